/* SPDX-License-Identifier: MIT */

#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "fdpass.h"
#include "hashmap.h"
#include "macro.h"
#include "message.h"
#include "pool.h"
#include "size.h"

/* What a cached slab is found by: its size and the uid whose data it may hold. */
typedef struct BucketKey {
        uint64_t size;
        uid_t uid;
} BucketKey;

/* Free slabs of one size that may be handed to one uid; most recently cached first. */
struct CacheBucket {
        BucketKey key;
        unsigned n;
        List slabs;
        HashLink link;          /* in PoolDevice.cache */
};

/* The slabs of one kind of memory of a device: its own, or host memory for parked leases. */
struct SlabSpace {
        PoolDevice *device;
        bool host;
        uint64_t granularity;           /* 0: none (a device that cannot park has no host space) */
        uint64_t capacity;
        uint64_t created_bytes;         /* every live slab: leased, scrubbing or cached */
        HashMap cache;                  /* CacheBucket by (size, uid), one per size and uid with cached slabs */
        List lru;                       /* cached Slab, least recently used first */
        List leased;                    /* Slab handed out (host: holding a parked lease) */
        uint64_t leased_bytes, scrubbing_bytes, cached_bytes;
        unsigned n_leased, n_scrubbing, n_cached;
        uint64_t making_bytes;          /* host slabs being made by the maker thread (pool_make_host()): room
                                           taken, not created yet */
};

/*
 * A place in a queue served a piece at a time, users in turn (turns_rotate()): the maker thread's requests
 * (MakeRequest) and the copy stream's copies (CopyJob).
 */
typedef struct Turn {
        uid_t uid;
        List link;
} Turn;

/*
 * One call's host slabs to make off the loop (pool_make_host(), or a batch of pool_reserve_host()'s), under a
 * ticket its caller waits for (pool_make_done()). The maker thread takes one job at a time, users in turn and
 * each user's requests in turn (turns_rotate()), so that a park of a few slabs is not made after all of
 * another's (an 8 GiB first park pins for 2.3 s on an H200), nor after one job of each of many parks of one
 * user. `todo` and `turn.link` are under Pool.make_lock; `left` and `link_live` belong to the loop.
 */
typedef struct MakeRequest {
        uint64_t ticket;
        Turn turn;                      /* in Pool.make_queue while `todo` is not empty; uid: whom its slabs are
                                           cached for (UID_UNBOUND: the reserve's) */
        List todo;                      /* its MakeJobs not taken by the maker thread yet */
        unsigned left;                  /* its jobs not finished (makes_finish()) yet */
        bool failed;                    /* one of them failed to be made (pool_make_failed()) */
        List link_live;                 /* in Pool.make_live until `left` is 0 */
        HashLink link_ticket;           /* in Pool.live_tickets while in make_live */
} MakeRequest;

/*
 * A host slab made off the loop (pool_make_host()): the maker thread makes and exports it, pool_dispatch()
 * adds it to the pool. Only `link` is shared, under Pool.make_lock; the rest belongs to whichever side has the
 * job in its list.
 */
typedef struct MakeJob {
        MakeRequest *request;
        PoolDevice *dev;
        uint64_t size;
        CUmemGenericAllocationHandle handle;
        int fd;
        CUdeviceptr va;                 /* the pool's mapping of it (Slab.scrub_va), or 0: made in the loop later */
        CUresult result;                /* of the call that failed, when `failed` */
        const char *failed;             /* the call that failed, or NULL */
        unsigned calls;                 /* driver calls made, for PoolDeviceStats.driver_calls */
        List link;                      /* in its MakeRequest.todo, then Pool.make_done */
} MakeJob;

struct PoolDevice {
        Pool *pool;
        CudaDeviceInfo info;
        CUcontext ctx;
        CUstream stream;                /* the scrub and copy stream */
        SlabSpace mem;                  /* the device's memory */
        SlabSpace host;                 /* host memory on its NUMA node, for parked leases */
        List queued;                    /* Slab of either space reclaimed, its scrub not issued yet: in reclaim
                                           order, SLAB_SCRUBBING and counted so (pool_scrub_queued()) */
        List scrubbing;                 /* Slab of either space, in stream order */
        List unmapped;                  /* Slab of either space that the pool has no mapping of, oldest first:
                                           mapped ahead by pool_idle() (map_ahead()) */
        CUstream copy_stream;           /* the copies of parks and unparks (pool_copy_start()): not behind scrubs,
                                           and no scrub behind them */
        List copies;                    /* CopyJobs with pieces left to queue, in turn (copy_pump()) */
        uid_t copy_last_uid;            /* whose piece was queued last (turns_next()) */
        CUevent piece_copied;           /* recorded on copy_stream after each piece, for notify_stream */
        CUstream notify_stream;         /* each piece's completion (copy_done()), after piece_copied: not on
                                           copy_stream, where a host function holds the copies queued behind it
                                           until the driver's thread has run it */
        uint64_t copies_issued;         /* pieces queued on copy_stream, each with its completion (copy_done()) */
        _Atomic uint64_t copies_done;   /* of those, reached: written by the driver's thread */
        uint64_t copies_dispatched;     /* copies_done when pool_dispatch() last looked */
        List after_copy;                /* leased Slab given back (pool_reclaim(), pool_release()) while a copy
                                           still uses it: given back for good once the copy is done */
        uint64_t scrubs_issued;         /* completions queued on the stream (scrub_done()) */
        _Atomic uint64_t scrubs_done;   /* of those, reached: written by the driver's thread */
        uint64_t scrubs_dispatched;     /* scrubs_done when pool_dispatch() last looked */
        bool scrubs_held;               /* device_scrub_queued() left scrubs queued for want of room on the
                                           stream: pool_dispatch() issues them as completions come */
        uint64_t zero_queued;           /* bytes of zeroing ever queued on the stream, scrubs and in place, host
                                           memory's HOST_ZERO_WEIGHT times over (zero_cost()) */
        uint64_t zero_done;             /* of those, the bytes up to the last zeroing known done (its
                                           Slab.zero_mark): the stream zeroes in order */
        uint64_t completion_mark;       /* zero_queued when the last completion was queued */
        PoolDeviceStats stats;
};

struct Pool {
        CudaDriver *cu;
        uint64_t max_slab;
        PoolDevice *devices;
        size_t n_devices;
        uint64_t clock;                 /* orders cached slabs for LRU */
        uint64_t ticks;                 /* pool_tick()s: when slabs are mapped ahead */
        uint64_t host_reserve;          /* host bytes per device made at start (pool_reserve_host()) */
        uint64_t host_slab;             /* the largest host slab (pool_host_slab()) */
        uint64_t copy_piece;            /* the most bytes of a copy queued at once (CopyJob) */
        uint64_t scrubs_finished;       /* moves when zeroing has finished, by any path: pool_scrubs_finished() */
        uint64_t last_slab_id;          /* the id of the last slab created */
        int event_fd;
        int *closing;                   /* exported fds of released slabs, closed by pool_idle() */
        size_t n_closing, n_closing_alloc;
        bool prime;                     /* an exported fd was closed since the last export */
        unsigned n_queued;              /* slabs on the devices' `queued` lists */
        void (*queued)(void *userdata); /* told when n_queued leaves 0 (pool_set_queued_hook()) */
        void *queued_userdata;
        PoolHooks hooks;
        void *hooks_userdata;
        char last_error[256];

        /* The maker thread (pool_make_host()): pinning host memory takes about 0.3 s per GiB, which the loop
         * does not wait for. It runs while it has jobs, and ends when it has none: no thread is left idle. */
        pthread_t maker;
        bool maker_joinable;            /* `maker` was started and not joined yet (it may have ended) */
        pthread_mutex_t make_lock;
        List make_queue;                /* MakeRequests with jobs to take, in turn; under make_lock */
        List make_done;                 /* MakeJobs made (or failed), under make_lock */
        bool maker_running;             /* under make_lock: it takes the jobs in make_queue; false once it ends */
        bool make_quit;                 /* under make_lock */
        List make_live;                 /* MakeRequests not finished (the loop's): host slabs are being made while it
                                           is not empty (pool_making()) */
        HashMap live_tickets;           /* the same by ticket: pool_make_done() in O(1), for each waiting call each
                                           time a request finishes */
        uint64_t last_ticket;           /* of the last MakeRequest */
        uint64_t failed_tickets[POOL_FAILED_TICKETS];   /* the last requests of which a slab failed to be made,
                                                           a ring (pool_make_failed()) */
        unsigned n_failed_tickets;      /* ever put in it */
        List made_bound;                /* cached host Slabs bound to a user by their making (Slab.link_made) */
        uint64_t host_made;             /* moves when a request's jobs are all finished (pool_host_made()) */
};

static const void *request_ticket(const HashLink *link) {
        return &container_of(link, MakeRequest, link_ticket)->ticket;
}

static const HashMapType request_by_ticket = { request_ticket, hashmap_hash_u64, hashmap_equal_u64 };

/* A request is live from its making's start until its last job is finished: in make_live and live_tickets. */
static void request_live(Pool *p, MakeRequest *req) {
        list_link_tail(&p->make_live, &req->link_live);
        hashmap_add(&p->live_tickets, &req->link_ticket);
}

static void request_unlive(Pool *p, MakeRequest *req) {
        list_unlink(&req->link_live);
        hashmap_remove(&p->live_tickets, &req->link_ticket);
}

/* Whether host slabs are being made off the loop: asked for and not yet dispatched (every job is of a live
 * request until makes_finish() has counted it). */
static bool pool_making(const Pool *p) {
        return !list_is_empty(&p->make_live);
}

/* Every Driver API call of the pool goes through this, so stats.driver_calls counts them. */
#define DRV(dev, fn) ((dev)->stats.driver_calls++, (dev)->pool->cu->fn)

_printf_(2, 3) static void set_error(Pool *p, const char *fmt, ...) {
        va_list ap;

        va_start(ap, fmt);
        vsnprintf(p->last_error, sizeof(p->last_error), fmt, ap);
        va_end(ap);
}

static void driver_error(PoolDevice *dev, const char *call, CUresult r) {
        set_error(dev->pool, "%s on device %d: %s", call, dev->info.index, cuda_result_name(dev->pool->cu, r));
}

const char *pool_last_error(Pool *p) {
        return p->last_error;
}

void pool_restate_error(Pool *p, const char *message) {
        set_error(p, "%s", message);
}

const char *pool_strerror(int r) {
        switch (r) {
        case 0:
                return "success";
        case POOL_E_NOMEM:
                return "out of device memory";
        case POOL_E_TOO_LARGE:
                return "request larger than the device can serve";
        case POOL_E_NO_DEVICE:
                return "no such device";
        case POOL_E_DRIVER:
                return "driver failure";
        case POOL_E_NOT_KEPT:
                return "slab not kept across a restart";
        default:
                return r < 0 ? strerror(-r) : "unknown pool error";
        }
}

size_t pool_plan(uint64_t size, uint64_t granularity, uint64_t max_slab, uint64_t *sizes, size_t max_sizes) {
        uint64_t rest;
        size_t n = 0;

        if (size == 0 || size > UINT64_MAX - granularity)
                return 0;
        size = ALIGN_UP(size, granularity);

        for (uint64_t k = size / max_slab; k > 0; k--, n++)
                if (sizes && n < max_sizes)
                        sizes[n] = max_slab;
        rest = size % max_slab;
        if (rest > 0) {
                if (sizes && n < max_sizes)
                        sizes[n] = rest;
                n++;
        }
        return n;
}

uint64_t pool_host_slab(uint64_t max_slab, uint64_t host_slab) {
        if (host_slab == 0)
                host_slab = MAX(POOL_DEFAULT_HOST_SLAB, max_slab / POOL_HOST_PIECES_MAX);
        return MIN(host_slab, max_slab);
}

/* Stream work needs the device's context current on this thread. (Callers may switch it, so always set it.) */
static int make_current(PoolDevice *dev) {
        CUresult r = DRV(dev, cuCtxSetCurrent)(dev->ctx);

        if (r != CUDA_SUCCESS) {
                driver_error(dev, "cuCtxSetCurrent", r);
                return -EIO;
        }
        return 0;
}

/* --- the cache ------------------------------------------------------------------------------------------ */

static const void *bucket_key(const HashLink *link) {
        return &container_of(link, CacheBucket, link)->key;
}

static uint64_t bucket_hash(const void *key) {
        const BucketKey *k = key;
        /* sizes are multiples of the granularity and uids 32 bits: this is one-to-one for a given uid */
        uint64_t u = k->size ^ ((uint64_t)k->uid * UINT64_C(0x9e3779b97f4a7c15));

        return hashmap_hash_u64(&u);
}

static bool bucket_equal(const void *a, const void *b) {
        const BucketKey *x = a, *y = b;

        return x->size == y->size && x->uid == y->uid;
}

static const HashMapType bucket_type = { .key = bucket_key, .hash = bucket_hash, .equal = bucket_equal };

static CacheBucket *bucket_find(SlabSpace *space, uint64_t size, uid_t uid) {
        BucketKey key = { .size = size, .uid = uid };
        HashLink *link = hashmap_find(&space->cache, &key);

        return link ? container_of(link, CacheBucket, link) : NULL;
}

/*
 * Links a slab into the device's LRU list, which is ordered by last_used, oldest
 * first. A slab cached now goes to the end at once; one put back after a failed
 * request finds its old place again.
 */
static void lru_insert(SlabSpace *space, Slab *slab) {
        List *pos = &space->lru;        /* insert before pos */

        for (List *l = space->lru.prev; l != &space->lru; l = l->prev) {
                if (list_entry(l, Slab, link_lru)->last_used <= slab->last_used) {
                        pos = l->next;
                        break;
                }
                pos = l;
        }
        list_link_between(&slab->link_lru, pos->prev, pos);
}

/* Puts a zeroed slab into its uid's bucket, as the most recently used. */
static int cache_insert(Slab *slab) {
        SlabSpace *space = slab->space;
        CacheBucket *b = bucket_find(space, slab->size, slab->uid);

        if (!b) {
                b = calloc(1, sizeof(*b));
                if (!b)
                        return -ENOMEM;
                b->key = (BucketKey){ .size = slab->size, .uid = slab->uid };
                list_init(&b->slabs);
                hashmap_add(&space->cache, &b->link);
        }
        slab->state = SLAB_CACHED;
        slab->bucket = b;
        list_link_front(&b->slabs, &slab->link_state);
        b->n++;

        lru_insert(space, slab);

        space->cached_bytes += slab->size;
        space->n_cached++;
        return 0;
}

static void cache_remove(Slab *slab) {
        SlabSpace *space = slab->space;
        CacheBucket *b = slab->bucket;

        list_unlink(&slab->link_state);
        list_unlink(&slab->link_lru);
        list_unlink(&slab->link_made);          /* taken or released: no longer bound by its making */
        slab->bucket = NULL;
        space->cached_bytes -= slab->size;
        space->n_cached--;
        if (--b->n == 0) {
                hashmap_remove(&space->cache, &b->link);
                free(b);
        }
}

/* --- slabs ---------------------------------------------------------------------------------------------- */

/*
 * Closes the exported fds of released slabs. Closing an exported fd makes the
 * driver's next export in this process slow (550-800 us instead of 15 us on an
 * H200, docs/pool.md), so the pool closes them outside requests, in
 * pool_idle(), or when the driver needs the memory back.
 */
static unsigned flush_closes(Pool *p) {
        unsigned n = (unsigned)p->n_closing;

        close_many(p->closing, p->n_closing);
        p->n_closing = 0;
        if (n > 0)
                p->prime = true;
        return n;
}

static void defer_close(Pool *p, int fd) {
        if (p->n_closing == p->n_closing_alloc) {
                size_t m = p->n_closing_alloc ? p->n_closing_alloc * 2 : 16;
                int *c = reallocarray(p->closing, m, sizeof(int));

                if (!c) {
                        safe_close(fd);
                        p->prime = true;
                        return;
                }
                p->closing = c;
                p->n_closing_alloc = m;
        }
        p->closing[p->n_closing++] = fd;
}

/* Whether a copy may still use the slab's memory (Slab.copy_ticket, of the device's copy stream; COPY_PENDING while
 * its copy has pieces left to queue). */
static bool slab_copying(const PoolDevice *dev, const Slab *slab) {
        return slab->copy_ticket > atomic_load_explicit(&dev->copies_done, memory_order_acquire);
}

static void copy_pump(PoolDevice *dev, bool all);
static void copy_dst_gone(PoolDevice *dev, CopyJob *job);

/* Waits for the copies queued, and for their completions (copy_done()): the first failure, or CUDA_SUCCESS. */
static CUresult copies_sync(PoolDevice *dev) {
        CUresult r = DRV(dev, cuStreamSynchronize)(dev->copy_stream), n;

        n = DRV(dev, cuStreamSynchronize)(dev->notify_stream);
        return r != CUDA_SUCCESS ? r : n;
}

/* Waits for whatever copy still uses the slab's memory: its release must not unmap it under the copy, which
 * would fault the stream for good. pool_reclaim() and pool_release() wait for nothing (slab_after_copy());
 * this guards the paths that cannot meet such a slab. */
static void slab_wait_copy(PoolDevice *dev, const Slab *slab) {
        if (slab_copying(dev, slab)) {
                dev->stats.copy_waits++;
                copy_pump(dev, true);
                (void)copies_sync(dev);
        }
}

/*
 * Gives a slab back to the driver. The slab must not be on any list. Its
 * memory is freed when its exported fd is closed (flush_closes()).
 */
static void slab_release(Slab *slab) {
        PoolDevice *dev = slab->device;

        if (dev->pool->hooks.slab_released)
                dev->pool->hooks.slab_released(slab, dev->pool->hooks_userdata);
        list_unlink(&slab->link_unmapped);
        slab_wait_copy(dev, slab);
        if (slab->zeroed) {
                /* A zeroing in place may still run on the pool's mapping: unmapping under it would fault the
                 * stream, for good. */
                (void)DRV(dev, cuEventSynchronize)(slab->zeroed);
                (void)DRV(dev, cuEventDestroy)(slab->zeroed);
        }
        if (slab->scrub_va) {
                (void)DRV(dev, cuMemUnmap)(slab->scrub_va, slab->size);
                (void)DRV(dev, cuMemAddressFree)(slab->scrub_va, slab->size);
        }
        (void)DRV(dev, cuMemRelease)(slab->handle);
        defer_close(dev->pool, slab->fd);
        slab->space->created_bytes -= slab->size;
        if (!slab->host)
                dev->stats.released++;          /* device slabs: the metric's */
        free(slab->copy_error);
        free(slab);
}

/* Releases the least recently used cached slab. Returns false if the cache is empty. */
static bool release_oldest(SlabSpace *space) {
        Slab *slab = list_first_entry(&space->lru, Slab, link_lru);

        if (!slab)
                return false;
        cache_remove(slab);
        slab_release(slab);
        return true;
}

/* The same, to make room for a request. Counted for device slabs only, as `released` is (PoolDeviceStats). */
static bool evict_one(SlabSpace *space) {
        if (!release_oldest(space))
                return false;
        if (!space->host)
                space->device->stats.evicted++;
        return true;
}

/* Fills in a slab just made or imported; it counts against its space's capacity from now on. */
static void slab_init(SlabSpace *space, Slab *slab, uint64_t id, int fd, uint64_t size, uid_t uid) {
        slab->id = id;
        slab->device = space->device;
        slab->space = space;
        slab->host = space->host;
        slab->size = size;
        slab->uid = uid;
        slab->state = SLAB_LEASED;
        slab->fd = fd;
        list_init(&slab->link_state);
        list_init(&slab->link_lru);
        list_init(&slab->link_unmapped);
        slab->made_tick = space->device->pool->ticks;
        if (!slab->scrub_va)
                list_link_tail(&space->device->unmapped, &slab->link_unmapped);
        space->created_bytes += size;
}

/*
 * Creates and exports one slab: one cuMemCreate and one export. When the
 * driver is out of memory, cached slabs are released (oldest first) and the
 * create is tried again.
 */
static int slab_create(SlabSpace *space, uint64_t size, uid_t uid, Slab **ret) {
        PoolDevice *dev = space->device;
        CUmemAllocationProp prop = space->host ? cuda_host_prop(dev->info.numa_node)
                                               : cuda_slab_prop(dev->info.device);
        _cleanup_free_ Slab *slab = NULL;
        CUresult r;
        int fd = -EBADF;

        slab = calloc(1, sizeof(*slab));
        if (!slab)
                return -ENOMEM;

        for (;;) {
                r = DRV(dev, cuMemCreate)(&slab->handle, size, &prop, 0);
                if (r != CUDA_ERROR_OUT_OF_MEMORY)
                        break;
                /* Released slabs hold their memory until their fds are closed; then make more room. */
                if (flush_closes(dev->pool) == 0 && !evict_one(space))
                        break;
        }
        if (r != CUDA_SUCCESS) {
                driver_error(dev, space->host ? "cuMemCreate (host memory)" : "cuMemCreate", r);
                if (r == CUDA_ERROR_OUT_OF_MEMORY)
                        return space->host ? POOL_E_HOST_NOMEM : POOL_E_NOMEM;
                return POOL_E_DRIVER;
        }
        r = DRV(dev, cuMemExportToShareableHandle)(&fd, slab->handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
        dev->pool->prime = false;
        if (r != CUDA_SUCCESS) {
                driver_error(dev, "cuMemExportToShareableHandle", r);
                (void)DRV(dev, cuMemRelease)(slab->handle);
                return POOL_E_DRIVER;
        }

        slab_init(space, slab, ++dev->pool->last_slab_id, fd, size, uid);
        if (space->host)
                dev->stats.host_created++;
        else
                dev->stats.created++;
        if (dev->pool->hooks.slab_created && dev->pool->hooks.slab_created(slab, dev->pool->hooks_userdata) < 0) {
                /* A slab the daemon could not keep across a restart is not handed out: a crash would lose it. */
                snprintf(dev->pool->last_error, sizeof(dev->pool->last_error),
                         "slab %" PRIu64 " could not be kept in the service manager's fd store", slab->id);
                slab_release(TAKE_PTR(slab));
                return POOL_E_NOT_KEPT;
        }
        *ret = TAKE_PTR(slab);
        return 0;
}

/*
 * The pool's own mapping of an allocation, read-write for the device: reserve, map, set access, counting the
 * driver calls into *calls (the maker thread may not touch the device's stats). On failure *ret_failed names
 * the call, and nothing is left reserved or mapped.
 */
static CUresult mapping_make(CudaDriver *cu, const PoolDevice *dev, CUmemGenericAllocationHandle handle,
                             uint64_t size, CUdeviceptr *ret_va, const char **ret_failed, unsigned *calls) {
        CUmemAccessDesc access = {
                .location = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = dev->info.device },
                .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        CUdeviceptr va = 0;
        CUresult r;

        (*calls)++;
        r = cu->cuMemAddressReserve(&va, size, cuda_slab_alignment(size), 0, 0);
        if (r != CUDA_SUCCESS) {
                *ret_failed = "cuMemAddressReserve";
                return r;
        }
        (*calls)++;
        r = cu->cuMemMap(va, size, 0, handle, 0);
        if (r == CUDA_SUCCESS) {
                (*calls)++;
                r = cu->cuMemSetAccess(va, size, &access, 1);
                if (r != CUDA_SUCCESS) {
                        *ret_failed = "cuMemSetAccess";
                        (*calls)++;
                        (void)cu->cuMemUnmap(va, size);
                }
        } else
                *ret_failed = "cuMemMap";
        if (r != CUDA_SUCCESS) {
                (*calls)++;
                (void)cu->cuMemAddressFree(va, size);
                return r;
        }
        *ret_va = va;
        return CUDA_SUCCESS;
}

/* Maps the slab for the pool (its zeroing and copies), once. 0 or -EIO. */
static int slab_map(PoolDevice *dev, Slab *slab) {
        const char *failed = NULL;
        unsigned calls = 0;
        CUresult r;

        if (slab->scrub_va)
                return 0;
        r = mapping_make(dev->pool->cu, dev, slab->handle, slab->size, &slab->scrub_va, &failed, &calls);
        dev->stats.driver_calls += calls;
        if (r != CUDA_SUCCESS) {
                driver_error(dev, failed, r);
                return -EIO;
        }
        list_unlink(&slab->link_unmapped);
        return 0;
}

/* Runs on the driver's thread when the stream reaches it: no Driver API calls here. */
static void scrub_done(void *userdata) {
        PoolDevice *dev = userdata;
        uint64_t one = 1;

        atomic_fetch_add_explicit(&dev->scrubs_done, 1, memory_order_release);
        (void)!write(dev->pool->event_fd, &one, sizeof(one));
}

/*
 * Zeroing is counted in what device memory's takes (zeroing_ahead()): the device zeroes its own memory at
 * about 0.3 ms per GiB and host memory, over the bus, at about 20 ms per GiB (an H200's scrubs, measured:
 * docs/performance.md, "A measured stall"), so a host slab counts HOST_ZERO_WEIGHT times its bytes. A wait
 * bounded by ScrubWaitBytes= is then a bound on time whichever memory stands ahead.
 */
#define HOST_ZERO_WEIGHT 64

static uint64_t zero_cost(const Slab *slab) {
        return slab->host ? slab->size * HOST_ZERO_WEIGHT : slab->size;
}

/* Queues the zeroing of a slab on the device's stream, through the pool's own mapping of it. */
static int slab_zero(PoolDevice *dev, Slab *slab) {
        CUresult r;
        int k;

        k = make_current(dev);
        if (k < 0)
                return k;
        k = slab_map(dev, slab);
        if (k < 0)
                return k;
        r = DRV(dev, cuMemsetD8Async)(slab->scrub_va, 0, slab->size, dev->stream);
        if (r != CUDA_SUCCESS) {
                driver_error(dev, "cuMemsetD8Async", r);
                return -EIO;
        }
        dev->zero_queued += zero_cost(slab);
        slab->zero_mark = dev->zero_queued;
        return 0;
}

/* `slab`'s last zeroing is done, and so every one queued before it. */
static void zeroed_through(PoolDevice *dev, const Slab *slab) {
        dev->zero_done = MAX(dev->zero_done, slab->zero_mark);
}

/* The bytes of zeroing on the device's stream up to and including `slab`'s last that may not be done yet, in
 * device memory's bytes (zero_cost()). */
static uint64_t zeroing_ahead(const PoolDevice *dev, const Slab *slab) {
        return slab->zero_mark > dev->zero_done ? slab->zero_mark - dev->zero_done : 0;
}

/* Queues a completion callback (scrub_done()) on the device's stream, after all that is queued there. 0 or
 * -EIO. */
static int completion_queue(PoolDevice *dev) {
        CUresult r = DRV(dev, cuLaunchHostFunc)(dev->stream, scrub_done, dev);

        if (r != CUDA_SUCCESS) {
                driver_error(dev, "cuLaunchHostFunc", r);
                return -EIO;
        }
        dev->scrubs_issued++;
        dev->completion_mark = dev->zero_queued;
        return 0;
}

/*
 * Records the slab's event (Slab.zeroed, created at its first use) on the device's stream, after the zeroing
 * queued last: it says when that zeroing is done without waiting for anything queued after it. 0 or -EIO.
 */
static int slab_record_zeroed(PoolDevice *dev, Slab *slab) {
        CUresult r;

        if (!slab->zeroed) {
                r = DRV(dev, cuEventCreate)(&slab->zeroed, CU_EVENT_DISABLE_TIMING);
                if (r != CUDA_SUCCESS) {
                        slab->zeroed = NULL;
                        driver_error(dev, "cuEventCreate", r);
                        return -EIO;
                }
        }
        r = DRV(dev, cuEventRecord)(slab->zeroed, dev->stream);
        if (r != CUDA_SUCCESS) {
                driver_error(dev, "cuEventRecord", r);
                return -EIO;
        }
        return 0;
}

/*
 * Queues the zeroing of a slab on the device's stream, then its event (so that a request of its size and uid
 * can wait for this one zeroing: cache_take_or_wait()), then a completion callback.
 */
static int slab_scrub(PoolDevice *dev, Slab *slab) {
        int k;

        k = slab_zero(dev, slab);
        if (k < 0)
                return k;
        if (slab_record_zeroed(dev, slab) < 0) {
                /* Queued, but its event says nothing: wait for it, and give up the slab. */
                (void)DRV(dev, cuStreamSynchronize)(dev->stream);
                return -EIO;
        }
        if (completion_queue(dev) < 0) {
                /* The memset is queued but nothing will tell us when it is done: wait for it, then give up the
                 * slab rather than trust a scrub we did not see complete. */
                (void)DRV(dev, cuStreamSynchronize)(dev->stream);
                return -EIO;
        }
        slab->scrub_seq = dev->scrubs_issued;
        return 0;
}

/* Takes a slab off the leased list. Returns false if it was not leased. */
static bool slab_unlease(Slab *slab) {
        if (slab->state != SLAB_LEASED)
                return false;
        list_unlink(&slab->link_state);
        slab->space->leased_bytes -= slab->size;
        slab->space->n_leased--;
        return true;
}

/* Puts a slab on its space's leased list. */
static void slab_lease(Slab *slab, uid_t uid) {
        slab->uid = uid;
        slab->state = SLAB_LEASED;
        list_link_tail(&slab->space->leased, &slab->link_state);
        slab->space->leased_bytes += slab->size;
        slab->space->n_leased++;
}

/*
 * A leased slab given back while a copy still reads or writes it waits, leased, on the device's after_copy list
 * until the copy is done (pool_dispatch()): no scrub may overtake the copy on the other stream, no release
 * unmap memory under it. Returns whether it waits so.
 */
static bool slab_after_copy(Slab *slab, bool release) {
        PoolDevice *dev = slab->device;

        if (slab->state != SLAB_LEASED || !slab_copying(dev, slab))
                return false;
        list_unlink(&slab->link_state);
        list_link_tail(&dev->after_copy, &slab->link_state);
        slab->release_after_copy = release;
        dev->stats.after_copy++;
        if (slab->copy_job)
                copy_dst_gone(dev, slab->copy_job);
        return true;
}

void pool_reclaim(Pool *p, Slab *slab) {
        PoolDevice *dev = slab->device;

        if (slab_after_copy(slab, false) || !slab_unlease(slab))
                return;
        slab->state = SLAB_SCRUBBING;
        list_link_tail(&dev->queued, &slab->link_state);
        slab->space->scrubbing_bytes += slab->size;
        slab->space->n_scrubbing++;
        if (p->n_queued++ == 0 && p->queued)
                p->queued(p->queued_userdata);
}

/*
 * Scrubs issued on a device's stream and not completed, at most. A stream holds a bounded queue of work:
 * past about 60 scrubs (a memset, an event, a host function each), measured on an H200, a launch blocks
 * in the driver until the device finishes one, and the daemon's loop with it. Host memory is zeroed at
 * about 50 GB/s (20 ms per GiB), so 32 GiB of a parked lease's host slabs freed by an unpark held the
 * next Free's scrubs, and every client, for 0.47 s (docs/performance.md, "A measured stall"). 16 scrubs
 * keep the device busy (a completion comes back through the loop long before 16 zeroings are done) and
 * the stream far from full.
 */
#define SCRUBS_AHEAD 16

static uint64_t scrubs_in_flight(const PoolDevice *dev) {
        return dev->scrubs_issued - atomic_load_explicit(&dev->scrubs_done, memory_order_acquire);
}

/* Issues the scrubs of the device's queued slabs, in reclaim order, while fewer than `ahead` are in flight;
 * the rest as completions come (pool_dispatch()). */
static void device_scrub_ahead(PoolDevice *dev, uint64_t ahead) {
        Slab *slab, *tmp;

        dev->scrubs_held = false;
        list_for_each_entry_safe(slab, tmp, &dev->queued, link_state) {
                if (scrubs_in_flight(dev) >= ahead) {
                        dev->scrubs_held = true;
                        break;
                }
                list_unlink(&slab->link_state);
                dev->pool->n_queued--;
                if (slab_scrub(dev, slab) < 0) {
                        /* Memory we could not zero is never handed out again. */
                        slab->space->scrubbing_bytes -= slab->size;
                        slab->space->n_scrubbing--;
                        dev->pool->scrubs_finished++;   /* not zeroed, but room all the same */
                        slab_release(slab);
                        continue;
                }
                if (slab->host)
                        slab->uid = UID_UNBOUND;        /* zeroed, it holds nobody's data: any park may use it */
                list_link_tail(&dev->scrubbing, &slab->link_state);
        }
}

/* Issues the device's queued scrubs while the stream has room for them (SCRUBS_AHEAD). */
static void device_scrub_queued(PoolDevice *dev) {
        device_scrub_ahead(dev, SCRUBS_AHEAD);
}

/* Whether a slab of `space` waits on the device's queue, its scrub not issued. */
static bool space_has_queued(const SlabSpace *space) {
        const Slab *s;

        list_for_each_entry(s, &space->device->queued, link_state)
                if (s->space == space)
                        return true;
        return false;
}

void pool_scrub_queued(Pool *p) {
        for (size_t i = 0; i < p->n_devices && p->n_queued > 0; i++)
                device_scrub_queued(&p->devices[i]);
}

bool pool_has_queued(const Pool *p) {
        return p->n_queued > 0;
}

uint64_t pool_scrubs_finished(const Pool *p) {
        return p->scrubs_finished;
}

void pool_set_queued_hook(Pool *p, void (*queued)(void *userdata), void *userdata) {
        p->queued = queued;
        p->queued_userdata = userdata;
        if (queued && p->n_queued > 0)
                queued(userdata);
}

void pool_set_hooks(Pool *p, const PoolHooks *hooks, void *userdata) {
        p->hooks = hooks ? *hooks : (PoolHooks){};
        p->hooks_userdata = userdata;
}

/* A slab of a previous run from its exported fd (the fd stays the caller's): a new Slab with the imported handle
 * and nothing else set (slab_init() next). 0, -ENOMEM, or POOL_E_DRIVER (said). */
static int slab_import(PoolDevice *dev, int fd, Slab **ret) {
        _cleanup_free_ Slab *slab = calloc(1, sizeof(*slab));
        CUresult r;

        if (!slab)
                return -ENOMEM;
        if (make_current(dev) < 0)
                return POOL_E_DRIVER;
        r = DRV(dev, cuMemImportFromShareableHandle)(&slab->handle, (void *)(intptr_t)fd,
                                                    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        if (r != CUDA_SUCCESS) {
                driver_error(dev, "cuMemImportFromShareableHandle", r);
                return POOL_E_DRIVER;
        }
        *ret = TAKE_PTR(slab);
        return 0;
}

int pool_import(Pool *p, int device, uint64_t id, int fd, uint64_t size, uid_t uid, bool host, Slab **ret) {
        int i = pool_find_device(p, device), k;
        SlabSpace *space;
        PoolDevice *dev;
        Slab *slab;

        if (i < 0)
                return -EINVAL;
        dev = &p->devices[i];
        space = host ? &dev->host : &dev->mem;
        if (space->granularity == 0 || size == 0 || size % space->granularity != 0 ||
            size > ALIGN_UP(p->max_slab, space->granularity) || id == 0)
                return -EINVAL;
        k = slab_import(dev, fd, &slab);
        if (k != 0)
                return k;
        slab_init(space, slab, id, fd, size, uid);
        p->last_slab_id = MAX(p->last_slab_id, id);
        slab_lease(slab, uid);
        *ret = slab;
        return 0;
}

void pool_release(Pool *p, Slab *slab) {
        if (!slab_after_copy(slab, true) && slab_unlease(slab))
                slab_release(slab);
}

/* Gives back the slabs that waited for their copy (slab_after_copy()), once it is done (`all`: the stream is). */
static unsigned after_copy_finish(PoolDevice *dev, bool all) {
        Slab *slab, *tmp;
        unsigned n = 0;

        list_for_each_entry_safe(slab, tmp, &dev->after_copy, link_state) {
                if (!all && slab_copying(dev, slab))
                        continue;
                list_unlink(&slab->link_state);
                list_link_tail(&slab->space->leased, &slab->link_state);
                if (all)
                        slab->copy_ticket = 0;
                if (slab->release_after_copy)
                        pool_release(dev->pool, slab);
                else
                        pool_reclaim(dev->pool, slab);
                n++;
        }
        return n;
}

int pool_scrub_leased(Pool *p, Slab *slab) {
        PoolDevice *dev = slab->device;

        if (slab->state != SLAB_LEASED || slab->host)
                return -EINVAL;
        if (slab_zero(dev, slab) < 0)           /* makes the device's context current: the event's */
                return POOL_E_DRIVER;
        if (slab_record_zeroed(dev, slab) < 0) {
                /* Queued, but nothing would say when it is done: wait for it, and do not vouch for it. */
                (void)DRV(dev, cuStreamSynchronize)(dev->stream);
                return POOL_E_DRIVER;
        }
        return 0;
}

int pool_scrub_wait(Pool *p, Slab *const *slabs, size_t n, uint64_t wait_max) {
        PoolDevice *dev = n > 0 ? slabs[0]->device : NULL;     /* one lease's slabs: one device */
        size_t j = 0;
        CUresult r;

        /* The first whose zeroing is not done: the stream zeroes in order, so those before it are. */
        for (; j < n; j++) {
                if (!slabs[j]->zeroed)
                        continue;
                r = DRV(dev, cuEventQuery)(slabs[j]->zeroed);
                if (r == CUDA_ERROR_NOT_READY)
                        break;
                if (r != CUDA_SUCCESS) {
                        driver_error(dev, "cuEventQuery", r);
                        return POOL_E_DRIVER;
                }
                zeroed_through(dev, slabs[j]);
        }
        if (j == n)
                return 0;
        if (wait_max != POOL_WAIT_ANY && zeroing_ahead(dev, slabs[n - 1]) > wait_max) {
                /* A scrub queued after them has its completion; else one is queued here. */
                if (dev->completion_mark < slabs[n - 1]->zero_mark &&
                    (make_current(dev) < 0 || completion_queue(dev) < 0))
                        return POOL_E_DRIVER;
                return POOL_E_SCRUBBING;
        }
        /* The device zeroes at TB/s: waiting here is cheaper than any trip through the loop. */
        dev->stats.scrub_waits++;
        for (; j < n; j++) {
                if (!slabs[j]->zeroed)
                        continue;
                r = DRV(dev, cuEventSynchronize)(slabs[j]->zeroed);
                if (r != CUDA_SUCCESS) {
                        driver_error(dev, "cuEventSynchronize", r);
                        return POOL_E_DRIVER;
                }
                zeroed_through(dev, slabs[j]);
        }
        return 0;
}

/* Caches a scrubbing slab whose zeroing is done: at its completion callback (pool_dispatch()), or ahead of it
 * (cache_take_or_wait()). */
static void scrub_finish(Slab *slab) {
        PoolDevice *dev = slab->device;

        list_unlink(&slab->link_state);
        slab->space->scrubbing_bytes -= slab->size;
        slab->space->n_scrubbing--;
        zeroed_through(dev, slab);
        dev->stats.scrubs++;
        dev->stats.scrubbed_bytes += slab->size;
        dev->pool->scrubs_finished++;
        slab->last_used = ++dev->pool->clock;
        if (cache_insert(slab) < 0)
                slab_release(slab);
}

static unsigned makes_finish(Pool *p);

unsigned pool_dispatch(Pool *p) {
        unsigned n = 0;
        uint64_t counter;

        /* Clear the eventfd first: a completion after this read makes it readable again. */
        (void)!read(p->event_fd, &counter, sizeof(counter));
        n += makes_finish(p);

        for (size_t i = 0; i < p->n_devices; i++) {
                PoolDevice *dev = &p->devices[i];
                uint64_t done = atomic_load_explicit(&dev->scrubs_done, memory_order_acquire);
                Slab *slab, *tmp;
                unsigned cached = 0;

                list_for_each_entry_safe(slab, tmp, &dev->scrubbing, link_state) {
                        if (slab->scrub_seq > done)
                                break;
                        scrub_finish(slab);
                        cached++;
                }
                /* Completions reached with no slab to cache (pool_scrub_wait()'s own, a copy's, or scrubs finished
                 * ahead) move the count all the same: a call deferred for a zeroing in place is tried again. */
                if (done != dev->scrubs_dispatched && cached == 0)
                        p->scrubs_finished++;
                dev->scrubs_dispatched = done;
                n += cached;
                if (dev->scrubs_held)
                        device_scrub_queued(dev);       /* the stream has room again */
                done = atomic_load_explicit(&dev->copies_done, memory_order_acquire);
                if (done != dev->copies_dispatched) {
                        copy_pump(dev, false);          /* the stream has room again: the next pieces, in turn */
                        n += after_copy_finish(dev, false);
                }
                dev->copies_dispatched = done;
        }
        return n;
}

int pool_drain(Pool *p) {
        int ret = 0;

        pool_scrub_queued(p);
        for (size_t i = 0; i < p->n_devices; i++) {
                PoolDevice *dev = &p->devices[i];
                CUresult r;

                if (list_is_empty(&dev->scrubbing) && list_is_empty(&dev->queued) && list_is_empty(&dev->copies) &&
                    dev->copies_issued == dev->copies_dispatched)
                        continue;
                if (make_current(dev) < 0) {
                        ret = -EIO;
                        continue;
                }
                /* the copies first, every piece left queued: what waited for them is scrubbed then */
                copy_pump(dev, true);
                r = copies_sync(dev);
                if (r != CUDA_SUCCESS) {
                        driver_error(dev, "cuStreamSynchronize (copies)", r);
                        ret = -EIO;
                }
                (void)after_copy_finish(dev, false);
                do {    /* SCRUBS_AHEAD at a time */
                        device_scrub_queued(dev);
                        r = DRV(dev, cuStreamSynchronize)(dev->stream);
                        if (r != CUDA_SUCCESS) {
                                driver_error(dev, "cuStreamSynchronize", r);
                                ret = -EIO;
                        }
                } while (r == CUDA_SUCCESS && !list_is_empty(&dev->queued));
        }
        pool_dispatch(p);
        /* and the host slabs being made: each finished one is told through the eventfd */
        while (pool_making(p)) {
                struct pollfd pfd = { .fd = p->event_fd, .events = POLLIN };

                if (poll(&pfd, 1, -1) < 0 && errno != EINTR)
                        return -errno;
                pool_dispatch(p);
        }
        return ret;
}

int pool_get_fd(Pool *p) {
        return p->event_fd;
}

/* --- requests ------------------------------------------------------------------------------------------- */

int pool_find_device(Pool *p, int device) {
        for (size_t i = 0; i < p->n_devices; i++)
                if (p->devices[i].info.index == device)
                        return (int)i;
        return -1;
}

/*
 * Takes a cached slab of `size` for `uid`, most recently used first; else an
 * unbound one (never leased, so it holds nobody's data); else NULL.
 */
static Slab *cache_take(SlabSpace *space, uint64_t size, uid_t uid) {
        CacheBucket *b = bucket_find(space, size, uid);
        Slab *slab;

        if (!b)
                b = bucket_find(space, size, UID_UNBOUND);
        if (!b)
                return NULL;
        slab = list_first_entry(&b->slabs, Slab, link_state);
        cache_remove(slab);
        return slab;
}

enum {
        ZEROED_WAITED,          /* the slab's zeroing is done, and every scrub issued before it: all cached */
        ZEROED_FAILED,          /* the driver failed: the scrubs will be seen as failed when their completions
                                   are dispatched */
        ZEROED_DEFERRED,        /* not waited for: longer than the caller may wait */
};

/* Caches every slab of the device's scrubbing list up to and including `last`, whose zeroing was waited for:
 * the stream zeroes in order, so those issued before it (any space's) are zeroed too. */
static void scrubs_finish_through(PoolDevice *dev, Slab *last) {
        Slab *s, *tmp;

        list_for_each_entry_safe(s, tmp, &dev->scrubbing, link_state) {
                bool done = s == last;

                scrub_finish(s);
                if (done)
                        break;
        }
}

/*
 * Waits for `slab`'s zeroing: its event, not the rest of the stream nor the completion callback, whose trip
 * through the driver's thread and the event loop takes longer than zeroing a small slab. The stream runs in
 * order, so every scrub issued before it is done too: they are cached with it (scrubs_finish_through()).
 * When the zeroing is not done and more than `wait_max` bytes of zeroing are queued on the stream up to and
 * including the slab's (zeroing_ahead(): scrubs and zeroings in place, any user's), nothing is waited for (such
 * a wait holds the daemon's loop, about 0.3 ms per GiB): the request is deferred (POOL_E_SCRUBBING) and tried
 * again once scrubs have finished; the slab's own completion comes after it.
 */
static int slab_wait_zeroed(PoolDevice *dev, Slab *slab, uint64_t wait_max) {
        if (make_current(dev) < 0)
                return ZEROED_FAILED;
        if (wait_max != POOL_WAIT_ANY && zeroing_ahead(dev, slab) > wait_max &&
            DRV(dev, cuEventQuery)(slab->zeroed) == CUDA_ERROR_NOT_READY)
                return ZEROED_DEFERRED;
        /* Every issued scrub has its event (slab_scrub()). */
        if (DRV(dev, cuEventSynchronize)(slab->zeroed) != CUDA_SUCCESS)
                return ZEROED_FAILED;
        dev->stats.scrub_waits++;
        scrubs_finish_through(dev, slab);
        return ZEROED_WAITED;
}

/*
 * A cached slab of `size` for `uid`; else, when one of that size and uid is being scrubbed, waits for its
 * zeroing (slab_wait_zeroed(), which caches it and the scrubs issued before it) and takes it. Under fast
 * alloc/free of one size the slab just freed is usually still queued or being scrubbed when the next request
 * comes: waiting for it (the device zeroes at TB/s: microseconds for small slabs) is cheaper than creating and
 * exporting a new one, and the pool does not grow with churn. A wait longer than `wait_max` is not made: NULL
 * with *ret_deferred set.
 */
/* Whether a slab being scrubbed (or queued for it) will be cached where a request of `uid` takes it: its own,
 * or unbound (a host slab's scrub unbinds it, device_scrub_queued()). */
static bool scrub_serves(const Slab *s, const SlabSpace *space, uint64_t size, uid_t uid) {
        return s->space == space && s->size == size && (s->uid == uid || s->uid == UID_UNBOUND);
}

/* The first slab being scrubbed on the device (issued) that scrub_serves() a request of `size` and `uid`. */
static Slab *scrubbing_serving(PoolDevice *dev, const SlabSpace *space, uint64_t size, uid_t uid) {
        Slab *s;

        list_for_each_entry(s, &dev->scrubbing, link_state)
                if (scrub_serves(s, space, size, uid))
                        return s;
        return NULL;
}

static Slab *cache_take_or_wait(SlabSpace *space, uint64_t size, uid_t uid, uint64_t wait_max,
                                bool *ret_deferred) {
        Slab *slab = cache_take(space, size, uid), *found;
        PoolDevice *dev = space->device;

        if (slab)
                return slab;
        device_scrub_queued(dev);       /* the slab freed by the last request may not be scrubbing yet */
        found = scrubbing_serving(dev, space, size, uid);
        /* One still queued behind SCRUBS_AHEAD: a request that may wait for any zeroing issues them all (the
         * stream may be full: it waits anyway); another one makes a new slab. */
        if (!found && wait_max == POOL_WAIT_ANY && space_has_queued(space)) {
                device_scrub_ahead(dev, UINT64_MAX);
                found = scrubbing_serving(dev, space, size, uid);
        }
        if (!found)
                return NULL;
        switch (slab_wait_zeroed(dev, found, wait_max)) {
        case ZEROED_WAITED:
                return cache_take(space, size, uid);
        case ZEROED_DEFERRED:
                *ret_deferred = true;
                return NULL;
        default:
                return NULL;
        }
}

/* The space's bytes that are not room: every live slab but the cached ones, and the host slabs being made. */
static uint64_t space_in_use(const SlabSpace *space) {
        return space->created_bytes + space->making_bytes - space->cached_bytes;
}

/*
 * Waits until the scrubs of the space's slabs (queued ones issued first) have given back the room that `fresh`
 * more bytes need, and caches them, where they count as room: a request that finds the device full only
 * because memory just freed is still being zeroed gets that memory rather than OutOfMemory. One wait, for the
 * last slab needed (slab_wait_zeroed(): the ones before it are done too, what is queued after it is not waited
 * for). Waits for nothing when they would not give back enough, or the driver fails. Returns false, having
 * waited for nothing, when the wait would be longer than `wait_max`.
 */
static bool space_wait_scrubbed(SlabSpace *space, uint64_t fresh, uint64_t wait_max) {
        PoolDevice *dev = space->device;
        Slab *s, *last = NULL;
        uint64_t in_use, need, covered = 0;

        /* a scrub that cannot be issued releases its slab: room too; one that may wait for any zeroing issues
         * them all (SCRUBS_AHEAD keeps the others off a full stream) */
        device_scrub_ahead(dev, wait_max == POOL_WAIT_ANY ? UINT64_MAX : SCRUBS_AHEAD);
        in_use = space_in_use(space);
        if (in_use + fresh <= space->capacity)
                return true;
        need = in_use + fresh - space->capacity;
        list_for_each_entry(s, &dev->scrubbing, link_state) {
                if (s->space != space)
                        continue;
                covered += s->size;
                last = s;
                if (covered >= need)
                        break;
        }
        /* the room is in scrubs not issued yet: tried again once scrubs finished, which issues more */
        if (covered < need && space_has_queued(space))
                return false;
        /* a failed wait counts as done: the scrubs are seen as failed when their completions are dispatched */
        return covered < need || slab_wait_zeroed(dev, last, wait_max) != ZEROED_DEFERRED;
}

/*
 * Room for `fresh` more bytes of new slabs in the space: when they fit beside what is in use (created, being
 * made, less what is cached), releases cached slabs (least recently used first) until they fit beside every
 * slab. Returns 0, or POOL_E_NOMEM / POOL_E_HOST_NOMEM (pool_last_error() says why) with nothing released.
 */
static int space_make_room(SlabSpace *space, uint64_t fresh) {
        PoolDevice *dev = space->device;
        uint64_t in_use = space_in_use(space);

        if (in_use + fresh > space->capacity) {
                set_error(dev->pool, "device %d has %" PRIu64 " of its %scapacity of %" PRIu64 " bytes in use",
                          dev->info.index, in_use, space->host ? "host " : "", space->capacity);
                return space->host ? POOL_E_HOST_NOMEM : POOL_E_NOMEM;
        }
        while (space->created_bytes + space->making_bytes + fresh > space->capacity)
                if (!evict_one(space))
                        break;
        return 0;
}

/* Undoes a request that failed: created slabs go back to the driver, cached ones back to the cache. */
static void alloc_rollback(Slab **slabs, size_t n) {
        for (size_t i = n; i-- > 0;) {
                Slab *slab = slabs[i];

                if (!slab)
                        continue;
                if (slab->state == SLAB_CACHED) {
                        if (cache_insert(slab) < 0)
                                slab_release(slab);
                } else
                        slab_release(slab);
                slabs[i] = NULL;
        }
}

/*
 * Slabs of these sizes from one space, leased to `uid`: cached ones first, the rest created, releasing
 * cached slabs (least recently used first) to make room. All or nothing; POOL_E_SCRUBBING, nothing changed,
 * when it would wait for more than `wait_max` bytes of zeroing.
 */
static int space_alloc(SlabSpace *space, const uint64_t *sizes, size_t n, uid_t uid, uint64_t wait_max,
                       Slab **ret_slabs) {
        Slab *slabs[POOL_MAX_HOST_SLABS] = {};
        uint64_t fresh = 0, in_use;
        PoolDevice *dev = space->device;
        bool deferred = false;
        int k;

        assert(n <= (space->host ? POOL_MAX_HOST_SLABS : POOL_MAX_SLABS));
        /* Cached slabs first. They stay marked SLAB_CACHED until the request succeeds, for the rollback. */
        for (size_t j = 0; j < n && !deferred; j++) {
                slabs[j] = cache_take_or_wait(space, sizes[j], uid, wait_max, &deferred);
                if (!slabs[j])
                        fresh += sizes[j];
        }
        if (deferred) {
                alloc_rollback(slabs, n);
                return POOL_E_SCRUBBING;
        }

        /*
         * Will the fresh slabs fit once every other cached slab is released, and what is being scrubbed is
         * done (waited for only when it is needed)? If not, fail before releasing anything. (The hits are out
         * of the cache now but still alive, so they count as in use.)
         */
        in_use = space_in_use(space);
        if (in_use + fresh > space->capacity && in_use - space->scrubbing_bytes + fresh <= space->capacity) {
                if (!space_wait_scrubbed(space, fresh, wait_max)) {
                        alloc_rollback(slabs, n);
                        return POOL_E_SCRUBBING;
                }
                in_use = space_in_use(space);
        }
        k = space_make_room(space, fresh);
        if (k != 0) {
                alloc_rollback(slabs, n);
                return k;
        }

        for (size_t j = 0; j < n; j++) {
                if (slabs[j])
                        continue;
                k = slab_create(space, sizes[j], uid, &slabs[j]);
                if (k != 0) {
                        alloc_rollback(slabs, n);
                        return k;
                }
        }

        for (size_t j = 0; j < n; j++) {
                if (slabs[j]->state == SLAB_CACHED)
                        dev->stats.hits++;
                slab_lease(slabs[j], uid);
                ret_slabs[j] = slabs[j];
        }
        return 0;
}

int pool_alloc(Pool *p, int device, uint64_t size, uid_t uid, Slab **ret_slabs, size_t *ret_n) {
        return pool_alloc_bounded(p, device, size, uid, POOL_WAIT_ANY, ret_slabs, ret_n);
}

int pool_alloc_bounded(Pool *p, int device, uint64_t size, uid_t uid, uint64_t wait_max, Slab **ret_slabs,
                       size_t *ret_n) {
        uint64_t sizes[POOL_MAX_SLABS];
        PoolDevice *dev;
        size_t n;
        int i, k;

        i = pool_find_device(p, device);
        if (i < 0)
                return POOL_E_NO_DEVICE;
        dev = &p->devices[i];

        n = pool_plan(size, dev->info.granularity, p->max_slab, sizes, ELEMENTSOF(sizes));
        if (n == 0)
                return size == 0 ? -EINVAL : POOL_E_TOO_LARGE;
        if (n > POOL_MAX_SLABS || ALIGN_UP(size, dev->info.granularity) > dev->mem.capacity)
                return POOL_E_TOO_LARGE;
        k = space_alloc(&dev->mem, sizes, n, uid, wait_max, ret_slabs);
        if (k == 0)
                *ret_n = n;
        return k;
}

bool pool_has_host(Pool *p, size_t i) {
        PoolDevice *dev = &p->devices[i];

        if (dev->host.granularity > 0 && dev->host.capacity > 0)
                return true;
        set_error(p, "device %d has no host memory for parked leases (%s)", dev->info.index,
                  dev->host.granularity == 0 ? "the driver cannot make it" : "HostCapacity=0");
        return false;
}

/*
 * The sizes of the host slabs that hold the content of device slabs `slabs` (one lease's, in mapping order):
 * each cut into slabs of the host slab size and one of the rest, so that the driver pins no more than
 * Pool.host_slab per call. Returns their number (at most POOL_MAX_HOST_SLABS: pool_new() keeps max_slab /
 * host_slab within POOL_HOST_PIECES_MAX), or 0 when the host granularity does not divide a slab (said).
 */
static size_t host_sizes(Pool *p, PoolDevice *dev, Slab *const *slabs, size_t n,
                         uint64_t sizes[static POOL_MAX_HOST_SLABS]) {
        size_t n_host = 0;

        for (size_t j = 0; j < n; j++) {
                if (slabs[j]->size % dev->host.granularity != 0) {
                        set_error(p, "device %d's host granularity (%" PRIu64 " bytes) does not divide a slab of "
                                  "%" PRIu64 " bytes", dev->info.index, dev->host.granularity, slabs[j]->size);
                        return 0;
                }
                n_host += pool_plan(slabs[j]->size, dev->host.granularity, p->host_slab, sizes + n_host,
                                    POOL_MAX_HOST_SLABS - n_host);
        }
        assert(n_host <= POOL_MAX_HOST_SLABS);
        return n_host;
}

int pool_alloc_host(Pool *p, Slab *const *slabs, size_t n, uid_t uid, uint64_t wait_max, Slab **ret_host,
                    size_t *ret_n) {
        uint64_t sizes[POOL_MAX_HOST_SLABS];
        PoolDevice *dev;
        size_t n_host;
        int k;

        if (n == 0 || n > POOL_MAX_SLABS)
                return -EINVAL;
        dev = slabs[0]->device;
        if (!pool_has_host(p, (size_t)(dev - p->devices)))
                return POOL_E_NO_HOST;
        /* The copies go by offset (pool_copy_start()): any cut of the same bytes maps back, whatever the layout of
         * the device slabs at unpark. */
        n_host = host_sizes(p, dev, slabs, n, sizes);
        if (n_host == 0)
                return POOL_E_NO_HOST;
        k = space_alloc(&dev->host, sizes, n_host, uid, wait_max, ret_host);
        if (k == 0)
                *ret_n = n_host;
        return k;
}

/* --- host slabs made off the loop ------------------------------------------------------------------- */

/*
 * Caches a host slab that is not leased (one the maker thread made, for the user of the call it was made for or
 * unbound for the reserve, or one of a previous run's cache taken back, unbound), once the hooks have stored it;
 * released if they could not (a slab a restart would lose is not handed out). Returns whether it was cached.
 */
static bool host_slab_cache(Pool *p, Slab *slab) {
        slab->last_used = ++p->clock;
        if ((p->hooks.slab_created && p->hooks.slab_created(slab, p->hooks_userdata) < 0) || cache_insert(slab) < 0) {
                slab_release(slab);
                return false;
        }
        return true;
}

/* Makes and exports one host slab on the maker thread: only the driver is touched, nothing of the pool's. */
static void make_one(Pool *p, MakeJob *j) {
        CUmemAllocationProp prop = cuda_host_prop(j->dev->info.numa_node);
        const char *failed = NULL;
        CUresult r;

        j->calls = 1;
        r = p->cu->cuCtxSetCurrent(j->dev->ctx);
        if (r != CUDA_SUCCESS) {
                j->failed = "cuCtxSetCurrent";
                j->result = r;
                return;
        }
        j->calls++;
        r = p->cu->cuMemCreate(&j->handle, j->size, &prop, 0);
        if (r != CUDA_SUCCESS) {
                j->failed = "cuMemCreate (host memory)";
                j->result = r;
                return;
        }
        j->calls++;
        r = p->cu->cuMemExportToShareableHandle(&j->fd, j->handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
        if (r != CUDA_SUCCESS) {
                j->calls++;
                (void)p->cu->cuMemRelease(j->handle);
                j->failed = "cuMemExportToShareableHandle";
                j->result = r;
                return;
        }
        /* The pool's mapping too (its copies and zeroing use it): 10 ms per GiB of pinned memory on an H200,
         * which the loop would pay at the first copy. Without it, the loop maps it then. */
        if (mapping_make(p->cu, j->dev, j->handle, j->size, &j->va, &failed, &j->calls) != CUDA_SUCCESS)
                j->va = 0;
}

/*
 * After a piece of work of user `uid` (for `served`, or NULL when that has no more): every entry of that user in
 * `queue` goes to its tail, in order, `served` last. The next piece is then another user's whenever one waits
 * (users take turns, however many entries each has queued), and the user's own entries take turns among
 * themselves.
 */
static void turns_rotate(List *queue, uid_t uid, Turn *served) {
        Turn *t, *tmp, *last = list_last_entry(queue, Turn, link);

        /* Once over the entries there were, each of the user's moved to the tail as it is met. */
        list_for_each_entry_safe(t, tmp, queue, link) {
                bool end = t == last;

                if (t != served && t->uid == uid) {
                        list_unlink(&t->link);
                        list_link_tail(queue, &t->link);
                }
                if (end)
                        break;
        }
        if (served) {
                list_unlink(&served->link);
                list_link_tail(queue, &served->link);
        }
}

/*
 * The entry to serve next: the first whose user is not `last` (the user served last), or else the first. After
 * turns_rotate() the user served last has its entries at the tail, and a user who came since, queued behind
 * them, goes first, as in a round of turns. The copies need it: copy_pump() rotates as it queues a piece, and a
 * user comes while that piece runs. The maker thread does not: it rotates once its job is made, so whoever came
 * meanwhile is queued already and goes before the user served, and the head is this entry.
 */
static Turn *turns_next(List *queue, uid_t last) {
        Turn *t;

        list_for_each_entry(t, queue, link)
                if (t->uid != last)
                        return t;
        return list_first_entry(queue, Turn, link);
}

/* The maker thread: one job at a time, users and their requests in turn (turns_rotate()), each handed back
 * through the pool's eventfd; it ends once none is left (or the pool stops it). */
static void *maker_thread(void *userdata) {
        Pool *p = userdata;

        (void)pthread_mutex_lock(&p->make_lock);
        for (;;) {
                MakeRequest *req;
                MakeJob *j;
                bool more;
                uid_t uid;

                if (p->make_quit || list_is_empty(&p->make_queue)) {
                        p->maker_running = false;
                        break;
                }
                req = list_first_entry(&p->make_queue, MakeRequest, turn.link);
                uid = req->turn.uid;
                j = list_first_entry(&req->todo, MakeJob, link);
                list_unlink(&j->link);
                more = !list_is_empty(&req->todo);
                if (!more)
                        list_unlink(&req->turn.link);   /* the loop frees it once its last job is finished */
                (void)pthread_mutex_unlock(&p->make_lock);
                make_one(p, j);
                (void)pthread_mutex_lock(&p->make_lock);
                /* Its user's next job after every other user's queued by now, even those queued meanwhile (req is
                 * not freed when it has jobs left; when it has none, the loop may have freed it). */
                turns_rotate(&p->make_queue, uid, more ? &req->turn : NULL);
                list_link_tail(&p->make_done, &j->link);
                (void)eventfd_write(p->event_fd, 1);
        }
        (void)pthread_mutex_unlock(&p->make_lock);
        return NULL;
}

/* Undoes the pool's mapping of a made slab that the pool will not take. */
static void job_unmap(Pool *p, MakeJob *j) {
        if (j->va) {
                (void)p->cu->cuMemUnmap(j->va, j->size);
                (void)p->cu->cuMemAddressFree(j->va, j->size);
        }
}

/* One more of the request's jobs is finished: when it was the last, the call that waits for its ticket takes
 * its slabs (pool_make_done(), pool_host_made()). */
static void request_finished(Pool *p, MakeRequest *req) {
        if (--req->left > 0)
                return;
        if (req->failed)
                p->failed_tickets[p->n_failed_tickets++ % POOL_FAILED_TICKETS] = req->ticket;
        request_unlive(p, req);
        free(req);
        p->host_made++;
}

/* Adds the host slabs the maker thread has made to their spaces' caches, each for the user of its request (the
 * reserve's unbound), and finishes their requests. Returns how many it added. */
static unsigned makes_finish(Pool *p) {
        List done = LIST_INIT(done);
        unsigned n = 0;
        MakeJob *j;

        if (!p->maker_joinable)
                return 0;
        (void)pthread_mutex_lock(&p->make_lock);
        list_splice_tail(&done, &p->make_done);
        (void)pthread_mutex_unlock(&p->make_lock);

        while ((j = list_first_entry(&done, MakeJob, link))) {
                PoolDevice *dev = j->dev;
                SlabSpace *space = &dev->host;
                Slab *slab = NULL;

                list_unlink(&j->link);
                space->making_bytes -= j->size;
                dev->stats.driver_calls += j->calls;
                if (j->failed) {
                        driver_error(dev, j->failed, j->result);
                        j->request->failed = true;
                } else if (!(slab = calloc(1, sizeof(*slab)))) {
                        j->request->failed = true;
                        job_unmap(p, j);
                        (void)DRV(dev, cuMemRelease)(j->handle);
                        defer_close(p, j->fd);
                } else {
                        slab->handle = j->handle;
                        slab->scrub_va = j->va;
                        /* Cached for the user whose call it was made for (new memory, zeroed: the reserve's
                         * are unbound), so that no other user's call takes it before that call does. */
                        slab_init(space, slab, ++p->last_slab_id, j->fd, j->size, j->request->turn.uid);
                        p->prime = false;
                        dev->stats.host_created++;
                        if (host_slab_cache(p, slab)) {
                                n++;
                                if (slab->uid != UID_UNBOUND)
                                        list_link_tail(&p->made_bound, &slab->link_made);
                        }
                }
                request_finished(p, j->request);
                free(j);
        }
        return n;
}

/* How many of the space's slabs of `size` a request of `uid` could take now or after a scrub under way. */
static unsigned space_available(SlabSpace *space, uint64_t size, uid_t uid) {
        PoolDevice *dev = space->device;
        CacheBucket *b = bucket_find(space, size, uid), *u = bucket_find(space, size, UID_UNBOUND);
        unsigned n = (b ? b->n : 0) + (u && u != b ? u->n : 0);
        List *lists[] = { &dev->queued, &dev->scrubbing };
        Slab *s;

        for (size_t i = 0; i < ELEMENTSOF(lists); i++)
                list_for_each_entry(s, lists[i], link_state)
                        if (scrub_serves(s, space, size, uid))
                                n++;
        return n;
}

/* Frees a request that was never queued, and its jobs. */
static void request_free(MakeRequest *req) {
        MakeJob *j;

        while ((j = list_first_entry(&req->todo, MakeJob, link))) {
                list_unlink(&j->link);
                free(j);
        }
        free(req);
}

/* Queues the making of `n_make` host slabs of `sizes` for `dev` (their room, `fresh` bytes, taken), to be cached
 * for `uid`, as one request, and starts the maker thread if it is not running. POOL_E_MAKING with the request's
 * ticket in *ret_ticket (may be NULL), or a negative errno with nothing queued. */
static int make_start(Pool *p, PoolDevice *dev, const uint64_t *sizes, size_t n_make, uint64_t fresh, uid_t uid,
                      uint64_t *ret_ticket) {
        MakeRequest *req = calloc(1, sizeof(*req));
        bool start;
        int r;

        if (!req)
                return -ENOMEM;
        *req = (MakeRequest){ .ticket = p->last_ticket + 1, .turn.uid = uid, .left = (unsigned)n_make };
        list_init(&req->todo);
        for (size_t i = 0; i < n_make; i++) {
                MakeJob *j = calloc(1, sizeof(*j));

                if (!j) {
                        request_free(req);
                        return -ENOMEM;
                }
                *j = (MakeJob){ .request = req, .dev = dev, .size = sizes[i], .fd = -EBADF };
                list_link_tail(&req->todo, &j->link);
        }
        /* Queued under the lock; a thread that runs takes them, else one is started (after the one that ended
         * is joined: it ended, or is about to, having found nothing to do). */
        (void)pthread_mutex_lock(&p->make_lock);
        list_link_tail(&p->make_queue, &req->turn.link);
        start = !p->maker_running;
        p->maker_running = true;
        (void)pthread_mutex_unlock(&p->make_lock);
        if (start) {
                if (p->maker_joinable)
                        (void)pthread_join(p->maker, NULL);
                p->maker_joinable = false;
                r = pthread_create(&p->maker, NULL, maker_thread, p);
                if (r != 0) {
                        /* no thread ran since it was not running: the queue is this request only */
                        (void)pthread_mutex_lock(&p->make_lock);
                        p->maker_running = false;
                        list_unlink(&req->turn.link);
                        (void)pthread_mutex_unlock(&p->make_lock);
                        request_free(req);
                        return -r;
                }
                p->maker_joinable = true;
        }
        p->last_ticket = req->ticket;
        request_live(p, req);
        dev->host.making_bytes += fresh;
        if (ret_ticket)
                *ret_ticket = req->ticket;
        return POOL_E_MAKING;
}

static int cmp_u64(const void *a, const void *b) {
        uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

        return x < y ? -1 : x > y;
}

int pool_make_host(Pool *p, Slab *const *slabs, size_t n, uid_t uid, uint64_t *ret_ticket) {
        uint64_t sizes[POOL_MAX_HOST_SLABS], make[POOL_MAX_HOST_SLABS], fresh = 0;
        size_t n_sizes, n_make = 0;
        SlabSpace *space;
        PoolDevice *dev;
        int r;

        if (n == 0 || n > POOL_MAX_SLABS)
                return -EINVAL;
        dev = slabs[0]->device;
        space = &dev->host;
        if (!pool_has_host(p, (size_t)(dev - p->devices)))
                return POOL_E_NO_HOST;
        n_sizes = host_sizes(p, dev, slabs, n, sizes);
        if (n_sizes == 0)
                return 0;               /* pool_alloc_host() refuses it, and says why */
        /* Of each size, the slabs that pool_alloc_host() would find (cached or being scrubbed) are not made. The
         * sizes are mostly one (the host slab size): sorted, each size is a run. */
        qsort(sizes, n_sizes, sizeof(uint64_t), cmp_u64);
        for (size_t i = 0, run; i < n_sizes; i += run) {
                unsigned have;

                for (run = 1; i + run < n_sizes && sizes[i + run] == sizes[i]; run++)
                        ;
                have = space_available(space, sizes[i], uid);
                for (size_t j = have; j < run; j++) {
                        make[n_make++] = sizes[i];
                        fresh += sizes[i];
                }
        }
        if (n_make == 0)
                return 0;
        r = space_make_room(space, fresh);
        if (r != 0)
                return r;
        return make_start(p, dev, make, n_make, fresh, uid, ret_ticket);
}

/* Bytes of the space's capacity that no slab has nor is being made into: room without evicting anything. */
static uint64_t space_free(const SlabSpace *space) {
        return space->capacity - MIN(space->capacity, space->created_bytes + space->making_bytes);
}

/* The space's slabs of `size`, whatever their state: leased, queued or being scrubbed, cached. */
static unsigned space_count(const SlabSpace *space, uint64_t size) {
        const PoolDevice *dev = space->device;
        const List *lists[] = { &space->leased, &dev->queued, &dev->scrubbing };
        unsigned n = 0;
        Slab *s;

        for (size_t i = 0; i < ELEMENTSOF(lists); i++)
                list_for_each_entry(s, lists[i], link_state)
                        n += s->space == space && s->size == size;
        list_for_each_entry(s, &space->lru, link_lru)
                n += s->size == size;
        return n;
}

int pool_reserve_host(Pool *p) {
        uint64_t want = p->host_reserve / p->host_slab, sizes[POOL_MAX_SLABS];
        int asked = 0;

        for (size_t b = 0; b < POOL_MAX_SLABS; b++)
                sizes[b] = p->host_slab;
        for (size_t i = 0; i < p->n_devices && want > 0; i++) {
                PoolDevice *dev = &p->devices[i];
                SlabSpace *space = &dev->host;
                uint64_t have, room, n;
                int k;

                if (!pool_has_host(p, i))
                        continue;       /* (device_init() refused a HostSlab= its host granularity does not divide) */
                have = space_count(space, p->host_slab);
                room = space_free(space) / p->host_slab;
                n = MIN(want > have ? want - have : 0, room);
                while (n > 0) {         /* POOL_MAX_SLABS jobs at a time */
                        size_t batch = (size_t)MIN(n, (uint64_t)POOL_MAX_SLABS);

                        k = make_start(p, dev, sizes, batch, batch * p->host_slab, UID_UNBOUND, NULL);
                        if (k < 0)
                                return k;
                        asked += (int)batch;
                        n -= batch;
                }
        }
        return asked;
}

uint64_t pool_host_made(const Pool *p) {
        return p->host_made;
}

bool pool_make_failed(const Pool *p, uint64_t ticket) {
        for (unsigned i = 0; i < MIN(p->n_failed_tickets, POOL_FAILED_TICKETS); i++)
                if (p->failed_tickets[i] == ticket)
                        return true;
        return false;
}

bool pool_make_done(const Pool *p, uint64_t ticket) {
        return !hashmap_find(&p->live_tickets, &ticket);
}

static int cmp_uid(const void *a, const void *b) {
        uid_t x = *(const uid_t *)a, y = *(const uid_t *)b;

        return x < y ? -1 : x > y;
}

unsigned pool_unbind_made(Pool *p) {
        _cleanup_free_ uid_t *making = NULL;
        const MakeRequest *req;
        size_t n_making = 0;
        unsigned n = 0;
        Slab *slab, *tmp;

        if (list_is_empty(&p->made_bound))
                return 0;
        /* The users for whom slabs are being made (a live request), sorted: a lookup per bound slab is then
         * O(log requests), not a walk of them all, each time a request finishes. */
        if (p->live_tickets.n > 0) {
                making = malloc(p->live_tickets.n * sizeof(uid_t));
                if (!making)
                        return 0;       /* bound a while longer: the next finished request tries again */
                list_for_each_entry(req, &p->make_live, link_live)
                        making[n_making++] = req->turn.uid;
                qsort(making, n_making, sizeof(uid_t), cmp_uid);
        }
        /* Not while its user has other slabs being made: a call made again takes its user's slabs whichever
         * call they were made for, so another's may be what is left, for a call still waiting. */
        list_for_each_entry_safe(slab, tmp, &p->made_bound, link_made) {
                if (n_making > 0 && bsearch(&slab->uid, making, n_making, sizeof(uid_t), cmp_uid))
                        continue;
                cache_remove(slab);             /* unlinks it from made_bound */
                slab->uid = UID_UNBOUND;
                if (cache_insert(slab) < 0)
                        slab_release(slab);
                else
                        n++;
        }
        return n;
}

int pool_adopt_host(Pool *p, int device, int fd, uint64_t size) {
        int i = pool_find_device(p, device), k;
        SlabSpace *space;
        PoolDevice *dev;
        Slab *slab;

        if (i < 0) {
                set_error(p, "no device %d", device);
                k = -ENODEV;
                goto fail;
        }
        dev = &p->devices[i];
        space = &dev->host;
        if (!pool_has_host(p, (size_t)i)) {
                k = POOL_E_NO_HOST;
                goto fail;
        }
        /* Larger ones (a run with a larger HostSlab=) would serve no park of this run's, and take room. */
        if (size == 0 || size % space->granularity != 0 || size > p->host_slab) {
                set_error(p, "a host slab of %" PRIu64 " bytes is not a multiple of device %d's host granularity "
                          "(%" PRIu64 ") up to HostSlab= (%" PRIu64 ")", size, dev->info.index, space->granularity,
                          p->host_slab);
                k = -EINVAL;
                goto fail;
        }
        if (size > space_free(space)) {
                set_error(p, "device %d's HostCapacity= (%" PRIu64 " bytes) has no room for %" PRIu64 " more",
                          dev->info.index, space->capacity, size);
                k = -ENOSPC;
                goto fail;
        }
        k = slab_import(dev, fd, &slab);
        if (k != 0)
                goto fail;
        slab_init(space, slab, ++p->last_slab_id, fd, size, UID_UNBOUND);
        if (!host_slab_cache(p, slab)) {
                set_error(p, "it could not be stored with the service manager");
                return -EIO;
        }
        dev->stats.host_adopted++;
        return 0;

fail:
        safe_close(fd);
        return k;
}

void pool_foreach_host_cached(Pool *p, void (*fn)(const Slab *slab, int device, void *userdata), void *userdata) {
        for (size_t i = 0; i < p->n_devices; i++) {
                PoolDevice *dev = &p->devices[i];
                Slab *slab;

                list_for_each_entry(slab, &dev->host.lru, link_lru)
                        fn(slab, dev->info.index, userdata);
        }
}

/* Stops the maker thread: the slab it makes now is finished (the driver cannot be interrupted), those queued
 * after it are not made; what it made is released with the pool. */
static void maker_stop(Pool *p) {
        MakeRequest *req;
        MakeJob *j;

        if (p->maker_joinable) {
                (void)pthread_mutex_lock(&p->make_lock);
                p->make_quit = true;
                (void)pthread_mutex_unlock(&p->make_lock);
                (void)pthread_join(p->maker, NULL);
                p->maker_joinable = false;
                while ((req = list_first_entry(&p->make_queue, MakeRequest, turn.link))) {
                        list_unlink(&req->turn.link);
                        while ((j = list_first_entry(&req->todo, MakeJob, link))) {
                                list_unlink(&j->link);
                                j->dev->host.making_bytes -= j->size;
                                free(j);
                        }
                }
                while ((j = list_first_entry(&p->make_done, MakeJob, link))) {
                        list_unlink(&j->link);
                        j->dev->host.making_bytes -= j->size;
                        if (!j->failed) {
                                job_unmap(p, j);
                                (void)p->cu->cuMemRelease(j->handle);
                                safe_close(j->fd);
                        }
                        free(j);
                }
        }
        while ((req = list_first_entry(&p->make_live, MakeRequest, link_live))) {
                request_unlive(p, req);
                free(req);
        }
}

/*
 * A copy of pool_copy_start()'s, queued on the device's copy stream a piece at a time (copy_pump()). The device
 * runs the copies queued on it in the order they were queued, those of its other streams too: on an H200 a
 * 100 MiB park queued behind another process's 8 GiB park took 139 ms, against 3.5 ms alone. So the stream holds
 * at most POOL_COPY_AHEAD pieces of at most Pool.copy_piece bytes, and the next piece queued is the next user's
 * in turn (turns_rotate()): a copy waits for what was on the stream when it came and for a piece of each other
 * user's copy per turn, not for whole copies. While the stream copies one piece, the loop has the time of the
 * others to queue the next (a 64 MiB piece is about 1.3 ms on an H200). Freed once its last piece is queued: its
 * slabs' copy_ticket then says when it is done.
 */
typedef struct CopyJob {
        Turn turn;                      /* in PoolDevice.copies; uid: whose content it copies */
        Slab **dst, **src;
        size_t n_dst, n_src;
        size_t i, j;                    /* the dst and src slabs where its next piece starts, */
        uint64_t dst_off, src_off;      /* and where in them */
        size_t dst_gone;                /* dst slabs given back meanwhile (copy_dst_gone()) */
        Slab *slabs[];                  /* dst, then src */
} CopyJob;

/* Slab.copy_ticket while the slab's copy has pieces left to queue: copying whatever the stream has done. */
#define COPY_PENDING UINT64_MAX

/* Queues the copy of `bytes` from src + src_off to dst + dst_off on the device's copy stream. */
static int copy_part(PoolDevice *dev, Slab *dst, uint64_t dst_off, Slab *src, uint64_t src_off, uint64_t bytes) {
        CUresult r;

        if (slab_map(dev, dst) < 0 || slab_map(dev, src) < 0)
                return -EIO;
        r = DRV(dev, cuMemcpyDtoDAsync)(dst->scrub_va + dst_off, src->scrub_va + src_off, bytes, dev->copy_stream);
        if (r != CUDA_SUCCESS) {
                driver_error(dev, "cuMemcpyDtoDAsync", r);
                return -EIO;
        }
        return 0;
}

/* Runs on the driver's thread when the notify stream reaches it, a piece copied: no Driver API calls here. */
static void copy_done(void *userdata) {
        PoolDevice *dev = userdata;
        uint64_t one = 1;

        atomic_fetch_add_explicit(&dev->copies_done, 1, memory_order_release);
        (void)!write(dev->pool->event_fd, &one, sizeof(one));
}

static bool copy_has_more(const CopyJob *job) {
        return job->i < job->n_dst && job->j < job->n_src;
}

/*
 * Queues the job's next piece, at most Pool.copy_piece bytes cut where its slabs are (two cursors over the two runs
 * of slabs), then its completion on the notify stream. 0, or -EIO (then some of the piece may be queued without
 * its completion).
 */
static int copy_piece(PoolDevice *dev, CopyJob *job) {
        uint64_t left = dev->pool->copy_piece;
        CUresult r;

        while (left > 0 && copy_has_more(job)) {
                Slab *dst = job->dst[job->i], *src = job->src[job->j];
                uint64_t bytes = MIN(MIN(dst->size - job->dst_off, src->size - job->src_off), left);

                if (copy_part(dev, dst, job->dst_off, src, job->src_off, bytes) < 0)
                        return -EIO;
                dev->stats.copied_bytes += bytes;
                left -= bytes;
                job->dst_off += bytes;
                job->src_off += bytes;
                if (job->dst_off == dst->size) {
                        job->i++;
                        job->dst_off = 0;
                }
                if (job->src_off == src->size) {
                        job->j++;
                        job->src_off = 0;
                }
        }
        r = DRV(dev, cuEventRecord)(dev->piece_copied, dev->copy_stream);
        if (r != CUDA_SUCCESS) {
                driver_error(dev, "cuEventRecord (copy)", r);
                return -EIO;
        }
        r = DRV(dev, cuStreamWaitEvent)(dev->notify_stream, dev->piece_copied, 0);
        if (r != CUDA_SUCCESS) {
                driver_error(dev, "cuStreamWaitEvent (copy)", r);
                return -EIO;
        }
        r = DRV(dev, cuLaunchHostFunc)(dev->notify_stream, copy_done, dev);
        if (r != CUDA_SUCCESS) {
                driver_error(dev, "cuLaunchHostFunc (copy)", r);
                return -EIO;
        }
        dev->copies_issued++;
        return 0;
}

/*
 * Ends a job: its last piece is queued, so its slabs' copy is done with the last completion queued; or it failed
 * (`failure`: why, in the driver's words), and what it queued is done (the stream was synchronized): its first dst
 * slab says so (pool_copy_result()).
 */
static void copy_end(PoolDevice *dev, CopyJob *job, const char *failure) {
        for (size_t k = 0; k < job->n_dst + job->n_src; k++)
                job->slabs[k]->copy_ticket = failure ? 0 : dev->copies_issued;
        for (size_t k = 0; k < job->n_dst; k++)
                job->dst[k]->copy_job = NULL;
        if (failure) {
                job->dst[0]->copy_failed = true;
                job->dst[0]->copy_error = strdup(failure);
        }
        list_unlink(&job->turn.link);
        free(job);
}

/*
 * One of the job's dst slabs was given back while its pieces are still to be queued (slab_after_copy()): once they
 * all are (the move was undone, or its lease ended), nobody will read the copy, so its other pieces are not
 * queued; its slabs wait for those that were.
 */
static void copy_dst_gone(PoolDevice *dev, CopyJob *job) {
        if (++job->dst_gone < job->n_dst)
                return;
        dev->stats.copies_dropped++;
        /* Its slabs wait for the last piece queued. A job with pieces left always has pieces on the stream
         * (copy_pump() stops only at POOL_COPY_AHEAD), so a completion still comes, and pool_dispatch() gives
         * them back then. */
        copy_end(dev, job, NULL);
}

/*
 * Queues pieces of the device's copies, users in turn, while the stream holds fewer than POOL_COPY_AHEAD (every piece
 * left, when `all`: before waiting for the stream). A job that fails to queue a piece ends failed, after what it
 * queued is done, and the pool's eventfd says so.
 */
static void copy_pump(PoolDevice *dev, bool all) {
        bool current = false;

        while (!list_is_empty(&dev->copies)) {
                CopyJob *job = container_of(turns_next(&dev->copies, dev->copy_last_uid), CopyJob, turn);
                uid_t uid = job->turn.uid;
                uint64_t one = 1;

                if (!all && dev->copies_issued - atomic_load_explicit(&dev->copies_done, memory_order_acquire) >=
                                    POOL_COPY_AHEAD)
                        return;
                if ((!current && make_current(dev) < 0) || copy_piece(dev, job) < 0) {
                        char failure[sizeof(dev->pool->last_error)];

                        /* Some of it may be queued, and nothing would say when it is done: wait for it. */
                        memcpy(failure, dev->pool->last_error, sizeof(failure));
                        (void)copies_sync(dev);
                        copy_end(dev, job, failure);
                        (void)!write(dev->pool->event_fd, &one, sizeof(one));
                        continue;
                }
                current = true;
                dev->copy_last_uid = uid;
                if (!copy_has_more(job)) {
                        copy_end(dev, job, NULL);
                        job = NULL;
                }
                turns_rotate(&dev->copies, uid, job ? &job->turn : NULL);
        }
}

int pool_copy_start(Pool *p, uid_t uid, Slab *const *dst, size_t n_dst, Slab *const *src, size_t n_src) {
        PoolDevice *dev;
        CopyJob *job;

        if (n_dst == 0 || n_src == 0)
                return -EINVAL;
        dev = dst[0]->device;
        job = calloc(1, sizeof(*job) + (n_dst + n_src) * sizeof(Slab *));
        if (!job)
                return -ENOMEM;
        job->turn.uid = uid;
        job->dst = job->slabs;
        job->src = job->slabs + n_dst;
        job->n_dst = n_dst;
        job->n_src = n_src;
        memcpy(job->dst, dst, n_dst * sizeof(Slab *));
        memcpy(job->src, src, n_src * sizeof(Slab *));
        for (size_t k = 0; k < n_dst + n_src; k++)
                job->slabs[k]->copy_ticket = COPY_PENDING;
        for (size_t k = 0; k < n_dst; k++) {
                dst[k]->copy_failed = false;
                dst[k]->copy_error = mfree(dst[k]->copy_error);
                dst[k]->copy_job = job;
        }
        list_link_tail(&dev->copies, &job->turn.link);
        copy_pump(dev, false);
        return dst[0]->copy_failed ? pool_copy_result(p, dst[0]) : 0;    /* POOL_E_DRIVER, said as it failed */
}

int pool_copy_result(Pool *p, const Slab *slab) {
        if (slab_copying(slab->device, slab))
                return POOL_E_COPYING;
        if (!slab->copy_failed)
                return 0;
        if (slab->copy_error)
                set_error(p, "%s", slab->copy_error);  /* the copy's own failure, not the pool's last since */
        return POOL_E_DRIVER;
}

/* --- the pool ------------------------------------------------------------------------------------------- */

/* A size as vmmbroker.conf takes it: "2M", "1K", "1500". */
static char *config_size(uint64_t bytes, char *buf, size_t len) {
        static const char suffixes[] = "KMGT";
        int i = -1;

        while (i < 3 && bytes >= 1024 && bytes % 1024 == 0) {
                bytes /= 1024;
                i++;
        }
        snprintf(buf, len, "%" PRIu64 "%.*s", bytes, i >= 0, i >= 0 ? &suffixes[i] : "");
        return buf;
}

/* HostReserve= against the rest of the configuration: whole host slabs of HostSlab=, and parking on. */
static int host_reserve_check(const PoolConfig *config, uint64_t host_slab, char **ret_message) {
        char b1[32], b2[32];

        if (config->host_reserve == 0)
                return 0;
        if (config->no_host) {
                set_message(ret_message, "HostReserve=%s asks for host memory for parked leases, but HostCapacity=0 "
                            "turns parking off: remove one of the two.",
                            config_size(config->host_reserve, b1, sizeof(b1)));
                return -EINVAL;
        }
        if (config->host_reserve % host_slab != 0) {
                set_message(ret_message, "HostReserve=%s is not a whole number of host slabs of HostSlab=%s, the "
                            "pieces it is pinned in: make it a multiple of %s.",
                            config_size(config->host_reserve, b1, sizeof(b1)), config_size(host_slab, b2, sizeof(b2)),
                            b2);
                return -EINVAL;
        }
        return 0;
}

/*
 * The sentence for a capacity below the device's granularity, e.g. "Capacity=1K gives device 0 a pool of
 * 1 KiB, less than its allocation granularity (2 MiB): it could lease nothing. Set Capacity= to at least 2M."
 */
static void capacity_message(const PoolDevice *dev, const PoolConfig *config, uint64_t free_mem,
                             char **ret_message) {
        char asked[FORMAT_SIZE_MAX], pool[FORMAT_SIZE_MAX], free_s[FORMAT_SIZE_MAX], gran[FORMAT_SIZE_MAX],
                min[FORMAT_SIZE_MAX];
        unsigned percent = config->capacity_percent ?: POOL_DEFAULT_CAPACITY_PERCENT;

        if (dev->mem.capacity % 1024 == 0)
                format_size(dev->mem.capacity, pool, sizeof(pool));
        else    /* "2.0 MiB" would hide why 2097151 bytes are too few */
                snprintf(pool, sizeof(pool), "%" PRIu64 " bytes", dev->mem.capacity);
        format_size(dev->info.granularity, gran, sizeof(gran));
        config_size(dev->info.granularity, min, sizeof(min));
        if (config->capacity > 0)
                set_message(ret_message, "Capacity=%s gives device %d a pool of %s, less than its allocation "
                            "granularity (%s): it could lease nothing. Set Capacity= to at least %s.",
                            config_size(config->capacity, asked, sizeof(asked)), dev->info.index, pool, gran, min);
        else
                set_message(ret_message, "Capacity=%u%% gives device %d a pool of %s (%u%% of the %s free at "
                            "start), less than its allocation granularity (%s): it could lease nothing. Free "
                            "memory on the device, or set Capacity= to a larger share or to at least %s.",
                            percent, dev->info.index, pool, percent, format_size(free_mem, free_s, sizeof(free_s)),
                            gran, min);
}

static int space_init(PoolDevice *dev, SlabSpace *space, bool host) {
        space->device = dev;
        space->host = host;
        list_init(&space->lru);
        list_init(&space->leased);
        return hashmap_init(&space->cache, &bucket_type);
}

/* The host memory a device may pin for parked leases: HostCapacity=, rounded down to the granularity. */
static void host_init(Pool *p, PoolDevice *dev, const PoolConfig *config, size_t n_devices) {
        CUmemAllocationProp prop = cuda_host_prop(dev->info.numa_node);
        size_t granularity = 0;
        uint64_t capacity;
        long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
        CUresult r;

        r = DRV(dev, cuMemGetAllocationGranularity)(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
        if (r != CUDA_SUCCESS || granularity == 0 || !IS_POWER_OF_2(granularity)) {
                /* Not fatal: the device serves leases, and Park says why it cannot. */
                driver_error(dev, "cuMemGetAllocationGranularity (host memory)", r);
                return;
        }
        dev->host.granularity = granularity;
        if (config->no_host)
                return;                 /* capacity 0: no parking */
        if (config->host_capacity > 0)
                capacity = config->host_capacity;
        else {
                uint64_t physical = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : 0;

                capacity = physical / 100 * (config->host_capacity_percent ?: POOL_DEFAULT_HOST_CAPACITY_PERCENT) /
                           (n_devices ?: 1);
        }
        dev->host.capacity = capacity - capacity % granularity;
}

/* Destroys the device's streams and the copy stream's event, those that were made. */
static void streams_destroy(PoolDevice *dev) {
        if (dev->stream)
                (void)DRV(dev, cuStreamDestroy)(dev->stream);
        if (dev->copy_stream)
                (void)DRV(dev, cuStreamDestroy)(dev->copy_stream);
        if (dev->notify_stream)
                (void)DRV(dev, cuStreamDestroy)(dev->notify_stream);
        if (dev->piece_copied)
                (void)DRV(dev, cuEventDestroy)(dev->piece_copied);
        dev->stream = dev->copy_stream = dev->notify_stream = NULL;
        dev->piece_copied = NULL;
}

static int device_init(Pool *p, PoolDevice *dev, int index, const PoolConfig *config, size_t n_devices,
                       char **ret_message) {
        size_t free_mem = 0, total = 0;
        CUresult r;
        int k;

        dev->pool = p;
        list_init(&dev->queued);
        list_init(&dev->scrubbing);
        list_init(&dev->unmapped);
        list_init(&dev->after_copy);
        list_init(&dev->copies);
        dev->copy_last_uid = UID_UNBOUND;
        k = space_init(dev, &dev->mem, false);
        if (k < 0)
                return k;
        k = space_init(dev, &dev->host, true);
        if (k < 0)
                return k;

        k = cuda_device_probe(p->cu, index, &dev->info, ret_message);
        if (k < 0)
                return k;
        if (p->max_slab < dev->info.granularity) {
                set_message(ret_message, "The maximum slab size (%" PRIu64 " bytes) is smaller than the "
                                            "allocation granularity of device %d (%" PRIu64 " bytes).",
                                            p->max_slab, index, dev->info.granularity);
                return -EINVAL;
        }

        r = DRV(dev, cuDevicePrimaryCtxRetain)(&dev->ctx, dev->info.device);
        if (r != CUDA_SUCCESS) {
                set_message(ret_message, "Cannot open a context on CUDA device %d: %s.", index,
                                            cuda_result_name(p->cu, r));
                return -ENODEV;
        }
        k = make_current(dev);
        if (k < 0)
                goto fail;
        r = DRV(dev, cuStreamCreate)(&dev->stream, CU_STREAM_NON_BLOCKING);
        if (r == CUDA_SUCCESS)
                r = DRV(dev, cuStreamCreate)(&dev->copy_stream, CU_STREAM_NON_BLOCKING);
        if (r == CUDA_SUCCESS)
                r = DRV(dev, cuStreamCreate)(&dev->notify_stream, CU_STREAM_NON_BLOCKING);
        if (r != CUDA_SUCCESS) {
                driver_error(dev, "cuStreamCreate", r);
                k = -EIO;
                goto fail;
        }
        r = DRV(dev, cuEventCreate)(&dev->piece_copied, CU_EVENT_DISABLE_TIMING);
        if (r != CUDA_SUCCESS) {
                driver_error(dev, "cuEventCreate", r);
                k = -EIO;
                goto fail;
        }

        if (config->capacity > 0)
                dev->mem.capacity = config->capacity;
        else {
                r = DRV(dev, cuMemGetInfo)(&free_mem, &total);
                if (r != CUDA_SUCCESS) {
                        driver_error(dev, "cuMemGetInfo", r);
                        k = -EIO;
                        goto fail;
                }
                dev->mem.capacity = (uint64_t)free_mem / 100 *
                                    (config->capacity_percent ?: POOL_DEFAULT_CAPACITY_PERCENT);
        }
        if (dev->mem.capacity < dev->info.granularity) {
                /* a pool that could not hold one slab would start and refuse every Alloc */
                capacity_message(dev, config, free_mem, ret_message);
                k = -EINVAL;
                goto release;
        }
        dev->mem.capacity -= dev->mem.capacity % dev->info.granularity;
        dev->mem.granularity = dev->info.granularity;
        host_init(p, dev, config, n_devices);
        if (dev->host.granularity > 0 && p->host_slab % dev->host.granularity != 0) {
                set_message(ret_message, "HostSlab= (%" PRIu64 " bytes) is not a multiple of device %d's host memory "
                            "granularity (%" PRIu64 " bytes): raise it.", p->host_slab, index, dev->host.granularity);
                k = -EINVAL;
                goto release;
        }

        dev->stats.index = index;
        dev->stats.name = dev->info.name;
        dev->stats.total = dev->info.total_memory;
        dev->stats.granularity = dev->info.granularity;
        dev->stats.numa_node = dev->info.numa_node;
        return 0;

fail:
        set_message(ret_message, "Cannot set up CUDA device %d: %s.", index, p->last_error);
release:
        streams_destroy(dev);
        (void)DRV(dev, cuDevicePrimaryCtxRelease)(dev->info.device);
        dev->ctx = NULL;
        return k;
}

static void space_done(SlabSpace *space) {
        Slab *slab, *tmp;

        list_for_each_entry_safe(slab, tmp, &space->leased, link_state) {
                list_unlink(&slab->link_state);
                slab_release(slab);
        }
        while (release_oldest(space))
                ;
        hashmap_done(&space->cache);
}

static void device_done(PoolDevice *dev) {
        Slab *slab, *tmp;

        if (!dev->ctx) {
                hashmap_done(&dev->mem.cache);
                hashmap_done(&dev->host.cache);
                return;
        }
        copy_pump(dev, true);
        if (make_current(dev) == 0 && dev->copy_stream)
                (void)copies_sync(dev);
        (void)after_copy_finish(dev, true);
        if (dev->stream)
                (void)DRV(dev, cuStreamSynchronize)(dev->stream);
        list_for_each_entry_safe(slab, tmp, &dev->queued, link_state) {
                list_unlink(&slab->link_state);
                dev->pool->n_queued--;
                slab_release(slab);
        }
        list_for_each_entry_safe(slab, tmp, &dev->scrubbing, link_state) {
                list_unlink(&slab->link_state);
                slab_release(slab);
        }
        space_done(&dev->mem);
        space_done(&dev->host);
        streams_destroy(dev);
        (void)DRV(dev, cuDevicePrimaryCtxRelease)(dev->info.device);
        dev->ctx = NULL;
}

Pool *pool_free(Pool *p) {
        if (!p)
                return NULL;
        maker_stop(p);
        for (size_t i = 0; i < p->n_devices; i++)
                device_done(&p->devices[i]);
        flush_closes(p);
        free(p->closing);
        free(p->devices);
        safe_close(p->event_fd);
        (void)pthread_mutex_destroy(&p->make_lock);
        hashmap_done(&p->live_tickets);
        free(p);
        return NULL;
}

DEFINE_TRIVIAL_CLEANUP_FUNC(Pool, pool_free);

int pool_new(Pool **ret, CudaDriver *cu, const PoolConfig *config, char **ret_message) {
        _cleanup_(pool_freep) Pool *p = NULL;
        static const PoolConfig defaults = {};
        int count = 0, k;
        CUresult r;

        if (!config)
                config = &defaults;

        p = calloc(1, sizeof(*p));
        if (!p)
                return -ENOMEM;
        p->cu = cu;
        p->event_fd = -EBADF;
        (void)pthread_mutex_init(&p->make_lock, NULL);
        list_init(&p->make_queue);
        list_init(&p->make_done);
        list_init(&p->make_live);
        list_init(&p->made_bound);
        k = hashmap_init(&p->live_tickets, &request_by_ticket);
        if (k < 0)
                return k;
        p->max_slab = config->max_slab ? config->max_slab : POOL_DEFAULT_MAX_SLAB;
        if (!IS_POWER_OF_2(p->max_slab)) {
                set_message(ret_message, "The maximum slab size (%" PRIu64 " bytes) is not a "
                                            "power of two.", p->max_slab);
                return -EINVAL;
        }
        p->host_slab = pool_host_slab(p->max_slab, config->host_slab);
        p->copy_piece = config->copy_piece ?: POOL_DEFAULT_COPY_PIECE;
        if (!IS_POWER_OF_2(p->host_slab) || p->max_slab / p->host_slab > POOL_HOST_PIECES_MAX) {
                char b1[32], b2[32];

                set_message(ret_message, "HostSlab=%s must be a power of two of at least MaxSlab=%s / %d, so that a "
                            "parked lease needs at most %d host slabs: raise it, or lower MaxSlab=.",
                            config_size(config->host_slab, b1, sizeof(b1)), config_size(p->max_slab, b2, sizeof(b2)),
                            POOL_HOST_PIECES_MAX, POOL_MAX_HOST_SLABS);
                return -EINVAL;
        }
        k = host_reserve_check(config, p->host_slab, ret_message);
        if (k < 0)
                return k;
        p->host_reserve = config->host_reserve;

        p->event_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (p->event_fd < 0)
                return -errno;

        if (config->devices)
                count = (int)config->n_devices;
        else {
                r = cu->cuDeviceGetCount(&count);
                if (r != CUDA_SUCCESS)
                        count = 0;
        }
        if (count <= 0) {
                set_message(ret_message, "No CUDA device to serve.");
                return -ENODEV;
        }
        p->devices = calloc((size_t)count, sizeof(*p->devices));
        if (!p->devices)
                return -ENOMEM;

        for (int i = 0; i < count; i++) {
                int index = config->devices ? config->devices[i] : i;

                if (pool_find_device(p, index) >= 0) {
                        set_message(ret_message, "CUDA device %d is listed twice.", index);
                        return -EINVAL;
                }
                k = device_init(p, &p->devices[i], index, config, (size_t)count, ret_message);
                if (k < 0) {
                        /* a device that failed is not pool_free()'s */
                        hashmap_done(&p->devices[i].mem.cache);
                        hashmap_done(&p->devices[i].host.cache);
                        return k;
                }
                p->n_devices++;
        }
        for (size_t i = 0; i < p->n_devices; i++) {
                const SlabSpace *host = &p->devices[i].host;
                char b1[32], b2[32];

                if (host->granularity > 0 && p->host_reserve > host->capacity) {
                        set_message(ret_message, "HostReserve=%s is more than the host memory device %d may pin "
                                    "for parked leases (HostCapacity= gives it %s): lower HostReserve= or raise "
                                    "HostCapacity=.", config_size(p->host_reserve, b1, sizeof(b1)),
                                    p->devices[i].info.device, config_size(host->capacity, b2, sizeof(b2)));
                        return -EINVAL;
                }
        }

        *ret = TAKE_PTR(p);
        return 0;
}

/*
 * Ticks after a slab is made before the pool maps it ahead: 2, so that at least a whole tick (a second) passes.
 * Its client imports and maps it as soon as the Alloc is answered, and that time is the request's: the pool's
 * mapping of the same memory then could only compete with it in the driver (not measured; the driver's lock
 * while it pins host memory, measured, is map_due()'s).
 */
#define MAP_AHEAD_TICKS 2

/*
 * The oldest slab of the device that is due to be mapped ahead, or NULL. None while the maker thread makes host
 * slabs: the driver pins their memory under a lock that a mapping in the loop then waits for, for up to a
 * second (the first park of a fresh 32 GiB lease, on an H200: idle dispatches of up to 1 s). They are due
 * again once the pool has dispatched every slab made (pool_making() false).
 */
static Slab *map_due(const PoolDevice *dev) {
        Slab *slab = list_first_entry(&dev->unmapped, Slab, link_unmapped);

        if (!slab || pool_making(dev->pool))
                return NULL;
        return slab->made_tick + MAP_AHEAD_TICKS <= dev->pool->ticks ? slab : NULL;
}

/*
 * Maps one due slab ahead (pool_idle()), of the first device that has one. A slab that cannot be mapped now
 * leaves the list all the same (each call makes progress): its first zeroing or copy maps it, or fails and says
 * why, as without mapping ahead. Returns whether it tried one.
 */
static bool map_ahead(Pool *p) {
        for (size_t i = 0; i < p->n_devices; i++) {
                PoolDevice *dev = &p->devices[i];
                Slab *slab = map_due(dev);

                if (!slab)
                        continue;
                if (make_current(dev) < 0 || slab_map(dev, slab) < 0)
                        list_unlink(&slab->link_unmapped);
                else
                        dev->stats.mapped_ahead++;
                return true;
        }
        return false;
}

void pool_tick(Pool *p) {
        p->ticks++;
}

bool pool_idle(Pool *p) {
        PoolDevice *dev = &p->devices[0];
        uint64_t size = dev->info.granularity;
        bool done = flush_closes(p) > 0;
        Slab *slab;

        done |= map_ahead(p);
        if (!p->prime)
                return done;
        /* One export absorbs the driver's slow path; its slab waits, unbound, for the next request. */
        p->prime = false;
        if (dev->mem.created_bytes + size > dev->mem.capacity || slab_create(&dev->mem, size, UID_UNBOUND, &slab) != 0)
                return true;
        slab->last_used = ++p->clock;
        if (cache_insert(slab) < 0)
                slab_release(slab);
        else
                dev->stats.primed++;
        return true;
}

bool pool_has_idle_work(const Pool *p) {
        if (p->n_closing > 0 || p->prime)
                return true;
        for (size_t i = 0; i < p->n_devices; i++)
                if (map_due(&p->devices[i]))
                        return true;
        return false;
}

unsigned pool_trim(Pool *p) {
        unsigned n = 0;

        for (size_t i = 0; i < p->n_devices; i++) {
                while (release_oldest(&p->devices[i].mem))
                        n++;
                while (release_oldest(&p->devices[i].host))
                        n++;
        }
        return n;
}

int pool_use_device(Pool *p, size_t i) {
        return make_current(&p->devices[i]);
}

size_t pool_n_devices(Pool *p) {
        return p->n_devices;
}

void pool_device_stats(Pool *p, size_t i, PoolDeviceStats *ret) {
        PoolDevice *dev = &p->devices[i];

        *ret = dev->stats;
        ret->capacity = dev->mem.capacity;
        ret->leased = dev->mem.leased_bytes;
        ret->scrubbing = dev->mem.scrubbing_bytes;
        ret->cached = dev->mem.cached_bytes;
        ret->n_leased = dev->mem.n_leased;
        ret->n_scrubbing = dev->mem.n_scrubbing;
        ret->n_cached = dev->mem.n_cached;
        ret->host_granularity = dev->host.granularity;
        ret->host_capacity = dev->host.capacity;
        ret->parked = dev->host.leased_bytes;
        ret->host_scrubbing = dev->host.scrubbing_bytes;
        ret->host_cached = dev->host.cached_bytes;
        ret->n_parked = dev->host.n_leased;
}
