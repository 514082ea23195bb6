/* SPDX-License-Identifier: MIT */

/*
 * bench-scale: how the daemon holds up with many live leases, against the targets of the scaling issue.
 * It runs the real vmmbrokerd ($VMMBROKER_DAEMON) on the simulated device ($VMMBROKER_LIBCUDA), talks raw
 * varlink to it (tests/integration/rawclient.h) and closes every slab fd it receives (nothing is mapped).
 * Three daemons of one configuration run, each on a simulated device of its own:
 *
 *   plain    started by this program with no NOTIFY_SOCKET, so it keeps no fd store (as a daemon run by
 *            hand). Measured: Alloc+Free round trips with 0 leases against "0" (target 2); then, with 5,000
 *            leases of root's in its table, Status p99 from uid 65534 idle and while uid 65533 pipelines
 *            List on 64 connections as fast as the daemon answers (target 3). Stopped after that.
 *   0        under a test supervisor (tests/supervisor: systemd's fd store, FileDescriptorStoreMax=262144),
 *            never given a lease to hold: the reference for target 1 and the stored side of target 2.
 *   N        under a second supervisor, the same: its round trips with N live leases held by a child
 *            process against "0" (target 1), the notifications it sent its supervisor per 1,000 such
 *            requests (target 2), its memory with 0 and N leases (5), `vmmctl list --all` with N leases (6),
 *            and start to READY=1 after SIGTERM and after SIGKILL with the N leases live (4).
 *
 * Latencies measured one phase after another differ by 2x and more on a busy machine: drift, not the
 * daemon. So the two daemons a target compares run at the same time and take turns: after each has its
 * pool warmed, BLOCKS rounds of one block of BLOCK_PAIRS round trips on each, the order alternating (A B,
 * B A, A B...) so that neither always goes first; each block ends with its daemon's scrubs done, so that
 * they do not run into the other's block. Each side's pairs are pooled for p50 and p99; the per-round
 * ratios of block p50s show how much drift is left. Interleaving alone is not enough: where the scheduler
 * happens to put a daemon, on the client's CPU or another, makes its round trips 2x faster or slower for
 * a whole run, so during a comparison the client runs on CPU 0 and both daemons on CPU PIN_CPU.
 *
 * An Alloc+Free round trip is one Alloc of 2 MiB and the Free of that lease on one open connection, timed
 * together, after the pool was warmed (16 slabs leased, freed and scrubbed) so that no slab is created.
 * "Notifications" are every message the supervisor acted on (FDSTORE=, FDSTOREREMOVE=, STATUS=...) while
 * that daemon's blocks ran, per 1,000 requests (an Alloc or a Free is one request).
 * N is 10,000 or what RLIMIT_NOFILE allows (see lease_count()). Every phase is bounded in time: a phase
 * that runs past its cap stops and says how far it got. A program that prints, not a test; it exits 0
 * whether or not the targets are met, and 1 when it could not measure.
 *
 * Usage: bench-scale [N]   ($VMMCTL names the vmmctl to time; without it, that row is not run)
 */

#include <dirent.h>
#include <errno.h>
#include <sched.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/pidfd.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "codec.h"
#include "harness.h"
#include "json.h"
#include "macro.h"
#include "rawclient.h"
#include "supervisor.h"
#include "timing.h"
#include "varlink.h"

#define MiB (UINT64_C(1) << 20)
#define GiB (UINT64_C(1) << 30)
#define SLAB (2 * MiB)

#define N_MAX 10000                     /* live leases asked for by the issue */
#define FD_RESERVE 512                  /* fds kept for sockets, cached slabs, states, stdio */
#define BLOCKS 20                       /* rounds of a comparison: one block on each daemon */
#define BLOCK_PAIRS 100                 /* Alloc+Free round trips per block */
#define PAIRS (BLOCKS * BLOCK_PAIRS)    /* per daemon and comparison */
#define WARM_SLABS 16                   /* slabs cached before a measurement */
#define PIN_CPU 1                       /* the daemons' CPU during comparisons; the client's is 0 */
#define COMPARE_CAP_S 120.0             /* longest a comparison (both daemons) may run */
#define FILL_CAP_S 300.0                /* longest the holder may take to lease its N */
#define FILL_WINDOW 64                  /* Allocs the holder has in flight */
#define STORE_MAX 262144                /* FileDescriptorStoreMax= of vmmbroker.service */
#define READY_TIMEOUT_MS 120000
#define FLOOD_LEASES 5000               /* root's leases in the table while uid A floods */
#define FLOOD_CONNS 64                  /* the default per-user MaxConnections= */
#define FLOOD_WINDOW 32                 /* List calls in flight per flood connection */
#define FLOOD_WARMUP_MS 500
#define FLOOD_CAP_S 180                 /* the flood process ends itself after this */
#define STATUS_CALLS 500
#define STATUS_CAP_S 30.0               /* longest the Status measurement may run */
#define UID_A 65533                     /* floods List */
#define UID_B 65534                     /* measures Status */
#define VMMCTL_RUNS 5
#define CHILD_TIMEOUT_MS 60000

/* ---- bookkeeping: children, temporary files, the supervisors; all undone at exit ----------------------- */

enum { STORED_0, STORED_N, N_STORED };  /* the daemons under a supervisor */
static const char *const stored_tag[N_STORED] = { "0", "n" };

static pid_t children[16];
static Supervisor *supervisors[N_STORED];
static char tmpdir[64];

static void track(pid_t pid) {
        for (size_t i = 0; i < ELEMENTSOF(children); i++)
                if (children[i] <= 0) {
                        children[i] = pid;
                        return;
                }
}

static void untrack(pid_t pid) {
        for (size_t i = 0; i < ELEMENTSOF(children); i++)
                if (children[i] == pid)
                        children[i] = 0;
}

static void cleanup(void) {
        char path[128];

        /* Daemons before the holders: a holder's death makes a live daemon scrub (touch) all its slabs. */
        for (size_t i = 0; i < N_STORED; i++)
                supervisors[i] = supervisor_free(supervisors[i]);
        for (size_t i = 0; i < ELEMENTSOF(children); i++)
                if (children[i] > 0) {
                        kill(children[i], SIGKILL);
                        (void)waitpid(children[i], NULL, 0);
                }
        if (tmpdir[0]) {
                static const char *const files[] = { "vmmbroker.conf", "plain.sock", "stored-0.sock", "stored-n.sock",
                                                     "not-inherited-0", "not-inherited-n" };

                for (size_t i = 0; i < ELEMENTSOF(files); i++) {
                        snprintf(path, sizeof(path), "%s/%s", tmpdir, files[i]);
                        (void)unlink(path);
                }
                (void)rmdir(tmpdir);
        }
}

static _Noreturn _printf_(1, 2) void die(const char *fmt, ...) {
        va_list ap;

        fputs("bench-scale: ", stderr);
        va_start(ap, fmt);
        vfprintf(stderr, fmt, ap);
        va_end(ap);
        fputc('\n', stderr);
        exit(EXIT_FAILURE);
}

static _printf_(1, 2) void progress(const char *fmt, ...) {
        va_list ap;

        fputs("bench-scale: ", stderr);
        va_start(ap, fmt);
        vfprintf(stderr, fmt, ap);
        va_end(ap);
        fputc('\n', stderr);
}

/* A forked child running fn(arg), killed with us (harness_fork) and at exit (track). */
static pid_t spawn(int (*fn)(void *arg), void *arg) {
        pid_t pid = harness_fork(fn, arg);

        if (pid < 0)
                die("fork: %m");
        track(pid);
        return pid;
}

/* Waits at most timeout_ms for a child, then SIGKILLs it. Its status as a shell shows it; -ETIMEDOUT. */
static int wait_child(pid_t pid, int timeout_ms) {
        _cleanup_close_ int pidfd = pidfd_open(pid, 0);
        struct pollfd p = { .fd = pidfd, .events = POLLIN };
        int status, k = 1;

        if (pidfd >= 0)
                do
                        k = poll(&p, 1, timeout_ms);
                while (k < 0 && errno == EINTR);
        if (k == 0)
                kill(pid, SIGKILL);
        if (waitpid(pid, &status, 0) != pid)
                return -errno;
        untrack(pid);
        if (k == 0)
                return -ETIMEDOUT;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* Reads exactly len bytes from a pipe within timeout_ms in all. 0, -ETIMEDOUT, -EPIPE at EOF. */
static int read_deadline(int fd, void *buf, size_t len, int timeout_ms) {
        double deadline = now_us() + timeout_ms * 1e3;
        size_t got = 0;

        while (got < len) {
                struct pollfd p = { .fd = fd, .events = POLLIN };
                int left = (int)((deadline - now_us()) / 1e3), k;
                ssize_t n;

                if (left <= 0)
                        return -ETIMEDOUT;
                k = poll(&p, 1, left);
                if (k < 0 && errno == EINTR)
                        continue;
                if (k <= 0)
                        return k < 0 ? -errno : -ETIMEDOUT;
                n = read(fd, (char *)buf + got, len - got);
                if (n < 0 && errno == EINTR)
                        continue;
                if (n <= 0)
                        return n < 0 ? -errno : -EPIPE;
                got += (size_t)n;
        }
        return 0;
}

/* Blocks until the other end of the pipe is closed (or this process is killed). */
static void wait_eof(int fd) {
        char c;
        ssize_t n;

        do
                n = read(fd, &c, 1);
        while (n > 0 || (n < 0 && errno == EINTR));
}

/* Drops to uid (and the gid of that number, no groups) and ties this process to `parent` again
 * (a change of credentials clears PR_SET_PDEATHSIG). 0 or -errno. */
static int become(uid_t uid, pid_t parent) {
        if (setgroups(0, NULL) < 0 || setresgid(uid, uid, uid) < 0 || setresuid(uid, uid, uid) < 0)
                return -errno;
        if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0 || getppid() != parent)
                return -ESRCH;
        return 0;
}

/* ---- numbers ------------------------------------------------------------------------------------------- */

/* The p-th percentile (nearest rank) of v[0..n), sorted in place. */
static double percentile(double *v, size_t n, unsigned p) {
        size_t rank = (n * p + 99) / 100;

        qsort(v, n, sizeof(*v), cmp_double);
        return n == 0 ? NAN : v[rank > 0 ? rank - 1 : 0];
}

typedef struct Latency {
        double p50, p99;                /* microseconds */
        size_t n;                       /* round trips measured */
        bool capped;                    /* stopped by COMPARE_CAP_S before PAIRS */
        double messages;                /* notifications to the supervisor per 1,000 requests; NAN: none */
        double stored, removed;         /* fds it stored, and had removed, per 1,000 requests */
} Latency;

static Latency latency_of(double *t, size_t n, bool capped) {
        Latency l = { .n = n, .capped = capped, .messages = NAN, .stored = NAN, .removed = NAN };

        l.p99 = percentile(t, n, 99);
        l.p50 = percentile(t, n, 50);
        return l;
}

/* "/proc/PID/<file>"'s value in kB for `key` ("VmRSS:"), or -1. */
static long proc_kb(pid_t pid, const char *file, const char *key) {
        char path[64], line[256];
        long kb = -1;
        FILE *f;

        snprintf(path, sizeof(path), "/proc/%d/%s", (int)pid, file);
        f = fopen(path, "re");
        if (!f)
                return -1;
        while (kb < 0 && fgets(line, sizeof(line), f))
                if (strncmp(line, key, strlen(key)) == 0)
                        kb = strtol(line + strlen(key), NULL, 10);
        fclose(f);
        return kb;
}

/* The daemon's memory. Shared memory is left out: on the simulated device that is the device memory
 * itself (slabs the daemon mapped to scrub them), which a GPU would not count. */
typedef struct Memory {
        long anon_kb;                   /* RssAnon: its heap, stacks and other private memory */
        long pss_kb;                    /* Pss - Pss_Shmem */
} Memory;

static Memory memory_of(pid_t pid) {
        return (Memory){ proc_kb(pid, "status", "RssAnon:"),
                         proc_kb(pid, "smaps_rollup", "Pss:") - proc_kb(pid, "smaps_rollup", "Pss_Shmem:") };
}

/* ---- talking to the daemon ----------------------------------------------------------------------------- */

static VarlinkConn *connect_or_die(const char *socket) {
        VarlinkConn *c = NULL;
        int k = conn_open(socket, &c);

        if (k < 0)
                die("connect to %s: %s", socket, strerror(-k));
        return c;
}

/* Waits (polling Status, at most 60 s) until nothing is being scrubbed. */
static void wait_scrubbed(VarlinkConn *c) {
        double deadline = now_us() + 60e6;
        WireDevice d;
        int k;

        do {
                k = harness_status_on(c, &d);
                if (k < 0)
                        die("Status: %s", strerror(-k));
        } while (d.scrubbing > 0 && now_us() < deadline);
}

/* Leases WARM_SLABS slabs, frees them and waits for their scrubs: the next Allocs find them cached. */
static void warm_pool(VarlinkConn *c) {
        TestLease l[WARM_SLABS];
        int k;

        for (size_t i = 0; i < WARM_SLABS; i++) {
                k = lease_alloc(c, SLAB, &l[i]);
                if (k < 0)
                        die("warming the pool: Alloc: %s", strerror(-k));
                test_lease_close(&l[i]);
        }
        for (size_t i = 0; i < WARM_SLABS; i++)
                if ((k = lease_free(c, l[i].id)) < 0)
                        die("warming the pool: Free: %s", strerror(-k));
        wait_scrubbed(c);
}

/* One Alloc+Free round trip on `c`, in microseconds. */
static double round_trip(VarlinkConn *c) {
        double t0 = now_us();
        TestLease l;
        int k;

        k = lease_alloc(c, SLAB, &l);
        if (k < 0)
                die("Alloc: %s", strerror(-k));
        test_lease_close(&l);
        k = lease_free(c, l.id);
        if (k < 0)
                die("Free: %s", strerror(-k));
        return now_us() - t0;
}

/* ---- interleaved comparisons: two daemons, taking turns ---------------------------------------------------- */

/* One daemon's side of a comparison: its round trips, block by block, and what it sent its supervisor. */
typedef struct Side {
        VarlinkConn *c;
        pid_t pid;                      /* the daemon */
        Supervisor *s;                  /* its supervisor; NULL: no fd store, no notifications to count */
        double t[PAIRS];                /* every round trip, microseconds */
        size_t n;
        double block_p50[BLOCKS];
        size_t blocks;
        unsigned messages, stored, removed;     /* what its supervisor acted on during its blocks */
} Side;

/* A block of BLOCK_PAIRS round trips (fewer past the deadline), then its scrubs waited for, untimed. */
static void run_block(Side *x, double deadline) {
        SupervisorStats before = {}, after = {};
        double b[BLOCK_PAIRS];
        size_t n = 0;

        if (x->s)
                before = supervisor_stats(x->s);
        for (; n < BLOCK_PAIRS && now_us() < deadline; n++)
                x->t[x->n + n] = b[n] = round_trip(x->c);
        if (x->s) {
                after = supervisor_stats(x->s);
                x->messages += after.messages - before.messages;
                x->stored += after.fds_stored - before.fds_stored;
                x->removed += after.fds_removed - before.fds_removed;
        }
        wait_scrubbed(x->c);
        x->n += n;
        if (n > 0)
                x->block_p50[x->blocks++] = percentile(b, n, 50);
}

/* A side's pooled round trips, and its notifications per 1,000 requests where it has a supervisor. */
static Latency latency_of_side(Side *x) {
        Latency l = latency_of(x->t, x->n, x->n < PAIRS);
        double requests = 2.0 * (double)x->n;

        if (x->s && x->n > 0) {
                l.messages = x->messages * 1000.0 / requests;
                l.stored = x->stored * 1000.0 / requests;
                l.removed = x->removed * 1000.0 / requests;
        }
        return l;
}

typedef struct Comparison {
        Latency a, b;                   /* each side's pairs, pooled */
        size_t rounds;                  /* rounds in which both ran a block */
        double block_a, block_b;        /* the median of each side's block p50s */
        double ratio_min, ratio_median, ratio_max;      /* of a's block p50 / b's, round by round */
} Comparison;

/* Sets the affinity of every thread of `pid` (0: the calling thread alone). */
static void pin(pid_t pid, const cpu_set_t *set) {
        char path[64];
        struct dirent *de;
        DIR *d;

        if (pid == 0) {
                (void)sched_setaffinity(0, sizeof(*set), set);
                return;
        }
        snprintf(path, sizeof(path), "/proc/%d/task", (int)pid);
        d = opendir(path);
        while (d && (de = readdir(d)))
                if (de->d_name[0] != '.')
                        (void)sched_setaffinity((pid_t)atoi(de->d_name), sizeof(*set), set);
        if (d)
                closedir(d);
}

/* Warms both pools, then BLOCKS rounds of a block on each, the order alternating, within COMPARE_CAP_S. */
static Comparison compare(Side *a, Side *b) {
        Comparison r = {};
        double ratios[BLOCKS], deadline;
        cpu_set_t all, client, daemons;

        CPU_ZERO(&client);
        CPU_ZERO(&daemons);
        CPU_SET(0, &client);
        CPU_SET(PIN_CPU, &daemons);
        if (sched_getaffinity(0, sizeof(all), &all) < 0 || !CPU_ISSET(0, &all) || !CPU_ISSET(PIN_CPU, &all)) {
                progress("CPUs 0 and %d are not both ours: not pinned", PIN_CPU);
                daemons = client = all;
        }
        pin(0, &client);
        pin(a->pid, &daemons);
        pin(b->pid, &daemons);
        warm_pool(a->c);
        warm_pool(b->c);
        deadline = now_us() + COMPARE_CAP_S * 1e6;
        for (size_t i = 0; i < BLOCKS && now_us() < deadline; i++) {
                run_block(i % 2 ? b : a, deadline);
                run_block(i % 2 ? a : b, deadline);
        }
        pin(0, &all);                   /* as before: the daemons it starts later inherit it */
        pin(a->pid, &all);
        pin(b->pid, &all);
        r.rounds = a->blocks < b->blocks ? a->blocks : b->blocks;
        for (size_t i = 0; i < r.rounds; i++)
                ratios[i] = a->block_p50[i] / b->block_p50[i];
        r.ratio_median = r.rounds ? median(ratios, (unsigned)r.rounds) : NAN;     /* sorts them */
        r.ratio_min = r.rounds ? ratios[0] : NAN;
        r.ratio_max = r.rounds ? ratios[r.rounds - 1] : NAN;
        r.block_a = a->blocks ? median(a->block_p50, (unsigned)a->blocks) : NAN;
        r.block_b = b->blocks ? median(b->block_p50, (unsigned)b->blocks) : NAN;
        r.a = latency_of_side(a);
        r.b = latency_of_side(b);
        return r;
}

/* Every lease in the table (List all: true, as root). -errno on failure. */
static long count_leases(const char *socket) {
        ListReply list = {};
        long n;
        int k = list_get(socket, true, &list);

        if (k < 0)
                return k;
        n = (long)list.n_leases;
        list_reply_done(&list);
        return n;
}

/* ---- the holder: a child that leases n slabs and holds them until its hold pipe closes -------------------- */

typedef struct HolderArgs {
        const char *socket;
        unsigned n;
        int report_w, hold_r;
} HolderArgs;

/* Sends `count` Allocs of one slab, then takes their replies. How many succeeded, or -errno. */
static int alloc_batch(VarlinkConn *c, json_object *params, unsigned count) {
        int ok = 0, k;

        for (unsigned i = 0; i < count; i++) {
                _cleanup_(json_object_putp) json_object *msg = NULL;

                k = varlink_call_new(VMMB_METHOD_ALLOC, params, false, false, &msg);
                if (k < 0 || (k = varlink_conn_send(c, msg, NULL, 0)) < 0)
                        return k;
        }
        if ((k = varlink_conn_flush(c)) < 0)
                return k;
        for (unsigned i = 0; i < count; i++) {
                _cleanup_(json_object_putp) json_object *reply = NULL;
                VarlinkReply vr = {};
                int *fds = NULL;
                size_t n_fds = 0;

                k = varlink_conn_receive(c, &reply, &fds, &n_fds);
                if (k < 0)
                        return k;
                close_many(fds, n_fds);
                free(fds);
                if (varlink_reply_parse(reply, &vr) == 0 && !vr.error)
                        ok++;
                else if (ok == (int)i)          /* say why once */
                        fprintf(stderr, "holder: Alloc refused: %s\n", vr.error ?: "bad reply");
                varlink_reply_done(&vr);
        }
        return ok;
}

static int holder(void *arg) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        _cleanup_(json_object_putp) json_object *params = NULL;
        HolderArgs *a = arg;
        double deadline = now_us() + FILL_CAP_S * 1e6;
        unsigned done = 0;
        int k;

        CHILD_CHECK(close_all_but((const int[]){ a->report_w, a->hold_r }, 2) == 0, "close fds");
        k = conn_open(a->socket, &c);
        CHILD_CHECK(k == 0, "connect: %s", strerror(-k));
        k = alloc_params_encode(&(AllocParams){ .size = SLAB, .device = VMMB_DEVICE_ANY }, &params);
        CHILD_CHECK(k == 0, "encode");
        while (done < a->n && now_us() < deadline) {
                unsigned count = a->n - done < FILL_WINDOW ? a->n - done : FILL_WINDOW;

                k = alloc_batch(c, params, count);
                CHILD_CHECK(k >= 0, "Alloc: %s", strerror(-k));
                done += (unsigned)k;
                if ((unsigned)k < count)
                        break;
        }
        CHILD_CHECK(write(a->report_w, &done, sizeof(done)) == sizeof(done), "pipe");
        wait_eof(a->hold_r);            /* keeps its connection and its leases */
        return 0;
}

typedef struct Holder {
        pid_t pid;
        int hold_w;
        unsigned n;                     /* leases it holds */
        double seconds;                 /* it took to lease them */
} Holder;

/* Starts a holder of n leases and waits (at most FILL_CAP_S + 60 s) until it has them, or gave up. */
static Holder holder_start(const char *socket, unsigned n) {
        int report[2], hold[2];
        HolderArgs a = { .socket = socket, .n = n };
        Holder h = {};
        double t0 = now_us();
        int k;

        if (pipe2(report, O_CLOEXEC) < 0 || pipe2(hold, O_CLOEXEC) < 0)
                die("pipe: %m");
        a.report_w = report[1];
        a.hold_r = hold[0];
        h.pid = spawn(holder, &a);
        safe_close(report[1]);
        safe_close(hold[0]);
        h.hold_w = hold[1];
        k = read_deadline(report[0], &h.n, sizeof(h.n), (int)(FILL_CAP_S * 1000) + 60000);
        safe_close(report[0]);
        if (k < 0)
                die("the holder did not report its leases: %s", strerror(-k));
        h.seconds = (now_us() - t0) / 1e6;
        return h;
}

static void holder_finish(Holder *h) {
        h->hold_w = safe_close(h->hold_w);
        (void)wait_child(h->pid, CHILD_TIMEOUT_MS);
}

/* ---- the daemon without an fd store -------------------------------------------------------------------- */

typedef struct Plain {
        pid_t pid;
        char socket[108];
} Plain;

typedef struct DaemonArgs {
        const char *daemon, *socket, *config, *capacity;
} DaemonArgs;

/* In the child: the daemon as a user starts it by hand: no NOTIFY_SOCKET, FDSTORE or LISTEN_FDS, no other fds. */
static int plain_exec(void *arg) {
        DaemonArgs *a = arg;

        (void)close_all_but(NULL, 0);
        unsetenv("NOTIFY_SOCKET");
        unsetenv("FDSTORE");
        unsetenv("LISTEN_FDS");
        unsetenv("LISTEN_PID");
        execl(a->daemon, a->daemon, "--socket", a->socket, "--config", a->config, "--capacity", a->capacity,
              (char *)NULL);
        return 127;
}

/* Starts it and waits (at most 60 s, polling Status: it has no NOTIFY_SOCKET to say READY=1 on). */
static Plain plain_start(const char *daemon, const char *config, const char *capacity) {
        Plain p = {};
        DaemonArgs a = { daemon, p.socket, config, capacity };
        double deadline = now_us() + 60e6;
        WireDevice d;

        snprintf(p.socket, sizeof(p.socket), "%s/plain.sock", tmpdir);
        p.pid = spawn(plain_exec, &a);
        while (harness_status(p.socket, &d) < 0) {
                if (waitpid(p.pid, NULL, WNOHANG) == p.pid) {
                        untrack(p.pid);
                        die("the daemon without a store exited before it served");
                }
                if (now_us() > deadline)
                        die("the daemon without a store did not serve within 60 s");
                usleep(10000);
        }
        return p;
}

static void plain_stop(Plain *p) {
        double t0 = now_us();
        int k;

        kill(p->pid, SIGTERM);
        k = wait_child(p->pid, 30000);
        if (k != 0)
                progress("the daemon without a store did not exit cleanly on SIGTERM: %s after %.1f s",
                         k < 0 ? strerror(-k) : k > 128 ? strsignal(k - 128) : "exit status != 0",
                         (now_us() - t0) / 1e6);
        (void)unlink(p->socket);
}

/* ---- target 3: Status of uid B while uid A floods List ------------------------------------------------- */

typedef struct StatusArgs {
        const char *socket;
        pid_t parent;
        int report_w;
} StatusArgs;

/* As UID_B: STATUS_CALLS Status calls (at most STATUS_CAP_S) on one connection; reports n, then times. */
static int status_child(void *arg) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        StatusArgs *a = arg;
        double t[STATUS_CALLS], deadline;
        unsigned n = 0;
        int k;

        CHILD_CHECK(close_all_but(&a->report_w, 1) == 0, "close fds");
        CHILD_CHECK(become(UID_B, a->parent) == 0, "cannot become uid %d", UID_B);
        k = harness_conn_open(a->socket, false, &c);
        CHILD_CHECK(k == 0, "connect as uid %d: %s", UID_B, strerror(-k));
        deadline = now_us() + STATUS_CAP_S * 1e6;
        for (; n < STATUS_CALLS && now_us() < deadline; n++) {
                WireDevice d;
                double t0 = now_us();

                k = harness_status_on(c, &d);
                CHILD_CHECK(k == 0, "Status: %s", strerror(-k));
                t[n] = now_us() - t0;
        }
        CHILD_CHECK(write(a->report_w, &n, sizeof(n)) == sizeof(n), "pipe");
        CHILD_CHECK(write(a->report_w, t, n * sizeof(double)) == (ssize_t)(n * sizeof(double)), "pipe");
        return 0;
}

/* Status p99 as uid B; *ret_n: calls made (fewer than STATUS_CALLS: capped). NAN on failure. */
static double status_p99(const char *socket, unsigned *ret_n) {
        double t[STATUS_CALLS];
        int p[2], k;
        StatusArgs a = { .socket = socket, .parent = getpid() };
        pid_t pid;

        *ret_n = 0;
        if (pipe2(p, O_CLOEXEC) < 0)
                die("pipe: %m");
        a.report_w = p[1];
        pid = spawn(status_child, &a);
        safe_close(p[1]);
        k = read_deadline(p[0], ret_n, sizeof(*ret_n), (int)(STATUS_CAP_S * 1000) + 30000);
        if (k == 0 && *ret_n <= STATUS_CALLS)
                k = read_deadline(p[0], t, *ret_n * sizeof(double), 10000);
        safe_close(p[0]);
        if (wait_child(pid, CHILD_TIMEOUT_MS) != 0 || k < 0 || *ret_n == 0 || *ret_n > STATUS_CALLS)
                return NAN;
        return percentile(t, *ret_n, 99);
}

typedef struct FloodArgs {
        const char *socket;
        pid_t parent;
        int report_w, hold_r;
} FloodArgs;

typedef struct FloodReport {
        uint64_t replies;               /* List replies received */
        unsigned closed;                /* connections the daemon closed */
        double seconds;
} FloodReport;

static const char list_call[] = "{\"method\":\"" VMMB_METHOD_LIST "\",\"parameters\":{}}";
#define LIST_LEN sizeof(list_call)      /* its NUL included: the varlink frame */

typedef struct FloodConn {
        int fd;
        uint64_t written;               /* bytes of calls written */
        uint64_t replies;
} FloodConn;

/* Writes calls until FLOOD_WINDOW are unanswered or the socket is full. -1 when the daemon hung up. */
static int flood_write(FloodConn *f, const char *calls) {
        for (;;) {
                uint64_t want = (f->replies + FLOOD_WINDOW) * LIST_LEN, off = f->written % LIST_LEN;
                size_t len = want - f->written < FLOOD_WINDOW * LIST_LEN - off ? want - f->written
                                                                                 : FLOOD_WINDOW * LIST_LEN - off;
                ssize_t n;

                if (len == 0)
                        return 0;
                n = send(f->fd, calls + off, len, MSG_NOSIGNAL | MSG_DONTWAIT);
                if (n < 0)
                        return errno == EAGAIN || errno == EINTR ? 0 : -1;
                f->written += (uint64_t)n;
        }
}

/* Reads what came and counts the replies (one NUL each). -1 when the daemon hung up. */
static int flood_read(FloodConn *f) {
        static char buf[256 * 1024];
        ssize_t n = recv(f->fd, buf, sizeof(buf), MSG_DONTWAIT);

        if (n < 0)
                return errno == EAGAIN || errno == EINTR ? 0 : -1;
        if (n == 0)
                return -1;
        for (ssize_t i = 0; i < n; i++)
                f->replies += buf[i] == 0;
        return 0;
}

/* As UID_A: FLOOD_CONNS connections, each with FLOOD_WINDOW List calls in flight, until hold_r closes. */
static int flood_child(void *arg) {
        static FloodConn conns[FLOOD_CONNS];
        struct pollfd p[FLOOD_CONNS + 1];
        char calls[FLOOD_WINDOW * LIST_LEN];
        FloodArgs *a = arg;
        FloodReport r = {};
        double t0;
        char ready = 'r';

        CHILD_CHECK(close_all_but((const int[]){ a->report_w, a->hold_r }, 2) == 0, "close fds");
        CHILD_CHECK(become(UID_A, a->parent) == 0, "cannot become uid %d", UID_A);
        alarm(FLOOD_CAP_S);             /* whatever becomes of the parent */
        for (size_t i = 0; i < FLOOD_WINDOW; i++)
                memcpy(calls + i * LIST_LEN, list_call, LIST_LEN);
        for (size_t i = 0; i < FLOOD_CONNS; i++) {
                conns[i] = (FloodConn){ .fd = harness_connect(a->socket) };
                CHILD_CHECK(conns[i].fd >= 0, "connect as uid %d: %s", UID_A, strerror(-conns[i].fd));
        }
        CHILD_CHECK(write(a->report_w, &ready, 1) == 1, "pipe");
        t0 = now_us();
        for (;;) {
                size_t n = 0;

                for (size_t i = 0; i < FLOOD_CONNS; i++)
                        if (conns[i].fd >= 0 && flood_write(&conns[i], calls) < 0)
                                conns[i].fd = safe_close(conns[i].fd), r.closed++;
                for (size_t i = 0; i < FLOOD_CONNS; i++)
                        if (conns[i].fd >= 0)
                                p[n++] = (struct pollfd){ .fd = conns[i].fd, .events = POLLIN };
                p[n++] = (struct pollfd){ .fd = a->hold_r, .events = POLLIN };
                if (poll(p, n, 1000) < 0 && errno != EINTR)
                        break;
                if (p[n - 1].revents)
                        break;          /* the parent is done measuring */
                for (size_t i = 0; i < FLOOD_CONNS; i++)
                        if (conns[i].fd >= 0 && flood_read(&conns[i]) < 0)
                                conns[i].fd = safe_close(conns[i].fd), r.closed++;
        }
        r.seconds = (now_us() - t0) / 1e6;
        for (size_t i = 0; i < FLOOD_CONNS; i++)
                r.replies += conns[i].replies;
        CHILD_CHECK(write(a->report_w, &r, sizeof(r)) == sizeof(r), "pipe");
        return 0;
}

typedef struct Fairness {
        bool run;
        const char *why_not;
        double idle_p99, loaded_p99;    /* microseconds */
        unsigned idle_n, loaded_n;
        FloodReport flood;
} Fairness;

/* Status p99 of uid B while uid A floods: starts the flood, waits until it is going, measures, stops it. */
static void measure_loaded(const char *socket, Fairness *f) {
        int report[2], hold[2], k;
        FloodArgs a = { .socket = socket, .parent = getpid() };
        char ready;
        pid_t pid;

        if (pipe2(report, O_CLOEXEC) < 0 || pipe2(hold, O_CLOEXEC) < 0)
                die("pipe: %m");
        a.report_w = report[1];
        a.hold_r = hold[0];
        pid = spawn(flood_child, &a);
        safe_close(report[1]);
        safe_close(hold[0]);
        k = read_deadline(report[0], &ready, 1, 30000);
        if (k < 0)
                die("the flood did not start: %s", strerror(-k));
        usleep(FLOOD_WARMUP_MS * 1000);
        f->loaded_p99 = status_p99(socket, &f->loaded_n);
        safe_close(hold[1]);
        k = read_deadline(report[0], &f->flood, sizeof(f->flood), 30000);
        safe_close(report[0]);
        if (k < 0)
                progress("the flood did not report: %s", strerror(-k));
        (void)wait_child(pid, CHILD_TIMEOUT_MS);
}

static Fairness measure_fairness(const char *socket) {
        Fairness f = { .run = true };

        if (geteuid() != 0) {
                f.run = false;
                f.why_not = "not run: needs root to run clients as other uids";
                return f;
        }
        /* Other uids must reach the socket: the directory is 0755, the socket 0777 (the test's access
         * rule stands in for the vmmbroker group's). */
        if (chmod(tmpdir, 0755) < 0 || chmod(socket, 0777) < 0)
                die("chmod %s: %m", socket);
        f.idle_p99 = status_p99(socket, &f.idle_n);
        measure_loaded(socket, &f);
        return f;
}

/* ---- the daemon under the supervisor ------------------------------------------------------------------- */

/* Starts daemon `which` (STORED_0, STORED_N) under a supervisor of its own and waits for its READY=1. */
static Supervisor *stored_start(unsigned which, const char *daemon, const char *config, const char *capacity) {
        char socket[128], unused[128];
        Supervisor *s = NULL;
        int64_t ready;
        int k;

        snprintf(socket, sizeof(socket), "%s/stored-%s.sock", tmpdir, stored_tag[which]);
        snprintf(unused, sizeof(unused), "%s/not-inherited-%s", tmpdir, stored_tag[which]);
        k = supervisor_new(&(SupervisorOptions){
                                   .path = daemon,
                                   .argv = (const char *const[]){ daemon, "--socket", unused, "--config", config,
                                                                  "--capacity", capacity, NULL },
                                   .socket_path = socket,
                                   .fd_store_max = STORE_MAX,
                           }, &s);
        if (k < 0)
                die("supervisor_new: %s", strerror(-k));
        supervisors[which] = s;
        if ((k = supervisor_start(s)) < 0)
                die("supervisor_start: %s", strerror(-k));
        ready = supervisor_wait_ready(s, READY_TIMEOUT_MS);
        if (ready < 0)
                die("the daemon under the supervisor did not get ready: %s", strerror((int)-ready));
        return s;
}

typedef struct Restart {
        int64_t ready_us;               /* exec to READY=1; negative errno on failure */
        long listed;                    /* leases listed after it */
} Restart;

static Restart restart(Supervisor *s, int sig) {
        Restart r = { .ready_us = supervisor_restart(s, sig, READY_TIMEOUT_MS), .listed = -1 };

        if (r.ready_us >= 0)
                r.listed = count_leases(supervisor_socket_path(s));
        return r;
}

/* ---- target 6: vmmctl list --all ------------------------------------------------------------------------- */

typedef struct VmmctlArgs {
        const char *vmmctl, *socket;
} VmmctlArgs;

static int vmmctl_exec(void *arg) {
        VmmctlArgs *a = arg;
        int null = open("/dev/null", O_WRONLY | O_CLOEXEC);

        if (null < 0 || dup2(null, STDOUT_FILENO) < 0)
                return 127;
        setenv("VMMBROKER_SOCKET", a->socket, 1);
        execl(a->vmmctl, "vmmctl", "list", "--all", (char *)NULL);
        return 127;
}

/* Median milliseconds of VMMCTL_RUNS runs; NAN when one failed or took more than a minute. */
static double time_vmmctl(const char *vmmctl, const char *socket) {
        VmmctlArgs a = { vmmctl, socket };
        double t[VMMCTL_RUNS];

        for (size_t i = 0; i < VMMCTL_RUNS; i++) {
                double t0 = now_us();
                int status = wait_child(spawn(vmmctl_exec, &a), CHILD_TIMEOUT_MS);

                t[i] = (now_us() - t0) / 1e3;
                if (status != 0) {
                        progress("vmmctl list --all: %s", status < 0 ? strerror(-status) : "failed");
                        return NAN;
                }
        }
        return median(t, VMMCTL_RUNS);
}

/* ---- set-up ------------------------------------------------------------------------------------------------ */

/*
 * The live leases: N_MAX, or fewer where fds run out. The limit is per process, and this process raises
 * its soft limit to the hard one, which the daemons inherit. Daemon N holds 2 fds per live slab (its
 * exported fd and the simulator's memfd); this process holds 1 per slab stored by daemon N (its
 * supervisor's copy of the stored fd), and 1 per slab of daemon 0, which has only its warm pool. So the
 * bound is 2N + FD_RESERVE <= the hard limit, FD_RESERVE covering sockets, cached slabs, daemon 0's store
 * and stdio.
 */
static unsigned lease_count(char *why, size_t len) {
        struct rlimit rl;
        unsigned n;

        if (getrlimit(RLIMIT_NOFILE, &rl) < 0)
                die("getrlimit: %m");
        rl.rlim_cur = rl.rlim_max;
        (void)setrlimit(RLIMIT_NOFILE, &rl);
        n = rl.rlim_max > 2 * N_MAX + FD_RESERVE ? N_MAX : (unsigned)((rl.rlim_max - FD_RESERVE) / 2);
        snprintf(why, len,
                 "%s: hard RLIMIT_NOFILE %llu, per process; daemon N holds 2 fds per live slab (its exported fd "
                 "and the simulator's memfd), this process 1 (its supervisor's stored copy), daemon 0 a few "
                 "(no leases); %d kept for the rest",
                 n == N_MAX ? "the issue's 10,000" : "the most the fd limit allows", (unsigned long long)rl.rlim_max,
                 FD_RESERVE);
        return n;
}

static void write_config(const char *path, unsigned max_leases) {
        FILE *f = fopen(path, "we");

        if (!f)
                die("%s: %m", path);
        fprintf(f, "[Limits]\nMaxLeases=%u\nMaxBytes=100%%\n", max_leases);
        if (fclose(f) != 0)
                die("%s: %m", path);
}

static void print_header(unsigned n, const char *why) {
        struct utsname u;
        char line[256], model[256] = "unknown", date[64];
        time_t now = time(NULL);
        FILE *f = fopen("/proc/cpuinfo", "re");

        while (f && fgets(line, sizeof(line), f))
                if (strncmp(line, "model name", 10) == 0) {
                        char *v = strchr(line, ':');

                        snprintf(model, sizeof(model), "%s", v ? v + 2 : line);
                        model[strcspn(model, "\n")] = 0;
                        break;
                }
        if (f)
                fclose(f);
        uname(&u);
        strftime(date, sizeof(date), "%Y-%m-%d %H:%M:%S %Z", localtime(&now));
        printf("bench-scale: %s, kernel %s, %ld CPUs, %s\n", date, u.release, sysconf(_SC_NPROCESSORS_ONLN), model);
        printf("method: vmmbrokerd on the simulated device, raw varlink over AF_UNIX; round trip = Alloc 2 MiB + Free "
               "on one connection, warm pool; fd store = test supervisor, FileDescriptorStoreMax=%d\n", STORE_MAX);
        printf("targets 1, 2: the two daemons compared run side by side, interleaved: %d rounds of one block of %d "
               "round trips on each, order alternating (AB BA AB...), scrubs awaited between blocks; %d pairs per "
               "daemon pooled for p50/p99 (cap %.0f s per comparison); client pinned to CPU 0, daemons to CPU %d\n",
               BLOCKS, BLOCK_PAIRS, PAIRS, COMPARE_CAP_S, PIN_CPU);
        printf("N = %u live leases of 2 MiB, held by a child process (%s)\n\n", n, why);
}

/* ---- the report -------------------------------------------------------------------------------------------- */

#define ROW "%-38s %-9s %-18s %s\n"       /* what, target, verdict, measured */

/* One row: what, the measured value as text, the target as text, and the verdict (value <= limit). */
static void row(const char *what, const char *measured, const char *target, double value, double limit) {
        char verdict[64];

        if (isnan(value))
                snprintf(verdict, sizeof(verdict), "not measured");
        else if (value <= limit)
                snprintf(verdict, sizeof(verdict), "met");
        else if (limit > 0)
                snprintf(verdict, sizeof(verdict), "MISSED by %.0f%%", (value / limit - 1) * 100);
        else
                snprintf(verdict, sizeof(verdict), "MISSED (goal 0)");
        printf(ROW, what, target, verdict, measured);
}

/* A duration for a person: microseconds below 10 ms, else milliseconds. Rotating static buffers. */
static const char *dur(double us) {
        static char buf[8][32];
        static unsigned i;

        i = (i + 1) % 8;
        if (us < 10000)
                snprintf(buf[i], sizeof(buf[i]), "%.1f us", us);
        else
                snprintf(buf[i], sizeof(buf[i]), "%.1f ms", us / 1e3);
        return buf[i];
}

static const char *capped(const Latency *l) {
        static char buf[4][64];
        static unsigned i;

        i = (i + 1) % 4;
        if (!l->capped)
                return "";
        snprintf(buf[i], sizeof(buf[i]), " [capped: %zu of %d pairs in %.0f s]", l->n, PAIRS, COMPARE_CAP_S);
        return buf[i];
}

typedef struct Results {
        unsigned n;
        Holder held;
        Comparison leases;              /* target 1: a = daemon N with its leases, b = daemon 0 */
        Comparison store;               /* target 2: a = daemon 0 (the fd store), b = plain (none) */
        Fairness fair;
        unsigned fair_leases;
        Restart term, killed;
        Memory mem0, memN;
        double vmmctl_ms;
        const char *vmmctl_why;
} Results;

static void print_latency_rows(const Results *r) {
        const Latency *n = &r->leases.a, *zero = &r->leases.b, *stored = &r->store.a, *plain = &r->store.b;
        const Comparison *l = &r->leases;
        char m[256];

        snprintf(m, sizeof(m), "p50 %s with %u vs %s with 0: %.2fx%s%s", dur(n->p50), r->held.n, dur(zero->p50),
                 n->p50 / zero->p50, capped(n), capped(zero));
        row("1. Alloc+Free p50, N leases vs 0", m, "<= 1.2x", n->p50 / zero->p50, 1.2);
        snprintf(m, sizeof(m), "p99 %s with %u vs %s with 0: %.2fx%s%s", dur(n->p99), r->held.n, dur(zero->p99),
                 n->p99 / zero->p99, capped(n), capped(zero));
        row("1. Alloc+Free p99, N leases vs 0", m, "<= 1.2x", n->p99 / zero->p99, 1.2);
        snprintf(m, sizeof(m), "median of block p50s %s vs %s: %.2fx; per-round ratio min %.2fx, median %.2fx, "
                 "max %.2fx (%zu rounds)", dur(l->block_a), dur(l->block_b), l->block_a / l->block_b, l->ratio_min,
                 l->ratio_median, l->ratio_max, l->rounds);
        row("1. block p50s, N leases vs 0", m, "<= 1.2x", l->block_a / l->block_b, 1.2);
        snprintf(m, sizeof(m), "p50 %s with the store vs %s without: %.2fx (p99 %s vs %s; per-round p50 ratio "
                 "%.2fx-%.2fx)%s%s", dur(stored->p50), dur(plain->p50), stored->p50 / plain->p50, dur(stored->p99),
                 dur(plain->p99), r->store.ratio_min, r->store.ratio_max, capped(stored), capped(plain));
        row("2. Alloc+Free p50, fd store vs none", m, "<= 1.2x", stored->p50 / plain->p50, 1.2);
        snprintf(m, sizeof(m), "%.1f with 0 leases (%.1f fds stored, %.1f removed)", zero->messages, zero->stored,
                 zero->removed);
        row("2. notifications / 1,000 requests", m, "0", zero->messages, 0);
        snprintf(m, sizeof(m), "%.1f with %u leases (%.1f fds stored, %.1f removed)", n->messages, r->held.n,
                 n->stored, n->removed);
        row("2. notifications / 1,000 requests", m, "0", n->messages, 0);
}

static void print_fairness_row(const Results *r) {
        const Fairness *f = &r->fair;
        char m[256];

        if (!f->run) {
                printf(ROW, "3. Status p99, List flood vs idle", "<= 10x", "not run", f->why_not);
                return;
        }
        snprintf(m, sizeof(m), "p99 %s loaded (%u calls) vs %s idle (%u calls): %.1fx", dur(f->loaded_p99),
                 f->loaded_n, dur(f->idle_p99), f->idle_n, f->loaded_p99 / f->idle_p99);
        row("3. Status p99, List flood vs idle", m, "<= 10x", f->loaded_p99 / f->idle_p99, 10);
        printf("%-38s %-9s %-18s %u leases of root's in the table; uid %d: %d connections x %d List in flight: %.0f "
               "replies/s, %u connections closed%s\n", "", "", "", r->fair_leases, UID_A, FLOOD_CONNS, FLOOD_WINDOW,
               f->flood.seconds > 0 ? (double)f->flood.replies / f->flood.seconds : 0.0, f->flood.closed,
               f->loaded_n < STATUS_CALLS ? "; loaded Status stopped at its 30 s cap" : "");
}

static void print_restart_row(const char *what, const Restart *x, unsigned expected) {
        char m[256];

        if (x->ready_us < 0) {
                snprintf(m, sizeof(m), "no READY=1 within %d s: %s", READY_TIMEOUT_MS / 1000,
                         strerror((int)-x->ready_us));
                row(what, m, "<= 200 ms", INFINITY, 200);
                return;
        }
        snprintf(m, sizeof(m), "%.1f ms; %ld of %u leases listed after%s", x->ready_us / 1e3, x->listed, expected,
                 x->listed == (long)expected ? "" : " (LOST SOME)");
        row(what, m, "<= 200 ms", x->ready_us / 1e3, 200);
}

static void print_results(const Results *r) {
        char m[256];

        printf(ROW, "", "target", "verdict", "measured");
        print_latency_rows(r);
        print_fairness_row(r);
        print_restart_row("4. start to READY=1 after SIGTERM", &r->term, r->held.n);
        print_restart_row("4. start to READY=1 after SIGKILL", &r->killed, r->held.n);
        snprintf(m, sizeof(m), "%.2f kB RssAnon, %.2f kB Pss (RssAnon %ld -> %ld kB, Pss %ld -> %ld kB; no shmem)",
                 (double)(r->memN.anon_kb - r->mem0.anon_kb) / r->held.n,
                 (double)(r->memN.pss_kb - r->mem0.pss_kb) / r->held.n, r->mem0.anon_kb, r->memN.anon_kb,
                 r->mem0.pss_kb, r->memN.pss_kb);
        printf(ROW, "5. daemon memory per live lease", "(none)", "", m);
        if (r->vmmctl_why)
                snprintf(m, sizeof(m), "%s", r->vmmctl_why);
        else
                snprintf(m, sizeof(m), "%.1f ms (median of %d) with %u leases", r->vmmctl_ms, VMMCTL_RUNS,
                         r->held.n);
        printf(ROW, "6. vmmctl list --all", "(none)", "", m);
        printf("\nset-up: the holder leased its %u in %.1f s with the store on (%.0f Allocs/s, %d in flight; "
               "cap %.0f s)%s\n", r->held.n, r->held.seconds, r->held.n / r->held.seconds, FILL_WINDOW, FILL_CAP_S,
               r->held.n < r->n ? "; STOPPED SHORT of N: capped or refused" : "");
}

/* ---- the phases ---------------------------------------------------------------------------------------------- */

/* Target 2, then 3: daemon 0 against the plain daemon, both with 0 leases, interleaved; then fairness on the
 * plain daemon with FLOOD_LEASES in its table, after which it is stopped. Daemon 0 stays for target 1. */
static void phase_plain(const char *daemon, const char *config, const char *capacity, Results *r) {
        Plain p = plain_start(daemon, config, capacity);
        Supervisor *s0 = stored_start(STORED_0, daemon, config, capacity);
        Side stored = { .c = connect_or_die(supervisor_socket_path(s0)), .pid = supervisor_pid(s0), .s = s0 };
        Side plain = { .c = connect_or_die(p.socket), .pid = p.pid };
        Holder h;

        progress("fd store vs none, 0 leases: %d rounds of %d round trips on each, interleaved", BLOCKS, BLOCK_PAIRS);
        r->store = compare(&stored, &plain);
        stored.c = varlink_conn_free(stored.c);
        plain.c = varlink_conn_free(plain.c);
        progress("without a store: a holder leases %d slabs as root", FLOOD_LEASES);
        h = holder_start(p.socket, FLOOD_LEASES);
        r->fair_leases = h.n;
        progress("without a store: Status as uid %d, idle and while uid %d floods List", UID_B, UID_A);
        r->fair = measure_fairness(p.socket);
        plain_stop(&p);                 /* first: see phase_stored() */
        holder_finish(&h);
}

/* Daemon N: memory with 0 and N leases, round trips with N interleaved with daemon 0's (after which daemon 0
 * is stopped), vmmctl, restarts. */
static void phase_stored(const char *daemon, const char *config, const char *capacity, Results *r) {
        Supervisor *s0 = supervisors[STORED_0], *s = stored_start(STORED_N, daemon, config, capacity);
        const char *socket = supervisor_socket_path(s), *vmmctl = getenv("VMMCTL");
        Side n = { .c = connect_or_die(socket), .pid = supervisor_pid(s), .s = s };
        Side zero = { .c = connect_or_die(supervisor_socket_path(s0)), .pid = supervisor_pid(s0), .s = s0 };

        warm_pool(n.c);
        r->mem0 = memory_of(supervisor_pid(s));
        progress("daemon N: a holder leases %u slabs (at most %.0f s)", r->n, FILL_CAP_S);
        r->held = holder_start(socket, r->n);
        r->memN = memory_of(supervisor_pid(s));
        progress("daemon N: %u leases in %.1f s; against daemon 0: %d rounds of %d round trips on each, interleaved",
                 r->held.n, r->held.seconds, BLOCKS, BLOCK_PAIRS);
        r->leases = compare(&n, &zero);
        n.c = varlink_conn_free(n.c);
        zero.c = varlink_conn_free(zero.c);
        if (supervisor_stop(s0, SIGTERM) != 0)        /* it holds no leases: nothing to scrub */
                progress("daemon 0 did not exit cleanly on SIGTERM");
        supervisors[STORED_0] = supervisor_free(s0);
        if (!vmmctl)
                r->vmmctl_why = "not run: $VMMCTL is not set";
        else {
                progress("daemon N: vmmctl list --all, %d runs", VMMCTL_RUNS);
                r->vmmctl_ms = time_vmmctl(vmmctl, socket);
        }
        progress("daemon N: restart after SIGTERM, then after SIGKILL");
        r->term = restart(s, SIGTERM);
        r->killed = restart(s, SIGKILL);
        /* The daemon first: were the holder to go first, the daemon would scrub (touch) all N slabs. */
        if (supervisor_stop(s, SIGTERM) != 0)
                progress("daemon N did not exit cleanly on SIGTERM");
        supervisors[STORED_N] = supervisor_free(s);
        holder_finish(&r->held);
}

int main(int argc, char *argv[]) {
        const char *daemon = getenv("VMMBROKER_DAEMON");
        char why[512], config[128], capacity[32], simcuda[32];
        Results r = {};
        uint64_t gib;

        if (argc > 2 || (argc == 2 && strtoul(argv[1], NULL, 10) == 0)) {
                fprintf(stderr, "Usage: %s [N]\n", argv[0]);
                return EXIT_FAILURE;
        }
        if (!daemon || !getenv("VMMBROKER_LIBCUDA"))
                die("set VMMBROKER_DAEMON and VMMBROKER_LIBCUDA (meson test --benchmark does)");
        signal(SIGPIPE, SIG_IGN);
        r.n = lease_count(why, sizeof(why));
        if (argc == 2) {
                r.n = (unsigned)strtoul(argv[1], NULL, 10);
                snprintf(why, sizeof(why), "given on the command line");
        }
        atexit(cleanup);
        snprintf(tmpdir, sizeof(tmpdir), "/tmp/vmmb-scale-XXXXXX");
        if (!mkdtemp(tmpdir))
                die("mkdtemp: %m");

        /* Room for every lease at once, and the simulated device a little bigger. */
        gib = ((uint64_t)(r.n > FLOOD_LEASES ? r.n : FLOOD_LEASES) + 256) * SLAB / GiB + 1;
        snprintf(capacity, sizeof(capacity), "%" PRIu64 "G", gib);
        snprintf(simcuda, sizeof(simcuda), "%" PRIu64 "G", gib + 4);
        setenv("SIMCUDA_MEMORY", simcuda, 1);
        snprintf(config, sizeof(config), "%s/vmmbroker.conf", tmpdir);
        write_config(config, (r.n > FLOOD_LEASES ? r.n : FLOOD_LEASES) + 1024);
        print_header(r.n, why);
        fflush(stdout);

        phase_plain(daemon, config, capacity, &r);
        phase_stored(daemon, config, capacity, &r);
        print_results(&r);
        return EXIT_SUCCESS;
}
