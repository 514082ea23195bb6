/* SPDX-License-Identifier: MIT */

/*
 * vmmbrokerd: the GPU memory broker daemon. This file parses the command line
 * and hands over to the pieces that do the work.
 */

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include "config.h"
#include "driver.h"
#include "manager.h"
#include "macro.h"
#include "pool.h"
#include "selfcheck.h"
#include "size.h"

/*
 * Exit statuses (vmmbrokerd(8), EXIT STATUS). 2 and 6 are the LSB numbers systemd names
 * (INVALIDARGUMENT, NOTCONFIGURED): vmmbroker.service does not restart on them
 * (RestartPreventExitStatus=2 6), since the next start would fail the same way.
 */
enum {
        /* EXIT_FAILURE (1): a start-up failure that may pass (out of memory, a driver call failing): retried */
        EXIT_BAD_CONFIG = 2,    /* the command line or the configuration is wrong */
        EXIT_CANNOT_SERVE = 6,  /* no driver, no usable device, a pool the devices cannot hold */
};

/* Command-line options that set a key of the configuration file, applied after the file. */
typedef struct Override {
        const char *key;
        const char *option;
        const char *value;
} Override;

typedef struct Args {
        bool check;
        bool print_config;
        const char *config_path;
        Override overrides[16];
        size_t n_overrides;
        char devices[CONFIG_MAX_DEVICES * 3];   /* --device values, joined as Devices= takes them */
} Args;

static void help(void) {
        printf("Usage: %s [OPTIONS]\n"
               "\n"
               "The vmmbroker GPU memory broker daemon: owns a pool of CUDA VMM allocations on each GPU and\n"
               "leases them to client processes.\n"
               "\n"
               "  -h --help              Show this help and exit\n"
               "     --version           Show the version and exit\n"
               "     --config PATH       Read PATH and PATH.d/*.conf (default " VMMBROKER_CONFIG_FILE ")\n"
               "     --print-config      Print the configuration in effect (files and options), exit\n"
               "     --check             Check the driver and the pool on every device, print a report, exit\n"
               "\n"
               "These override the configuration file (vmmbroker.conf(5)):\n"
               "     --socket PATH       Listen on PATH when the service manager passes no socket\n"
               "                         (default " MANAGER_DEFAULT_SOCKET ")\n"
               "     --device N          Serve CUDA device N (repeatable; default: every device)\n"
               "     --max-slab SIZE     Largest slab, a power of two (default 1G)\n"
               "     --capacity SIZE|N%%  Device memory the pool may hold per device\n"
               "                         (default: %d%% of the memory free at start)\n"
               "     --admin-group NAME  Members of group NAME may list every lease (root always may)\n"
               "\n"
               "SIZE takes a suffix K, M, G or T (powers of 1024).\n"
               "The driver is libcuda.so.1, or the file named by $" CUDA_DRIVER_LIBRARY_ENV ".\n",
               program_invocation_short_name, POOL_DEFAULT_CAPACITY_PERCENT);
}

static int add_override(Args *args, const char *key, const char *option, const char *value) {
        if (args->n_overrides == ELEMENTSOF(args->overrides)) {
                fprintf(stderr, "%s: too many options\n", program_invocation_short_name);
                return -EINVAL;
        }
        args->overrides[args->n_overrides++] = (Override){ key, option, value };
        return 0;
}

/* Returns 1 to go on, 0 to exit successfully, or a negative errno. */
static int parse_argv(int argc, char *argv[], Args *args) {
        enum {
                ARG_VERSION = 0x100,
                ARG_CONFIG,
                ARG_PRINT_CONFIG,
                ARG_CHECK,
                ARG_SOCKET,
                ARG_DEVICE,
                ARG_MAX_SLAB,
                ARG_CAPACITY,
                ARG_ADMIN_GROUP,
        };
        static const struct option options[] = {
                { "help", no_argument, NULL, 'h' },
                { "version", no_argument, NULL, ARG_VERSION },
                { "config", required_argument, NULL, ARG_CONFIG },
                { "print-config", no_argument, NULL, ARG_PRINT_CONFIG },
                { "check", no_argument, NULL, ARG_CHECK },
                { "socket", required_argument, NULL, ARG_SOCKET },
                { "device", required_argument, NULL, ARG_DEVICE },
                { "max-slab", required_argument, NULL, ARG_MAX_SLAB },
                { "capacity", required_argument, NULL, ARG_CAPACITY },
                { "admin-group", required_argument, NULL, ARG_ADMIN_GROUP },
                {}
        };
        bool devices = false;
        int c, k = 0;

        while ((c = getopt_long(argc, argv, "h", options, NULL)) >= 0) {
                switch (c) {
                case 'h':
                        help();
                        return 0;
                case ARG_VERSION:
                        printf("vmmbrokerd %s\n", VMMBROKER_VERSION);
                        return 0;
                case ARG_CONFIG:
                        args->config_path = optarg;
                        break;
                case ARG_PRINT_CONFIG:
                        args->print_config = true;
                        break;
                case ARG_CHECK:
                        args->check = true;
                        break;
                case ARG_SOCKET:
                        k = add_override(args, "Socket", "--socket", optarg);
                        break;
                case ARG_DEVICE: {
                        size_t used = strlen(args->devices);

                        /* Joined into one Devices= value; its parser checks each index. */
                        if (used + strlen(optarg) + 2 > sizeof(args->devices)) {
                                fprintf(stderr, "%s: too many --device options\n", program_invocation_short_name);
                                return -EINVAL;
                        }
                        snprintf(args->devices + used, sizeof(args->devices) - used, "%s%s", used ? " " : "", optarg);
                        if (!devices)
                                k = add_override(args, "Devices", "--device", args->devices);
                        devices = true;
                        break;
                }
                case ARG_MAX_SLAB:
                        k = add_override(args, "MaxSlab", "--max-slab", optarg);
                        break;
                case ARG_CAPACITY:
                        k = add_override(args, "Capacity", "--capacity", optarg);
                        break;
                case ARG_ADMIN_GROUP:
                        k = add_override(args, "AdminGroup", "--admin-group", optarg);
                        break;
                case '?':
                        return -EINVAL;
                default:
                        abort();
                }
                if (k < 0)
                        return k;
        }
        if (optind < argc) {
                fprintf(stderr, "%s: unexpected argument '%s'\n", program_invocation_short_name, argv[optind]);
                return -EINVAL;
        }
        return 1;
}

/* The configuration file, then the command line on top. What is wrong goes to *ret_message. */
static int load_config(const Args *args, Config *config, char **ret_message) {
        int k;

        k = config_load(config, args->config_path ?: VMMBROKER_CONFIG_FILE, ret_message);
        for (size_t i = 0; k >= 0 && i < args->n_overrides; i++)
                k = config_set(config, args->overrides[i].key, args->overrides[i].value, args->overrides[i].option,
                               ret_message);
        if (k < 0)
                fprintf(stderr, "%s: %s\n", program_invocation_short_name, *ret_message ?: strerror(-k));
        return k;
}

/*
 * Whether manager_new() failing with this error would fail again at the next start with the same driver,
 * devices and configuration: no driver or one too old (ENOENT, EPROTONOSUPPORT), no device that can be
 * used (ENODEV, ENXIO), a configuration the devices cannot hold (EINVAL: a capacity below the granularity,
 * a device listed twice, a slab size), a socket that cannot be used (the wrong kind passed, a path too
 * long, taken by another daemon, not permitted). Anything else (ENOMEM, EMFILE, EIO from a driver call) may
 * pass and is retried, as many times as the unit's start limit allows.
 */
static bool cannot_serve(int error) {
        switch (error) {
        case ENOENT:
        case ENOTDIR:
        case ENODEV:
        case ENXIO:
        case EPROTONOSUPPORT:
        case EOPNOTSUPP:
        case EINVAL:
        case ERANGE:
        case ENAMETOOLONG:
        case EADDRINUSE:
        case EACCES:
        case EPERM:
                return true;
        default:
                return false;
        }
}

/*
 * A copy of the listening socket the service manager passed (-EBADF when none), taken before the manager
 * takes the original, so that a daemon that cannot serve can still close the connections waiting on it.
 */
static int listening_socket_copy(void) {
        int n = sd_listen_fds(false);

        for (int fd = SD_LISTEN_FDS_START; n > 0 && fd < SD_LISTEN_FDS_START + n; fd++)
                if (sd_is_socket_unix(fd, SOCK_STREAM, 1, NULL, 0) > 0) {
                        int copy = fcntl(fd, F_DUPFD_CLOEXEC, SD_LISTEN_FDS_START + n);

                        return copy < 0 ? -errno : copy;
                }
        return -EBADF;
}

/*
 * Accepts and closes every connection waiting on the listening socket. A connection left in the backlog
 * keeps the socket readable, and systemd starts the service again at once for it, as often as the start
 * limit allows; closed, its client learns at once that no broker answers, and the service stays failed until
 * the next client comes (or an administrator starts it).
 */
static unsigned drain_waiting(int fd) {
        struct pollfd p = { .fd = fd, .events = POLLIN };
        unsigned n = 0;

        while (fd >= 0 && n < 65536 && poll(&p, 1, 0) > 0 && (p.revents & POLLIN)) {
                int c = accept4(fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);

                if (c < 0)
                        break;
                close(c);
                n++;
        }
        return n;
}

/*
 * Tells the service manager why the daemon is exiting (systemctl status shows STATUS=, and ERRNO= as
 * "Error:") and waits until it has read that, so that the line cannot lose a race with our exit. When
 * starting again cannot help, also closes the connections waiting on the socket (drain_waiting()).
 * listen_fd is listening_socket_copy(). Returns exit_status.
 */
static int give_up(int listen_fd, int exit_status, const char *what, const char *message, int error) {
        unsigned closed;

        if (sd_notifyf(false, "STATUS=%s: %s\nERRNO=%d", what, message ?: strerror(error), error) > 0)
                (void)sd_notify_barrier(false, UINT64_C(5) * 1000000);
        if (exit_status != EXIT_FAILURE) {
                closed = drain_waiting(listen_fd);
                if (closed > 0)
                        fprintf(stderr, "%s: closed %u waiting connection(s): nothing can serve them\n",
                                program_invocation_short_name, closed);
        }
        return exit_status;
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

/*
 * The pool keeps one fd open per slab, so the soft limit of 1024 that most
 * processes start with would cap it at about 1,000 slabs (2 GiB of 2 MiB
 * slabs). Raise it to the hard limit, as systemd advises for programs that
 * need many fds and do not use select().
 */
static void raise_fd_limit(void) {
        struct rlimit rl;

        if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
                rl.rlim_cur = rl.rlim_max;
                (void)setrlimit(RLIMIT_NOFILE, &rl);
        }
}

#define FD_TABLE_AHEAD 65536           /* fds the table is grown to at start (grow_fd_table()): 530 KiB */

/*
 * Grows the fd table, now, to what the daemon may use (the fd limit, at most FD_TABLE_AHEAD fds: 8.1 bytes
 * each). Linux grows it by doubling as fds are opened, and while threads share it (the CUDA driver's, the
 * pool's maker) each growth waits for an RCU grace period, in the loop: 10-20 ms, measured on an H200, when
 * the answer to an Unpark dup'ed its slab fds past a power of two. Grown here, before any thread, it costs
 * nothing; the table is never shrunk.
 */
static void grow_fd_table(void) {
        struct rlimit rl;
        rlim_t n;
        int fd;

        if (getrlimit(RLIMIT_NOFILE, &rl) < 0)
                return;
        n = rl.rlim_cur == RLIM_INFINITY ? FD_TABLE_AHEAD : MIN(rl.rlim_cur, (rlim_t)FD_TABLE_AHEAD);
        if (n <= 3)
                return;
        fd = fcntl(STDERR_FILENO, F_DUPFD_CLOEXEC, (int)n - 1);
        if (fd >= 0)
                (void)close(fd);
}

int main(int argc, char *argv[]) {
        _cleanup_free_ char *message = NULL;
        /* A copy of the passed socket for give_up(), taken before the manager takes the socket. */
        _cleanup_close_ int listen_copy = listening_socket_copy();
        Config config;
        Manager *m = NULL;
        Args args = {};
        int k;

        k = parse_argv(argc, argv, &args);
        if (k < 0)
                return give_up(listen_copy, EXIT_BAD_CONFIG, "Bad command line", "see journalctl -u vmmbroker", -k);
        if (k == 0)
                return 0;
        raise_fd_limit();
        grow_fd_table();
        config_init(&config);
        k = load_config(&args, &config, &message);
        if (k < 0)              /* like a usage error: trying again cannot help */
                k = give_up(listen_copy, EXIT_BAD_CONFIG, "Bad configuration", message, -k);
        else if (args.print_config) {
                config_print(&config, stdout);
                k = 0;
        } else if (args.check)
                k = run_check(&config.manager.pool);
        else {
                k = manager_new(&m, &config.manager, &message);
                if (k < 0) {
                        fprintf(stderr, "Cannot start: %s\n", message ?: strerror(-k));
                        if (cannot_serve(-k))
                                k = give_up(listen_copy, EXIT_CANNOT_SERVE, "Cannot serve", message, -k);
                        else
                                k = give_up(listen_copy, EXIT_FAILURE, "Cannot start, retrying", message, -k);
                } else {
                        listen_copy = safe_close(listen_copy);
                        fprintf(stderr, "vmmbrokerd %s: serving %zu device(s) on %s with %s\n", VMMBROKER_VERSION,
                                pool_n_devices(m->pool), m->bound_path ?: "the socket passed by the service manager",
                                m->cu->path);
                        k = manager_run(m);
                        manager_free(m);
                        if (k < 0)
                                fprintf(stderr, "Event loop failed: %s\n", strerror(-k));
                        k = k < 0 ? EXIT_FAILURE : 0;
                }
        }
        config_done(&config);
        return k;
}
