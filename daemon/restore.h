/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Keeping leases across a restart of the daemon, with the service manager's
 * file descriptor store (sd_notify(3) FDSTORE=1; systemd.service(5)
 * FileDescriptorStoreMax=):
 *
 *   - every slab's exported fd is stored as "slab-<id>" when the pool creates
 *     it, and removed when the pool releases it (the pool's hooks); a slab
 *     that cannot be stored is not handed out;
 *   - the lease table is kept by the Store (store.h): one memfd, stored once
 *     as "table-<generation>", to which every change is appended before it is
 *     made (broker.c); it is stored again only when it is compacted;
 *   - at exit, the host slabs the pool keeps cached for parks are stored
 *     again as "hcache-<device>-<size>-<id>" (their "slab-<id>" removed),
 *     so that the next run takes them back rather than pin that memory again
 *     (restore_keep_host_cache()); a crash keeps none;
 *   - at start, the stored fds come back with the listening socket
 *     (LISTEN_FDS, named by LISTEN_FDNAMES): the newest table is read, its
 *     slabs imported, its leases rebuilt, the holders still alive re-attached
 *     (pid and start time) and the holds of those that died dropped; then the
 *     table is stored anew, as one snapshot. What the daemon does not
 *     recognise is closed and removed from the store. A "state-<generation>"
 *     (the previous version's whole-table JSON) is read the same way, so an
 *     upgrade keeps every lease.
 *
 * Storing is on when the service manager says it keeps fds: $NOTIFY_SOCKET
 * and $FDSTORE (FileDescriptorStoreMax=, set by systemd 254 and later, and by
 * vmmbroker.service for older ones). Without them nothing is stored and a
 * restart ends every lease.
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

/* A host slab the previous run had cached, stored at its exit as "hcache-<device>-<size>-<id>". */
typedef struct InheritedCached {
        int device;                     /* the CUDA device index */
        uint64_t size;
        uint64_t id;                    /* its id in the previous run: only makes the name unique */
        int fd;                         /* -EBADF once taken */
} InheritedCached;

/* What the service manager passed. */
typedef struct Inherited {
        int socket;                     /* the listening socket, or -EBADF */
        int table_fd;                   /* the newest stored table, or -EBADF */
        uint64_t table_generation;
        bool table_legacy;              /* a "state-" JSON table of the previous version, not a "table-" store */
        InheritedSlab *slabs;
        size_t n_slabs;
        InheritedCached *cached;
        size_t n_cached;
        unsigned n_dropped;             /* fds closed: older tables, unknown names */
} Inherited;

#define INHERITED_NULL ((Inherited){ .socket = -EBADF, .table_fd = -EBADF })

/*
 * Sorts out LISTEN_FDS. The socket is the fd named RESTORE_SOCKET_NAME, or
 * any other socket among them: at most one may be passed. Returns 0 (possibly
 * with no socket: then the daemon binds its own), or -EINVAL with a sentence
 * for more than one socket or a socket that is not a listening AF_UNIX
 * stream one, or another negative errno.
 */
int inherited_take(Inherited *ret, char **ret_message);

/* Closes whatever of it was not taken (the store keeps them: a start that fails does not lose them). */
void inherited_done(Inherited *in);

/*
 * Starts storing when a service manager keeps fds ($NOTIFY_SOCKET, $FDSTORE > 0): slab fds
 * from now on, and a Store for the table (given to the broker). Honours
 * $VMMBROKER_TEST_STORE_FAULT ("STEP:N" or "STEP:N:crash", STEP one of write,
 * grow, seal, notify), a test hook that makes the Nth such step fail. Returns
 * 0, or -EINVAL with a sentence for a bad test hook, or -ENOMEM.
 */
int restore_start_storing(Manager *m, char **ret_message);

/*
 * Rebuilds the lease table from `in` (its table and slabs), re-attaching
 * holders still alive, then takes back the host slabs the previous run had
 * cached, as far as HostCapacity= has room (pool_adopt_host(); the others are
 * closed and removed), then stores the table anew. Prints a line per lease
 * dropped and a summary on stderr. Returns 0, or a negative errno for a
 * failure of the daemon itself (out of memory); a table that cannot be used
 * is reported and ignored.
 */
int restore_leases(Manager *m, Inherited *in);

/*
 * At exit, before restore_stop_storing(): stores each host slab the pool has
 * cached as "hcache-<device>-<size>-<id>" instead of "slab-<id>" (removed
 * first: the service manager keeps an open file once), so that the next run
 * finds what it is and takes it back (restore_leases()) rather than pin that
 * memory again, which holds every process's GPU allocations on the host
 * (docs/pool.md). Slabs still being zeroed are not kept. Nothing when not
 * storing.
 */
void restore_keep_host_cache(Manager *m);

/*
 * At exit: stops storing slab fds, so that releasing the pool does not take
 * them out of the store: a restart takes them back. (A service stopped for
 * good has its store emptied by the service manager.) The table needs
 * nothing: every change was stored when it was made.
 */
void restore_stop_storing(Manager *m);
