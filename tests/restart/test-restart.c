/* SPDX-License-Identifier: MIT */

/*
 * Restarts without loss, on the simulated device: the daemon runs under the
 * test supervisor (tests/supervisor: systemd's fd store and socket passing,
 * without systemd), client processes hold leases with canary words in them,
 * and the daemon is restarted with SIGTERM and with SIGKILL. Some clients
 * keep their leases parked in host memory between checks. After every
 * restart: every lease is still there with its holders, parked or not as it
 * was, every canary word is intact (a parked lease is unparked to check it,
 * and parked again), the fd store holds exactly the live slabs and one state, and the
 * leases of clients that died while the daemon was down are gone.
 *
 * VMMB_RESTARTS sets the number of restarts of the long test (default 100,
 * half SIGKILL).
 */

#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "harness.h"
#include "macro.h"
#include "rawclient.h"
#include "size.h"
#include "supervisor.h"
#include "unit.h"

#define MiB (UINT64_C(1) << 20)
#define N_CLIENTS 4
#define STORE_MAX 4096

/* ---- a client that holds a lease with a canary and checks it on request ------------------------------ */

typedef struct ClientArgs {
        const char *socket;
        uint64_t size;
        uint32_t word;
        bool park;                      /* keep the lease parked between checks */
        int report_w, hold_r;           /* report: its lease id, then one byte per check; hold: 'v' to check */
} ClientArgs;

/* Parks lease `id` (unmapped already) on a connection of its own; 0 when its content is in host memory. */
static int park(const char *socket, const char *id) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        char params[128];
        Reply r = {};
        int k;

        snprintf(params, sizeof(params), "{\"id\": \"%s\"}", id);
        k = conn_open(socket, &c);
        if (k == 0)
                k = call_text(c, "io.vmmbroker.Park", params, &r);
        if (k == 0 && !json_object_get_boolean(json_object_object_get(r.params, "parked")))
                k = -EPROTO;
        reply_done(&r);
        return k;
}

/* Unparks lease `id`, maps it, checks its canary, unmaps it and parks it again. Returns 0 or 1. */
static int check_parked(const ClientArgs *a, Gpu *g, const char *id) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        CUdeviceptr va = 0;
        char params[128];
        TestLease l;
        Reply r = {};
        int k, bad;

        snprintf(params, sizeof(params), "{\"id\": \"%s\"}", id);
        k = conn_open(a->socket, &c);
        CHILD_CHECK(k == 0, "connect: %s", strerror(-k));
        k = call_text(c, "io.vmmbroker.Unpark", params, &r);
        CHILD_CHECK(k == 0, "Unpark: %s", r.error ?: strerror(-k));
        k = lease_take(&r, &l);
        reply_done(&r);
        CHILD_CHECK(k == 0 && gpu_map(g, &l, &va) == 0, "map the unparked lease");
        test_lease_close(&l);
        bad = gpu_verify(g, va, a->size, a->word);
        CHILD_CHECK(cuda_unmap(g->cu, va, l.sizes, l.n) == 0, "unmap");
        CHILD_CHECK(park(a->socket, id) == 0, "Park again");
        return bad;
}

static int child_client(void *arg) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        ClientArgs *a = arg;
        CUdeviceptr va = 0;
        TestLease l;
        CUresult r;
        Gpu g;
        char cmd;
        int k;

        CHILD_CHECK(close_all_but((const int[]){ a->report_w, a->hold_r }, 2) == 0, "close fds");
        CHILD_CHECK(gpu_open(&g) == 0, "no driver");
        k = conn_open(a->socket, &c);
        CHILD_CHECK(k == 0, "connect: %s", strerror(-k));
        k = lease_alloc(c, a->size, &l);
        CHILD_CHECK(k == 0, "Alloc: %s", strerror(-k));
        CHILD_CHECK(gpu_map(&g, &l, &va) == 0, "map");
        test_lease_close(&l);
        r = g.cu->cuMemsetD32(va, a->word, a->size / 4);
        CHILD_CHECK(r == CUDA_SUCCESS, "cuMemsetD32: %s", cuda_result_name(g.cu, r));
        if (a->park) {
                CHILD_CHECK(cuda_unmap(g.cu, va, l.sizes, l.n) == 0, "unmap");
                CHILD_CHECK(park(a->socket, l.id) == 0, "Park");
        }
        CHILD_CHECK(write(a->report_w, l.id, sizeof(l.id)) == (ssize_t)sizeof(l.id), "pipe");
        /* The connection is not needed any more: the lease is the process's, whatever becomes of it. */
        c = varlink_conn_free(c);
        while (pipe_get(a->hold_r, &cmd, 1) == 1) {
                int bad = a->park ? check_parked(a, &g, l.id) : gpu_verify(&g, va, a->size, a->word);

                CHILD_CHECK(pipe_put(a->report_w, bad == 0 ? 'k' : 'x') == 0, "pipe");
        }
        return 0;                       /* exits holding its lease: the daemon reclaims it */
}

typedef struct Client {
        HeldChild held;
        char id[VMMB_ID_MAX + 1];
        bool alive;
        bool parked;
} Client;

static Client client_start_parked(const char *socket, uint64_t size, uint32_t word, bool park) {
        ClientArgs a = { .socket = socket, .size = size, .word = word, .park = park };
        Client x = { .alive = true, .parked = park };

        ck_assert_msg(held_child_start(child_client, &a, &a.report_w, &a.hold_r, x.id, sizeof(x.id), &x.held) == 0,
                      "a client did not report its lease (see its stderr)");
        x.id[VMMB_ID_MAX] = 0;
        return x;
}

static Client client_start(const char *socket, uint64_t size, uint32_t word) {
        return client_start_parked(socket, size, word, false);
}

/* Asks the client to check its canary; true if every word was intact. */
static bool client_check(Client *x) {
        char reply = 0;

        ck_assert_int_eq(pipe_put(x->held.hold_w, 'v'), 0);
        ck_assert_int_eq(pipe_get(x->held.report_r, &reply, 1), 1);
        return reply == 'k';
}

/* ---- the daemon under the supervisor -------------------------------------------------------------------- */

/* The daemon under the supervisor, with `config` as its vmmbroker.conf (NULL: none, the defaults). */
static Supervisor *daemon_start_with(char *dir, size_t dir_len, const char *config) {
        static char socket_arg[128], config_arg[128];
        const char *daemon = getenv("VMMBROKER_DAEMON");
        Supervisor *s = NULL;
        int64_t ready;

        ck_assert_ptr_nonnull(daemon);
        snprintf(dir, dir_len, "/tmp/vmmb-restart-XXXXXX");
        ck_assert_ptr_nonnull(mkdtemp(dir));
        snprintf(socket_arg, sizeof(socket_arg), "%s/not-inherited", dir);
        snprintf(config_arg, sizeof(config_arg), "%s/vmmbroker.conf", dir);   /* missing: the defaults */
        if (config) {
                FILE *f = fopen(config_arg, "we");

                ck_assert_ptr_nonnull(f);
                ck_assert_int_ge(fputs(config, f), 0);
                ck_assert_int_eq(fclose(f), 0);
        }
        ck_assert_int_eq(supervisor_new(&(SupervisorOptions){
                                 .path = daemon,
                                 .argv = (const char *const[]){ daemon, "--socket", socket_arg, "--config", config_arg,
                                                                NULL },
                                 .fd_store_max = STORE_MAX,
                         }, &s), 0);
        ck_assert_int_eq(supervisor_start(s), 0);
        ready = supervisor_wait_ready(s, 60000);
        ck_assert_msg(ready >= 0, "the daemon did not get ready: %s", strerror((int)-ready));
        return s;
}

static Supervisor *daemon_start(char *dir, size_t dir_len) {
        return daemon_start_with(dir, dir_len, NULL);
}

static void daemon_done(Supervisor *s, char *dir) {
        char config[128];

        ck_assert_int_eq(supervisor_stop(s, SIGTERM), 0);
        supervisor_free(s);
        snprintf(config, sizeof(config), "%s/vmmbroker.conf", dir);
        (void)unlink(config);
        (void)rmdir(dir);
}

/* The leases the daemon lists, and checks that each of `clients` alive is there, held by its process. */
static void check_leases(Supervisor *s, Client *clients, size_t n) {
        ListReply list = {};
        size_t alive = 0, slabs = 0;
        int stored;

        ck_assert_int_eq(list_get(supervisor_socket_path(s), true, &list), 0);
        for (size_t i = 0; i < n; i++) {
                const WireLeaseInfo *info = list_find(&list, clients[i].id);

                if (!clients[i].alive) {
                        ck_assert_msg(!info, "the lease of a client that died is still there");
                        continue;
                }
                alive++;
                ck_assert_msg(info, "lease %s was lost", clients[i].id);
                ck_assert_uint_eq(info->n_holders, 1);
                ck_assert_int_eq(info->holders[0].pid, clients[i].held.pid);
                ck_assert_msg(info->parked == clients[i].parked, "lease %s is %sparked", clients[i].id,
                              info->parked ? "" : "not ");
                ck_assert(info->holders[0].parked == clients[i].parked);
                ck_assert_msg(client_check(&clients[i]), "the canary of lease %s changed", clients[i].id);
        }
        ck_assert_uint_eq(list.n_leases, alive);
        for (size_t i = 0; i < list.n_leases; i++)
                slabs += list.leases[i].slabs;
        list_reply_done(&list);
        /* The store: the slabs of the leases, any the pool keeps cached, and one state. */
        stored = supervisor_store_count(s);
        ck_assert_int_ge(stored, (int)slabs + 1);
}

/* ---- a hold parked while another process maps the lease --------------------------------------------- */

typedef struct AttachArgs {
        const char *socket;
        const char *token;
        int report_w, hold_r;           /* report: 'a' once attached, then 'y' or 'n' for each park */
} AttachArgs;

/* Attaches the token's lease (maps nothing), then on each command parks its hold: 'y' when the content moved. */
static int child_attach_park(void *arg) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        AttachArgs *a = arg;
        char params[128], cmd;
        TestLease l;
        Reply r = {};
        int k;

        CHILD_CHECK(close_all_but((const int[]){ a->report_w, a->hold_r }, 2) == 0, "close fds");
        snprintf(params, sizeof(params), "{\"token\": \"%s\"}", a->token);
        k = conn_open(a->socket, &c);
        CHILD_CHECK(k == 0, "connect: %s", strerror(-k));
        k = call_text(c, "io.vmmbroker.Attach", params, &r);
        CHILD_CHECK(k == 0 && !r.error, "Attach: %s", r.error ?: strerror(-k));
        CHILD_CHECK(lease_take(&r, &l) == 0, "the lease");
        reply_done(&r);
        test_lease_close(&l);
        c = varlink_conn_free(c);
        CHILD_CHECK(pipe_put(a->report_w, 'a') == 0, "pipe");
        while (pipe_get(a->hold_r, &cmd, 1) == 1)
                CHILD_CHECK(pipe_put(a->report_w, park(a->socket, l.id) == 0 ? 'y' : 'n') == 0, "pipe");
        return 0;
}

static const WireHolder *holder_of(const WireLeaseInfo *info, pid_t pid) {
        for (size_t i = 0; i < info->n_holders; i++)
                if (info->holders[i].pid == pid)
                        return &info->holders[i];
        ck_abort_msg("process %d does not hold lease %s", (int)pid, info->id);
        return NULL;
}

/*
 * This process parks its hold of a lease that a child still maps; the daemon is killed and restarted; the
 * lease is still not parked and this process's hold still is; when the child parks, the content moves.
 */
START_TEST(test_restart_keeps_hold_parking) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        char dir[64], params[128], report = 0;
        Supervisor *s = daemon_start(dir, sizeof(dir));
        const char *socket = supervisor_socket_path(s);
        _cleanup_free_ char *token = NULL;
        const WireLeaseInfo *info;
        AttachArgs a = { .socket = socket };
        ListReply list = {};
        HeldChild child;
        TestLease l;
        Reply r = {};

        ck_assert_int_eq(conn_open(socket, &c), 0);
        ck_assert_int_eq(lease_alloc(c, 6 * MiB, &l), 0);
        test_lease_close(&l);
        snprintf(params, sizeof(params), "{\"id\": \"%s\"}", l.id);
        ck_assert_int_eq(call_text(c, "io.vmmbroker.Share", params, &r), 0);
        ck_assert_msg(!r.error, "Share: %s", r.error);
        token = strdup(reply_str(&r, "token"));
        reply_done(&r);
        a.token = token;
        ck_assert_int_eq(held_child_start(child_attach_park, &a, &a.report_w, &a.hold_r, &report, 1, &child), 0);
        ck_assert_int_eq(report, 'a');

        ck_assert_int_eq(park(socket, l.id), -EPROTO);          /* parked: false, the child maps it */
        ck_assert_int_ge(supervisor_restart(s, SIGKILL, 60000), 0);

        ck_assert_int_eq(list_get(socket, true, &list), 0);
        info = list_find(&list, l.id);
        ck_assert_ptr_nonnull(info);
        ck_assert(!info->parked);
        ck_assert(holder_of(info, getpid())->parked);
        ck_assert(!holder_of(info, child.pid)->parked);
        list_reply_done(&list);

        ck_assert_int_eq(pipe_put(child.hold_w, 'p'), 0);
        ck_assert_int_eq(pipe_get(child.report_r, &report, 1), 1);
        ck_assert_msg(report == 'y', "the child's park did not move the content: the restart forgot this hold");
        ck_assert_int_eq(list_get(socket, true, &list), 0);
        ck_assert(list_find(&list, l.id)->parked);
        list_reply_done(&list);

        ck_assert_int_eq(held_child_finish(&child), 0);
        daemon_done(s, dir);
}
END_TEST

START_TEST(test_restart_keeps_leases) {
        Client clients[N_CLIENTS];
        char dir[64];
        /* Host slabs of 2 MiB: the parked leases of 6 and 18 MiB are in 3 and 9 of them. */
        Supervisor *s = daemon_start_with(dir, sizeof(dir), "[Broker]\nMaxSlab=16M\nHostSlab=2M\n");

        /* Every other client keeps its lease parked; the first, which dies below, among them. */
        for (size_t i = 0; i < N_CLIENTS; i++)
                clients[i] = client_start_parked(supervisor_socket_path(s), (i + 1) * 6 * MiB,
                                                 0xCA000000u + (uint32_t)i, i % 2 == 0);
        check_leases(s, clients, N_CLIENTS);

        ck_assert_int_ge(supervisor_restart(s, SIGTERM, 60000), 0);
        check_leases(s, clients, N_CLIENTS);
        ck_assert_int_ge(supervisor_restart(s, SIGKILL, 60000), 0);
        check_leases(s, clients, N_CLIENTS);

        /* A client dies while the daemon is down: its lease is reclaimed when the daemon comes back. */
        ck_assert_int_eq(supervisor_stop(s, SIGKILL), 128 + SIGKILL);
        ck_assert_int_eq(kill(clients[0].held.pid, SIGKILL), 0);
        ck_assert_int_eq(held_child_finish(&clients[0].held), 128 + SIGKILL);
        clients[0].alive = false;
        ck_assert_int_eq(supervisor_start(s), 0);
        ck_assert_int_ge(supervisor_wait_ready(s, 60000), 0);
        check_leases(s, clients, N_CLIENTS);

        for (size_t i = 1; i < N_CLIENTS; i++)
                ck_assert_int_eq(held_child_finish(&clients[i].held), 0);
        daemon_done(s, dir);
}
END_TEST

/*
 * Many restarts, half with SIGKILL, while clients hold leases and check their canaries after each one;
 * every tenth, one client dies while the daemon is down and a new one takes its place after.
 */
START_TEST(test_many_restarts) {
        const char *e = getenv("VMMB_RESTARTS");
        unsigned restarts = e ? (unsigned)strtoul(e, NULL, 10) : 100, died = 0;
        Client clients[N_CLIENTS];
        int64_t ready, slowest = 0;
        char dir[64];
        Supervisor *s = daemon_start(dir, sizeof(dir));

        for (size_t i = 0; i < N_CLIENTS; i++)
                clients[i] = client_start(supervisor_socket_path(s), (i + 1) * 2 * MiB, 0x5E000000u + (uint32_t)i);
        for (unsigned r = 0; r < restarts; r++) {
                int sig = r % 2 ? SIGKILL : SIGTERM;
                size_t victim = r % N_CLIENTS;

                if (r % 10 == 9) {
                        ck_assert_int_eq(supervisor_stop(s, sig), sig == SIGKILL ? 128 + SIGKILL : 0);
                        ck_assert_int_eq(kill(clients[victim].held.pid, SIGKILL), 0);
                        ck_assert_int_eq(held_child_finish(&clients[victim].held), 128 + SIGKILL);
                        clients[victim].alive = false;
                        died++;
                        ck_assert_int_eq(supervisor_start(s), 0);
                        ready = supervisor_wait_ready(s, 60000);
                } else
                        ready = supervisor_restart(s, sig, 60000);
                ck_assert_msg(ready >= 0, "restart %u: the daemon did not get ready", r);
                slowest = ready > slowest ? ready : slowest;
                check_leases(s, clients, N_CLIENTS);
                if (!clients[victim].alive) {
                        /* its lease was reclaimed (checked above); a new client leases in its place */
                        clients[victim] = client_start(supervisor_socket_path(s), (victim + 1) * 2 * MiB,
                                                       0x5E000000u + (uint32_t)(r << 8) + (uint32_t)victim);
                        check_leases(s, clients, N_CLIENTS);
                }
        }
        fprintf(stderr, "restart: %u restarts (%u with SIGKILL), %u clients died while the daemon was down, every "
                "lease and canary kept; the slowest exec to READY=1 took %" PRId64 " us\n", restarts, restarts / 2,
                died, slowest);
        for (size_t i = 0; i < N_CLIENTS; i++)
                ck_assert_int_eq(held_child_finish(&clients[i].held), 0);

        /*
         * No slab leaked: with every client gone, one more restart finds nothing to restore and lets go of
         * the slabs its pool had cached (the table does not record their owners). What stays stored is the
         * table, and at most the one unbound slab the pool makes ahead when it is idle (pool.h).
         */
        ck_assert_int_ge(supervisor_restart(s, SIGTERM, 60000), 0);
        {
                WireDevice d;
                int stored = supervisor_store_count(s);

                ck_assert_int_eq(harness_status(supervisor_socket_path(s), &d), 0);
                ck_assert_uint_eq(d.leases, 0);
                ck_assert_uint_eq(d.leased, 0);
                ck_assert_msg(stored >= 1 && stored <= 2, "%d fds stored with no lease left", stored);
        }
        daemon_done(s, dir);
}
END_TEST

/* A client that leases `n` leases of 2 MiB (not mapped) and holds them until its hold pipe closes. */
typedef struct BulkArgs {
        const char *socket;
        unsigned n;
        int report_w, hold_r;
} BulkArgs;

static int child_bulk(void *arg) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        BulkArgs *a = arg;
        char x = 'r';
        int k;

        CHILD_CHECK(close_all_but((const int[]){ a->report_w, a->hold_r }, 2) == 0, "close fds");
        k = conn_open(a->socket, &c);
        CHILD_CHECK(k == 0, "connect: %s", strerror(-k));
        for (unsigned i = 0; i < a->n; i++) {
                TestLease l;

                k = lease_alloc(c, 2 * MiB, &l);
                CHILD_CHECK(k == 0, "Alloc %u: %s", i, strerror(-k));
                test_lease_close(&l);
        }
        CHILD_CHECK(write(a->report_w, &x, 1) == 1, "pipe");
        CHILD_CHECK(pipe_wait_eof(a->hold_r) == 0, "hold");
        return 0;
}

/*
 * The time from starting the daemon to READY=1 with many live leases, which it restores before it says
 * ready: VMMB_RESTART_LEASES of them (default 200; the GPU run uses 1000). Printed, never judged.
 */
START_TEST(test_ready_with_many_leases) {
        const char *e = getenv("VMMB_RESTART_LEASES");
        BulkArgs a = { .n = e ? (unsigned)strtoul(e, NULL, 10) : 200 };
        ListReply list = {};
        HeldChild bulk;
        char dir[64], x;
        Supervisor *s = daemon_start(dir, sizeof(dir));
        int64_t term, killed;

        a.socket = supervisor_socket_path(s);
        ck_assert_int_eq(held_child_start(child_bulk, &a, &a.report_w, &a.hold_r, &x, 1, &bulk), 0);
        term = supervisor_restart(s, SIGTERM, 120000);
        ck_assert_int_ge(term, 0);
        killed = supervisor_restart(s, SIGKILL, 120000);
        ck_assert_int_ge(killed, 0);
        ck_assert_int_eq(list_get(supervisor_socket_path(s), true, &list), 0);
        ck_assert_uint_eq(list.n_leases, a.n);
        list_reply_done(&list);
        fprintf(stderr, "restart: %u live leases: start to READY=1 took %" PRId64 " us after SIGTERM, %" PRId64
                " us after SIGKILL (every lease restored)\n", a.n, term, killed);
        ck_assert_int_eq(held_child_finish(&bulk), 0);
        daemon_done(s, dir);
}
END_TEST


/* Calls `method` on `c` with {"id": ID} and `more` (JSON members, or ""); fails the test on an error reply. */
static void call_id_or_fail(VarlinkConn *c, const char *method, const char *id, const char *more, Reply *ret) {
        char params[160];

        snprintf(params, sizeof(params), "{\"id\": \"%s\"%s}", id, more);
        ck_assert_int_eq(call_text(c, method, params, ret), 0);
        ck_assert_msg(!ret->error, "%s: %s", method, ret->error);
}

/* Free with keep on `c`: whether the daemon kept the lease. */
static bool free_keep(VarlinkConn *c, const char *id) {
        Reply r = {};
        bool kept;

        call_id_or_fail(c, "io.vmmbroker.Free", id, ", \"keep\": true", &r);
        kept = json_object_get_boolean(json_object_object_get(r.params, "kept"));
        reply_done(&r);
        return kept;
}

/*
 * A lease kept for this process survives a restart kept, and zeroed again: the test writes into the memory
 * after the keep (as a scrub that had not run before a crash would leave it), the daemon is killed and
 * restarted, and the lease handed back to this process's next Alloc of its size reads zero through the
 * mapping it never unmapped.
 */
START_TEST(test_restart_keeps_kept_lease) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        char dir[64];
        Supervisor *s = daemon_start(dir, sizeof(dir));
        const char *socket = supervisor_socket_path(s);
        const WireLeaseInfo *info;
        ListReply list = {};
        CUdeviceptr va = 0;
        TestLease l, again;
        Gpu g;

        ck_assert_int_eq(gpu_open(&g), 0);
        ck_assert_int_eq(conn_open(socket, &c), 0);
        ck_assert_int_eq(lease_alloc(c, 6 * MiB, &l), 0);
        ck_assert_int_eq(gpu_map(&g, &l, &va), 0);
        test_lease_close(&l);
        ck_assert(free_keep(c, l.id));
        ck_assert_int_eq(g.cu->cuCtxSynchronize(), CUDA_SUCCESS);
        ck_assert_int_eq(g.cu->cuMemsetD32(va, 0x5EED5EEDu, 6 * MiB / 4), CUDA_SUCCESS);

        ck_assert_int_ge(supervisor_restart(s, SIGKILL, 60000), 0);
        c = varlink_conn_free(c);
        ck_assert_int_eq(list_get(socket, true, &list), 0);
        info = list_find(&list, l.id);
        ck_assert_ptr_nonnull(info);
        ck_assert(info->kept);
        ck_assert_int_eq(holder_of(info, getpid())->pid, getpid());
        list_reply_done(&list);

        ck_assert_int_eq(conn_open(socket, &c), 0);
        ck_assert_int_eq(lease_alloc(c, 6 * MiB, &again), 0);
        test_lease_close(&again);
        ck_assert_str_eq(again.id, l.id);
        ck_assert_int_eq(gpu_verify(&g, va, 6 * MiB, 0), 0);
        ck_assert_int_eq(cuda_unmap(g.cu, va, l.sizes, l.n), 0);
        ck_assert_int_eq(lease_free(c, l.id), 0);
        gpu_close(&g);
        daemon_done(s, dir);
}
END_TEST

/* Waits until the daemon has `bytes` of host memory cached for parks (scrubbed, after an unpark freed it). */
static void host_cached_or_fail(Supervisor *s, int64_t bytes) {
        WireDevice d = {};

        for (uint64_t end = harness_poll_deadline(); harness_now_msec() < end;) {
                ck_assert_int_eq(harness_status(supervisor_socket_path(s), &d), 0);
                if (d.host_cached == bytes && d.scrubbing == 0)
                        return;
        }
        ck_abort_msg("%" PRId64 " bytes of host memory cached, not %" PRId64, d.host_cached, bytes);
}

/* Unparks lease `id` on `c` and returns it (its fds open), or fails the test. */
static TestLease unpark_or_fail(VarlinkConn *c, const char *id) {
        Reply r = {};
        TestLease l;

        call_id_or_fail(c, "io.vmmbroker.Unpark", id, "", &r);
        ck_assert_int_eq(lease_take(&r, &l), 0);
        reply_done(&r);
        return l;
}

/* Stores, as the daemon's previous run might have, a memfd of `size` bytes that is not a slab, named `name`. */
static void store_not_a_slab(Supervisor *s, const char *name, uint64_t size) {
        int fd = memfd_create("not-a-slab", MFD_CLOEXEC);

        ck_assert_int_ge(fd, 0);
        ck_assert_int_eq(ftruncate(fd, (off_t)size), 0);
        ck_assert_int_eq(supervisor_store_put(s, fd, name), 0);
        safe_close(fd);
}

/*
 * Host memory cached for parks is kept across a stop (stored at exit as "hcache-<device>-<size>-<id>", taken back
 * at start) rather than pinned again: the next park uses it, a crash while it is parked there keeps the lease
 * (the slab was stored again under its new id), and its content comes back. A crash keeps no cache (its
 * "slab-<id>" is one no lease names, and is dropped). Entries of that prefix that are not such a slab (no such
 * device, a size no slab has, memory that is not a slab, names that do not parse) are closed and removed, and the
 * daemon starts.
 */
START_TEST(test_restart_keeps_host_cache) {
        static const char *const bogus[] = { "hcache-7-6291456-1", "hcache-0-1000-2", "hcache-0-6291456-3",
                                             "hcache-0-6291456", "hcache-0-6291456-4-5", "hcache--1-6291456-6",
                                             "hcache-99999999999999999999-6291456-7", "hcache-0-0-8" };
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        char dir[64];
        Supervisor *s = daemon_start(dir, sizeof(dir));
        const char *socket = supervisor_socket_path(s);
        CUdeviceptr va = 0;
        WireDevice d = {};
        TestLease l;
        Gpu g = {};

        /* A first park makes host memory for 6 MiB; the unpark frees it, and it is zeroed and cached. */
        ck_assert_int_eq(conn_open(socket, &c), 0);
        ck_assert_int_eq(lease_alloc(c, 6 * MiB, &l), 0);
        test_lease_close(&l);
        ck_assert_int_eq(park(socket, l.id), 0);
        l = unpark_or_fail(c, l.id);
        test_lease_close(&l);
        ck_assert_int_eq(lease_free(c, l.id), 0);
        c = varlink_conn_free(c);
        host_cached_or_fail(s, (int64_t)(6 * MiB));

        ck_assert_int_ge(supervisor_restart(s, SIGTERM, 60000), 0);
        ck_assert_int_eq(harness_status(socket, &d), 0);
        ck_assert_msg(d.host_cached == (int64_t)(6 * MiB), "a stop kept %" PRId64 " bytes of host memory cached, "
                      "not 6 MiB", d.host_cached);

        /* The next park takes it (nothing is left cached) and its content comes back through it. */
        ck_assert_int_eq(gpu_open(&g), 0);
        ck_assert_int_eq(conn_open(socket, &c), 0);
        ck_assert_int_eq(lease_alloc(c, 6 * MiB, &l), 0);
        ck_assert_int_eq(gpu_map(&g, &l, &va), 0);
        ck_assert_int_eq(g.cu->cuMemsetD32(va, 0x4ca7c4ed, 6 * MiB / 4), CUDA_SUCCESS);
        ck_assert_int_eq(g.cu->cuCtxSynchronize(), CUDA_SUCCESS);
        ck_assert_int_eq(cuda_unmap(g.cu, va, l.sizes, l.n), 0);
        test_lease_close(&l);
        ck_assert_int_eq(park(socket, l.id), 0);
        ck_assert_int_eq(harness_status(socket, &d), 0);
        ck_assert_msg(d.host_cached == 0 && d.parked == (int64_t)(6 * MiB), "the park did not take the kept host "
                      "memory: %" PRId64 " bytes cached, %" PRId64 " parked", d.host_cached, d.parked);
        /* It was stored again under its new id: a crash now keeps the lease parked in it. */
        c = varlink_conn_free(c);
        ck_assert_int_ge(supervisor_restart(s, SIGKILL, 60000), 0);
        ck_assert_int_eq(conn_open(socket, &c), 0);
        l = unpark_or_fail(c, l.id);
        ck_assert_int_eq(gpu_map(&g, &l, &va), 0);
        ck_assert_msg(gpu_verify(&g, va, 6 * MiB, 0x4ca7c4ed) == 0, "the content did not come back");
        ck_assert_int_eq(cuda_unmap(g.cu, va, l.sizes, l.n), 0);
        test_lease_close(&l);
        ck_assert_int_eq(lease_free(c, l.id), 0);
        c = varlink_conn_free(c);
        host_cached_or_fail(s, (int64_t)(6 * MiB));

        ck_assert_int_ge(supervisor_restart(s, SIGKILL, 60000), 0);
        host_cached_or_fail(s, 0);

        ck_assert_int_eq(supervisor_stop(s, SIGTERM), 0);
        for (size_t i = 0; i < ELEMENTSOF(bogus); i++)
                store_not_a_slab(s, bogus[i], 6 * MiB);
        ck_assert_int_eq(supervisor_start(s), 0);
        ck_assert_int_ge(supervisor_wait_ready(s, 60000), 0);
        host_cached_or_fail(s, 0);
        for (size_t i = 0; i < ELEMENTSOF(bogus); i++)
                ck_assert_msg(supervisor_store_find(s, bogus[i], NULL) == 0, "%s is still stored", bogus[i]);
        ck_assert_uint_eq(supervisor_stats(s).fds_duplicate, 0);     /* each entry removed before it was stored again */
        gpu_close(&g);
        daemon_done(s, dir);
}
END_TEST

/* The value of metric sample `key` (its name and labels, then a space) from the daemon's Metrics. */
static uint64_t metric(Supervisor *s, const char *key) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        Reply r = {};
        uint64_t v;

        ck_assert_int_eq(conn_open(supervisor_socket_path(s), &c), 0);
        ck_assert_int_eq(call_text(c, "io.vmmbroker.Metrics", NULL, &r), 0);
        ck_assert_msg(!r.error, "Metrics: %s", r.error);
        ck_assert_msg(harness_metric(reply_str(&r, "text"), key, &v) == 0, "the metrics have no count %s", key);
        reply_done(&r);
        return v;
}

/* Milliseconds until the daemon has `bytes` of host memory cached, polled from `start` (harness_now_msec()). */
static uint64_t until_host_cached(Supervisor *s, int64_t bytes, uint64_t start) {
        host_cached_or_fail(s, bytes);
        return harness_now_msec() - start;
}

/*
 * HostReserve= is pinned at the first start only: a restart with SIGTERM takes it all back (counted as kept, and
 * cached when the daemon says it is ready). VMMB_RESTART_RESERVE sets the reserve (default 8M, with MaxSlab=4M;
 * the GPU run uses 8G of the default 1G slabs). The time until it was cached, after each start, is printed, never
 * judged.
 */
START_TEST(test_restart_keeps_reserve) {
        const char *e = getenv("VMMB_RESTART_RESERVE");
        uint64_t reserve = 8 * MiB, slab = e ? 1024 * MiB : 4 * MiB, first, again;
        char dir[64], config[128];
        WireDevice d = {};
        Supervisor *s;
        uint64_t t0;

        ck_assert_msg(!e || (parse_size(e, &reserve) == 0 && reserve > 0 && reserve % slab == 0),
                      "VMMB_RESTART_RESERVE=%s is not a multiple of 1G", e);
        snprintf(config, sizeof(config), "[Broker]\nMaxSlab=%" PRIu64 "M\nHostReserve=%" PRIu64 "M\n", slab / MiB,
                 reserve / MiB);
        t0 = harness_now_msec();
        s = daemon_start_with(dir, sizeof(dir), config);
        first = until_host_cached(s, (int64_t)reserve, t0);
        ck_assert_uint_eq(metric(s, "vmmbroker_device_host_slabs_kept_total{device=\"0\"} "), 0);

        t0 = harness_now_msec();
        ck_assert_int_ge(supervisor_restart(s, SIGTERM, 60000), 0);
        ck_assert_int_eq(harness_status(supervisor_socket_path(s), &d), 0);
        ck_assert_msg(d.host_cached == (int64_t)reserve, "%" PRId64 " bytes of the reserve cached when the daemon "
                      "said it was ready after a restart, not %" PRIu64, d.host_cached, reserve);
        again = until_host_cached(s, (int64_t)reserve, t0);
        /* made and kept in host slabs of HostSlab='s default: 64M, or MaxSlab= if smaller */
        ck_assert_uint_eq(metric(s, "vmmbroker_device_host_slabs_kept_total{device=\"0\"} "),
                          reserve / MIN(slab, 64 * MiB));
        fprintf(stderr, "restart: HostReserve=%" PRIu64 "M cached %" PRIu64 " ms after the first start (pinned), %"
                PRIu64 " ms after a restart with SIGTERM (kept)\n", reserve / MiB, first, again);
        daemon_done(s, dir);
}
END_TEST

int main(void) {
        return run_suite(UNIT_SUITE("restart", NULL, test_restart_keeps_leases, test_many_restarts,
                                    test_ready_with_many_leases, test_restart_keeps_hold_parking,
                                    test_restart_keeps_kept_lease, test_restart_keeps_host_cache,
                                    test_restart_keeps_reserve)) == 0
                       ? EXIT_SUCCESS
                       : EXIT_FAILURE;
}
