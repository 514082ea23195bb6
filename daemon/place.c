/* SPDX-License-Identifier: MIT */

#include <errno.h>
#include <stdbool.h>
#include <string.h>

#include "place.h"

static const char *const names[_PLACEMENT_MAX] = {
        [PLACEMENT_MOST_FREE] = "most-free",
        [PLACEMENT_FIRST] = "first",
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

/* Whether pool device a goes before pool device b under `rule`. */
static bool before(PlacementRule rule, const PoolDeviceStats *stats, size_t a, size_t b) {
        if (rule == PLACEMENT_MOST_FREE) {
                uint64_t ra = placement_room(&stats[a]), rb = placement_room(&stats[b]);

                if (ra != rb)
                        return ra > rb;
        }
        return a < b;
}

void placement_order(PlacementRule rule, const PoolDeviceStats *stats, size_t *order, size_t n) {
        /* Insertion sort: n is the number of devices, and stable. */
        for (size_t i = 1; i < n; i++) {
                size_t v = order[i], j = i;

                for (; j > 0 && before(rule, stats, v, order[j - 1]); j--)
                        order[j] = order[j - 1];
                order[j] = v;
        }
}
