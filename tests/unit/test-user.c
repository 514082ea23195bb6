/* SPDX-License-Identifier: MIT */

/* daemon/user.c: how limits resolve from [Limits], [Group:] and [User:], and charges against them. */

#include <check.h>
#include <errno.h>
#include <stdlib.h>

#include "macro.h"
#include "unit.h"
#include "user.h"

#define GiB (UINT64_C(1) << 30)

static const uint64_t capacity[] = { 100 * GiB, 10 * GiB };

/* [Limits] MaxLeases=2 MaxBytes=50%; [Group:10] MaxLeases=7; [Group:20] MaxLeases=5 MaxBytes=8G;
 * [Group:30] MaxConnections=3; [User:1000] MaxLeases=1. */
static LimitsConfig config(LimitsRule *rules) {
        LimitsConfig c = { .defaults = user_limits_default(), .rules = rules, .n_rules = 4 };

        c.defaults.max_leases = 2;
        c.defaults.max_bytes_percent = 50;
        rules[0] = (LimitsRule){ .group = true, .id = 10, .limits = { .max_leases = 7, .set = LIMIT_MAX_LEASES } };
        rules[1] = (LimitsRule){ .group = true, .id = 20,
                                 .limits = { .max_leases = 5, .max_bytes = 8 * GiB,
                                             .set = LIMIT_MAX_LEASES | LIMIT_MAX_BYTES } };
        rules[2] = (LimitsRule){ .group = true, .id = 30,
                                 .limits = { .max_connections = 3, .set = LIMIT_MAX_CONNECTIONS } };
        rules[3] = (LimitsRule){ .id = 1000, .limits = { .max_leases = 1, .set = LIMIT_MAX_LEASES } };
        return c;
}

START_TEST(test_resolve) {
        LimitsRule rules[4];
        LimitsConfig c = config(rules);
        UserRegistry r;
        User *u;

        ck_assert_int_eq(user_registry_init(&r, &c, capacity, NULL, 2), 0);

        /* No rule: [Limits], bytes per device from its capacity. */
        u = user_get(&r, 500, (const gid_t[]){ 99 }, 1);
        ck_assert_uint_eq(u->max_leases, 2);
        ck_assert_uint_eq(u->max_bytes[0], 50 * GiB);
        ck_assert_uint_eq(u->max_bytes[1], 5 * GiB);
        ck_assert_uint_eq(u->max_connections, USER_DEFAULT_MAX_CONNECTIONS);
        user_unref(u);

        /* Two groups: key by key, the most generous; a group's bytes replace the default even when smaller. */
        u = user_get(&r, 501, (const gid_t[]){ 20, 10 }, 2);
        ck_assert_uint_eq(u->max_leases, 7);
        ck_assert_uint_eq(u->max_bytes[0], 8 * GiB);
        ck_assert_uint_eq(u->max_bytes[1], 8 * GiB);
        user_unref(u);

        /* A group that sets only connections leaves the rest at [Limits]. */
        u = user_get(&r, 502, (const gid_t[]){ 30 }, 1);
        ck_assert_uint_eq(u->max_connections, 3);
        ck_assert_uint_eq(u->max_leases, 2);
        user_unref(u);

        /* [User:] beats the groups. */
        u = user_get(&r, 1000, (const gid_t[]){ 10 }, 1);
        ck_assert_uint_eq(u->max_leases, 1);
        user_unref(u);
        ck_assert_uint_eq(r.n_users, 0);
        user_registry_done(&r);
}
END_TEST

START_TEST(test_charge) {
        LimitsRule rules[4];
        LimitsConfig c = config(rules);
        UserCharge b1 = USER_CHARGE_NULL, b2 = USER_CHARGE_NULL, b3 = USER_CHARGE_NULL;
        UserCharge l1 = USER_CHARGE_NULL, l2 = USER_CHARGE_NULL, l3 = USER_CHARGE_NULL;
        UserQuota q = {};
        UserRegistry r;
        User *u, *same;

        ck_assert_int_eq(user_registry_init(&r, &c, capacity, NULL, 2), 0);
        u = user_get(&r, 500, NULL, 0);
        same = user_get(&r, 500, NULL, 0);          /* one object per uid, whatever connection asks */
        ck_assert_ptr_eq(u, same);
        ck_assert_uint_eq(r.n_users, 1);

        ck_assert_int_eq(user_charge(u, &b1, USER_BYTES, 1, 4 * GiB, NULL), 0);
        ck_assert_ptr_eq(b1.user, u);
        ck_assert_uint_eq(b1.amount, 4 * GiB);
        ck_assert_int_eq(user_charge(u, &b2, USER_BYTES, 1, 2 * GiB, &q), -EDQUOT);
        ck_assert_int_eq(q.what, USER_BYTES);
        ck_assert_uint_eq(q.limit, 5 * GiB);
        ck_assert_uint_eq(q.current, 4 * GiB);
        ck_assert_uint_eq(q.asked, 2 * GiB);
        ck_assert_ptr_null(b2.user);                /* a refused charge records nothing */
        ck_assert_uint_eq(u->bytes[1], 4 * GiB);    /* and changes nothing */
        ck_assert_int_eq(user_charge(u, &b2, USER_BYTES, 1, UINT64_MAX, NULL), -EDQUOT);   /* no overflow */
        ck_assert_int_eq(user_charge(u, &b3, USER_BYTES, 0, 50 * GiB, NULL), 0);           /* another device */

        ck_assert_int_eq(user_charge(u, &l1, USER_LEASES, 0, 1, NULL), 0);
        ck_assert_int_eq(user_charge(u, &l2, USER_LEASES, 0, 1, NULL), 0);
        ck_assert_int_eq(user_charge(u, &l3, USER_LEASES, 0, 1, &q), -EDQUOT);
        ck_assert_uint_eq(q.limit, 2);
        ck_assert_uint_eq(q.current, 2);

        /* A charge gives back exactly what it took, once: releasing it again does nothing. */
        user_charge_release(&l1);
        ck_assert_uint_eq(u->leases, 1);
        user_charge_release(&l1);
        ck_assert_uint_eq(u->leases, 1);
        ck_assert_ptr_null(l1.user);
        user_charge_release(&b1);
        ck_assert_uint_eq(u->bytes[1], 0);
        ck_assert_uint_eq(u->bytes[0], 50 * GiB);
        ck_assert_str_eq(user_resource_name(USER_CONNECTIONS), "connections");

        /* Charges hold the user: with every reference of the caller gone, it lives on until they are released. */
        user_unref(same);
        user_unref(u);
        ck_assert_uint_eq(r.n_users, 1);
        user_charge_release(&b3);
        user_charge_release(&l2);
        ck_assert_uint_eq(r.n_users, 0);
        user_registry_done(&r);
}
END_TEST

/* Over the limit anyway (leases restored after a restart), and given back the same way. */
START_TEST(test_charge_anyway) {
        LimitsRule rules[4];
        LimitsConfig c = config(rules);
        UserCharge l[3] = {};
        UserRegistry r;
        User *u;

        ck_assert_int_eq(user_registry_init(&r, &c, capacity, NULL, 2), 0);
        u = user_get(&r, 501, NULL, 0);
        for (size_t i = 0; i < 3; i++)
                user_charge_anyway(u, &l[i], USER_LEASES, 0, 1);
        ck_assert_uint_eq(u->leases, 3);            /* over MaxLeases=2 */
        ck_assert_int_eq(user_charge(u, &(UserCharge){}, USER_LEASES, 0, 1, NULL), -EDQUOT);
        for (size_t i = 0; i < 3; i++)
                user_charge_release(&l[i]);
        ck_assert_uint_eq(u->leases, 0);
        user_unref(u);
        user_registry_done(&r);
}
END_TEST

int main(void) {
        return run_suite(UNIT_SUITE("user", NULL, test_resolve, test_charge, test_charge_anyway)) == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
