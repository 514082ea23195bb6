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
#include "manager.h"
#include "macro.h"
#include "pool.h"
#include "selfcheck.h"
#include "size.h"

#define MAX_DEVICES 64

typedef struct Args {
        bool check;
        ManagerConfig manager;
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
               "     --socket PATH       Listen on PATH when the service manager passes no socket\n"
               "                         (default " MANAGER_DEFAULT_SOCKET ")\n"
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
        enum { ARG_VERSION = 0x100, ARG_SOCKET, ARG_CHECK, ARG_DEVICE, ARG_MAX_SLAB, ARG_CAPACITY };
        static const struct option options[] = {
                { "help", no_argument, NULL, 'h' },
                { "version", no_argument, NULL, ARG_VERSION },
                { "socket", required_argument, NULL, ARG_SOCKET },
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
                case ARG_SOCKET:
                        if (!*optarg || optarg[0] != '/') {
                                fprintf(stderr, "%s: --socket takes an absolute path, not '%s'\n",
                                        program_invocation_short_name, optarg);
                                return -EINVAL;
                        }
                        args->manager.socket_path = optarg;
                        break;
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
                        if (args->manager.pool.n_devices == MAX_DEVICES) {
                                fprintf(stderr, "%s: too many --device options\n", program_invocation_short_name);
                                return -EINVAL;
                        }
                        args->devices[args->manager.pool.n_devices++] = (int)v;
                        args->manager.pool.devices = args->devices;
                        break;
                }
                case ARG_MAX_SLAB:
                        if (parse_size_arg("--max-slab", optarg, &args->manager.pool.max_slab) < 0)
                                return -EINVAL;
                        break;
                case ARG_CAPACITY:
                        if (parse_size_arg("--capacity", optarg, &args->manager.pool.capacity) < 0)
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

static int run_check(const PoolConfig *config) {
        _cleanup_free_ char *message = NULL;
        CudaDriver *cu = NULL;
        Pool *pool = NULL;
        int k;

        k = cuda_driver_open(&cu, NULL, &message);
        if (k < 0) {
                fprintf(stderr, "%s\n", message ?: strerror(-k));
                return 1;
        }
        k = pool_new(&pool, cu, config, &message);
        if (k < 0) {
                fprintf(stderr, "Cannot set up the pool: %s\n", message ?: strerror(-k));
                cuda_driver_close(cu);
                return 1;
        }
        k = selfcheck_run(pool, cu, stdout);
        pool_free(pool);
        cuda_driver_close(cu);
        return k == 0 ? 0 : 1;
}

int main(int argc, char *argv[]) {
        _cleanup_free_ char *message = NULL;
        Manager *m = NULL;
        Args args = {};
        int k;

        k = parse_argv(argc, argv, &args);
        if (k <= 0)
                return k < 0 ? 2 : 0;
        if (args.check)
                return run_check(&args.manager.pool);

        k = manager_new(&m, &args.manager, &message);
        if (k < 0) {
                fprintf(stderr, "Cannot start: %s\n", message ?: strerror(-k));
                return 1;
        }
        fprintf(stderr, "vmmbrokerd %s: serving %zu device(s) on %s with %s\n", VMMBROKER_VERSION,
                pool_n_devices(m->pool), m->bound_path ?: "the socket passed by the service manager", m->cu->path);
        k = manager_run(m);
        manager_free(m);
        if (k < 0) {
                fprintf(stderr, "Event loop failed: %s\n", strerror(-k));
                return 1;
        }
        return 0;
}
