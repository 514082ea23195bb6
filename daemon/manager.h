/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The daemon's manager: one sd-event loop that owns the listening socket, the
 * connected peers, the pool's scrub completions and the pidfds of the
 * processes holding leases. Everything runs on this one thread; a slow or
 * stuck client only ever costs its own connection.
 */

#include <stdbool.h>
#include <sys/types.h>
#include <systemd/sd-event.h>

#include "driver.h"
#include "lease.h"
#include "list.h"
#include "pool.h"
#include "user.h"

#define MANAGER_DEFAULT_SOCKET "/run/vmmbroker/io.vmmbroker"
#define MANAGER_DEFAULT_REPLY_TIMEOUT_USEC (UINT64_C(30) * 1000000)

typedef struct ManagerConfig {
        const char *socket_path;        /* bound when systemd passed no socket; NULL = MANAGER_DEFAULT_SOCKET */
        PoolConfig pool;
        bool has_admin_group;           /* members of admin_gid are administrators (root always is) */
        gid_t admin_gid;
        LimitsConfig limits;            /* per user; must outlive the manager */
        uint64_t reply_timeout_usec;    /* a connection that leaves a reply unread this long is closed; 0 = default */
} ManagerConfig;

typedef struct Manager {
        sd_event *event;
        CudaDriver *cu;
        Pool *pool;
        LeaseTable leases;
        UserRegistry users;
        uint64_t reply_timeout_usec;
        int listen_fd;
        char *bound_path;               /* the socket we bound (and unlink at exit); NULL when inherited */
        sd_event_source *listen_source;
        sd_event_source *pool_source;   /* scrub completions */
        sd_event_source *idle_source;   /* pool_idle(), when nothing else is pending */
        int holder_epoll_fd;            /* the holders' pidfds */
        sd_event_source *holder_source;
        List peers;
        unsigned n_peers;
        bool status_dirty;              /* the STATUS= line is out of date */
        bool storing;                   /* a service manager keeps slab fds and the state (restore.h) */
        bool state_dirty;               /* the lease table changed since it was last stored */
        uint64_t state_generation;      /* of the last state stored */
        bool has_admin_group;           /* members of admin_gid are administrators, as root is */
        gid_t admin_gid;
} Manager;

/* Opens the driver, builds the pool, takes or binds the socket. Messages for a person go to *ret_message. */
int manager_new(Manager **ret, const ManagerConfig *config, char **ret_message);
Manager *manager_free(Manager *m);

/* Announces readiness to the service manager and runs until SIGTERM or SIGINT. */
int manager_run(Manager *m);

/* Schedules pool_idle() for when the loop has nothing else to do. */
void manager_schedule_idle(Manager *m);

/* Starts watching a new holder's pidfd; when it becomes readable the holder's leases are reclaimed. */
int manager_watch_holder(Manager *m, Holder *h);

/*
 * Handles a holder's exit: stops watching it, drops its holds (ending the leases nobody else holds or
 * published) and forgets it once no connection refers to it. Returns how many holds it dropped.
 */
unsigned manager_holder_exited(Manager *m, Holder *h);

/* Reclaims the holds of every holder whose process has exited. Returns how many. */
unsigned manager_reap_holders(Manager *m);

/* Called by a peer that goes away: frees its holder when nothing else refers to it. */
void manager_release_holder(Manager *m, Holder *h);

/* Marks the STATUS= line shown by systemctl status out of date; it is sent when the loop is idle. */
void manager_notify_status(Manager *m);
