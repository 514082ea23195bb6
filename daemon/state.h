/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The daemon's state across a restart as plain data (State), what both
 * readers give: store_read() (store.h: the log of changes the daemon keeps,
 * format 2, "table-<generation>") and state_read() here, for format 1, the
 * JSON "state-<generation>" memfd that the previous daemon stored whole after
 * every change, so that an upgrade keeps its leases. Both make the same
 * checks (state_check()). Also here: telling whether a holder written in a
 * state is still the same live process. docs/restart.md describes both
 * formats for a person; format 1, in short:
 *
 *   {"format": 1, "leases": [{
 *       "id": "<32 hex>", "device": 0, "size": 4194304, "created": <usec, CLOCK_REALTIME>,
 *       "label": "...",                                   (optional)
 *       "uid": 1000, "pid": 4242, "comm": "trainer",      (owner; the process that made it)
 *       "foreign": false,
 *       "slabs": [{"id": 7, "size": 2097152}, ...],       (mapping order, 1..POOL_MAX_SLABS)
 *       "name": "...", "name_uids": [1001], "name_readonly": true,   (only if published)
 *       "tokens": [{"token": "<32 hex>", "uid": 1001, "creator": 1000, "readonly": true}],
 *                                                         ("uid" left out: any user)
 *       "holds": [{"pid": 4242, "start_time": 123456, "uid": 1000, "gid": 1000,
 *                  "comm": "trainer", "refs": 1, "readonly": false}]
 *   }]}
 *
 * What is not written, because it follows from what is:
 *   - accounting: a user's bytes and leases per device are the sums over the
 *     leases it owns ("uid", "size", "device"); rebuilding them is charging
 *     each restored lease to its owner again;
 *   - holders: one per distinct (pid, start_time) among the holds, with the
 *     uid and gid the holds carry (state_read() checks they agree);
 *   - the pool's cached and scrubbing slabs: memory nobody holds, whose fds
 *     the restarted daemon may release (or re-cache) as it sees fit.
 *
 * Reading is strict, as for the wire (proto/json.c): a file that breaks any
 * rule, or says another format version, is refused whole with a sentence and
 * nothing of it is used: a table rebuilt from a file we cannot trust could
 * hand one user's memory to another.
 */

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "lease.h"

#define STATE_FORMAT 1                          /* the JSON version state_read() reads */
#define STATE_SIZE_MAX (UINT64_C(1) << 30)      /* bytes of the file */
#define STATE_LEASES_MAX 1000000
#define STATE_HOLDS_MAX 4194304                 /* holds per lease: PID_MAX_LIMIT, as each is a process */
#define STATE_COMM_MAX 15                       /* bytes of a command name (TASK_COMM_LEN - 1) */
#define STATE_NAME_UIDS_MAX 64                  /* a published lease's users (VMMB_PUBLISH_UIDS_MAX) */

typedef struct StateSlab {
        uint64_t id;                            /* Slab.id: its fd is stored as "slab-<id>" */
        uint64_t size;                          /* not 0 (the pool checks it against the device) */
} StateSlab;

typedef struct StateToken {
        char token[LEASE_TOKEN_LEN + 1];
        uid_t uid;                              /* or UID_ANY */
        uid_t creator;
        bool readonly;
} StateToken;

typedef struct StateHold {
        pid_t pid;                              /* 0 for a holder whose pid was taken by another process */
        uint64_t start_time;                    /* Holder.start_time; 0 if it was unknown */
        uid_t uid;
        gid_t gid;
        char comm[STATE_COMM_MAX + 1];
        unsigned refs;                          /* at least 1 */
        bool readonly;
        bool parked;                            /* its process parked the lease (format 2 only) */
} StateHold;

typedef struct StateLease {
        char id[LEASE_ID_LEN + 1];
        int device;                             /* CUDA device index, not checked against the pool */
        uint64_t size;                          /* the sum of the slabs' sizes */
        uint64_t created_usec;
        char *label;                            /* or NULL */
        uid_t uid;                              /* the owner, never UID_ANY */
        pid_t pid;                              /* the process that made it, and its command name */
        char comm[STATE_COMM_MAX + 1];
        bool foreign;                           /* true whenever a hold is of another uid than the owner */
        bool parked;                            /* the slabs are host slabs (format 2 only) */
        bool kept;                              /* kept for its one holder's next Alloc (format 2 only) */
        StateSlab *slabs;                       /* in mapping order */
        size_t n_slabs;                         /* 1..POOL_MAX_SLABS */
        char *name;                             /* published as, or NULL */
        uid_t *name_uids;                       /* only with a name */
        size_t n_name_uids;
        bool name_readonly;                     /* only with a name */
        StateToken *tokens;
        size_t n_tokens;                        /* at most LEASE_TOKENS_MAX */
        StateHold *holds;                       /* empty for a published lease nobody holds; an unpublished
                                                   lease with no holds is never written but is accepted: it is
                                                   what a lease whose holders all died looks like */
        size_t n_holds;
} StateLease;

/*
 * A state as read back. Checked beyond the JSON: lease ids, tokens, names and
 * slab ids are each unique in the whole file; ids and tokens are 32 lowercase
 * hex digits; names are valid for Publish; sizes add up; uids are not
 * UID_ANY (but a token's uid may be); a pid held in several leases has the
 * same start_time, uid and gid in each; a process holds a lease at most once.
 */
typedef struct State {
        StateLease *leases;
        size_t n_leases;
} State;

/*
 * Reads a format-1 state from `fd` (a regular file: the memfd the previous
 * daemon stored as "state-<generation>", or any copy of it; read with
 * pread(), from offset 0, so the fd's offset is neither used nor changed).
 * Returns 0 with *ret filled (free it with state_done()); -EPROTONOSUPPORT
 * for another format version, -EBADMSG for a file that is not one that
 * daemon wrote (not JSON, a rule broken, cut short; state_check()), -EFBIG
 * for one over STATE_SIZE_MAX, each with a sentence in *ret_message
 * (malloc'd; may be NULL); -ENOMEM; -errno of fstat()/pread(). On failure
 * *ret is empty and nothing is left allocated.
 */
int state_read(int fd, State *ret, char **ret_message);

/*
 * The checks state_read() makes beyond the syntax, over a State however it
 * was read (store_read() makes them too): at most STATE_LEASES_MAX leases;
 * ids and tokens 32 lowercase hex digits; command names and labels printable
 * UTF-8 within their limits; 1..POOL_MAX_SLABS slabs of non-zero ids and
 * non-zero sizes adding up to the size; a valid name, with name_uids
 * (at most STATE_NAME_UIDS_MAX) and name_readonly only with a name; at most
 * LEASE_TOKENS_MAX tokens and STATE_HOLDS_MAX holds; no uid, gid or creator
 * of UID_ANY (a token's uid may be), no negative device or pid, refs at
 * least 1; foreign whenever a hold is of another uid than the owner's; ids,
 * names, tokens and slab ids unique in the state; a pid held in several
 * leases described the same in each, and holding one lease at most once.
 * Returns 0, -EBADMSG with a sentence in *ret_message, or -ENOMEM.
 */
int state_check(const State *s, char **ret_message);

/* Frees what a StateLease holds (its strings and arrays), not the struct. */
void state_lease_done(StateLease *l);

/* Frees what state_read() put in a State and empties it. Accepts an empty State. */
void state_done(State *s);

/*
 * The start time of a process: field 22 of /proc/PID/stat, in clock ticks
 * since boot. Together with the pid it names one process: a later process
 * that is given the same pid starts later. Returns 0 (the value is never 0
 * for a process: at least 1 tick has passed), -ESRCH when there is no such
 * process, -EBADMSG for a line it cannot parse, or -errno of open()/read().
 */
int process_start_time(pid_t pid, uint64_t *ret);

/*
 * For re-attaching a holder from a state: opens a pidfd for `pid` and checks
 * that it is the same process as the one written, its start time unchanged.
 * Returns 1 and the pidfd in *ret_pidfd (O_CLOEXEC; watch it as for any
 * holder) when it is; 0 when the process is gone or the pid names another
 * one; a negative errno when it cannot tell (pidfd_open() failing otherwise
 * than with ESRCH).
 *
 * A start_time of 0 (unknown when the holder connected) or one that cannot be
 * read now matches any process with that pid: keeping a lease for a process
 * that may be another one leaks it until that process exits, whereas dropping
 * the holds of one still alive would let its mapped memory go to someone else.
 */
int state_open_holder(pid_t pid, uint64_t start_time, int *ret_pidfd);

/* The same, keeping no pidfd: whether the process written as (pid, start_time) is still alive. */
bool state_is_holder_alive(pid_t pid, uint64_t start_time);
