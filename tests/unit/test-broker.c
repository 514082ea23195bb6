/* SPDX-License-Identifier: MIT */

/*
 * daemon/broker.c: every rule of the broker, with no socket and no event
 * loop. A pool on the simulated device, the broker over it, and callers made
 * by hand: a caller is a holder (a real process, watched through a real
 * pidfd: this test's own process, or a child that blocks on a pipe until it
 * is killed) with a user and whether it is an administrator. Each operation's
 * success and every outcome it documents; what each user is charged; the
 * leases a List shows; the holds of a process that exited; and the
 * write-ahead rule with a store whose writes fail: a change that could not be
 * stored is not made, and what the store holds reads back as exactly the
 * acknowledged changes.
 *
 * Every test ends (teardown) with broker_done(), whose user_registry_done()
 * asserts that every charge came back, then the pool freed with no
 * allocation of the simulated device left alive.
 */

#include <check.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/pidfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include "broker.h"
#include "driver.h"
#include "macro.h"
#include "pool.h"
#include "state.h"
#include "store.h"
#include "unit.h"

#define MiB (UINT64_C(1) << 20)
#define GiB (UINT64_C(1) << 30)
#define CAPACITY (4 * GiB)              /* the pool's, on its one device */
#define GRANULARITY (2 * MiB)           /* the simulated device's */

#define UID_A 1000                      /* the usual owner */
#define UID_B 1001                      /* another user */
#define UID_SMALL 1002                  /* [User:1002] MaxLeases=2 MaxBytes=64M */
#define UID_E 1003                      /* a stranger to everything */
#define UID_ROOT 0

/* ---- the fixture: driver, pool, broker ------------------------------------------------------------------- */

static CudaDriver *cu;
static Pool *pool;
static Broker b;
static bool broker_up;
static LimitsRule rules[1];
static LimitsConfig limits;
static unsigned long (*sim_live_allocations)(void);
static int (*sim_fail)(const char *);
static void (*sim_hold_streams)(int);
static void (*sim_hold_copies)(int);

static void open_driver(void) {
        _cleanup_free_ char *message = NULL;
        void *lib;

        ck_assert_msg(cuda_driver_open(&cu, NULL, &message) == 0, "%s", message);
        lib = dlopen(cu->path, RTLD_NOW | RTLD_NOLOAD);
        ck_assert_ptr_nonnull(lib);
        sim_live_allocations = (unsigned long (*)(void))dlsym(lib, "simcuda_live_allocations");
        sim_fail = (int (*)(const char *))dlsym(lib, "simcuda_fail");
        sim_hold_streams = (void (*)(int))dlsym(lib, "simcuda_hold_streams");
        sim_hold_copies = (void (*)(int))dlsym(lib, "simcuda_hold_copies");
        ck_assert(sim_live_allocations && sim_fail && sim_hold_streams && sim_hold_copies);
        dlclose(lib);
}

static void setup_broker_with(uint64_t max_slab) {
        _cleanup_free_ char *message = NULL;
        PoolConfig config = { .capacity = CAPACITY, .max_slab = max_slab };

        open_driver();
        ck_assert_msg(pool_new(&pool, cu, &config, &message) == 0, "%s", message);

        /* [Limits] at the defaults (MaxBytes=80%, MaxLeases=1024); [User:1002] MaxLeases=2 MaxBytes=64M. */
        limits = (LimitsConfig){ .defaults = user_limits_default(), .rules = rules, .n_rules = 1 };
        rules[0] = (LimitsRule){ .id = UID_SMALL,
                                 .limits = { .max_leases = 2, .max_bytes = 64 * MiB,
                                             .set = LIMIT_MAX_LEASES | LIMIT_MAX_BYTES } };
        ck_assert_int_eq(broker_init(&b, pool, &limits), 0);
        broker_up = true;
}

static void setup_broker(void) {
        setup_broker_with(GiB);
}

/* ---- processes: this one, and children that live until killed ------------------------------------------ */

#define MAX_CHILDREN 16

static pid_t children[MAX_CHILDREN];
static size_t n_children;
static int hold_pipe[2] = { -EBADF, -EBADF };  /* children block reading it; EOF when this process ends */

static pid_t spawn(void) {
        pid_t pid;

        ck_assert_uint_lt(n_children, MAX_CHILDREN);
        if (hold_pipe[0] < 0)
                ck_assert_int_eq(pipe2(hold_pipe, O_CLOEXEC), 0);
        pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
                char c;

                close(hold_pipe[1]);
                (void)!read(hold_pipe[0], &c, 1);
                _exit(0);
        }
        children[n_children++] = pid;
        return pid;
}

/* The process exits (killed and waited for: its pidfd is readable from then on). */
static void kill_process(pid_t pid) {
        for (size_t i = 0; i < n_children; i++)
                if (children[i] == pid) {
                        ck_assert_int_eq(kill(pid, SIGKILL), 0);
                        ck_assert_int_eq(waitpid(pid, NULL, 0), pid);
                        children[i] = children[--n_children];
                        return;
                }
        ck_abort_msg("pid %d is not a child of the test", (int)pid);
}

/* ---- callers ------------------------------------------------------------------------------------------------ */

#define MAX_CALLERS 16

static Caller callers[MAX_CALLERS];
static size_t n_callers;

/* A connection of process `pid` of user `uid`, as peer.c makes one (the caller holds a reference on its user). */
static Caller *connect_as(uid_t uid, pid_t pid, bool admin) {
        Caller *c;
        User *u;
        int pidfd;

        ck_assert_uint_lt(n_callers, MAX_CALLERS);
        c = &callers[n_callers];
        u = user_get(&b.users, uid, (const gid_t[]){ uid }, 1);
        ck_assert_ptr_nonnull(u);
        pidfd = pidfd_open(pid, 0);
        ck_assert_int_ge(pidfd, 0);
        ck_assert_int_eq(holder_connect(&b.holders, u, pid, uid, pidfd, &c->holder, NULL), 0);
        c->user = u;
        c->admin = admin;
        n_callers++;
        return c;
}

/* This test's own process, as user `uid`. */
static Caller *this_process(uid_t uid) {
        return connect_as(uid, getpid(), false);
}

/* A new process of user `uid`. */
static Caller *new_process(uid_t uid) {
        return connect_as(uid, spawn(), false);
}

/* The connection of the last caller made closes (peer.c's way): its holder goes once nothing else holds it. */
static void disconnect_last(Caller *c) {
        ck_assert_ptr_eq(c, &callers[n_callers - 1]);
        holder_disconnect(c->holder);
        user_unref(c->user);
        n_callers--;
}

static Caller *administrator(void) {
        return connect_as(UID_ROOT, spawn(), true);
}

#include "fake-fdstore.h"

static Fake fake;

/* Gives the broker a store with the fake backend; stores the table (empty or not) as its first snapshot. */
static void give_store(void) {
        StoreBackend backend = { .save = fake_save, .remove = fake_remove, .userdata = &fake };
        Store *s = NULL;

        ck_assert_int_eq(store_new(&s, &backend), 0);
        broker_set_store(&b, s);
        ck_assert_int_eq(broker_store_snapshot(&b, true), 0);
        ck_assert_int_eq(b.store_error, 0);
}

/* ---- teardown --------------------------------------------------------------------------------------------------- */

static void teardown(void) {
        /* The callers' references on their users; then the broker, whose users must all be gone. */
        for (size_t i = 0; i < n_callers; i++)
                user_unref(callers[i].user);
        n_callers = 0;
        if (broker_up) {
                broker_done(&b);
                ck_assert_uint_eq(b.users.n_users, 0);
                broker_up = false;
        }
        while (n_children > 0)
                kill_process(children[n_children - 1]);
        hold_pipe[0] = safe_close(hold_pipe[0]);
        hold_pipe[1] = safe_close(hold_pipe[1]);
        for (size_t i = 0; i < fake.n; i++)
                safe_close(fake.fds[i]);
        fake = (Fake){};
        pool = pool_free(pool);
        if (cu) {
                ck_assert_uint_eq(sim_live_allocations(), 0);
                cu = cuda_driver_close(cu);
        }
}

/* ---- helpers for the operations ------------------------------------------------------------------------------- */

static Lease *alloc_ok(const Caller *c, uint64_t size) {
        UserQuota q = {};
        Lease *l = NULL;

        ck_assert_int_eq(broker_alloc(&b, c, -1, size, NULL, &l, &q), 0);
        ck_assert_ptr_nonnull(l);
        return l;
}

/* A token's text, kept by the test (the Token itself goes with the lease or a Revoke). */
typedef struct TokenText {
        char s[LEASE_TOKEN_LEN + 1];
} TokenText;

static TokenText share_ok(const Caller *c, const Lease *l, uid_t uid, bool readonly) {
        TokenText t;
        Token *tok = NULL;

        ck_assert_int_eq(broker_share(&b, c, l->id, uid, readonly, &tok), 0);
        ck_assert_ptr_nonnull(tok);
        memcpy(t.s, tok->token, sizeof(t.s));
        return t;
}

/*
 * A name as Attach and Unpublish take it: "UID/NAME" for another user's, "NAME" for the caller's own (method.c
 * turns a user name into a uid before the broker sees it).
 */
static const char *split_ref(const Caller *c, const char *ref, uid_t *ret_owner) {
        const char *slash = strchr(ref, '/');

        *ret_owner = slash ? (uid_t)strtoul(ref, NULL, 10) : c->holder->uid;
        return slash ? slash + 1 : ref;
}

static int unpublish(const Caller *c, const char *ref) {
        uid_t owner;
        const char *name = split_ref(c, ref, &owner);

        return broker_unpublish(&b, c, owner, name);
}

/* The lease `owner` published as `name`. */
static Lease *find_name(uid_t owner, const char *name) {
        return lease_table_find_name(&b.leases, owner, name);
}

/* Waits for a move (a park's or an unpark's copy) to end, as the daemon's loop does: the pool's eventfd, then broker_finish_moves(). */
static void wait_moves_ended(uint64_t since) {
        for (unsigned i = 0; broker_moves_ended(&b) == since; i++) {
                struct pollfd p = { .fd = pool_get_fd(pool), .events = POLLIN };

                ck_assert_msg(i < 100, "the copy did not end in 10 s");
                (void)poll(&p, 1, 100);
                (void)pool_dispatch(pool);
                (void)broker_finish_moves(&b);
        }
}

/* broker_unpark() as the daemon makes it: made again, copy_waited, each time a move ended while it waits for its
 * copy (BROKER_E_HOST_COPYING), until it is answered. */
static int unpark_call(const Caller *c, const char *id, Hold **ret, UserQuota *ret_quota) {
        uint64_t ended = broker_moves_ended(&b);
        Caller again = *c;
        int k = broker_unpark(&b, c, id, ret, ret_quota);

        again.copy_waited = true;
        while (k == BROKER_E_HOST_COPYING) {
                wait_moves_ended(ended);
                ended = broker_moves_ended(&b);
                k = broker_unpark(&b, &again, id, ret, ret_quota);
        }
        return k;
}

/* broker_attach() as the daemon makes it: an Attach of a parked lease waits for its unpark as unpark_call(). */
static int attach_call(const Caller *c, const char *token, uid_t owner, const char *name, bool readonly, Hold **ret) {
        uint64_t ended = broker_moves_ended(&b);
        Caller again = *c;
        int k = broker_attach(&b, c, token, owner, name, readonly, ret, NULL);

        again.copy_waited = true;
        while (k == BROKER_E_HOST_COPYING) {
                wait_moves_ended(ended);
                ended = broker_moves_ended(&b);
                k = broker_attach(&b, &again, token, owner, name, readonly, ret, NULL);
        }
        return k;
}

static Hold *attach_token_ok(const Caller *c, const TokenText *t, bool readonly) {
        Hold *hold = NULL;

        ck_assert_int_eq(attach_call(c, t->s, UID_ANY, NULL, readonly, &hold), 0);
        ck_assert_ptr_nonnull(hold);
        ck_assert_ptr_eq(hold->holder, c->holder);
        return hold;
}

static Hold *attach_name_ok(const Caller *c, const char *ref, bool readonly) {
        Hold *hold = NULL;
        uid_t owner;
        const char *name = split_ref(c, ref, &owner);

        ck_assert_int_eq(attach_call(c, NULL, owner, name, readonly, &hold), 0);
        ck_assert_ptr_nonnull(hold);
        return hold;
}

static int attach_token(const Caller *c, const char *token) {
        Hold *hold = NULL;

        return attach_call(c, token, UID_ANY, NULL, false, &hold);
}

static int attach_name(const Caller *c, const char *ref) {
        Hold *hold = NULL;
        uid_t owner;
        const char *name = split_ref(c, ref, &owner);

        return attach_call(c, NULL, owner, name, false, &hold);
}

/* The lease with that id, or NULL once it ended (copy the id first: an ended lease is freed). */
static Lease *find(const char *id) {
        return lease_table_find(&b.leases, id);
}

/* Slabs that went back to the pool for their uid (being scrubbed or cached) rather than to the driver. */
static unsigned kept_slabs(void) {
        PoolDeviceStats s;

        pool_device_stats(pool, 0, &s);
        return s.n_scrubbing + s.n_cached;
}

static uint64_t released_slabs(void) {
        PoolDeviceStats s;

        pool_device_stats(pool, 0, &s);
        return s.released;
}

/* ---- Alloc --------------------------------------------------------------------------------------------------- */

START_TEST(test_alloc) {
        Caller *a;
        Lease *l = NULL;
        UserQuota q = {};
        Hold *hold;

        setup_broker();
        a = this_process(UID_A);
        ck_assert_int_eq(broker_alloc(&b, a, 0, 3 * MiB, "weights", &l, &q), 0);

        /* Whole slabs, rounded up to the granularity, owned by and charged to the caller's user. */
        ck_assert_uint_eq(l->size, 4 * MiB);
        ck_assert_int_eq(l->device, 0);
        ck_assert_uint_eq(l->uid, UID_A);
        ck_assert_int_eq(l->pid, getpid());
        ck_assert_str_eq(l->label, "weights");
        ck_assert(!l->foreign);
        ck_assert_ptr_null(l->name);
        ck_assert_uint_eq(strlen(l->id), LEASE_ID_LEN);
        ck_assert_ptr_eq(find(l->id), l);
        ck_assert_uint_eq(b.leases.n_leases, 1);
        ck_assert_ptr_eq(l->charge_lease.user, a->user);
        ck_assert_uint_eq(a->user->leases, 1);
        ck_assert_uint_eq(a->user->bytes[0], 4 * MiB);
        ck_assert_ptr_eq(list_first_entry(&a->user->owned, Lease, link_owner), l);

        /* Held once by the caller's process, read-write. */
        ck_assert_uint_eq(l->n_holds, 1);
        hold = lease_find_hold(l, a->holder);
        ck_assert_ptr_nonnull(hold);
        ck_assert_uint_eq(hold->refs, 1);
        ck_assert(!hold->readonly);

        /* A negative device is the first one; a second lease adds to the charges. */
        ck_assert_int_eq(broker_alloc(&b, a, -1, 1, NULL, &l, &q), 0);
        ck_assert_uint_eq(l->size, GRANULARITY);
        ck_assert_ptr_null(l->label);
        ck_assert_uint_eq(a->user->leases, 2);
        ck_assert_uint_eq(a->user->bytes[0], 6 * MiB);
        ck_assert_uint_eq(b.leases.n_leases, 2);
}
END_TEST

START_TEST(test_alloc_no_device) {
        Caller *a;
        Lease *l = NULL;
        UserQuota q = {};

        setup_broker();
        a = this_process(UID_A);
        ck_assert_int_eq(broker_alloc(&b, a, 1, MiB, NULL, &l, &q), BROKER_E_NO_DEVICE);
        ck_assert_int_eq(broker_alloc(&b, a, INT64_MAX, MiB, NULL, &l, &q), BROKER_E_NO_DEVICE);
        ck_assert_int_eq(broker_alloc(&b, a, (int64_t)INT32_MAX + 1, MiB, NULL, &l, &q), BROKER_E_NO_DEVICE);
        ck_assert_ptr_null(l);
        ck_assert_uint_eq(a->user->leases, 0);
        ck_assert_uint_eq(b.leases.n_leases, 0);
}
END_TEST

START_TEST(test_alloc_too_large) {
        Caller *a;
        Lease *l = NULL;
        UserQuota q = {};

        setup_broker();
        a = this_process(UID_A);
        /* More than the device's capacity: TooLarge, not QuotaExceeded, though it is over the user's limit too. */
        ck_assert_int_eq(broker_alloc(&b, a, 0, CAPACITY + 1, NULL, &l, &q), BROKER_E_TOO_LARGE);
        ck_assert_int_eq(broker_alloc(&b, a, 0, UINT64_MAX, NULL, &l, &q), BROKER_E_TOO_LARGE);
        ck_assert_int_eq(broker_alloc(&b, a, 0, UINT64_MAX / 2 + 1, NULL, &l, &q), BROKER_E_TOO_LARGE);
        ck_assert_ptr_null(l);
        ck_assert_uint_eq(a->user->leases, 0);
        ck_assert_uint_eq(a->user->bytes[0], 0);
}
END_TEST

/* More slabs than one message can carry: TooLarge too, with nothing left charged or leased. */
START_TEST(test_alloc_too_many_slabs) {
        PoolDeviceStats ps;
        Caller *a;
        Lease *l = NULL;
        UserQuota q = {};

        setup_broker_with(GRANULARITY);                 /* every slab is 2 MiB */
        a = this_process(UID_A);
        ck_assert_int_eq(broker_alloc(&b, a, 0, (POOL_MAX_SLABS + 1) * GRANULARITY, NULL, &l, &q),
                         BROKER_E_TOO_LARGE);
        ck_assert_ptr_null(l);
        ck_assert_uint_eq(a->user->leases, 0);
        ck_assert_uint_eq(a->user->bytes[0], 0);
        pool_device_stats(pool, 0, &ps);
        ck_assert_uint_eq(ps.n_leased, 0);
        l = alloc_ok(a, POOL_MAX_SLABS * GRANULARITY);
        ck_assert_uint_eq(l->n_slabs, POOL_MAX_SLABS);
}
END_TEST

START_TEST(test_alloc_quota_bytes) {
        Caller *s;
        Lease *l = NULL;
        UserQuota q = {};

        setup_broker();
        s = this_process(UID_SMALL);
        alloc_ok(s, 48 * MiB);
        ck_assert_int_eq(broker_alloc(&b, s, 0, 32 * MiB, NULL, &l, &q), BROKER_E_QUOTA);
        ck_assert_int_eq(q.what, USER_BYTES);
        ck_assert_uint_eq(q.limit, 64 * MiB);
        ck_assert_uint_eq(q.current, 48 * MiB);
        ck_assert_uint_eq(q.asked, 32 * MiB);
        /* Nothing charged: not the lease either, whose charge came first. */
        ck_assert_uint_eq(s->user->leases, 1);
        ck_assert_uint_eq(s->user->bytes[0], 48 * MiB);
        ck_assert_uint_eq(b.leases.n_leases, 1);
        /* Up to the limit is within it. */
        alloc_ok(s, 16 * MiB);
        ck_assert_uint_eq(s->user->bytes[0], 64 * MiB);
}
END_TEST

START_TEST(test_alloc_quota_leases) {
        Caller *s;
        Lease *l = NULL;
        UserQuota q = {};

        setup_broker();
        s = this_process(UID_SMALL);
        alloc_ok(s, MiB);
        alloc_ok(s, MiB);
        ck_assert_int_eq(broker_alloc(&b, s, 0, MiB, NULL, &l, &q), BROKER_E_QUOTA);
        ck_assert_int_eq(q.what, USER_LEASES);
        ck_assert_uint_eq(q.limit, 2);
        ck_assert_uint_eq(q.current, 2);
        ck_assert_uint_eq(q.asked, 1);
        ck_assert_uint_eq(s->user->leases, 2);
        ck_assert_uint_eq(s->user->bytes[0], 2 * GRANULARITY);
}
END_TEST

/* A user's charges are its own: another user's leases do not count against it. */
START_TEST(test_alloc_quota_is_per_user) {
        Caller *s, *a;
        Lease *l = NULL;
        UserQuota q = {};

        setup_broker();
        s = this_process(UID_SMALL);
        a = new_process(UID_A);
        alloc_ok(s, MiB);
        alloc_ok(s, MiB);
        ck_assert_int_eq(broker_alloc(&b, s, 0, MiB, NULL, &l, &q), BROKER_E_QUOTA);
        alloc_ok(a, 64 * MiB);
        ck_assert_uint_eq(a->user->leases, 1);
        ck_assert_uint_eq(s->user->leases, 2);
}
END_TEST

START_TEST(test_alloc_no_memory) {
        Caller *a, *bb, *e;
        Lease *l = NULL;
        UserQuota q = {};

        setup_broker();
        a = this_process(UID_A);
        bb = new_process(UID_B);
        e = new_process(UID_E);
        /* Each may own 80% of the device; together they fill it. */
        alloc_ok(a, 3 * GiB);
        ck_assert_int_eq(broker_alloc(&b, bb, 0, 2 * GiB, NULL, &l, &q), BROKER_E_NO_MEMORY);
        alloc_ok(bb, GiB);
        ck_assert_int_eq(broker_alloc(&b, e, 0, MiB, NULL, &l, &q), BROKER_E_NO_MEMORY);
        ck_assert_uint_eq(e->user->leases, 0);
        ck_assert_uint_eq(e->user->bytes[0], 0);
        ck_assert_uint_eq(bb->user->leases, 1);
        ck_assert_uint_eq(bb->user->bytes[0], GiB);
        ck_assert_uint_eq(b.leases.n_leases, 2);
}
END_TEST

START_TEST(test_alloc_driver_error) {
        Caller *a;
        Lease *l = NULL;
        UserQuota q = {};

        setup_broker();
        a = this_process(UID_A);
        ck_assert_int_eq(sim_fail("cuMemCreate:1:CUDA_ERROR_UNKNOWN"), 0);
        ck_assert_int_eq(broker_alloc(&b, a, 0, MiB, NULL, &l, &q), BROKER_E_DRIVER);
        ck_assert_ptr_nonnull(strstr(pool_last_error(pool), "cuMemCreate"));
        ck_assert_uint_eq(a->user->leases, 0);
        ck_assert_uint_eq(a->user->bytes[0], 0);
        ck_assert_uint_eq(b.leases.n_leases, 0);
        alloc_ok(a, MiB);
}
END_TEST

/* ---- Free ---------------------------------------------------------------------------------------------------- */

/* A lease the caller's process does not hold is not found, even by another process of its owner. */
START_TEST(test_free_not_held_is_not_found) {
        Caller *a, *a2, *bb;
        Lease *l;

        setup_broker();
        a = this_process(UID_A);
        a2 = new_process(UID_A);
        bb = new_process(UID_B);
        l = alloc_ok(a, MiB);
        ck_assert_int_eq(broker_free(&b, a2, l->id, false, NULL), BROKER_E_NO_SUCH_LEASE);
        ck_assert_int_eq(broker_free(&b, bb, l->id, false, NULL), BROKER_E_NO_SUCH_LEASE);
        ck_assert_int_eq(broker_free(&b, a, "00000000000000000000000000000000", false, NULL), BROKER_E_NO_SUCH_LEASE);
        ck_assert_int_eq(broker_free(&b, a, "", false, NULL), BROKER_E_NO_SUCH_LEASE);
        ck_assert_ptr_eq(find(l->id), l);
        ck_assert_uint_eq(lease_find_hold(l, a->holder)->refs, 1);
}
END_TEST

/* Alloc and two Attaches of one process: three references, and the lease ends at the third Free. */
START_TEST(test_free_counts_references) {
        char id[LEASE_ID_LEN + 1];
        unsigned kept;
        TokenText t;
        Caller *a;
        Lease *l;
        Hold *hold;

        setup_broker();
        a = this_process(UID_A);
        l = alloc_ok(a, 4 * MiB);
        memcpy(id, l->id, sizeof(id));
        t = share_ok(a, l, UID_ANY, false);
        hold = attach_token_ok(a, &t, false);
        ck_assert_ptr_eq(hold, lease_find_hold(l, a->holder));  /* the same hold, one more reference */
        attach_token_ok(a, &t, false);
        ck_assert_uint_eq(hold->refs, 3);
        ck_assert_uint_eq(l->n_holds, 1);

        kept = kept_slabs();
        ck_assert_int_eq(broker_free(&b, a, id, false, NULL), 0);
        ck_assert_int_eq(broker_free(&b, a, id, false, NULL), 0);
        ck_assert_ptr_eq(find(id), l);
        ck_assert_uint_eq(hold->refs, 1);
        ck_assert_uint_eq(a->user->leases, 1);
        ck_assert_int_eq(broker_free(&b, a, id, false, NULL), 0);
        ck_assert_ptr_null(find(id));
        ck_assert_int_eq(broker_free(&b, a, id, false, NULL), BROKER_E_NO_SUCH_LEASE);

        /* Ended: its charges came back, its tokens went, its slabs went back to the pool for the owner. */
        ck_assert_uint_eq(a->user->leases, 0);
        ck_assert_uint_eq(a->user->bytes[0], 0);
        ck_assert_uint_eq(b.leases.n_leases, 0);
        ck_assert_uint_eq(b.leases.by_token.n, 0);
        ck_assert_ptr_null(lease_table_find_token(&b.leases, t.s));
        ck_assert_uint_eq(kept_slabs(), kept + 1);
        ck_assert(list_is_empty(&a->holder->holds));
}
END_TEST

/* ---- Share --------------------------------------------------------------------------------------------------- */

START_TEST(test_share) {
        Caller *a, *bb;
        Token *tok = NULL;
        Lease *l;

        setup_broker();
        a = this_process(UID_A);
        bb = new_process(UID_B);
        l = alloc_ok(a, MiB);
        ck_assert_int_eq(broker_share(&b, a, l->id, UID_B, true, &tok), 0);
        ck_assert_uint_eq(strlen(tok->token), LEASE_TOKEN_LEN);
        ck_assert_uint_eq(tok->uid, UID_B);
        ck_assert_uint_eq(tok->creator, UID_A);
        ck_assert(tok->readonly);
        ck_assert_ptr_eq(tok->lease, l);
        ck_assert_uint_eq(l->n_tokens, 1);
        ck_assert_ptr_eq(lease_table_find_token(&b.leases, tok->token), tok);

        /* Only a process that holds the lease may share it. */
        ck_assert_int_eq(broker_share(&b, bb, l->id, UID_ANY, false, &tok), BROKER_E_NO_SUCH_LEASE);
        ck_assert_int_eq(broker_share(&b, a, "nope", UID_ANY, false, &tok), BROKER_E_NO_SUCH_LEASE);
        ck_assert_uint_eq(l->n_tokens, 1);
}
END_TEST

/* A read-only holder may share only read-only. */
START_TEST(test_share_readonly_holder) {
        Caller *a, *a2;
        Token *tok = NULL;
        TokenText t;
        Hold *hold;
        Lease *l;

        setup_broker();
        a = this_process(UID_A);
        a2 = new_process(UID_A);
        l = alloc_ok(a, MiB);
        t = share_ok(a, l, UID_ANY, true);
        hold = attach_token_ok(a2, &t, false);
        ck_assert(hold->readonly);
        ck_assert_int_eq(broker_share(&b, a2, l->id, UID_ANY, false, &tok), BROKER_E_READONLY);
        ck_assert_uint_eq(l->n_tokens, 1);
        ck_assert_int_eq(broker_share(&b, a2, l->id, UID_ANY, true, &tok), 0);
        ck_assert(tok->readonly);
        ck_assert_uint_eq(tok->creator, UID_A);
        ck_assert_uint_eq(l->n_tokens, 2);
}
END_TEST

START_TEST(test_share_tokens_max) {
        Caller *a;
        Token *tok = NULL;
        TokenText first;
        Lease *l;

        setup_broker();
        a = this_process(UID_A);
        l = alloc_ok(a, MiB);
        first = share_ok(a, l, UID_ANY, false);
        for (unsigned i = 1; i < LEASE_TOKENS_MAX; i++)
                share_ok(a, l, UID_ANY, false);
        ck_assert_uint_eq(l->n_tokens, LEASE_TOKENS_MAX);
        ck_assert_int_eq(broker_share(&b, a, l->id, UID_ANY, false, &tok), BROKER_E_TOKENS);
        ck_assert_int_eq(broker_share(&b, a, l->id, UID_ANY, true, &tok), BROKER_E_TOKENS);
        ck_assert_uint_eq(l->n_tokens, LEASE_TOKENS_MAX);
        ck_assert_uint_eq(b.leases.by_token.n, LEASE_TOKENS_MAX);

        /* A revoked token makes room for one more. */
        ck_assert_int_eq(broker_revoke(&b, a, first.s), 0);
        share_ok(a, l, UID_ANY, false);
        ck_assert_uint_eq(l->n_tokens, LEASE_TOKENS_MAX);
}
END_TEST

/* ---- Revoke -------------------------------------------------------------------------------------------------- */

/* The owner, the token's maker or an administrator may revoke a token; nobody else. */
START_TEST(test_revoke) {
        Caller *a, *bb, *e, *root;
        TokenText for_b, by_b, by_b2, t3;
        Lease *l;

        setup_broker();
        a = this_process(UID_A);
        bb = new_process(UID_B);
        e = new_process(UID_E);
        root = administrator();
        l = alloc_ok(a, MiB);
        for_b = share_ok(a, l, UID_B, false);
        attach_token_ok(bb, &for_b, false);
        /* A holder of another user makes no tokens: it cannot use up the owner's or hand the memory on. */
        ck_assert_int_eq(broker_share(&b, bb, l->id, UID_ANY, true, &(Token *){ NULL }), BROKER_E_NOT_OWNER);
        by_b = share_ok(a, l, UID_ANY, false);
        by_b2 = share_ok(a, l, UID_ANY, false);
        t3 = share_ok(a, l, UID_ANY, false);
        ck_assert_uint_eq(l->n_tokens, 4);

        /* A stranger may not, even one the token is for (E may attach with by_b, not revoke it). */
        ck_assert_int_eq(broker_revoke(&b, e, for_b.s), BROKER_E_NOT_OWNER);
        ck_assert_int_eq(broker_revoke(&b, e, by_b.s), BROKER_E_NOT_OWNER);
        /* The maker of a token may not revoke another's token of a lease it does not own. */
        ck_assert_int_eq(broker_revoke(&b, bb, for_b.s), BROKER_E_NOT_OWNER);
        ck_assert_uint_eq(l->n_tokens, 4);

        ck_assert_int_eq(broker_revoke(&b, bb, by_b.s), BROKER_E_NOT_OWNER);    /* a holder, not the maker */
        ck_assert_int_eq(broker_revoke(&b, a, by_b.s), 0);      /* its maker */
        ck_assert_int_eq(broker_revoke(&b, a, by_b2.s), 0);
        ck_assert_int_eq(broker_revoke(&b, root, t3.s), 0);      /* an administrator */
        ck_assert_int_eq(broker_revoke(&b, a, for_b.s), 0);      /* the owner, of its own */
        ck_assert_uint_eq(l->n_tokens, 0);
        ck_assert_uint_eq(b.leases.by_token.n, 0);

        /* Gone: a second revoke, and a token that never was, are not found. */
        ck_assert_int_eq(broker_revoke(&b, a, for_b.s), BROKER_E_NO_SUCH_TOKEN);
        ck_assert_int_eq(broker_revoke(&b, root, "0123456789abcdef0123456789abcdef"), BROKER_E_NO_SUCH_TOKEN);
        ck_assert_int_eq(broker_revoke(&b, a, "short"), BROKER_E_NO_SUCH_TOKEN);
        /* The holds the token gave stay. */
        ck_assert_uint_eq(l->n_holds, 2);
}
END_TEST

/* An administrator who is not root by uid, and root who is not an administrator: only the flag counts. */
START_TEST(test_revoke_needs_admin_flag) {
        Caller *a, *root_not_admin, *admin_e;
        TokenText t;
        Lease *l;

        setup_broker();
        a = this_process(UID_A);
        root_not_admin = connect_as(UID_ROOT, spawn(), false);
        admin_e = connect_as(UID_E, spawn(), true);
        l = alloc_ok(a, MiB);
        t = share_ok(a, l, UID_ANY, false);
        ck_assert_int_eq(broker_revoke(&b, root_not_admin, t.s), BROKER_E_NOT_OWNER);
        ck_assert_int_eq(broker_revoke(&b, admin_e, t.s), 0);
}
END_TEST

/* ---- Attach by token ------------------------------------------------------------------------------------------ */

START_TEST(test_attach_token) {
        Caller *a, *bb, *e;
        TokenText for_b, any;
        Hold *hold;
        Lease *l;

        setup_broker();
        a = this_process(UID_A);
        bb = new_process(UID_B);
        e = new_process(UID_E);
        l = alloc_ok(a, MiB);
        for_b = share_ok(a, l, UID_B, false);
        any = share_ok(a, l, UID_ANY, false);

        ck_assert_int_eq(attach_token(e, for_b.s), BROKER_E_TOKEN_UID);
        ck_assert_uint_eq(l->n_holds, 1);
        ck_assert(!l->foreign);

        /* Another user attaching marks the lease foreign; the hold is its process's, read-write. */
        hold = attach_token_ok(bb, &for_b, false);
        ck_assert_ptr_eq(hold->lease, l);
        ck_assert_uint_eq(hold->refs, 1);
        ck_assert(!hold->readonly);
        ck_assert(l->foreign);
        ck_assert_uint_eq(l->n_holds, 2);
        /* Attaching charges nothing to the attacher: the owner pays. */
        ck_assert_uint_eq(bb->user->leases, 0);
        ck_assert_uint_eq(bb->user->bytes[0], 0);
        ck_assert_uint_eq(a->user->leases, 1);

        /* A token for anyone is for anyone; the token stays usable. */
        attach_token_ok(e, &any, false);
        attach_token_ok(e, &any, false);
        ck_assert_uint_eq(lease_find_hold(l, e->holder)->refs, 2);
        ck_assert_uint_eq(l->n_holds, 3);
        ck_assert_uint_eq(l->n_tokens, 2);
}
END_TEST

START_TEST(test_attach_token_readonly) {
        Caller *a, *a2, *a3;
        TokenText ro, rw;
        Hold *hold;
        Lease *l;

        setup_broker();
        a = this_process(UID_A);
        a2 = new_process(UID_A);
        a3 = new_process(UID_A);
        l = alloc_ok(a, MiB);
        ro = share_ok(a, l, UID_ANY, true);
        rw = share_ok(a, l, UID_ANY, false);

        hold = attach_token_ok(a2, &ro, false);         /* the token says read-only */
        ck_assert(hold->readonly);
        hold = attach_token_ok(a3, &rw, true);          /* the caller asks read-only */
        ck_assert(hold->readonly);
        /* Attached again read-write: read-write if either is. */
        hold = attach_token_ok(a3, &rw, false);
        ck_assert(!hold->readonly);
        ck_assert_uint_eq(hold->refs, 2);
        hold = attach_token_ok(a3, &ro, false);
        ck_assert(!hold->readonly);
        ck_assert(!l->foreign);                         /* one user */
}
END_TEST

START_TEST(test_attach_token_revoked_or_ended) {
        char id[LEASE_ID_LEN + 1];
        Caller *a, *bb;
        TokenText t, t2;
        Lease *l;

        setup_broker();
        a = this_process(UID_A);
        bb = new_process(UID_B);
        l = alloc_ok(a, MiB);
        t = share_ok(a, l, UID_ANY, false);
        ck_assert_int_eq(broker_revoke(&b, a, t.s), 0);
        ck_assert_int_eq(attach_token(bb, t.s), BROKER_E_NO_SUCH_TOKEN);

        /* The lease ended: its tokens with it. */
        t2 = share_ok(a, l, UID_ANY, false);
        memcpy(id, l->id, sizeof(id));
        ck_assert_int_eq(broker_free(&b, a, id, false, NULL), 0);
        ck_assert_ptr_null(find(id));
        ck_assert_int_eq(attach_token(bb, t2.s), BROKER_E_NO_SUCH_TOKEN);
        ck_assert_int_eq(attach_token(bb, "not a token"), BROKER_E_NO_SUCH_TOKEN);
        ck_assert(list_is_empty(&bb->holder->holds));
}
END_TEST

/* A foreign lease's slabs go back to the driver at its end, never to a cache another user could get. */
START_TEST(test_foreign_lease_slabs_are_released) {
        char id[LEASE_ID_LEN + 1];
        uint64_t released;
        unsigned kept;
        Caller *a, *bb;
        TokenText t;
        Lease *l;

        setup_broker_with(4 * MiB);
        a = this_process(UID_A);
        bb = new_process(UID_B);

        /* Not foreign: cached for the owner. */
        l = alloc_ok(a, 6 * MiB);                       /* two slabs: 4 + 2 MiB (the maximum slab is 4 MiB) */
        ck_assert_uint_eq(l->n_slabs, 2);
        memcpy(id, l->id, sizeof(id));
        kept = kept_slabs();
        released = released_slabs();
        ck_assert_int_eq(broker_free(&b, a, id, false, NULL), 0);
        ck_assert_uint_eq(kept_slabs(), kept + 2);
        ck_assert_uint_eq(released_slabs(), released);

        /* Foreign: released, even once the other user has let go. */
        l = alloc_ok(a, 6 * MiB);
        memcpy(id, l->id, sizeof(id));
        t = share_ok(a, l, UID_B, false);
        attach_token_ok(bb, &t, false);
        ck_assert_int_eq(broker_free(&b, bb, id, false, NULL), 0);
        ck_assert(l->foreign);                          /* for good */
        kept = kept_slabs();
        released = released_slabs();
        ck_assert_int_eq(broker_free(&b, a, id, false, NULL), 0);
        ck_assert_ptr_null(find(id));
        ck_assert_uint_eq(released_slabs(), released + 2);
        ck_assert_uint_eq(kept_slabs(), kept);
}
END_TEST

/* ---- Attach by name --------------------------------------------------------------------------------------------- */

START_TEST(test_attach_name) {
        Caller *a, *a2, *bb, *e;
        Hold *hold;
        Lease *l;

        setup_broker();
        a = this_process(UID_A);
        a2 = new_process(UID_A);
        bb = new_process(UID_B);
        e = new_process(UID_E);
        l = alloc_ok(a, MiB);
        ck_assert_int_eq(broker_publish(&b, a, l->id, "model", (const uid_t[]){ UID_B }, 1, false), 0);

        ck_assert_int_eq(attach_name(bb, "1000/no-such"), BROKER_E_NO_SUCH_NAME);
        ck_assert_int_eq(attach_name(e, "1000/model"), BROKER_E_NO_SUCH_NAME);
        ck_assert(list_is_empty(&e->holder->holds));

        /* A user it is published to; the owner's other processes always. */
        hold = attach_name_ok(bb, "1000/model", false);
        ck_assert_ptr_eq(hold->lease, l);
        ck_assert(!hold->readonly);
        ck_assert(l->foreign);
        hold = attach_name_ok(a2, "model", false);
        ck_assert(!hold->readonly);
        hold = attach_name_ok(a2, "model", true);       /* again, asking read-only: stays read-write */
        ck_assert(!hold->readonly);
        ck_assert_uint_eq(hold->refs, 2);
        ck_assert_uint_eq(l->n_holds, 3);
}
END_TEST

/* A lease published read-only is attached read-only by name, by anyone (its owner's processes included). */
START_TEST(test_attach_name_readonly) {
        Caller *a, *a2, *bb;
        Hold *hold;
        Lease *l;

        setup_broker();
        a = this_process(UID_A);
        a2 = new_process(UID_A);
        bb = new_process(UID_B);
        l = alloc_ok(a, MiB);
        ck_assert_int_eq(broker_publish(&b, a, l->id, "ro-model", (const uid_t[]){ UID_B }, 1, true), 0);
        hold = attach_name_ok(bb, "1000/ro-model", false);
        ck_assert(hold->readonly);
        hold = attach_name_ok(a2, "ro-model", false);
        ck_assert(hold->readonly);
        ck_assert(!lease_find_hold(l, a->holder)->readonly);    /* the maker's hold is untouched */
}
END_TEST

/* ---- Publish ----------------------------------------------------------------------------------------------- */

START_TEST(test_publish) {
        Caller *a, *bb;
        Lease *l;

        setup_broker();
        a = this_process(UID_A);
        bb = new_process(UID_B);
        l = alloc_ok(a, MiB);
        ck_assert_int_eq(broker_publish(&b, a, l->id, "weights", (const uid_t[]){ UID_B, UID_E }, 2, true), 0);
        ck_assert_str_eq(l->name, "weights");
        ck_assert_uint_eq(l->n_name_uids, 2);
        ck_assert_uint_eq(l->name_uids[0], UID_B);
        ck_assert_uint_eq(l->name_uids[1], UID_E);
        ck_assert(l->name_readonly);
        ck_assert_ptr_eq(find_name(UID_A, "weights"), l);
        ck_assert_uint_eq(b.leases.n_published, 1);

        /* Only a process that holds it. */
        ck_assert_int_eq(broker_publish(&b, bb, l->id, "other", NULL, 0, false), BROKER_E_NO_SUCH_LEASE);
        ck_assert_int_eq(broker_publish(&b, a, "nope", "other", NULL, 0, false), BROKER_E_NO_SUCH_LEASE);
}
END_TEST

/* Only a read-write holder of the owner's user: not a foreign holder, not a read-only one. */
START_TEST(test_publish_not_owner) {
        Caller *a, *a2, *a3, *bb;
        TokenText rw, ro, rw_a;
        Lease *l;

        setup_broker();
        a = this_process(UID_A);
        a2 = new_process(UID_A);
        a3 = new_process(UID_A);
        bb = new_process(UID_B);
        l = alloc_ok(a, MiB);
        rw = share_ok(a, l, UID_B, false);
        ro = share_ok(a, l, UID_A, true);
        rw_a = share_ok(a, l, UID_A, false);
        attach_token_ok(bb, &rw, false);
        attach_token_ok(a2, &ro, false);
        ck_assert_int_eq(broker_publish(&b, bb, l->id, "x", NULL, 0, false), BROKER_E_NOT_OWNER);
        ck_assert_int_eq(broker_publish(&b, a2, l->id, "x", NULL, 0, false), BROKER_E_NOT_OWNER);
        ck_assert_ptr_null(l->name);
        ck_assert_uint_eq(b.leases.n_published, 0);
        /* Any read-write holder of the owner's user: not only the process that made it. */
        attach_token_ok(a3, &rw_a, false);
        ck_assert_int_eq(broker_publish(&b, a3, l->id, "x", NULL, 0, false), 0);
        ck_assert_int_eq(broker_publish(&b, a, l->id, "x", (const uid_t[]){ UID_B }, 1, false), 0);
}
END_TEST

START_TEST(test_publish_name_in_use_and_has_name) {
        Caller *a, *bb;
        Lease *l, *l2, *lb;

        setup_broker();
        a = this_process(UID_A);
        bb = new_process(UID_B);
        l = alloc_ok(a, MiB);
        l2 = alloc_ok(a, MiB);
        lb = alloc_ok(bb, MiB);
        ck_assert_int_eq(broker_publish(&b, a, l->id, "x", NULL, 0, false), 0);
        ck_assert_int_eq(broker_publish(&b, a, l2->id, "x", NULL, 0, false), BROKER_E_NAME_IN_USE);
        /* Names live in their owner's namespace: another user's "x" is not A's (nobody can plant one). */
        ck_assert_int_eq(broker_publish(&b, bb, lb->id, "x", NULL, 0, false), 0);
        ck_assert_ptr_eq(find_name(UID_B, "x"), lb);
        ck_assert_ptr_eq(find_name(UID_A, "x"), l);
        ck_assert_int_eq(broker_publish(&b, a, l->id, "y", NULL, 0, false), BROKER_E_HAS_NAME);
        ck_assert_ptr_null(l2->name);
        ck_assert_str_eq(l->name, "x");
        ck_assert_ptr_null(find_name(UID_A, "y"));
        ck_assert_uint_eq(b.leases.n_published, 2);
        ck_assert_int_eq(broker_publish(&b, a, l2->id, "y", NULL, 0, false), 0);
        ck_assert_uint_eq(b.leases.n_published, 3);
}
END_TEST

/* Publishing again under the lease's own name replaces who may attach it, and how. */
START_TEST(test_publish_again_replaces_uids) {
        Caller *a, *bb, *e;
        Hold *hold;
        Lease *l;

        setup_broker();
        a = this_process(UID_A);
        bb = new_process(UID_B);
        e = new_process(UID_E);
        l = alloc_ok(a, MiB);
        ck_assert_int_eq(broker_publish(&b, a, l->id, "x", (const uid_t[]){ UID_B }, 1, false), 0);
        ck_assert_int_eq(broker_publish(&b, a, l->id, "x", (const uid_t[]){ UID_E }, 1, true), 0);
        ck_assert_uint_eq(l->n_name_uids, 1);
        ck_assert_uint_eq(l->name_uids[0], UID_E);
        ck_assert(l->name_readonly);
        ck_assert_uint_eq(b.leases.n_published, 1);
        ck_assert_ptr_eq(find_name(UID_A, "x"), l);
        ck_assert_int_eq(attach_name(bb, "1000/x"), BROKER_E_NO_SUCH_NAME);
        hold = attach_name_ok(e, "1000/x", false);
        ck_assert(hold->readonly);

        /* To nobody but the owner. */
        ck_assert_int_eq(broker_publish(&b, a, l->id, "x", NULL, 0, false), 0);
        ck_assert_uint_eq(l->n_name_uids, 0);
        ck_assert(!l->name_readonly);
        ck_assert_int_eq(attach_name(bb, "1000/x"), BROKER_E_NO_SUCH_NAME);
}
END_TEST

/* ---- Unpublish --------------------------------------------------------------------------------------------- */

START_TEST(test_unpublish) {
        char id[LEASE_ID_LEN + 1];
        Caller *a, *bb;
        Lease *l;

        setup_broker();
        a = this_process(UID_A);
        bb = new_process(UID_B);
        l = alloc_ok(a, MiB);
        memcpy(id, l->id, sizeof(id));
        ck_assert_int_eq(broker_publish(&b, a, id, "x", (const uid_t[]){ UID_B }, 1, false), 0);
        attach_name_ok(bb, "1000/x", false);

        ck_assert_int_eq(unpublish(a, "y"), BROKER_E_NO_SUCH_NAME);
        ck_assert_int_eq(unpublish(bb, "x"), BROKER_E_NO_SUCH_NAME); /* B's own "x": none */
        ck_assert_int_eq(unpublish(bb, "1000/x"), BROKER_E_NOT_OWNER); /* may attach it, not unpublish it */
        ck_assert_str_eq(l->name, "x");

        /* Held: the lease stays, without its name. */
        ck_assert_int_eq(unpublish(a, "x"), 0);
        ck_assert_ptr_eq(find(id), l);
        ck_assert_ptr_null(l->name);
        ck_assert_uint_eq(l->n_name_uids, 0);
        ck_assert_ptr_null(find_name(UID_A, "x"));
        ck_assert_uint_eq(b.leases.n_published, 0);
        ck_assert_int_eq(unpublish(a, "x"), BROKER_E_NO_SUCH_NAME);
        ck_assert_int_eq(attach_name(bb, "1000/x"), BROKER_E_NO_SUCH_NAME);
        ck_assert_uint_eq(l->n_holds, 2);
}
END_TEST

/* A published lease outlives its holders; unpublished with nobody holding it, it ends. */
START_TEST(test_unpublish_ends_unheld_lease) {
        char id[LEASE_ID_LEN + 1];
        Caller *a, *root;
        Lease *l;

        setup_broker();
        a = this_process(UID_A);
        root = administrator();
        l = alloc_ok(a, MiB);
        memcpy(id, l->id, sizeof(id));
        ck_assert_int_eq(broker_publish(&b, a, id, "kept", NULL, 0, false), 0);
        ck_assert_int_eq(broker_free(&b, a, id, false, NULL), 0);
        ck_assert_ptr_eq(find(id), l);                  /* nobody holds it: it lives on, published */
        ck_assert_uint_eq(l->n_holds, 0);
        ck_assert_uint_eq(a->user->leases, 1);          /* still charged to its owner */

        /* The administrator unpublishes it (it holds nothing of it): it ends, and the owner is charged nothing. */
        ck_assert_int_eq(unpublish(root, "1000/kept"), 0);
        ck_assert_ptr_null(find(id));
        ck_assert_uint_eq(b.leases.n_leases, 0);
        ck_assert_uint_eq(a->user->leases, 0);
        ck_assert_uint_eq(a->user->bytes[0], 0);
}
END_TEST

/* ---- List -------------------------------------------------------------------------------------------------- */

typedef struct Seen {
        const Lease *leases[64];
        size_t n;
        size_t stop_after;              /* 0: never stop */
} Seen;

static int see(const Lease *l, void *userdata) {
        Seen *s = userdata;

        if (s->n < ELEMENTSOF(s->leases))
                s->leases[s->n] = l;
        s->n++;
        return s->stop_after && s->n >= s->stop_after ? 42 : 0;
}

static size_t times_seen(const Seen *s, const Lease *l) {
        size_t n = 0;

        for (size_t i = 0; i < MIN(s->n, ELEMENTSOF(s->leases)); i++)
                n += s->leases[i] == l;
        return n;
}

static Seen list(const Caller *c, bool all) {
        Seen s = {};

        ck_assert_int_eq(broker_list(&b, c, all, see, &s), 0);
        return s;
}

/* A caller sees what its user owns and what its user's processes hold, each lease once. */
START_TEST(test_list_what_the_caller_sees) {
        Caller *a, *a2, *bb, *bb2, *e;
        TokenText t;
        Lease *la, *la2, *lb, *le;
        Seen s;

        setup_broker();
        a = this_process(UID_A);
        a2 = new_process(UID_A);
        bb = new_process(UID_B);
        bb2 = new_process(UID_B);
        e = new_process(UID_E);
        la = alloc_ok(a, MiB);
        la2 = alloc_ok(a2, MiB);                        /* another process of A's user */
        lb = alloc_ok(bb, MiB);
        le = alloc_ok(e, MiB);
        t = share_ok(a, la, UID_ANY, false);
        attach_token_ok(a2, &t, false);                 /* owned by A and held by two of its processes */
        attach_token_ok(bb, &t, false);
        attach_token_ok(bb2, &t, false);                /* held by two processes of B */

        s = list(a, false);
        ck_assert_uint_eq(s.n, 2);
        ck_assert_uint_eq(times_seen(&s, la), 1);
        ck_assert_uint_eq(times_seen(&s, la2), 1);
        s = list(a2, false);                            /* the same user: the same leases */
        ck_assert_uint_eq(s.n, 2);

        s = list(bb, false);
        ck_assert_uint_eq(s.n, 2);
        ck_assert_uint_eq(times_seen(&s, lb), 1);
        ck_assert_uint_eq(times_seen(&s, la), 1);

        s = list(e, false);
        ck_assert_uint_eq(s.n, 1);
        ck_assert_uint_eq(times_seen(&s, le), 1);

        /* Twice in a row: the same (each call shows each lease once, whatever the last one did). */
        s = list(bb, false);
        ck_assert_uint_eq(s.n, 2);
}
END_TEST

START_TEST(test_list_all_needs_admin) {
        Caller *a, *bb, *root, *root_not_admin;
        Seen s = {};

        setup_broker();
        a = this_process(UID_A);
        bb = new_process(UID_B);
        root = administrator();
        root_not_admin = connect_as(UID_ROOT, spawn(), false);
        alloc_ok(a, MiB);
        alloc_ok(a, MiB);
        alloc_ok(bb, MiB);
        ck_assert_int_eq(broker_list(&b, a, true, see, &s), BROKER_E_NOT_OWNER);
        ck_assert_int_eq(broker_list(&b, root_not_admin, true, see, &s), BROKER_E_NOT_OWNER);
        ck_assert_uint_eq(s.n, 0);
        s = list(root, true);
        ck_assert_uint_eq(s.n, 3);
        s = list(root, false);                          /* without `all`, an administrator sees its own */
        ck_assert_uint_eq(s.n, 0);
}
END_TEST

/* What fn returns stops the listing and is returned. */
START_TEST(test_list_stops_at_fn) {
        Caller *a, *root;
        Seen s = { .stop_after = 2 };

        setup_broker();
        a = this_process(UID_A);
        root = administrator();
        for (int i = 0; i < 4; i++)
                alloc_ok(a, MiB);
        ck_assert_int_eq(broker_list(&b, a, false, see, &s), 42);
        ck_assert_uint_eq(s.n, 2);
        s = (Seen){ .stop_after = 3 };
        ck_assert_int_eq(broker_list(&b, root, true, see, &s), 42);
        ck_assert_uint_eq(s.n, 3);
}
END_TEST

/* The cost is what the caller sees: another user's thousand leases are never visited. */
START_TEST(test_list_cost_is_what_the_caller_sees) {
        Caller *a, *bb, *root;
        Lease *first = NULL;
        TokenText t;
        Seen s;

        setup_broker();
        a = this_process(UID_A);
        bb = new_process(UID_B);
        root = administrator();
        for (int i = 0; i < 1000; i++) {
                Lease *l = alloc_ok(a, MiB);

                first = first ?: l;
        }
        ck_assert_uint_eq(a->user->leases, 1000);
        s = list(bb, false);
        ck_assert_uint_eq(s.n, 0);
        /* Not even visited: a List marks each lease it goes through, and none of A's is marked. */
        {
                const Lease *l;

                list_for_each_entry(l, &b.leases.leases, link_table)
                        ck_assert_uint_ne(l->listed, b.list_serial);
        }
        s = list(a, false);
        ck_assert_uint_eq(s.n, 1000);

        t = share_ok(a, first, UID_B, true);
        attach_token_ok(bb, &t, false);
        s = list(bb, false);
        ck_assert_uint_eq(s.n, 1);
        ck_assert_ptr_eq(s.leases[0], first);
        s = list(root, true);
        ck_assert_uint_eq(s.n, 1000);
}
END_TEST

/* ---- holders that exit ---------------------------------------------------------------------------------------- */

/*
 * A process exits: its holds are dropped, whatever their references. Its leases nobody else holds end; one
 * another live process holds survives, and so does one it published.
 */
START_TEST(test_reap) {
        char only_c[LEASE_ID_LEN + 1], twice_c[LEASE_ID_LEN + 1];
        Caller *a, *c, *bb;
        TokenText t, t2, t3;
        Lease *shared, *published, *held_by_b, *l;
        unsigned released;
        pid_t pid;

        setup_broker();
        a = this_process(UID_A);
        bb = new_process(UID_B);
        c = new_process(UID_A);
        pid = c->holder->pid;

        shared = alloc_ok(a, MiB);                      /* A's, held by C too */
        t = share_ok(a, shared, UID_ANY, false);
        attach_token_ok(c, &t, false);
        l = alloc_ok(c, MiB);                           /* C's only */
        memcpy(only_c, l->id, sizeof(only_c));
        l = alloc_ok(c, MiB);                           /* C's only, three references */
        memcpy(twice_c, l->id, sizeof(twice_c));
        t2 = share_ok(c, l, UID_ANY, false);
        attach_token_ok(c, &t2, false);
        attach_token_ok(c, &t2, false);
        published = alloc_ok(c, MiB);                   /* C's, published */
        ck_assert_int_eq(broker_publish(&b, c, published->id, "kept", NULL, 0, false), 0);
        held_by_b = alloc_ok(c, MiB);                   /* C's, held by B too */
        t3 = share_ok(c, held_by_b, UID_B, false);
        attach_token_ok(bb, &t3, false);
        ck_assert_uint_eq(b.leases.n_leases, 5);
        ck_assert_uint_eq(a->user->leases, 5);

        /* Alive: nothing to reap. */
        ck_assert_uint_eq(broker_reap_holders(&b), 0);
        ck_assert(!broker_has_unreaped(&b));

        kill_process(pid);
        released = broker_reap_holders(&b);
        ck_assert_uint_eq(released, 5);                 /* holds, not references */
        ck_assert(!broker_has_unreaped(&b));
        ck_assert(c->holder->exited);
        ck_assert(list_is_empty(&c->holder->holds));

        ck_assert_ptr_null(find(only_c));
        ck_assert_ptr_null(find(twice_c));
        ck_assert_ptr_null(lease_table_find_token(&b.leases, t2.s));
        ck_assert_uint_eq(shared->n_holds, 1);
        ck_assert_ptr_nonnull(lease_find_hold(shared, a->holder));
        ck_assert_uint_eq(published->n_holds, 0);
        ck_assert_ptr_eq(find_name(UID_A, "kept"), published);
        ck_assert_uint_eq(held_by_b->n_holds, 1);
        ck_assert_ptr_nonnull(lease_find_hold(held_by_b, bb->holder));
        ck_assert_uint_eq(b.leases.n_leases, 3);
        ck_assert_uint_eq(a->user->leases, 3);
        ck_assert_uint_eq(a->user->bytes[0], 3 * GRANULARITY);

        /* Reaped once. The exited holder is forgotten when its last connection closes. */
        ck_assert_uint_eq(broker_reap_holders(&b), 0);
        ck_assert_uint_eq(b.holders.n_holders, 3);
        disconnect_last(c);
        ck_assert_uint_eq(b.holders.n_holders, 2);

        /* The published lease ends when unpublished (by its owner's user, from another process). */
        ck_assert_int_eq(unpublish(a, "kept"), 0);
        ck_assert_uint_eq(b.leases.n_leases, 2);
}
END_TEST

/* Two processes that held a lease alone together exit: the first reaped ends its hold, the second the lease. */
START_TEST(test_reap_last_two_holders) {
        char id[LEASE_ID_LEN + 1];
        Caller *a, *c1, *c2;
        TokenText t;
        Lease *l;

        setup_broker();
        a = this_process(UID_A);
        c1 = new_process(UID_A);
        c2 = new_process(UID_B);
        l = alloc_ok(a, MiB);
        memcpy(id, l->id, sizeof(id));
        t = share_ok(a, l, UID_ANY, false);
        attach_token_ok(c1, &t, false);
        attach_token_ok(c2, &t, false);
        ck_assert_int_eq(broker_free(&b, a, id, false, NULL), 0);
        ck_assert_uint_eq(l->n_holds, 2);

        kill_process(c1->holder->pid);
        kill_process(c2->holder->pid);
        ck_assert_uint_eq(broker_reap_holders(&b), 2);
        ck_assert_ptr_null(find(id));
        ck_assert_uint_eq(a->user->leases, 0);
        ck_assert_uint_eq(a->user->bytes[0], 0);
}
END_TEST

/* ---- the write-ahead rule ---------------------------------------------------------------------------------- */

static int compare_lines(const void *x, const void *y) {
        return strcmp(*(char *const *)x, *(char *const *)y);
}

typedef struct Lines {
        char **v;
        size_t n;
} Lines;

static void add_line(Lines *lines, const char *format, ...) _printf_(2, 3);
static void add_line(Lines *lines, const char *format, ...) {
        va_list ap;
        char *s;

        va_start(ap, format);
        ck_assert_int_ge(vasprintf(&s, format, ap), 0);
        va_end(ap);
        lines->v = realloc(lines->v, (lines->n + 1) * sizeof(char *));
        ck_assert_ptr_nonnull(lines->v);
        lines->v[lines->n++] = s;
}

/* The lines sorted and joined (the order of leases, holds and tokens is not part of what is stored). */
static char *join_lines(Lines *lines) {
        size_t len = 1, at = 0;
        char *out;

        qsort(lines->v, lines->n, sizeof(char *), compare_lines);
        for (size_t i = 0; i < lines->n; i++)
                len += strlen(lines->v[i]) + 1;
        out = malloc(len);
        ck_assert_ptr_nonnull(out);
        for (size_t i = 0; i < lines->n; i++) {
                at += (size_t)sprintf(out + at, "%s\n", lines->v[i]);
                free(lines->v[i]);
        }
        out[at] = 0;
        free(lines->v);
        *lines = (Lines){};
        return out;
}

static void lease_line(Lines *lines, const char *id, int device, uint64_t size, const char *label, uid_t uid,
                       pid_t pid, bool foreign, bool parked, bool kept, const char *name, const uid_t *uids,
                       size_t n_uids, bool name_ro, const uint64_t *slab_ids, size_t n_slabs) {
        char buf[256] = "";
        size_t at = 0;

        for (size_t i = 0; i < n_uids; i++)
                at += (size_t)snprintf(buf + at, sizeof(buf) - at, "%u,", (unsigned)uids[i]);
        at += (size_t)snprintf(buf + at, sizeof(buf) - at, " slabs=");
        for (size_t i = 0; i < n_slabs; i++)
                at += (size_t)snprintf(buf + at, sizeof(buf) - at, "%" PRIu64 ",", slab_ids[i]);
        add_line(lines, "L %s device=%d size=%" PRIu64 " label=%s uid=%u pid=%d foreign=%d parked=%d kept=%d "
                 "name=%s ro=%d uids=%s", id, device, size, label ?: "-", (unsigned)uid, (int)pid, foreign, parked,
                 kept, name ?: "-", name_ro, buf);
}

/* The lease table as lines: each lease, each hold and each token. */
static void table_lines(Lines *lines, const LeaseTable *t) {
        const Lease *l;

        list_for_each_entry(l, &t->leases, link_table) {
                uint64_t slab_ids[POOL_MAX_SLABS];
                const Hold *hold;
                const Token *tok;

                for (size_t i = 0; i < l->n_slabs; i++)
                        slab_ids[i] = l->slabs[i]->id;
                lease_line(lines, l->id, l->device, l->size, l->label, l->uid, l->pid, l->foreign, l->parked,
                           l->kept, l->name, l->name_uids, l->n_name_uids, l->name_readonly, slab_ids, l->n_slabs);
                list_for_each_entry(hold, &l->holds, link_lease)
                        add_line(lines, "H %s pid=%d start=%" PRIu64 " uid=%u refs=%u ro=%d parked=%d", l->id,
                                 (int)hold->holder->pid, hold->holder->start_time, (unsigned)hold->holder->uid,
                                 hold->refs, hold->readonly, hold->parked);
                list_for_each_entry(tok, &l->tokens, link)
                        add_line(lines, "T %s %s uid=%u creator=%u ro=%d", l->id, tok->token, (unsigned)tok->uid,
                                 (unsigned)tok->creator, tok->readonly);
        }
}

/* The same lines from a stored table read back. */
static char *state_text(const State *s) {
        Lines lines = {};

        for (size_t i = 0; i < s->n_leases; i++) {
                const StateLease *l = &s->leases[i];
                uint64_t slab_ids[POOL_MAX_SLABS];

                for (size_t j = 0; j < l->n_slabs; j++)
                        slab_ids[j] = l->slabs[j].id;
                lease_line(&lines, l->id, l->device, l->size, l->label, l->uid, l->pid, l->foreign, l->parked,
                           l->kept, l->name, l->name_uids, l->n_name_uids, l->name_readonly, slab_ids, l->n_slabs);
                for (size_t j = 0; j < l->n_holds; j++)
                        add_line(&lines, "H %s pid=%d start=%" PRIu64 " uid=%u refs=%u ro=%d parked=%d", l->id,
                                 (int)l->holds[j].pid, l->holds[j].start_time, (unsigned)l->holds[j].uid,
                                 l->holds[j].refs, l->holds[j].readonly, l->holds[j].parked);
                for (size_t j = 0; j < l->n_tokens; j++)
                        add_line(&lines, "T %s %s uid=%u creator=%u ro=%d", l->id, l->tokens[j].token,
                                 (unsigned)l->tokens[j].uid, (unsigned)l->tokens[j].creator, l->tokens[j].readonly);
        }
        return join_lines(&lines);
}

static char *table_text(void) {
        Lines lines = {};

        table_lines(&lines, &b.leases);
        return join_lines(&lines);
}

/* Everything an operation could change: the table, the indexes' counts, every user's charges, the pool. */
static char *broker_text(void) {
        PoolDeviceStats ps;
        Lines lines = {};
        const User *u;

        table_lines(&lines, &b.leases);
        add_line(&lines, "N leases=%u published=%u by_id=%zu by_token=%zu by_name=%zu generation=%" PRIu64,
                 b.leases.n_leases, b.leases.n_published, b.leases.by_id.n, b.leases.by_token.n, b.leases.by_name.n,
                 b.leases.generation);
        list_for_each_entry(u, &b.users.users, link)
                add_line(&lines, "U %u refs=%u leases=%u bytes=%" PRIu64 " host=%" PRIu64, (unsigned)u->uid,
                         u->n_refs, u->leases, u->bytes[0], u->host_bytes[0]);
        pool_device_stats(pool, 0, &ps);
        add_line(&lines, "P leased=%u/%" PRIu64 " parked=%u/%" PRIu64 " holders=%u kept=%" PRIu64, ps.n_leased,
                 ps.leased, ps.n_parked, ps.parked, b.holders.n_holders, b.leases.device_kept[0]);
        return join_lines(&lines);
}

/* What the service manager holds reads back as exactly the table (every acknowledged change, nothing else). */
static void assert_stored_is_table(void) {
        _cleanup_free_ char *message = NULL, *stored = NULL, *table = NULL;
        State s = {};

        ck_assert_msg(store_read(fake_latest(&fake), &s, &message) == 0, "%s", message ?: "store_read failed");
        stored = state_text(&s);
        table = table_text();
        ck_assert_str_eq(stored, table);
        state_done(&s);
}

/*
 * The next write into the store fails: `op` must answer NOT_STORED and change nothing at all. Then the
 * same operation, tried again, is made, and the store reads back as the table.
 */
static unsigned n_faults;

#define ASSERT_NOT_STORED_THEN_MADE(op)                                                                  \
        do {                                                                                             \
                _cleanup_free_ char *before_ = broker_text(), *after_ = NULL;                            \
                store_inject_fault(b.store, STORE_STEP_WRITE, 1, -EIO, false);                           \
                n_faults++;                                                                              \
                ck_assert_int_eq((op), BROKER_E_NOT_STORED);                                             \
                ck_assert_int_eq(b.store_error, -EIO);                                                   \
                after_ = broker_text();                                                                  \
                ck_assert_str_eq(after_, before_);                                                       \
                ck_assert_int_eq((op), 0);                                                               \
                ck_assert_int_eq(b.store_error, 0);                                                      \
                assert_stored_is_table();                                                                \
        } while (0)

START_TEST(test_not_stored_before_the_first_snapshot) {
        StoreBackend backend = { .save = fake_save, .remove = fake_remove, .userdata = &fake };
        _cleanup_free_ char *before = NULL, *after = NULL;
        Store *s = NULL;
        Lease *l = NULL;
        UserQuota q = {};
        Caller *a;

        setup_broker();
        a = this_process(UID_A);
        ck_assert_int_eq(store_new(&s, &backend), 0);
        broker_set_store(&b, s);
        before = broker_text();
        ck_assert_int_eq(broker_alloc(&b, a, 0, MiB, NULL, &l, &q), BROKER_E_NOT_STORED);
        ck_assert_int_eq(b.store_error, -ENOLINK);
        after = broker_text();
        ck_assert_str_eq(after, before);
        ck_assert_int_eq(broker_store_snapshot(&b, false), 0);  /* nothing stored yet: it snapshots */
        ck_assert(store_is_open(b.store));
        alloc_ok(a, MiB);
        assert_stored_is_table();
}
END_TEST

/* Every operation, with the store failing once: refused and nothing changed; then made, and stored. */
START_TEST(test_write_ahead_every_operation) {
        char id[LEASE_ID_LEN + 1], id2[LEASE_ID_LEN + 1];
        Caller *a, *bb;
        TokenText t = {}, t_any = {};
        Token *tok = NULL;
        UserQuota q = {};
        Hold *hold = NULL;
        Lease *l = NULL;

        setup_broker();
        a = this_process(UID_A);
        bb = new_process(UID_B);
        alloc_ok(a, 3 * MiB);                           /* in the first snapshot */
        give_store();
        assert_stored_is_table();

        /* Alloc: its slabs go back to the pool, its charges to the user. */
        ASSERT_NOT_STORED_THEN_MADE(broker_alloc(&b, a, 0, 6 * MiB, "stored", &l, &q));
        memcpy(id, l->id, sizeof(id));
        l = alloc_ok(a, MiB);
        memcpy(id2, l->id, sizeof(id2));

        /* Share, for B and for anyone. */
        ASSERT_NOT_STORED_THEN_MADE(broker_share(&b, a, id, UID_B, false, &tok));
        memcpy(t.s, tok->token, sizeof(t.s));
        ASSERT_NOT_STORED_THEN_MADE(broker_share(&b, a, id, UID_ANY, true, &tok));
        memcpy(t_any.s, tok->token, sizeof(t_any.s));

        /* Attach by another user: the lease becomes foreign only once the change is stored. */
        ASSERT_NOT_STORED_THEN_MADE(broker_attach(&b, bb, t.s, UID_ANY, NULL, false, &hold, NULL));
        ck_assert(find(id)->foreign);
        /* Attach again: one more reference; and the owner's process with a read-only token stays read-write. */
        ASSERT_NOT_STORED_THEN_MADE(broker_attach(&b, bb, t_any.s, UID_ANY, NULL, false, &hold, NULL));
        ck_assert_uint_eq(hold->refs, 2);
        ASSERT_NOT_STORED_THEN_MADE(broker_attach(&b, a, t_any.s, UID_ANY, NULL, false, &hold, NULL));
        ck_assert_uint_eq(hold->refs, 2);

        /* Free of one reference of two. */
        ASSERT_NOT_STORED_THEN_MADE(broker_free(&b, bb, id, false, NULL));
        ck_assert_uint_eq(lease_find_hold(find(id), bb->holder)->refs, 1);

        /* Publish, publish again with other users, attach by name. */
        ASSERT_NOT_STORED_THEN_MADE(broker_publish(&b, a, id2, "stored-name", (const uid_t[]){ UID_B }, 1, false));
        ASSERT_NOT_STORED_THEN_MADE(
                broker_publish(&b, a, id2, "stored-name", (const uid_t[]){ UID_B, UID_E }, 2, true));
        ASSERT_NOT_STORED_THEN_MADE(broker_attach(&b, bb, NULL, UID_A, "stored-name", false, &hold, NULL));
        ck_assert(hold->readonly);
        ck_assert(find(id2)->foreign);

        /* Revoke. */
        ASSERT_NOT_STORED_THEN_MADE(broker_revoke(&b, a, t.s));

        /* Free of a hold that is not the last; of the last hold of a published lease (it stays). */
        ASSERT_NOT_STORED_THEN_MADE(broker_free(&b, bb, id2, false, NULL));
        ASSERT_NOT_STORED_THEN_MADE(broker_free(&b, a, id2, false, NULL));
        ck_assert_uint_eq(find(id2)->n_holds, 0);

        /* Unpublish of a lease nobody holds: it ends. */
        ASSERT_NOT_STORED_THEN_MADE(unpublish(a, "stored-name"));
        ck_assert_ptr_null(find(id2));

        /* Unpublish of a held lease: it stays. */
        ck_assert_int_eq(broker_publish(&b, a, id, "held", NULL, 0, false), 0);
        ASSERT_NOT_STORED_THEN_MADE(unpublish(a, "held"));
        ck_assert_ptr_nonnull(find(id));

        /* The last Free of the last hold: the lease ends. */
        ASSERT_NOT_STORED_THEN_MADE(broker_free(&b, bb, id, false, NULL));
        ASSERT_NOT_STORED_THEN_MADE(broker_free(&b, a, id, false, NULL));
        ASSERT_NOT_STORED_THEN_MADE(broker_free(&b, a, id, false, NULL));
        ck_assert_ptr_null(find(id));
        ck_assert_uint_eq(b.leases.n_leases, 1);

        /* The counters saw every one of those failures, and a snapshot now stores the same table. */
        ck_assert_uint_eq(store_stats(b.store).failures, n_faults);
        ck_assert_int_eq(broker_store_snapshot(&b, true), 0);
        assert_stored_is_table();
}
END_TEST

/* A reap whose change cannot be stored keeps the holder's holds until a later reap stores it. */
START_TEST(test_reap_not_stored_keeps_holds) {
        _cleanup_free_ char *before = NULL, *after = NULL;
        char id[LEASE_ID_LEN + 1];
        Caller *a, *c;
        TokenText t;
        Lease *shared, *l;

        setup_broker();
        a = this_process(UID_A);
        c = new_process(UID_A);
        give_store();
        l = alloc_ok(c, MiB);
        memcpy(id, l->id, sizeof(id));
        shared = alloc_ok(a, MiB);
        t = share_ok(a, shared, UID_ANY, false);
        attach_token_ok(c, &t, false);
        assert_stored_is_table();

        kill_process(c->holder->pid);
        before = broker_text();
        store_inject_fault(b.store, STORE_STEP_WRITE, 1, -EIO, false);
        ck_assert_uint_eq(broker_reap_holders(&b), 0);
        ck_assert(broker_has_unreaped(&b));
        ck_assert_int_eq(b.store_error, -EIO);
        after = broker_text();
        ck_assert_str_eq(after, before);
        ck_assert_ptr_eq(find(id), l);
        ck_assert_uint_eq(shared->n_holds, 2);
        assert_stored_is_table();

        /* Tried again, stored: the holds go. */
        ck_assert_uint_eq(broker_reap_holders(&b), 2);
        ck_assert(!broker_has_unreaped(&b));
        ck_assert_int_eq(b.store_error, 0);
        ck_assert_ptr_null(find(id));
        ck_assert_uint_eq(shared->n_holds, 1);
        assert_stored_is_table();
}
END_TEST

/* Two exited holders, the second's change not stored: the first is reaped, the second waits for the next call. */
START_TEST(test_reap_not_stored_second_holder) {
        char id1[LEASE_ID_LEN + 1], id2[LEASE_ID_LEN + 1];
        Caller *a, *c1, *c2;

        setup_broker();
        a = this_process(UID_A);
        c1 = new_process(UID_A);
        c2 = new_process(UID_A);
        give_store();
        memcpy(id1, alloc_ok(c1, MiB)->id, sizeof(id1));
        memcpy(id2, alloc_ok(c2, MiB)->id, sizeof(id2));
        alloc_ok(a, MiB);

        kill_process(c1->holder->pid);
        kill_process(c2->holder->pid);
        store_inject_fault(b.store, STORE_STEP_WRITE, 2, -EIO, false);
        ck_assert_uint_eq(broker_reap_holders(&b), 1);
        ck_assert(broker_has_unreaped(&b));
        ck_assert_uint_eq(b.leases.n_leases, 2);
        ck_assert((find(id1) == NULL) != (find(id2) == NULL));    /* one of the two, whichever came first */
        assert_stored_is_table();

        ck_assert_uint_eq(broker_reap_holders(&b), 1);
        ck_assert(!broker_has_unreaped(&b));
        ck_assert_ptr_null(find(id1));
        ck_assert_ptr_null(find(id2));
        ck_assert_uint_eq(b.leases.n_leases, 1);
        assert_stored_is_table();
}
END_TEST

/*
 * A process that held nothing exits while no table is stored yet (the snapshot at start failed): there is
 * nothing to store for it, so it is reaped, and forgotten when its connection closes. (Were it kept until
 * storing works, every short-lived client of an outage would keep its holder and pidfd.)
 */
START_TEST(test_reap_holder_without_holds_needs_no_store) {
        StoreBackend backend = { .save = fake_save, .remove = fake_remove, .userdata = &fake };
        Store *st = NULL;
        Caller *c;

        setup_broker();
        this_process(UID_A);
        c = new_process(UID_B);
        ck_assert_int_eq(store_new(&st, &backend), 0);
        broker_set_store(&b, st);                       /* no snapshot: not open */
        kill_process(c->holder->pid);
        ck_assert_uint_eq(broker_reap_holders(&b), 0);
        ck_assert_int_eq(b.store_error, 0);             /* nothing failed to be stored */
        ck_assert(!broker_has_unreaped(&b));
        disconnect_last(c);
        ck_assert_uint_eq(b.holders.n_holders, 1);
}
END_TEST

/* A snapshot when the log has not grown is not written; forced, it is, and reads back the same. */
START_TEST(test_snapshot) {
        unsigned saves;
        Caller *a;

        setup_broker();
        a = this_process(UID_A);
        give_store();
        alloc_ok(a, MiB);
        saves = fake.saves;
        ck_assert_int_eq(broker_store_snapshot(&b, false), 0);
        ck_assert_uint_eq(fake.saves, saves);
        ck_assert_int_eq(broker_store_snapshot(&b, true), 0);
        ck_assert_uint_eq(fake.saves, saves + 1);
        ck_assert_uint_eq(fake.n, 1);                   /* the previous generation removed */
        assert_stored_is_table();

        /* A snapshot that fails says so, and the store goes on with the memfd it had. */
        store_inject_fault(b.store, STORE_STEP_WRITE, 1, -EIO, false);
        ck_assert_int_eq(broker_store_snapshot(&b, true), -EIO);
        ck_assert_int_eq(b.store_error, -EIO);
        alloc_ok(a, MiB);
        ck_assert_int_eq(b.store_error, 0);
        assert_stored_is_table();
}
END_TEST

static int count_token(const Token *t, void *userdata) {
        (*(unsigned *)userdata)++;
        return 0;
}

/* Tokens: the owner's holders and administrators see every token of a lease; nobody else learns of them. */
START_TEST(test_tokens) {
        Caller *a, *bb, *e, *root;
        unsigned n = 0;
        TokenText t;
        Lease *l;

        setup_broker();
        a = this_process(UID_A);
        bb = new_process(UID_B);
        e = new_process(UID_E);
        root = administrator();
        l = alloc_ok(a, MiB);
        t = share_ok(a, l, UID_B, true);
        attach_token_ok(bb, &t, true);
        for (unsigned i = 1; i < LEASE_TOKENS_MAX; i++)
                share_ok(a, l, UID_ANY, false);
        ck_assert_int_eq(broker_tokens(&b, a, l->id, count_token, &n), 0);
        ck_assert_uint_eq(n, LEASE_TOKENS_MAX);
        n = 0;
        ck_assert_int_eq(broker_tokens(&b, root, l->id, count_token, &n), 0);
        ck_assert_uint_eq(n, LEASE_TOKENS_MAX);
        ck_assert_int_eq(broker_tokens(&b, bb, l->id, count_token, &n), BROKER_E_NOT_OWNER);  /* holds it */
        ck_assert_int_eq(broker_tokens(&b, e, l->id, count_token, &n), BROKER_E_NO_SUCH_LEASE);
        ck_assert_int_eq(broker_tokens(&b, root, "nope", count_token, &n), BROKER_E_NO_SUCH_LEASE);
}
END_TEST

/*
 * A name another user may not attach answers exactly as one that does not exist, and neither is found in
 * the caller's own namespace: a user cannot plant a name under another's lookup.
 */
START_TEST(test_names_cannot_be_planted) {
        Caller *a, *bb;
        Lease *la, *lb;
        Hold *hold;

        setup_broker();
        a = this_process(UID_A);
        bb = new_process(UID_B);
        lb = alloc_ok(bb, MiB);
        ck_assert_int_eq(broker_publish(&b, bb, lb->id, "weights", (const uid_t[]){ UID_A }, 1, false), 0);
        ck_assert_int_eq(broker_publish(&b, bb, alloc_ok(bb, MiB)->id, "secret", NULL, 0, false), 0);
        ck_assert_int_eq(attach_name(a, "weights"), BROKER_E_NO_SUCH_NAME);      /* A's own: none */
        ck_assert_int_eq(attach_name(a, "1001/secret"), BROKER_E_NO_SUCH_NAME);  /* exists, not for A */
        ck_assert_int_eq(attach_name(a, "1001/nothing"), BROKER_E_NO_SUCH_NAME); /* does not exist */
        la = alloc_ok(a, MiB);
        ck_assert_int_eq(broker_publish(&b, a, la->id, "weights", NULL, 0, false), 0);
        hold = attach_name_ok(a, "weights", false);
        ck_assert_ptr_eq(hold->lease, la);
        hold = attach_name_ok(a, "1001/weights", false);
        ck_assert_ptr_eq(hold->lease, lb);
}
END_TEST

/* MaxProcesses=: the processes of a user the daemon keeps a pidfd of; one over it is refused, others not. */
START_TEST(test_max_processes) {
        UserQuota q = {};
        Holder *h = NULL;
        User *u;
        int pidfd;

        setup_broker();
        u = user_get(&b.users, UID_A, (const gid_t[]){ UID_A }, 1);
        u->max_processes = 1;
        this_process(UID_A);
        pidfd = pidfd_open(getppid(), 0);
        ck_assert_int_ge(pidfd, 0);
        ck_assert_int_eq(holder_connect(&b.holders, u, getppid(), UID_A, pidfd, &h, &q), -EDQUOT);
        ck_assert_int_eq(q.what, USER_PROCESSES);
        ck_assert_uint_eq(q.limit, 1);
        ck_assert_uint_eq(u->processes, 1);
        user_unref(u);
        new_process(UID_B);             /* another user is not affected */
}
END_TEST

/* ---- parking ------------------------------------------------------------------------------------------------- */

static void setup_broker_config(const PoolConfig *config) {
        _cleanup_free_ char *message = NULL;

        open_driver();
        ck_assert_msg(pool_new(&pool, cu, config, &message) == 0, "%s", message);
        limits = (LimitsConfig){ .defaults = user_limits_default() };
        ck_assert_int_eq(broker_init(&b, pool, &limits), 0);
        broker_up = true;
}

static void setup_broker_host(uint64_t host_capacity, bool no_host) {
        PoolConfig config = { .capacity = CAPACITY, .max_slab = 4 * MiB, .host_capacity = host_capacity,
                              .no_host = no_host };

        setup_broker_config(&config);
}

/* Maps the lease's slabs in this process as a client would, copies `bytes` of `buf` in or out, unmaps. */
static void lease_copy(const Lease *l, unsigned char *buf, bool in) {
        _cleanup_free_ char *message = NULL;
        int fds[POOL_MAX_SLABS];
        uint64_t sizes[POOL_MAX_SLABS];
        CUdeviceptr va = 0;
        CUdevice dev;

        ck_assert(!l->parked);
        for (size_t j = 0; j < l->n_slabs; j++) {
                fds[j] = l->slabs[j]->fd;
                sizes[j] = l->slabs[j]->size;
        }
        ck_assert_int_eq(pool_use_device(pool, 0), 0);
        ck_assert_int_eq(cu->cuDeviceGet(&dev, l->device), CUDA_SUCCESS);
        ck_assert_msg(cuda_map_fds(cu, dev, fds, sizes, l->n_slabs, false, &va, &message) == 0, "%s", message);
        if (in)
                ck_assert_int_eq(cu->cuMemcpyHtoD(va, buf, l->size), CUDA_SUCCESS);
        else
                ck_assert_int_eq(cu->cuMemcpyDtoH(buf, va, l->size), CUDA_SUCCESS);
        ck_assert_int_eq(cuda_unmap(cu, va, sizes, l->n_slabs), 0);
}

/* The lease's content, read as a client would, is `want` (l->size bytes). */
static void assert_lease_holds(const Lease *l, const unsigned char *want) {
        unsigned char *got = malloc(l->size);

        ck_assert_ptr_nonnull(got);
        lease_copy(l, got, false);
        ck_assert_msg(memcmp(want, got, l->size) == 0, "lease %s does not hold what was written into it", l->id);
        free(got);
}

static void fill(unsigned char *buf, size_t n, unsigned seed) {
        for (size_t i = 0; i < n; i++)
                buf[i] = (unsigned char)(i * 131 + seed + i / 4096);
}

/* Dispatches the pool's completions until pool_host_made() moves from `since` (bounded: 10 s). */
/* Dispatches the pool until the host slabs of pool_make_host()'s `ticket` are made (pool_make_done()). */
static void wait_made(uint64_t ticket) {
        for (unsigned i = 0; !pool_make_done(pool, ticket); i++) {
                struct pollfd p = { .fd = pool_get_fd(pool), .events = POLLIN };

                ck_assert_msg(i < 100, "the host slabs asked for were not made in 10 s");
                (void)poll(&p, 1, 100);
                (void)pool_dispatch(pool);
        }
}

/* Makes a Park that waits for its copy (BROKER_E_HOST_COPYING) again once a move ended, copy_waited, as
 * peer_host_try() does, until it is answered. */
static int park_copied(const Caller *c, int k, const char *id, bool *ret_parked, UserQuota *ret_quota) {
        Caller again = *c;

        again.copy_waited = true;
        while (k == BROKER_E_HOST_COPYING) {
                uint64_t ended = broker_moves_ended(&b);

                wait_moves_ended(ended);
                k = broker_park(&b, &again, id, ret_parked, ret_quota, NULL);
        }
        return k;
}

/* A Park that waited for its copy made again once, as the manager makes it when a move ended. */
static int park_again(const Caller *c, const char *id, bool *ret_parked, UserQuota *ret_quota) {
        Caller again = *c;

        again.copy_waited = true;
        return broker_park(&b, &again, id, ret_parked, ret_quota, NULL);
}

/* A Park made again once the host slabs it waited for were made, as peer_host_try() makes it when no host slab
 * failed meanwhile: while it lacks some (others took them), it waits for another making; then answered. */
static int park_made_again(const Caller *c, const char *id, bool *ret_parked, UserQuota *ret_quota) {
        uint64_t ticket = 0;
        int k;

        while ((k = broker_park(&b, c, id, ret_parked, ret_quota, &ticket)) == BROKER_E_HOST_MAKING)
                wait_made(ticket);
        return park_copied(c, k, id, ret_parked, ret_quota);
}

/*
 * broker_park() as the daemon makes it: when the host slabs it needs are being made off the loop
 * (BROKER_E_HOST_MAKING, nothing changed), waits for them and makes the call again; when its copy runs off the
 * loop (BROKER_E_HOST_COPYING), waits for it and makes it again, copy_waited.
 */
static int park_call(const Caller *c, const char *id, bool *ret_parked, UserQuota *ret_quota) {
        uint64_t ticket = 0;
        int k;

        k = broker_park(&b, c, id, ret_parked, ret_quota, &ticket);
        if (k != BROKER_E_HOST_MAKING)
                return park_copied(c, k, id, ret_parked, ret_quota);
        wait_made(ticket);
        return park_made_again(c, id, ret_parked, ret_quota);
}

static bool park_ok(const Caller *c, const Lease *l) {
        UserQuota q = {};
        bool parked = false;

        ck_assert_int_eq(park_call(c, l->id, &parked, &q), 0);
        return parked;
}

static void unpark_ok(const Caller *c, const Lease *l) {
        UserQuota q = {};
        Hold *hold = NULL;

        ck_assert_int_eq(unpark_call(c, l->id, &hold, &q), 0);
        ck_assert_ptr_eq(hold->holder, c->holder);
        ck_assert(!hold->parked);
}

/* Park moves the content into host slabs and the charge into host bytes; Unpark brings both back. */
START_TEST(test_park_unpark) {
        const uint64_t size = 10 * MiB;         /* 4 + 4 + 2 MiB slabs */
        unsigned char *want = malloc(size);
        PoolDeviceStats s;
        Caller *a;
        Lease *l;

        ck_assert(want);
        setup_broker_host(64 * MiB, false);
        a = this_process(UID_A);
        l = alloc_ok(a, size);
        ck_assert_uint_eq(l->n_slabs, 3);
        fill(want, size, 7);
        lease_copy(l, want, true);

        ck_assert(park_ok(a, l));
        ck_assert(l->parked);
        ck_assert(lease_find_hold(l, a->holder)->parked);
        ck_assert_uint_eq(a->user->bytes[0], 0);
        ck_assert_uint_eq(a->user->host_bytes[0], size);
        pool_device_stats(pool, 0, &s);
        ck_assert_uint_eq(s.leased, 0);
        ck_assert_uint_eq(s.parked, size);
        ck_assert_uint_eq(s.n_parked, 3);
        ck_assert_uint_eq(s.host_capacity, 64 * MiB);
        ck_assert(park_ok(a, l));               /* again: nothing more to do */

        unpark_ok(a, l);
        ck_assert(!l->parked);
        ck_assert_uint_eq(l->n_slabs, 3);
        ck_assert_uint_eq(a->user->bytes[0], size);
        ck_assert_uint_eq(a->user->host_bytes[0], 0);
        assert_lease_holds(l, want);
        ck_assert_int_eq(pool_drain(pool), 0);
        pool_device_stats(pool, 0, &s);
        ck_assert_uint_eq(s.parked, 0);
        ck_assert_uint_eq(s.host_cached, size);         /* scrubbed, kept for the next park */
        unpark_ok(a, l);                                /* not parked: as it is */

        /* Parked again, into the zeroed cached host slabs (no new host slab). */
        ck_assert(park_ok(a, l));
        pool_device_stats(pool, 0, &s);
        ck_assert_uint_eq(s.host_created, 3);
        unpark_ok(a, l);
        assert_lease_holds(l, want);
        free(want);
}
END_TEST

/* The content moves when the last process that maps it parks; each holder unparks for itself. */
START_TEST(test_park_every_holder) {
        Caller *a, *a2;
        TokenText t;
        Lease *l;

        setup_broker_host(64 * MiB, false);
        a = this_process(UID_A);
        a2 = new_process(UID_A);
        l = alloc_ok(a, 4 * MiB);
        t = share_ok(a, l, UID_A, false);
        attach_token_ok(a2, &t, false);

        ck_assert(!park_ok(a, l));              /* a2 still maps it */
        ck_assert(!l->parked);
        ck_assert_uint_eq(a->user->host_bytes[0], 0);
        ck_assert(park_ok(a2, l));
        ck_assert(l->parked);

        unpark_ok(a, l);                        /* back for a; a2 keeps its hold parked */
        ck_assert(!l->parked);
        ck_assert(lease_find_hold(l, a2->holder)->parked);
        ck_assert(park_ok(a, l));               /* nobody maps it: it parks at once */
        ck_assert(l->parked);

        /* A process that attaches a parked lease gets it back in device memory. */
        attach_token_ok(a, &t, false);
        ck_assert(!l->parked);
        ck_assert(!lease_find_hold(l, a->holder)->parked);
}
END_TEST

/* Only a read-write holder of the owner's user parks; any holder unparks, charged to the owner. */
START_TEST(test_park_who) {
        Caller *a, *bb, *e;
        UserQuota q = {};
        TokenText t, ro;
        bool parked;
        Lease *l;

        setup_broker_host(64 * MiB, false);
        a = this_process(UID_A);
        bb = new_process(UID_B);
        e = new_process(UID_E);
        l = alloc_ok(a, 4 * MiB);
        t = share_ok(a, l, UID_B, false);
        ro = share_ok(a, l, UID_ANY, true);
        attach_token_ok(bb, &t, false);
        attach_token_ok(e, &ro, true);

        ck_assert_int_eq(park_call(bb, l->id, &parked, &q), BROKER_E_NOT_OWNER);
        ck_assert_int_eq(park_call(e, l->id, &parked, &q), BROKER_E_NOT_OWNER);
        ck_assert_int_eq(park_call(administrator(), l->id, &parked, &q), BROKER_E_NO_SUCH_LEASE);
        ck_assert_int_eq(park_call(a, "0123456789abcdef0123456789abcdef", &parked, &q),
                         BROKER_E_NO_SUCH_LEASE);
        ck_assert(!lease_find_hold(l, bb->holder)->parked);

        /* The other holders let go (B and E have no Park: they free), then A parks; B attached again unparks. */
        ck_assert_int_eq(broker_free(&b, bb, l->id, false, NULL), 0);
        ck_assert_int_eq(broker_free(&b, e, l->id, false, NULL), 0);
        ck_assert(park_ok(a, l));
        ck_assert_uint_eq(bb->user->host_bytes[0], 0);
        attach_token_ok(bb, &t, false);
        ck_assert(!l->parked);
        ck_assert_uint_eq(a->user->bytes[0], 4 * MiB);  /* the owner's, not B's */
        ck_assert_uint_eq(bb->user->bytes[0], 0);
        ck_assert(l->foreign);
}
END_TEST

/* No room, over a limit, no host memory: nothing changes, and the hold is not parked. */
START_TEST(test_park_no_room) {
        Caller *a, *bb, *e;
        UserQuota q = {};
        Hold *hold = NULL;
        bool parked = false;
        Lease *l, *le;

        setup_broker_host(8 * MiB, false);
        a = this_process(UID_A);
        bb = new_process(UID_B);
        e = new_process(UID_E);
        /* Two users fill the host memory within their limits (50% of it each); a third user's park finds no
         * room, and a fourth lease of theirs is over their limit. */
        ck_assert(park_ok(bb, alloc_ok(bb, 4 * MiB)));
        l = alloc_ok(a, 4 * MiB);
        ck_assert(park_ok(a, l));
        le = alloc_ok(e, 2 * MiB);
        ck_assert_int_eq(park_call(e, le->id, &parked, &q), BROKER_E_NO_HOST_MEMORY);
        ck_assert(!le->parked);
        ck_assert(!lease_find_hold(le, e->holder)->parked);
        ck_assert_uint_eq(e->user->host_bytes[0], 0);
        ck_assert_uint_eq(e->user->bytes[0], 2 * MiB);
        ck_assert_int_eq(park_call(a, alloc_ok(a, 2 * MiB)->id, &parked, &q), BROKER_E_QUOTA);
        ck_assert_int_eq(q.what, USER_HOST_BYTES);
        ck_assert_uint_eq(q.limit, 4 * MiB);
        ck_assert_uint_eq(q.current, 4 * MiB);

        /* A's unpark gives its host memory back, zeroed: E's park fits now. */
        unpark_ok(a, l);
        ck_assert_int_eq(pool_drain(pool), 0);
        ck_assert(park_ok(e, le));

        /* Unpark with the device full: the lease stays parked, charged as it was. */
        ck_assert_int_eq(broker_free(&b, a, l->id, false, NULL), 0);
        l = alloc_ok(a, 2 * MiB);
        ck_assert(park_ok(a, l));
        ck_assert_int_eq(pool_drain(pool), 0);  /* what parking gave back is cached, not being scrubbed */
        /* 2 MiB of A's are leased: B takes 3270 MiB (in leases of at most 253 slabs), A the other 824. */
        for (int i = 0; i < 3; i++)
                alloc_ok(bb, 1000 * MiB);
        alloc_ok(bb, 270 * MiB);
        alloc_ok(a, 824 * MiB);
        ck_assert_int_eq(unpark_call(a, l->id, &hold, &q), BROKER_E_NO_MEMORY);
        ck_assert(l->parked);
        ck_assert(lease_find_hold(l, a->holder)->parked);
        ck_assert_uint_eq(a->user->host_bytes[0], 2 * MiB);
}
END_TEST

/* Host slabs created in the pool so far (PoolDeviceStats.host_created). */
static uint64_t host_created(void) {
        PoolDeviceStats st;

        pool_device_stats(pool, 0, &st);
        return st.host_created;
}

/*
 * A park that needs new host slabs does not make them in the call: BROKER_E_HOST_MAKING, nothing changed (the
 * lease, the hold, the owner's charges), their room taken from the host capacity at once, so that a park that
 * would not fit beside them is refused at once. Once made, the call made again parks without creating any;
 * a later park the cache serves makes nothing; a call made again whose slabs others took waits for another
 * making, unless a host slab failed to be made meanwhile (host_make_failed): then it creates what it lacks.
 */
START_TEST(test_park_makes_host_off_the_loop) {
        Caller *a, *bb, *e;
        UserQuota q = {};
        Hold *hold = NULL;
        bool parked = true;
        uint64_t made, created, ta = 0, tb = 0;
        Lease *l, *lb;

        setup_broker_host(8 * MiB, false);
        a = this_process(UID_A);
        bb = new_process(UID_B);
        e = new_process(UID_E);
        l = alloc_ok(a, 4 * MiB);
        lb = alloc_ok(bb, 4 * MiB);
        created = host_created();
        ck_assert_int_eq(broker_park(&b, a, l->id, &parked, &q, &ta), BROKER_E_HOST_MAKING);
        ck_assert(!l->parked && !lease_find_hold(l, a->holder)->parked);
        ck_assert_uint_eq(a->user->host_bytes[0], 0);
        ck_assert_uint_eq(a->user->bytes[0], 4 * MiB);
        ck_assert_int_eq(broker_park(&b, bb, lb->id, &parked, &q, &tb), BROKER_E_HOST_MAKING);
        ck_assert_uint_gt(tb, ta);
        /* 8 MiB of host memory are being made: E's 2 MiB do not fit beside them */
        ck_assert_int_eq(broker_park(&b, e, alloc_ok(e, 2 * MiB)->id, &parked, &q, NULL), BROKER_E_NO_HOST_MEMORY);

        wait_made(ta);
        wait_made(tb);
        ck_assert_uint_eq(host_created(), created + 2);
        ck_assert_int_eq(park_made_again(a, l->id, &parked, &q), 0);
        ck_assert(parked && l->parked);
        ck_assert_int_eq(park_made_again(bb, lb->id, &parked, &q), 0);
        ck_assert(parked && lb->parked);
        ck_assert_uint_eq(host_created(), created + 2);         /* the made ones, no more */

        /* Unparked, A's host slab is kept for its next park, which makes nothing. */
        unpark_ok(a, l);
        ck_assert_int_eq(pool_drain(pool), 0);
        made = pool_host_made(pool);
        ck_assert_int_eq(park_call(a, l->id, &parked, &q), 0);
        ck_assert(parked && pool_host_made(pool) == made && host_created() == created + 2);

        /* Made again after a wait, a park whose host slabs others took meanwhile waits for another making: none
         * is pinned in the call, which would hold up every other client. */
        ck_assert_int_eq(unpark_call(a, l->id, &hold, &q), 0);
        ck_assert_int_eq(broker_free(&b, a, l->id, false, NULL), 0);
        ck_assert_int_eq(pool_drain(pool), 0);
        l = alloc_ok(a, 2 * MiB);
        ck_assert_int_eq(broker_park(&b, a, l->id, &parked, &q, &ta), BROKER_E_HOST_MAKING);
        ck_assert_uint_eq(host_created(), created + 2);
        wait_made(ta);
        ck_assert_int_eq(park_made_again(a, l->id, &parked, &q), 0);
        ck_assert(parked && host_created() == created + 3);

        /* When a host slab failed to be made since it began (host_make_failed), it creates what it lacks itself,
         * to be answered with the driver's refusal rather than wait for makings that fail for ever. */
        {
                Caller failed = *a;

                failed.host_make_failed = true;
                made = pool_host_made(pool);
                l = alloc_ok(a, 2 * MiB);
                ck_assert_int_eq(park_copied(&failed, broker_park(&b, &failed, l->id, &parked, &q, NULL), l->id, &parked,
                                             &q), 0);
                ck_assert(parked && pool_host_made(pool) == made && host_created() == created + 4);
        }
}
END_TEST

/*
 * A host slab that fails to be made off the loop is counted (pool_make_failures()). The Park made again lacks it;
 * with host_make_failed (the daemon sets it when the count moved while the call waited) it creates what it
 * lacks itself and is answered with the driver's refusal, where without it it would only ask for another
 * making, which could fail for ever with its client never answered. Without a fault, that making parks it.
 */
START_TEST(test_park_after_failed_making) {
        UserQuota q = {};
        bool parked = false;
        uint64_t ticket = 0;
        Caller *a, failed;
        Lease *l;

        setup_broker_host(8 * MiB, false);
        a = this_process(UID_A);
        l = alloc_ok(a, 2 * MiB);
        ck_assert_int_eq(sim_fail("cuMemCreate:1:CUDA_ERROR_OUT_OF_MEMORY"), 0);
        ck_assert_int_eq(broker_park(&b, a, l->id, &parked, &q, &ticket), BROKER_E_HOST_MAKING);
        wait_made(ticket);
        ck_assert(pool_make_failed(pool, ticket));
        ck_assert_ptr_nonnull(strstr(pool_last_error(pool), "cuMemCreate"));
        ck_assert(!l->parked);

        failed = *a;
        failed.host_make_failed = true;
        ck_assert_int_eq(sim_fail("cuMemCreate:1:CUDA_ERROR_OUT_OF_MEMORY"), 0);
        ck_assert_int_eq(broker_park(&b, &failed, l->id, &parked, &q, NULL), BROKER_E_NO_HOST_MEMORY);
        ck_assert(!l->parked);
        ck_assert_uint_eq(a->user->host_bytes[0], 0);

        ck_assert_int_eq(broker_park(&b, a, l->id, &parked, &q, &ticket), BROKER_E_HOST_MAKING);
        wait_made(ticket);
        ck_assert(!pool_make_failed(pool, ticket));
        ck_assert_int_eq(park_made_again(a, l->id, &parked, &q), 0);
        ck_assert(parked && l->parked);
}
END_TEST

START_TEST(test_park_without_host_memory) {
        UserQuota q = {};
        bool parked;
        Caller *a;
        Lease *l;

        setup_broker_host(0, true);             /* HostCapacity=0 */
        a = this_process(UID_A);
        l = alloc_ok(a, 2 * MiB);
        ck_assert_int_eq(park_call(a, l->id, &parked, &q), BROKER_E_NO_HOST_MEMORY);
        ck_assert(strstr(pool_last_error(pool), "HostCapacity=0"));
}
END_TEST

/* A parked lease ends like any: freed by its last holder, or when that process exits; host memory is zeroed. */
START_TEST(test_park_end) {
        char id[LEASE_ID_LEN + 1];
        PoolDeviceStats s;
        Caller *a, *child;
        Lease *l;

        setup_broker_host(64 * MiB, false);
        a = this_process(UID_A);
        l = alloc_ok(a, 4 * MiB);
        ck_assert(park_ok(a, l));
        ck_assert_int_eq(broker_free(&b, a, l->id, false, NULL), 0);
        ck_assert_uint_eq(a->user->host_bytes[0], 0);
        ck_assert_int_eq(pool_drain(pool), 0);
        pool_device_stats(pool, 0, &s);
        ck_assert_uint_eq(s.parked, 0);
        ck_assert_uint_eq(s.host_cached, 4 * MiB);

        child = new_process(UID_A);
        l = alloc_ok(child, 4 * MiB);
        memcpy(id, l->id, sizeof(id));
        ck_assert(park_ok(child, l));
        kill_process(child->holder->pid);
        ck_assert_uint_eq(broker_reap_holders(&b), 1);
        ck_assert_ptr_null(find(id));
        ck_assert_uint_eq(child->user->host_bytes[0], 0);
}
END_TEST

/* A lease parked once and unparked: its host slabs are cached, so that its next park makes none and only copies. */
static Lease *alloc_parked_once(const Caller *c, uint64_t size) {
        Lease *l = alloc_ok(c, size);

        ck_assert(park_ok(c, l));
        unpark_ok(c, l);
        ck_assert_int_eq(pool_drain(pool), 0);
        return l;
}

/* The park of `l` by `c` with the device's stream held: its copy waits, the call is answered HOST_COPYING. */
static Hold *park_copying(const Caller *c, const Lease *l) {
        UserQuota q = {};
        bool parked = true;

        sim_hold_streams(1);
        ck_assert_int_eq(broker_park(&b, c, l->id, &parked, &q, NULL), BROKER_E_HOST_COPYING);
        ck_assert_ptr_nonnull(l->move);
        return lease_find_hold(l, c->holder);
}

/*
 * A park's copy runs off the loop: the call is answered HOST_COPYING with the lease as it was (its host slabs
 * and host bytes taken, nothing stored), and the move is committed once the copy is done, not before. A second
 * Park of the same process waits for the same move. The content arrives whole.
 */
START_TEST(test_park_copies_off_the_loop) {
        const uint64_t size = 6 * MiB;
        unsigned char *want = malloc(size);
        uint64_t ended, copied;
        PoolDeviceStats s;
        UserQuota q = {};
        bool parked = true;
        Hold *hold;
        Caller *a;
        Lease *l;

        ck_assert(want);
        setup_broker_host(64 * MiB, false);
        a = this_process(UID_A);
        l = alloc_parked_once(a, size);
        fill(want, size, 3);
        lease_copy(l, want, true);
        pool_device_stats(pool, 0, &s);
        copied = s.copied_bytes;
        ended = broker_moves_ended(&b);

        hold = park_copying(a, l);
        ck_assert(!l->parked && !hold->parked);
        ck_assert_uint_eq(a->user->bytes[0], size);             /* still in device memory */
        ck_assert_uint_eq(a->user->host_bytes[0], size);        /* and its host memory taken */
        pool_device_stats(pool, 0, &s);
        ck_assert_uint_eq(s.copied_bytes, copied + size);
        ck_assert_uint_eq(s.parked, size);                      /* the host slabs are the move's */
        ck_assert_int_eq(broker_park(&b, a, l->id, &parked, &q, NULL), BROKER_E_HOST_COPYING);  /* the same move */
        ck_assert_uint_eq(broker_finish_moves(&b), 0);          /* not done: the stream is held */
        ck_assert_uint_eq(broker_moves_ended(&b), ended);
        ck_assert(!l->parked);

        sim_hold_streams(0);
        ck_assert_int_eq(park_copied(a, BROKER_E_HOST_COPYING, l->id, &parked, &q), 0);
        ck_assert(parked && l->parked && hold->parked);
        ck_assert_ptr_null(l->move);
        ck_assert_uint_eq(broker_moves_ended(&b), ended + 1);
        ck_assert_uint_eq(a->user->bytes[0], 0);
        ck_assert_uint_eq(a->user->host_bytes[0], size);
        unpark_ok(a, l);
        assert_lease_holds(l, want);
        free(want);
}
END_TEST

/*
 * A park's copy that fails part way (a later piece of it could not be queued: pieces of 2 MiB here) ends its move
 * uncommitted: the Park made again is answered with the driver's failure, and the lease is as it was, in device
 * memory with its content whole; its host slabs and host bytes went back. The next Park parks it.
 */
START_TEST(test_park_copy_fails_part_way) {
        const uint64_t size = 10 * MiB;         /* 4 + 4 + 2 MiB slabs: 5 pieces */
        PoolConfig config = { .capacity = CAPACITY, .max_slab = 4 * MiB, .host_capacity = 64 * MiB,
                              .copy_piece = 2 * MiB };
        unsigned char *want = malloc(size);
        PoolDeviceStats s;
        UserQuota q = {};
        bool parked = true;
        uint64_t ended;
        Caller *a, *bb;
        Lease *l, *other = NULL;

        ck_assert(want);
        setup_broker_config(&config);
        a = this_process(UID_A);
        bb = new_process(UID_B);
        l = alloc_parked_once(a, size);
        fill(want, size, 5);
        lease_copy(l, want, true);

        (void)park_copying(a, l);                               /* POOL_COPY_AHEAD pieces queued, held */
        ck_assert_int_eq(sim_fail("cuMemcpyDtoDAsync:2"), 0);   /* the fifth */
        ended = broker_moves_ended(&b);
        sim_hold_streams(0);
        wait_moves_ended(ended);
        /* Another user's call fails in the driver before the Park is made again: the Park's answer still says
         * why its own copy failed. */
        ck_assert_int_eq(sim_fail("cuMemCreate:1:CUDA_ERROR_UNKNOWN"), 0);
        ck_assert_int_eq(broker_alloc(&b, bb, 0, 6 * MiB, NULL, &other, &q), BROKER_E_DRIVER);
        ck_assert_ptr_nonnull(strstr(pool_last_error(pool), "cuMemCreate"));
        ck_assert_int_eq(park_again(a, l->id, &parked, &q), BROKER_E_DRIVER);
        ck_assert_msg(strstr(pool_last_error(pool), "cuMemcpyDtoDAsync"), "the Park's copy failed, and its answer "
                      "says: %s", pool_last_error(pool));
        ck_assert(!l->parked);
        ck_assert_ptr_null(l->move);
        ck_assert_uint_eq(a->user->bytes[0], size);
        ck_assert_uint_eq(a->user->host_bytes[0], 0);
        pool_device_stats(pool, 0, &s);
        ck_assert_uint_eq(s.parked, 0);
        assert_lease_holds(l, want);

        ck_assert(park_ok(a, l));
        unpark_ok(a, l);
        assert_lease_holds(l, want);
        free(want);
}
END_TEST

/*
 * What needs the lease as it is undoes its move: an Attach of another process, a Free with keep (never kept
 * while moving), the parking process's exit. Each gives the host slabs (scrubbed after the copy) and the host
 * bytes back at once; the Park made again then answers from the lease as it is. An Unpark of its own process
 * waits for the park instead.
 */
START_TEST(test_park_copy_undone) {
        const uint64_t size = 4 * MiB;
        PoolDeviceStats s;
        UserQuota q = {};
        bool parked = true, kept = true;
        uint64_t ended;
        Caller *a, *a2, *child;
        Hold *hold = NULL;
        TokenText t;
        Lease *l;
        char id[LEASE_ID_LEN + 1];

        setup_broker_host(64 * MiB, false);
        a = this_process(UID_A);
        a2 = new_process(UID_A);
        l = alloc_parked_once(a, size);
        t = share_ok(a, l, UID_A, false);

        /* Another process attaches: the move is undone; the Park then only parks its hold. */
        ended = broker_moves_ended(&b);
        park_copying(a, l);
        attach_token_ok(a2, &t, false);
        ck_assert_ptr_null(l->move);
        ck_assert_uint_eq(broker_moves_ended(&b), ended + 1);
        ck_assert_uint_eq(a->user->host_bytes[0], 0);
        ck_assert_int_eq(park_again(a, l->id, &parked, &q), 0);
        ck_assert(!parked && !l->parked && lease_find_hold(l, a->holder)->parked);
        sim_hold_streams(0);
        ck_assert_int_eq(pool_drain(pool), 0);
        pool_device_stats(pool, 0, &s);
        ck_assert_uint_eq(s.parked, 0);
        ck_assert_uint_eq(s.host_cached, size);                 /* scrubbed, cached */
        ck_assert_int_eq(broker_free(&b, a2, l->id, false, NULL), 0);
        unpark_ok(a, l);

        /* Its own Unpark (another thread's connection) waits for its park: served in the order they came. */
        park_copying(a, l);
        ck_assert_int_eq(broker_unpark(&b, a, l->id, &hold, &q), BROKER_E_HOST_COPYING);
        ck_assert(l->move && l->move->parked);                  /* not undone */
        sim_hold_streams(0);
        ck_assert_int_eq(park_copied(a, BROKER_E_HOST_COPYING, l->id, &parked, &q), 0);
        ck_assert(parked && l->parked);
        ck_assert_int_eq(unpark_call(a, l->id, &hold, &q), 0);
        ck_assert(!l->parked && !hold->parked);
        ck_assert_int_eq(pool_drain(pool), 0);

        /* A Free with keep: never kept while it moves; the lease ends, and the Park made again finds nothing. */
        memcpy(id, l->id, sizeof(id));
        park_copying(a, l);
        ck_assert_int_eq(broker_free(&b, a, id, true, &kept), 0);
        ck_assert(!kept);
        ck_assert_ptr_null(find(id));
        ck_assert_uint_eq(a->user->host_bytes[0], 0);
        ck_assert_int_eq(park_again(a, id, &parked, &q), BROKER_E_NO_SUCH_LEASE);
        sim_hold_streams(0);
        ck_assert_int_eq(pool_drain(pool), 0);

        /* The parking process exits mid-copy: its lease ends with the move. */
        child = new_process(UID_A);
        l = alloc_ok(child, size);
        memcpy(id, l->id, sizeof(id));
        park_copying(child, l);
        kill_process(child->holder->pid);
        ended = broker_moves_ended(&b);
        ck_assert_uint_eq(broker_reap_holders(&b), 1);
        ck_assert_ptr_null(find(id));
        ck_assert_uint_eq(broker_moves_ended(&b), ended + 1);
        ck_assert_uint_eq(child->user->host_bytes[0], 0);
        sim_hold_streams(0);
        ck_assert_int_eq(pool_drain(pool), 0);
        pool_device_stats(pool, 0, &s);
        ck_assert_uint_eq(s.parked, 0);
        ck_assert_uint_eq(s.leased, 0);
}
END_TEST

/*
 * A park's copy has a stream of its own: with it held, another user's Alloc that waits for its own freed slab's
 * scrub is served (the scrub is not queued behind the copy), and so is an unpark's scrub of nothing.
 */
START_TEST(test_park_copy_not_before_scrubs) {
        PoolDeviceStats s;
        UserQuota q = {};
        bool parked = false;
        uint64_t waits;
        Caller *a, *bb;
        Lease *l, *lb;

        setup_broker_host(64 * MiB, false);
        a = this_process(UID_A);
        bb = new_process(UID_B);
        l = alloc_parked_once(a, 4 * MiB);
        lb = alloc_ok(bb, 4 * MiB);

        sim_hold_copies(1);
        ck_assert_int_eq(broker_park(&b, a, l->id, &parked, &q, NULL), BROKER_E_HOST_COPYING);
        ck_assert_int_eq(broker_free(&b, bb, lb->id, false, NULL), 0);
        pool_scrub_queued(pool);
        pool_device_stats(pool, 0, &s);
        waits = s.scrub_waits;
        lb = alloc_ok(bb, 4 * MiB);                             /* its own slab, once scrubbed */
        pool_device_stats(pool, 0, &s);
        ck_assert_uint_eq(s.scrub_waits, waits + 1);
        ck_assert_ptr_nonnull(l->move);                         /* the copy is still held */
        sim_hold_copies(0);
        ck_assert_int_eq(park_copied(a, BROKER_E_HOST_COPYING, l->id, &parked, &q), 0);
        ck_assert(parked && l->parked);
}
END_TEST

/*
 * The host slabs of an undone park, queued for their scrub once the copy is done, serve the owner's next park:
 * it counts on them, makes none off the loop, and creates none in it (their scrub unbinds them).
 */
START_TEST(test_park_after_undone_creates_nothing) {
        PoolDeviceStats s;
        UserQuota q = {};
        bool parked = false;
        uint64_t created;
        Caller *a, *a2;
        TokenText t;
        Lease *l;

        setup_broker_host(64 * MiB, false);
        a = this_process(UID_A);
        a2 = new_process(UID_A);
        l = alloc_parked_once(a, 4 * MiB);
        t = share_ok(a, l, UID_A, false);
        created = host_created();
        park_copying(a, l);
        attach_token_ok(a2, &t, false);                         /* undone */
        ck_assert_int_eq(broker_free(&b, a2, l->id, false, NULL), 0);
        sim_hold_streams(0);
        for (unsigned i = 0;; i++) {                            /* the copy done: the host slabs queued */
                struct pollfd p = { .fd = pool_get_fd(pool), .events = POLLIN };

                pool_device_stats(pool, 0, &s);
                if (s.host_scrubbing > 0)
                        break;
                ck_assert_msg(i < 100, "the undone park's host slabs were not given back in 10 s");
                (void)poll(&p, 1, 100);
                (void)pool_dispatch(pool);
        }
        ck_assert_int_eq(park_again(a, l->id, &parked, &q), BROKER_E_HOST_COPYING);     /* not HOST_MAKING */
        ck_assert_uint_eq(host_created(), created);
        ck_assert_int_eq(park_copied(a, BROKER_E_HOST_COPYING, l->id, &parked, &q), 0);
        ck_assert(parked && l->parked);
        ck_assert_uint_eq(host_created(), created);
}
END_TEST

/* A lease on its way to host memory is not asked back: its device memory comes back when the move ends. */
START_TEST(test_park_copy_not_reclaimed) {
        Lease *picked[4];
        Caller *a, *w;
        Lease *l;

        setup_broker_host(64 * MiB, false);
        a = this_process(UID_A);
        w = new_process(UID_B);
        l = alloc_parked_once(a, 4 * MiB);
        a->holder->watch = &picked;
        ck_assert_int_eq(broker_set_reclaimable(&b, a, l->id, 1), 0);
        park_copying(a, l);
        ck_assert_uint_eq(broker_reclaim_pick(&b, 0, 4 * MiB, w->holder, picked, 4), 0);
        sim_hold_streams(0);
        a->holder->watch = NULL;
}
END_TEST

/*
 * An unpark's copy runs off the loop too: HOST_COPYING, the lease still parked with its device bytes taken; the
 * Unpark of another holder and an Attach wait for the same move (one copy, one charge), and each is answered
 * once it is committed. The content comes back whole.
 */
START_TEST(test_unpark_copies_off_the_loop) {
        const uint64_t size = 6 * MiB;
        unsigned char *want = malloc(size);
        Caller *a, *a2, *a3;
        UserQuota q = {};
        Hold *hold = NULL;
        uint64_t ended;
        TokenText t;
        Lease *l;

        ck_assert(want);
        setup_broker_host(64 * MiB, false);
        a = this_process(UID_A);
        a2 = new_process(UID_A);
        a3 = new_process(UID_A);
        l = alloc_ok(a, size);
        fill(want, size, 5);
        lease_copy(l, want, true);
        t = share_ok(a, l, UID_A, false);
        attach_token_ok(a2, &t, false);
        ck_assert(!park_ok(a2, l));
        ck_assert(park_ok(a, l));
        ck_assert_int_eq(pool_drain(pool), 0);

        sim_hold_streams(1);
        ended = broker_moves_ended(&b);
        ck_assert_int_eq(broker_unpark(&b, a, l->id, &hold, &q), BROKER_E_HOST_COPYING);
        ck_assert(l->parked && l->move && !l->move->parked);
        ck_assert_uint_eq(a->user->bytes[0], size);             /* its device memory taken */
        ck_assert_uint_eq(a->user->host_bytes[0], size);        /* and its host memory still its */
        ck_assert_int_eq(broker_unpark(&b, a2, l->id, &hold, &q), BROKER_E_HOST_COPYING);
        ck_assert_int_eq(broker_attach(&b, a3, t.s, UID_ANY, NULL, false, &hold, NULL), BROKER_E_HOST_COPYING);
        ck_assert_uint_eq(a->user->bytes[0], size);             /* one move */
        ck_assert_uint_eq(broker_finish_moves(&b), 0);
        ck_assert_uint_eq(broker_moves_ended(&b), ended);

        sim_hold_streams(0);
        ck_assert_int_eq(unpark_call(a, l->id, &hold, &q), 0);
        ck_assert(!l->parked && !l->move && !hold->parked);
        ck_assert_uint_eq(a->user->bytes[0], size);
        ck_assert_uint_eq(a->user->host_bytes[0], 0);
        ck_assert_int_eq(unpark_call(a2, l->id, &hold, &q), 0);
        ck_assert(!hold->parked);
        ck_assert_int_eq(attach_call(a3, t.s, UID_ANY, NULL, false, &hold), 0);
        ck_assert_uint_eq(l->n_holds, 3);
        assert_lease_holds(l, want);
        free(want);
}
END_TEST

/*
 * An unpark being copied is waited for by a Park of the same process, and undone by the lease's end; an
 * Attach's unpark is nobody's to undo, and outlives the attacher. And a
 * foreign lease that ends while a copy reads its slabs: they are released once the copy is done (and the
 * move's host slabs scrubbed then), and the loop waits for nothing.
 */
START_TEST(test_unpark_copy_undone) {
        const uint64_t size = 4 * MiB;
        Caller *a, *bb, *child;
        char id[LEASE_ID_LEN + 1];
        PoolDeviceStats s;
        UserQuota q = {};
        Hold *hold = NULL;
        bool parked = false;
        uint64_t released, deferred;
        TokenText t;
        size_t n;
        Lease *l;

        setup_broker_host(64 * MiB, false);
        a = this_process(UID_A);
        bb = new_process(UID_B);
        l = alloc_parked_once(a, size);
        ck_assert(park_ok(a, l));
        ck_assert_int_eq(pool_drain(pool), 0);

        /* Its own Park meanwhile waits for the unpark: unparked, then parked again, in the order they came. */
        sim_hold_streams(1);
        ck_assert_int_eq(broker_unpark(&b, a, l->id, &hold, &q), BROKER_E_HOST_COPYING);
        ck_assert_int_eq(broker_park(&b, a, l->id, &parked, &q, NULL), BROKER_E_HOST_COPYING);
        ck_assert(l->move && !l->move->parked);                 /* not undone */
        sim_hold_streams(0);
        ck_assert_int_eq(unpark_call(a, l->id, &hold, &q), 0);
        ck_assert(!l->parked && !hold->parked);
        ck_assert(park_ok(a, l));
        ck_assert_int_eq(pool_drain(pool), 0);
        pool_device_stats(pool, 0, &s);
        ck_assert_uint_eq(s.leased, 0);                         /* the device slabs scrubbed, cached */

        /* An Attach's unpark goes on when the attacher exits, and ends with the lease unparked. */
        t = share_ok(a, l, UID_A, false);
        child = new_process(UID_A);
        sim_hold_streams(1);
        ck_assert_int_eq(broker_attach(&b, child, t.s, UID_ANY, NULL, false, &hold, NULL), BROKER_E_HOST_COPYING);
        kill_process(child->holder->pid);
        (void)broker_reap_holders(&b);          /* it holds nothing yet */
        ck_assert_ptr_nonnull(l->move);
        sim_hold_streams(0);
        wait_moves_ended(broker_moves_ended(&b));
        ck_assert(!l->parked && !l->move);
        ck_assert_uint_eq(a->user->bytes[0], size);
        ck_assert_uint_eq(a->user->host_bytes[0], 0);

        /* The lease ends mid-unpark: its device slabs go back with the move. */
        ck_assert(park_ok(a, l));
        ck_assert_int_eq(pool_drain(pool), 0);          /* no scrub left for the unpark to wait for */
        memcpy(id, l->id, sizeof(id));
        sim_hold_streams(1);
        ck_assert_int_eq(broker_unpark(&b, a, id, &hold, &q), BROKER_E_HOST_COPYING);
        ck_assert_int_eq(broker_free(&b, a, id, false, NULL), 0);
        ck_assert_ptr_null(find(id));
        ck_assert_uint_eq(a->user->bytes[0], 0);
        ck_assert_uint_eq(a->user->host_bytes[0], 0);
        sim_hold_streams(0);
        ck_assert_int_eq(pool_drain(pool), 0);
        pool_device_stats(pool, 0, &s);
        ck_assert_uint_eq(s.leased, 0);
        ck_assert_uint_eq(s.parked, 0);

        /* A foreign lease ends mid-park: its device slabs, still read by the copy, are released after it. */
        l = alloc_ok(a, size);
        memcpy(id, l->id, sizeof(id));
        t = share_ok(a, l, UID_B, false);
        attach_token_ok(bb, &t, false);
        ck_assert_int_eq(broker_free(&b, bb, id, false, NULL), 0);
        ck_assert(l->foreign);
        n = l->n_slabs;
        pool_device_stats(pool, 0, &s);
        released = s.released;
        deferred = s.after_copy;
        park_copying(a, l);
        ck_assert_int_eq(broker_free(&b, a, id, false, NULL), 0);
        pool_device_stats(pool, 0, &s);
        ck_assert_uint_eq(s.after_copy, deferred + 2 * n);     /* the device slabs, and the move's host slabs */
        ck_assert_uint_eq(s.released, released);                /* not yet: the copy reads them */
        sim_hold_streams(0);
        ck_assert_int_eq(pool_drain(pool), 0);
        pool_device_stats(pool, 0, &s);
        ck_assert_uint_eq(s.released, released + n);
        ck_assert_uint_eq(s.copy_waits, 0);
}
END_TEST

/* A parked lease holds no device memory: marked reclaimable or not, it is never asked back. */
START_TEST(test_park_not_reclaimed) {
        Lease *picked[4];
        Caller *a, *w;
        Lease *l;

        setup_broker_host(64 * MiB, false);
        a = this_process(UID_A);
        w = new_process(UID_B);                 /* the process whose Alloc would wait */
        l = alloc_ok(a, 4 * MiB);
        a->holder->watch = &picked;             /* it watches (the manager's peer; not used here) */
        ck_assert_int_eq(broker_set_reclaimable(&b, a, l->id, 1), 0);
        ck_assert_uint_eq(broker_reclaim_pick(&b, 0, 4 * MiB, w->holder, picked, 4), 1);
        ck_assert(park_ok(a, l));
        ck_assert_int_eq(l->reclaim.state, RECLAIM_NONE);       /* parking ended its mark */
        ck_assert_int_eq(broker_set_reclaimable(&b, a, l->id, 1), 0);
        ck_assert_uint_eq(broker_reclaim_pick(&b, 0, 4 * MiB, w->holder, picked, 4), 0);
        unpark_ok(a, l);
        ck_assert_uint_eq(broker_reclaim_pick(&b, 0, 4 * MiB, w->holder, picked, 4), 1);
        a->holder->watch = NULL;
}
END_TEST

/* Park and Unpark are written ahead like every change; the store says which slabs are host slabs. */
START_TEST(test_park_write_ahead) {
        char id[LEASE_ID_LEN + 1];
        UserQuota q = {};
        Hold *hold = NULL;
        Caller *a, *a2;
        TokenText t;
        bool parked;

        setup_broker_host(64 * MiB, false);
        a = this_process(UID_A);
        a2 = new_process(UID_A);
        memcpy(id, alloc_ok(a, 6 * MiB)->id, sizeof(id));
        t = share_ok(a, find(id), UID_A, false);
        attach_token_ok(a2, &t, false);
        give_store();
        /* A hold parked while another process maps the lease: the hold's flag is stored. */
        ASSERT_NOT_STORED_THEN_MADE(park_call(a2, id, &parked, &q));
        ck_assert(!parked && lease_find_hold(find(id), a2->holder)->parked);
        /* The last one: the lease moves. */
        ASSERT_NOT_STORED_THEN_MADE(park_call(a, id, &parked, &q));
        ck_assert(parked && find(id)->parked);
        ASSERT_NOT_STORED_THEN_MADE(unpark_call(a, id, &hold, &q));
        ck_assert(!find(id)->parked);
        ck_assert(lease_find_hold(find(id), a2->holder)->parked);
        /* a2 maps it again: a lease not parked, only the hold's flag changes. */
        ASSERT_NOT_STORED_THEN_MADE(unpark_call(a2, id, &hold, &q));
        ck_assert(!hold->parked);
}
END_TEST


/* ---- keeping ---------------------------------------------------------------------------------------------- */

static bool free_keep(const Caller *c, const char *id) {
        bool kept = false;

        ck_assert_int_eq(broker_free(&b, c, id, true, &kept), 0);
        return kept;
}

/*
 * Free with keep leaves the lease to its process: still held, still charged, zeroed, on the holder's kept
 * list; the process's next Alloc of the size (rounded up) gets the very lease back with the new label.
 */
START_TEST(test_keep_and_reuse) {
        const uint64_t size = 6 * MiB;
        unsigned char *want = malloc(size), *got = malloc(size), *zero = calloc(1, size);
        char id[LEASE_ID_LEN + 1];
        UserQuota q = {};
        Lease *l, *again = NULL;
        Caller *a;

        ck_assert(want && got && zero);
        setup_broker();
        a = this_process(UID_A);
        l = alloc_ok(a, size);
        memcpy(id, l->id, sizeof(id));
        fill(want, size, 3);
        lease_copy(l, want, true);

        ck_assert(free_keep(a, id));
        ck_assert_ptr_eq(find(id), l);
        ck_assert(l->kept);
        ck_assert_uint_eq(lease_find_hold(l, a->holder)->refs, 1);
        ck_assert_uint_eq(a->user->leases, 1);                  /* still charged */
        ck_assert_uint_eq(a->user->bytes[0], size);
        ck_assert_uint_eq(b.leases.device_kept[0], size);
        ck_assert_int_eq(l->reclaim.state, RECLAIM_MARKED);
        ck_assert(l->reclaim.kept);

        /* 5 MiB rounds up to the kept 6 MiB: the same lease, zeroed, relabelled, charged once. */
        ck_assert_int_eq(broker_alloc(&b, a, 0, 5 * MiB, "again", &again, &q), 0);
        ck_assert_ptr_eq(again, l);
        ck_assert_str_eq(l->id, id);
        ck_assert(!l->kept);
        ck_assert_str_eq(l->label, "again");
        ck_assert_int_eq(l->reclaim.state, RECLAIM_NONE);
        ck_assert_uint_eq(b.leases.device_kept[0], 0);
        ck_assert_uint_eq(a->user->leases, 1);
        ck_assert_uint_eq(a->user->bytes[0], size);
        lease_copy(l, got, false);
        ck_assert(memcmp(got, zero, size) == 0);

        /* Placed (no device named): the kept lease comes first too. */
        ck_assert(free_keep(a, id));
        ck_assert_int_eq(broker_alloc(&b, a, -1, size, NULL, &again, &q), 0);
        ck_assert_ptr_eq(again, l);
        ck_assert_ptr_null(l->label);

        /* Another size: a new lease, and the kept one stays kept for its own size. */
        ck_assert(free_keep(a, id));
        ck_assert_ptr_ne(alloc_ok(a, 2 * MiB), l);
        ck_assert(l->kept);
        ck_assert_uint_eq(a->user->leases, 2);
        free(want);
        free(got);
        free(zero);
}
END_TEST

/* Kept only as the only hold of its owner's process, once, read-write, not published or parked: else plain. */
START_TEST(test_keep_rules) {
        char id[LEASE_ID_LEN + 1];
        Caller *a, *a2, *bb;
        TokenText t;
        Lease *l;

        setup_broker();
        a = this_process(UID_A);
        a2 = new_process(UID_A);
        bb = new_process(UID_B);

        /* Two references (an Attach of its own): the Free drops one. */
        l = alloc_ok(a, 2 * MiB);
        memcpy(id, l->id, sizeof(id));
        t = share_ok(a, l, UID_ANY, false);
        attach_token_ok(a, &t, false);
        ck_assert(!free_keep(a, id));
        ck_assert(!l->kept);
        ck_assert_uint_eq(lease_find_hold(l, a->holder)->refs, 1);

        /* Another process holds it too (of the owner's user, or another's). */
        attach_token_ok(a2, &t, false);
        ck_assert(!free_keep(a, id));
        ck_assert_ptr_nonnull(find(id));
        ck_assert(free_keep(a2, id));                   /* now its only holder, of the owner's user: kept */
        ck_assert_uint_eq(find(id)->n_tokens, 0);
        ck_assert(!free_keep(a2, id));                  /* kept already: ends */
        ck_assert_ptr_null(find(id));

        /* A holder of another user, the last one, does not keep the owner's memory. */
        l = alloc_ok(a, 2 * MiB);
        memcpy(id, l->id, sizeof(id));
        t = share_ok(a, l, UID_B, false);
        attach_token_ok(bb, &t, false);
        ck_assert(!free_keep(a, id));
        ck_assert(!free_keep(bb, id));
        ck_assert_ptr_null(find(id));

        /* Nor the owner a lease another user held once: that process may map it still. */
        l = alloc_ok(a, 2 * MiB);
        memcpy(id, l->id, sizeof(id));
        t = share_ok(a, l, UID_B, false);
        attach_token_ok(bb, &t, false);
        ck_assert(!free_keep(bb, id));                  /* the other user's hold ends; the lease is foreign */
        ck_assert(l->foreign);
        ck_assert(!free_keep(a, id));
        ck_assert_ptr_null(find(id));

        /* A read-only hold (a read-only token's, in a process that did not hold the lease) never keeps. */
        l = alloc_ok(a, 2 * MiB);
        memcpy(id, l->id, sizeof(id));
        t = share_ok(a, l, UID_A, true);
        attach_token_ok(a2, &t, true);
        ck_assert(!free_keep(a, id));
        ck_assert(!free_keep(a2, id));                  /* read-only, and the last: ends */
        ck_assert_ptr_null(find(id));

        /* Published: the name outlives the hold. */
        l = alloc_ok(a, 2 * MiB);
        memcpy(id, l->id, sizeof(id));
        ck_assert_int_eq(broker_publish(&b, a, id, "w", NULL, 0, false), 0);
        ck_assert(!free_keep(a, id));
        ck_assert(!find(id)->kept);
        ck_assert_int_eq(unpublish(a, "w"), 0);
        ck_assert_ptr_null(find(id));

        /* Kept already: a second Free (keep or not) ends it. */
        l = alloc_ok(a, 2 * MiB);
        memcpy(id, l->id, sizeof(id));
        ck_assert(free_keep(a, id));
        ck_assert(!free_keep(a, id));
        ck_assert_ptr_null(find(id));
        ck_assert_uint_eq(a->user->leases, 0);
        ck_assert_uint_eq(b.leases.device_kept[0], 0);
}
END_TEST

/* A kept lease is nobody's to use: its tokens are revoked, every call but Free and Alloc finds nothing. */
START_TEST(test_keep_is_not_for_use) {
        char id[LEASE_ID_LEN + 1];
        UserQuota q = {};
        Hold *hold = NULL;
        Token *tok = NULL;
        Caller *a, *a2, *bb;
        TokenText t;
        bool parked;
        Lease *l;

        setup_broker_host(64 * MiB, false);
        a = this_process(UID_A);
        a2 = new_process(UID_A);
        bb = new_process(UID_B);
        l = alloc_ok(a, 4 * MiB);
        memcpy(id, l->id, sizeof(id));
        t = share_ok(a, l, UID_ANY, false);
        ck_assert(free_keep(a, id));
        ck_assert_uint_eq(l->n_tokens, 0);
        ck_assert_uint_eq(b.leases.by_token.n, 0);
        ck_assert_int_eq(attach_token(bb, t.s), BROKER_E_NO_SUCH_TOKEN);
        ck_assert_int_eq(attach_token(a2, t.s), BROKER_E_NO_SUCH_TOKEN);

        ck_assert_int_eq(broker_share(&b, a, id, UID_ANY, false, &tok), BROKER_E_NO_SUCH_LEASE);
        ck_assert_int_eq(broker_set_reclaimable(&b, a, id, 3), BROKER_E_NO_SUCH_LEASE);
        ck_assert_int_eq(broker_publish(&b, a, id, "w", NULL, 0, false), BROKER_E_NO_SUCH_LEASE);
        ck_assert_int_eq(park_call(a, id, &parked, &q), BROKER_E_NO_SUCH_LEASE);
        ck_assert_int_eq(unpark_call(a, id, &hold, &q), BROKER_E_NO_SUCH_LEASE);
        ck_assert_int_eq(broker_tokens(&b, a, id, NULL, NULL), BROKER_E_NO_SUCH_LEASE);
        ck_assert(l->kept);
        ck_assert_int_eq(l->reclaim.state, RECLAIM_MARKED);     /* SetReclaimable did not touch it */

        /* Another process of its user, and another user, asking for the size get leases of their own. */
        ck_assert_ptr_ne(alloc_ok(a2, 4 * MiB), l);
        ck_assert_ptr_ne(alloc_ok(bb, 4 * MiB), l);
        ck_assert(l->kept);
}
END_TEST

/* A kept lease ends with its process, like any hold; and the daemon stores it kept. */
START_TEST(test_keep_reap_and_store) {
        char id[LEASE_ID_LEN + 1], id2[LEASE_ID_LEN + 1];
        UserQuota q = {};
        Lease *l = NULL;
        Caller *a, *a2;
        TokenText t;

        setup_broker();
        a = this_process(UID_A);
        a2 = new_process(UID_A);
        memcpy(id2, alloc_ok(a2, 2 * MiB)->id, sizeof(id2));
        ck_assert(free_keep(a2, id2));
        kill_process(a2->holder->pid);
        ck_assert_uint_eq(broker_reap_holders(&b), 1);
        ck_assert_ptr_null(find(id2));
        ck_assert_uint_eq(b.leases.device_kept[0], 0);

        memcpy(id, alloc_ok(a, 4 * MiB)->id, sizeof(id));
        t = share_ok(a, find(id), UID_ANY, false);     /* a stored token, which keeping revokes */
        give_store();
        /* Keeping (its token revoked) and handing back are written ahead like every change. */
        ASSERT_NOT_STORED_THEN_MADE(broker_free(&b, a, id, true, NULL));
        ck_assert(find(id)->kept);
        ck_assert_ptr_null(lease_table_find_token(&b.leases, t.s));
        ASSERT_NOT_STORED_THEN_MADE(broker_alloc(&b, a, 0, 4 * MiB, "x", &l, &q));
        ck_assert_ptr_eq(l, find(id));
        ck_assert(!l->kept);
        ck_assert(free_keep(a, id));
        assert_stored_is_table();
}
END_TEST

/* Kept leases are asked back first, those of the waiting process too; a marked one of its own is not. */
START_TEST(test_keep_reclaimed_first) {
        char id[LEASE_ID_LEN + 1];
        Lease *picked[4], *marked, *mine, *theirs;
        Caller *a, *w;

        setup_broker();
        a = this_process(UID_A);
        w = new_process(UID_B);                 /* the process whose Alloc waits */
        a->holder->watch = &picked;             /* both watch (the manager's peer; not used here) */
        w->holder->watch = &picked;
        marked = alloc_ok(a, 2 * MiB);
        ck_assert_int_eq(broker_set_reclaimable(&b, a, marked->id, 0), 0);
        theirs = alloc_ok(a, 4 * MiB);
        mine = alloc_ok(w, 6 * MiB);
        memcpy(id, theirs->id, sizeof(id));
        ck_assert(free_keep(a, id));
        ck_assert(free_keep(w, mine->id));

        ck_assert_uint_eq(broker_reclaim_pick(&b, 0, 4 * MiB, w->holder, picked, 4), 1);
        ck_assert_ptr_eq(picked[0], theirs);
        ck_assert_uint_eq(broker_reclaim_pick(&b, 0, 12 * MiB, w->holder, picked, 4), 3);
        ck_assert_ptr_eq(picked[0], theirs);    /* kept, in the order kept */
        ck_assert_ptr_eq(picked[1], mine);      /* the waiter's own kept lease: its library answers */
        ck_assert_ptr_eq(picked[2], marked);
        ck_assert_int_eq(broker_set_reclaimable(&b, w, mine->id, -1), BROKER_E_NO_SUCH_LEASE);

        /* A process that does not watch is not asked. */
        a->holder->watch = NULL;
        ck_assert_uint_eq(broker_reclaim_pick(&b, 0, 12 * MiB, w->holder, picked, 4), 1);
        ck_assert_ptr_eq(picked[0], mine);
        w->holder->watch = NULL;

        /* Asked back, a kept lease is not handed out: its library's Free would end the new hold. */
        reclaim_ask(&b.leases.reclaim, theirs, UINT64_MAX);
        ck_assert_ptr_ne(alloc_ok(a, 4 * MiB), theirs);
        ck_assert(theirs->kept);
        ck_assert_int_eq(broker_free(&b, a, id, false, NULL), 0);       /* the answer: it ends */
        ck_assert_ptr_null(find(id));
}
END_TEST

/* An Alloc that asked for no wait waits for kept leases to come back, within MaxAllocWait=. */
START_TEST(test_keep_alloc_waits) {
        Caller *a;
        Lease *l;

        setup_broker();
        a = this_process(UID_A);
        ck_assert_uint_eq(broker_alloc_wait_usec(&b, 0, 0), 0);
        ck_assert_uint_eq(broker_alloc_wait_usec(&b, 7, 0), 7);
        l = alloc_ok(a, 2 * MiB);
        ck_assert(free_keep(a, l->id));
        ck_assert_uint_eq(broker_alloc_wait_usec(&b, 0, 0), b.kept_wait_usec);
        ck_assert_uint_eq(broker_alloc_wait_usec(&b, -1, 0), b.kept_wait_usec);
        ck_assert_uint_eq(broker_alloc_wait_usec(&b, 7, 0), 7);
        ck_assert_uint_eq(broker_alloc_wait_usec(&b, 0, SIZE_MAX), 0);
        b.max_alloc_wait_usec = 0;              /* MaxAllocWait=0: nobody waits */
        ck_assert_uint_eq(broker_alloc_wait_usec(&b, 0, 0), 0);
}
END_TEST

int main(void) {
        return run_suite(UNIT_SUITE("broker", teardown, test_tokens, test_names_cannot_be_planted,
                                    test_max_processes, test_alloc, test_alloc_no_device, test_alloc_too_large,
                                    test_alloc_too_many_slabs,
                                    test_alloc_quota_bytes, test_alloc_quota_leases, test_alloc_quota_is_per_user,
                                    test_alloc_no_memory, test_alloc_driver_error, test_free_not_held_is_not_found,
                                    test_free_counts_references, test_share, test_share_readonly_holder,
                                    test_share_tokens_max, test_revoke, test_revoke_needs_admin_flag,
                                    test_attach_token, test_attach_token_readonly, test_attach_token_revoked_or_ended,
                                    test_foreign_lease_slabs_are_released, test_attach_name,
                                    test_attach_name_readonly, test_publish, test_publish_not_owner,
                                    test_publish_name_in_use_and_has_name, test_publish_again_replaces_uids,
                                    test_unpublish, test_unpublish_ends_unheld_lease, test_list_what_the_caller_sees,
                                    test_list_all_needs_admin, test_list_stops_at_fn,
                                    test_list_cost_is_what_the_caller_sees, test_reap, test_reap_last_two_holders,
                                    test_not_stored_before_the_first_snapshot, test_write_ahead_every_operation,
                                    test_reap_not_stored_keeps_holds, test_reap_not_stored_second_holder,
                                    test_reap_holder_without_holds_needs_no_store, test_snapshot, test_park_unpark,
                                    test_park_every_holder, test_park_who, test_park_no_room,
                                    test_park_makes_host_off_the_loop, test_park_after_failed_making,
                                    test_park_without_host_memory, test_park_end,
                                    test_park_write_ahead, test_park_copies_off_the_loop,
                                    test_park_copy_fails_part_way, test_park_copy_undone,
                                    test_park_copy_not_reclaimed, test_park_copy_not_before_scrubs,
                                    test_park_after_undone_creates_nothing,
                                    test_unpark_copies_off_the_loop,
                                    test_unpark_copy_undone, test_park_not_reclaimed, test_keep_and_reuse, test_keep_rules,
                                    test_keep_is_not_for_use, test_keep_reap_and_store, test_keep_reclaimed_first,
                                    test_keep_alloc_waits)) == 0
                       ? EXIT_SUCCESS
                       : EXIT_FAILURE;
}
