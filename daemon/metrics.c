/* SPDX-License-Identifier: MIT */

#include <errno.h>
#include <stddef.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "codec.h"
#include "macro.h"
#include "metrics.h"

static const char *const method_names[_METRICS_METHOD_MAX] = {
        [METRICS_ALLOC] = VMMB_METHOD_ALLOC,
        [METRICS_FREE] = VMMB_METHOD_FREE,
        [METRICS_SHARE] = VMMB_METHOD_SHARE,
        [METRICS_REVOKE] = VMMB_METHOD_REVOKE,
        [METRICS_TOKENS] = VMMB_METHOD_TOKENS,
        [METRICS_ATTACH] = VMMB_METHOD_ATTACH,
        [METRICS_PUBLISH] = VMMB_METHOD_PUBLISH,
        [METRICS_UNPUBLISH] = VMMB_METHOD_UNPUBLISH,
        [METRICS_LIST] = VMMB_METHOD_LIST,
        [METRICS_USERS] = VMMB_METHOD_USERS,
        [METRICS_STATUS] = VMMB_METHOD_STATUS,
        [METRICS_METRICS] = VMMB_METHOD_METRICS,
        [METRICS_SET_RECLAIMABLE] = VMMB_METHOD_SET_RECLAIMABLE,
        [METRICS_WATCH_RECLAIM] = VMMB_METHOD_WATCH_RECLAIM,
        [METRICS_PARK] = VMMB_METHOD_PARK,
        [METRICS_UNPARK] = VMMB_METHOD_UNPARK,
        [METRICS_GET_INFO] = VARLINK_METHOD_GET_INFO,
        [METRICS_GET_INTERFACE_DESCRIPTION] = VARLINK_METHOD_GET_INTERFACE_DESCRIPTION,
        [METRICS_OTHER] = "other",
};

static const char *const outcome_names[_METRICS_OUTCOME_MAX] = {
        [METRICS_OK] = "ok",
        [METRICS_OUT_OF_MEMORY] = VMMB_ERROR_OUT_OF_MEMORY,
        [METRICS_OUT_OF_HOST_MEMORY] = VMMB_ERROR_OUT_OF_HOST_MEMORY,
        [METRICS_QUOTA_EXCEEDED] = VMMB_ERROR_QUOTA_EXCEEDED,
        [METRICS_NO_SUCH_LEASE] = VMMB_ERROR_NO_SUCH_LEASE,
        [METRICS_NO_SUCH_TOKEN] = VMMB_ERROR_NO_SUCH_TOKEN,
        [METRICS_NO_SUCH_NAME] = VMMB_ERROR_NO_SUCH_NAME,
        [METRICS_NAME_IN_USE] = VMMB_ERROR_NAME_IN_USE,
        [METRICS_NO_SUCH_DEVICE] = VMMB_ERROR_NO_SUCH_DEVICE,
        [METRICS_INVALID_PARAMETER] = VMMB_ERROR_INVALID_PARAMETER,
        [METRICS_PERMISSION_DENIED] = VMMB_ERROR_PERMISSION_DENIED,
        [METRICS_DRIVER_ERROR] = VMMB_ERROR_DRIVER_ERROR,
        [METRICS_STORE_FAILED] = VMMB_ERROR_STORE_FAILED,
        [METRICS_METHOD_NOT_FOUND] = VARLINK_ERROR_METHOD_NOT_FOUND,
        [METRICS_INTERFACE_NOT_FOUND] = VARLINK_ERROR_INTERFACE_NOT_FOUND,
        [METRICS_OTHER_ERROR] = "other",
        [METRICS_FAILED] = "failed",
};

static const char *const event_names[_METRICS_EVENT_MAX] = {
        [METRICS_EVENT_MADE] = "made",
        [METRICS_EVENT_ENDED] = "ended",
        [METRICS_EVENT_RECLAIMED] = "reclaimed",
        [METRICS_EVENT_PUBLISHED] = "published",
        [METRICS_EVENT_UNPUBLISHED] = "unpublished",
        [METRICS_EVENT_PARKED] = "parked",
        [METRICS_EVENT_UNPARKED] = "unparked",
        [METRICS_EVENT_STORE_FAILED] = "store_failed",
        [METRICS_EVENT_STORE_RECOVERED] = "store_recovered",
};

static const char *const wait_names[_METRICS_WAIT_MAX] = {
        [METRICS_WAIT_SERVED] = "served",
        [METRICS_WAIT_EXPIRED] = "expired",
        [METRICS_WAIT_REFUSED] = "refused",
        [METRICS_WAIT_LEFT] = "left",
        [METRICS_WAIT_STOPPED] = "stopped",
};

/* Upper bounds of the buckets in microseconds, and as the `le` label writes them (in seconds). */
static const uint64_t bucket_usec[METRICS_BUCKETS] = {
        10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 25000, 50000, 100000, 250000, 500000, 1000000,
};
static const char *const bucket_le[METRICS_BUCKETS] = {
        "1e-05", "2.5e-05", "5e-05", "0.0001", "0.00025", "0.0005", "0.001", "0.0025", "0.005", "0.01",
        "0.025", "0.05", "0.1", "0.25", "0.5", "1.0",
};

static const char *const loop_names[_METRICS_LOOP_MAX] = {
        [METRICS_LOOP_CONNECTION] = "connection",
        [METRICS_LOOP_SERVE] = "serve",
        [METRICS_LOOP_ACCEPT] = "accept",
        [METRICS_LOOP_DEVICE] = "device",
        [METRICS_LOOP_HOLDER_EXIT] = "holder_exit",
        [METRICS_LOOP_WAITERS] = "waiters",
        [METRICS_LOOP_IDLE] = "idle",
        [METRICS_LOOP_TICK] = "tick",
        [METRICS_LOOP_RECLAIM] = "reclaim",
        [METRICS_LOOP_SCRUB] = "scrub",
        [METRICS_LOOP_DEADLINE] = "deadline",
        [METRICS_LOOP_SIGNAL] = "signal",
        [METRICS_LOOP_OTHER] = "other",
};

typedef struct Histogram {
        uint64_t buckets[METRICS_BUCKETS];      /* not cumulative: one per bucket */
        uint64_t count;
        uint64_t sum_usec;
} Histogram;

static struct {
        uint64_t requests[_METRICS_METHOD_MAX][_METRICS_OUTCOME_MAX];
        Histogram durations[_METRICS_METHOD_MAX];
        Histogram loop[_METRICS_LOOP_MAX];
        MetricsLoop loop_source;        /* of the dispatch under way */
        uint64_t events[_METRICS_EVENT_MAX];
        uint64_t events_dropped;
        uint64_t waits[_METRICS_WAIT_MAX];
        bool table_restored;
        unsigned leases_restored;
        double start_time;              /* seconds since the epoch */
} m;

static double now_realtime(void) {
        struct timespec ts;

        (void)clock_gettime(CLOCK_REALTIME, &ts);
        return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

MetricsMethod metrics_method(const char *method) {
        for (size_t i = 0; i < METRICS_OTHER; i++)
                if (strcmp(method, method_names[i]) == 0)
                        return (MetricsMethod)i;
        return METRICS_OTHER;
}

MetricsOutcome metrics_outcome(const char *error, int k) {
        if (k < 0)
                return METRICS_FAILED;
        if (!error)
                return METRICS_OK;
        for (size_t i = METRICS_OK + 1; i < METRICS_OTHER_ERROR; i++)
                if (strcmp(error, outcome_names[i]) == 0)
                        return (MetricsOutcome)i;
        return METRICS_OTHER_ERROR;
}

static void histogram_add(Histogram *h, uint64_t usec) {
        size_t b = 0;

        while (b < METRICS_BUCKETS && usec > bucket_usec[b])
                b++;
        if (b < METRICS_BUCKETS)
                h->buckets[b]++;
        h->count++;
        h->sum_usec += usec;
}

void metrics_request(MetricsMethod method, MetricsOutcome outcome, uint64_t usec) {
        m.requests[method][outcome]++;
        histogram_add(&m.durations[method], usec);
}

uint64_t metrics_clock(void) {
        struct timespec ts;

        (void)clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000 + (uint64_t)ts.tv_nsec / 1000;
}

void metrics_request_done(const char *method, json_object *reply, int k, uint64_t start) {
        json_object *error = NULL;
        uint64_t now = metrics_clock();

        if (reply)
                (void)json_object_object_get_ex(reply, "error", &error);
        metrics_request(metrics_method(method), metrics_outcome(error ? json_object_get_string(error) : NULL, k),
                        now > start ? now - start : 0);
}

uint64_t metrics_loop_begin(void) {
        m.loop_source = METRICS_LOOP_OTHER;
        return metrics_clock();
}

void metrics_loop_source(MetricsLoop source) {
        m.loop_source = source;
}

void metrics_loop_end(uint64_t start) {
        uint64_t now = metrics_clock();

        histogram_add(&m.loop[m.loop_source], now > start ? now - start : 0);
}

void metrics_event(MetricsEvent event) {
        m.events[event]++;
}

const char *metrics_event_name(MetricsEvent event) {
        return event_names[event];
}

void metrics_wait_done(MetricsWait how) {
        m.waits[how]++;
}

void metrics_event_dropped(void) {
        m.events_dropped++;
}

void metrics_started(bool table_restored, unsigned leases_restored) {
        m.table_restored = table_restored;
        m.leases_restored = leases_restored;
        m.start_time = now_realtime();
}

void metrics_reset(void) {
        memset(&m, 0, sizeof(m));
}

/* --- the text ------------------------------------------------------------------------------------------ */

/* The short name of a method or error: the part after the interface ("Alloc", "NoSuchLease"). */
static const char *short_name(const char *name) {
        const char *dot = strrchr(name, '.');

        return dot ? dot + 1 : name;
}

/* A label value, escaped as OpenMetrics wants: \\, \" and \n. */
static void put_label_value(FILE *f, const char *s) {
        for (; *s; s++)
                switch (*s) {
                case '\\':
                        fputs("\\\\", f);
                        break;
                case '"':
                        fputs("\\\"", f);
                        break;
                case '\n':
                        fputs("\\n", f);
                        break;
                default:
                        fputc(*s, f);
                }
}

/* The metadata of a metric family: TYPE, UNIT (when not NULL), HELP. */
static void family(FILE *f, const char *name, const char *type, const char *unit, const char *help) {
        fprintf(f, "# TYPE %s %s\n", name, type);
        if (unit)
                fprintf(f, "# UNIT %s %s\n", name, unit);
        fprintf(f, "# HELP %s %s\n", name, help);
}

typedef struct DeviceRow {
        PoolDeviceStats s;
        unsigned leases;
} DeviceRow;

/* One gauge per device: `field` of each row. */
static void device_gauge(FILE *f, const DeviceRow *rows, size_t n, const char *name, const char *unit,
                         const char *help, size_t offset) {
        family(f, name, "gauge", unit, help);
        for (size_t i = 0; i < n; i++)
                fprintf(f, "%s{device=\"%d\"} %" PRIu64 "\n", name, rows[i].s.index,
                        *(const uint64_t *)((const char *)&rows[i].s + offset));
}

static void device_counter(FILE *f, const DeviceRow *rows, size_t n, const char *name, const char *help,
                           size_t offset) {
        family(f, name, "counter", NULL, help);
        for (size_t i = 0; i < n; i++)
                fprintf(f, "%s_total{device=\"%d\"} %" PRIu64 "\n", name, rows[i].s.index,
                        *(const uint64_t *)((const char *)&rows[i].s + offset));
}

static int format_devices(FILE *f, Broker *b) {
        size_t n = pool_n_devices(b->pool);
        _cleanup_free_ DeviceRow *rows = calloc(n ?: 1, sizeof(DeviceRow));

        if (!rows)
                return -ENOMEM;
        for (size_t i = 0; i < n; i++) {
                pool_device_stats(b->pool, i, &rows[i].s);
                rows[i].leases = b->leases.device_leases[i];
        }
        family(f, "vmmbroker_device", "info", NULL, "A device the broker serves: its CUDA index and name.");
        for (size_t i = 0; i < n; i++) {
                fprintf(f, "vmmbroker_device_info{device=\"%d\",name=\"", rows[i].s.index);
                put_label_value(f, rows[i].s.name ?: "");
                fputs("\"} 1\n", f);
        }
        device_gauge(f, rows, n, "vmmbroker_device_memory_bytes", "bytes", "Memory of the device.",
                     offsetof(PoolDeviceStats, total));
        device_gauge(f, rows, n, "vmmbroker_device_capacity_bytes", "bytes",
                     "What the pool may hold on the device (Capacity=).", offsetof(PoolDeviceStats, capacity));
        device_gauge(f, rows, n, "vmmbroker_device_leased_bytes", "bytes", "Bytes in leases.",
                     offsetof(PoolDeviceStats, leased));
        device_gauge(f, rows, n, "vmmbroker_device_cached_bytes", "bytes",
                     "Bytes freed, scrubbed and kept for their user to lease again.",
                     offsetof(PoolDeviceStats, cached));
        device_gauge(f, rows, n, "vmmbroker_device_scrubbing_bytes", "bytes",
                     "Bytes freed and being scrubbed (not yet usable).", offsetof(PoolDeviceStats, scrubbing));
        device_gauge(f, rows, n, "vmmbroker_device_host_capacity_bytes", "bytes",
                     "Pinned host memory the pool may hold for the device's parked leases (HostCapacity=).",
                     offsetof(PoolDeviceStats, host_capacity));
        device_gauge(f, rows, n, "vmmbroker_device_parked_bytes", "bytes",
                     "Bytes of host memory holding the device's parked leases, or taken by parks being copied.",
                     offsetof(PoolDeviceStats, parked));
        device_gauge(f, rows, n, "vmmbroker_device_host_cached_bytes", "bytes",
                     "Bytes of host memory zeroed and kept for the next park.",
                     offsetof(PoolDeviceStats, host_cached));
        family(f, "vmmbroker_device_kept_bytes", "gauge", "bytes",
               "Bytes of leases kept for their process's next Alloc of their size (Free with keep); in leased too.");
        for (size_t i = 0; i < n; i++)
                fprintf(f, "vmmbroker_device_kept_bytes{device=\"%d\"} %" PRIu64 "\n", rows[i].s.index,
                        b->leases.device_kept[i]);
        family(f, "vmmbroker_device_leases", "gauge", NULL, "Leases on the device.");
        for (size_t i = 0; i < n; i++)
                fprintf(f, "vmmbroker_device_leases{device=\"%d\"} %u\n", rows[i].s.index, rows[i].leases);
        family(f, "vmmbroker_device_waiters", "gauge", NULL,
               "Alloc calls waiting for memory on the device (wait_usec), or for its scrubs.");
        for (size_t i = 0; i < n; i++)
                fprintf(f, "vmmbroker_device_waiters{device=\"%d\"} %u\n", rows[i].s.index, broker_waiters(b, i));
        device_counter(f, rows, n, "vmmbroker_device_cache_hits", "Slabs leased from the cache.",
                       offsetof(PoolDeviceStats, hits));
        device_counter(f, rows, n, "vmmbroker_device_slabs_created", "Device slabs created with the driver.",
                       offsetof(PoolDeviceStats, created));
        device_counter(f, rows, n, "vmmbroker_device_slabs_released", "Device slabs released to the driver.",
                       offsetof(PoolDeviceStats, released));
        device_counter(f, rows, n, "vmmbroker_device_evictions",
                       "Cached slabs released to make room for a request.", offsetof(PoolDeviceStats, evicted));
        device_counter(f, rows, n, "vmmbroker_device_scrubbed_bytes", "Bytes scrubbed.",
                       offsetof(PoolDeviceStats, scrubbed_bytes));
        device_counter(f, rows, n, "vmmbroker_device_scrub_waits",
                       "Requests that needed memory still being scrubbed: a slab to reuse, room, a kept lease.",
                       offsetof(PoolDeviceStats, scrub_waits));
        device_counter(f, rows, n, "vmmbroker_device_copied_bytes",
                       "Bytes copied between device and host memory by parks and unparks.",
                       offsetof(PoolDeviceStats, copied_bytes));
        device_counter(f, rows, n, "vmmbroker_device_copies_dropped",
                       "Copies of parks and unparks left unfinished because nobody would read them (the move was "
                       "undone, or its lease ended, before their last piece was queued).",
                       offsetof(PoolDeviceStats, copies_dropped));
        device_counter(f, rows, n, "vmmbroker_device_slabs_mapped_ahead",
                       "Slabs (device or host memory) the daemon mapped for its scrubs and copies while idle, a "
                       "second or two after it made them, rather than at their first scrub or copy.",
                       offsetof(PoolDeviceStats, mapped_ahead));
        device_counter(f, rows, n, "vmmbroker_device_host_slabs_kept",
                       "Host slabs the previous run of the daemon had cached for parks and this one took back at "
                       "start, rather than pin them again.",
                       offsetof(PoolDeviceStats, host_adopted));
        return 0;
}

/* A gauge of bytes per user and device: `member`, the offset of one of User's per-device arrays. */
static void user_bytes(FILE *f, Broker *b, const int *index, size_t n, const char *name, const char *help,
                       size_t member) {
        User *u;

        family(f, name, "gauge", "bytes", help);
        list_for_each_entry(u, &b->users.users, link) {
                const uint64_t *v = *(uint64_t *const *)((const char *)u + member);

                for (size_t i = 0; i < b->users.n_devices && i < n; i++)
                        fprintf(f, "%s{uid=\"%u\",device=\"%d\"} %" PRIu64 "\n", name, (unsigned)u->uid, index[i],
                                v[i]);
        }
}

static int format_users(FILE *f, Broker *b) {
        size_t n = pool_n_devices(b->pool);
        _cleanup_free_ int *index = calloc(n ?: 1, sizeof(int));
        User *u;

        if (!index)
                return -ENOMEM;
        for (size_t i = 0; i < n; i++) {
                PoolDeviceStats s;

                pool_device_stats(b->pool, i, &s);
                index[i] = s.index;
        }
        user_bytes(f, b, index, n, "vmmbroker_user_bytes", "Bytes in the leases a user owns on a device.",
                   offsetof(User, bytes));
        user_bytes(f, b, index, n, "vmmbroker_user_max_bytes", "The most a user may own on a device (MaxBytes=).",
                   offsetof(User, max_bytes));
        user_bytes(f, b, index, n, "vmmbroker_user_host_bytes",
                   "Bytes of host memory holding the parked leases a user owns of a device.",
                   offsetof(User, host_bytes));
        user_bytes(f, b, index, n, "vmmbroker_user_max_host_bytes",
                   "The most a user may have parked of a device (MaxHostBytes=).", offsetof(User, max_host_bytes));
        family(f, "vmmbroker_user_leases", "gauge", NULL, "Leases a user owns, published ones included.");
        list_for_each_entry(u, &b->users.users, link)
                fprintf(f, "vmmbroker_user_leases{uid=\"%u\"} %u\n", (unsigned)u->uid, u->leases);
        family(f, "vmmbroker_user_connections", "gauge", NULL, "Connections a user's processes have open.");
        list_for_each_entry(u, &b->users.users, link)
                fprintf(f, "vmmbroker_user_connections{uid=\"%u\"} %u\n", (unsigned)u->uid, u->connections);
        family(f, "vmmbroker_user_processes", "gauge", NULL, "A user's processes the broker keeps a pidfd of.");
        list_for_each_entry(u, &b->users.users, link)
                fprintf(f, "vmmbroker_user_processes{uid=\"%u\"} %u\n", (unsigned)u->uid, u->processes);
        return 0;
}

/* The samples of histogram NAME{LABEL="VALUE"}: none while it counted nothing. */
static void format_histogram(FILE *f, const char *name, const char *label, const char *value, const Histogram *h) {
        uint64_t cumulative = 0;

        if (h->count == 0)
                return;
        for (size_t j = 0; j < METRICS_BUCKETS; j++) {
                cumulative += h->buckets[j];
                fprintf(f, "%s_bucket{%s=\"%s\",le=\"%s\"} %" PRIu64 "\n", name, label, value, bucket_le[j],
                        cumulative);
        }
        fprintf(f, "%s_bucket{%s=\"%s\",le=\"+Inf\"} %" PRIu64 "\n", name, label, value, h->count);
        fprintf(f, "%s_count{%s=\"%s\"} %" PRIu64 "\n", name, label, value, h->count);
        fprintf(f, "%s_sum{%s=\"%s\"} %.6f\n", name, label, value, (double)h->sum_usec / 1e6);
}

static void format_requests(FILE *f) {
        family(f, "vmmbroker_requests", "counter", NULL,
               "Requests answered, by method and outcome (ok, the error's name, or failed: the connection was "
               "closed).");
        for (size_t i = 0; i < _METRICS_METHOD_MAX; i++)
                for (size_t o = 0; o < _METRICS_OUTCOME_MAX; o++)
                        if (m.requests[i][o] > 0)
                                fprintf(f, "vmmbroker_requests_total{method=\"%s\",outcome=\"%s\"} %" PRIu64 "\n",
                                        short_name(method_names[i]), short_name(outcome_names[o]),
                                        m.requests[i][o]);
        family(f, "vmmbroker_request_duration_seconds", "histogram", "seconds",
               "Time from reading a request to having its reply ready, by method.");
        for (size_t i = 0; i < _METRICS_METHOD_MAX; i++)
                format_histogram(f, "vmmbroker_request_duration_seconds", "method", short_name(method_names[i]),
                                 &m.durations[i]);
        family(f, "vmmbroker_loop_dispatch_seconds", "histogram", "seconds",
               "Time of each dispatch of the daemon's event loop, by what it ran: nobody else is served meanwhile.");
        for (size_t i = 0; i < _METRICS_LOOP_MAX; i++)
                format_histogram(f, "vmmbroker_loop_dispatch_seconds", "source", loop_names[i], &m.loop[i]);
}

static void format_broker(FILE *f, Broker *b) {
        unsigned connections = 0;
        User *u;

        list_for_each_entry(u, &b->users.users, link)
                connections += u->connections;
        family(f, "vmmbroker_build", "info", NULL, "The daemon's version.");
        fprintf(f, "vmmbroker_build_info{version=\"%s\"} 1\n", VMMBROKER_VERSION);
        family(f, "vmmbroker_start_time_seconds", "gauge", "seconds",
               "When this run of the daemon started, in seconds since the epoch: it changes at each restart.");
        fprintf(f, "vmmbroker_start_time_seconds %.3f\n", m.start_time);
        family(f, "vmmbroker_restarted", "gauge", NULL,
               "1 when this run took back a lease table that an earlier run stored (a restart), else 0.");
        fprintf(f, "vmmbroker_restarted %d\n", m.table_restored);
        family(f, "vmmbroker_leases_restored", "gauge", NULL, "Leases this run took back from an earlier run.");
        fprintf(f, "vmmbroker_leases_restored %u\n", m.leases_restored);
        family(f, "vmmbroker_leases", "gauge", NULL, "Leases, published ones included.");
        fprintf(f, "vmmbroker_leases %u\n", b->leases.n_leases);
        family(f, "vmmbroker_leases_published", "gauge", NULL, "Leases published under a name.");
        fprintf(f, "vmmbroker_leases_published %u\n", b->leases.n_published);
        family(f, "vmmbroker_users", "gauge", NULL, "Users with something charged (a connection or a lease).");
        fprintf(f, "vmmbroker_users %u\n", b->users.n_users);
        family(f, "vmmbroker_connections", "gauge", NULL, "Connections served.");
        fprintf(f, "vmmbroker_connections %u\n", connections);
        family(f, "vmmbroker_lease_events", "counter", NULL,
               "Lease events, by kind (made, ended, reclaimed, published, unpublished, parked, unparked, "
               "store_failed, store_recovered); each is also sent to the journal.");
        for (size_t i = 0; i < _METRICS_EVENT_MAX; i++)
                fprintf(f, "vmmbroker_lease_events_total{event=\"%s\"} %" PRIu64 "\n", event_names[i],
                        m.events[i]);
        family(f, "vmmbroker_alloc_waits", "counter", NULL,
               "Alloc calls that waited for memory, by how the wait ended (served; expired: its deadline "
               "passed; refused: another error, such as its user's limits; left: its connection closed or its "
               "process exited; stopped: the broker stopped).");
        for (size_t i = 0; i < _METRICS_WAIT_MAX; i++)
                fprintf(f, "vmmbroker_alloc_waits_total{outcome=\"%s\"} %" PRIu64 "\n", wait_names[i], m.waits[i]);
        family(f, "vmmbroker_calls_waiting", "gauge", NULL,
               "Park, Unpark and Attach calls waiting off the daemon's loop, by reason (host_memory: a park "
               "waiting for pinned host memory being made for it; zeroing: a park waiting for host memory "
               "being zeroed, or an unpark or attach of a parked lease for device memory being zeroed; copy: a "
               "park, unpark or attach waiting for a lease's content being copied between device and host "
               "memory). Alloc calls waiting for room are vmmbroker_device_waiters.");
        fprintf(f, "vmmbroker_calls_waiting{reason=\"host_memory\"} %u\n", b->n_waiting_making);
        fprintf(f, "vmmbroker_calls_waiting{reason=\"zeroing\"} %u\n", b->n_waiting_zeroing);
        fprintf(f, "vmmbroker_calls_waiting{reason=\"copy\"} %u\n", b->n_waiting_copying);
        family(f, "vmmbroker_reclaim_requests", "counter", NULL,
               "Reclaimable leases whose holders were asked to give them back (each asked once at a time).");
        fprintf(f, "vmmbroker_reclaim_requests_total %" PRIu64 "\n", b->leases.reclaim.sent);
        family(f, "vmmbroker_reclaim_answers", "counter", NULL,
               "Reclaim requests by how they ended (given_back: the lease ended before its deadline, freed or "
               "its holders exited; refused: a holder unmarked it; timed_out: still held at its deadline, the "
               "lease is unresponsive).");
        fprintf(f, "vmmbroker_reclaim_answers_total{outcome=\"given_back\"} %" PRIu64 "\n",
                b->leases.reclaim.given_back);
        fprintf(f, "vmmbroker_reclaim_answers_total{outcome=\"refused\"} %" PRIu64 "\n", b->leases.reclaim.refused);
        fprintf(f, "vmmbroker_reclaim_answers_total{outcome=\"timed_out\"} %" PRIu64 "\n",
                b->leases.reclaim.timed_out);
        family(f, "vmmbroker_reclaimable_leases", "gauge", NULL,
               "Leases marked reclaimable, by state (marked: not asked; asked: asked and not answered yet).");
        fprintf(f, "vmmbroker_reclaimable_leases{state=\"marked\"} %u\n", b->leases.reclaim.n_marked);
        fprintf(f, "vmmbroker_reclaimable_leases{state=\"asked\"} %u\n", b->leases.reclaim.n_asked);
        family(f, "vmmbroker_journal_events_dropped", "counter", NULL,
               "Lease events the journal's socket did not take (full or absent).");
        fprintf(f, "vmmbroker_journal_events_dropped_total %" PRIu64 "\n", m.events_dropped);
}

static void format_store(FILE *f, Broker *b) {
        StoreStats s = b->store ? store_stats(b->store) : (StoreStats){};

        family(f, "vmmbroker_store_enabled", "gauge", NULL,
               "1 when the lease table is stored for restarts (the service manager keeps fds), else 0.");
        fprintf(f, "vmmbroker_store_enabled %d\n", b->store != NULL);
        family(f, "vmmbroker_store_healthy", "gauge", NULL,
               "0 while storing fails (changes are refused), else 1.");
        fprintf(f, "vmmbroker_store_healthy %d\n", b->store_error == 0);
        family(f, "vmmbroker_store_generation", "gauge", NULL, "Generation of the stored table (0: none yet).");
        fprintf(f, "vmmbroker_store_generation %" PRIu64 "\n", s.generation);
        family(f, "vmmbroker_store_commits", "counter", NULL, "Changes stored.");
        fprintf(f, "vmmbroker_store_commits_total %" PRIu64 "\n", s.commits);
        family(f, "vmmbroker_store_failures", "counter", NULL, "Commits and snapshots that failed.");
        fprintf(f, "vmmbroker_store_failures_total %" PRIu64 "\n", s.failures);
        family(f, "vmmbroker_store_snapshots", "counter", NULL, "Snapshots of the whole table written.");
        fprintf(f, "vmmbroker_store_snapshots_total %" PRIu64 "\n", s.snapshots);
        family(f, "vmmbroker_store_log_bytes", "gauge", "bytes", "Bytes of the stored table's log.");
        fprintf(f, "vmmbroker_store_log_bytes %" PRIu64 "\n", s.log_bytes);
}

int metrics_format(Broker *b, char **ret) {
        char *text = NULL;
        size_t size = 0;
        FILE *f = open_memstream(&text, &size);
        int k;

        if (!f)
                return -ENOMEM;
        format_broker(f, b);
        k = format_devices(f, b);
        if (k >= 0)
                k = format_users(f, b);
        format_requests(f);
        format_store(f, b);
        fputs("# EOF\n", f);
        if (fclose(f) != 0 || !text || k < 0) {
                free(text);
                return -ENOMEM;
        }
        *ret = text;
        return 0;
}
