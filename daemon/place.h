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
 *   nearest    the devices whose host NUMA node (CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID)
 *              is a node the caller may run on (the nodes of the CPUs in its
 *              sched_getaffinity() mask) first, most-free among them; then
 *              the others, most-free. With no such device, or nodes unknown
 *              (no NUMA map, no node for a device, the affinity unreadable),
 *              it is most-free over all.
 *
 * The CPU -> node map comes from sysfs (<root>/devices/system/node/nodeN/cpulist),
 * read once when the daemon starts (numa_map_load()); the root is /sys, or
 * $VMMBROKER_SYSFS_ROOT (for tests).
 *
 * placement_order() only orders the candidates; broker.c tries them in that
 * order, skipping a device where the caller's limits or the device's
 * capacity refuse the request. Plain data in, plain data out: no pool, no
 * driver, unit tested in tests/unit/test-place.c.
 */

#include <sched.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "pool.h"

typedef enum PlacementRule {
        PLACEMENT_MOST_FREE,
        PLACEMENT_FIRST,
        PLACEMENT_NEAREST,
        _PLACEMENT_MAX,
} PlacementRule;

#define PLACEMENT_MAX_NODES 1024        /* NUMA nodes 0..1023 (the kernel's largest MAX_NUMNODES); others unknown */
#define PLACEMENT_MAX_CPUS 8192         /* CPUs 0..8191 in the map; a CPU past it has no node */
#define PLACEMENT_SYSFS_ROOT_ENV "VMMBROKER_SYSFS_ROOT"

/* Which CPU is on which NUMA node: node[cpu], -1 for a CPU no node lists. Empty (n_cpus 0): nodes unknown. */
typedef struct NumaMap {
        int16_t *node;
        size_t n_cpus;
} NumaMap;

/* A set of NUMA nodes, bit N for node N. */
typedef struct NodeSet {
        uint64_t bits[PLACEMENT_MAX_NODES / 64];
} NodeSet;

/* "most-free", "first", "nearest". */
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

/*
 * The same, for PLACEMENT_NEAREST with the caller's nodes `near` (NULL: unknown): the devices whose
 * PoolDeviceStats.numa_node is in `near` go first. Any other rule ignores `near`.
 */
void placement_order_near(PlacementRule rule, const PoolDeviceStats *stats, size_t *order, size_t n,
                          const NodeSet *near);

/*
 * Parses a sysfs cpulist ("0-3,8,10-11\n", or empty) into map: each CPU listed is on `node`. Returns 0,
 * -EINVAL for a malformed list (map unchanged from where it stopped), -ENOMEM.
 */
int numa_map_add_cpulist(NumaMap *m, const char *cpulist, int node);

/*
 * Reads <root>/devices/system/node/node<N>/cpulist for every node. A root with no node directory gives
 * an empty map (nodes unknown) and 0. Returns 0, -EINVAL (a malformed cpulist), -ENOMEM.
 */
int numa_map_load(NumaMap *m, const char *root);

/* Frees the map; it is empty again. */
void numa_map_done(NumaMap *m);

/* The node of `cpu`, or -1. */
int numa_map_node(const NumaMap *m, size_t cpu);

/* The nodes of the CPUs in `cpus` (a set of `setsize` bytes). Returns whether any CPU has a node. */
bool numa_map_nodes_of(const NumaMap *m, const cpu_set_t *cpus, size_t setsize, NodeSet *ret);

/*
 * The nodes process `pid` may run on: numa_map_nodes_of(its sched_getaffinity()). Returns 0, -ENODATA
 * when the map is empty or none of its CPUs has a node, or the negative errno of sched_getaffinity().
 */
int numa_map_nodes_of_pid(const NumaMap *m, pid_t pid, NodeSet *ret);
