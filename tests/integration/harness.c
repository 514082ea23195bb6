/* SPDX-License-Identifier: MIT */

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/pidfd.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "macro.h"

#define READY_TIMEOUT_MS 60000
#define STOP_TIMEOUT_MS 30000

/* A new socket of `type` and the address of `path` for it, or a negative errno. */
static int unix_socket(const char *path, int type, struct sockaddr_un *ret_sa) {
        int fd;

        *ret_sa = (struct sockaddr_un){ .sun_family = AF_UNIX };
        if (strlen(path) >= sizeof(ret_sa->sun_path))
                return -ENAMETOOLONG;
        strcpy(ret_sa->sun_path, path);
        fd = socket(AF_UNIX, type | SOCK_CLOEXEC, 0);
        return fd < 0 ? -errno : fd;
}

int harness_notify_socket(const char *path) {
        struct sockaddr_un sa;
        int fd, one = 1;

        fd = unix_socket(path, SOCK_DGRAM, &sa);
        if (fd < 0)
                return fd;
        if (setsockopt(fd, SOL_SOCKET, SO_PASSCRED, &one, sizeof(one)) < 0 ||
            bind(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
                int k = -errno;

                safe_close(fd);
                return k;
        }
        return fd;
}

int harness_notify_receive(int fd, int timeout_ms, char *buf, size_t len, pid_t *ret_sender) {
        union {
                struct cmsghdr h;
                char buf[CMSG_SPACE(sizeof(struct ucred))];
        } control;
        struct iovec iov = { .iov_base = buf, .iov_len = len - 1 };
        struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = &control,
                             .msg_controllen = sizeof(control) };
        struct pollfd p = { .fd = fd, .events = POLLIN };
        ssize_t n;
        int k;

        do
                k = poll(&p, 1, timeout_ms);
        while (k < 0 && errno == EINTR);
        if (k < 0)
                return -errno;
        if (k == 0)
                return -ETIMEDOUT;
        n = recvmsg(fd, &mh, MSG_DONTWAIT);
        if (n < 0)
                return -errno;
        buf[n] = 0;
        *ret_sender = 0;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
                if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_CREDENTIALS)
                        *ret_sender = ((struct ucred *)(void *)CMSG_DATA(c))->pid;
        return 0;
}

/*
 * Reads notifications until one carries READY=1, the daemon exits, or time runs out. The daemon's pidfd
 * is watched beside the notify socket, so a daemon that dies before it is ready is noticed at once.
 */
static int wait_ready(Harness *h, int fd) {
        _cleanup_close_ int pidfd = pidfd_open(h->pid, 0);

        if (pidfd < 0)
                return -errno;
        for (;;) {
                struct pollfd p[2] = {
                        { .fd = fd, .events = POLLIN },
                        { .fd = pidfd, .events = POLLIN },
                };
                char buf[4096];
                ssize_t n;
                int k;

                k = poll(p, 2, READY_TIMEOUT_MS);
                if (k < 0 && errno == EINTR)
                        continue;
                if (k < 0)
                        return -errno;
                if (k == 0)
                        return -ETIMEDOUT;
                if (p[0].revents & POLLIN) {
                        n = recv(fd, buf, sizeof(buf) - 1, MSG_DONTWAIT);
                        if (n < 0 && errno != EAGAIN && errno != EINTR)
                                return -errno;
                        if (n >= 0) {
                                char *save = NULL;

                                buf[n] = 0;
                                for (char *line = strtok_r(buf, "\n", &save); line;
                                     line = strtok_r(NULL, "\n", &save))
                                        if (strcmp(line, "READY=1") == 0)
                                                return 0;
                        }
                        continue;       /* read every notification sent before an exit */
                }
                if (p[1].revents) {
                        (void)waitpid(h->pid, NULL, 0);
                        h->pid = 0;
                        return -ECHILD;
                }
        }
}

/* A listening socket at `path`, as a service manager makes it for socket activation. */
static int listening_socket(const char *path) {
        struct sockaddr_un sa;
        int fd;

        fd = unix_socket(path, SOCK_STREAM, &sa);
        if (fd < 0)
                return fd;
        if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0 || listen(fd, SOMAXCONN) < 0) {
                int k = -errno;

                safe_close(fd);
                return k;
        }
        return fd;
}

int harness_start(Harness *h, const char *const *args) {
        return harness_start_full(h, args, 0);
}

int harness_start_full(Harness *h, const char *const *args, unsigned n_listen) {
        _cleanup_close_ int listen_fd = -EBADF;
        const char *daemon = getenv("VMMBROKER_DAEMON");
        pid_t parent = getpid();
        char notify[128], unused[128], config[128];
        int fd, k;

        if (!daemon)
                return -ENOENT;
        *h = (Harness){};
        strcpy(h->dir, "/tmp/vmmb-test-XXXXXX");
        if (!mkdtemp(h->dir))
                return -errno;
        snprintf(h->socket, sizeof(h->socket), "%s/io.vmmbroker", h->dir);
        snprintf(notify, sizeof(notify), "%s/notify", h->dir);
        snprintf(unused, sizeof(unused), "%s/not-inherited", h->dir);
        snprintf(config, sizeof(config), "%s/vmmbroker.conf", h->dir);
        if (n_listen > 0) {
                listen_fd = listening_socket(h->socket);
                if (listen_fd < 0)
                        return listen_fd;
        }
        fd = harness_notify_socket(notify);
        if (fd < 0)
                return fd;

        h->pid = fork();
        if (h->pid < 0) {
                safe_close(fd);
                return -errno;
        }
        if (h->pid == 0) {
                /* With sockets passed, --socket names a path the daemon must not bind. The configuration
                 * file named does not exist, so the host's own plays no part; a test that wants one
                 * passes its own --config, which comes later and wins. */
                const char *argv[32] = { daemon, "--socket", n_listen > 0 ? unused : h->socket,
                                         "--config", config };
                size_t n = 5;

                /* A test that fails (its process exits) must not leave a daemon behind. */
                if (prctl(PR_SET_PDEATHSIG, SIGTERM) < 0 || getppid() != parent)
                        _exit(127);

                for (size_t i = 0; args && args[i] && n < ELEMENTSOF(argv) - 1; i++)
                        argv[n++] = args[i];
                setenv("NOTIFY_SOCKET", notify, 1);
                if (n_listen > 0) {
                        char pid[16], count[16];

                        /* What systemd does: the sockets from fd 3 on, LISTEN_PID naming the daemon. Move
                         * ours out of the way first: dup2() onto itself would keep it close-on-exec. */
                        int high = fcntl(listen_fd, F_DUPFD_CLOEXEC, 64);

                        for (unsigned i = 0; i < n_listen; i++)
                                if (high < 0 || dup2(high, 3 + (int)i) < 0)
                                        _exit(127);
                        snprintf(pid, sizeof(pid), "%d", (int)getpid());
                        snprintf(count, sizeof(count), "%u", n_listen);
                        setenv("LISTEN_PID", pid, 1);
                        setenv("LISTEN_FDS", count, 1);
                }
                execv(daemon, (char *const *)argv);
                _exit(127);
        }
        k = wait_ready(h, fd);
        safe_close(fd);
        unlink(notify);
        if (k < 0) {
                if (h->pid > 0) {
                        kill(h->pid, SIGKILL);
                        (void)waitpid(h->pid, NULL, 0);
                        h->pid = 0;
                }
                unlink(h->socket);
                rmdir(h->dir);
        }
        return k;
}

int harness_stop(Harness *h) {
        _cleanup_close_ int pidfd = -EBADF;
        struct pollfd p;
        int status, k;

        if (h->pid <= 0)
                return -1;
        pidfd = pidfd_open(h->pid, 0);
        if (pidfd < 0)
                return -1;
        if (kill(h->pid, SIGTERM) < 0)
                return -1;
        /* A daemon that does not exit on SIGTERM is a failure, not a hang. */
        p = (struct pollfd){ .fd = pidfd, .events = POLLIN };
        do
                k = poll(&p, 1, STOP_TIMEOUT_MS);
        while (k < 0 && errno == EINTR);
        if (k <= 0)
                kill(h->pid, SIGKILL);
        if (waitpid(h->pid, &status, 0) != h->pid)
                return -1;
        h->pid = 0;
        unlink(h->socket);
        rmdir(h->dir);
        if (h->config[0])
                (void)unlink(h->config);
        if (k <= 0)
                return -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

int harness_freeze(Harness *h) {
        int status = 0;
        pid_t k;

        if (kill(h->pid, SIGSTOP) < 0)
                return -errno;
        /* SIGSTOP cannot be blocked or handled: the daemon is stopped once waitpid() says so */
        do
                k = waitpid(h->pid, &status, WUNTRACED);
        while (k < 0 && errno == EINTR);
        if (k < 0)
                return -errno;
        return WIFSTOPPED(status) ? 0 : -ECHILD;
}

int harness_thaw(Harness *h) {
        return kill(h->pid, SIGCONT) < 0 ? -errno : 0;
}

uint64_t harness_now_msec(void) {
        struct timespec ts;

        (void)clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

uint64_t harness_poll_deadline(void) {
        return harness_now_msec() + HARNESS_POLL_MS;
}

int harness_fd_count(pid_t pid) {
        char path[64];
        struct dirent *de;
        DIR *d;
        int n = 0;

        snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
        d = opendir(path);
        if (!d)
                return -1;
        while ((de = readdir(d)))
                if (de->d_name[0] != '.')
                        n++;
        closedir(d);
        return n;
}

pid_t harness_fork(int (*fn)(void *arg), void *arg) {
        pid_t parent = getpid(), pid;

        fflush(stdout);                 /* or the child writes out the parent's buffered output again */
        fflush(stderr);
        pid = fork();
        if (pid == 0) {
                /* A child blocked on a pipe must not outlive a test that failed. */
                if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0 || getppid() != parent)
                        _exit(127);
                _exit(fn(arg));
        }
        return pid;
}

int harness_wait(pid_t pid) {
        int status;
        pid_t k;

        do
                k = waitpid(pid, &status, 0);
        while (k < 0 && errno == EINTR);
        if (k != pid)
                return -1;
        if (WIFSIGNALED(status))
                return 128 + WTERMSIG(status);
        return WEXITSTATUS(status);
}

int harness_connect(const char *path) {
        struct timeval tv = { .tv_sec = HARNESS_IO_TIMEOUT_S };
        struct sockaddr_un sa;
        int fd;

        fd = unix_socket(path, SOCK_STREAM, &sa);
        if (fd < 0)
                return fd;
        if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) < 0 ||
            setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) < 0 ||
            connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
                int k = -errno;

                safe_close(fd);
                return k;
        }
        return fd;
}

int harness_conn_open(const char *path, bool accept_fds, VarlinkConn **ret) {
        int fd = harness_connect(path), k;

        if (fd < 0)
                return fd;
        k = varlink_conn_new(ret, fd, VARLINK_MAX_REPLY, accept_fds);
        if (k < 0)
                safe_close(fd);
        return k;
}

int harness_status_on(VarlinkConn *c, WireDevice *ret) {
        json_object *call = NULL, *msg = NULL;
        VarlinkReply r = {};
        StatusReply s = {};
        int k;

        k = varlink_call_new(VMMB_METHOD_STATUS, NULL, false, false, &call);
        if (k == 0)
                k = varlink_conn_send(c, call, NULL, 0);
        if (k == 0)
                k = varlink_conn_flush(c);
        if (k == 0)
                k = varlink_conn_receive(c, &msg, NULL, NULL);  /* 1: a message */
        if (k > 0)
                k = varlink_reply_parse(msg, &r);
        if (k == 0)
                k = r.error ? -EREMOTEIO : status_reply_decode(r.parameters, &s, NULL);
        if (k == 0 && s.n_devices < 1)
                k = -ENODEV;
        if (k == 0) {
                *ret = s.devices[0];
                ret->name = NULL;
        }
        status_reply_done(&s);
        varlink_reply_done(&r);
        json_object_put(msg);
        json_object_put(call);
        return k;
}

int harness_status(const char *path, WireDevice *ret) {
        VarlinkConn *c = NULL;
        int k;

        k = harness_conn_open(path, false, &c);
        if (k < 0)
                return k;
        k = harness_status_on(c, ret);
        varlink_conn_free(c);
        return k;
}

int harness_metric(const char *text, const char *key, uint64_t *ret) {
        const char *at = strstr(text ?: "", key), *value;
        char *end;

        if (!at)
                return -ENOENT;
        value = at + strlen(key);
        if (*value < '0' || *value > '9')
                return -EINVAL;
        errno = 0;
        *ret = strtoull(value, &end, 10);
        if (errno != 0 || *end != '\n')
                return -EINVAL;
        return 0;
}

int harness_write_config(const char *text, char path[static 64]) {
        size_t len = strlen(text);
        int fd, k = 0;

        snprintf(path, 64, "/tmp/vmmb-config-XXXXXX");
        fd = mkstemp(path);
        if (fd < 0)
                return -errno;
        if (len > 0 && write(fd, text, len) != (ssize_t)len)
                k = errno > 0 ? -errno : -EIO;
        safe_close(fd);
        if (k < 0)
                (void)unlink(path);
        return k;
}

int harness_start_config(Harness *h, const char *config, const char *const *args) {
        const char *argv[11] = { "--config" };
        char path[64];
        size_t n = 2;
        int k;

        for (size_t i = 0; args && args[i]; i++) {
                if (n == ELEMENTSOF(argv) - 1)
                        return -E2BIG;
                argv[n++] = args[i];
        }
        k = harness_write_config(config, path);
        if (k < 0)
                return k;
        argv[1] = path;
        k = harness_start(h, argv);
        if (k < 0) {
                (void)unlink(path);
                return k;
        }
        memcpy(h->config, path, sizeof(h->config));
        return 0;
}

int harness_start_capped(Harness *h, const char *capacity, const char *config) {
        _cleanup_free_ char *text = NULL;
        int k;

        if (asprintf(&text, "[Limits]\nMaxBytes=1G\n%s", config ?: "") < 0)
                return -ENOMEM;
        k = harness_start_config(h, text, (const char *const[]){ "--capacity", capacity, NULL });
        if (k < 0)
                return k;
        /* As root, other uids' processes (the tests' connectors) reach the socket too. */
        if (geteuid() == 0 && (chmod(h->dir, 0711) < 0 || chmod(h->socket, 0666) < 0))
                return -errno;
        return 0;
}
