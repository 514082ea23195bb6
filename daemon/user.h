/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Per-user accounting, in the manner of dbus-broker's: every resource a
 * client can make the daemon hold is charged to the uid of the process that
 * asked, never to its connection, so that opening more connections never
 * raises a cap.
 *
 * Charged to a user:
 *   - bytes, per device: the leases it owns (made with Alloc; published ones
 *     included, as they outlive their holders);
 *   - leases it owns;
 *   - connections its processes have open;
 *   - requests: replies queued for its connections that they have not read
 *     (at most one per connection: a connection's further requests wait in its
 *     own socket, so this is bounded by the connections).
 *
 * Limits come from the configuration: [Limits] for every user, [Group:NAME]
 * for members of a group (the most generous matching group wins, key by
 * key), [User:NAME] for one user (it beats the groups). A user's limits are
 * resolved when it first connects, from the groups its process had then.
 *
 * A charge over a limit fails and changes nothing; the caller answers
 * QuotaExceeded with user_quota_message()'s sentence.
 */

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "list.h"

#define USER_DEFAULT_MAX_BYTES_PERCENT 80       /* of each device's capacity */
#define USER_DEFAULT_MAX_LEASES 1024
#define USER_DEFAULT_MAX_CONNECTIONS 64

/* Which keys a [User:] or [Group:] section sets. */
enum {
        LIMIT_MAX_BYTES = 1 << 0,
        LIMIT_MAX_LEASES = 1 << 1,
        LIMIT_MAX_CONNECTIONS = 1 << 2,
};

typedef struct UserLimits {
        uint64_t max_bytes;             /* per device; 0: max_bytes_percent of the device's capacity */
        unsigned max_bytes_percent;     /* 1-100, when max_bytes is 0 */
        unsigned max_leases;
        unsigned max_connections;
        unsigned set;                   /* LIMIT_* bits: the keys a section set ([Limits] sets all) */
} UserLimits;

/* A [User:] or [Group:] section. */
typedef struct LimitsRule {
        bool group;                     /* a [Group:] section, else [User:] */
        uint32_t id;                    /* the uid or gid */
        char *name;                     /* as written in the file */
        UserLimits limits;
} LimitsRule;

typedef struct LimitsConfig {
        UserLimits defaults;            /* [Limits] */
        LimitsRule *rules;
        size_t n_rules;
} LimitsConfig;

/* [Limits] at its defaults. */
UserLimits user_limits_default(void);

/* The resources a charge can fail on, as QuotaExceeded names them. */
typedef enum UserResource {
        USER_BYTES,
        USER_LEASES,
        USER_CONNECTIONS,
} UserResource;

typedef struct User {
        uid_t uid;
        unsigned n_refs;
        uint64_t *bytes;                /* per device, in pool order */
        uint64_t *max_bytes;            /* per device, resolved */
        unsigned leases, max_leases;
        unsigned connections, max_connections;
        unsigned requests;
        bool groups_known;              /* limits resolved with the groups of a connected process */
        List link;                      /* in UserRegistry.users */
} User;

typedef struct UserRegistry {
        const LimitsConfig *config;
        size_t n_devices;
        uint64_t *capacity;             /* per device, in pool order */
        List users;
        unsigned n_users;
} UserRegistry;

/* Sets up a registry for devices of these capacities (copied). Returns 0 or -ENOMEM. */
int user_registry_init(UserRegistry *r, const LimitsConfig *config, const uint64_t *capacity, size_t n_devices);
void user_registry_done(UserRegistry *r);

/*
 * The user `uid`, with a new reference: the one already known, or a new one
 * whose limits are resolved from `gids` (its process's groups). Returns NULL
 * when out of memory.
 */
User *user_get(UserRegistry *r, uid_t uid, const gid_t *gids, size_t n_gids);
User *user_ref(User *u);
/* Drops a reference; the user is forgotten when none is left. Accepts NULL. */
void user_unref(UserRegistry *r, User *u);

/*
 * Charges one of a resource (bytes: `bytes` of device `device`). Returns 0,
 * or -EDQUOT and changes nothing when it would go over the user's limit;
 * then *ret_limit and *ret_current (if given) say what they are.
 */
int user_charge(User *u, UserResource what, size_t device, uint64_t bytes, uint64_t *ret_limit,
                uint64_t *ret_current);
/* Charges even over the limit: for leases restored after a restart, which were within it when made. */
void user_charge_anyway(User *u, UserResource what, size_t device, uint64_t amount);

/* Gives back what user_charge() took. */
void user_uncharge(User *u, UserResource what, size_t device, uint64_t bytes);

/* "bytes", "leases" or "connections". */
const char *user_resource_name(UserResource what);

/*
 * The sentence for a refused charge, e.g. "User 1000 owns 3 GiB of device 0
 * and may own at most 4 GiB: 2 GiB more is over the limit (MaxBytes= in
 * vmmbroker.conf)." Sets *ret (NULL if out of memory).
 */
void user_quota_message(const User *u, UserResource what, int device, uint64_t asked, uint64_t limit,
                        uint64_t current, char **ret);
