/* SPDX-License-Identifier: MIT */

/*
 * Per-user accounting and limits, end to end on the simulated device: each
 * test writes a configuration, starts its own daemon with it (harness.h) and
 * drives it with raw varlink (rawclient.h). Users() is checked against what
 * was done; every refusal is QuotaExceeded naming the resource, the limit and
 * the current use, and changes nothing; more connections or processes of the
 * same user never raise a cap.
 */

#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "codec.h"
#include "harness.h"
#include "macro.h"
#include "rawclient.h"
#include "unit.h"

#define MiB (UINT64_C(1) << 20)

/* Starts a daemon with `config` as its configuration file (written to a private path). */
static void start_with(Harness *h, char *path, size_t path_len, const char *config) {
        FILE *f;
        int fd, k;

        snprintf(path, path_len, "/tmp/vmmb-limits-XXXXXX");
        fd = mkstemp(path);
        ck_assert_int_ge(fd, 0);
        f = fdopen(fd, "w");
        ck_assert_ptr_nonnull(f);
        fputs(config, f);
        ck_assert_int_eq(fclose(f), 0);
        k = harness_start(h, (const char *const[]){ "--config", path, NULL });
        ck_assert_msg(k == 0, "harness_start: %s", strerror(-k));
}

static void stop(Harness *h, const char *path) {
        ck_assert_int_eq(harness_stop(h), 0);
        (void)unlink(path);
}

/* The caller's own entry of Users (or, with `all`, the one of `uid`), device 0 only. */
typedef struct Use {
        uint64_t leases, max_leases, connections, max_connections, requests, bytes, max_bytes;
        size_t n_users;
} Use;

static Use users_on(VarlinkConn *c, bool all, uid_t uid);

/*
 * Asks Users on `c` until the caller's user has `connections` open: a connection the test closed is
 * counted out when the daemon sees its hang-up, which may come after a request on another connection.
 * Bounded by HARNESS_POLL_MS.
 */
static Use users_settled(VarlinkConn *c, uint64_t connections) {
        Use u = users_on(c, false, getuid());

        for (uint64_t end = harness_poll_deadline(); u.connections != connections && harness_now_msec() < end;)
                u = users_on(c, false, getuid());
        ck_assert_uint_eq(u.connections, connections);
        return u;
}

static Use users_on(VarlinkConn *c, bool all, uid_t uid) {
        _cleanup_free_ char *message = NULL;
        UsersReply ur = {};
        Use u = {};
        Reply r;

        ck_assert_int_eq(call_text(c, VMMB_METHOD_USERS, all ? "{\"all\": true}" : "{}", &r), 0);
        ck_assert_msg(!r.error, "Users: %s", r.error);
        ck_assert_msg(users_reply_decode(r.params, &ur, &message) == 0, "Users reply: %s", message);
        u.n_users = ur.n_users;
        for (size_t i = 0; i < ur.n_users; i++) {
                const WireUser *w = &ur.users[i];

                if (w->uid != (int64_t)uid)
                        continue;
                ck_assert_uint_ge(w->n_devices, 1);
                u = (Use){ w->leases, w->max_leases, w->connections, w->max_connections, w->requests,
                           w->devices[0].bytes, w->devices[0].max_bytes, ur.n_users };
        }
        users_reply_done(&ur);
        reply_done(&r);
        return u;
}

/* Calls Alloc(size) and checks for QuotaExceeded on `resource` with that limit and current use. */
static void expect_quota(VarlinkConn *c, uint64_t size, const char *resource, uint64_t limit, uint64_t current) {
        _cleanup_free_ char *message = NULL;
        char params[128];
        VmmbError e;
        Reply r;

        snprintf(params, sizeof(params), "{\"size\": %" PRIu64 "}", size);
        ck_assert_int_eq(call_text(c, VMMB_METHOD_ALLOC, params, &r), 0);
        ck_assert_msg(r.error && strcmp(r.error, VMMB_ERROR_QUOTA_EXCEEDED) == 0, "Alloc(%" PRIu64 "): %s", size,
                      r.error ?: "allowed");
        ck_assert_uint_eq(r.n_fds, 0);
        ck_assert_int_eq(vmmb_error_decode(r.error, r.params, &e, &message), 0);
        ck_assert_str_eq(e.resource, resource);
        ck_assert_uint_eq(e.limit, limit);
        ck_assert_uint_eq(e.current, current);
        ck_assert_ptr_nonnull(strstr(e.message, " in /tmp/vmmb-limits-"));     /* the file that sets the limit */
        vmmb_error_done(&e);
        reply_done(&r);
}

START_TEST(test_users_reports_use) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL, *c2 = NULL;
        char path[64];
        TestLease l;
        WireDevice d;
        Harness h;
        Use u;

        start_with(&h, path, sizeof(path), "");
        ck_assert_int_eq(conn_open(h.socket, &c), 0);
        u = users_on(c, false, getuid());
        ck_assert_uint_eq(u.n_users, 1);
        ck_assert_uint_eq(u.connections, 1);
        ck_assert_uint_eq(u.leases, 0);
        ck_assert_uint_eq(u.bytes, 0);
        ck_assert_uint_eq(u.max_leases, 1024);
        ck_assert_uint_eq(u.max_connections, 64);
        ck_assert_int_eq(harness_status_on(c, &d), 0);
        ck_assert_uint_eq(u.max_bytes, d.capacity * 80 / 100);         /* MaxBytes=80% by default */

        ck_assert_int_eq(lease_alloc(c, 66 * MiB, &l), 0);
        test_lease_close(&l);
        ck_assert_int_eq(conn_open(h.socket, &c2), 0);
        u = users_on(c2, false, getuid());
        ck_assert_uint_eq(u.leases, 1);
        ck_assert_uint_eq(u.bytes, 66 * MiB);
        ck_assert_uint_eq(u.connections, 2);
        ck_assert_uint_eq(u.requests, 0);

        ck_assert_int_eq(lease_free(c, l.id), 0);
        c2 = varlink_conn_free(c2);
        u = users_settled(c, 1);
        ck_assert_uint_eq(u.leases, 0);
        ck_assert_uint_eq(u.bytes, 0);
        c = varlink_conn_free(c);
        stop(&h, path);
}
END_TEST

START_TEST(test_limits_refuse_and_change_nothing) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL, *c2 = NULL;
        TestLease a, b;
        WireDevice before, after;
        char path[64];
        Harness h;
        Use u;

        start_with(&h, path, sizeof(path), "[Limits]\nMaxLeases=2\nMaxBytes=100M\n");
        ck_assert_int_eq(conn_open(h.socket, &c), 0);
        ck_assert_int_eq(conn_open(h.socket, &c2), 0);

        /* Bytes: 100M is 50 granules of 2 MiB; 98 MiB fits, 2 MiB more does not. */
        ck_assert_int_eq(lease_alloc(c, 66 * MiB, &a), 0);
        test_lease_close(&a);
        ck_assert_int_eq(harness_status_on(c, &before), 0);
        expect_quota(c2, 36 * MiB, "bytes", 100 * MiB, 66 * MiB);      /* from another connection too */
        ck_assert_int_eq(harness_status_on(c, &after), 0);
        ck_assert_uint_eq(after.leased, before.leased);
        ck_assert_uint_eq(after.leases, before.leases);
        ck_assert_uint_eq(after.cached + after.scrubbing, before.cached + before.scrubbing);

        /* Leases: the second fits, the third does not, whichever connection asks. */
        ck_assert_int_eq(lease_alloc(c2, 32 * MiB, &b), 0);
        test_lease_close(&b);
        expect_quota(c, 2 * MiB, "leases", 2, 2);
        u = users_on(c, false, getuid());
        ck_assert_uint_eq(u.leases, 2);
        ck_assert_uint_eq(u.bytes, 98 * MiB);

        /* Freeing one makes room again. */
        ck_assert_int_eq(lease_free(c, a.id), 0);
        ck_assert_int_eq(lease_alloc(c, 2 * MiB, &a), 0);
        test_lease_close(&a);
        c = varlink_conn_free(c);
        c2 = varlink_conn_free(c2);
        stop(&h, path);
}
END_TEST

START_TEST(test_connection_limit) {
        _cleanup_(varlink_conn_freep) VarlinkConn *extra = NULL;
        VarlinkConn *c[3] = {};
        char path[64], buf[256];
        Harness h;
        Reply r;
        Use u;

        start_with(&h, path, sizeof(path), "[Limits]\nMaxConnections=3\n");
        for (size_t i = 0; i < ELEMENTSOF(c); i++)
                ck_assert_int_eq(conn_open(h.socket, &c[i]), 0);
        (void)users_settled(c[0], 3);           /* the daemon has accepted all three */

        /* The fourth is told why at its first call, then closed; the others go on. */
        ck_assert_int_eq(conn_open(h.socket, &extra), 0);
        ck_assert_int_eq(call_text(extra, VMMB_METHOD_STATUS, NULL, &r), 0);
        ck_assert_msg(r.error && strcmp(r.error, VMMB_ERROR_QUOTA_EXCEEDED) == 0, "4th connection: %s",
                      r.error ?: "served");
        ck_assert_ptr_nonnull(strstr(json_object_to_json_string(r.params), "\"connections\""));
        reply_done(&r);
        ck_assert_int_eq(recv(varlink_conn_get_fd(extra), buf, sizeof(buf), 0), 0);   /* closed */
        extra = varlink_conn_free(extra);
        u = users_on(c[1], false, getuid());
        ck_assert_uint_eq(u.connections, 3);

        /* One closes: once the daemon has seen it go, a new one is served. */
        c[2] = varlink_conn_free(c[2]);
        (void)users_settled(c[0], 2);
        ck_assert_int_eq(conn_open(h.socket, &extra), 0);
        ck_assert_uint_eq(users_on(extra, false, getuid()).connections, 3);
        for (size_t i = 0; i < ELEMENTSOF(c); i++)
                c[i] = varlink_conn_free(c[i]);
        extra = varlink_conn_free(extra);
        stop(&h, path);
}
END_TEST

START_TEST(test_user_and_group_sections) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        char path[64], config[512];
        Harness h;
        Use u;

        /* A rule for this process's primary group raises what it sets; [User:] beats it. (The most generous of
         * several groups is checked by tests/unit/test-user.c.) */
        snprintf(config, sizeof(config),
                 "[Limits]\nMaxLeases=2\nMaxConnections=5\n"
                 "[Group:%u]\nMaxLeases=7\nMaxBytes=50M\nMaxConnections=6\n"
                 "[User:%u]\nMaxConnections=9\n",
                 (unsigned)getgid(), (unsigned)getuid());
        start_with(&h, path, sizeof(path), config);
        ck_assert_int_eq(conn_open(h.socket, &c), 0);
        u = users_on(c, false, getuid());
        ck_assert_uint_eq(u.max_leases, 7);
        ck_assert_uint_eq(u.max_bytes, 50 * MiB);
        ck_assert_uint_eq(u.max_connections, 9);
        c = varlink_conn_free(c);
        stop(&h, path);
}
END_TEST

START_TEST(test_published_stays_charged) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        char path[64], params[128];
        TestLease l;
        Harness h;
        Reply r;

        start_with(&h, path, sizeof(path), "");
        ck_assert_int_eq(conn_open(h.socket, &c), 0);
        ck_assert_int_eq(lease_alloc(c, 4 * MiB, &l), 0);
        test_lease_close(&l);
        snprintf(params, sizeof(params), "{\"id\": \"%s\", \"name\": \"charged\"}", l.id);
        ck_assert_int_eq(call_text(c, VMMB_METHOD_PUBLISH, params, &r), 0);
        ck_assert_ptr_null(r.error);
        reply_done(&r);
        ck_assert_int_eq(lease_free(c, l.id), 0);
        ck_assert_uint_eq(users_on(c, false, getuid()).bytes, 4 * MiB);       /* no holder, still charged */
        ck_assert_int_eq(call_text(c, VMMB_METHOD_UNPUBLISH, "{\"name\": \"charged\"}", &r), 0);
        ck_assert_ptr_null(r.error);
        reply_done(&r);
        ck_assert_uint_eq(users_on(c, false, getuid()).bytes, 0);
        ck_assert_uint_eq(users_on(c, false, getuid()).leases, 0);
        c = varlink_conn_free(c);
        stop(&h, path);
}
END_TEST

START_TEST(test_unread_reply_closes) {
        static const char msg[] = "{\"method\":\"io.vmmbroker.Status\"}";    /* sent with its NUL */
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        char path[64], chunk[256 * sizeof(msg)];
        struct pollfd p;
        Harness h;
        int fd, k;

        for (size_t i = 0; i < 256; i++)
                memcpy(chunk + i * sizeof(msg), msg, sizeof(msg));
        start_with(&h, path, sizeof(path), "[Broker]\nReplyTimeout=300ms\n");
        ck_assert_int_eq(conn_open(h.socket, &c), 0);
        fd = harness_connect(h.socket);
        ck_assert_int_ge(fd, 0);
        /* Calls, never reading, until the socket is full both ways: the daemon holds a reply for us. */
        for (;;) {
                ssize_t n = send(fd, chunk, sizeof(chunk), MSG_DONTWAIT | MSG_NOSIGNAL);

                if (n < 0 && errno == EAGAIN) {
                        /* full: the daemon waits for us; the timeout then closes the connection (the only way
                         * out: POLLHUP within the failure guard) */
                        p = (struct pollfd){ .fd = fd, .events = POLLRDHUP };
                        k = poll(&p, 1, 30000);
                        ck_assert_int_eq(k, 1);
                        break;
                }
                ck_assert_msg(n > 0, "send: %m");
        }
        ck_assert_msg(p.revents & (POLLHUP | POLLRDHUP), "revents %#x", (unsigned)p.revents);
        close(fd);
        /* Its user's request and connection are given back (the daemon closed it: no waiting needed). */
        ck_assert_uint_eq(users_settled(c, 1).requests, 0);
        c = varlink_conn_free(c);
        stop(&h, path);
}
END_TEST

int main(void) {
        return run_suite(UNIT_SUITE("limits", NULL, test_users_reports_use,
                                    test_limits_refuse_and_change_nothing,
                                    test_connection_limit,
                                    test_user_and_group_sections,
                                    test_published_stays_charged,
                                    test_unread_reply_closes)) == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
