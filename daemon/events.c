/* SPDX-License-Identifier: MIT */

#include <errno.h>
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
        const char *path;
        uint64_t now;
        int fd;

        if (journal_fd >= 0)
                return journal_fd;
        now = now_usec();
        if (now < journal_next_try)
                return -EBADF;
        journal_next_try = now + EVENTS_RETRY_USEC;
        path = getenv("VMMBROKER_JOURNAL_SOCKET");
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

/*
 * Whether an event has somewhere to go: the tests' sink, or the journal's socket. One with nowhere to go is
 * counted as dropped here, before any of it is written.
 */
static bool event_wanted(void) {
        if (event_sink || journal_socket() >= 0)
                return true;
        metrics_event_dropped();
        return false;
}

/* An event as journald's native protocol has it: KEY=VALUE lines. */
typedef struct Event {
        size_t len;                     /* below EVENT_MAX while a line is written: EVENT_MAX once full */
        char buf[EVENT_MAX];
} Event;

/*
 * Every Alloc and Free sends one, so they are written piece by piece (a copy, a number in decimal) rather
 * than by a vsnprintf() per line, which cost five times as much. What goes out is the same as the
 * vsnprintf() lines': a line that does not fit is cut where only its newline still does, one that starts
 * with the buffer full is left out, and control characters in what a client chose (its command name) are
 * '?', so that it cannot end a line or start a field of its own. A line's bytes stop one short of
 * EVENT_MAX, so only a newline fills the buffer: once it is full, every line after is left out.
 */
static void line_end(Event *e) {
        if (e->len < EVENT_MAX)
                e->buf[e->len++] = '\n';
}

/* Appends bytes known to hold no control character: the constant parts, the numbers. */
static void put_raw(Event *e, const char *s, size_t n) {
        if (e->len >= EVENT_MAX)
                return;                 /* full: this line is left out */
        n = MIN(n, EVENT_MAX - 1 - e->len);
        memcpy(e->buf + e->len, s, n);
        e->len += n;
}

static void put_str(Event *e, const char *s) {
        put_raw(e, s, strlen(s));
}

/* Appends a value from elsewhere, its control characters as '?'. */
static void put_text(Event *e, const char *s, size_t n) {
        size_t at = e->len;

        put_raw(e, s, n);
        for (size_t i = at; i < e->len; i++)
                if ((unsigned char)e->buf[i] < 0x20 || e->buf[i] == 0x7f)
                        e->buf[i] = '?';
}

static void put_u64(Event *e, uint64_t v) {
        char d[20];
        size_t n = sizeof(d);

        do
                d[--n] = (char)('0' + v % 10);
        while ((v /= 10) > 0);
        put_raw(e, d + n, sizeof(d) - n);
}

static void put_int(Event *e, int v) {
        if (v < 0)
                put_raw(e, "-", 1);
        put_u64(e, v < 0 ? -(uint64_t)v : (uint64_t)v);
}

/* A whole "KEY=VALUE" line of each kind. */
static void field_str(Event *e, const char *key, const char *value) {
        put_str(e, key);
        put_str(e, value);
        line_end(e);
}

static void field_text(Event *e, const char *key, const char *value, size_t n) {
        put_str(e, key);
        put_text(e, value, n);
        line_end(e);
}

static void field_u64(Event *e, const char *key, uint64_t value) {
        put_str(e, key);
        put_u64(e, value);
        line_end(e);
}

static void field_int(Event *e, const char *key, int value) {
        put_str(e, key);
        put_int(e, value);
        line_end(e);
}

static void event_send(const Event *e) {
        if (event_sink) {
                event_sink(e->buf, e->len, event_sink_userdata);
                return;
        }
        if (send(journal_fd, e->buf, e->len, MSG_NOSIGNAL | MSG_DONTWAIT) < 0) {
                metrics_event_dropped();
                /* journald restarted (its socket is a new one) or went away: connect again later */
                if (errno == ECONNREFUSED || errno == ENOTCONN || errno == ENOENT)
                        events_close();
        }
}

/* The fields every lease event has, then sends it. */
static void lease_event(MetricsEvent event, const char *id, int priority, const char *what, const Lease *l,
                        const Holder *h, const char *name) {
        size_t comm_len = h ? strnlen(h->comm, sizeof(h->comm)) : 0;
        Event e;

        metrics_event(event);
        if (!event_wanted())
                return;

        e.len = 0;                      /* not zeroed: 2 KiB, of which only what is written is sent */
        put_str(&e, "MESSAGE=Lease ");
        put_text(&e, l->id, strlen(l->id));
        put_str(&e, " of user ");
        put_u64(&e, l->uid);
        put_str(&e, " (");
        put_u64(&e, l->size);
        put_str(&e, " bytes on device ");
        put_int(&e, l->device);
        put_str(&e, ") ");
        put_str(&e, what);
        if (name) {
                put_str(&e, " \"");
                put_text(&e, name, strlen(name));
                put_str(&e, "\"");
        } else if (h) {
                put_str(&e, ", pid ");
                put_int(&e, (int)h->pid);
                put_str(&e, " (");
                if (comm_len > 0)
                        put_text(&e, h->comm, comm_len);
                else
                        put_str(&e, "?");
                put_str(&e, ")");
        }
        line_end(&e);
        field_str(&e, "MESSAGE_ID=", id);
        field_int(&e, "PRIORITY=", priority);
        field_str(&e, "SYSLOG_IDENTIFIER=", "vmmbrokerd");
        field_str(&e, "VMMBROKER_EVENT=", metrics_event_name(event));
        field_text(&e, "VMMBROKER_LEASE=", l->id, strlen(l->id));
        field_u64(&e, "VMMBROKER_UID=", l->uid);
        field_int(&e, "VMMBROKER_DEVICE=", l->device);
        field_u64(&e, "VMMBROKER_SIZE=", l->size);
        if (h) {
                field_int(&e, "VMMBROKER_PID=", (int)h->pid);
                field_u64(&e, "VMMBROKER_HOLDER_UID=", h->uid);
                if (comm_len > 0)
                        field_text(&e, "VMMBROKER_COMM=", h->comm, comm_len);
        }
        if (l->name || name) {
                const char *n = name ?: l->name;

                field_text(&e, "VMMBROKER_NAME=", n, strlen(n));
        }
        event_send(&e);
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
        MetricsEvent event = now < 0 ? METRICS_EVENT_STORE_FAILED : METRICS_EVENT_STORE_RECOVERED;
        Event e;

        if ((old < 0) == (now < 0))
                return;
        metrics_event(event);
        if (!event_wanted())
                return;
        e.len = 0;
        if (now < 0) {
                const char *error = strerror(-now);

                put_str(&e, "MESSAGE=Storing the lease table for restarts failed (");
                put_text(&e, error, strlen(error));
                put_str(&e, "): changes are refused until it works again");
        } else
                put_str(&e, "MESSAGE=Storing the lease table for restarts works again");
        line_end(&e);
        field_str(&e, "MESSAGE_ID=", now < 0 ? ID_STORE_FAILED : ID_STORE_RECOVERED);
        field_int(&e, "PRIORITY=", now < 0 ? LOG_ERR : LOG_NOTICE);
        field_str(&e, "SYSLOG_IDENTIFIER=", "vmmbrokerd");
        field_str(&e, "VMMBROKER_EVENT=", metrics_event_name(event));
        if (now < 0)
                field_int(&e, "ERRNO=", -now);
        event_send(&e);
}
