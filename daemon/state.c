/* SPDX-License-Identifier: MIT */

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/pidfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include "codec.h"
#include "json.h"
#include "macro.h"
#include "message.h"
#include "state.h"

/*
 * The file as JSON sees it: every integer is int64_t or uint64_t, every
 * string a char *, as the JsonField tables need. state_read() checks the
 * ranges and copies it into the State types. (The previous daemon wrote it
 * with these same tables; this one only reads it, on upgrade: it stores the
 * table with store.c.)
 */
typedef struct StoredToken {
        char *token;
        int64_t uid;                    /* JSON_ABSENT: any user */
        int64_t creator;
        bool readonly;
} StoredToken;

typedef struct StoredHold {
        int64_t pid;
        uint64_t start_time;
        int64_t uid;
        int64_t gid;
        char *comm;
        uint64_t refs;
        bool readonly;
} StoredHold;

typedef struct StoredLease {
        char *id;
        int64_t device;
        uint64_t size;
        uint64_t created;
        char *label;
        int64_t uid;
        int64_t pid;
        char *comm;
        bool foreign;
        StateSlab *slabs;
        size_t n_slabs;
        char *name;
        uint64_t *name_uids;
        size_t n_name_uids;
        bool name_readonly;
        StoredToken *tokens;
        size_t n_tokens;
        StoredHold *holds;
        size_t n_holds;
} StoredLease;

typedef struct StoredState {
        int64_t format;
        StoredLease *leases;
        size_t n_leases;
} StoredState;

static const JsonField slab_fields[] = {
        JSON_FIELD_UINT64("id", StateSlab, id),
        JSON_FIELD_UINT64("size", StateSlab, size),
        JSON_FIELD_END,
};

static const JsonField token_fields[] = {
        JSON_FIELD_STRING("token", StoredToken, token, true, LEASE_TOKEN_LEN),
        JSON_FIELD_INT64("uid", StoredToken, uid, false, true),
        JSON_FIELD_INT64("creator", StoredToken, creator, true, true),
        JSON_FIELD_BOOL("readonly", StoredToken, readonly, true),
        JSON_FIELD_END,
};

static const JsonField hold_fields[] = {
        JSON_FIELD_INT64("pid", StoredHold, pid, true, true),
        JSON_FIELD_UINT64("start_time", StoredHold, start_time),
        JSON_FIELD_INT64("uid", StoredHold, uid, true, true),
        JSON_FIELD_INT64("gid", StoredHold, gid, true, true),
        JSON_FIELD_STRING("comm", StoredHold, comm, true, STATE_COMM_MAX),
        JSON_FIELD_UINT64("refs", StoredHold, refs),
        JSON_FIELD_BOOL("readonly", StoredHold, readonly, true),
        JSON_FIELD_END,
};

static const JsonField lease_fields[] = {
        JSON_FIELD_STRING("id", StoredLease, id, true, LEASE_ID_LEN),
        JSON_FIELD_INT64("device", StoredLease, device, true, true),
        JSON_FIELD_UINT64("size", StoredLease, size),
        JSON_FIELD_UINT64("created", StoredLease, created),
        JSON_FIELD_STRING("label", StoredLease, label, false, LEASE_LABEL_MAX),
        JSON_FIELD_INT64("uid", StoredLease, uid, true, true),
        JSON_FIELD_INT64("pid", StoredLease, pid, true, true),
        JSON_FIELD_STRING("comm", StoredLease, comm, true, STATE_COMM_MAX),
        JSON_FIELD_BOOL("foreign", StoredLease, foreign, true),
        JSON_FIELD_ARRAY("slabs", StoredLease, slabs, n_slabs, StateSlab, slab_fields, true, POOL_MAX_SLABS),
        JSON_FIELD_STRING("name", StoredLease, name, false, VMMB_LEASE_NAME_MAX),
        JSON_FIELD_UINT64V("name_uids", StoredLease, name_uids, n_name_uids, false, STATE_NAME_UIDS_MAX),
        JSON_FIELD_BOOL("name_readonly", StoredLease, name_readonly, false),
        JSON_FIELD_ARRAY("tokens", StoredLease, tokens, n_tokens, StoredToken, token_fields, true, LEASE_TOKENS_MAX),
        JSON_FIELD_ARRAY("holds", StoredLease, holds, n_holds, StoredHold, hold_fields, true, STATE_HOLDS_MAX),
        JSON_FIELD_END,
};

static const JsonField state_fields[] = {
        JSON_FIELD_INT64("format", StoredState, format, true, true),
        JSON_FIELD_ARRAY("leases", StoredState, leases, n_leases, StoredLease, lease_fields, true, STATE_LEASES_MAX),
        JSON_FIELD_END,
};

/* ---- process identity ------------------------------------------------------------------------------------- */

int process_start_time(pid_t pid, uint64_t *ret) {
        char path[64], buf[4096], *p, *end;
        unsigned long long v;
        ssize_t n;
        int fd;

        if (pid <= 0)
                return -ESRCH;
        snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
        fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
                return errno == ENOENT ? -ESRCH : -errno;
        n = read(fd, buf, sizeof(buf) - 1);
        if (n < 0) {
                int k = errno == ESRCH ? -ESRCH : -errno;

                safe_close(fd);
                return k;
        }
        safe_close(fd);
        buf[n] = 0;

        /* "pid (comm) state ppid ...": comm may hold spaces and ')', so fields are counted after the last ')'. */
        p = strrchr(buf, ')');
        if (!p)
                return -EBADMSG;
        p++;
        for (int field = 3; field <= 22; field++) {
                if (*p != ' ')
                        return -EBADMSG;
                p++;
                if (field == 22)
                        break;
                p += strcspn(p, " \n");
        }
        if (*p < '0' || *p > '9')
                return -EBADMSG;
        errno = 0;
        v = strtoull(p, &end, 10);
        if (errno != 0 || (*end != ' ' && *end != '\n' && *end != 0))
                return -EBADMSG;
        *ret = (uint64_t)v;
        return 0;
}

int state_open_holder(pid_t pid, uint64_t start_time, int *ret_pidfd) {
        _cleanup_close_ int pidfd = -EBADF;
        struct pollfd p;
        uint64_t now;

        if (pid <= 0)
                return 0;
        pidfd = pidfd_open(pid, 0);
        /* EINVAL: the pid is now a thread of some other process, not a process's (a holder's) own. */
        if (pidfd < 0)
                return errno == ESRCH || errno == EINVAL ? 0 : -errno;
        /* The pidfd now names one process whatever happens to the pid; is it the one written? */
        if (start_time != 0 && process_start_time(pid, &now) == 0 && now != start_time)
                return 0;
        /* Had it exited between pidfd_open() and the read, the start time may be another process's. */
        p = (struct pollfd){ .fd = pidfd, .events = POLLIN };
        if (poll(&p, 1, 0) > 0)
                return 0;
        *ret_pidfd = TAKE_FD(pidfd);
        return 1;
}

bool state_is_holder_alive(pid_t pid, uint64_t start_time) {
        int pidfd = -EBADF;

        if (state_open_holder(pid, start_time, &pidfd) <= 0)
                return false;
        safe_close(pidfd);
        return true;
}

/* ---- reading ---------------------------------------------------------------------------------------------- */

void state_lease_done(StateLease *l) {
        free(l->label);
        free(l->name);
        free(l->name_uids);
        free(l->slabs);
        free(l->tokens);
        free(l->holds);
}

void state_done(State *s) {
        for (size_t i = 0; s->leases && i < s->n_leases; i++)
                state_lease_done(&s->leases[i]);
        free(s->leases);
        *s = (State){};
}

static bool is_hex_id(const char *s, size_t len) {
        if (strlen(s) != len)
                return false;
        for (size_t i = 0; i < len; i++)
                if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
                        return false;
        return true;
}

/* A user or group id that names one: 0..4294967294 ((uid_t)-1 is "none" to the kernel and UID_ANY here). */
static bool id_is_valid(int64_t id) {
        return id >= 0 && id < (int64_t)UINT32_MAX;
}

static int cmp_str(const void *a, const void *b) {
        return strcmp(*(char *const *)a, *(char *const *)b);
}

static int cmp_u64(const void *a, const void *b) {
        uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

        return x < y ? -1 : x > y;
}

/* Sorts n strings and returns one that appears twice, or NULL. */
static const char *find_duplicate_str(const char **v, size_t n) {
        if (n > 1)
                qsort(v, n, sizeof(char *), cmp_str);
        for (size_t i = 1; i < n; i++)
                if (strcmp(v[i - 1], v[i]) == 0)
                        return v[i];
        return NULL;
}

/* One hold's process, to check that every hold of a pid describes the same process. */
typedef struct HoldKey {
        pid_t pid;
        size_t lease;
        const StateHold *hold;
} HoldKey;

static int cmp_hold_key(const void *a, const void *b) {
        const HoldKey *x = a, *y = b;

        if (x->pid != y->pid)
                return x->pid < y->pid ? -1 : 1;
        return x->lease < y->lease ? -1 : x->lease > y->lease;
}

/*
 * What the State types cannot hold, checked on the JSON's integers before converting: a device, pid,
 * reference count or id out of the range of int, unsigned and uid_t. The rest is state_check()'s.
 * Returns 0, or -EBADMSG with a sentence.
 */
static int check_ranges(const StoredLease *w, char **ret_message) {
        if (w->device > INT_MAX)
                return set_message_error(ret_message, -EBADMSG, "Lease %s's device %" PRIi64 " is out of range.",
                                         w->id, w->device);
        if (!id_is_valid(w->uid))
                return set_message_error(ret_message, -EBADMSG, "Lease %s's uid %" PRIi64 " is out of range.",
                                         w->id, w->uid);
        if (w->pid > INT_MAX)
                return set_message_error(ret_message, -EBADMSG, "Lease %s's pid %" PRIi64 " is out of range.",
                                         w->id, w->pid);
        for (size_t j = 0; j < w->n_name_uids; j++)
                if (w->name_uids[j] >= UINT32_MAX)
                        return set_message_error(ret_message, -EBADMSG,
                                                 "Lease %s's name_uids hold %" PRIu64 ", out of range.", w->id,
                                                 w->name_uids[j]);
        for (size_t j = 0; j < w->n_tokens; j++) {
                const StoredToken *tok = &w->tokens[j];

                if ((tok->uid != JSON_ABSENT && !id_is_valid(tok->uid)) || !id_is_valid(tok->creator))
                        return set_message_error(ret_message, -EBADMSG,
                                                 "Lease %s's token %zu has a uid out of range.", w->id, j);
        }
        for (size_t j = 0; j < w->n_holds; j++) {
                const StoredHold *h = &w->holds[j];

                if (h->pid > INT_MAX || !id_is_valid(h->uid) || !id_is_valid(h->gid))
                        return set_message_error(ret_message, -EBADMSG,
                                                 "Lease %s's hold %zu has a pid, uid or gid out of range.", w->id, j);
                if (h->refs == 0 || h->refs > UINT_MAX)
                        return set_message_error(ret_message, -EBADMSG,
                                                 "Lease %s's hold %zu has %" PRIu64 " references.", w->id, j,
                                                 h->refs);
        }
        return 0;
}

/* A fixed buffer's string: NUL-terminated within the buffer, printable UTF-8. */
static bool fixed_is_printable(const char *s, size_t size) {
        size_t n = strnlen(s, size);

        return n < size && json_string_is_printable(s, n, false);
}

/* Checks one lease on its own. Returns 0, or -EBADMSG with a sentence. */
static int check_lease(const StateLease *l, size_t i, char **ret_message) {
        uint64_t sum = 0;

        if (!fixed_is_printable(l->id, sizeof(l->id)) || !is_hex_id(l->id, LEASE_ID_LEN))
                return set_message_error(ret_message, -EBADMSG,
                                         "Lease %zu's id is not %d lowercase hexadecimal digits.", i, LEASE_ID_LEN);
        if (l->device < 0)
                return set_message_error(ret_message, -EBADMSG, "Lease %s's device %d is out of range.", l->id,
                                         l->device);
        if (l->uid == UID_ANY)
                return set_message_error(ret_message, -EBADMSG, "Lease %s's uid %u is out of range.", l->id,
                                         (unsigned)l->uid);
        if (l->pid < 0)
                return set_message_error(ret_message, -EBADMSG, "Lease %s's pid %d is out of range.", l->id,
                                         (int)l->pid);
        if (!fixed_is_printable(l->comm, sizeof(l->comm)))
                return set_message_error(ret_message, -EBADMSG,
                                         "Lease %s's command name is not printable UTF-8 of at most %d bytes.",
                                         l->id, STATE_COMM_MAX);
        if (l->label && (strlen(l->label) > LEASE_LABEL_MAX ||
                         !json_string_is_printable(l->label, strlen(l->label), false)))
                return set_message_error(ret_message, -EBADMSG,
                                         "Lease %s's label is not printable UTF-8 of at most %d bytes.", l->id,
                                         LEASE_LABEL_MAX);

        if (l->n_slabs == 0)
                return set_message_error(ret_message, -EBADMSG, "Lease %s has no slabs.", l->id);
        if (l->n_slabs > pool_max_slabs(l->parked))
                return set_message_error(ret_message, -EBADMSG, "Lease %s has more than %zu slabs.", l->id,
                                         pool_max_slabs(l->parked));
        for (size_t j = 0; j < l->n_slabs; j++) {
                if (l->slabs[j].id == 0)
                        return set_message_error(ret_message, -EBADMSG, "Lease %s has a slab of id 0.", l->id);
                /* the pool checks the size against the device's granularity and maximum slab when it
                 * imports the slab (pool_import()) */
                if (l->slabs[j].size == 0)
                        return set_message_error(ret_message, -EBADMSG, "Lease %s's slab %" PRIu64 " is empty.",
                                                 l->id, l->slabs[j].id);
                if (__builtin_add_overflow(sum, l->slabs[j].size, &sum))
                        return set_message_error(ret_message, -EBADMSG, "Lease %s's slabs overflow.", l->id);
        }
        if (sum != l->size)
                return set_message_error(ret_message, -EBADMSG,
                                         "Lease %s's size is %" PRIu64 " bytes but its slabs add up to %" PRIu64 ".",
                                         l->id, l->size, sum);

        if (l->name && !vmmb_lease_name_was_valid(l->name))
                return set_message_error(ret_message, -EBADMSG, "Lease %s's name is not a valid name.", l->id);
        if (!l->name && (l->n_name_uids > 0 || l->name_readonly))
                return set_message_error(ret_message, -EBADMSG,
                                         "Lease %s has name_uids or name_readonly but no name.", l->id);
        if (l->n_name_uids > STATE_NAME_UIDS_MAX)
                return set_message_error(ret_message, -EBADMSG, "Lease %s has more than %d name_uids.", l->id,
                                         STATE_NAME_UIDS_MAX);
        for (size_t j = 0; j < l->n_name_uids; j++)
                if (l->name_uids[j] == UID_ANY)
                        return set_message_error(ret_message, -EBADMSG,
                                                 "Lease %s's name_uids hold %u, out of range.", l->id,
                                                 (unsigned)l->name_uids[j]);

        if (l->n_tokens > LEASE_TOKENS_MAX)
                return set_message_error(ret_message, -EBADMSG, "Lease %s has more than %d tokens.", l->id,
                                         LEASE_TOKENS_MAX);
        for (size_t j = 0; j < l->n_tokens; j++) {
                const StateToken *tok = &l->tokens[j];

                if (!fixed_is_printable(tok->token, sizeof(tok->token)) || !is_hex_id(tok->token, LEASE_TOKEN_LEN))
                        return set_message_error(ret_message, -EBADMSG,
                                                 "Lease %s's token %zu is not %d lowercase hexadecimal digits.", l->id,
                                                 j, LEASE_TOKEN_LEN);
                if (tok->creator == UID_ANY)
                        return set_message_error(ret_message, -EBADMSG,
                                                 "Lease %s's token %zu has a uid out of range.", l->id, j);
        }

        if (l->n_holds > STATE_HOLDS_MAX)
                return set_message_error(ret_message, -EBADMSG, "Lease %s has more than %d holds.", l->id,
                                         STATE_HOLDS_MAX);
        for (size_t j = 0; j < l->n_holds; j++) {
                const StateHold *h = &l->holds[j];

                if (h->pid < 0 || h->uid == UID_ANY || h->gid == (gid_t)-1)
                        return set_message_error(ret_message, -EBADMSG,
                                                 "Lease %s's hold %zu has a pid, uid or gid out of range.", l->id, j);
                if (h->refs == 0)
                        return set_message_error(ret_message, -EBADMSG, "Lease %s's hold %zu has 0 references.",
                                                 l->id, j);
                if (!fixed_is_printable(h->comm, sizeof(h->comm)))
                        return set_message_error(ret_message, -EBADMSG,
                                                 "Lease %s's hold %zu has a command name that is not printable "
                                                 "UTF-8 of at most %d bytes.",
                                                 l->id, j, STATE_COMM_MAX);
                if (h->uid != l->uid && !l->foreign)
                        return set_message_error(ret_message, -EBADMSG,
                                                 "Lease %s is held by uid %u, not its owner's, yet is not "
                                                 "marked foreign.",
                                                 l->id, (unsigned)h->uid);
        }
        return 0;
}

/* The checks across leases: unique ids, names, tokens and slabs; one process per pid. */
static int check_unique(const State *s, char **ret_message) {
        _cleanup_free_ const char **strs = NULL;
        _cleanup_free_ uint64_t *ids = NULL;
        _cleanup_free_ HoldKey *keys = NULL;
        size_t n_slabs = 0, n_tokens = 0, n_holds = 0, n;
        const char *dup;

        for (size_t i = 0; i < s->n_leases; i++) {
                n_slabs += s->leases[i].n_slabs;
                n_tokens += s->leases[i].n_tokens;
                n_holds += s->leases[i].n_holds;
        }
        strs = calloc(MAX(s->n_leases, n_tokens) ?: 1, sizeof(char *));
        ids = calloc(n_slabs ?: 1, sizeof(uint64_t));
        keys = calloc(n_holds ?: 1, sizeof(HoldKey));
        if (!strs || !ids || !keys)
                return -ENOMEM;

        for (size_t i = 0; i < s->n_leases; i++)
                strs[i] = s->leases[i].id;
        dup = find_duplicate_str(strs, s->n_leases);
        if (dup)
                return set_message_error(ret_message, -EBADMSG, "Lease id %s appears twice.", dup);

        /* Names are unique in their owner's namespace: compared as "<owner>/<name>". */
        n = 0;
        for (size_t i = 0; i < s->n_leases; i++)
                if (s->leases[i].name) {
                        char *key;

                        if (asprintf(&key, "%u/%s", (unsigned)s->leases[i].uid, s->leases[i].name) < 0) {
                                for (size_t j = 0; j < n; j++)
                                        free((char *)strs[j]);
                                return -ENOMEM;
                        }
                        strs[n++] = key;
                }
        dup = find_duplicate_str(strs, n);
        if (dup) {
                int k = set_message_error(ret_message, -EBADMSG, "Two leases are published as '%s' (owner/name).",
                                          dup);

                for (size_t j = 0; j < n; j++)
                        free((char *)strs[j]);
                return k;
        }
        for (size_t j = 0; j < n; j++)
                free((char *)strs[j]);

        n = 0;
        for (size_t i = 0; i < s->n_leases; i++)
                for (size_t j = 0; j < s->leases[i].n_tokens; j++)
                        strs[n++] = s->leases[i].tokens[j].token;
        if (find_duplicate_str(strs, n))
                return set_message_error(ret_message, -EBADMSG, "A share token appears twice.");

        n = 0;
        for (size_t i = 0; i < s->n_leases; i++)
                for (size_t j = 0; j < s->leases[i].n_slabs; j++)
                        ids[n++] = s->leases[i].slabs[j].id;
        if (n > 1)
                qsort(ids, n, sizeof(uint64_t), cmp_u64);
        for (size_t i = 1; i < n; i++)
                if (ids[i - 1] == ids[i])
                        return set_message_error(ret_message, -EBADMSG, "Slab %" PRIu64 " is in two places.",
                                                 ids[i]);

        n = 0;
        for (size_t i = 0; i < s->n_leases; i++)
                for (size_t j = 0; j < s->leases[i].n_holds; j++)
                        keys[n++] = (HoldKey){ .pid = s->leases[i].holds[j].pid, .lease = i,
                                               .hold = &s->leases[i].holds[j] };
        if (n > 1)
                qsort(keys, n, sizeof(HoldKey), cmp_hold_key);
        for (size_t i = 1; i < n; i++) {
                const HoldKey *a = &keys[i - 1], *b = &keys[i];

                if (a->pid != b->pid || a->pid == 0)    /* pid 0: holders whose pid went to another process */
                        continue;
                if (a->lease == b->lease)
                        return set_message_error(ret_message, -EBADMSG, "Process %d holds lease %s twice.",
                                                 (int)a->pid, s->leases[a->lease].id);
                if (a->hold->start_time != b->hold->start_time || a->hold->uid != b->hold->uid ||
                    a->hold->gid != b->hold->gid)
                        return set_message_error(ret_message, -EBADMSG,
                                                 "Process %d is described differently in two leases.", (int)a->pid);
        }
        return 0;
}

int state_check(const State *s, char **ret_message) {
        int k;

        if (s->n_leases > STATE_LEASES_MAX)
                return set_message_error(ret_message, -EBADMSG, "The state has more than %d leases.",
                                         STATE_LEASES_MAX);
        for (size_t i = 0; i < s->n_leases; i++) {
                k = check_lease(&s->leases[i], i, ret_message);
                if (k < 0)
                        return k;
        }
        return check_unique(s, ret_message);
}

/* Copies a checked string into a fixed buffer (its length was bounded by the table). */
static void copy_fixed(char *dst, size_t size, const char *src) {
        size_t n = strlen(src);

        if (n >= size)
                n = size - 1;
        memcpy(dst, src, n);
        dst[n] = 0;
}

/* Moves a checked StoredLease into a StateLease. */
static int convert_lease(StoredLease *w, StateLease *l) {
        copy_fixed(l->id, sizeof(l->id), w->id);
        l->device = (int)w->device;
        l->size = w->size;
        l->created_usec = w->created;
        l->uid = (uid_t)w->uid;
        l->pid = (pid_t)w->pid;
        copy_fixed(l->comm, sizeof(l->comm), w->comm);
        l->foreign = w->foreign;
        l->name_readonly = w->name_readonly;
        l->label = TAKE_PTR(w->label);
        l->name = TAKE_PTR(w->name);
        l->slabs = TAKE_PTR(w->slabs);
        l->n_slabs = w->n_slabs;
        w->n_slabs = 0;

        if (w->n_name_uids > 0) {
                l->name_uids = calloc(w->n_name_uids, sizeof(uid_t));
                if (!l->name_uids)
                        return -ENOMEM;
                for (size_t j = 0; j < w->n_name_uids; j++)
                        l->name_uids[j] = (uid_t)w->name_uids[j];
                l->n_name_uids = w->n_name_uids;
        }
        if (w->n_tokens > 0) {
                l->tokens = calloc(w->n_tokens, sizeof(StateToken));
                if (!l->tokens)
                        return -ENOMEM;
                for (size_t j = 0; j < w->n_tokens; j++) {
                        StateToken *t = &l->tokens[j];

                        copy_fixed(t->token, sizeof(t->token), w->tokens[j].token);
                        t->uid = w->tokens[j].uid == JSON_ABSENT ? UID_ANY : (uid_t)w->tokens[j].uid;
                        t->creator = (uid_t)w->tokens[j].creator;
                        t->readonly = w->tokens[j].readonly;
                }
                l->n_tokens = w->n_tokens;
        }
        if (w->n_holds > 0) {
                l->holds = calloc(w->n_holds, sizeof(StateHold));
                if (!l->holds)
                        return -ENOMEM;
                for (size_t j = 0; j < w->n_holds; j++) {
                        StateHold *h = &l->holds[j];

                        h->pid = (pid_t)w->holds[j].pid;
                        h->start_time = w->holds[j].start_time;
                        h->uid = (uid_t)w->holds[j].uid;
                        h->gid = (gid_t)w->holds[j].gid;
                        copy_fixed(h->comm, sizeof(h->comm), w->holds[j].comm);
                        h->refs = (unsigned)w->holds[j].refs;
                        h->readonly = w->holds[j].readonly;
                }
                l->n_holds = w->n_holds;
        }
        return 0;
}

/* Reads the whole regular file at fd into a NUL-terminated buffer. */
static int read_file(int fd, char **ret, size_t *ret_len, char **ret_message) {
        _cleanup_free_ char *buf = NULL;
        struct stat st;
        size_t len, done = 0;

        if (fstat(fd, &st) < 0)
                return -errno;
        if (!S_ISREG(st.st_mode))
                return set_message_error(ret_message, -EBADMSG, "The state is not a regular file.");
        if ((uint64_t)st.st_size > STATE_SIZE_MAX)
                return set_message_error(ret_message, -EFBIG, "The state is %" PRIu64 " bytes, over the %" PRIu64
                                         " bytes this daemon reads.", (uint64_t)st.st_size, STATE_SIZE_MAX);
        if (st.st_size == 0)
                return set_message_error(ret_message, -EBADMSG, "The state is empty.");
        len = (size_t)st.st_size;
        buf = malloc(len + 1);
        if (!buf)
                return -ENOMEM;
        while (done < len) {
                ssize_t n = pread(fd, buf + done, len - done, (off_t)done);

                if (n < 0) {
                        if (errno == EINTR)
                                continue;
                        return -errno;
                }
                if (n == 0)
                        return set_message_error(ret_message, -EBADMSG, "The state was cut short while read.");
                done += (size_t)n;
        }
        buf[len] = 0;
        *ret = TAKE_PTR(buf);
        *ret_len = len;
        return 0;
}

static void stored_state_done(StoredState *w) {
        json_dispatch_free(state_fields, w);
}

int state_read(int fd, State *ret, char **ret_message) {
        _cleanup_(stored_state_done) StoredState w = {};
        _cleanup_(json_object_putp) json_object *o = NULL;
        _cleanup_(state_done) State s = {};
        _cleanup_free_ char *buf = NULL, *inner = NULL;
        json_object *format;
        size_t len = 0;
        int k;

        *ret = (State){};
        k = read_file(fd, &buf, &len, ret_message);
        if (k < 0)
                return k;
        k = json_parse_message(buf, len, &o);
        if (k == -EBADMSG)
                return set_message_error(ret_message, k, "The state is not one strict JSON object.");
        if (k < 0)
                return k;
        free(TAKE_PTR(buf));

        /* The version first, so that a later format is named as such rather than as "unknown parameter". */
        if (!json_object_object_get_ex(o, "format", &format))
                return set_message_error(ret_message, -EBADMSG, "The state has no format version.");
        if (!json_object_is_type(format, json_type_int))
                return set_message_error(ret_message, -EBADMSG, "The state's format version is not an integer.");
        if (json_object_get_int64(format) != STATE_FORMAT)
                return set_message_error(ret_message, -EPROTONOSUPPORT,
                                         "The state is in format %" PRIi64 "; this daemon reads format %d.",
                                         json_object_get_int64(format), STATE_FORMAT);

        k = json_dispatch(o, state_fields, &w, NULL, &inner);
        if (k == -EINVAL || k == -EBADMSG)
                return set_message_error(ret_message, -EBADMSG, "The state is malformed: %s",
                                         inner ?: "invalid.");
        if (k < 0)
                return k;
        json_object_put(TAKE_PTR(o));   /* the tree is several times the text: let it go before converting */

        for (size_t i = 0; i < w.n_leases; i++) {
                k = check_ranges(&w.leases[i], ret_message);
                if (k < 0)
                        return k;
        }

        if (w.n_leases > 0) {
                s.leases = calloc(w.n_leases, sizeof(StateLease));
                if (!s.leases)
                        return -ENOMEM;
        }
        for (size_t i = 0; i < w.n_leases; i++) {
                s.n_leases = i + 1;     /* counted first: state_done() frees what convert_lease() moved */
                k = convert_lease(&w.leases[i], &s.leases[i]);
                if (k < 0)
                        return k;
        }
        k = state_check(&s, ret_message);
        if (k < 0)
                return k;
        *ret = s;
        s = (State){};
        return 0;
}
