/* SPDX-License-Identifier: MIT */

/*
 * Tenant safety, second round: what one user of the daemon can do to another, each attack run as a
 * hostile uid (forked children that switch to 65532, 65533 or 65534 with setresuid) against the real
 * daemon on the simulated device (harness.h), over raw varlink (rawclient.h). One START_TEST per attack;
 * the comment above each states the attack and what the broker promises against it.
 *
 *   connections   a flood of a user's connections over its MaxConnections= never takes a slot of the
 *                 global table (MaxConnectionsTotal=) nor keeps more than 8 refused connections waiting:
 *                 test_connection_flood_locks_out_others, test_silent_flood_fills_default_table,
 *                 test_refused_connections_do_not_wait; MaxProcesses=: test_process_flood.
 *   names         a published name lives in its owner's namespace: test_planted_name,
 *                 test_foreign_name_probing.
 *   tokens        only the owner's processes make tokens; Tokens(id) lists them: test_token_exhaustion.
 *
 * The tests that set a key older daemons do not know (MaxConnectionsTotal=, MaxProcesses=) say so when the
 * daemon refuses to start with it. Checks of several promises in one attack are gathered and reported
 * together, so a failure lists every promise broken, not only the first.
 *
 * Nothing sleeps to synchronise: pipes, waitpid() and request/reply round trips order everything; every
 * blocking wait has a bound (IO_TIMEOUT_S on pipes and sockets, deadlines on the floods).
 */

#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "codec.h"
#include "harness.h"
#include "json.h"
#include "macro.h"
#include "rawclient.h"
#include "unit.h"

#define MiB (UINT64_C(1) << 20)
#define UID_A 65533                     /* the victim, or the prober of another's names */
#define UID_B 65534                     /* the attacker ("nobody") */
#define UID_C 65532                     /* a third user */
#define STR(x) STR_(x)
#define STR_(x) #x

#define DEFAULT_MAX_CONNECTIONS 64      /* [Limits] MaxConnections= by default */
#define REFUSED_WAITING_MAX 8           /* refused connections of one user that may wait for their first call */
#define METHOD_TOKENS "io.vmmbroker.Tokens"     /* new: not in older codec.h */

static double now_s(void) {
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* ---- gathered failures --------------------------------------------------------------------------- */

static char failures[16384];
static unsigned n_failures;

static void soft_fail(const char *fmt, ...) _printf_(1, 2);
static void soft_fail(const char *fmt, ...) {
        size_t len = strlen(failures);
        va_list ap;

        n_failures++;
        if (len + 8 >= sizeof(failures))
                return;
        snprintf(failures + len, sizeof(failures) - len, "\n  %u. ", n_failures);
        len = strlen(failures);
        va_start(ap, fmt);
        vsnprintf(failures + len, sizeof(failures) - len, fmt, ap);
        va_end(ap);
}

#define SOFT(cond, ...)                                                                                 \
        do {                                                                                            \
                if (!(cond))                                                                            \
                        soft_fail(__VA_ARGS__);                                                         \
        } while (0)

static void soft_done(const char *attack) {
        ck_assert_msg(n_failures == 0, "%s: %u promise(s) broken:%s", attack, n_failures, failures);
}

/* ---- the daemon ---------------------------------------------------------------------------------- */

typedef struct Daemon {
        Harness h;
} Daemon;

/*
 * Starts a daemon with `config` as its configuration file ("" for none) and opens its socket to every
 * user. `why` explains a refusal to start (a key the daemon does not know).
 */
static void daemon_start(Daemon *d, const char *config, const char *why) {
        int k = *config ? harness_start_config(&d->h, config, NULL) : harness_start(&d->h, NULL);

        ck_assert_msg(k == 0, "the daemon did not start with the configuration \"%s\" (%s)%s%s", config,
                      strerror(-k), why ? ": " : "", why ?: "");
        ck_assert_int_eq(chmod(d->h.dir, 0711), 0);
        ck_assert_int_eq(chmod(d->h.socket, 0666), 0);
}

static void daemon_stop(Daemon *d) {
        int k = harness_stop(&d->h);

        ck_assert_msg(k == 0, "the daemon exited with %d", k);
}

/* ---- children of other users --------------------------------------------------------------------- */

static int become(uid_t uid) {
        if (setgroups(0, NULL) < 0 || setresgid(uid, uid, uid) < 0 || setresuid(uid, uid, uid) < 0)
                return -errno;
        return 0;
}

/* Raises the soft fd limit to the hard one (children that open many connections). Returns the limit. */
static rlim_t fd_limit_raise(void) {
        struct rlimit rl;

        if (getrlimit(RLIMIT_NOFILE, &rl) < 0)
                return 0;
        rl.rlim_cur = rl.rlim_max;
        (void)setrlimit(RLIMIT_NOFILE, &rl);
        return rl.rlim_cur;
}

/*
 * A child that runs as another user and reports one failure message through a pipe ("" for success):
 * CK() in it records why and returns 1.
 */
static char child_msg[4096];

#define CK(cond, ...)                                                                                   \
        do {                                                                                            \
                if (!(cond)) {                                                                          \
                        snprintf(child_msg, sizeof(child_msg), __VA_ARGS__);                            \
                        return 1;                                                                       \
                }                                                                                       \
        } while (0)

typedef struct AsUser {
        uid_t uid;
        int (*fn)(void *arg);
        void *arg;
        int msg_w;
        int keep[4];                    /* further fds the child keeps (-1: none) */
} AsUser;

static int as_user_main(void *p) {
        AsUser *a = p;
        int keep[5] = { a->msg_w, a->keep[0], a->keep[1], a->keep[2], a->keep[3] };
        int k;

        (void)signal(SIGPIPE, SIG_IGN);
        child_msg[0] = 0;
        k = close_all_but(keep, ELEMENTSOF(keep));
        if (k < 0)
                snprintf(child_msg, sizeof(child_msg), "close_all_but: %s", strerror(-k));
        else if ((k = become(a->uid)) < 0)
                snprintf(child_msg, sizeof(child_msg), "cannot become uid %u: %s", (unsigned)a->uid, strerror(-k));
        else if (a->fn(a->arg) != 0 && !child_msg[0])
                snprintf(child_msg, sizeof(child_msg), "failed without saying why");
        (void)write(a->msg_w, child_msg, strlen(child_msg));
        return child_msg[0] ? 1 : 0;
}

typedef struct Running {
        pid_t pid;
        int msg_r;
} Running;

/* Forks fn(arg) as `uid`, keeping the fds in keep[] (up to 4, -1 for none). */
static Running as_user_start(uid_t uid, int (*fn)(void *), void *arg, const int *keep, size_t n_keep) {
        AsUser a = { .uid = uid, .fn = fn, .arg = arg, .keep = { -1, -1, -1, -1 } };
        Running r;
        int p[2];

        ck_assert_int_le(n_keep, 4);
        for (size_t i = 0; i < n_keep; i++)
                a.keep[i] = keep[i];
        ck_assert_int_eq(pipe2(p, O_CLOEXEC), 0);
        a.msg_w = p[1];
        r.pid = harness_fork(as_user_main, &a);
        ck_assert_int_gt(r.pid, 0);
        close(p[1]);
        r.msg_r = p[0];
        return r;
}

/* Waits for the child; returns its failure message (static, "" on success). */
static const char *as_user_finish(Running *r) {
        static char msg[sizeof(child_msg) + 64];
        size_t got = 0;
        ssize_t n;
        int status;

        while (got + 1 < sizeof(msg) && (n = pipe_get(r->msg_r, msg + got, sizeof(msg) - 1 - got)) > 0)
                got += (size_t)n;
        msg[got] = 0;
        close(r->msg_r);
        status = harness_wait(r->pid);
        if (status != 0 && got == 0)
                snprintf(msg, sizeof(msg), "the child exited with status %d without saying why", status);
        return msg;
}

/* Runs fn(arg) as `uid` to its end and ck_asserts that it succeeded. */
static void as_user_run(uid_t uid, const char *what, int (*fn)(void *), void *arg) {
        Running r = as_user_start(uid, fn, arg, NULL, 0);
        const char *msg = as_user_finish(&r);

        ck_assert_msg(!*msg, "%s (uid %u): %s", what, (unsigned)uid, msg);
}

/* ---- actors: a process of another user that makes calls on one connection when told to --------- */

/*
 * The test sends an actor "METHOD\0PARAMS" and gets back {"error": ?string, "parameters": {...}} (the
 * reply), or {"io_error": "..."} when the call got no reply (the connection was closed). The actor keeps
 * its connection, and so its holds, until its command pipe closes. Fds that come with replies are closed.
 */
typedef struct Actor {
        pid_t pid;
        uid_t uid;
        int cmd_w, rep_r;
} Actor;

typedef struct ActorArg {
        const char *socket;
        uid_t uid;
        int cmd_r, rep_w;
} ActorArg;

static int msg_put(int fd, const char *s, size_t len) {
        uint32_t n = (uint32_t)len;

        if (write(fd, &n, sizeof(n)) != (ssize_t)sizeof(n))
                return -EIO;
        while (len > 0) {
                ssize_t w = write(fd, s, len);

                if (w <= 0)
                        return -EIO;
                s += w;
                len -= (size_t)w;
        }
        return 0;
}

/* A message from a pipe (malloc'd, NUL-terminated, *ret_len its length) or NULL (EOF, error, timeout). */
static char *msg_get(int fd, size_t *ret_len) {
        uint32_t n;
        char *s;

        if (pipe_get_all(fd, &n, sizeof(n)) < 0 || n > 16 * MiB)
                return NULL;
        s = malloc(n + 1);
        if (!s)
                return NULL;
        if (pipe_get_all(fd, s, n) < 0) {
                free(s);
                return NULL;
        }
        s[n] = 0;
        if (ret_len)
                *ret_len = n;
        return s;
}

static int actor_main(void *p) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        const ActorArg *a = p;
        const char *ready;
        int k;

        (void)signal(SIGPIPE, SIG_IGN);
        if (close_all_but((const int[]){ a->cmd_r, a->rep_w }, 2) < 0)
                return 1;
        if ((k = become(a->uid)) < 0) {
                fprintf(stderr, "actor: cannot become uid %u: %s\n", (unsigned)a->uid, strerror(-k));
                return 1;
        }
        k = conn_open(a->socket, &c);
        ready = k == 0 ? "{}" : "{\"io_error\": \"connect\"}";
        if (msg_put(a->rep_w, ready, strlen(ready)) < 0)
                return 1;
        for (;;) {
                _cleanup_(json_object_putp) json_object *out = NULL;
                _cleanup_free_ char *cmd = NULL;
                const char *params;
                size_t len;
                Reply r = {};

                cmd = msg_get(a->cmd_r, &len);
                if (!cmd)
                        return 0;               /* told to go: exits, and its holds end */
                params = cmd + strlen(cmd) + 1;
                out = json_object_new_object();
                k = c ? call_text(c, cmd, *params ? params : NULL, &r) : -ENOTCONN;
                if (k < 0) {
                        json_object_object_add(out, "io_error", json_object_new_string(strerror(-k)));
                        c = varlink_conn_free(c);
                } else {
                        json_object_object_add(out, "error", r.error ? json_object_new_string(r.error) : NULL);
                        json_object_object_add(out, "parameters", json_object_get(r.params));
                        reply_done(&r);
                }
                params = json_object_to_json_string_ext(out, JSON_C_TO_STRING_PLAIN);
                if (msg_put(a->rep_w, params, strlen(params)) < 0)
                        return 1;
        }
}

/* Starts an actor of `uid`, connected. */
static Actor actor_start(const Daemon *d, uid_t uid) {
        ActorArg a = { .socket = d->h.socket, .uid = uid };
        Actor x = { .uid = uid };
        int cmd[2], rep[2];
        char *ready;

        ck_assert_int_eq(pipe2(cmd, O_CLOEXEC), 0);
        ck_assert_int_eq(pipe2(rep, O_CLOEXEC), 0);
        a.cmd_r = cmd[0];
        a.rep_w = rep[1];
        x.pid = harness_fork(actor_main, &a);
        ck_assert_int_gt(x.pid, 0);
        close(cmd[0]);
        close(rep[1]);
        x.cmd_w = cmd[1];
        x.rep_r = rep[0];
        ready = msg_get(x.rep_r, NULL);
        ck_assert_msg(ready && strcmp(ready, "{}") == 0, "the actor of uid %u could not connect: %s", (unsigned)uid,
                      ready ?: "it exited");
        free(ready);
        return x;
}

/* Ends an actor: it exits, and the daemon drops its holds. */
static void actor_stop(Actor *x) {
        close(x->cmd_w);
        ck_assert_msg(harness_wait(x->pid) == 0, "the actor of uid %u failed (see its stderr)", (unsigned)x->uid);
        close(x->rep_r);
}

/* The actor calls method(params...) and returns what it got (see above); ck_asserts that it answered. */
static json_object *actor_call(Actor *x, const char *method, const char *fmt, ...) _printf_(3, 4);
static json_object *actor_call(Actor *x, const char *method, const char *fmt, ...) {
        _cleanup_free_ char *params = NULL, *cmd = NULL, *out = NULL;
        json_object *o;
        va_list ap;
        int len;

        va_start(ap, fmt);
        ck_assert_int_ge(vasprintf(&params, fmt, ap), 0);
        va_end(ap);
        len = asprintf(&cmd, "%s%c%s", method, 0, params);
        ck_assert_int_ge(len, 0);
        ck_assert_int_eq(msg_put(x->cmd_w, cmd, (size_t)len), 0);
        out = msg_get(x->rep_r, NULL);
        ck_assert_msg(out, "the actor of uid %u died calling %s(%s)", (unsigned)x->uid, method, params);
        o = json_tokener_parse(out);
        ck_assert_ptr_nonnull(o);
        return o;
}

/* The error of an actor's result ("" for success, "(no reply: ...)" when the connection closed). */
static const char *res_error(json_object *o) {
        static char buf[128];
        json_object *v;

        if (json_object_object_get_ex(o, "io_error", &v)) {
                snprintf(buf, sizeof(buf), "(no reply: %s)", json_object_get_string(v));
                return buf;
        }
        if (json_object_object_get_ex(o, "error", &v) && json_object_is_type(v, json_type_string))
                return json_object_get_string(v);
        return "";
}

static bool res_is(json_object *o, const char *error) {
        return strcmp(res_error(o), error ?: "") == 0;
}

static json_object *res_params(json_object *o) {
        json_object *v = NULL;

        (void)json_object_object_get_ex(o, "parameters", &v);
        return v;
}

/* The result as text, for messages. */
static const char *res_text(json_object *o) {
        return json_object_to_json_string_ext(o, JSON_C_TO_STRING_PLAIN);
}

/* A member of `o` by a path of keys (NULL-terminated), or NULL. */
static json_object *get(json_object *o, ...) {
        const char *key;
        va_list ap;

        va_start(ap, o);
        while (o && (key = va_arg(ap, const char *)))
                if (!json_object_object_get_ex(o, key, &o))
                        o = NULL;
        va_end(ap);
        return o;
}

static const char *get_str(json_object *o, const char *key) {
        json_object *v = get(o, key, NULL);

        return v && json_object_is_type(v, json_type_string) ? json_object_get_string(v) : NULL;
}

/* ---- connection floods ---------------------------------------------------------------------------- */

/*
 * The attacker: opens `n` connections and, whenever the daemon closes one, opens another at once,
 * until `stop_r` closes. It never sends a byte (silent connections: the worst kind, they wait the
 * longest). Reports FloodReady once every slot was opened at least once (or after a bound), then
 * FloodStats at the end.
 */
typedef struct Flood {
        const char *socket;
        unsigned n;
        int report_w, stop_r;
} Flood;

typedef struct FloodStats {
        unsigned opened;                /* slots open when it reported ready */
        uint64_t connects, closed, refused_connect;
        char error[128];
} FloodStats;

static int flood_connect(const struct sockaddr_un *sa, uint64_t *refused) {
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);

        if (fd < 0)
                return -errno;
        if (connect(fd, (const struct sockaddr *)sa, sizeof(*sa)) < 0) {
                int k = -errno;

                close(fd);
                if (k == -EAGAIN || k == -ECONNREFUSED)
                        (*refused)++;           /* the backlog is full: try again on the next turn */
                return k;
        }
        return fd;
}

static int flood_main(void *p) {
        const Flood *f = p;
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        _cleanup_free_ struct pollfd *pfd = calloc(f->n + 1, sizeof(struct pollfd));
        FloodStats st = {};
        bool reported = false;
        double start = now_s();
        char buf[4096];

        if (!pfd)
                return 1;
        snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", f->socket);
        if (fd_limit_raise() < f->n + 64) {
                snprintf(st.error, sizeof(st.error), "RLIMIT_NOFILE too low for %u connections", f->n);
                (void)write(f->report_w, &st, sizeof(st));
                return 1;
        }
        for (unsigned i = 0; i < f->n; i++)
                pfd[i] = (struct pollfd){ .fd = -1, .events = POLLIN | POLLRDHUP };
        pfd[f->n] = (struct pollfd){ .fd = f->stop_r, .events = POLLIN };
        for (;;) {
                unsigned open = 0;
                int k;

                for (unsigned i = 0; i < f->n; i++) {
                        if (pfd[i].fd < 0) {
                                k = flood_connect(&sa, &st.refused_connect);
                                if (k >= 0) {
                                        pfd[i].fd = k;
                                        st.connects++;
                                } else if (k != -EAGAIN && k != -ECONNREFUSED && !st.error[0])
                                        snprintf(st.error, sizeof(st.error), "connect: %s", strerror(-k));
                        }
                        open += pfd[i].fd >= 0;
                }
                if (!reported && (open == f->n || now_s() - start > 30)) {
                        st.opened = open;
                        if (write(f->report_w, &st, sizeof(st)) != (ssize_t)sizeof(st))
                                return 1;
                        reported = true;
                }
                /* a full backlog: wait for a close (or 10 ms, then try the backlog again) */
                k = poll(pfd, f->n + 1, open == f->n ? 60000 : 10);
                if (k < 0 && errno != EINTR)
                        return 1;
                if (pfd[f->n].revents)
                        break;                  /* stop */
                for (unsigned i = 0; k > 0 && i < f->n; i++) {
                        ssize_t n;

                        if (pfd[i].fd < 0 || !pfd[i].revents)
                                continue;
                        n = recv(pfd[i].fd, buf, sizeof(buf), MSG_DONTWAIT);
                        if (n > 0 && !(pfd[i].revents & (POLLHUP | POLLRDHUP | POLLERR)))
                                continue;       /* an answer to nothing: read it, wait for the close */
                        if (n < 0 && errno == EAGAIN && !(pfd[i].revents & (POLLHUP | POLLRDHUP | POLLERR)))
                                continue;
                        close(pfd[i].fd);       /* closed by the daemon: reconnect on the next turn */
                        pfd[i].fd = -1;
                        st.closed++;
                }
        }
        for (unsigned i = 0; i < f->n; i++)
                if (pfd[i].fd >= 0)
                        close(pfd[i].fd);
        return write(f->report_w, &st, sizeof(st)) == (ssize_t)sizeof(st) ? 0 : 1;
}

typedef struct RunningFlood {
        Running r;
        int report_r, stop_w;
        FloodStats ready;
} RunningFlood;

static RunningFlood flood_start(const Daemon *d, uid_t uid, unsigned n) {
        static Flood f;                 /* the child gets a copy at fork */
        RunningFlood x = {};
        int report[2], stop[2];

        ck_assert_int_eq(pipe2(report, O_CLOEXEC), 0);
        ck_assert_int_eq(pipe2(stop, O_CLOEXEC), 0);
        f = (Flood){ .socket = d->h.socket, .n = n, .report_w = report[1], .stop_r = stop[0] };
        x.r = as_user_start(uid, flood_main, &f, (const int[]){ report[1], stop[0] }, 2);
        close(report[1]);
        close(stop[0]);
        x.report_r = report[0];
        x.stop_w = stop[1];
        ck_assert_msg(pipe_get_all(x.report_r, &x.ready, sizeof(x.ready)) == 0,
                      "the flood of uid %u did not start: %s", (unsigned)uid, as_user_finish(&x.r));
        ck_assert_msg(!x.ready.error[0], "the flood of uid %u: %s", (unsigned)uid, x.ready.error);
        return x;
}

static FloodStats flood_stop(RunningFlood *x) {
        FloodStats st = {};
        const char *msg;

        close(x->stop_w);
        ck_assert_int_eq(pipe_get_all(x->report_r, &st, sizeof(st)), 0);
        close(x->report_r);
        msg = as_user_finish(&x->r);
        ck_assert_msg(!*msg, "the flood: %s", msg);
        return st;
}

/* The victim: `n` Status calls, each on a fresh connection. */
typedef struct Probe {
        const char *socket;
        unsigned n;
        int report_w;
} Probe;

typedef struct ProbeResult {
        unsigned ok, failed;
        double worst_s;
        char first_failure[256];
} ProbeResult;

static int probe_main(void *p) {
        const Probe *a = p;
        ProbeResult res = {};
        double deadline = now_s() + 40;        /* within CK_DEFAULT_TIMEOUT (60 s) */

        for (unsigned i = 0; i < a->n && now_s() < deadline && res.failed < 20; i++) {
                _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
                double t = now_s();
                Reply r = {};
                int k;

                k = conn_open(a->socket, &c);
                if (k == 0)
                        k = call_text(c, VMMB_METHOD_STATUS, NULL, &r);
                if (k == 0 && !r.error) {
                        res.ok++;
                        res.worst_s = MAX(res.worst_s, now_s() - t);
                } else {
                        if (!res.failed)
                                snprintf(res.first_failure, sizeof(res.first_failure), "call %u: %s%s%s", i + 1,
                                         k < 0 ? strerror(-k) : r.error, k < 0 ? "" : " ",
                                         k < 0 ? "" : json_object_to_json_string(r.params));
                        res.failed++;
                }
                reply_done(&r);
        }
        return write(a->report_w, &res, sizeof(res)) == (ssize_t)sizeof(res) ? 0 : 1;
}

static ProbeResult probe_run(const Daemon *d, uid_t uid, unsigned n) {
        static Probe a;
        ProbeResult res = {};
        Running r;
        int p[2];
        const char *msg;
        int k;

        ck_assert_int_eq(pipe2(p, O_CLOEXEC), 0);
        a = (Probe){ .socket = d->h.socket, .n = n, .report_w = p[1] };
        r = as_user_start(uid, probe_main, &a, (const int[]){ p[1] }, 1);
        close(p[1]);
        /* pipe_get's bound is IO_TIMEOUT_S; the probe may take up to its own 40 s deadline */
        for (int i = 0; i < 2; i++) {
                k = pipe_get_all(p[0], &res, sizeof(res));
                if (k != -ETIMEDOUT)
                        break;
        }
        close(p[0]);
        msg = as_user_finish(&r);
        ck_assert_msg(k == 0 && !*msg, "the probe of uid %u: %s %s", (unsigned)uid, strerror(-k), msg);
        return res;
}

/*
 * Attack: uid 65534 opens 10x its MaxConnections (640) silent connections and reconnects every one the
 * daemon closes, as fast as it can, against a daemon whose global table is small (MaxConnectionsTotal=256).
 * Promise: only accepted connections, charged to their user, take a slot of the global table; refused ones
 * never do (at most 8 of them wait, briefly, per user). So uid 65533's Status, each call on a fresh
 * connection, succeeds every time while the flood runs.
 */
START_TEST(test_connection_flood_locks_out_others) {
        RunningFlood flood;
        ProbeResult pr;
        FloodStats st;
        WireDevice dev;
        Daemon d;

        if (geteuid() != 0) {
                fprintf(stderr, "%s: not root, cannot run clients of other uids\n", __func__);
                return;
        }
        daemon_start(&d, "[Broker]\nMaxConnectionsTotal=256\n",
                     "a daemon that does not know [Broker] MaxConnectionsTotal= cannot bound its connection table");
        flood = flood_start(&d, UID_B, 10 * DEFAULT_MAX_CONNECTIONS);
        pr = probe_run(&d, UID_A, 200);
        st = flood_stop(&flood);
        fprintf(stderr, "%s: flood of %u: %" PRIu64 " connects, %" PRIu64 " closed by the daemon, %" PRIu64
                " backlog-full retries; uid %u: %u of 200 Status calls served, slowest %.3f s\n",
                __func__, flood.ready.opened, st.connects, st.closed, st.refused_connect, UID_A, pr.ok, pr.worst_s);
        ck_assert_msg(pr.ok == 200,
                      "while uid %u held %u connections, uid %u's Status failed %u times of %u (first: %s): "
                      "refused connections took the global table",
                      UID_B, 10 * DEFAULT_MAX_CONNECTIONS, UID_A, pr.failed, pr.ok + pr.failed, pr.first_failure);
        /* the flood was refused and reconnected: what the test is about did happen (how many of the 640 were
         * closed by the time the probe is done depends on the machine's load: the daemon accepts 8 at a time,
         * between rounds of serving, so that a flood of connections delays nobody's requests) */
        ck_assert_msg(st.closed > REFUSED_WAITING_MAX,
                      "the daemon closed only %" PRIu64 " of the flood's connections", st.closed);
        ck_assert_int_eq(harness_status(d.h.socket, &dev), 0);
        daemon_stop(&d);
}
END_TEST

/*
 * Attack: the one today's daemon falls to: uid 65534 opens ~4,200 silent connections (more than the 4,096
 * of the old fixed table) with the default configuration, and reconnects those closed.
 * Promise: the same as above with the table the daemon derives from its fd limit: uid 65533's Status,
 * each on a fresh connection, succeeds every time.
 */
START_TEST(test_silent_flood_fills_default_table) {
        const unsigned n = 4200;
        RunningFlood flood;
        ProbeResult pr;
        FloodStats st;
        struct rlimit rl;
        Daemon d;

        if (geteuid() != 0) {
                fprintf(stderr, "%s: not root, cannot run clients of other uids\n", __func__);
                return;
        }
        ck_assert_int_eq(getrlimit(RLIMIT_NOFILE, &rl), 0);
        if (rl.rlim_max < n + 1024) {
                fprintf(stderr, "%s: RLIMIT_NOFILE hard limit %llu is too low for %u connections, skipped\n",
                        __func__, (unsigned long long)rl.rlim_max, n);
                return;
        }
        daemon_start(&d, "", NULL);
        flood = flood_start(&d, UID_B, n);
        pr = probe_run(&d, UID_A, 50);
        st = flood_stop(&flood);
        fprintf(stderr, "%s: flood of %u (%u open at once): %" PRIu64 " connects, %" PRIu64 " closed; uid %u: %u of "
                "50 Status calls served, slowest %.3f s\n",
                __func__, n, flood.ready.opened, st.connects, st.closed, UID_A, pr.ok, pr.worst_s);
        ck_assert_msg(pr.ok == 50,
                      "while uid %u held %u silent connections, uid %u's Status failed %u times of %u (first: %s): "
                      "refused connections filled the daemon's connection table",
                      UID_B, n, UID_A, pr.failed, pr.ok + pr.failed, pr.first_failure);
        daemon_stop(&d);
}
END_TEST

/* ---- refused connections do not wait ----------------------------------------------------------- */

/* The `connections` of the caller's user, from Users. */
static int users_connections(VarlinkConn *c, uint64_t *ret) {
        Reply r;
        json_object *users, *v;
        int k = call_text(c, VMMB_METHOD_USERS, NULL, &r);

        if (k < 0)
                return k;
        users = get(r.params, "users", NULL);
        if (r.error || !users || json_object_array_length(users) < 1 ||
            !(v = get(json_object_array_get_idx(users, 0), "connections", NULL))) {
                reply_done(&r);
                return -EBADMSG;
        }
        *ret = (uint64_t)json_object_get_int64(v);
        reply_done(&r);
        return 0;
}

/* Waits until `fd` is closed by the daemon, at most until `deadline`: 1 closed with no byte, 0 not closed by
 * then, -EBADMSG something came (an answer), another negative errno otherwise. */
static int closed_silently(int fd, double deadline) {
        char buf[256];

        for (;;) {
                struct pollfd p = { .fd = fd, .events = POLLIN | POLLRDHUP };
                double left = deadline - now_s();
                ssize_t n;
                int k;

                k = poll(&p, 1, left > 0 ? (int)(left * 1000) + 1 : 0);
                if (k < 0 && errno == EINTR)
                        continue;
                if (k < 0)
                        return -errno;
                if (k == 0)
                        return 0;
                n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
                if (n == 0 || (n < 0 && errno == ECONNRESET))
                        return 1;
                if (n > 0)
                        return -EBADMSG;
                if (errno != EAGAIN && errno != EINTR)
                        return -errno;
        }
}

#define N_SILENT 24

static int refused_child(void *arg) {
        const char *socket = arg;
        VarlinkConn *charged[DEFAULT_MAX_CONNECTIONS] = {};
        _cleanup_(varlink_conn_freep) VarlinkConn *r0 = NULL, *z = NULL;
        _cleanup_free_ char *message = NULL;
        int silent[N_SILENT];
        unsigned closed = 0, answered = 0, kept = 0;
        uint64_t conns = 0;
        double t, deadline;
        VmmbError e = {};
        Reply r = {};
        int k;

        /* 64 connections: the user's limit, all accepted and charged (Users counts them). */
        for (size_t i = 0; i < ELEMENTSOF(charged); i++) {
                k = conn_open(socket, &charged[i]);
                CK(k == 0, "connection %zu of %d: %s", i + 1, DEFAULT_MAX_CONNECTIONS, strerror(-k));
        }
        for (uint64_t end = harness_poll_deadline(); conns != DEFAULT_MAX_CONNECTIONS && harness_now_msec() < end;) {
                k = users_connections(charged[0], &conns);
                CK(k == 0, "Users: %s", strerror(-k));
        }
        CK(conns == DEFAULT_MAX_CONNECTIONS, "Users says %" PRIu64 " connections, not %d", conns,
           DEFAULT_MAX_CONNECTIONS);

        /* The 65th: its first call is answered QuotaExceeded "connections" (about at once), then it closes. */
        CK(conn_open(socket, &r0) == 0, "the 65th connection could not connect");
        t = now_s();
        k = call_text(r0, VMMB_METHOD_STATUS, NULL, &r);
        CK(k == 0, "the 65th connection's first call got no answer: %s", strerror(-k));
        CK(r.error && strcmp(r.error, VMMB_ERROR_QUOTA_EXCEEDED) == 0, "the 65th connection's Status: %s",
           r.error ?: "served");
        k = vmmb_error_decode(r.error, r.params, &e, &message);
        CK(k == 0 && e.resource && strcmp(e.resource, "connections") == 0, "QuotaExceeded for %s, not connections",
           e.resource ?: json_object_to_json_string(r.params));
        vmmb_error_done(&e);
        reply_done(&r);
        CK(now_s() - t < 2, "the 65th connection's answer took %.2f s", now_s() - t);
        k = closed_silently(varlink_conn_get_fd(r0), now_s() + 10);
        CK(k == 1, "the 65th connection was not closed after its answer (%d)", k);

        /* 24 more, silent: at most 8 of them may wait for a first call; the others are closed at once. */
        t = now_s();
        for (size_t i = 0; i < N_SILENT; i++) {
                silent[i] = harness_connect(socket);
                CK(silent[i] >= 0, "silent connection %zu: %s", i + 1, strerror(-silent[i]));
        }
        /* One more, calling at once: with 24 refused connections just opened, it is beyond the 8 that may wait,
         * so it is closed without an answer. */
        k = conn_open(socket, &z);
        CK(k == 0, "the probe connection: %s", strerror(-k));
        k = call_text(z, VMMB_METHOD_STATUS, NULL, &r);
        if (k == 0) {
                snprintf(child_msg, sizeof(child_msg),
                         "with %d refused connections of its user just opened, a further one was kept waiting and its "
                         "call answered (%s): more than %d refused connections wait at once",
                         N_SILENT, r.error ?: "served", REFUSED_WAITING_MAX);
                reply_done(&r);
                return 1;
        }
        /* Every silent one ends, with no byte; none waits longer than the bound. */
        deadline = t + 10;
        for (size_t i = 0; i < N_SILENT; i++) {
                k = closed_silently(silent[i], deadline);
                if (k == 1)
                        closed++;
                else if (k == -EBADMSG)
                        answered++;
                else
                        kept++;
                close(silent[i]);
        }
        CK(closed == N_SILENT,
           "of %d silent refused connections, %u were closed within 10 s, %u sent something, %u were still open: "
           "refused connections beyond the first %d must be closed at once",
           N_SILENT, closed, answered, kept, REFUSED_WAITING_MAX);
        for (size_t i = 0; i < ELEMENTSOF(charged); i++)
                varlink_conn_free(charged[i]);
        return 0;
}

/*
 * Attack: uid 65534, at its MaxConnections=, opens more connections that never send a byte, each of which
 * the daemon has to keep somewhere until it gives up on it.
 * Promise: a connection over the limit is answered QuotaExceeded ("connections") to its first call, about at
 * once, then closed; at most 8 refused connections of a user wait at once (for about 1 s); the others are
 * closed at once without an answer.
 */
START_TEST(test_refused_connections_do_not_wait) {
        Daemon d;

        if (geteuid() != 0) {
                fprintf(stderr, "%s: not root, cannot run clients of other uids\n", __func__);
                return;
        }
        daemon_start(&d, "", NULL);
        as_user_run(UID_B, "refused connections", refused_child, d.h.socket);
        daemon_stop(&d);
}
END_TEST

/*
 * Attack: uid 65534 spreads over many processes, each of which the daemon must keep a pidfd of (and watch).
 * Promise: [Limits] MaxProcesses= bounds the processes of a user the daemon keeps; a new process over it gets
 * QuotaExceeded "processes" on its first call; another user is unaffected.
 */
START_TEST(test_process_flood) {
        Actor b[5], a;
        json_object *o;
        Daemon d;

        if (geteuid() != 0) {
                fprintf(stderr, "%s: not root, cannot run clients of other uids\n", __func__);
                return;
        }
        daemon_start(&d, "[Limits]\nMaxProcesses=4\n",
                     "a daemon that does not know [Limits] MaxProcesses= keeps a pidfd of every process of a user");
        for (size_t i = 0; i < 4; i++) {
                b[i] = actor_start(&d, UID_B);
                o = actor_call(&b[i], VMMB_METHOD_STATUS, "{}");
                ck_assert_msg(res_is(o, NULL), "process %zu of uid %u (MaxProcesses=4): %s", i + 1, UID_B, res_text(o));
                json_object_put(o);
        }
        b[4] = actor_start(&d, UID_B);
        o = actor_call(&b[4], VMMB_METHOD_STATUS, "{}");
        ck_assert_msg(res_is(o, VMMB_ERROR_QUOTA_EXCEEDED) && get_str(res_params(o), "resource") &&
                              strcmp(get_str(res_params(o), "resource"), "processes") == 0,
                      "the 5th process of uid %u with MaxProcesses=4: wanted QuotaExceeded \"processes\", got %s",
                      UID_B, res_text(o));
        ck_assert_int_eq(json_object_get_int64(get(res_params(o), "limit", NULL)), 4);
        json_object_put(o);

        a = actor_start(&d, UID_A);
        o = actor_call(&a, VMMB_METHOD_STATUS, "{}");
        ck_assert_msg(res_is(o, NULL), "uid %u while uid %u is at its MaxProcesses=: %s", UID_A, UID_B, res_text(o));
        json_object_put(o);
        actor_stop(&a);
        for (size_t i = 0; i < 5; i++)
                actor_stop(&b[i]);
        daemon_stop(&d);
}
END_TEST

/* ---- names ------------------------------------------------------------------------------------------ */

/* Allocs 2 MiB as the actor; returns the result (the caller frees it) and the id in `id`. */
static json_object *alloc_as(Actor *x, char id[static VMMB_ID_MAX + 1]) {
        json_object *o = actor_call(x, VMMB_METHOD_ALLOC, "{\"size\": %" PRIu64 "}", 2 * MiB);
        const char *v = get_str(get(res_params(o), "lease", NULL), "id");

        ck_assert_msg(res_is(o, NULL) && v, "Alloc as uid %u: %s", (unsigned)x->uid, res_text(o));
        snprintf(id, VMMB_ID_MAX + 1, "%s", v);
        return o;
}

/* The user name of `uid`, or NULL when it has none (a copy of its own: getpwuid()'s is overwritten). */
static const char *user_name(uid_t uid) {
        static char names[4][64];
        static unsigned next;
        struct passwd *pw = getpwuid(uid);
        char *s = names[next++ % ELEMENTSOF(names)];

        if (!pw)
                return NULL;
        snprintf(s, sizeof(names[0]), "%s", pw->pw_name);
        return s;
}

/* Checks a lease reply's owner and owner_name; gathers what is wrong. */
static void check_owner(json_object *o, const char *what, uid_t owner) {
        json_object *lease = get(res_params(o), "lease", NULL), *v;
        const char *expected = user_name(owner), *got;

        v = get(lease, "owner", NULL);
        SOFT(v && json_object_is_type(v, json_type_int) && json_object_get_int64(v) == (int64_t)owner,
             "%s: lease.owner should be %u: %s", what, (unsigned)owner, res_text(o));
        got = get_str(lease, "owner_name");
        if (expected)
                SOFT(got && strcmp(got, expected) == 0, "%s: lease.owner_name should be \"%s\": %s", what, expected,
                     res_text(o));
        else
                SOFT(!got, "%s: uid %u has no user name, yet lease.owner_name is \"%s\"", what, (unsigned)owner, got);
}

/* An Attach by name as the actor, checked to give lease `id` owned by `owner`. */
static void attach_gives(Actor *x, const char *name, const char *id, uid_t owner) {
        json_object *o = actor_call(x, VMMB_METHOD_ATTACH, "{\"name\": \"%s\"}", name);
        const char *got = get_str(get(res_params(o), "lease", NULL), "id");
        char what[256];

        snprintf(what, sizeof(what), "uid %u's Attach(\"%s\")", (unsigned)x->uid, name);
        SOFT(res_is(o, NULL) && got && strcmp(got, id) == 0, "%s should give lease %s of uid %u: %s", what, id,
             (unsigned)owner, res_text(o));
        if (res_is(o, NULL))
                check_owner(o, what, owner);
        json_object_put(o);
}

/* The parameters of an error reply with its "name" blanked, and the name it echoed (NULL if none). */
static char *blank_name(json_object *o, const char **ret_name) {
        json_object *copy = NULL;
        char *s;

        *ret_name = get_str(res_params(o), "name");
        ck_assert_int_eq(json_object_deep_copy(o, &copy, NULL), 0);
        if (get(copy, "parameters", "name", NULL))
                json_object_object_add(get(copy, "parameters", NULL), "name", json_object_new_string(""));
        s = strdup(json_object_to_json_string_ext(copy, JSON_C_TO_STRING_PLAIN));
        json_object_put(copy);
        ck_assert_ptr_nonnull(s);
        return s;
}

/* Whether anything in the reply but the echoed name mentions `uid`. */
static bool mentions(json_object *o, const char *uid) {
        const char *name;
        _cleanup_free_ char *s = blank_name(o, &name);

        return strstr(s, uid) != NULL;
}

/*
 * Attack: uid 65534 publishes a lease under a name its victim uses ("weights"), allowing the victim, before the
 * victim does: the victim's Attach("weights") would map the attacker's memory as its own weights, and the
 * victim could not publish its own "weights" (NameInUse).
 * Promise: a name lives in its owner's namespace. NAME is the caller's own; another user's is OWNER/NAME
 * (a user name or a uid), and the reply's lease says whose it is (owner, owner_name). A name has no '/'.
 * Unpublish of another user's name is refused and changes nothing.
 */
START_TEST(test_planted_name) {
        char lb[VMMB_ID_MAX + 1], la[VMMB_ID_MAX + 1], lx[VMMB_ID_MAX + 1], name_b[300], b_name[64] = "";
        Actor a, b;
        json_object *o;
        Daemon d;

        if (geteuid() != 0) {
                fprintf(stderr, "%s: not root, cannot run clients of other uids\n", __func__);
                return;
        }
        daemon_start(&d, "", NULL);
        b = actor_start(&d, UID_B);
        a = actor_start(&d, UID_A);

        /* B plants "weights", allowing A. */
        o = alloc_as(&b, lb);
        check_owner(o, "uid 65534's Alloc", UID_B);
        json_object_put(o);
        o = actor_call(&b, VMMB_METHOD_PUBLISH, "{\"id\": \"%s\", \"name\": \"weights\", \"uids\": [" STR(UID_A) "]}",
                       lb);
        ck_assert_msg(res_is(o, NULL), "B's Publish(weights): %s", res_text(o));
        json_object_put(o);

        /* A's "weights" is A's own: A has none yet. */
        o = actor_call(&a, VMMB_METHOD_ATTACH, "{\"name\": \"weights\"}");
        SOFT(res_is(o, VMMB_ERROR_NO_SUCH_NAME),
             "A's Attach(\"weights\") with no \"weights\" of its own must be NoSuchName, not B's planted lease: %s",
             res_text(o));
        if (res_is(o, VMMB_ERROR_NO_SUCH_NAME))
                SOFT(get_str(res_params(o), "name") && strcmp(get_str(res_params(o), "name"), "weights") == 0,
                     "NoSuchName should echo \"weights\": %s", res_text(o));
        json_object_put(o);

        /* A publishes its own "weights": no NameInUse (B's is in B's namespace); then "weights" is A's. */
        o = alloc_as(&a, la);
        check_owner(o, "uid 65533's Alloc", UID_A);
        json_object_put(o);
        o = actor_call(&a, VMMB_METHOD_PUBLISH, "{\"id\": \"%s\", \"name\": \"weights\"}", la);
        SOFT(res_is(o, NULL), "A's Publish(\"weights\") must succeed while B has a \"weights\": %s", res_text(o));
        json_object_put(o);
        attach_gives(&a, "weights", la, UID_A);

        /* B's, by uid and by user name. */
        attach_gives(&a, STR(UID_B) "/weights", lb, UID_B);
        if (user_name(UID_B))
                snprintf(b_name, sizeof(b_name), "%s", user_name(UID_B));
        if (*b_name) {
                snprintf(name_b, sizeof(name_b), "%s/weights", b_name);
                attach_gives(&a, name_b, lb, UID_B);
        } else
                fprintf(stderr, "%s: uid %u has no user name: OWNER as a user name not checked\n", __func__, UID_B);

        /* A cannot remove B's name; the lease stays, published. */
        o = actor_call(&a, VMMB_METHOD_UNPUBLISH, "{\"name\": \"" STR(UID_B) "/weights\"}");
        SOFT(res_is(o, VMMB_ERROR_NO_SUCH_NAME) || res_is(o, VMMB_ERROR_PERMISSION_DENIED),
             "A's Unpublish(\"65534/weights\") must be refused (NoSuchName or PermissionDenied): %s", res_text(o));
        SOFT(!mentions(o, STR(UID_B)), "A's refused Unpublish names uid 65534: %s", res_text(o));
        json_object_put(o);
        attach_gives(&a, STR(UID_B) "/weights", lb, UID_B);

        /* Names are unique among the owner's names, and have no '/'. */
        o = alloc_as(&b, lx);
        json_object_put(o);
        o = actor_call(&b, VMMB_METHOD_PUBLISH, "{\"id\": \"%s\", \"name\": \"weights\"}", lx);
        SOFT(res_is(o, VMMB_ERROR_NAME_IN_USE), "B's second Publish(\"weights\") must be NameInUse: %s", res_text(o));
        json_object_put(o);
        o = actor_call(&b, VMMB_METHOD_PUBLISH, "{\"id\": \"%s\", \"name\": \"team/weights\"}", lx);
        SOFT(res_is(o, VMMB_ERROR_INVALID_PARAMETER), "Publish(\"team/weights\"): a name with '/' must be "
             "InvalidParameter: %s", res_text(o));
        json_object_put(o);

        /* B removes its own: then it is gone for A. */
        o = actor_call(&b, VMMB_METHOD_UNPUBLISH, "{\"name\": \"weights\"}");
        SOFT(res_is(o, NULL), "B's Unpublish(\"weights\"): %s", res_text(o));
        json_object_put(o);
        o = actor_call(&a, VMMB_METHOD_ATTACH, "{\"name\": \"" STR(UID_B) "/weights\"}");
        SOFT(res_is(o, VMMB_ERROR_NO_SUCH_NAME), "A's Attach(\"65534/weights\") after B's Unpublish: %s", res_text(o));
        json_object_put(o);
        /* A's own is still there. */
        attach_gives(&a, "weights", la, UID_A);

        actor_stop(&a);
        actor_stop(&b);
        soft_done("names planted in another user's namespace");
        daemon_stop(&d);
}
END_TEST

/*
 * Attack: uid 65533 probes uid 65534's names: which exist that it may not attach ("secret", published for
 * nobody else), which do not ("nothing"), which users exist ("nosuchuser"), as OWNER/NAME and as a bare
 * NAME (which a daemon with one namespace for all would look up among everyone's names).
 * Promise: a name that does not exist, an unknown owner and a name not published to the caller all get the
 * same NoSuchName with the name as given: the replies are byte-identical but for that name, and none names
 * another user's uid.
 */
START_TEST(test_foreign_name_probing) {
        char ls[VMMB_ID_MAX + 1], unknown[64], unknown_ref[80];
        _cleanup_free_ char *ref = NULL;
        const char *names[5], *echo;
        Actor a, b;
        json_object *o;
        Daemon d;

        if (geteuid() != 0) {
                fprintf(stderr, "%s: not root, cannot run clients of other uids\n", __func__);
                return;
        }
        snprintf(unknown, sizeof(unknown), "nosuchuser");
        for (unsigned i = 0; getpwnam(unknown); i++)
                snprintf(unknown, sizeof(unknown), "nosuchuser%u", i);
        daemon_start(&d, "", NULL);
        b = actor_start(&d, UID_B);
        a = actor_start(&d, UID_A);
        o = alloc_as(&b, ls);
        json_object_put(o);
        o = actor_call(&b, VMMB_METHOD_PUBLISH, "{\"id\": \"%s\", \"name\": \"secret\"}", ls);
        ck_assert_msg(res_is(o, NULL), "B's Publish(secret): %s", res_text(o));
        json_object_put(o);

        names[0] = STR(UID_B) "/secret";        /* exists, not for A */
        names[1] = STR(UID_B) "/nothing";       /* does not exist */
        snprintf(unknown_ref, sizeof(unknown_ref), "%s/x", unknown);
        names[2] = unknown_ref;                 /* no such owner */
        names[3] = "secret";                    /* A's own: A has none (B's is B's) */
        names[4] = "nothing";
        for (size_t i = 0; i < ELEMENTSOF(names); i++) {
                _cleanup_free_ char *blanked = NULL;

                o = actor_call(&a, VMMB_METHOD_ATTACH, "{\"name\": \"%s\"}", names[i]);
                SOFT(res_is(o, VMMB_ERROR_NO_SUCH_NAME), "A's Attach(\"%s\") must be NoSuchName: %s", names[i],
                     res_text(o));
                blanked = blank_name(o, &echo);
                SOFT(echo && strcmp(echo, names[i]) == 0, "A's Attach(\"%s\"): the name as given is not echoed: %s",
                     names[i], res_text(o));
                SOFT(!mentions(o, STR(UID_B)), "A's Attach(\"%s\") names uid 65534: %s", names[i],
                     res_text(o));
                if (!ref)
                        ref = TAKE_PTR(blanked);
                else
                        SOFT(strcmp(ref, blanked) == 0,
                             "A's Attach(\"%s\") and Attach(\"%s\") tell them apart: %s versus %s", names[0], names[i],
                             ref, blanked);
                json_object_put(o);
        }

        /* The probing changed nothing: B's secret is still B's. */
        o = actor_call(&b, VMMB_METHOD_ATTACH, "{\"name\": \"secret\"}");
        SOFT(res_is(o, NULL), "B's Attach(\"secret\") after A's probes: %s", res_text(o));
        json_object_put(o);
        actor_stop(&a);
        actor_stop(&b);
        soft_done("probing another user's names");
        daemon_stop(&d);
}
END_TEST

/* ---- tokens ----------------------------------------------------------------------------------------- */

#define LEASE_TOKENS_MAX 64

/*
 * Attack: uid 65534 holds uid 65533's lease read-only (by a token A made for B) and calls Share on it until
 * the lease's 64 tokens are used up, so that the owner cannot share its own lease any more.
 * Promise: only processes of the lease's owner make tokens (any other holder gets PermissionDenied, whatever it
 * asks); the owner sees every live token with Tokens(id) (uid, creator, readonly) and may revoke each; an
 * administrator sees them for any lease; a holder of another user gets PermissionDenied, and a user that holds
 * nothing NoSuchLease.
 */
START_TEST(test_token_exhaustion) {
        static const char *const b_shares[] = {
                "", ", \"readonly\": true", (", \"uid\": " STR(UID_B) ", \"readonly\": true"),
                (", \"uid\": " STR(UID_A) ", \"readonly\": true"), (", \"uid\": " STR(UID_B)),
        };
        char id[VMMB_ID_MAX + 1], tokens[LEASE_TOKENS_MAX][VMMB_TOKEN_MAX + 1];
        unsigned made = 0, listed = 0;
        _cleanup_(varlink_conn_freep) VarlinkConn *root = NULL;
        Actor a, b, c;
        json_object *o, *list;
        Daemon d;
        Reply r;

        if (geteuid() != 0) {
                fprintf(stderr, "%s: not root, cannot run clients of other uids\n", __func__);
                return;
        }
        daemon_start(&d, "", NULL);
        a = actor_start(&d, UID_A);
        b = actor_start(&d, UID_B);
        c = actor_start(&d, UID_C);

        /* A shares its lease with B, read-only; B attaches. */
        o = alloc_as(&a, id);
        json_object_put(o);
        o = actor_call(&a, VMMB_METHOD_SHARE, "{\"id\": \"%s\", \"uid\": " STR(UID_B) ", \"readonly\": true}", id);
        ck_assert_msg(res_is(o, NULL) && get_str(res_params(o), "token"), "A's Share: %s", res_text(o));
        snprintf(tokens[made++], sizeof(tokens[0]), "%s", get_str(res_params(o), "token"));
        json_object_put(o);
        o = actor_call(&b, VMMB_METHOD_ATTACH, "{\"token\": \"%s\"}", tokens[0]);
        ck_assert_msg(res_is(o, NULL), "B's Attach by A's token: %s", res_text(o));
        json_object_put(o);

        /* B may hold it, not make tokens for it. */
        for (size_t i = 0; i < ELEMENTSOF(b_shares); i++) {
                o = actor_call(&b, VMMB_METHOD_SHARE, "{\"id\": \"%s\"%s}", id, b_shares[i]);
                SOFT(res_is(o, VMMB_ERROR_PERMISSION_DENIED), "B's Share({id%s}) of A's lease must be "
                     "PermissionDenied: %s", b_shares[i], res_text(o));
                json_object_put(o);
        }

        /* The owner's 64 are all its own: 63 more, then QuotaExceeded "tokens". */
        for (unsigned i = 1; i < LEASE_TOKENS_MAX; i++) {
                o = actor_call(&a, VMMB_METHOD_SHARE, "{\"id\": \"%s\"%s}", id,
                               i % 3 == 0 ? ", \"readonly\": true" : i % 3 == 1 ? ", \"uid\": " STR(UID_C) : "");
                if (res_is(o, NULL) && get_str(res_params(o), "token"))
                        snprintf(tokens[made++], sizeof(tokens[0]), "%s", get_str(res_params(o), "token"));
                else {
                        soft_fail("A's token %u of %d: %s (tokens B made count against A's lease)", i + 1,
                                  LEASE_TOKENS_MAX, res_text(o));
                        json_object_put(o);
                        break;
                }
                json_object_put(o);
        }
        o = actor_call(&a, VMMB_METHOD_SHARE, "{\"id\": \"%s\"}", id);
        SOFT(res_is(o, VMMB_ERROR_QUOTA_EXCEEDED), "A's token 65: %s", res_text(o));
        json_object_put(o);

        /* A lists all 64, each made by A. */
        o = actor_call(&a, METHOD_TOKENS, "{\"id\": \"%s\"}", id);
        list = get(res_params(o), "tokens", NULL);
        SOFT(res_is(o, NULL) && list && json_object_is_type(list, json_type_array), "A's Tokens(id): %s",
             res_text(o));
        if (res_is(o, NULL) && list && json_object_is_type(list, json_type_array)) {
                listed = (unsigned)json_object_array_length(list);
                SOFT(listed == LEASE_TOKENS_MAX, "A's Tokens(id) lists %u tokens, not %d", listed, LEASE_TOKENS_MAX);
                for (unsigned i = 0; i < listed; i++) {
                        json_object *t = json_object_array_get_idx(list, i), *creator = get(t, "creator", NULL);
                        const char *tok = get_str(t, "token");
                        bool known = false;

                        for (unsigned j = 0; tok && j < made; j++)
                                known = known || strcmp(tokens[j], tok) == 0;
                        SOFT(known, "A's Tokens(id) lists a token A did not make: %s",
                             json_object_to_json_string(t));
                        SOFT(creator && json_object_get_int64(creator) == UID_A, "a token's creator is not %d: %s", UID_A,
                             json_object_to_json_string(t));
                        SOFT(get(t, "readonly", NULL), "a token without readonly: %s", json_object_to_json_string(t));
                }
                /* the first, for B read-only */
                for (unsigned i = 0; i < listed; i++) {
                        json_object *t = json_object_array_get_idx(list, i);

                        if (get_str(t, "token") && strcmp(get_str(t, "token"), tokens[0]) == 0)
                                SOFT(json_object_get_int64(get(t, "uid", NULL)) == UID_B &&
                                             json_object_get_boolean(get(t, "readonly", NULL)),
                                     "A's token for B is listed as %s", json_object_to_json_string(t));
                }
        }
        json_object_put(o);

        /* An administrator (root, not a holder) sees them too. */
        ck_assert_int_eq(conn_open(d.h.socket, &root), 0);
        {
                char params[128];

                snprintf(params, sizeof(params), "{\"id\": \"%s\"}", id);
                ck_assert_int_eq(call_text(root, METHOD_TOKENS, params, &r), 0);
                list = get(r.params, "tokens", NULL);
                SOFT(!r.error && list && json_object_array_length(list) == LEASE_TOKENS_MAX,
                     "root's Tokens(id) of A's lease: %s %s", r.error ?: "", json_object_to_json_string(r.params));
                reply_done(&r);
        }

        /* B holds it but does not own it; C holds nothing. */
        o = actor_call(&b, METHOD_TOKENS, "{\"id\": \"%s\"}", id);
        SOFT(res_is(o, VMMB_ERROR_PERMISSION_DENIED), "B's Tokens(id) (a holder, not the owner) must be "
             "PermissionDenied: %s", res_text(o));
        json_object_put(o);
        o = actor_call(&c, METHOD_TOKENS, "{\"id\": \"%s\"}", id);
        SOFT(res_is(o, VMMB_ERROR_NO_SUCH_LEASE), "C's Tokens(id) (holds nothing) must be NoSuchLease: %s",
             res_text(o));
        json_object_put(o);

        /* A revokes every one: none left, and B's token no longer attaches. */
        for (unsigned i = 0; i < made; i++) {
                o = actor_call(&a, VMMB_METHOD_REVOKE, "{\"token\": \"%s\"}", tokens[i]);
                SOFT(res_is(o, NULL), "A's Revoke of its token %u: %s", i + 1, res_text(o));
                json_object_put(o);
        }
        o = actor_call(&a, METHOD_TOKENS, "{\"id\": \"%s\"}", id);
        list = get(res_params(o), "tokens", NULL);
        SOFT(res_is(o, NULL) && list && json_object_array_length(list) == 0, "A's Tokens(id) after revoking all: %s",
             res_text(o));
        json_object_put(o);
        o = actor_call(&b, VMMB_METHOD_ATTACH, "{\"token\": \"%s\"}", tokens[0]);
        SOFT(res_is(o, VMMB_ERROR_NO_SUCH_TOKEN), "B's Attach by a revoked token: %s", res_text(o));
        json_object_put(o);

        actor_stop(&a);
        actor_stop(&b);
        actor_stop(&c);
        soft_done("another user's holder using up the owner's tokens");
        root = varlink_conn_free(root);
        daemon_stop(&d);
}
END_TEST

int main(void) {
        return run_suite(UNIT_SUITE("tenant", NULL, test_connection_flood_locks_out_others,
                                    test_silent_flood_fills_default_table,
                                    test_refused_connections_do_not_wait,
                                    test_process_flood,
                                    test_planted_name,
                                    test_foreign_name_probing,
                                    test_token_exhaustion)) == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
