/* SPDX-License-Identifier: MIT */

/*
 * bench-tenant: the target of the issue "tenant safety, second round", printed:
 *
 *   While one uid holds 10x its connection limit and reconnects as fast as it can, another uid's Status
 *   succeeds every time, p99 <= 10x its idle p99.
 *
 * It starts its own vmmbrokerd ($VMMBROKER_DAEMON, on the simulated device through $VMMBROKER_LIBCUDA or
 * on a GPU) with [Broker] MaxConnectionsTotal=256 (a daemon that does not know the key is run without it,
 * and the output says so) and the default [Limits] (MaxConnections=64). Then, as uid 65533 (the victim):
 *
 *   idle         500 Status round trips on one connection, nothing else running;
 *   under flood  while uid 65534 (the attacker, one process with poll) holds 640 silent connections and
 *                reopens each one the daemon closes at once: 500 Status round trips on one connection
 *                opened during the flood (a call that fails counts as a failure; the victim reconnects),
 *                then 200 Status calls each on a fresh connection (what a new client of the victim's
 *                meets: the lockout the issue is about).
 *
 * The target compares the p99s of the first two; the fresh-connection line is reported beside it, its
 * failures count as failures of the target. Every phase is bounded in time (60 s; a phase that runs past
 * it stops and the calls it did not make count as failures). A program that prints, not a test: it exits
 * 0 whether or not the target is met, 1 when it could not measure (not root, no daemon).
 *
 * Usage: bench-tenant [CONNECTIONS]   (the attacker's connections; 640 by default. 4200 is the attack on
 *        the daemon before MaxConnectionsTotal=, whose fixed table of 4,096 refused connections filled.)
 */

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include "codec.h"
#include "harness.h"
#include "macro.h"
#include "rawclient.h"
#include "timing.h"

#define UID_VICTIM 65533
#define UID_ATTACKER 65534
#define MAX_CONNECTIONS 64              /* [Limits] MaxConnections= by default */
#define FLOOD_DEFAULT (10 * MAX_CONNECTIONS)
#define N_CALLS 500
#define N_FRESH 200
#define PHASE_S 60.0                    /* bound on each phase */
#define TARGET_RATIO 10.0

static _Noreturn void die(const char *what, int k) {
        fprintf(stderr, "bench-tenant: %s: %s\n", what, strerror(k < 0 ? -k : k));
        exit(EXIT_FAILURE);
}

static int become(uid_t uid) {
        if (setgroups(0, NULL) < 0 || setresgid(uid, uid, uid) < 0 || setresuid(uid, uid, uid) < 0)
                return -errno;
        return 0;
}

/* ---- the attacker ------------------------------------------------------------------------------- */

typedef struct FloodStats {
        unsigned opened;                /* open when it reported ready */
        uint64_t connects, closed, backlog_full;
        double seconds;                 /* from ready to stop */
        char error[128];
} FloodStats;

static int flood_connect(const struct sockaddr_un *sa, uint64_t *backlog_full) {
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);

        if (fd < 0)
                return -errno;
        if (connect(fd, (const struct sockaddr *)sa, sizeof(*sa)) < 0) {
                int k = -errno;

                close(fd);
                if (k == -EAGAIN || k == -ECONNREFUSED)
                        (*backlog_full)++;
                return k;
        }
        return fd;
}

/*
 * Holds n_flood silent connections and reopens each one the daemon closes, at once, until stop_r closes.
 * Writes FloodStats to report_w when every connection was opened once (or after 30 s), and at the end.
 */
static unsigned n_flood = FLOOD_DEFAULT;     /* the attacker's connections */

static int flood_main(const char *socket_path, int report_w, int stop_r) {
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        _cleanup_free_ struct pollfd *pfd = calloc(n_flood + 1, sizeof(struct pollfd));
        struct rlimit rl;
        FloodStats st = {};
        bool reported = false;
        double start = now_us(), ready = 0;
        char buf[4096];

        snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", socket_path);
        if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
                rl.rlim_cur = rl.rlim_max;
                (void)setrlimit(RLIMIT_NOFILE, &rl);
        }
        if (!pfd || rl.rlim_cur < n_flood + 64) {
                snprintf(st.error, sizeof(st.error), "%s", pfd ? "RLIMIT_NOFILE is too low" : "out of memory");
                (void)write(report_w, &st, sizeof(st));
                return 1;
        }
        for (unsigned i = 0; i < n_flood; i++)
                pfd[i] = (struct pollfd){ .fd = -1, .events = POLLIN | POLLRDHUP };
        pfd[n_flood] = (struct pollfd){ .fd = stop_r, .events = POLLIN };
        for (;;) {
                unsigned open = 0;
                int k;

                for (unsigned i = 0; i < n_flood; i++) {
                        if (pfd[i].fd < 0) {
                                k = flood_connect(&sa, &st.backlog_full);
                                if (k >= 0) {
                                        pfd[i].fd = k;
                                        st.connects++;
                                } else if (k != -EAGAIN && k != -ECONNREFUSED && !st.error[0])
                                        snprintf(st.error, sizeof(st.error), "connect: %s", strerror(-k));
                        }
                        open += pfd[i].fd >= 0;
                }
                if (!reported && (open == n_flood || now_us() - start > 30e6)) {
                        st.opened = open;
                        if (write(report_w, &st, sizeof(st)) != (ssize_t)sizeof(st))
                                return 1;
                        reported = true;
                        ready = now_us();
                }
                /* all open: wait for a close; a full backlog: try again after 10 ms */
                k = poll(pfd, n_flood + 1, open == n_flood ? 60000 : 10);
                if (k < 0 && errno != EINTR)
                        return 1;
                if (pfd[n_flood].revents)
                        break;
                for (unsigned i = 0; k > 0 && i < n_flood; i++) {
                        bool hup;
                        ssize_t n;

                        if (pfd[i].fd < 0 || !pfd[i].revents)
                                continue;
                        hup = pfd[i].revents & (POLLHUP | POLLRDHUP | POLLERR);
                        n = recv(pfd[i].fd, buf, sizeof(buf), MSG_DONTWAIT);
                        if (!hup && (n > 0 || (n < 0 && errno == EAGAIN)))
                                continue;
                        close(pfd[i].fd);
                        pfd[i].fd = -1;
                        st.closed++;
                }
        }
        for (unsigned i = 0; i < n_flood; i++)
                if (pfd[i].fd >= 0)
                        close(pfd[i].fd);
        st.seconds = ready > 0 ? (now_us() - ready) / 1e6 : 0;
        return write(report_w, &st, sizeof(st)) == (ssize_t)sizeof(st) ? 0 : 1;
}

/* ---- the victim --------------------------------------------------------------------------------- */

typedef struct Phase {
        unsigned n;                     /* calls asked for */
        bool fresh;                     /* each on a new connection */
} Phase;

typedef struct PhaseResult {
        unsigned done, failed;          /* calls answered with success; calls that failed or were not made */
        double us[N_CALLS];             /* round trips of the successful calls (connect included when fresh) */
        char first_failure[200];
} PhaseResult;

static void fail(PhaseResult *r, const char *what, int k, const char *error) {
        if (!r->failed)
                snprintf(r->first_failure, sizeof(r->first_failure), "%s: %s", what, k < 0 ? strerror(-k) : error);
        r->failed++;
}

static void victim_phase(const char *socket_path, const Phase *p, PhaseResult *r) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        double deadline = now_us() + PHASE_S * 1e6;
        unsigned i;

        *r = (PhaseResult){};
        for (i = 0; i < p->n && now_us() < deadline; i++) {
                double t = now_us();
                WireDevice d;
                int k = 0;

                if (p->fresh || !c) {
                        c = varlink_conn_free(c);
                        k = harness_conn_open(socket_path, false, &c);
                        if (k < 0) {
                                fail(r, "connect", k, NULL);
                                continue;
                        }
                        if (!p->fresh)
                                t = now_us();   /* one connection: its opening is not a round trip */
                }
                k = harness_status_on(c, &d);
                if (k < 0) {
                        fail(r, "Status", k, k == -EREMOTEIO ? "an error reply" : NULL);
                        c = varlink_conn_free(c);
                        continue;
                }
                r->us[r->done++] = now_us() - t;
        }
        if (i < p->n)
                fail(r, "the phase's time bound", 0, "calls not made");
        r->failed += p->n - i - (i < p->n ? 1 : 0);
}

/* Runs one phase in a child of uid UID_VICTIM and returns its result. */
static void victim_run(const char *socket_path, Phase p, PhaseResult *ret) {
        int fds[2];
        pid_t pid;
        int k;

        if (pipe2(fds, O_CLOEXEC) < 0)
                die("pipe", errno);
        pid = fork();
        if (pid < 0)
                die("fork", errno);
        if (pid == 0) {
                static PhaseResult r;

                close(fds[0]);
                if (become(UID_VICTIM) < 0)
                        _exit(1);
                victim_phase(socket_path, &p, &r);
                _exit(write(fds[1], &r, sizeof(r)) == (ssize_t)sizeof(r) ? 0 : 1);
        }
        close(fds[1]);
        /* pipe_get waits at most IO_TIMEOUT_S for each read; the phase is bounded by PHASE_S plus one call's
         * socket timeout */
        k = -ETIMEDOUT;
        for (int i = 0; i < 4 && k == -ETIMEDOUT; i++)
                k = pipe_get_all(fds[0], ret, sizeof(*ret));
        close(fds[0]);
        if (k < 0) {
                kill(pid, SIGKILL);
                (void)harness_wait(pid);
                die("the victim's phase", k);
        }
        (void)harness_wait(pid);
}

static double percentile(double *v, unsigned n, double q) {
        unsigned i;

        if (n == 0)
                return 0;
        qsort(v, n, sizeof(*v), cmp_double);
        i = (unsigned)(q * n + 0.999999);
        return v[(i > 0 ? i : 1) - 1];
}

int main(int argc, char **argv) {
        static PhaseResult idle, flood_one, flood_fresh;
        char config[] = "/tmp/vmmb-bench-tenant-XXXXXX";
        const char *const args[] = { "--config", config, NULL };
        const char *table = "[Broker] MaxConnectionsTotal=256";
        double p99_idle, p99_flood, p50_idle, p50_flood, p99_fresh, p50_fresh, ratio;
        unsigned failures;
        struct utsname u;
        FloodStats ready, st;
        int report[2], stop[2], fd, k;
        Harness h;
        pid_t attacker;
        FILE *f;

        if (argc > 1) {
                char *end;
                unsigned long n = strtoul(argv[1], &end, 10);

                if (*end || n < 1 || n > 100000) {
                        fprintf(stderr, "Usage: bench-tenant [CONNECTIONS]   (1-100000, default %d)\n", FLOOD_DEFAULT);
                        return EXIT_FAILURE;
                }
                n_flood = (unsigned)n;
        }
        (void)signal(SIGPIPE, SIG_IGN);
        if (geteuid() != 0) {
                fprintf(stderr, "bench-tenant: needs root, to run the two users' clients as uids %d and %d\n",
                        UID_VICTIM, UID_ATTACKER);
                return EXIT_FAILURE;
        }
        fd = mkstemp(config);
        if (fd < 0 || !(f = fdopen(fd, "w")))
                die("config file", errno);
        fputs("[Broker]\nMaxConnectionsTotal=256\n", f);
        if (fclose(f) != 0)
                die("config file", errno);
        k = harness_start(&h, args);
        if (k == -ECHILD) {
                table = "the daemon's own table (it refused MaxConnectionsTotal=: an older daemon)";
                k = harness_start(&h, NULL);
        }
        (void)unlink(config);
        if (k < 0)
                die("starting vmmbrokerd", k);
        if (chmod(h.dir, 0711) < 0 || chmod(h.socket, 0666) < 0)
                die("chmod", errno);

        /* idle */
        victim_run(h.socket, (Phase){ .n = N_CALLS }, &idle);

        /* the flood */
        if (pipe2(report, O_CLOEXEC) < 0 || pipe2(stop, O_CLOEXEC) < 0)
                die("pipe", errno);
        attacker = fork();
        if (attacker < 0)
                die("fork", errno);
        if (attacker == 0) {
                close(report[0]);
                close(stop[1]);
                if (become(UID_ATTACKER) < 0)
                        _exit(1);
                _exit(flood_main(h.socket, report[1], stop[0]));
        }
        close(report[1]);
        close(stop[0]);
        k = pipe_get_all(report[0], &ready, sizeof(ready));
        if (k < 0 || ready.error[0]) {
                kill(attacker, SIGKILL);
                (void)harness_wait(attacker);
                fprintf(stderr, "bench-tenant: the flood did not start: %s\n", k < 0 ? strerror(-k) : ready.error);
                (void)harness_stop(&h);
                return EXIT_FAILURE;
        }
        victim_run(h.socket, (Phase){ .n = N_CALLS }, &flood_one);
        victim_run(h.socket, (Phase){ .n = N_FRESH, .fresh = true }, &flood_fresh);
        close(stop[1]);
        k = pipe_get_all(report[0], &st, sizeof(st));
        close(report[0]);
        if (k < 0) {
                kill(attacker, SIGKILL);
                st = (FloodStats){};
        }
        (void)harness_wait(attacker);
        k = harness_stop(&h);

        p50_idle = percentile(idle.us, idle.done, 0.50);
        p99_idle = percentile(idle.us, idle.done, 0.99);
        p50_flood = percentile(flood_one.us, flood_one.done, 0.50);
        p99_flood = percentile(flood_one.us, flood_one.done, 0.99);
        p50_fresh = percentile(flood_fresh.us, flood_fresh.done, 0.50);
        p99_fresh = percentile(flood_fresh.us, flood_fresh.done, 0.99);
        ratio = p99_idle > 0 ? p99_flood / p99_idle : 0;
        failures = flood_one.failed + flood_fresh.failed;

        if (uname(&u) < 0)
                die("uname", errno);
        printf("bench-tenant: one uid floods the daemon with connections; another's Status\n");
        printf("machine: %s %s %s, %ld CPUs online\n", u.sysname, u.release, u.machine, sysconf(_SC_NPROCESSORS_ONLN));
        printf("method: vmmbrokerd (%s) with %s and the default [Limits] (MaxConnections=%d);\n"
               "        uid %d: Status round trips, %d on one connection idle, then %d on one connection opened\n"
               "        during the flood and %d each on a fresh connection; uid %d: one process holding %u silent\n"
               "        connections and reopening each one the daemon closes at once (poll); phases bounded to %.0f s\n",
               getenv("VMMBROKER_LIBCUDA") ? "simulated device" : "the system's driver", table, MAX_CONNECTIONS,
               UID_VICTIM, N_CALLS, N_CALLS, N_FRESH, UID_ATTACKER, n_flood, PHASE_S);
        printf("idle          %4u of %u served  p50 %8.1f us  p99 %8.1f us  (failures %u)\n", idle.done, N_CALLS,
               p50_idle, p99_idle, idle.failed);
        printf("under flood   %4u of %u served  p50 %8.1f us  p99 %8.1f us  (failures %u%s%s)\n", flood_one.done,
               N_CALLS, p50_flood, p99_flood, flood_one.failed, flood_one.failed ? "; first: " : "",
               flood_one.first_failure);
        printf("fresh conns   %4u of %u served  p50 %8.1f us  p99 %8.1f us  (failures %u%s%s; connect included)\n",
               flood_fresh.done, N_FRESH, p50_fresh, p99_fresh, flood_fresh.failed,
               flood_fresh.failed ? "; first: " : "", flood_fresh.first_failure);
        printf("flood         %u of %u open at first; %" PRIu64 " connects, %" PRIu64 " closed by the daemon, %" PRIu64
               " backlog-full retries in %.1f s (%.0f reconnects/s)%s%s\n",
               ready.opened, n_flood, st.connects, st.closed, st.backlog_full, st.seconds,
               st.seconds > 0 ? (double)st.closed / st.seconds : 0, st.error[0] ? "; " : "", st.error);
        printf("p99 under flood / idle p99: %.2f (target <= %.0f); failures under flood: %u (target 0)\n", ratio,
               TARGET_RATIO, failures);
        if (failures == 0 && idle.failed == 0 && ratio <= TARGET_RATIO)
                printf("target: met\n");
        else if (failures > 0 || idle.failed > 0)
                printf("target: MISSED: %u of %u calls under the flood failed%s\n", failures, N_CALLS + N_FRESH,
                       ratio > TARGET_RATIO ? " and the p99 is over" : "");
        else
                printf("target: MISSED by %.0f%% (p99 %.1f us against %.1f us allowed)\n",
                       (ratio / TARGET_RATIO - 1) * 100, p99_flood, TARGET_RATIO * p99_idle);
        if (k != 0)
                printf("note: the daemon exited with %d at the end\n", k);
        return EXIT_SUCCESS;
}
