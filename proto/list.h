/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Intrusive circular doubly-linked lists. A `List` is both the head of a list
 * and the link embedded in each element. An unlinked element has both
 * pointers NULL (or is initialised to point at itself), so `list_is_linked()`
 * tells whether it sits on a list.
 */

#include <stdbool.h>
#include <stddef.h>

#include "macro.h"

typedef struct List List;
struct List {
        List *next;
        List *prev;
};

#define LIST_INIT(name) { .next = &(name), .prev = &(name) }

static inline void list_init(List *l) {
        l->next = l->prev = l;
}

static inline bool list_is_empty(const List *head) {
        return head->next == head;
}

static inline bool list_is_linked(const List *link) {
        return link->next && link->next != link;
}

static inline void list_link_between(List *link, List *prev, List *next) {
        link->prev = prev;
        link->next = next;
        prev->next = link;
        next->prev = link;
}

static inline void list_link_tail(List *head, List *link) {
        list_link_between(link, head->prev, head);
}

static inline void list_link_front(List *head, List *link) {
        list_link_between(link, head, head->next);
}

/* Unlinks an element; safe on an element that is not linked. */
static inline void list_unlink(List *link) {
        if (list_is_linked(link)) {
                link->prev->next = link->next;
                link->next->prev = link->prev;
        }
        list_init(link);
}

/* Moves every element of `from`, in order, to the tail of `head`; `from` is left empty. */
static inline void list_splice_tail(List *head, List *from) {
        if (list_is_empty(from))
                return;
        from->next->prev = head->prev;
        head->prev->next = from->next;
        from->prev->next = head;
        head->prev = from->prev;
        list_init(from);
}

#define list_entry(ptr, type, member) container_of(ptr, type, member)

#define list_first_entry(head, type, member) \
        (list_is_empty(head) ? NULL : list_entry((head)->next, type, member))

#define list_last_entry(head, type, member) \
        (list_is_empty(head) ? NULL : list_entry((head)->prev, type, member))

#define list_for_each_entry(pos, head, member)                                  \
        for (pos = list_entry((head)->next, __typeof__(*pos), member);          \
             &pos->member != (head);                                            \
             pos = list_entry(pos->member.next, __typeof__(*pos), member))

#define list_for_each_entry_safe(pos, tmp, head, member)                        \
        for (pos = list_entry((head)->next, __typeof__(*pos), member),          \
            tmp = list_entry(pos->member.next, __typeof__(*pos), member);       \
             &pos->member != (head);                                            \
             pos = tmp, tmp = list_entry(pos->member.next, __typeof__(*pos), member))
