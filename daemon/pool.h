/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The slab pool: the daemon's CUDA VMM physical allocations ("slabs"), per
 * device.
 *
 * - Sizes: a slab is any multiple of the device's allocation granularity up
 *   to the maximum slab size. A request is rounded up to the granularity and
 *   served by whole maximum slabs plus one slab of the rest: a lease up to
 *   the maximum slab is one slab, so a client imports and maps it once.
 * - Export once: a slab is exported (POSIX fd) when it is created and the fd
 *   is kept for the slab's life. Handing a slab out is sending that fd again.
 * - Isolation: a slab belongs to the uid it was first leased to; once freed it
 *   is cached for that uid only, by its exact size. Another uid gets fresh slabs, or unbound ones
 *   (created ahead by pool_idle() and never leased).
 * - Zeroed: a freed slab is scrubbed asynchronously, on the pool's own
 *   mapping and stream, and is cached only when the scrub has completed.
 * - Capacity: each device has a capacity; when a request needs room, cached
 *   slabs are released, least recently used first, whoever they belonged to.
 * - Transactions: a request that fails leaves every slab as it was, except
 *   cached slabs released to make room for it.
 * - Host memory for parking: each device also has slabs of pinned host memory
 *   on its NUMA node (cuMemCreate at CU_MEM_LOCATION_TYPE_HOST_NUMA), exported
 *   and kept in the fd store like device slabs, up to a host capacity of their
 *   own. A parked lease's content is copied into them (pool_alloc_host(),
 *   pool_copy_start()); they are never sent to a client. Freed, they are scrubbed
 *   like device slabs and then cached for any user (zeroed, they hold nobody's
 *   data).
 *
 * Single-threaded: every call comes from the daemon's event loop thread. The
 * only other thread is the driver's, which signals scrub completion through
 * pool_get_fd().
 */

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "driver.h"
#include "list.h"

#define POOL_MAX_SLABS 253                      /* the kernel's limit on fds in one message */
#define POOL_DEFAULT_MAX_SLAB (UINT64_C(1) << 30)
#define POOL_DEFAULT_HOST_SLAB (UINT64_C(64) << 20)  /* pinned per cuMemCreate: the driver's lock is held that long */
#define POOL_DEFAULT_COPY_PIECE (UINT64_C(64) << 20) /* a park's or unpark's copy is queued in pieces of this */
#define POOL_FAILED_TICKETS 64                  /* makings that failed, remembered (pool_make_failed()) */
#define POOL_COPY_AHEAD 3                       /* pieces of copies on a device's copy stream at once */
#define POOL_HOST_PIECES_MAX 16                 /* host slabs per device slab, at most (max_slab / host_slab) */
#define POOL_MAX_HOST_SLABS (POOL_MAX_SLABS * POOL_HOST_PIECES_MAX) /* of one parked lease */

/* The most slabs a lease may have: POOL_MAX_HOST_SLABS parked (host slabs), else POOL_MAX_SLABS. */
static inline size_t pool_max_slabs(bool parked) {
        return parked ? POOL_MAX_HOST_SLABS : POOL_MAX_SLABS;
}
#define POOL_DEFAULT_CAPACITY_PERCENT 95        /* of the device memory free when the pool starts */
#define POOL_DEFAULT_HOST_CAPACITY_PERCENT 25   /* of the host's physical memory, shared by the devices */
#define UID_UNBOUND ((uid_t)-1)                 /* owner of a slab never leased: any uid may have it */

/* Expected outcomes of pool_alloc(), positive; negative errno values are fatal. */
enum {
        POOL_E_NOMEM = 1,       /* no room on the device: capacity reached, or the driver is out of memory */
        POOL_E_TOO_LARGE,       /* more than the device's capacity, or more than POOL_MAX_SLABS slabs */
        POOL_E_NO_DEVICE,       /* the pool does not serve that device */
        POOL_E_DRIVER,          /* the driver failed; pool_last_error() says how */
        POOL_E_NOT_KEPT,        /* a new slab could not be kept across a restart (its slab_created hook failed) */
        POOL_E_HOST_NOMEM,      /* no room in the device's host memory for parked leases */
        POOL_E_NO_HOST,         /* the device has no host memory for parking (HostCapacity=0, or the driver
                                   cannot make it: pool_last_error() says why) */
        POOL_E_SCRUBBING,       /* the request would wait for more zeroing than it may (pool_alloc_bounded()) */
        POOL_E_MAKING,          /* the host slabs it needs are being made off the loop (pool_make_host()) */
        POOL_E_COPYING,         /* the copy is under way (pool_copy_result()) */
};

typedef struct PoolConfig {
        uint64_t max_slab;      /* largest slab: a power of two, at least the granularity; 0 = 1 GiB */
        uint64_t capacity;      /* bytes per device; 0 = capacity_percent of the free memory */
        unsigned capacity_percent; /* 1-100, when capacity is 0; 0 = POOL_DEFAULT_CAPACITY_PERCENT */
        const int *devices;     /* device indices to serve; NULL = every device */
        size_t n_devices;
        uint64_t host_capacity; /* host bytes per device for parked leases; 0 = host_capacity_percent */
        unsigned host_capacity_percent; /* 1-100 of the physical memory, divided among the devices, when
                                           host_capacity is 0; 0 = POOL_DEFAULT_HOST_CAPACITY_PERCENT */
        bool no_host;           /* no host memory at all: leases cannot be parked (HostCapacity=0) */
        uint64_t host_reserve;  /* host bytes per device pinned at start for parks (pool_reserve_host()), a multiple
                                   of host_slab; 0: none (HostReserve=) */
        uint64_t host_slab;     /* the largest host slab (HostSlab=): a power of two, at least max_slab /
                                   POOL_HOST_PIECES_MAX; 0 = pool_host_slab()'s default */
        uint64_t copy_piece;    /* the most bytes of a park's or unpark's copy queued at once (pool_copy_start());
                                   0 = POOL_DEFAULT_COPY_PIECE. Not a setting: tests make it small */
} PoolConfig;

/*
 * The largest host slab the pool makes with `max_slab` and HostSlab= `host_slab` (0: not set): host_slab, or
 * POOL_DEFAULT_HOST_SLAB but at least max_slab / POOL_HOST_PIECES_MAX; never more than max_slab. A device slab's
 * content is parked in host slabs of this size and one of the rest (pool_alloc_host()), because the driver pins
 * each host slab under a lock that every process's GPU allocations on the host wait for.
 */
uint64_t pool_host_slab(uint64_t max_slab, uint64_t host_slab);

typedef enum SlabState {
        SLAB_LEASED,            /* handed out; reclaim it with pool_reclaim() */
        SLAB_SCRUBBING,         /* being zeroed; not usable */
        SLAB_CACHED,            /* zeroed, waiting for its uid to ask again */
} SlabState;

typedef struct Pool Pool;
typedef struct PoolDevice PoolDevice;
typedef struct SlabSpace SlabSpace;
typedef struct CacheBucket CacheBucket;
typedef struct CopyJob CopyJob;

typedef struct Slab {
        uint64_t id;                    /* unique in the pool, from 1, never reused: names the slab's fd in the
                                           service manager's fd store ("slab-<id>") */
        PoolDevice *device;
        SlabSpace *space;               /* the device's memory, or its host memory */
        bool host;                      /* host memory: a parked lease's content, never sent to a client */
        uint64_t size;                  /* a multiple of the granularity, at most the maximum slab */
        uid_t uid;                      /* whose data it may hold */
        SlabState state;
        CUmemGenericAllocationHandle handle;
        int fd;                         /* exported once, at creation */
        CUdeviceptr scrub_va;           /* the pool's own mapping, made ahead by pool_idle() or at its first zeroing
                                           or copy; 0 if none */
        CUevent zeroed;                 /* recorded after its last zeroing (a scrub, or in place:
                                           pool_scrub_leased()); NULL until the first */
        uint64_t scrub_seq;             /* which completion of the device's stream ends its scrub */
        uint64_t copy_ticket;           /* which completion of the device's copy stream ends the last copy from
                                           or into it (pool_copy_start()); 0: none */
        bool copy_failed;               /* as a copy's first dst slab: the last copy into it failed
                                           (pool_copy_result()) */
        char *copy_error;               /* and why, in the driver's words (NULL: no memory to say it) */
        CopyJob *copy_job;              /* the copy into it while pieces of it are still to be queued */
        bool release_after_copy;        /* given back while that copy ran: released (else reclaimed) after it */
        uint64_t zero_mark;             /* the device's zeroing queued in all (bytes, PoolDevice.zero_queued) once
                                           its last zeroing was queued: how much stands before it is this less
                                           what is known done */
        uint64_t last_used;             /* pool clock when it was last cached */
        CacheBucket *bucket;            /* while cached */
        List link_state;                /* in the leased list, the scrub queue or its cache bucket */
        List link_lru;                  /* in the device's least-recently-used list, while cached */
        uint64_t made_tick;             /* pool_tick()s before it was made or imported */
        List link_unmapped;             /* in the device's list of slabs the pool has no mapping of, while so */
        List link_made;                 /* in Pool.made_bound while cached bound to its user by its making
                                           (pool_make_host()), until pool_unbind_made() or its taking */
} Slab;

typedef struct PoolDeviceStats {
        int index;
        const char *name;
        uint64_t total;                 /* device memory */
        uint64_t granularity;
        int numa_node;                  /* the host NUMA node nearest the device, -1 when unknown */
        uint64_t capacity;
        uint64_t leased;                /* bytes in leased slabs */
        uint64_t scrubbing;             /* bytes being scrubbed */
        uint64_t cached;                /* bytes in cached slabs */
        unsigned n_leased, n_scrubbing, n_cached;
        /* counters since the pool started */
        uint64_t hits;                  /* slabs served from the cache */
        uint64_t created;               /* slabs created (each exported once) */
        uint64_t released;              /* device slabs released back to the driver */
        uint64_t evicted;               /* of those, cached slabs released to make room (host slabs are
                                           counted in neither) */
        uint64_t scrubs;                /* scrubs completed */
        uint64_t scrubbed_bytes;
        uint64_t primed;                /* unbound slabs created by pool_idle() */
        uint64_t scrub_waits;           /* requests that needed memory still scrubbing (waited if not done) */
        uint64_t driver_calls;          /* Driver API calls the pool made for this device */
        uint64_t mapped_ahead;          /* slabs the pool mapped for itself in pool_idle(), before a zeroing or
                                           copy needed the mapping */
        /* host memory for parked leases */
        uint64_t host_granularity;      /* 0: the device cannot park */
        uint64_t host_capacity;
        uint64_t parked;                /* bytes in leased host slabs: holding parked leases, or taken by parks
                                           being copied */
        uint64_t host_scrubbing;
        uint64_t host_cached;           /* zeroed host slabs kept for the next park */
        unsigned n_parked;
        uint64_t host_created;          /* host slabs created */
        uint64_t host_adopted;          /* host slabs of a previous run's cache taken back (pool_adopt_host()) */
        uint64_t copied_bytes;          /* queued on the copy stream, piece by piece (pool_copy_start()) */
        uint64_t after_copy;            /* slabs given back while a copy used them, given back after it */
        uint64_t copy_waits;            /* slab releases that waited for a copy still using the slab */
        uint64_t copies_dropped;        /* copies whose destination was all given back before their last piece
                                           was queued: the rest was not queued */
} PoolDeviceStats;

/*
 * Creates the pool: probes each device, retains its primary context, creates
 * its scrub stream and sets its capacity. Returns 0, -ENODEV/-EOPNOTSUPP/-EINVAL
 * with a sentence in *ret_message (malloc'd), or another negative errno.
 */
int pool_new(Pool **ret, CudaDriver *cu, const PoolConfig *config, char **ret_message);

/* Waits for scrubs in flight and releases every slab, leased or not. Accepts NULL. */
Pool *pool_free(Pool *p);

/*
 * Leases `size` bytes on `device` to `uid`: fills ret_slabs (room for
 * POOL_MAX_SLABS) in mapping order, largest first, and sets *ret_n. Cached
 * slabs of that uid are used first (one being scrubbed is waited for); the
 * rest are created. Slabs being scrubbed are room: when the device is full
 * only because of them, it waits for as many scrubs as it needs. Returns 0, a
 * POOL_E_* code, or a negative errno.
 */
int pool_alloc(Pool *p, int device, uint64_t size, uid_t uid, Slab **ret_slabs, size_t *ret_n);

#define POOL_WAIT_ANY UINT64_MAX        /* pool_alloc_bounded(): any wait for scrubs is made */

/*
 * pool_alloc(), waiting for scrubs only when the zeroing queued on the device's stream up to the last slab
 * it needs is at most `wait_max` bytes (such a wait holds the caller: about 0.3 ms per GiB); otherwise it
 * returns POOL_E_SCRUBBING with nothing changed but queued scrubs issued (as many as the device's stream has
 * room for), and the caller tries again once
 * scrubs have finished (pool_scrubs_finished() moved). POOL_WAIT_ANY: as pool_alloc().
 */
int pool_alloc_bounded(Pool *p, int device, uint64_t size, uid_t uid, uint64_t wait_max, Slab **ret_slabs,
                       size_t *ret_n);

/*
 * Takes a leased slab back: it is queued for scrubbing (counted as scrubbing from now on), scrubbed once
 * pool_scrub_queued() runs, then cached for its uid (or released if the scrub cannot start). A host slab is
 * cached for any uid once scrubbed.
 */
void pool_reclaim(Pool *p, Slab *slab);

/*
 * Issues the scrubs of the slabs pool_reclaim() queued. The daemon runs it a little after the reply that
 * freed them (manager.c, SCRUB_DELAY_USEC), so that a Free's answer does not wait for the scrub it starts and
 * the scrub does not run during the client's unmap; pool_alloc() runs it for its device before it waits for
 * a scrubbing slab or creates one, and pool_drain() before anything else. At most 16 are in flight on a
 * device (a stream's queue is bounded, and a launch on a full one blocks the caller): the others stay
 * queued, and pool_dispatch() issues them as completions come.
 */
void pool_scrub_queued(Pool *p);

/* Whether any slab waits in the queue for pool_scrub_queued(). */
bool pool_has_queued(const Pool *p);

/*
 * A count that moves when zeroing has finished: scrubs (their slabs cached, or released when a scrub could not
 * be issued) whichever way they were finished, by pool_dispatch(), or ahead of it by a request that waited for
 * them, or pool_drain(); and the completion pool_scrub_wait() queues after zeroings in place it did
 * not wait for. A caller that deferred requests for zeroing (POOL_E_SCRUBBING) tries them again when this has
 * moved.
 */
uint64_t pool_scrubs_finished(const Pool *p);

/*
 * `queued` is called whenever pool_reclaim() queues a slab into an empty queue, and at once when the queue is
 * not empty already: the daemon arms its scrub timer there (manager.c, SCRUB_DELAY_USEC). NULL: nobody is
 * told. It may call pool_scrub_queued().
 */
void pool_set_queued_hook(Pool *p, void (*queued)(void *userdata), void *userdata);

/*
 * Host slabs to park the content of `slabs` (n device slabs of one device, a lease's) in: each device slab cut
 * into host slabs of the host slab size (pool_host_slab()) and one of the rest, in the same order, zeroed cached
 * ones first, the rest created on the device's NUMA node (within the device's host capacity, releasing cached
 * host slabs to make room). Fills ret_host (room for POOL_MAX_HOST_SLABS), leased to `uid`, and *ret_n.
 * Host slabs still being zeroed are waited for as pool_alloc_bounded() waits, within `wait_max` (host memory is
 * zeroed at about 20 ms per GiB: its bytes count 64 times over); past it, POOL_E_SCRUBBING, nothing changed.
 * Returns 0, POOL_E_NO_HOST (also when the host granularity does not divide a slab's size),
 * POOL_E_HOST_NOMEM, POOL_E_SCRUBBING, POOL_E_DRIVER, POOL_E_NOT_KEPT, or a negative errno; on failure nothing
 * changed (but cached host slabs released).
 */
int pool_alloc_host(Pool *p, Slab *const *slabs, size_t n, uid_t uid, uint64_t wait_max, Slab **ret_host,
                    size_t *ret_n);

/*
 * Makes, off the daemon's loop, the host slabs that pool_alloc_host(p, slabs, n, uid) would have to create now: those
 * of the sizes it would cut `slabs` into (a lease's device slabs, of one device) that no cached host slab, nor one
 * being scrubbed, of that size and `uid` (or unbound) would give. Creating pinned host memory takes about 0.3 s per
 * GiB, which a request made in the loop would make every other client wait for. The pool's maker thread makes them one
 * at a time, users in turn and each user's calls in turn, and exports them; pool_dispatch() (the pool's eventfd) then
 * adds each to the host cache, cached for `uid` (new memory, zeroed: bound so that no other user's call takes it
 * first), and tells the slab_created hook; once the call's are all made, pool_host_made() moves and
 * pool_make_done(*ret_ticket) is true. Their room in the device's host capacity is taken from now (cached host slabs
 * released for it). Returns 0 when none need making (pool_alloc_host() will not create any, unless others of `uid` take
 * what it counted meanwhile); POOL_E_MAKING, the ticket in *ret_ticket (may be NULL), when their making has begun;
 * POOL_E_NO_HOST, POOL_E_HOST_NOMEM (no room for them), or a negative errno, nothing begun. A slab that fails to be
 * made is told through pool_last_error() when it is dispatched; pool_alloc_host() then tries, and fails, as before.
 */
int pool_make_host(Pool *p, Slab *const *slabs, size_t n, uid_t uid, uint64_t *ret_ticket);

/*
 * Makes, off the loop, the host slabs of the configured reserve (PoolConfig.host_reserve) that each device that
 * can park lacks: host slabs of the host slab size (pool_host_slab()), counted whatever they hold (parked
 * leases' too) and whoever they are cached for, up to the reserve and within the device's free host capacity
 * (nothing cached is released for it; room taken by slabs being made counts as used, but they are not counted as
 * the reserve's: the daemon calls it once, at start, when none are). Pinning host memory holds a lock of the
 * driver's for the whole host (every process's GPU allocations wait behind each slab), so the daemon does it
 * once, at start, rather than at the first parks of a busy host. They are then cached unbound
 * (pool_make_host()'s are cached for the caller's user), and used, evicted and trimmed like any. Returns how
 * many it asked for, or a negative errno (the maker thread could not start).
 */
int pool_reserve_host(Pool *p);

/* A count that moves each time the slabs of one pool_make_host() (one ticket) are all made (or failed): a caller
 * that waits for them looks again (pool_make_done()) when it has moved. */
uint64_t pool_host_made(const Pool *p);

/* Whether the slabs of pool_make_host()'s `ticket` are all made (or failed) and cached for its caller. */
bool pool_make_done(const Pool *p, uint64_t ticket);

/*
 * Whether a host slab of pool_make_host()'s `ticket` failed to be made (the driver refused, or memory ran out), once
 * pool_make_done(): a call that waited for that making tells so whether what it lacks now may be the driver's
 * refusal rather than what its user's other calls took; another user's failures say nothing about it. The last
 * POOL_FAILED_TICKETS such tickets are kept: one forgotten asks for its making again, which fails again and is
 * known then.
 */
bool pool_make_failed(const Pool *p, uint64_t ticket);

/*
 * Unbinds the host slabs still cached for the user they were made for (pool_make_host()) once nothing more is
 * being made for that user (every one of its tickets pool_make_done()): its calls, made again, have taken what
 * they needed by then, and what is left (a call went away: the client exited or the lease was freed while it
 * waited, or it needed less) is new memory that holds nobody's data, so any user's park may take it rather than
 * pin more while it waits, bound, for an eviction. Not sooner: a call made again takes its user's slabs whichever
 * of its calls they were made for. The daemon calls it after the calls waiting for the tickets done were made
 * again. Returns how many it unbound.
 */
unsigned pool_unbind_made(Pool *p);

/*
 * Takes back a host slab that a previous run of the daemon had cached (restore.c: its exported fd, stored at
 * exit under a name that says its device and size): imports it and caches it, unbound, as the reserve's are
 * (the hooks store it under its new id first). It was zeroed, or fresh from the driver, when that run cached
 * it, and nobody but that run and the service manager has held it since. Taken only into free room: never over
 * HostCapacity=, and nothing cached is released for it. The fd is the pool's in every case (closed on failure).
 * Returns 0, -ENODEV (no such device), POOL_E_NO_HOST, -EINVAL (a size this run's host slabs cannot have: over
 * HostSlab=, or not of the host granularity), -ENOSPC (no room), -ENOMEM,
 * POOL_E_DRIVER, or -EIO (it could not be stored, and was released); pool_last_error() says why.
 */
int pool_adopt_host(Pool *p, int device, int fd, uint64_t size);

/* Calls fn for each cached host slab of every device (its CUDA device index): what a stopping daemon keeps for
 * the next run (restore.c). fn must not change the pool. */
void pool_foreach_host_cached(Pool *p, void (*fn)(const Slab *slab, int device, void *userdata), void *userdata);

/* Whether pool device i has host memory for parking; when not, pool_last_error() says why. */
bool pool_has_host(Pool *p, size_t i);

/*
 * Copies the content of the src slabs, back to back, into the dst slabs, back to back (as many bytes as the smaller of
 * the two holds, by offset: the two may be cut differently), through the pool's own mappings, on the device's copy
 * stream, without waiting. The copy is queued in pieces of at most POOL_DEFAULT_COPY_PIECE bytes, a few on the
 * stream at once, and the next piece is the next user's in turn (`uid`: whose content it is), each user's copies in
 * turn: a small copy waits for the pieces on the stream, not for another user's whole copy (the device runs what
 * is queued in order). pool_dispatch() queues the next pieces as the stream finishes them; the pool's eventfd is
 * told of each. Every slab is of one device. pool_copy_result() on dst[0] says when the copy is done. The slabs
 * stay as they are, leased: whatever gives them back waits for the copy, off the loop (pool_reclaim(),
 * pool_release()), and the scrub of a slab that waited is queued after it. Returns 0, -EINVAL (no slabs), -ENOMEM,
 * or POOL_E_DRIVER (its first piece could not be queued; pool_last_error() says why; nothing is left in flight).
 */
int pool_copy_start(Pool *p, uid_t uid, Slab *const *dst, size_t n_dst, Slab *const *src, size_t n_src);

/*
 * Of the copy into `slab` (the first dst slab of pool_copy_start()'s, until its next copy): POOL_E_COPYING while it
 * runs, 0 once it is done, POOL_E_DRIVER once it failed (a later piece could not be queued; what was queued is done,
 * and the dst slabs hold part of the content at most). On POOL_E_DRIVER pool_last_error() says why that copy failed,
 * whatever failed in the pool since.
 */
int pool_copy_result(Pool *p, const Slab *slab);

/*
 * Told of every slab the pool creates (after its export) and releases (before its fd is closed), so that
 * the daemon can keep slab fds in the service manager's fd store across a restart. When slab_created
 * fails (a negative errno), the slab is released and the request that needed it fails with POOL_E_NOT_KEPT.
 */
typedef struct PoolHooks {
        int (*slab_created)(const Slab *slab, void *userdata);
        void (*slab_released)(const Slab *slab, void *userdata);
} PoolHooks;

void pool_set_hooks(Pool *p, const PoolHooks *hooks, void *userdata);

/*
 * Takes back a slab of a previous run of the daemon from its exported fd (ownership passes to the pool on
 * success): imports it, and adds it as leased to `uid`, with its id (later slabs get higher ids). The
 * hooks are not told: it is in the store already. The id must not be one the pool has (restore.c takes each
 * stored fd once, and a table that names a slab twice is refused whole): checking would cost a walk of the
 * pool per slab, O(n^2) for a start with n leases. `host`: a host slab (a parked lease's), which must be a
 * multiple of the host granularity. Returns 0, -EINVAL (wrong size, device or id), -ENOMEM, or
 * POOL_E_DRIVER (pool_last_error() says why), and on failure the fd is still the caller's.
 */
int pool_import(Pool *p, int device, uint64_t id, int fd, uint64_t size, uid_t uid, bool host, Slab **ret);

/* Takes a leased slab back and releases it to the driver at once, without caching it: for slabs another
 * user may have held. */
void pool_release(Pool *p, Slab *slab);

/*
 * Zeroes a leased device slab in place, on the device's stream, leaving it leased: for a lease kept for its
 * process (broker.h), whose mapping of it stays. An event recorded after it (Slab.zeroed) says when it is
 * done: no completion goes through the driver's host-function thread, whose wake-up on a busy VM took longer
 * than the zeroing itself. pool_scrub_wait() waits for it. Returns 0, -EINVAL for a slab that is not a
 * leased device slab, or POOL_E_DRIVER (pool_last_error() says why) when the zeroing could not be queued.
 */
int pool_scrub_leased(Pool *p, Slab *slab);

/*
 * Waits for the zeroings pool_scrub_leased() last queued for `slabs` (one lease's, in the order they were
 * queued), as pool_alloc_bounded() waits for scrubs: when one is not done and the zeroing queued on the
 * device's stream up to the last of them is more than `wait_max` bytes (any user's, scrubs and zeroings in
 * place alike), nothing is waited for. Then a completion is made to follow them on the stream, so that
 * pool_scrubs_finished() moves once they are done, and it returns POOL_E_SCRUBBING: try again then. Returns 0,
 * POOL_E_SCRUBBING, or POOL_E_DRIVER (pool_last_error() says why): the memory may not be zero.
 */
int pool_scrub_wait(Pool *p, Slab *const *slabs, size_t n, uint64_t wait_max);

/* An eventfd that becomes readable when scrubs have completed; then call pool_dispatch(). */
int pool_get_fd(Pool *p);

/* Moves slabs whose scrub has completed into the cache, and issues the scrubs held back for room on the
 * stream (pool_scrub_queued()). Returns how many slabs it cached. */
unsigned pool_dispatch(Pool *p);

/* Issues the queued scrubs, blocks until every scrub in flight has completed and every host slab being made
 * (pool_make_host()) is made, then dispatches them. Not for the daemon's loop: it waits for pinning. Returns
 * 0 or a negative errno. */
int pool_drain(Pool *p);

/*
 * Work the pool keeps out of requests; the daemon calls it when it has nothing else to do. It closes the
 * exported fds of released slabs (which frees their memory) and, when it closed any, creates one unbound slab
 * of the smallest size, the granularity: closing an exported fd makes the driver's next export slow, and that
 * export is better paid here than in a client's request. It also maps ahead, for the pool, one slab made or
 * imported before the last pool_tick() but one (MAP_AHEAD_TICKS) that it has no mapping of yet: a slab's first
 * scrub or copy would otherwise map it in a request's or a scrub's dispatch (about 1 ms per GiB of device
 * memory and 10 ms per GiB of host memory, on an H200), holding every other client for a whole lease's worth.
 * One slab per call, so that requests are served between them. Queued scrubs are not its work: their time is
 * the daemon's (pool_scrub_queued()). Returns true if it did anything.
 */
bool pool_idle(Pool *p);

/* Whether pool_idle() has anything to do: fds of released slabs to close, a slab to prime, or one to map
 * ahead. Each call of pool_idle() makes progress: a caller may call it again while this is true. */
bool pool_has_idle_work(const Pool *p);

/* Counts a tick of the daemon's clock (once a second): slabs are mapped ahead MAP_AHEAD_TICKS ticks after
 * they were made, once their client has mapped them (the two mappings at once would contend in the driver). */
void pool_tick(Pool *p);

/* Releases every cached slab on every device back to the driver. Returns how many. */
unsigned pool_trim(Pool *p);

/* The devices served, in configuration order. */
size_t pool_n_devices(Pool *p);
void pool_device_stats(Pool *p, size_t i, PoolDeviceStats *ret);

/* Makes the context of device i (pool_device_stats() order) current on this thread, for callers that
 * touch the device's memory themselves. Returns 0 or -EIO (see pool_last_error()). */
int pool_use_device(Pool *p, size_t i);

/* Index into pool_device_stats() order for a CUDA device index, or -1. */
int pool_find_device(Pool *p, int device);

/* The last driver failure, "cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY", for POOL_E_DRIVER and POOL_E_NOMEM. */
const char *pool_last_error(Pool *p);

/* Makes pool_last_error() say `message` again: a failure the pool said earlier, kept by whoever answers it later
 * (Lease.move_message, a move's copy that failed). */
void pool_restate_error(Pool *p, const char *message);

/* The requested size rounded up to the granularity, split into the slab sizes that serve it: whole maximum
 * slabs, then one slab of the rest.
 * Returns the number of slabs (which may exceed POOL_MAX_SLABS: the caller checks), or 0 if size is 0 or
 * overflows. sizes may be NULL to only count; otherwise it has room for max_sizes entries. */
size_t pool_plan(uint64_t size, uint64_t granularity, uint64_t max_slab, uint64_t *sizes, size_t max_sizes);

const char *pool_strerror(int r);
