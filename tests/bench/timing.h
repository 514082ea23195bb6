/* SPDX-License-Identifier: MIT */
#pragma once

/* Timing helpers shared by the benchmarks: a monotonic clock in microseconds and medians. */

#include <stdlib.h>
#include <time.h>

static inline double now_us(void) {
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static inline int cmp_double(const void *a, const void *b) {
        double x = *(const double *)a, y = *(const double *)b;

        return x < y ? -1 : x > y;
}

/* Sorts v in place and returns its median. */
static inline double median(double *v, unsigned n) {
        qsort(v, n, sizeof(*v), cmp_double);
        return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}
