/* SPDX-License-Identifier: MIT */

#include <assert.h>
#include <errno.h>
#include <stdlib.h>

#include "macro.h"
#include "wait.h"

/* A user with waiters on the device: its place in the turns, and its waiters, oldest first. */
struct WaitUser {
        User *user;
        List waiters;                   /* Waiter.link */
        List link;                      /* in WaitQueue.users */
};

void wait_queue_init(WaitQueue *q) {
        *q = (WaitQueue){};
        list_init(&q->users);
}

void wait_queue_done(WaitQueue *q) {
        assert(q->n_waiters == 0 && list_is_empty(&q->users));
}

int wait_queue_push(WaitQueue *q, Waiter *w, User *u) {
        WaitUser *t = NULL, *i;

        list_for_each_entry(i, &q->users, link)
                if (i->user == u) {
                        t = i;
                        break;
                }
        if (!t) {
                t = calloc(1, sizeof(*t));
                if (!t)
                        return -ENOMEM;
                t->user = u;
                list_init(&t->waiters);
                list_link_tail(&q->users, &t->link);
                q->n_users++;
        }
        w->user = u;
        w->turn = t;
        list_link_tail(&t->waiters, &w->link);
        q->n_waiters++;
        return 0;
}

Waiter *wait_queue_first(const WaitQueue *q) {
        WaitUser *t;

        if (list_is_empty(&q->users))
                return NULL;
        t = list_first_entry(&q->users, WaitUser, link);
        return list_first_entry(&t->waiters, Waiter, link);
}

void wait_queue_remove(WaitQueue *q, Waiter *w, bool served) {
        WaitUser *t = w->turn;

        if (!t)
                return;
        list_unlink(&w->link);
        w->turn = NULL;
        q->n_waiters--;
        if (list_is_empty(&t->waiters)) {
                list_unlink(&t->link);
                q->n_users--;
                free(t);
        } else if (served) {
                list_unlink(&t->link);
                list_link_tail(&q->users, &t->link);
        }
}

void wait_queue_for_each(WaitQueue *q, void (*fn)(Waiter *w, void *userdata), void *userdata) {
        WaitUser *t, *tt;

        list_for_each_entry_safe(t, tt, &q->users, link)
                for (List *l = t->waiters.next; l != &t->waiters;) {
                        List *next = l->next;
                        bool last = next == &t->waiters;

                        fn(list_entry(l, Waiter, link), userdata);      /* may free t with its last waiter */
                        if (last)
                                break;
                        l = next;
                }
}
