/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The lease table's durable copy across a restart, at O(1) per change: an
 * append-only log of change records in ONE memfd, kept in the service
 * manager's file descriptor store as "table-<generation>". The memfd is
 * handed to the service manager once, when it is made (a snapshot: at start,
 * and at compaction when the log has grown); a change is then one pwrite()
 * at the end of the log and no message at all. docs/restart.md ("State
 * format") describes it for a person.
 *
 * The format (version STORE_FORMAT, little-endian):
 *
 *   file header, 32 bytes: magic "VMMBTBL\0", u32 format (2), u32 0, u64 generation,
 *                          u32 CRC-32C of the 24 bytes before it, u32 0
 *   records, back to back: u32 CRC-32C of the rest of the record, u32 length of the payload (>= 1),
 *                          u64 sequence (the previous record's + 1), payload: ops
 *   the first record is the snapshot: its first op is SNAPSHOT (u32 number of leases), then a
 *   PUT_LEASE per lease, each followed by its PUT_TOKENs and PUT_HOLDs; the records after it are
 *   changes, each one store_begin() .. store_commit(), made of PUT_ and END_ ops.
 *
 *   op   u8 code, then (str: u8 length + bytes, no NUL; bool: u8 0 or 1)
 *   1 SNAPSHOT   u32 n_leases
 *   2 PUT_LEASE  str id, i32 device, u64 size, u64 created_usec, u32 uid, i32 pid, str comm,
 *                u8 flags (1 foreign, 2 label, 4 name, 8 name_readonly, 16 parked: the slabs are host
 *                slabs holding a parked lease's content, 32 kept: for its one holder's next Alloc), [str label],
 *                u16 n_slabs, n_slabs x (u64 id, u64 size), [str name, u8 n_name_uids, n x u32 uid]
 *   3 END_LEASE  str id                       (its holds and tokens end with it)
 *   4 PUT_HOLD   str lease id, i32 pid, u64 start_time, u32 uid, u32 gid, str comm, u32 refs,
 *                u8 flags (1 readonly, 2 parked: the process let the device memory go; a bool before parking)
 *   5 END_HOLD   str lease id, i32 pid, u64 start_time
 *   6 PUT_TOKEN  str lease id, str token, u32 uid (UID_ANY: anyone), u32 creator, bool readonly
 *   7 END_TOKEN  str token
 *
 * Writing: the memfd (memfd_create("vmmbroker-table", MFD_CLOEXEC | MFD_ALLOW_SEALING), sealed
 * F_SEAL_SHRINK | F_SEAL_SEAL) is grown in doubling chunks with fallocate() before a record is
 * written, so that bytes past the log are zeros and a write does not allocate; a record is one
 * pwrite() at the end of the log, and the end moves only after the whole record is written. A record
 * that failed is overwritten by the next one, and the bytes of it that a shorter next record would
 * leave behind are zeroed first.
 *
 * Crash guarantees. A change whose commit returned 0 survives any crash of the daemon. A change whose
 * commit failed is never read back. A change whose commit did not return (the daemon died in it) is
 * never read back unless its record had been written whole: the last byte written is the commit
 * point, and a crash after it is a crash just after the return. A torn record, and anything after
 * it, is never read back: the reader stops at the first record whose length, sequence or checksum is
 * wrong. A snapshot is visible to a restarted daemon only once it is complete: the memfd is handed to
 * the service manager after it is written and sealed, and the previous one is removed only after
 * that; at start the highest generation wins.
 *
 * Replay: PUT_LEASE creates a lease or replaces its attributes (keeping its holds and tokens);
 * PUT_HOLD creates or replaces the hold of (lease, pid, start_time); PUT_TOKEN creates or replaces a
 * token. A PUT_HOLD or PUT_TOKEN naming a lease that is not there, or a token that is another
 * lease's, is corruption: the file is refused. An END_ op of something that is not there is a no-op
 * (ending is idempotent), so that the order in which the daemon records the ends of a lease and of its
 * holds does not matter. The result is checked as state_read() checks a file (state_check()).
 */

#include <stdbool.h>
#include <stdint.h>

#include "lease.h"
#include "state.h"

#define STORE_FORMAT 2                  /* format 1 is state.c's JSON "state-<generation>" */
#define STORE_NAME_PREFIX "table-"      /* stored as "table-<generation>" */
#define STORE_MEMFD_NAME "vmmbroker-table"

typedef struct Store Store;

/*
 * How a memfd gets into the service manager's fd store: in the daemon, sd_pid_notify_with_fds()
 * FDSTORE=1 + FDNAME= + FDPOLL=0, and FDSTOREREMOVE=1; in tests, a fake. Each returns 0 or a
 * negative errno.
 */
typedef struct StoreBackend {
        int (*save)(void *userdata, const char *name, int fd);
        int (*remove)(void *userdata, const char *name);
        void *userdata;
} StoreBackend;

typedef enum StoreStep {        /* the steps of storing, for fault injection */
        STORE_STEP_WRITE,       /* writing a record into the memfd */
        STORE_STEP_GROW,        /* growing the memfd (fallocate/ftruncate) before writing */
        STORE_STEP_SEAL,        /* sealing a new memfd (F_SEAL_SHRINK | F_SEAL_SEAL; it is never shrunk) */
        STORE_STEP_NOTIFY,      /* handing a new memfd to the service manager (backend save) */
        _STORE_STEP_MAX,
} StoreStep;

typedef struct StoreStats {
        uint64_t generation;     /* of the memfd in use; 0: none stored yet */
        uint64_t commits;        /* changes stored */
        uint64_t failures;       /* commits or snapshots that failed */
        uint64_t log_bytes;      /* bytes in the memfd in use (header and records) */
        uint64_t snapshot_bytes; /* bytes of its first record (the snapshot) */
        uint64_t snapshots;      /* snapshots written */
        uint64_t messages;       /* backend calls (messages to the service manager) */
} StoreStats;

/*
 * A store that will talk to the service manager through `backend` (copied). Opens nothing: a table is
 * stored by the first store_snapshot(). Returns 0 and the store in *ret, or -ENOMEM.
 */
int store_new(Store **ret, const StoreBackend *backend);

/*
 * Frees a store and closes its memfd; the service manager keeps its own copy, which a restarted daemon
 * reads. Drops a change begun and not committed. Accepts NULL; returns NULL.
 */
Store *store_free(Store *s);

/*
 * Where the numbering of generations goes on: after a restart, the generation of the table the daemon
 * read back ("table-<generation>"), so that the first snapshot is stored as "table-<generation+1>" and
 * removes "table-<generation>", and the newest table is always the highest. Only before the first
 * snapshot (later calls are ignored). Without it the first snapshot is "table-1".
 */
void store_set_generation(Store *s, uint64_t generation);

/* Whether a table is stored: a snapshot has succeeded. Commits before that fail with -ENOLINK. */
bool store_is_open(const Store *s);

/*
 * Starts one change, dropping any change begun and not committed. The ops that follow only append
 * to an in-memory buffer; store_commit() writes them as one record, or nothing of them.
 */
void store_begin(Store *s);

/*
 * Records that a lease was made or that its attributes changed: id, device, size, created_usec, label,
 * uid, pid, comm, foreign, parked, kept, slabs (id, size), name, name_uids, name_readonly (not its
 * holds and tokens). A label or command name that is not printable UTF-8 is written with '?' for each bad
 * character, as the JSON of format 1 had it. Returns 0 or -ENOMEM (the change then fails at commit).
 */
int store_put_lease(Store *s, const Lease *l);

/* Records that a lease ended, and its holds and tokens with it. Returns 0 or -ENOMEM. */
int store_end_lease(Store *s, const char *lease_id);

/*
 * Records that a process holds a lease `refs` times (read-only or not, parked or not): creates or replaces the hold of
 * (h->pid, h->start_time) on the lease; the holder's uid, gid and comm are stored. Returns 0 or -ENOMEM.
 */
int store_put_hold(Store *s, const char *lease_id, const Holder *h, unsigned refs, bool readonly, bool parked);

/* Records that the hold of (h->pid, h->start_time) on a lease ended. Returns 0 or -ENOMEM. */
int store_end_hold(Store *s, const char *lease_id, const Holder *h);

/* Records a share token of a lease (token, uid, creator, readonly), created or replaced. 0 or -ENOMEM. */
int store_put_token(Store *s, const char *lease_id, const Token *t);

/* Records that a share token was revoked (or ended with its lease). Returns 0 or -ENOMEM. */
int store_end_token(Store *s, const char *token);

/*
 * Writes the change begun by store_begin() as one record at the end of the log: returns 0 once it is
 * written whole (it then survives any crash), or a negative errno and nothing of it will ever be read
 * back: -ENOLINK before the first snapshot, -ENOMEM when an op could not be buffered, -EFBIG when the
 * log would pass STATE_SIZE_MAX, or the errno of growing or writing the memfd. An empty change
 * succeeds and writes nothing. Never sends anything to the service manager; costs the same whatever
 * the size of the table. The change is over either way.
 */
int store_commit(Store *s);

/* Drops the change begun by store_begin(): nothing of it is written. */
void store_abort(Store *s);

/*
 * Writes the whole table into a new memfd (generation + 1) as its first record, seals it, saves it
 * with the backend as "table-<generation+1>", then removes "table-<generation>" and switches to it.
 * On failure (any step) the store keeps using the memfd it had (if any) and returns a negative errno
 * (-EFBIG for a table over STATE_LEASES_MAX, a lease over STATE_HOLDS_MAX holds, or a snapshot over
 * STATE_SIZE_MAX). A failure to remove the old name is not one: the old table stays stored, and the
 * higher generation wins at start.
 * O(table), called rarely: at start, and when store_wants_snapshot() says the log has grown (the
 * daemon calls it when idle). Must not be called between store_begin() and store_commit().
 */
int store_snapshot(Store *s, const LeaseTable *t);

/*
 * Whether the log has grown enough to be worth compacting with store_snapshot(): more than twice
 * the snapshot plus 1 MiB. Compacting then costs O(1) amortised per change.
 */
bool store_wants_snapshot(const Store *s);

/* The store's counters. */
StoreStats store_stats(const Store *s);

/*
 * For tests: makes the nth next operation of `step` (1: the next one; 0 removes the fault) fail with
 * `error` (a negative errno), or, with crash, abort() the process right there. A WRITE that fails or
 * crashes does so after writing part of the record, so that a torn record is left.
 */
void store_inject_fault(Store *s, StoreStep step, unsigned nth, int error, bool crash);

/*
 * Reads a stored table back: replays the snapshot, then every whole record after it; a torn or
 * corrupt tail (bad length, checksum or sequence) ends the replay there (it was never acknowledged).
 * The result is checked with state_check(). A file in format 1 (JSON, starting with '{': the previous
 * daemon's "state-<generation>") is read with state_read(). Returns 0 with *ret filled (free with
 * state_done()); -EBADMSG or -EPROTONOSUPPORT with a sentence in *ret_message (malloc'd) for a file
 * it cannot trust (nothing of it is used); -EFBIG for a file over STATE_SIZE_MAX; -ENOMEM; -errno of
 * fstat()/pread(). Reads with pread() from offset 0: the fd's offset is neither used nor changed.
 * On failure *ret is empty.
 */
int store_read(int fd, State *ret, char **ret_message);
