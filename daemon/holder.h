/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Holders: the processes that hold leases or talk to the daemon, and the one
 * owner of a holder's life.
 *
 * A holder is a process, identified by its pid and a pidfd taken when it
 * connected, not a connection. It is made when its first connection comes
 * (holder_connect()) or when a restart re-attaches it (holder_restore()), and
 * it lives while it has a connection or a hold. Its pidfd is watched in an
 * epoll set of the registry's own: when the process exits, the holder is
 * marked exited and queued (holder_next_exited()), and the lease layer drops
 * its holds (broker_reap_holders()); then it is forgotten once its last
 * connection is closed. A new process with the same pid is a new holder.
 *
 * The holds themselves (Holder.holds) are the lease layer's (lease.c); this
 * module only reads whether there are any.
 */

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "hashmap.h"
#include "list.h"
#include "user.h"

typedef struct HolderRegistry HolderRegistry;

typedef struct Holder {
        HolderRegistry *registry;
        pid_t pid;
        uid_t uid;
        gid_t gid;
        int pidfd;
        char comm[16];                  /* /proc/PID/comm when it connected */
        uint64_t start_time;            /* /proc/PID/stat's starttime when it connected, 0 if unknown: with the
                                           pid, tells this process from a later one given the same pid */
        User *user;                     /* a reference; the holder is in user->holders */
        UserCharge charge;              /* one of the user's MaxProcesses= (its pidfd) */
        List holds;                     /* Hold.link_holder (lease.c) */
        List kept;                      /* Lease.link_kept: its leases kept for its next Alloc, oldest first */
        unsigned n_connections;         /* connections of this process the daemon has open */
        bool exited;                    /* the process has exited: no request of it is served any more */
        void *watch;                    /* its connection watching for reclaim requests (peer.c's), or NULL */
        HashLink link_pid;              /* in HolderRegistry.by_pid while it has not exited */
        List link;                      /* in HolderRegistry.holders */
        List link_user;                 /* in user->holders */
        List link_exited;               /* in HolderRegistry.exited until its holds are dropped */
} Holder;

struct HolderRegistry {
        HashMap by_pid;                 /* live holders */
        List holders;                   /* every holder */
        List exited;                    /* exited holders whose holds are still to be dropped */
        unsigned n_holders;
        int epoll_fd;                   /* the pidfds of the live holders */
};

/* Sets up an empty registry. Returns 0 or a negative errno. */
int holder_registry_init(HolderRegistry *r);

/* Frees every holder left (closing their pidfds) and the registry. Their holds must be gone. */
void holder_registry_done(HolderRegistry *r);

/* An fd that becomes readable when a holder's process exits; then call holder_next_exited(). */
int holder_registry_get_fd(const HolderRegistry *r);

/*
 * A connection of process `pid` of user `u` came: the holder for it (the live
 * one with that pid, or a new one watching `pidfd`), with one more
 * connection. Takes `pidfd` (closed when an existing holder is used, and on
 * failure). A live process whose uid changed is refused with -EPERM; a new
 * process over its user's MaxProcesses= with -EDQUOT (*ret_quota says so).
 * Returns 0 or a negative errno.
 */
int holder_connect(HolderRegistry *r, User *u, pid_t pid, gid_t gid, int pidfd, Holder **ret, UserQuota *ret_quota);

/* One connection of the holder closed; it is forgotten when nothing refers to it any more. */
void holder_disconnect(Holder *h);

/*
 * After a restart: the holder for a process that held leases before, if it is
 * the same process (pid and start time) and alive. Returns 1 with *ret, 0 when
 * it is gone, or a negative errno.
 */
int holder_restore(HolderRegistry *r, User *u, pid_t pid, gid_t gid, uint64_t start_time, Holder **ret);

/*
 * Marks the holders whose process has exited (non-blocking epoll_wait()s)
 * and returns the first exited holder whose holds are still to be dropped, or
 * NULL. The caller drops them and calls holder_reaped().
 */
Holder *holder_next_exited(HolderRegistry *r);

/* Marks a holder exited, as when its pidfd becomes readable (the fuzz target's way to end a holder that is
 * the fuzzer itself). */
void holder_exited(Holder *h);

/* The exited holder's holds are gone: it is forgotten once its last connection closes. */
void holder_reaped(Holder *h);

/* Frees the holder if it has no hold, no connection and is not waiting to be reaped. */
void holder_free_if_unused(Holder *h);

/* Whether the holder's process has exited (its pidfd is readable), whether or not it was marked yet. */
bool holder_is_dead(const Holder *h);
