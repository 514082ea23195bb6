/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The methods of io.vmmbroker and org.varlink.service: each decodes its
 * parameters (proto/codec.c), calls one operation of the broker (broker.c,
 * where the rules are) and encodes its outcome, a reply or a named error.
 * Nothing here decides who may do what, but that Users of every user and
 * Metrics, which read the broker's state with no operation, need an
 * administrator.
 */

#include <json-c/json.h>

#include "broker.h"
#include "codec.h"
#include "varlink.h"

/*
 * An Alloc that waits for room (its wait_usec, when its device has none):
 * what it asked, kept by its connection while it waits in the device's wait
 * queue (Broker.waits, wait.h), and tried again with method_alloc_again().
 */
typedef struct AllocWait {
        AllocParams params;             /* as decoded */
        size_t device;                  /* the pool index of the device it waits on */
        uint64_t wait_usec;             /* how long it may wait: its wait_usec, at most MaxAllocWait=; or, for
                                           a scrub wait, SCRUB_WAIT_USEC */
        bool scrub;                     /* it waits for scrubs to complete, not for room: an Alloc that asked
                                           for no wait, which zeroing longer than the broker's
                                           scrub_wait_bytes stands between it and its memory */
} AllocWait;

/* The longest an Alloc waits for scrubs it did not ask to wait for; then it fails with DriverError. */
#define SCRUB_WAIT_USEC (UINT64_C(30) * 1000000)

AllocWait *alloc_wait_free(AllocWait *w);

/* What a Park waits for, off the loop, before it is made again (MethodReply.wait_host, Peer.host_wait). */
typedef enum HostWait {
        HOST_WAIT_NONE,
        HOST_WAIT_MAKING,               /* host slabs being made (BROKER_E_HOST_MAKING) */
        HOST_WAIT_COPYING,              /* the lease's content being copied into them (BROKER_E_HOST_COPYING) */
        HOST_WAIT_ZEROING,              /* memory being zeroed (BROKER_E_SCRUBBING): a Park's host slabs, an
                                           Unpark's or Attach's device memory */
} HostWait;

typedef struct MethodReply {
        json_object *msg;               /* a whole envelope: a reply or an error */
        VarlinkText text;               /* or, instead of msg, a whole reply written as text (Alloc, Attach,
                                           Unpark, Free, Status, empty replies: *_reply_write()), sent as it is */
        int fds[POOL_MAX_SLABS];        /* sent with it (borrowed from the slabs) */
        size_t n_fds;
        AllocWait *wait;                /* instead of msg: the call waits for room; the caller takes it */
        HostWait wait_host;             /* instead of msg: the call (a Park) waits for host slabs being made or
                                           its copy, to be made again once that is done */
        uint64_t host_ticket;           /* for HOST_WAIT_MAKING: the making it waits for (pool_make_done()) */
} MethodReply;

/* Whether *r holds an answer to send: msg or text. */
static inline bool method_reply_is_set(const MethodReply *r) {
        return r->msg || r->text.len > 0;
}

/* Queues the answer in *r on `conn` with its fds (varlink_conn_send() or varlink_conn_send_text()). */
int method_reply_send(const MethodReply *r, VarlinkConn *conn);

/* The largest text buffer method_reply_done() keeps for the next reply. */
#define METHOD_REPLY_SPARE_MAX (64U * 1024U)

/*
 * A MethodReply to fill whose text is written into *spare's buffer (taken;
 * NULL or an empty one is fine): a daemon answers one call at a time, so one
 * buffer serves every reply and a reply written as text needs no allocation.
 */
static inline MethodReply method_reply_init(VarlinkText *spare) {
        MethodReply r = {};

        if (spare) {
                r.text = *spare;
                r.text.len = 0;
                *spare = (VarlinkText){};
        }
        return r;
}

/*
 * Frees what *r holds (msg, text); not its wait, which the caller takes. Its
 * text buffer goes back to *spare (may be NULL) when that holds none and it
 * is at most METHOD_REPLY_SPARE_MAX bytes.
 */
void method_reply_done(MethodReply *r, VarlinkText *spare);

/* Which try of an Alloc: as it came, again while it waits, when its wait ran out, or as the daemon stops. */
typedef enum AllocTry {
        ALLOC_TRY_FIRST,
        ALLOC_TRY_AGAIN,
        ALLOC_TRY_EXPIRED,
        ALLOC_TRY_STOPPING,             /* not tried: answered OutOfMemory saying the broker is stopping */
} AllocTry;

/*
 * Answers one call of `c`: fills *r (free it with method_reply_done()) and
 * returns 0, or returns a negative errno for a failure of the daemon (the
 * caller closes the connection). An unknown method is answered
 * MethodNotFound. Parameters read as text (call->parameters_text) are decoded
 * from it by Alloc, Free and Status; for the others they are made into
 * call->parameters first.
 */
int method_call(Broker *b, const Caller *c, VarlinkCall *call, MethodReply *r);

/* The answer to `c`'s call that waited off the loop (MethodReply.wait_host) when the daemon stops before what
 * it waited for is done: a Park OutOfHostMemory, an Unpark or Attach OutOfMemory, each saying so and that the
 * lease is as it was; NoSuchLease (NoSuchToken, NoSuchName) if the lease ended meanwhile. Returns 0 or a
 * negative errno. */
int method_wait_stopping(Broker *b, const Caller *c, VarlinkCall *call, json_object **ret);

/*
 * Tries a waiting Alloc again (`how`, `waited_usec` into its wait, for the
 * sentence of the error that ends it). Fills *r as method_call() does when the
 * call is answered: a lease, or the error that ends its wait (OutOfMemory
 * when it expired or the daemon stops, QuotaExceeded when its user's limits
 * no longer allow it, ...). With ALLOC_TRY_AGAIN and still no room, it leaves
 * *r unset (method_reply_is_set()): the call goes on waiting. Returns 0 or a
 * negative errno.
 */
int method_alloc_again(Broker *b, const Caller *c, AllocWait *w, AllocTry how, uint64_t waited_usec,
                       MethodReply *r);
