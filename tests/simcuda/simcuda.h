/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Test hooks of the simulated CUDA device (tests/simcuda, see its README).
 *
 * The library is dlopen()ed like the real driver, so a test looks the hooks
 * up with dlsym() on the library the driver layer loaded:
 *
 *     void *lib = dlopen(cu->path, RTLD_NOW | RTLD_NOLOAD);
 *     __typeof__(&simcuda_fail) fail = (__typeof__(&simcuda_fail))dlsym(lib, "simcuda_fail");
 *
 * Every hook is thread-safe and works before cuInit().
 */

#include <stdint.h>

/*
 * While held (hold != 0), work queued on created streams waits, host
 * functions included; cuStreamQuery() says CUDA_ERROR_NOT_READY and anything
 * that waits for those streams blocks. hold == 0 lets it run.
 * SIMCUDA_HOLD_NO_WAIT holds them too, and any call that would wait for held
 * work (cuStreamSynchronize(), cuEventSynchronize(), cuCtxSynchronize(), and
 * an operation on the NULL stream, which waits for the blocking streams)
 * aborts the process instead, saying which: for a test of code that must not
 * wait, which then fails at once rather than hanging until its timeout.
 */
#define SIMCUDA_HOLD_NO_WAIT 2
void simcuda_hold_streams(int hold);

/*
 * While held (hold != 0), a stream whose next operation is a device-to-device
 * copy (cuMemcpyDtoDAsync) waits before it; other streams run on.
 */
void simcuda_hold_copies(int hold);

/* Allocations alive in this process: those that a handle or a mapping refers to. */
unsigned long simcuda_live_allocations(void);

/* Bytes charged to a device's memory budget in this process; 0 for a device that does not exist. */
uint64_t simcuda_charged(int device);

/* Bytes charged to the host memory budget (SIMCUDA_HOST_MEMORY, host-NUMA allocations) in this process. */
uint64_t simcuda_host_charged(void);

/*
 * Appends fault rules, in the syntax of $SIMCUDA_FAIL: a comma-separated list
 * of ENTRY:N[:ERROR], "the Nth call of ENTRY from now fails with ERROR".
 * Returns 0, or -EINVAL for a bad spec (then nothing is added).
 */
int simcuda_fail(const char *spec);

/* Drops every pending fault rule. */
void simcuda_reset_faults(void);

/* How many times an entry point ("cuMemCreate") was called in this process; 0 for an unknown name. */
uint64_t simcuda_calls(const char *entry);
