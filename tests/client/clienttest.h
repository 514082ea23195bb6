/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * What the client tests (libvmmbroker against the real daemon on the simulated device) share: the driver the
 * test process opens for itself, with device 0's primary context current, to write and read the memory the
 * library leases; the library's calls in forms that fail the test; the daemon's own account of the leases,
 * over a connection of the test's own; and forked children, which never assert (Check's assertions belong to
 * the test process) but report with CHILD_CHECK and their exit status.
 */

#include <stdbool.h>
#include <stdint.h>

#include "codec.h"
#include "driver.h"
#include "rawclient.h"
#include "vmmbroker.h"

#define MiB (UINT64_C(1) << 20)
#define NOBODY 65534

/* In a forked child: rawclient.h's CHILD_CHECK, with the library's message of the last failure. */
#undef CHILD_CHECK
#define CHILD_CHECK(cond, ...)                                                                          \
        do {                                                                                            \
                if (!(cond)) {                                                                          \
                        fprintf(stderr, "child %d: %s:%d: ", (int)getpid(), __FILE__, __LINE__);        \
                        fprintf(stderr, __VA_ARGS__);                                                   \
                        fprintf(stderr, " (%s)\n", vmmb_error_message());                               \
                        return 1;                                                                       \
                }                                                                                       \
        } while (0)

/*
 * The driver this process opened (driver_open_or_fail()), NULL before; and device 0's primary context,
 * current in the thread that opened it. Other threads and forked children make it current themselves.
 */
extern CudaDriver *cu;
extern CUcontext ctx;

/* Opens the driver ($VMMBROKER_LIBCUDA) into `cu` and makes device 0's primary context current; fails the test
 * where it cannot. */
void driver_open_or_fail(void);

/* Makes no context current, releases device 0's primary context and closes the driver; nothing if none is open. */
void driver_close(void);

/* The simulated device's test hook `name` (simcuda.h) in the open driver, or NULL: a real driver has none. Valid
 * until driver_close(). */
void *driver_hook(const char *name);

/* Whether the driver counts its calls (simcuda_calls()): the simulated device does, a real driver does not. */
bool driver_counts(void);

/* How many times the driver's `entry` was called in this process, as the simulated device counts; 0 on a real
 * driver, which counts nothing (driver_counts()). */
uint64_t driver_calls(const char *entry);

/* Whether forked children cannot use the driver this process opened (only the simulated device's survives a
 * fork); if so, says on stderr that `test` is not run. */
bool skip_fork_on_real_driver(const char *test);

/* Runs fn(arg) in a forked child (harness_fork()) and fails the test unless it exited with status 0. */
void run_child(int (*fn)(void *arg), void *arg);

/* In a forked child of root: becomes uid and gid NOBODY, with no supplementary groups. 0, or 1 (said). */
int drop_to_nobody(void);

/* A forked child's start: drops to NOBODY when `as_nobody`, makes `ctx` current, connects to `socket` into *ret.
 * 0, or 1 (said). */
int child_open(const char *socket, bool as_nobody, vmmb_client **ret);

/* vmmb_connect() to `socket`; fails the test unless it returned a client. */
vmmb_client *connect_or_fail(const char *socket);

/* vmmb_alloc() of `size` bytes on `device` (or VMMB_ANY_DEVICE) with `label` (NULL: none); fails the test unless
 * it returned a lease. */
vmmb_lease *alloc_or_fail(vmmb_client *c, uint64_t size, int device, const char *label);

/* Writes `value` to every 32-bit word of the lease and waits until it is written. */
void fill(vmmb_lease *l, uint32_t value);

/* Whether every 32-bit word of the lease reads `value`; fails the test where the lease cannot be read. */
bool lease_reads(vmmb_lease *l, uint32_t value);

/* Whether every 32-bit word of the `size` bytes at `ptr` reads `value` (false where they cannot be read); for
 * forked children too. */
bool words_are(uint64_t ptr, uint64_t size, uint32_t value);

/* Device 0 as the Status of the daemon at `socket` shows it (its name left NULL); fails the test unless it
 * answered. */
WireDevice daemon_device(const char *socket);

/* The leases of device 0 of the daemon at `socket`, over all holders. */
uint64_t daemon_leases(const char *socket);

/* What the daemon's List says of this user's leases, and of one of them. */
typedef struct Listed {
        size_t n_leases;                /* how many it lists */
        bool found;                     /* whether it lists the lease asked about; then: */
        bool kept;
        size_t n_holders;
        char label[VMMB_LABEL_MAX + 1]; /* "" for none */
} Listed;

/* What the List of the daemon at `socket` (this user's leases) says, of lease `id` too unless it is NULL; fails
 * the test unless it answered. */
Listed daemon_list(const char *socket, const char *id);
