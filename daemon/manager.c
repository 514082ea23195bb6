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
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include "macro.h"
#include "manager.h"
#include "restore.h"
#include "message.h"
#include "peer.h"
#include "size.h"

#define MANAGER_MAX_PEERS 4096

/* Holder exits are handled before requests, so a request never sees a dead process's leases. */
#define PRIORITY_HOLDER_EXIT (-10)
#define PRIORITY_SCRUB (-5)

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

/* The socket systemd passed us, or -ENOENT when it passed none. */
static int on_accept(sd_event_source *s, int fd, uint32_t revents, void *userdata) {
        Manager *m = userdata;

        for (;;) {
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
                if (m->n_peers >= MANAGER_MAX_PEERS) {
                        safe_close(cfd);
                        continue;
                }
                (void)peer_new(m, cfd);
        }
}

static int on_pool(sd_event_source *s, int fd, uint32_t revents, void *userdata) {
        Manager *m = userdata;

        if (pool_dispatch(m->pool) > 0)
                manager_notify_status(m);
        return 0;
}

static void send_status(Manager *m);

static int on_idle(sd_event_source *s, void *userdata) {
        Manager *m = userdata;

        pool_idle(m->pool);
        restore_save_state(m);
        if (m->status_dirty)
                send_status(m);
        return 0;
}

static int on_signal(sd_event_source *s, const struct signalfd_siginfo *si, void *userdata) {
        Manager *m = userdata;

        return sd_event_exit(m->event, 0);
}

/*
 * Holders' pidfds live in an epoll set of their own, so that the manager can
 * ask "has any holder exited?" in one syscall before answering each request:
 * a request read after a holder's exit must never see its leases, and event
 * source priorities alone cannot promise that when a peer's requests are read
 * in a batch.
 */
static void unwatch_holder(Manager *m, Holder *h) {
        if (!h->userdata)
                return;
        (void)epoll_ctl(m->holder_epoll_fd, EPOLL_CTL_DEL, h->pidfd, NULL);
        h->userdata = NULL;
}

unsigned manager_holder_exited(Manager *m, Holder *h) {
        unsigned n;

        unwatch_holder(m, h);
        n = holder_reclaim(&m->leases, h);
        h->pid = 0;     /* a new process with this pid is someone else; its connections' requests go unserved */
        holder_free_if_unused(&m->leases, h);
        if (n > 0)
                restore_state_changed(m);
        return n;
}

unsigned manager_reap_holders(Manager *m) {
        struct epoll_event ev[64];
        unsigned reclaimed = 0;
        int n;

        do {
                n = epoll_wait(m->holder_epoll_fd, ev, ELEMENTSOF(ev), 0);
                for (int i = 0; i < n; i++)
                        reclaimed += manager_holder_exited(m, ev[i].data.ptr);
        } while (n == (int)ELEMENTSOF(ev));
        if (reclaimed > 0) {
                manager_schedule_idle(m);       /* released slabs' fds are closed there */
                manager_notify_status(m);
        }
        return reclaimed;
}

static int on_holder_exit(sd_event_source *s, int fd, uint32_t revents, void *userdata) {
        manager_reap_holders(userdata);
        return 0;
}

int manager_watch_holder(Manager *m, Holder *h) {
        struct epoll_event ev = { .events = EPOLLIN, .data.ptr = h };

        if (epoll_ctl(m->holder_epoll_fd, EPOLL_CTL_ADD, h->pidfd, &ev) < 0)
                return -errno;
        h->userdata = m;
        return 0;
}


void manager_release_holder(Manager *m, Holder *h) {
        /* A process with no lease and no connection left is forgotten; it is a new holder if it comes back. */
        if (--h->n_connections == 0 && list_is_empty(&h->holds))
                unwatch_holder(m, h);
        holder_free_if_unused(&m->leases, h);
}

void manager_schedule_idle(Manager *m) {
        (void)sd_event_source_set_enabled(m->idle_source, SD_EVENT_ONESHOT);
}

/* The STATUS= line is sent when the loop is idle: sd_notify() costs a socket of its own each time. */
void manager_notify_status(Manager *m) {
        m->status_dirty = true;
        manager_schedule_idle(m);
}

static void send_status(Manager *m) {
        uint64_t leased = 0, cached = 0;
        char b1[FORMAT_SIZE_MAX], b2[FORMAT_SIZE_MAX];

        for (size_t i = 0; i < pool_n_devices(m->pool); i++) {
                PoolDeviceStats s;

                pool_device_stats(m->pool, i, &s);
                leased += s.leased;
                cached += s.cached;
        }
        (void)sd_notifyf(false, "STATUS=%u leases (%s, %u published), %s cached, %u clients", m->leases.n_leases,
                         format_size(leased, b1, sizeof(b1)), m->leases.n_published,
                         format_size(cached, b2, sizeof(b2)), m->n_peers);
        m->status_dirty = false;
}

Manager *manager_free(Manager *m) {
        Peer *p, *tmp;
        Holder *h;

        if (!m)
                return NULL;
        list_for_each_entry_safe(p, tmp, &m->peers, link)
                peer_free(p);
        list_for_each_entry(h, &m->leases.holders, link)
                unwatch_holder(m, h);
        lease_table_done(&m->leases);
        user_registry_done(&m->users);          /* after the leases and peers that refer to users */
        sd_event_source_disable_unref(m->holder_source);
        safe_close(m->holder_epoll_fd);
        sd_event_source_disable_unref(m->listen_source);
        sd_event_source_disable_unref(m->pool_source);
        sd_event_source_disable_unref(m->idle_source);
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

/* The per-user accounting, for the devices the pool serves: their capacities bound the users' bytes. */
static int manager_init_users(Manager *m, const LimitsConfig *limits) {
        size_t n = pool_n_devices(m->pool);
        _cleanup_free_ uint64_t *capacity = calloc(n ?: 1, sizeof(uint64_t));

        if (!capacity)
                return -ENOMEM;
        for (size_t i = 0; i < n; i++) {
                PoolDeviceStats s;

                pool_device_stats(m->pool, i, &s);
                capacity[i] = s.capacity;
        }
        user_registry_done(&m->users);
        return user_registry_init(&m->users, limits, capacity, n);
}

int manager_new(Manager **ret, const ManagerConfig *config, char **ret_message) {
        _cleanup_(inherited_done) Inherited in = { .socket = -EBADF, .state_fd = -EBADF };
        _cleanup_(manager_freep) Manager *m = NULL;
        const char *path = config->socket_path ?: MANAGER_DEFAULT_SOCKET;
        sigset_t mask;
        int k;

        m = calloc(1, sizeof(*m));
        if (!m)
                return -ENOMEM;
        m->listen_fd = -EBADF;
        m->holder_epoll_fd = -EBADF;
        list_init(&m->peers);
        lease_table_init(&m->leases, NULL);     /* so that manager_free() works from any failure below */
        m->has_admin_group = config->has_admin_group;
        m->admin_gid = config->admin_gid;
        m->reply_timeout_usec = config->reply_timeout_usec ?: MANAGER_DEFAULT_REPLY_TIMEOUT_USEC;
        k = user_registry_init(&m->users, &config->limits, NULL, 0);
        if (k < 0)
                return k;

        k = sd_event_default(&m->event);
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
        m->leases.pool = m->pool;
        m->leases.users = &m->users;
        k = manager_init_users(m, &config->limits);
        if (k < 0)
                return k;

        restore_start_storing(m);
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

        m->holder_epoll_fd = epoll_create1(EPOLL_CLOEXEC);
        if (m->holder_epoll_fd < 0)
                return -errno;
        k = sd_event_add_io(m->event, &m->holder_source, m->holder_epoll_fd, EPOLLIN, on_holder_exit, m);
        if (k < 0)
                return k;
        (void)sd_event_source_set_priority(m->holder_source, PRIORITY_HOLDER_EXIT);
        k = restore_leases(m, &in);
        if (k < 0)
                return k;

        k = sd_event_add_io(m->event, &m->listen_source, m->listen_fd, EPOLLIN, on_accept, m);
        if (k < 0)
                return k;
        k = sd_event_add_io(m->event, &m->pool_source, pool_get_fd(m->pool), EPOLLIN, on_pool, m);
        if (k < 0)
                return k;
        (void)sd_event_source_set_priority(m->pool_source, PRIORITY_SCRUB);
        k = sd_event_add_defer(m->event, &m->idle_source, on_idle, m);
        if (k < 0)
                return k;
        (void)sd_event_source_set_priority(m->idle_source, SD_EVENT_PRIORITY_IDLE);
        (void)sd_event_source_set_enabled(m->idle_source, SD_EVENT_OFF);

        *ret = TAKE_PTR(m);
        return 0;
}

int manager_run(Manager *m) {
        int k;

        (void)sd_notify(false, "READY=1");
        send_status(m);
        k = sd_event_loop(m->event);
        (void)sd_notify(false, "STOPPING=1");
        /* What the service manager keeps stays there: the next run takes the leases back. */
        restore_stop_storing(m);
        return k;
}
