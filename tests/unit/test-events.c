/* SPDX-License-Identifier: MIT */

/*
 * daemon/events.c: what a lease event says, byte for byte, as journald's native protocol gets it: the
 * fields docs/metrics.md lists, the MESSAGE_ID of each kind, a client's command name with its control
 * characters as '?' (it must not end a line), and a value too long for the buffer cut with the lines after
 * it left out. The events go to a sink of the test's own (events_set_sink()).
 */

#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "events.h"
#include "unit.h"

static char got[8192];
static size_t got_len;
static unsigned got_n;

static void sink(const char *buf, size_t len, void *userdata) {
        ck_assert_uint_le(got_len + len, sizeof(got));
        memcpy(got + got_len, buf, len);
        got_len += len;
        got_n++;
}

static void setup(void) {
        got_len = 0;
        got_n = 0;
        events_set_sink(sink, NULL);
}

static void teardown(void) {
        events_set_sink(NULL, NULL);
}

/* The events sent since setup(), one after another. */
static void expect(const char *text) {
        ck_assert_uint_eq(got_len, strlen(text));
        ck_assert_msg(memcmp(got, text, got_len) == 0, "sent:\n%.*s\nexpected:\n%s", (int)got_len, got, text);
}

static Lease lease(void) {
        Lease l = { .device = 1, .size = UINT64_C(2097152), .uid = 1000 };

        strcpy(l.id, "5f0c6d7e8f9a0b1c2d3e4f5a6b7c8d9e");
        return l;
}

START_TEST(test_made) {
        Lease l = lease();
        Holder h = { .pid = 4242, .uid = 1001 };

        setup();
        strcpy(h.comm, "python3");
        event_lease_made(&l, &h);
        ck_assert_uint_eq(got_n, 1);
        expect("MESSAGE=Lease 5f0c6d7e8f9a0b1c2d3e4f5a6b7c8d9e of user 1000 (2097152 bytes on device 1) made, "
               "pid 4242 (python3)\n"
               "MESSAGE_ID=0de65dd031a748d68ab8a21db492ba9f\n"
               "PRIORITY=6\n"
               "SYSLOG_IDENTIFIER=vmmbrokerd\n"
               "VMMBROKER_EVENT=made\n"
               "VMMBROKER_LEASE=5f0c6d7e8f9a0b1c2d3e4f5a6b7c8d9e\n"
               "VMMBROKER_UID=1000\n"
               "VMMBROKER_DEVICE=1\n"
               "VMMBROKER_SIZE=2097152\n"
               "VMMBROKER_PID=4242\n"
               "VMMBROKER_HOLDER_UID=1001\n"
               "VMMBROKER_COMM=python3\n");
        teardown();
}
END_TEST

START_TEST(test_command_name_control_characters) {
        Lease l = lease();
        Holder h = { .pid = 7, .uid = 0 };

        setup();
        l.size = UINT64_MAX;
        strcpy(h.comm, "a\nB=1\x7f\t");
        event_lease_parked(&l, &h, true);
        expect("MESSAGE=Lease 5f0c6d7e8f9a0b1c2d3e4f5a6b7c8d9e of user 1000 (18446744073709551615 bytes on device "
               "1) parked in host memory by, pid 7 (a?B=1?" "?)\n"     /* two strings: "??)" is a trigraph */
               "MESSAGE_ID=f88eabfed2c34498adfeec4308aea91e\n"
               "PRIORITY=6\n"
               "SYSLOG_IDENTIFIER=vmmbrokerd\n"
               "VMMBROKER_EVENT=parked\n"
               "VMMBROKER_LEASE=5f0c6d7e8f9a0b1c2d3e4f5a6b7c8d9e\n"
               "VMMBROKER_UID=1000\n"
               "VMMBROKER_DEVICE=1\n"
               "VMMBROKER_SIZE=18446744073709551615\n"
               "VMMBROKER_PID=7\n"
               "VMMBROKER_HOLDER_UID=0\n"
               "VMMBROKER_COMM=a?B=1??\n");
        teardown();
}
END_TEST

START_TEST(test_published_without_command_name) {
        Lease l = lease();
        Holder h = { .pid = 1, .uid = 1000 };

        setup();
        l.name = (char *)"weights";
        l.device = 0;
        event_lease_published(&l, &h);
        expect("MESSAGE=Lease 5f0c6d7e8f9a0b1c2d3e4f5a6b7c8d9e of user 1000 (2097152 bytes on device 0) published "
               "as \"weights\"\n"
               "MESSAGE_ID=fa60aa4219404f26a82ce2656986598b\n"
               "PRIORITY=6\n"
               "SYSLOG_IDENTIFIER=vmmbrokerd\n"
               "VMMBROKER_EVENT=published\n"
               "VMMBROKER_LEASE=5f0c6d7e8f9a0b1c2d3e4f5a6b7c8d9e\n"
               "VMMBROKER_UID=1000\n"
               "VMMBROKER_DEVICE=0\n"
               "VMMBROKER_SIZE=2097152\n"
               "VMMBROKER_PID=1\n"
               "VMMBROKER_HOLDER_UID=1000\n"
               "VMMBROKER_NAME=weights\n");
        teardown();
}
END_TEST

/* Longer than any real value: the MESSAGE line is cut to fill the buffer, and no field after it fits. */
START_TEST(test_too_long_is_cut) {
        static char name[3000];
        Lease l = lease();
        size_t message;

        setup();
        memset(name, 'n', sizeof(name) - 1);
        l.name = name;
        event_lease_published(&l, NULL);
        ck_assert_uint_eq(got_n, 1);
        message = strlen("MESSAGE=Lease 5f0c6d7e8f9a0b1c2d3e4f5a6b7c8d9e of user 1000 (2097152 bytes on device 1) "
                         "published as \"");
        ck_assert_uint_eq(got_len, 2048);
        ck_assert_int_eq(memcmp(got, "MESSAGE=Lease ", 14), 0);
        for (size_t i = message; i < got_len - 1; i++)
                ck_assert_int_eq(got[i], 'n');
        ck_assert_int_eq(got[got_len - 1], '\n');
        teardown();
}
END_TEST

START_TEST(test_store_health) {
        setup();
        event_store_health(0, 0);               /* no change: nothing */
        ck_assert_uint_eq(got_n, 0);
        event_store_health(0, -EIO);
        event_store_health(-EIO, -ENOSPC);      /* still failing: nothing */
        event_store_health(-ENOSPC, 0);
        ck_assert_uint_eq(got_n, 2);
        expect("MESSAGE=Storing the lease table for restarts failed (Input/output error): changes are refused until "
               "it works again\n"
               "MESSAGE_ID=431089d712b7428b9a9622a4d718f33b\n"
               "PRIORITY=3\n"
               "SYSLOG_IDENTIFIER=vmmbrokerd\n"
               "VMMBROKER_EVENT=store_failed\n"
               "ERRNO=5\n"
               "MESSAGE=Storing the lease table for restarts works again\n"
               "MESSAGE_ID=3a2f480e28484bd195c0f2e792bbf4e0\n"
               "PRIORITY=5\n"
               "SYSLOG_IDENTIFIER=vmmbrokerd\n"
               "VMMBROKER_EVENT=store_recovered\n");
        teardown();
}
END_TEST

/* No command name (a process that exited before it was read): '?' in the message, no VMMBROKER_COMM. */
START_TEST(test_made_without_command_name) {
        Lease l = lease();
        Holder h = { .pid = 99, .uid = 1000 };

        setup();
        event_lease_made(&l, &h);
        ck_assert_uint_eq(got_n, 1);
        expect("MESSAGE=Lease 5f0c6d7e8f9a0b1c2d3e4f5a6b7c8d9e of user 1000 (2097152 bytes on device 1) made, "
               "pid 99 (?)\n"
               "MESSAGE_ID=0de65dd031a748d68ab8a21db492ba9f\n"
               "PRIORITY=6\n"
               "SYSLOG_IDENTIFIER=vmmbrokerd\n"
               "VMMBROKER_EVENT=made\n"
               "VMMBROKER_LEASE=5f0c6d7e8f9a0b1c2d3e4f5a6b7c8d9e\n"
               "VMMBROKER_UID=1000\n"
               "VMMBROKER_DEVICE=1\n"
               "VMMBROKER_SIZE=2097152\n"
               "VMMBROKER_PID=99\n"
               "VMMBROKER_HOLDER_UID=1000\n");
        teardown();
}
END_TEST

/*
 * A line that starts with room left but does not fit is cut where only its newline still does: here the last
 * one, VMMBROKER_NAME, after every line before it was sent whole. Its control characters are '?' too.
 */
START_TEST(test_last_field_cut) {
        static char name[1001], want[4096];
        Lease l = lease();
        int head;

        setup();
        memset(name, 'n', sizeof(name) - 1);
        name[0] = '\n';
        l.name = name;
        event_lease_published(&l, NULL);
        head = snprintf(want, sizeof(want),
                        "MESSAGE=Lease 5f0c6d7e8f9a0b1c2d3e4f5a6b7c8d9e of user 1000 (2097152 bytes on device 1) "
                        "published as \"?%s\"\n"
                        "MESSAGE_ID=fa60aa4219404f26a82ce2656986598b\n"
                        "PRIORITY=6\n"
                        "SYSLOG_IDENTIFIER=vmmbrokerd\n"
                        "VMMBROKER_EVENT=published\n"
                        "VMMBROKER_LEASE=5f0c6d7e8f9a0b1c2d3e4f5a6b7c8d9e\n"
                        "VMMBROKER_UID=1000\n"
                        "VMMBROKER_DEVICE=1\n"
                        "VMMBROKER_SIZE=2097152\n"
                        "VMMBROKER_NAME=?",
                        name + 1);
        ck_assert_int_lt(head, 2047);                   /* the name's line starts with room left... */
        ck_assert_int_gt(head + 999 + 1, 2048);         /* ...and would not fit whole */
        memset(want + head, 'n', (size_t)(2047 - head));
        want[2047] = '\n';
        want[2048] = 0;
        ck_assert_uint_eq(got_n, 1);
        expect(want);
        teardown();
}
END_TEST

int main(void) {
        return run_suite(UNIT_SUITE("events", NULL, test_made, test_command_name_control_characters,
                                    test_published_without_command_name, test_made_without_command_name,
                                    test_too_long_is_cut, test_last_field_cut, test_store_health)) == 0
                       ? EXIT_SUCCESS
                       : EXIT_FAILURE;
}
