/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The CUDA driver layer: one table of Driver API entry points, filled at run
 * time. The library is dlopen()ed (libcuda.so.1, or the file named by
 * VMMBROKER_LIBCUDA) and every entry point is looked up with
 * cuGetProcAddress_v2 at the ABI version named below, as NCCL and PyTorch do.
 * Nothing links -lcuda, so a program that uses this layer starts on a machine
 * without a driver and can say why it cannot serve.
 *
 * Members keep the driver's own names, so `cu->cuMemCreate(...)` reads like
 * the Driver API documentation. (cuda.h #defines some of those names to their
 * _v2 spellings; member declarations and uses are rewritten alike, so that is
 * harmless.)
 */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda.h>
#include <cudaTypedefs.h>

/* cuGetProcAddress_v2 appeared in CUDA 12.0; older drivers are refused. */
#define CUDA_DRIVER_MIN_VERSION 12000

/* Default soname of the driver library, and the variable that overrides it. */
#define CUDA_DRIVER_LIBRARY "libcuda.so.1"
#define CUDA_DRIVER_LIBRARY_ENV "VMMBROKER_LIBCUDA"

/* X(name, ABI version): every entry point the project uses. */
#define CUDA_DRIVER_ENTRY_POINTS(X)                     \
        X(cuGetErrorName, 6000)                         \
        X(cuGetErrorString, 6000)                       \
        X(cuInit, 2000)                                 \
        X(cuDriverGetVersion, 2020)                     \
        X(cuDeviceGetCount, 2000)                       \
        X(cuDeviceGet, 2000)                            \
        X(cuDeviceGetName, 2000)                        \
        X(cuDeviceGetAttribute, 2000)                   \
        X(cuDeviceTotalMem, 3020)                       \
        X(cuDeviceCanAccessPeer, 4000)                  \
        X(cuDevicePrimaryCtxGetState, 7000)             \
        X(cuDevicePrimaryCtxRetain, 7000)               \
        X(cuDevicePrimaryCtxRelease, 11000)             \
        X(cuCtxSetCurrent, 4000)                        \
        X(cuCtxGetCurrent, 4000)                        \
        X(cuCtxSynchronize, 2000)                       \
        X(cuMemGetInfo, 3020)                           \
        X(cuMemGetAllocationGranularity, 10020)         \
        X(cuMemCreate, 10020)                           \
        X(cuMemRelease, 10020)                          \
        X(cuMemExportToShareableHandle, 10020)          \
        X(cuMemImportFromShareableHandle, 10020)        \
        X(cuMemAddressReserve, 10020)                   \
        X(cuMemAddressFree, 10020)                      \
        X(cuMemMap, 10020)                              \
        X(cuMemUnmap, 10020)                            \
        X(cuMemSetAccess, 10020)                        \
        X(cuMemAlloc, 3020)                             \
        X(cuMemFree, 3020)                              \
        X(cuMemcpyHtoD, 3020)                           \
        X(cuMemcpyDtoH, 3020)                           \
        X(cuMemcpyDtoDAsync, 3020)                      \
        X(cuMemsetD8, 3020)                             \
        X(cuMemsetD32, 3020)                            \
        X(cuMemsetD8Async, 3020)                        \
        X(cuMemsetD32Async, 3020)                       \
        X(cuStreamCreate, 2000)                         \
        X(cuStreamDestroy, 4000)                        \
        X(cuStreamSynchronize, 2000)                    \
        X(cuStreamQuery, 2000)                          \
        X(cuLaunchHostFunc, 10000)                      \
        X(cuStreamWaitEvent, 3020)                      \
        X(cuEventCreate, 2000)                          \
        X(cuEventRecord, 2000)                          \
        X(cuEventQuery, 2000)                           \
        X(cuEventSynchronize, 2000)                     \
        X(cuEventDestroy, 4000)

typedef struct CudaDriver {
        void *library;
        char *path;     /* what was dlopen()ed */
        int version;    /* cuDriverGetVersion(), e.g. 13000 */
#define CUDA_DRIVER_MEMBER(name, abi) PFN_##name##_v##abi name;
        CUDA_DRIVER_ENTRY_POINTS(CUDA_DRIVER_MEMBER)
#undef CUDA_DRIVER_MEMBER
} CudaDriver;

/*
 * What one device offers the broker. Filled by cuda_device_probe().
 */
typedef struct CudaDeviceInfo {
        int index;
        CUdevice device;
        char name[256];
        uint64_t total_memory;          /* cuDeviceTotalMem */
        uint64_t granularity;           /* minimum VMM granularity for a pinned device allocation */
        bool vmm;                       /* CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED */
        bool posix_fd;                  /* CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED */
        int numa_node;                  /* CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID: the host NUMA node nearest the
                                           device, -1 when unknown (the driver says -1, or fails the query) */
} CudaDeviceInfo;

/* CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID came with CUDA 12.2's cuda.h; older drivers refuse it (numa_node -1). */
#if CUDA_VERSION < 12020
#define CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID ((CUdevice_attribute)134)
/* So did CU_MEM_LOCATION_TYPE_HOST_NUMA (cuda_host_prop()) and the attribute that says a device supports it
 * in cuMemCreate; older drivers refuse both. */
#define CU_MEM_LOCATION_TYPE_HOST_NUMA ((CUmemLocationType)3)
#define CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED ((CUdevice_attribute)141)
#endif

/* The host NUMA node of `dev`: CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, or -1 when the driver does not know it. */
int cuda_device_numa_node(CudaDriver *cu, CUdevice dev);

/*
 * Loads the driver, fills the table, checks the version, runs cuInit(0) and
 * checks that there is at least one device. `path` NULL means
 * $VMMBROKER_LIBCUDA, else libcuda.so.1.
 *
 * Returns 0, or a negative errno with a sentence for a person in *ret_message
 * (malloc'd; the caller frees it):
 *   -ENOENT            the driver library cannot be loaded
 *   -EPROTONOSUPPORT   the driver is too old, or lacks an entry point
 *   -ENODEV            cuInit failed or there is no device
 *   -ENOMEM            out of memory (no sentence)
 */
int cuda_driver_open(CudaDriver **ret, const char *path, char **ret_message);
CudaDriver *cuda_driver_close(CudaDriver *cu);

/*
 * Reads what device `index` offers. Returns 0 when the broker can use it;
 * -ENODEV for a bad index; -EOPNOTSUPP when the device lacks VMM or POSIX-fd
 * handle support, or reports an unusable granularity (ret is still filled so
 * the caller can report which).
 * *ret_message as for cuda_driver_open().
 */
int cuda_device_probe(CudaDriver *cu, int index, CudaDeviceInfo *ret, char **ret_message);

/* "CUDA_ERROR_OUT_OF_MEMORY", or "CUresult 123" when the driver does not know it. Never NULL. */
const char *cuda_result_name(const CudaDriver *cu, CUresult r);

/* Maps a CUresult to a negative errno, for callers that pass errors up unchanged. */
int cuda_result_to_errno(CUresult r);

/* The allocation properties the broker uses for every slab: pinned device memory, POSIX-fd exportable. */
CUmemAllocationProp cuda_slab_prop(CUdevice device);

/*
 * The allocation properties of a host slab, where a parked lease's content lives: pinned host memory on
 * NUMA node `numa_node` (CU_MEM_LOCATION_TYPE_HOST_NUMA; a node below 0, "unknown" as
 * cuda_device_numa_node() says, means node 0), POSIX-fd exportable like a device slab. It is imported and
 * mapped like one, and cuMemSetAccess with a DEVICE location gives that device access to it, so that
 * cuMemcpyDtoDAsync copies between a device slab and a host slab.
 */
CUmemAllocationProp cuda_host_prop(int numa_node);

/*
 * The alignment to reserve a slab's address range with: the largest power of two not above its size. Slabs
 * are any multiple of the granularity, and cuMemAddressReserve takes only power-of-two alignments
 * (CUDA_ERROR_INVALID_VALUE otherwise, on the real driver and the simulated device alike).
 */
uint64_t cuda_slab_alignment(uint64_t size);

/*
 * What a holder does with a lease: imports each slab fd, reserves one
 * contiguous range for them all (aligned as cuda_slab_alignment() says for the
 * first, largest slab), maps the
 * slabs into it in order and sets access for the whole range with one
 * cuMemSetAccess (read-write, or read-only). The imported handles are released
 * once mapped: the mapping keeps the memory. The fds stay open; the caller
 * closes them. Returns 0, or a negative errno with a sentence in *ret_message;
 * on failure nothing stays mapped or reserved.
 */
int cuda_map_fds(CudaDriver *cu, CUdevice device, const int *fds, const uint64_t *sizes, size_t n,
                 bool readonly, CUdeviceptr *ret_va, char **ret_message);

/*
 * Sets access to [va, va + size), a range cuda_map_fds() mapped, for each of
 * the n devices with one cuMemSetAccess carrying one descriptor per device:
 * read-write, or read only. Devices other than the memory's own need peer
 * capability (cuDeviceCanAccessPeer), which the caller checks; VMM memory
 * needs no cuCtxEnablePeerAccess. Returns the driver's result.
 */
CUresult cuda_set_access(CudaDriver *cu, CUdeviceptr va, uint64_t size, const CUdevice *devices, size_t n,
                         bool readonly);

/* Undoes cuda_map_fds(): unmaps each slab and frees the reservation. Returns 0 or a negative errno. */
int cuda_unmap(CudaDriver *cu, CUdeviceptr va, const uint64_t *sizes, size_t n);

/*
 * Unmaps the n slabs mapped back to back from va and keeps the reservation, for a lease that is parked (mapped
 * again later at the same address by cuda_map_fds_at()). Tries every slab; returns 0 or the first negative errno.
 */
int cuda_unmap_slabs(CudaDriver *cu, CUdeviceptr va, const uint64_t *sizes, size_t n);

/*
 * The second half of cuda_map_fds(), at an address range reserved already (for at least the slabs' total):
 * imports each slab fd, maps the slabs back to back from va, and sets access for the whole range for the
 * n_devices devices with one cuMemSetAccess (cuda_set_access(); the memory's own device among them). The fds
 * stay open. Returns 0, or a negative errno with a sentence in *ret_message; on failure nothing stays mapped,
 * and the reservation stays the caller's.
 */
int cuda_map_fds_at(CudaDriver *cu, const CUdevice *devices, size_t n_devices, const int *fds,
                    const uint64_t *sizes, size_t n, bool readonly, CUdeviceptr va, char **ret_message);
