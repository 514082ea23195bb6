/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * What the daemon counts for people who watch it, and the OpenMetrics text of
 * the Metrics method (docs/metrics.md lists every metric):
 *
 *   - requests, by method and outcome, and how long each method took to
 *     answer (a histogram in seconds): counted by peer.c around method_call();
 *   - lease events (made, ended, reclaimed from an exited holder, published,
 *     unpublished, parked, unparked, store failed, store recovered): counted
 *     by events.c;
 *   - how this run started: leases taken back from an earlier run's table;
 *   - how long each dispatch of the event loop took, by what it dispatched
 *     (a histogram in seconds): while one runs, nobody else is served.
 *     manager.c times each dispatch, and each handler names itself first
 *     (metrics_loop_source()).
 *
 * Everything else the text shows is read when it is asked for, from what the
 * daemon keeps anyway: the pool's per-device statistics, the lease table's
 * per-device counts, each user's charges and the store's counters. Nothing
 * walks the lease table: a scrape costs O(devices + users x devices).
 *
 * The counters are one set per process (the daemon has one event loop and
 * one thread), so that the layers that count them need no way to reach the
 * manager.
 */

#include <stdbool.h>
#include <stdint.h>
#include <json-c/json.h>

#include "broker.h"

/* The methods counted by name; any other is counted as "other". */
typedef enum MetricsMethod {
        METRICS_ALLOC,
        METRICS_FREE,
        METRICS_SHARE,
        METRICS_REVOKE,
        METRICS_TOKENS,
        METRICS_ATTACH,
        METRICS_PUBLISH,
        METRICS_UNPUBLISH,
        METRICS_LIST,
        METRICS_USERS,
        METRICS_STATUS,
        METRICS_METRICS,
        METRICS_SET_RECLAIMABLE,
        METRICS_WATCH_RECLAIM,
        METRICS_PARK,
        METRICS_UNPARK,
        METRICS_GET_INFO,
        METRICS_GET_INTERFACE_DESCRIPTION,
        METRICS_OTHER,
        _METRICS_METHOD_MAX,
} MetricsMethod;

/* What a request came to: "ok", an error the daemon answered (by its short name), or "failed". */
typedef enum MetricsOutcome {
        METRICS_OK,
        METRICS_OUT_OF_MEMORY,
        METRICS_OUT_OF_HOST_MEMORY,
        METRICS_QUOTA_EXCEEDED,
        METRICS_NO_SUCH_LEASE,
        METRICS_NO_SUCH_TOKEN,
        METRICS_NO_SUCH_NAME,
        METRICS_NAME_IN_USE,
        METRICS_NO_SUCH_DEVICE,
        METRICS_INVALID_PARAMETER,
        METRICS_PERMISSION_DENIED,
        METRICS_DRIVER_ERROR,
        METRICS_STORE_FAILED,
        METRICS_METHOD_NOT_FOUND,
        METRICS_INTERFACE_NOT_FOUND,
        METRICS_OTHER_ERROR,            /* an error name not in this list */
        METRICS_FAILED,                 /* a failure of the daemon itself: the connection was closed */
        _METRICS_OUTCOME_MAX,
} MetricsOutcome;

/* Lease events (events.h sends them to the journal). */
typedef enum MetricsEvent {
        METRICS_EVENT_MADE,
        METRICS_EVENT_ENDED,
        METRICS_EVENT_RECLAIMED,        /* a hold dropped because its process exited */
        METRICS_EVENT_PUBLISHED,
        METRICS_EVENT_UNPUBLISHED,
        METRICS_EVENT_PARKED,           /* a lease's content moved into host memory */
        METRICS_EVENT_UNPARKED,         /* and back into device memory */
        METRICS_EVENT_STORE_FAILED,
        METRICS_EVENT_STORE_RECOVERED,
        _METRICS_EVENT_MAX,
} MetricsEvent;

/* How a waiting Alloc's wait ended. */
typedef enum MetricsWait {
        METRICS_WAIT_SERVED,
        METRICS_WAIT_EXPIRED,           /* its deadline passed */
        METRICS_WAIT_REFUSED,           /* answered another error (its user's limits, the driver, the store) */
        METRICS_WAIT_LEFT,              /* its connection closed or its process exited */
        METRICS_WAIT_STOPPED,           /* the daemon stopped */
        _METRICS_WAIT_MAX,
} MetricsWait;

/* What one dispatch of the event loop ran: the `source` label of vmmbroker_loop_dispatch_seconds. */
typedef enum MetricsLoop {
        METRICS_LOOP_CONNECTION,        /* a connection read, and its request served at once if it was */
        METRICS_LOOP_SERVE,             /* a round of the fair queue: a request of each user waiting */
        METRICS_LOOP_ACCEPT,            /* new connections */
        METRICS_LOOP_DEVICE,            /* the devices' completions (scrubs, copies, host memory made) and the
                                         * calls they wake */
        METRICS_LOOP_HOLDER_EXIT,       /* processes that exited */
        METRICS_LOOP_WAITERS,           /* waiting Allocs tried again */
        METRICS_LOOP_IDLE,              /* the idle work: snapshots, released slabs' fds closed, STATUS= */
        METRICS_LOOP_TICK,              /* the one-second tick */
        METRICS_LOOP_RECLAIM,           /* a reclaim's deadline */
        METRICS_LOOP_SCRUB,             /* the scrubs queued issued */
        METRICS_LOOP_DEADLINE,          /* a waiting call's or an answer's deadline */
        METRICS_LOOP_SIGNAL,            /* SIGTERM, SIGINT */
        METRICS_LOOP_OTHER,             /* a dispatch no handler named: sd-event's own (exiting) */
        _METRICS_LOOP_MAX,
} MetricsLoop;

/* Histogram buckets, upper bounds in microseconds: 10 us .. 1 s, then +Inf. */
#define METRICS_BUCKETS 16

/* The method a call names. */
MetricsMethod metrics_method(const char *method);

/* The outcome of a reply: its error name (NULL for none) when the daemon answered; failed when k < 0. */
MetricsOutcome metrics_outcome(const char *error, int k);

/* Counts one request, answered in `usec` microseconds. */
void metrics_request(MetricsMethod method, MetricsOutcome outcome, uint64_t usec);

/* CLOCK_MONOTONIC in microseconds, to time a request with. */
uint64_t metrics_clock(void);

/*
 * peer.c's hook: counts the call of `method` begun at `start` (metrics_clock()) that method_call() answered
 * with `reply` (its error, if any, is the outcome) and returned k.
 */
void metrics_request_done(const char *method, json_object *reply, int k, uint64_t start);

/*
 * The loop's hooks: metrics_loop_begin() before a dispatch (returns the time it began, metrics_clock()),
 * metrics_loop_source() first thing in each handler, metrics_loop_end() after the dispatch, which counts it.
 */
uint64_t metrics_loop_begin(void);
void metrics_loop_source(MetricsLoop source);
void metrics_loop_end(uint64_t start);

/* Counts a waiting Alloc's end (peer.c). */
void metrics_wait_done(MetricsWait how);

/* Counts a lease event. */
void metrics_event(MetricsEvent event);

/* A lease event's name, as the metrics' `event` label and the journal's VMMBROKER_EVENT= say it: "made", ... */
const char *metrics_event_name(MetricsEvent event);

/* Counts an event that could not be sent to the journal (its socket was full or gone). */
void metrics_event_dropped(void);

/* How this run started: whether a table of an earlier run came back, and how many leases it restored. */
void metrics_started(bool table_restored, unsigned leases_restored);

/*
 * The OpenMetrics text (ends with "# EOF\n"), malloc'd into *ret. The caller checks that an administrator
 * asked. Returns 0 or -ENOMEM.
 */
int metrics_format(Broker *b, char **ret);

/* Forgets every count (for tests). */
void metrics_reset(void);
