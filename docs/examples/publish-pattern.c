/* SPDX-License-Identifier: MIT */

/*
 * publish-pattern: the producer of the sharing example. Leases device memory
 * from vmmbrokerd, writes a pattern into it through the GPU's copy engine,
 * publishes the lease under a name and exits still holding it, as a process
 * that loaded a model's weights and then crashed would. The broker drops the
 * process's hold when it exits, but a published lease outlives its holders:
 * attach-pattern, run afterwards in another process, attaches it by name and
 * checks every word.
 *
 *     publish-pattern 1G weights && attach-pattern weights
 *     vmmctl unpublish weights              (or attach-pattern --unpublish)
 *
 * NAME is a bare name, without '/': it lives in the namespace of the user that
 * publishes it. That user's processes attach it as NAME, every other user (one
 * given with --uid) as OWNER/NAME, OWNER the owner's user name or uid:
 *
 *     publish-pattern --uid bob 1G weights          (as alice)
 *     attach-pattern alice/weights                  (as bob)
 *
 * The pattern is word[i] = i * 2654435761 ^ seed (pattern.h), the seed the
 * FNV-1a hash of the name unless --seed gives one. --uid USER (a name or a
 * number; repeatable) lets that user attach too, besides the lease's owner;
 * --readonly makes every attach by the name a read-only hold. Exit status 0
 * when the lease was written and published. The socket is $VMMBROKER_SOCKET
 * or the system broker's; the driver is libcuda.so.1 or $VMMBROKER_LIBCUDA.
 */

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <pwd.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda.h>

#include "codec.h"
#include "driver.h"
#include "pattern.h"
#include "size.h"
#include "vmmbroker.h"

#define MAX_UIDS 64

/*
 * What the process still holds when it exits: the lease is left to the
 * broker on purpose (no vmmb_free(), no vmmb_close(), which would free it).
 * Kept here so that LeakSanitizer does not count them as leaks.
 */
static vmmb_client *client;
static vmmb_lease *lease;
static CudaDriver *cu;

static int parse_uid(const char *s, uid_t *ret) {
        struct passwd *pw;
        unsigned long u;
        char *end;

        errno = 0;
        u = strtoul(s, &end, 10);
        if (*s && *end == '\0' && errno == 0 && u < (uid_t)-1) {
                *ret = (uid_t)u;
                return 0;
        }
        pw = getpwnam(s);
        if (!pw)
                return -ENOENT;
        *ret = pw->pw_uid;
        return 0;
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
                "Usage: %s [--uid USER]... [--readonly] [--seed N] SIZE NAME\n"
                "Lease SIZE (e.g. 64M, 1G), fill it with a pattern, publish it as NAME and exit holding it.\n"
                "NAME has no '/': your processes attach it as NAME, other users as OWNER/NAME.\n"
                "  --uid USER   USER (a name or a number) may attach it by NAME too; repeatable\n"
                "  --readonly   attaching by NAME gives a read-only hold\n"
                "  --seed N     the pattern's seed (default: derived from NAME)\n",
                program_invocation_short_name);
}

int main(int argc, char *argv[]) {
        static const struct option options[] = {
                { "uid", required_argument, NULL, 'u' },
                { "readonly", no_argument, NULL, 'r' },
                { "seed", required_argument, NULL, 's' },
                { "help", no_argument, NULL, 'h' },
                {}
        };
        char *message = NULL, b[FORMAT_SIZE_MAX];
        uid_t uids[MAX_UIDS];
        size_t n_uids = 0;
        unsigned flags = 0;
        uint64_t size;
        uint32_t seed = 0, *host = NULL;
        bool seed_given = false, retained = false;
        const char *name;
        CUcontext ctx;
        CUdeviceptr ptr;
        int c, k, status = EXIT_FAILURE;

        setvbuf(stdout, NULL, _IOLBF, 0);       /* lines in order with stderr's, also into a pipe or file */
        while ((c = getopt_long(argc, argv, "", options, NULL)) >= 0)
                switch (c) {
                case 'u':
                        if (n_uids == MAX_UIDS) {
                                fprintf(stderr, "%s: at most %d users\n", program_invocation_short_name, MAX_UIDS);
                                return EXIT_FAILURE;
                        }
                        if (parse_uid(optarg, &uids[n_uids]) < 0) {
                                fprintf(stderr, "%s: no such user: %s\n", program_invocation_short_name, optarg);
                                return EXIT_FAILURE;
                        }
                        n_uids++;
                        break;
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
                case 'h':
                        usage(stdout);
                        return EXIT_SUCCESS;
                default:
                        usage(stderr);
                        return EXIT_FAILURE;
                }
        if (argc - optind != 2) {
                fprintf(stderr, "%s: %s\n", program_invocation_short_name,
                        argc - optind < 2 ? "needs a SIZE and a NAME" : "takes a SIZE and a NAME, nothing more");
                usage(stderr);
                return EXIT_FAILURE;
        }
        if (parse_size(argv[optind], &size) < 0 || size == 0) {
                fprintf(stderr, "%s: '%s' is not a size of more than 0 bytes, such as 64M or 1G\n",
                        program_invocation_short_name, argv[optind]);
                usage(stderr);
                return EXIT_FAILURE;
        }
        name = argv[optind + 1];
        /* The broker checks the name too, but only when publishing: after the lease was filled. */
        if (strchr(name, '/')) {
                fprintf(stderr, "%s: '%s' has a '/': publish a bare NAME, which lives in your own namespace; "
                        "other users attach it as OWNER/NAME\n", program_invocation_short_name, name);
                return EXIT_FAILURE;
        }
        if (!vmmb_lease_name_is_valid(name)) {
                fprintf(stderr, "%s: '%s' cannot be a lease's name: 1-128 letters, digits and ._-:@+, "
                        "the first a letter or digit\n", program_invocation_short_name, name);
                return EXIT_FAILURE;
        }
        if (!seed_given)
                seed = pattern_seed(name);

        /* The library loads the driver for itself; the example needs it too, for the copies. */
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
        k = vmmb_alloc(client, size, VMMB_ANY_DEVICE, "publish-pattern", &lease);
        if (k < 0) {
                fprintf(stderr, "pid %d: cannot lease %s: %s\n", (int)getpid(), format_size(size, b, sizeof(b)),
                        vmmb_error_message());
                goto out;
        }
        ptr = (CUdeviceptr)vmmb_lease_ptr(lease);
        size = vmmb_lease_size(lease);
        printf("pid %d: leased %s on device %d at 0x%" PRIx64 " (lease %s)\n", (int)getpid(),
               format_size(size, b, sizeof(b)), vmmb_lease_device(lease), (uint64_t)ptr, vmmb_lease_id(lease));

        host = malloc(PATTERN_CHUNK);
        if (!host) {
                fprintf(stderr, "pid %d: out of memory\n", (int)getpid());
                goto out;
        }
        for (uint64_t off = 0; off < size; off += PATTERN_CHUNK) {
                uint64_t n = size - off < PATTERN_CHUNK ? size - off : PATTERN_CHUNK;

                for (uint64_t i = 0; i < n / 4; i++)
                        host[i] = pattern_word(off / 4 + i, seed);
                if (cu->cuMemcpyHtoD(ptr + off, host, n) != CUDA_SUCCESS) {
                        fprintf(stderr, "pid %d: writing the pattern failed\n", (int)getpid());
                        goto out;
                }
        }
        /* cuMemcpyHtoD returns when the copy is done; synchronize anyway, so that nothing is in flight at exit. */
        if (cu->cuCtxSynchronize() != CUDA_SUCCESS) {
                fprintf(stderr, "pid %d: the device failed\n", (int)getpid());
                goto out;
        }
        printf("pid %d: wrote %" PRIu64 " words of pattern seed %#" PRIx32 "\n", (int)getpid(), size / 4, seed);

        k = vmmb_publish(lease, name, n_uids ? uids : NULL, n_uids, flags);
        if (k < 0) {
                fprintf(stderr, "pid %d: cannot publish as %s: %s\n", (int)getpid(), name, vmmb_error_message());
                goto out;
        }
        printf("pid %d: published lease %s as \"%s\"", (int)getpid(), vmmb_lease_id(lease), name);
        for (size_t i = 0; i < n_uids; i++)
                printf("%s%u", i == 0 ? " for uids " : ",", (unsigned)uids[i]);
        printf("%s; exiting without freeing it\n", flags & VMMB_READONLY ? ", read-only" : "");
        /* How the other users name it: OWNER/NAME, OWNER as the broker knows the lease's owner. */
        if (vmmb_lease_owner_name(lease))
                printf("pid %d: other users attach it as \"%s/%s\"\n", (int)getpid(), vmmb_lease_owner_name(lease),
                       name);
        else
                printf("pid %d: other users attach it as \"%u/%s\"\n", (int)getpid(),
                       (unsigned)vmmb_lease_owner(lease), name);
        status = EXIT_SUCCESS;
out:
        free(host);
        free(message);
        /*
         * On success the lease stays held until the process exits. On failure,
         * end it here: an unpublished lease would end at exit anyway, and a
         * failed publication must not leave it behind.
         */
        if (status != EXIT_SUCCESS) {
                vmmb_free(lease);
                vmmb_close(client);
                if (retained)
                        (void)cu->cuDevicePrimaryCtxRelease(0);
                cuda_driver_close(cu);
                lease = NULL;
                client = NULL;
                cu = NULL;
        }
        return status;
}
