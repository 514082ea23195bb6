/* SPDX-License-Identifier: MIT */

/*
 * The simulated device's own rules, through the driver layer as the broker
 * loads it ($VMMBROKER_LIBCUDA): the entry-point lookup, the environment, the
 * memory budget, every rule's error code, sticky faults, fault injection,
 * stream ordering while held, host cuMemCreate held by a file, memory that
 * outlives its handle, and import of an exported fd. Every test runs in a
 * process of its own (Check forks before each), so each loads a fresh
 * simulator and may set SIMCUDA_* first; each ends with no allocation alive.
 */

#include <check.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "driver.h"
#include "macro.h"
#include "simcuda.h"

#define MiB (UINT64_C(1) << 20)
#define GRAN (2 * MiB)

static CudaDriver *cu;
static CUcontext ctx;

/* The simulator's exports, looked up as the project's tests do. */
static struct {
        PFN_cuGetProcAddress_v12000 get_proc;
        PFN_cuGetProcAddress_v11030 get_proc_old;
        __typeof__(&simcuda_hold_streams) hold_streams;
        __typeof__(&simcuda_hold_copies) hold_copies;
        __typeof__(&simcuda_live_allocations) live_allocations;
        __typeof__(&simcuda_charged) charged;
        __typeof__(&simcuda_host_charged) host_charged;
        __typeof__(&simcuda_fail) inject;       /* not "fail": check.h has a fail() macro */
        __typeof__(&simcuda_reset_faults) reset_faults;
        __typeof__(&simcuda_calls) calls;
} sim;

/* Checks that a call returns `want`, naming what it returned when it does not. */
#define expect(call, want)                                                                              \
        do {                                                                                            \
                CUresult _got_ = (call), _want_ = (want);                                               \
                ck_assert_msg(_got_ == _want_, "%s returned %d (%s), expected %d", #call, (int)_got_,   \
                              cuda_result_name(cu, _got_), (int)_want_);                                \
        } while (0)
#define expect_ok(call) expect(call, CUDA_SUCCESS)

static void *library(void) {
        const char *path = getenv(CUDA_DRIVER_LIBRARY_ENV);
        void *lib;

        ck_assert_ptr_nonnull(path);
        lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        ck_assert_msg(lib, "%s", dlerror());
        sim.get_proc = (PFN_cuGetProcAddress_v12000)dlsym(lib, "cuGetProcAddress_v2");
        sim.get_proc_old = (PFN_cuGetProcAddress_v11030)dlsym(lib, "cuGetProcAddress");
        sim.hold_streams = (__typeof__(sim.hold_streams))dlsym(lib, "simcuda_hold_streams");
        sim.hold_copies = (__typeof__(sim.hold_copies))dlsym(lib, "simcuda_hold_copies");
        sim.live_allocations = (__typeof__(sim.live_allocations))dlsym(lib, "simcuda_live_allocations");
        sim.charged = (__typeof__(sim.charged))dlsym(lib, "simcuda_charged");
        sim.host_charged = (__typeof__(sim.host_charged))dlsym(lib, "simcuda_host_charged");
        sim.inject = (__typeof__(sim.inject))dlsym(lib, "simcuda_fail");
        sim.reset_faults = (__typeof__(sim.reset_faults))dlsym(lib, "simcuda_reset_faults");
        sim.calls = (__typeof__(sim.calls))dlsym(lib, "simcuda_calls");
        ck_assert(sim.get_proc && sim.get_proc_old && sim.hold_streams && sim.hold_copies && sim.live_allocations &&
                  sim.charged &&
                  sim.host_charged && sim.inject && sim.reset_faults && sim.calls);
        return lib;
}

static void open_driver(void) {
        _cleanup_free_ char *message = NULL;

        library();
        ck_assert_msg(cuda_driver_open(&cu, NULL, &message) == 0, "%s", message);
}

/* Also makes device 0's primary context current. */
static void open_ctx(void) {
        open_driver();
        expect_ok(cu->cuDevicePrimaryCtxRetain(&ctx, 0));
        expect_ok(cu->cuCtxSetCurrent(ctx));
}

static void teardown(void) {
        if (!cu)
                return;
        ck_assert_uint_eq(sim.live_allocations(), 0);
        ck_assert_uint_eq(sim.charged(0), 0);
        ck_assert_uint_eq(sim.host_charged(), 0);
        if (ctx)
                expect_ok(cu->cuDevicePrimaryCtxRelease(0));
        ctx = NULL;
        cu = cuda_driver_close(cu);
}

static CUmemAllocationProp prop_on(int device, CUmemAllocationHandleType types) {
        CUmemAllocationProp prop = cuda_slab_prop(device);

        prop.requestedHandleTypes = types;
        return prop;
}

static CUmemGenericAllocationHandle create_on(int device, uint64_t size) {
        CUmemAllocationProp prop = prop_on(device, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        CUmemGenericAllocationHandle h;

        expect_ok(cu->cuMemCreate(&h, size, &prop, 0));
        return h;
}

static CUmemGenericAllocationHandle create(uint64_t size) {
        return create_on(0, size);
}

static CUdeviceptr reserve(uint64_t size) {
        CUdeviceptr va;

        expect_ok(cu->cuMemAddressReserve(&va, size, 0, 0, 0));
        return va;
}

static CUresult set_access_on(int device, CUdeviceptr va, uint64_t size, CUmemAccess_flags flags) {
        CUmemAccessDesc desc = { .location = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = device }, .flags = flags };

        return cu->cuMemSetAccess(va, size, &desc, 1);
}

static CUresult set_access(CUdeviceptr va, uint64_t size, CUmemAccess_flags flags) {
        return set_access_on(0, va, size, flags);
}

/* Maps all of `h` (`size` bytes) in a reservation of its own, with `flags` access for device 0. */
static CUdeviceptr map_handle(CUmemGenericAllocationHandle h, uint64_t size, CUmemAccess_flags flags) {
        CUdeviceptr va = reserve(size);

        expect_ok(cu->cuMemMap(va, size, 0, h, 0));
        expect_ok(set_access(va, size, flags));
        return va;
}

/* A fresh allocation mapped read-write in a reservation of its own; its handle is released (the mapping keeps it). */
static CUdeviceptr map_new(uint64_t size) {
        CUmemGenericAllocationHandle h = create(size);
        CUdeviceptr va = map_handle(h, size, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);

        expect_ok(cu->cuMemRelease(h));
        return va;
}

static void unmap_free(CUdeviceptr va, uint64_t size) {
        expect_ok(cu->cuMemUnmap(va, size));
        expect_ok(cu->cuMemAddressFree(va, size));
}

/* Exports `h` as a POSIX fd and checks that it is the simcuda memfd `name` ("simcuda-dev1"); returns the fd. */
static int export_memfd(CUmemGenericAllocationHandle h, const char *name) {
        char path[64], target[128] = "", want[128];
        int fd = -1;

        expect_ok(cu->cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
        snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
        ck_assert_int_gt(readlink(path, target, sizeof(target) - 1), 0);
        snprintf(want, sizeof(want), "/memfd:%s (deleted)", name);
        ck_assert_str_eq(target, want);
        return fd;
}

/* Reads device memory back and checks that every byte is `value`. */
static void expect_bytes(CUdeviceptr va, uint64_t size, uint8_t value) {
        _cleanup_free_ uint8_t *host = malloc(size);

        ck_assert_ptr_nonnull(host);
        expect_ok(cu->cuMemcpyDtoH(host, va, size));
        for (uint64_t i = 0; i < size; i++)
                if (host[i] != value)
                        ck_abort_msg("byte %" PRIu64 " reads %#x, expected %#x", i, host[i], value);
}

/* ---- Loading and the environment --------------------------------------------------------------------- */

START_TEST(test_proc_address) {
        void *lib = library();
        CUdriverProcAddressQueryResult status;
        PFN_cuMemCreate_v10020 mem_create;
        PFN_cuDriverGetVersion_v2020 version;
        PFN_cuGetErrorName_v6000 error_name;
        CUmemAllocationProp prop = prop_on(0, CU_MEM_HANDLE_TYPE_NONE);
        CUmemGenericAllocationHandle h = 0;
        const char *name = NULL;
        void *pfn;
        int v = 0;

        /* Only the lookup and the hooks are exported. */
        ck_assert_ptr_null(dlsym(lib, "cuInit"));
        ck_assert_ptr_null(dlsym(lib, "cuMemCreate"));

        /* Finding nothing is a success with no function, as on the real driver; the status says why. */
        pfn = &pfn;
        expect_ok(sim.get_proc("cuNoSuchEntryPoint", &pfn, 13000, CU_GET_PROC_ADDRESS_DEFAULT, &status));
        ck_assert_int_eq(status, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
        ck_assert_ptr_null(pfn);
        pfn = &pfn;
        expect_ok(sim.get_proc("cuMemCreate", &pfn, 10010, CU_GET_PROC_ADDRESS_DEFAULT, &status));
        ck_assert_int_eq(status, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
        ck_assert_ptr_null(pfn);
        expect(sim.get_proc("cuMemCreate", &pfn, 13010, CU_GET_PROC_ADDRESS_DEFAULT, &status),
               CUDA_ERROR_INVALID_VALUE);   /* newer than the driver */
        expect(sim.get_proc("cuMemCreate", &pfn, 13000, 1 << 5, &status), CUDA_ERROR_INVALID_VALUE);
        expect_ok(sim.get_proc("cuMemCreate", &pfn, 13000, CU_GET_PROC_ADDRESS_DEFAULT, &status));
        ck_assert_int_eq(status, CU_GET_PROC_ADDRESS_SUCCESS);
        mem_create = (PFN_cuMemCreate_v10020)pfn;
        ck_assert_ptr_nonnull(mem_create);
        expect_ok(sim.get_proc_old("cuDriverGetVersion", &pfn, 2020, CU_GET_PROC_ADDRESS_DEFAULT));
        version = (PFN_cuDriverGetVersion_v2020)pfn;
        expect_ok(sim.get_proc("cuGetErrorName", &pfn, 6000, CU_GET_PROC_ADDRESS_DEFAULT, NULL));
        error_name = (PFN_cuGetErrorName_v6000)pfn;

        /* Before cuInit: only the version and the error names work. */
        expect(mem_create(&h, GRAN, &prop, 0), CUDA_ERROR_NOT_INITIALIZED);
        expect_ok(version(&v));
        ck_assert_int_eq(v, 13000);
        expect_ok(error_name(CUDA_ERROR_NOT_INITIALIZED, &name));
        ck_assert_str_eq(name, "CUDA_ERROR_NOT_INITIALIZED");
}
END_TEST

START_TEST(test_no_devices) {
        _cleanup_free_ char *message = NULL;

        setenv("SIMCUDA_DEVICES", "0", 1);
        library();
        ck_assert_int_eq(cuda_driver_open(&cu, NULL, &message), -ENODEV);
        ck_assert_ptr_nonnull(strstr(message, "CUDA_ERROR_NO_DEVICE"));
}
END_TEST

static const char *const bad_env[][2] = {
        { "SIMCUDA_DEVICES", "two" },   { "SIMCUDA_DEVICES", "65" },        { "SIMCUDA_MEMORY", "12Q" },
        { "SIMCUDA_MEMORY", "0" },      { "SIMCUDA_DRIVER_VERSION", "13.0" }, { "SIMCUDA_NO_VMM", "yes" },
        { "SIMCUDA_NO_POSIX_FD", "2" }, { "SIMCUDA_FAIL", "cuMemCreate" },   { "SIMCUDA_PEERS", "some" },
        { "SIMCUDA_PEERS", "0-1" },     /* device 1 does not exist (one device) */
        { "SIMCUDA_NUMA", "0,1" },      /* two nodes for one device */
        { "SIMCUDA_NUMA", "-2" },       { "SIMCUDA_NUMA", "1024" },          { "SIMCUDA_NUMA", "0," },
        { "SIMCUDA_NUMA", "x" },        { "SIMCUDA_HOST_MEMORY", "0" },      { "SIMCUDA_HOST_MEMORY", "1X" },
};

START_TEST(test_bad_env) {
        _cleanup_free_ char *message = NULL;
        char line[512] = "", extra[512];
        FILE *err = tmpfile();
        int saved, k;

        setenv(bad_env[_i][0], bad_env[_i][1], 1);
        library();
        ck_assert_ptr_nonnull(err);
        saved = dup(STDERR_FILENO);
        ck_assert_int_ge(saved, 0);
        ck_assert_int_ge(dup2(fileno(err), STDERR_FILENO), 0);
        k = cuda_driver_open(&cu, NULL, &message);
        ck_assert_int_ge(dup2(saved, STDERR_FILENO), 0);
        close(saved);

        ck_assert_int_eq(k, -ENODEV);
        ck_assert_ptr_nonnull(strstr(message, "CUDA_ERROR_INVALID_VALUE"));
        /* One line on stderr, naming the variable. */
        rewind(err);
        ck_assert_ptr_nonnull(fgets(line, sizeof(line), err));
        ck_assert_ptr_null(fgets(extra, sizeof(extra), err));
        ck_assert_msg(strstr(line, bad_env[_i][0]), "stderr: %s", line);
        fclose(err);
}
END_TEST

START_TEST(test_env_config) {
        _cleanup_free_ char *message = NULL;
        CudaDeviceInfo info;
        size_t total = 0;
        int count = 0;

        setenv("SIMCUDA_DEVICES", "2", 1);
        setenv("SIMCUDA_MEMORY", "64M", 1);
        setenv("SIMCUDA_DRIVER_VERSION", "12080", 1);
        setenv("SIMCUDA_NUMA", "3", 1);         /* device 1 past the list: node 0 */
        open_driver();
        ck_assert_int_eq(cu->version, 12080);
        expect_ok(cu->cuDeviceGetCount(&count));
        ck_assert_int_eq(count, 2);
        ck_assert_msg(cuda_device_probe(cu, 1, &info, &message) == 0, "%s", message);
        ck_assert_str_eq(info.name, "Simulated CUDA device 1");
        ck_assert_uint_eq(info.total_memory, 64 * MiB);
        ck_assert_uint_eq(info.granularity, GRAN);
        ck_assert(info.vmm && info.posix_fd);
        ck_assert_int_eq(info.numa_node, 0);
        ck_assert_int_eq(cuda_device_numa_node(cu, 0), 3);
        expect_ok(cu->cuDeviceTotalMem(&total, 0));
        ck_assert_uint_eq(total, 64 * MiB);
        ck_assert_int_eq(cuda_device_probe(cu, 2, &info, NULL), -ENODEV);
}
END_TEST

/* SIMCUDA_NUMA: a node each, and -1 (the driver does not know) read as unknown. */
START_TEST(test_numa) {
        CudaDeviceInfo info;
        int node = 7;

        setenv("SIMCUDA_DEVICES", "3", 1);
        setenv("SIMCUDA_NUMA", "1,-1,0", 1);
        open_driver();
        expect_ok(cu->cuDeviceGetAttribute(&node, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, 1));
        ck_assert_int_eq(node, -1);
        for (int d = 0; d < 3; d++) {
                ck_assert_int_eq(cuda_device_probe(cu, d, &info, NULL), 0);
                ck_assert_int_eq(info.numa_node, d == 0 ? 1 : d == 1 ? -1 : 0);
        }
}
END_TEST

static const char *const feature_env[] = { "SIMCUDA_NO_VMM", "SIMCUDA_NO_POSIX_FD" };

START_TEST(test_features_off) {
        CUmemAllocationProp prop = prop_on(0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        CUmemGenericAllocationHandle h;
        CudaDeviceInfo info;
        int vmm = -1, posix_fd = -1;

        setenv(feature_env[_i], "1", 1);
        open_driver();
        ck_assert_int_eq(cuda_device_probe(cu, 0, &info, NULL), -EOPNOTSUPP);
        expect_ok(cu->cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 0));
        expect_ok(cu->cuDeviceGetAttribute(&posix_fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                                           0));
        ck_assert_int_eq(vmm, _i != 0);
        ck_assert_int_eq(posix_fd, _i == 0);
        expect(cu->cuMemCreate(&h, GRAN, &prop, 0), CUDA_ERROR_NOT_SUPPORTED);
}
END_TEST

START_TEST(test_attributes) {
        static const struct {
                CUdevice_attribute attribute;
                int value;
        } expected[] = {
                { CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 1 },
                { CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, 1 },
                { CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 9 },
                { CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0 },
                { CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, 0 },
                { CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, 0 },
                { CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 1 },
                { CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 0 },
        };
        CUmemAllocationProp prop = prop_on(0, CU_MEM_HANDLE_TYPE_NONE);
        size_t gran = 0, total = 0;
        char name[8];
        CUdevice dev;
        int v;

        open_driver();
        for (size_t i = 0; i < ELEMENTSOF(expected); i++) {
                v = -1;
                expect_ok(cu->cuDeviceGetAttribute(&v, expected[i].attribute, 0));
                ck_assert_int_eq(v, expected[i].value);
        }
        expect(cu->cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 1),
               CUDA_ERROR_INVALID_DEVICE);
        expect(cu->cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MAX, 0), CUDA_ERROR_INVALID_VALUE);
        expect(cu->cuDeviceGet(&dev, 1), CUDA_ERROR_INVALID_DEVICE);
        expect_ok(cu->cuDeviceGet(&dev, 0));
        ck_assert_int_eq(dev, 0);
        expect(cu->cuDeviceTotalMem(&total, 1), CUDA_ERROR_INVALID_DEVICE);
        expect_ok(cu->cuDeviceTotalMem(&total, 0));
        ck_assert_uint_eq(total, 8192 * MiB);
        expect_ok(cu->cuDeviceGetName(name, sizeof(name), 0));
        ck_assert_str_eq(name, "Simulat");      /* truncated to fit */

        expect_ok(cu->cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
        ck_assert_uint_eq(gran, GRAN);
        expect_ok(cu->cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
        ck_assert_uint_eq(gran, GRAN);
        expect(cu->cuMemGetAllocationGranularity(&gran, &prop, 7), CUDA_ERROR_INVALID_VALUE);
        prop.location.id = 3;   /* the real driver does not look at the properties */
        expect_ok(cu->cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
}
END_TEST

START_TEST(test_error_names) {
        static const CUresult returned[] = {
                CUDA_SUCCESS, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_NOT_INITIALIZED,
                CUDA_ERROR_NO_DEVICE, CUDA_ERROR_INVALID_DEVICE, CUDA_ERROR_INVALID_CONTEXT,
                CUDA_ERROR_OPERATING_SYSTEM, CUDA_ERROR_INVALID_HANDLE, CUDA_ERROR_NOT_FOUND, CUDA_ERROR_NOT_READY,
                CUDA_ERROR_ILLEGAL_ADDRESS, CUDA_ERROR_CONTEXT_IS_DESTROYED, CUDA_ERROR_NOT_PERMITTED,
                CUDA_ERROR_NOT_SUPPORTED, CUDA_ERROR_UNKNOWN,
        };
        const char *s;

        open_driver();
        for (size_t i = 0; i < ELEMENTSOF(returned); i++) {
                s = NULL;
                expect_ok(cu->cuGetErrorName(returned[i], &s));
                ck_assert(s && strncmp(s, "CUDA_", 5) == 0);
                s = NULL;
                expect_ok(cu->cuGetErrorString(returned[i], &s));
                ck_assert(s && *s);
        }
        expect_ok(cu->cuGetErrorString(CUDA_ERROR_ILLEGAL_ADDRESS, &s));
        ck_assert_str_eq(s, "an illegal memory access was encountered");
        expect(cu->cuGetErrorName((CUresult)12345, &s), CUDA_ERROR_INVALID_VALUE);
        ck_assert_ptr_null(s);
        expect(cu->cuGetErrorString(CUDA_SUCCESS, NULL), CUDA_ERROR_INVALID_VALUE);
}
END_TEST

/* ---- Allocations, reservations, mappings, access ----------------------------------------------------- */

START_TEST(test_create_rules) {
        CUmemAllocationProp prop = prop_on(0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        CUmemGenericAllocationHandle h;

        open_driver();  /* no context: VMM calls need none */
        expect(cu->cuMemCreate(&h, 0, &prop, 0), CUDA_ERROR_INVALID_VALUE);
        expect(cu->cuMemCreate(&h, 1 * MiB, &prop, 0), CUDA_ERROR_INVALID_VALUE);
        expect(cu->cuMemCreate(&h, 3 * MiB, &prop, 0), CUDA_ERROR_INVALID_VALUE);
        expect(cu->cuMemCreate(&h, GRAN, &prop, 1), CUDA_ERROR_INVALID_VALUE);
        expect(cu->cuMemCreate(NULL, GRAN, &prop, 0), CUDA_ERROR_INVALID_VALUE);
        expect(cu->cuMemCreate(&h, GRAN, NULL, 0), CUDA_ERROR_INVALID_VALUE);
        prop.type = CU_MEM_ALLOCATION_TYPE_INVALID;
        expect(cu->cuMemCreate(&h, GRAN, &prop, 0), CUDA_ERROR_INVALID_VALUE);
        prop = prop_on(1, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        expect(cu->cuMemCreate(&h, GRAN, &prop, 0), CUDA_ERROR_INVALID_DEVICE);
        prop = prop_on(-1, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        expect(cu->cuMemCreate(&h, GRAN, &prop, 0), CUDA_ERROR_INVALID_DEVICE);
        prop = prop_on(0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        prop.location.type = CU_MEM_LOCATION_TYPE_HOST;
        expect(cu->cuMemCreate(&h, GRAN, &prop, 0), CUDA_ERROR_INVALID_VALUE);
        prop = prop_on(0, CU_MEM_HANDLE_TYPE_WIN32);
        expect(cu->cuMemCreate(&h, GRAN, &prop, 0), CUDA_ERROR_INVALID_VALUE);
        prop = prop_on(0, CU_MEM_HANDLE_TYPE_FABRIC);
        expect(cu->cuMemCreate(&h, GRAN, &prop, 0), CUDA_ERROR_NOT_SUPPORTED);
        ck_assert_uint_eq(sim.live_allocations(), 0);

        prop = prop_on(0, CU_MEM_HANDLE_TYPE_NONE);
        expect_ok(cu->cuMemCreate(&h, 6 * MiB, &prop, 0));
        ck_assert_uint_eq(sim.live_allocations(), 1);
        ck_assert_uint_eq(sim.charged(0), 6 * MiB);
        expect_ok(cu->cuMemRelease(h));
        expect(cu->cuMemRelease(h), CUDA_ERROR_INVALID_VALUE);
        expect(cu->cuMemRelease(0), CUDA_ERROR_INVALID_VALUE);
        expect(cu->cuMemRelease(3), CUDA_ERROR_INVALID_VALUE);
}
END_TEST

START_TEST(test_budget) {
        CUmemAllocationProp prop = prop_on(0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        CUmemGenericAllocationHandle a, b, c = 77;
        size_t free_mem = 0, total = 0;
        CUdeviceptr p, q;

        setenv("SIMCUDA_MEMORY", "16M", 1);
        open_ctx();
        a = create(8 * MiB);
        b = create(8 * MiB);
        expect(cu->cuMemCreate(&c, GRAN, &prop, 0), CUDA_ERROR_OUT_OF_MEMORY);
        ck_assert_uint_eq(c, 77);
        expect_ok(cu->cuMemGetInfo(&free_mem, &total));
        ck_assert_uint_eq(free_mem, 0);
        ck_assert_uint_eq(total, 16 * MiB);
        ck_assert_uint_eq(sim.charged(0), 16 * MiB);
        expect(cu->cuMemAlloc(&p, 1), CUDA_ERROR_OUT_OF_MEMORY);

        expect_ok(cu->cuMemRelease(a));
        expect_ok(cu->cuMemGetInfo(&free_mem, &total));
        ck_assert_uint_eq(free_mem, 8 * MiB);
        expect(cu->cuMemAlloc(&p, 8 * MiB + 1), CUDA_ERROR_OUT_OF_MEMORY);     /* rounds up to 10 MiB */
        expect_ok(cu->cuMemAlloc(&p, 7 * MiB));                                 /* rounds up to 8 MiB */
        ck_assert_uint_eq(sim.charged(0), 16 * MiB);
        expect(cu->cuMemAlloc(&q, 1), CUDA_ERROR_OUT_OF_MEMORY);
        expect_ok(cu->cuMemFree(p));
        expect_ok(cu->cuMemRelease(b));
        expect_ok(cu->cuMemGetInfo(&free_mem, &total));
        ck_assert_uint_eq(free_mem, 16 * MiB);
}
END_TEST

START_TEST(test_reserve_rules) {
        CUdeviceptr va, again;

        open_driver();
        expect(cu->cuMemAddressReserve(&va, 0, 0, 0, 0), CUDA_ERROR_INVALID_VALUE);
        expect(cu->cuMemAddressReserve(&va, 1 * MiB, 0, 0, 0), CUDA_ERROR_INVALID_VALUE);
        expect(cu->cuMemAddressReserve(&va, 3 * MiB, 0, 0, 0), CUDA_ERROR_INVALID_VALUE);
        expect(cu->cuMemAddressReserve(&va, GRAN, 3 * MiB, 0, 0), CUDA_ERROR_INVALID_VALUE);
        expect(cu->cuMemAddressReserve(&va, GRAN, 0, 0, 1), CUDA_ERROR_INVALID_VALUE);
        expect(cu->cuMemAddressReserve(NULL, GRAN, 0, 0, 0), CUDA_ERROR_INVALID_VALUE);

        /* A power of two below the granularity is allowed, and gives the granularity. */
        expect_ok(cu->cuMemAddressReserve(&va, GRAN, 4096, 0, 0));
        ck_assert_uint_eq(va % GRAN, 0);
        expect_ok(cu->cuMemAddressFree(va, GRAN));

        expect_ok(cu->cuMemAddressReserve(&va, 4 * MiB, 64 * MiB, 0, 0));
        ck_assert_uint_eq(va % (64 * MiB), 0);
        expect(cu->cuMemAddressFree(va, 2 * MiB), CUDA_ERROR_INVALID_VALUE);
        expect(cu->cuMemAddressFree(va + GRAN, GRAN), CUDA_ERROR_INVALID_VALUE);
        expect(cu->cuMemAddressFree(va, 8 * MiB), CUDA_ERROR_INVALID_VALUE);
        expect_ok(cu->cuMemAddressFree(va, 4 * MiB));
        expect(cu->cuMemAddressFree(va, 4 * MiB), CUDA_ERROR_INVALID_VALUE);

        /* The requested address, when free, is honoured. */
        expect_ok(cu->cuMemAddressReserve(&again, 4 * MiB, 0, va, 0));
        ck_assert_uint_eq(again, va);
        expect_ok(cu->cuMemAddressFree(again, 4 * MiB));
}
END_TEST

START_TEST(test_map_rules) {
        CUmemGenericAllocationHandle h;
        CUdeviceptr va;

        open_driver();
        h = create(4 * MiB);
        va = reserve(16 * MiB);
        /* Not the whole allocation from offset 0: "not supported", as the real driver says. */
        expect(cu->cuMemMap(va, 2 * MiB, GRAN, h, 0), CUDA_ERROR_NOT_SUPPORTED);
        expect(cu->cuMemMap(va, 2 * MiB, 0, h, 0), CUDA_ERROR_NOT_SUPPORTED);
        expect(cu->cuMemMap(va + 1 * MiB, 8 * MiB, 0, h, 0), CUDA_ERROR_NOT_SUPPORTED);
        expect(cu->cuMemMap(va + 1 * MiB, 4 * MiB, 0, h, 0), CUDA_ERROR_INVALID_VALUE);  /* unaligned */
        expect(cu->cuMemMap(va + 14 * MiB, 4 * MiB, 0, h, 0), CUDA_ERROR_INVALID_VALUE); /* past the end */
        expect(cu->cuMemMap(va + 16 * MiB, 4 * MiB, 0, h, 0), CUDA_ERROR_INVALID_VALUE); /* outside */
        expect(cu->cuMemMap(va, 4 * MiB, 0, h, 1), CUDA_ERROR_INVALID_VALUE);            /* flags */
        expect(cu->cuMemMap(va, 4 * MiB, 0, h + 1000, 0), CUDA_ERROR_INVALID_VALUE);     /* no such handle */

        expect_ok(cu->cuMemMap(va + 4 * MiB, 4 * MiB, 0, h, 0));
        expect(cu->cuMemMap(va + 4 * MiB, 4 * MiB, 0, h, 0), CUDA_ERROR_INVALID_VALUE);  /* mapped already */
        expect(cu->cuMemMap(va + 2 * MiB, 4 * MiB, 0, h, 0), CUDA_ERROR_INVALID_VALUE);  /* overlaps */
        expect(cu->cuMemMap(va + 6 * MiB, 4 * MiB, 0, h, 0), CUDA_ERROR_INVALID_VALUE);
        expect_ok(cu->cuMemMap(va + 8 * MiB, 4 * MiB, 0, h, 0));        /* the same allocation twice */
        expect(cu->cuMemAddressFree(va, 16 * MiB), CUDA_ERROR_INVALID_VALUE);    /* still mapped */
        expect_ok(cu->cuMemRelease(h));
        ck_assert_uint_eq(sim.live_allocations(), 1);
        expect_ok(cu->cuMemUnmap(va + 4 * MiB, 8 * MiB));                /* both mappings at once */
        expect_ok(cu->cuMemAddressFree(va, 16 * MiB));
}
END_TEST

START_TEST(test_unmap_rules) {
        CUmemGenericAllocationHandle a, b;
        CUdeviceptr va;

        open_driver();
        a = create(2 * MiB);
        b = create(4 * MiB);
        va = reserve(16 * MiB);
        /* a at 0, a again at 4 MiB, b at 8 MiB: holes at 2-4, 6-8 and 12-16 MiB */
        expect_ok(cu->cuMemMap(va, 2 * MiB, 0, a, 0));
        expect_ok(cu->cuMemMap(va + 4 * MiB, 2 * MiB, 0, a, 0));
        expect_ok(cu->cuMemMap(va + 8 * MiB, 4 * MiB, 0, b, 0));
        expect(cu->cuMemUnmap(va + 8 * MiB, 2 * MiB), CUDA_ERROR_INVALID_VALUE);        /* half of b */
        expect(cu->cuMemUnmap(va + 6 * MiB, 4 * MiB), CUDA_ERROR_INVALID_VALUE);
        expect(cu->cuMemUnmap(va, 1 * MiB), CUDA_ERROR_INVALID_VALUE);                  /* unaligned */
        expect(cu->cuMemUnmap(va + 1 * MiB, 2 * MiB), CUDA_ERROR_INVALID_VALUE);
        expect(cu->cuMemUnmap(va, 0), CUDA_ERROR_INVALID_VALUE);
        expect(cu->cuMemUnmap(GRAN, GRAN), CUDA_ERROR_INVALID_VALUE);                   /* nothing reserved */
        ck_assert_uint_eq(sim.charged(0), 6 * MiB);

        /* Holes are allowed, as on the real driver: the mappings inside go, whole. */
        expect_ok(cu->cuMemUnmap(va + 12 * MiB, 4 * MiB));     /* nothing mapped */
        expect_ok(cu->cuMemUnmap(va + 2 * MiB, 6 * MiB));      /* hole, a's second mapping, hole */
        expect(cu->cuMemMap(va, 2 * MiB, 0, a, 0), CUDA_ERROR_INVALID_VALUE);   /* the first is still there */
        expect_ok(cu->cuMemMap(va + 4 * MiB, 2 * MiB, 0, a, 0));        /* the reservation stays */
        expect_ok(cu->cuMemRelease(a));
        expect_ok(cu->cuMemRelease(b));
        expect_ok(cu->cuMemUnmap(va, 16 * MiB));
        ck_assert_uint_eq(sim.live_allocations(), 0);
        expect_ok(cu->cuMemAddressFree(va, 16 * MiB));
}
END_TEST

START_TEST(test_access_rules) {
        CUmemAccessDesc desc = { .location = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0 },
                                 .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
        CUmemGenericAllocationHandle a, b;
        size_t free_mem, total;
        CUdeviceptr va;

        open_ctx();
        a = create(2 * MiB);
        b = create(4 * MiB);
        va = reserve(16 * MiB);
        /* a at 0, b at 4 MiB, a again at 10 MiB: holes at 2-4 and 8-10 MiB */
        expect_ok(cu->cuMemMap(va, 2 * MiB, 0, a, 0));
        expect_ok(cu->cuMemMap(va + 4 * MiB, 4 * MiB, 0, b, 0));
        expect_ok(cu->cuMemMap(va + 10 * MiB, 2 * MiB, 0, a, 0));

        /* a device that does not exist: CUDA_ERROR_INVALID_VALUE, as the real driver says (conformance) */
        expect(set_access_on(1, va, 2 * MiB, CU_MEM_ACCESS_FLAGS_PROT_READWRITE), CUDA_ERROR_INVALID_VALUE);
        expect(set_access_on(-1, va, 2 * MiB, CU_MEM_ACCESS_FLAGS_PROT_READWRITE), CUDA_ERROR_INVALID_VALUE);
        desc.location.type = CU_MEM_LOCATION_TYPE_HOST;
        expect(cu->cuMemSetAccess(va, 2 * MiB, &desc, 1), CUDA_ERROR_NOT_SUPPORTED);
        desc.location.type = CU_MEM_LOCATION_TYPE_INVALID;
        expect(cu->cuMemSetAccess(va, 2 * MiB, &desc, 1), CUDA_ERROR_INVALID_VALUE);
        desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        expect(set_access(va, 2 * MiB, (CUmemAccess_flags)2), CUDA_ERROR_INVALID_VALUE);
        expect(cu->cuMemSetAccess(va, 2 * MiB, &desc, 0), CUDA_ERROR_INVALID_VALUE);
        expect(cu->cuMemSetAccess(va, 2 * MiB, NULL, 1), CUDA_ERROR_INVALID_VALUE);
        expect(set_access(va + 1 * MiB, 2 * MiB, CU_MEM_ACCESS_FLAGS_PROT_READWRITE), CUDA_ERROR_INVALID_VALUE);
        expect(set_access(va, 1 * MiB, CU_MEM_ACCESS_FLAGS_PROT_READWRITE), CUDA_ERROR_INVALID_VALUE);
        /* Part of a mapping, or a range that starts or ends where nothing is mapped. */
        expect(set_access(va + 4 * MiB, 2 * MiB, CU_MEM_ACCESS_FLAGS_PROT_READWRITE), CUDA_ERROR_INVALID_VALUE);
        expect(set_access(va + 6 * MiB, 2 * MiB, CU_MEM_ACCESS_FLAGS_PROT_READWRITE), CUDA_ERROR_INVALID_VALUE);
        expect(set_access(va + 2 * MiB, 2 * MiB, CU_MEM_ACCESS_FLAGS_PROT_READWRITE), CUDA_ERROR_INVALID_VALUE);
        expect(set_access(va + 2 * MiB, 6 * MiB, CU_MEM_ACCESS_FLAGS_PROT_READWRITE), CUDA_ERROR_INVALID_VALUE);
        expect(set_access(va, 4 * MiB, CU_MEM_ACCESS_FLAGS_PROT_READWRITE), CUDA_ERROR_INVALID_VALUE);
        expect(set_access(va, 16 * MiB, CU_MEM_ACCESS_FLAGS_PROT_READWRITE), CUDA_ERROR_INVALID_VALUE);

        /* Whole mappings, with holes between them: allowed, as on the real driver. */
        expect_ok(cu->cuMemSetAccess(va, 12 * MiB, &desc, 1));
        expect_ok(cu->cuMemsetD8(va, 0x11, 2 * MiB));
        expect_ok(cu->cuMemsetD8(va + 4 * MiB, 0x22, 4 * MiB));
        expect_bytes(va + 10 * MiB, 2 * MiB, 0x11);            /* a, through its other mapping */
        expect_bytes(va + 4 * MiB, 4 * MiB, 0x22);
        /* The holes themselves are not device memory. */
        expect(cu->cuMemsetD8(va + 2 * MiB - 1, 0x33, 2), CUDA_ERROR_INVALID_VALUE);
        expect(cu->cuMemsetD8(va + 2 * MiB, 0x33, 1), CUDA_ERROR_INVALID_VALUE);
        /* Access taken away again. */
        expect_ok(set_access(va + 4 * MiB, 4 * MiB, CU_MEM_ACCESS_FLAGS_PROT_NONE));
        expect(cu->cuMemsetD8(va + 4 * MiB, 0x33, 1), CUDA_ERROR_INVALID_VALUE);
        expect_ok(cu->cuMemGetInfo(&free_mem, &total));        /* none of this poisoned the context */

        expect_ok(cu->cuMemUnmap(va, 16 * MiB));
        expect_ok(cu->cuMemAddressFree(va, 16 * MiB));
        expect_ok(cu->cuMemRelease(a));
        expect_ok(cu->cuMemRelease(b));
}
END_TEST

START_TEST(test_read_only) {
        CUmemGenericAllocationHandle h;
        uint8_t byte = 1;
        CUdeviceptr va, dst;

        open_ctx();
        dst = map_new(GRAN);
        expect_ok(cu->cuMemsetD8(dst, 0xff, GRAN));
        h = create(GRAN);
        va = reserve(GRAN);
        expect_ok(cu->cuMemMap(va, GRAN, 0, h, 0));
        expect_ok(set_access(va, GRAN, CU_MEM_ACCESS_FLAGS_PROT_READ));
        expect_bytes(va, GRAN, 0);      /* fresh memory reads zero */
        expect(cu->cuMemcpyHtoD(va, &byte, 1), CUDA_ERROR_INVALID_VALUE);
        expect(cu->cuMemsetD8(va, 1, 1), CUDA_ERROR_INVALID_VALUE);
        expect(cu->cuMemcpyDtoDAsync(va, va + 1, 1, NULL), CUDA_ERROR_INVALID_VALUE);
        expect_ok(cu->cuMemcpyDtoDAsync(dst, va, GRAN, NULL));  /* read-only memory is a source */
        expect_bytes(dst, GRAN, 0);
        expect_ok(cu->cuCtxSynchronize());
        unmap_free(va, GRAN);
        unmap_free(dst, GRAN);
        expect_ok(cu->cuMemRelease(h));
}
END_TEST

/*
 * Memory the device may not touch (mapped without cuMemSetAccess, not mapped,
 * not reserved): every kind of access is refused when it is issued, with
 * CUDA_ERROR_INVALID_VALUE, and the context goes on working (the real driver's
 * behaviour).
 */
START_TEST(test_no_access) {
        CUmemGenericAllocationHandle h;
        size_t free_mem, total;
        uint8_t host[16] = { 0 };
        CUdeviceptr va, ok, targets[3];
        CUstream s;

        open_ctx();
        ok = map_new(GRAN);
        h = create(GRAN);
        va = reserve(2 * GRAN);
        expect_ok(cu->cuMemMap(va, GRAN, 0, h, 0));
        targets[0] = va;                /* mapped, no access */
        targets[1] = va + GRAN;         /* reserved, not mapped */
        targets[2] = 4096;              /* nothing */
        expect_ok(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
        for (size_t i = 0; i < ELEMENTSOF(targets); i++) {
                expect(cu->cuMemsetD8(targets[i], 0, 16), CUDA_ERROR_INVALID_VALUE);
                expect(cu->cuMemsetD32(targets[i], 0, 4), CUDA_ERROR_INVALID_VALUE);
                expect(cu->cuMemcpyHtoD(targets[i], host, sizeof(host)), CUDA_ERROR_INVALID_VALUE);
                expect(cu->cuMemcpyDtoH(host, targets[i], sizeof(host)), CUDA_ERROR_INVALID_VALUE);
                expect(cu->cuMemsetD8Async(targets[i], 0, 16, s), CUDA_ERROR_INVALID_VALUE);
                expect(cu->cuMemsetD32Async(targets[i], 0, 4, s), CUDA_ERROR_INVALID_VALUE);
                expect(cu->cuMemcpyDtoDAsync(targets[i], ok, 16, s), CUDA_ERROR_INVALID_VALUE);
                expect(cu->cuMemcpyDtoDAsync(ok, targets[i], 16, s), CUDA_ERROR_INVALID_VALUE);
        }
        expect_ok(cu->cuStreamSynchronize(s));
        expect_ok(cu->cuCtxSynchronize());
        expect_ok(cu->cuMemGetInfo(&free_mem, &total));
        /* A range that runs off the end of a mapping. */
        expect_ok(set_access(va, GRAN, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
        expect_ok(cu->cuMemsetD8(va, 0, GRAN));
        expect(cu->cuMemsetD8(va, 0, GRAN + 1), CUDA_ERROR_INVALID_VALUE);
        expect_ok(cu->cuStreamDestroy(s));
        expect_ok(cu->cuMemUnmap(va, GRAN));
        expect_ok(cu->cuMemAddressFree(va, 2 * GRAN));
        expect_ok(cu->cuMemRelease(h));
        unmap_free(ok, GRAN);
}
END_TEST

START_TEST(test_context_rules) {
        CUdeviceptr p = 0, va;
        CUmemGenericAllocationHandle h;
        size_t free_mem, total;
        CUcontext c = (CUcontext)&c, again;
        uint8_t byte = 0;
        CUstream s;
        int bogus;

        open_driver();
        /* No current context. */
        expect_ok(cu->cuCtxGetCurrent(&c));
        ck_assert_ptr_null(c);
        expect(cu->cuMemsetD8(0, 0, 0), CUDA_ERROR_INVALID_CONTEXT);
        expect(cu->cuMemcpyHtoD(0, &byte, 0), CUDA_ERROR_INVALID_CONTEXT);
        expect(cu->cuMemAlloc(&p, GRAN), CUDA_ERROR_INVALID_CONTEXT);
        expect(cu->cuMemFree(p), CUDA_ERROR_INVALID_CONTEXT);
        expect(cu->cuMemGetInfo(&free_mem, &total), CUDA_ERROR_INVALID_CONTEXT);
        expect(cu->cuStreamCreate(&s, 0), CUDA_ERROR_INVALID_CONTEXT);
        expect(cu->cuCtxSynchronize(), CUDA_ERROR_INVALID_CONTEXT);
        expect(cu->cuStreamSynchronize(NULL), CUDA_ERROR_INVALID_CONTEXT);
        /* ... while the VMM calls need none. */
        h = create(GRAN);
        va = reserve(GRAN);
        expect_ok(cu->cuMemMap(va, GRAN, 0, h, 0));
        expect_ok(set_access(va, GRAN, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
        unmap_free(va, GRAN);
        expect_ok(cu->cuMemRelease(h));

        expect(cu->cuDevicePrimaryCtxRelease(0), CUDA_ERROR_INVALID_CONTEXT);  /* not retained */
        expect(cu->cuDevicePrimaryCtxRetain(&c, 1), CUDA_ERROR_INVALID_DEVICE);
        expect(cu->cuCtxSetCurrent((CUcontext)&bogus), CUDA_ERROR_INVALID_CONTEXT);

        /* Reference counted: the context stays usable until the last release. */
        expect_ok(cu->cuDevicePrimaryCtxRetain(&c, 0));
        expect_ok(cu->cuDevicePrimaryCtxRetain(&again, 0));
        ck_assert_ptr_eq(c, again);
        expect_ok(cu->cuCtxSetCurrent(c));
        expect_ok(cu->cuCtxGetCurrent(&again));
        ck_assert_ptr_eq(c, again);
        expect_ok(cu->cuDevicePrimaryCtxRelease(0));
        expect_ok(cu->cuMemGetInfo(&free_mem, &total));
        expect_ok(cu->cuDevicePrimaryCtxRelease(0));
        expect(cu->cuMemGetInfo(&free_mem, &total), CUDA_ERROR_CONTEXT_IS_DESTROYED);
        expect_ok(cu->cuDevicePrimaryCtxRetain(&ctx, 0));
        expect_ok(cu->cuMemGetInfo(&free_mem, &total));

        expect(cu->cuStreamCreate(&s, 4), CUDA_ERROR_INVALID_VALUE);
        expect(cu->cuStreamSynchronize((CUstream)&bogus), CUDA_ERROR_INVALID_HANDLE);
        expect(cu->cuStreamDestroy(NULL), CUDA_ERROR_INVALID_HANDLE);
        expect_ok(cu->cuStreamCreate(&s, 0));
        expect_ok(cu->cuCtxSetCurrent(NULL));
        expect(cu->cuMemGetInfo(&free_mem, &total), CUDA_ERROR_INVALID_CONTEXT);
        /* A created stream is waited for and asked about with no context current, as the driver does; the
         * streams that name a context's own, and a handle that is no stream, need one. */
        expect_ok(cu->cuStreamSynchronize(s));
        expect_ok(cu->cuStreamQuery(s));
        expect(cu->cuStreamSynchronize(CU_STREAM_LEGACY), CUDA_ERROR_INVALID_CONTEXT);
        expect(cu->cuStreamQuery(CU_STREAM_PER_THREAD), CUDA_ERROR_INVALID_CONTEXT);
        expect(cu->cuStreamSynchronize((CUstream)&bogus), CUDA_ERROR_INVALID_CONTEXT);
        expect_ok(cu->cuCtxSetCurrent(ctx));
        expect_ok(cu->cuStreamDestroy(s));
        expect_ok(cu->cuCtxSetCurrent(NULL));
}
END_TEST

/* Access is per device; memory is charged to the device it lives on. */
START_TEST(test_two_devices) {
        CUmemAccessDesc both[] = {
                { .location = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0 },
                  .flags = CU_MEM_ACCESS_FLAGS_PROT_READ },
                { .location = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 1 },
                  .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE },
        };
        CUmemGenericAllocationHandle h, imported;
        size_t free_mem, total;
        CUcontext c1;
        CUstream s1;
        CUevent e0, e1;
        CUdeviceptr va;
        int fd = -1;

        setenv("SIMCUDA_DEVICES", "2", 1);
        setenv("SIMCUDA_MEMORY", "32M", 1);
        open_ctx();
        expect_ok(cu->cuDevicePrimaryCtxRetain(&c1, 1));
        h = create_on(1, 4 * MiB);
        ck_assert_uint_eq(sim.charged(0), 0);
        ck_assert_uint_eq(sim.charged(1), 4 * MiB);
        expect_ok(cu->cuMemGetInfo(&free_mem, &total));        /* device 0's */
        ck_assert_uint_eq(free_mem, 32 * MiB);

        fd = export_memfd(h, "simcuda-dev1");
        expect_ok(cu->cuMemImportFromShareableHandle(&imported, (void *)(uintptr_t)fd,
                                                     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
        ck_assert_uint_eq(sim.charged(1), 4 * MiB);
        close(fd);

        va = reserve(4 * MiB);
        expect_ok(cu->cuMemMap(va, 4 * MiB, 0, imported, 0));
        expect_ok(set_access_on(0, va, 4 * MiB, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
        expect_ok(cu->cuMemsetD8(va, 0x44, 4 * MiB));          /* device 0 may */
        expect_ok(cu->cuCtxSetCurrent(c1));
        expect(cu->cuMemsetD8(va, 0x55, 1), CUDA_ERROR_INVALID_VALUE);         /* device 1 may not */
        expect_ok(cu->cuMemSetAccess(va, 4 * MiB, both, ELEMENTSOF(both)));
        expect_ok(cu->cuMemsetD8(va, 0x55, 1));
        expect_ok(cu->cuCtxSetCurrent(ctx));
        expect(cu->cuMemsetD8(va, 0x66, 1), CUDA_ERROR_INVALID_VALUE);         /* device 0 reads only now */
        expect_bytes(va, 1, 0x55);
        expect_bytes(va + 1, 4 * MiB - 1, 0x44);
        /* Work on a stream of device 1's context goes in that context whatever is current, device 0's or none,
         * as on the driver (tests/conformance's pair_stream_work_in_its_own_context): queued, waited for, asked
         * about, destroyed. An event recorded must be the stream's context's; one waited for may be any. */
        expect_ok(cu->cuCtxSetCurrent(c1));
        expect_ok(cu->cuStreamCreate(&s1, 0));
        expect_ok(cu->cuEventCreate(&e1, CU_EVENT_DISABLE_TIMING));
        expect_ok(cu->cuCtxSetCurrent(ctx));
        expect_ok(cu->cuEventCreate(&e0, CU_EVENT_DISABLE_TIMING));
        expect_ok(cu->cuMemsetD8Async(va, 0x77, 1, s1));       /* device 1 may write, device 0 (current) not */
        expect(cu->cuEventRecord(e0, s1), CUDA_ERROR_INVALID_HANDLE);
        expect_ok(cu->cuEventRecord(e1, s1));
        expect_ok(cu->cuStreamWaitEvent(s1, e0, 0));
        expect_ok(cu->cuStreamSynchronize(s1));
        expect_ok(cu->cuStreamQuery(s1));
        expect_bytes(va, 1, 0x77);
        expect_ok(cu->cuCtxSetCurrent(NULL));
        expect_ok(cu->cuMemsetD8Async(va, 0x78, 1, s1));
        expect_ok(cu->cuEventRecord(e1, s1));
        expect_ok(cu->cuEventSynchronize(e1));
        expect_ok(cu->cuCtxSetCurrent(ctx));
        expect_bytes(va, 1, 0x78);
        expect_ok(cu->cuStreamDestroy(s1));
        expect_ok(cu->cuEventDestroy(e0));
        expect_ok(cu->cuEventDestroy(e1));

        unmap_free(va, 4 * MiB);
        expect_ok(cu->cuMemRelease(h));
        expect_ok(cu->cuMemRelease(imported));
        ck_assert_uint_eq(sim.charged(1), 0);
        expect_ok(cu->cuDevicePrimaryCtxRelease(1));
}
END_TEST

/*
 * SIMCUDA_PEERS: cuDeviceCanAccessPeer answers from the matrix ("0-1": both ways, "2>0": 2 may reach 0's
 * memory only; a device is never its own peer), cuMemSetAccess refuses access for a device without peer
 * capability with CUDA_ERROR_INVALID_DEVICE and changes nothing, and a memset through a device's context
 * needs that device's access.
 */
START_TEST(test_peers) {
        static const int want[3][3] = { { 0, 1, 0 }, { 1, 0, 0 }, { 1, 0, 0 } };
        CUmemAccessDesc descs[3];
        CUmemGenericAllocationHandle h;
        CUcontext c1, c2;
        CUdeviceptr va;
        int can = -1;

        setenv("SIMCUDA_DEVICES", "3", 1);
        setenv("SIMCUDA_PEERS", "0-1,2>0", 1);
        open_ctx();
        for (int d = 0; d < 3; d++)
                for (int p = 0; p < 3; p++) {
                        expect_ok(cu->cuDeviceCanAccessPeer(&can, d, p));
                        ck_assert_msg(can == want[d][p], "cuDeviceCanAccessPeer(%d, %d) says %d", d, p, can);
                }
        expect(cu->cuDeviceCanAccessPeer(&can, 0, 3), CUDA_ERROR_INVALID_DEVICE);
        expect(cu->cuDeviceCanAccessPeer(&can, -1, 0), CUDA_ERROR_INVALID_DEVICE);
        expect(cu->cuDeviceCanAccessPeer(NULL, 0, 1), CUDA_ERROR_INVALID_VALUE);

        expect_ok(cu->cuDevicePrimaryCtxRetain(&c1, 1));
        expect_ok(cu->cuDevicePrimaryCtxRetain(&c2, 2));
        h = create(4 * MiB);                                    /* on device 0 */
        va = reserve(4 * MiB);
        expect_ok(cu->cuMemMap(va, 4 * MiB, 0, h, 0));
        expect_ok(cu->cuMemRelease(h));
        for (int d = 0; d < 3; d++)
                descs[d] = (CUmemAccessDesc){ .location = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = d },
                                              .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
        /* 2 may reach 0's memory, 1 may too; both at once with 0's own */
        expect_ok(cu->cuMemSetAccess(va, 4 * MiB, descs, 3));
        expect_ok(cu->cuCtxSetCurrent(c2));
        expect_ok(cu->cuMemsetD32(va, 0x22222222, 1));
        expect_ok(cu->cuCtxSetCurrent(c1));
        expect_ok(cu->cuMemsetD32(va + 4, 0x11111111, 1));
        /* revoking is always allowed: 1 loses its access, its memset is refused */
        descs[1].flags = CU_MEM_ACCESS_FLAGS_PROT_NONE;
        expect_ok(cu->cuMemSetAccess(va, 4 * MiB, &descs[1], 1));
        expect(cu->cuMemsetD32(va + 4, 0x33333333, 1), CUDA_ERROR_INVALID_VALUE);
        expect_ok(cu->cuCtxSetCurrent(ctx));
        expect_ok(cu->cuMemsetD32(va + 8, 0x00000000, 1));
        expect_bytes(va, 4, 0x22);
        expect_bytes(va + 4, 4, 0x11);
        unmap_free(va, 4 * MiB);

        /* device 1's memory: 0 may reach it, 2 may not; the refused call changes nothing, 0's grant included */
        h = create_on(1, 2 * MiB);
        va = reserve(2 * MiB);
        expect_ok(cu->cuMemMap(va, 2 * MiB, 0, h, 0));
        expect_ok(cu->cuMemRelease(h));
        descs[1].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        expect(cu->cuMemSetAccess(va, 2 * MiB, descs, 3), CUDA_ERROR_INVALID_DEVICE);
        expect(cu->cuMemsetD8(va, 0x44, 1), CUDA_ERROR_INVALID_VALUE);         /* device 0: not granted */
        descs[2].flags = CU_MEM_ACCESS_FLAGS_PROT_NONE;                        /* revoking 2 is fine */
        expect_ok(cu->cuMemSetAccess(va, 2 * MiB, descs, 3));
        expect_ok(cu->cuMemsetD8(va, 0x44, 1));
        expect_ok(cu->cuCtxSetCurrent(c2));
        expect(cu->cuMemsetD8(va, 0x55, 1), CUDA_ERROR_INVALID_VALUE);
        expect_ok(cu->cuCtxSetCurrent(ctx));
        expect_bytes(va, 1, 0x44);
        unmap_free(va, 2 * MiB);
        ck_assert_uint_eq(sim.charged(1), 0);
        expect_ok(cu->cuDevicePrimaryCtxRelease(1));
        expect_ok(cu->cuDevicePrimaryCtxRelease(2));
}
END_TEST

START_TEST(test_peers_default) {
        int can = -1;

        setenv("SIMCUDA_DEVICES", "2", 1);
        open_driver();
        expect_ok(cu->cuDeviceCanAccessPeer(&can, 1, 0));
        ck_assert_int_eq(can, 1);
        expect_ok(cu->cuDeviceCanAccessPeer(&can, 0, 0));
        ck_assert_int_eq(can, 0);
}
END_TEST

/* ---- Lifetime, export and import --------------------------------------------------------------------- */

START_TEST(test_memory_alive_while_mapped) {
        CUmemGenericAllocationHandle h, again;
        CUdeviceptr va;
        int fd = -1;

        open_ctx();
        h = create(GRAN);
        va = reserve(GRAN);
        expect_ok(cu->cuMemMap(va, GRAN, 0, h, 0));
        expect_ok(set_access(va, GRAN, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
        expect_ok(cu->cuMemsetD8(va, 0x77, GRAN));
        expect_ok(cu->cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
        expect_ok(cu->cuMemRelease(h));
        expect(cu->cuMemMap(va, GRAN, 0, h, 0), CUDA_ERROR_INVALID_VALUE);      /* the handle is gone ... */
        ck_assert_uint_eq(sim.live_allocations(), 1);                           /* ... the memory is not */
        ck_assert_uint_eq(sim.charged(0), GRAN);
        expect_bytes(va, GRAN, 0x77);
        unmap_free(va, GRAN);
        ck_assert_uint_eq(sim.live_allocations(), 0);
        ck_assert_uint_eq(sim.charged(0), 0);

        /* Only the exported fd keeps it now: it is still there, and no longer charged. */
        expect_ok(cu->cuMemImportFromShareableHandle(&again, (void *)(uintptr_t)fd,
                                                     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
        close(fd);
        ck_assert_uint_eq(sim.live_allocations(), 1);
        ck_assert_uint_eq(sim.charged(0), 0);
        va = reserve(GRAN);
        expect_ok(cu->cuMemMap(va, GRAN, 0, again, 0));
        expect_ok(set_access(va, GRAN, CU_MEM_ACCESS_FLAGS_PROT_READ));
        expect_bytes(va, GRAN, 0x77);
        unmap_free(va, GRAN);
        expect_ok(cu->cuMemRelease(again));
}
END_TEST

START_TEST(test_export_import) {
        static const struct {
                const char *name;
                uint64_t size;
                CUresult result;
        } memfds[] = {
                { "something-else", GRAN, CUDA_ERROR_UNKNOWN },
                { "simcuda-dev5", GRAN, CUDA_ERROR_UNKNOWN },           /* one device here */
                { "simcuda-dev0", 1 * MiB, CUDA_ERROR_UNKNOWN },
                { "simcuda-dev0", 0, CUDA_ERROR_UNKNOWN },
                { "simcuda-host1", GRAN, CUDA_ERROR_UNKNOWN },          /* host NUMA node 0 only */
                { "simcuda-host0", 1 * MiB, CUDA_ERROR_UNKNOWN },
                { "simcuda-dev0", GRAN, CUDA_SUCCESS },                 /* as if another process exported it */
        };
        CUmemAllocationProp prop = prop_on(0, CU_MEM_HANDLE_TYPE_NONE);
        CUmemGenericAllocationHandle h, imported, plain, foreign;
        CUdeviceptr va, va2;
        int fd = -1, fd2 = -1, other;
        uint8_t byte = 0x33;

        open_ctx();
        h = create(4 * MiB);
        va = reserve(4 * MiB);
        expect_ok(cu->cuMemMap(va, 4 * MiB, 0, h, 0));
        expect_ok(set_access(va, 4 * MiB, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
        expect_ok(cu->cuMemsetD8(va, 0x5a, 4 * MiB));

        expect_ok(cu->cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
        ck_assert_int_ge(fd, 0);
        ck_assert(fcntl(fd, F_GETFD) & FD_CLOEXEC);
        expect_ok(cu->cuMemImportFromShareableHandle(&imported, (void *)(uintptr_t)fd,
                                                     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
        close(fd);      /* the handle holds its own */
        ck_assert_uint_ne(imported, h);
        ck_assert_uint_eq(sim.live_allocations(), 1);   /* the same allocation, charged once */
        ck_assert_uint_eq(sim.charged(0), 4 * MiB);

        /* Both views see the same bytes. */
        va2 = reserve(4 * MiB);
        expect_ok(cu->cuMemMap(va2, 4 * MiB, 0, imported, 0));
        expect_ok(set_access(va2, 4 * MiB, CU_MEM_ACCESS_FLAGS_PROT_READ));
        expect_bytes(va2, 4 * MiB, 0x5a);
        expect_ok(cu->cuMemcpyHtoD(va + 4 * MiB - 1, &byte, 1));
        expect_bytes(va2 + 4 * MiB - 1, 1, 0x33);

        /* An imported handle is not exported again (the real driver refuses it too). */
        expect(cu->cuMemExportToShareableHandle(&fd2, imported, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
               CUDA_ERROR_INVALID_VALUE);
        ck_assert_int_eq(fd2, -1);

        /* Export: only what was created exportable, only as a POSIX fd. */
        expect_ok(cu->cuMemCreate(&plain, GRAN, &prop, 0));
        fd = -1;
        expect(cu->cuMemExportToShareableHandle(&fd, plain, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
               CUDA_ERROR_INVALID_VALUE);
        ck_assert_int_eq(fd, -1);
        expect(cu->cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_FABRIC, 0), CUDA_ERROR_INVALID_VALUE);
        expect(cu->cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 1),
               CUDA_ERROR_INVALID_VALUE);
        expect(cu->cuMemExportToShareableHandle(&fd, h + 1000, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
               CUDA_ERROR_INVALID_VALUE);
        expect_ok(cu->cuMemRelease(plain));

        /* Import: only a simcuda memfd of a whole number of granules, of a device that exists. */
        expect(cu->cuMemImportFromShareableHandle(&foreign, (void *)(uintptr_t)-1,
                                                  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
               CUDA_ERROR_UNKNOWN);
        other = open("/dev/null", O_RDONLY | O_CLOEXEC);
        expect(cu->cuMemImportFromShareableHandle(&foreign, (void *)(uintptr_t)other,
                                                  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
               CUDA_ERROR_UNKNOWN);
        close(other);
        for (size_t i = 0; i < ELEMENTSOF(memfds); i++) {
                other = memfd_create(memfds[i].name, MFD_CLOEXEC);
                ck_assert_int_ge(other, 0);
                ck_assert_int_eq(ftruncate(other, (off_t)memfds[i].size), 0);
                expect(cu->cuMemImportFromShareableHandle(&foreign, (void *)(uintptr_t)other,
                                                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                       memfds[i].result);
                close(other);
        }
        ck_assert_uint_eq(sim.live_allocations(), 2);
        ck_assert_uint_eq(sim.charged(0), 4 * MiB);    /* memory created elsewhere is not charged here */
        expect_ok(cu->cuMemRelease(foreign));
        expect(cu->cuMemImportFromShareableHandle(&foreign, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_FABRIC),
               CUDA_ERROR_NOT_SUPPORTED);

        unmap_free(va, 4 * MiB);
        unmap_free(va2, 4 * MiB);
        expect_ok(cu->cuMemRelease(h));
        ck_assert_uint_eq(sim.live_allocations(), 1);   /* the imported handle still holds it */
        expect_ok(cu->cuMemRelease(imported));
}
END_TEST

/*
 * Host memory (CU_MEM_LOCATION_TYPE_HOST_NUMA, cuda_host_prop()): on node 0 or a node SIMCUDA_NUMA names, with
 * a device's granularity, charged to SIMCUDA_HOST_MEMORY and to no device; exported, imported and mapped like
 * device memory; any device gets access with cuMemSetAccess (no peer capability needed), and copies go both
 * ways between it and device memory.
 */
START_TEST(test_host_numa) {
        static const int bad_nodes[] = { -1, 1, 4096 };
        CUmemAllocationProp prop = cuda_host_prop(0);
        CUmemGenericAllocationHandle h, imported, other;
        size_t gran = 0, free_mem = 0, total = 0;
        CUdeviceptr host, dev;
        int fd = -1;

        setenv("SIMCUDA_DEVICES", "2", 1);
        setenv("SIMCUDA_NUMA", "-1,3", 1);
        setenv("SIMCUDA_HOST_MEMORY", "8M", 1);
        setenv("SIMCUDA_PEERS", "none", 1);
        open_ctx();

        expect_ok(cu->cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
        ck_assert_uint_eq(gran, GRAN);
        expect_ok(cu->cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
        ck_assert_uint_eq(gran, GRAN);

        /* Nodes 0 and 3 exist here; these do not. */
        for (size_t i = 0; i < ELEMENTSOF(bad_nodes); i++) {
                prop.location.id = bad_nodes[i];
                expect(cu->cuMemCreate(&h, GRAN, &prop, 0), CUDA_ERROR_INVALID_VALUE);
        }
        prop = cuda_host_prop(0);
        expect(cu->cuMemCreate(&h, 1 * MiB, &prop, 0), CUDA_ERROR_INVALID_VALUE);
        prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_FABRIC;
        expect(cu->cuMemCreate(&h, GRAN, &prop, 0), CUDA_ERROR_NOT_SUPPORTED);
        ck_assert_uint_eq(sim.live_allocations(), 0);

        /* One budget for every node; the devices' are untouched. Injected faults hit host memory too. */
        prop = cuda_host_prop(3);
        expect_ok(cu->cuMemCreate(&h, 6 * MiB, &prop, 0));
        ck_assert_uint_eq(sim.host_charged(), 6 * MiB);
        ck_assert_uint_eq(sim.charged(0) + sim.charged(1), 0);
        expect_ok(cu->cuMemGetInfo(&free_mem, &total));
        ck_assert_uint_eq(free_mem, total);
        prop = cuda_host_prop(-1);
        expect(cu->cuMemCreate(&other, 4 * MiB, &prop, 0), CUDA_ERROR_OUT_OF_MEMORY);
        ck_assert_int_eq(sim.inject("cuMemCreate:1:CUDA_ERROR_INVALID_VALUE"), 0);
        expect(cu->cuMemCreate(&other, GRAN, &prop, 0), CUDA_ERROR_INVALID_VALUE);
        ck_assert_uint_eq(sim.host_charged(), 6 * MiB);
        expect_ok(cu->cuMemCreate(&other, 2 * MiB, &prop, 0));
        ck_assert_uint_eq(sim.host_charged(), 8 * MiB);
        expect_ok(cu->cuMemRelease(other));

        /* Exported as a memfd of its node, imported as the same allocation, mapped. */
        fd = export_memfd(h, "simcuda-host3");
        expect_ok(cu->cuMemImportFromShareableHandle(&imported, (void *)(uintptr_t)fd,
                                                     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
        ck_assert_uint_eq(sim.live_allocations(), 1);
        host = reserve(6 * MiB);
        expect_ok(cu->cuMemMap(host, 6 * MiB, 0, imported, 0));
        expect_ok(cu->cuMemRelease(imported));
        expect(cu->cuMemsetD8(host, 1, 1), CUDA_ERROR_INVALID_VALUE);   /* no access yet */
        /* No device is a peer of another here, and both may access host memory. */
        expect_ok(set_access_on(1, host, 6 * MiB, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
        expect_ok(set_access(host, 6 * MiB, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));

        /* Device to host and back. */
        dev = map_new(6 * MiB);
        expect_ok(cu->cuMemsetD8(dev, 0x42, 6 * MiB));
        expect_ok(cu->cuMemcpyDtoDAsync(host, dev, 6 * MiB, NULL));
        expect_bytes(host, 6 * MiB, 0x42);
        expect_ok(cu->cuMemsetD8Async(host, 0x17, 2 * MiB, NULL));
        expect_ok(cu->cuMemcpyDtoDAsync(dev + 4 * MiB, host, 2 * MiB, NULL));
        expect_ok(cu->cuCtxSynchronize());
        expect_bytes(dev, 4 * MiB, 0x42);
        expect_bytes(dev + 4 * MiB, 2 * MiB, 0x17);
        unmap_free(dev, 6 * MiB);
        unmap_free(host, 6 * MiB);
        expect_ok(cu->cuMemRelease(h));
        ck_assert_uint_eq(sim.host_charged(), 0);

        /* Kept only by its fd, as if another process had made it: imported again, not charged here. */
        expect_ok(cu->cuMemImportFromShareableHandle(&imported, (void *)(uintptr_t)fd,
                                                     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
        close(fd);
        ck_assert_uint_eq(sim.live_allocations(), 1);
        ck_assert_uint_eq(sim.host_charged(), 0);
        host = map_handle(imported, 6 * MiB, CU_MEM_ACCESS_FLAGS_PROT_READ);
        expect_bytes(host, 2 * MiB, 0x17);
        unmap_free(host, 6 * MiB);
        expect_ok(cu->cuMemRelease(imported));
}
END_TEST

typedef struct HostCreate {
        CUmemGenericAllocationHandle handle;
        CUresult result;
} HostCreate;

static void *host_create(void *data) {
        HostCreate *c = data;
        CUmemAllocationProp prop = cuda_host_prop(0);

        c->result = cu->cuMemCreate(&c->handle, GRAN, &prop, 0);
        return NULL;
}

/* Waits, at most 10 s, for the file `path` to be there. */
static void wait_for_file(const char *path) {
        for (unsigned i = 0; i < 10000 && access(path, F_OK) != 0; i++)
                (void)usleep(1000);
        ck_assert_msg(access(path, F_OK) == 0, "%s never appeared", path);
}

/*
 * Names this process's hold file of `kind` ("copy", ...) into `hold` (64 bytes) and its ".reached" into `reached`
 * (80 bytes), forgets an old .reached, makes the file holding `content` ("" for none: a plain hold), and sets
 * the variable `var` (SIMCUDA_HOLD_*_FILE) to it, for the simulator to read when the context is opened.
 */
static void hold_file_start(const char *var, const char *kind, const char *content, char *hold, char *reached) {
        int fd;

        snprintf(hold, 64, "/tmp/simcuda-hold-%s-%d", kind, (int)getpid());
        snprintf(reached, 80, "%s.reached", hold);
        (void)unlink(reached);
        fd = open(hold, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        ck_assert_int_ge(fd, 0);
        ck_assert_int_eq(write(fd, content, strlen(content)), (ssize_t)strlen(content));
        close(fd);
        setenv(var, hold, 1);
}

/*
 * SIMCUDA_HOLD_CREATE_FILE: while the file is there, a cuMemCreate of host memory on another thread waits,
 * having made PATH.reached, and the simulator goes on serving this thread meanwhile (device memory is not held,
 * and nothing is charged for the held call yet); it finishes once the file goes. Without the file, host memory
 * is made at once and no .reached appears.
 */
START_TEST(test_hold_create) {
        HostCreate c = { .result = CUDA_ERROR_UNKNOWN };
        char hold[64], reached[80];
        CUmemAllocationProp prop = cuda_host_prop(0);
        CUmemGenericAllocationHandle h;
        pthread_t thread;

        hold_file_start("SIMCUDA_HOLD_CREATE_FILE", "create", "", hold, reached);
        open_ctx();

        ck_assert_int_eq(pthread_create(&thread, NULL, host_create, &c), 0);
        wait_for_file(reached);
        h = create(GRAN);
        expect_ok(cu->cuMemRelease(h));
        ck_assert_uint_eq(sim.host_charged(), 0);
        ck_assert_int_eq(pthread_tryjoin_np(thread, NULL), EBUSY);

        ck_assert_int_eq(unlink(hold), 0);
        ck_assert_int_eq(pthread_join(thread, NULL), 0);
        expect_ok(c.result);
        ck_assert_uint_eq(sim.host_charged(), GRAN);
        expect_ok(cu->cuMemRelease(c.handle));

        ck_assert_int_eq(unlink(reached), 0);
        expect_ok(cu->cuMemCreate(&h, GRAN, &prop, 0));
        ck_assert_int_ne(access(reached, F_OK), 0);
        expect_ok(cu->cuMemRelease(h));
}
END_TEST

/*
 * A SIMCUDA_HOLD_CREATE_FILE that holds a number lets that many host creates through, one at a time, counting
 * down in the file, and holds the next: here one made at once on this thread, then one on another that waits.
 */
START_TEST(test_hold_create_count) {
        HostCreate c = { .result = CUDA_ERROR_UNKNOWN };
        CUmemAllocationProp prop = cuda_host_prop(0);
        char hold[64], reached[80], left[8] = "";
        CUmemGenericAllocationHandle h;
        pthread_t thread;
        int fd;

        hold_file_start("SIMCUDA_HOLD_CREATE_FILE", "create-count", "1", hold, reached);
        open_ctx();

        expect_ok(cu->cuMemCreate(&h, GRAN, &prop, 0));
        ck_assert_int_ne(access(reached, F_OK), 0);
        fd = open(hold, O_RDONLY | O_CLOEXEC);
        ck_assert_int_ge(fd, 0);
        ck_assert_int_gt(read(fd, left, sizeof(left) - 1), 0);
        close(fd);
        ck_assert_str_eq(left, "0");
        ck_assert_int_eq(pthread_create(&thread, NULL, host_create, &c), 0);
        wait_for_file(reached);
        ck_assert_uint_eq(sim.host_charged(), GRAN);
        ck_assert_int_eq(pthread_tryjoin_np(thread, NULL), EBUSY);

        ck_assert_int_eq(unlink(hold), 0);
        ck_assert_int_eq(pthread_join(thread, NULL), 0);
        expect_ok(c.result);
        expect_ok(cu->cuMemRelease(c.handle));
        expect_ok(cu->cuMemRelease(h));
        (void)unlink(reached);
}
END_TEST

START_TEST(test_mem_alloc) {
        CUdeviceptr p, q;
        uint32_t word = 0;

        open_ctx();
        expect(cu->cuMemAlloc(&p, 0), CUDA_ERROR_INVALID_VALUE);
        expect_ok(cu->cuMemAlloc(&p, 3 * MiB));
        ck_assert_uint_eq(sim.charged(0), 4 * MiB);
        expect_ok(cu->cuMemsetD32(p, 0xdeadbeef, 3 * MiB / 4));
        expect_ok(cu->cuMemcpyDtoH(&word, p + 3 * MiB - 4, 4));
        ck_assert_uint_eq(word, 0xdeadbeef);
        expect(cu->cuMemsetD32(p + 1, 0, 1), CUDA_ERROR_INVALID_VALUE);        /* unaligned */
        expect(cu->cuMemsetD8(p + 3 * MiB, 0, 2 * MiB), CUDA_ERROR_INVALID_VALUE); /* past the end */

        /* Not for the VMM calls. */
        expect(cu->cuMemUnmap(p, 4 * MiB), CUDA_ERROR_INVALID_VALUE);
        expect(set_access(p, 4 * MiB, CU_MEM_ACCESS_FLAGS_PROT_NONE), CUDA_ERROR_INVALID_VALUE);
        expect(cu->cuMemAddressFree(p, 4 * MiB), CUDA_ERROR_INVALID_VALUE);
        expect(cu->cuMemFree(p + GRAN), CUDA_ERROR_INVALID_VALUE);
        expect_ok(cu->cuMemFree(p));
        expect(cu->cuMemFree(p), CUDA_ERROR_INVALID_VALUE);
        expect_ok(cu->cuMemFree(0));
        ck_assert_uint_eq(sim.charged(0), 0);

        /* The last release of the context frees what was left. */
        expect_ok(cu->cuMemAlloc(&q, 1));
        ck_assert_uint_eq(sim.live_allocations(), 1);
        expect_ok(cu->cuDevicePrimaryCtxRelease(0));
        ctx = NULL;
        ck_assert_uint_eq(sim.live_allocations(), 0);
}
END_TEST

/* ---- Fault injection --------------------------------------------------------------------------------- */

static void never(void *data) {
        ck_abort_msg("a host function whose launch failed ran");
}

START_TEST(test_faults) {
        static const char *const bad[] = {
                "cuMemCreate", "cuMemCreate:", "cuMemCreate:0", "cuMemCreate:x", "cuMemCreate:-1",
                "cuNoSuchEntry:1", "cuMemCreate:1:CUDA_ERROR_NO_SUCH", "cuMemCreate:1:CUDA_SUCCESS",
                "cuMemCreate:1,", ",cuMemCreate:1", "cuMemCreate:1:CUDA_ERROR_UNKNOWN:1", "cuMemCreate:1,cuNoSuch:1",
        };
        CUmemAllocationProp prop = prop_on(0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        CUmemGenericAllocationHandle a, b = 77, c;
        CUstream s;
        uint64_t calls;
        int fd = -1;

        open_ctx();
        calls = sim.calls("cuMemCreate");
        ck_assert_int_eq(sim.inject("cuMemCreate:2"), 0);
        a = create(GRAN);
        expect(cu->cuMemCreate(&b, GRAN, &prop, 0), CUDA_ERROR_OUT_OF_MEMORY);  /* the default for cuMemCreate */
        ck_assert_uint_eq(b, 77);                                               /* changed nothing */
        ck_assert_uint_eq(sim.live_allocations(), 1);
        c = create(GRAN);
        ck_assert_uint_eq(sim.calls("cuMemCreate"), calls + 3);
        ck_assert_uint_eq(sim.calls("cuNoSuchEntry"), 0);

        ck_assert_int_eq(sim.inject("cuMemExportToShareableHandle:1:CUDA_ERROR_INVALID_VALUE"), 0);
        expect(cu->cuMemExportToShareableHandle(&fd, a, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
               CUDA_ERROR_INVALID_VALUE);
        ck_assert_int_eq(fd, -1);
        expect_ok(cu->cuMemExportToShareableHandle(&fd, a, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
        close(fd);

        /* Two rules on the same call: the first listed wins, both are used up. */
        ck_assert_int_eq(sim.inject("cuMemRelease:1:CUDA_ERROR_NOT_PERMITTED,cuMemRelease:1"), 0);
        expect(cu->cuMemRelease(a), CUDA_ERROR_NOT_PERMITTED);
        expect_ok(cu->cuMemRelease(a));         /* the failed call did not release it */

        /* A failed async call queues nothing; other entry points default to CUDA_ERROR_UNKNOWN. */
        expect_ok(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
        ck_assert_int_eq(sim.inject("cuLaunchHostFunc:1"), 0);
        sim.hold_streams(1);
        expect(cu->cuLaunchHostFunc(s, never, NULL), CUDA_ERROR_UNKNOWN);
        expect_ok(cu->cuStreamQuery(s));
        sim.hold_streams(0);
        expect_ok(cu->cuStreamDestroy(s));

        for (size_t i = 0; i < ELEMENTSOF(bad); i++)
                ck_assert_msg(sim.inject(bad[i]) == -EINVAL, "spec \"%s\" accepted", bad[i]);
        ck_assert_int_eq(sim.inject(""), 0);
        expect_ok(cu->cuMemCreate(&b, GRAN, &prop, 0));         /* no bad spec left a rule behind */

        ck_assert_int_eq(sim.inject("cuMemCreate:1,cuMemRelease:1"), 0);
        sim.reset_faults();
        a = create(GRAN);
        expect_ok(cu->cuMemRelease(a));
        expect_ok(cu->cuMemRelease(b));
        expect_ok(cu->cuMemRelease(c));
}
END_TEST

START_TEST(test_faults_from_env) {
        CUmemAllocationProp prop = prop_on(0, CU_MEM_HANDLE_TYPE_NONE);
        _cleanup_free_ char *message = NULL;
        CUmemGenericAllocationHandle h;

        setenv("SIMCUDA_FAIL", "cuDeviceGetCount:1:CUDA_ERROR_UNKNOWN,cuMemCreate:1", 1);
        library();
        ck_assert_int_eq(cuda_driver_open(&cu, NULL, &message), -ENODEV);
        ck_assert_ptr_nonnull(strstr(message, "CUDA_ERROR_UNKNOWN"));
        free(message);
        message = NULL;
        ck_assert_msg(cuda_driver_open(&cu, NULL, &message) == 0, "%s", message);   /* used up */
        expect(cu->cuMemCreate(&h, GRAN, &prop, 0), CUDA_ERROR_OUT_OF_MEMORY);
        expect_ok(cu->cuMemCreate(&h, GRAN, &prop, 0));
        expect_ok(cu->cuMemRelease(h));
}
END_TEST

/* ---- Streams ----------------------------------------------------------------------------------------- */

/* Host functions of two streams run at the same time: count atomically. */
static void count(void *data) {
        __atomic_fetch_add((unsigned *)data, 1, __ATOMIC_RELAXED);
}

typedef struct Trace {
        CUdeviceptr va;
        unsigned n;
        uint8_t seen[8];                /* the first byte of va when each host function ran */
        pthread_t thread;
        unsigned long live;             /* a hook, called from the host function: the lock is not held */
} Trace;

static void trace(void *data) {
        Trace *t = data;

        t->seen[t->n++] = *(volatile uint8_t *)(uintptr_t)t->va;
        t->thread = pthread_self();
        t->live = sim.live_allocations();
}

/*
 * simcuda_hold_streams(SIMCUDA_HOLD_NO_WAIT) holds the streams, and lets through what does not wait: a query, a
 * synchronize of a stream with nothing held on it. A wait for held work aborts the process (the test expects
 * SIGABRT): a test of code that must not wait fails at once.
 */
START_TEST(test_hold_no_wait_aborts) {
        CUstream s, idle;
        CUevent e;
        CUdeviceptr va;

        open_ctx();
        va = map_new(GRAN);
        expect_ok(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
        expect_ok(cu->cuStreamCreate(&idle, CU_STREAM_NON_BLOCKING));
        expect_ok(cu->cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
        sim.hold_streams(SIMCUDA_HOLD_NO_WAIT);
        expect_ok(cu->cuMemsetD8Async(va, 1, GRAN, s));
        expect_ok(cu->cuEventRecord(e, s));
        expect(cu->cuStreamQuery(s), CUDA_ERROR_NOT_READY);
        expect(cu->cuEventQuery(e), CUDA_ERROR_NOT_READY);
        expect_ok(cu->cuStreamSynchronize(idle));       /* nothing held on it: no wait */
        (void)cu->cuEventSynchronize(e);                /* aborts */
        ck_abort_msg("cuEventSynchronize waited for held work under SIMCUDA_HOLD_NO_WAIT");
}
END_TEST

/* A memset of a new mapping queued on a new stream of `flags`, held by SIMCUDA_HOLD_NO_WAIT; returns the mapping. */
static CUdeviceptr memset_held_no_wait(unsigned flags) {
        CUdeviceptr va;
        CUstream s;

        open_ctx();
        va = map_new(GRAN);
        expect_ok(cu->cuStreamCreate(&s, flags));
        sim.hold_streams(SIMCUDA_HOLD_NO_WAIT);
        expect_ok(cu->cuMemsetD8Async(va, 1, GRAN, s));
        return va;
}

/* The same for a context's synchronize: it waits for every stream, the non-blocking held one too. */
START_TEST(test_hold_no_wait_aborts_ctx_sync) {
        CUdeviceptr va = memset_held_no_wait(CU_STREAM_NON_BLOCKING);

        expect_ok(cu->cuMemsetD8(va, 2, GRAN));         /* the NULL stream does not wait for a non-blocking one */
        (void)cu->cuCtxSynchronize();                   /* aborts */
        ck_abort_msg("cuCtxSynchronize waited for held work under SIMCUDA_HOLD_NO_WAIT");
}
END_TEST

/* And for an operation on the NULL stream while a blocking stream has held work: it waits for that stream. */
START_TEST(test_hold_no_wait_aborts_null_stream) {
        CUdeviceptr va = memset_held_no_wait(CU_STREAM_DEFAULT);

        (void)cu->cuMemsetD8(va, 2, GRAN);              /* aborts */
        ck_abort_msg("a memset on the NULL stream waited for held work under SIMCUDA_HOLD_NO_WAIT");
}
END_TEST

START_TEST(test_streams_in_order_while_held) {
        Trace t = { 0 };
        CUstream s;

        open_ctx();
        t.va = map_new(GRAN);
        expect_ok(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
        sim.hold_streams(1);
        expect_ok(cu->cuMemsetD8Async(t.va, 1, GRAN, s));
        expect_ok(cu->cuLaunchHostFunc(s, trace, &t));
        expect_ok(cu->cuMemsetD32Async(t.va, 0x02020202, GRAN / 4, s));
        expect_ok(cu->cuLaunchHostFunc(s, trace, &t));
        expect(cu->cuStreamQuery(s), CUDA_ERROR_NOT_READY);
        ck_assert_uint_eq(t.n, 0);
        expect_bytes(t.va, GRAN, 0);    /* the NULL stream does not wait for a non-blocking one */

        sim.hold_streams(0);
        expect_ok(cu->cuStreamSynchronize(s));
        ck_assert_uint_eq(t.n, 2);
        ck_assert_uint_eq(t.seen[0], 1);
        ck_assert_uint_eq(t.seen[1], 2);
        ck_assert(!pthread_equal(t.thread, pthread_self()));
        ck_assert_uint_eq(t.live, 1);
        expect_ok(cu->cuStreamQuery(s));
        expect_ok(cu->cuStreamDestroy(s));
        expect(cu->cuStreamQuery(s), CUDA_ERROR_INVALID_HANDLE);
        unmap_free(t.va, GRAN);
}
END_TEST

typedef struct Legacy {
        CUcontext ctx;
        CUdeviceptr va;
        CUresult result;
} Legacy;

static void *legacy_memset(void *data) {
        Legacy *l = data;

        l->result = cu->cuCtxSetCurrent(l->ctx);
        if (l->result == CUDA_SUCCESS)
                l->result = cu->cuMemsetD8(l->va, 9, GRAN);
        return NULL;
}

/* The NULL stream waits for the work queued before it on blocking streams. */
START_TEST(test_null_stream_waits) {
        Legacy l = { .result = CUDA_ERROR_UNKNOWN };
        pthread_t thread;
        uint64_t before;
        CUstream s;

        open_ctx();
        l.ctx = ctx;
        l.va = map_new(GRAN);
        expect_ok(cu->cuStreamCreate(&s, CU_STREAM_DEFAULT));
        sim.hold_streams(1);
        expect_ok(cu->cuMemsetD8Async(l.va, 7, GRAN, s));
        before = sim.calls("cuMemsetD8");
        ck_assert_int_eq(pthread_create(&thread, NULL, legacy_memset, &l), 0);
        /* Once the call is counted, the thread waits (it holds the simulator's lock until it does). */
        while (sim.calls("cuMemsetD8") == before)
                sched_yield();
        expect(cu->cuStreamQuery(s), CUDA_ERROR_NOT_READY);
        sim.hold_streams(0);
        ck_assert_int_eq(pthread_join(thread, NULL), 0);
        expect_ok(l.result);
        expect_bytes(l.va, GRAN, 9);    /* 7 first, then 9 */
        expect_ok(cu->cuStreamDestroy(s));
        unmap_free(l.va, GRAN);
}
END_TEST

/*
 * Memory unmapped between queueing a memset and running it: the memset does
 * not touch it and poisons the context for good (CUDA_ERROR_ILLEGAL_ADDRESS),
 * as a fault does on a GPU. Nothing queued after it runs, host functions
 * included; calls that need the context fail; VMM calls still work; the
 * primary context can be released but not retained again.
 */
START_TEST(test_fault_is_sticky) {
        CUmemGenericAllocationHandle h;
        size_t free_mem, total;
        CUdeviceptr va, p, q;
        CUcontext again;
        unsigned n = 0;
        CUstream s;

        open_ctx();
        expect_ok(cu->cuMemAlloc(&p, GRAN));
        va = map_new(GRAN);
        expect_ok(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
        sim.hold_streams(1);
        expect_ok(cu->cuMemsetD8Async(va, 1, GRAN, s));
        expect_ok(cu->cuLaunchHostFunc(s, count, &n));
        expect_ok(cu->cuMemUnmap(va, GRAN));
        sim.hold_streams(0);
        expect(cu->cuStreamSynchronize(s), CUDA_ERROR_ILLEGAL_ADDRESS);
        ck_assert_uint_eq(n, 0);
        expect(cu->cuStreamQuery(s), CUDA_ERROR_ILLEGAL_ADDRESS);
        expect(cu->cuLaunchHostFunc(s, count, &n), CUDA_ERROR_ILLEGAL_ADDRESS);
        expect(cu->cuMemGetInfo(&free_mem, &total), CUDA_ERROR_ILLEGAL_ADDRESS);
        expect(cu->cuMemAlloc(&q, GRAN), CUDA_ERROR_ILLEGAL_ADDRESS);
        expect(cu->cuCtxSynchronize(), CUDA_ERROR_ILLEGAL_ADDRESS);

        h = create(GRAN);
        expect_ok(cu->cuMemRelease(h));
        expect_ok(cu->cuMemAddressFree(va, GRAN));
        /* Clean-up calls do their work, and report the fault. */
        expect(cu->cuMemFree(p), CUDA_ERROR_ILLEGAL_ADDRESS);
        expect(cu->cuStreamDestroy(s), CUDA_ERROR_ILLEGAL_ADDRESS);
        ck_assert_uint_eq(sim.live_allocations(), 0);

        expect_ok(cu->cuDevicePrimaryCtxRelease(0));
        ctx = NULL;
        expect(cu->cuDevicePrimaryCtxRetain(&again, 0), CUDA_ERROR_ILLEGAL_ADDRESS);
        expect(cu->cuMemGetInfo(&free_mem, &total), CUDA_ERROR_CONTEXT_IS_DESTROYED);
        ck_assert_uint_eq(n, 0);
}
END_TEST

/*
 * Unmapping memory that a queued memset targets: cuMemUnmap does not wait,
 * the memset does not touch the allocation (still alive through its handle),
 * and the stream and the context report CUDA_ERROR_ILLEGAL_ADDRESS, as do
 * events recorded behind it.
 */
START_TEST(test_unmap_under_queued_work) {
        CUmemAccessDesc access = { .location = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0 },
                                   .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
        CUmemGenericAllocationHandle h;
        CUdeviceptr va, again;
        CUevent e;
        CUstream s;

        open_ctx();
        h = create(GRAN);
        va = reserve(GRAN);
        expect_ok(cu->cuMemMap(va, GRAN, 0, h, 0));
        expect_ok(cu->cuMemSetAccess(va, GRAN, &access, 1));
        expect_ok(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
        expect_ok(cu->cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
        sim.hold_streams(1);
        expect_ok(cu->cuMemsetD32Async(va, 0xffffffffu, GRAN / 4, s));
        expect_ok(cu->cuEventRecord(e, s));
        expect_ok(cu->cuMemUnmap(va, GRAN));            /* returns with the memset queued */
        expect(cu->cuStreamQuery(s), CUDA_ERROR_NOT_READY);
        expect(cu->cuEventQuery(e), CUDA_ERROR_NOT_READY);
        sim.hold_streams(0);
        expect(cu->cuStreamSynchronize(s), CUDA_ERROR_ILLEGAL_ADDRESS);
        expect(cu->cuEventSynchronize(e), CUDA_ERROR_ILLEGAL_ADDRESS);
        expect(cu->cuEventQuery(e), CUDA_ERROR_ILLEGAL_ADDRESS);

        /* the allocation was not written: mapped again (the VMM calls still work), it reads zero */
        again = reserve(GRAN);
        expect_ok(cu->cuMemMap(again, GRAN, 0, h, 0));
        expect_ok(cu->cuMemSetAccess(again, GRAN, &access, 1));
        ck_assert_uint_eq(*(volatile uint32_t *)(uintptr_t)again, 0);
        ck_assert_uint_eq(*(volatile uint32_t *)(uintptr_t)(again + GRAN - 4), 0);
        expect_ok(cu->cuMemUnmap(again, GRAN));
        expect_ok(cu->cuMemAddressFree(again, GRAN));
        expect_ok(cu->cuMemAddressFree(va, GRAN));
        expect_ok(cu->cuMemRelease(h));
        expect_ok(cu->cuEventDestroy(e));
        expect(cu->cuStreamDestroy(s), CUDA_ERROR_ILLEGAL_ADDRESS);
}
END_TEST

/*
 * simcuda_hold_copies(): a stream whose next operation is a device-to-device copy waits before it, what was
 * queued before the copy done; another stream's memset runs meanwhile. Let go, the copy and what follows run.
 */
START_TEST(test_hold_copies) {
        CUdeviceptr src, dst, other;
        CUstream s, t;

        open_ctx();
        src = map_new(GRAN);
        dst = map_new(GRAN);
        other = map_new(GRAN);
        expect_ok(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
        expect_ok(cu->cuStreamCreate(&t, CU_STREAM_NON_BLOCKING));
        sim.hold_copies(1);
        expect_ok(cu->cuMemsetD8Async(src, 0x3c, GRAN, s));
        expect_ok(cu->cuMemcpyDtoDAsync(dst, src, GRAN, s));
        expect_ok(cu->cuMemsetD8Async(src, 0, GRAN, s));
        expect_ok(cu->cuMemsetD8Async(other, 0x77, GRAN, t));
        expect_ok(cu->cuStreamSynchronize(t));                  /* the other stream runs */
        expect_bytes(other, GRAN, 0x77);
        expect(cu->cuStreamQuery(s), CUDA_ERROR_NOT_READY);
        expect_bytes(dst, GRAN, 0);
        sim.hold_copies(0);
        expect_ok(cu->cuStreamSynchronize(s));
        expect_bytes(dst, GRAN, 0x3c);
        expect_bytes(src, GRAN, 0);
        expect_ok(cu->cuStreamDestroy(s));
        expect_ok(cu->cuStreamDestroy(t));
        unmap_free(src, GRAN);
        unmap_free(dst, GRAN);
        unmap_free(other, GRAN);
}
END_TEST

/*
 * cuStreamWaitEvent(): work queued on a stream after the wait runs once the event's last record made before the
 * wait has run on its stream, here behind a held copy; a record made after the wait does not count. A wait for an
 * event never recorded is no wait; the NULL stream's caller waits itself. Flags other than
 * CU_EVENT_WAIT_EXTERNAL are refused, and so is an event that does not exist.
 */
START_TEST(test_stream_wait_event) {
        CUdeviceptr src, dst, other;
        CUevent e, never;
        CUstream s, t;

        open_ctx();
        src = map_new(GRAN);
        dst = map_new(GRAN);
        other = map_new(GRAN);
        expect_ok(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
        expect_ok(cu->cuStreamCreate(&t, CU_STREAM_NON_BLOCKING));
        expect_ok(cu->cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
        expect_ok(cu->cuEventCreate(&never, CU_EVENT_DISABLE_TIMING));
        expect_ok(cu->cuMemsetD8Async(src, 0x3c, GRAN, s));
        expect_ok(cu->cuStreamSynchronize(s));

        sim.hold_copies(1);
        expect_ok(cu->cuMemcpyDtoDAsync(dst, src, GRAN, s));
        expect_ok(cu->cuEventRecord(e, s));
        expect_ok(cu->cuStreamWaitEvent(t, e, 0));
        expect_ok(cu->cuMemsetD8Async(other, 0x77, GRAN, t));
        expect_ok(cu->cuEventRecord(e, s));             /* after the wait: not waited for */
        expect(cu->cuStreamQuery(t), CUDA_ERROR_NOT_READY);
        expect_bytes(other, GRAN, 0);
        sim.hold_copies(0);
        expect_ok(cu->cuStreamSynchronize(t));
        expect_bytes(dst, GRAN, 0x3c);                  /* the copy ran first */
        expect_bytes(other, GRAN, 0x77);
        expect_ok(cu->cuStreamSynchronize(s));

        expect_ok(cu->cuStreamWaitEvent(t, never, 0));
        expect_ok(cu->cuStreamWaitEvent(t, never, CU_EVENT_WAIT_EXTERNAL));
        expect_ok(cu->cuMemsetD8Async(other, 0x11, GRAN, t));
        expect_ok(cu->cuStreamSynchronize(t));
        expect_bytes(other, GRAN, 0x11);
        expect_ok(cu->cuStreamWaitEvent(NULL, e, 0));   /* its records ran: returns */
        expect(cu->cuStreamWaitEvent(t, e, 4), CUDA_ERROR_INVALID_VALUE);
        expect_ok(cu->cuEventDestroy(never));
        expect(cu->cuStreamWaitEvent(t, never, 0), CUDA_ERROR_INVALID_HANDLE);

        expect_ok(cu->cuEventDestroy(e));
        expect_ok(cu->cuStreamDestroy(s));
        expect_ok(cu->cuStreamDestroy(t));
        unmap_free(src, GRAN);
        unmap_free(dst, GRAN);
        unmap_free(other, GRAN);
}
END_TEST

/*
 * SIMCUDA_HOLD_COPY_FILE holding a number: that many copies run, each taking one from it, and the next one waits
 * (PATH.reached) until the file goes. An empty file lets none through.
 */
START_TEST(test_hold_copy_file_passes) {
        char hold[64], reached[80], left[8] = "";
        CUdeviceptr src, dst, held;
        CUstream s;
        int fd;

        hold_file_start("SIMCUDA_HOLD_COPY_FILE", "copy", "1", hold, reached);
        open_ctx();
        src = map_new(GRAN);
        dst = map_new(GRAN);
        held = map_new(GRAN);
        expect_ok(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));

        expect_ok(cu->cuMemsetD8Async(src, 0x3c, GRAN, s));
        expect_ok(cu->cuMemcpyDtoDAsync(dst, src, GRAN, s));    /* the one let through */
        expect_ok(cu->cuMemcpyDtoDAsync(held, src, GRAN, s));   /* held */
        wait_for_file(reached);
        expect_bytes(dst, GRAN, 0x3c);
        expect_bytes(held, GRAN, 0);
        expect(cu->cuStreamQuery(s), CUDA_ERROR_NOT_READY);
        fd = open(hold, O_RDONLY | O_CLOEXEC);
        ck_assert_int_ge(fd, 0);
        ck_assert_int_eq(read(fd, left, sizeof(left) - 1), 1);
        close(fd);
        ck_assert_str_eq(left, "0");

        ck_assert_int_eq(unlink(hold), 0);
        expect_ok(cu->cuStreamSynchronize(s));
        expect_bytes(held, GRAN, 0x3c);
        ck_assert_int_eq(unlink(reached), 0);
        expect_ok(cu->cuStreamDestroy(s));
        unmap_free(src, GRAN);
        unmap_free(dst, GRAN);
        unmap_free(held, GRAN);
}
END_TEST

/*
 * SIMCUDA_HOLD_MEMSET_FILE: while the file is there, a stream whose next operation is a memset waits before it
 * (and makes the file's name + ".reached"); a copy queued on another stream runs on. Removing the file lets it go.
 */
START_TEST(test_hold_memset_file) {
        char hold[64], reached[80];
        CUdeviceptr a, b, c;
        CUstream s, t;

        hold_file_start("SIMCUDA_HOLD_MEMSET_FILE", "memset", "", hold, reached);
        open_ctx();
        a = map_new(GRAN);
        b = map_new(GRAN);
        c = map_new(GRAN);
        expect_ok(cu->cuMemsetD8(c, 0x5a, GRAN));              /* the NULL stream's: run at once, not held */
        expect_ok(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
        expect_ok(cu->cuStreamCreate(&t, CU_STREAM_NON_BLOCKING));

        expect_ok(cu->cuMemsetD8Async(a, 0x77, GRAN, s));       /* held */
        expect_ok(cu->cuMemcpyDtoDAsync(b, c, GRAN, t));        /* runs on */
        wait_for_file(reached);
        expect_ok(cu->cuStreamSynchronize(t));
        expect_bytes(b, GRAN, 0x5a);
        expect_bytes(a, GRAN, 0);
        expect(cu->cuStreamQuery(s), CUDA_ERROR_NOT_READY);

        ck_assert_int_eq(unlink(hold), 0);
        expect_ok(cu->cuStreamSynchronize(s));
        expect_bytes(a, GRAN, 0x77);
        ck_assert_int_eq(unlink(reached), 0);
        expect_ok(cu->cuStreamDestroy(s));
        expect_ok(cu->cuStreamDestroy(t));
        unmap_free(a, GRAN);
        unmap_free(b, GRAN);
        unmap_free(c, GRAN);
}
END_TEST

/*
 * cuMemcpyDtoDAsync: in stream order with the memsets around it, on the NULL stream too, across the mappings of
 * two allocations mapped back to back; refused when issued (nothing queued, the context goes on working) for a
 * bad stream, without a context, or where the device may not write the destination (test_read_only and
 * test_no_access: not read the source).
 */
START_TEST(test_copy_device) {
        CUmemGenericAllocationHandle a, b;
        CUdeviceptr src, dst, pair;
        CUstream s;

        open_ctx();
        src = map_new(2 * GRAN);
        dst = map_new(2 * GRAN);
        expect_ok(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
        sim.hold_streams(1);
        expect_ok(cu->cuMemsetD8Async(src, 0x5a, 2 * GRAN, s));
        expect_ok(cu->cuMemcpyDtoDAsync(dst, src, 2 * GRAN, s));
        expect_ok(cu->cuMemsetD8Async(src, 0x11, GRAN, s));    /* after the copy: not in dst */
        expect_bytes(dst, 2 * GRAN, 0);
        sim.hold_streams(0);
        expect_ok(cu->cuStreamSynchronize(s));
        expect_bytes(dst, 2 * GRAN, 0x5a);
        expect_bytes(src, GRAN, 0x11);

        /* The NULL stream; 0 bytes is a no-op, wherever it points. */
        expect_ok(cu->cuMemcpyDtoDAsync(dst, src, GRAN, NULL));
        expect_bytes(dst, GRAN, 0x11);
        expect_ok(cu->cuMemcpyDtoDAsync(4096, 8192, 0, s));
        expect_ok(cu->cuMemcpyDtoDAsync(dst, src, 0, CU_STREAM_LEGACY));

        /* Two allocations back to back: one copy fills both, another reads across the boundary. */
        a = create(GRAN);
        b = create(GRAN);
        pair = reserve(2 * GRAN);
        expect_ok(cu->cuMemMap(pair, GRAN, 0, a, 0));
        expect_ok(cu->cuMemMap(pair + GRAN, GRAN, 0, b, 0));
        expect_ok(set_access(pair, 2 * GRAN, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
        expect_ok(cu->cuMemcpyDtoDAsync(pair, src, 2 * GRAN, s));
        expect_ok(cu->cuMemsetD8Async(dst, 0, 2 * GRAN, s));
        expect_ok(cu->cuMemcpyDtoDAsync(dst, pair + GRAN / 2, GRAN, s));
        expect_ok(cu->cuStreamSynchronize(s));
        expect_bytes(pair, GRAN, 0x11);
        expect_bytes(pair + GRAN, GRAN, 0x5a);
        expect_bytes(dst, GRAN / 2, 0x11);
        expect_bytes(dst + GRAN / 2, GRAN / 2, 0x5a);
        expect_bytes(dst + GRAN, GRAN, 0);

        /* Refused when issued. */
        expect(cu->cuMemcpyDtoDAsync(dst, src, 1, (CUstream)&s), CUDA_ERROR_INVALID_HANDLE);
        expect(cu->cuMemcpyDtoDAsync(dst, UINT64_MAX - 1, 2, s), CUDA_ERROR_INVALID_VALUE);
        expect_ok(cu->cuCtxSetCurrent(NULL));
        expect(cu->cuMemcpyDtoDAsync(dst, src, 1, NULL), CUDA_ERROR_INVALID_CONTEXT);
        expect_ok(cu->cuCtxSetCurrent(ctx));
        /* Fault injection: the call fails and queues nothing. */
        ck_assert_int_eq(sim.inject("cuMemcpyDtoDAsync:1"), 0);
        sim.hold_streams(1);
        expect(cu->cuMemcpyDtoDAsync(dst, src, GRAN, s), CUDA_ERROR_UNKNOWN);
        expect_ok(cu->cuStreamQuery(s));
        sim.hold_streams(0);
        expect_ok(cu->cuCtxSynchronize());
        expect_bytes(dst + GRAN, GRAN, 0);

        expect_ok(cu->cuStreamDestroy(s));
        unmap_free(pair, 2 * GRAN);
        expect_ok(cu->cuMemRelease(a));
        expect_ok(cu->cuMemRelease(b));
        unmap_free(src, 2 * GRAN);
        unmap_free(dst, 2 * GRAN);
}
END_TEST

/*
 * A copy whose destination is unmapped after it was queued and before it runs (what a daemon that frees a slab
 * too early does): it writes nothing, and the stream and the context fail with CUDA_ERROR_ILLEGAL_ADDRESS, as
 * for a memset (test_unmap_under_queued_work), rather than the process crashing.
 */
START_TEST(test_copy_into_unmapped_range) {
        CUmemGenericAllocationHandle h;
        CUdeviceptr src, dst, again;
        CUstream s;

        open_ctx();
        src = map_new(GRAN);
        expect_ok(cu->cuMemsetD8(src, 0x3c, GRAN));
        h = create(GRAN);
        dst = map_handle(h, GRAN, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
        expect_ok(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
        sim.hold_streams(1);
        expect_ok(cu->cuMemcpyDtoDAsync(dst, src, GRAN, s));
        expect_ok(cu->cuMemUnmap(dst, GRAN));           /* returns with the copy queued */
        sim.hold_streams(0);
        expect(cu->cuStreamSynchronize(s), CUDA_ERROR_ILLEGAL_ADDRESS);
        expect(cu->cuMemcpyDtoDAsync(src, src, 1, s), CUDA_ERROR_ILLEGAL_ADDRESS);

        /* The allocation was not written: mapped again (the VMM calls still work), it reads zero. */
        again = map_handle(h, GRAN, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
        ck_assert_uint_eq(*(volatile uint8_t *)(uintptr_t)again, 0);
        ck_assert_uint_eq(*(volatile uint8_t *)(uintptr_t)(again + GRAN - 1), 0);
        unmap_free(again, GRAN);
        expect_ok(cu->cuMemAddressFree(dst, GRAN));
        expect_ok(cu->cuMemRelease(h));
        unmap_free(src, GRAN);
        expect(cu->cuStreamDestroy(s), CUDA_ERROR_ILLEGAL_ADDRESS);
}
END_TEST

/* Events: complete once the work queued before them has run; destroyed with a record queued, freed after it. */
START_TEST(test_events) {
        CUdeviceptr p;
        CUevent e, f, bad;
        CUstream s;

        open_ctx();
        expect(cu->cuEventCreate(&bad, 0x100), CUDA_ERROR_INVALID_VALUE);
        expect(cu->cuEventCreate(NULL, 0), CUDA_ERROR_INVALID_VALUE);
        expect_ok(cu->cuEventCreate(&e, CU_EVENT_DEFAULT));
        expect_ok(cu->cuEventCreate(&f, CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC));
        expect_ok(cu->cuEventQuery(e));                 /* never recorded: complete */
        expect_ok(cu->cuMemAlloc(&p, GRAN));
        expect_ok(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));

        sim.hold_streams(1);
        expect_ok(cu->cuMemsetD8Async(p, 1, GRAN, s));
        expect_ok(cu->cuEventRecord(e, s));
        expect(cu->cuEventQuery(e), CUDA_ERROR_NOT_READY);
        expect_ok(cu->cuEventRecord(f, NULL));          /* the NULL stream does not wait for a non-blocking one */
        expect_ok(cu->cuEventQuery(f));
        expect(cu->cuEventRecord(f, (CUstream)0x1000), CUDA_ERROR_INVALID_HANDLE);
        expect_ok(cu->cuEventQuery(f));
        sim.hold_streams(0);
        expect_ok(cu->cuEventSynchronize(e));
        expect_ok(cu->cuEventQuery(e));

        /* recorded again: not complete until the new record has run */
        sim.hold_streams(1);
        expect_ok(cu->cuEventRecord(e, s));
        expect(cu->cuEventQuery(e), CUDA_ERROR_NOT_READY);
        expect_ok(cu->cuEventDestroy(e));               /* with the record queued */
        expect(cu->cuEventQuery(e), CUDA_ERROR_INVALID_HANDLE);
        expect(cu->cuEventDestroy(e), CUDA_ERROR_INVALID_HANDLE);
        sim.hold_streams(0);
        expect_ok(cu->cuStreamSynchronize(s));

        expect_ok(cu->cuEventDestroy(f));
        expect(cu->cuEventDestroy(NULL), CUDA_ERROR_INVALID_HANDLE);
        expect_ok(cu->cuStreamDestroy(s));
        expect_ok(cu->cuMemFree(p));
}
END_TEST

START_TEST(test_stream_destroy_drains) {
        unsigned n = 0;
        CUstream s, t;

        open_ctx();
        expect_ok(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
        for (int i = 0; i < 100; i++)
                expect_ok(cu->cuLaunchHostFunc(s, count, &n));
        expect_ok(cu->cuStreamDestroy(s));
        ck_assert_uint_eq(n, 100);

        /* cuCtxSynchronize waits for every stream; the NULL stream runs host functions inline. */
        expect_ok(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
        expect_ok(cu->cuStreamCreate(&t, CU_STREAM_DEFAULT));
        for (int i = 0; i < 50; i++) {
                expect_ok(cu->cuLaunchHostFunc(s, count, &n));
                expect_ok(cu->cuLaunchHostFunc(t, count, &n));
        }
        expect_ok(cu->cuCtxSynchronize());
        ck_assert_uint_eq(n, 200);
        expect_ok(cu->cuLaunchHostFunc(NULL, count, &n));
        ck_assert_uint_eq(n, 201);
        /* The last release of the context destroys what streams are left. */
        expect_ok(cu->cuLaunchHostFunc(t, count, &n));
        expect_ok(cu->cuDevicePrimaryCtxRelease(0));
        ctx = NULL;
        ck_assert_uint_eq(n, 202);
}
END_TEST

static Suite *simcuda_suite(void) {
        Suite *s = suite_create("simcuda");
        TCase *tc;

        tc = tcase_create("loading");
        tcase_add_checked_fixture(tc, NULL, teardown);
        tcase_add_test(tc, test_proc_address);
        tcase_add_test(tc, test_no_devices);
        tcase_add_loop_test(tc, test_bad_env, 0, ELEMENTSOF(bad_env));
        tcase_add_test(tc, test_env_config);
        tcase_add_test(tc, test_numa);
        tcase_add_loop_test(tc, test_features_off, 0, ELEMENTSOF(feature_env));
        tcase_add_test(tc, test_attributes);
        tcase_add_test(tc, test_error_names);
        suite_add_tcase(s, tc);

        tc = tcase_create("memory");
        tcase_add_checked_fixture(tc, NULL, teardown);
        tcase_add_test(tc, test_create_rules);
        tcase_add_test(tc, test_budget);
        tcase_add_test(tc, test_reserve_rules);
        tcase_add_test(tc, test_map_rules);
        tcase_add_test(tc, test_unmap_rules);
        tcase_add_test(tc, test_access_rules);
        tcase_add_test(tc, test_read_only);
        tcase_add_test(tc, test_no_access);
        tcase_add_test(tc, test_context_rules);
        tcase_add_test(tc, test_two_devices);
        tcase_add_test(tc, test_peers);
        tcase_add_test(tc, test_peers_default);
        tcase_add_test(tc, test_memory_alive_while_mapped);
        tcase_add_test(tc, test_export_import);
        tcase_add_test(tc, test_host_numa);
        tcase_add_test(tc, test_hold_create);
        tcase_add_test(tc, test_hold_create_count);
        tcase_add_test(tc, test_mem_alloc);
        suite_add_tcase(s, tc);

        tc = tcase_create("faults");
        tcase_add_checked_fixture(tc, NULL, teardown);
        tcase_add_test(tc, test_faults);
        tcase_add_test(tc, test_faults_from_env);
        suite_add_tcase(s, tc);

        tc = tcase_create("streams");
        tcase_add_checked_fixture(tc, NULL, teardown);
        tcase_add_test(tc, test_streams_in_order_while_held);
        tcase_add_test(tc, test_null_stream_waits);
        tcase_add_test(tc, test_fault_is_sticky);
        tcase_add_test(tc, test_stream_destroy_drains);
        tcase_add_test(tc, test_unmap_under_queued_work);
        tcase_add_test(tc, test_copy_device);
        tcase_add_test(tc, test_hold_copies);
        tcase_add_test(tc, test_stream_wait_event);
        tcase_add_test(tc, test_hold_copy_file_passes);
        tcase_add_test(tc, test_hold_memset_file);
        tcase_add_test_raise_signal(tc, test_hold_no_wait_aborts, SIGABRT);
        tcase_add_test_raise_signal(tc, test_hold_no_wait_aborts_ctx_sync, SIGABRT);
        tcase_add_test_raise_signal(tc, test_hold_no_wait_aborts_null_stream, SIGABRT);
        tcase_add_test(tc, test_copy_into_unmapped_range);
        tcase_add_test(tc, test_events);
        suite_add_tcase(s, tc);

        return s;
}

int main(void) {
        SRunner *sr = srunner_create(simcuda_suite());
        int failed;

        /* Each test loads the simulator in its own process, after setting its environment. */
        srunner_set_fork_status(sr, CK_FORK);
        srunner_run_all(sr, CK_NORMAL);
        failed = srunner_ntests_failed(sr);
        srunner_free(sr);
        return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
