/* SPDX-License-Identifier: MIT */

/* The test supervisor: what it does and does not do is in supervisor.h and README.md. */

#include <errno.h>
#include <fcntl.h>
#include <linux/kcmp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/pidfd.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "macro.h"
#include "supervisor.h"

#define NOTIFY_BUFFER_MAX 4096          /* systemd's: a notification longer than this is ignored */
#define NOTIFY_FD_MAX 768               /* systemd's: fds one notification may carry */
#define FDNAME_MAX 255
#define GUARD_MS 30000                  /* failure guard on the exec report, a sync and SIGKILL */
#define STOP_TIMEOUT_MS_DEFAULT 30000
#define USEC_PER_MSEC 1000ULL

extern char **environ;

typedef struct StoredFd {
        int fd;
        char *name;
        bool poll;                      /* without FDPOLL=0: dropped on POLLHUP/POLLERR */
        dev_t dev;                      /* fstat() at storing time, to look for duplicates cheaply */
        ino_t ino;
        uint64_t id;                    /* names the entry in the reading thread's poll set */
} StoredFd;

struct Supervisor {
        /* The options, copied. */
        char *path;
        char **argv;
        char *socket_name;
        unsigned fd_store_max;
        uint64_t watchdog_usec;
        unsigned stop_timeout_ms;
        bool oldest_first;

        char dir[64];
        char socket_path[sizeof(((struct sockaddr_un *)NULL)->sun_path)];
        char notify_path[sizeof(((struct sockaddr_un *)NULL)->sun_path)];
        bool socket_bound;              /* socket_path is ours to unlink */
        int listen_fd;
        int notify_fd;
        int wake_fd;                    /* eventfd: wakes the reading thread */

        pthread_t thread;
        bool thread_started;
        pthread_mutex_t lock;
        pthread_cond_t cond;            /* broadcast after every pass of the reading thread */

        /* Under lock from here on. */
        bool quit;
        pid_t pid;                      /* the daemon, until reaped; 0: none */
        int pidfd;                      /* polled by the thread, which closes it when the daemon exits */
        bool exited;                    /* its exit seen and every notification it sent acted on */
        uint64_t exec_at;               /* CLOCK_MONOTONIC µs when the child called execve() */
        uint64_t ready_at;              /* ... when READY=1 was received; 0: not yet */
        bool stopping;                  /* STOPPING=1 received: READY=1 no longer counts */
        char *status;
        uint64_t watchdog_current;      /* WatchdogSec=, or what WATCHDOG_USEC= made it */
        uint64_t watchdog_deadline;     /* 0: not armed */
        StoredFd *store;                /* oldest first */
        size_t n_store;
        uint64_t next_id;
        uint64_t sync_requested;
        uint64_t sync_done;
        bool clear_requested;
        int last_exit;
        SupervisorStats stats;

        Supervisor *live_next;          /* in live_first, under live_lock, while the reading thread runs */
};

/*
 * A fork() elsewhere in the process (a test forking its clients while a daemon runs) must not happen while
 * a reading thread is inside malloc(): the child would find the allocator's lock taken for good. glibc's
 * malloc has fork handlers, but gcc 12's AddressSanitizer allocator has none; test-store-faults' client
 * hung so in calloc(), about once in 20 runs under the sanitizers. A reading thread allocates only under
 * its supervisor's lock, so these handlers hold every live supervisor's lock across fork(), except the one
 * supervisor_start() holds already to fork its daemon (forking_own). One thread of the process forks.
 */
static pthread_mutex_t live_lock = PTHREAD_MUTEX_INITIALIZER;
static Supervisor *live_first;
static _Thread_local const Supervisor *forking_own;

static void fork_prepare(void) {
        pthread_mutex_lock(&live_lock);
        for (Supervisor *s = live_first; s; s = s->live_next)
                if (s != forking_own)
                        pthread_mutex_lock(&s->lock);
}

/* In the parent, and in the child (where no reading thread runs: its copies of the locks are let go). */
static void fork_done(void) {
        for (Supervisor *s = live_first; s; s = s->live_next)
                if (s != forking_own)
                        pthread_mutex_unlock(&s->lock);
        pthread_mutex_unlock(&live_lock);
}

static void fork_handlers_install(void) {
        (void)pthread_atfork(fork_prepare, fork_done, fork_done);
}

static void live_add(Supervisor *s) {
        static pthread_once_t once = PTHREAD_ONCE_INIT;

        (void)pthread_once(&once, fork_handlers_install);
        pthread_mutex_lock(&live_lock);
        s->live_next = live_first;
        live_first = s;
        pthread_mutex_unlock(&live_lock);
}

static void live_remove(Supervisor *s) {
        pthread_mutex_lock(&live_lock);
        for (Supervisor **p = &live_first; *p; p = &(*p)->live_next)
                if (*p == s) {
                        *p = s->live_next;
                        break;
                }
        pthread_mutex_unlock(&live_lock);
}

static uint64_t now_usec(void) {
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000ULL + (uint64_t)ts.tv_nsec / 1000ULL;
}

/* Waits on s->cond until the CLOCK_MONOTONIC time `deadline` (µs). Returns 0 or ETIMEDOUT. */
static int wait_until(Supervisor *s, uint64_t deadline) {
        struct timespec ts = { .tv_sec = (time_t)(deadline / 1000000ULL),
                               .tv_nsec = (long)(deadline % 1000000ULL) * 1000L };

        return pthread_cond_timedwait(&s->cond, &s->lock, &ts);
}

static void wake(Supervisor *s) {
        (void)eventfd_write(s->wake_fd, 1);
}

/* As systemd's fdname_is_valid(): printable ASCII but ':', at most 255 characters (empty allowed). */
static bool fdname_is_valid(const char *name) {
        size_t n = 0;

        for (const char *p = name; *p; p++, n++)
                if (*p == ':' || *p < ' ' || *p > '~')
                        return false;
        return n <= FDNAME_MAX;
}

/*
 * Whether `fd` is the same open file description as the stored entry `e`, as systemd's same_fd() asks:
 * kcmp(KCMP_FILE), or where kcmp() is not allowed (seccomp, no CONFIG_KCMP) the same inode, status flags
 * and offset. Returns 1, 0 or a negative errno.
 */
static int same_fd(const StoredFd *e, int fd, const struct stat *st) {
        long k;
        int fa, fb;

        if (e->dev != st->st_dev || e->ino != st->st_ino)
                return 0;
        k = syscall(SYS_kcmp, (long)getpid(), (long)getpid(), (long)KCMP_FILE, (long)e->fd, (long)fd);
        if (k >= 0)
                return k == 0;
        fa = fcntl(e->fd, F_GETFL);
        fb = fcntl(fd, F_GETFL);
        if (fa < 0 || fb < 0)
                return -errno;
        return fa == fb && lseek(e->fd, 0, SEEK_CUR) == lseek(fd, 0, SEEK_CUR);
}

static void store_drop(Supervisor *s, size_t i) {
        safe_close(s->store[i].fd);
        free(s->store[i].name);
        memmove(s->store + i, s->store + i + 1, (s->n_store - i - 1) * sizeof(StoredFd));
        s->n_store--;
}

/* Takes `fd` into the store (consumed in every case). Returns 1 stored, 0 duplicate, -EXFULL, -errno. */
static int store_add(Supervisor *s, int fd, const char *name, bool poll) {
        StoredFd *grown;
        struct stat st;
        char *copy;
        int k;

        if (s->n_store >= s->fd_store_max) {
                safe_close(fd);
                return -EXFULL;
        }
        if (fstat(fd, &st) < 0) {
                k = -errno;
                safe_close(fd);
                return k;
        }
        for (size_t i = 0; i < s->n_store; i++) {
                k = same_fd(&s->store[i], fd, &st);
                if (k != 0) {
                        safe_close(fd);
                        return k < 0 ? k : 0;
                }
        }
        copy = strdup(name);
        grown = copy ? realloc(s->store, (s->n_store + 1) * sizeof(StoredFd)) : NULL;
        if (!grown) {
                free(copy);
                safe_close(fd);
                return -ENOMEM;
        }
        s->store = grown;
        s->store[s->n_store++] = (StoredFd){ .fd = fd, .name = copy, .poll = poll, .dev = st.st_dev,
                                             .ino = st.st_ino, .id = ++s->next_id };
        return 1;
}

/* Drops every polled stored fd on which POLLHUP or POLLERR is raised now. */
static void store_check_hangup(Supervisor *s) {
        for (size_t i = 0; i < s->n_store;) {
                struct pollfd p = { .fd = s->store[i].fd };

                if (s->store[i].poll && poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLERR))) {
                        store_drop(s, i);
                        s->stats.fds_hangup++;
                } else
                        i++;
        }
}

static void watchdog_fire(Supervisor *s) {
        s->watchdog_deadline = 0;
        if (s->pid <= 0 || s->exited)
                return;
        /* WatchdogSignal= (SIGABRT) to the whole service, as systemd's stop-watchdog state sends it */
        if (kill(-s->pid, SIGABRT) < 0)
                (void)kill(s->pid, SIGABRT);
        s->stats.watchdog_fired++;
}

static void watchdog_reset(Supervisor *s) {
        s->watchdog_deadline = s->watchdog_current > 0 ? now_usec() + s->watchdog_current : 0;
}

/* The value of the first line of `tags` that starts with `prefix`, as systemd's strv_find_startswith(). */
static const char *tag_value(char *const *tags, const char *prefix) {
        size_t n = strlen(prefix);

        for (size_t i = 0; tags[i]; i++)
                if (strncmp(tags[i], prefix, n) == 0)
                        return tags[i] + n;
        return NULL;
}

static bool tag_has(char *const *tags, const char *line) {
        for (size_t i = 0; tags[i]; i++)
                if (strcmp(tags[i], line) == 0)
                        return true;
        return false;
}

/* Acts on a notification from the daemon (systemd's service_notify_message()). Consumes the fds. */
static void process(Supervisor *s, char *const *tags, int *fds, size_t n_fds) {
        const char *e;
        size_t used = 0;

        s->stats.messages++;

        /* STOPPING=1 wins; after it READY=1 does not resurrect the service. */
        if (tag_has(tags, "STOPPING=1"))
                s->stopping = true;
        else if (!s->stopping && tag_has(tags, "READY=1") && s->ready_at == 0) {
                s->ready_at = now_usec();
                watchdog_reset(s);      /* the watchdog runs once start-up is complete */
        }

        e = tag_value(tags, "STATUS=");
        if (e) {
                free(s->status);
                s->status = *e ? strdup(e) : NULL;
        }

        e = tag_value(tags, "WATCHDOG=");
        if (e && strcmp(e, "1") == 0) {
                s->stats.watchdog_pings++;
                watchdog_reset(s);
        } else if (e && strcmp(e, "trigger") == 0)
                watchdog_fire(s);

        e = tag_value(tags, "WATCHDOG_USEC=");
        if (e) {
                char *end;
                unsigned long long v;

                errno = 0;
                v = strtoull(e, &end, 10);
                if (errno == 0 && end != e && *end == 0) {
                        s->watchdog_current = v;
                        watchdog_reset(s);
                }
        }

        if (tag_has(tags, "FDSTOREREMOVE=1")) {
                e = tag_value(tags, "FDNAME=");
                if (!e || !fdname_is_valid(e)) {
                        if (e)
                                s->stats.invalid_names++;
                } else
                        for (size_t i = 0; i < s->n_store;) {
                                if (strcmp(s->store[i].name, e) == 0) {
                                        store_drop(s, i);
                                        s->stats.fds_removed++;
                                } else
                                        i++;
                        }
        } else if (tag_has(tags, "FDSTORE=1")) {
                bool poll = !tag_has(tags, "FDPOLL=0");

                e = tag_value(tags, "FDNAME=");
                if (e && !fdname_is_valid(e)) {
                        s->stats.invalid_names++;
                        e = NULL;
                }
                for (; used < n_fds; used++) {
                        int k = store_add(s, fds[used], e ? e : "stored", poll);

                        if (k > 0)
                                s->stats.fds_stored++;
                        else if (k == 0)
                                s->stats.fds_duplicate++;
                        else if (k == -EXFULL) {
                                /* as systemd: "Cannot store more fds than FileDescriptorStoreMax=, closing
                                 * remaining." */
                                s->stats.fds_full += (unsigned)(n_fds - used);
                                while (++used < n_fds)
                                        safe_close(fds[used]);
                                break;
                        } else {
                                used++;
                                break;
                        }
                }
        }
        for (size_t i = used; i < n_fds; i++) {
                safe_close(fds[i]);
                s->stats.fds_unexpected++;
        }
}

/* Receives one notification and acts on it. Returns 0, or -EAGAIN when none is queued. */
static int receive_one(Supervisor *s) {
        union {
                struct cmsghdr h;
                char buf[CMSG_SPACE(sizeof(struct ucred)) + CMSG_SPACE(sizeof(int) * NOTIFY_FD_MAX)];
        } control;
        char buf[NOTIFY_BUFFER_MAX + 1];
        struct iovec iov = { .iov_base = buf, .iov_len = NOTIFY_BUFFER_MAX };
        struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = &control,
                             .msg_controllen = sizeof(control) };
        const struct ucred *ucred = NULL;
        int *fds = NULL;
        size_t n_fds = 0, n_lines = 1;
        char **tags = NULL;
        ssize_t n;

        do
                n = recvmsg(s->notify_fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        while (n < 0 && errno == EINTR);
        if (n < 0)
                return errno == EAGAIN ? -EAGAIN : -errno;

        for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
                if (c->cmsg_level != SOL_SOCKET)
                        continue;
                if (c->cmsg_type == SCM_RIGHTS && !fds) {
                        fds = (int *)(void *)CMSG_DATA(c);
                        n_fds = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
                } else if (c->cmsg_type == SCM_RIGHTS) {
                        /* one array per message is all sd_notify() sends; a second one is not kept */
                        for (size_t i = 0; i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); i++)
                                safe_close(((int *)(void *)CMSG_DATA(c))[i]);
                } else if (c->cmsg_type == SCM_CREDENTIALS && c->cmsg_len == CMSG_LEN(sizeof(struct ucred)))
                        ucred = (const struct ucred *)(void *)CMSG_DATA(c);
        }

        /* As systemd, ignored: truncated fds or text, no credentials, embedded NULs. */
        if ((mh.msg_flags & (MSG_CTRUNC | MSG_TRUNC)) || !ucred || ucred->pid <= 0 ||
            (n > 1 && memchr(buf, 0, (size_t)n - 1)))
                goto ignore;
        buf[n] = 0;

        for (ssize_t i = 0; i < n; i++)
                n_lines += buf[i] == '\n';
        tags = calloc(n_lines + 1, sizeof(char *));
        if (!tags)
                goto ignore;
        n_lines = 0;
        for (char *line = buf, *next; line; line = next) {
                next = strchr(line, '\n');
                if (next)
                        *next++ = 0;
                if (*line)
                        tags[n_lines++] = line;
        }

        /* A barrier (sd_notify_barrier()): closing its fd is the answer, whoever sent it. */
        if (n_lines == 1 && strcmp(tags[0], "BARRIER=1") == 0)
                goto ignore;

        /* NotifyAccess=main: only the daemon's own pid, from the kernel-attached credentials. */
        if (s->pid <= 0 || ucred->pid != s->pid) {
                s->stats.foreign++;
                s->stats.fds_foreign += (unsigned)n_fds;
                goto ignore;
        }
        process(s, tags, fds, n_fds);
        free(tags);
        return 0;

ignore:
        for (size_t i = 0; i < n_fds; i++)
                safe_close(fds[i]);
        free(tags);
        return 0;
}

static void drain(Supervisor *s) {
        while (receive_one(s) == 0)
                ;
}

/* The reading thread: what PID 1's event loop does for the service. */
static void *reader(void *userdata) {
        Supervisor *s = userdata;
        struct pollfd *p = NULL;
        uint64_t *ids = NULL;
        size_t allocated = 0;

        pthread_mutex_lock(&s->lock);
        while (!s->quit) {
                size_t n = 0, n_fixed;
                int pidfd = s->pidfd, timeout = -1, k;
                uint64_t requested;

                if (allocated < 3 + s->n_store) {
                        size_t want = 3 + s->n_store + 16;
                        struct pollfd *np = realloc(p, want * sizeof(*p));
                        uint64_t *ni = np ? realloc(ids, want * sizeof(*ids)) : NULL;

                        if (np)
                                p = np;
                        if (ni) {
                                ids = ni;
                                allocated = want;
                        }
                }
                if (allocated < 3) {
                        /* no memory even for the fixed three: nothing can work */
                        s->quit = true;
                        break;
                }
                p[n++] = (struct pollfd){ .fd = s->notify_fd, .events = POLLIN };
                p[n++] = (struct pollfd){ .fd = s->wake_fd, .events = POLLIN };
                if (pidfd >= 0)
                        p[n++] = (struct pollfd){ .fd = pidfd, .events = POLLIN };
                n_fixed = n;
                for (size_t i = 0; i < s->n_store && n < allocated; i++)
                        if (s->store[i].poll) {
                                ids[n] = s->store[i].id;
                                /* events 0: POLLHUP and POLLERR are reported all the same */
                                p[n++] = (struct pollfd){ .fd = s->store[i].fd };
                        }
                if (s->watchdog_deadline > 0) {
                        uint64_t now = now_usec();

                        timeout = now >= s->watchdog_deadline
                                          ? 0
                                          : (int)MIN((s->watchdog_deadline - now + 999) / 1000, (uint64_t)INT32_MAX);
                }
                pthread_mutex_unlock(&s->lock);

                k = poll(p, n, timeout);

                pthread_mutex_lock(&s->lock);
                if (k < 0)
                        continue;       /* EINTR; the loop tries again */
                if (p[1].revents & POLLIN) {
                        eventfd_t v;

                        (void)eventfd_read(s->wake_fd, &v);
                }
                /* A sync asked for before this point is answered after the drain below. */
                requested = s->sync_requested;
                drain(s);
                /* The daemon exited before poll() returned, so all it sent was queued before the drain. */
                if (pidfd >= 0 && (p[2].revents & POLLIN) && pidfd == s->pidfd) {
                        s->exited = true;
                        s->watchdog_deadline = 0;
                        s->pidfd = safe_close(s->pidfd);
                }
                for (size_t i = n_fixed; i < n; i++)
                        if (p[i].revents & (POLLHUP | POLLERR))
                                for (size_t j = 0; j < s->n_store; j++)
                                        if (s->store[j].id == ids[i]) {
                                                store_drop(s, j);
                                                s->stats.fds_hangup++;
                                                break;
                                        }
                if (s->sync_done != requested) {
                        if (s->clear_requested) {
                                while (s->n_store > 0)
                                        store_drop(s, s->n_store - 1);
                                s->clear_requested = false;
                        }
                        store_check_hangup(s);
                        s->sync_done = requested;
                }
                if (s->watchdog_deadline > 0 && now_usec() >= s->watchdog_deadline)
                        watchdog_fire(s);
                pthread_cond_broadcast(&s->cond);
        }
        pthread_cond_broadcast(&s->cond);
        pthread_mutex_unlock(&s->lock);
        free(p);
        free(ids);
        return NULL;
}

/* Has the reading thread act on everything sent so far. Returns 0 or -ETIMEDOUT. Under lock. */
static int sync_locked(Supervisor *s) {
        uint64_t target = ++s->sync_requested, deadline = now_usec() + GUARD_MS * USEC_PER_MSEC;

        wake(s);
        while (s->sync_done < target && !s->quit)
                if (wait_until(s, deadline) == ETIMEDOUT)
                        return -ETIMEDOUT;
        return s->quit ? -EIO : 0;
}

static int unix_socket(const char *path, int type, struct sockaddr_un *ret_sa) {
        int fd;

        *ret_sa = (struct sockaddr_un){ .sun_family = AF_UNIX };
        if (strlen(path) >= sizeof(ret_sa->sun_path))
                return -ENAMETOOLONG;
        strcpy(ret_sa->sun_path, path);
        fd = socket(AF_UNIX, type | SOCK_CLOEXEC, 0);
        return fd < 0 ? -errno : fd;
}

int supervisor_new(const SupervisorOptions *o, Supervisor **ret) {
        pthread_condattr_t attr;
        struct sockaddr_un sa;
        Supervisor *s;
        size_t n_args = 0;
        int one = 1, k;

        if (!o || !o->path || !ret)
                return -EINVAL;
        if (o->socket_name && (!fdname_is_valid(o->socket_name) || !*o->socket_name))
                return -EINVAL;
        s = calloc(1, sizeof(*s));
        if (!s)
                return -ENOMEM;
        s->listen_fd = s->notify_fd = s->wake_fd = s->pidfd = -EBADF;
        pthread_mutex_init(&s->lock, NULL);
        pthread_condattr_init(&attr);
        pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
        pthread_cond_init(&s->cond, &attr);
        pthread_condattr_destroy(&attr);

        s->fd_store_max = o->fd_store_max;
        s->watchdog_usec = o->watchdog_usec;
        s->stop_timeout_ms = o->stop_timeout_ms > 0 ? o->stop_timeout_ms : STOP_TIMEOUT_MS_DEFAULT;
        s->oldest_first = o->oldest_first;
        s->path = strdup(o->path);
        s->socket_name = strdup(o->socket_name ? o->socket_name : "varlink");
        while (o->argv && o->argv[n_args])
                n_args++;
        s->argv = calloc(MAX(n_args, 1) + 1, sizeof(char *));
        if (!s->path || !s->socket_name || !s->argv) {
                k = -ENOMEM;
                goto fail;
        }
        for (size_t i = 0; i < MAX(n_args, 1); i++) {
                s->argv[i] = strdup(n_args > 0 ? o->argv[i] : o->path);
                if (!s->argv[i]) {
                        k = -ENOMEM;
                        goto fail;
                }
        }

        strcpy(s->dir, "/tmp/vmmb-supervisor-XXXXXX");
        if (!mkdtemp(s->dir)) {
                k = -errno;
                s->dir[0] = 0;
                goto fail;
        }
        (void)chmod(s->dir, 0755);     /* a daemon that drops privileges can still reach the notify socket */
        snprintf(s->notify_path, sizeof(s->notify_path), "%s/notify", s->dir);
        if (o->socket_path) {
                if (strlen(o->socket_path) >= sizeof(s->socket_path)) {
                        k = -ENAMETOOLONG;
                        goto fail;
                }
                strcpy(s->socket_path, o->socket_path);
        } else
                snprintf(s->socket_path, sizeof(s->socket_path), "%s/socket", s->dir);

        /* The listening socket, bound once (the socket unit's ListenStream=). */
        k = s->listen_fd = unix_socket(s->socket_path, SOCK_STREAM, &sa);
        if (k < 0)
                goto fail;
        if (bind(s->listen_fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
                k = -errno;
                goto fail;
        }
        s->socket_bound = true;
        if (listen(s->listen_fd, SOMAXCONN) < 0) {
                k = -errno;
                goto fail;
        }

        /* The notify socket, with the senders' credentials. */
        k = s->notify_fd = unix_socket(s->notify_path, SOCK_DGRAM, &sa);
        if (k < 0)
                goto fail;
        if (setsockopt(s->notify_fd, SOL_SOCKET, SO_PASSCRED, &one, sizeof(one)) < 0 ||
            bind(s->notify_fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
                k = -errno;
                goto fail;
        }
        (void)chmod(s->notify_path, 0666);

        s->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (s->wake_fd < 0) {
                k = -errno;
                goto fail;
        }
        k = -pthread_create(&s->thread, NULL, reader, s);
        if (k < 0)
                goto fail;
        s->thread_started = true;
        live_add(s);
        *ret = s;
        return 0;

fail:
        supervisor_free(s);
        return k;
}

/* What the child needs, all made before fork(): between fork() and execve() it calls only
 * async-signal-safe functions and allocates nothing. */
typedef struct ChildSetup {
        const char *path;
        char *const *argv;
        char *const *envp;
        const int *fds;                 /* the socket then the stored fds, for 3, 4, ... */
        int *moved;                     /* scratch for as many */
        size_t n_fds;
        int report_fd;                  /* close-on-exec pipe: exec time, or an errno */
        char *listen_pid;               /* "LISTEN_PID=" and room for digits, in envp */
        char *watchdog_pid;             /* "WATCHDOG_PID=" likewise, or NULL */
        pid_t parent;
} ChildSetup;

static void format_pid(char *env, pid_t pid) {
        char digits[16];
        size_t n = 0;

        env = strchr(env, '=') + 1;
        do
                digits[n++] = (char)('0' + pid % 10);
        while ((pid /= 10) > 0);
        while (n > 0)
                *env++ = digits[--n];
        *env = 0;
}

static _Noreturn void child_fail(int report_fd, int error) {
        uint64_t none = 0;
        int32_t e = error;

        (void)!write(report_fd, &none, sizeof(none));
        (void)!write(report_fd, &e, sizeof(e));
        _exit(127);
}

static _Noreturn void child(const ChildSetup *c) {
        struct sigaction sa = { .sa_handler = SIG_DFL };
        int first_free = 3 + (int)c->n_fds, report;
        sigset_t none;
        uint64_t t;
        int32_t e;

        /* The pipe and the fds to pass move above 3 + n first, so that the dup2() below clobber none of
         * them; the copies are close-on-exec, dup2()'s targets are not. */
        report = fcntl(c->report_fd, F_DUPFD_CLOEXEC, first_free);
        if (report < 0)
                _exit(127);
        for (size_t i = 0; i < c->n_fds; i++) {
                c->moved[i] = fcntl(c->fds[i], F_DUPFD_CLOEXEC, first_free);
                if (c->moved[i] < 0)
                        child_fail(report, errno);
        }
        for (size_t i = 0; i < c->n_fds; i++)
                if (dup2(c->moved[i], 3 + (int)i) < 0)
                        child_fail(report, errno);
        /* Nothing else of ours reaches the daemon (the report pipe closes at the exec). */
        if (close_range((unsigned)first_free, ~0U, CLOSE_RANGE_CLOEXEC) < 0 && errno != ENOSYS && errno != EINVAL)
                child_fail(report, errno);

        /* A clean signal state and a process group of its own (KillMode=control-group, roughly), and it
         * dies with the test that started it. */
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        for (int sig = 1; sig < NSIG; sig++)
                if (sig != SIGKILL && sig != SIGSTOP)
                        (void)sigaction(sig, &sa, NULL);
        if (setpgid(0, 0) < 0)
                child_fail(report, errno);
        if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0)
                child_fail(report, errno);
        if (getppid() != c->parent)
                child_fail(report, ESRCH);

        format_pid(c->listen_pid, getpid());
        if (c->watchdog_pid)
                format_pid(c->watchdog_pid, getpid());

        t = now_usec();
        (void)!write(report, &t, sizeof(t));
        execve(c->path, c->argv, c->envp);
        e = errno;
        (void)!write(report, &e, sizeof(e));
        _exit(127);
}

static bool env_is_ours(const char *entry) {
        static const char *const ours[] = { "LISTEN_PID=", "LISTEN_FDS=", "LISTEN_FDNAMES=", "NOTIFY_SOCKET=",
                                            "WATCHDOG_USEC=", "WATCHDOG_PID=", "FDSTORE=" };

        for (size_t i = 0; i < ELEMENTSOF(ours); i++)
                if (strncmp(entry, ours[i], strlen(ours[i])) == 0)
                        return true;
        return false;
}

/* Reads the child's report: 0 when it exec'd (*ret_exec_at set), or the negative errno it failed with. */
static int read_report(int fd, uint64_t *ret_exec_at) {
        char buf[sizeof(uint64_t) + sizeof(int32_t)];
        uint64_t deadline = now_usec() + GUARD_MS * USEC_PER_MSEC;
        size_t got = 0;

        for (;;) {
                struct pollfd p = { .fd = fd, .events = POLLIN };
                uint64_t now = now_usec();
                ssize_t n;
                int k;

                if (now >= deadline)
                        return -ETIMEDOUT;
                k = poll(&p, 1, (int)((deadline - now + 999) / 1000));
                if (k < 0 && errno == EINTR)
                        continue;
                if (k < 0)
                        return -errno;
                if (k == 0)
                        return -ETIMEDOUT;
                n = read(fd, buf + got, sizeof(buf) - got);
                if (n < 0 && errno == EINTR)
                        continue;
                if (n < 0)
                        return -errno;
                if (n == 0)
                        break;
                got += (size_t)n;
                if (got == sizeof(buf))
                        break;
        }
        if (got == sizeof(uint64_t)) {
                memcpy(ret_exec_at, buf, sizeof(uint64_t));
                return 0;
        }
        if (got == sizeof(buf)) {
                int32_t e;

                memcpy(&e, buf + sizeof(uint64_t), sizeof(e));
                return e > 0 ? -e : -EIO;
        }
        return -ECHILD;
}

/* Waits until the reading thread saw the daemon exit, up to `deadline`. Under lock. */
static bool wait_exited_locked(Supervisor *s, uint64_t deadline) {
        while (!s->exited && !s->quit)
                if (wait_until(s, deadline) == ETIMEDOUT)
                        break;
        return s->exited;
}

/* Reaps the exited daemon and returns its status as a shell shows it. Under lock. */
static int reap_locked(Supervisor *s) {
        pid_t pid = s->pid, k;
        int status, r;

        /* What is left of its process group goes too (the zombie leader keeps the group id from reuse). */
        (void)kill(-pid, SIGKILL);
        do
                k = waitpid(pid, &status, 0);
        while (k < 0 && errno == EINTR);
        if (k != pid)
                r = -ECHILD;
        else
                r = WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
        s->pid = 0;
        s->exited = false;
        s->ready_at = 0;
        s->stopping = false;
        s->watchdog_deadline = 0;
        s->last_exit = r;
        return r;
}

int supervisor_start(Supervisor *s) {
        _cleanup_close_ int report_read = -EBADF, report_write = -EBADF;
        char listen_pid[32] = "LISTEN_PID=", watchdog_pid[32] = "WATCHDOG_PID=";
        char *listen_fds = NULL, *listen_fdnames = NULL, *notify = NULL, *watchdog = NULL, *fdstore = NULL;
        char **envp = NULL;
        int *fds = NULL, *moved = NULL;
        size_t n_env = 0, n_fds, names_len, e = 0;
        uint64_t exec_at = 0;
        int pipefd[2], k;
        pid_t pid, parent;

        pthread_mutex_lock(&s->lock);
        if (s->pid != 0) {
                pthread_mutex_unlock(&s->lock);
                return -EBUSY;
        }
        /* Everything the last daemon sent, and every hang-up already raised, counts before the new one
         * starts, as in PID 1's event loop. */
        k = sync_locked(s);
        if (k < 0)
                goto finish;

        n_fds = 1 + s->n_store;
        names_len = strlen("LISTEN_FDNAMES=") + strlen(s->socket_name) + 1;
        for (size_t i = 0; i < s->n_store; i++)
                names_len += 1 + strlen(s->store[i].name);
        while (environ && environ[n_env])
                n_env++;
        fds = calloc(n_fds, sizeof(int));
        moved = calloc(n_fds, sizeof(int));
        envp = calloc(n_env + 8, sizeof(char *));
        listen_fdnames = malloc(names_len);
        if (asprintf(&listen_fds, "LISTEN_FDS=%zu", n_fds) < 0)
                listen_fds = NULL;      /* asprintf() leaves it undefined on failure */
        if (asprintf(&notify, "NOTIFY_SOCKET=%s", s->notify_path) < 0)
                notify = NULL;
        if (s->watchdog_usec > 0 &&
            asprintf(&watchdog, "WATCHDOG_USEC=%llu", (unsigned long long)s->watchdog_usec) < 0)
                watchdog = NULL;
        /* systemd 254 and later tell a service its FileDescriptorStoreMax= this way. */
        if (s->fd_store_max > 0 && asprintf(&fdstore, "FDSTORE=%u", s->fd_store_max) < 0)
                fdstore = NULL;
        if (!fds || !moved || !envp || !listen_fdnames || !listen_fds || !notify ||
            (s->watchdog_usec > 0 && !watchdog) || (s->fd_store_max > 0 && !fdstore)) {
                k = -ENOMEM;
                goto finish;
        }

        /* The socket at 3, the stored fds after it, with their names in the same order. */
        fds[0] = s->listen_fd;
        strcpy(listen_fdnames, "LISTEN_FDNAMES=");
        strcat(listen_fdnames, s->socket_name);
        for (size_t i = 0; i < s->n_store; i++) {
                const StoredFd *f = &s->store[s->oldest_first ? i : s->n_store - 1 - i];

                fds[1 + i] = f->fd;
                strcat(listen_fdnames, ":");
                strcat(listen_fdnames, f->name);
        }
        for (size_t i = 0; i < n_env; i++)
                if (!env_is_ours(environ[i]))
                        envp[e++] = environ[i];
        envp[e++] = listen_pid;
        envp[e++] = listen_fds;
        envp[e++] = listen_fdnames;
        envp[e++] = notify;
        if (fdstore)
                envp[e++] = fdstore;
        if (watchdog) {
                envp[e++] = watchdog;
                envp[e++] = watchdog_pid;
        }

        if (pipe2(pipefd, O_CLOEXEC) < 0) {
                k = -errno;
                goto finish;
        }
        report_read = pipefd[0];
        report_write = pipefd[1];

        parent = getpid();
        forking_own = s;                /* its lock is held here: the fork handlers leave it be */
        pid = fork();
        forking_own = NULL;
        if (pid < 0) {
                k = -errno;
                goto finish;
        }
        if (pid == 0)
                child(&(ChildSetup){ .path = s->path, .argv = s->argv, .envp = envp, .fds = fds, .moved = moved,
                                     .n_fds = n_fds, .report_fd = report_write, .listen_pid = listen_pid,
                                     .watchdog_pid = watchdog ? watchdog_pid : NULL, .parent = parent });

        s->pid = pid;
        s->pidfd = pidfd_open(pid, 0);
        if (s->pidfd < 0) {
                k = -errno;
                (void)kill(pid, SIGKILL);
                (void)waitpid(pid, NULL, 0);
                s->pid = 0;
                goto finish;
        }
        s->exited = false;
        s->ready_at = 0;
        s->stopping = false;
        s->exec_at = 0;
        free(s->status);
        s->status = NULL;
        s->watchdog_current = s->watchdog_usec;
        s->watchdog_deadline = 0;
        s->stats.starts++;
        wake(s);                        /* the reading thread polls the new pidfd from now on */
        pthread_mutex_unlock(&s->lock);

        report_write = safe_close(report_write);
        k = read_report(report_read, &exec_at);

        pthread_mutex_lock(&s->lock);
        if (k < 0) {
                /* It did not exec (or hung before): it is gone once reaped. */
                (void)kill(pid, SIGKILL);
                if (wait_exited_locked(s, now_usec() + GUARD_MS * USEC_PER_MSEC))
                        (void)reap_locked(s);
        } else
                s->exec_at = exec_at;

finish:
        pthread_mutex_unlock(&s->lock);
        free(fds);
        free(moved);
        free(envp);
        free(listen_fds);
        free(listen_fdnames);
        free(notify);
        free(watchdog);
        free(fdstore);
        return k;
}

int64_t supervisor_wait_ready(Supervisor *s, int timeout_ms) {
        uint64_t deadline = now_usec() + (uint64_t)MAX(timeout_ms, 0) * USEC_PER_MSEC;
        int64_t r;

        pthread_mutex_lock(&s->lock);
        if (s->pid == 0)
                r = -ESRCH;
        else {
                while (s->ready_at == 0 && !s->exited && !s->quit)
                        if (wait_until(s, deadline) == ETIMEDOUT)
                                break;
                if (s->ready_at > 0)
                        r = (int64_t)(s->ready_at - s->exec_at);
                else
                        r = s->exited ? -ECHILD : -ETIMEDOUT;
        }
        pthread_mutex_unlock(&s->lock);
        return r;
}

int supervisor_wait_exit(Supervisor *s, int timeout_ms) {
        int r;

        pthread_mutex_lock(&s->lock);
        if (s->pid == 0)
                r = -ESRCH;
        else if (!wait_exited_locked(s, now_usec() + (uint64_t)MAX(timeout_ms, 0) * USEC_PER_MSEC))
                r = -ETIMEDOUT;
        else
                r = reap_locked(s);
        pthread_mutex_unlock(&s->lock);
        return r;
}

int supervisor_stop(Supervisor *s, int sig) {
        bool killed = false;
        pid_t pid;
        int r;

        pthread_mutex_lock(&s->lock);
        pid = s->pid;
        if (pid == 0) {
                pthread_mutex_unlock(&s->lock);
                return -ESRCH;
        }
        if (kill(-pid, sig) < 0 && kill(pid, sig) < 0 && errno != ESRCH) {
                r = -errno;
                pthread_mutex_unlock(&s->lock);
                return r;
        }
        if (!wait_exited_locked(s, now_usec() + (uint64_t)(sig == SIGKILL ? GUARD_MS : s->stop_timeout_ms) *
                                                        USEC_PER_MSEC)) {
                /* TimeoutStopSec= ran out: SIGKILL, as systemd's stop-sigkill state */
                killed = true;
                if (kill(-pid, SIGKILL) < 0)
                        (void)kill(pid, SIGKILL);
                if (!wait_exited_locked(s, now_usec() + GUARD_MS * USEC_PER_MSEC)) {
                        pthread_mutex_unlock(&s->lock);
                        return -ETIMEDOUT;      /* unkillable (D state): left to supervisor_free() */
                }
        }
        r = reap_locked(s);
        pthread_mutex_unlock(&s->lock);
        return killed && sig != SIGKILL ? -ETIMEDOUT : r;
}

int64_t supervisor_restart(Supervisor *s, int sig, int timeout_ms) {
        int k;

        k = supervisor_stop(s, sig);
        if (k < 0 && k != -ESRCH)
                return k;
        k = supervisor_start(s);
        if (k < 0)
                return k;
        return supervisor_wait_ready(s, timeout_ms);
}

int supervisor_store_count(Supervisor *s) {
        int k;

        pthread_mutex_lock(&s->lock);
        k = sync_locked(s);
        if (k == 0)
                k = (int)s->n_store;
        pthread_mutex_unlock(&s->lock);
        return k;
}

int supervisor_store_find(Supervisor *s, const char *name, int *ret_fd) {
        int k, n = 0, fd = -EBADF;

        pthread_mutex_lock(&s->lock);
        k = sync_locked(s);
        for (size_t i = 0; k == 0 && i < s->n_store; i++)
                if (strcmp(s->store[i].name, name) == 0 && n++ == 0 && ret_fd) {
                        fd = fcntl(s->store[i].fd, F_DUPFD_CLOEXEC, 3);
                        if (fd < 0)
                                k = -errno;
                }
        pthread_mutex_unlock(&s->lock);
        if (k < 0)
                return k;
        if (ret_fd)
                *ret_fd = fd;
        return n;
}

int supervisor_store_put(Supervisor *s, int fd, const char *name) {
        int k, copy = fcntl(fd, F_DUPFD_CLOEXEC, 3);

        if (copy < 0)
                return -errno;
        pthread_mutex_lock(&s->lock);
        k = sync_locked(s);
        if (k == 0)
                k = store_add(s, copy, name, false);
        else
                safe_close(copy);
        pthread_mutex_unlock(&s->lock);
        return k < 0 ? k : k == 0 ? -EEXIST : 0;
}

void supervisor_store_clear(Supervisor *s) {
        pthread_mutex_lock(&s->lock);
        s->clear_requested = true;
        (void)sync_locked(s);
        pthread_mutex_unlock(&s->lock);
}

char *supervisor_status(Supervisor *s) {
        char *r;

        pthread_mutex_lock(&s->lock);
        (void)sync_locked(s);
        r = s->status ? strdup(s->status) : NULL;
        pthread_mutex_unlock(&s->lock);
        return r;
}

SupervisorStats supervisor_stats(Supervisor *s) {
        SupervisorStats r;

        pthread_mutex_lock(&s->lock);
        (void)sync_locked(s);
        r = s->stats;
        pthread_mutex_unlock(&s->lock);
        return r;
}

pid_t supervisor_pid(Supervisor *s) {
        pid_t r;

        pthread_mutex_lock(&s->lock);
        r = s->pid;
        pthread_mutex_unlock(&s->lock);
        return r;
}

int supervisor_last_exit(Supervisor *s) {
        int r;

        pthread_mutex_lock(&s->lock);
        r = s->last_exit;
        pthread_mutex_unlock(&s->lock);
        return r;
}

int64_t supervisor_ready_usec(Supervisor *s) {
        int64_t r;

        pthread_mutex_lock(&s->lock);
        r = s->pid > 0 && s->ready_at > 0 ? (int64_t)(s->ready_at - s->exec_at) : -1;
        pthread_mutex_unlock(&s->lock);
        return r;
}

const char *supervisor_socket_path(Supervisor *s) {
        return s->socket_path;
}

int supervisor_listen_fd(Supervisor *s) {
        return s->listen_fd;
}

Supervisor *supervisor_free(Supervisor *s) {
        if (!s)
                return NULL;
        if (s->thread_started) {
                live_remove(s);
                if (supervisor_pid(s) > 0)
                        (void)supervisor_stop(s, SIGKILL);
                pthread_mutex_lock(&s->lock);
                s->quit = true;
                wake(s);
                pthread_mutex_unlock(&s->lock);
                pthread_join(s->thread, NULL);
        }
        if (s->pid > 0) {
                /* not even SIGKILL got it out: do not wait for it */
                (void)kill(-s->pid, SIGKILL);
                (void)kill(s->pid, SIGKILL);
        }
        while (s->n_store > 0)
                store_drop(s, s->n_store - 1);
        free(s->store);
        safe_close(s->pidfd);
        safe_close(s->listen_fd);
        safe_close(s->notify_fd);
        safe_close(s->wake_fd);
        if (s->dir[0]) {
                if (s->socket_bound)
                        (void)unlink(s->socket_path);
                (void)unlink(s->notify_path);
                (void)rmdir(s->dir);
        }
        free(s->status);
        free(s->path);
        free(s->socket_name);
        for (size_t i = 0; s->argv && s->argv[i]; i++)
                free(s->argv[i]);
        free(s->argv);
        pthread_cond_destroy(&s->cond);
        pthread_mutex_destroy(&s->lock);
        free(s);
        return NULL;
}
