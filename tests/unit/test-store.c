/* SPDX-License-Identifier: MIT */

/*
 * daemon/store.c: the lease table as a log of change records in one memfd.
 * Every op and field read back; replace and end semantics; compaction to a
 * new generation; the bytes a commit writes not depending on the table; a
 * fault at every step of storing (the store goes on, and what the service
 * manager holds reads back as exactly the acknowledged changes); a crash at
 * every step, in a forked child; hostile files (cut at every byte, bits
 * flipped, counts out of range, other magic or version) read without a crash.
 * Leases, holders, tokens and slabs are plain structs made by hand: no pool,
 * no driver.
 */

#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "json.h"
#include "lease.h"
#include "macro.h"
#include "state.h"
#include "store.h"
#include "unit.h"

#define MiB (UINT64_C(1) << 20)

#include "fake-fdstore.h"

static Fake fake;
static Store *store;

static Store *new_store(Fake *f) {
        StoreBackend b = { .save = fake_save, .remove = fake_remove, .userdata = f };
        Store *s = NULL;

        ck_assert_int_eq(store_new(&s, &b), 0);
        return s;
}

/* ---- a lease table made by hand -------------------------------------------------------------------------------- */

static LeaseTable table;
static Holder holders[8];

static void table_init(void) {
        table = (LeaseTable){};
        list_init(&table.leases);
        for (size_t i = 0; i < ELEMENTSOF(holders); i++) {
                holders[i] = (Holder){ .pid = 100 + (pid_t)i, .uid = 1000 + (uid_t)(i % 3),
                                       .gid = 2000 + (gid_t)(i % 3), .start_time = 5000 + i };
                snprintf(holders[i].comm, sizeof(holders[i].comm), "proc-%zu", i);
        }
}

static Hold *find_hold(Lease *l, const Holder *h) {
        Hold *hold;

        list_for_each_entry(hold, &l->holds, link_lease)
                if (hold->holder == h)
                        return hold;
        return NULL;
}

static void drop_hold(Lease *l, Hold *hold) {
        list_unlink(&hold->link_lease);
        l->n_holds--;
        free(hold);
}

static void drop_token(Lease *l, Token *tok) {
        list_unlink(&tok->link);
        l->n_tokens--;
        free(tok);
}

static void drop_lease(Lease *l) {
        Hold *hold, *h2;
        Token *tok, *t2;

        list_for_each_entry_safe(hold, h2, &l->holds, link_lease)
                drop_hold(l, hold);
        list_for_each_entry_safe(tok, t2, &l->tokens, link)
                drop_token(l, tok);
        list_unlink(&l->link_table);
        table.n_leases--;
        for (size_t i = 0; i < l->n_slabs; i++)
                free(l->slabs[i]);
        free(l->slabs);
        free(l->label);
        free(l->name);
        free(l->name_uids);
        free(l);
}

static void table_done(void) {
        Lease *l, *tmp;

        if (!table.leases.next)
                return;
        list_for_each_entry_safe(l, tmp, &table.leases, link_table)
                drop_lease(l);
        table = (LeaseTable){};
}

/* Lease number n: an id from n, 1 + n % 3 slabs, owned by holders[n % 3]'s user. */
static Lease *mk_lease(unsigned n, const char *label) {
        Lease *l = calloc(1, sizeof(*l));

        ck_assert_ptr_nonnull(l);
        snprintf(l->id, sizeof(l->id), "%032x", n);
        l->device = (int)(n % 2);
        l->created_usec = 1700000000000000 + n;
        l->label = label ? strdup(label) : NULL;
        l->uid = holders[n % 3].uid;
        l->pid = 100 + (pid_t)(n % 3);
        snprintf(l->comm, sizeof(l->comm), "maker-%u", n % 100);
        l->n_slabs = 1 + n % 3;
        l->slabs = calloc(l->n_slabs, sizeof(Slab *));
        ck_assert_ptr_nonnull(l->slabs);
        for (size_t i = 0; i < l->n_slabs; i++) {
                l->slabs[i] = calloc(1, sizeof(Slab));
                ck_assert_ptr_nonnull(l->slabs[i]);
                l->slabs[i]->id = (uint64_t)n * 4 + i + 1;
                l->slabs[i]->size = (2 * MiB) << i;
                l->size += l->slabs[i]->size;
        }
        list_init(&l->holds);
        list_init(&l->tokens);
        list_link_tail(&table.leases, &l->link_table);
        table.n_leases++;
        return l;
}

static Hold *mk_hold(Lease *l, Holder *h, unsigned refs, bool readonly) {
        Hold *hold = calloc(1, sizeof(*hold));

        ck_assert_ptr_nonnull(hold);
        *hold = (Hold){ .lease = l, .holder = h, .refs = refs, .readonly = readonly };
        list_link_tail(&l->holds, &hold->link_lease);
        l->n_holds++;
        if (h->uid != l->uid)
                l->foreign = true;
        return hold;
}

static Token *mk_token(Lease *l, unsigned n, uid_t uid, uid_t creator, bool readonly) {
        Token *tok = calloc(1, sizeof(*tok));

        ck_assert_ptr_nonnull(tok);
        snprintf(tok->token, sizeof(tok->token), "%016x%016x", 0xabcu, n);
        tok->uid = uid;
        tok->creator = creator;
        tok->readonly = readonly;
        tok->lease = l;
        list_link_tail(&l->tokens, &tok->link);
        l->n_tokens++;
        return tok;
}

static void publish(Lease *l, const char *name, const uid_t *uids, size_t n, bool readonly) {
        free(l->name);
        free(l->name_uids);
        l->name = strdup(name);
        l->name_uids = n ? calloc(n, sizeof(uid_t)) : NULL;
        if (n)
                memcpy(l->name_uids, uids, n * sizeof(uid_t));
        l->n_name_uids = n;
        l->name_readonly = readonly;
}

/* Stores a whole lease (as made) in one change. */
static int commit_lease(Store *s, Lease *l) {
        Hold *hold;
        Token *tok;

        store_begin(s);
        ck_assert_int_eq(store_put_lease(s, l), 0);
        list_for_each_entry(tok, &l->tokens, link)
                ck_assert_int_eq(store_put_token(s, l->id, tok), 0);
        list_for_each_entry(hold, &l->holds, link_lease)
                ck_assert_int_eq(store_put_hold(s, l->id, hold->holder, hold->refs, hold->readonly, hold->parked), 0);
        return store_commit(s);
}

/* ---- comparing ------------------------------------------------------------------------------------------------ */

static void assert_same_comm(const char *read_back, const char *comm) {
        if (json_string_is_printable(comm, strlen(comm), false))
                ck_assert_str_eq(read_back, comm);
        else
                ck_assert_uint_eq(strlen(read_back), strlen(comm));
}

static void assert_same_lease(const Lease *l, const StateLease *s) {
        const Hold *hold;
        const Token *tok;
        size_t k;

        ck_assert_str_eq(s->id, l->id);
        ck_assert_int_eq(s->device, l->device);
        ck_assert_uint_eq(s->size, l->size);
        ck_assert_uint_eq(s->created_usec, l->created_usec);
        if (l->label)
                ck_assert_str_eq(s->label, l->label);
        else
                ck_assert_ptr_null(s->label);
        ck_assert_uint_eq(s->uid, l->uid);
        ck_assert_int_eq(s->pid, l->pid);
        assert_same_comm(s->comm, l->comm);
        ck_assert_int_eq(s->foreign, l->foreign);
        ck_assert_int_eq(s->parked, l->parked);
        ck_assert_uint_eq(s->n_slabs, l->n_slabs);
        for (size_t i = 0; i < l->n_slabs; i++) {
                ck_assert_uint_eq(s->slabs[i].id, l->slabs[i]->id);
                ck_assert_uint_eq(s->slabs[i].size, l->slabs[i]->size);
        }
        if (l->name) {
                ck_assert_str_eq(s->name, l->name);
                ck_assert_uint_eq(s->n_name_uids, l->n_name_uids);
                for (size_t i = 0; i < l->n_name_uids; i++)
                        ck_assert_uint_eq(s->name_uids[i], l->name_uids[i]);
                ck_assert_int_eq(s->name_readonly, l->name_readonly);
        } else {
                ck_assert_ptr_null(s->name);
                ck_assert_uint_eq(s->n_name_uids, 0);
                ck_assert(!s->name_readonly);
        }
        ck_assert_uint_eq(s->n_tokens, l->n_tokens);
        if (l->n_tokens == 0)
                ck_assert_ptr_null(s->tokens);
        k = 0;
        list_for_each_entry(tok, &l->tokens, link) {
                ck_assert_str_eq(s->tokens[k].token, tok->token);
                ck_assert_uint_eq(s->tokens[k].uid, tok->uid);
                ck_assert_uint_eq(s->tokens[k].creator, tok->creator);
                ck_assert_int_eq(s->tokens[k].readonly, tok->readonly);
                k++;
        }
        ck_assert_uint_eq(s->n_holds, l->n_holds);
        if (l->n_holds == 0)
                ck_assert_ptr_null(s->holds);
        k = 0;
        list_for_each_entry(hold, &l->holds, link_lease) {
                const StateHold *sh = &s->holds[k++];

                ck_assert_int_eq(sh->pid, hold->holder->pid);
                ck_assert_uint_eq(sh->start_time, hold->holder->start_time);
                ck_assert_uint_eq(sh->uid, hold->holder->uid);
                ck_assert_uint_eq(sh->gid, hold->holder->gid);
                assert_same_comm(sh->comm, hold->holder->comm);
                ck_assert_uint_eq(sh->refs, hold->refs);
                ck_assert_int_eq(sh->readonly, hold->readonly);
                ck_assert_int_eq(sh->parked, hold->parked);
        }
}

/* The state is the table, lease for lease, in order. */
static void assert_same_table(const State *s) {
        const Lease *l;
        size_t i = 0;

        ck_assert_uint_eq(s->n_leases, table.n_leases);
        list_for_each_entry(l, &table.leases, link_table)
                assert_same_lease(l, &s->leases[i++]);
}

static void assert_fd_is_table(int fd) {
        _cleanup_(state_done) State s = {};
        _cleanup_free_ char *message = NULL;
        int k = store_read(fd, &s, &message);

        ck_assert_msg(k == 0, "store_read: %d %s", k, message ?: "");
        assert_same_table(&s);
}

/* What the service manager holds reads back as the table. */
static void assert_stored_is_table(void) {
        assert_fd_is_table(fake_latest(&fake));
}

static void teardown(void) {
        store = store_free(store);
        fake_done(&fake);
        table_done();
}

/* ---- tests ---------------------------------------------------------------------------------------------------- */

START_TEST(test_round_trip) {
        Lease *a, *b, *c, *d;
        Token *tok;
        Hold *hold;
        StoreStats st;

        table_init();
        store = new_store(&fake);
        ck_assert(!store_is_open(store));
        ck_assert_uint_eq(store_stats(store).generation, 0);

        /* Every field: a label, two tokens (one for anyone), a read-only hold of another user (foreign). */
        a = mk_lease(1, "training run 7");
        mk_token(a, 1, 1001, 1000, true);
        mk_token(a, 2, UID_ANY, 1000, false);
        mk_hold(a, &holders[1], 2, false);
        mk_hold(a, &holders[2], 1, true);
        ck_assert(a->foreign);
        /* Published, with users, read-only, nobody holding it. */
        b = mk_lease(2, NULL);
        publish(b, "team/b:1", (const uid_t[]){ 1000, 1002 }, 2, true);
        /* Published with no users; a command name that is not UTF-8 (written with '?'). */
        c = mk_lease(3, "");
        publish(c, "orphan", NULL, 0, false);
        snprintf(c->comm, sizeof(c->comm), "\xff\xfe" "bad");
        holders[3].comm[0] = '\x01';
        mk_hold(c, &holders[3], 7, false);

        ck_assert_int_eq(store_snapshot(store, &table), 0);
        ck_assert(store_is_open(store));
        st = store_stats(store);
        ck_assert_uint_eq(st.generation, 1);
        ck_assert_uint_eq(st.snapshots, 1);
        ck_assert_uint_eq(st.messages, 1);
        ck_assert_uint_eq(fake.n, 1);
        ck_assert_str_eq(fake.names[0], "table-1");
        assert_stored_is_table();
        {
                _cleanup_(state_done) State s = {};

                ck_assert_int_eq(store_read(fake_latest(&fake), &s, NULL), 0);
                ck_assert_str_eq(s.leases[2].comm, "??bad");
                ck_assert_str_eq(s.leases[2].holds[0].comm, "?roc-3");
                ck_assert_uint_eq(s.leases[0].tokens[1].uid, UID_ANY);
                ck_assert_str_eq(s.leases[2].label, "");
        }

        /* Changes of every kind, each its own commit, none sent to the service manager. */
        d = mk_lease(4, "new");
        mk_hold(d, &holders[4], 1, false);
        mk_token(d, 3, 1004, 1001, true);
        ck_assert_int_eq(commit_lease(store, d), 0);
        assert_stored_is_table();

        tok = list_first_entry(&a->tokens, Token, link);
        store_begin(store);
        ck_assert_int_eq(store_end_token(store, tok->token), 0);
        ck_assert_int_eq(store_commit(store), 0);
        drop_token(a, tok);
        assert_stored_is_table();

        hold = find_hold(a, &holders[1]);
        store_begin(store);
        ck_assert_int_eq(store_end_hold(store, a->id, hold->holder), 0);
        ck_assert_int_eq(store_commit(store), 0);
        drop_hold(a, hold);
        assert_stored_is_table();

        /* Attached again: a new hold goes last, as in the table. */
        hold = mk_hold(a, &holders[5], 3, true);
        store_begin(store);
        ck_assert_int_eq(store_put_hold(store, a->id, hold->holder, hold->refs, hold->readonly, hold->parked), 0);
        ck_assert_int_eq(store_commit(store), 0);
        assert_stored_is_table();

        /* Published then unpublished: the lease replaced, its holds and tokens kept. */
        publish(d, "d", (const uid_t[]){ 7 }, 1, false);
        store_begin(store);
        ck_assert_int_eq(store_put_lease(store, d), 0);
        ck_assert_int_eq(store_commit(store), 0);
        assert_stored_is_table();
        free(d->name);
        free(d->name_uids);
        d->name = NULL;
        d->name_uids = NULL;
        d->n_name_uids = 0;
        d->name_readonly = false;
        free(d->label);
        d->label = NULL;
        store_begin(store);
        ck_assert_int_eq(store_put_lease(store, d), 0);
        ck_assert_int_eq(store_commit(store), 0);
        assert_stored_is_table();

        /* The lease ends, with its holds and tokens. */
        store_begin(store);
        ck_assert_int_eq(store_end_lease(store, b->id), 0);
        ck_assert_int_eq(store_commit(store), 0);
        drop_lease(b);
        assert_stored_is_table();

        st = store_stats(store);
        ck_assert_uint_eq(st.commits, 7);
        ck_assert_uint_eq(st.failures, 0);
        ck_assert_uint_eq(st.messages, 1);             /* only the snapshot's */
        ck_assert_uint_eq(fake.saves, 1);
        ck_assert_uint_eq(fake.removes, 0);
        ck_assert_uint_gt(st.log_bytes, st.snapshot_bytes);
        ck_assert(!store_wants_snapshot(store));
}
END_TEST

START_TEST(test_replace) {
        _cleanup_(state_done) State s = {};
        Lease *a;
        Token *tok;
        Hold *hold;

        table_init();
        store = new_store(&fake);
        a = mk_lease(1, "x");
        hold = mk_hold(a, &holders[0], 1, true);
        tok = mk_token(a, 1, 1001, 1000, false);
        ck_assert_int_eq(store_snapshot(store, &table), 0);

        /* The same hold again: one hold, the last refs and flags. A token again: replaced. Several ops in one
         * change, applied in order. */
        store_begin(store);
        ck_assert_int_eq(store_put_hold(store, a->id, &holders[0], 4, true, false), 0);
        ck_assert_int_eq(store_put_hold(store, a->id, &holders[0], 5, false, true), 0);
        tok->readonly = true;
        tok->uid = UID_ANY;
        ck_assert_int_eq(store_put_token(store, a->id, tok), 0);
        ck_assert_int_eq(store_commit(store), 0);
        hold->refs = 5;
        hold->readonly = false;
        hold->parked = true;
        assert_stored_is_table();

        /* A lease replaced keeps its holds and tokens; a different uid's hold and foreign. */
        a->device = 1;
        a->foreign = true;
        hold = mk_hold(a, &holders[1], 1, false);
        store_begin(store);
        ck_assert_int_eq(store_put_lease(store, a), 0);
        ck_assert_int_eq(store_put_hold(store, a->id, hold->holder, 1, false, false), 0);
        ck_assert_int_eq(store_commit(store), 0);
        assert_stored_is_table();

        /* Ends are idempotent: a hold, token or lease that is not there is nothing to end. */
        store_begin(store);
        ck_assert_int_eq(store_end_hold(store, a->id, &holders[7]), 0);
        ck_assert_int_eq(store_end_token(store, "0123456789abcdef0123456789abcdef"), 0);
        ck_assert_int_eq(store_end_lease(store, "0123456789abcdef0123456789abcdef"), 0);
        ck_assert_int_eq(store_commit(store), 0);
        assert_stored_is_table();

        /* An aborted change writes nothing; an empty one neither. */
        store_begin(store);
        ck_assert_int_eq(store_end_lease(store, a->id), 0);
        store_abort(store);
        {
                uint64_t before = store_stats(store).log_bytes;

                store_begin(store);
                ck_assert_int_eq(store_commit(store), 0);
                ck_assert_uint_eq(store_stats(store).log_bytes, before);
        }
        assert_stored_is_table();

        /* A lease ended and made again under its id (a new lease): none of the old holds come back. */
        store_begin(store);
        ck_assert_int_eq(store_end_lease(store, a->id), 0);
        ck_assert_int_eq(store_put_lease(store, a), 0);
        ck_assert_int_eq(store_commit(store), 0);
        ck_assert_int_eq(store_read(fake_latest(&fake), &s, NULL), 0);
        ck_assert_uint_eq(s.n_leases, 1);
        ck_assert_uint_eq(s.leases[0].n_holds, 0);
        ck_assert_uint_eq(s.leases[0].n_tokens, 0);
}
END_TEST

START_TEST(test_not_open) {
        Lease *a;

        table_init();
        store = new_store(&fake);
        a = mk_lease(1, NULL);
        ck_assert_int_eq(commit_lease(store, a), -ENOLINK);
        ck_assert_uint_eq(store_stats(store).failures, 1);
        ck_assert_uint_eq(fake.saves, 0);
        ck_assert(!store_wants_snapshot(store));

        /* Numbering goes on from a table read back at start: the first snapshot replaces it. */
        store_set_generation(store, 41);
        ck_assert_uint_eq(store_stats(store).generation, 0);
        ck_assert_int_eq(store_snapshot(store, &table), 0);
        ck_assert_uint_eq(store_stats(store).generation, 42);
        ck_assert_str_eq(fake.names[0], "table-42");
        ck_assert_uint_eq(fake.removes, 1);            /* "table-41", which the fake does not have */
        store_set_generation(store, 7);                 /* ignored once open */
        ck_assert_uint_eq(store_stats(store).generation, 42);
        assert_stored_is_table();
}
END_TEST

START_TEST(test_compaction) {
        _cleanup_(state_done) State before = {}, after = {};
        Lease *l, *tmp;
        StoreStats st;
        unsigned n = 0;

        table_init();
        store = new_store(&fake);
        for (; n < 20; n++)
                mk_hold(mk_lease(n, "old"), &holders[n % 3], 1, false);
        ck_assert_int_eq(store_snapshot(store, &table), 0);

        /* Churn until the log asks to be compacted. */
        while (!store_wants_snapshot(store)) {
                l = mk_lease(n++, "churn");
                mk_hold(l, &holders[l->uid - 1000], 1, false);
                ck_assert_int_eq(commit_lease(store, l), 0);
                store_begin(store);
                ck_assert_int_eq(store_end_hold(store, l->id, &holders[l->uid - 1000]), 0);
                ck_assert_int_eq(store_end_lease(store, l->id), 0);
                ck_assert_int_eq(store_commit(store), 0);
                drop_lease(l);
        }
        st = store_stats(store);
        ck_assert_uint_gt(st.log_bytes, 2 * st.snapshot_bytes + MiB);
        ck_assert_int_eq(store_read(fake_latest(&fake), &before, NULL), 0);
        assert_same_table(&before);

        ck_assert_int_eq(store_snapshot(store, &table), 0);
        st = store_stats(store);
        ck_assert_uint_eq(st.generation, 2);
        ck_assert_uint_eq(st.snapshots, 2);
        ck_assert_uint_eq(st.messages, 3);             /* save 1; save 2, remove 1 */
        ck_assert_uint_eq(fake.n, 1);
        ck_assert_str_eq(fake.names[0], "table-2");
        ck_assert(!store_wants_snapshot(store));
        ck_assert_uint_lt(st.log_bytes, 64 * 1024);
        ck_assert_int_eq(store_read(fake_latest(&fake), &after, NULL), 0);
        assert_same_table(&after);

        /* And it goes on from there. */
        list_for_each_entry_safe(l, tmp, &table.leases, link_table) {
                store_begin(store);
                ck_assert_int_eq(store_end_lease(store, l->id), 0);
                ck_assert_int_eq(store_commit(store), 0);
                drop_lease(l);
                break;
        }
        assert_stored_is_table();
}
END_TEST

/* The bytes one Alloc-like and one Free-like change add to the log, with n leases in the table. */
static void commit_bytes(unsigned n, uint64_t *ret_alloc, uint64_t *ret_free) {
        Fake f = {};
        Store *s = new_store(&f);
        uint64_t b0, b1, b2;
        Lease *l;

        table_init();
        for (unsigned i = 0; i < n; i++)
                mk_hold(mk_lease(i, "filler"), &holders[i % 3], 1, false);
        ck_assert_int_eq(store_snapshot(s, &table), 0);
        l = mk_lease(n, "measured");
        mk_hold(l, &holders[n % 3], 1, false);
        snprintf(l->id, sizeof(l->id), "%032x", 0xfffffffu);
        snprintf(l->comm, sizeof(l->comm), "measured");
        for (size_t i = 0; i < l->n_slabs; i++)
                l->slabs[i]->id = UINT64_C(1) << 40 | i;
        b0 = store_stats(s).log_bytes;
        ck_assert_int_eq(commit_lease(s, l), 0);
        b1 = store_stats(s).log_bytes;
        store_begin(s);
        ck_assert_int_eq(store_end_hold(s, l->id, &holders[n % 3]), 0);
        ck_assert_int_eq(store_end_lease(s, l->id), 0);
        ck_assert_int_eq(store_commit(s), 0);
        b2 = store_stats(s).log_bytes;
        *ret_alloc = b1 - b0;
        *ret_free = b2 - b1;
        ck_assert_uint_eq(store_stats(s).messages, 1);
        store_free(s);
        fake_done(&f);
        table_done();
}

START_TEST(test_commit_cost) {
        uint64_t a10, f10, a10k, f10k;

        /* n % 3 is the same for both, so the measured lease has as many slabs. */
        commit_bytes(12, &a10, &f10);
        commit_bytes(10002, &a10k, &f10k);
        ck_assert_uint_eq(a10, a10k);
        ck_assert_uint_eq(f10, f10k);
        ck_assert_uint_lt(a10, 256);
        ck_assert_uint_lt(f10, 128);
}
END_TEST

START_TEST(test_seals) {
        _cleanup_(state_done) State s = {};
        struct stat st;
        int fd;
        char c = 'x';

        table_init();
        store = new_store(&fake);
        mk_lease(1, NULL);
        ck_assert_int_eq(store_snapshot(store, &table), 0);
        fd = fake_latest(&fake);
        ck_assert_int_eq(fcntl(fd, F_GET_SEALS), F_SEAL_SHRINK | F_SEAL_SEAL);
        ck_assert_int_eq(fstat(fd, &st), 0);
        ck_assert_int_eq(ftruncate(fd, 1), -1);
        ck_assert_int_eq(errno, EPERM);
        ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE), -1);
        ck_assert_int_eq(fcntl(fd, F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
        /* Reading neither needs nor moves the offset. */
        ck_assert_int_eq(lseek(fd, 5, SEEK_SET), 5);
        ck_assert_int_eq(store_read(fd, &s, NULL), 0);
        ck_assert_int_eq(lseek(fd, 0, SEEK_CUR), 5);
        ck_assert_uint_eq(s.n_leases, 1);
        (void)c;
}
END_TEST

/* ---- faults and crashes --------------------------------------------------------------------------------------- */

/* Stores lease n (with a hold) as a change; it stays in the table only if the commit succeeded. */
static int try_commit(Store *s, unsigned n) {
        Lease *l = mk_lease(n, "label of some length, to make the records longer");
        int k;

        mk_hold(l, &holders[n % 3], 1, n % 2);
        k = commit_lease(s, l);
        if (k < 0)
                drop_lease(l);
        return k;
}

static const char *step_name[] = { "write", "grow", "seal", "notify" };

START_TEST(test_fault_commit) {
        unsigned n = 0;
        int k;

        for (StoreStep step = STORE_STEP_WRITE; step <= STORE_STEP_GROW; step++) {
                table_init();
                store = new_store(&fake);
                for (; n < 5; n++)
                        mk_lease(n, NULL);
                ck_assert_int_eq(store_snapshot(store, &table), 0);
                ck_assert_int_eq(try_commit(store, n++), 0);

                /* The next write or growth fails; a growth happens only when the memfd is full. */
                store_inject_fault(store, step, 1, -ENOSPC, false);
                for (k = 0; k == 0; n++)
                        k = try_commit(store, n);
                ck_assert_msg(k == -ENOSPC, "%s: %d", step_name[step], k);
                ck_assert_uint_eq(store_stats(store).failures, 1);
                assert_stored_is_table();

                /* It goes on: a shorter record next (no label) over what the failed one left. */
                {
                        Lease *l = mk_lease(n++, NULL);

                        ck_assert_int_eq(commit_lease(store, l), 0);
                }
                assert_stored_is_table();
                for (unsigned i = 0; i < 3; i++)
                        ck_assert_int_eq(try_commit(store, n++), 0);
                assert_stored_is_table();
                ck_assert_uint_eq(fake.saves, 1);

                /* Failed twice in a row at one offset, then stored. */
                store_inject_fault(store, STORE_STEP_WRITE, 1, -EIO, false);
                ck_assert_int_eq(try_commit(store, n++), -EIO);
                store_inject_fault(store, STORE_STEP_WRITE, 1, -EIO, false);
                ck_assert_int_eq(try_commit(store, n++), -EIO);
                ck_assert_int_eq(try_commit(store, n++), 0);
                assert_stored_is_table();

                store = store_free(store);
                fake_done(&fake);
                table_done();
        }
}
END_TEST

START_TEST(test_fault_snapshot) {
        for (StoreStep step = STORE_STEP_WRITE; step < _STORE_STEP_MAX; step++) {
                unsigned n = 0;
                StoreStats st;

                /* The first snapshot fails: nothing is stored, commits fail, a second try works. */
                table_init();
                store = new_store(&fake);
                mk_lease(n++, NULL);
                store_inject_fault(store, step, 1, -ENOSPC, false);
                ck_assert_int_eq(store_snapshot(store, &table), -ENOSPC);
                ck_assert(!store_is_open(store));
                ck_assert_uint_eq(fake.n, 0);
                ck_assert_int_eq(try_commit(store, n++), -ENOLINK);
                ck_assert_int_eq(store_snapshot(store, &table), 0);
                ck_assert_int_eq(try_commit(store, n++), 0);

                /* A compaction fails: the store goes on in the memfd it had, generation 1. */
                store_inject_fault(store, step, 1, -EMFILE, false);
                ck_assert_int_eq(store_snapshot(store, &table), -EMFILE);
                st = store_stats(store);
                ck_assert_uint_eq(st.generation, 1);
                ck_assert_uint_eq(st.failures, 3);
                ck_assert_uint_eq(fake.n, 1);
                ck_assert_str_eq(fake.names[0], "table-1");
                ck_assert_int_eq(try_commit(store, n++), 0);
                assert_stored_is_table();

                /* And compacts later. */
                ck_assert_int_eq(store_snapshot(store, &table), 0);
                ck_assert_uint_eq(store_stats(store).generation, 2);
                ck_assert_int_eq(try_commit(store, n++), 0);
                ck_assert_uint_eq(fake.n, 1);
                assert_stored_is_table();

                store = store_free(store);
                fake_done(&fake);
                table_done();
        }
}
END_TEST

/*
 * Runs `what` in a child that crashes at `step`: the child shares the memfd (fork keeps the store's fd and
 * the fake's dups), and dies with SIGABRT. Returns nothing: the parent then reads what is stored.
 */
static void crash_child(StoreStep step, bool snapshot, unsigned n) {
        pid_t pid;
        int status;

        pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
                struct rlimit no_core = {};

                (void)setrlimit(RLIMIT_CORE, &no_core);
                store_inject_fault(store, step, 1, 0, true);
                if (snapshot)
                        (void)store_snapshot(store, &table);
                else
                        for (unsigned i = 0; i < 100000; i++)
                                (void)try_commit(store, n + i);
                _exit(0);       /* the crash did not come */
        }
        ck_assert_int_eq(waitpid(pid, &status, 0), pid);
        ck_assert_msg(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT, "%s: the child did not crash (%#x)",
                      step_name[step], (unsigned)status);
}

START_TEST(test_crash) {
        for (StoreStep step = STORE_STEP_WRITE; step < _STORE_STEP_MAX; step++)
                for (int snapshot = 0; snapshot <= 1; snapshot++) {
                        unsigned n = 0;

                        if (!snapshot && step > STORE_STEP_GROW)
                                continue;       /* a commit neither seals nor notifies */
                        table_init();
                        store = new_store(&fake);
                        for (; n < 3; n++)
                                mk_hold(mk_lease(n, "before"), &holders[n % 3], 1, false);
                        ck_assert_int_eq(store_snapshot(store, &table), 0);
                        for (; n < 6; n++)
                                ck_assert_int_eq(try_commit(store, n), 0);

                        /* The child changes the table (a lease more) and dies storing it. */
                        if (snapshot)
                                mk_lease(1000, "never stored");
                        crash_child(step, snapshot, 2000);
                        if (snapshot) {
                                Lease *l = list_last_entry(&table.leases, Lease, link_table);

                                drop_lease(l);
                                /* The new memfd never reached the service manager. */
                                ck_assert_uint_eq(fake.n, 1);
                        }
                        /* Exactly what was acknowledged: the child's commits of leases 2000.. that returned 0
                         * before the crash are in the log too; the parent's table does not have them. */
                        {
                                _cleanup_(state_done) State s = {};
                                _cleanup_free_ char *message = NULL;
                                size_t extra;

                                ck_assert_int_eq(store_read(fake_latest(&fake), &s, &message), 0);
                                ck_assert_uint_ge(s.n_leases, table.n_leases);
                                extra = s.n_leases - table.n_leases;
                                /* Those acknowledged in the child: 2000, 2001, ... in order, none torn. */
                                for (size_t i = 0; i < extra; i++) {
                                        char id[33];

                                        snprintf(id, sizeof(id), "%032x", 2000 + (unsigned)i);
                                        ck_assert_str_eq(s.leases[table.n_leases + i].id, id);
                                        ck_assert_uint_eq(s.leases[table.n_leases + i].n_holds, 1);
                                }
                                if (step == STORE_STEP_WRITE && !snapshot)
                                        ck_assert_uint_eq(extra, 0);
                                s.n_leases = table.n_leases;
                                assert_same_table(&s);
                                s.n_leases += extra;
                        }

                        /* A restarted daemon: reads what is stored, stores it anew, goes on. Replays agree. */
                        {
                                _cleanup_(state_done) State s = {};
                                Store *again = new_store(&fake);
                                Lease *l, *tmp;

                                ck_assert_int_eq(store_read(fake_latest(&fake), &s, NULL), 0);
                                /* The table as read: drop from the model what the child had and the parent
                                 * does not (it is in the state), by storing the model, which wins. */
                                store_set_generation(again, store_stats(store).generation);
                                ck_assert_int_eq(store_snapshot(again, &table), 0);
                                store = store_free(store);
                                store = again;
                                ck_assert_uint_eq(fake.n, 1);
                                for (unsigned i = 0; i < 3; i++)
                                        ck_assert_int_eq(try_commit(store, 3000 + i), 0);
                                list_for_each_entry_safe(l, tmp, &table.leases, link_table) {
                                        store_begin(store);
                                        ck_assert_int_eq(store_end_lease(store, l->id), 0);
                                        ck_assert_int_eq(store_commit(store), 0);
                                        drop_lease(l);
                                        break;
                                }
                                assert_stored_is_table();
                                assert_stored_is_table();
                        }
                        store = store_free(store);
                        fake_done(&fake);
                        table_done();
                }
}
END_TEST

/* ---- hostile files -------------------------------------------------------------------------------------------- */

/* CRC-32C, bit by bit: an implementation of its own, so that the store's is checked against it. */
static uint32_t test_crc32c(const uint8_t *p, size_t n) {
        uint32_t c = UINT32_MAX;

        while (n--) {
                c ^= *p++;
                for (int i = 0; i < 8; i++)
                        c = c & 1 ? (c >> 1) ^ 0x82f63b78 : c >> 1;
        }
        return ~c;
}

static int bytes_fd(const void *data, size_t len) {
        int fd = memfd_create("test-store", MFD_CLOEXEC);

        ck_assert_int_ge(fd, 0);
        ck_assert_int_eq(pwrite(fd, data, len, 0), (ssize_t)len);
        return fd;
}

/* Reads bytes as a stored table; on failure checks the contract (a sentence, nothing left). */
static int read_bytes(const void *data, size_t len, State *ret, char **ret_message) {
        _cleanup_close_ int fd = bytes_fd(data, len);
        int k;

        *ret = (State){ .n_leases = 4242 };
        k = store_read(fd, ret, ret_message);
        if (k < 0) {
                ck_assert_msg(k == -EBADMSG || k == -EPROTONOSUPPORT, "%d", k);
                ck_assert_ptr_null(ret->leases);
                ck_assert_uint_eq(ret->n_leases, 0);
                if (ret_message)
                        ck_assert_ptr_nonnull(*ret_message);
        }
        return k;
}

/* A small log: a snapshot of 2 leases, then 4 records each adding one. *ret_ends: where each record ends. */
static uint8_t *small_log(size_t *ret_len, size_t ret_ends[static 5]) {
        struct stat st;
        uint8_t *data;
        int fd;

        table_init();
        store = new_store(&fake);
        mk_token(mk_lease(0, "zero"), 1, UID_ANY, 1000, true);
        publish(mk_lease(1, NULL), "one", (const uid_t[]){ 5 }, 1, true);
        ck_assert_int_eq(store_snapshot(store, &table), 0);
        ret_ends[0] = store_stats(store).log_bytes;
        for (unsigned i = 0; i < 4; i++) {
                ck_assert_int_eq(try_commit(store, 2 + i), 0);
                ret_ends[i + 1] = store_stats(store).log_bytes;
        }
        fd = fake_latest(&fake);
        ck_assert_int_eq(fstat(fd, &st), 0);
        ck_assert_uint_ge((uint64_t)st.st_size, ret_ends[4]);
        data = malloc(ret_ends[4]);
        ck_assert_ptr_nonnull(data);
        ck_assert_int_eq(pread(fd, data, ret_ends[4], 0), (ssize_t)ret_ends[4]);
        *ret_len = ret_ends[4];
        return data;
}

START_TEST(test_hostile_truncated) {
        _cleanup_free_ uint8_t *data = NULL;
        size_t len, ends[5];

        data = small_log(&len, ends);
        /* The checksums are CRC-32C as anyone computes it. */
        ck_assert_uint_eq(test_crc32c((const uint8_t *)"123456789", 9), 0xe3069283);
        ck_assert_uint_eq(test_crc32c(data, 24), (uint32_t)data[24] | (uint32_t)data[25] << 8 |
                                                         (uint32_t)data[26] << 16 | (uint32_t)data[27] << 24);

        for (size_t cut = 0; cut <= len; cut++) {
                _cleanup_(state_done) State s = {};
                _cleanup_free_ char *message = NULL;
                size_t whole = 0;
                int k = read_bytes(data, cut, &s, &message);

                while (whole < 5 && ends[whole] <= cut)
                        whole++;
                if (whole == 0) {
                        ck_assert_msg(k == -EBADMSG, "cut at %zu: %d", cut, k);
                        continue;
                }
                /* The snapshot and the whole records before the cut: 2 leases, then one more per record. */
                ck_assert_msg(k == 0, "cut at %zu: %d %s", cut, k, message ?: "");
                ck_assert_uint_eq(s.n_leases, 2 + (whole - 1));
        }
}
END_TEST

/* A small deterministic generator (xorshift64*), so that a failure replays. */
static uint64_t rng_state = UINT64_C(0x9e3779b97f4a7c15);

static uint64_t rng(void) {
        rng_state ^= rng_state >> 12;
        rng_state ^= rng_state << 25;
        rng_state ^= rng_state >> 27;
        return rng_state * UINT64_C(2685821657736338717);
}

START_TEST(test_hostile_flips) {
        _cleanup_free_ uint8_t *data = NULL, *copy = NULL;
        size_t len, ends[5];
        unsigned accepted = 0, refused = 0;

        data = small_log(&len, ends);
        copy = malloc(len + 64);
        ck_assert_ptr_nonnull(copy);
        for (unsigned i = 0; i < 20000; i++) {
                _cleanup_(state_done) State s = {};
                _cleanup_free_ char *message = NULL;
                size_t n = len, at = rng() % len, whole = 0;
                unsigned flips = 1 + (unsigned)(rng() % 3);
                int k;

                memcpy(copy, data, len);
                for (unsigned f = 0; f < flips; f++) {
                        at = rng() % len;
                        copy[at] ^= (uint8_t)(1u << (rng() % 8));
                }
                if (rng() % 4 == 0) {           /* and some garbage after it */
                        for (unsigned j = 0; j < 64; j++)
                                copy[len + j] = (uint8_t)rng();
                        n += 64;
                }
                k = read_bytes(copy, n, &s, &message);
                if (k < 0) {
                        refused++;
                        continue;
                }
                accepted++;
                /* Never more than was written; a flip in record r keeps the records before it. */
                ck_assert_uint_le(s.n_leases, 6);
                ck_assert_uint_ge(s.n_leases, 2);
                if (flips == 1) {
                        while (whole < 5 && ends[whole] <= at)
                                whole++;
                        ck_assert_uint_eq(s.n_leases, 2 + (whole - 1));
                }
        }
        ck_assert_uint_gt(refused, 0);
        ck_assert_uint_gt(accepted, 5000);
}
END_TEST

/* A file of our own making: a header, then records of the given payloads, with right checksums. */
typedef struct Crafted {
        uint8_t data[4096];
        size_t len;
        uint64_t seq;
} Crafted;

static void le32(uint8_t *p, uint32_t v) {
        for (int i = 0; i < 4; i++)
                p[i] = (uint8_t)(v >> (8 * i));
}

static void le64(uint8_t *p, uint64_t v) {
        for (int i = 0; i < 8; i++)
                p[i] = (uint8_t)(v >> (8 * i));
}

static void craft_header(Crafted *c, const char *magic, uint32_t format) {
        memset(c, 0, sizeof(*c));
        memcpy(c->data, magic, 8);
        le32(c->data + 8, format);
        le64(c->data + 16, 1);
        le32(c->data + 24, test_crc32c(c->data, 24));
        c->len = 32;
        c->seq = 1;
}

static void craft_record(Crafted *c, const uint8_t *payload, size_t n) {
        uint8_t *r = c->data + c->len;

        ck_assert_uint_le(c->len + 16 + n, sizeof(c->data));
        le32(r + 4, (uint32_t)n);
        le64(r + 8, c->seq++);
        memcpy(r + 16, payload, n);
        le32(r, test_crc32c(r + 4, 12 + n));
        c->len += 16 + n;
}

/* Payload writer. */
typedef struct P {
        uint8_t b[2048];
        size_t n;
} P;

static void p8(P *p, uint8_t v) {
        p->b[p->n++] = v;
}

static void p16(P *p, uint16_t v) {
        p8(p, (uint8_t)v);
        p8(p, (uint8_t)(v >> 8));
}

static void p32(P *p, uint32_t v) {
        le32(p->b + p->n, v);
        p->n += 4;
}

static void p64(P *p, uint64_t v) {
        le64(p->b + p->n, v);
        p->n += 8;
}

static void pstr(P *p, const char *s) {
        p8(p, (uint8_t)strlen(s));
        memcpy(p->b + p->n, s, strlen(s));
        p->n += strlen(s);
}

#define ID1 "0123456789abcdef0123456789abcdef"
#define ID2 "fedcba9876543210fedcba9876543210"

/* PUT_LEASE of one 2 MiB slab, of slab id `slab`. */
static void put_lease(P *p, const char *id, uint64_t slab) {
        p8(p, 2);
        pstr(p, id);
        p32(p, 0);
        p64(p, 2 * MiB);
        p64(p, 1);
        p32(p, 1000);
        p32(p, 10);
        pstr(p, "c");
        p8(p, 0);
        p16(p, 1);
        p64(p, slab);
        p64(p, 2 * MiB);
}

static void snapshot_of(P *p, uint32_t n) {
        p->n = 0;
        p8(p, 1);
        p32(p, n);
}

/* Expects the crafted file refused as corrupt, with a sentence holding `needle`. */
static void expect_crafted_refused(const Crafted *c, int error, const char *needle) {
        _cleanup_(state_done) State s = {};
        _cleanup_free_ char *message = NULL;
        int k = read_bytes(c->data, c->len, &s, &message);

        ck_assert_msg(k == error, "%d instead of %d: %s", k, error, message ?: "");
        ck_assert_msg(strstr(message, needle), "'%s' lacks '%s'", message, needle);
}

START_TEST(test_hostile_crafted) {
        _cleanup_(state_done) State s = {};
        Crafted c;
        P p = {};

        /* The header. */
        craft_header(&c, "VMMBTBL", 2);
        snapshot_of(&p, 0);
        craft_record(&c, p.b, p.n);
        ck_assert_int_eq(read_bytes(c.data, c.len, &s, NULL), 0);
        ck_assert_uint_eq(s.n_leases, 0);
        craft_header(&c, "VMMBTBX", 2);
        craft_record(&c, p.b, p.n);
        expect_crafted_refused(&c, -EBADMSG, "not a vmmbroker lease table");
        craft_header(&c, "VMMBTBL", 3);
        craft_record(&c, p.b, p.n);
        expect_crafted_refused(&c, -EPROTONOSUPPORT, "format 3");
        craft_header(&c, "VMMBTBL", 2);
        c.data[20] ^= 1;
        craft_record(&c, p.b, p.n);
        expect_crafted_refused(&c, -EBADMSG, "header is damaged");
        craft_header(&c, "VMMBTBL", 2);
        expect_crafted_refused(&c, -EBADMSG, "no whole snapshot");

        /* The snapshot must come first, and count its leases right. */
        craft_header(&c, "VMMBTBL", 2);
        p.n = 0;
        put_lease(&p, ID1, 1);
        craft_record(&c, p.b, p.n);
        expect_crafted_refused(&c, -EBADMSG, "not a snapshot");
        craft_header(&c, "VMMBTBL", 2);
        snapshot_of(&p, UINT32_MAX);
        craft_record(&c, p.b, p.n);
        expect_crafted_refused(&c, -EBADMSG, "count of leases");
        craft_header(&c, "VMMBTBL", 2);
        snapshot_of(&p, 2);
        put_lease(&p, ID1, 1);
        craft_record(&c, p.b, p.n);
        expect_crafted_refused(&c, -EBADMSG, "does not hold the leases it counts");

        /* Counts out of range. */
        craft_header(&c, "VMMBTBL", 2);
        snapshot_of(&p, 1);
        put_lease(&p, ID1, 1);
        p.b[p.n - 18] = 0xff;   /* n_slabs: 255 */
        craft_record(&c, p.b, p.n);
        expect_crafted_refused(&c, -EBADMSG, "too many");
        craft_header(&c, "VMMBTBL", 2);
        snapshot_of(&p, 1);
        put_lease(&p, ID1, 1);
        p.b[6] = 200;           /* the id's length */
        craft_record(&c, p.b, p.n);
        expect_crafted_refused(&c, -EBADMSG, "cannot be decoded");

        /* A valid snapshot, then hostile records. */
        for (int t = 0; t < 9; t++) {
                static const char *needles[] = {
                        "not there", "not there", "unknown op", "snapshot after", "cannot be decoded",
                        "0 references", "two leases", "Slab 1 is in two places", "cannot be decoded",
                };
                P q = {};

                craft_header(&c, "VMMBTBL", 2);
                snapshot_of(&p, 1);
                put_lease(&p, ID1, 1);
                craft_record(&c, p.b, p.n);
                switch (t) {
                case 0:         /* a hold on a lease that is not there */
                        p8(&q, 4);
                        pstr(&q, ID2);
                        p32(&q, 1);
                        p64(&q, 1);
                        p32(&q, 1000);
                        p32(&q, 1000);
                        pstr(&q, "x");
                        p32(&q, 1);
                        p8(&q, 0);
                        break;
                case 1:         /* a token of a lease that is not there */
                        p8(&q, 6);
                        pstr(&q, ID2);
                        pstr(&q, ID1);
                        p32(&q, 1);
                        p32(&q, 1);
                        p8(&q, 0);
                        break;
                case 2:
                        p8(&q, 99);
                        break;
                case 3:
                        p8(&q, 1);
                        p32(&q, 0);
                        break;
                case 4:         /* cut inside an op */
                        p8(&q, 3);
                        p8(&q, 32);
                        p8(&q, 'a');
                        break;
                case 5:         /* a hold of 0 references */
                        p8(&q, 4);
                        pstr(&q, ID1);
                        p32(&q, 1);
                        p64(&q, 1);
                        p32(&q, 1000);
                        p32(&q, 1000);
                        pstr(&q, "x");
                        p32(&q, 0);
                        p8(&q, 0);
                        break;
                case 6:         /* one token on two leases */
                        put_lease(&q, ID2, 2);
                        for (int j = 0; j < 2; j++) {
                                p8(&q, 6);
                                pstr(&q, j ? ID2 : ID1);
                                pstr(&q, "00112233445566778899aabbccddeeff");
                                p32(&q, 1);
                                p32(&q, 1);
                                p8(&q, 0);
                        }
                        break;
                case 7:         /* whole, but inconsistent: state_check() refuses it */
                        put_lease(&q, ID2, 1);
                        break;
                case 8:         /* a boolean that is not one */
                        p8(&q, 6);
                        pstr(&q, ID1);
                        pstr(&q, "00112233445566778899aabbccddeeff");
                        p32(&q, 1);
                        p32(&q, 1);
                        p8(&q, 2);
                        break;
                }
                craft_record(&c, q.b, q.n);
                expect_crafted_refused(&c, -EBADMSG, needles[t]);
        }

        /* A record of a length past the end, or of the wrong sequence, ends the log: it was never whole. */
        craft_header(&c, "VMMBTBL", 2);
        snapshot_of(&p, 1);
        put_lease(&p, ID1, 1);
        craft_record(&c, p.b, p.n);
        {
                P q = {};
                size_t at;

                p8(&q, 3);
                pstr(&q, ID1);
                at = c.len;
                craft_record(&c, q.b, q.n);
                le32(c.data + at + 4, UINT32_MAX);
                state_done(&s);
                ck_assert_int_eq(read_bytes(c.data, c.len, &s, NULL), 0);
                ck_assert_uint_eq(s.n_leases, 1);
                c.len = at;
                c.seq++;        /* a gap */
                craft_record(&c, q.b, q.n);
                state_done(&s);
                ck_assert_int_eq(read_bytes(c.data, c.len, &s, NULL), 0);
                ck_assert_uint_eq(s.n_leases, 1);
                c.len = at;
                c.seq = 2;      /* in sequence: the lease ends */
                craft_record(&c, q.b, q.n);
                state_done(&s);
                ck_assert_int_eq(read_bytes(c.data, c.len, &s, NULL), 0);
                ck_assert_uint_eq(s.n_leases, 0);
        }

        /* Not a regular file; empty; format 1 goes to state_read(). */
        {
                _cleanup_free_ char *message = NULL;
                int pipes[2];
                const char *json = "{\"format\":1,\"leases\":[]}\n";

                ck_assert_int_eq(pipe2(pipes, O_CLOEXEC), 0);
                state_done(&s);
                ck_assert_int_eq(store_read(pipes[0], &s, &message), -EBADMSG);
                close(pipes[0]);
                close(pipes[1]);
                ck_assert_int_eq(read_bytes("", 0, &s, NULL), -EBADMSG);
                ck_assert_int_eq(read_bytes(json, strlen(json), &s, NULL), 0);
                ck_assert_uint_eq(s.n_leases, 0);
                ck_assert_int_eq(read_bytes("{\"format\":9}", 12, &s, NULL), -EPROTONOSUPPORT);
        }
}
END_TEST

START_TEST(test_ended_never_back) {
        _cleanup_(state_done) State s = {};
        Lease *a, *b;
        char id[33];

        table_init();
        store = new_store(&fake);
        a = mk_lease(1, "ends");
        mk_hold(a, &holders[1], 1, false);
        mk_token(a, 9, UID_ANY, 1000, false);
        b = mk_lease(2, "stays");
        ck_assert_int_eq(store_snapshot(store, &table), 0);
        snprintf(id, sizeof(id), "%s", a->id);
        store_begin(store);
        ck_assert_int_eq(store_end_hold(store, a->id, &holders[1]), 0);
        ck_assert_int_eq(store_end_lease(store, a->id), 0);
        ck_assert_int_eq(store_commit(store), 0);
        drop_lease(a);
        assert_stored_is_table();

        /* Its token and its slab ids are free again for others. */
        mk_token(b, 9, UID_ANY, 1000, false);
        store_begin(store);
        ck_assert_int_eq(store_put_token(store, b->id, list_first_entry(&b->tokens, Token, link)), 0);
        ck_assert_int_eq(store_commit(store), 0);
        assert_stored_is_table();

        /* A failed change that would have brought it back is never read. */
        a = mk_lease(1, "ends");
        store_inject_fault(store, STORE_STEP_WRITE, 1, -EIO, false);
        ck_assert_int_eq(commit_lease(store, a), -EIO);
        drop_lease(a);
        assert_stored_is_table();

        /* Nor after compaction. */
        ck_assert_int_eq(store_snapshot(store, &table), 0);
        ck_assert_int_eq(store_read(fake_latest(&fake), &s, NULL), 0);
        for (size_t i = 0; i < s.n_leases; i++)
                ck_assert_str_ne(s.leases[i].id, id);
        assert_same_table(&s);
}
END_TEST

/* Many leases: replay with its maps and compaction of what ended, against the table. */
START_TEST(test_many) {
        Lease *l, *tmp;
        unsigned n = 0, i = 0;

        table_init();
        store = new_store(&fake);
        for (; n < 9000; n++)
                mk_hold(mk_lease(n, NULL), &holders[n % 3], 1, false);
        ck_assert_int_eq(store_snapshot(store, &table), 0);
        /* End nine in ten one by one, with their holds (the replay compacts what ended as it goes); add and
         * replace holds on the rest. */
        list_for_each_entry_safe(l, tmp, &table.leases, link_table) {
                Hold *hold = list_first_entry(&l->holds, Hold, link_lease);

                store_begin(store);
                if (i++ % 10 != 0) {
                        ck_assert_int_eq(store_end_hold(store, l->id, hold->holder), 0);
                        ck_assert_int_eq(store_end_lease(store, l->id), 0);
                        ck_assert_int_eq(store_commit(store), 0);
                        drop_lease(l);
                        continue;
                }
                hold->refs = 3;
                ck_assert_int_eq(store_put_hold(store, l->id, hold->holder, 3, false, false), 0);
                for (size_t j = 3; j < 8; j++) {
                        Hold *h2 = mk_hold(l, &holders[j], 1, true);

                        ck_assert_int_eq(store_put_hold(store, l->id, h2->holder, 1, true, false), 0);
                }
                ck_assert_int_eq(store_put_lease(store, l), 0);         /* foreign now */
                hold = find_hold(l, &holders[4]);
                ck_assert_int_eq(store_end_hold(store, l->id, hold->holder), 0);
                drop_hold(l, hold);
                ck_assert_int_eq(store_commit(store), 0);
        }
        for (; n < 12000; n++)
                ck_assert_int_eq(try_commit(store, n), 0);
        assert_stored_is_table();
        ck_assert_int_eq(store_snapshot(store, &table), 0);
        assert_stored_is_table();
}
END_TEST

int main(void) {
        return run_suite(UNIT_SUITE("store", teardown, test_round_trip, test_replace, test_not_open, test_compaction,
                                    test_commit_cost, test_seals, test_fault_commit, test_fault_snapshot, test_crash,
                                    test_hostile_truncated, test_hostile_flips, test_hostile_crafted,
                                    test_ended_never_back, test_many))
                       ? EXIT_FAILURE
                       : EXIT_SUCCESS;
}
