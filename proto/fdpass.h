/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * File descriptors over AF_UNIX sockets (SCM_RIGHTS). One call is one
 * sendmsg()/recvmsg(); the fds ride on the first byte of the data sent with
 * them. Receivers always use MSG_CMSG_CLOEXEC and treat truncated control data
 * (MSG_CTRUNC) as a protocol error.
 */

#include <stddef.h>
#include <sys/types.h>

/* The kernel's limit on fds in one message (SCM_MAX_FD). */
#define FDPASS_MAX_FDS 253

/*
 * Sends `len` bytes (len > 0) with `n_fds` fds attached to the first byte, in
 * one sendmsg(MSG_NOSIGNAL). Returns the number of bytes sent (possibly fewer
 * than len: the fds went with the first of them), or a negative errno.
 */
ssize_t fd_send(int sock, const void *buf, size_t len, const int *fds, size_t n_fds);

/*
 * Receives up to `len` bytes and up to `max_fds` fds, in one recvmsg().
 * Returns the bytes received (0 at end of stream) and the fds in
 * fds[0..*ret_n_fds), or a negative errno: -EPROTO when the control data was
 * truncated or carried something other than SCM_RIGHTS, in which case every
 * fd that did arrive has been closed.
 */
ssize_t fd_recv(int sock, void *buf, size_t len, int *fds, size_t max_fds, size_t *ret_n_fds);

/* Closes fds[0..n) and sets each to -EBADF. */
void close_many(int *fds, size_t n);
