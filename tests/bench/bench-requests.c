/* SPDX-License-Identifier: MIT */

/*
 * bench-requests: what one request costs the daemon, against what the machine costs without it, and how
 * many requests it serves. It starts its own vmmbrokerd ($VMMBROKER_DAEMON) on whatever driver it loads
 * (the simulated device in CI) and prints, with the CPU placement it used:
 *
 *   bare round trip   a NUL-terminated Status-sized call and its reply through an AF_UNIX stream socket to
 *                     a process that only echoes it: the floor of any request
 *   Status            the daemon's Status on an open connection, called and its reply read and decoded as the
 *                     client library does (status_call()) (target: <= 1.3x the bare round trip on the
 *                     same placement); both measured on the same CPUs, interleaved in blocks
 *   pairs/s           Alloc+Free pairs of 2 MiB per second from 1, 8 and 32 client processes at once, each on
 *                     its own connection (goal: 50,000 from 32 clients on a 2-core machine)
 *   churn             after 1,000 Alloc+Free cycles of one size, the pool's cached + leased + scrubbing
 *                     bytes and the slabs it created (target: within one slab of what is leased)
 *
 * A program that prints, not a test. Usage: bench-requests [SECONDS per pairs/s run, default 2]
 */

#include <errno.h>
#include <inttypes.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include "codec.h"
#include "harness.h"
#include "macro.h"
#include "rawclient.h"
#include "timing.h"
#include "varlink.h"

#define MiB (UINT64_C(1) << 20)
#define BLOCKS 20
#define PER_BLOCK 100

static _Noreturn void die(const char *what, int k) {
        fprintf(stderr, "bench-requests: %s: %s\n", what, strerror(k < 0 ? -k : k));
        exit(EXIT_FAILURE);
}

static void pin(pid_t pid, int cpu) {
        cpu_set_t set;

        CPU_ZERO(&set);
        CPU_SET(cpu, &set);
        (void)sched_setaffinity(pid, sizeof(set), &set);
}

/* ---- the bare round trip: an echo process over an AF_UNIX stream socket ------------------------------- */

static int echo_fd = -EBADF;
static pid_t echo_pid;

static void echo_start(int cpu) {
        int sv[2];

        if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0)
                die("socketpair", -errno);
        echo_pid = fork();
        if (echo_pid < 0)
                die("fork", -errno);
        if (echo_pid == 0) {
                char buf[4096];
                ssize_t n;

                close(sv[0]);
                pin(0, cpu);
                /* Echo every message back as soon as its NUL is in: one write per read, as a server does. */
                while ((n = read(sv[1], buf, sizeof(buf))) > 0)
                        if (write(sv[1], buf, (size_t)n) != n)
                                break;
                _exit(0);
        }
        close(sv[1]);
        echo_fd = sv[0];
}

static double bare_round_trip(const char *msg, size_t len) {
        char buf[4096];
        double t0 = now_us();
        size_t got = 0;

        if (write(echo_fd, msg, len) != (ssize_t)len)
                die("write", -errno);
        while (got < len) {
                ssize_t n = read(echo_fd, buf, sizeof(buf));

                if (n <= 0)
                        die("read", n < 0 ? -errno : -EPIPE);
                got += (size_t)n;
        }
        return now_us() - t0;
}

/* A Status as the client library calls and reads (status_call()), its reply decoded. */
static double status_round_trip(VarlinkConn *c) {
        double t0 = now_us();
        StatusReply s;
        int k = status_call(c, &s);

        if (k < 0)
                die("Status", k);
        status_reply_done(&s);
        return now_us() - t0;
}

/* Status against the bare round trip, interleaved in blocks so that drift touches both alike. */
static void compare_status(const char *socket, int client_cpu, int server_cpu, pid_t daemon, const char *placement) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        static const char msg[] = "{\"method\":\"io.vmmbroker.Status\",\"parameters\":{}}";
        double bare[BLOCKS * PER_BLOCK], st[BLOCKS * PER_BLOCK], mb, ms;
        size_t n = 0;
        int k;

        pin(0, client_cpu);
        pin(daemon, server_cpu);
        echo_start(server_cpu);
        k = conn_open(socket, &c);
        if (k < 0)
                die("connect", k);
        for (unsigned b = 0; b < BLOCKS; b++) {
                for (unsigned i = 0; i < PER_BLOCK; i++) {
                        bare[n] = bare_round_trip(msg, sizeof(msg));    /* the NUL ends it, as varlink's */
                        st[n] = status_round_trip(c);
                        n++;
                }
        }
        mb = median(bare, (unsigned)n);
        ms = median(st, (unsigned)n);
        printf("%-34s bare round trip %7.1f us, Status %7.1f us: %.2fx (target <= 1.3x) %s\n", placement, mb, ms,
               ms / mb, ms / mb <= 1.3 ? "met" : "MISSED");
        close(echo_fd);
        (void)waitpid(echo_pid, NULL, 0);
}

/* ---- pairs per second from n processes ------------------------------------------------------------------ */

static double pairs_per_second(const char *socket, unsigned n, double seconds) {
        uint64_t *counts = mmap(NULL, n * sizeof(uint64_t), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                                -1, 0);
        uint64_t total = 0;
        pid_t pids[64];
        int go[2];

        if (counts == MAP_FAILED || n > ELEMENTSOF(pids) || pipe(go) < 0)
                die("set-up", -errno);
        for (unsigned i = 0; i < n; i++) {
                pids[i] = fork();
                if (pids[i] < 0)
                        die("fork", -errno);
                if (pids[i] == 0) {
                        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
                        double end;
                        char x;

                        close(go[1]);
                        if (conn_open(socket, &c) < 0)
                                _exit(1);
                        if (read(go[0], &x, 1) < 0)
                                _exit(1);
                        end = now_us() + seconds * 1e6;
                        while (now_us() < end) {
                                TestLease l;

                                if (lease_alloc(c, 2 * MiB, &l) < 0)
                                        _exit(2);
                                test_lease_close(&l);
                                if (lease_free(c, l.id) < 0)
                                        _exit(3);
                                counts[i]++;
                        }
                        _exit(0);
                }
        }
        close(go[0]);
        close(go[1]);                   /* every child's read returns: they start together */
        for (unsigned i = 0; i < n; i++) {
                int status;

                if (waitpid(pids[i], &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
                        die("a client failed", -EPROTO);
                total += counts[i];
        }
        munmap(counts, n * sizeof(uint64_t));
        return (double)total / seconds;
}

/* ---- churn ---------------------------------------------------------------------------------------------- */

static void churn(const char *socket) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        WireDevice d;
        int k;

        k = conn_open(socket, &c);
        if (k < 0)
                die("connect", k);
        for (unsigned i = 0; i < 1000; i++) {
                TestLease l;

                k = lease_alloc(c, 64 * MiB, &l);
                if (k < 0)
                        die("Alloc", k);
                test_lease_close(&l);
                k = lease_free(c, l.id);
                if (k < 0)
                        die("Free", k);
        }
        k = harness_status_on(c, &d);
        if (k < 0)
                die("Status", k);
        printf("churn: after 1,000 Alloc+Free of 64 MiB: leased %" PRIu64 " MiB, cached %" PRIu64 " MiB, "
               "scrubbing %" PRIu64 " MiB: %s (target: within one 64 MiB slab of what is leased)\n",
               d.leased / MiB, d.cached / MiB, d.scrubbing / MiB,
               d.cached + d.scrubbing + d.leased <= 64 * MiB ? "met" : "MISSED");
}

int main(int argc, char *argv[]) {
        double seconds = argc > 1 ? atof(argv[1]) : 2.0;
        long cpus = sysconf(_SC_NPROCESSORS_ONLN);
        struct utsname u;
        Harness h;
        int k;

        uname(&u);
        printf("bench-requests: %s %s, %ld CPUs, driver %s\n", u.sysname, u.release, cpus,
               getenv("VMMBROKER_LIBCUDA") ?: "libcuda.so.1");
        printf("method: medians of %d interleaved blocks of %d round trips; Status as the client library calls "
               "and reads it (the call written as text, the reply read as text and decoded into a StatusReply); "
               "pairs/s: 2 MiB Alloc+Free pairs from N processes for %.1f s each, one connection each\n", BLOCKS,
               PER_BLOCK, seconds);
        k = harness_start(&h, NULL);
        if (k < 0)
                die("starting vmmbrokerd", k);
        compare_status(h.socket, 0, 0, h.pid, "same core (client, server on CPU 0)");
        if (cpus > 1)
                compare_status(h.socket, 0, 1, h.pid, "two cores (client 0, server 1)");
        {
                cpu_set_t all;

                CPU_ZERO(&all);
                for (long i = 0; i < cpus && i < CPU_SETSIZE; i++)
                        CPU_SET(i, &all);
                (void)sched_setaffinity(0, sizeof(all), &all);
                (void)sched_setaffinity(h.pid, sizeof(all), &all);
        }
        churn(h.socket);                /* first: the pool holds nothing else yet */
        for (unsigned n = 1; n <= 32; n *= n == 1 ? 8 : 4)
                printf("pairs/s from %2u clients: %9.0f%s\n", n, pairs_per_second(h.socket, n, seconds),
                       n == 32 ? " (goal 50,000 on a 2-core machine)" : "");
        k = harness_stop(&h);
        return k == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
