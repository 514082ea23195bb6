/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Placement: which device serves an Alloc that names no single device (no
 * `device`, or a set of `devices` to choose from), by the rule of
 * `Placement=` in vmmbroker.conf:
 *
 *   most-free  (the default) the device with the most room for the request:
 *              room = capacity - leased - scrubbing bytes; cached bytes count
 *              as room, since they are evicted to make room. Ties go to the
 *              lowest pool index (configuration order).
 *   first      the first device served (configuration order): the rule of
 *              the daemon before placement existed.
 *
 * placement_order() only orders the candidates; broker.c tries them in that
 * order, skipping a device where the caller's limits or the device's
 * capacity refuse the request. Plain data in, plain data out: no pool, no
 * driver, unit tested in tests/unit/test-place.c.
 */

#include <stddef.h>
#include <stdint.h>

#include "pool.h"

typedef enum PlacementRule {
        PLACEMENT_MOST_FREE,
        PLACEMENT_FIRST,
        _PLACEMENT_MAX,
} PlacementRule;

/* "most-free", "first". */
const char *placement_name(PlacementRule rule);

/* The rule named `name`, or -EINVAL. */
int placement_from_name(const char *name);

/* The room a device has for a new lease: capacity - leased - scrubbing, 0 when that is negative. */
uint64_t placement_room(const PoolDeviceStats *s);

/*
 * Sorts `order` (n pool indices, each < the length of `stats`, which is
 * indexed by pool index) into the order `rule` tries them: best first.
 * Stable on ties, and ties go to the lower pool index. O(n^2), n is small.
 */
void placement_order(PlacementRule rule, const PoolDeviceStats *stats, size_t *order, size_t n);
