/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The pattern that publish-pattern writes and attach-pattern checks:
 * word[i] = i * 2654435761 ^ seed (32-bit words), as in lease-pattern. The
 * seed comes from the lease's name unless given with --seed, so the consumer
 * needs nothing from the producer but the name, and a lease published under
 * another name, or memory that reads zero, fails the check.
 */

#include <stdint.h>

/* Bytes copied between host and device at a time. */
#define PATTERN_CHUNK (UINT64_C(64) << 20)

static inline uint32_t pattern_word(uint64_t i, uint32_t seed) {
        return (uint32_t)(i * 2654435761u) ^ seed;
}

/* The seed for a name: its 32-bit FNV-1a hash. */
static inline uint32_t pattern_seed(const char *name) {
        uint32_t h = 2166136261u;

        for (const unsigned char *p = (const unsigned char *)name; *p; p++)
                h = (h ^ *p) * 16777619u;
        return h;
}
