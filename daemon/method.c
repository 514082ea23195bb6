/* SPDX-License-Identifier: MIT */

#include <errno.h>
#include <inttypes.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "codec.h"
#include "json.h"
#include "macro.h"
#include "message.h"
#include "method.h"
#include "metrics.h"
#include "size.h"

static int reply_params(MethodReply *r, json_object *params) {
        int k = varlink_reply_new(params, &r->msg);

        json_object_put(params);
        return k;
}

static int reply_invalid(MethodReply *r, const char *field, const char *message) {
        return vmmb_error_invalid_parameter(field ?: "parameters", message ?: "invalid", &r->msg);
}

/* After a *_params_decode() failure k: -EINVAL becomes InvalidParameter naming `bad`, anything else stays. */
static int reply_decode_failed(MethodReply *r, int k, const char *bad, const char *message) {
        return k == -EINVAL ? reply_invalid(r, bad, message) : k;
}

/* {"parameters": {}}, written as text. */
static int reply_empty(MethodReply *r) {
        return empty_reply_write(&r->text);
}

/* OWNER of OWNER/NAME: a decimal uid, or a user name looked up. Returns 0, or -ESRCH for no such user. */
static int owner_uid(const char *owner, uid_t *ret) {
        struct passwd pw, *found = NULL;
        char scratch[1024], *end;
        unsigned long v;

        if (owner[0] >= '0' && owner[0] <= '9') {
                errno = 0;
                v = strtoul(owner, &end, 10);
                if (errno != 0 || *end || v >= UINT32_MAX)
                        return -ESRCH;
                *ret = (uid_t)v;
                return 0;
        }
        if (getpwnam_r(owner, &pw, scratch, sizeof(scratch), &found) != 0 || !found)
                return -ESRCH;
        *ret = found->pw_uid;
        return 0;
}

/*
 * The owner and name of Attach's and Unpublish's name: "NAME" is the caller's user's own, "OWNER/NAME"
 * another's. Returns 0, -EINVAL for a malformed one, -ESRCH for an owner that names no user.
 */
static int name_ref(const Caller *c, const char *ref, char *buf, uid_t *ret_owner, const char **ret_name) {
        const char *owner;
        int k = vmmb_lease_name_split(ref, buf, &owner, ret_name);

        if (k < 0)
                return k;
        if (!owner) {
                *ret_owner = c->holder->uid;
                return 0;
        }
        return owner_uid(owner, ret_owner);
}

/* After a name_ref() failure k: a malformed reference is InvalidParameter, an unknown owner NoSuchName. */
static int reply_bad_name_ref(MethodReply *r, int k, const char *ref) {
        return k == -EINVAL ? reply_invalid(r, "name", "A name is NAME or OWNER/NAME: OWNER a user name or "
                                            "uid, NAME 1-128 letters, digits and ._-:@+.")
                            : vmmb_error_no_such_name(ref, &r->msg);
}

/* Answers with a lease, who owns it, and its slabs' fds (Alloc, Attach). */
static int reply_lease(MethodReply *r, const Lease *l, bool readonly) {
        WireSlab slabs[POOL_MAX_SLABS];
        AllocReply reply = {
                .lease = { .id = (char *)l->id, .device = l->device, .size = l->size,
                           .slabs = slabs, .n_slabs = l->n_slabs, .owner = l->uid,
                           .owner_name = (char *)user_name(l->charge_lease.user, VMMB_USER_NAME_MAX),
                           .readonly = readonly },
        };
        int k;

        for (size_t j = 0; j < l->n_slabs; j++) {
                slabs[j] = (WireSlab){ .size = l->slabs[j]->size, .fd = j };
                r->fds[j] = l->slabs[j]->fd;
        }
        k = alloc_reply_write(&reply, &r->text);
        if (k == 0)
                r->n_fds = l->n_slabs;
        return k;
}

/* A uid from a request: 0..UINT32_MAX-1 ((uid_t)-1 means none to the kernel). */
static bool uid_is_valid(uint64_t uid) {
        return uid < UINT32_MAX;
}

/*
 * The named error for a broker outcome that needs nothing but the outcome and
 * what the call named (`what`: a lease id, token or name). Outcomes with
 * details of their own (QUOTA, TOO_LARGE, NO_MEMORY) are answered by their
 * method.
 */
static int reply_outcome(Broker *b, MethodReply *r, int k, const char *what) {
        _cleanup_free_ char *message = NULL;

        switch (k) {
        case BROKER_E_NO_SUCH_LEASE:
                return vmmb_error_no_such_lease(what, &r->msg);
        case BROKER_E_NO_SUCH_TOKEN:
                return vmmb_error_no_such_token(&r->msg);
        case BROKER_E_NO_SUCH_NAME:
                return vmmb_error_no_such_name(what, &r->msg);
        case BROKER_E_NAME_IN_USE:
                return vmmb_error_name_in_use(what, &r->msg);
        case BROKER_E_HAS_NAME:
                set_message(&message, "Lease %s is published under another name already: unpublish it first.",
                            what);
                return reply_invalid(r, "name", message);
        case BROKER_E_READONLY:
                set_message(&message, "This process holds lease %s read-only: it can only share it read-only.",
                            what);
                return vmmb_error_permission_denied(message ?: "read-only", &r->msg);
        case BROKER_E_TOKEN_UID:
                return vmmb_error_permission_denied("This token is for another user.", &r->msg);
        case BROKER_E_DRIVER:
                return vmmb_error_driver_error(pool_last_error(b->pool), &r->msg);
        case BROKER_E_NOT_STORED:
                set_message(&message, "The broker could not store this change for a restart (%s), so it did not "
                            "make it; it keeps trying: call again later.",
                            b->store_error < 0 ? strerror(-b->store_error) : pool_last_error(b->pool));
                return vmmb_error_store_failed(message ?: "not stored", &r->msg);
        default:
                return k < 0 ? k : -EPROTO;     /* an outcome this method cannot have */
        }
}

/* --- io.vmmbroker ------------------------------------------------------------------------------------- */

/* "3.2 s", "250 ms", "40 us": how long a call waited, for a sentence. */
static void format_wait(uint64_t usec, char *buf, size_t len) {
        if (usec >= 1000000)
                (void)snprintf(buf, len, "%.1f s", (double)usec / 1e6);
        else if (usec >= 1000)
                (void)snprintf(buf, len, "%" PRIu64 " ms", usec / 1000);
        else
                (void)snprintf(buf, len, "%" PRIu64 " us", usec);
}

/* The first of an Alloc's `devices` that the pool does not serve; -1 when it was asked for any and none is. */
static int64_t unknown_device(Broker *b, const uint64_t *devices, size_t n) {
        for (size_t j = 0; j < n; j++)
                if (devices[j] > INT32_MAX || pool_find_device(b->pool, (int)devices[j]) < 0)
                        return (int64_t)devices[j];
        return VMMB_DEVICE_ANY;
}

/*
 * Parks a first try of an Alloc (r->wait, which the caller takes): in device i's wait queue for `wait_usec`,
 * or, with `scrub`, until the scrubs that stand between it and its memory have completed.
 */
static int alloc_park(MethodReply *r, AllocParams *a, int index, size_t i, uint64_t wait_usec, bool scrub) {
        r->wait = calloc(1, sizeof(AllocWait));
        if (!r->wait)
                return -ENOMEM;
        r->wait->params = *a;   /* it takes the label and the devices */
        *a = (AllocParams){};
        /* It waits, and is tried again, on the device placement picked (broker.h). */
        free(r->wait->params.devices);
        r->wait->params.devices = NULL;
        r->wait->params.n_devices = 0;
        r->wait->params.device = index;
        r->wait->device = i;
        r->wait->wait_usec = wait_usec;
        r->wait->scrub = scrub;
        return 0;
}

/*
 * One try of an Alloc: `how` says whether it is the call as it came (ALLOC_TRY_FIRST), a waiting call tried
 * again, or one whose wait ended (`waited_usec` into its wait). Answers it in *r, or, when the device has no
 * room, leaves *r unset and sets r->wait (a first try that may wait, see AllocWait) or nothing (a waiting
 * call tried again: it goes on waiting).
 */
static int alloc_try(Broker *b, const Caller *c, AllocParams *a, AllocTry how, bool scrub_wait,
                     uint64_t waited_usec, MethodReply *r) {
        char b1[FORMAT_SIZE_MAX], b2[FORMAT_SIZE_MAX], w[32];
        _cleanup_free_ char *message = NULL;
        PoolDeviceStats s = {};
        UserQuota quota = {};
        size_t placed = 0;
        Lease *l;
        int k, i;

        if (how == ALLOC_TRY_STOPPING)
                k = BROKER_E_NO_MEMORY;         /* not tried: the daemon is going away */
        else if (a->device == VMMB_DEVICE_ANY)
                k = broker_alloc_among(b, c, a->devices, a->n_devices, a->size, a->label, &l, &quota, &placed);
        else
                k = broker_alloc(b, c, a->device, a->size, a->label, &l, &quota);
        if (k == BROKER_E_SCRUBBING && how == ALLOC_TRY_EXPIRED && !scrub_wait)
                k = BROKER_E_NO_MEMORY;         /* a call waiting for room, whose time ran out */
        if (a->device == VMMB_DEVICE_ANY)
                i = k == BROKER_E_NO_DEVICE ? -1 : (int)placed;
        else
                i = a->device <= INT32_MAX ? pool_find_device(b->pool, (int)a->device) : -1;
        if (i >= 0 && (size_t)i < pool_n_devices(b->pool))
                pool_device_stats(b->pool, (size_t)i, &s);
        switch (k) {
        case 0:
                return reply_lease(r, l, false);
        case BROKER_E_NO_DEVICE:
                return vmmb_error_no_such_device(a->device != VMMB_DEVICE_ANY ? a->device
                                                 : unknown_device(b, a->devices, a->n_devices), &r->msg);
        case BROKER_E_QUOTA:
                user_quota_message(c->user, &quota, s.index, &message);
                return vmmb_error_quota_exceeded(user_resource_name(quota.what), quota.limit, quota.current,
                                                 message ?: "over a limit", &r->msg);
        case BROKER_E_TOO_LARGE:
                set_message(&message, "%s is more than device %d can serve (capacity %s, at most %d slabs).",
                            format_size(a->size, b1, sizeof(b1)), s.index, format_size(s.capacity, b2, sizeof(b2)),
                            POOL_MAX_SLABS);
                return vmmb_error_invalid_parameter("size", message ?: "too large", &r->msg);
        case BROKER_E_SCRUBBING:
                if (how == ALLOC_TRY_AGAIN)
                        return 0;               /* its scrubs are not done: it goes on waiting */
                if (how == ALLOC_TRY_FIRST && i >= 0) {
                        /* parked: in its device's queue if it may wait for room, else for the scrubs */
                        uint64_t wait_usec = broker_alloc_wait_usec(b, a->wait_usec, (size_t)i);

                        return alloc_park(r, a, s.index, (size_t)i, wait_usec ?: SCRUB_WAIT_USEC, wait_usec == 0);
                }
                format_wait(waited_usec, w, sizeof(w));
                set_message(&message, "Device %d did not finish zeroing the memory this call needs in %s: the "
                            "device may be stuck. Call again.", s.index, w);
                return vmmb_error_driver_error(message ?: "scrubs not done", &r->msg);
        case BROKER_E_NO_MEMORY: {
                uint64_t requested = ALIGN_UP(a->size, s.granularity ?: 1);
                uint64_t available = s.capacity > s.leased ? s.capacity - s.leased : 0;        /* scrubbing: room */
                uint64_t wait_usec = broker_alloc_wait_usec(b, a->wait_usec, i >= 0 ? (size_t)i : SIZE_MAX);

                if (how == ALLOC_TRY_AGAIN && !scrub_wait)
                        return 0;               /* it goes on waiting */
                if (how == ALLOC_TRY_FIRST && wait_usec > 0 && i >= 0)
                        return alloc_park(r, a, s.index, (size_t)i, wait_usec, false);
                format_wait(waited_usec, w, sizeof(w));
                if (how == ALLOC_TRY_STOPPING)
                        set_message(&message, "Device %d had no room for %" PRIu64 " bytes, and the broker is "
                                    "stopping: it waited %s for room. Call again once the broker is back.",
                                    s.index, requested, w);
                else if (how == ALLOC_TRY_EXPIRED)
                        set_message(&message, "Device %d has no room for %" PRIu64 " bytes now: %s. It waited %s "
                                    "for room to come back (wait_usec, at most MaxAllocWait=).", s.index,
                                    requested, pool_last_error(b->pool), w);
                else
                        set_message(&message, "Device %d has no room for %" PRIu64 " bytes now: %s.", s.index,
                                    requested, pool_last_error(b->pool));
                return vmmb_error_out_of_memory(s.index, requested, available, message ?: "out of memory", &r->msg);
        }
        default:
                return reply_outcome(b, r, k, NULL);
        }
}

static int method_alloc(Broker *b, const Caller *c, const VarlinkCall *call, MethodReply *r) {
        _cleanup_free_ char *message = NULL;
        const char *bad = NULL;
        AllocParams a = {};
        int k;

        k = VARLINK_PARAMETERS_DECODE(alloc_params, call, &a, &bad, &message);
        if (k < 0)
                return reply_decode_failed(r, k, bad, message);
        k = alloc_try(b, c, &a, ALLOC_TRY_FIRST, false, 0, r);
        alloc_params_done(&a);
        return k;
}

int method_alloc_again(Broker *b, const Caller *c, AllocWait *w, AllocTry how, uint64_t waited_usec,
                       MethodReply *r) {
        return alloc_try(b, c, &w->params, how, w->scrub, waited_usec, r);
}

AllocWait *alloc_wait_free(AllocWait *w) {
        if (!w)
                return NULL;
        alloc_params_done(&w->params);
        free(w);
        return NULL;
}

static int method_free(Broker *b, const Caller *c, const VarlinkCall *call, MethodReply *r) {
        _cleanup_free_ char *message = NULL;
        const char *bad = NULL;
        FreeParams a = {};
        int k;

        k = VARLINK_PARAMETERS_DECODE(free_params, call, &a, &bad, &message);
        if (k < 0)
                k = reply_decode_failed(r, k, bad, message);
        else {
                FreeReply reply = {};

                k = broker_free(b, c, a.id, a.keep, &reply.kept);
                if (k == 0 && !a.keep)
                        k = reply_empty(r);     /* as it always was: `kept` answers a keep */
                else if (k == 0)
                        k = free_reply_write(&reply, &r->text);
                else
                        k = reply_outcome(b, r, k, a.id);
        }
        free_params_done(&a);
        return k;
}

static int method_set_reclaimable(Broker *b, const Caller *c, json_object *params, MethodReply *r) {
        _cleanup_free_ char *message = NULL;
        const char *bad = NULL;
        SetReclaimableParams a = {};
        int k;

        k = set_reclaimable_params_decode(params, &a, &bad, &message);
        if (k < 0)
                return reply_decode_failed(r, k, bad, message);
        k = broker_set_reclaimable(b, c, a.id, a.priority);
        if (k == BROKER_E_NOT_OWNER)
                k = vmmb_error_permission_denied("Only a process of the lease's owner may mark it reclaimable.",
                                                 &r->msg);
        else if (k == BROKER_E_READONLY) {
                set_message(&message, "This process holds lease %s read-only: it cannot offer it back.", a.id);
                k = vmmb_error_permission_denied(message ?: "read-only", &r->msg);
        } else
                k = k == 0 ? reply_empty(r) : reply_outcome(b, r, k, a.id);
        set_reclaimable_params_done(&a);
        return k;
}

/*
 * The answer to a Park, Unpark, or Attach of a parked lease that found no room: QuotaExceeded (the owner's
 * limit: the lease is charged to its owner whoever asks), OutOfMemory (device memory, to unpark) or
 * OutOfHostMemory (host memory, to park).
 */
static int reply_no_room(Broker *b, MethodReply *r, int k, const Lease *l, const UserQuota *quota) {
        _cleanup_free_ char *message = NULL;
        char b1[FORMAT_SIZE_MAX];
        PoolDeviceStats s;
        uint64_t available;

        pool_device_stats(b->pool, l->pool_device, &s);
        switch (k) {
        case BROKER_E_QUOTA: {
                const User *owner = l->parked ? l->charge_host.user : l->charge_bytes.user;

                user_quota_message(owner, quota, l->device, &message);
                return vmmb_error_quota_exceeded(user_resource_name(quota->what), quota->limit, quota->current,
                                                 message ?: "over a limit", &r->msg);
        }
        case BROKER_E_NO_MEMORY:
        case BROKER_E_TOO_LARGE:
                available = s.capacity > s.leased ? s.capacity - s.leased : 0;
                set_message(&message, "Device %d has no room to bring lease %s (%s) back from host memory now: %s. "
                            "It stays parked; unpark it later.", l->device, l->id,
                            format_size(l->size, b1, sizeof(b1)), pool_last_error(b->pool));
                return vmmb_error_out_of_memory(l->device, l->size, available, message ?: "out of memory", &r->msg);
        case BROKER_E_NO_HOST_MEMORY:
                available = s.host_capacity > s.parked ? s.host_capacity - s.parked : 0;
                set_message(&message, "Lease %s (%s) cannot be parked: %s. HostCapacity= in vmmbroker.conf sets the "
                            "host memory each device may use for parked leases.", l->id,
                            format_size(l->size, b1, sizeof(b1)), pool_last_error(b->pool));
                return vmmb_error_out_of_host_memory(l->device, l->size, available, message ?: "no host memory",
                                                     &r->msg);
        default:
                return reply_outcome(b, r, k, l->id);
        }
}

/* A Park, Unpark or Attach that waits off the loop for host slabs being made or zeroed, or a copy: no answer
 * yet, the call is made again (peer_host_try()). Whether `k` says so. */
static bool reply_waits(MethodReply *r, int k) {
        if (k == BROKER_E_HOST_MAKING)
                r->wait_host = HOST_WAIT_MAKING;
        else if (k == BROKER_E_SCRUBBING)
                r->wait_host = HOST_WAIT_ZEROING;       /* a Park's host slabs, an Unpark's device memory */
        else if (k == BROKER_E_HOST_COPYING)
                r->wait_host = HOST_WAIT_COPYING;
        return r->wait_host != HOST_WAIT_NONE;
}

static int method_park(Broker *b, const Caller *c, json_object *params, MethodReply *r) {
        _cleanup_free_ char *message = NULL;
        const char *bad = NULL;
        UserQuota quota = {};
        FreeParams a = {};
        json_object *out = NULL;
        ParkReply reply = {};
        int k;

        k = id_params_decode(params, &a, &bad, &message);
        if (k < 0)
                return reply_decode_failed(r, k, bad, message);
        k = broker_park(b, c, a.id, &reply.parked, &quota, &r->host_ticket);
        if (reply_waits(r, k))
                k = 0;
        else if (k == 0) {
                k = park_reply_encode(&reply, &out);
                if (k == 0)
                        k = reply_params(r, out);
        } else if (k == BROKER_E_NOT_OWNER)
                k = vmmb_error_permission_denied("Only a process of the lease's owner may park it: parking "
                                                 "spends the owner's host memory.", &r->msg);
        else if (k == BROKER_E_READONLY) {
                set_message(&message, "This process holds lease %s read-only: it cannot park it.", a.id);
                k = vmmb_error_permission_denied(message ?: "read-only", &r->msg);
        } else if (k == BROKER_E_QUOTA || k == BROKER_E_NO_HOST_MEMORY)
                k = reply_no_room(b, r, k, lease_table_find(&b->leases, a.id), &quota);
        else
                k = reply_outcome(b, r, k, a.id);
        free_params_done(&a);
        return k;
}

/* The lease a waiting Attach named (by token, or by name as `c` would see it), or NULL. */
static Lease *attach_lease(Broker *b, const Caller *c, const AttachParams *a) {
        char buf[VMMB_LEASE_NAME_REF_MAX + 1];
        const char *name = NULL;
        uid_t owner = UID_ANY;
        Token *tok;

        if (a->token) {
                tok = lease_table_find_token(&b->leases, a->token);
                return tok ? tok->lease : NULL;
        }
        if (!a->name || name_ref(c, a->name, buf, &owner, &name) < 0)
                return NULL;
        return lease_table_find_name(&b->leases, owner, name);
}

int method_wait_stopping(Broker *b, const Caller *c, VarlinkCall *call, json_object **ret) {
        _cleanup_free_ char *message = NULL, *text = NULL;
        bool attach = strcmp(call->method, VMMB_METHOD_ATTACH) == 0;
        const char *bad = NULL;
        AttachParams at = {};
        FreeParams a = {};
        Lease *l = NULL;
        int k;

        k = varlink_call_parameters(call);
        if (k >= 0 && attach) {
                k = attach_params_decode(call->parameters, &at, &bad, &message);
                if (k >= 0)
                        l = attach_lease(b, c, &at);
        } else if (k >= 0) {
                k = id_params_decode(call->parameters, &a, &bad, &message);
                if (k >= 0)
                        l = lease_table_find(&b->leases, a.id);
        }
        if (!l)         /* it ended meanwhile: say so, as any call about it would */
                k = attach ? (at.token ? vmmb_error_no_such_token(ret) : vmmb_error_no_such_name(at.name ?: "", ret))
                           : vmmb_error_no_such_lease(a.id ?: "", ret);
        else if (strcmp(call->method, VMMB_METHOD_PARK) == 0) {
                set_message(&text, "The broker is stopping: lease %s is not parked (its host memory was being "
                            "made, or its content copied into it). Park it again once the broker is back.", l->id);
                k = vmmb_error_out_of_host_memory(l->device, l->size, 0, text ?: "stopping", ret);
        } else {
                set_message(&text, "The broker is stopping: lease %s was waiting for device memory being zeroed, "
                            "or being copied back into it, and it is still parked. %s it again once the broker is "
                            "back.", l->id, attach ? "Attach" : "Unpark");
                k = vmmb_error_out_of_memory(l->device, l->size, 0, text ?: "stopping", ret);
        }
        attach_params_done(&at);
        free_params_done(&a);
        return k;
}

static int method_unpark(Broker *b, const Caller *c, json_object *params, MethodReply *r) {
        _cleanup_free_ char *message = NULL;
        const char *bad = NULL;
        UserQuota quota = {};
        FreeParams a = {};
        Hold *hold;
        int k;

        k = id_params_decode(params, &a, &bad, &message);
        if (k < 0)
                return reply_decode_failed(r, k, bad, message);
        k = broker_unpark(b, c, a.id, &hold, &quota);
        if (reply_waits(r, k))
                k = 0;
        else if (k == 0)
                k = reply_lease(r, hold->lease, hold->readonly);
        else if (k == BROKER_E_QUOTA || k == BROKER_E_NO_MEMORY || k == BROKER_E_TOO_LARGE)
                k = reply_no_room(b, r, k, lease_table_find(&b->leases, a.id), &quota);
        else
                k = reply_outcome(b, r, k, a.id);
        free_params_done(&a);
        return k;
}

static int method_share(Broker *b, const Caller *c, json_object *params, MethodReply *r) {
        _cleanup_free_ char *message = NULL;
        const char *bad = NULL;
        ShareParams a = {};
        json_object *out = NULL;
        Token *tok;
        int k;

        k = share_params_decode(params, &a, &bad, &message);
        if (k < 0) {
                k = reply_decode_failed(r, k, bad, message);
                goto out;
        }
        if (a.uid != JSON_ABSENT && !uid_is_valid((uint64_t)a.uid)) {
                k = reply_invalid(r, "uid", "A uid is at most 4294967294.");
                goto out;
        }
        k = broker_share(b, c, a.id, a.uid == JSON_ABSENT ? UID_ANY : (uid_t)a.uid, a.readonly, &tok);
        if (k == BROKER_E_NOT_OWNER)
                k = vmmb_error_permission_denied("Only processes of the lease's owner can make tokens for it.",
                                                 &r->msg);
        else if (k == BROKER_E_TOKENS) {
                set_message(&message, "Lease %s has %u share tokens already: revoke one first.", a.id,
                            LEASE_TOKENS_MAX);
                k = vmmb_error_quota_exceeded("tokens", LEASE_TOKENS_MAX, LEASE_TOKENS_MAX,
                                              message ?: "too many tokens", &r->msg);
        } else if (k == 0) {
                k = share_reply_encode(&(ShareReply){ .token = tok->token }, &out);
                if (k == 0)
                        k = reply_params(r, out);
        } else
                k = reply_outcome(b, r, k, a.id);
out:
        share_params_done(&a);
        return k;
}

static int method_revoke(Broker *b, const Caller *c, json_object *params, MethodReply *r) {
        _cleanup_free_ char *message = NULL;
        const char *bad = NULL;
        RevokeParams a = {};
        int k;

        k = revoke_params_decode(params, &a, &bad, &message);
        if (k < 0)
                k = reply_decode_failed(r, k, bad, message);
        else {
                k = broker_revoke(b, c, a.token);
                if (k == 0)
                        k = reply_empty(r);
                else if (k == BROKER_E_NOT_OWNER)
                        k = vmmb_error_permission_denied("Only the lease's owner, the token's maker or an "
                                                         "administrator can revoke a token.", &r->msg);
                else
                        k = reply_outcome(b, r, k, NULL);
        }
        revoke_params_done(&a);
        return k;
}

static int method_attach(Broker *b, const Caller *c, json_object *params, MethodReply *r) {
        _cleanup_free_ char *message = NULL;
        const char *bad = NULL;
        AttachParams a = {};
        Hold *hold;
        int k;

        char buf[VMMB_LEASE_NAME_REF_MAX + 1];
        const char *name = NULL;
        uid_t owner = UID_ANY;

        k = attach_params_decode(params, &a, &bad, &message);
        if (k < 0)
                k = reply_decode_failed(r, k, bad, message);
        else if (!a.token && (k = name_ref(c, a.name, buf, &owner, &name)) < 0)
                k = reply_bad_name_ref(r, k, a.name);
        else {
                UserQuota quota = {};
                Lease *l = NULL;

                k = broker_attach(b, c, a.token, owner, name, a.readonly, &hold, &quota);
                if (reply_waits(r, k))
                        k = 0;
                else if (k == 0)
                        k = reply_lease(r, hold->lease, hold->readonly);
                else if (k == BROKER_E_QUOTA || k == BROKER_E_NO_MEMORY || k == BROKER_E_TOO_LARGE) {
                        /* a parked lease that could not come back: found again for its device and owner */
                        l = a.token ? lease_table_find_token(&b->leases, a.token)->lease
                                    : lease_table_find_name(&b->leases, owner, name);
                        k = reply_no_room(b, r, k, l, &quota);
                } else
                        k = reply_outcome(b, r, k, a.name);
        }
        attach_params_done(&a);
        return k;
}

static int method_publish(Broker *b, const Caller *c, json_object *params, MethodReply *r) {
        _cleanup_free_ char *message = NULL;
        uid_t uids[VMMB_PUBLISH_UIDS_MAX];
        const char *bad = NULL;
        PublishParams a = {};
        int k;

        k = publish_params_decode(params, &a, &bad, &message);
        if (k < 0) {
                k = reply_decode_failed(r, k, bad, message);
                goto out;
        }
        for (size_t i = 0; i < a.n_uids; i++) {
                if (!uid_is_valid(a.uids[i])) {
                        k = reply_invalid(r, "uids", "A uid is at most 4294967294.");
                        goto out;
                }
                uids[i] = (uid_t)a.uids[i];
        }
        k = broker_publish(b, c, a.id, a.name, uids, a.n_uids, a.readonly);
        if (k == 0)
                k = reply_empty(r);
        else if (k == BROKER_E_NOT_OWNER)
                k = vmmb_error_permission_denied("Only a read-write holder of the lease's owner can publish it.",
                                                 &r->msg);
        else
                k = reply_outcome(b, r, k, k == BROKER_E_NO_SUCH_LEASE || k == BROKER_E_HAS_NAME ? a.id : a.name);
out:
        publish_params_done(&a);
        return k;
}

static int method_unpublish(Broker *b, const Caller *c, json_object *params, MethodReply *r) {
        _cleanup_free_ char *message = NULL;
        const char *bad = NULL;
        UnpublishParams a = {};
        int k;

        char buf[VMMB_LEASE_NAME_REF_MAX + 1];
        const char *name = NULL;
        uid_t owner;

        k = unpublish_params_decode(params, &a, &bad, &message);
        if (k < 0)
                k = reply_decode_failed(r, k, bad, message);
        else if ((k = name_ref(c, a.name, buf, &owner, &name)) < 0)
                k = reply_bad_name_ref(r, k, a.name);
        else {
                k = broker_unpublish(b, c, owner, name);
                if (k == 0)
                        k = reply_empty(r);
                else if (k == BROKER_E_NOT_OWNER)
                        k = vmmb_error_permission_denied("Only the lease's owner or an administrator can "
                                                         "unpublish it.", &r->msg);
                else
                        k = reply_outcome(b, r, k, a.name);
        }
        unpublish_params_done(&a);
        return k;
}

/* What Tokens gathers. */
typedef struct TokensBuilder {
        WireToken *tokens;
        size_t n;
} TokensBuilder;

static int tokens_add(const Token *t, void *userdata) {
        TokensBuilder *tb = userdata;

        /* A lease has at most LEASE_TOKENS_MAX: the array has room for them. */
        tb->tokens[tb->n++] = (WireToken){
                .token = (char *)t->token,
                .uid = t->uid == UID_ANY ? JSON_ABSENT : (int64_t)t->uid,
                .creator = t->creator,
                .readonly = t->readonly,
        };
        return 0;
}

static int method_tokens(Broker *b, const Caller *c, json_object *params, MethodReply *r) {
        WireToken tokens[LEASE_TOKENS_MAX];
        _cleanup_free_ char *message = NULL;
        TokensBuilder tb = { .tokens = tokens };
        const char *bad = NULL;
        json_object *out = NULL;
        FreeParams a = {};
        int k;

        k = id_params_decode(params, &a, &bad, &message);
        if (k < 0)
                return reply_decode_failed(r, k, bad, message);
        k = broker_tokens(b, c, a.id, tokens_add, &tb);
        if (k == 0) {
                k = tokens_reply_encode(&(TokensReply){ .tokens = tb.tokens, .n_tokens = tb.n }, &out);
                if (k == 0)
                        k = reply_params(r, out);
        } else if (k == BROKER_E_NOT_OWNER)
                k = vmmb_error_permission_denied("Only processes of the lease's owner and administrators can see "
                                                 "its tokens.", &r->msg);
        else
                k = reply_outcome(b, r, k, a.id);
        free_params_done(&a);
        return k;
}

static void user_to_wire(Broker *b, const User *u, WireUserDevice *devices, WireUser *ret) {
        for (size_t i = 0; i < b->users.n_devices; i++) {
                PoolDeviceStats s;

                pool_device_stats(b->pool, i, &s);
                devices[i] = (WireUserDevice){
                        .index = s.index,
                        .bytes = u->bytes[i],
                        .max_bytes = u->max_bytes[i],
                        .host_bytes = (int64_t)u->host_bytes[i],
                        .max_host_bytes = (int64_t)u->max_host_bytes[i],
                };
        }
        *ret = (WireUser){
                .uid = u->uid,
                .leases = u->leases,
                .max_leases = u->max_leases,
                .connections = u->connections,
                .max_connections = u->max_connections,
                .requests = u->requests,
                .devices = b->users.n_devices > 0 ? devices : NULL,
                .n_devices = b->users.n_devices,
        };
}

static int method_users(Broker *b, const Caller *c, json_object *params, MethodReply *r) {
        _cleanup_free_ char *message = NULL;
        _cleanup_free_ WireUserDevice *devices = NULL;
        _cleanup_free_ WireUser *users = NULL;
        size_t n_dev = b->users.n_devices, n;
        const char *bad = NULL;
        ListParams a = {};
        UsersReply reply = {};
        json_object *out = NULL;
        User *u;
        int k;

        k = list_params_decode(params, &a, &bad, &message);
        if (k < 0)
                return reply_decode_failed(r, k, bad, message);
        if (a.all && !c->admin)
                return vmmb_error_permission_denied("Showing every user needs an administrator.", &r->msg);
        n = a.all ? b->users.n_users : 1;       /* a user's own costs one, whatever the registry holds */
        users = calloc(n ?: 1, sizeof(*users));
        devices = calloc((n ?: 1) * (n_dev ?: 1), sizeof(*devices));
        if (!users || !devices)
                return -ENOMEM;
        if (a.all)
                list_for_each_entry(u, &b->users.users, link) {
                        user_to_wire(b, u, devices + reply.n_users * n_dev, &users[reply.n_users]);
                        reply.n_users++;
                }
        else
                user_to_wire(b, c->user, devices, &users[reply.n_users++]);
        reply.users = users;
        k = users_reply_encode(&reply, &out);
        return k < 0 ? k : reply_params(r, out);
}

/* What List gathers, lease by lease. */
typedef struct ListBuilder {
        WireLeaseInfo *infos;
        size_t n, allocated;
        WireHolder *holders;
        size_t n_holders, holders_allocated;
} ListBuilder;

static int grow(void **p, size_t *allocated, size_t need, size_t size) {
        size_t n = MAX(*allocated * 2, MAX(need, (size_t)16));
        void *q;

        if (need <= *allocated)
                return 0;
        q = reallocarray(*p, n, size);
        if (!q)
                return -ENOMEM;
        *p = q;
        *allocated = n;
        return 0;
}

static int list_add(const Lease *l, void *userdata) {
        ListBuilder *lb = userdata;
        const Hold *hold;
        WireLeaseInfo *info;

        if (grow((void **)&lb->infos, &lb->allocated, lb->n + 1, sizeof(*lb->infos)) < 0 ||
            grow((void **)&lb->holders, &lb->holders_allocated, lb->n_holders + l->n_holds, sizeof(*lb->holders)) < 0)
                return -ENOMEM;
        info = &lb->infos[lb->n++];
        *info = (WireLeaseInfo){
                .id = (char *)l->id,
                .device = l->device,
                .size = l->size,
                .slabs = l->n_slabs,
                .pid = l->pid,
                .uid = l->uid,
                .comm = l->comm[0] ? (char *)l->comm : NULL,
                .label = l->label,
                .created = (int64_t)l->created_usec,
                .name = l->name,
                .n_holders = l->n_holds,
                .reclaim_priority = l->reclaim.state == RECLAIM_MARKED || l->reclaim.state == RECLAIM_ASKED ?
                                    (int64_t)l->reclaim.priority : JSON_ABSENT,
                .reclaim = (char *)reclaim_state_name(l->reclaim.state),
                .parked = l->parked,
                .kept = l->kept,
        };
        /* Holders are placed by index: the array may move while it grows. */
        info->holders = (WireHolder *)(uintptr_t)lb->n_holders;
        list_for_each_entry(hold, &l->holds, link_lease)
                lb->holders[lb->n_holders++] = (WireHolder){
                        .pid = hold->holder->pid,
                        .uid = hold->holder->uid,
                        .comm = hold->holder->comm[0] ? hold->holder->comm : NULL,
                        .readonly = hold->readonly,
                        .parked = hold->parked,
                };
        return 0;
}

static int method_list(Broker *b, const Caller *c, json_object *params, MethodReply *r) {
        _cleanup_free_ char *message = NULL;
        const char *bad = NULL;
        ListParams a = {};
        ListBuilder lb = {};
        ListReply reply = {};
        json_object *out = NULL;
        int k;

        k = list_params_decode(params, &a, &bad, &message);
        if (k < 0)
                return reply_decode_failed(r, k, bad, message);
        k = broker_list(b, c, a.all, list_add, &lb);
        if (k == BROKER_E_NOT_OWNER)
                k = vmmb_error_permission_denied("Listing every user's leases needs an administrator.", &r->msg);
        else if (k == 0) {
                for (size_t i = 0; i < lb.n; i++)
                        lb.infos[i].holders = lb.infos[i].n_holders > 0
                                ? lb.holders + (uintptr_t)lb.infos[i].holders : NULL;
                reply.leases = lb.infos;
                reply.n_leases = lb.n;
                k = list_reply_encode(&reply, &out);
                if (k == 0)
                        k = reply_params(r, out);
        }
        free(lb.infos);
        free(lb.holders);
        return k;
}

/* Devices whose Status is built on the stack; a larger pool's is allocated. */
#define STATUS_STACK_DEVICES 8

static int method_status(Broker *b, const Caller *c, const VarlinkCall *call, MethodReply *r) {
        _cleanup_free_ char *message = NULL;
        size_t n = pool_n_devices(b->pool);
        WireDevice devices_stack[STATUS_STACK_DEVICES];
        PoolDeviceStats stats_stack[STATUS_STACK_DEVICES];
        _cleanup_free_ WireDevice *devices_heap = NULL;
        _cleanup_free_ PoolDeviceStats *stats_heap = NULL;
        WireDevice *devices = devices_stack;
        PoolDeviceStats *stats = stats_stack;
        const char *bad = NULL;
        StatusReply reply = {};
        int k;

        k = VARLINK_PARAMETERS_DECODE(empty_params, call, &bad, &message);
        if (k < 0)
                return reply_decode_failed(r, k, bad, message);
        if (n > STATUS_STACK_DEVICES) {
                devices = devices_heap = calloc(n, sizeof(WireDevice));
                stats = stats_heap = calloc(n, sizeof(PoolDeviceStats));
                if (!devices || !stats)
                        return -ENOMEM;
        }
        for (size_t i = 0; i < n; i++) {
                pool_device_stats(b->pool, i, &stats[i]);
                devices[i] = (WireDevice){
                        .index = stats[i].index,
                        .name = (char *)stats[i].name,
                        .total = stats[i].total,
                        .granularity = stats[i].granularity,
                        .capacity = stats[i].capacity,
                        .leased = stats[i].leased,
                        .scrubbing = stats[i].scrubbing,
                        .cached = stats[i].cached,
                        .leases = b->leases.device_leases[i],
                        .waiters = broker_waiters(b, i),
                        .numa_node = stats[i].numa_node >= 0 ? stats[i].numa_node : JSON_ABSENT,
                        .host_capacity = (int64_t)stats[i].host_capacity,
                        .parked = (int64_t)stats[i].parked,
                        .host_cached = (int64_t)stats[i].host_cached,
                        .kept = (int64_t)b->leases.device_kept[i],
                };
        }
        reply.devices = devices;
        reply.n_devices = n;
        reply.placement = (char *)placement_name(b->placement);
        return status_reply_write(&reply, &r->text);
}

/* Every user's use is in it: for administrators only. Costs O(devices + users x devices), no lease walk. */
static int method_metrics(Broker *b, const Caller *c, json_object *params, MethodReply *r) {
        _cleanup_free_ char *message = NULL, *text = NULL;
        const char *bad = NULL;
        json_object *out = NULL;
        int k;

        k = empty_params_decode(params, &bad, &message);
        if (k < 0)
                return reply_decode_failed(r, k, bad, message);
        if (!c->admin)
                return vmmb_error_permission_denied("The metrics show every user's use: they need an "
                                                    "administrator.", &r->msg);
        k = metrics_format(b, &text);
        if (k < 0)
                return k;
        k = metrics_reply_encode(&(MetricsReply){ .text = text }, &out);
        return k < 0 ? k : reply_params(r, out);
}

/* --- org.varlink.service ------------------------------------------------------------------------------ */

static int method_get_info(Broker *b, const Caller *c, json_object *params, MethodReply *r) {
        _cleanup_free_ char *message = NULL;
        const char *bad = NULL;
        json_object *out = NULL;
        int k;

        k = empty_params_decode(params, &bad, &message);
        if (k < 0)
                return k == -EINVAL ? varlink_error_invalid_parameter(bad ?: "parameters", &r->msg) : k;
        k = varlink_info_encode(&out);
        return k < 0 ? k : reply_params(r, out);
}

static int method_get_interface_description(Broker *b, const Caller *c, json_object *params, MethodReply *r) {
        _cleanup_free_ char *message = NULL;
        InterfaceParams a = {};
        const char *bad = NULL;
        json_object *out = NULL;
        int k;

        k = interface_params_decode(params, &a, &bad, &message);
        if (k < 0)
                return k == -EINVAL ? varlink_error_invalid_parameter(bad ?: "parameters", &r->msg) : k;
        k = interface_description_encode(a.interface, &out);
        if (k == -ENOENT)
                k = varlink_error_interface_not_found(a.interface, &r->msg);
        else if (k == 0)
                k = reply_params(r, out);
        interface_params_done(&a);
        return k;
}

/* Methods whose parameters are read from their text take the call (call_handler); the others, json-c. */
static const struct {
        const char *name;
        int (*handler)(Broker *b, const Caller *c, json_object *params, MethodReply *r);
        int (*call_handler)(Broker *b, const Caller *c, const VarlinkCall *call, MethodReply *r);
} methods[] = {
        { VMMB_METHOD_ALLOC, .call_handler = method_alloc },
        { VMMB_METHOD_FREE, .call_handler = method_free },
        { VMMB_METHOD_SET_RECLAIMABLE, method_set_reclaimable },
        { VMMB_METHOD_PARK, method_park },
        { VMMB_METHOD_UNPARK, method_unpark },
        { VMMB_METHOD_LIST, method_list },
        { VMMB_METHOD_SHARE, method_share },
        { VMMB_METHOD_REVOKE, method_revoke },
        { VMMB_METHOD_ATTACH, method_attach },
        { VMMB_METHOD_PUBLISH, method_publish },
        { VMMB_METHOD_UNPUBLISH, method_unpublish },
        { VMMB_METHOD_STATUS, .call_handler = method_status },
        { VMMB_METHOD_USERS, method_users },
        { VMMB_METHOD_TOKENS, method_tokens },
        { VMMB_METHOD_METRICS, method_metrics },
        { VARLINK_METHOD_GET_INFO, method_get_info },
        { VARLINK_METHOD_GET_INTERFACE_DESCRIPTION, method_get_interface_description },
};

int method_reply_send(const MethodReply *r, VarlinkConn *conn) {
        if (r->msg)
                return varlink_conn_send(conn, r->msg, r->fds, r->n_fds);
        return varlink_conn_send_text(conn, &r->text, r->fds, r->n_fds);
}

void method_reply_done(MethodReply *r, VarlinkText *spare) {
        json_object_put(TAKE_PTR(r->msg));
        if (spare && !spare->data && r->text.alloc <= METHOD_REPLY_SPARE_MAX) {
                *spare = r->text;
                spare->len = 0;
                r->text = (VarlinkText){};
        }
        varlink_text_done(&r->text);
}

int method_call(Broker *b, const Caller *c, VarlinkCall *call, MethodReply *r) {
        int k;

        for (size_t i = 0; i < ELEMENTSOF(methods); i++) {
                if (strcmp(call->method, methods[i].name) != 0)
                        continue;
                if (methods[i].call_handler)
                        return methods[i].call_handler(b, c, call, r);
                k = varlink_call_parameters(call);
                return k < 0 ? k : methods[i].handler(b, c, call->parameters, r);
        }
        return varlink_error_method_not_found(call->method, &r->msg);
}
