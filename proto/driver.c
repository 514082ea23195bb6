/* SPDX-License-Identifier: MIT */

#include <dlfcn.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "driver.h"
#include "macro.h"
#include "message.h"

CudaDriver *cuda_driver_close(CudaDriver *cu) {
        if (!cu)
                return NULL;
        if (cu->library)
                dlclose(cu->library);
        free(cu->path);
        free(cu);
        return NULL;
}

DEFINE_TRIVIAL_CLEANUP_FUNC(CudaDriver, cuda_driver_close);

const char *cuda_result_name(const CudaDriver *cu, CUresult r) {
        static __thread char buf[32];
        const char *name = NULL;

        if (cu && cu->cuGetErrorName && cu->cuGetErrorName(r, &name) == CUDA_SUCCESS && name)
                return name;
        snprintf(buf, sizeof(buf), "CUresult %d", (int)r);
        return buf;
}

int cuda_result_to_errno(CUresult r) {
        switch (r) {
        case CUDA_SUCCESS:
                return 0;
        case CUDA_ERROR_OUT_OF_MEMORY:
                return -ENOMEM;
        case CUDA_ERROR_INVALID_VALUE:
        case CUDA_ERROR_INVALID_HANDLE:
                return -EINVAL;
        case CUDA_ERROR_NO_DEVICE:
        case CUDA_ERROR_INVALID_DEVICE:
                return -ENODEV;
        case CUDA_ERROR_NOT_SUPPORTED:
                return -EOPNOTSUPP;
        case CUDA_ERROR_NOT_PERMITTED:
                return -EPERM;
        default:
                return -EIO;
        }
}

CUmemAllocationProp cuda_slab_prop(CUdevice device) {
        return (CUmemAllocationProp){
                .type = CU_MEM_ALLOCATION_TYPE_PINNED,
                .requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                .location = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = device },
        };
}

CUmemAllocationProp cuda_host_prop(int numa_node) {
        CUmemAllocationProp prop = cuda_slab_prop(0);

        prop.location = (CUmemLocation){
                .type = CU_MEM_LOCATION_TYPE_HOST_NUMA,
                .id = numa_node < 0 ? 0 : numa_node,
        };
        return prop;
}

uint64_t cuda_slab_alignment(uint64_t size) {
        return size == 0 ? 0 : UINT64_C(1) << (63 - __builtin_clzll(size));
}

static const char *driver_path(const char *path) {
        const char *e;

        if (path)
                return path;
        e = getenv(CUDA_DRIVER_LIBRARY_ENV);
        if (e && *e)
                return e;
        return CUDA_DRIVER_LIBRARY;
}

int cuda_driver_open(CudaDriver **ret, const char *path, char **ret_message) {
        _cleanup_(cuda_driver_closep) CudaDriver *cu = NULL;
        PFN_cuGetProcAddress_v12000 get_proc;
        CUresult r;
        int count = 0;

        cu = calloc(1, sizeof(*cu));
        if (!cu)
                return -ENOMEM;
        cu->path = strdup(driver_path(path));
        if (!cu->path)
                return -ENOMEM;

        cu->library = dlopen(cu->path, RTLD_NOW | RTLD_LOCAL);
        if (!cu->library) {
                set_message(ret_message,
                     "No CUDA driver: cannot load %s (%s). Install the NVIDIA driver, or set %s to a libcuda.so.1 "
                     "(the simulated device, tests/simcuda, builds one).",
                     cu->path, dlerror(), CUDA_DRIVER_LIBRARY_ENV);
                return -ENOENT;
        }

        get_proc = (PFN_cuGetProcAddress_v12000)dlsym(cu->library, "cuGetProcAddress_v2");
        if (!get_proc) {
                set_message(ret_message,
                     "CUDA driver too old: %s has no cuGetProcAddress_v2; vmmbroker needs a driver for CUDA %d.%d "
                     "or newer. Upgrade the NVIDIA driver.",
                     cu->path, CUDA_DRIVER_MIN_VERSION / 1000, CUDA_DRIVER_MIN_VERSION % 1000 / 10);
                return -EPROTONOSUPPORT;
        }

#define CUDA_DRIVER_LOOKUP(name, abi)                                                                  \
        {                                                                                              \
                void *pfn = NULL;                                                                      \
                CUdriverProcAddressQueryResult found = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;           \
                r = get_proc(#name, &pfn, abi, CU_GET_PROC_ADDRESS_DEFAULT, &found);                   \
                if (r != CUDA_SUCCESS || !pfn || found != CU_GET_PROC_ADDRESS_SUCCESS) {               \
                        set_message(ret_message,                                                              \
                             "CUDA driver too old or incomplete: %s does not provide %s (ABI %d). "     \
                             "Upgrade the NVIDIA driver.",                                             \
                             cu->path, #name, abi);                                                    \
                        return -EPROTONOSUPPORT;                                                       \
                }                                                                                      \
                cu->name = (PFN_##name##_v##abi)pfn;                                                   \
        }
        CUDA_DRIVER_ENTRY_POINTS(CUDA_DRIVER_LOOKUP)
#undef CUDA_DRIVER_LOOKUP

        r = cu->cuDriverGetVersion(&cu->version);
        if (r != CUDA_SUCCESS) {
                set_message(ret_message, "CUDA driver at %s does not report its version: %s.", cu->path,
                     cuda_result_name(cu, r));
                return -EPROTONOSUPPORT;
        }
        if (cu->version < CUDA_DRIVER_MIN_VERSION) {
                set_message(ret_message,
                     "CUDA driver too old: %s supports CUDA %d.%d; vmmbroker needs %d.%d or newer. Upgrade the "
                     "NVIDIA driver.",
                     cu->path, cu->version / 1000, cu->version % 1000 / 10, CUDA_DRIVER_MIN_VERSION / 1000,
                     CUDA_DRIVER_MIN_VERSION % 1000 / 10);
                return -EPROTONOSUPPORT;
        }

        r = cu->cuInit(0);
        if (r != CUDA_SUCCESS) {
                set_message(ret_message,
                     "No CUDA device: cuInit failed with %s. Check that the NVIDIA kernel module is loaded and "
                     "that /dev/nvidia* is accessible.",
                     cuda_result_name(cu, r));
                return -ENODEV;
        }
        r = cu->cuDeviceGetCount(&count);
        if (r != CUDA_SUCCESS || count <= 0) {
                set_message(ret_message, "No CUDA device: the driver at %s reports %d devices%s%s.", cu->path,
                     r == CUDA_SUCCESS ? count : 0, r == CUDA_SUCCESS ? "" : ", ",
                     r == CUDA_SUCCESS ? "" : cuda_result_name(cu, r));
                return -ENODEV;
        }

        *ret = TAKE_PTR(cu);
        return 0;
}

static int device_attribute(CudaDriver *cu, CUdevice dev, CUdevice_attribute attr, int *ret) {
        CUresult r = cu->cuDeviceGetAttribute(ret, attr, dev);
        return r == CUDA_SUCCESS ? 0 : cuda_result_to_errno(r);
}

int cuda_device_numa_node(CudaDriver *cu, CUdevice dev) {
        int node = -1;

        if (device_attribute(cu, dev, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, &node) < 0 || node < 0)
                return -1;
        return node;
}

int cuda_device_probe(CudaDriver *cu, int index, CudaDeviceInfo *ret, char **ret_message) {
        CUmemAllocationProp prop;
        CudaDeviceInfo info = { .index = index };
        int count = 0, vmm = 0, posix_fd = 0;
        size_t total = 0, gran = 0;
        CUresult r;
        int k;

        r = cu->cuDeviceGetCount(&count);
        if (r != CUDA_SUCCESS)
                count = 0;
        if (index < 0 || index >= count) {
                set_message(ret_message, "No CUDA device %d: the driver reports %d device%s (0 to %d).", index, count,
                     count == 1 ? "" : "s", count - 1);
                return -ENODEV;
        }
        r = cu->cuDeviceGet(&info.device, index);
        if (r != CUDA_SUCCESS) {
                set_message(ret_message, "Cannot open CUDA device %d: %s.", index, cuda_result_name(cu, r));
                return -ENODEV;
        }
        r = cu->cuDeviceGetName(info.name, sizeof(info.name), info.device);
        if (r != CUDA_SUCCESS)
                snprintf(info.name, sizeof(info.name), "device %d", index);
        r = cu->cuDeviceTotalMem(&total, info.device);
        if (r == CUDA_SUCCESS)
                info.total_memory = total;

        k = device_attribute(cu, info.device, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, &vmm);
        info.vmm = k == 0 && vmm;
        k = device_attribute(cu, info.device, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                             &posix_fd);
        info.posix_fd = k == 0 && posix_fd;
        info.numa_node = cuda_device_numa_node(cu, info.device);

        if (info.vmm) {
                prop = cuda_slab_prop(info.device);
                r = cu->cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
                if (r == CUDA_SUCCESS)
                        info.granularity = gran;
        }
        *ret = info;

        if (!info.vmm) {
                set_message(ret_message,
                     "CUDA device %d (%s) does not support virtual memory management "
                     "(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0); the broker cannot serve it.",
                     index, info.name);
                return -EOPNOTSUPP;
        }
        if (!info.posix_fd) {
                set_message(ret_message,
                     "CUDA device %d (%s) does not support POSIX file descriptor handles "
                     "(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED is 0); the broker cannot "
                     "pass its memory to other processes.",
                     index, info.name);
                return -EOPNOTSUPP;
        }
        if (info.granularity == 0 || !IS_POWER_OF_2(info.granularity)) {
                set_message(ret_message, "CUDA device %d (%s) reports an unusable allocation granularity (%zu).", index,
                     info.name, gran);
                return -EOPNOTSUPP;
        }
        return 0;
}

/* Unmaps n slabs mapped back to back from va; returns their total size. Sets *ret to the first error. */
static uint64_t unmap_slabs(CudaDriver *cu, CUdeviceptr va, const uint64_t *sizes, size_t n, int *ret) {
        uint64_t offset = 0;

        for (size_t i = 0; i < n; i++) {
                CUresult r = cu->cuMemUnmap(va + offset, sizes[i]);

                if (r != CUDA_SUCCESS && *ret == 0)
                        *ret = cuda_result_to_errno(r);
                offset += sizes[i];
        }
        return offset;
}

int cuda_unmap(CudaDriver *cu, CUdeviceptr va, const uint64_t *sizes, size_t n) {
        uint64_t total;
        int ret = 0;
        CUresult r;

        total = unmap_slabs(cu, va, sizes, n, &ret);
        r = cu->cuMemAddressFree(va, total);
        if (r != CUDA_SUCCESS && ret == 0)
                ret = cuda_result_to_errno(r);
        return ret;
}

CUresult cuda_set_access(CudaDriver *cu, CUdeviceptr va, uint64_t size, const CUdevice *devices, size_t n,
                         bool readonly) {
        _cleanup_free_ CUmemAccessDesc *access = NULL;

        if (n == 0)
                return CUDA_ERROR_INVALID_VALUE;
        access = calloc(n, sizeof(*access));
        if (!access)
                return CUDA_ERROR_OUT_OF_MEMORY;
        for (size_t i = 0; i < n; i++)
                access[i] = (CUmemAccessDesc){
                        .location = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = devices[i] },
                        .flags = readonly ? CU_MEM_ACCESS_FLAGS_PROT_READ : CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                };
        return cu->cuMemSetAccess(va, size, access, n);
}

int cuda_unmap_slabs(CudaDriver *cu, CUdeviceptr va, const uint64_t *sizes, size_t n) {
        int ret = 0;

        (void)unmap_slabs(cu, va, sizes, n, &ret);
        return ret;
}

int cuda_map_fds_at(CudaDriver *cu, const CUdevice *devices, size_t n_devices, const int *fds,
                    const uint64_t *sizes, size_t n, bool readonly, CUdeviceptr va, char **ret_message) {
        uint64_t total = 0;
        size_t mapped = 0;
        CUresult r;

        if (n == 0 || n_devices == 0)
                return -EINVAL;
        for (; mapped < n; mapped++) {
                CUmemGenericAllocationHandle h;

                r = cu->cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)fds[mapped],
                                                       CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
                if (r != CUDA_SUCCESS) {
                        set_message(ret_message, "Cannot import slab %zu (fd %d): %s.", mapped, fds[mapped],
                             cuda_result_name(cu, r));
                        goto fail;
                }
                r = cu->cuMemMap(va + total, sizes[mapped], 0, h, 0);
                (void)cu->cuMemRelease(h);
                if (r != CUDA_SUCCESS) {
                        set_message(ret_message, "Cannot map slab %zu (%" PRIu64 " bytes): %s.", mapped, sizes[mapped],
                             cuda_result_name(cu, r));
                        goto fail;
                }
                total += sizes[mapped];
        }
        r = cuda_set_access(cu, va, total, devices, n_devices, readonly);
        if (r != CUDA_SUCCESS) {
                set_message(ret_message, "Cannot set access to %" PRIu64 " bytes of device memory: %s.", total,
                     cuda_result_name(cu, r));
                goto fail;
        }
        return 0;

fail:
        (void)unmap_slabs(cu, va, sizes, mapped, &(int){ 0 });
        return cuda_result_to_errno(r);
}

int cuda_map_fds(CudaDriver *cu, CUdevice device, const int *fds, const uint64_t *sizes, size_t n,
                 bool readonly, CUdeviceptr *ret_va, char **ret_message) {
        uint64_t total = 0;
        CUdeviceptr va = 0;
        CUresult r;
        int k;

        if (n == 0)
                return -EINVAL;
        for (size_t i = 0; i < n; i++) {
                if (sizes[i] == 0 || total + sizes[i] < total)
                        return -EINVAL;
                total += sizes[i];
        }

        r = cu->cuMemAddressReserve(&va, total, cuda_slab_alignment(sizes[0]), 0, 0);
        if (r != CUDA_SUCCESS) {
                set_message(ret_message, "Cannot reserve %" PRIu64 " bytes of device address space: %s.", total,
                     cuda_result_name(cu, r));
                return cuda_result_to_errno(r);
        }
        k = cuda_map_fds_at(cu, &device, 1, fds, sizes, n, readonly, va, ret_message);
        if (k < 0) {
                (void)cu->cuMemAddressFree(va, total);
                return k;
        }
        *ret_va = va;
        return 0;
}
