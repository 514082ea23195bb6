/* SPDX-License-Identifier: MIT */

/*
 * lease-pattern: lease device memory from vmmbrokerd, write a pattern of this
 * process's own into it through the GPU's copy engine, read it back and check
 * every word, then free it. Run two at once to see the broker serve two
 * processes side by side:
 *
 *     lease-pattern 256M & lease-pattern 256M & wait
 *
 * The pattern is word[i] = i * 2654435761 ^ seed, with the pid as seed, so
 * one process's words are wrong in any other's lease. Exit status 0 when
 * every word checked out. The socket is $VMMBROKER_SOCKET or the system
 * broker's; the driver is libcuda.so.1 or $VMMBROKER_LIBCUDA.
 *
 * With --hold it keeps the lease after checking it until its standard input
 * closes (Ctrl-D), so that `vmmctl list` and `vmmctl status` can show it.
 * With --zero it first checks that the lease reads zero, as the broker
 * promises, before writing anything: run it after another user's
 * lease-pattern exited, and it must not see that user's words
 * (tests/gpu/canary.sh).
 */

#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda.h>

#include "driver.h"
#include "size.h"
#include "vmmbroker.h"

#define CHUNK (UINT64_C(64) << 20)

#define USAGE                                                                                           \
        "Usage: %s [--hold] [--zero] [SIZE]\n"                                                           \
        "Lease SIZE (e.g. 256M, 1G; default 256M), write a pattern of this process's own, check it, free it.\n" \
        "  --hold   after checking, keep the lease until standard input closes\n"                         \
        "  --zero   first check that the new lease reads zero\n"

static uint32_t word(uint64_t i, uint32_t seed) {
        return (uint32_t)(i * 2654435761u) ^ seed;
}

int main(int argc, char *argv[]) {
        char *message = NULL, b[FORMAT_SIZE_MAX];
        uint64_t size = UINT64_C(256) << 20, bad = 0, wrong = 0;
        uint32_t seed = (uint32_t)getpid();
        vmmb_client *client = NULL;
        vmmb_lease *lease = NULL;
        uint32_t *host = NULL;
        CudaDriver *cu = NULL;
        CUcontext ctx;
        CUdeviceptr ptr;
        int k, status = EXIT_FAILURE;
        bool hold = false, zero = false;

        for (; argc > 1 && argv[1][0] == '-' && argv[1][1]; argv++, argc--)
                if (strcmp(argv[1], "--hold") == 0)
                        hold = true;
                else if (strcmp(argv[1], "--zero") == 0)
                        zero = true;
                else if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
                        printf(USAGE, program_invocation_short_name);
                        return EXIT_SUCCESS;
                } else if (strcmp(argv[1], "--") == 0) {
                        argv++, argc--;
                        break;
                } else {
                        fprintf(stderr, "%s: unknown option %s\n" USAGE, program_invocation_short_name, argv[1],
                                program_invocation_short_name);
                        return EXIT_FAILURE;
                }
        if (argc > 2) {
                fprintf(stderr, "%s: one SIZE at most, not also '%s'\n" USAGE, program_invocation_short_name,
                        argv[2], program_invocation_short_name);
                return EXIT_FAILURE;
        }
        if (argc == 2 && (parse_size(argv[1], &size) < 0 || size == 0)) {
                fprintf(stderr, "%s: '%s' is not a size of more than 0 bytes, such as 256M or 1G\n" USAGE,
                        program_invocation_short_name, argv[1], program_invocation_short_name);
                return EXIT_FAILURE;
        }
        /* The library loads the driver for itself; the example needs it too, for the copies. */
        if (cuda_driver_open(&cu, NULL, &message) < 0 || cu->cuDevicePrimaryCtxRetain(&ctx, 0) != CUDA_SUCCESS ||
            cu->cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
                fprintf(stderr, "%s\n", message ? message : "Cannot use CUDA device 0.");
                goto out;
        }
        k = vmmb_connect(NULL, &client);
        if (k < 0) {
                fprintf(stderr, "pid %d: %s\n", (int)getpid(), vmmb_error_message());
                goto out;
        }
        k = vmmb_alloc(client, size, 0, "lease-pattern", &lease);
        if (k < 0) {
                fprintf(stderr, "pid %d: cannot lease %s: %s\n", (int)getpid(), format_size(size, b, sizeof(b)),
                        vmmb_error_message());
                goto out;
        }
        ptr = (CUdeviceptr)vmmb_lease_ptr(lease);
        size = vmmb_lease_size(lease);
        printf("pid %d: leased %s on device %d at 0x%" PRIx64 " (lease %s)\n", (int)getpid(),
               format_size(size, b, sizeof(b)), vmmb_lease_device(lease), (uint64_t)ptr, vmmb_lease_id(lease));

        host = malloc(CHUNK);
        if (!host)
                goto out;
        if (zero) {
                uint64_t nonzero = 0;

                for (uint64_t off = 0; off < size; off += CHUNK) {
                        uint64_t n = size - off < CHUNK ? size - off : CHUNK;

                        if (cu->cuMemcpyDtoH(host, ptr + off, n) != CUDA_SUCCESS) {
                                fprintf(stderr, "pid %d: reading the new lease failed\n", (int)getpid());
                                goto out;
                        }
                        for (uint64_t i = 0; i < n / 4; i++)
                                nonzero += host[i] != 0;
                }
                printf("pid %d: before writing, the lease read %s\n", (int)getpid(),
                       nonzero == 0 ? "zero in every word" : "NOT ZERO");
                if (nonzero) {
                        printf("pid %d: %" PRIu64 " of %" PRIu64 " words were not zero\n", (int)getpid(), nonzero,
                               size / 4);
                        bad += nonzero;
                }
        }
        for (uint64_t off = 0; off < size; off += CHUNK) {
                uint64_t n = size - off < CHUNK ? size - off : CHUNK;

                for (uint64_t i = 0; i < n / 4; i++)
                        host[i] = word(off / 4 + i, seed);
                if (cu->cuMemcpyHtoD(ptr + off, host, n) != CUDA_SUCCESS) {
                        fprintf(stderr, "pid %d: writing the pattern failed\n", (int)getpid());
                        goto out;
                }
        }
        printf("pid %d: wrote %" PRIu64 " words of pattern seed %#x\n", (int)getpid(), size / 4, seed);
        for (uint64_t off = 0; off < size; off += CHUNK) {
                uint64_t n = size - off < CHUNK ? size - off : CHUNK;

                if (cu->cuMemcpyDtoH(host, ptr + off, n) != CUDA_SUCCESS) {
                        fprintf(stderr, "pid %d: reading back failed\n", (int)getpid());
                        goto out;
                }
                for (uint64_t i = 0; i < n / 4; i++)
                        wrong += host[i] != word(off / 4 + i, seed);
        }
        printf("pid %d: read back %" PRIu64 " words: %s\n", (int)getpid(), size / 4,
               wrong == 0 ? "all correct" : "WRONG");
        if (wrong)
                printf("pid %d: %" PRIu64 " words differ\n", (int)getpid(), wrong);
        bad += wrong;
        if (hold) {
                printf("pid %d: holding the lease until standard input closes\n", (int)getpid());
                fflush(stdout);
                while (getchar() != EOF)
                        ;
        }
        k = vmmb_free(lease);
        lease = NULL;
        if (k < 0) {
                fprintf(stderr, "pid %d: freeing failed: %s\n", (int)getpid(), vmmb_error_message());
                goto out;
        }
        printf("pid %d: freed\n", (int)getpid());
        status = bad == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
out:
        free(host);
        vmmb_free(lease);
        vmmb_close(client);
        if (cu)
                (void)cu->cuDevicePrimaryCtxRelease(0);
        cuda_driver_close(cu);
        free(message);
        return status;
}
