/* SPDX-License-Identifier: MIT */

/*
 * Park while host slabs are being made (docs/protocol.md, "Parking"): pinning host memory takes about 0.3 s per
 * GiB on a real GPU host, so the daemon makes a Park's host slabs off its event loop and the Park waits, its
 * connection reading nothing more, while every other connection is served. The simulated device holds every
 * cuMemCreate of host memory while the file SIMCUDA_HOLD_CREATE_FILE names is there, and makes that name +
 * ".reached" when one starts to wait; a test parks the first lease of a daemon (no host slabs cached: they must
 * be made), sees the make under way, checks what is answered meanwhile, and removes the file.
 *
 * Nothing here sleeps: the test polls the .reached file, the waiting connection (poll() with no timeout, or
 * with ANSWER_MS as the bound of what must be answered at once) and Status in bounded loops. Where a call is
 * not answered in time, the hold is released before the test fails; and a guard process removes the hold file
 * when the test's process ends however it ends (a failed check _exit()s, Check's timeout kills), so that no
 * daemon is left waiting for a file nobody removes. A daemon that makes host slabs in its loop answers nothing
 * while the hold is there: those tests fail after ANSWER_MS saying so.
 *
 * Nor does anybody wait for a Park's copy into host memory (some 20 ms per GiB) but the Park: the daemon queues
 * it on the device's copy stream and stores the lease parked once the stream has done it. The simulated device
 * holds every device-to-device copy (a park's or an unpark's) while the file SIMCUDA_HOLD_COPY_FILE names is
 * there, and makes that name + ".reached" when a stream waits at one; its scrubs go on. A test parks a lease
 * whose host slabs a first park and unpark left cached (nothing to make: creates are held too, to see that none
 * starts), sees the copy held, checks what is answered meanwhile, and what the parking process's end, the end
 * of a lease another user held, an Attach of the lease and the daemon's stop do to the waiting Park; then it
 * removes the file. A daemon that copies in its loop answers no Status while the copy is held: those tests fail
 * after ANSWER_MS saying so.
 *
 * An Unpark's copy back into device memory (or an Attach's of a parked lease) is held the same way: the Unpark
 * waits, everybody else is answered, another holder's Unpark or another process's Attach waits for the same
 * copy, the parking process's own Unpark waits for its Park's copy, and the daemon's stop answers the Unpark.
 */

#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/pidfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include "checked.h"
#include "codec.h"
#include "harness.h"
#include "json.h"
#include "macro.h"
#include "rawclient.h"
#include "unit.h"

#define MiB (UINT64_C(1) << 20)
#define UNIT (2 * MiB)                  /* the granularity: one slab */
#define SIZE (64 * MiB)                 /* a lease to park */
#define SIZE2 (32 * MiB)                /* another, of another layout: slabs of its own to make */
#define ANSWER_MS 20000                 /* what must be answered, or reached, while something is held is within
                                           this (time: a loaded machine makes each slower); polls of the daemon
                                           are bounded by HARNESS_POLL_MS */
#define UID_OTHER 65534                 /* nobody */
#define CONFIG "[Broker]\nHostCapacity=512M\n"  /* MaxHostBytes= 50% of it: 256 MiB */

static Harness h;
static char hold[64], reached[80];      /* this test's hold file and the file the simulator makes under it */
static char copies[64], copied[80];     /* the file that holds the daemon's copies (SIMCUDA_HOLD_COPY_FILE), or
                                           "", and the file the simulator makes under it */
static char memsets[64], memset_reached[80];    /* the file that holds the daemon's memsets (scrubs;
                                                   SIMCUDA_HOLD_MEMSET_FILE) once made, or "", and the simulator's
                                                   under it */
static const char *holding;             /* what the test holds, for what it says when a call is not answered */
static pid_t guard = -1;                /* removes them when this process ends (start_guard()) */
static int guard_w = -EBADF;            /* its pipe: EOF when this process ends */

/* ---- holding the daemon's host cuMemCreate and its copies ----------------------------------------------- */

/* Lets held creates and copies go on; what was held under them (.reached) stays for the test to look at. */
static void release_hold(void) {
        if (hold[0])
                (void)unlink(hold);
        if (copies[0])
                (void)unlink(copies);
        if (memsets[0])
                (void)unlink(memsets);
}

/* Makes the file `path` (empty), unless it is there. */
static void make_file(const char *path) {
        int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);

        ck_assert_int_ge(fd, 0);
        close(fd);
}

/* Holds the daemon's next host cuMemCreate, and forgets whether one was held before. */
static void make_hold(void) {
        (void)unlink(reached);
        make_file(hold);
}

/* Holds the daemon's next copy (a Park's into host memory, an Unpark's back), and forgets whether one was held
 * before. Its scrubs go on. */
static void hold_copies(void) {
        ck_assert(copies[0]);
        (void)unlink(copied);
        make_file(copies);
}

/* Lets the next `n` operations that the hold file `file` holds run, one at a time, and holds the one after them
 * (the file holding a count, written whole by a rename); forgets whether one was held before (`reached_file`). */
static void let_through(const char *file, const char *reached_file, unsigned n) {
        char tmp[80];
        int fd;

        ck_assert(file[0]);
        (void)unlink(reached_file);
        snprintf(tmp, sizeof(tmp), "%s.new", file);
        fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        ck_assert_int_ge(fd, 0);
        ck_assert_int_gt(dprintf(fd, "%u", n), 0);
        close(fd);
        ck_assert_int_eq(rename(tmp, file), 0);
}

/* Lets the next `n` held copies run and holds the one after them (SIMCUDA_HOLD_COPY_FILE). */
static void let_copies_through(unsigned n) {
        let_through(copies, copied, n);
}

/* Lets the next `n` held host cuMemCreates run and holds the one after them (SIMCUDA_HOLD_CREATE_FILE). */
static void let_creates_through(unsigned n) {
        let_through(hold, reached, n);
}

/*
 * Forks the guard: a process that waits for the end of its pipe, which only this process holds (close-on-exec:
 * not the daemon), and then removes the hold files. It is not killed with this one, unlike harness_fork()'s
 * children, and leaves its process group, which Check kills once a test's process has ended.
 */
static void start_guard(void) {
        int p[2];

        ck_assert_int_eq(pipe2(p, O_CLOEXEC), 0);
        fflush(stdout);
        fflush(stderr);
        guard = fork();
        ck_assert_int_ge(guard, 0);
        if (guard == 0) {
                char c;

                (void)setpgid(0, 0);
                (void)close_all_but(&p[0], 1);
                while (read(p[0], &c, 1) < 0 && errno == EINTR)
                        ;
                (void)unlink(hold);
                (void)unlink(reached);
                if (copies[0]) {
                        (void)unlink(copies);
                        (void)unlink(copied);
                }
                if (memsets[0]) {
                        (void)unlink(memsets);
                        (void)unlink(memset_reached);
                }
                _exit(0);
        }
        close(p[0]);
        guard_w = p[1];
}

/* Ends the guard, which removes the hold files. */
static void stop_guard(void) {
        guard_w = safe_close(guard_w);
        ck_assert_int_eq(harness_wait(guard), 0);
        guard = -1;
}

/*
 * For a test that holds the simulated device's host cuMemCreate, and its copies too with `copy`: false, said on
 * stderr, on a real driver, which cannot; else names the hold files (this process's, not there yet), sets
 * SIMCUDA_HOLD_CREATE_FILE (and SIMCUDA_HOLD_COPY_FILE) and starts the daemon with a device of 1 GiB and
 * `config` (vmmbroker.conf lines).
 */
static bool start_holding(const char *test, const char *config, bool copy) {
        if (!strstr(getenv("VMMBROKER_LIBCUDA") ?: "", "simcuda")) {
                fprintf(stderr, "%s: not run: it holds the simulated device's %s, which a real driver cannot\n",
                        test, copy ? "copies" : "cuMemCreate");
                return false;
        }
        snprintf(hold, sizeof(hold), "/tmp/vmmb-hold-create-%d", (int)getpid());
        snprintf(reached, sizeof(reached), "%s.reached", hold);
        copies[0] = copied[0] = '\0';
        if (copy) {
                snprintf(copies, sizeof(copies), "/tmp/vmmb-hold-copy-%d", (int)getpid());
                snprintf(copied, sizeof(copied), "%s.reached", copies);
                (void)unlink(copied);
        }
        holding = copy ? "a Park's copy into host memory was held" : "a Park's host slabs were being made";
        release_hold();
        (void)unlink(reached);
        start_guard();
        ck_assert_int_eq(setenv("SIMCUDA_HOLD_CREATE_FILE", hold, 1), 0);
        if (copy)
                ck_assert_int_eq(setenv("SIMCUDA_HOLD_COPY_FILE", copies, 1), 0);
        harness_start_capped_or_fail(&h, "1G", config);
        return true;
}

/*
 * start_holding() without copies, and the daemon's memsets (its scrubs) held while the file `memsets` is there
 * (hold_memsets()): false on a real driver.
 */
static bool start_holding_memsets(const char *test, const char *config) {
        snprintf(memsets, sizeof(memsets), "/tmp/vmmb-hold-memset-%d", (int)getpid());
        snprintf(memset_reached, sizeof(memset_reached), "%s.reached", memsets);
        (void)unlink(memset_reached);
        ck_assert_int_eq(setenv("SIMCUDA_HOLD_MEMSET_FILE", memsets, 1), 0);
        if (start_holding(test, config, false))         /* its guard removes the memsets' files too */
                return true;
        memsets[0] = memset_reached[0] = '\0';
        ck_assert_int_eq(unsetenv("SIMCUDA_HOLD_MEMSET_FILE"), 0);
        return false;
}

/* Holds the daemon's next memset (a scrub's), and forgets whether one was held before. Its copies go on. */
static void hold_memsets(void) {
        ck_assert(memsets[0]);
        (void)unlink(memset_reached);
        make_file(memsets);
}

/* Lets held creates, copies and memsets go on and stops the daemon, which must exit with status 0. */
static void stop(void) {
        release_hold();
        harness_stop_or_fail(&h);
        stop_guard();
        ck_assert_int_eq(unsetenv("SIMCUDA_HOLD_CREATE_FILE"), 0);
        ck_assert_int_eq(unsetenv("SIMCUDA_HOLD_COPY_FILE"), 0);
        ck_assert_int_eq(unsetenv("SIMCUDA_HOLD_MEMSET_FILE"), 0);
        memsets[0] = memset_reached[0] = '\0';
}

/*
 * Waits, at most ANSWER_MS, for the simulator to make `file` (a hold's .reached: the daemon reached what is
 * held); else releases the holds and fails the test, saying that `what` did not happen.
 */
static void reached_or_fail(const char *file, const char *what) {
        uint64_t deadline = harness_now_msec() + ANSWER_MS;

        while (access(file, F_OK) != 0 && harness_now_msec() < deadline)
                (void)poll(NULL, 0, 1);
        if (access(file, F_OK) != 0) {
                release_hold();
                ck_abort_msg("%s within %d s (%s never appeared)", what, ANSWER_MS / 1000, file);
        }
}

/* Waits, at most ANSWER_MS, for the daemon to start a held host cuMemCreate. */
static void wait_for_make(void) {
        reached_or_fail(reached, "the Park made no host slab");
}

/* ---- calls ------------------------------------------------------------------------------------------------ */

/* Whether `c` has something to read now (no waiting): a reply, or the daemon's hang-up. */
static bool readable_now(VarlinkConn *c) {
        struct pollfd p = { .fd = varlink_conn_get_fd(c), .events = POLLIN };

        return poll(&p, 1, 0) == 1;
}

/*
 * Waits, at most ANSWER_MS, for `c` to have its answer to read. Returns whether it came; if not, releases the
 * hold first, so that the daemon goes on while the test fails.
 */
static bool answered_within(VarlinkConn *c) {
        struct pollfd p = { .fd = varlink_conn_get_fd(c), .events = POLLIN };
        uint64_t deadline = harness_now_msec() + ANSWER_MS;
        int k;

        do
                k = poll(&p, 1, (int)(deadline - MIN(deadline, harness_now_msec())));
        while (k < 0 && errno == EINTR);
        if (k == 1)
                return true;
        release_hold();
        return false;
}

/* Sends a Park of lease `id` on `c` without reading its answer. */
static int park_send(VarlinkConn *c, const char *id) {
        _cleanup_(json_object_putp) json_object *params = NULL;
        FreeParams p = { .id = (char *)id };
        int k = id_params_encode(&p, &params);

        return k < 0 ? k : call_send(c, VMMB_METHOD_PARK, params, false);
}

/* Reads the answer to a Park on `c`, which must be a success saying `parked`. */
static void park_answer_or_fail(VarlinkConn *c, bool parked) {
        ParkReply p = {};
        Reply r;

        ck_assert_int_eq(reply_read(c, &r, NULL), 0);
        ck_assert_msg(!r.error, "Park refused: %s %s", r.error, json_object_to_json_string(r.params));
        ck_assert_int_eq(park_reply_decode(r.params, &p, NULL), 0);
        ck_assert_msg(p.parked == parked, "the lease was %sparked: %s", p.parked ? "" : "not ",
                      json_object_to_json_string(r.params));
        park_reply_done(&p);
        reply_done(&r);
}

/* Reads the answer to a Park on `c`, which must be `parked: true`. */
static void parked_or_fail(VarlinkConn *c) {
        park_answer_or_fail(c, true);
}

/*
 * Reads what comes on `c`, a connection of a killed process that the test keeps, for the Park it sent: the
 * daemon's hang-up, or any answer but `parked: true`.
 */
static void killed_park_answer_or_fail(VarlinkConn *c) {
        Reply r;

        if (reply_read(c, &r, NULL) < 0)
                return;
        ck_assert_msg(r.error || !json_object_get_boolean(json_object_object_get(r.params, "parked")),
                      "the Park of a killed process was answered %s", json_object_to_json_string(r.params));
        reply_done(&r);
}

/* Shares lease `id` on `c` with user `uid` and returns the token in `token`. */
static void share_or_fail(VarlinkConn *c, const char *id, uid_t uid, char token[static VMMB_TOKEN_MAX + 1]) {
        char params[128];
        Reply r;

        snprintf(params, sizeof(params), "{\"id\": \"%s\", \"uid\": %u}", id, (unsigned)uid);
        ck_assert_int_eq(call_text(c, VMMB_METHOD_SHARE, params, &r), 0);
        ck_assert_msg(!r.error, "Share refused: %s %s", r.error, json_object_to_json_string(r.params));
        ck_assert_uint_eq(strlen(reply_str(&r, "token") ?: ""), VMMB_TOKEN_LEN);
        snprintf(token, VMMB_TOKEN_MAX + 1, "%s", reply_str(&r, "token"));
        reply_done(&r);
}

/* Sends an Attach with `token` on `c` without reading its answer. */
static int attach_send(VarlinkConn *c, const char *token) {
        _cleanup_(json_object_putp) json_object *params = json_object_new_object();

        if (!params || json_object_object_add(params, "token", json_object_new_string(token)) < 0)
                return -ENOMEM;
        return call_send(c, VMMB_METHOD_ATTACH, params, false);
}

/* Sends an Unpark of lease `id` on `c` without reading its answer. */
static int unpark_send(VarlinkConn *c, const char *id) {
        _cleanup_(json_object_putp) json_object *params = NULL;
        FreeParams p = { .id = (char *)id };
        int k = id_params_encode(&p, &params);

        return k < 0 ? k : call_send(c, VMMB_METHOD_UNPARK, params, false);
}

/* Reads the answer to an Unpark of lease `id` on `c`, which must be the lease, and returns it, its fds open. */
static TestLease unpark_answer_or_fail(VarlinkConn *c, const char *id) {
        TestLease l;
        Reply r;

        ck_assert_int_eq(reply_read(c, &r, NULL), 0);
        ck_assert_msg(!r.error, "Unpark refused: %s %s", r.error, json_object_to_json_string(r.params));
        ck_assert_int_eq(lease_take(&r, &l), 0);
        reply_done(&r);
        ck_assert_str_eq(l.id, id);
        return l;
}

/* Unparks lease `id` on `c` and returns it, its fds open. */
static TestLease unpark_or_fail(VarlinkConn *c, const char *id) {
        ck_assert_int_eq(unpark_send(c, id), 0);
        return unpark_answer_or_fail(c, id);
}

/* Device 0 as Status says, on a connection of its own. */
static WireDevice status(void) {
        WireDevice d;

        ck_assert_int_eq(harness_status(h.socket, &d), 0);
        return d;
}

/*
 * A Status on a connection of its own that must be answered within ANSWER_MS, while a host cuMemCreate or a copy
 * is held (else the hold is released and the test fails). Returns device 0.
 */
static WireDevice status_while_held(void) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        StatusReply s = {};
        WireDevice d;
        Reply r;

        ck_assert_int_eq(conn_open(h.socket, &c), 0);
        ck_assert_int_eq(call_send(c, VMMB_METHOD_STATUS, NULL, false), 0);
        ck_assert_msg(answered_within(c), "a Status on another connection was not answered within %d s while %s "
                      "(done in the daemon's loop?)", ANSWER_MS / 1000, holding);
        ck_assert_int_eq(reply_read(c, &r, NULL), 0);
        ck_assert_msg(!r.error, "Status refused: %s", r.error);
        ck_assert_int_eq(status_reply_decode(r.params, &s, NULL), 0);
        ck_assert_uint_ge(s.n_devices, 1);
        d = s.devices[0];
        d.name = NULL;
        status_reply_done(&s);
        reply_done(&r);
        return d;
}

/* Polls Status, each answered at once though a make is held, until the device has `n` waiters (bounded). */
static void wait_for_waiters_while_held(int64_t n) {
        int64_t waiters = -1;

        for (uint64_t end = harness_poll_deadline(); harness_now_msec() < end && waiters != n;)
                waiters = status_while_held().waiters;
        ck_assert_msg(waiters == n, "the device has %" PRId64 " waiters, not %" PRId64, waiters, n);
}

/*
 * Whether List (every lease, on a connection of its own) says lease `id` is parked. Status's `parked` cannot say:
 * it counts the host slabs a copy in flight fills too.
 */
static bool listed_parked(const char *id) {
        const WireLeaseInfo *li;
        ListReply lr = {};
        bool parked;

        ck_assert_int_eq(list_get(h.socket, true, &lr), 0);
        li = list_find(&lr, id);
        ck_assert_msg(li, "lease %s is not listed", id);
        parked = li->parked;
        list_reply_done(&lr);
        return parked;
}

/*
 * Whether List says lease `id` is not parked, nor by any of its holders, and it has `n_holders` of them; else it
 * fails the test, saying why.
 */
static void listed_unparked_or_fail(const char *id, size_t n_holders) {
        const WireLeaseInfo *li;
        ListReply lr = {};

        ck_assert_int_eq(list_get(h.socket, true, &lr), 0);
        li = list_find(&lr, id);
        ck_assert_msg(li, "lease %s is not listed", id);
        ck_assert_msg(!li->parked, "lease %s is parked though it was unparked", id);
        ck_assert_uint_eq(li->n_holders, n_holders);
        for (size_t i = 0; i < li->n_holders; i++)
                ck_assert_msg(!li->holders[i].parked, "lease %s's holder %" PRId64 " is still parked", id,
                              li->holders[i].pid);
        list_reply_done(&lr);
}

/* Waits, at most ANSWER_MS, for the daemon's copy stream to reach a held copy, `what`'s (for the failure). */
static void copy_reached_or_fail(const char *what) {
        char said[64];

        snprintf(said, sizeof(said), "%s started no copy", what);
        reached_or_fail(copied, said);
}

/*
 * Waits, at most ANSWER_MS, for the daemon's copy stream to reach the held copy of the Park of lease `id` just
 * sent; then a Status must be answered at once, the Park must have taken the host slabs cached for it, and the
 * lease must not be parked yet.
 */
static void wait_for_copy(const char *id) {
        WireDevice d;

        copy_reached_or_fail("the Park");
        d = status_while_held();
        ck_assert_msg(d.host_cached == 0, "the Park left %" PRId64 " bytes of host slabs cached", d.host_cached);
        ck_assert_msg(!listed_parked(id), "lease %s is parked though its copy is held", id);
}

/*
 * Waits, at most ANSWER_MS, for the daemon's copy stream to reach the held copy of the Unpark of lease `id`
 * (parked, the device's only lease, of SIZE) just sent; then a Status must be answered at once, the Unpark must
 * have taken device slabs for it, and the lease must still be parked: its content is in host memory until the
 * copy is done.
 */
static void wait_for_copy_back(const char *id) {
        WireDevice d;

        copy_reached_or_fail("the Unpark");
        d = status_while_held();
        ck_assert_msg(d.leased == SIZE, "%" PRIu64 " bytes leased while the Unpark's copy of %" PRIu64 " was held",
                      d.leased, SIZE);
        ck_assert_int_eq(d.parked, (int64_t)SIZE);
        ck_assert_msg(listed_parked(id), "lease %s is not parked though its copy back is held", id);
}

/*
 * The value of the metric sample `key` (its name and labels, then a space), from Metrics on a connection of its
 * own, answered within ANSWER_MS (else the hold is released and the test fails). The metrics are an
 * administrator's: root's here.
 */
static uint64_t metric(const char *key) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        MetricsReply m = {};
        uint64_t v;
        Reply r;

        ck_assert_int_eq(conn_open(h.socket, &c), 0);
        ck_assert_int_eq(call_send(c, VMMB_METHOD_METRICS, NULL, false), 0);
        ck_assert_msg(answered_within(c), "Metrics was not answered within %d s while %s", ANSWER_MS / 1000,
                      holding);
        ck_assert_int_eq(reply_read(c, &r, NULL), 0);
        ck_assert_msg(!r.error, "Metrics refused: %s", r.error);
        ck_assert_int_eq(metrics_reply_decode(r.params, &m, NULL), 0);
        ck_assert_msg(harness_metric(m.text, key, &v) == 0, "the metrics have no count %s", key);
        metrics_reply_done(&m);
        reply_done(&r);
        return v;
}

/* Device 0's bytes copied between device and host memory (vmmbroker_device_copied_bytes_total). */
static uint64_t copied_bytes(void) {
        return metric("vmmbroker_device_copied_bytes_total{device=\"0\"} ");
}

/* How many calls wait off the loop for `reason` now (vmmbroker_calls_waiting). Root only. */
static uint64_t calls_waiting(const char *reason) {
        char key[64];

        snprintf(key, sizeof(key), "vmmbroker_calls_waiting{reason=\"%s\"} ", reason);
        return metric(key);
}

/*
 * Waits, at most HARNESS_POLL_MS, until `n` calls wait off the loop for `reason` (vmmbroker_calls_waiting:
 * "host_memory", host slabs being made; "zeroing", memory being zeroed; "copy", a copy between device
 * and host memory): the call just sent has been read, and waits. Then none waits for `other` (NULL: no check),
 * the reason it must not be counted under. Root only (the metrics are an administrator's); others make two
 * Status round trips on connections made after the call instead, which make that likely but cannot say it.
 */
static void wait_for_calls_waiting(const char *reason, uint64_t n, const char *other) {
        uint64_t waiting = 0;

        if (geteuid() != 0) {
                (void)status_while_held();
                (void)status_while_held();
                return;
        }
        for (uint64_t end = harness_poll_deadline(); harness_now_msec() < end && waiting != n;)
                waiting = calls_waiting(reason);
        ck_assert_msg(waiting == n, "%" PRIu64 " calls wait for %s, not %" PRIu64 " (the call just sent was not "
                      "read, or did not wait)", waiting, reason, n);
        if (other) {
                waiting = calls_waiting(other);
                ck_assert_msg(waiting == 0, "%" PRIu64 " calls wait for %s, not 0, while %" PRIu64 " wait for %s",
                              waiting, other, n, reason);
        }
}

/* Polls Status until no lease is left, `host_cached` bytes of host slabs are cached and nothing is being
 * scrubbed (bounded). */
static void wait_for_idle(int64_t host_cached) {
        WireDevice d = {};

        for (uint64_t end = harness_poll_deadline(); harness_now_msec() < end;) {
                d = status();
                if (d.leases == 0 && d.leased == 0 && d.scrubbing == 0 && d.parked == 0 &&
                    d.host_cached == host_cached)
                        return;
        }
        ck_abort_msg("the device has %" PRIu64 " leases (%" PRIu64 " bytes, %" PRIu64 " scrubbing, %" PRId64
                     " parked) and %" PRId64 " bytes of host slabs cached, not none and %" PRId64, d.leases, d.leased,
                     d.scrubbing, d.parked, d.host_cached, host_cached);
}

/* ---- leases with content ------------------------------------------------------------------------------------ */

/* Allocs `size` on `c` and writes `word` all over it through the (simulated) device; unmapped and its fds
 * closed again, as a process leaves a lease it parks. */
static TestLease alloc_written(Gpu *g, VarlinkConn *c, uint64_t size, uint32_t word) {
        CUdeviceptr va;
        TestLease l;

        ck_assert_int_eq(lease_alloc(c, size, &l), 0);
        ck_assert_int_eq(gpu_map(g, &l, &va), 0);
        ck_assert_int_eq(g->cu->cuMemsetD32(va, word, size / 4), CUDA_SUCCESS);
        ck_assert_int_eq(gpu_verify(g, va, size, word), 0);    /* done before the unmap, which would not wait */
        ck_assert_int_eq(cuda_unmap(g->cu, va, l.sizes, l.n), 0);
        test_lease_close(&l);
        return l;
}

/*
 * Leaves host slabs for a lease of `size` cached, as a process leaves them that parks, unparks and frees a lease
 * of that size on `c` (the first park makes them): a later park of that size makes nothing, it only waits for
 * its copy. Waits until they are scrubbed and cached.
 */
static void cache_host_slabs(VarlinkConn *c, uint64_t size) {
        TestLease l;

        ck_assert_int_eq(lease_alloc(c, size, &l), 0);
        test_lease_close(&l);
        ck_assert_int_eq(park_send(c, l.id), 0);
        parked_or_fail(c);
        l = unpark_or_fail(c, l.id);
        test_lease_close(&l);
        ck_assert_int_eq(lease_free(c, l.id), 0);
        wait_for_idle((int64_t)size);
}

/* Maps lease `l` (its fds open) and checks that it holds `word` all over, as it came back from host memory. */
static void content_or_fail(Gpu *g, const TestLease *l, uint32_t word) {
        CUdeviceptr va;

        ck_assert_int_eq(gpu_map(g, l, &va), 0);
        ck_assert_msg(gpu_verify(g, va, l->size, word) == 0, "lease %s did not come back with its content", l->id);
        ck_assert_int_eq(cuda_unmap(g->cu, va, l->sizes, l->n), 0);
}

/*
 * The Unpark of lease `id` sent on `a` while `what` is held: not answered, and the lease still parked; once the
 * hold is released, answered with the lease (of SIZE), which holds `word` all over. Its fds are closed after.
 */
static void unpark_waits_for_hold(Gpu *g, VarlinkConn *a, const char *id, uint32_t word, const char *what) {
        TestLease l;

        ck_assert_msg(!readable_now(a), "the Unpark was answered while %s was held", what);
        ck_assert_msg(listed_parked(id), "lease %s is not parked though %s is held", id, what);
        release_hold();
        ck_assert_msg(answered_within(a), "the Unpark was not answered within %d s of the release of %s",
                      ANSWER_MS / 1000, what);
        l = unpark_answer_or_fail(a, id);
        ck_assert_uint_eq(l.size, SIZE);
        content_or_fail(g, &l, word);
        test_lease_close(&l);
}

/* Unparks lease `id` on `c`, checks that it holds `word` all over, and frees it. */
static void unpark_check_free(Gpu *g, VarlinkConn *c, const char *id, uint64_t size, uint32_t word) {
        TestLease l = unpark_or_fail(c, id);

        ck_assert_uint_eq(l.size, size);
        content_or_fail(g, &l, word);
        test_lease_close(&l);
        ck_assert_int_eq(lease_free(c, id), 0);
}

/* ---- processes -------------------------------------------------------------------------------------------- */

/* Whether process `pid` (a child) has exited, without reaping it. */
static bool exited_now(pid_t pid) {
        siginfo_t si = {};

        return waitid(P_PID, (id_t)pid, &si, WEXITED | WNOHANG | WNOWAIT) == 0 && si.si_pid == pid;
}

/* Waits, at most ANSWER_MS, for child `pid` to exit, and checks it succeeded; else releases the hold and fails
 * the test, saying `what` was not done while something was held. */
static void child_done_within(pid_t pid, const char *what) {
        _cleanup_close_ int pidfd = pidfd_open(pid, 0);
        struct pollfd p = { .fd = pidfd, .events = POLLIN };
        int k;

        ck_assert_int_ge(pidfd, 0);
        do
                k = poll(&p, 1, ANSWER_MS);
        while (k < 0 && errno == EINTR);
        if (k != 1) {
                release_hold();
                (void)kill(pid, SIGKILL);
                (void)harness_wait(pid);
                ck_abort_msg("%s: not done within %d s while %s (done in the daemon's loop?)", what,
                             ANSWER_MS / 1000, holding);
        }
        ck_assert_msg(harness_wait(pid) == 0, "%s failed (see the child's stderr)", what);
}

/*
 * In a child: becomes nobody, Allocs `size` and Frees it; with `park`, Parks it first, which must be answered
 * parked (its host slabs made while another user's park still makes its own, or taken from the cache).
 */
static int other_user_lease(const char *socket, uint64_t size, bool park) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        TestLease l;
        int k;

        CHILD_CHECK(setgroups(0, NULL) == 0 && setresgid(UID_OTHER, UID_OTHER, UID_OTHER) == 0 &&
                    setresuid(UID_OTHER, UID_OTHER, UID_OTHER) == 0, "cannot become uid %u: %m", UID_OTHER);
        k = conn_open(socket, &c);
        CHILD_CHECK(k == 0, "connect: %s", strerror(-k));
        k = lease_alloc(c, size, &l);
        CHILD_CHECK(k == 0, "Alloc: %s", strerror(-k));
        test_lease_close(&l);
        if (park) {
                ParkReply p = {};
                Reply r;

                k = park_send(c, l.id);
                CHILD_CHECK(k == 0, "Park: %s", strerror(-k));
                k = reply_read(c, &r, NULL);
                CHILD_CHECK(k == 0 && !r.error, "Park: %s", k < 0 ? strerror(-k) : r.error);
                CHILD_CHECK(park_reply_decode(r.params, &p, NULL) == 0 && p.parked, "Park: not parked");
                park_reply_done(&p);
                reply_done(&r);
        }
        k = lease_free(c, l.id);
        CHILD_CHECK(k == 0, "Free: %s", strerror(-k));
        return 0;
}

/* In a child: becomes nobody, and Allocs and Frees a slab. */
static int child_other_user(void *arg) {
        return other_user_lease(arg, UNIT, false);
}

/* In a child: becomes nobody, Allocs a slab, Parks it (answered parked) and Frees it. */
static int child_other_parker(void *arg) {
        return other_user_lease(arg, UNIT, true);
}

/* In a child: becomes nobody, Allocs SIZE, Parks it (answered parked) and Frees it. */
static int child_other_parker_size(void *arg) {
        return other_user_lease(arg, SIZE, true);
}

typedef struct Parker {
        const char *socket;
        int report_w, hold_r;           /* the child's ends of held_child_start()'s pipes */
} Parker;

/* In a child: Allocs SIZE, sends its Park, reports the lease's id and waits to be killed (or released). */
static int child_parker(void *arg) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        Parker *a = arg;
        char id[VMMB_ID_MAX + 1] = "";
        TestLease l;
        int k;

        /* Not the test's ends of the pipes: the hold pipe's end must be the test's alone for its EOF. */
        CHILD_CHECK(close_all_but((const int[]){ a->report_w, a->hold_r }, 2) == 0, "close fds");
        k = conn_open(a->socket, &c);
        CHILD_CHECK(k == 0, "connect: %s", strerror(-k));
        k = lease_alloc(c, SIZE, &l);
        CHILD_CHECK(k == 0, "Alloc: %s", strerror(-k));
        test_lease_close(&l);
        k = park_send(c, l.id);
        CHILD_CHECK(k == 0, "Park: %s", strerror(-k));
        snprintf(id, sizeof(id), "%s", l.id);
        CHILD_CHECK(write(a->report_w, id, sizeof(id)) == (ssize_t)sizeof(id), "report: %m");
        (void)pipe_wait_eof(a->hold_r);
        return 0;
}

/* ---- the tests ------------------------------------------------------------------------------------------ */

/*
 * The first Park of a daemon makes host slabs, and nobody waits for that but the Park: while the make is held,
 * a Status on another connection is answered, and so are another user's Alloc and Free (as root); the Park is
 * not. Once the make goes on, the Park is answered `parked: true`, the lease is parked (Status's `parked`),
 * and Unpark brings its content back.
 */
START_TEST(test_park_does_not_hold_others) {
        _cleanup_(varlink_conn_freep) VarlinkConn *a = NULL;
        TestLease l;
        WireDevice d;
        Gpu g = {};

        if (!start_holding(__func__, CONFIG, false))
                return;
        ck_assert_int_eq(conn_open(h.socket, &a), 0);
        ck_assert_int_eq(gpu_open(&g), 0);
        l = alloc_written(&g, a, SIZE, 0xca11ab1e);
        ck_assert_int_eq(status().host_cached, 0);

        make_hold();
        ck_assert_int_eq(park_send(a, l.id), 0);
        wait_for_make();
        d = status_while_held();
        ck_assert_int_eq(d.parked, 0);
        if (geteuid() == 0)
                child_done_within(harness_fork(child_other_user, h.socket), "another user's Alloc and Free");
        ck_assert_msg(!readable_now(a), "the Park was answered while its host slabs were being made");

        release_hold();
        parked_or_fail(a);
        d = status();
        ck_assert_int_eq(d.parked, (int64_t)SIZE);
        ck_assert_uint_eq(d.leased, 0);
        unpark_check_free(&g, a, l.id, SIZE, 0xca11ab1e);
        gpu_close(&g);
        wait_for_idle((int64_t)SIZE);           /* the host slabs, scrubbed, wait for the next park */
        stop();
}
END_TEST

/*
 * Another park of SIZE, on `c`, takes the host slabs left cached: it is answered parked, and nothing is made,
 * though creates are held again. Then its lease is freed and the daemon left idle.
 */
static void next_park_makes_nothing(VarlinkConn *c) {
        WireDevice d;
        TestLease l;

        ck_assert_int_eq(lease_alloc(c, SIZE, &l), 0);
        test_lease_close(&l);
        make_hold();
        ck_assert_int_eq(park_send(c, l.id), 0);
        ck_assert_msg(answered_within(c), "a Park that cached host slabs can serve was not answered within %d s "
                      "(it waited for a make: %s is %s)", ANSWER_MS / 1000, reached,
                      access(reached, F_OK) == 0 ? "there" : "not there");
        parked_or_fail(c);
        ck_assert_msg(access(reached, F_OK) != 0, "the next Park made host slabs though %" PRIu64 " bytes of them "
                      "were cached", SIZE);
        d = status();
        ck_assert_int_eq(d.parked, (int64_t)SIZE);
        ck_assert_int_eq(d.host_cached, 0);
        ck_assert_int_eq(lease_free(c, l.id), 0);
        wait_for_idle((int64_t)SIZE);
}

/*
 * A process killed while its Park waits for host slabs leaves nothing behind: its lease ends at once, as with
 * its last holder, and the slabs made for it, once made, stay cached in the pool, for anyone: the made slabs are
 * bound to their user only until the making is done (pool_unbind_made()). The next park of that size, another
 * user's (as root) and another process's, takes them without making any (while creates are held, it is
 * answered at once).
 */
START_TEST(test_park_waiter_exits) {
        _cleanup_(varlink_conn_freep) VarlinkConn *a = NULL;
        char id[VMMB_ID_MAX + 1] = "";
        Parker arg = {};
        HeldChild x;
        WireDevice d = {};

        if (!start_holding(__func__, CONFIG, false))
                return;
        arg.socket = h.socket;
        make_hold();
        ck_assert_int_eq(held_child_start(child_parker, &arg, &arg.report_w, &arg.hold_r, id, sizeof(id), &x), 0);
        wait_for_make();
        (void)status_while_held();

        ck_assert_int_eq(kill(x.pid, SIGKILL), 0);
        ck_assert_int_eq(held_child_finish(&x), 128 + SIGKILL);
        /* Its lease ends with its process, the make still held. */
        for (uint64_t end = harness_poll_deadline(); harness_now_msec() < end;) {
                d = status_while_held();
                if (d.leases == 0)
                        break;
        }
        ck_assert_msg(d.leases == 0, "lease %s outlived its only holder while its Park waited", id);

        release_hold();
        wait_for_idle((int64_t)SIZE);

        if (geteuid() == 0) {
                /* another user's park of that size takes them, not bound to the user they were made for */
                make_hold();
                child_done_within(harness_fork(child_other_parker_size, h.socket),
                                  "another user's Park of the host slabs made for a killed process's");
                ck_assert_msg(access(reached, F_OK) != 0, "another user's Park made host slabs though %" PRIu64
                              " bytes of them, made for a park that went away, were cached", SIZE);
                wait_for_idle((int64_t)SIZE);
        }
        /* Another park of that size takes them: answered though creates are held again. */
        ck_assert_int_eq(conn_open(h.socket, &a), 0);
        next_park_makes_nothing(a);
        stop();
}
END_TEST

/* Sends a Park of `id` on `c` and reads its answer, which must come at once (creates are held) and be the error
 * `error`; checks that nothing was made for it. Returns the answer (reply_done() it). */
static Reply refused_at_once(VarlinkConn *c, const char *id, const char *error) {
        Reply r;

        make_hold();
        ck_assert_int_eq(park_send(c, id), 0);
        ck_assert_msg(answered_within(c), "a Park that should be refused with %s was not answered within %d s "
                      "(it waited for a make: %s is %s)", error, ANSWER_MS / 1000, reached,
                      access(reached, F_OK) == 0 ? "there" : "not there");
        ck_assert_int_eq(reply_read(c, &r, NULL), 0);
        ck_assert_msg(r.error && strcmp(r.error, error) == 0, "Park answered %s %s, not %s", r.error ?: "(no error)",
                      json_object_to_json_string(r.params), error);
        ck_assert_msg(access(reached, F_OK) != 0, "a Park refused with %s made host slabs first", error);
        release_hold();
        return r;
}

/*
 * A Park over the user's MaxHostBytes= is refused at once with QuotaExceeded ("host_bytes"), and one that cannot
 * fit in the device's HostCapacity= with OutOfHostMemory: neither makes anything (no create starts while they are
 * held), and the lease stays where it was.
 */
START_TEST(test_park_over_limits_at_once) {
        static const struct {
                const char *config;
                const char *error;
        } cases[] = {
                { CONFIG "[Limits]\nMaxHostBytes=32M\n", VMMB_ERROR_QUOTA_EXCEEDED },
                { "[Broker]\nHostCapacity=32M\n[Limits]\nMaxHostBytes=1G\n", VMMB_ERROR_OUT_OF_HOST_MEMORY },
        };

        for (size_t i = 0; i < ELEMENTSOF(cases); i++) {
                _cleanup_(varlink_conn_freep) VarlinkConn *a = NULL;
                TestLease l;
                WireDevice d;
                Reply r;

                if (!start_holding(__func__, cases[i].config, false))
                        return;
                ck_assert_int_eq(conn_open(h.socket, &a), 0);
                ck_assert_int_eq(lease_alloc(a, SIZE, &l), 0);
                test_lease_close(&l);
                r = refused_at_once(a, l.id, cases[i].error);
                if (strcmp(cases[i].error, VMMB_ERROR_QUOTA_EXCEEDED) == 0)
                        ck_assert_str_eq(reply_str(&r, "resource") ?: "", "host_bytes");
                reply_done(&r);
                d = status();
                ck_assert_uint_eq(d.leased, SIZE);
                ck_assert_int_eq(d.parked, 0);
                ck_assert_int_eq(d.host_cached, 0);
                ck_assert_int_eq(lease_free(a, l.id), 0);
                a = varlink_conn_free(a);
                stop();
        }
}
END_TEST

/*
 * SIGTERM while a Park's host slabs are being made: the daemon does not exit under the make; once the make
 * finishes it exits with status 0, and the waiting Park gets an error or the connection's end, not a crash.
 * The make goes on only once the daemon has acted on the signal, which it says to an Alloc waiting for room
 * (OutOfMemory, "stopping"): a make finished before would be a Park done before the stop.
 */
START_TEST(test_stop_while_making) {
        _cleanup_(varlink_conn_freep) VarlinkConn *a = NULL, *w = NULL;
        const char *message;
        int64_t waiters;
        TestLease l;
        Reply r;
        int k;

        /* MaxBytes= above the device: w's Alloc of all of it waits for room, not refused over the limit. */
        if (!start_holding(__func__, CONFIG "[Limits]\nMaxBytes=2G\n", false))
                return;
        ck_assert_int_eq(conn_open(h.socket, &a), 0);
        ck_assert_int_eq(conn_open(h.socket, &w), 0);
        ck_assert_int_eq(lease_alloc(a, SIZE, &l), 0);
        test_lease_close(&l);
        make_hold();
        ck_assert_int_eq(park_send(a, l.id), 0);
        wait_for_make();
        waiters = status_while_held().waiters;
        ck_assert_int_eq(alloc_wait_send(w, 1024 * MiB, 60 * 1000000), 0);
        wait_for_waiters_while_held(waiters + 1);

        ck_assert_int_eq(kill(h.pid, SIGTERM), 0);
        ck_assert_int_eq(reply_read(w, &r, NULL), 0);
        ck_assert_str_eq(r.error ?: "(none)", VMMB_ERROR_OUT_OF_MEMORY);
        message = reply_str(&r, "message");
        ck_assert_msg(message && strstr(message, "stopping"), "not said: %s", message);
        reply_done(&r);
        ck_assert_msg(!exited_now(h.pid), "the daemon exited while host slabs were being made");
        stop();                                 /* releases the hold; fails unless the daemon exits with 0 */
        k = reply_read(a, &r, NULL);            /* what the daemon sent before it exited, then the end */
        ck_assert_msg(k < 0 || r.error, "the Park was answered %s though the daemon stopped",
                      k < 0 ? "" : json_object_to_json_string(r.params));
        if (k == 0)
                reply_done(&r);
}
END_TEST

/*
 * Two Parks, on two connections, each needing host slabs made, both wait while creates are held (and another
 * connection's Status is answered); once they go on, both are answered `parked: true` and both leases come back
 * with their own content.
 */
START_TEST(test_two_parks_while_making) {
        _cleanup_(varlink_conn_freep) VarlinkConn *a = NULL, *b = NULL;
        TestLease la, lb;
        WireDevice d;
        Gpu g = {};

        if (!start_holding(__func__, CONFIG, false))
                return;
        ck_assert_int_eq(conn_open(h.socket, &a), 0);
        ck_assert_int_eq(conn_open(h.socket, &b), 0);
        ck_assert_int_eq(gpu_open(&g), 0);
        la = alloc_written(&g, a, SIZE, 0xaaaa0001);
        lb = alloc_written(&g, b, SIZE2, 0xbbbb0002);

        make_hold();
        ck_assert_int_eq(park_send(a, la.id), 0);
        wait_for_make();
        ck_assert_int_eq(park_send(b, lb.id), 0);
        wait_for_calls_waiting("host_memory", 2, "zeroing");
        ck_assert_msg(!readable_now(a) && !readable_now(b), "a Park was answered while host slabs were being made");

        release_hold();
        parked_or_fail(a);
        parked_or_fail(b);
        d = status();
        ck_assert_int_eq(d.parked, (int64_t)(SIZE + SIZE2));
        ck_assert_uint_eq(d.leased, 0);
        unpark_check_free(&g, a, la.id, SIZE, 0xaaaa0001);
        unpark_check_free(&g, b, lb.id, SIZE2, 0xbbbb0002);
        gpu_close(&g);
        wait_for_idle((int64_t)(SIZE + SIZE2));
        stop();
}
END_TEST

/*
 * One user's Park of one host slab is not made after all of another user's many, however many Parks that user
 * has waiting: the daemon's maker thread takes one slab at a time, users in turn, and a Park is made again as
 * soon as its own are made. A's Parks of SIZE need 32 host slabs of HostSlab=2M each; while the first one's first
 * is held, A sends two more (as root; else none), and another user (nobody, as root; else another connection of
 * A's user) parks one slab. Two creates are let through, A's first and the next, and the one after is held: B's
 * Park must be answered parked while A's all wait. (With one queue in order, the second create is A's, and B's
 * Park waits for all of A's; with A's Parks taking turns with B's as equals, it is A's second Park's.)
 */
START_TEST(test_park_not_behind_anothers) {
        _cleanup_(varlink_conn_freep) VarlinkConn *b = NULL;
        VarlinkConn *a[3] = {};         /* freed at the end (a failed check ends the test's process) */
        size_t n_a = geteuid() == 0 ? ELEMENTSOF(a) : 1;
        TestLease la[ELEMENTSOF(a)], lb = {};
        pid_t child = -1;
        Gpu g = {};

        if (!start_holding(__func__, CONFIG "MaxSlab=32M\nHostSlab=2M\n", false))
                return;
        ck_assert_int_eq(gpu_open(&g), 0);
        for (size_t i = 0; i < n_a; i++) {
                ck_assert_int_eq(conn_open(h.socket, &a[i]), 0);
                la[i] = alloc_written(&g, a[i], SIZE, 0xaaaa0003 + (uint32_t)i);
        }

        make_hold();
        ck_assert_int_eq(park_send(a[0], la[0].id), 0);
        wait_for_make();
        for (size_t i = 1; i < n_a; i++)
                ck_assert_int_eq(park_send(a[i], la[i].id), 0);
        if (geteuid() == 0) {
                wait_for_calls_waiting("host_memory", n_a, NULL);
                child = harness_fork(child_other_parker, h.socket);
                wait_for_calls_waiting("host_memory", n_a + 1, NULL);
        } else {
                ck_assert_int_eq(conn_open(h.socket, &b), 0);
                lb = alloc_written(&g, b, UNIT, 0xbbbb0003);
                ck_assert_int_eq(park_send(b, lb.id), 0);
                wait_for_calls_waiting("host_memory", n_a + 1, NULL);
        }

        let_creates_through(2);
        reached_or_fail(reached, "no third host slab was made");
        if (child > 0)
                child_done_within(child, "another user's Park of one slab while Parks of 32 were being made");
        else
                parked_or_fail(b);
        for (size_t i = 0; i < n_a; i++)
                ck_assert_msg(!readable_now(a[i]), "a Park of 32 host slabs was answered with its slabs held");
        if (geteuid() == 0)
                ck_assert_uint_eq(calls_waiting("host_memory"), n_a);

        release_hold();
        for (size_t i = 0; i < n_a; i++) {
                parked_or_fail(a[i]);
                unpark_check_free(&g, a[i], la[i].id, SIZE, 0xaaaa0003 + (uint32_t)i);
                a[i] = varlink_conn_free(a[i]);
        }
        if (b)
                unpark_check_free(&g, b, lb.id, UNIT, 0xbbbb0003);
        gpu_close(&g);
        wait_for_idle((int64_t)(n_a * SIZE + UNIT));
        stop();
}
END_TEST

/*
 * A Park whose host slabs its own user's other Park took while they were being made is made again off the loop:
 * nothing is pinned in the loop for it, which would hold every other client up (0.3 s per GiB on an H200). A's
 * first Park needs 32 host slabs of HostSlab=2M; 31 are made, the 32nd held; A's second Park, of 16 slabs, takes
 * 16 of those 31 in the loop. Once the 32nd is let through, the first Park is made again, lacks 16, and waits
 * for them to be made while a Status on another connection is answered (with the creates held again).
 */
START_TEST(test_park_taken_meanwhile_made_again) {
        _cleanup_(varlink_conn_freep) VarlinkConn *a1 = NULL, *a2 = NULL;
        TestLease l1, l2;
        WireDevice d = {};
        Gpu g = {};

        if (!start_holding(__func__, CONFIG "MaxSlab=32M\nHostSlab=2M\n", false))
                return;
        ck_assert_int_eq(gpu_open(&g), 0);
        ck_assert_int_eq(conn_open(h.socket, &a1), 0);
        ck_assert_int_eq(conn_open(h.socket, &a2), 0);
        l1 = alloc_written(&g, a1, SIZE, 0xaaaa0010);
        l2 = alloc_written(&g, a2, SIZE2, 0xaaaa0020);

        make_hold();
        ck_assert_int_eq(park_send(a1, l1.id), 0);
        wait_for_make();
        let_creates_through(31);
        reached_or_fail(reached, "the first Park's 32nd host slab was not reached");
        for (uint64_t end = harness_poll_deadline(); harness_now_msec() < end;) {
                d = status_while_held();
                if (d.host_cached == (int64_t)(31 * UNIT))
                        break;
        }
        ck_assert_msg(d.host_cached == (int64_t)(31 * UNIT), "%" PRId64 " bytes of host slabs cached, not the 31 "
                      "made", d.host_cached);
        ck_assert_int_eq(park_send(a2, l2.id), 0);
        parked_or_fail(a2);                             /* 16 of the first Park's slabs, taken in the loop */

        let_creates_through(1);                         /* the first Park's last: it is made again, lacks 16 */
        reached_or_fail(reached, "the first Park, made again, made no host slab for what the second took");
        (void)status_while_held();                      /* not pinning in the loop */
        ck_assert_msg(!readable_now(a1), "the first Park was answered with its host slabs held");
        ck_assert_uint_eq(calls_waiting("host_memory"), 1);

        release_hold();
        parked_or_fail(a1);
        unpark_check_free(&g, a1, l1.id, SIZE, 0xaaaa0010);
        unpark_check_free(&g, a2, l2.id, SIZE2, 0xaaaa0020);
        gpu_close(&g);
        wait_for_idle((int64_t)(SIZE + SIZE2));
        stop();
}
END_TEST

/* ---- the copy into host memory, held ------------------------------------------------------------------- */

/*
 * A Park whose host slabs are cached only waits for its copy, and nobody waits for that but the Park: while the
 * copy is held, a Status on another connection is answered, and so are another user's Alloc and Free (as root);
 * the Park is not, and the lease is not parked yet. Once the copy goes on, the Park is answered `parked: true`
 * without anything made, and Unpark brings the content back.
 */
START_TEST(test_park_copy_does_not_hold_others) {
        _cleanup_(varlink_conn_freep) VarlinkConn *a = NULL;
        TestLease l;
        WireDevice d;
        Gpu g = {};

        if (!start_holding(__func__, CONFIG, true))
                return;
        ck_assert_int_eq(conn_open(h.socket, &a), 0);
        ck_assert_int_eq(gpu_open(&g), 0);
        cache_host_slabs(a, SIZE);
        l = alloc_written(&g, a, SIZE, 0xc0b1ed01);

        make_hold();
        hold_copies();
        ck_assert_int_eq(park_send(a, l.id), 0);
        wait_for_copy(l.id);
        if (geteuid() == 0)
                child_done_within(harness_fork(child_other_user, h.socket), "another user's Alloc and Free");
        d = status_while_held();
        ck_assert_uint_eq(d.leased, SIZE);
        ck_assert_msg(!readable_now(a), "the Park was answered while its copy was held");

        release_hold();
        parked_or_fail(a);
        ck_assert_msg(access(reached, F_OK) != 0, "the Park made host slabs though %" PRIu64 " bytes of them were "
                      "cached", SIZE);
        ck_assert(listed_parked(l.id));
        d = status();
        ck_assert_int_eq(d.parked, (int64_t)SIZE);
        ck_assert_uint_eq(d.leased, 0);
        unpark_check_free(&g, a, l.id, SIZE, 0xc0b1ed01);
        gpu_close(&g);
        wait_for_idle((int64_t)SIZE);
        stop();
}
END_TEST

/*
 * Copies go on the device a piece at a time (64 MiB), three on its stream at once, the next piece the next user's
 * in turn: a Park of one slab sent while the copy of another's Park of 512 MiB (8 pieces, host slabs cached) is
 * held waits for the pieces queued when it came, not for the whole copy. With `other_user`, the Park of one slab is
 * another user's (a child process as UID_OTHER), which goes before the user served last: its copy is the 4th on
 * the stream, and it is answered once 4 copies are let through. Otherwise it is another connection's of the same
 * user, whose copies take turns among themselves: its copy is the 5th. The large Park still waits; both contents
 * come back whole. Queued whole, the large copy goes first and the small Park is not answered.
 */
static void park_copy_in_turn(const char *test, bool other_user) {
        const uint64_t big = 512 * MiB;
        _cleanup_(varlink_conn_freep) VarlinkConn *a = NULL, *b = NULL;
        TestLease la, lb = {};
        pid_t child = -1;
        Gpu g = {};

        if (!start_holding(test, "[Broker]\nHostCapacity=640M\n[Limits]\nMaxHostBytes=100%\n", true))
                return;
        ck_assert_int_eq(conn_open(h.socket, &a), 0);
        ck_assert_int_eq(gpu_open(&g), 0);
        cache_host_slabs(a, big);
        la = alloc_written(&g, a, big, 0xc0b1ed07);
        if (!other_user) {
                ck_assert_int_eq(conn_open(h.socket, &b), 0);
                lb = alloc_written(&g, b, UNIT, 0xc0b1ed08);
        }

        hold_copies();
        ck_assert_int_eq(park_send(a, la.id), 0);
        copy_reached_or_fail("the Park of 512 MiB");
        if (b)
                ck_assert_int_eq(park_send(b, lb.id), 0);
        else
                child = harness_fork(child_other_parker, h.socket);
        wait_for_calls_waiting("copy", 2, NULL);        /* the small Park's host slab made, its copy queued */

        let_copies_through(b ? 5 : 4);
        reached_or_fail(copied, "the copy after the small Park's was not reached");
        if (b)
                parked_or_fail(b);
        else
                child_done_within(child, "another user's Park of one slab behind a Park of 512 MiB");
        ck_assert_msg(!readable_now(a), "the Park of 512 MiB was answered with three of its eight pieces held");

        release_hold();
        parked_or_fail(a);
        unpark_check_free(&g, a, la.id, big, 0xc0b1ed07);
        if (b)
                unpark_check_free(&g, b, lb.id, UNIT, 0xc0b1ed08);
        gpu_close(&g);
        wait_for_idle((int64_t)(big + UNIT));
        stop();
}

/* park_copy_in_turn() with the small Park another connection's of the same user: run by anyone, root included. */
START_TEST(test_park_copy_in_turn_same_user) {
        park_copy_in_turn(__func__, false);
}
END_TEST

/* park_copy_in_turn() with the small Park another user's. */
START_TEST(test_park_copy_in_turn_other_user) {
        if (geteuid() != 0) {
                fprintf(stderr, "%s: not run: it needs another user (uid %u), which only root can be\n", __func__,
                        UID_OTHER);
                return;
        }
        park_copy_in_turn(__func__, true);
}
END_TEST

/*
 * The parking process (of a lease of `size`, whose host slabs a park and unpark on `a` leave cached first) killed
 * while its copy is held: its hold ends, and with it the park and the lease, the copy still held; everybody else
 * is answered meanwhile, and so is the Park left on the connection (the test keeps it, not the dead process):
 * hung up, or anything but `parked: true`. Once the copy goes on, nothing is parked or leased and the host slabs
 * the park had taken are cached again. Returns the bytes the daemon copied for that park.
 */
static uint64_t parker_killed_while_copying(VarlinkConn *a, uint64_t size) {
        _cleanup_(varlink_conn_freep) VarlinkConn *p = NULL;
        uint64_t moved;
        Connector x;
        TestLease l;
        WireDevice d = {};

        cache_host_slabs(a, size);
        /* The parking process: a connector of this user, the holder of what is leased on its connection. */
        x = connector_start(h.socket, getuid(), 1, &p);
        ck_assert_int_eq(lease_alloc(p, size, &l), 0);
        test_lease_close(&l);

        make_hold();
        hold_copies();
        moved = copied_bytes();
        ck_assert_int_eq(park_send(p, l.id), 0);
        wait_for_copy(l.id);
        ck_assert_int_eq(kill(x.pid, SIGKILL), 0);
        ck_assert_int_eq(connector_close(&x), 128 + SIGKILL);
        /* Its lease ends with its process, the copy still held (its device slabs wait for the copy to end). */
        for (uint64_t end = harness_poll_deadline(); harness_now_msec() < end;) {
                d = status_while_held();
                if (d.leases == 0)
                        break;
        }
        ck_assert_msg(d.leases == 0, "lease %s outlived its only holder while its copy was held", l.id);
        if (geteuid() == 0)
                child_done_within(harness_fork(child_other_user, h.socket), "another user's Alloc and Free");
        ck_assert_msg(answered_within(p), "the Park of a process that was killed was neither answered nor hung up "
                      "within %d s of its lease's end", ANSWER_MS / 1000);
        killed_park_answer_or_fail(p);

        release_hold();
        wait_for_idle((int64_t)size);           /* the park's host slabs, scrubbed after the copy */
        return copied_bytes() - moved;
}

/* parker_killed_while_copying() with a lease of one piece; then the next park of that size, another process's, takes
 * the host slabs without making any. */
START_TEST(test_park_copy_parker_killed) {
        _cleanup_(varlink_conn_freep) VarlinkConn *a = NULL;

        if (!start_holding(__func__, CONFIG, true))
                return;
        ck_assert_int_eq(conn_open(h.socket, &a), 0);
        ck_assert_uint_eq(parker_killed_while_copying(a, SIZE), SIZE);   /* one piece, queued when it began */
        next_park_makes_nothing(a);
        stop();
}
END_TEST

/*
 * The same with a lease of 512 MiB, whose copy goes in 8 pieces of 64 MiB: once its lease has ended, nobody will
 * read the copy, so the pieces not yet queued when it ended (the first three are) are dropped; the daemon's
 * metrics say one copy dropped and 192 MiB copied.
 */
START_TEST(test_park_copy_dropped) {
        _cleanup_(varlink_conn_freep) VarlinkConn *a = NULL;
        uint64_t moved;

        if (!start_holding(__func__, "[Broker]\nHostCapacity=640M\n[Limits]\nMaxHostBytes=100%\n", true))
                return;
        ck_assert_int_eq(conn_open(h.socket, &a), 0);
        moved = parker_killed_while_copying(a, 8 * SIZE);
        ck_assert_msg(moved == 3 * SIZE, "%" PRIu64 " bytes copied for a park of %" PRIu64 " whose lease ended "
                      "with three pieces of it queued", moved, 8 * SIZE);
        ck_assert_uint_eq(metric("vmmbroker_device_copies_dropped_total{device=\"0\"} "), 1);
        stop();
}
END_TEST

/*
 * A foreign lease (another user attached it once) ends while its park's copy is held. Its device slabs are
 * released, not scrubbed, and the copy still reads them: unmapped under it, the copy would fault the device's
 * copy stream for good; waited for in the loop, everybody would wait for the copy. Owner A (a connector of this
 * user) allocs and shares with user B, whose connector attaches and frees; A parks, its copy held, and is
 * killed. The lease ends and everybody else is answered, the copy still held; once it goes on, nothing is left
 * but the park's host slabs, cached again, and a lease with content parks and unparks whole: the copy stream
 * works (a faulted one fails the copy: DriverError).
 */
START_TEST(test_park_copy_foreign_lease_ends) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL, *pa = NULL, *pb = NULL;
        char token[VMMB_TOKEN_MAX + 1];
        Connector xa, xb;
        TestLease l, lb;
        WireDevice d = {};
        Gpu g = {};

        if (geteuid() != 0) {
                fprintf(stderr, "%s: not run: it needs another user (uid %u), which only root can be\n", __func__,
                        UID_OTHER);
                return;
        }
        if (!start_holding(__func__, CONFIG, true))
                return;
        ck_assert_int_eq(conn_open(h.socket, &c), 0);
        cache_host_slabs(c, SIZE);
        xa = connector_start(h.socket, getuid(), 1, &pa);
        xb = connector_start(h.socket, UID_OTHER, 1, &pb);
        ck_assert_int_eq(lease_alloc(pa, SIZE, &l), 0);
        test_lease_close(&l);
        share_or_fail(pa, l.id, UID_OTHER, token);
        ck_assert_int_eq(attach_send(pb, token), 0);
        lb = lease_reply_or_fail(pb);
        ck_assert_str_eq(lb.id, l.id);
        ck_assert_int_eq(lease_free(pb, l.id), 0);
        connector_finish(&xb);

        hold_copies();
        ck_assert_int_eq(park_send(pa, l.id), 0);
        wait_for_copy(l.id);
        ck_assert_int_eq(kill(xa.pid, SIGKILL), 0);
        ck_assert_int_eq(connector_close(&xa), 128 + SIGKILL);
        for (uint64_t end = harness_poll_deadline(); harness_now_msec() < end;) {
                d = status_while_held();
                if (d.leases == 0)
                        break;
        }
        ck_assert_msg(d.leases == 0, "foreign lease %s outlived its only holder while its copy was held", l.id);
        child_done_within(harness_fork(child_other_user, h.socket), "another user's Alloc and Free");
        ck_assert_msg(answered_within(pa), "the Park of a process that was killed was neither answered nor hung up "
                      "within %d s of its lease's end", ANSWER_MS / 1000);
        killed_park_answer_or_fail(pa);

        release_hold();
        wait_for_idle((int64_t)SIZE);           /* the park's host slabs, scrubbed after the copy */
        ck_assert_int_eq(gpu_open(&g), 0);
        l = alloc_written(&g, c, SIZE, 0xf0e1d2c3);
        ck_assert_int_eq(park_send(c, l.id), 0);
        parked_or_fail(c);
        unpark_check_free(&g, c, l.id, SIZE, 0xf0e1d2c3);
        gpu_close(&g);
        wait_for_idle((int64_t)SIZE);
        stop();
}
END_TEST

/*
 * An Attach of the lease by another process of its user while its park's copy is held undoes the park: the
 * Attach is answered with the lease as it is, and the Park `parked: false` at once, the copy still held (it waits
 * for nothing more). The attacher maps the lease and finds its content; the lease is not parked. Once the copy
 * goes on, the host slabs the park had taken are scrubbed and cached again.
 */
START_TEST(test_park_copy_attach_cancels) {
        _cleanup_(varlink_conn_freep) VarlinkConn *a = NULL, *b = NULL;
        char token[VMMB_TOKEN_MAX + 1];
        CUdeviceptr va;
        Connector x;
        TestLease l, lb;
        WireDevice d;
        Gpu g = {};
        Reply r;

        if (!start_holding(__func__, CONFIG, true))
                return;
        ck_assert_int_eq(conn_open(h.socket, &a), 0);
        ck_assert_int_eq(gpu_open(&g), 0);
        cache_host_slabs(a, SIZE);
        l = alloc_written(&g, a, SIZE, 0xa77ac4ed);
        share_or_fail(a, l.id, getuid(), token);
        x = connector_start(h.socket, getuid(), 1, &b);

        hold_copies();
        ck_assert_int_eq(park_send(a, l.id), 0);
        wait_for_copy(l.id);
        ck_assert_int_eq(attach_send(b, token), 0);
        ck_assert_msg(answered_within(b), "an Attach was not answered within %d s while %s", ANSWER_MS / 1000,
                      holding);
        ck_assert_int_eq(reply_read(b, &r, NULL), 0);
        ck_assert_msg(!r.error, "Attach refused: %s %s", r.error, json_object_to_json_string(r.params));
        ck_assert_int_eq(lease_take(&r, &lb), 0);
        reply_done(&r);
        ck_assert_str_eq(lb.id, l.id);
        ck_assert(!lb.readonly);
        ck_assert_msg(answered_within(a), "the Park was not answered within %d s of an Attach that undid it, its "
                      "copy held", ANSWER_MS / 1000);
        park_answer_or_fail(a, false);
        d = status_while_held();
        ck_assert_uint_eq(d.leased, SIZE);
        ck_assert_uint_eq(d.leases, 1);
        ck_assert_msg(!listed_parked(l.id), "lease %s is parked though an Attach undid its park", l.id);
        ck_assert_int_eq(gpu_map(&g, &lb, &va), 0);
        ck_assert_msg(gpu_verify(&g, va, SIZE, 0xa77ac4ed) == 0, "the attacher did not find the lease's content");
        ck_assert_int_eq(cuda_unmap(g.cu, va, lb.sizes, lb.n), 0);
        test_lease_close(&lb);

        release_hold();
        ck_assert_int_eq(lease_free(b, l.id), 0);
        ck_assert_int_eq(lease_free(a, l.id), 0);
        connector_finish(&x);
        gpu_close(&g);
        wait_for_idle((int64_t)SIZE);           /* the park's host slabs, scrubbed after the copy */
        stop();
}
END_TEST

/*
 * After SIGTERM: the `what` waiting on `c` for a held copy is answered at once (not hung up on) with `error`,
 * whose message says the broker is stopping, names lease `id` and says `state` ("not parked", "still parked").
 */
static void stopping_answer_or_fail(VarlinkConn *c, const char *what, const char *error, const char *id,
                                    const char *state) {
        const char *message;
        Reply r;
        int k;

        ck_assert_msg(answered_within(c), "the %s was not answered within %d s of SIGTERM, the copy it waited for "
                      "held", what, ANSWER_MS / 1000);
        k = reply_read(c, &r, NULL);
        ck_assert_msg(k == 0, "the %s waiting for a copy was not answered at the stop: %s (hung up on)", what,
                      strerror(-k));
        ck_assert_str_eq(r.error ?: "(none)", error);
        message = reply_str(&r, "message");
        ck_assert_msg(message && strstr(message, "stopping") && strstr(message, id) && strstr(message, state),
                      "the %s's answer does not say the broker stops, lease %s, \"%s\": %s", what, id, state,
                      message);
        reply_done(&r);
}

/*
 * SIGTERM while a Park's copy is held: the waiting Park is told at once, the copy still held, that the broker is
 * stopping and its lease is not parked (OutOfHostMemory); once the copy goes on, the daemon exits with status 0.
 */
START_TEST(test_stop_while_copying) {
        _cleanup_(varlink_conn_freep) VarlinkConn *a = NULL;
        TestLease l;

        if (!start_holding(__func__, CONFIG, true))
                return;
        ck_assert_int_eq(conn_open(h.socket, &a), 0);
        cache_host_slabs(a, SIZE);
        ck_assert_int_eq(lease_alloc(a, SIZE, &l), 0);
        test_lease_close(&l);
        hold_copies();
        ck_assert_int_eq(park_send(a, l.id), 0);
        wait_for_copy(l.id);

        ck_assert_int_eq(kill(h.pid, SIGTERM), 0);
        stopping_answer_or_fail(a, "Park", VMMB_ERROR_OUT_OF_HOST_MEMORY, l.id, "not parked");
        stop();                                 /* releases the hold; fails unless the daemon exits with 0 */
}
END_TEST

/* ---- the copy back into device memory, held ----------------------------------------------------------- */

/*
 * An Unpark only waits for its copy back into device memory, and nobody waits for that but the Unpark: while the
 * copy is held, a Status on another connection is answered, and so are another user's Alloc and Free (as root);
 * the Unpark is not, and the lease is still parked. Once the copy goes on, the Unpark is answered with the lease,
 * which holds its content and is no longer parked.
 */
START_TEST(test_unpark_copy_does_not_hold_others) {
        _cleanup_(varlink_conn_freep) VarlinkConn *a = NULL;
        TestLease l;
        WireDevice d;
        Gpu g = {};

        if (!start_holding(__func__, CONFIG, true))
                return;
        holding = "an Unpark's copy back into device memory was held";
        ck_assert_int_eq(conn_open(h.socket, &a), 0);
        ck_assert_int_eq(gpu_open(&g), 0);
        l = alloc_written(&g, a, SIZE, 0xba0cba0c);
        ck_assert_int_eq(park_send(a, l.id), 0);
        parked_or_fail(a);
        ck_assert(listed_parked(l.id));

        hold_copies();
        ck_assert_int_eq(unpark_send(a, l.id), 0);
        wait_for_copy_back(l.id);
        if (geteuid() == 0)
                child_done_within(harness_fork(child_other_user, h.socket), "another user's Alloc and Free");
        d = status_while_held();
        ck_assert_uint_eq(d.leased, SIZE);
        unpark_waits_for_hold(&g, a, l.id, 0xba0cba0c, "its copy back");
        listed_unparked_or_fail(l.id, 1);
        d = status();
        ck_assert_int_eq(d.parked, 0);
        ck_assert_uint_eq(d.leased, SIZE);
        ck_assert_int_eq(lease_free(a, l.id), 0);
        gpu_close(&g);
        wait_for_idle((int64_t)SIZE);           /* the lease's host slabs, scrubbed after the copy back */
        stop();
}
END_TEST

/*
 * A Park whose host slabs are still being zeroed (the Unpark before it freed them; a real device zeroes host
 * memory at about 20 ms per GiB) waits for that zeroing off the daemon's loop, as for host slabs being made but
 * counted apart (vmmbroker_calls_waiting's zeroing, not host_memory): another connection's Status is
 * answered meanwhile, and the Park once the zeroing is done, its content back at the Unpark after it.
 */
START_TEST(test_park_waits_for_host_zeroing) {
        _cleanup_(varlink_conn_freep) VarlinkConn *a = NULL;
        WireDevice d = {};
        TestLease l, back;
        Gpu g = {};

        if (!start_holding_memsets(__func__, CONFIG))
                return;
        holding = "the zeroing of the host slabs a Park needs was held";
        ck_assert_int_eq(conn_open(h.socket, &a), 0);
        ck_assert_int_eq(gpu_open(&g), 0);
        l = alloc_written(&g, a, SIZE, 0x2e50a11c);
        ck_assert_int_eq(park_send(a, l.id), 0);
        parked_or_fail(a);                      /* its host slabs made; its device slabs given back */
        for (uint64_t end = harness_poll_deadline(); harness_now_msec() < end;)
                if ((d = status()).scrubbing == 0)
                        break;
        ck_assert_uint_eq(d.scrubbing, 0);      /* the Unpark takes them back without waiting */

        hold_memsets();
        back = unpark_or_fail(a, l.id);         /* its host slabs freed: their scrub is held */
        test_lease_close(&back);
        reached_or_fail(memset_reached, "no scrub reached the device");
        ck_assert_int_eq(park_send(a, l.id), 0);
        wait_for_calls_waiting("zeroing", 1, "host_memory");
        d = status_while_held();
        ck_assert_uint_eq(d.leased, SIZE);
        ck_assert_msg(!readable_now(a), "the Park was answered while the zeroing of its host slabs was held");
        ck_assert_msg(!listed_parked(l.id), "lease %s is parked though its host slabs are not zeroed", l.id);

        release_hold();
        ck_assert_msg(answered_within(a), "the Park was not answered within %d s of the zeroing's release",
                      ANSWER_MS / 1000);
        parked_or_fail(a);
        unpark_check_free(&g, a, l.id, SIZE, 0x2e50a11c);
        gpu_close(&g);
        wait_for_idle((int64_t)SIZE);
        stop();
}
END_TEST

/*
 * HostReserve= makes host memory when the daemon starts, off its loop: once it is up, Status shows the reserve
 * cached, and the first park of a lease of whole slabs of it makes nothing (it is answered while the simulated
 * device holds every host cuMemCreate).
 */
START_TEST(test_host_reserve_made_at_start) {
        _cleanup_(varlink_conn_freep) VarlinkConn *a = NULL;

        if (!start_holding(__func__, CONFIG "MaxSlab=64M\nHostReserve=64M\n", false))
                return;
        ck_assert_int_eq(conn_open(h.socket, &a), 0);
        wait_for_idle((int64_t)SIZE);           /* the reserve, made and cached */
        next_park_makes_nothing(a);
        stop();
}
END_TEST

/*
 * An Unpark whose device memory is still being zeroed, past the broker's bound (ScrubWaitBytes=16M, the lease
 * 64 MiB), waits for it off the loop: the Park gave the lease's device slabs back, their scrub is held, and the
 * Unpark, which takes that slab back, is counted as waiting for zeroing (not for a copy) while another
 * connection's Status is answered and the lease stays parked. Once the zeroing goes on, the Unpark is answered
 * with the lease and its content. (Before, it waited in the loop, behind host memory's zeroing too.)
 */
START_TEST(test_unpark_waits_for_device_zeroing) {
        _cleanup_(varlink_conn_freep) VarlinkConn *a = NULL;
        TestLease l;
        Gpu g = {};

        if (!start_holding_memsets(__func__, CONFIG "ScrubWaitBytes=16M\n"))
                return;
        holding = "the zeroing of the device memory an Unpark needs was held";
        ck_assert_int_eq(conn_open(h.socket, &a), 0);
        ck_assert_int_eq(gpu_open(&g), 0);
        l = alloc_written(&g, a, SIZE, 0x0ba5eba1);
        hold_memsets();
        ck_assert_int_eq(park_send(a, l.id), 0);
        parked_or_fail(a);                      /* its device slabs given back: their scrub is held */
        reached_or_fail(memset_reached, "no scrub reached the device");

        ck_assert_int_eq(unpark_send(a, l.id), 0);
        wait_for_calls_waiting("zeroing", 1, "copy");
        ck_assert_uint_eq(status_while_held().scrubbing, SIZE);
        unpark_waits_for_hold(&g, a, l.id, 0x0ba5eba1, "the zeroing of its device memory");
        ck_assert_int_eq(lease_free(a, l.id), 0);
        gpu_close(&g);
        wait_for_idle((int64_t)SIZE);
        stop();
}
END_TEST

/* A lease of SIZE on `a`, written with `word`, whose Park is sent with its copy held (host slabs cached first). */
static TestLease park_held(Gpu *g, VarlinkConn *a, uint32_t word) {
        TestLease l;

        cache_host_slabs(a, SIZE);
        l = alloc_written(g, a, SIZE, word);
        hold_copies();
        ck_assert_int_eq(park_send(a, l.id), 0);
        wait_for_copy(l.id);
        return l;
}

/* Sends an Unpark of lease `id` on `c`, which must then be one of `n` calls waiting for a copy, and not be
 * answered while its own process's Park's copy is held. */
static void unpark_waits_for_own_park(VarlinkConn *c, const char *id, uint64_t n) {
        ck_assert_int_eq(unpark_send(c, id), 0);
        wait_for_calls_waiting("copy", n, NULL);
        ck_assert_msg(!readable_now(c), "an Unpark was answered while its own process's Park's copy was held");
}

/*
 * A process's calls about a lease it is moving are served in the order they came: while its Park's copy is held,
 * its Unpark of the lease on another connection (the same process: both are the test's) is not answered, nor
 * does it undo the park (the Park is not answered either). Once the copy goes on, the Park is answered `parked:
 * true`, then the Unpark brings the lease back with its content; neither the lease nor its holder is parked.
 */
START_TEST(test_own_unpark_waits_for_own_park) {
        _cleanup_(varlink_conn_freep) VarlinkConn *a = NULL, *b = NULL;
        TestLease l;
        WireDevice d;
        Gpu g = {};

        if (!start_holding(__func__, CONFIG, true))
                return;
        ck_assert_int_eq(conn_open(h.socket, &a), 0);
        ck_assert_int_eq(conn_open(h.socket, &b), 0);
        ck_assert_int_eq(gpu_open(&g), 0);
        l = park_held(&g, a, 0x0de20de2);
        unpark_waits_for_own_park(b, l.id, 2);         /* and the Park */
        d = status_while_held();
        ck_assert_msg(!readable_now(a), "the Park was answered while its copy was held (its own process's Unpark "
                      "undid it?)");
        ck_assert_uint_eq(d.leased, SIZE);
        ck_assert_msg(!listed_parked(l.id), "lease %s is parked though its copy is held", l.id);

        release_hold();
        ck_assert_msg(answered_within(a), "the Park was not answered within %d s of its copy's release",
                      ANSWER_MS / 1000);
        park_answer_or_fail(a, true);
        ck_assert_msg(answered_within(b), "the Unpark was not answered within %d s of the Park's copy's release",
                      ANSWER_MS / 1000);
        l = unpark_answer_or_fail(b, l.id);
        content_or_fail(&g, &l, 0x0de20de2);
        test_lease_close(&l);
        listed_unparked_or_fail(l.id, 1);
        d = status();
        ck_assert_int_eq(d.parked, 0);
        ck_assert_uint_eq(d.leased, SIZE);
        ck_assert_int_eq(lease_free(a, l.id), 0);
        gpu_close(&g);
        wait_for_idle((int64_t)SIZE);
        stop();
}
END_TEST

/*
 * As above, a process's Unpark waits for its own Park's copy, held, and so does a second Unpark of the same
 * process, sent after it. Then that copy alone is let through: the Park is answered, and the first Unpark, made
 * again, finds the lease parked and starts its own copy back, held; the second waits for that one. Another
 * connection's Status must be answered meanwhile: a waiting call made again that waits again is not made again in
 * the same pass (before 09d1234 the daemon's loop made the two Unparks again, in turn, until the copy ended). Once
 * let go, both Unparks are answered with the lease, which holds its content.
 */
START_TEST(test_own_unparks_after_own_park_copy) {
        _cleanup_(varlink_conn_freep) VarlinkConn *a = NULL, *b = NULL, *c = NULL;
        TestLease l, again;
        Gpu g = {};

        if (!start_holding(__func__, CONFIG, true))
                return;
        ck_assert_int_eq(conn_open(h.socket, &a), 0);
        ck_assert_int_eq(conn_open(h.socket, &b), 0);
        ck_assert_int_eq(conn_open(h.socket, &c), 0);
        ck_assert_int_eq(gpu_open(&g), 0);
        l = park_held(&g, a, 0x0de30de3);
        unpark_waits_for_own_park(b, l.id, 2);         /* and the Park */
        unpark_waits_for_own_park(c, l.id, 3);
        ck_assert_msg(!readable_now(b), "an Unpark was answered while its own process's Park's copy was held");

        let_copies_through(1);
        holding = "the Unpark's copy back, started once the Park's copy was let through, was held";
        ck_assert_msg(answered_within(a), "the Park was not answered within %d s of its copy being let through "
                      "(the daemon's loop busy making the waiting Unparks again?)", ANSWER_MS / 1000);
        park_answer_or_fail(a, true);
        wait_for_copy_back(l.id);
        ck_assert_msg(!readable_now(b) && !readable_now(c), "an Unpark was answered while the copy back was held");

        release_hold();
        ck_assert_msg(answered_within(b) && answered_within(c),
                      "the Unparks were not answered within %d s of the copy's release", ANSWER_MS / 1000);
        l = unpark_answer_or_fail(b, l.id);
        again = unpark_answer_or_fail(c, l.id);
        content_or_fail(&g, &l, 0x0de30de3);
        test_lease_close(&l);
        test_lease_close(&again);
        listed_unparked_or_fail(l.id, 1);
        ck_assert_int_eq(lease_free(a, l.id), 0);
        gpu_close(&g);
        wait_for_idle((int64_t)SIZE);
        stop();
}
END_TEST

/*
 * Two processes of the owner hold a lease and both parked it: the lease is parked. The first one's Unpark copies
 * it back, its copy held; the second one's Unpark waits for that same copy rather than making its own: one lease's
 * device slabs are taken, and (as root, who may read the metrics) one lease's bytes copied; neither Unpark is
 * answered meanwhile. Once the copy goes on, both are answered with the lease, which holds its content; neither
 * the lease nor either holder is parked, and nothing more was copied.
 */
START_TEST(test_unpark_copy_shared) {
        _cleanup_(varlink_conn_freep) VarlinkConn *a = NULL, *b = NULL;
        char token[VMMB_TOKEN_MAX + 1];
        uint64_t before = 0;
        Connector x;
        TestLease l, lb;
        WireDevice d;
        Gpu g = {};

        if (!start_holding(__func__, CONFIG, true))
                return;
        holding = "an Unpark's copy back into device memory was held";
        ck_assert_int_eq(conn_open(h.socket, &a), 0);
        ck_assert_int_eq(gpu_open(&g), 0);
        l = alloc_written(&g, a, SIZE, 0x5a5ed0b1);
        share_or_fail(a, l.id, getuid(), token);
        x = connector_start(h.socket, getuid(), 1, &b);
        ck_assert_int_eq(attach_send(b, token), 0);
        lb = lease_reply_or_fail(b);
        ck_assert_str_eq(lb.id, l.id);
        /* The lease parks when the last of its holders parks it. */
        ck_assert_int_eq(park_send(a, l.id), 0);
        park_answer_or_fail(a, false);
        ck_assert_int_eq(park_send(b, l.id), 0);
        parked_or_fail(b);
        ck_assert(listed_parked(l.id));
        if (geteuid() == 0)
                before = copied_bytes();

        hold_copies();
        ck_assert_int_eq(unpark_send(a, l.id), 0);
        wait_for_copy_back(l.id);
        ck_assert_int_eq(unpark_send(b, l.id), 0);
        wait_for_calls_waiting("copy", 2, NULL);
        d = status_while_held();
        ck_assert_msg(d.leased == SIZE, "%" PRIu64 " bytes leased while an Unpark's copy of %" PRIu64 " was held: "
                      "the second Unpark took device slabs of its own", d.leased, SIZE);
        if (geteuid() == 0)
                ck_assert_msg(copied_bytes() - before == SIZE, "%" PRIu64 " bytes copied for two Unparks of a lease "
                              "of %" PRIu64 ", not one copy", copied_bytes() - before, SIZE);
        ck_assert_msg(!readable_now(a), "the first Unpark was answered while its copy was held");
        ck_assert_msg(!readable_now(b), "the second Unpark was answered while the lease's copy back was held");
        ck_assert_msg(listed_parked(l.id), "lease %s is not parked though its copy back is held", l.id);

        release_hold();
        ck_assert_msg(answered_within(a), "the first Unpark was not answered within %d s of its copy's release",
                      ANSWER_MS / 1000);
        l = unpark_answer_or_fail(a, l.id);
        ck_assert_msg(answered_within(b), "the second Unpark was not answered within %d s of the copy's release",
                      ANSWER_MS / 1000);
        lb = unpark_answer_or_fail(b, l.id);
        test_lease_close(&lb);
        content_or_fail(&g, &l, 0x5a5ed0b1);
        test_lease_close(&l);
        listed_unparked_or_fail(l.id, 2);
        d = status();
        ck_assert_int_eq(d.parked, 0);
        ck_assert_uint_eq(d.leased, SIZE);
        if (geteuid() == 0)
                ck_assert_msg(copied_bytes() - before == SIZE, "%" PRIu64 " bytes copied for two Unparks of a lease "
                              "of %" PRIu64 ", not one copy", copied_bytes() - before, SIZE);
        ck_assert_int_eq(lease_free(b, l.id), 0);
        ck_assert_int_eq(lease_free(a, l.id), 0);
        connector_finish(&x);
        gpu_close(&g);
        wait_for_idle((int64_t)SIZE);
        stop();
}
END_TEST

/*
 * An Attach of a parked lease by another process of its owner while the owner's Unpark's copy back is held waits
 * for that copy (unlike one while a park is copied, which undoes the park): it is not answered meanwhile, nor is
 * the Unpark, while a Status is, and only one lease's device slabs are taken. Once the copy goes on, both are
 * answered with the lease; the attacher maps it and finds its content, and neither the lease nor either holder
 * is parked.
 */
START_TEST(test_attach_waits_for_unpark_copy) {
        _cleanup_(varlink_conn_freep) VarlinkConn *a = NULL, *b = NULL;
        char token[VMMB_TOKEN_MAX + 1];
        Connector x;
        TestLease l, lb;
        WireDevice d;
        Gpu g = {};
        Reply r;

        if (!start_holding(__func__, CONFIG, true))
                return;
        holding = "an Unpark's copy back into device memory was held";
        ck_assert_int_eq(conn_open(h.socket, &a), 0);
        ck_assert_int_eq(gpu_open(&g), 0);
        l = alloc_written(&g, a, SIZE, 0xa77ac4ba);
        share_or_fail(a, l.id, getuid(), token);
        x = connector_start(h.socket, getuid(), 1, &b);
        ck_assert_int_eq(park_send(a, l.id), 0);
        parked_or_fail(a);

        hold_copies();
        ck_assert_int_eq(unpark_send(a, l.id), 0);
        wait_for_copy_back(l.id);
        ck_assert_int_eq(attach_send(b, token), 0);
        wait_for_calls_waiting("copy", 2, NULL);        /* and the Unpark */
        d = status_while_held();
        ck_assert_msg(d.leased == SIZE, "%" PRIu64 " bytes leased while an Unpark's copy of %" PRIu64 " was held: "
                      "the Attach took device slabs of its own", d.leased, SIZE);
        ck_assert_msg(!readable_now(b), "another process's Attach was answered while the lease's copy back was held");
        ck_assert_msg(!readable_now(a), "the Unpark was answered while its copy was held");
        ck_assert_msg(listed_parked(l.id), "lease %s is not parked though its copy back is held", l.id);

        release_hold();
        ck_assert_msg(answered_within(a), "the Unpark was not answered within %d s of its copy's release",
                      ANSWER_MS / 1000);
        l = unpark_answer_or_fail(a, l.id);
        test_lease_close(&l);
        ck_assert_msg(answered_within(b), "the Attach was not answered within %d s of the copy's release",
                      ANSWER_MS / 1000);
        ck_assert_int_eq(reply_read(b, &r, NULL), 0);
        ck_assert_msg(!r.error, "Attach refused: %s %s", r.error, json_object_to_json_string(r.params));
        ck_assert_int_eq(lease_take(&r, &lb), 0);
        reply_done(&r);
        ck_assert_str_eq(lb.id, l.id);
        content_or_fail(&g, &lb, 0xa77ac4ba);
        test_lease_close(&lb);
        listed_unparked_or_fail(l.id, 2);
        d = status();
        ck_assert_int_eq(d.parked, 0);
        ck_assert_uint_eq(d.leased, SIZE);
        ck_assert_int_eq(lease_free(b, l.id), 0);
        ck_assert_int_eq(lease_free(a, l.id), 0);
        connector_finish(&x);
        gpu_close(&g);
        wait_for_idle((int64_t)SIZE);
        stop();
}
END_TEST

/*
 * SIGTERM while an Unpark's copy back is held: the waiting Unpark is told at once, the copy still held, that the
 * broker is stopping and its lease is still parked (OutOfMemory); once the copy goes on, the daemon exits with
 * status 0.
 */
START_TEST(test_stop_while_unparking) {
        _cleanup_(varlink_conn_freep) VarlinkConn *a = NULL;
        TestLease l;

        if (!start_holding(__func__, CONFIG, true))
                return;
        holding = "an Unpark's copy back into device memory was held";
        ck_assert_int_eq(conn_open(h.socket, &a), 0);
        ck_assert_int_eq(lease_alloc(a, SIZE, &l), 0);
        test_lease_close(&l);
        ck_assert_int_eq(park_send(a, l.id), 0);
        parked_or_fail(a);
        hold_copies();
        ck_assert_int_eq(unpark_send(a, l.id), 0);
        wait_for_copy_back(l.id);

        ck_assert_int_eq(kill(h.pid, SIGTERM), 0);
        stopping_answer_or_fail(a, "Unpark", VMMB_ERROR_OUT_OF_MEMORY, l.id, "still parked");
        stop();                                 /* releases the hold; fails unless the daemon exits with 0 */
}
END_TEST

/*
 * SIGTERM while an Unpark's copy back is held and another process's Attach of the lease waits for that copy: the
 * Attach is told at once, as the Unpark is, that the broker is stopping and the lease is still parked
 * (OutOfMemory), not hung up on; once the copy goes on, the daemon exits with status 0.
 */
START_TEST(test_stop_while_attaching) {
        _cleanup_(varlink_conn_freep) VarlinkConn *a = NULL, *b = NULL;
        char token[VMMB_TOKEN_MAX + 1];
        Connector x;
        TestLease l;

        if (!start_holding(__func__, CONFIG, true))
                return;
        holding = "an Unpark's copy back into device memory was held";
        ck_assert_int_eq(conn_open(h.socket, &a), 0);
        ck_assert_int_eq(lease_alloc(a, SIZE, &l), 0);
        test_lease_close(&l);
        share_or_fail(a, l.id, getuid(), token);
        x = connector_start(h.socket, getuid(), 1, &b);
        ck_assert_int_eq(park_send(a, l.id), 0);
        parked_or_fail(a);
        hold_copies();
        ck_assert_int_eq(unpark_send(a, l.id), 0);
        wait_for_copy_back(l.id);
        ck_assert_int_eq(attach_send(b, token), 0);
        wait_for_calls_waiting("copy", 2, NULL);        /* and the Unpark */
        ck_assert_msg(!readable_now(b), "another process's Attach was answered while the lease's copy back was held");

        ck_assert_int_eq(kill(h.pid, SIGTERM), 0);
        stopping_answer_or_fail(a, "Unpark", VMMB_ERROR_OUT_OF_MEMORY, l.id, "still parked");
        stopping_answer_or_fail(b, "Attach", VMMB_ERROR_OUT_OF_MEMORY, l.id, "still parked");
        stop();                                 /* releases the hold; fails unless the daemon exits with 0 */
        connector_finish(&x);
}
END_TEST

int main(void) {
        return run_suite(UNIT_SUITE("park", NULL, test_park_does_not_hold_others, test_park_waiter_exits,
                                    test_park_over_limits_at_once, test_stop_while_making,
                                    test_two_parks_while_making, test_park_not_behind_anothers,
                                    test_park_taken_meanwhile_made_again,
                                    test_park_copy_does_not_hold_others, test_park_copy_in_turn_same_user,
                                    test_park_copy_in_turn_other_user,
                                    test_park_copy_parker_killed, test_park_copy_dropped,
                                    test_park_copy_foreign_lease_ends,
                                    test_park_copy_attach_cancels, test_stop_while_copying,
                                    test_unpark_copy_does_not_hold_others, test_park_waits_for_host_zeroing,
                                    test_unpark_waits_for_device_zeroing, test_host_reserve_made_at_start,
                                    test_own_unpark_waits_for_own_park,
                                    test_own_unparks_after_own_park_copy, test_unpark_copy_shared, test_attach_waits_for_unpark_copy,
                                    test_stop_while_unparking, test_stop_while_attaching)) == 0
                       ? EXIT_SUCCESS : EXIT_FAILURE;
}
