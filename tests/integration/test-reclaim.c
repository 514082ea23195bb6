/* SPDX-License-Identifier: MIT */

/*
 * Reclaimable leases: on a daemon whose device holds 4 slabs of 2 MiB
 * (--capacity 8M), a holder process A (a child that makes connections and
 * hands them to the test, staying alive as their holder) fills the device,
 * marks leases reclaimable and watches (WatchReclaim) on a connection of its
 * own; the test's own process waits in an Alloc, and the daemon asks A.
 *
 * Nothing here sleeps: the test reads the requests from A's watch
 * connection and the waiting call's reply with blocking reads (IO_TIMEOUT_S
 * as a failure guard); a deadline passing is seen as the next request or
 * the waiting call's reply, which the daemon sends only then.
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
#define UNIT (2 * MiB)                  /* the granularity: one slab */
#define N_UNITS 4                       /* the capacity, in slabs */
#define UID_OTHER 65533

static Harness h;

/* ---- calls ---------------------------------------------------------------------------------------------- */

/* Reads the next reclaim request on a watch: its lease id into id[]. */
static void read_request(VarlinkConn *c, char *id, int64_t *ret_timeout) {
        ReclaimRequest q;

        ck_assert_int_eq(reclaim_request_read(c, &q), 0);
        ck_assert_ptr_nonnull(q.id);
        ck_assert_int_eq(q.size, UNIT);
        ck_assert_int_eq(q.device, 0);
        snprintf(id, VMMB_ID_MAX + 1, "%s", q.id);
        if (ret_timeout)
                *ret_timeout = q.timeout_usec;
        reclaim_request_done(&q);
}

/* SetReclaimable; the error it got, or NULL (a static string). */
static const char *set_reclaimable(VarlinkConn *c, const char *id, int64_t priority) {
        static char error[256];
        char params[160];
        Reply r;

        if (priority < 0)
                snprintf(params, sizeof(params), "{\"id\": \"%s\"}", id);
        else
                snprintf(params, sizeof(params), "{\"id\": \"%s\", \"priority\": %" PRId64 "}", id, priority);
        ck_assert_int_eq(call_text(c, VMMB_METHOD_SET_RECLAIMABLE, params, &r), 0);
        snprintf(error, sizeof(error), "%s", r.error ?: "");
        reply_done(&r);
        return error[0] ? error : NULL;
}

/* The lease's reclaim state as List (all) shows it: "marked", "asked", "unresponsive" or "-". */
static void check_state(const char *id, const char *state) {
        ListReply l = {};
        const WireLeaseInfo *info;

        ck_assert_int_eq(list_get(h.socket, true, &l), 0);
        info = list_find(&l, id);
        ck_assert_ptr_nonnull(info);
        ck_assert_str_eq(info->reclaim ?: "-", state);
        list_reply_done(&l);
}

/* A's connections: [0] for calls, [1] its watch. Fills the device with A's leases. */
static Connector holder_fill(VarlinkConn **a, TestLease *leases) {
        Connector x = connector_start(h.socket, getuid(), 2, a);

        for (unsigned i = 0; i < N_UNITS; i++) {
                ck_assert_int_eq(lease_alloc(a[0], UNIT, &leases[i]), 0);
                test_lease_close(&leases[i]);
        }
        watch_reclaim_or_fail(a[1]);
        return x;
}

/* ---- the tests ------------------------------------------------------------------------------------------ */

/* A waiting Alloc asks the lowest priority first; the holder's Free serves it; the other stays marked. */
START_TEST(test_reclaim_lowest_priority_first) {
        _cleanup_(varlink_conn_freep) VarlinkConn *w = NULL;
        VarlinkConn *a[2] = {};
        TestLease leases[N_UNITS];
        char id[VMMB_ID_MAX + 1];
        int64_t timeout = 0;
        Connector x;

        harness_start_capped_or_fail(&h, "8M", "[Broker]\nReclaimTimeout=7s\n");
        x = holder_fill(a, leases);
        ck_assert_ptr_null(set_reclaimable(a[0], leases[0].id, 5));
        ck_assert_ptr_null(set_reclaimable(a[0], leases[1].id, 1));
        ck_assert_ptr_null(set_reclaimable(a[0], leases[2].id, 5));
        check_state(leases[1].id, "marked");

        ck_assert_int_eq(conn_open(h.socket, &w), 0);
        ck_assert_int_eq(alloc_wait_send(w, UNIT, 60 * 1000000), 0);
        read_request(a[1], id, &timeout);
        ck_assert_str_eq(id, leases[1].id);
        ck_assert_int_eq(timeout, 7 * 1000000);
        check_state(leases[1].id, "asked");
        check_state(leases[0].id, "marked");
        ck_assert_int_eq(lease_free(a[0], leases[1].id), 0);
        (void)lease_reply_or_fail(w);   /* kept: the device stays full */

        /* Asked in turn: the next waiting call asks the next lease, the earlier marked of priority 5. */
        ck_assert_int_eq(alloc_wait_send(w, UNIT, 60 * 1000000), 0);
        read_request(a[1], id, NULL);
        ck_assert_str_eq(id, leases[0].id);
        ck_assert_int_eq(lease_free(a[0], leases[0].id), 0);
        (void)lease_reply_or_fail(w);   /* kept: the device stays full */
        check_state(leases[2].id, "marked");

        for (size_t i = 0; i < 2; i++)
                varlink_conn_free(a[i]);
        connector_finish(&x);
        harness_stop_or_fail(&h);
}
END_TEST

/*
 * A holder that does not answer: at the deadline its lease is unresponsive (not reclaimable any more) and
 * the next lease is asked; with none left, the waiting call fails at its own deadline.
 */
START_TEST(test_reclaim_unanswered) {
        _cleanup_(varlink_conn_freep) VarlinkConn *w = NULL;
        VarlinkConn *a[2] = {};
        TestLease leases[N_UNITS];
        char id[VMMB_ID_MAX + 1];
        Connector x;
        Reply r;

        harness_start_capped_or_fail(&h, "8M", "[Broker]\nReclaimTimeout=100ms\n");
        x = holder_fill(a, leases);
        ck_assert_ptr_null(set_reclaimable(a[0], leases[0].id, 0));
        ck_assert_ptr_null(set_reclaimable(a[0], leases[1].id, 1));

        ck_assert_int_eq(conn_open(h.socket, &w), 0);
        ck_assert_int_eq(alloc_wait_send(w, UNIT, 60 * 1000000), 0);
        read_request(a[1], id, NULL);
        ck_assert_str_eq(id, leases[0].id);
        /* Not answered: the next request comes only once the first one's deadline passed. */
        read_request(a[1], id, NULL);
        ck_assert_str_eq(id, leases[1].id);
        check_state(leases[0].id, "unresponsive");
        /* Refused (unmarked) now: nothing left to ask. */
        ck_assert_ptr_null(set_reclaimable(a[0], leases[1].id, -1));
        check_state(leases[1].id, "-");
        varlink_conn_free(w);
        w = NULL;

        /* A waiting call with nobody left to ask fails at its own deadline; unresponsive stays so. */
        ck_assert_int_eq(conn_open(h.socket, &w), 0);
        ck_assert_int_eq(alloc_wait_send(w, UNIT, 200 * 1000), 0);
        ck_assert_int_eq(reply_read(w, &r, NULL), 0);
        ck_assert_str_eq(r.error, VMMB_ERROR_OUT_OF_MEMORY);
        reply_done(&r);
        check_state(leases[0].id, "unresponsive");
        /* Marking it again makes it reclaimable again. */
        ck_assert_ptr_null(set_reclaimable(a[0], leases[0].id, 3));
        check_state(leases[0].id, "marked");

        for (size_t i = 0; i < 2; i++)
                varlink_conn_free(a[i]);
        connector_finish(&x);
        harness_stop_or_fail(&h);
}
END_TEST

/* A holder killed while asked: its leases come back by its exit, and the waiting call is served. */
START_TEST(test_reclaim_holder_killed) {
        _cleanup_(varlink_conn_freep) VarlinkConn *w = NULL;
        VarlinkConn *a[2] = {};
        TestLease leases[N_UNITS];
        char id[VMMB_ID_MAX + 1];
        Connector x;

        harness_start_capped_or_fail(&h, "8M", NULL);
        x = holder_fill(a, leases);
        ck_assert_ptr_null(set_reclaimable(a[0], leases[2].id, 0));
        ck_assert_int_eq(conn_open(h.socket, &w), 0);
        ck_assert_int_eq(alloc_wait_send(w, UNIT, 60 * 1000000), 0);
        read_request(a[1], id, NULL);
        ck_assert_str_eq(id, leases[2].id);
        ck_assert_int_eq(kill(x.pid, SIGKILL), 0);
        (void)lease_reply_or_fail(w);   /* kept: the device stays full */
        for (size_t i = 0; i < 2; i++)
                varlink_conn_free(a[i]);
        x.hold_w = safe_close(x.hold_w);
        (void)harness_wait(x.pid);
        harness_stop_or_fail(&h);
}
END_TEST

/*
 * What is never asked: a lease whose holder does not watch, a published lease, and the waiting process's
 * own lease; the waiting call fails at its deadline and they stay "marked".
 */
START_TEST(test_reclaim_not_asked) {
        _cleanup_(varlink_conn_freep) VarlinkConn *w = NULL, *nw = NULL;
        VarlinkConn *a[2] = {};
        TestLease leases[N_UNITS], own;
        Connector x;
        Reply r;

        harness_start_capped_or_fail(&h, "8M", NULL);
        x = connector_start(h.socket, getuid(), 2, a);            /* A: no watch */
        for (unsigned i = 0; i < N_UNITS - 1; i++) {
                ck_assert_int_eq(lease_alloc(a[0], UNIT, &leases[i]), 0);
                test_lease_close(&leases[i]);
        }
        ck_assert_int_eq(conn_open(h.socket, &w), 0);
        ck_assert_int_eq(conn_open(h.socket, &nw), 0);
        ck_assert_int_eq(lease_alloc(w, UNIT, &own), 0);        /* the waiting process's own */
        test_lease_close(&own);
        watch_reclaim_or_fail(nw);
        ck_assert_ptr_null(set_reclaimable(a[0], leases[0].id, 0));
        ck_assert_ptr_null(set_reclaimable(a[0], leases[1].id, 0));
        {
                char params[160];

                snprintf(params, sizeof(params), "{\"id\": \"%s\", \"name\": \"kept\"}", leases[1].id);
                ck_assert_int_eq(call_text(a[0], VMMB_METHOD_PUBLISH, params, &r), 0);
                ck_assert_ptr_null(r.error);
                reply_done(&r);
        }
        ck_assert_ptr_null(set_reclaimable(w, own.id, 0));
        ck_assert_int_eq(alloc_wait_send(w, UNIT, 300 * 1000), 0);
        ck_assert_int_eq(reply_read(w, &r, NULL), 0);
        ck_assert_str_eq(r.error, VMMB_ERROR_OUT_OF_MEMORY);
        reply_done(&r);
        check_state(leases[0].id, "marked");
        check_state(leases[1].id, "marked");
        check_state(own.id, "marked");

        for (size_t i = 0; i < 2; i++)
                varlink_conn_free(a[i]);
        connector_finish(&x);
        harness_stop_or_fail(&h);
}
END_TEST

/*
 * Who may mark: only a holder, only of the owner's user, read-write; a process that is not a holder gets
 * NoSuchLease, as for a lease that does not exist. One watch per process; WatchReclaim needs "more".
 */
START_TEST(test_reclaim_rules) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL, *c2 = NULL;
        VarlinkConn *o[2] = {};
        TestLease l;
        _cleanup_(json_object_putp) json_object *msg = NULL;
        char params[160];
        Connector x;
        Reply r;

        harness_start_capped_or_fail(&h, "8M", NULL);
        ck_assert_int_eq(conn_open(h.socket, &c), 0);
        ck_assert_int_eq(conn_open(h.socket, &c2), 0);
        ck_assert_int_eq(lease_alloc(c, UNIT, &l), 0);
        test_lease_close(&l);
        ck_assert_str_eq(set_reclaimable(c, "0123456789abcdef0123456789abcdef", 0), VMMB_ERROR_NO_SUCH_LEASE);
        snprintf(params, sizeof(params), "{\"id\": \"%s\", \"priority\": 2147483648}", l.id);
        ck_assert_int_eq(call_text(c, VMMB_METHOD_SET_RECLAIMABLE, params, &r), 0);
        ck_assert_str_eq(r.error, VMMB_ERROR_INVALID_PARAMETER);
        reply_done(&r);
        snprintf(params, sizeof(params), "{\"id\": \"%s\", \"priority\": -1}", l.id);
        ck_assert_int_eq(call_text(c, VMMB_METHOD_SET_RECLAIMABLE, params, &r), 0);
        ck_assert_str_eq(r.error, VMMB_ERROR_INVALID_PARAMETER);
        reply_done(&r);

        /* Another process, of the same user or not, holds nothing: NoSuchLease. */
        x = connector_start(h.socket, geteuid() == 0 ? UID_OTHER : getuid(), 2, o);
        ck_assert_str_eq(set_reclaimable(o[0], l.id, 0), VMMB_ERROR_NO_SUCH_LEASE);
        if (geteuid() == 0) {
                /* A holder of another user (it attached with a token): PermissionDenied. */
                TestLease attached;
                const char *token;

                snprintf(params, sizeof(params), "{\"id\": \"%s\"}", l.id);
                ck_assert_int_eq(call_text(c, VMMB_METHOD_SHARE, params, &r), 0);
                ck_assert_ptr_null(r.error);
                token = reply_str(&r, "token");
                snprintf(params, sizeof(params), "{\"token\": \"%s\"}", token);
                reply_done(&r);
                ck_assert_int_eq(call_text(o[0], VMMB_METHOD_ATTACH, params, &r), 0);
                ck_assert_msg(!r.error, "%s", r.error);
                ck_assert_int_eq(lease_take(&r, &attached), 0);
                reply_done(&r);
                test_lease_close(&attached);
                ck_assert_str_eq(set_reclaimable(o[0], l.id, 0), VMMB_ERROR_PERMISSION_DENIED);
        }
        ck_assert_ptr_null(set_reclaimable(c, l.id, 0));
        check_state(l.id, "marked");

        /* WatchReclaim without more; a second watch of the same process. */
        ck_assert_int_eq(call_text(c2, VMMB_METHOD_WATCH_RECLAIM, NULL, &r), 0);
        ck_assert_str_eq(r.error, VMMB_ERROR_INVALID_PARAMETER);
        reply_done(&r);
        watch_reclaim_or_fail(c2);
        ck_assert_int_eq(varlink_call_new(VMMB_METHOD_WATCH_RECLAIM, NULL, false, true, &msg), 0);
        ck_assert_int_eq(varlink_conn_send(c, msg, NULL, 0), 0);
        ck_assert_int_eq(varlink_conn_flush(c), 0);
        ck_assert_int_eq(reply_read(c, &r, NULL), 0);
        ck_assert_str_eq(r.error, VMMB_ERROR_INVALID_PARAMETER);
        reply_done(&r);
        /* The refused call left the connection as it was: it still serves calls. */
        ck_assert_int_eq(lease_free(c, l.id), 0);

        for (size_t i = 0; i < 2; i++)
                varlink_conn_free(o[i]);
        connector_finish(&x);
        harness_stop_or_fail(&h);
}
END_TEST

int main(void) {
        return run_suite(UNIT_SUITE("reclaim", NULL, test_reclaim_lowest_priority_first, test_reclaim_unanswered,
                                    test_reclaim_holder_killed, test_reclaim_not_asked, test_reclaim_rules)) == 0
                       ? EXIT_SUCCESS
                       : EXIT_FAILURE;
}
