/* SPDX-License-Identifier: MIT */

/*
 * A stand-in daemon for tests/supervisor: it takes what it is passed with libsystemd's
 * sd_listen_fds_with_names() (the listening socket by its name, at fd 3, and stored fds), says READY=1,
 * and serves one-line commands on the socket, one line of reply each, with which a test stores fds in the
 * supervisor (sd_pid_notify_with_fds()), removes them, and asks what the process was given at start:
 *
 *   pid                          its pid
 *   env                          LISTEN_FDS, LISTEN_FDNAMES, LISTEN_PID (ok/bad/unset), NOTIFY_SOCKET
 *                                (set/unset) and sd_watchdog_enabled()'s interval as found at start
 *   fds                          what it was passed, in fd order: NAME:listen@INODE, NAME:memfd=CONTENT,
 *                                NAME:pipe or NAME:other, space separated
 *   store NAME CONTENT [nopoll]  a memfd holding CONTENT, stored as NAME ("-": no FDNAME=), FDPOLL=0 if nopoll
 *   storemany N NAME             N memfds ("NAME-0"...) in one FDSTORE=1 message
 *   pipe NAME poll|nopoll        stores a pipe's read end; the daemon keeps the write end
 *   closepipe NAME               closes that write end (the stored read end then hangs up)
 *   remove NAME                  FDSTOREREMOVE=1 with FDNAME=NAME
 *   restore NAME                 stores again the fd it was passed at start as NAME (a duplicate)
 *   foreign NAME CONTENT         a child process stores a memfd (the supervisor must refuse it)
 *   raw N TEXT                   sends TEXT ('|' for newline) with N memfds ("raw-0"...)
 *   status TEXT                  STATUS=TEXT
 *   watchdog off                 stops sending WATCHDOG=1
 *   trigger                      WATCHDOG=trigger
 *   ignoreterm                   SIGTERM is ignored from now on
 *   exit CODE                    exits at once with CODE
 *
 * Replies are "ok", a value, or "error ...". On SIGTERM it sends STOPPING=1 and exits 0. Options:
 * --socket-name NAME (default "varlink"), --exit-before-ready CODE.
 */

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdbool.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <systemd/sd-daemon.h>
#include <time.h>
#include <unistd.h>

#define MAX_CLIENTS 16
#define MAX_PASSED 256
#define MAX_PIPES 16
#define LINE_MAX_LEN 1024
#define REPLY_MAX 8192

typedef struct Client {
        int fd;
        size_t n;
        char buf[LINE_MAX_LEN];
} Client;

static struct {
        int fd;
        char *name;
} passed[MAX_PASSED];
static size_t n_passed;

static struct {
        int write_fd;
        char name[64];
} pipes[MAX_PIPES];
static size_t n_pipes;

static char env_report[1024];
static uint64_t watchdog_usec;
static bool watchdog_on = true, ignore_term;

static uint64_t now_usec(void) {
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000ULL + (uint64_t)ts.tv_nsec / 1000ULL;
}

static int memfd_with(const char *name, const char *content) {
        size_t len = strlen(content);
        int fd = memfd_create(name, MFD_CLOEXEC);

        if (fd < 0)
                return -errno;
        if (write(fd, content, len) != (ssize_t)len) {
                close(fd);
                return -EIO;
        }
        return fd;
}

/* Sends `state` with `fds` to the supervisor. */
static int notify_fds(const char *state, const int *fds, unsigned n) {
        int k = sd_pid_notify_with_fds(0, 0, state, fds, n);

        return k > 0 ? 0 : k == 0 ? -ENOTCONN : k;
}

static void describe(int fd, const char *name, char *out, size_t len) {
        size_t used = strlen(out);
        char content[256] = "";
        struct stat st;

        if (fstat(fd, &st) < 0)
                snprintf(out + used, len - used, "%s%s:badfd", used ? " " : "", name);
        else if (S_ISSOCK(st.st_mode) && sd_is_socket_unix(fd, SOCK_STREAM, 1, NULL, 0) > 0)
                snprintf(out + used, len - used, "%s%s:listen@%llu", used ? " " : "", name,
                         (unsigned long long)st.st_ino);
        else if (S_ISREG(st.st_mode)) {
                ssize_t n = pread(fd, content, sizeof(content) - 1, 0);

                content[n > 0 ? n : 0] = 0;
                snprintf(out + used, len - used, "%s%s:memfd=%s", used ? " " : "", name, content);
        } else if (S_ISFIFO(st.st_mode))
                snprintf(out + used, len - used, "%s%s:pipe", used ? " " : "", name);
        else
                snprintf(out + used, len - used, "%s%s:other", used ? " " : "", name);
}

static int store_memfd(const char *name, const char *content, bool poll) {
        char state[512];
        int fd, k;

        fd = memfd_with(strcmp(name, "-") == 0 ? "stored" : name, content);
        if (fd < 0)
                return fd;
        if (strcmp(name, "-") == 0)
                snprintf(state, sizeof(state), "FDSTORE=1%s", poll ? "" : "\nFDPOLL=0");
        else
                snprintf(state, sizeof(state), "FDSTORE=1\nFDNAME=%s%s", name, poll ? "" : "\nFDPOLL=0");
        k = notify_fds(state, &fd, 1);
        close(fd);                      /* the supervisor's copy is what keeps it now */
        return k;
}

static int store_many(unsigned n, const char *name) {
        int fds[64], k = 0;
        char state[512];
        unsigned made = 0;

        if (n > 64)
                return -E2BIG;
        for (; made < n; made++) {
                char content[128];

                snprintf(content, sizeof(content), "%s-%u", name, made);
                fds[made] = memfd_with(name, content);
                if (fds[made] < 0) {
                        k = fds[made];
                        break;
                }
        }
        if (k == 0) {
                snprintf(state, sizeof(state), "FDSTORE=1\nFDNAME=%s\nFDPOLL=0", name);
                k = notify_fds(state, fds, n);
        }
        for (unsigned i = 0; i < made; i++)
                close(fds[i]);
        return k;
}

static int store_pipe(const char *name, bool poll) {
        char state[512];
        int p[2], k;

        if (n_pipes >= MAX_PIPES)
                return -E2BIG;
        if (pipe2(p, O_CLOEXEC) < 0)
                return -errno;
        snprintf(state, sizeof(state), "FDSTORE=1\nFDNAME=%s%s", name, poll ? "" : "\nFDPOLL=0");
        k = notify_fds(state, &p[0], 1);
        close(p[0]);
        pipes[n_pipes].write_fd = p[1];
        snprintf(pipes[n_pipes].name, sizeof(pipes[n_pipes].name), "%s", name);
        n_pipes++;
        return k;
}

static int close_pipe(const char *name) {
        for (size_t i = 0; i < n_pipes; i++)
                if (pipes[i].write_fd >= 0 && strcmp(pipes[i].name, name) == 0) {
                        close(pipes[i].write_fd);
                        pipes[i].write_fd = -1;
                        return 0;
                }
        return -ENOENT;
}

static int foreign(const char *name, const char *content) {
        int status;
        pid_t pid = fork();

        if (pid < 0)
                return -errno;
        if (pid == 0)
                _exit(store_memfd(name, content, false) < 0 ? 1 : 0);
        if (waitpid(pid, &status, 0) != pid)
                return -errno;
        return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : -EIO;
}

static int raw(unsigned n, char *text) {
        int fds[16], k = 0;
        unsigned made = 0;

        if (n > 16)
                return -E2BIG;
        for (char *p = text; *p; p++)
                if (*p == '|')
                        *p = '\n';
        for (; made < n; made++) {
                char content[32];

                snprintf(content, sizeof(content), "raw-%u", made);
                fds[made] = memfd_with("raw", content);
                if (fds[made] < 0) {
                        k = fds[made];
                        break;
                }
        }
        if (k == 0)
                k = notify_fds(text, fds, n);
        for (unsigned i = 0; i < made; i++)
                close(fds[i]);
        return k;
}

static void handle(char *line, char *reply, size_t len) {
        char *save = NULL, *cmd = strtok_r(line, " ", &save), *a = strtok_r(NULL, " ", &save),
             *b = strtok_r(NULL, " ", &save), *c = strtok_r(NULL, " ", &save);
        int k = -EINVAL;

        reply[0] = 0;
        if (!cmd)
                k = -EINVAL;
        else if (strcmp(cmd, "pid") == 0) {
                snprintf(reply, len, "%d", (int)getpid());
                return;
        } else if (strcmp(cmd, "env") == 0) {
                snprintf(reply, len, "%s", env_report);
                return;
        } else if (strcmp(cmd, "fds") == 0) {
                for (size_t i = 0; i < n_passed; i++)
                        describe(passed[i].fd, passed[i].name, reply, len);
                return;
        } else if (strcmp(cmd, "store") == 0 && a && b)
                k = store_memfd(a, b, !(c && strcmp(c, "nopoll") == 0));
        else if (strcmp(cmd, "storemany") == 0 && a && b)
                k = store_many((unsigned)atoi(a), b);
        else if (strcmp(cmd, "pipe") == 0 && a && b)
                k = store_pipe(a, strcmp(b, "poll") == 0);
        else if (strcmp(cmd, "closepipe") == 0 && a)
                k = close_pipe(a);
        else if (strcmp(cmd, "remove") == 0 && a) {
                char state[512];

                snprintf(state, sizeof(state), "FDSTOREREMOVE=1\nFDNAME=%s", a);
                k = notify_fds(state, NULL, 0);
        } else if (strcmp(cmd, "restore") == 0 && a) {
                k = -ENOENT;
                for (size_t i = 1; i < n_passed; i++)
                        if (strcmp(passed[i].name, a) == 0) {
                                char state[512];

                                snprintf(state, sizeof(state), "FDSTORE=1\nFDNAME=%s\nFDPOLL=0", a);
                                k = notify_fds(state, &passed[i].fd, 1);
                                break;
                        }
        } else if (strcmp(cmd, "foreign") == 0 && a && b)
                k = foreign(a, b);
        else if (strcmp(cmd, "raw") == 0 && a && b)
                k = raw((unsigned)atoi(a), b);
        else if (strcmp(cmd, "status") == 0 && a) {
                char state[512];

                snprintf(state, sizeof(state), "STATUS=%s", a);
                k = notify_fds(state, NULL, 0);
        } else if (strcmp(cmd, "watchdog") == 0 && a && strcmp(a, "off") == 0) {
                watchdog_on = false;
                k = 0;
        } else if (strcmp(cmd, "trigger") == 0)
                k = notify_fds("WATCHDOG=trigger", NULL, 0);
        else if (strcmp(cmd, "ignoreterm") == 0) {
                ignore_term = true;
                k = 0;
        } else if (strcmp(cmd, "exit") == 0 && a)
                _exit(atoi(a));
        if (k < 0)
                snprintf(reply, len, "error %s", strerror(-k));
        else
                snprintf(reply, len, "ok");
}

/* Reads what a client sent and answers each complete line. Returns false when it is gone. */
static bool serve(Client *c) {
        ssize_t n = read(c->fd, c->buf + c->n, sizeof(c->buf) - c->n);
        char *nl;

        if (n <= 0)
                return n < 0 && errno == EINTR;
        c->n += (size_t)n;
        while ((nl = memchr(c->buf, '\n', c->n))) {
                static char reply[REPLY_MAX];
                size_t used = (size_t)(nl - c->buf) + 1, r;

                *nl = 0;
                handle(c->buf, reply, sizeof(reply) - 1);
                r = strlen(reply);
                reply[r++] = '\n';
                if (write(c->fd, reply, r) != (ssize_t)r)
                        return false;
                memmove(c->buf, c->buf + used, c->n - used);
                c->n -= used;
        }
        return c->n < sizeof(c->buf);   /* a line too long: drop the client */
}

int main(int argc, char **argv) {
        const char *socket_name = "varlink", *pid_env = getenv("LISTEN_PID");
        struct rlimit no_core = { 0, 0 };
        Client clients[MAX_CLIENTS];
        size_t n_clients = 0;
        char **names = NULL;
        uint64_t next_ping = 0;
        int n, exit_before_ready = -1, sigfd, listen_fd;
        sigset_t mask;

        for (int i = 1; i < argc; i++) {
                if (strcmp(argv[i], "--socket-name") == 0 && i + 1 < argc)
                        socket_name = argv[++i];
                else if (strcmp(argv[i], "--exit-before-ready") == 0 && i + 1 < argc)
                        exit_before_ready = atoi(argv[++i]);
                else {
                        fprintf(stderr, "fake-daemon: unknown argument %s\n", argv[i]);
                        return 2;
                }
        }
        (void)setrlimit(RLIMIT_CORE, &no_core);        /* the watchdog test ends with SIGABRT */

        snprintf(env_report, sizeof(env_report), "LISTEN_FDS=%s LISTEN_FDNAMES=%s LISTEN_PID=%s NOTIFY_SOCKET=%s",
                 getenv("LISTEN_FDS") ?: "unset", getenv("LISTEN_FDNAMES") ?: "unset",
                 !pid_env ? "unset" : atol(pid_env) == (long)getpid() ? "ok" : "bad",
                 getenv("NOTIFY_SOCKET") ? "set" : "unset");
        if (sd_watchdog_enabled(0, &watchdog_usec) <= 0)
                watchdog_usec = 0;
        snprintf(env_report + strlen(env_report), sizeof(env_report) - strlen(env_report), " WATCHDOG_USEC=%llu",
                 (unsigned long long)watchdog_usec);

        n = sd_listen_fds_with_names(1, &names);
        if (n < 1 || n > MAX_PASSED || !names || strcmp(names[0], socket_name) != 0 ||
            sd_is_socket_unix(SD_LISTEN_FDS_START, SOCK_STREAM, 1, NULL, 0) <= 0) {
                fprintf(stderr, "fake-daemon: no listening socket named %s at fd 3 (%d fds)\n", socket_name, n);
                return 1;
        }
        for (int i = 0; i < n; i++) {
                passed[n_passed].fd = SD_LISTEN_FDS_START + i;
                passed[n_passed++].name = names[i];
        }
        free(names);
        listen_fd = SD_LISTEN_FDS_START;
        if (exit_before_ready >= 0)
                return exit_before_ready;

        sigemptyset(&mask);
        sigaddset(&mask, SIGTERM);
        sigprocmask(SIG_BLOCK, &mask, NULL);
        sigfd = signalfd(-1, &mask, SFD_CLOEXEC);
        if (sigfd < 0 || fcntl(listen_fd, F_SETFL, fcntl(listen_fd, F_GETFL) | O_NONBLOCK) < 0) {
                perror("fake-daemon");
                return 1;
        }
        if (watchdog_usec > 0)
                next_ping = now_usec() + watchdog_usec / 4;
        if (sd_notify(0, "READY=1\nSTATUS=serving") <= 0) {
                fprintf(stderr, "fake-daemon: no NOTIFY_SOCKET\n");
                return 1;
        }

        for (;;) {
                struct pollfd p[2 + MAX_CLIENTS];
                int timeout = -1;

                p[0] = (struct pollfd){ .fd = listen_fd, .events = POLLIN };
                p[1] = (struct pollfd){ .fd = sigfd, .events = POLLIN };
                for (size_t i = 0; i < n_clients; i++)
                        p[2 + i] = (struct pollfd){ .fd = clients[i].fd, .events = POLLIN };
                if (watchdog_on && watchdog_usec > 0) {
                        uint64_t now = now_usec();

                        timeout = now >= next_ping ? 0 : (int)((next_ping - now + 999) / 1000);
                }
                if (poll(p, 2 + n_clients, timeout) < 0 && errno != EINTR) {
                        perror("fake-daemon: poll");
                        return 1;
                }
                if (watchdog_on && watchdog_usec > 0 && now_usec() >= next_ping) {
                        (void)sd_notify(0, "WATCHDOG=1");
                        next_ping = now_usec() + watchdog_usec / 4;
                }
                if (p[1].revents & POLLIN) {
                        struct signalfd_siginfo si;

                        if (read(sigfd, &si, sizeof(si)) == sizeof(si) && si.ssi_signo == SIGTERM && !ignore_term) {
                                (void)sd_notify(0, "STOPPING=1");
                                return 0;
                        }
                }
                for (size_t i = n_clients; i > 0; i--)
                        if (p[2 + i - 1].revents && !serve(&clients[i - 1])) {
                                close(clients[i - 1].fd);
                                clients[i - 1] = clients[--n_clients];
                        }
                if (p[0].revents & POLLIN)
                        for (;;) {
                                int fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC);

                                if (fd < 0)
                                        break;
                                if (n_clients >= MAX_CLIENTS) {
                                        close(fd);
                                        continue;
                                }
                                clients[n_clients].fd = fd;
                                clients[n_clients++].n = 0;
                        }
        }
}
