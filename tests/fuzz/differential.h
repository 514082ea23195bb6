/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The text readers against the json-c path, on any bytes: what test-varlink.c
 * runs over the fuzz corpus and hostile messages, and what fuzz-daemon.c runs
 * on every message of every input.
 *
 * differential_check(text, len) reads the bytes as each kind of message the
 * text readers take, both ways, and returns NULL when the two agree (the same
 * result; the same contents, or the same bad field and message), else a
 * sentence saying where they differ:
 *   - a call envelope: varlink_call_parse_text() against json_parse_message()
 *     and varlink_call_parse(), the method, flags and parameters;
 *   - a reply envelope: varlink_reply_parse_text() against varlink_reply_parse();
 *     and read with its parameters in one pass (status_reply_parse_text(),
 *     alloc_reply_parse_text()) against varlink_reply_parse() then the decoder;
 *   - a parameters object, for Alloc, Free and Status calls
 *     (*_params_decode_text()) and Alloc, Free and Status replies
 *     (*_reply_decode_text()): the whole text, and the parameters of the
 *     envelope when it is one.
 * Contents are compared as the text their encoder makes of them.
 */

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "codec.h"
#include "json.h"
#include "macro.h"
#include "varlink.h"

/* The text of the object an encoder made in *o, k its result (NULL for a failed encode: a difference). */
static char *differential_text(int k, json_object **o) {
        char *buf = NULL;
        size_t alloc = 0;
        ssize_t n;

        if (k < 0 || !*o)
                return NULL;
        n = json_write(*o, &buf, &alloc, 0);
        if (n < 0) {
                free(buf);
                return NULL;
        }
        buf[n] = 0;
        return buf;
}

static bool differential_same_str(const char *a, const char *b) {
        return (!a && !b) || (a && b && strcmp(a, b) == 0);
}

/* Compares two decodes' results, bad fields and messages; on both succeeding, the encoded texts. */
static const char *differential_outcome(const char *what, int r1, int r2, const char *bad1, const char *bad2,
                                        const char *m1, const char *m2, const char *t1, const char *t2) {
        if (r1 != r2)
                return what;
        if (r1 < 0)
                return differential_same_str(bad1, bad2) && differential_same_str(m1, m2) ? NULL : what;
        return differential_same_str(t1, t2) && t1 ? NULL : what;
}

/*
 * DIFFERENTIAL_DECODER() defines, for one codec with a text decoder,
 *
 *         static const char *differential_NAME(const char *text, size_t len, json_object *o, size_t n_fds);
 *
 * which reads the parameters both ways, `o` (their json-c reading, NULL: absent) with the json-c decoder and
 * text[0..len) (NULL text: absent) with the text decoder, and returns NULL when the two agree by
 * differential_outcome(), else `what`. The two calls are given whole, as the codecs' decoders take different
 * arguments: they read into `a` and `b` (of `type`), the bad field into bad1 and bad2 where the codec names
 * one, the message into m1 and m2; n_fds is for Alloc's reply, the others ignore it. `also`, a function of
 * `a` and `b` or NULL, is the codec's own further check, once both succeeded with the same text, of what its
 * encoder leaves out; it returns NULL or its own sentence.
 */
#define DIFFERENTIAL_DECODER(name, type, what, decode, decode_text, encode, done, also)                        \
        static const char *differential_##name(const char *text, size_t len, json_object *o, size_t n_fds) {   \
                _cleanup_free_ char *m1 = NULL, *m2 = NULL, *t1 = NULL, *t2 = NULL, *b1 = NULL;               \
                _cleanup_(json_object_putp) json_object *e1 = NULL, *e2 = NULL;                                \
                const char *(*also_check)(const type *, const type *) = also;                                  \
                const char *bad1 = NULL, *bad2 = NULL, *why;                                                   \
                type a = {}, b = {};                                                                           \
                int r1, r2;                                                                                    \
                                                                                                               \
                r1 = decode;                                                                                   \
                b1 = bad1 ? strdup(bad1) : NULL;                                                               \
                r2 = decode_text;                                                                              \
                if (r1 == 0)                                                                                   \
                        t1 = differential_text(encode(&a, &e1), &e1);                                          \
                if (r2 == 0)                                                                                   \
                        t2 = differential_text(encode(&b, &e2), &e2);                                          \
                why = differential_outcome(what, r1, r2, b1, bad2, m1, m2, t1, t2);                            \
                if (!why && r1 == 0 && also_check)                                                             \
                        why = also_check(&a, &b);                                                              \
                if (r1 == 0)                                                                                   \
                        done(&a);                                                                              \
                if (r2 == 0)                                                                                   \
                        done(&b);                                                                              \
                return why;                                                                                    \
        }

/* Alloc's encoder leaves a wait_usec of 0 out, as it does an absent one (-1): told apart here. */
static const char *differential_alloc_params_wait(const AllocParams *a, const AllocParams *b) {
        return a->wait_usec == b->wait_usec ? NULL : "Alloc parameters (wait_usec)";
}

/* Status's parameters are none: the EmptyParams is only there to fit DIFFERENTIAL_DECODER(); a success is {}. */
static int differential_empty_params_encode(const EmptyParams *p, json_object **ret) {
        return empty_params_encode(ret);
}

static void differential_empty_params_done(EmptyParams *p) {
}

DIFFERENTIAL_DECODER(alloc_params, AllocParams, "Alloc parameters",
                     alloc_params_decode(o, &a, &bad1, &m1),
                     alloc_params_decode_text(text, len, &b, &bad2, &m2),
                     alloc_params_encode, alloc_params_done, differential_alloc_params_wait);
DIFFERENTIAL_DECODER(free_params, FreeParams, "Free parameters",
                     free_params_decode(o, &a, &bad1, &m1),
                     free_params_decode_text(text, len, &b, &bad2, &m2),
                     free_params_encode, free_params_done, NULL);
DIFFERENTIAL_DECODER(empty_params, EmptyParams, "Status parameters",
                     empty_params_decode(o, &bad1, &m1),
                     empty_params_decode_text(text, len, &bad2, &m2),
                     differential_empty_params_encode, differential_empty_params_done, NULL);
DIFFERENTIAL_DECODER(status_reply, StatusReply, "Status reply",
                     status_reply_decode(o, &a, &m1),
                     status_reply_decode_text(text, len, &b, &m2),
                     status_reply_encode, status_reply_done, NULL);
DIFFERENTIAL_DECODER(alloc_reply, AllocReply, "Alloc reply",
                     alloc_reply_decode(o, n_fds, &a, &m1),
                     alloc_reply_decode_text(text, len, n_fds, &b, &m2),
                     alloc_reply_encode, alloc_reply_done, NULL);
DIFFERENTIAL_DECODER(free_reply, FreeReply, "Free reply",
                     free_reply_decode(o, &a, &m1),
                     free_reply_decode_text(text, len, &b, &m2),
                     free_reply_encode, free_reply_done, NULL);

/* One parameters object (NULL text: absent), text[0..len) against `o` (its json-c reading, NULL: absent), as
 * the parameters of each call and reply that has a text decoder. */
static const char *differential_params(const char *text, size_t len, json_object *o) {
        const char *why;

        why = differential_alloc_params(text, len, o, 0) ?: differential_free_params(text, len, o, 0) ?:
              differential_empty_params(text, len, o, 0) ?: differential_status_reply(text, len, o, 0);
        /* Alloc's reply, as if 0, 1 or 2 fds came with it */
        for (size_t n_fds = 0; !why && n_fds <= 2; n_fds++)
                why = differential_alloc_reply(text, len, o, n_fds);
        return why ?: differential_free_reply(text, len, o, 0);
}

/* Whether a text reader's parameters (object, or text to read) are the json-c reading's `o`. */
static bool differential_same_parameters(json_object *o, json_object *obj, const char *text, size_t len) {
        _cleanup_(json_object_putp) json_object *parsed = NULL;

        if (text) {
                if (obj || json_parse_message(text, len, &parsed) < 0)
                        return false;
                obj = parsed;
        }
        if (!o || !obj)
                return !o && !obj;
        return json_object_equal(o, obj);
}

/* A reply read with its Status or Alloc parameters in one pass, against varlink_reply_parse() and the decoder. */
static const char *differential_reply_into(const char *text, size_t len, json_object *msg, int r, bool alloc) {
        _cleanup_free_ char *t1 = NULL, *t2 = NULL, *m1 = NULL, *m2 = NULL;
        _cleanup_(json_object_putp) json_object *e1 = NULL, *e2 = NULL;
        VarlinkReply a = {}, b = {};
        StatusReply sa = {}, sb = {};
        AllocReply aa = {}, ab = {};
        const char *why = NULL;
        bool decoded = false;
        int r1, r2, d1 = -1, d2;

        r1 = r == 0 ? varlink_reply_parse(msg, &a) : r;
        r2 = alloc ? alloc_reply_parse_text(text, len, &b, &ab, &decoded)
                   : status_reply_parse_text(text, len, &b, &sb, &decoded);
        if (r1 != r2)
                why = "reply read with its parameters";
        else if (r1 == 0 && (!differential_same_str(a.error, b.error) || a.continues != b.continues))
                why = "reply read with its parameters: envelope";
        else if (r1 == 0 && decoded && (b.error || b.parameters || b.parameters_text))
                why = "reply read with its parameters: decoded and kept";
        else if (r1 == 0 && !decoded &&
                 !differential_same_parameters(a.parameters, b.parameters, b.parameters_text, b.parameters_len))
                why = "reply read with its parameters: parameters";
        else if (r1 == 0 && decoded) {
                /* what the decoder makes of the json-c reading */
                if (alloc) {
                        d1 = alloc_reply_decode(a.parameters, 1, &aa, &m1);
                        d2 = alloc_reply_check_fds(&ab, 1, &m2);
                        decoded = false;        /* ab is freed by a failed check, else below */
                        if (d1 == 0)
                                t1 = differential_text(alloc_reply_encode(&aa, &e1), &e1);
                        if (d2 == 0)
                                t2 = differential_text(alloc_reply_encode(&ab, &e2), &e2);
                        why = differential_outcome("reply read with Alloc's parameters", d1, d2, NULL, NULL, m1, m2,
                                                   t1, t2);
                        if (d1 == 0)
                                alloc_reply_done(&aa);
                        if (d2 == 0)
                                alloc_reply_done(&ab);
                } else {
                        d1 = status_reply_decode(a.parameters, &sa, &m1);
                        if (d1 == 0) {
                                t1 = differential_text(status_reply_encode(&sa, &e1), &e1);
                                t2 = differential_text(status_reply_encode(&sb, &e2), &e2);
                                status_reply_done(&sa);
                        }
                        why = differential_outcome("reply read with Status's parameters", d1, 0, NULL, NULL, m1,
                                                   NULL, t1, t2);
                }
        }
        if (decoded) {
                if (alloc)
                        alloc_reply_done(&ab);
                else
                        status_reply_done(&sb);
        }
        varlink_reply_done(&a);
        varlink_reply_done(&b);
        return why;
}

static const char *differential_check(const char *text, size_t len) {
        _cleanup_(json_object_putp) json_object *msg = NULL;
        const char *why;
        int r;

        r = json_parse_message(text, len, &msg);

        /* the whole text as a parameters object */
        if (r == 0)
                why = differential_params(text, len, msg);
        else {
                /* every text reader refuses it as the json-c path does: -EBADMSG, nothing named */
                why = NULL;
                for (int i = 0; i < 3 && !why; i++) {
                        _cleanup_free_ char *m = NULL;
                        const char *bad = NULL;
                        AllocParams a = {};
                        FreeParams f = {};
                        int k = i == 0 ? alloc_params_decode_text(text, len, &a, &bad, &m)
                              : i == 1 ? free_params_decode_text(text, len, &f, &bad, &m)
                                       : empty_params_decode_text(text, len, &bad, &m);

                        if (k != r || bad || m)
                                why = "parameters that json-c refuses";
                }
                if (!why) {
                        StatusReply s = {};
                        AllocReply a = {};
                        FreeReply f = {};

                        if (status_reply_decode_text(text, len, &s, NULL) != r ||
                            alloc_reply_decode_text(text, len, 0, &a, NULL) != r ||
                            free_reply_decode_text(text, len, &f, NULL) != r)
                                why = "a reply that json-c refuses";
                }
        }
        if (why)
                return why;

        {       /* a call envelope, then its parameters */
                VarlinkCall a = {}, b = {};
                int r1, r2;

                r1 = r == 0 ? varlink_call_parse(msg, &a) : r;
                r2 = varlink_call_parse_text(text, len, &b);
                if (r1 != r2)
                        why = "call envelope";
                else if (r1 == 0 && (strcmp(a.method, b.method) != 0 || a.oneway != b.oneway || a.more != b.more ||
                                     !differential_same_parameters(a.parameters, b.parameters, b.parameters_text,
                                                                   b.parameters_len)))
                        why = "call envelope contents";
                else if (r1 == 0 && b.parameters_text)
                        why = differential_params(b.parameters_text, b.parameters_len, a.parameters);
                else if (r1 == 0 && !b.parameters && !b.parameters_text)
                        why = differential_params(NULL, 0, NULL);
                varlink_call_done(&a);
                varlink_call_done(&b);
                if (why)
                        return why;
        }
        {       /* a reply envelope */
                VarlinkReply a = {}, b = {};
                int r1, r2;

                r1 = r == 0 ? varlink_reply_parse(msg, &a) : r;
                r2 = varlink_reply_parse_text(text, len, &b);
                if (r1 != r2)
                        why = "reply envelope";
                else if (r1 == 0 && (!differential_same_str(a.error, b.error) || a.continues != b.continues ||
                                     !differential_same_parameters(a.parameters, b.parameters, b.parameters_text,
                                                                   b.parameters_len)))
                        why = "reply envelope contents";
                else if (r1 == 0 && b.parameters_text && varlink_reply_parameters(&b) < 0)
                        why = "reply parameters read again";
                varlink_reply_done(&a);
                varlink_reply_done(&b);
        }
        if (!why)
                why = differential_reply_into(text, len, msg, r, false);
        if (!why)
                why = differential_reply_into(text, len, msg, r, true);
        return why;
}
