/* SPDX-License-Identifier: MIT */

/*
 * bench-trace: a real workload's segments through the broker, against the driver without it (issue 14's
 * second target). It replays a recorded trace of the segments PyTorch's caching allocator asked the driver
 * for during a training run (tests/gpu/python/record_segments.py writes it), in the trace's order and with
 * the segments live as the trace says, four times per pass, once for each way to get the memory:
 *
 *   broker       vmmb_alloc() of the segment's size, from a warm pool: from the request to a usable pointer;
 *                a freed segment is vmmb_free(), so each allocation imports, maps and gives access anew
 *   kept         the same, a freed segment vmmb_free_keep() (as the PyTorch allocator of vmmbroker.torch
 *                frees): an allocation of a size this process kept gets that lease back and reuses its
 *                mapping. Every pass after the first (untimed) finds every size kept.
 *   in-process   cuMemCreate + cuMemAddressReserve + cuMemMap + cuMemSetAccess of the same size in this
 *                process: one allocation per segment, whatever layout the broker uses (that is the point of
 *                the comparison: what a framework would pay doing VMM itself), with the broker's slab
 *                properties (pinned device memory, POSIX-fd exportable); freed with unmap, address free,
 *                release
 *   cuMemAlloc   cuMemAlloc of the same size (what PyTorch's allocator does); freed with cuMemFree
 *
 * Only the allocations are timed. A pass replays the whole trace for each method in turn (the order rotates
 * from pass to pass, so that drift touches them alike) and frees what the trace left live at its end. It runs
 * in two phases, since the broker hands a process's kept leases to any Alloc of that process: first broker,
 * in-process and cuMemAlloc with nothing kept; then kept, in-process and cuMemAlloc, after the kept method's
 * frees have kept every size. Each ratio compares methods of the same phase. One untimed pass of each method
 * first warms the pool (the daemon caches the slabs, scrubbed, for this uid, or keeps them) and the driver.
 * The daemon is this program's own ($VMMBROKER_DAEMON), started on the driver it loads.
 *
 * It prints medians per distinct size and the median per segment over every segment of every timed pass,
 * and the targets, each met or MISSED by how much:
 *
 *   - median per segment, broker <= 1.5x in-process create + map + access;
 *   - for each size from 512 MiB up, broker faster than cuMemAlloc (median of that size).
 *
 * The trace format (text; the recorder's header says how it was recorded):
 *
 *   # ...        a comment; blank lines are ignored too
 *   +SIZE        the next segment is allocated, SIZE bytes (decimal). Segments are numbered 0, 1, 2, ... in
 *                the order of their + lines.
 *   -N           segment N is freed (it must be live)
 *
 * A program that prints measurements, not a test. Usage: bench-trace TRACE [PASSES]  (PASSES: 5 by default)
 */

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "codec.h"
#include "driver.h"
#include "harness.h"
#include "machine.h"
#include "macro.h"
#include "size.h"
#include "timing.h"
#include "varlink.h"
#include "vmmbroker.h"

#define MiB (UINT64_C(1) << 20)
#define MAX_PASSES 50
#define DEFAULT_PASSES 5
#define TARGET_IN_PROCESS 1.5           /* median per segment, broker <= 1.5x in-process create + map + access */
#define LARGE (512 * MiB)               /* from here up, broker faster than cuMemAlloc */

enum { BROKER, KEPT, IN_PROCESS, CUMEMALLOC, N_METHODS };
enum { PHASE_BROKER, PHASE_KEPT, N_PHASES };

/* The methods of each phase: the broker's, then the two it is compared with. */
static const int phase_methods[N_PHASES][3] = {
        [PHASE_BROKER] = { BROKER, IN_PROCESS, CUMEMALLOC },
        [PHASE_KEPT] = { KEPT, IN_PROCESS, CUMEMALLOC },
};

static CudaDriver *cu;
static CUdevice dev0;
static uint64_t granularity;

static _Noreturn void die(const char *what, int k) {
        fprintf(stderr, "bench-trace: %s: %s (%s)\n", what, strerror(k < 0 ? -k : k), vmmb_error_message());
        exit(EXIT_FAILURE);
}

static void check(CUresult r, const char *what) {
        if (r != CUDA_SUCCESS) {
                fprintf(stderr, "bench-trace: %s: %s\n", what, cuda_result_name(cu, r));
                exit(EXIT_FAILURE);
        }
}

/* ---- the trace ------------------------------------------------------------------------------------------ */

typedef struct Event {
        bool alloc;
        uint64_t segment;               /* the segment allocated or freed */
} Event;

typedef struct Trace {
        Event *events;
        size_t n_events, n_frees;
        uint64_t *sizes;                /* per segment */
        size_t n_segments;
        uint64_t total, peak;           /* bytes allocated in all, most bytes live at once */
        char *comments;                 /* its # lines, one per line: how it was recorded */
        size_t comments_len;
} Trace;

static void trace_done(Trace *t) {
        free(t->events);
        free(t->sizes);
        free(t->comments);
        *t = (Trace){};
}

static void *grow(void *p, size_t n, size_t size) {
        /* doubling at powers of two: n is the count before the append */
        if (n == 0 || (n & (n - 1)) == 0) {
                p = realloc(p, (n ? 2 * n : 16) * size);
                if (!p)
                        die("realloc", -ENOMEM);
        }
        return p;
}

/* Reads and checks a trace, keeping its comment lines. Exits with a message on error. */
static void trace_load(const char *path, Trace *ret) {
        _cleanup_free_ bool *live = NULL;
        _cleanup_free_ char *line = NULL;
        Trace t = {};
        uint64_t now = 0;
        size_t cap = 0, lineno = 0;
        FILE *f = fopen(path, "re");

        if (!f) {
                fprintf(stderr, "bench-trace: cannot open the trace %s: %m\n"
                        "  Record one on a GPU with tests/gpu/python/record_segments.py (see its header), or pass "
                        "the trace kept in the tree, tests/bench/traces/gpt2-train-segments.txt, once it is there.\n",
                        path);
                exit(EXIT_FAILURE);
        }
        while (getline(&line, &cap, f) >= 0) {
                char *s = line + strspn(line, " \t"), *end;
                unsigned long long v;

                lineno++;
                s[strcspn(s, "\r\n")] = 0;
                if (*s == '#') {
                        size_t n = strlen(s);

                        t.comments = realloc(t.comments, t.comments_len + n + 2);
                        if (!t.comments)
                                die("realloc", -ENOMEM);
                        memcpy(t.comments + t.comments_len, s, n);
                        t.comments_len += n;
                        t.comments[t.comments_len++] = '\n';
                        t.comments[t.comments_len] = 0;
                        continue;
                }
                if (*s == 0)
                        continue;
                if ((*s != '+' && *s != '-') || s[1] < '0' || s[1] > '9')
                        goto bad;
                errno = 0;
                v = strtoull(s + 1, &end, 10);
                if (errno != 0 || *(end + strspn(end, " \t")) != 0)
                        goto bad;
                t.events = grow(t.events, t.n_events, sizeof(Event));
                if (*s == '+') {
                        if (v == 0 || v > (UINT64_C(1) << 48))
                                goto bad;
                        t.sizes = grow(t.sizes, t.n_segments, sizeof(uint64_t));
                        live = grow(live, t.n_segments, sizeof(bool));
                        t.sizes[t.n_segments] = v;
                        live[t.n_segments] = true;
                        t.events[t.n_events++] = (Event){ .alloc = true, .segment = t.n_segments++ };
                        t.total += v;
                        now += v;
                        t.peak = MAX(t.peak, now);
                } else {
                        if (v >= t.n_segments || !live[v]) {
                                fprintf(stderr, "bench-trace: %s:%zu: segment %llu is not live here\n", path, lineno,
                                        v);
                                exit(EXIT_FAILURE);
                        }
                        live[v] = false;
                        now -= t.sizes[v];
                        t.events[t.n_events++] = (Event){ .alloc = false, .segment = v };
                        t.n_frees++;
                }
        }
        fclose(f);
        if (t.n_segments == 0) {
                fprintf(stderr, "bench-trace: %s: no segment in the trace\n", path);
                exit(EXIT_FAILURE);
        }
        *ret = t;
        return;
bad:
        fprintf(stderr, "bench-trace: %s:%zu: \"%s\" is neither \"+SIZE\" nor \"-SEGMENT\" (nor a # comment)\n", path,
                lineno, line);
        exit(EXIT_FAILURE);
}

/* ---- one replay ----------------------------------------------------------------------------------------- */

typedef struct Held {
        vmmb_lease *lease;                      /* broker */
        CUdeviceptr va;                         /* in-process, cuMemAlloc */
        CUmemGenericAllocationHandle handle;    /* in-process */
        uint64_t size;                          /* in-process: rounded up to the granularity */
        bool live;
} Held;

/* Allocates segment `size` by `method` into *h; returns the microseconds it took to a usable pointer. */
static double segment_alloc(int method, vmmb_client *client, uint64_t size, Held *h) {
        CUmemAllocationProp prop = cuda_slab_prop(dev0);
        CUmemAccessDesc access = {
                .location = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = dev0 },
                .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        double t0 = now_us(), t;
        int k;

        *h = (Held){ .live = true };
        switch (method) {
        case BROKER:
        case KEPT:
                k = vmmb_alloc(client, size, 0, "trace", &h->lease);
                t = now_us() - t0;
                if (k < 0)
                        die("vmmb_alloc", k);
                return t;
        case IN_PROCESS:
                h->size = (size + granularity - 1) / granularity * granularity;
                check(cu->cuMemCreate(&h->handle, h->size, &prop, 0), "cuMemCreate");
                check(cu->cuMemAddressReserve(&h->va, h->size, 0, 0, 0), "cuMemAddressReserve");
                check(cu->cuMemMap(h->va, h->size, 0, h->handle, 0), "cuMemMap");
                check(cu->cuMemSetAccess(h->va, h->size, &access, 1), "cuMemSetAccess");
                return now_us() - t0;
        default:
                check(cu->cuMemAlloc(&h->va, size), "cuMemAlloc");
                return now_us() - t0;
        }
}

static void segment_free(int method, Held *h) {
        int k;

        switch (method) {
        case BROKER:
                k = vmmb_free(h->lease);
                if (k < 0)
                        die("vmmb_free", k);
                break;
        case KEPT:
                k = vmmb_free_keep(h->lease);
                if (k < 0)
                        die("vmmb_free_keep", k);
                break;
        case IN_PROCESS:
                check(cu->cuMemUnmap(h->va, h->size), "cuMemUnmap");
                check(cu->cuMemAddressFree(h->va, h->size), "cuMemAddressFree");
                check(cu->cuMemRelease(h->handle), "cuMemRelease");
                break;
        default:
                check(cu->cuMemFree(h->va), "cuMemFree");
        }
        h->live = false;
}

/* Waits (polling Status, this is a benchmark) until the daemon has scrubbed every freed slab. */
static void wait_scrubbed(const char *path) {
        WireDevice d;
        int k;

        do {
                k = harness_status(path, &d);
                if (k < 0)
                        die("Status", k);
        } while (d.scrubbing > 0);
}

/*
 * Replays the trace once by `method`; the allocation times go to us[segment] (NULL: untimed). Frees what the
 * trace leaves live, and for the broker waits until the pool has scrubbed it all: the next pass starts warm.
 */
static void replay(const Trace *t, int method, vmmb_client *client, const char *path, Held *held, double *us) {
        for (size_t i = 0; i < t->n_events; i++) {
                const Event *e = &t->events[i];

                if (e->alloc) {
                        double x = segment_alloc(method, client, t->sizes[e->segment], &held[e->segment]);

                        if (us)
                                us[e->segment] = x;
                } else
                        segment_free(method, &held[e->segment]);
        }
        for (size_t s = 0; s < t->n_segments; s++)
                if (held[s].live)
                        segment_free(method, &held[s]);
        if (method == BROKER)
                wait_scrubbed(path);
}

/* ---- the report ----------------------------------------------------------------------------------------- */

#define TARGET_ROW "%-40s %-8s %-17s %s\n"       /* what, target, verdict, measured */

static void target_row(const char *what, const char *target, bool met, double ratio, double limit,
                       const char *measured) {
        char verdict[32];

        if (met)
                snprintf(verdict, sizeof(verdict), "met");
        else
                snprintf(verdict, sizeof(verdict), "MISSED by %.0f%%", (ratio / limit - 1) * 100);
        printf(TARGET_ROW, what, target, verdict, measured);
}

/* The median of one method's samples of the segments of `size`, over every pass; x is scratch of passes *
 * segments. Sets *ret_n to how many samples there were. */
static double size_median(const Trace *t, const double *us, unsigned passes, uint64_t size, double *x,
                          unsigned *ret_n) {
        unsigned n = 0;

        for (unsigned p = 0; p < passes; p++)
                for (size_t s = 0; s < t->n_segments; s++)
                        if (t->sizes[s] == size)
                                x[n++] = us[(size_t)p * t->n_segments + s];
        *ret_n = n;
        return median(x, n);
}

static int cmp_u64(const void *a, const void *b) {
        uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

        return x < y ? -1 : x > y;
}

/* Prints medians per distinct size and per segment, then the targets. us[phase][m] holds passes x segments
 * samples of the phase's methods. */
static void report(const Trace *t, double *const us[N_PHASES][N_METHODS], unsigned passes) {
        size_t n_samples = (size_t)passes * t->n_segments, n_distinct = 0;
        _cleanup_free_ uint64_t *distinct = calloc(t->n_segments, sizeof(uint64_t));
        _cleanup_free_ double *x = calloc(n_samples, sizeof(double));
        double med[N_PHASES][N_METHODS], overall[N_PHASES][N_METHODS], r;
        char b[FORMAT_SIZE_MAX], measured[160];
        bool any_large = false;
        unsigned n = 0;

        if (!distinct || !x)
                die("calloc", -ENOMEM);
        memcpy(distinct, t->sizes, t->n_segments * sizeof(uint64_t));
        qsort(distinct, t->n_segments, sizeof(uint64_t), cmp_u64);
        for (size_t i = 0; i < t->n_segments; i++)
                if (i == 0 || distinct[i] != distinct[n_distinct - 1])
                        distinct[n_distinct++] = distinct[i];

        printf("phase 1, nothing kept: broker (vmmb_free() between passes); phase 2: kept (vmmb_free_keep()); "
               "in-process and cuMemAlloc measured in each phase\n");
        printf("%-11s %8s %9s %9s %9s %8s | %9s %9s %9s %8s %8s\n", "size", "segments", "broker", "in-proc",
               "cuMemAlloc", "vs in-pr", "kept", "in-proc", "cuMemAlloc", "vs in-pr", "vs alloc");
        for (size_t d = 0; d < n_distinct; d++) {
                for (int ph = 0; ph < N_PHASES; ph++)
                        for (int k = 0; k < 3; k++) {
                                int m = phase_methods[ph][k];

                                med[ph][m] = size_median(t, us[ph][m], passes, distinct[d], x, &n);
                        }
                printf("%-11s %8u %9.1f %9.1f %9.1f %7.2fx | %9.1f %9.1f %9.1f %7.2fx %7.2fx\n",
                       format_size(distinct[d], b, sizeof(b)), n / passes, med[0][BROKER], med[0][IN_PROCESS],
                       med[0][CUMEMALLOC], med[0][BROKER] / med[0][IN_PROCESS], med[1][KEPT], med[1][IN_PROCESS],
                       med[1][CUMEMALLOC], med[1][KEPT] / med[1][IN_PROCESS], med[1][KEPT] / med[1][CUMEMALLOC]);
        }
        for (int ph = 0; ph < N_PHASES; ph++)
                for (int k = 0; k < 3; k++) {
                        int m = phase_methods[ph][k];

                        memcpy(x, us[ph][m], n_samples * sizeof(double));
                        overall[ph][m] = median(x, (unsigned)n_samples);
                }
        printf("%-11s %8zu %9.1f %9.1f %9.1f %7.2fx | %9.1f %9.1f %9.1f %7.2fx %7.2fx\n", "per segment",
               t->n_segments, overall[0][BROKER], overall[0][IN_PROCESS], overall[0][CUMEMALLOC],
               overall[0][BROKER] / overall[0][IN_PROCESS], overall[1][KEPT], overall[1][IN_PROCESS],
               overall[1][CUMEMALLOC], overall[1][KEPT] / overall[1][IN_PROCESS],
               overall[1][KEPT] / overall[1][CUMEMALLOC]);

        printf("\n" TARGET_ROW, "target (issue 14)", "target", "verdict", "measured");
        for (int ph = 0; ph < N_PHASES; ph++) {
                int m = phase_methods[ph][0];
                char what[64];

                r = overall[ph][m] / overall[ph][IN_PROCESS];
                snprintf(what, sizeof(what), "per segment, %s vs in-process VMM", m == KEPT ? "kept" : "broker");
                snprintf(measured, sizeof(measured), "%.2fx: %.1f / %.1f us (median of %zu)", r, overall[ph][m],
                         overall[ph][IN_PROCESS], n_samples);
                target_row(what, "<= 1.5x", r <= TARGET_IN_PROCESS, r, TARGET_IN_PROCESS, measured);
        }
        for (size_t d = 0; d < n_distinct; d++) {
                if (distinct[d] < LARGE)
                        continue;
                any_large = true;
                for (int ph = 0; ph < N_PHASES; ph++) {
                        int m = phase_methods[ph][0];
                        char what[64];
                        double mb, ma;

                        mb = size_median(t, us[ph][m], passes, distinct[d], x, &n);
                        ma = size_median(t, us[ph][CUMEMALLOC], passes, distinct[d], x, &n);
                        r = mb / ma;
                        snprintf(what, sizeof(what), "%s, %s vs cuMemAlloc", format_size(distinct[d], b, sizeof(b)),
                                 m == KEPT ? "kept" : "broker");
                        snprintf(measured, sizeof(measured), "%.2fx: %.1f / %.1f us (median of %u)", r, mb, ma, n);
                        target_row(what, "< 1.0x", r < 1.0, r, 1.0, measured);
                }
        }
        if (!any_large)
                printf(TARGET_ROW, "from 512 MiB up, broker vs cuMemAlloc", "< 1.0x", "not measured",
                       "no segment of 512 MiB or more in the trace");
}

int main(int argc, char *argv[]) {
        CUmemAllocationProp prop;
        _cleanup_free_ Held *held = NULL;
        _cleanup_free_ double *pool = NULL;
        double *us[N_PHASES][N_METHODS] = {};
        unsigned passes = argc > 2 ? (unsigned)strtoul(argv[2], NULL, 10) : DEFAULT_PASSES;
        size_t n_samples, gran = 0;
        char b1[FORMAT_SIZE_MAX], b2[FORMAT_SIZE_MAX];
        vmmb_client *client;
        Trace t;
        Harness h;
        CUcontext ctx;
        int k;

        if (argc < 2 || argc > 3 || passes == 0 || passes > MAX_PASSES) {
                fprintf(stderr, "Usage: %s TRACE [PASSES]  (PASSES 1 to %d, default %d)\n"
                        "  TRACE: a segment trace recorded by tests/gpu/python/record_segments.py, such as "
                        "tests/bench/traces/gpt2-train-segments.txt\n", argv[0], MAX_PASSES, DEFAULT_PASSES);
                return EXIT_FAILURE;
        }
        trace_load(argv[1], &t);

        k = harness_start_config(&h, "[Limits]\nMaxBytes=100%\n", NULL);    /* the trace is most of a device */
        if (k < 0)
                die("starting vmmbrokerd (is VMMBROKER_DAEMON set?)", k);
        machine_open_device("bench-trace", &cu, &dev0, &ctx);
        prop = cuda_slab_prop(dev0);
        check(cu->cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
              "cuMemGetAllocationGranularity");
        granularity = gran;
        k = vmmb_connect(h.socket, &client);
        if (k < 0)
                die("vmmb_connect", k);

        machine_print("bench-trace", cu);
        printf("trace: %s: %zu segments (%s in all, at most %s live at once), %zu freed during the run\n", argv[1],
               t.n_segments, format_size(t.total, b1, sizeof(b1)), format_size(t.peak, b2, sizeof(b2)), t.n_frees);
        printf("%s", t.comments ?: "# (the trace says nothing of how it was recorded)\n");
        printf("method: %u timed passes after one untimed (the pool warm, the driver warm); each pass replays the "
               "trace by each method in turn, order rotating; allocation to usable pointer timed with "
               "CLOCK_MONOTONIC, frees untimed; medians in us over every segment of every timed pass\n", passes);
        fflush(stdout);

        n_samples = (size_t)passes * t.n_segments;
        held = calloc(t.n_segments, sizeof(Held));
        pool = calloc(N_PHASES * N_METHODS * n_samples, sizeof(double));
        if (!held || !pool)
                die("calloc", -ENOMEM);
        for (int ph = 0; ph < N_PHASES; ph++)
                for (int m = 0; m < N_METHODS; m++)
                        us[ph][m] = pool + ((size_t)ph * N_METHODS + (size_t)m) * n_samples;

        for (int ph = 0; ph < N_PHASES; ph++) {
                for (int i = 0; i < 3; i++)
                        replay(&t, phase_methods[ph][i], client, h.socket, held, NULL);
                for (unsigned p = 0; p < passes; p++)
                        for (unsigned i = 0; i < 3; i++) {
                                int m = phase_methods[ph][(p + i) % 3];

                                replay(&t, m, client, h.socket, held, us[ph][m] + (size_t)p * t.n_segments);
                        }
        }
        vmmb_close(client);

        report(&t, us, passes);

        trace_done(&t);
        k = harness_stop(&h);
        (void)cu->cuDevicePrimaryCtxRelease(0);
        cuda_driver_close(cu);
        return k == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
