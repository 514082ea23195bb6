/* SPDX-License-Identifier: MIT */

/* vmmbroker.conf: the file's grammar, drop-ins, overrides, every key's values and errors, and printing. */

#include <errno.h>
#include <grp.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "config.h"
#include "driver.h"
#include "macro.h"
#include "pool.h"
#include "unit.h"

static char dir[64];
static char path[128];

static void setup(void) {
        strcpy(dir, "/tmp/vmmb-config-XXXXXX");
        ck_assert_ptr_nonnull(mkdtemp(dir));
        snprintf(path, sizeof(path), "%s/vmmbroker.conf", dir);
}

static void teardown(void) {
        char cmd[128];

        snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
        ck_assert_int_eq(system(cmd), 0);
}

static void write_file(const char *file, const char *text) {
        FILE *f = fopen(file, "we");

        ck_assert_ptr_nonnull(f);
        ck_assert_int_eq(fputs(text, f) >= 0, 1);
        ck_assert_int_eq(fclose(f), 0);
}

/* Loads `text` as the main file; returns config_load()'s result and leaves the message in *ret_message. */
static int load(Config *c, const char *text, char **ret_message) {
        write_file(path, text);
        config_init(c);
        return config_load(c, path, ret_message);
}

/* Loads `text`, which must fail on `line` with a message containing `needle`. */
static void expect_error(const char *text, unsigned line, const char *needle) {
        _cleanup_free_ char *message = NULL, *where = NULL;
        Config c;
        int k;

        k = load(&c, text, &message);
        ck_assert_msg(k == -EINVAL, "expected -EINVAL for \"%s\", got %d", text, k);
        ck_assert_ptr_nonnull(message);
        ck_assert_int_ge(asprintf(&where, "%s:%u: ", path, line), 0);
        ck_assert_msg(strncmp(message, where, strlen(where)) == 0, "\"%s\" does not start with \"%s\"", message,
                      where);
        ck_assert_msg(strstr(message, needle), "\"%s\" does not say \"%s\"", message, needle);
        config_done(&c);
}

/* The configuration printed, as a string. */
static char *printed(const Config *c) {
        char *buf = NULL;
        size_t len = 0;
        FILE *f = open_memstream(&buf, &len);

        ck_assert_ptr_nonnull(f);
        config_print(c, f);
        ck_assert_int_eq(fclose(f), 0);
        return buf;
}

START_TEST(test_defaults_without_file) {
        _cleanup_free_ char *message = NULL, *text = NULL;
        Config c;

        config_init(&c);
        ck_assert_int_eq(config_load(&c, path, &message), 0);          /* no file, no .d: the defaults */
        ck_assert_ptr_null(c.manager.socket_path);
        ck_assert_ptr_null(c.manager.pool.devices);
        ck_assert_uint_eq(c.manager.pool.capacity, 0);
        ck_assert_uint_eq(c.manager.pool.capacity_percent, 0);
        ck_assert_uint_eq(c.manager.pool.max_slab, 0);
        ck_assert(!c.manager.has_admin_group);
        text = printed(&c);
        ck_assert_str_eq(text, "[Broker]\n"
                               "Socket=/run/vmmbroker/io.vmmbroker\n"
                               "Devices=all\n"
                               "Capacity=95%\n"
                               "MaxSlab=1G\n"
                               "AdminGroup=\n"
                               "ReplyTimeout=30s\n"
                               "# MaxConnectionsTotal= is empty: derived from the fd limit, RLIMIT_NOFILE / 4 "
                               "(64-65536)\n"
                               "MaxConnectionsTotal=\n"
                               "MaxAllocWait=5min\n"
                               "Placement=most-free\n"
                               "ReclaimTimeout=5s\n"
                               "HostCapacity=25%\n"
                               "HostReserve=0\n"
                               "HostSlab=64M\n"
                               "ScrubWaitBytes=256M\n"
                               "\n"
                               "[Limits]\n"
                               "MaxBytes=80%\n"
                               "MaxHostBytes=50%\n"
                               "MaxLeases=1024\n"
                               "MaxConnections=64\n"
                               "MaxProcesses=256\n");
        ck_assert_uint_eq(c.manager.max_connections_total, 0);
        ck_assert_uint_eq(c.manager.limits.defaults.max_processes, USER_DEFAULT_MAX_PROCESSES);
        ck_assert(c.manager.limits.defaults.set & LIMIT_MAX_PROCESSES);
        config_done(&c);
}
END_TEST

START_TEST(test_every_key) {
        _cleanup_free_ char *message = NULL;
        Config c;

        ck_assert_int_eq(load(&c,
                              "# a comment\n"
                              "; another\n"
                              "\n"
                              "  [Broker]  \n"
                              "Socket = /run/test/socket \n"
                              "Devices=2, 0 1\n"
                              "Capacity=64G\n"
                              "MaxSlab=512M\n"
                              "AdminGroup=root\n"
                              "Placement=first\n",
                              &message),
                         0);
        ck_assert_str_eq(c.manager.socket_path, "/run/test/socket");
        ck_assert_int_eq(c.manager.placement, PLACEMENT_FIRST);
        ck_assert_uint_eq(c.manager.pool.n_devices, 3);
        ck_assert_int_eq(c.manager.pool.devices[0], 2);
        ck_assert_int_eq(c.manager.pool.devices[1], 0);
        ck_assert_int_eq(c.manager.pool.devices[2], 1);
        ck_assert_uint_eq(c.manager.pool.capacity, 64ULL << 30);
        ck_assert_uint_eq(c.manager.pool.max_slab, 512ULL << 20);
        ck_assert(c.manager.has_admin_group);
        ck_assert_uint_eq(c.manager.admin_gid, 0);
        ck_assert_uint_eq(c.manager.scrub_wait_bytes, 0);    /* the default */
        config_done(&c);

        /* ScrubWaitBytes=0 is a value, not the default; empty goes back to the default. */
        ck_assert_int_eq(load(&c, "[Broker]\nScrubWaitBytes=0\n", &message), 0);
        ck_assert_uint_eq(c.manager.scrub_wait_bytes, MANAGER_SCRUB_WAIT_NONE);
        config_done(&c);
        ck_assert_int_eq(load(&c, "[Broker]\nScrubWaitBytes=64M\nScrubWaitBytes=\n", &message), 0);
        ck_assert_uint_eq(c.manager.scrub_wait_bytes, 0);    /* the default */
        config_done(&c);
        ck_assert_int_eq(load(&c, "[Broker]\nScrubWaitBytes=1G\n", &message), 0);
        ck_assert_uint_eq(c.manager.scrub_wait_bytes, 1ULL << 30);
        config_done(&c);
}
END_TEST

START_TEST(test_percent_and_reset) {
        _cleanup_free_ char *message = NULL;
        Config c;

        ck_assert_int_eq(load(&c, "[Broker]\nCapacity=80%\n", &message), 0);
        ck_assert_uint_eq(c.manager.pool.capacity, 0);
        ck_assert_uint_eq(c.manager.pool.capacity_percent, 80);
        config_done(&c);

        /* A later assignment wins; an empty one goes back to the default. */
        ck_assert_int_eq(load(&c, "[Broker]\nCapacity=8G\nDevices=1\nAdminGroup=root\nCapacity=\nDevices=\n"
                                  "AdminGroup=\nDevices=all\n", &message), 0);
        ck_assert_uint_eq(c.manager.pool.capacity, 0);
        ck_assert_uint_eq(c.manager.pool.capacity_percent, 0);
        ck_assert_ptr_null(c.manager.pool.devices);
        ck_assert_uint_eq(c.manager.pool.n_devices, 0);
        ck_assert(!c.manager.has_admin_group);
        config_done(&c);
}
END_TEST

static void write_drop_in(const char *name, const char *text) {
        _cleanup_free_ char *file = NULL;

        ck_assert_int_ge(asprintf(&file, "%s.d/%s", path, name), 0);
        write_file(file, text);
}

START_TEST(test_drop_ins) {
        _cleanup_free_ char *message = NULL, *d = NULL;
        Config c;

        ck_assert_int_ge(asprintf(&d, "%s.d", path), 0);
        ck_assert_int_eq(mkdir(d, 0755), 0);
        write_drop_in("20-late.conf", "[Broker]\nMaxSlab=256M\n");
        write_drop_in("10-early.conf", "[Broker]\nMaxSlab=128M\nCapacity=50%\n");
        write_drop_in("99-ignored.conf.disabled", "this is not read\n");

        /* Main file first, then the drop-ins in lexical order: 10 then 20. */
        ck_assert_int_eq(load(&c, "[Broker]\nMaxSlab=2G\nCapacity=10G\n", &message), 0);
        ck_assert_uint_eq(c.manager.pool.max_slab, 256ULL << 20);
        ck_assert_uint_eq(c.manager.pool.capacity_percent, 50);
        config_done(&c);

        /* An error in a drop-in names the drop-in. */
        write_drop_in("30-bad.conf", "[Broker]\n\nMaxSlab=3M\n");
        ck_assert_int_eq(load(&c, "", &message), -EINVAL);
        ck_assert_msg(strstr(message, "30-bad.conf:3: MaxSlab=3M: expected a power of two"), "%s", message);
        config_done(&c);
}
END_TEST

START_TEST(test_errors_name_the_line) {
        expect_error("[Broker]\nCapcity=1G\n", 2, "unknown key \"Capcity\" in [Broker]");
        expect_error("[Broker]\nPlacement=closest\n", 2, "expected most-free, first or nearest");
        expect_error("Capacity=1G\n", 1, "comes before any section");
        expect_error("[Brokers]\n", 1, "unknown section [Brokers]");
        expect_error("[Broker\n", 1, "a section header must be [Name]");
        expect_error("[Broker]\n\n\nCapacity 1G\n", 4, "expected Key=Value");
        expect_error("[Broker]\ncapacity=1G\n", 2, "unknown key \"capacity\"");     /* keys are case-sensitive */
        expect_error("[Broker]\nSocket=relative/path\n", 2, "Socket=relative/path: expected an absolute path");
        expect_error("[Broker]\nSocket=/a/path/longer/than/sun_path/holds/which/is/one/hundred/and/eight/bytes/"
                     "including/its/terminating/nul/so/this/is/too/long\n", 2, "longer than a Unix socket path may be");
        expect_error("[Broker]\nDevices=0 x\n", 2, "Devices=0 x: expected \"all\" or CUDA device indices");
        expect_error("[Broker]\nDevices=-1\n", 2, "expected \"all\"");
        expect_error("[Broker]\nDevices=64\n", 2, "expected \"all\"");
        expect_error("[Broker]\nDevices=1 1\n", 2, "device 1 is named twice");
        expect_error("[Broker]\nCapacity=0\n", 2, "Capacity=0: a pool of 0 bytes could lease nothing: set at least "
                     "a device's allocation granularity (2M on current GPUs)");
        expect_error("[Broker]\nCapacity=12X\n", 2, "expected a size such as 64G");
        expect_error("[Broker]\nCapacity=101%\n", 2, "a percentage must be 1%-100%");
        expect_error("[Broker]\nCapacity=0%\n", 2, "a percentage must be 1%-100%");
        expect_error("[Broker]\nCapacity=%\n", 2, "a percentage must be 1%-100%");
        expect_error("[Broker]\nMaxSlab=3G\n", 2, "expected a power of two");
        expect_error("[Broker]\nHostReserve=lots\n", 2, "expected a size such as 16G");
        expect_error("[Broker]\nHostSlab=48M\n", 2, "expected a power of two of at least 2M");
        expect_error("[Broker]\nHostSlab=1M\n", 2, "expected a power of two of at least 2M");
        expect_error("[Broker]\nAdminGroup=vmmb-no-such-group\n", 2, "no such group");
        expect_error("[Broker]\nScrubWaitBytes=-1\n", 2, "ScrubWaitBytes=-1: expected a size such as 256M, or 0");
        expect_error("[Broker]\nScrubWaitBytes=1P\n", 2, "expected a size such as 256M");
        expect_error("[Broker]\nScrubWaitBytes=99999999999T\n", 2, "expected a size such as 256M");
}
END_TEST

START_TEST(test_nothing_half_applied_on_error) {
        _cleanup_free_ char *message = NULL;
        Config c;

        /* A bad value leaves the key as it was (the daemon stops anyway, but the parser must not lie). */
        ck_assert_int_eq(load(&c, "[Broker]\nDevices=3\nDevices=4 x\n", &message), -EINVAL);
        ck_assert_uint_eq(c.manager.pool.n_devices, 1);
        ck_assert_int_eq(c.manager.pool.devices[0], 3);
        config_done(&c);
}
END_TEST

START_TEST(test_long_and_nul_lines) {
        _cleanup_free_ char *message = NULL, *text = NULL;
        Config c;
        FILE *f;

        text = malloc(5000);
        ck_assert_ptr_nonnull(text);
        memset(text, '#', 4999);
        text[4999] = 0;
        expect_error(text, 1, "longer than 4096 bytes");

        f = fopen(path, "we");
        ck_assert_ptr_nonnull(f);
        ck_assert_uint_eq(fwrite("[Broker]\nMaxSlab=1G\0x\n", 1, 23, f), 23);
        ck_assert_int_eq(fclose(f), 0);
        config_init(&c);
        ck_assert_int_eq(config_load(&c, path, &message), -EINVAL);
        ck_assert_msg(strstr(message, ":2: the line contains a NUL byte"), "%s", message);
        config_done(&c);
}
END_TEST

START_TEST(test_unreadable) {
        _cleanup_free_ char *message = NULL;
        Config c;

        /* A directory where the file should be: present but unreadable as a file. */
        ck_assert_int_eq(mkdir(path, 0755), 0);
        config_init(&c);
        ck_assert_int_lt(config_load(&c, path, &message), 0);
        ck_assert_msg(strstr(message, "cannot read") && strstr(message, path), "%s", message);
        config_done(&c);
}
END_TEST

START_TEST(test_set_from_option) {
        _cleanup_free_ char *message = NULL;
        Config c;

        ck_assert_int_eq(load(&c, "[Broker]\nCapacity=10G\n", &message), 0);
        ck_assert_int_eq(config_set(&c, "Capacity", "25%", "--capacity", &message), 0);
        ck_assert_uint_eq(c.manager.pool.capacity, 0);
        ck_assert_uint_eq(c.manager.pool.capacity_percent, 25);
        ck_assert_int_eq(config_set(&c, "MaxSlab", "7M", "--max-slab", &message), -EINVAL);
        ck_assert_str_eq(message, "--max-slab: MaxSlab=7M: expected a power of two such as 512M or 1G");
        config_done(&c);
}
END_TEST

START_TEST(test_print_round_trip) {
        _cleanup_free_ char *message = NULL, *first = NULL, *second = NULL;
        Config c;

        ck_assert_int_eq(load(&c, "[Broker]\nSocket=/run/x\nDevices=1,0\nCapacity=1536M\nMaxSlab=2G\n"
                                  "AdminGroup=root\nReplyTimeout=2min\nMaxConnectionsTotal=500\nMaxAllocWait=0\n"
                                  "Placement=first\nHostCapacity=0\nHostReserve=4G\nHostSlab=256M\nScrubWaitBytes=0\n"
                                  "[Limits]\nMaxBytes=40G\nMaxProcesses=12\n"
                                  "MaxHostBytes=8G\n[User:0]\nMaxLeases=7\nMaxProcesses=1\nMaxHostBytes=10%\n"
                                  "[Group:root]\nMaxBytes=50%\nMaxConnections=3\n",
                              &message), 0);
        first = printed(&c);
        ck_assert_str_eq(first, "[Broker]\n"
                                "Socket=/run/x\n"
                                "Devices=1 0\n"
                                "Capacity=1536M\n"
                                "MaxSlab=2G\n"
                                "AdminGroup=root\n"
                                "ReplyTimeout=2min\n"
                                "MaxConnectionsTotal=500\n"
                                "MaxAllocWait=0\n"
                                "Placement=first\n"
                                "ReclaimTimeout=5s\n"
                                "HostCapacity=0\n"
                                "HostReserve=4G\n"
                                "HostSlab=256M\n"
                                "ScrubWaitBytes=0\n"
                                "\n"
                                "[Limits]\n"
                                "MaxBytes=40G\n"
                                "MaxHostBytes=8G\n"
                                "MaxLeases=1024\n"
                                "MaxConnections=64\n"
                                "MaxProcesses=12\n"
                                "\n"
                                "[User:0]\n"
                                "MaxHostBytes=10%\n"
                                "MaxLeases=7\n"
                                "MaxProcesses=1\n"
                                "\n"
                                "[Group:root]\n"
                                "MaxBytes=50%\n"
                                "MaxConnections=3\n");
        config_done(&c);
        ck_assert_int_eq(load(&c, first, &message), 0);
        second = printed(&c);
        ck_assert_str_eq(first, second);
        config_done(&c);
}
END_TEST

START_TEST(test_limits) {
        _cleanup_free_ char *message = NULL;
        const LimitsConfig *lc;
        Config c;

        ck_assert_int_eq(load(&c, "[Limits]\nMaxBytes=64G\nMaxConnections=5\nMaxProcesses=6\n"
                                  "[User:root]\nMaxBytes=90%\n"
                                  "[Group:0]\nMaxLeases=10\nMaxProcesses=30\n"
                                  "[User:0]\nMaxConnections=9\n", &message), 0);
        lc = &c.manager.limits;
        ck_assert_uint_eq(lc->defaults.max_bytes, UINT64_C(64) << 30);
        ck_assert_uint_eq(lc->defaults.max_connections, 5);
        ck_assert_uint_eq(lc->defaults.max_leases, USER_DEFAULT_MAX_LEASES);
        ck_assert_uint_eq(lc->defaults.max_processes, 6);
        /* [User:root] and [User:0] are one rule; each sets only its own keys */
        ck_assert_uint_eq(lc->n_rules, 2);
        ck_assert(!lc->rules[0].group);
        ck_assert_uint_eq(lc->rules[0].id, 0);
        ck_assert_uint_eq(lc->rules[0].limits.set, LIMIT_MAX_BYTES | LIMIT_MAX_CONNECTIONS);
        ck_assert_uint_eq(lc->rules[0].limits.max_bytes_percent, 90);
        ck_assert_uint_eq(lc->rules[0].limits.max_connections, 9);
        ck_assert(lc->rules[1].group);
        ck_assert_uint_eq(lc->rules[1].limits.set, LIMIT_MAX_LEASES | LIMIT_MAX_PROCESSES);
        ck_assert_uint_eq(lc->rules[1].limits.max_processes, 30);
        config_done(&c);

        ck_assert_int_eq(load(&c, "[User:vmmb-no-such-user]\nMaxLeases=1\n", &message), -EINVAL);
        ck_assert_ptr_nonnull(strstr(message, ":1: [User:vmmb-no-such-user]: no such user"));
        config_done(&c);
        ck_assert_int_eq(load(&c, "[Group:]\n", &message), -EINVAL);
        config_done(&c);
        ck_assert_int_eq(load(&c, "[Limits]\nMaxLeases=1000001\n", &message), -EINVAL);
        ck_assert_ptr_nonnull(strstr(message, "MaxLeases=1000001: expected a number from 1 to 1000000"));
        config_done(&c);
        ck_assert_int_eq(load(&c, "[Limits]\nMaxBytes=101%\n", &message), -EINVAL);
        config_done(&c);
        ck_assert_int_eq(load(&c, "[Broker]\nMaxLeases=3\n", &message), -EINVAL);   /* a [Limits] key */
        config_done(&c);
        ck_assert_int_eq(load(&c, "[Broker]\nReplyTimeout=0\n", &message), -EINVAL);
        config_done(&c);
        ck_assert_int_eq(load(&c, "[Broker]\nReplyTimeout=5h\n", &message), -EINVAL);
        config_done(&c);
}
END_TEST

/* Values that could not work are refused with the smallest that would; an empty value still resets. */
START_TEST(test_zero_refused) {
        _cleanup_free_ char *message = NULL;
        Config c;

        expect_error("[Limits]\nMaxLeases=0\n", 2, "MaxLeases=0: must be at least 1: with 0 the user could lease "
                     "nothing");
        expect_error("[Limits]\nMaxConnections=00\n", 2, "MaxConnections=00: must be at least 1: with 0 the user "
                     "could not connect at all");
        expect_error("[Limits]\nMaxProcesses=0\n", 2, "MaxProcesses=0: must be at least 1: a process that "
                     "connects counts, so with 0 the user could not connect at all");
        expect_error("[User:0]\nMaxProcesses=0\n", 2, "MaxProcesses=0: must be at least 1");
        expect_error("[Group:0]\nMaxConnections=0\n", 2, "MaxConnections=0: must be at least 1");
        expect_error("[Limits]\nMaxBytes=0\n", 2, "MaxBytes=0: with 0 the user could lease nothing: set at least "
                     "a device's allocation granularity (2M on current GPUs), or a percentage");
        expect_error("[Limits]\nMaxBytes=0K\n", 2, "MaxBytes=0K: with 0 the user could lease nothing");
        expect_error("[Limits]\nMaxBytes=0%\n", 2, "MaxBytes=0%: a percentage must be 1%-100%");
        expect_error("[Broker]\nReplyTimeout=0\n", 2, "ReplyTimeout=0: must be at least 1ms: with 0 every "
                     "connection would be closed as soon as a reply waited for it");
        expect_error("[Broker]\nReplyTimeout=0ms\n", 2, "ReplyTimeout=0ms: must be at least 1ms");
        expect_error("[Broker]\nReplyTimeout=0min\n", 2, "ReplyTimeout=0min: must be at least 1ms");
        expect_error("[Broker]\nReplyTimeout=1h\n", 2, "ReplyTimeout=1h: expected a time such as 30s");
        expect_error("[Broker]\nMaxAllocWait=soon\n", 2, "MaxAllocWait=soon: expected a time such as 30s");
        expect_error("[Broker]\nMaxConnectionsTotal=0\n", 2, "MaxConnectionsTotal=0: must be at least 1: with 0 "
                     "nobody could connect (leave it empty to derive it from the fd limit)");
        expect_error("[Broker]\nMaxConnectionsTotal=-5\n", 2, "MaxConnectionsTotal=-5: expected a number from 1 "
                     "to 1000000");
        expect_error("[Broker]\nMaxConnectionsTotal=1000001\n", 2, "expected a number from 1 to 1000000");
        expect_error("[Broker]\nMaxProcesses=3\n", 2, "unknown key \"MaxProcesses\" in [Broker]");
        expect_error("[Limits]\nMaxConnectionsTotal=3\n", 2, "unknown key \"MaxConnectionsTotal\" in [Limits]");

        /* The command line goes through the same parser. */
        config_init(&c);
        ck_assert_int_eq(config_set(&c, "MaxConnectionsTotal", "0", "--max-connections-total", &message), -EINVAL);
        ck_assert_str_eq(message, "--max-connections-total: MaxConnectionsTotal=0: must be at least 1: with 0 "
                                  "nobody could connect (leave it empty to derive it from the fd limit)");
        ck_assert_int_eq(config_set(&c, "ReplyTimeout", "0s", "--reply-timeout", &message), -EINVAL);
        ck_assert_str_eq(message, "--reply-timeout: ReplyTimeout=0s: must be at least 1ms: with 0 every connection "
                                  "would be closed as soon as a reply waited for it");
        config_done(&c);

        /* The smallest values are taken; an empty value goes back to the default. */
        ck_assert_int_eq(load(&c, "[Broker]\nMaxConnectionsTotal=1\nReplyTimeout=1ms\n"
                                  "[Limits]\nMaxLeases=1\nMaxConnections=1\nMaxProcesses=1\nMaxBytes=1\n",
                              &message), 0);
        ck_assert_uint_eq(c.manager.max_connections_total, 1);
        ck_assert_uint_eq(c.manager.reply_timeout_usec, 1000);
        ck_assert_uint_eq(c.manager.limits.defaults.max_leases, 1);
        ck_assert_uint_eq(c.manager.limits.defaults.max_connections, 1);
        ck_assert_uint_eq(c.manager.limits.defaults.max_processes, 1);
        ck_assert_uint_eq(c.manager.limits.defaults.max_bytes, 1);
        config_done(&c);
        ck_assert_int_eq(load(&c, "[Broker]\nMaxConnectionsTotal=9\nMaxConnectionsTotal=\nReplyTimeout=5s\n"
                                  "ReplyTimeout=\n[Limits]\nMaxProcesses=3\nMaxProcesses=\nMaxLeases=2\n"
                                  "MaxLeases=\nMaxConnections=2\nMaxConnections=\nMaxBytes=1G\nMaxBytes=\n",
                              &message), 0);
        ck_assert_uint_eq(c.manager.max_connections_total, 0);
        ck_assert_uint_eq(c.manager.reply_timeout_usec, 0);
        ck_assert_uint_eq(c.manager.limits.defaults.max_processes, USER_DEFAULT_MAX_PROCESSES);
        ck_assert_uint_eq(c.manager.limits.defaults.max_leases, USER_DEFAULT_MAX_LEASES);
        ck_assert_uint_eq(c.manager.limits.defaults.max_connections, USER_DEFAULT_MAX_CONNECTIONS);
        ck_assert_uint_eq(c.manager.limits.defaults.max_bytes, 0);
        ck_assert_uint_eq(c.manager.limits.defaults.max_bytes_percent, USER_DEFAULT_MAX_BYTES_PERCENT);
        config_done(&c);

        /* A value refused leaves the key as it was. */
        ck_assert_int_eq(load(&c, "[Broker]\nMaxConnectionsTotal=70\nMaxConnectionsTotal=0\n", &message), -EINVAL);
        ck_assert_uint_eq(c.manager.max_connections_total, 70);
        config_done(&c);
}
END_TEST

/*
 * The pool (on the simulated device, 2 MiB granularity) with `text` as the configuration: pool_new()'s result,
 * its message in *ret_message and, when it succeeds, device 0's capacity in *ret_capacity.
 */
static int pool_with(const char *text, uint64_t *ret_capacity, char **ret_message) {
        _cleanup_free_ char *message = NULL;
        CudaDriver *cu = NULL;
        Pool *pool = NULL;
        PoolDeviceStats st;
        Config c;
        int k;

        ck_assert_int_eq(load(&c, text, &message), 0);
        ck_assert_msg(cuda_driver_open(&cu, NULL, &message) == 0, "%s", message);
        k = pool_new(&pool, cu, &c.manager.pool, ret_message);
        if (k == 0) {
                pool_device_stats(pool, 0, &st);
                *ret_capacity = st.capacity;
        }
        pool_free(pool);
        cuda_driver_close(cu);
        config_done(&c);
        return k;
}

START_TEST(test_capacity_below_granularity) {
        _cleanup_free_ char *message = NULL;
        uint64_t capacity = 0;

        ck_assert_int_eq(pool_with("[Broker]\nCapacity=1K\n", &capacity, &message), -EINVAL);
        ck_assert_str_eq(message, "Capacity=1K gives device 0 a pool of 1 KiB, less than its allocation granularity "
                                  "(2 MiB): it could lease nothing. Set Capacity= to at least 2M.");
        ck_assert_int_eq(pool_with("[Broker]\nCapacity=2097151\n", &capacity, &message), -EINVAL);
        ck_assert_str_eq(message, "Capacity=2097151 gives device 0 a pool of 2097151 bytes, less than its allocation "
                                  "granularity (2 MiB): it could lease nothing. Set Capacity= to at least 2M.");

        /* The granularity itself is enough; above it, the capacity is rounded down to a multiple of it. */
        ck_assert_int_eq(pool_with("[Broker]\nCapacity=2M\n", &capacity, &message), 0);
        ck_assert_uint_eq(capacity, UINT64_C(2) << 20);
        ck_assert_int_eq(pool_with("[Broker]\nCapacity=5M\n", &capacity, &message), 0);
        ck_assert_uint_eq(capacity, UINT64_C(4) << 20);
}
END_TEST

START_TEST(test_capacity_percent_below_granularity) {
        _cleanup_free_ char *message = NULL;
        uint64_t capacity = 0;

        /* Each test runs in a process of its own, which loads the simulator afresh: it reads this. */
        ck_assert_int_eq(setenv("SIMCUDA_MEMORY", "100M", 1), 0);
        ck_assert_int_eq(pool_with("[Broker]\nCapacity=1%\n", &capacity, &message), -EINVAL);
        ck_assert_str_eq(message, "Capacity=1% gives device 0 a pool of 1 MiB (1% of the 100 MiB free at start), "
                                  "less than its allocation granularity (2 MiB): it could lease nothing. Free memory "
                                  "on the device, or set Capacity= to a larger share or to at least 2M.");
        ck_assert_int_eq(pool_with("[Broker]\nCapacity=2%\n", &capacity, &message), 0);
        ck_assert_uint_eq(capacity, UINT64_C(2) << 20);
}
END_TEST

int main(void) {
        Suite *s = suite_create("config");
        TCase *tc = tcase_create("config");

        tcase_add_checked_fixture(tc, setup, teardown);
        tcase_add_test(tc, test_defaults_without_file);
        tcase_add_test(tc, test_every_key);
        tcase_add_test(tc, test_percent_and_reset);
        tcase_add_test(tc, test_drop_ins);
        tcase_add_test(tc, test_errors_name_the_line);
        tcase_add_test(tc, test_nothing_half_applied_on_error);
        tcase_add_test(tc, test_long_and_nul_lines);
        tcase_add_test(tc, test_unreadable);
        tcase_add_test(tc, test_set_from_option);
        tcase_add_test(tc, test_print_round_trip);
        tcase_add_test(tc, test_limits);
        tcase_add_test(tc, test_zero_refused);
        tcase_add_test(tc, test_capacity_below_granularity);
        tcase_add_test(tc, test_capacity_percent_below_granularity);
        suite_add_tcase(s, tc);
        return run_suite(s) == 0 ? 0 : 1;
}
