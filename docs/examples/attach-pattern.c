/* SPDX-License-Identifier: MIT */

/*
 * attach-pattern: the consumer of the sharing example. Attaches a lease that
 * publish-pattern published, by its name, and checks every word of the
 * producer's pattern through the GPU's copy engine: the same physical memory,
 * mapped into this process with no copy, after the producer has exited.
 *
 *     publish-pattern 1G weights && attach-pattern weights
 *
 * NAME is the publisher's name as the library takes it: NAME for one the
 * calling user published, OWNER/NAME for one another user published (OWNER
 * a user name or uid: "alice/weights"). It prints the owner the broker says
 * the lease has (vmmb_lease_owner(), vmmb_lease_owner_name()).
 *
 * It prints the time from the attach request to a usable pointer (the
 * vmmb_attach_name() call: the broker's reply with the slabs' descriptors,
 * importing and mapping them), then how long reading back took. --readonly
 * asks for a read-only hold (the library maps the memory read-only);
 * --seed N checks for the pattern of that seed instead of the name's;
 * --hold keeps the lease after checking it until standard input closes, for
 * `vmmctl list`; --unpublish removes the name at the end, after freeing this
 * process's hold, so that the lease ends. Exit status 0 when every word
 * checked out (and each step worked). The socket is $VMMBROKER_SOCKET or the
 * system broker's; the driver is libcuda.so.1 or $VMMBROKER_LIBCUDA.
 */

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cuda.h>

#include "codec.h"
#include "driver.h"
#include "pattern.h"
#include "size.h"
#include "vmmbroker.h"

/* Wrong words reported one by one before only counting. */
#define SHOW_BAD 3

static double now_us(void) {
        struct timespec ts;

        (void)clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int parse_seed(const char *s, uint32_t *ret) {
        unsigned long long v;
        char *end;

        errno = 0;
        v = strtoull(s, &end, 0);
        if (!*s || *end || errno || v > UINT32_MAX)
                return -EINVAL;
        *ret = (uint32_t)v;
        return 0;
}

static void usage(FILE *f) {
        fprintf(f,
                "Usage: %s [--readonly] [--seed N] [--hold] [--unpublish] NAME|OWNER/NAME\n"
                "Attach the lease published as NAME and check publish-pattern's pattern in every word.\n"
                "NAME is one of your own names; another user's is OWNER/NAME (OWNER a user name or uid).\n"
                "  --readonly   ask for a read-only hold\n"
                "  --seed N     the pattern's seed (default: derived from NAME, as publish-pattern does)\n"
                "  --hold       after checking, keep the lease until standard input closes\n"
                "  --unpublish  at the end, unpublish NAME (the lease then ends when nobody holds it)\n",
                program_invocation_short_name);
}

int main(int argc, char *argv[]) {
        static const struct option options[] = {
                { "readonly", no_argument, NULL, 'r' },
                { "seed", required_argument, NULL, 's' },
                { "hold", no_argument, NULL, 'H' },
                { "unpublish", no_argument, NULL, 'U' },
                { "help", no_argument, NULL, 'h' },
                {}
        };
        char *message = NULL, b[FORMAT_SIZE_MAX], split[VMMB_LEASE_NAME_REF_MAX + 1], owner[32];
        bool seed_given = false, hold = false, unpublish = false, retained = false, readonly;
        unsigned flags = 0;
        uint64_t size, bad = 0;
        uint32_t seed = 0, *host = NULL;
        vmmb_client *client = NULL;
        vmmb_lease *lease = NULL;
        CudaDriver *cu = NULL;
        const char *name, *owner_part, *bare;
        double t0, t_attach, t_check;
        CUcontext ctx;
        CUdeviceptr ptr;
        int c, k, status = EXIT_FAILURE;

        setvbuf(stdout, NULL, _IOLBF, 0);       /* lines in order with stderr's, also into a pipe or file */
        while ((c = getopt_long(argc, argv, "", options, NULL)) >= 0)
                switch (c) {
                case 'r':
                        flags |= VMMB_READONLY;
                        break;
                case 's':
                        if (parse_seed(optarg, &seed) < 0) {
                                fprintf(stderr, "%s: bad seed: %s\n", program_invocation_short_name, optarg);
                                return EXIT_FAILURE;
                        }
                        seed_given = true;
                        break;
                case 'H':
                        hold = true;
                        break;
                case 'U':
                        unpublish = true;
                        break;
                case 'h':
                        usage(stdout);
                        return EXIT_SUCCESS;
                default:
                        usage(stderr);
                        return EXIT_FAILURE;
                }
        if (argc - optind != 1) {
                fprintf(stderr, "%s: %s\n", program_invocation_short_name,
                        argc - optind < 1 ? "needs the NAME of a published lease" : "takes one NAME, nothing more");
                usage(stderr);
                return EXIT_FAILURE;
        }
        name = argv[optind];
        if (vmmb_lease_name_split(name, split, &owner_part, &bare) < 0) {
                fprintf(stderr, "%s: '%s' is not a lease's name: NAME (one of yours) or OWNER/NAME (OWNER a user "
                        "name or uid), NAME 1-128 letters, digits and ._-:@+, the first a letter or digit\n",
                        program_invocation_short_name, name);
                return EXIT_FAILURE;
        }
        /* publish-pattern derives the seed from the bare name it published */
        if (!seed_given)
                seed = pattern_seed(bare);

        /*
         * The driver and the context come first, and the connection, so that
         * the time measured below is the attach alone: what a process that
         * already uses the GPU pays to map memory another process filled.
         */
        if (cuda_driver_open(&cu, NULL, &message) < 0 ||
            !(retained = cu->cuDevicePrimaryCtxRetain(&ctx, 0) == CUDA_SUCCESS) ||
            cu->cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
                fprintf(stderr, "%s\n", message ? message : "Cannot use CUDA device 0.");
                goto out;
        }
        k = vmmb_connect(NULL, &client);
        if (k < 0) {
                fprintf(stderr, "pid %d: %s\n", (int)getpid(), vmmb_error_message());
                goto out;
        }

        t0 = now_us();
        k = vmmb_attach_name(client, name, flags, &lease);
        t_attach = now_us() - t0;
        if (k < 0) {
                fprintf(stderr, "pid %d: cannot attach \"%s\": %s\n", (int)getpid(), name, vmmb_error_message());
                goto out;
        }
        ptr = (CUdeviceptr)vmmb_lease_ptr(lease);
        size = vmmb_lease_size(lease);
        readonly = vmmb_lease_readonly(lease) > 0;
        if (vmmb_lease_owner(lease) == (uid_t)-1)
                snprintf(owner, sizeof(owner), "unknown");      /* a broker older than owner namespaces */
        else
                snprintf(owner, sizeof(owner), "uid %u", (unsigned)vmmb_lease_owner(lease));
        printf("pid %d: attached \"%s\" in %.1f us: lease %s, %s on device %d at 0x%" PRIx64 ", %s, owned by "
               "%s (%s)\n", (int)getpid(), name, t_attach, vmmb_lease_id(lease), format_size(size, b, sizeof(b)),
               vmmb_lease_device(lease), (uint64_t)ptr, readonly ? "read-only" : "read-write",
               vmmb_lease_owner_name(lease) ?: "?", owner);
        if ((flags & VMMB_READONLY) && !readonly) {
                fprintf(stderr, "pid %d: asked for a read-only hold, got a read-write one\n", (int)getpid());
                goto out;
        }

        host = malloc(PATTERN_CHUNK);
        if (!host) {
                fprintf(stderr, "pid %d: out of memory\n", (int)getpid());
                goto out;
        }
        t0 = now_us();
        for (uint64_t off = 0; off < size; off += PATTERN_CHUNK) {
                uint64_t n = size - off < PATTERN_CHUNK ? size - off : PATTERN_CHUNK;

                if (cu->cuMemcpyDtoH(host, ptr + off, n) != CUDA_SUCCESS) {
                        fprintf(stderr, "pid %d: reading back failed\n", (int)getpid());
                        goto out;
                }
                for (uint64_t i = 0; i < n / 4; i++) {
                        uint32_t want = pattern_word(off / 4 + i, seed);

                        if (host[i] == want)
                                continue;
                        if (bad++ < SHOW_BAD)
                                printf("pid %d: word %" PRIu64 " is %#" PRIx32 ", not %#" PRIx32 "\n", (int)getpid(),
                                       off / 4 + i, host[i], want);
                }
        }
        t_check = now_us() - t0;
        printf("pid %d: read back %" PRIu64 " words of pattern seed %#" PRIx32 " in %.1f ms: %s\n", (int)getpid(),
               size / 4, seed, t_check / 1e3, bad == 0 ? "all correct" : "WRONG");
        if (bad)
                printf("pid %d: %" PRIu64 " of %" PRIu64 " words differ\n", (int)getpid(), bad, size / 4);
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
        printf("pid %d: freed its hold\n", (int)getpid());
        if (unpublish) {
                k = vmmb_unpublish(client, name);
                if (k < 0) {
                        fprintf(stderr, "pid %d: cannot unpublish \"%s\": %s\n", (int)getpid(), name,
                                vmmb_error_message());
                        goto out;
                }
                printf("pid %d: unpublished \"%s\"\n", (int)getpid(), name);
        }
        status = bad == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
out:
        free(host);
        vmmb_free(lease);
        vmmb_close(client);
        if (retained)
                (void)cu->cuDevicePrimaryCtxRelease(0);
        cuda_driver_close(cu);
        free(message);
        return status;
}
