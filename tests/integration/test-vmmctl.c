/* SPDX-License-Identifier: MIT */

/*
 * vmmctl against the real daemon on the simulated device. Each test starts
 * its own vmmbrokerd (harness.h), makes leases over a raw varlink connection
 * (and shares, attaches and publishes them the same way: the tests depend on
 * the protocol, not on the client library), runs $VMMCTL and checks its
 * output against what the broker says on that raw connection: the tables'
 * columns line up under their headers and carry the same numbers, a lease
 * shows one row per holder, --json carries exactly the interface's fields,
 * and the exit statuses are those of vmmctl(1). Fitting to a terminal is
 * checked under a pseudo-terminal of a known width.
 *
 * Nothing sleeps: vmmctl is waited for, and every read has a poll() timeout
 * that only turns a hang into a failure.
 */

#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <poll.h>
#include <pty.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "codec.h"
#include "fdpass.h"
#include "harness.h"
#include "json.h"
#include "macro.h"
#include "size.h"
#include "unit.h"
#include "varlink.h"

#ifndef VMMBROKER_VERSION
#error "VMMBROKER_VERSION must be the project's version"
#endif

#define MiB (UINT64_C(1) << 20)
#define IO_TIMEOUT_MS (HARNESS_IO_TIMEOUT_S * 1000)
#define MAX_LINES 64
#define NOBODY 65534
#define PTY_COLUMNS 78                  /* narrower than the status table, wide enough for its narrowest */
#define LIST_PTY_COLUMNS 100            /* the same for the list table (12 columns, 80 or more at the narrowest) */
#define USERS_PTY_COLUMNS 78            /* the same for the users table of two devices (89 wide, 74 at the narrowest) */
#define SETTLE_ROUND_TRIPS 1000         /* Users calls to wait for the broker to count closed connections out */
#define HOLDER_COMM "vmmctl-holder"     /* the command name of the second holder's process */
#define LONG_LABEL "a label long enough that no terminal of eighty columns shows all of it beside the rest"

DEFINE_TRIVIAL_CLEANUP_FUNC(VarlinkConn, varlink_conn_free);

/* ---- the broker, raw ------------------------------------------------------------------------------- */

/* Calls `method` on a fresh connection: 0 with the reply in *ret (its error name, if any, in ret->error). */
static void raw_call(const char *socket, const char *method, json_object *params, VarlinkReply *ret) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        _cleanup_(json_object_putp) json_object *call = NULL, *msg = NULL;
        int *fds = NULL;
        size_t n_fds = 0;

        ck_assert_int_eq(harness_conn_open(socket, true, &c), 0);
        ck_assert_int_eq(varlink_call_new(method, params, false, false, &call), 0);
        ck_assert_int_eq(varlink_conn_send(c, call, NULL, 0), 0);
        ck_assert_int_eq(varlink_conn_flush(c), 0);
        ck_assert_int_eq(varlink_conn_receive(c, &msg, &fds, &n_fds), 1);
        /* the leases stay with this process: their memory needs no fd to stay leased */
        close_many(fds, n_fds);
        free(fds);
        ck_assert_int_eq(varlink_reply_parse(msg, ret), 0);
}

/* Leases `size` bytes labelled `label` on `device` (or VMMB_DEVICE_ANY); returns the lease's identifier. */
static char *lease_alloc_on(const char *socket, uint64_t size, int64_t device, const char *label) {
        _cleanup_(json_object_putp) json_object *params = NULL;
        AllocParams a = { .size = size, .device = device, .label = (char *)label };
        VarlinkReply r = {};
        json_object *lease, *id;
        char *ret;

        ck_assert_int_eq(alloc_params_encode(&a, &params), 0);
        raw_call(socket, VMMB_METHOD_ALLOC, params, &r);
        ck_assert_msg(!r.error, "Alloc: %s", r.error);
        ck_assert(json_object_object_get_ex(r.parameters, "lease", &lease));
        ck_assert(json_object_object_get_ex(lease, "id", &id));
        ret = strdup(json_object_get_string(id));
        ck_assert_ptr_nonnull(ret);
        varlink_reply_done(&r);
        return ret;
}

/* Leases `size` bytes labelled `label` on any device; returns the lease's identifier (to free). */
static char *lease_alloc(const char *socket, uint64_t size, const char *label) {
        return lease_alloc_on(socket, size, VMMB_DEVICE_ANY, label);
}

/* raw_call(), asserting that the broker did not answer with an error. */
static void raw_call_ok(const char *socket, const char *method, json_object *params, VarlinkReply *ret) {
        raw_call(socket, method, params, ret);
        ck_assert_msg(!ret->error, "%s: %s", method, ret->error);
}

/* Shares lease `id` of this process with anyone; returns the token (to free). */
static char *lease_share(const char *socket, const char *id, bool readonly) {
        _cleanup_(json_object_putp) json_object *params = NULL;
        ShareParams sp = { .id = (char *)id, .uid = JSON_ABSENT, .readonly = readonly };
        ShareReply sr = {};
        VarlinkReply r = {};
        char *ret;

        ck_assert_int_eq(share_params_encode(&sp, &params), 0);
        raw_call_ok(socket, VMMB_METHOD_SHARE, params, &r);
        ck_assert_int_eq(share_reply_decode(r.parameters, &sr, NULL), 0);
        ret = TAKE_PTR(sr.token);
        share_reply_done(&sr);
        varlink_reply_done(&r);
        return ret;
}

/* Publishes lease `id` of this process under `name`, for its owner and the `n_uids` users of `uids`. */
static void lease_publish_to(const char *socket, const char *id, const char *name, uint64_t *uids, size_t n_uids) {
        _cleanup_(json_object_putp) json_object *params = NULL;
        PublishParams pp = { .id = (char *)id, .name = (char *)name, .uids = uids, .n_uids = n_uids };
        VarlinkReply r = {};

        ck_assert_int_eq(publish_params_encode(&pp, &params), 0);
        raw_call_ok(socket, VMMB_METHOD_PUBLISH, params, &r);
        varlink_reply_done(&r);
}

/* Publishes lease `id` of this process under `name`, for its owner alone. */
static void lease_publish(const char *socket, const char *id, const char *name) {
        lease_publish_to(socket, id, name, NULL, 0);
}

/* Shares lease `id` of this process with `uid` (JSON_ABSENT: anyone); returns the token (to free). */
static char *lease_share_for(const char *socket, const char *id, int64_t uid, bool readonly) {
        _cleanup_(json_object_putp) json_object *params = NULL;
        ShareParams sp = { .id = (char *)id, .uid = uid, .readonly = readonly };
        ShareReply sr = {};
        VarlinkReply r = {};
        char *ret;

        ck_assert_int_eq(share_params_encode(&sp, &params), 0);
        raw_call_ok(socket, VMMB_METHOD_SHARE, params, &r);
        ck_assert_int_eq(share_reply_decode(r.parameters, &sr, NULL), 0);
        ret = TAKE_PTR(sr.token);
        share_reply_done(&sr);
        varlink_reply_done(&r);
        return ret;
}

/* The tokens of lease `id`, raw. */
static void tokens_get(const char *socket, const char *id, TokensReply *ret) {
        _cleanup_(json_object_putp) json_object *params = NULL;
        FreeParams fp = { .id = (char *)id };
        VarlinkReply r = {};

        ck_assert_int_eq(free_params_encode(&fp, &params), 0);
        raw_call_ok(socket, VMMB_METHOD_TOKENS, params, &r);
        ck_assert_int_eq(tokens_reply_decode(r.parameters, ret, NULL), 0);
        varlink_reply_done(&r);
}

/* Attaches the lease published as `name` (NAME or OWNER/NAME) to this process; returns its identifier. */
static char *lease_attach_name(const char *socket, const char *name) {
        _cleanup_(json_object_putp) json_object *params = NULL;
        AttachParams ap = { .name = (char *)name };
        VarlinkReply r = {};
        char *ret;

        ck_assert_int_eq(attach_params_encode(&ap, &params), 0);
        raw_call(socket, VMMB_METHOD_ATTACH, params, &r);
        ck_assert_msg(!r.error, "Attach(%s): %s", name, r.error);
        /* the fds were closed by raw_call(): the hold stays without them; only the identifier is wanted */
        {
                json_object *lease, *id;

                ck_assert(json_object_object_get_ex(r.parameters, "lease", &lease));
                ck_assert(json_object_object_get_ex(lease, "id", &id));
                ret = strdup(json_object_get_string(id));
        }
        ck_assert_ptr_nonnull(ret);
        varlink_reply_done(&r);
        return ret;
}

/* Ends this process's hold on lease `id`. */
static void lease_free(const char *socket, const char *id) {
        _cleanup_(json_object_putp) json_object *params = NULL;
        FreeParams fp = { .id = (char *)id };
        VarlinkReply r = {};

        ck_assert_int_eq(free_params_encode(&fp, &params), 0);
        raw_call_ok(socket, VMMB_METHOD_FREE, params, &r);
        varlink_reply_done(&r);
}

/* Calls Unpublish(name) raw: the reply, error or not, in *ret. */
static void raw_unpublish(const char *socket, const char *name, VarlinkReply *ret) {
        _cleanup_(json_object_putp) json_object *params = NULL;
        UnpublishParams up = { .name = (char *)name };

        ck_assert_int_eq(unpublish_params_encode(&up, &params), 0);
        raw_call(socket, VMMB_METHOD_UNPUBLISH, params, ret);
}

/*
 * Another process that holds a lease: it attaches with a token (as `uid`, if
 * > 0, with the command name HOLDER_COMM) and keeps the hold until
 * holder_stop() lets it exit.
 */
typedef struct HolderProcess {
        const char *socket;
        const char *token;
        bool readonly;
        uid_t uid;
        int ready[2];                   /* it writes a byte once it holds the lease */
        int hold[2];                    /* it exits when this pipe's write end is closed */
        pid_t pid;
} HolderProcess;

/* The holder's side: no ck_assert() here, a failure is its exit status. */
static int holder_run(void *arg) {
        HolderProcess *hp = arg;
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        _cleanup_(json_object_putp) json_object *params = NULL, *call = NULL, *msg = NULL;
        AttachParams ap = { .token = (char *)hp->token, .readonly = hp->readonly };
        VarlinkReply r = {};
        int *fds = NULL;
        size_t n_fds = 0;
        char b;

        safe_close(hp->ready[0]);
        safe_close(hp->hold[1]);
        /* the daemon reads /proc/PID/comm when the process connects */
        if (prctl(PR_SET_NAME, HOLDER_COMM) < 0)
                return 10;
        if (hp->uid > 0 && (setgroups(0, NULL) < 0 || setgid((gid_t)hp->uid) < 0 || setuid(hp->uid) < 0))
                return 11;
        if (harness_conn_open(hp->socket, true, &c) < 0)
                return 12;
        if (attach_params_encode(&ap, &params) < 0 || varlink_call_new(VMMB_METHOD_ATTACH, params, false, false,
                                                                       &call) < 0)
                return 13;
        if (varlink_conn_send(c, call, NULL, 0) < 0 || varlink_conn_flush(c) < 0 ||
            varlink_conn_receive(c, &msg, &fds, &n_fds) != 1)
                return 14;
        close_many(fds, n_fds);         /* the hold stays without them */
        free(fds);
        if (varlink_reply_parse(msg, &r) < 0)
                return 15;
        if (r.error) {
                fprintf(stderr, "holder: Attach: %s\n", r.error);
                varlink_reply_done(&r);
                return 16;
        }
        varlink_reply_done(&r);
        if (write(hp->ready[1], "x", 1) != 1)
                return 17;
        while (read(hp->hold[0], &b, 1) < 0 && errno == EINTR)
                ;
        return 0;
}

/* Starts the holder and waits until it holds the lease. */
static void holder_start(HolderProcess *hp) {
        struct pollfd p;
        char b;

        ck_assert_int_eq(pipe2(hp->ready, O_CLOEXEC), 0);
        ck_assert_int_eq(pipe2(hp->hold, O_CLOEXEC), 0);
        hp->pid = harness_fork(holder_run, hp);
        ck_assert_int_ge(hp->pid, 0);
        hp->ready[1] = safe_close(hp->ready[1]);
        hp->hold[0] = safe_close(hp->hold[0]);
        p = (struct pollfd){ .fd = hp->ready[0], .events = POLLIN };
        ck_assert_msg(poll(&p, 1, IO_TIMEOUT_MS) == 1, "the holder did not attach within %d ms", IO_TIMEOUT_MS);
        if (read(hp->ready[0], &b, 1) != 1)
                ck_abort_msg("the holder failed to attach: exit status %d", harness_wait(hp->pid));
        hp->ready[0] = safe_close(hp->ready[0]);
}

/* Lets the holder exit, which ends its hold. */
static void holder_stop(HolderProcess *hp) {
        hp->hold[1] = safe_close(hp->hold[1]);
        ck_assert_int_eq(harness_wait(hp->pid), 0);
}

static void status_get(const char *socket, StatusReply *ret) {
        VarlinkReply r = {};

        raw_call(socket, VMMB_METHOD_STATUS, NULL, &r);
        ck_assert_msg(!r.error, "Status: %s", r.error);
        ck_assert_int_eq(status_reply_decode(r.parameters, ret, NULL), 0);
        ck_assert_uint_ge(ret->n_devices, 1);
        varlink_reply_done(&r);
}

static void list_get(const char *socket, ListReply *ret) {
        VarlinkReply r = {};

        raw_call(socket, VMMB_METHOD_LIST, NULL, &r);
        ck_assert_msg(!r.error, "List: %s", r.error);
        ck_assert_int_eq(list_reply_decode(r.parameters, ret, NULL), 0);
        varlink_reply_done(&r);
}

/* A daemon with three leases of this process: two labelled (one label long), one without. */
typedef struct Fixture {
        Harness h;
        char *ids[3];
} Fixture;

static void fixture_start(Fixture *f) {
        int k = harness_start(&f->h, NULL);

        ck_assert_msg(k == 0, "harness_start: %s", strerror(-k));
        f->ids[0] = lease_alloc(f->h.socket, 66 * MiB, "weights");     /* one slab of 66 MiB */
        f->ids[1] = lease_alloc(f->h.socket, 3 * MiB, LONG_LABEL);
        f->ids[2] = lease_alloc(f->h.socket, 1, NULL);
}

static void fixture_stop(Fixture *f) {
        ck_assert_int_eq(harness_stop(&f->h), 0);
        for (size_t i = 0; i < ELEMENTSOF(f->ids); i++)
                free(f->ids[i]);
}

/* ---- running vmmctl -------------------------------------------------------------------------------- */

typedef struct Output {
        char *out;                      /* stdout; with a terminal, stdout and stderr together */
        char *err;
        int status;                     /* exit status, or 128 + signal */
} Output;

static void output_done(Output *o) {
        free(o->out);
        free(o->err);
        *o = (Output){};
}

/* Reads fds[0..n) to their ends (EOF, or EIO for a terminal whose other side is closed) into ret[]. */
static void read_all(const int *fds, char **ret, size_t n) {
        FILE *m[2] = {};
        size_t len[2];
        size_t n_open = n;
        struct pollfd p[2];

        ck_assert_uint_le(n, 2);
        for (size_t i = 0; i < n; i++) {
                m[i] = open_memstream(&ret[i], &len[i]);
                ck_assert_ptr_nonnull(m[i]);
                p[i] = (struct pollfd){ .fd = fds[i], .events = POLLIN };
        }
        while (n_open > 0) {
                int k = poll(p, n, IO_TIMEOUT_MS);

                if (k < 0 && errno == EINTR)
                        continue;
                ck_assert_msg(k > 0, "vmmctl wrote nothing and did not exit within %d ms", IO_TIMEOUT_MS);
                for (size_t i = 0; i < n; i++) {
                        char buf[4096];
                        ssize_t r;

                        if (p[i].fd < 0 || !p[i].revents)
                                continue;
                        r = read(p[i].fd, buf, sizeof(buf));
                        if (r < 0 && errno == EINTR)
                                continue;
                        ck_assert_msg(r >= 0 || errno == EIO, "read: %m");
                        if (r <= 0) {
                                p[i].fd = -1;
                                n_open--;
                                continue;
                        }
                        fwrite(buf, 1, (size_t)r, m[i]);
                }
        }
        for (size_t i = 0; i < n; i++)
                ck_assert_int_eq(fclose(m[i]), 0);
}

/* How vmmctl runs; zero is on pipes, as this process, in its environment. */
typedef struct Run {
        const char *const *env;         /* "NAME=VALUE" sets, "NAME" unsets; NULL-terminated */
        unsigned pty_columns;           /* > 0: stdout and stderr are one terminal that wide (TERM=xterm,
                                           a UTF-8 locale), not two pipes */
        uid_t uid;                      /* > 0: as this user (and its group of the same number) */
} Run;

/* Runs vmmctl with `args` (NULL-terminated) as `how` says (NULL: the defaults) until it exits. */
static void run_full(const char *const *args, const Run *how, Output *ret) {
        const char *vmmctl = getenv("VMMCTL");
        const char *const *env = how ? how->env : NULL;
        unsigned pty_columns = how ? how->pty_columns : 0;
        uid_t uid = how ? how->uid : 0;
        int out[2] = { -1, -1 }, err[2] = { -1, -1 };
        char *bufs[2] = {};
        pid_t pid;

        ck_assert_ptr_nonnull(vmmctl);
        if (pty_columns > 0) {
                struct winsize ws = { .ws_row = 24, .ws_col = (unsigned short)pty_columns };

                ck_assert_int_eq(openpty(&out[0], &out[1], NULL, NULL, &ws), 0);
        } else {
                ck_assert_int_eq(pipe2(out, O_CLOEXEC), 0);
                ck_assert_int_eq(pipe2(err, O_CLOEXEC), 0);
        }
        fflush(stdout);
        fflush(stderr);
        pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
                const char *argv[32] = { vmmctl };
                size_t n = 1;

                for (size_t i = 0; args[i] && n < ELEMENTSOF(argv) - 1; i++)
                        argv[n++] = args[i];
                unsetenv("VMMBROKER_SOCKET");
                unsetenv("COLUMNS");
                unsetenv("NO_COLOR");
                if (pty_columns > 0) {
                        setenv("TERM", "xterm", 1);
                        setenv("LC_ALL", "C.UTF-8", 1);
                }
                for (size_t i = 0; env && env[i]; i++)
                        if (strchr(env[i], '='))
                                putenv((char *)env[i]);
                        else
                                unsetenv(env[i]);
                if (dup2(out[1], STDOUT_FILENO) < 0 || dup2(pty_columns > 0 ? out[1] : err[1], STDERR_FILENO) < 0)
                        _exit(127);
                if (uid > 0 && (setgroups(0, NULL) < 0 || setgid((gid_t)uid) < 0 || setuid(uid) < 0))
                        _exit(127);
                execv(vmmctl, (char *const *)argv);
                _exit(127);
        }
        safe_close(out[1]);
        safe_close(err[1]);
        if (pty_columns > 0) {
                read_all(out, bufs, 1);
                bufs[1] = strdup("");
        } else
                read_all((const int[]){ out[0], err[0] }, bufs, 2);
        safe_close(out[0]);
        safe_close(err[0]);
        *ret = (Output){ .out = bufs[0], .err = bufs[1], .status = harness_wait(pid) };
        ck_assert_ptr_nonnull(ret->err);
}

/* Runs vmmctl with `args` on pipes and the test's environment; the arguments end with NULL. */
#define RUN(ret, ...) run_full((const char *const[]){ __VA_ARGS__, NULL }, NULL, (ret))

/* Runs it and asserts success with nothing on stderr. */
#define RUN_OK(ret, ...)                                                                                \
        do {                                                                                            \
                RUN(ret, __VA_ARGS__);                                                                  \
                ck_assert_msg((ret)->status == 0, "vmmctl exited with %d: %s", (ret)->status, (ret)->err); \
                ck_assert_str_eq((ret)->err, "");                                                       \
        } while (0)

/* ---- reading tables -------------------------------------------------------------------------------- */

typedef struct Column {
        const char *name;
        bool right;                     /* right-aligned: fields end where the header ends */
} Column;

static const Column status_columns[] = {
        { "DEVICE", true }, { "NUMA", true },   { "NAME", false },  { "CAPACITY", true }, { "LEASED", true },
        { "CACHED", true }, { "FREE", true },   { "LEASES", true }, { "WAIT", true },     { "USAGE", false },
};

static const Column list_columns[] = {
        { "ID", false },   { "DEVICE", true }, { "SIZE", true },  { "SLABS", true },
        { "OWNER", false }, { "NAME", false }, { "LABEL", false }, { "RECLAIM", false }, { "AGE", true },
        { "PID", true },   { "USER", false },  { "MODE", false },  { "COMMAND", false },
};

static const Column users_columns[] = {
        { "USER", false },  { "LEASES", true }, { "CONNECTIONS", true }, { "REQUESTS", true },
        { "DEVICE", true }, { "BYTES", true },  { "LIMIT", true },       { "USAGE", false },
};

/* The users columns that a device's continuation row leaves blank: the user's own. */
static const char *const users_user_columns[] = { "USER", "LEASES", "CONNECTIONS", "REQUESTS" };

/* The list columns that a holder's continuation row leaves blank: the lease's own. */
static const char *const list_lease_columns[] = { "ID", "DEVICE", "SIZE", "SLABS", "OWNER", "NAME", "LABEL", "AGE" };

/* Splits `text` (changed in place) into lines, dropping the CRs a terminal adds. Returns the count. */
static size_t split_lines(char *text, char **lines) {
        size_t n = 0;
        char *save = NULL;

        for (char *s = text; *s; s++)
                if (*s == '\r')
                        *s = ' ';
        for (char *l = strtok_r(text, "\n", &save); l; l = strtok_r(NULL, "\n", &save)) {
                size_t len = strlen(l);

                while (len > 0 && l[len - 1] == ' ')    /* where a CR was */
                        l[--len] = 0;
                ck_assert_uint_lt(n, MAX_LINES);
                lines[n++] = l;
        }
        return n;
}

/* Removes colour sequences (ESC [ ... m) in place. */
static void strip_escapes(char *s) {
        char *w = s;

        while (*s) {
                if (s[0] == '\033' && s[1] == '[') {
                        s += 2;
                        while (*s && !(*s >= 0x40 && *s <= 0x7e))
                                s++;
                        if (*s)
                                s++;
                        continue;
                }
                *w++ = *s++;
        }
        *w = 0;
}

/* Characters (not bytes) in UTF-8 text: the tables here hold no wide characters. */
static size_t text_columns(const char *s) {
        size_t n = 0;

        for (; *s; s++)
                n += ((unsigned char)*s & 0xc0) != 0x80;
        return n;
}

/* The header must hold exactly the columns' names, in order. */
static void check_header(const char *header, const Column *cols, size_t n) {
        _cleanup_free_ char *copy = strdup(header);
        char *save = NULL, *word = strtok_r(copy, " ", &save);

        for (size_t i = 0; i < n; i++, word = strtok_r(NULL, " ", &save))
                ck_assert_msg(word && strcmp(word, cols[i].name) == 0, "header '%s': expected %s at column %zu",
                              header, cols[i].name, i);
        ck_assert_msg(!word, "header '%s' has more columns than expected", header);
}

/*
 * The field of `line` in column `name` (a byte offset in the header, which
 * holds ASCII only): a left-aligned field must start where its header starts,
 * a right-aligned one end where its header ends. Fields are separated by at
 * least two spaces; the last column runs to the end of the line. Returns a
 * new string.
 */
static char *field(const char *header, const char *line, const Column *cols, size_t n, const char *name) {
        const Column *col = NULL;
        const char *h = header;
        size_t start, end, len = strlen(line);
        bool last;

        for (size_t i = 0; i < n; i++)
                if (strcmp(cols[i].name, name) == 0)
                        col = &cols[i];
        ck_assert_ptr_nonnull(col);
        last = col == &cols[n - 1];
        /* the header's word `name`, not a part of another word */
        for (;;) {
                h = strstr(h, name);
                ck_assert_ptr_nonnull(h);
                if ((h == header || h[-1] == ' ') && (h[strlen(name)] == ' ' || !h[strlen(name)]))
                        break;
                h++;
        }
        if (col->right) {
                end = (size_t)(h - header) + strlen(name);
                ck_assert_msg(end <= len && line[end - 1] != ' ' && (end == len || line[end] == ' '),
                              "'%s' in line '%s' does not end under its header in '%s'", name, line, header);
                for (start = end - 1; start > 0 && !(line[start - 1] == ' ' && (start < 2 || line[start - 2] == ' '));
                     start--)
                        ;
        } else {
                start = (size_t)(h - header);
                ck_assert_msg(start < len && line[start] != ' ' && (start == 0 || line[start - 1] == ' '),
                              "'%s' in line '%s' does not start under its header in '%s'", name, line, header);
                for (end = start; end < len && (last || !(line[end] == ' ' && line[end + 1] == ' ')); end++)
                        ;
        }
        return strndup(line + start, end - start);
}

/* Asserts that column `name` of `line` is `expected`. */
#define CHECK_FIELD(header, line, cols, name, expected)                                                 \
        do {                                                                                            \
                _cleanup_free_ char *f_ = field(header, line, cols, ELEMENTSOF(cols), name);            \
                ck_assert_msg(strcmp(f_, expected) == 0, "%s: '%s', expected '%s' in line '%s'", name,  \
                              f_, expected, line);                                                      \
        } while (0)

/* Asserts that column `name` of `line` is blank: nothing under its header, nor in the cells around it. */
static void check_blank(const char *header, const char *line, const char *name) {
        const char *h = header;
        size_t start, end, len = strlen(line);

        for (;;) {
                h = strstr(h, name);
                ck_assert_ptr_nonnull(h);
                if ((h == header || h[-1] == ' ') && (h[strlen(name)] == ' ' || !h[strlen(name)]))
                        break;
                h++;
        }
        /* a left-aligned cell starts where its header starts, a right-aligned one ends where it ends */
        start = (size_t)(h - header);
        end = start + strlen(name);
        for (size_t i = start; i < end && i < len; i++)
                ck_assert_msg(line[i] == ' ', "%s is not blank in the continuation row '%s'", name, line);
}

static const char *size_str(uint64_t size, char buf[static FORMAT_SIZE_MAX]) {
        return format_size(size, buf, FORMAT_SIZE_MAX);
}

static const char *number_str(int64_t v, char buf[static 24]) {
        snprintf(buf, 24, "%" PRId64, v);
        return buf;
}

/* The index of the row of the lease `id` in list output lines[1..n), or 0 when there is none. */
static size_t list_row_index(char **lines, size_t n, const char *id) {
        for (size_t i = 1; i < n; i++)
                if (strncmp(lines[i], id, strlen(id)) == 0 && lines[i][strlen(id)] == ' ')
                        return i;
        return 0;
}

/* The row of the lease `id` in list output lines[1..n), or NULL. */
static const char *list_row(char **lines, size_t n, const char *id) {
        size_t i = list_row_index(lines, n, id);

        return i > 0 ? lines[i] : NULL;
}

/* A user's name as vmmctl shows it: from the user database, else the number. */
static const char *user_str(int64_t uid, char buf[static 64]) {
        const struct passwd *pw = getpwuid((uid_t)uid);

        if (pw)
                snprintf(buf, 64, "%s", pw->pw_name);
        else
                snprintf(buf, 64, "%" PRId64, uid);
        return buf;
}

/* A published name as vmmctl list shows it: OWNER/NAME, OWNER the user name (the uid if it has none). */
static const char *published_str(int64_t uid, const char *name, char buf[static 256]) {
        char user[64];

        user_str(uid, user);
        if (user[0] >= '0' && user[0] <= '9')
                snprintf(user, sizeof(user), "%" PRId64, uid);
        snprintf(buf, 256, "%s/%s", user, name);
        return buf;
}

/* ---- tests ----------------------------------------------------------------------------------------- */

START_TEST(test_status_table) {
        _cleanup_free_ char *usage = NULL;
        char *lines[MAX_LINES], buf[FORMAT_SIZE_MAX], num[24];
        StatusReply s = {};
        Output o, dflt;
        Fixture f;
        size_t n;

        fixture_start(&f);
        status_get(f.h.socket, &s);
        RUN_OK(&o, "--socket", f.h.socket, "status");
        ck_assert_ptr_null(strchr(o.out, '\033'));              /* no colour on a pipe */

        /* No command is status; $VMMBROKER_SOCKET names the socket. */
        {
                char env[160];

                snprintf(env, sizeof(env), "VMMBROKER_SOCKET=%s", f.h.socket);
                run_full((const char *const[]){ NULL }, &(Run){ .env = (const char *const[]){ env, NULL } }, &dflt);
        }
        ck_assert_int_eq(dflt.status, 0);
        ck_assert_str_eq(dflt.out, o.out);

        n = split_lines(o.out, lines);
        ck_assert_uint_eq(n, 1 + s.n_devices);
        check_header(lines[0], status_columns, ELEMENTSOF(status_columns));
        for (size_t i = 0; i < s.n_devices; i++) {
                const WireDevice *d = &s.devices[i];
                const char *row = lines[1 + i];
                uint64_t used = d->leased + d->scrubbing + d->cached;

                CHECK_FIELD(lines[0], row, status_columns, "DEVICE", number_str(d->index, num));
                CHECK_FIELD(lines[0], row, status_columns, "NUMA",
                            d->numa_node < 0 ? "-" : number_str(d->numa_node, num));
                CHECK_FIELD(lines[0], row, status_columns, "NAME", d->name);
                CHECK_FIELD(lines[0], row, status_columns, "CAPACITY", size_str(d->capacity, buf));
                CHECK_FIELD(lines[0], row, status_columns, "LEASED", size_str(d->leased, buf));
                CHECK_FIELD(lines[0], row, status_columns, "CACHED", size_str(d->cached, buf));
                CHECK_FIELD(lines[0], row, status_columns, "FREE",
                            size_str(used < d->capacity ? d->capacity - used : 0, buf));
                CHECK_FIELD(lines[0], row, status_columns, "LEASES", number_str((int64_t)d->leases, num));
                CHECK_FIELD(lines[0], row, status_columns, "WAIT", number_str(d->waiters, num));
        }
        /* Device 0 holds this test's three leases: 66 MiB + 4 MiB + 2 MiB, a bar with its leased percentage. */
        ck_assert_uint_eq(s.devices[0].leases, 3);
        ck_assert_uint_eq(s.devices[0].leased, 72 * MiB);
        usage = field(lines[0], lines[1], status_columns, ELEMENTSOF(status_columns), "USAGE");
        ck_assert_msg(usage[0] == '[' && strstr(usage, "] ") && usage[strlen(usage) - 1] == '%', "USAGE '%s'",
                      usage);
        snprintf(num, sizeof(num), " %u%%",
                 (unsigned)((double)s.devices[0].leased * 100 / (double)s.devices[0].capacity + 0.5));
        ck_assert_msg(strstr(usage, num), "USAGE '%s' without '%s'", usage, num);

        /* --no-legend: the rows alone. */
        output_done(&o);
        RUN_OK(&o, "--socket", f.h.socket, "--no-legend");
        n = split_lines(o.out, lines);
        ck_assert_uint_eq(n, s.n_devices);
        ck_assert_ptr_null(strstr(lines[0], "CAPACITY"));

        output_done(&o);
        output_done(&dflt);
        status_reply_done(&s);
        fixture_stop(&f);
}
END_TEST

START_TEST(test_status_json) {
        _cleanup_(json_object_putp) json_object *j = NULL;
        StatusReply raw = {}, shown = {};
        Output o;
        Fixture f;

        fixture_start(&f);
        RUN_OK(&o, "--json", "--socket", f.h.socket, "status");
        status_get(f.h.socket, &raw);
        j = json_tokener_parse(o.out);
        ck_assert_msg(j, "not JSON: %s", o.out);
        ck_assert_msg(strstr(o.out, "\n  "), "not pretty-printed: %s", o.out);
        /* the decoder refuses any field the interface does not name, and requires all it does */
        ck_assert_int_eq(status_reply_decode(j, &shown, NULL), 0);
        ck_assert_uint_eq(shown.n_devices, raw.n_devices);
        for (size_t i = 0; i < raw.n_devices; i++) {
                const WireDevice *a = &raw.devices[i], *b = &shown.devices[i];

                ck_assert_int_eq(a->index, b->index);
                ck_assert_str_eq(a->name, b->name);
                ck_assert_uint_eq(a->total, b->total);
                ck_assert_uint_eq(a->granularity, b->granularity);
                ck_assert_uint_eq(a->capacity, b->capacity);
                ck_assert_uint_eq(a->leased, b->leased);
                ck_assert_uint_eq(a->scrubbing, b->scrubbing);
                ck_assert_uint_eq(a->cached, b->cached);
                ck_assert_uint_eq(a->leases, b->leases);
        }
        status_reply_done(&raw);
        status_reply_done(&shown);
        output_done(&o);
        fixture_stop(&f);
}
END_TEST

/* Checks the holder columns of `row` against holder `h`, or against none ("-") when `h` is NULL. */
static void check_holder_cells(const char *header, const char *row, const WireHolder *h) {
        char num[24], user[64];

        CHECK_FIELD(header, row, list_columns, "PID", h ? number_str(h->pid, num) : "-");
        CHECK_FIELD(header, row, list_columns, "USER", h ? user_str(h->uid, user) : "-");
        CHECK_FIELD(header, row, list_columns, "MODE", !h ? "-" : h->readonly ? "ro" : "rw");
        CHECK_FIELD(header, row, list_columns, "COMMAND", h && h->comm ? h->comm : "-");
}

/*
 * Checks every lease of `raw` in list output `lines` (the header first): its
 * row with the first holder, then a continuation row for each further one, in
 * the broker's order; nothing else.
 */
static void check_list_rows(char **lines, size_t n, const ListReply *raw) {
        char buf[FORMAT_SIZE_MAX], num[24], user[64], published[256];
        size_t n_rows = 0;

        ck_assert_uint_ge(n, 1);
        check_header(lines[0], list_columns, ELEMENTSOF(list_columns));
        for (size_t i = 0; i < raw->n_leases; i++) {
                const WireLeaseInfo *l = &raw->leases[i];
                size_t r = list_row_index(lines, n, l->id);
                const char *row = lines[r];
                _cleanup_free_ char *age = NULL;

                ck_assert_msg(r > 0, "no row for lease %s", l->id);
                CHECK_FIELD(lines[0], row, list_columns, "ID", l->id);
                CHECK_FIELD(lines[0], row, list_columns, "DEVICE", number_str(l->device, num));
                CHECK_FIELD(lines[0], row, list_columns, "SIZE", size_str(l->size, buf));
                CHECK_FIELD(lines[0], row, list_columns, "SLABS", number_str((int64_t)l->slabs, num));
                CHECK_FIELD(lines[0], row, list_columns, "OWNER", user_str(l->uid, user));
                CHECK_FIELD(lines[0], row, list_columns, "NAME",
                            l->name ? published_str(l->uid, l->name, published) : "-");
                CHECK_FIELD(lines[0], row, list_columns, "LABEL", l->label ?: "-");
                age = field(lines[0], row, list_columns, ELEMENTSOF(list_columns), "AGE");
                ck_assert_msg(strspn(age, "0123456789") > 0 && age[strlen(age) - 1] == 's', "AGE '%s'", age);
                check_holder_cells(lines[0], row, l->n_holders > 0 ? &l->holders[0] : NULL);
                for (size_t j = 1; j < l->n_holders; j++) {
                        ck_assert_msg(r + j < n, "lease %s: no row for holder %zu", l->id, j);
                        for (size_t c = 0; c < ELEMENTSOF(list_lease_columns); c++)
                                check_blank(lines[0], lines[r + j], list_lease_columns[c]);
                        check_holder_cells(lines[0], lines[r + j], &l->holders[j]);
                }
                n_rows += l->n_holders > 0 ? l->n_holders : 1;
        }
        ck_assert_msg(n == 1 + n_rows, "%zu lines for %zu leases in %zu rows", n, raw->n_leases, n_rows);
}

START_TEST(test_list_table) {
        char *lines[MAX_LINES];
        ListReply raw = {};
        Output o;
        Fixture f;
        size_t n;

        fixture_start(&f);
        list_get(f.h.socket, &raw);
        ck_assert_uint_eq(raw.n_leases, 3);
        RUN_OK(&o, "--socket", f.h.socket, "list");
        ck_assert_ptr_null(strchr(o.out, '\033'));

        /* Not a terminal: the long label is shown whole. */
        ck_assert_ptr_nonnull(strstr(o.out, LONG_LABEL));
        n = split_lines(o.out, lines);
        check_list_rows(lines, n, &raw);
        /* The one slab of the 66 MiB lease. */
        CHECK_FIELD(lines[0], list_row(lines, n, f.ids[0]), list_columns, "SLABS", "1");
        CHECK_FIELD(lines[0], list_row(lines, n, f.ids[0]), list_columns, "LABEL", "weights");
        CHECK_FIELD(lines[0], list_row(lines, n, f.ids[2]), list_columns, "LABEL", "-");
        /* Each lease has one holder, this process, read-write, and no name. */
        for (size_t i = 0; i < raw.n_leases; i++) {
                const WireLeaseInfo *l = &raw.leases[i];
                char num[24], user[64];

                ck_assert_uint_eq(l->n_holders, 1);
                ck_assert_int_eq(l->holders[0].pid, getpid());
                ck_assert_ptr_null(l->name);
                CHECK_FIELD(lines[0], list_row(lines, n, l->id), list_columns, "PID", number_str(getpid(), num));
                CHECK_FIELD(lines[0], list_row(lines, n, l->id), list_columns, "USER", user_str(getuid(), user));
                CHECK_FIELD(lines[0], list_row(lines, n, l->id), list_columns, "OWNER", user_str(getuid(), user));
                CHECK_FIELD(lines[0], list_row(lines, n, l->id), list_columns, "MODE", "rw");
                CHECK_FIELD(lines[0], list_row(lines, n, l->id), list_columns, "NAME", "-");
        }

        output_done(&o);
        RUN_OK(&o, "list", "--no-legend", "--socket", f.h.socket);
        for (size_t i = 0; i < ELEMENTSOF(f.ids); i++)
                ck_assert_ptr_nonnull(strstr(o.out, f.ids[i]));
        n = split_lines(o.out, lines);
        ck_assert_uint_eq(n, raw.n_leases);
        for (size_t i = 0; i < n; i++)
                ck_assert_ptr_null(strstr(lines[i], "COMMAND"));

        output_done(&o);
        list_reply_done(&raw);
        fixture_stop(&f);
}
END_TEST

START_TEST(test_list_json) {
        _cleanup_(json_object_putp) json_object *j = NULL;
        ListReply raw = {}, shown = {};
        Output o;
        Fixture f;

        fixture_start(&f);
        lease_publish(f.h.socket, f.ids[1], "vmmctl-json");
        RUN_OK(&o, "--socket", f.h.socket, "list", "--json");
        list_get(f.h.socket, &raw);
        j = json_tokener_parse(o.out);
        ck_assert_msg(j, "not JSON: %s", o.out);
        ck_assert_int_eq(list_reply_decode(j, &shown, NULL), 0);
        ck_assert_uint_eq(shown.n_leases, raw.n_leases);
        for (size_t i = 0; i < raw.n_leases; i++) {
                const WireLeaseInfo *a = &raw.leases[i], *b = NULL;

                for (size_t k = 0; k < shown.n_leases; k++)
                        if (strcmp(shown.leases[k].id, a->id) == 0)
                                b = &shown.leases[k];
                ck_assert_msg(b, "lease %s missing", a->id);
                ck_assert_int_eq(a->device, b->device);
                ck_assert_uint_eq(a->size, b->size);
                ck_assert_uint_eq(a->slabs, b->slabs);
                ck_assert_int_eq(a->pid, b->pid);
                ck_assert_int_eq(a->uid, b->uid);
                ck_assert_int_eq(a->created, b->created);
                ck_assert_str_eq(a->comm ?: "(none)", b->comm ?: "(none)");
                ck_assert_str_eq(a->label ?: "(none)", b->label ?: "(none)");
                ck_assert_str_eq(a->name ?: "(none)", b->name ?: "(none)");
                ck_assert_uint_eq(a->n_holders, b->n_holders);
                for (size_t k = 0; k < a->n_holders; k++) {
                        ck_assert_int_eq(a->holders[k].pid, b->holders[k].pid);
                        ck_assert_int_eq(a->holders[k].uid, b->holders[k].uid);
                        ck_assert_int_eq(a->holders[k].readonly, b->holders[k].readonly);
                        ck_assert_str_eq(a->holders[k].comm ?: "(none)", b->holders[k].comm ?: "(none)");
                }
        }
        list_reply_done(&raw);
        list_reply_done(&shown);
        output_done(&o);
        fixture_stop(&f);
}
END_TEST

START_TEST(test_list_all) {
        Output o;
        Fixture f;

        fixture_start(&f);
        RUN(&o, "--socket", f.h.socket, "list", "--all");
        if (getuid() == 0) {
                char *lines[MAX_LINES];
                ListReply raw = {};

                /* root is an administrator: every lease, here this test's own */
                ck_assert_msg(o.status == 0, "exit %d: %s", o.status, o.err);
                list_get(f.h.socket, &raw);
                check_list_rows(lines, split_lines(o.out, lines), &raw);
                list_reply_done(&raw);

                /* nobody is not: the broker's PermissionDenied, with vmmctl's hint for it */
                ck_assert_int_eq(chmod(f.h.dir, 0711), 0);
                ck_assert_int_eq(chmod(f.h.socket, 0666), 0);
                output_done(&o);
                run_full((const char *const[]){ "--socket", f.h.socket, "list", "--all", NULL },
                         &(Run){ .uid = NOBODY }, &o);
                ck_assert_msg(o.status == 1, "as nobody: exit %d: %s", o.status, o.err);
                ck_assert_str_eq(o.out, "");
                ck_assert_msg(strncmp(o.err, "vmmctl: ", 8) == 0 && strstr(o.err, "AdminGroup="), "stderr: %s",
                              o.err);
        } else {
                _cleanup_(json_object_putp) json_object *params = json_tokener_parse("{\"all\": true}");
                _cleanup_free_ char *message = NULL;
                VarlinkReply r = {};
                VmmbError e;

                /* the broker's own refusal, word for word */
                raw_call(f.h.socket, VMMB_METHOD_LIST, params, &r);
                ck_assert_str_eq(r.error ?: "(none)", VMMB_ERROR_PERMISSION_DENIED);
                ck_assert_int_eq(vmmb_error_decode(r.error, r.parameters, &e, &message), 0);
                ck_assert_ptr_nonnull(e.message);
                ck_assert_int_eq(o.status, 1);
                ck_assert_str_eq(o.out, "");
                ck_assert_msg(strncmp(o.err, "vmmctl: ", 8) == 0 && strstr(o.err, e.message), "stderr: %s", o.err);
                vmmb_error_done(&e);
                varlink_reply_done(&r);
        }
        output_done(&o);
        fixture_stop(&f);
}
END_TEST

/* Runs a command under a terminal `columns` wide and checks that the table was fitted to it. */
static void check_fitted(const char *socket, const char *command, const Column *cols, size_t n_cols,
                         unsigned columns) {
        char *lines[MAX_LINES];
        Output o;
        size_t n;

        run_full((const char *const[]){ "--socket", socket, command, NULL }, &(Run){ .pty_columns = columns }, &o);
        ck_assert_msg(o.status == 0, "vmmctl %s exited with %d: %s", command, o.status, o.out);
        /* Colour on a terminal: a bold header. */
        ck_assert_msg(strncmp(o.out, "\033[1m", 4) == 0, "no bold header: %s", o.out);
        strip_escapes(o.out);
        ck_assert_msg(strstr(o.out, "…"), "nothing shortened at %u columns:\n%s", columns, o.out);
        /* one byte for the one column of each ellipsis, so that field() may count bytes */
        for (char *e = strstr(o.out, "…"); e; e = strstr(e, "…")) {
                *e = '~';
                memmove(e + 1, e + 3, strlen(e + 3) + 1);
        }
        n = split_lines(o.out, lines);
        ck_assert_uint_ge(n, 2);
        check_header(lines[0], cols, n_cols);
        for (size_t i = 0; i < n; i++) {
                ck_assert_msg(text_columns(lines[i]) <= columns, "line %zu is %zu columns wide, over %u: '%s'", i,
                              text_columns(lines[i]), columns, lines[i]);
                /* still lined up: the first (but on a continuation row) and the last column of every row sit
                 * under their headers */
                if (i > 0) {
                        if (lines[i][0] != ' ')
                                free(field(lines[0], lines[i], cols, n_cols, cols[0].name));
                        free(field(lines[0], lines[i], cols, n_cols, cols[n_cols - 1].name));
                }
        }
        output_done(&o);
}

/* Lets processes of other users (nobody) reach the daemon's socket. */
static void socket_open_to_all(const Harness *h) {
        ck_assert_int_eq(chmod(h->dir, 0711), 0);
        ck_assert_int_eq(chmod(h->socket, 0666), 0);
}

/* The lease `id` in `raw`; asserts that it is there. */
static const WireLeaseInfo *lease_find(const ListReply *raw, const char *id) {
        for (size_t i = 0; i < raw->n_leases; i++)
                if (strcmp(raw->leases[i].id, id) == 0)
                        return &raw->leases[i];
        ck_abort_msg("List has no lease %s", id);
        return NULL;
}

/* Whether `raw` has the lease `id`. */
static bool lease_listed(const ListReply *raw, const char *id) {
        for (size_t i = 0; i < raw->n_leases; i++)
                if (strcmp(raw->leases[i].id, id) == 0)
                        return true;
        return false;
}

START_TEST(test_list_holders) {
        _cleanup_free_ char *token = NULL, *shown = NULL, *attached = NULL;
        char *lines[MAX_LINES], num[24], user[64], published_name[256];
        const WireLeaseInfo *shared, *published;
        HolderProcess hp;
        ListReply raw = {};
        Output o;
        Fixture f;
        size_t n, r;

        fixture_start(&f);
        /* ids[0] gets a second holder through a read-only token: nobody's process when this runs as root, so
         * that the holder's user is not the owner */
        token = lease_share(f.h.socket, f.ids[0], true);
        if (getuid() == 0)
                socket_open_to_all(&f.h);
        hp = (HolderProcess){ .socket = f.h.socket, .token = token, .uid = getuid() == 0 ? NOBODY : 0 };
        holder_start(&hp);
        /* ids[2] is published, then freed: a lease that nobody holds */
        lease_publish(f.h.socket, f.ids[2], "vmmctl-test.published");
        lease_free(f.h.socket, f.ids[2]);

        /* What the broker says, raw. */
        list_get(f.h.socket, &raw);
        ck_assert_uint_eq(raw.n_leases, 3);
        shared = lease_find(&raw, f.ids[0]);
        ck_assert_uint_eq(shared->n_holders, 2);
        ck_assert_int_eq(shared->holders[0].pid, getpid());
        ck_assert(!shared->holders[0].readonly);
        ck_assert_int_eq(shared->holders[1].pid, hp.pid);
        ck_assert_int_eq(shared->holders[1].uid, getuid() == 0 ? NOBODY : getuid());
        ck_assert(shared->holders[1].readonly);
        ck_assert_str_eq(shared->holders[1].comm ?: "(none)", HOLDER_COMM);
        published = lease_find(&raw, f.ids[2]);
        ck_assert_uint_eq(published->n_holders, 0);
        ck_assert_str_eq(published->name ?: "(none)", "vmmctl-test.published");

        /* What vmmctl shows: every lease and holder, column by column. */
        RUN_OK(&o, "--socket", f.h.socket, "list");
        n = split_lines(o.out, lines);
        check_list_rows(lines, n, &raw);
        ck_assert_uint_eq(n, 1 + 4);

        /* The shared lease: two rows, the second a continuation row for the other process. */
        r = list_row_index(lines, n, f.ids[0]);
        ck_assert_uint_gt(r, 0);
        ck_assert_uint_lt(r + 1, n);
        ck_assert_msg(lines[r + 1][0] == ' ', "not a continuation row: '%s'", lines[r + 1]);
        CHECK_FIELD(lines[0], lines[r], list_columns, "PID", number_str(getpid(), num));
        CHECK_FIELD(lines[0], lines[r], list_columns, "MODE", "rw");
        CHECK_FIELD(lines[0], lines[r], list_columns, "OWNER", user_str(getuid(), user));
        CHECK_FIELD(lines[0], lines[r + 1], list_columns, "PID", number_str(hp.pid, num));
        CHECK_FIELD(lines[0], lines[r + 1], list_columns, "USER", user_str(shared->holders[1].uid, user));
        CHECK_FIELD(lines[0], lines[r + 1], list_columns, "MODE", "ro");
        CHECK_FIELD(lines[0], lines[r + 1], list_columns, "COMMAND", HOLDER_COMM);

        /* The published lease nobody holds: its name, and "-" for a holder. */
        r = list_row_index(lines, n, f.ids[2]);
        ck_assert_uint_gt(r, 0);
        /* as OWNER/NAME, which Attach takes as it is */
        CHECK_FIELD(lines[0], lines[r], list_columns, "NAME",
                    published_str(getuid(), "vmmctl-test.published", published_name));
        shown = field(lines[0], lines[r], list_columns, ELEMENTSOF(list_columns), "NAME");
        attached = lease_attach_name(f.h.socket, shown);
        ck_assert_str_eq(attached, f.ids[2]);
        lease_free(f.h.socket, f.ids[2]);
        CHECK_FIELD(lines[0], lines[r], list_columns, "PID", "-");
        CHECK_FIELD(lines[0], lines[r], list_columns, "USER", "-");
        CHECK_FIELD(lines[0], lines[r], list_columns, "MODE", "-");
        CHECK_FIELD(lines[0], lines[r], list_columns, "COMMAND", "-");
        CHECK_FIELD(lines[0], lines[r], list_columns, "OWNER", user_str(getuid(), user));
        ck_assert(r + 1 == n || lines[r + 1][0] != ' ');

        /* --no-legend: the same rows, continuation rows too. */
        output_done(&o);
        RUN_OK(&o, "--socket", f.h.socket, "list", "--no-legend");
        ck_assert_uint_eq(split_lines(o.out, lines), 4);

        /* Fitted to a terminal, continuation rows still line up. */
        check_fitted(f.h.socket, "list", list_columns, ELEMENTSOF(list_columns), LIST_PTY_COLUMNS);

        output_done(&o);
        list_reply_done(&raw);
        holder_stop(&hp);
        fixture_stop(&f);
}
END_TEST

START_TEST(test_unpublish) {
        _cleanup_(json_object_putp) json_object *j = NULL;
        _cleanup_free_ char *expected = NULL, *line = NULL;
        VarlinkReply r = {};
        ListReply raw = {};
        Output o;
        Fixture f;

        fixture_start(&f);

        /* A name on a lease this process holds: the lease stays, without it. Nothing is printed. */
        lease_publish(f.h.socket, f.ids[0], "vmmctl-held");
        RUN_OK(&o, "--socket", f.h.socket, "unpublish", "vmmctl-held");
        ck_assert_str_eq(o.out, "");
        output_done(&o);
        list_get(f.h.socket, &raw);
        ck_assert_ptr_null(lease_find(&raw, f.ids[0])->name);
        list_reply_done(&raw);

        /* A name on a lease nobody holds: the lease ends with it. */
        lease_publish(f.h.socket, f.ids[1], "vmmctl-unheld");
        lease_free(f.h.socket, f.ids[1]);
        list_get(f.h.socket, &raw);
        ck_assert_str_eq(lease_find(&raw, f.ids[1])->name ?: "(none)", "vmmctl-unheld");
        list_reply_done(&raw);
        RUN_OK(&o, "--socket", f.h.socket, "unpublish", "vmmctl-unheld");
        ck_assert_str_eq(o.out, "");
        output_done(&o);
        list_get(f.h.socket, &raw);
        ck_assert(!lease_listed(&raw, f.ids[1]));
        ck_assert_uint_eq(raw.n_leases, 2);
        list_reply_done(&raw);

        /* The name is gone: the broker's NoSuchName, in the words of its raw reply, exit status 1. */
        RUN(&o, "--socket", f.h.socket, "unpublish", "vmmctl-unheld");
        raw_unpublish(f.h.socket, "vmmctl-unheld", &r);
        ck_assert_str_eq(r.error ?: "(none)", VMMB_ERROR_NO_SUCH_NAME);
        vmmb_error_describe(r.error, r.parameters, VMMB_METHOD_UNPUBLISH, &expected);
        ck_assert_ptr_nonnull(expected);
        ck_assert_ptr_nonnull(strstr(expected, "vmmctl-unheld"));
        ck_assert_int_ge(asprintf(&line, "vmmctl: %s\n", expected), 0);
        ck_assert_int_eq(o.status, 1);
        ck_assert_str_eq(o.out, "");
        ck_assert_str_eq(o.err, line);
        varlink_reply_done(&r);
        output_done(&o);

        /* --json: the broker's reply, an empty object. */
        lease_publish(f.h.socket, f.ids[2], "vmmctl-json");
        RUN_OK(&o, "--socket", f.h.socket, "--json", "unpublish", "vmmctl-json");
        j = json_tokener_parse(o.out);
        ck_assert_msg(j && json_object_is_type(j, json_type_object) && json_object_object_length(j) == 0,
                      "not {}: %s", o.out);
        output_done(&o);

        /* OWNER/NAME, by uid and by user name: the same name of the caller's own. */
        {
                char ref[256];

                lease_publish(f.h.socket, f.ids[0], "vmmctl-own");
                snprintf(ref, sizeof(ref), "%u/vmmctl-own", (unsigned)getuid());
                RUN_OK(&o, "--socket", f.h.socket, "unpublish", ref);
                output_done(&o);
                list_get(f.h.socket, &raw);
                ck_assert_ptr_null(lease_find(&raw, f.ids[0])->name);
                list_reply_done(&raw);
                lease_publish(f.h.socket, f.ids[0], "vmmctl-own");
                RUN_OK(&o, "--socket", f.h.socket, "unpublish", published_str(getuid(), "vmmctl-own", ref));
                output_done(&o);
                /* another owner's namespace has no such name */
                lease_publish(f.h.socket, f.ids[0], "vmmctl-own");
                snprintf(ref, sizeof(ref), "%u/vmmctl-own", (unsigned)getuid() + 4242);
                RUN(&o, "--socket", f.h.socket, "unpublish", ref);
                ck_assert_msg(o.status == 1, "exit %d: %s", o.status, o.err);
                ck_assert_ptr_nonnull(strstr(o.err, ref));
                output_done(&o);
                RUN_OK(&o, "--socket", f.h.socket, "unpublish", "vmmctl-own");
                output_done(&o);
        }

        /* Someone who may attach the name but is neither the owner nor an administrator: PermissionDenied,
         * with who may; one who may not even attach it: NoSuchName, as for a name that does not exist. */
        if (getuid() == 0) {
                uint64_t nobody = NOBODY;

                lease_publish_to(f.h.socket, f.ids[0], "vmmctl-root", &nobody, 1);
                socket_open_to_all(&f.h);
                run_full((const char *const[]){ "--socket", f.h.socket, "unpublish", "root/vmmctl-root", NULL },
                         &(Run){ .uid = NOBODY }, &o);
                ck_assert_msg(o.status == 1, "as nobody: exit %d: %s", o.status, o.err);
                ck_assert_str_eq(o.out, "");
                ck_assert_msg(strncmp(o.err, "vmmctl: ", 8) == 0 && strstr(o.err, "may unpublish it"),
                              "stderr: %s", o.err);
                output_done(&o);
                /* its own namespace has no such name */
                run_full((const char *const[]){ "--socket", f.h.socket, "unpublish", "vmmctl-root", NULL },
                         &(Run){ .uid = NOBODY }, &o);
                ck_assert_msg(o.status == 1 && !strstr(o.err, "may unpublish it"), "as nobody: exit %d: %s",
                              o.status, o.err);
                output_done(&o);
                list_get(f.h.socket, &raw);
                ck_assert_str_eq(lease_find(&raw, f.ids[0])->name ?: "(none)", "vmmctl-root");
                list_reply_done(&raw);
                /* published to nobody else, it is NoSuchName to nobody */
                lease_publish_to(f.h.socket, f.ids[0], "vmmctl-root", NULL, 0);
                run_full((const char *const[]){ "--socket", f.h.socket, "unpublish", "0/vmmctl-root", NULL },
                         &(Run){ .uid = NOBODY }, &o);
                ck_assert_msg(o.status == 1 && strstr(o.err, "0/vmmctl-root") && !strstr(o.err, "may unpublish"),
                              "as nobody: exit %d: %s", o.status, o.err);
                output_done(&o);
        }
        fixture_stop(&f);
}
END_TEST

/* As nobody: leases 2 MiB, publishes it as `arg` and exits; the name keeps the lease. No ck_assert() here. */
static int publish_as_nobody(void *arg) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        const char *const *a = arg;     /* socket, name */
        _cleanup_(json_object_putp) json_object *params = NULL, *call = NULL, *msg = NULL;
        AllocParams ap = { .size = 2 * MiB, .device = VMMB_DEVICE_ANY, .label = (char *)"nobody's" };
        VarlinkReply r = {};
        int *fds = NULL;
        size_t n_fds = 0;
        char *id;

        if (setgroups(0, NULL) < 0 || setgid(NOBODY) < 0 || setuid(NOBODY) < 0)
                return 11;
        if (harness_conn_open(a[0], true, &c) < 0)
                return 12;
        if (alloc_params_encode(&ap, &params) < 0 || varlink_call_new(VMMB_METHOD_ALLOC, params, false, false,
                                                                      &call) < 0)
                return 13;
        if (varlink_conn_send(c, call, NULL, 0) < 0 || varlink_conn_flush(c) < 0 ||
            varlink_conn_receive(c, &msg, &fds, &n_fds) != 1 || varlink_reply_parse(msg, &r) < 0 || r.error)
                return 14;
        close_many(fds, n_fds);
        free(fds);
        {
                json_object *lease, *jid;

                if (!json_object_object_get_ex(r.parameters, "lease", &lease) ||
                    !json_object_object_get_ex(lease, "id", &jid))
                        return 15;
                id = strdup(json_object_get_string(jid));
        }
        varlink_reply_done(&r);
        json_object_put(params);
        json_object_put(call);
        json_object_put(msg);
        params = call = msg = NULL;
        {
                PublishParams pp = { .id = id, .name = (char *)a[1] };

                if (publish_params_encode(&pp, &params) < 0 ||
                    varlink_call_new(VMMB_METHOD_PUBLISH, params, false, false, &call) < 0)
                        return 16;
        }
        free(id);
        if (varlink_conn_send(c, call, NULL, 0) < 0 || varlink_conn_flush(c) < 0 ||
            varlink_conn_receive(c, &msg, NULL, NULL) != 1 || varlink_reply_parse(msg, &r) < 0)
                return 17;
        if (r.error) {
                fprintf(stderr, "nobody: Publish: %s\n", r.error);
                varlink_reply_done(&r);
                return 18;
        }
        varlink_reply_done(&r);
        return 0;
}

/* An administrator sees another user's name as OWNER/NAME, and takes it away by it. */
START_TEST(test_unpublish_other_owner) {
        const char *args[] = { NULL, "vmmctl-nobodys" };
        char *lines[MAX_LINES], expected[256];
        ListReply raw = {};
        Harness h;
        Output o;
        size_t n;
        pid_t pid;

        if (getuid() != 0) {
                fprintf(stderr, "test_unpublish_other_owner: not root, another user's name not checked\n");
                return;
        }
        ck_assert_int_eq(harness_start(&h, NULL), 0);
        socket_open_to_all(&h);
        args[0] = h.socket;
        pid = harness_fork(publish_as_nobody, args);
        ck_assert_int_gt(pid, 0);
        ck_assert_int_eq(harness_wait(pid), 0);

        /* list --all: nobody's lease, with no holder, named nobody/NAME (or 65534/NAME) */
        RUN_OK(&o, "--socket", h.socket, "list", "--all");
        n = split_lines(o.out, lines);
        ck_assert_uint_eq(n, 2);
        CHECK_FIELD(lines[0], lines[1], list_columns, "NAME", published_str(NOBODY, "vmmctl-nobodys", expected));
        output_done(&o);

        /* root's own namespace has no such name; nobody's has */
        RUN(&o, "--socket", h.socket, "unpublish", "vmmctl-nobodys");
        ck_assert_msg(o.status == 1, "exit %d: %s", o.status, o.err);
        output_done(&o);
        RUN_OK(&o, "--socket", h.socket, "unpublish", expected);
        ck_assert_str_eq(o.out, "");
        output_done(&o);
        list_get(h.socket, &raw);
        ck_assert_uint_eq(raw.n_leases, 0);
        list_reply_done(&raw);
        ck_assert_int_eq(harness_stop(&h), 0);
}
END_TEST

/* ---- tokens --------------------------------------------------------------------------------------- */

static const Column tokens_columns[] = {
        { "TOKEN", false }, { "FOR", false }, { "CREATOR", false }, { "MODE", false },
};

START_TEST(test_tokens) {
        _cleanup_free_ char *any = NULL, *for_nobody = NULL;
        char *lines[MAX_LINES], user[64];
        TokensReply raw = {}, shown = {};
        Output o;
        Fixture f;
        size_t n;

        fixture_start(&f);
        any = lease_share_for(f.h.socket, f.ids[0], JSON_ABSENT, false);
        for_nobody = lease_share_for(f.h.socket, f.ids[0], NOBODY, true);
        tokens_get(f.h.socket, f.ids[0], &raw);
        ck_assert_uint_eq(raw.n_tokens, 2);

        if (getuid() != 0) {
                /* not an administrator: vmmctl holds no lease, so the broker shows it none */
                RUN(&o, "--socket", f.h.socket, "tokens", f.ids[0]);
                ck_assert_int_eq(o.status, 1);
                ck_assert_msg(strstr(o.err, "AdminGroup=") && strstr(o.err, "vmmb_tokens()"), "stderr: %s", o.err);
                output_done(&o);
                tokens_reply_done(&raw);
                fixture_stop(&f);
                return;
        }

        /* The table: a row per token, in the broker's order. */
        RUN_OK(&o, "--socket", f.h.socket, "tokens", f.ids[0]);
        ck_assert_ptr_nonnull(strstr(o.out, any));
        ck_assert_ptr_nonnull(strstr(o.out, for_nobody));
        n = split_lines(o.out, lines);
        ck_assert_uint_eq(n, 1 + raw.n_tokens);
        check_header(lines[0], tokens_columns, ELEMENTSOF(tokens_columns));
        for (size_t i = 0; i < raw.n_tokens; i++) {
                const WireToken *t = &raw.tokens[i];

                CHECK_FIELD(lines[0], lines[1 + i], tokens_columns, "TOKEN", t->token);
                CHECK_FIELD(lines[0], lines[1 + i], tokens_columns, "FOR",
                            t->uid == JSON_ABSENT ? "anyone" : user_str(t->uid, user));
                CHECK_FIELD(lines[0], lines[1 + i], tokens_columns, "CREATOR", user_str(t->creator, user));
                CHECK_FIELD(lines[0], lines[1 + i], tokens_columns, "MODE", t->readonly ? "ro" : "rw");
        }
        output_done(&o);

        /* --json: the broker's reply. */
        {
                _cleanup_(json_object_putp) json_object *j = NULL;

                RUN_OK(&o, "--socket", f.h.socket, "--json", "tokens", f.ids[0]);
                j = json_tokener_parse(o.out);
                ck_assert_msg(j, "not JSON: %s", o.out);
                ck_assert_int_eq(tokens_reply_decode(j, &shown, NULL), 0);
                ck_assert_uint_eq(shown.n_tokens, raw.n_tokens);
                for (size_t i = 0; i < raw.n_tokens; i++) {
                        ck_assert_str_eq(shown.tokens[i].token, raw.tokens[i].token);
                        ck_assert_int_eq(shown.tokens[i].uid, raw.tokens[i].uid);
                        ck_assert_int_eq(shown.tokens[i].creator, raw.tokens[i].creator);
                        ck_assert_int_eq(shown.tokens[i].readonly, raw.tokens[i].readonly);
                }
                tokens_reply_done(&shown);
                output_done(&o);
        }

        /* A lease with none; --no-legend. */
        RUN_OK(&o, "--socket", f.h.socket, "tokens", f.ids[1]);
        ck_assert_uint_eq(split_lines(o.out, lines), 2);
        check_header(lines[0], tokens_columns, ELEMENTSOF(tokens_columns));
        ck_assert_ptr_nonnull(strstr(lines[1], "No tokens"));
        output_done(&o);
        RUN_OK(&o, "--socket", f.h.socket, "tokens", f.ids[1], "--no-legend");
        ck_assert_str_eq(o.out, "");
        output_done(&o);

        /* No such lease: the broker's NoSuchLease, exit status 1. */
        RUN(&o, "--socket", f.h.socket, "tokens", "0123456789abcdef0123456789abcdef");
        ck_assert_int_eq(o.status, 1);
        ck_assert_str_eq(o.out, "");
        ck_assert_ptr_nonnull(strstr(o.err, "0123456789abcdef0123456789abcdef"));
        output_done(&o);

        /* Not an administrator, nor a holder: the broker shows nothing; vmmctl says who may. */
        socket_open_to_all(&f.h);
        run_full((const char *const[]){ "--socket", f.h.socket, "tokens", f.ids[0], NULL }, &(Run){ .uid = NOBODY },
                 &o);
        ck_assert_msg(o.status == 1, "as nobody: exit %d: %s", o.status, o.err);
        ck_assert_str_eq(o.out, "");
        ck_assert_msg(strncmp(o.err, "vmmctl: ", 8) == 0 && strstr(o.err, "AdminGroup=") &&
                              strstr(o.err, "vmmb_tokens()"),
                      "stderr: %s", o.err);
        ck_assert_ptr_null(strstr(o.err, any));
        output_done(&o);

        tokens_reply_done(&raw);
        fixture_stop(&f);
}
END_TEST

/* ---- users ---------------------------------------------------------------------------------------- */

/* Calls `method` on the open connection `c`: the reply, error or not, in *ret. */
static void conn_call(VarlinkConn *c, const char *method, json_object *params, VarlinkReply *ret) {
        _cleanup_(json_object_putp) json_object *call = NULL, *msg = NULL;

        ck_assert_int_eq(varlink_call_new(method, params, false, false, &call), 0);
        ck_assert_int_eq(varlink_conn_send(c, call, NULL, 0), 0);
        ck_assert_int_eq(varlink_conn_flush(c), 0);
        ck_assert_int_eq(varlink_conn_receive(c, &msg, NULL, NULL), 1);
        ck_assert_int_eq(varlink_reply_parse(msg, ret), 0);
}

/* The entry of `uid` in a Users reply, or NULL. */
static WireUser *users_find(const UsersReply *raw, int64_t uid) {
        for (size_t i = 0; i < raw->n_users; i++)
                if (raw->users[i].uid == uid)
                        return &raw->users[i];
        return NULL;
}

/*
 * Users(all) on `c`, once the broker has counted out every connection that
 * closed: calls until this process's user has no connection but `c` and, when
 * `uid` >= 0, the user `uid` has `connections` open (raw_call()'s and vmmctl's
 * connections are closed, but the broker may not have seen their hangup
 * yet). Nothing of this user's is in flight then: vmmctl, the only other
 * connection that follows, adds one connection and nothing else.
 */
static void users_settled_full(VarlinkConn *c, bool all, int64_t uid, uint64_t connections, UsersReply *ret) {
        _cleanup_(json_object_putp) json_object *params = NULL;
        ListParams lp = { .all = all };

        ck_assert_int_eq(list_params_encode(&lp, &params), 0);
        for (unsigned i = 0;; i++) {
                VarlinkReply r = {};
                const WireUser *me, *other;

                conn_call(c, VMMB_METHOD_USERS, params, &r);
                ck_assert_msg(!r.error, "Users: %s", r.error);
                ck_assert_int_eq(users_reply_decode(r.parameters, ret, NULL), 0);
                varlink_reply_done(&r);
                me = users_find(ret, getuid());
                ck_assert_msg(me, "Users has no entry for this process's user %d", (int)getuid());
                ck_assert_uint_ge(me->connections, 1);
                other = uid >= 0 ? users_find(ret, uid) : NULL;
                if (me->connections == 1 && (uid < 0 || (other && other->connections == connections)))
                        return;
                ck_assert_msg(i < SETTLE_ROUND_TRIPS,
                              "after %u calls, %" PRIu64 " connections of this user, %" PRIu64 " of user %" PRId64, i,
                              me->connections, other ? other->connections : 0, uid);
                users_reply_done(ret);
        }
}

static void users_settled(VarlinkConn *c, bool all, UsersReply *ret) {
        users_settled_full(c, all, -1, 0, ret);
}

static int users_uid_compare(const void *a, const void *b) {
        const WireUser *x = a, *y = b;

        return x->uid < y->uid ? -1 : x->uid > y->uid;
}

static int users_device_compare(const void *a, const void *b) {
        const WireUserDevice *x = a, *y = b;

        return x->index < y->index ? -1 : x->index > y->index;
}

/* The percentage the users table gives `bytes` of `max_bytes`. */
static unsigned users_percent(uint64_t bytes, uint64_t max_bytes) {
        double p;

        if (max_bytes == 0)
                return bytes > 0 ? 100 : 0;
        p = (double)bytes * 100 / (double)max_bytes + 0.5;
        return p >= 999 ? 999 : (unsigned)p;
}

/* Asserts that the USAGE cell of `row` is a bar ending in the percentage of `d`; returns its cells. */
static size_t check_users_bar(const char *header, const char *row, const WireUserDevice *d) {
        _cleanup_free_ char *usage = field(header, row, users_columns, ELEMENTSOF(users_columns), "USAGE");
        char pct[24];
        size_t len = strlen(usage), cells;

        snprintf(pct, sizeof(pct), "] %3u%%", users_percent(d->bytes, d->max_bytes));
        ck_assert_msg(usage[0] == '[' && len > strlen(pct) && strcmp(usage + len - strlen(pct), pct) == 0,
                      "USAGE '%s', expected a bar ending in '%s'", usage, pct);
        cells = len - strlen(pct) - 1;
        ck_assert_uint_eq(strspn(usage + 1, "#."), cells);
        return cells;
}

/*
 * Checks users output `lines` (the header first) against the raw reply
 * `raw` (sorted here as vmmctl sorts it: by uid, then by device), in which
 * this process's user had one connection fewer (vmmctl's own): a row per
 * user with its first device, a continuation row for each further device,
 * nothing else. Returns the bars' widest cell count.
 */
static size_t check_users_rows(char **lines, size_t n, UsersReply *raw) {
        char num[24], buf[64], user[64], size[FORMAT_SIZE_MAX];
        size_t r = 1, cells = 0;

        ck_assert_uint_ge(n, 1);
        check_header(lines[0], users_columns, ELEMENTSOF(users_columns));
        if (raw->n_users > 0)
                qsort(raw->users, raw->n_users, sizeof(raw->users[0]), users_uid_compare);
        for (size_t i = 0; i < raw->n_users; i++) {
                const WireUser *u = &raw->users[i];
                uint64_t connections = u->connections + (u->uid == getuid());

                if (u->n_devices > 0)
                        qsort(u->devices, u->n_devices, sizeof(u->devices[0]), users_device_compare);
                ck_assert_msg(r < n, "no row for user %" PRId64, u->uid);
                ck_assert_msg(lines[r][0] != ' ', "a continuation row for user %" PRId64 ": '%s'", u->uid, lines[r]);
                CHECK_FIELD(lines[0], lines[r], users_columns, "USER", user_str(u->uid, user));
                snprintf(buf, sizeof(buf), "%" PRIu64 "/%" PRIu64, u->leases, u->max_leases);
                CHECK_FIELD(lines[0], lines[r], users_columns, "LEASES", buf);
                snprintf(buf, sizeof(buf), "%" PRIu64 "/%" PRIu64, connections, u->max_connections);
                CHECK_FIELD(lines[0], lines[r], users_columns, "CONNECTIONS", buf);
                CHECK_FIELD(lines[0], lines[r], users_columns, "REQUESTS", number_str((int64_t)u->requests, num));
                ck_assert_uint_ge(u->n_devices, 1);     /* the broker serves at least one device */
                for (size_t j = 0; j < u->n_devices; j++, r++) {
                        const WireUserDevice *d = &u->devices[j];
                        size_t c;

                        ck_assert_msg(r < n, "user %" PRId64 ": no row for device %" PRId64, u->uid, d->index);
                        if (j > 0)
                                for (size_t k = 0; k < ELEMENTSOF(users_user_columns); k++)
                                        check_blank(lines[0], lines[r], users_user_columns[k]);
                        CHECK_FIELD(lines[0], lines[r], users_columns, "DEVICE", number_str(d->index, num));
                        CHECK_FIELD(lines[0], lines[r], users_columns, "BYTES", size_str(d->bytes, size));
                        CHECK_FIELD(lines[0], lines[r], users_columns, "LIMIT", size_str(d->max_bytes, size));
                        c = check_users_bar(lines[0], lines[r], d);
                        cells = c > cells ? c : cells;
                }
        }
        ck_assert_msg(r == n, "%zu lines for %zu users in %zu rows", n, raw->n_users, r - 1);
        return cells;
}

/* Whether the daemon can be given two devices: the simulated driver's SIMCUDA_DEVICES; a real one has its own. */
static bool two_devices(const char *test) {
        const char *lib = getenv("VMMBROKER_LIBCUDA");

        if (lib && strstr(lib, "simcuda"))
                return true;
        fprintf(stderr, "%s: not run: it needs the simulated driver's two devices\n", test);
        return false;
}

/* Starts a daemon on two simulated devices. */
static void users_daemon_start(Harness *h) {
        int k;

        ck_assert_int_eq(setenv("SIMCUDA_DEVICES", "2", 1), 0);
        k = harness_start(h, NULL);
        ck_assert_int_eq(unsetenv("SIMCUDA_DEVICES"), 0);
        ck_assert_msg(k == 0, "harness_start: %s", strerror(-k));
}

/* NUMA: the device's host NUMA node, "-" when the driver does not know it (SIMCUDA_NUMA=-1,1). */
/* A parked lease: its device shows as N:host, its holder's mode as rw,parked; status says where the memory is. */
START_TEST(test_list_parked) {
        _cleanup_(json_object_putp) json_object *params = NULL;
        char *lines[MAX_LINES], user[64], want[160];
        FreeParams fp;
        VarlinkReply r = {};
        Output o;
        Fixture f;
        size_t n;

        fixture_start(&f);
        fp = (FreeParams){ .id = f.ids[0] };
        ck_assert_int_eq(free_params_encode(&fp, &params), 0);
        /* Nothing of it is mapped here: the raw Alloc only took the fds, which are closed. */
        raw_call_ok(f.h.socket, VMMB_METHOD_PARK, params, &r);
        ck_assert(json_object_get_boolean(json_object_object_get(r.parameters, "parked")));
        varlink_reply_done(&r);

        RUN_OK(&o, "--socket", f.h.socket, "list");
        n = split_lines(o.out, lines);
        CHECK_FIELD(lines[0], list_row(lines, n, f.ids[0]), list_columns, "DEVICE", "0:host");
        CHECK_FIELD(lines[0], list_row(lines, n, f.ids[0]), list_columns, "MODE", "rw,parked");
        CHECK_FIELD(lines[0], list_row(lines, n, f.ids[1]), list_columns, "DEVICE", "0");
        CHECK_FIELD(lines[0], list_row(lines, n, f.ids[1]), list_columns, "MODE", "rw");
        output_done(&o);

        RUN_OK(&o, "--socket", f.h.socket, "status");
        ck_assert_msg(strstr(o.out, "\ndevice 0: 66 MiB parked in host memory (HostCapacity= "), "%s", o.out);
        output_done(&o);

        RUN_OK(&o, "--socket", f.h.socket, "users");
        user_str(getuid(), user);
        snprintf(want, sizeof(want), "\n%s: 66 MiB parked in host memory for device 0 (MaxHostBytes= ", user);
        ck_assert_msg(strstr(o.out, want), "%s", o.out);
        output_done(&o);
        fixture_stop(&f);
}
END_TEST

START_TEST(test_status_numa) {
        char *lines[MAX_LINES];
        Harness h;
        Output o;

        if (!two_devices(__func__))
                return;
        ck_assert_int_eq(setenv("SIMCUDA_NUMA", "-1,1", 1), 0);
        users_daemon_start(&h);
        ck_assert_int_eq(unsetenv("SIMCUDA_NUMA"), 0);
        RUN_OK(&o, "--socket", h.socket, "status");
        ck_assert_uint_eq(split_lines(o.out, lines), 4);
        check_header(lines[0], status_columns, ELEMENTSOF(status_columns));
        CHECK_FIELD(lines[0], lines[1], status_columns, "NUMA", "-");
        CHECK_FIELD(lines[0], lines[2], status_columns, "NUMA", "1");
        /* two devices: the rule that places an Alloc naming none, the default */
        ck_assert_str_eq(lines[3], "placement: most-free (Placement=, for an Alloc that names no device)");
        output_done(&o);
        ck_assert_int_eq(harness_stop(&h), 0);
}
END_TEST

START_TEST(test_users_table) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        _cleanup_free_ char *id0 = NULL, *id1 = NULL;
        char *lines[MAX_LINES], size[FORMAT_SIZE_MAX];
        UsersReply raw = {};
        ListReply list = {};
        const WireUser *me;
        uint64_t listed = 0;
        Harness h;
        Output o;
        size_t n;

        if (!two_devices(__func__))
                return;
        users_daemon_start(&h);
        /* This user's two leases on device 0: 66 MiB and 3 MiB, which the granularity makes 4. */
        id0 = lease_alloc_on(h.socket, 66 * MiB, 0, "weights");
        id1 = lease_alloc_on(h.socket, 3 * MiB, 0, NULL);
        ck_assert_int_eq(harness_conn_open(h.socket, false, &c), 0);

        /* What the broker says, raw: the leases as List sizes them, on device 0 and nothing on device 1. */
        list_get(h.socket, &list);
        ck_assert_uint_eq(list.n_leases, 2);
        for (size_t i = 0; i < list.n_leases; i++)
                listed += list.leases[i].size;
        ck_assert_uint_eq(listed, 70 * MiB);
        users_settled(c, false, &raw);
        ck_assert_uint_eq(raw.n_users, 1);             /* not an administrator's call: this user alone */
        me = &raw.users[0];
        ck_assert_int_eq(me->uid, getuid());
        ck_assert_uint_eq(me->leases, 2);
        ck_assert_uint_eq(me->connections, 1);
        ck_assert_uint_eq(me->n_devices, 2);
        for (size_t i = 0; i < me->n_devices; i++) {
                ck_assert_uint_eq(me->devices[i].bytes, me->devices[i].index == 0 ? listed : 0);
                ck_assert_uint_gt(me->devices[i].max_bytes, 0);
        }

        /* What vmmctl shows: this user's row for device 0, a continuation row for device 1, column by column. */
        RUN_OK(&o, "--socket", h.socket, "users");
        ck_assert_ptr_null(strchr(o.out, '\033'));              /* no colour on a pipe */
        n = split_lines(o.out, lines);
        ck_assert_uint_eq(n, 1 + 2);
        ck_assert_uint_eq(check_users_rows(lines, n, &raw), 20);        /* not a terminal: whole bars */
        CHECK_FIELD(lines[0], lines[1], users_columns, "DEVICE", "0");
        CHECK_FIELD(lines[0], lines[1], users_columns, "BYTES", size_str(70 * MiB, size));
        CHECK_FIELD(lines[0], lines[2], users_columns, "DEVICE", "1");
        CHECK_FIELD(lines[0], lines[2], users_columns, "BYTES", "0 B");
        ck_assert_msg(lines[2][0] == ' ', "not a continuation row: '%s'", lines[2]);
        output_done(&o);
        users_reply_done(&raw);

        /* One lease freed: the bytes and the count go down, in the broker's words and in vmmctl's. */
        lease_free(h.socket, id1);
        users_settled(c, false, &raw);
        ck_assert_uint_eq(raw.users[0].leases, 1);
        RUN_OK(&o, "--socket", h.socket, "users");
        n = split_lines(o.out, lines);
        check_users_rows(lines, n, &raw);
        CHECK_FIELD(lines[0], lines[1], users_columns, "BYTES", size_str(66 * MiB, size));
        output_done(&o);

        /* --no-legend: the rows alone. */
        RUN_OK(&o, "--socket", h.socket, "users", "--no-legend");
        ck_assert_uint_eq(split_lines(o.out, lines), 2);
        ck_assert_ptr_null(strstr(o.out, "CONNECTIONS"));
        output_done(&o);

        users_reply_done(&raw);
        list_reply_done(&list);
        ck_assert_int_eq(harness_stop(&h), 0);
}
END_TEST

START_TEST(test_users_json) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        _cleanup_(json_object_putp) json_object *j = NULL;
        _cleanup_free_ char *id = NULL;
        UsersReply raw = {}, shown = {};
        Harness h;
        Output o;

        if (!two_devices(__func__))
                return;
        users_daemon_start(&h);
        id = lease_alloc_on(h.socket, 5 * MiB, 1, NULL);
        ck_assert_int_eq(harness_conn_open(h.socket, false, &c), 0);
        users_settled(c, false, &raw);
        RUN_OK(&o, "--json", "--socket", h.socket, "users");
        j = json_tokener_parse(o.out);
        ck_assert_msg(j, "not JSON: %s", o.out);
        ck_assert_msg(strstr(o.out, "\n  "), "not pretty-printed: %s", o.out);
        /* the decoder refuses any field the interface does not name, and requires all it does */
        ck_assert_int_eq(users_reply_decode(j, &shown, NULL), 0);
        ck_assert_uint_eq(shown.n_users, raw.n_users);
        for (size_t i = 0; i < raw.n_users; i++) {
                const WireUser *a = &raw.users[i], *b = users_find(&shown, a->uid);

                ck_assert_msg(b, "user %" PRId64 " missing", a->uid);
                ck_assert_uint_eq(a->leases, b->leases);
                ck_assert_uint_eq(a->max_leases, b->max_leases);
                /* vmmctl's own connection is the one more */
                ck_assert_uint_eq(a->connections + (a->uid == getuid()), b->connections);
                ck_assert_uint_eq(a->max_connections, b->max_connections);
                ck_assert_uint_eq(a->requests, b->requests);
                ck_assert_uint_eq(a->n_devices, b->n_devices);
                for (size_t k = 0; k < a->n_devices; k++) {
                        ck_assert_int_eq(a->devices[k].index, b->devices[k].index);
                        ck_assert_uint_eq(a->devices[k].bytes, b->devices[k].bytes);
                        ck_assert_uint_eq(a->devices[k].max_bytes, b->devices[k].max_bytes);
                }
        }
        /* the 5 MiB lease on device 1, rounded up to the 2 MiB granularity */
        for (size_t k = 0; k < shown.users[0].n_devices; k++)
                ck_assert_uint_eq(shown.users[0].devices[k].bytes, shown.users[0].devices[k].index == 1 ? 6 * MiB : 0);
        users_reply_done(&raw);
        users_reply_done(&shown);
        output_done(&o);
        ck_assert_int_eq(harness_stop(&h), 0);
}
END_TEST

START_TEST(test_users_all) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        _cleanup_free_ char *id = NULL, *token = NULL;
        char *lines[MAX_LINES], buf[64];
        UsersReply raw = {};
        HolderProcess hp;
        Harness h;
        Output o;
        size_t n;

        if (!two_devices(__func__))
                return;
        users_daemon_start(&h);
        id = lease_alloc_on(h.socket, 8 * MiB, 0, NULL);
        ck_assert_int_eq(harness_conn_open(h.socket, false, &c), 0);
        if (getuid() != 0) {
                _cleanup_(json_object_putp) json_object *params = json_tokener_parse("{\"all\": true}");
                _cleanup_free_ char *message = NULL;
                VarlinkReply r = {};
                VmmbError e;

                /* not an administrator: the broker's own refusal, word for word, and who may ask */
                RUN(&o, "--socket", h.socket, "users", "--all");
                conn_call(c, VMMB_METHOD_USERS, params, &r);
                ck_assert_str_eq(r.error ?: "(none)", VMMB_ERROR_PERMISSION_DENIED);
                ck_assert_int_eq(vmmb_error_decode(r.error, r.parameters, &e, &message), 0);
                ck_assert_ptr_nonnull(e.message);
                ck_assert_int_eq(o.status, 1);
                ck_assert_str_eq(o.out, "");
                ck_assert_msg(strncmp(o.err, "vmmctl: ", 8) == 0 && strstr(o.err, e.message) &&
                                      strstr(o.err, "AdminGroup="),
                              "stderr: %s", o.err);
                vmmb_error_done(&e);
                varlink_reply_done(&r);
                output_done(&o);
                ck_assert_int_eq(harness_stop(&h), 0);
                return;
        }

        /* Another user with something charged: nobody's process, attached to root's lease, holds a connection. */
        socket_open_to_all(&h);
        token = lease_share(h.socket, id, true);
        hp = (HolderProcess){ .socket = h.socket, .token = token, .uid = NOBODY };
        holder_start(&hp);

        /* root is an administrator: every user, column by column against the raw reply. */
        users_settled(c, true, &raw);
        ck_assert_ptr_nonnull(users_find(&raw, 0));
        ck_assert_ptr_nonnull(users_find(&raw, NOBODY));
        ck_assert_uint_eq(users_find(&raw, NOBODY)->leases, 0);        /* the lease is charged to its owner */
        ck_assert_uint_ge(users_find(&raw, NOBODY)->connections, 1);
        RUN_OK(&o, "--socket", h.socket, "users", "--all");
        n = split_lines(o.out, lines);
        check_users_rows(lines, n, &raw);
        output_done(&o);
        users_reply_done(&raw);

        /* Without --all, root sees root alone. */
        users_settled(c, false, &raw);
        ck_assert_uint_eq(raw.n_users, 1);
        RUN_OK(&o, "--socket", h.socket, "users");
        n = split_lines(o.out, lines);
        check_users_rows(lines, n, &raw);
        output_done(&o);
        users_reply_done(&raw);

        /* nobody is not an administrator: the broker's PermissionDenied, with vmmctl's hint for it */
        run_full((const char *const[]){ "--socket", h.socket, "users", "--all", NULL }, &(Run){ .uid = NOBODY }, &o);
        ck_assert_msg(o.status == 1, "as nobody: exit %d: %s", o.status, o.err);
        ck_assert_str_eq(o.out, "");
        ck_assert_msg(strncmp(o.err, "vmmctl: ", 8) == 0 && strstr(o.err, "AdminGroup="), "stderr: %s", o.err);
        output_done(&o);

        /* ... and sees its own use: no leases, its holder's connection and vmmctl's (once the broker has
         * counted out the connection of the refused vmmctl) */
        users_settled_full(c, true, NOBODY, 1, &raw);
        users_reply_done(&raw);
        run_full((const char *const[]){ "--socket", h.socket, "users", NULL }, &(Run){ .uid = NOBODY }, &o);
        ck_assert_msg(o.status == 0, "as nobody: exit %d: %s", o.status, o.err);
        n = split_lines(o.out, lines);
        ck_assert_uint_eq(n, 1 + 2);
        check_header(lines[0], users_columns, ELEMENTSOF(users_columns));
        CHECK_FIELD(lines[0], lines[1], users_columns, "USER", user_str(NOBODY, buf));
        ck_assert_msg(strncmp(lines[1], buf, strlen(buf)) == 0, "'%s' is not nobody's row", lines[1]);
        CHECK_FIELD(lines[0], lines[1], users_columns, "BYTES", "0 B");
        CHECK_FIELD(lines[0], lines[2], users_columns, "BYTES", "0 B");
        {
                _cleanup_free_ char *leases = field(lines[0], lines[1], users_columns, ELEMENTSOF(users_columns),
                                                    "LEASES");
                _cleanup_free_ char *conns = field(lines[0], lines[1], users_columns, ELEMENTSOF(users_columns),
                                                   "CONNECTIONS");

                ck_assert_msg(strncmp(leases, "0/", 2) == 0, "LEASES '%s'", leases);
                ck_assert_msg(strncmp(conns, "2/", 2) == 0, "CONNECTIONS '%s'", conns);
        }
        output_done(&o);

        holder_stop(&hp);
        ck_assert_int_eq(harness_stop(&h), 0);
}
END_TEST

START_TEST(test_users_fitted) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        _cleanup_free_ char *id = NULL;
        char *lines[MAX_LINES];
        UsersReply raw = {};
        Harness h;
        Output o;
        size_t n;

        users_daemon_start(&h);
        id = lease_alloc_on(h.socket, 66 * MiB, 0, NULL);
        ck_assert_int_eq(harness_conn_open(h.socket, false, &c), 0);
        users_settled(c, false, &raw);
        run_full((const char *const[]){ "--socket", h.socket, "users", NULL },
                 &(Run){ .pty_columns = USERS_PTY_COLUMNS }, &o);
        ck_assert_msg(o.status == 0, "vmmctl users exited with %d: %s", o.status, o.out);
        /* Colour on a terminal: a bold header, coloured bars. */
        ck_assert_msg(strncmp(o.out, "\033[1m", 4) == 0, "no bold header: %s", o.out);
        strip_escapes(o.out);
        n = split_lines(o.out, lines);
        for (size_t i = 0; i < n; i++)
                ck_assert_msg(text_columns(lines[i]) <= USERS_PTY_COLUMNS, "line %zu is %zu columns wide, over %u: '%s'",
                              i, text_columns(lines[i]), USERS_PTY_COLUMNS, lines[i]);
        /* the same cells, lined up, with bars shortened to fit rather than cut */
        ck_assert_uint_lt(check_users_rows(lines, n, &raw), 20);
        output_done(&o);
        users_reply_done(&raw);
        ck_assert_int_eq(harness_stop(&h), 0);
}
END_TEST

START_TEST(test_list_empty) {
        char *lines[MAX_LINES];
        Harness h;
        Output o;

        ck_assert_int_eq(harness_start(&h, NULL), 0);
        RUN_OK(&o, "--socket", h.socket, "list");
        ck_assert_uint_eq(split_lines(o.out, lines), 2);
        check_header(lines[0], list_columns, ELEMENTSOF(list_columns));
        ck_assert_str_eq(lines[1], "No leases of yours.");
        output_done(&o);
        RUN_OK(&o, "--socket", h.socket, "list", "--no-legend");
        ck_assert_str_eq(o.out, "");
        output_done(&o);
        ck_assert_int_eq(harness_stop(&h), 0);
}
END_TEST

START_TEST(test_unreachable) {
        char dir[] = "/tmp/vmmctl-test-XXXXXX", path[64];
        Output o;

        ck_assert_ptr_nonnull(mkdtemp(dir));
        snprintf(path, sizeof(path), "%s/no-such-socket", dir);
        RUN(&o, "--socket", path, "status");
        ck_assert_int_eq(o.status, 3);
        ck_assert_str_eq(o.out, "");
        /* Nothing there, and not the service's socket: how to start a broker there, not systemctl. */
        ck_assert_msg(strncmp(o.err, "vmmctl: ", 8) == 0 && strstr(o.err, path) && strstr(o.err, "nothing is there") &&
                              strstr(o.err, "vmmbrokerd --socket") && !strstr(o.err, "systemctl") &&
                              !strstr(o.err, "group"),
                      "stderr: %s", o.err);
        output_done(&o);
        {
                /* A regular file is not a socket; a socket nobody listens on is a stopped broker's. */
                char file[80], stale[80];
                struct sockaddr_un sa = { .sun_family = AF_UNIX };
                int fd;

                snprintf(file, sizeof(file), "%s/file", dir);
                fd = open(file, O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
                ck_assert_int_ge(fd, 0);
                close(fd);
                RUN(&o, "--socket", file, "status");
                ck_assert_int_eq(o.status, 3);
                ck_assert_msg(strstr(o.err, "it is a regular file, not a socket") && !strstr(o.err, "refused"),
                              "stderr: %s", o.err);
                output_done(&o);
                ck_assert_int_eq(unlink(file), 0);

                snprintf(stale, sizeof(stale), "%s/stale", dir);
                snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", stale);
                fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
                ck_assert_int_eq(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
                close(fd);
                RUN(&o, "--socket", stale, "status");
                ck_assert_int_eq(o.status, 3);
                ck_assert_msg(strstr(o.err, "nobody listens on that socket"), "stderr: %s", o.err);
                output_done(&o);
                ck_assert_int_eq(unlink(stale), 0);
        }
        RUN(&o, "--socket", path, "unpublish", "some-name");
        ck_assert_int_eq(o.status, 3);
        output_done(&o);
        RUN(&o, "--socket", path, "users", "--all");
        ck_assert_int_eq(o.status, 3);
        ck_assert_str_eq(o.out, "");
        output_done(&o);
        ck_assert_int_eq(rmdir(dir), 0);
}
END_TEST

START_TEST(test_usage) {
        static const char *const bad[][4] = {   /* NULL-terminated: at most three arguments */
                { "--no-such-option" },
                { "no-such-command" },
                { "status", "extra" },
                { "--socket" },
                { "status", "--all" },
                { "list", "extra" },
                { "unpublish" },
                { "unpublish", "a-name", "another" },
                { "unpublish", "not a name" },
                { "unpublish", "--all", "a-name" },
                { "unpublish", "/no-owner" },
                { "unpublish", "owner/" },
                { "unpublish", "owner/not a name" },
                { "tokens" },
                { "tokens", "an-id", "another" },
                { "tokens", "" },
                { "tokens", "--all", "an-id" },
                { "users", "extra" },
                { "users", "--all", "extra" },
        };
        Output o;

        for (size_t i = 0; i < ELEMENTSOF(bad); i++) {
                run_full(bad[i], NULL, &o);
                ck_assert_msg(o.status == 2, "%s %s: exit %d", bad[i][0], bad[i][1] ?: "", o.status);
                ck_assert_str_eq(o.out, "");
                ck_assert_msg(strncmp(o.err, "vmmctl: ", 8) == 0 && strstr(o.err, "See 'vmmctl --help'."),
                              "%s: stderr: %s", bad[i][0], o.err);
                output_done(&o);
        }
        /* the missing argument is named */
        RUN(&o, "unpublish");
        ck_assert_ptr_nonnull(strstr(o.err, "NAME"));
        output_done(&o);
        RUN(&o, "tokens");
        ck_assert_ptr_nonnull(strstr(o.err, "ID"));
        output_done(&o);
        /* a malformed name says what a name is */
        RUN(&o, "unpublish", "owner/");
        ck_assert_ptr_nonnull(strstr(o.err, "OWNER/NAME"));
        output_done(&o);

        RUN_OK(&o, "--help");
        ck_assert_ptr_nonnull(strstr(o.out, "Usage: vmmctl"));
        output_done(&o);
        RUN_OK(&o, "-h");
        ck_assert_ptr_nonnull(strstr(o.out, "--no-legend"));
        output_done(&o);

        RUN_OK(&o, "--version");
        ck_assert_str_eq(o.out, "vmmctl " VMMBROKER_VERSION "\n");
        output_done(&o);
}
END_TEST

START_TEST(test_fit_terminal) {
        char *lines[MAX_LINES];
        Output o;
        Fixture f;

        fixture_start(&f);
        check_fitted(f.h.socket, "list", list_columns, ELEMENTSOF(list_columns), LIST_PTY_COLUMNS);
        check_fitted(f.h.socket, "status", status_columns, ELEMENTSOF(status_columns), PTY_COLUMNS);

        /* $COLUMNS wins over the terminal's size: wide enough, nothing is shortened. */
        run_full((const char *const[]){ "--socket", f.h.socket, "list", NULL },
                 &(Run){ .env = (const char *const[]){ "COLUMNS=400", "NO_COLOR=1", NULL },
                         .pty_columns = LIST_PTY_COLUMNS },
                 &o);
        ck_assert_int_eq(o.status, 0);
        ck_assert_ptr_null(strchr(o.out, '\033'));              /* $NO_COLOR */
        ck_assert_ptr_nonnull(strstr(o.out, LONG_LABEL));
        ck_assert_uint_eq(split_lines(o.out, lines), 4);
        output_done(&o);

        /* Not a terminal: nothing is shortened whatever $COLUMNS says. */
        run_full((const char *const[]){ "--socket", f.h.socket, "list", NULL },
                 &(Run){ .env = (const char *const[]){ "COLUMNS=40", NULL } }, &o);
        ck_assert_int_eq(o.status, 0);
        ck_assert_ptr_nonnull(strstr(o.out, LONG_LABEL));
        output_done(&o);
        fixture_stop(&f);
}
END_TEST

int main(void) {
        return run_suite(UNIT_SUITE("vmmctl", NULL, test_status_table, test_status_json, test_list_table,
                                    test_list_json, test_list_all, test_list_holders, test_unpublish,
                                    test_unpublish_other_owner, test_tokens,
                                    test_users_table, test_users_json, test_users_all, test_users_fitted,
                                    test_list_empty, test_unreachable, test_usage, test_fit_terminal,
                                    test_status_numa, test_list_parked)) == 0
                       ? EXIT_SUCCESS
                       : EXIT_FAILURE;
}
