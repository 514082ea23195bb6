/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The wait queues: Alloc calls that wait for room on a device (Alloc's
 * wait_usec), one queue per device, and whose turn it is when memory comes
 * back.
 *
 * The rule: users (uids) take turns, and a user's own waiters are served
 * first come, first served. The waiter whose turn it is is the oldest waiter
 * of the user at the head; when it is served its user goes to the back of
 * the turns. A waiter that leaves without being served (its deadline passed,
 * its connection closed, its process exited) does not move its user. So two
 * users waiting on a full device get the memory that comes back in turn, and
 * a user with 64 waiters gets one served for each one of another user's.
 *
 * The turn is strict: the waiter at the head is served before any other,
 * even one that would fit when it does not (the caller stops at it), so a
 * large request is not passed over forever by a stream of small ones.
 *
 * A waiter lives in its connection (peer.c), which adds it and takes it out;
 * this module only orders them and counts them. Adding costs O(users waiting
 * on the device); everything else O(1).
 */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "list.h"
#include "user.h"

typedef struct WaitUser WaitUser;

typedef struct Waiter {
        User *user;                     /* whose turn it takes (borrowed: the connection holds a reference) */
        WaitUser *turn;                 /* its user's place in the queue, while queued */
        List link;                      /* in its user's waiters, oldest first */
} Waiter;

typedef struct WaitQueue {
        List users;                     /* WaitUser.link, in turn order */
        unsigned n_waiters;
        unsigned n_users;
} WaitQueue;

void wait_queue_init(WaitQueue *q);

/* Ends an empty queue: every waiter, and so every user's turn, must be gone (it asserts so). */
void wait_queue_done(WaitQueue *q);

/* Queues `w` (not queued) as its user's newest waiter; a user new to the queue takes the last turn.
 * Returns 0 or -ENOMEM. */
int wait_queue_push(WaitQueue *q, Waiter *w, User *u);

/* The waiter whose turn it is, or NULL. */
Waiter *wait_queue_first(const WaitQueue *q);

/* Takes `w` out of the queue; `served` moves its user to the last turn. Accepts a waiter not queued. */
void wait_queue_remove(WaitQueue *q, Waiter *w, bool served);

static inline bool waiter_is_queued(const Waiter *w) {
        return w->turn != NULL;
}

/* Calls fn for every waiter in the queue (fn may remove the one it is given, no other). */
void wait_queue_for_each(WaitQueue *q, void (*fn)(Waiter *w, void *userdata), void *userdata);
