/* SPDX-License-Identifier: MIT */

#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "lease.h"
#include "macro.h"

/* --- indexes -------------------------------------------------------------------------------------- */

static const void *lease_id_key(const HashLink *link) {
        return container_of(link, Lease, link_id)->id;
}

static const void *lease_key_of_name(const HashLink *link) {
        return container_of(link, Lease, link_name)->name_key;
}

static const void *token_key(const HashLink *link) {
        return container_of(link, Token, link_table)->token;
}

static bool string_equal(const void *a, const void *b) {
        return strcmp(a, b) == 0;
}

/* Compares two tokens in time that does not depend on where they differ. */
static bool token_equal(const void *a, const void *b) {
        const char *x = a, *y = b;
        unsigned char diff = 0;

        for (size_t i = 0; i < LEASE_TOKEN_LEN; i++)
                diff |= (unsigned char)(x[i] ^ y[i]);
        return diff == 0;
}

static const HashMapType lease_by_id = { lease_id_key, hashmap_hash_string, string_equal };
static const HashMapType lease_by_name = { lease_key_of_name, hashmap_hash_string, string_equal };
static const HashMapType token_by_token = { token_key, hashmap_hash_string, token_equal };

int lease_table_init(LeaseTable *t, Pool *pool) {
        size_t n = pool ? pool_n_devices(pool) : 0;
        int k;

        *t = (LeaseTable){ .pool = pool, .n_devices = n };
        list_init(&t->leases);
        list_init(&t->moves);
        t->device_leases = calloc(n ?: 1, sizeof(unsigned));
        t->device_kept = calloc(n ?: 1, sizeof(uint64_t));
        if (!t->device_leases || !t->device_kept)
                return -ENOMEM;
        k = reclaim_set_init(&t->reclaim, n);
        if (k < 0)
                return k;
        k = hashmap_init(&t->by_id, &lease_by_id);
        if (k >= 0)
                k = hashmap_init(&t->by_token, &token_by_token);
        if (k >= 0)
                k = hashmap_init(&t->by_name, &lease_by_name);
        return k;
}

void lease_table_done(LeaseTable *t) {
        Lease *l, *tmp;

        t->closing = true;
        list_for_each_entry_safe(l, tmp, &t->leases, link_table)
                lease_end(t, l);
        hashmap_done(&t->by_id);
        hashmap_done(&t->by_token);
        hashmap_done(&t->by_name);
        free(t->device_leases);
        t->device_leases = NULL;
        free(t->device_kept);
        t->device_kept = NULL;
        reclaim_set_done(&t->reclaim);
}

int lease_table_reserve(LeaseTable *t) {
        int k = hashmap_reserve(&t->by_id, t->by_id.n + 1);

        if (k >= 0)
                k = hashmap_reserve(&t->by_token, t->by_token.n + 1);
        if (k >= 0)
                k = hashmap_reserve(&t->by_name, t->by_name.n + 1);
        return k;
}

Lease *lease_table_find(const LeaseTable *t, const char *id) {
        HashLink *link = hashmap_find(&t->by_id, id);

        return link ? container_of(link, Lease, link_id) : NULL;
}

char *lease_name_key(uid_t owner, const char *name) {
        char *key;

        return asprintf(&key, "%u/%s", (unsigned)owner, name) < 0 ? NULL : key;
}

Lease *lease_table_find_name(const LeaseTable *t, uid_t owner, const char *name) {
        char key[16 + 256];
        HashLink *link;

        if (snprintf(key, sizeof(key), "%u/%s", (unsigned)owner, name) >= (int)sizeof(key))
                return NULL;    /* longer than any name */
        link = hashmap_find(&t->by_name, key);
        return link ? container_of(link, Lease, link_name) : NULL;
}

Token *lease_table_find_token(const LeaseTable *t, const char *token) {
        HashLink *link;

        if (strlen(token) != LEASE_TOKEN_LEN)
                return NULL;
        link = hashmap_find(&t->by_token, token);
        return link ? container_of(link, Token, link_table) : NULL;
}

/* --- leases --------------------------------------------------------------------------------------- */

void lease_table_add(LeaseTable *t, Lease *l) {
        User *owner = l->charge_lease.user;

        list_init(&l->holds);
        list_init(&l->tokens);
        list_init(&l->link_kept);
        l->kept = false;                /* lease_keep() makes it kept, once it has its hold */
        l->reclaim = (ReclaimMark){};
        list_init(&l->reclaim.link);
        list_link_tail(&t->leases, &l->link_table);
        list_link_tail(&owner->owned, &l->link_owner);
        hashmap_add(&t->by_id, &l->link_id);
        if (l->name)
                hashmap_add(&t->by_name, &l->link_name);
        t->n_leases++;
        t->n_published += l->name != NULL;
        t->device_leases[l->pool_device]++;
        t->generation++;
}

void lease_end(LeaseTable *t, Lease *l) {
        Hold *hold, *htmp;
        Token *tok, *ttmp;

        if (l->kept) {
                list_unlink(&l->link_kept);
                t->device_kept[l->pool_device] -= l->size;
        }
        reclaim_forget(&t->reclaim, l);
        lease_move_cancel(t, l);
        list_for_each_entry_safe(hold, htmp, &l->holds, link_lease) {
                list_unlink(&hold->link_lease);
                list_unlink(&hold->link_holder);
                free(hold);
        }
        list_for_each_entry_safe(tok, ttmp, &l->tokens, link)
                token_free(t, tok);
        for (size_t i = 0; i < l->n_slabs; i++) {
                if (l->foreign || t->closing)
                        pool_release(t->pool, l->slabs[i]);
                else
                        pool_reclaim(t->pool, l->slabs[i]);
        }
        if (l->name) {
                hashmap_remove(&t->by_name, &l->link_name);
                t->n_published--;
        }
        hashmap_remove(&t->by_id, &l->link_id);
        list_unlink(&l->link_table);
        list_unlink(&l->link_owner);
        user_charge_release(&l->charge_bytes);  /* may drop the owner's last reference: after its lists */
        user_charge_release(&l->charge_host);
        user_charge_release(&l->charge_lease);
        t->n_leases--;
        t->device_leases[l->pool_device]--;
        t->generation++;
        free(l->name_key);
        free(l->name_uids);
        free(l->slabs);
        free(l->label);
        free(l->move_message);
        free(l);
}

/* --- holds ---------------------------------------------------------------------------------------- */

Hold *lease_find_hold(const Lease *l, const Holder *h) {
        Hold *hold;

        /* A lease has few holders (the processes that share it); a process may hold thousands of leases. */
        list_for_each_entry(hold, &l->holds, link_lease)
                if (hold->holder == h)
                        return hold;
        return NULL;
}

void lease_add_hold(LeaseTable *t, Lease *l, Hold *hold, Holder *h, unsigned refs, bool readonly) {
        *hold = (Hold){ .lease = l, .holder = h, .refs = refs, .readonly = readonly };
        list_link_tail(&l->holds, &hold->link_lease);
        list_link_tail(&h->holds, &hold->link_holder);
        l->n_holds++;
        if (h->uid != l->uid)
                l->foreign = true;
        t->generation++;
}

void hold_ref(LeaseTable *t, Hold *hold, bool readonly) {
        hold->refs++;
        hold->readonly = hold->readonly && readonly;
        t->generation++;
}

bool hold_is_last(const Hold *hold) {
        return hold->lease->n_holds == 1 && !hold->lease->name;
}

void hold_end(LeaseTable *t, Hold *hold) {
        Lease *l = hold->lease;

        if (l->move && l->move->hold == hold)
                lease_move_cancel(t, l);        /* its process will never have the answer */
        list_unlink(&hold->link_lease);
        list_unlink(&hold->link_holder);
        l->n_holds--;
        free(hold);
        t->generation++;
        if (l->n_holds == 0 && !l->name)
                lease_end(t, l);
}

void hold_unref(LeaseTable *t, Hold *hold) {
        assert(hold->refs > 0);
        if (--hold->refs == 0)
                hold_end(t, hold);
        else
                t->generation++;
}

/* --- keeping ------------------------------------------------------------------------------------- */

void lease_keep(LeaseTable *t, Lease *l) {
        Hold *hold = list_first_entry(&l->holds, Hold, link_lease);
        Token *tok, *ttmp;

        assert(hold && l->n_holds == 1 && !l->kept);
        list_for_each_entry_safe(tok, ttmp, &l->tokens, link)
                token_free(t, tok);
        l->kept = true;
        list_link_tail(&hold->holder->kept, &l->link_kept);
        t->device_kept[l->pool_device] += l->size;
        reclaim_mark_kept(&t->reclaim, l);
        t->generation++;
}

void lease_unkeep(LeaseTable *t, Lease *l) {
        if (!l->kept)
                return;
        l->kept = false;
        list_unlink(&l->link_kept);
        t->device_kept[l->pool_device] -= l->size;
        (void)reclaim_unmark(&t->reclaim, l);
        t->generation++;
}

/* --- moves --------------------------------------------------------------------------------------- */

void lease_move_add(LeaseTable *t, Lease *l, LeaseMove *move) {
        assert(!l->move);
        move->lease = l;
        l->move = move;
        l->move_error = 0;              /* the last move's failure is no longer anyone's answer */
        l->move_message = mfree(l->move_message);
        list_link_tail(&t->moves, &move->link);
}

LeaseMove *lease_move_take(LeaseTable *t, Lease *l) {
        LeaseMove *move = l->move;

        if (!move)
                return NULL;
        list_unlink(&move->link);
        l->move = NULL;
        t->moves_ended++;
        return move;
}

void lease_move_cancel(LeaseTable *t, Lease *l) {
        LeaseMove *move = lease_move_take(t, l);

        if (!move)
                return;
        /* The owner's content at most: scrubbed and kept for the next park. */
        for (size_t i = 0; i < move->n_slabs; i++) {
                if (t->closing)
                        pool_release(t->pool, move->slabs[i]);
                else
                        pool_reclaim(t->pool, move->slabs[i]);
        }
        user_charge_release(&move->charge);
        free(move->slabs);
        free(move);
}

/* --- tokens and names ----------------------------------------------------------------------------- */

void lease_add_token(LeaseTable *t, Lease *l, Token *tok) {
        tok->lease = l;
        list_link_tail(&l->tokens, &tok->link);
        hashmap_add(&t->by_token, &tok->link_table);
        l->n_tokens++;
        t->generation++;
}

void token_free(LeaseTable *t, Token *tok) {
        if (!tok)
                return;
        list_unlink(&tok->link);
        hashmap_remove(&t->by_token, &tok->link_table);
        tok->lease->n_tokens--;
        t->generation++;
        free(tok);
}

void lease_set_name(LeaseTable *t, Lease *l, char *key, uid_t *uids, size_t n_uids, bool readonly) {
        if (l->name)
                free(key);      /* its own name already: only who may attach changes */
        else {
                l->name_key = key;
                l->name = strchr(key, '/') + 1;
                hashmap_add(&t->by_name, &l->link_name);
                t->n_published++;
        }
        free(l->name_uids);
        l->name_uids = uids;
        l->n_name_uids = n_uids;
        l->name_readonly = readonly;
        t->generation++;
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
        hashmap_remove(&t->by_name, &l->link_name);
        free(l->name_key);
        l->name_key = NULL;
        l->name = NULL;
        free(l->name_uids);
        l->name_uids = NULL;
        l->n_name_uids = 0;
        l->name_readonly = false;
        t->n_published--;
        t->generation++;
        if (l->n_holds == 0)
                lease_end(t, l);
}

int lease_random_hex(char *out, size_t digits) {
        static const char hex[16] = "0123456789abcdef";
        uint8_t b[32];

        assert(digits % 2 == 0 && digits / 2 <= sizeof(b));
        if (getrandom(b, digits / 2, 0) != (ssize_t)(digits / 2))
                return -errno ?: -EIO;
        /* Every Alloc makes one: a table look-up per digit, not a snprintf() per byte */
        for (size_t i = 0; i < digits / 2; i++) {
                out[2 * i] = hex[b[i] >> 4];
                out[2 * i + 1] = hex[b[i] & 0xf];
        }
        out[digits] = 0;
        return 0;
}
