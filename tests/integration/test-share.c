/* SPDX-License-Identifier: MIT */

/*
 * Sharing, end to end on the simulated device: a producer process leases and
 * fills memory, shares it by token or publishes it by name, and consumer
 * processes attach and see its writes. Each test starts its own daemon
 * (harness.h) and drives it with raw varlink (rawclient.h); producers and
 * consumers are forked children that report through pipes.
 *
 * What the issue asks of sharing, and where it is checked:
 *   - several consumers attach one lease and see the producer's writes:
 *     test_consumers_outlive_producer;
 *   - the producer's death does not end the lease while a consumer holds it,
 *     and the last holder's exit returns it zeroed: the same;
 *   - a published lease outlives all holders: test_published_outlives_holders;
 *   - wrong, revoked and foreign-uid tokens fail with named errors:
 *     test_token_errors;
 *   - a slab another uid attached is released, not cached: test_foreign_uid_released;
 *   - read-only holds: test_readonly.
 *
 * Nothing sleeps to synchronise: pipes, waitpid() and request/reply round trips order everything.
 */

#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "codec.h"
#include "harness.h"
#include "macro.h"
#include "rawclient.h"
#include "unit.h"

#define MiB (UINT64_C(1) << 20)
#define LEASE_SIZE (66 * MiB)           /* two slabs: 64 MiB + 2 MiB (start() sets the maximum slab) */
#define WORD 0xC0FFEE01u                /* what producers write */
#define N_CONSUMERS 3
#define NOBODY 65534

/* ---- children ------------------------------------------------------------------------------------ */

/* What a child does. A producer has `produce`; a consumer has `token` or `name`. */
typedef struct Role {
        const char *socket;
        int report_w, hold_r;
        bool produce;                   /* Alloc, map, fill with WORD */
        bool zero;                      /* a producer: check that the lease reads zero before filling it */
        const char *share;              /* then Share with these extra JSON members ("" for none); NULL: no Share */
        const char *publish;            /* then Publish under this name */
        const char *token, *name;       /* a consumer: Attach by one of these */
        bool readonly;                  /* ask Attach for a read-only hold */
        bool map;                       /* a consumer: map and check WORD (and, read-only, that writes fail) */
        uid_t uid;                      /* switch to this user first, unless 0 */
} Role;

/* What a child reports once it holds its lease. */
typedef struct Report {
        char id[VMMB_ID_MAX + 1];
        char token[VMMB_TOKEN_MAX + 1];
        bool readonly;
} Report;

/* Calls `method` with JSON text and takes a successful reply's string member `key` into buf (if key). */
static int child_call(VarlinkConn *c, const char *method, const char *params, const char *key, char *buf,
                      size_t len) {
        Reply r;
        int k = call_text(c, method, params, &r);

        CHILD_CHECK(k == 0, "%s: %s", method, strerror(-k));
        CHILD_CHECK(!r.error, "%s(%s): %s %s", method, params, r.error, json_object_to_json_string(r.params));
        if (key) {
                const char *v = reply_str(&r, key);

                CHILD_CHECK(v && strlen(v) < len, "%s: no %s in the reply", method, key);
                memcpy(buf, v, strlen(v) + 1);
        }
        reply_done(&r);
        return 0;
}

static int child_produce(VarlinkConn *c, const Role *a, Gpu *g, TestLease *l, CUdeviceptr *va, Report *rep) {
        char params[512];
        CUresult r;
        int k;

        k = lease_alloc(c, LEASE_SIZE, l);
        CHILD_CHECK(k == 0, "Alloc: %s", strerror(-k));
        CHILD_CHECK(gpu_map(g, l, va) == 0, "map");
        if (a->zero && gpu_verify(g, *va, LEASE_SIZE, 0) != 0)
                return 1;
        r = g->cu->cuMemsetD32(*va, WORD, LEASE_SIZE / 4);
        CHILD_CHECK(r == CUDA_SUCCESS, "cuMemsetD32: %s", cuda_result_name(g->cu, r));
        memcpy(rep->id, l->id, sizeof(rep->id));
        if (a->share) {
                snprintf(params, sizeof(params), "{\"id\": \"%s\"%s%s}", l->id, *a->share ? ", " : "", a->share);
                if (child_call(c, VMMB_METHOD_SHARE, params, "token", rep->token, sizeof(rep->token)) != 0)
                        return 1;
        }
        if (a->publish) {
                snprintf(params, sizeof(params), "{\"id\": \"%s\", \"name\": \"%s\"}", l->id, a->publish);
                if (child_call(c, VMMB_METHOD_PUBLISH, params, NULL, NULL, 0) != 0)
                        return 1;
        }
        return 0;
}

static int child_consume(VarlinkConn *c, const Role *a, Gpu *g, TestLease *l, CUdeviceptr *va, Report *rep) {
        char params[512];
        CUresult r;
        Reply rep_attach;
        int k;

        snprintf(params, sizeof(params), "{\"%s\": \"%s\", \"readonly\": %s}", a->token ? "token" : "name",
                 a->token ?: a->name, a->readonly ? "true" : "false");
        k = call_text(c, VMMB_METHOD_ATTACH, params, &rep_attach);
        CHILD_CHECK(k == 0, "Attach: %s", strerror(-k));
        CHILD_CHECK(!rep_attach.error, "Attach(%s): %s %s", params, rep_attach.error,
                    json_object_to_json_string(rep_attach.params));
        k = lease_take(&rep_attach, l);
        reply_done(&rep_attach);
        CHILD_CHECK(k == 0, "Attach reply: %s", strerror(-k));
        CHILD_CHECK(l->size == LEASE_SIZE, "attached %" PRIu64 " bytes", l->size);
        memcpy(rep->id, l->id, sizeof(rep->id));
        rep->readonly = l->readonly;
        if (!a->map)
                return 0;
        CHILD_CHECK(gpu_map(g, l, va) == 0, "map");
        if (gpu_verify(g, *va, LEASE_SIZE, WORD) != 0)
                return 1;
        if (l->readonly) {
                r = g->cu->cuMemsetD32(*va, 0, 1);
                CHILD_CHECK(r != CUDA_SUCCESS, "a write to a read-only mapping succeeded");
        }
        return 0;
}

/* A producer or a consumer: gets its lease, reports, holds it until the hold pipe closes, then exits. */
static int child_role(void *arg) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        const Role *a = arg;
        CUdeviceptr va = 0;
        Report rep = {};
        TestLease l = {};
        Gpu g = {};
        int k;

        CHILD_CHECK(close_all_but((const int[]){ a->report_w, a->hold_r }, 2) == 0, "close fds");
        if (a->uid != 0)
                CHILD_CHECK(setgroups(0, NULL) == 0 && setgid(a->uid) == 0 && setuid(a->uid) == 0,
                            "cannot become uid %u: %m", (unsigned)a->uid);
        if (a->produce || a->map)
                CHILD_CHECK(gpu_open(&g) == 0, "no driver");
        k = conn_open(a->socket, &c);
        CHILD_CHECK(k == 0, "connect: %s", strerror(-k));
        k = a->produce ? child_produce(c, a, &g, &l, &va, &rep) : child_consume(c, a, &g, &l, &va, &rep);
        test_lease_close(&l);
        if (k != 0)
                return k;
        CHILD_CHECK(write(a->report_w, &rep, sizeof(rep)) == (ssize_t)sizeof(rep), "pipe");
        CHILD_CHECK(pipe_wait_eof(a->hold_r) == 0, "hold");
        if (va)
                CHILD_CHECK(cuda_unmap(g.cu, va, l.sizes, l.n) == 0, "cuda_unmap");
        if (g.cu)
                gpu_close(&g);
        return 0;
}

/* A running child and what it reported. */
typedef struct Child {
        HeldChild held;
        pid_t pid;
        Report rep;
} Child;

/* Forks child_role() and waits for its report. */
static Child child_start(const Harness *h, Role a) {
        Child x = {};
        int k;

        a.socket = h->socket;
        k = held_child_start(child_role, &a, &a.report_w, &a.hold_r, &x.rep, sizeof(x.rep), &x.held);
        x.pid = x.held.pid;
        ck_assert_msg(k == 0, "child %d did not report (see its stderr)", (int)x.pid);
        return x;
}

/* Lets the child go on and exit; returns its exit status. */
static int child_finish(Child *x) {
        return held_child_finish(&x->held);
}

/* ---- the test process --------------------------------------------------------------------------- */

/* A 64 MiB maximum slab, so that LEASE_SIZE is two slabs and every test crosses a slab boundary. */
static void start(Harness *h) {
        int k = harness_start(h, (const char *const[]){ "--max-slab", "64M", NULL });

        ck_assert_msg(k == 0, "harness_start: %s", strerror(-k));
}

static void stop(Harness *h) {
        ck_assert_int_eq(harness_stop(h), 0);
}

static WireDevice status_of(const Harness *h) {
        WireDevice d;
        int k = harness_status(h->socket, &d);

        ck_assert_msg(k == 0, "Status failed: %s", strerror(-k));
        return d;
}

/* Asks Status until no scrub is in flight (bounded by HARNESS_POLL_MS). */
static WireDevice status_settled(const Harness *h) {
        WireDevice d = status_of(h);

        for (uint64_t end = harness_poll_deadline(); d.scrubbing > 0 && harness_now_msec() < end;)
                d = status_of(h);
        ck_assert_msg(d.scrubbing == 0, "scrubs did not complete: %" PRIu64 " bytes", d.scrubbing);
        return d;
}

/* Calls method(params) and checks for the error `error` (NULL: success). */
static void expect(VarlinkConn *c, const char *method, const char *params, const char *error) {
        Reply r;

        ck_assert_int_eq(call_text(c, method, params, &r), 0);
        if (error)
                ck_assert_msg(r.error && strcmp(r.error, error) == 0, "%s(%s): wanted %s, got %s %s", method, params,
                              error, r.error ?: "success", json_object_to_json_string(r.params));
        else
                ck_assert_msg(!r.error, "%s(%s): %s %s", method, params, r.error,
                              json_object_to_json_string(r.params));
        reply_done(&r);
}

/* The lease as List{all} shows it; ck_assert that it is there. The caller frees *list. */
static const WireLeaseInfo *listed(const Harness *h, const char *id, ListReply *list) {
        const WireLeaseInfo *info;

        ck_assert_int_eq(list_get(h->socket, true, list), 0);
        info = list_find(list, id);
        ck_assert_msg(info, "lease %s is not listed", id);
        return info;
}

static size_t holders_of(const Harness *h, const char *id) {
        ListReply list = {};
        size_t n = listed(h, id, &list)->n_holders;

        list_reply_done(&list);
        return n;
}

START_TEST(test_consumers_outlive_producer) {
        Child producer, consumers[N_CONSUMERS], next;
        ListReply list = {};
        const WireLeaseInfo *info;
        WireDevice d;
        Harness h;

        start(&h);
        producer = child_start(&h, (Role){ .produce = true, .share = "" });
        ck_assert_uint_eq(strlen(producer.rep.token), VMMB_TOKEN_LEN);
        for (size_t i = 0; i < N_CONSUMERS; i++) {
                consumers[i] = child_start(&h, (Role){ .token = producer.rep.token, .map = true });
                ck_assert_str_eq(consumers[i].rep.id, producer.rep.id);
        }

        /* One lease, four holders, charged once. */
        d = status_of(&h);
        ck_assert_uint_eq(d.leased, LEASE_SIZE);
        ck_assert_uint_eq(d.leases, 1);
        info = listed(&h, producer.rep.id, &list);
        ck_assert_uint_eq(info->n_holders, 1 + N_CONSUMERS);
        ck_assert_int_eq(info->pid, producer.pid);
        ck_assert_int_eq(info->holders[0].pid, producer.pid);
        for (size_t i = 0; i < N_CONSUMERS; i++) {
                ck_assert_int_eq(info->holders[1 + i].pid, consumers[i].pid);
                ck_assert(!info->holders[1 + i].readonly);
        }
        list_reply_done(&list);

        /* The producer dies: the consumers keep the lease. */
        ck_assert_int_eq(kill(producer.pid, SIGKILL), 0);
        ck_assert_int_eq(child_finish(&producer), 128 + SIGKILL);
        d = status_of(&h);
        ck_assert_msg(d.leased == LEASE_SIZE && d.leases == 1, "the producer's death ended the lease: leased %" PRIu64,
                      d.leased);
        ck_assert_uint_eq(holders_of(&h, consumers[0].rep.id), N_CONSUMERS);

        /* Every consumer but the last goes: still leased. */
        for (size_t i = 0; i + 1 < N_CONSUMERS; i++) {
                ck_assert_int_eq(child_finish(&consumers[i]), 0);
                ck_assert_uint_eq(status_of(&h).leased, LEASE_SIZE);
        }
        ck_assert_int_eq(child_finish(&consumers[N_CONSUMERS - 1]), 0);

        /* The last one gone: back to the pool, scrubbed, and cached for this user (nobody else held it). */
        d = status_settled(&h);
        ck_assert_uint_eq(d.leased, 0);
        ck_assert_uint_eq(d.leases, 0);
        ck_assert_uint_eq(d.cached, LEASE_SIZE);

        /* This user's next lease reuses those slabs, and reads zero. */
        next = child_start(&h, (Role){ .produce = true, .zero = true });
        ck_assert_uint_eq(status_of(&h).cached, 0);
        ck_assert_int_eq(child_finish(&next), 0);
        stop(&h);
}
END_TEST

START_TEST(test_published_outlives_holders) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        Child producer, consumer, other;
        ListReply list = {};
        const WireLeaseInfo *info;
        Harness h;

        start(&h);
        producer = child_start(&h, (Role){ .produce = true, .publish = "weights-v1" });
        /* The producer exits without freeing: the name keeps the lease. */
        ck_assert_int_eq(child_finish(&producer), 0);
        ck_assert_uint_eq(status_of(&h).leased, LEASE_SIZE);
        info = listed(&h, producer.rep.id, &list);
        ck_assert_str_eq(info->name, "weights-v1");
        ck_assert_uint_eq(info->n_holders, 0);
        list_reply_done(&list);

        /* A later process attaches by name and sees the producer's words; it too exits: still there. */
        consumer = child_start(&h, (Role){ .name = "weights-v1", .map = true });
        ck_assert_str_eq(consumer.rep.id, producer.rep.id);
        ck_assert_uint_eq(holders_of(&h, producer.rep.id), 1);
        ck_assert_int_eq(child_finish(&consumer), 0);
        ck_assert_uint_eq(status_of(&h).leased, LEASE_SIZE);

        /* Names are unique; unknown names are named errors. */
        ck_assert_int_eq(conn_open(h.socket, &c), 0);
        other = child_start(&h, (Role){ .produce = true, .share = "" });
        expect(c, VMMB_METHOD_ATTACH, "{\"name\": \"weights/v2\"}", VMMB_ERROR_NO_SUCH_NAME);
        {
                char params[256];

                /* The other producer holds its lease; this process does not: it cannot publish it... */
                snprintf(params, sizeof(params), "{\"id\": \"%s\", \"name\": \"weights-v1\"}", other.rep.id);
                expect(c, VMMB_METHOD_PUBLISH, params, VMMB_ERROR_NO_SUCH_LEASE);
                /* ...until it attaches; then the name is taken. */
                snprintf(params, sizeof(params), "{\"token\": \"%s\"}", other.rep.token);
                expect(c, VMMB_METHOD_ATTACH, params, NULL);
                snprintf(params, sizeof(params), "{\"id\": \"%s\", \"name\": \"weights-v1\"}", other.rep.id);
                expect(c, VMMB_METHOD_PUBLISH, params, VMMB_ERROR_NAME_IN_USE);
                snprintf(params, sizeof(params), "{\"id\": \"%s\", \"name\": \"-bad name\"}", other.rep.id);
                expect(c, VMMB_METHOD_PUBLISH, params, VMMB_ERROR_INVALID_PARAMETER);
                snprintf(params, sizeof(params), "{\"id\": \"%s\"}", other.rep.id);
                expect(c, VMMB_METHOD_FREE, params, NULL);
        }
        ck_assert_int_eq(child_finish(&other), 0);

        /* Unpublished with nobody holding it: it ends. */
        expect(c, VMMB_METHOD_UNPUBLISH, "{\"name\": \"weights-v1\"}", NULL);
        expect(c, VMMB_METHOD_UNPUBLISH, "{\"name\": \"weights-v1\"}", VMMB_ERROR_NO_SUCH_NAME);
        ck_assert_uint_eq(status_of(&h).leased, 0);
        ck_assert_uint_eq(status_of(&h).leases, 0);
        c = varlink_conn_free(c);
        stop(&h);
}
END_TEST

START_TEST(test_token_errors) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        char params[256];
        Child producer;
        Harness h;

        start(&h);
        ck_assert_int_eq(conn_open(h.socket, &c), 0);
        producer = child_start(&h, (Role){ .produce = true, .share = "" });

        /* Wrong tokens. */
        expect(c, VMMB_METHOD_ATTACH, "{\"token\": \"00000000000000000000000000000000\"}", VMMB_ERROR_NO_SUCH_TOKEN);
        expect(c, VMMB_METHOD_ATTACH, "{\"token\": \"short\"}", VMMB_ERROR_NO_SUCH_TOKEN);
        expect(c, VMMB_METHOD_ATTACH, "{}", VMMB_ERROR_INVALID_PARAMETER);
        expect(c, VMMB_METHOD_ATTACH, "{\"token\": \"a\", \"name\": \"b\"}", VMMB_ERROR_INVALID_PARAMETER);
        expect(c, VMMB_METHOD_REVOKE, "{\"token\": \"00000000000000000000000000000000\"}", VMMB_ERROR_NO_SUCH_TOKEN);

        /* Sharing needs a hold. */
        snprintf(params, sizeof(params), "{\"id\": \"%s\"}", producer.rep.id);
        expect(c, VMMB_METHOD_SHARE, params, VMMB_ERROR_NO_SUCH_LEASE);

        /* Revoked: refused from then on; what it gave stays. */
        snprintf(params, sizeof(params), "{\"token\": \"%s\"}", producer.rep.token);
        expect(c, VMMB_METHOD_ATTACH, params, NULL);
        expect(c, VMMB_METHOD_REVOKE, params, NULL);
        expect(c, VMMB_METHOD_ATTACH, params, VMMB_ERROR_NO_SUCH_TOKEN);
        expect(c, VMMB_METHOD_REVOKE, params, VMMB_ERROR_NO_SUCH_TOKEN);
        ck_assert_uint_eq(holders_of(&h, producer.rep.id), 2);

        /* A token for another uid. */
        {
                Reply r;
                char token[VMMB_TOKEN_MAX + 1];

                snprintf(params, sizeof(params), "{\"id\": \"%s\", \"uid\": 12345}", producer.rep.id);
                ck_assert_int_eq(call_text(c, VMMB_METHOD_SHARE, params, &r), 0);
                ck_assert_ptr_null(r.error);
                snprintf(token, sizeof(token), "%s", reply_str(&r, "token"));
                reply_done(&r);
                snprintf(params, sizeof(params), "{\"token\": \"%s\"}", token);
                expect(c, VMMB_METHOD_ATTACH, params, getuid() == 12345 ? NULL : VMMB_ERROR_PERMISSION_DENIED);
        }
        snprintf(params, sizeof(params), "{\"id\": \"%s\", \"uid\": -1}", producer.rep.id);
        expect(c, VMMB_METHOD_SHARE, params, VMMB_ERROR_INVALID_PARAMETER);
        snprintf(params, sizeof(params), "{\"id\": \"%s\", \"uid\": 4294967295}", producer.rep.id);
        expect(c, VMMB_METHOD_SHARE, params, VMMB_ERROR_INVALID_PARAMETER);

        /* At most LEASE_TOKENS_MAX (64) live tokens per lease: the producer's was revoked; one for uid 12345,
         * 63 more. */
        snprintf(params, sizeof(params), "{\"id\": \"%s\"}", producer.rep.id);
        for (int i = 0; i < 63; i++)
                expect(c, VMMB_METHOD_SHARE, params, NULL);
        expect(c, VMMB_METHOD_SHARE, params, VMMB_ERROR_QUOTA_EXCEEDED);

        /* Free ends this process's hold only. */
        expect(c, VMMB_METHOD_FREE, params, NULL);
        expect(c, VMMB_METHOD_FREE, params, VMMB_ERROR_NO_SUCH_LEASE);
        ck_assert_uint_eq(holders_of(&h, producer.rep.id), 1);
        ck_assert_int_eq(child_finish(&producer), 0);
        ck_assert_uint_eq(status_of(&h).leases, 0);
        c = varlink_conn_free(c);
        stop(&h);
}
END_TEST

START_TEST(test_attach_counts_references) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        char params[256];
        Child producer;
        Harness h;

        start(&h);
        ck_assert_int_eq(conn_open(h.socket, &c), 0);
        producer = child_start(&h, (Role){ .produce = true, .share = "" });
        ck_assert_int_eq(child_finish(&producer), 0);   /* not published: the lease ends with it */
        ck_assert_uint_eq(status_of(&h).leases, 0);
        snprintf(params, sizeof(params), "{\"token\": \"%s\"}", producer.rep.token);
        expect(c, VMMB_METHOD_ATTACH, params, VMMB_ERROR_NO_SUCH_TOKEN);

        /* Two Attach replies to one process: one holder, two references, two Frees. */
        producer = child_start(&h, (Role){ .produce = true, .share = "" });
        snprintf(params, sizeof(params), "{\"token\": \"%s\"}", producer.rep.token);
        expect(c, VMMB_METHOD_ATTACH, params, NULL);
        expect(c, VMMB_METHOD_ATTACH, params, NULL);
        ck_assert_uint_eq(holders_of(&h, producer.rep.id), 2);
        ck_assert_int_eq(child_finish(&producer), 0);
        ck_assert_uint_eq(holders_of(&h, producer.rep.id), 1);
        snprintf(params, sizeof(params), "{\"id\": \"%s\"}", producer.rep.id);
        expect(c, VMMB_METHOD_FREE, params, NULL);
        ck_assert_uint_eq(status_of(&h).leases, 1);
        expect(c, VMMB_METHOD_FREE, params, NULL);
        ck_assert_uint_eq(status_of(&h).leases, 0);
        c = varlink_conn_free(c);
        stop(&h);
}
END_TEST

START_TEST(test_readonly) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        Child producer, ro, asked;
        ListReply list = {};
        const WireLeaseInfo *info;
        char params[256];
        Harness h;

        start(&h);
        producer = child_start(&h, (Role){ .produce = true, .share = "\"readonly\": true" });
        /* A read-only token gives a read-only hold, mapped read-only: writes fail in the child. */
        ro = child_start(&h, (Role){ .token = producer.rep.token, .map = true });
        ck_assert(ro.rep.readonly);

        /* A read-only holder shares only read-only, and cannot publish. */
        ck_assert_int_eq(conn_open(h.socket, &c), 0);
        snprintf(params, sizeof(params), "{\"token\": \"%s\"}", producer.rep.token);
        expect(c, VMMB_METHOD_ATTACH, params, NULL);
        snprintf(params, sizeof(params), "{\"id\": \"%s\"}", producer.rep.id);
        expect(c, VMMB_METHOD_SHARE, params, VMMB_ERROR_PERMISSION_DENIED);
        snprintf(params, sizeof(params), "{\"id\": \"%s\", \"readonly\": true}", producer.rep.id);
        expect(c, VMMB_METHOD_SHARE, params, NULL);
        snprintf(params, sizeof(params), "{\"id\": \"%s\", \"name\": \"ro\"}", producer.rep.id);
        expect(c, VMMB_METHOD_PUBLISH, params, VMMB_ERROR_PERMISSION_DENIED);

        /* A read-write producer publishes read-only; a consumer may also ask for read-only itself. */
        ck_assert_int_eq(child_finish(&producer), 0);
        producer = child_start(&h, (Role){ .produce = true, .share = "" });
        asked = child_start(&h, (Role){ .token = producer.rep.token, .readonly = true, .map = true });
        ck_assert(asked.rep.readonly);
        info = listed(&h, producer.rep.id, &list);
        ck_assert_uint_eq(info->n_holders, 2);
        ck_assert(!info->holders[0].readonly);
        ck_assert(info->holders[1].readonly);
        list_reply_done(&list);

        ck_assert_int_eq(child_finish(&asked), 0);
        ck_assert_int_eq(child_finish(&producer), 0);
        ck_assert_int_eq(child_finish(&ro), 0);
        c = varlink_conn_free(c);
        stop(&h);
}
END_TEST

/* As nobody: the lease published as "for-nobody" (for its owner only) is out of reach. */
static int child_nobody_denied(void *arg) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        static const char *const calls[][2] = {
                /* root's name, not published to nobody: nobody learns nothing of it, not even that it exists */
                { VMMB_METHOD_ATTACH, "{\"name\": \"0/for-nobody\"}" },
                { VMMB_METHOD_UNPUBLISH, "{\"name\": \"0/for-nobody\"}" },
                { VMMB_METHOD_ATTACH, "{\"name\": \"root/for-nobody\"}" },
        };
        int k;

        CHILD_CHECK(close_all_but(NULL, 0) == 0, "close fds");
        CHILD_CHECK(setgroups(0, NULL) == 0 && setgid(NOBODY) == 0 && setuid(NOBODY) == 0, "setuid: %m");
        k = conn_open(arg, &c);
        CHILD_CHECK(k == 0, "connect: %s", strerror(-k));
        for (size_t i = 0; i < ELEMENTSOF(calls); i++) {
                Reply r;

                k = call_text(c, calls[i][0], calls[i][1], &r);
                CHILD_CHECK(k == 0, "%s: %s", calls[i][0], strerror(-k));
                CHILD_CHECK(r.error && strcmp(r.error, VMMB_ERROR_NO_SUCH_NAME) == 0, "%s as nobody: %s",
                            calls[i][0], r.error ?: "allowed");
                reply_done(&r);
        }
        return 0;
}

START_TEST(test_foreign_uid_released) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        Child producer, nobody;
        char params[256];
        WireDevice d;
        Harness h;

        if (geteuid() != 0) {
                fprintf(stderr, "test_foreign_uid_released: not root, cannot run a client of another uid\n");
                return;
        }
        start(&h);
        ck_assert_int_eq(chmod(h.dir, 0711), 0);
        ck_assert_int_eq(chmod(h.socket, 0666), 0);

        /* Shared with nobody only: root cannot use the token, nobody can. */
        producer = child_start(&h, (Role){ .produce = true, .share = "\"uid\": 65534", .publish = "for-nobody" });
        ck_assert_int_eq(conn_open(h.socket, &c), 0);
        snprintf(params, sizeof(params), "{\"token\": \"%s\"}", producer.rep.token);
        expect(c, VMMB_METHOD_ATTACH, params, VMMB_ERROR_PERMISSION_DENIED);
        nobody = child_start(&h, (Role){ .token = producer.rep.token, .uid = NOBODY });

        /* Published for the owner only: nobody may not attach by name, nor unpublish it. */
        {
                pid_t pid = harness_fork(child_nobody_denied, (void *)h.socket);

                ck_assert_int_gt(pid, 0);
                ck_assert_msg(harness_wait(pid) == 0, "nobody's checks failed (see its stderr)");
        }
        ck_assert_int_eq(child_finish(&nobody), 0);
        expect(c, VMMB_METHOD_UNPUBLISH, "{\"name\": \"for-nobody\"}", NULL);
        ck_assert_int_eq(child_finish(&producer), 0);

        /*
         * Another uid held it: its slabs were released, not cached for root. (Releasing closes fds, after
         * which the pool makes one unbound 2 MiB slab ahead of time, pool.h's pool_idle(): that one may be
         * cached; the 66 MiB of the lease may not.)
         */
        d = status_settled(&h);
        ck_assert_uint_eq(d.leased, 0);
        ck_assert_msg(d.cached < LEASE_SIZE, "a lease another uid attached was cached: %" PRIu64 " bytes", d.cached);
        c = varlink_conn_free(c);
        stop(&h);
}
END_TEST

int main(void) {
        return run_suite(UNIT_SUITE("share", NULL, test_consumers_outlive_producer,
                                    test_published_outlives_holders,
                                    test_token_errors,
                                    test_attach_counts_references,
                                    test_readonly,
                                    test_foreign_uid_released)) == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
