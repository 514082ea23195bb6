/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Strict JSON for the wire, on json-c.
 *
 * json-c's tokener is lenient even with JSON_TOKENER_STRICT (it takes NaN,
 * Infinity, single quotes, raw control characters in strings, overlong UTF-8
 * and UTF-16 surrogates, clamps out-of-range integers and keeps the last of
 * duplicate keys), so json_parse_message() reads the text itself, against the
 * RFC 8259 grammar, and builds with json-c's constructors the tree the
 * tokener would have built: one pass, no tokener.
 *
 * Parameters are read through a table of JsonField, in the style of systemd's
 * json_dispatch(): each field names a member of a C struct, its type and its
 * limits. The same table serialises the struct (json_build(), or straight
 * to text with json_build_write()), so a codec is one table and the two sides
 * cannot disagree.
 *
 * Optional fields have an "absent" value instead of a presence flag; dispatch
 * always writes every member of the table, so the struct needs no set-up:
 *   - JSON_STRING: NULL;
 *   - JSON_INT64 with .nonnegative: -1 (JSON_ABSENT);
 *   - JSON_BOOL: false;
 *   - JSON_ARRAY, JSON_STRV, JSON_UINT64V: NULL (and a count of 0);
 *   - JSON_VARIANT: NULL.
 * JSON null is taken as absent for an optional field. Other types cannot be
 * optional (dispatch returns -EINVAL for such a table). json_build() omits a
 * field holding its absent value (NULL string, array or variant, negative
 * optional integer, false optional boolean).
 *
 * Strings are copied (strdup) into the struct: they outlive the JSON object.
 * json_dispatch_free() frees them, and every array, and sets them to NULL.
 */

#include <json-c/json.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* Most containers nested in one message (the top-level object counts as 1). */
#define VARLINK_MAX_DEPTH 16

/* Value of an optional, non-negative JSON_INT64 member when the field is absent. */
#define JSON_ABSENT INT64_C(-1)

typedef enum JsonType {
        JSON_INT64,  /* int64_t; with .nonnegative, 0..INT64_MAX */
        JSON_UINT64, /* uint64_t, 0..INT64_MAX (the range every varlink peer can read) */
        JSON_BOOL,   /* bool */
        JSON_STRING, /* char *: printable UTF-8 of at most .max_len bytes */
        JSON_OBJECT, /* a struct embedded at .offset, described by .fields */
        JSON_ARRAY,  /* an array of objects: a pointer at .offset to .elem_size-byte elements
                        described by .fields, their count a size_t at .count_offset */
        JSON_VARIANT, /* json_object *: any JSON object, kept as a new reference that
                         json_dispatch_free() drops */
        JSON_STRV,   /* char **: a NULL-terminated array of strings of at most .max_len bytes
                        each, their count a size_t at .count_offset */
        JSON_UINT64V, /* uint64_t *: an array of at most .max_len integers, each 0..INT64_MAX,
                         their count a size_t at .count_offset */
} JsonType;

typedef struct JsonField {
        const char *name;        /* the JSON key; NULL ends a table */
        JsonType type;
        bool required;           /* absent or null is an error */
        bool nonnegative;        /* JSON_INT64: refuse negative values */
        bool multiline;          /* JSON_STRING, JSON_STRV: also allow newline and tab */
        size_t offset;           /* of the member in the struct */
        size_t max_len;          /* JSON_STRING, JSON_STRV: bytes of a string; JSON_ARRAY, JSON_UINT64V: elements;
                                    0: no limit beyond the message size */
        const struct JsonField *fields; /* JSON_OBJECT, JSON_ARRAY: the nested table */
        size_t elem_size;        /* JSON_ARRAY: sizeof one element */
        size_t count_offset;     /* JSON_ARRAY, JSON_STRV, JSON_UINT64V: offset of a size_t element count */
} JsonField;

/* Table entries. `st` is the struct type, `m` the member; the member's C type is checked. */
#define JSON_MEMBER_(st, m, ctype)                                                       \
        (offsetof(st, m) +                                                               \
         0 * sizeof(struct {                                                             \
                 _Static_assert(__builtin_types_compatible_p(__typeof__(((st *)0)->m), ctype), \
                                "member " #m " of " #st " is not " #ctype);              \
                 int dummy_;                                                             \
         }))
#define JSON_FIELD_INT64(n, st, m, req, nonneg)                                          \
        { .name = (n), .type = JSON_INT64, .required = (req), .nonnegative = (nonneg),   \
          .offset = JSON_MEMBER_(st, m, int64_t) }
#define JSON_FIELD_UINT64(n, st, m)                                                      \
        { .name = (n), .type = JSON_UINT64, .required = true, .offset = JSON_MEMBER_(st, m, uint64_t) }
#define JSON_FIELD_BOOL(n, st, m, req)                                                   \
        { .name = (n), .type = JSON_BOOL, .required = (req), .offset = JSON_MEMBER_(st, m, bool) }
#define JSON_FIELD_STRING(n, st, m, req, max)                                            \
        { .name = (n), .type = JSON_STRING, .required = (req), .offset = JSON_MEMBER_(st, m, char *), \
          .max_len = (max) }
#define JSON_FIELD_TEXT(n, st, m, req, max)                                              \
        { .name = (n), .type = JSON_STRING, .required = (req), .multiline = true,        \
          .offset = JSON_MEMBER_(st, m, char *), .max_len = (max) }
#define JSON_FIELD_OBJECT(n, st, m, etype, tbl)                                          \
        { .name = (n), .type = JSON_OBJECT, .required = true, .offset = JSON_MEMBER_(st, m, etype), \
          .fields = (tbl) }
#define JSON_FIELD_ARRAY(n, st, m, cnt, etype, tbl, req, max)                            \
        { .name = (n), .type = JSON_ARRAY, .required = (req), .offset = JSON_MEMBER_(st, m, etype *), \
          .count_offset = JSON_MEMBER_(st, cnt, size_t), .elem_size = sizeof(etype),     \
          .fields = (tbl), .max_len = (max) }
#define JSON_FIELD_STRV(n, st, m, cnt, req, max)                                         \
        { .name = (n), .type = JSON_STRV, .required = (req), .offset = JSON_MEMBER_(st, m, char **), \
          .count_offset = JSON_MEMBER_(st, cnt, size_t), .max_len = (max) }
#define JSON_FIELD_UINT64V(n, st, m, cnt, req, max)                                      \
        { .name = (n), .type = JSON_UINT64V, .required = (req), .offset = JSON_MEMBER_(st, m, uint64_t *), \
          .count_offset = JSON_MEMBER_(st, cnt, size_t), .max_len = (max) }
#define JSON_FIELD_VARIANT(n, st, m, req)                                                 \
        { .name = (n), .type = JSON_VARIANT, .required = (req), .offset = JSON_MEMBER_(st, m, json_object *) }
#define JSON_FIELD_END { .name = NULL }

/*
 * Parses buf[0..len) as one message: strict RFC 8259 JSON whose only value is
 * an object (whitespace around it is allowed, nothing else), valid UTF-8 with
 * no overlong forms, surrogates or embedded NUL (raw or \u0000), no unpaired
 * \u surrogate escapes, no duplicate keys, at most VARLINK_MAX_DEPTH nested
 * containers, and no integer json-c would clamp (outside
 * INT64_MIN..UINT64_MAX). Returns 0 and a new reference in *ret, -EBADMSG when
 * the text breaks any rule, or -ENOMEM.
 */
int json_parse_message(const char *buf, size_t len, json_object **ret);

/*
 * Reads `params` (an object, or NULL for an empty one) into the struct `out`
 * as the table `fields` says. Every member in the table is written (absent
 * optional fields get their absent value, see above); members must not hold
 * anything to free on entry. Rejects unknown keys, wrong JSON types (1.0 is
 * not an integer), missing required fields, integers out of range and strings
 * that are too long, not printable or hold control characters.
 *
 * Returns 0; -EINVAL for a parameter error, with the top-level key in
 * *ret_bad_field (pointing into the table or, for an unknown key, into
 * `params`: valid while params lives) and a sentence in *ret_message (through
 * set_message(); both outputs may be NULL); -EBADMSG when params is not an
 * object; -ENOMEM. On failure the struct's strings and arrays are freed.
 */
int json_dispatch(json_object *params, const JsonField *fields, void *out,
                  const char **ret_bad_field, char **ret_message);

/*
 * json_parse_message() of text[0..len) and json_dispatch() of the object in
 * one, without making the object: the same struct contents, or the same error,
 * *ret_bad_field and *ret_message (-EBADMSG, with no bad field and no message,
 * for text json_parse_message() refuses). NULL text is an absent (empty)
 * object. For an unknown key, *ret_bad_field points into *ret_message's
 * allocation, after the sentence's NUL (valid while that lives; NULL when
 * ret_message is NULL). It reads what it is sure of straight into `out` and
 * leaves everything else, errors included, to the json-c path (json.c says
 * how).
 */
int json_dispatch_text(const char *text, size_t len, const JsonField *fields, void *out,
                       const char **ret_bad_field, char **ret_message);

/*
 * The fast path of json_dispatch_text() for a message whose top-level
 * JSON_VARIANT field `raw` is not parsed but kept as text. Returns 0 when
 * json_parse_message() would take the whole text and json_dispatch() read it
 * without error: `out` filled as json_dispatch() fills it, except that the raw
 * field's member is NULL and its value's text (an object) is
 * *ret_raw[0..*ret_raw_len), inside `text` (NULL when absent or null).
 * Returns 1 when it cannot be sure (an error, or text it does not take: use
 * the json-c path), nothing held; or -ENOMEM.
 */
int json_dispatch_text_raw(const char *text, size_t len, const JsonField *fields, void *out, const JsonField *raw,
                           const char **ret_raw, size_t *ret_raw_len);

/*
 * json_dispatch_text_raw() that also reads the raw field's object, in the same
 * pass, into the struct `raw_out` as the table `raw_fields` says. Returns 0
 * only when, besides what json_dispatch_text_raw() says, json_dispatch() of
 * that object with raw_fields would succeed: then `raw_out` holds what it would
 * (free it with json_dispatch_free()) when *ret_raw is not NULL; with the field
 * absent or null (*ret_raw NULL) `raw_out` holds nothing. Returns 1 (nothing
 * held in either struct) or -ENOMEM otherwise.
 */
int json_dispatch_text_nested(const char *text, size_t len, const JsonField *fields, void *out, const JsonField *raw,
                              const JsonField *raw_fields, void *raw_out, const char **ret_raw, size_t *ret_raw_len);

/* Frees the strings and arrays that json_dispatch() put in `out`, recursively, and sets them to NULL. */
void json_dispatch_free(const JsonField *fields, void *out);

/*
 * Serialises the struct `in` as a new JSON object, as json_build_write()
 * writes it (below): its text read back. Returns 0 and a new reference in
 * *ret, or json_build_write()'s errors.
 */
int json_build(const JsonField *fields, const void *in, json_object **ret);

/*
 * Makes room in *buf (malloc'd, *alloc bytes; NULL and 0 are fine) for n
 * bytes from offset `at` on, as json_write() grows its buffer: to twice its
 * size or what is needed, whichever is more, and 256 bytes at the least. For
 * the code that writes messages into such a buffer piece by piece (varlink.c).
 * Returns 0, or -ENOMEM with *buf and *alloc as they were.
 */
int json_buf_reserve(char **buf, size_t *alloc, size_t at, size_t n);

/*
 * Writes `o` into *buf (malloc'd, *alloc bytes; NULL and 0 are fine) from
 * offset `at` on, growing it as needed: the same bytes as
 * json_object_to_json_string_ext(o, JSON_C_TO_STRING_PLAIN |
 * JSON_C_TO_STRING_NOSLASHESCAPE) makes, for any tree of json-c's standard
 * objects (doubles are written by json-c itself). The text holds no NUL: a
 * string's is escaped. Returns the offset after the text, with room left for
 * one byte more (varlink's NUL); -EBADMSG when json-c's text for a double
 * holds a NUL; or -ENOMEM. *buf and *alloc are updated either way, and the
 * bytes before `at` kept.
 */
ssize_t json_write(json_object *o, char **buf, size_t *alloc, size_t at);

/*
 * Writes the struct `in` as the table `fields` says into *buf from offset
 * `at` on, as json_write() writes JSON: the fields in the table's order,
 * optional fields holding their absent value left out. Strings are made
 * acceptable to json_dispatch(): invalid UTF-8 and control characters become
 * '?', and a string longer than .max_len is cut at a character boundary.
 * Returns the offset after the text, with room left for one byte more;
 * -EINVAL when a required string or array is NULL or a table is malformed;
 * -ERANGE for a JSON_UINT64 above INT64_MAX or a negative JSON_INT64 marked
 * non-negative and required; -ENOMEM; or json_write()'s errors for a
 * JSON_VARIANT member. *buf and *alloc are updated either way, and the bytes
 * before `at` kept; after an error the bytes from `at` on are garbage. It is
 * the one walk of a table that writes: json_build() reads its text back.
 */
ssize_t json_build_write(const JsonField *fields, const void *in, char **buf, size_t *alloc, size_t at);

/*
 * Tells whether s[0..len) is valid UTF-8 (no overlong forms, surrogates or
 * code points above U+10FFFF) holding no control character (C0, DEL, C1),
 * except newline and tab when `multiline`.
 */
bool json_string_is_printable(const char *s, size_t len, bool multiline);

/*
 * Copies s[0..len) into dst as a string json_string_is_printable() accepts:
 * bytes that are not UTF-8 and control characters become '?', and it is cut at
 * a character boundary to at most max_len bytes (0: no limit; dst has room for
 * max_len, or len when there is none). No NUL is added. Returns the bytes
 * written.
 */
size_t json_printable_copy(char *dst, const char *s, size_t len, size_t max_len, bool multiline);

/* Drops a json-c reference held in *p; for _cleanup_(json_object_putp). */
static inline void json_object_putp(json_object **p) {
        if (*p)
                json_object_put(*p);
}
