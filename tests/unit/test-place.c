/* SPDX-License-Identifier: MIT */

/*
 * daemon/place.c: the order in which an Alloc that names no single device
 * tries the devices. most-free: the most room first (cached bytes count as
 * room, scrubbing bytes do not), ties to the lower pool index; first: pool
 * order.
 */

#include <check.h>
#include <errno.h>
#include <stdlib.h>

#include "macro.h"
#include "place.h"
#include "unit.h"

#define MIB (UINT64_C(1) << 20)

static PoolDeviceStats dev(uint64_t capacity, uint64_t leased, uint64_t scrubbing, uint64_t cached) {
        return (PoolDeviceStats){ .capacity = capacity, .leased = leased, .scrubbing = scrubbing,
                                  .cached = cached, .granularity = 2 * MIB };
}

START_TEST(test_names) {
        ck_assert_str_eq(placement_name(PLACEMENT_MOST_FREE), "most-free");
        ck_assert_str_eq(placement_name(PLACEMENT_FIRST), "first");
        ck_assert_int_eq(placement_from_name("most-free"), PLACEMENT_MOST_FREE);
        ck_assert_int_eq(placement_from_name("first"), PLACEMENT_FIRST);
        ck_assert_int_eq(placement_from_name("nearest"), -EINVAL);
        ck_assert_int_eq(placement_from_name(""), -EINVAL);
        ck_assert_int_eq(placement_from_name("Most-Free"), -EINVAL);
}
END_TEST

START_TEST(test_room) {
        PoolDeviceStats s = dev(100 * MIB, 30 * MIB, 10 * MIB, 50 * MIB);

        ck_assert_uint_eq(placement_room(&s), 60 * MIB);        /* cached counts as room */
        s = dev(100 * MIB, 90 * MIB, 20 * MIB, 0);              /* more in use than the capacity */
        ck_assert_uint_eq(placement_room(&s), 0);
}
END_TEST

START_TEST(test_most_free) {
        PoolDeviceStats stats[4] = {
                dev(100 * MIB, 60 * MIB, 0, 0),         /* room 40 */
                dev(100 * MIB, 20 * MIB, 0, 70 * MIB),  /* room 80: cached is room */
                dev(100 * MIB, 0, 30 * MIB, 0),         /* room 70: scrubbing is not */
                dev(100 * MIB, 20 * MIB, 0, 0),         /* room 80, a tie with 1: after it */
        };
        size_t order[4] = { 0, 1, 2, 3 };

        placement_order(PLACEMENT_MOST_FREE, stats, order, 4);
        ck_assert_uint_eq(order[0], 1);
        ck_assert_uint_eq(order[1], 3);
        ck_assert_uint_eq(order[2], 2);
        ck_assert_uint_eq(order[3], 0);

        /* A subset, given out of order: ties still go to the lower index. */
        size_t some[2] = { 3, 1 };

        placement_order(PLACEMENT_MOST_FREE, stats, some, 2);
        ck_assert_uint_eq(some[0], 1);
        ck_assert_uint_eq(some[1], 3);
}
END_TEST

START_TEST(test_first) {
        PoolDeviceStats stats[3] = { dev(100 * MIB, 99 * MIB, 0, 0), dev(100 * MIB, 0, 0, 0), dev(100 * MIB, 0, 0, 0) };
        size_t order[3] = { 2, 0, 1 };

        placement_order(PLACEMENT_FIRST, stats, order, 3);
        ck_assert_uint_eq(order[0], 0);
        ck_assert_uint_eq(order[1], 1);
        ck_assert_uint_eq(order[2], 2);
}
END_TEST

START_TEST(test_empty_and_one) {
        PoolDeviceStats stats[1] = { dev(100 * MIB, 0, 0, 0) };
        size_t order[1] = { 0 };

        placement_order(PLACEMENT_MOST_FREE, stats, order, 0);
        placement_order(PLACEMENT_MOST_FREE, stats, order, 1);
        ck_assert_uint_eq(order[0], 0);
}
END_TEST

int main(void) {
        return run_suite(UNIT_SUITE("place", NULL, test_names, test_room, test_most_free, test_first,
                                    test_empty_and_one)) == 0
                       ? EXIT_SUCCESS
                       : EXIT_FAILURE;
}
