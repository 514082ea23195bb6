/* SPDX-License-Identifier: MIT */

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
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

/* --- the store ------------------------------------------------------------------------------------ */

static void store_fd(const char *name, int fd) {
        char msg[128];
        int k;

        snprintf(msg, sizeof(msg), "FDSTORE=1\nFDNAME=%s\nFDPOLL=0", name);
        k = sd_pid_notify_with_fds(0, false, msg, &fd, 1);
        if (k < 0)
                fprintf(stderr, "Cannot store %s with the service manager: %s; it will not survive a restart.\n",
                        name, strerror(-k));
}

static void unstore_fd(const char *name) {
        char msg[128];

        snprintf(msg, sizeof(msg), "FDSTOREREMOVE=1\nFDNAME=%s", name);
        (void)sd_pid_notify(0, false, msg);
}

static void slab_name(uint64_t id, char buf[static 32]) {
        snprintf(buf, 32, "slab-%" PRIu64, id);
}

static void on_slab_created(const Slab *slab, void *userdata) {
        char name[32];

        slab_name(slab->id, name);
        store_fd(name, slab->fd);
}

static void on_slab_released(const Slab *slab, void *userdata) {
        char name[32];

        slab_name(slab->id, name);
        unstore_fd(name);
}

void restore_start_storing(Manager *m) {
        static const PoolHooks hooks = { on_slab_created, on_slab_released };
        const char *e = getenv("NOTIFY_SOCKET");

        m->storing = e && *e;
        if (m->storing)
                pool_set_hooks(m->pool, &hooks, m);
}

void restore_stop_storing(Manager *m) {
        if (!m->storing)
                return;
        restore_save_state(m);
        pool_set_hooks(m->pool, NULL, NULL);
        m->storing = false;
}

void restore_state_changed(Manager *m) {
        if (!m->storing)
                return;
        m->state_dirty = true;
        manager_schedule_idle(m);
}

void restore_save_state(Manager *m) {
        _cleanup_close_ int fd = -EBADF;
        char name[48];
        int k;

        if (!m->state_dirty)
                return;
        m->state_dirty = false;
        k = state_write(&m->leases, &fd);
        if (k < 0) {
                fprintf(stderr, "Cannot write the lease table for a restart: %s; a restart now would lose it.\n",
                        strerror(-k));
                return;
        }
        /* The new generation first: a crash between the two leaves one whole state, the highest wins. */
        snprintf(name, sizeof(name), "state-%" PRIu64, m->state_generation + 1);
        store_fd(name, fd);
        if (m->state_generation > 0) {
                snprintf(name, sizeof(name), "state-%" PRIu64, m->state_generation);
                unstore_fd(name);
        }
        m->state_generation++;
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

static void drop(Inherited *in, int fd, const char *name) {
        safe_close(fd);
        if (name)
                unstore_fd(name);
        in->n_dropped++;
}

int inherited_take(Inherited *ret, char **ret_message) {
        _cleanup_(inherited_done) Inherited in = { .socket = -EBADF, .state_fd = -EBADF };
        char **names = NULL;
        int n, k = 0;

        *ret = in;
        n = sd_listen_fds_with_names(true, &names);
        if (n < 0) {
                set_message(ret_message, "Cannot read the fds passed by the service manager: %s.", strerror(-n));
                return n;
        }
        in.slabs = calloc(n ?: 1, sizeof(InheritedSlab));
        if (!in.slabs)
                k = -ENOMEM;
        for (int i = 0; i < n; i++) {
                int fd = SD_LISTEN_FDS_START + i;
                const char *name = names && names[i] ? names[i] : "unknown";
                uint64_t v;

                (void)fcntl(fd, F_SETFD, FD_CLOEXEC);
                if (k < 0)
                        safe_close(fd);
                else if (strcmp(name, RESTORE_SOCKET_NAME) == 0 ||
                         (sd_is_socket(fd, AF_UNSPEC, 0, -1) > 0 && !parse_numbered(name, "slab-", &v) &&
                          !parse_numbered(name, "state-", &v))) {
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
                } else if (parse_numbered(name, "slab-", &v))
                        in.slabs[in.n_slabs++] = (InheritedSlab){ .id = v, .fd = fd };
                else if (parse_numbered(name, "state-", &v)) {
                        char old[48];

                        if (in.state_fd >= 0 && v < in.state_generation) {
                                snprintf(old, sizeof(old), "state-%" PRIu64, v);
                                drop(&in, fd, old);
                                continue;
                        }
                        if (in.state_fd >= 0) {
                                snprintf(old, sizeof(old), "state-%" PRIu64, in.state_generation);
                                drop(&in, in.state_fd, old);
                        }
                        in.state_fd = fd;
                        in.state_generation = v;
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
        in = (Inherited){ .socket = -EBADF, .state_fd = -EBADF };
        return 0;
}

void inherited_done(Inherited *in) {
        safe_close(in->socket);
        safe_close(in->state_fd);
        for (size_t i = 0; i < in->n_slabs; i++)
                safe_close(in->slabs[i].fd);
        free(in->slabs);
        *in = (Inherited){ .socket = -EBADF, .state_fd = -EBADF };
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

/* The stored fd of slab `id`, taken out of `in`; -EBADF if none. */
static int take_slab_fd(Inherited *in, uint64_t id) {
        for (size_t i = 0; i < in->n_slabs; i++)
                if (in->slabs[i].id == id && in->slabs[i].fd >= 0) {
                        int fd = in->slabs[i].fd;

                        in->slabs[i].fd = -EBADF;
                        return fd;
                }
        return -EBADF;
}

/* Imports a lease's slabs. Returns 0, or a negative errno / POOL_E_* (then none is left imported). */
static int import_slabs(Manager *m, Inherited *in, const StateLease *sl, Slab **slabs) {
        for (size_t j = 0; j < sl->n_slabs; j++) {
                int fd = take_slab_fd(in, sl->slabs[j].id), k;

                k = fd < 0 ? -ENOENT : pool_import(m->pool, sl->device, sl->slabs[j].id, fd, sl->slabs[j].size,
                                                   sl->uid, &slabs[j]);
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

/* The holder of a restored hold, if its process is the same and alive; NULL if it has gone. */
static Holder *restored_holder(Manager *m, const StateHold *sh, int *ret_error) {
        int pidfd = -EBADF, k;
        Holder *h;
        bool created;

        *ret_error = 0;
        if (sh->pid <= 0 || state_open_holder(sh->pid, sh->start_time, &pidfd) <= 0)
                return NULL;
        k = lease_table_get_holder(&m->leases, sh->pid, sh->uid, sh->gid, pidfd, &h, &created);
        if (k < 0) {
                safe_close(pidfd);
                return NULL;
        }
        if (created) {
                k = manager_watch_holder(m, h);
                if (k < 0) {
                        *ret_error = k;
                        return NULL;
                }
        }
        return h;
}

static int restore_one(Manager *m, Inherited *in, const StateLease *sl, unsigned *ret_holds, unsigned *ret_gone) {
        Slab *slabs[POOL_MAX_SLABS];
        User *owner;
        Lease *l;
        int i = pool_find_device(m->pool, sl->device), k;

        if (i < 0 || sl->n_slabs > POOL_MAX_SLABS)
                return -ENODEV;
        k = import_slabs(m, in, sl, slabs);
        if (k != 0)
                return k;
        owner = user_get(&m->users, sl->uid, NULL, 0);
        k = owner ? lease_restore(&m->leases, owner, (size_t)i, sl->id, sl->device, sl->created_usec, sl->label,
                                  sl->pid, sl->comm, sl->foreign, slabs, sl->n_slabs, &l)
                  : -ENOMEM;
        user_unref(&m->users, owner);
        if (k < 0) {
                for (size_t j = 0; j < sl->n_slabs; j++)
                        pool_release(m->pool, slabs[j]);
                return k;
        }
        for (size_t j = 0; j < sl->n_tokens && k >= 0; j++)
                k = lease_restore_token(l, sl->tokens[j].token, sl->tokens[j].uid, sl->tokens[j].creator,
                                        sl->tokens[j].readonly);
        if (k >= 0 && sl->name)
                k = lease_publish(&m->leases, l, sl->name, sl->name_uids, sl->n_name_uids, sl->name_readonly);
        for (size_t j = 0; j < sl->n_holds && k >= 0; j++) {
                Holder *h = restored_holder(m, &sl->holds[j], &k);

                if (h)
                        k = lease_restore_hold(l, h, sl->holds[j].refs, sl->holds[j].readonly);
                if (h && k >= 0)
                        (*ret_holds)++;
                else if (k >= 0)
                        (*ret_gone)++;
        }
        /* Every holder gone while the daemon was down, and no name: it ends, as their exits would have ended it. */
        if (k < 0 || (l->n_holds == 0 && !l->name))
                lease_free(&m->leases, l);
        return k < 0 ? k : 0;
}

int restore_leases(Manager *m, Inherited *in) {
        _cleanup_free_ char *message = NULL;
        unsigned restored = 0, dropped = 0, holds = 0, gone = 0, unused = 0;
        State s = {};
        int k;

        if (in->state_fd < 0) {
                if (in->n_slabs > 0)
                        fprintf(stderr, "The service manager kept %u slabs but no lease table: releasing them.\n",
                                drop_unused_slabs(in));
                return 0;
        }
        k = state_read(in->state_fd, &s, &message);
        if (k == -ENOMEM)
                return k;
        if (k < 0) {
                char name[48];

                fprintf(stderr, "Cannot use the stored lease table (state-%" PRIu64 "): %s Every lease is released.\n",
                        in->state_generation, message ?: strerror(-k));
                snprintf(name, sizeof(name), "state-%" PRIu64, in->state_generation);
                drop(in, in->state_fd, name);
                in->state_fd = -EBADF;
                drop_unused_slabs(in);
                return 0;
        }
        m->state_generation = in->state_generation;
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
        restore_state_changed(m);
        return 0;
}
