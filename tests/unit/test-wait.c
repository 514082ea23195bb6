/* SPDX-License-Identifier: MIT */

/*
 * daemon/wait.c: whose waiting Alloc is served next on a device. Users take
 * turns, a served user goes to the back, a user's waiters are served first
 * come, first served, and a waiter that leaves unserved does not move its
 * user. The users are real (user.c); the waiters carry a number.
 */

#include <check.h>
#include <stdlib.h>

#include "macro.h"
#include "unit.h"
#include "user.h"
#include "wait.h"

typedef struct TestWaiter {
        int id;
        Waiter w;
} TestWaiter;

static LimitsConfig limits;
static UserRegistry users;
static WaitQueue q;

static void setup(User **u, size_t n) {
        static const uint64_t capacity[] = { UINT64_C(1) << 30 };

        limits = (LimitsConfig){ .defaults = user_limits_default() };
        ck_assert_int_eq(user_registry_init(&users, &limits, capacity, NULL, 1), 0);
        for (size_t i = 0; i < n; i++) {
                u[i] = user_get(&users, 1000 + i, NULL, 0);
                ck_assert_ptr_nonnull(u[i]);
        }
        wait_queue_init(&q);
}

static void teardown(User **u, size_t n) {
        ck_assert_uint_eq(q.n_waiters, 0);
        ck_assert_uint_eq(q.n_users, 0);
        wait_queue_done(&q);
        for (size_t i = 0; i < n; i++)
                user_unref(u[i]);
        user_registry_done(&users);
}

static void push(TestWaiter *t, int id, User *u) {
        *t = (TestWaiter){ .id = id };
        ck_assert_int_eq(wait_queue_push(&q, &t->w, u), 0);
        ck_assert(waiter_is_queued(&t->w));
}

/* Serves the waiter whose turn it is; returns its id, -1 for none. */
static int serve(void) {
        Waiter *w = wait_queue_first(&q);

        if (!w)
                return -1;
        wait_queue_remove(&q, w, true);
        ck_assert(!waiter_is_queued(w));
        return container_of(w, TestWaiter, w)->id;
}

START_TEST(test_empty) {
        User *u[1];

        setup(u, 1);
        ck_assert_ptr_null(wait_queue_first(&q));
        ck_assert_int_eq(serve(), -1);
        teardown(u, 1);
}
END_TEST

/* A's three waiters came first, then B's three: served A, B, A, B, A, B, each user's in order. */
START_TEST(test_users_take_turns) {
        TestWaiter t[6];
        User *u[2];
        const int expect[] = { 0, 3, 1, 4, 2, 5 };

        setup(u, 2);
        for (int i = 0; i < 6; i++)
                push(&t[i], i, u[i / 3]);
        ck_assert_uint_eq(q.n_waiters, 6);
        ck_assert_uint_eq(q.n_users, 2);
        for (size_t i = 0; i < ELEMENTSOF(expect); i++)
                ck_assert_int_eq(serve(), expect[i]);
        ck_assert_int_eq(serve(), -1);
        teardown(u, 2);
}
END_TEST

/* 64 waiters of one user do not raise its share: a later user's one waiter is served second. */
START_TEST(test_many_waiters_do_not_raise_a_share) {
        TestWaiter t[65];
        User *u[2];

        setup(u, 2);
        for (int i = 0; i < 64; i++)
                push(&t[i], i, u[0]);
        push(&t[64], 64, u[1]);
        ck_assert_int_eq(serve(), 0);
        ck_assert_int_eq(serve(), 64);
        for (int i = 1; i < 64; i++)
                ck_assert_int_eq(serve(), i);
        teardown(u, 2);
}
END_TEST

/* A waiter that leaves unserved (its deadline, its connection) keeps its user's turn where it was. */
START_TEST(test_leaving_keeps_the_turn) {
        TestWaiter t[4];
        User *u[2];

        setup(u, 2);
        push(&t[0], 0, u[0]);
        push(&t[1], 1, u[0]);
        push(&t[2], 2, u[1]);
        push(&t[3], 3, u[1]);
        wait_queue_remove(&q, &t[0].w, false);          /* A's first leaves: A's second is first now */
        ck_assert_ptr_eq(wait_queue_first(&q), &t[1].w);
        wait_queue_remove(&q, &t[3].w, false);          /* B's last leaves: no change of turn */
        wait_queue_remove(&q, &t[3].w, false);          /* not queued any more: nothing happens */
        ck_assert_uint_eq(q.n_waiters, 2);
        ck_assert_int_eq(serve(), 1);
        ck_assert_int_eq(serve(), 2);
        ck_assert_int_eq(serve(), -1);
        teardown(u, 2);
}
END_TEST

static void remove_odd(Waiter *w, void *userdata) {
        unsigned *seen = userdata;

        (*seen)++;
        if (container_of(w, TestWaiter, w)->id % 2)
                wait_queue_remove(&q, w, false);
}

/* Every waiter is seen once, and may be removed as it is (a user's last included). */
START_TEST(test_for_each_removes) {
        TestWaiter t[5];
        User *u[3];
        unsigned seen = 0;

        setup(u, 3);
        push(&t[0], 0, u[0]);
        push(&t[1], 1, u[0]);
        push(&t[2], 2, u[1]);
        push(&t[3], 3, u[2]);                           /* u[2]'s only waiter: its turn goes with it */
        push(&t[4], 4, u[1]);
        wait_queue_for_each(&q, remove_odd, &seen);
        ck_assert_uint_eq(seen, 5);
        ck_assert_uint_eq(q.n_waiters, 3);
        ck_assert_uint_eq(q.n_users, 2);
        ck_assert_int_eq(serve(), 0);
        ck_assert_int_eq(serve(), 2);
        ck_assert_int_eq(serve(), 4);
        teardown(u, 3);
}
END_TEST

int main(void) {
        return run_suite(UNIT_SUITE("wait", NULL, test_empty, test_users_take_turns,
                                    test_many_waiters_do_not_raise_a_share, test_leaving_keeps_the_turn,
                                    test_for_each_removes)) == 0
                       ? EXIT_SUCCESS
                       : EXIT_FAILURE;
}
