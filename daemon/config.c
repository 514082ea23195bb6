/* SPDX-License-Identifier: MIT */

#include <assert.h>
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <grp.h>
#include <inttypes.h>
#include <pwd.h>
#include <stdlib.h>
#include <string.h>
#include <sys/un.h>

#include "config.h"
#include "macro.h"
#include "message.h"
#include "size.h"

#define CONFIG_MAX_LINE 4096

static inline void fclosep(FILE **f) {
        if (*f)
                (void)fclose(*f);
}
#define _cleanup_fclose_ _cleanup_(fclosep)
#define sizeof_field(type, member) sizeof(((type *)NULL)->member)

typedef struct ConfigKey {
        const char *section;
        const char *name;
        /* Sets the key from a trimmed value ("" = the default); -EINVAL with a message naming the problem. */
        int (*parse)(Config *c, const char *value, char **ret_message);
        /* Writes the key's value as the file would take it. */
        void (*print)(const Config *c, FILE *f);
        /* A comment printed above the key, or NULL; optional. */
        const char *(*note)(const Config *c);
} ConfigKey;

/* --- the keys ------------------------------------------------------------------------------------- */

static int parse_socket(Config *c, const char *value, char **ret_message) {
        char *copy = NULL;

        if (*value) {
                if (value[0] != '/')
                        return set_message_error(ret_message, -EINVAL, "expected an absolute path");
                if (strlen(value) >= sizeof_field(struct sockaddr_un, sun_path))
                        return set_message_error(ret_message, -EINVAL,
                                                 "longer than a Unix socket path may be (%zu bytes)",
                                                 sizeof_field(struct sockaddr_un, sun_path) - 1);
                copy = strdup(value);
                if (!copy)
                        return -ENOMEM;
        }
        free(c->socket_path);
        c->socket_path = copy;
        c->manager.socket_path = copy;
        return 0;
}

static void print_socket(const Config *c, FILE *f) {
        fputs(c->socket_path ?: MANAGER_DEFAULT_SOCKET, f);
}

static int parse_devices(Config *c, const char *value, char **ret_message) {
        int devices[CONFIG_MAX_DEVICES];
        size_t n = 0;
        const char *p = value;

        if (*value && strcmp(value, "all") != 0)
                while (*p) {
                        char *end;
                        long v;

                        errno = 0;
                        v = strtol(p, &end, 10);
                        if (!isdigit((unsigned char)*p) || errno != 0 || v >= CONFIG_MAX_DEVICES ||
                            (*end && *end != ',' && !isspace((unsigned char)*end)))
                                return set_message_error(ret_message, -EINVAL,
                                                         "expected \"all\" or CUDA device indices 0-%d "
                                                         "separated by spaces or commas", CONFIG_MAX_DEVICES - 1);
                        for (size_t i = 0; i < n; i++)
                                if (devices[i] == v)
                                        return set_message_error(ret_message, -EINVAL, "device %ld is named twice", v);
                        devices[n++] = (int)v;
                        p = end;
                        while (*p == ',' || isspace((unsigned char)*p))
                                p++;
                }
        memcpy(c->devices, devices, n * sizeof(int));
        c->manager.pool.devices = n > 0 ? c->devices : NULL;
        c->manager.pool.n_devices = n;
        return 0;
}

static void print_devices(const Config *c, FILE *f) {
        if (c->manager.pool.n_devices == 0)
                fputs("all", f);
        for (size_t i = 0; i < c->manager.pool.n_devices; i++)
                fprintf(f, "%s%d", i > 0 ? " " : "", c->devices[i]);
}

/* A size the way a person writes it in the file: the largest suffix that divides it. */
static void print_size(uint64_t bytes, FILE *f) {
        static const char suffixes[] = "KMGT";
        int i = -1;

        while (i < 3 && bytes >= 1024 && bytes % 1024 == 0) {
                bytes /= 1024;
                i++;
        }
        fprintf(f, "%" PRIu64 "%.*s", bytes, i >= 0, i >= 0 ? &suffixes[i] : "");
}

/*
 * A count from 1 to 1000000; "" is `fallback`. 0 is refused with "must be at least 1: " and `why_not_0`,
 * what 0 would do.
 */
static int parse_count(const char *value, unsigned fallback, const char *why_not_0, unsigned *ret,
                       char **ret_message) {
        char *end;
        unsigned long v;

        if (!*value) {
                *ret = fallback;
                return 0;
        }
        errno = 0;
        v = strtoul(value, &end, 10);
        if (!isdigit((unsigned char)value[0]) || errno != 0 || *end || v > 1000000)
                return set_message_error(ret_message, -EINVAL, "expected a number from 1 to 1000000");
        if (v == 0)
                return set_message_error(ret_message, -EINVAL, "must be at least 1: %s", why_not_0);
        *ret = (unsigned)v;
        return 0;
}

/*
 * A size, or a percentage ("N%", 1-100) when the value ends with '%'; empty is 0 and 0. `what` says, in the
 * message for a value that is neither, what a size and a percentage are of ("a size such as 64G, or a
 * percentage of ...").
 */
static int parse_size_or_percent(const char *value, const char *what, uint64_t *ret_bytes, unsigned *ret_percent,
                                 char **ret_message) {
        size_t len = strlen(value);

        *ret_bytes = 0;
        *ret_percent = 0;
        if (len > 0 && value[len - 1] == '%') {
                char *end;
                unsigned long v;

                errno = 0;
                v = strtoul(value, &end, 10);
                if (!isdigit((unsigned char)value[0]) || errno != 0 || end != value + len - 1 || v < 1 || v > 100)
                        return set_message_error(ret_message, -EINVAL, "a percentage must be 1%%-100%%");
                *ret_percent = (unsigned)v;
        } else if (len > 0 && parse_size(value, ret_bytes) < 0)
                return set_message_error(ret_message, -EINVAL, "expected %s", what);
        return 0;
}

static int parse_capacity(Config *c, const char *value, char **ret_message) {
        uint64_t bytes;
        unsigned percent;
        int k = parse_size_or_percent(value, "a size such as 64G, or a percentage of the memory free at start "
                                      "such as 90%", &bytes, &percent, ret_message);

        if (k < 0)
                return k;
        if (*value && bytes == 0 && percent == 0)
                return set_message_error(ret_message, -EINVAL,
                                         "a pool of 0 bytes could lease nothing: set at least a device's "
                                         "allocation granularity (2M on current GPUs), or a percentage");
        c->manager.pool.capacity = bytes;
        c->manager.pool.capacity_percent = percent;
        return 0;
}

static void print_capacity(const Config *c, FILE *f) {
        if (c->manager.pool.capacity > 0)
                print_size(c->manager.pool.capacity, f);
        else
                fprintf(f, "%u%%", c->manager.pool.capacity_percent ?: POOL_DEFAULT_CAPACITY_PERCENT);
}

/* HostCapacity=: a size, a percentage of the physical memory (divided among the devices), or 0: no parking. */
static int parse_host_capacity(Config *c, const char *value, char **ret_message) {
        PoolConfig *pool = &c->manager.pool;
        int k = parse_size_or_percent(value, "a size such as 64G, a percentage of the host's memory such as 25%, "
                                      "or 0 for no parking", &pool->host_capacity, &pool->host_capacity_percent,
                                      ret_message);

        if (k < 0)
                return k;
        pool->no_host = *value && pool->host_capacity == 0 && pool->host_capacity_percent == 0;
        return 0;
}

static void print_host_capacity(const Config *c, FILE *f) {
        const PoolConfig *pool = &c->manager.pool;

        if (pool->no_host)
                fputs("0", f);
        else if (pool->host_capacity > 0)
                print_size(pool->host_capacity, f);
        else
                fprintf(f, "%u%%", pool->host_capacity_percent ?: POOL_DEFAULT_HOST_CAPACITY_PERCENT);
}

/* HostReserve=: a size (checked against HostSlab= and HostCapacity= when the pool starts), or 0: none. */
static int parse_host_reserve(Config *c, const char *value, char **ret_message) {
        uint64_t bytes = 0;

        if (*value && parse_size(value, &bytes) < 0)
                return set_message_error(ret_message, -EINVAL, "expected a size such as 16G (a multiple of HostSlab=), "
                                         "or 0 for none");
        c->manager.pool.host_reserve = bytes;
        return 0;
}

static void print_host_reserve(const Config *c, FILE *f) {
        print_size(c->manager.pool.host_reserve, f);
}

/* HostSlab=: the largest host slab, a power of two (checked against MaxSlab= when the pool starts), or empty. */
static int parse_host_slab(Config *c, const char *value, char **ret_message) {
        uint64_t bytes = 0;

        if (*value && (parse_size(value, &bytes) < 0 || bytes < (UINT64_C(2) << 20) || !IS_POWER_OF_2(bytes)))
                return set_message_error(ret_message, -EINVAL, "expected a power of two of at least 2M, such as 64M");
        c->manager.pool.host_slab = bytes;
        return 0;
}

static void print_host_slab(const Config *c, FILE *f) {
        const PoolConfig *pool = &c->manager.pool;

        print_size(pool_host_slab(pool->max_slab ?: POOL_DEFAULT_MAX_SLAB, pool->host_slab), f);
}

static int parse_max_slab(Config *c, const char *value, char **ret_message) {
        uint64_t bytes = 0;

        if (*value && (parse_size(value, &bytes) < 0 || bytes == 0 || (bytes & (bytes - 1)) != 0))
                return set_message_error(ret_message, -EINVAL, "expected a power of two such as 512M or 1G");
        c->manager.pool.max_slab = bytes;
        return 0;
}

static void print_max_slab(const Config *c, FILE *f) {
        print_size(c->manager.pool.max_slab ?: POOL_DEFAULT_MAX_SLAB, f);
}

static int parse_admin_group(Config *c, const char *value, char **ret_message) {
        struct group g, *found = NULL;
        char buf[16384];
        char *copy = NULL;
        int k;

        if (*value) {
                k = getgrnam_r(value, &g, buf, sizeof(buf), &found);
                if (k != 0)
                        return set_message_error(ret_message, -EINVAL, "cannot look the group up: %s", strerror(k));
                if (!found)
                        return set_message_error(ret_message, -EINVAL, "no such group (create it, e.g. with groupadd "
                                                 "--system %s, or fix the name)", value);
                copy = strdup(value);
                if (!copy)
                        return -ENOMEM;
                c->manager.admin_gid = found->gr_gid;
        }
        free(c->admin_group);
        c->admin_group = copy;
        c->manager.has_admin_group = copy != NULL;
        return 0;
}

static void print_admin_group(const Config *c, FILE *f) {
        fputs(c->admin_group ?: "", f);
}

/* A time as the [Broker] keys take it: "30s", "500ms", "2min", a bare number of seconds. */
static int parse_time(const char *value, uint64_t *ret, char **ret_message) {
        char *end;
        unsigned long long v;
        uint64_t unit;

        errno = 0;
        v = strtoull(value, &end, 10);
        if (strcmp(end, "s") == 0 || !*end)
                unit = 1000000;
        else if (strcmp(end, "ms") == 0)
                unit = 1000;
        else if (strcmp(end, "min") == 0)
                unit = 60000000;
        else
                unit = 0;
        if (!isdigit((unsigned char)value[0]) || errno != 0 || unit == 0 || v > UINT32_MAX)
                return set_message_error(ret_message, -EINVAL, "expected a time such as 30s, 500ms or 2min");
        *ret = v * unit;
        return 0;
}

static void print_time(uint64_t usec, FILE *f) {
        if (usec % 60000000 == 0)
                fprintf(f, "%" PRIu64 "min", usec / 60000000);
        else if (usec % 1000000 == 0)
                fprintf(f, "%" PRIu64 "s", usec / 1000000);
        else
                fprintf(f, "%" PRIu64 "ms", usec / 1000);
}

/*
 * A time-valued key: empty leaves *ret 0 (the key's default); 0 is refused with `zero_refused` when that is not
 * NULL. Returns 0 or a negative errno with a sentence.
 */
static int parse_time_key(const char *value, const char *zero_refused, uint64_t *ret, char **ret_message) {
        uint64_t usec = 0;

        if (*value) {
                int k = parse_time(value, &usec, ret_message);

                if (k < 0)
                        return k;
                if (usec == 0 && zero_refused)
                        return set_message_error(ret_message, -EINVAL, "%s", zero_refused);
        }
        *ret = usec;
        return 0;
}

static int parse_reply_timeout(Config *c, const char *value, char **ret_message) {
        return parse_time_key(value, "must be at least 1ms: with 0 every connection would be closed as soon as a "
                              "reply waited for it", &c->manager.reply_timeout_usec, ret_message);
}

/* Empty: the default; 0: no Alloc waits (MANAGER_ALLOC_WAIT_OFF). */
static int parse_max_alloc_wait(Config *c, const char *value, char **ret_message) {
        int k = parse_time_key(value, NULL, &c->manager.max_alloc_wait_usec, ret_message);

        if (k == 0 && *value && c->manager.max_alloc_wait_usec == 0)
                c->manager.max_alloc_wait_usec = MANAGER_ALLOC_WAIT_OFF;
        return k;
}

static void print_max_alloc_wait(const Config *c, FILE *f) {
        uint64_t usec = manager_max_alloc_wait_usec(&c->manager);

        if (usec == 0)
                fputs("0", f);
        else
                print_time(usec, f);
}

/* Empty: the default, most-free. */
static int parse_placement(Config *c, const char *value, char **ret_message) {
        int rule = *value ? placement_from_name(value) : PLACEMENT_MOST_FREE;

        if (rule < 0)
                return set_message_error(ret_message, -EINVAL, "expected most-free, first or nearest");
        c->manager.placement = (PlacementRule)rule;
        return 0;
}

static void print_placement(const Config *c, FILE *f) {
        fputs(placement_name(c->manager.placement), f);
}

/* Empty: the default (5 s); more than 0. */
static int parse_reclaim_timeout(Config *c, const char *value, char **ret_message) {
        return parse_time_key(value, "must be more than 0: a holder needs time to give memory back",
                              &c->manager.reclaim_timeout_usec, ret_message);
}

static void print_reclaim_timeout(const Config *c, FILE *f) {
        print_time(c->manager.reclaim_timeout_usec ?: RECLAIM_DEFAULT_TIMEOUT_USEC, f);
}

/* Empty: the default, MANAGER_DEFAULT_SCRUB_WAIT_BYTES; 0: no wait for zeroing in the loop (MANAGER_SCRUB_WAIT_NONE),
 * as MaxAllocWait= does. */
static int parse_scrub_wait_bytes(Config *c, const char *value, char **ret_message) {
        uint64_t bytes = 0;

        if (*value && parse_size(value, &bytes) < 0)
                return set_message_error(ret_message, -EINVAL, "expected a size such as 256M, or 0 to wait for no "
                                         "zeroing in the daemon's loop");
        c->manager.scrub_wait_bytes = *value && bytes == 0 ? MANAGER_SCRUB_WAIT_NONE : bytes;
        return 0;
}

static void print_scrub_wait_bytes(const Config *c, FILE *f) {
        print_size(manager_scrub_wait_bytes(&c->manager), f);
}

/* Empty (0): the manager derives it from the fd limit. */
static int parse_max_connections_total(Config *c, const char *value, char **ret_message) {
        return parse_count(value, 0, "with 0 nobody could connect (leave it empty to derive it from the fd limit)",
                           &c->manager.max_connections_total, ret_message);
}

static void print_max_connections_total(const Config *c, FILE *f) {
        if (c->manager.max_connections_total > 0)
                fprintf(f, "%u", c->manager.max_connections_total);
}

static const char *note_max_connections_total(const Config *c) {
        return c->manager.max_connections_total > 0 ? NULL :
               "MaxConnectionsTotal= is empty: derived from the fd limit, RLIMIT_NOFILE / 4 (64-65536)";
}

static void print_reply_timeout(const Config *c, FILE *f) {
        print_time(c->manager.reply_timeout_usec ?: MANAGER_DEFAULT_REPLY_TIMEOUT_USEC, f);
}

/* [Limits], [User:] and [Group:] keys set c->limits, the section being read. */
/* A byte limit per device: a size, or a percentage of each device's `what` ("capacity"); 0 would leave the user
 * nothing to `verb`. */
static int parse_byte_limit(const char *value, uint64_t default_bytes, unsigned default_percent, const char *what,
                            const char *verb, uint64_t *ret_bytes, unsigned *ret_percent, char **ret_message) {
        _cleanup_free_ char *expected = NULL;
        int k;

        if (!*value) {
                *ret_bytes = default_bytes;
                *ret_percent = default_percent;
                return 0;
        }
        if (asprintf(&expected, "a size such as 64G, or a percentage of each device's %s such as 80%%", what) < 0)
                return -ENOMEM;
        k = parse_size_or_percent(value, expected, ret_bytes, ret_percent, ret_message);
        if (k < 0)
                return k;
        if (*ret_bytes == 0 && *ret_percent == 0)
                return set_message_error(ret_message, -EINVAL,
                                         "with 0 the user could %s nothing: set at least a device's "
                                         "allocation granularity (2M on current GPUs), or a percentage", verb);
        return 0;
}

static int parse_max_bytes(Config *c, const char *value, char **ret_message) {
        UserLimits d = user_limits_default();
        int k = parse_byte_limit(value, d.max_bytes, d.max_bytes_percent, "capacity", "lease", &c->limits->max_bytes,
                                 &c->limits->max_bytes_percent, ret_message);

        if (k == 0)
                c->limits->set |= LIMIT_MAX_BYTES;
        return k;
}

static int parse_max_host_bytes(Config *c, const char *value, char **ret_message) {
        UserLimits d = user_limits_default();
        int k = parse_byte_limit(value, d.max_host_bytes, d.max_host_bytes_percent, "host capacity", "park",
                                 &c->limits->max_host_bytes, &c->limits->max_host_bytes_percent, ret_message);

        if (k == 0)
                c->limits->set |= LIMIT_MAX_HOST_BYTES;
        return k;
}

static void print_byte_limit(uint64_t bytes, unsigned percent, FILE *f) {
        if (bytes > 0)
                print_size(bytes, f);
        else
                fprintf(f, "%u%%", percent);
}

static int parse_max_leases(Config *c, const char *value, char **ret_message) {
        int k = parse_count(value, USER_DEFAULT_MAX_LEASES, "with 0 the user could lease nothing",
                            &c->limits->max_leases, ret_message);

        if (k == 0)
                c->limits->set |= LIMIT_MAX_LEASES;
        return k;
}

static int parse_max_connections(Config *c, const char *value, char **ret_message) {
        int k = parse_count(value, USER_DEFAULT_MAX_CONNECTIONS, "with 0 the user could not connect at all",
                            &c->limits->max_connections, ret_message);

        if (k == 0)
                c->limits->set |= LIMIT_MAX_CONNECTIONS;
        return k;
}

static int parse_max_processes(Config *c, const char *value, char **ret_message) {
        int k = parse_count(value, USER_DEFAULT_MAX_PROCESSES,
                            "a process that connects counts, so with 0 the user could not connect at all",
                            &c->limits->max_processes, ret_message);

        if (k == 0)
                c->limits->set |= LIMIT_MAX_PROCESSES;
        return k;
}

/* The [Limits]-style keys, printed for one section: every key for [Limits], the ones set for a rule. */
static void print_limits(const UserLimits *l, FILE *f) {
        if (l->set & LIMIT_MAX_BYTES) {
                fputs("MaxBytes=", f);
                print_byte_limit(l->max_bytes, l->max_bytes_percent, f);
                fputc('\n', f);
        }
        if (l->set & LIMIT_MAX_HOST_BYTES) {
                fputs("MaxHostBytes=", f);
                print_byte_limit(l->max_host_bytes, l->max_host_bytes_percent, f);
                fputc('\n', f);
        }
        if (l->set & LIMIT_MAX_LEASES)
                fprintf(f, "MaxLeases=%u\n", l->max_leases);
        if (l->set & LIMIT_MAX_CONNECTIONS)
                fprintf(f, "MaxConnections=%u\n", l->max_connections);
        if (l->set & LIMIT_MAX_PROCESSES)
                fprintf(f, "MaxProcesses=%u\n", l->max_processes);
}

static const ConfigKey keys[] = {
        { "Broker", "Socket", parse_socket, print_socket },
        { "Broker", "Devices", parse_devices, print_devices },
        { "Broker", "Capacity", parse_capacity, print_capacity },
        { "Broker", "MaxSlab", parse_max_slab, print_max_slab },
        { "Broker", "AdminGroup", parse_admin_group, print_admin_group },
        { "Broker", "ReplyTimeout", parse_reply_timeout, print_reply_timeout },
        { "Broker", "MaxConnectionsTotal", parse_max_connections_total, print_max_connections_total,
          note_max_connections_total },
        { "Broker", "MaxAllocWait", parse_max_alloc_wait, print_max_alloc_wait },
        { "Broker", "Placement", parse_placement, print_placement },
        { "Broker", "ReclaimTimeout", parse_reclaim_timeout, print_reclaim_timeout },
        { "Broker", "HostCapacity", parse_host_capacity, print_host_capacity },
        { "Broker", "HostReserve", parse_host_reserve, print_host_reserve },
        { "Broker", "HostSlab", parse_host_slab, print_host_slab },
        { "Broker", "ScrubWaitBytes", parse_scrub_wait_bytes, print_scrub_wait_bytes },
        /* also valid in [User:NAME] and [Group:NAME]; printed by print_limits() */
        { "Limits", "MaxBytes", parse_max_bytes, NULL },
        { "Limits", "MaxLeases", parse_max_leases, NULL },
        { "Limits", "MaxConnections", parse_max_connections, NULL },
        { "Limits", "MaxProcesses", parse_max_processes, NULL },
        { "Limits", "MaxHostBytes", parse_max_host_bytes, NULL },
};

/* --- the file ------------------------------------------------------------------------------------- */

static const ConfigKey *find_key(const char *section, const char *name) {
        for (size_t i = 0; i < ELEMENTSOF(keys); i++)
                if (strcmp(keys[i].section, section) == 0 && strcmp(keys[i].name, name) == 0)
                        return &keys[i];
        return NULL;
}

static bool known_section(const char *section) {
        for (size_t i = 0; i < ELEMENTSOF(keys); i++)
                if (strcmp(keys[i].section, section) == 0)
                        return true;
        return false;
}

static char *strip(char *s) {
        char *end;

        while (isspace((unsigned char)*s))
                s++;
        end = s + strlen(s);
        while (end > s && isspace((unsigned char)end[-1]))
                *--end = 0;
        return s;
}

/* Sets a key, or says "{where}Key=value: what is wrong". */
static int parse_key(Config *c, const ConfigKey *key, const char *value, const char *where, char **ret_message) {
        _cleanup_free_ char *problem = NULL;
        int k = key->parse(c, value, &problem);

        if (k < 0)
                set_message(ret_message, "%s%s=%s: %s", where, key->name, value, problem ?: strerror(-k));
        return k;
}

/* The rule of a [User:NAME] or [Group:NAME] section: found, or added at the end. */
static int limits_rule(Config *c, bool group, const char *name, char **ret_message) {
        LimitsConfig *lc = &c->manager.limits;
        char buf[16384];
        uint32_t id;
        LimitsRule *rules;
        char *end;
        unsigned long v;

        if (!*name)
                return set_message_error(ret_message, -EINVAL, "[%s:] needs a name or a number", group ? "Group" : "User");
        errno = 0;
        v = strtoul(name, &end, 10);
        if (isdigit((unsigned char)name[0]) && !*end && errno == 0 && v < UINT32_MAX)
                id = (uint32_t)v;
        else if (group) {
                struct group g, *found = NULL;
                int k = getgrnam_r(name, &g, buf, sizeof(buf), &found);

                if (k != 0 || !found)
                        return set_message_error(ret_message, -EINVAL, "[Group:%s]: %s", name,
                                                 k != 0 ? strerror(k) : "no such group");
                id = found->gr_gid;
        } else {
                struct passwd pw, *found = NULL;
                int k = getpwnam_r(name, &pw, buf, sizeof(buf), &found);

                if (k != 0 || !found)
                        return set_message_error(ret_message, -EINVAL, "[User:%s]: %s", name,
                                                 k != 0 ? strerror(k) : "no such user");
                id = found->pw_uid;
        }
        for (size_t i = 0; i < lc->n_rules; i++)
                if (lc->rules[i].group == group && lc->rules[i].id == id) {
                        c->limits = &lc->rules[i].limits;
                        return 0;
                }
        rules = realloc(lc->rules, (lc->n_rules + 1) * sizeof(LimitsRule));
        if (!rules)
                return -ENOMEM;
        lc->rules = rules;
        rules[lc->n_rules] = (LimitsRule){ .group = group, .id = id, .name = strdup(name) };
        if (!rules[lc->n_rules].name)
                return -ENOMEM;
        /* a rule starts from the defaults, and sets only its own keys */
        rules[lc->n_rules].limits = user_limits_default();
        rules[lc->n_rules].limits.set = 0;
        c->limits = &rules[lc->n_rules++].limits;
        return 0;
}

/*
 * Enters a section: sets `section` to the name its keys are looked up under ("Limits" for [User:] and
 * [Group:] too) and, for those, c->limits. Returns 0 or -EINVAL with a message.
 */
static int enter_section(Config *c, const char *header, char *section, size_t section_len, char **ret_message) {
        int k;

        if (strncmp(header, "User:", 5) == 0 || strncmp(header, "Group:", 6) == 0) {
                bool group = header[0] == 'G';

                k = limits_rule(c, group, header + (group ? 6 : 5), ret_message);
                if (k < 0)
                        return k;
                snprintf(section, section_len, "Limits");
                return 0;
        }
        if (!known_section(header))
                return set_message_error(ret_message, -EINVAL,
                                         "unknown section [%s] (known: [Broker], [Limits], [User:NAME], [Group:NAME])",
                                         header);
        if (strcmp(header, "Limits") == 0)
                c->limits = &c->manager.limits.defaults;
        snprintf(section, section_len, "%s", header);
        return 0;
}

/* Applies one line; `section` is the current section's name. Returns 0 or -EINVAL with a message. */
static int parse_line(Config *c, char *line, char *section, size_t section_len, char **ret_message) {
        const ConfigKey *key;
        char *eq, *name;

        line = strip(line);
        if (!*line || *line == '#' || *line == ';')
                return 0;
        if (*line == '[') {
                size_t len = strlen(line);

                if (line[len - 1] != ']' || len < 3)
                        return set_message_error(ret_message, -EINVAL,
                                                 "a section header must be [Name], not \"%s\"", line);
                line[len - 1] = 0;
                return enter_section(c, line + 1, section, section_len, ret_message);
        }
        eq = strchr(line, '=');
        if (!eq)
                return set_message_error(ret_message, -EINVAL,
                                         "expected Key=Value, a [Section] or a comment, not \"%s\"", line);
        *eq = 0;
        name = strip(line);
        if (!*section)
                return set_message_error(ret_message, -EINVAL,
                                         "%s= comes before any section (put it under [Broker])", name);
        key = find_key(section, name);
        if (!key)
                return set_message_error(ret_message, -EINVAL, "unknown key \"%s\" in [%s]", name, section);
        return parse_key(c, key, strip(eq + 1), "", ret_message);
}

static int load_file(Config *c, const char *path, char **ret_message) {
        _cleanup_free_ char *line = NULL, *problem = NULL;
        _cleanup_fclose_ FILE *f = NULL;
        char section[64] = "";                  /* a file starts outside any section */
        size_t size = 0;
        unsigned number = 0;
        ssize_t n;
        int k;

        f = fopen(path, "re");
        if (!f) {
                if (errno == ENOENT)
                        return 0;
                k = -errno;
                set_message(ret_message, "cannot read %s: %s", path, strerror(-k));
                return k;
        }
        if (!c->manager.limits.file) {
                c->manager.limits.file = strdup(path);  /* the limits' messages name it */
                if (!c->manager.limits.file)
                        return -ENOMEM;
        }
        while ((n = getline(&line, &size, f)) >= 0) {
                number++;
                if (n > CONFIG_MAX_LINE)
                        k = set_message_error(&problem, -EINVAL, "line longer than %d bytes", CONFIG_MAX_LINE);
                else if (memchr(line, 0, (size_t)n))
                        k = set_message_error(&problem, -EINVAL, "the line contains a NUL byte");
                else
                        k = parse_line(c, line, section, sizeof(section), &problem);
                if (k < 0) {
                        set_message(ret_message, "%s:%u: %s", path, number, problem ?: strerror(-k));
                        return k;
                }
        }
        if (ferror(f)) {
                k = errno > 0 ? -errno : -EIO;
                set_message(ret_message, "cannot read %s: %s", path, strerror(-k));
                return k;
        }
        return 0;
}

static int is_conf(const struct dirent *d) {
        size_t len = strlen(d->d_name);

        return d->d_name[0] != '.' && len > 5 && strcmp(d->d_name + len - 5, ".conf") == 0;
}

int config_load(Config *c, const char *path, char **ret_message) {
        _cleanup_free_ char *dir = NULL;
        struct dirent **entries = NULL;
        int n, k;

        k = load_file(c, path, ret_message);
        if (k < 0)
                return k;
        if (asprintf(&dir, "%s.d", path) < 0)
                return -ENOMEM;
        n = scandir(dir, &entries, is_conf, alphasort);
        if (n < 0) {
                if (errno == ENOENT || errno == ENOTDIR)
                        return 0;
                k = -errno;
                set_message(ret_message, "cannot read %s: %s", dir, strerror(-k));
                return k;
        }
        for (int i = 0; i < n; i++) {
                _cleanup_free_ char *file = NULL;

                if (k >= 0 && asprintf(&file, "%s/%s", dir, entries[i]->d_name) < 0)
                        k = -ENOMEM;
                if (k >= 0)
                        k = load_file(c, file, ret_message);
                free(entries[i]);
        }
        free(entries);
        return k;
}

int config_set(Config *c, const char *key, const char *value, const char *where, char **ret_message) {
        const ConfigKey *k = find_key("Broker", key);
        _cleanup_free_ char *prefix = NULL;

        assert(k);
        if (asprintf(&prefix, "%s: ", where) < 0)
                return -ENOMEM;
        return parse_key(c, k, value, prefix, ret_message);
}

void config_print(const Config *c, FILE *f) {
        const LimitsConfig *lc = &c->manager.limits;

        fputs("[Broker]\n", f);
        for (size_t i = 0; i < ELEMENTSOF(keys); i++) {
                const char *note = keys[i].note ? keys[i].note(c) : NULL;

                if (!keys[i].print)
                        continue;
                if (note)
                        fprintf(f, "# %s\n", note);
                fprintf(f, "%s=", keys[i].name);
                keys[i].print(c, f);
                fputc('\n', f);
        }
        fputs("\n[Limits]\n", f);
        print_limits(&lc->defaults, f);
        for (size_t i = 0; i < lc->n_rules; i++) {
                fprintf(f, "\n[%s:%s]\n", lc->rules[i].group ? "Group" : "User", lc->rules[i].name);
                print_limits(&lc->rules[i].limits, f);
        }
}

void config_init(Config *c) {
        *c = (Config){};
        c->manager.limits.defaults = user_limits_default();
        c->limits = &c->manager.limits.defaults;
}

void config_done(Config *c) {
        free(c->socket_path);
        free(c->admin_group);
        for (size_t i = 0; i < c->manager.limits.n_rules; i++)
                free(c->manager.limits.rules[i].name);
        free(c->manager.limits.rules);
        free(c->manager.limits.file);
        config_init(c);
}
