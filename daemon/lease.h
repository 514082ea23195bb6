/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Leases and their holders.
 *
 * A lease is whole slabs from the pool, handed to one process: its holder. A
 * holder is a process, identified by its pid and a pidfd taken when it
 * connected; it is not a connection. A lease ends when its holder frees it or
 * exits (the pidfd becomes readable). A closed connection alone ends nothing:
 * the process may still have the memory mapped.
 *
 * This module is plain data over the pool: no sockets and no event loop. The
 * manager watches the pidfds and calls holder_reclaim().
 */

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "list.h"
#include "pool.h"

#define LEASE_ID_LEN 32                 /* hex digits of a 128-bit random identifier */
#define LEASE_LABEL_MAX 128

typedef struct Holder Holder;

typedef struct Lease {
        char id[LEASE_ID_LEN + 1];
        int device;
        uint64_t size;
        uint64_t created_usec;          /* CLOCK_REALTIME */
        char *label;
        Holder *holder;
        size_t n_slabs;
        Slab **slabs;                   /* in mapping order */
        List link_holder;               /* in Holder.leases */
        List link_table;                /* in LeaseTable.leases */
} Lease;

struct Holder {
        pid_t pid;
        uid_t uid;
        gid_t gid;
        int pidfd;
        char comm[16];                  /* /proc/PID/comm when it connected */
        List leases;                    /* Lease */
        unsigned n_connections;         /* connections of this process the daemon has open */
        void *userdata;                 /* non-NULL while the manager watches the pidfd */
        List link;                      /* in LeaseTable.holders */
};

typedef struct LeaseTable {
        Pool *pool;
        List leases;                    /* every Lease */
        List holders;                   /* every Holder */
        unsigned n_leases;
} LeaseTable;

void lease_table_init(LeaseTable *t, Pool *pool);

/* Reclaims every lease and frees every holder (closing their pidfds). */
void lease_table_done(LeaseTable *t);

/*
 * The holder for a process that just connected, given its credentials and a
 * pidfd (ownership passes to the table on success). If the table already has a
 * live holder with that pid, that one is returned and the new pidfd closed; a
 * holder whose process is gone (its pidfd readable) is reclaimed first, so a
 * reused pid never inherits another process's leases. *ret_new says whether a
 * holder was created (the caller then watches its pidfd).
 */
int lease_table_get_holder(LeaseTable *t, pid_t pid, uid_t uid, gid_t gid, int pidfd, Holder **ret,
                           bool *ret_new);

/* Whether the holder's process has exited (its pidfd is readable). */
bool holder_is_dead(const Holder *h);

/* Reclaims every lease of a holder: the slabs go back to the pool to be scrubbed. Returns how many. */
unsigned holder_reclaim(LeaseTable *t, Holder *h);

/* Frees a holder that has no leases and no connections. Returns true if it did. */
bool holder_free_if_unused(LeaseTable *t, Holder *h);

/*
 * Leases `size` bytes of `device` to a holder. Returns 0, a POOL_E_* code, or a
 * negative errno; on failure nothing changed.
 */
int lease_new(LeaseTable *t, Holder *h, int device, uint64_t size, const char *label, Lease **ret);

/* Ends a lease: its slabs go back to the pool. */
void lease_free(LeaseTable *t, Lease *l);

/* The lease with that identifier held by `h`, or NULL (another holder's lease is not found either). */
Lease *lease_find(LeaseTable *t, const Holder *h, const char *id);
