/* SPDX-License-Identifier: MIT */

/*
 * The test supervisor (supervisor.h) against fake-daemon.c, which uses libsystemd's own
 * sd_listen_fds_with_names() and sd_pid_notify_with_fds(): stored fds come back by name with their
 * contents after SIGTERM and SIGKILL restarts, removed names stay gone, fds from a foreign pid and over
 * FileDescriptorStoreMax= are closed, polled fds that hang up are dropped, the listening socket is the
 * same across restarts (a client that connected while the daemon was down is served by the next one),
 * and READY=1 timing, the stop guard and the watchdog work.
 */

#include <check.h>
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "harness.h"
#include "macro.h"
#include "supervisor.h"
#include "unit.h"

#define READY_TIMEOUT_MS 30000

static const char *fake_daemon(void) {
        const char *p = getenv("SUPERVISOR_FAKE_DAEMON");

        ck_assert_ptr_nonnull(p);
        return p;
}

static Supervisor *new_supervisor(const SupervisorOptions *extra) {
        SupervisorOptions o = extra ? *extra : (SupervisorOptions){ .fd_store_max = 64 };
        Supervisor *s = NULL;

        if (!o.path)
                o.path = fake_daemon();
        ck_assert_int_eq(supervisor_new(&o, &s), 0);
        return s;
}

static Supervisor *started(const SupervisorOptions *extra) {
        Supervisor *s = new_supervisor(extra);

        ck_assert_int_eq(supervisor_start(s), 0);
        ck_assert_int_gt(supervisor_wait_ready(s, READY_TIMEOUT_MS), 0);
        return s;
}

/* Reads one line (without its newline) from fd; the socket's own timeout guards it. */
static char *read_line(int fd) {
        char buf[8192];
        size_t n = 0;

        while (n < sizeof(buf) - 1) {
                ssize_t k = read(fd, buf + n, 1);

                ck_assert_int_eq(k, 1);
                if (buf[n] == '\n')
                        break;
                n++;
        }
        buf[n] = 0;
        return strdup(buf);
}

static void write_line(int fd, const char *line) {
        size_t len = strlen(line);

        ck_assert_int_eq(write(fd, line, len), (ssize_t)len);
        ck_assert_int_eq(write(fd, "\n", 1), 1);
}

/* Sends one command to the daemon on a connection of its own and returns the reply (malloc'd). */
_printf_(2, 3) static char *command(Supervisor *s, const char *format, ...) {
        _cleanup_close_ int fd = harness_connect(supervisor_socket_path(s));
        char line[1024];
        va_list ap;

        ck_assert_int_ge(fd, 0);
        va_start(ap, format);
        vsnprintf(line, sizeof(line), format, ap);
        va_end(ap);
        write_line(fd, line);
        return read_line(fd);
}

_printf_(2, 3) static void command_ok(Supervisor *s, const char *format, ...) {
        _cleanup_free_ char *reply = NULL;
        char line[1024];
        va_list ap;

        va_start(ap, format);
        vsnprintf(line, sizeof(line), format, ap);
        va_end(ap);
        reply = command(s, "%s", line);
        ck_assert_msg(strcmp(reply, "ok") == 0, "%s: %s", line, reply);
}

static void assert_reply(Supervisor *s, const char *cmd, const char *expected) {
        _cleanup_free_ char *reply = command(s, "%s", cmd);

        ck_assert_str_eq(reply, expected);
}

/* What the daemon says it was passed, with @ standing for the listening socket's inode. */
static void assert_fds(Supervisor *s, const char *expected_after_socket, const char *socket_name) {
        char expected[4096];
        struct stat st;

        ck_assert_int_eq(fstat(supervisor_listen_fd(s), &st), 0);
        snprintf(expected, sizeof(expected), "%s:listen@%llu%s%s", socket_name, (unsigned long long)st.st_ino,
                 *expected_after_socket ? " " : "", expected_after_socket);
        assert_reply(s, "fds", expected);
}

static void assert_stored_content(Supervisor *s, const char *name, int count, const char *content) {
        _cleanup_close_ int fd = -EBADF;
        char buf[256];
        ssize_t n;

        ck_assert_int_eq(supervisor_store_find(s, name, &fd), count);
        if (count == 0) {
                ck_assert_int_lt(fd, 0);
                return;
        }
        n = pread(fd, buf, sizeof(buf) - 1, 0);
        ck_assert_int_ge(n, 0);
        buf[n] = 0;
        ck_assert_str_eq(buf, content);
}

START_TEST(test_start_ready_stop) {
        Supervisor *s = new_supervisor(NULL);
        _cleanup_free_ char *pid = NULL, *status = NULL;
        SupervisorStats st;
        int64_t ready;

        ck_assert_int_eq(supervisor_wait_ready(s, 0), -ESRCH);
        ck_assert_int_eq(supervisor_start(s), 0);
        ck_assert_int_eq(supervisor_start(s), -EBUSY);
        ready = supervisor_wait_ready(s, READY_TIMEOUT_MS);
        ck_assert_int_gt(ready, 0);
        ck_assert_int_lt(ready, READY_TIMEOUT_MS * 1000LL);
        ck_assert_int_eq(supervisor_ready_usec(s), ready);

        pid = command(s, "pid");
        ck_assert_int_eq(atoi(pid), supervisor_pid(s));
        assert_reply(s, "env", "LISTEN_FDS=1 LISTEN_FDNAMES=varlink LISTEN_PID=ok NOTIFY_SOCKET=set WATCHDOG_USEC=0");
        assert_fds(s, "", "varlink");
        status = supervisor_status(s);
        ck_assert_str_eq(status, "serving");
        command_ok(s, "status busy");
        free(status);
        status = supervisor_status(s);
        ck_assert_str_eq(status, "busy");

        ck_assert_int_eq(supervisor_stop(s, SIGTERM), 0);
        ck_assert_int_eq(supervisor_last_exit(s), 0);
        ck_assert_int_eq(supervisor_pid(s), 0);
        ck_assert_int_eq(supervisor_ready_usec(s), -1);
        ck_assert_int_eq(supervisor_stop(s, SIGTERM), -ESRCH);
        st = supervisor_stats(s);
        ck_assert_uint_eq(st.starts, 1);
        ck_assert_uint_ge(st.messages, 3);      /* READY=1, STATUS=busy, STOPPING=1 */
        ck_assert_uint_eq(st.foreign, 0);
        supervisor_free(s);
}
END_TEST

/* Stored memfds come back by name with their contents, newest first, after SIGTERM and SIGKILL restarts in
 * either order; a removed name does not. */
START_TEST(test_store_survives_restarts) {
        const int sigs[2] = { _i == 0 ? SIGTERM : SIGKILL, _i == 0 ? SIGKILL : SIGTERM };
        Supervisor *s = started(NULL);

        command_ok(s, "store a alpha");
        command_ok(s, "store b beta nopoll");
        command_ok(s, "store - anonymous");
        command_ok(s, "store c gamma nopoll");
        command_ok(s, "remove b");
        ck_assert_int_eq(supervisor_store_count(s), 3);
        assert_stored_content(s, "a", 1, "alpha");
        assert_stored_content(s, "b", 0, NULL);
        assert_stored_content(s, "stored", 1, "anonymous");
        assert_stored_content(s, "c", 1, "gamma");

        ck_assert_int_gt(supervisor_restart(s, sigs[0], READY_TIMEOUT_MS), 0);
        ck_assert_int_eq(supervisor_last_exit(s), sigs[0] == SIGTERM ? 0 : 128 + SIGKILL);
        assert_reply(s, "env",
                     "LISTEN_FDS=4 LISTEN_FDNAMES=varlink:c:stored:a LISTEN_PID=ok NOTIFY_SOCKET=set WATCHDOG_USEC=0");
        assert_fds(s, "c:memfd=gamma stored:memfd=anonymous a:memfd=alpha", "varlink");

        /* The new process changes the store; the next restart hands that on. */
        command_ok(s, "store d delta nopoll");
        command_ok(s, "remove a");
        ck_assert_int_eq(supervisor_store_count(s), 3);
        ck_assert_int_gt(supervisor_restart(s, sigs[1], READY_TIMEOUT_MS), 0);
        ck_assert_int_eq(supervisor_last_exit(s), sigs[1] == SIGTERM ? 0 : 128 + SIGKILL);
        assert_fds(s, "d:memfd=delta c:memfd=gamma stored:memfd=anonymous", "varlink");
        assert_stored_content(s, "a", 0, NULL);
        ck_assert_uint_eq(supervisor_stats(s).fds_removed, 2);
        supervisor_free(s);
}
END_TEST

/* FDSTOREREMOVE=1 removes every fd of the name; fds stored again by the process they were passed to are
 * duplicates and do not add up. */
START_TEST(test_remove_all_of_name_and_duplicates) {
        Supervisor *s = started(NULL);

        command_ok(s, "store x one nopoll");
        command_ok(s, "store x two nopoll");
        command_ok(s, "store y three nopoll");
        ck_assert_int_eq(supervisor_store_find(s, "x", NULL), 2);
        assert_stored_content(s, "x", 2, "one");        /* the oldest of the name */
        command_ok(s, "remove x");
        ck_assert_int_eq(supervisor_store_count(s), 1);
        ck_assert_int_eq(supervisor_store_find(s, "x", NULL), 0);

        ck_assert_int_gt(supervisor_restart(s, SIGKILL, READY_TIMEOUT_MS), 0);
        assert_fds(s, "y:memfd=three", "varlink");
        command_ok(s, "restore y");
        ck_assert_int_eq(supervisor_store_count(s), 1);
        ck_assert_uint_eq(supervisor_stats(s).fds_duplicate, 1);
        supervisor_free(s);
}
END_TEST

/* Notifications from another pid are ignored and their fds closed; fds without FDSTORE=1 are closed. */
START_TEST(test_foreign_and_unexpected_fds) {
        Supervisor *s = started(NULL);
        SupervisorStats st;
        int before;

        ck_assert_int_eq(supervisor_store_count(s), 0);
        before = harness_fd_count(getpid());
        command_ok(s, "foreign evil payload");
        ck_assert_int_eq(supervisor_store_count(s), 0);
        command_ok(s, "raw 2 STATUS=with-fds");
        ck_assert_int_eq(supervisor_store_count(s), 0);
        ck_assert_int_eq(harness_fd_count(getpid()), before);
        st = supervisor_stats(s);
        ck_assert_uint_eq(st.foreign, 1);
        ck_assert_uint_eq(st.fds_foreign, 1);
        ck_assert_uint_eq(st.fds_unexpected, 2);
        ck_assert_uint_eq(st.fds_stored, 0);

        ck_assert_int_gt(supervisor_restart(s, SIGTERM, READY_TIMEOUT_MS), 0);
        assert_fds(s, "", "varlink");
        supervisor_free(s);
}
END_TEST

/* FileDescriptorStoreMax=: fds over it are closed, those before it kept, and nothing more gets in. */
START_TEST(test_store_limit) {
        Supervisor *s = started(&(SupervisorOptions){ .fd_store_max = 3 });
        SupervisorStats st;
        int before;

        before = harness_fd_count(getpid());
        command_ok(s, "storemany 5 m");
        command_ok(s, "store late late");
        ck_assert_int_eq(supervisor_store_count(s), 3);
        ck_assert_int_eq(harness_fd_count(getpid()), before + 3);
        st = supervisor_stats(s);
        ck_assert_uint_eq(st.fds_stored, 3);
        ck_assert_uint_eq(st.fds_full, 3);
        ck_assert_uint_eq(st.fds_unexpected, 0);
        ck_assert_int_eq(supervisor_store_find(s, "late", NULL), 0);

        ck_assert_int_gt(supervisor_restart(s, SIGKILL, READY_TIMEOUT_MS), 0);
        assert_fds(s, "m:memfd=m-2 m:memfd=m-1 m:memfd=m-0", "varlink");
        supervisor_free(s);

        /* FileDescriptorStoreMax=0, systemd's default: nothing is stored. */
        s = started(&(SupervisorOptions){ .fd_store_max = 0 });
        command_ok(s, "store a alpha");
        ck_assert_int_eq(supervisor_store_count(s), 0);
        ck_assert_uint_eq(supervisor_stats(s).fds_full, 1);
        supervisor_free(s);
}
END_TEST

/* Without FDPOLL=0 a stored fd that hangs up is dropped, whether that happens while the daemon runs or
 * because it died; with FDPOLL=0 it stays, and memfds never hang up. */
START_TEST(test_fdpoll) {
        Supervisor *s = started(NULL);

        command_ok(s, "pipe p1 poll");
        command_ok(s, "pipe p2 nopoll");
        command_ok(s, "store m memo");
        command_ok(s, "pipe p3 poll");
        ck_assert_int_eq(supervisor_store_count(s), 4);
        command_ok(s, "closepipe p1");
        ck_assert_int_eq(supervisor_store_count(s), 3);
        ck_assert_int_eq(supervisor_store_find(s, "p1", NULL), 0);

        /* The daemon's death closes the write ends of p2 and p3. */
        ck_assert_int_gt(supervisor_restart(s, SIGKILL, READY_TIMEOUT_MS), 0);
        assert_fds(s, "m:memfd=memo p2:pipe", "varlink");
        ck_assert_uint_eq(supervisor_stats(s).fds_hangup, 2);
        supervisor_free(s);
}
END_TEST

/* The socket is bound once: a client that connects while no daemon runs waits in the backlog and is
 * served by the next process, which accepts it on the same socket. */
START_TEST(test_client_waits_across_restart) {
        Supervisor *s = started(NULL);
        _cleanup_free_ char *old_pid = command(s, "pid"), *reply = NULL;
        _cleanup_close_ int fd = -EBADF;

        ck_assert_int_eq(supervisor_stop(s, SIGKILL), 128 + SIGKILL);
        fd = harness_connect(supervisor_socket_path(s));
        ck_assert_int_ge(fd, 0);
        write_line(fd, "pid");
        ck_assert_int_eq(supervisor_start(s), 0);
        ck_assert_int_gt(supervisor_wait_ready(s, READY_TIMEOUT_MS), 0);
        reply = read_line(fd);
        ck_assert_int_eq(atoi(reply), supervisor_pid(s));
        ck_assert_int_ne(atoi(reply), atoi(old_pid));
        assert_fds(s, "", "varlink");
        supervisor_free(s);
}
END_TEST

START_TEST(test_exit_before_ready_and_bad_path) {
        Supervisor *s = new_supervisor(&(SupervisorOptions){
                .argv = (const char *const[]){ fake_daemon(), "--exit-before-ready", "3", NULL } });

        ck_assert_int_eq(supervisor_start(s), 0);
        ck_assert_int_eq(supervisor_wait_ready(s, READY_TIMEOUT_MS), -ECHILD);
        ck_assert_int_eq(supervisor_wait_exit(s, READY_TIMEOUT_MS), 3);
        ck_assert_int_eq(supervisor_last_exit(s), 3);
        ck_assert_int_eq(supervisor_pid(s), 0);
        supervisor_free(s);

        s = new_supervisor(&(SupervisorOptions){ .path = "/nonexistent/daemon" });
        ck_assert_int_eq(supervisor_start(s), -ENOENT);
        ck_assert_int_eq(supervisor_pid(s), 0);
        supervisor_free(s);
}
END_TEST

/* TimeoutStopSec=: a daemon that ignores SIGTERM gets SIGKILL; the store is kept all the same. */
START_TEST(test_stop_guard) {
        Supervisor *s = started(&(SupervisorOptions){ .fd_store_max = 4, .stop_timeout_ms = 200 });

        command_ok(s, "store a alpha");
        command_ok(s, "ignoreterm");
        ck_assert_int_eq(supervisor_stop(s, SIGTERM), -ETIMEDOUT);
        ck_assert_int_eq(supervisor_last_exit(s), 128 + SIGKILL);
        ck_assert_int_eq(supervisor_pid(s), 0);
        ck_assert_int_eq(supervisor_start(s), 0);
        ck_assert_int_gt(supervisor_wait_ready(s, READY_TIMEOUT_MS), 0);
        assert_fds(s, "a:memfd=alpha", "varlink");
        supervisor_free(s);
}
END_TEST

/* WatchdogSec=: the daemon gets WATCHDOG_USEC and WATCHDOG_PID (sd_watchdog_enabled() says so), is kept
 * alive by its pings, and gets SIGABRT when they stop or on WATCHDOG=trigger. */
START_TEST(test_watchdog) {
        Supervisor *s = started(&(SupervisorOptions){ .fd_store_max = 4, .watchdog_usec = 1000000 });
        _cleanup_close_ int fd = -EBADF;

        assert_reply(s, "env",
                     "LISTEN_FDS=1 LISTEN_FDNAMES=varlink LISTEN_PID=ok NOTIFY_SOCKET=set WATCHDOG_USEC=1000000");
        command_ok(s, "watchdog off");
        ck_assert_int_eq(supervisor_wait_exit(s, READY_TIMEOUT_MS), 128 + SIGABRT);
        ck_assert_uint_eq(supervisor_stats(s).watchdog_fired, 1);

        ck_assert_int_gt(supervisor_restart(s, SIGTERM, READY_TIMEOUT_MS), 0);     /* nothing to stop */
        /* The abort may come before the daemon replies: no reply is waited for. */
        fd = harness_connect(supervisor_socket_path(s));
        ck_assert_int_ge(fd, 0);
        write_line(fd, "trigger");
        ck_assert_int_eq(supervisor_wait_exit(s, READY_TIMEOUT_MS), 128 + SIGABRT);
        ck_assert_uint_eq(supervisor_stats(s).watchdog_fired, 2);
        supervisor_free(s);
}
END_TEST

/* systemd's rules for odd messages: an invalid FDNAME= stores as "stored"; FDSTOREREMOVE=1 wins over
 * FDSTORE=1 and the fds are closed; FDSTOREREMOVE=1 without a name does nothing; a barrier's fd is closed. */
START_TEST(test_message_rules) {
        Supervisor *s = started(NULL);
        SupervisorStats st;

        command_ok(s, "raw 1 FDSTORE=1|FDNAME=bad:name");
        assert_stored_content(s, "stored", 1, "raw-0");
        ck_assert_uint_eq(supervisor_stats(s).invalid_names, 1);
        command_ok(s, "raw 0 FDSTOREREMOVE=1");
        ck_assert_int_eq(supervisor_store_count(s), 1);
        command_ok(s, "raw 1 FDSTORE=1|FDSTOREREMOVE=1|FDNAME=stored");
        ck_assert_int_eq(supervisor_store_count(s), 0);
        st = supervisor_stats(s);
        ck_assert_uint_eq(st.fds_unexpected, 1);
        command_ok(s, "raw 1 BARRIER=1");
        ck_assert_int_eq(supervisor_store_count(s), 0);
        ck_assert_uint_eq(supervisor_stats(s).messages, st.messages);   /* not a message to act on */
        ck_assert_uint_eq(supervisor_stats(s).fds_unexpected, 1);
        supervisor_free(s);
}
END_TEST

/* oldest_first turns the order round; a socket name of the caller's choosing is passed. */
START_TEST(test_order_and_socket_name) {
        Supervisor *s = started(&(SupervisorOptions){
                .fd_store_max = 4,
                .oldest_first = true,
                .socket_name = "vmmbroker.socket",
                .argv = (const char *const[]){ fake_daemon(), "--socket-name", "vmmbroker.socket", NULL } });

        command_ok(s, "store a alpha");
        command_ok(s, "store b beta");
        ck_assert_int_gt(supervisor_restart(s, SIGKILL, READY_TIMEOUT_MS), 0);
        assert_fds(s, "a:memfd=alpha b:memfd=beta", "vmmbroker.socket");
        supervisor_free(s);
}
END_TEST

/* Many restarts, half SIGKILL, each process storing one fd and removing an older one: the store always
 * holds exactly the last two, and READY=1 comes every time. */
START_TEST(test_many_restarts) {
        Supervisor *s = started(NULL);
        int64_t worst = 0;

        for (int i = 0; i < 40; i++) {
                char expected[256];
                int64_t ready;

                command_ok(s, "store r%d content%d", i, i);
                if (i >= 2)
                        command_ok(s, "remove r%d", i - 2);
                ready = supervisor_restart(s, i % 2 ? SIGKILL : SIGTERM, READY_TIMEOUT_MS);
                ck_assert_int_gt(ready, 0);
                worst = MAX(worst, ready);
                ck_assert_int_eq(supervisor_last_exit(s), i % 2 ? 128 + SIGKILL : 0);
                if (i == 0)
                        snprintf(expected, sizeof(expected), "r0:memfd=content0");
                else
                        snprintf(expected, sizeof(expected), "r%d:memfd=content%d r%d:memfd=content%d", i, i, i - 1,
                                 i - 1);
                assert_fds(s, expected, "varlink");
        }
        printf("40 restarts: the slowest exec to READY=1 took %lld us\n", (long long)worst);
        ck_assert_uint_eq(supervisor_stats(s).starts, 41);
        supervisor_free(s);
}
END_TEST

/* The supervisor leaves no fd, process or file behind. */
START_TEST(test_free_leaves_nothing) {
        int before = harness_fd_count(getpid());
        char dir[256], path[512];
        struct stat st;
        Supervisor *s;
        pid_t pid;

        s = started(NULL);
        command_ok(s, "store a alpha");
        command_ok(s, "pipe p nopoll");
        pid = supervisor_pid(s);
        snprintf(path, sizeof(path), "%s", supervisor_socket_path(s));
        snprintf(dir, sizeof(dir), "%.*s", (int)(strrchr(path, '/') - path), path);
        supervisor_free(s);
        ck_assert_int_eq(harness_fd_count(getpid()), before);
        ck_assert_int_eq(kill(pid, 0), -1);
        ck_assert_int_eq(errno, ESRCH);
        ck_assert_int_eq(stat(path, &st), -1);
        ck_assert_int_eq(stat(dir, &st), -1);
}
END_TEST

int main(void) {
        Suite *s = suite_create("supervisor");
        TCase *tc = tcase_create("supervisor");

        tcase_add_test(tc, test_start_ready_stop);
        tcase_add_loop_test(tc, test_store_survives_restarts, 0, 2);
        tcase_add_test(tc, test_remove_all_of_name_and_duplicates);
        tcase_add_test(tc, test_foreign_and_unexpected_fds);
        tcase_add_test(tc, test_store_limit);
        tcase_add_test(tc, test_fdpoll);
        tcase_add_test(tc, test_client_waits_across_restart);
        tcase_add_test(tc, test_exit_before_ready_and_bad_path);
        tcase_add_test(tc, test_stop_guard);
        tcase_add_test(tc, test_watchdog);
        tcase_add_test(tc, test_message_rules);
        tcase_add_test(tc, test_order_and_socket_name);
        tcase_add_test(tc, test_many_restarts);
        tcase_add_test(tc, test_free_leaves_nothing);
        suite_add_tcase(s, tc);
        return run_suite(s) == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
