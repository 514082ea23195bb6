/* SPDX-License-Identifier: MIT */

#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <inttypes.h>
#include <limits.h>
#include <pwd.h>
#include <stdlib.h>
#include <string.h>

#include "macro.h"
#include "message.h"
#include "size.h"
#include "user.h"

UserLimits user_limits_default(void) {
        return (UserLimits){
                .max_bytes_percent = USER_DEFAULT_MAX_BYTES_PERCENT,
                .max_host_bytes_percent = USER_DEFAULT_MAX_HOST_BYTES_PERCENT,
                .max_leases = USER_DEFAULT_MAX_LEASES,
                .max_connections = USER_DEFAULT_MAX_CONNECTIONS,
                .max_processes = USER_DEFAULT_MAX_PROCESSES,
                .set = LIMIT_MAX_BYTES | LIMIT_MAX_LEASES | LIMIT_MAX_CONNECTIONS | LIMIT_MAX_PROCESSES |
                       LIMIT_MAX_HOST_BYTES,
        };
}

int user_registry_init(UserRegistry *r, const LimitsConfig *config, const uint64_t *capacity,
                       const uint64_t *host_capacity, size_t n_devices) {
        *r = (UserRegistry){ .config = config, .n_devices = n_devices };
        list_init(&r->users);
        r->capacity = calloc(n_devices ?: 1, sizeof(uint64_t));
        r->host_capacity = calloc(n_devices ?: 1, sizeof(uint64_t));
        if (!r->capacity || !r->host_capacity) {
                free(r->capacity);
                free(r->host_capacity);
                return -ENOMEM;
        }
        if (n_devices > 0)
                memcpy(r->capacity, capacity, n_devices * sizeof(uint64_t));
        if (n_devices > 0 && host_capacity)
                memcpy(r->host_capacity, host_capacity, n_devices * sizeof(uint64_t));
        return 0;
}

static bool user_usage_is_zero(const User *u) {
        for (size_t i = 0; i < u->registry->n_devices; i++)
                if (u->bytes[i] != 0 || u->host_bytes[i] != 0)
                        return false;
        return u->leases == 0 && u->connections == 0 && u->requests == 0 && u->processes == 0 && u->refused == 0;
}

static void user_free(UserRegistry *r, User *u) {
        /* Every charge holds a reference: with none left, everything charged must have come back. */
        assert(user_usage_is_zero(u));
        assert(list_is_empty(&u->owned) && list_is_empty(&u->holders) && list_is_empty(&u->ready_peers));
        list_unlink(&u->link);
        r->n_users--;
        free(u->bytes);
        free(u->max_bytes);
        free(u->host_bytes);
        free(u->max_host_bytes);
        free(u->name);
        free(u);
}

void user_registry_done(UserRegistry *r) {
        /* Users go with their last reference; one still here is a reference or a charge never released. */
        assert(r->n_users == 0);
        free(r->capacity);
        free(r->host_capacity);
        *r = (UserRegistry){};
}

/* A limit of bytes: `bytes`, or `percent` of a capacity. */
static uint64_t bytes_limit(uint64_t bytes, unsigned percent, uint64_t capacity) {
        return bytes ?: capacity / 100 * percent + capacity % 100 * percent / 100;
}

/*
 * Applies the keys `mask` of `from` to the user: replacing its values, or, when `generous`, only where
 * `from` gives more.
 */
static void apply(UserRegistry *r, User *u, const UserLimits *from, unsigned mask, bool generous) {
        if (mask & LIMIT_MAX_BYTES)
                for (size_t i = 0; i < r->n_devices; i++) {
                        uint64_t v = bytes_limit(from->max_bytes, from->max_bytes_percent, r->capacity[i]);

                        u->max_bytes[i] = generous ? MAX(u->max_bytes[i], v) : v;
                }
        if (mask & LIMIT_MAX_HOST_BYTES)
                for (size_t i = 0; i < r->n_devices; i++) {
                        uint64_t v = bytes_limit(from->max_host_bytes, from->max_host_bytes_percent,
                                                 r->host_capacity[i]);

                        u->max_host_bytes[i] = generous ? MAX(u->max_host_bytes[i], v) : v;
                }
        if (mask & LIMIT_MAX_LEASES)
                u->max_leases = generous ? MAX(u->max_leases, from->max_leases) : from->max_leases;
        if (mask & LIMIT_MAX_CONNECTIONS)
                u->max_connections = generous ? MAX(u->max_connections, from->max_connections)
                                              : from->max_connections;
        if (mask & LIMIT_MAX_PROCESSES)
                u->max_processes = generous ? MAX(u->max_processes, from->max_processes) : from->max_processes;
}

static bool has_gid(const gid_t *gids, size_t n, gid_t gid) {
        for (size_t i = 0; i < n; i++)
                if (gids[i] == gid)
                        return true;
        return false;
}

/* [Limits]; then, key by key, the most generous of the matching [Group:] sections; then [User:]. */
static void resolve_limits(UserRegistry *r, User *u, const gid_t *gids, size_t n_gids) {
        const LimitsConfig *c = r->config;
        unsigned from_groups = 0;

        apply(r, u, &c->defaults, c->defaults.set, false);
        for (size_t i = 0; i < c->n_rules; i++) {
                const UserLimits *g = &c->rules[i].limits;

                if (!c->rules[i].group || !has_gid(gids, n_gids, c->rules[i].id))
                        continue;
                /* A group's key replaces the default, and is raised by later groups. */
                apply(r, u, g, g->set & ~from_groups, false);
                apply(r, u, g, g->set & from_groups, true);
                from_groups |= g->set;
        }
        for (size_t i = 0; i < c->n_rules; i++)
                if (!c->rules[i].group && c->rules[i].id == u->uid)
                        apply(r, u, &c->rules[i].limits, c->rules[i].limits.set, false);
}

User *user_get(UserRegistry *r, uid_t uid, const gid_t *gids, size_t n_gids) {
        User *u;

        list_for_each_entry(u, &r->users, link)
                if (u->uid == uid) {
                        /* Restored after a restart without its groups: resolve again at its first connection. */
                        if (!u->groups_known && gids) {
                                resolve_limits(r, u, gids, n_gids);
                                u->groups_known = true;
                        }
                        return user_ref(u);
                }
        u = calloc(1, sizeof(*u));
        if (!u)
                return NULL;
        u->bytes = calloc(r->n_devices ?: 1, sizeof(uint64_t));
        u->max_bytes = calloc(r->n_devices ?: 1, sizeof(uint64_t));
        u->host_bytes = calloc(r->n_devices ?: 1, sizeof(uint64_t));
        u->max_host_bytes = calloc(r->n_devices ?: 1, sizeof(uint64_t));
        if (!u->bytes || !u->max_bytes || !u->host_bytes || !u->max_host_bytes) {
                free(u->bytes);
                free(u->max_bytes);
                free(u->host_bytes);
                free(u->max_host_bytes);
                free(u);
                return NULL;
        }
        u->registry = r;
        u->uid = uid;
        u->n_refs = 1;
        list_init(&u->owned);
        list_init(&u->holders);
        list_init(&u->ready_peers);
        list_init(&u->link_ready);
        resolve_limits(r, u, gids, n_gids);
        u->groups_known = gids != NULL;
        list_link_tail(&r->users, &u->link);
        r->n_users++;
        return u;
}

User *user_ref(User *u) {
        if (u)
                u->n_refs++;
        return u;
}

User *user_unref(User *u) {
        if (u && --u->n_refs == 0)
                user_free(u->registry, u);
        return NULL;
}

/* What a user has of a resource now, and may have at most. */
static uint64_t usage_of(const User *u, UserResource what, size_t device, uint64_t *ret_limit) {
        switch (what) {
        case USER_BYTES:
                *ret_limit = u->max_bytes[device];
                return u->bytes[device];
        case USER_HOST_BYTES:
                *ret_limit = u->max_host_bytes[device];
                return u->host_bytes[device];
        case USER_LEASES:
                *ret_limit = u->max_leases;
                return u->leases;
        case USER_CONNECTIONS:
                *ret_limit = u->max_connections;
                return u->connections;
        case USER_PROCESSES:
                *ret_limit = u->max_processes;
                return u->processes;
        default:
                *ret_limit = UINT64_MAX;
                return u->requests;
        }
}

/* Adds or gives back `amount`; asserts that a counter neither wraps nor goes below zero. */
static void add_usage(User *u, UserResource what, size_t device, uint64_t amount, bool give_back) {
        unsigned *counter = what == USER_LEASES ? &u->leases
                          : what == USER_CONNECTIONS ? &u->connections
                          : what == USER_REQUESTS ? &u->requests
                          : what == USER_PROCESSES ? &u->processes : NULL;

        if (!counter) {
                uint64_t *bytes = what == USER_HOST_BYTES ? &u->host_bytes[device] : &u->bytes[device];

                assert(give_back ? *bytes >= amount : *bytes <= UINT64_MAX - amount);
                *bytes = give_back ? *bytes - amount : *bytes + amount;
                return;
        }
        assert(amount == 1 && (give_back ? *counter > 0 : *counter < UINT_MAX));
        *counter = give_back ? *counter - 1 : *counter + 1;
}

int user_charge(User *u, UserCharge *charge, UserResource what, size_t device, uint64_t amount,
                UserQuota *ret_quota) {
        uint64_t limit, current;

        assert(!charge->user);
        if (what != USER_BYTES && what != USER_HOST_BYTES)
                amount = 1;
        current = usage_of(u, what, device, &limit);
        if (amount > limit || current > limit - amount) {
                if (ret_quota)
                        *ret_quota = (UserQuota){ .what = what, .asked = amount, .limit = limit, .current = current };
                return -EDQUOT;
        }
        user_charge_anyway(u, charge, what, device, amount);
        return 0;
}

void user_charge_anyway(User *u, UserCharge *charge, UserResource what, size_t device, uint64_t amount) {
        assert(!charge->user);
        if (what != USER_BYTES && what != USER_HOST_BYTES)
                amount = 1;
        add_usage(u, what, device, amount, false);
        *charge = (UserCharge){ .user = user_ref(u), .what = what, .device = device, .amount = amount };
}

void user_charge_release(UserCharge *charge) {
        if (!charge->user)
                return;
        add_usage(charge->user, charge->what, charge->device, charge->amount, true);
        user_unref(charge->user);
        *charge = USER_CHARGE_NULL;
}

const char *user_name(User *u, size_t max) {
        struct passwd pw, *found = NULL;
        char scratch[1024];

        if (!u->name) {
                if (getpwuid_r(u->uid, &pw, scratch, sizeof(scratch), &found) != 0)
                        return NULL;    /* not cached: the lookup may work next time */
                u->name = strdup(found ? found->pw_name : "");
                if (!u->name)
                        return NULL;
        }
        return *u->name && strlen(u->name) <= max ? u->name : NULL;
}

const char *user_resource_name(UserResource what) {
        static const char *const names[] = {
                [USER_BYTES] = "bytes",
                [USER_LEASES] = "leases",
                [USER_CONNECTIONS] = "connections",
                [USER_REQUESTS] = "requests",
                [USER_PROCESSES] = "processes",
                [USER_HOST_BYTES] = "host_bytes",
        };

        return names[what];
}

/* Where a limit comes from, for its message: "in FILE", or that no file set it. */
static const char *limit_source(const User *u, char *buf, size_t size) {
        const char *file = u->registry && u->registry->config ? u->registry->config->file : NULL;

        if (file)
                snprintf(buf, size, "in %s", file);
        else
                snprintf(buf, size, "at its default: the broker read no configuration file; see vmmbroker.conf(5)");
        return buf;
}

void user_quota_message(const User *u, const UserQuota *q, int device, char **ret) {
        char b1[FORMAT_SIZE_MAX], b2[FORMAT_SIZE_MAX], b3[FORMAT_SIZE_MAX], where[PATH_MAX + 128];
        uint64_t asked = q->asked, limit = q->limit, current = q->current;

        switch (q->what) {
        case USER_BYTES:
                set_message(ret, "User %u has %s of device %d and may have at most %s: %s more is over the limit "
                            "(MaxBytes= %s).", (unsigned)u->uid, format_size(current, b1, sizeof(b1)),
                            device, format_size(limit, b2, sizeof(b2)), format_size(asked, b3, sizeof(b3)),
                            limit_source(u, where, sizeof(where)));
                break;
        case USER_HOST_BYTES:
                set_message(ret, "User %u has %s of parked leases of device %d in host memory and may have at most "
                            "%s: %s more is over the limit (MaxHostBytes= %s).", (unsigned)u->uid,
                            format_size(current, b1, sizeof(b1)), device, format_size(limit, b2, sizeof(b2)),
                            format_size(asked, b3, sizeof(b3)), limit_source(u, where, sizeof(where)));
                break;
        case USER_LEASES:
                set_message(ret, "User %u owns %" PRIu64 " leases and may own at most %" PRIu64 " (MaxLeases= %s): "
                            "free or unpublish one first.", (unsigned)u->uid, current, limit,
                            limit_source(u, where, sizeof(where)));
                break;
        case USER_CONNECTIONS:
                set_message(ret, "User %u has %" PRIu64 " connections open and may have at most %" PRIu64
                            " (MaxConnections= %s): close one first.", (unsigned)u->uid, current, limit,
                            limit_source(u, where, sizeof(where)));
                break;
        case USER_PROCESSES:
                set_message(ret, "User %u has %" PRIu64 " processes known to the broker and may have at most %"
                            PRIu64 " (MaxProcesses= %s): end or free the leases of one first.",
                            (unsigned)u->uid, current, limit, limit_source(u, where, sizeof(where)));
                break;
        default:
                set_message(ret, "User %u is over its limit of %s.", (unsigned)u->uid, user_resource_name(q->what));
                break;
        }
}
