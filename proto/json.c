/* SPDX-License-Identifier: MIT */

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "json.h"
#include "macro.h"
#include "message.h"

/* ---- UTF-8 ---- */

/*
 * Decodes one UTF-8 character from s[0..len) (len > 0). Returns its length in
 * bytes and the code point in *ret_cp, or 0 when the bytes are not a shortest
 * form of a scalar value (overlong forms, surrogates, above U+10FFFF, cut
 * short).
 */
static size_t utf8_decode(const uint8_t *s, size_t len, uint32_t *ret_cp) {
        uint8_t c = s[0], lo = 0x80, hi = 0xbf;
        uint32_t cp;
        size_t n;

        if (c < 0x80) {
                *ret_cp = c;
                return 1;
        }
        if (c >= 0xc2 && c <= 0xdf) {
                n = 2;
                cp = c & 0x1f;
        } else if (c >= 0xe0 && c <= 0xef) {
                n = 3;
                cp = c & 0x0f;
                if (c == 0xe0)
                        lo = 0xa0;      /* no overlong 3-byte forms */
                else if (c == 0xed)
                        hi = 0x9f;      /* no surrogates */
        } else if (c >= 0xf0 && c <= 0xf4) {
                n = 4;
                cp = c & 0x07;
                if (c == 0xf0)
                        lo = 0x90;      /* no overlong 4-byte forms */
                else if (c == 0xf4)
                        hi = 0x8f;      /* nothing above U+10FFFF */
        } else
                return 0;
        if (len < n)
                return 0;
        for (size_t i = 1; i < n; i++) {
                uint8_t b = s[i];

                if (b < (i == 1 ? lo : 0x80) || b > (i == 1 ? hi : 0xbf))
                        return 0;
                cp = (cp << 6) | (b & 0x3f);
        }
        *ret_cp = cp;
        return n;
}

static bool is_control(uint32_t cp, bool multiline) {
        if (multiline && (cp == '\n' || cp == '\t'))
                return false;
        return cp < 0x20 || (cp >= 0x7f && cp < 0xa0);
}

bool json_string_is_printable(const char *s, size_t len, bool multiline) {
        const uint8_t *p = (const uint8_t *)s;

        for (size_t i = 0; i < len;) {
                uint32_t cp;
                size_t n = utf8_decode(p + i, len - i, &cp);

                if (n == 0 || is_control(cp, multiline))
                        return false;
                i += n;
        }
        return true;
}

size_t json_printable_copy(char *dst, const char *s, size_t len, size_t max_len, bool multiline) {
        const uint8_t *p = (const uint8_t *)s;
        size_t o = 0;

        for (size_t i = 0; i < len;) {
                uint32_t cp;
                size_t n = utf8_decode(p + i, len - i, &cp);

                if (n == 0 || is_control(cp, multiline)) {
                        if (max_len > 0 && o + 1 > max_len)
                                break;
                        dst[o++] = '?';
                        i += n == 0 ? 1 : n;
                        continue;
                }
                if (max_len > 0 && o + n > max_len)
                        break;
                memcpy(dst + o, p + i, n);
                o += n;
                i += n;
        }
        return o;
}

/* json_printable_copy() into a new NUL-terminated string. */
static char *printable_dup(const char *s, size_t max_len, bool multiline, size_t *ret_len) {
        size_t len = strlen(s);
        char *d = malloc(len + 1);

        if (!d)
                return NULL;
        *ret_len = json_printable_copy(d, s, len, max_len, multiline);
        d[*ret_len] = 0;
        return d;
}

/* ---- The grammar check ---- */

typedef struct Scan {
        const uint8_t *p;
        const uint8_t *end;
        unsigned depth;
        size_t members;         /* object members seen, to find duplicate keys afterwards */
} Scan;

static void scan_ws(Scan *s) {
        while (s->p < s->end && (*s->p == ' ' || *s->p == '\t' || *s->p == '\n' || *s->p == '\r'))
                s->p++;
}

static bool scan_char(Scan *s, uint8_t c) {
        if (s->p >= s->end || *s->p != c)
                return false;
        s->p++;
        return true;
}

static int hex_value(uint8_t c) {
        if (c >= '0' && c <= '9')
                return c - '0';
        if (c >= 'a' && c <= 'f')
                return c - 'a' + 10;
        if (c >= 'A' && c <= 'F')
                return c - 'A' + 10;
        return -1;
}

/* Reads the XXXX of a \uXXXX escape; s->p is after the 'u'. */
static bool scan_hex4(Scan *s, uint32_t *ret) {
        uint32_t v = 0;

        if (s->end - s->p < 4)
                return false;
        for (int i = 0; i < 4; i++) {
                int h = hex_value(s->p[i]);

                if (h < 0)
                        return false;
                v = (v << 4) | (uint32_t)h;
        }
        s->p += 4;
        *ret = v;
        return true;
}

static bool scan_string(Scan *s) {
        if (!scan_char(s, '"'))
                return false;
        for (;;) {
                uint32_t cp;
                size_t n;
                uint8_t c;

                if (s->p >= s->end)
                        return false;
                c = *s->p;
                if (c == '"') {
                        s->p++;
                        return true;
                }
                if (c == '\\') {
                        s->p++;
                        if (s->p >= s->end)
                                return false;
                        c = *s->p++;
                        if (strchr("\"\\/bfnrt", c) && c != 0)
                                continue;
                        if (c != 'u' || !scan_hex4(s, &cp))
                                return false;
                        if (cp == 0)
                                return false;   /* json-c keys are C strings: no NUL anywhere */
                        if (cp >= 0xdc00 && cp <= 0xdfff)
                                return false;   /* a low surrogate alone */
                        if (cp >= 0xd800 && cp <= 0xdbff) {
                                if (!scan_char(s, '\\') || !scan_char(s, 'u') || !scan_hex4(s, &cp))
                                        return false;
                                if (cp < 0xdc00 || cp > 0xdfff)
                                        return false;
                        }
                        continue;
                }
                if (c < 0x20)
                        return false;           /* raw control characters must be escaped */
                n = utf8_decode(s->p, (size_t)(s->end - s->p), &cp);
                if (n == 0)
                        return false;
                s->p += n;
        }
}

static bool is_digit(const Scan *s) {
        return s->p < s->end && *s->p >= '0' && *s->p <= '9';
}

/* Compares two runs of decimal digits without leading zeros. */
static int digits_cmp(const uint8_t *a, size_t a_len, const char *b) {
        size_t b_len = strlen(b);

        if (a_len != b_len)
                return a_len < b_len ? -1 : 1;
        return memcmp(a, b, a_len);
}

static bool scan_number(Scan *s) {
        const uint8_t *digits;
        bool negative, integer = true;
        size_t n_digits;

        negative = scan_char(s, '-');
        digits = s->p;
        if (scan_char(s, '0'))
                ;
        else if (is_digit(s) && *s->p != '0')
                while (is_digit(s))
                        s->p++;
        else
                return false;
        n_digits = (size_t)(s->p - digits);
        if (scan_char(s, '.')) {
                integer = false;
                if (!is_digit(s))
                        return false;
                while (is_digit(s))
                        s->p++;
        }
        if (s->p < s->end && (*s->p == 'e' || *s->p == 'E')) {
                integer = false;
                s->p++;
                if (!scan_char(s, '+'))
                        (void)scan_char(s, '-');
                if (!is_digit(s))
                        return false;
                while (is_digit(s))
                        s->p++;
        }
        /* json-c would silently clamp these; refuse rather than change a value */
        if (integer && digits_cmp(digits, n_digits, negative ? "9223372036854775808" : "18446744073709551615") > 0)
                return false;
        return true;
}

static bool scan_literal(Scan *s, const char *lit) {
        size_t n = strlen(lit);

        if ((size_t)(s->end - s->p) < n || memcmp(s->p, lit, n) != 0)
                return false;
        s->p += n;
        return true;
}

static bool scan_value(Scan *s);

static bool scan_container(Scan *s, uint8_t open, uint8_t close) {
        bool ok = false;

        if (!scan_char(s, open))
                return false;
        if (++s->depth > VARLINK_MAX_DEPTH)
                return false;
        scan_ws(s);
        if (scan_char(s, close)) {
                s->depth--;
                return true;
        }
        for (;;) {
                if (open == '{') {
                        if (!scan_string(s))
                                return false;
                        scan_ws(s);
                        if (!scan_char(s, ':'))
                                return false;
                        scan_ws(s);
                        s->members++;
                }
                if (!scan_value(s))
                        return false;
                scan_ws(s);
                if (scan_char(s, close)) {
                        ok = true;
                        break;
                }
                if (!scan_char(s, ','))
                        return false;
                scan_ws(s);
        }
        s->depth--;
        return ok;
}

static bool scan_value(Scan *s) {
        if (s->p >= s->end)
                return false;
        switch (*s->p) {
        case '{':
                return scan_container(s, '{', '}');
        case '[':
                return scan_container(s, '[', ']');
        case '"':
                return scan_string(s);
        case 't':
                return scan_literal(s, "true");
        case 'f':
                return scan_literal(s, "false");
        case 'n':
                return scan_literal(s, "null");
        default:
                return scan_number(s);
        }
}

/* Counts the members of every object in the tree. */
static size_t count_members(json_object *o) {
        size_t n = 0;

        if (json_object_is_type(o, json_type_object)) {
                json_object_object_foreach(o, key, v) {
                        (void)key;
                        n += 1 + count_members(v);
                }
        } else if (json_object_is_type(o, json_type_array)) {
                size_t k = json_object_array_length(o);

                for (size_t i = 0; i < k; i++)
                        n += count_members(json_object_array_get_idx(o, i));
        }
        return n;
}

static void json_tokener_freep(struct json_tokener **t) {
        if (*t)
                json_tokener_free(*t);
}

int json_parse_message(const char *buf, size_t len, json_object **ret) {
        _cleanup_(json_tokener_freep) struct json_tokener *tok = NULL;
        _cleanup_(json_object_putp) json_object *o = NULL;
        Scan s = { .p = (const uint8_t *)buf, .end = (const uint8_t *)buf + len };

        if (!buf || len > INT_MAX)
                return -EBADMSG;
        scan_ws(&s);
        if (s.p >= s.end || *s.p != '{' || !scan_value(&s))
                return -EBADMSG;
        scan_ws(&s);
        if (s.p != s.end)
                return -EBADMSG;

        /* json-c counts a scalar inside the innermost container as a level */
        tok = json_tokener_new_ex(VARLINK_MAX_DEPTH + 1);
        if (!tok)
                return -ENOMEM;
        json_tokener_set_flags(tok, JSON_TOKENER_STRICT | JSON_TOKENER_VALIDATE_UTF8);
        o = json_tokener_parse_ex(tok, buf, (int)len);
        if (!o) {
                /* json-c reports allocation failure only as a failed parse */
                return json_tokener_get_error(tok) == json_tokener_success ? -ENOMEM : -EBADMSG;
        }
        if (json_tokener_get_parse_end(tok) != len || !json_object_is_type(o, json_type_object))
                return -EBADMSG;
        /* json-c keeps the last of duplicate keys: fewer members than the text had */
        if (count_members(o) != s.members)
                return -EBADMSG;
        *ret = TAKE_PTR(o);
        return 0;
}

/* ---- Dispatch ---- */

#define MEMBER(out, f, type) ((type *)((char *)(out) + (f)->offset))
#define COUNT(out, f) ((size_t *)((char *)(out) + (f)->count_offset))

static bool field_may_be_optional(const JsonField *f) {
        switch (f->type) {
        case JSON_INT64:
                return f->nonnegative;
        case JSON_BOOL:
        case JSON_STRING:
        case JSON_ARRAY:
        case JSON_STRV:
        case JSON_UINT64V:
        case JSON_VARIANT:
                return true;
        default:
                return false;
        }
}

static void strv_free(char **l) {
        if (!l)
                return;
        for (char **i = l; *i; i++)
                free(*i);
        free(l);
}

/* Sets every member of the table to its absent value, without freeing anything. */
static void dispatch_reset(const JsonField *fields, void *out) {
        for (const JsonField *f = fields; f->name; f++)
                switch (f->type) {
                case JSON_INT64:
                        *MEMBER(out, f, int64_t) = f->nonnegative ? JSON_ABSENT : 0;
                        break;
                case JSON_UINT64:
                        *MEMBER(out, f, uint64_t) = 0;
                        break;
                case JSON_BOOL:
                        *MEMBER(out, f, bool) = false;
                        break;
                case JSON_STRING:
                        *MEMBER(out, f, char *) = NULL;
                        break;
                case JSON_OBJECT:
                        dispatch_reset(f->fields, MEMBER(out, f, char));
                        break;
                case JSON_ARRAY:
                        *MEMBER(out, f, void *) = NULL;
                        *COUNT(out, f) = 0;
                        break;
                case JSON_STRV:
                        *MEMBER(out, f, char **) = NULL;
                        *COUNT(out, f) = 0;
                        break;
                case JSON_UINT64V:
                        *MEMBER(out, f, uint64_t *) = NULL;
                        *COUNT(out, f) = 0;
                        break;
                case JSON_VARIANT:
                        *MEMBER(out, f, json_object *) = NULL;
                        break;
                }
}

void json_dispatch_free(const JsonField *fields, void *out) {
        if (!fields || !out)
                return;
        for (const JsonField *f = fields; f->name; f++)
                switch (f->type) {
                case JSON_STRING:
                        free(*MEMBER(out, f, char *));
                        *MEMBER(out, f, char *) = NULL;
                        break;
                case JSON_OBJECT:
                        json_dispatch_free(f->fields, MEMBER(out, f, char));
                        break;
                case JSON_ARRAY: {
                        char *items = *MEMBER(out, f, char *);

                        for (size_t i = 0; items && i < *COUNT(out, f); i++)
                                json_dispatch_free(f->fields, items + i * f->elem_size);
                        free(items);
                        *MEMBER(out, f, void *) = NULL;
                        *COUNT(out, f) = 0;
                        break;
                }
                case JSON_STRV:
                        strv_free(*MEMBER(out, f, char **));
                        *MEMBER(out, f, char **) = NULL;
                        *COUNT(out, f) = 0;
                        break;
                case JSON_UINT64V:
                        free(*MEMBER(out, f, uint64_t *));
                        *MEMBER(out, f, uint64_t *) = NULL;
                        *COUNT(out, f) = 0;
                        break;
                case JSON_VARIANT:
                        json_object_putp(MEMBER(out, f, json_object *));
                        *MEMBER(out, f, json_object *) = NULL;
                        break;
                default:
                        break;
                }
}

/* Checks and copies one string value; *ret NULL on error with the message set. */
static int dispatch_string(const JsonField *f, json_object *v, const char *what, char **ret, char **ret_message) {
        size_t len;
        char *s;

        if (!json_object_is_type(v, json_type_string)) {
                set_message(ret_message, "%s '%s' must be a string.", what, f->name);
                return -EINVAL;
        }
        len = (size_t)json_object_get_string_len(v);
        if (f->max_len > 0 && len > f->max_len) {
                set_message(ret_message, "%s '%s' is longer than %zu bytes.", what, f->name, f->max_len);
                return -EINVAL;
        }
        if (!json_string_is_printable(json_object_get_string(v), len, f->multiline)) {
                set_message(ret_message, "%s '%s' must be printable UTF-8 without control characters.",
                            what, f->name);
                return -EINVAL;
        }
        s = strndup(json_object_get_string(v), len);
        if (!s)
                return -ENOMEM;
        *ret = s;
        return 0;
}

/* Reads an integer in INT64_MIN..INT64_MAX, or 0..INT64_MAX when `nonnegative`. `what` names it for the message. */
static int dispatch_integer(json_object *v, bool nonnegative, const char *what, const char *name, int64_t *ret,
                            char **ret_message) {
        int64_t i;
        uint64_t u;

        if (!json_object_is_type(v, json_type_int)) {
                set_message(ret_message, "%s '%s' must be an integer.", what, name);
                return -EINVAL;
        }
        i = json_object_get_int64(v);
        u = json_object_get_uint64(v);  /* 0 for negative values */
        if (i >= 0 && u > INT64_MAX) {
                set_message(ret_message, "%s '%s' is larger than %" PRIi64 ".", what, name, INT64_MAX);
                return -EINVAL;
        }
        if (i < 0 && nonnegative) {
                set_message(ret_message, "%s '%s' must not be negative.", what, name);
                return -EINVAL;
        }
        *ret = i;
        return 0;
}

/* Reads one present, non-null value into its member. */
static int dispatch_field(const JsonField *f, json_object *v, void *out, char **ret_message) {
        int64_t i;
        int r;

        switch (f->type) {
        case JSON_INT64:
        case JSON_UINT64:
                r = dispatch_integer(v, f->type == JSON_UINT64 || f->nonnegative, "Parameter", f->name, &i,
                                     ret_message);
                if (r < 0)
                        return r;
                if (f->type == JSON_INT64)
                        *MEMBER(out, f, int64_t) = i;
                else
                        *MEMBER(out, f, uint64_t) = (uint64_t)i;
                return 0;

        case JSON_BOOL:
                if (!json_object_is_type(v, json_type_boolean)) {
                        set_message(ret_message, "Parameter '%s' must be a boolean.", f->name);
                        return -EINVAL;
                }
                *MEMBER(out, f, bool) = json_object_get_boolean(v);
                return 0;

        case JSON_STRING:
                return dispatch_string(f, v, "Parameter", MEMBER(out, f, char *), ret_message);

        case JSON_OBJECT: {
                _cleanup_free_ char *inner = NULL;

                if (!json_object_is_type(v, json_type_object)) {
                        set_message(ret_message, "Parameter '%s' must be an object.", f->name);
                        return -EINVAL;
                }
                r = json_dispatch(v, f->fields, MEMBER(out, f, char), NULL, &inner);
                if (r == -EINVAL || r == -EBADMSG) {
                        set_message(ret_message, "In '%s': %s", f->name, inner ?: "invalid.");
                        return -EINVAL;
                }
                return r;
        }

        case JSON_ARRAY: {
                size_t n;
                char *items;

                if (!json_object_is_type(v, json_type_array)) {
                        set_message(ret_message, "Parameter '%s' must be an array.", f->name);
                        return -EINVAL;
                }
                n = json_object_array_length(v);
                if (f->max_len > 0 && n > f->max_len) {
                        set_message(ret_message, "Parameter '%s' has more than %zu elements.", f->name, f->max_len);
                        return -EINVAL;
                }
                if (n == 0)
                        return 0;
                items = calloc(n, f->elem_size);
                if (!items)
                        return -ENOMEM;
                *MEMBER(out, f, char *) = items;
                for (size_t k = 0; k < n; k++) {
                        _cleanup_free_ char *inner = NULL;
                        json_object *e = json_object_array_get_idx(v, k);

                        if (!json_object_is_type(e, json_type_object)) {
                                set_message(ret_message, "Element %zu of '%s' must be an object.", k, f->name);
                                return -EINVAL;
                        }
                        r = json_dispatch(e, f->fields, items + k * f->elem_size, NULL, &inner);
                        if (r < 0) {
                                if (r == -EINVAL)
                                        set_message(ret_message, "In element %zu of '%s': %s", k, f->name,
                                                    inner ?: "invalid.");
                                return r;
                        }
                        /* counted as soon as it holds something to free */
                        *COUNT(out, f) = k + 1;
                }
                return 0;
        }

        case JSON_VARIANT:
                if (!json_object_is_type(v, json_type_object)) {
                        set_message(ret_message, "Parameter '%s' must be an object.", f->name);
                        return -EINVAL;
                }
                *MEMBER(out, f, json_object *) = json_object_get(v);
                return 0;

        case JSON_STRV: {
                size_t n;
                char **l;

                if (!json_object_is_type(v, json_type_array)) {
                        set_message(ret_message, "Parameter '%s' must be an array.", f->name);
                        return -EINVAL;
                }
                n = json_object_array_length(v);
                l = calloc(n + 1, sizeof(char *));
                if (!l)
                        return -ENOMEM;
                *MEMBER(out, f, char **) = l;
                for (size_t k = 0; k < n; k++) {
                        r = dispatch_string(f, json_object_array_get_idx(v, k), "Each element of", &l[k],
                                            ret_message);
                        if (r < 0)
                                return r;
                        *COUNT(out, f) = k + 1;
                }
                return 0;
        }

        case JSON_UINT64V: {
                uint64_t *l;
                size_t n;

                if (!json_object_is_type(v, json_type_array)) {
                        set_message(ret_message, "Parameter '%s' must be an array.", f->name);
                        return -EINVAL;
                }
                n = json_object_array_length(v);
                if (f->max_len > 0 && n > f->max_len) {
                        set_message(ret_message, "Parameter '%s' has more than %zu elements.", f->name, f->max_len);
                        return -EINVAL;
                }
                if (n == 0)
                        return 0;
                l = calloc(n, sizeof(uint64_t));
                if (!l)
                        return -ENOMEM;
                *MEMBER(out, f, uint64_t *) = l;
                *COUNT(out, f) = n;
                for (size_t k = 0; k < n; k++) {
                        r = dispatch_integer(json_object_array_get_idx(v, k), true, "Each element of", f->name, &i,
                                             ret_message);
                        if (r < 0)
                                return r;
                        l[k] = (uint64_t)i;
                }
                return 0;
        }
        }
        return -EINVAL;
}

int json_dispatch(json_object *params, const JsonField *fields, void *out,
                  const char **ret_bad_field, char **ret_message) {
        const JsonField *f;
        int r;

        if (ret_bad_field)
                *ret_bad_field = NULL;
        if (params && !json_object_is_type(params, json_type_object)) {
                set_message(ret_message, "Parameters must be an object.");
                return -EBADMSG;
        }
        for (f = fields; f->name; f++)
                if (!f->required && !field_may_be_optional(f))
                        return -EINVAL;         /* a malformed table: a bug in the caller */
        dispatch_reset(fields, out);

        if (params) {
                json_object_object_foreach(params, key, v) {
                        for (f = fields; f->name; f++)
                                if (strcmp(f->name, key) == 0)
                                        break;
                        if (!f->name) {
                                if (ret_bad_field)
                                        *ret_bad_field = key;
                                set_message(ret_message, "Unknown parameter '%.64s'.", key);
                                r = -EINVAL;
                                goto fail;
                        }
                        if (json_object_is_type(v, json_type_null)) {
                                if (!f->required)
                                        continue;
                                set_message(ret_message, "Parameter '%s' is required; null is not allowed.",
                                            f->name);
                                r = -EINVAL;
                                goto fail_field;
                        }
                        r = dispatch_field(f, v, out, ret_message);
                        if (r < 0)
                                goto fail_field;
                }
        }
        for (f = fields; f->name; f++) {
                json_object *v;

                if (!f->required)
                        continue;
                if (!params || !json_object_object_get_ex(params, f->name, &v)) {
                        set_message(ret_message, "Parameter '%s' is missing.", f->name);
                        r = -EINVAL;
                        goto fail_field;
                }
        }
        return 0;

fail_field:
        if (ret_bad_field && r == -EINVAL)
                *ret_bad_field = f->name;
fail:
        json_dispatch_free(fields, out);
        return r;
}

/* ---- Building ---- */

static int add(json_object *o, const char *key, json_object *v) {
        if (!v)
                return -ENOMEM;
        if (json_object_object_add(o, key, v) < 0) {
                json_object_put(v);
                return -ENOMEM;
        }
        return 0;
}

static int build_string(const JsonField *f, const char *s, json_object **ret) {
        _cleanup_free_ char *d = NULL;
        size_t len;

        d = printable_dup(s, f->max_len, f->multiline, &len);
        if (!d)
                return -ENOMEM;
        *ret = json_object_new_string_len(d, (int)len);
        return *ret ? 0 : -ENOMEM;
}

/* An integer every varlink peer can read: 0..INT64_MAX. */
static int build_uint64(uint64_t u, json_object **ret) {
        if (u > INT64_MAX)
                return -ERANGE;
        *ret = json_object_new_int64((int64_t)u);
        return *ret ? 0 : -ENOMEM;
}

int json_build(const JsonField *fields, const void *in, json_object **ret) {
        _cleanup_(json_object_putp) json_object *o = NULL;
        int r;

        o = json_object_new_object();
        if (!o)
                return -ENOMEM;
        for (const JsonField *f = fields; f->name; f++) {
                json_object *v = NULL;

                switch (f->type) {
                case JSON_INT64: {
                        int64_t i = *MEMBER(in, f, int64_t);

                        if (f->nonnegative && i < 0) {
                                if (f->required)
                                        return -ERANGE;
                                continue;
                        }
                        v = json_object_new_int64(i);
                        break;
                }
                case JSON_UINT64:
                        r = build_uint64(*MEMBER(in, f, uint64_t), &v);
                        if (r < 0)
                                return r;
                        break;
                case JSON_BOOL:
                        if (!f->required && !*MEMBER(in, f, bool))
                                continue;
                        v = json_object_new_boolean(*MEMBER(in, f, bool));
                        break;
                case JSON_VARIANT:
                        v = *MEMBER(in, f, json_object *);
                        if (!v) {
                                if (f->required)
                                        return -EINVAL;
                                continue;
                        }
                        json_object_get(v);
                        break;
                case JSON_STRING: {
                        const char *s = *MEMBER(in, f, char *);

                        if (!s) {
                                if (f->required)
                                        return -EINVAL;
                                continue;
                        }
                        r = build_string(f, s, &v);
                        if (r < 0)
                                return r;
                        break;
                }
                case JSON_OBJECT:
                        r = json_build(f->fields, MEMBER(in, f, char), &v);
                        if (r < 0)
                                return r;
                        break;
                case JSON_ARRAY:
                case JSON_STRV:
                case JSON_UINT64V: {
                        const char *items = *MEMBER(in, f, char *);
                        size_t n = *COUNT(in, f);

                        if (!items) {
                                if (n > 0)
                                        return -EINVAL;
                                if (!f->required)
                                        continue;
                        }
                        v = json_object_new_array_ext((int)n);
                        if (!v)
                                return -ENOMEM;
                        for (size_t k = 0; k < n; k++) {
                                json_object *e;

                                if (f->type == JSON_ARRAY)
                                        r = json_build(f->fields, items + k * f->elem_size, &e);
                                else if (f->type == JSON_UINT64V)
                                        r = build_uint64(((const uint64_t *)items)[k], &e);
                                else if (((char *const *)items)[k])
                                        r = build_string(f, ((char *const *)items)[k], &e);
                                else
                                        r = -EINVAL;
                                if (r >= 0 && json_object_array_add(v, e) < 0) {
                                        json_object_put(e);
                                        r = -ENOMEM;
                                }
                                if (r < 0) {
                                        json_object_put(v);
                                        return r;
                                }
                        }
                        break;
                }
                }
                r = add(o, f->name, v);
                if (r < 0)
                        return r;
        }
        *ret = TAKE_PTR(o);
        return 0;
}
