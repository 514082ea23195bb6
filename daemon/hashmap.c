/* SPDX-License-Identifier: MIT */

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "hashmap.h"

/* --- SipHash-1-3 with a per-process random key ---------------------------------------------------- */

static uint64_t sip_key[2];
static bool sip_keyed;

static uint64_t rotl(uint64_t x, int b) {
        return (x << b) | (x >> (64 - b));
}

#define SIPROUND()                                                                      \
        do {                                                                            \
                v0 += v1; v1 = rotl(v1, 13); v1 ^= v0; v0 = rotl(v0, 32);               \
                v2 += v3; v3 = rotl(v3, 16); v3 ^= v2;                                  \
                v0 += v3; v3 = rotl(v3, 21); v3 ^= v0;                                  \
                v2 += v1; v1 = rotl(v1, 17); v1 ^= v2; v2 = rotl(v2, 32);               \
        } while (0)

static uint64_t siphash13(const uint8_t *in, size_t len) {
        uint64_t v0 = 0x736f6d6570736575ULL, v1 = 0x646f72616e646f6dULL;
        uint64_t v2 = 0x6c7967656e657261ULL, v3 = 0x7465646279746573ULL;
        uint64_t b = (uint64_t)len << 56, m;
        size_t i;

        if (!sip_keyed) {
                /* Without randomness the map still works; only collision resistance is lost. */
                if (getrandom(sip_key, sizeof(sip_key), GRND_NONBLOCK) != (ssize_t)sizeof(sip_key))
                        sip_key[0] = (uint64_t)(uintptr_t)&sip_key ^ 0x9e3779b97f4a7c15ULL;
                sip_keyed = true;
        }
        v0 ^= sip_key[0];
        v1 ^= sip_key[1];
        v2 ^= sip_key[0];
        v3 ^= sip_key[1];
        for (i = 0; i + 8 <= len; i += 8) {
                memcpy(&m, in + i, 8);
                v3 ^= m;
                SIPROUND();
                v0 ^= m;
        }
        for (size_t j = 0; i + j < len; j++)
                b |= (uint64_t)in[i + j] << (8 * j);
        v3 ^= b;
        SIPROUND();
        v0 ^= b;
        v2 ^= 0xff;
        SIPROUND();
        SIPROUND();
        SIPROUND();
        return v0 ^ v1 ^ v2 ^ v3;
}

uint64_t hashmap_hash_string(const void *key) {
        return siphash13(key, strlen(key));
}

uint64_t hashmap_hash_u64(const void *key) {
        return siphash13(key, sizeof(uint64_t));
}

bool hashmap_equal_u64(const void *a, const void *b) {
        return *(const uint64_t *)a == *(const uint64_t *)b;
}

/* --- the map -------------------------------------------------------------------------------------- */

void hashmap_done(HashMap *m) {
        free(m->buckets);
        *m = (HashMap){ .type = m->type };
}

static int resize(HashMap *m, size_t n_buckets) {
        HashLink **b = calloc(n_buckets, sizeof(*b));

        if (!b)
                return -ENOMEM;
        for (size_t i = 0; i < m->n_buckets; i++)
                for (HashLink *l = m->buckets[i], *next; l; l = next) {
                        next = l->next;
                        l->next = b[l->hash & (n_buckets - 1)];
                        b[l->hash & (n_buckets - 1)] = l;
                }
        free(m->buckets);
        m->buckets = b;
        m->n_buckets = n_buckets;
        return 0;
}

int hashmap_init(HashMap *m, const HashMapType *type) {
        *m = (HashMap){ .type = type };
        return resize(m, 16);
}

int hashmap_reserve(HashMap *m, size_t n) {
        size_t want = m->n_buckets ?: 16;

        while (want < n) {
                if (want > SIZE_MAX / 2 / sizeof(HashLink *))
                        return -ENOMEM;
                want *= 2;
        }
        return want == m->n_buckets ? 0 : resize(m, want);
}

void hashmap_add(HashMap *m, HashLink *link) {
        HashLink **b;

        if (m->n >= m->n_buckets)
                (void)hashmap_reserve(m, m->n + 1);     /* if it cannot grow, the chains get longer */
        link->hash = m->type->hash(m->type->key(link));
        b = &m->buckets[link->hash & (m->n_buckets - 1)];
        link->next = *b;
        *b = link;
        m->n++;
}

HashLink *hashmap_find(const HashMap *m, const void *key) {
        uint64_t h;

        if (m->n == 0)
                return NULL;
        h = m->type->hash(key);
        for (HashLink *l = m->buckets[h & (m->n_buckets - 1)]; l; l = l->next)
                if (l->hash == h && m->type->equal(m->type->key(l), key))
                        return l;
        return NULL;
}

void hashmap_remove(HashMap *m, HashLink *link) {
        HashLink **p = &m->buckets[link->hash & (m->n_buckets - 1)];

        while (*p && *p != link)
                p = &(*p)->next;
        if (*p) {
                *p = link->next;
                link->next = NULL;
                m->n--;
        }
}
