/* SPDX-License-Identifier: MIT */

/*
 * The slab pool against the simulated device: caching, isolation between
 * uids, LRU eviction, capacity, asynchronous scrubbing, and requests that fail
 * in the driver leaving the pool as it was.
 */

#include <check.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "driver.h"
#include "macro.h"
#include "pool.h"
#include "simcuda.h"
#include "unit.h"

#define MiB (UINT64_C(1) << 20)
#define UID_A 1000
#define UID_B 1001
#define UID_C 1002

static CudaDriver *cu;
static Pool *pool;

/* The simulator's test hooks, from the same library the driver layer loaded. */
static struct {
        void (*hold_streams)(int);
        unsigned long (*live_allocations)(void);
        int (*inject)(const char *);
        uint64_t (*calls)(const char *entry);
} sim;

static void open_driver(void) {
        _cleanup_free_ char *message = NULL;
        void *lib;

        ck_assert_msg(cuda_driver_open(&cu, NULL, &message) == 0, "%s", message);
        lib = dlopen(cu->path, RTLD_NOW | RTLD_NOLOAD);
        ck_assert_ptr_nonnull(lib);
        sim.hold_streams = (void (*)(int))dlsym(lib, "simcuda_hold_streams");
        sim.live_allocations = (unsigned long (*)(void))dlsym(lib, "simcuda_live_allocations");
        sim.inject = (int (*)(const char *))dlsym(lib, "simcuda_fail");
        sim.calls = (uint64_t (*)(const char *))dlsym(lib, "simcuda_calls");
        ck_assert(sim.hold_streams && sim.live_allocations && sim.inject && sim.calls);
        dlclose(lib);
}

static void open_pool(uint64_t capacity, uint64_t max_slab) {
        _cleanup_free_ char *message = NULL;
        PoolConfig config = { .capacity = capacity, .max_slab = max_slab };

        open_driver();
        ck_assert_msg(pool_new(&pool, cu, &config, &message) == 0, "%s", message);
        ck_assert_int_eq(pool_use_device(pool, 0), 0);
}

static void teardown(void) {
        pool = pool_free(pool);
        if (cu) {
                ck_assert_uint_eq(sim.live_allocations(), 0);
                cu = cuda_driver_close(cu);
        }
}

static PoolDeviceStats stats(void) {
        PoolDeviceStats s;

        pool_device_stats(pool, 0, &s);
        return s;
}

/* Waits (on the pool's eventfd, no sleeping) until `n` more scrubs have completed. */
static void wait_scrubs(unsigned n) {
        unsigned done = 0;

        while (done < n) {
                struct pollfd p = { .fd = pool_get_fd(pool), .events = POLLIN };

                ck_assert_int_eq(poll(&p, 1, 30000), 1);
                done += pool_dispatch(pool);
        }
        ck_assert_uint_eq(done, n);
}

/* The driver calls that wait, so far: a test that must not wait checks this did not move. */
static uint64_t sync_calls(void) {
        return sim.calls("cuEventSynchronize") + sim.calls("cuStreamSynchronize");
}

static int alloc(uint64_t size, uid_t uid, Slab **slabs, size_t *n) {
        return pool_alloc(pool, 0, size, uid, slabs, n);
}

/* Reclaims the slabs and issues their scrubs, as the daemon does once its reply is sent. */
static void reclaim_all(Slab **slabs, size_t n) {
        for (size_t i = 0; i < n; i++)
                pool_reclaim(pool, slabs[i]);
        pool_scrub_queued(pool);
}

/* Maps a lease's slabs as a client would: its address; sizes[] (for cuda_unmap()) and *ret_total filled. */
static CUdeviceptr lease_map(Slab **slabs, size_t n, uint64_t sizes[static POOL_MAX_SLABS], uint64_t *ret_total) {
        _cleanup_free_ char *message = NULL;
        int fds[POOL_MAX_SLABS] = {};
        CUdeviceptr va;

        *ret_total = 0;
        for (size_t i = 0; i < n; i++) {
                fds[i] = slabs[i]->fd;
                sizes[i] = slabs[i]->size;
                *ret_total += sizes[i];
        }
        ck_assert_msg(cuda_map_fds(cu, 0, fds, sizes, n, false, &va, &message) == 0, "%s", message);
        return va;
}

/* Maps a lease as a client would and either fills it with `fill` or checks it reads `expect`. */
static void lease_io(Slab **slabs, size_t n, int fill, int expect) {
        uint64_t sizes[POOL_MAX_SLABS] = {}, total;
        _cleanup_free_ uint8_t *host = NULL;
        CUdeviceptr va = lease_map(slabs, n, sizes, &total);

        if (fill >= 0)
                ck_assert_int_eq(cu->cuMemsetD8(va, (unsigned char)fill, total), CUDA_SUCCESS);
        else {
                host = malloc(total);
                ck_assert_ptr_nonnull(host);
                ck_assert_int_eq(cu->cuMemcpyDtoH(host, va, total), CUDA_SUCCESS);
                for (uint64_t i = 0; i < total; i++)
                        if (host[i] != expect)
                                ck_abort_msg("byte %" PRIu64 " of the lease reads %#x, expected %#x", i, host[i],
                                             expect);
        }
        ck_assert_int_eq(cuda_unmap(cu, va, sizes, n), 0);
}

/* The parts of the stats that describe the pool's state (not its history). */
static void assert_same_state(PoolDeviceStats a, PoolDeviceStats b) {
        ck_assert_uint_eq(a.leased, b.leased);
        ck_assert_uint_eq(a.cached, b.cached);
        ck_assert_uint_eq(a.scrubbing, b.scrubbing);
        ck_assert_uint_eq(a.n_leased, b.n_leased);
        ck_assert_uint_eq(a.n_cached, b.n_cached);
        ck_assert_uint_eq(a.n_scrubbing, b.n_scrubbing);
        ck_assert_uint_eq(a.created - a.released, b.created - b.released);
}

START_TEST(test_plan) {
        uint64_t s[POOL_MAX_SLABS + 8];
        const uint64_t G = 1024 * MiB;

        ck_assert_uint_eq(pool_plan(0, 2 * MiB, G, s, ELEMENTSOF(s)), 0);
        ck_assert_uint_eq(pool_plan(UINT64_MAX, 2 * MiB, G, s, ELEMENTSOF(s)), 0);

        ck_assert_uint_eq(pool_plan(1, 2 * MiB, G, s, ELEMENTSOF(s)), 1);
        ck_assert_uint_eq(s[0], 2 * MiB);

        /* 3 MiB rounds up to 4 MiB: one slab, not two. */
        ck_assert_uint_eq(pool_plan(3 * MiB, 2 * MiB, G, s, ELEMENTSOF(s)), 1);
        ck_assert_uint_eq(s[0], 4 * MiB);

        /* Any multiple of the granularity up to the maximum slab is one slab of exactly that size. */
        ck_assert_uint_eq(pool_plan(66 * MiB, 2 * MiB, G, s, ELEMENTSOF(s)), 1);
        ck_assert_uint_eq(s[0], 66 * MiB);
        ck_assert_uint_eq(pool_plan(677 * MiB, 2 * MiB, G, s, ELEMENTSOF(s)), 1);
        ck_assert_uint_eq(s[0], 678 * MiB);
        ck_assert_uint_eq(pool_plan(G, 2 * MiB, G, s, ELEMENTSOF(s)), 1);
        ck_assert_uint_eq(s[0], G);

        /* 3 GiB + 1022 MiB: three maximum slabs, then one of 1022 MiB. */
        ck_assert_uint_eq(pool_plan(3 * G + 1022 * MiB, 2 * MiB, G, s, ELEMENTSOF(s)), 4);
        ck_assert_uint_eq(s[2], G);
        ck_assert_uint_eq(s[3], 1022 * MiB);

        /* Counting only, and counts past the fd limit are reported for the caller to refuse. */
        ck_assert_uint_eq(pool_plan(300 * G, 2 * MiB, G, NULL, 0), 300);
        ck_assert_uint_eq(pool_plan(300 * G, 2 * MiB, G, s, 4), 300);
}
END_TEST

START_TEST(test_fresh_then_cached) {
        Slab *a[POOL_MAX_SLABS], *b[POOL_MAX_SLABS];
        PoolDeviceStats s;
        uint64_t calls;
        size_t n, m;

        open_pool(64 * MiB, 4 * MiB);  /* 6 MiB is two slabs, 4 + 2 */
        calls = stats().driver_calls;
        ck_assert_int_eq(alloc(6 * MiB, UID_A, a, &n), 0);
        ck_assert_uint_eq(n, 2);
        ck_assert_uint_eq(a[0]->size, 4 * MiB);
        ck_assert_uint_eq(a[1]->size, 2 * MiB);
        ck_assert_int_ge(a[0]->fd, 0);
        ck_assert_int_ne(a[0]->fd, a[1]->fd);
        s = stats();
        ck_assert_uint_eq(s.leased, 6 * MiB);
        ck_assert_uint_eq(s.created, 2);
        /* A fresh slab costs one create and one export, nothing else. */
        ck_assert_uint_eq(s.driver_calls - calls, 4);

        lease_io(a, n, 0, 0);           /* fresh memory reads zero */
        lease_io(a, n, 0xab, -1);       /* the holder dirties it */
        reclaim_all(a, n);
        s = stats();
        ck_assert_uint_eq(s.leased, 0);
        ck_assert_uint_eq(s.scrubbing, 6 * MiB);
        wait_scrubs(2);
        s = stats();
        ck_assert_uint_eq(s.scrubbing, 0);
        ck_assert_uint_eq(s.cached, 6 * MiB);
        ck_assert_uint_eq(s.n_cached, 2);

        calls = s.driver_calls;
        ck_assert_int_eq(alloc(6 * MiB, UID_A, b, &m), 0);
        s = stats();
        ck_assert_uint_eq(s.driver_calls, calls);       /* a cached hit costs no driver call */
        ck_assert_uint_eq(s.hits, 2);
        ck_assert_uint_eq(s.created, 2);
        ck_assert_ptr_eq(b[0], a[0]);
        ck_assert_ptr_eq(b[1], a[1]);
        lease_io(b, m, -1, 0);          /* and it was scrubbed */
        reclaim_all(b, m);
}
END_TEST

START_TEST(test_scrubbing_slab_waited_for) {
        Slab *a[POOL_MAX_SLABS], *b[POOL_MAX_SLABS];
        size_t n, m;

        open_pool(64 * MiB, 0);
        ck_assert_int_eq(alloc(2 * MiB, UID_A, a, &n), 0);
        lease_io(a, n, 0x5a5a5a5a, 0);
        reclaim_all(a, n);
        ck_assert_uint_eq(stats().n_scrubbing, 1);

        /* The only slab of that size is being scrubbed (nothing dispatched its completion): the request waits
         * for the scrub and takes it back, zeroed, rather than create one more. The scrub counts as finished
         * (pool_scrubs_finished()), though its completion is not dispatched yet, nor will be found then. */
        ck_assert_uint_eq(pool_scrubs_finished(pool), 0);
        ck_assert_int_eq(alloc(2 * MiB, UID_A, b, &m), 0);
        ck_assert_ptr_eq(b[0], a[0]);
        ck_assert_uint_eq(pool_scrubs_finished(pool), 1);
        lease_io(b, m, -1, 0);
        ck_assert_uint_eq(stats().created, 1);
        ck_assert_uint_eq(stats().scrub_waits, 1);
        reclaim_all(b, m);
}
END_TEST

/* The scrubs issued before the one waited for are done too (the stream zeroes in order): they are cached with
 * it, and the scrubs queued after it are left to their completions. */
START_TEST(test_scrubs_before_the_waited_one_cached) {
        Slab *a[POOL_MAX_SLABS], *b[POOL_MAX_SLABS], *c[POOL_MAX_SLABS], *d[POOL_MAX_SLABS];
        PoolDeviceStats s;
        size_t n, m, k, l;

        open_pool(64 * MiB, 0);
        ck_assert_int_eq(alloc(4 * MiB, UID_B, a, &n), 0);
        ck_assert_int_eq(alloc(2 * MiB, UID_A, b, &m), 0);
        ck_assert_int_eq(alloc(8 * MiB, UID_C, c, &k), 0);
        reclaim_all(a, n);              /* scrubbed in this order: 4, 2, 8 MiB */
        reclaim_all(b, m);
        reclaim_all(c, k);
        pool_scrub_queued(pool);
        ck_assert_uint_eq(stats().n_scrubbing, 3);

        ck_assert_int_eq(alloc(2 * MiB, UID_A, d, &l), 0);
        ck_assert_ptr_eq(d[0], b[0]);
        s = stats();
        ck_assert_uint_eq(s.scrub_waits, 1);
        ck_assert_uint_eq(pool_scrubs_finished(pool), 2);       /* the 4 MiB one before it too */
        ck_assert_uint_eq(s.n_cached, 1);
        ck_assert_uint_eq(s.cached, 4 * MiB);
        ck_assert_uint_eq(s.n_scrubbing, 1);                    /* the 8 MiB one: nothing dispatched yet */
        /* One dispatch once the stream is idle, not wait_scrubs(): a dispatch that finds only the completions
         * of the two scrubs finished ahead moves the count by design (pool_dispatch()), and whether one runs
         * before the 8 MiB completion depends on the driver thread's timing. */
        ck_assert_int_eq(pool_drain(pool), 0);
        s = stats();
        ck_assert_uint_eq(s.n_scrubbing, 0);
        ck_assert_uint_eq(s.n_cached, 2);
        ck_assert_uint_eq(pool_scrubs_finished(pool), 3);       /* each counted once */
        reclaim_all(d, l);
}
END_TEST

/*
 * A device full only because memory just freed is still queued or being scrubbed: a request of another size,
 * or another uid's, waits for as much of that zeroing as it needs instead of failing, and the rest of the
 * queue is not waited for. Memory that would not make room even once scrubbed is not waited for at all.
 */
START_TEST(test_full_device_waits_for_scrubs) {
        Slab *a[POOL_MAX_SLABS], *b[POOL_MAX_SLABS], *c[POOL_MAX_SLABS], *d[POOL_MAX_SLABS];
        PoolDeviceStats s;
        uint64_t syncs, finished;
        size_t n, m, k, l;

        open_pool(16 * MiB, 0);
        ck_assert_int_eq(alloc(8 * MiB, UID_A, a, &n), 0);
        ck_assert_int_eq(alloc(4 * MiB, UID_A, b, &m), 0);
        ck_assert_int_eq(alloc(4 * MiB, UID_B, c, &k), 0);
        lease_io(a, n, 0x3c, 0);
        pool_reclaim(pool, a[0]);                       /* queued: no scrub issued yet */
        pool_reclaim(pool, b[0]);

        /* 6 MiB for uid B: the 8 MiB slab's scrub is enough; the 4 MiB one behind it is not waited for (nothing
         * dispatched it: it is still scrubbing), nor is the stream. */
        syncs = sim.calls("cuStreamSynchronize");
        ck_assert_int_eq(alloc(6 * MiB, UID_B, d, &l), 0);
        ck_assert_uint_eq(sim.calls("cuStreamSynchronize"), syncs);
        lease_io(d, l, -1, 0);
        s = stats();
        ck_assert_uint_eq(s.leased, 10 * MiB);
        ck_assert_uint_eq(s.scrub_waits, 1);
        ck_assert_uint_eq(s.scrubbing, 4 * MiB);
        ck_assert_uint_eq(s.created - s.released, 3);

        /* 8 MiB more: even with every scrub done there is no room (18 of 16 MiB). Refused, with no wait and
         * nothing changed. */
        ck_assert_int_eq(alloc(8 * MiB, UID_A, a, &n), POOL_E_NOMEM);
        assert_same_state(stats(), s);
        ck_assert_uint_eq(stats().scrub_waits, 1);

        /* Both leases freed, the first scrub issued fails (its slab is released: room too): 12 MiB for uid A
         * gets that room and waits for the rest it needs. */
        pool_reclaim(pool, c[0]);
        pool_reclaim(pool, d[0]);
        ck_assert_int_eq(sim.inject("cuMemsetD8Async:1:CUDA_ERROR_UNKNOWN"), 0);
        finished = pool_scrubs_finished(pool);
        ck_assert_int_eq(alloc(12 * MiB, UID_A, a, &n), 0);
        ck_assert_uint_eq(pool_scrubs_finished(pool), finished + 3);   /* the failed one, and the two waited for */
        lease_io(a, n, -1, 0);
        s = stats();
        ck_assert_uint_eq(s.leased, 12 * MiB);
        ck_assert_uint_eq(s.scrub_waits, 2);
        reclaim_all(a, n);
        wait_scrubs(stats().n_scrubbing);
}
END_TEST

/*
 * pool_alloc_bounded(): a request whose memory is behind more zeroing than it may wait for gets
 * POOL_E_SCRUBBING, nothing changed and nothing waited for, whether it needs its size's slab just freed or
 * room on a full device; once the scrubs are done (dispatched), the same request is served, zeroed. Streams
 * are held meanwhile, so that the zeroing cannot be done before the request comes.
 */
START_TEST(test_scrub_wait_bounded) {
        Slab *a[POOL_MAX_SLABS], *b[POOL_MAX_SLABS], *c[POOL_MAX_SLABS];
        PoolDeviceStats s;
        uint64_t syncs;
        size_t n, m, k;

        open_pool(16 * MiB, 0);
        ck_assert_int_eq(alloc(8 * MiB, UID_A, a, &n), 0);
        ck_assert_int_eq(alloc(8 * MiB, UID_A, b, &m), 0);
        lease_io(a, n, 0x77, 0);
        sim.hold_streams(1);
        reclaim_all(a, n);                      /* issued, not run */
        s = stats();
        syncs = sync_calls();

        /* Its own slab of the size: 8 MiB of zeroing, more than the 4 MiB it may wait for. */
        ck_assert_int_eq(pool_alloc_bounded(pool, 0, 8 * MiB, UID_A, 4 * MiB, c, &k), POOL_E_SCRUBBING);
        /* Another uid's 6 MiB on the full device: room only once the 8 MiB are zeroed. */
        ck_assert_int_eq(pool_alloc_bounded(pool, 0, 6 * MiB, UID_B, 4 * MiB, c, &k), POOL_E_SCRUBBING);
        assert_same_state(stats(), s);
        ck_assert_uint_eq(sync_calls(), syncs);

        sim.hold_streams(0);
        wait_scrubs(1);
        ck_assert_int_eq(pool_alloc_bounded(pool, 0, 6 * MiB, UID_B, 4 * MiB, c, &k), 0);
        lease_io(c, k, -1, 0);
        ck_assert_uint_eq(stats().leased, 14 * MiB);
        reclaim_all(b, m);
        reclaim_all(c, k);
        wait_scrubs(2);
}
END_TEST

/*
 * Host memory's zeroing counts 64 times its bytes before a bounded wait (zero_cost()): the device zeroes host
 * memory at about 20 ms per GiB, its own at 0.3. A request for its size's device slab, whose scrub is queued
 * behind 2 MiB of host zeroing, is deferred under a bound of 64 MiB (2 x 64 + 2 MiB ahead), where counting bytes
 * alone (4 MiB) would have waited in the daemon's loop. Streams are held meanwhile, and a wait for them aborts.
 */
START_TEST(test_host_zeroing_counts_more) {
        Slab *a[POOL_MAX_SLABS], *ha[POOL_MAX_HOST_SLABS], *d[POOL_MAX_SLABS], *c[POOL_MAX_SLABS];
        _cleanup_free_ char *message = NULL;
        PoolConfig config = { .capacity = 64 * MiB, .host_capacity = 8 * MiB };
        uint64_t syncs;
        size_t n, m, k;

        open_driver();
        ck_assert_msg(pool_new(&pool, cu, &config, &message) == 0, "%s", message);
        ck_assert_int_eq(pool_use_device(pool, 0), 0);
        ck_assert_int_eq(alloc(2 * MiB, UID_A, a, &n), 0);
        ck_assert_int_eq(pool_alloc_host(pool, a, n, UID_A, POOL_WAIT_ANY, ha, &n), 0);
        ck_assert_int_eq(alloc(2 * MiB, UID_A, d, &m), 0);
        sim.hold_streams(SIMCUDA_HOLD_NO_WAIT); /* a wait for the held zeroing fails the test at once */
        reclaim_all(ha, n);                     /* issued first, not run */
        reclaim_all(d, m);                      /* behind it */
        syncs = sync_calls();
        ck_assert_int_eq(pool_alloc_bounded(pool, 0, 2 * MiB, UID_A, 64 * MiB, c, &k), POOL_E_SCRUBBING);
        ck_assert_uint_eq(sync_calls(), syncs);
        sim.hold_streams(0);
        ck_assert_int_eq(pool_alloc_bounded(pool, 0, 2 * MiB, UID_A, 256 * MiB, c, &k), 0);
        ck_assert_ptr_eq(c[0], d[0]);           /* its own, zeroed meanwhile */
        reclaim_all(a, n);
        reclaim_all(c, k);
        ck_assert_int_eq(pool_drain(pool), 0);
}
END_TEST

/*
 * pool_scrub_wait(): a kept lease's zeroing in place is waited for under the same bound as a scrub. With more
 * than `wait_max` bytes of zeroing before it, nothing is waited for: POOL_E_SCRUBBING, and one completion is
 * queued after it (not one per try), whose dispatch moves pool_scrubs_finished() though it caches nothing. The
 * zeroing in place counts before the scrubs queued after it: another uid's request for its size's slab, whose
 * scrub is behind it, is deferred too, though that scrub alone is within the bound. Streams are held meanwhile.
 */
START_TEST(test_kept_zeroing_wait_bounded) {
        Slab *a[POOL_MAX_SLABS], *b[POOL_MAX_SLABS], *c[POOL_MAX_SLABS];
        uint64_t syncs, hostfns, finished;
        struct pollfd p;
        size_t n, m, k;

        open_pool(64 * MiB, 0);
        ck_assert_int_eq(alloc(8 * MiB, UID_A, a, &n), 0);
        ck_assert_int_eq(alloc(2 * MiB, UID_B, b, &m), 0);
        lease_io(a, n, 0x55, 0);
        sim.hold_streams(1);
        ck_assert_int_eq(pool_scrub_leased(pool, a[0]), 0);
        reclaim_all(b, m);                      /* 2 MiB scrub, queued after the 8 MiB zeroing in place */
        syncs = sync_calls();
        hostfns = sim.calls("cuLaunchHostFunc");

        ck_assert_int_eq(pool_scrub_wait(pool, a, n, 4 * MiB), POOL_E_SCRUBBING);
        ck_assert_uint_eq(sim.calls("cuLaunchHostFunc"), hostfns);     /* the scrub after it has one */
        ck_assert_int_eq(pool_alloc_bounded(pool, 0, 2 * MiB, UID_B, 4 * MiB, c, &k), POOL_E_SCRUBBING);
        ck_assert_uint_eq(sync_calls(), syncs);
        sim.hold_streams(0);
        wait_scrubs(1);
        ck_assert_int_eq(pool_scrub_wait(pool, a, n, 4 * MiB), 0);
        lease_io(a, n, -1, 0);

        /* Alone on the stream: a completion of its own, queued once, moves the count when dispatched. */
        sim.hold_streams(1);
        ck_assert_int_eq(pool_scrub_leased(pool, a[0]), 0);
        hostfns = sim.calls("cuLaunchHostFunc");
        ck_assert_int_eq(pool_scrub_wait(pool, a, n, 4 * MiB), POOL_E_SCRUBBING);
        ck_assert_int_eq(pool_scrub_wait(pool, a, n, 4 * MiB), POOL_E_SCRUBBING);
        ck_assert_uint_eq(sim.calls("cuLaunchHostFunc"), hostfns + 1);
        finished = pool_scrubs_finished(pool);
        sim.hold_streams(0);
        p = (struct pollfd){ .fd = pool_get_fd(pool), .events = POLLIN };
        ck_assert_int_eq(poll(&p, 1, 30000), 1);
        ck_assert_uint_eq(pool_dispatch(pool), 0);
        ck_assert_uint_gt(pool_scrubs_finished(pool), finished);
        ck_assert_int_eq(pool_scrub_wait(pool, a, n, 4 * MiB), 0);
        ck_assert_uint_eq(pool_scrub_wait(pool, a, n, POOL_WAIT_ANY), 0);
        lease_io(a, n, -1, 0);
        reclaim_all(a, n);
        wait_scrubs(1);
}
END_TEST

/* Fast alloc/free of one size: the pool does not grow with churn (it grew by a slab per cycle before). */
START_TEST(test_churn_does_not_grow_the_pool) {
        Slab *a[POOL_MAX_SLABS];
        PoolDeviceStats s;
        size_t n;

        open_pool(256 * MiB, 0);
        for (unsigned i = 0; i < 1000; i++) {
                ck_assert_int_eq(alloc(4 * MiB, UID_A, a, &n), 0);
                reclaim_all(a, n);
        }
        s = stats();
        ck_assert_uint_eq(s.created, 1);
        ck_assert_uint_le(s.cached + s.scrubbing + s.leased, 4 * MiB);
}
END_TEST

/* A lease of any size up to the maximum slab is one slab of exactly that size, cached by its size: a
 * request of another size never takes it (it would hand out more than was asked, or less). */
START_TEST(test_exact_size_slabs) {
        Slab *a[POOL_MAX_SLABS], *b[POOL_MAX_SLABS], *c[POOL_MAX_SLABS];
        size_t n, m, k;

        open_pool(256 * MiB, 0);
        ck_assert_int_eq(alloc(20 * MiB, UID_A, a, &n), 0);
        ck_assert_uint_eq(n, 1);
        ck_assert_uint_eq(a[0]->size, 20 * MiB);
        lease_io(a, n, 0x11, -1);
        reclaim_all(a, n);
        wait_scrubs(1);

        ck_assert_int_eq(alloc(18 * MiB, UID_A, b, &m), 0);
        ck_assert_uint_eq(m, 1);
        ck_assert_uint_eq(b[0]->size, 18 * MiB);
        ck_assert_ptr_ne(b[0], a[0]);
        ck_assert_uint_eq(stats().hits, 0);

        ck_assert_int_eq(alloc(19 * MiB + 1, UID_A, c, &k), 0);       /* rounds up to 20 MiB: the cached one */
        ck_assert_ptr_eq(c[0], a[0]);
        lease_io(c, k, -1, 0);
        ck_assert_uint_eq(stats().hits, 1);
        ck_assert_uint_eq(stats().created, 2);
        reclaim_all(b, m);
        reclaim_all(c, k);
        ck_assert_int_eq(pool_drain(pool), 0);
}
END_TEST

START_TEST(test_uid_isolation) {
        Slab *a[POOL_MAX_SLABS], *b[POOL_MAX_SLABS], *c[POOL_MAX_SLABS];
        size_t n, m, k;

        open_pool(64 * MiB, 0);
        ck_assert_int_eq(alloc(2 * MiB, UID_A, a, &n), 0);
        reclaim_all(a, n);
        wait_scrubs(1);

        /* Another uid never gets A's slab, even scrubbed. */
        ck_assert_int_eq(alloc(2 * MiB, UID_B, b, &m), 0);
        ck_assert_ptr_ne(b[0], a[0]);
        ck_assert_uint_eq(b[0]->uid, UID_B);
        ck_assert_uint_eq(stats().hits, 0);
        ck_assert_uint_eq(stats().created, 2);

        ck_assert_int_eq(alloc(2 * MiB, UID_A, c, &k), 0);
        ck_assert_ptr_eq(c[0], a[0]);
        ck_assert_uint_eq(stats().hits, 1);
        reclaim_all(b, m);
        reclaim_all(c, k);
        ck_assert_int_eq(pool_drain(pool), 0);
}
END_TEST

START_TEST(test_lru_eviction) {
        Slab *a[POOL_MAX_SLABS], *b[POOL_MAX_SLABS], *c[POOL_MAX_SLABS], *d[POOL_MAX_SLABS];
        PoolDeviceStats before;
        size_t n, m, k, l;

        open_pool(8 * MiB, 0);
        ck_assert_int_eq(alloc(4 * MiB, UID_A, a, &n), 0);
        ck_assert_int_eq(alloc(4 * MiB, UID_B, b, &m), 0);
        reclaim_all(a, n);              /* A's is older */
        wait_scrubs(1);
        reclaim_all(b, m);
        wait_scrubs(1);
        ck_assert_uint_eq(stats().n_cached, 2);

        /* The device is full of cached slabs: C's request releases the least recently used, A's. */
        ck_assert_int_eq(alloc(4 * MiB, UID_C, c, &k), 0);
        ck_assert_uint_eq(stats().evicted, 1);
        ck_assert_uint_eq(stats().n_cached, 1);
        ck_assert_int_eq(alloc(4 * MiB, UID_B, d, &l), 0);
        ck_assert_ptr_eq(d[0], b[0]);   /* B's survived */

        /* Now everything is leased: A's request fails and changes nothing. */
        before = stats();
        ck_assert_int_eq(alloc(2 * MiB, UID_A, a, &n), POOL_E_NOMEM);
        assert_same_state(before, stats());
        ck_assert_ptr_nonnull(strstr(pool_last_error(pool), "capacity"));
        reclaim_all(c, k);
        reclaim_all(d, l);
        ck_assert_int_eq(pool_drain(pool), 0);
}
END_TEST

/* Host slabs released to make room for a park count in neither `evicted` nor `released`, which are the
 * device's (the metrics' vmmbroker_device_evictions_total is a part of vmmbroker_device_slabs_released_total). */
START_TEST(test_host_eviction_not_counted) {
        Slab *a[POOL_MAX_SLABS], *b[POOL_MAX_SLABS], *ha[POOL_MAX_HOST_SLABS], *hb[POOL_MAX_HOST_SLABS];
        _cleanup_free_ char *message = NULL;
        PoolConfig config = { .capacity = 64 * MiB, .host_capacity = 4 * MiB };
        PoolDeviceStats s;
        size_t n, m;

        open_driver();
        ck_assert_msg(pool_new(&pool, cu, &config, &message) == 0, "%s", message);
        ck_assert_int_eq(pool_use_device(pool, 0), 0);
        ck_assert(pool_has_host(pool, 0));
        ck_assert_int_eq(alloc(2 * MiB, UID_A, a, &n), 0);
        ck_assert_int_eq(alloc(4 * MiB, UID_B, b, &m), 0);
        ck_assert_int_eq(pool_alloc_host(pool, a, n, UID_A, POOL_WAIT_ANY, ha, &n), 0);
        reclaim_all(ha, n);             /* A's host slab, zeroed and cached */
        wait_scrubs(1);
        ck_assert_uint_eq(stats().host_cached, 2 * MiB);

        /* B's 4 MiB do not fit beside it, and it is not of B's size: released to make room */
        ck_assert_int_eq(pool_alloc_host(pool, b, m, UID_B, POOL_WAIT_ANY, hb, &m), 0);
        s = stats();
        ck_assert_uint_eq(s.host_created, 2);
        ck_assert_uint_eq(s.host_cached, 0);
        ck_assert_uint_eq(s.evicted, 0);
        ck_assert_uint_eq(s.released, 0);

        reclaim_all(hb, m);
        reclaim_all(a, n);
        reclaim_all(b, m);
        wait_scrubs(3);
}
END_TEST

START_TEST(test_too_large) {
        Slab *a[POOL_MAX_SLABS];
        size_t n;

        open_pool(64 * MiB, 2 * MiB);
        ck_assert_int_eq(alloc(0, UID_A, a, &n), -EINVAL);
        ck_assert_int_eq(alloc(66 * MiB, UID_A, a, &n), POOL_E_TOO_LARGE);
        ck_assert_int_eq(pool_alloc(pool, 7, 2 * MiB, UID_A, a, &n), POOL_E_NO_DEVICE);
        pool = pool_free(pool);
        cu = cuda_driver_close(cu);

        /* 254 slabs of the maximum size: one more than fits in one message. */
        open_pool(1024 * MiB, 2 * MiB);
        ck_assert_int_eq(alloc(254 * 2 * MiB, UID_A, a, &n), POOL_E_TOO_LARGE);
        ck_assert_int_eq(alloc(253 * 2 * MiB, UID_A, a, &n), 0);
        ck_assert_uint_eq(n, 253);
        reclaim_all(a, n);
        ck_assert_int_eq(pool_drain(pool), 0);
        ck_assert_uint_eq(stats().n_cached, 253);
}
END_TEST

START_TEST(test_bad_config) {
        _cleanup_free_ char *message = NULL;
        PoolConfig config = { .max_slab = 3 * MiB };
        int dup[] = { 0, 0 };

        open_driver();
        ck_assert_int_eq(pool_new(&pool, cu, &config, &message), -EINVAL);
        ck_assert_ptr_nonnull(strstr(message, "power of two"));
        config.max_slab = 1 * MiB;
        ck_assert_int_eq(pool_new(&pool, cu, &config, &message), -EINVAL);
        ck_assert_ptr_nonnull(strstr(message, "granularity"));
        config = (PoolConfig){ .devices = dup, .n_devices = 2 };
        ck_assert_int_eq(pool_new(&pool, cu, &config, &message), -EINVAL);
        ck_assert_ptr_nonnull(strstr(message, "twice"));
        config = (PoolConfig){ .devices = (int[]){ 5 }, .n_devices = 1 };
        ck_assert_int_eq(pool_new(&pool, cu, &config, &message), -ENODEV);
        ck_assert_ptr_null(pool);
}
END_TEST

START_TEST(test_default_capacity) {
        size_t free_mem, total;

        open_pool(0, 0);
        ck_assert_int_eq(cu->cuMemGetInfo(&free_mem, &total), CUDA_SUCCESS);
        ck_assert_uint_eq(stats().capacity, ((uint64_t)free_mem / 100 * POOL_DEFAULT_CAPACITY_PERCENT) &
                                                    ~(stats().granularity - 1));
        ck_assert_uint_eq(stats().total, total);
}
END_TEST

/* The simulated device has a budget of 16 MiB (see the tcase); the pool is allowed more. */
START_TEST(test_driver_oom_evicts_cache) {
        Slab *a[POOL_MAX_SLABS], *b[POOL_MAX_SLABS];
        size_t n, m;

        open_pool(64 * MiB, 0);
        ck_assert_int_eq(alloc(8 * MiB, UID_A, a, &n), 0);
        reclaim_all(a, n);
        wait_scrubs(1);
        /* 16 MiB does not fit beside A's cached 8 MiB in the driver: the pool releases A's and tries again. */
        ck_assert_int_eq(alloc(16 * MiB, UID_B, b, &m), 0);
        ck_assert_uint_eq(stats().evicted, 1);
        ck_assert_uint_eq(stats().n_cached, 0);
        reclaim_all(b, m);
        ck_assert_int_eq(pool_drain(pool), 0);
}
END_TEST

START_TEST(test_driver_oom_fails_cleanly) {
        Slab *a[POOL_MAX_SLABS];
        PoolDeviceStats before;
        unsigned long live;
        size_t n;

        open_pool(64 * MiB, 4 * MiB);  /* 6 MiB is two slabs, 4 + 2 */
        before = stats();
        live = sim.live_allocations();
        /* The first create succeeds, the second finds the device out of memory. */
        ck_assert_int_eq(sim.inject("cuMemCreate:2:CUDA_ERROR_OUT_OF_MEMORY"), 0);
        ck_assert_int_eq(alloc(6 * MiB, UID_A, a, &n), POOL_E_NOMEM);
        ck_assert_ptr_nonnull(strstr(pool_last_error(pool), "CUDA_ERROR_OUT_OF_MEMORY"));
        assert_same_state(before, stats());
        ck_assert_uint_eq(sim.live_allocations(), live);
}
END_TEST

START_TEST(test_export_failure) {
        Slab *a[POOL_MAX_SLABS];
        PoolDeviceStats before;
        size_t n;

        open_pool(64 * MiB, 4 * MiB);  /* 6 MiB is two slabs, 4 + 2 */
        before = stats();
        ck_assert_int_eq(sim.inject("cuMemExportToShareableHandle:2:CUDA_ERROR_INVALID_VALUE"), 0);
        ck_assert_int_eq(alloc(6 * MiB, UID_A, a, &n), POOL_E_DRIVER);
        ck_assert_ptr_nonnull(strstr(pool_last_error(pool), "cuMemExportToShareableHandle"));
        assert_same_state(before, stats());
        ck_assert_uint_eq(sim.live_allocations(), 0);
        /* The pool goes on serving. */
        ck_assert_int_eq(alloc(6 * MiB, UID_A, a, &n), 0);
        reclaim_all(a, n);
        ck_assert_int_eq(pool_drain(pool), 0);
}
END_TEST

START_TEST(test_failed_request_returns_hits) {
        Slab *a[POOL_MAX_SLABS], *b[POOL_MAX_SLABS], *c[POOL_MAX_SLABS];
        PoolDeviceStats before;
        size_t n, m, k;

        open_pool(64 * MiB, 4 * MiB);  /* 6 MiB is two slabs, 4 + 2 */
        ck_assert_int_eq(alloc(4 * MiB, UID_A, a, &n), 0);
        ck_assert_int_eq(alloc(4 * MiB, UID_A, b, &m), 0);
        reclaim_all(a, n);
        wait_scrubs(1);
        reclaim_all(b, m);
        wait_scrubs(1);

        /* 6 MiB takes the cached 4 MiB slab cached last (B's) and needs a fresh 2 MiB one, whose create
         * fails. The 4 MiB slab goes back where it was. */
        before = stats();
        ck_assert_int_eq(sim.inject("cuMemCreate:1:CUDA_ERROR_UNKNOWN"), 0);
        ck_assert_int_eq(alloc(6 * MiB, UID_A, c, &k), POOL_E_DRIVER);
        assert_same_state(before, stats());
        ck_assert_uint_eq(stats().hits, 0);

        /* Most recently cached first, as before the failure. */
        ck_assert_int_eq(alloc(4 * MiB, UID_A, c, &k), 0);
        ck_assert_ptr_eq(c[0], b[0]);
        reclaim_all(c, k);
        ck_assert_int_eq(pool_drain(pool), 0);
}
END_TEST

START_TEST(test_scrub_failure_releases) {
        Slab *a[POOL_MAX_SLABS];
        PoolDeviceStats s;
        size_t n;

        open_pool(64 * MiB, 0);
        ck_assert_int_eq(alloc(2 * MiB, UID_A, a, &n), 0);
        ck_assert_int_eq(sim.inject("cuMemsetD8Async:1:CUDA_ERROR_UNKNOWN"), 0);
        reclaim_all(a, n);
        s = stats();
        ck_assert_uint_eq(s.n_scrubbing, 0);
        ck_assert_uint_eq(s.n_cached, 0);
        ck_assert_uint_eq(s.released, 1);
        ck_assert_uint_eq(sim.live_allocations(), 0);
}
END_TEST

/*
 * pool_reclaim() only queues the scrub, with no driver call, so that a Free's answer need not wait for it:
 * the slab counts as scrubbing and is never handed out unscrubbed. pool_scrub_queued() issues it; a request
 * of its size and uid issues and waits for it rather than create a slab; another uid's request never gets
 * it; pool_idle() leaves it queued (when to issue it is the daemon's choice: manager.c, SCRUB_DELAY_USEC); a
 * scrub that cannot be issued releases the slab; the pool freed with scrubs still queued leaves nothing
 * behind (teardown()).
 */
START_TEST(test_scrub_queued_until_told) {
        static const char *const unissued[] = {
                "cuMemsetD8Async:1:CUDA_ERROR_UNKNOWN", "cuEventRecord:1:CUDA_ERROR_UNKNOWN",
        };
        Slab *a[POOL_MAX_SLABS], *b[POOL_MAX_SLABS], *c[POOL_MAX_SLABS];
        uint64_t calls, syncs, waits;
        PoolDeviceStats s;
        size_t n, m, k;

        open_pool(64 * MiB, 0);
        ck_assert_int_eq(alloc(2 * MiB, UID_A, a, &n), 0);
        lease_io(a, n, 0x5c5c5c5c, 0);
        calls = stats().driver_calls;
        pool_reclaim(pool, a[0]);
        s = stats();
        ck_assert_uint_eq(s.driver_calls, calls);       /* queued: nothing asked of the driver yet */
        ck_assert_uint_eq(s.scrubbing, 2 * MiB);
        ck_assert_uint_eq(s.leased, 0);
        ck_assert(pool_has_queued(pool));
        ck_assert(!pool_has_idle_work(pool));

        /*
         * Another uid's request of the size gets a slab of its own; then the owner's takes it back, zeroed,
         * having waited for that slab's event alone: not for the stream, nor for the completion callback.
         */
        ck_assert_int_eq(alloc(2 * MiB, UID_B, c, &k), 0);
        ck_assert_ptr_ne(c[0], a[0]);
        ck_assert_uint_eq(stats().created, 2);
        syncs = sim.calls("cuStreamSynchronize");
        waits = sim.calls("cuEventSynchronize");
        ck_assert_int_eq(alloc(2 * MiB, UID_A, b, &m), 0);
        ck_assert_ptr_eq(b[0], a[0]);
        ck_assert_uint_eq(sim.calls("cuStreamSynchronize"), syncs);
        ck_assert_uint_eq(sim.calls("cuEventSynchronize"), waits + 1);
        lease_io(b, m, -1, 0);
        ck_assert_uint_eq(stats().created, 2);

        /* Queued, then issued by pool_scrub_queued(): cached once done. */
        pool_reclaim(pool, b[0]);
        pool_scrub_queued(pool);
        ck_assert_uint_gt(stats().driver_calls, calls);
        wait_scrubs(1);
        ck_assert_uint_eq(stats().n_cached, 1);

        ck_assert(!pool_has_queued(pool));

        /* Queued, and left so by pool_idle(), until pool_scrub_queued(). */
        pool_reclaim(pool, c[0]);
        calls = stats().driver_calls;
        ck_assert(!pool_idle(pool));
        ck_assert_uint_eq(stats().driver_calls, calls);
        ck_assert(pool_has_queued(pool));
        pool_scrub_queued(pool);
        wait_scrubs(1);
        ck_assert_uint_eq(stats().n_cached, 2);

        /*
         * A scrub that cannot be issued, or whose event cannot be recorded (nothing could say when its zeroing
         * is done): the slab is released, never cached.
         */
        for (unsigned i = 0; i < ELEMENTSOF(unissued); i++) {
                ck_assert_int_eq(alloc(2 * MiB, UID_A, a, &n), 0);
                ck_assert_int_eq(sim.inject(unissued[i]), 0);
                pool_reclaim(pool, a[0]);
                pool_scrub_queued(pool);
                s = stats();
                ck_assert_uint_eq(s.scrubbing, 0);
                ck_assert_uint_eq(s.released, i + 1);
        }

        /* One left queued when the pool is freed. */
        ck_assert_int_eq(alloc(2 * MiB, UID_B, c, &k), 0);
        pool_reclaim(pool, c[0]);
}
END_TEST

/* Holds the streams, gives back the first slab of each of `s[0..n)` and issues their scrubs: `ahead` are issued.
 * Returns the memset count before, for all_issued_and_cached(); the streams stay held. */
static uint64_t reclaim_held(Slab *s[][POOL_MAX_SLABS], size_t n, unsigned ahead) {
        uint64_t memsets = sim.calls("cuMemsetD8Async");

        sim.hold_streams(1);
        for (size_t i = 0; i < n; i++)
                pool_reclaim(pool, s[i][0]);
        pool_scrub_queued(pool);
        ck_assert_uint_eq(sim.calls("cuMemsetD8Async") - memsets, ahead);
        return memsets;
}

/* `n` memsets issued since `memsets`, nothing left queued or scrubbing, `n` slabs cached. */
static void all_issued_and_cached(uint64_t memsets, size_t n) {
        ck_assert_uint_eq(sim.calls("cuMemsetD8Async") - memsets, n);
        ck_assert(!pool_has_queued(pool));
        ck_assert_uint_eq(stats().n_cached, n);
        ck_assert_uint_eq(stats().scrubbing, 0);
}

/*
 * Scrubs are issued 16 at a time (SCRUBS_AHEAD): a real stream holds about 60 before a launch blocks the daemon's
 * loop. Held streams keep the first 16 in flight; the rest stay queued, counted as scrubbing, and are issued as
 * completions come (pool_dispatch()) until every slab is cached. pool_drain() issues and waits for them all.
 */
START_TEST(test_scrubs_issued_ahead_bounded) {
        enum { N = 40, AHEAD = 16 };
        Slab *s[N][POOL_MAX_SLABS];
        uint64_t memsets;
        size_t n;

        open_pool(128 * MiB, 0);
        for (size_t i = 0; i < N; i++) {
                ck_assert_int_eq(alloc(2 * MiB, UID_A, s[i], &n), 0);
                ck_assert_uint_eq(n, 1);
        }
        memsets = reclaim_held(s, N, AHEAD);
        ck_assert(pool_has_queued(pool));
        ck_assert_uint_eq(stats().scrubbing, N * 2 * MiB);
        pool_scrub_queued(pool);                /* the stream is no emptier: nothing more */
        ck_assert_uint_eq(sim.calls("cuMemsetD8Async") - memsets, AHEAD);
        sim.hold_streams(0);
        wait_scrubs(N);
        all_issued_and_cached(memsets, N);

        /* Taken again from the cache, and freed: pool_drain() starts with 24 still queued behind the bound
         * (the stream held while they are issued) and leaves nothing queued or scrubbing, issuing and
         * synchronizing as many times as that takes. How many passes that is depends on how fast completions
         * come in while it issues: a drain of one pass left 8 queued in the plain build, and passed under ASan. */
        for (size_t i = 0; i < N; i++)
                ck_assert_int_eq(alloc(2 * MiB, UID_A, s[i], &n), 0);
        ck_assert_uint_eq(stats().created, N);
        memsets = reclaim_held(s, N, AHEAD);
        sim.hold_streams(0);
        ck_assert_int_eq(pool_drain(pool), 0);
        all_issued_and_cached(memsets, N);
}
END_TEST

static void count_told(void *userdata) {
        (*(unsigned *)userdata)++;
}

/*
 * pool_set_queued_hook(), which the daemon's scrub timer hangs on: told when a reclaim queues into an empty
 * queue (not for each slab queued behind it), again once the queue was emptied, and at once when set over a
 * queue that is not empty (what restoring queued before the daemon's timer existed).
 */
START_TEST(test_queued_hook) {
        Slab *a[POOL_MAX_SLABS], *b[POOL_MAX_SLABS];
        unsigned told = 0;
        size_t n, m;

        open_pool(64 * MiB, 0);
        ck_assert_int_eq(alloc(2 * MiB, UID_A, a, &n), 0);
        ck_assert_int_eq(alloc(4 * MiB, UID_A, b, &m), 0);
        ck_assert_uint_eq(n + m, 2);
        pool_set_queued_hook(pool, count_told, &told);
        ck_assert_uint_eq(told, 0);             /* nothing queued */
        pool_reclaim(pool, a[0]);
        pool_reclaim(pool, b[0]);
        ck_assert_uint_eq(told, 1);             /* once, for the queue it began */
        pool_scrub_queued(pool);
        wait_scrubs(2);

        ck_assert_int_eq(alloc(2 * MiB, UID_A, a, &n), 0);
        pool_reclaim(pool, a[0]);
        ck_assert_uint_eq(told, 2);             /* the queue was emptied: told again */
        pool_set_queued_hook(pool, NULL, NULL);
        pool_set_queued_hook(pool, count_told, &told);
        ck_assert_uint_eq(told, 3);             /* set over a queue that is not empty: told at once */
        pool_set_queued_hook(pool, NULL, NULL);
        pool_scrub_queued(pool);
        wait_scrubs(1);
}
END_TEST

START_TEST(test_free_releases_everything) {
        Slab *a[POOL_MAX_SLABS], *b[POOL_MAX_SLABS], *c[POOL_MAX_SLABS];
        size_t n, m, k;

        open_pool(64 * MiB, 0);
        ck_assert_int_eq(alloc(2 * MiB, UID_A, a, &n), 0);      /* cached */
        reclaim_all(a, n);
        wait_scrubs(1);
        ck_assert_int_eq(alloc(4 * MiB, UID_A, b, &m), 0);      /* being scrubbed */
        sim.hold_streams(1);
        reclaim_all(b, m);
        ck_assert_int_eq(alloc(8 * MiB, UID_B, c, &k), 0);      /* leased */
        ck_assert_uint_gt(sim.live_allocations(), 0);
        sim.hold_streams(0);
        /* teardown() frees the pool and checks that nothing is left */
}
END_TEST

static ino_t fd_inode(int fd) {
        struct stat st;

        return fstat(fd, &st) < 0 ? 0 : st.st_ino;
}

START_TEST(test_idle_closes_and_primes) {
        Slab *a[POOL_MAX_SLABS], *b[POOL_MAX_SLABS];
        uint64_t calls;
        ino_t ino;
        size_t n, m;
        int fd;

        open_pool(64 * MiB, 0);
        ck_assert(!pool_idle(pool));            /* nothing to do yet */
        ck_assert_int_eq(alloc(2 * MiB, UID_A, a, &n), 0);
        fd = a[0]->fd;
        ino = fd_inode(fd);
        reclaim_all(a, n);
        wait_scrubs(1);

        /* Released, but its exported fd stays open until the pool is idle: no close inside a request. */
        ck_assert_uint_eq(pool_trim(pool), 1);
        ck_assert_uint_eq(fd_inode(fd), ino);
        ck_assert(pool_idle(pool));
        ck_assert_uint_ne(fd_inode(fd), ino);   /* closed (or the number reused by another file) */

        /* ... and it made one unbound slab of the smallest size (the granularity), which any uid gets, with no driver call. */
        ck_assert_uint_eq(stats().primed, 1);
        ck_assert_uint_eq(stats().n_cached, 1);
        calls = stats().driver_calls;
        ck_assert_int_eq(alloc(2 * MiB, UID_B, b, &m), 0);
        ck_assert_uint_eq(stats().driver_calls, calls);
        ck_assert_uint_eq(b[0]->uid, UID_B);
        lease_io(b, m, -1, 0);

        /* Nothing closed since: idle has nothing to do. */
        ck_assert(!pool_idle(pool));
        reclaim_all(b, m);
        wait_scrubs(1);
        /* Once leased, it is B's: A does not get it back. */
        ck_assert_int_eq(alloc(2 * MiB, UID_A, a, &n), 0);
        ck_assert_ptr_ne(a[0], b[0]);
        reclaim_all(a, n);
        ck_assert_int_eq(pool_drain(pool), 0);
}
END_TEST

/* Slabs are mapped for the pool ahead, in pool_idle(), two ticks after they were made, one per call, and not
 * while host slabs are being made; a slab mapped so is scrubbed with no mapping call, one released first leaves
 * the list, one that fails to map is mapped at its scrub as before. */
START_TEST(test_idle_maps_ahead) {
        Slab *a[POOL_MAX_SLABS], *c[POOL_MAX_SLABS], *d[POOL_MAX_SLABS], *e[POOL_MAX_SLABS];
        uint64_t maps, made;
        size_t n, m, k, l;

        open_pool(64 * MiB, 4 * MiB);
        ck_assert_int_eq(alloc(6 * MiB, UID_A, a, &n), 0);      /* 4 + 2 MiB */
        ck_assert_uint_eq(n, 2);
        ck_assert(a[0]->scrub_va == 0 && a[1]->scrub_va == 0);
        ck_assert(!pool_has_idle_work(pool));

        /* Not in the tick they were made in, nor the next: their client maps them then. */
        pool_tick(pool);
        ck_assert(!pool_has_idle_work(pool));
        ck_assert(!pool_idle(pool));
        ck_assert(a[0]->scrub_va == 0);

        /* This one was made after the first tick: due a tick after the others. */
        ck_assert_int_eq(alloc(2 * MiB, UID_B, c, &m), 0);
        pool_tick(pool);
        maps = sim.calls("cuMemMap");
        ck_assert(pool_has_idle_work(pool));
        ck_assert(pool_idle(pool));
        ck_assert(a[0]->scrub_va != 0 && a[1]->scrub_va == 0);    /* one per call, the oldest first */
        ck_assert_uint_eq(stats().mapped_ahead, 1);
        ck_assert(pool_idle(pool));
        ck_assert(a[1]->scrub_va != 0 && c[0]->scrub_va == 0);
        ck_assert_uint_eq(sim.calls("cuMemMap") - maps, 2);
        ck_assert(!pool_has_idle_work(pool));
        ck_assert(!pool_idle(pool));

        /* Their scrubs map nothing more, and zero them. */
        lease_io(a, n, 0x5a, -1);
        maps = sim.calls("cuMemMap");
        reclaim_all(a, n);
        wait_scrubs(2);
        ck_assert_uint_eq(sim.calls("cuMemMap"), maps);
        ck_assert_int_eq(alloc(6 * MiB, UID_A, a, &n), 0);
        lease_io(a, n, -1, 0);

        /* Nothing is mapped ahead while host slabs are made off the loop: the driver pins them under a lock
         * that the mapping would wait for. Once they are dispatched, it goes on. */
        made = pool_host_made(pool);
        ck_assert_int_eq(pool_make_host(pool, c, m, UID_B, NULL), POOL_E_MAKING);
        pool_tick(pool);
        pool_tick(pool);
        ck_assert(!pool_has_idle_work(pool));
        ck_assert(!pool_idle(pool));
        ck_assert(c[0]->scrub_va == 0);
        for (unsigned i = 0; pool_host_made(pool) == made; i++) {
                struct pollfd p = { .fd = pool_get_fd(pool), .events = POLLIN };

                ck_assert_msg(i < 100, "the host slab asked for was not made in 10 s");
                (void)poll(&p, 1, 100);
                (void)pool_dispatch(pool);
        }
        ck_assert(pool_has_idle_work(pool));
        ck_assert(pool_idle(pool));
        ck_assert(c[0]->scrub_va != 0);
        ck_assert_uint_eq(stats().mapped_ahead, 3);
        ck_assert(!pool_has_idle_work(pool));

        /* Released before it was due: off the list (ASan would see it used after free otherwise). */
        ck_assert_int_eq(alloc(2 * MiB, UID_C, e, &l), 0);
        pool_release(pool, e[0]);
        ck_assert(pool_idle(pool));                             /* closes its fd, primes a slab */
        ck_assert_int_eq(alloc(2 * MiB, UID_C, d, &k), 0);      /* that slab, unbound till now */
        pool_tick(pool);
        pool_tick(pool);
        /* A slab the driver does not map leaves the list all the same: its scrub maps it. */
        ck_assert(pool_has_idle_work(pool));
        ck_assert_int_eq(sim.inject("cuMemMap:1:CUDA_ERROR_UNKNOWN"), 0);
        ck_assert(pool_idle(pool));
        ck_assert(d[0]->scrub_va == 0);
        ck_assert_uint_eq(stats().mapped_ahead, 3);
        ck_assert(!pool_has_idle_work(pool));
        ck_assert(!pool_idle(pool));
        lease_io(d, k, 0x33, -1);
        e[0] = d[0];
        reclaim_all(d, k);
        wait_scrubs(1);
        ck_assert_int_eq(alloc(2 * MiB, UID_C, d, &k), 0);
        ck_assert_ptr_eq(d[0], e[0]);           /* its own slab back, mapped by its scrub */
        ck_assert(d[0]->scrub_va != 0);
        lease_io(d, k, -1, 0);
        reclaim_all(d, k);
        reclaim_all(c, m);
        reclaim_all(a, n);
        ck_assert_int_eq(pool_drain(pool), 0);
}
END_TEST

/* pool_new() refuses a HostReserve= that is not whole host slabs (of HostSlab=, which defaults to MaxSlab= this
 * small), exceeds the host capacity or asks for host memory with parking off, and says which; it takes one that
 * is whole host slabs but not whole device slabs; pool_reserve_host() makes the reserve off the loop, once. */
START_TEST(test_host_reserve) {
        PoolConfig config = { .capacity = 64 * MiB, .max_slab = 4 * MiB, .host_capacity = 32 * MiB };
        Slab *a[POOL_MAX_SLABS], *host[POOL_MAX_HOST_SLABS];
        static const struct {
                uint64_t reserve, host_slab;
                bool no_host;
                const char *says;
        } bad[] = {
                { 6 * MiB, 0, false, "not a whole number of host slabs of HostSlab=4M, the pieces it is pinned in: "
                                     "make it a multiple of 4M" },
                { 3 * MiB, 2 * MiB, false, "HostSlab=2M, the pieces it is pinned in: make it a multiple of 2M" },
                { 64 * MiB, 0, false, "HostCapacity= gives it 32M" },
                { 16 * MiB, 0, true, "HostCapacity=0 turns parking off" },
        };
        PoolDeviceStats st;
        uint64_t made;
        size_t n;

        open_driver();
        for (size_t i = 0; i < ELEMENTSOF(bad); i++) {
                _cleanup_free_ char *message = NULL;

                config.host_reserve = bad[i].reserve;
                config.host_slab = bad[i].host_slab;
                config.no_host = bad[i].no_host;
                ck_assert_int_eq(pool_new(&pool, cu, &config, &message), -EINVAL);
                ck_assert_msg(message && strstr(message, bad[i].says), "%s", message ?: "no message");
        }
        config.no_host = false;
        {
                _cleanup_free_ char *message = NULL;

                config.host_reserve = 6 * MiB;  /* three host slabs of 2M, one and a half device slabs */
                config.host_slab = 2 * MiB;
                ck_assert_msg(pool_new(&pool, cu, &config, &message) == 0, "%s", message);
                pool = pool_free(pool);
        }
        config.host_reserve = 16 * MiB;
        config.host_slab = 0;
        {
                _cleanup_free_ char *message = NULL;

                ck_assert_msg(pool_new(&pool, cu, &config, &message) == 0, "%s", message);
        }
        ck_assert_int_eq(pool_use_device(pool, 0), 0);

        /* Four slabs of the largest size, made off the loop, cached unbound once dispatched. */
        made = pool_host_made(pool);
        ck_assert_int_eq(pool_reserve_host(pool), 4);
        for (unsigned i = 0; pool_host_made(pool) == made; i++) {
                struct pollfd p = { .fd = pool_get_fd(pool), .events = POLLIN };

                ck_assert_msg(i < 100, "the host reserve was not made in 10 s");
                (void)poll(&p, 1, 100);
                (void)pool_dispatch(pool);
        }
        st = stats();
        ck_assert_uint_eq(st.host_cached, 16 * MiB);
        ck_assert_uint_eq(st.host_created, 4);
        ck_assert_int_eq(pool_reserve_host(pool), 0);           /* there already */

        /* A park of 8 MiB makes nothing and takes two of them; leased, they still count as the reserve. */
        ck_assert_int_eq(alloc(8 * MiB, UID_A, a, &n), 0);
        ck_assert_uint_eq(n, 2);
        ck_assert_int_eq(pool_make_host(pool, a, n, UID_A, NULL), 0);
        ck_assert_int_eq(pool_alloc_host(pool, a, n, UID_A, POOL_WAIT_ANY, host, &n), 0);
        ck_assert_int_eq(pool_reserve_host(pool), 0);
        st = stats();
        ck_assert_uint_eq(st.host_created, 4);
        ck_assert_uint_eq(st.parked, 8 * MiB);
        ck_assert_uint_eq(st.host_cached, 8 * MiB);
        reclaim_all(host, n);
        reclaim_all(a, n);
        ck_assert_int_eq(pool_drain(pool), 0);
}
END_TEST

/* Dispatches the pool until the host slabs of `ticket` are made (pool_make_done()), at most 10 s. */
static void wait_made(uint64_t ticket) {
        for (unsigned i = 0; !pool_make_done(pool, ticket); i++) {
                struct pollfd p = { .fd = pool_get_fd(pool), .events = POLLIN };

                ck_assert_msg(i < 100, "the host slabs of ticket %" PRIu64 " were not made in 10 s", ticket);
                (void)poll(&p, 1, 100);
                (void)pool_dispatch(pool);
        }
}

/* Writes `text` into the file `path` whole (by a rename). */
static void write_file(const char *path, const char *text) {
        char tmp[80];
        int fd;

        snprintf(tmp, sizeof(tmp), "%s.new", path);
        fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        ck_assert_int_ge(fd, 0);
        ck_assert_int_eq(write(fd, text, strlen(text)), (ssize_t)strlen(text));
        close(fd);
        ck_assert_int_eq(rename(tmp, path), 0);
}

static char create_hold[64], create_reached[80];     /* SIMCUDA_HOLD_CREATE_FILE, and the file it makes */

/* Opens the pool of `config` on device 0 with every host slab's cuMemCreate held (SIMCUDA_HOLD_CREATE_FILE): the
 * test lets them through with write_file(create_hold, "N"), or all of them by removing create_hold. */
static void open_pool_holding_creates(const PoolConfig *config) {
        _cleanup_free_ char *message = NULL;

        snprintf(create_hold, sizeof(create_hold), "/tmp/vmmb-pool-hold-%d", (int)getpid());
        snprintf(create_reached, sizeof(create_reached), "%s.reached", create_hold);
        (void)unlink(create_reached);
        write_file(create_hold, "");
        ck_assert_int_eq(setenv("SIMCUDA_HOLD_CREATE_FILE", create_hold, 1), 0);
        open_driver();
        ck_assert_msg(pool_new(&pool, cu, config, &message) == 0, "%s", message);
        ck_assert_int_eq(pool_use_device(pool, 0), 0);
}

/* Waits (at most 10 s) for a host cuMemCreate to be held. */
static void wait_create_held(void) {
        for (unsigned i = 0; access(create_reached, F_OK) != 0; i++) {
                ck_assert_msg(i < 10000, "no host slab was made in 10 s");
                (void)usleep(1000);
        }
}

/* Drains the pool of open_pool_holding_creates() (its hold removed by then) and forgets the hold. */
static void close_pool_holding_creates(void) {
        ck_assert_int_eq(pool_drain(pool), 0);
        (void)unlink(create_reached);
        ck_assert_int_eq(unsetenv("SIMCUDA_HOLD_CREATE_FILE"), 0);
}

/*
 * The maker thread takes one host slab at a time, users in turn, and each pool_make_host() is done
 * (pool_make_done()) once its own are made: B's one slab, asked for while the first of A's four is held and
 * after A's second call (two more), is the second made, not after a slab of each of A's calls (the simulated
 * device lets two creates through, SIMCUDA_HOLD_CREATE_FILE holding a count, and holds the third). What is made
 * for a call is cached for its user: C's park does not count B's slab, B's does. Nothing more is made when each
 * takes its slabs.
 */
START_TEST(test_make_in_turn) {
        PoolConfig config = { .capacity = 64 * MiB, .max_slab = 4 * MiB, .host_capacity = 32 * MiB,
                              .host_slab = 2 * MiB };
        Slab *a[POOL_MAX_SLABS], *a2[POOL_MAX_SLABS], *b[POOL_MAX_SLABS], *c[POOL_MAX_SLABS];
        Slab *host[POOL_MAX_HOST_SLABS];
        uint64_t ta = 0, ta2 = 0, tb = 0, tc = 0;
        size_t n, n2, m, o, nh;

        open_pool_holding_creates(&config);                     /* every host create held */
        ck_assert_int_eq(alloc(8 * MiB, UID_A, a, &n), 0);              /* 4 host slabs of 2M */
        ck_assert_int_eq(alloc(4 * MiB, UID_A, a2, &n2), 0);            /* 2 more */
        ck_assert_int_eq(alloc(2 * MiB, UID_B, b, &m), 0);
        ck_assert_int_eq(alloc(2 * MiB, UID_C, c, &o), 0);

        ck_assert_int_eq(pool_make_host(pool, a, n, UID_A, &ta), POOL_E_MAKING);
        wait_create_held();
        ck_assert_int_eq(pool_make_host(pool, a2, n2, UID_A, &ta2), POOL_E_MAKING);
        ck_assert_int_eq(pool_make_host(pool, b, m, UID_B, &tb), POOL_E_MAKING);
        ck_assert_uint_gt(tb, ta2);
        (void)unlink(create_reached);
        write_file(create_hold, "2");
        wait_made(tb);
        ck_assert_msg(!pool_make_done(pool, ta) && !pool_make_done(pool, ta2), "A's slabs were made before B's one");
        ck_assert_uint_eq(stats().host_created, 2);

        ck_assert_int_eq(pool_make_host(pool, b, m, UID_B, NULL), 0);
        ck_assert_int_eq(pool_make_host(pool, c, o, UID_C, &tc), POOL_E_MAKING);
        ck_assert_int_eq(unlink(create_hold), 0);
        wait_made(ta);
        wait_made(ta2);
        wait_made(tc);
        ck_assert_uint_eq(stats().host_created, 8);
        ck_assert_int_eq(pool_alloc_host(pool, a, n, UID_A, POOL_WAIT_ANY, host, &nh), 0);
        ck_assert_uint_eq(nh, 4);
        reclaim_all(host, nh);
        ck_assert_int_eq(pool_alloc_host(pool, a2, n2, UID_A, POOL_WAIT_ANY, host, &nh), 0);
        ck_assert_uint_eq(nh, 2);
        reclaim_all(host, nh);
        ck_assert_int_eq(pool_alloc_host(pool, b, m, UID_B, POOL_WAIT_ANY, host, &nh), 0);
        reclaim_all(host, nh);
        ck_assert_int_eq(pool_alloc_host(pool, c, o, UID_C, POOL_WAIT_ANY, host, &nh), 0);
        reclaim_all(host, nh);
        ck_assert_uint_eq(stats().host_created, 8);
        reclaim_all(a, n);
        reclaim_all(a2, n2);
        reclaim_all(b, m);
        reclaim_all(c, o);
        close_pool_holding_creates();
}
END_TEST

/*
 * Host slabs made for a park whose caller went away: bound to that user while anything is being made for it
 * (the slabs made so far stay A's; and A's first call done, its slabs wait for A's second, which may take either
 * call's), anyone's once nothing is (pool_unbind_made()), so that another user's park takes them rather than
 * pinning as much again.
 */
START_TEST(test_made_unbound_after) {
        PoolConfig config = { .capacity = 64 * MiB, .max_slab = 4 * MiB, .host_capacity = 32 * MiB,
                              .host_slab = 2 * MiB };
        Slab *a[POOL_MAX_SLABS], *a2[POOL_MAX_SLABS], *b[POOL_MAX_SLABS], *host[POOL_MAX_HOST_SLABS];
        uint64_t ta = 0, ta2 = 0;
        size_t n, n2, m, nh;

        open_pool_holding_creates(&config);                     /* every host create held */
        ck_assert_int_eq(alloc(4 * MiB, UID_A, a, &n), 0);              /* 2 host slabs of 2M */
        ck_assert_int_eq(alloc(4 * MiB, UID_A, a2, &n2), 0);            /* 2 more, another call */
        ck_assert_int_eq(alloc(8 * MiB, UID_B, b, &m), 0);

        /* a's first is held while a2 is asked for; then, in turn, a, a2, a, and a2's second is held */
        ck_assert_int_eq(pool_make_host(pool, a, n, UID_A, &ta), POOL_E_MAKING);
        wait_create_held();
        ck_assert_int_eq(pool_make_host(pool, a2, n2, UID_A, &ta2), POOL_E_MAKING);
        (void)unlink(create_reached);
        write_file(create_hold, "3");
        wait_made(ta);
        ck_assert(!pool_make_done(pool, ta2));
        ck_assert_uint_eq(stats().host_created, 3);
        ck_assert_uint_eq(pool_unbind_made(pool), 0);                   /* A's second call is still being made */

        ck_assert_int_eq(unlink(create_hold), 0);
        wait_made(ta2);
        ck_assert_uint_eq(stats().host_created, 4);
        /* A's parks went away without taking them */
        ck_assert_uint_eq(pool_unbind_made(pool), 4);
        ck_assert_uint_eq(pool_unbind_made(pool), 0);
        ck_assert_int_eq(pool_make_host(pool, b, m, UID_B, NULL), 0);
        ck_assert_int_eq(pool_alloc_host(pool, b, m, UID_B, POOL_WAIT_ANY, host, &nh), 0);
        ck_assert_uint_eq(nh, 4);
        ck_assert_uint_eq(stats().host_created, 4);
        reclaim_all(host, nh);
        reclaim_all(a, n);
        reclaim_all(a2, n2);
        reclaim_all(b, m);
        close_pool_holding_creates();
}
END_TEST

/*
 * A making of which a host slab failed is known by its ticket once done (pool_make_failed()); another user's,
 * made after it, is not: a park that waited for B's making does not take A's failure for its own (and pin what it
 * lacks in the daemon's loop).
 */
START_TEST(test_make_failed_per_ticket) {
        PoolConfig config = { .capacity = 64 * MiB, .max_slab = 4 * MiB, .host_capacity = 32 * MiB };
        Slab *a[POOL_MAX_SLABS], *b[POOL_MAX_SLABS];
        uint64_t ta = 0, tb = 0;
        size_t n, m;

        open_driver();
        ck_assert_int_eq(pool_new(&pool, cu, &config, NULL), 0);
        ck_assert_int_eq(pool_use_device(pool, 0), 0);
        ck_assert_int_eq(alloc(4 * MiB, UID_A, a, &n), 0);
        ck_assert_int_eq(alloc(4 * MiB, UID_B, b, &m), 0);
        ck_assert_int_eq(sim.inject("cuMemCreate:1:CUDA_ERROR_OUT_OF_MEMORY"), 0);
        ck_assert_int_eq(pool_make_host(pool, a, n, UID_A, &ta), POOL_E_MAKING);
        wait_made(ta);
        ck_assert(pool_make_failed(pool, ta));
        ck_assert_int_eq(pool_make_host(pool, b, m, UID_B, &tb), POOL_E_MAKING);
        wait_made(tb);
        ck_assert(!pool_make_failed(pool, tb));
        ck_assert(pool_make_failed(pool, ta));
        ck_assert_uint_eq(stats().host_created, 1);
        reclaim_all(a, n);
        reclaim_all(b, m);
}
END_TEST

/* Maps a lease as a client would and fills each MiB of it with a byte of its own (`write`), or checks that. */
static void lease_chunks(Slab **slabs, size_t n, bool write) {
        uint64_t sizes[POOL_MAX_SLABS] = {}, total;
        CUdeviceptr va = lease_map(slabs, n, sizes, &total);
        uint8_t chunk[4096];

        for (uint64_t k = 0; k < total / MiB; k++) {
                uint8_t byte = (uint8_t)(k * 7 + 1);

                if (write) {
                        ck_assert_int_eq(cu->cuMemsetD8(va + k * MiB, byte, MiB), CUDA_SUCCESS);
                        continue;
                }
                ck_assert_int_eq(cu->cuMemcpyDtoH(chunk, va + k * MiB + MiB - sizeof(chunk), sizeof(chunk)),
                                 CUDA_SUCCESS);
                for (size_t i = 0; i < sizeof(chunk); i++)
                        ck_assert_msg(chunk[i] == byte, "MiB %" PRIu64 " of the lease reads %#x, not %#x", k,
                                      chunk[i], byte);
        }
        ck_assert_int_eq(cu->cuCtxSynchronize(), CUDA_SUCCESS);
        ck_assert_int_eq(cuda_unmap(cu, va, sizes, n), 0);
}

/* Dispatches the pool until the copy into dst[0] is over: pool_copy_result(), 0 or its failure. */
static int copy_wait(Slab **dst) {
        int k;

        for (unsigned i = 0; (k = pool_copy_result(pool, dst[0])) == POOL_E_COPYING; i++) {
                struct pollfd p = { .fd = pool_get_fd(pool), .events = POLLIN };

                ck_assert_msg(i < 100, "the copy was not done in 10 s");
                (void)poll(&p, 1, 100);
                (void)pool_dispatch(pool);
        }
        return k;
}

/* Copies src into dst (pool_copy_start(), `uid`'s) and dispatches the pool until the copy is done. */
static void copy_and_wait(uid_t uid, Slab **dst, size_t n_dst, Slab **src, size_t n_src) {
        ck_assert_int_eq(pool_copy_start(pool, uid, dst, n_dst, src, n_src), 0);
        ck_assert_int_eq(copy_wait(dst), 0);
}

/*
 * A park's host memory comes in host slabs of HostSlab= and one of each device slab's rest, so that the driver
 * pins no more than that per call: with HostSlab=4M, a 14 MiB lease of 8 + 6 MiB device slabs parks in 4 + 4 and
 * 4 + 2 MiB. They are made off the loop, each size as often as it is missing; the content goes into them and
 * back into other device slabs, every MiB in its place; a second park of the size finds them cached and makes
 * nothing. A HostSlab= under MaxSlab= / 16 is refused.
 */
START_TEST(test_host_pieces) {
        PoolConfig config = { .capacity = 64 * MiB, .max_slab = 8 * MiB, .host_capacity = 32 * MiB,
                              .host_slab = 4 * MiB };
        Slab *a[POOL_MAX_SLABS], *b[POOL_MAX_SLABS], *host[POOL_MAX_HOST_SLABS];
        static const uint64_t want[] = { 4 * MiB, 4 * MiB, 4 * MiB, 2 * MiB };
        _cleanup_free_ char *message = NULL;
        PoolDeviceStats st;
        size_t n, m, nh;
        uint64_t made;

        open_driver();
        config.host_slab = 2 * MiB;
        config.max_slab = 64 * MiB;
        ck_assert_int_eq(pool_new(&pool, cu, &config, &message), -EINVAL);
        ck_assert_msg(message && strstr(message, "HostSlab=2M must be a power of two of at least MaxSlab=64M / 16"),
                      "%s", message ?: "no message");
        config.host_slab = 4 * MiB;
        config.max_slab = 8 * MiB;
        ck_assert_int_eq(pool_new(&pool, cu, &config, NULL), 0);
        ck_assert_int_eq(pool_use_device(pool, 0), 0);

        ck_assert_int_eq(alloc(14 * MiB, UID_A, a, &n), 0);
        ck_assert_uint_eq(n, 2);
        lease_chunks(a, n, true);
        made = pool_host_made(pool);
        ck_assert_int_eq(pool_make_host(pool, a, n, UID_A, NULL), POOL_E_MAKING);
        for (unsigned i = 0; pool_host_made(pool) == made; i++) {
                struct pollfd p = { .fd = pool_get_fd(pool), .events = POLLIN };

                ck_assert_msg(i < 100, "the host slabs were not made in 10 s");
                (void)poll(&p, 1, 100);
                (void)pool_dispatch(pool);
        }
        ck_assert_uint_eq(stats().host_created, 4);
        ck_assert_int_eq(pool_make_host(pool, a, n, UID_A, NULL), 0);         /* all there */
        ck_assert_int_eq(pool_alloc_host(pool, a, n, UID_A, POOL_WAIT_ANY, host, &nh), 0);
        ck_assert_uint_eq(nh, ELEMENTSOF(want));
        for (size_t i = 0; i < nh; i++)
                ck_assert_uint_eq(host[i]->size, want[i]);
        copy_and_wait(UID_A, host, nh, a, n);
        reclaim_all(a, n);

        ck_assert_int_eq(alloc(14 * MiB, UID_B, b, &m), 0);              /* other slabs than A's */
        copy_and_wait(UID_B, b, m, host, nh);
        lease_chunks(b, m, false);
        reclaim_all(host, nh);
        /* A's device slabs may still be scrubbing too: wait for nothing to be (wait_scrubs() counts them). */
        for (unsigned i = 0;; i++) {
                struct pollfd p = { .fd = pool_get_fd(pool), .events = POLLIN };

                st = stats();
                if (st.scrubbing + st.host_scrubbing == 0)
                        break;
                ck_assert_msg(i < 100, "the scrubs were not done in 10 s");
                (void)poll(&p, 1, 100);
                (void)pool_dispatch(pool);
        }
        ck_assert_uint_eq(st.host_cached, 14 * MiB);
        ck_assert_int_eq(pool_make_host(pool, b, m, UID_B, NULL), 0);         /* cached, unbound: any park's */
        ck_assert_uint_eq(st.host_created, 4);
        reclaim_all(b, m);
        ck_assert_int_eq(pool_drain(pool), 0);
}
END_TEST

/* Host slabs to park the lease `slabs` of `uid` in: made off the loop if they must be (waited for), then taken. */
static void host_for(Slab **slabs, size_t n, uid_t uid, Slab **host, size_t *n_host) {
        uint64_t made = pool_host_made(pool);
        int k = pool_make_host(pool, slabs, n, uid, NULL);

        for (unsigned i = 0; k == POOL_E_MAKING && pool_host_made(pool) == made; i++) {
                struct pollfd p = { .fd = pool_get_fd(pool), .events = POLLIN };

                ck_assert_msg(i < 100, "the host slabs were not made in 10 s");
                (void)poll(&p, 1, 100);
                (void)pool_dispatch(pool);
        }
        ck_assert_int_eq(pool_make_host(pool, slabs, n, uid, NULL), 0);
        ck_assert_int_eq(pool_alloc_host(pool, slabs, n, uid, POOL_WAIT_ANY, host, n_host), 0);
}

/* A pool whose copies go in pieces of 2 MiB (PoolConfig.copy_piece), with slabs of 8 MiB and host memory. */
static void open_pool_copying(void) {
        PoolConfig config = { .capacity = 128 * MiB, .max_slab = 8 * MiB, .host_capacity = 64 * MiB,
                              .copy_piece = 2 * MiB };

        open_driver();
        ck_assert_int_eq(pool_new(&pool, cu, &config, NULL), 0);
        ck_assert_int_eq(pool_use_device(pool, 0), 0);
}

/*
 * The content of the host slabs `host` copied back into a new lease of `size` for `uid`, as an unpark does: every
 * MiB in its place (lease_chunks()). The lease and the host slabs are given back after.
 */
static void copy_back_check(uid_t uid, uint64_t size, Slab **host, size_t n_host) {
        Slab *slabs[POOL_MAX_SLABS];
        size_t n;

        ck_assert_int_eq(alloc(size, uid, slabs, &n), 0);
        copy_and_wait(uid, slabs, n, host, n_host);
        lease_chunks(slabs, n, false);
        reclaim_all(slabs, n);
        reclaim_all(host, n_host);
}

/*
 * A pool of open_pool_copying(), a lease of 32 MiB of A's written (lease_chunks()) and host slabs for it, and its
 * copy into them started with the streams held: POOL_COPY_AHEAD pieces of its 16 queued, none done.
 */
static void copy_started_held(Slab **a, size_t *n, Slab **host, size_t *n_host) {
        open_pool_copying();
        ck_assert_int_eq(alloc(32 * MiB, UID_A, a, n), 0);
        lease_chunks(a, *n, true);
        host_for(a, *n, UID_A, host, n_host);
        sim.hold_streams(1);
        ck_assert_int_eq(pool_copy_start(pool, UID_A, host, *n_host, a, *n), 0);
        ck_assert_uint_eq(stats().copied_bytes, POOL_COPY_AHEAD * 2 * MiB);
}

/*
 * A copy is queued a piece at a time, POOL_COPY_AHEAD pieces on the stream, users in turn and each user's copies in
 * turn: a copy of one piece started right after A's of 16 (the stream held, so that none is done yet) is done
 * while A's still copies, whether it is another user's or A's own. Queued whole, A's would be done first: the
 * stream runs its work in order, as the device does. Every MiB of both arrives in its place.
 */
START_TEST(test_copies_in_turn) {
        static const uid_t second[] = { UID_B, UID_A };
        Slab *a[POOL_MAX_SLABS], *b[POOL_MAX_SLABS], *ha[POOL_MAX_HOST_SLABS], *hb[POOL_MAX_HOST_SLABS];
        size_t n, m, nha, nhb;
        uint64_t copied;

        open_pool_copying();
        for (size_t t = 0; t < ELEMENTSOF(second); t++) {
                ck_assert_int_eq(alloc(32 * MiB, UID_A, a, &n), 0);
                ck_assert_int_eq(alloc(2 * MiB, second[t], b, &m), 0);
                lease_chunks(a, n, true);
                lease_chunks(b, m, true);
                host_for(a, n, UID_A, ha, &nha);
                host_for(b, m, second[t], hb, &nhb);
                copied = stats().copied_bytes;

                sim.hold_streams(1);
                ck_assert_int_eq(pool_copy_start(pool, UID_A, ha, nha, a, n), 0);
                ck_assert_int_eq(pool_copy_start(pool, second[t], hb, nhb, b, m), 0);
                ck_assert_uint_eq(stats().copied_bytes - copied, POOL_COPY_AHEAD * 2 * MiB);  /* A's pieces only */
                ck_assert_int_eq(pool_copy_result(pool, ha[0]), POOL_E_COPYING);
                ck_assert_int_eq(pool_copy_result(pool, hb[0]), POOL_E_COPYING);
                sim.hold_streams(0);

                ck_assert_int_eq(copy_wait(hb), 0);
                ck_assert_msg(pool_copy_result(pool, ha[0]) == POOL_E_COPYING, "A's copy of 16 pieces was done "
                              "before %s copy of one, started after it", t == 0 ? "another user's" : "A's own");
                ck_assert_int_eq(copy_wait(ha), 0);
                ck_assert_uint_eq(stats().copied_bytes - copied, 34 * MiB);

                reclaim_all(a, n);
                reclaim_all(b, m);
                copy_back_check(UID_A, 32 * MiB, ha, nha);
                copy_back_check(second[t], 2 * MiB, hb, nhb);
        }
        ck_assert_int_eq(pool_drain(pool), 0);
}
END_TEST

/*
 * A copy whose later piece cannot be queued fails once what it queued is done: pool_copy_result() says
 * POOL_E_DRIVER and, whenever asked, why (in pool_last_error()), its slabs are no longer in use by a copy (given
 * back at once, not after it), and the next copy of the same slabs runs. One whose first piece cannot be queued
 * fails at once, nothing left in flight.
 */
START_TEST(test_copy_piece_fails) {
        Slab *a[POOL_MAX_SLABS], *host[POOL_MAX_HOST_SLABS];
        uint64_t after;
        size_t n, nh;

        copy_started_held(a, &n, host, &nh);
        ck_assert_int_eq(sim.inject("cuMemcpyDtoDAsync:2"), 0);                 /* the second after those queued */
        sim.hold_streams(0);
        ck_assert_int_eq(copy_wait(host), POOL_E_DRIVER);
        ck_assert_msg(strstr(pool_last_error(pool), "cuMemcpyDtoDAsync"), "%s", pool_last_error(pool));
        pool_restate_error(pool, "another failure since");     /* asked again, it says its own */
        ck_assert_int_eq(pool_copy_result(pool, host[0]), POOL_E_DRIVER);
        ck_assert_msg(strstr(pool_last_error(pool), "cuMemcpyDtoDAsync"), "%s", pool_last_error(pool));
        ck_assert_uint_eq(stats().copied_bytes, (POOL_COPY_AHEAD + 1) * 2 * MiB);
        after = stats().after_copy;
        reclaim_all(host, nh);
        ck_assert_uint_eq(stats().after_copy, after);           /* no copy used them any more */

        host_for(a, n, UID_A, host, &nh);
        ck_assert_int_eq(sim.inject("cuMemcpyDtoDAsync:1"), 0);
        ck_assert_int_eq(pool_copy_start(pool, UID_A, host, nh, a, n), POOL_E_DRIVER);
        ck_assert_int_eq(pool_copy_result(pool, host[0]), POOL_E_DRIVER);
        copy_and_wait(UID_A, host, nh, a, n);
        reclaim_all(a, n);
        copy_back_check(UID_A, 32 * MiB, host, nh);
        ck_assert_int_eq(pool_drain(pool), 0);
}
END_TEST

/*
 * A copy whose destination is all given back before its last piece is queued (its move undone, or its lease
 * ended) queues no more pieces: nobody will read it. Its slabs wait only for the pieces on the stream; then the
 * destination is scrubbed and cached, the source given back at once, and pool_drain() copies nothing more.
 */
START_TEST(test_copy_dropped) {
        Slab *a[POOL_MAX_SLABS], *host[POOL_MAX_HOST_SLABS];
        PoolDeviceStats st;
        size_t n, nh;

        copy_started_held(a, &n, host, &nh);
        for (size_t i = 0; i < nh; i++)
                pool_reclaim(pool, host[i]);
        st = stats();
        ck_assert_uint_eq(st.after_copy, nh);
        ck_assert_uint_eq(st.copies_dropped, 1);
        sim.hold_streams(0);
        for (unsigned i = 0;; i++) {
                struct pollfd p = { .fd = pool_get_fd(pool), .events = POLLIN };

                st = stats();
                if (st.host_cached == 32 * MiB)
                        break;
                ck_assert_msg(i < 100, "the dropped copy's destination was not cached in 10 s");
                (void)poll(&p, 1, 100);
                (void)pool_dispatch(pool);
                pool_scrub_queued(pool);        /* given back after the copy: queued for their scrub */
        }
        ck_assert_int_eq(pool_drain(pool), 0);
        ck_assert_uint_eq(stats().copied_bytes, POOL_COPY_AHEAD * 2 * MiB);
        reclaim_all(a, n);
        ck_assert_uint_eq(stats().after_copy, nh);              /* the source did not wait */
}
END_TEST

/*
 * Pieces of a copy not yet queued when the pool must wait for its copies: pool_drain() queues them all and waits
 * (the copy is done and whole after it), a release of one of its slabs (here: a lease given back while its copy
 * runs waits on after_copy, then goes) does not free memory under it, and pool_free() with a copy still pending
 * queues the rest and waits before it releases anything (ASan sees no use after free; the simulated device no
 * allocation left).
 */
START_TEST(test_copy_pending_at_drain_and_end) {
        Slab *a[POOL_MAX_SLABS], *host[POOL_MAX_HOST_SLABS];
        size_t n, nh;

        copy_started_held(a, &n, host, &nh);
        sim.hold_streams(0);
        ck_assert_int_eq(pool_drain(pool), 0);
        ck_assert_uint_eq(stats().copied_bytes, 32 * MiB);
        ck_assert_int_eq(pool_copy_result(pool, host[0]), 0);
        copy_back_check(UID_A, 32 * MiB, host, nh);

        host_for(a, n, UID_A, host, &nh);
        sim.hold_streams(1);
        ck_assert_int_eq(pool_copy_start(pool, UID_A, host, nh, a, n), 0);
        for (size_t i = 0; i < nh; i++)
                pool_reclaim(pool, host[i]);            /* the move undone: they wait for the copy */
        ck_assert_uint_eq(stats().after_copy, nh);
        sim.hold_streams(0);
        pool = pool_free(pool);                         /* the source's copy still pending */
}
END_TEST

/* An exported host allocation of `size`, as the previous run of the daemon leaves a cached host slab stored. */
static int host_slab_fd(uint64_t size) {
        CUmemAllocationProp prop = cuda_host_prop(0);
        CUmemGenericAllocationHandle h;
        int fd = -1;

        ck_assert_int_eq(cu->cuMemCreate(&h, size, &prop, 0), CUDA_SUCCESS);
        ck_assert_int_eq(cu->cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                         CUDA_SUCCESS);
        ck_assert_int_eq(cu->cuMemRelease(h), CUDA_SUCCESS);
        return fd;
}

/* pool_adopt_host() with a slab it must refuse: the result, and the fd closed (the pool's in every case). */
static int adopt_refused(int device, uint64_t size, uint64_t real_size) {
        int fd = host_slab_fd(real_size), k = pool_adopt_host(pool, device, fd, size);

        ck_assert_msg(fcntl(fd, F_GETFD) < 0 && errno == EBADF, "the refused fd was left open");
        return k;
}

/*
 * A host slab of the previous run's cache is taken back into free room only: cached unbound and counted, and a
 * park of its size takes it and makes nothing. Refused, and its fd closed: no such device, a size no slab has,
 * no room left in HostCapacity=, a pool without host memory.
 */
START_TEST(test_adopt_host) {
        PoolConfig config = { .capacity = 64 * MiB, .max_slab = 4 * MiB, .host_capacity = 8 * MiB };
        Slab *a[POOL_MAX_SLABS], *host[POOL_MAX_HOST_SLABS];
        PoolDeviceStats st;
        size_t n;

        open_driver();
        ck_assert_int_eq(pool_new(&pool, cu, &config, NULL), 0);
        ck_assert_int_eq(pool_use_device(pool, 0), 0);
        ck_assert_int_eq(pool_adopt_host(pool, 0, host_slab_fd(4 * MiB), 4 * MiB), 0);
        st = stats();
        ck_assert_uint_eq(st.host_cached, 4 * MiB);
        ck_assert_uint_eq(st.host_adopted, 1);
        ck_assert_uint_eq(st.host_created, 0);

        ck_assert_int_eq(adopt_refused(5, 4 * MiB, 4 * MiB), -ENODEV);
        ck_assert_int_eq(adopt_refused(0, 3 * MiB, 4 * MiB), -EINVAL);         /* not of the granularity */
        ck_assert_int_eq(adopt_refused(0, 6 * MiB, 6 * MiB), -EINVAL);         /* over HostSlab= (MaxSlab=) */
        ck_assert_int_eq(adopt_refused(0, 0, 2 * MiB), -EINVAL);
        ck_assert_int_eq(pool_adopt_host(pool, 0, host_slab_fd(4 * MiB), 4 * MiB), 0);
        ck_assert_int_eq(adopt_refused(0, 2 * MiB, 2 * MiB), -ENOSPC);         /* 8 of 8 MiB cached */
        ck_assert_msg(strstr(pool_last_error(pool), "HostCapacity="), "%s", pool_last_error(pool));
        st = stats();
        ck_assert_uint_eq(st.host_cached, 8 * MiB);
        ck_assert_uint_eq(st.host_adopted, 2);

        ck_assert_int_eq(alloc(4 * MiB, UID_A, a, &n), 0);
        ck_assert_int_eq(pool_make_host(pool, a, n, UID_A, NULL), 0);
        ck_assert_int_eq(pool_alloc_host(pool, a, n, UID_A, POOL_WAIT_ANY, host, &n), 0);
        st = stats();
        ck_assert_uint_eq(st.host_created, 0);
        ck_assert_uint_eq(st.parked, 4 * MiB);
        reclaim_all(host, n);
        reclaim_all(a, n);
        ck_assert_int_eq(pool_drain(pool), 0);
        pool = pool_free(pool);

        config.no_host = true;
        ck_assert_int_eq(pool_new(&pool, cu, &config, NULL), 0);
        ck_assert_int_eq(adopt_refused(0, 4 * MiB, 4 * MiB), POOL_E_NO_HOST);
}
END_TEST

static Suite *pool_suite(void) {
        Suite *s = suite_create("pool");
        TCase *tc;

        tc = tcase_create("plan");
        tcase_add_test(tc, test_plan);
        suite_add_tcase(s, tc);

        tc = tcase_create("pool");
        tcase_add_checked_fixture(tc, NULL, teardown);
        tcase_add_test(tc, test_fresh_then_cached);
        tcase_add_test(tc, test_scrubbing_slab_waited_for);
        tcase_add_test(tc, test_scrubs_before_the_waited_one_cached);
        tcase_add_test(tc, test_full_device_waits_for_scrubs);
        tcase_add_test(tc, test_scrub_wait_bounded);
        tcase_add_test(tc, test_kept_zeroing_wait_bounded);
        tcase_add_test(tc, test_churn_does_not_grow_the_pool);
        tcase_add_test(tc, test_exact_size_slabs);
        tcase_add_test(tc, test_uid_isolation);
        tcase_add_test(tc, test_lru_eviction);
        tcase_add_test(tc, test_host_eviction_not_counted);
        tcase_add_test(tc, test_too_large);
        tcase_add_test(tc, test_bad_config);
        tcase_add_test(tc, test_default_capacity);
        tcase_add_test(tc, test_driver_oom_fails_cleanly);
        tcase_add_test(tc, test_export_failure);
        tcase_add_test(tc, test_failed_request_returns_hits);
        tcase_add_test(tc, test_scrub_failure_releases);
        tcase_add_test(tc, test_scrub_queued_until_told);
        tcase_add_test(tc, test_queued_hook);
        tcase_add_test(tc, test_scrubs_issued_ahead_bounded);
        tcase_add_test(tc, test_host_zeroing_counts_more);
        tcase_add_test(tc, test_free_releases_everything);
        tcase_add_test(tc, test_idle_closes_and_primes);
        tcase_add_test(tc, test_idle_maps_ahead);
        tcase_add_test(tc, test_host_reserve);
        tcase_add_test(tc, test_adopt_host);
        tcase_add_test(tc, test_host_pieces);
        tcase_add_test(tc, test_make_failed_per_ticket);
        tcase_add_test(tc, test_copies_in_turn);
        tcase_add_test(tc, test_copy_piece_fails);
        tcase_add_test(tc, test_copy_pending_at_drain_and_end);
        tcase_add_test(tc, test_copy_dropped);
        tcase_add_test(tc, test_make_in_turn);
        tcase_add_test(tc, test_made_unbound_after);
        suite_add_tcase(s, tc);

        return s;
}

static Suite *pool_budget_suite(void) {
        Suite *s = suite_create("pool-budget");
        TCase *tc = tcase_create("small device");

        tcase_add_checked_fixture(tc, NULL, teardown);
        tcase_add_test(tc, test_driver_oom_evicts_cache);
        suite_add_tcase(s, tc);
        return s;
}

int main(void) {
        int failed = run_suite(pool_suite());

        /* Every test runs in a child forked after this, so the simulated device they open has 16 MiB. */
        setenv("SIMCUDA_MEMORY", "16M", 1);
        failed += run_suite(pool_budget_suite());
        return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
