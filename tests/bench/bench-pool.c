/* SPDX-License-Identifier: MIT */

/*
 * bench-pool: what a request costs the pool, on whatever driver it loads (the
 * GPU's, or the simulated device through VMMBROKER_LIBCUDA).
 *
 * For each slab size it measures, as medians over repetitions:
 *   fresh        pool_alloc() of one slab for a uid with nothing cached
 *   floor        cuMemCreate + cuMemExportToShareableHandle of the same size,
 *                called directly in the same state: what a fresh slab cannot
 *                be cheaper than
 *   released     pool_alloc() for a new uid right after cached slabs were
 *                released and pool_idle() ran, as the daemon does between
 *                requests (for the smallest class, the unbound slab that
 *                pool_idle() made serves it)
 *   hit          pool_alloc() served from the cache
 *   calls        Driver API calls the pool made per fresh request and per hit
 *   scrub        time from pool_reclaim() to the scrub's completion being
 *                dispatched, and the throughput that gives (bytes / time); the
 *                first scrub of a slab also maps it, so it is reported apart
 *
 * It is a program that prints measurements, not a test: it never fails on a
 * timing. Usage: bench-pool [REPS] (default 20).
 */

#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "driver.h"
#include "macro.h"
#include "pool.h"
#include "size.h"
#include "timing.h"

#define MiB (UINT64_C(1) << 20)
#define MAX_REPS 100

static _Noreturn void die(const char *what, int k, Pool *pool) {
        fprintf(stderr, "bench-pool: %s failed: %s (%s)\n", what, pool_strerror(k), pool ? pool_last_error(pool) : "");
        exit(EXIT_FAILURE);
}

static uint64_t driver_calls(Pool *pool) {
        PoolDeviceStats s;

        pool_device_stats(pool, 0, &s);
        return s.driver_calls;
}

/* Reclaims a slab and waits, on the pool's eventfd, until its scrub is dispatched. Returns microseconds. */
static double reclaim_and_wait(Pool *pool, Slab *slab) {
        double t0 = now_us();

        pool_reclaim(pool, slab);
        pool_scrub_queued(pool);
        for (;;) {
                struct pollfd p = { .fd = pool_get_fd(pool), .events = POLLIN };

                if (poll(&p, 1, -1) < 0)
                        die("poll", -errno, NULL);
                if (pool_dispatch(pool) > 0)
                        return now_us() - t0;
        }
}

typedef struct Row {
        uint64_t size;
        double fresh, floor, released, hit, scrub_first, scrub;
        double calls_fresh, calls_hit;
} Row;

/*
 * The floor's allocations are kept until the end: closing an exported fd
 * makes the process's next export slow (docs/pool.md), which would charge the
 * pool's next measurement for the floor's clean-up.
 */
static struct {
        CUmemGenericAllocationHandle handle;
        int fd;
} kept[3 * MAX_REPS];
static unsigned n_kept;

static void bench_floor(CudaDriver *cu, uint64_t size, unsigned reps, Row *row) {
        CUmemAllocationProp prop = cuda_slab_prop(0);
        double t[MAX_REPS];

        for (unsigned i = 0; i < reps; i++) {
                CUmemGenericAllocationHandle h;
                double t0 = now_us();
                CUresult r;
                int fd = -1;

                r = cu->cuMemCreate(&h, size, &prop, 0);
                if (r == CUDA_SUCCESS) {
                        r = cu->cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
                        t[i] = now_us() - t0;
                        kept[n_kept].handle = h;
                        kept[n_kept++].fd = fd;
                }
                if (r != CUDA_SUCCESS) {
                        fprintf(stderr, "bench-pool: cuMemCreate/export of %" PRIu64 " bytes: %s\n", size,
                                cuda_result_name(cu, r));
                        exit(EXIT_FAILURE);
                }
        }
        row->floor = median(t, reps);
}

static double timed_alloc(Pool *pool, uint64_t size, uid_t uid, Slab **slab, uint64_t *calls) {
        Slab *slabs[POOL_MAX_SLABS];
        uint64_t c0 = driver_calls(pool);
        double t0 = now_us(), t;
        size_t n;
        int k;

        k = pool_alloc(pool, 0, size, uid, slabs, &n);
        t = now_us() - t0;
        if (k != 0)
                die("pool_alloc", k, pool);
        *calls += driver_calls(pool) - c0;
        *slab = slabs[0];
        return t;
}

static void bench_size(Pool *pool, CudaDriver *cu, uint64_t size, unsigned reps, Row *row) {
        double fresh[MAX_REPS], released[MAX_REPS], hit[MAX_REPS], scrub[MAX_REPS], first[MAX_REPS];
        uint64_t calls_fresh = 0, calls_hit = 0, ignored = 0;
        uid_t uid = 1000;
        Slab *slab;

        row->size = size;
        bench_floor(cu, size, reps, row);

        for (unsigned i = 0; i < reps; i++) {
                /* Fresh: a uid with nothing cached, nothing released since the last export. */
                fresh[i] = timed_alloc(pool, size, ++uid, &slab, &calls_fresh);
                first[i] = reclaim_and_wait(pool, slab);

                /* Hit: the slab just scrubbed. */
                hit[i] = timed_alloc(pool, size, uid, &slab, &calls_hit);
                scrub[i] = reclaim_and_wait(pool, slab);
        }
        for (unsigned i = 0; i < reps; i++) {
                /* After the cache was released and the daemon went idle once. */
                pool_trim(pool);
                pool_idle(pool);
                released[i] = timed_alloc(pool, size, ++uid, &slab, &ignored);
                reclaim_and_wait(pool, slab);
        }
        pool_trim(pool);
        pool_idle(pool);

        row->fresh = median(fresh, reps);
        row->released = median(released, reps);
        row->hit = median(hit, reps);
        row->scrub_first = median(first, reps);
        row->scrub = median(scrub, reps);
        row->calls_fresh = (double)calls_fresh / reps;
        row->calls_hit = (double)calls_hit / reps;
}

int main(int argc, char *argv[]) {
        static const uint64_t sizes[] = { 2 * MiB, 64 * MiB, 1024 * MiB };
        _cleanup_free_ char *message = NULL;
        PoolConfig config = {};
        Row rows[ELEMENTSOF(sizes)];
        PoolDeviceStats s;
        CudaDriver *cu;
        Pool *pool;
        unsigned reps = 20;
        int k;

        if (argc > 1) {
                reps = (unsigned)strtoul(argv[1], NULL, 10);
                if (reps == 0 || reps > MAX_REPS) {
                        fprintf(stderr, "Usage: %s [REPS], 1 to %d (default 20)\n", argv[0], MAX_REPS);
                        return EXIT_FAILURE;
                }
        }
        k = cuda_driver_open(&cu, NULL, &message);
        if (k < 0) {
                fprintf(stderr, "%s\n", message);
                return EXIT_FAILURE;
        }
        config.devices = (int[]){ 0 };
        config.n_devices = 1;
        k = pool_new(&pool, cu, &config, &message);
        if (k < 0) {
                fprintf(stderr, "%s\n", message);
                return EXIT_FAILURE;
        }
        if (pool_use_device(pool, 0) < 0)
                die("cuCtxSetCurrent", -EIO, pool);

        for (size_t i = 0; i < ELEMENTSOF(sizes); i++)
                bench_size(pool, cu, sizes[i], reps, &rows[i]);

        pool_device_stats(pool, 0, &s);
        printf("bench-pool: device 0 (%s), driver %s (CUDA %d.%d), %u repetitions, medians\n", s.name, cu->path,
               cu->version / 1000, cu->version % 1000 / 10, reps);
        printf("%-8s %9s %9s %11s %8s %11s %9s %12s %10s %10s\n", "size", "fresh us", "floor us", "released us",
               "hit us", "calls/fresh", "calls/hit", "1st scrub us", "scrub us", "scrub GB/s");
        for (size_t i = 0; i < ELEMENTSOF(sizes); i++) {
                char b[FORMAT_SIZE_MAX];

                printf("%-8s %9.1f %9.1f %11.1f %8.2f %11.1f %9.1f %12.1f %10.1f %10.1f\n",
                       format_size(rows[i].size, b, sizeof(b)), rows[i].fresh, rows[i].floor, rows[i].released,
                       rows[i].hit, rows[i].calls_fresh, rows[i].calls_hit, rows[i].scrub_first, rows[i].scrub,
                       (double)rows[i].size / rows[i].scrub / 1e3);
        }
        for (unsigned i = 0; i < n_kept; i++) {
                safe_close(kept[i].fd);
                (void)cu->cuMemRelease(kept[i].handle);
        }
        pool_free(pool);
        cuda_driver_close(cu);
        return EXIT_SUCCESS;
}
