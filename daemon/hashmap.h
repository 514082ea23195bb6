/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * An intrusive hash map: the objects it indexes embed a HashLink, and a
 * HashMapType says how to get an object's key and hash and compare keys.
 * Chained buckets, doubled when there are more entries than buckets, so a
 * lookup costs O(1) whatever the number of leases, tokens, names or holders.
 *
 * Keys that clients choose (names) could be picked to collide: the hash is
 * SipHash-1-3 keyed with a random key per process, so they cannot.
 *
 * Adding never fails: when the table cannot grow it keeps its buckets and the
 * chains get longer. A caller that must not fail halfway through a change
 * calls hashmap_reserve() first.
 */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct HashLink {
        struct HashLink *next;
        uint64_t hash;
} HashLink;

typedef struct HashMapType {
        const void *(*key)(const HashLink *link);       /* the key of an object in the map */
        uint64_t (*hash)(const void *key);              /* hashmap_hash_string(), hashmap_hash_u64()... */
        bool (*equal)(const void *a, const void *b);    /* two keys */
} HashMapType;

typedef struct HashMap {
        const HashMapType *type;
        HashLink **buckets;
        size_t n_buckets;                               /* 0 or a power of two */
        size_t n;
} HashMap;

/* Sets up an empty map with its first buckets. Returns 0 or -ENOMEM. */
int hashmap_init(HashMap *m, const HashMapType *type);

/* Frees the buckets (not the objects). Accepts a map hashmap_init() failed on, or a zeroed one. */
void hashmap_done(HashMap *m);

/* Makes room for `n` entries in all, so that adding up to that many grows nothing. Returns 0 or -ENOMEM. */
int hashmap_reserve(HashMap *m, size_t n);

/* Adds an object (its key must not be in the map already). Never fails: see above. */
void hashmap_add(HashMap *m, HashLink *link);

/* The object with that key, or NULL. */
HashLink *hashmap_find(const HashMap *m, const void *key);

/* Removes an object that is in the map. */
void hashmap_remove(HashMap *m, HashLink *link);

/* Keyed hashes of a NUL-terminated string and of a number. */
uint64_t hashmap_hash_string(const void *key);
uint64_t hashmap_hash_u64(const void *key);

/* Whether two uint64_t keys are equal: the `equal` that goes with hashmap_hash_u64(). */
bool hashmap_equal_u64(const void *a, const void *b);
