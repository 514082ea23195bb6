/* SPDX-License-Identifier: MIT */

/*
 * bench-driver: what cuMemCreate and cuMemExportToShareableHandle cost, each
 * timed alone, depending on what the process did just before. The pool's
 * fresh-slab cost is exactly these two calls, so this is its floor.
 *
 *   keep        create + export, keeping every allocation and fd (nothing released in between)
 *   recycle     create + export, then close the fd and release, before the next create
 *   mapped      as recycle, but the allocation is also mapped with access and unmapped before release
 *               (what the pool does with a slab it scrubbed and later evicts)
 *   closed      create + export, then close the fd but keep the allocation until the end
 *   released    create + export, then release the allocation but keep the fd open until the end
 *   primed      as recycle, then one untimed export of a separate allocation before the next create
 *
 * Usage: bench-driver [REPS] (default 20). Prints medians in microseconds.
 */

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "driver.h"
#include "macro.h"
#include "size.h"
#include "timing.h"

#define MiB (UINT64_C(1) << 20)
#define MAX_REPS 200

static void check(CudaDriver *cu, CUresult r, const char *what) {
        if (r != CUDA_SUCCESS) {
                fprintf(stderr, "bench-driver: %s: %s\n", what, cuda_result_name(cu, r));
                exit(EXIT_FAILURE);
        }
}

enum { KEEP, RECYCLE, MAPPED, CLOSED, RELEASED, PRIMED, N_MODES };
static const char *const mode_names[] = { "keep", "recycle", "mapped", "closed", "released", "primed" };

static void run(CudaDriver *cu, uint64_t size, int mode, unsigned reps, double *ret_create, double *ret_export) {
        CUmemAllocationProp prop = cuda_slab_prop(0);
        CUmemAccessDesc access = {
                .location = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0 },
                .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        CUmemGenericAllocationHandle h[MAX_REPS], primer[MAX_REPS];
        double tc[MAX_REPS], te[MAX_REPS];
        int fd[MAX_REPS], primer_fd[MAX_REPS];

        for (unsigned i = 0; i < reps; i++) {
                double t0 = now_us(), t1;

                check(cu, cu->cuMemCreate(&h[i], size, &prop, 0), "cuMemCreate");
                t1 = now_us();
                check(cu, cu->cuMemExportToShareableHandle(&fd[i], h[i], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                      "cuMemExportToShareableHandle");
                te[i] = now_us() - t1;
                tc[i] = t1 - t0;
                if (mode == MAPPED) {
                        CUdeviceptr va;

                        check(cu, cu->cuMemAddressReserve(&va, size, size, 0, 0), "cuMemAddressReserve");
                        check(cu, cu->cuMemMap(va, size, 0, h[i], 0), "cuMemMap");
                        check(cu, cu->cuMemSetAccess(va, size, &access, 1), "cuMemSetAccess");
                        check(cu, cu->cuMemsetD8(va, 0, size), "cuMemsetD8");
                        check(cu, cu->cuCtxSynchronize(), "cuCtxSynchronize");
                        check(cu, cu->cuMemUnmap(va, size), "cuMemUnmap");
                        check(cu, cu->cuMemAddressFree(va, size), "cuMemAddressFree");
                }
                if (mode == RECYCLE || mode == MAPPED || mode == PRIMED || mode == CLOSED)
                        fd[i] = safe_close(fd[i]);
                if (mode == RECYCLE || mode == MAPPED || mode == PRIMED || mode == RELEASED) {
                        check(cu, cu->cuMemRelease(h[i]), "cuMemRelease");
                        h[i] = 0;
                }
                if (mode == PRIMED) {
                        check(cu, cu->cuMemCreate(&primer[i], 2 * MiB, &prop, 0), "cuMemCreate");
                        check(cu, cu->cuMemExportToShareableHandle(&primer_fd[i], primer[i],
                                                                   CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                              "cuMemExportToShareableHandle");
                }
        }
        for (unsigned i = 0; i < reps; i++) {
                safe_close(fd[i]);
                if (h[i])
                        check(cu, cu->cuMemRelease(h[i]), "cuMemRelease");
                if (mode == PRIMED) {
                        safe_close(primer_fd[i]);
                        check(cu, cu->cuMemRelease(primer[i]), "cuMemRelease");
                }
        }
        *ret_create = median(tc, reps);
        *ret_export = median(te, reps);
}

int main(int argc, char *argv[]) {
        static const uint64_t sizes[] = { 2 * MiB, 64 * MiB, 1024 * MiB };
        _cleanup_free_ char *message = NULL;
        unsigned reps = argc > 1 ? (unsigned)strtoul(argv[1], NULL, 10) : 20;
        CudaDriver *cu;
        CUcontext ctx;

        if (reps == 0 || reps > MAX_REPS) {
                fprintf(stderr, "Usage: %s [REPS], 1 to %d\n", argv[0], MAX_REPS);
                return EXIT_FAILURE;
        }
        if (cuda_driver_open(&cu, NULL, &message) < 0) {
                fprintf(stderr, "%s\n", message);
                return EXIT_FAILURE;
        }
        check(cu, cu->cuDevicePrimaryCtxRetain(&ctx, 0), "cuDevicePrimaryCtxRetain");
        check(cu, cu->cuCtxSetCurrent(ctx), "cuCtxSetCurrent");

        printf("bench-driver: %s (CUDA %d.%d), %u repetitions, medians in us\n", cu->path, cu->version / 1000,
               cu->version % 1000 / 10, reps);
        printf("%-8s %-8s %10s %10s\n", "size", "before", "create", "export");
        for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++)
                for (int mode = 0; mode < N_MODES; mode++) {
                        char b[FORMAT_SIZE_MAX];
                        double c, e;

                        run(cu, sizes[i], mode, reps, &c, &e);
                        printf("%-8s %-8s %10.1f %10.1f\n", format_size(sizes[i], b, sizeof(b)), mode_names[mode],
                               c, e);
                }
        (void)cu->cuDevicePrimaryCtxRelease(0);
        cuda_driver_close(cu);
        return EXIT_SUCCESS;
}
