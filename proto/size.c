/* SPDX-License-Identifier: MIT */

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "size.h"

int parse_size(const char *s, uint64_t *ret) {
        static const struct {
                const char *suffix;
                unsigned shift;
        } units[] = {
                { "", 0 },    { "B", 0 },    { "K", 10 }, { "KiB", 10 }, { "M", 20 },
                { "MiB", 20 }, { "G", 30 },  { "GiB", 30 }, { "T", 40 },  { "TiB", 40 },
        };
        unsigned long long v;
        char *end;

        if (!s || *s < '0' || *s > '9')
                return -EINVAL;
        errno = 0;
        v = strtoull(s, &end, 10);
        if (errno == ERANGE)
                return -ERANGE;
        for (size_t i = 0; i < sizeof(units) / sizeof(units[0]); i++) {
                if (strcmp(end, units[i].suffix) != 0)
                        continue;
                if (units[i].shift > 0 && v > (UINT64_MAX >> units[i].shift))
                        return -ERANGE;
                *ret = (uint64_t)v << units[i].shift;
                return 0;
        }
        return -EINVAL;
}

char *format_size(uint64_t bytes, char *buf, size_t len) {
        static const char *const names[] = { "B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB" };
        unsigned i = 0;
        double v = (double)bytes;

        while (v >= 1024 && i + 1 < sizeof(names) / sizeof(names[0])) {
                v /= 1024;
                i++;
        }
        if (i == 0)
                snprintf(buf, len, "%" PRIu64 " B", bytes);
        else if (v == (double)(uint64_t)v)
                snprintf(buf, len, "%.0f %s", v, names[i]);
        else
                snprintf(buf, len, "%.1f %s", v, names[i]);
        return buf;
}
