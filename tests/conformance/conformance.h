/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * What the conformance checks (conformance.c) and their peer processes
 * (peers.c) share: the driver and device of this process, device memory
 * helpers, patterns, and the messages a test and its peer exchange.
 *
 * Helpers return false on failure and say why in `why` (the first failure
 * since why_reset() wins, so that clean-up steps do not hide the cause). They
 * never assert: a peer process is not a Check test and must report instead.
 */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "driver.h"
#include "macro.h"

#define MiB ((size_t)1 << 20)

/* Which device the suite uses (default 0). */
#define CONFORMANCE_DEVICE_ENV "VMMB_CONFORMANCE_DEVICE"

/* The driver, the device and its primary context, opened once per process. */
typedef struct Gpu {
        CudaDriver *cu;
        CudaDeviceInfo info;
        CUcontext ctx;
        bool retained;
        size_t granularity;     /* minimum granularity for the broker's slab properties */
} Gpu;
extern Gpu gpu;

#define WHY_MAX 512
extern char why[WHY_MAX];
void why_reset(void);
_printf_(1, 2) bool set_why(const char *fmt, ...);

/*
 * Opens the driver ($VMMBROKER_LIBCUDA, else libcuda.so.1), probes the device
 * ($VMMB_CONFORMANCE_DEVICE, else 0), retains its primary context and makes it
 * current. gpu_close() undoes it; it returns false if a step failed.
 */
int conformance_device_index(void);
bool gpu_open(void);
bool gpu_close(void);

/*
 * The other device of a pair (issue 18's peer checks): the next index after the suite's, wrapping. Returns
 * false with *ret_count set when the driver has one device (the check does not run, and says so), or on a
 * driver error (why says which).
 */
bool gpu_pair_device(CUdevice *ret, int *ret_count);
/* Retains `dev`'s primary context (released with cuDevicePrimaryCtxRelease) and makes it current. */
bool gpu_enter_device(CUdevice dev, CUcontext *ret);
/* Makes the suite's device's context current again. */
bool gpu_leave_device(void);
/* Read-write access for the suite's device and `peer` (read-write, or read-only with `peer_readonly`). */
CUresult mem_set_access_pair(CUdeviceptr va, size_t size, CUdevice peer, bool peer_readonly);

/* A CUresult's name ("CUDA_ERROR_INVALID_VALUE"), copied to buf. */
const char *result_name(CUresult r, char *buf, size_t len);
#define RESULT_NAME_MAX 64

/* Records a failed call (its source text and result) in why; returns r == CUDA_SUCCESS. */
bool cu_ok(CUresult r, const char *call);
#define CU(call) cu_ok((call), #call)

/*
 * The diffable record of what the driver did: one line on stderr,
 * "observed: <check> -> <CUresult name or outcome>".
 */
void observe(const char *check, CUresult r);
void observe_text(const char *check, const char *outcome);

/* Device memory, with the broker's slab properties (pinned, POSIX-fd exportable). */
bool mem_create(size_t size, CUmemGenericAllocationHandle *ret);
/* Host memory as the broker's host slabs have it (cuda_host_prop(): pinned, on the device's NUMA node). */
bool mem_create_host(size_t size, CUmemGenericAllocationHandle *ret);
bool mem_export(CUmemGenericAllocationHandle handle, int *ret_fd);
bool mem_import(int fd, CUmemGenericAllocationHandle *ret);
/* Reserves `size` bytes of address space aligned to the granularity. */
bool mem_reserve(size_t size, CUdeviceptr *ret);
/* Read-write access for this device to [va, va + size). */
bool mem_set_access(CUdeviceptr va, size_t size);
/* Reserves a range of the allocation's size, maps the whole allocation into it, sets access. */
bool mem_map(CUmemGenericAllocationHandle handle, size_t size, CUdeviceptr *ret);
/* cuMemUnmap then cuMemAddressFree of the same range. */
bool mem_unmap(CUdeviceptr va, size_t size);
bool mem_release(CUmemGenericAllocationHandle handle);

/*
 * Patterns: 32-bit word i of a pattern is pattern_word(seed, i), counted from
 * the start of the range written, so that any part can be checked.
 */
uint32_t pattern_word(uint32_t seed, size_t index);
void pattern_fill(uint32_t *words, size_t first, size_t n, uint32_t seed);
/* Checks words[first, first + n) against the pattern or a fill value; `what` names the memory in why. */
bool pattern_check(const uint32_t *words, size_t first, size_t n, uint32_t seed, const char *what);
bool fill_check(const uint32_t *words, size_t first, size_t n, uint32_t value, const char *what);

/* Writes the pattern to [va, va + size) with cuMemcpyHtoD and waits for it (cuCtxSynchronize). */
bool mem_write_pattern(CUdeviceptr va, size_t size, uint32_t seed);
/* Reads [va, va + size) with cuMemcpyDtoH into a new buffer (the caller frees it). */
bool mem_read(CUdeviceptr va, size_t size, uint32_t **ret);
bool mem_check_pattern(CUdeviceptr va, size_t size, uint32_t seed, const char *what);
bool mem_check_fill(CUdeviceptr va, size_t size, uint32_t value, const char *what);

/*
 * A test and its peer exchange fixed-size messages on a SOCK_STREAM socket;
 * at most one fd rides on a message (on its first byte, SCM_RIGHTS).
 */
#define PEER_MAGIC UINT32_C(0x564d4d42) /* "VMMB" */
typedef struct PeerMsg {
        uint32_t magic;
        int32_t ok;             /* report: 1 when every step the peer took succeeded */
        uint64_t size;          /* request: allocation size */
        uint32_t seed[2];       /* request: pattern seeds */
        int32_t result[2];      /* report: CUresults the check asked the peer to record */
        char text[WHY_MAX + 64]; /* report: what failed */
} PeerMsg;

/* fd < 0: no fd. */
bool msg_send(int sock, const PeerMsg *m, int fd);
/* ret_fd NULL: a message with an fd is an error; else *ret_fd is the fd or -EBADF. */
bool msg_recv(int sock, PeerMsg *m, int *ret_fd);

/* The peer side: `role` is what to do, `sock` the socket to the test. Returns the exit status. */
int peer_main(const char *role, int sock);
