/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The fair queue: which connection's request is served next.
 *
 * Connections with a request waiting are queued under their user (uid), and
 * users are served in turn: each turn serves one request of the user at the
 * head, then that user goes to the back. Within a user, its connections take
 * turns the same way. So a user with 64 busy connections gets one request
 * served for every one of another user's, and no connection or user can hold
 * the event loop: the manager serves one round of the queue per wake-up.
 *
 * The lists live in User (ready_peers, link_ready) and in the connection (its
 * own List link); this module only orders them.
 */

#include <stdbool.h>

#include "list.h"
#include "user.h"

typedef struct FairQueue {
        List users;                     /* User.link_ready, in turn order */
        unsigned n_users;
} FairQueue;

void fair_queue_init(FairQueue *q);

/* Queues a connection (`link`, not queued yet) at the back of its user's turn. */
void fair_queue_push(FairQueue *q, User *u, List *link);

/* Takes the connection whose turn it is, or NULL; its user goes to the back. */
List *fair_queue_pop(FairQueue *q);

/* Takes a queued connection out (it closed). Accepts one that is not queued. */
void fair_queue_remove(FairQueue *q, User *u, List *link);

static inline bool fair_queue_is_empty(const FairQueue *q) {
        return q->n_users == 0;
}
