/* SPDX-License-Identifier: MIT */
#pragma once

/**
 * libvmmbroker: lease GPU memory from vmmbrokerd.
 *
 * A client connects to the broker, asks for device memory and gets a lease:
 * the daemon sends the lease's slabs as file descriptors, and the library
 * imports them, maps them back to back into one reserved device address
 * range, sets access for the whole range and closes the descriptors. The
 * caller uses the pointer like any device memory from cuMemAlloc.
 *
 * The memory reads zero when leased. It stays the caller's until
 * vmmb_free() or until the process exits; closing the connection alone does
 * not end a lease.
 *
 * Errors are negative errno values; vmmb_error_message() gives the daemon's
 * or the library's sentence for the calling thread's last failure. Every
 * function may be called from several threads at once on the same client
 * (calls on one client take turns on its connection), except vmmb_close(),
 * which must be the client's last call. The library never logs.
 */

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** A connection to the broker. */
typedef struct vmmb_client vmmb_client;

/** Device memory leased from the broker and mapped into this process. */
typedef struct vmmb_lease vmmb_lease;

/** The broker's socket when neither the caller nor $VMMBROKER_SOCKET names one. */
#define VMMB_DEFAULT_SOCKET "/run/vmmbroker/io.vmmbroker"

/** Pass as `device` to vmmb_alloc() for the first device the broker serves. */
#define VMMB_ANY_DEVICE (-1)

/**
 * vmmb_connect() - connect to the broker.
 * @socket_path: the broker's socket; NULL for $VMMBROKER_SOCKET, else VMMB_DEFAULT_SOCKET.
 * @ret: the new client, on success.
 *
 * Also loads the CUDA driver (libcuda.so.1, or $VMMBROKER_LIBCUDA) the first
 * time a client is made in the process.
 *
 * Return: 0, or a negative errno: -ENOENT or -ECONNREFUSED when no broker
 * listens there, -EACCES when the caller may not connect (not in the
 * vmmbroker group), -ENODEV when the CUDA driver cannot be loaded (the
 * answer stays for the life of the process), -EINVAL for an empty path,
 * -ENAMETOOLONG for a path too long for a Unix socket.
 */
int vmmb_connect(const char *socket_path, vmmb_client **ret);

/**
 * vmmb_close() - close the connection and free the client.
 * @client: the client, or NULL.
 *
 * Every lease still held through this client is freed first, as by
 * vmmb_free(): do not use their pointers afterwards, nor the lease objects.
 * Must be the last call on the client: no other thread may be using it or
 * its leases. Leaves vmmb_error_message() as it was.
 */
void vmmb_close(vmmb_client *client);

/**
 * vmmb_alloc() - lease device memory.
 * @client: the client.
 * @size: bytes wanted, more than 0; the broker rounds it up to the device's granularity (2 MiB).
 * @device: CUDA device index, or VMMB_ANY_DEVICE.
 * @label: a label that `vmmctl list` shows, or NULL; at most 128 bytes of printable UTF-8
 *         (a longer one is refused; other characters are replaced when sent).
 * @ret: the lease, mapped read-write and zeroed, on success.
 *
 * The received slab descriptors are always closed. If the memory cannot be
 * mapped, the lease is given back to the broker before returning the error.
 *
 * Return: 0, or a negative errno: -ENOMEM when the device has no room,
 * -ENODEV for a device the broker does not serve, -EINVAL for a bad
 * parameter (a size of 0 or more than the device can serve, a label too
 * long), -EDQUOT over a limit of the calling user, -EIO when the driver
 * failed, -ECONNRESET when the connection to the broker was lost (now or by
 * an earlier call: the client stays unusable), -EPROTO when the broker's
 * reply makes no sense.
 */
int vmmb_alloc(vmmb_client *client, uint64_t size, int device, const char *label, vmmb_lease **ret);

/**
 * vmmb_free() - end a lease.
 * @lease: the lease, or NULL.
 *
 * Unmaps the memory (synchronously: the driver waits for work using it; the
 * library does not synchronize a context of its own), then tells the broker,
 * which scrubs it and reuses it. The lease object is freed in every case.
 * When telling the broker fails (-ECONNRESET), the broker reclaims the memory
 * when this process exits. When unmapping fails, the broker is not told, as
 * the memory may still be mapped here; it too comes back at exit.
 *
 * Return: 0, or a negative errno from the unmapping or from the broker.
 */
int vmmb_free(vmmb_lease *lease);

/**
 * vmmb_lease_ptr() - the lease's device address.
 * @lease: the lease.
 *
 * Return: the start of the mapping, a CUdeviceptr (usable as a device pointer).
 */
uint64_t vmmb_lease_ptr(const vmmb_lease *lease);

/**
 * vmmb_lease_size() - the lease's size.
 * @lease: the lease.
 *
 * Return: bytes mapped at vmmb_lease_ptr(): the request rounded up.
 */
uint64_t vmmb_lease_size(const vmmb_lease *lease);

/**
 * vmmb_lease_device() - the lease's device.
 * @lease: the lease.
 *
 * Return: the CUDA device index of the memory.
 */
int vmmb_lease_device(const vmmb_lease *lease);

/**
 * vmmb_lease_id() - the lease's identifier, as `vmmctl list` shows it.
 * @lease: the lease.
 *
 * Return: a string owned by the lease.
 */
const char *vmmb_lease_id(const vmmb_lease *lease);

/**
 * vmmb_error_message() - what went wrong in the calling thread's last failed call.
 *
 * Every failing call sets the calling thread's message (vmmb_close() aside);
 * successful calls leave it as it was, so check return values, not this.
 *
 * Return: a sentence for a person (the broker's own message when it refused a
 * request), valid until the thread's next call into the library; "" if no
 * call has failed in this thread.
 */
const char *vmmb_error_message(void);

#ifdef __cplusplus
}
#endif
