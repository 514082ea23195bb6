/* SPDX-License-Identifier: MIT */

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "lease.h"
#include "macro.h"

void lease_table_init(LeaseTable *t, Pool *pool) {
        *t = (LeaseTable){ .pool = pool };
        list_init(&t->leases);
        list_init(&t->holders);
}

static void holder_free(LeaseTable *t, Holder *h) {
        list_unlink(&h->link);
        safe_close(h->pidfd);
        free(h);
}

void lease_table_done(LeaseTable *t) {
        Holder *h, *tmp;

        list_for_each_entry_safe(h, tmp, &t->holders, link) {
                holder_reclaim(t, h);
                holder_free(t, h);
        }
}

bool holder_is_dead(const Holder *h) {
        struct pollfd p = { .fd = h->pidfd, .events = POLLIN };

        return poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLHUP | POLLERR));
}

static void read_comm(pid_t pid, char *buf, size_t len) {
        char path[64];
        ssize_t n;
        int fd;

        buf[0] = 0;
        snprintf(path, sizeof(path), "/proc/%d/comm", (int)pid);
        fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
                return;
        n = read(fd, buf, len - 1);
        safe_close(fd);
        if (n <= 0)
                return;
        buf[n] = 0;
        buf[strcspn(buf, "\n")] = 0;
}

int lease_table_get_holder(LeaseTable *t, pid_t pid, uid_t uid, gid_t gid, int pidfd, Holder **ret,
                           bool *ret_new) {
        Holder *h;

        list_for_each_entry(h, &t->holders, link) {
                if (h->pid != pid)
                        continue;
                if (holder_is_dead(h)) {
                        /* The pid was reused before we saw its holder exit: end the old one first. */
                        holder_reclaim(t, h);
                        h->pid = 0;
                        holder_free_if_unused(t, h);
                        break;
                }
                if (h->uid != uid)
                        return -EPERM;  /* a live process changed uid: refuse rather than mix */
                safe_close(pidfd);
                *ret = h;
                *ret_new = false;
                return 0;
        }

        h = calloc(1, sizeof(*h));
        if (!h)
                return -ENOMEM;
        h->pid = pid;
        h->uid = uid;
        h->gid = gid;
        h->pidfd = pidfd;
        read_comm(pid, h->comm, sizeof(h->comm));
        list_init(&h->leases);
        list_link_tail(&t->holders, &h->link);
        *ret = h;
        *ret_new = true;
        return 0;
}

unsigned holder_reclaim(LeaseTable *t, Holder *h) {
        unsigned n = 0;
        Lease *l, *tmp;

        list_for_each_entry_safe(l, tmp, &h->leases, link_holder) {
                lease_free(t, l);
                n++;
        }
        return n;
}

bool holder_free_if_unused(LeaseTable *t, Holder *h) {
        if (!list_is_empty(&h->leases) || h->n_connections > 0 || h->userdata)
                return false;
        holder_free(t, h);
        return true;
}

static int random_id(char id[static LEASE_ID_LEN + 1]) {
        uint8_t b[LEASE_ID_LEN / 2];

        if (getrandom(b, sizeof(b), 0) != (ssize_t)sizeof(b))
                return -errno ?: -EIO;
        for (size_t i = 0; i < sizeof(b); i++)
                snprintf(id + 2 * i, 3, "%02x", b[i]);
        return 0;
}

static uint64_t now_realtime_usec(void) {
        struct timespec ts;

        clock_gettime(CLOCK_REALTIME, &ts);
        return (uint64_t)ts.tv_sec * 1000000 + (uint64_t)ts.tv_nsec / 1000;
}

int lease_new(LeaseTable *t, Holder *h, int device, uint64_t size, const char *label, Lease **ret) {
        Slab *slabs[POOL_MAX_SLABS];
        _cleanup_free_ Lease *l = NULL;
        _cleanup_free_ char *lab = NULL;
        _cleanup_free_ Slab **copy = NULL;
        size_t n = 0;
        int k;

        l = calloc(1, sizeof(*l));
        if (!l)
                return -ENOMEM;
        k = random_id(l->id);
        if (k < 0)
                return k;
        if (label) {
                lab = strdup(label);
                if (!lab)
                        return -ENOMEM;
        }
        k = pool_alloc(t->pool, device, size, h->uid, slabs, &n);
        if (k != 0)
                return k;
        copy = calloc(n, sizeof(Slab *));
        if (!copy) {
                for (size_t i = 0; i < n; i++)
                        pool_reclaim(t->pool, slabs[i]);
                return -ENOMEM;
        }
        memcpy(copy, slabs, n * sizeof(Slab *));

        l->device = device;
        for (size_t i = 0; i < n; i++)
                l->size += slabs[i]->size;
        l->created_usec = now_realtime_usec();
        l->label = TAKE_PTR(lab);
        l->holder = h;
        l->n_slabs = n;
        l->slabs = TAKE_PTR(copy);
        list_link_tail(&h->leases, &l->link_holder);
        list_link_tail(&t->leases, &l->link_table);
        t->n_leases++;
        *ret = TAKE_PTR(l);
        return 0;
}

void lease_free(LeaseTable *t, Lease *l) {
        for (size_t i = 0; i < l->n_slabs; i++)
                pool_reclaim(t->pool, l->slabs[i]);
        list_unlink(&l->link_holder);
        list_unlink(&l->link_table);
        t->n_leases--;
        free(l->slabs);
        free(l->label);
        free(l);
}

Lease *lease_find(LeaseTable *t, const Holder *h, const char *id) {
        Lease *l;

        list_for_each_entry(l, &h->leases, link_holder)
                if (strcmp(l->id, id) == 0)
                        return l;
        return NULL;
}
