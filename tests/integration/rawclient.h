/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * A raw client for the integration tests: calls over proto's VarlinkConn and
 * codecs, leases as fds, pipes between the test and its forked clients, and
 * the (simulated) GPU in a child. Nothing here asserts: functions return a
 * negative errno (-EREMOTEIO for an error reply where a success was wanted)
 * and children report failures with CHILD_CHECK and their exit status.
 */

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "codec.h"
#include "driver.h"
#include "fdpass.h"
#include "macro.h"
#include "varlink.h"

#include <json-c/json.h>

#define IO_TIMEOUT_S 30                 /* failure guard on every blocking socket and pipe read */

/* In a child: unless cond, prints where and why and returns 1 (its exit status). */
#define CHILD_CHECK(cond, ...)                                                                          \
        do {                                                                                            \
                if (!(cond)) {                                                                          \
                        fprintf(stderr, "child %d: %s:%d: ", (int)getpid(), __FILE__, __LINE__);        \
                        fprintf(stderr, __VA_ARGS__);                                                   \
                        fputc('\n', stderr);                                                            \
                        return 1;                                                                       \
                }                                                                                       \
        } while (0)

DEFINE_TRIVIAL_CLEANUP_FUNC(VarlinkConn, varlink_conn_free);

/* A reply: its parameters (never NULL), its error name (NULL on success) and the fds that came with it. */
typedef struct Reply {
        json_object *params;
        char *error;
        int *fds;
        size_t n_fds;
} Reply;

/* A lease as a client holds it: the fds in mapping order. */
typedef struct TestLease {
        char id[VMMB_ID_MAX + 1];
        uint64_t size;
        size_t n;
        int fds[FDPASS_MAX_FDS];
        uint64_t sizes[FDPASS_MAX_FDS];
        bool readonly;                  /* the reply said so: gpu_map() maps it read-only */
} TestLease;

/* Device 0 of the driver (the simulated one in CI), its primary context current. */
typedef struct Gpu {
        CudaDriver *cu;
        CUdevice dev;
        bool retained;
} Gpu;

/* A connection to the daemon that accepts fds (harness_conn_open()). */
int conn_open(const char *path, VarlinkConn **ret);

/* Frees a reply and closes its fds. */
void reply_done(Reply *r);

/* A string member of the reply's parameters, or NULL. */
const char *reply_str(const Reply *r, const char *key);

/* Calls `method` with `params` (borrowed; NULL is {}) and waits for the reply. Returns 0 or a negative errno. */
int call(VarlinkConn *c, const char *method, json_object *params, Reply *ret);

/* Sends a call of `method` (`more`: "more": true) without reading its reply. Returns 0 or a negative errno. */
int call_send(VarlinkConn *c, const char *method, json_object *params, bool more);

/* Reads the next reply (blocking, with the socket's timeout); *ret_continues (if given) says whether it said
 * "continues". Returns 0, -ECONNRESET when the daemon closed the connection, or a negative errno. */
int reply_read(VarlinkConn *c, Reply *ret, bool *ret_continues);

/* Reads the next reply of a watch (WatchReclaim) into *ret: 0, -EREMOTEIO for an error reply, -EPROTO for one
 * that is not a request, or a negative errno. *ret is a request's (its id set) or the first reply's (no id). */
int reclaim_request_read(VarlinkConn *c, ReclaimRequest *ret);

/* Calls WatchReclaim ("more") on `c` and reads its first reply: 0 once the watch is on, or a negative errno. */
int watch_reclaim(VarlinkConn *c);

/* Sends an Alloc of `size` on any device that may wait `wait_usec` for room, without reading its reply. */
int alloc_wait_send(VarlinkConn *c, uint64_t size, uint64_t wait_usec);

/* Like call(), with the parameters written as JSON text (NULL is {}). */
int call_text(VarlinkConn *c, const char *method, const char *params, Reply *ret);

/*
 * A Status as the client library makes a call and reads its reply (client_call_full()): the call written as
 * text (varlink_call_write(), as alloc_params_write() writes Alloc's) and sent, the reply read as text with its parameters in the same pass
 * (status_reply_parse_text(), as the library reads Alloc's with alloc_reply_parse_text()), or decoded after
 * it where that pass cannot (status_reply_decode_text()). Returns 0 with the reply in *ret (free it with
 * status_reply_done()), -EREMOTEIO for an error reply, -EPROTO for a reply with "continues", or a negative
 * errno.
 */
int status_call(VarlinkConn *c, StatusReply *ret);

/* Closes the lease's fds (a mapping keeps the memory); the rest stays for cuda_unmap(). */
void test_lease_close(TestLease *l);

/* Takes the lease of an Alloc or Attach reply: its fds move from the reply to *ret. Returns 0 or -errno. */
int lease_take(Reply *r, TestLease *ret);

/* Allocs `size` bytes. Returns 0, a negative errno, or -EREMOTEIO for an error reply (printed). */
int lease_alloc(VarlinkConn *c, uint64_t size, TestLease *ret);

/* Frees a lease by id; returns 0, a negative errno, or -EREMOTEIO for an error reply. */
int lease_free(VarlinkConn *c, const char *id);

/* The caller's leases (every lease with `all`) on a fresh connection. */
int list_get(const char *socket, bool all, ListReply *ret);

/* The lease with that identifier in a List reply, or NULL. */
const WireLeaseInfo *list_find(const ListReply *l, const char *id);

/* Writes one byte to a pipe. */
int pipe_put(int fd, char c);

/* Reads up to len bytes from a pipe, waiting at most IO_TIMEOUT_S. Returns the count (0 at EOF) or -errno. */
ssize_t pipe_get(int fd, void *buf, size_t len);

/* Reads exactly len bytes. */
int pipe_get_all(int fd, void *buf, size_t len);

/* Waits until the other side closes the pipe (a barrier: the test closes it to release every child at once). */
int pipe_wait_eof(int fd);

/*
 * In a forked client: closes every fd but stdio and `keep`, so that no child holds a pipe end meant for
 * another (a barrier or a hold pipe would never see EOF) and no child keeps the test's own connections.
 */
int close_all_but(const int *keep, size_t n_keep);

/* A forked client that reports once through a pipe, then holds what it has until its hold pipe closes. */
typedef struct HeldChild {
        pid_t pid;
        int report_r, hold_w;           /* the test's ends */
} HeldChild;

/*
 * Makes the two pipes, writes the child's ends into *child_report_w and *child_hold_r (members of `arg`),
 * forks fn(arg) (harness_fork()), and reads `len` bytes of its report into `report`. Returns 0 or a
 * negative errno (-EPIPE: the child exited without reporting).
 */
int held_child_start(int (*fn)(void *arg), void *arg, int *child_report_w, int *child_hold_r, void *report, size_t len,
               HeldChild *ret);

/* Closes the hold pipe (the child goes on and exits) and returns its exit status, as harness_wait(). */
int held_child_finish(HeldChild *x);

/*
 * Another user's connections: a forked process that becomes `uid` (setgroups, setresgid, setresuid; the test
 * runs as root for any other uid), makes `n` connections to `socket` and hands them over, then stays alive
 * (the holder of whatever is leased on them) until connector_close() or a kill.
 */
#define CONNECTOR_MAX 64

typedef struct Connector {
        pid_t pid;
        int hold_w;
} Connector;

/* Starts one and takes its `n` connections (at most CONNECTOR_MAX) as VarlinkConns (replies up to
 * VARLINK_MAX_REPLY, fds accepted) into ret[]. Returns 0 or a negative errno (the child's stderr says why). */
int connector_open(const char *socket, uid_t uid, unsigned n, Connector *x, VarlinkConn **ret);

/* Lets it exit; returns its exit status, as harness_wait(). */
int connector_close(Connector *x);

/* Opens the driver and makes device 0's primary context current. Returns 0 or -errno (printed). */
int gpu_open(Gpu *g);

/* Releases the context and closes the driver. */
void gpu_close(Gpu *g);

/* Maps a lease's fds back to back, read-only when the lease says so. Returns 0 or -errno (printed). */
int gpu_map(Gpu *g, const TestLease *l, CUdeviceptr *ret);

/* Reads the whole lease back and checks that every 32-bit word is `word`. Returns 0 or 1. */
int gpu_verify(Gpu *g, CUdeviceptr va, uint64_t size, uint32_t word);
