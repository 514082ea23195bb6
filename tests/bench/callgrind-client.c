/* SPDX-License-Identifier: MIT */

/*
 * callgrind-client: the client side of tests/bench/callgrind-requests.sh, which runs it (and the daemon)
 * under valgrind --tool=callgrind to count the instructions one request costs each side. It does the
 * same calls in the same order every run:
 *
 *   warm-up      N Alloc+Free pairs of 2 MiB and N Status, not counted: the daemon's cache then holds
 *                slabs for every Alloc that follows, and its tables and buffers have grown
 *   alloc        N Allocs of 2 MiB, held
 *   free         the N leases freed
 *   pairs        N Alloc+Free pairs of 2 MiB             (vmmb_alloc() in measured_alloc(), vmmb_free() in
 *                                                         measured_free())
 *   status       N Status on a raw connection           (status_call(): as the library calls and reads)
 *
 * The script counts the client's instructions inside the measured_*() functions only (--toggle-collect):
 * its pairs and Status, one lease mapped at a time (the simulated driver's work grows with the mappings a
 * process has, which the held Allocs would add to the client's counts). The daemon's Alloc and Free are
 * the held ones, its pairs and Status the same as the client's.
 * Each phase ends with a marker: a GetInfo, whose answer the client waits for. The daemon runs with
 * --dump-before=method_get_info, so it writes out what the phase cost it in the middle of that GetInfo;
 * the GetInfo's first part lands in the phase before, its second in the next. A phase of two markers back
 * to back (the first one) costs one whole GetInfo, which the script takes off each phase.
 *
 * Usage: callgrind-client SOCKET N
 */

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "codec.h"
#include "macro.h"
#include "rawclient.h"
#include "vmmbroker.h"

#define MiB (UINT64_C(1) << 20)

static _Noreturn void die(const char *what, int k) {
        fprintf(stderr, "callgrind-client: %s: %s (%s)\n", what, strerror(k < 0 ? -k : k), vmmb_error_message());
        exit(EXIT_FAILURE);
}

/* The functions the script's --toggle-collect names: not inlined, so that callgrind sees each call. */
__attribute__((noinline)) static int measured_alloc(vmmb_client *c, vmmb_lease **ret) {
        return vmmb_alloc(c, 2 * MiB, VMMB_ANY_DEVICE, NULL, ret);
}

__attribute__((noinline)) static int measured_free(vmmb_lease *l) {
        return vmmb_free(l);
}

/*
 * A Status on a raw connection, its reply decoded: the warm-up's, and what measured_status() counts. Inlined,
 * so that measured_status() is the same code as before and no tail call hides it from --toggle-collect.
 */
__attribute__((always_inline)) static inline int status(VarlinkConn *c) {
        StatusReply s;
        int k;

        k = status_call(c, &s);         /* as the client library calls and reads */
        status_reply_done(&s);
        return k;
}

__attribute__((noinline)) static int measured_status(VarlinkConn *c) {
        return status(c);
}

/* Ends a phase: a GetInfo, before which the daemon writes out what the phase cost it. */
static void marker(VarlinkConn *c) {
        Reply r;
        int k;

        k = call(c, VARLINK_METHOD_GET_INFO, NULL, &r);
        if (k < 0)
                die("GetInfo", k);
        reply_done(&r);
}

int main(int argc, char **argv) {
        _cleanup_(varlink_conn_freep) VarlinkConn *raw = NULL;
        vmmb_lease **leases;
        vmmb_client *c;
        size_t n;
        int k;

        if (argc != 3 || (n = strtoul(argv[2], NULL, 10)) == 0) {
                fprintf(stderr, "Usage: callgrind-client SOCKET N\n");
                return EXIT_FAILURE;
        }
        leases = calloc(n, sizeof(*leases));
        if (!leases)
                die("calloc", -ENOMEM);
        k = vmmb_connect(argv[1], &c);
        if (k < 0)
                die("vmmb_connect", k);
        k = conn_open(argv[1], &raw);
        if (k < 0)
                die("connect", k);

        for (size_t i = 0; i < n; i++) {
                vmmb_lease *l;

                k = vmmb_alloc(c, 2 * MiB, VMMB_ANY_DEVICE, NULL, &l);
                if (k < 0)
                        die("warm-up Alloc", k);
                k = vmmb_free(l);
                if (k < 0)
                        die("warm-up Free", k);
                k = status(raw);
                if (k < 0)
                        die("warm-up Status", k);
        }
        /* the held leases below need as many slabs cached: one warm-up round that holds them all */
        for (size_t i = 0; i < n; i++)
                if ((k = vmmb_alloc(c, 2 * MiB, VMMB_ANY_DEVICE, NULL, &leases[i])) < 0)
                        die("warm-up Alloc", k);
        for (size_t i = 0; i < n; i++)
                if ((k = vmmb_free(leases[i])) < 0)
                        die("warm-up Free", k);

        marker(raw);            /* ends the warm-up */
        marker(raw);            /* ends a phase of nothing but the marker's GetInfo */

        for (size_t i = 0; i < n; i++)
                if ((k = vmmb_alloc(c, 2 * MiB, VMMB_ANY_DEVICE, NULL, &leases[i])) < 0)
                        die("Alloc", k);
        marker(raw);

        for (size_t i = 0; i < n; i++)
                if ((k = vmmb_free(leases[i])) < 0)
                        die("Free", k);
        marker(raw);

        for (size_t i = 0; i < n; i++) {
                vmmb_lease *l;

                if ((k = measured_alloc(c, &l)) < 0)
                        die("Alloc", k);
                if ((k = measured_free(l)) < 0)
                        die("Free", k);
        }
        marker(raw);

        for (size_t i = 0; i < n; i++)
                if ((k = measured_status(raw)) < 0)
                        die("Status", k);
        marker(raw);

        vmmb_close(c);
        free(leases);
        return EXIT_SUCCESS;
}
