/* SPDX-License-Identifier: MIT */

/*
 * bench-broker: what a client pays for memory from the broker, against what
 * the driver costs without it. It starts its own vmmbrokerd ($VMMBROKER_DAEMON)
 * on a private socket, on whatever driver it loads (the GPU's, or the
 * simulated device through VMMBROKER_LIBCUDA), and measures for each size, as
 * medians over repetitions:
 *
 *   request      vmmb_alloc() with a warm pool: from the request to a usable
 *                pointer (the daemon's reply, import, reserve, map, access)
 *   floor        the same slabs' fds, already exported, imported and mapped in
 *                one process: cuMemImportFromShareableHandle + reserve + map +
 *                one cuMemSetAccess (cuda_map_fds()), the least a client can pay
 *   cuMemAlloc   cuMemAlloc of the same size, for comparison
 *   reclaim      from SIGKILL of a process holding the lease to the daemon
 *                reporting it reclaimed (leased drops), and to it being cached
 *                again (scrubbed, reusable); polled through Status
 *
 * A program that prints measurements, not a test. Usage: bench-broker [REPS].
 */

#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "codec.h"
#include "driver.h"
#include "harness.h"
#include "macro.h"
#include "pool.h"
#include "size.h"
#include "timing.h"
#include "varlink.h"
#include "vmmbroker.h"

#define MiB (UINT64_C(1) << 20)
#define MAX_REPS 100

static CudaDriver *cu;

static void die(const char *what, int k) {
        fprintf(stderr, "bench-broker: %s: %s (%s)\n", what, strerror(k < 0 ? -k : k), vmmb_error_message());
        exit(EXIT_FAILURE);
}

static void check(CUresult r, const char *what) {
        if (r != CUDA_SUCCESS) {
                fprintf(stderr, "bench-broker: %s: %s\n", what, cuda_result_name(cu, r));
                exit(EXIT_FAILURE);
        }
}

/* Status of device 0 on `c`. */
static void status_on(VarlinkConn *c, uint64_t *ret_leased, uint64_t *ret_scrubbing, uint64_t *ret_cached) {
        WireDevice d;
        int k = harness_status_on(c, &d);

        if (k < 0)
                die("Status", k);
        *ret_leased = d.leased;
        *ret_scrubbing = d.scrubbing;
        *ret_cached = d.cached;
}

/* The same on a connection of its own. */
static void status(const char *path, uint64_t *ret_leased, uint64_t *ret_scrubbing, uint64_t *ret_cached) {
        VarlinkConn *c = NULL;
        int k = harness_conn_open(path, false, &c);

        if (k < 0)
                die("connect", k);
        status_on(c, ret_leased, ret_scrubbing, ret_cached);
        varlink_conn_free(c);
}

/* A bare round trip: Status on an open connection, no fds, no driver. */
static double bench_round_trip(const char *path, unsigned reps) {
        VarlinkConn *c = NULL;
        double t[MAX_REPS];
        uint64_t a, b, d;

        if (harness_conn_open(path, false, &c) < 0)
                die("connect", -ECONNREFUSED);
        for (unsigned i = 0; i < reps; i++) {
                double t0 = now_us();

                status_on(c, &a, &b, &d);
                t[i] = now_us() - t0;
        }
        varlink_conn_free(c);
        return median(t, reps);
}

/* Waits (polling Status, this is a benchmark) until nothing is being scrubbed. */
static void wait_scrubbed(const char *path) {
        uint64_t leased, scrubbing, cached;

        do
                status(path, &leased, &scrubbing, &cached);
        while (scrubbing > 0);
}

typedef struct Row {
        uint64_t size;
        double request, floor, alloc, reclaimed, cached;
} Row;

static double bench_request(vmmb_client *client, const char *path, uint64_t size, unsigned reps) {
        double t[MAX_REPS];
        vmmb_lease *l;
        int k;

        /* Warm the pool: the slabs this size needs, scrubbed and cached for this uid. */
        k = vmmb_alloc(client, size, 0, "bench", &l);
        if (k < 0)
                die("vmmb_alloc", k);
        vmmb_free(l);
        wait_scrubbed(path);

        for (unsigned i = 0; i < reps; i++) {
                double t0 = now_us();

                k = vmmb_alloc(client, size, 0, "bench", &l);
                t[i] = now_us() - t0;
                if (k < 0)
                        die("vmmb_alloc", k);
                k = vmmb_free(l);
                if (k < 0)
                        die("vmmb_free", k);
                wait_scrubbed(path);
        }
        return median(t, reps);
}

/* Import + reserve + map + access of already exported slabs, as the client does, in one process. */
static double bench_floor(uint64_t size, unsigned reps) {
        CUmemAllocationProp prop = cuda_slab_prop(0);
        CUmemGenericAllocationHandle h[POOL_MAX_SLABS];
        uint64_t sizes[POOL_MAX_SLABS];
        int fds[POOL_MAX_SLABS];
        double t[MAX_REPS];
        size_t n;

        /* The same slabs the daemon's pool uses for this size. */
        n = pool_plan(size, 2 * MiB, POOL_DEFAULT_MAX_SLAB, sizes, ELEMENTSOF(sizes));
        for (size_t i = 0; i < n; i++) {
                check(cu->cuMemCreate(&h[i], sizes[i], &prop, 0), "cuMemCreate");
                check(cu->cuMemExportToShareableHandle(&fds[i], h[i], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                      "cuMemExportToShareableHandle");
        }
        for (unsigned i = 0; i < reps; i++) {
                _cleanup_free_ char *message = NULL;
                CUdeviceptr va;
                double t0 = now_us();
                int k;

                k = cuda_map_fds(cu, 0, fds, sizes, n, false, &va, &message);
                t[i] = now_us() - t0;
                if (k < 0) {
                        fprintf(stderr, "bench-broker: %s\n", message);
                        exit(EXIT_FAILURE);
                }
                (void)cuda_unmap(cu, va, sizes, n);
        }
        for (size_t i = 0; i < n; i++) {
                safe_close(fds[i]);
                (void)cu->cuMemRelease(h[i]);
        }
        return median(t, reps);
}

static double bench_cumemalloc(uint64_t size, unsigned reps) {
        double t[MAX_REPS];

        for (unsigned i = 0; i < reps; i++) {
                CUdeviceptr p;
                double t0 = now_us();

                check(cu->cuMemAlloc(&p, size), "cuMemAlloc");
                t[i] = now_us() - t0;
                check(cu->cuMemFree(p), "cuMemFree");
        }
        return median(t, reps);
}

/* `bench-broker --hold PATH SIZE`: lease SIZE, say 'r' on stdout, wait to be killed. */
static int hold(const char *path, const char *size) {
        vmmb_client *client;
        vmmb_lease *l;

        if (vmmb_connect(path, &client) < 0 || vmmb_alloc(client, strtoull(size, NULL, 10), 0, "victim", &l) < 0) {
                fprintf(stderr, "bench-broker --hold: %s\n", vmmb_error_message());
                return 1;
        }
        (void)!write(STDOUT_FILENO, "r", 1);
        pause();
        return 0;
}

/*
 * A process holding a lease of `size`. It is this program run again, not a
 * fork: CUDA is not usable in a child forked after the driver was initialised.
 */
static pid_t spawn_holder(const char *path, uint64_t size) {
        char arg[32];
        int p[2];
        pid_t pid;
        char c;

        if (pipe(p) < 0)
                die("pipe", -errno);
        snprintf(arg, sizeof(arg), "%" PRIu64, size);
        pid = fork();
        if (pid == 0) {
                dup2(p[1], STDOUT_FILENO);
                execl("/proc/self/exe", "bench-broker", "--hold", path, arg, (char *)NULL);
                _exit(127);
        }
        safe_close(p[1]);
        if (read(p[0], &c, 1) != 1)
                die("holder", -EIO);
        safe_close(p[0]);
        return pid;
}

static void bench_reclaim(const char *path, uint64_t size, unsigned reps, Row *row) {
        double reclaimed[MAX_REPS], cached[MAX_REPS];

        for (unsigned i = 0; i < reps; i++) {
                uint64_t leased, scrubbing, c;
                pid_t pid = spawn_holder(path, size);
                double t0;

                wait_scrubbed(path);
                t0 = now_us();
                kill(pid, SIGKILL);
                do
                        status(path, &leased, &scrubbing, &c);
                while (leased > 0);
                reclaimed[i] = now_us() - t0;
                do
                        status(path, &leased, &scrubbing, &c);
                while (scrubbing > 0);
                cached[i] = now_us() - t0;
                (void)harness_wait(pid);
        }
        row->reclaimed = median(reclaimed, reps);
        row->cached = median(cached, reps);
}

int main(int argc, char *argv[]) {
        static const uint64_t sizes[] = { 2 * MiB, 64 * MiB, 512 * MiB, 1024 * MiB };
        _cleanup_free_ char *message = NULL;
        unsigned reps = argc > 1 ? (unsigned)strtoul(argv[1], NULL, 10) : 20;
        Row rows[ELEMENTSOF(sizes)] = {};
        vmmb_client *client;
        Harness h;
        CUcontext ctx;
        int k;

        if (argc == 4 && strcmp(argv[1], "--hold") == 0)
                return hold(argv[2], argv[3]);
        if (reps == 0 || reps > MAX_REPS) {
                fprintf(stderr, "Usage: %s [REPS], 1 to %d\n", argv[0], MAX_REPS);
                return EXIT_FAILURE;
        }
        k = harness_start(&h, NULL);
        if (k < 0)
                die("starting vmmbrokerd (is VMMBROKER_DAEMON set?)", k);
        k = cuda_driver_open(&cu, NULL, &message);
        if (k < 0) {
                fprintf(stderr, "%s\n", message);
                return EXIT_FAILURE;
        }
        check(cu->cuDevicePrimaryCtxRetain(&ctx, 0), "cuDevicePrimaryCtxRetain");
        check(cu->cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
        k = vmmb_connect(h.socket, &client);
        if (k < 0)
                die("vmmb_connect", k);

        for (size_t i = 0; i < ELEMENTSOF(sizes); i++) {
                rows[i].size = sizes[i];
                rows[i].request = bench_request(client, h.socket, sizes[i], reps);
                rows[i].floor = bench_floor(sizes[i], reps);
                rows[i].alloc = bench_cumemalloc(sizes[i], reps);
                bench_reclaim(h.socket, sizes[i], reps < 5 ? reps : 5, &rows[i]);
        }
        vmmb_close(client);

        printf("bench-broker: a bare Status round trip on an open connection: %.1f us (median of %u)\n",
               bench_round_trip(h.socket, reps), reps);
        printf("bench-broker: driver %s (CUDA %d.%d), %u repetitions (reclaim: %u), medians in us\n", cu->path,
               cu->version / 1000, cu->version % 1000 / 10, reps, reps < 5 ? reps : 5);
        printf("%-8s %10s %10s %8s %11s %10s %13s %13s\n", "size", "request", "floor", "ratio", "cuMemAlloc",
               "vs alloc", "kill->reclaim", "kill->cached");
        for (size_t i = 0; i < ELEMENTSOF(sizes); i++) {
                char b[FORMAT_SIZE_MAX];

                printf("%-8s %10.1f %10.1f %7.2fx %11.1f %9.2fx %13.1f %13.1f\n", format_size(rows[i].size, b, sizeof(b)),
                       rows[i].request, rows[i].floor, rows[i].request / rows[i].floor, rows[i].alloc,
                       rows[i].request / rows[i].alloc, rows[i].reclaimed, rows[i].cached);
        }
        k = harness_stop(&h);
        (void)cu->cuDevicePrimaryCtxRelease(0);
        cuda_driver_close(cu);
        return k == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
