/* SPDX-License-Identifier: MIT */

/*
 * The lease table's store (daemon/store.c): what one change costs with 10 and
 * with 100,000 live leases, what a snapshot and a replay cost at 100,000, and
 * the bytes a lease takes in the log. Leases are plain structs made by hand
 * (no pool, no driver, no fds); the service manager is a fake that keeps a dup
 * of the memfd. Prints; asserts nothing.
 *
 *   bench-store [ITERATIONS]      (changes timed per kind and size, default 20000)
 */

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <unistd.h>

#include "lease.h"
#include "macro.h"
#include "state.h"
#include "store.h"
#include "timing.h"

#define MiB (UINT64_C(1) << 20)

static int fake_save(void *userdata, const char *name, int fd) {
        int *kept = userdata;

        safe_close(*kept);
        *kept = fcntl(fd, F_DUPFD_CLOEXEC, 3);
        return *kept < 0 ? -errno : 0;
}

static int fake_remove(void *userdata, const char *name) {
        return 0;
}

static Holder holders[64];

/* A lease like a client's Alloc: one or two slabs, a label, held once by its maker. */
static Lease *mk_lease(LeaseTable *t, unsigned n) {
        Lease *l = calloc(1, sizeof(*l));
        Hold *hold = calloc(1, sizeof(*hold));
        Holder *h = &holders[n % 64];

        if (!l || !hold)
                abort();
        snprintf(l->id, sizeof(l->id), "%016x%016x", 0x5eedu, n);
        l->created_usec = 1700000000000000 + n;
        l->label = strdup("bench");
        l->uid = h->uid;
        l->pid = h->pid;
        memcpy(l->comm, h->comm, sizeof(l->comm));
        l->n_slabs = 1 + n % 2;
        l->slabs = calloc(l->n_slabs, sizeof(Slab *));
        for (size_t i = 0; i < l->n_slabs; i++) {
                l->slabs[i] = calloc(1, sizeof(Slab));
                l->slabs[i]->id = (uint64_t)n * 2 + i + 1;
                l->slabs[i]->size = 2 * MiB << i;
                l->size += l->slabs[i]->size;
        }
        list_init(&l->holds);
        list_init(&l->tokens);
        *hold = (Hold){ .lease = l, .holder = h, .refs = 1 };
        list_link_tail(&l->holds, &hold->link_lease);
        l->n_holds = 1;
        list_link_tail(&t->leases, &l->link_table);
        t->n_leases++;
        return l;
}

static void drop_lease(LeaseTable *t, Lease *l) {
        Hold *hold = list_first_entry(&l->holds, Hold, link_lease);

        free(hold);
        list_unlink(&l->link_table);
        t->n_leases--;
        for (size_t i = 0; i < l->n_slabs; i++)
                free(l->slabs[i]);
        free(l->slabs);
        free(l->label);
        free(l);
}

static void table_done(LeaseTable *t) {
        Lease *l, *tmp;

        list_for_each_entry_safe(l, tmp, &t->leases, link_table)
                drop_lease(t, l);
}

static double pct(double *v, unsigned n, double p) {
        qsort(v, n, sizeof(*v), cmp_double);
        return v[(unsigned)(p * (n - 1))];
}

typedef struct Result {
        double alloc_p50, alloc_p99, free_p50, free_p99;
        double snapshot_ms, read_ms, start_ms;
        uint64_t alloc_bytes, free_bytes, snapshot_bytes;
} Result;

static int run(unsigned n_leases, unsigned iterations, Result *r) {
        StoreBackend b = { .save = fake_save, .remove = fake_remove };
        double *ta = calloc(iterations, sizeof(double)), *tf = calloc(iterations, sizeof(double)), t0;
        LeaseTable t = {};
        Store *s = NULL;
        State st = {};
        int kept = -EBADF, k;

        if (!ta || !tf)
                return -ENOMEM;
        b.userdata = &kept;
        list_init(&t.leases);
        for (unsigned i = 0; i < n_leases; i++)
                mk_lease(&t, i);
        k = store_new(&s, &b);
        if (k < 0)
                return k;
        t0 = now_us();
        k = store_snapshot(s, &t);
        r->snapshot_ms = (now_us() - t0) / 1e3;
        if (k < 0)
                return k;
        r->snapshot_bytes = store_stats(s).snapshot_bytes;

        for (unsigned i = 0; i < iterations; i++) {
                Lease *l = mk_lease(&t, n_leases + i);
                Hold *hold = list_first_entry(&l->holds, Hold, link_lease);
                uint64_t before = store_stats(s).log_bytes;

                /* Alloc: the lease and its maker's hold, one record. */
                t0 = now_us();
                store_begin(s);
                k = store_put_lease(s, l);
                if (k >= 0)
                        k = store_put_hold(s, l->id, hold->holder, 1, false, false);
                if (k >= 0)
                        k = store_commit(s);
                ta[i] = now_us() - t0;
                if (k < 0)
                        return k;
                r->alloc_bytes = store_stats(s).log_bytes - before;
                before = store_stats(s).log_bytes;

                /* Free: the hold ends, and the lease with it. */
                t0 = now_us();
                store_begin(s);
                k = store_end_hold(s, l->id, hold->holder);
                if (k >= 0)
                        k = store_end_lease(s, l->id);
                if (k >= 0)
                        k = store_commit(s);
                tf[i] = now_us() - t0;
                if (k < 0)
                        return k;
                r->free_bytes = store_stats(s).log_bytes - before;
                drop_lease(&t, l);
        }
        r->alloc_p50 = pct(ta, iterations, 0.50);
        r->alloc_p99 = pct(ta, iterations, 0.99);
        r->free_p50 = pct(tf, iterations, 0.50);
        r->free_p99 = pct(tf, iterations, 0.99);

        /* A restart: replay what the service manager holds (snapshot and every change since), then store
         * the table anew, as the daemon does before READY (its own rebuilding of the table is not here). */
        t0 = now_us();
        k = store_read(kept, &st, NULL);
        r->read_ms = (now_us() - t0) / 1e3;
        if (k < 0)
                return k;
        if (st.n_leases != n_leases)
                return -EBADMSG;
        state_done(&st);
        store_free(s);
        k = store_new(&s, &b);
        if (k < 0)
                return k;
        t0 = now_us();
        k = store_read(kept, &st, NULL);
        if (k >= 0)
                k = store_snapshot(s, &t);
        r->start_ms = (now_us() - t0) / 1e3;
        state_done(&st);
        store_free(s);
        safe_close(kept);
        table_done(&t);
        free(ta);
        free(tf);
        return k;
}

int main(int argc, char **argv) {
        unsigned iterations = argc > 1 ? (unsigned)atoi(argv[1]) : 20000;
        static const unsigned sizes[] = { 10, 100000 };
        Result r[2] = {};
        struct utsname u;

        if (iterations < 100)
                iterations = 20000;     /* `meson test --benchmark` passes no count */
        for (unsigned i = 0; i < 64; i++) {
                holders[i] = (Holder){ .pid = 1000 + (pid_t)i, .uid = 1000 + i % 4, .gid = 1000 + i % 4,
                                       .start_time = 100000 + i };
                snprintf(holders[i].comm, sizeof(holders[i].comm), "worker-%u", i);
        }
        uname(&u);
        printf("# bench-store: %s %s %s, %ld CPUs\n", u.sysname, u.release, u.machine, sysconf(_SC_NPROCESSORS_ONLN));
        printf("# method: hand-made leases (1-2 slabs, a label, one hold each) in a LeaseTable, a fake service\n"
               "# manager keeping a dup of the memfd. Per table size: one snapshot, then %u Alloc-like changes\n"
               "# (put_lease + put_hold, one commit) each followed by a Free-like one (end_hold + end_lease),\n"
               "# timed from store_begin() to store_commit()'s return with CLOCK_MONOTONIC; then store_read()\n"
               "# of the stored memfd (snapshot + every change), and a start: store_read() + a new snapshot.\n",
               iterations);
        for (unsigned i = 0; i < 2; i++) {
                int k = run(sizes[i], iterations, &r[i]);

                if (k < 0) {
                        fprintf(stderr, "Failed with %u leases: %s\n", sizes[i], strerror(-k));
                        return EXIT_FAILURE;
                }
                printf("%7u leases: alloc commit p50 %.2f us p99 %.2f us | free commit p50 %.2f us p99 %.2f us\n",
                       sizes[i], r[i].alloc_p50, r[i].alloc_p99, r[i].free_p50, r[i].free_p99);
                printf("%7u leases: snapshot %.2f ms (%" PRIu64 " bytes, %.1f bytes/lease) | replay %.2f ms | "
                       "start (replay + snapshot) %.2f ms\n",
                       sizes[i], r[i].snapshot_ms, r[i].snapshot_bytes,
                       (double)r[i].snapshot_bytes / sizes[i], r[i].read_ms, r[i].start_ms);
        }
        printf("bytes per change: alloc %" PRIu64 ", free %" PRIu64 " (the same at both sizes: %s)\n",
               r[1].alloc_bytes, r[1].free_bytes,
               r[0].alloc_bytes == r[1].alloc_bytes && r[0].free_bytes == r[1].free_bytes ? "yes" : "NO");
        printf("ratio 100000/10: alloc p50 %.2fx p99 %.2fx, free p50 %.2fx p99 %.2fx (target <= 1.2x at p50)\n",
               r[1].alloc_p50 / r[0].alloc_p50, r[1].alloc_p99 / r[0].alloc_p99, r[1].free_p50 / r[0].free_p50,
               r[1].free_p99 / r[0].free_p99);
        printf("start at 100000 leases: %.1f ms (target <= 1000 ms: %s)\n", r[1].start_ms,
               r[1].start_ms <= 1000 ? "met" : "MISSED");
        return EXIT_SUCCESS;
}
