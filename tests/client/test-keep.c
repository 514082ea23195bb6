/* SPDX-License-Identifier: MIT */

/*
 * vmmb_free_keep() against the real daemon on the simulated device: the
 * broker keeps a freed lease for this process, and the library hands its
 * mapping back to the next vmmb_alloc() of the size with no driver call; what
 * the library does not keep, and when it gives kept leases back (the broker
 * asks for them, vmmb_close(), vmmb_give_back_kept(), an Alloc refused for a
 * limit). Each test starts its own vmmbrokerd (tests/integration/harness.c)
 * and opens the driver itself, with device 0's primary context current, to
 * write and read the leased memory through the library's pointer, and to
 * count the simulated driver's calls (simcuda.h).
 *
 * The broker carries out one connection's calls in order: after a one-way
 * Free (every keep but the first on a connection), a call answered on the
 * same client (barrier()) comes after it, and only then does a List on
 * another connection see what the Free did. The other processes are forked
 * (harness_fork()) after the library loaded the driver, which the simulated
 * device survives; on a real driver those tests say so and pass without
 * running.
 */

#include <check.h>
#include <dlfcn.h>
#include <errno.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "codec.h"
#include "driver.h"
#include "harness.h"
#include "macro.h"
#include "rawclient.h"
#include "simcuda.h"
#include "unit.h"
#include "varlink.h"
#include "vmmbroker.h"

#define MiB (UINT64_C(1) << 20)
#define NOBODY 65534
#define WAIT_USEC (UINT64_C(30) * 1000000)     /* failure guard on the waiting Allocs */

static Harness h;
static CudaDriver *cu;
static CUcontext ctx;
static __typeof__(&simcuda_calls) driver_calls;

static void driver_open(void) {
        _cleanup_free_ char *message = NULL;
        void *lib;
        int k;

        k = cuda_driver_open(&cu, NULL, &message);
        ck_assert_msg(k == 0, "cuda_driver_open: %s", message);
        ck_assert_int_eq(cu->cuDevicePrimaryCtxRetain(&ctx, 0), CUDA_SUCCESS);
        ck_assert_int_eq(cu->cuCtxSetCurrent(ctx), CUDA_SUCCESS);
        lib = dlopen(cu->path, RTLD_NOW | RTLD_NOLOAD);
        ck_assert_ptr_nonnull(lib);
        driver_calls = (__typeof__(driver_calls))dlsym(lib, "simcuda_calls");
        ck_assert(driver_calls || !strstr(cu->path, "simcuda"));      /* counted on the simulated device */
}

/* A daemon with 64 MiB slabs at most (66 MiB leases are two slabs), and `config` when given. */
static void start(const char *config) {
        const char *const args[] = { "--max-slab", "64M", NULL };
        int k;

        k = config ? harness_start_config(&h, config, args) : harness_start(&h, args);
        ck_assert_msg(k == 0, "harness_start: %s (is VMMBROKER_DAEMON set?)", strerror(-k));
        driver_open();
}

/* A daemon whose device holds `capacity` (harness_start_capped(): MaxBytes=1G, the socket open to all). */
static void start_capped(const char *capacity) {
        int k = harness_start_capped(&h, capacity, NULL);

        ck_assert_msg(k == 0, "harness_start_capped: %s", strerror(-k));
        driver_open();
}

static void teardown(void) {
        if (cu) {
                (void)cu->cuCtxSetCurrent(NULL);
                (void)cu->cuDevicePrimaryCtxRelease(0);
                cu = cuda_driver_close(cu);
        }
        ck_assert_int_eq(harness_stop(&h), 0);
}

/* How many times the simulated driver's `entry` was called in this process; 0 on a real driver. */
static uint64_t calls(const char *entry) {
        return driver_calls ? driver_calls(entry) : 0;
}

/* Whether the library unmapped since `before` calls of cuMemUnmap; always true where nothing is counted. */
static bool unmapped_since(uint64_t before) {
        return !driver_calls || calls("cuMemUnmap") > before;
}

/* The driver calls that mapping a lease makes, all added up. */
static uint64_t mapping_calls(void) {
        return calls("cuMemImportFromShareableHandle") + calls("cuMemAddressReserve") + calls("cuMemMap") +
               calls("cuMemSetAccess");
}

/* Whether forked children can use the driver this process opened: only the simulated device's. */
static bool skip_fork_on_real_driver(const char *test) {
        const char *lib = getenv("VMMBROKER_LIBCUDA");

        if (lib && strstr(lib, "simcuda"))
                return false;
        fprintf(stderr, "%s: not run: it forks after loading the driver, which only the simulated device "
                "survives\n", test);
        return true;
}

static vmmb_client *connect_or_fail(void) {
        vmmb_client *c = NULL;
        int k = vmmb_connect(h.socket, &c);

        ck_assert_msg(k == 0, "vmmb_connect: %s: %s", strerror(-k), vmmb_error_message());
        return c;
}

static vmmb_lease *alloc_or_fail(vmmb_client *c, uint64_t size, const char *label) {
        vmmb_lease *l = NULL;
        int k = vmmb_alloc(c, size, 0, label, &l);

        ck_assert_msg(k == 0, "vmmb_alloc(%llu): %s: %s", (unsigned long long)size, strerror(-k),
                      vmmb_error_message());
        return l;
}

static void keep_or_fail(vmmb_lease *l) {
        int k = vmmb_free_keep(l);

        ck_assert_msg(k == 0, "vmmb_free_keep: %s: %s", strerror(-k), vmmb_error_message());
}

/* A call answered on `c`: the broker has carried out every call the client sent before, one-way Frees too. */
static void barrier(vmmb_client *c) {
        ck_assert_int_eq(vmmb_revoke(c, "0123456789abcdef0123456789abcdef"), -ENOKEY);
}

/* Fills the lease with words that are never 0 (each differs, so a slab mapped elsewhere would show). */
static void fill(vmmb_lease *l) {
        size_t n = vmmb_lease_size(l) / sizeof(uint32_t);
        _cleanup_free_ uint32_t *buf = malloc(n * sizeof(uint32_t));

        ck_assert_ptr_nonnull(buf);
        for (size_t i = 0; i < n; i++)
                buf[i] = 0x80000000u | (uint32_t)i;
        ck_assert_int_eq(cu->cuMemcpyHtoD(vmmb_lease_ptr(l), buf, n * sizeof(uint32_t)), CUDA_SUCCESS);
        ck_assert_int_eq(cu->cuCtxSynchronize(), CUDA_SUCCESS);
}

/* Whether every word of `size` bytes at `ptr` reads 0; for children too. */
static bool reads_zero(uint64_t ptr, uint64_t size) {
        size_t n = size / sizeof(uint32_t);
        _cleanup_free_ uint32_t *buf = malloc(n * sizeof(uint32_t));

        if (!buf || cu->cuMemcpyDtoH(buf, ptr, n * sizeof(uint32_t)) != CUDA_SUCCESS)
                return false;
        for (size_t i = 0; i < n; i++)
                if (buf[i] != 0)
                        return false;
        return true;
}

/* What the daemon's List says of a lease of this user. */
typedef struct Listed {
        bool found;
        bool kept;
        size_t n_holders;
        char label[VMMB_LABEL_MAX + 1];
} Listed;

static Listed daemon_list(const char *id) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        _cleanup_free_ char *message = NULL;
        ListReply lr = {};
        Listed ret = {};
        Reply r = {};

        ck_assert_int_eq(harness_conn_open(h.socket, false, &c), 0);
        ck_assert_int_eq(call(c, VMMB_METHOD_LIST, NULL, &r), 0);
        ck_assert_int_eq(list_reply_decode(r.params, &lr, &message), 0);
        for (size_t i = 0; i < lr.n_leases; i++)
                if (strcmp(lr.leases[i].id, id) == 0)
                        ret = (Listed){ .found = true, .kept = lr.leases[i].kept,
                                        .n_holders = lr.leases[i].n_holders };
        for (size_t i = 0; i < lr.n_leases; i++)
                if (strcmp(lr.leases[i].id, id) == 0 && lr.leases[i].label)
                        snprintf(ret.label, sizeof(ret.label), "%s", lr.leases[i].label);
        list_reply_done(&lr);
        reply_done(&r);
        return ret;
}

/* Device 0 as the daemon's Status shows it. */
static WireDevice daemon_device(void) {
        WireDevice d;
        int k = harness_status(h.socket, &d);

        ck_assert_msg(k == 0, "Status failed: %s", strerror(-k));
        return d;
}

/* The leases of device 0, over all holders. */
static uint64_t daemon_leases(void) {
        return daemon_device().leases;
}

/* ---- reuse -------------------------------------------------------------------------------------------- */

/*
 * A two-slab lease written with a pattern and kept: the daemon lists it kept and counts it in Status; the next
 * Alloc of its size gets the same lease, at the same address, zeroed, with no driver call at either end; a
 * second keep on the connection (one-way) does the same.
 */
START_TEST(test_keep_reuses_mapping) {
        vmmb_client *c;
        vmmb_lease *l, *again;
        char id[VMMB_ID_MAX + 1];
        uint64_t ptr, unmaps, maps;
        WireDevice d;
        Listed s;

        start(NULL);
        c = connect_or_fail();
        l = alloc_or_fail(c, 66 * MiB, "first");
        snprintf(id, sizeof(id), "%s", vmmb_lease_id(l));
        ptr = vmmb_lease_ptr(l);
        fill(l);

        unmaps = calls("cuMemUnmap");
        maps = mapping_calls();
        ck_assert(maps > 0 || !driver_calls);                         /* the first Alloc mapped it */
        keep_or_fail(l);
        ck_assert_uint_eq(calls("cuMemUnmap"), unmaps);                 /* not unmapped */
        /* the first keep on the connection was answered: the daemon has it kept already */
        s = daemon_list(id);
        ck_assert(s.found && s.kept);
        d = daemon_device();
        ck_assert_uint_eq(d.leased, 66 * MiB);                         /* still leased, and counted kept */
        ck_assert_uint_eq(d.kept, 66 * MiB);

        again = alloc_or_fail(c, 66 * MiB, "second");
        ck_assert_str_eq(vmmb_lease_id(again), id);
        ck_assert_uint_eq(vmmb_lease_ptr(again), ptr);
        ck_assert_uint_eq(vmmb_lease_size(again), 66 * MiB);
        ck_assert_uint_eq(mapping_calls(), maps);                      /* not imported, mapped or given access */
        ck_assert(reads_zero(ptr, 66 * MiB));                           /* zeroed by the daemon, across both slabs */
        s = daemon_list(id);
        ck_assert(s.found && !s.kept);
        ck_assert_str_eq(s.label, "second");                            /* the label as asked */
        ck_assert_uint_eq(daemon_device().kept, 0);

        /* Again, one-way this time: the Alloc on the same client comes after the Free. */
        fill(again);
        keep_or_fail(again);
        l = alloc_or_fail(c, 66 * MiB, NULL);
        ck_assert_str_eq(vmmb_lease_id(l), id);
        ck_assert_uint_eq(vmmb_lease_ptr(l), ptr);
        ck_assert_uint_eq(mapping_calls(), maps);
        ck_assert_uint_eq(calls("cuMemUnmap"), unmaps);
        ck_assert(reads_zero(ptr, 66 * MiB));

        ck_assert_int_eq(vmmb_free(l), 0);
        ck_assert(!daemon_list(id).found);
        ck_assert_int_eq(vmmb_free_keep(NULL), 0);
        vmmb_close(c);
}
END_TEST

/* Another size gets a new lease and leaves the kept one kept; the kept one comes back for its size later. */
START_TEST(test_keep_other_size) {
        vmmb_client *c;
        vmmb_lease *a, *b, *a2, *d;
        char ida[VMMB_ID_MAX + 1];
        uint64_t ptra;

        start(NULL);
        c = connect_or_fail();
        a = alloc_or_fail(c, 4 * MiB, NULL);
        snprintf(ida, sizeof(ida), "%s", vmmb_lease_id(a));
        ptra = vmmb_lease_ptr(a);
        fill(a);
        keep_or_fail(a);

        b = alloc_or_fail(c, 2 * MiB, NULL);
        ck_assert_str_ne(vmmb_lease_id(b), ida);
        ck_assert_uint_ne(vmmb_lease_ptr(b), ptra);
        ck_assert(reads_zero(vmmb_lease_ptr(b), 2 * MiB));
        ck_assert(daemon_list(ida).kept);

        a2 = alloc_or_fail(c, 3 * MiB, NULL);                           /* rounded up: 4 MiB */
        ck_assert_str_eq(vmmb_lease_id(a2), ida);
        ck_assert_uint_eq(vmmb_lease_ptr(a2), ptra);
        ck_assert(reads_zero(ptra, 4 * MiB));

        d = alloc_or_fail(c, 4 * MiB, NULL);                            /* nothing of 4 MiB kept any more */
        ck_assert_str_ne(vmmb_lease_id(d), ida);
        ck_assert_uint_eq(daemon_leases(), 3);

        ck_assert_int_eq(vmmb_free(a2), 0);
        ck_assert_int_eq(vmmb_free(b), 0);
        ck_assert_int_eq(vmmb_free(d), 0);
        ck_assert_uint_eq(daemon_leases(), 0);
        vmmb_close(c);
}
END_TEST

/*
 * The first keep on a connection is answered, so the daemon lists the lease kept at once; later keeps are
 * one-way: the daemon lists them kept once a later call on the client was answered. A client of the same
 * process gets a lease another one kept: the process holds it.
 */
START_TEST(test_keep_answered_then_oneway) {
        vmmb_client *c, *other;
        vmmb_lease *l[3], *back;
        char id[3][VMMB_ID_MAX + 1];
        uint64_t ptr2;

        start(NULL);
        c = connect_or_fail();
        for (size_t i = 0; i < 3; i++) {
                l[i] = alloc_or_fail(c, (i + 1) * 2 * MiB, NULL);
                snprintf(id[i], sizeof(id[i]), "%s", vmmb_lease_id(l[i]));
        }
        ptr2 = vmmb_lease_ptr(l[2]);
        keep_or_fail(l[0]);
        ck_assert(daemon_list(id[0]).kept);
        keep_or_fail(l[1]);
        keep_or_fail(l[2]);
        barrier(c);
        ck_assert(daemon_list(id[1]).kept);
        ck_assert(daemon_list(id[2]).kept);
        ck_assert_uint_eq(daemon_device().kept, 12 * MiB);

        other = connect_or_fail();
        back = alloc_or_fail(other, 6 * MiB, NULL);
        ck_assert_str_eq(vmmb_lease_id(back), id[2]);
        ck_assert_uint_eq(vmmb_lease_ptr(back), ptr2);
        ck_assert(reads_zero(ptr2, 6 * MiB));
        /* a reclaimable mark on the other client shares the process's watch, which keeping started */
        ck_assert_int_eq(vmmb_lease_set_reclaimable(back, 3, NULL, NULL), 0);
        ck_assert_int_eq(vmmb_free(back), 0);
        vmmb_close(other);

        vmmb_close(c);                  /* gives back the two kept through it */
        ck_assert_uint_eq(daemon_leases(), 0);
}
END_TEST

/* ---- what is not kept ---------------------------------------------------------------------------------- */

/* A lease shared, published, attached or parked is freed plainly, as by vmmb_free_oneway(). */
START_TEST(test_keep_falls_back) {
        char token[VMMB_TOKEN_SIZE], id[VMMB_ID_MAX + 1];
        vmmb_lease *l, *attached;
        vmmb_client *c;
        uint64_t unmaps;
        Listed s;

        start(NULL);
        c = connect_or_fail();

        /* shared: the process's only hold, freed; the lease ends */
        l = alloc_or_fail(c, 2 * MiB, NULL);
        snprintf(id, sizeof(id), "%s", vmmb_lease_id(l));
        ck_assert_int_eq(vmmb_share(l, VMMB_ANY_UID, 0, token), 0);
        unmaps = calls("cuMemUnmap");
        keep_or_fail(l);
        ck_assert(unmapped_since(unmaps));                /* unmapped, as by a plain free */
        barrier(c);
        ck_assert(!daemon_list(id).found);

        /* published: the hold ends, the lease stays under its name, held by nobody, not kept */
        l = alloc_or_fail(c, 2 * MiB, NULL);
        snprintf(id, sizeof(id), "%s", vmmb_lease_id(l));
        ck_assert_int_eq(vmmb_publish(l, "keep-published", NULL, 0, 0), 0);
        keep_or_fail(l);
        barrier(c);
        s = daemon_list(id);
        ck_assert(s.found && !s.kept);
        ck_assert_uint_eq(s.n_holders, 0);
        ck_assert_int_eq(vmmb_unpublish(c, "keep-published"), 0);
        ck_assert(!daemon_list(id).found);

        /* attached through the same client: each object is freed plainly, the lease ends with the last */
        l = alloc_or_fail(c, 4 * MiB, NULL);
        snprintf(id, sizeof(id), "%s", vmmb_lease_id(l));
        ck_assert_int_eq(vmmb_share(l, VMMB_ANY_UID, 0, token), 0);
        ck_assert_int_eq(vmmb_attach(c, token, 0, &attached), 0);
        keep_or_fail(attached);
        barrier(c);
        s = daemon_list(id);
        ck_assert(s.found && !s.kept);
        keep_or_fail(l);
        barrier(c);
        ck_assert(!daemon_list(id).found);

        /* parked once: freed plainly */
        l = alloc_or_fail(c, 4 * MiB, NULL);
        snprintf(id, sizeof(id), "%s", vmmb_lease_id(l));
        ck_assert_int_eq(vmmb_lease_park(l, NULL), 1);
        ck_assert_int_eq(vmmb_lease_unpark(l), 0);
        keep_or_fail(l);
        barrier(c);
        ck_assert(!daemon_list(id).found);

        ck_assert_uint_eq(daemon_leases(), 0);
        vmmb_close(c);
}
END_TEST

typedef struct OtherArgs {
        const char *socket;
        const char *kept_id;            /* the parent's kept lease */
        uint64_t size;
} OtherArgs;

/* In a forked child: reports and returns 1, never asserts (check's assertions belong to the test process);
 * rawclient.h's, with the library's message. */
#undef CHILD_CHECK
#define CHILD_CHECK(cond, ...)                                                                          \
        do {                                                                                            \
                if (!(cond)) {                                                                          \
                        fprintf(stderr, "child %d: %s:%d: ", (int)getpid(), __FILE__, __LINE__);        \
                        fprintf(stderr, __VA_ARGS__);                                                   \
                        fprintf(stderr, " (%s)\n", vmmb_error_message());                               \
                        return 1;                                                                       \
                }                                                                                       \
        } while (0)

/* As uid 65534: an Alloc of the size of root's kept lease gets a lease of its own, zeroed. */
static int child_other_user(void *arg) {
        const OtherArgs *a = arg;
        vmmb_client *c = NULL;
        vmmb_lease *l = NULL;
        int k;

        CHILD_CHECK(setgroups(0, NULL) == 0 && setgid(NOBODY) == 0 && setuid(NOBODY) == 0, "cannot drop to nobody");
        CHILD_CHECK(cu->cuCtxSetCurrent(ctx) == CUDA_SUCCESS, "cuCtxSetCurrent");
        k = vmmb_connect(a->socket, &c);
        CHILD_CHECK(k == 0, "vmmb_connect: %s", strerror(-k));
        k = vmmb_alloc(c, a->size, 0, "nobody", &l);
        CHILD_CHECK(k == 0, "vmmb_alloc: %s", strerror(-k));
        CHILD_CHECK(strcmp(vmmb_lease_id(l), a->kept_id) != 0, "nobody got root's kept lease %s", a->kept_id);
        CHILD_CHECK(vmmb_lease_owner(l) == NOBODY, "owner %u", (unsigned)vmmb_lease_owner(l));
        CHILD_CHECK(reads_zero(vmmb_lease_ptr(l), a->size), "nobody's lease does not read zero");
        /* and a keep of its own is its own */
        k = vmmb_free_keep(l);
        CHILD_CHECK(k == 0, "vmmb_free_keep: %s", strerror(-k));
        vmmb_close(c);
        return 0;
}

/* Another user's process asking for the size of a kept lease gets a lease of its own; the keeper keeps its. */
START_TEST(test_keep_other_user) {
        char id[VMMB_ID_MAX + 1];
        vmmb_client *c;
        vmmb_lease *l;
        uint64_t ptr;
        pid_t pid;

        start(NULL);
        if (skip_fork_on_real_driver(__func__))
                return;
        if (geteuid() != 0) {
                fprintf(stderr, "%s: not root: another user's process not run\n", __func__);
                return;
        }
        ck_assert_int_eq(chmod(h.dir, 0711), 0);
        ck_assert_int_eq(chmod(h.socket, 0666), 0);
        c = connect_or_fail();
        l = alloc_or_fail(c, 4 * MiB, NULL);
        snprintf(id, sizeof(id), "%s", vmmb_lease_id(l));
        ptr = vmmb_lease_ptr(l);
        fill(l);
        keep_or_fail(l);

        pid = harness_fork(child_other_user, &(OtherArgs){ .socket = h.socket, .kept_id = id, .size = 4 * MiB });
        ck_assert_int_gt(pid, 0);
        ck_assert_msg(harness_wait(pid) == 0, "the child failed (see its stderr)");

        ck_assert(daemon_list(id).kept);
        l = alloc_or_fail(c, 4 * MiB, NULL);
        ck_assert_str_eq(vmmb_lease_id(l), id);
        ck_assert_uint_eq(vmmb_lease_ptr(l), ptr);
        ck_assert(reads_zero(ptr, 4 * MiB));
        ck_assert_int_eq(vmmb_free(l), 0);
        ck_assert_uint_eq(daemon_leases(), 0);         /* nobody's kept lease ended with its process */
        vmmb_close(c);
}
END_TEST

/* ---- giving back ---------------------------------------------------------------------------------------- */

typedef struct WaiterArgs {
        const char *socket;
        uint64_t size;
        bool wait;                      /* vmmb_alloc_wait(), else vmmb_alloc() (the daemon waits for kept memory) */
        const char *kept_id;
} WaiterArgs;

/* Another process on the full device: served once the keeper's library gave its kept lease back. */
static int child_waiter(void *arg) {
        const WaiterArgs *a = arg;
        vmmb_client *c = NULL;
        vmmb_lease *l = NULL;
        int k;

        CHILD_CHECK(cu->cuCtxSetCurrent(ctx) == CUDA_SUCCESS, "cuCtxSetCurrent");
        k = vmmb_connect(a->socket, &c);
        CHILD_CHECK(k == 0, "vmmb_connect: %s", strerror(-k));
        k = a->wait ? vmmb_alloc_wait(c, a->size, 0, "waiter", WAIT_USEC, &l) :
                      vmmb_alloc(c, a->size, 0, "waiter", &l);
        CHILD_CHECK(k == 0, "the alloc was not served: %s", strerror(-k));
        CHILD_CHECK(strcmp(vmmb_lease_id(l), a->kept_id) != 0, "got the other process's kept lease");
        CHILD_CHECK(reads_zero(vmmb_lease_ptr(l), a->size), "does not read zero");
        CHILD_CHECK(vmmb_free(l) == 0, "vmmb_free");
        vmmb_close(c);
        return 0;
}

/*
 * A device that one kept lease fills: another process's Alloc, waiting or not (the daemon waits for kept
 * memory), is served, because the daemon asks for the kept lease and the keeper's library gives it back on its
 * own, with nobody calling it.
 */
START_TEST(test_kept_given_back_when_asked) {
        char id[VMMB_ID_MAX + 1];
        vmmb_client *c;
        vmmb_lease *l;
        pid_t pid;

        start_capped("8M");
        if (skip_fork_on_real_driver(__func__))
                return;
        c = connect_or_fail();
        for (int round = 0; round < 2; round++) {
                l = alloc_or_fail(c, 8 * MiB, NULL);
                snprintf(id, sizeof(id), "%s", vmmb_lease_id(l));
                fill(l);
                keep_or_fail(l);
                barrier(c);
                ck_assert(daemon_list(id).kept);

                pid = harness_fork(child_waiter, &(WaiterArgs){ .socket = h.socket, .size = 8 * MiB,
                                                                .wait = round == 0, .kept_id = id });
                ck_assert_int_gt(pid, 0);
                ck_assert_msg(harness_wait(pid) == 0, "the waiter failed (see its stderr)");
                ck_assert(!daemon_list(id).found);
                ck_assert_uint_eq(daemon_leases(), 0);
        }
        /* the table forgot it: the next Alloc of the size gets a new lease, mapped anew */
        l = alloc_or_fail(c, 8 * MiB, NULL);
        ck_assert_str_ne(vmmb_lease_id(l), id);
        ck_assert(reads_zero(vmmb_lease_ptr(l), 8 * MiB));
        ck_assert_int_eq(vmmb_free(l), 0);
        vmmb_close(c);
}
END_TEST

/* vmmb_close() gives back what the client kept; vmmb_give_back_kept() what one client kept, and only that. */
START_TEST(test_close_and_give_back) {
        vmmb_client *c, *c2, *c3;
        vmmb_lease *l;
        const uint64_t sizes[] = { 2 * MiB, 4 * MiB, 66 * MiB };

        start(NULL);
        c = connect_or_fail();
        for (size_t i = 0; i < ELEMENTSOF(sizes); i++)
                keep_or_fail(alloc_or_fail(c, sizes[i], NULL));
        barrier(c);
        ck_assert_uint_eq(daemon_device().kept, 72 * MiB);
        vmmb_close(c);
        ck_assert_uint_eq(daemon_leases(), 0);
        ck_assert_uint_eq(daemon_device().kept, 0);

        c2 = connect_or_fail();
        c3 = connect_or_fail();
        keep_or_fail(alloc_or_fail(c2, 2 * MiB, NULL));
        keep_or_fail(alloc_or_fail(c2, 4 * MiB, NULL));
        l = alloc_or_fail(c3, 6 * MiB, NULL);
        keep_or_fail(l);
        barrier(c2);
        ck_assert_uint_eq(daemon_device().kept, 12 * MiB);
        ck_assert_int_eq(vmmb_give_back_kept(c2), 2);
        ck_assert_uint_eq(daemon_leases(), 1);                         /* c3's is left */
        ck_assert_uint_eq(daemon_device().kept, 6 * MiB);
        ck_assert_int_eq(vmmb_give_back_kept(c2), 0);
        ck_assert_int_eq(vmmb_give_back_kept(NULL), -EINVAL);
        ck_assert_str_ne(vmmb_error_message(), "");
        ck_assert_int_eq(vmmb_give_back_kept(c3), 1);
        ck_assert_uint_eq(daemon_leases(), 0);
        vmmb_close(c2);
        vmmb_close(c3);
}
END_TEST

/*
 * Near the user's MaxBytes= (8M) with a kept lease of 6 MiB, an Alloc of 4 MiB fits only if the kept lease
 * goes: the daemon refuses it (QuotaExceeded), the library gives its kept leases back and asks again.
 */
START_TEST(test_keep_quota_retry) {
        char id[VMMB_ID_MAX + 1];
        vmmb_client *c;
        vmmb_lease *a, *b = NULL;

        start("[Limits]\nMaxBytes=8M\n");
        c = connect_or_fail();
        ck_assert_int_eq(vmmb_alloc(c, 10 * MiB, 0, NULL, &b), -EDQUOT);      /* over the limit in any case */
        a = alloc_or_fail(c, 6 * MiB, NULL);
        snprintf(id, sizeof(id), "%s", vmmb_lease_id(a));
        keep_or_fail(a);
        ck_assert(daemon_list(id).kept);

        b = alloc_or_fail(c, 4 * MiB, NULL);
        ck_assert_str_ne(vmmb_lease_id(b), id);
        ck_assert(reads_zero(vmmb_lease_ptr(b), 4 * MiB));
        ck_assert(!daemon_list(id).found);
        ck_assert_uint_eq(daemon_leases(), 1);
        ck_assert_int_eq(vmmb_free(b), 0);
        vmmb_close(c);
}
END_TEST

int main(void) {
        Suite *s = suite_create("keep");
        TCase *tc = tcase_create("keep");
        int failed;

        tcase_add_checked_fixture(tc, NULL, teardown);
        tcase_add_test(tc, test_keep_reuses_mapping);
        tcase_add_test(tc, test_keep_other_size);
        tcase_add_test(tc, test_keep_answered_then_oneway);
        tcase_add_test(tc, test_keep_falls_back);
        tcase_add_test(tc, test_keep_other_user);
        tcase_add_test(tc, test_kept_given_back_when_asked);
        tcase_add_test(tc, test_close_and_give_back);
        tcase_add_test(tc, test_keep_quota_retry);
        suite_add_tcase(s, tc);

        failed = run_suite(s);
        return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
