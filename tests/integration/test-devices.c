/* SPDX-License-Identifier: MIT */

/*
 * Several devices (issue 18), end to end on four simulated devices
 * (SIMCUDA_DEVICES=4): where an Alloc that names no single device goes under
 * Placement=most-free and Placement=first, Alloc's `devices` set, the named
 * errors for what a hostile client sends in it, per-device limits passing a
 * device over, vmmb_alloc_among() in libvmmbroker, and leases several devices
 * of a process use (vmmb_lease_grant_access(), simulated peer access set by
 * SIMCUDA_PEERS), and Placement=nearest over devices on NUMA nodes 0,0,1,1
 * (SIMCUDA_NUMA) with a fake sysfs (VMMBROKER_SYSFS_ROOT). Each test starts its
 * own daemon with its own configuration (harness.h) and drives it with raw
 * varlink (rawclient.h).
 *
 * The tests of the tcase "pair" need two devices or more, however many: two
 * simulated ones in CI, every GPU of a machine against the real driver (a
 * lease on each device, most-free spreading leases, one device writing and
 * reading another's lease); the others say they did not run there.
 */

#include <check.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "codec.h"
#include "driver.h"
#include "json.h"
#include "harness.h"
#include "macro.h"
#include "rawclient.h"
#include "unit.h"
#include "vmmbroker.h"

#define MiB (UINT64_C(1) << 20)
#define N_DEVICES 4

typedef struct Daemon {
        Harness h;
} Daemon;

/* Starts a daemon on N_DEVICES simulated devices with `config` as its configuration file. */
static void start_with(Daemon *d, const char *config) {
        int k;

        ck_assert_int_eq(setenv("SIMCUDA_DEVICES", "4", 1), 0);
        k = harness_start_config(&d->h, config, NULL);
        ck_assert_int_eq(unsetenv("SIMCUDA_DEVICES"), 0);
        ck_assert_msg(k == 0, "harness_start: %s", strerror(-k));
}

static void stop(Daemon *d) {
        ck_assert_int_eq(harness_stop(&d->h), 0);
}

/* Whether the daemon can be given four devices: only the simulated driver's SIMCUDA_DEVICES can. */
static bool four_devices(const char *test) {
        const char *lib = getenv("VMMBROKER_LIBCUDA");

        if (lib && strstr(lib, "simcuda"))
                return true;
        fprintf(stderr, "%s: not run: it needs the simulated driver's four devices\n", test);
        return false;
}

/* Calls Alloc with `params` (JSON text). Returns the lease's device, or -1 with *ret_error set (strdup'd). */
static int64_t alloc(VarlinkConn *c, const char *params, char **ret_error, VmmbError *ret_e) {
        _cleanup_free_ char *message = NULL;
        AllocReply ar = {};
        int64_t device;
        Reply r;

        ck_assert_int_eq(call_text(c, VMMB_METHOD_ALLOC, params, &r), 0);
        if (r.error) {
                ck_assert_uint_eq(r.n_fds, 0);
                ck_assert_ptr_nonnull(ret_error);
                *ret_error = strdup(r.error);
                if (ret_e)
                        ck_assert_int_eq(vmmb_error_decode(r.error, r.params, ret_e, &message), 0);
                reply_done(&r);
                return -1;
        }
        ck_assert_msg(alloc_reply_decode(r.params, r.n_fds, &ar, &message) == 0, "Alloc reply: %s", message);
        device = ar.lease.device;
        alloc_reply_done(&ar);
        reply_done(&r);                 /* closes the fds: the lease stays, held by this process */
        return device;
}

/* Alloc that must succeed: its device. */
static int64_t alloc_ok(VarlinkConn *c, const char *params) {
        _cleanup_free_ char *error = NULL;
        int64_t device = alloc(c, params, &error, NULL);

        ck_assert_msg(device >= 0, "Alloc(%s): %s", params, error);
        return device;
}

/* Alloc that must fail with `error`; fills *ret_e with its parameters. */
static void alloc_fails(VarlinkConn *c, const char *params, const char *error, VmmbError *ret_e) {
        _cleanup_free_ char *got = NULL;
        VmmbError e = {};

        ck_assert_msg(alloc(c, params, &got, &e) < 0, "Alloc(%s) succeeded", params);
        ck_assert_msg(strcmp(got, error) == 0, "Alloc(%s): %s, expected %s", params, got, error);
        if (ret_e)
                *ret_e = e;
        else
                vmmb_error_done(&e);
}

static char *status_placement(VarlinkConn *c) {
        _cleanup_free_ char *message = NULL;
        StatusReply s = {};
        char *placement;
        Reply r;

        ck_assert_int_eq(call_text(c, VMMB_METHOD_STATUS, NULL, &r), 0);
        ck_assert_ptr_null(r.error);
        ck_assert_msg(status_reply_decode(r.params, &s, &message) == 0, "Status reply: %s", message);
        ck_assert_uint_eq(s.n_devices, N_DEVICES);
        ck_assert_ptr_nonnull(s.placement);
        placement = strdup(s.placement);
        status_reply_done(&s);
        reply_done(&r);
        return placement;
}

/* most-free, the default: leases spread over the devices, each to the one with the most room. */
START_TEST(test_most_free_spreads) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        _cleanup_free_ char *placement = NULL;
        Daemon d;

        if (!four_devices("test_most_free_spreads"))
                return;
        start_with(&d, "[Broker]\nCapacity=64M\n[Limits]\nMaxBytes=100%\n");
        ck_assert_int_eq(conn_open(d.h.socket, &c), 0);
        placement = status_placement(c);
        ck_assert_str_eq(placement, "most-free");

        for (int64_t i = 0; i < N_DEVICES; i++)         /* all equal: ties to the lowest index, then the next */
                ck_assert_int_eq(alloc_ok(c, "{\"size\": 16777216}"), i);
        ck_assert_int_eq(alloc_ok(c, "{\"size\": 33554432}"), 0);      /* all at 48M: device 0 */
        ck_assert_int_eq(alloc_ok(c, "{\"size\": 2097152}"), 1);       /* 0 has 16M left, the others 48M */
        ck_assert_int_eq(alloc_ok(c, "{\"size\": 2097152}"), 2);
        /* An explicit device is not placed. */
        ck_assert_int_eq(alloc_ok(c, "{\"size\": 2097152, \"device\": 0}"), 0);
        stop(&d);
}
END_TEST

/* first: every placed lease on device 0, until it is full; then OutOfMemory naming device 0. */
START_TEST(test_first_keeps_device_0) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        _cleanup_free_ char *placement = NULL;
        VmmbError e;
        Daemon d;

        if (!four_devices("test_first_keeps_device_0"))
                return;
        start_with(&d, "[Broker]\nCapacity=64M\nPlacement=first\n[Limits]\nMaxBytes=1G\n");
        ck_assert_int_eq(conn_open(d.h.socket, &c), 0);
        placement = status_placement(c);
        ck_assert_str_eq(placement, "first");
        for (int i = 0; i < 4; i++)
                ck_assert_int_eq(alloc_ok(c, "{\"size\": 16777216}"), 0);
        alloc_fails(c, "{\"size\": 2097152}", VMMB_ERROR_OUT_OF_MEMORY, &e);
        ck_assert_int_eq(e.device, 0);
        vmmb_error_done(&e);
        /* The user is over no limit: device 0 is full, not passed over. The first of a set, in the order the
         * daemon serves them (not the order given). */
        ck_assert_int_eq(alloc_ok(c, "{\"size\": 2097152, \"devices\": [3, 2]}"), 2);
        stop(&d);
}
END_TEST

/* A set restricts the choice, placed among it by most-free; duplicates count once; [] is no set. */
START_TEST(test_set_restricts) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        Daemon d;

        if (!four_devices("test_set_restricts"))
                return;
        start_with(&d, "[Broker]\nCapacity=64M\n[Limits]\nMaxBytes=100%\n");
        ck_assert_int_eq(conn_open(d.h.socket, &c), 0);
        ck_assert_int_eq(alloc_ok(c, "{\"size\": 8388608, \"devices\": [2, 3]}"), 2);
        ck_assert_int_eq(alloc_ok(c, "{\"size\": 8388608, \"devices\": [2, 3]}"), 3);
        ck_assert_int_eq(alloc_ok(c, "{\"size\": 8388608, \"devices\": [3, 2]}"), 2);
        ck_assert_int_eq(alloc_ok(c, "{\"size\": 2097152, \"devices\": [3, 3, 3, 3]}"), 3);
        ck_assert_int_eq(alloc_ok(c, "{\"size\": 2097152, \"devices\": [1]}"), 1);
        ck_assert_int_eq(alloc_ok(c, "{\"size\": 2097152, \"devices\": []}"), 0);   /* the emptiest: 0 */
        stop(&d);
}
END_TEST

/* What a hostile client may send in the set: each a named error, nothing leased, the daemon unharmed. */
START_TEST(test_set_refusals) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        char big[1024];
        size_t n = 0;
        VmmbError e;
        Daemon d;

        if (!four_devices("test_set_refusals"))
                return;
        start_with(&d, "[Broker]\nCapacity=64M\n[Limits]\nMaxBytes=100%\n");
        ck_assert_int_eq(conn_open(d.h.socket, &c), 0);

        alloc_fails(c, "{\"size\": 2097152, \"devices\": [1, 9]}", VMMB_ERROR_NO_SUCH_DEVICE, &e);
        ck_assert_int_eq(e.device, 9);
        vmmb_error_done(&e);
        alloc_fails(c, "{\"size\": 2097152, \"devices\": [1099511627776]}", VMMB_ERROR_NO_SUCH_DEVICE, &e);
        ck_assert_int_eq(e.device, INT64_C(1099511627776));
        vmmb_error_done(&e);
        alloc_fails(c, "{\"size\": 2097152, \"devices\": [0, -1]}", VMMB_ERROR_INVALID_PARAMETER, &e);
        ck_assert_str_eq(e.parameter, "devices");
        vmmb_error_done(&e);
        alloc_fails(c, "{\"size\": 2097152, \"devices\": [0, \"1\"]}", VMMB_ERROR_INVALID_PARAMETER, &e);
        ck_assert_str_eq(e.parameter, "devices");
        vmmb_error_done(&e);
        alloc_fails(c, "{\"size\": 2097152, \"devices\": 1}", VMMB_ERROR_INVALID_PARAMETER, &e);
        ck_assert_str_eq(e.parameter, "devices");
        vmmb_error_done(&e);
        alloc_fails(c, "{\"size\": 2097152, \"device\": 1, \"devices\": [1]}", VMMB_ERROR_INVALID_PARAMETER, &e);
        ck_assert_str_eq(e.parameter, "devices");
        vmmb_error_done(&e);

        /* 65 entries: one more than the bound. 64 (all valid, duplicates) are taken. */
        n += (size_t)snprintf(big + n, sizeof(big) - n, "{\"size\": 2097152, \"devices\": [0");
        for (int i = 1; i < 65; i++)
                n += (size_t)snprintf(big + n, sizeof(big) - n, ", %d", i % N_DEVICES);
        snprintf(big + n, sizeof(big) - n, "]}");
        alloc_fails(c, big, VMMB_ERROR_INVALID_PARAMETER, &e);
        ck_assert_str_eq(e.parameter, "devices");
        vmmb_error_done(&e);
        *strrchr(big, ',') = '\0';
        strcat(big, "]}");
        ck_assert_int_eq(alloc_ok(c, big), 0);

        /* More than any device of the set can hold: InvalidParameter naming the size. */
        alloc_fails(c, "{\"size\": 134217728, \"devices\": [1, 2]}", VMMB_ERROR_INVALID_PARAMETER, &e);
        ck_assert_str_eq(e.parameter, "size");
        vmmb_error_done(&e);

        /* The daemon still serves, and nothing else was leased. */
        ck_assert_int_eq(alloc_ok(c, "{\"size\": 2097152, \"devices\": [1, 2]}"), 1);
        stop(&d);
}
END_TEST

/*
 * Limits per device: a device where the user is at MaxBytes= is passed over for the next in the rule's
 * order (first, here: with one user the device it is at its limit on never has the most room); when every
 * device of the set is refused, QuotaExceeded naming the first refused.
 */
START_TEST(test_quota_per_device) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        VmmbError e;
        Daemon d;

        if (!four_devices("test_quota_per_device"))
                return;
        start_with(&d, "[Broker]\nCapacity=64M\nPlacement=first\n[Limits]\nMaxBytes=32M\n");
        ck_assert_int_eq(conn_open(d.h.socket, &c), 0);
        ck_assert_int_eq(alloc_ok(c, "{\"size\": 33554432}"), 0);
        ck_assert_int_eq(alloc_ok(c, "{\"size\": 2097152}"), 1);              /* 0 passed over */
        alloc_fails(c, "{\"size\": 2097152, \"devices\": [0]}", VMMB_ERROR_QUOTA_EXCEEDED, NULL);
        ck_assert_int_eq(alloc_ok(c, "{\"size\": 31457280, \"devices\": [1, 0]}"), 1);
        alloc_fails(c, "{\"size\": 2097152, \"devices\": [1, 0]}", VMMB_ERROR_QUOTA_EXCEEDED, &e);
        ck_assert_str_eq(e.resource, "bytes");
        ck_assert_uint_eq(e.limit, 32 * MiB);
        ck_assert_uint_eq(e.current, 32 * MiB);
        ck_assert_msg(strstr(e.message, "device 0"), "%s", e.message);  /* the first refused */
        vmmb_error_done(&e);
        /* The user's limit on one device leaves the others: device 2 is still open to it. */
        ck_assert_int_eq(alloc_ok(c, "{\"size\": 2097152, \"devices\": [1, 0, 2]}"), 2);
        stop(&d);
}
END_TEST

/* Status's devices (n of them) into ret[]. */
static void status_devices(const char *socket, WireDevice *ret, size_t n) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        StatusReply s = {};
        Reply r;

        ck_assert_int_eq(conn_open(socket, &c), 0);
        ck_assert_int_eq(call_text(c, VMMB_METHOD_STATUS, NULL, &r), 0);
        ck_assert_ptr_null(r.error);
        ck_assert_int_eq(status_reply_decode(r.params, &s, NULL), 0);
        ck_assert_uint_eq(s.n_devices, n);
        for (size_t i = 0; i < n; i++)
                ret[i] = (WireDevice){ .index = s.devices[i].index, .waiters = s.devices[i].waiters,
                                       .numa_node = s.devices[i].numa_node };
        status_reply_done(&s);
        reply_done(&r);
}

/* Alloc that must succeed: its lease's id, in id[]. */
static void alloc_id(VarlinkConn *c, const char *params, char id[static VMMB_ID_MAX + 1]) {
        TestLease l;
        Reply r;

        ck_assert_int_eq(call_text(c, VMMB_METHOD_ALLOC, params, &r), 0);
        ck_assert_msg(!r.error, "Alloc(%s): %s", params, r.error);
        ck_assert_int_eq(lease_take(&r, &l), 0);
        memcpy(id, l.id, VMMB_ID_MAX + 1);
        test_lease_close(&l);
        reply_done(&r);
}

/*
 * A placed Alloc that waits waits on the device placement picked, and is served there only: room coming back
 * on another device of its set does not serve it.
 */
START_TEST(test_placed_wait_stays) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL, *w = NULL;
        _cleanup_(json_object_putp) json_object *msg = NULL, *call_params = NULL;
        char ids[N_DEVICES][VMMB_ID_MAX + 1], params[64];
        _cleanup_free_ char *message = NULL;
        WireDevice devs[N_DEVICES];
        AllocReply ar = {};
        unsigned i;
        Reply r;
        Daemon d;

        if (!four_devices("test_placed_wait_stays"))
                return;
        start_with(&d, "[Broker]\nCapacity=64M\n[Limits]\nMaxBytes=1G\n");
        ck_assert_int_eq(conn_open(d.h.socket, &c), 0);
        ck_assert_int_eq(conn_open(d.h.socket, &w), 0);
        for (i = 0; i < N_DEVICES; i++) {
                snprintf(params, sizeof(params), "{\"size\": 67108864, \"device\": %u}", i);
                alloc_id(c, params, ids[i]);
        }
        call_params = json_tokener_parse("{\"size\": 2097152, \"devices\": [3, 2], \"wait_usec\": 60000000}");
        ck_assert_ptr_nonnull(call_params);
        ck_assert_int_eq(varlink_call_new(VMMB_METHOD_ALLOC, call_params, false, false, &msg), 0);
        ck_assert_int_eq(varlink_conn_send(w, msg, NULL, 0), 0);
        ck_assert_int_eq(varlink_conn_flush(w), 0);
        /* Every device is full and equally so: the tie goes to the lower index, 2. Status is answered
         * after the Alloc was read only once the daemon has queued it: poll (bounded, no sleep). */
        for (uint64_t end = harness_poll_deadline(); harness_now_msec() < end;) {
                status_devices(d.h.socket, devs, N_DEVICES);
                if (devs[2].waiters == 1)
                        break;
        }
        ck_assert_int_eq(devs[2].waiters, 1);
        ck_assert_int_eq(devs[3].waiters, 0);

        /* Room on device 3: not where it waits. */
        ck_assert_int_eq(lease_free(c, ids[3]), 0);
        /* The room is real once its scrub is done (waiting for it, not racing it). */
        ck_assert_int_eq(alloc_ok(c, "{\"size\": 2097152, \"device\": 3, \"wait_usec\": 60000000}"), 3);
        status_devices(d.h.socket, devs, N_DEVICES);
        ck_assert_int_eq(devs[2].waiters, 1);

        /* Room on device 2: served there. */
        ck_assert_int_eq(lease_free(c, ids[2]), 0);
        {
                _cleanup_(json_object_putp) json_object *reply = NULL;
                VarlinkReply vr = {};
                int *fds = NULL;
                size_t n_fds = 0;

                ck_assert_int_eq(varlink_conn_receive(w, &reply, &fds, &n_fds), 1);
                ck_assert_int_eq(varlink_reply_parse(reply, &vr), 0);
                ck_assert_msg(!vr.error, "the waiting Alloc: %s", vr.error);
                ck_assert_msg(alloc_reply_decode(vr.parameters, n_fds, &ar, &message) == 0, "%s", message);
                ck_assert_int_eq(ar.lease.device, 2);
                alloc_reply_done(&ar);
                varlink_reply_done(&vr);
                r = (Reply){ .params = json_object_new_object(), .fds = fds, .n_fds = n_fds };
                reply_done(&r);
        }
        stop(&d);
}
END_TEST

/* libvmmbroker's vmmb_alloc_among(): placed in the set, mapped, and its refusals. */
START_TEST(test_client_alloc_among) {
        vmmb_client *client = NULL;
        vmmb_lease *l1 = NULL, *l2 = NULL, *bad = NULL;
        static const int set[] = { 3, 1 };
        int neg[] = { 2, -1 }, many[65] = {};
        Daemon d;

        if (!four_devices("test_client_alloc_among"))
                return;
        start_with(&d, "[Broker]\nCapacity=64M\n[Limits]\nMaxBytes=100%\n");
        ck_assert_int_eq(setenv("SIMCUDA_DEVICES", "4", 1), 0);        /* this process maps on device 3 too */
        ck_assert_int_eq(vmmb_connect(d.h.socket, &client), 0);
        ck_assert_int_eq(vmmb_alloc_among(client, 4 * MiB, set, 2, "among", 0, &l1), 0);
        ck_assert_int_eq(vmmb_lease_device(l1), 1);
        ck_assert_int_eq(vmmb_alloc_among(client, 4 * MiB, set, 2, NULL, 0, &l2), 0);
        ck_assert_int_eq(vmmb_lease_device(l2), 3);
        ck_assert_int_eq(vmmb_alloc_among(client, 4 * MiB, neg, 2, NULL, 0, &bad), -ENODEV);
        ck_assert_int_eq(vmmb_alloc_among(client, 4 * MiB, many, 65, NULL, 0, &bad), -EINVAL);
        ck_assert_int_eq(vmmb_alloc_among(client, 4 * MiB, NULL, 1, NULL, 0, &bad), -EINVAL);
        neg[1] = 7;
        ck_assert_int_eq(vmmb_alloc_among(client, 4 * MiB, neg, 2, NULL, 0, &bad), -ENODEV);
        ck_assert_ptr_nonnull(strstr(vmmb_error_message(), "7"));
        ck_assert_ptr_null(bad);
        ck_assert_int_eq(vmmb_free(l1), 0);
        ck_assert_int_eq(vmmb_free(l2), 0);
        vmmb_close(client);
        stop(&d);
}
END_TEST

/* The most devices whose contexts a test holds: as many as one vmmb_lease_grant_access() may name. */
#define DEVICES_MAX VMMB_ACCESS_MAX

/* The driver of this process (the one libvmmbroker loaded: the same devices) and a primary context each. */
typedef struct Devices {
        CudaDriver *cu;
        int n;                          /* devices 0 .. n-1 have their primary context retained */
        CUcontext ctx[DEVICES_MAX];
} Devices;

/* Retains the primary context of devices 0 .. n-1 of the driver opened in dv->cu. */
static void devices_retain(Devices *dv, int n) {
        ck_assert_int_le(n, DEVICES_MAX);
        for (dv->n = 0; dv->n < n; dv->n++)
                ck_assert_int_eq(dv->cu->cuDevicePrimaryCtxRetain(&dv->ctx[dv->n], dv->n), CUDA_SUCCESS);
}

static void devices_open(Devices *dv) {
        _cleanup_free_ char *message = NULL;

        ck_assert_msg(cuda_driver_open(&dv->cu, NULL, &message) == 0, "%s", message);
        devices_retain(dv, N_DEVICES);
}

static void devices_close(Devices *dv) {
        ck_assert_int_eq(dv->cu->cuCtxSetCurrent(NULL), CUDA_SUCCESS);
        for (int i = 0; i < dv->n; i++)
                ck_assert_int_eq(dv->cu->cuDevicePrimaryCtxRelease(i), CUDA_SUCCESS);
        dv->n = 0;
        dv->cu = cuda_driver_close(dv->cu);
}

/* cuMemsetD32 of `words` words at `ptr` through `device`'s context: the driver's result. */
static CUresult memset_on(Devices *dv, int device, uint64_t ptr, uint32_t value, size_t words) {
        ck_assert_int_eq(dv->cu->cuCtxSetCurrent(dv->ctx[device]), CUDA_SUCCESS);
        return dv->cu->cuMemsetD32((CUdeviceptr)ptr, value, words);
}

/* Reads the word at `ptr` through `device`'s context; CUDA_SUCCESS or the driver's refusal. */
static CUresult read_on(Devices *dv, int device, uint64_t ptr, uint32_t *ret) {
        ck_assert_int_eq(dv->cu->cuCtxSetCurrent(dv->ctx[device]), CUDA_SUCCESS);
        return dv->cu->cuMemcpyDtoH(ret, (CUdeviceptr)ptr, sizeof(*ret));
}

/*
 * vmmb_lease_grant_access(): a lease on device 2 written through device 3's context once granted (and not
 * before), read back through device 2; a device not named stays without access; a read-only hold gives
 * read-only access; hostile lists change nothing; vmmb_free() unmaps a range with several devices' access.
 */
START_TEST(test_client_grant_access) {
        vmmb_client *client = NULL;
        vmmb_lease *l = NULL, *ro = NULL;
        char token[VMMB_TOKEN_SIZE];
        int three[] = { 3, 3, 2 }, bad[] = { 3, -1 }, many[VMMB_ACCESS_MAX + 1] = {};
        uint32_t word = 0;
        uint64_t p, size;
        Devices dv = {};
        Daemon d;

        if (!four_devices("test_client_grant_access"))
                return;
        start_with(&d, "[Broker]\nCapacity=64M\n[Limits]\nMaxBytes=100%\n");
        ck_assert_int_eq(setenv("SIMCUDA_DEVICES", "4", 1), 0);        /* every pair can: SIMCUDA_PEERS=all */
        ck_assert_int_eq(vmmb_connect(d.h.socket, &client), 0);
        ck_assert_int_eq(vmmb_alloc(client, 4 * MiB, 2, "peers", &l), 0);
        p = vmmb_lease_ptr(l);
        size = vmmb_lease_size(l);
        devices_open(&dv);

        ck_assert_int_eq(memset_on(&dv, 3, p, 0x33333333, size / 4), CUDA_ERROR_INVALID_VALUE);  /* not yet */
        ck_assert_int_eq(vmmb_lease_grant_access(l, three, ELEMENTSOF(three)), 0);
        ck_assert_int_eq(memset_on(&dv, 3, p, 0x33333333, size / 4), CUDA_SUCCESS);
        ck_assert_int_eq(read_on(&dv, 2, p + size - 4, &word), CUDA_SUCCESS);
        ck_assert_uint_eq(word, 0x33333333);
        ck_assert_int_eq(memset_on(&dv, 2, p, 0x22222222, 1), CUDA_SUCCESS);     /* its own device kept access */
        ck_assert_int_eq(memset_on(&dv, 1, p, 0x11111111, 1), CUDA_ERROR_INVALID_VALUE); /* never named */
        ck_assert_int_eq(read_on(&dv, 3, p, &word), CUDA_SUCCESS);
        ck_assert_uint_eq(word, 0x22222222);

        /* hostile lists: refused before the driver is asked, nothing changes */
        ck_assert_int_eq(vmmb_lease_grant_access(l, bad, ELEMENTSOF(bad)), -ENODEV);
        ck_assert_ptr_nonnull(strstr(vmmb_error_message(), "-1"));
        bad[1] = N_DEVICES;
        ck_assert_int_eq(vmmb_lease_grant_access(l, bad, ELEMENTSOF(bad)), -ENODEV);
        ck_assert_ptr_nonnull(strstr(vmmb_error_message(), "No CUDA device 4"));
        bad[1] = INT32_MIN;
        ck_assert_int_eq(vmmb_lease_grant_access(l, bad, ELEMENTSOF(bad)), -ENODEV);
        ck_assert_int_eq(vmmb_lease_grant_access(l, many, ELEMENTSOF(many)), -EINVAL);
        ck_assert_int_eq(vmmb_lease_grant_access(l, many, SIZE_MAX), -EINVAL);
        ck_assert_int_eq(vmmb_lease_grant_access(l, NULL, 1), -EINVAL);
        ck_assert_int_eq(vmmb_lease_grant_access(NULL, three, 1), -EINVAL);
        ck_assert_int_eq(vmmb_lease_grant_access(l, NULL, 0), 0);
        ck_assert_int_eq(vmmb_lease_grant_access(l, many, VMMB_ACCESS_MAX), 0);  /* device 0, 64 times */
        ck_assert_int_eq(memset_on(&dv, 0, p, 0x00000000, 1), CUDA_SUCCESS);
        ck_assert_int_eq(memset_on(&dv, 1, p, 0x11111111, 1), CUDA_ERROR_INVALID_VALUE);

        /* a read-only hold of the same lease, mapped again in this process: its peers read only */
        ck_assert_int_eq(vmmb_share(l, VMMB_ANY_UID, VMMB_READONLY, token), 0);
        ck_assert_int_eq(vmmb_attach(client, token, VMMB_READONLY, &ro), 0);
        ck_assert_int_eq(vmmb_lease_grant_access(ro, (const int[]){ 1 }, 1), 0);
        ck_assert_int_eq(read_on(&dv, 1, vmmb_lease_ptr(ro) + 4, &word), CUDA_SUCCESS);
        ck_assert_uint_eq(word, 0x33333333);
        ck_assert_int_eq(memset_on(&dv, 1, vmmb_lease_ptr(ro), 0x11111111, 1), CUDA_ERROR_INVALID_VALUE);
        ck_assert_int_eq(memset_on(&dv, 2, vmmb_lease_ptr(ro), 0x22222222, 1), CUDA_ERROR_INVALID_VALUE);
        ck_assert_int_eq(vmmb_free(ro), 0);

        /* one cuMemUnmap per slab takes every device's access with the mapping */
        ck_assert_int_eq(vmmb_free(l), 0);
        ck_assert_int_eq(memset_on(&dv, 3, p, 0x33333333, 1), CUDA_ERROR_INVALID_VALUE);
        ck_assert_int_eq(memset_on(&dv, 2, p, 0x22222222, 1), CUDA_ERROR_INVALID_VALUE);
        devices_close(&dv);
        vmmb_close(client);
        stop(&d);
}
END_TEST

/*
 * A device that cannot reach the lease's device (SIMCUDA_PEERS=1-2: only devices 1 and 2 reach each other):
 * -EOPNOTSUPP naming the pair, and nothing changed: the device named before it in the same call has no
 * access either, and the lease still works on its own device.
 */
START_TEST(test_client_grant_access_refused) {
        vmmb_client *client = NULL;
        vmmb_lease *l = NULL;
        uint32_t word = 0;
        Devices dv = {};
        Daemon d;
        uint64_t p;

        if (!four_devices("test_client_grant_access_refused"))
                return;
        start_with(&d, "[Broker]\nCapacity=64M\n[Limits]\nMaxBytes=100%\n");
        ck_assert_int_eq(setenv("SIMCUDA_DEVICES", "4", 1), 0);
        ck_assert_int_eq(setenv("SIMCUDA_PEERS", "1-2", 1), 0);
        ck_assert_int_eq(vmmb_connect(d.h.socket, &client), 0);
        ck_assert_int_eq(vmmb_alloc(client, 4 * MiB, 2, NULL, &l), 0);
        p = vmmb_lease_ptr(l);
        devices_open(&dv);

        ck_assert_int_eq(vmmb_lease_grant_access(l, (const int[]){ 1, 3 }, 2), -EOPNOTSUPP);
        ck_assert_msg(strstr(vmmb_error_message(), "Device 3 cannot access device 2's memory (cuDeviceCanAccessPeer "
                                                   "says no)"), "%s", vmmb_error_message());
        ck_assert_int_eq(memset_on(&dv, 1, p, 0x11111111, 1), CUDA_ERROR_INVALID_VALUE);
        ck_assert_int_eq(memset_on(&dv, 3, p, 0x33333333, 1), CUDA_ERROR_INVALID_VALUE);
        ck_assert_int_eq(memset_on(&dv, 2, p, 0x22222222, 1), CUDA_SUCCESS);
        ck_assert_int_eq(read_on(&dv, 2, p, &word), CUDA_SUCCESS);
        ck_assert_uint_eq(word, 0x22222222);
        ck_assert_int_eq(vmmb_lease_grant_access(l, (const int[]){ 0 }, 1), -EOPNOTSUPP);
        ck_assert_int_eq(vmmb_lease_grant_access(l, (const int[]){ 1 }, 1), 0);
        ck_assert_int_eq(memset_on(&dv, 1, p, 0x11111111, 1), CUDA_SUCCESS);
        ck_assert_int_eq(vmmb_free(l), 0);
        devices_close(&dv);
        vmmb_close(client);
        stop(&d);
}
END_TEST

/*
 * A fake sysfs under root (a mkdtemp template, filled in) where node `all` lists every CPU this process may
 * run on and the other node of 0 and 1 none: the caller is on node `all` only.
 */
static void fake_sysfs(char root[static 32], int all) {
        static const char *const dirs[] = { "devices", "devices/system", "devices/system/node",
                                            "devices/system/node/node0", "devices/system/node/node1" };
        char path[128];
        FILE *f;

        snprintf(root, 32, "/tmp/vmmb-sysfs-XXXXXX");
        ck_assert_ptr_nonnull(mkdtemp(root));
        for (size_t i = 0; i < ELEMENTSOF(dirs); i++) {
                snprintf(path, sizeof(path), "%s/%s", root, dirs[i]);
                ck_assert_int_eq(mkdir(path, 0755), 0);
        }
        for (int node = 0; node < 2; node++) {
                snprintf(path, sizeof(path), "%s/devices/system/node/node%d/cpulist", root, node);
                f = fopen(path, "we");
                ck_assert_ptr_nonnull(f);
                fputs(node == all ? "0-8191\n" : "\n", f);
                ck_assert_int_eq(fclose(f), 0);
        }
}

static void fake_sysfs_remove(const char *root) {
        char path[128];

        for (int node = 0; node < 2; node++) {
                snprintf(path, sizeof(path), "%s/devices/system/node/node%d/cpulist", root, node);
                ck_assert_int_eq(unlink(path), 0);
                snprintf(path, sizeof(path), "%s/devices/system/node/node%d", root, node);
                ck_assert_int_eq(rmdir(path), 0);
        }
        snprintf(path, sizeof(path), "%s/devices/system/node", root);
        ck_assert_int_eq(rmdir(path), 0);
        snprintf(path, sizeof(path), "%s/devices/system", root);
        ck_assert_int_eq(rmdir(path), 0);
        snprintf(path, sizeof(path), "%s/devices", root);
        ck_assert_int_eq(rmdir(path), 0);
        ck_assert_int_eq(rmdir(root), 0);
}

/* Starts a Placement=nearest daemon on devices on nodes 0,0,1,1, the caller on node `caller` (-1: no sysfs). */
static void start_nearest(Daemon *d, char root[static 32], int caller) {
        if (caller >= 0)
                fake_sysfs(root, caller);
        else
                snprintf(root, 32, "/nonexistent/vmmb-sysfs");
        ck_assert_int_eq(setenv("SIMCUDA_NUMA", "0,0,1,1", 1), 0);
        ck_assert_int_eq(setenv("VMMBROKER_SYSFS_ROOT", root, 1), 0);
        start_with(d, "[Broker]\nCapacity=64M\nPlacement=nearest\n[Limits]\nMaxBytes=1G\n");
        ck_assert_int_eq(unsetenv("SIMCUDA_NUMA"), 0);
        ck_assert_int_eq(unsetenv("VMMBROKER_SYSFS_ROOT"), 0);
}

/* nearest: the devices on the caller's node first, most-free among them; a full one ends the search. */
START_TEST(test_nearest) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        _cleanup_free_ char *placement = NULL;
        WireDevice devs[N_DEVICES];
        char root[32];
        VmmbError e;
        Daemon d;

        if (!four_devices("test_nearest"))
                return;
        start_nearest(&d, root, 1);
        ck_assert_int_eq(conn_open(d.h.socket, &c), 0);
        placement = status_placement(c);
        ck_assert_str_eq(placement, "nearest");
        status_devices(d.h.socket, devs, N_DEVICES);
        for (size_t i = 0; i < N_DEVICES; i++)
                ck_assert_int_eq(devs[i].numa_node, i < 2 ? 0 : 1);

        ck_assert_int_eq(alloc_ok(c, "{\"size\": 16777216}"), 2);      /* node 1: 2 and 3 tie, the lower */
        ck_assert_int_eq(alloc_ok(c, "{\"size\": 16777216}"), 3);      /* 3 has more room than 2 */
        ck_assert_int_eq(alloc_ok(c, "{\"size\": 33554432}"), 2);      /* a tie again: 2 has 16M left */
        ck_assert_int_eq(alloc_ok(c, "{\"size\": 16777216}"), 3);      /* 3 has 48M: 32M left */
        ck_assert_int_eq(alloc_ok(c, "{\"size\": 16777216}"), 3);      /* 16M left each */
        /* Devices 2 and 3 nearly full, 0 and 1 empty: the near devices still go first. */
        ck_assert_int_eq(alloc_ok(c, "{\"size\": 16777216}"), 2);
        ck_assert_int_eq(alloc_ok(c, "{\"size\": 16777216}"), 3);
        /* Both near devices full: OutOfMemory on the first of them; the far ones are not tried. */
        alloc_fails(c, "{\"size\": 2097152}", VMMB_ERROR_OUT_OF_MEMORY, &e);
        ck_assert_int_eq(e.device, 2);
        vmmb_error_done(&e);
        /* A set without a near device: most-free among it. */
        ck_assert_int_eq(alloc_ok(c, "{\"size\": 2097152, \"devices\": [1, 0]}"), 0);
        ck_assert_int_eq(alloc_ok(c, "{\"size\": 2097152, \"devices\": [1, 0]}"), 1);
        stop(&d);
        fake_sysfs_remove(root);

        /* The caller on node 0. */
        start_nearest(&d, root, 0);
        varlink_conn_free(TAKE_PTR(c));
        ck_assert_int_eq(conn_open(d.h.socket, &c), 0);
        ck_assert_int_eq(alloc_ok(c, "{\"size\": 16777216}"), 0);
        ck_assert_int_eq(alloc_ok(c, "{\"size\": 16777216}"), 1);
        ck_assert_int_eq(alloc_ok(c, "{\"size\": 16777216, \"devices\": [3, 2]}"), 2);
        stop(&d);
        fake_sysfs_remove(root);

        /* No NUMA in sysfs: nodes unknown, most-free over all. */
        start_nearest(&d, root, -1);
        varlink_conn_free(TAKE_PTR(c));
        ck_assert_int_eq(conn_open(d.h.socket, &c), 0);
        ck_assert_int_eq(alloc_ok(c, "{\"size\": 16777216}"), 0);
        ck_assert_int_eq(alloc_ok(c, "{\"size\": 16777216}"), 1);
        ck_assert_int_eq(alloc_ok(c, "{\"size\": 16777216}"), 2);
        stop(&d);
}
END_TEST

/*
 * A Status of more devices than method_status() builds on its stack (8): 12 simulated devices, one lease on
 * device 10, read both ways the library and vmmctl read it (the text reader, status_call(); json-c,
 * status_reply_decode()): every device once, in order, the lease where it is, the two reads the same.
 */
START_TEST(test_status_many_devices) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        _cleanup_free_ char *message = NULL;
        StatusReply text = {}, tree = {};
        Daemon d;
        Reply r;
        int k;

        if (!four_devices("test_status_many_devices"))
                return;
        ck_assert_int_eq(setenv("SIMCUDA_DEVICES", "12", 1), 0);
        k = harness_start_config(&d.h, "[Broker]\nCapacity=64M\n[Limits]\nMaxBytes=100%\n", NULL);
        ck_assert_int_eq(unsetenv("SIMCUDA_DEVICES"), 0);
        ck_assert_msg(k == 0, "harness_start: %s", strerror(-k));
        ck_assert_int_eq(conn_open(d.h.socket, &c), 0);
        ck_assert_int_eq(alloc_ok(c, "{\"size\": 4194304, \"device\": 10}"), 10);

        ck_assert_int_eq(status_call(c, &text), 0);
        ck_assert_int_eq(call_text(c, VMMB_METHOD_STATUS, NULL, &r), 0);
        ck_assert_ptr_null(r.error);
        ck_assert_msg(status_reply_decode(r.params, &tree, &message) == 0, "Status reply: %s", message);
        reply_done(&r);
        ck_assert_uint_eq(text.n_devices, 12);
        ck_assert_uint_eq(tree.n_devices, 12);
        for (size_t i = 0; i < 12; i++) {
                WireDevice *a = &text.devices[i], *b = &tree.devices[i];

                ck_assert_int_eq(a->index, (int64_t)i);
                ck_assert_uint_eq(a->capacity, 64 * MiB);
                ck_assert_uint_eq(a->leased, i == 10 ? 4 * MiB : 0);
                ck_assert_uint_eq(a->leases, i == 10 ? 1 : 0);
                /* the two reads agree on every field */
                ck_assert_int_eq(b->index, a->index);
                ck_assert_str_eq(b->name, a->name);
                ck_assert_uint_eq(b->total, a->total);
                ck_assert_uint_eq(b->granularity, a->granularity);
                ck_assert_uint_eq(b->capacity, a->capacity);
                ck_assert_uint_eq(b->leased, a->leased);
                ck_assert_uint_eq(b->scrubbing, a->scrubbing);
                ck_assert_uint_eq(b->cached, a->cached);
                ck_assert_uint_eq(b->leases, a->leases);
                ck_assert_int_eq(b->waiters, a->waiters);
                ck_assert_int_eq(b->numa_node, a->numa_node);
                ck_assert_int_eq(b->host_capacity, a->host_capacity);
                ck_assert_int_eq(b->parked, a->parked);
                ck_assert_int_eq(b->host_cached, a->host_cached);
                ck_assert_int_eq(b->kept, a->kept);
        }
        ck_assert_str_eq(tree.placement, text.placement);
        status_reply_done(&text);
        status_reply_done(&tree);
        ck_assert_int_eq(harness_stop(&d.h), 0);
}
END_TEST

/*
 * The pair tests: several devices with however many (two or more) the driver of this process has, so that the
 * same binary runs in CI on two simulated devices and on a machine of real GPUs against the real driver
 * (VMMBROKER_LIBCUDA unset, VMMBROKER_DAEMON naming the build's vmmbrokerd). They only make accesses the
 * driver allows: on a real GPU a write through a device without access, or through a read-only mapping, is a
 * fault that can be sticky and break the context of this process for the tests after it.
 */

#define PAIR_LEASE (64 * MiB)           /* a multiple of the 2 MiB granularity of real GPUs */
/* Room for 2 leases of PAIR_LEASE on each device (test_pair_most_free_spreads) and some more; 100%: no user's
 * limit refuses what the devices hold. */
#define PAIR_CONFIG "[Broker]\nCapacity=256M\n[Limits]\nMaxBytes=100%\n"

/*
 * Opens the driver of this process with a primary context on each of its devices: true when it has two or
 * more. The simulated driver is given two (SIMCUDA_DEVICES, read when this process first loads it; the daemon
 * started after inherits it); the real one is asked how many it has. False, and why on stderr, with fewer.
 */
static bool pair_open(const char *test, Devices *dv) {
        const char *lib = getenv("VMMBROKER_LIBCUDA");
        bool simulated = lib && strstr(lib, "simcuda");
        _cleanup_free_ char *message = NULL;
        int count = 0, k;

        *dv = (Devices){};
        if (simulated)
                ck_assert_int_eq(setenv("SIMCUDA_DEVICES", "2", 1), 0);
        k = cuda_driver_open(&dv->cu, NULL, &message);
        /* the real driver of a machine without a GPU fails cuInit (no device); the simulated one must load */
        ck_assert_msg(k == 0 || !simulated, "%s", message);
        if (k < 0) {
                fprintf(stderr, "%s: not run: it needs two devices, the driver has 0 (%s)\n", test, message);
                return false;
        }
        ck_assert_int_eq(dv->cu->cuDeviceGetCount(&count), CUDA_SUCCESS);
        if (count < 2) {
                fprintf(stderr, "%s: not run: it needs two devices, the driver has %d\n", test, count);
                dv->cu = cuda_driver_close(dv->cu);
                return false;
        }
        devices_retain(dv, count);
        return true;
}

/* Starts a daemon with PAIR_CONFIG on the devices pair_open() found, and connects to it. */
static vmmb_client *pair_start(Daemon *d) {
        vmmb_client *client = NULL;
        int k = harness_start_config(&d->h, PAIR_CONFIG, NULL);

        ck_assert_msg(k == 0, "harness_start: %s", strerror(-k));
        ck_assert_int_eq(vmmb_connect(d->h.socket, &client), 0);
        return client;
}

/* Ends what pair_open() and pair_start() began: the client closed, the devices released, the daemon stopped. */
static void pair_stop(Daemon *d, Devices *dv, vmmb_client *client) {
        vmmb_close(client);
        devices_close(dv);
        stop(d);
}

/*
 * Through `device`'s context: sets the `size` bytes at `ptr` to the 32-bit `value` and waits for it, so that
 * a read through another context (another stream) comes after the write.
 */
static void fill_on(Devices *dv, int device, uint64_t ptr, uint64_t size, uint32_t value) {
        ck_assert_int_eq(memset_on(dv, device, ptr, value, size / 4), CUDA_SUCCESS);
        ck_assert_int_eq(dv->cu->cuCtxSynchronize(), CUDA_SUCCESS);
}

/*
 * Reads the `size` bytes at `ptr` through `device`'s context, all of them: each must be a word `value`. One
 * check for the whole range (a ck_assert per word would cost more than the copy).
 */
static void holds_on(Devices *dv, int device, uint64_t ptr, uint64_t size, uint32_t value) {
        _cleanup_free_ uint32_t *buf = malloc(size);
        size_t i, n = size / 4;

        ck_assert_ptr_nonnull(buf);
        ck_assert_int_eq(dv->cu->cuCtxSetCurrent(dv->ctx[device]), CUDA_SUCCESS);
        ck_assert_int_eq(dv->cu->cuMemcpyDtoH(buf, (CUdeviceptr)ptr, size), CUDA_SUCCESS);
        for (i = 0; i < n && buf[i] == value; i++)
                ;
        ck_assert_msg(i == n, "device %d reads 0x%08" PRIx32 " at byte %zu of %" PRIu64 " at 0x%" PRIx64
                      ", expected 0x%08" PRIx32, device, i < n ? buf[i] : 0, i * 4, size, ptr, value);
}

/* Status must list the n devices of the driver, each with `leases` leases of `bytes` together. */
static void status_each(const char *socket, int n, uint64_t leases, uint64_t bytes) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        StatusReply s = {};

        ck_assert_int_eq(conn_open(socket, &c), 0);
        ck_assert_int_eq(status_call(c, &s), 0);
        ck_assert_uint_eq(s.n_devices, (size_t)n);
        for (size_t i = 0; i < s.n_devices; i++) {
                ck_assert_int_eq(s.devices[i].index, (int64_t)i);
                ck_assert_msg(s.devices[i].leases == leases && s.devices[i].leased == bytes,
                              "device %zu: %" PRIu64 " leases of %" PRIu64 " bytes, expected %" PRIu64 " of %" PRIu64,
                              i, s.devices[i].leases, s.devices[i].leased, leases, bytes);
        }
        status_reply_done(&s);
}

/*
 * A lease on each device, asked for by its index: there, reads zero, holds what that device's context writes;
 * Status counts one lease on each. The patterns differ per device, so that leases sharing memory would show.
 */
START_TEST(test_pair_lease_on_each_device) {
        vmmb_lease *l[DEVICES_MAX] = {};
        vmmb_client *client;
        Devices dv;
        Daemon d;
        int i;

        if (!pair_open("test_pair_lease_on_each_device", &dv))
                return;
        client = pair_start(&d);
        for (i = 0; i < dv.n; i++) {
                uint64_t p;

                ck_assert_int_eq(vmmb_alloc(client, PAIR_LEASE, i, "pair", &l[i]), 0);
                ck_assert_int_eq(vmmb_lease_device(l[i]), i);
                ck_assert_uint_eq(vmmb_lease_size(l[i]), PAIR_LEASE);
                p = vmmb_lease_ptr(l[i]);
                holds_on(&dv, i, p, PAIR_LEASE, 0);
                fill_on(&dv, i, p, PAIR_LEASE, 0xd0d0d000u | (uint32_t)i);
                holds_on(&dv, i, p, PAIR_LEASE, 0xd0d0d000u | (uint32_t)i);
        }
        status_each(d.h.socket, dv.n, 1, PAIR_LEASE);
        /* every device's lease still holds its own pattern after the others were written */
        for (i = 0; i < dv.n; i++)
                holds_on(&dv, i, vmmb_lease_ptr(l[i]), PAIR_LEASE, 0xd0d0d000u | (uint32_t)i);
        for (i = 0; i < dv.n; i++)
                ck_assert_int_eq(vmmb_free(l[i]), 0);
        status_each(d.h.socket, dv.n, 0, 0);
        pair_stop(&d, &dv, client);
}
END_TEST

/*
 * most-free, the default, through the library with VMMB_ANY_DEVICE: 2 * N leases of one size on N devices of
 * equal capacity go 2 to each (under Placement=first all would go to device 0, which holds 4).
 */
START_TEST(test_pair_most_free_spreads) {
        vmmb_lease *l[2 * DEVICES_MAX] = {};
        unsigned on[DEVICES_MAX] = {};
        vmmb_client *client;
        Devices dv;
        Daemon d;
        int i;

        if (!pair_open("test_pair_most_free_spreads", &dv))
                return;
        client = pair_start(&d);
        for (i = 0; i < 2 * dv.n; i++) {
                int device;

                ck_assert_int_eq(vmmb_alloc(client, PAIR_LEASE, VMMB_ANY_DEVICE, "spread", &l[i]), 0);
                device = vmmb_lease_device(l[i]);
                ck_assert_msg(device >= 0 && device < dv.n, "lease %d placed on device %d", i, device);
                on[device]++;
        }
        for (i = 0; i < dv.n; i++)
                ck_assert_msg(on[i] == 2, "device %d got %u of the %d leases, expected 2", i, on[i], 2 * dv.n);
        status_each(d.h.socket, dv.n, 2, 2 * PAIR_LEASE);
        for (i = 0; i < 2 * dv.n; i++)
                ck_assert_int_eq(vmmb_free(l[i]), 0);
        pair_stop(&d, &dv, client);
}
END_TEST

/* One direction of test_pair_peer_write_read: a lease on device a, used by device b. */
static void peer_write_read(Devices *dv, vmmb_client *client, int a, int b) {
        const uint32_t by_b = 0x1d1d1d1du ^ (uint32_t)a, by_a = 0x0a0a0a0au ^ (uint32_t)a;
        vmmb_lease *l = NULL, *ro = NULL;
        char token[VMMB_TOKEN_SIZE], want[128];
        int can = -1, count = dv->n;
        uint64_t p;

        ck_assert_int_eq(vmmb_alloc(client, PAIR_LEASE, a, "peer", &l), 0);
        ck_assert_int_eq(vmmb_lease_device(l), a);
        p = vmmb_lease_ptr(l);
        ck_assert_int_eq(dv->cu->cuDeviceCanAccessPeer(&can, b, a), CUDA_SUCCESS);
        if (!can) {
                /* refused, naming the pair, and nothing changed: the lease works on its own device */
                ck_assert_int_eq(vmmb_lease_grant_access(l, &b, 1), -EOPNOTSUPP);
                snprintf(want, sizeof(want), "Device %d cannot access device %d's memory (cuDeviceCanAccessPeer "
                         "says no)", b, a);
                ck_assert_msg(strstr(vmmb_error_message(), want), "%s", vmmb_error_message());
                fill_on(dv, a, p, PAIR_LEASE, by_a);
                holds_on(dv, a, p, PAIR_LEASE, by_a);
                ck_assert_int_eq(vmmb_free(l), 0);
                fprintf(stderr, "info: device %d cannot access device %d's memory\n", b, a);
                return;
        }

        ck_assert_int_eq(vmmb_lease_grant_access(l, &b, 1), 0);
        holds_on(dv, b, p, PAIR_LEASE, 0);                      /* b reads the new lease: zero */
        fill_on(dv, b, p, PAIR_LEASE, by_b);
        holds_on(dv, a, p, PAIR_LEASE, by_b);                   /* b's writes are in a's memory */
        fill_on(dv, a, p, PAIR_LEASE, by_a);
        holds_on(dv, b, p, PAIR_LEASE, by_a);

        /* A read-only hold of the same lease, mapped again in this process at an address of its own and given to
         * b read-only: b reads a's writes through it. Nothing writes through it: that would fault on a GPU. */
        ck_assert_int_eq(vmmb_share(l, VMMB_ANY_UID, VMMB_READONLY, token), 0);
        ck_assert_int_eq(vmmb_attach(client, token, VMMB_READONLY, &ro), 0);
        ck_assert_int_eq(vmmb_lease_device(ro), a);
        ck_assert_int_eq(vmmb_lease_readonly(ro), 1);
        ck_assert_uint_ne(vmmb_lease_ptr(ro), p);
        ck_assert_int_eq(vmmb_lease_grant_access(ro, &b, 1), 0);
        holds_on(dv, b, vmmb_lease_ptr(ro), PAIR_LEASE, by_a);

        /* Hostile lists: refused before the driver is asked; the lease as it was, on a and on b. */
        ck_assert_int_eq(vmmb_lease_grant_access(l, &count, 1), -ENODEV);
        snprintf(want, sizeof(want), "No CUDA device %d ", count);
        ck_assert_msg(strstr(vmmb_error_message(), want), "%s", vmmb_error_message());
        ck_assert_int_eq(vmmb_lease_grant_access(l, (const int[]){ -1 }, 1), -ENODEV);
        ck_assert_int_eq(vmmb_lease_grant_access(l, NULL, 1), -EINVAL);
        fill_on(dv, a, p, PAIR_LEASE, by_b);
        holds_on(dv, a, p, PAIR_LEASE, by_b);
        holds_on(dv, b, p, PAIR_LEASE, by_b);
        holds_on(dv, b, vmmb_lease_ptr(ro), PAIR_LEASE, by_b);

        ck_assert_int_eq(vmmb_free(ro), 0);
        ck_assert_int_eq(vmmb_free(l), 0);
}

/*
 * vmmb_lease_grant_access() between devices 0 and 1, both ways: a lease on one written through the other's
 * context and read back through its own, and the other way round; a read-only hold given to the other device
 * reads it; hostile lists refused. Where the driver says a device cannot access the other's memory
 * (cuDeviceCanAccessPeer), the grant must be refused naming the pair, and that direction ends there.
 */
START_TEST(test_pair_peer_write_read) {
        vmmb_client *client;
        Devices dv;
        Daemon d;

        if (!pair_open("test_pair_peer_write_read", &dv))
                return;
        client = pair_start(&d);
        peer_write_read(&dv, client, 0, 1);
        peer_write_read(&dv, client, 1, 0);
        status_each(d.h.socket, dv.n, 0, 0);
        pair_stop(&d, &dv, client);
}
END_TEST

int main(void) {
        Suite *s = UNIT_SUITE("devices", NULL, test_status_many_devices, test_most_free_spreads,
                              test_first_keeps_device_0, test_set_restricts, test_set_refusals, test_quota_per_device,
                              test_placed_wait_stays, test_client_alloc_among, test_client_grant_access,
                              test_client_grant_access_refused, test_nearest);
        TCase *pair = tcase_create("pair");

        /* On real GPUs a daemon's start and a context per device take seconds; check's default is 4 s when
         * CK_DEFAULT_TIMEOUT (the meson test's 60) is not set. */
        tcase_set_timeout(pair, 120);
        tcase_add_test(pair, test_pair_lease_on_each_device);
        tcase_add_test(pair, test_pair_most_free_spreads);
        tcase_add_test(pair, test_pair_peer_write_read);
        suite_add_tcase(s, pair);
        return run_suite(s) == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
