/* SPDX-License-Identifier: MIT */

#include <assert.h>
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
#include "state.h"

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
        Holder *h, *htmp;
        Lease *l, *ltmp;

        t->closing = true;
        list_for_each_entry_safe(h, htmp, &t->holders, link) {
                holder_reclaim(t, h);
                holder_free(t, h);
        }
        list_for_each_entry_safe(l, ltmp, &t->leases, link_table)
                lease_free(t, l);
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
        /* Read through the pid, so only trusted while the pidfd says the process still lives: had it exited,
         * the pid may already name another process. */
        if (process_start_time(pid, &h->start_time) < 0 || holder_is_dead(h))
                h->start_time = 0;
        list_init(&h->holds);
        list_link_tail(&t->holders, &h->link);
        *ret = h;
        *ret_new = true;
        return 0;
}

/* Ends a hold, whatever its references; then the lease if nobody holds it and it has no name. */
static void hold_end(LeaseTable *t, Hold *hold) {
        Lease *l = hold->lease;

        list_unlink(&hold->link_lease);
        list_unlink(&hold->link_holder);
        l->n_holds--;
        free(hold);
        if (l->n_holds == 0 && !l->name)
                lease_free(t, l);
}

unsigned holder_reclaim(LeaseTable *t, Holder *h) {
        unsigned n = 0;
        Hold *hold, *tmp;

        list_for_each_entry_safe(hold, tmp, &h->holds, link_holder) {
                hold_end(t, hold);
                n++;
        }
        return n;
}

bool holder_free_if_unused(LeaseTable *t, Holder *h) {
        if (!list_is_empty(&h->holds) || h->n_connections > 0 || h->userdata)
                return false;
        holder_free(t, h);
        return true;
}

static int random_hex(char *out, size_t digits) {
        uint8_t b[32];

        assert(digits % 2 == 0 && digits / 2 <= sizeof(b));
        if (getrandom(b, digits / 2, 0) != (ssize_t)(digits / 2))
                return -errno ?: -EIO;
        for (size_t i = 0; i < digits / 2; i++)
                snprintf(out + 2 * i, 3, "%02x", b[i]);
        return 0;
}

static uint64_t now_realtime_usec(void) {
        struct timespec ts;

        clock_gettime(CLOCK_REALTIME, &ts);
        return (uint64_t)ts.tv_sec * 1000000 + (uint64_t)ts.tv_nsec / 1000;
}

/* Links a new hold of one reference. */
static void hold_link(Hold *hold, Lease *l, Holder *h, bool readonly) {
        *hold = (Hold){ .lease = l, .holder = h, .refs = 1, .readonly = readonly };
        list_link_tail(&l->holds, &hold->link_lease);
        list_link_tail(&h->holds, &hold->link_holder);
        l->n_holds++;
        if (h->uid != l->uid)
                l->foreign = true;
}

/* Charges a new lease of `size` bytes (rounded up) on the pool's device `i` to its owner. */
static int lease_charge(LeaseTable *t, User *owner, size_t i, uint64_t size, LeaseQuota *ret_quota) {
        PoolDeviceStats s;
        uint64_t bytes;
        int k;

        pool_device_stats(t->pool, i, &s);
        bytes = ALIGN_UP(size, s.granularity);
        if (bytes > s.capacity)
                return POOL_E_TOO_LARGE;        /* no limit could allow it: say so rather than QuotaExceeded */
        *ret_quota = (LeaseQuota){ .what = USER_LEASES, .asked = 1 };
        k = user_charge(owner, USER_LEASES, i, 1, &ret_quota->limit, &ret_quota->current);
        if (k < 0)
                return k;
        *ret_quota = (LeaseQuota){ .what = USER_BYTES, .asked = bytes };
        k = user_charge(owner, USER_BYTES, i, bytes, &ret_quota->limit, &ret_quota->current);
        if (k < 0)
                user_uncharge(owner, USER_LEASES, i, 1);
        return k;
}

static void lease_uncharge(User *owner, size_t i, uint64_t bytes) {
        user_uncharge(owner, USER_BYTES, i, bytes);
        user_uncharge(owner, USER_LEASES, i, 1);
}

int lease_new(LeaseTable *t, Holder *h, User *owner, int device, uint64_t size, const char *label, Lease **ret,
              LeaseQuota *ret_quota) {
        Slab *slabs[POOL_MAX_SLABS];
        _cleanup_free_ Lease *l = NULL;
        _cleanup_free_ char *lab = NULL;
        _cleanup_free_ Slab **copy = NULL;
        _cleanup_free_ Hold *hold = NULL;
        int i = pool_find_device(t->pool, device);
        size_t n = 0;
        int k;

        if (i < 0)
                return POOL_E_NO_DEVICE;
        if (size > UINT64_MAX / 2)
                return POOL_E_TOO_LARGE;        /* rounding it up would overflow */
        l = calloc(1, sizeof(*l));
        hold = calloc(1, sizeof(*hold));
        if (!l || !hold)
                return -ENOMEM;
        k = random_hex(l->id, LEASE_ID_LEN);
        if (k < 0)
                return k;
        if (label) {
                lab = strdup(label);
                if (!lab)
                        return -ENOMEM;
        }
        k = lease_charge(t, owner, (size_t)i, size, ret_quota);
        if (k != 0)
                return k;
        k = pool_alloc(t->pool, device, size, h->uid, slabs, &n);
        if (k == 0) {
                copy = calloc(n, sizeof(Slab *));
                if (!copy) {
                        for (size_t j = 0; j < n; j++)
                                pool_reclaim(t->pool, slabs[j]);
                        k = -ENOMEM;
                }
        }
        if (k != 0) {
                lease_uncharge(owner, (size_t)i, ret_quota->asked);
                return k;
        }
        memcpy(copy, slabs, n * sizeof(Slab *));

        l->device = device;
        l->pool_device = (size_t)i;
        for (size_t j = 0; j < n; j++)
                l->size += slabs[j]->size;
        assert(l->size == ret_quota->asked);    /* the slabs sum to the rounded size that was charged */
        l->created_usec = now_realtime_usec();
        l->label = TAKE_PTR(lab);
        l->uid = h->uid;
        l->owner = user_ref(owner);
        l->pid = h->pid;
        memcpy(l->comm, h->comm, sizeof(l->comm));
        l->n_slabs = n;
        l->slabs = TAKE_PTR(copy);
        list_init(&l->holds);
        list_init(&l->tokens);
        list_link_tail(&t->leases, &l->link_table);
        t->n_leases++;

        hold_link(TAKE_PTR(hold), l, h, false);
        *ret = TAKE_PTR(l);
        return 0;
}

Hold *hold_find(const Holder *h, const char *id) {
        Hold *hold;

        list_for_each_entry(hold, &h->holds, link_holder)
                if (strcmp(hold->lease->id, id) == 0)
                        return hold;
        return NULL;
}

int lease_attach(LeaseTable *t, Lease *l, Holder *h, bool readonly, Hold **ret) {
        Hold *hold;

        list_for_each_entry(hold, &h->holds, link_holder)
                if (hold->lease == l) {
                        hold->refs++;
                        hold->readonly = hold->readonly && readonly;
                        *ret = hold;
                        return 0;
                }
        hold = calloc(1, sizeof(*hold));
        if (!hold)
                return -ENOMEM;
        hold_link(hold, l, h, readonly);
        *ret = hold;
        return 0;
}

void hold_unref(LeaseTable *t, Hold *hold) {
        if (--hold->refs == 0)
                hold_end(t, hold);
}

void lease_free(LeaseTable *t, Lease *l) {
        Hold *hold, *htmp;
        Token *tok, *ttmp;

        list_for_each_entry_safe(hold, htmp, &l->holds, link_lease) {
                list_unlink(&hold->link_lease);
                list_unlink(&hold->link_holder);
                free(hold);
        }
        list_for_each_entry_safe(tok, ttmp, &l->tokens, link)
                token_free(tok);
        for (size_t i = 0; i < l->n_slabs; i++) {
                if (l->foreign || t->closing)
                        pool_release(t->pool, l->slabs[i]);
                else
                        pool_reclaim(t->pool, l->slabs[i]);
        }
        if (l->name)
                t->n_published--;
        lease_uncharge(l->owner, l->pool_device, l->size);
        user_unref(t->users, l->owner);
        list_unlink(&l->link_table);
        t->n_leases--;
        free(l->name);
        free(l->name_uids);
        free(l->slabs);
        free(l->label);
        free(l);
}

int lease_share(Lease *l, uid_t uid, uid_t creator, bool readonly, Token **ret) {
        _cleanup_free_ Token *tok = NULL;
        int k;

        if (l->n_tokens >= LEASE_TOKENS_MAX)
                return -EDQUOT;
        tok = calloc(1, sizeof(*tok));
        if (!tok)
                return -ENOMEM;
        k = random_hex(tok->token, LEASE_TOKEN_LEN);
        if (k < 0)
                return k;
        tok->uid = uid;
        tok->creator = creator;
        tok->readonly = readonly;
        tok->lease = l;
        list_link_tail(&l->tokens, &tok->link);
        l->n_tokens++;
        *ret = TAKE_PTR(tok);
        return 0;
}

/* Compares two tokens in time that does not depend on where they differ. */
static bool token_equal(const char *a, const char *b) {
        unsigned char diff = 0;

        for (size_t i = 0; i < LEASE_TOKEN_LEN; i++)
                diff |= (unsigned char)(a[i] ^ b[i]);
        return diff == 0;
}

Token *token_find(LeaseTable *t, const char *token) {
        Lease *l;
        Token *tok;

        if (strlen(token) != LEASE_TOKEN_LEN)
                return NULL;
        list_for_each_entry(l, &t->leases, link_table)
                list_for_each_entry(tok, &l->tokens, link)
                        if (token_equal(tok->token, token))
                                return tok;
        return NULL;
}

void token_free(Token *tok) {
        if (!tok)
                return;
        list_unlink(&tok->link);
        tok->lease->n_tokens--;
        free(tok);
}

Lease *lease_find_name(LeaseTable *t, const char *name) {
        Lease *l;

        list_for_each_entry(l, &t->leases, link_table)
                if (l->name && strcmp(l->name, name) == 0)
                        return l;
        return NULL;
}

int lease_publish(LeaseTable *t, Lease *l, const char *name, const uid_t *uids, size_t n_uids, bool readonly) {
        _cleanup_free_ uid_t *copy = NULL;
        _cleanup_free_ char *dup = NULL;
        Lease *other = lease_find_name(t, name);

        if (other && other != l)
                return -EEXIST;
        if (l->name && strcmp(l->name, name) != 0)
                return -EBUSY;
        if (n_uids > 0) {
                copy = calloc(n_uids, sizeof(uid_t));
                if (!copy)
                        return -ENOMEM;
                memcpy(copy, uids, n_uids * sizeof(uid_t));
        }
        if (!l->name) {
                dup = strdup(name);
                if (!dup)
                        return -ENOMEM;
                l->name = TAKE_PTR(dup);
                t->n_published++;
        }
        free(l->name_uids);
        l->name_uids = TAKE_PTR(copy);
        l->n_name_uids = n_uids;
        l->name_readonly = readonly;
        return 0;
}

bool lease_name_allows(const Lease *l, uid_t uid) {
        if (uid == l->uid)
                return true;
        for (size_t i = 0; i < l->n_name_uids; i++)
                if (l->name_uids[i] == uid)
                        return true;
        return false;
}

void lease_unpublish(LeaseTable *t, Lease *l) {
        if (!l->name)
                return;
        free(l->name);
        l->name = NULL;
        free(l->name_uids);
        l->name_uids = NULL;
        l->n_name_uids = 0;
        l->name_readonly = false;
        t->n_published--;
        if (l->n_holds == 0)
                lease_free(t, l);
}

int lease_restore(LeaseTable *t, User *owner, size_t pool_device, const char *id, int device, uint64_t created_usec,
                  const char *label, pid_t pid, const char *comm, bool foreign, Slab **slabs, size_t n_slabs,
                  Lease **ret) {
        _cleanup_free_ Lease *l = calloc(1, sizeof(Lease));
        _cleanup_free_ Slab **copy = calloc(n_slabs ?: 1, sizeof(Slab *));
        _cleanup_free_ char *lab = label ? strdup(label) : NULL;

        if (strlen(id) != LEASE_ID_LEN)
                return -EINVAL;         /* state_read() checked it: not from a table this code wrote */
        if (!l || !copy || (label && !lab))
                return -ENOMEM;
        memcpy(l->id, id, LEASE_ID_LEN + 1);
        memcpy(copy, slabs, n_slabs * sizeof(Slab *));
        l->device = device;
        l->pool_device = pool_device;
        for (size_t j = 0; j < n_slabs; j++)
                l->size += slabs[j]->size;
        l->created_usec = created_usec;
        l->label = TAKE_PTR(lab);
        l->uid = owner->uid;
        l->owner = user_ref(owner);
        l->pid = pid;
        snprintf(l->comm, sizeof(l->comm), "%s", comm ?: "");
        l->foreign = foreign;
        l->n_slabs = n_slabs;
        l->slabs = TAKE_PTR(copy);
        list_init(&l->holds);
        list_init(&l->tokens);
        user_charge_anyway(owner, USER_LEASES, pool_device, 1);
        user_charge_anyway(owner, USER_BYTES, pool_device, l->size);
        list_link_tail(&t->leases, &l->link_table);
        t->n_leases++;
        *ret = TAKE_PTR(l);
        return 0;
}

int lease_restore_hold(Lease *l, Holder *h, unsigned refs, bool readonly) {
        Hold *hold = calloc(1, sizeof(*hold));

        if (!hold)
                return -ENOMEM;
        hold_link(hold, l, h, readonly);
        hold->refs = refs ?: 1;
        return 0;
}

int lease_restore_token(Lease *l, const char *token, uid_t uid, uid_t creator, bool readonly) {
        Token *tok;
        int k = lease_share(l, uid, creator, readonly, &tok);

        if (k < 0)
                return k;
        memcpy(tok->token, token, LEASE_TOKEN_LEN + 1);
        return 0;
}
