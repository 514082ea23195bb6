/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Leases, their holders, share tokens and names.
 *
 * A lease is whole slabs from the pool. It belongs to the user that made it
 * (its owner, charged for it) and is held by processes: its holders. A holder
 * is a process, identified by its pid and a pidfd taken when it connected; it
 * is not a connection. The process that made the lease is its first holder;
 * others attach to it with a share token or, for a published lease, its name.
 *
 * A hold counts the replies that gave the lease to its process (Alloc, then
 * each Attach); each Free drops one, and the process exiting (its pidfd
 * becomes readable) drops them all. A lease ends when no process holds it and
 * it is not published. A closed connection alone ends nothing: the process may
 * still have the memory mapped.
 *
 * Isolation: once a holder of another user than the owner has attached, the
 * lease is "foreign" and its slabs are released to the driver at its end,
 * never cached, so that no slab ever goes from one user's hands to another's.
 *
 * This module is plain data over the pool: no sockets, no event loop and no
 * policy on who may do what (peer.c decides). The manager watches the pidfds
 * and calls holder_reclaim().
 */

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "list.h"
#include "pool.h"
#include "user.h"

#define LEASE_ID_LEN 32                 /* hex digits of a 128-bit random identifier */
#define LEASE_TOKEN_LEN 32              /* hex digits of a 128-bit random share token */
#define LEASE_LABEL_MAX 128
#define LEASE_TOKENS_MAX 64             /* live share tokens per lease */
#define UID_ANY ((uid_t)-1)             /* a token any user may present */

typedef struct Holder Holder;
typedef struct Lease Lease;

/* One process's hold on one lease. */
typedef struct Hold {
        Lease *lease;
        Holder *holder;
        unsigned refs;                  /* Alloc and Attach replies not yet freed */
        bool readonly;
        List link_lease;                /* in Lease.holds */
        List link_holder;               /* in Holder.holds */
} Hold;

/* A share token: whoever presents it (of `uid`, unless UID_ANY) may attach to its lease. */
typedef struct Token {
        char token[LEASE_TOKEN_LEN + 1];
        uid_t uid;                      /* who may present it, or UID_ANY */
        uid_t creator;                  /* who made it: may revoke it */
        bool readonly;                  /* attaching with it gives a read-only hold */
        Lease *lease;
        List link;                      /* in Lease.tokens */
} Token;

struct Lease {
        char id[LEASE_ID_LEN + 1];
        int device;
        uint64_t size;
        uint64_t created_usec;          /* CLOCK_REALTIME */
        char *label;
        uid_t uid;                      /* the owner: the user that made it, charged for it */
        User *owner;                    /* its accounting (a reference) */
        size_t pool_device;             /* the device in pool order, for the accounting */
        pid_t pid;                      /* the process that made it (it may have exited) */
        char comm[16];                  /* and its command name */
        bool foreign;                   /* another user has held it: release its slabs at the end */
        size_t n_slabs;
        Slab **slabs;                   /* in mapping order */
        List holds;                     /* Hold */
        unsigned n_holds;
        List tokens;                    /* Token */
        unsigned n_tokens;
        char *name;                     /* published under this name, or NULL */
        uid_t *name_uids;               /* users besides the owner who may attach by name */
        size_t n_name_uids;
        bool name_readonly;             /* attaching by name gives a read-only hold */
        List link_table;                /* in LeaseTable.leases */
};

struct Holder {
        pid_t pid;
        uid_t uid;
        gid_t gid;
        int pidfd;
        char comm[16];                  /* /proc/PID/comm when it connected */
        uint64_t start_time;            /* /proc/PID/stat's starttime when it connected, 0 if unknown: with the
                                           pid, tells this process from a later one given the same pid */
        List holds;                     /* Hold */
        unsigned n_connections;         /* connections of this process the daemon has open */
        void *userdata;                 /* non-NULL while the manager watches the pidfd */
        List link;                      /* in LeaseTable.holders */
};

typedef struct LeaseTable {
        Pool *pool;
        UserRegistry *users;            /* the owners' accounting */
        List leases;                    /* every Lease */
        List holders;                   /* every Holder */
        unsigned n_leases;
        unsigned n_published;
        bool closing;                   /* the daemon is exiting: slabs are released, never scrubbed */
} LeaseTable;

void lease_table_init(LeaseTable *t, Pool *pool);

/*
 * Ends every lease, published or not, and frees every holder (closing their pidfds). The slabs are
 * released, not scrubbed: their holders may still be using them, and a restarted daemon takes them back
 * from the service manager's store.
 */
void lease_table_done(LeaseTable *t);

/*
 * The holder for a process that just connected, given its credentials and a
 * pidfd (ownership passes to the table on success). If the table already has a
 * live holder with that pid, that one is returned and the new pidfd closed; a
 * holder whose process is gone (its pidfd readable) is reclaimed first, so a
 * reused pid never inherits another process's holds. *ret_new says whether a
 * holder was created (the caller then watches its pidfd).
 */
int lease_table_get_holder(LeaseTable *t, pid_t pid, uid_t uid, gid_t gid, int pidfd, Holder **ret,
                           bool *ret_new);

/* Whether the holder's process has exited (its pidfd is readable). */
bool holder_is_dead(const Holder *h);

/* Drops every hold of a holder, ending the leases nobody else holds or published. Returns how many holds. */
unsigned holder_reclaim(LeaseTable *t, Holder *h);

/* Frees a holder that has no holds and no connections. Returns true if it did. */
bool holder_free_if_unused(LeaseTable *t, Holder *h);

/* What a refused charge was: for the QuotaExceeded answer. */
typedef struct LeaseQuota {
        UserResource what;
        uint64_t asked, limit, current;
} LeaseQuota;

/*
 * Leases `size` bytes of `device` to a holder, which holds it once, owned by
 * and charged to `owner` (the holder's user). Returns 0, a POOL_E_* code,
 * -EDQUOT over one of the owner's limits (*ret_quota says which), or a
 * negative errno; on failure nothing changed.
 */
int lease_new(LeaseTable *t, Holder *h, User *owner, int device, uint64_t size, const char *label, Lease **ret,
              LeaseQuota *ret_quota);

/* The holder's hold on the lease with that identifier, or NULL (a lease it does not hold is not found). */
Hold *hold_find(const Holder *h, const char *id);

/*
 * Gives a holder one more reference on a lease: a new hold (read-only if
 * asked), or one more reference on the hold it has (which becomes read-write
 * if this one is). Marks the lease foreign when the holder is not of the
 * owner's uid. Returns 0 or -ENOMEM.
 */
int lease_attach(LeaseTable *t, Lease *l, Holder *h, bool readonly, Hold **ret);

/* Drops one reference; at the last, the hold ends, and the lease too if nobody holds it and it has no name. */
void hold_unref(LeaseTable *t, Hold *hold);

/* Ends a lease at once, whoever holds it: its slabs go back to the pool (released if foreign). */
void lease_free(LeaseTable *t, Lease *l);

/*
 * Makes a share token for a lease. Returns 0, -EDQUOT when the lease has
 * LEASE_TOKENS_MAX tokens already, or a negative errno.
 */
int lease_share(Lease *l, uid_t uid, uid_t creator, bool readonly, Token **ret);

/* The live token equal to `token` (compared in constant time per token), or NULL. */
Token *token_find(LeaseTable *t, const char *token);

/* Revokes a token. */
void token_free(Token *tok);

/* The lease published as `name`, or NULL. */
Lease *lease_find_name(LeaseTable *t, const char *name);

/*
 * Publishes a lease as `name`, for the owner and `uids`. Publishing it again
 * under its name replaces uids and readonly. Returns 0, -EEXIST when another
 * lease has the name, -EBUSY when this lease has another name, -ENOMEM.
 */
int lease_publish(LeaseTable *t, Lease *l, const char *name, const uid_t *uids, size_t n_uids, bool readonly);

/* Whether `uid` may attach to a published lease by its name: the owner, or one of its users. */
bool lease_name_allows(const Lease *l, uid_t uid);

/*
 * Restoring after a restart (daemon/restore.c): a lease with the identity and slabs it had, owned by and
 * charged to `owner` even over its limits (it was within them when made), with no hold yet. The slabs
 * (imported, leased to the owner) pass to the lease. Returns 0 or -ENOMEM (then nothing changed).
 */
int lease_restore(LeaseTable *t, User *owner, size_t pool_device, const char *id, int device, uint64_t created_usec,
                  const char *label, pid_t pid, const char *comm, bool foreign, Slab **slabs, size_t n_slabs,
                  Lease **ret);

/* A restored hold of `refs` references. Returns 0 or -ENOMEM. */
int lease_restore_hold(Lease *l, Holder *h, unsigned refs, bool readonly);

/* A restored token. Returns 0, -EDQUOT or -ENOMEM. */
int lease_restore_token(Lease *l, const char *token, uid_t uid, uid_t creator, bool readonly);

/* Removes a lease's name; the lease ends if nobody holds it. */
void lease_unpublish(LeaseTable *t, Lease *l);
