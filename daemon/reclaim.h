/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Reclaimable leases: which leases a holder marked reclaimable (with a
 * priority), which of them the daemon has asked back and by when, and which
 * to ask next when an Alloc waits for room.
 *
 * The rule of the order: on one device, kept leases first (memory their
 * process has let go), in the order they were kept; then lowest priority
 * first; among equal priorities, the lease marked earliest first. Asking picks leases in that
 * order, skipping those the caller says cannot be asked (not every holder
 * watches, published, parked, held by the process that waits unless kept),
 * until their bytes cover what is needed.
 *
 * A lease is in one state:
 *   NONE          not reclaimable;
 *   MARKED        reclaimable, in its device's list;
 *   ASKED         its holders were asked, until its deadline (one request
 *                 per lease at a time): in the asked list, oldest first;
 *   UNRESPONSIVE  asked, and not given back by the deadline: the daemon
 *                 cannot take memory from a live process, so it stops asking
 *                 (the lease is not reclaimable any more) until a holder marks
 *                 it again.
 * Unmarking an ASKED lease is its holder's refusal; a lease that ends while
 * ASKED (its holders freed it or exited) was given back.
 *
 * Marks live in the daemon only: they are not stored, and a restarted daemon
 * starts with no lease reclaimable (watches are connections, which a restart
 * ends; libvmmbroker marks its leases again when its watch reconnects).
 *
 * This module only orders and counts; the lease table (lease.c) calls
 * reclaim_forget() when a lease ends, the broker (broker.c) decides who may
 * mark and what may be asked, and the manager sends the requests and keeps
 * the deadline's timer. Marking costs O(marked leases on the device); asking,
 * expiring and forgetting O(1) per lease.
 */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "list.h"

#define RECLAIM_DEFAULT_TIMEOUT_USEC (UINT64_C(5) * 1000000)    /* ReclaimTimeout= when not set: 5 s */

typedef enum ReclaimState {
        RECLAIM_NONE,
        RECLAIM_MARKED,
        RECLAIM_ASKED,
        RECLAIM_UNRESPONSIVE,
} ReclaimState;

/* A lease's place in reclaiming (in struct Lease). */
typedef struct ReclaimMark {
        ReclaimState state;
        bool kept;                      /* a kept lease's (reclaim_mark_kept()): before every holder's mark */
        uint32_t priority;              /* MARKED, ASKED: lower is asked first */
        uint64_t serial;                /* when it was marked, in marks: the older first among equal priorities */
        uint64_t deadline;              /* ASKED: CLOCK_MONOTONIC usec */
        List link;                      /* MARKED: in ReclaimSet.marked[device]; ASKED: in ReclaimSet.asked */
} ReclaimMark;

typedef struct ReclaimSet {
        List *marked;                   /* per pool device: ReclaimMark.link, in the order they are asked */
        uint64_t *asked_bytes;          /* per pool device: bytes of leases ASKED */
        size_t n_devices;
        List asked;                     /* ReclaimMark.link of ASKED leases, by deadline */
        uint64_t serial;
        unsigned n_marked, n_asked;
        /* counters since the daemon started, for the metrics */
        uint64_t sent;                  /* leases asked (one request to each of its holders) */
        uint64_t given_back;            /* asked leases that ended before their deadline */
        uint64_t refused;               /* asked leases a holder unmarked */
        uint64_t timed_out;             /* asked leases still held at their deadline */
} ReclaimSet;

struct Lease;

/* Sets up an empty set over n_devices devices. Returns 0 or -ENOMEM. */
int reclaim_set_init(ReclaimSet *s, size_t n_devices);
void reclaim_set_done(ReclaimSet *s);

/* Marks `l` reclaimable with `priority`, or changes its priority (an ASKED lease stays asked). */
void reclaim_mark(ReclaimSet *s, struct Lease *l, uint32_t priority);

/*
 * Marks a kept lease (lease.h): asked before any lease a holder marked, kept leases in the order they were
 * kept. Its priority shows as 0.
 */
void reclaim_mark_kept(ReclaimSet *s, struct Lease *l);

/* Makes `l` not reclaimable; an ASKED lease counts as refused. Returns whether it was ASKED. */
bool reclaim_unmark(ReclaimSet *s, struct Lease *l);

/* `l` ends: out of every list; an ASKED lease counts as given back. */
void reclaim_forget(ReclaimSet *s, struct Lease *l);

/*
 * Picks MARKED leases of `device` in order, those `can_ask` accepts, until
 * their bytes reach `need` or `max` are picked. Returns how many (into ret[]);
 * changes nothing.
 */
size_t reclaim_pick(const ReclaimSet *s, size_t device, uint64_t need,
                    bool (*can_ask)(const struct Lease *l, void *userdata), void *userdata,
                    struct Lease **ret, size_t max);

/* A MARKED lease is asked, until `deadline`. */
void reclaim_ask(ReclaimSet *s, struct Lease *l, uint64_t deadline);

/* ASKED leases whose deadline is at or before `now` become UNRESPONSIVE. Returns how many. */
unsigned reclaim_expire(ReclaimSet *s, uint64_t now);

/* The earliest deadline of an ASKED lease, or UINT64_MAX. */
uint64_t reclaim_next_deadline(const ReclaimSet *s);

/* "marked", "asked", "unresponsive", or NULL for NONE. */
const char *reclaim_state_name(ReclaimState state);
