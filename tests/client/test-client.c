/* SPDX-License-Identifier: MIT */

/*
 * libvmmbroker against the real daemon on the simulated device. Each test
 * starts its own vmmbrokerd (tests/integration/harness.c) and opens the
 * driver itself, with device 0's primary context current, to write and read
 * the leased memory through the pointer the library returns.
 *
 * The sharing tests fork the second process (harness_fork()) after the
 * library has loaded the driver: the simulated device goes on working in a
 * forked child, as the real driver would not, so the child needs no driver of
 * its own; it makes its own client and attaches at addresses of its own. On
 * a real driver those tests say so and pass without running; sharing between
 * processes on a real GPU is run by tests/integration/test-share.c, whose
 * children open the driver after the fork, and by docs/examples' pair.
 */

#include <check.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <pwd.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "checked.h"
#include "clienttest.h"
#include "codec.h"
#include "driver.h"
#include "harness.h"
#include "json.h"
#include "macro.h"
#include "simcuda.h"
#include "varlink.h"
#include "vmmbroker.h"
#include "unit.h"

static Harness h;
static bool daemon_killed;

static void setup(void) {
        /* a 64 MiB maximum slab: 66 MiB leases are two slabs, and the tests cross a slab boundary */
        harness_start_or_fail(&h, NULL, (const char *const[]){ "--max-slab", "64M", NULL });
        driver_open_or_fail();
}

static void teardown(void) {
        int status;

        driver_close();
        status = harness_stop(&h);
        if (!daemon_killed)
                ck_assert_msg(status == 0, "vmmbrokerd exited with %d", status);
}

START_TEST(test_alloc_write_read) {
        vmmb_client *c = connect_or_fail(h.socket);
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
        /* the maker owns it, and the broker says so */
        ck_assert_uint_eq(vmmb_lease_owner(l), getuid());
        ck_assert_uint_eq(vmmb_lease_owner(NULL), (uid_t)-1);
        ck_assert_ptr_null(vmmb_lease_owner_name(NULL));

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
        vmmb_client *c = connect_or_fail(h.socket);
        pthread_t threads[N_THREADS];
        WireDevice d;

        for (size_t i = 0; i < N_THREADS; i++)
                ck_assert_int_eq(pthread_create(&threads[i], NULL, thread_work, c), 0);
        for (size_t i = 0; i < N_THREADS; i++) {
                void *failure;

                ck_assert_int_eq(pthread_join(threads[i], &failure), 0);
                ck_assert_msg(!failure, "thread %zu: %s", i, (const char *)failure);
        }
        d = daemon_device(h.socket);
        ck_assert_uint_eq(d.leased, 0);
        ck_assert_uint_eq(d.leases, 0);
        vmmb_close(c);
}
END_TEST

START_TEST(test_errors) {
        vmmb_client *c = connect_or_fail(h.socket);
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
        vmmb_client *c = connect_or_fail(h.socket);
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
        vmmb_client *c = connect_or_fail(h.socket);
        WireDevice d;

        (void)alloc_or_fail(c, 2 * MiB, 0, "a");
        (void)alloc_or_fail(c, 4 * MiB, 0, "b");
        (void)alloc_or_fail(c, 66 * MiB, 0, "c");
        d = daemon_device(h.socket);
        ck_assert_uint_eq(d.leased, 72 * MiB);
        ck_assert_uint_eq(d.leases, 3);

        vmmb_close(c);
        d = daemon_device(h.socket);
        ck_assert_uint_eq(d.leased, 0);
        ck_assert_uint_eq(d.leases, 0);
        ck_assert_int_eq(harness_fd_count(getpid()), fds_before);
}
END_TEST

/* The broker killed and not started again: calls try to connect again and give up at once here
 * (VMMBROKER_RECONNECT_TIMEOUT=0); test-reconnect.c has the restarts and the waiting. */
START_TEST(test_daemon_killed) {
        vmmb_client *c;
        vmmb_lease *l, *l2, *l3 = NULL;
        uint64_t unmaps;

        ck_assert_int_eq(setenv("VMMBROKER_RECONNECT_TIMEOUT", "0", 1), 0);
        c = connect_or_fail(h.socket);
        l = alloc_or_fail(c, 4 * MiB, 0, NULL);
        l2 = alloc_or_fail(c, 2 * MiB, 0, NULL);
        ck_assert_int_eq(kill(h.pid, SIGKILL), 0);
        ck_assert_int_eq(harness_wait(h.pid), 128 + SIGKILL);
        h.pid = 0;
        daemon_killed = true;

        /* The socket file is left behind: refused. */
        ck_assert_int_eq(vmmb_alloc(c, 2 * MiB, 0, NULL, &l3), -ECONNREFUSED);
        ck_assert_ptr_null(l3);
        ck_assert_msg(strstr(vmmb_error_message(), "no broker listened at"), "message: %s", vmmb_error_message());
        /* The mapping still works until freed; freeing unmaps, then cannot tell the broker. */
        ck_assert_int_eq(cu->cuMemsetD32(vmmb_lease_ptr(l), 1, vmmb_lease_size(l) / 4), CUDA_SUCCESS);
        unmaps = driver_calls("cuMemUnmap");
        ck_assert_int_eq(vmmb_free(l), -ECONNREFUSED);
        ck_assert(!driver_counts() || driver_calls("cuMemUnmap") == unmaps + 1);       /* never sent: unmapped after */
        /* so does a one-way Free: it would connect again to send the call, and no broker listens */
        ck_assert_int_eq(cu->cuMemsetD32(vmmb_lease_ptr(l2), 1, vmmb_lease_size(l2) / 4), CUDA_SUCCESS);
        ck_assert_int_eq(vmmb_free_oneway(l2), -ECONNREFUSED);
        ck_assert_msg(strstr(vmmb_error_message(), "no broker listened at"), "message: %s", vmmb_error_message());
        ck_assert_int_eq(unlink(h.socket), 0);
        ck_assert_int_eq(vmmb_alloc(c, 2 * MiB, 0, NULL, &l3), -ECONNREFUSED);  /* missing: the same */
        ck_assert_msg(strstr(vmmb_error_message(), strerror(ENOENT)), "message: %s", vmmb_error_message());
        vmmb_close(c);
        unlink(h.socket);
        rmdir(h.dir);
}
END_TEST

/* ---- sharing ------------------------------------------------------------------------------------------ */

static void share_or_fail(vmmb_lease *l, uid_t uid, unsigned flags, char token[VMMB_TOKEN_SIZE]) {
        int k;

        memset(token, 'x', VMMB_TOKEN_SIZE);
        k = vmmb_share(l, uid, flags, token);
        ck_assert_msg(k == 0, "vmmb_share: %s: %s", strerror(-k), vmmb_error_message());
        /* 32 hex digits, NUL-terminated in the buffer */
        ck_assert_uint_eq(strlen(token), 32);
        for (size_t i = 0; i < 32; i++)
                ck_assert_msg(isxdigit((unsigned char)token[i]), "token %s", token);
}

static vmmb_lease *attach_or_fail(vmmb_client *c, const char *token, const char *name, unsigned flags) {
        vmmb_lease *l = NULL;
        int k;

        k = token ? vmmb_attach(c, token, flags, &l) : vmmb_attach_name(c, name, flags, &l);
        ck_assert_msg(k == 0, "vmmb_attach%s(%s): %s: %s", token ? "" : "_name", token ?: name, strerror(-k),
                      vmmb_error_message());
        ck_assert_ptr_nonnull(l);
        return l;
}

typedef struct AttachArgs {
        const char *socket;
        const char *token;              /* attach by this token, or */
        const char *name;               /* by this name */
        unsigned flags;
        const char *id;                 /* the lease's identifier */
        uint64_t size;
        uint32_t expect;                /* what every word reads */
        uint32_t write;                 /* written through the attached lease, unless 0 */
        bool readonly;                  /* whether it must be mapped read-only */
        bool as_nobody;                 /* drop to uid/gid 65534 first */
        int error;                      /* what the attach must return instead, or 0 */
} AttachArgs;

/*
 * A second process: attaches, checks the lease against the args, reads it,
 * writes it (or checks that it cannot), attaches it once more and frees one
 * hold, and leaves the other to vmmb_close().
 */
static int child_attach(void *arg) {
        const AttachArgs *a = arg;
        vmmb_client *c = NULL;
        vmmb_lease *l = NULL, *l2 = NULL;
        uint32_t word = 0x12345678;
        int k;

        if (child_open(a->socket, a->as_nobody, &c) != 0)
                return 1;
        k = a->token ? vmmb_attach(c, a->token, a->flags, &l) : vmmb_attach_name(c, a->name, a->flags, &l);
        if (a->error) {
                CHILD_CHECK(k == a->error && !l, "attach returned %d (%s), want %d", k, strerror(-k), a->error);
                CHILD_CHECK(*vmmb_error_message(), "no message");
                vmmb_close(c);
                return 0;
        }
        CHILD_CHECK(k == 0, "attach: %s", strerror(-k));
        CHILD_CHECK(strcmp(vmmb_lease_id(l), a->id) == 0, "lease %s, want %s", vmmb_lease_id(l), a->id);
        CHILD_CHECK(vmmb_lease_size(l) == a->size, "%llu bytes", (unsigned long long)vmmb_lease_size(l));
        CHILD_CHECK(vmmb_lease_device(l) == 0, "device %d", vmmb_lease_device(l));
        CHILD_CHECK(vmmb_lease_readonly(l) == a->readonly, "readonly %d", vmmb_lease_readonly(l));
        CHILD_CHECK(words_are(vmmb_lease_ptr(l), a->size, a->expect), "the lease does not read 0x%08x", a->expect);

        if (a->readonly) {
                /* The driver refuses a write to memory mapped read-only, and nothing changes. */
                CHILD_CHECK(cu->cuMemcpyHtoD(vmmb_lease_ptr(l), &word, sizeof(word)) == CUDA_ERROR_INVALID_VALUE,
                            "a copy into the read-only lease did not fail");
                CHILD_CHECK(cu->cuMemsetD32(vmmb_lease_ptr(l), 0, 1) == CUDA_ERROR_INVALID_VALUE,
                            "a memset of the read-only lease did not fail");
                CHILD_CHECK(words_are(vmmb_lease_ptr(l), a->size, a->expect), "the read-only lease changed");
                /* A read-only holder can share it on read-only, not read-write, and cannot publish it. */
                {
                        char token[VMMB_TOKEN_SIZE];

                        k = vmmb_share(l, VMMB_ANY_UID, 0, token);
                        CHILD_CHECK(k == -EACCES, "read-write share by a read-only holder: %d", k);
                        k = vmmb_share(l, VMMB_ANY_UID, VMMB_READONLY, token);
                        CHILD_CHECK(k == 0, "read-only share by a read-only holder: %s", strerror(-k));
                        CHILD_CHECK(vmmb_revoke(c, token) == 0, "revoke");
                        k = vmmb_publish(l, "child-readonly", NULL, 0, VMMB_READONLY);
                        CHILD_CHECK(k == -EACCES, "publish by a read-only holder: %d", k);
                }
        } else if (a->write) {
                CHILD_CHECK(cu->cuMemsetD32(vmmb_lease_ptr(l), a->write, a->size / 4) == CUDA_SUCCESS, "memset");
                CHILD_CHECK(cu->cuCtxSynchronize() == CUDA_SUCCESS, "synchronize");
        }

        /* A second hold of the same lease: one more mapping of the same memory. */
        k = a->token ? vmmb_attach(c, a->token, a->flags, &l2) : vmmb_attach_name(c, a->name, a->flags, &l2);
        CHILD_CHECK(k == 0, "second attach: %s", strerror(-k));
        CHILD_CHECK(vmmb_lease_ptr(l2) != vmmb_lease_ptr(l), "the same address twice");
        CHILD_CHECK(strcmp(vmmb_lease_id(l2), a->id) == 0, "second lease %s", vmmb_lease_id(l2));
        CHILD_CHECK(words_are(vmmb_lease_ptr(l2), a->size, a->write && !a->readonly ? a->write : a->expect),
                    "the second mapping does not read what the first does");
        k = vmmb_free(l);
        CHILD_CHECK(k == 0, "vmmb_free: %s", strerror(-k));
        vmmb_close(c);          /* frees l2 */
        return 0;
}

/* The end of a test that holds one lease: frees it, and the broker holds nothing; closes the client. */
static void free_last_and_close(vmmb_client *c, vmmb_lease *l) {
        ck_assert_int_eq(vmmb_free(l), 0);
        ck_assert_uint_eq(daemon_leases(h.socket), 0);
        vmmb_close(c);
}

START_TEST(test_share_attach) {
        vmmb_client *c = connect_or_fail(h.socket);
        vmmb_lease *l = alloc_or_fail(c, 66 * MiB, VMMB_ANY_DEVICE, "shared");
        int fds_before = harness_fd_count(getpid());
        char token[VMMB_TOKEN_SIZE];
        AttachArgs a;

        if (skip_fork_on_real_driver(__func__))
                return;
        fill(l, 0xA11CE000);
        share_or_fail(l, VMMB_ANY_UID, 0, token);
        ck_assert_int_eq(vmmb_lease_readonly(l), 0);

        /* Another process sees this one's writes, and this one its writes: the same memory. */
        a = (AttachArgs){ .socket = h.socket, .token = token, .id = vmmb_lease_id(l), .size = 66 * MiB,
                          .expect = 0xA11CE000, .write = 0xB0B0CAFE };
        run_child(child_attach, &a);
        ck_assert(lease_reads(l, 0xB0B0CAFE));
        /* Its holds ended with it (free and close); the lease stays this process's. */
        ck_assert_uint_eq(daemon_leases(h.socket), 1);

        /* A token can be used again, and a token for the caller's uid works as well. */
        share_or_fail(l, getuid(), 0, token);
        a.expect = 0xB0B0CAFE;
        a.write = 0x0DDBA11;
        run_child(child_attach, &a);
        ck_assert(lease_reads(l, 0x0DDBA11));
        ck_assert_int_eq(harness_fd_count(getpid()), fds_before);

        free_last_and_close(c, l);
}
END_TEST

START_TEST(test_attach_outlives_maker) {
        vmmb_client *c = connect_or_fail(h.socket);
        vmmb_lease *l = alloc_or_fail(c, 4 * MiB, 0, NULL), *l2, *l3;
        char token[VMMB_TOKEN_SIZE];
        WireDevice d;

        fill(l, 0x5EED5EED);
        share_or_fail(l, VMMB_ANY_UID, 0, token);

        /* In one process too: each attach is one more hold, mapped at an address of its own. */
        l2 = attach_or_fail(c, token, NULL, 0);
        ck_assert_str_eq(vmmb_lease_id(l2), vmmb_lease_id(l));
        ck_assert_uint_ne(vmmb_lease_ptr(l2), vmmb_lease_ptr(l));
        ck_assert_uint_eq(vmmb_lease_size(l2), 4 * MiB);
        ck_assert_int_eq(vmmb_lease_readonly(l2), 0);
        ck_assert(lease_reads(l2, 0x5EED5EED));

        /* Freeing the lease it was made as leaves the attached one. */
        ck_assert_int_eq(vmmb_free(l), 0);
        d = daemon_device(h.socket);
        ck_assert_uint_eq(d.leases, 1);
        ck_assert_uint_eq(d.leased, 4 * MiB);
        ck_assert(lease_reads(l2, 0x5EED5EED));
        fill(l2, 0xFEEDF00D);

        /* The token lives as long as the lease. */
        l3 = attach_or_fail(c, token, NULL, VMMB_READONLY);
        ck_assert_int_eq(vmmb_lease_readonly(l3), 1);
        ck_assert(lease_reads(l3, 0xFEEDF00D));
        ck_assert_int_eq(vmmb_free(l2), 0);
        ck_assert_int_eq(vmmb_free(l3), 0);

        /* The last hold ended the lease and its tokens; the memory comes back zeroed. */
        ck_assert_uint_eq(daemon_leases(h.socket), 0);
        l3 = NULL;
        ck_assert_int_eq(vmmb_attach(c, token, 0, &l3), -ENOKEY);
        ck_assert_ptr_null(l3);
        l = alloc_or_fail(c, 4 * MiB, 0, NULL);
        ck_assert(lease_reads(l, 0));
        vmmb_close(c);
        ck_assert_uint_eq(daemon_leases(h.socket), 0);
}
END_TEST

START_TEST(test_attach_readonly) {
        vmmb_client *c = connect_or_fail(h.socket);
        vmmb_lease *l = alloc_or_fail(c, 66 * MiB, 0, "ro"), *l2;
        char ro[VMMB_TOKEN_SIZE], rw[VMMB_TOKEN_SIZE];
        uint32_t word = 1;
        AttachArgs a;

        if (skip_fork_on_real_driver(__func__))
                return;
        fill(l, 0xC0FFEE00);
        share_or_fail(l, VMMB_ANY_UID, VMMB_READONLY, ro);
        share_or_fail(l, VMMB_ANY_UID, 0, rw);
        ck_assert_str_ne(ro, rw);

        /* A read-only token maps read-only in another process: writes fail there. */
        a = (AttachArgs){ .socket = h.socket, .token = ro, .id = vmmb_lease_id(l), .size = 66 * MiB,
                          .expect = 0xC0FFEE00, .readonly = true };
        run_child(child_attach, &a);
        /* So does a read-write token when the attach asks for read-only. */
        a.token = rw;
        a.flags = VMMB_READONLY;
        run_child(child_attach, &a);
        ck_assert(lease_reads(l, 0xC0FFEE00));

        /* This process holds it read-write already: the read-only token gives no less, but asking does. */
        l2 = attach_or_fail(c, ro, NULL, 0);
        ck_assert_int_eq(vmmb_lease_readonly(l2), 0);
        ck_assert_int_eq(vmmb_free(l2), 0);
        l2 = attach_or_fail(c, rw, NULL, VMMB_READONLY);
        ck_assert_int_eq(vmmb_lease_readonly(l2), 1);
        ck_assert_int_eq(cu->cuMemcpyHtoD(vmmb_lease_ptr(l2), &word, sizeof(word)), CUDA_ERROR_INVALID_VALUE);
        ck_assert(lease_reads(l2, 0xC0FFEE00));
        ck_assert_int_eq(vmmb_free(l2), 0);

        free_last_and_close(c, l);
}
END_TEST

typedef struct PublishArgs {
        const char *socket;
        const char *name;
        uint32_t value;
} PublishArgs;

/* A producer: leases, fills, publishes and exits without freeing. */
static int child_publish(void *arg) {
        const PublishArgs *a = arg;
        vmmb_client *c = NULL;
        vmmb_lease *l = NULL;
        int k;

        if (child_open(a->socket, false, &c) != 0)
                return 1;
        k = vmmb_alloc(c, 6 * MiB, 0, "producer", &l);
        CHILD_CHECK(k == 0, "vmmb_alloc: %s", strerror(-k));
        CHILD_CHECK(cu->cuMemsetD32(vmmb_lease_ptr(l), a->value, vmmb_lease_size(l) / 4) == CUDA_SUCCESS, "memset");
        CHILD_CHECK(cu->cuCtxSynchronize() == CUDA_SUCCESS, "synchronize");
        k = vmmb_publish(l, a->name, NULL, 0, 0);
        CHILD_CHECK(k == 0, "vmmb_publish: %s", strerror(-k));
        return 0;               /* exits holding it: the name keeps it */
}

/* The caller's user name, as the broker looks it up (NULL when it has none). */
static const char *my_user_name(void) {
        const struct passwd *pw = getpwuid(getuid());

        return pw ? pw->pw_name : NULL;
}

START_TEST(test_publish) {
        vmmb_client *c = connect_or_fail(h.socket);
        vmmb_lease *l = alloc_or_fail(c, 4 * MiB, 0, "published"), *l2, *other, *none = NULL;
        const char *name = "test.weights-1.0:a@b+c_d";
        char ref[256];
        uid_t users[] = { 1000, NOBODY };
        PublishArgs p = { .socket = h.socket, .name = "made-by-a-child", .value = 0xDA7A0001 };
        AttachArgs a;

        if (skip_fork_on_real_driver(__func__))
                return;
        fill(l, 0x9E1B0000);
        ck_assert_int_eq(vmmb_publish(l, name, NULL, 0, 0), 0);
        /* The same name again updates it; another lease cannot take it; this one has no second name. */
        ck_assert_int_eq(vmmb_publish(l, name, users, 2, 0), 0);
        other = alloc_or_fail(c, 2 * MiB, 0, NULL);
        ck_assert_int_eq(vmmb_publish(other, name, NULL, 0, 0), -EEXIST);
        ck_assert_msg(strstr(vmmb_error_message(), name), "message: %s", vmmb_error_message());
        ck_assert_int_eq(vmmb_publish(l, "another-name", NULL, 0, 0), -EINVAL);
        ck_assert_int_eq(vmmb_free(other), 0);

        /* A name with '/' is refused before anything is sent, saying how others name it. */
        ck_assert_int_eq(vmmb_publish(l, "test/weights", NULL, 0, 0), -EINVAL);
        ck_assert_msg(strstr(vmmb_error_message(), "OWNER/NAME"), "message: %s", vmmb_error_message());
        ck_assert_int_eq(vmmb_publish(l, "a/", NULL, 0, 0), -EINVAL);

        /* Published, it outlives every holder. */
        ck_assert_int_eq(vmmb_free(l), 0);
        ck_assert_uint_eq(daemon_leases(h.socket), 1);
        l = attach_or_fail(c, NULL, name, 0);
        ck_assert_int_eq(vmmb_lease_readonly(l), 0);
        ck_assert_uint_eq(vmmb_lease_size(l), 4 * MiB);
        ck_assert(lease_reads(l, 0x9E1B0000));

        /* The reply says whose it is; the owner may name it OWNER/NAME too, by uid or user name. */
        ck_assert_uint_eq(vmmb_lease_owner(l), getuid());
        if (my_user_name())
                ck_assert_str_eq(vmmb_lease_owner_name(l) ?: "(none)", my_user_name());
        snprintf(ref, sizeof(ref), "%u/%s", (unsigned)getuid(), name);
        l2 = attach_or_fail(c, NULL, ref, 0);
        ck_assert_str_eq(vmmb_lease_id(l2), vmmb_lease_id(l));
        ck_assert_uint_eq(vmmb_lease_owner(l2), getuid());
        ck_assert_int_eq(vmmb_free(l2), 0);
        if (my_user_name()) {
                snprintf(ref, sizeof(ref), "%s/%s", my_user_name(), name);
                l2 = attach_or_fail(c, NULL, ref, 0);
                ck_assert_str_eq(vmmb_lease_id(l2), vmmb_lease_id(l));
                ck_assert_int_eq(vmmb_free(l2), 0);
        }
        /* The same name of another owner is another name: none here. */
        snprintf(ref, sizeof(ref), "%u/%s", (unsigned)getuid() + 4242, name);
        ck_assert_int_eq(vmmb_attach_name(c, ref, 0, &none), -ENOENT);
        ck_assert_int_eq(vmmb_attach_name(c, "no-such-user-of-vmmb/x", 0, &none), -ENOENT);
        ck_assert_ptr_null(none);

        /* Another process attaches by the name; published read-only, it gets a read-only mapping. */
        a = (AttachArgs){ .socket = h.socket, .name = name, .id = vmmb_lease_id(l), .size = 4 * MiB,
                          .expect = 0x9E1B0000, .write = 0x9E1B0001 };
        run_child(child_attach, &a);
        ck_assert(lease_reads(l, 0x9E1B0001));
        ck_assert_int_eq(vmmb_publish(l, name, NULL, 0, VMMB_READONLY), 0);
        a.expect = 0x9E1B0001;
        a.readonly = true;
        run_child(child_attach, &a);

        /* Unpublished, it ends with its last holder. */
        ck_assert_int_eq(vmmb_unpublish(c, name), 0);
        ck_assert_int_eq(vmmb_unpublish(c, name), -ENOENT);
        ck_assert_msg(strstr(vmmb_error_message(), name), "message: %s", vmmb_error_message());
        ck_assert_int_eq(vmmb_attach_name(c, name, 0, &none), -ENOENT);
        ck_assert_ptr_null(none);
        ck_assert_uint_eq(daemon_leases(h.socket), 1);
        ck_assert(lease_reads(l, 0x9E1B0001));
        ck_assert_int_eq(vmmb_free(l), 0);
        ck_assert_uint_eq(daemon_leases(h.socket), 0);

        /* A lease published by a process that exited: attached by the next one, then unpublished. */
        run_child(child_publish, &p);
        ck_assert_uint_eq(daemon_leases(h.socket), 1);
        l2 = attach_or_fail(c, NULL, p.name, 0);
        ck_assert(lease_reads(l2, 0xDA7A0001));
        ck_assert_int_eq(vmmb_free(l2), 0);
        ck_assert_uint_eq(daemon_leases(h.socket), 1);
        ck_assert_int_eq(vmmb_unpublish(c, p.name), 0);
        ck_assert_uint_eq(daemon_leases(h.socket), 0);
        vmmb_close(c);
}
END_TEST

START_TEST(test_share_errors) {
        vmmb_client *c = connect_or_fail(h.socket);
        vmmb_lease *l = alloc_or_fail(c, 2 * MiB, 0, NULL), *none = NULL;
        char token[VMMB_TOKEN_SIZE], tokens[64][VMMB_TOKEN_SIZE];
        uid_t other = getuid() == 0 ? NOBODY : getuid() + 1;

        /* A token nobody made, a revoked one. */
        ck_assert_int_eq(vmmb_attach(c, "0123456789abcdef0123456789abcdef", 0, &none), -ENOKEY);
        ck_assert_msg(strstr(vmmb_error_message(), "token"), "message: %s", vmmb_error_message());
        ck_assert_int_eq(vmmb_revoke(c, "0123456789abcdef0123456789abcdef"), -ENOKEY);
        share_or_fail(l, VMMB_ANY_UID, 0, token);
        ck_assert_int_eq(vmmb_revoke(c, token), 0);
        ck_assert_int_eq(vmmb_attach(c, token, 0, &none), -ENOKEY);
        ck_assert_int_eq(vmmb_revoke(c, token), -ENOKEY);

        /* A token for another user. */
        share_or_fail(l, other, 0, token);
        ck_assert_int_eq(vmmb_attach(c, token, 0, &none), -EACCES);
        ck_assert_str_ne(vmmb_error_message(), "");
        ck_assert_ptr_null(none);
        ck_assert_int_eq(vmmb_revoke(c, token), 0);

        /* At most 64 live tokens a lease; revoking one makes room. */
        for (size_t i = 0; i < 64; i++)
                share_or_fail(l, VMMB_ANY_UID, i % 2 ? VMMB_READONLY : 0, tokens[i]);
        ck_assert_int_eq(vmmb_share(l, VMMB_ANY_UID, 0, token), -EDQUOT);
        ck_assert_msg(strstr(vmmb_error_message(), "token"), "message: %s", vmmb_error_message());
        ck_assert_int_eq(vmmb_revoke(c, tokens[7]), 0);
        share_or_fail(l, VMMB_ANY_UID, 0, token);

        /* Published to 64 users, not 65. */
        {
                uid_t users[65];

                for (size_t i = 0; i < 65; i++)
                        users[i] = (uid_t)(2000 + i);
                ck_assert_int_eq(vmmb_publish(l, "many", users, 65, 0), -EINVAL);
                ck_assert_int_eq(vmmb_publish(l, "many", users, 64, 0), 0);
                users[3] = VMMB_ANY_UID;
                ck_assert_int_eq(vmmb_publish(l, "many", users, 64, 0), -EINVAL);
                ck_assert_int_eq(vmmb_publish(l, "many", NULL, 1, 0), -EINVAL);
                ck_assert_int_eq(vmmb_unpublish(c, "many"), 0);
        }

        /* Arguments. */
        ck_assert_int_eq(vmmb_share(NULL, VMMB_ANY_UID, 0, token), -EINVAL);
        ck_assert_int_eq(vmmb_share(l, VMMB_ANY_UID, 0, NULL), -EINVAL);
        ck_assert_int_eq(vmmb_share(l, VMMB_ANY_UID, 2, token), -EINVAL);
        ck_assert_int_eq(vmmb_revoke(NULL, token), -EINVAL);
        ck_assert_int_eq(vmmb_revoke(c, NULL), -EINVAL);
        ck_assert_int_eq(vmmb_revoke(c, ""), -EINVAL);
        ck_assert_int_eq(vmmb_attach(NULL, token, 0, &none), -EINVAL);
        ck_assert_int_eq(vmmb_attach(c, NULL, 0, &none), -EINVAL);
        ck_assert_int_eq(vmmb_attach(c, "", 0, &none), -EINVAL);
        ck_assert_int_eq(vmmb_attach(c, token, 0, NULL), -EINVAL);
        ck_assert_int_eq(vmmb_attach(c, token, VMMB_READONLY | 4, &none), -EINVAL);
        {
                char long_token[VMMB_TOKEN_SIZE + 1];

                memset(long_token, 'a', VMMB_TOKEN_SIZE);
                long_token[VMMB_TOKEN_SIZE] = 0;
                ck_assert_int_eq(vmmb_attach(c, long_token, 0, &none), -EINVAL);
                ck_assert_int_eq(vmmb_revoke(c, long_token), -EINVAL);
                long_token[VMMB_TOKEN_SIZE - 1] = 0;   /* the longest a token may be: unknown, not invalid */
                ck_assert_int_eq(vmmb_attach(c, long_token, 0, &none), -ENOKEY);
        }
        /* Sent with the characters replaced: no token has them. */
        ck_assert_int_eq(vmmb_attach(c, "token\twith\ncontrols\xff", 0, &none), -ENOKEY);
        ck_assert_ptr_null(none);

        {
                char long_name[130];

                memset(long_name, 'n', sizeof(long_name) - 1);
                long_name[sizeof(long_name) - 1] = 0;
                for (size_t i = 0; i < 10; i++) {
                        const char *bad = (const char *[]){ "", "-starts-with-dash", ".hidden", "has space",
                                                             "ünïcode", long_name, "/no-owner", "owner/",
                                                             "owner/-dash", "owner/has space" }[i];

                        ck_assert_int_eq(vmmb_publish(l, bad, NULL, 0, 0), -EINVAL);
                        ck_assert_int_eq(vmmb_attach_name(c, bad, 0, &none), -EINVAL);
                        ck_assert_int_eq(vmmb_unpublish(c, bad), -EINVAL);
                        ck_assert_str_ne(vmmb_error_message(), "");
                }
                /* An OWNER longer than a user name can be. */
                {
                        char long_owner[80];

                        memset(long_owner, 'o', 65);
                        strcpy(long_owner + 65, "/x");
                        ck_assert_int_eq(vmmb_attach_name(c, long_owner, 0, &none), -EINVAL);
                        ck_assert_int_eq(vmmb_unpublish(c, long_owner), -EINVAL);
                }
                long_name[128] = 0;     /* 128 bytes: a name */
                ck_assert_int_eq(vmmb_attach_name(c, long_name, 0, &none), -ENOENT);
        }
        ck_assert_int_eq(vmmb_publish(NULL, "x", NULL, 0, 0), -EINVAL);
        ck_assert_int_eq(vmmb_publish(l, NULL, NULL, 0, 0), -EINVAL);
        ck_assert_int_eq(vmmb_publish(l, "x", NULL, 0, 8), -EINVAL);
        ck_assert_int_eq(vmmb_attach_name(NULL, "x", 0, &none), -EINVAL);
        ck_assert_int_eq(vmmb_attach_name(c, NULL, 0, &none), -EINVAL);
        ck_assert_int_eq(vmmb_attach_name(c, "x", 0, NULL), -EINVAL);
        ck_assert_int_eq(vmmb_attach_name(c, "x", 2, &none), -EINVAL);
        ck_assert_int_eq(vmmb_unpublish(NULL, "x"), -EINVAL);
        ck_assert_int_eq(vmmb_unpublish(c, NULL), -EINVAL);
        ck_assert_ptr_null(none);
        ck_assert_int_eq(vmmb_lease_readonly(NULL), 0);

        /* The client is still usable, and nothing leaked. */
        ck_assert_int_eq(vmmb_free(l), 0);
        ck_assert_int_eq(vmmb_attach(c, tokens[0], 0, &none), -ENOKEY);
        ck_assert_uint_eq(daemon_leases(h.socket), 0);
        vmmb_close(c);
}
END_TEST

typedef struct NobodyArgs {
        const char *socket;
        const char *token_any;          /* attachable by anyone */
        const char *token_nobody;       /* made for uid 65534 */
        const char *token_root;         /* made for uid 0 */
        const char *name_closed;        /* published to no other user, as nobody names it (OWNER/NAME) */
        const char *name_open;          /* published to 65534, as nobody names it (OWNER/NAME) */
        const char *bare_open;          /* name_open without its owner: nobody's own namespace */
        const char *id;
        uint64_t size;
        uint32_t expect;
} NobodyArgs;

/*
 * As uid 65534: attach what was shared with it, by OWNER/NAME; be refused what was not, and not told whether
 * a name it may not attach exists; revoke, unpublish and share on nothing; publish the same name as root in
 * its own namespace.
 */
static int child_nobody(void *arg) {
        const NobodyArgs *a = arg;
        vmmb_client *c = NULL;
        vmmb_lease *l = NULL, *own = NULL;
        vmmb_token *tokens = NULL;
        size_t n_tokens = 0;
        char token[VMMB_TOKEN_SIZE], missing[256];
        int k;

        if (child_open(a->socket, true, &c) != 0)
                return 1;

        k = vmmb_attach(c, a->token_root, 0, &l);
        CHILD_CHECK(k == -EACCES && !l, "attach with root's token: %d", k);
        /* A name not published to nobody reads as one that does not exist, and so does its bare NAME. */
        k = vmmb_attach_name(c, a->name_closed, 0, &l);
        CHILD_CHECK(k == -ENOENT && !l, "attach by a name not published to nobody: %d", k);
        snprintf(missing, sizeof(missing), "%s-missing", a->name_closed);
        k = vmmb_attach_name(c, missing, 0, &l);
        CHILD_CHECK(k == -ENOENT && !l, "attach by a name nobody published: %d", k);
        k = vmmb_attach_name(c, a->bare_open, 0, &l);
        CHILD_CHECK(k == -ENOENT && !l, "attach of root's name without its owner: %d", k);
        k = vmmb_revoke(c, a->token_root);
        CHILD_CHECK(k == -EACCES, "revoke of root's token: %d", k);
        k = vmmb_unpublish(c, a->name_open);
        CHILD_CHECK(k == -EACCES, "unpublish of root's name published to nobody: %d", k);
        k = vmmb_unpublish(c, a->name_closed);
        CHILD_CHECK(k == -ENOENT, "unpublish of root's name not published to nobody: %d", k);

        for (size_t i = 0; i < 3; i++) {
                k = i == 0 ? vmmb_attach(c, a->token_any, 0, &l) :
                    i == 1 ? vmmb_attach(c, a->token_nobody, 0, &l) : vmmb_attach_name(c, a->name_open, 0, &l);
                CHILD_CHECK(k == 0, "attach %zu as nobody: %s", i, strerror(-k));
                CHILD_CHECK(strcmp(vmmb_lease_id(l), a->id) == 0 && vmmb_lease_size(l) == a->size, "lease");
                /* whose memory it is: root's */
                CHILD_CHECK(vmmb_lease_owner(l) == 0, "owner %u", (unsigned)vmmb_lease_owner(l));
                CHILD_CHECK(strcmp(vmmb_lease_owner_name(l) ?: "(none)", "root") == 0, "owner name %s",
                            vmmb_lease_owner_name(l) ?: "(none)");
                CHILD_CHECK(words_are(vmmb_lease_ptr(l), a->size, a->expect), "does not read 0x%08x", a->expect);
                CHILD_CHECK(vmmb_free(l) == 0, "free");
                l = NULL;
        }

        /* A holder of another user may neither publish it, nor share it on, nor see its tokens. */
        k = vmmb_attach(c, a->token_any, 0, &l);
        CHILD_CHECK(k == 0, "attach: %s", strerror(-k));
        k = vmmb_publish(l, "nobodys", NULL, 0, 0);
        CHILD_CHECK(k == -EACCES, "publish of root's lease by nobody: %d", k);
        k = vmmb_share(l, VMMB_ANY_UID, 0, token);
        CHILD_CHECK(k == -EACCES, "share of root's lease by nobody: %d", k);
        k = vmmb_share(l, VMMB_ANY_UID, VMMB_READONLY, token);
        CHILD_CHECK(k == -EACCES, "read-only share of root's lease by nobody: %d", k);
        k = vmmb_tokens(l, &tokens, &n_tokens);
        CHILD_CHECK(k == -EACCES && !tokens, "tokens of root's lease by nobody: %d", k);
        CHILD_CHECK(*vmmb_error_message(), "no message");
        CHILD_CHECK(vmmb_free(l) == 0, "free");

        /* Nobody's own namespace: the same name as root's is another lease, its own. */
        k = vmmb_alloc(c, 2 * MiB, 0, "nobody's", &own);
        CHILD_CHECK(k == 0, "alloc by nobody: %s", strerror(-k));
        CHILD_CHECK(vmmb_lease_owner(own) == NOBODY, "owner %u", (unsigned)vmmb_lease_owner(own));
        k = vmmb_publish(own, a->bare_open, NULL, 0, 0);
        CHILD_CHECK(k == 0, "nobody publishes root's name in its own namespace: %s", strerror(-k));
        k = vmmb_attach_name(c, a->bare_open, 0, &l);
        CHILD_CHECK(k == 0, "attach of nobody's own name: %s", strerror(-k));
        CHILD_CHECK(strcmp(vmmb_lease_id(l), vmmb_lease_id(own)) == 0, "attached %s, not its own %s",
                    vmmb_lease_id(l), vmmb_lease_id(own));
        CHILD_CHECK(vmmb_lease_owner(l) == NOBODY, "owner %u", (unsigned)vmmb_lease_owner(l));
        CHILD_CHECK(vmmb_free(l) == 0, "free");
        /* and the owner of a lease lists the tokens that it made */
        k = vmmb_share(own, 0, VMMB_READONLY, token);
        CHILD_CHECK(k == 0, "share by nobody of its own lease: %s", strerror(-k));
        k = vmmb_tokens(own, &tokens, &n_tokens);
        CHILD_CHECK(k == 0 && n_tokens == 1 && strcmp(tokens[0].token, token) == 0 && tokens[0].uid == 0 &&
                    tokens[0].creator == NOBODY && tokens[0].readonly == 1, "tokens of its own lease: %d", k);
        vmmb_tokens_free(tokens, n_tokens);
        k = vmmb_unpublish(c, a->bare_open);
        CHILD_CHECK(k == 0, "nobody unpublishes its own name: %s", strerror(-k));
        vmmb_close(c);
        return 0;
}

/*
 * Whether `test`, which runs a child as user nobody, can run here: the child is forked, which only the simulated
 * device survives, and drops to nobody, which takes root. When not, a line says the test was not run.
 */
static bool other_user_runs(const char *test) {
        if (skip_fork_on_real_driver(test))
                return false;
        if (geteuid() != 0) {
                fprintf(stderr, "%s: not run: it runs a child as another user, which takes root\n", test);
                return false;
        }
        return true;
}

START_TEST(test_other_user) {
        char any[VMMB_TOKEN_SIZE], nobody[VMMB_TOKEN_SIZE], root[VMMB_TOKEN_SIZE];
        uid_t user = NOBODY;
        NobodyArgs a;
        vmmb_client *c;
        vmmb_lease *l;

        if (!other_user_runs(__func__))
                return;
        c = connect_or_fail(h.socket);
        l = alloc_or_fail(c, 4 * MiB, 0, NULL);
        fill(l, 0x0BAD0000);
        share_or_fail(l, VMMB_ANY_UID, 0, any);
        share_or_fail(l, NOBODY, 0, nobody);
        share_or_fail(l, 0, 0, root);
        ck_assert_int_eq(vmmb_publish(l, "for-nobody", &user, 1, 0), 0);
        {
                vmmb_lease *closed = alloc_or_fail(c, 2 * MiB, 0, NULL);

                ck_assert_int_eq(vmmb_publish(closed, "for-root", NULL, 0, 0), 0);
                ck_assert_int_eq(vmmb_free(closed), 0);
        }

        /* Let nobody reach the private socket. */
        ck_assert_int_eq(chmod(h.dir, 0711), 0);
        ck_assert_int_eq(chmod(h.socket, 0666), 0);
        a = (NobodyArgs){ .socket = h.socket, .token_any = any, .token_nobody = nobody, .token_root = root,
                          .name_closed = "0/for-root", .name_open = "root/for-nobody", .bare_open = "for-nobody",
                          .id = vmmb_lease_id(l), .size = 4 * MiB, .expect = 0x0BAD0000 };
        run_child(child_nobody, &a);

        /* Root's tokens and names are as they were; nobody's lease ended with its name. */
        ck_assert_uint_eq(daemon_leases(h.socket), 2);
        ck_assert_int_eq(vmmb_revoke(c, root), 0);
        ck_assert_int_eq(vmmb_unpublish(c, "for-root"), 0);
        ck_assert_int_eq(vmmb_unpublish(c, "for-nobody"), 0);
        free_last_and_close(c, l);
}
END_TEST

/* ---- one-way frees ------------------------------------------------------------------------------------ */

typedef struct FloodArgs {
        const char *socket;
        const char *id;                 /* root's lease, which the child does not hold */
} FloodArgs;

/*
 * Another user's process, as a hostile client: a thousand one-way Frees of root's lease, by its identifier,
 * written at once on a raw connection. None may end a hold it does not have, and none is answered: the
 * first answer on the connection is that of the Status sent after them.
 */
static int child_oneway_flood(void *arg) {
        const FloodArgs *a = arg;
        _cleanup_(json_object_putp) json_object *params = json_object_new_object(), *call = NULL;
        VarlinkConn *c = NULL;
        WireDevice d;
        int k;

        if (drop_to_nobody() != 0)
                return 1;
        CHILD_CHECK(params && json_object_object_add(params, "id", json_object_new_string(a->id)) == 0, "params");
        CHILD_CHECK(varlink_call_new(VMMB_METHOD_FREE, params, true, false, &call) == 0, "call");
        CHILD_CHECK(harness_conn_open(a->socket, false, &c) == 0, "connect");
        for (unsigned i = 0; i < 1000; i++)
                CHILD_CHECK(varlink_conn_send(c, call, NULL, 0) == 0, "queue the Free");
        CHILD_CHECK(varlink_conn_flush(c) >= 0, "send the Frees");
        k = harness_status_on(c, &d);
        CHILD_CHECK(k == 0, "Status after the Frees: %s", strerror(-k));
        varlink_conn_free(c);
        return 0;
}

/*
 * vmmb_free_oneway(): the broker reads the Free before the client's next call, so on a device with room for
 * one lease the next Alloc of the same client finds it; the memory comes back scrubbed; and another user's
 * one-way Frees of the lease change nothing.
 */
START_TEST(test_free_oneway) {
        vmmb_client *c;
        vmmb_lease *l;
        WireDevice d;
        int k;

        harness_stop_or_fail(&h);
        harness_start_capped_or_fail(&h, "64M", NULL);
        c = connect_or_fail(h.socket);
        l = alloc_or_fail(c, 64 * MiB, 0, NULL);
        fill(l, 0x0DDBA11);
        ck_assert_int_eq(vmmb_free_oneway(l), 0);
        ck_assert_int_eq(vmmb_free_oneway(NULL), 0);
        l = alloc_or_fail(c, 64 * MiB, 0, NULL);
        ck_assert(lease_reads(l, 0));
        d = daemon_device(h.socket);
        ck_assert_uint_eq(d.leases, 1);
        ck_assert_uint_eq(d.leased, 64 * MiB);

        if (!skip_fork_on_real_driver(__func__) && geteuid() == 0) {
                FloodArgs a = { .socket = h.socket, .id = vmmb_lease_id(l) };

                fill(l, 0x5AFE5AFE);
                ck_assert_int_eq(chmod(h.dir, 0711), 0);
                ck_assert_int_eq(chmod(h.socket, 0666), 0);
                run_child(child_oneway_flood, &a);
                ck_assert_uint_eq(daemon_leases(h.socket), 1);
                ck_assert(lease_reads(l, 0x5AFE5AFE));
        }

        /* A one-way Free, then the client closed at once: the broker still reads the call (closing alone does
         * not end a hold, and this process lives on), so a waiting Alloc on a new connection gets the room. */
        ck_assert_int_eq(vmmb_free_oneway(l), 0);
        vmmb_close(c);
        c = connect_or_fail(h.socket);
        l = NULL;
        k = vmmb_alloc_wait(c, 64 * MiB, 0, NULL, 30 * 1000000ULL, &l);
        ck_assert_msg(k == 0, "vmmb_alloc_wait: %s: %s", strerror(-k), vmmb_error_message());
        ck_assert(lease_reads(l, 0));
        free_last_and_close(c, l);
}
END_TEST

/* Address ranges the driver reserved and freed in this process since *since, which it then moves on. */
static void ranges_since(uint64_t since[2], uint64_t *ret_reserved, uint64_t *ret_freed) {
        uint64_t r = driver_calls("cuMemAddressReserve"), f = driver_calls("cuMemAddressFree");

        *ret_reserved = r - since[0];
        *ret_freed = f - since[1];
        since[0] = r;
        since[1] = f;
}

/* The simulated device's simcuda_fail(), or NULL, with a line saying `test` was not run, on a driver that
 * neither counts nor fails calls (the real one). */
static __typeof__(&simcuda_fail) sim_inject(const char *test) {
        __typeof__(&simcuda_fail) inject = (__typeof__(inject))driver_hook("simcuda_fail");

        if (driver_counts() && inject)
                return inject;
        fprintf(stderr, "%s: not run: it counts and fails driver calls, which only the simulated device does\n",
                test);
        return NULL;
}

/*
 * An Alloc reserves its lease's address range while the reply is on the way and maps the lease there: one
 * reservation per lease, freed with it; and none left behind when the reservation fails, the mapping fails or
 * the broker refuses, nor made when a kept lease comes back mapped.
 */
START_TEST(test_alloc_reserves_ahead) {
        __typeof__(&simcuda_fail) inject = sim_inject(__func__);
        uint64_t since[2] = {}, reserved, freed, ptr;
        char id[VMMB_ID_MAX + 1];
        vmmb_client *c;
        vmmb_lease *l;
        int k;

        if (!inject)
                return;
        c = connect_or_fail(h.socket);
        ranges_since(since, &reserved, &freed);

        /* 66 MiB is a 64 and a 2 MiB slab; 3 MiB is leased as 4: one range each, mapped and freed once */
        for (uint64_t size = 66 * MiB; size != 0; size = size == 66 * MiB ? 3 * MiB : 0) {
                l = alloc_or_fail(c, size, 0, NULL);
                ranges_since(since, &reserved, &freed);
                ck_assert_uint_eq(reserved, 1);
                ck_assert_uint_eq(freed, 0);
                ck_assert(lease_reads(l, 0));
                fill(l, 0xA4EAD);
                ck_assert(lease_reads(l, 0xA4EAD));
                ck_assert_int_eq(vmmb_free(l), 0);
                ranges_since(since, &reserved, &freed);
                ck_assert_uint_eq(reserved, 0);
                ck_assert_uint_eq(freed, 1);
        }

        /* The reservation ahead fails: the lease reserves a range of its own. */
        ck_assert_int_eq(inject("cuMemAddressReserve:1:CUDA_ERROR_OUT_OF_MEMORY"), 0);
        l = alloc_or_fail(c, 4 * MiB, 0, NULL);
        ranges_since(since, &reserved, &freed);
        ck_assert_uint_eq(reserved, 2);
        ck_assert(lease_reads(l, 0));
        ck_assert_int_eq(vmmb_free(l), 0);
        ranges_since(since, &reserved, &freed);
        ck_assert_uint_eq(freed, 1);

        /* Mapping into it fails: the Alloc fails and frees the range; the next one works. */
        ck_assert_int_eq(inject("cuMemMap:1"), 0);
        l = NULL;
        k = vmmb_alloc(c, 4 * MiB, 0, NULL, &l);
        ck_assert_int_eq(k, -EIO);
        ck_assert_ptr_null(l);
        ranges_since(since, &reserved, &freed);
        ck_assert_uint_eq(reserved, 1);
        ck_assert_uint_eq(freed, 1);
        ck_assert_uint_eq(daemon_leases(h.socket), 0);

        /* The broker refuses, again and again (4 GiB held; 4 more is over the user's limit): nothing is left
         * reserved. */
        l = alloc_or_fail(c, UINT64_C(4) << 30, 0, NULL);
        ranges_since(since, &reserved, &freed);
        for (unsigned i = 0; i < 100; i++) {
                vmmb_lease *more = NULL;

                k = vmmb_alloc(c, UINT64_C(4) << 30, 0, NULL, &more);
                ck_assert_msg(k == -EDQUOT, "vmmb_alloc: %s: %s", strerror(-k), vmmb_error_message());
        }
        ranges_since(since, &reserved, &freed);
        ck_assert_uint_eq(reserved, 100);
        ck_assert_uint_eq(freed, 100);
        ck_assert_int_eq(vmmb_free(l), 0);
        ranges_since(since, &reserved, &freed);

        /*
         * A kept lease comes back mapped: nothing reserved for it. The keep leaves the lease mapped in the range
         * its Alloc reserved ahead (none freed), and the Alloc that is handed it back reserves none; that one
         * range goes with the lease when it is freed at last.
         */
        l = alloc_or_fail(c, 4 * MiB, 0, NULL);
        snprintf(id, sizeof(id), "%s", vmmb_lease_id(l));
        ptr = vmmb_lease_ptr(l);
        ck_assert_int_eq(vmmb_free_keep(l), 0);
        ranges_since(since, &reserved, &freed);
        ck_assert_uint_eq(reserved, 1);
        ck_assert_uint_eq(freed, 0);
        l = alloc_or_fail(c, 4 * MiB, 0, NULL);
        ck_assert_str_eq(vmmb_lease_id(l), id);
        ck_assert_uint_eq(vmmb_lease_ptr(l), ptr);
        ranges_since(since, &reserved, &freed);
        ck_assert_uint_eq(reserved, 0);
        ck_assert_uint_eq(freed, 0);
        ck_assert(lease_reads(l, 0));
        free_last_and_close(c, l);
        ranges_since(since, &reserved, &freed);
        ck_assert_uint_eq(reserved, 0);
        ck_assert_uint_eq(freed, 1);
}
END_TEST

/* The value of environment variable `name` (malloc'd), or NULL when it is unset; for env_restore(). */
static char *env_save(const char *name) {
        const char *v = getenv(name);
        char *copy = v ? strdup(v) : NULL;

        ck_assert(!v || copy);
        return copy;
}

/* Sets `name` back to `saved` (NULL: unsets it) and frees `saved`. */
static void env_restore(const char *name, char *saved) {
        if (saved)
                ck_assert_int_eq(setenv(name, saved, 1), 0);
        else
                ck_assert_int_eq(unsetenv(name), 0);
        free(saved);
}

/* Sets environment variable `name` to `value` and connects; returns vmmb_connect()'s result. */
static int connect_with_env(const char *name, const char *value, vmmb_client **ret) {
        ck_assert_int_eq(setenv(name, value, 1), 0);
        *ret = NULL;
        return vmmb_connect(h.socket, ret);
}

/* vmmb_connect() refuses each of `values` (NULL-terminated) in environment variable `name`, naming it. */
static void connect_refuses_env(const char *name, const char *const *values) {
        for (const char *const *v = values; *v; v++) {
                vmmb_client *c;

                ck_assert_int_eq(connect_with_env(name, *v, &c), -EINVAL);
                ck_assert_ptr_null(c);
                ck_assert_msg(strstr(vmmb_error_message(), name), "%s=%s: %s", name, *v, vmmb_error_message());
        }
}

/* $VMMBROKER_RECONNECT_TIMEOUT: seconds, with a fraction; vmmb_connect() refuses anything else, naming it. */
START_TEST(test_reconnect_timeout_values) {
        char *saved = env_save("VMMBROKER_RECONNECT_TIMEOUT");

        connect_refuses_env("VMMBROKER_RECONNECT_TIMEOUT",
                            (const char *const[]){ "abc", "-1", ".5", "1.", "1e3", "5s", " 5", "0x10", "1000000001",
                                                   "99999999999999999999", NULL });
        for (const char *const *good = (const char *const[]){ "", "0", "0.5", "30", "1000000000", "2.0000009", NULL };
             *good; good++) {
                vmmb_client *c;

                ck_assert_int_eq(connect_with_env("VMMBROKER_RECONNECT_TIMEOUT", *good, &c), 0);
                vmmb_close(c);
        }
        env_restore("VMMBROKER_RECONNECT_TIMEOUT", saved);
}
END_TEST

static uint64_t monotonic_usec(void) {
        struct timespec ts;

        ck_assert_int_eq(clock_gettime(CLOCK_MONOTONIC, &ts), 0);
        return (uint64_t)ts.tv_sec * 1000000 + (uint64_t)ts.tv_nsec / 1000;
}

/*
 * A call made in a thread of its own, to watch while the daemon is stopped (test_free_unmaps_while_answered(),
 * test_reply_spin()): what it calls, and what the test sees of it: its thread, when it began, whether it has
 * returned and what.
 */
typedef struct ThreadCall {
        int (*fn)(void *arg);
        void *arg;
        pthread_t thread;
        _Atomic pid_t tid;              /* 0 until the thread runs */
        _Atomic uint64_t started_usec;  /* CLOCK_MONOTONIC, set before the call */
        _Atomic bool done;
        int result;                     /* once `done`, or joined */
} ThreadCall;

static void *thread_call_run(void *arg) {
        ThreadCall *a = arg;

        a->started_usec = monotonic_usec();
        a->tid = gettid();
        a->result = a->fn(a->arg);
        a->done = true;
        return NULL;
}

/* Starts fn(arg) in a thread of its own, watched through `a`. */
static void thread_call_start(ThreadCall *a, int (*fn)(void *arg), void *arg) {
        *a = (ThreadCall){ .fn = fn, .arg = arg };
        ck_assert_int_eq(pthread_create(&a->thread, NULL, thread_call_run, a), 0);
}

/* Waits for the call's thread to end; returns what the call returned. */
static int thread_call_join(ThreadCall *a) {
        ck_assert_int_eq(pthread_join(a->thread, NULL), 0);
        return a->result;
}

static int free_lease(void *lease) {
        return vmmb_free(lease);
}

static int unpublish_no_such_name(void *client) {
        return vmmb_unpublish(client, "test-client-no-such-name");
}

/*
 * vmmb_free() sends the Free first and unmaps while the answer is on the way: with the daemon stopped, the
 * lease is unmapped (its range freed) before any answer can have come. When unmapping fails after the Free was
 * sent, the broker has ended the lease all the same and the error says so; a one-way Free unmaps first and
 * tells the broker nothing when unmapping fails. When the Free cannot be sent (test_daemon_killed()), the lease
 * is unmapped all the same.
 */
START_TEST(test_free_unmaps_while_answered) {
        __typeof__(&simcuda_fail) inject = sim_inject(__func__);
        ThreadCall a;
        uint64_t unmaps, freed;
        vmmb_client *c;
        vmmb_lease *l;
        int k;

        if (!inject)
                return;
        c = connect_or_fail(h.socket);

        /* 66 MiB: two slabs, two unmaps, then the range freed, all while the daemon cannot answer */
        l = alloc_or_fail(c, 66 * MiB, 0, NULL);
        fill(l, 0xF4EE);
        unmaps = driver_calls("cuMemUnmap");
        freed = driver_calls("cuMemAddressFree");
        ck_assert_int_eq(harness_freeze(&h), 0);
        thread_call_start(&a, free_lease, l);
        while (driver_calls("cuMemAddressFree") == freed)
                ;                       /* the Free sent, the lease being unmapped: Check's timeout bounds it */
        ck_assert_uint_eq(driver_calls("cuMemUnmap"), unmaps + 2);
        ck_assert(!a.done);             /* and still waiting for the answer */
        ck_assert_int_eq(harness_thaw(&h), 0);
        k = thread_call_join(&a);
        ck_assert_msg(k == 0, "vmmb_free: %s: %s", strerror(-k), vmmb_error_message());
        ck_assert_uint_eq(daemon_leases(h.socket), 0);

        /* Unmapping fails after the Free was sent: the broker has ended the lease, and the error says so. */
        l = alloc_or_fail(c, 2 * MiB, 0, NULL);
        ck_assert_int_eq(inject("cuMemUnmap:1"), 0);
        k = vmmb_free(l);
        ck_assert_int_eq(k, -EIO);
        ck_assert_msg(strstr(vmmb_error_message(), "The broker has ended it"), "%s", vmmb_error_message());
        ck_assert_uint_eq(daemon_leases(h.socket), 0);

        /* A one-way Free unmaps first: when that fails, the broker is not told and keeps the lease. */
        l = alloc_or_fail(c, 2 * MiB, 0, NULL);
        ck_assert_int_eq(inject("cuMemUnmap:1"), 0);
        ck_assert_int_eq(vmmb_free_oneway(l), -EIO);
        ck_assert_msg(strstr(vmmb_error_message(), "Cannot unmap lease"), "%s", vmmb_error_message());
        ck_assert_uint_eq(daemon_leases(h.socket), 1);
        vmmb_close(c);
}
END_TEST

/* The state letter of this process's thread `tid` (/proc/self/task/TID/stat), or 0. */
static char thread_state(pid_t tid) {
        char path[64], buf[512], *p;
        _cleanup_close_ int fd = -EBADF;
        ssize_t n;

        (void)snprintf(path, sizeof(path), "/proc/self/task/%d/stat", (int)tid);
        fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
                return 0;
        n = read(fd, buf, sizeof(buf) - 1);
        if (n <= 0)
                return 0;
        buf[n] = 0;
        p = strrchr(buf, ')');          /* the name may hold anything; the state follows its ')' */
        return p && p[1] == ' ' ? p[2] : 0;
}

/*
 * $VMMBROKER_REPLY_SPIN_USEC: a call polls for its reply that long, then sleeps for it. Bad values are
 * refused by vmmb_connect(), naming the variable; a reply that comes after the polling ended is still read,
 * as is one that comes while polling.
 */
START_TEST(test_reply_spin) {
        char *saved = env_save("VMMBROKER_REPLY_SPIN_USEC");
        ThreadCall a;
        vmmb_client *c;
        vmmb_lease *l;

        connect_refuses_env("VMMBROKER_REPLY_SPIN_USEC",
                            (const char *const[]){ "abc", "-1", "1.5", "100001", "99999999999999999999", " 10", NULL });
        for (const char *const *good = (const char *const[]){ "", "0", "100000", NULL }; *good; good++) {
                ck_assert_int_eq(connect_with_env("VMMBROKER_REPLY_SPIN_USEC", *good, &c), 0);
                l = alloc_or_fail(c, 2 * MiB, 0, NULL);
                ck_assert(lease_reads(l, 0));
                ck_assert_int_eq(vmmb_free(l), 0);
                vmmb_close(c);
        }

        /*
         * Polling for 100 ms while the daemon is stopped: the call does not sleep until 100 ms after it began
         * to poll (the polling's deadline is on the clock, so however busy the machine; a call that does not
         * poll sleeps in recv() at once), then sleeps, and is answered once the daemon goes on.
         */
        ck_assert_int_eq(connect_with_env("VMMBROKER_REPLY_SPIN_USEC", "100000", &c), 0);
        ck_assert_int_eq(vmmb_unpublish(c, "test-client-no-such-name"), -ENOENT);   /* connected, answered */
        ck_assert_int_eq(harness_freeze(&h), 0);
        thread_call_start(&a, unpublish_no_such_name, c);
        while (a.tid == 0 || thread_state(a.tid) != 'S')
                ;                       /* polling, then asleep in recv(): Check's timeout bounds the wait */
        ck_assert_uint_ge(monotonic_usec() - a.started_usec, 100000);
        ck_assert_int_eq(harness_thaw(&h), 0);
        ck_assert_int_eq(thread_call_join(&a), -ENOENT);
        vmmb_close(c);
        env_restore("VMMBROKER_REPLY_SPIN_USEC", saved);
}
END_TEST

/* The tokens of `l` must be exactly want[0..n): each once, in any order, with its uid, creator and mode. */
static void check_tokens(vmmb_lease *l, const vmmb_token *want, size_t n) {
        vmmb_token *got = NULL;
        size_t n_got = 0;
        int k;

        k = vmmb_tokens(l, &got, &n_got);
        ck_assert_msg(k == 0, "vmmb_tokens: %s: %s", strerror(-k), vmmb_error_message());
        ck_assert_uint_eq(n_got, n);
        ck_assert(n > 0 ? got != NULL : got == NULL);
        for (size_t i = 0; i < n; i++) {
                const vmmb_token *t = NULL;

                for (size_t j = 0; j < n_got; j++)
                        if (strcmp(got[j].token, want[i].token) == 0)
                                t = &got[j];
                ck_assert_msg(t, "token %s is not listed", want[i].token);
                ck_assert_uint_eq(t->uid, want[i].uid);
                ck_assert_uint_eq(t->creator, want[i].creator);
                ck_assert_int_eq(t->readonly, want[i].readonly);
        }
        vmmb_tokens_free(got, n_got);
}

START_TEST(test_tokens) {
        vmmb_client *c = connect_or_fail(h.socket);
        vmmb_lease *l = alloc_or_fail(c, 2 * MiB, 0, "tokens"), *l2;
        vmmb_token want[3] = {}, *none = NULL;
        size_t n = 99;

        /* None yet: an empty list, no array. */
        check_tokens(l, want, 0);

        want[0] = (vmmb_token){ .uid = VMMB_ANY_UID, .creator = getuid(), .readonly = 0 };
        share_or_fail(l, VMMB_ANY_UID, 0, want[0].token);
        want[1] = (vmmb_token){ .uid = NOBODY, .creator = getuid(), .readonly = 1 };
        share_or_fail(l, NOBODY, VMMB_READONLY, want[1].token);
        want[2] = (vmmb_token){ .uid = getuid(), .creator = getuid(), .readonly = 0 };
        share_or_fail(l, getuid(), 0, want[2].token);
        check_tokens(l, want, 3);

        /* Another hold of the owner's user, here a second one of this process, sees them too. */
        l2 = attach_or_fail(c, want[2].token, NULL, 0);
        ck_assert_uint_eq(vmmb_lease_owner(l2), getuid());
        check_tokens(l2, want, 3);

        /* Revoked, a token is no longer listed. */
        ck_assert_int_eq(vmmb_revoke(c, want[1].token), 0);
        want[1] = want[2];
        check_tokens(l, want, 2);

        /* Arguments. */
        ck_assert_int_eq(vmmb_tokens(NULL, &none, &n), -EINVAL);
        ck_assert_int_eq(vmmb_tokens(l, NULL, &n), -EINVAL);
        ck_assert_int_eq(vmmb_tokens(l, &none, NULL), -EINVAL);
        ck_assert_str_ne(vmmb_error_message(), "");
        ck_assert_ptr_null(none);
        vmmb_tokens_free(NULL, 0);

        ck_assert_int_eq(vmmb_free(l2), 0);
        free_last_and_close(c, l);
}
END_TEST

/* --- parking ---------------------------------------------------------------------------------------------- */

/* The word at index i of pattern `seed`: every word differs, so a slab mapped at the wrong offset shows. */
static uint32_t pattern_word(uint32_t seed, size_t i) {
        return seed ^ (uint32_t)(i * 2654435761u);
}

/* Writes pattern `seed` over the lease with one cuMemcpyHtoD; for children too. */
static bool write_pattern(uint64_t ptr, uint64_t size, uint32_t seed) {
        size_t n = size / sizeof(uint32_t);
        _cleanup_free_ uint32_t *buf = malloc(n * sizeof(uint32_t));

        if (!buf)
                return false;
        for (size_t i = 0; i < n; i++)
                buf[i] = pattern_word(seed, i);
        return cu->cuMemcpyHtoD(ptr, buf, n * sizeof(uint32_t)) == CUDA_SUCCESS &&
               cu->cuCtxSynchronize() == CUDA_SUCCESS;
}

/* Whether the `size` bytes at `ptr` read pattern `seed`; for children too. */
static bool reads_pattern(uint64_t ptr, uint64_t size, uint32_t seed) {
        size_t n = size / sizeof(uint32_t);
        _cleanup_free_ uint32_t *buf = malloc(n * sizeof(uint32_t));

        if (!buf || cu->cuMemcpyDtoH(buf, ptr, n * sizeof(uint32_t)) != CUDA_SUCCESS)
                return false;
        for (size_t i = 0; i < n; i++)
                if (buf[i] != pattern_word(seed, i))
                        return false;
        return true;
}

static int park_or_fail(vmmb_lease *l, void *stream) {
        int k = vmmb_lease_park(l, stream);

        ck_assert_msg(k >= 0, "vmmb_lease_park: %s: %s", strerror(-k), vmmb_error_message());
        ck_assert_int_eq(vmmb_lease_parked(l), 1);
        return k;
}

static void unpark_or_fail(vmmb_lease *l) {
        int k = vmmb_lease_unpark(l);

        ck_assert_msg(k == 0, "vmmb_lease_unpark: %s: %s", strerror(-k), vmmb_error_message());
        ck_assert_int_eq(vmmb_lease_parked(l), 0);
}

START_TEST(test_park_unpark) {
        vmmb_client *c = connect_or_fail(h.socket);
        vmmb_lease *l = alloc_or_fail(c, 66 * MiB, 0, "parked");        /* two slabs: 64 MiB and 2 MiB */
        uint64_t ptr = vmmb_lease_ptr(l);
        WireDevice d;
        int fds_before = harness_fd_count(getpid());
        CUstream stream = NULL;

        ck_assert(write_pattern(ptr, 66 * MiB, 0x5EED0001));
        ck_assert_int_eq(vmmb_lease_parked(l), 0);

        /* The only holder: the content goes to host memory, and the device memory back to the pool. */
        ck_assert_int_eq(park_or_fail(l, NULL), 1);
        ck_assert_uint_eq(vmmb_lease_ptr(l), ptr);
        ck_assert_uint_eq(vmmb_lease_size(l), 66 * MiB);
        d = daemon_device(h.socket);
        ck_assert_uint_eq(d.leased, 0);
        ck_assert_uint_eq(d.leases, 1);
        ck_assert_int_eq(vmmb_lease_park(l, NULL), -EALREADY);
        ck_assert_str_ne(vmmb_error_message(), "");

        /* Back at the same address, with the same content, and writable. */
        unpark_or_fail(l);
        ck_assert_uint_eq(vmmb_lease_ptr(l), ptr);
        ck_assert(reads_pattern(ptr, 66 * MiB, 0x5EED0001));
        d = daemon_device(h.socket);
        ck_assert_uint_eq(d.leased, 66 * MiB);
        ck_assert_int_eq(vmmb_lease_unpark(l), -EALREADY);
        ck_assert(reads_pattern(ptr, 66 * MiB, 0x5EED0001));

        /* Again, waiting for a stream this time, with work queued on it. */
        ck_assert_int_eq(cu->cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
        ck_assert_int_eq(cu->cuMemsetD32Async(ptr, 0x77777777, 1, stream), CUDA_SUCCESS);
        ck_assert_int_eq(park_or_fail(l, stream), 1);
        unpark_or_fail(l);
        ck_assert_uint_eq(vmmb_lease_ptr(l), ptr);
        {
                uint32_t first = 0;

                /* the memset ran before the unmap and was carried through host memory */
                ck_assert_int_eq(cu->cuMemcpyDtoH(&first, ptr, sizeof(first)), CUDA_SUCCESS);
                ck_assert_uint_eq(first, 0x77777777);
        }
        ck_assert(write_pattern(ptr, 66 * MiB, 0x5EED0002));
        ck_assert_int_eq(cu->cuStreamDestroy(stream), CUDA_SUCCESS);

        /* Arguments. */
        ck_assert_int_eq(vmmb_lease_park(NULL, NULL), -EINVAL);
        ck_assert_int_eq(vmmb_lease_unpark(NULL), -EINVAL);
        ck_assert_int_eq(vmmb_lease_parked(NULL), 0);

        ck_assert_int_eq(harness_fd_count(getpid()), fds_before);
        free_last_and_close(c, l);
}
END_TEST

/*
 * A park waits for the work of the context (stream NULL): in a thread with no context of its own, the device's
 * primary context. When that is not active either, nothing can be queued, and the library does not retain it:
 * a retain would create the context (about 0.2 s on an H200, and 1 s while another process pins host memory)
 * and the release destroy it again. When it is active, the park retains it and waits for its work. The calls are
 * counted on the simulated device; on both, the primary context must be as inactive after the first park as
 * before it (a retain the library kept would leave it active).
 */
START_TEST(test_park_without_context) {
        vmmb_client *c = connect_or_fail(h.socket);
        vmmb_lease *l = alloc_or_fail(c, 4 * MiB, 0, "no context");
        uint64_t retains, syncs;
        unsigned flags;
        int active = -1;

        ck_assert(write_pattern(vmmb_lease_ptr(l), 4 * MiB, 0x5EED0003));
        ck_assert_int_eq(cu->cuCtxSynchronize(), CUDA_SUCCESS);
        ck_assert_int_eq(cu->cuCtxSetCurrent(NULL), CUDA_SUCCESS);
        ck_assert_int_eq(cu->cuDevicePrimaryCtxRelease(0), CUDA_SUCCESS);      /* driver_open_or_fail()'s */
        ck_assert_int_eq(cu->cuDevicePrimaryCtxGetState(0, &flags, &active), CUDA_SUCCESS);
        ck_assert_msg(active == 0, "the primary context is still active with the test's retain released");

        retains = driver_calls("cuDevicePrimaryCtxRetain");
        syncs = driver_calls("cuCtxSynchronize");
        ck_assert_int_eq(park_or_fail(l, NULL), 1);
        ck_assert_uint_eq(driver_calls("cuDevicePrimaryCtxRetain"), retains);
        ck_assert_uint_eq(driver_calls("cuCtxSynchronize"), syncs);
        ck_assert_int_eq(cu->cuDevicePrimaryCtxGetState(0, &flags, &active), CUDA_SUCCESS);
        ck_assert_msg(active == 0, "a park from a thread with no context left the primary context active");
        unpark_or_fail(l);

        /* Active, not current: retained for the wait, and waited in. */
        ck_assert_int_eq(cu->cuDevicePrimaryCtxRetain(&ctx, 0), CUDA_SUCCESS);
        retains = driver_calls("cuDevicePrimaryCtxRetain");
        syncs = driver_calls("cuCtxSynchronize");
        ck_assert_int_eq(park_or_fail(l, NULL), 1);
        if (driver_counts()) {
                ck_assert_uint_eq(driver_calls("cuDevicePrimaryCtxRetain"), retains + 1);
                ck_assert_uint_eq(driver_calls("cuCtxSynchronize"), syncs + 1);
        }
        unpark_or_fail(l);
        ck_assert_int_eq(cu->cuCtxSetCurrent(ctx), CUDA_SUCCESS);
        ck_assert(reads_pattern(vmmb_lease_ptr(l), 4 * MiB, 0x5EED0003));
        free_last_and_close(c, l);
}
END_TEST

START_TEST(test_free_parked) {
        vmmb_client *c = connect_or_fail(h.socket);
        vmmb_lease *l = alloc_or_fail(c, 4 * MiB, 0, NULL), *l2 = alloc_or_fail(c, 4 * MiB, 0, NULL);
        WireDevice d;

        fill(l, 0x1);
        ck_assert_int_eq(park_or_fail(l, NULL), 1);
        ck_assert_int_eq(park_or_fail(l2, NULL), 1);
        /* Freed while parked: only the reservation was left here; the hold ends with the broker. */
        ck_assert_int_eq(vmmb_free(l), 0);
        d = daemon_device(h.socket);
        ck_assert_uint_eq(d.leases, 1);
        ck_assert_uint_eq(d.leased, 0);
        /* and a parked lease left to vmmb_close() is freed the same way */
        vmmb_close(c);
        ck_assert_uint_eq(daemon_leases(h.socket), 0);
}
END_TEST

typedef struct ParkArgs {
        const char *socket;
        const char *token;
        uint64_t size;
        uint32_t expect;                /* the pattern the child reads first */
        uint32_t write;                 /* the pattern it writes once the parent has parked */
        int to_child, from_child;       /* pipes: the parent says "parked", the child "attached" */
} ParkArgs;

/* A second holder: attaches, waits for the parent to park, writes, parks (the content moves), frees. */
static int child_park(void *arg) {
        const ParkArgs *a = arg;
        vmmb_client *c = NULL;
        vmmb_lease *l = NULL;
        char byte = 'a';
        int k;

        if (child_open(a->socket, false, &c) != 0)
                return 1;
        k = vmmb_attach(c, a->token, 0, &l);
        CHILD_CHECK(k == 0, "attach: %s", strerror(-k));
        CHILD_CHECK(reads_pattern(vmmb_lease_ptr(l), a->size, a->expect), "does not read the parent's pattern");
        CHILD_CHECK(write(a->from_child, &byte, 1) == 1, "write: %m");
        CHILD_CHECK(read(a->to_child, &byte, 1) == 1, "read: %m");

        /* The parent parked its hold; this one still maps the device memory and uses it. */
        CHILD_CHECK(reads_pattern(vmmb_lease_ptr(l), a->size, a->expect), "changed under the parent's park");
        CHILD_CHECK(write_pattern(vmmb_lease_ptr(l), a->size, a->write), "write_pattern");
        k = vmmb_lease_park(l, NULL);
        CHILD_CHECK(k == 1, "the last holder's park returned %d, want 1 (in host memory)", k);
        /* freed while parked, the parent's hold is left, parked in host memory */
        CHILD_CHECK(vmmb_free(l) == 0, "free of a parked hold");
        vmmb_close(c);
        return 0;
}

START_TEST(test_park_shared) {
        vmmb_client *c = connect_or_fail(h.socket);
        vmmb_lease *l = alloc_or_fail(c, 66 * MiB, 0, "shared-parked");
        uint64_t ptr = vmmb_lease_ptr(l);
        WireDevice d;
        int to_child[2], from_child[2];
        char token[VMMB_TOKEN_SIZE], byte = 'p';
        ParkArgs a;
        pid_t pid;

        if (skip_fork_on_real_driver(__func__))
                return;
        ck_assert(write_pattern(ptr, 66 * MiB, 0xAB0000));
        share_or_fail(l, VMMB_ANY_UID, 0, token);
        ck_assert_int_eq(pipe(to_child), 0);
        ck_assert_int_eq(pipe(from_child), 0);
        a = (ParkArgs){ .socket = h.socket, .token = token, .size = 66 * MiB, .expect = 0xAB0000,
                        .write = 0xCD0000, .to_child = to_child[0], .from_child = from_child[1] };
        pid = harness_fork(child_park, &a);
        ck_assert_int_gt(pid, 0);
        ck_assert_int_eq(read(from_child[0], &byte, 1), 1);

        /* Another process maps it: this hold is parked, the content stays on the device for it. */
        ck_assert_int_eq(park_or_fail(l, NULL), 0);
        d = daemon_device(h.socket);
        ck_assert_uint_eq(d.leased, 66 * MiB);
        ck_assert_int_eq(write(to_child[1], &byte, 1), 1);
        ck_assert_msg(harness_wait(pid) == 0, "the child failed (see its stderr)");
        /* It parked too, then freed: the content is in host memory, the device memory in the pool. */
        d = daemon_device(h.socket);
        ck_assert_uint_eq(d.leased, 0);
        ck_assert_uint_eq(d.leases, 1);

        unpark_or_fail(l);
        ck_assert_uint_eq(vmmb_lease_ptr(l), ptr);
        ck_assert(reads_pattern(ptr, 66 * MiB, 0xCD0000));         /* what the child wrote, moved and back */
        for (size_t i = 0; i < 2; i++) {
                safe_close(to_child[i]);
                safe_close(from_child[i]);
        }
        free_last_and_close(c, l);
}
END_TEST

/*
 * As uid 65534 holding root's lease through a token: Park is refused (PermissionDenied: not the owner's user),
 * and the library maps the lease again through Unpark, which any holder may call: it ends mapped, as it was,
 * with the content it had.
 */
static int child_park_nobody(void *arg) {
        const ParkArgs *a = arg;
        vmmb_client *c = NULL;
        vmmb_lease *l = NULL;
        uint64_t ptr;
        int k;

        if (child_open(a->socket, true, &c) != 0)
                return 1;
        k = vmmb_attach(c, a->token, 0, &l);
        CHILD_CHECK(k == 0, "attach: %s", strerror(-k));
        ptr = vmmb_lease_ptr(l);
        k = vmmb_lease_park(l, NULL);
        CHILD_CHECK(k == -EACCES, "park of root's lease by nobody: %d", k);
        CHILD_CHECK(strstr(vmmb_error_message(), "mapped again"), "message: %s", vmmb_error_message());
        CHILD_CHECK(vmmb_lease_parked(l) == 0 && vmmb_lease_ptr(l) == ptr, "not mapped again where it was");
        CHILD_CHECK(reads_pattern(ptr, a->size, a->expect), "does not read root's pattern after the refusal");
        CHILD_CHECK(write_pattern(ptr, a->size, a->write), "cannot write it after the refusal");
        CHILD_CHECK(vmmb_lease_unpark(l) == -EALREADY, "unpark of a lease not parked");
        CHILD_CHECK(vmmb_free(l) == 0, "free");
        vmmb_close(c);
        return 0;
}

START_TEST(test_park_other_user) {
        char token[VMMB_TOKEN_SIZE];
        vmmb_client *c;
        vmmb_lease *l;
        ParkArgs a;

        if (!other_user_runs(__func__))
                return;
        c = connect_or_fail(h.socket);
        l = alloc_or_fail(c, 4 * MiB, 0, NULL);
        ck_assert(write_pattern(vmmb_lease_ptr(l), 4 * MiB, 0xEE0000));
        share_or_fail(l, VMMB_ANY_UID, 0, token);
        ck_assert_int_eq(chmod(h.dir, 0711), 0);
        ck_assert_int_eq(chmod(h.socket, 0666), 0);
        a = (ParkArgs){ .socket = h.socket, .token = token, .size = 4 * MiB, .expect = 0xEE0000, .write = 0xFF0000 };
        run_child(child_park_nobody, &a);
        /* root's hold still maps what nobody wrote */
        ck_assert(reads_pattern(vmmb_lease_ptr(l), 4 * MiB, 0xFF0000));
        ck_assert_int_eq(park_or_fail(l, NULL), 1);
        unpark_or_fail(l);
        ck_assert(reads_pattern(vmmb_lease_ptr(l), 4 * MiB, 0xFF0000));
        ck_assert_int_eq(vmmb_free(l), 0);
        vmmb_close(c);
}
END_TEST

/* vmmb_lease_read() on a thread with no current context: the library uses the device's primary context. */
static void *read_without_context(void *arg) {
        vmmb_lease *l = arg;
        uint32_t word = 0;
        CUcontext current = NULL;

        if (vmmb_lease_read(l, 64 * MiB, &word, sizeof(word)) != 0 || word != pattern_word(0x2EAD0001, 16 * MiB))
                return "the read on a thread without a context failed or read the wrong word";
        if (cu->cuCtxGetCurrent(&current) != CUDA_SUCCESS || current)
                return "the read left a context current on the thread";
        return NULL;
}

START_TEST(test_lease_read) {
        vmmb_client *c = connect_or_fail(h.socket);
        vmmb_lease *l = alloc_or_fail(c, 66 * MiB, 0, "read");      /* two slabs: 64 MiB and 2 MiB */
        const size_t n = 66 * MiB / sizeof(uint32_t);
        _cleanup_free_ uint32_t *back = calloc(n, sizeof(uint32_t));
        char rw[VMMB_TOKEN_SIZE];
        uint32_t words[4], canary[4];
        const char *failure = NULL;
        size_t wrong = 0;
        pthread_t thread;
        vmmb_lease *ro;

        ck_assert_ptr_nonnull(back);
        /* fresh memory reads zero through it */
        memset(words, 0xAB, sizeof(words));
        ck_assert_int_eq(vmmb_lease_read(l, 0, words, sizeof(words)), 0);
        for (size_t i = 0; i < 4; i++)
                ck_assert_uint_eq(words[i], 0);

        /* all of it, and across the slabs' boundary, at the right offsets */
        ck_assert(write_pattern(vmmb_lease_ptr(l), 66 * MiB, 0x2EAD0001));
        ck_assert_int_eq(vmmb_lease_read(l, 0, back, n * sizeof(uint32_t)), 0);
        for (size_t i = 0; i < n; i++)
                wrong += back[i] != pattern_word(0x2EAD0001, i);        /* one check: each ck_assert costs */
        ck_assert_uint_eq(wrong, 0);
        ck_assert_int_eq(vmmb_lease_read(l, 64 * MiB - 8, words, sizeof(words)), 0);
        for (size_t i = 0; i < 4; i++)
                ck_assert_uint_eq(words[i], pattern_word(0x2EAD0001, 16 * MiB - 2 + i));

        /* a thread with no context of its own */
        ck_assert_int_eq(pthread_create(&thread, NULL, read_without_context, l), 0);
        ck_assert_int_eq(pthread_join(thread, (void **)&failure), 0);
        ck_assert_msg(!failure, "%s", failure);

        /* a read-only hold reads too */
        share_or_fail(l, VMMB_ANY_UID, 0, rw);
        ro = attach_or_fail(c, rw, NULL, VMMB_READONLY);
        ck_assert_int_eq(vmmb_lease_readonly(ro), 1);
        ck_assert_int_eq(vmmb_lease_read(ro, 66 * MiB - sizeof(words), words, sizeof(words)), 0);
        for (size_t i = 0; i < 4; i++)
                ck_assert_uint_eq(words[i], pattern_word(0x2EAD0001, n - 4 + i));
        ck_assert_int_eq(vmmb_free(ro), 0);

        /* Bounds, hostile ones included: refused with nothing written to the buffer. */
        memset(canary, 0x5A, sizeof(canary));
        memcpy(words, canary, sizeof(words));
        ck_assert_int_eq(vmmb_lease_read(l, 66 * MiB, words, 0), 0);
        ck_assert_int_eq(vmmb_lease_read(l, 66 * MiB, words, 1), -ERANGE);
        ck_assert_ptr_nonnull(strstr(vmmb_error_message(), vmmb_lease_id(l)));
        ck_assert_int_eq(vmmb_lease_read(l, 66 * MiB - 4, words, 8), -ERANGE);
        ck_assert_int_eq(vmmb_lease_read(l, 66 * MiB + 1, words, 0), -ERANGE);
        ck_assert_int_eq(vmmb_lease_read(l, UINT64_MAX, words, 1), -ERANGE);
        ck_assert_int_eq(vmmb_lease_read(l, 8, words, SIZE_MAX), -ERANGE);
        ck_assert_int_eq(vmmb_lease_read(l, 0, NULL, 4), -EINVAL);
        ck_assert_int_eq(vmmb_lease_read(NULL, 0, words, 4), -EINVAL);
        ck_assert_int_eq(memcmp(words, canary, sizeof(words)), 0);

        /* parked: nothing is mapped, and the read says so; unparked, it reads what was there */
        ck_assert_int_eq(park_or_fail(l, NULL), 1);
        ck_assert_int_eq(vmmb_lease_read(l, 0, words, sizeof(words)), -ENXIO);
        ck_assert_ptr_nonnull(strstr(vmmb_error_message(), "vmmb_lease_unpark()"));
        ck_assert_int_eq(memcmp(words, canary, sizeof(words)), 0);
        unpark_or_fail(l);
        ck_assert_int_eq(vmmb_lease_read(l, 64 * MiB - 8, words, sizeof(words)), 0);
        ck_assert_uint_eq(words[3], pattern_word(0x2EAD0001, 16 * MiB + 1));

        free_last_and_close(c, l);
}
END_TEST

/* Reads the lease's first words over and over while the main thread parks and unparks it. */
typedef struct ReadRace {
        vmmb_lease *lease;
        atomic_bool stop, ended;
        atomic_uint reads, parked;
        const char *failure;            /* the thread's, read once it is joined */
} ReadRace;

static void *read_while_parking(void *arg) {
        ReadRace *x = arg;

        if (cu->cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
                x->failure = "cuCtxSetCurrent failed";
                goto out;
        }
        while (!atomic_load(&x->stop)) {
                uint32_t words[4] = {};
                int k = vmmb_lease_read(x->lease, 0, words, sizeof(words));

                if (k == -ENXIO) {
                        atomic_fetch_add(&x->parked, 1);
                        (void)sched_yield();    /* the park or unpark under way has the CPU first */
                        continue;
                }
                if (k != 0) {
                        x->failure = "a read failed with something other than ENXIO";
                        goto out;
                }
                for (size_t i = 0; i < 4; i++)
                        if (words[i] != pattern_word(0x2EAD0002, i)) {
                                x->failure = "a read came back with other bytes";
                                goto out;
                        }
                atomic_fetch_add(&x->reads, 1);
        }
out:
        atomic_store(&x->ended, true);
        return NULL;
}

/* The reads made so far, of the content or answered ENXIO. */
static unsigned read_race_count(ReadRace *x) {
        return atomic_load(&x->reads) + atomic_load(&x->parked);
}

/* Yields until the reader has made a read since it had made `since`, or has ended (bounded: a failure guard). */
static void read_race_wait(ReadRace *x, unsigned since) {
        for (unsigned i = 0; i < 100000000 && read_race_count(x) == since && !atomic_load(&x->ended); i++)
                (void)sched_yield();
        ck_assert_msg(read_race_count(x) != since || atomic_load(&x->ended), "the reader made no read");
}

/*
 * A read never sees the lease half parked: it reads the content or says the lease is parked (ENXIO). The
 * reader makes at least one read between each park and unpark and the next, so that the reads and the
 * parking overlap in every cycle rather than only perhaps.
 */
START_TEST(test_lease_read_while_parking) {
        vmmb_client *c = connect_or_fail(h.socket);
        vmmb_lease *l = alloc_or_fail(c, 4 * MiB, 0, "read race");
        ReadRace x = { .lease = l };
        pthread_t thread;

        ck_assert(write_pattern(vmmb_lease_ptr(l), 4 * MiB, 0x2EAD0002));
        ck_assert_int_eq(pthread_create(&thread, NULL, read_while_parking, &x), 0);
        read_race_wait(&x, 0);
        for (unsigned i = 0; i < 50 && !atomic_load(&x.ended); i++) {
                unsigned before = read_race_count(&x);

                ck_assert_int_eq(park_or_fail(l, NULL), 1);
                unpark_or_fail(l);
                read_race_wait(&x, before);
        }
        atomic_store(&x.stop, true);
        ck_assert_int_eq(pthread_join(thread, NULL), 0);
        ck_assert_msg(!x.failure, "%s (after %u reads, %u parked)", x.failure, atomic_load(&x.reads),
                      atomic_load(&x.parked));
        ck_assert_uint_ge(read_race_count(&x), 51);
        ck_assert(reads_pattern(vmmb_lease_ptr(l), 4 * MiB, 0x2EAD0002));
        free_last_and_close(c, l);
}
END_TEST

/* The first word of a lease, read with vmmb_lease_read() (a ThreadCall): 0 when it is 0x5EAD5EAD. */
static int read_first_word(void *lease) {
        uint32_t word = 0;
        int k = vmmb_lease_read(lease, 0, &word, sizeof(word));

        return k < 0 ? k : word == 0x5EAD5EADU ? 0 : -EILSEQ;
}

static int close_client(void *client) {
        vmmb_close(client);
        return 0;
}

/* Yields until `a`'s thread runs and sleeps (bounded by Check's timeout). */
static void wait_sleeping(ThreadCall *a) {
        while (atomic_load(&a->tid) == 0 || thread_state(atomic_load(&a->tid)) != 'S')
                (void)sched_yield();
}

/*
 * A read waits for the work queued before it (cuMemcpyDtoH's order), and nothing else waits for the read but
 * what would unmap the lease under it: another thread frees another lease of the client meanwhile, while a
 * free of the lease being read waits for the copy. (The library held the client's lock across the copy: a
 * read behind a long kernel held up every other lease of the client, and the watch's answers for them.)
 * vmmb_close() waits for a read of a lease it frees too.
 */
START_TEST(test_lease_read_holds_up_no_other) {
        __typeof__(&simcuda_hold_streams) hold = (__typeof__(hold))driver_hook("simcuda_hold_streams");
        ThreadCall read, free_other, free_read;
        uint64_t copies, unmaps, deadline;
        vmmb_lease *l, *other;
        CUstream stream;
        vmmb_client *c;

        if (!hold || !driver_counts()) {
                fprintf(stderr, "%s: not run: it holds streams, which only the simulated device does\n", __func__);
                return;
        }
        c = connect_or_fail(h.socket);
        l = alloc_or_fail(c, 2 * MiB, 0, "read");
        other = alloc_or_fail(c, 2 * MiB, 0, "other");
        ck_assert_int_eq(cu->cuStreamCreate(&stream, 0), CUDA_SUCCESS);
        hold(1);
        ck_assert_int_eq(cu->cuMemsetD32Async(vmmb_lease_ptr(l), 0x5EAD5EADU, 2 * MiB / 4, stream), CUDA_SUCCESS);
        copies = driver_calls("cuMemcpyDtoH");
        thread_call_start(&read, read_first_word, l);
        while (driver_calls("cuMemcpyDtoH") == copies)
                (void)sched_yield();    /* the copy waits for the memset now */

        /* 20 s: an unhindered free takes milliseconds, even under the sanitizers */
        thread_call_start(&free_other, free_lease, other);
        deadline = monotonic_usec() + 20 * 1000000;
        while (!atomic_load(&free_other.done) && monotonic_usec() < deadline)
                (void)sched_yield();
        if (!atomic_load(&free_other.done)) {
                hold(0);
                (void)thread_call_join(&read);
                (void)thread_call_join(&free_other);
                ck_abort_msg("vmmb_free() of another lease waited for a vmmb_lease_read()");
        }
        ck_assert_int_eq(thread_call_join(&free_other), 0);

        unmaps = driver_calls("cuMemUnmap");
        thread_call_start(&free_read, free_lease, l);
        wait_sleeping(&free_read);
        ck_assert_msg(!atomic_load(&free_read.done) && driver_calls("cuMemUnmap") == unmaps,
                      "the lease was unmapped while a read copied from it");
        ck_assert(!atomic_load(&read.done));
        hold(0);
        ck_assert_int_eq(thread_call_join(&read), 0);           /* after the memset, as cuMemcpyDtoH orders it */
        ck_assert_int_eq(thread_call_join(&free_read), 0);
        ck_assert_uint_eq(daemon_leases(h.socket), 0);

        /* vmmb_close() waits for a read of a lease it frees as well */
        l = alloc_or_fail(c, 2 * MiB, 0, "read at close");
        hold(1);
        ck_assert_int_eq(cu->cuMemsetD32Async(vmmb_lease_ptr(l), 0x5EAD5EADU, 2 * MiB / 4, stream), CUDA_SUCCESS);
        copies = driver_calls("cuMemcpyDtoH");
        thread_call_start(&read, read_first_word, l);
        while (driver_calls("cuMemcpyDtoH") == copies)
                (void)sched_yield();
        unmaps = driver_calls("cuMemUnmap");
        thread_call_start(&free_read, close_client, c);
        wait_sleeping(&free_read);
        ck_assert_msg(!atomic_load(&free_read.done) && driver_calls("cuMemUnmap") == unmaps,
                      "vmmb_close() unmapped a lease while a read copied from it");
        hold(0);
        ck_assert_int_eq(thread_call_join(&read), 0);
        ck_assert_int_eq(thread_call_join(&free_read), 0);
        ck_assert_uint_eq(daemon_leases(h.socket), 0);
        ck_assert_int_eq(cu->cuStreamDestroy(stream), CUDA_SUCCESS);
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
        tcase_add_test(tc, test_share_attach);
        tcase_add_test(tc, test_attach_outlives_maker);
        tcase_add_test(tc, test_attach_readonly);
        tcase_add_test(tc, test_publish);
        tcase_add_test(tc, test_share_errors);
        tcase_add_test(tc, test_other_user);
        tcase_add_test(tc, test_tokens);
        tcase_add_test(tc, test_park_unpark);
        tcase_add_test(tc, test_park_without_context);
        tcase_add_test(tc, test_free_parked);
        tcase_add_test(tc, test_park_shared);
        tcase_add_test(tc, test_park_other_user);
        tcase_add_test(tc, test_lease_read);
        tcase_add_test(tc, test_lease_read_while_parking);
        tcase_add_test(tc, test_lease_read_holds_up_no_other);
        tcase_add_test(tc, test_free_oneway);
        tcase_add_test(tc, test_alloc_reserves_ahead);
        tcase_add_test(tc, test_reply_spin);
        tcase_add_test(tc, test_free_unmaps_while_answered);
        tcase_add_test(tc, test_reconnect_timeout_values);
        suite_add_tcase(s, tc);

        failed = run_suite(s);
        return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
