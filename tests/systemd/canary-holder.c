/* SPDX-License-Identifier: MIT */
/*
 * canary-holder: a client that holds a lease with a canary in it while the
 * broker is restarted around it (tests/systemd/boot-test.sh).
 *
 *     canary-holder SIZE
 *
 * Leases SIZE, writes a pattern of its own into the whole lease through the
 * device (word[i] = i * 2654435761 ^ pid), reads it back, and prints
 *
 *     leased ID SIZE
 *
 * Then, for each line read on standard input:
 *
 *     check    reads the whole lease back through its own mapping and prints
 *              "check N: intact" or "check N: WRONG W of T words"
 *     park     parks the lease (its content goes to host memory), unparks it
 *              (the host memory is freed, zeroed and kept for the next park),
 *              reads it back and prints "park N: intact", "park N: WRONG ..."
 *              or "park N: " and the broker's message
 *
 * The mapping is the holder's: the daemon restarting, crashing or stopping
 * does not touch it, and a restart must not give the memory to anyone else.
 * At the end of standard input it frees the lease (a failure is printed, not
 * fatal: a stopped broker has ended it already) and prints "done". Exit
 * status 0 unless the lease could not be made or a check failed to run.
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

#define CHUNK (UINT64_C(16) << 20)

static uint32_t word(uint64_t i, uint32_t seed) {
        return (uint32_t)(i * 2654435761u) ^ seed;
}

/* Returns the number of wrong words, or -1 when a copy failed. */
static int64_t check(CudaDriver *cu, CUdeviceptr ptr, uint64_t size, uint32_t seed, uint32_t *host) {
        int64_t wrong = 0;

        for (uint64_t off = 0; off < size; off += CHUNK) {
                uint64_t n = size - off < CHUNK ? size - off : CHUNK;

                if (cu->cuMemcpyDtoH(host, ptr + off, n) != CUDA_SUCCESS)
                        return -1;
                for (uint64_t i = 0; i < n / 4; i++)
                        wrong += host[i] != word(off / 4 + i, seed);
        }
        return wrong;
}

int main(int argc, char *argv[]) {
        uint32_t seed = (uint32_t)getpid(), *host = NULL;
        vmmb_client *client = NULL;
        vmmb_lease *lease = NULL;
        char *message = NULL, line[64];
        CudaDriver *cu = NULL;
        uint64_t size;
        CUdeviceptr ptr;
        CUcontext ctx;
        unsigned n_checks = 0, n_parks = 0;
        int64_t wrong;
        int status = EXIT_FAILURE;

        if (argc != 2 || parse_size(argv[1], &size) < 0 || size == 0) {
                fprintf(stderr, "Usage: %s SIZE\n", program_invocation_short_name);
                return 2;
        }
        setvbuf(stdout, NULL, _IOLBF, 0);
        if (cuda_driver_open(&cu, NULL, &message) < 0 || cu->cuDevicePrimaryCtxRetain(&ctx, 0) != CUDA_SUCCESS ||
            cu->cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
                fprintf(stderr, "canary-holder: %s\n", message ?: "cannot use CUDA device 0");
                goto out;
        }
        host = malloc(CHUNK);
        if (!host)
                goto out;
        if (vmmb_connect(NULL, &client) < 0 || vmmb_alloc(client, size, 0, "canary", &lease) < 0) {
                fprintf(stderr, "canary-holder: %s\n", vmmb_error_message());
                goto out;
        }
        ptr = (CUdeviceptr)vmmb_lease_ptr(lease);
        size = vmmb_lease_size(lease);
        for (uint64_t off = 0; off < size; off += CHUNK) {
                uint64_t n = size - off < CHUNK ? size - off : CHUNK;

                for (uint64_t i = 0; i < n / 4; i++)
                        host[i] = word(off / 4 + i, seed);
                if (cu->cuMemcpyHtoD(ptr + off, host, n) != CUDA_SUCCESS) {
                        fprintf(stderr, "canary-holder: writing the canary failed\n");
                        goto out;
                }
        }
        if (check(cu, ptr, size, seed, host) != 0) {
                fprintf(stderr, "canary-holder: the canary did not read back\n");
                goto out;
        }
        printf("leased %s %" PRIu64 "\n", vmmb_lease_id(lease), size);

        while (fgets(line, sizeof(line), stdin)) {
                bool park = strcmp(line, "park\n") == 0;
                const char *what = park ? "park" : "check";
                unsigned *n = park ? &n_parks : &n_checks;

                if (!park && strcmp(line, "check\n") != 0) {
                        printf("unknown command\n");
                        continue;
                }
                if (park && (vmmb_lease_park(lease, NULL) < 0 || vmmb_lease_unpark(lease) < 0)) {
                        printf("park %u: %s\n", ++*n, vmmb_error_message());
                        continue;
                }
                wrong = check(cu, ptr, size, seed, host);
                if (wrong < 0) {
                        printf("%s %u: cannot read the lease\n", what, ++*n);
                        goto out;
                }
                if (wrong == 0)
                        printf("%s %u: intact\n", what, ++*n);
                else
                        printf("%s %u: WRONG %" PRId64 " of %" PRIu64 " words\n", what, ++*n, wrong, size / 4);
        }
        if (vmmb_free(lease) < 0)
                printf("free: %s\n", vmmb_error_message());
        lease = NULL;
        printf("done\n");
        status = EXIT_SUCCESS;
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
