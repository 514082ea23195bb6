/* SPDX-License-Identifier: MIT */

#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "macro.h"
#include "message.h"
#include "selfcheck.h"
#include "size.h"

/* 64 MiB + 2 MiB: one slab at the default MaxSlab= (1 GiB); with MaxSlab=64M or less, several, so the lease
 * needs a contiguous multi-slab mapping. */
#define CHECK_SIZE (UINT64_C(66) << 20)
#define CHECK_PATTERN 0x5eedcafeu

static double now_us(void) {
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

/* Maps a lease as a client would; fills it with `pattern` after checking that it reads `expect` everywhere. */
static int use_lease(CudaDriver *cu, int index, Slab **slabs, size_t n, uint32_t expect, uint32_t pattern,
                     const char **ret_what, char **ret_message) {
        uint64_t sizes[POOL_MAX_SLABS], total = 0;
        int fds[POOL_MAX_SLABS];
        _cleanup_free_ uint32_t *host = NULL;
        CUdevice device;
        CUdeviceptr va;
        CUresult r;
        int k;

        r = cu->cuDeviceGet(&device, index);
        if (r != CUDA_SUCCESS) {
                *ret_what = "open the device";
                return cuda_result_to_errno(r);
        }
        for (size_t i = 0; i < n; i++) {
                fds[i] = slabs[i]->fd;
                sizes[i] = slabs[i]->size;
                total += sizes[i];
        }
        k = cuda_map_fds(cu, device, fds, sizes, n, false, &va, ret_message);
        if (k < 0) {
                *ret_what = "map the lease";
                return k;
        }
        host = malloc(total);
        if (!host) {
                k = -ENOMEM;
                goto out;
        }
        r = cu->cuMemcpyDtoH(host, va, total);
        if (r != CUDA_SUCCESS) {
                *ret_what = "read the lease";
                k = cuda_result_to_errno(r);
                goto out;
        }
        for (size_t i = 0; i < total / sizeof(uint32_t); i++)
                if (host[i] != expect) {
                        *ret_what = expect == 0 ? "find the lease zeroed" : "read back the pattern";
                        k = -EBADMSG;
                        goto out;
                }
        r = cu->cuMemsetD32(va, pattern, total / sizeof(uint32_t));
        if (r != CUDA_SUCCESS) {
                *ret_what = "write the lease";
                k = cuda_result_to_errno(r);
                goto out;
        }
        r = cu->cuCtxSynchronize();
        if (r != CUDA_SUCCESS) {
                *ret_what = "write the lease";
                k = cuda_result_to_errno(r);
        }
out:
        (void)cuda_unmap(cu, va, sizes, n);
        return k;
}

static int check_device(Pool *pool, CudaDriver *cu, size_t i, FILE *out) {
        _cleanup_free_ char *message = NULL;
        Slab *slabs[POOL_MAX_SLABS], *again[POOL_MAX_SLABS];
        char b1[FORMAT_SIZE_MAX], b2[FORMAT_SIZE_MAX], b3[FORMAT_SIZE_MAX];
        PoolDeviceStats before, after;
        const char *what;
        size_t n = 0, m = 0;
        double t0, t_fresh, t_hit;
        int k;

        pool_device_stats(pool, i, &before);
        fprintf(out, "device %d: %s, %s, granularity %s, pool capacity %s\n", before.index, before.name,
                format_size(before.total, b1, sizeof(b1)), format_size(before.granularity, b2, sizeof(b2)),
                format_size(before.capacity, b3, sizeof(b3)));

        what = "use the device";
        k = pool_use_device(pool, i);
        if (k != 0)
                goto fail;
        what = "lease memory";
        t0 = now_us();
        k = pool_alloc(pool, before.index, CHECK_SIZE, getuid(), slabs, &n);
        t_fresh = now_us() - t0;
        if (k != 0)
                goto fail;
        /* A fresh lease must read zero too: the driver is relied on for that. */
        k = use_lease(cu, before.index, slabs, n, 0, CHECK_PATTERN, &what, &message);
        if (k == 0)
                k = use_lease(cu, before.index, slabs, n, CHECK_PATTERN, CHECK_PATTERN, &what, &message);
        for (size_t j = 0; j < n; j++)
                pool_reclaim(pool, slabs[j]);
        if (k != 0)
                goto fail;

        what = "scrub the freed slabs";
        k = pool_drain(pool);
        if (k != 0)
                goto fail;

        what = "lease memory from the cache";
        t0 = now_us();
        k = pool_alloc(pool, before.index, CHECK_SIZE, getuid(), again, &m);
        t_hit = now_us() - t0;
        if (k != 0)
                goto fail;
        k = use_lease(cu, before.index, again, m, 0, CHECK_PATTERN, &what, &message);
        for (size_t j = 0; j < m; j++)
                pool_reclaim(pool, again[j]);
        if (k != 0)
                goto fail;
        k = pool_drain(pool);

        pool_device_stats(pool, i, &after);
        if (after.hits - before.hits != m) {
                what = "serve the second lease from the cache";
                k = -ESTALE;
                goto fail;
        }
        fprintf(out,
                "device %d: OK: leased %s as %zu slabs (fresh %.0f us), wrote and read it back, freed it; "
                "leased it again from the cache (%.1f us) and it read zero\n",
                before.index, format_size(CHECK_SIZE, b1, sizeof(b1)), n, t_fresh, t_hit);
        return 0;

fail:
        /* The reason after the error's name: the driver's, the pool's (only for the codes it explains), or ours. */
        if (!message && k == POOL_E_TOO_LARGE && CHECK_SIZE > before.capacity)
                set_message(&message, "the check leases %s, more than the pool's capacity of %s on this device "
                            "(Capacity=)", format_size(CHECK_SIZE, b1, sizeof(b1)),
                            format_size(before.capacity, b2, sizeof(b2)));
        if (!message && (k == POOL_E_DRIVER || k == POOL_E_NOMEM) && *pool_last_error(pool))
                message = strdup(pool_last_error(pool));
        fprintf(out, "device %d: FAILED to %s: %s%s%s\n", before.index, what,
                k > 0 ? pool_strerror(k) : strerror(-k), message ? ": " : "", message ?: "");
        return 1;
}

int selfcheck_run(Pool *pool, CudaDriver *cu, FILE *out) {
        int failed = 0;

        fprintf(out, "driver: %s, CUDA %d.%d\n", cu->path, cu->version / 1000, cu->version % 1000 / 10);
        for (size_t i = 0; i < pool_n_devices(pool); i++)
                failed |= check_device(pool, cu, i, out);
        return failed;
}
