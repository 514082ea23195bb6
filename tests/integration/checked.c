/* SPDX-License-Identifier: MIT */

#include <check.h>
#include <string.h>

#include "checked.h"

void harness_start_or_fail(Harness *h, const char *config, const char *const *args) {
        int k = config ? harness_start_config(h, config, args) : harness_start(h, args);

        ck_assert_msg(k == 0, "harness_start: %s (is VMMBROKER_DAEMON set?)", strerror(-k));
}

void harness_start_capped_or_fail(Harness *h, const char *capacity, const char *config) {
        int k = harness_start_capped(h, capacity, config);

        ck_assert_msg(k == 0, "harness_start_capped: %s", strerror(-k));
}

void harness_stop_or_fail(Harness *h) {
        ck_assert_int_eq(harness_stop(h), 0);
}

Connector connector_start(const char *socket, uid_t uid, unsigned n, VarlinkConn **ret) {
        Connector x;
        int k = connector_open(socket, uid, n, &x, ret);

        ck_assert_msg(k == 0, "the connector of uid %u did not pass its connections: %s (see its stderr)",
                      (unsigned)uid, strerror(-k));
        return x;
}

void connector_finish(Connector *x) {
        ck_assert_msg(connector_close(x) == 0, "a connector failed (see its stderr)");
}

void watch_reclaim_or_fail(VarlinkConn *c) {
        ck_assert_int_eq(watch_reclaim(c), 0);
}

TestLease lease_reply_or_fail(VarlinkConn *c) {
        TestLease l;
        Reply r;

        ck_assert_int_eq(reply_read(c, &r, NULL), 0);
        ck_assert_msg(!r.error, "%s %s", r.error, json_object_to_json_string(r.params));
        ck_assert_int_eq(lease_take(&r, &l), 0);
        reply_done(&r);
        test_lease_close(&l);
        return l;
}
