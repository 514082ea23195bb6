/* SPDX-License-Identifier: MIT */

#include <assert.h>
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <grp.h>
#include <inttypes.h>
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

static int parse_capacity(Config *c, const char *value, char **ret_message) {
        size_t len = strlen(value);
        uint64_t bytes = 0;
        unsigned percent = 0;

        if (len > 0 && value[len - 1] == '%') {
                char *end;
                unsigned long v;

                errno = 0;
                v = strtoul(value, &end, 10);
                if (!isdigit((unsigned char)value[0]) || errno != 0 || end != value + len - 1 || v < 1 || v > 100)
                        return set_message_error(ret_message, -EINVAL, "a percentage must be 1%%-100%%");
                percent = (unsigned)v;
        } else if (len > 0 && (parse_size(value, &bytes) < 0 || bytes == 0))
                return set_message_error(ret_message, -EINVAL, "expected a size such as 64G, or a percentage of "
                                         "the memory free at start such as 90%%");
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

static const ConfigKey keys[] = {
        { "Broker", "Socket", parse_socket, print_socket },
        { "Broker", "Devices", parse_devices, print_devices },
        { "Broker", "Capacity", parse_capacity, print_capacity },
        { "Broker", "MaxSlab", parse_max_slab, print_max_slab },
        { "Broker", "AdminGroup", parse_admin_group, print_admin_group },
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
                if (!known_section(line + 1))
                        return set_message_error(ret_message, -EINVAL, "unknown section [%s] (known: [Broker])",
                                                 line + 1);
                snprintf(section, section_len, "%s", line + 1);
                return 0;
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
        char section[64] = "";
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
        const char *section = "";

        for (size_t i = 0; i < ELEMENTSOF(keys); i++) {
                if (strcmp(section, keys[i].section) != 0) {
                        section = keys[i].section;
                        fprintf(f, "%s[%s]\n", i > 0 ? "\n" : "", section);
                }
                fprintf(f, "%s=", keys[i].name);
                keys[i].print(c, f);
                fputc('\n', f);
        }
}

void config_init(Config *c) {
        *c = (Config){};
}

void config_done(Config *c) {
        free(c->socket_path);
        free(c->admin_group);
        config_init(c);
}
