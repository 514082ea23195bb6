/* SPDX-License-Identifier: MIT */

/*
 * daemon/hashmap.c: the intrusive hash map under the lease table's and the
 * holder registry's indexes. Many string and number keys, growth, reserve,
 * keys that are not there, and removal from every place in a chain (made
 * with a hash that puts every key in one bucket).
 */

#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hashmap.h"
#include "macro.h"
#include "unit.h"

#define MANY 100000

typedef struct Entry {
        char name[24];
        uint64_t number;
        HashLink link;
} Entry;

static const void *name_key(const HashLink *link) {
        return container_of(link, Entry, link)->name;
}

static const void *number_key(const HashLink *link) {
        return &container_of(link, Entry, link)->number;
}

static bool name_equal(const void *a, const void *b) {
        return strcmp(a, b) == 0;
}

static bool number_equal(const void *a, const void *b) {
        return *(const uint64_t *)a == *(const uint64_t *)b;
}

/* Every key in one bucket: the chains are as long as the map. */
static uint64_t same_hash(const void *key) {
        return 42;
}

static const HashMapType by_name = { name_key, hashmap_hash_string, name_equal };
static const HashMapType by_number = { number_key, hashmap_hash_u64, number_equal };
static const HashMapType by_name_colliding = { name_key, same_hash, name_equal };

static Entry *entries;

static void teardown(void) {
        free(entries);
        entries = NULL;
}

/* MANY entries, "key-<i>" and i * 2654435761 + 1 (never 0, all different). */
static void make_entries(size_t n) {
        entries = calloc(n, sizeof(Entry));
        ck_assert_ptr_nonnull(entries);
        for (size_t i = 0; i < n; i++) {
                snprintf(entries[i].name, sizeof(entries[i].name), "key-%zu", i);
                entries[i].number = (uint64_t)i * UINT64_C(2654435761) + 1;
        }
}

static Entry *find_name(const HashMap *m, const char *name) {
        HashLink *link = hashmap_find(m, name);

        return link ? container_of(link, Entry, link) : NULL;
}

static Entry *find_number(const HashMap *m, uint64_t number) {
        HashLink *link = hashmap_find(m, &number);

        return link ? container_of(link, Entry, link) : NULL;
}

/* The buckets are a power of two and at least as many as the entries (the map doubles when full). */
static void assert_shape(const HashMap *m) {
        ck_assert_uint_gt(m->n_buckets, 0);
        ck_assert_uint_eq(m->n_buckets & (m->n_buckets - 1), 0);
        ck_assert_uint_ge(m->n_buckets, m->n);
}

START_TEST(test_string_keys) {
        HashMap m;

        make_entries(MANY);
        ck_assert_int_eq(hashmap_init(&m, &by_name), 0);
        ck_assert_ptr_null(hashmap_find(&m, "key-0"));  /* empty */
        for (size_t i = 0; i < MANY; i++)
                hashmap_add(&m, &entries[i].link);
        ck_assert_uint_eq(m.n, MANY);
        assert_shape(&m);
        for (size_t i = 0; i < MANY; i++)
                ck_assert_ptr_eq(find_name(&m, entries[i].name), &entries[i]);

        /* Remove every other one: those are gone, the rest still found. */
        for (size_t i = 0; i < MANY; i += 2)
                hashmap_remove(&m, &entries[i].link);
        ck_assert_uint_eq(m.n, MANY / 2);
        for (size_t i = 0; i < MANY; i++)
                ck_assert_ptr_eq(find_name(&m, entries[i].name), i % 2 ? &entries[i] : NULL);
        for (size_t i = 1; i < MANY; i += 2)
                hashmap_remove(&m, &entries[i].link);
        ck_assert_uint_eq(m.n, 0);
        ck_assert_ptr_null(find_name(&m, entries[1].name));
        hashmap_done(&m);
}
END_TEST

START_TEST(test_u64_keys) {
        HashMap m;

        make_entries(MANY);
        ck_assert_int_eq(hashmap_init(&m, &by_number), 0);
        for (size_t i = 0; i < MANY; i++)
                hashmap_add(&m, &entries[i].link);
        ck_assert_uint_eq(m.n, MANY);
        assert_shape(&m);
        for (size_t i = 0; i < MANY; i++)
                ck_assert_ptr_eq(find_number(&m, entries[i].number), &entries[i]);
        for (size_t i = 0; i < MANY; i += 3)
                hashmap_remove(&m, &entries[i].link);
        for (size_t i = 0; i < MANY; i++)
                ck_assert_ptr_eq(find_number(&m, entries[i].number), i % 3 ? &entries[i] : NULL);
        hashmap_done(&m);
}
END_TEST

/* Each doubling rehashes every entry into the new buckets: after each one, all are found. */
START_TEST(test_growth_keeps_entries) {
        size_t buckets;
        HashMap m;

        make_entries(5000);
        ck_assert_int_eq(hashmap_init(&m, &by_name), 0);
        ck_assert_uint_eq(m.n_buckets, 16);
        buckets = m.n_buckets;
        for (size_t i = 0; i < 5000; i++) {
                hashmap_add(&m, &entries[i].link);
                assert_shape(&m);
                if (m.n_buckets != buckets) {
                        ck_assert_uint_eq(m.n_buckets, 2 * buckets);    /* doubled, when it was full */
                        ck_assert_uint_eq(m.n, buckets + 1);
                        buckets = m.n_buckets;
                        for (size_t j = 0; j <= i; j++)
                                ck_assert_ptr_eq(find_name(&m, entries[j].name), &entries[j]);
                }
        }
        ck_assert_uint_eq(m.n_buckets, 8192);
        hashmap_done(&m);
}
END_TEST

/* After hashmap_reserve(n), adding up to n entries in all grows nothing: it cannot fail. */
START_TEST(test_reserve_then_add) {
        HashLink **buckets;
        HashMap m;

        make_entries(MANY);
        ck_assert_int_eq(hashmap_init(&m, &by_name), 0);
        ck_assert_int_eq(hashmap_reserve(&m, MANY), 0);
        ck_assert_uint_ge(m.n_buckets, MANY);
        buckets = m.buckets;
        for (size_t i = 0; i < MANY; i++)
                hashmap_add(&m, &entries[i].link);
        ck_assert_ptr_eq(m.buckets, buckets);           /* never reallocated */
        ck_assert_uint_eq(m.n, MANY);
        for (size_t i = 0; i < MANY; i++)
                ck_assert_ptr_eq(find_name(&m, entries[i].name), &entries[i]);

        /* Reserving what is there already, or less, changes nothing. */
        ck_assert_int_eq(hashmap_reserve(&m, MANY), 0);
        ck_assert_int_eq(hashmap_reserve(&m, 1), 0);
        ck_assert_ptr_eq(m.buckets, buckets);

        /* The lease table's way: reserve n + 1 before each add, then the add never grows. */
        hashmap_done(&m);
        ck_assert_int_eq(hashmap_init(&m, &by_name), 0);
        for (size_t i = 0; i < 1000; i++) {
                ck_assert_int_eq(hashmap_reserve(&m, m.n + 1), 0);
                buckets = m.buckets;
                hashmap_add(&m, &entries[i].link);
                ck_assert_ptr_eq(m.buckets, buckets);
        }
        hashmap_done(&m);
}
END_TEST

START_TEST(test_absent_key) {
        HashMap m;
        uint64_t zero = 0;

        make_entries(1000);
        ck_assert_int_eq(hashmap_init(&m, &by_name), 0);
        for (size_t i = 0; i < 1000; i++)
                hashmap_add(&m, &entries[i].link);
        ck_assert_ptr_null(hashmap_find(&m, "key-1000"));
        ck_assert_ptr_null(hashmap_find(&m, "key-"));
        ck_assert_ptr_null(hashmap_find(&m, ""));
        ck_assert_ptr_null(hashmap_find(&m, "KEY-1"));
        ck_assert_ptr_null(hashmap_find(&m, "key-10 "));
        hashmap_done(&m);

        ck_assert_int_eq(hashmap_init(&m, &by_number), 0);
        for (size_t i = 0; i < 1000; i++)
                hashmap_add(&m, &entries[i].link);
        ck_assert_ptr_null(find_number(&m, 0));
        ck_assert_ptr_null(find_number(&m, 2));
        ck_assert_ptr_null(hashmap_find(&m, &zero));
        hashmap_done(&m);

        /* A zeroed map and a map after hashmap_done() find nothing and can be done again. */
        m = (HashMap){ .type = &by_name };
        ck_assert_ptr_null(hashmap_find(&m, "key-1"));
        hashmap_done(&m);
        hashmap_done(&m);
}
END_TEST

/* All in one chain: removing its head, its middle and its tail keeps the others findable. */
START_TEST(test_remove_middle_of_chain) {
        HashMap m;

        make_entries(9);
        ck_assert_int_eq(hashmap_init(&m, &by_name_colliding), 0);
        for (size_t i = 0; i < 9; i++)
                hashmap_add(&m, &entries[i].link);
        ck_assert_uint_eq(m.n, 9);
        for (size_t i = 0; i < 9; i++)
                ck_assert_ptr_eq(find_name(&m, entries[i].name), &entries[i]);
        ck_assert_ptr_null(find_name(&m, "key-9"));     /* same hash, another key */

        /* The chain is newest first: entry 8 is its head, entry 0 its tail, entry 4 the middle. */
        hashmap_remove(&m, &entries[4].link);
        ck_assert_ptr_null(find_name(&m, "key-4"));
        for (size_t i = 0; i < 9; i++)
                if (i != 4)
                        ck_assert_ptr_eq(find_name(&m, entries[i].name), &entries[i]);
        hashmap_remove(&m, &entries[8].link);           /* head */
        hashmap_remove(&m, &entries[0].link);           /* tail */
        ck_assert_uint_eq(m.n, 6);
        for (size_t i = 0; i < 9; i++)
                ck_assert_ptr_eq(find_name(&m, entries[i].name), i == 0 || i == 4 || i == 8 ? NULL : &entries[i]);

        /* Added again, each is found again. */
        hashmap_add(&m, &entries[4].link);
        hashmap_add(&m, &entries[0].link);
        ck_assert_ptr_eq(find_name(&m, "key-4"), &entries[4]);
        ck_assert_ptr_eq(find_name(&m, "key-0"), &entries[0]);
        ck_assert_uint_eq(m.n, 8);
        hashmap_done(&m);
}
END_TEST

/* Keys that the same hash function sees: equal strings hash equal, and the hash is keyed but stable. */
START_TEST(test_hash_functions) {
        uint64_t a = 7, b = 7, c = 8;
        char s1[] = "lease-name", s2[] = "lease-name";

        ck_assert_uint_eq(hashmap_hash_string(s1), hashmap_hash_string(s2));
        ck_assert_uint_ne(hashmap_hash_string("a"), hashmap_hash_string("b"));
        ck_assert_uint_eq(hashmap_hash_u64(&a), hashmap_hash_u64(&b));
        ck_assert_uint_ne(hashmap_hash_u64(&a), hashmap_hash_u64(&c));
        ck_assert_uint_eq(hashmap_hash_string(""), hashmap_hash_string(""));
}
END_TEST

int main(void) {
        return run_suite(UNIT_SUITE("hashmap", teardown, test_string_keys, test_u64_keys, test_growth_keeps_entries,
                                    test_reserve_then_add, test_absent_key, test_remove_middle_of_chain,
                                    test_hash_functions)) == 0
                       ? EXIT_SUCCESS
                       : EXIT_FAILURE;
}
