/* SPDX-License-Identifier: MIT */

/*
 * Helpers shared by the conformance checks and their peers; see conformance.h.
 */

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "conformance.h"
#include "fdpass.h"

Gpu gpu;
char why[WHY_MAX];

void why_reset(void) {
        why[0] = '\0';
}

bool set_why(const char *fmt, ...) {
        va_list ap;

        if (why[0] != '\0')
                return false;   /* the first failure is the one worth reading */
        va_start(ap, fmt);
        (void)vsnprintf(why, sizeof(why), fmt, ap);
        va_end(ap);
        return false;
}

const char *result_name(CUresult r, char *buf, size_t len) {
        snprintf(buf, len, "%s", cuda_result_name(gpu.cu, r));
        return buf;
}

bool cu_ok(CUresult r, const char *call) {
        char name[RESULT_NAME_MAX];

        if (r == CUDA_SUCCESS)
                return true;
        return set_why("%s failed: %s", call, result_name(r, name, sizeof(name)));
}

void observe(const char *check, CUresult r) {
        char name[RESULT_NAME_MAX];

        observe_text(check, result_name(r, name, sizeof(name)));
}

void observe_text(const char *check, const char *outcome) {
        /* stderr is unbuffered: the line is out even if the test dies next. */
        fprintf(stderr, "observed: %s -> %s\n", check, outcome);
}

int conformance_device_index(void) {
        const char *e = getenv(CONFORMANCE_DEVICE_ENV);
        char *end = NULL;
        long v;

        if (!e || !*e)
                return 0;
        errno = 0;
        v = strtol(e, &end, 10);
        if (errno != 0 || !end || *end != '\0' || v < 0 || v > INT_MAX)
                return -EINVAL;
        return (int)v;
}

bool gpu_open(void) {
        _cleanup_free_ char *message = NULL;
        int index, k;

        index = conformance_device_index();
        if (index < 0)
                return set_why("%s=%s is not a device index.", CONFORMANCE_DEVICE_ENV,
                               getenv(CONFORMANCE_DEVICE_ENV));
        k = cuda_driver_open(&gpu.cu, NULL, &message);
        if (k < 0)
                return set_why("cuda_driver_open: %s", message ? message : strerror(-k));
        k = cuda_device_probe(gpu.cu, index, &gpu.info, &message);
        if (k < 0)
                return set_why("cuda_device_probe: %s", message ? message : strerror(-k));
        gpu.granularity = gpu.info.granularity;
        if (!CU(gpu.cu->cuDevicePrimaryCtxRetain(&gpu.ctx, gpu.info.device)))
                return false;
        gpu.retained = true;
        return CU(gpu.cu->cuCtxSetCurrent(gpu.ctx));
}

bool gpu_close(void) {
        bool ok = true;

        if (!gpu.cu)
                return true;
        if (gpu.retained) {
                ok = CU(gpu.cu->cuCtxSetCurrent(NULL)) && ok;
                ok = CU(gpu.cu->cuDevicePrimaryCtxRelease(gpu.info.device)) && ok;
                gpu.retained = false;
        }
        gpu.cu = cuda_driver_close(gpu.cu);
        return ok;
}

bool gpu_pair_device(CUdevice *ret, int *ret_count) {
        int count = 0;

        *ret_count = 0;
        if (!CU(gpu.cu->cuDeviceGetCount(&count)))
                return false;
        *ret_count = count;
        if (count < 2)
                return false;
        *ret = (gpu.info.device + 1) % count;
        return true;
}

bool gpu_enter_device(CUdevice dev, CUcontext *ret) {
        if (!CU(gpu.cu->cuDevicePrimaryCtxRetain(ret, dev)))
                return false;
        if (!CU(gpu.cu->cuCtxSetCurrent(*ret))) {
                (void)gpu.cu->cuDevicePrimaryCtxRelease(dev);
                return false;
        }
        return true;
}

bool gpu_leave_device(void) {
        return CU(gpu.cu->cuCtxSetCurrent(gpu.ctx));
}

CUresult mem_set_access_pair(CUdeviceptr va, size_t size, CUdevice peer, bool peer_readonly) {
        CUmemAccessDesc access[2] = {
                { .location = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = gpu.info.device },
                  .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE },
                { .location = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = peer },
                  .flags = peer_readonly ? CU_MEM_ACCESS_FLAGS_PROT_READ : CU_MEM_ACCESS_FLAGS_PROT_READWRITE },
        };

        return gpu.cu->cuMemSetAccess(va, size, access, 2);
}

bool mem_create(size_t size, CUmemGenericAllocationHandle *ret) {
        CUmemAllocationProp prop = cuda_slab_prop(gpu.info.device);

        return CU(gpu.cu->cuMemCreate(ret, size, &prop, 0));
}

bool mem_create_host(size_t size, CUmemGenericAllocationHandle *ret) {
        CUmemAllocationProp prop = cuda_host_prop(gpu.info.numa_node);

        return CU(gpu.cu->cuMemCreate(ret, size, &prop, 0));
}

bool mem_export(CUmemGenericAllocationHandle handle, int *ret_fd) {
        int fd = -EBADF;

        if (!CU(gpu.cu->cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)))
                return false;
        if (fd < 0)
                return set_why("cuMemExportToShareableHandle succeeded but returned fd %d.", fd);
        *ret_fd = fd;
        return true;
}

bool mem_import(int fd, CUmemGenericAllocationHandle *ret) {
        return CU(gpu.cu->cuMemImportFromShareableHandle(ret, (void *)(uintptr_t)fd,
                                                         CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
}

bool mem_reserve(size_t size, CUdeviceptr *ret) {
        return CU(gpu.cu->cuMemAddressReserve(ret, size, gpu.granularity, 0, 0));
}

bool mem_set_access(CUdeviceptr va, size_t size) {
        CUmemAccessDesc access = {
                .location = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = gpu.info.device },
                .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };

        return CU(gpu.cu->cuMemSetAccess(va, size, &access, 1));
}

bool mem_map(CUmemGenericAllocationHandle handle, size_t size, CUdeviceptr *ret) {
        CUdeviceptr va = 0;

        if (!mem_reserve(size, &va))
                return false;
        if (!CU(gpu.cu->cuMemMap(va, size, 0, handle, 0))) {
                (void)gpu.cu->cuMemAddressFree(va, size);
                return false;
        }
        if (!mem_set_access(va, size)) {
                (void)mem_unmap(va, size);
                return false;
        }
        *ret = va;
        return true;
}

bool mem_unmap(CUdeviceptr va, size_t size) {
        bool ok;

        ok = CU(gpu.cu->cuMemUnmap(va, size));
        ok = CU(gpu.cu->cuMemAddressFree(va, size)) && ok;
        return ok;
}

bool mem_release(CUmemGenericAllocationHandle handle) {
        return CU(gpu.cu->cuMemRelease(handle));
}

uint32_t pattern_word(uint32_t seed, size_t index) {
        /* Knuth's multiplicative hash of the index: neighbouring words and pages differ. */
        return seed ^ (uint32_t)(index * UINT64_C(2654435761));
}

void pattern_fill(uint32_t *words, size_t first, size_t n, uint32_t seed) {
        for (size_t i = first; i < first + n; i++)
                words[i] = pattern_word(seed, i);
}

bool pattern_check(const uint32_t *words, size_t first, size_t n, uint32_t seed, const char *what) {
        for (size_t i = first; i < first + n; i++)
                if (words[i] != pattern_word(seed, i))
                        return set_why("%s: byte offset %zu holds 0x%08" PRIx32 ", the pattern (seed 0x%08" PRIx32
                                       ") has 0x%08" PRIx32 ".",
                                       what, i * sizeof(uint32_t), words[i], seed, pattern_word(seed, i));
        return true;
}

bool fill_check(const uint32_t *words, size_t first, size_t n, uint32_t value, const char *what) {
        for (size_t i = first; i < first + n; i++)
                if (words[i] != value)
                        return set_why("%s: byte offset %zu holds 0x%08" PRIx32 ", expected 0x%08" PRIx32 ".", what,
                                       i * sizeof(uint32_t), words[i], value);
        return true;
}

static uint32_t *host_buffer(size_t size) {
        uint32_t *p = malloc(size);

        if (!p)
                set_why("Cannot allocate a %zu-byte host buffer.", size);
        return p;
}

bool mem_write_pattern(CUdeviceptr va, size_t size, uint32_t seed) {
        _cleanup_free_ uint32_t *buf = host_buffer(size);

        if (!buf)
                return false;
        pattern_fill(buf, 0, size / sizeof(uint32_t), seed);
        /* From pageable memory the copy may return before the DMA is done: wait for it. */
        return CU(gpu.cu->cuMemcpyHtoD(va, buf, size)) && CU(gpu.cu->cuCtxSynchronize());
}

bool mem_read(CUdeviceptr va, size_t size, uint32_t **ret) {
        uint32_t *buf = host_buffer(size);

        if (!buf)
                return false;
        if (!CU(gpu.cu->cuMemcpyDtoH(buf, va, size))) {
                free(buf);
                return false;
        }
        *ret = buf;
        return true;
}

bool mem_check_pattern(CUdeviceptr va, size_t size, uint32_t seed, const char *what) {
        _cleanup_free_ uint32_t *buf = NULL;

        return mem_read(va, size, &buf) && pattern_check(buf, 0, size / sizeof(uint32_t), seed, what);
}

bool mem_check_fill(CUdeviceptr va, size_t size, uint32_t value, const char *what) {
        _cleanup_free_ uint32_t *buf = NULL;

        return mem_read(va, size, &buf) && fill_check(buf, 0, size / sizeof(uint32_t), value, what);
}

bool msg_send(int sock, const PeerMsg *m, int fd) {
        size_t sent;
        ssize_t n;

        n = fd_send(sock, m, sizeof(*m), fd >= 0 ? &fd : NULL, fd >= 0 ? 1 : 0);
        if (n < 0)
                return set_why("Sending to the other process: %s.", strerror((int)-n));
        for (sent = (size_t)n; sent < sizeof(*m); sent += (size_t)n) {
                n = send(sock, (const char *)m + sent, sizeof(*m) - sent, MSG_NOSIGNAL);
                if (n < 0 && errno == EINTR) {
                        n = 0;
                        continue;
                }
                if (n <= 0)
                        return set_why("Sending to the other process: %s.", n < 0 ? strerror(errno) : "short write");
        }
        return true;
}

bool msg_recv(int sock, PeerMsg *m, int *ret_fd) {
        int fds[1] = { -EBADF };
        size_t n_fds = 0, got;
        ssize_t n;

        /* At most sizeof(*m) bytes: never the start of the next message, nor its fds. */
        n = fd_recv(sock, m, sizeof(*m), fds, ELEMENTSOF(fds), &n_fds);
        if (n < 0)
                return set_why("Receiving from the other process: %s.", strerror((int)-n));
        if (n == 0)
                return set_why("The other process closed its socket before sending what it should have.");
        for (got = (size_t)n; got < sizeof(*m); got += (size_t)n) {
                n = recv(sock, (char *)m + got, sizeof(*m) - got, 0);
                if (n < 0 && errno == EINTR) {
                        n = 0;
                        continue;
                }
                if (n <= 0) {
                        close_many(fds, n_fds);
                        return set_why("Receiving from the other process: %s.",
                                       n < 0 ? strerror(errno) : "the socket closed in the middle of a message");
                }
        }
        if (m->magic != PEER_MAGIC) {
                close_many(fds, n_fds);
                return set_why("Received a message with magic 0x%08" PRIx32 ".", m->magic);
        }
        m->text[sizeof(m->text) - 1] = '\0';
        if (!ret_fd) {
                if (n_fds > 0) {
                        close_many(fds, n_fds);
                        return set_why("Received an fd with a message that should have none.");
                }
                return true;
        }
        *ret_fd = n_fds > 0 ? fds[0] : -EBADF;
        return true;
}
