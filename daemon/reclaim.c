/* SPDX-License-Identifier: MIT */

#include <assert.h>
#include <errno.h>
#include <stdlib.h>

#include "lease.h"
#include "macro.h"
#include "reclaim.h"

int reclaim_set_init(ReclaimSet *s, size_t n_devices) {
        *s = (ReclaimSet){ .n_devices = n_devices };
        list_init(&s->asked);
        s->marked = calloc(n_devices ?: 1, sizeof(List));
        s->asked_bytes = calloc(n_devices ?: 1, sizeof(uint64_t));
        if (!s->marked || !s->asked_bytes) {
                reclaim_set_done(s);
                return -ENOMEM;
        }
        for (size_t i = 0; i < (n_devices ?: 1); i++)
                list_init(&s->marked[i]);
        return 0;
}

void reclaim_set_done(ReclaimSet *s) {
        free(s->marked);
        free(s->asked_bytes);
        s->marked = NULL;
        s->asked_bytes = NULL;
}

/* Takes `l` out of the list its state puts it in. */
static void unlink_mark(ReclaimSet *s, Lease *l) {
        ReclaimMark *m = &l->reclaim;

        if (m->state == RECLAIM_MARKED) {
                list_unlink(&m->link);
                s->n_marked--;
        } else if (m->state == RECLAIM_ASKED) {
                list_unlink(&m->link);
                s->n_asked--;
                s->asked_bytes[l->pool_device] -= l->size;
        }
}

/* Whether a mark is asked before `m` (reclaim.h's order): kept leases first, then lower priorities; among
 * equals, the one marked first. */
static bool asked_before(const ReclaimMark *i, const ReclaimMark *m) {
        if (i->kept != m->kept)
                return i->kept;
        return i->priority <= m->priority;      /* i was marked earlier: equal priorities keep their order */
}

/* Marks `l` with `kept` and `priority`, in its device's list by that order. Not for an ASKED lease. */
static void mark(ReclaimSet *s, Lease *l, bool kept, uint32_t priority) {
        ReclaimMark *m = &l->reclaim, *i;

        unlink_mark(s, l);
        m->state = RECLAIM_MARKED;
        m->kept = kept;
        m->priority = priority;
        m->serial = ++s->serial;
        list_for_each_entry(i, &s->marked[l->pool_device], link)
                if (!asked_before(i, m))
                        break;
        list_link_tail(&i->link, &m->link);     /* before i: at the end when every mark goes first */
        s->n_marked++;
}

void reclaim_mark(ReclaimSet *s, Lease *l, uint32_t priority) {
        if (l->reclaim.state == RECLAIM_ASKED) {
                l->reclaim.priority = priority; /* asked already: it stays asked, once */
                return;
        }
        mark(s, l, false, priority);
}

void reclaim_mark_kept(ReclaimSet *s, Lease *l) {
        assert(l->reclaim.state != RECLAIM_ASKED);
        mark(s, l, true, 0);
}

bool reclaim_unmark(ReclaimSet *s, Lease *l) {
        bool asked = l->reclaim.state == RECLAIM_ASKED;

        unlink_mark(s, l);
        if (asked)
                s->refused++;
        l->reclaim.state = RECLAIM_NONE;
        l->reclaim.kept = false;
        return asked;
}

void reclaim_forget(ReclaimSet *s, Lease *l) {
        if (l->reclaim.state == RECLAIM_ASKED)
                s->given_back++;
        unlink_mark(s, l);
        l->reclaim.state = RECLAIM_NONE;
        l->reclaim.kept = false;
}

size_t reclaim_pick(const ReclaimSet *s, size_t device, uint64_t need,
                    bool (*can_ask)(const Lease *l, void *userdata), void *userdata, Lease **ret, size_t max) {
        uint64_t got = 0;
        ReclaimMark *m;
        size_t n = 0;

        if (device >= s->n_devices)
                return 0;
        list_for_each_entry(m, &s->marked[device], link) {
                Lease *l = container_of(m, Lease, reclaim);

                if (got >= need || n == max)
                        break;
                if (can_ask && !can_ask(l, userdata))
                        continue;
                ret[n++] = l;
                got += l->size;
        }
        return n;
}

void reclaim_ask(ReclaimSet *s, Lease *l, uint64_t deadline) {
        ReclaimMark *m = &l->reclaim;

        assert(m->state == RECLAIM_MARKED);
        unlink_mark(s, l);
        m->state = RECLAIM_ASKED;
        m->deadline = deadline;
        /* Every request has the same timeout, so the list stays in deadline order when appended to; a
         * ReclaimTimeout= changed by a restart does not matter: the list starts empty. */
        list_link_tail(&s->asked, &m->link);
        s->n_asked++;
        s->asked_bytes[l->pool_device] += l->size;
        s->sent++;
}

unsigned reclaim_expire(ReclaimSet *s, uint64_t now) {
        unsigned n = 0;

        while (!list_is_empty(&s->asked)) {
                ReclaimMark *m = list_first_entry(&s->asked, ReclaimMark, link);
                Lease *l = container_of(m, Lease, reclaim);

                if (m->deadline > now)
                        break;
                unlink_mark(s, l);
                m->state = RECLAIM_UNRESPONSIVE;
                s->timed_out++;
                n++;
        }
        return n;
}

uint64_t reclaim_next_deadline(const ReclaimSet *s) {
        if (list_is_empty(&s->asked))
                return UINT64_MAX;
        return list_first_entry(&s->asked, ReclaimMark, link)->deadline;
}

const char *reclaim_state_name(ReclaimState state) {
        switch (state) {
        case RECLAIM_MARKED:
                return "marked";
        case RECLAIM_ASKED:
                return "asked";
        case RECLAIM_UNRESPONSIVE:
                return "unresponsive";
        default:
                return NULL;
        }
}
