/* SPDX-License-Identifier: MIT */

/*
 * Kept leases over the wire (docs/protocol.md, "Keeping a lease for reuse"), on a daemon whose device holds
 * 4 slabs of 2 MiB (--capacity 8M): a holder process A (a child that makes connections and hands them to the
 * test, staying alive as their holder) fills the device and keeps a lease with Free(keep); the test's own
 * process and processes of another user then ask for memory.
 *
 * What a hostile local user tries: another user's process freeing, keeping, attaching or reusing A's kept
 * lease; a call that would fail for want of kept memory nobody gives back; a keeper killed while its memory
 * is asked for. Nothing here sleeps: every wait is a blocking read of a reply or a request (IO_TIMEOUT_S as a
 * failure guard).
 */

#include <check.h>
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "checked.h"
#include "codec.h"
#include "harness.h"
#include "json.h"
#include "macro.h"
#include "rawclient.h"
#include "unit.h"

#define MiB (UINT64_C(1) << 20)
#define UNIT (2 * MiB)                  /* the granularity: one slab */
#define N_UNITS 4                       /* the capacity, in slabs */
#define UID_OTHER 65533

static Harness h;

/* Reads the next reclaim request on a watch; checks it asks for lease `id`. */
static void read_request(VarlinkConn *c, const char *id) {
        ReclaimRequest q;

        ck_assert_int_eq(reclaim_request_read(c, &q), 0);
        ck_assert_ptr_nonnull(q.id);
        ck_assert_str_eq(q.id, id);
        reclaim_request_done(&q);
}

/* Free(id, keep: true): the error name it got (NULL on success, a static string) and `kept`. */
static const char *free_keep(VarlinkConn *c, const char *id, bool *ret_kept) {
        static char error[256];
        char params[128];
        FreeReply f = {};
        Reply r;

        snprintf(params, sizeof(params), "{\"id\": \"%s\", \"keep\": true}", id);
        ck_assert_int_eq(call_text(c, VMMB_METHOD_FREE, params, &r), 0);
        snprintf(error, sizeof(error), "%s", r.error ?: "");
        if (!r.error) {
                ck_assert_int_eq(free_reply_decode(r.params, &f, NULL), 0);
                *ret_kept = f.kept;
        }
        reply_done(&r);
        return error[0] ? error : NULL;
}

/* Whether List (all) shows lease `id`, and kept. */
static bool listed_kept(const char *id, bool *ret_kept) {
        ListReply l = {};
        const WireLeaseInfo *info;
        bool found;

        ck_assert_int_eq(list_get(h.socket, true, &l), 0);
        info = list_find(&l, id);
        found = info != NULL;
        if (ret_kept)
                *ret_kept = info && info->kept;
        list_reply_done(&l);
        return found;
}

/* A's connections: [0] for calls, [1] its watch. Fills the device with A's leases and keeps leases[0]. */
static Connector keeper_fill(VarlinkConn **a, TestLease *leases) {
        Connector x = connector_start(h.socket, getuid(), 2, a);
        bool kept = false;

        for (unsigned i = 0; i < N_UNITS; i++) {
                ck_assert_int_eq(lease_alloc(a[0], UNIT, &leases[i]), 0);
                test_lease_close(&leases[i]);
        }
        watch_reclaim_or_fail(a[1]);
        ck_assert_ptr_null(free_keep(a[0], leases[0].id, &kept));
        ck_assert(kept);
        ck_assert(listed_kept(leases[0].id, &kept) && kept);
        return x;
}

/* An Alloc of one slab with no wait_usec: it would fail at once, but the device's memory is kept. */
static void alloc_send(VarlinkConn *c) {
        _cleanup_(json_object_putp) json_object *params = NULL;
        AllocParams a = { .size = UNIT, .device = 0 };

        ck_assert_int_eq(alloc_params_encode(&a, &params), 0);
        ck_assert_int_eq(call_send(c, VMMB_METHOD_ALLOC, params, false), 0);
}

static void finish(VarlinkConn **a, Connector *x) {
        for (size_t i = 0; i < 2; i++)
                varlink_conn_free(a[i]);
        connector_finish(x);
}

/* ---- the tests ------------------------------------------------------------------------------------------ */

/*
 * Another user's Alloc that asked for no wait, on a device full of A's leases, one of them kept: the daemon
 * asks A for the kept lease at once, and serves the call when A gives it back; A's marked-for-nothing
 * leases are not asked.
 */
START_TEST(test_keep_asked_for_a_call_that_does_not_wait) {
        VarlinkConn *a[2] = {}, *o[1] = {};
        TestLease leases[N_UNITS], got;
        Connector x, y;

        harness_start_capped_or_fail(&h, "8M", "[Broker]\nReclaimTimeout=30s\n");
        x = keeper_fill(a, leases);
        y = connector_start(h.socket, UID_OTHER, 1, o);
        alloc_send(o[0]);
        read_request(a[1], leases[0].id);
        ck_assert_int_eq(lease_free(a[0], leases[0].id), 0);
        got = lease_reply_or_fail(o[0]);
        ck_assert(!listed_kept(leases[0].id, NULL));
        ck_assert_str_ne(got.id, leases[0].id);

        varlink_conn_free(o[0]);
        connector_finish(&y);
        finish(a, &x);
        harness_stop_or_fail(&h);
}
END_TEST

/* Nobody gives it back: the call that did not ask to wait fails at ReclaimTimeout=, OutOfMemory. */
START_TEST(test_keep_not_given_back) {
        VarlinkConn *a[2] = {};
        TestLease leases[N_UNITS];
        _cleanup_(varlink_conn_freep) VarlinkConn *w = NULL;
        bool kept = false;
        Connector x;
        Reply r;

        harness_start_capped_or_fail(&h, "8M", "[Broker]\nReclaimTimeout=100ms\n");
        x = keeper_fill(a, leases);
        ck_assert_int_eq(conn_open(h.socket, &w), 0);
        alloc_send(w);
        read_request(a[1], leases[0].id);
        ck_assert_int_eq(reply_read(w, &r, NULL), 0);
        ck_assert_str_eq(r.error ?: "(none)", VMMB_ERROR_OUT_OF_MEMORY);
        reply_done(&r);
        /* Still A's, still kept; unresponsive, so the next call does not wait for it again. */
        ck_assert(listed_kept(leases[0].id, &kept) && kept);
        ck_assert_int_eq(lease_alloc(a[0], UNIT, &leases[0]), 0);      /* A's own Alloc takes it back */
        test_lease_close(&leases[0]);
        ck_assert(listed_kept(leases[0].id, &kept) && !kept);
        finish(a, &x);
        harness_stop_or_fail(&h);
}
END_TEST

/* The keeper is killed while asked: its memory comes back by its exit, and the call is served. */
START_TEST(test_keep_keeper_killed) {
        VarlinkConn *a[2] = {};
        TestLease leases[N_UNITS];
        _cleanup_(varlink_conn_freep) VarlinkConn *w = NULL;
        Connector x;

        harness_start_capped_or_fail(&h, "8M", NULL);
        x = keeper_fill(a, leases);
        ck_assert_int_eq(conn_open(h.socket, &w), 0);
        alloc_send(w);
        read_request(a[1], leases[0].id);
        ck_assert_int_eq(kill(x.pid, SIGKILL), 0);
        (void)lease_reply_or_fail(w);           /* served */
        for (size_t i = 0; i < 2; i++)
                varlink_conn_free(a[i]);
        x.hold_w = safe_close(x.hold_w);
        (void)harness_wait(x.pid);
        ck_assert(!listed_kept(leases[0].id, NULL));
        harness_stop_or_fail(&h);
}
END_TEST

/*
 * Another user cannot touch a kept lease: Free (keep or not), Share, SetReclaimable and Park by its id are
 * NoSuchLease, a token made before the keep no longer attaches, and its Alloc of the same size gets memory
 * of its own (here: none, the device being full, and the call asks A and waits as above).
 */
START_TEST(test_keep_other_user) {
        VarlinkConn *a[2] = {}, *o[1] = {};
        TestLease leases[N_UNITS], mine;
        static const char *const methods[] = { VMMB_METHOD_SHARE, VMMB_METHOD_SET_RECLAIMABLE,
                                               "io.vmmbroker.Park", "io.vmmbroker.Tokens" };
        char params[160], token[VMMB_TOKEN_MAX + 1];
        bool kept = false;
        Connector x, y;
        Reply r;

        harness_start_capped_or_fail(&h, "8M", "[Broker]\nReclaimTimeout=30s\n");
        x = connector_start(h.socket, getuid(), 2, a);
        for (unsigned i = 0; i < N_UNITS; i++) {
                ck_assert_int_eq(lease_alloc(a[0], UNIT, &leases[i]), 0);
                test_lease_close(&leases[i]);
        }
        watch_reclaim_or_fail(a[1]);
        snprintf(params, sizeof(params), "{\"id\": \"%s\"}", leases[0].id);
        ck_assert_int_eq(call_text(a[0], VMMB_METHOD_SHARE, params, &r), 0);
        ck_assert_ptr_null(r.error);
        snprintf(token, sizeof(token), "%s", reply_str(&r, "token"));
        reply_done(&r);
        ck_assert_ptr_null(free_keep(a[0], leases[0].id, &kept));
        ck_assert(kept);

        y = connector_start(h.socket, UID_OTHER, 1, o);
        ck_assert_str_eq(free_keep(o[0], leases[0].id, &kept), VMMB_ERROR_NO_SUCH_LEASE);
        ck_assert_int_eq(lease_free(o[0], leases[0].id), -EREMOTEIO);
        for (size_t i = 0; i < ELEMENTSOF(methods); i++) {
                ck_assert_int_eq(call_text(o[0], methods[i], params, &r), 0);
                ck_assert_str_eq(r.error ?: "(none)", VMMB_ERROR_NO_SUCH_LEASE);
                reply_done(&r);
        }
        /* Nor A itself: a kept lease is not its to use. (A runs as root, an administrator, who may list any
         * lease's tokens: a kept lease has none, so Tokens is left out here.) */
        for (size_t i = 0; i < ELEMENTSOF(methods) - 1; i++) {
                ck_assert_int_eq(call_text(a[0], methods[i], params, &r), 0);
                ck_assert_str_eq(r.error ?: "(none)", VMMB_ERROR_NO_SUCH_LEASE);
                reply_done(&r);
        }
        snprintf(params, sizeof(params), "{\"token\": \"%s\"}", token);
        ck_assert_int_eq(call_text(o[0], VMMB_METHOD_ATTACH, params, &r), 0);
        ck_assert_str_eq(r.error ?: "(none)", VMMB_ERROR_NO_SUCH_TOKEN);
        reply_done(&r);
        ck_assert(listed_kept(leases[0].id, &kept) && kept);

        /* Its Alloc of the size: memory of its own, once A gave its kept lease back. */
        alloc_send(o[0]);
        read_request(a[1], leases[0].id);
        ck_assert_int_eq(lease_free(a[0], leases[0].id), 0);
        mine = lease_reply_or_fail(o[0]);
        ck_assert_str_ne(mine.id, leases[0].id);

        varlink_conn_free(o[0]);
        connector_finish(&y);
        finish(a, &x);
        harness_stop_or_fail(&h);
}
END_TEST

/*
 * A flood of keeps by one process, each size new (so nothing is reused), is bounded by its user's limits:
 * the kept leases stay charged, so MaxLeases= stops it with QuotaExceeded, and another user's call is served.
 */
START_TEST(test_keep_flood_is_charged) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        VarlinkConn *o[1] = {};
        unsigned made = 0;
        TestLease l;
        bool kept;
        Connector y;
        Reply r;

        harness_start_capped_or_fail(&h, "64M", "[Limits]\nMaxLeases=3\n");
        ck_assert_int_eq(conn_open(h.socket, &c), 0);
        for (unsigned i = 1; i <= 8; i++) {
                char params[64];

                snprintf(params, sizeof(params), "{\"size\": %" PRIu64 "}", i * UNIT);
                ck_assert_int_eq(call_text(c, VMMB_METHOD_ALLOC, params, &r), 0);
                if (r.error) {
                        ck_assert_str_eq(r.error, VMMB_ERROR_QUOTA_EXCEEDED);
                        reply_done(&r);
                        break;
                }
                ck_assert_int_eq(lease_take(&r, &l), 0);
                reply_done(&r);
                test_lease_close(&l);
                made++;
                kept = false;
                ck_assert_ptr_null(free_keep(c, l.id, &kept));
                ck_assert(kept);
        }
        ck_assert_uint_eq(made, 3);
        y = connector_start(h.socket, UID_OTHER, 1, o);
        ck_assert_int_eq(lease_alloc(o[0], UNIT, &l), 0);
        test_lease_close(&l);
        varlink_conn_free(o[0]);
        connector_finish(&y);
        harness_stop_or_fail(&h);
}
END_TEST

int main(void) {
        return run_suite(UNIT_SUITE("keep", NULL, test_keep_asked_for_a_call_that_does_not_wait,
                                    test_keep_not_given_back, test_keep_keeper_killed, test_keep_other_user,
                                    test_keep_flood_is_charged)) == 0
                       ? EXIT_SUCCESS
                       : EXIT_FAILURE;
}
