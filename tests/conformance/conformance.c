/* SPDX-License-Identifier: MIT */

/*
 * The driver conformance suite: the Driver API behaviour vmmbroker relies on,
 * checked the same way against the simulated device (tests/simcuda, in CI)
 * and against the real NVIDIA driver (the same binary with VMMBROKER_LIBCUDA
 * unset). Where the two disagree, the simulator is wrong.
 *
 * Every check that expects an error asserts the CUresult the CUDA
 * documentation implies and prints what the driver returned, as
 *
 *     observed: <check> -> <CUresult name or outcome>
 *
 * on stderr, so that the lines of two runs can be diffed. A few checks are
 * report-only ("(report only)" in their line): the documentation does not
 * settle them, and the broker does not depend on the answer; they print what
 * the driver did and pass either way.
 *
 * Check runs every test in a forked process (CK_FORK, the default); the runner
 * process never loads the driver, because CUDA does not survive fork(). Each
 * test opens the driver itself (checked fixture). Checks that need a second
 * process re-execute this binary as a peer (peers.c).
 */

#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "conformance.h"
#include "fdpass.h"
#include "size.h"

#define TCASE_TIMEOUT 60

/* A helper's failure, with its reason. */
#define ASSERT_OK(expr) ck_assert_msg((expr), "%s", why)
/* A driver call that must succeed. */
#define ASSERT_CU(call) ASSERT_OK(CU(call))

#define G (gpu.granularity)

static void setup(void) {
        why_reset();
        ASSERT_OK(gpu_open());
}

static void teardown(void) {
        ASSERT_OK(gpu_close());
}

/*
 * Asserts that a result already printed with observe() is the expected one:
 * the code the CUDA documentation implies, or, where the documentation names
 * none, the code the real driver returned (each such check says so).
 */
static void assert_result(const char *check, CUresult observed, CUresult expected) {
        char o[RESULT_NAME_MAX], e[RESULT_NAME_MAX];

        ck_assert_msg(observed == expected, "%s: expected %s, the driver returned %s.", check,
                      result_name(expected, e, sizeof(e)), result_name(observed, o, sizeof(o)));
}

/* Prints the observed result, then asserts it. */
static void expect_result(const char *check, CUresult observed, CUresult expected) {
        observe(check, observed);
        assert_result(check, observed, expected);
}

static const char *size_text(size_t bytes, char *buf, size_t len) {
        return format_size(bytes, buf, len);
}

/* --- Peers: this binary again, as `--peer ROLE FD`. */

typedef struct Peer {
        pid_t pid;
        int sock;
} Peer;

static Peer peer_start(const char *role) {
        char fd_arg[16];
        char *argv[] = { program_invocation_name, (char *)"--peer", (char *)role, fd_arg, NULL };
        int sv[2];
        pid_t pid;

        ck_assert_msg(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0, "socketpair: %s",
                      strerror(errno));
        snprintf(fd_arg, sizeof(fd_arg), "%d", sv[1]);
        pid = fork();
        ck_assert_msg(pid >= 0, "fork: %s", strerror(errno));
        if (pid == 0) {
                /* The peer gets its socket and stdio, nothing else: no driver fds, no exported fds. */
                if (sv[1] > 3)
                        (void)close_range(3, (unsigned)sv[1] - 1, 0);
                (void)close_range((unsigned)sv[1] + 1, ~0U, 0);
                if (fcntl(sv[1], F_SETFD, 0) < 0)
                        _exit(127);
                execv("/proc/self/exe", argv);
                _exit(127);
        }
        (void)safe_close(sv[1]);
        return (Peer){ .pid = pid, .sock = sv[0] };
}

static const char *status_text(int status, char *buf, size_t len) {
        if (WIFEXITED(status))
                snprintf(buf, len, "exit status %d", WEXITSTATUS(status));
        else if (WIFSIGNALED(status))
                snprintf(buf, len, "signal %d (%s)", WTERMSIG(status), strsignal(WTERMSIG(status)));
        else
                snprintf(buf, len, "wait status 0x%x", (unsigned)status);
        return buf;
}

/* Receives the peer's report, waits for it to exit, and asserts that it succeeded. */
static void peer_finish(Peer *p, PeerMsg *report) {
        char status_buf[64];
        int status = 0;
        bool got;
        pid_t k;

        got = msg_recv(p->sock, report, NULL);
        p->sock = safe_close(p->sock);
        do
                k = waitpid(p->pid, &status, 0);
        while (k < 0 && errno == EINTR);
        ck_assert_msg(k == p->pid, "waitpid: %s", strerror(errno));
        ck_assert_msg(got, "No report from the peer (%s): %s", status_text(status, status_buf, sizeof(status_buf)),
                      why);
        ck_assert_msg(report->ok, "%s", report->text);
        ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "The peer reported success but ended with %s.",
                      status_text(status, status_buf, sizeof(status_buf)));
}

/* --- 1. The device. */

START_TEST(device_supports_vmm_and_fds) {
        _cleanup_free_ char *message = NULL;
        CUmemAllocationProp prop = cuda_slab_prop(gpu.info.device);
        CudaDeviceInfo info;
        char total[FORMAT_SIZE_MAX], g[FORMAT_SIZE_MAX], rg[FORMAT_SIZE_MAX];
        size_t recommended = 0;
        int k;

        k = cuda_device_probe(gpu.cu, gpu.info.index, &info, &message);
        fprintf(stderr, "info: driver %s, CUDA %d.%d\n", gpu.cu->path, gpu.cu->version / 1000,
                gpu.cu->version % 1000 / 10);
        fprintf(stderr, "info: device %d: %s, %s\n", info.index, info.name,
                size_text(info.total_memory, total, sizeof(total)));
        observe_text("virtual memory management supported", info.vmm ? "yes" : "no");
        observe_text("POSIX fd handles supported", info.posix_fd ? "yes" : "no");
        {
                /* Report only (issue 18, Placement=nearest): the host NUMA node, -1 when the driver does not know. */
                char node[32];
                int raw = -1;
                CUresult r = gpu.cu->cuDeviceGetAttribute(&raw, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, info.device);

                if (r == CUDA_SUCCESS)
                        snprintf(node, sizeof(node), "%d", raw);
                else
                        snprintf(node, sizeof(node), "%s", cuda_result_name(gpu.cu, r));
                observe_text("host NUMA node, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID (report only)", node);
                ck_assert_int_eq(info.numa_node, r == CUDA_SUCCESS && raw >= 0 ? raw : -1);
        }
        ck_assert_msg(k == 0, "cuda_device_probe: %s", message);
        ck_assert(info.vmm && info.posix_fd);

        ASSERT_CU(gpu.cu->cuMemGetAllocationGranularity(&recommended, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
        fprintf(stderr, "info: granularity: minimum %s (%zu), recommended %s (%zu)\n",
                size_text(info.granularity, g, sizeof(g)), (size_t)info.granularity,
                size_text(recommended, rg, sizeof(rg)), recommended);
        ck_assert_msg(IS_POWER_OF_2(info.granularity), "granularity %" PRIu64 " is not a power of two",
                      info.granularity);
        ck_assert_msg(recommended >= info.granularity && recommended % info.granularity == 0,
                      "recommended granularity %zu is not a multiple of the minimum %" PRIu64, recommended,
                      info.granularity);
        ck_assert_uint_gt(info.total_memory, 0);
}
END_TEST

/* --- 2. Round trip in one process. */

static void round_trip(size_t size) {
        const uint32_t seed = UINT32_C(0x2b7e1516), fill = UINT32_C(0xc0ffee11);
        const size_t words = size / sizeof(uint32_t), half = words / 2;
        _cleanup_free_ uint32_t *buf = NULL;
        CUmemGenericAllocationHandle h;
        CUdeviceptr va;
        int fd = -EBADF;

        ASSERT_OK(mem_create(size, &h));
        ASSERT_OK(mem_export(h, &fd));
        ASSERT_OK(mem_map(h, size, &va));
        ASSERT_OK(mem_write_pattern(va, size, seed));
        ASSERT_CU(gpu.cu->cuMemsetD32(va + half * sizeof(uint32_t), fill, words - half));
        ASSERT_OK(mem_read(va, size, &buf));
        ASSERT_OK(pattern_check(buf, 0, half, seed, "the first half, written with cuMemcpyHtoD"));
        ASSERT_OK(fill_check(buf, half, words - half, fill, "the second half, written with cuMemsetD32"));
        ASSERT_OK(mem_unmap(va, size));
        ASSERT_OK(mem_release(h));
        ck_assert_msg(close(fd) == 0, "closing the exported fd: %s", strerror(errno));
}

START_TEST(round_trip_2mib) {
        round_trip(2 * MiB);
}
END_TEST

START_TEST(round_trip_64mib) {
        round_trip(64 * MiB);
}
END_TEST

/* --- 3. Fresh allocations read zero. */

#define FRESH_ROUNDS 4

/*
 * Creates, fills with 0xA5 and releases an allocation, then FRESH_ROUNDS
 * times creates one of the same size, reads it, and dirties it again. Returns
 * whether every fresh allocation read zero, and prints what was seen.
 */
static bool fresh_allocations_zeroed(size_t size) {
        char what[96], s[FORMAT_SIZE_MAX], outcome[160] = "zeroed";
        bool zeroed = true;

        for (int round = 0; round <= FRESH_ROUNDS; round++) {
                CUmemGenericAllocationHandle h;
                CUdeviceptr va;

                ASSERT_OK(mem_create(size, &h));
                ASSERT_OK(mem_map(h, size, &va));
                if (round > 0) {
                        _cleanup_free_ uint32_t *buf = NULL;

                        ASSERT_OK(mem_read(va, size, &buf));
                        for (size_t i = 0; zeroed && i < size / sizeof(uint32_t); i++)
                                if (buf[i] != 0) {
                                        zeroed = false;
                                        snprintf(outcome, sizeof(outcome),
                                                 "NOT ZEROED (creation %d: word at offset %zu holds 0x%08" PRIx32 ")",
                                                 round + 1, i * sizeof(uint32_t), buf[i]);
                                }
                }
                ASSERT_CU(gpu.cu->cuMemsetD8(va, 0xa5, size));
                ASSERT_CU(gpu.cu->cuCtxSynchronize());
                ASSERT_OK(mem_unmap(va, size));
                ASSERT_OK(mem_release(h));
        }
        snprintf(what, sizeof(what), "fresh %s allocation after one filled with 0xA5 was released",
                 size_text(size, s, sizeof(s)));
        observe_text(what, outcome);
        return zeroed;
}

START_TEST(fresh_allocations_read_zero) {
        bool small = fresh_allocations_zeroed(2 * MiB);
        bool large = fresh_allocations_zeroed(64 * MiB);

        /* Both sizes are printed before judging, so that a GPU run shows both. */
        ck_assert_msg(small && large,
                      "A fresh allocation held old data (see the observed lines): the broker must scrub new slabs.");
}
END_TEST

/* --- 4. Import in another process. */

START_TEST(import_in_another_process) {
        const size_t size = 8 * MiB;
        const uint32_t seed_a = UINT32_C(0x11111111), seed_b = UINT32_C(0x2222abcd);
        PeerMsg req = { .magic = PEER_MAGIC, .size = size, .seed = { seed_a, seed_b } }, report;
        _cleanup_close_ int fd = -EBADF;
        CUmemGenericAllocationHandle h;
        CUdeviceptr va;
        Peer p;

        ASSERT_OK(mem_create(size, &h));
        ASSERT_OK(mem_export(h, &fd));
        ASSERT_OK(mem_map(h, size, &va));
        ASSERT_OK(mem_write_pattern(va, size, seed_a));

        p = peer_start("import");
        ASSERT_OK(msg_send(p.sock, &req, fd));
        peer_finish(&p, &report);

        ASSERT_OK(mem_check_pattern(va, size, seed_b, "the exporter's mapping, after the peer wrote"));
        ASSERT_OK(mem_unmap(va, size));
        ASSERT_OK(mem_release(h));
}
END_TEST

/* --- 5. An exported fd keeps the memory after its exporter released it and exited. */

START_TEST(fd_outlives_its_exporter) {
        const size_t size = 8 * MiB;
        const uint32_t seed = UINT32_C(0x5a5a0f0f);
        PeerMsg req = { .magic = PEER_MAGIC, .size = size, .seed = { seed } }, carrier, report;
        _cleanup_close_ int fd = -EBADF;
        CUmemGenericAllocationHandle h;
        CUdeviceptr va;
        Peer p;

        p = peer_start("export-and-exit");
        ASSERT_OK(msg_send(p.sock, &req, -1));
        if (!msg_recv(p.sock, &carrier, &fd) || fd < 0) {
                if (why[0] == '\0')
                        set_why("The peer's message carried no fd.");
                peer_finish(&p, &report); /* says how the peer ended */
                ck_abort_msg("%s", why);
        }
        peer_finish(&p, &report); /* returns once the exporter has exited */

        ASSERT_OK(mem_import(fd, &h));
        ASSERT_OK(mem_map(h, size, &va));
        ASSERT_OK(mem_check_pattern(va, size, seed, "memory imported after its exporter exited"));
        ASSERT_OK(mem_unmap(va, size));
        ASSERT_OK(mem_release(h));
}
END_TEST

/* --- 6. The same fd imported twice in one process. */

START_TEST(import_same_fd_twice) {
        const size_t size = 4 * MiB;
        _cleanup_close_ int fd = -EBADF;
        CUmemGenericAllocationHandle h0;
        CUdeviceptr va0;

        ASSERT_OK(mem_create(size, &h0));
        ASSERT_OK(mem_export(h0, &fd));
        ASSERT_OK(mem_map(h0, size, &va0));

        /* Round 0 releases the first import first, round 1 the second first. */
        for (int round = 0; round < 2; round++) {
                const uint32_t seed = UINT32_C(0x600d0000) + (uint32_t)round;
                const uint32_t fill = UINT32_C(0xfeed0000) + (uint32_t)round;
                CUmemGenericAllocationHandle h[2];
                CUdeviceptr va[2];

                ASSERT_OK(mem_import(fd, &h[0]));
                ASSERT_OK(mem_import(fd, &h[1]));
                if (round == 0)
                        observe_text("import the same fd twice in one process",
                                     h[0] == h[1] ? "same handle" : "distinct handles");
                ASSERT_OK(mem_map(h[0], size, &va[0]));
                ASSERT_OK(mem_map(h[1], size, &va[1]));

                ASSERT_OK(mem_write_pattern(va[0], size, seed));
                ASSERT_OK(mem_check_pattern(va[1], size, seed, "the second import, written through the first"));
                ASSERT_CU(gpu.cu->cuMemsetD32(va[1], fill, size / sizeof(uint32_t)));
                ASSERT_OK(mem_check_fill(va[0], size, fill, "the first import, written through the second"));

                ASSERT_OK(mem_unmap(va[0], size));
                ASSERT_OK(mem_unmap(va[1], size));
                ASSERT_OK(mem_release(h[round]));
                ASSERT_OK(mem_release(h[1 - round]));

                /* Releasing the imports leaves the memory to the original handle. */
                ASSERT_OK(mem_check_fill(va0, size, fill, "the exporter's mapping, after both imports were released"));
        }

        ASSERT_OK(mem_unmap(va0, size));
        ASSERT_OK(mem_release(h0));
}
END_TEST

/* --- 7. Release while mapped. */

START_TEST(release_while_mapped) {
        const size_t size = 4 * MiB;
        const uint32_t seed = UINT32_C(0x7e1ea5ed), fill = UINT32_C(0x0badf00d);
        CUmemGenericAllocationHandle h;
        CUdeviceptr va;

        ASSERT_OK(mem_create(size, &h));
        ASSERT_OK(mem_map(h, size, &va));
        ASSERT_OK(mem_release(h));

        /* The mapping alone keeps the memory until cuMemUnmap. */
        ASSERT_OK(mem_write_pattern(va, size, seed));
        ASSERT_OK(mem_check_pattern(va, size, seed, "a mapping whose handle was released"));
        ASSERT_CU(gpu.cu->cuMemsetD32(va, fill, size / sizeof(uint32_t)));
        ASSERT_OK(mem_check_fill(va, size, fill, "a mapping whose handle was released, after cuMemsetD32"));
        ASSERT_OK(mem_unmap(va, size));
}
END_TEST

/* --- 8. Several allocations in one range: what the client library does with a lease. */

START_TEST(contiguous_allocations_in_one_range) {
        /* A lease's slabs: largest first, as the pool's binary decomposition hands them out. */
        const size_t sizes[] = { 4 * G, 2 * G, G, G };
        const uint32_t seed = UINT32_C(0xb0a7d00d), fill = UINT32_C(0xb0b0b0b0);
        const size_t window = 8192; /* bytes of cuMemsetD32 on each side of a boundary */
        CUmemGenericAllocationHandle h[ELEMENTSOF(sizes)];
        _cleanup_free_ uint32_t *buf = NULL;
        size_t total = 0, offset;
        CUdeviceptr va = 0;

        for (size_t i = 0; i < ELEMENTSOF(sizes); i++)
                total += sizes[i];

        ASSERT_CU(gpu.cu->cuMemAddressReserve(&va, total, sizes[0], 0, 0));
        offset = 0;
        for (size_t i = 0; i < ELEMENTSOF(sizes); i++) {
                ASSERT_OK(mem_create(sizes[i], &h[i]));
                ASSERT_CU(gpu.cu->cuMemMap(va + offset, sizes[i], 0, h[i], 0));
                offset += sizes[i];
        }
        ASSERT_OK(mem_set_access(va, total)); /* one call for the whole range */

        /* One pattern across every boundary, then a memset straddling each boundary. */
        ASSERT_OK(mem_write_pattern(va, total, seed));
        ASSERT_OK(mem_check_pattern(va, total, seed, "a range of several allocations"));
        offset = 0;
        for (size_t i = 0; i + 1 < ELEMENTSOF(sizes); i++) {
                offset += sizes[i];
                ASSERT_CU(gpu.cu->cuMemsetD32(va + offset - window, fill, 2 * window / sizeof(uint32_t)));
        }
        ASSERT_OK(mem_read(va, total, &buf));
        offset = 0;
        for (size_t i = 0; i < ELEMENTSOF(sizes); i++) {
                const size_t w = window / sizeof(uint32_t);
                size_t first = offset / sizeof(uint32_t), n = sizes[i] / sizeof(uint32_t);
                size_t lo = i > 0 ? w : 0, hi = i + 1 < ELEMENTSOF(sizes) ? w : 0;
                char what[64];

                snprintf(what, sizeof(what), "allocation %zu of the range", i);
                ASSERT_OK(fill_check(buf, first, lo, fill, what));
                ASSERT_OK(pattern_check(buf, first + lo, n - lo - hi, seed, what));
                ASSERT_OK(fill_check(buf, first + n - hi, hi, fill, what));
                offset += sizes[i];
        }

        /* Each allocation, mapped again on its own, holds its own slice: the order is right. */
        offset = 0;
        for (size_t i = 0; i < ELEMENTSOF(sizes); i++) {
                _cleanup_free_ uint32_t *own = NULL;
                CUdeviceptr single;
                char what[64];

                snprintf(what, sizeof(what), "allocation %zu, mapped on its own", i);
                ASSERT_OK(mem_map(h[i], sizes[i], &single));
                ASSERT_OK(mem_read(single, sizes[i], &own));
                ck_assert_msg(memcmp(own, buf + offset / sizeof(uint32_t), sizes[i]) == 0,
                              "%s does not hold bytes %zu to %zu of the range", what, offset, offset + sizes[i]);
                ASSERT_OK(mem_unmap(single, sizes[i]));
                offset += sizes[i];
        }
        /* One cuMemUnmap for the whole range, as the client library does. */
        expect_result("unmap a range of several mappings at once", gpu.cu->cuMemUnmap(va, total), CUDA_SUCCESS);
        ASSERT_CU(gpu.cu->cuMemAddressFree(va, total));
        for (size_t i = 0; i < ELEMENTSOF(sizes); i++)
                ASSERT_OK(mem_release(h[i]));
}
END_TEST

/* The driver layer's own helper (proto/driver.c) on exported slabs, as a lease holder uses it. */
/* cuda_map_fds() over slabs exported here: one range in which each slab reads what its own mapping reads. */
static void driver_layer_maps(const uint64_t *sizes, size_t n, uint32_t seed) {
        _cleanup_free_ char *message = NULL;
        CUmemGenericAllocationHandle h[2];
        CUdeviceptr va[2], lease = 0;
        int fds[2] = { -EBADF, -EBADF };
        uint64_t offset = 0;

        ck_assert_uint_le(n, 2);
        for (size_t i = 0; i < n; i++) {
                ASSERT_OK(mem_create(sizes[i], &h[i]));
                ASSERT_OK(mem_export(h[i], &fds[i]));
                ASSERT_OK(mem_map(h[i], sizes[i], &va[i]));
        }
        ck_assert_msg(cuda_map_fds(gpu.cu, gpu.info.device, fds, sizes, n, false, &lease, &message) == 0, "%s",
                      message);
        for (size_t i = 0; i < n; i++)
                offset += sizes[i];
        ASSERT_OK(mem_write_pattern(lease, offset, seed));
        offset = 0;
        for (size_t i = 0; i < n; i++) {
                _cleanup_free_ uint32_t *a = NULL;
                size_t w = 0, words = sizes[i] / sizeof(uint32_t);

                ASSERT_OK(mem_read(va[i], sizes[i], &a));
                /* One assertion per slab: Check tells its runner of every one that passes (a write() each). */
                while (w < words && a[w] == pattern_word(seed, offset / sizeof(uint32_t) + w))
                        w++;
                ck_assert_msg(w == words, "slab %zu through its own mapping differs at byte %zu", i,
                              w * sizeof(uint32_t));
                offset += sizes[i];
        }
        ck_assert_int_eq(cuda_unmap(gpu.cu, lease, sizes, n), 0);
        for (size_t i = 0; i < n; i++) {
                ASSERT_OK(mem_unmap(va[i], sizes[i]));
                ASSERT_OK(mem_release(h[i]));
        }
        close_many(fds, n);
}

START_TEST(driver_layer_maps_fds) {
        const uint64_t sizes[] = { 2 * G, G };

        driver_layer_maps(sizes, ELEMENTSOF(sizes), UINT32_C(0xd15c0ded));
}
END_TEST

/* Slabs of any multiple of the granularity (the pool's exact-size slabs), not only powers of two: a lease of
 * 678 MiB is one slab, reserved with the largest power-of-two alignment below its size. */
START_TEST(driver_layer_maps_odd_sizes) {
        const uint64_t one[] = { 3 * gpu.granularity }, two[] = { 5 * gpu.granularity, 3 * gpu.granularity };

        driver_layer_maps(one, ELEMENTSOF(one), UINT32_C(0x0dd51ab5));
        driver_layer_maps(two, ELEMENTSOF(two), UINT32_C(0x0dd51ab6));
}
END_TEST

/* --- 9. Alignment and mapping rules. */

START_TEST(create_size_not_a_granularity_multiple) {
        CUmemAllocationProp prop = cuda_slab_prop(gpu.info.device);
        CUmemGenericAllocationHandle h;
        CUresult r;

        /* "The size of this allocation must be a multiple of the [minimum granularity]." */
        r = gpu.cu->cuMemCreate(&h, G + (size_t)sysconf(_SC_PAGESIZE), &prop, 0);
        if (r == CUDA_SUCCESS)
                (void)gpu.cu->cuMemRelease(h);
        expect_result("create, size not a multiple of the granularity", r, CUDA_ERROR_INVALID_VALUE);
}
END_TEST

START_TEST(reserve_size_not_a_page_multiple) {
        CUdeviceptr va = 0;
        CUresult r;

        /* "The size and address parameters must be a multiple of the host page size." */
        r = gpu.cu->cuMemAddressReserve(&va, G + 1, 0, 0, 0);
        if (r == CUDA_SUCCESS)
                (void)gpu.cu->cuMemAddressFree(va, G + 1);
        expect_result("reserve, size not a multiple of the page size", r, CUDA_ERROR_INVALID_VALUE);
}
END_TEST

/*
 * The documentation asks reservations only for host-page multiples, but the
 * real driver (H200, driver 580.159.04, CUDA 13.0) refuses a size that is a
 * page multiple and not a granularity multiple with CUDA_ERROR_INVALID_VALUE,
 * and the simulator must do the same. (The broker always reserves whole slabs.)
 */
START_TEST(reserve_size_not_a_granularity_multiple) {
        const size_t size = G + (size_t)sysconf(_SC_PAGESIZE);
        CUdeviceptr va = 0;
        CUresult r;

        r = gpu.cu->cuMemAddressReserve(&va, size, 0, 0, 0);
        if (r == CUDA_SUCCESS)
                (void)gpu.cu->cuMemAddressFree(va, size);
        expect_result("reserve, size a page multiple but not a granularity multiple", r, CUDA_ERROR_INVALID_VALUE);
}
END_TEST

/* The alignment must be a power of two: the pool and cuda_map_fds() reserve with cuda_slab_alignment(). */
START_TEST(reserve_alignment_not_a_power_of_two) {
        const size_t size = 3 * gpu.granularity;
        CUdeviceptr va = 0;
        CUresult r;

        r = gpu.cu->cuMemAddressReserve(&va, size, size, 0, 0);
        if (r == CUDA_SUCCESS)
                (void)gpu.cu->cuMemAddressFree(va, size);
        expect_result("reserve, alignment not a power of two", r, CUDA_ERROR_INVALID_VALUE);
        ck_assert_uint_eq(cuda_slab_alignment(size), 2 * gpu.granularity);
        ASSERT_CU(gpu.cu->cuMemAddressReserve(&va, size, cuda_slab_alignment(size), 0, 0));
        ck_assert_uint_eq(va % cuda_slab_alignment(size), 0);
        ASSERT_CU(gpu.cu->cuMemAddressFree(va, size));
}
END_TEST

START_TEST(map_with_nonzero_offset) {
        CUmemGenericAllocationHandle h;
        CUdeviceptr va;
        CUresult r;

        ASSERT_OK(mem_create(2 * G, &h));
        ASSERT_OK(mem_reserve(2 * G, &va));
        /*
         * "offset ... Note: currently must be zero." The real driver (H200,
         * driver 580.159.04, CUDA 13.0) answers CUDA_ERROR_NOT_SUPPORTED, one of
         * cuMemMap's documented codes: not yet supported, rather than invalid.
         * (A nonzero offset cannot be tried without a partial mapping, which the
         * same driver also refuses with CUDA_ERROR_NOT_SUPPORTED.)
         */
        r = gpu.cu->cuMemMap(va, G, G, h, 0);
        if (r == CUDA_SUCCESS)
                (void)gpu.cu->cuMemUnmap(va, G);
        expect_result("map with a nonzero offset", r, CUDA_ERROR_NOT_SUPPORTED);
        ASSERT_CU(gpu.cu->cuMemAddressFree(va, 2 * G));
        ASSERT_OK(mem_release(h));
}
END_TEST

/*
 * Report only: the broker maps whole allocations only (ARCHITECTURE.md), and
 * the documentation's "offset + size must be less than the size of the memory
 * allocation" reads as if a smaller mapping were allowed. What the driver does
 * is recorded, and the check passes either way (a driver that allows it gets
 * the partial mapping written and read back). The real driver (H200, driver
 * 580.159.04, CUDA 13.0) refuses it with CUDA_ERROR_NOT_SUPPORTED.
 */
START_TEST(map_part_of_an_allocation) {
        CUmemGenericAllocationHandle h;
        CUdeviceptr va;
        CUresult r;

        ASSERT_OK(mem_create(2 * G, &h));
        ASSERT_OK(mem_reserve(2 * G, &va));
        r = gpu.cu->cuMemMap(va, G, 0, h, 0);
        observe("map part of an allocation (report only)", r);
        if (r == CUDA_SUCCESS) {
                ASSERT_OK(mem_set_access(va, G));
                ASSERT_OK(mem_write_pattern(va, G, UINT32_C(0x9a47ed00)));
                ASSERT_OK(mem_check_pattern(va, G, UINT32_C(0x9a47ed00), "a partial mapping"));
                ASSERT_CU(gpu.cu->cuMemUnmap(va, G));
        }
        ASSERT_CU(gpu.cu->cuMemAddressFree(va, 2 * G));
        ASSERT_OK(mem_release(h));
}
END_TEST

START_TEST(map_at_unaligned_address) {
        CUmemGenericAllocationHandle h;
        CUdeviceptr va;
        CUresult r;

        ASSERT_OK(mem_create(G, &h));
        ASSERT_OK(mem_reserve(2 * G, &va));
        /* Page-aligned, inside the reservation, but not a multiple of the granularity. */
        r = gpu.cu->cuMemMap(va + G / 2, G, 0, h, 0);
        if (r == CUDA_SUCCESS)
                (void)gpu.cu->cuMemUnmap(va + G / 2, G);
        expect_result("map at an address not aligned to the granularity", r, CUDA_ERROR_INVALID_VALUE);
        ASSERT_CU(gpu.cu->cuMemAddressFree(va, 2 * G));
        ASSERT_OK(mem_release(h));
}
END_TEST

START_TEST(map_over_a_mapped_range) {
        CUmemGenericAllocationHandle big, small;
        CUdeviceptr va;
        CUresult r1, r2;

        ASSERT_OK(mem_create(2 * G, &big));
        ASSERT_OK(mem_create(G, &small));
        ASSERT_OK(mem_reserve(2 * G, &va));
        ASSERT_CU(gpu.cu->cuMemMap(va, 2 * G, 0, big, 0));

        /* "cuMemMap can only create mappings on VA range reservations that are not currently mapped." */
        r1 = gpu.cu->cuMemMap(va, G, 0, small, 0);
        if (r1 == CUDA_SUCCESS)
                (void)gpu.cu->cuMemUnmap(va, G);
        r2 = gpu.cu->cuMemMap(va + G, G, 0, small, 0);
        if (r2 == CUDA_SUCCESS)
                (void)gpu.cu->cuMemUnmap(va + G, G);
        observe("map over the start of a mapped range", r1);
        observe("map over the end of a mapped range", r2);
        assert_result("map over the start of a mapped range", r1, CUDA_ERROR_INVALID_VALUE);
        assert_result("map over the end of a mapped range", r2, CUDA_ERROR_INVALID_VALUE);

        ASSERT_OK(mem_unmap(va, 2 * G));
        ASSERT_OK(mem_release(big));
        ASSERT_OK(mem_release(small));
}
END_TEST

START_TEST(map_outside_a_reservation) {
        CUmemGenericAllocationHandle h;
        CUdeviceptr va;
        CUresult r1, r2;

        ASSERT_OK(mem_create(2 * G, &h));

        /* A range that was reserved and freed again: no reservation is there now. */
        ASSERT_OK(mem_reserve(2 * G, &va));
        ASSERT_CU(gpu.cu->cuMemAddressFree(va, 2 * G));
        r1 = gpu.cu->cuMemMap(va, 2 * G, 0, h, 0);
        if (r1 == CUDA_SUCCESS)
                (void)gpu.cu->cuMemUnmap(va, 2 * G);

        /* A mapping that would run past the end of its reservation. */
        ASSERT_OK(mem_reserve(G, &va));
        r2 = gpu.cu->cuMemMap(va, 2 * G, 0, h, 0);
        if (r2 == CUDA_SUCCESS)
                (void)gpu.cu->cuMemUnmap(va, 2 * G);
        ASSERT_CU(gpu.cu->cuMemAddressFree(va, G));

        observe("map where nothing is reserved", r1);
        observe("map past the end of a reservation", r2);
        assert_result("map where nothing is reserved", r1, CUDA_ERROR_INVALID_VALUE);
        assert_result("map past the end of a reservation", r2, CUDA_ERROR_INVALID_VALUE);
        ASSERT_OK(mem_release(h));
}
END_TEST

START_TEST(unmap_part_of_a_mapping) {
        CUmemGenericAllocationHandle h;
        CUdeviceptr va;
        CUresult r;

        ASSERT_OK(mem_create(2 * G, &h));
        ASSERT_OK(mem_map(h, 2 * G, &va));
        /* "cuMemUnmap cannot unmap a sub-range of an address range mapped by cuMemCreate / cuMemMap." */
        r = gpu.cu->cuMemUnmap(va, G);
        expect_result("unmap part of a mapping", r, CUDA_ERROR_INVALID_VALUE);
        /* The whole mapping is still there and still works. */
        ASSERT_OK(mem_write_pattern(va, 2 * G, UINT32_C(0x0a0b0c0d)));
        ASSERT_OK(mem_check_pattern(va, 2 * G, UINT32_C(0x0a0b0c0d), "a mapping after a refused partial unmap"));
        ASSERT_OK(mem_unmap(va, 2 * G));
        ASSERT_OK(mem_release(h));
}
END_TEST

START_TEST(set_access_on_a_partly_mapped_range) {
        CUmemAccessDesc access = {
                .location = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = gpu.info.device },
                .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        CUmemGenericAllocationHandle h;
        CUdeviceptr va;
        CUresult r;

        ASSERT_OK(mem_create(G, &h));
        ASSERT_OK(mem_reserve(2 * G, &va));
        ASSERT_CU(gpu.cu->cuMemMap(va, G, 0, h, 0));
        /* "The range must be a fully mapped address range." */
        r = gpu.cu->cuMemSetAccess(va, 2 * G, &access, 1);
        expect_result("set access on a range only partly mapped", r, CUDA_ERROR_INVALID_VALUE);
        ASSERT_CU(gpu.cu->cuMemUnmap(va, G));
        ASSERT_CU(gpu.cu->cuMemAddressFree(va, 2 * G));
        ASSERT_OK(mem_release(h));
}
END_TEST

/*
 * Report only: the documentation does not say whether a reservation that
 * still holds mappings can be freed. The broker always unmaps first. The real
 * driver (H200, driver 580.159.04, CUDA 13.0) refuses with
 * CUDA_ERROR_INVALID_VALUE and leaves the mapping in place.
 */
START_TEST(address_free_while_mapped) {
        CUmemGenericAllocationHandle h;
        CUdeviceptr va;
        CUresult r;

        ASSERT_OK(mem_create(G, &h));
        ASSERT_OK(mem_map(h, G, &va));
        r = gpu.cu->cuMemAddressFree(va, G);
        observe("free a reservation that still has a mapping (report only)", r);
        if (r == CUDA_SUCCESS)
                observe("unmap after its reservation was freed (report only)", gpu.cu->cuMemUnmap(va, G));
        else
                ASSERT_OK(mem_unmap(va, G));
        ASSERT_OK(mem_release(h));
}
END_TEST

/*
 * --- 10. No access before cuMemSetAccess (in a peer: the error may be sticky).
 *
 * The documentation names no code, so the check asks only that the copy or
 * the synchronize after it fail. The real driver (H200, driver 580.159.04,
 * CUDA 13.0) fails the copy with CUDA_ERROR_INVALID_VALUE, and the context
 * stays usable (the synchronize succeeds).
 */

START_TEST(no_access_before_set_access) {
        PeerMsg req = { .magic = PEER_MAGIC, .size = 2 * MiB, .seed = { UINT32_C(0xacce55ed) } }, report;
        CUresult copy, sync;
        Peer p;

        p = peer_start("no-access");
        ASSERT_OK(msg_send(p.sock, &req, -1));
        peer_finish(&p, &report);
        copy = (CUresult)report.result[0];
        sync = (CUresult)report.result[1];
        observe("copy into a mapping without access", copy);
        observe("synchronize after copying into a mapping without access", sync);
        ck_assert_msg(copy != CUDA_SUCCESS || sync != CUDA_SUCCESS,
                      "Copying into memory mapped without cuMemSetAccess succeeded, and so did the synchronize.");
}
END_TEST

/*
 * --- 10b. cuMemUnmap does not wait for work queued on the range (in a peer:
 * the work then faults, and the error is sticky).
 *
 * The documentation says nothing about queued work. On an H100 (driver 580,
 * CUDA 13.0) cuMemUnmap returned after 181 us with ten 8 GiB memsets queued
 * on the range, and the stream then failed with CUDA_ERROR_ILLEGAL_ADDRESS:
 * freeing memory is safe only once no queued work uses it (vmmb_free()'s
 * documentation, vmmb_free_stream(), vmmb_torch_free()). Here the memsets are
 * held behind a host function that blocks the stream, so that they are still
 * queued when cuMemUnmap runs however fast the GPU is. The check asks that
 * the unmap succeed without waiting for them, and that the stream then report
 * an error (any: the line says which) rather than the process crash.
 */

START_TEST(unmap_with_work_queued) {
        PeerMsg req = { .magic = PEER_MAGIC, .size = 64 * MiB }, report;
        CUresult unmap, sync;
        bool waited;
        Peer p;

        p = peer_start("unmap-queued");
        ASSERT_OK(msg_send(p.sock, &req, -1));
        peer_finish(&p, &report);
        unmap = (CUresult)report.result[0];
        sync = (CUresult)report.result[1];
        waited = report.size != 0;
        observe("unmap a range with memsets still queued on it", unmap);
        observe_text("unmap waits for the work queued on the range", waited ? "yes" : "no");
        observe("synchronize the stream after the range of its queued memsets was unmapped", sync);
        assert_result("unmap a range with memsets still queued on it", unmap, CUDA_SUCCESS);
        ck_assert_msg(!waited, "cuMemUnmap waited for the memsets queued on the range.");
        ck_assert_msg(sync != CUDA_SUCCESS, "The memsets queued on a range that was then unmapped completed "
                      "without an error.");
}
END_TEST

/* --- 11. The device memory budget. */

START_TEST(device_memory_budget) {
        const size_t size = 64 * MiB;
        CUmemAllocationProp prop = cuda_slab_prop(gpu.info.device);
        char a[FORMAT_SIZE_MAX], b[FORMAT_SIZE_MAX], t[FORMAT_SIZE_MAX];
        size_t free0 = 0, total0 = 0, free1 = 0, total1 = 0, too_big;
        CUmemGenericAllocationHandle h;
        bool dropped = false;
        CUresult r;

        /* Another user of a real GPU may free memory meanwhile: a short drop is retried. */
        for (int attempt = 1; attempt <= 5 && !dropped; attempt++) {
                ASSERT_CU(gpu.cu->cuMemGetInfo(&free0, &total0));
                ASSERT_OK(mem_create(size, &h));
                ASSERT_CU(gpu.cu->cuMemGetInfo(&free1, &total1));
                ASSERT_OK(mem_release(h));
                dropped = free1 <= free0 && free0 - free1 >= size;
                fprintf(stderr, "info: attempt %d: free %s before creating %zu MiB, %s after: %+.3f MiB (total %s)\n",
                        attempt, size_text(free0, a, sizeof(a)), size / MiB, size_text(free1, b, sizeof(b)),
                        ((double)free1 - (double)free0) / (double)MiB, size_text(total1, t, sizeof(t)));
                ck_assert_uint_eq(total0, total1);
        }
        observe_text("free memory while a 64 MiB allocation exists",
                     dropped ? "at least 64 MiB less" : "less than 64 MiB less");
        ck_assert_msg(dropped, "cuMemGetInfo: free memory dropped by less than %zu bytes (from %zu to %zu).", size,
                      free0, free1);

        /* Never really allocate most of a GPU: ask for more than it has, which must fail at once. */
        too_big = ALIGN_UP((total0 > gpu.info.total_memory ? total0 : (size_t)gpu.info.total_memory) + G, G);
        r = gpu.cu->cuMemCreate(&h, too_big, &prop, 0);
        if (r == CUDA_SUCCESS)
                (void)gpu.cu->cuMemRelease(h);
        expect_result("create more than the device's total memory", r, CUDA_ERROR_OUT_OF_MEMORY);
}
END_TEST

/* --- 12. Export once, send many. */

START_TEST(export_once_send_many) {
        const size_t size = 4 * MiB;
        const uint32_t seed_a = UINT32_C(0x0e0e0e0e), seed_b = UINT32_C(0x5e4d0002);
        PeerMsg req = { .magic = PEER_MAGIC, .size = size, .seed = { seed_a, seed_b } }, report;
        _cleanup_close_ int fd = -EBADF;
        CUmemGenericAllocationHandle h, again;
        CUdeviceptr va, va_again;
        Peer p;

        ASSERT_OK(mem_create(size, &h));
        ASSERT_OK(mem_export(h, &fd));
        ASSERT_OK(mem_map(h, size, &va));
        ASSERT_OK(mem_write_pattern(va, size, seed_a));

        /* The one exported fd, sent twice: the peer receives two duplicates and imports each. */
        p = peer_start("import-twice");
        ASSERT_OK(msg_send(p.sock, &req, fd));
        ASSERT_OK(msg_send(p.sock, &req, fd));
        peer_finish(&p, &report);
        ASSERT_OK(mem_check_pattern(va, size, seed_b, "the exporter's mapping, after the peer wrote"));

        /* The fd still works here after being sent, imported elsewhere, released and closed there. */
        ASSERT_OK(mem_import(fd, &again));
        ASSERT_OK(mem_map(again, size, &va_again));
        ASSERT_OK(mem_check_pattern(va_again, size, seed_b, "the exported fd imported again by the exporter"));
        ASSERT_OK(mem_unmap(va_again, size));
        ASSERT_OK(mem_release(again));

        ASSERT_OK(mem_unmap(va, size));
        ASSERT_OK(mem_release(h));
}
END_TEST

/* --- 13. Asynchronous memset and host functions on a stream. */

typedef struct HostCalls {
        atomic_int count;
        int order[4];
} HostCalls;

static void CUDA_CB host_call(void *userdata) {
        HostCalls *c = userdata;
        int n = atomic_fetch_add(&c->count, 1);

        /* No CUDA calls in here: a host function must not make any. */
        if (n < (int)ELEMENTSOF(c->order))
                c->order[n] = n;
}

static void CUDA_CB host_call_second(void *userdata) {
        HostCalls *c = userdata;
        int n = atomic_fetch_add(&c->count, 1);

        if (n < (int)ELEMENTSOF(c->order))
                c->order[n] = 100 + n;
}

START_TEST(async_memset_then_host_function) {
        const size_t size = 4 * MiB, words = size / sizeof(uint32_t);
        const uint32_t first = UINT32_C(0x5eed0001), second = UINT32_C(0x5eed0002);
        _cleanup_free_ uint32_t *buf = NULL;
        HostCalls calls = { .order = { -1, -1, -1, -1 } };
        CUmemGenericAllocationHandle h;
        CUstream stream;
        CUdeviceptr va;
        CUresult r;

        ASSERT_OK(mem_create(size, &h));
        ASSERT_OK(mem_map(h, size, &va));
        ASSERT_CU(gpu.cu->cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));

        /* memset, host function, memset over the first half, host function: all in stream order. */
        ASSERT_CU(gpu.cu->cuMemsetD32Async(va, first, words, stream));
        ASSERT_CU(gpu.cu->cuLaunchHostFunc(stream, host_call, &calls));
        ASSERT_CU(gpu.cu->cuMemsetD32Async(va, second, words / 2, stream));
        ASSERT_CU(gpu.cu->cuLaunchHostFunc(stream, host_call_second, &calls));
        ASSERT_CU(gpu.cu->cuStreamSynchronize(stream));

        ck_assert_msg(atomic_load(&calls.count) == 2, "The host functions ran %d times in all, not once each.",
                      atomic_load(&calls.count));
        ck_assert_msg(calls.order[0] == 0 && calls.order[1] == 101,
                      "The host functions ran out of stream order (%d, %d).", calls.order[0], calls.order[1]);
        r = gpu.cu->cuStreamQuery(stream);
        expect_result("query a stream after synchronizing it", r, CUDA_SUCCESS);

        ASSERT_OK(mem_read(va, size, &buf));
        ASSERT_OK(fill_check(buf, 0, words / 2, second, "the half both memsets wrote"));
        ASSERT_OK(fill_check(buf, words / 2, words - words / 2, first, "the half only the first memset wrote"));

        ASSERT_CU(gpu.cu->cuStreamDestroy(stream));
        ASSERT_OK(mem_unmap(va, size));
        ASSERT_OK(mem_release(h));
}
END_TEST

/*
 * The daemon queues each piece of a park's copy on its copy stream, records an event after it and makes a second
 * stream wait for that event before a host function that counts the piece done: a host function on the copy
 * stream itself held the copies behind it until the driver's thread had run it (about 130 us a piece on an
 * H200). Work queued on a stream after cuStreamWaitEvent() runs after what the event captured on the other
 * stream, and what that stream queues after the record is not waited for; an event never recorded is no wait.
 */
START_TEST(wait_event_orders_two_streams) {
        const size_t size = 64 * MiB, words = size / sizeof(uint32_t);
        const uint32_t first = UINT32_C(0x5eed0011), second = UINT32_C(0x5eed0012), third = UINT32_C(0x5eed0013);
        _cleanup_free_ uint32_t *buf = NULL;
        HostCalls calls = { .order = { -1, -1, -1, -1 } };
        CUmemGenericAllocationHandle h;
        CUstream a, b;
        CUevent e, never;
        CUdeviceptr va;

        ASSERT_OK(mem_create(size, &h));
        ASSERT_OK(mem_map(h, size, &va));
        ASSERT_CU(gpu.cu->cuStreamCreate(&a, CU_STREAM_NON_BLOCKING));
        ASSERT_CU(gpu.cu->cuStreamCreate(&b, CU_STREAM_NON_BLOCKING));
        ASSERT_CU(gpu.cu->cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
        ASSERT_CU(gpu.cu->cuEventCreate(&never, CU_EVENT_DISABLE_TIMING));

        /* a: the whole range, the record, then the second half again; b: after the record, the first half. */
        ASSERT_CU(gpu.cu->cuMemsetD32Async(va, first, words, a));
        ASSERT_CU(gpu.cu->cuEventRecord(e, a));
        ASSERT_CU(gpu.cu->cuMemsetD32Async(va + size / 2, third, words / 2, a));
        ASSERT_CU(gpu.cu->cuStreamWaitEvent(b, never, 0));
        ASSERT_CU(gpu.cu->cuStreamWaitEvent(b, e, 0));
        ASSERT_CU(gpu.cu->cuMemsetD32Async(va, second, words / 2, b));
        ASSERT_CU(gpu.cu->cuLaunchHostFunc(b, host_call, &calls));
        ASSERT_CU(gpu.cu->cuStreamSynchronize(b));
        ck_assert_msg(atomic_load(&calls.count) == 1, "The host function after the wait ran %d times, not once.",
                      atomic_load(&calls.count));
        ASSERT_CU(gpu.cu->cuStreamSynchronize(a));
        /* Report only: the documentation names no code for it; the simulator says INVALID_VALUE. */
        observe("wait for an event with an unknown flag", gpu.cu->cuStreamWaitEvent(b, e, 4));

        ASSERT_OK(mem_read(va, size, &buf));
        ASSERT_OK(fill_check(buf, 0, words / 2, second, "the half the waiting stream wrote after the record"));
        ASSERT_OK(fill_check(buf, words / 2, words - words / 2, third, "the half only the first stream wrote"));

        ASSERT_CU(gpu.cu->cuEventDestroy(never));
        ASSERT_CU(gpu.cu->cuEventDestroy(e));
        ASSERT_CU(gpu.cu->cuStreamDestroy(a));
        ASSERT_CU(gpu.cu->cuStreamDestroy(b));
        ASSERT_OK(mem_unmap(va, size));
        ASSERT_OK(mem_release(h));
}
END_TEST

/*
 * A stream the caller created is waited for (and asked about) by a thread with no current context: the driver
 * finds the stream's context from it. vmmb_free_stream() and vmmb_lease_park() count on it to wait for such a
 * stream without retaining the primary context, which a retain would create when it is not active. The NULL
 * stream names the current context's own, and there is none: CUDA_ERROR_INVALID_CONTEXT. Measured first on an
 * H200 (2026-11-30) from a second thread, for a stream of the primary context and one of a context of its own.
 */
START_TEST(stream_synchronized_without_context) {
        const size_t size = 64 * MiB, words = size / sizeof(uint32_t);
        const uint32_t word = UINT32_C(0x5eed0021);
        _cleanup_free_ uint32_t *buf = NULL;
        CUmemGenericAllocationHandle h;
        CUdeviceptr va;
        CUstream s;
        CUresult synced, queried, legacy;

        ASSERT_OK(mem_create(size, &h));
        ASSERT_OK(mem_map(h, size, &va));
        ASSERT_CU(gpu.cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
        ASSERT_CU(gpu.cu->cuMemsetD32Async(va, word, words, s));
        ASSERT_CU(gpu.cu->cuCtxSetCurrent(NULL));
        synced = gpu.cu->cuStreamSynchronize(s);
        queried = gpu.cu->cuStreamQuery(s);
        legacy = gpu.cu->cuStreamSynchronize(NULL);
        ASSERT_CU(gpu.cu->cuCtxSetCurrent(gpu.ctx));
        expect_result("synchronize a created stream with no current context", synced, CUDA_SUCCESS);
        expect_result("query a created stream after that, no current context", queried, CUDA_SUCCESS);
        expect_result("synchronize the NULL stream with no current context", legacy, CUDA_ERROR_INVALID_CONTEXT);

        ASSERT_OK(mem_read(va, size, &buf));
        ASSERT_OK(fill_check(buf, 0, words, word, "the range the stream wrote before it was waited for"));
        ASSERT_CU(gpu.cu->cuStreamDestroy(s));
        ASSERT_OK(mem_unmap(va, size));
        ASSERT_OK(mem_release(h));
}
END_TEST

/*
 * Work queued on a created stream from a thread with no current context: a memset, a device-to-device copy, a
 * host function, a record of the stream's context's event and a wait for it, then the stream destroyed, all
 * CUDA_SUCCESS, and the work done in order. The stream names its context (measured on H200s, driver 580.159.04;
 * what simcuda's stream_context() copies). The library waits for a caller's stream this way (wait_queued()).
 */
START_TEST(stream_work_without_context) {
        const size_t size = 4 * MiB, words = size / sizeof(uint32_t), half = size / 2;
        const uint32_t word = UINT32_C(0x5eed0022);
        _cleanup_free_ uint32_t *buf = NULL;
        HostCalls calls = { .order = { -1, -1, -1, -1 } };
        CUresult r[7];
        CUmemGenericAllocationHandle h;
        CUdeviceptr va;
        CUstream s;
        CUevent e;

        ASSERT_OK(mem_create(size, &h));
        ASSERT_OK(mem_map(h, size, &va));
        ASSERT_CU(gpu.cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
        ASSERT_CU(gpu.cu->cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
        ASSERT_CU(gpu.cu->cuCtxSetCurrent(NULL));
        r[0] = gpu.cu->cuMemsetD32Async(va, word, words / 2, s);
        r[1] = gpu.cu->cuMemcpyDtoDAsync(va + half, va, half, s);
        r[2] = gpu.cu->cuLaunchHostFunc(s, host_call, &calls);
        r[3] = gpu.cu->cuEventRecord(e, s);
        r[4] = gpu.cu->cuStreamWaitEvent(s, e, 0);
        r[5] = gpu.cu->cuEventSynchronize(e);
        r[6] = gpu.cu->cuStreamSynchronize(s);
        ASSERT_CU(gpu.cu->cuCtxSetCurrent(gpu.ctx));
        expect_result("queue a memset on a created stream with no current context", r[0], CUDA_SUCCESS);
        expect_result("queue a device-to-device copy on it, no current context", r[1], CUDA_SUCCESS);
        expect_result("queue a host function on it, no current context", r[2], CUDA_SUCCESS);
        expect_result("record its context's event on it, no current context", r[3], CUDA_SUCCESS);
        expect_result("make it wait for that event, no current context", r[4], CUDA_SUCCESS);
        expect_result("synchronize that event, no current context", r[5], CUDA_SUCCESS);
        expect_result("synchronize the stream after that, no current context", r[6], CUDA_SUCCESS);
        ck_assert_msg(atomic_load(&calls.count) == 1, "The host function ran %d times, not once.",
                      atomic_load(&calls.count));

        ASSERT_OK(mem_read(va, size, &buf));
        ASSERT_OK(fill_check(buf, 0, words, word, "the memset's half and the copy of it, queued with no context"));
        ASSERT_CU(gpu.cu->cuCtxSetCurrent(NULL));
        r[0] = gpu.cu->cuStreamDestroy(s);
        r[1] = gpu.cu->cuEventDestroy(e);
        ASSERT_CU(gpu.cu->cuCtxSetCurrent(gpu.ctx));
        expect_result("destroy a created stream with no current context", r[0], CUDA_SUCCESS);
        expect_result("destroy an event with no current context", r[1], CUDA_SUCCESS);
        ASSERT_OK(mem_unmap(va, size));
        ASSERT_OK(mem_release(h));
}
END_TEST

/*
 * --- Peer access (issue 18: leases several GPUs can use), what one GPU can tell.
 *
 * vmmb_lease_grant_access() asks cuDeviceCanAccessPeer(&can, B, A) for each
 * device B other than the lease's A, then sets access with one cuMemSetAccess
 * carrying a descriptor per device. A one-GPU machine cannot show a peer, but
 * it shows the answers the simulator must copy: the device with itself, and
 * a device index that does not exist, to both calls.
 */

/*
 * Report only: the documentation does not say what a device is to itself
 * (HIP documents 0, "a device is not a peer of itself"); the library never
 * asks for (A, A). An index equal to the device count is
 * CUDA_ERROR_INVALID_DEVICE, the code the documentation lists.
 */
START_TEST(can_access_peer_itself_and_nothing) {
        int count = 0, can = -1;
        CUresult r;

        ASSERT_CU(gpu.cu->cuDeviceGetCount(&count));
        r = gpu.cu->cuDeviceCanAccessPeer(&can, gpu.info.device, gpu.info.device);
        expect_result("can a device access its own memory as a peer, the call", r, CUDA_SUCCESS);
        observe_text("can a device access its own memory as a peer (report only)", can == 0 ? "0" : "1");
        r = gpu.cu->cuDeviceCanAccessPeer(&can, gpu.info.device, count);
        expect_result("can a device access the memory of a device index that does not exist", r,
                      CUDA_ERROR_INVALID_DEVICE);
}
END_TEST

/*
 * cuMemSetAccess with two descriptors, this device's (valid) and one for the
 * device index equal to the device count. The documentation lists
 * CUDA_ERROR_INVALID_DEVICE among its codes; the simulator answers that.
 * Then a copy through this device's context says whether the valid
 * descriptor of the refused call took effect (the simulator: no, the copy is
 * refused with CUDA_ERROR_INVALID_VALUE, as for a mapping without access).
 */
START_TEST(set_access_for_a_device_that_does_not_exist) {
        CUmemAccessDesc access[2] = {
                { .location = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = gpu.info.device },
                  .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE },
                { .location = { .type = CU_MEM_LOCATION_TYPE_DEVICE },
                  .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE },
        };
        CUmemGenericAllocationHandle h;
        uint32_t word = 0;
        int count = 0;
        CUdeviceptr va;
        CUresult r;

        ASSERT_CU(gpu.cu->cuDeviceGetCount(&count));
        access[1].location.id = count;
        ASSERT_OK(mem_create(G, &h));
        ASSERT_OK(mem_reserve(G, &va));
        ASSERT_CU(gpu.cu->cuMemMap(va, G, 0, h, 0));
        r = gpu.cu->cuMemSetAccess(va, G, access, 2);
        /* the documentation lists CUDA_ERROR_INVALID_DEVICE; the H100's driver 580.159.04 says this */
        expect_result("set access for a device index that does not exist", r, CUDA_ERROR_INVALID_VALUE);
        observe("copy after set access was refused for another device in the same call",
                gpu.cu->cuMemcpyHtoD(va, &word, sizeof(word)));
        ASSERT_CU(gpu.cu->cuCtxSynchronize());
        ASSERT_OK(mem_unmap(va, G));
        ASSERT_OK(mem_release(h));
}
END_TEST

/*
 * --- Peer access between two devices (issue 18), where the driver has two or more: the suite's device A and
 * the next index, B (gpu_pair_device()). tests/gpu/run.sh runs them on a machine of several GPUs; in CI,
 * `meson test conformance-pair` runs them on the simulated device with SIMCUDA_DEVICES=2. With one device
 * each says on stderr that it did not run, and checks nothing.
 *
 * What vmmb_lease_grant_access() relies on: cuDeviceCanAccessPeer(&can, B, A) says whether B may reach A's
 * memory; one cuMemSetAccess with a descriptor for A and one for B gives both access to the mapping, after
 * which B's context reads and writes A's memory; a read-only descriptor lets B read and not write; without a
 * descriptor B's work on the range fails (the library's tests rely on the simulator's answer for it).
 */

/* B, or false when the driver has one device (the check is not run, and says so). */
static bool pair_device(const char *check, CUdevice *ret) {
        int count = 0;

        if (gpu_pair_device(ret, &count))
                return true;
        ASSERT_OK(count > 0);   /* a driver error, not one device */
        fprintf(stderr, "info: %s: not run: the driver has %d device(s), the check needs two\n", check, count);
        return false;
}

/* Whether B can reach A's memory; both directions are reported (they depend on the machine). */
static bool pair_can_access(CUdevice b) {
        int ba = -1, ab = -1;

        ASSERT_CU(gpu.cu->cuDeviceCanAccessPeer(&ba, b, gpu.info.device));
        ASSERT_CU(gpu.cu->cuDeviceCanAccessPeer(&ab, gpu.info.device, b));
        fprintf(stderr, "info: device %d can access device %d's memory: %s; device %d device %d's: %s\n", (int)b,
                (int)gpu.info.device, ba ? "yes" : "no", (int)gpu.info.device, (int)b, ab ? "yes" : "no");
        observe_text("the other device of a pair can access this one's memory (report only)", ba ? "1" : "0");
        observe_text("this device can access the other's memory (report only)", ab ? "1" : "0");
        return ba != 0;
}

/* A pair check's memory: on A, mapped (G bytes), with access for A and for B. */
typedef struct PairMapping {
        CUdevice b;
        CUmemGenericAllocationHandle h;
        CUdeviceptr va;
        CUcontext ctx;                  /* B's, while the check is in it (gpu_enter_device()) */
} PairMapping;

/*
 * B (pair_device()), and memory on A mapped with access for A and for B (read-write, or read-only), in one
 * cuMemSetAccess; false, the check not run, with one device or when B cannot reach A (then the set-access
 * must have been refused).
 */
static bool pair_mapping(const char *check, bool readonly, PairMapping *m) {
        bool can;
        CUresult r;

        if (!pair_device(check, &m->b))
                return false;
        can = pair_can_access(m->b);
        ASSERT_OK(mem_create(G, &m->h));
        ASSERT_OK(mem_reserve(G, &m->va));
        ASSERT_CU(gpu.cu->cuMemMap(m->va, G, 0, m->h, 0));
        r = mem_set_access_pair(m->va, G, m->b, readonly);
        if (!can) {
                observe("set access for a device that cannot reach the memory", r);
                ck_assert_msg(r != CUDA_SUCCESS, "cuMemSetAccess gave access to a device that is not a peer.");
                ASSERT_OK(mem_unmap(m->va, G));
                ASSERT_OK(mem_release(m->h));
                return false;
        }
        expect_result(readonly ? "set access for this device and read-only for its peer, one call" :
                                 "set access for this device and its peer, one call", r, CUDA_SUCCESS);
        return true;
}

/* Back in A's context: B's context released, pair_mapping()'s memory unmapped and released. */
static void pair_mapping_done(PairMapping *m) {
        ASSERT_OK(gpu_leave_device());
        ASSERT_CU(gpu.cu->cuDevicePrimaryCtxRelease(m->b));
        ASSERT_OK(mem_unmap(m->va, G));
        ASSERT_OK(mem_release(m->h));
}

/* B writes A's memory, A reads it; A writes, B reads: both see the other's bytes. */
START_TEST(pair_write_through_the_other_device) {
        PairMapping m;

        if (!pair_mapping("pair_write_through_the_other_device", false, &m))
                return;
        ASSERT_OK(gpu_enter_device(m.b, &m.ctx));
        expect_result("memset of a device's memory through its peer's context",
                      gpu.cu->cuMemsetD32(m.va, UINT32_C(0xb0b0b0b0), G / sizeof(uint32_t)), CUDA_SUCCESS);
        ASSERT_CU(gpu.cu->cuCtxSynchronize());
        ASSERT_OK(gpu_leave_device());
        ASSERT_OK(mem_check_fill(m.va, G, UINT32_C(0xb0b0b0b0), "the memory written by the peer, read on its device"));
        ASSERT_OK(mem_write_pattern(m.va, G, UINT32_C(0xa0a0a0a0)));
        ASSERT_OK(gpu_enter_device(m.b, &m.ctx));
        ASSERT_OK(mem_check_pattern(m.va, G, UINT32_C(0xa0a0a0a0),
                                    "the memory written on its device, read by the peer"));
        observe_text("a peer with access reads and writes the memory", "yes");
        pair_mapping_done(&m);
}
END_TEST

/* A read-only descriptor for B: B reads what A wrote. (B's write is pair_peer_writes_read_only.) */
START_TEST(pair_read_only_peer_reads) {
        PairMapping m;

        if (!pair_mapping("pair_read_only_peer_reads", true, &m))
                return;
        ASSERT_OK(mem_write_pattern(m.va, G, UINT32_C(0x0dd0dd0d)));
        ASSERT_OK(gpu_enter_device(m.b, &m.ctx));
        ASSERT_OK(mem_check_pattern(m.va, G, UINT32_C(0x0dd0dd0d), "the memory read by a read-only peer"));
        observe_text("a read-only peer reads the memory", "yes");
        pair_mapping_done(&m);
}
END_TEST

/* In a peer process (a fault may be sticky): B's memset of A's memory mapped without B, or read-only for B. */
static void pair_write_refused(const char *role, const char *what) {
        PeerMsg req = { .magic = PEER_MAGIC, .size = G, .seed = { UINT32_C(0xbad0bad0) } }, report;
        char check[128];
        CUdevice b;
        Peer p;

        if (!pair_device(role, &b))
                return;
        if (!pair_can_access(b) && strcmp(role, "pair-read-only-write") == 0) {
                fprintf(stderr, "info: %s: not run: device %d cannot reach the memory at all\n", role, (int)b);
                return;
        }
        p = peer_start(role);
        ASSERT_OK(msg_send(p.sock, &req, -1));
        peer_finish(&p, &report);
        snprintf(check, sizeof(check), "memset through the peer's context, %s", what);
        observe(check, (CUresult)report.result[0]);
        snprintf(check, sizeof(check), "synchronize the peer's context after its memset, %s", what);
        observe(check, (CUresult)report.result[1]);
        ck_assert_msg(report.result[0] != CUDA_SUCCESS || report.result[1] != CUDA_SUCCESS,
                      "Device %d wrote device %d's memory %s, and its context synchronized without error.", (int)b,
                      (int)gpu.info.device, what);
}

START_TEST(pair_peer_without_access_writes) {
        pair_write_refused("pair-no-access", "mapped without access for it");
}
END_TEST

START_TEST(pair_peer_writes_read_only) {
        pair_write_refused("pair-read-only-write", "mapped read-only for it");
}
END_TEST

/*
 * Work on a stream of B's context with A's context current goes in B's context, as with none current
 * (stream_work_without_context): a memset of B's memory, a record of B's event, a wait for A's event (an event
 * may be another context's), the stream destroyed, all CUDA_SUCCESS. A record of A's event on B's stream is
 * CUDA_ERROR_INVALID_HANDLE (an event is recorded in its own context's streams), a memset of A's memory on it,
 * which B was not given, CUDA_ERROR_INVALID_VALUE. Measured on two H200s (driver 580.159.04), the same with a
 * second context of one device.
 */
START_TEST(pair_stream_work_in_its_own_context) {
        const uint32_t word = UINT32_C(0x5eed0023);
        CUdeviceptr mine, theirs;
        CUresult r[7];
        uint32_t got = 0;
        CUcontext cb;
        CUevent ea, eb;
        CUstream sb;
        CUdevice b;

        if (!pair_device("pair_stream_work_in_its_own_context", &b))
                return;
        ASSERT_CU(gpu.cu->cuMemAlloc(&mine, MiB));
        ASSERT_CU(gpu.cu->cuEventCreate(&ea, CU_EVENT_DISABLE_TIMING));
        ASSERT_CU(gpu.cu->cuEventRecord(ea, NULL));
        ASSERT_OK(gpu_enter_device(b, &cb));
        ASSERT_CU(gpu.cu->cuMemAlloc(&theirs, MiB));
        ASSERT_CU(gpu.cu->cuStreamCreate(&sb, CU_STREAM_NON_BLOCKING));
        ASSERT_CU(gpu.cu->cuEventCreate(&eb, CU_EVENT_DISABLE_TIMING));
        ASSERT_OK(gpu_leave_device());

        r[0] = gpu.cu->cuMemsetD32Async(theirs, word, MiB / sizeof(uint32_t), sb);
        r[1] = gpu.cu->cuEventRecord(eb, sb);
        r[2] = gpu.cu->cuStreamWaitEvent(sb, ea, 0);
        r[3] = gpu.cu->cuEventRecord(ea, sb);
        r[4] = gpu.cu->cuMemsetD32Async(mine, word, 1, sb);
        r[5] = gpu.cu->cuStreamSynchronize(sb);
        r[6] = gpu.cu->cuStreamDestroy(sb);
        expect_result("queue a memset of B's memory on B's stream, A's context current", r[0], CUDA_SUCCESS);
        expect_result("record B's event on B's stream, A's context current", r[1], CUDA_SUCCESS);
        expect_result("make B's stream wait for A's event, A's context current", r[2], CUDA_SUCCESS);
        expect_result("record A's event on B's stream", r[3], CUDA_ERROR_INVALID_HANDLE);
        expect_result("queue a memset of A's memory (not B's to write) on B's stream", r[4], CUDA_ERROR_INVALID_VALUE);
        expect_result("synchronize B's stream, A's context current", r[5], CUDA_SUCCESS);
        expect_result("destroy B's stream, A's context current", r[6], CUDA_SUCCESS);

        ASSERT_OK(gpu_enter_device(b, &cb));
        ASSERT_CU(gpu.cu->cuMemcpyDtoH(&got, theirs, sizeof(got)));
        ck_assert_msg(got == word, "B's memory holds %#x after the memset queued on B's stream, not %#x", got, word);
        ASSERT_CU(gpu.cu->cuEventDestroy(eb));
        ASSERT_CU(gpu.cu->cuMemFree(theirs));
        ASSERT_OK(gpu_leave_device());
        ASSERT_CU(gpu.cu->cuDevicePrimaryCtxRelease(b));
        ASSERT_CU(gpu.cu->cuEventDestroy(ea));
        ASSERT_CU(gpu.cu->cuMemFree(mine));
}
END_TEST

/*
 * --- 14. Host memory, where a parked lease's content lives (the parking notes; cuda_host_prop()).
 *
 * The daemon creates host slabs on the device's NUMA node (CU_MEM_LOCATION_TYPE_HOST_NUMA), keeps them as
 * exported fds, maps them (imported, after a restart) with access for the device, and copies between them and
 * device slabs with cuMemcpyDtoDAsync on its stream. The granularity is 2 MiB on an H100; the checks ask only
 * for a power of two.
 */

/* The minimum granularity of host slabs on this device's node. */
static size_t host_granularity(size_t *ret_recommended) {
        CUmemAllocationProp prop = cuda_host_prop(gpu.info.numa_node);
        size_t minimum = 0, recommended = 0;

        ASSERT_CU(gpu.cu->cuMemGetAllocationGranularity(&minimum, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
        ASSERT_CU(gpu.cu->cuMemGetAllocationGranularity(&recommended, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
        if (ret_recommended)
                *ret_recommended = recommended;
        return minimum;
}

START_TEST(host_numa_granularity) {
        char m[FORMAT_SIZE_MAX], rm[FORMAT_SIZE_MAX], text[RESULT_NAME_MAX];
        size_t minimum, recommended = 0;
        int supported = -1;
        CUresult r;

        /* Report only: whether the device says it can (cuMemCreate below is what the broker relies on). */
        r = gpu.cu->cuDeviceGetAttribute(&supported, CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                         gpu.info.device);
        observe_text("host NUMA virtual memory management supported (report only)",
                     r != CUDA_SUCCESS ? result_name(r, text, sizeof(text)) : supported ? "yes" : "no");

        minimum = host_granularity(&recommended);
        fprintf(stderr, "info: host NUMA node %d (device's %d): granularity minimum %s (%zu), recommended %s (%zu)\n",
                cuda_host_prop(gpu.info.numa_node).location.id, gpu.info.numa_node, size_text(minimum, m, sizeof(m)),
                minimum, size_text(recommended, rm, sizeof(rm)), recommended);
        observe_text("host NUMA granularity a power of two", IS_POWER_OF_2(minimum) ? "yes" : "no");
        ck_assert_msg(IS_POWER_OF_2(minimum), "host granularity %zu is not a power of two", minimum);
        ck_assert_msg(recommended >= minimum && recommended % minimum == 0,
                      "recommended host granularity %zu is not a multiple of the minimum %zu", recommended, minimum);
}
END_TEST

/*
 * A 64 MiB host slab: created, exported, imported and mapped with access for the device; a memset on it, then a
 * pattern copied device -> host -> device with cuMemcpyDtoDAsync (the device memory cleared in between) reads
 * back bit-identical on both sides.
 */
START_TEST(host_numa_round_trip) {
        const size_t size = 64 * MiB;
        const uint32_t seed = UINT32_C(0x9a4ced01), fill = UINT32_C(0xa5a5a5a5);
        CUmemGenericAllocationHandle host, imported, dev;
        _cleanup_close_ int fd = -EBADF;
        CUdeviceptr host_va, dev_va;
        CUstream stream;
        bool same;

        ck_assert_uint_eq(size % host_granularity(NULL), 0);
        ASSERT_OK(mem_create_host(size, &host));
        ASSERT_OK(mem_export(host, &fd));
        ASSERT_OK(mem_import(fd, &imported));
        ASSERT_OK(mem_map(imported, size, &host_va));   /* read-write access for this device */
        ASSERT_OK(mem_release(imported));
        ASSERT_CU(gpu.cu->cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));

        ASSERT_CU(gpu.cu->cuMemsetD8Async(host_va, 0xa5, size, stream));
        ASSERT_CU(gpu.cu->cuStreamSynchronize(stream));
        ASSERT_OK(mem_check_fill(host_va, size, fill, "host memory after cuMemsetD8Async"));

        ASSERT_OK(mem_create(size, &dev));
        ASSERT_OK(mem_map(dev, size, &dev_va));
        ASSERT_OK(mem_write_pattern(dev_va, size, seed));
        ASSERT_CU(gpu.cu->cuMemcpyDtoDAsync(host_va, dev_va, size, stream));
        ASSERT_CU(gpu.cu->cuMemsetD8Async(dev_va, 0, size, stream));
        ASSERT_CU(gpu.cu->cuMemcpyDtoDAsync(dev_va, host_va, size, stream));
        ASSERT_CU(gpu.cu->cuStreamSynchronize(stream));
        same = mem_check_pattern(host_va, size, seed, "host memory copied from device memory") &&
               mem_check_pattern(dev_va, size, seed, "device memory copied back from host memory");
        observe_text("device to host to device memory with cuMemcpyDtoDAsync", same ? "bit-identical" : "different");
        ASSERT_OK(same);

        ASSERT_CU(gpu.cu->cuStreamDestroy(stream));
        ASSERT_OK(mem_unmap(dev_va, size));
        ASSERT_OK(mem_unmap(host_va, size));
        ASSERT_OK(mem_release(dev));
        ASSERT_OK(mem_release(host));
}
END_TEST

/*
 * A NUMA node that no machine has. The documentation names no code (the id "must specify the NUMA ID of the
 * CPU"); the check asks that it fail and prints the code (the simulator: CUDA_ERROR_INVALID_VALUE).
 */
START_TEST(host_numa_bad_node) {
        CUmemAllocationProp prop = cuda_host_prop(4096);
        CUmemGenericAllocationHandle h;
        CUresult r;

        r = gpu.cu->cuMemCreate(&h, host_granularity(NULL), &prop, 0);
        if (r == CUDA_SUCCESS)
                (void)gpu.cu->cuMemRelease(h);
        observe("create host memory on NUMA node 4096", r);
        ck_assert_msg(r != CUDA_SUCCESS, "cuMemCreate made host memory on NUMA node 4096.");
}
END_TEST

/* --- The suite. */

static TCase *tcase(Suite *s, const char *name) {
        TCase *tc = tcase_create(name);

        tcase_add_checked_fixture(tc, setup, teardown); /* in the forked test process, never the runner */
        tcase_set_timeout(tc, TCASE_TIMEOUT);
        suite_add_tcase(s, tc);
        return tc;
}

static Suite *conformance_suite(void) {
        Suite *s = suite_create("conformance");
        TCase *tc;

        tc = tcase(s, "device");
        tcase_add_test(tc, device_supports_vmm_and_fds);

        tc = tcase(s, "round_trip");
        tcase_add_test(tc, round_trip_2mib);
        tcase_add_test(tc, round_trip_64mib);

        tc = tcase(s, "fresh");
        tcase_add_test(tc, fresh_allocations_read_zero);

        tc = tcase(s, "sharing");
        tcase_add_test(tc, import_in_another_process);
        tcase_add_test(tc, fd_outlives_its_exporter);
        tcase_add_test(tc, import_same_fd_twice);
        tcase_add_test(tc, export_once_send_many);

        tc = tcase(s, "mapping");
        tcase_add_test(tc, release_while_mapped);
        tcase_add_test(tc, contiguous_allocations_in_one_range);
        tcase_add_test(tc, driver_layer_maps_fds);
        tcase_add_test(tc, driver_layer_maps_odd_sizes);

        tc = tcase(s, "rules");
        tcase_add_test(tc, create_size_not_a_granularity_multiple);
        tcase_add_test(tc, reserve_size_not_a_page_multiple);
        tcase_add_test(tc, reserve_size_not_a_granularity_multiple);
        tcase_add_test(tc, reserve_alignment_not_a_power_of_two);
        tcase_add_test(tc, map_with_nonzero_offset);
        tcase_add_test(tc, map_part_of_an_allocation);
        tcase_add_test(tc, map_at_unaligned_address);
        tcase_add_test(tc, map_over_a_mapped_range);
        tcase_add_test(tc, map_outside_a_reservation);
        tcase_add_test(tc, unmap_part_of_a_mapping);
        tcase_add_test(tc, set_access_on_a_partly_mapped_range);
        tcase_add_test(tc, address_free_while_mapped);

        tc = tcase(s, "access");
        tcase_add_test(tc, no_access_before_set_access);
        tcase_add_test(tc, unmap_with_work_queued);

        tc = tcase(s, "peers");
        tcase_add_test(tc, can_access_peer_itself_and_nothing);
        tcase_add_test(tc, set_access_for_a_device_that_does_not_exist);

        tc = tcase(s, "budget");
        tcase_add_test(tc, device_memory_budget);

        tc = tcase(s, "streams");
        tcase_add_test(tc, async_memset_then_host_function);
        tcase_add_test(tc, wait_event_orders_two_streams);
        tcase_add_test(tc, stream_synchronized_without_context);
        tcase_add_test(tc, stream_work_without_context);

        tc = tcase(s, "host");
        tcase_add_test(tc, host_numa_granularity);
        tcase_add_test(tc, host_numa_round_trip);
        tcase_add_test(tc, host_numa_bad_node);

        tc = tcase(s, "pair");
        tcase_add_test(tc, pair_write_through_the_other_device);
        tcase_add_test(tc, pair_read_only_peer_reads);
        tcase_add_test(tc, pair_peer_without_access_writes);
        tcase_add_test(tc, pair_peer_writes_read_only);
        tcase_add_test(tc, pair_stream_work_in_its_own_context);

        return s;
}

int main(int argc, char **argv) {
        const char *lib = getenv(CUDA_DRIVER_LIBRARY_ENV);
        SRunner *sr;
        int failed;

        if (argc >= 2 && strcmp(argv[1], "--peer") == 0) {
                char *end = NULL;
                long fd;

                if (argc != 4) {
                        fprintf(stderr, "usage: %s --peer ROLE FD\n", program_invocation_short_name);
                        return 2;
                }
                errno = 0;
                fd = strtol(argv[3], &end, 10);
                if (errno != 0 || !end || *end != '\0' || fd < 0 || fd > INT32_MAX) {
                        fprintf(stderr, "%s: bad socket fd \"%s\"\n", program_invocation_short_name, argv[3]);
                        return 2;
                }
                return peer_main(argv[2], (int)fd);
        }

        /* Nothing here loads the driver: each test does, in its own process. */
        fprintf(stderr, "info: driver under test: %s\n",
                lib && *lib ? lib : CUDA_DRIVER_LIBRARY " (the system's, " CUDA_DRIVER_LIBRARY_ENV " unset)");
        sr = srunner_create(conformance_suite());
        if (srunner_fork_status(sr) == CK_NOFORK)
                fprintf(stderr, "info: CK_FORK=no: every test shares one process; on a real GPU a failure in "
                                "one check can break the checks after it.\n");
        srunner_run_all(sr, CK_VERBOSE);
        failed = srunner_ntests_failed(sr);
        srunner_free(sr);
        return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
