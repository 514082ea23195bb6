/* SPDX-License-Identifier: MIT */

/*
 * libvmmbroker against the real daemon on the simulated device. Each test
 * starts its own vmmbrokerd (tests/integration/harness.c) and opens the
 * driver itself, with device 0's primary context current, to write and read
 * the leased memory through the pointer the library returns.
 */

#include <check.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "codec.h"
#include "driver.h"
#include "harness.h"
#include "macro.h"
#include "varlink.h"
#include "vmmbroker.h"
#include "unit.h"

#define MiB (UINT64_C(1) << 20)

static Harness h;
static bool daemon_killed;
static CudaDriver *cu;
static CUcontext ctx;

static void setup(void) {
        _cleanup_free_ char *message = NULL;
        int k;

        k = harness_start(&h, NULL);
        ck_assert_msg(k == 0, "harness_start: %s (is VMMBROKER_DAEMON set?)", strerror(-k));
        k = cuda_driver_open(&cu, NULL, &message);
        ck_assert_msg(k == 0, "cuda_driver_open: %s", message);
        ck_assert_int_eq(cu->cuDevicePrimaryCtxRetain(&ctx, 0), CUDA_SUCCESS);
        ck_assert_int_eq(cu->cuCtxSetCurrent(ctx), CUDA_SUCCESS);
}

static void teardown(void) {
        int status;

        if (cu) {
                (void)cu->cuCtxSetCurrent(NULL);
                (void)cu->cuDevicePrimaryCtxRelease(0);
                cu = cuda_driver_close(cu);
        }
        status = harness_stop(&h);
        if (!daemon_killed)
                ck_assert_msg(status == 0, "vmmbrokerd exited with %d", status);
}

/* Device 0's (leased bytes, leases) from the daemon's Status, over a raw varlink connection. */
static void daemon_status(uint64_t *ret_leased, uint64_t *ret_leases) {
        WireDevice d;
        int k = harness_status(h.socket, &d);

        ck_assert_msg(k == 0, "Status failed: %s", strerror(-k));
        *ret_leased = d.leased;
        *ret_leases = d.leases;
}

static vmmb_client *connect_or_fail(void) {
        vmmb_client *c = NULL;
        int k;

        k = vmmb_connect(h.socket, &c);
        ck_assert_msg(k == 0, "vmmb_connect: %s: %s", strerror(-k), vmmb_error_message());
        ck_assert_ptr_nonnull(c);
        return c;
}

static vmmb_lease *alloc_or_fail(vmmb_client *c, uint64_t size, int device, const char *label) {
        vmmb_lease *l = NULL;
        int k;

        k = vmmb_alloc(c, size, device, label, &l);
        ck_assert_msg(k == 0, "vmmb_alloc(%llu): %s: %s", (unsigned long long)size, strerror(-k),
                      vmmb_error_message());
        ck_assert_ptr_nonnull(l);
        return l;
}

/* Whether every 32-bit word of the lease reads `value`. */
static bool lease_reads(vmmb_lease *l, uint32_t value) {
        size_t n = vmmb_lease_size(l) / sizeof(uint32_t);
        _cleanup_free_ uint32_t *buf = malloc(n * sizeof(uint32_t));

        ck_assert_ptr_nonnull(buf);
        ck_assert_int_eq(cu->cuMemcpyDtoH(buf, vmmb_lease_ptr(l), n * sizeof(uint32_t)), CUDA_SUCCESS);
        for (size_t i = 0; i < n; i++)
                if (buf[i] != value)
                        return false;
        return true;
}

START_TEST(test_alloc_write_read) {
        vmmb_client *c = connect_or_fail();
        vmmb_lease *l = alloc_or_fail(c, 66 * MiB, VMMB_ANY_DEVICE, "test-client");
        const size_t n = 66 * MiB / sizeof(uint32_t);
        _cleanup_free_ uint32_t *pattern = malloc(n * sizeof(uint32_t));
        _cleanup_free_ uint32_t *back = calloc(n, sizeof(uint32_t));

        ck_assert_ptr_nonnull(pattern);
        ck_assert_ptr_nonnull(back);
        ck_assert_uint_ne(vmmb_lease_ptr(l), 0);
        ck_assert_uint_eq(vmmb_lease_size(l), 66 * MiB);
        ck_assert_int_eq(vmmb_lease_device(l), 0);
        ck_assert_ptr_nonnull(vmmb_lease_id(l));
        ck_assert_str_ne(vmmb_lease_id(l), "");

        /* Leased memory reads zero; a memset and a copy reach all of it, across slabs (64 + 2 MiB). */
        ck_assert(lease_reads(l, 0));
        ck_assert_int_eq(cu->cuMemsetD32(vmmb_lease_ptr(l), 0xdeadbeef, n), CUDA_SUCCESS);
        ck_assert(lease_reads(l, 0xdeadbeef));
        for (size_t i = 0; i < n; i++)
                pattern[i] = (uint32_t)(i * 2654435761U);
        ck_assert_int_eq(cu->cuMemcpyHtoD(vmmb_lease_ptr(l), pattern, n * sizeof(uint32_t)), CUDA_SUCCESS);
        ck_assert_int_eq(cu->cuMemcpyDtoH(back, vmmb_lease_ptr(l), n * sizeof(uint32_t)), CUDA_SUCCESS);
        ck_assert(memcmp(pattern, back, n * sizeof(uint32_t)) == 0);
        ck_assert_int_eq(vmmb_free(l), 0);

        /* The same slabs come back scrubbed. */
        l = alloc_or_fail(c, 66 * MiB, 0, NULL);
        ck_assert_int_eq(vmmb_lease_device(l), 0);
        ck_assert(lease_reads(l, 0));
        ck_assert_int_eq(vmmb_free(l), 0);
        vmmb_close(c);
}
END_TEST

/* Several threads share one client. */
#define N_THREADS 8
#define N_ROUNDS 12

static void *thread_work(void *arg) {
        vmmb_client *c = arg;
        static __thread char failure[512];
        unsigned t = (unsigned)(uintptr_t)pthread_self() % 1000;

        if (cu->cuCtxSetCurrent(ctx) != CUDA_SUCCESS)
                return "cuCtxSetCurrent failed";
        for (unsigned i = 0; i < N_ROUNDS; i++) {
                uint64_t size = (1 + (t + i) % 3) * 2 * MiB;
                uint32_t value = t * 1000 + i + 1, first = 0, last = 0;
                vmmb_lease *l = NULL;
                int k;

                k = vmmb_alloc(c, size, VMMB_ANY_DEVICE, "thread", &l);
                if (k < 0) {
                        snprintf(failure, sizeof(failure), "vmmb_alloc: %s: %s", strerror(-k), vmmb_error_message());
                        return failure;
                }
                if (vmmb_lease_size(l) != size || cu->cuMemsetD32(vmmb_lease_ptr(l), value, size / 4) != CUDA_SUCCESS ||
                    cu->cuMemcpyDtoH(&first, vmmb_lease_ptr(l), 4) != CUDA_SUCCESS ||
                    cu->cuMemcpyDtoH(&last, vmmb_lease_ptr(l) + size - 4, 4) != CUDA_SUCCESS || first != value ||
                    last != value) {
                        (void)vmmb_free(l);
                        return "the lease did not hold what was written";
                }
                k = vmmb_free(l);
                if (k < 0) {
                        snprintf(failure, sizeof(failure), "vmmb_free: %s: %s", strerror(-k), vmmb_error_message());
                        return failure;
                }
        }
        return NULL;
}

START_TEST(test_threads) {
        vmmb_client *c = connect_or_fail();
        pthread_t threads[N_THREADS];
        uint64_t leased, leases;

        for (size_t i = 0; i < N_THREADS; i++)
                ck_assert_int_eq(pthread_create(&threads[i], NULL, thread_work, c), 0);
        for (size_t i = 0; i < N_THREADS; i++) {
                void *failure;

                ck_assert_int_eq(pthread_join(threads[i], &failure), 0);
                ck_assert_msg(!failure, "thread %zu: %s", i, (const char *)failure);
        }
        daemon_status(&leased, &leases);
        ck_assert_uint_eq(leased, 0);
        ck_assert_uint_eq(leases, 0);
        vmmb_close(c);
}
END_TEST

START_TEST(test_errors) {
        vmmb_client *c = connect_or_fail();
        vmmb_lease *l = NULL;

        ck_assert_int_eq(vmmb_alloc(c, 2 * MiB, 7, NULL, &l), -ENODEV);
        ck_assert_ptr_null(l);
        ck_assert_msg(strstr(vmmb_error_message(), "7"), "message: %s", vmmb_error_message());
        ck_assert_int_eq(vmmb_alloc(c, 2 * MiB, -5, NULL, &l), -ENODEV);
        ck_assert_msg(strstr(vmmb_error_message(), "-5"), "message: %s", vmmb_error_message());

        ck_assert_int_eq(vmmb_alloc(c, 0, VMMB_ANY_DEVICE, NULL, &l), -EINVAL);
        ck_assert_str_ne(vmmb_error_message(), "");
        ck_assert_int_eq(vmmb_alloc(c, UINT64_C(1) << 40, VMMB_ANY_DEVICE, NULL, &l), -EINVAL);
        ck_assert_msg(strstr(vmmb_error_message(), "device 0"), "message: %s", vmmb_error_message());
        ck_assert_int_eq(vmmb_alloc(c, UINT64_MAX, VMMB_ANY_DEVICE, NULL, &l), -EINVAL);
        ck_assert_str_ne(vmmb_error_message(), "");
        ck_assert_ptr_null(l);

        /* The broker checks the label (at most 128 bytes); the client stays usable after refusals. */
        {
                char label[200];

                memset(label, 'x', sizeof(label) - 1);
                label[sizeof(label) - 1] = 0;
                ck_assert_int_eq(vmmb_alloc(c, 2 * MiB, VMMB_ANY_DEVICE, label, &l), -EINVAL);
                ck_assert_msg(strstr(vmmb_error_message(), "label"), "message: %s", vmmb_error_message());
        }
        ck_assert_int_eq(vmmb_alloc(NULL, 2 * MiB, 0, NULL, &l), -EINVAL);
        ck_assert_int_eq(vmmb_alloc(c, 2 * MiB, 0, NULL, NULL), -EINVAL);

        /* Success leaves the last failure's message alone. */
        l = alloc_or_fail(c, 1, 0, NULL);
        ck_assert_uint_eq(vmmb_lease_size(l), 2 * MiB);
        ck_assert_str_ne(vmmb_error_message(), "");
        ck_assert_int_eq(vmmb_free(l), 0);

        ck_assert_int_eq(vmmb_free(NULL), 0);
        vmmb_close(NULL);
        vmmb_close(c);
}
END_TEST

static void *thread_error_message(void *arg) {
        return (void *)vmmb_error_message();
}

START_TEST(test_error_message_per_thread) {
        /* A new thread has no message; another thread's failure does not show in it. */
        vmmb_client *c = connect_or_fail();
        vmmb_lease *l = NULL;
        pthread_t t;
        void *out;

        ck_assert_str_eq(vmmb_error_message(), "");
        ck_assert_int_eq(vmmb_alloc(c, 0, 0, NULL, &l), -EINVAL);
        ck_assert_int_eq(pthread_create(&t, NULL, thread_error_message, NULL), 0);
        ck_assert_int_eq(pthread_join(t, &out), 0);
        ck_assert_str_eq(out, "");
        ck_assert_str_ne(vmmb_error_message(), "");
        vmmb_close(c);
}
END_TEST

START_TEST(test_connect_errors) {
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        char missing[128], dead[128];
        vmmb_client *c = NULL;
        int fd;

        snprintf(missing, sizeof(missing), "%s/no-such-socket", h.dir);
        ck_assert_int_eq(vmmb_connect(missing, &c), -ENOENT);
        ck_assert_ptr_null(c);
        ck_assert_msg(strstr(vmmb_error_message(), missing), "message: %s", vmmb_error_message());

        /* A socket nobody listens on. */
        snprintf(dead, sizeof(dead), "%s/dead", h.dir);
        fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        ck_assert_int_ge(fd, 0);
        strcpy(sa.sun_path, dead);
        ck_assert_int_eq(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
        ck_assert_int_eq(vmmb_connect(dead, &c), -ECONNREFUSED);
        ck_assert_ptr_null(c);
        ck_assert_msg(strstr(vmmb_error_message(), dead), "message: %s", vmmb_error_message());
        safe_close(fd);
        unlink(dead);

        ck_assert_int_eq(vmmb_connect("", &c), -EINVAL);

        /* $VMMBROKER_SOCKET when the caller names none. */
        ck_assert_int_eq(setenv("VMMBROKER_SOCKET", missing, 1), 0);
        ck_assert_int_eq(vmmb_connect(NULL, &c), -ENOENT);
        ck_assert_int_eq(setenv("VMMBROKER_SOCKET", h.socket, 1), 0);
        ck_assert_int_eq(vmmb_connect(NULL, &c), 0);
        vmmb_close(c);
}
END_TEST

START_TEST(test_no_driver) {
        vmmb_client *c = NULL;

        /* The library loads its driver at the first connect: after the harness and setup() ran. */
        ck_assert_int_eq(setenv("VMMBROKER_LIBCUDA", "/nonexistent/libcuda.so.1", 1), 0);
        ck_assert_int_eq(vmmb_connect(h.socket, &c), -ENODEV);
        ck_assert_ptr_null(c);
        ck_assert_msg(strstr(vmmb_error_message(), "/nonexistent/libcuda.so.1"), "message: %s",
                      vmmb_error_message());
        /* Once per process: the answer stays. */
        ck_assert_int_eq(vmmb_connect(h.socket, &c), -ENODEV);
}
END_TEST

START_TEST(test_close_frees_leases) {
        int fds_before = harness_fd_count(getpid());
        vmmb_client *c = connect_or_fail();
        uint64_t leased, leases;

        (void)alloc_or_fail(c, 2 * MiB, 0, "a");
        (void)alloc_or_fail(c, 4 * MiB, 0, "b");
        (void)alloc_or_fail(c, 66 * MiB, 0, "c");
        daemon_status(&leased, &leases);
        ck_assert_uint_eq(leased, 72 * MiB);
        ck_assert_uint_eq(leases, 3);

        vmmb_close(c);
        daemon_status(&leased, &leases);
        ck_assert_uint_eq(leased, 0);
        ck_assert_uint_eq(leases, 0);
        ck_assert_int_eq(harness_fd_count(getpid()), fds_before);
}
END_TEST

START_TEST(test_daemon_killed) {
        vmmb_client *c = connect_or_fail();
        vmmb_lease *l = alloc_or_fail(c, 4 * MiB, 0, NULL), *l2 = alloc_or_fail(c, 2 * MiB, 0, NULL), *l3 = NULL;

        ck_assert_int_eq(kill(h.pid, SIGKILL), 0);
        ck_assert_int_eq(harness_wait(h.pid), 128 + SIGKILL);
        h.pid = 0;
        daemon_killed = true;

        ck_assert_int_eq(vmmb_alloc(c, 2 * MiB, 0, NULL, &l3), -ECONNRESET);
        ck_assert_ptr_null(l3);
        ck_assert_str_ne(vmmb_error_message(), "");
        /* The mapping still works until freed; freeing unmaps, then cannot tell the broker. */
        ck_assert_int_eq(cu->cuMemsetD32(vmmb_lease_ptr(l), 1, vmmb_lease_size(l) / 4), CUDA_SUCCESS);
        ck_assert_int_eq(vmmb_free(l), -ECONNRESET);
        ck_assert_int_eq(vmmb_alloc(c, 2 * MiB, 0, NULL, &l3), -ECONNRESET);
        vmmb_close(c);          /* frees l2 */
        (void)l2;
        unlink(h.socket);
        rmdir(h.dir);
}
END_TEST

int main(void) {
        Suite *s = suite_create("client");
        TCase *tc = tcase_create("client");
        int failed;

        tcase_add_checked_fixture(tc, setup, teardown);
        tcase_add_test(tc, test_alloc_write_read);
        tcase_add_test(tc, test_threads);
        tcase_add_test(tc, test_errors);
        tcase_add_test(tc, test_error_message_per_thread);
        tcase_add_test(tc, test_connect_errors);
        tcase_add_test(tc, test_no_driver);
        tcase_add_test(tc, test_close_frees_leases);
        tcase_add_test(tc, test_daemon_killed);
        suite_add_tcase(s, tc);

        failed = run_suite(s);
        return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
