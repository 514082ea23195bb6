/* SPDX-License-Identifier: MIT */

/*
 * The driver layer's errors, one per cause a person can meet, against the
 * simulated device (its environment variables set the cause). Each test runs
 * in its own process, so each loads the simulator afresh.
 */

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "driver.h"
#include "macro.h"
#include "unit.h"

static CudaDriver *cu;
static char *message;

static void teardown(void) {
        cu = cuda_driver_close(cu);
        free(message);
        message = NULL;
}

#define assert_message(s) ck_assert_msg(message && strstr(message, s), "message '%s' lacks '%s'", message, s)

START_TEST(test_open) {
        CudaDeviceInfo info;

        ck_assert_int_eq(cuda_driver_open(&cu, NULL, &message), 0);
        ck_assert_int_ge(cu->version, CUDA_DRIVER_MIN_VERSION);
        ck_assert_int_eq(cuda_device_probe(cu, 0, &info, &message), 0);
        ck_assert(info.vmm && info.posix_fd);
        ck_assert_uint_eq(info.granularity, 2 << 20);
        ck_assert_uint_gt(info.total_memory, 0);
        ck_assert_str_eq(cuda_result_name(cu, CUDA_ERROR_OUT_OF_MEMORY), "CUDA_ERROR_OUT_OF_MEMORY");
        ck_assert_str_eq(cuda_result_name(NULL, 12345), "CUresult 12345");
}
END_TEST

START_TEST(test_missing_library) {
        ck_assert_int_eq(cuda_driver_open(&cu, "/nonexistent/libcuda.so.1", &message), -ENOENT);
        assert_message("No CUDA driver");
        assert_message("VMMBROKER_LIBCUDA");
        ck_assert_ptr_null(cu);
}
END_TEST

START_TEST(test_too_old) {
        setenv("SIMCUDA_DRIVER_VERSION", "11080", 1);
        ck_assert_int_eq(cuda_driver_open(&cu, NULL, &message), -EPROTONOSUPPORT);
        assert_message("too old");
        assert_message("11.8");
}
END_TEST

START_TEST(test_no_device) {
        setenv("SIMCUDA_DEVICES", "0", 1);
        ck_assert_int_eq(cuda_driver_open(&cu, NULL, &message), -ENODEV);
        assert_message("No CUDA device");
}
END_TEST

START_TEST(test_bad_index) {
        CudaDeviceInfo info;

        setenv("SIMCUDA_DEVICES", "2", 1);
        ck_assert_int_eq(cuda_driver_open(&cu, NULL, &message), 0);
        ck_assert_int_eq(cuda_device_probe(cu, 1, &info, &message), 0);
        ck_assert_int_eq(cuda_device_probe(cu, 2, &info, &message), -ENODEV);
        assert_message("2 devices");
}
END_TEST

START_TEST(test_no_vmm) {
        CudaDeviceInfo info;

        setenv("SIMCUDA_NO_VMM", "1", 1);
        ck_assert_int_eq(cuda_driver_open(&cu, NULL, &message), 0);
        ck_assert_int_eq(cuda_device_probe(cu, 0, &info, &message), -EOPNOTSUPP);
        assert_message("virtual memory management");
}
END_TEST

START_TEST(test_no_posix_fd) {
        CudaDeviceInfo info;

        setenv("SIMCUDA_NO_POSIX_FD", "1", 1);
        ck_assert_int_eq(cuda_driver_open(&cu, NULL, &message), 0);
        ck_assert_int_eq(cuda_device_probe(cu, 0, &info, &message), -EOPNOTSUPP);
        assert_message("POSIX file descriptor");
}
END_TEST

/* cuda_map_fds() leaves nothing mapped or reserved when an import fails halfway. */
START_TEST(test_map_fds_failure) {
        CUmemAllocationProp prop = cuda_slab_prop(0);
        CUmemGenericAllocationHandle h;
        uint64_t sizes[2] = { 2 << 20, 2 << 20 };
        int fds[2] = { -1, -1 };
        CUdeviceptr va;
        CUcontext ctx;

        ck_assert_int_eq(cuda_driver_open(&cu, NULL, &message), 0);
        ck_assert_int_eq(cu->cuDevicePrimaryCtxRetain(&ctx, 0), CUDA_SUCCESS);
        ck_assert_int_eq(cu->cuCtxSetCurrent(ctx), CUDA_SUCCESS);
        ck_assert_int_eq(cu->cuMemCreate(&h, sizes[0], &prop, 0), CUDA_SUCCESS);
        ck_assert_int_eq(cu->cuMemExportToShareableHandle(&fds[0], h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                         CUDA_SUCCESS);
        fds[1] = dup(STDIN_FILENO);     /* not device memory */
        ck_assert_int_lt(cuda_map_fds(cu, 0, fds, sizes, 2, false, &va, &message), 0);
        assert_message("import slab 1");

        /* Everything was undone: the one good slab maps again, alone, into a fresh range. */
        ck_assert_int_eq(cuda_map_fds(cu, 0, fds, sizes, 1, false, &va, &message), 0);
        ck_assert_int_eq(cu->cuMemsetD8(va, 0x11, sizes[0]), CUDA_SUCCESS);
        ck_assert_int_eq(cuda_unmap(cu, va, sizes, 1), 0);
        ck_assert_int_eq(cu->cuMemRelease(h), CUDA_SUCCESS);
        safe_close(fds[0]);
        safe_close(fds[1]);
}
END_TEST

/* A host slab: pinned, exportable as a POSIX fd like a device slab, on the NUMA node asked for (0 when unknown). */
START_TEST(test_host_prop) {
        CUmemAllocationProp slab = cuda_slab_prop(0), host = cuda_host_prop(3);

        ck_assert_int_eq(host.type, CU_MEM_ALLOCATION_TYPE_PINNED);
        ck_assert_int_eq(host.requestedHandleTypes, slab.requestedHandleTypes);
        ck_assert_int_eq(host.location.type, CU_MEM_LOCATION_TYPE_HOST_NUMA);
        ck_assert_int_eq(host.location.id, 3);
        host = cuda_host_prop(-1);
        ck_assert_int_eq(host.location.type, CU_MEM_LOCATION_TYPE_HOST_NUMA);
        ck_assert_int_eq(host.location.id, 0);
}
END_TEST

int main(void) {
        Suite *s = UNIT_SUITE("driver", teardown, test_open, test_missing_library, test_too_old, test_no_device,
                              test_bad_index, test_no_vmm, test_no_posix_fd, test_map_fds_failure,
                              test_host_prop);

        return run_suite(s) == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
