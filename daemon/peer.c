/* SPDX-License-Identifier: MIT */

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/pidfd.h>
#include <unistd.h>

#include "codec.h"
#include "json.h"
#include "macro.h"
#include "manager.h"
#include "message.h"
#include "peer.h"
#include "restore.h"
#include "size.h"

#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77                 /* Linux 6.5; Debian 12's headers predate it */
#endif

/* Reads per wake-up before letting other peers run. */
#define PEER_READS_PER_WAKEUP 16

typedef struct Reply {
        json_object *msg;               /* a whole envelope */
        int fds[POOL_MAX_SLABS];        /* sent with it (borrowed from the slabs) */
        size_t n_fds;
} Reply;

static bool peer_is_admin(const Peer *p) {
        return p->admin;
}

static int reply_params(Reply *r, json_object *params) {
        int k = varlink_reply_new(params, &r->msg);

        json_object_put(params);
        return k;
}

static int reply_invalid(Reply *r, const char *field, const char *message) {
        return vmmb_error_invalid_parameter(field ?: "parameters", message ?: "invalid", &r->msg);
}

/* --- io.vmmbroker ------------------------------------------------------------------------------------- */

/* Answers with a lease and its slabs' fds (Alloc, Attach). */
static int reply_lease(Reply *r, const Lease *l, bool readonly) {
        WireSlab slabs[POOL_MAX_SLABS];
        AllocReply reply = {
                .lease = { .id = (char *)l->id, .device = l->device, .size = l->size,
                           .slabs = slabs, .n_slabs = l->n_slabs, .readonly = readonly },
        };
        json_object *out = NULL;
        int k;

        for (size_t j = 0; j < l->n_slabs; j++) {
                slabs[j] = (WireSlab){ .size = l->slabs[j]->size, .fd = j };
                r->fds[j] = l->slabs[j]->fd;
        }
        k = alloc_reply_encode(&reply, &out);
        if (k == 0)
                k = reply_params(r, out);
        if (k == 0)
                r->n_fds = l->n_slabs;
        return k;
}

static int reply_empty(Reply *r) {
        json_object *out = NULL;
        int k = empty_params_encode(&out);

        return k < 0 ? k : reply_params(r, out);
}

/* A uid from a request: 0..UINT32_MAX-1 ((uid_t)-1 means none to the kernel). */
static bool uid_is_valid(uint64_t uid) {
        return uid < UINT32_MAX;
}

static int method_alloc(Peer *p, json_object *params, Reply *r) {
        _cleanup_free_ char *message = NULL;
        const char *bad = NULL;
        AllocParams a = {};
        PoolDeviceStats s;
        Manager *m = p->manager;
        LeaseQuota quota;
        Lease *l;
        int k, i;

        k = alloc_params_decode(params, &a, &bad, &message);
        if (k < 0) {
                k = k == -EINVAL ? reply_invalid(r, bad, message) : k;
                goto out;
        }
        if (a.device == VMMB_DEVICE_ANY) {
                pool_device_stats(m->pool, 0, &s);
                a.device = s.index;
        }
        i = a.device <= INT32_MAX ? pool_find_device(m->pool, (int)a.device) : -1;
        if (i < 0) {
                k = vmmb_error_no_such_device(a.device, &r->msg);
                goto out;
        }
        pool_device_stats(m->pool, (size_t)i, &s);

        k = lease_new(&m->leases, p->holder, p->user, (int)a.device, a.size, a.label, &l, &quota);
        /* Slabs released for it (evicted, or rolled back when it failed) hold memory until pool_idle() closes
         * their fds: outside this request, but soon, whether it succeeded or not. */
        manager_schedule_idle(m);
        if (k == -EDQUOT) {
                user_quota_message(p->user, quota.what, s.index, quota.asked, quota.limit, quota.current, &message);
                k = vmmb_error_quota_exceeded(user_resource_name(quota.what), quota.limit, quota.current,
                                              message ?: "over a limit", &r->msg);
        } else if (k == POOL_E_TOO_LARGE) {
                char b1[FORMAT_SIZE_MAX], b2[FORMAT_SIZE_MAX];

                set_message(&message, "%s is more than device %d can serve (capacity %s, at most %d slabs).",
                            format_size(a.size, b1, sizeof(b1)), s.index, format_size(s.capacity, b2, sizeof(b2)),
                            POOL_MAX_SLABS);
                k = vmmb_error_invalid_parameter("size", message ?: "too large", &r->msg);
        } else if (k == POOL_E_NOMEM) {
                uint64_t requested = ALIGN_UP(a.size, s.granularity);
                uint64_t in_use = s.leased + s.scrubbing;
                uint64_t available = s.capacity > in_use ? s.capacity - in_use : 0;

                set_message(&message, "Device %d has no room for %" PRIu64 " bytes now: %s.", s.index, requested,
                            pool_last_error(m->pool));
                k = vmmb_error_out_of_memory(a.device, requested, available, message ?: "out of memory", &r->msg);
        } else if (k == POOL_E_DRIVER)
                k = vmmb_error_driver_error(pool_last_error(m->pool), &r->msg);
        else if (k == 0) {
                k = reply_lease(r, l, false);
                if (k < 0)
                        lease_free(&m->leases, l);
                manager_notify_status(m);
        }
out:
        alloc_params_done(&a);
        return k;
}

static int method_free(Peer *p, json_object *params, Reply *r) {
        _cleanup_free_ char *message = NULL;
        const char *bad = NULL;
        FreeParams a = {};
        Hold *hold;
        int k;

        k = free_params_decode(params, &a, &bad, &message);
        if (k < 0) {
                k = k == -EINVAL ? reply_invalid(r, bad, message) : k;
                goto out;
        }
        hold = hold_find(p->holder, a.id);
        if (!hold) {
                k = vmmb_error_no_such_lease(a.id, &r->msg);
                goto out;
        }
        hold_unref(&p->manager->leases, hold);
        manager_schedule_idle(p->manager);
        manager_notify_status(p->manager);
        k = reply_empty(r);
out:
        free_params_done(&a);
        return k;
}

static int method_share(Peer *p, json_object *params, Reply *r) {
        _cleanup_free_ char *message = NULL;
        const char *bad = NULL;
        ShareParams a = {};
        json_object *out = NULL;
        Token *tok;
        Hold *hold;
        int k;

        k = share_params_decode(params, &a, &bad, &message);
        if (k < 0) {
                k = k == -EINVAL ? reply_invalid(r, bad, message) : k;
                goto out;
        }
        if (a.uid != JSON_ABSENT && !uid_is_valid((uint64_t)a.uid)) {
                k = reply_invalid(r, "uid", "A uid is at most 4294967294.");
                goto out;
        }
        hold = hold_find(p->holder, a.id);
        if (!hold) {
                k = vmmb_error_no_such_lease(a.id, &r->msg);
                goto out;
        }
        if (hold->readonly && !a.readonly) {
                set_message(&message, "This process holds lease %s read-only: it can only share it read-only.",
                            a.id);
                k = vmmb_error_permission_denied(message ?: "read-only", &r->msg);
                goto out;
        }
        k = lease_share(hold->lease, a.uid == JSON_ABSENT ? UID_ANY : (uid_t)a.uid, p->cred.uid, a.readonly, &tok);
        if (k == -EDQUOT) {
                set_message(&message, "Lease %s has %u share tokens already: revoke one first.", a.id,
                            hold->lease->n_tokens);
                k = vmmb_error_quota_exceeded("tokens", LEASE_TOKENS_MAX, hold->lease->n_tokens,
                                              message ?: "too many tokens", &r->msg);
                goto out;
        }
        if (k < 0)
                goto out;
        k = share_reply_encode(&(ShareReply){ .token = tok->token }, &out);
        if (k == 0)
                k = reply_params(r, out);
        if (k < 0)
                token_free(tok);
out:
        share_params_done(&a);
        return k;
}

static int method_revoke(Peer *p, json_object *params, Reply *r) {
        _cleanup_free_ char *message = NULL;
        const char *bad = NULL;
        RevokeParams a = {};
        Token *tok;
        int k;

        k = revoke_params_decode(params, &a, &bad, &message);
        if (k < 0) {
                k = k == -EINVAL ? reply_invalid(r, bad, message) : k;
                goto out;
        }
        tok = token_find(&p->manager->leases, a.token);
        if (!tok) {
                k = vmmb_error_no_such_token(&r->msg);
                goto out;
        }
        if (p->cred.uid != tok->lease->uid && p->cred.uid != tok->creator && !peer_is_admin(p)) {
                k = vmmb_error_permission_denied("Only the lease's owner, the token's maker or an administrator "
                                                 "can revoke a token.", &r->msg);
                goto out;
        }
        token_free(tok);
        k = reply_empty(r);
out:
        revoke_params_done(&a);
        return k;
}

static int method_attach(Peer *p, json_object *params, Reply *r) {
        _cleanup_free_ char *message = NULL;
        LeaseTable *t = &p->manager->leases;
        const char *bad = NULL;
        AttachParams a = {};
        bool readonly = false;
        Lease *l;
        Hold *hold;
        int k;

        k = attach_params_decode(params, &a, &bad, &message);
        if (k < 0) {
                k = k == -EINVAL ? reply_invalid(r, bad, message) : k;
                goto out;
        }
        if (a.token) {
                Token *tok = token_find(t, a.token);

                if (!tok) {
                        k = vmmb_error_no_such_token(&r->msg);
                        goto out;
                }
                if (tok->uid != UID_ANY && tok->uid != p->cred.uid) {
                        set_message(&message, "This token is for uid %u only.", (unsigned)tok->uid);
                        k = vmmb_error_permission_denied(message ?: "the token is for another user", &r->msg);
                        goto out;
                }
                l = tok->lease;
                readonly = tok->readonly;
        } else {
                l = lease_find_name(t, a.name);
                if (!l) {
                        k = vmmb_error_no_such_name(a.name, &r->msg);
                        goto out;
                }
                if (!lease_name_allows(l, p->cred.uid)) {
                        set_message(&message, "Lease '%s' is not published to uid %u.", a.name,
                                    (unsigned)p->cred.uid);
                        k = vmmb_error_permission_denied(message ?: "not published to this user", &r->msg);
                        goto out;
                }
                readonly = l->name_readonly;
        }
        k = lease_attach(t, l, p->holder, readonly || a.readonly, &hold);
        if (k < 0)
                goto out;
        k = reply_lease(r, l, hold->readonly);
        if (k < 0)
                hold_unref(t, hold);
        manager_notify_status(p->manager);
out:
        attach_params_done(&a);
        return k;
}

static int method_publish(Peer *p, json_object *params, Reply *r) {
        _cleanup_free_ char *message = NULL;
        uid_t uids[VMMB_PUBLISH_UIDS_MAX];
        const char *bad = NULL;
        PublishParams a = {};
        Hold *hold;
        int k;

        k = publish_params_decode(params, &a, &bad, &message);
        if (k < 0) {
                k = k == -EINVAL ? reply_invalid(r, bad, message) : k;
                goto out;
        }
        for (size_t i = 0; i < a.n_uids; i++) {
                if (!uid_is_valid(a.uids[i])) {
                        k = reply_invalid(r, "uids", "A uid is at most 4294967294.");
                        goto out;
                }
                uids[i] = (uid_t)a.uids[i];
        }
        hold = hold_find(p->holder, a.id);
        if (!hold) {
                k = vmmb_error_no_such_lease(a.id, &r->msg);
                goto out;
        }
        if (p->cred.uid != hold->lease->uid || hold->readonly) {
                set_message(&message, "Only a read-write holder of the lease's owner (uid %u) can publish it.",
                            (unsigned)hold->lease->uid);
                k = vmmb_error_permission_denied(message ?: "not the owner", &r->msg);
                goto out;
        }
        k = lease_publish(&p->manager->leases, hold->lease, a.name, uids, a.n_uids, a.readonly);
        if (k == -EEXIST)
                k = vmmb_error_name_in_use(a.name, &r->msg);
        else if (k == -EBUSY) {
                set_message(&message, "Lease %s is published as '%s' already: unpublish it first.", a.id,
                            hold->lease->name);
                k = reply_invalid(r, "name", message);
        } else if (k == 0) {
                manager_notify_status(p->manager);
                k = reply_empty(r);
        }
out:
        publish_params_done(&a);
        return k;
}

static int method_unpublish(Peer *p, json_object *params, Reply *r) {
        _cleanup_free_ char *message = NULL;
        const char *bad = NULL;
        UnpublishParams a = {};
        Lease *l;
        int k;

        k = unpublish_params_decode(params, &a, &bad, &message);
        if (k < 0) {
                k = k == -EINVAL ? reply_invalid(r, bad, message) : k;
                goto out;
        }
        l = lease_find_name(&p->manager->leases, a.name);
        if (!l) {
                k = vmmb_error_no_such_name(a.name, &r->msg);
                goto out;
        }
        if (p->cred.uid != l->uid && !peer_is_admin(p)) {
                set_message(&message, "Only the lease's owner (uid %u) or an administrator can unpublish '%s'.",
                            (unsigned)l->uid, a.name);
                k = vmmb_error_permission_denied(message ?: "not the owner", &r->msg);
                goto out;
        }
        lease_unpublish(&p->manager->leases, l);
        manager_schedule_idle(p->manager);
        manager_notify_status(p->manager);
        k = reply_empty(r);
out:
        unpublish_params_done(&a);
        return k;
}

static void user_to_wire(const Manager *m, const User *u, WireUserDevice *devices, WireUser *ret) {
        for (size_t i = 0; i < m->users.n_devices; i++) {
                PoolDeviceStats s;

                pool_device_stats(m->pool, i, &s);
                devices[i] = (WireUserDevice){ .index = s.index, .bytes = u->bytes[i], .max_bytes = u->max_bytes[i] };
        }
        *ret = (WireUser){
                .uid = u->uid,
                .leases = u->leases,
                .max_leases = u->max_leases,
                .connections = u->connections,
                .max_connections = u->max_connections,
                .requests = u->requests,
                .devices = m->users.n_devices > 0 ? devices : NULL,
                .n_devices = m->users.n_devices,
        };
}

static int method_users(Peer *p, json_object *params, Reply *r) {
        _cleanup_free_ char *message = NULL;
        _cleanup_free_ WireUserDevice *devices = NULL;
        _cleanup_free_ WireUser *users = NULL;
        Manager *m = p->manager;
        size_t n_dev = m->users.n_devices;
        const char *bad = NULL;
        ListParams a = {};
        UsersReply reply = {};
        json_object *out = NULL;
        User *u;
        int k;

        k = list_params_decode(params, &a, &bad, &message);
        if (k < 0)
                return k == -EINVAL ? reply_invalid(r, bad, message) : k;
        if (a.all && !peer_is_admin(p))
                return vmmb_error_permission_denied("Showing every user needs an administrator.", &r->msg);
        users = calloc(m->users.n_users ?: 1, sizeof(*users));
        devices = calloc((m->users.n_users ?: 1) * (n_dev ?: 1), sizeof(*devices));
        if (!users || !devices)
                return -ENOMEM;
        list_for_each_entry(u, &m->users.users, link) {
                if (!a.all && u != p->user)
                        continue;
                user_to_wire(m, u, devices + reply.n_users * n_dev, &users[reply.n_users]);
                reply.n_users++;
        }
        reply.users = users;
        k = users_reply_encode(&reply, &out);
        return k < 0 ? k : reply_params(r, out);
}

/* Whether a non-administrator's List shows the lease: its user owns it or holds it. */
static bool lease_visible_to(const Lease *l, uid_t uid) {
        const Hold *hold;

        if (l->uid == uid)
                return true;
        list_for_each_entry(hold, &l->holds, link_lease)
                if (hold->holder->uid == uid)
                        return true;
        return false;
}

static int method_list(Peer *p, json_object *params, Reply *r) {
        _cleanup_free_ char *message = NULL;
        _cleanup_free_ WireLeaseInfo *infos = NULL;
        _cleanup_free_ WireHolder *holders = NULL;
        LeaseTable *t = &p->manager->leases;
        const char *bad = NULL;
        ListParams a = {};
        json_object *out = NULL;
        ListReply reply = {};
        size_t n_holds = 0, used = 0;
        Lease *l;
        int k;

        k = list_params_decode(params, &a, &bad, &message);
        if (k < 0)
                return k == -EINVAL ? reply_invalid(r, bad, message) : k;
        if (a.all && !peer_is_admin(p))
                return vmmb_error_permission_denied("Listing every user's leases needs an administrator.", &r->msg);

        list_for_each_entry(l, &t->leases, link_table)
                n_holds += l->n_holds;
        infos = calloc(t->n_leases ?: 1, sizeof(*infos));
        holders = calloc(n_holds ?: 1, sizeof(*holders));
        if (!infos || !holders)
                return -ENOMEM;
        list_for_each_entry(l, &t->leases, link_table) {
                WireLeaseInfo *info;
                Hold *hold;

                if (!a.all && !lease_visible_to(l, p->cred.uid))
                        continue;
                info = &infos[reply.n_leases++];
                *info = (WireLeaseInfo){
                        .id = l->id,
                        .device = l->device,
                        .size = l->size,
                        .slabs = l->n_slabs,
                        .pid = l->pid,
                        .uid = l->uid,
                        .comm = l->comm[0] ? (char *)l->comm : NULL,
                        .label = l->label,
                        .created = (int64_t)l->created_usec,
                        .name = l->name,
                        .holders = holders + used,
                };
                list_for_each_entry(hold, &l->holds, link_lease)
                        holders[used++] = (WireHolder){
                                .pid = hold->holder->pid,
                                .uid = hold->holder->uid,
                                .comm = hold->holder->comm[0] ? hold->holder->comm : NULL,
                                .readonly = hold->readonly,
                        };
                info->n_holders = (size_t)(holders + used - info->holders);
                if (info->n_holders == 0)
                        info->holders = NULL;
        }
        reply.leases = infos;
        k = list_reply_encode(&reply, &out);
        return k < 0 ? k : reply_params(r, out);
}

static int method_status(Peer *p, json_object *params, Reply *r) {
        _cleanup_free_ char *message = NULL;
        Manager *m = p->manager;
        size_t n = pool_n_devices(m->pool);
        _cleanup_free_ WireDevice *devices = NULL;
        PoolDeviceStats stats[64];
        const char *bad = NULL;
        StatusReply reply = {};
        json_object *out = NULL;
        Lease *l;
        int k;

        k = empty_params_decode(params, &bad, &message);
        if (k < 0)
                return k == -EINVAL ? reply_invalid(r, bad, message) : k;
        n = MIN(n, ELEMENTSOF(stats));
        devices = calloc(n, sizeof(*devices));
        if (!devices)
                return -ENOMEM;
        for (size_t i = 0; i < n; i++) {
                pool_device_stats(m->pool, i, &stats[i]);
                devices[i] = (WireDevice){
                        .index = stats[i].index,
                        .name = (char *)stats[i].name,
                        .total = stats[i].total,
                        .granularity = stats[i].granularity,
                        .capacity = stats[i].capacity,
                        .leased = stats[i].leased,
                        .scrubbing = stats[i].scrubbing,
                        .cached = stats[i].cached,
                };
        }
        list_for_each_entry(l, &m->leases.leases, link_table) {
                int i = pool_find_device(m->pool, l->device);

                if (i >= 0 && (size_t)i < n)
                        devices[i].leases++;
        }
        reply.devices = devices;
        reply.n_devices = n;
        k = status_reply_encode(&reply, &out);
        return k < 0 ? k : reply_params(r, out);
}

/* --- org.varlink.service ------------------------------------------------------------------------------ */

static int method_get_info(Peer *p, json_object *params, Reply *r) {
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

static int method_get_interface_description(Peer *p, json_object *params, Reply *r) {
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

static const struct {
        const char *name;
        int (*handler)(Peer *p, json_object *params, Reply *r);
        bool changes;                   /* may change the lease table: store it again (restore.h) */
} methods[] = {
        { VMMB_METHOD_ALLOC, method_alloc, true },
        { VMMB_METHOD_FREE, method_free, true },
        { VMMB_METHOD_LIST, method_list, false },
        { VMMB_METHOD_SHARE, method_share, true },
        { VMMB_METHOD_REVOKE, method_revoke, true },
        { VMMB_METHOD_ATTACH, method_attach, true },
        { VMMB_METHOD_PUBLISH, method_publish, true },
        { VMMB_METHOD_UNPUBLISH, method_unpublish, true },
        { VMMB_METHOD_STATUS, method_status, false },
        { VMMB_METHOD_USERS, method_users, false },
        { VARLINK_METHOD_GET_INFO, method_get_info, false },
        { VARLINK_METHOD_GET_INTERFACE_DESCRIPTION, method_get_interface_description, false },
};

/* QuotaExceeded for a connection over its user's MaxConnections. */
static int peer_refusal(Peer *p, json_object **ret) {
        _cleanup_free_ char *message = NULL;
        User *u = p->user;

        user_quota_message(u, USER_CONNECTIONS, -1, 1, u->max_connections, u->connections, &message);
        return vmmb_error_quota_exceeded(user_resource_name(USER_CONNECTIONS), u->max_connections, u->connections,
                                         message ?: "too many connections", ret);
}

/* Answers one call. Returns 0, or a negative errno that ends the connection. */
static int peer_dispatch(Peer *p, json_object *msg) {
        VarlinkCall call = {};
        Reply r = { .n_fds = 0 };
        int k;

        k = varlink_call_parse(msg, &call);
        if (k < 0)
                return k;
        /* Whoever exited before this request was read is gone for it. */
        manager_reap_holders(p->manager);
        if (p->holder->pid == 0) {
                /* Its sender has exited: what it asked for would belong to nobody and never end. */
                varlink_call_done(&call);
                return -ECONNRESET;
        }
        if (p->refused) {
                /* Over MaxConnections: the answer to its first call says why; then the connection closes. */
                k = peer_refusal(p, &r.msg);
                if (k == 0)
                        k = varlink_conn_send(p->conn, r.msg, NULL, 0);
                json_object_put(r.msg);
                varlink_call_done(&call);
                return k;
        }
        k = varlink_error_method_not_found(call.method, &r.msg);
        for (size_t i = 0; i < ELEMENTSOF(methods); i++)
                if (strcmp(call.method, methods[i].name) == 0) {
                        json_object_put(r.msg);
                        r.msg = NULL;
                        k = methods[i].handler(p, call.parameters, &r);
                        /* Stored before the reply goes out: a crash after the client learns of a change must
                         * not lose it (restore.h). A refused request changed nothing (every method is
                         * transactional), so its error reply costs no write. */
                        if (methods[i].changes && k == 0 && !json_object_object_get_ex(r.msg, "error", NULL)) {
                                restore_state_changed(p->manager);
                                restore_save_state(p->manager);
                        }
                        break;
                }
        if (k == 0 && r.msg && !call.oneway)
                k = varlink_conn_send(p->conn, r.msg, r.fds, r.n_fds);
        json_object_put(r.msg);
        varlink_call_done(&call);
        return k;
}

/* Answers buffered calls until none is left or a reply waits to be written. */
static int peer_process(Peer *p) {
        for (;;) {
                json_object *msg = NULL;
                int k;

                if (varlink_conn_pending(p->conn) > 0) {
                        k = varlink_conn_flush(p->conn);
                        if (k == -EAGAIN)
                                return 0;
                        if (k < 0)
                                return k;
                        if (p->refused)
                                return -ECONNRESET;     /* it has its answer */
                }
                k = varlink_conn_next_json(p->conn, &msg, NULL, NULL);
                if (k <= 0)
                        return k;
                k = peer_dispatch(p, msg);
                json_object_put(msg);
                if (k < 0)
                        return k;
        }
}

static int on_reply_timeout(sd_event_source *s, uint64_t usec, void *userdata) {
        Peer *p = userdata;

        fprintf(stderr, "Closing the connection of pid %d (uid %u): %s for %g s (ReplyTimeout=).\n",
                (int)p->cred.pid, (unsigned)p->cred.uid,
                p->refused ? "over its user's MaxConnections= and silent" : "it left a reply unread",
                (double)p->manager->reply_timeout_usec / 1e6);
        peer_free(p);
        return 0;
}

/* Arms the reply timer from now, or stops it. */
static void peer_set_timer(Peer *p, bool on) {
        uint64_t now;

        if (!on) {
                (void)sd_event_source_set_enabled(p->reply_timer, SD_EVENT_OFF);
                return;
        }
        if (sd_event_now(p->manager->event, CLOCK_MONOTONIC, &now) < 0)
                return;
        (void)sd_event_source_set_time(p->reply_timer, now + p->manager->reply_timeout_usec);
        (void)sd_event_source_set_enabled(p->reply_timer, SD_EVENT_ONESHOT);
}

/*
 * A queued reply is a request in flight, charged to the user; while there is one, the connection has
 * ReplyTimeout= to read it. (A refused connection's timer runs from the start: it must speak or go.)
 */
static void peer_update_request(Peer *p) {
        bool pending = varlink_conn_pending(p->conn) > 0;

        if (pending == p->charged_request)
                return;
        p->charged_request = pending;
        if (pending)
                p->user->requests++;
        else
                p->user->requests--;
        if (!p->refused)
                peer_set_timer(p, pending);
}

static int on_peer_io(sd_event_source *s, int fd, uint32_t revents, void *userdata) {
        Peer *p = userdata;
        int k = 0;

        for (unsigned i = 0; i < PEER_READS_PER_WAKEUP; i++) {
                k = peer_process(p);
                if (k < 0 || varlink_conn_pending(p->conn) > 0)
                        break;
                k = varlink_conn_read(p->conn);
                if (k == -EAGAIN) {
                        k = 0;
                        break;
                }
                if (k <= 0) {
                        k = k ?: -ECONNRESET;   /* end of stream */
                        break;
                }
        }
        /* The last read's requests: if it emptied the socket, nothing else would wake us for them. */
        if (k > 0)
                k = peer_process(p);
        if (k == 0 && (revents & EPOLLHUP) && varlink_conn_pending(p->conn) == 0)
                k = -ECONNRESET;
        if (k < 0) {
                peer_free(p);
                return 0;
        }
        /* Wait for the client to read before answering more: nothing piles up in the daemon. */
        (void)sd_event_source_set_io_events(s, varlink_conn_pending(p->conn) > 0 ? EPOLLOUT : EPOLLIN);
        peer_update_request(p);
        return 0;
}

static int peer_pidfd(int fd, pid_t pid) {
        socklen_t len = sizeof(int);
        int pidfd = -EBADF;

        if (getsockopt(fd, SOL_SOCKET, SO_PEERPIDFD, &pidfd, &len) == 0 && pidfd >= 0)
                return pidfd;
        /* Older kernels: open it by pid right after accept, before the client can have exited and been
         * replaced (its connection keeps nothing alive, so this is a small window, not none). */
        pidfd = pidfd_open(pid, 0);
        return pidfd < 0 ? -errno : pidfd;
}

/* The peer's groups when it connected (SO_PEERGROUPS) and its primary group. *ret is malloc'd. */
static int peer_groups(int sock, gid_t primary, gid_t **ret, size_t *ret_n) {
        _cleanup_free_ gid_t *groups = NULL;
        socklen_t len = 0;
        gid_t *all;
        size_t n;

        /* Asked with too small a buffer, the kernel says ERANGE and how much it needs. */
        while (getsockopt(sock, SOL_SOCKET, SO_PEERGROUPS, groups, &len) < 0) {
                if (errno != ERANGE)
                        return -errno;
                free(groups);
                groups = malloc(len);
                if (!groups)
                        return -ENOMEM;
        }
        n = len / sizeof(gid_t);
        all = realloc(TAKE_PTR(groups), (n + 1) * sizeof(gid_t));
        if (!all)
                return -ENOMEM;
        all[n] = primary;
        *ret = all;
        *ret_n = n + 1;
        return 0;
}

/* Root, or a member (primary or supplementary) of the configured administrators' group. */
static bool peer_check_admin(const Peer *p, const gid_t *gids, size_t n_gids) {
        const Manager *m = p->manager;

        if (p->cred.uid == 0)
                return true;
        if (!m->has_admin_group)
                return false;
        for (size_t i = 0; i < n_gids; i++)
                if (gids[i] == m->admin_gid)
                        return true;
        return false;
}

int peer_new(Manager *m, int fd) {
        socklen_t len = sizeof(struct ucred);
        _cleanup_close_ int sock = fd, pidfd = -EBADF;
        _cleanup_free_ gid_t *gids = NULL;
        size_t n_gids = 0;
        Peer *p;
        bool created;
        int k;

        p = calloc(1, sizeof(*p));
        if (!p)
                return -ENOMEM;
        p->manager = m;
        list_init(&p->link);
        if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &p->cred, &len) < 0 || p->cred.pid <= 0) {
                k = -errno ?: -EPROTO;
                goto fail;
        }
        k = peer_groups(sock, p->cred.gid, &gids, &n_gids);
        if (k < 0)
                goto fail;
        p->admin = peer_check_admin(p, gids, n_gids);
        p->user = user_get(&m->users, p->cred.uid, gids, n_gids);
        if (!p->user) {
                k = -ENOMEM;
                goto fail;
        }
        /* Over the limit, the connection is kept just long enough to say why (peer_refusal()). */
        p->refused = user_charge(p->user, USER_CONNECTIONS, 0, 1, NULL, NULL) < 0;
        k = sd_event_add_time(m->event, &p->reply_timer, CLOCK_MONOTONIC, UINT64_MAX, 0, on_reply_timeout, p);
        if (k < 0)
                goto fail;
        peer_set_timer(p, p->refused);
        pidfd = peer_pidfd(sock, p->cred.pid);
        if (pidfd < 0) {
                k = pidfd;
                goto fail;
        }
        k = lease_table_get_holder(&m->leases, p->cred.pid, p->cred.uid, p->cred.gid, pidfd, &p->holder, &created);
        if (k < 0)
                goto fail;
        pidfd = -EBADF;                 /* the table has it (or closed it) */
        p->holder->n_connections++;
        if (created) {
                k = manager_watch_holder(m, p->holder);
                if (k < 0)
                        goto fail;
        }
        k = varlink_conn_new(&p->conn, sock, VARLINK_MAX_REQUEST, false);
        if (k < 0)
                goto fail;
        sock = -EBADF;
        k = sd_event_add_io(m->event, &p->io, varlink_conn_get_fd(p->conn), EPOLLIN, on_peer_io, p);
        if (k < 0)
                goto fail;
        list_link_tail(&m->peers, &p->link);
        m->n_peers++;
        return 0;

fail:
        peer_free(p);
        return k;
}

Peer *peer_free(Peer *p) {
        if (!p)
                return NULL;
        if (list_is_linked(&p->link)) {
                list_unlink(&p->link);
                p->manager->n_peers--;
        }
        sd_event_source_disable_unref(p->io);
        sd_event_source_disable_unref(p->reply_timer);
        varlink_conn_free(p->conn);
        if (p->holder)
                manager_release_holder(p->manager, p->holder);
        if (p->user) {
                if (p->charged_request)
                        p->user->requests--;
                if (!p->refused)
                        user_uncharge(p->user, USER_CONNECTIONS, 0, 1);
                user_unref(&p->manager->users, p->user);
        }
        free(p);
        return NULL;
}
