/* SPDX-License-Identifier: MIT */

/*
 * daemon/place.c: the order in which an Alloc that names no single device
 * tries the devices. most-free: the most room first (cached bytes count as
 * room, scrubbing bytes do not), ties to the lower pool index; first: pool
 * order.
 */

#include <check.h>
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "macro.h"
#include "place.h"
#include "unit.h"

#define MIB (UINT64_C(1) << 20)

static PoolDeviceStats dev(uint64_t capacity, uint64_t leased, uint64_t scrubbing, uint64_t cached) {
        return (PoolDeviceStats){ .capacity = capacity, .leased = leased, .scrubbing = scrubbing,
                                  .cached = cached, .granularity = 2 * MIB, .numa_node = -1 };
}

static PoolDeviceStats dev_on(int node, uint64_t capacity, uint64_t leased) {
        PoolDeviceStats s = dev(capacity, leased, 0, 0);

        s.numa_node = node;
        return s;
}

static NodeSet nodes(int a, int b) {
        NodeSet set = {};

        if (a >= 0)
                set.bits[a / 64] |= UINT64_C(1) << (a % 64);
        if (b >= 0)
                set.bits[b / 64] |= UINT64_C(1) << (b % 64);
        return set;
}

/* Writes `text` to dir/devices/system/node/<node>/cpulist, creating the directories. */
static void write_cpulist(const char *root, const char *node, const char *text) {
        char path[512];
        FILE *f;

        snprintf(path, sizeof(path), "%s/devices", root);
        (void)mkdir(path, 0755);
        snprintf(path, sizeof(path), "%s/devices/system", root);
        (void)mkdir(path, 0755);
        snprintf(path, sizeof(path), "%s/devices/system/node", root);
        (void)mkdir(path, 0755);
        snprintf(path, sizeof(path), "%s/devices/system/node/%s", root, node);
        ck_assert_int_eq(mkdir(path, 0755), 0);
        if (!text)
                return;
        snprintf(path, sizeof(path), "%s/devices/system/node/%s/cpulist", root, node);
        f = fopen(path, "we");
        ck_assert_ptr_nonnull(f);
        fputs(text, f);
        ck_assert_int_eq(fclose(f), 0);
}

static void remove_tree(const char *root) {
        char cmd[600];

        snprintf(cmd, sizeof(cmd), "rm -rf '%s'", root);
        ck_assert_int_eq(system(cmd), 0);
}

START_TEST(test_names) {
        ck_assert_str_eq(placement_name(PLACEMENT_MOST_FREE), "most-free");
        ck_assert_str_eq(placement_name(PLACEMENT_FIRST), "first");
        ck_assert_int_eq(placement_from_name("most-free"), PLACEMENT_MOST_FREE);
        ck_assert_int_eq(placement_from_name("first"), PLACEMENT_FIRST);
        ck_assert_str_eq(placement_name(PLACEMENT_NEAREST), "nearest");
        ck_assert_int_eq(placement_from_name("nearest"), PLACEMENT_NEAREST);
        ck_assert_int_eq(placement_from_name("closest"), -EINVAL);
        ck_assert_int_eq(placement_from_name(""), -EINVAL);
        ck_assert_int_eq(placement_from_name("Most-Free"), -EINVAL);
}
END_TEST

START_TEST(test_room) {
        PoolDeviceStats s = dev(100 * MIB, 30 * MIB, 10 * MIB, 50 * MIB);

        ck_assert_uint_eq(placement_room(&s), 60 * MIB);        /* cached counts as room */
        s = dev(100 * MIB, 90 * MIB, 20 * MIB, 0);              /* more in use than the capacity */
        ck_assert_uint_eq(placement_room(&s), 0);
}
END_TEST

START_TEST(test_most_free) {
        PoolDeviceStats stats[4] = {
                dev(100 * MIB, 60 * MIB, 0, 0),         /* room 40 */
                dev(100 * MIB, 20 * MIB, 0, 70 * MIB),  /* room 80: cached is room */
                dev(100 * MIB, 0, 30 * MIB, 0),         /* room 70: scrubbing is not */
                dev(100 * MIB, 20 * MIB, 0, 0),         /* room 80, a tie with 1: after it */
        };
        size_t order[4] = { 0, 1, 2, 3 };

        placement_order(PLACEMENT_MOST_FREE, stats, order, 4);
        ck_assert_uint_eq(order[0], 1);
        ck_assert_uint_eq(order[1], 3);
        ck_assert_uint_eq(order[2], 2);
        ck_assert_uint_eq(order[3], 0);

        /* A subset, given out of order: ties still go to the lower index. */
        size_t some[2] = { 3, 1 };

        placement_order(PLACEMENT_MOST_FREE, stats, some, 2);
        ck_assert_uint_eq(some[0], 1);
        ck_assert_uint_eq(some[1], 3);
}
END_TEST

START_TEST(test_first) {
        PoolDeviceStats stats[3] = { dev(100 * MIB, 99 * MIB, 0, 0), dev(100 * MIB, 0, 0, 0), dev(100 * MIB, 0, 0, 0) };
        size_t order[3] = { 2, 0, 1 };

        placement_order(PLACEMENT_FIRST, stats, order, 3);
        ck_assert_uint_eq(order[0], 0);
        ck_assert_uint_eq(order[1], 1);
        ck_assert_uint_eq(order[2], 2);
}
END_TEST

START_TEST(test_empty_and_one) {
        PoolDeviceStats stats[1] = { dev(100 * MIB, 0, 0, 0) };
        size_t order[1] = { 0 };

        placement_order(PLACEMENT_MOST_FREE, stats, order, 0);
        placement_order(PLACEMENT_MOST_FREE, stats, order, 1);
        ck_assert_uint_eq(order[0], 0);
}
END_TEST

/* nearest: the devices on the caller's nodes first, most-free among them; then the rest, most-free. */
START_TEST(test_nearest) {
        PoolDeviceStats stats[4] = {
                dev_on(0, 100 * MIB, 10 * MIB),         /* node 0, room 90 */
                dev_on(0, 100 * MIB, 50 * MIB),         /* node 0, room 50 */
                dev_on(1, 100 * MIB, 60 * MIB),         /* node 1, room 40 */
                dev_on(1, 100 * MIB, 30 * MIB),         /* node 1, room 70 */
        };
        NodeSet near = nodes(1, -1), both = nodes(0, 1), far = nodes(5, 900);
        size_t order[4] = { 0, 1, 2, 3 };

        placement_order_near(PLACEMENT_NEAREST, stats, order, 4, &near);
        ck_assert_uint_eq(order[0], 3);
        ck_assert_uint_eq(order[1], 2);
        ck_assert_uint_eq(order[2], 0);
        ck_assert_uint_eq(order[3], 1);

        /* On both nodes: every device is near, so most-free. */
        placement_order_near(PLACEMENT_NEAREST, stats, order, 4, &both);
        ck_assert_uint_eq(order[0], 0);
        ck_assert_uint_eq(order[1], 3);
        ck_assert_uint_eq(order[2], 1);
        ck_assert_uint_eq(order[3], 2);

        /* No device on the caller's nodes, or the nodes unknown: most-free over all. */
        for (int i = 0; i < 2; i++) {
                size_t o[4] = { 3, 2, 1, 0 };

                placement_order_near(PLACEMENT_NEAREST, stats, o, 4, i == 0 ? &far : NULL);
                ck_assert_uint_eq(o[0], 0);
                ck_assert_uint_eq(o[1], 3);
                ck_assert_uint_eq(o[2], 1);
                ck_assert_uint_eq(o[3], 2);
        }

        /* A device whose node is unknown (-1) is never near; the other rules ignore the nodes. */
        stats[3].numa_node = -1;
        placement_order_near(PLACEMENT_NEAREST, stats, order, 4, &near);
        ck_assert_uint_eq(order[0], 2);
        ck_assert_uint_eq(order[1], 0);
        placement_order_near(PLACEMENT_MOST_FREE, stats, order, 4, &near);
        ck_assert_uint_eq(order[0], 0);
        placement_order_near(PLACEMENT_FIRST, stats, order, 4, &near);
        ck_assert_uint_eq(order[0], 0);
        ck_assert_uint_eq(order[3], 3);
}
END_TEST

START_TEST(test_cpulist) {
        NumaMap m = {};

        ck_assert_int_eq(numa_map_add_cpulist(&m, "0-3,8\n", 0), 0);
        ck_assert_int_eq(numa_map_add_cpulist(&m, "4-7,9-10", 1), 0);
        ck_assert_int_eq(numa_map_add_cpulist(&m, "\n", 2), 0);       /* memory only */
        ck_assert_int_eq(numa_map_add_cpulist(&m, "", 3), 0);
        ck_assert_uint_eq(m.n_cpus, 11);
        for (size_t c = 0; c < 4; c++)
                ck_assert_int_eq(numa_map_node(&m, c), 0);
        for (size_t c = 4; c < 8; c++)
                ck_assert_int_eq(numa_map_node(&m, c), 1);
        ck_assert_int_eq(numa_map_node(&m, 8), 0);
        ck_assert_int_eq(numa_map_node(&m, 9), 1);
        ck_assert_int_eq(numa_map_node(&m, 10), 1);
        ck_assert_int_eq(numa_map_node(&m, 11), -1);
        ck_assert_int_eq(numa_map_node(&m, 100000), -1);

        ck_assert_int_eq(numa_map_add_cpulist(&m, "x", 0), -EINVAL);
        ck_assert_int_eq(numa_map_add_cpulist(&m, "3-1", 0), -EINVAL);
        ck_assert_int_eq(numa_map_add_cpulist(&m, "1,", 0), -EINVAL);
        ck_assert_int_eq(numa_map_add_cpulist(&m, "1 2", 0), -EINVAL);
        ck_assert_int_eq(numa_map_add_cpulist(&m, "1", -1), -EINVAL);
        ck_assert_int_eq(numa_map_add_cpulist(&m, "1", PLACEMENT_MAX_NODES), -EINVAL);
        numa_map_done(&m);
        ck_assert_uint_eq(m.n_cpus, 0);
}
END_TEST

/* A CPU set's nodes, from a hand-made map. */
START_TEST(test_nodes_of) {
        NumaMap m = {};
        size_t setsize = CPU_ALLOC_SIZE(64);
        cpu_set_t *cpus = CPU_ALLOC(64);
        NodeSet set;

        ck_assert_ptr_nonnull(cpus);
        ck_assert_int_eq(numa_map_add_cpulist(&m, "0-1", 0), 0);
        ck_assert_int_eq(numa_map_add_cpulist(&m, "2-3", 70), 0);
        CPU_ZERO_S(setsize, cpus);
        CPU_SET_S(3, setsize, cpus);
        CPU_SET_S(40, setsize, cpus);                   /* no node */
        ck_assert(numa_map_nodes_of(&m, cpus, setsize, &set));
        ck_assert_uint_eq(set.bits[0], 0);
        ck_assert_uint_eq(set.bits[1], UINT64_C(1) << 6);

        CPU_ZERO_S(setsize, cpus);
        CPU_SET_S(1, setsize, cpus);
        CPU_SET_S(2, setsize, cpus);
        ck_assert(numa_map_nodes_of(&m, cpus, setsize, &set));
        ck_assert_uint_eq(set.bits[0], 1);
        ck_assert_uint_eq(set.bits[1], UINT64_C(1) << 6);

        CPU_ZERO_S(setsize, cpus);
        CPU_SET_S(40, setsize, cpus);
        ck_assert(!numa_map_nodes_of(&m, cpus, setsize, &set));
        ck_assert_uint_eq(set.bits[0], 0);
        CPU_FREE(cpus);
        numa_map_done(&m);

        /* An empty map: unknown, whatever the process. */
        ck_assert_int_eq(numa_map_nodes_of_pid(&m, getpid(), &set), -ENODATA);
}
END_TEST

/* numa_map_load() over a fake sysfs tree; and this process's nodes by its affinity. */
START_TEST(test_load) {
        char root[] = "/tmp/vmmb-place-XXXXXX";
        NumaMap m = {};
        NodeSet set;

        ck_assert_ptr_nonnull(mkdtemp(root));
        ck_assert_int_eq(numa_map_load(&m, root), 0);   /* no node directory: unknown */
        ck_assert_uint_eq(m.n_cpus, 0);

        write_cpulist(root, "node0", "\n");                    /* memory only */
        write_cpulist(root, "node1", "0-8191\n");              /* every CPU this process may have */
        write_cpulist(root, "node2", NULL);                     /* no cpulist: skipped */
        write_cpulist(root, "nodex", "0\n");                   /* not a node */
        ck_assert_int_eq(numa_map_load(&m, root), 0);
        ck_assert_uint_eq(m.n_cpus, PLACEMENT_MAX_CPUS);
        ck_assert_int_eq(numa_map_node(&m, 0), 1);
        ck_assert_int_eq(numa_map_nodes_of_pid(&m, getpid(), &set), 0);
        ck_assert_uint_eq(set.bits[0], 2);
        ck_assert_int_lt(numa_map_nodes_of_pid(&m, -1, &set), 0);       /* no such process */
        numa_map_done(&m);

        write_cpulist(root, "node3", "1-x\n");
        ck_assert_int_eq(numa_map_load(&m, root), -EINVAL);
        numa_map_done(&m);
        remove_tree(root);
}
END_TEST

int main(void) {
        return run_suite(UNIT_SUITE("place", NULL, test_names, test_room, test_most_free, test_first,
                                    test_empty_and_one, test_nearest, test_cpulist, test_nodes_of,
                                    test_load)) == 0
                       ? EXIT_SUCCESS
                       : EXIT_FAILURE;
}
