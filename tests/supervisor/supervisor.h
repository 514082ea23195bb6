/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * A test supervisor: the service manager's side of the protocols a systemd service speaks, for tests that
 * restart a daemon without systemd as PID 1 (issue 7, "restart without loss"). It does for one daemon what
 * systemd does for a Type=notify, NotifyAccess=main service with a socket unit and FileDescriptorStoreMax=:
 *
 *  - binds the daemon's listening AF_UNIX stream socket once and keeps it across restarts, so that a client
 *    that connects while the daemon is down waits in the backlog and is accepted by the next process;
 *  - owns a NOTIFY_SOCKET (datagram, SO_PASSCRED) read by a thread of its own, as PID 1 reads it whenever a
 *    message comes (a daemon's sd_notify() blocks once 10 datagrams are queued, net.unix.max_dgram_qlen);
 *    only messages whose kernel-attached credentials name the current daemon's pid are acted on, others
 *    are counted and their fds closed (NotifyAccess=main);
 *  - understands READY=1, STOPPING=1 (after which READY=1 is ignored), STATUS=, WATCHDOG=1,
 *    WATCHDOG=trigger, WATCHDOG_USEC=, FDSTORE=1 with FDNAME= and FDPOLL=0, FDSTOREREMOVE=1 with FDNAME=,
 *    and a message of BARRIER=1 alone (its fd closed: sd_notify_barrier() returns); anything else is ignored,
 *    and so are fds sent without FDSTORE=1 (closed);
 *  - keeps the fd store across restarts, with systemd's rules (src/core/service.c): at most fd_store_max
 *    fds, the ones over it closed; a fd for an open file description already stored is a duplicate and
 *    closed; FDNAME= defaults to "stored", and a name that is not 1-255 printable ASCII characters without
 *    ':' is ignored (the fds are stored as "stored"); FDSTOREREMOVE=1 closes every fd of that name and
 *    wins over FDSTORE=1 in the same message (whose fds are then closed); without FDPOLL=0 a stored fd on
 *    which poll() reports POLLHUP or POLLERR is dropped (memfds and other regular files never do);
 *  - starts the daemon as systemd does: FDSTORE=fd_store_max when it is not 0 (as systemd 254 and later
 *    do), LISTEN_PID (written in the child after fork, before exec),
 *    LISTEN_FDS = 1 + stored fds, the socket at fd 3 and the stored fds after it, LISTEN_FDNAMES =
 *    socket_name then the stored names, NOTIFY_SOCKET, and WATCHDOG_USEC/WATCHDOG_PID when asked; no other
 *    fds, signal mask emptied, its own process group. Stored fds come newest first, as systemd's store (a
 *    list it prepends to) passes them; sd_listen_fds(3) calls the order arbitrary, so a daemon must go by
 *    the names, and oldest_first turns the order round to show that it does;
 *  - enforces the watchdog from READY=1 on, as WatchdogSec= does: no WATCHDOG=1 within the interval (or a
 *    WATCHDOG=trigger) and the daemon gets SIGABRT; it is not restarted: the test calls supervisor_restart().
 *
 * Not done: cgroups (the daemon's process group stands in for KillMode=control-group), MAINPID=, RELOADING=1,
 * EXTEND_TIMEOUT_USEC=, Restart= on its own, and rate limits. The store lives as long as the Supervisor
 * (FileDescriptorStorePreserve=restart, systemd's default); supervisor_store_clear() is `systemctl stop`.
 *
 * Every blocking wait has a timeout that turns a hang into a failure; nothing sleeps. The Supervisor is
 * used from one thread; PR_SET_PDEATHSIG (SIGKILL) ties the daemon to the thread that started it, so that a
 * failed test leaves no daemon behind. The daemon does not use this yet: tests/supervisor/test-supervisor.c
 * drives a fake daemon; README.md says what the broker's restart tests need.
 */

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

typedef struct Supervisor Supervisor;

typedef struct SupervisorOptions {
        const char *path;               /* the daemon's executable */
        const char *const *argv;        /* its argv, NULL-terminated, argv[0] included; NULL: { path } */
        const char *socket_path;        /* where to bind the listening socket; NULL: <private dir>/socket */
        const char *socket_name;        /* its name in LISTEN_FDNAMES; NULL: "varlink" */
        unsigned fd_store_max;          /* FileDescriptorStoreMax=: 0 stores nothing, as systemd */
        uint64_t watchdog_usec;         /* WatchdogSec= in microseconds; 0: no watchdog */
        unsigned stop_timeout_ms;       /* TimeoutStopSec=: SIGTERM, then SIGKILL after this; 0: 30 s */
        bool oldest_first;              /* pass stored fds oldest first instead of systemd's newest first */
} SupervisorOptions;

/* What the supervisor did with what it received, since supervisor_new(). */
typedef struct SupervisorStats {
        unsigned messages;              /* notifications acted on (from the current daemon) */
        unsigned foreign;               /* notifications from another pid, ignored */
        unsigned fds_foreign;           /* fds that came with those, closed */
        unsigned fds_unexpected;        /* fds from the daemon without FDSTORE=1, closed */
        unsigned fds_stored;            /* fds taken into the store */
        unsigned fds_full;              /* fds refused because the store was full, closed */
        unsigned fds_duplicate;         /* fds for a file description already stored, closed */
        unsigned fds_removed;           /* fds closed by FDSTOREREMOVE=1 */
        unsigned fds_hangup;            /* stored fds dropped on POLLHUP/POLLERR */
        unsigned invalid_names;         /* FDNAME= values ignored as invalid */
        unsigned watchdog_pings;        /* WATCHDOG=1 from the daemon */
        unsigned watchdog_fired;        /* times the daemon got SIGABRT from the watchdog */
        unsigned starts;                /* daemons started */
} SupervisorStats;

/* Makes a private directory, binds the listening socket and the notify socket and starts the reading
 * thread. The options are copied. Returns 0 or a negative errno. */
int supervisor_new(const SupervisorOptions *options, Supervisor **ret);

/* Starts the daemon (none must be running) and returns once it has exec'd, or a negative errno: the
 * exec's own error (-ENOENT...) when it could not. Stored fds that hung up are dropped first. */
int supervisor_start(Supervisor *s);

/*
 * Waits until the daemon sends READY=1 and returns the microseconds from its exec to the moment the
 * supervisor received READY=1, or -ETIMEDOUT after timeout_ms, or -ECHILD when it exited first (reap it
 * with supervisor_stop() or supervisor_wait_exit()), or -ESRCH when none was started.
 */
int64_t supervisor_wait_ready(Supervisor *s, int timeout_ms);

/*
 * Waits for the daemon to exit by itself within timeout_ms (after a crash, exit() or the watchdog),
 * reaps it and returns its status as a shell shows it: the exit code, or 128 + the signal. -ETIMEDOUT
 * leaves it running; -ESRCH: none running.
 */
int supervisor_wait_exit(Supervisor *s, int timeout_ms);

/*
 * Stops the daemon with `sig`, as `systemctl kill`/`stop` would: the signal goes to its process group; for
 * a signal other than SIGKILL it is given stop_timeout_ms to exit, then SIGKILL, and the result is
 * -ETIMEDOUT (it is gone all the same). Every notification it sent before it died is acted on before the
 * supervisor forgets its pid, as systemd does. Returns the status as supervisor_wait_exit().
 */
int supervisor_stop(Supervisor *s, int sig);

/* supervisor_stop(sig), supervisor_start() and supervisor_wait_ready(timeout_ms): returns what the last
 * returns, or the first error. The stop's status is in supervisor_last_exit(). */
int64_t supervisor_restart(Supervisor *s, int sig, int timeout_ms);

/*
 * The fd store after every notification already sent to the supervisor has been acted on and every
 * POLLHUP/POLLERR already raised on a polled fd has been seen: a test that got a reply from the daemon
 * after its sd_notify() sees its effect. The number of stored fds; -ETIMEDOUT if the reading thread did
 * not answer within 30 s.
 */
int supervisor_store_count(Supervisor *s);

/* How many stored fds are named `name` (the same), and, when ret_fd is not NULL and there is one, a new
 * close-on-exec fd for the oldest of them, for the caller to close. */
int supervisor_store_find(Supervisor *s, const char *name, int *ret_fd);

/* Stores a copy of `fd` as `name` (not polled), as the daemon's FDSTORE=1 would: for a test of what the next
 * start does with an entry it did not store. Returns 0, -EEXIST (that open file is stored already), -EXFULL, or
 * a negative errno. */
int supervisor_store_put(Supervisor *s, int fd, const char *name);

/* Empties the store (`systemctl stop`: the next start gets the socket alone). */
void supervisor_store_clear(Supervisor *s);

/* The last STATUS= text (malloc'd, NULL if none or on ENOMEM) and the counters, after a sync as above. */
char *supervisor_status(Supervisor *s);
SupervisorStats supervisor_stats(Supervisor *s);

pid_t supervisor_pid(Supervisor *s);              /* the running daemon's pid, 0 if none */
int supervisor_last_exit(Supervisor *s);          /* the status the last stop or wait_exit returned */
int64_t supervisor_ready_usec(Supervisor *s);     /* exec to READY=1 of the running daemon, -1 if not ready */
const char *supervisor_socket_path(Supervisor *s);
int supervisor_listen_fd(Supervisor *s);          /* the listening socket, owned by the supervisor */

/* Stops the daemon with SIGKILL if one runs, closes the store and the sockets and removes the files.
 * Returns NULL. */
Supervisor *supervisor_free(Supervisor *s);
