/* SPDX-License-Identifier: MIT */

/*
 * daemon/fair.c: the queue that says whose request is served next. Users take
 * turns (one request each per turn, in the order they first queued), a user's
 * connections take turns within its turn, and a connection that closes leaves
 * the queue whether or not it was queued. The users are real (user.c); the
 * connections are a List link and a number.
 */

#include <check.h>
#include <stdlib.h>

#include "fair.h"
#include "macro.h"
#include "unit.h"
#include "user.h"

typedef struct Conn {
        int id;
        User *user;
        List link;                      /* in user->ready_peers while queued */
} Conn;

static LimitsConfig limits;
static UserRegistry users;
static FairQueue q;

static void setup_users(void) {
        static const uint64_t capacity[] = { UINT64_C(1) << 30 };

        limits = (LimitsConfig){ .defaults = user_limits_default() };
        ck_assert_int_eq(user_registry_init(&users, &limits, capacity, NULL, 1), 0);
        fair_queue_init(&q);
        ck_assert(fair_queue_is_empty(&q));
}

static void conn_init(Conn *c, int id, User *u) {
        *c = (Conn){ .id = id, .user = u };
        list_init(&c->link);
}

static void push(Conn *c) {
        fair_queue_push(&q, c->user, &c->link);
}

/* The id of the connection whose turn it is, or -1 for none. */
static int pop(void) {
        List *link = fair_queue_pop(&q);

        if (!link)
                return -1;
        ck_assert(!list_is_linked(link));       /* taken out: may be queued again */
        return container_of(link, Conn, link)->id;
}

static void drop_users(User **u, size_t n) {
        for (size_t i = 0; i < n; i++)
                user_unref(u[i]);
        user_registry_done(&users);
}

START_TEST(test_empty) {
        setup_users();
        ck_assert_ptr_null(fair_queue_pop(&q));
        ck_assert_uint_eq(q.n_users, 0);
        user_registry_done(&users);
}
END_TEST

/* Users are served one request each per turn, in the order they first queued; a user with more waits. */
START_TEST(test_users_take_turns) {
        User *u[3];
        Conn a[3], b, c[2];

        setup_users();
        for (size_t i = 0; i < 3; i++)
                u[i] = user_get(&users, 1000 + (uid_t)i, NULL, 0);
        /* User 0 has three connections waiting, user 1 one, user 2 two; queued in that order. */
        for (int i = 0; i < 3; i++)
                conn_init(&a[i], 10 + i, u[0]);
        conn_init(&b, 20, u[1]);
        conn_init(&c[0], 30, u[2]);
        conn_init(&c[1], 31, u[2]);
        for (int i = 0; i < 3; i++)
                push(&a[i]);
        push(&b);
        push(&c[0]);
        push(&c[1]);
        ck_assert_uint_eq(q.n_users, 3);

        /* Turn 1: 0, 1, 2. Turn 2: 0, 2 (1 has nothing left). Turn 3: 0. */
        ck_assert_int_eq(pop(), 10);
        ck_assert_int_eq(pop(), 20);
        ck_assert_uint_eq(q.n_users, 2);                /* user 1 left the queue */
        ck_assert_int_eq(pop(), 30);
        ck_assert_int_eq(pop(), 11);
        ck_assert_int_eq(pop(), 31);
        ck_assert_uint_eq(q.n_users, 1);
        ck_assert_int_eq(pop(), 12);
        ck_assert_uint_eq(q.n_users, 0);
        ck_assert(fair_queue_is_empty(&q));
        ck_assert_int_eq(pop(), -1);
        drop_users(u, 3);
}
END_TEST

/* A connection served and queued again goes behind its user's other connections; the user behind the others. */
START_TEST(test_connections_of_a_user_take_turns) {
        User *u[2];
        Conn a[3], b;
        int order[9];

        setup_users();
        u[0] = user_get(&users, 1000, NULL, 0);
        u[1] = user_get(&users, 1001, NULL, 0);
        for (int i = 0; i < 3; i++) {
                conn_init(&a[i], i, u[0]);
                push(&a[i]);
        }
        conn_init(&b, 9, u[1]);
        push(&b);

        /* Each connection is busy: served, it queues its next request at once. */
        for (size_t i = 0; i < ELEMENTSOF(order); i++) {
                List *link = fair_queue_pop(&q);

                ck_assert_ptr_nonnull(link);
                order[i] = container_of(link, Conn, link)->id;
                push(container_of(link, Conn, link));
        }
        /* The users alternate; user 0's connections go round 0, 1, 2 however busy user 1 is. */
        ck_assert_int_eq(order[0], 0);
        ck_assert_int_eq(order[1], 9);
        ck_assert_int_eq(order[2], 1);
        ck_assert_int_eq(order[3], 9);
        ck_assert_int_eq(order[4], 2);
        ck_assert_int_eq(order[5], 9);
        ck_assert_int_eq(order[6], 0);
        ck_assert_int_eq(order[7], 9);
        ck_assert_int_eq(order[8], 1);
        ck_assert_uint_eq(q.n_users, 2);

        for (int i = 0; i < 3; i++)
                fair_queue_remove(&q, u[0], &a[i].link);
        fair_queue_remove(&q, u[1], &b.link);
        ck_assert(fair_queue_is_empty(&q));
        drop_users(u, 2);
}
END_TEST

/* 64 busy connections of one user get one request served for each of another user's one connection. */
START_TEST(test_many_connections_do_not_raise_a_share) {
        User *u[2];
        Conn a[64], b;
        unsigned served[2] = {};

        setup_users();
        u[0] = user_get(&users, 1000, NULL, 0);
        u[1] = user_get(&users, 1001, NULL, 0);
        for (int i = 0; i < 64; i++) {
                conn_init(&a[i], i, u[0]);
                push(&a[i]);
        }
        conn_init(&b, 100, u[1]);
        push(&b);
        for (int i = 0; i < 1000; i++) {
                List *link = fair_queue_pop(&q);
                Conn *c = container_of(link, Conn, link);

                served[c->user == u[1]]++;
                push(c);
        }
        ck_assert_uint_eq(served[0], 500);
        ck_assert_uint_eq(served[1], 500);
        for (int i = 0; i < 64; i++)
                fair_queue_remove(&q, u[0], &a[i].link);
        fair_queue_remove(&q, u[1], &b.link);
        ck_assert(fair_queue_is_empty(&q));
        drop_users(u, 2);
}
END_TEST

/* Removing a queued connection: the others keep their turn; the user leaves with its last one. */
START_TEST(test_remove_queued) {
        User *u[2];
        Conn a[3], b;

        setup_users();
        u[0] = user_get(&users, 1000, NULL, 0);
        u[1] = user_get(&users, 1001, NULL, 0);
        for (int i = 0; i < 3; i++) {
                conn_init(&a[i], i, u[0]);
                push(&a[i]);
        }
        conn_init(&b, 9, u[1]);
        push(&b);

        fair_queue_remove(&q, u[0], &a[1].link);        /* the middle one */
        ck_assert(!list_is_linked(&a[1].link));
        ck_assert_uint_eq(q.n_users, 2);
        fair_queue_remove(&q, u[1], &b.link);           /* user 1's only one: user 1 leaves */
        ck_assert_uint_eq(q.n_users, 1);
        ck_assert(!list_is_linked(&u[1]->link_ready));
        ck_assert_int_eq(pop(), 0);
        ck_assert_int_eq(pop(), 2);
        ck_assert_int_eq(pop(), -1);
        ck_assert_uint_eq(q.n_users, 0);

        /* A user that left comes back at the back of the queue. */
        push(&b);
        push(&a[0]);
        ck_assert_int_eq(pop(), 9);
        ck_assert_int_eq(pop(), 0);
        drop_users(u, 2);
}
END_TEST

/* Removing a connection that is not queued (served already, or never queued) changes nothing. */
START_TEST(test_remove_unqueued) {
        User *u[2];
        Conn a[2], b, never;

        setup_users();
        u[0] = user_get(&users, 1000, NULL, 0);
        u[1] = user_get(&users, 1001, NULL, 0);
        conn_init(&a[0], 0, u[0]);
        conn_init(&a[1], 1, u[0]);
        conn_init(&b, 9, u[1]);
        conn_init(&never, 5, u[0]);
        push(&a[0]);
        push(&a[1]);
        push(&b);

        fair_queue_remove(&q, u[0], &never.link);       /* never queued */
        ck_assert_uint_eq(q.n_users, 2);
        ck_assert_int_eq(pop(), 0);
        fair_queue_remove(&q, u[0], &a[0].link);        /* served: not queued any more */
        ck_assert_uint_eq(q.n_users, 2);
        ck_assert(list_is_linked(&u[0]->link_ready));   /* user 0 still waits with connection 1 */
        fair_queue_remove(&q, u[1], &(Conn){}.link);    /* a zeroed link, as a fresh connection has */
        ck_assert_uint_eq(q.n_users, 2);
        ck_assert_int_eq(pop(), 9);
        ck_assert_int_eq(pop(), 1);
        ck_assert_int_eq(pop(), -1);
        fair_queue_remove(&q, u[0], &a[1].link);        /* removed twice */
        ck_assert_uint_eq(q.n_users, 0);
        drop_users(u, 2);
}
END_TEST

/* n_users counts the users in the queue: each once, whatever its number of connections. */
START_TEST(test_n_users) {
        User *u[4];
        Conn c[8];

        setup_users();
        for (size_t i = 0; i < 4; i++)
                u[i] = user_get(&users, 1000 + (uid_t)i, NULL, 0);
        for (int i = 0; i < 8; i++)
                conn_init(&c[i], i, u[i % 4]);
        for (int i = 0; i < 8; i++) {
                push(&c[i]);
                ck_assert_uint_eq(q.n_users, i < 4 ? (unsigned)i + 1 : 4);
        }
        /* Turn 1 serves one of each user: each still has one left. */
        for (int i = 0; i < 4; i++) {
                ck_assert_int_eq(pop(), i);
                ck_assert_uint_eq(q.n_users, 4);
        }
        /* Turn 2 serves the last of each: each leaves. */
        for (int i = 0; i < 4; i++) {
                ck_assert_int_eq(pop(), 4 + i);
                ck_assert_uint_eq(q.n_users, 3 - (unsigned)i);
        }
        ck_assert(fair_queue_is_empty(&q));
        drop_users(u, 4);
}
END_TEST

int main(void) {
        return run_suite(UNIT_SUITE("fair", NULL, test_empty, test_users_take_turns,
                                    test_connections_of_a_user_take_turns, test_many_connections_do_not_raise_a_share,
                                    test_remove_queued, test_remove_unqueued, test_n_users)) == 0
                       ? EXIT_SUCCESS
                       : EXIT_FAILURE;
}
