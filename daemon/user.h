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
 *   - host bytes, per device: its parked leases, charged instead of their
 *     device bytes;
 *   - leases it owns;
 *   - connections its processes have open;
 *   - processes: its holders, of which the daemon keeps a pidfd;
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
#define USER_DEFAULT_MAX_HOST_BYTES_PERCENT 50  /* of each device's host capacity, for parked leases */
#define USER_DEFAULT_MAX_LEASES 1024
#define USER_DEFAULT_MAX_CONNECTIONS 64
#define USER_DEFAULT_MAX_PROCESSES 256  /* processes the daemon keeps a pidfd of (holders) */

/* Which keys a [User:] or [Group:] section sets. */
enum {
        LIMIT_MAX_BYTES = 1 << 0,
        LIMIT_MAX_LEASES = 1 << 1,
        LIMIT_MAX_CONNECTIONS = 1 << 2,
        LIMIT_MAX_PROCESSES = 1 << 3,
        LIMIT_MAX_HOST_BYTES = 1 << 4,
};

typedef struct UserLimits {
        uint64_t max_bytes;             /* per device; 0: max_bytes_percent of the device's capacity */
        unsigned max_bytes_percent;     /* 1-100, when max_bytes is 0 */
        uint64_t max_host_bytes;        /* per device, of parked leases; 0: max_host_bytes_percent */
        unsigned max_host_bytes_percent; /* 1-100 of the device's host capacity, when max_host_bytes is 0 */
        unsigned max_leases;
        unsigned max_connections;
        unsigned max_processes;
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
        char *file;                     /* the configuration file read, for messages; NULL when none existed */
} LimitsConfig;

/* [Limits] at its defaults. */
UserLimits user_limits_default(void);

/* What is charged to a user, as QuotaExceeded names them. */
typedef enum UserResource {
        USER_BYTES,                     /* per device */
        USER_LEASES,
        USER_CONNECTIONS,
        USER_REQUESTS,                  /* replies queued and not read: no limit of its own (one per connection) */
        USER_PROCESSES,                 /* holders: processes the daemon keeps a pidfd of */
        USER_HOST_BYTES,                /* per device: host memory holding the user's parked leases */
        _USER_RESOURCE_MAX,
} UserResource;

typedef struct UserRegistry UserRegistry;

typedef struct User {
        UserRegistry *registry;
        uid_t uid;
        unsigned n_refs;
        uint64_t *bytes;                /* per device, in pool order */
        uint64_t *max_bytes;            /* per device, resolved */
        uint64_t *host_bytes;           /* per device: parked leases the user owns, in host memory */
        uint64_t *max_host_bytes;       /* per device, resolved */
        unsigned leases, max_leases;
        unsigned connections, max_connections;
        unsigned processes, max_processes;
        unsigned requests;
        unsigned refused;               /* connections over max_connections waiting to be told so (peer.c) */
        bool groups_known;              /* limits resolved with the groups of a connected process */
        char *name;                     /* its user name, looked up once (user_name()); "" when it has none */
        List link;                      /* in UserRegistry.users */

        /* Indexes kept by the lease layer (lease.c), so that what a call costs is what its caller may see. */
        List owned;                     /* Lease.link_owner: the leases this user owns */
        List holders;                   /* Holder.link_user: this user's processes that hold or connect */

        /* The manager's fair queue (manager.c): peers of this user with requests waiting to be served. */
        List ready_peers;               /* Peer.link_ready */
        List link_ready;                /* in Manager.ready_users while ready_peers is not empty */
} User;

struct UserRegistry {
        const LimitsConfig *config;
        size_t n_devices;
        uint64_t *capacity;             /* per device, in pool order */
        uint64_t *host_capacity;        /* per device: host memory for parked leases */
        List users;
        unsigned n_users;
};

/*
 * A charge: what one object took from one user, as a record. The object that
 * was charged keeps it and releases exactly it with user_charge_release(), so
 * nothing can be given back twice or by someone else. A charge holds a
 * reference on its user. A zeroed charge (USER_CHARGE_NULL) holds nothing.
 */
typedef struct UserCharge {
        User *user;                     /* NULL: nothing charged */
        UserResource what;
        size_t device;                  /* for USER_BYTES and USER_HOST_BYTES */
        uint64_t amount;
} UserCharge;

#define USER_CHARGE_NULL ((UserCharge){})

/* A refused charge, for the QuotaExceeded answer. */
typedef struct UserQuota {
        UserResource what;
        uint64_t asked, limit, current;
} UserQuota;

/* Sets up a registry for devices of these capacities, device and host (copied; host_capacity NULL: none).
 * Returns 0 or -ENOMEM. */
int user_registry_init(UserRegistry *r, const LimitsConfig *config, const uint64_t *capacity,
                       const uint64_t *host_capacity, size_t n_devices);

/* Frees the registry. Every user must be gone (every charge released, every reference dropped): it asserts so. */
void user_registry_done(UserRegistry *r);

/*
 * The user `uid`, with a new reference: the one already known, or a new one
 * whose limits are resolved from `gids` (its process's groups). Returns NULL
 * when out of memory.
 */
User *user_get(UserRegistry *r, uid_t uid, const gid_t *gids, size_t n_gids);
User *user_ref(User *u);
/* Drops a reference; the user is forgotten when none is left (its usage must then be zero). Accepts NULL;
 * returns NULL. */
User *user_unref(User *u);

/*
 * Charges `amount` of a resource (bytes of pool device `device` for
 * USER_BYTES and USER_HOST_BYTES; 1 for the others) to `u` and records it in *charge, which must
 * be empty. The limit:
 *
 *     usage + amount <= limit         (computed without overflow)
 *
 * with the user's resolved MaxBytes= or MaxHostBytes= for the device, MaxLeases=,
 * MaxConnections= or MaxProcesses=; USER_REQUESTS has none. Returns 0, or -EDQUOT and changes
 * nothing when it would go over; then *ret_quota (if given) says what.
 */
int user_charge(User *u, UserCharge *charge, UserResource what, size_t device, uint64_t amount,
                UserQuota *ret_quota);

/* The same, even over the limit: for leases restored after a restart, which were within it when made. */
void user_charge_anyway(User *u, UserCharge *charge, UserResource what, size_t device, uint64_t amount);

/* Gives back exactly what the charge took and empties it. Accepts an empty charge. */
void user_charge_release(UserCharge *charge);

/*
 * The user's name, as replies give it (Lease.owner_name): looked up once per User with getpwuid_r() and
 * kept while the daemon knows the user, so that no request pays an NSS lookup. NULL when the uid has no
 * name or the lookup failed (then it is tried again next time); at most `max` bytes, else NULL.
 */
const char *user_name(User *u, size_t max);

/* "bytes", "leases", "connections", "requests", "processes" or "host_bytes". */
const char *user_resource_name(UserResource what);

/*
 * The sentence for a refused charge, e.g. "User 1000 has 3 GiB of device 0
 * and may have at most 4 GiB: 2 GiB more is over the limit (MaxBytes= in
 * /etc/vmmbroker/vmmbroker.conf)." Sets *ret (NULL if out of memory).
 */
void user_quota_message(const User *u, const UserQuota *q, int device, char **ret);
