/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Keeping leases across a restart of the daemon, with the service manager's
 * file descriptor store (sd_notify(3) FDSTORE=1; systemd.service(5)
 * FileDescriptorStoreMax=):
 *
 *   - every slab's exported fd is stored as "slab-<id>" when the pool creates
 *     it, and removed when the pool releases it (the pool's hooks);
 *   - the lease table (daemon/state.c) is stored as "state-<generation>"
 *     after every request that changed it, before its reply is sent (a
 *     client never learns of a change a crash could lose), and when holders'
 *     exits changed it, when the loop is idle: the new generation first,
 *     then the old one removed, so that a crash in between leaves one whole
 *     state (the highest generation wins at start);
 *   - at start, the stored fds come back with the listening socket
 *     (LISTEN_FDS, named by LISTEN_FDNAMES): the newest state is read, its
 *     slabs imported, its leases rebuilt, the holders still alive re-attached
 *     (pid and start time) and the holds of those that died dropped. What the
 *     daemon does not recognise is closed and removed from the store.
 *
 * Without a service manager (no NOTIFY_SOCKET), storing does nothing and a
 * restart ends every lease, as before.
 */

#include <stdbool.h>
#include <stdint.h>

typedef struct Manager Manager;

/* The name the socket unit gives the listening socket (FileDescriptorName=). */
#define RESTORE_SOCKET_NAME "varlink"

/* A stored slab fd that came back at start. */
typedef struct InheritedSlab {
        uint64_t id;
        int fd;                         /* -EBADF once taken */
} InheritedSlab;

/* What the service manager passed. */
typedef struct Inherited {
        int socket;                     /* the listening socket, or -EBADF */
        int state_fd;                   /* the newest stored state, or -EBADF */
        uint64_t state_generation;
        InheritedSlab *slabs;
        size_t n_slabs;
        unsigned n_dropped;             /* fds closed: older states, unknown names */
} Inherited;

/*
 * Sorts out LISTEN_FDS. The socket is the fd named RESTORE_SOCKET_NAME, else
 * the only listening AF_UNIX stream socket among them. Returns 0 (possibly
 * with no socket: then the daemon binds its own), or -EINVAL with a sentence
 * for more than one unnamed socket or a socket that is not a listening
 * AF_UNIX stream one.
 */
int inherited_take(Inherited *ret, char **ret_message);

/* Closes whatever of it was not taken (the store keeps them: a start that fails does not lose them). */
void inherited_done(Inherited *in);

/* Starts storing: the pool's hooks store and remove slab fds from now on. Does nothing without NOTIFY_SOCKET. */
void restore_start_storing(Manager *m);

/*
 * Rebuilds the lease table from `in` (its state and slabs), re-attaching
 * holders still alive. Prints a line per lease dropped and a summary on
 * stderr. Returns 0, or a negative errno for a failure of the daemon itself
 * (out of memory); a state that cannot be used is reported and ignored.
 */
int restore_leases(Manager *m, Inherited *in);

/*
 * At exit: stores the state if it changed, then stops storing, so that releasing the pool does not take
 * the slabs out of the store: a restart takes them back. (A service stopped for good has its store
 * emptied by the service manager.)
 */
void restore_stop_storing(Manager *m);

/* Marks the lease table changed: it is stored again when the loop is next idle. */
void restore_state_changed(Manager *m);

/* Stores the state if it changed: before a reply to a request that changed it, and when the loop is idle. */
void restore_save_state(Manager *m);
