/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The daemon's manager: one sd-event loop that owns the listening socket, the
 * connected peers, the fair queue that decides whose request is served next,
 * the pool's scrub completions and the holders' exits. Everything runs on
 * this one thread; a slow or stuck client only ever costs its own connection,
 * and a busy user only its own turns.
 *
 * What it wires: main.c -> manager.c -> peer.c -> method.c -> broker.c (the
 * rules) -> lease.c, holder.c, user.c, pool.c, store.c; restore.c rebuilds the
 * broker's table at start. No module below calls back into one above, but
 * peer.c into manager_serve_at_once().
 */

#include <stdbool.h>
#include <sys/types.h>
#include <systemd/sd-event.h>

#include "broker.h"
#include "driver.h"
#include "fair.h"
#include "list.h"
#include "pool.h"
#include "user.h"
#include "varlink.h"

#define MANAGER_DEFAULT_SOCKET "/run/vmmbroker/io.vmmbroker"
#define MANAGER_DEFAULT_REPLY_TIMEOUT_USEC (UINT64_C(30) * 1000000)
#define MANAGER_ALLOC_WAIT_OFF UINT64_MAX      /* ManagerConfig.max_alloc_wait_usec: MaxAllocWait=0, no waiting */
#define MANAGER_SCRUB_WAIT_NONE UINT64_MAX     /* ManagerConfig.scrub_wait_bytes: ScrubWaitBytes=0, no wait */

/*
 * ScrubWaitBytes=, by default: the most zeroing an Alloc waits for in the loop, 256 MiB, about 80 us on an
 * H100 or H200 (3.3 TB/s), while nobody else is served. An Alloc that needs memory behind more (its size's
 * slab just freed, room on a full device, its own kept lease) is parked until the zeroing's completion
 * reaches the loop (Broker.scrub_waiters, or its device's queue), which costs it that trip through the
 * driver's callback thread and the loop, 0.1-0.2 ms more on an H200 (docs/performance.md).
 */
#define MANAGER_DEFAULT_SCRUB_WAIT_BYTES (UINT64_C(256) << 20)

typedef struct ManagerConfig {
        const char *socket_path;        /* bound when systemd passed no socket; NULL = MANAGER_DEFAULT_SOCKET */
        PoolConfig pool;
        bool has_admin_group;           /* members of admin_gid are administrators (root always is) */
        gid_t admin_gid;
        LimitsConfig limits;            /* per user; must outlive the manager */
        uint64_t reply_timeout_usec;    /* a connection that leaves a reply unread this long is closed; 0 = default */
        unsigned max_connections_total; /* connections of all users at once; 0 = from the fd limit */
        uint64_t max_alloc_wait_usec;   /* the longest an Alloc may wait for room; 0 = the default (5 min),
                                           MANAGER_ALLOC_WAIT_OFF = none may */
        PlacementRule placement;        /* where an Alloc that names no single device goes (place.h) */
        uint64_t reclaim_timeout_usec;  /* ReclaimTimeout=: a holder's time to give a lease back; 0 = 5 s */
        uint64_t scrub_wait_bytes;      /* ScrubWaitBytes=; 0 = the default (MANAGER_DEFAULT_SCRUB_WAIT_BYTES),
                                           MANAGER_SCRUB_WAIT_NONE = every call whose zeroing is not done parks */
} ManagerConfig;

/* What MaxAllocWait= comes to, defaults and MANAGER_ALLOC_WAIT_OFF applied: the longest an Alloc may wait, 0 none. */
static inline uint64_t manager_max_alloc_wait_usec(const ManagerConfig *c) {
        return c->max_alloc_wait_usec == MANAGER_ALLOC_WAIT_OFF ? 0
                                                                 : c->max_alloc_wait_usec ?: BROKER_DEFAULT_MAX_ALLOC_WAIT_USEC;
}

/* What ScrubWaitBytes= comes to, defaults and MANAGER_SCRUB_WAIT_NONE applied: the most zeroing waited for, 0 none. */
static inline uint64_t manager_scrub_wait_bytes(const ManagerConfig *c) {
        return c->scrub_wait_bytes == MANAGER_SCRUB_WAIT_NONE ? 0 : c->scrub_wait_bytes ?: MANAGER_DEFAULT_SCRUB_WAIT_BYTES;
}

typedef struct Manager {
        sd_event *event;
        CudaDriver *cu;
        Pool *pool;
        Broker broker;                  /* leases, holders, users, the store: the rules (broker.h) */
        FairQueue fair;                 /* peers with a request waiting, by user (fair.h) */
        uint64_t reply_timeout_usec;
        int listen_fd;
        char *bound_path;               /* the socket we bound (and unlink at exit); NULL when inherited */
        sd_event_source *listen_source;
        sd_event_source *serve_source;  /* serves one round of the fair queue per wake-up */
        sd_event_source *pool_source;   /* scrub completions */
        sd_event_source *holder_source; /* holders' exits */
        sd_event_source *idle_source;   /* pool_idle(), snapshots, STATUS=, when nothing else is pending */
        sd_event_source *waiters_source; /* tries waiting Allocs when memory came back (Broker.waits) */
        sd_event_source *reclaim_timer; /* the earliest deadline of a lease asked back (reclaim.h) */
        sd_event_source *scrub_timer;   /* issues the pool's queued scrubs, SCRUB_DELAY_USEC after the first
                                           (scrubs_queued()) */
        uint64_t reclaim_timeout_usec;  /* ReclaimTimeout= */
        uint64_t *waiters_in_use;       /* per device: leased bytes when its first waiter last found no
                                           room (a request served since then tries it again only
                                           if that went down) */
        List peers;
        uint64_t scrubs_seen;           /* pool_scrubs_finished() when the waiters last looked */
        uint64_t hosts_seen;            /* pool_host_made() when the Parks waiting for it last looked */
        uint64_t moves_seen;            /* broker_moves_ended() when the Parks waiting for copies last looked */
        unsigned n_peers;               /* connections served (refused ones are not counted) */
        unsigned n_refused;             /* connections waiting to be told they are refused */
        unsigned max_connections_total; /* MaxConnectionsTotal=, resolved */
        bool storing;                   /* a service manager keeps slab fds and the table (restore.h) */
        uint64_t status_generation;     /* the table's generation the last STATUS= showed */
        int status_store_error;         /* and the store's error it showed */
        bool status_sent;
        uint64_t served;                /* requests served */
        const void *at_once_peer;       /* the connection last served as it was read (only compared) */
        uint64_t at_once_iteration;     /* and the loop iteration that did it (manager_serve_at_once()) */
        uint64_t served_at_tick;        /* at the last on_tick() */
        unsigned busy_ticks;            /* ticks in a row with requests served */
        bool has_admin_group;           /* members of admin_gid are administrators, as root is */
        gid_t admin_gid;
        VarlinkText reply_text;         /* the buffer replies are written in as text, kept between requests
                                           (method_reply_init()) */
} Manager;

/* Opens the driver, builds the pool, takes or binds the socket. Messages for a person go to *ret_message. */
int manager_new(Manager **ret, const ManagerConfig *config, char **ret_message);
Manager *manager_free(Manager *m);

/*
 * Serves the request the connection just read at once, rather than through the fair queue's next round,
 * when that cannot put anyone behind it: the queue is empty, and no other connection was served this way
 * in the loop's previous iteration. Returns whether it served (the peer may be gone then).
 */
struct Peer;
bool manager_serve_at_once(Manager *m, struct Peer *p);

/* Announces readiness to the service manager and runs until SIGTERM or SIGINT. */
int manager_run(Manager *m);
