/* SPDX-License-Identifier: MIT */

#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fdpass.h"
#include "json.h"
#include "list.h"
#include "macro.h"
#include "varlink.h"

/* Starting size of the input buffer; it doubles up to the message limit. */
#define INPUT_INITIAL 4096U

/* The largest sent OutBuf kept for the next message: a connection holds at most this much more. */
#define OUTPUT_SPARE_MAX 4096U

/* fds that arrived with the message starting at stream offset `at`. */
typedef struct FdBatch {
        List link;
        uint64_t at;
        int *fds;
        size_t n_fds;
} FdBatch;

/* Queued output: bytes of one or more messages; fds, when any, go with data[0]. */
typedef struct OutBuf {
        List link;
        char *data;
        size_t len;
        size_t alloc;
        size_t sent;
        int *fds;
        size_t n_fds;
} OutBuf;

struct VarlinkConn {
        int fd;
        bool accept_fds;
        size_t max_message;

        char *in;
        size_t in_alloc;
        size_t in_start;        /* first byte not handed out: always a message start */
        size_t in_end;
        size_t in_scanned;      /* bytes after in_start known to hold no NUL */
        uint64_t in_offset;     /* stream offset of in[0] */
        bool in_eof;
        List in_fds;            /* FdBatch, by stream offset */

        List out;               /* OutBuf, in order */
        size_t out_pending;
        OutBuf *out_spare;      /* one sent, kept so that a reply needs no allocation: most are sent at once */
};

static FdBatch *fd_batch_free(FdBatch *b) {
        if (!b)
                return NULL;
        list_unlink(&b->link);
        close_many(b->fds, b->n_fds);
        free(b->fds);
        free(b);
        return NULL;
}

static OutBuf *out_buf_free(OutBuf *o) {
        if (!o)
                return NULL;
        list_unlink(&o->link);
        close_many(o->fds, o->n_fds);
        free(o->fds);
        free(o->data);
        free(o);
        return NULL;
}

int varlink_conn_new(VarlinkConn **ret, int fd, size_t max_message, bool accept_fds) {
        VarlinkConn *c;

        if (fd < 0 || max_message < 2)
                return -EINVAL;
        c = calloc(1, sizeof(*c));
        if (!c)
                return -ENOMEM;
        *c = (VarlinkConn){
                .fd = fd,
                .accept_fds = accept_fds,
                .max_message = max_message,
        };
        list_init(&c->in_fds);
        list_init(&c->out);
        *ret = c;
        return 0;
}

VarlinkConn *varlink_conn_free(VarlinkConn *c) {
        FdBatch *b, *bt;
        OutBuf *o, *ot;

        if (!c)
                return NULL;
        list_for_each_entry_safe(b, bt, &c->in_fds, link)
                fd_batch_free(b);
        list_for_each_entry_safe(o, ot, &c->out, link)
                out_buf_free(o);
        out_buf_free(c->out_spare);
        free(c->in);
        safe_close(c->fd);
        free(c);
        return NULL;
}

int varlink_conn_get_fd(const VarlinkConn *c) {
        return c->fd;
}

/* Attaches fds received with in[pos..pos+n) to the last message beginning there. */
static int attach_fds(VarlinkConn *c, size_t pos, size_t n, int *fds, size_t n_fds) {
        FdBatch *b, *last;
        uint64_t at;
        size_t i;

        /* a message begins after each NUL, and at pos if the byte before it ended one */
        for (i = n - 1; i > 0; i--)
                if (c->in[pos + i - 1] == 0)
                        break;
        if (i == 0 && pos > c->in_start && c->in[pos - 1] != 0)
                return -EPROTO;         /* fds in the middle of a message */
        at = c->in_offset + pos + i;

        last = list_last_entry(&c->in_fds, FdBatch, link);
        if (last && last->at >= at)
                return -EPROTO;         /* a second set of fds for one message */

        b = calloc(1, sizeof(*b));
        if (!b)
                return -ENOMEM;
        b->fds = malloc(n_fds * sizeof(int));
        if (!b->fds) {
                free(b);
                return -ENOMEM;
        }
        memcpy(b->fds, fds, n_fds * sizeof(int));
        b->n_fds = n_fds;
        b->at = at;
        list_link_tail(&c->in_fds, &b->link);
        return 0;
}

int varlink_conn_read(VarlinkConn *c) {
        int fds[FDPASS_MAX_FDS];
        size_t n_fds = 0, room, want, pos;
        ssize_t n;
        int r;

        if (c->in_eof)
                return 0;
        if (c->in_start > 0) {
                memmove(c->in, c->in + c->in_start, c->in_end - c->in_start);
                c->in_offset += c->in_start;
                c->in_end -= c->in_start;
                c->in_start = 0;
        }
        room = c->max_message - c->in_end;
        if (room == 0)
                return memchr(c->in, 0, c->in_end) ? -ENOBUFS : -EMSGSIZE;
        if (c->in_alloc - c->in_end < room && c->in_alloc - c->in_end < INPUT_INITIAL / 2) {
                size_t a = c->in_alloc ? c->in_alloc * 2 : INPUT_INITIAL;
                char *p;

                if (a > c->max_message)
                        a = c->max_message;
                p = realloc(c->in, a);
                if (!p)
                        return -ENOMEM;
                c->in = p;
                c->in_alloc = a;
        }
        want = c->in_alloc - c->in_end;
        if (want > room)
                want = room;

        pos = c->in_end;
        n = fd_recv(c->fd, c->in + pos, want, fds, FDPASS_MAX_FDS, &n_fds);
        if (n < 0)
                return (int)n;
        if (n_fds > 0 && (!c->accept_fds || n == 0)) {
                close_many(fds, n_fds);
                return -EPROTO;
        }
        if (n == 0) {
                c->in_eof = true;
                if (c->in_end > c->in_start && c->in[c->in_end - 1] != 0)
                        return -ECONNRESET;
                return 0;
        }
        c->in_end += (size_t)n;
        if (n_fds > 0) {
                r = attach_fds(c, pos, (size_t)n, fds, n_fds);
                if (r < 0) {
                        close_many(fds, n_fds);
                        return r;
                }
        }
        return (int)n;
}

int varlink_conn_next(VarlinkConn *c, const char **ret_message, size_t *ret_len,
                      int **ret_fds, size_t *ret_n_fds) {
        size_t avail = c->in_end - c->in_start;
        const char *nul;
        FdBatch *b;
        uint64_t at;

        nul = avail > c->in_scanned
                ? memchr(c->in + c->in_start + c->in_scanned, 0, avail - c->in_scanned)
                : NULL;
        if (!nul) {
                c->in_scanned = avail;
                if (avail >= c->max_message)
                        return -EMSGSIZE;
                if (c->in_eof && avail > 0)
                        return -ECONNRESET;
                return 0;
        }

        at = c->in_offset + c->in_start;
        b = list_first_entry(&c->in_fds, FdBatch, link);
        if (b && b->at == at) {
                if (ret_fds) {
                        *ret_fds = TAKE_PTR(b->fds);
                        *ret_n_fds = b->n_fds;
                        b->n_fds = 0;
                }
                fd_batch_free(b);
        } else if (ret_fds) {
                *ret_fds = NULL;
                *ret_n_fds = 0;
        }

        *ret_message = c->in + c->in_start;
        *ret_len = (size_t)(nul - *ret_message);
        c->in_start += *ret_len + 1;
        c->in_scanned = 0;
        return 1;
}

bool varlink_conn_has_message(VarlinkConn *c) {
        size_t avail = c->in_end - c->in_start;

        if (avail > c->in_scanned && memchr(c->in + c->in_start + c->in_scanned, 0, avail - c->in_scanned))
                return true;
        c->in_scanned = avail;
        return avail >= c->max_message || (c->in_eof && avail > 0);
}

/*
 * A message just taken, m[0..len) with the fds (*fds)[0..n_fds), parsed into *ret: 1 with the fds handed over
 * (or closed, without ret_fds), or json_parse_message()'s error with them closed.
 */
static int message_json(const char *m, size_t len, int **fds, size_t n_fds, json_object **ret, int **ret_fds,
                        size_t *ret_n_fds) {
        int r;

        r = json_parse_message(m, len, ret);
        if (r < 0 || !ret_fds) {
                close_many(*fds, n_fds);
                if (r < 0)
                        return r;
                return 1;
        }
        *ret_fds = TAKE_PTR(*fds);
        *ret_n_fds = n_fds;
        return 1;
}

int varlink_conn_next_json(VarlinkConn *c, json_object **ret, int **ret_fds, size_t *ret_n_fds) {
        _cleanup_free_ int *fds = NULL;
        const char *m;
        size_t len, n_fds = 0;
        int r;

        r = varlink_conn_next(c, &m, &len, &fds, &n_fds);
        if (r <= 0)
                return r;
        return message_json(m, len, &fds, n_fds, ret, ret_fds, ret_n_fds);
}

int varlink_conn_receive_text(VarlinkConn *c, const char **ret_message, size_t *ret_len, int **ret_fds,
                              size_t *ret_n_fds) {
        for (;;) {
                int r;

                r = varlink_conn_next(c, ret_message, ret_len, ret_fds, ret_n_fds);
                if (r != 0)
                        return r;
                r = varlink_conn_read(c);
                if (r == 0)
                        return -ECONNRESET;
                if (r < 0)
                        return r;
        }
}

int varlink_conn_receive(VarlinkConn *c, json_object **ret, int **ret_fds, size_t *ret_n_fds) {
        _cleanup_free_ int *fds = NULL;
        const char *m;
        size_t len, n_fds = 0;
        int r;

        r = varlink_conn_receive_text(c, &m, &len, &fds, &n_fds);
        if (r < 0)
                return r;
        return message_json(m, len, &fds, n_fds, ret, ret_fds, ret_n_fds);
}

/*
 * Writes a message and its NUL into o's buffer after its o->len bytes: text[0..len) as it is, or, with text
 * NULL, msg serialised. Returns the bytes added, or an error (nothing is added): json_write()'s for msg
 * (-EBADMSG for a NUL in the text, -ENOMEM), -ENOMEM for text.
 */
static ssize_t out_buf_write(OutBuf *o, json_object *msg, const char *text, size_t len) {
        ssize_t end;

        if (!text) {
                end = json_write(msg, &o->data, &o->alloc, o->len);
                if (end < 0)
                        return end;
        } else {
                int r = json_buf_reserve(&o->data, &o->alloc, o->len, len + 1);

                if (r < 0)
                        return r;
                memcpy(o->data + o->len, text, len);
                end = (ssize_t)(o->len + len);
        }
        o->data[end] = 0;       /* there is room for it, and no NUL before it */
        end = end + 1 - (ssize_t)o->len;
        o->len += (size_t)end;
        return end;
}

/* Queues text[0..len), or with text NULL msg, as varlink_conn_send() says. */
static int conn_send(VarlinkConn *c, json_object *msg, const char *text, size_t len,
                     const int *fds, size_t n_fds) {
        OutBuf *o, *tail;
        ssize_t n;

        if (n_fds > FDPASS_MAX_FDS)
                return -E2BIG;

        tail = list_last_entry(&c->out, OutBuf, link);
        if (n_fds == 0 && tail && tail->n_fds == 0) {
                /* no fds: join the bytes queued before */
                n = out_buf_write(tail, msg, text, len);
                if (n < 0)
                        return (int)n;
                c->out_pending += (size_t)n;
                return 0;
        }

        o = TAKE_PTR(c->out_spare) ?: calloc(1, sizeof(*o));
        if (!o)
                return -ENOMEM;
        list_init(&o->link);
        n = out_buf_write(o, msg, text, len);
        if (n < 0) {
                out_buf_free(o);
                return (int)n;
        }
        if (n_fds > 0) {
                o->fds = malloc(n_fds * sizeof(int));
                if (!o->fds) {
                        out_buf_free(o);
                        return -ENOMEM;
                }
                for (size_t i = 0; i < n_fds; i++) {
                        int fd = fcntl(fds[i], F_DUPFD_CLOEXEC, 3);

                        if (fd < 0) {
                                int r = -errno;

                                out_buf_free(o);
                                return r;
                        }
                        o->fds[o->n_fds++] = fd;
                }
        }
        list_link_tail(&c->out, &o->link);
        c->out_pending += o->len;
        return 0;
}

int varlink_conn_send(VarlinkConn *c, json_object *msg, const int *fds, size_t n_fds) {
        return conn_send(c, msg, NULL, 0, fds, n_fds);
}

int varlink_conn_send_text(VarlinkConn *c, const VarlinkText *t, const int *fds, size_t n_fds) {
        if (!t->data || t->len == 0)
                return -EINVAL;
        /* Made sure of where the text was written (VarlinkText), not looked for in every message sent: the
         * daemon's replies and the client's calls all go this way. A NUL would end the message early. */
        assert(!memchr(t->data, 0, t->len));
        return conn_send(c, NULL, t->data, t->len, fds, n_fds);
}

/* A sent OutBuf: kept as the connection's spare when it has none and the buffer is small, else freed. */
static void out_buf_done(VarlinkConn *c, OutBuf *o) {
        if (c->out_spare || o->alloc > OUTPUT_SPARE_MAX) {
                out_buf_free(o);
                return;
        }
        list_unlink(&o->link);
        free(o->fds);           /* its fds went with the first byte */
        o->fds = NULL;
        o->len = o->sent = 0;
        c->out_spare = o;
}

int varlink_conn_flush(VarlinkConn *c) {
        OutBuf *o;

        while ((o = list_first_entry(&c->out, OutBuf, link))) {
                ssize_t n;

                n = fd_send(c->fd, o->data + o->sent, o->len - o->sent, o->fds, o->n_fds);
                if (n < 0)
                        return (int)n;
                if (o->n_fds > 0) {
                        /* the fds went with the first byte; never again */
                        close_many(o->fds, o->n_fds);
                        o->n_fds = 0;
                }
                o->sent += (size_t)n;
                c->out_pending -= (size_t)n;
                if (o->sent == o->len)
                        out_buf_done(c, o);
        }
        return 0;
}

size_t varlink_conn_pending(const VarlinkConn *c) {
        return c->out_pending;
}

/* ---- Envelopes ---- */

bool varlink_name_is_valid(const char *name) {
        size_t len, words = 0;
        bool in_word = false;

        if (!name)
                return false;
        len = strlen(name);
        if (len == 0 || len > VARLINK_MAX_NAME)
                return false;
        for (const char *p = name; *p; p++) {
                char ch = *p;

                if (ch == '.') {
                        if (!in_word)
                                return false;
                        in_word = false;
                } else if ((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                           (ch >= '0' && ch <= '9') || ch == '_') {
                        if (!in_word)
                                words++;
                        in_word = true;
                } else
                        return false;
        }
        return in_word && words >= 2;
}

static const JsonField call_fields[] = {
        JSON_FIELD_STRING("method", VarlinkCall, method, true, VARLINK_MAX_NAME),
        JSON_FIELD_VARIANT("parameters", VarlinkCall, parameters, false),
        JSON_FIELD_BOOL("oneway", VarlinkCall, oneway, false),
        JSON_FIELD_BOOL("more", VarlinkCall, more, false),
        JSON_FIELD_END,
};

static const JsonField reply_fields[] = {
        JSON_FIELD_STRING("error", VarlinkReply, error, false, VARLINK_MAX_NAME),
        JSON_FIELD_VARIANT("parameters", VarlinkReply, parameters, false),
        JSON_FIELD_BOOL("continues", VarlinkReply, continues, false),
        JSON_FIELD_END,
};

int varlink_call_parse(json_object *msg, VarlinkCall *ret) {
        VarlinkCall call = {};
        int r;

        r = json_dispatch(msg, call_fields, &call, NULL, NULL);
        if (r == -ENOMEM)
                return r;
        if (r < 0)
                return -EBADMSG;
        if (!varlink_name_is_valid(call.method)) {
                json_dispatch_free(call_fields, &call);
                return -EBADMSG;
        }
        *ret = call;
        return 0;
}

void varlink_call_done(VarlinkCall *call) {
        json_dispatch_free(call_fields, call);
        *call = (VarlinkCall){};
}

int varlink_reply_parse(json_object *msg, VarlinkReply *ret) {
        VarlinkReply reply = {};
        int r;

        r = json_dispatch(msg, reply_fields, &reply, NULL, NULL);
        if (r == -ENOMEM)
                return r;
        if (r < 0)
                return -EBADMSG;
        if (reply.error && !varlink_name_is_valid(reply.error)) {
                json_dispatch_free(reply_fields, &reply);
                return -EBADMSG;
        }
        *ret = reply;
        return 0;
}

void varlink_reply_done(VarlinkReply *reply) {
        json_dispatch_free(reply_fields, reply);
        free(reply->parameters_text);
        *reply = (VarlinkReply){};
}

/* The envelope's fields that are kept as text by the *_parse_text() functions. */
#define CALL_PARAMETERS (&call_fields[1])
#define REPLY_PARAMETERS (&reply_fields[1])

int varlink_call_parse_text(const char *text, size_t len, VarlinkCall *ret) {
        _cleanup_(json_object_putp) json_object *msg = NULL;
        VarlinkCall call = {};
        const char *params;
        size_t params_len;
        int r;

        r = json_dispatch_text_raw(text, len, call_fields, &call, CALL_PARAMETERS, &params, &params_len);
        if (r < 0)
                return r;
        if (r > 0) {
                /* not sure of it: as it was read before */
                r = json_parse_message(text, len, &msg);
                return r < 0 ? r : varlink_call_parse(msg, ret);
        }
        if (!varlink_name_is_valid(call.method)) {
                json_dispatch_free(call_fields, &call);
                return -EBADMSG;
        }
        call.parameters_text = params;
        call.parameters_len = params_len;
        *ret = call;
        return 0;
}

int varlink_call_parameters(VarlinkCall *call) {
        int r;

        if (!call->parameters_text)
                return 0;
        r = json_parse_message(call->parameters_text, call->parameters_len, &call->parameters);
        if (r < 0)
                return r;
        call->parameters_text = NULL;
        call->parameters_len = 0;
        return 0;
}

int varlink_reply_parse_text_into(const char *text, size_t len, VarlinkReply *ret, const JsonField *fields, void *out,
                                  bool *ret_decoded) {
        _cleanup_(json_object_putp) json_object *msg = NULL;
        VarlinkReply reply = {};
        const char *params;
        size_t params_len;
        bool decoded;
        int r;

        if (ret_decoded)
                *ret_decoded = false;
        if (fields)
                r = json_dispatch_text_nested(text, len, reply_fields, &reply, REPLY_PARAMETERS, fields, out, &params,
                                              &params_len);
        else
                r = json_dispatch_text_raw(text, len, reply_fields, &reply, REPLY_PARAMETERS, &params, &params_len);
        if (r < 0)
                return r;
        if (r > 0) {
                r = json_parse_message(text, len, &msg);
                return r < 0 ? r : varlink_reply_parse(msg, ret);
        }
        decoded = fields && params;
        if (decoded && reply.error) {
                /* read as a successful reply's, but they are an error's: given as text, as they are */
                json_dispatch_free(fields, out);
                decoded = false;
        }
        if (reply.error && !varlink_name_is_valid(reply.error)) {
                /* decoded is false here: an error reply's parameters were given back above */
                json_dispatch_free(reply_fields, &reply);
                return -EBADMSG;
        }
        if (params && !decoded) {
                reply.parameters_text = strndup(params, params_len);
                if (!reply.parameters_text) {
                        json_dispatch_free(reply_fields, &reply);
                        return -ENOMEM;
                }
                reply.parameters_len = params_len;
        }
        if (ret_decoded)
                *ret_decoded = decoded;
        *ret = reply;
        return 0;
}

int varlink_reply_parse_text(const char *text, size_t len, VarlinkReply *ret) {
        return varlink_reply_parse_text_into(text, len, ret, NULL, NULL, NULL);
}

int varlink_reply_parameters(VarlinkReply *reply) {
        int r;

        if (!reply->parameters_text)
                return 0;
        r = json_parse_message(reply->parameters_text, reply->parameters_len, &reply->parameters);
        if (r < 0)
                return r;
        free(reply->parameters_text);
        reply->parameters_text = NULL;
        reply->parameters_len = 0;
        return 0;
}

/* Builds an envelope from `fields`, with {} standing in for NULL parameters. */
static int envelope_build(const JsonField *fields, void *in, json_object **pparams, json_object **ret) {
        _cleanup_(json_object_putp) json_object *empty = NULL;

        if (!*pparams) {
                empty = json_object_new_object();
                if (!empty)
                        return -ENOMEM;
                *pparams = empty;
        }
        return json_build(fields, in, ret);
}

int varlink_call_new(const char *method, json_object *parameters, bool oneway, bool more, json_object **ret) {
        VarlinkCall call = {
                .method = (char *)method,
                .parameters = parameters,
                .oneway = oneway,
                .more = more,
        };

        if (!varlink_name_is_valid(method))
                return -EINVAL;
        return envelope_build(call_fields, &call, &call.parameters, ret);
}

int varlink_reply_new(json_object *parameters, json_object **ret) {
        VarlinkReply reply = { .parameters = parameters };

        return envelope_build(reply_fields, &reply, &reply.parameters, ret);
}

int varlink_reply_new_continues(json_object *parameters, json_object **ret) {
        VarlinkReply reply = { .parameters = parameters, .continues = true };

        return envelope_build(reply_fields, &reply, &reply.parameters, ret);
}

int varlink_error_new(const char *error, json_object *parameters, json_object **ret) {
        VarlinkReply reply = { .error = (char *)error, .parameters = parameters };

        if (!varlink_name_is_valid(error))
                return -EINVAL;
        return envelope_build(reply_fields, &reply, &reply.parameters, ret);
}

/* ---- Messages as text ---- */

void varlink_text_done(VarlinkText *t) {
        free(t->data);
        *t = (VarlinkText){};
}

/* Writes s[0..n) at t->data[*at], growing the buffer as json_build_write() does (room for a NUL after it is kept). */
static int text_put(VarlinkText *t, size_t *at, const char *s, size_t n) {
        int r = json_buf_reserve(&t->data, &t->alloc, *at, n + 1);

        if (r < 0)
                return r;
        memcpy(t->data + *at, s, n);
        *at += n;
        return 0;
}

int varlink_call_write(VarlinkText *t, const char *method, const JsonField *fields, const void *in, bool oneway,
                       bool more) {
        static const JsonField no_fields[] = { JSON_FIELD_END };
        static const char head[] = "{\"method\":\"", mid[] = "\",\"parameters\":", ow[] = ",\"oneway\":true",
                          mo[] = ",\"more\":true";
        size_t at = 0;
        ssize_t end;
        int r;

        /* call_fields' order and choices, as json_build() of varlink_call_new()'s VarlinkCall makes them */
        t->len = 0;
        if (!varlink_name_is_valid(method))
                return -EINVAL;
        /* a valid name is words of [A-Za-z0-9_] joined by dots: written as it is, and never over max_len */
        r = text_put(t, &at, head, sizeof(head) - 1);
        if (r >= 0)
                r = text_put(t, &at, method, strlen(method));
        if (r >= 0)
                r = text_put(t, &at, mid, sizeof(mid) - 1);
        if (r < 0)
                return r;
        end = json_build_write(fields ?: no_fields, in, &t->data, &t->alloc, at);
        if (end < 0)
                return (int)end;
        at = (size_t)end;
        r = oneway ? text_put(t, &at, ow, sizeof(ow) - 1) : 0;
        if (r >= 0 && more)
                r = text_put(t, &at, mo, sizeof(mo) - 1);
        if (r >= 0)
                r = text_put(t, &at, "}", 1);
        if (r < 0)
                return r;
        t->data[at] = 0;        /* text_put() left room for it */
        t->len = at;
        return 0;
}

int varlink_reply_write(VarlinkText *t, const JsonField *fields, const void *in) {
        /* reply_fields with no error and no continues, the parameters written from their own table */
        const JsonField envelope[] = {
                { .name = "parameters", .type = JSON_OBJECT, .required = true, .offset = 0, .fields = fields },
                JSON_FIELD_END,
        };
        ssize_t end;

        end = json_build_write(envelope, in, &t->data, &t->alloc, 0);
        if (end < 0) {
                t->len = 0;
                return (int)end;
        }
        t->data[end] = 0;       /* json_build_write() left room for it */
        t->len = (size_t)end;
        return 0;
}
