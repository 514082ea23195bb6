/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * A connected client: its connection, its credentials (SO_PEERCRED) and the
 * holder (process) it speaks for. Requests are answered in order; while a
 * reply is still queued, the peer's further requests wait (a client that does
 * not read its replies holds at most one reply in the daemon).
 */

#include <sys/socket.h>
#include <systemd/sd-event.h>

#include "lease.h"
#include "list.h"
#include "varlink.h"

typedef struct Manager Manager;

typedef struct Peer {
        Manager *manager;
        VarlinkConn *conn;
        sd_event_source *io;
        struct ucred cred;
        bool admin;                     /* root or in the admin group when it connected: may List(all) */
        Holder *holder;
        User *user;                     /* the accounting of cred.uid */
        bool refused;                   /* over the user's MaxConnections: answers QuotaExceeded, then closes */
        bool charged_request;           /* a reply is queued: charged to the user as a request in flight */
        sd_event_source *reply_timer;   /* closes the connection when a reply stays unread too long */
        List link;                      /* in Manager.peers */
} Peer;

/* Takes a just-accepted connection (closed on failure). Returns 0 or a negative errno. */
int peer_new(Manager *m, int fd);

/* Closes the connection. The holder's leases stay: they end when the process frees them or exits. */
Peer *peer_free(Peer *p);
