/* SPDX-License-Identifier: MIT */

/*
 * Socket activation without systemd: the daemon takes the listening socket it
 * is passed (LISTEN_FDS, LISTEN_PID), serves on it, binds nothing of its own,
 * and refuses to start when passed something it cannot use.
 */

#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "codec.h"
#include "harness.h"
#include "macro.h"
#include "unit.h"
#include "varlink.h"

/* Calls GetInfo on `path` and returns the product it names (malloc'd), or NULL. */
static char *get_info_product(const char *path) {
        json_object *call = NULL, *reply = NULL, *params, *product;
        VarlinkConn *c = NULL;
        char *ret = NULL;

        ck_assert_int_eq(harness_conn_open(path, false, &c), 0);
        ck_assert_int_eq(varlink_call_new(VARLINK_METHOD_GET_INFO, NULL, false, false, &call), 0);
        ck_assert_int_eq(varlink_conn_send(c, call, NULL, 0), 0);
        ck_assert_int_eq(varlink_conn_flush(c), 0);
        ck_assert_int_eq(varlink_conn_receive(c, &reply, NULL, NULL), 1);
        if (json_object_object_get_ex(reply, "parameters", &params) &&
            json_object_object_get_ex(params, "product", &product))
                ret = strdup(json_object_get_string(product));
        json_object_put(reply);
        json_object_put(call);
        varlink_conn_free(c);
        return ret;
}

START_TEST(test_serves_inherited_socket) {
        _cleanup_free_ char *product = NULL;
        char unused[128];
        struct stat st;
        Harness h;

        ck_assert_int_eq(harness_start_full(&h, NULL, 1), 0);
        product = get_info_product(h.socket);
        ck_assert_ptr_nonnull(product);
        ck_assert_str_eq(product, "vmmbrokerd");
        /* It served on the passed socket and bound nothing itself. */
        snprintf(unused, sizeof(unused), "%s/not-inherited", h.dir);
        ck_assert_int_eq(stat(unused, &st), -1);
        ck_assert_int_eq(errno, ENOENT);
        ck_assert_int_eq(harness_stop(&h), 0);
}
END_TEST

START_TEST(test_refuses_two_sockets) {
        Harness h;

        /* Two sockets is a unit file mistake: the daemon says so and does not start. */
        ck_assert_int_eq(harness_start_full(&h, NULL, 2), -ECHILD);
}
END_TEST

int main(void) {
        Suite *s = UNIT_SUITE("activation", NULL, test_serves_inherited_socket, test_refuses_two_sockets);

        return run_suite(s) == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
