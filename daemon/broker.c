/* SPDX-License-Identifier: MIT */

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "broker.h"
#include "events.h"
#include "macro.h"

int broker_init(Broker *b, Pool *pool, const LimitsConfig *limits) {
        size_t n = pool_n_devices(pool);
        _cleanup_free_ uint64_t *capacity = calloc(n ?: 1, sizeof(uint64_t));
        _cleanup_free_ uint64_t *host_capacity = calloc(n ?: 1, sizeof(uint64_t));
        int k1, k2, k3;

        *b = (Broker){ .pool = pool, .max_alloc_wait_usec = BROKER_DEFAULT_MAX_ALLOC_WAIT_USEC,
                       .kept_wait_usec = RECLAIM_DEFAULT_TIMEOUT_USEC, .scrub_wait_bytes = POOL_WAIT_ANY };
        for (size_t i = 0; capacity && i < n; i++) {
                PoolDeviceStats s;

                pool_device_stats(pool, i, &s);
                capacity[i] = s.capacity;       /* what bounds the users' bytes */
                if (host_capacity)
                        host_capacity[i] = s.host_capacity;
        }
        /* Each is set up enough for broker_done() even when another, or itself, fails. */
        k1 = user_registry_init(&b->users, limits, capacity, host_capacity, capacity && host_capacity ? n : 0);
        k2 = holder_registry_init(&b->holders);
        k3 = lease_table_init(&b->leases, pool);
        b->waits = calloc(n ?: 1, sizeof(WaitQueue));
        for (size_t i = 0; b->waits && i < n; i++)
                wait_queue_init(&b->waits[i]);
        list_init(&b->scrub_waiters);
        list_init(&b->host_waiters);
        b->scrub_waiting = calloc(n ?: 1, sizeof(unsigned));
        return !capacity || !host_capacity || !b->waits || !b->scrub_waiting ? -ENOMEM :
               k1 < 0 ? k1 : k2 < 0 ? k2 : k3;
}

void broker_done(Broker *b) {
        for (size_t i = 0; b->waits && i < pool_n_devices(b->pool); i++)
                wait_queue_done(&b->waits[i]);          /* their connections are gone: every waiter with them */
        free(b->waits);
        b->waits = NULL;
        free(b->scrub_waiting);
        b->scrub_waiting = NULL;
        lease_table_done(&b->leases);           /* the leases hold charges on users and holds of holders */
        holder_registry_done(&b->holders);      /* the holders hold references on users */
        user_registry_done(&b->users);
        store_free(b->store);
        b->store = NULL;
        numa_map_done(&b->numa);
}

void broker_set_store(Broker *b, Store *store) {
        store_free(b->store);
        b->store = store;
}

/* --- writing ahead -------------------------------------------------------------------------------- */

/*
 * The store's steps, doing nothing when there is no store. An operation
 * begins, adds what it will change, and commits before it changes anything.
 */
static void change_begin(Broker *b) {
        if (b->store)
                store_begin(b->store);
}

/* `k` is the first failure of adding to the change, if any. Returns 0, BROKER_E_NOT_STORED or -ENOMEM. */
static int change_commit(Broker *b, int k) {
        if (!b->store)
                return 0;
        if (k < 0) {
                store_abort(b->store);
                return k;
        }
        k = store_commit(b->store);
        event_store_health(b->store_error, MIN(k, 0));
        if (k < 0) {
                bool was_fine = b->store_error == 0;

                b->store_error = k;
                if (was_fine && b->store_failing)
                        b->store_failing(b->store_failing_userdata);
                return BROKER_E_NOT_STORED;
        }
        b->store_error = 0;
        return 0;
}

static int put_lease(Broker *b, const Lease *l) {
        return b->store ? store_put_lease(b->store, l) : 0;
}

/*
 * Stores lease `l` as it will be, kept or not and with `label`, then puts it back as it is: the table
 * changes only once the change is stored. Adds to the change begun by the caller; returns put_lease()'s.
 */
static int put_lease_as(Broker *b, Lease *l, bool kept, char *label) {
        bool was_kept = l->kept;
        char *was_label = l->label;
        int k;

        l->kept = kept;
        l->label = label;
        k = put_lease(b, l);
        l->kept = was_kept;
        l->label = was_label;
        return k;
}

static int put_hold(Broker *b, const Lease *l, const Holder *h, unsigned refs, bool readonly, bool parked) {
        return b->store ? store_put_hold(b->store, l->id, h, refs, readonly, parked) : 0;
}

/* The hold ends: its lease too when it was the last and the lease has no name. */
static int put_hold_end(Broker *b, const Hold *hold) {
        if (!b->store)
                return 0;
        if (hold_is_last(hold))
                return store_end_lease(b->store, hold->lease->id);
        return store_end_hold(b->store, hold->lease->id, hold->holder);
}

/* --- Alloc ---------------------------------------------------------------------------------------- */

static uint64_t now_realtime_usec(void) {
        struct timespec ts;

        clock_gettime(CLOCK_REALTIME, &ts);
        return (uint64_t)ts.tv_sec * 1000000 + (uint64_t)ts.tv_nsec / 1000;
}

static int pool_outcome(int k) {
        switch (k) {
        case POOL_E_NOMEM:
                return BROKER_E_NO_MEMORY;
        case POOL_E_TOO_LARGE:
                return BROKER_E_TOO_LARGE;
        case POOL_E_NO_DEVICE:
                return BROKER_E_NO_DEVICE;
        case POOL_E_DRIVER:
                return BROKER_E_DRIVER;
        case POOL_E_NOT_KEPT:
                return BROKER_E_NOT_STORED;
        case POOL_E_HOST_NOMEM:
        case POOL_E_NO_HOST:
                return BROKER_E_NO_HOST_MEMORY;
        case POOL_E_SCRUBBING:
                return BROKER_E_SCRUBBING;
        case POOL_E_MAKING:
                return BROKER_E_HOST_MAKING;
        default:
                return k;
        }
}

uint64_t broker_alloc_wait_usec(const Broker *b, int64_t asked, size_t device) {
        uint64_t wait = asked <= 0 ? 0 : MIN((uint64_t)asked, b->max_alloc_wait_usec);

        /* Kept memory is memory its process let go: a call that finds no room waits for it to come back. */
        if (wait == 0 && device < b->leases.n_devices && b->leases.device_kept[device] > 0)
                wait = MIN(b->kept_wait_usec, b->max_alloc_wait_usec);
        return wait;
}

unsigned broker_waiters(const Broker *b, size_t device) {
        return b->waits[device].n_waiters + b->scrub_waiting[device];
}

/* --- kept leases ---------------------------------------------------------------------------------- */

#define KEPT_GONE (-1000)               /* kept_take(): the kept lease ended instead; make a new one */

/*
 * The caller's oldest kept lease of `size` bytes (a multiple of the granularity) on pool device i, or NULL.
 * One asked back is not handed out: its process's library is giving it back, and the Free it sends would
 * end the hold this Alloc got.
 */
static Lease *kept_find(const Holder *h, size_t i, uint64_t size) {
        Lease *l;

        list_for_each_entry(l, &h->kept, link_kept)
                if (l->pool_device == i && l->size == size && l->reclaim.state != RECLAIM_ASKED)
                        return l;
        return NULL;
}

/* Ends a kept lease whose zeroing the device did not finish: its memory is not handed out as zero. */
static int kept_end(Broker *b, Lease *l) {
        Hold *hold = list_first_entry(&l->holds, Hold, link_lease);
        int k;

        change_begin(b);
        k = change_commit(b, put_hold_end(b, hold));
        if (k != 0)
                return k;
        event_hold_freed(hold);
        hold_end(&b->leases, hold);
        return KEPT_GONE;
}

/*
 * Hands the caller's kept lease back to it for an Alloc: waits for its zeroing (as long as for a scrub:
 * scrub_wait_bytes), stores it not kept with the call's label, and takes it off the kept list. Returns 0,
 * KEPT_GONE (its zeroing failed: it ended), BROKER_E_SCRUBBING (more zeroing stands before it than the loop
 * waits for: it stays kept, and the call is tried again when zeroing has finished), BROKER_E_NOT_STORED (it
 * stays kept) or -ENOMEM.
 */
static int kept_take(Broker *b, Lease *l, const char *label) {
        _cleanup_free_ char *copy = NULL;
        int k;

        if (label) {
                copy = strdup(label);
                if (!copy)
                        return -ENOMEM;
        }
        k = pool_scrub_wait(b->pool, l->slabs, l->n_slabs, b->scrub_wait_bytes);
        if (k == POOL_E_SCRUBBING)
                return BROKER_E_SCRUBBING;
        if (k != 0)
                return kept_end(b, l);

        change_begin(b);
        k = change_commit(b, put_lease_as(b, l, false, copy));
        if (k != 0)
                return k;
        free(l->label);
        l->label = TAKE_PTR(copy);
        lease_unkeep(&b->leases, l);
        return 0;
}

/*
 * An Alloc of the caller's served by a lease it kept, on one of the pool devices order[0..n) (in that
 * order): 0 with *ret (and *ret_device) set, or left NULL when it kept none that fits; or kept_take()'s
 * failures, with *ret_device set to the kept lease's device.
 */
static int kept_serve(Broker *b, const Caller *c, const size_t *order, size_t n, uint64_t size,
                      const char *label, Lease **ret, size_t *ret_device) {
        *ret = NULL;
        for (size_t j = 0; j < n; j++) {
                PoolDeviceStats s;
                Lease *l;
                int k;

                pool_device_stats(b->pool, order[j], &s);
                while ((l = kept_find(c->holder, order[j], ALIGN_UP(size, s.granularity)))) {
                        k = kept_take(b, l, label);
                        if (k == KEPT_GONE)
                                continue;
                        if (ret_device)
                                *ret_device = order[j];
                        if (k != 0)
                                return k;
                        *ret = l;
                        return 0;
                }
        }
        return 0;
}

/* Gives back what an Alloc took before it could be made. */
static void alloc_undo(Broker *b, Lease *l, Slab **slabs, size_t n) {
        for (size_t j = 0; j < n; j++)
                pool_reclaim(b->pool, slabs[j]);
        user_charge_release(&l->charge_bytes);
        user_charge_release(&l->charge_lease);
}

int broker_alloc(Broker *b, const Caller *c, int64_t device, uint64_t size, const char *label, Lease **ret,
                 UserQuota *ret_quota) {
        Slab *slabs[POOL_MAX_SLABS];
        _cleanup_free_ Lease *l = NULL;
        _cleanup_free_ Hold *hold = NULL;
        PoolDeviceStats s;
        Holder *h = c->holder;
        size_t n = 0;
        int i, k;

        if (device < 0)
                return broker_alloc_among(b, c, NULL, 0, size, label, ret, ret_quota, NULL);
        i = device <= INT32_MAX ? pool_find_device(b->pool, (int)device) : -1;
        if (i < 0)
                return BROKER_E_NO_DEVICE;
        pool_device_stats(b->pool, (size_t)i, &s);
        if (size > UINT64_MAX / 2 || ALIGN_UP(size, s.granularity) > s.capacity)
                return BROKER_E_TOO_LARGE;      /* no limit could allow it: say so rather than QuotaExceeded */
        if (!list_is_empty(&h->kept)) {
                k = kept_serve(b, c, &(size_t){ (size_t)i }, 1, size, label, ret, NULL);
                if (k != 0 || *ret)
                        return k;
        }

        l = calloc(1, sizeof(*l));
        hold = calloc(1, sizeof(*hold));
        if (!l || !hold)
                return -ENOMEM;
        if (label) {
                l->label = strdup(label);
                if (!l->label)
                        return -ENOMEM;
        }
        k = lease_random_hex(l->id, LEASE_ID_LEN);
        if (k >= 0)
                k = lease_table_reserve(&b->leases);
        if (k < 0) {
                free(l->label);
                return k;
        }
        if (user_charge(c->user, &l->charge_lease, USER_LEASES, (size_t)i, 1, ret_quota) < 0 ||
            user_charge(c->user, &l->charge_bytes, USER_BYTES, (size_t)i, ALIGN_UP(size, s.granularity),
                        ret_quota) < 0) {
                user_charge_release(&l->charge_lease);
                free(l->label);
                return BROKER_E_QUOTA;
        }
        k = pool_alloc_bounded(b->pool, s.index, size, h->uid, b->scrub_wait_bytes, slabs, &n);
        if (k == 0) {
                l->slabs = calloc(n, sizeof(Slab *));
                if (!l->slabs)
                        k = -ENOMEM;
        }
        if (k != 0) {
                alloc_undo(b, l, slabs, k == -ENOMEM ? n : 0);
                free(l->label);
                return pool_outcome(k);
        }
        memcpy(l->slabs, slabs, n * sizeof(Slab *));
        l->n_slabs = n;
        l->device = s.index;
        l->pool_device = (size_t)i;
        for (size_t j = 0; j < n; j++)
                l->size += slabs[j]->size;
        l->created_usec = now_realtime_usec();
        l->uid = h->uid;
        l->pid = h->pid;
        memcpy(l->comm, h->comm, sizeof(l->comm));

        change_begin(b);
        k = put_lease(b, l);
        if (k >= 0)
                k = put_hold(b, l, h, 1, false, false);
        k = change_commit(b, k);
        if (k != 0) {
                alloc_undo(b, l, slabs, n);
                free(l->slabs);
                free(l->label);
                return k;
        }
        lease_table_add(&b->leases, l);
        lease_add_hold(&b->leases, l, TAKE_PTR(hold), h, 1, false);
        event_lease_made(l, h);
        *ret = TAKE_PTR(l);
        return 0;
}

int broker_alloc_among(Broker *b, const Caller *c, const uint64_t *devices, size_t n, uint64_t size,
                       const char *label, Lease **ret, UserQuota *ret_quota, size_t *ret_device) {
        size_t n_pool = pool_n_devices(b->pool), n_order = 0;
        _cleanup_free_ PoolDeviceStats *stats = calloc(n_pool ?: 1, sizeof(PoolDeviceStats));
        _cleanup_free_ size_t *order = calloc(n_pool ?: 1, sizeof(size_t));
        _cleanup_free_ bool *chosen = calloc(n_pool ?: 1, sizeof(bool));
        UserQuota quota = {}, q;
        int outcome = BROKER_E_NO_DEVICE, k;
        bool refused_quota = false;
        size_t first = 0;

        if (!stats || !order || !chosen)
                return -ENOMEM;
        for (size_t j = 0; j < (devices ? n : n_pool); j++) {
                int i = !devices ? (int)j : devices[j] <= INT32_MAX
                                                    ? pool_find_device(b->pool, (int)devices[j]) : -1;

                if (i < 0)
                        return BROKER_E_NO_DEVICE;
                if (!chosen[i])
                        order[n_order++] = (size_t)i;
                chosen[i] = true;
        }
        for (size_t j = 0; j < n_order; j++)
                pool_device_stats(b->pool, order[j], &stats[order[j]]);
        if (b->placement == PLACEMENT_NEAREST) {
                NodeSet near;

                /* The caller's nodes; unknown (no map, affinity unreadable): most-free over all. */
                placement_order_near(b->placement, stats, order, n_order,
                                     numa_map_nodes_of_pid(&b->numa, c->holder->pid, &near) == 0 ? &near : NULL);
        } else
                placement_order(b->placement, stats, order, n_order);

        /* A lease the caller kept comes first, on whichever of the devices it is: the memory is its own. */
        if (!list_is_empty(&c->holder->kept) && size <= UINT64_MAX / 2) {
                k = kept_serve(b, c, order, n_order, size, label, ret, ret_device);
                if (k != 0 || *ret)
                        return k;
        }

        for (size_t j = 0; j < n_order; j++) {
                q = (UserQuota){};
                k = broker_alloc(b, c, stats[order[j]].index, size, label, ret, &q);
                if (k == BROKER_E_QUOTA || k == BROKER_E_TOO_LARGE) {
                        if (outcome == BROKER_E_NO_DEVICE)
                                first = order[j];
                        if (k == BROKER_E_QUOTA && !refused_quota) {
                                refused_quota = true;
                                quota = q;
                                first = order[j];
                        }
                        outcome = refused_quota ? BROKER_E_QUOTA : k;
                        continue;
                }
                if (ret_device)
                        *ret_device = order[j];
                return k;
        }
        if (outcome == BROKER_E_QUOTA && ret_quota)
                *ret_quota = quota;
        if (outcome != BROKER_E_NO_DEVICE && ret_device)
                *ret_device = first;
        return outcome;
}

/* --- Free, Share, Revoke -------------------------------------------------------------------------- */

/* The caller's hold on the lease `id`, kept or not: a lease its process does not hold is not found. */
static Hold *caller_hold_any(const Broker *b, const Caller *c, const char *id) {
        Lease *l = lease_table_find(&b->leases, id);

        return l ? lease_find_hold(l, c->holder) : NULL;
}

/* The caller's hold on the lease `id` for any call but Free: a kept lease is not the process's to use. */
static Hold *caller_hold(const Broker *b, const Caller *c, const char *id) {
        Hold *hold = caller_hold_any(b, c, id);

        return hold && !hold->lease->kept ? hold : NULL;
}

/* Whether the lease of `hold` may be kept for the hold's process (broker_free()). */
static bool may_keep(const Hold *hold) {
        const Lease *l = hold->lease;

        /* Not foreign: a process of another user that held it may still map it (and write into it after the
         * zeroing), which is why a foreign lease's slabs are never reused either. */
        return hold->refs == 1 && l->n_holds == 1 && !hold->readonly && hold->holder->uid == l->uid &&
               !l->name && !l->parked && !l->kept && !l->move && !l->foreign && l->reclaim.state != RECLAIM_ASKED;
}

/* Queues the zeroing in place of every slab of a lease. Returns 0 or BROKER_E_DRIVER. */
static int lease_zero(Broker *b, Lease *l) {
        for (size_t j = 0; j < l->n_slabs; j++)
                if (pool_scrub_leased(b->pool, l->slabs[j]) != 0)
                        return BROKER_E_DRIVER;
        return 0;
}

int broker_keep_restored(Broker *b, Lease *l) {
        Hold *hold = list_first_entry(&l->holds, Hold, link_lease);
        int k;

        if (!hold || !may_keep(hold))
                return BROKER_E_NOT_OWNER;
        k = lease_zero(b, l);
        if (k != 0)
                return k;
        lease_keep(&b->leases, l);
        return 0;
}

/*
 * Keeps the lease of the caller's hold: zeroes it in place, stores it kept, then keeps it in the table.
 * Returns 0, or BROKER_E_DRIVER (nothing changed) / BROKER_E_NOT_STORED (nothing changed but the zeroing).
 */
static int lease_keep_stored(Broker *b, Hold *hold) {
        Lease *l = hold->lease;
        Token *tok;
        int k;

        k = lease_zero(b, l);
        if (k != 0)
                return k;
        /* Kept, and its tokens revoked. */
        change_begin(b);
        k = put_lease_as(b, l, true, l->label);
        list_for_each_entry(tok, &l->tokens, link)
                if (k >= 0 && b->store)
                        k = store_end_token(b->store, tok->token);
        k = change_commit(b, k);
        if (k != 0)
                return k;
        lease_keep(&b->leases, l);
        return 0;
}

int broker_free(Broker *b, const Caller *c, const char *id, bool keep, bool *ret_kept) {
        Hold *hold = caller_hold_any(b, c, id);
        int k;

        if (ret_kept)
                *ret_kept = false;
        if (!hold)
                return BROKER_E_NO_SUCH_LEASE;
        if (keep && may_keep(hold)) {
                k = lease_keep_stored(b, hold);
                if (k == 0) {
                        if (ret_kept)
                                *ret_kept = true;
                        return 0;
                }
                if (k != BROKER_E_DRIVER)
                        return k;
                /* Memory the device could not be asked to zero is not kept: the Free ends the hold. */
        }
        change_begin(b);
        if (hold->refs > 1)
                k = put_hold(b, hold->lease, hold->holder, hold->refs - 1, hold->readonly, hold->parked);
        else
                k = put_hold_end(b, hold);
        k = change_commit(b, k);
        if (k != 0)
                return k;
        event_hold_freed(hold);
        hold_unref(&b->leases, hold);
        return 0;
}

int broker_set_reclaimable(Broker *b, const Caller *c, const char *id, int64_t priority) {
        Hold *hold = caller_hold(b, c, id);

        if (!hold)
                return BROKER_E_NO_SUCH_LEASE;
        if (c->holder->uid != hold->lease->uid)
                return BROKER_E_NOT_OWNER;
        if (hold->readonly)
                return BROKER_E_READONLY;
        /* Not stored (reclaim.h): nothing a crash could lose matters here, a mark only invites a request. */
        if (priority < 0)
                (void)reclaim_unmark(&b->leases.reclaim, hold->lease);
        else
                reclaim_mark(&b->leases.reclaim, hold->lease, (uint32_t)MIN(priority, (int64_t)UINT32_MAX));
        return 0;
}

/* Whether a lease can be asked back for `waiting`'s sake (broker_reclaim_pick()). */
static bool reclaim_can_ask(const Lease *l, void *userdata) {
        const Holder *waiting = userdata;
        const Hold *hold;

        if (l->name || l->n_holds == 0)
                return false;           /* published: it would outlive every Free of its holders */
        if (l->parked || l->move)
                return false;           /* in host memory, or on its way there: freeing it gives the device
                                           nothing, or nothing sooner */
        /* A kept lease may be asked of the waiting process too: the library gives it back from its watch
         * thread, with no caller to consult (protocol.md). */
        list_for_each_entry(hold, &l->holds, link_lease)
                if ((hold->holder == waiting && !l->kept) || !hold->holder->watch || hold->holder->exited)
                        return false;
        return true;
}

size_t broker_reclaim_pick(Broker *b, size_t device, uint64_t need, const Holder *waiting, Lease **ret,
                           size_t max) {
        return reclaim_pick(&b->leases.reclaim, device, need, reclaim_can_ask, (void *)waiting, ret, max);
}

int broker_share(Broker *b, const Caller *c, const char *id, uid_t uid, bool readonly, Token **ret) {
        Hold *hold = caller_hold(b, c, id);
        _cleanup_free_ Token *tok = NULL;
        int k;

        if (!hold)
                return BROKER_E_NO_SUCH_LEASE;
        if (c->holder->uid != hold->lease->uid)
                return BROKER_E_NOT_OWNER;
        if (hold->readonly && !readonly)
                return BROKER_E_READONLY;
        if (hold->lease->n_tokens >= LEASE_TOKENS_MAX)
                return BROKER_E_TOKENS;
        tok = calloc(1, sizeof(*tok));
        if (!tok)
                return -ENOMEM;
        k = lease_random_hex(tok->token, LEASE_TOKEN_LEN);
        if (k >= 0)
                k = lease_table_reserve(&b->leases);
        if (k < 0)
                return k;
        tok->uid = uid;
        tok->creator = c->holder->uid;
        tok->readonly = readonly;
        tok->lease = hold->lease;

        change_begin(b);
        k = change_commit(b, b->store ? store_put_token(b->store, hold->lease->id, tok) : 0);
        if (k != 0)
                return k;
        lease_add_token(&b->leases, hold->lease, tok);
        *ret = TAKE_PTR(tok);
        return 0;
}

int broker_tokens(Broker *b, const Caller *c, const char *id, int (*fn)(const Token *t, void *userdata),
                  void *userdata) {
        Lease *l = lease_table_find(&b->leases, id);
        const Token *tok;
        int k;

        if (!l || (!c->admin && (!lease_find_hold(l, c->holder) || l->kept)))
                return BROKER_E_NO_SUCH_LEASE;
        if (!c->admin && c->holder->uid != l->uid)
                return BROKER_E_NOT_OWNER;
        list_for_each_entry(tok, &l->tokens, link) {
                k = fn(tok, userdata);
                if (k != 0)
                        return k;
        }
        return 0;
}

int broker_revoke(Broker *b, const Caller *c, const char *token) {
        Token *tok = lease_table_find_token(&b->leases, token);
        uid_t uid = c->holder->uid;
        int k;

        if (!tok)
                return BROKER_E_NO_SUCH_TOKEN;
        if (uid != tok->lease->uid && uid != tok->creator && !c->admin)
                return BROKER_E_NOT_OWNER;
        change_begin(b);
        k = change_commit(b, b->store ? store_end_token(b->store, tok->token) : 0);
        if (k != 0)
                return k;
        token_free(&b->leases, tok);
        return 0;
}

/* --- Park, Unpark --------------------------------------------------------------------------------- */

/* Gives leased slabs back to the pool: scrubbed and cached, or released when another user held them. */
static void slabs_give_back(Broker *b, Slab *const *slabs, size_t n, bool foreign) {
        for (size_t j = 0; j < n; j++) {
                if (foreign)
                        pool_release(b->pool, slabs[j]);
                else
                        pool_reclaim(b->pool, slabs[j]);
        }
}

/* A move that does not happen, for failure `k`: its slabs `to` (the owner's content at most: scrubbed, kept for it)
 * and `charge` go back; returns the failure as the broker says it. */
static int move_undo(Broker *b, Slab *const *to, size_t n_to, UserCharge *charge, int k) {
        slabs_give_back(b, to, n_to, false);
        user_charge_release(charge);
        return pool_outcome(k);
}

/* Sets a hold parked or not, stored first. */
static int hold_set_parked(Broker *b, Hold *hold, bool parked) {
        int k;

        if (hold->parked == parked)
                return 0;
        change_begin(b);
        k = change_commit(b, put_hold(b, hold->lease, hold->holder, hold->refs, hold->readonly, parked));
        if (k != 0)
                return k;
        hold->parked = parked;
        return 0;
}

/*
 * Makes a lease's content being in `to` (n_to slabs, leased already, the copy done) the lease's: stores the
 * lease as it will be (parked or not, with those slabs) and `hold` (if not NULL: the one that asked) parked
 * as the lease, then swaps the slabs and the charge (`charge`, taken by the caller, replaces the lease's
 * other one). On failure `to` and `charge` go back and the lease is as it was.
 */
static int lease_move_commit(Broker *b, Lease *l, Slab **to, size_t n_to, bool parked, UserCharge *charge,
                             Hold *hold) {
        _cleanup_free_ Slab **array = calloc(n_to, sizeof(Slab *));
        Slab **old = l->slabs;
        size_t n_old = l->n_slabs;
        int k = array ? 0 : -ENOMEM;

        if (k == 0) {
                memcpy(array, to, n_to * sizeof(Slab *));
                change_begin(b);
                l->slabs = array;
                l->n_slabs = n_to;
                l->parked = parked;
                k = put_lease(b, l);
                l->slabs = old;
                l->n_slabs = n_old;
                l->parked = !parked;
                if (k >= 0 && hold)
                        k = put_hold(b, l, hold->holder, hold->refs, hold->readonly, parked);
                k = change_commit(b, k);
        }
        if (k != 0)
                return move_undo(b, to, n_to, charge, k);
        /* Device slabs another user mapped are released; host slabs were never mapped by anyone else. */
        slabs_give_back(b, old, n_old, l->foreign && parked);
        free(old);
        l->slabs = TAKE_PTR(array);
        l->n_slabs = n_to;
        l->parked = parked;
        if (parked) {
                user_charge_release(&l->charge_bytes);
                l->charge_host = *charge;
        } else {
                user_charge_release(&l->charge_host);
                l->charge_bytes = *charge;
        }
        *charge = USER_CHARGE_NULL;
        if (hold)
                hold->parked = parked;
        if (parked)
                reclaim_forget(&b->leases.reclaim, l);  /* its device memory came back: asked or not, done */
        event_lease_parked(l, hold ? hold->holder : NULL, parked);
        b->leases.generation++;
        return 0;
}

/*
 * Moves a lease's content into `to` (n_to slabs, leased already) off the loop: the copy is queued and the lease
 * gets a move (lease.h), which broker_finish_moves() commits once the copy is done, for `hold` (or none: an
 * Attach's). `charge`, taken by the caller, goes with it. Returns BROKER_E_HOST_COPYING, or the failure to
 * start it (then `to` and `charge` went back).
 */
static int lease_move_start(Broker *b, Lease *l, Slab **to, size_t n_to, bool parked, UserCharge *charge,
                            Hold *hold) {
        _cleanup_free_ LeaseMove *move = calloc(1, sizeof(*move));
        _cleanup_free_ Slab **slabs = calloc(n_to, sizeof(Slab *));
        int k = move && slabs ? 0 : -ENOMEM;

        if (k == 0)
                k = pool_copy_start(b->pool, l->uid, to, n_to, l->slabs, l->n_slabs);
        if (k != 0)
                return move_undo(b, to, n_to, charge, k);
        memcpy(slabs, to, n_to * sizeof(Slab *));
        move->slabs = TAKE_PTR(slabs);
        move->n_slabs = n_to;
        move->parked = parked;
        move->charge = *charge;
        *charge = USER_CHARGE_NULL;
        move->hold = hold;
        lease_move_add(&b->leases, l, TAKE_PTR(move));
        return BROKER_E_HOST_COPYING;
}

/* Returns a move's outcome `k` as the answer says it: a copy's failure in its own words (Lease.move_message), whatever
 * failed in the pool since. */
static int move_outcome(Broker *b, const Lease *l, int k) {
        if (k == BROKER_E_DRIVER && l->move_message)
                pool_restate_error(b->pool, l->move_message);
        return k;
}

/*
 * Ends a move whose copy is over (lease_move_start()): committed when it copied (`copied`, pool_copy_result(): 0),
 * else given up, its slabs and charge given back, and a copy's failure kept in the driver's words
 * (Lease.move_message: giving the slabs back may fail in the pool too). On failure the lease is as it was.
 */
static int move_end(Broker *b, Lease *l, int copied) {
        LeaseMove *move = lease_move_take(&b->leases, l);
        int k;

        if (copied == 0)
                k = lease_move_commit(b, l, move->slabs, move->n_slabs, move->parked, &move->charge, move->hold);
        else {
                if (copied == POOL_E_DRIVER) {
                        free(l->move_message);
                        l->move_message = strdup(pool_last_error(b->pool));     /* pool_copy_result()'s */
                }
                k = move_undo(b, move->slabs, move->n_slabs, &move->charge, copied);
        }
        free(move->slabs);
        free(move);
        return move_outcome(b, l, k);
}

/* A call made again after a move ended gets the failure to store that move (Lease.move_error): every call
 * that waited for it, until another move starts. */
static int move_error_take(Broker *b, const Caller *c, const Lease *l) {
        return c->copy_waited ? move_outcome(b, l, l->move_error) : 0;
}

/* The lease's move: ended when its copy is over (0, or the failure), else waited for (HOST_COPYING). */
static int move_wait(Broker *b, Lease *l) {
        int copied = pool_copy_result(b->pool, l->move->slabs[0]);

        if (copied == POOL_E_COPYING)
                return BROKER_E_HOST_COPYING;
        return move_end(b, l, copied);
}

/*
 * Whether the lease's move is the caller's process's own. Its calls about the lease wait for it, whatever they
 * ask, so that they are served in the order they came: a Park, then an Unpark from another thread, end with
 * the lease unparked, never parked again behind the Unpark's back.
 */
static bool move_is_own(const Lease *l, const Caller *c) {
        return l->move && l->move->hold && l->move->hold->holder == c->holder;
}

unsigned broker_finish_moves(Broker *b) {
        LeaseMove *move, *tmp;
        unsigned n = 0;

        list_for_each_entry_safe(move, tmp, &b->leases.moves, link) {
                Lease *l = move->lease;
                int copied = pool_copy_result(b->pool, move->slabs[0]);

                if (copied == POOL_E_COPYING)
                        continue;
                l->move_error = move_end(b, l, copied); /* for the call waiting for it */
                n++;
        }
        return n;
}

uint64_t broker_moves_ended(const Broker *b) {
        return b->leases.moves_ended;
}

int broker_park(Broker *b, const Caller *c, const char *id, bool *ret_parked, UserQuota *ret_quota,
                uint64_t *ret_ticket) {
        Hold *hold = caller_hold(b, c, id), *other;
        _cleanup_free_ Slab **host = NULL;
        UserCharge charge = USER_CHARGE_NULL;
        bool alone = true;
        size_t n_host = 0;
        Lease *l;
        int k;

        if (!hold)
                return BROKER_E_NO_SUCH_LEASE;
        l = hold->lease;
        if (c->holder->uid != l->uid)
                return BROKER_E_NOT_OWNER;
        if (hold->readonly)
                return BROKER_E_READONLY;
        k = move_error_take(b, c, l);
        if (k == 0 && move_is_own(l, c))
                k = move_wait(b, l);            /* its process's park (this call's, or another's) or unpark */
        if (k != 0)
                return k;
        if (l->move)
                alone = false;                  /* another process's park or unpark is under way */
        list_for_each_entry(other, &l->holds, link_lease)
                if (other != hold && !other->parked)
                        alone = false;          /* another process still maps it: it moves when that one parks */
        if (l->parked || !alone) {
                k = hold_set_parked(b, hold, true);
                if (k != 0)
                        return k;
                *ret_parked = l->parked;
                return 0;
        }

        if (!pool_has_host(b->pool, l->pool_device))
                return BROKER_E_NO_HOST_MEMORY;         /* not a limit of the user's: say why */
        if (user_charge(l->charge_bytes.user, &charge, USER_HOST_BYTES, l->pool_device, l->size, ret_quota) < 0)
                return BROKER_E_QUOTA;
        /* Pinning new host memory takes about 0.3 s per GiB: not in the loop, which serves everyone else. */
        k = c->host_make_failed ? 0 : pool_make_host(b->pool, l->slabs, l->n_slabs, l->uid, ret_ticket);
        if (k != 0) {
                user_charge_release(&charge);
                return pool_outcome(k);
        }
        /* Host slabs freed by an unpark are zeroed at about 20 ms per GiB: waited for off the loop, past the
         * bound of what the loop waits for (BROKER_E_SCRUBBING, made again once scrubs finished). */
        host = calloc(POOL_MAX_HOST_SLABS, sizeof(Slab *));
        k = host ? pool_alloc_host(b->pool, l->slabs, l->n_slabs, l->uid, b->scrub_wait_bytes, host, &n_host)
                 : -ENOMEM;
        if (k != 0) {
                user_charge_release(&charge);
                return pool_outcome(k);
        }
        /* Nor the copy, some 20 ms per GiB. */
        return lease_move_start(b, l, host, n_host, true, &charge, hold);
}

/*
 * Brings a parked lease back into device memory, charged to its owner, off the loop: HOST_COPYING once its
 * copy is under way, for `hold` (or NULL: an Attach's).
 */
static int lease_unpark(Broker *b, Lease *l, Hold *hold, UserQuota *ret_quota) {
        Slab *slabs[POOL_MAX_SLABS];
        UserCharge charge = USER_CHARGE_NULL;
        size_t n = 0;
        int k;

        if (user_charge(l->charge_host.user, &charge, USER_BYTES, l->pool_device, l->size, ret_quota) < 0)
                return BROKER_E_QUOTA;
        /* Device memory still being zeroed past the broker's bound is waited for off the loop, as an Alloc's
         * (BROKER_E_SCRUBBING, made again once scrubs finished): it may stand behind host memory's zeroing, 20 ms
         * per GiB. */
        k = pool_alloc_bounded(b->pool, l->device, l->size, l->uid, b->scrub_wait_bytes, slabs, &n);
        if (k != 0) {
                user_charge_release(&charge);
                return pool_outcome(k);
        }
        return lease_move_start(b, l, slabs, n, false, &charge, hold);
}

int broker_unpark(Broker *b, const Caller *c, const char *id, Hold **ret, UserQuota *ret_quota) {
        Hold *hold = caller_hold(b, c, id);
        Lease *l;
        int k;

        if (!hold)
                return BROKER_E_NO_SUCH_LEASE;
        l = hold->lease;
        k = move_error_take(b, c, l);
        if (k == 0 && (move_is_own(l, c) || (l->move && !l->move->parked)))
                k = move_wait(b, l);            /* its own park or unpark, or the lease's unpark, any holder's */
        if (k != 0)
                return k;
        if (l->parked)
                return lease_unpark(b, l, hold, ret_quota);
        lease_move_cancel(&b->leases, l);       /* another process's park being copied: it maps it again */
        k = hold_set_parked(b, hold, false);
        if (k != 0)
                return k;
        *ret = hold;
        return 0;
}

/* --- Attach --------------------------------------------------------------------------------------- */

int broker_attach(Broker *b, const Caller *c, const char *token, uid_t owner, const char *name, bool readonly,
                  Hold **ret, UserQuota *ret_quota) {
        _cleanup_free_ Hold *fresh = NULL;
        Holder *h = c->holder;
        bool was_foreign;
        Hold *hold;
        Lease *l;
        int k;

        if (token) {
                Token *tok = lease_table_find_token(&b->leases, token);

                if (!tok)
                        return BROKER_E_NO_SUCH_TOKEN;
                if (tok->uid != UID_ANY && tok->uid != h->uid)
                        return BROKER_E_TOKEN_UID;
                l = tok->lease;
                readonly = readonly || tok->readonly;
        } else {
                l = lease_table_find_name(&b->leases, owner, name);
                if (!l || !lease_name_allows(l, h->uid))
                        return BROKER_E_NO_SUCH_NAME;   /* whether it exists is not the caller's to learn */
                readonly = readonly || l->name_readonly;
        }
        hold = lease_find_hold(l, h);
        if (!hold) {
                fresh = calloc(1, sizeof(*fresh));
                if (!fresh)
                        return -ENOMEM;
        }
        k = move_error_take(b, c, l);
        if (k == 0 && (move_is_own(l, c) || (l->move && !l->move->parked)))
                k = move_wait(b, l);            /* its own park or unpark, or the lease's unpark */
        if (k != 0)
                return k;
        if (l->parked)
                return lease_unpark(b, l, NULL, ret_quota);     /* attached or not, it comes back */
        /* Another process's park being copied is undone: this process maps the lease as it is. */
        lease_move_cancel(&b->leases, l);
        /* Once another user holds it, the lease is foreign for good: stored with it. */
        was_foreign = l->foreign;
        change_begin(b);
        l->foreign = l->foreign || h->uid != l->uid;
        k = l->foreign != was_foreign ? put_lease(b, l) : 0;
        l->foreign = was_foreign;
        if (k >= 0)
                k = hold ? put_hold(b, l, h, hold->refs + 1, hold->readonly && readonly, false)
                         : put_hold(b, l, h, 1, readonly, false);
        k = change_commit(b, k);
        if (k != 0)
                return k;
        if (hold) {
                hold_ref(&b->leases, hold, readonly);
                hold->parked = false;
        } else {
                hold = TAKE_PTR(fresh);
                lease_add_hold(&b->leases, l, hold, h, 1, readonly);
        }
        *ret = hold;
        return 0;
}

/* --- Publish, Unpublish --------------------------------------------------------------------------- */

int broker_publish(Broker *b, const Caller *c, const char *id, const char *name, const uid_t *uids, size_t n_uids,
                   bool readonly) {
        _cleanup_free_ uid_t *copy = NULL;
        _cleanup_free_ char *key = NULL;
        Hold *hold = caller_hold(b, c, id);
        Lease *l, *other;
        uid_t *old_uids;
        size_t old_n;
        bool old_ro;
        char *old_name;
        int k;

        if (!hold)
                return BROKER_E_NO_SUCH_LEASE;
        l = hold->lease;
        if (c->holder->uid != l->uid || hold->readonly)
                return BROKER_E_NOT_OWNER;
        other = lease_table_find_name(&b->leases, l->uid, name);
        if (other && other != l)
                return BROKER_E_NAME_IN_USE;
        if (l->name && strcmp(l->name, name) != 0)
                return BROKER_E_HAS_NAME;
        key = lease_name_key(l->uid, name);
        copy = calloc(n_uids ?: 1, sizeof(uid_t));
        if (!key || !copy)
                return -ENOMEM;
        if (n_uids > 0)
                memcpy(copy, uids, n_uids * sizeof(uid_t));
        k = lease_table_reserve(&b->leases);
        if (k < 0)
                return k;

        /* The lease as it will be, stored; then put back until the change is made. */
        old_name = l->name;
        old_uids = l->name_uids;
        old_n = l->n_name_uids;
        old_ro = l->name_readonly;
        change_begin(b);
        l->name = strchr(key, '/') + 1;
        l->name_uids = copy;
        l->n_name_uids = n_uids;
        l->name_readonly = readonly;
        k = put_lease(b, l);
        l->name = old_name;
        l->name_uids = old_uids;
        l->n_name_uids = old_n;
        l->name_readonly = old_ro;
        k = change_commit(b, k);
        if (k != 0)
                return k;
        lease_set_name(&b->leases, l, TAKE_PTR(key), TAKE_PTR(copy), n_uids, readonly);
        event_lease_published(l, c->holder);
        return 0;
}

int broker_unpublish(Broker *b, const Caller *c, uid_t owner, const char *name) {
        Lease *l = lease_table_find_name(&b->leases, owner, name);
        char *old;
        int k;

        if (!l || (!c->admin && !lease_name_allows(l, c->holder->uid)))
                return BROKER_E_NO_SUCH_NAME;
        if (c->holder->uid != l->uid && !c->admin)
                return BROKER_E_NOT_OWNER;
        change_begin(b);
        if (l->n_holds == 0)
                k = b->store ? store_end_lease(b->store, l->id) : 0;
        else {
                old = l->name;
                l->name = NULL;
                k = put_lease(b, l);
                l->name = old;
        }
        k = change_commit(b, k);
        if (k != 0)
                return k;
        event_lease_unpublished(l, c->holder);
        lease_unpublish(&b->leases, l);
        return 0;
}

/* --- List ----------------------------------------------------------------------------------------- */

int broker_list(Broker *b, const Caller *c, bool all, int (*fn)(const Lease *l, void *userdata), void *userdata) {
        uint64_t serial = ++b->list_serial;
        Holder *h;
        Lease *l;
        Hold *hold;
        int k;

        if (all && !c->admin)
                return BROKER_E_NOT_OWNER;
        if (all) {
                list_for_each_entry(l, &b->leases.leases, link_table) {
                        k = fn(l, userdata);
                        if (k != 0)
                                return k;
                }
                return 0;
        }
        /* What the caller's user owns, then what its processes hold of others' (each lease once). */
        list_for_each_entry(l, &c->user->owned, link_owner) {
                l->listed = serial;
                k = fn(l, userdata);
                if (k != 0)
                        return k;
        }
        list_for_each_entry(h, &c->user->holders, link_user)
                list_for_each_entry(hold, &h->holds, link_holder) {
                        l = hold->lease;
                        if (l->listed == serial)
                                continue;
                        l->listed = serial;
                        k = fn(l, userdata);
                        if (k != 0)
                                return k;
                }
        return 0;
}

/* --- holders that exited -------------------------------------------------------------------------- */

unsigned broker_reap_holders(Broker *b) {
        unsigned n = 0;
        Holder *h;

        while ((h = holder_next_exited(&b->holders))) {
                Hold *hold, *tmp;
                int k = 0;

                /* A holder that held nothing changes nothing stored: it goes even while storing fails. */
                if (!list_is_empty(&h->holds)) {
                        change_begin(b);
                        list_for_each_entry(hold, &h->holds, link_holder)
                                if (k >= 0)
                                        k = put_hold_end(b, hold);
                        k = change_commit(b, k);
                        if (k != 0)
                                break;  /* kept, and tried again at the next call (broker_has_unreaped()) */
                }
                list_for_each_entry_safe(hold, tmp, &h->holds, link_holder) {
                        event_hold_reclaimed(hold);
                        hold_end(&b->leases, hold);
                        n++;
                }
                holder_reaped(h);
        }
        return n;
}

bool broker_has_unreaped(const Broker *b) {
        return !list_is_empty(&b->holders.exited);
}

/* --- the store ------------------------------------------------------------------------------------ */

static bool snapshot_wanted(const Broker *b) {
        return b->store && (!store_is_open(b->store) || store_wants_snapshot(b->store));
}

bool broker_has_idle_work(const Broker *b) {
        return snapshot_wanted(b) || b->store_error < 0 || broker_has_unreaped(b);
}

int broker_store_snapshot(Broker *b, bool force) {
        int k;

        if (!b->store)
                return 0;
        if (!force && !snapshot_wanted(b))
                return 0;
        k = store_snapshot(b->store, &b->leases);
        event_store_health(b->store_error, MIN(k, 0));
        b->store_error = k < 0 ? k : 0;
        return k;
}
