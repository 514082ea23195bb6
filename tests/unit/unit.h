/* SPDX-License-Identifier: MIT */
#pragma once

#include <check.h>
#include <stdlib.h>

/* Runs a suite (each test in its own process) and returns the number of failed tests. */
static inline int run_suite(Suite *s) {
        SRunner *sr = srunner_create(s);
        int failed;

        srunner_run_all(sr, CK_NORMAL);
        failed = srunner_ntests_failed(sr);
        srunner_free(sr);
        return failed;
}

/* A suite of one test case holding `n` tests, with an optional teardown run after each. */
static inline Suite *unit_suite(const char *name, void (*teardown)(void), const TTest *const *tests, size_t n) {
        Suite *s = suite_create(name);
        TCase *tc = tcase_create(name);

        if (teardown)
                tcase_add_checked_fixture(tc, NULL, teardown);
        for (size_t i = 0; i < n; i++)
                tcase_add_test(tc, tests[i]);
        suite_add_tcase(s, tc);
        return s;
}

#define UNIT_SUITE(name, teardown, ...)                                                                 \
        unit_suite(name, teardown, (const TTest *const[]){ __VA_ARGS__ },                               \
                   sizeof((const TTest *const[]){ __VA_ARGS__ }) / sizeof(const TTest *))
