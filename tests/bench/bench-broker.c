/* SPDX-License-Identifier: MIT */

/*
 * bench-broker: what a client pays for memory from the broker, against what
 * the driver costs without it (issue 14's first and third targets). It starts
 * its own vmmbrokerd ($VMMBROKER_DAEMON) on a private socket, on whatever
 * driver it loads (the GPU's, or the simulated device through
 * VMMBROKER_LIBCUDA), and measures for each size of SIZES, as medians over
 * repetitions, all in one run:
 *
 *   slabs        how many slabs the daemon served the size with: the layout of
 *                one raw Alloc over the wire, the same the client maps
 *   request      vmmb_alloc() with a warm pool: from the request to a usable
 *                pointer (the daemon's reply, import, reserve, map, access)
 *   floor        the driver floor for the same slab layout: the very slabs the
 *                daemon hands out (the fds of a raw Alloc, just received, as a
 *                request has them) imported, reserved, mapped and given access
 *                in this process: cuda_map_fds(), what the client does, less
 *                the round trip; a raw Alloc per repetition, so no repetition
 *                maps fds mapped before (that costs less: see the phases)
 *   bare         a bare AF_UNIX round trip of a Status request's and reply's
 *                size to a forked process that only answers, measured between
 *                this size's requests: what any request pays for the socket
 *   free         vmmb_free() of such a lease: unmap in the client, then Free
 *   oneway       vmmb_free_oneway() of such a lease: unmap, then the Free sent
 *                as a one-way call, its answer not waited for
 *   again        vmmb_alloc() of the size right after a vmmb_free() of it: the
 *                slab just freed is the one it gets, once its scrub is issued
 *                and done (the daemon issues it at once for such a request)
 *   kept         vmmb_alloc() of a size this process kept with vmmb_free_keep():
 *                the broker hands the same lease back, zeroed, and the client
 *                reuses its mapping (no import, map or access); measured after
 *                the zeroing had time to finish (size / 1 TB/s + 200 us after
 *                the keep; an H100 zeroes at 3.3 TB/s), as the plain request is
 *                measured once the freed slab is scrubbed
 *   back to back the same, the next vmmb_alloc() right after the keep: the
 *                broker waits for the zeroing when it still runs
 *   keep         vmmb_free_keep() itself: no unmap, the Free sent one-way
 *   unmap        the unmap floor: cuda_unmap() of the floor's mapping, its fds
 *                closed first as a client's are (cuMemUnmap of each slab,
 *                cuMemAddressFree), which is what vmmb_free() does in the
 *                process (the client releases its imported handles right after
 *                mapping, so there is nothing more to release)
 *   cuMemAlloc   cuMemAlloc of the same size, for comparison
 *   reclaim      from SIGKILL of a process holding the lease to the daemon
 *                reporting it reclaimed (leased drops), and to it being cached
 *                again (scrubbed, reusable); polled through Status
 *
 * Then where a request's time goes: the raw Alloc and Free round trips alone
 * (reply and fds received, no driver call), the rest of vmmb_alloc() beyond the
 * floor and that round trip, the daemon's own time per method (from its
 * request-latency metric), how many of the request-and-free repetitions found
 * this process and the daemon last on one CPU right after the free (the
 * scheduler's placement: a free's unmap overlaps the daemon's work only on two
 * CPUs), and the floor's driver calls one by one, with the fds just received
 * and with the same fds mapped a second time.
 *
 * Requests and floors are interleaved repetition by repetition (which goes
 * first alternating): on the lent VM the same step's median moves by half
 * between loops a second apart, and a ratio of two loops run one after the
 * other measured that drift as much as the request.
 *
 * Placement: nothing is pinned. This process, the daemon and the echo process
 * run wherever the scheduler puts them, as a daemon and its clients do; the
 * bare round trip and the requests share that placement. The header says what
 * the machine is; the end prints each target met or MISSED, by how much.
 *
 * A program that prints measurements, not a test. Usage: bench-broker [REPS].
 */

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "codec.h"
#include "driver.h"
#include "harness.h"
#include "json.h"
#include "machine.h"
#include "macro.h"
#include "rawclient.h"
#include "size.h"
#include "timing.h"
#include "varlink.h"
#include "vmmbroker.h"

#define MiB (UINT64_C(1) << 20)
#define GiB (UINT64_C(1) << 30)
#define MAX_REPS 100
#define RECLAIM_REPS 5
#define TARGET_REQUEST 1.2              /* request <= 1.2x the driver floor for the same slab layout */
#define TARGET_FREE 1.2                 /* free <= 1.2x the unmap floor */

/*
 * The sizes measured, from 2 MiB to 4 GiB: the powers of two a pool likes, and the odd sizes frameworks ask
 * for, which a power-of-two layout serves with several slabs.
 */
static const struct {
        uint64_t size;
        const char *why;
} SIZES[] = {
        { 2 * MiB, "the granularity: PyTorch's small-block segments" },
        { 20 * MiB, "PyTorch's caching allocator's large-segment size" },
        { 64 * MiB, "a power of two" },
        { 154 * MiB, "a PyTorch segment seen in GPT-2 training (issue 14)" },
        { 512 * MiB, "a power of two" },
        { 677 * MiB, "GPT-2 medium's weights in bf16, rounded up" },
        { 1 * GiB, "the default maximum slab" },
        { 2 * GiB, "two maximum slabs" },
        { 4 * GiB, "four maximum slabs" },
};

static CudaDriver *cu;
static CUdevice dev0;

static _Noreturn void die(const char *what, int k) {
        fprintf(stderr, "bench-broker: %s: %s (%s)\n", what, strerror(k < 0 ? -k : k), vmmb_error_message());
        exit(EXIT_FAILURE);
}

static void check(CUresult r, const char *what) {
        if (r != CUDA_SUCCESS) {
                fprintf(stderr, "bench-broker: %s: %s\n", what, cuda_result_name(cu, r));
                exit(EXIT_FAILURE);
        }
}

/* Status of device 0 on `c`. */
static void status_on(VarlinkConn *c, uint64_t *ret_leased, uint64_t *ret_scrubbing, uint64_t *ret_cached) {
        WireDevice d;
        int k = harness_status_on(c, &d);

        if (k < 0)
                die("Status", k);
        *ret_leased = d.leased;
        *ret_scrubbing = d.scrubbing;
        *ret_cached = d.cached;
}

/* The same on a connection of its own. */
static void status(const char *path, uint64_t *ret_leased, uint64_t *ret_scrubbing, uint64_t *ret_cached) {
        VarlinkConn *c = NULL;
        int k = harness_conn_open(path, false, &c);

        if (k < 0)
                die("connect", k);
        status_on(c, ret_leased, ret_scrubbing, ret_cached);
        varlink_conn_free(c);
}

/* Waits (polling Status, this is a benchmark) until nothing is being scrubbed. */
static void wait_scrubbed(const char *path) {
        uint64_t leased, scrubbing, cached;

        do
                status(path, &leased, &scrubbing, &cached);
        while (scrubbing > 0);
}

/* Waits until device 0 has nothing leased or scrubbing: a one-way Free has been read and its scrub is done. */
static void wait_idle(const char *path) {
        uint64_t leased, scrubbing, cached;

        do
                status(path, &leased, &scrubbing, &cached);
        while (leased > 0 || scrubbing > 0);
}

/* ---- the bare round trip: a forked process that answers each request with a reply of Status's size ---- */

static int echo_fd = -EBADF;
static pid_t echo_pid;
static size_t request_len, reply_len;   /* a Status call's and its reply's bytes on the wire, NUL included */

/* The bytes a message takes on the wire: its JSON text as varlink writes it, and the NUL. */
static size_t wire_len(json_object *msg) {
        size_t len = 0;

        (void)json_object_to_json_string_length(msg, JSON_C_TO_STRING_PLAIN | JSON_C_TO_STRING_NOSLASHESCAPE, &len);
        return len + 1;
}

/* Measures what a Status call and its reply take on the wire, on a connection of its own. */
static void measure_status_sizes(const char *path) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        _cleanup_(json_object_putp) json_object *call_msg = NULL, *reply_msg = NULL;
        Reply r;
        int k;

        k = conn_open(path, &c);
        if (k < 0)
                die("connect", k);
        k = call_text(c, VMMB_METHOD_STATUS, NULL, &r);
        if (k < 0 || r.error)
                die("Status", k < 0 ? k : -EPROTO);
        k = varlink_call_new(VMMB_METHOD_STATUS, NULL, false, false, &call_msg);
        reply_msg = json_object_new_object();
        if (k < 0 || !reply_msg ||
            json_object_object_add(reply_msg, "parameters", json_object_get(r.params)) < 0)
                die("Status sizes", -ENOMEM);
        request_len = wire_len(call_msg);
        reply_len = wire_len(reply_msg);
        reply_done(&r);
}

/*
 * Forks the answering process. Before the driver is loaded: the child uses no CUDA, but nothing forked after
 * the driver was initialised should touch it, and it must not hold this process's driver state.
 */
static void echo_start(void) {
        int sv[2];

        if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0)
                die("socketpair", -errno);
        echo_pid = fork();
        if (echo_pid < 0)
                die("fork", -errno);
        if (echo_pid == 0) {
                _cleanup_free_ char *reply = malloc(reply_len);
                char buf[4096];
                size_t got = 0;
                ssize_t n;

                close(sv[0]);
                if (!reply)
                        _exit(1);
                memset(reply, ' ', reply_len - 1);
                reply[reply_len - 1] = 0;
                /* A whole request in, then the whole reply out in one write, as the daemon answers. */
                while ((n = read(sv[1], buf, sizeof(buf))) > 0) {
                        got += (size_t)n;
                        if (got < request_len)
                                continue;
                        got -= request_len;
                        if (write(sv[1], reply, reply_len) != (ssize_t)reply_len)
                                break;
                }
                _exit(0);
        }
        close(sv[1]);
        echo_fd = sv[0];
}

static void echo_stop(void) {
        echo_fd = safe_close(echo_fd);
        (void)waitpid(echo_pid, NULL, 0);
}

static double bare_round_trip(void) {
        _cleanup_free_ char *msg = malloc(request_len);
        char buf[4096];
        size_t got = 0;
        double t0;

        if (!msg)
                die("malloc", -ENOMEM);
        memset(msg, ' ', request_len - 1);
        msg[request_len - 1] = 0;
        t0 = now_us();
        if (write(echo_fd, msg, request_len) != (ssize_t)request_len)
                die("write", -errno);
        while (got < reply_len) {
                ssize_t n = read(echo_fd, buf, sizeof(buf));

                if (n <= 0)
                        die("read", n < 0 ? -errno : -EPIPE);
                got += (size_t)n;
        }
        return now_us() - t0;
}

/* Status on an open connection against the bare round trip, one of each in turn; medians. */
static void bench_round_trips(const char *path, unsigned n, double *ret_status, double *ret_bare) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        _cleanup_free_ double *st = calloc(n, sizeof(double)), *bare = calloc(n, sizeof(double));
        uint64_t a, b, d;

        if (!st || !bare)
                die("calloc", -ENOMEM);
        if (harness_conn_open(path, false, &c) < 0)
                die("connect", -ECONNREFUSED);
        for (unsigned i = 0; i < n; i++) {
                double t0;

                bare[i] = bare_round_trip();
                t0 = now_us();
                status_on(c, &a, &b, &d);
                st[i] = now_us() - t0;
        }
        *ret_status = median(st, n);
        *ret_bare = median(bare, n);
}

/* ---- one size ------------------------------------------------------------------------------------------ */

typedef struct Row {
        uint64_t size;
        TestLease layout;               /* the slabs of one raw Alloc (their fds closed) */
        double request, floor, bare, free, free_oneway, unmap, alloc, reclaimed, cached;
        double alloc_rt, free_rt;       /* raw Alloc (reply and fds received) and Free round trips, no driver */
        double fresh[5], again[5];      /* import, reserve, map, access, close: fds just received / mapped once */
        double send;                    /* a one-way Free written on a raw connection (the daemon answers nothing) */
        double kept, kept_b2b, keep;    /* vmmb_alloc() of a kept lease (zeroing done / back to back), vmmb_free_keep() */
        double daemon_alloc;            /* the daemon's own time per Alloc over those requests and floors (mean) */
        double unmap_again;             /* the unmap of a mapping of fds mapped twice before, closed first */
        unsigned one_cpu;               /* request-and-free repetitions with this process and the daemon on one CPU */
        double realloc;                 /* vmmb_alloc() of the size right after its vmmb_free() */
} Row;

static pid_t daemon_pid;

/* The CPU process `pid` last ran on (/proc/PID/stat's 39th field), or -1. */
static int last_cpu(pid_t pid) {
        char path[64], buf[1024];
        const char *p;
        ssize_t n;
        int fd, field = 2;

        snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
        fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
                return -1;
        n = read(fd, buf, sizeof(buf) - 1);
        close(fd);
        if (n <= 0)
                return -1;
        buf[n] = 0;
        p = strrchr(buf, ')');          /* the command name may hold anything but ends there */
        while (p && field < 39) {
                p = strchr(p + 1, ' ');
                field++;
        }
        return p ? atoi(p + 1) : -1;
}

/* vmmb_alloc() of `size` on device 0 into *ret; returns the microseconds it took. */
static double timed_alloc(vmmb_client *client, uint64_t size, vmmb_lease **ret) {
        double t0 = now_us(), t;
        int k;

        k = vmmb_alloc(client, size, 0, "bench", ret);
        t = now_us() - t0;
        if (k < 0)
                die("vmmb_alloc", k);
        return t;
}

/* Frees `l` by `fn` (vmmb_free(), vmmb_free_oneway(), vmmb_free_keep()); returns the microseconds it took. */
static double timed_free(int (*fn)(vmmb_lease *), const char *name, vmmb_lease *l) {
        double t0 = now_us(), t;
        int k;

        k = fn(l);
        t = now_us() - t0;
        if (k < 0)
                die(name, k);
        return t;
}

/* Lets the broker's zeroing of a kept lease of `size` finish: longer than it takes at 1 TB/s, plus 200 us. */
static void let_zeroing_finish(uint64_t size) {
        struct timespec ts = { .tv_nsec = (long)(size / 1000 + 200000) };

        while (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
        }
        (void)nanosleep(&ts, NULL);
}

/*
 * vmmb_alloc() of a lease this process kept (vmmb_free_keep()): the same lease comes back and the client
 * reuses its mapping. Timed once the zeroing had time to finish, and back to back; and the keep itself.
 */
static void bench_kept(vmmb_client *client, unsigned reps, Row *row) {
        double t[MAX_REPS], tb[MAX_REPS], tk[MAX_REPS];
        vmmb_lease *l;
        int k;

        /* The first keep of a connection waits for the broker's answer (does it keep?): not timed. */
        (void)timed_alloc(client, row->size, &l);
        (void)timed_free(vmmb_free_keep, "vmmb_free_keep", l);
        for (unsigned i = 0; i < reps; i++) {
                let_zeroing_finish(row->size);
                t[i] = timed_alloc(client, row->size, &l);
                tk[i] = timed_free(vmmb_free_keep, "vmmb_free_keep", l);
                tb[i] = timed_alloc(client, row->size, &l);
                (void)timed_free(vmmb_free_keep, "vmmb_free_keep", l);
        }
        row->kept = median(t, reps);
        row->kept_b2b = median(tb, reps);
        row->keep = median(tk, reps);
        /* Given back for good: the next size starts from a pool with nothing kept. */
        k = vmmb_give_back_kept(client);
        if (k < 0)
                die("vmmb_give_back_kept", k);
}

/* Alloc on device 0 over raw varlink: the lease as the wire has it, slab sizes and fds in mapping order. */
static void raw_alloc(VarlinkConn *c, uint64_t size, TestLease *ret) {
        _cleanup_(json_object_putp) json_object *params = NULL;
        AllocParams a = { .size = size, .device = 0 };
        Reply r;
        int k;

        k = alloc_params_encode(&a, &params);
        if (k < 0)
                die("Alloc", k);
        k = call(c, VMMB_METHOD_ALLOC, params, &r);
        if (k < 0 || r.error)
                die(r.error ?: "Alloc", k < 0 ? k : -EREMOTEIO);
        k = lease_take(&r, ret);
        reply_done(&r);
        if (k < 0)
                die("Alloc reply", k);
}

/* The daemon's time in method_call() for METHOD so far, in seconds, and how many calls: its request-latency
 * metric's sum and count. */
typedef struct MethodTotal {
        double sum, count;
} MethodTotal;

static MethodTotal method_total(const char *metrics, const char *method) {
        MethodTotal t = {};
        char key[128];
        const char *p;

        snprintf(key, sizeof(key), "vmmbroker_request_duration_seconds_sum{method=\"%s\"} ", method);
        p = strstr(metrics, key);
        if (p)
                t.sum = strtod(p + strlen(key), NULL);
        snprintf(key, sizeof(key), "vmmbroker_request_duration_seconds_count{method=\"%s\"} ", method);
        p = strstr(metrics, key);
        if (p)
                t.count = strtod(p + strlen(key), NULL);
        return t;
}

/* The mean microseconds per call between two totals of one method; 0 when there was none. */
static double method_mean_us(MethodTotal from, MethodTotal to) {
        return to.count > from.count ? (to.sum - from.sum) / (to.count - from.count) * 1e6 : 0;
}

/* The daemon's metrics text (Metrics) into *ret, which the caller frees with reply_done(); the text is
 * reply_str(ret, "text"). */
static const char *metrics_get(const char *path, Reply *ret) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        _cleanup_(json_object_putp) json_object *params = json_object_new_object();
        const char *text;
        int k;

        k = conn_open(path, &c);
        if (k < 0)
                die("connect", k);
        k = call(c, VMMB_METHOD_METRICS, params, ret);
        if (k < 0 || ret->error)
                die(ret->error ?: "Metrics", k < 0 ? k : -EREMOTEIO);
        text = reply_str(ret, "text");
        if (!text)
                die("Metrics reply", -EBADMSG);
        return text;
}

/* The daemon's total for METHOD now (method_total()). */
static MethodTotal daemon_total(const char *path, const char *method) {
        Reply r;
        MethodTotal t = method_total(metrics_get(path, &r), method);

        reply_done(&r);
        return t;
}

/*
 * One repetition of the driver floor for the broker's own slab layout, as a request meets it: one raw Alloc of
 * the size on `c` (from the warm pool: the same slabs vmmb_alloc() gets, just scrubbed), its fds, just
 * received, imported, reserved, mapped and given access as the client does (*ret_map, us), the fds closed as
 * the client closes them, the mapping unmapped as vmmb_free() does (*ret_unmap), the lease freed and its scrub
 * waited for; its layout in *ret_layout. A request always maps fds it has just received, and mapping such fds
 * costs more than mapping the same fds a second time (the phases table prints both), so the floor is never
 * measured on fds this process mapped before.
 */
static void floor_once(VarlinkConn *c, const char *path, uint64_t size, double *ret_map, double *ret_unmap,
                       TestLease *ret_layout) {
        _cleanup_free_ char *message = NULL;
        CUdeviceptr va;
        double t0;
        int k;

        raw_alloc(c, size, ret_layout);
        t0 = now_us();
        k = cuda_map_fds(cu, dev0, ret_layout->fds, ret_layout->sizes, ret_layout->n, ret_layout->readonly, &va,
                         &message);
        *ret_map = now_us() - t0;
        if (k < 0) {
                fprintf(stderr, "bench-broker: %s\n", message);
                exit(EXIT_FAILURE);
        }
        test_lease_close(ret_layout);
        t0 = now_us();
        k = cuda_unmap(cu, va, ret_layout->sizes, ret_layout->n);
        *ret_unmap = now_us() - t0;
        if (k < 0)
                die("cuda_unmap", k);
        k = lease_free(c, ret_layout->id);
        if (k < 0)
                die("Free", k);
        wait_scrubbed(path);
}

/*
 * One request to usable pointer (*ret_request, us) and its vmmb_free() (*ret_free), then the scrub waited for;
 * whether this process and the daemon were last on one CPU right after the free (*ret_one_cpu).
 */
static void request_once(vmmb_client *client, const char *path, uint64_t size, double *ret_request,
                         double *ret_free, bool *ret_one_cpu) {
        vmmb_lease *l;

        *ret_request = timed_alloc(client, size, &l);
        *ret_free = timed_free(vmmb_free, "vmmb_free", l);
        *ret_one_cpu = sched_getcpu() == last_cpu(daemon_pid);
        wait_scrubbed(path);
}

/*
 * Request to usable pointer and vmmb_free() on a warm pool, and the floor and unmap floor (floor_once()),
 * interleaved repetition by repetition, which of the two goes first alternating: the machine's drift (on the
 * lent VM a phase's median moves by half between loops a second apart) then weighs on both sides of a ratio
 * alike. A bare round trip before each pair. Then one-way frees, and the raw round trips alone. The first
 * floor's layout stays in the row.
 */
static void bench_request(vmmb_client *client, const char *path, unsigned reps, Row *row) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        double t[MAX_REPS], tf[MAX_REPS], tb[MAX_REPS], tm[MAX_REPS], tu[MAX_REPS];
        MethodTotal before;
        vmmb_lease *l;
        int k;

        k = conn_open(path, &c);
        if (k < 0)
                die("connect", k);
        /* Warm the pool: the slabs this size needs, scrubbed and cached for this uid. */
        (void)timed_alloc(client, row->size, &l);
        (void)timed_free(vmmb_free, "vmmb_free", l);
        wait_scrubbed(path);

        before = daemon_total(path, "Alloc");
        for (unsigned i = 0; i < reps; i++) {
                TestLease x;
                bool one_cpu;

                tb[i] = bare_round_trip();
                if (i % 2 == 0) {
                        request_once(client, path, row->size, &t[i], &tf[i], &one_cpu);
                        floor_once(c, path, row->size, &tm[i], &tu[i], &x);
                } else {
                        floor_once(c, path, row->size, &tm[i], &tu[i], &x);
                        request_once(client, path, row->size, &t[i], &tf[i], &one_cpu);
                }
                row->one_cpu += one_cpu;
                if (i == 0)
                        row->layout = x;
        }
        row->request = median(t, reps);
        row->free = median(tf, reps);
        row->bare = median(tb, reps);
        row->floor = median(tm, reps);
        row->unmap = median(tu, reps);
        row->daemon_alloc = method_mean_us(before, daemon_total(path, "Alloc"));

        /* vmmb_free_oneway(): the Free sent, not waited for. */
        for (unsigned i = 0; i < reps; i++) {
                (void)timed_alloc(client, row->size, &l);
                tf[i] = timed_free(vmmb_free_oneway, "vmmb_free_oneway", l);
                wait_idle(path);
        }
        row->free_oneway = median(tf, reps);

        /* A request of the size right after its vmmb_free(): the daemon issues and waits for the scrub. */
        for (unsigned i = 0; i < reps; i++) {
                (void)timed_alloc(client, row->size, &l);
                (void)timed_free(vmmb_free, "vmmb_free", l);
                t[i] = timed_alloc(client, row->size, &l);
                (void)timed_free(vmmb_free, "vmmb_free", l);
                wait_scrubbed(path);
        }
        row->realloc = median(t, reps);

        /* The same request's round trips alone: what the wire and the daemon add to the floor. */
        for (unsigned i = 0; i < reps; i++) {
                TestLease x;
                double t0 = now_us();

                raw_alloc(c, row->size, &x);
                t[i] = now_us() - t0;
                test_lease_close(&x);
                t0 = now_us();
                k = lease_free(c, x.id);
                tu[i] = now_us() - t0;
                if (k < 0)
                        die("Free", k);
                wait_scrubbed(path);
        }
        row->alloc_rt = median(t, reps);
        row->free_rt = median(tu, reps);
}

/*
 * Writes a one-way Free of `id` (ended already: the daemon acts on nothing and answers nothing) and returns
 * how long building and writing it took: what vmmb_free_oneway() adds to the unmap.
 */
static double oneway_free_send(VarlinkConn *c, const char *id) {
        _cleanup_(varlink_text_done) VarlinkText call = {};
        FreeParams p = { .id = (char *)id };
        double t0 = now_us();
        int k;

        /* written as text, as vmmb_free_oneway() writes it (client_free_id()) */
        k = free_params_write(&p, true, &call);
        if (k >= 0)
                k = varlink_conn_send_text(c, &call, NULL, 0);
        if (k >= 0)
                k = varlink_conn_flush(c);
        if (k < 0)
                die("one-way Free", k);
        return now_us() - t0;
}

/* Maps l's slabs phase by phase as cuda_map_fds() does, adding each phase's time to t[0..3]; unmaps. */
static void map_phases(const TestLease *l, double t[5]) {
        CUmemGenericAllocationHandle h;
        CUdeviceptr va;
        uint64_t total = 0, off = 0;
        double t0;

        for (size_t i = 0; i < l->n; i++)
                total += l->sizes[i];
        t0 = now_us();
        check(cu->cuMemAddressReserve(&va, total, cuda_slab_alignment(l->sizes[0]), 0, 0), "reserve");
        t[1] += now_us() - t0;
        for (size_t i = 0; i < l->n; i++) {
                t0 = now_us();
                check(cu->cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)l->fds[i],
                                                         CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), "import");
                t[0] += now_us() - t0;
                t0 = now_us();
                check(cu->cuMemMap(va + off, l->sizes[i], 0, h, 0), "map");
                (void)cu->cuMemRelease(h);
                t[2] += now_us() - t0;
                off += l->sizes[i];
        }
        t0 = now_us();
        check(cuda_set_access(cu, va, total, &dev0, 1, false), "access");
        t[3] += now_us() - t0;
        if (cuda_unmap(cu, va, l->sizes, l->n) < 0)
                die("cuda_unmap", -EIO);
}

/* The floor's phases with fds just received (as a request has them) and with the same fds mapped again. */
static void bench_phases(const char *path, unsigned reps, Row *row) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        double f[5][MAX_REPS], a[5][MAX_REPS], sent[MAX_REPS], uc[MAX_REPS];
        int k;

        k = conn_open(path, &c);
        if (k < 0)
                die("connect", k);
        for (unsigned i = 0; i < reps; i++) {
                double tf[5] = {}, ta[5] = {}, t0;
                TestLease x;

                _cleanup_free_ char *message = NULL;
                CUdeviceptr va;

                raw_alloc(c, row->size, &x);
                map_phases(&x, tf);
                map_phases(&x, ta);
                if (cuda_map_fds(cu, dev0, x.fds, x.sizes, x.n, false, &va, &message) < 0)
                        die(message ?: "cuda_map_fds", -EIO);
                t0 = now_us();
                test_lease_close(&x);
                tf[4] = now_us() - t0;
                t0 = now_us();
                if (cuda_unmap(cu, va, x.sizes, x.n) < 0)
                        die("cuda_unmap", -EIO);
                uc[i] = now_us() - t0;
                k = lease_free(c, x.id);
                if (k < 0)
                        die("Free", k);
                wait_scrubbed(path);
                sent[i] = oneway_free_send(c, x.id);
                for (unsigned j = 0; j < 5; j++) {
                        f[j][i] = tf[j];
                        a[j][i] = ta[j];
                }
        }
        for (unsigned j = 0; j < 5; j++) {
                row->fresh[j] = median(f[j], reps);
                row->again[j] = median(a[j], reps);
        }
        row->send = median(sent, reps);
        row->unmap_again = median(uc, reps);
}

/* The daemon's own time per call over the whole run: method_call() alone, without reading, parsing or sending. */
static void print_daemon_share(const char *path) {
        static const char *const methods[] = { "Alloc", "Free", "Status" };
        Reply r;
        const char *text = metrics_get(path, &r);

        printf("the daemon's own time per call, all sizes (method_call() alone, mean from its metrics):");
        for (size_t i = 0; i < ELEMENTSOF(methods); i++)
                printf("%s %s %.1f us", i > 0 ? "," : "", methods[i],
                       method_mean_us((MethodTotal){}, method_total(text, methods[i])));
        printf("\n");
        reply_done(&r);
}

static double bench_cumemalloc(uint64_t size, unsigned reps) {
        double t[MAX_REPS];

        for (unsigned i = 0; i < reps; i++) {
                CUdeviceptr p;
                double t0 = now_us();

                check(cu->cuMemAlloc(&p, size), "cuMemAlloc");
                t[i] = now_us() - t0;
                check(cu->cuMemFree(p), "cuMemFree");
        }
        return median(t, reps);
}

/* `bench-broker --hold PATH SIZE`: lease SIZE, say 'r' on stdout, wait to be killed. */
static int hold(const char *path, const char *size) {
        vmmb_client *client;
        vmmb_lease *l;

        if (vmmb_connect(path, &client) < 0 || vmmb_alloc(client, strtoull(size, NULL, 10), 0, "victim", &l) < 0) {
                fprintf(stderr, "bench-broker --hold: %s\n", vmmb_error_message());
                return 1;
        }
        (void)!write(STDOUT_FILENO, "r", 1);
        pause();
        return 0;
}

/*
 * A process holding a lease of `size`. It is this program run again, not a
 * fork: CUDA is not usable in a child forked after the driver was initialised.
 */
static pid_t spawn_holder(const char *path, uint64_t size) {
        char arg[32];
        int p[2];
        pid_t pid;
        char c;

        if (pipe(p) < 0)
                die("pipe", -errno);
        snprintf(arg, sizeof(arg), "%" PRIu64, size);
        pid = fork();
        if (pid == 0) {
                dup2(p[1], STDOUT_FILENO);
                execl("/proc/self/exe", "bench-broker", "--hold", path, arg, (char *)NULL);
                _exit(127);
        }
        safe_close(p[1]);
        if (read(p[0], &c, 1) != 1)
                die("holder", -EIO);
        safe_close(p[0]);
        return pid;
}

static void bench_reclaim(const char *path, unsigned reps, Row *row) {
        double reclaimed[MAX_REPS], cached[MAX_REPS];

        for (unsigned i = 0; i < reps; i++) {
                uint64_t leased, scrubbing, c;
                pid_t pid = spawn_holder(path, row->size);
                double t0;

                wait_scrubbed(path);
                t0 = now_us();
                kill(pid, SIGKILL);
                do
                        status(path, &leased, &scrubbing, &c);
                while (leased > 0);
                reclaimed[i] = now_us() - t0;
                do
                        status(path, &leased, &scrubbing, &c);
                while (scrubbing > 0);
                cached[i] = now_us() - t0;
                (void)harness_wait(pid);
        }
        row->reclaimed = median(reclaimed, reps);
        row->cached = median(cached, reps);
}

/* ---- the report ---------------------------------------------------------------------------------------- */

#define TARGET_ROW "%-34s %-8s %-17s %s\n"       /* what, target, verdict, measured */

/* One target row: met when value <= limit, else MISSED by how much over the limit. */
static void target_row(const char *what, double value, double limit, const char *measured) {
        char target[16], verdict[32];

        snprintf(target, sizeof(target), "<= %.1fx", limit);
        if (value <= limit)
                snprintf(verdict, sizeof(verdict), "met");
        else
                snprintf(verdict, sizeof(verdict), "MISSED by %.0f%%", (value / limit - 1) * 100);
        printf(TARGET_ROW, what, target, verdict, measured);
}

/* "154 MiB = 128 MiB + 16 MiB + 8 MiB + 2 MiB", or "2 GiB = 2 x 1 GiB"; runs of one size are counted. */
static void print_layout(const Row *row) {
        char b[FORMAT_SIZE_MAX];

        printf("  %-8s =", format_size(row->size, b, sizeof(b)));
        for (size_t i = 0; i < row->layout.n;) {
                size_t j = i;

                while (j < row->layout.n && row->layout.sizes[j] == row->layout.sizes[i])
                        j++;
                printf("%s", i ? " +" : "");
                if (j - i > 1)
                        printf(" %zu x", j - i);
                printf(" %s", format_size(row->layout.sizes[i], b, sizeof(b)));
                i = j;
        }
        printf("\n");
}

int main(int argc, char *argv[]) {
        unsigned reps = argc > 1 ? (unsigned)strtoul(argv[1], NULL, 10) : 20;
        unsigned reclaim_reps = MIN(reps, (unsigned)RECLAIM_REPS);
        Row rows[ELEMENTSOF(SIZES)] = {};
        double status_us, bare_us;
        vmmb_client *client;
        Harness h;
        CUcontext ctx;
        int k;

        if (argc == 4 && strcmp(argv[1], "--hold") == 0)
                return hold(argv[2], argv[3]);
        if (reps == 0 || reps > MAX_REPS) {
                fprintf(stderr, "Usage: %s [REPS], 1 to %d\n", argv[0], MAX_REPS);
                return EXIT_FAILURE;
        }
        k = harness_start(&h, NULL);
        if (k < 0)
                die("starting vmmbrokerd (is VMMBROKER_DAEMON set?)", k);
        daemon_pid = h.pid;
        measure_status_sizes(h.socket);
        echo_start();                   /* before this process loads the driver */
        machine_open_device("bench-broker", &cu, &dev0, &ctx);
        k = vmmb_connect(h.socket, &client);
        if (k < 0)
                die("vmmb_connect", k);

        machine_print("bench-broker", cu);
        printf("method: %u repetitions per size (reclaim: %u), medians in us, CLOCK_MONOTONIC around each call; "
               "one daemon started for the run, its pool warm for this uid before each size; the floor maps the "
               "slabs of a raw Alloc of the size, its fds just received, one raw Alloc per repetition (the layout "
               "below), requests and floors interleaved, which goes first alternating; nothing pinned (placement is "
               "the scheduler's, the same for requests and bare round trips); bare = %zu-byte call, %zu-byte reply "
               "(Status's) through an AF_UNIX stream socket to a forked echo process\n",
               reps, reclaim_reps, request_len, reply_len);
        fflush(stdout);

        for (size_t i = 0; i < ELEMENTSOF(SIZES); i++) {
                rows[i].size = SIZES[i].size;
                bench_request(client, h.socket, reps, &rows[i]);
                bench_kept(client, reps, &rows[i]);
                bench_phases(h.socket, reps, &rows[i]);
                rows[i].alloc = bench_cumemalloc(rows[i].size, reps);
                bench_reclaim(h.socket, reclaim_reps, &rows[i]);
        }
        vmmb_close(client);
        bench_round_trips(h.socket, 10 * reps, &status_us, &bare_us);
        print_daemon_share(h.socket);
        echo_stop();

        printf("round trips on an open connection (interleaved, median of %u): bare %.1f us, Status %.1f us "
               "(%.2fx)\n", 10 * reps, bare_us, status_us, status_us / bare_us);
        printf("layouts the daemon served (slabs in mapping order):\n");
        for (size_t i = 0; i < ELEMENTSOF(rows); i++)
                print_layout(&rows[i]);
        printf("%-8s %5s %9s %9s %7s %7s %9s %8s %7s %8s %7s %10s %8s %13s %12s\n", "size", "slabs", "request",
               "floor", "ratio", "bare", "free", "unmap", "ratio", "oneway", "ratio", "cuMemAlloc", "vs alloc",
               "kill->reclaim", "kill->cached");
        for (size_t i = 0; i < ELEMENTSOF(rows); i++) {
                const Row *r = &rows[i];
                char b[FORMAT_SIZE_MAX];

                printf("%-8s %5zu %9.1f %9.1f %6.2fx %7.1f %9.1f %8.1f %6.2fx %8.1f %6.2fx %10.1f %7.2fx %13.1f "
                       "%12.1f\n",
                       format_size(r->size, b, sizeof(b)), r->layout.n, r->request, r->floor, r->request / r->floor,
                       r->bare, r->free, r->unmap, r->free / r->unmap, r->free_oneway, r->free_oneway / r->unmap,
                       r->alloc, r->request / r->alloc, r->reclaimed, r->cached);
        }

        printf("kept leases (medians, us): kept = vmmb_alloc() of a size this process kept with vmmb_free_keep(), "
               "the zeroing done; b2b = the same right after the keep; keep = vmmb_free_keep()\n");
        printf("%-8s %9s %9s %7s %9s %7s %9s %8s %7s %10s %8s\n", "size", "kept", "floor", "ratio", "b2b", "ratio",
               "keep", "unmap", "ratio", "cuMemAlloc", "vs alloc");
        for (size_t i = 0; i < ELEMENTSOF(rows); i++) {
                const Row *r = &rows[i];
                char b[FORMAT_SIZE_MAX];

                printf("%-8s %9.1f %9.1f %6.2fx %9.1f %6.2fx %9.1f %8.1f %6.2fx %10.1f %7.2fx\n",
                       format_size(r->size, b, sizeof(b)), r->kept, r->floor, r->kept / r->floor, r->kept_b2b,
                       r->kept_b2b / r->floor, r->keep, r->unmap, r->keep / r->unmap, r->alloc, r->kept / r->alloc);
        }

        printf("where a request's time goes (medians, us): alloc RT = raw Alloc call to reply and fds received, "
               "no driver call; client = request - floor - alloc RT; free RT = raw Free round trip; send = a one-way "
               "Free built and written, not answered; unmap = the unmap floor (fds just received, closed first, as a "
               "client's are); unmap/ag = the same for a mapping of fds mapped twice before; daemon = the daemon's own "
               "time per Alloc over the requests and floors of the size (method_call(), mean from its metrics); 1 CPU = of "
               "the %u requests and frees, those after which this process and the daemon were last on one CPU; again = "
               "vmmb_alloc() of the size right after its vmmb_free() (the daemon issues and waits for the freed slab's "
               "scrub)\n",
               reps);
        printf("%-8s %9s %9s %9s %9s %9s %9s %9s %9s %9s %9s %6s %9s\n", "size", "request", "floor", "alloc RT",
               "client", "free RT", "send", "unmap", "unmap/ag", "bare", "daemon", "1 CPU", "again");
        for (size_t i = 0; i < ELEMENTSOF(rows); i++) {
                const Row *r = &rows[i];
                char b[FORMAT_SIZE_MAX];

                printf("%-8s %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %6u %9.1f\n",
                       format_size(r->size, b, sizeof(b)), r->request, r->floor, r->alloc_rt,
                       r->request - r->floor - r->alloc_rt, r->free_rt, r->send, r->unmap, r->unmap_again, r->bare,
                       r->daemon_alloc, r->one_cpu, r->realloc);
        }

        printf("the floor's phases (medians, us), fds just received / the same fds mapped a second time:\n");
        printf("%-8s %15s %15s %15s %15s %7s\n", "size", "import", "reserve", "map", "access", "close");
        for (size_t i = 0; i < ELEMENTSOF(rows); i++) {
                const Row *r = &rows[i];
                char b[FORMAT_SIZE_MAX];

                printf("%-8s %7.1f/%-7.1f %7.1f/%-7.1f %7.1f/%-7.1f %7.1f/%-7.1f %7.1f\n",
                       format_size(r->size, b, sizeof(b)), r->fresh[0], r->again[0], r->fresh[1], r->again[1],
                       r->fresh[2], r->again[2], r->fresh[3], r->again[3], r->fresh[4]);
        }

        printf("\n" TARGET_ROW, "target (issue 14)", "target", "verdict", "measured");
        for (size_t i = 0; i < ELEMENTSOF(rows); i++) {
                const Row *r = &rows[i];
                char what[64], measured[160], b[FORMAT_SIZE_MAX];

                format_size(r->size, b, sizeof(b));
                snprintf(what, sizeof(what), "request vs floor, %s", b);
                snprintf(measured, sizeof(measured), "%.2fx: %.1f / %.1f us, %zu slab%s (bare round trip %.1f us)",
                         r->request / r->floor, r->request, r->floor, r->layout.n, r->layout.n == 1 ? "" : "s",
                         r->bare);
                target_row(what, r->request / r->floor, TARGET_REQUEST, measured);
        }
        for (size_t i = 0; i < ELEMENTSOF(rows); i++) {
                const Row *r = &rows[i];
                char what[64], measured[160], b[FORMAT_SIZE_MAX];

                format_size(r->size, b, sizeof(b));
                snprintf(what, sizeof(what), "request kept vs floor, %s", b);
                snprintf(measured, sizeof(measured), "%.2fx: %.1f / %.1f us (back to back %.1f us, %.2fx)",
                         r->kept / r->floor, r->kept, r->floor, r->kept_b2b, r->kept_b2b / r->floor);
                target_row(what, r->kept / r->floor, TARGET_REQUEST, measured);
        }
        for (size_t i = 0; i < ELEMENTSOF(rows); i++) {
                const Row *r = &rows[i];
                char what[64], measured[160], b[FORMAT_SIZE_MAX];

                format_size(r->size, b, sizeof(b));
                snprintf(what, sizeof(what), "free vs unmap floor, %s", b);
                snprintf(measured, sizeof(measured), "%.2fx: %.1f / %.1f us (bare round trip %.1f us)",
                         r->free / r->unmap, r->free, r->unmap, r->bare);
                target_row(what, r->free / r->unmap, TARGET_FREE, measured);
        }
        for (size_t i = 0; i < ELEMENTSOF(rows); i++) {
                const Row *r = &rows[i];
                char what[64], measured[160], b[FORMAT_SIZE_MAX];

                format_size(r->size, b, sizeof(b));
                snprintf(what, sizeof(what), "free one-way vs unmap floor, %s", b);
                snprintf(measured, sizeof(measured), "%.2fx: %.1f / %.1f us (vmmb_free_oneway())",
                         r->free_oneway / r->unmap, r->free_oneway, r->unmap);
                target_row(what, r->free_oneway / r->unmap, TARGET_FREE, measured);
        }
        for (size_t i = 0; i < ELEMENTSOF(rows); i++) {
                const Row *r = &rows[i];
                char what[64], measured[160], b[FORMAT_SIZE_MAX];

                format_size(r->size, b, sizeof(b));
                snprintf(what, sizeof(what), "free keep vs unmap floor, %s", b);
                snprintf(measured, sizeof(measured), "%.2fx: %.1f / %.1f us (vmmb_free_keep())", r->keep / r->unmap,
                         r->keep, r->unmap);
                target_row(what, r->keep / r->unmap, TARGET_FREE, measured);
        }

        k = harness_stop(&h);
        (void)cu->cuDevicePrimaryCtxRelease(0);
        cuda_driver_close(cu);
        return k == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
