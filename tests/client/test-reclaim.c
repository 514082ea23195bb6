/* SPDX-License-Identifier: MIT */

/*
 * libvmmbroker's reclaim callbacks against the real daemon on the simulated
 * device (--capacity 8M: 4 slabs of 2 MiB). A holder process fills the
 * device with the library, marks leases reclaimable, and reports on a pipe
 * which callback ran; the test's process waits in vmmb_alloc_wait() and is
 * served by what the holder gives back. Nothing sleeps: every step is a
 * blocking read of a pipe or a call that returns when served.
 */

#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "checked.h"
#include "harness.h"
#include "macro.h"
#include "vmmbroker.h"
#include "unit.h"

#define MiB (UINT64_C(1) << 20)
#define UNIT (2 * MiB)
#define N_UNITS 4

static Harness h;

/* The holder: what it marks and how its callbacks answer. */
typedef struct HolderArgs {
        const char *socket;
        int report_w, go_r;
        bool refuse_first;      /* lease 0's callback refuses */
} HolderArgs;

typedef struct CallbackData {
        int report_w;
        int index;
        int answer;
} CallbackData;

static int on_reclaim(vmmb_lease *lease, uint64_t timeout_usec, void *userdata) {
        CallbackData *d = userdata;
        char c = (char)('0' + d->index);

        if (timeout_usec == 0 || vmmb_lease_ptr(lease) == 0 || vmmb_free(lease) != -EDEADLK)
                c = 'x';                /* still mapped, with a deadline; freeing from here is refused */
        (void)!write(d->report_w, &c, 1);
        return d->answer;
}

/*
 * Whether vmmb_lease_reclaimed() says `want` within 10 s. The library sends the Free before it sets the flag
 * (on its watch thread), so the test's waiting call may be served, and say "go", a moment before.
 */
static bool reclaimed_soon(vmmb_lease *l, int want) {
        for (int i = 0; i < 10000; i++) {
                if (vmmb_lease_reclaimed(l) == want)
                        return true;
                (void)usleep(1000);
        }
        return false;
}

#define HOLDER_CHECK(cond, ...)                                                 \
        do {                                                                    \
                if (!(cond)) {                                                  \
                        fprintf(stderr, "holder: " __VA_ARGS__);                \
                        fprintf(stderr, ": %s\n", vmmb_error_message());        \
                        return 1;                                               \
                }                                                               \
        } while (0)

static int child_holder(void *arg) {
        HolderArgs *a = arg;
        CallbackData data[N_UNITS];
        vmmb_lease *l[N_UNITS];
        vmmb_client *c = NULL;
        char x = 'r';

        HOLDER_CHECK(vmmb_connect(a->socket, &c) == 0, "connect");
        for (int i = 0; i < N_UNITS; i++) {
                HOLDER_CHECK(vmmb_alloc(c, UNIT, 0, "cache", &l[i]) == 0, "alloc %d", i);
                data[i] = (CallbackData){ .report_w = a->report_w, .index = i,
                                          .answer = i == 0 && a->refuse_first ? -1 : 0 };
        }
        /* Lease 2 lowest, then 0, then 1 (NULL callback: given back without asking); 3 is not offered. */
        HOLDER_CHECK(vmmb_lease_set_reclaimable(l[0], 5, on_reclaim, &data[0]) == 0, "mark 0");
        HOLDER_CHECK(vmmb_lease_set_reclaimable(l[1], 9, NULL, NULL) == 0, "mark 1");
        HOLDER_CHECK(vmmb_lease_set_reclaimable(l[2], 1, on_reclaim, &data[2]) == 0, "mark 2");
        HOLDER_CHECK(vmmb_lease_set_reclaimable(l[3], 0, NULL, NULL) == 0, "mark 3");
        HOLDER_CHECK(vmmb_lease_set_reclaimable(l[3], VMMB_NOT_RECLAIMABLE, NULL, NULL) == 0, "unmark 3");
        HOLDER_CHECK(vmmb_lease_set_reclaimable(l[3], -2, NULL, NULL) == -EINVAL, "bad priority");
        HOLDER_CHECK(write(a->report_w, &x, 1) == 1, "report");
        HOLDER_CHECK(read(a->go_r, &x, 1) == 1, "go");
        /* What the test expects given back, by now: 2, and then 0 or (refused) 1. */
        HOLDER_CHECK(reclaimed_soon(l[2], 1) && vmmb_lease_ptr(l[2]) == 0, "2 not given back");
        HOLDER_CHECK(reclaimed_soon(l[0], !a->refuse_first), "0");
        HOLDER_CHECK(reclaimed_soon(l[1], a->refuse_first), "1");
        HOLDER_CHECK(vmmb_lease_reclaimed(l[3]) == 0, "3");
        HOLDER_CHECK(vmmb_lease_set_reclaimable(l[2], 0, NULL, NULL) == -ESTALE, "mark a given-back lease");
        HOLDER_CHECK(vmmb_lease_read(l[2], 0, &x, 1) == -ESTALE, "read a given-back lease");
        HOLDER_CHECK(vmmb_lease_read(l[3], 0, &x, 1) == 0, "read a lease not offered");
        /* Freeing the objects of given-back leases, and the others; vmmb_close() stops the watch. */
        HOLDER_CHECK(vmmb_free(l[2]) == 0, "free 2");
        HOLDER_CHECK(vmmb_free(l[3]) == 0, "free 3");
        vmmb_close(c);          /* frees 0 and 1, given back or not */
        return 0;
}

static void run(bool refuse_first) {
        int report[2], go[2];
        vmmb_lease *got[2];
        vmmb_client *c = NULL;
        char x;
        pid_t pid;

        harness_start_capped_or_fail(&h, "8M", NULL);   /* the device's room, not a user's limit, stops a call */
        ck_assert_int_eq(pipe2(report, O_CLOEXEC), 0);
        ck_assert_int_eq(pipe2(go, O_CLOEXEC), 0);
        pid = harness_fork(child_holder, &(HolderArgs){ .socket = h.socket, .report_w = report[1], .go_r = go[0],
                                                         .refuse_first = refuse_first });
        ck_assert_int_gt(pid, 0);
        close(report[1]);
        close(go[0]);
        ck_assert_int_eq(read(report[0], &x, 1), 1);
        ck_assert_int_eq(x, 'r');

        ck_assert_int_eq(vmmb_connect(h.socket, &c), 0);
        /* The first waiting call: lease 2 (priority 1) is asked, its callback gives it back. */
        ck_assert_msg(vmmb_alloc_wait(c, UNIT, 0, NULL, 30 * 1000000, &got[0]) == 0, "%s", vmmb_error_message());
        ck_assert_int_eq(read(report[0], &x, 1), 1);
        ck_assert_int_eq(x, '2');
        /* The second: lease 0 (priority 5); refused, lease 1 (priority 9, no callback) is given back. */
        ck_assert_msg(vmmb_alloc_wait(c, UNIT, 0, NULL, 30 * 1000000, &got[1]) == 0, "%s", vmmb_error_message());
        ck_assert_int_eq(read(report[0], &x, 1), 1);
        ck_assert_int_eq(x, '0');
        ck_assert_int_eq(write(go[1], "g", 1), 1);
        ck_assert_msg(harness_wait(pid) == 0, "the holder failed (see its stderr)");
        close(report[0]);
        close(go[1]);
        vmmb_free(got[0]);
        vmmb_free(got[1]);
        vmmb_close(c);
        harness_stop_or_fail(&h);
}

/* Lowest priority first; the callback gives back; the next waiting call asks the next lease. */
START_TEST(test_callback_gives_back) {
        run(false);
}
END_TEST

/* A callback that refuses: the lease stays mapped and unmarked, and the broker asks the next one. */
START_TEST(test_callback_refuses) {
        run(true);
}
END_TEST

int main(void) {
        return run_suite(UNIT_SUITE("reclaim", NULL, test_callback_gives_back, test_callback_refuses)) == 0
                       ? EXIT_SUCCESS
                       : EXIT_FAILURE;
}
