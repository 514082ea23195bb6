/* SPDX-License-Identifier: MIT */

#include <check.h>
#include <dlfcn.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clienttest.h"
#include "harness.h"
#include "macro.h"
#include "simcuda.h"

CudaDriver *cu;
CUcontext ctx;

void driver_open_or_fail(void) {
        _cleanup_free_ char *message = NULL;
        int k;

        k = cuda_driver_open(&cu, NULL, &message);
        ck_assert_msg(k == 0, "cuda_driver_open: %s", message);
        ck_assert_int_eq(cu->cuDevicePrimaryCtxRetain(&ctx, 0), CUDA_SUCCESS);
        ck_assert_int_eq(cu->cuCtxSetCurrent(ctx), CUDA_SUCCESS);
}

void driver_close(void) {
        if (!cu)
                return;
        (void)cu->cuCtxSetCurrent(NULL);
        (void)cu->cuDevicePrimaryCtxRelease(0);
        cu = cuda_driver_close(cu);
}

void *driver_hook(const char *name) {
        void *lib = dlopen(cu->path, RTLD_NOW | RTLD_NOLOAD), *hook;

        if (!lib)
                return NULL;
        hook = dlsym(lib, name);
        (void)dlclose(lib);             /* the driver stays loaded: `cu` holds it */
        return hook;
}

bool driver_counts(void) {
        return driver_hook("simcuda_calls") != NULL;
}

uint64_t driver_calls(const char *entry) {
        __typeof__(&simcuda_calls) calls = (__typeof__(calls))driver_hook("simcuda_calls");

        return calls ? calls(entry) : 0;
}

bool skip_fork_on_real_driver(const char *test) {
        const char *lib = getenv("VMMBROKER_LIBCUDA");

        if (lib && strstr(lib, "simcuda"))
                return false;
        fprintf(stderr, "%s: not run: it forks after loading the driver, which only the simulated device "
                "survives\n", test);
        return true;
}

void run_child(int (*fn)(void *arg), void *arg) {
        pid_t pid = harness_fork(fn, arg);

        ck_assert_int_gt(pid, 0);
        ck_assert_msg(harness_wait(pid) == 0, "the child failed (see its stderr)");
}

int drop_to_nobody(void) {
        CHILD_CHECK(setgroups(0, NULL) == 0 && setgid(NOBODY) == 0 && setuid(NOBODY) == 0,
                    "cannot drop privileges: %m");
        CHILD_CHECK(getuid() == NOBODY && geteuid() == NOBODY, "still uid %d", (int)geteuid());
        return 0;
}

int child_open(const char *socket, bool as_nobody, vmmb_client **ret) {
        int k;

        if (as_nobody && drop_to_nobody() != 0)
                return 1;
        CHILD_CHECK(cu->cuCtxSetCurrent(ctx) == CUDA_SUCCESS, "cuCtxSetCurrent");
        k = vmmb_connect(socket, ret);
        CHILD_CHECK(k == 0, "vmmb_connect: %s", strerror(-k));
        return 0;
}

vmmb_client *connect_or_fail(const char *socket) {
        vmmb_client *c = NULL;
        int k;

        k = vmmb_connect(socket, &c);
        ck_assert_msg(k == 0, "vmmb_connect: %s: %s", strerror(-k), vmmb_error_message());
        ck_assert_ptr_nonnull(c);
        return c;
}

vmmb_lease *alloc_or_fail(vmmb_client *c, uint64_t size, int device, const char *label) {
        vmmb_lease *l = NULL;
        int k;

        k = vmmb_alloc(c, size, device, label, &l);
        ck_assert_msg(k == 0, "vmmb_alloc(%llu): %s: %s", (unsigned long long)size, strerror(-k),
                      vmmb_error_message());
        ck_assert_ptr_nonnull(l);
        return l;
}

void fill(vmmb_lease *l, uint32_t value) {
        ck_assert_int_eq(cu->cuMemsetD32(vmmb_lease_ptr(l), value, vmmb_lease_size(l) / 4), CUDA_SUCCESS);
        ck_assert_int_eq(cu->cuCtxSynchronize(), CUDA_SUCCESS);
}

/* Whether buf[0..n) are all `value`. */
static bool all_words(const uint32_t *buf, size_t n, uint32_t value) {
        for (size_t i = 0; i < n; i++)
                if (buf[i] != value)
                        return false;
        return true;
}

bool lease_reads(vmmb_lease *l, uint32_t value) {
        size_t n = vmmb_lease_size(l) / sizeof(uint32_t);
        _cleanup_free_ uint32_t *buf = malloc(n * sizeof(uint32_t));

        ck_assert_ptr_nonnull(buf);
        ck_assert_int_eq(cu->cuMemcpyDtoH(buf, vmmb_lease_ptr(l), n * sizeof(uint32_t)), CUDA_SUCCESS);
        return all_words(buf, n, value);
}

bool words_are(uint64_t ptr, uint64_t size, uint32_t value) {
        size_t n = size / sizeof(uint32_t);
        _cleanup_free_ uint32_t *buf = malloc(n * sizeof(uint32_t));

        return buf && cu->cuMemcpyDtoH(buf, ptr, n * sizeof(uint32_t)) == CUDA_SUCCESS && all_words(buf, n, value);
}

WireDevice daemon_device(const char *socket) {
        WireDevice d;
        int k = harness_status(socket, &d);

        ck_assert_msg(k == 0, "Status failed: %s", strerror(-k));
        return d;
}

uint64_t daemon_leases(const char *socket) {
        return daemon_device(socket).leases;
}

Listed daemon_list(const char *socket, const char *id) {
        ListReply lr = {};
        const WireLeaseInfo *info;
        Listed ret;

        ck_assert_int_eq(list_get(socket, false, &lr), 0);
        ret = (Listed){ .n_leases = lr.n_leases };
        info = id ? list_find(&lr, id) : NULL;
        if (info) {
                ret.found = true;
                ret.kept = info->kept;
                ret.n_holders = info->n_holders;
                snprintf(ret.label, sizeof(ret.label), "%s", info->label ?: "");
        }
        list_reply_done(&lr);
        return ret;
}
