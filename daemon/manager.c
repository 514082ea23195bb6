/* SPDX-License-Identifier: MIT */

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <libgen.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include "macro.h"
#include "manager.h"
#include "message.h"
#include "metrics.h"
#include "peer.h"
#include "restore.h"
#include "size.h"

/* MaxConnectionsTotal= when not set: from the fd limit (each connection costs a socket, and a pidfd per
 * process), leaving the rest to slabs. */
static unsigned default_max_connections_total(void) {
        struct rlimit rl;

        if (getrlimit(RLIMIT_NOFILE, &rl) < 0 || rl.rlim_cur == RLIM_INFINITY)
                return 65536;
        return (unsigned)MIN(MAX(rl.rlim_cur / 4, (rlim_t)64), (rlim_t)65536);
}

/* Holder exits are handled before requests, so a request never sees a dead process's leases. */
#define PRIORITY_HOLDER_EXIT (-10)
#define PRIORITY_SCRUB (-5)
/* Waiting Allocs are tried when memory came back (scrubs completed, holders exited), before any new
 * request is served: what comes back goes to those who waited first. */
#define PRIORITY_WAITERS (-4)
/*
 * Serving comes after reading (SD_EVENT_PRIORITY_NORMAL): a wake-up of a connection only reads, once, and a
 * connection with a request buffered is not woken again until it is served, so reading is bounded by the
 * connections. A defer source stays pending while it is enabled and sd-event serves older pending sources
 * first: at the same priority as reading, the fair queue would run before any other connection is read.
 */
#define PRIORITY_SERVE 1

/*
 * How long the scrub of a freed slab waits before it is issued. A client unmaps a lease after it sent the
 * lease's Free, while the answer is on the way (libvmmbroker's FreeUnmap), and a scrub running on the device
 * meanwhile slows that unmap: on H200s by 15-45% at 2-4 GiB, and up to twice over for small leases
 * (docs/performance.md, "Scrubs issued after the client's unmap"). 500 us is longer than an H100's or H200's
 * unmap of 8 GiB. What waits is only memory no request has asked for yet: an Alloc that misses its cache issues
 * the device's queued scrubs at once (pool.h), and a freed slab is nobody else's until it is scrubbed anyway.
 */
#define SCRUB_DELAY_USEC 500

static int bind_socket(const char *path, char **ret_message) {
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        _cleanup_close_ int fd = -EBADF;
        _cleanup_free_ char *dir = NULL;

        if (strlen(path) >= sizeof(sa.sun_path)) {
                set_message(ret_message, "Socket path %s is longer than %zu bytes.", path, sizeof(sa.sun_path) - 1);
                return -ENAMETOOLONG;
        }
        strcpy(sa.sun_path, path);

        dir = strdup(path);
        if (!dir)
                return -ENOMEM;
        if (mkdir(dirname(dir), 0755) < 0 && errno != EEXIST) {
                set_message(ret_message, "Cannot create the socket's directory for %s: %s.", path, strerror(errno));
                return -errno;
        }

        fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0)
                return -errno;
        if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
                _cleanup_close_ int probe = -EBADF;

                if (errno != EADDRINUSE) {
                        set_message(ret_message, "Cannot bind %s: %s.", path, strerror(errno));
                        return -errno;
                }
                /* Someone serving there, or a stale socket left by a daemon that died? */
                probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
                if (probe >= 0 && connect(probe, (struct sockaddr *)&sa, sizeof(sa)) == 0) {
                        set_message(ret_message, "Another daemon is serving %s; stop it first.", path);
                        return -EADDRINUSE;
                }
                if (unlink(path) < 0 || bind(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
                        set_message(ret_message, "Cannot bind %s: %s.", path, strerror(errno));
                        return -errno;
                }
        }
        if (listen(fd, SOMAXCONN) < 0)
                return -errno;
        return TAKE_FD(fd);
}

/* Runs pool_idle(), snapshots and STATUS= when the loop has nothing else to do. */
static void schedule_idle(Manager *m) {
        (void)sd_event_source_set_enabled(m->idle_source, SD_EVENT_ONESHOT);
}

/* Issues the scrubs queued since the timer was armed (scrubs_queued()). */
static int on_scrub_timer(sd_event_source *s, uint64_t usec, void *userdata) {
        Manager *m = userdata;

        metrics_loop_source(METRICS_LOOP_SCRUB);
        pool_scrub_queued(m->pool);
        return 0;
}

/*
 * The pool's scrub queue was empty and is not (pool_set_queued_hook()), whatever queued it: a Free, an exited
 * holder, a reclaim, a failed request giving back. Every queued scrub is so issued at most SCRUB_DELAY_USEC
 * after it was queued. When the timer cannot be armed, at once.
 */
static void scrubs_queued(void *userdata) {
        Manager *m = userdata;

        if (sd_event_source_set_time_relative(m->scrub_timer, SCRUB_DELAY_USEC) < 0 ||
            sd_event_source_set_enabled(m->scrub_timer, SD_EVENT_ONESHOT) < 0)
                pool_scrub_queued(m->pool);
}

/* Whether STATUS= says what it should (with table_too, the lease table's counts as well). */
static bool status_is_current(const Manager *m, bool table_too) {
        return m->status_sent && m->status_store_error == m->broker.store_error &&
               (!table_too || m->status_generation == m->broker.leases.generation);
}

/*
 * Whether on_idle() would do anything. After a request that changed nothing (a Status, a List) it would
 * not, and scheduling it anyway cost every such request another turn of the loop: a poll of its own and
 * sd-event's bookkeeping around it. A new kind of idle work goes in on_idle() and here, through its owner's
 * predicate, or it waits for the next request that has other idle work, or for on_tick().
 */
static bool idle_has_work(const Manager *m) {
        return pool_has_idle_work(m->pool) || broker_has_idle_work(&m->broker) || !status_is_current(m, false);
}

/*
 * Waiting Allocs served per device per wake-up: a loop that serves a burst of waiters still polls between
 * bursts (each serve is an Alloc and a reply). When the burst is used up the source runs again.
 */
#define WAITERS_PER_WAKEUP 16

/*
 * Has device i's memory leased gone down since its first waiter last found no room? (Memory being scrubbed
 * is room: an Alloc waits for the scrubs it needs, pool.h.)
 */
static bool waiters_may_fit(Manager *m, size_t i) {
        PoolDeviceStats s;

        if (!wait_queue_first(&m->broker.waits[i]))
                return false;
        pool_device_stats(m->pool, i, &s);
        return m->waiters_in_use[i] == 0 || s.leased < m->waiters_in_use[i];
}

static void reclaim_for_head(Manager *m, size_t i);

/*
 * Tries the waiting Allocs of every device in turn (wait.h): the first waiter, then the next while each is
 * served. The turn is strict: a first waiter that does not fit stops its device's queue. `all`: every
 * device; else only those whose memory in use went down since their first waiter last tried.
 */
static void serve_waiters(Manager *m, bool all) {
        for (size_t i = 0; i < pool_n_devices(m->pool); i++) {
                WaitQueue *q = &m->broker.waits[i];
                unsigned n = 0;
                Waiter *w;

                if (!all && !waiters_may_fit(m, i))
                        continue;
                while ((w = wait_queue_first(q))) {
                        PoolDeviceStats s;

                        if (n++ == WAITERS_PER_WAKEUP) {
                                (void)sd_event_source_set_enabled(m->waiters_source, SD_EVENT_ONESHOT);
                                break;
                        }
                        if (!peer_wait_try(container_of(w, Peer, waiter), ALLOC_TRY_AGAIN))
                                continue;
                        pool_device_stats(m->pool, i, &s);
                        m->waiters_in_use[i] = s.leased;
                        break;
                }
        }
        /* Whose call still waits at the head may get room from reclaimable leases. */
        for (size_t i = 0; i < pool_n_devices(m->pool); i++)
                reclaim_for_head(m, i);
}

/* Leases asked back per device per try: enough for any request, a bound on one wake-up's work. */
#define RECLAIM_PICK_MAX 64

/* Arms the reclaim timer at the earliest deadline of a lease asked back, or stops it. */
static void reclaim_arm(Manager *m) {
        uint64_t next = reclaim_next_deadline(&m->broker.leases.reclaim);

        if (next == UINT64_MAX) {
                (void)sd_event_source_set_enabled(m->reclaim_timer, SD_EVENT_OFF);
                return;
        }
        (void)sd_event_source_set_time(m->reclaim_timer, next);
        (void)sd_event_source_set_enabled(m->reclaim_timer, SD_EVENT_ONESHOT);
}

/*
 * Asks holders of reclaimable leases for room for the call at the head of device i's wait queue (the one
 * whose turn it is: the turn is strict, so room for anyone else would not serve it): as many bytes as it
 * needs beyond the room the device has (capacity less what is leased: slabs being scrubbed come back, other
 * users' cached slabs are released to make room) and the bytes asked already. Which leases: reclaim.h's
 * order, as broker_reclaim_pick() allows.
 */
static void reclaim_for_head(Manager *m, size_t i) {
        ReclaimSet *rs = &m->broker.leases.reclaim;
        Waiter *w = wait_queue_first(&m->broker.waits[i]);
        Lease *picked[RECLAIM_PICK_MAX];
        uint64_t need, room, now;
        PoolDeviceStats s;
        Peer *head;
        size_t n;

        if (!w || list_is_empty(&rs->marked[i]))
                return;
        head = container_of(w, Peer, waiter);
        pool_device_stats(m->pool, i, &s);
        need = head->wait->params.size;
        if (s.granularity > 0)
                need = (need + s.granularity - 1) / s.granularity * s.granularity;
        room = s.capacity > s.leased ? s.capacity - s.leased : 0;
        if (need <= room + rs->asked_bytes[i])
                return;
        n = broker_reclaim_pick(&m->broker, i, need - room - rs->asked_bytes[i], head->caller.holder, picked,
                                ELEMENTSOF(picked));
        if (n == 0 || sd_event_now(m->event, CLOCK_MONOTONIC, &now) < 0)
                return;
        for (size_t j = 0; j < n; j++) {
                Hold *hold, *tmp;

                reclaim_ask(rs, picked[j], now + m->reclaim_timeout_usec);
                /* Sending may close a watch (its holder stays: the request is then left to the deadline). */
                list_for_each_entry_safe(hold, tmp, &picked[j]->holds, link_lease)
                        if (hold->holder->watch)
                                peer_reclaim_send(hold->holder->watch, picked[j], m->reclaim_timeout_usec);
        }
        reclaim_arm(m);
}

/* The deadline of a lease asked back passed: it is unresponsive, and the next leases are asked. */
static int on_reclaim_timer(sd_event_source *s, uint64_t usec, void *userdata) {
        Manager *m = userdata;
        uint64_t now = usec;

        metrics_loop_source(METRICS_LOOP_RECLAIM);
        (void)sd_event_now(m->event, CLOCK_MONOTONIC, &now);
        if (reclaim_expire(&m->broker.leases.reclaim, now) > 0)
                for (size_t i = 0; i < pool_n_devices(m->pool); i++)
                        reclaim_for_head(m, i);
        reclaim_arm(m);
        return 0;
}

/* Memory may have come back: try the waiters once the loop gets there (PRIORITY_WAITERS). */
static void wake_waiters(Manager *m) {
        (void)sd_event_source_set_enabled(m->waiters_source, SD_EVENT_ONESHOT);
}

static int on_waiters(sd_event_source *s, void *userdata) {
        metrics_loop_source(METRICS_LOOP_WAITERS);
        serve_waiters(userdata, true);
        return 0;
}

static void check_waiter_exited(Waiter *w, void *userdata) {
        peer_wait_check_exited(container_of(w, Peer, waiter));
}

/*
 * Connections accepted per wake-up of the listening socket. A user reconnecting as fast as it can keeps
 * the socket readable, and sd-event serves the readable sources before the fair queue (PRIORITY_SERVE):
 * so after a full batch the socket is left alone until the queue has had a round (on_serve() turns it
 * back on). Accepting and serving take turns, and a connection flood delays nobody's requests.
 */
#define ACCEPTS_PER_WAKEUP 8

static int on_accept(sd_event_source *s, int fd, uint32_t revents, void *userdata) {
        Manager *m = userdata;

        metrics_loop_source(METRICS_LOOP_ACCEPT);
        for (unsigned i = 0;; i++) {
                if (i == ACCEPTS_PER_WAKEUP) {
                        (void)sd_event_source_set_enabled(s, SD_EVENT_OFF);
                        (void)sd_event_source_set_enabled(m->serve_source, SD_EVENT_ON);
                        return 0;
                }
                int cfd = accept4(fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);

                if (cfd < 0) {
                        if (errno == EAGAIN || errno == EINTR)
                                return 0;
                        if (errno == EMFILE || errno == ENFILE) {
                                fprintf(stderr, "Failed to accept a connection: %m; refusing connections until "
                                                "one closes\n");
                                return 0;
                        }
                        fprintf(stderr, "Failed to accept a connection: %m, ignoring\n");
                        return 0;
                }
                (void)peer_new(m, cfd);         /* which closes it if it cannot be served or told why */
        }
        return 0;
}

/*
 * Makes again the calls that wait for `what`, in the order they came, each once: they are taken off the
 * broker's list first, so that one that waits again (an Unpark whose lease a Park just parked starts its own
 * copy) goes back to the list's tail without being tried again in this pass, which would never end.
 */
static void host_waiters_try(Manager *m, HostWait what) {
        List now = LIST_INIT(now);
        Peer *p, *tmp;

        list_for_each_entry_safe(p, tmp, &m->broker.host_waiters, link_host)
                if (p->host_wait == what &&
                    (what != HOST_WAIT_MAKING || pool_make_done(m->pool, p->host_ticket))) {
                        list_unlink(&p->link_host);
                        list_link_tail(&now, &p->link_host);
                }
        while ((p = list_first_entry(&now, Peer, link_host)))
                peer_host_try(p);       /* takes p off `now`; may free p, no other peer */
}

/*
 * Scrubs have finished since the waiters last looked (pool_scrubs_finished(): by the completions' dispatch, or
 * ahead of it by a request that waited for them or a park's copy, which the dispatch then does not see again).
 * The Allocs parked for scrubs are tried, oldest first: each is served, refused, or goes on waiting (its scrubs
 * are not all done); a call that asked for no wait takes whatever room there is when it comes, outside the
 * devices' turns (wait.h), and these are such calls. And the memory scrubbed is cached, room for whoever waits.
 * The calls waiting for memory being zeroed (a Park's host slabs, an Unpark's or Attach's device memory) are made
 * again too; none gives device memory back before its copy, so the waiters' pass that wake_waiters() schedules
 * is all the Allocs need.
 */
static void scrubs_finished(Manager *m) {
        uint64_t finished = pool_scrubs_finished(m->pool);
        Peer *p, *tmp;

        if (finished == m->scrubs_seen)
                return;
        m->scrubs_seen = finished;
        list_for_each_entry_safe(p, tmp, &m->broker.scrub_waiters, link_scrub)
                (void)peer_wait_try(p, ALLOC_TRY_AGAIN);        /* may free p, no other peer */
        host_waiters_try(m, HOST_WAIT_ZEROING);                 /* calls whose memory was being zeroed */
        wake_waiters(m);
}

/* Parks waiting for host slabs are made again once theirs are made (pool_make_done()), each taking the slabs
 * made for it, in order: one park's few slabs are not held back by another user's many (the maker takes users
 * in turn). What they left of them (their caller went away meanwhile) is anyone's then (pool_unbind_made()). */
static void hosts_made(Manager *m) {
        uint64_t made = pool_host_made(m->pool);

        if (made == m->hosts_seen)
                return;
        m->hosts_seen = made;
        host_waiters_try(m, HOST_WAIT_MAKING);
        (void)pool_unbind_made(m->pool);
        serve_waiters(m, false);        /* a park gives device memory back */
}

/*
 * Moves whose copy is done are committed; then, once any move ended (committed, or cancelled by a request or
 * an exit), the Parks waiting for copies are made again: each finds its lease parked, or as it is now.
 */
static void moves_ended(Manager *m) {
        uint64_t ended;

        (void)broker_finish_moves(&m->broker);
        ended = broker_moves_ended(&m->broker);
        if (ended == m->moves_seen)
                return;
        m->moves_seen = ended;
        host_waiters_try(m, HOST_WAIT_COPYING);
        serve_waiters(m, false);        /* a park gives device memory back */
}

/* What follows serving requests, in a round or at once. */
static void served(Manager *m) {
        /* A Free, an Unpublish, a scrub that failed may have given memory back at once. */
        serve_waiters(m, false);
        scrubs_finished(m);             /* a request may have finished scrubs ahead of their dispatch */
        hosts_made(m);                  /* and dispatched made host slabs */
        moves_ended(m);                 /* or cancelled a park's copy, or saw it done */
        /* A round has been served: new connections may come in again (on_accept()). */
        (void)sd_event_source_set_enabled(m->listen_source, SD_EVENT_ON);
        if (idle_has_work(m))
                schedule_idle(m);       /* released slabs' fds are closed there, STATUS= sent */
}

/*
 * One round of the fair queue: each user with a request waiting gets one
 * request served (fair.h), then the loop polls again, so that new
 * connections, other users' requests and holders' exits are seen between
 * rounds.
 */
static int on_serve(sd_event_source *s, void *userdata) {
        Manager *m = userdata;
        unsigned n = m->fair.n_users;

        metrics_loop_source(METRICS_LOOP_SERVE);
        for (unsigned i = 0; i < n && !fair_queue_is_empty(&m->fair); i++) {
                List *link = fair_queue_pop(&m->fair);

                peer_serve(container_of(link, Peer, link_ready));
                m->served++;
        }
        if (fair_queue_is_empty(&m->fair))
                (void)sd_event_source_set_enabled(s, SD_EVENT_OFF);
        served(m);
        return 0;
}

/*
 * The quiet case, one client at a time asking and waiting for each reply, is most requests: there, going
 * through the queue costs a loop iteration and two changes of the connection's epoll events per request,
 * syscalls that made a Status 3x a bare socket round trip on the H100 machine (docs/performance.md).
 * Fairness is kept: sd-event dispatches one source per iteration, so connections that became readable
 * together are dispatched in consecutive iterations; the first is served as it is read, the next ones
 * (another connection, in the very next iteration) are queued, and once anyone is queued everyone is,
 * until a round of the queue has served them. A lone client is served at once request after request.
 */
bool manager_serve_at_once(Manager *m, struct Peer *p) {
        uint64_t iteration = 0;

        (void)sd_event_get_iteration(m->event, &iteration);
        if (!fair_queue_is_empty(&m->fair) || (m->at_once_peer != p && m->at_once_iteration + 1 >= iteration))
                return false;
        m->at_once_peer = p;
        m->at_once_iteration = iteration;
        peer_serve(p);
        m->served++;
        served(m);
        return true;
}

static int on_pool(sd_event_source *s, int fd, uint32_t revents, void *userdata) {
        Manager *m = userdata;

        metrics_loop_source(METRICS_LOOP_DEVICE);
        if (pool_dispatch(m->pool) > 0)
                schedule_idle(m);
        scrubs_finished(m);
        hosts_made(m);
        moves_ended(m);
        return 0;
}

static int on_holder_exit(sd_event_source *s, int fd, uint32_t revents, void *userdata) {
        Manager *m = userdata;
        Peer *p, *tmp;

        metrics_loop_source(METRICS_LOOP_HOLDER_EXIT);
        broker_reap_holders(&m->broker);
        /* A waiting call of an exited process leaves its queue unanswered; its memory came back too. */
        for (size_t i = 0; i < pool_n_devices(m->pool); i++)
                wait_queue_for_each(&m->broker.waits[i], check_waiter_exited, NULL);
        list_for_each_entry_safe(p, tmp, &m->broker.scrub_waiters, link_scrub)
                peer_wait_check_exited(p);
        moves_ended(m);                 /* an exited process's park being copied ended with its hold */
        wake_waiters(m);
        schedule_idle(m);
        return 0;
}

/*
 * The STATUS= line. It is a message to the service manager, so it is not sent per request: storing that
 * starts to fail is sent at once (store_failing(), before the refused request is answered), its other
 * changes when the loop is next idle; a change of the table once a second has passed
 * with no request served, or after a minute of them (on_tick()), so that a busy daemon sends about nothing
 * (bench-scale counts the messages).
 */
static void send_status(Manager *m, bool table_too) {
        const LeaseTable *t = &m->broker.leases;
        uint64_t leased = 0, cached = 0;
        char b1[FORMAT_SIZE_MAX], b2[FORMAT_SIZE_MAX];

        if (status_is_current(m, table_too))
                return;
        for (size_t i = 0; i < pool_n_devices(m->pool); i++) {
                PoolDeviceStats s;

                pool_device_stats(m->pool, i, &s);
                leased += s.leased;
                cached += s.cached;
        }
        if (m->broker.store_error < 0)
                (void)sd_notifyf(false, "STATUS=Storing the lease table for restarts failed (%s): changes are "
                                 "refused until it works again; %u leases (%s)",
                                 strerror(-m->broker.store_error), t->n_leases, format_size(leased, b1, sizeof(b1)));
        else
                (void)sd_notifyf(false, "STATUS=%u leases (%s, %u published), %s cached, %u clients", t->n_leases,
                                 format_size(leased, b1, sizeof(b1)), t->n_published,
                                 format_size(cached, b2, sizeof(b2)), m->n_peers);
        m->status_generation = t->generation;
        m->status_store_error = m->broker.store_error;
        m->status_sent = true;
}

/* The broker found that storing fails: say so before it answers the request that found it. */
static void store_failing(void *userdata) {
        send_status(userdata, false);
}

static int on_idle(sd_event_source *s, void *userdata) {
        Manager *m = userdata;
        int old = m->broker.store_error;

        metrics_loop_source(METRICS_LOOP_IDLE);
        /* Keep trying what could not be stored: a table to start from, exited holders' holds. */
        if (broker_store_snapshot(&m->broker, false) < 0 && old == 0)
                fprintf(stderr, "Failed to store the lease table: %s; changes are refused until it works again.\n",
                        strerror(-m->broker.store_error));
        if (broker_has_unreaped(&m->broker))
                broker_reap_holders(&m->broker);
        pool_idle(m->pool);     /* after reaping: the fds of what it gave back */
        if (old < 0 && m->broker.store_error == 0)
                fprintf(stderr, "Storing the lease table works again.\n");
        send_status(m, false);
        /* The pool maps slabs ahead one per call, each a dispatch of its own, requests served between them. */
        if (pool_has_idle_work(m->pool))
                schedule_idle(m);
        return 0;
}

static int on_signal(sd_event_source *s, const struct signalfd_siginfo *si, void *userdata) {
        Manager *m = userdata;

        metrics_loop_source(METRICS_LOOP_SIGNAL);
        return sd_event_exit(m->event, 0);
}

/*
 * Every second: while storing fails, try again even if nothing else wakes the loop; compact the store and
 * close released slabs' fds even when a busy loop is never idle; and say what changed in STATUS=.
 */
static int on_tick(sd_event_source *s, uint64_t usec, void *userdata) {
        Manager *m = userdata;

        metrics_loop_source(METRICS_LOOP_TICK);
        if (m->broker.store_error < 0 || broker_has_unreaped(&m->broker))
                schedule_idle(m);
        else
                (void)broker_store_snapshot(&m->broker, false);
        if (m->served == m->served_at_tick || ++m->busy_ticks >= 60) {
                send_status(m, true);
                m->busy_ticks = 0;
        }
        m->served_at_tick = m->served;
        /* Released slabs' fds are closed (their memory given back to the driver) when the loop is idle; a loop
         * that requests keep busy is never idle, so also here, at least once a second. The tick also makes
         * the slabs of a second ago due to be mapped ahead, in the idle dispatches that follow. */
        pool_tick(m->pool);
        (void)pool_idle(m->pool);
        if (pool_has_idle_work(m->pool))
                schedule_idle(m);
        wake_waiters(m);                /* the driver's memory may have come back from outside the pool */
        (void)sd_event_source_set_time_relative(s, 1000000);
        return 0;
}

Manager *manager_free(Manager *m) {
        Peer *p, *tmp;

        if (!m)
                return NULL;
        if (m->pool)
                pool_set_queued_hook(m->pool, NULL, NULL);      /* the scrub timer goes below */
        list_for_each_entry_safe(p, tmp, &m->peers, link)
                peer_free(p);
        if (m->pool)
                broker_done(&m->broker);        /* broker_init() comes right after pool_new() */
        sd_event_source_disable_unref(m->holder_source);
        sd_event_source_disable_unref(m->listen_source);
        sd_event_source_disable_unref(m->serve_source);
        sd_event_source_disable_unref(m->pool_source);
        sd_event_source_disable_unref(m->idle_source);
        sd_event_source_disable_unref(m->waiters_source);
        sd_event_source_disable_unref(m->reclaim_timer);
        sd_event_source_disable_unref(m->scrub_timer);
        free(m->waiters_in_use);
        varlink_text_done(&m->reply_text);
        if (m->bound_path) {
                (void)unlink(m->bound_path);
                free(m->bound_path);
        }
        safe_close(m->listen_fd);
        pool_free(m->pool);
        cuda_driver_close(m->cu);
        sd_event_unref(m->event);
        free(m);
        return NULL;
}

DEFINE_TRIVIAL_CLEANUP_FUNC(Manager, manager_free);

static int manager_add_sources(Manager *m) {
        sd_event_source *tick = NULL;
        int k;

        k = sd_event_add_io(m->event, &m->holder_source, holder_registry_get_fd(&m->broker.holders), EPOLLIN,
                            on_holder_exit, m);
        if (k >= 0)
                k = sd_event_source_set_priority(m->holder_source, PRIORITY_HOLDER_EXIT);
        if (k >= 0)
                k = sd_event_add_io(m->event, &m->listen_source, m->listen_fd, EPOLLIN, on_accept, m);
        if (k >= 0)
                k = sd_event_add_defer(m->event, &m->serve_source, on_serve, m);
        if (k >= 0)
                k = sd_event_source_set_priority(m->serve_source, PRIORITY_SERVE);
        if (k >= 0)
                k = sd_event_source_set_enabled(m->serve_source, SD_EVENT_OFF);
        if (k >= 0)
                k = sd_event_add_io(m->event, &m->pool_source, pool_get_fd(m->pool), EPOLLIN, on_pool, m);
        if (k >= 0)
                k = sd_event_source_set_priority(m->pool_source, PRIORITY_SCRUB);
        if (k >= 0)
                k = sd_event_add_defer(m->event, &m->idle_source, on_idle, m);
        if (k >= 0)
                k = sd_event_source_set_priority(m->idle_source, SD_EVENT_PRIORITY_IDLE);
        if (k >= 0)
                k = sd_event_source_set_enabled(m->idle_source, SD_EVENT_OFF);
        if (k >= 0)
                k = sd_event_add_defer(m->event, &m->waiters_source, on_waiters, m);
        if (k >= 0)
                k = sd_event_source_set_priority(m->waiters_source, PRIORITY_WAITERS);
        if (k >= 0)
                k = sd_event_source_set_enabled(m->waiters_source, SD_EVENT_OFF);
        if (k >= 0)
                k = sd_event_add_time(m->event, &m->reclaim_timer, CLOCK_MONOTONIC, UINT64_MAX, 0, on_reclaim_timer,
                                      m);
        if (k >= 0)
                k = sd_event_source_set_enabled(m->reclaim_timer, SD_EVENT_OFF);
        if (k >= 0)     /* accurate to 1 us: sd-event's default would let it wait up to 250 ms */
                k = sd_event_add_time(m->event, &m->scrub_timer, CLOCK_MONOTONIC, UINT64_MAX, 1, on_scrub_timer,
                                      m);
        if (k >= 0)
                k = sd_event_source_set_priority(m->scrub_timer, PRIORITY_SCRUB);
        if (k >= 0)
                k = sd_event_source_set_enabled(m->scrub_timer, SD_EVENT_OFF);
        if (k >= 0)     /* from here on; what restoring queued is told at once */
                pool_set_queued_hook(m->pool, scrubs_queued, m);
        if (k >= 0)
                k = sd_event_add_time_relative(m->event, &tick, CLOCK_MONOTONIC, 1000000, 0, on_tick, m);
        if (k >= 0)
                k = sd_event_source_set_enabled(tick, SD_EVENT_ON);
        if (k >= 0)
                (void)sd_event_source_set_floating(tick, true);
        sd_event_source_unref(tick);
        return k;
}

int manager_new(Manager **ret, const ManagerConfig *config, char **ret_message) {
        _cleanup_(inherited_done) Inherited in = INHERITED_NULL;
        _cleanup_(manager_freep) Manager *m = NULL;
        const char *path = config->socket_path ?: MANAGER_DEFAULT_SOCKET;
        bool restored_table;
        sigset_t mask;
        int k;

        m = calloc(1, sizeof(*m));
        if (!m)
                return -ENOMEM;
        m->listen_fd = -EBADF;
        list_init(&m->peers);
        fair_queue_init(&m->fair);
        m->has_admin_group = config->has_admin_group;
        m->admin_gid = config->admin_gid;
        m->reply_timeout_usec = config->reply_timeout_usec ?: MANAGER_DEFAULT_REPLY_TIMEOUT_USEC;
        m->max_connections_total = config->max_connections_total ?: default_max_connections_total();
        m->reclaim_timeout_usec = config->reclaim_timeout_usec ?: RECLAIM_DEFAULT_TIMEOUT_USEC;

        /* A loop of its own, not the thread's default: sd_event_prepare() checks the default loop's thread
         * with a gettid() on every iteration, two system calls per request. */
        k = sd_event_new(&m->event);
        if (k < 0)
                return k;
        /* Whatever started us may have left these ignored, and an ignored signal never reaches the signalfd. */
        (void)signal(SIGTERM, SIG_DFL);
        (void)signal(SIGINT, SIG_DFL);
        sigemptyset(&mask);
        sigaddset(&mask, SIGTERM);
        sigaddset(&mask, SIGINT);
        sigprocmask(SIG_BLOCK, &mask, NULL);
        (void)signal(SIGPIPE, SIG_IGN);
        k = sd_event_add_signal(m->event, NULL, SIGTERM, on_signal, m);
        if (k >= 0)
                k = sd_event_add_signal(m->event, NULL, SIGINT, on_signal, m);
        if (k < 0)
                return k;
        (void)sd_event_set_watchdog(m->event, true);

        /* What the service manager passed: the socket, and what an earlier run stored. */
        k = inherited_take(&in, ret_message);
        if (k < 0)
                return k;
        k = cuda_driver_open(&m->cu, NULL, ret_message);
        if (k < 0)
                return k;
        k = pool_new(&m->pool, m->cu, &config->pool, ret_message);
        if (k < 0)
                return k;
        k = broker_init(&m->broker, m->pool, &config->limits);
        if (k < 0)
                return k;
        m->broker.max_alloc_wait_usec = manager_max_alloc_wait_usec(config);
        m->broker.kept_wait_usec = m->reclaim_timeout_usec;    /* kept leases are asked back within it */
        m->broker.scrub_wait_bytes = manager_scrub_wait_bytes(config);
        m->broker.placement = config->placement;
        m->broker.store_failing = store_failing;
        m->broker.store_failing_userdata = m;
        if (config->placement == PLACEMENT_NEAREST) {
                /* Read once: which CPU is on which NUMA node. */
                const char *root = getenv(PLACEMENT_SYSFS_ROOT_ENV);

                k = numa_map_load(&m->broker.numa, root && *root ? root : "/sys");
                if (k < 0) {
                        numa_map_done(&m->broker.numa);
                        if (k == -ENOMEM)
                                return k;
                        fprintf(stderr, "Cannot read the NUMA nodes' CPUs in %s/devices/system/node: %s; "
                                "Placement=nearest places as most-free.\n", root && *root ? root : "/sys",
                                strerror(-k));
                }
        }
        m->waiters_in_use = calloc(pool_n_devices(m->pool) ?: 1, sizeof(uint64_t));
        if (!m->waiters_in_use)
                return -ENOMEM;
        k = restore_start_storing(m, ret_message);
        if (k < 0)
                return k;

        k = in.socket;
        in.socket = -EBADF;
        if (k < 0) {
                k = bind_socket(path, ret_message);
                if (k >= 0) {
                        m->bound_path = strdup(path);
                        if (!m->bound_path) {
                                safe_close(k);
                                return -ENOMEM;
                        }
                }
        }
        if (k < 0)
                return k;
        m->listen_fd = k;

        restored_table = in.table_fd >= 0;
        k = restore_leases(m, &in);
        if (k < 0)
                return k;
        metrics_started(restored_table && m->broker.leases.n_leases > 0, m->broker.leases.n_leases);
        /* After the leases restored, whose parked host slabs count: off the loop, while it serves. */
        k = pool_reserve_host(m->pool);
        if (k < 0)
                fprintf(stderr, "Could not start making the host memory of HostReserve=: %s. Parks make it as they "
                        "need it.\n", strerror(-k));
        k = manager_add_sources(m);
        if (k < 0)
                return k;

        *ret = TAKE_PTR(m);
        return 0;
}

/*
 * sd_event_loop(), each dispatch timed: one dispatch runs one source's handler, and nobody else is served
 * until it returns (vmmbroker_loop_dispatch_seconds, by the handler's metrics_loop_source()). Returns the
 * exit code, or a failure of sd-event.
 */
static int loop_run(sd_event *e) {
        int k, code = 0;

        while (sd_event_get_state(e) != SD_EVENT_FINISHED) {
                k = sd_event_prepare(e);
                if (k == 0)
                        k = sd_event_wait(e, UINT64_MAX);
                if (k > 0) {
                        uint64_t start = metrics_loop_begin();

                        k = sd_event_dispatch(e);
                        metrics_loop_end(start);
                }
                if (k < 0)
                        return k;
        }
        k = sd_event_get_exit_code(e, &code);
        return k < 0 ? k : code;
}

int manager_run(Manager *m) {
        Peer *p, *tmp;
        int k;

        (void)sd_notify(false, "READY=1");
        send_status(m, true);
        k = loop_run(m->event);
        (void)sd_notify(false, "STOPPING=1");
        /* Waiting calls are not kept across a restart: each is told the broker stops, so its client knows
         * it was not served (a closed connection alone would leave that unknown). */
        for (size_t i = 0; i < pool_n_devices(m->pool); i++) {
                Waiter *w;

                while ((w = wait_queue_first(&m->broker.waits[i])))
                        (void)peer_wait_try(container_of(w, Peer, waiter), ALLOC_TRY_STOPPING);
        }
        list_for_each_entry_safe(p, tmp, &m->broker.scrub_waiters, link_scrub)
                (void)peer_wait_try(p, ALLOC_TRY_STOPPING);     /* answered: it leaves the list */
        list_for_each_entry_safe(p, tmp, &m->broker.host_waiters, link_host)
                peer_host_stopping(p);                          /* answered: it leaves the list */
        /* What the service manager keeps stays there: the next run takes the leases back, and the host
         * memory cached for parks. */
        restore_keep_host_cache(m);
        restore_stop_storing(m);
        return k;
}
