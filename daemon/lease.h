/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The lease table: leases, their holds, share tokens and names, as plain
 * data with the indexes that make every lookup O(1) (by id, by token, by
 * name) and every per-user question O(what the user owns or holds).
 *
 * A lease is whole slabs from the pool. It belongs to the user that made it
 * (its owner, charged for it) and is held by processes (holders, holder.h).
 * A hold counts the replies that gave the lease to its process (Alloc, then
 * each Attach). A lease ends when no process holds it and it is not
 * published. Once a holder of another user than the owner has attached, the
 * lease is "foreign" and its slabs are released to the driver at its end,
 * never cached, so that no slab ever goes from one user's hands to another's.
 *
 * A lease may be parked: its content copied into host slabs, its device slabs
 * given back, charged to its owner as host bytes (broker_park()). Its slabs are
 * then the host slabs, which no client ever maps.
 *
 * A lease may be kept: its only holder freed it with keep (broker_free()), and
 * it waits, zeroed and still mapped in that process, for the process's next
 * Alloc of its size. It keeps its hold, its charges and its slabs; it is on
 * its holder's kept list and the first its device's reclaiming asks for.
 *
 * This module changes the table and nothing else: no policy on who may do
 * what, no storing, no sockets. The rules and the store are broker.c's, which
 * prepares everything that can fail (memory, slabs, charges, the stored
 * record) before it calls the functions here that change the table; those
 * cannot fail. Every change bumps LeaseTable.generation.
 */

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "hashmap.h"
#include "holder.h"
#include "list.h"
#include "pool.h"
#include "reclaim.h"
#include "user.h"

#define LEASE_ID_LEN 32                 /* hex digits of a 128-bit random identifier */
#define LEASE_TOKEN_LEN 32              /* hex digits of a 128-bit random share token */
#define LEASE_LABEL_MAX 128
#define LEASE_TOKENS_MAX 64             /* live share tokens per lease */
#define UID_ANY ((uid_t)-1)             /* a token any user may present */

typedef struct Lease Lease;
typedef struct Hold Hold;

/* One process's hold on one lease. */
struct Hold {
        Lease *lease;
        Holder *holder;
        unsigned refs;                  /* Alloc and Attach replies not yet freed */
        bool readonly;
        bool parked;                    /* its process let the device memory go (Park) and keeps the lease
                                           (stored; always true of a parked lease's holds) */
        List link_lease;                /* in Lease.holds */
        List link_holder;               /* in Holder.holds */
};

/* A share token: whoever presents it (of `uid`, unless UID_ANY) may attach to its lease. */
typedef struct Token {
        char token[LEASE_TOKEN_LEN + 1];
        uid_t uid;                      /* who may present it, or UID_ANY */
        uid_t creator;                  /* who made it: may revoke it */
        bool readonly;                  /* attaching with it gives a read-only hold */
        Lease *lease;
        List link;                      /* in Lease.tokens */
        HashLink link_table;            /* in LeaseTable.by_token */
} Token;

/*
 * A park's or an unpark's copy in flight (broker_park(), broker_unpark()): the lease's content is being copied,
 * off the loop, into `slabs` (host slabs for a park, device slabs for an unpark, leased for its owner and
 * charged by `charge`), while the lease stays as it is. broker.c ends it: committed once the copy is done (the
 * lease takes the slabs and the charge), or cancelled by whatever needs the lease as it is (an Attach or
 * Unpark undoes a park, a Park of the same hold its unpark). The table cancels it when the lease ends, and
 * when the hold that asked for it ends (lease_move_cancel()).
 */
typedef struct LeaseMove {
        Lease *lease;
        Hold *hold;                     /* the process's that asked, or NULL (an Attach's unpark) */
        bool parked;                    /* toward host memory (a park) or device memory (an unpark) */
        Slab **slabs;
        size_t n_slabs;
        UserCharge charge;              /* the owner's host bytes (a park) or device bytes for them */
        List link;                      /* in LeaseTable.moves, in the order they began */
} LeaseMove;

struct Lease {
        char id[LEASE_ID_LEN + 1];
        int device;                     /* CUDA device index */
        size_t pool_device;             /* the same device in pool order */
        uint64_t size;
        uint64_t created_usec;          /* CLOCK_REALTIME */
        char *label;
        uid_t uid;                      /* the owner: the user that made it */
        UserCharge charge_lease;        /* the owner's charges for it; charge_lease.user is the owner */
        UserCharge charge_bytes;        /* device bytes, while not parked */
        UserCharge charge_host;         /* host bytes, while parked */
        pid_t pid;                      /* the process that made it (it may have exited) */
        char comm[16];                  /* and its command name */
        bool foreign;                   /* another user has held it: release its slabs at the end */
        bool parked;                    /* its content is in host memory: slabs are host slabs (pool.h) */
        bool kept;                      /* kept for its one holder's next Alloc of its size (stored) */
        LeaseMove *move;                /* a copy to or from host memory in flight, or NULL (not stored) */
        int move_error;                 /* why its last move ended uncommitted (a BROKER_E_*), for the calls
                                           that waited for it; 0: none, or another move began (not stored) */
        char *move_message;             /* with move_error BROKER_E_DRIVER: the driver's words for the copy's
                                           failure (move_end()), or NULL */
        size_t n_slabs;
        Slab **slabs;                   /* in mapping order */
        List holds;                     /* Hold */
        unsigned n_holds;
        List tokens;                    /* Token */
        unsigned n_tokens;
        char *name;                     /* published under this name in its owner's namespace, or NULL: the part
                                           of name_key after the owner */
        char *name_key;                 /* "<owner uid>/<name>": its key in LeaseTable.by_name (owns the string) */
        uid_t *name_uids;               /* users besides the owner who may attach by name */
        size_t n_name_uids;
        bool name_readonly;             /* attaching by name gives a read-only hold */
        uint64_t listed;                /* the List call that last showed it (to show it once) */
        ReclaimMark reclaim;            /* reclaimable, asked back (reclaim.h); not stored */
        List link_kept;                 /* in its holder's Holder.kept while kept, oldest first */
        List link_table;                /* in LeaseTable.leases */
        List link_owner;                /* in owner->owned */
        HashLink link_id;               /* in LeaseTable.by_id */
        HashLink link_name;             /* in LeaseTable.by_name while published */
};

typedef struct LeaseTable {
        Pool *pool;
        List leases;                    /* every Lease, oldest first */
        HashMap by_id, by_token, by_name;
        unsigned n_leases;
        unsigned n_published;
        unsigned *device_leases;        /* leases per pool device */
        uint64_t *device_kept;          /* bytes of kept leases per pool device */
        size_t n_devices;
        uint64_t generation;            /* bumped by every change of the table */
        bool closing;                   /* the daemon is exiting: slabs are released, never scrubbed */
        ReclaimSet reclaim;             /* the reclaimable leases (reclaim.h) */
        List moves;                     /* LeaseMove, oldest first */
        uint64_t moves_ended;           /* bumped by each lease_move_take() and lease_move_cancel() */
} LeaseTable;

/* Sets up an empty table over the pool's devices. Returns 0 or -ENOMEM. */
int lease_table_init(LeaseTable *t, Pool *pool);

/*
 * Ends every lease, published or not. The slabs are released, not scrubbed:
 * their holders may still be using them, and a restarted daemon takes them
 * back from the service manager's store.
 */
void lease_table_done(LeaseTable *t);

/* Makes room in the indexes for one more lease, token or name, so that adding it cannot fail. */
int lease_table_reserve(LeaseTable *t);

/* The lease with that identifier, or NULL. */
Lease *lease_table_find(const LeaseTable *t, const char *id);

/* The lease that `owner` published as `name`, or NULL. */
Lease *lease_table_find_name(const LeaseTable *t, uid_t owner, const char *name);

/* The key of a name in the table: "<owner>/<name>", malloc'd (NULL when out of memory). */
char *lease_name_key(uid_t owner, const char *name);

/* The live token equal to `token` (compared in constant time), or NULL. */
Token *lease_table_find_token(const LeaseTable *t, const char *token);

/*
 * Adds a lease that broker.c made: id, device, pool_device, size, slabs,
 * charges and the rest filled in, lists and links not yet initialised (this
 * does it). It has no hold yet.
 */
void lease_table_add(LeaseTable *t, Lease *l);

/* Ends a lease at once, whoever holds it: its slabs go back to the pool (released if foreign), its charges
 * are released, its holds and tokens dropped. */
void lease_end(LeaseTable *t, Lease *l);

/* The hold of a holder on a lease, or NULL. */
Hold *lease_find_hold(const Lease *l, const Holder *h);

/* Links a new hold (allocated by the caller) of `refs` references. Marks the lease foreign for another user. */
void lease_add_hold(LeaseTable *t, Lease *l, Hold *hold, Holder *h, unsigned refs, bool readonly);

/* One more reference on a hold; read-write if either is. */
void hold_ref(LeaseTable *t, Hold *hold, bool readonly);

/* Drops one reference; at the last the hold ends, and the lease too if nobody holds it and it has no name. */
void hold_unref(LeaseTable *t, Hold *hold);

/* Ends a hold whatever its references, and the lease if nobody holds it and it has no name. */
void hold_end(LeaseTable *t, Hold *hold);

/* Whether ending this hold ends its lease. */
bool hold_is_last(const Hold *hold);

/*
 * Keeps a lease for its one holder (broker_free()'s rules decided it may be): revokes its tokens, puts it on
 * the holder's kept list, and marks it to be asked back before any lease marked reclaimable.
 */
void lease_keep(LeaseTable *t, Lease *l);

/* Hands a kept lease back to its holder's use: off the kept list, no longer reclaimable. */
void lease_unkeep(LeaseTable *t, Lease *l);

/* Starts a lease's move (allocated and filled by the caller but for `lease` and `link`). */
void lease_move_add(LeaseTable *t, Lease *l, LeaseMove *move);

/* Takes the lease's move off the table to commit it (the caller frees it): the lease is as it was. */
LeaseMove *lease_move_take(LeaseTable *t, Lease *l);

/* Ends the lease's move, if it has one: its slabs go back to the pool (scrubbed after the copy, on the same
 * stream; released if the daemon is exiting) and its charge is released. */
void lease_move_cancel(LeaseTable *t, Lease *l);

/* Links a new token (allocated and filled by the caller: token, uid, creator, readonly). */
void lease_add_token(LeaseTable *t, Lease *l, Token *tok);

/* Revokes a token. */
void token_free(LeaseTable *t, Token *tok);

/*
 * Publishes a lease under `key` (lease_name_key() of its owner and the name;
 * ownership of key and uids passes to the lease), or changes who may attach
 * it by its name when it has that name already (then `key` is freed). The
 * name must be free in the owner's namespace or the lease's own.
 */
void lease_set_name(LeaseTable *t, Lease *l, char *key, uid_t *uids, size_t n_uids, bool readonly);

/* Removes a lease's name; the lease ends if nobody holds it. */
void lease_unpublish(LeaseTable *t, Lease *l);

/* Whether `uid` may attach to a published lease by its name: the owner, or one of its users. */
bool lease_name_allows(const Lease *l, uid_t uid);

/* A fresh random identifier or token of `digits` hex digits (even, at most 64) into out[digits + 1]. */
int lease_random_hex(char *out, size_t digits);
