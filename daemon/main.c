/* SPDX-License-Identifier: MIT */

/*
 * vmmbrokerd: the GPU memory broker daemon. This file parses the command line
 * and hands over to the pieces that do the work.
 */

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "driver.h"
#include "macro.h"
#include "pool.h"
#include "selfcheck.h"
#include "size.h"

#define MAX_DEVICES 64

typedef struct Args {
        bool check;
        PoolConfig pool;
        int devices[MAX_DEVICES];
} Args;

static void help(void) {
        printf("Usage: %s [OPTIONS]\n"
               "\n"
               "The vmmbroker GPU memory broker daemon: owns a pool of CUDA VMM allocations on each GPU and\n"
               "leases them to client processes.\n"
               "\n"
               "  -h --help              Show this help and exit\n"
               "     --version           Show the version and exit\n"
               "     --check             Check the driver and the pool on every device, print a report, exit\n"
               "     --device N          Serve CUDA device N (repeatable; default: every device)\n"
               "     --max-slab SIZE     Largest slab, a power of two (default 1G)\n"
               "     --capacity SIZE     Device memory the pool may hold per device\n"
               "                         (default: %d%% of the memory free at start)\n"
               "\n"
               "SIZE takes a suffix K, M, G or T (powers of 1024).\n"
               "The driver is libcuda.so.1, or the file named by $" CUDA_DRIVER_LIBRARY_ENV ".\n",
               program_invocation_short_name, POOL_DEFAULT_CAPACITY_PERCENT);
}

static int parse_size_arg(const char *name, const char *value, uint64_t *ret) {
        int k = parse_size(value, ret);

        if (k < 0 || *ret == 0) {
                fprintf(stderr, "%s: invalid size for %s: '%s' (expected e.g. 64M or 1G)\n",
                        program_invocation_short_name, name, value);
                return -EINVAL;
        }
        return 0;
}

/* Returns 1 to go on, 0 to exit successfully, or a negative errno. */
static int parse_argv(int argc, char *argv[], Args *args) {
        enum { ARG_VERSION = 0x100, ARG_CHECK, ARG_DEVICE, ARG_MAX_SLAB, ARG_CAPACITY };
        static const struct option options[] = {
                { "help", no_argument, NULL, 'h' },
                { "version", no_argument, NULL, ARG_VERSION },
                { "check", no_argument, NULL, ARG_CHECK },
                { "device", required_argument, NULL, ARG_DEVICE },
                { "max-slab", required_argument, NULL, ARG_MAX_SLAB },
                { "capacity", required_argument, NULL, ARG_CAPACITY },
                {}
        };
        int c;

        while ((c = getopt_long(argc, argv, "h", options, NULL)) >= 0) {
                switch (c) {
                case 'h':
                        help();
                        return 0;
                case ARG_VERSION:
                        printf("vmmbrokerd %s\n", VMMBROKER_VERSION);
                        return 0;
                case ARG_CHECK:
                        args->check = true;
                        break;
                case ARG_DEVICE: {
                        char *end;
                        long v;

                        errno = 0;
                        v = strtol(optarg, &end, 10);
                        if (errno != 0 || *end || end == optarg || v < 0 || v >= MAX_DEVICES) {
                                fprintf(stderr, "%s: invalid device index '%s'\n", program_invocation_short_name,
                                        optarg);
                                return -EINVAL;
                        }
                        if (args->pool.n_devices == MAX_DEVICES) {
                                fprintf(stderr, "%s: too many --device options\n", program_invocation_short_name);
                                return -EINVAL;
                        }
                        args->devices[args->pool.n_devices++] = (int)v;
                        args->pool.devices = args->devices;
                        break;
                }
                case ARG_MAX_SLAB:
                        if (parse_size_arg("--max-slab", optarg, &args->pool.max_slab) < 0)
                                return -EINVAL;
                        break;
                case ARG_CAPACITY:
                        if (parse_size_arg("--capacity", optarg, &args->pool.capacity) < 0)
                                return -EINVAL;
                        break;
                case '?':
                        return -EINVAL;
                default:
                        abort();
                }
        }
        if (optind < argc) {
                fprintf(stderr, "%s: unexpected argument '%s'\n", program_invocation_short_name, argv[optind]);
                return -EINVAL;
        }
        return 1;
}

int main(int argc, char *argv[]) {
        _cleanup_free_ char *message = NULL;
        CudaDriver *cu = NULL;
        Pool *pool = NULL;
        Args args = {};
        int k;

        k = parse_argv(argc, argv, &args);
        if (k <= 0)
                return k < 0 ? 2 : 0;

        if (!args.check) {
                fprintf(stderr,
                        "%s: serving clients is not implemented yet; this build can only check the driver and the "
                        "pool: run '%s --check'.\n",
                        program_invocation_short_name, program_invocation_short_name);
                return 2;
        }

        k = cuda_driver_open(&cu, NULL, &message);
        if (k < 0) {
                fprintf(stderr, "%s\n", message ? message : strerror(-k));
                return 1;
        }
        k = pool_new(&pool, cu, &args.pool, &message);
        if (k < 0) {
                fprintf(stderr, "Cannot set up the pool: %s\n", message ? message : strerror(-k));
                cuda_driver_close(cu);
                return 1;
        }

        k = selfcheck_run(pool, cu, stdout);
        pool_free(pool);
        cuda_driver_close(cu);
        return k == 0 ? 0 : 1;
}
