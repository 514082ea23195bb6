/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Integration tests run the real daemon: harness_start() starts vmmbrokerd on
 * a private socket with the simulated device and waits for its READY=1 on a
 * NOTIFY_SOCKET of its own (no sleeping), harness_stop() stops it and reports
 * how it exited.
 */

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "codec.h"
#include "varlink.h"

#define HARNESS_IO_TIMEOUT_S 30         /* failure guard on blocking socket reads and writes */

typedef struct Harness {
        pid_t pid;
        char dir[64];                   /* private directory: socket and notify socket */
        char socket[108];
        char config[64];                /* the file harness_start_config() wrote, removed by harness_stop() */
} Harness;

/*
 * Writes `text` (vmmbroker.conf lines) to a new file /tmp/vmmb-config-XXXXXX for the daemon's --config, its
 * name in `path`; the caller unlinks it. Returns 0 or a negative errno.
 */
int harness_write_config(const char *text, char path[static 64]);

/*
 * harness_start() with `config` as the daemon's configuration file (written by harness_write_config(), kept
 * in Harness.config and removed by harness_stop(), or at once when the start fails) and `args` (NULL: none,
 * at most 8) after its --config. Returns 0 or a negative errno.
 */
int harness_start_config(Harness *h, const char *config, const char *const *args);

/*
 * Starts the daemon with `--capacity CAPACITY` and a configuration file of `config` after "[Limits]
 * MaxBytes=1G" (so that the device's room, not a user's limit, is what stops a call); as root, its socket
 * is opened to every uid. Returns 0 or a negative errno.
 */
int harness_start_capped(Harness *h, const char *capacity, const char *config);

/*
 * Starts $VMMBROKER_DAEMON (the build's vmmbrokerd) with `args` appended
 * (NULL-terminated, may be NULL) and waits until it is ready. Returns 0 or a
 * negative errno: -ETIMEDOUT after 60 s, -ECHILD when the daemon exited
 * first. The daemon gets SIGTERM when the calling process exits (a test that
 * failed before harness_stop()).
 */
int harness_start(Harness *h, const char *const *args);

/*
 * The same, but the daemon is started as a service manager starts it for
 * socket activation: the harness binds h->socket itself and passes it (dup'd
 * n_listen times, from fd 3 on) with LISTEN_FDS and LISTEN_PID; the daemon's
 * --socket then names a path in h->dir ("not-inherited") that it must leave
 * alone. n_listen 0 is harness_start().
 */
int harness_start_full(Harness *h, const char *const *args, unsigned n_listen);

/*
 * SIGTERM, then waits (SIGKILL after 30 s). Returns the exit status, or -1 if
 * it did not exit by itself within that time or was killed by a signal.
 */
int harness_stop(Harness *h);

/*
 * Stops the daemon (SIGSTOP) and waits until it is stopped: it reads and answers nothing until harness_thaw()
 * (SIGCONT), so that a call that waits for its answer cannot return meanwhile, and one that does not wait
 * can. Returns 0 or a negative errno (-ECHILD: it exited instead). Thaw it before anything can fail the test:
 * a stopped daemon does not act on harness_stop()'s SIGTERM or the one it gets when the test exits.
 */
int harness_freeze(Harness *h);

/* Lets a daemon stopped by harness_freeze() go on. Returns 0 or a negative errno. */
int harness_thaw(Harness *h);

/* Binds a datagram socket at `path` for sd_notify() messages, passing the sender's credentials. */
int harness_notify_socket(const char *path);

/*
 * Receives one notification (NUL-terminated into buf) within timeout_ms and
 * the pid that sent it. Returns 0, -ETIMEDOUT or a negative errno.
 */
int harness_notify_receive(int fd, int timeout_ms, char *buf, size_t len, pid_t *ret_sender);

/* CLOCK_MONOTONIC in milliseconds: for the deadlines of bounded polls. */
uint64_t harness_now_msec(void);

/*
 * The bound of a test's poll of the daemon until something it does off the test's sight is done (a scrub,
 * a hang-up seen, a call queued): each try is a round trip, not a sleep, and the bound is only a failure
 * guard. It is a time, not a number of tries: on a loaded machine a simulated scrub or copy of 64 MiB took
 * 0.4-3 s, while 20,000 round trips took 2-3 s. Use as
 *   for (uint64_t end = harness_poll_deadline(); !done && harness_now_msec() < end;) ...
 */
#define HARNESS_POLL_MS 20000
uint64_t harness_poll_deadline(void);

/* Open fds of a process, from /proc/PID/fd; -1 on error. */
int harness_fd_count(pid_t pid);

/*
 * Forks a child that runs fn(arg) and exits (_exit) with its return value.
 * The child gets SIGKILL when the calling process exits. Returns the pid.
 */
pid_t harness_fork(int (*fn)(void *arg), void *arg);

/* Waits for a child and returns its exit status, or 128 + signal. */
int harness_wait(pid_t pid);

/* A connected, blocking socket to the daemon at `path` whose reads and writes give up after
 * HARNESS_IO_TIMEOUT_S. Returns the fd or a negative errno. */
int harness_connect(const char *path);

/* The same, wrapped in a varlink connection (replies up to VARLINK_MAX_REPLY). */
int harness_conn_open(const char *path, bool accept_fds, VarlinkConn **ret);

/* Calls Status on `c` and returns device 0 (its name left NULL). Returns 0 or a negative errno;
 * -EREMOTEIO for an error reply. */
int harness_status_on(VarlinkConn *c, WireDevice *ret);

/* The same on a connection of its own to `path`. */
int harness_status(const char *path, WireDevice *ret);

/*
 * The count of the sample `key` (its name and labels, then a space, e.g. "vmmbroker_calls_waiting{reason=\"copy\"} ")
 * in Metrics' `text`. Returns 0, -ENOENT when no sample is so named, -EINVAL when its value is not a count.
 */
int harness_metric(const char *text, const char *key, uint64_t *ret);
