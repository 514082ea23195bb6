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
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "checked.h"
#include "harness.h"
#include "rawclient.h"
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

/* --- a lease asked for, then parked before the watch reads the request ------------------------------ */

typedef struct ParkerArgs {
        const char *socket;
        int report_w;           /* 'r' ready, 'A' and 'C' from callbacks, 'P' parked, 'E' failed */
        int go_r;               /* lets A's callback return */
        int cmd_r;              /* 'p': park B; 'f': check and finish */
} ParkerArgs;

static ParkerArgs parker;
static volatile int b_called;   /* set by B's callback, which must not run */

static int on_a_blocks(vmmb_lease *lease, uint64_t timeout_usec, void *userdata) {
        char x;

        (void)lease, (void)timeout_usec, (void)userdata;
        (void)!write(parker.report_w, "A", 1);
        return read(parker.go_r, &x, 1) == 1 ? 0 : -1;         /* the watch thread waits here, its requests queue */
}

static int on_b_never(vmmb_lease *lease, uint64_t timeout_usec, void *userdata) {
        (void)lease, (void)timeout_usec, (void)userdata;
        b_called = 1;
        return -1;
}

/* Reports its letter (userdata) and gives the lease back. */
static int on_report_gives_back(vmmb_lease *lease, uint64_t timeout_usec, void *userdata) {
        (void)lease, (void)timeout_usec;
        (void)!write(parker.report_w, userdata, 1);
        return 0;
}

/*
 * A holder's start: fills the device with leases labelled A, B, C and D (l[0..4)), marks A (priority 0, its
 * callback blocks until told), B (1, with `b_callback`) and C (2, its callback reports 'C' and gives it back),
 * and reports 'r'. 0, or 1 (said).
 */
static int holder_fill(void *arg, vmmb_reclaim_fn b_callback, void *b_userdata, vmmb_client **ret, vmmb_lease *l[4]) {
        parker = *(ParkerArgs *)arg;
        HOLDER_CHECK(vmmb_connect(parker.socket, ret) == 0, "connect");
        for (int i = 0; i < 4; i++)
                HOLDER_CHECK(vmmb_alloc(*ret, UNIT, 0, (const char[]){ (char)('A' + i), 0 }, &l[i]) == 0, "alloc");
        HOLDER_CHECK(vmmb_lease_set_reclaimable(l[0], 0, on_a_blocks, NULL) == 0 &&
                     vmmb_lease_set_reclaimable(l[1], 1, b_callback, b_userdata) == 0 &&
                     vmmb_lease_set_reclaimable(l[2], 2, on_report_gives_back, "C") == 0, "mark");
        HOLDER_CHECK(write(parker.report_w, "r", 1) == 1, "report");
        return 0;
}

/* The holder of test_asked_then_parked: B's callback must never run; parks B when told, while B's request waits
 * behind A's callback. */
static int child_parker(void *arg) {
        vmmb_lease *l[4], *a, *b, *c_, *d;
        vmmb_client *c = NULL;
        char x;

        if (holder_fill(arg, on_b_never, NULL, &c, l) != 0)
                return 1;
        a = l[0], b = l[1], c_ = l[2], d = l[3];

        HOLDER_CHECK(read(parker.cmd_r, &x, 1) == 1 && x == 'p', "command p");
        /* Asked already, not read yet: parking gives the device memory back all the same. */
        x = vmmb_lease_park(b, NULL) == 1 ? 'P' : 'E';
        HOLDER_CHECK(write(parker.report_w, &x, 1) == 1, "report park");

        HOLDER_CHECK(read(parker.cmd_r, &x, 1) == 1 && x == 'f', "command f");
        /* C's request came after B's on the watch's connection: B's has been read, and changed nothing. */
        HOLDER_CHECK(!b_called, "B's callback ran for a parked lease");
        HOLDER_CHECK(vmmb_lease_reclaimed(b) == 0 && vmmb_lease_parked(b) == 1, "B given back or not parked");
        HOLDER_CHECK(reclaimed_soon(a, 1) && reclaimed_soon(c_, 1), "A and C not given back");
        HOLDER_CHECK(read(parker.cmd_r, &x, 1) == 1 && x == 'u', "command u");
        HOLDER_CHECK(vmmb_lease_unpark(b) == 0 && vmmb_lease_parked(b) == 0, "unpark B");
        HOLDER_CHECK(vmmb_free(b) == 0 && vmmb_free(d) == 0, "free");
        vmmb_close(c);          /* frees the objects of A and C, given back */
        return 0;
}

typedef struct WaiterArgs {
        const char *socket;
        int served_w;           /* 'w' once served */
        int release_r;          /* a byte each: free and exit */
        uint64_t size;          /* what it waits for: 0 for one unit */
} WaiterArgs;

/* Waits for its size (the device is full), says so, and holds it until released. */
static int child_waiter(void *arg) {
        WaiterArgs *a = arg;
        vmmb_client *c = NULL;
        vmmb_lease *l;
        char x;

        HOLDER_CHECK(vmmb_connect(a->socket, &c) == 0, "waiter: connect");
        HOLDER_CHECK(vmmb_alloc_wait(c, a->size ?: UNIT, 0, NULL, 30 * 1000000, &l) == 0, "waiter: alloc_wait");
        HOLDER_CHECK(write(a->served_w, "w", 1) == 1, "waiter: report");
        (void)!read(a->release_r, &x, 1);
        vmmb_free(l);
        vmmb_close(c);
        return 0;
}

/* The reclaim state of the lease labelled `label`, as the daemon's List (all) shows it: "-" for none. */
static void labelled_state(const char *label, char *buf, size_t len, bool *ret_parked) {
        ListReply list = {};

        ck_assert_int_eq(list_get(h.socket, true, &list), 0);
        snprintf(buf, len, "?");
        for (size_t i = 0; i < list.n_leases; i++)
                if (list.leases[i].label && strcmp(list.leases[i].label, label) == 0) {
                        snprintf(buf, len, "%s", list.leases[i].reclaim ?: "-");
                        if (ret_parked)
                                *ret_parked = list.leases[i].parked;
                }
        list_reply_done(&list);
}

/* Polls List (bounded) until the lease labelled `label` is asked for; fails the test otherwise. */
static void wait_asked(const char *label) {
        uint64_t deadline = harness_now_msec() + 10000;
        char state[32];

        do
                labelled_state(label, state, sizeof(state), NULL);
        while (strcmp(state, "asked") != 0 && harness_now_msec() < deadline);
        ck_assert_msg(strcmp(state, "asked") == 0, "lease %s: %s, not asked", label, state);
}

/* A daemon of 4 units, a holder process that fills it (holder_fill()) and the pipes between them and the test. */
typedef struct Scene {
        int report[2], go[2], cmd[2], release[2];
        pid_t holder;
} Scene;

static void scene_start(Scene *sc, int (*holder)(void *arg)) {
        harness_start_capped_or_fail(&h, "8M", NULL);
        ck_assert_int_eq(pipe2(sc->report, O_CLOEXEC), 0);
        ck_assert_int_eq(pipe2(sc->go, O_CLOEXEC), 0);
        ck_assert_int_eq(pipe2(sc->cmd, O_CLOEXEC), 0);
        ck_assert_int_eq(pipe2(sc->release, O_CLOEXEC), 0);
        sc->holder = harness_fork(holder, &(ParkerArgs){ .socket = h.socket, .report_w = sc->report[1],
                                                          .go_r = sc->go[0], .cmd_r = sc->cmd[0] });
        ck_assert_int_gt(sc->holder, 0);
}

/* Waits for the holder to exit 0, closes the pipes and stops the daemon. */
static void scene_end(Scene *sc) {
        ck_assert_msg(harness_wait(sc->holder) == 0, "the holder failed (see its stderr)");
        for (int i = 0; i < 2; i++) {
                close(sc->report[i]);
                close(sc->go[i]);
                close(sc->cmd[i]);
                close(sc->release[i]);
        }
        harness_stop_or_fail(&h);
}

static pid_t start_waiter(WaiterArgs *w, int served[2]) {
        ck_assert_int_eq(pipe2(served, O_CLOEXEC), 0);
        w->served_w = served[1];
        return harness_fork(child_waiter, w);
}

/* Reads one report from a pipe (waiting at most IO_TIMEOUT_S), which must be `want`. */
static void expect_report(int fd, char want) {
        char x = 0;

        ck_assert_msg(pipe_get(fd, &x, 1) == 1, "no '%c' reported", want);
        ck_assert_int_eq(x, want);
}

/*
 * A lease asked for and parked before the library's watch reads the request (its watch thread is busy with
 * another callback): the parking gives the device memory back, so a waiting call is served by it; the
 * broker asks for it no more; and when the watch reads the request, the library neither calls the lease's
 * callback nor gives the parked lease back (freeing it would lose its content). The waiters are served in
 * their turn: the first by B's parking, the second by A. Each step waits for the one
 * before: a pipe, or List polled (bounded) for the broker's "asked".
 */
START_TEST(test_asked_then_parked) {
        int served[3][2];
        WaiterArgs w = { .socket = NULL };
        char state[32];
        bool parked = false;
        pid_t waiter[3];
        Scene sc;

        scene_start(&sc, child_parker);
        expect_report(sc.report[0], 'r');
        w = (WaiterArgs){ .socket = h.socket, .release_r = sc.release[0] };

        /* The first waiter: A is asked, and its callback holds the holder's watch thread. */
        waiter[0] = start_waiter(&w, served[0]);
        expect_report(sc.report[0], 'A');
        /* The second: B is asked; its request waits on the watch's connection. */
        waiter[1] = start_waiter(&w, served[1]);
        wait_asked("B");

        /* B parked: its device memory serves the waiter whose turn it is, the first, while A's callback still
         * holds the watch. */
        ck_assert_int_eq(write(sc.cmd[1], "p", 1), 1);
        expect_report(sc.report[0], 'P');
        expect_report(served[0][0], 'w');
        labelled_state("B", state, sizeof(state), &parked);
        ck_assert_str_eq(state, "-");
        ck_assert(parked);

        /* A given back serves the second; the watch then reads B's request. C's, asked for a third waiter,
         * comes after it on the same connection. */
        ck_assert_int_eq(write(sc.go[1], "g", 1), 1);
        expect_report(served[1][0], 'w');
        waiter[2] = start_waiter(&w, served[2]);
        expect_report(sc.report[0], 'C');
        expect_report(served[2][0], 'w');
        ck_assert_int_eq(write(sc.cmd[1], "f", 1), 1);

        /* The waiters free their units; B comes back into device memory. */
        ck_assert_int_eq(write(sc.release[1], "xxx", 3), 3);
        for (int i = 0; i < 3; i++) {
                ck_assert_int_eq(harness_wait(waiter[i]), 0);
                close(served[i][0]);
                close(served[i][1]);
        }
        ck_assert_int_eq(write(sc.cmd[1], "u", 1), 1);
        scene_end(&sc);
}
END_TEST

/* --- requests that arrive together ------------------------------------------------------------------- */

/* The holder of test_requests_read_together: B's callback reports 'B' and gives it back; D is not offered. */
static int child_three(void *arg) {
        vmmb_client *c = NULL;
        vmmb_lease *l[4];
        char x;

        if (holder_fill(arg, on_report_gives_back, "B", &c, l) != 0)
                return 1;
        HOLDER_CHECK(read(parker.cmd_r, &x, 1) == 1 && x == 'f', "command f");
        HOLDER_CHECK(reclaimed_soon(l[0], 1) && reclaimed_soon(l[1], 1) && reclaimed_soon(l[2], 1) &&
                     vmmb_lease_reclaimed(l[3]) == 0, "A, B and C given back, D kept");
        vmmb_close(c);
        return 0;
}

/*
 * One call waits for three units: the broker asks for A, B and C at once, three requests back to back on the
 * holder's watch connection. A's callback holds the watch thread until the broker has sent the other two, so
 * that they are read together: the library must answer both, not wait on the socket for more after the first
 * (C's request would then wait until ReclaimTimeout= had the broker mark the lease unresponsive, and the call
 * would not be served).
 */
START_TEST(test_requests_read_together) {
        int served[2];
        pid_t waiter;
        Scene sc;

        scene_start(&sc, child_three);
        expect_report(sc.report[0], 'r');
        waiter = start_waiter(&(WaiterArgs){ .socket = h.socket, .release_r = sc.release[0], .size = 3 * UNIT },
                              served);
        expect_report(sc.report[0], 'A');
        wait_asked("B");
        wait_asked("C");

        ck_assert_int_eq(write(sc.go[1], "g", 1), 1);
        expect_report(sc.report[0], 'B');
        expect_report(sc.report[0], 'C');
        expect_report(served[0], 'w');
        ck_assert_int_eq(write(sc.cmd[1], "f", 1), 1);
        ck_assert_int_eq(write(sc.release[1], "x", 1), 1);
        ck_assert_int_eq(harness_wait(waiter), 0);
        close(served[0]);
        close(served[1]);
        scene_end(&sc);
}
END_TEST

/* --- a shared lease, asked of a holder that did not mark it, or that parked its hold ------------------- */

typedef struct SharerArgs {
        const char *socket;
        int report_w;           /* 'r' ready, 'P' its hold parked; 'L' and 'M' from callbacks */
        int token_w, token_r;   /* the token of L, from the owner to the other holder */
        int cmd_r;              /* 'p': park its hold of L; 'f': check and finish */
        bool owner;             /* the process that makes and marks L (else the one that attaches it) */
        bool parks;             /* the owner parks its hold of L before L is asked for */
} SharerArgs;

/*
 * The owner makes L (marked, priority 0: its callback reports 'L' and gives its hold back), a filler and M
 * (marked, priority 9: its callback reports 'M' and gives it back), and shares L; the other holder attaches
 * L, not marking it, and marks a lease of its own, K (priority 1, no callback: given back without asking).
 * With `parks` the owner parks its hold of L when told: the other holder still maps L, so only the hold parks.
 */
static int child_sharer(void *arg) {
        SharerArgs *a = arg;
        char token[VMMB_TOKEN_SIZE] = "", x;
        vmmb_lease *l, *k = NULL, *f, *m = NULL;
        vmmb_client *c = NULL;

        parker = (ParkerArgs){ .report_w = a->report_w };
        HOLDER_CHECK(vmmb_connect(a->socket, &c) == 0, "connect");
        if (a->owner) {
                HOLDER_CHECK(vmmb_alloc(c, UNIT, 0, "L", &l) == 0 && vmmb_alloc(c, UNIT, 0, "F", &f) == 0 &&
                             vmmb_alloc(c, UNIT, 0, "M", &m) == 0, "alloc");
                HOLDER_CHECK(vmmb_share(l, VMMB_ANY_UID, 0, token) == 0, "share");
                HOLDER_CHECK(write(a->token_w, token, sizeof(token)) == sizeof(token), "token");
                HOLDER_CHECK(vmmb_lease_set_reclaimable(l, 0, on_report_gives_back, "L") == 0 &&
                             vmmb_lease_set_reclaimable(m, 9, on_report_gives_back, "M") == 0, "mark");
        } else {
                HOLDER_CHECK(read(a->token_r, token, sizeof(token)) == sizeof(token), "token");
                HOLDER_CHECK(vmmb_attach(c, token, 0, &l) == 0, "attach L");
                HOLDER_CHECK(vmmb_alloc(c, UNIT, 0, "K", &k) == 0, "alloc K");
                HOLDER_CHECK(vmmb_lease_set_reclaimable(k, 1, NULL, NULL) == 0, "mark K");
        }
        HOLDER_CHECK(write(a->report_w, "r", 1) == 1, "report");
        if (a->parks) {
                HOLDER_CHECK(read(a->cmd_r, &x, 1) == 1 && x == 'p', "command p");
                HOLDER_CHECK(vmmb_lease_park(l, NULL) == 0, "park: the other holder maps L, so only the hold");
                HOLDER_CHECK(write(a->report_w, "P", 1) == 1, "report park");
        }
        HOLDER_CHECK(read(a->cmd_r, &x, 1) == 1 && x == 'f', "command f");
        if (a->owner && a->parks)
                HOLDER_CHECK(vmmb_lease_reclaimed(l) == 0 && vmmb_lease_parked(l) == 1 && reclaimed_soon(m, 1),
                             "the owner gave its parked hold of L back, or not M");
        else if (a->owner)
                HOLDER_CHECK(reclaimed_soon(l, 1), "the owner did not give its hold of L back");
        else
                HOLDER_CHECK(vmmb_lease_reclaimed(l) == 0 && vmmb_lease_ptr(l) != 0 && reclaimed_soon(k, 1),
                             "the other holder gave L back, or not K");
        vmmb_close(c);
        return 0;
}

/*
 * L is shared by two processes of one user and marked by its owner only; both watch, so the broker may ask
 * for it, and asks both. The other holder, which did not offer L, refuses it, so that the broker asks for
 * the next lease (K) at once and the waiting call is served by K. With `parks`, the owner parked its hold
 * of L first (the other holder still maps L, so L stays in device memory and stays marked): the owner's
 * library refuses too, runs no callback and keeps the parked hold; else it gives its hold back. A second
 * waiter gets M, the owner's, asked: its request comes after L's on the owner's watch, so once 'M' is
 * reported L's request has been read there.
 */
static void run_shared(bool parks) {
        int report[2], token[2], cmd[2], cmd_other[2], release[2], served[2][2];
        char state[32];
        pid_t owner, other, waiter[2];

        harness_start_capped_or_fail(&h, "8M", NULL);
        ck_assert_int_eq(pipe2(report, O_CLOEXEC), 0);
        ck_assert_int_eq(pipe2(token, O_CLOEXEC), 0);
        ck_assert_int_eq(pipe2(cmd, O_CLOEXEC), 0);
        ck_assert_int_eq(pipe2(cmd_other, O_CLOEXEC), 0);
        ck_assert_int_eq(pipe2(release, O_CLOEXEC), 0);
        owner = harness_fork(child_sharer, &(SharerArgs){ .socket = h.socket, .report_w = report[1],
                                                           .token_w = token[1], .cmd_r = cmd[0], .owner = true,
                                                           .parks = parks });
        other = harness_fork(child_sharer, &(SharerArgs){ .socket = h.socket, .report_w = report[1],
                                                           .token_r = token[0], .cmd_r = cmd_other[0] });
        expect_report(report[0], 'r');
        expect_report(report[0], 'r');
        if (parks) {
                ck_assert_int_eq(write(cmd[1], "p", 1), 1);
                expect_report(report[0], 'P');
        }

        waiter[0] = start_waiter(&(WaiterArgs){ .socket = h.socket, .release_r = release[0] }, served[0]);
        if (!parks)
                expect_report(report[0], 'L');
        expect_report(served[0][0], 'w');
        /* Served by K, asked after the refusal: L was never left to its deadline. */
        labelled_state("L", state, sizeof(state), NULL);
        ck_assert_str_eq(state, "-");
        labelled_state("K", state, sizeof(state), NULL);
        ck_assert_str_eq(state, "?");           /* given back: no such lease */
        /* M next: once it is reported, the owner's watch has read L's request (and, parked, not run L's). */
        waiter[1] = start_waiter(&(WaiterArgs){ .socket = h.socket, .release_r = release[0] }, served[1]);
        expect_report(report[0], 'M');
        expect_report(served[1][0], 'w');

        ck_assert_int_eq(write(cmd[1], "f", 1), 1);
        ck_assert_int_eq(write(cmd_other[1], "f", 1), 1);
        ck_assert_msg(harness_wait(owner) == 0, "the owner failed (see its stderr)");
        ck_assert_msg(harness_wait(other) == 0, "the other holder failed (see its stderr)");
        ck_assert_int_eq(write(release[1], "xx", 2), 2);
        for (int i = 0; i < 2; i++)
                ck_assert_int_eq(harness_wait(waiter[i]), 0);
        for (int i = 0; i < 2; i++) {
                close(report[i]);
                close(token[i]);
                close(cmd[i]);
                close(cmd_other[i]);
                close(release[i]);
                close(served[0][i]);
                close(served[1][i]);
        }
        harness_stop_or_fail(&h);
}

START_TEST(test_shared_holder_refuses) {
        run_shared(false);
}
END_TEST

START_TEST(test_parked_hold_refuses) {
        run_shared(true);
}
END_TEST

/* --- a callback that marks or unmarks its own lease --------------------------------------------------- */

static atomic_int a_calls;      /* how often A's callback ran (on the watch thread; read by the holder's) */

/*
 * A's callback calls vmmb_lease_set_reclaimable() on A itself (the library must not wait for the callback that
 * calls it). With `userdata` "m", it marks A again, at another priority ("not now, ask me later"), reports
 * 'M' and refuses; with "u", it unmarks A, reports 'U' and gives A back.
 */
static int on_a_marks(vmmb_lease *lease, uint64_t timeout_usec, void *userdata) {
        bool unmarks = *(const char *)userdata == 'u';
        char x = unmarks ? 'U' : 'M';

        (void)timeout_usec;
        atomic_fetch_add(&a_calls, 1);
        if (vmmb_lease_set_reclaimable(lease, unmarks ? VMMB_NOT_RECLAIMABLE : 7, unmarks ? NULL : on_a_marks,
                                       unmarks ? NULL : userdata) != 0)
                x = 'E';
        (void)!write(parker.report_w, &x, 1);
        return unmarks ? 0 : -EAGAIN;
}

/*
 * The holder of the tests below: fills the device with A, B, C, D; marks A (priority 0, on_a_marks() with
 * `mode`) and B (priority 1: it reports 'B' and gives B back). When told 'f', reports how often A's callback
 * ran ('0' + n), and checks that the lease given back is B when A refused, else A.
 */
static int a_marker(void *arg, const char *mode) {
        bool unmarks = *mode == 'u';
        vmmb_lease *l[4];
        vmmb_client *c = NULL;
        char x;

        parker = *(ParkerArgs *)arg;
        HOLDER_CHECK(vmmb_connect(parker.socket, &c) == 0, "connect");
        for (int i = 0; i < 4; i++)
                HOLDER_CHECK(vmmb_alloc(c, UNIT, 0, (const char[]){ (char)('A' + i), 0 }, &l[i]) == 0, "alloc");
        HOLDER_CHECK(vmmb_lease_set_reclaimable(l[0], 0, on_a_marks, (void *)mode) == 0 &&
                     vmmb_lease_set_reclaimable(l[1], 1, on_report_gives_back, "B") == 0, "mark");
        HOLDER_CHECK(write(parker.report_w, "r", 1) == 1, "report");
        HOLDER_CHECK(read(parker.cmd_r, &x, 1) == 1 && x == 'f', "command f");
        x = (char)('0' + MIN(atomic_load(&a_calls), 9));
        HOLDER_CHECK(write(parker.report_w, &x, 1) == 1, "report calls");
        HOLDER_CHECK(reclaimed_soon(l[0], unmarks) && reclaimed_soon(l[1], !unmarks), "A or B given back, or not");
        HOLDER_CHECK(unmarks || vmmb_lease_ptr(l[0]) != 0, "A refused, and not mapped");
        HOLDER_CHECK(vmmb_lease_reclaimed(l[2]) == 0 && vmmb_lease_reclaimed(l[3]) == 0, "C or D given back");
        vmmb_close(c);
        return 0;
}

static int child_a_marks_again(void *arg) {
        return a_marker(arg, "m");
}

static int child_a_unmarks(void *arg) {
        return a_marker(arg, "u");
}

/*
 * The scene of the two tests below: a holder (`child`, a_marker()) marks A and B, a waiter's call gets A asked;
 * the holder reports `reports` (A's callback, then B's if it runs), the waiter is served, the lease labelled
 * `label` is then in `want` (its state as vmmctl list shows it), and A's callback ran once.
 */
static void run_a_marker(int (*child)(void *arg), const char *reports, const char *label, const char *want) {
        int served[2];
        char state[32];
        pid_t waiter;
        Scene sc;

        scene_start(&sc, child);
        expect_report(sc.report[0], 'r');
        waiter = start_waiter(&(WaiterArgs){ .socket = h.socket, .release_r = sc.release[0] }, served);
        for (const char *x = reports; *x; x++)
                expect_report(sc.report[0], *x);
        expect_report(served[0], 'w');
        labelled_state(label, state, sizeof(state), NULL);
        ck_assert_str_eq(state, want);
        ck_assert_int_eq(write(sc.cmd[1], "f", 1), 1);
        expect_report(sc.report[0], '1');
        ck_assert_int_eq(write(sc.release[1], "x", 1), 1);
        ck_assert_int_eq(harness_wait(waiter), 0);
        close(served[0]);
        close(served[1]);
        scene_end(&sc);
}

/*
 * A callback that marks its lease again (another priority: "not now, ask me later") and then refuses: the
 * refusal is the answer, and it ends the mark, the one set in the callback too. The broker asks the next lease
 * (B), which serves the waiting call, and A is not marked any more. (Were the mark kept, the broker would ask
 * A again at once for the very call it refused, and again after each refusal, for as long as the call waits:
 * the daemon keeps no record of refusals, and should not, since a lease marked again after a refusal is
 * offered again, to the call that waits too: test_callback_that_refuses_and_a_live_export in
 * tests/python/test_vmmbroker.py.)
 */
START_TEST(test_callback_marks_again_then_refuses) {
        run_a_marker(child_a_marks_again, "MB", "A", "-");
}
END_TEST

/*
 * A callback that unmarks its lease and then gives it back: giving back is the answer, and the waiting call is
 * served by A. The unmarking is no refusal of its own, which would have the broker ask the next lease (B) for
 * memory the call is getting already: B is still marked, never asked.
 */
START_TEST(test_callback_unmarks_then_gives_back) {
        run_a_marker(child_a_unmarks, "U", "B", "marked");
}
END_TEST

int main(void) {
        return run_suite(UNIT_SUITE("reclaim", NULL, test_callback_gives_back, test_callback_refuses,
                                      test_asked_then_parked, test_requests_read_together,
                                      test_shared_holder_refuses, test_parked_hold_refuses,
                                      test_callback_marks_again_then_refuses,
                                      test_callback_unmarks_then_gives_back)) == 0
                       ? EXIT_SUCCESS
                       : EXIT_FAILURE;
}
