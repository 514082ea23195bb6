/* SPDX-License-Identifier: MIT */

/*
 * What the service manager and an administrator see of vmmbrokerd: socket
 * activation by systemd-socket-activate (the daemon starts on the first
 * connection and serves it), the READY, WATCHDOG and STOPPING notifications
 * (sent by the daemon's own pid, as NotifyAccess=main requires), a bad
 * configuration file stopping start-up with its line named, and
 * --print-config.
 */

#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "codec.h"
#include "harness.h"
#include "macro.h"
#include "unit.h"
#include "varlink.h"

#define NOTIFY_TIMEOUT_MS 30000         /* failure guard: a notification that never comes */

/* A private directory for one test's sockets and files. */
typedef struct Scratch {
        char dir[64];
        char socket[128];
        char notify[128];
        char config[128];
} Scratch;

static void scratch_init(Scratch *s) {
        strcpy(s->dir, "/tmp/vmmb-service-XXXXXX");
        ck_assert_ptr_nonnull(mkdtemp(s->dir));
        snprintf(s->socket, sizeof(s->socket), "%s/io.vmmbroker", s->dir);
        snprintf(s->notify, sizeof(s->notify), "%s/notify", s->dir);
        snprintf(s->config, sizeof(s->config), "%s/vmmbroker.conf", s->dir);
}

static void scratch_done(Scratch *s) {
        char cmd[128];

        snprintf(cmd, sizeof(cmd), "rm -rf '%s'", s->dir);
        ck_assert_int_eq(system(cmd), 0);
}

/*
 * Runs argv with `env` (NAME=VALUE strings, NULL-terminated) added to the
 * environment, its stdout and stderr into one pipe whose read end is
 * *ret_output. The child gets SIGTERM if the test dies.
 */
static pid_t spawn(const char *const *argv, const char *const *env, int *ret_output) {
        pid_t parent = getpid(), pid;
        int p[2];

        ck_assert_int_eq(pipe2(p, O_CLOEXEC), 0);
        fflush(stdout);
        fflush(stderr);
        pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
                if (prctl(PR_SET_PDEATHSIG, SIGTERM) < 0 || getppid() != parent)
                        _exit(127);
                if (dup2(p[1], STDOUT_FILENO) < 0 || dup2(p[1], STDERR_FILENO) < 0)
                        _exit(127);
                for (size_t i = 0; env && env[i]; i++)
                        putenv((char *)env[i]);
                execv(argv[0], (char *const *)argv);
                _exit(127);
        }
        close(p[1]);
        *ret_output = p[0];
        return pid;
}

/*
 * Reads the pipe until `needle` shows up in what was read (kept in buf), or to EOF when needle is NULL.
 * Returns whether it found the needle (or reached EOF).
 */
static bool read_until(int fd, const char *needle, char *buf, size_t len) {
        size_t used = strlen(buf);

        while ((!needle || !strstr(buf, needle)) && used < len - 1) {
                struct pollfd p = { .fd = fd, .events = POLLIN };
                ssize_t n;

                if (poll(&p, 1, NOTIFY_TIMEOUT_MS) <= 0)
                        return false;
                n = read(fd, buf + used, len - 1 - used);
                if (n <= 0)
                        return !needle;
                used += (size_t)n;
                buf[used] = 0;
        }
        return !needle || strstr(buf, needle);
}

/* Waits for a notification containing the line `line`, sent by `pid`; other notifications are skipped. */
static void expect_notification(int fd, pid_t pid, const char *line) {
        for (;;) {
                char buf[4096], *save = NULL;
                pid_t sender;
                int k;

                k = harness_notify_receive(fd, NOTIFY_TIMEOUT_MS, buf, sizeof(buf), &sender);
                ck_assert_msg(k == 0, "waiting for %s: %s", line, strerror(-k));
                ck_assert_msg(sender == pid, "\"%s\" came from pid %d, not the daemon's %d", buf, (int)sender,
                              (int)pid);
                for (char *l = strtok_r(buf, "\n", &save); l; l = strtok_r(NULL, "\n", &save))
                        if (strcmp(l, line) == 0)
                                return;
        }
}

/* Stops the daemon with SIGTERM and returns how it exited (128 + signal if killed). */
static int terminate(pid_t pid) {
        ck_assert_int_eq(kill(pid, SIGTERM), 0);
        return harness_wait(pid);
}

START_TEST(test_socket_activation) {
        const char *activate = getenv("SYSTEMD_SOCKET_ACTIVATE");
        const char *daemon = getenv("VMMBROKER_DAEMON");
        _cleanup_close_ int notify = -EBADF, output = -EBADF;
        char notify_env[160], output_text[8192] = "";
        VarlinkConn *c = NULL;
        WireDevice dev;
        Scratch s;
        pid_t pid;

        ck_assert_ptr_nonnull(activate);
        scratch_init(&s);
        notify = harness_notify_socket(s.notify);
        ck_assert_int_ge(notify, 0);
        snprintf(notify_env, sizeof(notify_env), "NOTIFY_SOCKET=%s", s.notify);

        /* systemd-socket-activate passes on only the variables named with -E. */
        pid = spawn((const char *const[]){ activate, "--listen", s.socket, "-E", "VMMBROKER_LIBCUDA",
                                           "-E", "NOTIFY_SOCKET", "-E", "ASAN_OPTIONS", "-E", "UBSAN_OPTIONS",
                                           daemon, "--config", s.config, NULL },
                    (const char *const[]){ notify_env, "SYSTEMD_LOG_TARGET=console", NULL }, &output);

        /* It listens first, and starts the daemon only when someone connects. */
        ck_assert_msg(read_until(output, "Listening on", output_text, sizeof(output_text)),
                      "systemd-socket-activate did not listen: %s", output_text);
        ck_assert_int_eq(harness_conn_open(s.socket, false, &c), 0);
        expect_notification(notify, pid, "READY=1");

        /* The connection that started it is served. */
        ck_assert_int_eq(harness_status_on(c, &dev), 0);
        ck_assert_int_eq(dev.index, 0);
        ck_assert_uint_gt(dev.capacity, 0);
        c = varlink_conn_free(c);

        ck_assert_int_eq(terminate(pid), 0);
        expect_notification(notify, pid, "STOPPING=1");
        ck_assert(read_until(output, "serving 1 device(s) on the socket passed by the service manager", output_text,
                             sizeof(output_text)));
        scratch_done(&s);
}
END_TEST

START_TEST(test_watchdog) {
        const char *daemon = getenv("VMMBROKER_DAEMON");
        _cleanup_close_ int notify = -EBADF, output = -EBADF;
        char notify_env[160];
        Scratch s;
        pid_t pid;

        scratch_init(&s);
        notify = harness_notify_socket(s.notify);
        ck_assert_int_ge(notify, 0);
        snprintf(notify_env, sizeof(notify_env), "NOTIFY_SOCKET=%s", s.notify);

        /* WatchdogSec=50ms: the daemon must ping at least every 50 ms while idle. */
        pid = spawn((const char *const[]){ daemon, "--socket", s.socket, "--config", s.config, NULL },
                    (const char *const[]){ notify_env, "WATCHDOG_USEC=50000", NULL }, &output);
        expect_notification(notify, pid, "READY=1");
        for (int i = 0; i < 5; i++)
                expect_notification(notify, pid, "WATCHDOG=1");
        ck_assert_int_eq(terminate(pid), 0);
        expect_notification(notify, pid, "STOPPING=1");
        scratch_done(&s);
}
END_TEST

/* Runs the daemon with `args` until it exits; returns its exit status and its output in buf. */
static int run_daemon(const char *const *args, char *buf, size_t len) {
        const char *argv[16] = { getenv("VMMBROKER_DAEMON") };
        _cleanup_close_ int output = -EBADF;
        size_t n = 1;
        pid_t pid;

        for (size_t i = 0; args[i] && n < ELEMENTSOF(argv) - 1; i++)
                argv[n++] = args[i];
        pid = spawn(argv, NULL, &output);
        buf[0] = 0;
        ck_assert(read_until(output, NULL, buf, len));
        return harness_wait(pid);
}

static void write_text(const char *path, const char *text) {
        FILE *f = fopen(path, "we");

        ck_assert_ptr_nonnull(f);
        ck_assert_int_ge(fputs(text, f), 0);
        ck_assert_int_eq(fclose(f), 0);
}

START_TEST(test_bad_config_stops_start_up) {
        char out[4096], expected[256];
        Scratch s;

        scratch_init(&s);
        write_text(s.config, "[Broker]\nCapacity=80%\nCapcity=1G\n");
        ck_assert_int_eq(run_daemon((const char *const[]){ "--config", s.config, "--socket", s.socket, NULL }, out,
                                    sizeof(out)),
                         2);
        snprintf(expected, sizeof(expected), "vmmbrokerd: %s:3: unknown key \"Capcity\" in [Broker]\n", s.config);
        ck_assert_str_eq(out, expected);
        ck_assert_int_eq(access(s.socket, F_OK), -1);           /* it stopped before binding anything */

        /* A bad option value is named the same way; both, like a bad option, are usage errors (2). */
        write_text(s.config, "[Broker]\nCapacity=80%\n");
        ck_assert_int_eq(run_daemon((const char *const[]){ "--config", s.config, "--capacity", "200%", NULL }, out,
                                    sizeof(out)),
                         2);
        ck_assert_str_eq(out, "vmmbrokerd: --capacity: Capacity=200%: a percentage must be 1%-100%\n");
        ck_assert_int_eq(run_daemon((const char *const[]){ "--no-such-option", NULL }, out, sizeof(out)), 2);
        ck_assert_int_eq(run_daemon((const char *const[]){ "--admin-group", "vmmb-no-such-group", "--config",
                                                           s.config, NULL }, out, sizeof(out)),
                         2);
        ck_assert_msg(strstr(out, "AdminGroup=vmmb-no-such-group: no such group"), "%s", out);
        scratch_done(&s);
}
END_TEST

START_TEST(test_print_config) {
        char out[4096], drop_in[160];
        Scratch s;

        scratch_init(&s);
        write_text(s.config, "[Broker]\nCapacity=80%\nMaxSlab=256M\nDevices=0\n");
        snprintf(drop_in, sizeof(drop_in), "%s.d", s.config);
        ck_assert_int_eq(mkdir(drop_in, 0755), 0);
        snprintf(drop_in, sizeof(drop_in), "%s.d/50-slab.conf", s.config);
        write_text(drop_in, "[Broker]\nMaxSlab=512M\n");

        /* The file, its drop-in over it, then the options over both. */
        ck_assert_int_eq(run_daemon((const char *const[]){ "--config", s.config, "--capacity", "2G", "--device", "1",
                                                           "--device", "0", "--print-config", NULL },
                                    out, sizeof(out)),
                         0);
        ck_assert_str_eq(out, "[Broker]\n"
                              "Socket=/run/vmmbroker/io.vmmbroker\n"
                              "Devices=1 0\n"
                              "Capacity=2G\n"
                              "MaxSlab=512M\n"
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
        scratch_done(&s);
}
END_TEST

int main(void) {
        Suite *s = UNIT_SUITE("service", NULL, test_socket_activation, test_watchdog, test_bad_config_stops_start_up,
                              test_print_config);

        return run_suite(s) == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
