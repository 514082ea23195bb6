/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Varlink framing on an AF_UNIX SOCK_STREAM socket: one JSON object per
 * message, each ended by a NUL byte. A VarlinkConn owns the socket, an input
 * buffer and an output queue; it does no event handling of its own, so the
 * daemon drives it from its event loop (non-blocking socket: read on EPOLLIN,
 * flush on EPOLLOUT) and the client calls it one request at a time (blocking
 * socket).
 *
 * File descriptors go with the first byte of the message that names them, and
 * a message that carries fds is sent alone in its own sendmsg(). Note that
 * Linux does NOT stop a stream read in front of an skb carrying fds: a
 * recvmsg() may return the tail of earlier messages and then the first bytes
 * of the fd-carrying one, with the fds (it stops right after that skb). So
 * the receiver attaches the fds of a read to the LAST message that begins
 * within that read (which is also the first when the read starts with it);
 * fds in a read where no message begins are a protocol error (-EPROTO).
 */

#include <json-c/json.h>
#include <stdbool.h>
#include <stddef.h>

#include "json.h"

/* Limits on one message, NUL included. */
#define VARLINK_MAX_REQUEST (64U * 1024U)          /* the daemon's, for calls */
#define VARLINK_MAX_REPLY (64U * 1024U * 1024U)    /* the client's, for replies */

/* Longest method or error name accepted. */
#define VARLINK_MAX_NAME 255

typedef struct VarlinkConn VarlinkConn;

/*
 * Makes a connection on the connected socket `fd`, which it owns from then on
 * (closed by varlink_conn_free()) on success only. `max_message` is the
 * largest incoming message, NUL included. With `accept_fds` false, any fd
 * received is closed and the read fails with -EPROTO. Returns 0, -EINVAL or
 * -ENOMEM.
 */
int varlink_conn_new(VarlinkConn **ret, int fd, size_t max_message, bool accept_fds);

/* Closes the socket and every fd still held, frees the connection; returns NULL. Accepts NULL. */
VarlinkConn *varlink_conn_free(VarlinkConn *c);

/* The socket, for the caller's event loop. */
int varlink_conn_get_fd(const VarlinkConn *c);

/*
 * Reads once from the socket (one recvmsg()) into the input buffer. Call it
 * when varlink_conn_next() returned 0. Moves buffered data, so a message
 * returned by varlink_conn_next() is invalid afterwards. Returns the number of
 * bytes read; 0 at the end of the stream between messages; -ECONNRESET at the
 * end of the stream inside a message; -EAGAIN when a non-blocking socket has
 * nothing; -EMSGSIZE when the message being read reaches the limit without its
 * NUL; -ENOBUFS when the buffer is full of complete messages not yet taken;
 * -EPROTO when fds arrived and are not accepted, or arrived where no message
 * begins (they are closed); -ENOMEM; or another negative errno from recvmsg().
 * After an error other than -EAGAIN, the connection is no good for input.
 */
int varlink_conn_read(VarlinkConn *c);

/*
 * Takes the next complete message from the input buffer, without reading.
 * Returns 1 and the message in *ret_message (NUL-terminated, inside the
 * connection's buffer: valid until the next varlink_conn_read() or
 * varlink_conn_free()) with its length, NUL excluded, in *ret_len; and the fds
 * that came with it in *ret_fds (a malloc'd array the caller owns, with the
 * fds: close them and free it; NULL when none) and *ret_n_fds. With ret_fds
 * NULL, the message's fds are closed. Returns 0 when no complete message is
 * buffered, -EMSGSIZE when the buffered part of the next message reaches the
 * limit, -ECONNRESET when the stream ended inside it.
 */
int varlink_conn_next(VarlinkConn *c, const char **ret_message, size_t *ret_len,
                      int **ret_fds, size_t *ret_n_fds);

/*
 * Whether a whole message is buffered, so that varlink_conn_next() would
 * return it without reading; or whether the buffered input is already an
 * error that varlink_conn_next() would report (over the limit, or the stream
 * ended inside a message). Costs nothing for bytes it looked at before.
 */
bool varlink_conn_has_message(VarlinkConn *c);

/*
 * Like varlink_conn_next(), but parses the message with json_parse_message()
 * into a new reference in *ret: -EBADMSG when it is not a strict JSON object
 * (the message is consumed and its fds closed).
 */
int varlink_conn_next_json(VarlinkConn *c, json_object **ret, int **ret_fds, size_t *ret_n_fds);

/*
 * Reads until a whole message is buffered and takes it as varlink_conn_next()
 * does: returns 1 with the message (valid until the next read), its length
 * and its fds. For a blocking socket (the client); on a non-blocking one it
 * returns -EAGAIN when the socket runs dry. The end of the stream between
 * messages is -ECONNRESET here too (a reply was expected); otherwise the
 * errors of varlink_conn_next() and varlink_conn_read().
 */
int varlink_conn_receive_text(VarlinkConn *c, const char **ret_message, size_t *ret_len, int **ret_fds,
                              size_t *ret_n_fds);

/*
 * varlink_conn_receive_text(), the message parsed as varlink_conn_next_json()
 * parses it.
 */
int varlink_conn_receive(VarlinkConn *c, json_object **ret, int **ret_fds, size_t *ret_n_fds);

/*
 * Queues `msg`, serialised plainly and ended by a NUL, with fds[0..n_fds)
 * riding on its first byte. The caller keeps its fds: the queue holds
 * close-on-exec duplicates and closes them once sent or dropped. Nothing is
 * written here: call varlink_conn_flush(). Returns 0; -E2BIG for more than
 * FDPASS_MAX_FDS fds; -EBADMSG when the serialisation holds a NUL; -ENOMEM;
 * or the error of dup().
 */
int varlink_conn_send(VarlinkConn *c, json_object *msg, const int *fds, size_t n_fds);

/*
 * A message written as text by varlink_reply_write() or varlink_call_write()
 * (or json_write() into data, with len and the NUL after it set), for
 * varlink_conn_send_text(): sent without building json-c objects. The text
 * holds no NUL, which would end the message early: the writers escape every
 * string (a NUL as \u0000) and refuse json-c's text for a double when it
 * holds one (-EBADMSG), so that the send path need not look for one.
 */
typedef struct VarlinkText {
        char *data;             /* malloc'd, NULL until written; reused by the next write */
        size_t len;             /* bytes of the message (0: nothing written); data[len] is a NUL */
        size_t alloc;
} VarlinkText;

/* Frees the text and zeroes *t. */
void varlink_text_done(VarlinkText *t);

/*
 * Writes into *t (replacing what it held) the reply {"parameters": {...}}
 * whose parameters are the struct `in` as the table `fields` says
 * (json_build_write()): the same bytes as json_write() of varlink_reply_new()
 * of json_build(fields, in). Returns 0, or json_build_write()'s error (then
 * t->len is 0).
 */
int varlink_reply_write(VarlinkText *t, const JsonField *fields, const void *in);

/*
 * Writes into *t (replacing what it held) the call {"method": method,
 * "parameters": {...}} ("oneway": true and "more": true when set) whose
 * parameters are the struct `in` as the table `fields` says (NULL: {}):
 * the same bytes as json_write() of varlink_call_new() of json_build(fields,
 * in), without making either object. Returns 0; -EINVAL for an invalid method
 * name; or json_build_write()'s error. On failure t->len is 0.
 */
int varlink_call_write(VarlinkText *t, const char *method, const JsonField *fields, const void *in, bool oneway,
                       bool more);

/*
 * Queues the message t->data[0..t->len), ended by a NUL, as
 * varlink_conn_send() queues a json-c one. The text must come from the
 * writers above: that it holds no NUL is asserted, not checked. Returns 0;
 * -EINVAL for an empty text; or varlink_conn_send()'s errors (-E2BIG, -ENOMEM,
 * dup()'s).
 */
int varlink_conn_send_text(VarlinkConn *c, const VarlinkText *t, const int *fds, size_t n_fds);

/*
 * Writes queued messages until the queue is empty (0), or the socket is full
 * (-EAGAIN: the rest stays queued; wait for EPOLLOUT and call again). A
 * message with fds goes alone in its own sendmsg(); messages without fds are
 * written together. Partial writes are resumed where they stopped. Other
 * negative errno values (-EPIPE, -ECONNRESET) mean the peer is gone.
 */
int varlink_conn_flush(VarlinkConn *c);

/* Bytes queued and not yet written. */
size_t varlink_conn_pending(const VarlinkConn *c);

/*
 * A varlink call as received: {"method": "...", "parameters": {...},
 * "oneway": bool, "more": bool}. Owns its strings and a reference to the
 * parameters object (NULL when absent).
 */
typedef struct VarlinkCall {
        char *method;
        json_object *parameters;
        bool oneway;
        bool more;
        /* varlink_call_parse_text(), when it read the envelope as text: the parameters' text (an object,
           checked as json_parse_message() checks it) inside the message, not NUL-terminated and borrowed
           (valid while the message is), parameters then NULL; NULL when absent or read into parameters */
        const char *parameters_text;
        size_t parameters_len;
} VarlinkCall;

/*
 * Reads a call envelope. The method must be a qualified name: dot-separated
 * non-empty words of [A-Za-z0-9_], at least two, at most VARLINK_MAX_NAME
 * bytes in all; parameters an object or absent; oneway and more booleans or
 * absent; no other key. Returns 0, -EBADMSG for anything else, or -ENOMEM.
 * Release with varlink_call_done().
 */
int varlink_call_parse(json_object *msg, VarlinkCall *ret);

/*
 * json_parse_message() of text[0..len) and varlink_call_parse() of it in one:
 * the same results, without making json-c objects for the envelope or the
 * parameters (json_dispatch_text_raw(); whatever it is not sure of goes the
 * json-c way, and then parameters holds the object). Returns 0, -EBADMSG or
 * -ENOMEM.
 */
int varlink_call_parse_text(const char *text, size_t len, VarlinkCall *ret);

/*
 * Makes call->parameters from call->parameters_text when the call was read as
 * text, for code that reads the parameters as json-c. Returns 0, -ENOMEM (or
 * -EBADMSG, which cannot happen for text varlink_call_parse_text() checked).
 */
int varlink_call_parameters(VarlinkCall *call);

/* Frees what a VarlinkCall holds and zeroes it. */
void varlink_call_done(VarlinkCall *call);

/*
 * A reply as received: {"parameters": {...}} or {"error": "...",
 * "parameters": {...}}, optionally with "continues": bool. Owns its strings
 * and a reference to the parameters (NULL when absent).
 */
typedef struct VarlinkReply {
        char *error;            /* NULL for a successful reply */
        json_object *parameters;
        bool continues;
        /* varlink_reply_parse_text(), when it read the envelope as text: a copy of the parameters' text (an
           object, checked as json_parse_message() checks it; malloc'd, NUL-terminated), parameters then
           NULL; NULL when absent or read into parameters */
        char *parameters_text;
        size_t parameters_len;
} VarlinkReply;

/*
 * Reads a reply envelope; an error name must be qualified like a method name.
 * Returns 0, -EBADMSG for anything else, -ENOMEM. Release with varlink_reply_done().
 */
int varlink_reply_parse(json_object *msg, VarlinkReply *ret);

/* json_parse_message() and varlink_reply_parse() in one, as varlink_call_parse_text() is for calls. */
int varlink_reply_parse_text(const char *text, size_t len, VarlinkReply *ret);

/*
 * varlink_reply_parse_text() that also reads a successful reply's parameters
 * into the struct `out` as the table `fields` says, in the same pass, where it
 * can: then *ret_decoded is true, `out` holds what json_dispatch() of the
 * parameters would put there (free it with json_dispatch_free()), and the
 * reply holds no parameters. Otherwise *ret_decoded is false, `out` holds
 * nothing, and the reply is as varlink_reply_parse_text() gives it: an error
 * reply, absent parameters, or parameters the table does not take without an
 * error (decode them as before, to get that error).
 */
int varlink_reply_parse_text_into(const char *text, size_t len, VarlinkReply *ret, const JsonField *fields, void *out,
                                  bool *ret_decoded);

/* Makes reply->parameters from reply->parameters_text, as varlink_call_parameters() does. */
int varlink_reply_parameters(VarlinkReply *reply);

/* Frees what a VarlinkReply holds and zeroes it. */
void varlink_reply_done(VarlinkReply *reply);

/*
 * NAME_decode_text() of the parameters of `m` (a VarlinkCall or a VarlinkReply) when they were read as text
 * (parameters_text), else NAME_decode() of their json-c object: the same results either way. The arguments
 * after `m` follow the parameters in both.
 */
#define VARLINK_PARAMETERS_DECODE(name, m, ...)                                                       \
        ((m)->parameters_text                                                                          \
                 ? name##_decode_text((m)->parameters_text, (m)->parameters_len, __VA_ARGS__)          \
                 : name##_decode((m)->parameters, __VA_ARGS__))

/*
 * Tells whether `name` is a qualified varlink name (interface.Member): words of
 * [A-Za-z0-9_] joined by single dots, at least two words, at most VARLINK_MAX_NAME bytes.
 */
bool varlink_name_is_valid(const char *name);

/*
 * Builds {"method": method, "parameters": parameters} (oneway/more when set).
 * `parameters` is borrowed (the envelope takes its own reference); NULL is {}.
 * Returns 0, -EINVAL for an invalid method name, -ENOMEM.
 */
int varlink_call_new(const char *method, json_object *parameters, bool oneway, bool more, json_object **ret);

/* Builds {"parameters": parameters}; parameters borrowed, NULL is {}. Returns 0 or -ENOMEM. */
int varlink_reply_new(json_object *parameters, json_object **ret);

/* Builds {"parameters": parameters, "continues": true}: one of several replies to a call with "more". */
int varlink_reply_new_continues(json_object *parameters, json_object **ret);

/*
 * Builds {"error": error, "parameters": parameters}; parameters borrowed, NULL
 * is {}. Returns 0, -EINVAL for an invalid error name, -ENOMEM.
 */
int varlink_error_new(const char *error, json_object *parameters, json_object **ret);
