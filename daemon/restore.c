/* SPDX-License-Identifier: MIT */

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include "macro.h"
#include "manager.h"
#include "message.h"
#include "restore.h"
#include "state.h"
#include "store.h"

#define LEGACY_NAME_PREFIX "state-"     /* the previous version's whole-table JSON (state_read()) */
#define HOST_CACHE_PREFIX "hcache-"     /* a cached host slab kept at exit: "hcache-<device>-<size>-<id>" */

/* --- the service manager's fd store ----------------------------------------------------------------- */

static int fdstore_save(void *userdata, const char *name, int fd) {
        char msg[320];
        int k;

        snprintf(msg, sizeof(msg), "FDSTORE=1\nFDNAME=%s\nFDPOLL=0", name);
        k = sd_pid_notify_with_fds(0, false, msg, &fd, 1);
        return k < 0 ? k : k == 0 ? -ENOTCONN : 0;
}

static int fdstore_remove(void *userdata, const char *name) {
        char msg[320];
        int k;

        snprintf(msg, sizeof(msg), "FDSTOREREMOVE=1\nFDNAME=%s", name);
        k = sd_pid_notify(0, false, msg);
        return k < 0 ? k : k == 0 ? -ENOTCONN : 0;
}

static void slab_name(uint64_t id, char buf[static 32]) {
        snprintf(buf, 32, "slab-%" PRIu64, id);
}

static void host_cache_name(int device, uint64_t size, uint64_t id, char buf[static 80]) {
        snprintf(buf, 80, HOST_CACHE_PREFIX "%d-%" PRIu64 "-%" PRIu64, device, size, id);
}

static int on_slab_created(const Slab *slab, void *userdata) {
        char name[32];
        int k;

        slab_name(slab->id, name);
        k = fdstore_save(userdata, name, slab->fd);
        if (k < 0)
                fprintf(stderr, "Failed to store %s with the service manager: %s; not handing it out.\n", name,
                        strerror(-k));
        return k;
}

static void on_slab_released(const Slab *slab, void *userdata) {
        char name[32];

        slab_name(slab->id, name);
        (void)fdstore_remove(userdata, name);
}

/* VMMBROKER_TEST_STORE_FAULT=STEP:N[:crash], for the tests of storing (tests/restart/test-store-faults.c). */
static int parse_fault(Store *s, const char *v, char **ret_message) {
        static const char *const steps[] = {
                [STORE_STEP_WRITE] = "write",
                [STORE_STEP_GROW] = "grow",
                [STORE_STEP_SEAL] = "seal",
                [STORE_STEP_NOTIFY] = "notify",
        };
        char step[16], crash[16] = "";
        unsigned n;
        int fields = sscanf(v, "%15[a-z]:%u:%15s", step, &n, crash);

        for (size_t i = 0; fields >= 2 && n > 0 && i < ELEMENTSOF(steps); i++)
                if (strcmp(step, steps[i]) == 0 && (fields == 2 || strcmp(crash, "crash") == 0)) {
                        store_inject_fault(s, (StoreStep)i, n, -EIO, fields == 3);
                        return 0;
                }
        set_message(ret_message, "VMMBROKER_TEST_STORE_FAULT=%s is not STEP:N or STEP:N:crash with STEP one of "
                    "write, grow, seal, notify and N at least 1.", v);
        return -EINVAL;
}

int restore_start_storing(Manager *m, char **ret_message) {
        static const PoolHooks hooks = { on_slab_created, on_slab_released };
        const StoreBackend backend = { fdstore_save, fdstore_remove, NULL };
        const char *e = getenv("NOTIFY_SOCKET"), *fdstore = getenv("FDSTORE");
        const char *fault = getenv("VMMBROKER_TEST_STORE_FAULT");
        Store *s = NULL;
        int k;

        /* systemd 254 and later set $FDSTORE to FileDescriptorStoreMax= when the service has a store;
         * vmmbroker.service sets it for older ones. Without it nothing stored would be kept. */
        m->storing = e && *e && fdstore && strtoul(fdstore, NULL, 10) > 0;
        if (!m->storing)
                return 0;
        k = store_new(&s, &backend);
        if (k < 0)
                return k;
        if (fault && *fault) {
                k = parse_fault(s, fault, ret_message);
                if (k < 0) {
                        store_free(s);
                        return k;
                }
        }
        broker_set_store(&m->broker, s);
        pool_set_hooks(m->pool, &hooks, NULL);
        return 0;
}

/* Stores one cached host slab as "hcache-": `kept` counts the messages sent, which the manager may still refuse. */
static void keep_host_slab(const Slab *slab, int device, void *userdata) {
        unsigned *kept = userdata;
        char name[80];

        slab_name(slab->id, name);
        if (fdstore_remove(NULL, name) < 0)
                return;
        host_cache_name(device, slab->size, slab->id, name);
        if (fdstore_save(NULL, name, slab->fd) == 0)
                (*kept)++;
}

void restore_keep_host_cache(Manager *m) {
        unsigned kept = 0;

        if (!m->storing)
                return;
        pool_foreach_host_cached(m->pool, keep_host_slab, &kept);
        if (kept > 0)
                fprintf(stderr, "Handed %u cached host slabs to the service manager for the next run (it may "
                        "refuse some; the next start says how many it kept).\n", kept);
}

void restore_stop_storing(Manager *m) {
        if (!m->storing)
                return;
        pool_set_hooks(m->pool, NULL, NULL);
        m->storing = false;
}

/* --- what came back at start ---------------------------------------------------------------------- */

/* "prefix<number>" to number; false if it is not that. */
static bool parse_numbered(const char *name, const char *prefix, uint64_t *ret) {
        size_t n = strlen(prefix);
        char *end;

        if (strncmp(name, prefix, n) != 0 || name[n] < '0' || name[n] > '9')
                return false;
        errno = 0;
        *ret = strtoull(name + n, &end, 10);
        return errno == 0 && !*end;
}

/* "hcache-<device>-<size>-<id>" to its parts (fd left -EBADF); false if it is not that. */
static bool parse_host_cache(const char *name, InheritedCached *ret) {
        size_t n = strlen(HOST_CACHE_PREFIX);
        const char *p = name + n;
        uint64_t v[3];

        if (strncmp(name, HOST_CACHE_PREFIX, n) != 0)
                return false;
        for (size_t i = 0; i < ELEMENTSOF(v); i++) {
                char *end;

                if (*p < '0' || *p > '9')
                        return false;
                errno = 0;
                v[i] = strtoull(p, &end, 10);
                if (errno != 0 || *end != (i + 1 < ELEMENTSOF(v) ? '-' : '\0'))
                        return false;
                p = end + 1;
        }
        if (v[0] > INT_MAX)
                return false;
        *ret = (InheritedCached){ .device = (int)v[0], .size = v[1], .id = v[2], .fd = -EBADF };
        return true;
}

static void drop(Inherited *in, int fd, const char *name) {
        safe_close(fd);
        if (name)
                (void)fdstore_remove(NULL, name);
        in->n_dropped++;
}

static void table_name(const Inherited *in, char buf[static 48]) {
        snprintf(buf, 48, "%s%" PRIu64, in->table_legacy ? LEGACY_NAME_PREFIX : STORE_NAME_PREFIX,
                 in->table_generation);
}

/* Keeps the newer of two stored tables: any "table-" over any "state-", else the higher generation. */
static void take_table(Inherited *in, int fd, uint64_t generation, bool legacy) {
        char name[48];

        if (in->table_fd >= 0 &&
            (legacy > in->table_legacy || (legacy == in->table_legacy && generation < in->table_generation))) {
                snprintf(name, sizeof(name), "%s%" PRIu64, legacy ? LEGACY_NAME_PREFIX : STORE_NAME_PREFIX,
                         generation);
                drop(in, fd, name);
                return;
        }
        if (in->table_fd >= 0) {
                table_name(in, name);
                drop(in, in->table_fd, name);
        }
        in->table_fd = fd;
        in->table_generation = generation;
        in->table_legacy = legacy;
}

int inherited_take(Inherited *ret, char **ret_message) {
        _cleanup_(inherited_done) Inherited in = INHERITED_NULL;
        char **names = NULL;
        int n, k = 0;

        *ret = in;
        n = sd_listen_fds_with_names(true, &names);
        if (n < 0) {
                set_message(ret_message, "Cannot read the fds passed by the service manager: %s.", strerror(-n));
                return n;
        }
        in.slabs = calloc(n ?: 1, sizeof(InheritedSlab));
        in.cached = calloc(n ?: 1, sizeof(InheritedCached));
        if (!in.slabs || !in.cached)
                k = -ENOMEM;
        for (int i = 0; i < n; i++) {
                int fd = SD_LISTEN_FDS_START + i;
                const char *name = names && names[i] ? names[i] : "unknown";
                InheritedCached c;
                uint64_t v;

                (void)fcntl(fd, F_SETFD, FD_CLOEXEC);
                if (k < 0)
                        safe_close(fd);
                else if (parse_numbered(name, "slab-", &v))
                        in.slabs[in.n_slabs++] = (InheritedSlab){ .id = v, .fd = fd };
                else if (parse_host_cache(name, &c)) {
                        c.fd = fd;
                        in.cached[in.n_cached++] = c;
                } else if (parse_numbered(name, STORE_NAME_PREFIX, &v))
                        take_table(&in, fd, v, false);
                else if (parse_numbered(name, LEGACY_NAME_PREFIX, &v))
                        take_table(&in, fd, v, true);
                else if (strcmp(name, RESTORE_SOCKET_NAME) == 0 || sd_is_socket(fd, AF_UNSPEC, 0, -1) > 0) {
                        if (in.socket >= 0 || sd_is_socket_unix(fd, SOCK_STREAM, 1, NULL, 0) <= 0) {
                                set_message(ret_message, "The service manager passed %s; vmmbrokerd takes exactly "
                                            "one listening AF_UNIX stream socket (check ListenStream= in "
                                            "vmmbroker.socket).", in.socket >= 0 ? "more than one socket" :
                                            "a socket that is not a listening AF_UNIX stream socket");
                                k = -EINVAL;
                                safe_close(fd);
                                continue;
                        }
                        in.socket = fd;
                } else
                        drop(&in, fd, name);
        }
        for (int i = 0; names && i < n; i++)
                free(names[i]);
        free(names);
        if (k < 0)
                return k;
        /* Service managers pass sockets blocking unless told otherwise; the accept loop needs EAGAIN. */
        if (in.socket >= 0 && fcntl(in.socket, F_SETFL, fcntl(in.socket, F_GETFL) | O_NONBLOCK) < 0)
                return -errno;
        *ret = in;
        in = INHERITED_NULL;
        return 0;
}

void inherited_done(Inherited *in) {
        safe_close(in->socket);
        safe_close(in->table_fd);
        for (size_t i = 0; i < in->n_slabs; i++)
                safe_close(in->slabs[i].fd);
        free(in->slabs);
        for (size_t i = 0; i < in->n_cached; i++)
                safe_close(in->cached[i].fd);
        free(in->cached);
        *in = INHERITED_NULL;
}

/* Closes the slab fds no lease took and removes them from the store: nobody can have them back. */
static unsigned drop_unused_slabs(Inherited *in) {
        unsigned n = 0;

        for (size_t i = 0; i < in->n_slabs; i++)
                if (in->slabs[i].fd >= 0) {
                        char name[32];

                        slab_name(in->slabs[i].id, name);
                        drop(in, in->slabs[i].fd, name);
                        in->slabs[i].fd = -EBADF;
                        n++;
                }
        return n;
}

/* --- rebuilding the table ------------------------------------------------------------------------- */

static int cmp_slab(const void *a, const void *b) {
        const InheritedSlab *x = a, *y = b;

        return x->id < y->id ? -1 : x->id > y->id;
}

/* The stored fd of slab `id`, taken out of `in` (sorted by id); -EBADF if none. */
static int take_slab_fd(Inherited *in, uint64_t id) {
        InheritedSlab key = { .id = id }, *s = bsearch(&key, in->slabs, in->n_slabs, sizeof(*s), cmp_slab);
        int fd;

        if (!s)
                return -EBADF;
        fd = s->fd;
        s->fd = -EBADF;
        return fd;
}

/* Imports a lease's slabs. Returns 0, or a negative errno / POOL_E_* (then none is left imported). */
static int import_slabs(Manager *m, Inherited *in, const StateLease *sl, Slab **slabs) {
        for (size_t j = 0; j < sl->n_slabs; j++) {
                int fd = take_slab_fd(in, sl->slabs[j].id), k;

                k = fd < 0 ? -ENOENT : pool_import(m->pool, sl->device, sl->slabs[j].id, fd, sl->slabs[j].size,
                                                   sl->uid, sl->parked, &slabs[j]);
                if (k != 0) {
                        char name[32];

                        if (fd >= 0) {
                                slab_name(sl->slabs[j].id, name);
                                drop(in, fd, name);
                        }
                        for (size_t i = 0; i < j; i++)
                                pool_release(m->pool, slabs[i]);        /* its hook removes it from the store */
                        return k;
                }
        }
        return 0;
}

/* A lease as it was, owned by and charged to its owner even over its limits (it was within them when made). */
static int rebuild_lease(Broker *b, const StateLease *sl, size_t pool_device, Slab **slabs, Lease **ret) {
        _cleanup_free_ Lease *l = calloc(1, sizeof(Lease));
        User *owner;
        int k;

        if (!l)
                return -ENOMEM;
        l->slabs = calloc(sl->n_slabs ?: 1, sizeof(Slab *));
        l->label = sl->label ? strdup(sl->label) : NULL;
        owner = user_get(&b->users, sl->uid, NULL, 0);
        k = lease_table_reserve(&b->leases);
        if (!l->slabs || (sl->label && !l->label) || !owner || k < 0) {
                free(l->slabs);
                free(l->label);
                user_unref(owner);
                return -ENOMEM;
        }
        memcpy(l->id, sl->id, LEASE_ID_LEN + 1);
        memcpy(l->slabs, slabs, sl->n_slabs * sizeof(Slab *));
        l->n_slabs = sl->n_slabs;
        l->device = sl->device;
        l->pool_device = pool_device;
        for (size_t j = 0; j < sl->n_slabs; j++)
                l->size += slabs[j]->size;
        l->created_usec = sl->created_usec;
        l->uid = sl->uid;
        l->pid = sl->pid;
        snprintf(l->comm, sizeof(l->comm), "%s", sl->comm);
        l->foreign = sl->foreign;
        l->parked = sl->parked;
        user_charge_anyway(owner, &l->charge_lease, USER_LEASES, pool_device, 1);
        if (l->parked)
                user_charge_anyway(owner, &l->charge_host, USER_HOST_BYTES, pool_device, l->size);
        else
                user_charge_anyway(owner, &l->charge_bytes, USER_BYTES, pool_device, l->size);
        user_unref(owner);
        lease_table_add(&b->leases, l);
        *ret = TAKE_PTR(l);
        return 0;
}

static int restore_tokens_and_name(Broker *b, Lease *l, const StateLease *sl) {
        for (size_t j = 0; j < sl->n_tokens; j++) {
                Token *tok = calloc(1, sizeof(Token));

                if (!tok || lease_table_reserve(&b->leases) < 0) {
                        free(tok);
                        return -ENOMEM;
                }
                memcpy(tok->token, sl->tokens[j].token, LEASE_TOKEN_LEN + 1);
                tok->uid = sl->tokens[j].uid;
                tok->creator = sl->tokens[j].creator;
                tok->readonly = sl->tokens[j].readonly;
                lease_add_token(&b->leases, l, tok);
        }
        if (sl->name) {
                char *key = lease_name_key(l->uid, sl->name);
                uid_t *uids = calloc(sl->n_name_uids ?: 1, sizeof(uid_t));

                if (!key || !uids || lease_table_reserve(&b->leases) < 0) {
                        free(key);
                        free(uids);
                        return -ENOMEM;
                }
                if (sl->n_name_uids > 0)
                        memcpy(uids, sl->name_uids, sl->n_name_uids * sizeof(uid_t));
                lease_set_name(&b->leases, l, key, uids, sl->n_name_uids, sl->name_readonly);
        }
        return 0;
}

/* Re-attaches the holds whose process is the same and alive. */
static int restore_holds(Broker *b, Lease *l, const StateLease *sl, unsigned *ret_holds, unsigned *ret_gone) {
        for (size_t j = 0; j < sl->n_holds; j++) {
                const StateHold *sh = &sl->holds[j];
                User *u = user_get(&b->users, sh->uid, NULL, 0);
                Holder *h = NULL;
                Hold *hold;
                int k;

                if (!u)
                        return -ENOMEM;
                k = holder_restore(&b->holders, u, sh->pid, sh->gid, sh->start_time, &h);
                user_unref(u);
                if (k < 0)
                        return k;
                if (k == 0 || lease_find_hold(l, h)) {
                        (*ret_gone)++;
                        continue;
                }
                hold = calloc(1, sizeof(*hold));
                if (!hold) {
                        holder_free_if_unused(h);
                        return -ENOMEM;
                }
                lease_add_hold(&b->leases, l, hold, h, sh->refs ?: 1, sh->readonly);
                hold->parked = l->parked || sh->parked; /* a parked lease is mapped by none of its holders */
                (*ret_holds)++;
        }
        return 0;
}

/* A lease that was kept is kept again (broker_keep_restored()), or said why not. */
static void restore_kept(Broker *b, Lease *l) {
        int k = broker_keep_restored(b, l);

        if (k == BROKER_E_NOT_OWNER)
                fprintf(stderr, "Lease %s was stored kept, but is not as a kept lease is: it is not kept.\n", l->id);
        else if (k != 0)
                fprintf(stderr, "Lease %s was kept, but cannot be zeroed again (%s): it is not kept.\n", l->id,
                        pool_last_error(b->pool));
}

static int restore_one(Manager *m, Inherited *in, const StateLease *sl, unsigned *ret_holds, unsigned *ret_gone) {
        Slab *slabs[POOL_MAX_HOST_SLABS];
        Broker *b = &m->broker;
        Lease *l;
        int i = pool_find_device(m->pool, sl->device), k;

        if (i < 0 || sl->n_slabs > pool_max_slabs(sl->parked))
                return -ENODEV;
        k = import_slabs(m, in, sl, slabs);
        if (k != 0)
                return k;
        k = rebuild_lease(b, sl, (size_t)i, slabs, &l);
        if (k < 0) {
                for (size_t j = 0; j < sl->n_slabs; j++)
                        pool_release(m->pool, slabs[j]);
                return k;
        }
        k = restore_tokens_and_name(b, l, sl);
        if (k >= 0)
                k = restore_holds(b, l, sl, ret_holds, ret_gone);
        /* Every holder gone while the daemon was down, and no name: it ends, as their exits would have ended it. */
        if (k < 0 || (l->n_holds == 0 && !l->name)) {
                lease_end(&b->leases, l);
                return k < 0 ? k : 0;
        }
        if (sl->kept)
                restore_kept(b, l);
        return 0;
}

/* Reads the inherited table. Returns 0, a negative errno (-ENOMEM fatal), with a sentence in *ret_message. */
static int read_table(Inherited *in, State *s, char **ret_message) {
        return in->table_legacy ? state_read(in->table_fd, s, ret_message) : store_read(in->table_fd, s, ret_message);
}

/* Stores the rebuilt table as a new generation, then removes the one it came from. */
static void store_rebuilt(Manager *m, Inherited *in) {
        char name[48];
        int k;

        if (!m->broker.store)
                return;
        if (in->table_fd >= 0 && !in->table_legacy)
                store_set_generation(m->broker.store, in->table_generation);
        k = broker_store_snapshot(&m->broker, true);
        if (k < 0) {
                /* The old table stays stored, and is still right: nothing changes until this works. */
                fprintf(stderr, "Failed to store the lease table: %s; changes are refused until it works.\n",
                        strerror(-k));
                return;
        }
        if (in->table_fd >= 0 && in->table_legacy) {
                table_name(in, name);
                (void)fdstore_remove(NULL, name);
        }
}

/*
 * Takes back the host slabs the previous run kept (restore_keep_host_cache()), after the leases and the unused
 * slabs are done with (a dropped "slab-<id>" must not remove a new slab of the same id). Each "hcache-" entry is
 * removed first: the pool stores the slab again under its new id, and the service manager would refuse a second
 * entry of the same open file. A slab it cannot take (no room, no such device, a size no slab has) is closed.
 */
static void adopt_host_cache(Manager *m, Inherited *in) {
        unsigned kept = 0, dropped = 0;
        uint64_t bytes = 0;

        for (size_t i = 0; i < in->n_cached; i++) {
                InheritedCached *c = &in->cached[i];
                char name[80];
                int k, fd = c->fd;

                c->fd = -EBADF;
                host_cache_name(c->device, c->size, c->id, name);
                (void)fdstore_remove(NULL, name);
                k = pool_adopt_host(m->pool, c->device, fd, c->size);
                if (k == 0) {
                        kept++;
                        bytes += c->size;
                        continue;
                }
                fprintf(stderr, "Not keeping host slab %s of the previous run: %s.\n", name,
                        k == -ENOMEM ? strerror(ENOMEM) : pool_last_error(m->pool));
                dropped++;
        }
        if (kept + dropped > 0)
                fprintf(stderr, "Kept %u host slabs (%" PRIu64 " MiB) that the previous run had cached for parks; "
                        "%u could not be kept.\n", kept, bytes >> 20, dropped);
}

int restore_leases(Manager *m, Inherited *in) {
        _cleanup_free_ char *message = NULL;
        unsigned restored = 0, dropped = 0, holds = 0, gone = 0, unused = 0;
        State s = {};
        int k;

        qsort(in->slabs, in->n_slabs, sizeof(InheritedSlab), cmp_slab);
        if (in->table_fd < 0) {
                if (in->n_slabs > 0)
                        fprintf(stderr, "The service manager kept %u slabs but no lease table: releasing them.\n",
                                drop_unused_slabs(in));
                goto done;
        }
        k = read_table(in, &s, &message);
        if (k == -ENOMEM)
                return k;
        if (k < 0) {
                char name[48];

                table_name(in, name);
                fprintf(stderr, "Cannot use the stored lease table (%s): %s Every lease is released.\n", name,
                        message ?: strerror(-k));
                drop(in, in->table_fd, name);
                in->table_fd = -EBADF;
                drop_unused_slabs(in);
                goto done;
        }
        for (size_t i = 0; i < s.n_leases; i++) {
                k = restore_one(m, in, &s.leases[i], &holds, &gone);
                if (k == -ENOMEM)
                        break;
                if (k != 0) {
                        fprintf(stderr, "Cannot restore lease %s: %s.\n", s.leases[i].id,
                                k > 0 ? pool_last_error(m->pool) : strerror(-k));
                        dropped++;
                } else
                        restored++;
        }
        state_done(&s);
        if (k == -ENOMEM)
                return k;
        unused = drop_unused_slabs(in);         /* no lease names them: their owner is unknown, never cached */
        fprintf(stderr, "Restored %u leases (%u holds; %u holders had exited, %u leases could not be restored, "
                "%u stored slabs were unused).\n", restored, holds, gone, dropped, unused);
done:
        adopt_host_cache(m, in);
        store_rebuilt(m, in);
        return 0;
}
