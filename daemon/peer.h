/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * A connected client: its connection, its credentials (SO_PEERCRED, its
 * groups, a pidfd), the holder (process) and user it speaks for, and what it
 * is charged for (the connection; a reply it has not read).
 *
 * Reading and answering are separate: a wake-up of the connection reads once
 * (at most VARLINK_MAX_REQUEST bytes) and, when a whole request is there,
 * queues the connection in the manager's fair queue (fair.h); the manager
 * serves one request per turn (peer_serve()). While a reply is still queued,
 * the connection's further requests wait (a client that does not read its
 * replies holds at most one reply in the daemon).
 *
 * An Alloc that waits for room (wait_usec) parks its connection: the call is
 * kept (AllocWait) with its place in the device's wait queue (wait.h), the
 * connection reads nothing more (further calls wait in its socket, as behind
 * an unread reply) and watches only for hangup, and the reply timer becomes
 * the wait's deadline. The manager tries it again when memory comes back
 * (peer_wait_try()); it is answered when served, when its deadline passes,
 * when its user's limits no longer allow it, or when the daemon stops; it
 * leaves the queue unanswered when its connection closes or its process
 * exits. One waiting call per connection: waiters are bounded by the
 * connections (MaxConnections=, MaxConnectionsTotal=).
 */

#include <stdbool.h>
#include <sys/socket.h>
#include <systemd/sd-event.h>

#include "broker.h"
#include "list.h"
#include "method.h"
#include "varlink.h"
#include "wait.h"

typedef struct Manager Manager;

#define PEER_REFUSED_PER_USER 8                         /* refused connections of one user told why at once */
#define PEER_REFUSED_TIMEOUT_USEC (UINT64_C(1000000))   /* a refused connection's time to ask and be told */

typedef struct Peer {
        Manager *manager;
        VarlinkConn *conn;
        sd_event_source *io;
        struct ucred cred;
        Caller caller;                  /* its holder, its user (a reference) and whether it is an administrator */
        UserCharge charge_connection;   /* empty for a refused connection */
        UserCharge charge_request;      /* while a reply is queued */
        bool refused;                   /* over one of its user's limits: answers QuotaExceeded, then closes */
        UserQuota refusal;              /* which one */
        bool waits_refused;             /* counted in its user's and the manager's refused connections */
        bool hangup;                    /* the client closed its end: its buffered requests are served, then
                                           the connection closes */
        sd_event_source *reply_timer;   /* closes the connection when a reply stays unread too long */
        List link;                      /* in Manager.peers */
        List link_ready;                /* in its user's ready_peers (fair.h) while a request waits */
        AllocWait *wait;                /* an Alloc waiting for room (parked): nothing more is read meanwhile */
        Waiter waiter;                  /* its place in its device's wait queue (Broker.waits) */
        List link_scrub;                /* or, for a scrub wait (AllocWait.scrub), in Broker.scrub_waiters */
        uint64_t wait_since;            /* when it began waiting (metrics_clock()) */
        bool wait_oneway;               /* the waiting call asked for no reply */
        char *host_call;                /* a Park waiting for host slabs being made or its copy, or an Unpark
                                           or Attach waiting for its copy (MethodReply.wait_host): its text,
                                           made again by peer_host_try(); nothing more is read meanwhile */
        HostWait host_wait;             /* what it waits for */
        uint64_t host_ticket;           /* for HOST_WAIT_MAKING: its host slabs' making (pool_make_done()) */
        size_t host_call_len;
        List link_host;                 /* while host_call: in Broker.host_waiters */
        bool watching;                  /* its WatchReclaim goes on: it reads nothing more, it is sent requests */
} Peer;

/*
 * Takes a just-accepted connection (closed on failure). A connection over its
 * user's MaxConnections= or MaxProcesses= is kept to answer QuotaExceeded to
 * its first call, within PEER_REFUSED_TIMEOUT_USEC, and closed; it takes no
 * slot of MaxConnectionsTotal=. At most PEER_REFUSED_PER_USER of a user's
 * wait so at once; further ones are closed at once (-EDQUOT). Returns 0 or a
 * negative errno.
 */
int peer_new(Manager *m, int fd);

/* Closes the connection. The holder's leases stay: they end when the process frees them or exits. */
Peer *peer_free(Peer *p);

/* Serves the peer's next request (its turn in the fair queue came); it may close the peer. */
void peer_serve(Peer *p);

/*
 * Makes again the call that waits (Peer.host_call), now that what it waits for moved: its host slabs were made
 * (pool_make_done()), with Caller.host_make_failed when a host slab of that making failed (pool_make_failed()), so that
 * it is answered with that failure rather than wait for making again; or a move
 * ended (broker_moves_ended()), with Caller.copy_waited too, so that it waits for nothing more but a copy
 * of its own still running. It is answered as any call; the connection then reads its next request. May free
 * `p` (and no other peer).
 */
void peer_host_try(Peer *p);

/* Answers the call that waits (method_wait_stopping()): the daemon stops before its host slabs are made or its
 * copy done. May free `p` (and no other peer). */
void peer_host_stopping(Peer *p);

/*
 * Tries the peer's waiting Alloc (`how`: ALLOC_TRY_AGAIN when memory came
 * back, ALLOC_TRY_EXPIRED at its deadline, ALLOC_TRY_STOPPING when the daemon
 * stops). Returns true when it goes on waiting; false when it was answered
 * (the connection reads again) or the peer was closed (its process has
 * exited, or sending failed).
 */
bool peer_wait_try(Peer *p, AllocTry how);

/*
 * Asks the process watching on `p` (WatchReclaim) to give back `l` within
 * `timeout_usec`: one more reply of its call. A watch that does not read its
 * requests is closed after ReplyTimeout=, like any unread reply. It may
 * close the peer (sending failed).
 */
void peer_reclaim_send(Peer *p, const Lease *l, uint64_t timeout_usec);

/* Closes the peer if it is waiting and its process has exited (it leaves the queue unanswered). */
void peer_wait_check_exited(Peer *p);
