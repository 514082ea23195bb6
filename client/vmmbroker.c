/* SPDX-License-Identifier: MIT */

/*
 * libvmmbroker: the client side of io.vmmbroker. One blocking varlink
 * connection per client, one call at a time on it (client->call_lock), and
 * the import/map steps of proto/driver.c. No logging: every failure is a
 * negative errno plus a sentence in the calling thread's error buffer, which
 * is written on failure only (a successful call leaves it as it was).
 *
 * A lost connection (the broker stopped, crashed or restarted) is closed, and
 * the call that found it lost, or the next one, connects again to the same
 * path, waiting up to the client's reconnect timeout for a broker to listen
 * there. Whether the call that was under way is sent again depends on what the
 * broker can have done with it: see client_call(). Leases stay mapped through
 * all of this: their memory is held by this process's own imported handles.
 */

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <semaphore.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "codec.h"
#include "driver.h"
#include "internal.h"
#include "json.h"
#include "list.h"
#include "macro.h"
#include "varlink.h"
#include "vmmbroker.h"

#define VMMB_EXPORT __attribute__((visibility("default")))

#define ERROR_MESSAGE_MAX 1024

/* How long a lost connection waits for a broker to come back, unless $VMMBROKER_RECONNECT_TIMEOUT says. */
#define RECONNECT_TIMEOUT_DEFAULT_USEC (UINT64_C(30) * 1000000)
#define RECONNECT_TIMEOUT_ENV "VMMBROKER_RECONNECT_TIMEOUT"
#define REPLY_SPIN_ENV "VMMBROKER_REPLY_SPIN_USEC"
#define REPLY_SPIN_DEFAULT_USEC 100
#define REPLY_SPIN_MAX_USEC 100000
#define REPLY_SPIN_MIN_CPUS 4
/* The pause between two refused connects: doubling from the first to the most. */
#define RECONNECT_BACKOFF_FIRST_USEC UINT64_C(10000)
#define RECONNECT_BACKOFF_MAX_USEC UINT64_C(250000)

struct vmmb_client {
        pthread_mutex_t call_lock;      /* one call at a time on conn; guards conn */
        VarlinkConn *conn;              /* NULL once lost (or out of step): the next call connects again */
        char *path;                     /* the broker's socket, to connect to again */
        uint64_t reconnect_usec;        /* how long connecting again waits for a broker to listen (a watch's
                                           connection for answers: 0 while it marks again, watch_remark()) */
        uint64_t spin_usec;             /* how long a call polls for its reply before it sleeps (reply_spin()) */
        bool closing;                   /* in vmmb_close(): connecting again does not wait */
        int parks;                      /* whether the broker serves Park and Unpark: 1, 0, or -1 not asked yet
                                           (since the last connect); atomic */
        /* under call_lock: which connection is which, for what its broker said of keeping (vmmb_free_keep()) */
        uint64_t generation;            /* conn's number: 1 for the first, one more for each connect again */
        uint64_t keeps;                 /* the connection whose broker said it keeps leases (Free's `kept`), or 0 */
        uint64_t keeps_not;             /* the connection whose broker knows no keeping, or 0 */

        pthread_mutex_t leases_lock;    /* guards leases, and their reclaim state */
        List leases;                    /* vmmb_lease.link */
        pthread_cond_t reclaim_done;    /* with leases_lock: a lease's callback returned, or its reads ended */

        /* Reclaim requests (vmmb_lease_set_reclaimable(), vmmb_free_keep()): the process's watch of the broker
         * at `path`, which the process's clients of that broker share; under process.lock */
        struct Watch *watch;            /* NULL until the client first needs it */
        List watch_link;                /* in watch->clients */
};

struct vmmb_lease {
        vmmb_client *client;
        List link;                      /* in client->leases; once kept, in process.kept */
        char *id;
        int device;
        CUdeviceptr va;
        uint64_t size;                  /* the sum of sizes[] */
        uint64_t *sizes;                /* each slab's size, in mapping order */
        size_t n_slabs;
        bool readonly;                  /* mapped with read access only */
        uid_t owner;                    /* the owner's uid, (uid_t)-1 when the broker did not say */
        char *owner_name;               /* the owner's user name, NULL when the broker did not say */
        int *peers;                     /* devices other than `device` given access here (vmmb_lease_grant_access()),
                                           each once; under client->leases_lock */
        size_t n_peers;
        /* reclaiming, under client->leases_lock */
        bool reclaimable;               /* marked with the broker: the watch thread answers its requests */
        int priority;
        vmmb_reclaim_fn reclaim_cb;
        void *reclaim_userdata;
        bool reclaiming;                /* its callback or giving it back runs now (on the watch thread) */
        bool reclaimed;                 /* given back: unmapped and freed; only the object is left */
        unsigned readers;               /* vmmb_lease_read() copies from its mapping now: nothing unmaps it */
        bool parked;                    /* unmapped here with its address range kept (vmmb_lease_park()), until
                                           vmmb_lease_unpark() maps it again at va; under client->leases_lock */
        /* what the broker's keeping depends on (vmmb_free_keep()); under client->leases_lock */
        bool from_alloc;                /* Alloc made it (not Attach) */
        bool shared;                    /* vmmb_share() was called for it: a token may exist */
        bool published;                 /* vmmb_publish() was called for it */
        bool was_parked;                /* vmmb_lease_park() was called for it: set with `parked`, never reset */
        /* kept (vmmb_free_keep()), under process.lock */
        uint64_t kept_serial;           /* which keeping of the process this is */
        uint64_t kept_seq;              /* the next Alloc ticket when its keep-Free was written; 0 until then */
        uint64_t kept_generation;       /* the connection of `client` that its keep-Free went on */
};

/* --- errors ------------------------------------------------------------------------------------------- */

static __thread char error_message[ERROR_MESSAGE_MAX];

/* Sets the calling thread's message and returns `error`, a negative errno. */
_printf_(2, 3) static int set_error(int error, const char *fmt, ...) {
        va_list ap;

        va_start(ap, fmt);
        (void)vsnprintf(error_message, sizeof(error_message), fmt, ap);
        va_end(ap);
        return error;
}

/* set_error() for the library's other files (internal.h). */
int client_set_error(int error, const char *fmt, ...) {
        va_list ap;

        va_start(ap, fmt);
        (void)vsnprintf(error_message, sizeof(error_message), fmt, ap);
        va_end(ap);
        return error;
}

/* Like set_error(), with the sentence of a lower layer (may be NULL: then strerror()). */
static int set_error_from(int error, const char *what, const char *message) {
        if (message && *message)
                return set_error(error, "%s: %s", what, message);
        return set_error(error, "%s: %s.", what, strerror(-error));
}

/* --- the driver, once per process ---------------------------------------------------------------------- */

static pthread_once_t driver_once = PTHREAD_ONCE_INIT;
static CudaDriver *driver;              /* kept for the life of the process */
static int driver_error;
static char *driver_message;

static void driver_load(void) {
        driver_error = cuda_driver_open(&driver, NULL, &driver_message);
}

static int driver_get(CudaDriver **ret) {
        (void)pthread_once(&driver_once, driver_load);
        if (driver_error < 0)
                return set_error_from(-ENODEV, "Cannot use the CUDA driver", driver_message);
        *ret = driver;
        return 0;
}

int client_driver(CudaDriver **ret) {
        return driver_get(ret);
}

/* --- calls ---------------------------------------------------------------------------------------------- */

static void close_fds(int *fds, size_t n) {
        for (size_t i = 0; i < n; i++)
                safe_close(fds[i]);
}

/* The fds received with a reply: closed and freed by the cleanup. */
typedef struct ReceivedFds {
        int *fds;
        size_t n;
} ReceivedFds;

static void received_fds_done(ReceivedFds *r) {
        close_fds(r->fds, r->n);
        free(r->fds);
        *r = (ReceivedFds){};
}

static void json_putp(json_object **o) {
        json_object_put(*o);
}

/* --- the connection ------------------------------------------------------------------------------------ */

static uint64_t now_usec(void) {
        struct timespec ts;

        (void)clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000 + (uint64_t)ts.tv_nsec / 1000;
}

/* Waits until CLOCK_MONOTONIC reads `usec`. */
static void sleep_until(uint64_t usec) {
        struct timespec ts = { .tv_sec = (time_t)(usec / 1000000), .tv_nsec = (long)(usec % 1000000) * 1000 };

        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
                ;
}

/* "30 s", "0.25 s": microseconds for a message, without the locale's decimal point. */
static const char *format_seconds(uint64_t usec, char buf[static 32]) {
        if (usec % 1000000 == 0)
                (void)snprintf(buf, 32, "%" PRIu64 " s", usec / 1000000);
        else
                (void)snprintf(buf, 32, "%" PRIu64 ".%03" PRIu64 " s", usec / 1000000, usec % 1000000 / 1000);
        return buf;
}

/*
 * Reads the decimal digits at `s` into *ret: returns the first byte after them, or NULL when there are none or
 * they make more than `max`. The environment variables' numbers are read with it.
 */
static const char *digits_read(const char *s, uint64_t max, uint64_t *ret) {
        const char *p;
        uint64_t v = 0;

        for (p = s; *p >= '0' && *p <= '9'; p++) {
                v = v * 10 + (uint64_t)(*p - '0');
                if (v > max)
                        return NULL;
        }
        if (p == s)
                return NULL;
        *ret = v;
        return p;
}

/*
 * $VMMBROKER_RECONNECT_TIMEOUT in microseconds: seconds as digits, with a
 * fraction after a point ("30", "0.5", "0"; digits past the sixth after the
 * point count for nothing); unset or empty is the default. -EINVAL for
 * anything else, with the message set.
 */
static int reconnect_timeout(uint64_t *ret) {
        const char *e = getenv(RECONNECT_TIMEOUT_ENV), *p;
        uint64_t seconds = 0, fraction = 0, scale = 100000;

        if (!e || !*e) {
                *ret = RECONNECT_TIMEOUT_DEFAULT_USEC;
                return 0;
        }
        p = digits_read(e, UINT64_C(1000000000), &seconds);
        if (!p)
                goto invalid;
        if (*p == '.') {
                if (!(p[1] >= '0' && p[1] <= '9'))
                        goto invalid;
                for (p++; *p >= '0' && *p <= '9'; p++) {
                        fraction += (uint64_t)(*p - '0') * scale;
                        scale /= 10;
                }
        }
        if (*p)
                goto invalid;
        *ret = seconds * 1000000 + fraction;
        return 0;
invalid:
        return set_error(-EINVAL, "$%s is '%.32s%s', not a number of seconds such as 30 or 0.5.",
                         RECONNECT_TIMEOUT_ENV, e, strlen(e) > 32 ? "..." : "");
}

/*
 * $VMMBROKER_REPLY_SPIN_USEC: how long a call polls its connection for the reply before it sleeps in the
 * kernel, in microseconds, at most REPLY_SPIN_MAX_USEC; "0" never polls. Unset or empty: REPLY_SPIN_DEFAULT_USEC
 * where the process may run on REPLY_SPIN_MIN_CPUS or more CPUs, else 0, as the CUDA driver spins on work only
 * while a CPU is free for it. A reply usually comes within tens of microseconds, and waking a sleeping
 * thread for it costs as much again on a virtual machine. -EINVAL for anything else, with the message set.
 */
static int reply_spin(uint64_t *ret) {
        const char *e = getenv(REPLY_SPIN_ENV), *p;
        uint64_t usec = 0;

        if (!e || !*e) {
                cpu_set_t set;
                long cpus;

                /* the CPUs this process may run on (a container's cpuset), else those online */
                cpus = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : sysconf(_SC_NPROCESSORS_ONLN);
                *ret = cpus >= REPLY_SPIN_MIN_CPUS ? REPLY_SPIN_DEFAULT_USEC : 0;
                return 0;
        }
        p = digits_read(e, REPLY_SPIN_MAX_USEC, &usec);
        if (!p || *p)
                return set_error(-EINVAL, "$%s is '%.32s%s', not a number of microseconds from 0 to %d such as "
                                 "100.", REPLY_SPIN_ENV, e, strlen(e) > 32 ? "..." : "", REPLY_SPIN_MAX_USEC);
        *ret = usec;
        return 0;
}

/* A new blocking socket connected to `path` in *ret_fd, or the negative errno of socket() or connect(). */
static int socket_connect(const char *path, int *ret_fd) {
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        _cleanup_close_ int fd = -EBADF;

        memcpy(sa.sun_path, path, strlen(path) + 1);    /* checked by vmmb_connect() */
        fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0)
                return -errno;
        if (connect(fd, (const struct sockaddr *)&sa, sizeof(sa)) < 0)
                return -errno;
        *ret_fd = TAKE_FD(fd);
        return 0;
}

/* Whether connecting failed only because no broker listens at the path now: worth trying again. */
static bool connect_error_is_transient(int error) {
        return error == -ENOENT || error == -ECONNREFUSED || error == -EAGAIN || error == -EINTR;
}

/* Whether an error of the connection means the broker closed it (stopped, crashed, restarted). */
static bool conn_error_is_lost(int error) {
        return error == -ECONNRESET || error == -EPIPE || error == -ENOTCONN || error == -ESHUTDOWN;
}

/* Closes the client's connection: the next call connects again. Lock held. */
static void client_disconnect(vmmb_client *c) {
        c->conn = varlink_conn_free(c->conn);
        __atomic_store_n(&c->parks, -1, __ATOMIC_RELAXED);     /* the next broker may be another version */
}

/*
 * Connects the client again, to the path it was made with, after its
 * connection was lost: while nobody listens there (a broker stopped or
 * restarting, and no service manager holding the socket for it), it tries
 * again with a growing pause until the reconnect timeout has passed since the
 * first try (not at all in vmmb_close()). A socket that a service manager
 * holds for the broker takes the connection at once, and the broker answers
 * it once it is back. Lock held, no connection. Returns 0 or, with the
 * message set, -ECONNREFUSED when nobody listened in time (whether the socket
 * refused or was missing: the message says which), or another error of
 * socket() or connect() (-EACCES...).
 */
static int client_reconnect(vmmb_client *c) {
        uint64_t deadline = now_usec() + (c->closing ? 0 : c->reconnect_usec);
        uint64_t pause = RECONNECT_BACKOFF_FIRST_USEC;
        char seconds[32];
        int fd = -EBADF, k;

        for (;;) {
                uint64_t now;

                k = socket_connect(c->path, &fd);
                if (k >= 0)
                        break;
                if (!connect_error_is_transient(k))
                        return set_error(k, "Lost the connection to the broker, and cannot connect to it again at "
                                         "%s: %s.", c->path, strerror(-k));
                now = now_usec();
                if (now >= deadline)
                        /* -ECONNREFUSED for a missing socket too: -ENOENT is an answer of the broker's */
                        return set_error(-ECONNREFUSED, "Lost the connection to the broker, and no broker "
                                         "listened at %s within %s: %s. It may be stopped; the next call "
                                         "tries again.",
                                         c->path, format_seconds(c->closing ? 0 : c->reconnect_usec, seconds),
                                         strerror(-k));
                sleep_until(MIN(now + pause, deadline));
                pause = MIN(pause * 2, RECONNECT_BACKOFF_MAX_USEC);
        }
        k = varlink_conn_new(&c->conn, fd, VARLINK_MAX_REPLY, true);
        if (k < 0) {
                safe_close(fd);
                return set_error(k, "Cannot set up the connection to the broker: %s.", strerror(-k));
        }
        c->generation++;                /* another connection, maybe to another broker */
        return 0;
}

/* How a call's connection was lost, as far as the broker's part in it can be known. */
typedef enum CallLoss {
        CALL_NOT_LOST,                  /* not lost: the stream is out of step, or this process ran out of memory */
        CALL_UNREAD,                    /* the broker closed it before reading all of the call: not carried out */
        CALL_MAYBE_DONE,                /* closed after the broker read the call: it may have carried it out */
} CallLoss;

/*
 * Driver work a call does while its reply is on the way, so that the round trip hides it: client_call_full()
 * runs it once, as soon as the call is first sent whole (not again when the call is sent again after a lost
 * connection; not at all when it was never sent). An Alloc reserves the address range its lease will most
 * likely need (AllocAhead); a Free unmaps the lease it frees (FreeUnmap).
 */
typedef struct CallOverlap {
        void (*run)(struct CallOverlap *o);
        bool ran;
} CallOverlap;

/* Runs `o` unless it ran (or is NULL). */
static void call_overlap_run(CallOverlap *o) {
        if (!o || o->ran)
                return;
        o->ran = true;
        o->run(o);
}

/*
 * The device address range an Alloc's lease will most likely need, reserved while the reply is on the way
 * (a CallOverlap) and mapped into by lease_map_reply() when the lease fits it: a lease of `size`
 * bytes whose first slab's alignment divides `va`. Its size is the request rounded up to LIKELY_GRANULARITY,
 * aligned for the largest slab such a lease can have. A lease that does not fit (another granularity, a kept
 * lease handed back) is mapped as always and the range freed (alloc_ahead_done()): a miss costs one
 * reservation and its free, never a wrong mapping.
 */
typedef struct AllocAhead {
        CallOverlap overlap;    /* alloc_ahead_reserve(), once per Alloc */
        uint64_t size;          /* 0: nothing to reserve */
        CUdeviceptr va;         /* 0: not reserved, or taken by the lease */
} AllocAhead;

#define LIKELY_GRANULARITY (UINT64_C(2) << 20)  /* every CUDA device's VMM granularity so far: 2 MiB */

/* Reserves ahead->size bytes; a failure leaves nothing reserved (the lease reserves its own range). */
static void alloc_ahead_reserve(CallOverlap *o) {
        AllocAhead *ahead = container_of(o, AllocAhead, overlap);
        CudaDriver *cu = NULL;

        if (ahead->size == 0)
                return;
        if (driver_get(&cu) < 0 ||
            cu->cuMemAddressReserve(&ahead->va, ahead->size, cuda_slab_alignment(ahead->size), 0, 0) != CUDA_SUCCESS)
                ahead->va = 0;
}

/* Frees the range unless the lease took it. */
static void alloc_ahead_done(AllocAhead *ahead) {
        CudaDriver *cu = NULL;

        if (ahead->va != 0 && driver_get(&cu) >= 0)
                (void)cu->cuMemAddressFree(ahead->va, ahead->size);
        ahead->va = 0;
}

/*
 * A reply that carries a lease (Alloc's and Attach's: an AllocReply), its parameters read in the same pass
 * as its envelope (alloc_reply_parse_text()): client_call_full() fills it, and the caller frees `lease`
 * with alloc_reply_done() when `decoded`.
 */
typedef struct ReplyInto {
        AllocReply lease;
        bool decoded;           /* `lease` holds the parameters; the reply, none */
} ReplyInto;

/* Frees what `into` holds, if anything. Accepts NULL. */
static void reply_into_done(ReplyInto *into) {
        if (into && into->decoded) {
                alloc_reply_done(&into->lease);
                into->decoded = false;
        }
}

/*
 * A reply's message text[0..len) read as text (varlink_reply_parse_text(): no json-c objects for a reply that
 * decodes from its text; with `into`, its parameters read in the same pass where they can be) into *ret: 0, or
 * a negative errno: -EBADMSG for a message that is not strict JSON (*ret_not_json set) or not a reply.
 */
static int reply_from_text(const char *text, size_t len, VarlinkReply *ret, bool *ret_not_json, ReplyInto *into) {
        _cleanup_(json_putp) json_object *o = NULL;
        int k;

        k = into ? alloc_reply_parse_text(text, len, ret, &into->lease, &into->decoded)
                 : varlink_reply_parse_text(text, len, ret);
        if (k == -EBADMSG)
                /* rarely: which of the two it was, for the message (reading the text, or the reply in it) */
                *ret_not_json = json_parse_message(text, len, &o) < 0;
        return MIN(k, 0);
}

/*
 * Waits for the reply to the call just sent and returns it as
 * varlink_conn_receive() does, read by reply_from_text() with its fds in
 * *fds, or a negative errno and *ret_loss saying what a lost connection means
 * for the call (*ret_not_json: as reply_from_text() says).
 *
 * Before reading, it peeks at the reply's first byte, to tell two ways the
 * broker can close the connection apart: Linux resets a stream socket's peer
 * (ECONNRESET) when the socket is closed with data left unread in it, and
 * reports a plain end of stream otherwise. One call at a time goes on the
 * connection and the broker acts on a call only once it has read the NUL that
 * ends it, the last byte sent: a reset before any byte of the reply means the
 * call was not read whole, so not carried out; an end of stream means the
 * broker read it and may have carried it out; a reply begun means it did.
 */
static int conn_receive(VarlinkConn *conn, uint64_t spin_usec, VarlinkReply *ret, ReceivedFds *fds,
                        CallLoss *ret_loss, bool *ret_not_json, ReplyInto *into) {
        const char *text;
        bool buffered;
        size_t len;
        ssize_t n;
        char byte;
        int k;

        *ret_loss = CALL_NOT_LOST;
        *ret_not_json = false;
        /* A message already buffered is read first, with nothing to peek at (the broker sends one reply per
         * call: never so far); so is what is buffered when it is already an error. */
        buffered = varlink_conn_has_message(conn);
        if (!buffered) {
                /* polled for up to spin_usec (reply_spin()), then waited for in the kernel */
                uint64_t until = spin_usec > 0 ? now_usec() + spin_usec : 0;

                for (;;) {
                        n = recv(varlink_conn_get_fd(conn), &byte, 1, MSG_PEEK | (until ? MSG_DONTWAIT : 0));
                        if (n < 0 && errno == EINTR)
                                continue;
                        if (n < 0 && errno == EAGAIN && until) {
                                if (now_usec() >= until)
                                        until = 0;
                                continue;
                        }
                        break;
                }
                if (n == 0) {
                        *ret_loss = CALL_MAYBE_DONE;
                        return -ECONNRESET;
                }
                if (n < 0) {
                        k = -errno;
                        if (k == -ECONNRESET)
                                *ret_loss = CALL_UNREAD;
                        else if (conn_error_is_lost(k))
                                *ret_loss = CALL_MAYBE_DONE;
                        return k;
                }
        }

        k = varlink_conn_receive_text(conn, &text, &len, &fds->fds, &fds->n);
        if (k >= 0)
                k = reply_from_text(text, len, ret, ret_not_json, into);
        if (k < 0 && !buffered && conn_error_is_lost(k))
                *ret_loss = CALL_MAYBE_DONE;            /* the reply had begun */
        return MIN(k, 0);
}

/*
 * Whether a call may be sent again when the broker may have carried it out
 * before the connection was lost: when one call and two leave the broker the
 * same and are answered the same. Of the calls this library makes, Publish
 * is: the same lease published again under the same name, with the same
 * users and flags, changes nothing and succeeds again; and Tokens, which
 * changes nothing at all. (The other read-only calls, List, Status and Users,
 * would be too; the library makes none.)
 * Alloc, Attach and Share make something new each time: a lease or a hold
 * this process would not know of, or a token. Free drops one reference on
 * this process's hold, and a process may hold a lease more than once (an
 * Attach of a lease it holds already): a second Free could end the hold that
 * another lease object still maps. Revoke and Unpublish would be answered
 * NoSuchToken and NoSuchName the second time, and Unpublish could remove the
 * name from another lease that took it in between.
 */
static bool method_is_repeatable(const char *method) {
        return strcmp(method, VMMB_METHOD_PUBLISH) == 0 || strcmp(method, VMMB_METHOD_TOKENS) == 0;
}

/* "Alloc" for "io.vmmbroker.Alloc". */
static const char *method_short(const char *method) {
        const char *dot = strrchr(method, '.');

        return dot ? dot + 1 : method;
}

/* Closes a connection that is out of step and turns the error into what the caller returns. Lock held. */
static int client_out_of_step(vmmb_client *c, int error, const char *what) {
        client_disconnect(c);
        if (error == -ENOMEM)
                return set_error(-ENOMEM, "Out of memory while %s.", what);
        return set_error(-EPROTO, "The broker broke the protocol while %s: %s.", what, strerror(-error));
}

/* The sentence for an error reply: the broker's own message, else one made from the error's parameters. */
static int reply_error(const VarlinkReply *reply, const char *method) {
        _cleanup_free_ char *message = NULL;
        int error = vmmb_error_to_errno(reply->error);

        vmmb_error_describe(reply->error, reply->parameters, method, &message);
        return set_error(error, "%s", message ?: "The broker refused the call.");
}

/*
 * One call for client_call_full(): what is sent, and how its reply is read.
 */
typedef struct Call {
        const char *method;             /* for messages and for method_is_repeatable() */
        const VarlinkText *text;        /* the call written whole: NAME_params_write() or call_write() */
        bool error_replies;             /* an error reply is returned in *ret (reply.error set, the message not)
                                         * for the caller to read its parameters, rather than made the error */
        ReplyInto *into;                /* a call answered with a lease: its parameters read here (NULL: none) */
        CallOverlap *overlap;           /* work done while the reply is on the way (NULL: none) */
} Call;

/*
 * Sends `call` and waits for its reply. Returns 0 with a successful reply in
 * *ret (and, when ret_fds is given, the fds that came with it; when
 * ret_generation is given, the number of the connection that carried it); or a
 * negative errno with the thread's message set: the errno of the broker's
 * named error, -EPROTO for a reply that makes no sense, or one of a lost
 * connection. With call->error_replies, an error reply is returned in *ret as
 * well.
 *
 * The reply is read as text: a successful reply's parameters are in
 * reply.parameters_text (decode them with NAME_decode_text()), unless the
 * reader left them to json-c (reply.parameters); an error reply's are always
 * in reply.parameters. client_call() makes them reply.parameters in any case.
 * With call->into, a successful reply's parameters are read into
 * into->lease in the same pass where they can be (into->decoded; the reply
 * then has none); on failure it holds nothing. With call->overlap, it runs
 * that work once the call is first sent whole, before it waits for the reply.
 *
 * A lost connection (the broker stopped, crashed or restarted) is closed and
 * connected again (client_reconnect(), which may wait for the broker), and the
 * call is sent once more when that is safe: when the broker cannot have
 * carried it out (the connection was lost before the call was sent, or the
 * broker closed it with the call unread: conn_receive()), or when the call is
 * one that may be repeated (method_is_repeatable()). Otherwise, or when the
 * call is lost a second time, it returns -ECONNRESET with a message saying
 * whether the call was carried out is unknown (or that it was not), and the
 * next call connects again. When connecting again fails it returns that error
 * (-ECONNREFUSED: no broker came back in time). A connection that
 * is out of step (a reply that is not one) is closed as well.
 */
static int client_call_full(vmmb_client *c, const Call *call, VarlinkReply *ret, ReceivedFds *ret_fds,
                            uint64_t *ret_generation) {
        const char *method = call->method;
        ReplyInto *into = call->into;
        _cleanup_(received_fds_done) ReceivedFds fds = {};
        VarlinkReply reply = {};
        bool repeated = false, maybe_done = false, not_json = false;
        uint64_t generation = 0;
        int k;

        (void)pthread_mutex_lock(&c->call_lock);
        for (;;) {
                CallLoss loss;

                if (!c->conn) {
                        k = client_reconnect(c);
                        if (k < 0)
                                goto unlock;
                }
                k = varlink_conn_send_text(c->conn, call->text, NULL, 0);
                if (k < 0) {
                        k = set_error(k, "Cannot queue the call %s: %s.", method, strerror(-k));
                        goto unlock;
                }
                k = varlink_conn_flush(c->conn);
                if (k < 0) {
                        if (!conn_error_is_lost(k)) {
                                k = client_out_of_step(c, k, "sending the call");
                                goto unlock;
                        }
                        loss = CALL_UNREAD;     /* the broker has no whole call to act on */
                } else {
                        call_overlap_run(call->overlap);
                        k = conn_receive(c->conn, c->spin_usec, &reply, &fds, &loss, &not_json, into);
                        if (k >= 0) {
                                generation = c->generation;
                                break;
                        }
                        if (loss == CALL_NOT_LOST) {
                                k = client_out_of_step(c, k, k == -EBADMSG && !not_json ? "reading the reply"
                                                                                        : "receiving the reply");
                                goto unlock;
                        }
                }

                client_disconnect(c);
                maybe_done = maybe_done || loss == CALL_MAYBE_DONE;
                if (!repeated && (loss == CALL_UNREAD || method_is_repeatable(method))) {
                        repeated = true;
                        continue;
                }
                if (!maybe_done)
                        k = set_error(-ECONNRESET, "Lost the connection to the broker twice before it read the call "
                                      "%s, which was not carried out: it stopped or restarted. The next call "
                                      "connects again.", method_short(method));
                else
                        k = set_error(-ECONNRESET, "The broker closed the connection after it received the call %s "
                                      "and before it answered: it stopped or restarted, and whether it carried "
                                      "the call out is unknown. The next call connects again.",
                                      method_short(method));
                goto unlock;
        }
        if (reply.continues) {
                /* a reply with "continues" means more are coming for a call that asked for one */
                k = client_out_of_step(c, -EBADMSG, "reading the reply");
                goto unlock;
        }
        /* an error's parameters are read as json-c: vmmb_error_decode(), vmmb_error_describe() */
        k = reply.error ? varlink_reply_parameters(&reply) : 0;
        if (k < 0)
                k = client_out_of_step(c, k, "reading the reply");
unlock:
        (void)pthread_mutex_unlock(&c->call_lock);
        if (k < 0) {
                reply_into_done(into);
                varlink_reply_done(&reply);
                return k;
        }

        if (reply.error && !call->error_replies) {
                k = reply_error(&reply, method);
                varlink_reply_done(&reply);
                return k;
        }
        if (fds.n > 0 && (!ret_fds || reply.error)) {
                reply_into_done(into);
                varlink_reply_done(&reply);
                return set_error(-EPROTO, "The broker sent %zu file descriptors with its reply to %s.", fds.n,
                                 method);
        }
        if (ret_fds) {
                *ret_fds = fds;
                fds = (ReceivedFds){};
        }
        if (ret_generation)
                *ret_generation = generation;
        *ret = reply;
        return 0;
}

/*
 * Writes the call of `method` with the json-c parameters `params` (NULL: {}) as text for client_call_full(),
 * for the calls whose parameters have no writer of their own. Returns 0 or a negative errno with the message set.
 */
static int call_write(const char *method, json_object *params, VarlinkText *ret) {
        _cleanup_(json_putp) json_object *call = NULL;
        ssize_t end;
        int k;

        k = varlink_call_new(method, params, false, false, &call);
        if (k < 0)
                return set_error(k, "Cannot build the call %s: %s.", method, strerror(-k));
        end = json_write(call, &ret->data, &ret->alloc, 0);
        if (end < 0)
                return set_error((int)end, "Cannot build the call %s: %s.", method, strerror((int)-end));
        ret->data[end] = 0;     /* json_write() left room for it */
        ret->len = (size_t)end;
        return 0;
}

/*
 * client_call_full() for a call whose error replies are the caller's errors, whatever the connection, and
 * whose reply's parameters are read as json-c (reply.parameters).
 */
static int client_call(vmmb_client *c, const char *method, json_object *params, VarlinkReply *ret,
                       ReceivedFds *ret_fds) {
        _cleanup_(varlink_text_done) VarlinkText call = {};
        int k;

        k = call_write(method, params, &call);
        if (k >= 0)
                k = client_call_full(c, &(Call){ .method = method, .text = &call }, ret, ret_fds, NULL);
        if (k >= 0) {
                k = varlink_reply_parameters(ret);
                if (k < 0) {
                        varlink_reply_done(ret);
                        return set_error(k, "Cannot read the reply to %s: %s.", method_short(method), strerror(-k));
                }
        }
        return k;
}

/*
 * Sends one call written with varlink's "oneway" set (`call`: free_params_write() with oneway), so that the
 * broker sends no reply, and returns once it is written: the broker acts on it before it reads this client's
 * next call. A connection lost while sending (the broker has no whole call to act on) is connected again and
 * the call sent once more, as client_call() does; after it is written, nothing of the call's outcome comes
 * back.
 *
 * With `keeping` (a Free with keep), the call goes only on a connection whose broker said it keeps leases:
 * when there is none now (never asked on this connection, or it is lost, or lost while sending), it returns 1
 * with nothing carried out, for the caller to ask with a call that is answered. *ret_generation (when given)
 * is the number of the connection that carried it.
 */
static int client_call_oneway(vmmb_client *c, const char *method, const VarlinkText *call, bool keeping,
                              uint64_t *ret_generation) {
        int k;

        (void)pthread_mutex_lock(&c->call_lock);
        for (unsigned attempt = 0;; attempt++) {
                if (keeping && (!c->conn || c->keeps != c->generation)) {
                        k = 1;
                        break;
                }
                if (!c->conn) {
                        k = client_reconnect(c);
                        if (k < 0)
                                break;
                }
                k = varlink_conn_send_text(c->conn, call, NULL, 0);
                if (k < 0) {
                        k = set_error(k, "Cannot queue the call %s: %s.", method, strerror(-k));
                        break;
                }
                k = varlink_conn_flush(c->conn);
                if (k >= 0) {
                        if (ret_generation)
                                *ret_generation = c->generation;
                        k = 0;
                        break;
                }
                if (!conn_error_is_lost(k)) {
                        k = client_out_of_step(c, k, "sending the call");
                        break;
                }
                client_disconnect(c);
                if (keeping)
                        continue;               /* the next connection's broker is asked first */
                if (attempt > 0) {
                        k = set_error(-ECONNRESET, "Lost the connection to the broker twice before it read the call "
                                      "%s, which was not carried out: it stopped or restarted. The next call "
                                      "connects again.", method_short(method));
                        break;
                }
        }
        (void)pthread_mutex_unlock(&c->call_lock);
        return k;
}

/* Tells the broker that lease `id` is done with: waits for its answer, or only sends the call when `oneway`. */
static int client_free_id(vmmb_client *c, const char *id, bool oneway, CallOverlap *overlap) {
        _cleanup_(varlink_text_done) VarlinkText call = {};
        FreeParams p = { .id = (char *)id };
        VarlinkReply reply = {};
        int k;

        k = free_params_write(&p, oneway, &call);
        if (k < 0)
                return set_error(k, "Cannot encode the call to free lease %s: %s.", id, strerror(-k));
        if (oneway)
                return client_call_oneway(c, VMMB_METHOD_FREE, &call, false, NULL);
        k = client_call_full(c, &(Call){ .method = VMMB_METHOD_FREE, .text = &call, .overlap = overlap }, &reply,
                             NULL, NULL);
        if (k < 0)
                return k;
        varlink_reply_done(&reply);
        return 0;
}

/* --- leases ------------------------------------------------------------------------------------------- */

static vmmb_lease *lease_destroy(vmmb_lease *l) {
        if (!l)
                return NULL;
        free(l->id);
        free(l->sizes);
        free(l->owner_name);
        free(l->peers);
        free(l);
        return NULL;
}

DEFINE_TRIVIAL_CLEANUP_FUNC(vmmb_lease, lease_destroy);

/*
 * Unmaps a lease and frees its address range (only the range, for a parked one); returns 0 or a negative errno
 * with the message set. cuMemUnmap does not wait for work queued on the range (work that runs after it faults,
 * CUDA_ERROR_ILLEGAL_ADDRESS, sticky for its context): the caller has made sure none is.
 */
static int lease_unmap(const vmmb_lease *l) {
        CudaDriver *cu = NULL;
        int k;

        k = driver_get(&cu);            /* loaded already: the lease was mapped with it */
        if (k < 0)
                return k;
        if (l->parked)                  /* nothing is mapped: only the reservation is left */
                k = cuda_result_to_errno(cu->cuMemAddressFree(l->va, l->size));
        else
                k = cuda_unmap(cu, l->va, l->sizes, l->n_slabs);
        if (k < 0)
                return set_error(k, "Cannot unmap lease %s at 0x%llx: %s.", l->id, (unsigned long long)l->va,
                                 strerror(-k));
        return 0;
}

/* A Free's unmapping of its lease, done while the broker's answer is on the way (a CallOverlap). */
typedef struct FreeUnmap {
        CallOverlap overlap;
        const vmmb_lease *lease;
        int result;             /* lease_unmap()'s, once run */
} FreeUnmap;

static void free_unmap(CallOverlap *o) {
        FreeUnmap *u = container_of(o, FreeUnmap, overlap);

        u->result = lease_unmap(u->lease);
}

/*
 * Unmaps a lease (lease_unmap()) and tells the broker; frees the lease object in every case. The caller has
 * made sure no work uses it (vmmb_free_stream() waits for a stream first).
 *
 * When `oneway` (vmmb_free_oneway()) it unmaps, then sends the Free and waits for nothing; when unmapping fails
 * the broker is not told, and reclaims the lease when the process exits.
 *
 * Otherwise the Free is sent first and the lease unmapped while the broker's answer is on the way, so that the
 * round trip costs nothing beyond the unmap (FreeUnmap). The broker hands a slab only to its own user, and
 * only once scrubbed; the memory is not touched by anything between the Free and its unmapping, by contract.
 * When unmapping fails after the Free was sent (the driver refused: it is being torn down, say), the broker
 * has ended the lease all the same: the range stays reserved and is never used again by this library, and the
 * unmap's error is returned. When the Free could not be sent, the lease is unmapped afterwards and the call's
 * error returned.
 */
static int lease_release(vmmb_lease *l, bool oneway) {
        _cleanup_(lease_destroyp) vmmb_lease *lease = l;
        FreeUnmap u;
        int k;

        if (lease->reclaimed)
                return 0;               /* given back already: only the object was left */
        if (oneway) {
                k = lease_unmap(lease);
                return k < 0 ? k : client_free_id(lease->client, lease->id, true, NULL);
        }
        u = (FreeUnmap){ .overlap.run = free_unmap, .lease = lease };
        k = client_free_id(lease->client, lease->id, false, &u.overlap);
        if (!u.overlap.ran) {
                /* never sent whole: the broker was not told, and the call's error stands unless unmapping fails */
                int r = lease_unmap(lease);

                return r < 0 ? r : k;
        }
        if (u.result < 0)
                return set_error(u.result, "Cannot unmap lease %s at 0x%llx, which was freed: %s. The broker has "
                                 "ended it; its address range stays reserved in this process.", lease->id,
                                 (unsigned long long)lease->va, strerror(-u.result));
        return k;
}

/* --- the process: kept leases ---------------------------------------------------------------------- */

/*
 * What belongs to the process rather than to one client: the leases it keeps
 * for its next Alloc of their size (vmmb_free_keep()), and its watches for the
 * broker's reclaim requests (below). A process holds leases, not a connection:
 * the broker hands a kept lease back to any Alloc of the process, on any of
 * its connections, so the table is the process's, keyed by lease id.
 *
 * The broker carries out the calls of one connection in order, and those of
 * two connections in no order the library can see. Two things depend on it:
 *
 * - A lease whose keep-Free went one-way and that the broker did not keep
 *   (this process also held it through an Attach, say) would wait in the table
 *   for ever. The broker hands kept leases back before it makes new ones: an
 *   Alloc whose reply is a new lease of size S on device D, sent on the same
 *   connection after the keep-Free of a lease of S on D, shows that the broker
 *   did not keep that one. It is unmapped and dropped (kept_reuse()), with no
 *   Free, since the process may still hold it otherwise; its id is remembered
 *   for a while, and freed if the broker asks for it after all.
 * - A kept lease given back (unmapped, then a Free, maybe on another
 *   connection) may have been handed to an Alloc of this process that the
 *   broker served before the Free: that Free ends the hold the Alloc got, so
 *   its reply must not be used. The id is remembered as released until every
 *   Alloc sent before the Free's answer has been taken in.
 *
 * So each Alloc takes a ticket, numbered in the order they are taken, before
 * it is sent, and gives it back once its reply is taken in; a kept lease
 * records the next ticket once its keep-Free is written.
 *
 * A process keeps at most as many leases as its user may hold (MaxLeases=):
 * finding one is a walk of the list, which costs less than an Alloc's round
 * trip.
 */

/* An Alloc under way: from before it is sent until its reply is taken in. */
typedef struct AllocTicket {
        List link;                      /* in process.allocs, oldest first */
        uint64_t seq;
} AllocTicket;

/* The id of a kept lease the library let go of while the broker may still hand it back or ask for it. */
typedef struct Released {
        List link;                      /* in process.released */
        char id[VMMB_ID_MAX + 1];
        bool dropped;                   /* unmapped as stale, not freed: asked for, it gets a Free */
        uint64_t until;                 /* given back: Allocs with a ticket below this may still bring it back;
                                           UINT64_MAX while its Free is under way */
} Released;

#define DROPPED_MAX 64                  /* dropped ids remembered at most; the oldest is forgotten first */

static struct {
        pthread_mutex_t lock;           /* guards what follows, the kept leases' kept_* fields, the clients'
                                           watch and watch_link, and each watch's clients and handling */
        List kept;                      /* vmmb_lease.link: kept leases, oldest first */
        List released;                  /* Released.link */
        size_t n_dropped;
        List allocs;                    /* AllocTicket.link */
        uint64_t next_seq;              /* the next Alloc's ticket, from 1 */
        uint64_t next_serial;           /* the next keeping's serial, from 1 */
        List watches;                   /* Watch.link: one per broker socket */
        pthread_cond_t handled;         /* with lock: a watch thread is done with a client's lease */
        pthread_mutex_t watch_lock;     /* serialises making and ending watches (joining one that runs needs only
                                           lock); taken before lock */
} process = {
        .lock = PTHREAD_MUTEX_INITIALIZER,
        .kept = LIST_INIT(process.kept),
        .released = LIST_INIT(process.released),
        .allocs = LIST_INIT(process.allocs),
        .next_seq = 1,
        .next_serial = 1,
        .watches = LIST_INIT(process.watches),
        .handled = PTHREAD_COND_INITIALIZER,
        .watch_lock = PTHREAD_MUTEX_INITIALIZER,
};

static pthread_once_t process_once = PTHREAD_ONCE_INIT;

/*
 * In the child of a fork(): what the table holds is the parent's (its holds,
 * mappings the child cannot use on a real driver), and the watch threads did
 * not survive; the child starts with nothing kept and no watch. The lease
 * objects and watches are left, not freed: the parent's clients, copied into
 * the child, may still point to them.
 */
static void process_forget(void) {
        (void)pthread_mutex_init(&process.lock, NULL);
        (void)pthread_mutex_init(&process.watch_lock, NULL);
        (void)pthread_cond_init(&process.handled, NULL);
        list_init(&process.kept);
        list_init(&process.released);
        list_init(&process.allocs);
        list_init(&process.watches);
        process.n_dropped = 0;
}

static void process_init(void) {
        (void)pthread_atfork(NULL, NULL, process_forget);
}

static void process_lock(void) {
        (void)pthread_mutex_lock(&process.lock);
}

static void process_unlock(void) {
        (void)pthread_mutex_unlock(&process.lock);
}

/* The released record of `id`, or NULL. Lock held. */
static Released *released_find(const char *id) {
        Released *r;

        list_for_each_entry(r, &process.released, link)
                if (strcmp(r->id, id) == 0)
                        return r;
        return NULL;
}

/*
 * Links `r` as the released record of `id`: dropped (unmapped as stale, not freed), or given back, its Free
 * under way. Lock held.
 */
static void released_add(Released *r, const char *id, bool dropped) {
        *r = (Released){ .dropped = dropped, .until = dropped ? 0 : UINT64_MAX };
        memcpy(r->id, id, strlen(id) + 1);
        list_link_tail(&process.released, &r->link);
        if (dropped)
                process.n_dropped++;
}

/* Unlinks and frees a released record. Lock held. */
static void released_remove(Released *r) {
        if (r->dropped)
                process.n_dropped--;
        list_unlink(&r->link);
        free(r);
}

/* Forgets what no Alloc under way can bring back any more, and the oldest dropped ids past DROPPED_MAX. Lock
 * held. */
static void released_prune(void) {
        const AllocTicket *oldest = list_first_entry(&process.allocs, AllocTicket, link);
        uint64_t horizon = oldest ? oldest->seq : process.next_seq;
        Released *r, *tmp;

        list_for_each_entry_safe(r, tmp, &process.released, link)
                if (r->dropped ? process.n_dropped > DROPPED_MAX : r->until <= horizon)
                        released_remove(r);
}

/* Takes a ticket for an Alloc about to be sent. */
static void alloc_ticket_take(AllocTicket *t) {
        process_lock();
        t->seq = process.next_seq++;
        list_link_tail(&process.allocs, &t->link);
        process_unlock();
}

/* Gives a ticket back once the Alloc's reply is taken in. */
static void alloc_ticket_return(AllocTicket *t) {
        process_lock();
        list_unlink(&t->link);
        released_prune();
        process_unlock();
}

/* The kept lease of that id, or NULL. Lock held. */
static vmmb_lease *kept_find(const char *id) {
        vmmb_lease *l;

        list_for_each_entry(l, &process.kept, link)
                if (strcmp(l->id, id) == 0)
                        return l;
        return NULL;
}

/* Whether `l` (which may be freed already) is in the table as the keeping `serial`. Lock held. */
static bool kept_is(const vmmb_lease *l, uint64_t serial) {
        const vmmb_lease *i;

        list_for_each_entry(i, &process.kept, link)
                if (i == l)
                        return i->kept_serial == serial;
        return false;
}

/* Puts a lease off its client's list into the table, its keep-Free not written yet; returns its serial. */
static uint64_t kept_add(vmmb_lease *l) {
        uint64_t serial;

        process_lock();
        serial = l->kept_serial = process.next_serial++;
        l->kept_seq = 0;
        l->kept_generation = 0;
        list_link_tail(&process.kept, &l->link);
        process_unlock();
        return serial;
}

/* Its keep-Free was written on connection `generation` (and the broker keeps it, as far as is known). */
static void kept_sent(vmmb_lease *l, uint64_t serial, uint64_t generation) {
        process_lock();
        if (kept_is(l, serial)) {
                l->kept_seq = process.next_seq;
                l->kept_generation = generation;
        }
        process_unlock();
}

/*
 * Whether `l`, a kept lease whose keep-Free was written, is one to give back on `via`: kept through it, or,
 * with `same_broker`, through any client of the broker at its socket (a Free on `via` reaches no other
 * broker). Lock held: the client that kept a lease is not closed while the lease is in the table.
 */
static bool kept_for(const vmmb_lease *l, const vmmb_client *via, bool same_broker) {
        return l->kept_seq != 0 && (l->client == via || (same_broker && strcmp(l->client->path, via->path) == 0));
}

/* Whether the process keeps any lease whose keep-Free was written, through a client of `via`'s broker. */
static bool kept_any(const vmmb_client *via) {
        const vmmb_lease *l;
        bool any = false;

        process_lock();
        list_for_each_entry(l, &process.kept, link)
                if (kept_for(l, via, true)) {
                        any = true;
                        break;
                }
        process_unlock();
        return any;
}

/*
 * Takes the oldest kept lease to give back on `via` (kept_for()) out of the table, and links `r` as its
 * released record while it is given back. NULL when there is none.
 */
static vmmb_lease *kept_take_next(const vmmb_client *via, bool same_broker, Released *r) {
        vmmb_lease *l, *found = NULL;

        process_lock();
        list_for_each_entry(l, &process.kept, link)
                if (kept_for(l, via, same_broker)) {
                        found = l;
                        break;
                }
        if (found) {
                list_unlink(&found->link);
                released_add(r, found->id, false);
        }
        process_unlock();
        return found;
}

/*
 * Gives back a kept lease `l` taken out of the table with its released record `r` (`l` NULL: a dropped one,
 * unmapped already, by its id alone): unmaps it (the work queued on it was done before its keep-Free, by contract,
 * so nothing is waited for), then frees it with the broker on `via`, waiting for the answer. The record stays
 * until no Alloc sent before the answer can bring the lease back. Frees the object. Returns 0 or a negative
 * errno (message set); when unmapping fails the broker is not told, and the record goes at once (no Free
 * ends a hold that an Alloc might get back). When the Free fails, the broker may not have carried it out and
 * still keep the lease: its id is remembered as dropped too, so that a request for it is answered with a Free.
 */
static int kept_give_back(vmmb_client *via, vmmb_lease *l, Released *r) {
        Released *d = NULL;
        bool sent = false;
        int k = 0;

        if (l)
                k = lease_unmap(l);
        if (k >= 0) {
                sent = true;            /* whatever comes back, the broker may have carried it out */
                k = client_free_id(via, r->id, false, NULL);
                if (k < 0)
                        d = calloc(1, sizeof(*d));      /* none: such a request goes unanswered, as before */
        }
        process_lock();
        if (d)
                released_add(d, r->id, true);
        if (sent) {
                r->until = process.next_seq;
                released_prune();
        } else
                released_remove(r);
        process_unlock();
        lease_destroy(l);
        return k;
}

/*
 * Gives back every kept lease kept through `via`, or with `same_broker` through any client of its broker,
 * freeing them on `via`. Returns how many, or the first error (message set) once it has tried them all.
 */
static int kept_give_back_all(vmmb_client *via, bool same_broker) {
        int n = 0, ret = 0, k;

        for (;;) {
                Released *r = calloc(1, sizeof(*r));
                vmmb_lease *l;

                if (!r)
                        return set_error(-ENOMEM, "Out of memory.");
                l = kept_take_next(via, same_broker, r);
                if (!l) {
                        free(r);
                        break;
                }
                k = kept_give_back(via, l, r);
                if (k < 0 && ret == 0)
                        ret = k;
                if (k >= 0 && n < INT32_MAX)
                        n++;
        }
        return ret < 0 ? ret : n;
}

/*
 * A reclaim request for a lease no client's list has: a kept lease is given back without asking anyone, and
 * a dropped one (unmapped already, the broker kept it after all) is freed. Anything else is not this
 * process's to answer (freed meanwhile: the broker sees that).
 */
static void kept_asked(vmmb_client *via, const char *id) {
        Released *r = calloc(1, sizeof(*r)), *d;
        vmmb_lease *l;
        bool found = false;

        if (!r)
                return;
        process_lock();
        l = kept_find(id);
        d = l ? NULL : released_find(id);
        found = l || (d && d->dropped);
        if (l)
                list_unlink(&l->link);
        else if (found)
                released_remove(d);     /* its record becomes one of a lease being given back */
        if (found)
                released_add(r, id, false);
        process_unlock();
        if (!found) {
                free(r);
                return;
        }
        (void)kept_give_back(via, l, r);
}

/* Whether a kept lease has exactly the slabs and device of an Alloc reply: then its mapping is the lease's. */
static bool kept_fits(const vmmb_lease *l, const WireLease *w) {
        if (l->device != w->device || l->size != w->size || l->n_slabs != w->n_slabs || w->readonly)
                return false;
        for (size_t i = 0; i < l->n_slabs; i++)
                if (l->sizes[i] != w->slabs[i].size)
                        return false;
        return true;
}

/*
 * What an Alloc reply (of `c`, ticket `t`, on connection `generation`) means for the kept leases, before it is
 * mapped:
 * - 1: it brings back a lease given back meanwhile, whose Free ends the hold it got: not to be used;
 * - 0 with *ret set: it is a lease kept here with the same slabs and device, taken out of the table, whose
 *   mapping is the lease's;
 * - 0 with *ret NULL: map it. A kept lease of its id whose layout differs is unmapped; when the reply is a
 *   new lease, the leases it shows the broker did not keep (above) are unmapped and dropped.
 * The caller holds the ticket: alloc_ticket_return() prunes the released records afterwards.
 */
static int kept_reuse(vmmb_client *c, const WireLease *w, const AllocTicket *t, uint64_t generation,
                      vmmb_lease **ret) {
        List stale = LIST_INIT(stale);
        vmmb_lease *l, *i, *next;
        Released *r;

        *ret = NULL;
        process_lock();
        r = released_find(w->id);
        if (r && !r->dropped) {
                process_unlock();
                return 1;
        }
        if (r)
                /* the broker kept it after all, and hands it back: a hold of this process's, to map again */
                released_remove(r);
        l = kept_find(w->id);
        if (l)
                list_unlink(&l->link);
        else
                list_for_each_entry_safe(i, next, &process.kept, link) {
                        Released *d;

                        if (i->client != c || i->kept_seq == 0 || i->kept_seq > t->seq ||
                            i->kept_generation != generation || (int64_t)i->device != w->device ||
                            i->size != w->size)
                                continue;
                        d = calloc(1, sizeof(*d));
                        if (!d)
                                continue;       /* left kept, then: vmmb_close() gives it back */
                        released_add(d, i->id, true);
                        list_unlink(&i->link);
                        list_link_tail(&stale, &i->link);
                }
        process_unlock();       /* the dropped ids past DROPPED_MAX go when the Alloc's ticket does */

        while ((i = list_first_entry(&stale, vmmb_lease, link))) {
                list_unlink(&i->link);
                (void)lease_unmap(i);           /* our own mapping: always safe to unmap */
                lease_destroy(i);
        }
        if (!l)
                return 0;
        if (!kept_fits(l, w)) {
                (void)lease_unmap(l);
                lease_destroy(l);
                return 0;
        }
        *ret = l;
        return 0;
}

/* The identifier of a lease in an Alloc reply that failed to decode, or NULL. */
static const char *reply_lease_id(VarlinkReply *reply) {
        json_object *params, *lease, *id;

        if (varlink_reply_parameters(reply) < 0)
                return NULL;
        params = reply->parameters;
        if (!json_object_object_get_ex(params, "lease", &lease) || !json_object_is_type(lease, json_type_object) ||
            !json_object_object_get_ex(lease, "id", &id) || !json_object_is_type(id, json_type_string))
                return NULL;
        return json_object_get_string(id);
}

/* Gives a lease the broker sent back after it could not be used; the caller's error stands. */
static void client_give_back(vmmb_client *c, const char *id) {
        char saved[ERROR_MESSAGE_MAX];

        if (!id)
                return;
        memcpy(saved, error_message, sizeof(saved));
        (void)client_free_id(c, id, false, NULL);
        memcpy(error_message, saved, sizeof(saved));
}

/*
 * Turns a reply that carries a lease (Alloc's or Attach's, an AllocReply) and
 * the fds that came with it into a lease mapped here, on the client's list.
 * `method` names the call in messages; the lease must be on `device` unless
 * that is VMMB_ANY_DEVICE, and of at least `min_size` bytes. It is mapped
 * read-only when `readonly` or the reply says so. The fds stay the caller's.
 * On failure a lease the broker did send is given back to it (one Free, which
 * ends this process's hold) and the error is returned.
 *
 * An Alloc's reply (`ticket` given, the Alloc's, and the connection
 * `generation` that carried it) may hand back a lease this process kept
 * (kept_reuse()): its mapping is used as it is, with no driver call. It
 * returns 1, with nothing mapped or given back and the message set, for a
 * reply that brings back a lease the library was giving back meanwhile: that
 * hold ends with the library's Free, and the Alloc is to be made again.
 */
static int lease_map_reply(vmmb_client *client, const char *method, VarlinkReply *reply, AllocReply *decoded,
                           const ReceivedFds *fds, int device, uint64_t min_size, bool readonly,
                           const AllocTicket *ticket, uint64_t generation, AllocAhead *ahead, vmmb_lease **ret) {
        _cleanup_(lease_destroyp) vmmb_lease *l = NULL;
        _cleanup_free_ char *message = NULL, *decoded_id = NULL;
        _cleanup_free_ int *ordered = NULL;
        AllocReply ar = {};
        CudaDriver *cu = NULL;
        CUdevice dev;
        CUresult r;
        int k;

        if (decoded) {
                /* read with the reply (ReplyInto): taken, its id kept apart until the fds are checked */
                ar = *decoded;
                *decoded = (AllocReply){};
                decoded_id = TAKE_PTR(ar.lease.id);
        }
        k = driver_get(&cu);
        if (k < 0) {
                client_give_back(client, decoded ? decoded_id : reply_lease_id(reply));
                alloc_reply_done(&ar);
                return k;
        }
        if (decoded)
                k = alloc_reply_check_fds(&ar, fds->n, &message);
        else
                k = VARLINK_PARAMETERS_DECODE(alloc_reply, reply, fds->n, &ar, &message);
        if (k < 0) {
                char what[64];

                (void)snprintf(what, sizeof(what), "The broker's reply to %s is not valid", method);
                k = set_error_from(k == -ENOMEM ? k : -EPROTO, what, message);
                client_give_back(client, decoded ? decoded_id : reply_lease_id(reply));
                return k;
        }
        if (decoded)
                ar.lease.id = TAKE_PTR(decoded_id);
        if (ar.lease.n_slabs == 0 || ar.lease.device < 0 || ar.lease.device > INT32_MAX ||
            (device != VMMB_ANY_DEVICE && ar.lease.device != device)) {
                k = set_error(-EPROTO, "The broker's reply to %s is not valid: lease %s has %zu slabs on "
                              "device %" PRId64 ".", method, ar.lease.id, ar.lease.n_slabs, ar.lease.device);
                client_give_back(client, ar.lease.id);
                goto out;
        }
        /* (uid_t)-1 is no user: an owner is a uid below it, or absent (a broker older than owners) */
        if (ar.lease.owner != JSON_ABSENT && (ar.lease.owner < 0 || ar.lease.owner >= (int64_t)UINT32_MAX)) {
                k = set_error(-EPROTO, "The broker's reply to %s is not valid: lease %s is owned by uid %" PRId64 ".",
                              method, ar.lease.id, ar.lease.owner);
                client_give_back(client, ar.lease.id);
                goto out;
        }

        if (ticket) {
                k = kept_reuse(client, &ar.lease, ticket, generation, &l);
                if (k > 0) {
                        (void)set_error(-EAGAIN, "The broker handed back lease %s, which this process was giving "
                                        "back at the same time: ask again.", ar.lease.id);
                        goto out;
                }
                if (l && l->size < min_size) {
                        (void)lease_unmap(l);
                        k = set_error(-EPROTO, "The broker's reply to %s is not valid: it handed back lease %s of "
                                      "%" PRIu64 " bytes, less than was asked for.", method, l->id, l->size);
                        client_give_back(client, ar.lease.id);
                        goto out;
                }
                if (l) {
                        /* the same lease, slabs and device, still mapped here: only the object changes hands */
                        l->client = client;
                        l->owner = ar.lease.owner == JSON_ABSENT ? (uid_t)-1 : (uid_t)ar.lease.owner;
                        goto listed;
                }
        }

        l = calloc(1, sizeof(*l));
        ordered = calloc(ar.lease.n_slabs, sizeof(int));
        if (l) {
                l->id = strdup(ar.lease.id);
                l->sizes = calloc(ar.lease.n_slabs, sizeof(uint64_t));
                l->owner_name = ar.lease.owner_name ? strdup(ar.lease.owner_name) : NULL;
        }
        if (!l || !ordered || !l->id || !l->sizes || (ar.lease.owner_name && !l->owner_name)) {
                k = set_error(-ENOMEM, "Out of memory.");
                client_give_back(client, ar.lease.id);
                goto out;
        }
        l->client = client;
        list_init(&l->link);
        l->from_alloc = ticket != NULL;
        l->device = (int)ar.lease.device;
        l->n_slabs = ar.lease.n_slabs;
        l->readonly = readonly || ar.lease.readonly;
        l->owner = ar.lease.owner == JSON_ABSENT ? (uid_t)-1 : (uid_t)ar.lease.owner;
        for (size_t i = 0; i < l->n_slabs; i++) {
                ordered[i] = fds->fds[ar.lease.slabs[i].fd];
                l->sizes[i] = ar.lease.slabs[i].size;
                l->size += l->sizes[i];
        }
        if (l->size != ar.lease.size || l->size < min_size) {
                k = set_error(-EPROTO, "The broker's reply to %s is not valid: lease %s of %" PRIu64
                              " bytes has slabs of %" PRIu64 " bytes%s.", method, l->id, ar.lease.size, l->size,
                              l->size < min_size ? ", less than was asked for" : "");
                client_give_back(client, l->id);
                goto out;
        }

        r = cu->cuDeviceGet(&dev, l->device);
        if (r != CUDA_SUCCESS) {
                k = set_error(cuda_result_to_errno(r), "Cannot use device %d of lease %s: %s.", l->device, l->id,
                              cuda_result_name(cu, r));
                client_give_back(client, l->id);
                goto out;
        }
        if (ahead && ahead->va != 0 && ahead->size == l->size && ahead->va % cuda_slab_alignment(l->sizes[0]) == 0) {
                k = cuda_map_fds_at(cu, &dev, 1, ordered, l->sizes, l->n_slabs, l->readonly, ahead->va, &message);
                if (k >= 0) {
                        l->va = ahead->va;
                        ahead->va = 0;  /* the lease's now: lease_unmap() frees it */
                }
        } else
                k = cuda_map_fds(cu, dev, ordered, l->sizes, l->n_slabs, l->readonly, &l->va, &message);
        if (k < 0) {
                (void)set_error_from(k, "Cannot map the leased memory", message);
                client_give_back(client, l->id);
                goto out;
        }

listed:
        (void)pthread_mutex_lock(&client->leases_lock);
        list_link_tail(&client->leases, &l->link);
        (void)pthread_mutex_unlock(&client->leases_lock);
        *ret = TAKE_PTR(l);
        k = 0;
out:
        alloc_reply_done(&ar);
        return k;
}

/* --- the API -------------------------------------------------------------------------------------------- */

static vmmb_client *client_destroy(vmmb_client *c) {
        if (!c)
                return NULL;
        varlink_conn_free(c->conn);
        free(c->path);
        (void)pthread_mutex_destroy(&c->call_lock);
        (void)pthread_mutex_destroy(&c->leases_lock);
        (void)pthread_cond_destroy(&c->reclaim_done);
        free(c);
        return NULL;
}

DEFINE_TRIVIAL_CLEANUP_FUNC(vmmb_client, client_destroy);

VMMB_EXPORT int vmmb_connect(const char *socket_path, vmmb_client **ret) {
        _cleanup_(client_destroyp) vmmb_client *c = NULL;
        _cleanup_close_ int fd = -EBADF;
        const char *path = socket_path;
        CudaDriver *cu = NULL;
        uint64_t reconnect_usec = 0, spin_usec = 0;
        int k;

        if (!ret)
                return set_error(-EINVAL, "vmmb_connect() needs somewhere to put the client.");
        if (!path) {
                path = getenv("VMMBROKER_SOCKET");
                if (!path || !*path)
                        path = VMMB_DEFAULT_SOCKET;
        }
        if (!*path)
                return set_error(-EINVAL, "The broker's socket path is empty.");
        if (strlen(path) >= sizeof(((struct sockaddr_un *)NULL)->sun_path))
                return set_error(-ENAMETOOLONG, "The broker's socket path is longer than %zu bytes: %s",
                                 sizeof(((struct sockaddr_un *)NULL)->sun_path) - 1, path);
        k = reconnect_timeout(&reconnect_usec);
        if (k < 0)
                return k;
        k = reply_spin(&spin_usec);
        if (k < 0)
                return k;

        k = driver_get(&cu);
        if (k < 0)
                return k;
        (void)pthread_once(&process_once, process_init);

        k = socket_connect(path, &fd);
        if (k < 0) {
                _cleanup_free_ char *message = NULL;

                /* The hint that fits what is at the path: nothing, not a socket, nobody listening, whose */
                vmmb_connect_message(path, VMMB_DEFAULT_SOCKET, k, &message);
                if (!message)
                        return set_error(k, "Cannot connect to the broker at %s: %s.", path, strerror(-k));
                return set_error(k, "%s", message);
        }

        c = calloc(1, sizeof(*c));
        if (!c)
                return set_error(-ENOMEM, "Out of memory.");
        (void)pthread_mutex_init(&c->call_lock, NULL);
        (void)pthread_mutex_init(&c->leases_lock, NULL);
        (void)pthread_cond_init(&c->reclaim_done, NULL);
        c->parks = -1;
        c->generation = 1;
        list_init(&c->leases);
        list_init(&c->watch_link);
        c->reconnect_usec = reconnect_usec;
        c->spin_usec = spin_usec;
        c->path = strdup(path);
        if (!c->path)
                return set_error(-ENOMEM, "Out of memory.");
        k = varlink_conn_new(&c->conn, fd, VARLINK_MAX_REPLY, true);
        if (k < 0)
                return set_error(k, "Cannot set up the connection to the broker: %s.", strerror(-k));
        fd = -EBADF;                    /* the connection owns it */
        *ret = TAKE_PTR(c);
        return 0;
}

/* --- reclaim requests ------------------------------------------------------------------------------------ */

/*
 * The broker takes one WatchReclaim per process, so the process has one watch
 * per broker socket, which its clients of that broker share: made by the first
 * that needs it (vmmb_lease_set_reclaimable(), vmmb_free_keep()), ended by the
 * last one's vmmb_close(). Its thread answers each request for the lease's
 * client, whichever it is, or gives back a kept lease (kept_asked()), on a
 * connection of its own (`answer`): the clients' may be busy for long
 * (vmmb_alloc_wait()).
 */
typedef struct Watch {
        List link;                      /* in process.watches */
        char *path;
        List clients;                   /* vmmb_client.watch_link; under process.lock */
        vmmb_client *handling;          /* whose lease its thread answers for now; under process.lock */
        pthread_t thread;
        bool running;
        sem_t started;                  /* posted by the thread once it runs (watch_join() waits for it) */
        int stop;                       /* an eventfd: the last client's vmmb_close() stops the thread */
        VarlinkConn *conn;              /* its WatchReclaim; the thread's own once it runs */
        vmmb_client *answer;            /* its connection for Free and SetReclaimable */
} Watch;

/*
 * When the watch thread tries to connect again after its connection was lost: WATCH_RETRY_USEC after, then
 * twice as long each time up to WATCH_RETRY_MAX_USEC, for as long as it takes (watch_reconnect()).
 */
#define WATCH_RETRY_USEC UINT64_C(100000)
#define WATCH_RETRY_MAX_USEC (UINT64_C(2) * 1000000)

/* The lease whose reclaim request the calling thread (a watch thread) answers now, or NULL. */
static __thread vmmb_lease *reclaim_running;

static void varlink_conn_closep(VarlinkConn **c) {
        varlink_conn_free(*c);
}

/* Opens a connection with WatchReclaim on, its first reply read. Returns 0 or a negative errno. */
static int watch_open(const char *path, VarlinkConn **ret) {
        _cleanup_(varlink_conn_closep) VarlinkConn *conn = NULL;
        _cleanup_(json_putp) json_object *call = NULL, *msg = NULL;
        _cleanup_close_ int fd = -EBADF;
        VarlinkReply reply = {};
        int *fds = NULL;
        size_t n_fds = 0;
        int k;

        k = socket_connect(path, &fd);
        if (k < 0)
                return k;
        k = varlink_conn_new(&conn, fd, VARLINK_MAX_REPLY, false);
        if (k < 0)
                return k;
        fd = -EBADF;
        k = varlink_call_new(VMMB_METHOD_WATCH_RECLAIM, NULL, false, true, &call);
        if (k >= 0)
                k = varlink_conn_send(conn, call, NULL, 0);
        if (k >= 0)
                k = varlink_conn_flush(conn);
        if (k >= 0)
                k = varlink_conn_receive(conn, &msg, &fds, &n_fds);
        if (k >= 0 && n_fds > 0) {
                close_fds(fds, n_fds);
                k = -EPROTO;
        }
        free(fds);
        if (k < 0)
                return k;
        k = varlink_reply_parse(msg, &reply);
        if (k >= 0 && (reply.error || !reply.continues))
                k = reply.error && strcmp(reply.error, VARLINK_ERROR_METHOD_NOT_FOUND) == 0 ? -EOPNOTSUPP : -EPROTO;
        varlink_reply_done(&reply);
        if (k < 0)
                return k;
        *ret = TAKE_PTR(conn);
        return 0;
}

/* SetReclaimable on `c`: priority < 0 unmarks. */
static int client_set_reclaimable(vmmb_client *c, const char *id, int priority) {
        _cleanup_(json_putp) json_object *params = NULL;
        SetReclaimableParams p = { .id = (char *)id, .priority = priority < 0 ? JSON_ABSENT : priority };
        VarlinkReply reply = {};
        int k;

        k = set_reclaimable_params_encode(&p, &params);
        if (k < 0)
                return set_error(k, "Cannot encode the call to mark lease %s: %s.", id, strerror(-k));
        k = client_call(c, VMMB_METHOD_SET_RECLAIMABLE, params, &reply, NULL);
        if (k < 0)
                return k;
        varlink_reply_done(&reply);
        return 0;
}

/* Waits for the work queued in a device's primary context (retained for the wait). */
static CUresult primary_synchronize(CudaDriver *cu, int device) {
        CUcontext primary = NULL;
        CUdevice dev = 0;
        CUresult r;

        r = cu->cuDeviceGet(&dev, device);
        if (r == CUDA_SUCCESS)
                r = cu->cuDevicePrimaryCtxRetain(&primary, dev);
        if (r == CUDA_SUCCESS) {
                r = cu->cuCtxSetCurrent(primary);
                if (r == CUDA_SUCCESS)
                        r = cu->cuCtxSynchronize();
                (void)cu->cuCtxSetCurrent(NULL);
                (void)cu->cuDevicePrimaryCtxRelease(dev);
        }
        return r;
}

/* Under client->leases_lock: waits until no vmmb_lease_read() copies from the lease, before it is unmapped. */
static void lease_wait_reads(vmmb_lease *lease) {
        while (lease->readers > 0)
                (void)pthread_cond_wait(&lease->client->reclaim_done, &lease->client->leases_lock);
}

/*
 * Gives a lease back on the watch thread: waits for the work queued in the primary context of its device and of
 * every device given access to it (l->peers: no other thread changes them while l->reclaiming), unmaps, frees
 * it on `via`. Returns 0 once unmapped (whether the broker heard the Free or not: it ends the hold at exit
 * otherwise), or a negative errno with the lease still mapped.
 */
static int lease_give_back(vmmb_lease *l, vmmb_client *via) {
        vmmb_client *c = l->client;
        CudaDriver *cu = NULL;
        CUresult r;
        int k;

        k = driver_get(&cu);
        if (k < 0)
                return k;
        /* a vmmb_lease_read() begun before the request may still copy from the mapping (`reclaiming` stops
         * new ones) */
        (void)pthread_mutex_lock(&c->leases_lock);
        lease_wait_reads(l);
        (void)pthread_mutex_unlock(&c->leases_lock);
        r = primary_synchronize(cu, l->device);
        for (size_t i = 0; r == CUDA_SUCCESS && i < l->n_peers; i++)
                r = primary_synchronize(cu, l->peers[i]);
        if (r != CUDA_SUCCESS)
                return -EIO;            /* work may still run on it: keep it mapped */
        k = cuda_unmap(cu, l->va, l->sizes, l->n_slabs);
        if (k < 0)
                return k;
        /* Reclaimed before the broker hears of it: whoever sees the memory come back sees the flag too. */
        (void)pthread_mutex_lock(&c->leases_lock);
        l->reclaimed = true;
        l->va = 0;
        (void)pthread_mutex_unlock(&c->leases_lock);
        (void)client_free_id(via, l->id, false, NULL);
        return 0;
}

/* Client c's lease object `id` that a request may be for: not given back or being given back, and marked
 * here unless `marked_only` is false. c->leases_lock held. */
static vmmb_lease *client_askable(vmmb_client *c, const char *id, bool marked_only) {
        vmmb_lease *i;

        list_for_each_entry(i, &c->leases, link)
                if (strcmp(i->id, id) == 0 && (i->reclaimable || !marked_only) && !i->reclaimed && !i->reclaiming)
                        return i;
        return NULL;
}

/*
 * One request: the lease's callback decides, then the library gives it back or refuses (unmarks it). A lease
 * that a client of the watch holds but has not marked is refused; one that none holds may be one this
 * process keeps (kept_asked()).
 */
static void watch_handle(Watch *w, const ReclaimRequest *q) {
        vmmb_lease *l = NULL;
        vmmb_client *c = NULL, *j;
        vmmb_reclaim_fn cb = NULL;
        void *userdata = NULL;
        bool parked = false, marked = false;
        int k = 0;

        process_lock();
        /* A lease marked here first; else one not marked here, which the broker may have marked all the same
         * (the watch's marking again, read after the program's unmarking): refused, so it asks the next. */
        for (int pass = 0; pass < 2 && !l; pass++)
                list_for_each_entry(j, &w->clients, watch_link) {
                        (void)pthread_mutex_lock(&j->leases_lock);
                        l = client_askable(j, q->id, pass == 0);
                        if (l) {
                                /* `parked` is read here, under the lock that guards it: while `reclaiming` is
                                 * set, vmmb_lease_park() waits, and vmmb_lease_unpark() of a lease not parked
                                 * changes nothing, so it stays true of the lease until the give-back below is
                                 * done. */
                                l->reclaiming = true;
                                parked = l->parked;
                                marked = l->reclaimable;
                                cb = l->reclaim_cb;
                                userdata = l->reclaim_userdata;
                        }
                        (void)pthread_mutex_unlock(&j->leases_lock);
                        if (l) {
                                c = j;
                                w->handling = c;        /* its vmmb_close() waits */
                                break;
                        }
                }
        process_unlock();
        if (!l) {
                kept_asked(w->answer, q->id);   /* or freed meanwhile: the broker sees that */
                return;
        }

        reclaim_running = l;
        if (parked || !marked)
                k = -EBUSY;     /* parked after it was asked (nothing is mapped to give back), or not offered
                                   here (any more): refuse, so that the broker asks the next at once */
        else if (cb)
                k = cb(l, (uint64_t)MAX(q->timeout_usec, INT64_C(0)), userdata);
        if (k == 0)
                k = lease_give_back(l, w->answer);
        (void)pthread_mutex_lock(&c->leases_lock);
        l->reclaimable = false;
        (void)pthread_mutex_unlock(&c->leases_lock);
        if (k != 0)
                (void)client_set_reclaimable(w->answer, l->id, -1);     /* refused: the broker asks another */
        reclaim_running = NULL;
        (void)pthread_mutex_lock(&c->leases_lock);
        l->reclaiming = false;
        (void)pthread_cond_broadcast(&c->reclaim_done);
        (void)pthread_mutex_unlock(&c->leases_lock);

        process_lock();
        w->handling = NULL;
        (void)pthread_cond_broadcast(&process.handled);
        process_unlock();
}

/*
 * The next lease that its clients marked and that is not marked again yet, flagged as done (its priority
 * p stored as -1 - p until watch_remark_done()), its id and priority copied out; false when there is none.
 */
static bool watch_remark_next(Watch *w, char id[static VMMB_ID_MAX + 1], int *ret_priority) {
        vmmb_client *c;
        vmmb_lease *l;
        bool found = false;

        process_lock();
        list_for_each_entry(c, &w->clients, watch_link) {
                (void)pthread_mutex_lock(&c->leases_lock);
                list_for_each_entry(l, &c->leases, link)
                        if (l->reclaimable && !l->reclaimed && l->priority >= 0) {
                                snprintf(id, VMMB_ID_MAX + 1, "%s", l->id);
                                *ret_priority = l->priority;
                                l->priority = -1 - l->priority;
                                found = true;
                                break;
                        }
                (void)pthread_mutex_unlock(&c->leases_lock);
                if (found)
                        break;
        }
        process_unlock();
        return found;
}

/* Undoes watch_remark_next()'s flags. */
static void watch_remark_done(Watch *w) {
        vmmb_client *c;
        vmmb_lease *l;

        process_lock();
        list_for_each_entry(c, &w->clients, watch_link) {
                (void)pthread_mutex_lock(&c->leases_lock);
                list_for_each_entry(l, &c->leases, link)
                        if (l->priority < 0)
                                l->priority = -1 - l->priority;
                (void)pthread_mutex_unlock(&c->leases_lock);
        }
        process_unlock();
}

/*
 * Marks again, on the connection for answers, every lease its clients marked, one at a time, no lock held across
 * a call. Returns false when a call found the broker gone again (a crash loop): the watch then connects again
 * and marks them all again, those marked already too, since a broker keeps no mark across its restart.
 *
 * Its calls do not wait for a broker to listen, as a call does for up to $VMMBROKER_RECONNECT_TIMEOUT: they
 * look at nothing meanwhile, and the last client's vmmb_close() joins this thread, so a broker gone while the
 * watch marks held that vmmb_close() for the whole timeout. The watch's own loop waits for the broker instead,
 * and sees the stop (watch_reconnect()). A broker that is there takes the connection at once. The stop needs no
 * look between calls: it comes once no client is left, and then watch_remark_next() finds nothing.
 */
static bool watch_remark(Watch *w) {
        uint64_t reconnect_usec = w->answer->reconnect_usec;
        bool done = true;

        w->answer->reconnect_usec = 0;          /* only this thread calls on `answer` */
        for (;;) {
                char id[VMMB_ID_MAX + 1] = "";
                int priority = 0, k;

                if (!watch_remark_next(w, id, &priority))
                        break;
                k = client_set_reclaimable(w->answer, id, priority);
                if (k == -ECONNREFUSED || conn_error_is_lost(k)) {
                        done = false;
                        break;
                }
        }
        watch_remark_done(w);
        w->answer->reconnect_usec = reconnect_usec;
        return done;
}

/*
 * The broker went away: watch again once it is back, however long that takes, and mark again what was marked
 * (marks are not kept). Kept leases are kept across the restart (the broker stores them): nothing to do for
 * them. It does not give up after $VMMBROKER_RECONNECT_TIMEOUT, as a call does: a watch that stopped would
 * leave every lease of the process's clients, marked or kept, never asked again once the broker is back.
 * A broker that goes away again while the watch marks is waited for the same way.
 * Returns false only when the watch is stopped (or poll() fails for good).
 */
static bool watch_reconnect(Watch *w) {
        uint64_t wait = WATCH_RETRY_USEC;

        for (;;) {
                struct pollfd p = { .fd = w->stop, .events = POLLIN };
                int r;

                w->conn = varlink_conn_free(w->conn);
                if (watch_open(w->path, &w->conn) >= 0 && watch_remark(w))
                        return true;
                r = poll(&p, 1, (int)(wait / 1000));
                if (r > 0 || (r < 0 && errno != EINTR))
                        return false;
                wait = MIN(wait * 2, WATCH_RETRY_MAX_USEC);
        }
}

static void *watch_thread(void *userdata) {
        Watch *w = userdata;

        (void)sem_post(&w->started);
        for (;;) {
                _cleanup_(json_putp) json_object *msg = NULL;
                struct pollfd p[2] = {
                        { .fd = w->stop, .events = POLLIN },
                        { .fd = varlink_conn_get_fd(w->conn), .events = POLLIN },
                };
                VarlinkReply reply = {};
                ReclaimRequest q = {};
                int *fds = NULL;
                size_t n_fds = 0;
                int k;

                /* One read may have taken several requests: those buffered are handled without waiting for
                 * the socket, which has nothing more to say about them (the stop is still looked at). */
                if (poll(p, 2, varlink_conn_has_message(w->conn) ? 0 : -1) < 0) {
                        if (errno == EINTR)
                                continue;
                        break;
                }
                if (p[0].revents)
                        break;
                k = varlink_conn_receive(w->conn, &msg, &fds, &n_fds);
                close_fds(fds, n_fds);
                free(fds);
                if (k >= 0 && n_fds > 0)
                        k = -EPROTO;
                if (k >= 0)
                        k = varlink_reply_parse(msg, &reply);
                if (k >= 0 && (reply.error || !reply.continues))
                        k = -EPROTO;
                if (k >= 0)
                        k = reclaim_request_decode(reply.parameters, &q, NULL);
                varlink_reply_done(&reply);
                if (k < 0) {
                        if (!watch_reconnect(w))
                                break;
                        continue;
                }
                if (q.id)
                        watch_handle(w, &q);
                reclaim_request_done(&q);
        }
        return NULL;
}

/* Stops a watch's thread (if it runs) and frees it. watch_lock held, the watch in no list. */
static Watch *watch_free(Watch *w) {
        if (!w)
                return NULL;
        if (w->running) {
                (void)eventfd_write(w->stop, 1);
                (void)pthread_join(w->thread, NULL);
        }
        varlink_conn_free(w->conn);
        safe_close(w->stop);
        vmmb_close(w->answer);          /* holds nothing, and watches nothing */
        (void)sem_destroy(&w->started);
        free(w->path);
        free(w);
        return NULL;
}

/* Joins the client to the running watch of its broker socket, unless it has one already; false when the process
 * has none. process.lock held. */
static bool watch_join_running(vmmb_client *c) {
        Watch *w;

        if (c->watch)
                return true;
        list_for_each_entry(w, &process.watches, link)
                if (strcmp(w->path, c->path) == 0) {
                        list_link_tail(&w->clients, &c->watch_link);
                        c->watch = w;
                        return true;
                }
        return false;
}

/*
 * Makes a client's process watch for reclaim requests of the broker at its socket: it joins the watch of
 * another client of the same socket, or makes one (a connection with WatchReclaim on, one for the answers,
 * the thread). Returns 0 or a negative errno (with the message set): -EOPNOTSUPP for a broker older than
 * reclaiming.
 */
static int watch_join(vmmb_client *c) {
        Watch *w = NULL;
        bool joined;
        int k = 0;

        /* Joining a watch that runs needs no watch_lock: a reclaim callback on its thread may join while a
         * vmmb_close() holds watch_lock and waits for that callback (watch_leave()). */
        process_lock();
        joined = watch_join_running(c);
        process_unlock();
        if (joined)
                return 0;

        (void)pthread_mutex_lock(&process.watch_lock);
        process_lock();
        joined = watch_join_running(c);
        process_unlock();
        if (joined)
                goto out;

        w = calloc(1, sizeof(*w));
        if (!w) {
                k = set_error(-ENOMEM, "Out of memory.");
                goto out;
        }
        list_init(&w->link);
        list_init(&w->clients);
        (void)sem_init(&w->started, 0, 0);
        w->stop = -EBADF;
        w->path = strdup(c->path);
        if (!w->path) {
                k = set_error(-ENOMEM, "Out of memory.");
                goto fail;
        }
        k = vmmb_connect(c->path, &w->answer);
        if (k < 0)
                goto fail;
        w->stop = eventfd(0, EFD_CLOEXEC);
        if (w->stop < 0) {
                k = set_error(-errno, "Cannot make an eventfd for the reclaim watch: %m.");
                goto fail;
        }
        k = watch_open(w->path, &w->conn);
        if (k == -EOPNOTSUPP)
                k = set_error(k, "This broker does not ask for leases back (it has no WatchReclaim): update it.");
        else if (k < 0)
                k = set_error(k, "Cannot watch for reclaim requests at %s: %s.", w->path, strerror(-k));
        if (k < 0)
                goto fail;
        /* the client among its clients before the thread runs: a request for the client's leases finds them */
        process_lock();
        list_link_tail(&w->clients, &c->watch_link);
        c->watch = w;
        process_unlock();
        k = -pthread_create(&w->thread, NULL, watch_thread, w);
        if (k < 0) {
                process_lock();
                list_unlink(&c->watch_link);
                c->watch = NULL;
                process_unlock();
                k = set_error(k, "Cannot start the reclaim watch thread: %s.", strerror(-k));
                goto fail;
        }
        w->running = true;
        /*
         * Returns once the thread runs, past its start-up, which allocates: a process that forks right after
         * (a keep starts the watch) must not fork it in the middle of an allocation, which leaves the child
         * an allocator lock that nobody there will release. glibc's malloc takes its locks around fork();
         * older sanitizers' allocators do not, and a child of test-keep hung so under AddressSanitizer.
         */
        while (sem_wait(&w->started) < 0 && errno == EINTR)
                ;
        /* the process's once it runs: other clients join it from here on */
        process_lock();
        list_link_tail(&process.watches, &w->link);
        process_unlock();
        goto out;
fail:
        w = watch_free(w);
out:
        (void)pthread_mutex_unlock(&process.watch_lock);
        return k;
}

/*
 * A client leaves its watch (vmmb_close()), once the watch thread is done with any lease of its; the last
 * client's leaving stops the thread, after the request it handles now, if any.
 */
static void watch_leave(vmmb_client *c) {
        Watch *w;
        bool last;

        process_lock();
        w = c->watch;
        process_unlock();
        if (!w)
                return;                 /* (never joined, as the watch's own connection for answers) */

        (void)pthread_mutex_lock(&process.watch_lock);
        process_lock();
        list_unlink(&c->watch_link);
        while (w->handling == c)
                (void)pthread_cond_wait(&process.handled, &process.lock);
        c->watch = NULL;
        last = list_is_empty(&w->clients);
        if (last)
                list_unlink(&w->link);
        process_unlock();
        if (last)
                w = watch_free(w);
        (void)pthread_mutex_unlock(&process.watch_lock);
}

VMMB_EXPORT int vmmb_lease_set_reclaimable(vmmb_lease *lease, int priority, vmmb_reclaim_fn callback,
                                           void *userdata) {
        vmmb_client *c;
        bool was;
        int k;

        if (!lease)
                return set_error(-EINVAL, "vmmb_lease_set_reclaimable() needs a lease.");
        if (priority < VMMB_NOT_RECLAIMABLE)
                return set_error(-EINVAL, "A reclaim priority is 0 or more, or VMMB_NOT_RECLAIMABLE.");
        c = lease->client;
        if (priority >= 0) {
                k = watch_join(c);
                if (k < 0)
                        return k;
        }
        (void)pthread_mutex_lock(&c->leases_lock);
        while (lease->reclaiming && reclaim_running != lease)
                (void)pthread_cond_wait(&c->reclaim_done, &c->leases_lock);
        if (lease->reclaimed) {
                (void)pthread_mutex_unlock(&c->leases_lock);
                return set_error(-ESTALE, "Lease %s was given back on the broker's request.", lease->id);
        }
        was = lease->reclaimable;
        lease->reclaimable = priority >= 0;
        lease->priority = priority;
        lease->reclaim_cb = callback;
        lease->reclaim_userdata = userdata;
        (void)pthread_mutex_unlock(&c->leases_lock);
        /* From its own callback the broker is told nothing: the callback's answer is what it hears
         * (watch_handle(), which unmarks the lease either way). An unmark told now would be a refusal of its
         * own, and the broker would ask the next lease even when the callback gives this one back; a mark
         * would be undone by a refusal all the same (kept, the broker would ask the lease again at once for
         * the call it refused: vmmb_reclaim_fn's documentation). Nor does the callback wait here for the
         * client's connection, which another thread may hold for long (vmmb_alloc_wait()). */
        if (reclaim_running == lease)
                return 0;
        if (priority < 0 && !was)
                return 0;
        k = client_set_reclaimable(c, lease->id, priority);
        if (k < 0 && priority >= 0) {
                (void)pthread_mutex_lock(&c->leases_lock);
                lease->reclaimable = false;
                (void)pthread_mutex_unlock(&c->leases_lock);
        }
        return k;
}

/* Under client->leases_lock: 0 when the lease is still this process's, else -ESTALE (given back on the broker's
 * request) or -EBUSY (being given back), with the message set. */
static int lease_not_given_back(const vmmb_lease *lease) {
        if (!lease->reclaimed && !lease->reclaiming)
                return 0;
        return set_error(lease->reclaimed ? -ESTALE : -EBUSY, "Lease %s %s on the broker's request.", lease->id,
                         lease->reclaimed ? "was given back" : "is being given back");
}

/* A flag of the lease's that client->leases_lock guards (reclaimed, parked), read under the lock. */
static bool lease_flag(const vmmb_lease *lease, const bool *flag) {
        bool v;

        (void)pthread_mutex_lock(&lease->client->leases_lock);
        v = *flag;
        (void)pthread_mutex_unlock(&lease->client->leases_lock);
        return v;
}

/* Sets a flag of the lease's that client->leases_lock guards (parked, shared, published) under the lock. */
static void lease_set_flag(vmmb_lease *lease, bool *flag, bool value) {
        (void)pthread_mutex_lock(&lease->client->leases_lock);
        *flag = value;
        (void)pthread_mutex_unlock(&lease->client->leases_lock);
}

VMMB_EXPORT int vmmb_lease_reclaimed(const vmmb_lease *lease) {
        return lease && lease_flag(lease, &lease->reclaimed);
}

VMMB_EXPORT void vmmb_close(vmmb_client *client) {
        char saved[ERROR_MESSAGE_MAX];

        if (!client)
                return;
        /* Freeing the leases may fail (the broker may be gone); that is no news for the caller's thread. A
         * broker that is gone is not waited for: this process's holds end when it exits. */
        client->closing = true;
        memcpy(saved, error_message, sizeof(saved));
        (void)kept_give_back_all(client, false);       /* and those the broker did not keep: stale */
        watch_leave(client);
        for (;;) {
                vmmb_lease *l;

                (void)pthread_mutex_lock(&client->leases_lock);
                /* not while another thread's vmmb_lease_read() copies from it; the list is looked at again
                 * after each wait, whatever that thread did meanwhile */
                while ((l = list_first_entry(&client->leases, vmmb_lease, link)) && l->readers > 0)
                        (void)pthread_cond_wait(&client->reclaim_done, &client->leases_lock);
                if (l)
                        list_unlink(&l->link);
                (void)pthread_mutex_unlock(&client->leases_lock);
                if (!l)
                        break;
                (void)lease_release(l, false);
        }
        memcpy(error_message, saved, sizeof(saved));
        client_destroy(client);
}

/* How often an Alloc is made again when its reply brings back a lease being given back (lease_map_reply()). */
#define ALLOC_STALE_TRIES 3

/*
 * Alloc, waiting up to wait_usec for room (0: not at all); `function` names the caller in messages. A reply
 * that hands back a kept lease reuses its mapping (lease_map_reply()). Refused for room or a limit while the
 * process keeps leases of this broker, it gives them all back and asks once more, with the same wait.
 */
static int client_alloc(vmmb_client *client, uint64_t size, int device, const uint64_t *devices, size_t n_devices,
                        const char *label, uint64_t wait_usec, const char *function, vmmb_lease **ret) {
        _cleanup_(varlink_text_done) VarlinkText call = {};
        AllocParams a = { .size = size, .device = device, .label = (char *)label,
                          .wait_usec = (int64_t)MIN(wait_usec, (uint64_t)INT64_MAX),
                          .devices = (uint64_t *)devices, .n_devices = n_devices };
        AllocAhead ahead = { .overlap.run = alloc_ahead_reserve };
        bool gave_back = false;
        unsigned stale = 0;
        CudaDriver *cu = NULL;
        AllocTicket t;
        int k;

        if (!client || !ret)
                return set_error(-EINVAL, "%s() needs a client and somewhere to put the lease.", function);
        if (size == 0)
                return set_error(-EINVAL, "Cannot lease 0 bytes: the size must be more than 0.");
        if (label && strlen(label) > VMMB_LABEL_MAX)
                return set_error(-EINVAL, "The label is longer than %d bytes.", VMMB_LABEL_MAX);
        if (device < VMMB_ANY_DEVICE)
                return set_error(-ENODEV, "There is no device %d: devices are numbered from 0.", device);
        k = driver_get(&cu);
        if (k < 0)
                return k;

        k = alloc_params_write(&a, &call);
        if (k == -ERANGE || k == -EINVAL)
                /* a varlink int is an int64: larger sizes cannot even be asked for */
                return set_error(-EINVAL, "Cannot lease %" PRIu64 " bytes: the size is out of range.", size);
        if (k < 0)
                return set_error(k, "Cannot encode the request: %s.", strerror(-k));

        /* a kept lease is likely to come back, mapped already: nothing to reserve for it */
        if (size <= UINT64_MAX - LIKELY_GRANULARITY && !kept_any(client))
                ahead.size = (size + LIKELY_GRANULARITY - 1) / LIKELY_GRANULARITY * LIKELY_GRANULARITY;

        alloc_ticket_take(&t);
        for (;;) {
                _cleanup_(received_fds_done) ReceivedFds fds = {};
                VarlinkReply reply = {};
                uint64_t generation = 0;

                ReplyInto into = {};

                k = client_call_full(client, &(Call){ .method = VMMB_METHOD_ALLOC, .text = &call, .into = &into,
                                                      .overlap = &ahead.overlap },
                                     &reply, &fds, &generation);
                if ((k == -ENOMEM || k == -EDQUOT) && !gave_back && kept_any(client)) {
                        char saved[ERROR_MESSAGE_MAX];

                        /* kept leases are still charged and leased: give them back, and ask again */
                        gave_back = true;
                        memcpy(saved, error_message, sizeof(saved));
                        (void)kept_give_back_all(client, true);
                        memcpy(error_message, saved, sizeof(saved));
                        continue;
                }
                if (k < 0)
                        break;
                k = lease_map_reply(client, "Alloc", &reply, into.decoded ? &into.lease : NULL, &fds, device, size,
                                    false, &t, generation, &ahead, ret);
                varlink_reply_done(&reply);
                if (k > 0 && ++stale < ALLOC_STALE_TRIES)
                        continue;
                if (k > 0)
                        k = -EAGAIN;            /* the message says why */
                break;
        }
        alloc_ticket_return(&t);
        alloc_ahead_done(&ahead);
        return k;
}

VMMB_EXPORT int vmmb_alloc(vmmb_client *client, uint64_t size, int device, const char *label, vmmb_lease **ret) {
        return client_alloc(client, size, device, NULL, 0, label, 0, "vmmb_alloc", ret);
}

VMMB_EXPORT int vmmb_alloc_wait(vmmb_client *client, uint64_t size, int device, const char *label,
                                uint64_t timeout_usec, vmmb_lease **ret) {
        return client_alloc(client, size, device, NULL, 0, label, timeout_usec, "vmmb_alloc_wait", ret);
}

VMMB_EXPORT int vmmb_alloc_among(vmmb_client *client, uint64_t size, const int *devices, size_t n_devices,
                                 const char *label, uint64_t timeout_usec, vmmb_lease **ret) {
        uint64_t set[VMMB_ALLOC_DEVICES_MAX];

        if (n_devices > 0 && !devices)
                return set_error(-EINVAL, "vmmb_alloc_among() needs the devices to choose from.");
        if (n_devices > VMMB_ALLOC_DEVICES_MAX)
                return set_error(-EINVAL, "vmmb_alloc_among() takes at most %d devices, not %zu.",
                                 VMMB_ALLOC_DEVICES_MAX, n_devices);
        for (size_t j = 0; j < n_devices; j++) {
                if (devices[j] < 0)
                        return set_error(-ENODEV, "There is no device %d: devices are numbered from 0.",
                                         devices[j]);
                set[j] = (uint64_t)devices[j];
        }
        return client_alloc(client, size, VMMB_ANY_DEVICE, n_devices > 0 ? set : NULL, n_devices, label,
                            timeout_usec, "vmmb_alloc_among", ret);
}

/* Checks a token the caller passed; `function` names the caller in the message. */
static int token_check(const char *token, const char *function) {
        size_t n;

        if (!token)
                return set_error(-EINVAL, "%s() needs a token.", function);
        n = strlen(token);
        if (n == 0 || n > VMMB_TOKEN_MAX)
                return set_error(-EINVAL, "'%.*s%s' is not a token: a token is 1-%d characters, as vmmb_share() "
                                 "wrote it.", 16, token, n > 16 ? "..." : "", VMMB_TOKEN_MAX);
        return 0;
}

/*
 * Checks a name to publish: NAME alone, in the owner's namespace. One with '/' is refused with a sentence on
 * how others name it; `owner_name` is the lease owner's user name, for that sentence, or NULL.
 */
static int name_check(const char *name, const char *function, const char *owner_name) {
        if (!name)
                return set_error(-EINVAL, "%s() needs a name.", function);
        if (strchr(name, '/') && vmmb_lease_name_was_valid(name))
                return set_error(-EINVAL, "'%.*s%s' cannot be published: a name has no '/'. A name lives in its "
                                 "owner's namespace: publish it as NAME, and other users attach it as "
                                 "OWNER/NAME (%s/NAME).", 64, name, strlen(name) > 64 ? "..." : "",
                                 owner_name ?: "OWNER");
        if (!vmmb_lease_name_is_valid(name))
                return set_error(-EINVAL, "'%.*s%s' cannot be a lease's name: a name is 1-%d ASCII letters, "
                                 "digits and ._-:@+ that begins with a letter or digit.", 64, name,
                                 strlen(name) > 64 ? "..." : "", VMMB_LEASE_NAME_MAX);
        return 0;
}

/* Checks a name to attach or unpublish: NAME (the caller's own) or OWNER/NAME. */
static int name_ref_check(const char *ref, const char *function) {
        char buf[VMMB_LEASE_NAME_REF_MAX + 1];
        const char *owner, *name;

        if (!ref)
                return set_error(-EINVAL, "%s() needs a name.", function);
        if (vmmb_lease_name_split(ref, buf, &owner, &name) < 0)
                return set_error(-EINVAL, "'%.*s%s' is not a lease's name: that is NAME (one of your own) or "
                                 "OWNER/NAME (OWNER a user name or uid), NAME 1-%d ASCII letters, digits and "
                                 "._-:@+ that begins with a letter or digit.", 64, ref,
                                 strlen(ref) > 64 ? "..." : "", VMMB_LEASE_NAME_MAX);
        return 0;
}

/* Checks flags: VMMB_READONLY is the only one. */
static int flags_check(unsigned flags, const char *function) {
        if (flags & ~VMMB_READONLY)
                return set_error(-EINVAL, "%s() takes no flags but VMMB_READONLY (0x%x given).", function, flags);
        return 0;
}

/* A call that returns nothing: sends it and drops the empty reply. */
static int client_call_empty(vmmb_client *c, const char *method, json_object *params) {
        VarlinkReply reply = {};
        int k;

        k = client_call(c, method, params, &reply, NULL);
        if (k < 0)
                return k;
        varlink_reply_done(&reply);
        return 0;
}

/* Attach by token or by name (exactly one). */
static int client_attach(vmmb_client *client, const char *token, const char *name, unsigned flags,
                         vmmb_lease **ret) {
        _cleanup_(received_fds_done) ReceivedFds fds = {};
        _cleanup_(varlink_text_done) VarlinkText call = {};
        AttachParams a = { .token = (char *)token, .name = (char *)name, .readonly = flags & VMMB_READONLY };
        ReplyInto into = {};
        VarlinkReply reply = {};
        CudaDriver *cu = NULL;
        int k;

        k = driver_get(&cu);
        if (k < 0)
                return k;
        k = attach_params_write(&a, &call);
        if (k < 0)
                return set_error(k, "Cannot encode the request: %s.", strerror(-k));
        /* its reply is an Alloc's, read in the envelope's pass as Alloc's is */
        k = client_call_full(client, &(Call){ .method = VMMB_METHOD_ATTACH, .text = &call, .into = &into }, &reply,
                             &fds, NULL);
        if (k < 0)
                return k;
        k = lease_map_reply(client, "Attach", &reply, into.decoded ? &into.lease : NULL, &fds, VMMB_ANY_DEVICE, 0,
                            flags & VMMB_READONLY, NULL, 0, NULL, ret);
        varlink_reply_done(&reply);
        return k;
}

VMMB_EXPORT int vmmb_attach(vmmb_client *client, const char *token, unsigned flags, vmmb_lease **ret) {
        int k;

        if (!client || !ret)
                return set_error(-EINVAL, "vmmb_attach() needs a client and somewhere to put the lease.");
        k = token_check(token, "vmmb_attach");
        if (k < 0)
                return k;
        k = flags_check(flags, "vmmb_attach");
        if (k < 0)
                return k;
        return client_attach(client, token, NULL, flags, ret);
}

VMMB_EXPORT int vmmb_attach_name(vmmb_client *client, const char *name, unsigned flags, vmmb_lease **ret) {
        int k;

        if (!client || !ret)
                return set_error(-EINVAL, "vmmb_attach_name() needs a client and somewhere to put the lease.");
        k = name_ref_check(name, "vmmb_attach_name");
        if (k < 0)
                return k;
        k = flags_check(flags, "vmmb_attach_name");
        if (k < 0)
                return k;
        return client_attach(client, NULL, name, flags, ret);
}

VMMB_EXPORT int vmmb_share(vmmb_lease *lease, uid_t uid, unsigned flags, char token[VMMB_TOKEN_SIZE]) {
        _cleanup_(json_putp) json_object *params = NULL;
        _cleanup_free_ char *message = NULL;
        ShareParams p = { .uid = uid == VMMB_ANY_UID ? JSON_ABSENT : (int64_t)uid,
                          .readonly = flags & VMMB_READONLY };
        VarlinkReply reply = {};
        ShareReply sr = {};
        int k;

        if (!lease || !token)
                return set_error(-EINVAL, "vmmb_share() needs a lease and somewhere to put the token.");
        k = flags_check(flags, "vmmb_share");
        if (k < 0)
                return k;
        p.id = lease->id;
        lease_set_flag(lease, &lease->shared, true);    /* a token may exist from here on, whatever comes back */
        k = share_params_encode(&p, &params);
        if (k < 0)
                return set_error(k, "Cannot encode the request: %s.", strerror(-k));
        k = client_call(lease->client, VMMB_METHOD_SHARE, params, &reply, NULL);
        if (k < 0)
                return k;
        k = share_reply_decode(reply.parameters, &sr, &message);
        if (k < 0)
                k = set_error_from(k == -ENOMEM ? k : -EPROTO, "The broker's reply to Share is not valid", message);
        else if (strlen(sr.token) == 0 || strlen(sr.token) >= VMMB_TOKEN_SIZE)
                k = set_error(-EPROTO, "The broker's reply to Share is not valid: a token of %zu characters.",
                              strlen(sr.token));
        else
                memcpy(token, sr.token, strlen(sr.token) + 1);
        share_reply_done(&sr);
        varlink_reply_done(&reply);
        return k;
}

VMMB_EXPORT int vmmb_revoke(vmmb_client *client, const char *token) {
        _cleanup_(json_putp) json_object *params = NULL;
        RevokeParams p = { .token = (char *)token };
        int k;

        if (!client)
                return set_error(-EINVAL, "vmmb_revoke() needs a client.");
        k = token_check(token, "vmmb_revoke");
        if (k < 0)
                return k;
        k = revoke_params_encode(&p, &params);
        if (k < 0)
                return set_error(k, "Cannot encode the request: %s.", strerror(-k));
        return client_call_empty(client, VMMB_METHOD_REVOKE, params);
}

VMMB_EXPORT int vmmb_publish(vmmb_lease *lease, const char *name, const uid_t *uids, size_t n_uids,
                             unsigned flags) {
        _cleanup_(json_putp) json_object *params = NULL;
        _cleanup_free_ uint64_t *wire_uids = NULL;
        PublishParams p = { .name = (char *)name, .n_uids = n_uids, .readonly = flags & VMMB_READONLY };
        int k;

        if (!lease)
                return set_error(-EINVAL, "vmmb_publish() needs a lease.");
        k = name_check(name, "vmmb_publish", lease->owner_name);
        if (k < 0)
                return k;
        k = flags_check(flags, "vmmb_publish");
        if (k < 0)
                return k;
        if (n_uids > VMMB_PUBLISH_UIDS_MAX)
                return set_error(-EINVAL, "A lease can be published to at most %d users (%zu given).",
                                 VMMB_PUBLISH_UIDS_MAX, n_uids);
        if (n_uids > 0 && !uids)
                return set_error(-EINVAL, "vmmb_publish() was given %zu users but no array of them.", n_uids);
        if (n_uids > 0) {
                wire_uids = calloc(n_uids, sizeof(uint64_t));
                if (!wire_uids)
                        return set_error(-ENOMEM, "Out of memory.");
                for (size_t i = 0; i < n_uids; i++) {
                        if (uids[i] == VMMB_ANY_UID)
                                return set_error(-EINVAL, "User %zu of the list is VMMB_ANY_UID, which is no user.",
                                                 i);
                        wire_uids[i] = uids[i];
                }
        }
        p.id = lease->id;
        p.uids = wire_uids;
        lease_set_flag(lease, &lease->published, true); /* it may be published from here on */
        k = publish_params_encode(&p, &params);
        if (k < 0)
                return set_error(k, "Cannot encode the request: %s.", strerror(-k));
        return client_call_empty(lease->client, VMMB_METHOD_PUBLISH, params);
}

VMMB_EXPORT int vmmb_unpublish(vmmb_client *client, const char *name) {
        _cleanup_(json_putp) json_object *params = NULL;
        UnpublishParams p = { .name = (char *)name };
        int k;

        if (!client)
                return set_error(-EINVAL, "vmmb_unpublish() needs a client.");
        k = name_ref_check(name, "vmmb_unpublish");
        if (k < 0)
                return k;
        k = unpublish_params_encode(&p, &params);
        if (k < 0)
                return set_error(k, "Cannot encode the request: %s.", strerror(-k));
        return client_call_empty(client, VMMB_METHOD_UNPUBLISH, params);
}

VMMB_EXPORT int vmmb_tokens(vmmb_lease *lease, vmmb_token **ret, size_t *ret_n) {
        _cleanup_(json_putp) json_object *params = NULL;
        _cleanup_free_ char *message = NULL;
        _cleanup_free_ vmmb_token *tokens = NULL;
        FreeParams p = {};
        VarlinkReply reply = {};
        TokensReply tr = {};
        int k;

        if (!lease || !ret || !ret_n)
                return set_error(-EINVAL, "vmmb_tokens() needs a lease and somewhere to put the tokens.");
        p.id = lease->id;
        k = free_params_encode(&p, &params);
        if (k < 0)
                return set_error(k, "Cannot encode the request: %s.", strerror(-k));
        k = client_call(lease->client, VMMB_METHOD_TOKENS, params, &reply, NULL);
        if (k < 0)
                return k;
        k = tokens_reply_decode(reply.parameters, &tr, &message);
        if (k < 0) {
                k = set_error_from(k == -ENOMEM ? k : -EPROTO, "The broker's reply to Tokens is not valid", message);
                goto out;
        }
        if (tr.n_tokens > 0) {
                tokens = calloc(tr.n_tokens, sizeof(vmmb_token));
                if (!tokens) {
                        k = set_error(-ENOMEM, "Out of memory.");
                        goto out;
                }
        }
        for (size_t i = 0; i < tr.n_tokens; i++) {
                const WireToken *w = &tr.tokens[i];
                size_t n = strlen(w->token);

                /* (uid_t)-1 is VMMB_ANY_UID: a user is below it */
                if (n == 0 || n >= VMMB_TOKEN_SIZE || (w->uid != JSON_ABSENT && w->uid >= (int64_t)UINT32_MAX) ||
                    w->creator < 0 || w->creator >= (int64_t)UINT32_MAX) {
                        k = set_error(-EPROTO, "The broker's reply to Tokens is not valid: token %zu is of %zu "
                                      "characters, for uid %" PRId64 ", made by uid %" PRId64 ".", i, n, w->uid,
                                      w->creator);
                        goto out;
                }
                memcpy(tokens[i].token, w->token, n + 1);
                tokens[i].uid = w->uid == JSON_ABSENT ? VMMB_ANY_UID : (uid_t)w->uid;
                tokens[i].creator = (uid_t)w->creator;
                tokens[i].readonly = w->readonly ? 1 : 0;
        }
        *ret = TAKE_PTR(tokens);
        *ret_n = tr.n_tokens;
        k = 0;
out:
        tokens_reply_done(&tr);
        varlink_reply_done(&reply);
        return k;
}

VMMB_EXPORT void vmmb_tokens_free(vmmb_token *tokens, size_t n) {
        /* one block: the tokens hold nothing of their own (n is for a later layout that may) */
        (void)n;
        free(tokens);
}

/*
 * Takes a lease off its client's list to free it, once no reclaim callback decides on it; `function` names the
 * caller in messages. *ret_keepable (when given) says whether the broker can be expected to keep it
 * (vmmb_free_keep()): it came from this library's Alloc, was never shared, published, parked or given to
 * other devices, is mapped read-write, and is not marked reclaimable nor given back. (So no other lease object
 * of the process is the same lease: an Attach needs a token or a name, which only vmmb_share() or
 * vmmb_publish() of this object can have made, and the broker hands a lease back to an Alloc only while it is
 * kept, off every client's list.)
 */
static int lease_unlist(vmmb_lease *lease, const char *function, bool *ret_keepable) {
        vmmb_client *c = lease->client;

        (void)pthread_mutex_lock(&c->leases_lock);
        if (lease->reclaiming && reclaim_running == lease) {
                (void)pthread_mutex_unlock(&c->leases_lock);
                return set_error(-EDEADLK, "%s() of lease %s from its own reclaim callback: return 0 from the "
                                 "callback instead, and the library gives it back.", function, lease->id);
        }
        /* its reclaim callback runs: it decides first; another thread's vmmb_lease_read() copies from it */
        while (lease->reclaiming || lease->readers > 0)
                (void)pthread_cond_wait(&c->reclaim_done, &c->leases_lock);
        list_unlink(&lease->link);
        if (ret_keepable)
                *ret_keepable = lease->from_alloc && !lease->shared && !lease->published && !lease->was_parked &&
                                lease->n_peers == 0 && !lease->readonly && !lease->reclaimable && !lease->reclaimed;
        (void)pthread_mutex_unlock(&c->leases_lock);
        return 0;
}

/* vmmb_free() and vmmb_free_oneway(). */
static int lease_free(vmmb_lease *lease, bool oneway) {
        int k;

        if (!lease)
                return 0;
        k = lease_unlist(lease, oneway ? "vmmb_free_oneway" : "vmmb_free", NULL);
        if (k < 0)
                return k;
        return lease_release(lease, oneway);
}

VMMB_EXPORT int vmmb_free(vmmb_lease *lease) {
        return lease_free(lease, false);
}

VMMB_EXPORT int vmmb_free_oneway(vmmb_lease *lease) {
        return lease_free(lease, true);
}

/* Whether the broker of the client's connection keeps leases: 1, 0, or -1 when not known (not asked on this
 * connection, or none is up: the next call connects again, maybe to another broker). */
static int client_keeps(vmmb_client *c) {
        int keeps = -1;

        (void)pthread_mutex_lock(&c->call_lock);
        if (c->conn && c->keeps == c->generation)
                keeps = 1;
        else if (c->conn && c->keeps_not == c->generation)
                keeps = 0;
        (void)pthread_mutex_unlock(&c->call_lock);
        return keeps;
}

/* What the broker of connection `generation` said: it keeps leases, or it knows no keeping. */
static void client_set_keeps(vmmb_client *c, uint64_t generation, bool keeps) {
        (void)pthread_mutex_lock(&c->call_lock);
        if (keeps)
                c->keeps = generation;
        else
                c->keeps_not = generation;
        (void)pthread_mutex_unlock(&c->call_lock);
}

/*
 * A keep-Free that did not keep: takes the lease back out of the table if it is still there (otherwise whoever
 * took it has it), unmaps it, and sends the plain Free one-way when `free_plainly` (an older broker refused the
 * parameter, so nothing was freed). When `maybe_kept` (the connection was lost after the broker may have read
 * the call), its id is remembered as dropped: if the broker kept it after all and asks for it, it is freed.
 * Returns `error` (its message kept) when it is negative, else what unmapping and freeing returned.
 */
static int kept_undo(vmmb_lease *l, uint64_t serial, int error, bool free_plainly, bool maybe_kept) {
        char saved[ERROR_MESSAGE_MAX];
        Released *d = maybe_kept ? calloc(1, sizeof(*d)) : NULL;
        bool taken;
        int k;

        memcpy(saved, error_message, sizeof(saved));
        process_lock();
        taken = kept_is(l, serial);
        if (taken) {
                list_unlink(&l->link);
                if (d) {
                        released_add(d, l->id, true);
                        d = NULL;
                        released_prune();
                }
        }
        process_unlock();
        free(d);
        if (!taken)
                return error;
        if (free_plainly)
                k = lease_release(l, true);
        else {
                k = lease_unmap(l);
                lease_destroy(l);
        }
        if (error < 0) {
                memcpy(error_message, saved, sizeof(saved));
                return error;
        }
        return k;
}

VMMB_EXPORT int vmmb_free_keep(vmmb_lease *lease) {
        _cleanup_(varlink_text_done) VarlinkText call = {};
        FreeParams p;
        _cleanup_free_ char *message = NULL;
        char saved[ERROR_MESSAGE_MAX];
        uint64_t serial, generation = 0;
        VarlinkReply reply = {};
        FreeReply fr = {};
        vmmb_client *c;
        bool keepable, kept;
        int k, keeps;

        if (!lease)
                return 0;
        c = lease->client;
        k = lease_unlist(lease, "vmmb_free_keep", &keepable);
        if (k < 0)
                return k;
        if (!keepable)
                return lease_release(lease, true);
        keeps = client_keeps(c);
        if (keeps == 0)
                return lease_release(lease, true);
        p = (FreeParams){ .id = lease->id, .keep = true };
        /* one-way when this connection's broker said it keeps (the call is written again if not sent) */
        if (free_params_write(&p, keeps > 0, &call) < 0)
                return lease_release(lease, true);
        /* The broker asks for kept leases back through the process's watch: no watch, no keeping. */
        memcpy(saved, error_message, sizeof(saved));
        k = watch_join(c);
        memcpy(error_message, saved, sizeof(saved));
        if (k == -EOPNOTSUPP) {
                /* older than reclaiming, so older than keeping: no watch is tried again on this connection */
                (void)pthread_mutex_lock(&c->call_lock);
                c->keeps_not = c->generation;
                (void)pthread_mutex_unlock(&c->call_lock);
        }
        if (k < 0)
                return lease_release(lease, true);

        /* In the table before the call: an Alloc that the broker hands it back to, on any client, finds it. */
        serial = kept_add(lease);
        if (keeps > 0) {
                k = client_call_oneway(c, VMMB_METHOD_FREE, &call, true, &generation);
                if (k == 0) {
                        kept_sent(lease, serial, generation);
                        return 0;
                }
                if (k < 0)
                        return kept_undo(lease, serial, k, false, false);
                /* not sent: the connection is new, its broker not asked yet */
        }

        /* Asked with an answer, the first time on each connection: does this broker keep? */
        if (keeps > 0 && free_params_write(&p, false, &call) < 0)
                return kept_undo(lease, serial, 0, true, false);        /* freed plainly, as above */
        k = client_call_full(c, &(Call){ .method = VMMB_METHOD_FREE, .text = &call, .error_replies = true }, &reply,
                             NULL, &generation);
        if (k < 0)
                return kept_undo(lease, serial, k, false, k == -ECONNRESET);
        if (reply.error) {
                VmmbError e = {};
                bool refused_keep;

                refused_keep = strcmp(reply.error, VMMB_ERROR_INVALID_PARAMETER) == 0 &&
                               vmmb_error_decode(reply.error, reply.parameters, &e, NULL) >= 0 && e.parameter &&
                               strcmp(e.parameter, "keep") == 0;
                vmmb_error_done(&e);
                if (refused_keep) {
                        /* a broker older than keeping, which refuses the parameter: nothing was freed */
                        varlink_reply_done(&reply);
                        client_set_keeps(c, generation, false);
                        return kept_undo(lease, serial, 0, true, false);
                }
                k = reply_error(&reply, VMMB_METHOD_FREE);
                varlink_reply_done(&reply);
                return kept_undo(lease, serial, k, false, false);
        }
        k = VARLINK_PARAMETERS_DECODE(free_reply, &reply, &fr, &message);
        varlink_reply_done(&reply);
        kept = fr.kept;
        free_reply_done(&fr);
        if (k == -ENODATA) {
                /* a broker older than keeping that took it for a plain Free: the lease is freed, unmap it */
                client_set_keeps(c, generation, false);
                return kept_undo(lease, serial, 0, false, false);
        }
        if (k < 0)
                return kept_undo(lease, serial, set_error_from(k == -ENOMEM ? k : -EPROTO, "The broker's reply to "
                                                               "Free is not valid", message), false, false);
        client_set_keeps(c, generation, true);
        if (!kept)
                /* a plain Free after all (the process holds it otherwise too, say): unmap it now */
                return kept_undo(lease, serial, 0, false, false);
        kept_sent(lease, serial, generation);
        return 0;
}

VMMB_EXPORT int vmmb_give_back_kept(vmmb_client *client) {
        if (!client)
                return set_error(-EINVAL, "vmmb_give_back_kept() needs a client.");
        return kept_give_back_all(client, false);
}

/*
 * Makes sure the calling thread has a current context: its own, or else `device`'s primary context, retained and
 * made current until context_drop(); *ret_primary is that context (NULL when the thread had one). With `ret_none`
 * (a caller that only waits for work in the context), when the thread has no context and the primary context is
 * not active either, *ret_none is set and nothing is retained: no work can be queued in a context that does not
 * exist, and retaining it would create it (about 0.2 s on an H200, 1 s while another process pins host memory),
 * only for context_drop() to destroy it again.
 */
static CUresult context_hold(CudaDriver *cu, int device, CUcontext *ret_primary, CUdevice *ret_dev, bool *ret_none) {
        CUcontext current = NULL;
        unsigned flags = 0;
        int active = 0;
        CUresult r;

        *ret_primary = NULL;
        if (ret_none)
                *ret_none = false;
        r = cu->cuCtxGetCurrent(&current);
        if (r != CUDA_SUCCESS || current)
                return r;
        r = cu->cuDeviceGet(ret_dev, device);
        if (r == CUDA_SUCCESS && ret_none) {
                r = cu->cuDevicePrimaryCtxGetState(*ret_dev, &flags, &active);
                if (r == CUDA_SUCCESS && !active) {
                        *ret_none = true;
                        return CUDA_SUCCESS;
                }
        }
        if (r == CUDA_SUCCESS)
                r = cu->cuDevicePrimaryCtxRetain(ret_primary, *ret_dev);
        if (r != CUDA_SUCCESS)
                return r;
        r = cu->cuCtxSetCurrent(*ret_primary);
        if (r != CUDA_SUCCESS) {
                (void)cu->cuDevicePrimaryCtxRelease(*ret_dev);
                *ret_primary = NULL;
        }
        return r;
}

/* Undoes context_hold(). */
static void context_drop(CudaDriver *cu, CUcontext primary, CUdevice dev) {
        if (!primary)
                return;
        (void)cu->cuCtxSetCurrent(NULL);
        (void)cu->cuDevicePrimaryCtxRelease(dev);
}

/* A stream the caller created: not NULL, CU_STREAM_LEGACY or CU_STREAM_PER_THREAD, which name a context's own. */
static bool stream_is_created(const void *stream) {
        return stream && (CUstream)stream != CU_STREAM_LEGACY && (CUstream)stream != CU_STREAM_PER_THREAD;
}

/*
 * Waits for the work queued on `stream` (cuStreamSynchronize), or for all the work of the context when
 * `whole_context` (cuCtxSynchronize). A created stream is waited for as it is, in any thread: the driver finds
 * its context from it (measured on an H200: from a thread with no current context, a stream of the primary
 * context and one of another context both synchronized), so a thread with no context retains none for it (a
 * retain would create the primary context when it is not active, about 0.2 s). The context's own work (whole,
 * or a stream that names the context's) is waited for in the context context_hold() gives: nothing when there
 * is no context, none current and the primary one not active. Returns the driver's result.
 */
static CUresult wait_queued(CudaDriver *cu, int device, void *stream, bool whole_context) {
        CUcontext primary = NULL;
        CUdevice dev = 0;
        bool none = false;
        CUresult r;

        if (!whole_context && stream_is_created(stream))
                return cu->cuStreamSynchronize((CUstream)stream);
        r = context_hold(cu, device, &primary, &dev, &none);
        if (r == CUDA_SUCCESS && !none)
                r = whole_context ? cu->cuCtxSynchronize() : cu->cuStreamSynchronize((CUstream)stream);
        context_drop(cu, primary, dev);
        return r;
}

/* Waits for `stream` (wait_queued()), then frees as vmmb_free() does. When the wait fails, the lease is left as
 * it was: unmapping could fault work that may still run. */
VMMB_EXPORT int vmmb_free_stream(vmmb_lease *lease, void *stream) {
        CudaDriver *cu = NULL;
        CUresult r;
        int k;

        if (!lease)
                return 0;
        k = driver_get(&cu);            /* loaded already: the lease was mapped with it */
        if (k < 0)
                return k;
        r = wait_queued(cu, lease->device, stream, false);
        if (r != CUDA_SUCCESS)
                return set_error(cuda_result_to_errno(r), "Cannot wait for the work queued on stream %p before "
                                 "freeing lease %s: %s. The lease is left as it was, mapped and held.", stream,
                                 lease->id, cuda_result_name(cu, r));
        return vmmb_free(lease);
}

/* --- parking ---------------------------------------------------------------------------------------------- */

/*
 * Unpark, then maps the slabs of the reply back to back at l->va (the range kept reserved), with l's access:
 * read-only or not, for its device and every peer given access. The layout may differ from the one the lease
 * was mapped with (the broker makes fresh slabs), never the total. On failure the lease stays parked here; a
 * later Unpark of a lease the broker thinks mapped returns the same slabs, so calling this again recovers it.
 */
static int lease_unpark(vmmb_lease *l) {
        _cleanup_(received_fds_done) ReceivedFds fds = {};
        _cleanup_(json_putp) json_object *params = NULL;
        _cleanup_free_ CUdevice *devices = NULL;
        _cleanup_free_ uint64_t *sizes = NULL;
        _cleanup_free_ char *message = NULL;
        _cleanup_free_ int *ordered = NULL;
        FreeParams p = { .id = l->id };
        vmmb_client *c = l->client;
        VarlinkReply reply = {};
        AllocReply ar = {};
        CudaDriver *cu = NULL;
        uint64_t total = 0;
        size_t n_devices;
        int k;

        k = driver_get(&cu);            /* loaded already: the lease was mapped with it */
        if (k < 0)
                return k;
        k = free_params_encode(&p, &params);
        if (k < 0)
                return set_error(k, "Cannot encode the call to unpark lease %s: %s.", l->id, strerror(-k));
        k = client_call(c, VMMB_METHOD_UNPARK, params, &reply, &fds);
        if (k < 0)
                return k;
        k = alloc_reply_decode(reply.parameters, fds.n, &ar, &message);
        varlink_reply_done(&reply);
        if (k < 0)
                return set_error_from(k == -ENOMEM ? k : -EPROTO, "The broker's reply to Unpark is not valid", message);

        sizes = calloc(ar.lease.n_slabs ?: 1, sizeof(uint64_t));
        ordered = calloc(ar.lease.n_slabs ?: 1, sizeof(int));
        (void)pthread_mutex_lock(&c->leases_lock);
        n_devices = 1 + l->n_peers;
        devices = calloc(n_devices, sizeof(CUdevice));
        if (devices) {
                devices[0] = l->device;
                for (size_t i = 0; i < l->n_peers; i++)
                        devices[1 + i] = l->peers[i];
        }
        (void)pthread_mutex_unlock(&c->leases_lock);
        if (!sizes || !ordered || !devices) {
                k = set_error(-ENOMEM, "Out of memory.");
                goto out;
        }
        for (size_t i = 0; i < ar.lease.n_slabs; i++) {
                ordered[i] = fds.fds[ar.lease.slabs[i].fd];
                sizes[i] = ar.lease.slabs[i].size;
                total += sizes[i];
        }
        if (strcmp(ar.lease.id, l->id) != 0 || ar.lease.device != l->device || ar.lease.n_slabs == 0 ||
            total != l->size) {
                k = set_error(-EPROTO, "The broker's reply to Unpark is not valid: lease %s of %" PRIu64 " bytes in "
                              "%zu slabs on device %" PRId64 ", for lease %s of %" PRIu64 " bytes on device %d.",
                              ar.lease.id, total, ar.lease.n_slabs, ar.lease.device, l->id, l->size, l->device);
                goto out;
        }
        k = cuda_map_fds_at(cu, devices, n_devices, ordered, sizes, ar.lease.n_slabs, l->readonly, l->va,
                            &message);
        if (k < 0) {
                (void)set_error_from(k, "Cannot map the unparked memory again", message);
                goto out;
        }
        (void)pthread_mutex_lock(&c->leases_lock);
        free(l->sizes);
        l->sizes = TAKE_PTR(sizes);
        l->n_slabs = ar.lease.n_slabs;
        l->parked = false;
        (void)pthread_mutex_unlock(&c->leases_lock);
        k = 0;
out:
        alloc_reply_done(&ar);
        return k;
}

/*
 * Whether the broker serves Park and Unpark, asked once per connection (GetInterfaceDescription) before the
 * first park unmaps anything: a broker older than parking could not give the slabs back to map again, and
 * the lease would stay unmapped. Returns 1 or 0, or a negative errno with the message set.
 */
static int client_parks(vmmb_client *c) {
        _cleanup_(json_putp) json_object *params = NULL;
        _cleanup_free_ char *message = NULL;
        InterfaceParams p = { .interface = (char *)VMMB_INTERFACE };
        InterfaceDescription d = {};
        VarlinkReply reply = {};
        int k = __atomic_load_n(&c->parks, __ATOMIC_RELAXED);

        if (k >= 0)
                return k;
        k = interface_params_encode(&p, &params);
        if (k < 0)
                return set_error(k, "Cannot encode the call GetInterfaceDescription: %s.", strerror(-k));
        k = client_call(c, VARLINK_METHOD_GET_INTERFACE_DESCRIPTION, params, &reply, NULL);
        if (k < 0)
                return k;
        k = interface_description_decode(reply.parameters, &d, &message);
        varlink_reply_done(&reply);
        if (k < 0)
                return set_error_from(k == -ENOMEM ? k : -EPROTO, "The broker's interface description is not "
                                      "valid", message);
        k = strstr(d.description, "\nmethod Park(") && strstr(d.description, "\nmethod Unpark(");
        interface_description_done(&d);
        __atomic_store_n(&c->parks, k, __ATOMIC_RELAXED);
        return k;
}

/*
 * Marks a lease parked here (and parked once, for vmmb_free_keep()), once no reclaim callback of it runs; fails
 * for one given back, or parked already. Returns 0 or a negative errno with the message set.
 */
static int lease_begin_park(vmmb_lease *l) {
        vmmb_client *c = l->client;
        int k = 0;

        (void)pthread_mutex_lock(&c->leases_lock);
        if (l->reclaiming && reclaim_running == l)
                k = set_error(-EDEADLK, "vmmb_lease_park() of lease %s from its own reclaim callback.", l->id);
        while (k == 0 && (l->reclaiming || l->readers > 0))
                (void)pthread_cond_wait(&c->reclaim_done, &c->leases_lock);
        if (k == 0 && l->reclaimed)
                k = set_error(-ESTALE, "Lease %s was given back on the broker's request.", l->id);
        else if (k == 0 && l->parked)
                k = set_error(-EALREADY, "Lease %s is parked already.", l->id);
        else if (k == 0)
                l->parked = l->was_parked = true;
        (void)pthread_mutex_unlock(&c->leases_lock);
        return k;
}

VMMB_EXPORT int vmmb_lease_park(vmmb_lease *lease, void *stream) {
        _cleanup_(json_putp) json_object *params = NULL;
        _cleanup_free_ char *message = NULL;
        FreeParams p = {};
        VarlinkReply reply = {};
        ParkReply pr = {};
        CudaDriver *cu = NULL;
        char saved[ERROR_MESSAGE_MAX], why[ERROR_MESSAGE_MAX];
        CUresult r;
        int k;

        if (!lease)
                return set_error(-EINVAL, "vmmb_lease_park() needs a lease.");
        k = driver_get(&cu);            /* loaded already: the lease was mapped with it */
        if (k < 0)
                return k;
        p.id = lease->id;
        k = free_params_encode(&p, &params);
        if (k < 0)
                return set_error(k, "Cannot encode the call to park lease %s: %s.", lease->id, strerror(-k));
        k = client_parks(lease->client);
        if (k == 0)
                return set_error(-EOPNOTSUPP, "The broker does not park leases (it has no Park): update it. "
                                 "Lease %s is left as it was, mapped.", lease->id);
        if (k < 0)
                return k;
        k = lease_begin_park(lease);
        if (k < 0)
                return k;

        r = wait_queued(cu, lease->device, stream, !stream);
        if (r != CUDA_SUCCESS) {
                lease_set_flag(lease, &lease->parked, false);
                return set_error(cuda_result_to_errno(r), "Cannot wait for the work queued %s%p before parking "
                                 "lease %s: %s. The lease is left as it was, mapped.", stream ? "on stream " :
                                 "in the context, stream ", stream, lease->id, cuda_result_name(cu, r));
        }
        k = cuda_unmap_slabs(cu, lease->va, lease->sizes, lease->n_slabs);
        if (k < 0)
                return set_error(k, "Cannot unmap lease %s at 0x%llx to park it: %s. Some of it may still be "
                                 "mapped; vmmb_free() it.", lease->id, (unsigned long long)lease->va,
                                 strerror(-k));

        k = client_call(lease->client, VMMB_METHOD_PARK, params, &reply, NULL);
        if (k < 0) {
                /* The broker did not park it (or may have: a lost connection): the same slabs, or fresh ones
                 * with the content, come back with Unpark, mapped where they were. */
                memcpy(saved, error_message, sizeof(saved));
                if (lease_unpark(lease) >= 0)
                        return set_error(k, "%s The lease is mapped again, as before.", saved);
                memcpy(why, error_message, sizeof(why));
                return set_error(k, "%s The lease is left parked here (unmapped, its address kept), and mapping "
                                 "it again failed: %s vmmb_lease_unpark() maps it again.", saved, why);
        }
        k = park_reply_decode(reply.parameters, &pr, &message);
        varlink_reply_done(&reply);
        if (k < 0)
                return set_error_from(k == -ENOMEM ? k : -EPROTO, "The broker's reply to Park is not valid (the "
                                      "lease is parked here: vmmb_lease_unpark() maps it again)", message);
        if (pr.parked)
                /* Its content went into host memory, which ended its reclaimable mark in the broker: not
                 * marked here either, so the watch neither marks it again after a restart nor answers a
                 * request the broker sent before the park (it forgot that ask). */
                lease_set_flag(lease, &lease->reclaimable, false);
        return pr.parked ? 1 : 0;
}

VMMB_EXPORT int vmmb_lease_unpark(vmmb_lease *lease) {
        vmmb_client *c;
        int k = 0;

        if (!lease)
                return set_error(-EINVAL, "vmmb_lease_unpark() needs a lease.");
        c = lease->client;
        (void)pthread_mutex_lock(&c->leases_lock);
        if (lease->reclaimed)
                k = set_error(-ESTALE, "Lease %s was given back on the broker's request.", lease->id);
        else if (!lease->parked)
                k = set_error(-EALREADY, "Lease %s is not parked: it is mapped at 0x%llx.", lease->id,
                              (unsigned long long)lease->va);
        (void)pthread_mutex_unlock(&c->leases_lock);
        if (k < 0)
                return k;
        return lease_unpark(lease);
}

VMMB_EXPORT int vmmb_lease_parked(const vmmb_lease *lease) {
        return lease && lease_flag(lease, &lease->parked);
}

VMMB_EXPORT uint64_t vmmb_lease_ptr(const vmmb_lease *lease) {
        return lease ? (uint64_t)lease->va : 0;
}

VMMB_EXPORT uint64_t vmmb_lease_size(const vmmb_lease *lease) {
        return lease ? lease->size : 0;
}

VMMB_EXPORT int vmmb_lease_device(const vmmb_lease *lease) {
        return lease ? lease->device : -1;
}

VMMB_EXPORT const char *vmmb_lease_id(const vmmb_lease *lease) {
        return lease ? lease->id : NULL;
}

VMMB_EXPORT uid_t vmmb_lease_owner(const vmmb_lease *lease) {
        return lease ? lease->owner : (uid_t)-1;
}

VMMB_EXPORT const char *vmmb_lease_owner_name(const vmmb_lease *lease) {
        return lease ? lease->owner_name : NULL;
}

/* Whether `device` is in the list. */
static bool devices_contain(const CUdevice *list, size_t n, int device) {
        for (size_t i = 0; i < n; i++)
                if (list[i] == device)
                        return true;
        return false;
}

/*
 * One cuMemSetAccess for the lease's own device (its access as it was mapped) and each other device named,
 * once each, after cuDeviceCanAccessPeer said yes for every one of them: a refusal changes nothing.
 */
VMMB_EXPORT int vmmb_lease_grant_access(vmmb_lease *lease, const int *devices, size_t n) {
        _cleanup_free_ CUdevice *list = NULL;
        CudaDriver *cu = NULL;
        vmmb_client *c;
        int count = 0, k;
        size_t m = 0;
        int *peers;
        CUresult r;

        if (!lease)
                return set_error(-EINVAL, "No lease to give access to.");
        if (n > VMMB_ACCESS_MAX)
                return set_error(-EINVAL, "Access for %zu devices asked for lease %s: at most %d.", n, lease->id,
                                 VMMB_ACCESS_MAX);
        if (n > 0 && !devices)
                return set_error(-EINVAL, "No list of devices for lease %s.", lease->id);
        k = driver_get(&cu);            /* loaded already: the lease was mapped with it */
        if (k < 0)
                return k;
        r = cu->cuDeviceGetCount(&count);
        if (r != CUDA_SUCCESS)
                return set_error(cuda_result_to_errno(r), "Cannot count the CUDA devices: %s.",
                                 cuda_result_name(cu, r));
        list = calloc(n + 1, sizeof(*list));
        if (!list)
                return set_error(-ENOMEM, "Out of memory.");
        list[m++] = lease->device;
        for (size_t i = 0; i < n; i++) {
                int can = 0;

                if (devices[i] < 0 || devices[i] >= count)
                        return set_error(-ENODEV, "No CUDA device %d to give access to lease %s: the driver reports "
                                         "%d device%s here.", devices[i], lease->id, count, count == 1 ? "" : "s");
                if (devices_contain(list, m, devices[i]))
                        continue;
                r = cu->cuDeviceCanAccessPeer(&can, devices[i], lease->device);
                if (r != CUDA_SUCCESS)
                        return set_error(cuda_result_to_errno(r), "Cannot ask whether device %d can access device "
                                         "%d's memory: %s.", devices[i], lease->device, cuda_result_name(cu, r));
                if (!can)
                        return set_error(-EOPNOTSUPP, "Device %d cannot access device %d's memory "
                                         "(cuDeviceCanAccessPeer says no): lease %s stays as it was, usable on "
                                         "device %d.", devices[i], lease->device, lease->id, lease->device);
                list[m++] = devices[i];
        }
        if (m == 1)
                return 0;               /* nothing but its own device, which has its access */

        c = lease->client;
        (void)pthread_mutex_lock(&c->leases_lock);
        k = lease_not_given_back(lease);
        if (k < 0) {
                (void)pthread_mutex_unlock(&c->leases_lock);
                return k;
        }
        peers = realloc(lease->peers, (lease->n_peers + m - 1) * sizeof(int));
        if (!peers) {
                (void)pthread_mutex_unlock(&c->leases_lock);
                return set_error(-ENOMEM, "Out of memory.");
        }
        lease->peers = peers;
        /* a parked lease has nothing mapped: vmmb_lease_unpark() gives the access it maps again with */
        r = lease->parked ? CUDA_SUCCESS : cuda_set_access(cu, lease->va, lease->size, list, m, lease->readonly);
        if (r == CUDA_SUCCESS)
                for (size_t i = 1; i < m; i++) {
                        bool known = false;

                        for (size_t j = 0; j < lease->n_peers; j++)
                                known = known || lease->peers[j] == list[i];
                        if (!known)
                                lease->peers[lease->n_peers++] = list[i];
                }
        (void)pthread_mutex_unlock(&c->leases_lock);
        if (r != CUDA_SUCCESS)
                return set_error(cuda_result_to_errno(r), "Cannot give %zu device%s access to lease %s of device %d: "
                                 "%s.", m - 1, m == 2 ? "" : "s", lease->id, lease->device, cuda_result_name(cu, r));
        return 0;
}

VMMB_EXPORT int vmmb_lease_readonly(const vmmb_lease *lease) {
        return lease && lease->readonly ? 1 : 0;
}

/*
 * One synchronous cuMemcpyDtoH, in the context context_hold() gives, counted in the lease's `readers`: nothing
 * unmaps the lease while the copy reads it (the watch thread's give-back, another thread's park or free wait
 * for it), and leases_lock is not held across the copy, which waits for whatever the legacy default stream
 * has queued: the client's other leases, and the watch's answers for them, do not wait for it.
 */
VMMB_EXPORT int vmmb_lease_read(vmmb_lease *lease, uint64_t offset, void *buf, size_t n) {
        CUcontext primary = NULL;
        CudaDriver *cu = NULL;
        CUdevice dev = 0;
        vmmb_client *c;
        CUresult r;
        int k;

        if (!lease)
                return set_error(-EINVAL, "vmmb_lease_read() needs a lease.");
        if (n > 0 && !buf)
                return set_error(-EINVAL, "vmmb_lease_read() needs a buffer for the %zu bytes of lease %s.", n,
                                 lease->id);
        if (offset > lease->size || n > lease->size - offset)
                return set_error(-ERANGE, "Cannot read %zu bytes at offset %llu of lease %s: it has %llu bytes.", n,
                                 (unsigned long long)offset, lease->id, (unsigned long long)lease->size);
        if (n == 0)
                return 0;
        k = driver_get(&cu);            /* loaded already: the lease was mapped with it */
        if (k < 0)
                return k;
        c = lease->client;
        (void)pthread_mutex_lock(&c->leases_lock);
        k = lease_not_given_back(lease);
        if (k == 0 && lease->parked)
                k = set_error(-ENXIO, "Lease %s is parked (nothing is mapped here): vmmb_lease_unpark() maps it "
                              "again.", lease->id);
        if (k == 0)
                lease->readers++;
        (void)pthread_mutex_unlock(&c->leases_lock);
        if (k < 0)
                return k;

        r = context_hold(cu, lease->device, &primary, &dev, NULL);
        if (r == CUDA_SUCCESS)
                r = cu->cuMemcpyDtoH(buf, lease->va + offset, n);
        context_drop(cu, primary, dev);
        if (r != CUDA_SUCCESS)
                k = set_error(cuda_result_to_errno(r), "Cannot read %zu bytes of lease %s: %s.", n, lease->id,
                              cuda_result_name(cu, r));

        (void)pthread_mutex_lock(&c->leases_lock);
        if (--lease->readers == 0)
                (void)pthread_cond_broadcast(&c->reclaim_done);
        (void)pthread_mutex_unlock(&c->leases_lock);
        return k;
}

VMMB_EXPORT const char *vmmb_error_message(void) {
        return error_message;
}
