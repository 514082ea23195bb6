/* SPDX-License-Identifier: MIT */

/*
 * Fairness between users, measured as an ORDER, not a time: one user (uid 65533, "A") fills all of its 64
 * connections (MaxConnections= by default) with pipelined calls, another user (uid 65534, "B") makes a call
 * while A's backlog is being served, and the test finds out exactly how many of A's calls the daemon served
 * before B's. A daemon that serves users in turn answers B within a round or two of A's connections; a
 * daemon that serves one connection for as long as it has input answers B after a whole pass over A's
 * backlog.
 *
 * How the order is read, exactly and independently of timing:
 *  - A's backlog has Status calls among its other calls: probes. B's calls are an Alloc and a Free whose
 *    sizes leave a mark in every Status reply made after them: A's leases are 2 MiB (one granule), so
 *    leased / 2 MiB - leases does not move with them, while B's leases (6 MiB from before the flood, 4 MiB
 *    during it) set it to 2 before B's Alloc, 3 between B's Alloc and B's Free, 1 after. Each probe reply
 *    says on which side of B's calls the daemon served it; replies on one connection come in order.
 *  - Replies buffered in sockets do not matter (a reply says when it was made, not when it was read). But
 *    a daemon serving A's calls while A is still writing them would serve part of the backlog before B's
 *    call exists: so the daemon is stopped (SIGSTOP, waited for) while the backlog is written, and
 *    continued after.
 *  - Dispatch order inside the event loop: if B's call were there when the daemon woke up, it would be one
 *    of 65 ready connections in whatever order the loop takes them. It is written once the first of A's
 *    replies has been read: the daemon is serving the backlog by then.
 *  - The only timing left is the test's own reaction (B's Alloc is written right after A's first reply is
 *    read, B's Free right after B's Alloc reply); the bound (an eighth of the probes) leaves room for tens
 *    of milliseconds of that, against a round or two of A's 64 connections for a fair daemon.
 *
 * Connections are made by two small processes, one per uid (connect time credentials are what the daemon
 * goes by), which pass them to the test over a socketpair and stay alive holding them: the test itself
 * writes, reads and counts. Every wait has a timeout (IO_TIMEOUT_S on sockets and polls) that turns a hang
 * into a failure. Runs only as root (it needs two other uids); skipped otherwise.
 */

#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "checked.h"
#include "codec.h"
#include "fdpass.h"
#include "harness.h"
#include "json.h"
#include "macro.h"
#include "rawclient.h"
#include "unit.h"

#define MiB (UINT64_C(1) << 20)
#define UNIT (2 * MiB)                  /* the granularity: A's lease size */
#define UID_A 65533                     /* the flooding user */
#define UID_B 65534                     /* the other user */
#define N_CONN 64                       /* A's connections: MaxConnections= by default */
#define K_READ 500                      /* read flood: List + Status pairs per connection (64 KB written at once) */
#define W_ALLOC 128                     /* Alloc flood: Alloc + Status pairs per connection, each lease then freed */
#define A_MAX_LEASES 64                 /* A's MaxLeases=: the Alloc flood holds at most 128 MiB */
#define B_OLD_SIZE (6 * MiB)            /* B's lease from before the flood: mark 2 */
#define B_NEW_SIZE (4 * MiB)            /* B's Alloc during the flood: mark +1 */

typedef enum Attack {
        ATTACK_READ,                    /* A: List, Status pipelined; B: Alloc */
        ATTACK_ALLOC,                   /* A: Alloc, Status pipelined, each lease freed as it comes; B: Alloc, Free */
} Attack;

/* ---- calls -------------------------------------------------------------------------------------------- */

/* Queues a call with parameters as JSON text (NULL: none). */
static void queue_call(VarlinkConn *c, const char *method, const char *params) {
        _cleanup_(json_object_putp) json_object *p = NULL, *msg = NULL;

        if (params) {
                p = json_tokener_parse(params);
                ck_assert_ptr_nonnull(p);
        }
        ck_assert_int_eq(varlink_call_new(method, p, false, false, &msg), 0);
        ck_assert_int_eq(varlink_conn_send(c, msg, NULL, 0), 0);
}

/* Writes what is queued; the socket must take it all at once (the daemon may be stopped: no waiting). */
static void write_now(VarlinkConn *c) {
        int fd = varlink_conn_get_fd(c), flags = fcntl(fd, F_GETFL), k;

        ck_assert_int_ge(flags, 0);
        ck_assert_int_eq(fcntl(fd, F_SETFL, flags | O_NONBLOCK), 0);
        k = varlink_conn_flush(c);
        ck_assert_int_eq(fcntl(fd, F_SETFL, flags), 0);
        ck_assert_msg(k == 0, "writing calls: %s", strerror(-k));
}

static void queue_alloc(VarlinkConn *c, uint64_t size) {
        char params[64];

        snprintf(params, sizeof(params), "{\"size\": %" PRIu64 "}", size);
        queue_call(c, VMMB_METHOD_ALLOC, params);
}

static void queue_free(VarlinkConn *c, const char *id) {
        char params[VMMB_ID_MAX + 32];

        snprintf(params, sizeof(params), "{\"id\": \"%s\"}", id);
        queue_call(c, VMMB_METHOD_FREE, params);
}

/* One call and its reply, before the flood (blocking, with the sockets' timeouts). */
static void round_trip(VarlinkConn *c, const char *method, const char *params, Reply *ret) {
        ck_assert_int_eq(call_text(c, method, params, ret), 0);
        ck_assert_msg(!ret->error, "%s: %s %s", method, ret->error, json_object_to_json_string(ret->params));
}

/* ---- reading the flood -------------------------------------------------------------------------------- */

typedef struct Flood {
        Attack attack;
        VarlinkConn *a[N_CONN], *b;
        size_t to_come[N_CONN];         /* replies still due on each of A's connections */
        size_t b_to_come;
        unsigned b_step;                /* B's calls written so far */
        char b_old[VMMB_ID_MAX + 1];    /* B's 6 MiB lease (ATTACK_ALLOC) */
        int phase[N_CONN];              /* the last probe's phase on each connection */
        uint64_t probes[3];             /* probes served before B's first call, between its two, after both */
        uint64_t a_replies, leases, refused, frees;
} Flood;

/* The phase a probe reply shows: 0 before B's Alloc, 1 after it (and before B's Free), 2 after B's Free. */
static int probe_phase(const Flood *f, json_object *params) {
        _cleanup_free_ char *message = NULL;
        StatusReply s = {};
        int64_t mark;
        int phase;

        ck_assert_msg(status_reply_decode(params, &s, &message) == 0 && s.n_devices >= 1, "Status reply: %s",
                      message ?: "no device");
        ck_assert_uint_eq(s.devices[0].leased % UNIT, 0);
        mark = (int64_t)(s.devices[0].leased / UNIT) - (int64_t)s.devices[0].leases;
        status_reply_done(&s);
        if (f->attack == ATTACK_READ)
                phase = mark == 0 ? 0 : mark == 1 ? 1 : -1;
        else
                phase = mark == 2 ? 0 : mark == 3 ? 1 : mark == 1 ? 2 : -1;
        ck_assert_msg(phase >= 0, "a Status reply shows %" PRId64 " = leased/2MiB - leases: not a state of B's calls",
                      mark);
        return phase;
}

/* One reply on A's connection i. */
static void a_reply(Flood *f, size_t i, json_object *msg, int *fds, size_t n_fds) {
        _cleanup_free_ char *message = NULL;
        VarlinkReply r = {};
        AllocReply ar = {};
        json_object *v;

        ck_assert_int_eq(varlink_reply_parse(msg, &r), 0);
        if (r.error) {
                /* Alloc over A's MaxLeases=: a pair that ends there */
                ck_assert_msg(f->attack == ATTACK_ALLOC && strcmp(r.error, VMMB_ERROR_QUOTA_EXCEEDED) == 0,
                              "A's call failed: %s", json_object_to_json_string(msg));
                f->refused++;
        } else if (n_fds > 0) {
                /* Alloc: free the lease (on the same connection, behind what is pipelined there) */
                ck_assert_msg(alloc_reply_decode(r.parameters, n_fds, &ar, &message) == 0, "lease: %s", message);
                ck_assert_uint_eq(ar.lease.size, UNIT);
                queue_free(f->a[i], ar.lease.id);
                alloc_reply_done(&ar);
                write_now(f->a[i]);
                f->to_come[i]++;
                f->leases++;
        } else if (r.parameters && json_object_object_get_ex(r.parameters, "devices", NULL)) {
                /* Status: a probe */
                int phase = probe_phase(f, r.parameters);

                ck_assert_msg(phase >= f->phase[i], "connection %zu: replies out of order", i);
                f->phase[i] = phase;
                f->probes[phase]++;
        } else if (r.parameters && json_object_object_get_ex(r.parameters, "leases", &v))
                ;                       /* List */
        else {
                ck_assert_msg(f->attack == ATTACK_ALLOC && (!r.parameters || json_object_object_length(r.parameters) == 0),
                              "unexpected reply %s", json_object_to_json_string(msg));
                f->frees++;
        }
        varlink_reply_done(&r);
        ck_assert_msg(f->to_come[i] > 0, "connection %zu: more replies than calls", i);
        f->to_come[i]--;
        f->a_replies++;
        if (f->a_replies == 1) {
                /* The daemon is serving the backlog: B asks now. */
                queue_alloc(f->b, B_NEW_SIZE);
                write_now(f->b);
                f->b_step = 1;
                f->b_to_come = 1;
        }
}

/* B's reply: its Alloc (then, in ATTACK_ALLOC, its Free of the old lease goes out at once) or its Free. */
static void b_reply(Flood *f, json_object *msg, int *fds, size_t n_fds) {
        VarlinkReply r = {};

        ck_assert_int_eq(varlink_reply_parse(msg, &r), 0);
        ck_assert_msg(!r.error, "B's call %u failed: %s", f->b_step, json_object_to_json_string(msg));
        ck_assert_uint_eq(n_fds, f->b_step == 1 ? 1 : 0);
        varlink_reply_done(&r);
        f->b_to_come--;
        if (f->attack == ATTACK_ALLOC && f->b_step == 1) {
                queue_free(f->b, f->b_old);
                write_now(f->b);
                f->b_step = 2;
                f->b_to_come = 1;
        }
}

/* Reads what one connection has: every complete reply. */
static void drain(Flood *f, VarlinkConn *c, ssize_t i) {
        int k = varlink_conn_read(c);

        ck_assert_msg(k > 0, "connection %zd: %s", i, k == 0 ? "closed by the daemon" : strerror(-k));
        for (;;) {
                _cleanup_(json_object_putp) json_object *msg = NULL;
                _cleanup_free_ int *fds = NULL;
                size_t n_fds = 0;

                k = varlink_conn_next_json(c, &msg, &fds, &n_fds);
                ck_assert_msg(k >= 0, "connection %zd: %s", i, strerror(-k));
                if (k == 0)
                        break;
                if (i < 0)
                        b_reply(f, msg, fds, n_fds);
                else
                        a_reply(f, (size_t)i, msg, fds, n_fds);
                close_many(fds, n_fds);
        }
}

static void read_flood(Flood *f) {
        size_t left;

        for (;;) {
                struct pollfd p[N_CONN + 1];
                size_t idx[N_CONN + 1], n = 0;
                int k;

                left = f->b_to_come;
                for (size_t i = 0; i < N_CONN; i++)
                        left += f->to_come[i];
                if (left == 0 && f->b_step == (f->attack == ATTACK_READ ? 1u : 2u))
                        return;
                /* B first: its next call goes out as soon as its reply is in */
                if (f->b_to_come > 0) {
                        p[n] = (struct pollfd){ .fd = varlink_conn_get_fd(f->b), .events = POLLIN };
                        idx[n++] = SIZE_MAX;
                }
                for (size_t i = 0; i < N_CONN; i++)
                        if (f->to_come[i] > 0) {
                                p[n] = (struct pollfd){ .fd = varlink_conn_get_fd(f->a[i]), .events = POLLIN };
                                idx[n++] = i;
                        }
                k = poll(p, n, IO_TIMEOUT_S * 1000);
                if (k < 0 && errno == EINTR)
                        continue;
                ck_assert_msg(k > 0, "no reply for %d s with %zu to come: %s", IO_TIMEOUT_S, left,
                              k == 0 ? "timed out" : strerror(errno));
                for (size_t j = 0; j < n; j++) {
                        struct pollfd pb = { .fd = varlink_conn_get_fd(f->b), .events = POLLIN };

                        if (idx[j] == SIZE_MAX) {
                                if (p[j].revents)
                                        drain(f, f->b, -1);
                                continue;
                        }
                        if (p[j].revents)
                                drain(f, f->a[idx[j]], (ssize_t)idx[j]);
                        /* B's reply is taken as soon as it is there, not after a whole round of A's */
                        if (f->b_to_come > 0 && poll(&pb, 1, 0) > 0)
                                drain(f, f->b, -1);
                }
        }
}

/* ---- the test ------------------------------------------------------------------------------------------ */

static void run_attack(Attack attack) {
        const char *name = attack == ATTACK_READ ? "List/Status" : "Alloc/Free";
        size_t per_conn = attack == ATTACK_READ ? K_READ : W_ALLOC;
        uint64_t probes = (uint64_t)N_CONN * per_conn, bound = probes / 8;
        char path[64], config[128];
        Connector ca, cb;
        Flood f = { .attack = attack };
        Harness h;
        Reply r;
        FILE *cf;
        int fd, k;

        if (geteuid() != 0) {
                fprintf(stderr, "fairness (%s): not root, cannot run clients of two other uids: skipped\n", name);
                return;
        }

        /* A's leases are capped, so that the Alloc flood stays small in memory (refusals are replies too). */
        snprintf(path, sizeof(path), "/tmp/vmmb-fairness-XXXXXX");
        fd = mkstemp(path);
        ck_assert_int_ge(fd, 0);
        cf = fdopen(fd, "w");
        ck_assert_ptr_nonnull(cf);
        snprintf(config, sizeof(config), "[User:%d]\nMaxLeases=%d\n", UID_A, A_MAX_LEASES);
        fputs(config, cf);
        ck_assert_int_eq(fclose(cf), 0);
        k = harness_start(&h, (const char *const[]){ "--config", path, NULL });
        ck_assert_msg(k == 0, "harness_start: %s", strerror(-k));
        ck_assert_int_eq(chmod(h.dir, 0711), 0);
        ck_assert_int_eq(chmod(h.socket, 0666), 0);

        ca = connector_start(h.socket, UID_A, N_CONN, f.a);
        cb = connector_start(h.socket, UID_B, 1, &f.b);
        /* Each connection answered once: accepted, its user known. */
        for (size_t i = 0; i < N_CONN; i++) {
                round_trip(f.a[i], VMMB_METHOD_STATUS, NULL, &r);
                reply_done(&r);
        }
        if (attack == ATTACK_ALLOC) {
                char params[64];
                TestLease l;

                snprintf(params, sizeof(params), "{\"size\": %" PRIu64 "}", B_OLD_SIZE);
                round_trip(f.b, VMMB_METHOD_ALLOC, params, &r);
                ck_assert_int_eq(lease_take(&r, &l), 0);
                reply_done(&r);
                test_lease_close(&l);
                snprintf(f.b_old, sizeof(f.b_old), "%s", l.id);
        } else {
                round_trip(f.b, VMMB_METHOD_STATUS, NULL, &r);
                reply_done(&r);
        }

        /* The backlog goes into the daemon's sockets while it is stopped; then it goes on. */
        ck_assert_int_eq(harness_freeze(&h), 0);
        for (size_t i = 0; i < N_CONN; i++) {
                for (size_t j = 0; j < per_conn; j++) {
                        if (attack == ATTACK_READ)
                                queue_call(f.a[i], VMMB_METHOD_LIST, NULL);
                        else
                                queue_alloc(f.a[i], UNIT);
                        queue_call(f.a[i], VMMB_METHOD_STATUS, NULL);
                }
                write_now(f.a[i]);
                f.to_come[i] = 2 * per_conn;
        }
        ck_assert_int_eq(harness_thaw(&h), 0);
        read_flood(&f);

        fprintf(stderr,
                "fairness (%s): uid %d wrote %zu calls on each of %d connections (%" PRIu64 " Status probes among "
                "them) and read %" PRIu64 " replies (%" PRIu64 " leases, each freed; %" PRIu64 " refused by "
                "MaxLeases=%d); probes the daemon served before uid %d's Alloc: %" PRIu64 ", between its Alloc and its "
                "Free: %" PRIu64 ", after: %" PRIu64 "; the bound is %" PRIu64 "\n",
                name, UID_A, 2 * per_conn, N_CONN, probes, f.a_replies, f.leases, f.refused, A_MAX_LEASES, UID_B,
                f.probes[0], attack == ATTACK_ALLOC ? f.probes[1] : 0, f.probes[attack == ATTACK_ALLOC ? 2 : 1],
                bound);
        ck_assert_uint_eq(f.probes[0] + f.probes[1] + f.probes[2], probes);
        ck_assert_uint_eq(f.frees, f.leases);
        ck_assert_msg(f.probes[0] < bound,
                      "uid %d's Alloc waited behind uid %d's flood: the daemon served %" PRIu64 " of %" PRIu64
                      " probes before it, a fair daemon serves it within a round or two of the %d connections "
                      "(bound %" PRIu64 ")",
                      UID_B, UID_A, f.probes[0], probes, N_CONN, bound);
        if (attack == ATTACK_ALLOC)
                ck_assert_msg(f.probes[0] + f.probes[1] < bound,
                              "uid %d's Free waited behind uid %d's flood: the daemon served %" PRIu64 " of %" PRIu64
                              " probes before it (bound %" PRIu64 ")",
                              UID_B, UID_A, f.probes[0] + f.probes[1], probes, bound);

        for (size_t i = 0; i < N_CONN; i++)
                f.a[i] = varlink_conn_free(f.a[i]);
        f.b = varlink_conn_free(f.b);
        connector_finish(&ca);
        connector_finish(&cb);
        ck_assert_int_eq(harness_stop(&h), 0);
        (void)unlink(path);
}

/* A pipelines 500 List + Status pairs on each of its 64 connections; B's Alloc is served early. */
START_TEST(test_read_flood) {
        run_attack(ATTACK_READ);
}
END_TEST

/* A pipelines 128 Alloc + Status pairs on each of its 64 connections, freeing each lease as it comes; B's
 * Alloc and Free are served early. */
START_TEST(test_alloc_free_flood) {
        run_attack(ATTACK_ALLOC);
}
END_TEST

int main(void) {
        return run_suite(UNIT_SUITE("fairness", NULL, test_read_flood, test_alloc_free_flood)) == 0 ? EXIT_SUCCESS
                                                                                                     : EXIT_FAILURE;
}
