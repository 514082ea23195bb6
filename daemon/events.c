/* SPDX-License-Identifier: MIT */

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <syslog.h>
#include <time.h>
#include <unistd.h>

#include "events.h"
#include "macro.h"
#include "metrics.h"

#define JOURNAL_SOCKET "/run/systemd/journal/socket"
#define EVENT_MAX 2048                  /* one event's fields: far more than the longest */

/* One MESSAGE_ID per kind of event (docs/metrics.md lists them). */
#define ID_MADE "0de65dd031a748d68ab8a21db492ba9f"
#define ID_ENDED "163bdaa5f4824357bfaa8bf86091f5ca"
#define ID_RECLAIMED "78b5f91a42834b13b446f4edea203aab"
#define ID_PUBLISHED "fa60aa4219404f26a82ce2656986598b"
#define ID_UNPUBLISHED "6ee89dabd401499fbbf356c94e9d5918"
#define ID_PARKED "f88eabfed2c34498adfeec4308aea91e"
#define ID_UNPARKED "e05bc0f7918648ec80ef19f07ef95881"
#define ID_STORE_FAILED "431089d712b7428b9a9622a4d718f33b"
#define ID_STORE_RECOVERED "3a2f480e28484bd195c0f2e792bbf4e0"

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

static int journal_fd = -EBADF;
static uint64_t journal_next_try;       /* CLOCK_MONOTONIC usec: when to look for the socket again */
static void (*event_sink)(const char *buf, size_t len, void *userdata);
static void *event_sink_userdata;

static uint64_t now_usec(void) {
        struct timespec ts;

        (void)clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000 + (uint64_t)ts.tv_nsec / 1000;
}

void events_set_sink(void (*sink)(const char *buf, size_t len, void *userdata), void *userdata) {
        event_sink = sink;
        event_sink_userdata = userdata;
}

void events_close(void) {
        journal_fd = safe_close(journal_fd);
        journal_next_try = 0;
}

/* A non-blocking datagram socket connected to the journal, or -EBADF (tried again later). */
static int journal_socket(void) {
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        const char *path = getenv("VMMBROKER_JOURNAL_SOCKET");
        uint64_t now;
        int fd;

        if (journal_fd >= 0)
                return journal_fd;
        now = now_usec();
        if (now < journal_next_try)
                return -EBADF;
        journal_next_try = now + EVENTS_RETRY_USEC;
        if (!path || !*path)
                path = JOURNAL_SOCKET;
        if (strlen(path) >= sizeof(sa.sun_path))
                return -EBADF;
        strcpy(sa.sun_path, path);
        fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0)
                return -EBADF;
        if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
                close(fd);
                return -EBADF;
        }
        journal_fd = fd;
        return fd;
}

static void journal_send(const char *buf, size_t len) {
        int fd = journal_socket();

        if (fd < 0) {
                metrics_event_dropped();
                return;
        }
        if (send(fd, buf, len, MSG_NOSIGNAL | MSG_DONTWAIT) < 0) {
                metrics_event_dropped();
                /* journald restarted (its socket is a new one) or went away: connect again later */
                if (errno == ECONNREFUSED || errno == ENOTCONN || errno == ENOENT)
                        events_close();
        }
}

/* Appends "KEY=VALUE\n" with the value's control characters as '?' (the native protocol's lines). */
_printf_(3, 4) static void field(char *buf, size_t *len, const char *fmt, ...) {
        va_list ap;
        int n;

        if (*len >= EVENT_MAX)
                return;
        va_start(ap, fmt);
        n = vsnprintf(buf + *len, EVENT_MAX - *len, fmt, ap);
        va_end(ap);
        if (n < 0)
                return;
        if ((size_t)n >= EVENT_MAX - *len)
                n = (int)(EVENT_MAX - *len - 1);
        for (int i = 0; i < n; i++)
                if ((unsigned char)buf[*len + i] < 0x20 || buf[*len + i] == 0x7f)
                        buf[*len + i] = '?';
        *len += (size_t)n;
        buf[(*len)++] = '\n';
}

/* The fields every lease event has, then sends it. */
static void lease_event(MetricsEvent event, const char *id, int priority, const char *what, const Lease *l,
                        const Holder *h, const char *name) {
        char buf[EVENT_MAX + 1];
        size_t len = 0;

        metrics_event(event);
        if (name)
                field(buf, &len, "MESSAGE=Lease %s of user %u (%" PRIu64 " bytes on device %d) %s \"%s\"", l->id,
                      (unsigned)l->uid, l->size, l->device, what, name);
        else if (h)
                field(buf, &len, "MESSAGE=Lease %s of user %u (%" PRIu64 " bytes on device %d) %s, pid %d (%s)",
                      l->id, (unsigned)l->uid, l->size, l->device, what, (int)h->pid, h->comm[0] ? h->comm : "?");
        else
                field(buf, &len, "MESSAGE=Lease %s of user %u (%" PRIu64 " bytes on device %d) %s", l->id,
                      (unsigned)l->uid, l->size, l->device, what);
        field(buf, &len, "MESSAGE_ID=%s", id);
        field(buf, &len, "PRIORITY=%d", priority);
        field(buf, &len, "SYSLOG_IDENTIFIER=vmmbrokerd");
        field(buf, &len, "VMMBROKER_EVENT=%s", event_names[event]);
        field(buf, &len, "VMMBROKER_LEASE=%s", l->id);
        field(buf, &len, "VMMBROKER_UID=%u", (unsigned)l->uid);
        field(buf, &len, "VMMBROKER_DEVICE=%d", l->device);
        field(buf, &len, "VMMBROKER_SIZE=%" PRIu64, l->size);
        if (h) {
                field(buf, &len, "VMMBROKER_PID=%d", (int)h->pid);
                field(buf, &len, "VMMBROKER_HOLDER_UID=%u", (unsigned)h->uid);
                if (h->comm[0])
                        field(buf, &len, "VMMBROKER_COMM=%s", h->comm);
        }
        if (l->name || name)
                field(buf, &len, "VMMBROKER_NAME=%s", name ?: l->name);
        if (event_sink)
                event_sink(buf, len, event_sink_userdata);
        else
                journal_send(buf, len);
}

void event_lease_made(const Lease *l, const Holder *h) {
        lease_event(METRICS_EVENT_MADE, ID_MADE, LOG_INFO, "made", l, h, NULL);
}

static void lease_ended(const Lease *l, const Holder *h, const char *how) {
        lease_event(METRICS_EVENT_ENDED, ID_ENDED, LOG_INFO, how, l, h, NULL);
}

void event_hold_freed(const Hold *hold) {
        if (hold->refs == 1 && hold_is_last(hold))
                lease_ended(hold->lease, hold->holder, "ended: freed by its last holder");
}

void event_hold_reclaimed(const Hold *hold) {
        lease_event(METRICS_EVENT_RECLAIMED, ID_RECLAIMED, LOG_INFO, "reclaimed: its holder exited", hold->lease,
                    hold->holder, NULL);
        if (hold_is_last(hold))
                lease_ended(hold->lease, hold->holder, "ended: its last holder exited");
}

void event_lease_published(const Lease *l, const Holder *h) {
        lease_event(METRICS_EVENT_PUBLISHED, ID_PUBLISHED, LOG_INFO, "published as", l, h, l->name ?: "?");
}

void event_lease_parked(const Lease *l, const Holder *h, bool parked) {
        if (parked)
                lease_event(METRICS_EVENT_PARKED, ID_PARKED, LOG_INFO, "parked in host memory by", l, h, NULL);
        else
                lease_event(METRICS_EVENT_UNPARKED, ID_UNPARKED, LOG_INFO, "back in device memory for", l, h, NULL);
}

void event_lease_unpublished(const Lease *l, const Holder *h) {
        lease_event(METRICS_EVENT_UNPUBLISHED, ID_UNPUBLISHED, LOG_INFO, "unpublished from", l, h, l->name ?: "?");
        if (l->n_holds == 0)
                lease_ended(l, h, "ended: unpublished and held by nobody");
}

void event_store_health(int old, int now) {
        char buf[EVENT_MAX + 1];
        size_t len = 0;

        if ((old < 0) == (now < 0))
                return;
        metrics_event(now < 0 ? METRICS_EVENT_STORE_FAILED : METRICS_EVENT_STORE_RECOVERED);
        if (now < 0)
                field(buf, &len, "MESSAGE=Storing the lease table for restarts failed (%s): changes are refused "
                      "until it works again", strerror(-now));
        else
                field(buf, &len, "MESSAGE=Storing the lease table for restarts works again");
        field(buf, &len, "MESSAGE_ID=%s", now < 0 ? ID_STORE_FAILED : ID_STORE_RECOVERED);
        field(buf, &len, "PRIORITY=%d", now < 0 ? LOG_ERR : LOG_NOTICE);
        field(buf, &len, "SYSLOG_IDENTIFIER=vmmbrokerd");
        field(buf, &len, "VMMBROKER_EVENT=%s",
              event_names[now < 0 ? METRICS_EVENT_STORE_FAILED : METRICS_EVENT_STORE_RECOVERED]);
        if (now < 0)
                field(buf, &len, "ERRNO=%d", -now);
        if (event_sink)
                event_sink(buf, len, event_sink_userdata);
        else
                journal_send(buf, len);
}
