/* SPDX-License-Identifier: MIT */

#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../fuzz/differential.h"
#include "codec.h"
#include "fdpass.h"
#include "json.h"
#include "macro.h"
#include "varlink.h"
#include "unit.h"

DEFINE_TRIVIAL_CLEANUP_FUNC(VarlinkConn, varlink_conn_free);

/* A connected pair: *ret_conn reads from and writes to *ret_peer (a raw socket). */
static void conn_pair(size_t max, bool accept_fds, VarlinkConn **ret_conn, int *ret_peer) {
        int sv[2];

        ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
        ck_assert_int_eq(varlink_conn_new(ret_conn, sv[0], max, accept_fds), 0);
        *ret_peer = sv[1];
}

static void send_raw(int fd, const char *s, size_t len) {
        ck_assert_int_eq(send(fd, s, len, MSG_NOSIGNAL), (ssize_t)len);
}

static int count_fds(void) {
        DIR *d = opendir("/proc/self/fd");
        struct dirent *e;
        int n = 0;

        ck_assert_ptr_nonnull(d);
        while ((e = readdir(d)))
                if (e->d_name[0] != '.')
                        n++;
        closedir(d);
        return n - 1;   /* the directory's own fd */
}

static json_object *parse_str(const char *s) {
        json_object *o = NULL;

        ck_assert_int_eq(json_parse_message(s, strlen(s), &o), 0);
        return o;
}

START_TEST(test_split_bytes) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        _cleanup_close_ int peer = -EBADF;
        static const char wire[] = "{\"a\":1}\0{\"b\":\"xy\"}";         /* two messages, NULs included */
        const char *m;
        size_t len;
        int got = 0;

        conn_pair(VARLINK_MAX_REQUEST, false, &c, &peer);
        for (size_t i = 0; i < sizeof(wire); i++) {
                send_raw(peer, wire + i, 1);
                ck_assert_int_eq(varlink_conn_read(c), 1);
                int r = varlink_conn_next(c, &m, &len, NULL, NULL);
                if (wire[i] != 0) {
                        ck_assert_int_eq(r, 0);
                        continue;
                }
                ck_assert_int_eq(r, 1);
                ck_assert_str_eq(m, got == 0 ? "{\"a\":1}" : "{\"b\":\"xy\"}");
                ck_assert_uint_eq(len, strlen(m));
                got++;
        }
        ck_assert_int_eq(got, 2);
        ck_assert_int_eq(varlink_conn_next(c, &m, &len, NULL, NULL), 0);
        peer = safe_close(peer);
        ck_assert_int_eq(varlink_conn_read(c), 0);             /* clean end between messages */
}
END_TEST

START_TEST(test_many_in_one_read) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        _cleanup_close_ int peer = -EBADF;
        static const char wire[] = "{\"a\":1}\0{\"b\":2}\0{}\0{\"c\":";
        const char *m;
        size_t len;

        conn_pair(VARLINK_MAX_REQUEST, false, &c, &peer);
        send_raw(peer, wire, sizeof(wire) - 1);
        ck_assert_int_eq(varlink_conn_read(c), (int)sizeof(wire) - 1);
        ck_assert_int_eq(varlink_conn_next(c, &m, &len, NULL, NULL), 1);
        ck_assert_str_eq(m, "{\"a\":1}");
        ck_assert_int_eq(varlink_conn_next(c, &m, &len, NULL, NULL), 1);
        ck_assert_str_eq(m, "{\"b\":2}");
        ck_assert_int_eq(varlink_conn_next(c, &m, &len, NULL, NULL), 1);
        ck_assert_str_eq(m, "{}");
        ck_assert_int_eq(varlink_conn_next(c, &m, &len, NULL, NULL), 0);
        send_raw(peer, "3}", 3);
        ck_assert_int_eq(varlink_conn_read(c), 3);
        ck_assert_int_eq(varlink_conn_next(c, &m, &len, NULL, NULL), 1);
        ck_assert_str_eq(m, "{\"c\":3}");
}
END_TEST

START_TEST(test_oversized) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        _cleanup_close_ int peer = -EBADF;
        char big[200];
        const char *m;
        size_t len;
        int r;

        /* a message of exactly the limit (NUL included) passes */
        conn_pair(64, false, &c, &peer);
        memset(big, ' ', sizeof(big));
        big[0] = '{';
        big[62] = '}';
        big[63] = 0;
        send_raw(peer, big, 64);
        ck_assert_int_eq(varlink_conn_read(c), 64);
        ck_assert_int_eq(varlink_conn_next(c, &m, &len, NULL, NULL), 1);
        ck_assert_uint_eq(len, 63);

        /* one byte more does not */
        big[63] = ' ';
        big[64] = 0;
        send_raw(peer, big, 65);
        do {
                r = varlink_conn_next(c, &m, &len, NULL, NULL);
                if (r == 0)
                        r = varlink_conn_read(c);
        } while (r > 0);
        ck_assert_int_eq(r, -EMSGSIZE);
}
END_TEST

START_TEST(test_unterminated_eof) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        _cleanup_close_ int peer = -EBADF;
        json_object *o = NULL;
        const char *m;
        size_t len;

        conn_pair(VARLINK_MAX_REQUEST, false, &c, &peer);
        send_raw(peer, "{\"a\":1}\0{\"a\":", 13);
        peer = safe_close(peer);
        ck_assert_int_eq(varlink_conn_read(c), 13);
        ck_assert_int_eq(varlink_conn_next(c, &m, &len, NULL, NULL), 1);
        ck_assert_int_eq(varlink_conn_next(c, &m, &len, NULL, NULL), 0);
        ck_assert_int_eq(varlink_conn_read(c), -ECONNRESET);
        ck_assert_int_eq(varlink_conn_next(c, &m, &len, NULL, NULL), -ECONNRESET);
        ck_assert_int_eq(varlink_conn_receive(c, &o, NULL, NULL), -ECONNRESET);
}
END_TEST

/* Checks that fd a and fd b are the same open file. */
static void assert_same_file(int a, int b) {
        struct stat sa, sb;

        ck_assert_int_eq(fstat(a, &sa), 0);
        ck_assert_int_eq(fstat(b, &sb), 0);
        ck_assert_uint_eq(sa.st_ino, sb.st_ino);
        ck_assert_uint_eq(sa.st_dev, sb.st_dev);
        ck_assert_int_ne(a, b);
        ck_assert_int_eq(fcntl(b, F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
}

/*
 * varlink_conn_receive_text(): reads until a whole message is there (one larger than the first buffer takes
 * several reads), hands a message's fds over or closes them, and the end of the stream is -ECONNRESET inside
 * a message and between messages alike.
 */
START_TEST(test_receive_text) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        _cleanup_close_ int peer = -EBADF;
        _cleanup_free_ char *big = malloc(10000);
        _cleanup_free_ int *got = NULL;
        int pipes[2], before;
        size_t len, n = 99;
        const char *m;

        ck_assert_ptr_nonnull(big);
        memset(big, ' ', 10000);
        big[0] = '{';
        big[9998] = '}';
        big[9999] = 0;
        ck_assert_int_eq(pipe2(pipes, O_CLOEXEC), 0);
        conn_pair(VARLINK_MAX_REQUEST, true, &c, &peer);

        /* a message with fds goes alone (varlink_conn_send()) */
        send_raw(peer, big, 10000);
        ck_assert_int_eq(fd_send(peer, "{\"a\":1}", 8, pipes, 1), 8);
        send_raw(peer, "{\"b\":2}", 8);
        ck_assert_int_eq(fd_send(peer, "{}", 3, pipes + 1, 1), 3);
        send_raw(peer, "{\"c\":", 5);
        peer = safe_close(peer);
        before = count_fds();                                   /* the fds sent are in the socket, not here */

        ck_assert_int_eq(varlink_conn_receive_text(c, &m, &len, &got, &n), 1);
        ck_assert_uint_eq(len, 9999);
        ck_assert_mem_eq(m, big, 10000);
        ck_assert_ptr_null(got);
        ck_assert_uint_eq(n, 0);
        ck_assert_int_eq(varlink_conn_receive_text(c, &m, &len, &got, &n), 1);
        ck_assert_str_eq(m, "{\"a\":1}");
        ck_assert_uint_eq(len, 7);
        ck_assert_uint_eq(n, 1);
        assert_same_file(pipes[0], got[0]);
        close_many(got, n);
        ck_assert_int_eq(varlink_conn_receive_text(c, &m, &len, NULL, NULL), 1);
        ck_assert_str_eq(m, "{\"b\":2}");
        ck_assert_int_eq(varlink_conn_receive_text(c, &m, &len, NULL, NULL), 1);    /* its fd closed */
        ck_assert_str_eq(m, "{}");
        ck_assert_int_eq(count_fds(), before);
        ck_assert_int_eq(varlink_conn_receive_text(c, &m, &len, NULL, NULL), -ECONNRESET);
        c = varlink_conn_free(c);

        conn_pair(VARLINK_MAX_REQUEST, true, &c, &peer);
        send_raw(peer, "{}", 3);
        peer = safe_close(peer);
        ck_assert_int_eq(varlink_conn_receive_text(c, &m, &len, NULL, NULL), 1);
        ck_assert_int_eq(varlink_conn_receive_text(c, &m, &len, NULL, NULL), -ECONNRESET);
        close_many(pipes, 2);
}
END_TEST

START_TEST(test_fds_on_their_message) {
        _cleanup_(varlink_conn_freep) VarlinkConn *rx = NULL, *tx = NULL;
        _cleanup_close_ int peer = -EBADF;
        int pipes[2], mfd, fds[3], before;
        static const char *const names[] = { "A", "B", "C", "D" };

        ck_assert_int_eq(pipe2(pipes, O_CLOEXEC), 0);
        mfd = memfd_create("test", MFD_CLOEXEC);
        ck_assert_int_ge(mfd, 0);
        fds[0] = pipes[0];
        fds[1] = pipes[1];
        fds[2] = mfd;

        conn_pair(VARLINK_MAX_REPLY, true, &rx, &peer);
        ck_assert_int_eq(varlink_conn_new(&tx, TAKE_FD(peer), VARLINK_MAX_REQUEST, false), 0);
        before = count_fds();

        /* A without fds, B with 3, C and D without: A and B are separate sendmsg() calls, which
         * Linux may still hand over in one read */
        for (size_t i = 0; i < ELEMENTSOF(names); i++) {
                _cleanup_(json_object_putp) json_object *o = json_object_new_object();

                json_object_object_add(o, "name", json_object_new_string(names[i]));
                ck_assert_int_eq(varlink_conn_send(tx, o, i == 1 ? fds : NULL, i == 1 ? 3 : 0), 0);
        }
        ck_assert_int_eq(count_fds(), before + 3);              /* the queue's duplicates */
        ck_assert_int_eq(varlink_conn_flush(tx), 0);
        ck_assert_uint_eq(varlink_conn_pending(tx), 0);
        ck_assert_int_eq(count_fds(), before);                  /* closed once sent */

        for (size_t i = 0; i < ELEMENTSOF(names); i++) {
                _cleanup_(json_object_putp) json_object *o = NULL;
                _cleanup_free_ int *got = NULL;
                json_object *v;
                size_t n = 99;

                ck_assert_int_eq(varlink_conn_receive(rx, &o, &got, &n), 1);
                ck_assert(json_object_object_get_ex(o, "name", &v));
                ck_assert_str_eq(json_object_get_string(v), names[i]);
                if (i != 1) {
                        ck_assert_uint_eq(n, 0);
                        ck_assert_ptr_null(got);
                        continue;
                }
                ck_assert_uint_eq(n, 3);
                for (size_t k = 0; k < 3; k++)
                        assert_same_file(fds[k], got[k]);
                close_many(got, n);
        }
        ck_assert_int_eq(count_fds(), before);
        close_many(fds, 3);
}
END_TEST

/* "A" then "B" with an fd, in two sendmsg() calls: Linux returns both in one read, fds included */
START_TEST(test_fds_merged_read) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        _cleanup_close_ int peer = -EBADF, mfd = -EBADF;
        _cleanup_free_ int *got = NULL;
        const char *m;
        size_t len, n = 0;

        mfd = memfd_create("test", MFD_CLOEXEC);
        conn_pair(VARLINK_MAX_REPLY, true, &c, &peer);
        send_raw(peer, "{\"m\":\"A\"}", 10);
        ck_assert_int_eq(fd_send(peer, "{\"m\":\"B\"}", 10, &mfd, 1), 10);
        while (varlink_conn_next(c, &m, &len, &got, &n) == 0)
                ck_assert_int_gt(varlink_conn_read(c), 0);
        ck_assert_str_eq(m, "{\"m\":\"A\"}");
        ck_assert_ptr_null(got);
        while (varlink_conn_next(c, &m, &len, &got, &n) == 0)
                ck_assert_int_gt(varlink_conn_read(c), 0);
        ck_assert_str_eq(m, "{\"m\":\"B\"}");
        ck_assert_uint_eq(n, 1);
        assert_same_file(mfd, got[0]);
        close_many(got, n);
}
END_TEST

START_TEST(test_fds_mid_message) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        _cleanup_close_ int peer = -EBADF, mfd = -EBADF;
        int before;

        mfd = memfd_create("test", MFD_CLOEXEC);
        before = count_fds();
        conn_pair(VARLINK_MAX_REPLY, true, &c, &peer);
        send_raw(peer, "{\"a\"", 4);
        ck_assert_int_eq(varlink_conn_read(c), 4);
        ck_assert_int_eq(fd_send(peer, ":1}", 4, &mfd, 1), 4);
        ck_assert_int_eq(varlink_conn_read(c), -EPROTO);
        ck_assert_int_eq(count_fds(), before + 2);              /* the pair only: nothing leaked */
}
END_TEST

START_TEST(test_no_fds_mode) {
        _cleanup_(varlink_conn_freep) VarlinkConn *c = NULL;
        _cleanup_close_ int peer = -EBADF;
        int pipes[2], before;

        ck_assert_int_eq(pipe2(pipes, O_CLOEXEC), 0);
        conn_pair(VARLINK_MAX_REQUEST, false, &c, &peer);
        before = count_fds();
        ck_assert_int_eq(fd_send(peer, "{}", 3, pipes, 2), 3);
        ck_assert_int_eq(varlink_conn_read(c), -EPROTO);
        ck_assert_int_eq(count_fds(), before);
        /* the received copies are gone: closing ours leaves the pipe with no writer */
        close_many(pipes + 1, 1);
        {
                char b;
                ck_assert_int_eq(read(pipes[0], &b, 1), 0);
        }
        close_many(pipes, 1);
}
END_TEST

START_TEST(test_pending_output) {
        _cleanup_(varlink_conn_freep) VarlinkConn *tx = NULL, *rx = NULL;
        _cleanup_(json_object_putp) json_object *msg = NULL;
        _cleanup_free_ char *text = NULL;
        int sv[2], sndbuf = 4096, r;
        size_t total = 0, msg_len, n_msgs = 0, got = 0;

        ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sv), 0);
        ck_assert_int_eq(setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof(sndbuf)), 0);
        ck_assert_int_eq(varlink_conn_new(&tx, sv[0], VARLINK_MAX_REQUEST, false), 0);
        ck_assert_int_eq(varlink_conn_new(&rx, sv[1], VARLINK_MAX_REPLY, true), 0);

        text = malloc(1001);
        memset(text, 'x', 1000);
        text[1000] = 0;
        msg = json_object_new_object();
        json_object_object_add(msg, "t", json_object_new_string(text));
        msg_len = strlen(json_object_to_json_string_ext(msg, JSON_C_TO_STRING_PLAIN)) + 1;

        /* a peer that does not read: the socket fills, the queue grows */
        for (;;) {
                ck_assert_int_eq(varlink_conn_send(tx, msg, NULL, 0), 0);
                total += msg_len;
                n_msgs++;
                r = varlink_conn_flush(tx);
                if (r == -EAGAIN)
                        break;
                ck_assert_int_eq(r, 0);
                ck_assert_uint_lt(n_msgs, 100000);
        }
        for (int i = 0; i < 50; i++) {
                ck_assert_int_eq(varlink_conn_send(tx, msg, NULL, 0), 0);
                total += msg_len;
                n_msgs++;
        }
        ck_assert_int_eq(varlink_conn_flush(tx), -EAGAIN);
        ck_assert_uint_ge(varlink_conn_pending(tx), 50 * msg_len);

        /* count what the socket holds: it plus the queue is everything */
        {
                size_t in_socket = 0;
                int q;

                for (;;) {
                        r = varlink_conn_read(rx);
                        if (r == -EAGAIN)
                                break;
                        ck_assert_int_gt(r, 0);
                        in_socket += (size_t)r;
                        for (;;) {
                                json_object *o = NULL;

                                q = varlink_conn_next_json(rx, &o, NULL, NULL);
                                if (q != 1)
                                        break;
                                json_object_put(o);
                                got++;
                        }
                        ck_assert_int_eq(q, 0);
                }
                ck_assert_uint_eq(in_socket + varlink_conn_pending(tx), total);
        }

        /* then draining works */
        while (varlink_conn_pending(tx) > 0) {
                r = varlink_conn_flush(tx);
                ck_assert(r == 0 || r == -EAGAIN);
                for (;;) {
                        json_object *o = NULL;

                        r = varlink_conn_next_json(rx, &o, NULL, NULL);
                        if (r == 1) {
                                json_object_put(o);
                                got++;
                                continue;
                        }
                        ck_assert_int_eq(r, 0);
                        r = varlink_conn_read(rx);
                        if (r == -EAGAIN)
                                break;
                        ck_assert_int_gt(r, 0);
                }
        }
        ck_assert_int_eq(varlink_conn_flush(tx), 0);
        for (;;) {
                json_object *o = NULL;

                r = varlink_conn_next_json(rx, &o, NULL, NULL);
                if (r == 1) {
                        json_object_put(o);
                        got++;
                        continue;
                }
                if (varlink_conn_read(rx) == -EAGAIN)
                        break;
        }
        ck_assert_uint_eq(got, n_msgs);
}
END_TEST

START_TEST(test_envelopes) {
        _cleanup_(json_object_putp) json_object *o = NULL, *params = NULL;
        VarlinkCall call;
        VarlinkReply reply;
        static const char *const bad_calls[] = {
                "{}",
                "{\"method\":\"Alloc\"}",
                "{\"method\":\"io.vmmbroker.\"}",
                "{\"method\":\".Alloc\"}",
                "{\"method\":\"io..Alloc\"}",
                "{\"method\":\"io.vmm-broker.Alloc\"}",
                "{\"method\":\"io.vmmbroker.Alloc\",\"parameters\":[]}",
                "{\"method\":\"io.vmmbroker.Alloc\",\"parameters\":1}",
                "{\"method\":\"io.vmmbroker.Alloc\",\"oneway\":1}",
                "{\"method\":\"io.vmmbroker.Alloc\",\"more\":\"yes\"}",
                "{\"method\":\"io.vmmbroker.Alloc\",\"upgrade\":true}",
                "{\"method\":1}",
        };

        o = parse_str("{\"method\":\"io.vmmbroker.Alloc\",\"parameters\":{\"size\":1},\"more\":true}");
        ck_assert_int_eq(varlink_call_parse(o, &call), 0);
        ck_assert_str_eq(call.method, VMMB_METHOD_ALLOC);
        ck_assert_ptr_nonnull(call.parameters);
        ck_assert(call.more && !call.oneway);
        varlink_call_done(&call);
        json_object_put(TAKE_PTR(o));

        o = parse_str("{\"method\":\"org.varlink.service.GetInfo\"}");
        ck_assert_int_eq(varlink_call_parse(o, &call), 0);
        ck_assert_ptr_null(call.parameters);
        varlink_call_done(&call);
        json_object_put(TAKE_PTR(o));

        for (size_t i = 0; i < ELEMENTSOF(bad_calls); i++) {
                o = parse_str(bad_calls[i]);
                ck_assert_msg(varlink_call_parse(o, &call) == -EBADMSG, "%s", bad_calls[i]);
                json_object_put(TAKE_PTR(o));
        }

        params = parse_str("{\"size\":1}");
        ck_assert_int_eq(varlink_call_new(VMMB_METHOD_ALLOC, params, false, false, &o), 0);
        ck_assert_str_eq(json_object_to_json_string_ext(o, JSON_C_TO_STRING_PLAIN),
                         "{\"method\":\"io.vmmbroker.Alloc\",\"parameters\":{\"size\":1}}");
        json_object_put(TAKE_PTR(o));
        ck_assert_int_eq(varlink_call_new("Alloc", NULL, false, false, &o), -EINVAL);

        ck_assert_int_eq(varlink_reply_new(NULL, &o), 0);
        ck_assert_str_eq(json_object_to_json_string_ext(o, JSON_C_TO_STRING_PLAIN), "{\"parameters\":{}}");
        ck_assert_int_eq(varlink_reply_parse(o, &reply), 0);
        ck_assert_ptr_null(reply.error);
        varlink_reply_done(&reply);
        json_object_put(TAKE_PTR(o));

        ck_assert_int_eq(varlink_error_new(VMMB_ERROR_NO_SUCH_LEASE, params, &o), 0);
        ck_assert_int_eq(varlink_reply_parse(o, &reply), 0);
        ck_assert_str_eq(reply.error, VMMB_ERROR_NO_SUCH_LEASE);
        varlink_reply_done(&reply);
        json_object_put(TAKE_PTR(o));

        o = parse_str("{\"parameters\":{},\"extra\":1}");
        ck_assert_int_eq(varlink_reply_parse(o, &reply), -EBADMSG);
}
END_TEST

/* Sends `msg` with fds over a fresh pair and returns what arrives. */
static json_object *round_trip(json_object *msg, const int *fds, size_t n_fds, int **ret_fds, size_t *ret_n) {
        _cleanup_(varlink_conn_freep) VarlinkConn *tx = NULL, *rx = NULL;
        int sv[2];
        json_object *o = NULL;

        ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
        ck_assert_int_eq(varlink_conn_new(&tx, sv[0], VARLINK_MAX_REQUEST, false), 0);
        ck_assert_int_eq(varlink_conn_new(&rx, sv[1], VARLINK_MAX_REPLY, true), 0);
        ck_assert_int_eq(varlink_conn_send(tx, msg, fds, n_fds), 0);
        ck_assert_int_eq(varlink_conn_flush(tx), 0);
        ck_assert_int_eq(varlink_conn_receive(rx, &o, ret_fds, ret_n), 1);
        return o;
}

/* Wraps parameters in a reply, sends it and returns the parameters that arrive. */
static json_object *reply_round_trip(json_object *params, const int *fds, size_t n_fds, int **ret_fds,
                                     size_t *ret_n, VarlinkReply *ret_reply) {
        _cleanup_(json_object_putp) json_object *env = NULL, *got = NULL;

        ck_assert_int_eq(varlink_reply_new(params, &env), 0);
        got = round_trip(env, fds, n_fds, ret_fds, ret_n);
        ck_assert_int_eq(varlink_reply_parse(got, ret_reply), 0);
        return ret_reply->parameters;
}

START_TEST(test_codec_calls) {
        _cleanup_(json_object_putp) json_object *env = NULL, *got = NULL, *p = NULL;
        const char *bad = NULL;
        char *msg = NULL;
        VarlinkCall call;
        AllocParams a = { .size = 1 << 21, .device = 1, .label = (char *)"training run" }, a2;
        FreeParams f = { .id = (char *)"lease-42" }, f2;
        ListParams l = { .all = true }, l2;
        InterfaceParams ip = { .interface = (char *)VMMB_INTERFACE }, ip2;

        ck_assert_int_eq(alloc_params_encode(&a, &p), 0);
        ck_assert_int_eq(varlink_call_new(VMMB_METHOD_ALLOC, p, false, false, &env), 0);
        got = round_trip(env, NULL, 0, NULL, NULL);
        ck_assert_int_eq(varlink_call_parse(got, &call), 0);
        ck_assert_str_eq(call.method, VMMB_METHOD_ALLOC);
        ck_assert_int_eq(alloc_params_decode(call.parameters, &a2, &bad, &msg), 0);
        ck_assert_uint_eq(a2.size, a.size);
        ck_assert_int_eq(a2.device, 1);
        ck_assert_str_eq(a2.label, a.label);
        alloc_params_done(&a2);
        varlink_call_done(&call);

        /* device and label absent */
        json_object_put(TAKE_PTR(p));
        a = (AllocParams){ .size = 5, .device = VMMB_DEVICE_ANY };
        ck_assert_int_eq(alloc_params_encode(&a, &p), 0);
        ck_assert_str_eq(json_object_to_json_string_ext(p, JSON_C_TO_STRING_PLAIN), "{\"size\":5}");
        ck_assert_int_eq(alloc_params_decode(p, &a2, &bad, &msg), 0);
        ck_assert_int_eq(a2.device, VMMB_DEVICE_ANY);
        ck_assert_ptr_null(a2.label);
        json_object_put(TAKE_PTR(p));

        p = parse_str("{\"size\":0}");
        ck_assert_int_eq(alloc_params_decode(p, &a2, &bad, &msg), -EINVAL);
        ck_assert_str_eq(bad, "size");
        json_object_put(TAKE_PTR(p));
        p = parse_str("{\"size\":1,\"label\":\"\\u0007\"}");
        ck_assert_int_eq(alloc_params_decode(p, &a2, &bad, &msg), -EINVAL);
        ck_assert_str_eq(bad, "label");
        json_object_put(TAKE_PTR(p));

        ck_assert_int_eq(free_params_encode(&f, &p), 0);
        ck_assert_int_eq(free_params_decode(p, &f2, &bad, &msg), 0);
        ck_assert_str_eq(f2.id, "lease-42");
        free_params_done(&f2);
        json_object_put(TAKE_PTR(p));
        ck_assert_int_eq(free_params_decode(NULL, &f2, &bad, &msg), -EINVAL);
        ck_assert_str_eq(bad, "id");

        ck_assert_int_eq(list_params_encode(&l, &p), 0);
        ck_assert_int_eq(list_params_decode(p, &l2, &bad, &msg), 0);
        ck_assert(l2.all);
        ck_assert_int_eq(list_params_decode(NULL, &l2, &bad, &msg), 0);
        ck_assert(!l2.all);
        json_object_put(TAKE_PTR(p));

        ck_assert_int_eq(empty_params_encode(&p), 0);
        ck_assert_int_eq(empty_params_decode(p, &bad, &msg), 0);
        ck_assert_int_eq(empty_params_decode(NULL, &bad, &msg), 0);
        json_object_put(TAKE_PTR(p));
        p = parse_str("{\"x\":1}");
        ck_assert_int_eq(empty_params_decode(p, &bad, &msg), -EINVAL);
        ck_assert_str_eq(bad, "x");
        json_object_put(TAKE_PTR(p));

        ck_assert_int_eq(interface_params_encode(&ip, &p), 0);
        ck_assert_int_eq(interface_params_decode(p, &ip2, &bad, &msg), 0);
        ck_assert_str_eq(ip2.interface, VMMB_INTERFACE);
        interface_params_done(&ip2);
        free(msg);
}
END_TEST

START_TEST(test_codec_replies) {
        _cleanup_free_ char *msg = NULL;
        VarlinkReply reply;
        json_object *p, *rp;
        int fds[2], pipes[2];
        _cleanup_free_ int *got_fds = NULL;
        size_t n_got = 0;

        /* Alloc: a lease with two slabs, fds sent in reverse order */
        {
                WireSlab slabs[] = { { .size = 1 << 21, .fd = 1 }, { .size = 1 << 22, .fd = 0 } };
                AllocReply in = { .lease = { .id = (char *)"L1", .device = 0, .size = 6 << 20,
                                             .slabs = slabs, .n_slabs = 2 } }, out;

                ck_assert_int_eq(pipe2(pipes, O_CLOEXEC), 0);
                fds[0] = pipes[0];
                fds[1] = pipes[1];
                ck_assert_int_eq(alloc_reply_encode(&in, &p), 0);
                rp = reply_round_trip(p, fds, 2, &got_fds, &n_got, &reply);
                json_object_put(p);
                ck_assert_uint_eq(n_got, 2);
                ck_assert_int_eq(alloc_reply_decode(rp, n_got, &out, &msg), 0);
                ck_assert_str_eq(out.lease.id, "L1");
                ck_assert_uint_eq(out.lease.size, 6 << 20);
                ck_assert_uint_eq(out.lease.n_slabs, 2);
                ck_assert_uint_eq(out.lease.slabs[0].size, 1 << 21);
                ck_assert_uint_eq(out.lease.slabs[0].fd, 1);
                assert_same_file(pipes[1], got_fds[out.lease.slabs[0].fd]);
                alloc_reply_done(&out);
                /* the wrong number of fds, or an index out of range, is refused */
                ck_assert_int_eq(alloc_reply_decode(rp, 1, &out, &msg), -EINVAL);
                ck_assert_ptr_null(out.lease.id);
                varlink_reply_done(&reply);
                close_many(got_fds, n_got);
                close_many(pipes, 2);
                slabs[0].fd = 0;
                ck_assert_int_eq(alloc_reply_encode(&in, &p), 0);
                ck_assert_int_eq(alloc_reply_decode(p, 2, &out, &msg), -EINVAL);
                json_object_put(p);
        }

        /* List, with an unprintable process name made printable by the encoder */
        {
                WireLeaseInfo leases[] = {
                        { .id = (char *)"L1", .device = 0, .size = 4096, .slabs = 1, .pid = 10, .uid = 1000,
                          .comm = (char *)"bad\x1b\xff", .label = NULL, .created = 1700000000000000 },
                        { .id = (char *)"L2", .device = 1, .size = 8192, .slabs = 2, .pid = 11, .uid = 0,
                          .comm = NULL, .label = (char *)"x", .created = -1 },
                };
                ListReply in = { .leases = leases, .n_leases = 2 }, out;

                ck_assert_int_eq(list_reply_encode(&in, &p), 0);
                rp = reply_round_trip(p, NULL, 0, NULL, NULL, &reply);
                json_object_put(p);
                ck_assert_int_eq(list_reply_decode(rp, &out, &msg), 0);
                ck_assert_uint_eq(out.n_leases, 2);
                ck_assert_str_eq(out.leases[0].comm, "bad??");
                ck_assert_ptr_null(out.leases[0].label);
                ck_assert_int_eq(out.leases[0].created, 1700000000000000);
                ck_assert_str_eq(out.leases[1].label, "x");
                ck_assert_ptr_null(out.leases[1].comm);
                ck_assert_int_eq(out.leases[1].uid, 0);
                ck_assert_int_eq(out.leases[1].created, -1);
                list_reply_done(&out);
                ck_assert_ptr_null(out.leases);
                varlink_reply_done(&reply);

                /* an empty list */
                in.n_leases = 0;
                in.leases = NULL;
                ck_assert_int_eq(list_reply_encode(&in, &p), 0);
                ck_assert_str_eq(json_object_to_json_string_ext(p, JSON_C_TO_STRING_PLAIN), "{\"leases\":[]}");
                ck_assert_int_eq(list_reply_decode(p, &out, &msg), 0);
                ck_assert_uint_eq(out.n_leases, 0);
                json_object_put(p);
        }

        /* Status */
        {
                WireDevice devices[] = { { .index = 0, .name = (char *)"Simulated GPU", .total = 1ULL << 34,
                                           .granularity = 1 << 21, .capacity = 1ULL << 33, .leased = 1 << 21,
                                           .scrubbing = 0, .cached = 1 << 22, .leases = 1 } };
                StatusReply in = { .devices = devices, .n_devices = 1 }, out;

                ck_assert_int_eq(status_reply_encode(&in, &p), 0);
                rp = reply_round_trip(p, NULL, 0, NULL, NULL, &reply);
                json_object_put(p);
                ck_assert_int_eq(status_reply_decode(rp, &out, &msg), 0);
                ck_assert_uint_eq(out.n_devices, 1);
                ck_assert_str_eq(out.devices[0].name, "Simulated GPU");
                ck_assert_uint_eq(out.devices[0].total, 1ULL << 34);
                ck_assert_uint_eq(out.devices[0].cached, 1 << 22);
                status_reply_done(&out);
                varlink_reply_done(&reply);
        }

        /* GetInfo and GetInterfaceDescription */
        {
                VarlinkInfo info;
                InterfaceDescription d;

                ck_assert_int_eq(varlink_info_encode(&p), 0);
                rp = reply_round_trip(p, NULL, 0, NULL, NULL, &reply);
                json_object_put(p);
                ck_assert_int_eq(varlink_info_decode(rp, &info, &msg), 0);
                ck_assert_str_eq(info.vendor, "vmmbroker");
                ck_assert_str_eq(info.product, "vmmbrokerd");
                ck_assert_uint_eq(info.n_interfaces, 2);
                ck_assert_str_eq(info.interfaces[0], "org.varlink.service");
                ck_assert_str_eq(info.interfaces[1], "io.vmmbroker");
                ck_assert_ptr_null(info.interfaces[2]);
                varlink_info_done(&info);
                varlink_reply_done(&reply);

                ck_assert_int_eq(interface_description_encode(VMMB_INTERFACE, &p), 0);
                rp = reply_round_trip(p, NULL, 0, NULL, NULL, &reply);
                json_object_put(p);
                ck_assert_int_eq(interface_description_decode(rp, &d, &msg), 0);
                ck_assert_str_eq(d.description, vmmb_interface_description);
                ck_assert_ptr_nonnull(strstr(d.description, "\ninterface io.vmmbroker\n"));
                ck_assert_ptr_nonnull(strstr(d.description, "method Alloc("));
                interface_description_done(&d);
                varlink_reply_done(&reply);

                ck_assert_int_eq(interface_description_encode(VARLINK_SERVICE_INTERFACE, &p), 0);
                json_object_put(p);
                ck_assert_int_eq(interface_description_encode("org.example", &p), -ENOENT);
        }
}
END_TEST

START_TEST(test_codec_errors) {
        _cleanup_free_ char *msg = NULL;
        json_object *env[10] = {};
        VmmbError e;
        VarlinkReply reply;
        size_t n = 0;

        ck_assert_int_eq(vmmb_error_out_of_memory(0, 1 << 30, 1 << 20, "Device 0 has 1 MiB free.", &env[n++]), 0);
        ck_assert_int_eq(vmmb_error_quota_exceeded("bytes", 1 << 30, 1 << 29, "Over the quota.", &env[n++]), 0);
        ck_assert_int_eq(vmmb_error_no_such_lease("L9", &env[n++]), 0);
        ck_assert_int_eq(vmmb_error_no_such_device(7, &env[n++]), 0);
        ck_assert_int_eq(vmmb_error_invalid_parameter("size", "Parameter 'size' must be an integer.", &env[n++]), 0);
        ck_assert_int_eq(vmmb_error_permission_denied("Only administrators may list all leases.", &env[n++]), 0);
        ck_assert_int_eq(vmmb_error_driver_error("cuMemCreate: CUDA_ERROR_UNKNOWN\nsecond line", &env[n++]), 0);
        ck_assert_int_eq(varlink_error_method_not_found("io.vmmbroker.Nope", &env[n++]), 0);
        ck_assert_int_eq(varlink_error_interface_not_found("org.example", &env[n++]), 0);
        ck_assert_int_eq(varlink_error_invalid_parameter("interface", &env[n++]), 0);

        for (size_t i = 0; i < n; i++) {
                _cleanup_(json_object_putp) json_object *got = round_trip(env[i], NULL, 0, NULL, NULL);

                ck_assert_int_eq(varlink_reply_parse(got, &reply), 0);
                ck_assert_ptr_nonnull(reply.error);
                ck_assert_int_eq(vmmb_error_decode(reply.error, reply.parameters, &e, &msg), 0);
                switch (i) {
                case 0:
                        ck_assert_str_eq(reply.error, VMMB_ERROR_OUT_OF_MEMORY);
                        ck_assert_int_eq(e.device, 0);
                        ck_assert_uint_eq(e.requested, 1 << 30);
                        ck_assert_uint_eq(e.available, 1 << 20);
                        ck_assert_str_eq(e.message, "Device 0 has 1 MiB free.");
                        ck_assert_int_eq(vmmb_error_to_errno(reply.error), -ENOMEM);
                        break;
                case 1:
                        ck_assert_str_eq(e.resource, "bytes");
                        ck_assert_uint_eq(e.current, 1 << 29);
                        ck_assert_int_eq(vmmb_error_to_errno(reply.error), -EDQUOT);
                        break;
                case 2:
                        ck_assert_str_eq(e.id, "L9");
                        ck_assert_int_eq(vmmb_error_to_errno(reply.error), -ENOENT);
                        break;
                case 3:
                        ck_assert_int_eq(e.device, 7);
                        ck_assert_int_eq(vmmb_error_to_errno(reply.error), -ENODEV);
                        break;
                case 4:
                        ck_assert_str_eq(e.parameter, "size");
                        ck_assert_int_eq(vmmb_error_to_errno(reply.error), -EINVAL);
                        break;
                case 5:
                        ck_assert_int_eq(vmmb_error_to_errno(reply.error), -EACCES);
                        break;
                case 6:
                        ck_assert_str_eq(e.message, "cuMemCreate: CUDA_ERROR_UNKNOWN?second line");
                        ck_assert_int_eq(vmmb_error_to_errno(reply.error), -EIO);
                        break;
                case 7:
                        ck_assert_str_eq(e.method, "io.vmmbroker.Nope");
                        ck_assert_int_eq(vmmb_error_to_errno(reply.error), -EOPNOTSUPP);
                        break;
                case 8:
                        ck_assert_str_eq(e.interface, "org.example");
                        break;
                case 9:
                        ck_assert_str_eq(reply.error, VARLINK_ERROR_INVALID_PARAMETER);
                        ck_assert_str_eq(e.parameter, "interface");
                        break;
                }
                vmmb_error_done(&e);
                varlink_reply_done(&reply);
                json_object_put(env[i]);
        }
        ck_assert_int_eq(vmmb_error_to_errno("org.example.Other"), -EPROTO);
        ck_assert_int_eq(vmmb_error_decode("org.example.Other", NULL, &e, &msg), 0);
}
END_TEST

/* ---- Replies written as text (varlink_reply_write(), *_reply_write()) ---- */

/* t holds exactly what json_write() makes of the reply envelope around `params` (taken), and is strict JSON. */
static void assert_text_is_reply(const VarlinkText *t, json_object *params) {
        _cleanup_(json_object_putp) json_object *env = NULL, *back = NULL;
        _cleanup_free_ char *want = NULL;
        size_t alloc = 0;
        ssize_t end;

        ck_assert_ptr_nonnull(params);
        ck_assert_int_eq(varlink_reply_new(params, &env), 0);
        json_object_put(params);
        end = json_write(env, &want, &alloc, 0);
        ck_assert_int_gt(end, 0);
        ck_assert_uint_eq(t->len, (size_t)end);
        ck_assert_uint_gt(t->alloc, t->len);
        ck_assert_msg(memcmp(t->data, want, t->len) == 0, "wrote %.*s\nvia json-c: %.*s", (int)t->len, t->data,
                      (int)end, want);
        ck_assert_int_eq(json_parse_message(t->data, t->len, &back), 0);
}

/* Names that need escaping or making printable, as a device or user name could hold. */
static const char *const odd_names[] = {
        "",
        "Simulated GPU",
        "\"quoted\" \\back\\",
        "ctl \x01\x08\t\n\x0c\r\x1b\x1f\x7f \xc2\x85",
        "NVIDIA H100 80GB HBM3 \xe2\x80\x94 \xc3\xa9\xe6\x97\xa5\xf0\x9f\x98\x80",
        "bad \xff\xc0\xaf\xed\xa0\x80\xe2\x82",
        ("a very long name that is longer than any limit on names here, repeated: a very long name that is "
         "longer than any limit on names here, repeated: a very long name that is longer than any limit"),
};

START_TEST(test_reply_text) {
        VarlinkText t = {};
        json_object *p = NULL;

        /* Alloc: with and without the optional members, names that need escaping */
        for (size_t i = 0; i < ELEMENTSOF(odd_names); i++) {
                WireSlab slabs[] = { { .size = 1 << 21, .fd = 0 }, { .size = INT64_MAX, .fd = 1 } };
                AllocReply in = { .lease = { .id = (char *)odd_names[i], .device = INT64_MAX, .size = 0,
                                             .slabs = slabs, .n_slabs = 2, .owner = 4294967294,
                                             .owner_name = (char *)odd_names[i], .readonly = true } };

                ck_assert_int_eq(alloc_reply_write(&in, &t), 0);
                ck_assert_int_eq(alloc_reply_encode(&in, &p), 0);
                assert_text_is_reply(&t, p);

                in.lease.owner = JSON_ABSENT;
                in.lease.owner_name = NULL;
                in.lease.readonly = false;
                in.lease.n_slabs = 0;   /* an empty slab array is still there */
                ck_assert_int_eq(alloc_reply_write(&in, &t), 0);
                ck_assert_int_eq(alloc_reply_encode(&in, &p), 0);
                assert_text_is_reply(&t, p);
                ck_assert_ptr_null(strstr(t.data, "owner"));
                ck_assert_ptr_null(strstr(t.data, "readonly"));
        }
        {
                /* a required member missing or out of range: the encoder's error, and nothing to send */
                AllocReply in = { .lease = { .id = NULL, .owner = JSON_ABSENT } };

                ck_assert_int_eq(alloc_reply_write(&in, &t), -EINVAL);
                ck_assert_uint_eq(t.len, 0);
                in.lease.id = (char *)"L1";
                in.lease.size = UINT64_MAX;
                ck_assert_int_eq(alloc_reply_write(&in, &t), -ERANGE);
                ck_assert_int_eq(alloc_reply_encode(&in, &p), -ERANGE);
                ck_assert_uint_eq(t.len, 0);
        }

        /* Free: kept either way, and the empty reply */
        for (int kept = 0; kept < 2; kept++) {
                ck_assert_int_eq(free_reply_write(&(FreeReply){ .kept = kept }, &t), 0);
                ck_assert_int_eq(free_reply_encode(&(FreeReply){ .kept = kept }, &p), 0);
                assert_text_is_reply(&t, p);
        }
        ck_assert_int_eq(empty_reply_write(&t), 0);
        ck_assert_int_eq(empty_params_encode(&p), 0);
        assert_text_is_reply(&t, p);
        ck_assert_str_eq(t.data, "{\"parameters\":{}}");        /* the writer left room for the NUL */

        /* Status: no device; devices with odd names, every optional member absent or at its extreme */
        {
                StatusReply in = { .devices = NULL, .n_devices = 0 };
                WireDevice devices[ELEMENTSOF(odd_names)];

                ck_assert_int_eq(status_reply_write(&in, &t), 0);
                ck_assert_int_eq(status_reply_encode(&in, &p), 0);
                assert_text_is_reply(&t, p);
                ck_assert_str_eq(t.data, "{\"parameters\":{\"devices\":[]}}");

                for (size_t i = 0; i < ELEMENTSOF(odd_names); i++) {
                        bool absent = i % 2 == 0;

                        devices[i] = (WireDevice){
                                .index = (int64_t)i, .name = (char *)odd_names[i], .total = INT64_MAX,
                                .granularity = 1 << 21, .capacity = 0, .leased = 1, .scrubbing = 2, .cached = 3,
                                .leases = 4,
                                .waiters = absent ? JSON_ABSENT : 0,
                                .numa_node = absent ? JSON_ABSENT : INT64_MAX,
                                .host_capacity = absent ? INT64_MIN : 5,
                                .parked = absent ? JSON_ABSENT : 6,
                                .host_cached = absent ? JSON_ABSENT : 7,
                                .kept = absent ? JSON_ABSENT : 8,
                        };
                }
                in = (StatusReply){ .devices = devices, .n_devices = ELEMENTSOF(devices),
                                    .placement = (char *)"spread \"x\"\n" };
                ck_assert_int_eq(status_reply_write(&in, &t), 0);
                ck_assert_int_eq(status_reply_encode(&in, &p), 0);
                assert_text_is_reply(&t, p);
                in.placement = NULL;
                ck_assert_int_eq(status_reply_write(&in, &t), 0);
                ck_assert_int_eq(status_reply_encode(&in, &p), 0);
                assert_text_is_reply(&t, p);
                ck_assert_ptr_null(strstr(t.data, "placement"));

                devices[1].total = (uint64_t)INT64_MAX + 1;
                ck_assert_int_eq(status_reply_write(&in, &t), -ERANGE);
                devices[1].total = 0;
                devices[1].name = NULL;
                ck_assert_int_eq(status_reply_write(&in, &t), -EINVAL);
        }
        {
                /* many devices: a reply far larger than any buffer's first size */
                _cleanup_free_ WireDevice *many = calloc(2000, sizeof(WireDevice));
                StatusReply in = { .devices = many, .n_devices = 2000, .placement = (char *)"pack" };

                ck_assert_ptr_nonnull(many);
                for (size_t i = 0; i < 2000; i++)
                        many[i] = (WireDevice){ .index = (int64_t)i, .name = (char *)odd_names[i % ELEMENTSOF(odd_names)],
                                                .total = i << 30, .waiters = JSON_ABSENT, .numa_node = (int64_t)i % 4,
                                                .host_capacity = JSON_ABSENT, .parked = JSON_ABSENT,
                                                .host_cached = JSON_ABSENT, .kept = (int64_t)i };
                ck_assert_int_eq(status_reply_write(&in, &t), 0);
                ck_assert_uint_gt(t.len, 2000 * 100);
                ck_assert_int_eq(status_reply_encode(&in, &p), 0);
                assert_text_is_reply(&t, p);
        }
        varlink_text_done(&t);
        ck_assert_ptr_null(t.data);
        ck_assert_uint_eq(t.len, 0);
}
END_TEST

typedef struct Variant {
        json_object *v;
} Variant;

static const JsonField variant_fields[] = {
        JSON_FIELD_VARIANT("v", Variant, v, true),
        JSON_FIELD_END,
};

/* A serializer that writes a NUL, as one set on a json-c double could. */
static int write_nul(json_object *o, struct printbuf *pb, int level, int flags) {
        return printbuf_memappend(pb, "1\0", 2);
}

/*
 * No text the writers make holds a NUL, which varlink_conn_send_text() only asserts: a json-c string's NUL is
 * escaped, and json-c's text for a double that holds one is refused, with nothing written.
 */
START_TEST(test_text_nul) {
        _cleanup_(json_object_putp) json_object *s = json_object_new_string_len("a\0b", 3),
                                                *d = json_object_new_double(1);
        VarlinkText t = {};

        ck_assert(s && d);
        ck_assert_int_eq(varlink_reply_write(&t, variant_fields, &(Variant){ .v = s }), 0);
        ck_assert_str_eq(t.data, "{\"parameters\":{\"v\":\"a\\u0000b\"}}");
        ck_assert_uint_eq(t.len, strlen(t.data));
        ck_assert_int_eq(varlink_call_write(&t, "io.example.M", variant_fields, &(Variant){ .v = s }, true, false), 0);
        ck_assert_str_eq(t.data, "{\"method\":\"io.example.M\",\"parameters\":{\"v\":\"a\\u0000b\"},\"oneway\":true}");
        ck_assert_uint_eq(t.len, strlen(t.data));

        json_object_set_serializer(d, write_nul, NULL, NULL);
        ck_assert_int_eq(varlink_reply_write(&t, variant_fields, &(Variant){ .v = d }), -EBADMSG);
        ck_assert_uint_eq(t.len, 0);
        ck_assert_int_eq(varlink_call_write(&t, "io.example.M", variant_fields, &(Variant){ .v = d }, false, false),
                         -EBADMSG);
        ck_assert_uint_eq(t.len, 0);
        varlink_text_done(&t);
}
END_TEST

/* ---- Calls written as text (varlink_call_write(), *_params_write()) ---- */

/*
 * t holds exactly what json_write() makes of varlink_call_new(method, params (taken), oneway, more), is strict
 * JSON, and reads back as that call (varlink_call_parse_text()).
 */
static void assert_text_is_call(const VarlinkText *t, const char *method, json_object *params, bool oneway,
                                bool more) {
        _cleanup_(json_object_putp) json_object *env = NULL, *back = NULL;
        _cleanup_free_ char *want = NULL;
        VarlinkCall call = {};
        size_t alloc = 0;
        ssize_t end;

        ck_assert_int_eq(varlink_call_new(method, params, oneway, more, &env), 0);
        json_object_put(params);
        end = json_write(env, &want, &alloc, 0);
        ck_assert_int_gt(end, 0);
        ck_assert_uint_eq(t->len, (size_t)end);
        ck_assert_uint_gt(t->alloc, t->len);
        ck_assert_int_eq(t->data[t->len], 0);
        ck_assert_msg(memcmp(t->data, want, t->len) == 0, "wrote %.*s\nvia json-c: %.*s", (int)t->len, t->data,
                      (int)end, want);
        ck_assert_int_eq(json_parse_message(t->data, t->len, &back), 0);
        ck_assert_int_eq(varlink_call_parse_text(t->data, t->len, &call), 0);
        ck_assert_str_eq(call.method, method);
        ck_assert(call.oneway == oneway && call.more == more);
        varlink_call_done(&call);
}

START_TEST(test_call_text) {
        VarlinkText t = {};
        json_object *p = NULL;

        /* Free: ids that need escaping or making printable (and one over VMMB_ID_MAX), keep and oneway or not */
        for (size_t i = 0; i < ELEMENTSOF(odd_names); i++)
                for (unsigned bits = 0; bits < 4; bits++) {
                        FreeParams in = { .id = (char *)odd_names[i], .keep = bits & 1 };
                        bool oneway = bits & 2;

                        ck_assert_int_eq(free_params_write(&in, oneway, &t), 0);
                        ck_assert_int_eq(free_params_encode(&in, &p), 0);
                        assert_text_is_call(&t, VMMB_METHOD_FREE, p, oneway, false);
                        ck_assert(!strstr(t.data, "\"keep\"") == !in.keep);
                        ck_assert(!strstr(t.data, "\"oneway\"") == !oneway);
                }
        {
                /* the id is required: the encoder's error, and nothing to send */
                FreeParams in = {};

                ck_assert_int_eq(free_params_write(&in, true, &t), -EINVAL);
                ck_assert_int_eq(free_params_encode(&in, &p), -EINVAL);
                ck_assert_uint_eq(t.len, 0);
        }

        /* Alloc: labels as odd as the names, each optional member absent and present */
        for (size_t i = 0; i < ELEMENTSOF(odd_names); i++) {
                uint64_t devices[] = { 0, 7, INT64_MAX };
                AllocParams in = { .size = 1, .device = VMMB_DEVICE_ANY, .label = (char *)odd_names[i],
                                   .wait_usec = 0 };
                AllocParams out = {};

                ck_assert_int_eq(alloc_params_write(&in, &t), 0);
                ck_assert_int_eq(alloc_params_encode(&in, &p), 0);
                assert_text_is_call(&t, VMMB_METHOD_ALLOC, p, false, false);
                ck_assert_ptr_null(strstr(t.data, "wait_usec"));        /* 0 is left out, as absent */
                ck_assert_ptr_null(strstr(t.data, "device"));

                in = (AllocParams){ .size = INT64_MAX, .device = 3, .label = NULL, .wait_usec = INT64_MAX };
                ck_assert_int_eq(alloc_params_write(&in, &t), 0);
                ck_assert_int_eq(alloc_params_encode(&in, &p), 0);
                assert_text_is_call(&t, VMMB_METHOD_ALLOC, p, false, false);
                ck_assert_ptr_null(strstr(t.data, "label"));

                in = (AllocParams){ .size = 1 << 21, .device = VMMB_DEVICE_ANY, .label = (char *)odd_names[i],
                                    .wait_usec = JSON_ABSENT, .devices = devices, .n_devices = ELEMENTSOF(devices) };
                ck_assert_int_eq(alloc_params_write(&in, &t), 0);
                ck_assert_int_eq(alloc_params_encode(&in, &p), 0);
                assert_text_is_call(&t, VMMB_METHOD_ALLOC, p, false, false);

                /* and the daemon reads back what was asked */
                {
                        VarlinkCall call = {};

                        ck_assert_int_eq(varlink_call_parse_text(t.data, t.len, &call), 0);
                        ck_assert_ptr_nonnull(call.parameters_text);
                        ck_assert_int_eq(alloc_params_decode_text(call.parameters_text, call.parameters_len, &out,
                                                                  NULL, NULL), 0);
                        ck_assert_uint_eq(out.size, 1 << 21);
                        ck_assert_uint_eq(out.n_devices, 3);
                        ck_assert_uint_eq(out.devices[2], INT64_MAX);
                        ck_assert_int_eq(out.wait_usec, JSON_ABSENT);
                        ck_assert_ptr_nonnull(out.label);
                        alloc_params_done(&out);
                        varlink_call_done(&call);
                }
        }
        {
                /* out of range: the encoder's errors, and nothing to send */
                uint64_t devices[] = { (uint64_t)INT64_MAX + 1 };
                AllocParams in = { .size = UINT64_MAX, .device = VMMB_DEVICE_ANY, .wait_usec = JSON_ABSENT };

                ck_assert_int_eq(alloc_params_write(&in, &t), -ERANGE);
                ck_assert_int_eq(alloc_params_encode(&in, &p), -ERANGE);
                ck_assert_uint_eq(t.len, 0);
                in.size = 1;
                in.devices = devices;
                in.n_devices = 1;
                ck_assert_int_eq(alloc_params_write(&in, &t), alloc_params_encode(&in, &p));
                ck_assert_int_lt(alloc_params_encode(&in, &p), 0);
                ck_assert_uint_eq(t.len, 0);
        }

        /* Attach: tokens and names as odd as the others, by either, read-only or not; what the encoder refuses,
         * refused the same */
        for (size_t i = 0; i < ELEMENTSOF(odd_names); i++)
                for (unsigned bits = 0; bits < 4; bits++) {
                        AttachParams in = { .token = bits & 1 ? (char *)odd_names[i] : NULL,
                                            .name = bits & 1 ? NULL : (char *)odd_names[i], .readonly = bits & 2 };
                        int k = attach_params_encode(&in, &p);

                        ck_assert_int_eq(attach_params_write(&in, &t), k);
                        if (k < 0) {
                                ck_assert_uint_eq(t.len, 0);
                                continue;
                        }
                        assert_text_is_call(&t, VMMB_METHOD_ATTACH, p, false, false);
                        ck_assert(!strstr(t.data, "\"readonly\"") == !in.readonly);
                }

        /* no parameters (Status), with each of oneway and more; a valid name of the longest length */
        for (unsigned bits = 0; bits < 4; bits++) {
                ck_assert_int_eq(varlink_call_write(&t, VMMB_METHOD_STATUS, NULL, NULL, bits & 1, bits & 2), 0);
                assert_text_is_call(&t, VMMB_METHOD_STATUS, NULL, bits & 1, bits & 2);
        }
        {
                char name[VARLINK_MAX_NAME + 2];

                memset(name, 'a', sizeof(name) - 1);
                name[sizeof(name) - 1] = 0;
                name[1] = '.';
                ck_assert_int_eq(varlink_call_write(&t, name, NULL, NULL, false, false), -EINVAL);
                ck_assert_uint_eq(t.len, 0);
                name[VARLINK_MAX_NAME] = 0;
                ck_assert_int_eq(varlink_call_write(&t, name, NULL, NULL, false, true), 0);
                assert_text_is_call(&t, name, NULL, false, true);
        }

        /* what json-c and the writer both refuse */
        ck_assert_int_eq(varlink_call_write(&t, "Status", NULL, NULL, false, false), -EINVAL);
        ck_assert_int_eq(varlink_call_new("Status", NULL, false, false, &p), -EINVAL);
        ck_assert_int_eq(varlink_call_write(&t, "io.vmmbroker.\"Status", NULL, NULL, false, false), -EINVAL);
        ck_assert_uint_eq(t.len, 0);
        varlink_text_done(&t);
        ck_assert_ptr_null(t.data);
}
END_TEST

/* The writer's text of one message, compared whole with what the wire must carry. */
static void assert_text_is(int k, VarlinkText *t, const char *want) {
        ck_assert_int_eq(k, 0);
        ck_assert_msg(t->len == strlen(want) && memcmp(t->data, want, t->len) == 0, "wrote %.*s\nwant  %s",
                      (int)t->len, t->data, want);
}

/*
 * Each call and reply written as text, spelled out byte for byte: the oracle for the codec tables' wire form
 * that does not go through json_build(), which reads json_build_write()'s own text back (the tests above
 * compare the two paths, which now share that walk). A quote escaped, a newline made printable, an absent
 * wait_usec and numa_node left out.
 */
START_TEST(test_text_golden) {
        uint64_t devices[] = { 1, 3 };
        WireSlab slabs[] = { { .size = 67108864, .fd = 0 }, { .size = 2097152, .fd = 1 } };
        WireDevice dev = { .index = 0, .name = (char *)"Sim \"GPU\"", .total = 1, .granularity = 2097152,
                           .capacity = 3, .leased = 4, .scrubbing = 5, .cached = 6, .leases = 7, .waiters = 0,
                           .numa_node = JSON_ABSENT, .host_capacity = 8, .parked = 9, .host_cached = 10,
                           .kept = 11 };
        VarlinkText t = {};

        assert_text_is(free_params_write(&(FreeParams){ .id = (char *)"ab\"c", .keep = true }, true, &t), &t,
                       "{\"method\":\"io.vmmbroker.Free\",\"parameters\":{\"id\":\"ab\\\"c\",\"keep\":true},"
                       "\"oneway\":true}");
        assert_text_is(alloc_params_write(&(AllocParams){ .size = 69206016, .device = VMMB_DEVICE_ANY,
                                                          .label = (char *)"l\n1", .wait_usec = 0,
                                                          .devices = devices, .n_devices = 2 }, &t), &t,
                       "{\"method\":\"io.vmmbroker.Alloc\",\"parameters\":{\"size\":69206016,\"label\":\"l?1\","
                       "\"devices\":[1,3]}}");
        assert_text_is(attach_params_write(&(AttachParams){ .name = (char *)"alice/w", .readonly = true }, &t), &t,
                       "{\"method\":\"io.vmmbroker.Attach\",\"parameters\":{\"name\":\"alice/w\",\"readonly\":true}}");
        assert_text_is(alloc_reply_write(&(AllocReply){ .lease = { .id = (char *)"id1", .device = 2, .size = 69206016,
                                                                   .slabs = slabs, .n_slabs = 2, .owner = 1000,
                                                                   .owner_name = (char *)"alice", .readonly = true } },
                                         &t), &t,
                       "{\"parameters\":{\"lease\":{\"id\":\"id1\",\"device\":2,\"size\":69206016,\"slabs\":"
                       "[{\"size\":67108864,\"fd\":0},{\"size\":2097152,\"fd\":1}],\"owner\":1000,"
                       "\"owner_name\":\"alice\",\"readonly\":true}}}");
        assert_text_is(free_reply_write(&(FreeReply){ .kept = true }, &t), &t, "{\"parameters\":{\"kept\":true}}");
        assert_text_is(status_reply_write(&(StatusReply){ .devices = &dev, .n_devices = 1,
                                                          .placement = (char *)"most-free" }, &t), &t,
                       "{\"parameters\":{\"devices\":[{\"index\":0,\"name\":\"Sim \\\"GPU\\\"\",\"total\":1,"
                       "\"granularity\":2097152,\"capacity\":3,\"leased\":4,\"scrubbing\":5,\"cached\":6,"
                       "\"leases\":7,\"waiters\":0,\"host_capacity\":8,\"parked\":9,\"host_cached\":10,"
                       "\"kept\":11}],\"placement\":\"most-free\"}}");
        varlink_text_done(&t);
}
END_TEST

/* Text replies queue like json-c ones: joined to fd-less output, alone with fds, large ones whole. */
START_TEST(test_send_text) {
        _cleanup_(varlink_conn_freep) VarlinkConn *rx = NULL, *tx = NULL;
        _cleanup_(json_object_putp) json_object *first = NULL;
        _cleanup_close_ int peer = -EBADF;
        _cleanup_free_ WireDevice *many = calloc(1000, sizeof(WireDevice));
        VarlinkText t = {}, big = {};
        int pipes[2], before, too_many[FDPASS_MAX_FDS + 1];
        StatusReply status = { .devices = many, .n_devices = 1000 };
        WireSlab slabs[] = { { .size = 1 << 21, .fd = 0 }, { .size = 1 << 21, .fd = 1 } };
        AllocReply lease = { .lease = { .id = (char *)"L\"1", .slabs = slabs, .n_slabs = 2, .owner = JSON_ABSENT } };

        ck_assert_ptr_nonnull(many);
        for (size_t i = 0; i < 1000; i++)
                many[i] = (WireDevice){ .index = (int64_t)i, .name = (char *)"GPU \"\\\x01", .waiters = JSON_ABSENT,
                                        .numa_node = JSON_ABSENT, .host_capacity = JSON_ABSENT,
                                        .parked = JSON_ABSENT, .host_cached = JSON_ABSENT, .kept = JSON_ABSENT };
        ck_assert_int_eq(status_reply_write(&status, &big), 0);
        ck_assert_uint_gt(big.len, 64 * 1024);

        ck_assert_int_eq(pipe2(pipes, O_CLOEXEC), 0);
        conn_pair(VARLINK_MAX_REPLY, true, &rx, &peer);
        ck_assert_int_eq(varlink_conn_new(&tx, TAKE_FD(peer), VARLINK_MAX_REQUEST, false), 0);
        before = count_fds();

        /* a json-c message, an empty reply joined to it, a lease with fds alone, then the large Status */
        first = parse_str("{\"parameters\":{\"n\":1}}");
        ck_assert_int_eq(varlink_conn_send(tx, first, NULL, 0), 0);
        ck_assert_int_eq(empty_reply_write(&t), 0);
        ck_assert_int_eq(varlink_conn_send_text(tx, &t, NULL, 0), 0);
        ck_assert_int_eq(alloc_reply_write(&lease, &t), 0);
        ck_assert_int_eq(varlink_conn_send_text(tx, &t, pipes, 2), 0);
        ck_assert_int_eq(varlink_conn_send_text(tx, &big, NULL, 0), 0);
        ck_assert_int_eq(count_fds(), before + 2);              /* the queue's duplicates */
        ck_assert_uint_eq(varlink_conn_pending(tx), strlen("{\"parameters\":{\"n\":1}}") + 1 +
                          strlen("{\"parameters\":{}}") + 1 + t.len + 1 + big.len + 1);

        /* what cannot be sent is refused, and nothing is queued for it (a NUL cannot be written: test_text_nul) */
        {
                size_t pending = varlink_conn_pending(tx);
                VarlinkText none = {};

                for (size_t i = 0; i < ELEMENTSOF(too_many); i++)
                        too_many[i] = pipes[0];
                ck_assert_int_eq(varlink_conn_send_text(tx, &none, NULL, 0), -EINVAL);
                ck_assert_int_eq(varlink_conn_send_text(tx, &t, too_many, ELEMENTSOF(too_many)), -E2BIG);
                ck_assert_uint_eq(varlink_conn_pending(tx), pending);
        }

        /* the peer reads while the writer flushes: the large reply does not fit the socket at once */
        {
                json_object *o[4] = {};
                _cleanup_free_ int *got = NULL;
                size_t n = 0, n_got = 0, n_fds[4] = {};
                int r;

                ck_assert_int_eq(fcntl(varlink_conn_get_fd(tx), F_SETFL, O_NONBLOCK), 0);
                ck_assert_int_eq(fcntl(varlink_conn_get_fd(rx), F_SETFL, O_NONBLOCK), 0);
                while (n < 4) {
                        int *f = NULL;

                        r = varlink_conn_flush(tx);
                        ck_assert(r == 0 || r == -EAGAIN);
                        r = varlink_conn_next_json(rx, &o[n], &f, &n_fds[n]);
                        ck_assert_int_ge(r, 0);
                        if (r == 1) {
                                if (f) {
                                        free(got);
                                        got = f;
                                        n_got = n_fds[n];
                                }
                                n++;
                                continue;
                        }
                        r = varlink_conn_read(rx);
                        ck_assert(r > 0 || r == -EAGAIN);
                }
                ck_assert_uint_eq(varlink_conn_pending(tx), 0);
                ck_assert_str_eq(json_object_to_json_string_ext(o[1], JSON_C_TO_STRING_PLAIN), "{\"parameters\":{}}");
                ck_assert_uint_eq(n_fds[0] + n_fds[1] + n_fds[3], 0);
                ck_assert_uint_eq(n_fds[2], 2);
                assert_same_file(pipes[0], got[0]);
                assert_same_file(pipes[1], got[1]);
                close_many(got, n_got);
                {
                        VarlinkReply reply;
                        AllocReply a;
                        StatusReply st;
                        _cleanup_free_ char *msg = NULL;

                        ck_assert_int_eq(varlink_reply_parse(o[2], &reply), 0);
                        ck_assert_int_eq(alloc_reply_decode(reply.parameters, 2, &a, &msg), 0);
                        ck_assert_str_eq(a.lease.id, "L\"1");
                        alloc_reply_done(&a);
                        varlink_reply_done(&reply);
                        ck_assert_int_eq(varlink_reply_parse(o[3], &reply), 0);
                        ck_assert_int_eq(status_reply_decode(reply.parameters, &st, &msg), 0);
                        ck_assert_uint_eq(st.n_devices, 1000);
                        ck_assert_str_eq(st.devices[999].name, "GPU \"\\?");
                        status_reply_done(&st);
                        varlink_reply_done(&reply);
                }
                for (size_t i = 0; i < ELEMENTSOF(o); i++)
                        json_object_put(o[i]);
        }
        ck_assert_int_eq(count_fds(), before);
        close_many(pipes, 2);
        varlink_text_done(&t);
        varlink_text_done(&big);
}
END_TEST

/* ---- the text readers against the json-c path (differential.h) ---- */

static void ck_differential(const char *text, size_t len) {
        const char *why = differential_check(text, len);

        ck_assert_msg(!why, "text and json-c paths differ (%s) on: %.*s", why ?: "", (int)MIN(len, (size_t)400),
                      text);
}

/* ck_differential() of text, of every prefix of it, and of it with every byte in turn changed. */
static void ck_differential_mutated(const char *text) {
        static const char subst[] = { 0, '"', '\\', '}', ']', ',', ':', '1', '-', '.', 'e', 'n', ' ', '\x80', '{' };
        size_t len = strlen(text);
        _cleanup_free_ char *m = malloc(len + 1);

        ck_assert_ptr_nonnull(m);
        for (size_t n = 0; n <= len; n++)
                ck_differential(text, n);
        for (size_t i = 0; i < len; i++)
                for (size_t k = 0; k < sizeof(subst); k++) {
                        memcpy(m, text, len);
                        m[i] = subst[k];
                        ck_differential(m, len);
                }
}

/* Every message of every seed of the fuzz corpus: the bytes after the 4-byte header, cut at each NUL. */
START_TEST(test_text_corpus) {
        DIR *d = opendir(FUZZ_CORPUS);
        struct dirent *e;
        size_t n_messages = 0;

        ck_assert_ptr_nonnull(d);
        while ((e = readdir(d))) {
                _cleanup_free_ char *path = NULL, *data = NULL;
                size_t size = 0, alloc = 0;
                FILE *f;

                if (e->d_name[0] == '.')
                        continue;
                ck_assert_int_ge(asprintf(&path, "%s/%s", FUZZ_CORPUS, e->d_name), 0);
                f = fopen(path, "re");
                ck_assert_ptr_nonnull(f);
                for (;;) {
                        size_t n;

                        if (alloc - size < 4096) {
                                alloc = alloc * 2 + 4096;
                                data = realloc(data, alloc);
                                ck_assert_ptr_nonnull(data);
                        }
                        n = fread(data + size, 1, alloc - size, f);
                        if (n == 0)
                                break;
                        size += n;
                }
                fclose(f);
                for (size_t at = MIN(size, (size_t)4); at < size;) {
                        const char *nul = memchr(data + at, 0, size - at);
                        size_t len = nul ? (size_t)(nul - (data + at)) : size - at;

                        ck_differential(data + at, len);
                        n_messages++;
                        at += len + 1;
                }
        }
        closedir(d);
        ck_assert_uint_gt(n_messages, 100);
}
END_TEST

static const char *const text_messages[] = {
        /* calls as clients send them, and replies as the daemon does */
        "{\"method\":\"io.vmmbroker.Status\",\"parameters\":{}}",
        "{\"method\":\"io.vmmbroker.Status\"}",
        "{\"parameters\":{},\"method\":\"io.vmmbroker.Status\",\"oneway\":false,\"more\":false}",
        "{\"method\":\"io.vmmbroker.Alloc\",\"parameters\":{\"size\":2097152,\"device\":0,\"label\":\"w\",\"wait_usec\":5}}",
        "{\"method\":\"io.vmmbroker.Alloc\",\"parameters\":{\"size\":1,\"devices\":[0,1]},\"oneway\":true}",
        "{\"method\":\"io.vmmbroker.Free\",\"parameters\":{\"id\":\"0123456789abcdef\",\"keep\":true}}",
        "{\"method\":\"io.vmmbroker.Free\",\"parameters\":null}",
        "{\"parameters\":{\"devices\":[{\"index\":0,\"name\":\"sim\",\"total\":1,\"granularity\":2,\"capacity\":3,"
        "\"leased\":0,\"scrubbing\":0,\"cached\":0,\"leases\":0,\"waiters\":0}],\"placement\":\"spread\"}}",
        "{\"parameters\":{\"lease\":{\"id\":\"ab\",\"device\":0,\"size\":2,\"slabs\":[{\"size\":2,\"fd\":0}]}}}",
        "{\"parameters\":{\"kept\":true}}",
        "{\"kept\":true}", "{\"kept\":false}",       /* a Free reply's parameters, read as such */
        "{\"error\":\"io.vmmbroker.InvalidParameter\",\"parameters\":{\"parameter\":\"size\",\"message\":\"x\"}}",
        "{\"parameters\":{},\"continues\":true}",
        /* envelopes that json-c reads differently or refuses */
        "{\"method\":\"io.vmmbroker.Status\",\"method\":\"io.vmmbroker.Status\"}",
        "{\"method\":\"io.vmmbroker.Status\",\"parameters\":{},\"parameters\":{}}",
        "{\"method\":\"io.vmmbroker.Status\",\"parameters\":{\"a\":1,\"a\":1}}",
        "{\"method\":\"io.vmmbroker.Status\",\"parameters\":{\"a\":{\"b\":[{\"c\":1,\"c\":2}]}}}",
        "{\"method\":\"io.vmmbroker.Status\",\"parameters\":{\"\\u0061\":1,\"a\":1}}",
        "{\"method\":\"io.vmmbroker.Status\",\"parameters\":{\"k1\":1,\"k2\":1,\"k3\":1,\"k4\":1,\"k5\":1,\"k6\":1,"
        "\"k7\":1,\"k8\":1,\"k9\":1,\"k10\":1,\"k11\":1,\"k12\":1,\"k13\":1,\"k14\":1,\"k15\":1,\"k16\":1,\"k17\":1}}",
        "{\"method\":\"io.vmmbroker.Status\",\"parameters\":{\"k1\":1,\"k2\":1,\"k3\":1,\"k4\":1,\"k5\":1,\"k6\":1,"
        "\"k7\":1,\"k8\":1,\"k9\":1,\"k10\":1,\"k11\":1,\"k12\":1,\"k13\":1,\"k14\":1,\"k15\":1,\"k1\":1}}",
        "{\"method\":\"io.vmmbroker.Status\",\"parameters\":[]}",
        "{\"method\":\"io.vmmbroker.Status\",\"parameters\":\"x\"}",
        "{\"method\":\"io.vmmbroker.Status\",\"oneway\":1}",
        "{\"method\":\"io.vmmbroker.Status\",\"more\":null}",
        "{\"method\":\"io.vmmbroker.Status\",\"color\":1}",
        "{\"method\":\"io.vmmbroker..Status\"}",
        "{\"method\":\"Status\"}",
        "{\"method\":\"io.vmmbroker.Stat\\u0075s\"}",
        "{\"method\":\"io.vmmbroker.Status\\u0000\"}",
        "{\"method\":null}",
        "{\"method\":1}",
        "{}",
        "{\"method\":\"io.vmmbroker.Alloc\",\"parameters\":{\"size\":1.5}}",
        "{\"method\":\"io.vmmbroker.Alloc\",\"parameters\":{\"size\":-0}}",
        "{\"method\":\"io.vmmbroker.Alloc\",\"parameters\":{\"size\":9223372036854775808}}",
        "{\"method\":\"io.vmmbroker.Alloc\",\"parameters\":{\"size\":18446744073709551616}}",
        "{\"method\":\"io.vmmbroker.Alloc\",\"parameters\":{\"size\":1,\"device\":-1}}",
        "{\"method\":\"io.vmmbroker.Alloc\",\"parameters\":{\"size\":1,\"device\":0,\"devices\":[0]}}",
        "{\"method\":\"io.vmmbroker.Alloc\",\"parameters\":{\"size\":1,\"label\":\"\\ud800\"}}",
        "{\"method\":\"io.vmmbroker.Alloc\",\"parameters\":{\"size\":1,\"label\":\"\xff\"}}",
        "{\"method\":\"io.vmmbroker.Alloc\",\"parameters\":{\"size\":1,\"label\":\"a\\u001bb\"}}",
        "{\"method\":\"io.vmmbroker.Alloc\",\"parameters\":{\"size\":1,\"color\":1}}",
        "{\"method\":\"io.vmmbroker.Free\",\"parameters\":{\"id\":\"\"}}",
        "{\"method\":\"io.vmmbroker.Free\",\"parameters\":{\"keep\":true}}",
        "{\"parameters\":{\"lease\":{\"id\":\"ab\",\"device\":0,\"size\":2,\"slabs\":[{\"size\":2,\"fd\":1}]}}}",
        "{\"parameters\":{\"lease\":{\"id\":\"ab\",\"device\":0,\"size\":2,\"slabs\":[{\"size\":2,\"fd\":0},"
        "{\"size\":2,\"fd\":0}]}}}",
        "{\"parameters\":{\"kept\":1}}",
        "{\"parameters\":{\"devices\":[]}}",
        "{\"error\":\"nope\",\"parameters\":{}}",
        "{\"parameters\":{}} ",
        "{\"parameters\":{}}x",
};

START_TEST(test_text_hostile) {
        _cleanup_free_ char *big = malloc(70000);
        size_t n;

        ck_assert_ptr_nonnull(big);
        for (size_t i = 0; i < ELEMENTSOF(text_messages); i++)
                ck_differential_mutated(text_messages[i]);

        /* nesting in the parameters at and past the limit (the envelope counts as one) */
        for (int depth = 13; depth <= 17; depth++) {
                n = (size_t)sprintf(big, "{\"method\":\"io.vmmbroker.Status\",\"parameters\":{\"a\":");
                for (int i = 0; i < depth; i++)
                        big[n++] = '[';
                for (int i = 0; i < depth; i++)
                        big[n++] = ']';
                n += (size_t)sprintf(big + n, "}}");
                ck_differential(big, n);
        }
        /* a label of 60,000 bytes; 5,000 devices */
        n = (size_t)sprintf(big, "{\"method\":\"io.vmmbroker.Alloc\",\"parameters\":{\"size\":1,\"label\":\"");
        memset(big + n, 'x', 60000);
        n += 60000;
        n += (size_t)sprintf(big + n, "\"}}");
        ck_differential(big, n);
        n = (size_t)sprintf(big, "{\"method\":\"io.vmmbroker.Alloc\",\"parameters\":{\"size\":1,\"devices\":[");
        for (int i = 0; i < 5000; i++)
                n += (size_t)sprintf(big + n, "%d,", i % 10);
        n += (size_t)sprintf(big + n, "0]}}");
        ck_differential(big, n);
}
END_TEST

int main(void) {
        Suite *s = suite_create("varlink");
        TCase *tc = tcase_create("varlink");
        int failed;

        tcase_add_test(tc, test_split_bytes);
        tcase_add_test(tc, test_many_in_one_read);
        tcase_add_test(tc, test_oversized);
        tcase_add_test(tc, test_unterminated_eof);
        tcase_add_test(tc, test_receive_text);
        tcase_add_test(tc, test_fds_on_their_message);
        tcase_add_test(tc, test_fds_merged_read);
        tcase_add_test(tc, test_fds_mid_message);
        tcase_add_test(tc, test_no_fds_mode);
        tcase_add_test(tc, test_pending_output);
        tcase_add_test(tc, test_envelopes);
        tcase_add_test(tc, test_codec_calls);
        tcase_add_test(tc, test_codec_replies);
        tcase_add_test(tc, test_codec_errors);
        tcase_add_test(tc, test_reply_text);
        tcase_add_test(tc, test_call_text);
        tcase_add_test(tc, test_text_golden);
        tcase_add_test(tc, test_text_nul);
        tcase_add_test(tc, test_send_text);
        tcase_add_test(tc, test_text_corpus);
        tcase_add_test(tc, test_text_hostile);
        suite_add_tcase(s, tc);
        failed = run_suite(s);
        return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
