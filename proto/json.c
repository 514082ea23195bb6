/* SPDX-License-Identifier: MIT */

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <locale.h>
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
                size_t n;

                /* printable ASCII, most of every string, without decoding */
                if (p[i] >= 0x20 && p[i] < 0x7f) {
                        i++;
                        continue;
                }
                n = utf8_decode(p + i, len - i, &cp);

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

/* json_printable_copy() of s[0..len) into a new NUL-terminated string. */
static char *printable_dup(const char *s, size_t len, size_t max_len, bool multiline, size_t *ret_len) {
        char *d = malloc(len + 1);

        if (!d)
                return NULL;
        *ret_len = json_printable_copy(d, s, len, max_len, multiline);
        d[*ret_len] = 0;
        return d;
}

/* ---- Parsing ---- */

/*
 * json_parse_message() reads the text once: it checks it against the grammar
 * and builds the tree as it goes, the same tree json-c's tokener builds from
 * text this strict (json-c's own constructors: integers as int64, as uint64
 * above INT64_MAX; other numbers as doubles that keep their text; strings
 * unescaped to UTF-8; members in the order of the text). Checking first and
 * then handing the text to json_tokener_parse_ex() read every message twice,
 * and the tokener made and freed a buffer and a locale per message: more
 * than half of what a request cost the daemon to parse.
 */

typedef struct Parse {
        const uint8_t *p;
        const uint8_t *end;
        unsigned depth;
        char *buf;              /* an unescaped string, a key, a number's text; NUL-terminated */
        size_t buf_size;
        char stack[256];        /* buf, until it needs more: then malloc'd */
        const struct JsonField *raw;    /* json_dispatch_text_raw(): the field kept as text, not parsed */
        const struct JsonField *raw_fields; /* json_dispatch_text_nested(): or read with this table */
        void *raw_out;                  /* into this struct */
        const uint8_t *raw_begin;       /* and where its text is */
        const uint8_t *raw_end;
} Parse;

/* Makes room for n more bytes and a NUL after buf[0..len). */
static int buf_reserve(Parse *s, size_t len, size_t n) {
        size_t size;
        char *b;

        if (s->buf_size - len > n)
                return 0;
        size = MAX(s->buf_size * 2, len + n + 1);
        b = s->buf == s->stack ? malloc(size) : realloc(s->buf, size);
        if (!b)
                return -ENOMEM;
        if (s->buf == s->stack)
                memcpy(b, s->buf, len);
        s->buf = b;
        s->buf_size = size;
        return 0;
}

static void parse_ws(Parse *s) {
        while (s->p < s->end && (*s->p == ' ' || *s->p == '\t' || *s->p == '\n' || *s->p == '\r'))
                s->p++;
}

static bool parse_char(Parse *s, uint8_t c) {
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
static bool parse_hex4(Parse *s, uint32_t *ret) {
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

/* Writes the code point cp (a scalar value) as UTF-8 into out; returns its length. */
static size_t utf8_encode(uint32_t cp, uint8_t out[static 4]) {
        if (cp < 0x80) {
                out[0] = (uint8_t)cp;
                return 1;
        }
        if (cp < 0x800) {
                out[0] = (uint8_t)(0xc0 | (cp >> 6));
                out[1] = (uint8_t)(0x80 | (cp & 0x3f));
                return 2;
        }
        if (cp < 0x10000) {
                out[0] = (uint8_t)(0xe0 | (cp >> 12));
                out[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3f));
                out[2] = (uint8_t)(0x80 | (cp & 0x3f));
                return 3;
        }
        out[0] = (uint8_t)(0xf0 | (cp >> 18));
        out[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3f));
        out[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3f));
        out[3] = (uint8_t)(0x80 | (cp & 0x3f));
        return 4;
}

/* Reads one escape after its backslash into buf at *len. Returns 0, -EBADMSG or -ENOMEM. */
static int parse_escape(Parse *s, size_t *len) {
        uint8_t u[4];
        uint32_t cp, lo;
        size_t n;
        int r;

        if (s->p >= s->end)
                return -EBADMSG;
        switch (*s->p++) {
        case '"':  u[0] = '"'; n = 1; break;
        case '\\': u[0] = '\\'; n = 1; break;
        case '/':  u[0] = '/'; n = 1; break;
        case 'b':  u[0] = '\b'; n = 1; break;
        case 'f':  u[0] = '\f'; n = 1; break;
        case 'n':  u[0] = '\n'; n = 1; break;
        case 'r':  u[0] = '\r'; n = 1; break;
        case 't':  u[0] = '\t'; n = 1; break;
        case 'u':
                if (!parse_hex4(s, &cp))
                        return -EBADMSG;
                if (cp == 0)
                        return -EBADMSG;        /* json-c keys are C strings: no NUL anywhere */
                if (cp >= 0xdc00 && cp <= 0xdfff)
                        return -EBADMSG;        /* a low surrogate alone */
                if (cp >= 0xd800 && cp <= 0xdbff) {
                        if (!parse_char(s, '\\') || !parse_char(s, 'u') || !parse_hex4(s, &lo))
                                return -EBADMSG;
                        if (lo < 0xdc00 || lo > 0xdfff)
                                return -EBADMSG;
                        cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
                }
                n = utf8_encode(cp, u);
                break;
        default:
                return -EBADMSG;
        }
        r = buf_reserve(s, *len, n);
        if (r < 0)
                return r;
        memcpy(s->buf + *len, u, n);
        *len += n;
        return 0;
}

/* Bytes of an eight-byte word, each: 0x01 and 0x80. */
#define BYTES_01 UINT64_C(0x0101010101010101)
#define BYTES_80 UINT64_C(0x8080808080808080)

/*
 * The first byte from p that parse_string() must look at by itself ('"', '\\', a control character, or any
 * byte of a multi-byte UTF-8 sequence), found eight bytes at a time; or where fewer than eight are left,
 * which the caller reads one by one. In a word, a byte is flagged when it is below 0x20, equal to '"' or
 * '\\' (the classic has-zero-byte test on the word xor'd with it), or has its high bit set. A subtraction's
 * borrow can flag a byte only above a byte flagged for itself, so the lowest flag is a byte to stop at.
 * Keys and values are mostly plain runs: read byte by byte they were a third of reading a Status reply.
 */
static const uint8_t *plain_run_end(const uint8_t *p, const uint8_t *end) {
        while (end - p >= 8) {
                uint64_t x, q, b, m;

                memcpy(&x, p, sizeof(x));
                q = x ^ (BYTES_01 * '"');
                b = x ^ (BYTES_01 * '\\');
                m = (((x - BYTES_01 * 0x20) & ~x) | ((q - BYTES_01) & ~q) | ((b - BYTES_01) & ~b) | x) & BYTES_80;
                if (m) {
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
                        p += (unsigned)__builtin_ctzll(m) / 8;
#endif
                        break;
                }
                p += 8;
        }
        return p;
}

/*
 * Reads a string (s->p at its opening quote): valid UTF-8 with no raw control
 * character and valid escapes. Returns 0 with the string in *ret and its
 * length in *ret_len: inside the text when it has no escape (not
 * NUL-terminated), else unescaped in s->buf (NUL-terminated, until the buffer
 * is used again). Returns -EBADMSG or -ENOMEM otherwise.
 */
static int parse_string(Parse *s, const char **ret, size_t *ret_len) {
        const uint8_t *start;
        bool copied = false;
        size_t len = 0;
        int r;

        if (!parse_char(s, '"'))
                return -EBADMSG;
        start = s->p;
        for (;;) {
                uint32_t cp;
                size_t n;
                uint8_t c;

                s->p = plain_run_end(s->p, s->end);
                if (s->p >= s->end)
                        return -EBADMSG;
                c = *s->p;
                if (c == '"' || c == '\\') {
                        /* what came since the start, or since the last escape, goes to the buffer now */
                        if (copied || c == '\\') {
                                n = (size_t)(s->p - start);
                                r = buf_reserve(s, len, n);
                                if (r < 0)
                                        return r;
                                memcpy(s->buf + len, start, n);
                                len += n;
                                copied = true;
                        }
                        s->p++;
                        if (c == '"')
                                break;
                        r = parse_escape(s, &len);
                        if (r < 0)
                                return r;
                        start = s->p;
                        continue;
                }
                if (c < 0x20)
                        return -EBADMSG;        /* raw control characters must be escaped */
                if (c < 0x80) {
                        s->p++;
                        continue;
                }
                n = utf8_decode(s->p, (size_t)(s->end - s->p), &cp);
                if (n == 0)
                        return -EBADMSG;
                s->p += n;
        }
        if (!copied) {
                *ret = (const char *)start;
                *ret_len = (size_t)(s->p - 1 - start);
                return 0;
        }
        s->buf[len] = 0;
        *ret = s->buf;
        *ret_len = len;
        return 0;
}

static bool is_digit(const Parse *s) {
        return s->p < s->end && *s->p >= '0' && *s->p <= '9';
}

/* Compares two runs of decimal digits without leading zeros. */
static int digits_cmp(const uint8_t *a, size_t a_len, const char *b) {
        size_t b_len = strlen(b);

        if (a_len != b_len)
                return a_len < b_len ? -1 : 1;
        return memcmp(a, b, a_len);
}

/* strtod() as json-c calls it: in the C locale, whatever the process's is. */
static double strtod_c(const char *text, char **end) {
        static locale_t c_locale;
        locale_t l = __atomic_load_n(&c_locale, __ATOMIC_ACQUIRE);

        if (!l) {
                locale_t n = newlocale(LC_NUMERIC_MASK, "C", (locale_t)0);

                if (!n)
                        return strtod(text, end);       /* glibc's C locale is static: never */
                if (__atomic_compare_exchange_n(&c_locale, &l, n, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
                        l = n;
                else
                        freelocale(n);
        }
        return strtod_l(text, end, l);
}

/* A number's text as scan_number() found it. */
typedef struct Number {
        const uint8_t *start;   /* its first byte, '-' included */
        const uint8_t *digits;  /* the integer part's digits */
        size_t n_digits;
        bool negative;
        bool integer;           /* no fraction, no exponent */
} Number;

/* Reads a number's text against the grammar (s->p at its first byte). Returns 0 or -EBADMSG. */
static int scan_number(Parse *s, Number *ret) {
        *ret = (Number){ .start = s->p, .integer = true };
        ret->negative = parse_char(s, '-');
        ret->digits = s->p;
        if (parse_char(s, '0'))
                ;
        else if (is_digit(s) && *s->p != '0')
                while (is_digit(s))
                        s->p++;
        else
                return -EBADMSG;
        ret->n_digits = (size_t)(s->p - ret->digits);
        if (parse_char(s, '.')) {
                ret->integer = false;
                if (!is_digit(s))
                        return -EBADMSG;
                while (is_digit(s))
                        s->p++;
        }
        if (s->p < s->end && (*s->p == 'e' || *s->p == 'E')) {
                ret->integer = false;
                s->p++;
                if (!parse_char(s, '+'))
                        (void)parse_char(s, '-');
                if (!is_digit(s))
                        return -EBADMSG;
                while (is_digit(s))
                        s->p++;
        }
        return 0;
}

/*
 * An integer's magnitude in *ret; false for one json-c would silently clamp (outside
 * INT64_MIN..UINT64_MAX): refused rather than a value changed.
 */
static bool number_magnitude(const Number *n, uint64_t *ret) {
        uint64_t u = 0;

        /* under 19 digits it is below 10^18 and fits either way */
        if (n->n_digits >= 19 &&
            digits_cmp(n->digits, n->n_digits, n->negative ? "9223372036854775808" : "18446744073709551615") > 0)
                return false;
        for (size_t i = 0; i < n->n_digits; i++)
                u = u * 10 + (uint64_t)(n->digits[i] - '0');
        *ret = u;
        return true;
}

static int parse_number(Parse *s, json_object **ret) {
        Number num;
        int r;

        r = scan_number(s, &num);
        if (r < 0)
                return r;
        if (num.integer) {
                uint64_t u;

                if (!number_magnitude(&num, &u))
                        return -EBADMSG;
                if (num.negative)
                        *ret = json_object_new_int64(u == 0 ? 0 : -(int64_t)(u - 1) - 1);  /* down to INT64_MIN */
                else if (u <= INT64_MAX)
                        *ret = json_object_new_int64((int64_t)u);
                else
                        *ret = json_object_new_uint64(u);
        } else {
                size_t len = (size_t)(s->p - num.start);
                double d;

                /* json-c's double keeps its text, which it writes back as it was */
                r = buf_reserve(s, 0, len);
                if (r < 0)
                        return r;
                memcpy(s->buf, num.start, len);
                s->buf[len] = 0;
                d = strtod_c(s->buf, NULL);
                *ret = json_object_new_double_s(d, s->buf);
        }
        return *ret ? 0 : -ENOMEM;
}

static int parse_literal(Parse *s, const char *lit) {
        size_t n = strlen(lit);

        if ((size_t)(s->end - s->p) < n || memcmp(s->p, lit, n) != 0)
                return -EBADMSG;
        s->p += n;
        return 0;
}

static int parse_value(Parse *s, json_object **ret);

/* Keys this long or shorter are copied onto the stack of their member's parse. */
#define KEY_STACK 64

/* Reads one "key": value into the object o. */
static int parse_member(Parse *s, json_object *o) {
        _cleanup_free_ char *key_heap = NULL;
        char key_stack[KEY_STACK + 1], *key = key_stack;
        json_object *v = NULL;
        const char *k;
        size_t len;
        int n, r;

        /* its own copy: the value's parse may use the buffer, nested objects their keys */
        r = parse_string(s, &k, &len);
        if (r < 0)
                return r;
        if (len > KEY_STACK) {
                key = key_heap = malloc(len + 1);
                if (!key)
                        return -ENOMEM;
        }
        memcpy(key, k, len);
        key[len] = 0;

        parse_ws(s);
        if (!parse_char(s, ':'))
                return -EBADMSG;
        parse_ws(s);
        r = parse_value(s, &v);
        if (r < 0)
                return r;
        n = json_object_object_length(o);
        if (json_object_object_add(o, key, v) < 0) {
                json_object_put(v);
                return -ENOMEM;
        }
        /* json-c keeps the last of duplicate keys: the object did not grow */
        return json_object_object_length(o) == n ? -EBADMSG : 0;
}

/* Reads one value into the array a. */
static int parse_element(Parse *s, json_object *a) {
        json_object *v = NULL;
        int r;

        r = parse_value(s, &v);
        if (r < 0)
                return r;
        if (json_object_array_add(a, v) < 0) {
                json_object_put(v);
                return -ENOMEM;
        }
        return 0;
}

/* Reads an object's members or an array's elements, s->p after its opening bracket, up to its closing one. */
static int parse_container(Parse *s, bool object, json_object **ret) {
        _cleanup_(json_object_putp) json_object *c = NULL;
        uint8_t close = object ? '}' : ']';
        int r;

        c = object ? json_object_new_object() : json_object_new_array();
        if (!c)
                return -ENOMEM;
        parse_ws(s);
        if (!parse_char(s, close))
                for (;;) {
                        r = object ? parse_member(s, c) : parse_element(s, c);
                        if (r < 0)
                                return r;
                        parse_ws(s);
                        if (parse_char(s, close))
                                break;
                        if (!parse_char(s, ','))
                                return -EBADMSG;
                        parse_ws(s);
                }
        *ret = TAKE_PTR(c);
        return 0;
}

/* Reads one value into *ret (NULL for null). Returns 0, -EBADMSG or -ENOMEM. */
static int parse_value(Parse *s, json_object **ret) {
        const char *str;
        size_t len;
        bool b;
        int r;

        if (s->p >= s->end)
                return -EBADMSG;
        switch (*s->p) {
        case '{':
        case '[':
                if (s->depth >= VARLINK_MAX_DEPTH)
                        return -EBADMSG;
                s->depth++;
                r = parse_container(s, *s->p++ == '{', ret);
                s->depth--;
                return r;
        case '"':
                r = parse_string(s, &str, &len);
                if (r < 0)
                        return r;
                *ret = json_object_new_string_len(str, (int)len);
                return *ret ? 0 : -ENOMEM;
        case 't':
        case 'f':
                b = *s->p == 't';
                r = parse_literal(s, b ? "true" : "false");
                if (r < 0)
                        return r;
                *ret = json_object_new_boolean(b);
                return *ret ? 0 : -ENOMEM;
        case 'n':
                *ret = NULL;
                return parse_literal(s, "null");
        default:
                return parse_number(s, ret);
        }
}

int json_parse_message(const char *buf, size_t len, json_object **ret) {
        json_object *o = NULL;
        Parse s;
        int r;

        if (!buf || len > INT_MAX)
                return -EBADMSG;
        s.p = (const uint8_t *)buf;
        s.end = (const uint8_t *)buf + len;
        s.depth = 0;
        s.buf = s.stack;        /* not zeroed: only what is written is read */
        s.buf_size = sizeof(s.stack);
        s.raw = NULL;
        parse_ws(&s);
        r = s.p < s.end && *s.p == '{' ? parse_value(&s, &o) : -EBADMSG;
        if (r >= 0) {
                parse_ws(&s);
                if (s.p != s.end)
                        r = -EBADMSG;
        }
        if (s.buf != s.stack)
                free(s.buf);
        if (r < 0) {
                json_object_put(o);
                return r;
        }
        *ret = o;
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

/* The number of elements of `v`, which must be an array of at most `max` of them (0: any), into *ret. */
static int dispatch_array_length(const JsonField *f, json_object *v, size_t max, size_t *ret, char **ret_message) {
        size_t n;

        if (!json_object_is_type(v, json_type_array)) {
                set_message(ret_message, "Parameter '%s' must be an array.", f->name);
                return -EINVAL;
        }
        n = json_object_array_length(v);
        if (max > 0 && n > max) {
                set_message(ret_message, "Parameter '%s' has more than %zu elements.", f->name, max);
                return -EINVAL;
        }
        *ret = n;
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

                r = dispatch_array_length(f, v, f->max_len, &n, ret_message);
                if (r < 0)
                        return r;
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

                r = dispatch_array_length(f, v, 0, &n, ret_message);     /* .max_len is a string's */
                if (r < 0)
                        return r;
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

                r = dispatch_array_length(f, v, f->max_len, &n, ret_message);
                if (r < 0)
                        return r;
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

/*
 * The field named `key`, or NULL. Senders write the fields in the table's order (json_build_write() does), so the
 * search starts after the field found last and wraps around: one strcmp() per key, mostly.
 */
static const JsonField *find_field(const JsonField *fields, const JsonField *start, const char *key) {
        for (const JsonField *f = start; f->name; f++)
                if (strcmp(f->name, key) == 0)
                        return f;
        for (const JsonField *f = fields; f < start; f++)
                if (strcmp(f->name, key) == 0)
                        return f;
        return NULL;
}

int json_dispatch(json_object *params, const JsonField *fields, void *out,
                  const char **ret_bad_field, char **ret_message) {
        const JsonField *f, *next = fields;
        uint64_t seen = 0;              /* the first 64 fields of the table that params has, null or not */
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
                        f = find_field(fields, next, key);
                        if (!f) {
                                if (ret_bad_field)
                                        *ret_bad_field = key;
                                set_message(ret_message, "Unknown parameter '%.64s'.", key);
                                r = -EINVAL;
                                goto fail;
                        }
                        next = f + 1;
                        if (f - fields < 64)
                                seen |= UINT64_C(1) << (f - fields);
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
                if (!f->required)
                        continue;
                if (f - fields < 64 ? !(seen & (UINT64_C(1) << (f - fields)))
                                    : !params || !json_object_object_get_ex(params, f->name, NULL)) {
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

/* ---- Dispatch from text ---- */

/*
 * json_dispatch_text() reads a message straight into the struct, as json_parse_message() and then
 * json_dispatch() would, without making the json-c objects in between: making them and freeing them again
 * was most of what the daemon paid to read a request, and a client to read a reply (issue 14).
 *
 * It is a fast path that only ever says yes: it reads text that is sure to give no error (every key a field
 * of the table, at most once, every value of the field's type and in its limits, the grammar kept
 * throughout) and fills the struct as json_dispatch() does. Anything else, an error of any kind or a case it
 * does not take (a number that is not a plain integer where one is wanted, a table of more than 64 fields,
 * a duplicate key it cannot rule out cheaply), makes it give up, free what it read and leave the whole
 * decision to the json-c path on the same text. So its errors are the json-c path's by construction, and
 * what it accepts is what the differential tests in test-json.c and test-varlink.c and the fuzz target check
 * against that path. Rejected text costs two reads; the daemon's messages are at most 64 KiB.
 */

#define TEXT_UNSURE 1           /* the fast path gives up: the json-c path decides */

/* The field named key[0..len) (no NUL in it), searched as find_field() does. */
static const JsonField *find_field_len(const JsonField *fields, const JsonField *start, const char *key,
                                       size_t len) {
        for (const JsonField *f = start; f->name; f++)
                if (strncmp(f->name, key, len) == 0 && f->name[len] == 0)
                        return f;
        for (const JsonField *f = fields; f < start; f++)
                if (strncmp(f->name, key, len) == 0 && f->name[len] == 0)
                        return f;
        return NULL;
}

/* Turns the parser's -EBADMSG into giving up; 0 and -ENOMEM stay. */
static int text_unsure(int r) {
        return r == 0 || r == -ENOMEM ? r : TEXT_UNSURE;
}

/* Keys of one object compared for duplicates by text_skip(); an object with more is left to json-c. */
#define SKIP_KEYS_MAX 16

static int text_skip(Parse *s);

/* Checks an object's members or an array's elements, s->p after its opening bracket, as parse_container(). */
static int text_skip_container(Parse *s, bool object) {
        struct { const char *key; size_t len; } keys[SKIP_KEYS_MAX];
        uint8_t close = object ? '}' : ']';
        size_t n_keys = 0;
        int r;

        parse_ws(s);
        if (parse_char(s, close))
                return 0;
        for (;;) {
                if (object) {
                        const char *k;
                        size_t len;

                        r = parse_string(s, &k, &len);
                        if (r < 0)
                                return text_unsure(r);
                        /* an escaped key is in s->buf, which the value reuses: not kept, so not compared */
                        if (k == s->buf || n_keys == SKIP_KEYS_MAX)
                                return TEXT_UNSURE;
                        for (size_t i = 0; i < n_keys; i++)
                                if (keys[i].len == len && memcmp(keys[i].key, k, len) == 0)
                                        return TEXT_UNSURE;     /* a duplicate key */
                        keys[n_keys].key = k;
                        keys[n_keys++].len = len;
                        parse_ws(s);
                        if (!parse_char(s, ':'))
                                return TEXT_UNSURE;
                        parse_ws(s);
                }
                r = text_skip(s);
                if (r != 0)
                        return r;
                parse_ws(s);
                if (parse_char(s, close))
                        return 0;
                if (!parse_char(s, ','))
                        return TEXT_UNSURE;
                parse_ws(s);
        }
}

/* Checks one value as parse_value() reads it, without building it: 0 when it would take it, else TEXT_UNSURE. */
static int text_skip(Parse *s) {
        const char *str;
        Number num;
        uint64_t u;
        size_t len;
        int r;

        if (s->p >= s->end)
                return TEXT_UNSURE;
        switch (*s->p) {
        case '{':
        case '[':
                if (s->depth >= VARLINK_MAX_DEPTH)
                        return TEXT_UNSURE;
                s->depth++;
                r = text_skip_container(s, *s->p++ == '{');
                s->depth--;
                return r;
        case '"':
                return text_unsure(parse_string(s, &str, &len));
        case 't':
                return text_unsure(parse_literal(s, "true"));
        case 'f':
                return text_unsure(parse_literal(s, "false"));
        case 'n':
                return text_unsure(parse_literal(s, "null"));
        default:
                if (scan_number(s, &num) < 0 || (num.integer && !number_magnitude(&num, &u)))
                        return TEXT_UNSURE;
                return 0;
        }
}

/* An integer json_dispatch() takes for a field (dispatch_integer()), or TEXT_UNSURE. */
static int text_integer(Parse *s, bool nonnegative, int64_t *ret) {
        const uint8_t *p = s->p, *digits;
        bool negative;
        Number num;
        uint64_t u = 0;

        /* The common case in one pass: at most 18 digits (no overflow), no leading zero, no fraction or
         * exponent after them. Anything else is scanned by the grammar's own reader below. */
        negative = p < s->end && *p == '-';
        digits = p += negative;
        for (; p < s->end && (unsigned)(*p - '0') < 10; p++)
                u = u * 10 + (unsigned)(*p - '0');
        if (p > digits && p - digits < 19 && (*digits != '0' || p - digits == 1) &&
            (p == s->end || (*p != '.' && *p != 'e' && *p != 'E'))) {
                if (negative && u != 0 && nonnegative)
                        return TEXT_UNSURE;
                s->p = p;
                *ret = negative ? -(int64_t)u : (int64_t)u;
                return 0;
        }

        if (s->p >= s->end || !(*s->p == '-' || (*s->p >= '0' && *s->p <= '9')))
                return TEXT_UNSURE;
        if (scan_number(s, &num) < 0 || !num.integer || !number_magnitude(&num, &u))
                return TEXT_UNSURE;
        if (!num.negative) {
                if (u > INT64_MAX)
                        return TEXT_UNSURE;
                *ret = (int64_t)u;
        } else if (u == 0)
                *ret = 0;               /* -0 is the integer 0, as json-c reads it */
        else if (nonnegative)
                return TEXT_UNSURE;
        else
                *ret = -(int64_t)(u - 1) - 1;
        return 0;
}

/* A string json_dispatch() takes for a field (dispatch_string()), copied, or TEXT_UNSURE. */
static int text_string(Parse *s, const JsonField *f, char **ret) {
        const char *str;
        size_t len;
        int r;

        if (s->p >= s->end || *s->p != '"')
                return TEXT_UNSURE;
        r = parse_string(s, &str, &len);
        if (r < 0)
                return text_unsure(r);
        if ((f->max_len > 0 && len > f->max_len) || !json_string_is_printable(str, len, f->multiline))
                return TEXT_UNSURE;
        *ret = strndup(str, len);
        return *ret ? 0 : -ENOMEM;
}

/* Enters an array, s->p at its '[': as parse_value() counts its depth. Returns whether it is empty. */
static int text_array_open(Parse *s, bool *ret_empty) {
        if (s->p >= s->end || *s->p != '[' || s->depth >= VARLINK_MAX_DEPTH)
                return TEXT_UNSURE;
        s->depth++;
        s->p++;
        parse_ws(s);
        *ret_empty = parse_char(s, ']');
        if (*ret_empty)
                s->depth--;
        return 0;
}

/* After an array's element: 0 and *ret_done at its end, 0 after a comma, else TEXT_UNSURE. */
static int text_array_next(Parse *s, bool *ret_done) {
        parse_ws(s);
        *ret_done = parse_char(s, ']');
        if (*ret_done) {
                s->depth--;
                return 0;
        }
        if (!parse_char(s, ','))
                return TEXT_UNSURE;
        parse_ws(s);
        return 0;
}

/*
 * a[0..*alloc) of `size`-byte items grown to hold n (n > 0), the new room zeroed; NULL (a kept) without memory,
 * which includes room whose size in bytes does not fit a size_t.
 */
static void *grow(void *a, size_t *alloc, size_t n, size_t size) {
        size_t m, bytes;
        char *p;

        if (n <= *alloc)
                return a;
        m = MAX(n, *alloc * 2);
        /* doubling cannot wrap (*alloc * size bytes exist), but m * size could: a buffer too small for m items */
        if (__builtin_mul_overflow(m, size, &bytes))
                return NULL;
        p = realloc(a, bytes);
        if (!p)
                return NULL;
        memset(p + *alloc * size, 0, (m - *alloc) * size);
        *alloc = m;
        return p;
}

static int text_object(Parse *s, const JsonField *fields, void *out);

/* Reads one member's value into its field, as dispatch_field() does; s->p at the value. */
static int text_field(Parse *s, const JsonField *f, void *out) {
        bool done;
        int64_t i;
        int r;

        if (s->p < s->end && *s->p == 'n') {
                /* null: absent, which the member is already */
                if (f->required)
                        return TEXT_UNSURE;
                return text_unsure(parse_literal(s, "null"));
        }
        switch (f->type) {
        case JSON_INT64:
        case JSON_UINT64:
                r = text_integer(s, f->type == JSON_UINT64 || f->nonnegative, &i);
                if (r != 0)
                        return r;
                if (f->type == JSON_INT64)
                        *MEMBER(out, f, int64_t) = i;
                else
                        *MEMBER(out, f, uint64_t) = (uint64_t)i;
                return 0;

        case JSON_BOOL: {
                bool b = s->p < s->end && *s->p == 't';

                if (parse_literal(s, b ? "true" : "false") < 0)
                        return TEXT_UNSURE;
                *MEMBER(out, f, bool) = b;
                return 0;
        }

        case JSON_STRING:
                return text_string(s, f, MEMBER(out, f, char *));

        case JSON_OBJECT:
                return text_object(s, f->fields, MEMBER(out, f, char));

        case JSON_VARIANT: {
                json_object *v = NULL;

                if (s->p >= s->end || *s->p != '{')
                        return TEXT_UNSURE;
                if (f == s->raw) {
                        /* kept as text: checked as json_parse_message() would read it, or read with its table */
                        const uint8_t *start = s->p;

                        r = s->raw_fields ? text_object(s, s->raw_fields, s->raw_out) : text_skip(s);
                        if (r != 0)
                                return r;
                        s->raw_begin = start;
                        s->raw_end = s->p;
                        return 0;
                }
                r = parse_value(s, &v);
                if (r < 0)
                        return text_unsure(r);
                *MEMBER(out, f, json_object *) = v;
                return 0;
        }

        case JSON_ARRAY: {
                char *items = NULL;
                size_t alloc = 0;

                r = text_array_open(s, &done);
                for (size_t k = 0; r == 0 && !done; k++) {
                        if (f->max_len > 0 && k == f->max_len)
                                return TEXT_UNSURE;
                        items = grow(items, &alloc, k + 1, f->elem_size);
                        if (!items)
                                return -ENOMEM;
                        /* counted before it is read, so that whatever it holds is freed on the way out */
                        *MEMBER(out, f, char *) = items;
                        *COUNT(out, f) = k + 1;
                        r = text_object(s, f->fields, items + k * f->elem_size);
                        if (r == 0)
                                r = text_array_next(s, &done);
                }
                return r;
        }

        case JSON_STRV: {
                char **l = calloc(1, sizeof(char *));
                size_t alloc = 1;

                if (!l)
                        return -ENOMEM;
                *MEMBER(out, f, char **) = l;           /* an empty list is an empty list, not NULL */
                r = text_array_open(s, &done);
                for (size_t k = 0; r == 0 && !done; k++) {
                        l = grow(l, &alloc, k + 2, sizeof(char *));
                        if (!l)
                                return -ENOMEM;
                        *MEMBER(out, f, char **) = l;
                        r = text_string(s, f, &l[k]);
                        if (r != 0)
                                return r;
                        *COUNT(out, f) = k + 1;
                        r = text_array_next(s, &done);
                }
                return r;
        }

        case JSON_UINT64V: {
                uint64_t *l = NULL;
                size_t alloc = 0;

                r = text_array_open(s, &done);
                for (size_t k = 0; r == 0 && !done; k++) {
                        if (f->max_len > 0 && k == f->max_len)
                                return TEXT_UNSURE;
                        l = grow(l, &alloc, k + 1, sizeof(uint64_t));
                        if (!l)
                                return -ENOMEM;
                        *MEMBER(out, f, uint64_t *) = l;
                        *COUNT(out, f) = k + 1;
                        r = text_integer(s, true, &i);
                        if (r == 0) {
                                l[k] = (uint64_t)i;
                                r = text_array_next(s, &done);
                        }
                }
                return r;
        }
        }
        return TEXT_UNSURE;
}

/* Reads an object (s->p at its '{') into the struct `out` as the table says, as json_dispatch() does. */
static int text_object(Parse *s, const JsonField *fields, void *out) {
        const JsonField *f, *next = fields;
        uint64_t seen = 0, required = 0;
        size_t n = 0;
        int r;

        for (f = fields; f->name; f++, n++) {
                if (n >= 64 || (!f->required && !field_may_be_optional(f)))
                        return TEXT_UNSURE;
                if (f->required)
                        required |= UINT64_C(1) << n;
        }
        dispatch_reset(fields, out);
        if (s->p >= s->end || *s->p != '{' || s->depth >= VARLINK_MAX_DEPTH)
                return TEXT_UNSURE;
        s->depth++;
        s->p++;
        parse_ws(s);
        if (!parse_char(s, '}'))
                for (;;) {
                        uint64_t bit;
                        const char *k;
                        size_t len;

                        r = parse_string(s, &k, &len);
                        if (r < 0)
                                return text_unsure(r);
                        f = find_field_len(fields, next, k, len);
                        if (!f)
                                return TEXT_UNSURE;     /* an unknown key */
                        bit = UINT64_C(1) << (f - fields);
                        if (seen & bit)
                                return TEXT_UNSURE;     /* a duplicate key */
                        seen |= bit;
                        next = f + 1;
                        parse_ws(s);
                        if (!parse_char(s, ':'))
                                return TEXT_UNSURE;
                        parse_ws(s);
                        r = text_field(s, f, out);
                        if (r != 0)
                                return r;
                        parse_ws(s);
                        if (parse_char(s, '}'))
                                break;
                        if (!parse_char(s, ','))
                                return TEXT_UNSURE;
                        parse_ws(s);
                }
        s->depth--;
        return (seen & required) == required ? 0 : TEXT_UNSURE;
}

/* The fast path over the whole message: 0 with `out` filled, or TEXT_UNSURE or -ENOMEM with nothing held. */
static int text_dispatch(const char *text, size_t len, const JsonField *fields, void *out, const JsonField *raw,
                         const JsonField *raw_fields, void *raw_out, const char **ret_raw, size_t *ret_raw_len) {
        Parse s;
        int r;

        dispatch_reset(fields, out);
        if (raw_fields)
                dispatch_reset(raw_fields, raw_out);
        if (len > INT_MAX)
                return TEXT_UNSURE;
        s.p = (const uint8_t *)text;
        s.end = (const uint8_t *)text + len;
        s.depth = 0;
        s.buf = s.stack;
        s.buf_size = sizeof(s.stack);
        s.raw = raw;
        s.raw_fields = raw_fields;
        s.raw_out = raw_out;
        s.raw_begin = s.raw_end = NULL;
        parse_ws(&s);
        r = text_object(&s, fields, out);
        if (r == 0) {
                parse_ws(&s);
                if (s.p != s.end)
                        r = TEXT_UNSURE;        /* trailing text */
        }
        if (s.buf != s.stack)
                free(s.buf);
        if (r != 0) {
                json_dispatch_free(fields, out);
                if (raw_fields)
                        json_dispatch_free(raw_fields, raw_out);
                return r;
        }
        if (ret_raw) {
                *ret_raw = (const char *)s.raw_begin;
                *ret_raw_len = (size_t)(s.raw_end - s.raw_begin);
        }
        return 0;
}

/* Whether `name` is one of the table's own strings (a bad field json_dispatch() named from the table). */
static bool field_name_in(const JsonField *fields, const char *name) {
        for (const JsonField *f = fields; f->name; f++)
                if (f->name == name)
                        return true;
        return false;
}

int json_dispatch_text(const char *text, size_t len, const JsonField *fields, void *out,
                       const char **ret_bad_field, char **ret_message) {
        _cleanup_(json_object_putp) json_object *o = NULL;
        const char *bad = NULL;
        int r;

        if (ret_bad_field)
                *ret_bad_field = NULL;
        if (!text)
                return json_dispatch(NULL, fields, out, ret_bad_field, ret_message);
        r = text_dispatch(text, len, fields, out, NULL, NULL, NULL, NULL, NULL);
        if (r <= 0)
                return r;

        /* Not sure: the json-c path decides, on the same text. */
        r = json_parse_message(text, len, &o);
        if (r < 0)
                return r;
        r = json_dispatch(o, fields, out, &bad, ret_message);
        if (r == -EINVAL && bad && !field_name_in(fields, bad) && ret_message && *ret_message) {
                /* an unknown key names a key of `o`, which goes now: kept after the message, in its allocation */
                size_t m = strlen(*ret_message), k = strlen(bad);
                char *p = realloc(*ret_message, m + 1 + k + 1);

                if (!p)
                        return -ENOMEM;
                memcpy(p + m + 1, bad, k + 1);
                *ret_message = p;
                bad = p + m + 1;
        } else if (r == -EINVAL && bad && !field_name_in(fields, bad))
                bad = NULL;             /* nowhere to keep it */
        if (ret_bad_field)
                *ret_bad_field = bad;
        return r;
}

int json_dispatch_text_raw(const char *text, size_t len, const JsonField *fields, void *out, const JsonField *raw,
                           const char **ret_raw, size_t *ret_raw_len) {
        *ret_raw = NULL;
        *ret_raw_len = 0;
        if (!text)
                return TEXT_UNSURE;
        return text_dispatch(text, len, fields, out, raw, NULL, NULL, ret_raw, ret_raw_len);
}

int json_dispatch_text_nested(const char *text, size_t len, const JsonField *fields, void *out, const JsonField *raw,
                              const JsonField *raw_fields, void *raw_out, const char **ret_raw, size_t *ret_raw_len) {
        int r;

        *ret_raw = NULL;
        *ret_raw_len = 0;
        if (!text)
                return TEXT_UNSURE;
        r = text_dispatch(text, len, fields, out, raw, raw_fields, raw_out, ret_raw, ret_raw_len);
        if (r == 0 && !*ret_raw)
                json_dispatch_free(raw_fields, raw_out);       /* absent: nothing was read into it */
        return r;
}

/* ---- Building ---- */

/*
 * An array member's items and count, for json_build_write(): 1 when it is written
 * (NULL items with no count is []), 0 when it is left out (optional, NULL), -EINVAL for NULL items with a count.
 */
static int build_items(const JsonField *f, const void *in, const char **ret_items, size_t *ret_n) {
        const char *items = *MEMBER(in, f, char *);
        size_t n = *COUNT(in, f);

        if (!items) {
                if (n > 0)
                        return -EINVAL;
                if (!f->required)
                        return 0;
        }
        *ret_items = items;
        *ret_n = n;
        return 1;
}

/* ---- Writing ---- */

/*
 * Replies and calls are written here rather than by json_object_to_json_string_ext(), which grows a
 * print buffer of json-c's own with a call per string run and escape and formats every integer with
 * snprintf(), and whose text the caller then copied into its own buffer: a third of what a Status cost
 * the daemon. The bytes are json-c's, so that nothing on the wire changes.
 */

typedef struct Writer {
        char *buf;
        size_t alloc;
        size_t len;
} Writer;

int json_buf_reserve(char **buf, size_t *alloc, size_t at, size_t n) {
        size_t a;
        char *b;

        if (*alloc - at >= n)
                return 0;
        if (__builtin_add_overflow(at, n, &a))
                return -ENOMEM;
        /* doubled, so that a message written a piece at a time costs few copies */
        a = MAX(MAX(*alloc * 2, a), (size_t)256);
        b = realloc(*buf, a);
        if (!b)
                return -ENOMEM;
        *buf = b;
        *alloc = a;
        return 0;
}

static int write_reserve(Writer *w, size_t n) {
        /* most calls are for a byte or a few, with room left: no call for those */
        if (w->alloc - w->len >= n)
                return 0;
        return json_buf_reserve(&w->buf, &w->alloc, w->len, n);
}

static int write_bytes(Writer *w, const char *s, size_t n) {
        int r = write_reserve(w, n);

        if (r < 0)
                return r;
        memcpy(w->buf + w->len, s, n);
        w->len += n;
        return 0;
}

/* One byte of punctuation: most of what is written, so no memcpy() for it. */
static int write_char(Writer *w, char c) {
        int r = write_reserve(w, 1);

        if (r < 0)
                return r;
        w->buf[w->len++] = c;
        return 0;
}

/* The bytes json_escape_str() escapes: C0, the quote and the backslash (not '/': NOSLASHESCAPE). */
static const bool needs_escape[256] = {
        [0x00 ... 0x1f] = true,
        ['"'] = true,
        ['\\'] = true,
};

/* json-c's json_escape_str() with JSON_C_TO_STRING_NOSLASHESCAPE: these escapes, other C0 as \u00xx. */
static int write_string(Writer *w, const char *s, size_t len) {
        static const char hex[16] = "0123456789abcdef";
        size_t run = 0;
        int r;

        /* room for it as it is and the quotes; each escape makes room for itself */
        r = write_reserve(w, len + 2);
        if (r < 0)
                return r;
        w->buf[w->len++] = '"';
        for (size_t i = 0; i < len; i++) {
                uint8_t c = (uint8_t)s[i];
                char e;

                if (!needs_escape[c])
                        continue;
                memcpy(w->buf + w->len, s + run, i - run);
                w->len += i - run;
                run = i + 1;
                r = write_reserve(w, 6 + (len - run) + 1);
                if (r < 0)
                        return r;
                switch (c) {
                case '"':  e = '"'; break;
                case '\\': e = '\\'; break;
                case '\b': e = 'b'; break;
                case '\f': e = 'f'; break;
                case '\n': e = 'n'; break;
                case '\r': e = 'r'; break;
                case '\t': e = 't'; break;
                default:
                        memcpy(w->buf + w->len, "\\u00", 4);
                        w->buf[w->len + 4] = hex[c >> 4];
                        w->buf[w->len + 5] = hex[c & 0xf];
                        w->len += 6;
                        continue;
                }
                w->buf[w->len++] = '\\';
                w->buf[w->len++] = e;
        }
        memcpy(w->buf + w->len, s + run, len - run);
        w->len += len - run;
        w->buf[w->len++] = '"';
        return 0;
}

/* "00" to "99": two digits per division when printing integers. */
static const char digit_pairs[] =
        "00010203040506070809101112131415161718192021222324252627282930313233343536373839"
        "40414243444546474849505152535455565758596061626364656667686970717273747576777879"
        "8081828384858687888990919293949596979899";

/* The magnitude u, after a '-' when `negative`: as json-c prints an int64 or a uint64. */
static int write_digits(Writer *w, bool negative, uint64_t u) {
        char d[21];
        size_t n = sizeof(d);

        while (u >= 100) {
                n -= 2;
                memcpy(d + n, digit_pairs + 2 * (u % 100), 2);
                u /= 100;
        }
        if (u >= 10) {
                n -= 2;
                memcpy(d + n, digit_pairs + 2 * u, 2);
        } else
                d[--n] = (char)('0' + u);
        if (negative)
                d[--n] = '-';
        return write_bytes(w, d + n, sizeof(d) - n);
}

static int write_int64(Writer *w, int64_t i) {
        return write_digits(w, i < 0, i < 0 ? -(uint64_t)i : (uint64_t)i);
}

static int write_integer(Writer *w, json_object *o) {
        int64_t i = json_object_get_int64(o);

        /* an int64 prints as itself; a uint64 (above INT64_MAX) reads as INT64_MAX there, itself here */
        return write_digits(w, i < 0, i < 0 ? -(uint64_t)i : json_object_get_uint64(o));
}

static int write_value(Writer *w, json_object *o) {
        const char *text;
        size_t n;
        int r;

        if (!o)
                return write_bytes(w, "null", 4);
        switch (json_object_get_type(o)) {
        case json_type_boolean:
                return json_object_get_boolean(o) ? write_bytes(w, "true", 4) : write_bytes(w, "false", 5);
        case json_type_int:
                return write_integer(w, o);
        case json_type_string:
                return write_string(w, json_object_get_string(o), (size_t)json_object_get_string_len(o));
        case json_type_array:
                n = json_object_array_length(o);
                r = write_char(w, '[');
                for (size_t i = 0; r >= 0 && i < n; i++) {
                        if (i > 0)
                                r = write_char(w, ',');
                        if (r >= 0)
                                r = write_value(w, json_object_array_get_idx(o, i));
                }
                return r < 0 ? r : write_char(w, ']');
        case json_type_object: {
                bool first = true;

                r = write_char(w, '{');
                json_object_object_foreach(o, key, v) {
                        if (r >= 0 && !first)
                                r = write_char(w, ',');
                        if (r >= 0)
                                r = write_string(w, key, strlen(key));
                        if (r >= 0)
                                r = write_char(w, ':');
                        if (r >= 0)
                                r = write_value(w, v);
                        if (r < 0)
                                return r;
                        first = false;
                }
                return r < 0 ? r : write_char(w, '}');
        }
        default:
                /*
                 * A double: json-c writes the text it was parsed from, or formats it its own way. Its text is
                 * the only one not written here, so the only one that could hold a NUL (a serializer set on the
                 * object could write anything): a message never does.
                 */
                text = json_object_to_json_string_length(o, JSON_C_TO_STRING_PLAIN | JSON_C_TO_STRING_NOSLASHESCAPE,
                                                         &n);
                if (!text)
                        return -ENOMEM;
                if (memchr(text, 0, n))
                        return -EBADMSG;
                return write_bytes(w, text, n);
        }
}

ssize_t json_write(json_object *o, char **buf, size_t *alloc, size_t at) {
        Writer w = { .buf = *buf, .alloc = *alloc, .len = at };
        int r;

        r = write_value(&w, o);
        if (r >= 0)
                r = write_reserve(&w, 1);
        /* the buffer may have moved even when writing failed */
        *buf = w.buf;
        *alloc = w.alloc;
        return r < 0 ? r : (ssize_t)w.len;
}

/* ---- Building as text ---- */

/*
 * json_build_write() writes a struct field by field from its table, without making json-c objects: building
 * them and freeing them was most of what a Status reply cost the daemon (an object, a hash table and a copy of
 * every key and string per field, each malloc'd and freed). Its bytes are json_write()'s, so json-c's, so
 * that nothing on the wire changed; test-json.c reads them back and writes them again.
 */

/* Printable ASCII that json-c writes as it is: all but the quote and the backslash. */
static const bool plain_ascii[256] = {
        [0x20 ... '"' - 1] = true,
        ['"' + 1 ... '\\' - 1] = true,
        ['\\' + 1 ... 0x7e] = true,
};

/* A table's string: as it is when it is printable and short enough, else made so (printable_dup()). */
static int write_field_string(Writer *w, const JsonField *f, const char *s) {
        _cleanup_free_ char *d = NULL;
        size_t len = 0;
        int r;

        /* most strings are plain ASCII: one look at each byte, then copied whole */
        while (plain_ascii[(uint8_t)s[len]])
                len++;
        if (!s[len] && (f->max_len == 0 || len <= f->max_len)) {
                r = write_reserve(w, len + 2);
                if (r < 0)
                        return r;
                w->buf[w->len++] = '"';
                memcpy(w->buf + w->len, s, len);
                w->len += len;
                w->buf[w->len++] = '"';
                return 0;
        }
        len += strlen(s + len);
        if ((f->max_len == 0 || len <= f->max_len) && json_string_is_printable(s, len, f->multiline))
                return write_string(w, s, len);
        d = printable_dup(s, len, f->max_len, f->multiline, &len);
        if (!d)
                return -ENOMEM;
        return write_string(w, d, len);
}

/* An integer every varlink peer can read: 0..INT64_MAX. */
static int write_uint64(Writer *w, uint64_t u) {
        if (u > INT64_MAX)
                return -ERANGE;
        return write_digits(w, false, u);
}

/*
 * `"name":`, after a comma unless it is the object's first member. A table's names are the program's own and
 * need no escape: those are copied whole, with one reservation; any other goes through write_string().
 */
static int write_key(Writer *w, const char *name, bool *first) {
        size_t len = 0;
        char *p;
        int r;

        while (name[len] && !needs_escape[(uint8_t)name[len]])
                len++;
        if (name[len]) {
                r = *first ? 0 : write_char(w, ',');
                if (r >= 0)
                        r = write_string(w, name, strlen(name));
                *first = false;
                return r < 0 ? r : write_char(w, ':');
        }
        r = write_reserve(w, len + 4);
        if (r < 0)
                return r;
        p = w->buf + w->len;
        if (!*first)
                *p++ = ',';
        *first = false;
        *p++ = '"';
        memcpy(p, name, len);
        p += len;
        *p++ = '"';
        *p++ = ':';
        w->len = (size_t)(p - w->buf);
        return 0;
}

static int build_write(Writer *w, const JsonField *fields, const void *in) {
        bool first = true;
        int r;

        r = write_char(w, '{');
        for (const JsonField *f = fields; r >= 0 && f->name; f++) {
                switch (f->type) {
                case JSON_INT64: {
                        int64_t i = *MEMBER(in, f, int64_t);

                        if (f->nonnegative && i < 0) {
                                if (f->required)
                                        return -ERANGE;
                                continue;
                        }
                        r = write_key(w, f->name, &first);
                        if (r >= 0)
                                r = write_int64(w, i);
                        break;
                }
                case JSON_UINT64:
                        if (*MEMBER(in, f, uint64_t) > INT64_MAX)
                                return -ERANGE;
                        r = write_key(w, f->name, &first);
                        if (r >= 0)
                                r = write_uint64(w, *MEMBER(in, f, uint64_t));
                        break;
                case JSON_BOOL: {
                        bool b = *MEMBER(in, f, bool);

                        if (!f->required && !b)
                                continue;
                        r = write_key(w, f->name, &first);
                        if (r >= 0)
                                r = b ? write_bytes(w, "true", 4) : write_bytes(w, "false", 5);
                        break;
                }
                case JSON_VARIANT: {
                        json_object *v = *MEMBER(in, f, json_object *);

                        if (!v) {
                                if (f->required)
                                        return -EINVAL;
                                continue;
                        }
                        r = write_key(w, f->name, &first);
                        if (r >= 0)
                                r = write_value(w, v);
                        break;
                }
                case JSON_STRING: {
                        const char *s = *MEMBER(in, f, char *);

                        if (!s) {
                                if (f->required)
                                        return -EINVAL;
                                continue;
                        }
                        r = write_key(w, f->name, &first);
                        if (r >= 0)
                                r = write_field_string(w, f, s);
                        break;
                }
                case JSON_OBJECT:
                        r = write_key(w, f->name, &first);
                        if (r >= 0)
                                r = build_write(w, f->fields, MEMBER(in, f, char));
                        break;
                case JSON_ARRAY:
                case JSON_STRV:
                case JSON_UINT64V: {
                        const char *items;
                        size_t n;

                        r = build_items(f, in, &items, &n);
                        if (r < 0)
                                return r;
                        if (r == 0)
                                continue;
                        r = write_key(w, f->name, &first);
                        if (r >= 0)
                                r = write_char(w, '[');
                        for (size_t k = 0; r >= 0 && k < n; k++) {
                                if (k > 0)
                                        r = write_char(w, ',');
                                if (r < 0)
                                        break;
                                if (f->type == JSON_ARRAY)
                                        r = build_write(w, f->fields, items + k * f->elem_size);
                                else if (f->type == JSON_UINT64V)
                                        r = write_uint64(w, ((const uint64_t *)items)[k]);
                                else if (((char *const *)items)[k])
                                        r = write_field_string(w, f, ((char *const *)items)[k]);
                                else
                                        r = -EINVAL;
                        }
                        if (r >= 0)
                                r = write_char(w, ']');
                        break;
                }
                }
        }
        return r < 0 ? r : write_char(w, '}');
}

ssize_t json_build_write(const JsonField *fields, const void *in, char **buf, size_t *alloc, size_t at) {
        Writer w = { .buf = *buf, .alloc = *alloc, .len = at };
        int r;

        r = build_write(&w, fields, in);
        if (r >= 0)
                r = write_reserve(&w, 1);
        /* the buffer may have moved even when writing failed */
        *buf = w.buf;
        *alloc = w.alloc;
        return r < 0 ? r : (ssize_t)w.len;
}

/*
 * The object is json_build_write()'s text read back: one walk of the table owns which members are written and
 * how, whichever form the caller wants. It costs a parse more than building the objects directly; the
 * requests and replies where that matters are written as text.
 */
int json_build(const JsonField *fields, const void *in, json_object **ret) {
        _cleanup_free_ char *buf = NULL;
        size_t alloc = 0;
        ssize_t n;
        int r;

        n = json_build_write(fields, in, &buf, &alloc, 0);
        if (n < 0)
                return (int)n;
        r = json_parse_message(buf, (size_t)n, ret);
        return r == -EBADMSG ? -EINVAL : r;     /* text we wrote that we cannot read: a variant nested too deep */
}
