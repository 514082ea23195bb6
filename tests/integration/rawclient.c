/* SPDX-License-Identifier: MIT */

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <grp.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "harness.h"
#include "json.h"
#include "rawclient.h"

int conn_open(const char *path, VarlinkConn **ret) {
        return harness_conn_open(path, true, ret);
}

void reply_done(Reply *r) {
        json_object_put(r->params);
        free(r->error);
        close_many(r->fds, r->n_fds);
        free(r->fds);
        *r = (Reply){};
}

/* A string member of the reply's parameters, or NULL. */
const char *reply_str(const Reply *r, const char *key) {
        json_object *v;

        if (!r->params || !json_object_object_get_ex(r->params, key, &v) || !json_object_is_type(v, json_type_string))
                return NULL;
        return json_object_get_string(v);
}

/* Calls `method` with `params` (borrowed; NULL is {}) and waits for the reply. Returns 0 or a negative errno. */
int call_send(VarlinkConn *c, const char *method, json_object *params, bool more) {
        _cleanup_(json_object_putp) json_object *msg = NULL;
        int k;

        k = varlink_call_new(method, params, false, more, &msg);
        if (k < 0)
                return k;
        k = varlink_conn_send(c, msg, NULL, 0);
        if (k < 0)
                return k;
        return varlink_conn_flush(c);
}

int reply_read(VarlinkConn *c, Reply *ret, bool *ret_continues) {
        _cleanup_(json_object_putp) json_object *reply = NULL;
        VarlinkReply vr = {};
        int *fds = NULL;
        size_t n_fds = 0;
        int k;

        *ret = (Reply){};
        k = varlink_conn_receive(c, &reply, &fds, &n_fds);
        if (k < 0)
                return k;
        if (k == 0)
                return -ECONNRESET;
        k = varlink_reply_parse(reply, &vr);
        if (k < 0) {
                close_many(fds, n_fds);
                free(fds);
                return k;
        }
        ret->error = TAKE_PTR(vr.error);
        ret->params = vr.parameters ? TAKE_PTR(vr.parameters) : json_object_new_object();
        ret->fds = fds;
        ret->n_fds = n_fds;
        if (ret_continues)
                *ret_continues = vr.continues;
        varlink_reply_done(&vr);
        return ret->params ? 0 : -ENOMEM;
}

int reclaim_request_read(VarlinkConn *c, ReclaimRequest *ret) {
        bool continues = false;
        Reply r;
        int k;

        *ret = (ReclaimRequest){};
        k = reply_read(c, &r, &continues);
        if (k < 0)
                return k;
        if (r.error || !continues || r.n_fds > 0)
                k = r.error ? -EREMOTEIO : -EPROTO;
        else
                k = reclaim_request_decode(r.params, ret, NULL);
        reply_done(&r);
        return k;
}

int watch_reclaim(VarlinkConn *c) {
        ReclaimRequest q;
        int k = call_send(c, VMMB_METHOD_WATCH_RECLAIM, NULL, true);

        if (k >= 0)
                k = reclaim_request_read(c, &q);
        if (k >= 0 && q.id)
                k = -EPROTO;            /* the first reply says the watch is on, and asks for nothing */
        reclaim_request_done(&q);
        return k;
}

int call(VarlinkConn *c, const char *method, json_object *params, Reply *ret) {
        int k = call_send(c, method, params, false);

        *ret = (Reply){};
        return k < 0 ? k : reply_read(c, ret, NULL);
}

int alloc_wait_send(VarlinkConn *c, uint64_t size, uint64_t wait_usec) {
        _cleanup_(json_object_putp) json_object *params = NULL;
        AllocParams a = { .size = size, .device = VMMB_DEVICE_ANY, .wait_usec = (int64_t)wait_usec };
        int k = alloc_params_encode(&a, &params);

        return k < 0 ? k : call_send(c, VMMB_METHOD_ALLOC, params, false);
}

/* Like call(), with the parameters written as JSON text (NULL is {}). */
int call_text(VarlinkConn *c, const char *method, const char *params, Reply *ret) {
        _cleanup_(json_object_putp) json_object *p = NULL;

        if (params) {
                p = json_tokener_parse(params);
                if (!p)
                        return -EINVAL;
        }
        return call(c, method, p, ret);
}

int status_call(VarlinkConn *c, StatusReply *ret) {
        _cleanup_(varlink_text_done) VarlinkText call = {};
        VarlinkReply vr = {};
        bool decoded = false;
        const char *text;
        size_t len;
        int k;

        *ret = (StatusReply){};
        /* written as text, as the client library writes its Alloc and Free calls */
        k = varlink_call_write(&call, VMMB_METHOD_STATUS, NULL, NULL, false, false);
        if (k >= 0)
                k = varlink_conn_send_text(c, &call, NULL, 0);
        if (k >= 0)
                k = varlink_conn_flush(c);
        if (k >= 0)
                k = varlink_conn_receive_text(c, &text, &len, NULL, NULL);
        if (k < 0)
                return k;
        k = status_reply_parse_text(text, len, &vr, ret, &decoded);
        if (k < 0)
                return k;
        if (vr.error || vr.continues) {
                if (decoded)
                        status_reply_done(ret);
                k = vr.error ? -EREMOTEIO : -EPROTO;
        } else if (decoded)
                k = 0;
        else
                k = VARLINK_PARAMETERS_DECODE(status_reply, &vr, ret, NULL);
        varlink_reply_done(&vr);
        return k;
}

/* Closes the lease's fds (a mapping keeps the memory); the rest stays for cuda_unmap(). */
void test_lease_close(TestLease *l) {
        close_many(l->fds, l->n);
}

int lease_take(Reply *r, TestLease *ret) {
        _cleanup_free_ char *message = NULL;
        AllocReply ar = {};
        int k;

        k = alloc_reply_decode(r->params, r->n_fds, &ar, &message);
        if (k < 0) {
                fprintf(stderr, "Bad lease reply: %s\n", message ?: strerror(-k));
                return k;
        }
        *ret = (TestLease){ .size = ar.lease.size, .n = ar.lease.n_slabs, .readonly = ar.lease.readonly };
        snprintf(ret->id, sizeof(ret->id), "%s", ar.lease.id);
        for (size_t j = 0; j < ar.lease.n_slabs; j++) {
                ret->fds[j] = r->fds[ar.lease.slabs[j].fd];
                r->fds[ar.lease.slabs[j].fd] = -EBADF;
                ret->sizes[j] = ar.lease.slabs[j].size;
        }
        alloc_reply_done(&ar);
        return 0;
}

/* Allocs `size` bytes. Returns 0, a negative errno, or -EREMOTEIO for an error reply (printed). */
int lease_alloc(VarlinkConn *c, uint64_t size, TestLease *ret) {
        _cleanup_(json_object_putp) json_object *params = NULL;
        AllocParams a = { .size = size, .device = VMMB_DEVICE_ANY };
        Reply r;
        int k;

        k = alloc_params_encode(&a, &params);
        if (k < 0)
                return k;
        k = call(c, VMMB_METHOD_ALLOC, params, &r);
        if (k < 0)
                return k;
        if (r.error) {
                fprintf(stderr, "Alloc(%" PRIu64 ") failed: %s %s\n", size, r.error,
                        json_object_to_json_string(r.params));
                reply_done(&r);
                return -EREMOTEIO;
        }
        k = lease_take(&r, ret);
        reply_done(&r);
        return k;
}

/* Frees a lease by id; returns 0, a negative errno, or -EREMOTEIO for an error reply. */
int lease_free(VarlinkConn *c, const char *id) {
        _cleanup_(json_object_putp) json_object *params = NULL;
        FreeParams f = { .id = (char *)id };
        Reply r;
        int k;

        k = free_params_encode(&f, &params);
        if (k < 0)
                return k;
        k = call(c, VMMB_METHOD_FREE, params, &r);
        if (k < 0)
                return k;
        if (r.error) {
                fprintf(stderr, "Free(%s) failed: %s\n", id, r.error);
                k = -EREMOTEIO;
        }
        reply_done(&r);
        return k;
}

/* The caller's leases (List{all}) on a fresh connection. */
int list_get(const char *socket, bool all, ListReply *ret) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        _cleanup_(json_object_putp) json_object *params = NULL;
        ListParams lp = { .all = all };
        Reply r;
        int k;

        k = conn_open(socket, &c);
        if (k < 0)
                return k;
        k = list_params_encode(&lp, &params);
        if (k < 0)
                return k;
        k = call(c, VMMB_METHOD_LIST, params, &r);
        if (k < 0)
                return k;
        if (r.error) {
                reply_done(&r);
                return -EREMOTEIO;
        }
        k = list_reply_decode(r.params, ret, NULL);
        reply_done(&r);
        return k;
}

const WireLeaseInfo *list_find(const ListReply *l, const char *id) {
        for (size_t i = 0; i < l->n_leases; i++)
                if (strcmp(l->leases[i].id, id) == 0)
                        return &l->leases[i];
        return NULL;
}

/* Writes one byte to a pipe. */
int pipe_put(int fd, char c) {
        return write(fd, &c, 1) == 1 ? 0 : -EIO;
}

/* Reads up to len bytes from a pipe, waiting at most IO_TIMEOUT_S. Returns the count (0 at EOF) or -errno. */
ssize_t pipe_get(int fd, void *buf, size_t len) {
        struct pollfd p = { .fd = fd, .events = POLLIN };
        ssize_t n;
        int k;

        do
                k = poll(&p, 1, IO_TIMEOUT_S * 1000);
        while (k < 0 && errno == EINTR);
        if (k < 0)
                return -errno;
        if (k == 0)
                return -ETIMEDOUT;
        do
                n = read(fd, buf, len);
        while (n < 0 && errno == EINTR);
        return n < 0 ? -errno : n;
}

/* Reads exactly len bytes. */
int pipe_get_all(int fd, void *buf, size_t len) {
        size_t got = 0;

        while (got < len) {
                ssize_t n = pipe_get(fd, (char *)buf + got, len - got);

                if (n < 0)
                        return (int)n;
                if (n == 0)
                        return -EPIPE;
                got += (size_t)n;
        }
        return 0;
}

/* Waits until the other side closes the pipe (a barrier: the test closes it to release every child at once). */
int pipe_wait_eof(int fd) {
        char c;
        ssize_t n = pipe_get(fd, &c, 1);

        return n == 0 ? 0 : n < 0 ? (int)n : -EBADMSG;
}

/*
 * In a forked client: closes every fd but stdio and `keep`, so that no child holds a pipe end meant for
 * another (a barrier or a hold pipe would never see EOF) and no child keeps the test's own connections.
 */
int close_all_but(const int *keep, size_t n_keep) {
        _cleanup_free_ int *fds = NULL;
        size_t n = 0, alloc = 0;
        struct dirent *de;
        DIR *d;

        d = opendir("/proc/self/fd");
        if (!d)
                return -errno;
        while ((de = readdir(d))) {
                int fd = atoi(de->d_name);
                bool kept = fd < 3 || fd == dirfd(d) || de->d_name[0] == '.';

                for (size_t i = 0; i < n_keep && !kept; i++)
                        kept = keep[i] == fd;
                if (kept)
                        continue;
                if (n == alloc) {
                        int *p = realloc(fds, (alloc = alloc * 2 + 16) * sizeof(int));

                        if (!p) {
                                closedir(d);
                                return -ENOMEM;
                        }
                        fds = p;
                }
                fds[n++] = fd;
        }
        closedir(d);
        close_many(fds, n);
        return 0;
}

int gpu_open(Gpu *g) {
        _cleanup_free_ char *message = NULL;
        CUcontext ctx = NULL;
        CUresult r;
        int k;

        *g = (Gpu){};
        k = cuda_driver_open(&g->cu, NULL, &message);
        if (k < 0) {
                fprintf(stderr, "cuda_driver_open: %s\n", message ?: strerror(-k));
                return k;
        }
        r = g->cu->cuDeviceGet(&g->dev, 0);
        if (r == CUDA_SUCCESS) {
                r = g->cu->cuDevicePrimaryCtxRetain(&ctx, g->dev);
                g->retained = r == CUDA_SUCCESS;
        }
        if (r == CUDA_SUCCESS)
                r = g->cu->cuCtxSetCurrent(ctx);
        if (r != CUDA_SUCCESS) {
                fprintf(stderr, "Cannot make device 0's primary context current: %s\n", cuda_result_name(g->cu, r));
                return -EIO;
        }
        return 0;
}

void gpu_close(Gpu *g) {
        if (g->retained)
                (void)g->cu->cuDevicePrimaryCtxRelease(g->dev);
        cuda_driver_close(g->cu);
        *g = (Gpu){};
}

int gpu_map(Gpu *g, const TestLease *l, CUdeviceptr *ret) {
        _cleanup_free_ char *message = NULL;
        int k = cuda_map_fds(g->cu, g->dev, l->fds, l->sizes, l->n, l->readonly, ret, &message);

        if (k < 0)
                fprintf(stderr, "cuda_map_fds: %s\n", message ?: strerror(-k));
        return k;
}

/* Reads the whole lease back and checks that every 32-bit word is `word`. Returns 0 or 1. */
int gpu_verify(Gpu *g, CUdeviceptr va, uint64_t size, uint32_t word) {
        _cleanup_free_ uint32_t *buf = malloc(size);
        CUresult r;

        CHILD_CHECK(buf, "out of memory");
        memset(buf, 0x5A, size);        /* not the pattern, not zero: a copy that does nothing shows */
        r = g->cu->cuMemcpyDtoH(buf, va, size);
        CHILD_CHECK(r == CUDA_SUCCESS, "cuMemcpyDtoH: %s", cuda_result_name(g->cu, r));
        for (uint64_t i = 0; i < size / 4; i++)
                CHILD_CHECK(buf[i] == word, "word %" PRIu64 " of %" PRIu64 " is 0x%08x, expected 0x%08x", i,
                            size / 4, buf[i], word);
        return 0;
}


int held_child_start(int (*fn)(void *arg), void *arg, int *child_report_w, int *child_hold_r, void *report, size_t len,
               HeldChild *ret) {
        int report_pipe[2], hold_pipe[2], k;

        *ret = (HeldChild){ .pid = -1, .report_r = -EBADF, .hold_w = -EBADF };
        if (pipe2(report_pipe, O_CLOEXEC) < 0)
                return -errno;
        if (pipe2(hold_pipe, O_CLOEXEC) < 0) {
                k = -errno;
                close_many(report_pipe, 2);
                return k;
        }
        *child_report_w = report_pipe[1];
        *child_hold_r = hold_pipe[0];
        ret->pid = harness_fork(fn, arg);
        safe_close(report_pipe[1]);
        safe_close(hold_pipe[0]);
        ret->report_r = report_pipe[0];
        ret->hold_w = hold_pipe[1];
        if (ret->pid < 0)
                return -ECHILD;
        return pipe_get_all(ret->report_r, report, len);
}

int held_child_finish(HeldChild *x) {
        int k;

        x->hold_w = safe_close(x->hold_w);
        k = harness_wait(x->pid);
        x->report_r = safe_close(x->report_r);
        return k;
}

/* --- another user's connections ----------------------------------------------------------------------- */

#define CONNECTOR_HOLD_MS 110000        /* a connector gives up holding (below meson's 120 s) */

typedef struct ConnectorArgs {
        const char *socket;
        uid_t uid;
        unsigned n;
        int sock_w, hold_r;
} ConnectorArgs;

static int child_connector(void *arg) {
        ConnectorArgs *a = arg;
        int fds[CONNECTOR_MAX];
        struct pollfd p;
        char x = 'c';
        int k;

        CHILD_CHECK(close_all_but((const int[]){ a->sock_w, a->hold_r }, 2) == 0, "close fds");
        if (a->uid != getuid())
                CHILD_CHECK(setgroups(0, NULL) == 0 && setresgid(a->uid, a->uid, a->uid) == 0 &&
                            setresuid(a->uid, a->uid, a->uid) == 0, "cannot become uid %u: %m", (unsigned)a->uid);
        for (unsigned i = 0; i < a->n; i++) {
                fds[i] = harness_connect(a->socket);
                CHILD_CHECK(fds[i] >= 0, "connection %u of uid %u: %s", i, (unsigned)a->uid, strerror(-fds[i]));
        }
        CHILD_CHECK(fd_send(a->sock_w, &x, 1, fds, a->n) == 1, "passing the connections: %m");
        close_many(fds, a->n);
        /* The holder of whatever is leased on them: alive until the test closes the hold pipe (or kills it). */
        p = (struct pollfd){ .fd = a->hold_r, .events = POLLIN };
        do
                k = poll(&p, 1, CONNECTOR_HOLD_MS);
        while (k < 0 && errno == EINTR);
        CHILD_CHECK(k == 1, "never released");
        return 0;
}

int connector_open(const char *socket, uid_t uid, unsigned n, Connector *x, VarlinkConn **ret) {
        struct timeval tv = { .tv_sec = IO_TIMEOUT_S };
        int sp[2], hold[2], fds[CONNECTOR_MAX];
        size_t n_fds = 0;
        unsigned made = 0;
        int k = 0;
        char c;

        if (n == 0 || n > CONNECTOR_MAX)
                return -EINVAL;
        if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sp) < 0)
                return -errno;
        if (pipe2(hold, O_CLOEXEC) < 0) {
                k = -errno;
                close_many(sp, 2);
                return k;
        }
        (void)setsockopt(sp[0], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        x->pid = harness_fork(child_connector, &(ConnectorArgs){ .socket = socket, .uid = uid, .n = n,
                                                                 .sock_w = sp[1], .hold_r = hold[0] });
        close_many((int[]){ sp[1], hold[0] }, 2);
        x->hold_w = hold[1];
        if (x->pid <= 0 || fd_recv(sp[0], &c, 1, fds, CONNECTOR_MAX, &n_fds) != 1 || n_fds != n)
                k = -EPIPE;
        safe_close(sp[0]);
        for (; k == 0 && made < n; made++)
                k = varlink_conn_new(&ret[made], fds[made], VARLINK_MAX_REPLY, true);
        if (k < 0) {
                for (unsigned i = 0; i < made; i++)
                        ret[i] = varlink_conn_free(ret[i]);
                if (made < n_fds)
                        close_many(fds + made, n_fds - made);
                if (x->pid > 0)
                        (void)connector_close(x);
        }
        return k;
}

int connector_close(Connector *x) {
        x->hold_w = safe_close(x->hold_w);
        return harness_wait(x->pid);
}
