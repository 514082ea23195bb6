/* SPDX-License-Identifier: MIT */

/*
 * PyTorch's pluggable allocator entry points of libvmmbroker (client/torch.c)
 * and vmmb_free_stream(), against the real daemon on the simulated device.
 * Each test (its own process, as Check forks them) starts a vmmbrokerd,
 * points $VMMBROKER_SOCKET at it for the library's process-wide client, and
 * opens the driver itself with device 0's primary context current, to write
 * and read the memory and to queue work on streams. simcuda_hold_streams()
 * keeps work queued on created streams for as long as a test needs: that is
 * how a free "with work still queued" is made on cue.
 *
 * Under ThreadSanitizer (-Db_sanitize=thread) the threads test is the one
 * that matters; the simulated device's own locking is one mutex.
 */

#include <check.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "checked.h"
#include "clienttest.h"
#include "codec.h"
#include "driver.h"
#include "harness.h"
#include "macro.h"
#include "simcuda.h"
#include "unit.h"
#include "vmmbroker.h"

static Harness h;
static __typeof__(&simcuda_hold_streams) hold_streams;

static void start(const char *config) {
        harness_start_or_fail(&h, config, NULL);
        ck_assert_int_eq(setenv("VMMBROKER_SOCKET", h.socket, 1), 0);
        ck_assert_int_eq(setenv("VMMBROKER_RECONNECT_TIMEOUT", "0", 1), 0);
        driver_open_or_fail();
        hold_streams = (__typeof__(hold_streams))driver_hook("simcuda_hold_streams");
        ck_assert_ptr_nonnull(hold_streams);
}

static void setup(void) {
        start(NULL);
}

/* 100M of the user's: 50 granules of 2 MiB. */
static void setup_limited(void) {
        start("[Limits]\nMaxBytes=100M\n");
}

static void teardown(void) {
        if (hold_streams)
                hold_streams(0);
        driver_close();
        harness_stop_or_fail(&h);
}

/* Whether the daemon lists lease `id` (of this user). */
static bool daemon_lists(const char *id) {
        return daemon_list(h.socket, id).found;
}

/*
 * Whether the daemon lists lease `id` kept (vmmb_free_keep(), which the segments' frees use) within
 * HARNESS_POLL_MS of List calls: after the first keep on the allocator's connection (which is answered) the
 * Frees are one-way, and a List on another connection may come first.
 */
static bool daemon_keeps(const char *id) {
        for (uint64_t end = harness_poll_deadline(); harness_now_msec() < end;)
                if (daemon_list(h.socket, id).kept)
                        return true;
        return false;
}

/* The number of leases the daemon lists for this user. */
static size_t daemon_count(void) {
        return daemon_list(h.socket, NULL).n_leases;
}

static void *torch_alloc_or_fail(ssize_t size) {
        void *p = vmmb_torch_alloc(size, 0, NULL);

        ck_assert_msg(p, "vmmb_torch_alloc(%zd): %s", size, vmmb_error_message());
        return p;
}

static void lease_id_or_fail(const void *p, char id[static VMMB_ID_MAX + 1]) {
        int k = vmmb_torch_lease_id(p, id, VMMB_ID_MAX + 1);

        ck_assert_msg(k > 0, "vmmb_torch_lease_id: %s: %s", strerror(-k), vmmb_error_message());
        ck_assert_uint_eq(strlen(id), (size_t)k);
}

/* Writes `value` to every word of [p, p + size) and reads the first and last word back. */
static void write_read(void *p, uint64_t size, uint32_t value) {
        CUdeviceptr d = (CUdeviceptr)(uintptr_t)p;
        uint32_t first = 0, last = 0;

        ck_assert_int_eq(cu->cuMemsetD32(d, value, size / 4), CUDA_SUCCESS);
        ck_assert_int_eq(cu->cuMemcpyDtoH(&first, d, 4), CUDA_SUCCESS);
        ck_assert_int_eq(cu->cuMemcpyDtoH(&last, d + size - 4, 4), CUDA_SUCCESS);
        ck_assert_uint_eq(first, value);
        ck_assert_uint_eq(last, value);
}

static void sleep_ms(long ms) {
        struct timespec ts = { .tv_sec = ms / 1000, .tv_nsec = ms % 1000 * 1000000 };

        while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
                ;
}

START_TEST(test_alloc_sizes) {
        const ssize_t sizes[] = { 1, 2 * MiB, 3 * MiB, 66 * MiB, 4096 };
        const uint64_t mapped[] = { 2 * MiB, 2 * MiB, 4 * MiB, 66 * MiB, 2 * MiB };
        char ids[ELEMENTSOF(sizes)][VMMB_ID_MAX + 1], inner[VMMB_ID_MAX + 1];
        void *p[ELEMENTSOF(sizes)];

        for (size_t i = 0; i < ELEMENTSOF(sizes); i++) {
                p[i] = torch_alloc_or_fail(sizes[i]);
                lease_id_or_fail(p[i], ids[i]);
                ck_assert(daemon_lists(ids[i]));
                /* leased memory reads zero, and all of it can be written */
                uint32_t word = 1;
                ck_assert_int_eq(cu->cuMemcpyDtoH(&word, (CUdeviceptr)(uintptr_t)p[i], 4), CUDA_SUCCESS);
                ck_assert_uint_eq(word, 0);
                write_read(p[i], mapped[i], 0xa0000000u + (uint32_t)i);
        }
        /* distinct, and no two overlap */
        for (size_t i = 0; i < ELEMENTSOF(sizes); i++)
                for (size_t j = 0; j < i; j++) {
                        uintptr_t a = (uintptr_t)p[i], b = (uintptr_t)p[j];

                        ck_assert(a + mapped[i] <= b || b + mapped[j] <= a);
                        ck_assert_str_ne(ids[i], ids[j]);
                }
        /* each still holds its own value */
        for (size_t i = 0; i < ELEMENTSOF(sizes); i++) {
                uint32_t word = 0;

                ck_assert_int_eq(cu->cuMemcpyDtoH(&word, (CUdeviceptr)(uintptr_t)p[i] + mapped[i] - 4, 4),
                                 CUDA_SUCCESS);
                ck_assert_uint_eq(word, 0xa0000000u + (uint32_t)i);
        }
        /* an address inside a segment names its lease; a buffer too small does not fit it */
        lease_id_or_fail((char *)p[3] + 5 * MiB + 12, inner);
        ck_assert_str_eq(inner, ids[3]);
        ck_assert_int_eq(vmmb_torch_lease_id(p[3], inner, 2), -ERANGE);
        ck_assert_int_eq(vmmb_torch_lease_id(p[3], NULL, 0), -EINVAL);

        /* freed on the NULL stream, with nothing queued: the lease is kept at once, for the next of its size */
        for (size_t i = 0; i < ELEMENTSOF(sizes); i++) {
                vmmb_torch_free(p[i], sizes[i], 0, NULL);
                ck_assert(daemon_keeps(ids[i]));
                ck_assert_int_eq(vmmb_torch_lease_id(p[i], inner, sizeof(inner)), -ENOENT);
        }
        ck_assert_uint_eq(daemon_count(), ELEMENTSOF(sizes));

        /* the next segment of 66 MiB is the kept one: the same lease at the same address, zeroed */
        {
                void *again = torch_alloc_or_fail(66 * MiB);
                uint32_t word = 1;

                ck_assert_ptr_eq(again, p[3]);
                lease_id_or_fail(again, inner);
                ck_assert_str_eq(inner, ids[3]);
                ck_assert_int_eq(cu->cuMemcpyDtoH(&word, (CUdeviceptr)(uintptr_t)again + 66 * MiB - 4, 4),
                                 CUDA_SUCCESS);
                ck_assert_uint_eq(word, 0);
                vmmb_torch_free(again, 66 * MiB, 0, NULL);
        }
        /* torn down: the kept segments go back to the broker (none was left unfreed) */
        ck_assert_int_eq(vmmb_torch_release_all(), 0);
        ck_assert_uint_eq(daemon_count(), 0);
}
END_TEST

START_TEST(test_free_unknown_is_harmless) {
        char id[VMMB_ID_MAX + 1];
        void *p;

        /* before any alloc: no client, no driver needed */
        vmmb_torch_free(NULL, 0, 0, NULL);
        vmmb_torch_free((void *)0x1234, 100, 0, NULL);
        ck_assert_int_eq(vmmb_torch_release_all(), 0);

        p = torch_alloc_or_fail(2 * MiB);
        lease_id_or_fail(p, id);
        /* an address inside the segment, an unknown one, NULL: none frees anything */
        vmmb_torch_free((char *)p + 4096, 2 * MiB, 0, NULL);
        vmmb_torch_free((void *)0x1234, 100, 0, NULL);
        vmmb_torch_free(NULL, 0, 0, NULL);
        ck_assert(daemon_lists(id));
        write_read(p, 2 * MiB, 7);

        /* freed twice: the second is ignored */
        vmmb_torch_free(p, 2 * MiB, 0, NULL);
        ck_assert(daemon_keeps(id));
        vmmb_torch_free(p, 2 * MiB, 0, NULL);
        ck_assert_uint_eq(daemon_count(), 1);
        ck_assert_int_eq(vmmb_torch_release_all(), 0);
        ck_assert_uint_eq(daemon_count(), 0);
        ck_assert_int_eq(cu->cuCtxSynchronize(), CUDA_SUCCESS);
}
END_TEST

/* Many threads: each allocates, queues work on a stream of its own, frees on that stream. */
#define N_THREADS 8
#define N_ROUNDS 25

static void *thread_work(void *arg) {
        static __thread char failure[512];
        unsigned t = (unsigned)(uintptr_t)arg;
        CUstream s = NULL;

        if (cu->cuCtxSetCurrent(ctx) != CUDA_SUCCESS || cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS)
                return "cannot set the context or create a stream";
        for (unsigned i = 0; i < N_ROUNDS; i++) {
                uint64_t size = (1 + (t + i) % 3) * 2 * MiB;
                uint32_t value = t * 1000 + i + 1, first = 0, last = 0;
                char id[VMMB_ID_MAX + 1];
                void *p = vmmb_torch_alloc((ssize_t)size, 0, s);
                CUdeviceptr d = (CUdeviceptr)(uintptr_t)p;

                if (!p) {
                        snprintf(failure, sizeof(failure), "vmmb_torch_alloc: %s", vmmb_error_message());
                        return failure;
                }
                if (vmmb_torch_lease_id(p, id, sizeof(id)) <= 0)
                        return "no lease for a live segment";
                if (cu->cuMemsetD32Async(d, value, size / 4, s) != CUDA_SUCCESS ||
                    cu->cuStreamSynchronize(s) != CUDA_SUCCESS || cu->cuMemcpyDtoH(&first, d, 4) != CUDA_SUCCESS ||
                    cu->cuMemcpyDtoH(&last, d + size - 4, 4) != CUDA_SUCCESS || first != value || last != value)
                        return "the segment did not hold what was written";
                /* work still queued on the stream when PyTorch frees the segment */
                if (cu->cuMemsetD32Async(d, ~value, size / 4, s) != CUDA_SUCCESS)
                        return "cannot queue a memset";
                vmmb_torch_free(p, (ssize_t)size, 0, s);
        }
        if (cu->cuStreamSynchronize(s) != CUDA_SUCCESS)
                return "the stream failed: a segment was unmapped under queued work";
        (void)cu->cuStreamDestroy(s);
        return NULL;
}

START_TEST(test_threads) {
        pthread_t threads[N_THREADS];

        for (unsigned i = 0; i < N_THREADS; i++)
                ck_assert_int_eq(pthread_create(&threads[i], NULL, thread_work, (void *)(uintptr_t)i), 0);
        for (unsigned i = 0; i < N_THREADS; i++) {
                void *failure = NULL;

                ck_assert_int_eq(pthread_join(threads[i], &failure), 0);
                ck_assert_msg(!failure, "thread %u: %s", i, (const char *)failure);
        }
        ck_assert_int_eq(cu->cuCtxSynchronize(), CUDA_SUCCESS);
        /* what is still pending is given back now */
        ck_assert_int_ge(vmmb_torch_release_all(), 0);
        ck_assert_uint_eq(daemon_count(), 0);
}
END_TEST

/* A free with work still queued on its stream waits for it, without blocking, and nothing faults. */
START_TEST(test_free_with_queued_work) {
        const uint64_t size = 64 * MiB;
        char id[VMMB_ID_MAX + 1], other_id[VMMB_ID_MAX + 1];
        CUstream s = NULL;
        void *p, *other;

        ck_assert_int_eq(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
        p = torch_alloc_or_fail((ssize_t)size);
        lease_id_or_fail(p, id);

        hold_streams(1);
        ck_assert_int_eq(cu->cuMemsetD32Async((CUdeviceptr)(uintptr_t)p, 0x5a5a5a5a, size / 4, s), CUDA_SUCCESS);
        vmmb_torch_free(p, (ssize_t)size, 0, s);        /* returns: the memset is still queued */
        ck_assert_int_eq(cu->cuStreamQuery(s), CUDA_ERROR_NOT_READY);
        ck_assert(daemon_lists(id));                    /* not unmapped, not given back */
        ck_assert_int_eq(vmmb_torch_lease_id(p, id, sizeof(id)), -ENOENT);     /* but no longer PyTorch's */

        /* an alloc meanwhile looks at the pending free and leaves it */
        other = torch_alloc_or_fail(2 * MiB);
        lease_id_or_fail(other, other_id);
        ck_assert(daemon_lists(id));

        hold_streams(0);
        ck_assert_int_eq(cu->cuStreamSynchronize(s), CUDA_SUCCESS);    /* the memset ran on mapped memory */
        ck_assert_int_eq(cu->cuCtxSynchronize(), CUDA_SUCCESS);

        /* the next free frees the pending one too (this one on the NULL stream, done at once): both kept */
        vmmb_torch_free(other, 2 * MiB, 0, NULL);
        ck_assert(daemon_keeps(id));
        ck_assert(daemon_keeps(other_id));
        ck_assert_int_eq(cu->cuStreamDestroy(s), CUDA_SUCCESS);
}
END_TEST

typedef struct Waiter {
        pthread_t thread;
        vmmb_lease *lease;
        CUstream stream;
        int result;
        volatile int done;
} Waiter;

static void *free_stream_thread(void *arg) {
        Waiter *w = arg;

        /* no current context in this thread: the stream, one the caller created, is waited for as it is */
        w->result = vmmb_free_stream(w->lease, w->stream);
        __atomic_store_n(&w->done, 1, __ATOMIC_RELEASE);
        return NULL;
}

/*
 * vmmb_free_stream() waits for the stream before unmapping; from a thread with no current context, a stream the
 * caller created is waited for without retaining the primary context (which a retain creates when it is not
 * active: about 0.2 s on an H200). Counted on the simulated device.
 */
START_TEST(test_free_stream_waits) {
        const uint64_t size = 32 * MiB;
        vmmb_client *c = NULL;
        Waiter w = {};
        char id[VMMB_ID_MAX + 1];
        uint64_t retains;

        ck_assert_int_eq(vmmb_connect(NULL, &c), 0);
        ck_assert_int_eq(vmmb_alloc(c, size, 0, "free-stream", &w.lease), 0);
        snprintf(id, sizeof(id), "%s", vmmb_lease_id(w.lease));
        ck_assert_int_eq(cu->cuStreamCreate(&w.stream, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);

        hold_streams(1);
        ck_assert_int_eq(cu->cuMemsetD32Async(vmmb_lease_ptr(w.lease), 1, size / 4, w.stream), CUDA_SUCCESS);
        retains = driver_calls("cuDevicePrimaryCtxRetain");
        ck_assert_int_eq(pthread_create(&w.thread, NULL, free_stream_thread, &w), 0);
        sleep_ms(200);
        ck_assert_int_eq(__atomic_load_n(&w.done, __ATOMIC_ACQUIRE), 0);      /* waiting for the memset */
        ck_assert(daemon_lists(id));
        hold_streams(0);
        ck_assert_int_eq(pthread_join(w.thread, NULL), 0);
        ck_assert_msg(w.result == 0, "vmmb_free_stream: %s: %s", strerror(-w.result), vmmb_error_message());
        ck_assert(!daemon_lists(id));
        if (driver_counts())
                ck_assert_msg(driver_calls("cuDevicePrimaryCtxRetain") == retains, "the free from a thread with no "
                              "context retained the primary context to wait for a stream it did not need it for");
        ck_assert_int_eq(cu->cuStreamSynchronize(w.stream), CUDA_SUCCESS);
        ck_assert_int_eq(cu->cuCtxSynchronize(), CUDA_SUCCESS);

        /* the NULL stream, in this thread's context; a NULL lease */
        ck_assert_int_eq(vmmb_alloc(c, 2 * MiB, 0, NULL, &w.lease), 0);
        ck_assert_int_eq(vmmb_free_stream(w.lease, NULL), 0);
        ck_assert_int_eq(vmmb_free_stream(NULL, NULL), 0);

        /* a stream the driver does not know: nothing is freed */
        ck_assert_int_eq(vmmb_alloc(c, 2 * MiB, 0, NULL, &w.lease), 0);
        snprintf(id, sizeof(id), "%s", vmmb_lease_id(w.lease));
        ck_assert_int_eq(vmmb_free_stream(w.lease, (void *)0x1000), -EINVAL);
        ck_assert_str_ne(vmmb_error_message(), "");
        ck_assert(daemon_lists(id));
        ck_assert_int_eq(vmmb_free(w.lease), 0);

        ck_assert_int_eq(cu->cuStreamDestroy(w.stream), CUDA_SUCCESS);
        vmmb_close(c);
}
END_TEST

/*
 * The fact that the above guards against, on the simulated device as on the
 * driver: vmmb_free() does not wait, and the queued memset then faults the
 * context (sticky) instead of writing to memory that is gone. (This test's
 * process is its own, so the poisoned context goes with it.)
 */
START_TEST(test_free_does_not_wait) {
        const uint64_t size = 32 * MiB;
        vmmb_client *c = NULL;
        vmmb_lease *l = NULL;
        CUstream s = NULL;

        ck_assert_int_eq(vmmb_connect(NULL, &c), 0);
        ck_assert_int_eq(vmmb_alloc(c, size, 0, NULL, &l), 0);
        ck_assert_int_eq(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
        hold_streams(1);
        ck_assert_int_eq(cu->cuMemsetD32Async(vmmb_lease_ptr(l), 1, size / 4, s), CUDA_SUCCESS);
        ck_assert_int_eq(vmmb_free(l), 0);              /* returns with the memset queued */
        ck_assert_int_eq(cu->cuStreamQuery(s), CUDA_ERROR_NOT_READY);
        hold_streams(0);
        ck_assert_int_eq(cu->cuStreamSynchronize(s), CUDA_ERROR_ILLEGAL_ADDRESS);
        ck_assert_int_eq(cu->cuCtxSynchronize(), CUDA_ERROR_ILLEGAL_ADDRESS);
        (void)cu->cuStreamDestroy(s);
        vmmb_close(c);
}
END_TEST

static void *release_all_thread(void *arg) {
        int *result = arg;

        *result = vmmb_torch_release_all();
        return NULL;
}

START_TEST(test_release_all) {
        char ids[3][VMMB_ID_MAX + 1];
        pthread_t thread;
        CUstream s = NULL;
        void *p[3];
        int result = -1;

        ck_assert_int_eq(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
        for (size_t i = 0; i < 3; i++) {
                p[i] = torch_alloc_or_fail((ssize_t)(4 * MiB));
                lease_id_or_fail(p[i], ids[i]);
        }
        /* one freed with work queued (pending), two never freed, one of them with work queued too */
        hold_streams(1);
        ck_assert_int_eq(cu->cuMemsetD32Async((CUdeviceptr)(uintptr_t)p[0], 3, MiB, s), CUDA_SUCCESS);
        vmmb_torch_free(p[0], (ssize_t)(4 * MiB), 0, s);
        ck_assert_int_eq(cu->cuMemsetD32Async((CUdeviceptr)(uintptr_t)p[1], 3, MiB, s), CUDA_SUCCESS);
        ck_assert_uint_eq(daemon_count(), 3);

        /* it waits for the work: nothing is given back while the stream is held */
        ck_assert_int_eq(pthread_create(&thread, NULL, release_all_thread, &result), 0);
        sleep_ms(200);
        ck_assert_uint_eq(daemon_count(), 3);
        hold_streams(0);
        ck_assert_int_eq(pthread_join(thread, NULL), 0);
        ck_assert_msg(result == 2, "vmmb_torch_release_all: %d: %s", result, vmmb_error_message());
        ck_assert_uint_eq(daemon_count(), 0);
        ck_assert_int_eq(cu->cuStreamSynchronize(s), CUDA_SUCCESS);
        ck_assert_int_eq(cu->cuCtxSynchronize(), CUDA_SUCCESS);

        /* what was released is no longer PyTorch's: its free is ignored */
        ck_assert_int_eq(vmmb_torch_lease_id(p[1], ids[1], sizeof(ids[1])), -ENOENT);
        vmmb_torch_free(p[1], (ssize_t)(4 * MiB), 0, s);
        vmmb_torch_free(p[2], (ssize_t)(4 * MiB), 0, s);
        ck_assert_int_eq(vmmb_torch_release_all(), 0);

        /* and the allocator goes on working */
        p[0] = torch_alloc_or_fail((ssize_t)(2 * MiB));
        write_read(p[0], 2 * MiB, 9);
        ck_assert_int_eq(vmmb_torch_release_all(), 1);
        ck_assert_int_eq(cu->cuStreamDestroy(s), CUDA_SUCCESS);
}
END_TEST

START_TEST(test_alloc_errors) {
        ck_assert_ptr_null(vmmb_torch_alloc(0, 0, NULL));
        ck_assert_ptr_nonnull(strstr(vmmb_error_message(), "more than 0"));
        ck_assert_ptr_null(vmmb_torch_alloc(-5, 0, NULL));
        ck_assert_ptr_null(vmmb_torch_alloc(2 * MiB, -1, NULL));
        ck_assert_str_ne(vmmb_error_message(), "");
        ck_assert_ptr_null(vmmb_torch_alloc(2 * MiB, 7, NULL));         /* a device the broker does not serve */
        ck_assert_str_ne(vmmb_error_message(), "");
        ck_assert_uint_eq(daemon_count(), 0);
}
END_TEST

/* No broker: NULL, and the message says why; a broker later is found by the next call. */
START_TEST(test_alloc_no_broker) {
        void *p;

        ck_assert_int_eq(setenv("VMMBROKER_SOCKET", "/nonexistent/vmmbroker", 1), 0);
        ck_assert_ptr_null(vmmb_torch_alloc(2 * MiB, 0, NULL));
        ck_assert_ptr_nonnull(strstr(vmmb_error_message(), "/nonexistent/vmmbroker"));
        ck_assert_int_eq(setenv("VMMBROKER_SOCKET", h.socket, 1), 0);
        p = torch_alloc_or_fail(2 * MiB);
        vmmb_torch_free(p, 2 * MiB, 0, NULL);
        ck_assert_int_eq(vmmb_torch_release_all(), 0);
        ck_assert_uint_eq(daemon_count(), 0);
}
END_TEST

typedef struct Message {
        char text[1024];
        bool null;
} Message;

static void *over_limit_thread(void *arg) {
        Message *m = arg;

        m->null = vmmb_torch_alloc(128 * MiB, 0, NULL) == NULL;
        snprintf(m->text, sizeof(m->text), "%s", vmmb_error_message());
        return NULL;
}

/* Over the user's limit (MaxBytes=100M): NULL, and the broker's sentence in that thread. */
START_TEST(test_alloc_over_limit) {
        Message m = {};
        pthread_t thread;
        void *p;

        ck_assert_int_eq(pthread_create(&thread, NULL, over_limit_thread, &m), 0);
        ck_assert_int_eq(pthread_join(thread, NULL), 0);
        ck_assert(m.null);
        ck_assert_msg(strstr(m.text, "limit"), "message: %s", m.text);
        ck_assert_str_ne(vmmb_error_message(), m.text);         /* per thread: not this one's */

        p = torch_alloc_or_fail((ssize_t)(96 * MiB));
        ck_assert_ptr_null(vmmb_torch_alloc(8 * MiB, 0, NULL));
        ck_assert_msg(strstr(vmmb_error_message(), "limit"), "message: %s", vmmb_error_message());
        vmmb_torch_free(p, (ssize_t)(96 * MiB), 0, NULL);

        /* kept, it still counts toward the limit: an alloc it is in the way of gets it given back first */
        {
                char id[VMMB_ID_MAX + 1];

                ck_assert_int_eq(vmmb_torch_lease_id(p, id, sizeof(id)), -ENOENT);
                ck_assert_uint_eq(daemon_count(), 1);
                p = torch_alloc_or_fail((ssize_t)(8 * MiB));
                lease_id_or_fail(p, id);
                ck_assert_uint_eq(daemon_count(), 1);
                ck_assert(daemon_lists(id));
                vmmb_torch_free(p, (ssize_t)(8 * MiB), 0, NULL);
        }
        ck_assert_int_eq(vmmb_torch_release_all(), 0);
        ck_assert_uint_eq(daemon_count(), 0);
}
END_TEST

static void *unhold_later(void *arg) {
        sleep_ms(200);
        hold_streams(0);
        return NULL;
}

/* Refused for the limit while a free still waits for its stream: the alloc waits for it and asks again. */
START_TEST(test_alloc_waits_for_pending_frees) {
        char id[VMMB_ID_MAX + 1];
        pthread_t thread;
        CUstream s = NULL;
        void *p, *q;

        ck_assert_int_eq(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
        p = torch_alloc_or_fail((ssize_t)(64 * MiB));
        lease_id_or_fail(p, id);
        hold_streams(1);
        ck_assert_int_eq(cu->cuMemsetD32Async((CUdeviceptr)(uintptr_t)p, 1, 16 * MiB, s), CUDA_SUCCESS);
        vmmb_torch_free(p, (ssize_t)(64 * MiB), 0, s);
        ck_assert(daemon_lists(id));

        ck_assert_int_eq(pthread_create(&thread, NULL, unhold_later, NULL), 0);
        q = torch_alloc_or_fail((ssize_t)(64 * MiB));   /* 128M > 100M until the pending free is done */
        ck_assert_int_eq(pthread_join(thread, NULL), 0);
        ck_assert(!daemon_lists(id));
        ck_assert_int_eq(cu->cuStreamSynchronize(s), CUDA_SUCCESS);
        vmmb_torch_free(q, (ssize_t)(64 * MiB), 0, s);
        ck_assert_int_eq(vmmb_torch_release_all(), 0);
        ck_assert_uint_eq(daemon_count(), 0);
        ck_assert_int_eq(cu->cuStreamDestroy(s), CUDA_SUCCESS);
}
END_TEST

/* Whether the first, a middle and the last word of [p, p + size) read `value`. */
static bool holds(const void *p, uint64_t size, uint32_t value) {
        CUdeviceptr d = (CUdeviceptr)(uintptr_t)p;
        uint32_t w[3] = { 0 };

        return cu->cuMemcpyDtoH(&w[0], d, 4) == CUDA_SUCCESS && cu->cuMemcpyDtoH(&w[1], d + size / 2, 4) == CUDA_SUCCESS &&
               cu->cuMemcpyDtoH(&w[2], d + size - 4, 4) == CUDA_SUCCESS && w[0] == value && w[1] == value &&
               w[2] == value;
}

/* Segments of distinct content, put to sleep (parked) and woken: the same pointers, the same content. */
START_TEST(test_sleep_wake) {
        const ssize_t sizes[] = { (ssize_t)(2 * MiB), (ssize_t)(66 * MiB), (ssize_t)(10 * MiB) };
        void *p[3];
        CUstream s = NULL;

        for (size_t i = 0; i < 3; i++) {
                p[i] = torch_alloc_or_fail(sizes[i]);
                ck_assert_int_eq(cu->cuMemsetD32((CUdeviceptr)(uintptr_t)p[i], 0xC0DE0000 + (uint32_t)i,
                                                 (size_t)sizes[i] / 4), CUDA_SUCCESS);
        }
        /* a free still waiting for its stream is given back by the sleep, not parked */
        ck_assert_int_eq(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
        hold_streams(1);
        ck_assert_int_eq(cu->cuMemsetD32Async((CUdeviceptr)(uintptr_t)p[2], 1, 1, s), CUDA_SUCCESS);
        vmmb_torch_free(p[2], sizes[2], 0, s);
        ck_assert_uint_eq(daemon_count(), 3);
        hold_streams(0);

        ck_assert_int_eq(vmmb_torch_sleep(NULL), 2);
        ck_assert_uint_eq(daemon_count(), 2);
        ck_assert_int_eq(vmmb_torch_sleep(NULL), 0);            /* parked already: passed over */
        ck_assert_int_eq(vmmb_torch_wake(), 2);
        ck_assert_int_eq(vmmb_torch_wake(), 0);
        for (size_t i = 0; i < 2; i++)
                ck_assert_msg(holds(p[i], (uint64_t)sizes[i], 0xC0DE0000 + (uint32_t)i), "segment %zu", i);

        /* asleep, a segment can still be freed: its reservation goes, and its hold */
        ck_assert_int_eq(vmmb_torch_sleep(NULL), 2);
        vmmb_torch_free(p[0], sizes[0], 0, NULL);
        ck_assert_int_eq(vmmb_torch_wake(), 1);
        ck_assert(holds(p[1], (uint64_t)sizes[1], 0xC0DE0001));
        ck_assert_int_eq(vmmb_torch_release_all(), 1);
        ck_assert_uint_eq(daemon_count(), 0);
        ck_assert_int_eq(cu->cuStreamDestroy(s), CUDA_SUCCESS);
}
END_TEST

/* vmmb_lease_park() with work still queued on the stream: it waits for the work before unmapping. */
START_TEST(test_park_waits_for_stream) {
        vmmb_client *c = NULL;
        vmmb_lease *l = NULL;
        pthread_t thread;
        CUstream s = NULL;
        uint64_t ptr;

        ck_assert_int_eq(vmmb_connect(h.socket, &c), 0);
        ck_assert_int_eq(vmmb_alloc(c, 8 * MiB, 0, NULL, &l), 0);
        ptr = vmmb_lease_ptr(l);
        ck_assert_int_eq(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
        hold_streams(1);
        ck_assert_int_eq(cu->cuMemsetD32Async(ptr, 0xFEEDF00D, 2 * MiB, s), CUDA_SUCCESS);
        ck_assert_int_eq(pthread_create(&thread, NULL, unhold_later, NULL), 0);
        ck_assert_int_eq(vmmb_lease_park(l, s), 1);             /* returns once the memset ran */
        ck_assert_int_eq(pthread_join(thread, NULL), 0);
        ck_assert_int_eq(vmmb_lease_unpark(l), 0);
        ck_assert_uint_eq(vmmb_lease_ptr(l), ptr);
        ck_assert(holds((void *)(uintptr_t)ptr, 8 * MiB, 0xFEEDF00D));
        ck_assert_int_eq(vmmb_free(l), 0);
        vmmb_close(c);
        ck_assert_int_eq(cu->cuStreamDestroy(s), CUDA_SUCCESS);
}
END_TEST

int main(void) {
        Suite *s = suite_create("torch");
        TCase *tc = tcase_create("torch"), *limited = tcase_create("limited");
        int failed;

        tcase_add_checked_fixture(tc, setup, teardown);
        tcase_add_test(tc, test_alloc_sizes);
        tcase_add_test(tc, test_free_unknown_is_harmless);
        tcase_add_test(tc, test_threads);
        tcase_add_test(tc, test_free_with_queued_work);
        tcase_add_test(tc, test_free_stream_waits);
        tcase_add_test(tc, test_free_does_not_wait);
        tcase_add_test(tc, test_release_all);
        tcase_add_test(tc, test_alloc_errors);
        tcase_add_test(tc, test_alloc_no_broker);
        tcase_add_test(tc, test_sleep_wake);
        tcase_add_test(tc, test_park_waits_for_stream);
        suite_add_tcase(s, tc);

        tcase_add_checked_fixture(limited, setup_limited, teardown);
        tcase_add_test(limited, test_alloc_over_limit);
        tcase_add_test(limited, test_alloc_waits_for_pending_frees);
        suite_add_tcase(s, limited);

        failed = run_suite(s);
        return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
