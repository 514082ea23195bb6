/* SPDX-License-Identifier: MIT */

#include "fair.h"
#include "macro.h"

void fair_queue_init(FairQueue *q) {
        *q = (FairQueue){};
        list_init(&q->users);
}

void fair_queue_push(FairQueue *q, User *u, List *link) {
        list_link_tail(&u->ready_peers, link);
        if (!list_is_linked(&u->link_ready)) {
                list_link_tail(&q->users, &u->link_ready);
                q->n_users++;
        }
}

List *fair_queue_pop(FairQueue *q) {
        User *u;
        List *link;

        if (q->n_users == 0)
                return NULL;
        u = list_first_entry(&q->users, User, link_ready);
        link = u->ready_peers.next;
        list_unlink(link);
        list_unlink(&u->link_ready);
        if (list_is_empty(&u->ready_peers))
                q->n_users--;
        else
                list_link_tail(&q->users, &u->link_ready);
        return link;
}

void fair_queue_remove(FairQueue *q, User *u, List *link) {
        if (!list_is_linked(link))
                return;
        list_unlink(link);
        if (list_is_empty(&u->ready_peers) && list_is_linked(&u->link_ready)) {
                list_unlink(&u->link_ready);
                q->n_users--;
        }
}
