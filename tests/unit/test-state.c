/* SPDX-License-Identifier: MIT */

/*
 * daemon/state.c: the previous daemon's lease table (format 1, JSON in a
 * sealed memfd, "state-<generation>"), which a daemon read back on upgrade,
 * read field for field from text as that daemon wrote it; files cut short,
 * corrupted, of another version or too large refused with a sentence (and,
 * under ASan, without a leak or a bad access); state_check(), the checks
 * that state_read() and store_read() share; process start times telling a
 * live holder from a dead one or a reused pid, with forked children as
 * holders; slab ids, as the stored fds are named by them, on the simulated
 * device.
 */

#include <check.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/pidfd.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "driver.h"
#include "json.h"
#include "lease.h"
#include "macro.h"
#include "pool.h"
#include "simcuda.h"
#include "state.h"
#include "unit.h"

#define MiB (UINT64_C(1) << 20)

static CudaDriver *cu;
static Pool *pool;
static unsigned long (*live_allocations)(void);

/* ---- fixtures ---------------------------------------------------------------------------------------------- */

static void open_pool(void) {
        _cleanup_free_ char *message = NULL;
        PoolConfig config = { .capacity = 512 * MiB, .max_slab = 4 * MiB };    /* 6 MiB is two slabs */
        void *lib;

        ck_assert_msg(cuda_driver_open(&cu, NULL, &message) == 0, "%s", message);
        lib = dlopen(cu->path, RTLD_NOW | RTLD_NOLOAD);
        ck_assert_ptr_nonnull(lib);
        live_allocations = (unsigned long (*)(void))dlsym(lib, "simcuda_live_allocations");
        ck_assert_ptr_nonnull(live_allocations);
        dlclose(lib);
        ck_assert_msg(pool_new(&pool, cu, &config, &message) == 0, "%s", message);
}

static void teardown(void) {
        pool = pool_free(pool);
        if (cu) {
                ck_assert_uint_eq(live_allocations(), 0);
                cu = cuda_driver_close(cu);
        }
}

/* A process to hold leases: it waits for commands on a pipe and exits when the pipe closes. */
typedef struct Child {
        pid_t pid;
        int cmd;                        /* write end: 'r' renames it, closing ends it */
        int ack;                        /* read end: a byte when it started, and after each command */
} Child;

static void child_ack(const Child *c) {
        char b;

        ck_assert_int_eq(read(c->ack, &b, 1), 1);
}

static Child child_spawn(const char *rename_to) {
        int cmd[2], ack[2];
        Child c;

        ck_assert_int_eq(pipe2(cmd, O_CLOEXEC), 0);
        ck_assert_int_eq(pipe2(ack, O_CLOEXEC), 0);
        c.pid = fork();
        ck_assert_int_ge(c.pid, 0);
        if (c.pid == 0) {
                char b = 0;

                close(cmd[1]);
                close(ack[0]);
                if (write(ack[1], &b, 1) != 1)
                        _exit(1);
                while (read(cmd[0], &b, 1) == 1) {
                        if (b == 'r')
                                (void)prctl(PR_SET_NAME, rename_to);
                        if (write(ack[1], &b, 1) != 1)
                                _exit(1);
                }
                _exit(0);
        }
        close(cmd[0]);
        close(ack[1]);
        c.cmd = cmd[1];
        c.ack = ack[0];
        child_ack(&c);
        return c;
}

static void child_rename(const Child *c) {
        ck_assert_int_eq(write(c->cmd, "r", 1), 1);
        child_ack(c);
}

/* Ends the child and reaps it: its pid is then free for the kernel to give to another process. */
static void child_end(Child *c) {
        int status;

        c->cmd = safe_close(c->cmd);
        c->ack = safe_close(c->ack);
        ck_assert_int_eq(waitpid(c->pid, &status, 0), c->pid);
        ck_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

static int text_fd(const char *text, size_t len) {
        int fd = memfd_create("test-state", MFD_CLOEXEC);

        ck_assert_int_ge(fd, 0);
        ck_assert_int_eq(write(fd, text, len), (ssize_t)len);
        return fd;
}

static int read_text_len(const char *text, size_t len, char **ret_message) {
        _cleanup_close_ int fd = text_fd(text, len);
        State s = { .n_leases = 12345 };
        int k;

        k = state_read(fd, &s, ret_message);
        if (k < 0) {
                ck_assert_ptr_null(s.leases);
                ck_assert_uint_eq(s.n_leases, 0);
        }
        state_done(&s);
        return k;
}

/* Expects `text` refused with `error` and a sentence that holds `needle`. */
static void expect_refused(const char *text, int error, const char *needle) {
        _cleanup_free_ char *message = NULL;
        int k = read_text_len(text, strlen(text), &message);

        ck_assert_msg(k == error, "%d instead of %d (%s) for %s", k, error, message ?: "no message", text);
        ck_assert_ptr_nonnull(message);
        ck_assert_msg(strstr(message, needle), "'%s' lacks '%s'", message, needle);
}

static void fclosep_(FILE **f) {
        if (*f)
                fclose(*f);
}

static char *mfree_(char *p) {
        free(p);
        return NULL;
}



/* ---- tests ------------------------------------------------------------------------------------------------- */

static Slab *alloc_one(uint64_t size, size_t *ret_n, Slab **slabs) {
        ck_assert_int_eq(pool_alloc(pool, 0, size, 1000, slabs, ret_n), 0);
        return slabs[0];
}

START_TEST(test_slab_ids) {
        Slab *slabs[POOL_MAX_SLABS];
        uint64_t ids[8];
        size_t n = 0, k;
        Slab *b, *c;

        open_pool();
        alloc_one(6 * MiB, &k, slabs);          /* 4 + 2 MiB (the maximum slab is 4 MiB) */
        ck_assert_uint_eq(k, 2);
        for (size_t i = 0; i < k; i++)
                ids[n++] = slabs[i]->id;
        b = alloc_one(2 * MiB, &k, slabs);
        ids[n++] = b->id;
        /* Numbered from 1, in creation order, each once. */
        ck_assert_uint_eq(ids[0], 1);
        ck_assert_uint_eq(ids[1], 2);
        ck_assert_uint_eq(ids[2], 3);

        /* A slab keeps its id through the cache; a new slab never takes an old one's id. */
        pool_reclaim(pool, b);
        ck_assert_int_eq(pool_drain(pool), 0);
        c = alloc_one(2 * MiB, &k, slabs);
        ck_assert_uint_eq(c->id, 3);
        c = alloc_one(2 * MiB, &k, slabs);
        ck_assert_uint_eq(c->id, 4);
        /* Released to the driver, its id is not given again. */
        pool_reclaim(pool, c);
        ck_assert_int_eq(pool_drain(pool), 0);
        ck_assert_uint_eq(pool_trim(pool), 1);
        c = alloc_one(2 * MiB, &k, slabs);
        ck_assert_uint_eq(c->id, 5);
}
END_TEST

/* A format-1 table with one lease held by `pid` (of start time `start_time`) and another process. */
static char *held_by(pid_t pid, uint64_t start_time, pid_t other, uint64_t other_start) {
        char *text;

        ck_assert_int_ge(asprintf(&text,
                                  "{\"format\":1,\"leases\":[{\"id\":\"0123456789abcdef0123456789abcdef\","
                                  "\"device\":0,\"size\":2097152,\"created\":1,\"uid\":1000,\"pid\":%d,"
                                  "\"comm\":\"??bad\",\"foreign\":false,\"slabs\":[{\"id\":1,\"size\":2097152}],"
                                  "\"tokens\":[],\"holds\":[{\"pid\":%d,\"start_time\":%" PRIu64 ",\"uid\":1000,"
                                  "\"gid\":1000,\"comm\":\"r) 1 2 (3\",\"refs\":1,\"readonly\":false},"
                                  "{\"pid\":%d,\"start_time\":%" PRIu64 ",\"uid\":1000,\"gid\":1000,"
                                  "\"comm\":\"other\",\"refs\":2,\"readonly\":true}]}]}\n",
                                  (int)pid, (int)pid, start_time, (int)other, other_start),
                         0);
        return text;
}

START_TEST(test_holders) {
        _cleanup_(state_done) State s = {};
        _cleanup_free_ char *text = NULL, *message = NULL;
        _cleanup_close_ int fd = -EBADF;
        uint64_t st1, st2;
        Child c1, c2;

        /* Two processes hold a lease in a table the previous daemon wrote; one of them exits while the
         * daemon is down. */
        c1 = child_spawn("r) 1 2 (3");          /* a command name that looks like stat's fields */
        c2 = child_spawn("other");
        child_rename(&c1);
        ck_assert_int_eq(process_start_time(c1.pid, &st1), 0);
        ck_assert_int_eq(process_start_time(c2.pid, &st2), 0);
        ck_assert_uint_ne(st1, 0);
        text = held_by(c1.pid, st1, c2.pid, st2);
        fd = text_fd(text, strlen(text));
        ck_assert_msg(state_read(fd, &s, &message) == 0, "%s", message);
        ck_assert_uint_eq(s.n_leases, 1);
        ck_assert_uint_eq(s.leases[0].n_holds, 2);
        ck_assert_str_eq(s.leases[0].holds[0].comm, "r) 1 2 (3");
        ck_assert_str_eq(s.leases[0].comm, "??bad");
        ck_assert_uint_eq(s.leases[0].holds[1].refs, 2);
        ck_assert(s.leases[0].holds[1].readonly);

        /* The holders as a restarted daemon would find them. */
        child_end(&c2);
        ck_assert(state_is_holder_alive(s.leases[0].holds[0].pid, s.leases[0].holds[0].start_time));
        ck_assert(!state_is_holder_alive(s.leases[0].holds[1].pid, s.leases[0].holds[1].start_time));
        child_end(&c1);
        ck_assert(!state_is_holder_alive(s.leases[0].holds[0].pid, s.leases[0].holds[0].start_time));
}
END_TEST

START_TEST(test_empty) {
        _cleanup_(state_done) State s = {};
        const char *text = "{\"format\":1,\"leases\":[]}\n";
        _cleanup_close_ int fd = text_fd(text, strlen(text));

        ck_assert_int_eq(state_read(fd, &s, NULL), 0);
        ck_assert_uint_eq(s.n_leases, 0);
        ck_assert_ptr_null(s.leases);
        ck_assert_int_eq(state_check(&s, NULL), 0);
}
END_TEST

START_TEST(test_offset) {
        _cleanup_(state_done) State s = {};
        const char *text = "{\"format\":1,\"leases\":[]}\n";
        _cleanup_close_ int fd = text_fd(text, strlen(text));

        /* Reading neither needs nor moves the offset. */
        ck_assert_int_eq(lseek(fd, 5, SEEK_SET), 5);
        ck_assert_int_eq(state_read(fd, &s, NULL), 0);
        ck_assert_int_eq(lseek(fd, 0, SEEK_CUR), 5);
}
END_TEST

START_TEST(test_start_time) {
        _cleanup_close_ int pidfd = -EBADF;
        uint64_t self, before, after, dead;
        struct pollfd p;
        Child c;

        ck_assert_int_eq(process_start_time(getpid(), &self), 0);
        ck_assert_uint_gt(self, 0);
        ck_assert(state_is_holder_alive(getpid(), self));
        ck_assert(!state_is_holder_alive(getpid(), self + 1));         /* a process that took our pid */
        ck_assert(state_is_holder_alive(getpid(), 0));                 /* unknown: the pid decides */
        ck_assert(!state_is_holder_alive(0, 0));
        ck_assert(!state_is_holder_alive(-1, self));
        ck_assert_int_eq(state_open_holder(getpid(), self, &pidfd), 1);
        ck_assert_int_ge(pidfd, 0);
        pidfd = safe_close(pidfd);

        /* Field 22 is found after the last ')' whatever the command name holds. */
        c = child_spawn("x) S 1 2 3 4 5");
        ck_assert_int_eq(process_start_time(c.pid, &before), 0);
        child_rename(&c);
        ck_assert_int_eq(process_start_time(c.pid, &after), 0);
        ck_assert_uint_eq(before, after);
        ck_assert_uint_ge(before, self);
        ck_assert(state_is_holder_alive(c.pid, before));

        /* Exited but not reaped (a zombie: its /proc/PID/stat still reads): dead all the same. */
        pidfd = pidfd_open(c.pid, 0);
        ck_assert_int_ge(pidfd, 0);
        c.cmd = safe_close(c.cmd);
        p = (struct pollfd){ .fd = pidfd, .events = POLLIN };
        ck_assert_int_eq(poll(&p, 1, 30000), 1);
        ck_assert_int_eq(process_start_time(c.pid, &dead), 0);
        ck_assert_uint_eq(dead, before);
        ck_assert(!state_is_holder_alive(c.pid, before));
        ck_assert(!state_is_holder_alive(c.pid, 0));

        /* Reaped: gone. */
        child_end(&c);
        ck_assert_int_eq(process_start_time(c.pid, &dead), -ESRCH);
        ck_assert(!state_is_holder_alive(c.pid, before));
}
END_TEST


/* state_check() on a State made by hand: what a binary file could say and JSON could not. */
static void expect_check(State *s, const char *needle) {
        _cleanup_free_ char *message = NULL;

        ck_assert_int_eq(state_check(s, &message), -EBADMSG);
        ck_assert_ptr_nonnull(message);
        ck_assert_msg(strstr(message, needle), "'%s' lacks '%s'", message, needle);
}

START_TEST(test_check) {
        StateSlab slabs[POOL_MAX_SLABS + 1] = {};
        StateToken tokens[LEASE_TOKENS_MAX + 1] = {};
        uid_t uids[STATE_NAME_UIDS_MAX + 1] = {};
        StateHold holds[2] = {};
        char label[LEASE_LABEL_MAX + 2];
        StateLease l = {}, saved;
        State s = { .leases = &l, .n_leases = 1 };

        snprintf(l.id, sizeof(l.id), "0123456789abcdef0123456789abcdef");
        l.size = 2 * MiB;
        l.uid = 1000;
        snprintf(l.comm, sizeof(l.comm), "c");
        slabs[0] = (StateSlab){ .id = 1, .size = 2 * MiB };
        l.slabs = slabs;
        l.n_slabs = 1;
        holds[0] = (StateHold){ .pid = 10, .uid = 1000, .gid = 1000, .refs = 1 };
        l.holds = holds;
        l.n_holds = 1;
        ck_assert_int_eq(state_check(&s, NULL), 0);
        saved = l;

        l.device = -1;
        expect_check(&s, "device -1");
        l = saved;
        l.uid = UID_ANY;
        expect_check(&s, "uid 4294967295");
        l = saved;
        l.pid = -3;
        expect_check(&s, "pid -3");
        l = saved;
        memset(l.comm, 'x', sizeof(l.comm));    /* no NUL */
        expect_check(&s, "command name");
        l = saved;
        l.comm[0] = '\x01';
        expect_check(&s, "command name");
        l = saved;
        memset(label, 'a', sizeof(label) - 1);
        label[sizeof(label) - 1] = 0;
        l.label = label;
        expect_check(&s, "label");
        label[0] = '\x7f';
        label[1] = 0;
        expect_check(&s, "label");
        l = saved;
        l.n_slabs = POOL_MAX_SLABS + 1;
        for (size_t i = 0; i < l.n_slabs; i++)
                slabs[i] = (StateSlab){ .id = i + 1, .size = 2 * MiB };
        l.size = l.n_slabs * 2 * MiB;
        expect_check(&s, "more than 253 slabs");
        l = saved;
        l.tokens = tokens;
        l.n_tokens = LEASE_TOKENS_MAX + 1;
        for (size_t i = 0; i < l.n_tokens; i++)
                snprintf(tokens[i].token, sizeof(tokens[i].token), "%032zx", i);
        expect_check(&s, "more than 64 tokens");
        l.n_tokens = 1;
        tokens[0].creator = UID_ANY;
        expect_check(&s, "uid out of range");
        tokens[0].creator = 1;
        tokens[0].uid = UID_ANY;
        ck_assert_int_eq(state_check(&s, NULL), 0);
        l = saved;
        l.name = (char *)"n";
        l.name_uids = uids;
        l.n_name_uids = STATE_NAME_UIDS_MAX + 1;
        expect_check(&s, "more than 64 name_uids");
        l.n_name_uids = 1;
        uids[0] = UID_ANY;
        expect_check(&s, "out of range");
        uids[0] = 5;
        ck_assert_int_eq(state_check(&s, NULL), 0);
        l = saved;
        holds[0].refs = 0;
        expect_check(&s, "0 references");
        holds[0].refs = 1;
        holds[0].gid = (gid_t)-1;
        expect_check(&s, "out of range");
        holds[0].gid = 1000;
        holds[0].comm[0] = '\x1b';
        expect_check(&s, "command name");
        holds[0].comm[0] = 0;
        holds[1] = holds[0];
        l.n_holds = 2;
        expect_check(&s, "holds lease");
        l = saved;
        ck_assert_int_eq(state_check(&s, NULL), 0);
}
END_TEST

#define VALID                                                                                                   \
        "{\"format\":1,\"leases\":["                                                                            \
        "{\"id\":\"0123456789abcdef0123456789abcdef\",\"device\":0,\"size\":6291456,"                           \
        "\"created\":1700000000000000,\"label\":\"run\",\"uid\":1000,\"pid\":100,\"comm\":\"trainer\","         \
        "\"foreign\":true,\"slabs\":[{\"id\":1,\"size\":4194304},{\"id\":2,\"size\":2097152}],"                 \
        "\"tokens\":[{\"token\":\"00112233445566778899aabbccddeeff\",\"uid\":1001,\"creator\":1000,"            \
        "\"readonly\":true},{\"token\":\"ffeeddccbbaa99887766554433221100\",\"creator\":1000,"                  \
        "\"readonly\":false}],"                                                                                 \
        "\"holds\":[{\"pid\":100,\"start_time\":5000,\"uid\":1000,\"gid\":1000,\"comm\":\"trainer\","           \
        "\"refs\":2,\"readonly\":false},{\"pid\":200,\"start_time\":6000,\"uid\":1001,\"gid\":1001,"            \
        "\"comm\":\"reader\",\"refs\":1,\"readonly\":true}]},"                                                  \
        "{\"id\":\"fedcba9876543210fedcba9876543210\",\"device\":0,\"size\":2097152,"                           \
        "\"created\":1700000000000001,\"uid\":1001,\"pid\":200,\"comm\":\"reader\",\"foreign\":false,"          \
        "\"slabs\":[{\"id\":3,\"size\":2097152}],\"name\":\"shared.b\",\"name_uids\":[1000],"                   \
        "\"name_readonly\":true,\"tokens\":[],"                                                                 \
        "\"holds\":[{\"pid\":200,\"start_time\":6000,\"uid\":1001,\"gid\":1001,\"comm\":\"reader\","            \
        "\"refs\":1,\"readonly\":false}]}"                                                                      \
        "]}"

/* VALID with the first `from` replaced by `to`. */
static char *mutate(const char *from, const char *to) {
        const char *at = strstr(VALID, from);
        char *s;

        ck_assert_msg(at, "'%s' is not in the text", from);
        ck_assert_int_ge(asprintf(&s, "%.*s%s%s", (int)(at - VALID), VALID, to, at + strlen(from)), 0);
        return s;
}

static void refused_as(const char *from, const char *to, int error, const char *needle) {
        _cleanup_free_ char *s = mutate(from, to);

        expect_refused(s, error, needle);
}

START_TEST(test_valid_text) {
        _cleanup_close_ int fd = text_fd(VALID, strlen(VALID));
        _cleanup_(state_done) State s = {};
        _cleanup_free_ char *message = NULL;
        const StateLease *a, *b;

        ck_assert_msg(state_read(fd, &s, &message) == 0, "%s", message);
        ck_assert_uint_eq(s.n_leases, 2);
        a = &s.leases[0];
        b = &s.leases[1];
        ck_assert_str_eq(a->label, "run");
        ck_assert_uint_eq(a->n_slabs, 2);
        ck_assert_uint_eq(a->slabs[1].id, 2);
        ck_assert_uint_eq(a->tokens[0].uid, 1001);
        ck_assert_uint_eq(a->tokens[1].uid, UID_ANY);   /* "uid" left out: anyone */
        ck_assert_uint_eq(a->holds[0].refs, 2);
        ck_assert_uint_eq(a->holds[1].start_time, 6000);
        ck_assert_ptr_null(b->label);
        ck_assert_str_eq(b->name, "shared.b");
        ck_assert_uint_eq(b->n_name_uids, 1);
        ck_assert_uint_eq(b->name_uids[0], 1000);
        ck_assert(b->name_readonly);
        ck_assert_uint_eq(b->n_tokens, 0);
        ck_assert_ptr_null(b->tokens);
}
END_TEST

START_TEST(test_refuse_version) {
        refused_as("\"format\":1", "\"format\":2", -EPROTONOSUPPORT, "format 2");
        refused_as("\"format\":1", "\"format\":0", -EPROTONOSUPPORT, "format 0");
        refused_as("\"format\":1", "\"format\":-1", -EPROTONOSUPPORT, "format -1");
        refused_as("\"format\":1", "\"format\":\"1\"", -EBADMSG, "not an integer");
        refused_as("\"format\":1", "\"format\":1.0", -EBADMSG, "not an integer");
        refused_as("\"format\":1,", "", -EBADMSG, "no format");
        /* A later format may have other fields: it is named by its version, not by the first unknown key. */
        refused_as("{\"format\":1,", "{\"compressed\":true,\"format\":9,", -EPROTONOSUPPORT, "format 9");
}
END_TEST

START_TEST(test_refuse_malformed) {
        _cleanup_free_ char *message = NULL;

        expect_refused("", -EBADMSG, "empty");
        expect_refused("[]", -EBADMSG, "JSON");
        expect_refused("{}", -EBADMSG, "no format");
        expect_refused("{\"format\":1}", -EBADMSG, "'leases' is missing");
        expect_refused(VALID "x", -EBADMSG, "JSON");
        expect_refused("\xef\xbb\xbf" VALID, -EBADMSG, "JSON");
        ck_assert_int_eq(read_text_len(VALID, sizeof(VALID), &message), -EBADMSG);  /* with its NUL */

        refused_as("{\"format\":1,", "{\"format\":1,\"more\":[],", -EBADMSG, "Unknown parameter 'more'");
        refused_as("\"foreign\":true", "\"foreign\":true,\"extra\":1", -EBADMSG, "Unknown parameter 'extra'");
        refused_as("\"foreign\":true", "\"foreign\":true,\"foreign\":true", -EBADMSG, "JSON");
        refused_as("\"foreign\":true", "\"foreign\":1", -EBADMSG, "'foreign' must be a boolean");
        refused_as("\"created\":1700000000000000", "\"created\":1.7e15", -EBADMSG, "must be an integer");
        refused_as("\"created\":1700000000000000", "\"created\":9223372036854775808", -EBADMSG, "larger than");
        refused_as("\"created\":1700000000000000", "\"created\":99999999999999999999999", -EBADMSG, "JSON");
        refused_as("\"label\":\"run\"", "\"label\":\"r\\u0001n\"", -EBADMSG, "printable");
        refused_as("\"label\":\"run\"", "\"label\":\"r\\u0000n\"", -EBADMSG, "JSON");
        refused_as("\"uid\":1000,\"pid\":100", "\"uid\":null,\"pid\":100", -EBADMSG, "null is not allowed");
        refused_as("\"holds\":[", "\"holdz\":[", -EBADMSG, "Unknown parameter 'holdz'");
        refused_as("\"slabs\":[{\"id\":1", "\"slabs\":{\"x\":[{\"id\":1", -EBADMSG, "JSON");
        refused_as("\"comm\":\"trainer\"", "\"comm\":\"sixteen-bytes-xx\"", -EBADMSG, "longer than 15 bytes");
        refused_as("\"label\":\"run\"", "\"label\":[\"run\"]", -EBADMSG, "must be a string");
        refused_as("\"tokens\":[{", "\"tokens\":[7,{", -EBADMSG, "must be an object");
}
END_TEST

START_TEST(test_refuse_inconsistent) {
        refused_as("\"size\":6291456", "\"size\":6291457", -EBADMSG, "add up");
        refused_as("{\"id\":2,\"size\":2097152}", "{\"id\":2,\"size\":3145728}", -EBADMSG, "add up");
        refused_as("{\"id\":2,\"size\":2097152}", "{\"id\":2,\"size\":0}", -EBADMSG, "is empty");
        refused_as("{\"id\":3,", "{\"id\":2,", -EBADMSG, "Slab 2 is in two places");
        refused_as("{\"id\":1,", "{\"id\":0,", -EBADMSG, "slab of id 0");
        refused_as("\"slabs\":[{\"id\":3,\"size\":2097152}]", "\"slabs\":[]", -EBADMSG, "no slabs");
        refused_as("\"fedcba9876543210fedcba9876543210\"", "\"0123456789abcdef0123456789abcdef\"", -EBADMSG,
                   "appears twice");
        refused_as("\"0123456789abcdef0123456789abcdef\"", "\"0123456789ABCDEF0123456789abcdef\"", -EBADMSG,
                   "hexadecimal");
        refused_as("\"0123456789abcdef0123456789abcdef\"", "\"0123456789abcdef0123456789abcde\"", -EBADMSG,
                   "hexadecimal");
        refused_as("\"0123456789abcdef0123456789abcdef\"", "\"0123456789abcdef0123456789abcdef0\"", -EBADMSG,
                   "longer than 32");
        refused_as("\"ffeeddccbbaa99887766554433221100\"", "\"00112233445566778899aabbccddeeff\"", -EBADMSG,
                   "token appears twice");
        refused_as("\"ffeeddccbbaa99887766554433221100\"", "\"ffeeddccbbaa99887766554433221g00\"", -EBADMSG,
                   "hexadecimal");
        refused_as("\"uid\":1000,\"pid\":100", "\"uid\":4294967295,\"pid\":100", -EBADMSG, "uid 4294967295");
        refused_as("\"uid\":1001,\"creator\"", "\"uid\":4294967295,\"creator\"", -EBADMSG, "uid out of range");
        refused_as("\"creator\":1000", "\"creator\":-5", -EBADMSG, "negative");
        refused_as("\"device\":0", "\"device\":-1", -EBADMSG, "negative");
        refused_as("\"device\":0", "\"device\":2147483648", -EBADMSG, "device 2147483648");
        refused_as("\"pid\":100,\"comm\"", "\"pid\":2147483648,\"comm\"", -EBADMSG, "pid 2147483648");
        refused_as("\"gid\":1000", "\"gid\":4294967295", -EBADMSG, "out of range");
        refused_as("\"foreign\":true", "\"foreign\":false", -EBADMSG, "not marked foreign");
        refused_as("\"name\":\"shared.b\"", "\"name\":\"-bad\"", -EBADMSG, "not a valid name");
        refused_as("\"name\":\"shared.b\"", "\"name\":\"\"", -EBADMSG, "not a valid name");
        refused_as("\"name\":\"shared.b\",", "", -EBADMSG, "but no name");
        refused_as("\"name_uids\":[1000]", "\"name_uids\":[4294967295]", -EBADMSG, "out of range");
        refused_as("\"refs\":2", "\"refs\":0", -EBADMSG, "0 references");
        refused_as("\"refs\":2", "\"refs\":4294967296", -EBADMSG, "4294967296 references");
        /* The second lease's hold of pid 200 says another start time than the first lease's. */
        refused_as("\"holds\":[{\"pid\":200,\"start_time\":6000", "\"holds\":[{\"pid\":200,\"start_time\":7000",
                   -EBADMSG, "Process 200 is described differently");
        refused_as("\"holds\":[{\"pid\":200,\"start_time\":6000,\"uid\":1001,\"gid\":1001",
                   "\"holds\":[{\"pid\":200,\"start_time\":6000,\"uid\":1001,\"gid\":1002", -EBADMSG,
                   "described differently");
        /* The first lease held twice by pid 100. */
        refused_as("{\"pid\":200,\"start_time\":6000,\"uid\":1001,\"gid\":1001,\"comm\":\"reader\",\"refs\":1,"
                   "\"readonly\":true}",
                   "{\"pid\":100,\"start_time\":5000,\"uid\":1000,\"gid\":1000,\"comm\":\"trainer\",\"refs\":1,"
                   "\"readonly\":true}",
                   -EBADMSG, "Process 100 holds lease 0123456789abcdef0123456789abcdef twice");
        /* Two leases of one owner published under one name. */
        expect_refused("{\"format\":1,\"leases\":["
                       "{\"id\":\"0123456789abcdef0123456789abcdef\",\"device\":0,\"size\":2097152,"
                       "\"created\":1,\"uid\":1000,\"pid\":100,\"comm\":\"t\",\"foreign\":false,\"name\":\"x\","
                       "\"slabs\":[{\"id\":1,\"size\":2097152}],\"tokens\":[],\"holds\":[]},"
                       "{\"id\":\"fedcba9876543210fedcba9876543210\",\"device\":0,\"size\":2097152,"
                       "\"created\":1,\"uid\":1000,\"pid\":100,\"comm\":\"t\",\"foreign\":false,\"name\":\"x\","
                       "\"slabs\":[{\"id\":2,\"size\":2097152}],\"tokens\":[],\"holds\":[]}]}",
                       -EBADMSG, "published as '1000/x'");
}
END_TEST

/* Names live in their owner's namespace: two owners may each publish the same name. */
START_TEST(test_same_name_two_owners) {
        _cleanup_free_ char *s = mutate("\"foreign\":true,", "\"foreign\":true,\"name\":\"shared.b\",");
        _cleanup_close_ int fd = text_fd(s, strlen(s));
        _cleanup_(state_done) State st = {};
        _cleanup_free_ char *message = NULL;

        ck_assert_msg(state_read(fd, &st, &message) == 0, "%s", message);
        ck_assert_str_eq(st.leases[0].name, "shared.b");
        ck_assert_str_eq(st.leases[1].name, "shared.b");
}
END_TEST

/* A lease with n slabs (2 MiB each) and n tokens, as text. */
static char *lease_with(size_t n_slabs, size_t n_tokens) {
        _cleanup_(fclosep_) FILE *f = NULL;
        char *text = NULL;
        size_t len;

        f = open_memstream(&text, &len);
        ck_assert_ptr_nonnull(f);
        fprintf(f, "{\"format\":1,\"leases\":[{\"id\":\"0123456789abcdef0123456789abcdef\",\"device\":0,"
                   "\"size\":%" PRIu64 ",\"created\":1,\"uid\":1,\"pid\":1,\"comm\":\"\",\"foreign\":false,\"slabs\":[",
                n_slabs * 2 * MiB);
        for (size_t i = 0; i < n_slabs; i++)
                fprintf(f, "%s{\"id\":%zu,\"size\":%" PRIu64 "}", i ? "," : "", i + 1, 2 * MiB);
        fputs("],\"tokens\":[", f);
        for (size_t i = 0; i < n_tokens; i++)
                fprintf(f, "%s{\"token\":\"%032zx\",\"creator\":1,\"readonly\":false}", i ? "," : "", i);
        fputs("],\"holds\":[]}]}", f);
        ck_assert_int_eq(fclose(TAKE_PTR(f)), 0);
        return text;
}

START_TEST(test_refuse_counts) {
        _cleanup_free_ char *ok = lease_with(POOL_MAX_SLABS, LEASE_TOKENS_MAX);
        _cleanup_free_ char *slabs = lease_with(POOL_MAX_SLABS + 1, 0);
        _cleanup_free_ char *tokens = lease_with(1, LEASE_TOKENS_MAX + 1);
        _cleanup_free_ char *leases = NULL, *message = NULL;
        _cleanup_close_ int fd = -EBADF;
        _cleanup_(state_done) State s = {};
        size_t n = STATE_LEASES_MAX + 1, len;
        int pipes[2];

        /* At the limits: read, and a lease nobody holds and nobody published is accepted (see state.h). */
        ck_assert_int_eq(read_text_len(ok, strlen(ok), &message), 0);
        expect_refused(slabs, -EBADMSG, "more than 253 elements");
        expect_refused(tokens, -EBADMSG, "more than 64 elements");

        /* The count is checked before any element is read. */
        len = strlen("{\"format\":1,\"leases\":[") + 3 * n + 1;
        leases = malloc(len + 1);
        ck_assert_ptr_nonnull(leases);
        strcpy(leases, "{\"format\":1,\"leases\":[");
        for (size_t i = 0, o = strlen(leases); i < n; i++, o += 3)
                memcpy(leases + o, i + 1 < n ? "{}," : "{}]}", i + 1 < n ? 3 : 4);
        leases[len] = 0;
        expect_refused(leases, -EBADMSG, "more than 1000000 elements");

        /* Too large: a sparse file, nothing read. */
        fd = memfd_create("big", MFD_CLOEXEC);
        ck_assert_int_ge(fd, 0);
        ck_assert_int_eq(ftruncate(fd, (off_t)STATE_SIZE_MAX + 1), 0);
        message = mfree_(message);
        ck_assert_int_eq(state_read(fd, &s, &message), -EFBIG);
        ck_assert_ptr_nonnull(strstr(message, "over the"));
        fd = safe_close(fd);

        /* Not a file. */
        ck_assert_int_eq(pipe2(pipes, O_CLOEXEC), 0);
        message = mfree_(message);
        ck_assert_int_eq(state_read(pipes[0], &s, &message), -EBADMSG);
        ck_assert_ptr_nonnull(strstr(message, "not a regular file"));
        close(pipes[0]);
        close(pipes[1]);
}
END_TEST

static unsigned count_fds(void) {
        unsigned n = 0;

        for (int fd = 0; fd < 1024; fd++)
                if (fcntl(fd, F_GETFD) >= 0)
                        n++;
        return n;
}

START_TEST(test_refuse_truncated) {
        unsigned fds = count_fds();

        /* Every prefix of the hand-written file. */
        for (size_t len = 0; len < strlen(VALID); len++) {
                _cleanup_free_ char *message = NULL;

                ck_assert_int_eq(read_text_len(VALID, len, &message), -EBADMSG);
                ck_assert_ptr_nonnull(message);
        }
        ck_assert_uint_eq(count_fds(), fds);
}
END_TEST

/* A small deterministic generator (xorshift64*), so that a failure replays. */
static uint64_t rng_state = UINT64_C(0x9e3779b97f4a7c15);

static uint64_t rng(void) {
        rng_state ^= rng_state >> 12;
        rng_state ^= rng_state << 25;
        rng_state ^= rng_state >> 27;
        return rng_state * UINT64_C(2685821657736338717);
}

/* One random edit of text[0..len) into out (room for 2 * len + 64), returning the new length. */
static size_t fuzz_edit(const char *text, size_t len, char *out) {
        static const char tokens[] = "{}[]\",:0123456789-+.eE tfnul\\ux\x01\x7f\xc3\xff";
        size_t at = rng() % len, span = 1 + rng() % 16, o;

        memcpy(out, text, len);
        switch (rng() % 6) {
        case 0:         /* flip a bit */
                out[at] = (char)(out[at] ^ (1 << (rng() % 8)));
                return len;
        case 1:         /* a byte JSON cares about */
                out[at] = tokens[rng() % (sizeof(tokens) - 1)];
                return len;
        case 2:         /* delete a span */
                span = MIN(span, len - at);
                memmove(out + at, text + at + span, len - at - span);
                return len - span;
        case 3:         /* repeat a span */
                span = MIN(span, len - at);
                memcpy(out + at + span, text + at, len - at);
                return len + span;
        case 4:         /* insert a number, of any size */
                o = (size_t)snprintf(out + at, 64, "%" PRIi64, (int64_t)rng() >> (rng() % 64));
                memcpy(out + at + o, text + at, len - at);
                return len + o;
        default:        /* two edits */
                o = fuzz_edit(text, len, out);
                {
                        _cleanup_free_ char *again = malloc(2 * o + 64);

                        ck_assert_ptr_nonnull(again);
                        memcpy(again, out, o);
                        return fuzz_edit(again, o, out);
                }
        }
}

START_TEST(test_fuzz) {
        _cleanup_close_ int fd = memfd_create("fuzz", MFD_CLOEXEC);
        _cleanup_free_ char *out = malloc(8 * strlen(VALID) + 256);
        unsigned accepted = 0, refused = 0;

        ck_assert_int_ge(fd, 0);
        for (unsigned i = 0; i < 20000; i++) {
                _cleanup_free_ char *message = NULL;
                State s = {};
                size_t len = fuzz_edit(VALID, strlen(VALID), out);
                int k;

                ck_assert_int_eq(ftruncate(fd, 0), 0);
                ck_assert_int_eq(pwrite(fd, out, len, 0), (ssize_t)len);
                k = state_read(fd, &s, &message);
                if (k == 0) {
                        accepted++;
                        ck_assert_uint_le(s.n_leases, 3);
                        state_done(&s);
                        continue;
                }
                refused++;
                ck_assert_msg(k == -EBADMSG || k == -EPROTONOSUPPORT, "edit %u: %d", i, k);
                ck_assert_msg(message, "edit %u refused without a sentence", i);
                ck_assert_ptr_null(s.leases);
        }
        /* Most edits break something; some (a digit in a label, a bit of a start time) do not. */
        ck_assert_uint_gt(refused, 10000);
        ck_assert_uint_gt(accepted, 0);
}
END_TEST

int main(void) {
        return run_suite(UNIT_SUITE("state", teardown, test_slab_ids, test_holders, test_empty, test_offset,
                                    test_start_time, test_check, test_valid_text, test_refuse_version,
                                    test_refuse_malformed,
                                    test_refuse_inconsistent, test_same_name_two_owners, test_refuse_counts, test_refuse_truncated, test_fuzz))
                       ? EXIT_FAILURE
                       : EXIT_SUCCESS;
}
