/* SPDX-License-Identifier: MIT */

#include <dirent.h>
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "place.h"

static const char *const names[_PLACEMENT_MAX] = {
        [PLACEMENT_MOST_FREE] = "most-free",
        [PLACEMENT_FIRST] = "first",
        [PLACEMENT_NEAREST] = "nearest",
};

const char *placement_name(PlacementRule rule) {
        return rule >= 0 && rule < _PLACEMENT_MAX ? names[rule] : "unknown";
}

int placement_from_name(const char *name) {
        for (int i = 0; i < _PLACEMENT_MAX; i++)
                if (strcmp(name, names[i]) == 0)
                        return i;
        return -EINVAL;
}

uint64_t placement_room(const PoolDeviceStats *s) {
        uint64_t in_use = s->leased + s->scrubbing;

        return s->capacity > in_use ? s->capacity - in_use : 0;
}

static bool node_in(const NodeSet *set, int node) {
        return set && node >= 0 && node < PLACEMENT_MAX_NODES &&
               (set->bits[node / 64] >> (node % 64) & 1) != 0;
}

/* Whether pool device a goes before pool device b under `rule` (near: the caller's nodes, for nearest). */
static bool before(PlacementRule rule, const PoolDeviceStats *stats, size_t a, size_t b, const NodeSet *near) {
        if (rule == PLACEMENT_NEAREST) {
                bool na = node_in(near, stats[a].numa_node), nb = node_in(near, stats[b].numa_node);

                if (na != nb)
                        return na;
        }
        if (rule == PLACEMENT_MOST_FREE || rule == PLACEMENT_NEAREST) {
                uint64_t ra = placement_room(&stats[a]), rb = placement_room(&stats[b]);

                if (ra != rb)
                        return ra > rb;
        }
        return a < b;
}

void placement_order_near(PlacementRule rule, const PoolDeviceStats *stats, size_t *order, size_t n,
                          const NodeSet *near) {
        /* Insertion sort: n is the number of devices, and stable. */
        for (size_t i = 1; i < n; i++) {
                size_t v = order[i], j = i;

                for (; j > 0 && before(rule, stats, v, order[j - 1], near); j--)
                        order[j] = order[j - 1];
                order[j] = v;
        }
}

void placement_order(PlacementRule rule, const PoolDeviceStats *stats, size_t *order, size_t n) {
        placement_order_near(rule, stats, order, n, NULL);
}

/* --- The CPU -> NUMA node map ------------------------------------------------------------------------ */

static int map_set(NumaMap *m, size_t cpu, int node) {
        if (cpu >= PLACEMENT_MAX_CPUS)
                return 0;       /* past the map: no node, as documented */
        if (cpu >= m->n_cpus) {
                size_t n = cpu + 1;
                int16_t *p = realloc(m->node, n * sizeof(*p));

                if (!p)
                        return -ENOMEM;
                for (size_t i = m->n_cpus; i < n; i++)
                        p[i] = -1;
                m->node = p;
                m->n_cpus = n;
        }
        m->node[cpu] = (int16_t)node;
        return 0;
}

/* A CPU number at *s; advances *s past its digits. */
static bool parse_cpu(const char **s, unsigned long *ret) {
        char *end;

        if (**s < '0' || **s > '9')
                return false;
        errno = 0;
        *ret = strtoul(*s, &end, 10);
        if (errno != 0)
                return false;
        *s = end;
        return true;
}

int numa_map_add_cpulist(NumaMap *m, const char *s, int node) {
        if (node < 0 || node >= PLACEMENT_MAX_NODES)
                return -EINVAL;
        if (*s == '\n' || *s == '\0')
                return 0;       /* a node without CPUs (memory only) */
        for (;;) {
                unsigned long lo, hi;

                if (!parse_cpu(&s, &lo))
                        return -EINVAL;
                hi = lo;
                if (*s == '-') {
                        s++;
                        if (!parse_cpu(&s, &hi) || hi < lo)
                                return -EINVAL;
                }
                for (unsigned long c = lo; c <= hi && c < PLACEMENT_MAX_CPUS; c++) {
                        int k = map_set(m, c, node);

                        if (k < 0)
                                return k;
                }
                if (*s == ',') {
                        s++;
                        continue;
                }
                if (*s == '\n')
                        s++;
                return *s == '\0' ? 0 : -EINVAL;
        }
}

int numa_map_load(NumaMap *m, const char *root) {
        char path[4096], line[65536];
        DIR *d;
        struct dirent *e;
        int k = 0;

        snprintf(path, sizeof(path), "%s/devices/system/node", root);
        d = opendir(path);
        if (!d)
                return 0;       /* no NUMA in sysfs: nodes unknown */
        while (k == 0 && (e = readdir(d))) {
                char *end;
                long node;
                FILE *f;

                if (strncmp(e->d_name, "node", 4) != 0 || e->d_name[4] < '0' || e->d_name[4] > '9')
                        continue;
                node = strtol(e->d_name + 4, &end, 10);
                if (*end || node >= PLACEMENT_MAX_NODES)
                        continue;
                snprintf(path, sizeof(path), "%s/devices/system/node/%s/cpulist", root, e->d_name);
                f = fopen(path, "re");
                if (!f)
                        continue;
                if (!fgets(line, sizeof(line), f))
                        line[0] = '\0';
                fclose(f);
                k = numa_map_add_cpulist(m, line, (int)node);
        }
        closedir(d);
        return k;
}

void numa_map_done(NumaMap *m) {
        free(m->node);
        *m = (NumaMap){};
}

int numa_map_node(const NumaMap *m, size_t cpu) {
        return cpu < m->n_cpus ? m->node[cpu] : -1;
}

bool numa_map_nodes_of(const NumaMap *m, const cpu_set_t *cpus, size_t setsize, NodeSet *ret) {
        bool any = false;

        *ret = (NodeSet){};
        for (size_t c = 0; c < m->n_cpus && c < setsize * 8; c++) {
                int node = m->node[c];

                if (node < 0 || !CPU_ISSET_S(c, setsize, cpus))
                        continue;
                ret->bits[node / 64] |= UINT64_C(1) << (node % 64);
                any = true;
        }
        return any;
}

int numa_map_nodes_of_pid(const NumaMap *m, pid_t pid, NodeSet *ret) {
        size_t setsize = CPU_ALLOC_SIZE(PLACEMENT_MAX_CPUS);
        cpu_set_t *cpus;
        bool any;

        if (m->n_cpus == 0)
                return -ENODATA;
        cpus = CPU_ALLOC(PLACEMENT_MAX_CPUS);
        if (!cpus)
                return -ENOMEM;
        CPU_ZERO_S(setsize, cpus);
        if (sched_getaffinity(pid, setsize, cpus) < 0) {
                int k = -errno;

                CPU_FREE(cpus);
                return k;
        }
        any = numa_map_nodes_of(m, cpus, setsize, ret);
        CPU_FREE(cpus);
        return any ? 0 : -ENODATA;
}
