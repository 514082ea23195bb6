/* SPDX-License-Identifier: MIT */

/*
 * The soak test: one daemon on the simulated device, many client processes
 * at once doing random allocations, frees, shares, attaches, publishes and
 * revokes, some of them killed with SIGKILL at random points, and an
 * invariant checker around it all.
 *
 * Each client (a forked child that opens the driver after the fork) checks
 * that every byte of every lease it gets from Alloc reads zero, fills it with
 * a word of its own, and reads the word back before it frees the lease; a
 * client that attaches someone else's lease checks the owner's word. Clients
 * offer their tokens and published names to the others on a board in shared
 * memory. When the test runs as root, a quarter of the clients run as nobody,
 * with small limits (vmmbroker.conf's [User:]), so leases cross users and
 * requests meet QuotaExceeded too.
 *
 * The parent keeps RUNNING clients alive until CLIENTS have run, kills the
 * doomed ones once they have reported a random number of operations, and
 * unpublishes what dead clients left published. At the end, with every client
 * gone and everything unpublished, the daemon must be back where it started:
 * its fd count, Status (nothing leased, nothing being scrubbed, the same
 * cache) and Users' accounting (every user's, when root). Allocations refused
 * for lack of room or quota, and attaches of leases that ended meanwhile, are
 * expected outcomes, counted; any other error fails the test.
 *
 * The cache is what a soak changes legitimately, so before each measurement
 * the parent flushes it the same way: it leases the whole capacity and frees
 * it (every other cached slab is evicted for it), then polls Status until the
 * scrub has completed and the fd count is steady. No sleeps: pipes, pidfds,
 * waitpid() and request/reply round trips order everything.
 *
 * Reproducible: the schedule (who runs as whom, what each client does, who is
 * killed after how many operations) comes from VMMB_SOAK_SEED (printed); the
 * exact instant a kill lands within an operation is up to the kernel.
 * VMMB_SOAK_CLIENTS, VMMB_SOAK_RUNNING and VMMB_SOAK_OPS scale it.
 */

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/pidfd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "codec.h"
#include "driver.h"
#include "harness.h"
#include "macro.h"
#include "rawclient.h"

#define MiB (UINT64_C(1) << 20)
#define GRANULE (2 * MiB)
#define CAPACITY "1G"                   /* the pool's capacity: small, so that the cache evicts */
#define MIN_SIZE (2 * MiB)
#define SIZE_CLASSES 4                  /* 2-4, 4-8, 8-16 and 16-32 MiB, equally likely */
#define MAX_SIZE (MIN_SIZE << SIZE_CLASSES)
#define MAX_HELD 4                      /* leases a client holds at once (made or attached) */
#define BOARD_PER_SLOT 4                /* tokens and names each running client offers */
#define KILL_PERCENT 30
#define NOBODY 65534
#define NOBODY_MAX_BYTES "160M"         /* nobody's limits (when the test runs as root) */
#define NOBODY_MAX_LEASES 10
#define DEFAULT_SEED UINT64_C(0x5eed)
#define DEFAULT_CLIENTS 72
#define DEFAULT_RUNNING 12
#define DEFAULT_OPS 40
#define HANG_TIMEOUT_MS 60000           /* nothing from any client for this long: a hang, the test fails */
#define STEADY_ROUNDS 20                /* round trips with the same fd count before the pool counts as settled */
#define TICK_US 1100000                 /* more than the daemon's tick: it closes released slabs' fds by then */

/* ---- the schedule's random numbers: splitmix64 ------------------------------------------------------ */

static uint64_t rnd(uint64_t *s) {
        uint64_t z = (*s += UINT64_C(0x9E3779B97F4A7C15));

        z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
        return z ^ (z >> 31);
}

static unsigned rnd_below(uint64_t *s, unsigned n) {
        return (unsigned)(rnd(s) % n);
}

/* ---- what the processes share: the board and the clients' counters ---------------------------------- */

enum { ENTRY_TOKEN = 1, ENTRY_NAME };

/* A token or a name offered to the other clients, with the word its lease holds and who may attach it. A
 * seqlock: odd while being written, 0 while empty. */
typedef struct Entry {
        uint64_t seq;
        int kind;
        char key[VMMB_LEASE_NAME_MAX + 1];
        uint32_t word;
        uint64_t size;
        bool anyone;                    /* a token without uid */
        unsigned n_uids;                /* otherwise these uids only */
        uid_t uids[2];
} Entry;

typedef enum Counter {
        C_ALLOC,
        C_ALLOC_NOMEM,                  /* OutOfMemory: an expected outcome */
        C_ALLOC_QUOTA,                  /* QuotaExceeded: the same */
        C_FREE,
        C_SHARE,
        C_SHARE_REFUSED,                /* QuotaExceeded ("tokens") */
        C_REVOKE,
        C_PUBLISH,
        C_UNPUBLISH,
        C_ATTACH_TOKEN,
        C_ATTACH_NAME,
        C_ATTACH_MISSED,                /* NoSuchToken or NoSuchName: the lease ended, revoked, unpublished */
        C_ATTACH_DENIED,                /* PermissionDenied: a token or name for another uid */
        C_CHECK,                        /* a held lease's word read back, not freeing it */
        C_RECONNECT,                    /* a new connection; the holds stay with the process */
        C_EXIT_HOLDING,                 /* leases still held when the client exited by itself */
        C_BYTES_LEASED,                 /* by Alloc */
        C_BYTES_ATTACHED,
        C_BYTES_ZERO,                   /* checked zero at lease time */
        C_BYTES_PATTERN,                /* checked holding their word */
        _C_MAX,
} Counter;

static const char *const counter_names[_C_MAX] = {
        [C_ALLOC] = "alloc",
        [C_ALLOC_NOMEM] = "alloc out of memory",
        [C_ALLOC_QUOTA] = "alloc over quota",
        [C_FREE] = "free",
        [C_SHARE] = "share",
        [C_SHARE_REFUSED] = "share refused",
        [C_REVOKE] = "revoke",
        [C_PUBLISH] = "publish",
        [C_UNPUBLISH] = "unpublish",
        [C_ATTACH_TOKEN] = "attach by token",
        [C_ATTACH_NAME] = "attach by name",
        [C_ATTACH_MISSED] = "attach missed",
        [C_ATTACH_DENIED] = "attach denied",
        [C_CHECK] = "check",
        [C_RECONNECT] = "reconnect",
        [C_EXIT_HOLDING] = "left held at exit",
};

typedef struct Stats {
        uint64_t n[_C_MAX];
        int failed;                     /* the client found something wrong (and said what on stderr) */
} Stats;

typedef struct Shared {
        Entry *board;                   /* [running][BOARD_PER_SLOT] */
        Stats *stats;                   /* [clients] */
} Shared;

static void entry_write(Entry *e, const Entry *in) {
        uint64_t s = __atomic_load_n(&e->seq, __ATOMIC_RELAXED);

        __atomic_store_n(&e->seq, s | 1, __ATOMIC_RELAXED);
        __atomic_thread_fence(__ATOMIC_RELEASE);
        e->kind = in->kind;
        memcpy(e->key, in->key, sizeof(e->key));
        e->word = in->word;
        e->size = in->size;
        e->anyone = in->anyone;
        e->n_uids = in->n_uids;
        memcpy(e->uids, in->uids, sizeof(e->uids));
        __atomic_store_n(&e->seq, (s | 1) + 1, __ATOMIC_RELEASE);
}

/* Copies an entry if it holds something and was not being written meanwhile. */
static bool entry_read(Entry *e, Entry *ret) {
        uint64_t s1 = __atomic_load_n(&e->seq, __ATOMIC_ACQUIRE);

        if (s1 == 0 || (s1 & 1) || e->kind == 0)
                return false;
        ret->kind = e->kind;
        memcpy(ret->key, e->key, sizeof(ret->key));
        ret->word = e->word;
        ret->size = e->size;
        ret->anyone = e->anyone;
        ret->n_uids = MIN(e->n_uids, ELEMENTSOF(e->uids));
        memcpy(ret->uids, e->uids, sizeof(ret->uids));
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        ret->key[sizeof(ret->key) - 1] = 0;
        return __atomic_load_n(&e->seq, __ATOMIC_RELAXED) == s1;
}

/* ---- a client ---------------------------------------------------------------------------------------- */

typedef struct Config {
        uint64_t seed;
        unsigned clients, running, ops;
        const char *socket;
        Shared sh;
} Config;

typedef struct ClientArgs {
        const Config *cfg;
        unsigned serial, slot;
        uid_t uid, other_uid;           /* other_uid: the uid of the other kind of client, or (uid_t)-1 */
        int progress_w;
} ClientArgs;

typedef struct Held {
        char id[VMMB_ID_MAX + 1];
        uint64_t size;
        size_t n;
        uint64_t sizes[FDPASS_MAX_FDS];
        CUdeviceptr va;
        uint32_t word;
        bool own;                       /* made by this client's Alloc: it may share and publish it */
        bool published;
        char name[64];
        char token[VMMB_TOKEN_MAX + 1]; /* the last token made for it, "" if none or revoked */
        int token_at, name_at;          /* where on the board they are offered, -1 if nowhere */
} Held;

typedef struct Client {
        const ClientArgs *a;
        uint64_t rng;
        VarlinkConn *conn;
        Gpu g;
        Held held[MAX_HELD];
        size_t n_held;
        unsigned counter;               /* for words and names */
        uint32_t *buf;                  /* MAX_SIZE, rounded up: where leases are read back */
        Stats *st;
} Client;

static bool is_error(const Reply *r, const char *name) {
        return r->error && strcmp(r->error, name) == 0;
}

/* A call whose only acceptable outcome is success. */
static int call_ok(Client *c, const char *method, const char *params, Reply *ret) {
        int k = call_text(c->conn, method, params, ret);

        CHILD_CHECK(k == 0, "%s: %s", method, strerror(-k));
        if (ret->error) {
                fprintf(stderr, "child %d: %s(%s): %s %s\n", (int)getpid(), method, params, ret->error,
                        json_object_to_json_string(ret->params));
                reply_done(ret);
                return 1;
        }
        return 0;
}

static uint32_t new_word(Client *c) {
        c->counter++;
        return (uint32_t)rnd(&c->rng) | 1;      /* never zero, or a lease that was not scrubbed could pass */
}

/* This client's places on the board. */
static Entry *board_entry(Client *c, unsigned slot, unsigned i) {
        return &c->a->cfg->sh.board[slot * BOARD_PER_SLOT + i];
}

/* Offers a token or name on the board, in one of this client's places (replacing what was there). */
static void offer(Client *c, Entry *e, const char *key, Held *h, int *at) {
        unsigned i = rnd_below(&c->rng, BOARD_PER_SLOT);

        snprintf(e->key, sizeof(e->key), "%s", key);
        e->word = h->word;
        e->size = h->size;
        entry_write(board_entry(c, c->a->slot, i), e);
        /* What was offered there before is no longer, whichever lease it was for. */
        for (size_t j = 0; j < c->n_held; j++) {
                if (c->held[j].token_at == (int)i)
                        c->held[j].token_at = -1;
                if (c->held[j].name_at == (int)i)
                        c->held[j].name_at = -1;
        }
        *at = (int)i;
}

/* Takes an offer back: attaches would mostly miss (the token revoked, the name unpublished, the lease ended). */
static void withdraw(Client *c, int *at) {
        if (*at < 0)
                return;
        entry_write(board_entry(c, c->a->slot, (unsigned)*at), &(Entry){});
        *at = -1;
}

static bool entry_allows(const Entry *e, uid_t uid) {
        for (unsigned i = 0; i < e->n_uids; i++)
                if (e->uids[i] == uid)
                        return true;
        return e->anyone;
}

/*
 * Reads a whole lease back and checks that every 32-bit word is `word` (gpu_verify(), with one buffer for
 * the client's life: a fresh one for each read costs more in page faults than the read itself). The buffer
 * is filled with something else first, so that a copy that does nothing shows.
 */
static int verify(Client *c, const Held *h, uint32_t word) {
        CUresult r;

        memset(c->buf, (int)(~word & 0xFF) ^ 0x5A, h->size);       /* a byte that word cannot repeat */
        r = c->g.cu->cuMemcpyDtoH(c->buf, h->va, h->size);
        CHILD_CHECK(r == CUDA_SUCCESS, "cuMemcpyDtoH: %s", cuda_result_name(c->g.cu, r));
        /* Every word equals the next and the first is `word`: one memcmp(), fast under the sanitizers too. */
        if (c->buf[0] == word && memcmp(c->buf, c->buf + 1, h->size - 4) == 0)
                return 0;
        for (uint64_t i = 0; i < h->size / 4; i++)
                CHILD_CHECK(c->buf[i] == word, "lease %s (%s, %" PRIu64 " bytes): word %" PRIu64 " is 0x%08x, "
                            "expected 0x%08x", h->id, h->own ? "made here" : "attached", h->size, i, c->buf[i], word);
        return 0;
}

/* Maps a lease just received and adds it to the held ones. */
static int hold(Client *c, Reply *r, bool own, Held **ret) {
        TestLease l;
        Held *h = &c->held[c->n_held];
        int k;

        k = lease_take(r, &l);
        CHILD_CHECK(k == 0, "lease in the reply: %s", strerror(-k));
        *h = (Held){ .size = l.size, .n = l.n, .own = own, .token_at = -1, .name_at = -1 };
        memcpy(h->id, l.id, sizeof(h->id));
        memcpy(h->sizes, l.sizes, sizeof(h->sizes));
        k = gpu_map(&c->g, &l, &h->va);
        test_lease_close(&l);           /* the mapping keeps the memory */
        CHILD_CHECK(k == 0, "map lease %s", h->id);
        c->n_held++;
        *ret = h;
        return 0;
}

static int op_alloc(Client *c) {
        /* Log-uniform: a power-of-two range from MIN_SIZE up to MAX_SIZE, then a size in it. */
        uint64_t lo = MIN_SIZE << rnd_below(&c->rng, SIZE_CLASSES), size = lo + rnd(&c->rng) % (lo + 1);
        char params[64];
        CUresult cr;
        Held *h;
        Reply r;
        int k;

        if (rnd_below(&c->rng, 2))
                size = ALIGN_UP(size, GRANULE);         /* half exact, half rounded up by the daemon */
        snprintf(params, sizeof(params), "{\"size\": %" PRIu64 "}", size);
        k = call_text(c->conn, VMMB_METHOD_ALLOC, params, &r);
        CHILD_CHECK(k == 0, "Alloc: %s", strerror(-k));
        if (is_error(&r, VMMB_ERROR_OUT_OF_MEMORY) || is_error(&r, VMMB_ERROR_QUOTA_EXCEEDED)) {
                c->st->n[is_error(&r, VMMB_ERROR_OUT_OF_MEMORY) ? C_ALLOC_NOMEM : C_ALLOC_QUOTA]++;
                reply_done(&r);
                return 0;
        }
        CHILD_CHECK(!r.error, "Alloc(%" PRIu64 "): %s %s", size, r.error, json_object_to_json_string(r.params));
        k = hold(c, &r, true, &h);
        reply_done(&r);
        if (k != 0)
                return k;
        CHILD_CHECK(h->size == ALIGN_UP(size, GRANULE), "Alloc(%" PRIu64 ") leased %" PRIu64, size, h->size);
        c->st->n[C_ALLOC]++;
        c->st->n[C_BYTES_LEASED] += h->size;
        /* Every byte of a new lease reads zero, whoever had its slabs before. */
        if (verify(c, h, 0) != 0) {
                fprintf(stderr, "child %d: lease %s was not zero when leased\n", (int)getpid(), h->id);
                return 1;
        }
        c->st->n[C_BYTES_ZERO] += h->size;
        h->word = new_word(c);
        cr = c->g.cu->cuMemsetD32(h->va, h->word, h->size / 4);
        CHILD_CHECK(cr == CUDA_SUCCESS, "cuMemsetD32: %s", cuda_result_name(c->g.cu, cr));
        return 0;
}

static int check(Client *c, Held *h) {
        if (verify(c, h, h->word) != 0)
                return 1;
        c->st->n[C_BYTES_PATTERN] += h->size;
        return 0;
}

static int unpublish(Client *c, Held *h) {
        char params[128];
        Reply r;

        snprintf(params, sizeof(params), "{\"name\": \"%s\"}", h->name);
        if (call_ok(c, VMMB_METHOD_UNPUBLISH, params, &r) != 0)
                return 1;
        reply_done(&r);
        h->published = false;
        withdraw(c, &h->name_at);
        c->st->n[C_UNPUBLISH]++;
        return 0;
}

/* Checks a held lease's word, unmaps it and frees it (unpublishing it first, sometimes, when it is published). */
static int op_free(Client *c, size_t i) {
        Held *h = &c->held[i];
        char params[128];
        Reply r;
        int k;

        if (check(c, h) != 0)
                return 1;
        k = cuda_unmap(c->g.cu, h->va, h->sizes, h->n);
        CHILD_CHECK(k == 0, "cuda_unmap: %s", strerror(-k));
        if (h->published && rnd_below(&c->rng, 2) && unpublish(c, h) != 0)
                return 1;
        snprintf(params, sizeof(params), "{\"id\": \"%s\"}", h->id);
        if (call_ok(c, VMMB_METHOD_FREE, params, &r) != 0)
                return 1;
        reply_done(&r);
        c->st->n[C_FREE]++;
        if (!h->published)              /* the lease ends unless another process holds it */
                withdraw(c, &h->token_at);
        c->held[i] = c->held[--c->n_held];
        return 0;
}

/* One of the leases this client made, or NULL. */
static Held *pick_own(Client *c) {
        size_t n = 0, idx[MAX_HELD];

        for (size_t i = 0; i < c->n_held; i++)
                if (c->held[i].own)
                        idx[n++] = i;
        return n == 0 ? NULL : &c->held[idx[rnd_below(&c->rng, (unsigned)n)]];
}

static int op_share(Client *c, Held *h) {
        char params[256], uid[32] = "";
        unsigned who = rnd_below(&c->rng, 3);
        bool readonly = rnd_below(&c->rng, 2);
        Entry e = { .kind = ENTRY_TOKEN, .anyone = true };
        const char *token;
        Reply r;

        /* A token for anyone, for this uid only, or for the other kind of client's uid. */
        if (who == 1 || (who == 2 && c->a->other_uid != (uid_t)-1)) {
                e = (Entry){ .kind = ENTRY_TOKEN, .n_uids = 1, .uids = { who == 1 ? c->a->uid : c->a->other_uid } };
                snprintf(uid, sizeof(uid), ", \"uid\": %u", (unsigned)e.uids[0]);
        }
        snprintf(params, sizeof(params), "{\"id\": \"%s\", \"readonly\": %s%s}", h->id, readonly ? "true" : "false",
                 uid);
        CHILD_CHECK(call_text(c->conn, VMMB_METHOD_SHARE, params, &r) == 0, "Share");
        if (is_error(&r, VMMB_ERROR_QUOTA_EXCEEDED)) {
                c->st->n[C_SHARE_REFUSED]++;
                reply_done(&r);
                return 0;
        }
        CHILD_CHECK(!r.error, "Share(%s): %s %s", params, r.error, json_object_to_json_string(r.params));
        token = reply_str(&r, "token");
        CHILD_CHECK(token && strlen(token) < sizeof(h->token), "Share: no token");
        snprintf(h->token, sizeof(h->token), "%s", token);
        reply_done(&r);
        offer(c, &e, h->token, h, &h->token_at);
        c->st->n[C_SHARE]++;
        return 0;
}

static int op_revoke(Client *c, Held *h) {
        char params[128];
        Reply r;

        snprintf(params, sizeof(params), "{\"token\": \"%s\"}", h->token);
        if (call_ok(c, VMMB_METHOD_REVOKE, params, &r) != 0)
                return 1;
        reply_done(&r);
        h->token[0] = 0;
        withdraw(c, &h->token_at);
        c->st->n[C_REVOKE]++;
        return 0;
}

static int op_publish(Client *c, Held *h) {
        char params[256], uids[48] = "";
        bool readonly = rnd_below(&c->rng, 2);
        Entry e = { .kind = ENTRY_NAME, .n_uids = 1, .uids = { c->a->uid } };    /* the owner's uid may attach */
        Reply r;

        /* The parent unpublishes what a client left published once it is gone, by this prefix. */
        snprintf(h->name, sizeof(h->name), "soak-%u-%u", c->a->serial, c->counter++);
        if (c->a->other_uid != (uid_t)-1 && rnd_below(&c->rng, 2)) {
                e.uids[e.n_uids++] = c->a->other_uid;
                snprintf(uids, sizeof(uids), ", \"uids\": [%u]", (unsigned)c->a->other_uid);
        }
        snprintf(params, sizeof(params), "{\"id\": \"%s\", \"name\": \"%s\", \"readonly\": %s%s}", h->id, h->name,
                 readonly ? "true" : "false", uids);
        if (call_ok(c, VMMB_METHOD_PUBLISH, params, &r) != 0)
                return 1;
        reply_done(&r);
        h->published = true;
        offer(c, &e, h->name, h, &h->name_at);
        c->st->n[C_PUBLISH]++;
        return 0;
}

/* Attaches a lease another client (or this one) offered, and checks that it holds its word. */
static int op_attach(Client *c) {
        unsigned n = c->a->cfg->running * BOARD_PER_SLOT, start = rnd_below(&c->rng, n), i;
        bool readonly = rnd_below(&c->rng, 2);
        char params[256];
        Entry e;
        Held *h;
        Reply r;
        int k;

        /* The first offer on the board from a random place on. */
        for (i = 0; i < n; i++)
                if (entry_read(&c->a->cfg->sh.board[(start + i) % n], &e))
                        break;
        if (i == n)
                return op_alloc(c);
        snprintf(params, sizeof(params), "{\"%s\": \"%s\", \"readonly\": %s}", e.kind == ENTRY_TOKEN ? "token" : "name",
                 e.key, readonly ? "true" : "false");
        k = call_text(c->conn, VMMB_METHOD_ATTACH, params, &r);
        CHILD_CHECK(k == 0, "Attach: %s", strerror(-k));
        if (is_error(&r, VMMB_ERROR_NO_SUCH_TOKEN) || is_error(&r, VMMB_ERROR_NO_SUCH_NAME)) {
                c->st->n[C_ATTACH_MISSED]++;
                reply_done(&r);
                return 0;
        }
        /* Denied exactly when the token or name was not for this uid. */
        if (is_error(&r, VMMB_ERROR_PERMISSION_DENIED)) {
                reply_done(&r);
                CHILD_CHECK(!entry_allows(&e, c->a->uid), "Attach(%s) as uid %u: PermissionDenied, but it was "
                            "offered to this uid", params, (unsigned)c->a->uid);
                c->st->n[C_ATTACH_DENIED]++;
                return 0;
        }
        CHILD_CHECK(!r.error, "Attach(%s): %s %s", params, r.error, json_object_to_json_string(r.params));
        if (!entry_allows(&e, c->a->uid)) {
                fprintf(stderr, "child %d: Attach(%s) as uid %u succeeded, but the lease was offered only to uid "
                        "%u%s\n", (int)getpid(), params, (unsigned)c->a->uid, (unsigned)e.uids[0],
                        e.n_uids > 1 ? " and another" : "");
                reply_done(&r);
                return 1;
        }
        k = hold(c, &r, false, &h);
        reply_done(&r);
        if (k != 0)
                return k;
        CHILD_CHECK(h->size == e.size, "Attach(%s): %" PRIu64 " bytes, offered with %" PRIu64, params, h->size,
                    e.size);
        h->word = e.word;
        c->st->n[e.kind == ENTRY_TOKEN ? C_ATTACH_TOKEN : C_ATTACH_NAME]++;
        c->st->n[C_BYTES_ATTACHED] += h->size;
        return check(c, h);
}

static int op_reconnect(Client *c) {
        int k;

        c->conn = varlink_conn_free(c->conn);
        k = conn_open(c->a->cfg->socket, &c->conn);
        CHILD_CHECK(k == 0, "connect: %s", strerror(-k));
        c->st->n[C_RECONNECT]++;
        return 0;
}

static int client_op(Client *c) {
        unsigned p = rnd_below(&c->rng, 100);
        Held *own = pick_own(c);

        if (c->n_held == 0)
                return p < 80 ? op_alloc(c) : op_attach(c);
        if (p < 25)
                return c->n_held < MAX_HELD ? op_alloc(c) : op_free(c, rnd_below(&c->rng, (unsigned)c->n_held));
        if (p < 50)
                return op_free(c, rnd_below(&c->rng, (unsigned)c->n_held));
        if (p < 65)
                return c->n_held < MAX_HELD ? op_attach(c) : op_free(c, rnd_below(&c->rng, (unsigned)c->n_held));
        if (p < 75 && own)
                return op_share(c, own);
        if (p < 81 && own)
                return own->published ? unpublish(c, own) : op_publish(c, own);
        if (p < 85 && own && own->token[0])
                return op_revoke(c, own);
        if (p < 98) {
                Held *h = &c->held[rnd_below(&c->rng, (unsigned)c->n_held)];

                if (check(c, h) != 0)
                        return 1;
                c->st->n[C_CHECK]++;
                return 0;
        }
        return op_reconnect(c);
}

static int client_run(Client *c) {
        const ClientArgs *a = c->a;
        int k;

        CHILD_CHECK(close_all_but(&a->progress_w, 1) == 0, "close fds");
        c->buf = malloc(ALIGN_UP(MAX_SIZE, GRANULE));
        CHILD_CHECK(c->buf, "out of memory");
        /* The driver first: a client that becomes nobody may not be able to read the library's directory. */
        CHILD_CHECK(gpu_open(&c->g) == 0, "no driver");
        if (a->uid != getuid())
                CHILD_CHECK(setgroups(0, NULL) == 0 && setgid(a->uid) == 0 && setuid(a->uid) == 0,
                            "cannot become uid %u: %m", (unsigned)a->uid);
        k = conn_open(a->cfg->socket, &c->conn);
        CHILD_CHECK(k == 0, "connect: %s", strerror(-k));
        for (unsigned i = 0; i < a->cfg->ops; i++) {
                if (client_op(c) != 0)
                        return 1;
                CHILD_CHECK(pipe_put(a->progress_w, '.') == 0, "progress pipe");
        }
        /* Half of the clients free everything, checking it; the others exit holding their leases. */
        if (rnd_below(&c->rng, 2)) {
                while (c->n_held > 0)
                        if (op_free(c, c->n_held - 1) != 0)
                                return 1;
        } else
                c->st->n[C_EXIT_HOLDING] += c->n_held;
        return 0;
}

static int client_main(void *arg) {
        const ClientArgs *a = arg;
        Client c = { .a = a, .rng = a->cfg->seed ^ (UINT64_C(0xC2B2AE3D27D4EB4F) * (a->serial + 1)),
                     .st = &a->cfg->sh.stats[a->serial] };
        int k;

        k = client_run(&c);
        if (k != 0)
                c.st->failed = 1;
        varlink_conn_free(c.conn);
        free(c.buf);
        return k;
}

/* ---- the parent's checks ----------------------------------------------------------------------------- */

static unsigned failures;

_printf_(1, 2) static void fail(const char *fmt, ...) {
        va_list ap;

        fputs("FAIL: ", stdout);
        va_start(ap, fmt);
        vprintf(fmt, ap);
        va_end(ap);
        fputc('\n', stdout);
        fflush(stdout);
        failures++;
}

/* Exits at once (the harness stops the daemon and kills the children as the process exits). */
#define REQUIRE(cond, ...)                                                                                      \
        do {                                                                                                    \
                if (!(cond)) {                                                                                  \
                        fail(__VA_ARGS__);                                                                      \
                        exit(EXIT_FAILURE);                                                                     \
                }                                                                                               \
        } while (0)

static uint64_t env_uint(const char *name, uint64_t def, uint64_t min, uint64_t max) {
        const char *v = getenv(name);
        char *end;
        uint64_t x;

        if (!v || !*v)
                return def;
        errno = 0;
        x = strtoull(v, &end, 0);
        REQUIRE(errno == 0 && *end == 0 && x >= min && x <= max, "%s=%s: not a number from %" PRIu64 " to %" PRIu64,
                name, v, min, max);
        return x;
}

/* What must come back after the soak. */
typedef struct Snapshot {
        int fds;
        WireDevice dev;
        char *users;                    /* Users' reply as JSON text */
} Snapshot;

static void call_or_die(VarlinkConn *ctl, const char *method, const char *params, Reply *ret) {
        int k = call_text(ctl, method, params, ret);

        REQUIRE(k == 0, "%s(%s): %s", method, params ?: "", strerror(-k));
        REQUIRE(!ret->error, "%s(%s): %s %s", method, params ?: "", ret->error,
                json_object_to_json_string(ret->params));
}

/* Every lease (every one the caller's uid can see, when not root). */
static void list_all(VarlinkConn *ctl, ListReply *ret) {
        Reply r;
        int k;

        call_or_die(ctl, VMMB_METHOD_LIST, geteuid() == 0 ? "{\"all\": true}" : "{}", &r);
        k = list_reply_decode(r.params, ret, NULL);
        REQUIRE(k == 0, "List's reply: %s", strerror(-k));
        reply_done(&r);
}

/* Unpublishes the names that begin with prefix (every name for ""). Returns how many. */
static unsigned unpublish_prefix(VarlinkConn *ctl, const char *prefix) {
        ListReply l = {};
        unsigned n = 0;

        list_all(ctl, &l);
        for (size_t i = 0; i < l.n_leases; i++) {
                char params[256];
                Reply r;

                if (!l.leases[i].name || strncmp(l.leases[i].name, prefix, strlen(prefix)) != 0)
                        continue;
                /* As root, another user's name is OWNER/NAME. */
                snprintf(params, sizeof(params), "{\"name\": \"%" PRId64 "/%s\"}", l.leases[i].uid,
                         l.leases[i].name);
                call_or_die(ctl, VMMB_METHOD_UNPUBLISH, params, &r);
                reply_done(&r);
                n++;
        }
        list_reply_done(&l);
        return n;
}

static WireDevice status(VarlinkConn *ctl) {
        WireDevice d;
        int k = harness_status_on(ctl, &d);

        REQUIRE(k == 0, "Status: %s", strerror(-k));
        return d;
}


static uint64_t now_us(void) {
        struct timespec ts;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000 + (uint64_t)ts.tv_nsec / 1000;
}

/* User and system CPU time of a process so far, in seconds; 0 if unknown. */
static double cpu_seconds(pid_t pid) {
        unsigned long long utime = 0, stime = 0;
        char path[64], buf[1024], *p;
        ssize_t n;
        int fd;

        snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
        fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
                return 0;
        n = read(fd, buf, sizeof(buf) - 1);
        safe_close(fd);
        if (n <= 0)
                return 0;
        buf[n] = 0;
        p = strrchr(buf, ')');          /* after the command name, which may hold spaces */
        if (!p || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &utime, &stime) != 2)
                return 0;
        return (double)(utime + stime) / (double)sysconf(_SC_CLK_TCK);
}

/* Users' reply as text: every user's (only ours when not root). */
static char *users(VarlinkConn *ctl) {
        Reply r;
        char *s;

        call_or_die(ctl, VMMB_METHOD_USERS, geteuid() == 0 ? "{\"all\": true}" : "{}", &r);
        s = strdup(json_object_to_json_string_ext(r.params, JSON_C_TO_STRING_PLAIN));
        REQUIRE(s, "out of memory");
        reply_done(&r);
        return s;
}

/*
 * Brings the pool to the same state whatever the soak left in its cache: leases the whole capacity (which
 * evicts every other cached slab) and frees it, then makes Status round trips until its scrub has completed
 * and the daemon's fd count has not moved for a few of them, counted only from a second after the Free (the
 * daemon closes released slabs' fds when it is idle, which these round trips may never let it be, and at
 * least once a second). Then takes the snapshot.
 */
static void settle(const Harness *h, VarlinkConn *ctl, Snapshot *ret) {
        uint64_t deadline = now_us() + (uint64_t)HANG_TIMEOUT_MS * 1000;
        WireDevice d = status(ctl);
        char params[128];
        TestLease l;
        uint64_t freed;
        Reply r;
        int k, fds = -1, steady = 0;

        /* Scrubs still running hold room: the lease must wait for them. */
        while (d.scrubbing > 0) {
                REQUIRE(now_us() < deadline, "scrubs did not complete in %d s: scrubbing %" PRIu64,
                        HANG_TIMEOUT_MS / 1000, d.scrubbing);
                d = status(ctl);
        }
        snprintf(params, sizeof(params), "{\"size\": %" PRIu64 "}", d.capacity);
        call_or_die(ctl, VMMB_METHOD_ALLOC, params, &r);
        k = lease_take(&r, &l);
        REQUIRE(k == 0, "Alloc's lease: %s", strerror(-k));
        reply_done(&r);
        test_lease_close(&l);
        snprintf(params, sizeof(params), "{\"id\": \"%s\"}", l.id);
        call_or_die(ctl, VMMB_METHOD_FREE, params, &r);
        reply_done(&r);
        freed = now_us();
        while (steady < STEADY_ROUNDS) {
                int n;

                REQUIRE(now_us() < deadline, "the pool did not settle in %d s: scrubbing %" PRIu64 ", fd count %d",
                        HANG_TIMEOUT_MS / 1000, d.scrubbing, fds);
                d = status(ctl);
                n = harness_fd_count(h->pid);
                REQUIRE(n > 0, "cannot count the daemon's fds");
                /* Back-to-back round trips may keep the daemon from ever being idle: count only once its
                 * tick (which closes released slabs' fds whatever the load) has run since the Free. */
                steady = d.scrubbing == 0 && n == fds && now_us() >= freed + TICK_US ? steady + 1 : 0;
                fds = n;
        }
        *ret = (Snapshot){ .fds = fds, .dev = d, .users = users(ctl) };
}

/*
 * The limits: the test's own uid may hold the whole capacity (settle() leases all of it); nobody's clients
 * get little room and few leases, so that they meet QuotaExceeded while others are being killed.
 */
static void write_config(char *path) {
        int fd = mkstemps(path, 5);
        FILE *f;

        REQUIRE(fd >= 0, "mkstemps: %m");
        f = fdopen(fd, "w");
        REQUIRE(f, "fdopen: %m");
        fprintf(f, "[User:%u]\nMaxBytes=100%%\n", (unsigned)getuid());
        if (geteuid() == 0)
                fprintf(f, "[User:%u]\nMaxBytes=%s\nMaxLeases=%u\n", NOBODY, NOBODY_MAX_BYTES, NOBODY_MAX_LEASES);
        REQUIRE(fclose(f) == 0, "cannot write %s: %m", path);
}

/* ---- the parent: running the clients ----------------------------------------------------------------- */

typedef struct Slot {
        pid_t pid;                      /* 0: free */
        int pidfd, progress_r;
        unsigned serial, progress, kill_at;     /* kill_at: UINT_MAX for a client left to finish */
        bool killed;
} Slot;

typedef struct Run {
        const Config *cfg;
        const Harness *h;
        VarlinkConn *ctl;
        uint64_t rng;
        Slot *slots;
        unsigned spawned, live, reaped, killed, nobody, doomed_finished, unpublished;
        unsigned *retired;              /* serials reaped, in order: their names are unpublished later */
} Run;

static void spawn(Run *run, Slot *s) {
        const Config *cfg = run->cfg;
        bool root = geteuid() == 0;
        ClientArgs a = { .cfg = cfg, .serial = run->spawned, .slot = (unsigned)(s - run->slots),
                         .uid = getuid(), .other_uid = (uid_t)-1 };
        int p[2];

        if (root) {
                if (rnd_below(&run->rng, 4) == 0) {
                        a.uid = NOBODY;
                        run->nobody++;
                }
                a.other_uid = a.uid == 0 ? NOBODY : 0;
        }
        REQUIRE(pipe2(p, O_CLOEXEC) == 0, "pipe: %m");
        a.progress_w = p[1];
        *s = (Slot){ .serial = run->spawned, .progress_r = p[0], .kill_at = UINT_MAX };
        if (rnd_below(&run->rng, 100) < KILL_PERCENT)
                s->kill_at = rnd_below(&run->rng, cfg->ops + 1);
        s->pid = harness_fork(client_main, &a);
        REQUIRE(s->pid > 0, "fork: %m");
        safe_close(p[1]);
        s->pidfd = pidfd_open(s->pid, 0);
        REQUIRE(s->pidfd >= 0, "pidfd_open: %m");
        run->spawned++;
        run->live++;
}

static void kill_slot(Slot *s) {
        /* ESRCH: it has exited already (its pidfd tells the loop). */
        REQUIRE(pidfd_send_signal(s->pidfd, SIGKILL, NULL, 0) == 0 || errno == ESRCH, "pidfd_send_signal: %m");
        s->killed = true;
}

static void reap(Run *run, Slot *s) {
        const Stats *st = &run->cfg->sh.stats[s->serial];
        int status = harness_wait(s->pid);

        if (status == 128 + SIGKILL && s->killed)
                run->killed++;
        else if (status == 0 && s->killed)
                run->doomed_finished++;         /* it finished before the signal came */
        else if (status != 0 || st->failed)
                fail("client %u (pid %d) exited with status %d%s (its stderr above says why)", s->serial,
                     (int)s->pid, status, st->failed ? ", reporting a failure" : "");
        safe_close(s->pidfd);
        safe_close(s->progress_r);
        run->retired[run->reaped++] = s->serial;
        run->live--;
        *s = (Slot){};

        /* What a client left published stays attachable for a while after it is gone, then is unpublished. */
        if (run->reaped > run->cfg->running) {
                char prefix[32];

                snprintf(prefix, sizeof(prefix), "soak-%u-", run->retired[run->reaped - run->cfg->running - 1]);
                run->unpublished += unpublish_prefix(run->ctl, prefix);
        }
}

/* Reads a client's progress and kills it when it has done as many operations as it was given. */
static void progress(Slot *s) {
        char buf[256];
        ssize_t n = read(s->progress_r, buf, sizeof(buf));

        REQUIRE(n >= 0 || errno == EINTR || errno == EAGAIN, "progress pipe: %m");
        if (n == 0) {                   /* it exited: its pidfd says so too */
                s->progress_r = safe_close(s->progress_r);
                return;
        }
        if (n > 0)
                s->progress += (unsigned)n;
        if (!s->killed && s->progress >= s->kill_at)
                kill_slot(s);
}

static void run_clients(Run *run) {
        const Config *cfg = run->cfg;
        struct pollfd *p = calloc(2 * cfg->running, sizeof(*p));

        REQUIRE(p, "out of memory");
        while (run->spawned < cfg->clients || run->live > 0) {
                size_t n = 0;
                int k;

                for (unsigned i = 0; i < cfg->running && run->spawned < cfg->clients; i++)
                        if (run->slots[i].pid == 0) {
                                spawn(run, &run->slots[i]);
                                if (run->slots[i].kill_at == 0)
                                        kill_slot(&run->slots[i]);
                        }
                for (unsigned i = 0; i < cfg->running; i++) {
                        p[2 * i] = (struct pollfd){ .fd = run->slots[i].pid ? run->slots[i].progress_r : -1,
                                                    .events = POLLIN };
                        p[2 * i + 1] = (struct pollfd){ .fd = run->slots[i].pid ? run->slots[i].pidfd : -1,
                                                        .events = POLLIN };
                        n += 2;
                }
                k = poll(p, n, HANG_TIMEOUT_MS);
                if (k < 0 && errno == EINTR)
                        continue;
                REQUIRE(k >= 0, "poll: %m");
                REQUIRE(k > 0, "no client did anything for %d s: a hang", HANG_TIMEOUT_MS / 1000);
                for (unsigned i = 0; i < cfg->running; i++) {
                        Slot *s = &run->slots[i];

                        if (s->pid == 0)
                                continue;
                        if (p[2 * i].fd >= 0 && p[2 * i].revents)
                                progress(s);
                        /* Once its progress pipe is drained, so that every operation it reported is counted. */
                        if (p[2 * i + 1].revents && s->progress_r < 0)
                                reap(run, s);
                }
        }
        free(p);
}

static double gib(uint64_t b) {
        return (double)b / (double)(UINT64_C(1) << 30);
}

/* What the clients did, from their counters: the numbers docs/robustness.md quotes. */
static void summary(const Run *run, uint64_t usec) {
        const Config *cfg = run->cfg;
        Stats total = {};
        uint64_t ops = 0;

        for (unsigned i = 0; i < cfg->clients; i++)
                for (int c = 0; c < _C_MAX; c++)
                        total.n[c] += cfg->sh.stats[i].n[c];
        for (int c = 0; c < C_EXIT_HOLDING; c++)
                ops += total.n[c];
        printf("soak: %u clients (%u as nobody), %u killed with SIGKILL (%u more were doomed but finished first)\n",
               cfg->clients, run->nobody, run->killed, run->doomed_finished);
        printf("soak: %" PRIu64 " operations:", ops);
        for (int c = 0; c < C_BYTES_LEASED; c++)
                printf("%s %s %" PRIu64, c == 0 ? "" : ",", counter_names[c], total.n[c]);
        printf("; names unpublished by the test: %u\n", run->unpublished);
        printf("soak: bytes leased %.2f GiB, attached %.2f GiB; checked zero at lease time %.2f GiB, checked "
               "holding their word %.2f GiB\n", gib(total.n[C_BYTES_LEASED]), gib(total.n[C_BYTES_ATTACHED]),
               gib(total.n[C_BYTES_ZERO]), gib(total.n[C_BYTES_PATTERN]));
        printf("soak: the clients ran for %.1f s\n", (double)usec / 1e6);
}

/* ---- the test ------------------------------------------------------------------------------------------ */

static void check_back(const Snapshot *a, const Snapshot *b) {
        const WireDevice *x = &a->dev, *y = &b->dev;

        printf("soak: after: daemon fds %d (before: %d); leased %" PRIu64 ", leases %" PRIu64 ", scrubbing %" PRIu64
               ", cached %" PRIu64 " (before: %" PRIu64 ")\n", b->fds, a->fds, y->leased, y->leases, y->scrubbing,
               y->cached, x->cached);
        if (b->fds != a->fds)
                fail("the daemon has %d fds open, %d before the soak", b->fds, a->fds);
        if (y->leased != 0 || y->leases != 0 || y->scrubbing != 0)
                fail("Status after the soak: leased %" PRIu64 ", leases %" PRIu64 ", scrubbing %" PRIu64, y->leased,
                     y->leases, y->scrubbing);
        if (y->cached != x->cached || y->capacity != x->capacity || y->total != x->total)
                fail("Status after the soak: cached %" PRIu64 " of %" PRIu64 " (before: %" PRIu64 " of %" PRIu64 ")",
                     y->cached, y->capacity, x->cached, x->capacity);
        if (strcmp(a->users, b->users) != 0)
                fail("Users after the soak:\n  %s\nbefore:\n  %s", b->users, a->users);
        else
                printf("soak: Users: as before: %s\n", b->users);
}

int main(void) {
        _cleanup_(varlink_conn_freep) VarlinkConn *ctl = NULL;
        Config cfg = {};
        Snapshot before, after;
        ListReply l = {};
        Harness h;
        Run run = {};
        uint64_t start, t0, t1;
        char config[] = "/tmp/vmmb-soak-XXXXXX.conf";
        size_t board_size, stats_size;
        void *shm;
        int k;

        setvbuf(stdout, NULL, _IOLBF, 0);
        start = now_us();
        cfg.seed = env_uint("VMMB_SOAK_SEED", DEFAULT_SEED, 0, UINT64_MAX);
        cfg.clients = (unsigned)env_uint("VMMB_SOAK_CLIENTS", DEFAULT_CLIENTS, 1, 1000000);
        cfg.running = (unsigned)env_uint("VMMB_SOAK_RUNNING", DEFAULT_RUNNING, 1, 50);
        cfg.ops = (unsigned)env_uint("VMMB_SOAK_OPS", DEFAULT_OPS, 1, 1000000);
        printf("soak: seed %#" PRIx64 " (VMMB_SOAK_SEED=%#" PRIx64 " reproduces it): %u clients, %u at a time, %u "
               "operations each, %d%% killed with SIGKILL\n", cfg.seed, cfg.seed, cfg.clients, cfg.running, cfg.ops,
               KILL_PERCENT);

        board_size = (size_t)cfg.running * BOARD_PER_SLOT * sizeof(Entry);
        stats_size = (size_t)cfg.clients * sizeof(Stats);
        shm = mmap(NULL, board_size + stats_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        REQUIRE(shm != MAP_FAILED, "mmap: %m");
        cfg.sh = (Shared){ .board = shm, .stats = (Stats *)((char *)shm + board_size) };

        write_config(config);
        k = harness_start(&h, (const char *const[]){ "--capacity", CAPACITY, "--config", config, NULL });
        unlink(config);
        REQUIRE(k == 0, "cannot start the daemon: %s", strerror(-k));
        cfg.socket = h.socket;
        if (geteuid() == 0) {
                /* For the clients that run as nobody. */
                REQUIRE(chmod(h.dir, 0711) == 0 && chmod(h.socket, 0666) == 0, "chmod: %m");
        } else
                printf("soak: not root: every client runs as uid %u\n", (unsigned)getuid());
        k = conn_open(h.socket, &ctl);
        REQUIRE(k == 0, "connect: %s", strerror(-k));

        settle(&h, ctl, &before);
        printf("soak: before: daemon fds %d; capacity %" PRIu64 ", cached %" PRIu64 "\n", before.fds,
               before.dev.capacity, before.dev.cached);

        run = (Run){ .cfg = &cfg, .h = &h, .ctl = ctl, .rng = cfg.seed,
                     .slots = calloc(cfg.running, sizeof(Slot)), .retired = calloc(cfg.clients, sizeof(unsigned)) };
        REQUIRE(run.slots && run.retired, "out of memory");
        t0 = now_us();
        run_clients(&run);
        t1 = now_us();
        /* Everything is gone but what is published: unpublish it. */
        run.unpublished += unpublish_prefix(ctl, "");
        summary(&run, t1 - t0);

        /* Nothing may be left, */
        list_all(ctl, &l);
        for (size_t i = 0; i < l.n_leases; i++) {
                const WireLeaseInfo *x = &l.leases[i];

                fail("lease %s (%" PRIu64 " bytes, owner uid %" PRId64 ", made by pid %" PRId64 ", name %s) outlived "
                     "every client", x->id, x->size, x->uid, x->pid, x->name ?: "none");
                for (size_t j = 0; j < x->n_holders; j++)
                        printf("  held by pid %" PRId64 " (uid %" PRId64 ", %s)%s\n", x->holders[j].pid,
                               x->holders[j].uid, x->holders[j].comm ?: "?",
                               x->holders[j].pid == getpid() ? ": this test" : "");
        }
        list_reply_done(&l);
        /* and the daemon is back where it started. */
        settle(&h, ctl, &after);
        check_back(&before, &after);
        printf("soak: the daemon used %.1f s of CPU\n", cpu_seconds(h.pid));
        ctl = varlink_conn_free(ctl);
        k = harness_stop(&h);
        if (k != 0)
                fail("the daemon exited with status %d", k);
        free(run.slots);
        free(run.retired);
        free(before.users);
        free(after.users);
        munmap(shm, board_size + stats_size);
        if (failures > 0) {
                printf("soak: %u failures (seed %#" PRIx64 ")\n", failures, cfg.seed);
                return EXIT_FAILURE;
        }
        printf("soak: passed in %.1f s\n", (double)(now_us() - start) / 1e6);
        return EXIT_SUCCESS;
}
