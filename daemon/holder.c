/* SPDX-License-Identifier: MIT */

#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <unistd.h>

#include "holder.h"
#include "macro.h"
#include "state.h"

static const void *holder_key(const HashLink *link) {
        return &container_of(link, Holder, link_pid)->pid;
}

static uint64_t pid_hash(const void *key) {
        uint64_t v = (uint64_t)*(const pid_t *)key;

        return hashmap_hash_u64(&v);
}

static bool pid_equal(const void *a, const void *b) {
        return *(const pid_t *)a == *(const pid_t *)b;
}

static const HashMapType holder_by_pid = { holder_key, pid_hash, pid_equal };

int holder_registry_init(HolderRegistry *r) {
        int k;

        *r = (HolderRegistry){ .epoll_fd = -EBADF };
        list_init(&r->holders);
        list_init(&r->exited);
        k = hashmap_init(&r->by_pid, &holder_by_pid);
        if (k < 0)
                return k;
        r->epoll_fd = epoll_create1(EPOLL_CLOEXEC);
        return r->epoll_fd < 0 ? -errno : 0;
}

int holder_registry_get_fd(const HolderRegistry *r) {
        return r->epoll_fd;
}

/* Stops watching: the process exited, or the holder goes. */
static void holder_unwatch(Holder *h) {
        if (!h->exited) {
                (void)epoll_ctl(h->registry->epoll_fd, EPOLL_CTL_DEL, h->pidfd, NULL);
                hashmap_remove(&h->registry->by_pid, &h->link_pid);
        }
}

static void holder_free(Holder *h) {
        HolderRegistry *r = h->registry;

        assert(list_is_empty(&h->holds));
        holder_unwatch(h);
        list_unlink(&h->link);
        list_unlink(&h->link_user);
        if (list_is_linked(&h->link_exited))
                list_unlink(&h->link_exited);
        r->n_holders--;
        safe_close(h->pidfd);
        user_charge_release(&h->charge);
        user_unref(h->user);
        free(h);
}

void holder_registry_done(HolderRegistry *r) {
        Holder *h, *tmp;

        list_for_each_entry_safe(h, tmp, &r->holders, link)
                holder_free(h);
        hashmap_done(&r->by_pid);
        safe_close(r->epoll_fd);
        *r = (HolderRegistry){ .epoll_fd = -EBADF };
}

bool holder_is_dead(const Holder *h) {
        struct pollfd p = { .fd = h->pidfd, .events = POLLIN };

        return h->exited || (poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLHUP | POLLERR)));
}

/* Its requests are not served any more and its holds are to be dropped. */
void holder_exited(Holder *h) {
        if (h->exited)
                return;
        holder_unwatch(h);
        h->exited = true;
        list_link_tail(&h->registry->exited, &h->link_exited);
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

/*
 * A new holder watching `pidfd` (taken on success), charged to its user: within MaxProcesses= unless
 * `anyway` (a process that held leases before a restart).
 */
static int holder_new(HolderRegistry *r, User *u, pid_t pid, gid_t gid, int pidfd, bool anyway, Holder **ret,
                      UserQuota *ret_quota) {
        struct epoll_event ev = { .events = EPOLLIN };
        _cleanup_free_ Holder *h = calloc(1, sizeof(Holder));
        int k;

        if (!h)
                return -ENOMEM;
        k = hashmap_reserve(&r->by_pid, r->by_pid.n + 1);
        if (k < 0)
                return k;
        *h = (Holder){ .registry = r, .pid = pid, .uid = u->uid, .gid = gid, .pidfd = pidfd };
        ev.data.ptr = h;
        if (anyway)
                user_charge_anyway(u, &h->charge, USER_PROCESSES, 0, 1);
        else if (user_charge(u, &h->charge, USER_PROCESSES, 0, 1, ret_quota) < 0)
                return -EDQUOT;
        if (epoll_ctl(r->epoll_fd, EPOLL_CTL_ADD, pidfd, &ev) < 0) {
                user_charge_release(&h->charge);
                return -errno;
        }
        read_comm(pid, h->comm, sizeof(h->comm));
        /* Read through the pid, so only trusted while the pidfd says the process still lives: had it exited,
         * the pid may already name another process. */
        if (process_start_time(pid, &h->start_time) < 0 || holder_is_dead(h))
                h->start_time = 0;
        h->user = user_ref(u);
        list_init(&h->holds);
        list_init(&h->kept);
        list_init(&h->link_exited);
        list_link_tail(&r->holders, &h->link);
        list_link_tail(&u->holders, &h->link_user);
        hashmap_add(&r->by_pid, &h->link_pid);
        r->n_holders++;
        *ret = TAKE_PTR(h);
        return 0;
}

/* The live holder with that pid, or NULL; one whose process has gone is marked exited first (a reused pid). */
static Holder *holder_find_live(HolderRegistry *r, pid_t pid) {
        HashLink *link = hashmap_find(&r->by_pid, &pid);
        Holder *h = link ? container_of(link, Holder, link_pid) : NULL;

        if (h && holder_is_dead(h)) {
                holder_exited(h);
                return NULL;
        }
        return h;
}

int holder_connect(HolderRegistry *r, User *u, pid_t pid, gid_t gid, int pidfd, Holder **ret, UserQuota *ret_quota) {
        Holder *h = holder_find_live(r, pid);
        int k;

        if (h) {
                safe_close(pidfd);
                if (h->uid != u->uid)
                        return -EPERM;  /* a live process changed uid: refuse rather than mix */
        } else {
                k = holder_new(r, u, pid, gid, pidfd, false, &h, ret_quota);
                if (k < 0) {
                        safe_close(pidfd);
                        return k;
                }
        }
        h->n_connections++;
        *ret = h;
        return 0;
}

void holder_disconnect(Holder *h) {
        assert(h->n_connections > 0);
        h->n_connections--;
        holder_free_if_unused(h);
}

int holder_restore(HolderRegistry *r, User *u, pid_t pid, gid_t gid, uint64_t start_time, Holder **ret) {
        int pidfd = -EBADF, k;
        Holder *h = holder_find_live(r, pid);

        if (h) {
                /* Re-attached already for another lease: the same process, or none of ours. */
                if (h->uid != u->uid || (start_time && h->start_time && start_time != h->start_time))
                        return 0;
                *ret = h;
                return 1;
        }
        if (pid <= 0)
                return 0;
        k = state_open_holder(pid, start_time, &pidfd);
        if (k <= 0)
                return k;
        k = holder_new(r, u, pid, gid, pidfd, true, &h, NULL);
        if (k < 0) {
                safe_close(pidfd);
                return k;
        }
        *ret = h;
        return 1;
}

Holder *holder_next_exited(HolderRegistry *r) {
        struct epoll_event ev[64];
        int n;

        do {
                n = epoll_wait(r->epoll_fd, ev, ELEMENTSOF(ev), 0);
                for (int i = 0; i < n; i++)
                        holder_exited(ev[i].data.ptr);
        } while (n == (int)ELEMENTSOF(ev));
        return list_is_empty(&r->exited) ? NULL : list_first_entry(&r->exited, Holder, link_exited);
}

void holder_reaped(Holder *h) {
        assert(h->exited && list_is_empty(&h->holds));
        list_unlink(&h->link_exited);
        holder_free_if_unused(h);
}

void holder_free_if_unused(Holder *h) {
        if (list_is_empty(&h->holds) && h->n_connections == 0 && !list_is_linked(&h->link_exited))
                holder_free(h);
}
