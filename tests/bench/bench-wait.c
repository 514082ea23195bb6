/* SPDX-License-Identifier: MIT */

/*
 * bench-wait: how soon a waiting Alloc is served once the memory it needs comes back (issue 16's target:
 * within 1 ms, simulated device and GPU). It starts its own vmmbrokerd ($VMMBROKER_DAEMON) with a pool of
 * 4 slabs of 2 MiB (--capacity 8M) on whatever driver it loads (the simulated device in CI) and prints,
 * with the machine it ran on:
 *
 *   served after free   from just before a Free of one of the leases that fill the device is sent, to the
 *                       waiting Alloc's reply (2 MiB, wait_usec 10 s) read on another connection: the Free's
 *                       round trip, the scrub of the freed slab, the retry and the reply. Medians, p99 and
 *                       the worst of ROUNDS rounds; the target row says met or MISSED against p99.
 *
 * Each round: the device is full (4 leases on the filling connection), the waiting Alloc is sent and seen
 * queued (Status's waiters, polled), then the clock starts and one filling lease is freed. Then the served
 * lease is freed and the filling connection leases its slab again. One process, three connections.
 *
 * A program that prints, not a test. Usage: bench-wait [ROUNDS, default 500]
 */

#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <unistd.h>

#include "codec.h"
#include "harness.h"
#include "json.h"
#include "macro.h"
#include "rawclient.h"
#include "timing.h"
#include "varlink.h"

#define MiB (UINT64_C(1) << 20)
#define UNIT (2 * MiB)
#define N_UNITS 4
#define TARGET_US 1000.0

static _Noreturn void die(const char *what, int k) {
        fprintf(stderr, "bench-wait: %s: %s\n", what, strerror(k < 0 ? -k : k));
        exit(EXIT_FAILURE);
}

static void send_alloc_wait(VarlinkConn *c) {
        _cleanup_(json_object_putp) json_object *params = NULL, *msg = NULL;
        AllocParams a = { .size = UNIT, .device = VMMB_DEVICE_ANY, .wait_usec = 10 * 1000000 };
        int k;

        k = alloc_params_encode(&a, &params);
        if (k == 0)
                k = varlink_call_new(VMMB_METHOD_ALLOC, params, false, false, &msg);
        if (k == 0)
                k = varlink_conn_send(c, msg, NULL, 0);
        if (k == 0)
                k = varlink_conn_flush(c);
        if (k < 0)
                die("sending the waiting Alloc", k);
}

/* Reads the waiting Alloc's reply as a lease. */
static void read_lease(VarlinkConn *c, TestLease *ret) {
        _cleanup_(json_object_putp) json_object *msg = NULL;
        VarlinkReply vr = {};
        Reply r = {};
        int *fds = NULL;
        size_t n_fds = 0;
        int k;

        k = varlink_conn_receive(c, &msg, &fds, &n_fds);
        if (k < 0)
                die("reading the waiting Alloc's reply", k);
        k = varlink_reply_parse(msg, &vr);
        if (k < 0)
                die("parsing the waiting Alloc's reply", k);
        if (vr.error) {
                fprintf(stderr, "bench-wait: the waiting Alloc failed: %s\n", vr.error);
                exit(EXIT_FAILURE);
        }
        r.params = TAKE_PTR(vr.parameters);
        r.fds = fds;
        r.n_fds = n_fds;
        k = lease_take(&r, ret);
        reply_done(&r);
        varlink_reply_done(&vr);
        if (k < 0)
                die("taking the lease", k);
        test_lease_close(ret);
}

static void wait_queued(VarlinkConn *ctl) {
        WireDevice d = {};

        for (unsigned i = 0; i < 100000; i++) {
                int k = harness_status_on(ctl, &d);

                if (k < 0)
                        die("Status", k);
                if (d.waiters == 1)
                        return;
        }
        die("the Alloc never queued", -ETIMEDOUT);
}

int main(int argc, char *argv[]) {
        unsigned rounds = argc > 1 ? (unsigned)atoi(argv[1]) : 500;
        VarlinkConn *fill = NULL, *waiter = NULL, *ctl = NULL;
        TestLease filler[N_UNITS], got;
        char config[] = "/tmp/bench-wait-XXXXXX";
        double *lat;
        struct utsname u;
        Harness h;
        FILE *f;
        int fd, k;

        if (rounds < 1)
                rounds = 1;
        lat = calloc(rounds, sizeof(double));
        if (!lat)
                die("memory", -ENOMEM);
        uname(&u);
        printf("bench-wait: %s %s, %ld CPUs, driver %s\n", u.sysname, u.release, sysconf(_SC_NPROCESSORS_ONLN),
               getenv("VMMBROKER_LIBCUDA") ?: "libcuda.so.1");
        printf("method: %u rounds; a pool of %d slabs of 2 MiB, full; from just before a Free of one to the "
               "waiting 2 MiB Alloc's reply on another connection (Free round trip + scrub + retry + reply)\n",
               rounds, N_UNITS);

        fd = mkstemp(config);
        if (fd < 0 || !(f = fdopen(fd, "w")))
                die("writing the configuration", -errno);
        fputs("[Limits]\nMaxBytes=1G\n", f);
        fclose(f);
        k = harness_start(&h, (const char *const[]){ "--capacity", "8M", "--config", config, NULL });
        if (k < 0)
                die("starting vmmbrokerd", k);
        if ((k = conn_open(h.socket, &fill)) < 0 || (k = conn_open(h.socket, &waiter)) < 0 ||
            (k = conn_open(h.socket, &ctl)) < 0)
                die("connecting", k);
        for (unsigned i = 0; i < N_UNITS; i++) {
                k = lease_alloc(fill, UNIT, &filler[i]);
                if (k < 0)
                        die("filling the device", k);
                test_lease_close(&filler[i]);
        }

        for (unsigned r = 0; r < rounds; r++) {
                unsigned i = r % N_UNITS;
                double t0;

                send_alloc_wait(waiter);
                wait_queued(ctl);
                t0 = now_us();
                k = lease_free(fill, filler[i].id);
                if (k < 0)
                        die("freeing a filling lease", k);
                read_lease(waiter, &got);
                lat[r] = now_us() - t0;
                k = lease_free(waiter, got.id);
                if (k == 0)
                        k = lease_alloc(fill, UNIT, &filler[i]);
                if (k < 0)
                        die("filling the device again", k);
                test_lease_close(&filler[i]);
        }

        {
                double med = median(lat, rounds);       /* sorts lat */
                double p99 = lat[(size_t)((rounds - 1) * 0.99)], worst = lat[rounds - 1];

                printf("served after free: median %.1f us, p99 %.1f us, worst %.1f us\n", med, p99, worst);
                printf("target: a waiting Alloc is served within 1 ms of the memory it needs coming back "
                       "(p99 %.1f us <= %.0f us): %s\n", p99, TARGET_US, p99 <= TARGET_US ? "met" : "MISSED");
        }
        varlink_conn_free(fill);
        varlink_conn_free(waiter);
        varlink_conn_free(ctl);
        free(lat);
        k = harness_stop(&h);
        (void)unlink(config);
        return k == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
