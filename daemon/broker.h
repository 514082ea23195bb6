/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The broker's rules: every operation a client can ask for, with who may do
 * it, over the lease table (lease.c), the holders (holder.c), the per-user
 * accounting (user.c), the pool (pool.c) and the store (store.c).
 *
 * Each operation takes the caller (its process, user and whether it is an
 * administrator) and returns one of:
 *
 *   0                  done;
 *   BROKER_E_* > 0     an expected outcome the caller answers with a named
 *                      error (method.c turns each into one); nothing changed;
 *   -errno < 0         a failure of the daemon itself (out of memory); nothing
 *                      changed. The connection that asked is closed.
 *
 * That is the daemon's error convention everywhere: modules return positive
 * codes of their own (POOL_E_*, BROKER_E_*) for outcomes their direct caller
 * must handle, and negative errno values for failures, passed up unchanged.
 *
 * Every change is written ahead: an operation prepares everything that can
 * fail (memory, slabs, charges), stores the change (store_commit(), when the
 * daemon runs under a service manager), and only then changes the table, in
 * steps that cannot fail. A change that could not be stored is not made and
 * is answered BROKER_E_NOT_STORED, so a client is never told of a change that
 * a crash could lose, and a crash never brings back a lease that ended.
 *
 * Nothing here does socket I/O or talks to the event loop, so every rule is
 * unit tested without either (tests/unit/test-broker.c).
 */

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "holder.h"
#include "lease.h"
#include "place.h"
#include "pool.h"
#include "store.h"
#include "user.h"
#include "wait.h"

#define BROKER_DEFAULT_MAX_ALLOC_WAIT_USEC (UINT64_C(300) * 1000000)   /* MaxAllocWait= when not set: 5 min */

/* Expected outcomes, positive; see above. */
enum {
        BROKER_E_NO_DEVICE = 1,         /* no such device in the pool */
        BROKER_E_TOO_LARGE,             /* more than the device's capacity or POOL_MAX_SLABS slabs */
        BROKER_E_NO_MEMORY,             /* no room on the device now (pool_last_error() says why): with
                                           SCRUBBING, the outcomes an Alloc may wait on (broker_alloc_wait_usec()) */
        BROKER_E_DRIVER,                /* the driver failed (pool_last_error() says how) */
        BROKER_E_QUOTA,                 /* over one of the owner's limits (*ret_quota says which) */
        BROKER_E_TOKENS,                /* the lease has LEASE_TOKENS_MAX tokens already */
        BROKER_E_NO_SUCH_LEASE,         /* the caller's process holds no lease with that id */
        BROKER_E_NO_SUCH_TOKEN,         /* no live token is that one */
        BROKER_E_NO_SUCH_NAME,          /* no lease is published under that name */
        BROKER_E_NAME_IN_USE,           /* another lease is published under that name */
        BROKER_E_HAS_NAME,              /* the lease is published under another name already */
        BROKER_E_READONLY,              /* the caller holds the lease read-only: it may only share it read-only */
        BROKER_E_TOKEN_UID,             /* the token is for another user */
        BROKER_E_NOT_OWNER,             /* only the owner (or an administrator, where it says) may */
        BROKER_E_NOT_STORED,            /* the change could not be stored for a restart: it was not made */
        BROKER_E_NO_HOST_MEMORY,        /* no room in the device's host memory for parked leases, or none at
                                           all (pool_last_error() says which) */
        BROKER_E_SCRUBBING,             /* an Alloc, a Park for its host slabs, or an Unpark or Attach for a
                                           parked lease's device memory would wait for more zeroing than
                                           scrub_wait_bytes: nothing changed; try it again once scrubs have
                                           completed */
        BROKER_E_HOST_MAKING,           /* a Park needs host slabs, being made off the loop now: nothing changed;
                                           try it again once pool_make_done() (Caller.host_make_failed) */
        BROKER_E_HOST_COPYING,          /* a Park's, Unpark's or Attach's copy runs off the loop now
                                           (Lease.move): try it again, with Caller.copy_waited, once
                                           broker_moves_ended() moved */
};

typedef struct Broker {
        Pool *pool;
        UserRegistry users;
        HolderRegistry holders;
        LeaseTable leases;
        Store *store;                   /* NULL: nothing is kept across a restart (no service manager) */
        int store_error;                /* the last failure to store (negative errno), 0 once storing works */
        uint64_t list_serial;           /* counts List calls, for Lease.listed */
        WaitQueue *waits;               /* per pool device: Alloc calls waiting for room (wait.h) */
        List scrub_waiters;             /* Peer.link_scrub: Allocs parked until scrubs complete (AllocWait.scrub),
                                           outside the turns, oldest first */
        List host_waiters;              /* Peer.link_host: Parks waiting for host slabs being made
                                           (BROKER_E_HOST_MAKING), Parks, Unparks and Attaches waiting for
                                           memory being zeroed (BROKER_E_SCRUBBING) or for a copy
                                           (BROKER_E_HOST_COPYING), in the order they came */
        unsigned n_waiting_making;      /* of host_waiters, those waiting for host slabs being made */
        unsigned n_waiting_zeroing;     /* those waiting for memory being zeroed: a Park's host slabs, an Unpark's or
                                           an Attach's device memory */
        unsigned n_waiting_copying;     /* and those waiting for a copy (vmmbroker_calls_waiting) */
        unsigned *scrub_waiting;        /* per pool device: how many of scrub_waiters wait on it */
        uint64_t max_alloc_wait_usec;   /* MaxAllocWait=: the longest an Alloc may wait; 0: none may */
        uint64_t scrub_wait_bytes;      /* the most zeroing an Alloc waits for in the loop (pool_alloc_bounded());
                                           POOL_WAIT_ANY (the default): any */
        uint64_t kept_wait_usec;        /* how long an Alloc that asked for no wait waits for kept leases to
                                           come back (ReclaimTimeout=, within MaxAllocWait=) */
        PlacementRule placement;        /* Placement=: where an Alloc that names no single device goes */
        NumaMap numa;                   /* CPU -> NUMA node, for Placement=nearest; empty: unknown (place.h) */
        /* Told when storing starts to fail, before the request that found it is answered (the manager
         * says so in STATUS= then, so that whoever sees the refusal can see why); NULL: nobody. */
        void (*store_failing)(void *userdata);
        void *store_failing_userdata;
} Broker;

/* Who asks: the process, its user, and whether it is an administrator (root, or the admin group). */
typedef struct Caller {
        Holder *holder;
        User *user;
        bool admin;
        bool host_make_failed;          /* the call is a Park tried again after the host slabs it waited for
                                           were made, and a host slab of that making failed: it creates
                                           what it still lacks itself (broker_park()), to be answered with the
                                           driver's refusal rather than wait for another making */
        bool copy_waited;               /* the call is tried again after a move ended: the lease's move_error,
                                           if any, is its answer */
} Caller;

/*
 * Sets up the lease layer over `pool`, with users limited by `limits` (which
 * must outlive the broker). Returns 0 or a negative errno.
 */
int broker_init(Broker *b, Pool *pool, const LimitsConfig *limits);

/* Ends every lease (releasing its slabs, see lease_table_done()), forgets every holder and user. */
void broker_done(Broker *b);

/* Gives the broker a store (it takes it): changes are stored ahead from now on. */
void broker_set_store(Broker *b, Store *store);

/*
 * Alloc: `size` bytes of CUDA device `device` (VMMB_DEVICE_ANY-like: a
 * negative value places it among every device served, as
 * broker_alloc_among() does), held once by the caller, owned by and charged
 * to its user. A lease the caller's process kept of that size (rounded up to
 * the granularity) on the device is handed back instead (broker_free()), its
 * zeroing waited for, with the new label. Returns 0 with *ret, a BROKER_E_*
 * (QUOTA fills *ret_quota), or a negative errno.
 */
int broker_alloc(Broker *b, const Caller *c, int64_t device, uint64_t size, const char *label, Lease **ret,
                 UserQuota *ret_quota);

/*
 * Alloc placed among the CUDA devices `devices` (n of them; NULL: every
 * device served; duplicates count once) by Broker.placement (place.h). The
 * devices are tried in the rule's order: one where the caller's user is over
 * a limit (QUOTA) or whose capacity is smaller than the request (TOO_LARGE)
 * is skipped; any other outcome of a device, NO_MEMORY included, is the
 * call's (under most-free the device tried first has the most room, so no
 * other has more). When every device is skipped the outcome is QUOTA if any
 * was refused for a limit (*ret_quota: the first such device's), else
 * TOO_LARGE. NO_DEVICE for a device not served (nothing is tried), or no
 * device at all. *ret_device (if given) is the pool index whose outcome this
 * is: the device of the lease, the one that had no room (where the call would
 * wait), or the first device refused; unchanged for NO_DEVICE.
 */
int broker_alloc_among(Broker *b, const Caller *c, const uint64_t *devices, size_t n, uint64_t size,
                       const char *label, Lease **ret, UserQuota *ret_quota, size_t *ret_device);

/*
 * How long an Alloc that found no room on pool device `device`
 * (BROKER_E_NO_MEMORY or BROKER_E_SCRUBBING, and only those: a call over the
 * capacity or its user's limits can never be served, and fails at once)
 * waits for room, given the wait it asked for (`asked`: its wait_usec,
 * negative when absent): at most MaxAllocWait=. 0: it does not wait. A call
 * that asked for no wait still waits Broker.kept_wait_usec when the device
 * has kept leases: their processes are asked for them first. While it waits
 * its user's limits still hold: each try charges it as a new Alloc would, and
 * a try over a limit ends the wait with QUOTA.
 */
uint64_t broker_alloc_wait_usec(const Broker *b, int64_t asked, size_t device);

/* The Alloc calls waiting on pool device `device`: for room (its wait queue) or for its scrubs (parked). */
unsigned broker_waiters(const Broker *b, size_t device);

/*
 * Free: drops one reference of the caller's hold. NO_SUCH_LEASE for a lease its process does not hold.
 *
 * With `keep`, the lease is kept instead (*ret_kept true) when the caller's hold is its only hold, with one
 * reference, read-write, of the owner's user, and the lease is not published, parked, kept already, asked
 * back or foreign (another user held it, and may map it still): its tokens are revoked, its memory zeroed in place (the process keeps its mapping), and it waits
 * for the process's next Alloc of its size (broker_alloc() hands it back first), charged as before, the
 * first its device's reclaiming asks for. Every other call treats a kept lease as one the process does not
 * hold; a Free of it ends it. Otherwise, or when the device cannot be asked to zero it, a plain Free.
 * NOT_STORED: nothing changed (but the zeroing of memory its process no longer uses).
 */
int broker_free(Broker *b, const Caller *c, const char *id, bool keep, bool *ret_kept);

/*
 * A lease that a restarted daemon read back as kept is kept again by broker_free()'s rules, its memory
 * zeroed in place again (the zeroing queued before the restart may not have run). NOT_OWNER: it is not as a
 * kept lease is (its holds, its name, its owner); DRIVER: it cannot be zeroed. Then it stays a plain lease of
 * its process. Nothing is stored: it is stored kept already.
 */
int broker_keep_restored(Broker *b, Lease *l);

/*
 * SetReclaimable: marks the caller's lease reclaimable with `priority` (0 is
 * asked first), or not reclaimable (priority < 0; an asked lease counts as
 * refused). Only a read-write holder (READONLY) of the owner's user
 * (NOT_OWNER) may: another user's process holding the lease cannot offer the
 * owner's memory. NO_SUCH_LEASE for a lease the caller's process does not
 * hold. Marks are not stored (reclaim.h).
 */
int broker_set_reclaimable(Broker *b, const Caller *c, const char *id, int64_t priority);

/*
 * The marked leases of pool device `device` to ask back, in reclaim.h's
 * order, until their bytes reach `need` (at most `max`, into ret[]). A lease
 * is asked only when it is not published (its holders' Frees would not end
 * it), not parked (it holds no device memory), and every holder watches (Holder.watch), is alive and is not `waiting`
 * (the process whose Alloc waits: it could not answer while it waits), but for a kept lease, which its
 * library gives back from its watch thread.
 */
size_t broker_reclaim_pick(Broker *b, size_t device, uint64_t need, const Holder *waiting, Lease **ret,
                           size_t max);

/*
 * Park: the caller's process lets the lease's device memory go, keeping the
 * lease (its hold is parked). When no other holder maps it any more (every
 * hold parked), the lease parks: its content is copied into host slabs on the
 * device's NUMA node, its device slabs go back to the pool (scrubbed, or
 * released when foreign), and its owner is charged host bytes instead of
 * device bytes. *ret_parked says whether the content is in host memory now.
 * Only a read-write holder (READONLY) of the owner's user (NOT_OWNER) may
 * park: another user's process cannot spend the owner's host memory.
 * QUOTA (the owner's MaxHostBytes=), NO_HOST_MEMORY, DRIVER, NOT_STORED: the
 * lease is as it was, and the hold is not parked. A hold's parking is stored
 * with it, so that a restarted daemon knows who still maps the lease. Parking ends a reclaim mark
 * (an asked lease counts as given back).
 *
 * Neither pinning nor copying is done in the loop, nor long waits for host slabs
 * being zeroed (SCRUBBING past scrub_wait_bytes, nothing changed: made again
 * once scrubs have completed). Host slabs that must be
 * created first are made off it (pool_make_host()): HOST_MAKING, nothing
 * changed, the making's ticket in *ret_ticket (may be NULL), and the call is to
 * be made again once pool_make_done() says so. What its user's other calls
 * took meanwhile is made off the loop again (HOST_MAKING again), unless a host
 * slab of its making failed to be made (Caller.host_make_failed):
 * then it is created in the call, which fails with the driver's refusal
 * rather than wait for makings that fail for ever. Then the copy is queued on the device's
 * stream and the lease gets a move (Lease.move): HOST_COPYING, the lease as it
 * was, its host slabs and host bytes taken. broker_finish_moves() commits the
 * move once the copy is done; the call, made again then (Caller.copy_waited),
 * finds the lease parked, or the failure to store it (Hold.move_error:
 * NOT_STORED, nothing changed). Until then an Attach or Unpark of the lease,
 * the end of the hold, or the end of the lease cancels the move: the call made
 * again then sees the lease as it is now (still alone, it starts another
 * copy: only the owner's own processes can undo its moves). A Park of the
 * same hold while its move runs waits for that one.
 */
int broker_park(Broker *b, const Caller *c, const char *id, bool *ret_parked, UserQuota *ret_quota,
                uint64_t *ret_ticket);

/*
 * Commits every move (broker_park()) whose copy is done, oldest first; one that cannot be stored is
 * cancelled. Returns how many ended.
 */
unsigned broker_finish_moves(Broker *b);

/* A count that moves each time a move ends, committed or cancelled: the calls waiting for copies
 * (BROKER_E_HOST_COPYING) are made again then. */
uint64_t broker_moves_ended(const Broker *b);

/*
 * Unpark: the caller's process maps the lease again. A parked lease comes
 * back into device slabs (the layout Alloc gives its size) with its content,
 * charged to its owner as device bytes again, its host slabs scrubbed and
 * cached; one not parked is as it is. The caller's hold is not parked any
 * more; *ret is it. Any holder may unpark (another user's too: the owner's
 * lease comes back within the owner's limits). QUOTA (the owner's MaxBytes=),
 * NO_MEMORY, DRIVER, NOT_STORED: the lease stays parked.
 *
 * The copy back runs off the loop as a park's does (broker_park()): the device
 * slabs and device bytes are taken, the lease gets a move toward device memory,
 * and the call returns HOST_COPYING, to be made again (Caller.copy_waited) once
 * a move ended. Any holder's Unpark, and an Attach, of a lease whose unpark is
 * being copied wait for that move (one copy, one charge); a Park of the hold
 * that asked for it cancels it (the lease stays parked), as does the end of
 * that hold or of the lease.
 */
int broker_unpark(Broker *b, const Caller *c, const char *id, Hold **ret, UserQuota *ret_quota);

/*
 * Share: a token for the caller's lease, for `uid` (UID_ANY: anyone). Only
 * processes of the owner's user make tokens (NOT_OWNER): a holder of another
 * user cannot use up the owner's tokens or hand the memory on. A read-only
 * holder may only make read-only tokens (READONLY). TOKENS when the lease has
 * LEASE_TOKENS_MAX already.
 */
int broker_share(Broker *b, const Caller *c, const char *id, uid_t uid, bool readonly, Token **ret);

/*
 * Tokens: calls fn for every live token of lease `id`, for a holder of the
 * owner's user, or an administrator (any lease). NO_SUCH_LEASE for a lease
 * the caller's process does not hold (an administrator: that does not exist),
 * NOT_OWNER for a holder of another user. Returns what fn returned if not 0.
 */
int broker_tokens(Broker *b, const Caller *c, const char *id, int (*fn)(const Token *t, void *userdata),
                  void *userdata);

/* Revoke: by the lease's owner, the token's maker or an administrator (NOT_OWNER otherwise). */
int broker_revoke(Broker *b, const Caller *c, const char *token);

/*
 * Attach: the caller's process becomes a holder of the lease that `token` or
 * (when token is NULL) `owner`'s name `name` names. TOKEN_UID for a token
 * made for another user. A name that does not exist and one the caller's user
 * may not attach are the same NO_SUCH_NAME: nobody learns whether another
 * user's name exists. The hold is read-only if the token or name says so or
 * `readonly`. A parked lease is unparked first (broker_unpark()'s outcomes,
 * *ret_quota for QUOTA, HOST_COPYING while its copy runs: the unpark is no
 * hold's, and ends committed even if the caller goes). A park of the lease
 * being copied is cancelled: the caller maps the lease as it is.
 */
int broker_attach(Broker *b, const Caller *c, const char *token, uid_t owner, const char *name, bool readonly,
                  Hold **ret, UserQuota *ret_quota);

/*
 * Publish: only a read-write holder of the owner's user (NOT_OWNER), in the
 * owner's namespace. Publishing again under the lease's own name replaces
 * uids and readonly. NAME_IN_USE (another of the owner's leases has the
 * name), HAS_NAME.
 */
int broker_publish(Broker *b, const Caller *c, const char *id, const char *name, const uid_t *uids, size_t n_uids,
                   bool readonly);

/*
 * Unpublish `owner`'s name `name`: by the owner or an administrator; the
 * lease ends if nobody holds it. A user who may attach the name but not
 * unpublish it gets NOT_OWNER; one who may not even attach it NO_SUCH_NAME,
 * as for a name that does not exist.
 */
int broker_unpublish(Broker *b, const Caller *c, uid_t owner, const char *name);

/*
 * Calls fn for every lease the caller sees (every lease with `all`, which
 * needs an administrator: NOT_OWNER otherwise), each once, at a cost in
 * proportion to what it sees: the leases its user owns, then those its
 * processes hold. Returns 0, NOT_OWNER, or what fn returned (stopping there).
 */
int broker_list(Broker *b, const Caller *c, bool all, int (*fn)(const Lease *l, void *userdata), void *userdata);

/*
 * Drops the holds of every holder whose process has exited (ending the leases
 * nobody else holds or published), storing each holder's change first. A
 * holder whose change cannot be stored keeps its holds (its leases stay, so
 * nothing a crash would bring back is given to anyone else) and is tried
 * again at the next call. Returns the number of holds dropped.
 */
unsigned broker_reap_holders(Broker *b);

/* Whether exited holders are still waiting to have their holds dropped (their change could not be stored). */
bool broker_has_unreaped(const Broker *b);

/*
 * Whether the broker has work for when the daemon is idle: a snapshot the store wants
 * (broker_store_snapshot() without force would write one), storing that failed and is tried again, or
 * exited holders not yet reaped.
 */
bool broker_has_idle_work(const Broker *b);

/*
 * Writes the whole table to a new store generation when the store asks for
 * it (its log has grown), or when no table is stored yet. Returns 0, or a
 * negative errno when storing failed (then Broker.store_error says so).
 */
int broker_store_snapshot(Broker *b, bool force);
