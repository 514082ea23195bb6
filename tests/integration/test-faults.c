/* SPDX-License-Identifier: MIT */

/*
 * Driver faults, end to end: the simulated device fails chosen calls
 * ($SIMCUDA_FAIL in the daemon's environment, simcuda_fail() in a client
 * process; tests/simcuda/README.md) and each test checks that
 *   - the client gets a named error (a varlink error, or a named errno from
 *     libvmmbroker) and no fds;
 *   - the pool (Status: leased, scrubbing, cached, leases), the accounting
 *     (Users with all, once the daemon has it) and the daemon's fd count are
 *     as they were before the request, except for the one unbound 2 MiB slab
 *     the pool primes after it closed fds (pool.h, pool_idle()), which the
 *     expectation names;
 *   - the daemon is healthy afterwards: a forked client leases memory, finds
 *     it zeroed, writes to it and frees it.
 * docs/robustness.md ("Faults") lists every case and its outcome.
 *
 * Each case starts its own daemon, so that $SIMCUDA_FAIL's "Nth call"
 * counts from a known start: the daemon makes no cuMemCreate, export, memset,
 * reserve, map or set-access call before its first request, and one
 * cuCtxSetCurrent per device at start. Nothing sleeps: the states the daemon
 * reaches asynchronously (a scrub completing, an idle pass closing fds and
 * priming, a dead client's connection closing) are polled for with Status
 * round trips, a bounded number of them.
 */

#include <check.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "codec.h"
#include "harness.h"
#include "macro.h"
#include "rawclient.h"
#include "simcuda.h"
#include "unit.h"
#include "vmmbroker.h"

#define MiB (UINT64_C(1) << 20)
#define GRAN (2 * MiB)                  /* the simulated device's granularity: the primed slab's size */
#define CANARY 0xDEADBEEFu              /* what a client leaves in its lease before freeing it */
#define SETTLE_ROUND_TRIPS 20000        /* Status round trips to wait for an expected state */
/* fds a live slab keeps open in the daemon: its exported fd, and the simulator's memfd behind its handle
 * (a real driver has no fd behind a handle). */
#define FDS_PER_SLAB 2

/* ---- the daemon and its state ------------------------------------------------------------------------ */

typedef struct Fixture {
        Harness h;
        VarlinkConn *ctl;               /* the test's own connection: Status, Users, raw Alloc */
} Fixture;

/*
 * Starts a daemon whose simulated device fails `faults` ($SIMCUDA_FAIL, NULL for none) and has `memory`
 * ($SIMCUDA_MEMORY, NULL for the default), with extra options `args` (NULL-terminated, may be NULL).
 * The variables reach only the daemon: they are set for the fork and removed at once.
 */
static void fixture_start(Fixture *f, const char *faults, const char *memory, const char *const *args) {
        int k;

        *f = (Fixture){};
        if (faults)
                ck_assert_int_eq(setenv("SIMCUDA_FAIL", faults, 1), 0);
        if (memory)
                ck_assert_int_eq(setenv("SIMCUDA_MEMORY", memory, 1), 0);
        k = harness_start(&f->h, args);
        (void)unsetenv("SIMCUDA_FAIL");
        (void)unsetenv("SIMCUDA_MEMORY");
        ck_assert_msg(k == 0, "starting the daemon (SIMCUDA_FAIL=%s): %s", faults ?: "", strerror(-k));
        k = conn_open(f->h.socket, &f->ctl);
        ck_assert_msg(k == 0, "connect: %s", strerror(-k));
}

/* A 64 MiB maximum slab: a lease of 66 MiB is two slabs, 64 + 2 MiB, for the cases of a second slab. */
#define SLABS_64M ((const char *const[]){ "--max-slab", "64M", NULL })

static void fixture_stop(Fixture *f) {
        f->ctl = varlink_conn_free(f->ctl);
        ck_assert_int_eq(harness_stop(&f->h), 0);
}

typedef struct State {
        WireDevice d;                   /* device 0: leased, scrubbing, cached, leases */
        int fds;                        /* the daemon's open fds */
        char users[2048];               /* Users(all), one line per user; "" while the daemon has no Users */
} State;

static bool users_missing;              /* the daemon answered Users with MethodNotFound (say it once) */

static int user_cmp(const void *a, const void *b) {
        const WireUser *x = a, *y = b;

        return x->uid < y->uid ? -1 : x->uid > y->uid;
}

/* Users on the control connection: every user (the test runs as root, an administrator), else its own. */
static void users_text(Fixture *f, char *buf, size_t len) {
        _cleanup_free_ char *message = NULL;
        UsersReply u = {};
        size_t off = 0;
        Reply r;
        int k;

        buf[0] = 0;
        if (users_missing)
                return;
        k = call_text(f->ctl, VMMB_METHOD_USERS, "{\"all\": true}", &r);
        ck_assert_msg(k == 0, "Users: %s", strerror(-k));
        if (r.error && strcmp(r.error, VMMB_ERROR_PERMISSION_DENIED) == 0) {
                reply_done(&r);
                k = call_text(f->ctl, VMMB_METHOD_USERS, NULL, &r);
                ck_assert_msg(k == 0, "Users: %s", strerror(-k));
        }
        if (r.error && (strcmp(r.error, VARLINK_ERROR_METHOD_NOT_FOUND) == 0 ||
                        strcmp(r.error, VARLINK_ERROR_METHOD_NOT_IMPLEMENTED) == 0)) {
                fprintf(stderr, "note: the daemon answers Users with %s: accounting not checked\n", r.error);
                users_missing = true;
                reply_done(&r);
                return;
        }
        ck_assert_msg(!r.error, "Users: %s %s", r.error, json_object_to_json_string(r.params));
        k = users_reply_decode(r.params, &u, &message);
        ck_assert_msg(k == 0, "Users reply: %s", message ?: strerror(-k));
        /* In uid order, so that two snapshots compare as text. */
        if (u.n_users > 1)
                qsort(u.users, u.n_users, sizeof(*u.users), user_cmp);
        for (size_t i = 0; i < u.n_users; i++) {
                const WireUser *w = &u.users[i];

                off += (size_t)snprintf(buf + off, off < len ? len - off : 0,
                                        "uid %" PRId64 ": leases %" PRIu64 "/%" PRIu64 ", connections %" PRIu64
                                        "/%" PRIu64 ", requests %" PRIu64, w->uid, w->leases, w->max_leases,
                                        w->connections, w->max_connections, w->requests);
                for (size_t j = 0; j < w->n_devices; j++)
                        off += (size_t)snprintf(buf + off, off < len ? len - off : 0,
                                                ", device %" PRId64 " %" PRIu64 "/%" PRIu64 " bytes",
                                                w->devices[j].index, w->devices[j].bytes, w->devices[j].max_bytes);
                off += (size_t)snprintf(buf + off, off < len ? len - off : 0, "\n");
        }
        ck_assert_msg(off < len, "Users reply too long to compare");
        users_reply_done(&u);
        reply_done(&r);
}

static void state_get(Fixture *f, State *ret) {
        int k = harness_status_on(f->ctl, &ret->d);

        ck_assert_msg(k == 0, "Status: %s", strerror(-k));
        ret->fds = harness_fd_count(f->h.pid);
        ck_assert_int_gt(ret->fds, 0);
        users_text(f, ret->users, sizeof(ret->users));
}

static bool state_eq(const State *a, const State *b) {
        return a->d.leased == b->d.leased && a->d.scrubbing == b->d.scrubbing && a->d.cached == b->d.cached &&
               a->d.leases == b->d.leases && a->fds == b->fds && strcmp(a->users, b->users) == 0;
}

static void state_format(const State *s, char *buf, size_t len) {
        snprintf(buf, len, "leased %" PRIu64 ", scrubbing %" PRIu64 ", cached %" PRIu64 ", %" PRIu64 " leases, "
                 "%d fds\n%s", s->d.leased, s->d.scrubbing, s->d.cached, s->d.leases, s->fds, s->users);
}

/*
 * Waits (Status round trips) until the daemon is in state `want`, or `alt` unless NULL, twice in a row (an
 * fd count read while the daemon opens and closes fds is not to be trusted alone); fails the test with the
 * states if not.
 */
static void expect_states(Fixture *f, const State *want, const State *alt, const char *what) {
        char b1[2200], b2[2200], b3[2200] = "";
        State now = {};
        int matched = 0;

        for (int i = 0; i < SETTLE_ROUND_TRIPS; i++) {
                state_get(f, &now);
                matched = state_eq(&now, want) || (alt && state_eq(&now, alt)) ? matched + 1 : 0;
                if (matched == 2)
                        return;
        }
        state_format(want, b1, sizeof(b1));
        if (alt)
                state_format(alt, b3, sizeof(b3));
        state_format(&now, b2, sizeof(b2));
        ck_abort_msg("after %s the daemon is not as expected.\nwanted: %s%s%s\ngot:    %s", what, b1,
                     alt ? "\nor:     " : "", b3, b2);
}

static void expect_state(Fixture *f, const State *want, const char *what) {
        expect_states(f, want, NULL, what);
}

/*
 * Waits until no scrub is in flight and two snapshots in a row agree, and returns that state: the daemon
 * runs on while /proc is read, so one snapshot may catch an fd it holds only for a moment (sd_notify()'s
 * socket in its idle pass, say).
 */
static void state_settled(Fixture *f, State *ret) {
        State prev;

        state_get(f, &prev);
        for (int i = 0; i < SETTLE_ROUND_TRIPS; i++) {
                state_get(f, ret);
                if (ret->d.scrubbing == 0 && state_eq(ret, &prev))
                        return;
                prev = *ret;
        }
        ck_abort_msg("the daemon did not settle: %" PRIu64 " bytes scrubbing", ret->d.scrubbing);
}

/* `s` with `n` unbound slabs primed by the pool after it closed fds (pool_idle()), cached. */
static State primed(State s, unsigned n) {
        s.d.cached += n * GRAN;
        s.fds += (int)n * FDS_PER_SLAB;
        return s;
}

/* ---- clients ------------------------------------------------------------------------------------------- */

/* Alloc(size) on the control connection must fail with `error`, no fds, a message containing `message`. */
static void alloc_fails(Fixture *f, uint64_t size, const char *error, const char *message) {
        char params[64];
        const char *m;
        Reply r;

        snprintf(params, sizeof(params), "{\"size\": %" PRIu64 "}", size);
        ck_assert_int_eq(call_text(f->ctl, VMMB_METHOD_ALLOC, params, &r), 0);
        ck_assert_msg(r.error && strcmp(r.error, error) == 0, "Alloc(%" PRIu64 "): wanted %s, got %s %s", size,
                      error, r.error ?: "success", json_object_to_json_string(r.params));
        ck_assert_msg(r.n_fds == 0, "the error came with %zu fds", r.n_fds);
        m = reply_str(&r, "message");
        ck_assert_msg(m && (!message || strstr(m, message)), "%s's message \"%s\" does not say \"%s\"", error,
                      m ?: "(none)", message);
        if (strcmp(error, VMMB_ERROR_OUT_OF_MEMORY) == 0) {
                json_object *v;

                ck_assert(json_object_object_get_ex(r.params, "requested", &v));
                ck_assert_uint_eq((uint64_t)json_object_get_int64(v), (size + GRAN - 1) / GRAN * GRAN);
                ck_assert(json_object_object_get_ex(r.params, "device", &v));
                ck_assert_int_eq(json_object_get_int64(v), 0);
        }
        reply_done(&r);
}

/* Leases `size` bytes on the control connection and frees it: its slabs end up cached for the test's uid. */
static void lease_and_free(Fixture *f, uint64_t size) {
        TestLease l;

        ck_assert_int_eq(lease_alloc(f->ctl, size, &l), 0);
        test_lease_close(&l);
        ck_assert_int_eq(lease_free(f->ctl, l.id), 0);
}

typedef struct UseArgs {
        const char *socket;
        uint64_t size;
} UseArgs;

/* A client: leases, maps, checks that the memory reads zero, leaves CANARY in it, unmaps and frees. */
static int child_use(void *userdata) {
        const UseArgs *a = userdata;
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        CUdeviceptr va = 0;
        TestLease l;
        CUresult r;
        Gpu g;
        int k;

        CHILD_CHECK(close_all_but(NULL, 0) == 0, "close_all_but");
        k = conn_open(a->socket, &c);
        CHILD_CHECK(k == 0, "connect: %s", strerror(-k));
        CHILD_CHECK(gpu_open(&g) == 0, "gpu_open");
        k = lease_alloc(c, a->size, &l);
        CHILD_CHECK(k == 0, "Alloc(%" PRIu64 "): %s", a->size, strerror(-k));
        CHILD_CHECK(gpu_map(&g, &l, &va) == 0, "map");
        if (gpu_verify(&g, va, l.size, 0) != 0)
                return 1;
        r = g.cu->cuMemsetD32(va, CANARY, l.size / 4);
        CHILD_CHECK(r == CUDA_SUCCESS, "cuMemsetD32: %s", cuda_result_name(g.cu, r));
        r = g.cu->cuCtxSynchronize();
        CHILD_CHECK(r == CUDA_SUCCESS, "cuCtxSynchronize: %s", cuda_result_name(g.cu, r));
        CHILD_CHECK(cuda_unmap(g.cu, va, l.sizes, l.n) == 0, "unmap");
        test_lease_close(&l);
        k = lease_free(c, l.id);
        CHILD_CHECK(k == 0, "Free: %s", strerror(-k));
        gpu_close(&g);
        return 0;
}

/* Runs child_use() in a client process and waits for it. */
static void use_lease(Fixture *f, uint64_t size) {
        UseArgs a = { .socket = f->h.socket, .size = size };
        pid_t pid = harness_fork(child_use, &a);

        ck_assert_int_gt(pid, 0);
        ck_assert_msg(harness_wait(pid) == 0, "a client leasing %" PRIu64 " bytes failed (see its stderr)", size);
}

/* After a fault: a new client gets zeroed memory and frees it, and Status answers on a new connection. */
static void check_healthy(Fixture *f, uint64_t size) {
        WireDevice d;
        int k;

        use_lease(f, size);
        k = harness_status(f->h.socket, &d);
        ck_assert_msg(k == 0, "Status on a new connection: %s", strerror(-k));
}

/* ---- requests that fail in the daemon ------------------------------------------------------------------ */

typedef struct AllocFault {
        const char *name;
        const char *faults;             /* the daemon's $SIMCUDA_FAIL */
        const char *memory;             /* the daemon's $SIMCUDA_MEMORY, or NULL */
        const char *args[4];            /* extra daemon options */
        uint64_t warm;                  /* first lease and free this much, so that it is cached (0: no) */
        uint64_t size;                  /* the request that fails */
        const char *error;
        const char *message;            /* in the error's message */
        bool released;                  /* slabs were made for it, then released */
        uint64_t evicted;               /* cached bytes released to make room for it (one slab), gone after */
} AllocFault;

#define OOM VMMB_ERROR_OUT_OF_MEMORY
#define DRIVER VMMB_ERROR_DRIVER_ERROR

static const AllocFault alloc_faults[] = {
        /* One slab (64 MiB), nothing cached. */
        { "driver out of memory", "cuMemCreate:1", NULL, {}, 0, 64 * MiB, OOM,
          "cuMemCreate on device 0: CUDA_ERROR_OUT_OF_MEMORY", false },
        { "cuMemCreate unknown error", "cuMemCreate:1:CUDA_ERROR_UNKNOWN", NULL, {}, 0, 64 * MiB, DRIVER,
          "cuMemCreate on device 0: CUDA_ERROR_UNKNOWN", false },
        { "cuMemCreate invalid value", "cuMemCreate:1:CUDA_ERROR_INVALID_VALUE", NULL, {}, 0, 64 * MiB, DRIVER,
          "cuMemCreate on device 0: CUDA_ERROR_INVALID_VALUE", false },
        { "cuMemCreate ECC error", "cuMemCreate:1:CUDA_ERROR_ECC_UNCORRECTABLE", NULL, {}, 0, 64 * MiB, DRIVER,
          "CUDA_ERROR_ECC_UNCORRECTABLE", false },
        { "cuMemCreate not permitted", "cuMemCreate:1:CUDA_ERROR_NOT_PERMITTED", NULL, {}, 0, 64 * MiB, DRIVER,
          "CUDA_ERROR_NOT_PERMITTED", false },
        { "export invalid value", "cuMemExportToShareableHandle:1:CUDA_ERROR_INVALID_VALUE", NULL, {}, 0,
          64 * MiB, DRIVER, "cuMemExportToShareableHandle on device 0: CUDA_ERROR_INVALID_VALUE", false },
        { "export out of memory", "cuMemExportToShareableHandle:1:CUDA_ERROR_OUT_OF_MEMORY", NULL, {}, 0,
          64 * MiB, DRIVER, "cuMemExportToShareableHandle on device 0: CUDA_ERROR_OUT_OF_MEMORY", false },
        { "export OS error", "cuMemExportToShareableHandle:1:CUDA_ERROR_OPERATING_SYSTEM", NULL, {}, 0,
          64 * MiB, DRIVER, "CUDA_ERROR_OPERATING_SYSTEM", false },
        /* Three slabs with a 32 MiB maximum (32 + 32 + 18 MiB): the ones made before the failure go back to
         * the driver. */
        { "3rd slab out of memory", "cuMemCreate:3", NULL, { "--max-slab", "32M" }, 0, 82 * MiB, OOM,
          "CUDA_ERROR_OUT_OF_MEMORY", true },
        { "2nd slab create error", "cuMemCreate:2:CUDA_ERROR_UNKNOWN", NULL, { "--max-slab", "32M" }, 0, 82 * MiB,
          DRIVER, "cuMemCreate on device 0: CUDA_ERROR_UNKNOWN", true },
        { "3rd slab export error", "cuMemExportToShareableHandle:3", NULL, { "--max-slab", "32M" }, 0, 82 * MiB,
          DRIVER, "cuMemExportToShareableHandle on device 0: CUDA_ERROR_UNKNOWN", true },
        /* Twenty 2 MiB slabs; the 17th fails. */
        { "17th of 20 slabs", "cuMemCreate:17:CUDA_ERROR_UNKNOWN", NULL, { "--max-slab", "2M" }, 0, 40 * MiB,
          DRIVER, "CUDA_ERROR_UNKNOWN", true },
        /* 64 MiB cached first (a 64 MiB maximum: 82 MiB is 64 + 18): the request takes it, then fails; it goes
         * back to the cache. */
        { "cache hit, then create error", "cuMemCreate:2:CUDA_ERROR_UNKNOWN", NULL, { "--max-slab", "64M" },
          64 * MiB, 82 * MiB, DRIVER, "CUDA_ERROR_UNKNOWN", false },
        /* 32 MiB cached first (82 MiB is 32 + 32 + 18): a hit, a slab made, then out of memory. */
        { "cache hit, slab made, then OOM", "cuMemCreate:3", NULL, { "--max-slab", "32M" }, 32 * MiB, 82 * MiB,
          OOM, "CUDA_ERROR_OUT_OF_MEMORY", true },
        { "cache hit, then export error", "cuMemExportToShareableHandle:2:CUDA_ERROR_INVALID_VALUE", NULL,
          { "--max-slab", "64M" }, 64 * MiB, 82 * MiB, DRIVER, "cuMemExportToShareableHandle", false },
        /* 80 MiB of capacity, 64 MiB cached: an 18 MiB request evicts the cached slab to make room, then its
         * create fails. The evicted slab stays released, as pool.h allows. */
        { "evicted for room, then error", "cuMemCreate:2:CUDA_ERROR_UNKNOWN", NULL, { "--capacity", "80M" },
          64 * MiB, 18 * MiB, DRIVER, "CUDA_ERROR_UNKNOWN", true, 64 * MiB },
        /* Not injected: the device (64 MiB) is smaller than the configured capacity (128 MiB), so the driver
         * runs out on the second slab (64 + 2 MiB), with nothing cached to release. */
        { "real out of memory", NULL, "64M", { "--capacity", "128M", "--max-slab", "64M" }, 0, 66 * MiB, OOM,
          "cuMemCreate on device 0: CUDA_ERROR_OUT_OF_MEMORY", true },
};

START_TEST(test_alloc_fault) {
        const AllocFault *c = &alloc_faults[_i];
        State before, want;
        Fixture f;

        fprintf(stderr, "case: %s (SIMCUDA_FAIL=%s)\n", c->name, c->faults ?: "");
        fixture_start(&f, c->faults, c->memory, c->args);
        if (c->warm > 0)
                lease_and_free(&f, c->warm);
        state_settled(&f, &before);

        alloc_fails(&f, c->size, c->error, c->message);
        /*
         * As before. Where slabs were made and released, their fds were closed (or the memory would stay
         * the driver's), and closing fds makes the pool prime one unbound slab when the daemon next goes
         * idle: that may have happened, once, and is as good.
         */
        before.d.cached -= c->evicted;
        before.fds -= c->evicted > 0 ? FDS_PER_SLAB : 0;
        want = primed(before, 1);
        expect_states(&f, &before, c->released ? &want : NULL, c->name);

        /* Every fault has fired: the next request works (on the 64 MiB device, a primed slab, if any, is
         * charged to the device, and the driver's out-of-memory makes the pool evict it). */
        check_healthy(&f, 64 * MiB);
        fixture_stop(&f);
}
END_TEST

/* ---- scrubs that fail in the daemon -------------------------------------------------------------------- */

typedef struct ScrubFault {
        const char *name;
        const char *faults;
        uint64_t size;                  /* the lease freed */
        uint64_t scrubbed;              /* bytes of it whose scrub worked, cached afterwards */
        unsigned n_scrubbed;            /* in so many slabs */
        bool ahead;                     /* the fault is the pool's mapping's, which the daemon may make ahead, while
                                           idle, a second or two after the Alloc (pool_idle()): a slow run (TSan)
                                           may meet it there, and then the scrub maps the slab and caches it */
} ScrubFault;

static const ScrubFault scrub_faults[] = {
        { "memset fails", "cuMemsetD8Async:1", 64 * MiB, 0, 0, false },
        { "memset out of memory", "cuMemsetD8Async:1:CUDA_ERROR_OUT_OF_MEMORY", 64 * MiB, 0, 0, false },
        { "completion callback fails", "cuLaunchHostFunc:1", 64 * MiB, 0, 0, false },
        { "scrub mapping: reserve fails", "cuMemAddressReserve:1", 64 * MiB, 0, 0, true },
        { "scrub mapping: map fails", "cuMemMap:1:CUDA_ERROR_INVALID_VALUE", 64 * MiB, 0, 0, true },
        { "scrub mapping: set access fails", "cuMemSetAccess:1", 64 * MiB, 0, 0, true },
        /* The first cuCtxSetCurrent is the pool's start; the second is the first scrub's (or mapping ahead's). */
        { "context switch fails", "cuCtxSetCurrent:2:CUDA_ERROR_CONTEXT_IS_DESTROYED", 64 * MiB, 0, 0, true },
        /* Two slabs (64 + 2 MiB): the first is scrubbed and cached, the second released. */
        { "2nd of 2 slabs", "cuMemsetD8Async:2", 66 * MiB, 64 * MiB, 1, false },
};

START_TEST(test_scrub_fault) {
        const ScrubFault *c = &scrub_faults[_i];
        State before, want, alt;
        Fixture f;

        fprintf(stderr, "case: %s (SIMCUDA_FAIL=%s)\n", c->name, c->faults);
        fixture_start(&f, c->faults, NULL, SLABS_64M);
        state_settled(&f, &before);

        /* A client leases, leaves CANARY in the memory and frees it; the daemon's scrub of it fails. Or, for a
         * fault of the pool's mapping, the daemon mapped the slab ahead, met the fault there and left the slab
         * to its scrub, which mapped it, zeroed it and cached it (`alt`, one slab). Either way no CANARY below. */
        use_lease(&f, c->size);
        want = before;
        want.d.cached += c->scrubbed;
        want.fds += (int)c->n_scrubbed * FDS_PER_SLAB;
        want = primed(want, 1);
        alt = before;
        alt.d.cached += c->size;
        alt.fds += FDS_PER_SLAB;
        ck_assert(!c->ahead || c->size == 64 * MiB);    /* one slab of SLABS_64M */
        expect_states(&f, &want, c->ahead ? &alt : NULL, c->name);

        /* The same user leases as much again: whatever it gets reads zero, never CANARY. */
        check_healthy(&f, c->size);
        fixture_stop(&f);
}
END_TEST

/* ---- faults in the client's process (libvmmbroker) ----------------------------------------------------- */

typedef struct ClientFault {
        const char *name;
        const char *faults;             /* for simcuda_fail() in the client, once connected */
        int error;                      /* what vmmb_alloc() or vmmb_attach() returns */
        const char *alloc_faults;       /* for vmmb_alloc() instead of `faults`, where it differs */
} ClientFault;

static const ClientFault client_faults[] = {
        { "import fails", "cuMemImportFromShareableHandle:1", -EIO },
        { "2nd import out of memory", "cuMemImportFromShareableHandle:2:CUDA_ERROR_OUT_OF_MEMORY", -ENOMEM },
        { "map invalid value", "cuMemMap:1:CUDA_ERROR_INVALID_VALUE", -EINVAL },
        { "2nd map fails", "cuMemMap:2", -EIO },
        /* an Alloc reserves its range while the reply is on the way, and once more when that failed */
        { "reserve out of memory", "cuMemAddressReserve:1:CUDA_ERROR_OUT_OF_MEMORY", -ENOMEM,
          "cuMemAddressReserve:1:CUDA_ERROR_OUT_OF_MEMORY,cuMemAddressReserve:2:CUDA_ERROR_OUT_OF_MEMORY" },
        { "set access fails", "cuMemSetAccess:1", -EIO },
        { "set access not permitted", "cuMemSetAccess:1:CUDA_ERROR_NOT_PERMITTED", -EPERM },
        { "device lookup fails", "cuDeviceGet:1:CUDA_ERROR_INVALID_DEVICE", -ENODEV },
};

#define CLIENT_SIZE (66 * MiB)          /* two slabs: 64 + 2 MiB (SLABS_64M) */

typedef struct ClientArgs {
        const char *socket;
        const ClientFault *fault;
        const char *token;              /* attach with this token instead of allocating */
        int to_test, from_test;         /* pipes: "connected"/"failed" to the test, "go" from it */
} ClientArgs;

static int child_client_fault(void *userdata) {
        const ClientArgs *a = userdata;
        const char *lib = getenv("VMMBROKER_LIBCUDA");
        int keep[2] = { a->to_test, a->from_test };
        __typeof__(&simcuda_fail) inject;
        __typeof__(&simcuda_live_allocations) live;
        vmmb_client *c = NULL;
        vmmb_lease *l = NULL;
        unsigned long live_before;
        const char *m, *spec;
        char go;
        void *h;
        int fds, k;

        CHILD_CHECK(close_all_but(keep, 2) == 0, "close_all_but");
        k = vmmb_connect(a->socket, &c);
        CHILD_CHECK(k == 0, "vmmb_connect: %s", strerror(-k));
        h = dlopen(lib, RTLD_NOW | RTLD_NOLOAD);
        CHILD_CHECK(h, "the driver %s is not loaded: %s", lib ?: "(unset)", dlerror());
        inject = (__typeof__(&simcuda_fail))dlsym(h, "simcuda_fail");
        live = (__typeof__(&simcuda_live_allocations))dlsym(h, "simcuda_live_allocations");
        CHILD_CHECK(inject && live, "no simcuda hooks in %s", lib);
        /* A round trip that changes nothing: the daemon has taken the connection (and the process as a
         * holder, with its pidfd) before the test takes its "before" state. */
        k = vmmb_unpublish(c, "faults-no-such-name");
        CHILD_CHECK(k == -ENOENT, "vmmb_unpublish: %s", strerror(-k));

        CHILD_CHECK(pipe_put(a->to_test, 'c') == 0, "pipe");
        CHILD_CHECK(pipe_get(a->from_test, &go, 1) == 1, "waiting for the test");

        fds = harness_fd_count(getpid());
        live_before = live();
        spec = !a->token && a->fault->alloc_faults ? a->fault->alloc_faults : a->fault->faults;
        CHILD_CHECK(inject(spec) == 0, "bad fault spec %s", spec);
        if (a->token)
                k = vmmb_attach(c, a->token, 0, &l);
        else
                k = vmmb_alloc(c, CLIENT_SIZE, VMMB_ANY_DEVICE, "fault", &l);
        m = vmmb_error_message();
        CHILD_CHECK(k == a->fault->error, "%s: got %d (%s), wanted %d (%s); \"%s\"", a->fault->name, k,
                    strerror(-k), a->fault->error, strerror(-a->fault->error), m);
        CHILD_CHECK(!l, "a lease came back with the error");
        CHILD_CHECK(m && *m, "no error message");
        fprintf(stderr, "%s: %s: \"%s\"\n", a->fault->name, strerror(-k), m);
        /* Nothing left in this process: no imported allocation, no mapping, no received fd. */
        CHILD_CHECK(live() == live_before, "%lu allocations alive, %lu before", live(), live_before);
        CHILD_CHECK(harness_fd_count(getpid()) == fds, "%d fds open, %d before", harness_fd_count(getpid()), fds);

        CHILD_CHECK(pipe_put(a->to_test, 'f') == 0, "pipe");
        CHILD_CHECK(pipe_get(a->from_test, &go, 1) == 1, "waiting for the test");

        /* The same call works now. */
        if (a->token)
                k = vmmb_attach(c, a->token, 0, &l);
        else
                k = vmmb_alloc(c, CLIENT_SIZE, VMMB_ANY_DEVICE, "fault", &l);
        CHILD_CHECK(k == 0, "after the fault: %s (%s)", strerror(-k), vmmb_error_message());
        k = vmmb_free(l);
        CHILD_CHECK(k == 0, "vmmb_free: %s", strerror(-k));
        vmmb_close(c);
        return 0;
}

/* Runs child_client_fault(): `before` is taken once it is connected; after its failure the daemon must be
 * back in that state. */
static void run_client_fault(Fixture *f, const ClientFault *fault, const char *token) {
        int to_test[2], from_test[2];
        State before;
        ClientArgs a;
        char c;
        pid_t pid;

        ck_assert_int_eq(pipe2(to_test, O_CLOEXEC), 0);
        ck_assert_int_eq(pipe2(from_test, O_CLOEXEC), 0);
        a = (ClientArgs){ .socket = f->h.socket, .fault = fault, .token = token, .to_test = to_test[1],
                          .from_test = from_test[0] };
        pid = harness_fork(child_client_fault, &a);
        ck_assert_int_gt(pid, 0);
        safe_close(to_test[1]);
        safe_close(from_test[0]);

        ck_assert_msg(pipe_get(to_test[0], &c, 1) == 1 && c == 'c', "the client did not connect");
        state_settled(f, &before);
        ck_assert_int_eq(pipe_put(from_test[1], 'g'), 0);
        ck_assert_msg(pipe_get(to_test[0], &c, 1) == 1 && c == 'f', "the client's checks failed (its stderr)");
        /* The lease (or hold) it could not map was given back: as it was, its slabs cached again. */
        expect_state(f, &before, fault->name);
        ck_assert_int_eq(pipe_put(from_test[1], 'g'), 0);
        ck_assert_msg(harness_wait(pid) == 0, "the client failed after the fault (see its stderr)");
        safe_close(to_test[0]);
        safe_close(from_test[1]);
}

START_TEST(test_client_alloc_fault) {
        const ClientFault *c = &client_faults[_i];
        Fixture f;

        fprintf(stderr, "case: vmmb_alloc, %s (%s)\n", c->name, c->faults);
        fixture_start(&f, NULL, NULL, SLABS_64M);
        /* Cached first, so that the lease given back returns to the same state. */
        lease_and_free(&f, CLIENT_SIZE);
        run_client_fault(&f, c, NULL);
        check_healthy(&f, CLIENT_SIZE);
        fixture_stop(&f);
}
END_TEST

START_TEST(test_client_attach_fault) {
        const ClientFault *c = &client_faults[_i];
        char params[128];
        ListReply list = {};
        const WireLeaseInfo *info;
        TestLease l;
        Fixture f;
        Reply r;

        fprintf(stderr, "case: vmmb_attach, %s (%s)\n", c->name, c->faults);
        fixture_start(&f, NULL, NULL, SLABS_64M);
        ck_assert_int_eq(lease_alloc(f.ctl, CLIENT_SIZE, &l), 0);
        test_lease_close(&l);
        snprintf(params, sizeof(params), "{\"id\": \"%s\"}", l.id);
        ck_assert_int_eq(call_text(f.ctl, VMMB_METHOD_SHARE, params, &r), 0);
        ck_assert_msg(!r.error && reply_str(&r, "token"), "Share: %s", r.error);

        run_client_fault(&f, c, reply_str(&r, "token"));

        /* The lease is the test's alone again. */
        ck_assert_int_eq(list_get(f.h.socket, true, &list), 0);
        info = list_find(&list, l.id);
        ck_assert_ptr_nonnull(info);
        ck_assert_uint_eq(info->n_holders, 1);
        ck_assert_int_eq(info->holders[0].pid, getpid());
        list_reply_done(&list);
        reply_done(&r);
        ck_assert_int_eq(lease_free(f.ctl, l.id), 0);
        check_healthy(&f, CLIENT_SIZE);
        fixture_stop(&f);
}
END_TEST

static Suite *faults_suite(void) {
        Suite *s = suite_create("faults");
        TCase *tc = tcase_create("faults");

        tcase_add_loop_test(tc, test_alloc_fault, 0, (int)ELEMENTSOF(alloc_faults));
        tcase_add_loop_test(tc, test_scrub_fault, 0, (int)ELEMENTSOF(scrub_faults));
        tcase_add_loop_test(tc, test_client_alloc_fault, 0, (int)ELEMENTSOF(client_faults));
        tcase_add_loop_test(tc, test_client_attach_fault, 0, (int)ELEMENTSOF(client_faults));
        suite_add_tcase(s, tc);
        return s;
}

int main(void) {
        return run_suite(faults_suite()) == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
