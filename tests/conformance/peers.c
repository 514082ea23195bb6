/* SPDX-License-Identifier: MIT */

/*
 * The second process of the checks that need one. The test re-executes this
 * binary as `vmmb-conformance --peer ROLE FD` (a fresh process: CUDA does not
 * survive fork), with FD one end of a socketpair. The peer opens the driver,
 * does what its role says, sends one report (PeerMsg with ok set, and what
 * failed in text) and exits 0 when everything succeeded, 1 otherwise.
 */

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "conformance.h"

/*
 * "import": receives {size, seed A, seed B} and an fd; imports it, maps it,
 * checks pattern A, writes pattern B, and releases everything.
 */
static bool peer_import(int sock, PeerMsg *report) {
        _cleanup_close_ int fd = -EBADF;
        CUmemGenericAllocationHandle h;
        CUdeviceptr va;
        PeerMsg req;
        bool ok;

        if (!msg_recv(sock, &req, &fd))
                return false;
        if (fd < 0)
                return set_why("No fd came with the request.");
        if (!mem_import(fd, &h))
                return false;
        if (!mem_map(h, req.size, &va)) {
                (void)mem_release(h);
                return false;
        }
        ok = mem_check_pattern(va, req.size, req.seed[0], "the importer's mapping, before it wrote") &&
             mem_write_pattern(va, req.size, req.seed[1]);
        ok = mem_unmap(va, req.size) && ok;
        ok = mem_release(h) && ok;
        return ok;
}

/*
 * "export-and-exit": receives {size, seed A}; creates an allocation, writes
 * pattern A, exports it, sends the fd, then releases its handle, unmaps, and
 * (after its report) exits: only the fd in flight keeps the memory.
 */
static bool peer_export_and_exit(int sock, PeerMsg *report) {
        _cleanup_close_ int fd = -EBADF;
        PeerMsg req, carrier = { .magic = PEER_MAGIC, .ok = 1 };
        CUmemGenericAllocationHandle h;
        CUdeviceptr va;
        bool ok;

        if (!msg_recv(sock, &req, NULL))
                return false;
        if (!mem_create(req.size, &h))
                return false;
        if (!mem_map(h, req.size, &va)) {
                (void)mem_release(h);
                return false;
        }
        ok = mem_write_pattern(va, req.size, req.seed[0]) && mem_export(h, &fd) && msg_send(sock, &carrier, fd);
        fd = safe_close(fd);
        ok = mem_release(h) && ok;
        ok = mem_unmap(va, req.size) && ok;
        return ok;
}

/*
 * "import-twice": receives two messages, each carrying the same exported fd
 * (sent twice by the test, so two descriptors here); imports both, maps each
 * in its own range, checks pattern A through both, writes pattern B through
 * the second and checks it through the first.
 */
static bool peer_import_twice(int sock, PeerMsg *report) {
        int fds[2] = { -EBADF, -EBADF };
        CUmemGenericAllocationHandle h[2];
        CUdeviceptr va[2];
        size_t imported = 0, mapped = 0;
        PeerMsg req[2];
        bool ok = true;

        for (size_t i = 0; i < 2 && ok; i++) {
                ok = msg_recv(sock, &req[i], &fds[i]);
                if (ok && fds[i] < 0)
                        ok = set_why("No fd came with message %zu.", i + 1);
        }
        for (size_t i = 0; i < 2 && ok; i++)
                if ((ok = mem_import(fds[i], &h[i])))
                        imported++;
        for (size_t i = 0; i < 2 && ok; i++)
                if ((ok = mem_map(h[i], req[0].size, &va[i])))
                        mapped++;

        ok = ok && mem_check_pattern(va[0], req[0].size, req[0].seed[0], "the first import's mapping");
        ok = ok && mem_check_pattern(va[1], req[0].size, req[0].seed[0], "the second import's mapping");
        ok = ok && mem_write_pattern(va[1], req[0].size, req[0].seed[1]);
        ok = ok && mem_check_pattern(va[0], req[0].size, req[0].seed[1],
                                     "the first import's mapping, after writing through the second");

        for (size_t i = 0; i < mapped; i++)
                ok = mem_unmap(va[i], req[0].size) && ok;
        for (size_t i = 0; i < imported; i++)
                ok = mem_release(h[i]) && ok;
        for (size_t i = 0; i < 2; i++)
                fds[i] = safe_close(fds[i]);
        return ok;
}

/*
 * "no-access": receives {size}; creates and maps an allocation but does not
 * call cuMemSetAccess, then copies into it. Reports the copy's result and
 * that of the cuCtxSynchronize after it in result[0] and result[1]. This runs
 * in a peer because the error may be sticky and poison the context.
 */
static bool peer_no_access(int sock, PeerMsg *report) {
        _cleanup_free_ uint32_t *buf = NULL;
        CUmemGenericAllocationHandle h;
        CUdeviceptr va = 0;
        PeerMsg req;

        if (!msg_recv(sock, &req, NULL))
                return false;
        buf = malloc(req.size);
        if (!buf)
                return set_why("Cannot allocate %zu bytes.", (size_t)req.size);
        pattern_fill(buf, 0, req.size / sizeof(uint32_t), req.seed[0]);
        if (!mem_create(req.size, &h))
                return false;
        if (!mem_reserve(req.size, &va) || !CU(gpu.cu->cuMemMap(va, req.size, 0, h, 0))) {
                (void)mem_release(h);
                return false;
        }
        report->result[0] = gpu.cu->cuMemcpyHtoD(va, buf, req.size);
        report->result[1] = gpu.cu->cuCtxSynchronize();
        /* The context may be broken now: clean up as far as it lets us, and do not judge. */
        (void)gpu.cu->cuMemUnmap(va, req.size);
        (void)gpu.cu->cuMemAddressFree(va, req.size);
        (void)gpu.cu->cuMemRelease(h);
        return true;
}

/*
 * "pair-no-access" and "pair-read-only-write": receive {size, seed A}; create an allocation on the suite's
 * device and map it, with access for that device only ("no-access") or read-only access for the pair's other
 * device too; then memset it through the other device's context. Report the memset's result and that of the
 * cuCtxSynchronize after it in result[0] and result[1]. In a peer because a fault may be sticky.
 */
static bool peer_pair_write(int sock, PeerMsg *report, bool readonly) {
        CUmemGenericAllocationHandle h;
        CUdeviceptr va = 0;
        CUcontext ctx;
        CUdevice other;
        PeerMsg req;
        int count;

        if (!msg_recv(sock, &req, NULL))
                return false;
        if (!gpu_pair_device(&other, &count))
                return set_why("The driver has %d device(s); the pair checks need two.", count);
        if (!mem_create(req.size, &h))
                return false;
        if (!mem_reserve(req.size, &va) || !CU(gpu.cu->cuMemMap(va, req.size, 0, h, 0)) ||
            !(readonly ? CU(mem_set_access_pair(va, req.size, other, true)) : mem_set_access(va, req.size)) ||
            !gpu_enter_device(other, &ctx)) {
                (void)gpu.cu->cuMemUnmap(va, req.size);
                (void)gpu.cu->cuMemAddressFree(va, req.size);
                (void)mem_release(h);
                return false;
        }
        report->result[0] = gpu.cu->cuMemsetD32(va, req.seed[0], req.size / sizeof(uint32_t));
        report->result[1] = gpu.cu->cuCtxSynchronize();
        /* The other device's context may be broken now: clean up as far as it lets us, and do not judge. */
        (void)gpu_leave_device();
        (void)gpu.cu->cuDevicePrimaryCtxRelease(other);
        (void)gpu.cu->cuMemUnmap(va, req.size);
        (void)gpu.cu->cuMemAddressFree(va, req.size);
        (void)gpu.cu->cuMemRelease(h);
        return true;
}

static bool peer_pair_no_access(int sock, PeerMsg *report) {
        return peer_pair_write(sock, report, false);
}

static bool peer_pair_read_only_write(int sock, PeerMsg *report) {
        return peer_pair_write(sock, report, true);
}

/*
 * A gate on a stream: a host function that blocks the stream until the peer
 * opens it, or GATE_TIMEOUT_S passes (so that a driver call that waited for
 * the stream would come back, late, rather than hang).
 */
#define GATE_TIMEOUT_S 5

typedef struct Gate {
        pthread_mutex_t lock;
        pthread_cond_t cond;
        bool open;
        bool entered, left, timed_out;
} Gate;

static void CUDA_CB gate_wait(void *userdata) {
        Gate *g = userdata;
        struct timespec deadline;

        /* No CUDA calls in here: a host function must not make any. */
        (void)clock_gettime(CLOCK_REALTIME, &deadline);
        deadline.tv_sec += GATE_TIMEOUT_S;
        (void)pthread_mutex_lock(&g->lock);
        g->entered = true;
        while (!g->open && !g->timed_out)
                if (pthread_cond_timedwait(&g->cond, &g->lock, &deadline) == ETIMEDOUT)
                        g->timed_out = true;
        g->left = true;
        (void)pthread_mutex_unlock(&g->lock);
}

static void gate_open(Gate *g) {
        (void)pthread_mutex_lock(&g->lock);
        g->open = true;
        (void)pthread_cond_broadcast(&g->cond);
        (void)pthread_mutex_unlock(&g->lock);
}

static bool gate_left(Gate *g) {
        bool left;

        (void)pthread_mutex_lock(&g->lock);
        left = g->left;
        (void)pthread_mutex_unlock(&g->lock);
        return left;
}

/*
 * "unmap-queued": receives {size}; maps an allocation of that size, and on a
 * stream queues a gate (a host function that blocks the stream until opened)
 * and behind it UNMAP_QUEUED_MEMSETS memsets of the whole range. With them
 * all still queued, it unmaps the range, then opens the gate and synchronizes
 * the stream. Reports cuMemUnmap's result in result[0], cuStreamSynchronize's
 * in result[1], and in `size` 1 when the unmap returned only after the gate
 * had let the stream go on (it waited for the stream), else 0. This runs in a
 * peer: the memsets fault, and the error is sticky for the peer's context.
 */
#define UNMAP_QUEUED_MEMSETS 8

static bool peer_unmap_queued(int sock, PeerMsg *report) {
        Gate gate = { .lock = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER };
        CUmemGenericAllocationHandle h;
        CUstream stream = NULL;
        CUdeviceptr va = 0;
        PeerMsg req;
        bool left;

        if (!msg_recv(sock, &req, NULL))
                return false;
        if (!mem_create(req.size, &h))
                return false;
        if (!mem_map(h, req.size, &va)) {
                (void)mem_release(h);
                return false;
        }
        if (!CU(gpu.cu->cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING)))
                goto fail;
        if (!CU(gpu.cu->cuLaunchHostFunc(stream, gate_wait, &gate)))
                goto fail;
        for (int i = 0; i < UNMAP_QUEUED_MEMSETS; i++)
                if (!CU(gpu.cu->cuMemsetD32Async(va, UINT32_C(0x0dd0beef) + (uint32_t)i, req.size / 4, stream))) {
                        gate_open(&gate);
                        goto fail;
                }
        if (gate_left(&gate)) {
                gate_open(&gate);
                (void)set_why("The gate on the stream timed out before the memsets were queued.");
                goto fail;
        }

        report->result[0] = gpu.cu->cuMemUnmap(va, req.size);
        left = gate_left(&gate);        /* the stream went on before cuMemUnmap returned: it waited */
        report->size = left ? 1 : 0;
        gate_open(&gate);
        report->result[1] = gpu.cu->cuStreamSynchronize(stream);

        /* The context is broken now, if the memsets faulted: clean up as far as it lets us, and do not judge. */
        (void)gpu.cu->cuStreamDestroy(stream);
        if (report->result[0] != CUDA_SUCCESS)
                (void)gpu.cu->cuMemUnmap(va, req.size);
        (void)gpu.cu->cuMemAddressFree(va, req.size);
        (void)gpu.cu->cuMemRelease(h);
        return true;

fail:
        if (stream) {
                (void)gpu.cu->cuStreamSynchronize(stream);
                (void)gpu.cu->cuStreamDestroy(stream);
        }
        (void)mem_unmap(va, req.size);
        (void)mem_release(h);
        return false;
}

static const struct {
        const char *name;
        bool (*run)(int sock, PeerMsg *report);
        bool may_break_context; /* a failed gpu_close() is expected, not a failure */
} roles[] = {
        { "import", peer_import, false },
        { "export-and-exit", peer_export_and_exit, false },
        { "import-twice", peer_import_twice, false },
        { "no-access", peer_no_access, true },
        { "unmap-queued", peer_unmap_queued, true },
        { "pair-no-access", peer_pair_no_access, true },
        { "pair-read-only-write", peer_pair_read_only_write, true },
};

int peer_main(const char *role, int sock) {
        PeerMsg report = { .magic = PEER_MAGIC };
        bool ok, closed;
        size_t i;

        for (i = 0; i < ELEMENTSOF(roles); i++)
                if (strcmp(roles[i].name, role) == 0)
                        break;
        if (i == ELEMENTSOF(roles)) {
                fprintf(stderr, "vmmb-conformance: unknown peer role \"%s\"\n", role);
                return 2;
        }

        why_reset();
        ok = gpu_open() && roles[i].run(sock, &report);
        closed = gpu_close();
        if (!closed && !roles[i].may_break_context)
                ok = false;
        report.ok = ok;
        if (!ok)
                snprintf(report.text, sizeof(report.text), "peer \"%s\": %s", role, why);
        if (!msg_send(sock, &report, -1)) {
                fprintf(stderr, "vmmb-conformance: peer \"%s\": %s\n", role, why);
                return 1;
        }
        sock = safe_close(sock);
        return ok ? 0 : 1;
}
