/* SPDX-License-Identifier: MIT */

/*
 * daemon/reclaim.c: which reclaimable leases are asked back, in which order,
 * and how a request ends. The leases are bare structs (only what reclaim.c
 * reads: size, device, the mark); no table, pool or driver.
 */

#include <check.h>
#include <stdlib.h>

#include "lease.h"
#include "macro.h"
#include "reclaim.h"
#include "unit.h"

#define N 6

static ReclaimSet set;
static Lease leases[N];

static void setup(void) {
        ck_assert_int_eq(reclaim_set_init(&set, 2), 0);
        for (size_t i = 0; i < N; i++) {
                leases[i] = (Lease){ .size = 2u << 20, .pool_device = 0 };
                list_init(&leases[i].reclaim.link);
        }
}

static void teardown(void) {
        for (size_t i = 0; i < N; i++)
                reclaim_forget(&set, &leases[i]);
        ck_assert_uint_eq(set.n_marked, 0);
        ck_assert_uint_eq(set.n_asked, 0);
        ck_assert_uint_eq(set.asked_bytes[0], 0);
        reclaim_set_done(&set);
}

static size_t index_of(const Lease *l) {
        return (size_t)(l - leases);
}

static bool all(const Lease *l, void *userdata) {
        return true;
}

static bool not_two(const Lease *l, void *userdata) {
        return index_of(l) != 2;
}

/* Lowest priority first; equal priorities in the order they were marked; a new mark goes behind. */
START_TEST(test_order) {
        Lease *got[N];
        size_t n;

        setup();
        reclaim_mark(&set, &leases[0], 5);
        reclaim_mark(&set, &leases[1], 1);
        reclaim_mark(&set, &leases[2], 5);
        reclaim_mark(&set, &leases[3], 0);
        reclaim_mark(&set, &leases[4], 1);
        n = reclaim_pick(&set, 0, UINT64_MAX, all, NULL, got, N);
        ck_assert_uint_eq(n, 5);
        ck_assert_uint_eq(index_of(got[0]), 3);
        ck_assert_uint_eq(index_of(got[1]), 1);
        ck_assert_uint_eq(index_of(got[2]), 4);
        ck_assert_uint_eq(index_of(got[3]), 0);
        ck_assert_uint_eq(index_of(got[4]), 2);
        /* Marking again moves it to its new place, behind the leases of that priority. */
        reclaim_mark(&set, &leases[3], 5);
        n = reclaim_pick(&set, 0, UINT64_MAX, all, NULL, got, N);
        ck_assert_uint_eq(index_of(got[0]), 1);
        ck_assert_uint_eq(index_of(got[4]), 3);
        ck_assert_uint_eq(set.n_marked, 5);
        teardown();
}
END_TEST

/* Only as many as the bytes need, skipping what cannot be asked, never another device's. */
START_TEST(test_pick_enough) {
        Lease *got[N];

        setup();
        leases[5].pool_device = 1;
        reclaim_mark(&set, &leases[5], 0);
        for (size_t i = 0; i < 4; i++)
                reclaim_mark(&set, &leases[i], (uint32_t)i);
        ck_assert_uint_eq(reclaim_pick(&set, 0, 1, all, NULL, got, N), 1);
        ck_assert_uint_eq(index_of(got[0]), 0);
        ck_assert_uint_eq(reclaim_pick(&set, 0, (2u << 20) + 1, all, NULL, got, N), 2);
        ck_assert_uint_eq(reclaim_pick(&set, 0, 3u << 21, not_two, NULL, got, N), 3);
        ck_assert_uint_eq(index_of(got[2]), 3);
        ck_assert_uint_eq(reclaim_pick(&set, 0, UINT64_MAX, all, NULL, got, 2), 2);
        ck_assert_uint_eq(reclaim_pick(&set, 1, UINT64_MAX, all, NULL, got, N), 1);
        ck_assert_uint_eq(index_of(got[0]), 5);
        ck_assert_uint_eq(reclaim_pick(&set, 7, UINT64_MAX, all, NULL, got, N), 0);
        teardown();
}
END_TEST

/* Asked once; the three ways it ends, each counted once; asked bytes follow. */
START_TEST(test_ask_and_end) {
        Lease *got[N];

        setup();
        for (size_t i = 0; i < 4; i++)
                reclaim_mark(&set, &leases[i], 0);
        reclaim_ask(&set, &leases[0], 100);
        reclaim_ask(&set, &leases[1], 200);
        reclaim_ask(&set, &leases[2], 300);
        ck_assert_uint_eq(set.sent, 3);
        ck_assert_uint_eq(set.asked_bytes[0], 3u << 21);
        /* An asked lease is not picked again, and marking it again does not ask it twice. */
        ck_assert_uint_eq(reclaim_pick(&set, 0, UINT64_MAX, all, NULL, got, N), 1);
        reclaim_mark(&set, &leases[0], 9);
        ck_assert_int_eq(leases[0].reclaim.state, RECLAIM_ASKED);
        ck_assert_uint_eq(reclaim_next_deadline(&set), 100);

        reclaim_forget(&set, &leases[0]);               /* given back */
        ck_assert(reclaim_unmark(&set, &leases[1]));    /* refused */
        ck_assert_uint_eq(reclaim_expire(&set, 299), 0);
        ck_assert_uint_eq(reclaim_expire(&set, 300), 1);        /* timed out */
        ck_assert_int_eq(leases[2].reclaim.state, RECLAIM_UNRESPONSIVE);
        ck_assert_str_eq(reclaim_state_name(leases[2].reclaim.state), "unresponsive");
        ck_assert_uint_eq(set.given_back, 1);
        ck_assert_uint_eq(set.refused, 1);
        ck_assert_uint_eq(set.timed_out, 1);
        ck_assert_uint_eq(set.asked_bytes[0], 0);
        ck_assert_uint_eq(reclaim_next_deadline(&set), UINT64_MAX);
        /* Unresponsive: not picked, until marked again. */
        ck_assert_uint_eq(reclaim_pick(&set, 0, UINT64_MAX, all, NULL, got, N), 1);
        ck_assert_uint_eq(index_of(got[0]), 3);
        reclaim_mark(&set, &leases[2], 0);
        ck_assert_uint_eq(reclaim_pick(&set, 0, UINT64_MAX, all, NULL, got, N), 2);
        ck_assert(!reclaim_unmark(&set, &leases[3]));   /* not asked: no refusal */
        ck_assert_uint_eq(set.refused, 1);
        teardown();
}
END_TEST

int main(void) {
        return run_suite(UNIT_SUITE("reclaim", NULL, test_order, test_pick_enough, test_ask_and_end)) == 0
                       ? EXIT_SUCCESS
                       : EXIT_FAILURE;
}
