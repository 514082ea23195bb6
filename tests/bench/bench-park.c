/* SPDX-License-Identifier: MIT */

/*
 * bench-park: parking a lease in host memory and bringing it back (issue 16's target: park and unpark of
 * 1 GiB each at >= 80% of the host<->device copy bandwidth measured in the same run, content bit-identical
 * after the round trip). It starts its own vmmbrokerd ($VMMBROKER_DAEMON) on whatever driver it loads (the
 * simulated device in CI) and prints, with the machine it ran on:
 *
 *   floor d2h, h2d   the copy the daemon makes, made here: cuMemcpyDtoDAsync between a mapping of device
 *                    memory (cuMemAlloc) and a mapping of pinned host-NUMA VMM memory (the daemon's host
 *                    slabs: cuMemCreate at CU_MEM_LOCATION_TYPE_HOST_NUMA, mapped with device access), on one
 *                    stream, timed around the call and its cuStreamSynchronize
 *   park             vmmb_lease_park(): wait for the stream, unmap (keeping the range), the Park call (the
 *                    daemon's copy into host slabs, its store, giving the device slabs back)
 *   unpark           vmmb_lease_unpark(): the Unpark call (device slabs, the copy back) and mapping at the
 *                    same address
 *
 * Medians of REPS rounds after a first, cold one (whose park creates the host slabs: printed apart); each
 * round checks the content (a pattern written before the first park) after the unpark, and that the address
 * did not move. Bandwidths in GB/s (10^9 bytes per second).
 *
 * A program that prints, not a test. Usage: bench-park [REPS, default 10] [SIZE in MiB, default 1024]
 */

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "driver.h"
#include "harness.h"
#include "machine.h"
#include "macro.h"
#include "timing.h"
#include "vmmbroker.h"

#define MiB (UINT64_C(1) << 20)
#define MAX_REPS 1000
#define TARGET 0.80

static CudaDriver *cu;

static _Noreturn void die(const char *what, int k) {
        fprintf(stderr, "bench-park: %s: %s\n", what, strerror(k < 0 ? -k : k));
        exit(EXIT_FAILURE);
}

static void check(CUresult r, const char *what) {
        if (r != CUDA_SUCCESS) {
                fprintf(stderr, "bench-park: %s: %s\n", what, cuda_result_name(cu, r));
                exit(EXIT_FAILURE);
        }
}

static double gbps(uint64_t bytes, double us) {
        return (double)bytes / us / 1e3;
}

/* Pinned host-NUMA VMM memory of `size` bytes on `node`, mapped with access for `dev`, as the daemon's. */
static CUdeviceptr host_mapping(CUdevice dev, int node, uint64_t size, CUmemGenericAllocationHandle *ret) {
        CUmemAllocationProp prop = cuda_host_prop(node);
        CUmemAccessDesc access = {
                .location = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = dev },
                .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        CUdeviceptr va = 0;

        check(cu->cuMemCreate(ret, size, &prop, 0), "cuMemCreate (host memory)");
        check(cu->cuMemAddressReserve(&va, size, cuda_slab_alignment(size), 0, 0), "cuMemAddressReserve");
        check(cu->cuMemMap(va, size, 0, *ret, 0), "cuMemMap");
        check(cu->cuMemSetAccess(va, size, &access, 1), "cuMemSetAccess");
        return va;
}

/* One copy on the stream, timed until it is done. */
static double timed_copy(CUdeviceptr dst, CUdeviceptr src, uint64_t size, CUstream stream) {
        double t0 = now_us();

        check(cu->cuMemcpyDtoDAsync(dst, src, size, stream), "cuMemcpyDtoDAsync");
        check(cu->cuStreamSynchronize(stream), "cuStreamSynchronize");
        return now_us() - t0;
}

static void fill(unsigned char *buf, uint64_t n) {
        for (uint64_t i = 0; i < n; i += 8) {
                uint64_t v = i * UINT64_C(0x9e3779b97f4a7c15) + 12345;

                memcpy(buf + i, &v, MIN(8, n - i));
        }
}

int main(int argc, char *argv[]) {
        unsigned reps = argc > 1 ? (unsigned)strtoul(argv[1], NULL, 10) : 10;
        uint64_t size = (argc > 2 ? strtoull(argv[2], NULL, 10) : 1024) * MiB;
        double *park, *unpark, *d2h, *h2d, cold_park = 0, cold_unpark = 0, t0;
        double m_park, m_unpark, m_d2h, m_h2d;
        CUmemGenericAllocationHandle host_handle;
        CUdeviceptr dev_va = 0, host_va, lease_va;
        unsigned char *want, *got;
        vmmb_client *client;
        vmmb_lease *lease;
        CUcontext ctx;
        CUstream stream;
        CUdevice dev;
        Harness h;
        int node, k;

        if (reps == 0 || reps > MAX_REPS || size == 0) {
                fprintf(stderr, "Usage: %s [REPS, 1 to %d] [SIZE in MiB]\n", argv[0], MAX_REPS);
                return EXIT_FAILURE;
        }
        park = calloc(reps, sizeof(double));
        unpark = calloc(reps, sizeof(double));
        d2h = calloc(reps, sizeof(double));
        h2d = calloc(reps, sizeof(double));
        want = malloc(size);
        got = malloc(size);
        if (!park || !unpark || !d2h || !h2d || !want || !got)
                die("allocating", -ENOMEM);

        k = harness_start(&h, NULL);
        if (k < 0)
                die("starting vmmbrokerd (is VMMBROKER_DAEMON set?)", k);
        machine_open_device("bench-park", &cu, &dev, &ctx);
        check(cu->cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
        node = cuda_device_numa_node(cu, dev);
        k = vmmb_connect(h.socket, &client);
        if (k < 0)
                die("vmmb_connect", k);

        machine_print("bench-park", cu);
        printf("method: a lease of %" PRIu64 " MiB on device 0, parked and unparked %u times after a cold round; "
               "medians, CLOCK_MONOTONIC around each call; the floor is the daemon's own copy made here "
               "(cuMemcpyDtoDAsync between cuMemAlloc memory and pinned host-NUMA VMM memory on node %d, "
               "+ cuStreamSynchronize), measured between the rounds; GB/s = 10^9 bytes/s\n",
               size / MiB, reps, node < 0 ? 0 : node);
        fflush(stdout);

        /* The floor's memory, and the lease with its pattern. */
        check(cu->cuMemAlloc(&dev_va, size), "cuMemAlloc");
        host_va = host_mapping(dev, node, size, &host_handle);
        fill(want, size);
        k = vmmb_alloc(client, size, 0, "bench-park", &lease);
        if (k < 0)
                die("vmmb_alloc", k);
        lease_va = vmmb_lease_ptr(lease);
        check(cu->cuMemcpyHtoD(lease_va, want, size), "cuMemcpyHtoD");

        for (unsigned i = 0; i <= reps; i++) {
                double tp, tu;

                t0 = now_us();
                k = vmmb_lease_park(lease, NULL);
                tp = now_us() - t0;
                if (k < 0)
                        die("vmmb_lease_park", k);
                if (!vmmb_lease_parked(lease))
                        die("vmmb_lease_parked after a park", -EPROTO);
                t0 = now_us();
                k = vmmb_lease_unpark(lease);
                tu = now_us() - t0;
                if (k < 0)
                        die("vmmb_lease_unpark", k);
                if (vmmb_lease_ptr(lease) != lease_va)
                        die("the lease moved: unparked at another address", -EPROTO);
                check(cu->cuMemcpyDtoH(got, lease_va, size), "cuMemcpyDtoH");
                if (memcmp(want, got, size) != 0)
                        die("the content changed across park and unpark", -EPROTO);
                if (i == 0) {
                        cold_park = tp;
                        cold_unpark = tu;
                        continue;
                }
                park[i - 1] = tp;
                unpark[i - 1] = tu;
                d2h[i - 1] = timed_copy(host_va, dev_va, size, stream);
                h2d[i - 1] = timed_copy(dev_va, host_va, size, stream);
        }
        m_park = median(park, reps);
        m_unpark = median(unpark, reps);
        m_d2h = median(d2h, reps);
        m_h2d = median(h2d, reps);

        printf("%-26s %10s %8s\n", "", "us", "GB/s");
        printf("%-26s %10.0f %8.2f\n", "floor: device -> host", m_d2h, gbps(size, m_d2h));
        printf("%-26s %10.0f %8.2f\n", "floor: host -> device", m_h2d, gbps(size, m_h2d));
        printf("%-26s %10.0f %8.2f\n", "park (cold: host slabs made)", cold_park, gbps(size, cold_park));
        printf("%-26s %10.0f %8.2f\n", "unpark (first)", cold_unpark, gbps(size, cold_unpark));
        printf("%-26s %10.0f %8.2f\n", "park", m_park, gbps(size, m_park));
        printf("%-26s %10.0f %8.2f\n", "unpark", m_unpark, gbps(size, m_unpark));
        printf("content bit-identical after each of %u round trips, at the same address\n", reps + 1);
        printf("target: park   >= %.0f%% of device->host  %-6s %.1f%% (%.2f of %.2f GB/s)\n", TARGET * 100,
               m_d2h / m_park >= TARGET ? "met" : "MISSED", 100 * m_d2h / m_park, gbps(size, m_park),
               gbps(size, m_d2h));
        printf("target: unpark >= %.0f%% of host->device  %-6s %.1f%% (%.2f of %.2f GB/s)\n", TARGET * 100,
               m_h2d / m_unpark >= TARGET ? "met" : "MISSED", 100 * m_h2d / m_unpark, gbps(size, m_unpark),
               gbps(size, m_h2d));

        k = vmmb_free(lease);
        if (k < 0)
                die("vmmb_free", k);
        vmmb_close(client);
        check(cu->cuMemUnmap(host_va, size), "cuMemUnmap");
        check(cu->cuMemAddressFree(host_va, size), "cuMemAddressFree");
        check(cu->cuMemRelease(host_handle), "cuMemRelease");
        check(cu->cuMemFree(dev_va), "cuMemFree");
        check(cu->cuStreamDestroy(stream), "cuStreamDestroy");
        (void)cu->cuDevicePrimaryCtxRelease(dev);
        cu = cuda_driver_close(cu);
        k = harness_stop(&h);
        if (k < 0)
                die("stopping vmmbrokerd", k);
        free(park);
        free(unpark);
        free(d2h);
        free(h2d);
        free(want);
        free(got);
        return EXIT_SUCCESS;
}
