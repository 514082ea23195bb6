/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Asserting wrappers of harness.h and rawclient.h, for the tests that run under Check (the integration and
 * client tests): each calls the function it is named after and fails the test, saying why, where that
 * returns an error. Neither harness.h nor rawclient.h asserts (bench programs and forked children use them).
 */

#include <sys/types.h>

#include "harness.h"
#include "rawclient.h"

/*
 * harness_start_config() with `config` (vmmbroker.conf lines) and `args` after its --config, or harness_start()
 * with `args` where `config` is NULL; fails the test unless the daemon started.
 */
void harness_start_or_fail(Harness *h, const char *config, const char *const *args);

/* harness_start_capped(): a daemon whose device holds `capacity`, with `config`; fails the test unless it started. */
void harness_start_capped_or_fail(Harness *h, const char *capacity, const char *config);

/* harness_stop(); fails the test unless the daemon exited with status 0. */
void harness_stop_or_fail(Harness *h);

/*
 * connector_open(): forks a process of `uid` that makes `n` connections to `socket` and hands them over as
 * VarlinkConns into ret[]; fails the test unless they came. connector_finish() lets it exit.
 */
Connector connector_start(const char *socket, uid_t uid, unsigned n, VarlinkConn **ret);

/* connector_close(); fails the test unless the connector exited with status 0. */
void connector_finish(Connector *x);

/* watch_reclaim(): WatchReclaim on `c`, and its first reply; fails the test unless the watch is on. */
void watch_reclaim_or_fail(VarlinkConn *c);

/*
 * reply_read() and lease_take(): the answer to an Alloc sent on `c` (a waiting one, say), which must be a lease;
 * its fds are closed (test_lease_close()): the lease stays leased. Fails the test otherwise.
 */
TestLease lease_reply_or_fail(VarlinkConn *c);
