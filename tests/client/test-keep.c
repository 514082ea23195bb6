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
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "checked.h"
#include "clienttest.h"
#include "codec.h"
#include "driver.h"
#include "harness.h"
#include "macro.h"
#include "unit.h"
#include "vmmbroker.h"

#define WAIT_USEC (UINT64_C(30) * 1000000)     /* failure guard on the waiting Allocs */

static Harness h;

/* Opens the driver (driver_open_or_fail()); on the simulated device, which counts its calls. */
static void open_driver(void) {
        driver_open_or_fail();
        ck_assert(driver_counts() || !strstr(cu->path, "simcuda"));   /* counted on the simulated device */
}

/* A daemon with 64 MiB slabs at most (66 MiB leases are two slabs), and `config` when given. */
static void start(const char *config) {
        harness_start_or_fail(&h, config, (const char *const[]){ "--max-slab", "64M", NULL });
        open_driver();
}

/* A daemon whose device holds `capacity` (harness_start_capped(): MaxBytes=1G, the socket open to all). */
static void start_capped(const char *capacity) {
        harness_start_capped_or_fail(&h, capacity, NULL);
        open_driver();
}

static void teardown(void) {
        driver_close();
        harness_stop_or_fail(&h);
}

/* Whether the library unmapped since `before` calls of cuMemUnmap; always true where nothing is counted. */
static bool unmapped_since(uint64_t before) {
        return !driver_counts() || driver_calls("cuMemUnmap") > before;
}

/* The driver calls that mapping a lease makes, all added up. */
static uint64_t mapping_calls(void) {
        return driver_calls("cuMemImportFromShareableHandle") + driver_calls("cuMemAddressReserve") +
               driver_calls("cuMemMap") + driver_calls("cuMemSetAccess");
}

static void keep_or_fail(vmmb_lease *l) {
        int k = vmmb_free_keep(l);

        ck_assert_msg(k == 0, "vmmb_free_keep: %s: %s", strerror(-k), vmmb_error_message());
}

/* A call answered on `c`: the broker has carried out every call the client sent before, one-way Frees too. */
static void barrier(vmmb_client *c) {
        ck_assert_int_eq(vmmb_revoke(c, "0123456789abcdef0123456789abcdef"), -ENOKEY);
}

/* vmmb_free_keep() of leases[0..n) on a thread of its own, so that the test can go on while one waits. */
typedef struct KeepOp {
        pthread_t thread;
        vmmb_lease **leases;
        size_t n;
        int result;
        char message[1024];             /* vmmb_error_message() of the thread */
} KeepOp;

static void *keep_op_run(void *arg) {
        KeepOp *o = arg;

        for (size_t i = 0; i < o->n && o->result == 0; i++)
                o->result = vmmb_free_keep(o->leases[i]);
        snprintf(o->message, sizeof(o->message), "%s", vmmb_error_message());
        return NULL;
}

/*
 * Keeps leases[0..n) while the daemon is stopped (harness_freeze()): true when every vmmb_free_keep() returned
 * while it was, so that none waited for an answer; false when they still waited after WAIT_USEC, a failure
 * guard (one-way keeps return at once). Either way the daemon goes on before anything is asserted, and the
 * keeps have all returned 0 when this returns.
 */
static bool keep_while_frozen(vmmb_lease **leases, size_t n) {
        KeepOp o = { .leases = leases, .n = n };
        struct timespec deadline;
        bool returned = false;
        int k;

        ck_assert_int_eq(harness_freeze(&h), 0);
        k = pthread_create(&o.thread, NULL, keep_op_run, &o);
        if (k == 0) {
                (void)clock_gettime(CLOCK_REALTIME, &deadline);
                deadline.tv_sec += WAIT_USEC / 1000000;
                returned = pthread_timedjoin_np(o.thread, NULL, &deadline) == 0;
        }
        ck_assert_int_eq(harness_thaw(&h), 0);
        ck_assert_int_eq(k, 0);
        if (!returned)
                ck_assert_int_eq(pthread_join(o.thread, NULL), 0);     /* answered, now that the daemon goes on */
        ck_assert_msg(o.result == 0, "vmmb_free_keep: %s: %s", strerror(-o.result), o.message);
        return returned;
}

/* Fills the lease with words that are never 0 (each differs, so a slab mapped elsewhere would show). */
static void fill_nonzero(vmmb_lease *l) {
        size_t n = vmmb_lease_size(l) / sizeof(uint32_t);
        _cleanup_free_ uint32_t *buf = malloc(n * sizeof(uint32_t));

        ck_assert_ptr_nonnull(buf);
        for (size_t i = 0; i < n; i++)
                buf[i] = 0x80000000u | (uint32_t)i;
        ck_assert_int_eq(cu->cuMemcpyHtoD(vmmb_lease_ptr(l), buf, n * sizeof(uint32_t)), CUDA_SUCCESS);
        ck_assert_int_eq(cu->cuCtxSynchronize(), CUDA_SUCCESS);
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
        c = connect_or_fail(h.socket);
        l = alloc_or_fail(c, 66 * MiB, 0, "first");
        snprintf(id, sizeof(id), "%s", vmmb_lease_id(l));
        ptr = vmmb_lease_ptr(l);
        fill_nonzero(l);

        unmaps = driver_calls("cuMemUnmap");
        maps = mapping_calls();
        ck_assert(maps > 0 || !driver_counts());                      /* the first Alloc mapped it */
        keep_or_fail(l);
        ck_assert_uint_eq(driver_calls("cuMemUnmap"), unmaps);          /* not unmapped */
        /* the first keep on the connection was answered: the daemon has it kept already */
        s = daemon_list(h.socket, id);
        ck_assert(s.found && s.kept);
        d = daemon_device(h.socket);
        ck_assert_uint_eq(d.leased, 66 * MiB);                         /* still leased, and counted kept */
        ck_assert_uint_eq(d.kept, 66 * MiB);

        again = alloc_or_fail(c, 66 * MiB, 0, "second");
        ck_assert_str_eq(vmmb_lease_id(again), id);
        ck_assert_uint_eq(vmmb_lease_ptr(again), ptr);
        ck_assert_uint_eq(vmmb_lease_size(again), 66 * MiB);
        ck_assert_uint_eq(mapping_calls(), maps);                      /* not imported, mapped or given access */
        ck_assert(words_are(ptr, 66 * MiB, 0));                         /* zeroed by the daemon, across both slabs */
        s = daemon_list(h.socket, id);
        ck_assert(s.found && !s.kept);
        ck_assert_str_eq(s.label, "second");                            /* the label as asked */
        ck_assert_uint_eq(daemon_device(h.socket).kept, 0);

        /* Again, one-way this time: the Alloc on the same client comes after the Free. */
        fill_nonzero(again);
        keep_or_fail(again);
        l = alloc_or_fail(c, 66 * MiB, 0, NULL);
        ck_assert_str_eq(vmmb_lease_id(l), id);
        ck_assert_uint_eq(vmmb_lease_ptr(l), ptr);
        ck_assert_uint_eq(mapping_calls(), maps);
        ck_assert_uint_eq(driver_calls("cuMemUnmap"), unmaps);
        ck_assert(words_are(ptr, 66 * MiB, 0));

        ck_assert_int_eq(vmmb_free(l), 0);
        ck_assert(!daemon_list(h.socket, id).found);
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
        c = connect_or_fail(h.socket);
        a = alloc_or_fail(c, 4 * MiB, 0, NULL);
        snprintf(ida, sizeof(ida), "%s", vmmb_lease_id(a));
        ptra = vmmb_lease_ptr(a);
        fill_nonzero(a);
        keep_or_fail(a);

        b = alloc_or_fail(c, 2 * MiB, 0, NULL);
        ck_assert_str_ne(vmmb_lease_id(b), ida);
        ck_assert_uint_ne(vmmb_lease_ptr(b), ptra);
        ck_assert(words_are(vmmb_lease_ptr(b), 2 * MiB, 0));
        ck_assert(daemon_list(h.socket, ida).kept);

        a2 = alloc_or_fail(c, 3 * MiB, 0, NULL);                        /* rounded up: 4 MiB */
        ck_assert_str_eq(vmmb_lease_id(a2), ida);
        ck_assert_uint_eq(vmmb_lease_ptr(a2), ptra);
        ck_assert(words_are(ptra, 4 * MiB, 0));

        d = alloc_or_fail(c, 4 * MiB, 0, NULL);                         /* nothing of 4 MiB kept any more */
        ck_assert_str_ne(vmmb_lease_id(d), ida);
        ck_assert_uint_eq(daemon_leases(h.socket), 3);

        ck_assert_int_eq(vmmb_free(a2), 0);
        ck_assert_int_eq(vmmb_free(b), 0);
        ck_assert_int_eq(vmmb_free(d), 0);
        ck_assert_uint_eq(daemon_leases(h.socket), 0);
        vmmb_close(c);
}
END_TEST

/*
 * The first keep on a connection is answered, so the daemon lists the lease kept at once; later keeps are
 * one-way: they return while the daemon is stopped, when no answer can come, and the daemon lists them kept
 * once a later call on the client was answered. A client of the same process gets a lease another one kept:
 * the process holds it.
 */
START_TEST(test_keep_answered_then_oneway) {
        vmmb_client *c, *other;
        vmmb_lease *l[3], *back;
        char id[3][VMMB_ID_MAX + 1];
        uint64_t ptr2;

        start(NULL);
        c = connect_or_fail(h.socket);
        for (size_t i = 0; i < 3; i++) {
                l[i] = alloc_or_fail(c, (i + 1) * 2 * MiB, 0, NULL);
                snprintf(id[i], sizeof(id[i]), "%s", vmmb_lease_id(l[i]));
        }
        ptr2 = vmmb_lease_ptr(l[2]);
        keep_or_fail(l[0]);
        ck_assert(daemon_list(h.socket, id[0]).kept);
        ck_assert_msg(keep_while_frozen(&l[1], 2), "a keep after the first on the connection waited for the "
                      "daemon's answer: it was not sent one-way");
        barrier(c);
        ck_assert(daemon_list(h.socket, id[1]).kept);
        ck_assert(daemon_list(h.socket, id[2]).kept);
        ck_assert_uint_eq(daemon_device(h.socket).kept, 12 * MiB);

        other = connect_or_fail(h.socket);
        back = alloc_or_fail(other, 6 * MiB, 0, NULL);
        ck_assert_str_eq(vmmb_lease_id(back), id[2]);
        ck_assert_uint_eq(vmmb_lease_ptr(back), ptr2);
        ck_assert(words_are(ptr2, 6 * MiB, 0));
        /* a reclaimable mark on the other client shares the process's watch, which keeping started */
        ck_assert_int_eq(vmmb_lease_set_reclaimable(back, 3, NULL, NULL), 0);
        ck_assert_int_eq(vmmb_free(back), 0);
        vmmb_close(other);

        vmmb_close(c);                  /* gives back the two kept through it */
        ck_assert_uint_eq(daemon_leases(h.socket), 0);
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
        c = connect_or_fail(h.socket);

        /* shared: the process's only hold, freed; the lease ends */
        l = alloc_or_fail(c, 2 * MiB, 0, NULL);
        snprintf(id, sizeof(id), "%s", vmmb_lease_id(l));
        ck_assert_int_eq(vmmb_share(l, VMMB_ANY_UID, 0, token), 0);
        unmaps = driver_calls("cuMemUnmap");
        keep_or_fail(l);
        ck_assert(unmapped_since(unmaps));                /* unmapped, as by a plain free */
        barrier(c);
        ck_assert(!daemon_list(h.socket, id).found);

        /* published: the hold ends, the lease stays under its name, held by nobody, not kept */
        l = alloc_or_fail(c, 2 * MiB, 0, NULL);
        snprintf(id, sizeof(id), "%s", vmmb_lease_id(l));
        ck_assert_int_eq(vmmb_publish(l, "keep-published", NULL, 0, 0), 0);
        keep_or_fail(l);
        barrier(c);
        s = daemon_list(h.socket, id);
        ck_assert(s.found && !s.kept);
        ck_assert_uint_eq(s.n_holders, 0);
        ck_assert_int_eq(vmmb_unpublish(c, "keep-published"), 0);
        ck_assert(!daemon_list(h.socket, id).found);

        /* attached through the same client: each object is freed plainly, the lease ends with the last */
        l = alloc_or_fail(c, 4 * MiB, 0, NULL);
        snprintf(id, sizeof(id), "%s", vmmb_lease_id(l));
        ck_assert_int_eq(vmmb_share(l, VMMB_ANY_UID, 0, token), 0);
        ck_assert_int_eq(vmmb_attach(c, token, 0, &attached), 0);
        keep_or_fail(attached);
        barrier(c);
        s = daemon_list(h.socket, id);
        ck_assert(s.found && !s.kept);
        keep_or_fail(l);
        barrier(c);
        ck_assert(!daemon_list(h.socket, id).found);

        /* parked once: freed plainly */
        l = alloc_or_fail(c, 4 * MiB, 0, NULL);
        snprintf(id, sizeof(id), "%s", vmmb_lease_id(l));
        ck_assert_int_eq(vmmb_lease_park(l, NULL), 1);
        ck_assert_int_eq(vmmb_lease_unpark(l), 0);
        keep_or_fail(l);
        barrier(c);
        ck_assert(!daemon_list(h.socket, id).found);

        ck_assert_uint_eq(daemon_leases(h.socket), 0);
        vmmb_close(c);
}
END_TEST

typedef struct OtherArgs {
        const char *socket;
        const char *kept_id;            /* the parent's kept lease */
        uint64_t size;
} OtherArgs;

/* As uid 65534: an Alloc of the size of root's kept lease gets a lease of its own, zeroed. */
static int child_other_user(void *arg) {
        const OtherArgs *a = arg;
        vmmb_client *c = NULL;
        vmmb_lease *l = NULL;
        int k;

        if (child_open(a->socket, true, &c) != 0)
                return 1;
        k = vmmb_alloc(c, a->size, 0, "nobody", &l);
        CHILD_CHECK(k == 0, "vmmb_alloc: %s", strerror(-k));
        CHILD_CHECK(strcmp(vmmb_lease_id(l), a->kept_id) != 0, "nobody got root's kept lease %s", a->kept_id);
        CHILD_CHECK(vmmb_lease_owner(l) == NOBODY, "owner %u", (unsigned)vmmb_lease_owner(l));
        CHILD_CHECK(words_are(vmmb_lease_ptr(l), a->size, 0), "nobody's lease does not read zero");
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

        start(NULL);
        if (skip_fork_on_real_driver(__func__))
                return;
#if defined(__SANITIZE_THREAD__)
        /* the child's library starts its watch thread: ThreadSanitizer cannot start threads after fork()ing
         * a process with threads ("starting new threads after multi-threaded fork is not supported") */
        fprintf(stderr, "%s: under ThreadSanitizer: another user's process not run\n", __func__);
        return;
#endif
        if (geteuid() != 0) {
                fprintf(stderr, "%s: not root: another user's process not run\n", __func__);
                return;
        }
        ck_assert_int_eq(chmod(h.dir, 0711), 0);
        ck_assert_int_eq(chmod(h.socket, 0666), 0);
        c = connect_or_fail(h.socket);
        l = alloc_or_fail(c, 4 * MiB, 0, NULL);
        snprintf(id, sizeof(id), "%s", vmmb_lease_id(l));
        ptr = vmmb_lease_ptr(l);
        fill_nonzero(l);
        keep_or_fail(l);

        run_child(child_other_user, &(OtherArgs){ .socket = h.socket, .kept_id = id, .size = 4 * MiB });

        ck_assert(daemon_list(h.socket, id).kept);
        l = alloc_or_fail(c, 4 * MiB, 0, NULL);
        ck_assert_str_eq(vmmb_lease_id(l), id);
        ck_assert_uint_eq(vmmb_lease_ptr(l), ptr);
        ck_assert(words_are(ptr, 4 * MiB, 0));
        ck_assert_int_eq(vmmb_free(l), 0);
        ck_assert_uint_eq(daemon_leases(h.socket), 0); /* nobody's kept lease ended with its process */
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

        if (child_open(a->socket, false, &c) != 0)
                return 1;
        k = a->wait ? vmmb_alloc_wait(c, a->size, 0, "waiter", WAIT_USEC, &l) :
                      vmmb_alloc(c, a->size, 0, "waiter", &l);
        CHILD_CHECK(k == 0, "the alloc was not served: %s", strerror(-k));
        CHILD_CHECK(strcmp(vmmb_lease_id(l), a->kept_id) != 0, "got the other process's kept lease");
        CHILD_CHECK(words_are(vmmb_lease_ptr(l), a->size, 0), "does not read zero");
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

        start_capped("8M");
        if (skip_fork_on_real_driver(__func__))
                return;
        c = connect_or_fail(h.socket);
        for (int round = 0; round < 2; round++) {
                l = alloc_or_fail(c, 8 * MiB, 0, NULL);
                snprintf(id, sizeof(id), "%s", vmmb_lease_id(l));
                fill_nonzero(l);
                keep_or_fail(l);
                barrier(c);
                ck_assert(daemon_list(h.socket, id).kept);

                run_child(child_waiter, &(WaiterArgs){ .socket = h.socket, .size = 8 * MiB, .wait = round == 0,
                                                       .kept_id = id });
                ck_assert(!daemon_list(h.socket, id).found);
                ck_assert_uint_eq(daemon_leases(h.socket), 0);
        }
        /* the table forgot it: the next Alloc of the size gets a new lease, mapped anew */
        l = alloc_or_fail(c, 8 * MiB, 0, NULL);
        ck_assert_str_ne(vmmb_lease_id(l), id);
        ck_assert(words_are(vmmb_lease_ptr(l), 8 * MiB, 0));
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
        c = connect_or_fail(h.socket);
        for (size_t i = 0; i < ELEMENTSOF(sizes); i++)
                keep_or_fail(alloc_or_fail(c, sizes[i], 0, NULL));
        barrier(c);
        ck_assert_uint_eq(daemon_device(h.socket).kept, 72 * MiB);
        vmmb_close(c);
        ck_assert_uint_eq(daemon_leases(h.socket), 0);
        ck_assert_uint_eq(daemon_device(h.socket).kept, 0);

        c2 = connect_or_fail(h.socket);
        c3 = connect_or_fail(h.socket);
        keep_or_fail(alloc_or_fail(c2, 2 * MiB, 0, NULL));
        keep_or_fail(alloc_or_fail(c2, 4 * MiB, 0, NULL));
        l = alloc_or_fail(c3, 6 * MiB, 0, NULL);
        keep_or_fail(l);
        barrier(c2);
        ck_assert_uint_eq(daemon_device(h.socket).kept, 12 * MiB);
        ck_assert_int_eq(vmmb_give_back_kept(c2), 2);
        ck_assert_uint_eq(daemon_leases(h.socket), 1);                 /* c3's is left */
        ck_assert_uint_eq(daemon_device(h.socket).kept, 6 * MiB);
        ck_assert_int_eq(vmmb_give_back_kept(c2), 0);
        ck_assert_int_eq(vmmb_give_back_kept(NULL), -EINVAL);
        ck_assert_str_ne(vmmb_error_message(), "");
        ck_assert_int_eq(vmmb_give_back_kept(c3), 1);
        ck_assert_uint_eq(daemon_leases(h.socket), 0);
        vmmb_close(c2);
        vmmb_close(c3);
}
END_TEST

/*
 * Keeps a lease of 6 MiB, then asks for 4 MiB, which fits only if the kept lease goes: the daemon refuses the
 * Alloc, the library gives its kept leases back and asks again, and gets a zeroed lease of its own.
 */
static void keep_then_need_its_room(vmmb_client *c) {
        char id[VMMB_ID_MAX + 1];
        vmmb_lease *a, *b;

        a = alloc_or_fail(c, 6 * MiB, 0, NULL);
        snprintf(id, sizeof(id), "%s", vmmb_lease_id(a));
        fill_nonzero(a);
        keep_or_fail(a);
        ck_assert(daemon_list(h.socket, id).kept);

        b = alloc_or_fail(c, 4 * MiB, 0, NULL);
        ck_assert_str_ne(vmmb_lease_id(b), id);
        ck_assert(words_are(vmmb_lease_ptr(b), 4 * MiB, 0));
        ck_assert(!daemon_list(h.socket, id).found);
        ck_assert_uint_eq(daemon_leases(h.socket), 1);
        ck_assert_int_eq(vmmb_free(b), 0);
}

/* Near the user's MaxBytes= (8M): refused with QuotaExceeded, then served. */
START_TEST(test_keep_quota_retry) {
        vmmb_client *c;
        vmmb_lease *b = NULL;

        start("[Limits]\nMaxBytes=8M\n");
        c = connect_or_fail(h.socket);
        ck_assert_int_eq(vmmb_alloc(c, 10 * MiB, 0, NULL, &b), -EDQUOT);      /* over the limit in any case */
        keep_then_need_its_room(c);
        vmmb_close(c);
}
END_TEST

/*
 * At a full device (8M): the retry comes while the broker still has the kept lease's memory to scrub, and gets
 * that room.
 */
START_TEST(test_keep_capacity_retry) {
        vmmb_client *c;

        start_capped("8M");
        c = connect_or_fail(h.socket);
        keep_then_need_its_room(c);
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
        tcase_add_test(tc, test_keep_capacity_retry);
        suite_add_tcase(s, tc);

        failed = run_suite(s);
        return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
