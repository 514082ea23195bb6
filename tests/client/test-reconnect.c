/* SPDX-License-Identifier: MIT */

/*
 * libvmmbroker across a lost connection (issue 7, "Clients"): the broker
 * restarted under a client, stopped while a call waits for it, gone for good;
 * and which calls the library sends again.
 *
 * The restarts run the real daemon on the simulated device under the test
 * supervisor (tests/supervisor), which keeps the listening socket across
 * restarts as systemd's socket unit does, and the fds the daemon stores (its
 * slabs and lease table), so that leases survive the restart. The rule for sending a call
 * again depends on how the broker went away, which a real daemon does not do
 * on cue: those tests put a fake broker on a socket of the test's own, which
 * reads or does not read a call and closes the connection, and check what the
 * library did on the next connections.
 *
 * Each test runs in a process of its own (Check forks). The calls that block
 * run on a thread (client_op_start()) while the main thread plays the broker
 * or restarts it; every wait has a timeout.
 */

#include <check.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "clienttest.h"
#include "codec.h"
#include "driver.h"
#include "harness.h"
#include "macro.h"
#include "rawclient.h"
#include "supervisor.h"
#include "unit.h"
#include "varlink.h"
#include "vmmbroker.h"

#define WAIT_MS 30000                   /* failure guard on every wait for the library or the daemon */
#define READY_MS 60000
#define LEASE_ID "00112233445566778899aabbccddeeff"     /* the fake broker's lease */

static char dir[64];                    /* private: the fake's socket, the daemon's unused paths */

static void setup(void) {
        strcpy(dir, "/tmp/vmmb-reconnect-XXXXXX");
        ck_assert_ptr_nonnull(mkdtemp(dir));
        driver_open_or_fail();
}

static void teardown(void) {
        char path[128];

        driver_close();
        snprintf(path, sizeof(path), "%s/fake", dir);
        (void)unlink(path);
        (void)rmdir(dir);
}

/* ---- the daemon under the supervisor ------------------------------------------------------------------- */

static Supervisor *daemon_start(void) {
        const char *daemon = getenv("VMMBROKER_DAEMON");
        char unused[128], config[128];
        Supervisor *s = NULL;
        int64_t ready;
        int k;

        ck_assert_msg(daemon, "VMMBROKER_DAEMON is not set");
        /* The socket comes from the supervisor: --socket names a path the daemon must leave alone; the
         * configuration file does not exist, so the host's plays no part. */
        snprintf(unused, sizeof(unused), "%s/not-inherited", dir);
        snprintf(config, sizeof(config), "%s/vmmbroker.conf", dir);
        k = supervisor_new(&(SupervisorOptions){
                .path = daemon,
                .argv = (const char *const[]){ daemon, "--socket", unused, "--config", config, NULL },
                .fd_store_max = 4096,
        }, &s);
        ck_assert_msg(k == 0, "supervisor_new: %s", strerror(-k));
        ck_assert_int_eq(supervisor_start(s), 0);
        ready = supervisor_wait_ready(s, READY_MS);
        ck_assert_msg(ready >= 0, "the daemon did not get ready: %s", strerror((int)-ready));
        return s;
}

/* ---- a call on a thread of its own --------------------------------------------------------------------- */

typedef enum Op {
        OP_ALLOC, OP_FREE, OP_PUBLISH, OP_UNPUBLISH, OP_REVOKE, OP_TOKENS, OP_PARK, OP_FREE_KEEP, OP_GIVE_BACK_KEPT,
        OP_MARK, OP_UNMARK,
} Op;

typedef struct ClientOp {
        pthread_t thread;
        Op op;
        vmmb_client *client;
        vmmb_lease *lease;              /* OP_FREE, OP_PUBLISH, OP_TOKENS, OP_PARK, OP_FREE_KEEP, OP_MARK, OP_UNMARK:
                                           the lease; OP_ALLOC: the result */
        vmmb_token *tokens;             /* OP_TOKENS: the result */
        size_t n_tokens;
        int result;
        char message[1024];             /* vmmb_error_message() of the thread */
} ClientOp;

static void *client_op_run(void *arg) {
        ClientOp *o = arg;

        switch (o->op) {
        case OP_ALLOC:
                o->result = vmmb_alloc(o->client, 2 * MiB, 0, "on a thread", &o->lease);
                break;
        case OP_FREE:
                o->result = vmmb_free(o->lease);
                o->lease = NULL;
                break;
        case OP_PUBLISH:
                o->result = vmmb_publish(o->lease, "team.weights", NULL, 0, 0);
                break;
        case OP_UNPUBLISH:
                o->result = vmmb_unpublish(o->client, "team.weights");
                break;
        case OP_REVOKE:
                o->result = vmmb_revoke(o->client, "0123456789abcdef0123456789abcdef");
                break;
        case OP_TOKENS:
                o->result = vmmb_tokens(o->lease, &o->tokens, &o->n_tokens);
                break;
        case OP_PARK:
                o->result = vmmb_lease_park(o->lease, NULL);
                break;
        case OP_FREE_KEEP:
                o->result = vmmb_free_keep(o->lease);
                o->lease = NULL;
                break;
        case OP_GIVE_BACK_KEPT:
                o->result = vmmb_give_back_kept(o->client);
                break;
        case OP_MARK:
                o->result = vmmb_lease_set_reclaimable(o->lease, 3, NULL, NULL);
                break;
        case OP_UNMARK:
                o->result = vmmb_lease_set_reclaimable(o->lease, VMMB_NOT_RECLAIMABLE, NULL, NULL);
                break;
        }
        snprintf(o->message, sizeof(o->message), "%s", vmmb_error_message());
        return NULL;
}

static void client_op_start(ClientOp *o, Op op, vmmb_client *c, vmmb_lease *l) {
        *o = (ClientOp){ .op = op, .client = c, .lease = l };
        ck_assert_int_eq(pthread_create(&o->thread, NULL, client_op_run, o), 0);
}

/* Joins the call's thread and returns what the call returned. */
static int client_op_finish(ClientOp *o) {
        ck_assert_int_eq(pthread_join(o->thread, NULL), 0);
        return o->result;
}

/* ---- a fake broker ------------------------------------------------------------------------------------- */

/* Waits for fd to be readable; false after WAIT_MS (or timeout_ms when not negative). */
static bool readable(int fd, int timeout_ms) {
        struct pollfd p = { .fd = fd, .events = POLLIN };
        int k;

        do
                k = poll(&p, 1, timeout_ms < 0 ? WAIT_MS : timeout_ms);
        while (k < 0 && errno == EINTR);
        ck_assert_int_ge(k, 0);
        return k == 1;
}

/* A listening socket at <dir>/fake, bound anew (a stale file is removed first). */
static int fake_listen(char path[static 128]) {
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        int fd;

        snprintf(path, 128, "%s/fake", dir);
        (void)unlink(path);
        snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
        fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        ck_assert_int_ge(fd, 0);
        ck_assert_int_eq(bind(fd, (const struct sockaddr *)&sa, sizeof(sa)), 0);
        ck_assert_int_eq(listen(fd, 16), 0);
        return fd;
}

/* Accepts the client's next connection, as a varlink connection of the fake's; fails after WAIT_MS. */
static VarlinkConn *fake_accept(int listen_fd) {
        struct timeval tv = { .tv_sec = WAIT_MS / 1000 };
        VarlinkConn *vc = NULL;
        int fd;

        ck_assert_msg(readable(listen_fd, -1), "the client did not connect");
        fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC);
        ck_assert_int_ge(fd, 0);
        /* blocking, but a client that sends nothing fails the test instead of hanging it */
        ck_assert_int_eq(setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)), 0);
        ck_assert_int_eq(varlink_conn_new(&vc, fd, VARLINK_MAX_REQUEST, false), 0);
        return vc;
}

/* Whether the client connected again (a connection waits to be accepted), without waiting. */
static bool fake_pending(int listen_fd) {
        return readable(listen_fd, 0);
}

/* Reads the next call, which must be `method`; its parameters, serialised, in *ret_params (malloc'd). */
static void fake_read_call(VarlinkConn *vc, const char *method, char **ret_params) {
        _cleanup_(varlink_call_done) VarlinkCall call = {};
        json_object *msg = NULL;
        int k;

        k = varlink_conn_receive(vc, &msg, NULL, NULL);
        ck_assert_msg(k == 1, "reading the call: %s", strerror(-k));
        ck_assert_int_eq(varlink_call_parse(msg, &call), 0);
        json_object_put(msg);
        ck_assert_str_eq(call.method, method);
        if (ret_params) {
                *ret_params = strdup(call.parameters ? json_object_to_json_string_ext(call.parameters,
                                                                                     JSON_C_TO_STRING_PLAIN)
                                                     : "{}");
                ck_assert_ptr_nonnull(*ret_params);
        }
}

/* Closes the connection once the client's call has arrived, without reading it. */
static void fake_drop_unread(VarlinkConn *vc) {
        ck_assert_msg(readable(varlink_conn_get_fd(vc), -1), "the call did not come");
        varlink_conn_free(vc);
}

/* Sends a reply with `params` (NULL: empty), and fds with it. */
static void fake_reply(VarlinkConn *vc, json_object *params, const int *fds, size_t n_fds) {
        json_object *msg = NULL;

        ck_assert_int_eq(varlink_reply_new(params, &msg), 0);
        ck_assert_int_eq(varlink_conn_send(vc, msg, fds, n_fds), 0);
        json_object_put(msg);
        ck_assert_int_eq(varlink_conn_flush(vc), 0);
}

/* Answers an Alloc (or an Unpark) with lease `id`: the one 2 MiB slab of `handle`, exported. */
static void fake_reply_lease_id(VarlinkConn *vc, CUmemGenericAllocationHandle handle, const char *id) {
        WireSlab slab = { .size = 2 * MiB, .fd = 0 };
        AllocReply reply = { .lease = { .id = (char *)id, .device = 0, .size = 2 * MiB, .slabs = &slab,
                                        .n_slabs = 1 } };
        json_object *params = NULL;
        int fd = -EBADF;

        ck_assert_int_eq(cu->cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                         CUDA_SUCCESS);
        ck_assert_int_eq(alloc_reply_encode(&reply, &params), 0);
        fake_reply(vc, params, &fd, 1);
        json_object_put(params);
        safe_close(fd);
}

/* Answers an Alloc (or an Unpark) with the fake's lease: the one 2 MiB slab of `handle`, exported. */
static void fake_reply_lease(VarlinkConn *vc, CUmemGenericAllocationHandle handle) {
        fake_reply_lease_id(vc, handle, LEASE_ID);
}

/* Answers an Alloc with a lease of one 2 MiB slab made here: its handle in *ret_handle, for the caller to
 * release once the client has mapped it. */
static void fake_reply_alloc(VarlinkConn *vc, CUmemGenericAllocationHandle *ret_handle) {
        CUmemAllocationProp prop = cuda_slab_prop(0);

        ck_assert_int_eq(cu->cuMemCreate(ret_handle, 2 * MiB, &prop, 0), CUDA_SUCCESS);
        fake_reply_lease(vc, *ret_handle);
}

/* Answers GetInterfaceDescription with an io.vmmbroker of Free alone, or of Free, Park and Unpark. */
static void fake_reply_description(VarlinkConn *vc, bool parks) {
        json_object *params = json_object_new_object();

        ck_assert_ptr_nonnull(params);
        ck_assert_int_eq(json_object_object_add(params, "description", json_object_new_string(
                parks ? "interface io.vmmbroker\n\nmethod Free(id: string) -> ()\n"
                        "method Park(id: string) -> (parked: bool)\nmethod Unpark(id: string) -> (lease: Lease)\n"
                      : "interface io.vmmbroker\n\nmethod Free(id: string) -> ()\n")), 0);
        fake_reply(vc, params, NULL, 0);
        json_object_put(params);
}

/* A client of the fake, connected and accepted: the client in *ret_client, the fake's end returned. */
static VarlinkConn *fake_connect(int listen_fd, const char *path, vmmb_client **ret_client) {
        *ret_client = connect_or_fail(path);
        return fake_accept(listen_fd);
}

#define ck_assert_message_has(o, text) \
        ck_assert_msg(strstr((o)->message, (text)), "message: %s", (o)->message)

/*
 * This process's fds, less the supervisor's store (in this process too), once they hold still: the
 * daemon stores and unstores fds on its own when idle (the pool's spare slab), so the two are read until
 * a Status round trip changes neither (round trips, not sleeps; the bound is a failure guard).
 */
static int client_fds(Supervisor *s) {
        int last = -1;

        for (int i = 0; i < 1000; i++) {
                int stored = supervisor_store_count(s);
                int n = harness_fd_count(getpid()) - stored;

                if (n == last && supervisor_store_count(s) == stored)
                        return n;
                last = n;
                (void)daemon_leases(supervisor_socket_path(s));
        }
        return last;
}

/* ---- restarts of the real daemon ----------------------------------------------------------------------- */

/*
 * A client connected before restarts goes on without reconnecting by hand:
 * its lease stays mapped, readable and writable (the memory is held by the
 * process's own imported handles), and its next calls go to the new daemon.
 * _i: 0 restarts with SIGTERM, 1 with SIGKILL.
 */
START_TEST(test_restart) {
        int sig = _i == 0 ? SIGTERM : SIGKILL;
        Supervisor *s = daemon_start();
        vmmb_client *c = connect_or_fail(supervisor_socket_path(s));
        vmmb_lease *kept = alloc_or_fail(c, 4 * MiB, 0, "reconnect");
        char token[VMMB_TOKEN_SIZE];
        int fds_before;

        fill(kept, 0xC0FFEE00);
        /* Counted once the driver has done its first work here: a real one opens fds of its own lazily. */
        fds_before = client_fds(s);
        ck_assert_uint_eq(daemon_leases(supervisor_socket_path(s)), 1);

        for (unsigned i = 0; i < 3; i++) {
                vmmb_lease *l, *oneway = i == 1 ? alloc_or_fail(c, 2 * MiB, 0, "reconnect") : NULL;
                int64_t ready = supervisor_restart(s, sig, READY_MS);

                ck_assert_msg(ready >= 0, "restart %u: %s", i, strerror((int)-ready));
                ck_assert_int_eq(supervisor_last_exit(s), sig == SIGTERM ? 0 : 128 + SIGKILL);

                /* The mapping outlived the daemon that leased it, and its memory with it. */
                ck_assert(lease_reads(kept, 0xC0FFEE00 + i));
                ck_assert_uint_eq(daemon_leases(supervisor_socket_path(s)), oneway ? 2 : 1); /* restored */
                fill(kept, 0xC0FFEE00 + i + 1);
                ck_assert(lease_reads(kept, 0xC0FFEE00 + i + 1));

                /* The connection was lost while idle: the call finds it so when sending, connects again and
                 * sends the call there; a one-way Free too, which the new broker reads before the next call. */
                if (oneway)
                        ck_assert_int_eq(vmmb_free_oneway(oneway), 0);
                l = alloc_or_fail(c, 2 * MiB, 0, "reconnect");
                ck_assert(lease_reads(l, 0));
                fill(l, 0x5EED0000 + i);
                ck_assert(lease_reads(l, 0x5EED0000 + i));
                ck_assert_uint_eq(daemon_leases(supervisor_socket_path(s)), 2);
                ck_assert_int_eq(vmmb_share(l, VMMB_ANY_UID, 0, token), 0);
                ck_assert_int_eq(vmmb_free(l), 0);
                ck_assert_uint_eq(daemon_leases(supervisor_socket_path(s)), 1);
                ck_assert(lease_reads(kept, 0xC0FFEE00 + i + 1));
        }


        /* No fd of the client's left behind by the restarts and reconnections (the supervisor's store, in this
         * process too, aside). */
        ck_assert_int_eq(client_fds(s), fds_before);

        /* The lease of before is the restored daemon's to end. */
        ck_assert_int_eq(vmmb_free(kept), 0);
        ck_assert_uint_eq(daemon_leases(supervisor_socket_path(s)), 0);
        vmmb_close(c);
        supervisor_free(s);
}
END_TEST

/* The lease's reclaim state as the daemon's List (all) shows it, "-" for none. */
static void lease_reclaim_state(Supervisor *s, const char *id, char *buf, size_t len) {
        ListReply list = {};
        const WireLeaseInfo *info;

        ck_assert_int_eq(list_get(supervisor_socket_path(s), true, &list), 0);
        info = list_find(&list, id);
        ck_assert_ptr_nonnull(info);
        snprintf(buf, len, "%s", info->reclaim ?: "-");
        list_reply_done(&list);
}

/* Polls List, for up to `within_ms`, until the lease is marked again (the library's watch marked it). */
static void assert_marked_again(Supervisor *s, vmmb_lease *l, uint64_t within_ms) {
        uint64_t deadline = harness_now_msec() + within_ms;
        char state[32];

        do
                lease_reclaim_state(s, vmmb_lease_id(l), state, sizeof(state));
        while (strcmp(state, "marked") != 0 && harness_now_msec() < deadline);
        ck_assert_str_eq(state, "marked");
}

/*
 * Reclaim marks are not stored: a restarted daemon starts with none (its
 * leases are restored, unmarked), and libvmmbroker's watch thread connects
 * again and marks its leases again. The test polls List, bounded by READY_MS,
 * for the mark to come back.
 */
START_TEST(test_restart_marks_again) {
        Supervisor *s = daemon_start();
        vmmb_client *c = connect_or_fail(supervisor_socket_path(s));
        vmmb_lease *l = alloc_or_fail(c, 2 * MiB, 0, "reconnect");
        char state[32];
        int64_t ready;

        ck_assert_msg(vmmb_lease_set_reclaimable(l, 3, NULL, NULL) == 0, "%s", vmmb_error_message());
        lease_reclaim_state(s, vmmb_lease_id(l), state, sizeof(state));
        ck_assert_str_eq(state, "marked");
        ready = supervisor_restart(s, SIGTERM, READY_MS);
        ck_assert_msg(ready >= 0, "restart: %s", strerror((int)-ready));
        assert_marked_again(s, l, READY_MS);
        ck_assert_int_eq(vmmb_free(l), 0);
        vmmb_close(c);
        supervisor_free(s);
}
END_TEST

/*
 * Parking a lease ends its reclaimable mark in the broker (docs/protocol.md, "Parking"), and the library
 * forgets the mark too: after a restart its watch marks again the leases still marked, not one parked (and
 * unparked) since. A second lease, made after it, marked and never parked, says when the watch's pass of
 * marking again (in the order the leases were made) has gone past the first.
 */
START_TEST(test_parked_not_marked_again) {
        Supervisor *s = daemon_start();
        vmmb_client *c = connect_or_fail(supervisor_socket_path(s));
        vmmb_lease *parked = alloc_or_fail(c, 2 * MiB, 0, "reconnect");
        vmmb_lease *marked = alloc_or_fail(c, 2 * MiB, 0, "reconnect");
        char state[32];
        int64_t ready;

        ck_assert_msg(vmmb_lease_set_reclaimable(parked, 3, NULL, NULL) == 0, "%s", vmmb_error_message());
        ck_assert_msg(vmmb_lease_set_reclaimable(marked, 3, NULL, NULL) == 0, "%s", vmmb_error_message());
        ck_assert_msg(vmmb_lease_park(parked, NULL) == 1, "%s", vmmb_error_message());
        lease_reclaim_state(s, vmmb_lease_id(parked), state, sizeof(state));
        ck_assert_str_eq(state, "-");
        ck_assert_msg(vmmb_lease_unpark(parked) == 0, "%s", vmmb_error_message());
        ready = supervisor_restart(s, SIGTERM, READY_MS);
        ck_assert_msg(ready >= 0, "restart: %s", strerror((int)-ready));
        assert_marked_again(s, marked, READY_MS);
        lease_reclaim_state(s, vmmb_lease_id(parked), state, sizeof(state));
        ck_assert_str_eq(state, "-");
        ck_assert_int_eq(vmmb_free(parked), 0);
        ck_assert_int_eq(vmmb_free(marked), 0);
        vmmb_close(c);
        supervisor_free(s);
}
END_TEST

/*
 * The same after an outage longer than $VMMBROKER_RECONNECT_TIMEOUT with
 * nothing at the socket's path (the socket unit stopped too, say): a call
 * gives up after that long, the watch thread must not, or the process's
 * leases are never marked again, nor asked, once the broker is back. It
 * gave up until the eleventh stop. The outage is made by moving the socket
 * aside while the daemon is stopped, for five times the timeout: the time
 * is the condition under test, not a stand-in for an event.
 */
START_TEST(test_long_outage_marks_again) {
        char path[108], aside[128], state[32];
        vmmb_client *c;
        vmmb_lease *l;
        Supervisor *s;

        ck_assert_int_eq(setenv("VMMBROKER_RECONNECT_TIMEOUT", "0.2", 1), 0);
        s = daemon_start();
        c = connect_or_fail(supervisor_socket_path(s));
        l = alloc_or_fail(c, 2 * MiB, 0, "reconnect");
        ck_assert_msg(vmmb_lease_set_reclaimable(l, 3, NULL, NULL) == 0, "%s", vmmb_error_message());
        lease_reclaim_state(s, vmmb_lease_id(l), state, sizeof(state));
        ck_assert_str_eq(state, "marked");

        snprintf(path, sizeof(path), "%s", supervisor_socket_path(s));
        snprintf(aside, sizeof(aside), "%s.aside", path);
        /* aside first: the watch's next connect must find nothing, not the supervisor's socket, whose
         * backlog would hold it until the daemon is back */
        ck_assert_int_eq(rename(path, aside), 0);
        ck_assert_int_eq(supervisor_stop(s, SIGTERM), 0);
        ck_assert_int_eq(usleep(1000 * 1000), 0);
        ck_assert_int_eq(rename(aside, path), 0);
        ck_assert_int_eq(supervisor_start(s), 0);
        ck_assert_int_ge(supervisor_wait_ready(s, READY_MS), 0);

        /* the watch tries again at most WATCH_RETRY_MAX_USEC (2 s) apart: 10 s is plenty */
        assert_marked_again(s, l, 10000);
        ck_assert_int_eq(vmmb_free(l), 0);
        vmmb_close(c);
        supervisor_free(s);
}
END_TEST

/*
 * A call made while the daemon is down connects to the socket that the
 * supervisor holds for it and waits there; the daemon started again answers
 * it. The test starts the daemon only once the client's new connection waits
 * in the socket's backlog.
 */
START_TEST(test_call_while_down) {
        Supervisor *s = daemon_start();
        int fds_before = client_fds(s);
        vmmb_client *c = connect_or_fail(supervisor_socket_path(s));
        vmmb_lease *kept = alloc_or_fail(c, 4 * MiB, 0, "reconnect");
        ClientOp o;

        fill(kept, 0xA5A5A5A5);
        ck_assert_int_eq(supervisor_stop(s, SIGKILL), 128 + SIGKILL);

        client_op_start(&o, OP_ALLOC, c, NULL);
        ck_assert_msg(readable(supervisor_listen_fd(s), -1), "the client did not connect again");
        ck_assert(lease_reads(kept, 0xA5A5A5A5));
        ck_assert_int_eq(supervisor_start(s), 0);
        ck_assert_int_ge(supervisor_wait_ready(s, READY_MS), 0);

        ck_assert_msg(client_op_finish(&o) == 0, "vmmb_alloc: %s", o.message);
        ck_assert(lease_reads(o.lease, 0));
        /* the new one, and the one of before, restored */
        ck_assert_uint_eq(daemon_leases(supervisor_socket_path(s)), 2);
        ck_assert_int_eq(vmmb_free(o.lease), 0);
        ck_assert(lease_reads(kept, 0xA5A5A5A5));
        ck_assert_int_eq(vmmb_free(kept), 0);
        vmmb_close(c);
        /* No fd of the client's left behind (the supervisor's store, in this process too, aside). */
        ck_assert_int_eq(client_fds(s), fds_before);
        supervisor_free(s);
}
END_TEST

/* ---- no broker comes back ------------------------------------------------------------------------------ */

/*
 * Nobody listens at the path (refused, then missing): a call tries again for
 * $VMMBROKER_RECONNECT_TIMEOUT, gives up with -ECONNREFUSED and says why,
 * and the client stays usable: once a broker listens, the next call works.
 */
START_TEST(test_gives_up) {
        int fds_before = harness_fd_count(getpid());
        char path[128];
        int listen_fd = fake_listen(path);
        vmmb_client *c;
        VarlinkConn *vc;
        uint64_t start, took;
        ClientOp o;

        ck_assert_int_eq(setenv("VMMBROKER_RECONNECT_TIMEOUT", "0.3", 1), 0);
        vc = fake_connect(listen_fd, path, &c);
        varlink_conn_free(vc);
        safe_close(listen_fd);          /* the file stays: connect() is refused */

        start = harness_now_msec();
        ck_assert_int_eq(vmmb_revoke(c, "0123456789abcdef0123456789abcdef"), -ECONNREFUSED);
        took = harness_now_msec() - start;
        ck_assert_msg(took >= 300 && took < WAIT_MS, "gave up after %llu ms", (unsigned long long)took);
        ck_assert_msg(strstr(vmmb_error_message(), "no broker listened at") &&
                      strstr(vmmb_error_message(), path) && strstr(vmmb_error_message(), "within 0.300 s"),
                      "message: %s", vmmb_error_message());

        /* Missing: -ECONNREFUSED too (-ENOENT would be the broker's NoSuchName); the message says why. */
        ck_assert_int_eq(unlink(path), 0);
        ck_assert_int_eq(vmmb_unpublish(c, "team.weights"), -ECONNREFUSED);
        ck_assert_msg(strstr(vmmb_error_message(), "no broker listened at") &&
                      strstr(vmmb_error_message(), strerror(ENOENT)), "message: %s", vmmb_error_message());

        /* A broker again: the next call connects to it. */
        listen_fd = fake_listen(path);
        client_op_start(&o, OP_REVOKE, c, NULL);
        vc = fake_accept(listen_fd);
        fake_read_call(vc, VMMB_METHOD_REVOKE, NULL);
        fake_reply(vc, NULL, NULL, 0);
        ck_assert_msg(client_op_finish(&o) == 0, "vmmb_revoke: %s", o.message);

        vmmb_close(c);
        varlink_conn_free(vc);
        safe_close(listen_fd);
        ck_assert_int_eq(harness_fd_count(getpid()), fds_before);
}
END_TEST

/* A bad $VMMBROKER_RECONNECT_TIMEOUT is refused when connecting, and "0" tries once without waiting. */
START_TEST(test_timeout_env) {
        static const char *const bad[] = { "x", "-1", "1.", ".5", "1s", "1e3", " 1", "10000000000" };
        char path[128];
        int listen_fd = fake_listen(path);
        vmmb_client *c = NULL;
        VarlinkConn *vc;
        uint64_t start;

        for (size_t i = 0; i < ELEMENTSOF(bad); i++) {
                ck_assert_int_eq(setenv("VMMBROKER_RECONNECT_TIMEOUT", bad[i], 1), 0);
                ck_assert_int_eq(vmmb_connect(path, &c), -EINVAL);
                ck_assert_ptr_null(c);
                ck_assert_msg(strstr(vmmb_error_message(), "VMMBROKER_RECONNECT_TIMEOUT"), "%s: %s", bad[i],
                              vmmb_error_message());
        }

        ck_assert_int_eq(setenv("VMMBROKER_RECONNECT_TIMEOUT", "0", 1), 0);
        vc = fake_connect(listen_fd, path, &c);
        varlink_conn_free(vc);
        safe_close(listen_fd);
        ck_assert_int_eq(unlink(path), 0);
        start = harness_now_msec();
        ck_assert_int_eq(vmmb_unpublish(c, "team.weights"), -ECONNREFUSED);
        ck_assert_uint_lt(harness_now_msec() - start, WAIT_MS);
        ck_assert_msg(strstr(vmmb_error_message(), "within 0 s"), "message: %s", vmmb_error_message());
        vmmb_close(c);
}
END_TEST

/*
 * vmmb_close() does not wait for a broker that is gone, whatever the timeout:
 * it tries once for each lease and frees the client; the holds end when the
 * process exits.
 */
START_TEST(test_close_does_not_wait) {
        char path[128];
        int listen_fd = fake_listen(path);
        CUmemGenericAllocationHandle handle;
        vmmb_client *c;
        VarlinkConn *vc;
        uint64_t start;
        ClientOp o;

        ck_assert_int_eq(setenv("VMMBROKER_RECONNECT_TIMEOUT", "600", 1), 0);
        vc = fake_connect(listen_fd, path, &c);
        client_op_start(&o, OP_ALLOC, c, NULL);
        fake_read_call(vc, VMMB_METHOD_ALLOC, NULL);
        fake_reply_alloc(vc, &handle);
        ck_assert_msg(client_op_finish(&o) == 0, "vmmb_alloc: %s", o.message);
        varlink_conn_free(vc);
        safe_close(listen_fd);

        start = harness_now_msec();
        vmmb_close(c);
        ck_assert_uint_lt(harness_now_msec() - start, WAIT_MS);
        ck_assert_int_eq(cu->cuMemRelease(handle), CUDA_SUCCESS);
}
END_TEST

/* ---- parking when the broker cannot -------------------------------------------------------------------- */

/* A client of the fake holding the fake's lease, and the fake's end of its connection. */
typedef struct FakeLease {
        char path[128];
        int listen_fd;
        CUmemGenericAllocationHandle handle;    /* the lease's one slab, the fake's */
        vmmb_client *c;
        VarlinkConn *vc;
        vmmb_lease *l;
} FakeLease;

/* Makes the fake, a client of it and the fake's lease, mapped by the client and filled with `value`. */
static void fake_lease(FakeLease *f, uint32_t value) {
        ClientOp o;

        f->listen_fd = fake_listen(f->path);
        f->vc = fake_connect(f->listen_fd, f->path, &f->c);
        client_op_start(&o, OP_ALLOC, f->c, NULL);
        fake_read_call(f->vc, VMMB_METHOD_ALLOC, NULL);
        fake_reply_alloc(f->vc, &f->handle);
        ck_assert_msg(client_op_finish(&o) == 0, "vmmb_alloc: %s", o.message);
        f->l = o.lease;
        fill(f->l, value);
}

/* Closes the fake, then the client, which does not wait for it (its lease is left to the process's exit). */
static void fake_lease_done(FakeLease *f) {
        varlink_conn_free(f->vc);
        safe_close(f->listen_fd);
        vmmb_close(f->c);
        ck_assert_int_eq(cu->cuMemRelease(f->handle), CUDA_SUCCESS);
}

/* A broker older than parking: asked first, it gets no Park, and nothing was unmapped. */
START_TEST(test_park_old_broker) {
        FakeLease f;
        ClientOp o;

        fake_lease(&f, 0x01D0B0CE);
        client_op_start(&o, OP_PARK, f.c, f.l);
        fake_read_call(f.vc, VARLINK_METHOD_GET_INTERFACE_DESCRIPTION, NULL);
        fake_reply_description(f.vc, false);
        ck_assert_int_eq(client_op_finish(&o), -EOPNOTSUPP);
        ck_assert_message_has(&o, "left as it was, mapped");
        ck_assert(!fake_pending(f.listen_fd));
        ck_assert_int_eq(vmmb_lease_parked(f.l), 0);
        ck_assert(lease_reads(f.l, 0x01D0B0CE));
        /* the answer is kept for the connection: asked no more */
        ck_assert_int_eq(vmmb_lease_park(f.l, NULL), -EOPNOTSUPP);
        fake_lease_done(&f);
}
END_TEST

/*
 * Park refused, then Park lost after the broker read it: each time the library unmapped the lease first, and
 * maps it again at the same address with what Unpark returns (the slabs of a lease not parked, as they are),
 * content and all, before it returns the error.
 */
START_TEST(test_park_failed_maps_again) {
        json_object *refusal = NULL;
        uint64_t ptr;
        FakeLease f;
        ClientOp o;

        ck_assert_int_eq(setenv("VMMBROKER_RECONNECT_TIMEOUT", "5", 1), 0);
        fake_lease(&f, 0xBAC0FFEE);
        ptr = vmmb_lease_ptr(f.l);
        client_op_start(&o, OP_PARK, f.c, f.l);
        fake_read_call(f.vc, VARLINK_METHOD_GET_INTERFACE_DESCRIPTION, NULL);
        fake_reply_description(f.vc, true);
        fake_read_call(f.vc, VMMB_METHOD_PARK, NULL);
        ck_assert_int_eq(vmmb_error_permission_denied("Not yours to park.", &refusal), 0);
        ck_assert_int_eq(varlink_conn_send(f.vc, refusal, NULL, 0), 0);
        ck_assert_int_eq(varlink_conn_flush(f.vc), 0);
        json_object_put(refusal);
        fake_read_call(f.vc, VMMB_METHOD_UNPARK, NULL);
        fake_reply_lease(f.vc, f.handle);
        ck_assert_int_eq(client_op_finish(&o), -EACCES);
        ck_assert_message_has(&o, "Not yours to park.");
        ck_assert_message_has(&o, "mapped again");
        ck_assert_int_eq(vmmb_lease_parked(f.l), 0);
        ck_assert_uint_eq(vmmb_lease_ptr(f.l), ptr);
        ck_assert(lease_reads(f.l, 0xBAC0FFEE));

        /* Read, then the connection lost: maybe parked; Unpark on the next connection brings it back. */
        fill(f.l, 0xBAC0FFEF);
        client_op_start(&o, OP_PARK, f.c, f.l);
        fake_read_call(f.vc, VMMB_METHOD_PARK, NULL);
        varlink_conn_free(f.vc);
        f.vc = fake_accept(f.listen_fd);
        fake_read_call(f.vc, VMMB_METHOD_UNPARK, NULL);
        fake_reply_lease(f.vc, f.handle);
        ck_assert_int_eq(client_op_finish(&o), -ECONNRESET);
        ck_assert_message_has(&o, "mapped again");
        ck_assert_int_eq(vmmb_lease_parked(f.l), 0);
        ck_assert_uint_eq(vmmb_lease_ptr(f.l), ptr);
        ck_assert(lease_reads(f.l, 0xBAC0FFEF));
        fake_lease_done(&f);
}
END_TEST

/* ---- which calls are sent again ------------------------------------------------------------------------ */

/*
 * The broker closed the connection with the call unread (it went down before
 * reading it): the call was not carried out, and is sent again on a new
 * connection, whatever it is. Twice: -ECONNRESET, saying it was not carried
 * out.
 */
START_TEST(test_unread_call_is_sent_again) {
        int fds_before = harness_fd_count(getpid());
        char path[128];
        int listen_fd = fake_listen(path);
        vmmb_client *c;
        VarlinkConn *vc = fake_connect(listen_fd, path, &c);
        ClientOp o;

        client_op_start(&o, OP_UNPUBLISH, c, NULL);
        fake_drop_unread(vc);
        vc = fake_accept(listen_fd);
        fake_read_call(vc, VMMB_METHOD_UNPUBLISH, NULL);
        fake_reply(vc, NULL, NULL, 0);
        ck_assert_msg(client_op_finish(&o) == 0, "vmmb_unpublish: %s", o.message);
        ck_assert(!fake_pending(listen_fd));

        /* Unread twice: given up. */
        client_op_start(&o, OP_UNPUBLISH, c, NULL);
        fake_drop_unread(vc);
        vc = fake_accept(listen_fd);
        fake_drop_unread(vc);
        ck_assert_int_eq(client_op_finish(&o), -ECONNRESET);
        ck_assert_message_has(&o, "was not carried out");
        ck_assert(!fake_pending(listen_fd));

        /* The client goes on: the next call connects again. */
        client_op_start(&o, OP_REVOKE, c, NULL);
        vc = fake_accept(listen_fd);
        fake_read_call(vc, VMMB_METHOD_REVOKE, NULL);
        fake_reply(vc, NULL, NULL, 0);
        ck_assert_msg(client_op_finish(&o) == 0, "vmmb_revoke: %s", o.message);

        vmmb_close(c);
        varlink_conn_free(vc);
        safe_close(listen_fd);
        ck_assert_int_eq(harness_fd_count(getpid()), fds_before);
}
END_TEST

/*
 * The broker read the call and closed the connection without answering (it
 * went down while or after carrying it out): Alloc, Free, Unpublish are not
 * sent again; the call returns -ECONNRESET saying the outcome is unknown, and
 * the next call connects again. Publish is sent again: twice is as once.
 */
START_TEST(test_read_call_is_not_sent_again) {
        int fds_before = harness_fd_count(getpid());
        _cleanup_free_ char *first = NULL, *second = NULL, *first_tokens = NULL, *second_tokens = NULL;
        CUmemGenericAllocationHandle handle;
        char path[128];
        int listen_fd = fake_listen(path);
        vmmb_client *c;
        VarlinkConn *vc = fake_connect(listen_fd, path, &c);
        vmmb_lease *l;
        ClientOp o;

        /* Alloc: lost after it was read; not sent again, the next call (Revoke) is the first on the new
         * connection. */
        client_op_start(&o, OP_ALLOC, c, NULL);
        fake_read_call(vc, VMMB_METHOD_ALLOC, NULL);
        varlink_conn_free(vc);
        ck_assert_int_eq(client_op_finish(&o), -ECONNRESET);
        ck_assert_ptr_null(o.lease);
        ck_assert_message_has(&o, "whether it carried the call out is unknown");
        ck_assert_message_has(&o, "Alloc");
        ck_assert(!fake_pending(listen_fd));
        client_op_start(&o, OP_REVOKE, c, NULL);
        vc = fake_accept(listen_fd);
        fake_read_call(vc, VMMB_METHOD_REVOKE, NULL);
        fake_reply(vc, NULL, NULL, 0);
        ck_assert_msg(client_op_finish(&o) == 0, "vmmb_revoke: %s", o.message);

        /* A lease to publish and free. */
        client_op_start(&o, OP_ALLOC, c, NULL);
        fake_read_call(vc, VMMB_METHOD_ALLOC, NULL);
        fake_reply_alloc(vc, &handle);
        ck_assert_msg(client_op_finish(&o) == 0, "vmmb_alloc: %s", o.message);
        l = o.lease;
        ck_assert_str_eq(vmmb_lease_id(l), LEASE_ID);
        fill(l, 0x600DF00D);

        /* Publish: lost after it was read, sent again on a new connection, the same call. */
        client_op_start(&o, OP_PUBLISH, c, l);
        fake_read_call(vc, VMMB_METHOD_PUBLISH, &first);
        varlink_conn_free(vc);
        vc = fake_accept(listen_fd);
        fake_read_call(vc, VMMB_METHOD_PUBLISH, &second);
        ck_assert_str_eq(first, second);
        fake_reply(vc, NULL, NULL, 0);
        ck_assert_msg(client_op_finish(&o) == 0, "vmmb_publish: %s", o.message);
        ck_assert(!fake_pending(listen_fd));

        /* Tokens, which changes nothing: lost after it was read, sent again, the same call. */
        client_op_start(&o, OP_TOKENS, c, l);
        fake_read_call(vc, VMMB_METHOD_TOKENS, &first_tokens);
        varlink_conn_free(vc);
        vc = fake_accept(listen_fd);
        fake_read_call(vc, VMMB_METHOD_TOKENS, &second_tokens);
        ck_assert_str_eq(first_tokens, second_tokens);
        {
                json_object *p =
                        json_tokener_parse("{\"tokens\": [{\"token\": \"0123456789abcdef0123456789abcdef\", "
                                           "\"creator\": 0, \"readonly\": true}]}");

                ck_assert_ptr_nonnull(p);
                fake_reply(vc, p, NULL, 0);
                json_object_put(p);
        }
        ck_assert_msg(client_op_finish(&o) == 0, "vmmb_tokens: %s", o.message);
        ck_assert_uint_eq(o.n_tokens, 1);
        ck_assert_str_eq(o.tokens[0].token, "0123456789abcdef0123456789abcdef");
        ck_assert_uint_eq(o.tokens[0].uid, VMMB_ANY_UID);
        ck_assert_int_eq(o.tokens[0].readonly, 1);
        vmmb_tokens_free(o.tokens, o.n_tokens);
        ck_assert(!fake_pending(listen_fd));

        /* Publish lost after it was read twice: given up. */
        client_op_start(&o, OP_PUBLISH, c, l);
        fake_read_call(vc, VMMB_METHOD_PUBLISH, NULL);
        varlink_conn_free(vc);
        vc = fake_accept(listen_fd);
        fake_read_call(vc, VMMB_METHOD_PUBLISH, NULL);
        varlink_conn_free(vc);
        ck_assert_int_eq(client_op_finish(&o), -ECONNRESET);
        ck_assert_message_has(&o, "whether it carried the call out is unknown");
        ck_assert(!fake_pending(listen_fd));

        /* Publish read, then unread on the new connection: the first may have been carried out. */
        client_op_start(&o, OP_PUBLISH, c, l);
        vc = fake_accept(listen_fd);
        fake_read_call(vc, VMMB_METHOD_PUBLISH, NULL);
        varlink_conn_free(vc);
        vc = fake_accept(listen_fd);
        fake_drop_unread(vc);
        ck_assert_int_eq(client_op_finish(&o), -ECONNRESET);
        ck_assert_message_has(&o, "whether it carried the call out is unknown");
        ck_assert(!fake_pending(listen_fd));

        /* Unpublish: not sent again. */
        client_op_start(&o, OP_UNPUBLISH, c, NULL);
        vc = fake_accept(listen_fd);
        fake_read_call(vc, VMMB_METHOD_UNPUBLISH, NULL);
        varlink_conn_free(vc);
        ck_assert_int_eq(client_op_finish(&o), -ECONNRESET);
        ck_assert_message_has(&o, "Unpublish");
        ck_assert(!fake_pending(listen_fd));

        /* Free: the memory was unmapped, the broker was told, and whether it heard is unknown: not sent
         * again (a second Free could end another hold of this process on the lease). The lease object is
         * gone all the same. */
        ck_assert(lease_reads(l, 0x600DF00D));
        client_op_start(&o, OP_FREE, c, l);
        vc = fake_accept(listen_fd);
        fake_read_call(vc, VMMB_METHOD_FREE, NULL);
        varlink_conn_free(vc);
        ck_assert_int_eq(client_op_finish(&o), -ECONNRESET);
        ck_assert_message_has(&o, "Free");
        ck_assert(!fake_pending(listen_fd));
        ck_assert_int_eq(cu->cuMemRelease(handle), CUDA_SUCCESS);

        /* And the client goes on. */
        client_op_start(&o, OP_REVOKE, c, NULL);
        vc = fake_accept(listen_fd);
        fake_read_call(vc, VMMB_METHOD_REVOKE, NULL);
        fake_reply(vc, NULL, NULL, 0);
        ck_assert_msg(client_op_finish(&o) == 0, "vmmb_revoke: %s", o.message);

        vmmb_close(c);
        varlink_conn_free(vc);
        safe_close(listen_fd);
        ck_assert_int_eq(harness_fd_count(getpid()), fds_before);
}
END_TEST

/* ---- keeping, with the fake for a broker ------------------------------------------------------------- */

#define OTHER_ID "ffeeddccbbaa99887766554433221100"     /* another lease of the fake's */

/* How many times the simulated driver's `entry` was called in this process; fails on a driver that counts nothing. */
static uint64_t calls(const char *entry) {
        ck_assert(driver_counts());
        return driver_calls(entry);
}

/* The keeping tests against the fake count the library's unmaps: on a real driver (the GPU run) there is no
 * count, and they say so and pass. */
#define COUNTED_DRIVER_ONLY()                                                                                    do {                                                                                                             if (!driver_counts()) {                                                                                         fprintf(stderr, "%s: not run: it counts driver calls, which only the simulated "                                  "device does\n", __func__);                                                                      return;                                                                                          }                                                                                                } while (0)

/* Reads the next call, which must be a Free of `id`, asking to keep or not, one-way or not. */
static void fake_read_free(VarlinkConn *vc, const char *id, bool keep, bool oneway) {
        _cleanup_(varlink_call_done) VarlinkCall call = {};
        json_object *msg = NULL, *v;
        int k;

        k = varlink_conn_receive(vc, &msg, NULL, NULL);
        ck_assert_msg(k == 1, "reading the call: %s", strerror(-k));
        ck_assert_int_eq(varlink_call_parse(msg, &call), 0);
        json_object_put(msg);
        ck_assert_str_eq(call.method, VMMB_METHOD_FREE);
        ck_assert_ptr_nonnull(call.parameters);
        ck_assert(json_object_object_get_ex(call.parameters, "id", &v));
        ck_assert_str_eq(json_object_get_string(v), id);
        ck_assert_int_eq(json_object_object_get_ex(call.parameters, "keep", &v) && json_object_get_boolean(v), keep);
        ck_assert_int_eq(call.oneway, oneway);
}

/* Answers a Free with keep: (kept: true) or (kept: false); or () as a broker older than keeping (kept < 0). */
static void fake_reply_kept(VarlinkConn *vc, int kept) {
        json_object *params = json_object_new_object();

        ck_assert_ptr_nonnull(params);
        if (kept >= 0)
                ck_assert_int_eq(json_object_object_add(params, "kept", json_object_new_boolean(kept)), 0);
        fake_reply(vc, params, NULL, 0);
        json_object_put(params);
}

/* Sends a reply that says "continues", on a call with "more". */
static void fake_reply_continues(VarlinkConn *vc, json_object *params) {
        json_object *msg = NULL;

        ck_assert_int_eq(varlink_reply_new_continues(params, &msg), 0);
        ck_assert_int_eq(varlink_conn_send(vc, msg, NULL, 0), 0);
        json_object_put(msg);
        ck_assert_int_eq(varlink_conn_flush(vc), 0);
}

/* Sends an error reply. */
static void fake_reply_error(VarlinkConn *vc, json_object *error) {
        ck_assert_ptr_nonnull(error);
        ck_assert_int_eq(varlink_conn_send(vc, error, NULL, 0), 0);
        ck_assert_int_eq(varlink_conn_flush(vc), 0);
        json_object_put(error);
}

/* Accepts the process's WatchReclaim connection and answers with the watch on. */
static VarlinkConn *fake_watch_on(int listen_fd) {
        VarlinkConn *vc = fake_accept(listen_fd);
        json_object *params = json_object_new_object();

        fake_read_call(vc, VMMB_METHOD_WATCH_RECLAIM, NULL);
        ck_assert_ptr_nonnull(params);
        fake_reply_continues(vc, params);
        json_object_put(params);
        return vc;
}

/* The fake's ends of the process's watch: its connection for answers, and the one of WatchReclaim. */
typedef struct FakeWatch {
        VarlinkConn *answer;
        VarlinkConn *watch;
} FakeWatch;

/*
 * Accepts the process's watch, made before the library keeps anything: its connection for answers, then
 * WatchReclaim, answered with the watch on (`watches`) or MethodNotFound (a broker older than reclaiming).
 */
static void fake_watch(int listen_fd, bool watches, FakeWatch *ret) {
        ret->answer = fake_accept(listen_fd);
        if (watches) {
                ret->watch = fake_watch_on(listen_fd);
        } else {
                json_object *error = NULL;

                ret->watch = fake_accept(listen_fd);
                fake_read_call(ret->watch, VMMB_METHOD_WATCH_RECLAIM, NULL);
                ck_assert_int_eq(varlink_error_method_not_found(VMMB_METHOD_WATCH_RECLAIM, &error), 0);
                fake_reply_error(ret->watch, error);
        }
}

/* Closes the fake's ends of the watch; after the client's vmmb_close(), which stops the watch. */
static void fake_watch_done(FakeWatch *w) {
        w->answer = varlink_conn_free(w->answer);
        w->watch = varlink_conn_free(w->watch);
}

/* Asks for lease `id` back on the watch, as a broker does when an Alloc waits for room. */
static void fake_ask(FakeWatch *w, const char *id) {
        ReclaimRequest q = { .id = (char *)id, .device = 0, .size = 2 * MiB, .timeout_usec = 5000000 };
        json_object *params = NULL;

        ck_assert_int_eq(reclaim_request_encode(&q, &params), 0);
        fake_reply_continues(w->watch, params);
        json_object_put(params);
}

/*
 * The first keep on a connection waits for the answer (kept), and the lease stays mapped: the broker's
 * Alloc that hands it back gets the same mapping. The next keep is one-way. On a new connection (the broker
 * restarted) the first keep is answered again.
 */
START_TEST(test_keep_answered_then_oneway) {
        uint64_t ptr, unmaps;
        FakeLease f;
        FakeWatch w;
        ClientOp o;

        COUNTED_DRIVER_ONLY();

        fake_lease(&f, 0x4EE90000);
        ptr = vmmb_lease_ptr(f.l);
        unmaps = calls("cuMemUnmap");
        client_op_start(&o, OP_FREE_KEEP, f.c, f.l);
        fake_watch(f.listen_fd, true, &w);
        fake_read_free(f.vc, LEASE_ID, true, false);
        fake_reply_kept(f.vc, true);
        ck_assert_msg(client_op_finish(&o) == 0, "vmmb_free_keep: %s", o.message);
        ck_assert_uint_eq(calls("cuMemUnmap"), unmaps);

        /* handed back: the same mapping, and what it holds (this fake zeroes nothing) */
        client_op_start(&o, OP_ALLOC, f.c, NULL);
        fake_read_call(f.vc, VMMB_METHOD_ALLOC, NULL);
        fake_reply_lease(f.vc, f.handle);
        ck_assert_msg(client_op_finish(&o) == 0, "vmmb_alloc: %s", o.message);
        ck_assert_str_eq(vmmb_lease_id(o.lease), LEASE_ID);
        ck_assert_uint_eq(vmmb_lease_ptr(o.lease), ptr);
        ck_assert(lease_reads(o.lease, 0x4EE90000));
        f.l = o.lease;

        client_op_start(&o, OP_FREE_KEEP, f.c, f.l);
        fake_read_free(f.vc, LEASE_ID, true, true);
        ck_assert_msg(client_op_finish(&o) == 0, "vmmb_free_keep: %s", o.message);

        /* the broker restarted (the connection lost while idle): the Alloc goes on a new connection */
        varlink_conn_free(f.vc);
        client_op_start(&o, OP_ALLOC, f.c, NULL);
        f.vc = fake_accept(f.listen_fd);
        fake_read_call(f.vc, VMMB_METHOD_ALLOC, NULL);
        fake_reply_lease(f.vc, f.handle);
        ck_assert_msg(client_op_finish(&o) == 0, "vmmb_alloc: %s", o.message);
        ck_assert_uint_eq(vmmb_lease_ptr(o.lease), ptr);
        f.l = o.lease;
        client_op_start(&o, OP_FREE_KEEP, f.c, f.l);
        fake_read_free(f.vc, LEASE_ID, true, false);    /* another broker, maybe: asked again */
        fake_reply_kept(f.vc, true);
        ck_assert_msg(client_op_finish(&o) == 0, "vmmb_free_keep: %s", o.message);
        ck_assert_uint_eq(calls("cuMemUnmap"), unmaps);
        ck_assert(!fake_pending(f.listen_fd));

        fake_lease_done(&f);            /* unmaps the kept lease; its Free finds no broker */
        fake_watch_done(&w);
        ck_assert_uint_gt(calls("cuMemUnmap"), unmaps);
}
END_TEST

/*
 * A broker older than keeping that refuses the parameter (InvalidParameter naming `keep`): nothing was
 * freed, so the library unmaps and sends a plain one-way Free; the next keep on the connection is a plain
 * one-way Free at once.
 */
START_TEST(test_keep_old_broker_refuses) {
        uint64_t unmaps;
        FakeLease f;
        FakeWatch w;
        ClientOp o;
        json_object *error = NULL;

        COUNTED_DRIVER_ONLY();

        fake_lease(&f, 0x01D0B0CE);
        unmaps = calls("cuMemUnmap");
        client_op_start(&o, OP_FREE_KEEP, f.c, f.l);
        fake_watch(f.listen_fd, true, &w);
        fake_read_free(f.vc, LEASE_ID, true, false);
        ck_assert_int_eq(vmmb_error_invalid_parameter("keep", "Unknown parameter 'keep'.", &error), 0);
        fake_reply_error(f.vc, error);
        fake_read_free(f.vc, LEASE_ID, false, true);
        ck_assert_msg(client_op_finish(&o) == 0, "vmmb_free_keep: %s", o.message);
        ck_assert_uint_gt(calls("cuMemUnmap"), unmaps);

        client_op_start(&o, OP_ALLOC, f.c, NULL);
        fake_read_call(f.vc, VMMB_METHOD_ALLOC, NULL);
        fake_reply_lease(f.vc, f.handle);
        ck_assert_msg(client_op_finish(&o) == 0, "vmmb_alloc: %s", o.message);
        ck_assert(lease_reads(o.lease, 0x01D0B0CE));    /* mapped anew: the fake's slab, as it was */
        unmaps = calls("cuMemUnmap");
        client_op_start(&o, OP_FREE_KEEP, f.c, o.lease);
        fake_read_free(f.vc, LEASE_ID, false, true);
        ck_assert_msg(client_op_finish(&o) == 0, "vmmb_free_keep: %s", o.message);
        ck_assert_uint_gt(calls("cuMemUnmap"), unmaps);
        ck_assert(!fake_pending(f.listen_fd));

        fake_lease_done(&f);
        fake_watch_done(&w);
}
END_TEST

/*
 * A broker older than keeping that takes the parameter for a plain Free (an empty reply, no `kept`): the lease
 * is freed, so the library unmaps it and sends nothing more; the next keep is a plain one-way Free.
 */
START_TEST(test_keep_old_broker_frees) {
        uint64_t unmaps;
        FakeLease f;
        FakeWatch w;
        ClientOp o;

        COUNTED_DRIVER_ONLY();

        fake_lease(&f, 0x0DDBA11);
        unmaps = calls("cuMemUnmap");
        client_op_start(&o, OP_FREE_KEEP, f.c, f.l);
        fake_watch(f.listen_fd, true, &w);
        fake_read_free(f.vc, LEASE_ID, true, false);
        fake_reply_kept(f.vc, -1);
        ck_assert_msg(client_op_finish(&o) == 0, "vmmb_free_keep: %s", o.message);
        ck_assert_uint_gt(calls("cuMemUnmap"), unmaps);

        /* nothing more was sent for it: the next call the fake reads is the client's next one */
        client_op_start(&o, OP_ALLOC, f.c, NULL);
        fake_read_call(f.vc, VMMB_METHOD_ALLOC, NULL);
        fake_reply_lease(f.vc, f.handle);
        ck_assert_msg(client_op_finish(&o) == 0, "vmmb_alloc: %s", o.message);
        client_op_start(&o, OP_FREE_KEEP, f.c, o.lease);
        fake_read_free(f.vc, LEASE_ID, false, true);
        ck_assert_msg(client_op_finish(&o) == 0, "vmmb_free_keep: %s", o.message);
        ck_assert(!fake_pending(f.listen_fd));

        fake_lease_done(&f);
        fake_watch_done(&w);
}
END_TEST

/* A broker that does not ask for leases back (no WatchReclaim): nothing is kept; a plain one-way Free. */
START_TEST(test_keep_no_watch) {
        uint64_t unmaps;
        FakeLease f;
        FakeWatch w;
        ClientOp o;

        COUNTED_DRIVER_ONLY();

        fake_lease(&f, 0x0BAD0001);
        unmaps = calls("cuMemUnmap");
        client_op_start(&o, OP_FREE_KEEP, f.c, f.l);
        fake_watch(f.listen_fd, false, &w);
        fake_read_free(f.vc, LEASE_ID, false, true);
        ck_assert_msg(client_op_finish(&o) == 0, "vmmb_free_keep: %s", o.message);
        ck_assert_uint_gt(calls("cuMemUnmap"), unmaps);
        ck_assert(!fake_pending(f.listen_fd));

        fake_lease_done(&f);
        fake_watch_done(&w);
}
END_TEST

/*
 * A one-way keep the broker did not carry out as a keep (the fake frees it plainly): the next Alloc of the
 * size, on the same connection, brings a new lease, which shows the kept one stale: it is unmapped and
 * dropped, not freed. When the broker asks for it after all, the library frees it.
 */
START_TEST(test_keep_stale_dropped) {
        CUmemGenericAllocationHandle other;
        CUmemAllocationProp prop = cuda_slab_prop(0);
        uint64_t unmaps;
        FakeLease f;
        FakeWatch w;
        ClientOp o;

        COUNTED_DRIVER_ONLY();

        fake_lease(&f, 0x57A1E000);
        client_op_start(&o, OP_FREE_KEEP, f.c, f.l);
        fake_watch(f.listen_fd, true, &w);
        fake_read_free(f.vc, LEASE_ID, true, false);
        fake_reply_kept(f.vc, true);
        ck_assert_msg(client_op_finish(&o) == 0, "vmmb_free_keep: %s", o.message);
        client_op_start(&o, OP_ALLOC, f.c, NULL);
        fake_read_call(f.vc, VMMB_METHOD_ALLOC, NULL);
        fake_reply_lease(f.vc, f.handle);
        ck_assert_msg(client_op_finish(&o) == 0, "vmmb_alloc: %s", o.message);

        client_op_start(&o, OP_FREE_KEEP, f.c, o.lease);
        fake_read_free(f.vc, LEASE_ID, true, true);     /* the fake frees it, as a broker refusing to keep */
        ck_assert_msg(client_op_finish(&o) == 0, "vmmb_free_keep: %s", o.message);

        unmaps = calls("cuMemUnmap");
        ck_assert_int_eq(cu->cuMemCreate(&other, 2 * MiB, &prop, 0), CUDA_SUCCESS);
        client_op_start(&o, OP_ALLOC, f.c, NULL);
        fake_read_call(f.vc, VMMB_METHOD_ALLOC, NULL);
        fake_reply_lease_id(f.vc, other, OTHER_ID);
        ck_assert_msg(client_op_finish(&o) == 0, "vmmb_alloc: %s", o.message);
        ck_assert_str_eq(vmmb_lease_id(o.lease), OTHER_ID);
        ck_assert_uint_gt(calls("cuMemUnmap"), unmaps); /* the stale one, unmapped */
        ck_assert(lease_reads(o.lease, 0));

        /* asked for after all (a broker that kept it): freed on the watch's connection for answers */
        fake_ask(&w, LEASE_ID);
        fake_read_free(w.answer, LEASE_ID, false, false);
        fake_reply(w.answer, NULL, NULL, 0);
        ck_assert(!fake_pending(f.listen_fd));

        fake_lease_done(&f);
        fake_watch_done(&w);
        ck_assert_int_eq(cu->cuMemRelease(other), CUDA_SUCCESS);
}
END_TEST

/*
 * The broker asks for a kept lease, and the library gives it back (unmapped, Free on its connection for
 * answers); an Alloc that the broker served with that lease before it read the Free (its hold ends with
 * the Free) is not used: the library asks again, and maps what comes then.
 */
START_TEST(test_keep_given_back_while_handed_back) {
        CUmemGenericAllocationHandle other;
        CUmemAllocationProp prop = cuda_slab_prop(0);
        uint64_t unmaps;
        FakeLease f;
        FakeWatch w;
        ClientOp o;

        COUNTED_DRIVER_ONLY();

        fake_lease(&f, 0x6A6A6A6A);
        client_op_start(&o, OP_FREE_KEEP, f.c, f.l);
        fake_watch(f.listen_fd, true, &w);
        fake_read_free(f.vc, LEASE_ID, true, false);
        fake_reply_kept(f.vc, true);
        ck_assert_msg(client_op_finish(&o) == 0, "vmmb_free_keep: %s", o.message);

        unmaps = calls("cuMemUnmap");
        fake_ask(&w, LEASE_ID);
        fake_read_free(w.answer, LEASE_ID, false, false);       /* unmapped and freed; not answered yet */
        ck_assert_uint_gt(calls("cuMemUnmap"), unmaps);

        ck_assert_int_eq(cu->cuMemCreate(&other, 2 * MiB, &prop, 0), CUDA_SUCCESS);
        client_op_start(&o, OP_ALLOC, f.c, NULL);
        fake_read_call(f.vc, VMMB_METHOD_ALLOC, NULL);
        fake_reply_lease(f.vc, f.handle);                       /* served before the Free was read */
        fake_read_call(f.vc, VMMB_METHOD_ALLOC, NULL);          /* asked again */
        fake_reply_lease_id(f.vc, other, OTHER_ID);
        ck_assert_msg(client_op_finish(&o) == 0, "vmmb_alloc: %s", o.message);
        ck_assert_str_eq(vmmb_lease_id(o.lease), OTHER_ID);
        fake_reply(w.answer, NULL, NULL, 0);                    /* the Free's answer */
        ck_assert(!fake_pending(f.listen_fd));

        fake_lease_done(&f);
        fake_watch_done(&w);
        ck_assert_int_eq(cu->cuMemRelease(other), CUDA_SUCCESS);
}
END_TEST

/*
 * The real daemon restarted under a client that kept a lease: the daemon stores keeping, so the next Alloc
 * of the size (on the new connection) gets the same lease back, at the same address, zeroed; the next keep,
 * the first on that connection, is kept too.
 */
START_TEST(test_keep_across_restart) {
        Supervisor *s = daemon_start();
        vmmb_client *c = connect_or_fail(supervisor_socket_path(s));
        vmmb_lease *l = alloc_or_fail(c, 4 * MiB, 0, "reconnect");
        char id[VMMB_ID_MAX + 1];
        uint64_t ptr = vmmb_lease_ptr(l);
        int64_t ready;

        snprintf(id, sizeof(id), "%s", vmmb_lease_id(l));
        for (unsigned i = 0; i < 2; i++) {
                fill(l, 0x4E570000 + i);
                ck_assert_msg(vmmb_free_keep(l) == 0, "vmmb_free_keep: %s", vmmb_error_message());
                ready = supervisor_restart(s, i == 0 ? SIGTERM : SIGKILL, READY_MS);
                ck_assert_msg(ready >= 0, "restart: %s", strerror((int)-ready));
                ck_assert_uint_eq(daemon_leases(supervisor_socket_path(s)), 1);
                l = alloc_or_fail(c, 4 * MiB, 0, "reconnect");
                ck_assert_str_eq(vmmb_lease_id(l), id);
                ck_assert_uint_eq(vmmb_lease_ptr(l), ptr);
                ck_assert(lease_reads(l, 0));
        }
        ck_assert_int_eq(vmmb_free(l), 0);
        ck_assert_uint_eq(daemon_leases(supervisor_socket_path(s)), 0);
        vmmb_close(c);
        supervisor_free(s);
}
END_TEST

/* ---- requests the library's own account no longer matches ----------------------------------------------- */

/* Whether the library sent something on `vc` before the broker's default ReclaimTimeout= (5 s) passed. */
#define ANSWER_MS 5000
#define assert_answered(vc, what)                                                                               \
        ck_assert_msg(readable(varlink_conn_get_fd(vc), ANSWER_MS), "the request for %s was left unanswered "   \
                      "for %d ms", (what), ANSWER_MS)

/* Reads a SetReclaimable of `id`: with `priority`, or without one (unmarking) when it is negative. */
static void fake_read_mark(VarlinkConn *vc, const char *id, int priority) {
        _cleanup_free_ char *text = NULL;
        json_object *params, *v;

        fake_read_call(vc, VMMB_METHOD_SET_RECLAIMABLE, &text);
        params = json_tokener_parse(text);
        ck_assert_ptr_nonnull(params);
        ck_assert(json_object_object_get_ex(params, "id", &v));
        ck_assert_str_eq(json_object_get_string(v), id);
        if (priority < 0)
                ck_assert_msg(!json_object_object_get_ex(params, "priority", &v) || json_object_is_type(v, json_type_null),
                              "a SetReclaimable with a priority, not an unmarking: %s", text);
        else {
                ck_assert(json_object_object_get_ex(params, "priority", &v));
                ck_assert_int_eq(json_object_get_int64(v), priority);
        }
        json_object_put(params);
}

/*
 * vmmb_give_back_kept() unmaps a kept lease and frees it; the broker reads the Free and the connection is
 * lost before its answer (it stopped, or crashed before it carried the call out): whether the lease ended is
 * unknown, and the call is not sent again. A broker that did not carry it out still keeps the lease for the
 * process and asks for it when another call waits for room. The library, which unmapped it, must free it
 * then, as it does for a keep-Free lost the same way (the "dropped" record); it forgot the id instead, and
 * the request went unanswered until the broker's deadline: the waiting call not served, the lease marked
 * unresponsive, its memory held for the life of the process.
 */
START_TEST(test_kept_give_back_lost_then_asked) {
        FakeLease f;
        FakeWatch w;
        ClientOp o;

        fake_lease(&f, 0x6B6B6B6B);
        client_op_start(&o, OP_FREE_KEEP, f.c, f.l);
        fake_watch(f.listen_fd, true, &w);
        fake_read_free(f.vc, LEASE_ID, true, false);
        fake_reply_kept(f.vc, true);
        ck_assert_msg(client_op_finish(&o) == 0, "vmmb_free_keep: %s", o.message);

        client_op_start(&o, OP_GIVE_BACK_KEPT, f.c, NULL);
        fake_read_free(f.vc, LEASE_ID, false, false);
        f.vc = varlink_conn_free(f.vc);         /* read, not answered: gone */
        ck_assert_int_eq(client_op_finish(&o), -ECONNRESET);
        ck_assert(!fake_pending(f.listen_fd));

        /* The broker kept it after all, and asks for it: the library frees it on its connection for answers. */
        fake_ask(&w, LEASE_ID);
        assert_answered(w.answer, "the kept lease");
        fake_read_free(w.answer, LEASE_ID, false, false);
        fake_reply(w.answer, NULL, NULL, 0);

        fake_lease_done(&f);
        fake_watch_done(&w);
}
END_TEST

/*
 * The watch's connection is lost (a broker restart, as far as the watch can tell): it watches again and marks
 * again, on its connection for answers, every lease still marked. The program unmarks one of them at the same
 * time on its own connection, and the broker, which orders two connections' calls as it likes, reads the
 * program's unmarking first and the watch's marking after: the lease is marked in the broker and not in the
 * library, with no error anywhere. When the broker asks for it, the library must refuse (unmark it), so that
 * the broker asks the next lease at once; it ignored the request instead (it looked only at leases marked
 * here), which held the waiting call until the broker's deadline (ReclaimTimeout=).
 */
START_TEST(test_unmarked_while_marked_again) {
        FakeLease f;
        FakeWatch w;
        ClientOp o;

        fake_lease(&f, 0x7C7C7C7C);
        client_op_start(&o, OP_MARK, f.c, f.l);
        fake_watch(f.listen_fd, true, &w);
        fake_read_mark(f.vc, LEASE_ID, 3);
        fake_reply(f.vc, NULL, NULL, 0);
        ck_assert_msg(client_op_finish(&o) == 0, "vmmb_lease_set_reclaimable: %s", o.message);

        /* The watch lost: it watches again, then marks the lease again on its connection for answers. */
        w.watch = varlink_conn_free(w.watch);
        w.watch = fake_watch_on(f.listen_fd);
        ck_assert_msg(readable(varlink_conn_get_fd(w.answer), -1), "the watch did not mark again");

        /* The program unmarks it meanwhile; the broker reads that first, then the watch's marking. */
        client_op_start(&o, OP_UNMARK, f.c, f.l);
        fake_read_mark(f.vc, LEASE_ID, -1);
        fake_reply(f.vc, NULL, NULL, 0);
        ck_assert_msg(client_op_finish(&o) == 0, "vmmb_lease_set_reclaimable: %s", o.message);
        fake_read_mark(w.answer, LEASE_ID, 3);
        fake_reply(w.answer, NULL, NULL, 0);

        /* Asked for: refused (unmarked) on the connection for answers, the lease still mapped and the program's. */
        fake_ask(&w, LEASE_ID);
        assert_answered(w.answer, "the unmarked lease");
        fake_read_mark(w.answer, LEASE_ID, -1);
        fake_reply(w.answer, NULL, NULL, 0);
        ck_assert_int_eq(vmmb_lease_reclaimed(f.l), 0);
        ck_assert(lease_reads(f.l, 0x7C7C7C7C));
        ck_assert(!fake_pending(f.listen_fd));

        fake_lease_done(&f);
        fake_watch_done(&w);
}
END_TEST

/*
 * The broker comes back and goes away again while the watch marks again (a crash loop): it answers the first
 * marking, and is gone with the second unread. The call for the second waited for a broker to listen, as any
 * call does, for $VMMBROKER_RECONNECT_TIMEOUT (30 s by default) without looking at the watch's stop, and the
 * last client's vmmb_close() joins the watch's thread: it waited as long. (Only that call: the client leaves
 * the watch first, so the watch finds no more leases to mark.) Now the watch's calls do not wait for a broker;
 * its own loop does, and sees the stop.
 */
#define REMARK_LEASES 3
START_TEST(test_close_while_marking_again) {
        CUmemGenericAllocationHandle handles[REMARK_LEASES];
        char ids[REMARK_LEASES][VMMB_ID_MAX + 1];
        char path[128];
        int listen_fd;
        vmmb_client *c;
        VarlinkConn *vc;
        uint64_t start, took;
        FakeWatch w;
        ClientOp o;

        ck_assert_int_eq(setenv("VMMBROKER_RECONNECT_TIMEOUT", "10", 1), 0);
        listen_fd = fake_listen(path);
        vc = fake_connect(listen_fd, path, &c);
        for (unsigned i = 0; i < REMARK_LEASES; i++) {
                CUmemAllocationProp prop = cuda_slab_prop(0);

                snprintf(ids[i], sizeof(ids[i]), "0011223344556677889900aabbccdd%02x", i);
                ck_assert_int_eq(cu->cuMemCreate(&handles[i], 2 * MiB, &prop, 0), CUDA_SUCCESS);
                client_op_start(&o, OP_ALLOC, c, NULL);
                fake_read_call(vc, VMMB_METHOD_ALLOC, NULL);
                fake_reply_lease_id(vc, handles[i], ids[i]);
                ck_assert_msg(client_op_finish(&o) == 0, "vmmb_alloc: %s", o.message);
                client_op_start(&o, OP_MARK, c, o.lease);
                if (i == 0)
                        fake_watch(listen_fd, true, &w);
                fake_read_mark(vc, ids[i], 3);
                fake_reply(vc, NULL, NULL, 0);
                ck_assert_msg(client_op_finish(&o) == 0, "vmmb_lease_set_reclaimable: %s", o.message);
        }

        /* The broker goes away (it stops listening first: nothing connects to the old socket) and comes back:
         * the watch watches again, then marks again on a new connection for answers, in the order the leases
         * were made. */
        safe_close(listen_fd);
        vc = varlink_conn_free(vc);
        fake_watch_done(&w);
        listen_fd = fake_listen(path);
        w.watch = fake_watch_on(listen_fd);
        w.answer = fake_accept(listen_fd);
        fake_read_mark(w.answer, ids[0], 3);
        fake_reply(w.answer, NULL, NULL, 0);

        /* The second marking sent, the broker goes away for good, with it unread: the call is sent again
         * (the broker did not carry it out) once a broker listens. */
        ck_assert_msg(readable(varlink_conn_get_fd(w.answer), -1), "the watch did not mark the second lease");
        safe_close(listen_fd);
        ck_assert_int_eq(unlink(path), 0);
        fake_watch_done(&w);

        /*
         * Before the fix this took the whole 10 s timeout, less the few ms since the fake closed: a deadline,
         * not a race. Now the watch thread is at most in one connect() that fails at once, or in its pause
         * between tries, which the stop ends; vmmb_close() itself tries each Free once without waiting. 5 s
         * is far more than that takes on a slow machine under a sanitizer, and far less than 10 s.
         */
        start = harness_now_msec();
        vmmb_close(c);
        took = harness_now_msec() - start;
        ck_assert_msg(took < 5000, "vmmb_close() took %llu ms", (unsigned long long)took);
        for (unsigned i = 0; i < REMARK_LEASES; i++)
                ck_assert_int_eq(cu->cuMemRelease(handles[i]), CUDA_SUCCESS);
}
END_TEST

int main(void) {
        Suite *s = suite_create("reconnect");
        TCase *tc = tcase_create("reconnect");
        int failed;

        tcase_add_checked_fixture(tc, setup, teardown);
        tcase_add_loop_test(tc, test_restart, 0, 2);
        tcase_add_test(tc, test_call_while_down);
        tcase_add_test(tc, test_restart_marks_again);
        tcase_add_test(tc, test_long_outage_marks_again);
        tcase_add_test(tc, test_parked_not_marked_again);
        tcase_add_test(tc, test_gives_up);
        tcase_add_test(tc, test_timeout_env);
        tcase_add_test(tc, test_close_does_not_wait);
        tcase_add_test(tc, test_park_old_broker);
        tcase_add_test(tc, test_park_failed_maps_again);
        tcase_add_test(tc, test_unread_call_is_sent_again);
        tcase_add_test(tc, test_read_call_is_not_sent_again);
        tcase_add_test(tc, test_keep_answered_then_oneway);
        tcase_add_test(tc, test_keep_old_broker_refuses);
        tcase_add_test(tc, test_keep_old_broker_frees);
        tcase_add_test(tc, test_keep_no_watch);
        tcase_add_test(tc, test_keep_stale_dropped);
        tcase_add_test(tc, test_keep_given_back_while_handed_back);
        tcase_add_test(tc, test_keep_across_restart);
        tcase_add_test(tc, test_kept_give_back_lost_then_asked);
        tcase_add_test(tc, test_unmarked_while_marked_again);
        tcase_add_test(tc, test_close_while_marking_again);
        suite_add_tcase(s, tc);

        failed = run_suite(s);
        return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
