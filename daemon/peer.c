/* SPDX-License-Identifier: MIT */

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/pidfd.h>
#include <unistd.h>

#include "codec.h"
#include "json.h"
#include "macro.h"
#include "manager.h"
#include "message.h"
#include "method.h"
#include "metrics.h"
#include "peer.h"

#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77                 /* Linux 6.5; Debian 12's headers predate it */
#endif

/* --- answering ------------------------------------------------------------------------------------ */

/* QuotaExceeded for a connection over its user's MaxConnections= or MaxProcesses=. */
static int peer_refusal(Peer *p, json_object **ret) {
        _cleanup_free_ char *message = NULL;
        const UserQuota *q = &p->refusal;

        user_quota_message(p->caller.user, q, -1, &message);
        return vmmb_error_quota_exceeded(user_resource_name(q->what), q->limit, q->current,
                                         message ?: "over a limit", ret);
}

/* Parks the connection with its Alloc `w` (taken), waiting since `since`. Returns 0 or -ENOMEM. */
static int peer_park(Peer *p, AllocWait *w, bool oneway, uint64_t since) {
        int k = 0;

        if (w->scrub) {
                list_link_tail(&p->manager->broker.scrub_waiters, &p->link_scrub);
                p->manager->broker.scrub_waiting[w->device]++;
        } else
                k = wait_queue_push(&p->manager->broker.waits[w->device], &p->waiter, p->caller.user);
        if (k < 0) {
                alloc_wait_free(w);
                return k;
        }
        p->wait = w;
        p->wait_since = since;
        p->wait_oneway = oneway;
        return 0;
}

/* Ends the wait: out of the queue (`served` gives its user's turn to the next), the call forgotten. */
static void peer_unpark(Peer *p, bool served) {
        if (!p->wait)
                return;
        if (p->wait->scrub) {
                list_unlink(&p->link_scrub);
                p->manager->broker.scrub_waiting[p->wait->device]--;
        } else
                wait_queue_remove(&p->manager->broker.waits[p->wait->device], &p->waiter, served);
        p->wait = alloc_wait_free(p->wait);
}

static void peer_update(Peer *p);

/* The broker's count of the calls waiting for `what` (Broker.n_waiting_making: host memory being made;
 * n_waiting_zeroing: memory being zeroed; n_waiting_copying: a copy). */
static unsigned *host_waiting_count(Broker *b, HostWait what) {
        switch (what) {
        case HOST_WAIT_ZEROING:
                return &b->n_waiting_zeroing;
        case HOST_WAIT_COPYING:
                return &b->n_waiting_copying;
        case HOST_WAIT_MAKING:
        default:                        /* HOST_WAIT_NONE: no call counts it */
                return &b->n_waiting_making;
        }
}

/* Keeps the text of a call that waits for `what`, to make it again (peer_host_try()). Returns 0 or -ENOMEM. */
static int peer_wait_host(Peer *p, const char *text, size_t len, HostWait what) {
        p->host_call = malloc(len);
        if (!p->host_call)
                return -ENOMEM;
        memcpy(p->host_call, text, len);
        p->host_call_len = len;
        p->host_wait = what;
        list_link_tail(&p->manager->broker.host_waiters, &p->link_host);
        (*host_waiting_count(&p->manager->broker, what))++;
        return 0;
}

/* Takes the waiting Park's text back from the connection (freed by the caller). */
static char *peer_host_take(Peer *p, size_t *ret_len) {
        list_unlink(&p->link_host);
        (*host_waiting_count(&p->manager->broker, p->host_wait))--;
        *ret_len = p->host_call_len;
        p->host_wait = HOST_WAIT_NONE;
        return TAKE_PTR(p->host_call);
}

/*
 * WatchReclaim: the connection becomes its process's watch, answered at once
 * with a first reply (continues, no id) that says the watch is on, then one
 * reply per reclaim request. Returns 0 or a negative errno.
 */
static int peer_watch(Peer *p, VarlinkCall *call, MethodReply *r) {
        _cleanup_(json_object_putp) json_object *params = NULL;
        ReclaimRequest first = { .device = JSON_ABSENT, .size = JSON_ABSENT, .timeout_usec = JSON_ABSENT };
        Holder *h = p->caller.holder;
        int k;

        if (!call->more || call->oneway)
                return vmmb_error_invalid_parameter("more", "Call WatchReclaim with \"more\": true.", &r->msg);
        k = varlink_call_parameters(call);
        if (k < 0)
                return k;
        if (call->parameters && json_object_object_length(call->parameters) > 0)
                return vmmb_error_invalid_parameter("parameters", "WatchReclaim takes no parameters.", &r->msg);
        if (h->watch)
                return vmmb_error_invalid_parameter("more", "This process watches for reclaim requests on another "
                                                    "connection already: one watch per process.", &r->msg);
        k = reclaim_request_encode(&first, &params);
        if (k >= 0)
                k = varlink_reply_new_continues(params, &r->msg);
        if (k < 0)
                return k;
        h->watch = p;
        p->watching = true;
        return 0;
}

/*
 * After a reply sent outside the connection's own turn (`k`: how sending it went): writes what the socket
 * takes now (the rest on EPOLLOUT), and frees the connection when either failed.
 */
static void peer_flush_or_free(Peer *p, int k) {
        if (k >= 0) {
                k = varlink_conn_flush(p->conn);
                if (k == -EAGAIN)
                        k = 0;
        }
        if (k < 0) {
                peer_free(p);
                return;
        }
        peer_update(p);
}

void peer_reclaim_send(Peer *p, const Lease *l, uint64_t timeout_usec) {
        _cleanup_(json_object_putp) json_object *params = NULL, *msg = NULL;
        ReclaimRequest q = { .id = (char *)l->id, .device = l->device, .size = (int64_t)l->size,
                             .timeout_usec = (int64_t)MIN(timeout_usec, (uint64_t)INT64_MAX) };
        int k;

        k = reclaim_request_encode(&q, &params);
        if (k >= 0)
                k = varlink_reply_new_continues(params, &msg);
        if (k >= 0)
                k = varlink_conn_send(p->conn, msg, NULL, 0);
        peer_flush_or_free(p, k);
}

/*
 * Answers one call, the message text[0..len) (read as text: varlink_call_parse_text()). Returns 0, or a
 * negative errno that ends the connection.
 */
static int peer_dispatch(Peer *p, const char *text, size_t len) {
        Broker *b = &p->manager->broker;
        VarlinkCall call = {};
        MethodReply r;
        int k;

        k = varlink_call_parse_text(text, len, &call);
        if (k < 0)
                return k;
        /* Whoever exited before this request was read is gone for it. */
        broker_reap_holders(b);
        if (p->caller.holder && p->caller.holder->exited) {
                /* Its sender has exited: what it asked for would belong to nobody and never end. */
                varlink_call_done(&call);
                return -ECONNRESET;
        }
        r = method_reply_init(&p->manager->reply_text);
        if (p->refused)
                k = peer_refusal(p, &r.msg);    /* the answer to its first call says why; then it closes */
        else if (strcmp(call.method, VMMB_METHOD_WATCH_RECLAIM) == 0) {
                uint64_t start = metrics_clock();

                k = peer_watch(p, &call, &r);
                metrics_request_done(call.method, r.msg, k, start);
        } else {
                uint64_t start = metrics_clock();

                k = method_call(b, &p->caller, &call, &r);
                if (r.wait_host) {
                        /* Its host slabs are being made, or its copy: counted when it is answered
                         * (peer_host_try()). */
                        p->host_ticket = r.host_ticket;
                        k = peer_wait_host(p, text, len, r.wait_host);
                        method_reply_done(&r, &p->manager->reply_text);
                        varlink_call_done(&call);
                        return k;
                }
                if (r.wait) {
                        /* No room, and it may wait: counted when it is answered (peer_wait_try()). */
                        k = peer_park(p, TAKE_PTR(r.wait), call.oneway, start);
                        method_reply_done(&r, &p->manager->reply_text);
                        varlink_call_done(&call);
                        return k;
                }
                metrics_request_done(call.method, r.msg, k, start);
        }
        if (k == 0 && method_reply_is_set(&r) && !call.oneway)
                k = method_reply_send(&r, p->conn);
        method_reply_done(&r, &p->manager->reply_text);
        varlink_call_done(&call);
        return k;
}

static int on_reply_timeout(sd_event_source *s, uint64_t usec, void *userdata) {
        Peer *p = userdata;

        metrics_loop_source(METRICS_LOOP_DEADLINE);
        if (p->wait) {
                /* The waiting call's deadline: one last try, then OutOfMemory saying how long it waited. */
                (void)peer_wait_try(p, ALLOC_TRY_EXPIRED);
                return 0;
        }

        /* A refused connection that does not ask is simply closed: nothing to say about each of a flood. */
        if (!p->refused)
                fprintf(stderr, "Closing the connection of pid %d (uid %u): it left a reply unread for %g s "
                        "(ReplyTimeout=).\n", (int)p->cred.pid, (unsigned)p->cred.uid,
                        (double)p->manager->reply_timeout_usec / 1e6);
        peer_free(p);
        return 0;
}

/* Arms the reply timer from now, or stops it; while a call waits, it is the wait's deadline. */
static void peer_set_timer(Peer *p, bool on) {
        uint64_t now;

        if (p->wait) {
                (void)sd_event_source_set_time(p->reply_timer, p->wait_since + p->wait->wait_usec);
                (void)sd_event_source_set_enabled(p->reply_timer, SD_EVENT_ONESHOT);
                return;
        }
        if (!on) {
                (void)sd_event_source_set_enabled(p->reply_timer, SD_EVENT_OFF);
                return;
        }
        if (sd_event_now(p->manager->event, CLOCK_MONOTONIC, &now) < 0)
                return;
        (void)sd_event_source_set_time(p->reply_timer,
                                       now + (p->refused ? PEER_REFUSED_TIMEOUT_USEC : p->manager->reply_timeout_usec));
        (void)sd_event_source_set_enabled(p->reply_timer, SD_EVENT_ONESHOT);
}

/*
 * After each step: what the connection waits for next. A queued reply is a
 * request in flight, charged to the user, and the connection has
 * ReplyTimeout= to read it; then it waits for EPOLLOUT. Otherwise a whole
 * request buffered puts it in the fair queue, and nothing more is read until
 * it is served; else it waits for input.
 */
static void peer_update(Peer *p) {
        bool pending = varlink_conn_pending(p->conn) > 0;
        bool ready = !pending && !p->wait && !p->host_call && !p->watching && varlink_conn_has_message(p->conn);
        Manager *m = p->manager;

        if (pending && !p->charge_request.user)
                user_charge_anyway(p->caller.user, &p->charge_request, USER_REQUESTS, 0, 1);
        else if (!pending)
                user_charge_release(&p->charge_request);
        if (!p->refused)
                peer_set_timer(p, pending);

        if (ready && !list_is_linked(&p->link_ready)) {
                fair_queue_push(&m->fair, p->caller.user, &p->link_ready);
                (void)sd_event_source_set_enabled(m->serve_source, SD_EVENT_ON);
        } else if (!ready)
                fair_queue_remove(&m->fair, p->caller.user, &p->link_ready);
        /* A parked connection is woken only by a hangup (always reported), which ends its wait. */
        /* A watch reads nothing more after its call either: it is woken to write, or by its client shutting
         * down (EPOLLRDHUP: its end of the stream, which a hangup alone does not report for a half-close). */
        (void)sd_event_source_set_io_events(p->io,
                                            (pending ? EPOLLOUT : ready || p->wait || p->host_call || p->watching ?
                                                                  0 : EPOLLIN) |
                                            (p->watching ? EPOLLRDHUP : 0));
}

void peer_serve(Peer *p) {
        const char *text;
        size_t len;
        int k;

        k = varlink_conn_next(p->conn, &text, &len, NULL, NULL);
        if (k > 0)
                k = peer_dispatch(p, text, len);
        if (k >= 0) {
                k = varlink_conn_flush(p->conn);
                if (k == -EAGAIN)
                        k = 0;
                else if (k == 0 && p->refused)
                        k = -ECONNRESET;        /* it has its answer */
        }
        if (k >= 0 && p->hangup && (p->wait || !varlink_conn_has_message(p->conn)))
                k = -ECONNRESET;        /* a waiting call whose client has gone leaves the queue */
        if (k < 0) {
                peer_free(p);
                return;
        }
        peer_update(p);
}

bool peer_wait_try(Peer *p, AllocTry how) {
        Broker *b = &p->manager->broker;
        uint64_t start = metrics_clock();
        MethodReply r;
        bool served;
        int k;

        if (how != ALLOC_TRY_STOPPING) {
                broker_reap_holders(b);
                if (p->caller.holder && p->caller.holder->exited) {
                        peer_free(p);   /* what it waits for would belong to nobody */
                        return false;
                }
        }
        r = method_reply_init(&p->manager->reply_text);
        k = method_alloc_again(b, &p->caller, p->wait, how, start - p->wait_since, &r);
        if (k == 0 && !method_reply_is_set(&r)) {
                method_reply_done(&r, &p->manager->reply_text);
                return true;
        }
        metrics_request_done(VMMB_METHOD_ALLOC, r.msg, k, start);
        served = k == 0 && r.n_fds > 0;
        metrics_wait_done(served ? METRICS_WAIT_SERVED :
                          how == ALLOC_TRY_STOPPING ? METRICS_WAIT_STOPPED :
                          how == ALLOC_TRY_EXPIRED ? METRICS_WAIT_EXPIRED : METRICS_WAIT_REFUSED);
        peer_unpark(p, served);
        if (k == 0 && !p->wait_oneway)
                k = method_reply_send(&r, p->conn);
        method_reply_done(&r, &p->manager->reply_text);
        peer_flush_or_free(p, k);
        return false;
}

void peer_host_try(Peer *p) {
        _cleanup_free_ char *text = NULL;
        size_t len;
        int k;

        /* Made again after its making, a Park whose slabs its user's other calls took meanwhile waits for another
         * making rather than pin in the loop, which would hold every other client up (0.3 s per GiB); only when a
         * host slab of its own making failed to be made does it create what it lacks itself, and is answered with
         * the driver's refusal rather than make and fail for ever. */
        p->caller.copy_waited = p->host_wait == HOST_WAIT_COPYING;
        p->caller.host_make_failed = p->host_wait == HOST_WAIT_MAKING &&
                                     pool_make_failed(p->manager->pool, p->host_ticket);
        text = peer_host_take(p, &len);
        k = peer_dispatch(p, text, len);
        p->caller.host_make_failed = false;
        p->caller.copy_waited = false;
        if (k >= 0 && p->hangup && !varlink_conn_has_message(p->conn))
                k = -ECONNRESET;        /* answered (or not, one-way): its client has gone */
        peer_flush_or_free(p, k);
}

void peer_host_stopping(Peer *p) {
        _cleanup_(json_object_putp) json_object *msg = NULL;
        _cleanup_(varlink_call_done) VarlinkCall call = {};
        _cleanup_free_ char *text = NULL;
        size_t len;
        int k;

        text = peer_host_take(p, &len);
        k = varlink_call_parse_text(text, len, &call);
        if (k >= 0 && !call.oneway)
                k = method_wait_stopping(&p->manager->broker, &p->caller, &call, &msg);
        if (k >= 0 && msg)
                k = varlink_conn_send(p->conn, msg, NULL, 0);
        peer_flush_or_free(p, k);
}

void peer_wait_check_exited(Peer *p) {
        if (p->wait && p->caller.holder && p->caller.holder->exited)
                peer_free(p);
}

static int on_peer_io(sd_event_source *s, int fd, uint32_t revents, void *userdata) {
        Peer *p = userdata;
        int k = 0;

        metrics_loop_source(METRICS_LOOP_CONNECTION);
        if (p->wait || p->host_call) {
                /* Parked: only a hangup wakes it, and the call's client is gone. */
                if (revents & (EPOLLHUP | EPOLLERR))
                        peer_free(p);
                return 0;
        }
        if (p->watching && (revents & (EPOLLHUP | EPOLLERR | EPOLLRDHUP))) {
                peer_free(p);           /* its process stopped watching: requests have nobody to go to */
                return 0;
        }
        if (varlink_conn_pending(p->conn) > 0) {
                k = varlink_conn_flush(p->conn);
                if (k == -EAGAIN)
                        k = 0;
                else if (k == 0 && p->refused)
                        k = -ECONNRESET;
        } else if (!varlink_conn_has_message(p->conn)) {
                /* One read per wake-up: whatever it brings waits for the connection's turn. */
                k = varlink_conn_read(p->conn);
                if (k == -EAGAIN)
                        k = 0;
                else if (k == 0)
                        k = -ECONNRESET;        /* end of stream */
        }
        if (k >= 0 && (revents & (EPOLLHUP | EPOLLERR))) {
                if (!varlink_conn_has_message(p->conn))
                        k = -ECONNRESET;
                else {
                        /* Serve what it sent before it closed, but do not wake up for the hangup again. */
                        p->hangup = true;
                        (void)sd_event_source_set_enabled(p->io, SD_EVENT_OFF);
                }
        }
        if (k < 0) {
                peer_free(p);
                return 0;
        }
        /* A whole request read, nothing of ours unsent: served now when nobody is waiting (manager.h). */
        if (varlink_conn_pending(p->conn) == 0 && varlink_conn_has_message(p->conn) &&
            manager_serve_at_once(p->manager, p))
                return 0;
        peer_update(p);
        return 0;
}

/* --- connecting ----------------------------------------------------------------------------------- */

static int peer_pidfd(int fd, pid_t pid) {
        socklen_t len = sizeof(int);
        int pidfd = -EBADF;

        if (getsockopt(fd, SOL_SOCKET, SO_PEERPIDFD, &pidfd, &len) == 0 && pidfd >= 0)
                return pidfd;
        /* Older kernels: open it by pid right after accept, before the client can have exited and been
         * replaced (its connection keeps nothing alive, so this is a small window, not none). */
        pidfd = pidfd_open(pid, 0);
        return pidfd < 0 ? -errno : pidfd;
}

/* The peer's groups when it connected (SO_PEERGROUPS) and its primary group. *ret is malloc'd. */
static int peer_groups(int sock, gid_t primary, gid_t **ret, size_t *ret_n) {
        _cleanup_free_ gid_t *groups = NULL;
        socklen_t len = 0;
        gid_t *all;
        size_t n;

        /* Asked with too small a buffer, the kernel says ERANGE and how much it needs. */
        while (getsockopt(sock, SOL_SOCKET, SO_PEERGROUPS, groups, &len) < 0) {
                if (errno != ERANGE)
                        return -errno;
                free(groups);
                groups = malloc(len);
                if (!groups)
                        return -ENOMEM;
        }
        n = len / sizeof(gid_t);
        all = realloc(TAKE_PTR(groups), (n + 1) * sizeof(gid_t));
        if (!all)
                return -ENOMEM;
        all[n] = primary;
        *ret = all;
        *ret_n = n + 1;
        return 0;
}

/* Root, or a member (primary or supplementary) of the configured administrators' group. */
static bool peer_check_admin(const Peer *p, const gid_t *gids, size_t n_gids) {
        const Manager *m = p->manager;

        if (p->cred.uid == 0)
                return true;
        if (!m->has_admin_group)
                return false;
        for (size_t i = 0; i < n_gids; i++)
                if (gids[i] == m->admin_gid)
                        return true;
        return false;
}

int peer_new(Manager *m, int fd) {
        socklen_t len = sizeof(struct ucred);
        _cleanup_close_ int sock = fd, pidfd = -EBADF;
        _cleanup_free_ gid_t *gids = NULL;
        size_t n_gids = 0;
        Peer *p;
        int k;

        p = calloc(1, sizeof(*p));
        if (!p)
                return -ENOMEM;
        p->manager = m;
        list_init(&p->link);
        list_init(&p->link_ready);
        list_init(&p->link_scrub);
        if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &p->cred, &len) < 0 || p->cred.pid <= 0) {
                k = -errno ?: -EPROTO;
                goto fail;
        }
        k = peer_groups(sock, p->cred.gid, &gids, &n_gids);
        if (k < 0)
                goto fail;
        p->caller.admin = peer_check_admin(p, gids, n_gids);
        p->caller.user = user_get(&m->broker.users, p->cred.uid, gids, n_gids);
        if (!p->caller.user) {
                k = -ENOMEM;
                goto fail;
        }
        /* Over a limit, the connection is kept just long enough to say why (peer_refusal()). */
        if (user_charge(p->caller.user, &p->charge_connection, USER_CONNECTIONS, 0, 1, &p->refusal) < 0)
                p->refused = true;
        else {
                if (m->n_peers >= m->max_connections_total) {
                        k = -EUSERS;    /* no slot for anyone: closed at once */
                        goto fail;
                }
                pidfd = peer_pidfd(sock, p->cred.pid);
                if (pidfd < 0) {
                        k = pidfd;
                        goto fail;
                }
                k = holder_connect(&m->broker.holders, p->caller.user, p->cred.pid, p->cred.gid, TAKE_FD(pidfd),
                                   &p->caller.holder, &p->refusal);
                if (k == -EDQUOT) {
                        user_charge_release(&p->charge_connection);
                        p->refused = true;
                } else if (k < 0)
                        goto fail;
        }
        if (p->refused) {
                /* A bounded few of a user's refused connections wait to be told; the rest go at once. */
                if (p->caller.user->refused >= PEER_REFUSED_PER_USER) {
                        k = -EDQUOT;
                        goto fail;
                }
                p->caller.user->refused++;
                m->n_refused++;
                p->waits_refused = true;
        }
        k = sd_event_add_time(m->event, &p->reply_timer, CLOCK_MONOTONIC, UINT64_MAX, 0, on_reply_timeout, p);
        if (k < 0)
                goto fail;
        peer_set_timer(p, p->refused);
        k = varlink_conn_new(&p->conn, sock, VARLINK_MAX_REQUEST, false);
        if (k < 0)
                goto fail;
        sock = -EBADF;
        k = sd_event_add_io(m->event, &p->io, varlink_conn_get_fd(p->conn), EPOLLIN, on_peer_io, p);
        if (k < 0)
                goto fail;
        list_link_tail(&m->peers, &p->link);
        if (!p->refused)
                m->n_peers++;
        return 0;

fail:
        peer_free(p);
        return k;
}

Peer *peer_free(Peer *p) {
        if (!p)
                return NULL;
        if (list_is_linked(&p->link)) {
                list_unlink(&p->link);
                if (!p->refused)
                        p->manager->n_peers--;
        }
        if (p->waits_refused) {
                p->caller.user->refused--;
                p->manager->n_refused--;
        }
        if (p->caller.user)
                fair_queue_remove(&p->manager->fair, p->caller.user, &p->link_ready);
        if (p->wait) {
                metrics_wait_done(METRICS_WAIT_LEFT);
                peer_unpark(p, false);
        }
        if (p->host_call) {
                size_t len;

                free(peer_host_take(p, &len));
        }
        sd_event_source_disable_unref(p->io);
        sd_event_source_disable_unref(p->reply_timer);
        varlink_conn_free(p->conn);
        if (p->watching && p->caller.holder && p->caller.holder->watch == p)
                p->caller.holder->watch = NULL;
        if (p->caller.holder)
                holder_disconnect(p->caller.holder);
        user_charge_release(&p->charge_request);
        user_charge_release(&p->charge_connection);
        user_unref(p->caller.user);
        free(p);
        return NULL;
}
