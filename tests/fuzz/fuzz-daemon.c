/* SPDX-License-Identifier: MIT */

/*
 * libFuzzer target over the daemon's framing and request dispatch.
 *
 * The real daemon code (daemon/ and proto/, as vmmbrokerd links them) runs in
 * this process on the simulated device (tests/simcuda). For each input, a
 * socketpair stands for an accepted connection: peer_new() takes one end, the
 * fuzzer writes the input's bytes to the other and reads the replies, and the
 * manager's sd-event loop runs with a timeout of 0 until nothing is pending.
 * The process itself is the client, so the daemon's peer is this process (its
 * pid, uid and a pidfd of its own).
 *
 * Input: a 4-byte header, then the bytes the client sends.
 *
 *   byte 0    flags (FLAG_* below): session mode, fds, a client that goes silent or never
 *             reads, an administrator, a user already at its MaxConnections=
 *   bytes 1-3 stream mode: where to cut the payload into up to 4 writes, each
 *             byte a fraction (n/256) of the payload's length
 *
 * Stream mode writes the payload as it is, in those pieces; session mode
 * writes one message (up to and including its NUL) at a time, waits for the
 * daemon to settle and reads its replies, and replaces "$L0".."$L3" in a
 * message with the identifiers of the last leases the replies carried (most
 * recent first) and "$T0".."$T3" with the last tokens, so that Free, Share,
 * Attach, Publish and Revoke reach past "no such lease".
 *
 * Checked after every input (abort() on failure, which libFuzzer reports as a
 * crash):
 *   - the text readers (json_dispatch_text(), varlink_*_parse_text(), the
 *     codec's *_decode_text()) read every message sent and every reply as the
 *     json-c path does (differential.h): the same contents or the same error;
 *   - every reply is a strict JSON object and a varlink reply envelope, its
 *     error (if any) is named in io.vmmbroker or org.varlink.service, and its
 *     parameters decode with the client's own decoders (proto/codec.c); fds
 *     come only with a lease, one per slab;
 *   - the daemon never closes the connection inside a reply, and never queues
 *     more than one reply's worth of output (64 KiB here) for a connection;
 *   - the event loop settles (no busy loop) and, once the client has closed,
 *     the peer is gone;
 *   - after the input's holder is reclaimed (as if this process had exited),
 *     no lease, holder or user is left, the pool is back to its starting
 *     state, and the process has exactly as many fds open as before the input
 *     (LeakSanitizer checks memory).
 */

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "codec.h"
#include "config.h"
#include "differential.h"
#include "fdpass.h"
#include "json.h"
#include "macro.h"
#include "manager.h"
#include "metrics.h"
#include "peer.h"
#include "varlink.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#ifndef SIMCUDA_PATH
#error "SIMCUDA_PATH must name the simulated libcuda.so.1"
#endif

enum {
        FLAG_SESSION = 1 << 0,          /* one message at a time, with $Ln/$Tn substitution */
        FLAG_FD_FIRST = 1 << 1,         /* one fd (SCM_RIGHTS) with the first write */
        FLAG_FD_LATER = 1 << 2,         /* FDPASS_MAX_FDS fds with the second write */
        FLAG_SILENCE = 1 << 3,          /* never shut down the write side: close the socket when idle */
        FLAG_NO_READ = 1 << 4,          /* never read a reply */
        FLAG_ADMIN = 1 << 5,            /* the client is an administrator (else not, even as root) */
        FLAG_CROWD = 1 << 6,            /* CROWD other connections of the user are open: over MaxConnections= */
};

#define HEADER_SIZE 4
#define CROWD 2                         /* MaxConnections= in the configuration below */
#define REMEMBERED 4                    /* lease identifiers and tokens kept for substitution */
#define PUMP_MAX 100000                 /* event loop iterations before "it never settles" */
#define POOL_WAIT_SECONDS 10            /* longest wait for host slabs being made or a copy (pump()) */
#define PENDING_MAX (64U * 1024U)        /* output the daemon may queue for one connection (one reply) */
#define REMEMBER_MAX 64                 /* longest identifier or token kept (VMMB_ID_MAX, VMMB_TOKEN_MAX) */

#define die(...)                                                                                \
        do {                                                                                    \
                fprintf(stderr, "fuzz-daemon: " __VA_ARGS__);                                  \
                fputc('\n', stderr);                                                            \
                abort();                                                                        \
        } while (0)

static bool trace;                      /* $FUZZ_DAEMON_TRACE: print what is sent and answered */
static Config config;
static Manager *manager;
static int devnull = -EBADF;
static unsigned baseline_fds;
static PoolDeviceStats baseline_stats[8];
static size_t n_devices;

typedef struct Client {
        VarlinkConn *conn;              /* the client's end: reads replies; writes go to the fd directly */
        int fd;
        bool reading;
        bool eof;                       /* the daemon closed its end */
        bool write_closed;              /* the daemon no longer reads, or we shut down */
        size_t replies;
        char leases[REMEMBERED][REMEMBER_MAX + 1];
        char tokens[REMEMBERED][REMEMBER_MAX + 1];
} Client;

/*
 * The fds open, but pipes: the sanitizers' runtime keeps pipes to llvm-symbolizer once it has symbolized
 * something (libFuzzer's NEW_FUNC lines), and nothing the daemon runs makes a pipe.
 */
static unsigned count_fds(void) {
        DIR *d = opendir("/proc/self/fd");
        struct dirent *de;
        unsigned n = 0;

        if (!d)
                die("cannot open /proc/self/fd: %m");
        while ((de = readdir(d))) {
                char path[300], target[64];
                ssize_t k;

                if (de->d_name[0] == '.' || atoi(de->d_name) == dirfd(d))
                        continue;
                snprintf(path, sizeof(path), "/proc/self/fd/%s", de->d_name);
                k = readlink(path, target, sizeof(target) - 1);
                target[k < 0 ? 0 : k] = 0;
                if (strncmp(target, "pipe:", 5) != 0)
                        n++;
        }
        closedir(d);
        return n;
}

/* Says what each open fd is, for a report. */
static void dump_fds(void) {
        DIR *d = opendir("/proc/self/fd");
        struct dirent *de;

        if (!d)
                return;
        while ((de = readdir(d))) {
                char path[300], target[256];
                ssize_t n;

                if (de->d_name[0] == '.')
                        continue;
                snprintf(path, sizeof(path), "/proc/self/fd/%s", de->d_name);
                n = readlink(path, target, sizeof(target) - 1);
                target[n < 0 ? 0 : n] = 0;
                fprintf(stderr, "fd %s: %s\n", de->d_name, target);
        }
        closedir(d);
}

static void remember(char list[REMEMBERED][REMEMBER_MAX + 1], const char *s) {
        if (!s || strlen(s) > REMEMBER_MAX)
                return;
        memmove(list[1], list[0], (REMEMBERED - 1) * sizeof(list[0]));
        snprintf(list[0], sizeof(list[0]), "%s", s);
}

static bool has_key(json_object *o, const char *key) {
        return o && json_object_object_get_ex(o, key, NULL);
}

/* Checks one reply and learns the lease identifiers and tokens it carries. */
static void check_reply(Client *cl, json_object *msg, const int *fds, size_t n_fds) {
        _cleanup_free_ char *message = NULL;
        VarlinkReply reply = {};
        json_object *p;
        int k;

        if (trace)
                fprintf(stderr, "< %.300s%s\n", json_object_to_json_string(msg), n_fds > 0 ? " (with fds)" : "");
        if (varlink_reply_parse(msg, &reply) < 0)
                die("the daemon sent a message that is not a varlink reply: %s", json_object_to_json_string(msg));
        p = reply.parameters;
        if (reply.continues) {
                /* Only WatchReclaim (called with more) is answered so: its first reply and its requests. */
                ReclaimRequest q = {};

                if (reply.error || n_fds > 0)
                        die("a continued reply is an error or came with fds: %s", json_object_to_json_string(msg));
                k = reclaim_request_decode(p, &q, &message);
                if (k < 0)
                        die("a continued reply is not a reclaim request: %s (%s)", strerror(-k), message ?: "");
                reclaim_request_done(&q);
                varlink_reply_done(&reply);
                return;
        }
        if (reply.error) {
                VmmbError e = {};

                if (strncmp(reply.error, VMMB_INTERFACE ".", strlen(VMMB_INTERFACE) + 1) != 0 &&
                    strncmp(reply.error, VARLINK_SERVICE_INTERFACE ".", strlen(VARLINK_SERVICE_INTERFACE) + 1) != 0)
                        die("error %s is in neither interface", reply.error);
                if (n_fds > 0)
                        die("error %s came with %zu fds", reply.error, n_fds);
                k = vmmb_error_decode(reply.error, p, &e, &message);
                if (k < 0)
                        die("error %s does not decode: %s (%s)", reply.error, strerror(-k), message ?: "");
                vmmb_error_done(&e);
        } else if (has_key(p, "lease")) {
                AllocReply a = {};

                k = alloc_reply_decode(p, n_fds, &a, &message);
                if (k < 0)
                        die("a lease reply does not decode: %s (%s)", strerror(-k), message ?: "");
                if (a.lease.n_slabs != n_fds)
                        die("a lease of %zu slabs came with %zu fds", a.lease.n_slabs, n_fds);
                remember(cl->leases, a.lease.id);
                alloc_reply_done(&a);
        } else {
                if (n_fds > 0)
                        die("a reply without a lease came with %zu fds", n_fds);
                if (has_key(p, "token")) {
                        ShareReply s = {};

                        k = share_reply_decode(p, &s, &message);
                        if (k == 0)
                                remember(cl->tokens, s.token);
                        share_reply_done(&s);
                } else if (has_key(p, "tokens")) {
                        TokensReply t = {};

                        k = tokens_reply_decode(p, &t, &message);
                        tokens_reply_done(&t);
                } else if (has_key(p, "leases")) {
                        ListReply l = {};

                        k = list_reply_decode(p, &l, &message);
                        list_reply_done(&l);
                } else if (has_key(p, "users")) {
                        UsersReply u = {};

                        k = users_reply_decode(p, &u, &message);
                        users_reply_done(&u);
                } else if (has_key(p, "devices")) {
                        StatusReply s = {};

                        k = status_reply_decode(p, &s, &message);
                        status_reply_done(&s);
                } else if (has_key(p, "description")) {
                        InterfaceDescription d = {};

                        k = interface_description_decode(p, &d, &message);
                        interface_description_done(&d);
                } else if (has_key(p, "vendor")) {
                        VarlinkInfo v = {};

                        k = varlink_info_decode(p, &v, &message);
                        varlink_info_done(&v);
                } else if (has_key(p, "kept")) {
                        FreeReply f = {};

                        k = free_reply_decode(p, &f, &message);
                        free_reply_done(&f);
                } else if (has_key(p, "parked")) {
                        ParkReply pr = {};

                        k = park_reply_decode(p, &pr, &message);
                        park_reply_done(&pr);
                } else if (has_key(p, "text")) {
                        MetricsReply m = {};

                        k = metrics_reply_decode(p, &m, &message);
                        metrics_reply_done(&m);
                } else
                        k = empty_params_decode(p, NULL, &message);
                if (k < 0)
                        die("a reply does not decode: %s (%s): %s", strerror(-k), message ?: "",
                            json_object_to_json_string(msg));
        }
        varlink_reply_done(&reply);
        cl->replies++;
}

/* Takes every reply the socket has. Returns the bytes read. */
static size_t client_drain(Client *cl) {
        size_t total = 0;

        bool reset = false;

        if (!cl || !cl->reading || cl->eof)
                return 0;
        for (;;) {
                json_object *msg = NULL;
                _cleanup_free_ int *fds = NULL;
                const char *text, *why;
                size_t n_fds = 0, len;
                int k;

                k = varlink_conn_next(cl->conn, &text, &len, &fds, &n_fds);
                if (k > 0) {
                        /* the client's text readers read the reply as its json-c readers do */
                        why = differential_check(text, len);
                        if (why)
                                die("the text and json-c readers differ (%s) on the reply: %.*s", why,
                                    (int)MIN(len, (size_t)400), text);
                        if (json_parse_message(text, len, &msg) < 0)
                                die("the daemon sent a bad message: %s", strerror(EBADMSG));
                        check_reply(cl, msg, fds, n_fds);
                        close_many(fds, n_fds);
                        json_object_put(msg);
                        continue;
                }
                if (k == -ECONNRESET)
                        die("the daemon closed the connection inside a reply");
                if (k < 0)
                        die("the daemon sent a bad message: %s", strerror(-k));
                k = varlink_conn_read(cl->conn);
                if (k == -EAGAIN)
                        return total;
                if (k == 0) {
                        cl->eof = true;
                        return total;
                }
                if (k == -ECONNRESET && !reset) {
                        /* The daemon closed its end with our bytes unread: the kernel says so once, then
                         * gives the end of the stream (which must not be inside a reply). */
                        reset = true;
                        continue;
                }
                if (k == -ECONNRESET)
                        die("the daemon closed the connection inside a reply");
                if (k < 0)
                        die("reading the daemon's replies: %s", strerror(-k));
                total += (size_t)k;
        }
}

/*
 * The daemon holds at most one reply per connection, and the fuzzer's replies are all under 64 KiB (the
 * interface description is the largest): more queued means output piling up for a client that does not read.
 */
static void check_pending(void) {
        Peer *p;

        list_for_each_entry(p, &manager->peers, link)
                if (varlink_conn_pending(p->conn) > PENDING_MAX)
                        die("the daemon has %zu bytes queued for one connection", varlink_conn_pending(p->conn));
}

/*
 * Waits, at most POOL_WAIT_SECONDS, for the pool's eventfd to become readable. A signal may cut poll() short:
 * libFuzzer's SIGALRM, which checks -timeout= every few seconds, comes at any time. Such a poll() is made
 * again for what is left of the wait, rather than taken for a wait that never ended.
 */
static void pool_event_wait(void) {
        struct pollfd pfd = { .fd = pool_get_fd(manager->pool), .events = POLLIN };
        uint64_t end = metrics_clock() + (uint64_t)POOL_WAIT_SECONDS * 1000000;

        for (;;) {
                uint64_t now = metrics_clock();
                int k;

                if (now >= end)
                        die("a call waited %d s for the pool: host slabs being made, or a copy", POOL_WAIT_SECONDS);
                k = poll(&pfd, 1, (int)((end - now + 999) / 1000));
                if (k == 1)
                        return;
                if (k < 0 && errno != EINTR)
                        die("poll() on the pool's eventfd: %s", strerror(errno));
        }
}

/* Runs the event loop and reads replies until neither has anything left. Returns whether anything happened. */
static bool pump(Client *cl) {
        bool any = false;

        for (unsigned i = 0;; i++) {
                size_t got;
                int k;

                if (i >= PUMP_MAX)
                        die("the event loop does not settle after %u iterations", PUMP_MAX);
                k = sd_event_run(manager->event, 0);
                if (k < 0)
                        die("sd_event_run: %s", strerror(-k));
                check_pending();
                got = client_drain(cl);
                if (k == 0 && got == 0 && !list_is_empty(&manager->broker.host_waiters)) {
                        /* A call waits for host slabs that the pool's maker thread makes, or that a device's
                         * stream zeroes, or for a copy: the loop hears of each through the pool's eventfd. */
                        pool_event_wait();
                        any = true;
                        continue;
                }
                if (k == 0 && got == 0)
                        return any;
                any = true;
        }
}

/* One sendmsg(), with `n_fds` copies of /dev/null when asked. Returns bytes sent or a negative errno. */
static ssize_t client_send(Client *cl, const uint8_t *buf, size_t len, size_t n_fds) {
        int fds[FDPASS_MAX_FDS];

        for (size_t i = 0; i < n_fds; i++)
                fds[i] = devnull;
        return fd_send(cl->fd, buf, len, fds, n_fds);
}

/* Writes all of buf (fds on its first byte), running the daemon whenever the socket is full. */
static void client_write(Client *cl, const uint8_t *buf, size_t len, size_t n_fds) {
        size_t off = 0;

        if (trace)
                fprintf(stderr, "> %.*s%s%s\n", (int)MIN(len, 300), (const char *)buf, len > 300 ? "..." : "",
                        n_fds > 0 ? " (with fds)" : "");
        while (off < len && !cl->write_closed) {
                ssize_t n = client_send(cl, buf + off, len - off, n_fds);

                if (n > 0) {
                        off += (size_t)n;
                        n_fds = 0;
                } else if (n == -EAGAIN) {
                        /* The daemon reads nothing more, e.g. while a reply waits for us and we do not read. */
                        if (!pump(cl))
                                cl->write_closed = true;
                } else if (n == -EPIPE || n == -ECONNRESET)
                        cl->write_closed = true;        /* the daemon closed the connection */
                else
                        die("sendmsg: %s", strerror((int)-n));
        }
        pump(cl);
}

/* The message with $Ln and $Tn replaced. */
static uint8_t *substitute(const Client *cl, const uint8_t *in, size_t len, size_t *ret_len) {
        size_t alloc = len + 1, n = 0;
        uint8_t *out = malloc(alloc);

        if (!out)
                die("out of memory");
        for (size_t i = 0; i < len; i++) {
                const char *value = NULL;

                if (in[i] == '$' && i + 2 < len && (in[i + 1] == 'L' || in[i + 1] == 'T') && in[i + 2] >= '0' &&
                    in[i + 2] < '0' + REMEMBERED) {
                        value = in[i + 1] == 'L' ? cl->leases[in[i + 2] - '0'] : cl->tokens[in[i + 2] - '0'];
                        if (!value[0])
                                value = NULL;
                }
                if (value) {
                        size_t vl = strlen(value);

                        if (n + vl + (len - i) > alloc) {
                                alloc = n + vl + (len - i) + 64;
                                out = realloc(out, alloc);
                                if (!out)
                                        die("out of memory");
                        }
                        memcpy(out + n, value, vl);
                        n += vl;
                        i += 2;
                } else
                        out[n++] = in[i];
        }
        *ret_len = n;
        return out;
}

static void check_pool(const char *when) {
        for (size_t i = 0; i < n_devices; i++) {
                PoolDeviceStats s;

                pool_device_stats(manager->pool, i, &s);
                if (s.n_leased != 0 || s.leased != 0 || s.n_scrubbing != 0 || s.scrubbing != 0 ||
                    s.n_cached != baseline_stats[i].n_cached || s.cached != baseline_stats[i].cached)
                        die("%s: device %d has %u slabs leased (%llu bytes), %u scrubbing, %u cached (%llu bytes); "
                            "it started with %u cached (%llu bytes)",
                            when, s.index, s.n_leased, (unsigned long long)s.leased, s.n_scrubbing, s.n_cached,
                            (unsigned long long)s.cached, baseline_stats[i].n_cached,
                            (unsigned long long)baseline_stats[i].cached);
                /* host memory for parked leases: none holds a lease, and the cache is as it started */
                if (s.parked != 0 || s.host_scrubbing != 0 || s.host_cached != baseline_stats[i].host_cached)
                        die("%s: device %d has %llu bytes of host memory parked, %llu scrubbing, %llu cached; "
                            "it started with %llu cached",
                            when, s.index, (unsigned long long)s.parked, (unsigned long long)s.host_scrubbing,
                            (unsigned long long)s.host_cached, (unsigned long long)baseline_stats[i].host_cached);
        }
}

/*
 * What the daemon does when this process exits, and then some: every holder is handled as exited
 * (holder_exited() and broker_reap_holders(), as the daemon does for a dead process), published leases ended, scrubs
 * waited for and the cache emptied, so that each input starts from the same state.
 */
static void reset(void) {
        Holder *h, *htmp;
        Lease *l, *ltmp;

        list_for_each_entry_safe(h, htmp, &manager->broker.holders.holders, link)
                holder_exited(h);
        (void)broker_reap_holders(&manager->broker);
        if (!list_is_empty(&manager->broker.holders.holders))
                die("a holder is still in use after its connection closed");
        list_for_each_entry_safe(l, ltmp, &manager->broker.leases.leases, link_table)
                lease_end(&manager->broker.leases, l);  /* published, nobody holding them */
        if (pool_drain(manager->pool) < 0)
                die("pool_drain failed: %s", pool_last_error(manager->pool));
        pool_trim(manager->pool);
        while (pool_idle(manager->pool))
                ;
        pump(NULL);
        if (!list_is_empty(&manager->broker.host_waiters) || manager->broker.n_waiting_making > 0 ||
            manager->broker.n_waiting_zeroing > 0 || manager->broker.n_waiting_copying > 0)
                die("calls still wait off the loop with every connection closed (%u for host memory being made, "
                    "%u for host memory being zeroed, %u for a copy)", manager->broker.n_waiting_making,
                    manager->broker.n_waiting_zeroing, manager->broker.n_waiting_copying);
}

static void run_input(const uint8_t *data, size_t size);

static const uint8_t warm_up[] =
        "\x01\x00\x00\x00"
        "{\"method\":\"io.vmmbroker.Alloc\",\"parameters\":{\"size\":1}}\0"
        "{\"method\":\"io.vmmbroker.Share\",\"parameters\":{\"id\":\"$L0\"}}\0"
        "{\"method\":\"io.vmmbroker.Free\",\"parameters\":{\"id\":\"$L0\"}}\0";

int LLVMFuzzerInitialize(int *argc, char ***argv) {
        char dir[] = "/tmp/vmmbroker-fuzz-XXXXXX", conf[64], sock[64];
        _cleanup_free_ char *message = NULL;
        sigset_t mask;
        FILE *f;
        int k;

        trace = getenv("FUZZ_DAEMON_TRACE");

        /* The simulated device, small so that the fuzzer reaches its limits: 2 devices of 64 MiB. */
        setenv("VMMBROKER_LIBCUDA", SIMCUDA_PATH, 1);
        setenv("SIMCUDA_DEVICES", "2", 1);
        setenv("SIMCUDA_MEMORY", "64M", 1);
        unsetenv("SIMCUDA_FAIL");
        unsetenv("LISTEN_FDS");
        unsetenv("LISTEN_PID");
        unsetenv("NOTIFY_SOCKET");
        unsetenv("WATCHDOG_USEC");

        if (!mkdtemp(dir))
                die("mkdtemp: %m");
        snprintf(conf, sizeof(conf), "%s/vmmbroker.conf", dir);
        snprintf(sock, sizeof(sock), "%s/io.vmmbroker", dir);
        f = fopen(conf, "we");
        if (!f)
                die("%s: %m", conf);
        fprintf(f,
                "[Broker]\n"
                "Socket=%s\n"
                "Capacity=32M\n"
                "MaxSlab=8M\n"
                "HostSlab=2M\n"
                "[Limits]\n"
                "MaxBytes=75%%\n"
                "MaxLeases=8\n"
                "MaxConnections=%d\n",
                sock, CROWD);
        fclose(f);
        config_init(&config);
        k = config_load(&config, conf, &message);
        if (k < 0)
                die("%s: %s", conf, message ?: strerror(-k));
        k = manager_new(&manager, &config.manager, &message);
        if (k < 0)
                die("manager_new: %s", message ?: strerror(-k));
        /* Nothing connects to the socket: remove it at once, and leave nothing behind. */
        (void)unlink(sock);
        (void)unlink(conf);
        (void)rmdir(dir);
        /* manager_new() blocks these for its signalfd; libFuzzer handles them itself. */
        sigemptyset(&mask);
        sigaddset(&mask, SIGTERM);
        sigaddset(&mask, SIGINT);
        sigprocmask(SIG_UNBLOCK, &mask, NULL);

        devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
        if (devnull < 0)
                die("/dev/null: %m");

        n_devices = MIN(pool_n_devices(manager->pool), ELEMENTSOF(baseline_stats));
        pump(NULL);
        /* What the first requests make and keep (sd-event's timerfds, the pool's scrub mapping, its one unbound
         * slab made after a release: see reset()) is made here, before the counts every input is checked
         * against. */
        run_input(warm_up, sizeof(warm_up) - 1);
        reset();
        for (size_t i = 0; i < n_devices; i++)
                pool_device_stats(manager->pool, i, &baseline_stats[i]);
        baseline_fds = count_fds();
        return 0;
}

/* A new connection, as if accepted. Returns the client's end. */
static int connect_peer(bool admin) {
        Peer *p;
        int sv[2], k;

        if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) < 0)
                die("socketpair: %m");
        k = peer_new(manager, sv[0]);
        if (k < 0)
                die("peer_new: %s", strerror(-k));
        /* Whatever uid the fuzzer runs as (root is always an administrator), the input says: it replays the same
         * as root or not. */
        p = list_last_entry(&manager->peers, Peer, link);
        if (!p)
                die("peer_new made no peer");
        p->caller.admin = admin;
        return sv[1];
}

/* The text readers against the json-c path on every message of the payload, as sent (differential.h). */
static void check_differential(const uint8_t *payload, size_t len) {
        for (size_t at = 0; at < len;) {
                const uint8_t *nul = memchr(payload + at, 0, len - at);
                size_t n = nul ? (size_t)(nul - (payload + at)) : len - at;
                const char *why = differential_check((const char *)payload + at, n);

                if (why)
                        die("the text and json-c readers differ (%s) on a message of %zu bytes: %.*s", why, n,
                            (int)MIN(n, (size_t)400), (const char *)payload + at);
                at += n + 1;
        }
}

/* Sends one input and lets the connection go; the daemon's state is reset afterwards. */
static void run_input(const uint8_t *data, size_t size) {
        uint8_t header[HEADER_SIZE] = {};
        const uint8_t *payload;
        Client cl = { .fd = -EBADF };
        int crowd[CROWD], k;
        size_t len;

        memcpy(header, data, MIN(size, sizeof(header)));
        payload = data + MIN(size, sizeof(header));
        len = size - MIN(size, sizeof(header));
        cl.reading = !(header[0] & FLAG_NO_READ);
        check_differential(payload, len);

        for (size_t i = 0; i < CROWD; i++)
                crowd[i] = header[0] & FLAG_CROWD ? connect_peer(false) : -EBADF;
        cl.fd = connect_peer(header[0] & FLAG_ADMIN);
        k = varlink_conn_new(&cl.conn, cl.fd, VARLINK_MAX_REPLY, true);
        if (k < 0)
                die("varlink_conn_new: %s", strerror(-k));

        if (header[0] & FLAG_SESSION) {
                /* One message at a time, each answered before the next is written; the rest (no NUL) last. */
                size_t start = 0, i = 0;

                for (unsigned n = 0; start < len && !cl.write_closed; n++) {
                        _cleanup_free_ uint8_t *msg = NULL;
                        size_t msg_len;

                        while (i < len && payload[i] != 0)
                                i++;
                        if (i < len)
                                i++;    /* with its NUL */
                        msg = substitute(&cl, payload + start, i - start, &msg_len);
                        client_write(&cl, msg, msg_len,
                                     n == 0 && (header[0] & FLAG_FD_FIRST) ? 1
                                     : n == 1 && (header[0] & FLAG_FD_LATER) ? FDPASS_MAX_FDS
                                                                             : 0);
                        start = i;
                }
        } else {
                /* The payload as it is, in up to 4 writes cut where the header says. */
                size_t cuts[HEADER_SIZE + 1] = { 0 }, n_cuts = 1;

                for (size_t j = 1; j < HEADER_SIZE; j++) {
                        size_t at = len * header[j] / 256;

                        if (at > cuts[n_cuts - 1])
                                cuts[n_cuts++] = at;
                }
                cuts[n_cuts] = len;
                for (size_t j = 0; j < n_cuts; j++)
                        if (cuts[j + 1] > cuts[j])
                                client_write(&cl, payload + cuts[j], cuts[j + 1] - cuts[j],
                                             j == 0 && (header[0] & FLAG_FD_FIRST) ? 1
                                             : j == 1 && (header[0] & FLAG_FD_LATER) ? FDPASS_MAX_FDS
                                                                                     : 0);
        }

        /* The end of the stream: the daemon must let the connection go. */
        if (!(header[0] & FLAG_SILENCE)) {
                (void)shutdown(cl.fd, SHUT_WR);
                pump(&cl);
        }
        if (cl.reading && !(header[0] & FLAG_SILENCE) && !cl.eof)
                die("the daemon keeps a connection whose client has shut down and read everything");
        cl.conn = varlink_conn_free(cl.conn);   /* closes cl.fd */
        close_many(crowd, CROWD);
        pump(NULL);
        if (manager->n_peers != 0)
                die("%u peers left after the client closed", manager->n_peers);
        reset();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        unsigned fds;

        run_input(data, size);
        if (manager->broker.leases.n_leases != 0 || manager->broker.leases.n_published != 0 ||
            !list_is_empty(&manager->broker.holders.holders))
                die("leases or holders left after the holder was reclaimed");
        if (manager->broker.users.n_users != 0)
                die("%u users left with nothing charged", manager->broker.users.n_users);
        check_pool("after the input");
        fds = count_fds();
        if (fds != baseline_fds) {
                dump_fds();
                die("%u fds open after the input, %u before", fds, baseline_fds);
        }
        return 0;
}
