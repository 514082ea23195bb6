/* SPDX-License-Identifier: MIT */

#include <check.h>
#include <errno.h>
#include <json-c/printbuf.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json.h"
#include "macro.h"
#include "unit.h"

static int parse(const char *s) {
        json_object *o = NULL;
        int r;

        r = json_parse_message(s, strlen(s), &o);
        if (r == 0)
                json_object_put(o);
        return r;
}

/* Nests n arrays in an object: {"a":[[...[1]...]]} has n + 1 containers. */
static char *nested(int n) {
        char *s = malloc(2 * (size_t)n + 16);

        strcpy(s, "{\"a\":");
        for (int i = 0; i < n; i++)
                strcat(s, "[");
        strcat(s, "1");
        for (int i = 0; i < n; i++)
                strcat(s, "]");
        strcat(s, "}");
        return s;
}

START_TEST(test_parse_strict) {
        _cleanup_free_ char *d16 = nested(15), *d17 = nested(16);

        ck_assert_int_eq(parse("{}"), 0);
        ck_assert_int_eq(parse(" {\"a\": [1, -2, 3.5e1, true, false, null, \"x\"]}\n"), 0);
        ck_assert_int_eq(parse("{\"a\":\"\\u00e9\\ud83d\\ude00 \xc3\xa9\xf0\x9f\x98\x80\"}"), 0);

        ck_assert_int_eq(parse(""), -EBADMSG);
        ck_assert_int_eq(parse("[]"), -EBADMSG);                        /* not an object */
        ck_assert_int_eq(parse("\"x\""), -EBADMSG);
        ck_assert_int_eq(parse("{\"a\":1} x"), -EBADMSG);               /* trailing garbage */
        ck_assert_int_eq(parse("{\"a\":1}{}"), -EBADMSG);               /* two objects */
        ck_assert_int_eq(parse("{\"a\":NaN}"), -EBADMSG);
        ck_assert_int_eq(parse("{\"a\":Infinity}"), -EBADMSG);
        ck_assert_int_eq(parse("{\"a\":-Infinity}"), -EBADMSG);
        ck_assert_int_eq(parse("{\"a\":1 /* c */}"), -EBADMSG);         /* comments */
        ck_assert_int_eq(parse("{\"a\":1} // c"), -EBADMSG);
        ck_assert_int_eq(parse("{'a':1}"), -EBADMSG);                   /* single quotes */
        ck_assert_int_eq(parse("{\"a\":'x'}"), -EBADMSG);
        ck_assert_int_eq(parse("{\"a\":1,}"), -EBADMSG);                /* trailing comma */
        ck_assert_int_eq(parse("{\"a\":01}"), -EBADMSG);
        ck_assert_int_eq(parse("{\"a\":+1}"), -EBADMSG);
        ck_assert_int_eq(parse("{\"a\":1.}"), -EBADMSG);
        ck_assert_int_eq(parse("{\"a\":.5}"), -EBADMSG);
        ck_assert_int_eq(parse("{\"a\":tRue}"), -EBADMSG);
        ck_assert_int_eq(parse("{a:1}"), -EBADMSG);
        ck_assert_int_eq(parse("{\"a\":\"\xff\"}"), -EBADMSG);           /* invalid UTF-8 */
        ck_assert_int_eq(parse("{\"a\":\"\xc3\"}"), -EBADMSG);           /* cut short */
        ck_assert_int_eq(parse("{\"a\":\"\xc0\xaf\"}"), -EBADMSG);       /* overlong '/' */
        ck_assert_int_eq(parse("{\"a\":\"\xe0\x80\xaf\"}"), -EBADMSG);   /* overlong, 3 bytes */
        ck_assert_int_eq(parse("{\"a\":\"\xed\xa0\x80\"}"), -EBADMSG);   /* a surrogate */
        ck_assert_int_eq(parse("{\"a\":\"\xf4\x90\x80\x80\"}"), -EBADMSG); /* above U+10FFFF */
        ck_assert_int_eq(parse("{\"a\":\"\\ud800\"}"), -EBADMSG);       /* unpaired escape */
        ck_assert_int_eq(parse("{\"a\":\"\\udc00\\ud800\"}"), -EBADMSG);
        ck_assert_int_eq(parse("{\"a\":\"\\u0000\"}"), -EBADMSG);       /* escaped NUL */
        ck_assert_int_eq(parse("{\"a\":\"\x01\"}"), -EBADMSG);           /* raw control character */
        ck_assert_int_eq(parse("{\"a\":\"\\x\"}"), -EBADMSG);           /* unknown escape */
        ck_assert_int_eq(parse("{\"a\":\"x}"), -EBADMSG);
        ck_assert_int_eq(json_parse_message("{}\0", 3, &(json_object *){ NULL }), -EBADMSG); /* embedded NUL */
        ck_assert_int_eq(json_parse_message("{\"a\":\"\0\"}", 8, &(json_object *){ NULL }), -EBADMSG);

        /* depth: the object plus 15 arrays is 16 containers, one more is too many */
        ck_assert_int_eq(parse(d16), 0);
        ck_assert_int_eq(parse(d17), -EBADMSG);

        /* integers json-c would clamp are refused; the rest are kept exactly */
        ck_assert_int_eq(parse("{\"a\":9223372036854775807}"), 0);
        ck_assert_int_eq(parse("{\"a\":-9223372036854775808}"), 0);
        ck_assert_int_eq(parse("{\"a\":18446744073709551615}"), 0);
        ck_assert_int_eq(parse("{\"a\":18446744073709551616}"), -EBADMSG);
        ck_assert_int_eq(parse("{\"a\":-9223372036854775809}"), -EBADMSG);
        ck_assert_int_eq(parse("{\"a\":100000000000000000000}"), -EBADMSG);

        /* duplicate keys, at the top and nested (json-c would keep the last) */
        ck_assert_int_eq(parse("{\"a\":1,\"a\":2}"), -EBADMSG);
        ck_assert_int_eq(parse("{\"a\":1,\"\\u0061\":2}"), -EBADMSG);
        ck_assert_int_eq(parse("{\"a\":[{\"b\":1,\"c\":{},\"b\":{\"x\":1}}]}"), -EBADMSG);
        ck_assert_int_eq(parse("{\"a\":{\"b\":1},\"b\":{\"b\":1}}"), 0);
}
END_TEST

/* json-c's own tokener, as json_parse_message() used it before it built the tree itself. */
static json_object *tokener_parse(const char *s) {
        struct json_tokener *tok = json_tokener_new_ex(VARLINK_MAX_DEPTH + 1);
        json_object *o;

        ck_assert_ptr_nonnull(tok);
        json_tokener_set_flags(tok, JSON_TOKENER_STRICT | JSON_TOKENER_VALIDATE_UTF8);
        o = json_tokener_parse_ex(tok, s, (int)strlen(s));
        ck_assert_msg(o, "json-c refused %s", s);
        json_tokener_free(tok);
        return o;
}

/* Asserts that a and b are the same tree: types (int64 or uint64 too), values, a double's text, key order. */
static void assert_same_tree(json_object *a, json_object *b) {
        ck_assert_int_eq(json_object_get_type(a), json_object_get_type(b));
        switch (json_object_get_type(a)) {
        case json_type_int:
                ck_assert_int_eq(json_object_get_int64(a), json_object_get_int64(b));
                ck_assert_uint_eq(json_object_get_uint64(a), json_object_get_uint64(b));
                break;
        case json_type_double:
                ck_assert(memcmp(&(double){ json_object_get_double(a) }, &(double){ json_object_get_double(b) },
                                 sizeof(double)) == 0);
                ck_assert_str_eq(json_object_to_json_string(a), json_object_to_json_string(b));
                break;
        case json_type_boolean:
                ck_assert_int_eq(json_object_get_boolean(a), json_object_get_boolean(b));
                break;
        case json_type_string:
                ck_assert_int_eq(json_object_get_string_len(a), json_object_get_string_len(b));
                ck_assert_mem_eq(json_object_get_string(a), json_object_get_string(b),
                                 (size_t)json_object_get_string_len(a));
                break;
        case json_type_array:
                ck_assert_uint_eq(json_object_array_length(a), json_object_array_length(b));
                for (size_t i = 0; i < json_object_array_length(a); i++)
                        assert_same_tree(json_object_array_get_idx(a, i), json_object_array_get_idx(b, i));
                break;
        case json_type_object: {
                struct lh_entry *e = json_object_get_object(b)->head;

                ck_assert_int_eq(json_object_object_length(a), json_object_object_length(b));
                json_object_object_foreach(a, key, v) {
                        ck_assert_str_eq(key, (const char *)lh_entry_k(e));
                        assert_same_tree(v, (json_object *)lh_entry_v(e));
                        e = e->next;
                }
                break;
        }
        default:
                break;
        }
}

/* What json_parse_message() accepts, it builds as json-c's tokener would: the tree checked, not the verdict only. */
START_TEST(test_parse_builds_tokeners_tree) {
        static const char *const texts[] = {
                "{}",
                " {\"a\": [1, -2, 3.5e1, true, false, null, \"x\", [], {}]}\n",
                "{\"a\":\"\\u00e9\\ud83d\\ude00 \xc3\xa9\xf0\x9f\x98\x80\"}",
                "{\"e\":\"\\\"\\\\\\/\\b\\f\\n\\r\\t\\u0001\\u001f\\u007f\\u0085\\uffff\\udbff\\udfff\"}",
                "{\"\\u0061\\u00e9k\":1,\"a key longer than the 64 bytes a key may take on the stack: 0123456789\":2}",
                "{\"s\":\"a long string, longer than the parse's 256 bytes on the stack, with an escape here \\n "
                "and more text after it: 0123456789012345678901234567890123456789012345678901234567890123456789"
                "0123456789012345678901234567890123456789012345678901234567890123456789012345678901234567890123\"}",
                "{\"i\":[0,-0,9223372036854775807,9223372036854775808,18446744073709551615,-9223372036854775808]}",
                "{\"d\":[0.0,-0.0,1.50,1e2,1E+2,1e-2,-2.5E-3,1e400,-1e400,1e-400,0.123456789012345678901234567890]}",
                "{\"n\":{\"n\":{\"n\":[[{\"z\":null}]]}},\"after\":\"x\"}",
        };

        for (size_t i = 0; i < ELEMENTSOF(texts); i++) {
                _cleanup_(json_object_putp) json_object *ours = NULL, *theirs = tokener_parse(texts[i]);

                ck_assert_msg(json_parse_message(texts[i], strlen(texts[i]), &ours) == 0, "refused %s", texts[i]);
                assert_same_tree(ours, theirs);
        }
}
END_TEST

/* json_write(o) as json-c writes it: the text, and where it goes in the buffer. */
static void assert_writes_json_c(json_object *o) {
        _cleanup_free_ char *buf = strdup("head");
        const char *want;
        size_t alloc = 4, want_len;
        ssize_t end;

        want = json_object_to_json_string_length(o, JSON_C_TO_STRING_PLAIN | JSON_C_TO_STRING_NOSLASHESCAPE,
                                                 &want_len);
        end = json_write(o, &buf, &alloc, 4);
        ck_assert_int_eq(end, (ssize_t)(4 + want_len));
        ck_assert_uint_gt(alloc, (size_t)end);                  /* room for varlink's NUL */
        ck_assert_mem_eq(buf, "head", 4);                       /* what was before `at` is kept */
        ck_assert_msg(memcmp(buf + 4, want, want_len) == 0, "wrote %.*s\njson-c: %s", (int)want_len, buf + 4, want);
}

/* A serializer that writes a NUL: json_write() refuses what json-c writes with one. */
static int write_nul(json_object *o, struct printbuf *pb, int level, int flags) {
        return printbuf_memappend(pb, "1\0", 2);
}

START_TEST(test_write_is_json_c) {
        _cleanup_(json_object_putp) json_object *o = json_object_new_object(), *empty = json_object_new_object(),
                                                *parsed = NULL, *nul = NULL;
        _cleanup_free_ char *buf = NULL;
        json_object *a = json_object_new_array();
        char every[128];
        size_t alloc = 0;
        static const char text[] = "{\"d\":[1.50,-0.0,1e400,2E-3],\"u\":18446744073709551615,\"s\":\"\\u00e9/\"}";

        /* every ASCII byte, control characters and DEL included, then a NUL and UTF-8 */
        for (size_t i = 0; i < sizeof(every); i++)
                every[i] = (char)i;
        json_object_object_add(o, "every", json_object_new_string_len(every, sizeof(every)));
        json_object_object_add(o, "nul and utf-8", json_object_new_string_len("a\0b\xc3\xa9\xff", 6));
        json_object_object_add(o, "", json_object_new_string(""));
        json_object_object_add(o, "k\"e\\y/\n\x01", json_object_new_boolean(true));
        json_object_object_add(o, "f", json_object_new_boolean(false));
        json_object_object_add(o, "null", NULL);
        json_object_array_add(a, json_object_new_int64(0));
        json_object_array_add(a, json_object_new_int64(-1));
        json_object_array_add(a, json_object_new_int64(INT64_MIN));
        json_object_array_add(a, json_object_new_int64(INT64_MAX));
        json_object_array_add(a, json_object_new_uint64(UINT64_MAX));
        json_object_array_add(a, json_object_new_double(0.1));
        json_object_array_add(a, json_object_new_double(-3));
        json_object_array_add(a, NULL);
        json_object_array_add(a, json_object_new_array());
        json_object_array_add(a, json_object_new_object());
        json_object_object_add(o, "a", a);
        assert_writes_json_c(o);
        assert_writes_json_c(empty);

        /* doubles keep the text they were parsed from */
        ck_assert_int_eq(json_parse_message(text, strlen(text), &parsed), 0);
        assert_writes_json_c(parsed);

        nul = json_object_new_double(1);
        json_object_set_serializer(nul, write_nul, NULL, NULL);
        ck_assert_int_eq(json_write(nul, &buf, &alloc, 0), -EBADMSG);
}
END_TEST

typedef struct Inner {
        uint64_t n;
} Inner;

typedef struct Params {
        uint64_t size;
        int64_t device;
        int64_t delta;
        bool flag;
        char *label;
        Inner *items;
        size_t n_items;
} Params;

static const JsonField inner_fields[] = {
        JSON_FIELD_UINT64("n", Inner, n),
        JSON_FIELD_END,
};

static const JsonField params_fields[] = {
        JSON_FIELD_UINT64("size", Params, size),
        JSON_FIELD_INT64("device", Params, device, false, true),
        JSON_FIELD_INT64("delta", Params, delta, true, false),
        JSON_FIELD_BOOL("flag", Params, flag, false),
        JSON_FIELD_STRING("label", Params, label, false, 8),
        JSON_FIELD_ARRAY("items", Params, items, n_items, Inner, inner_fields, false, 3),
        JSON_FIELD_END,
};

/* Dispatches s; returns the error, with the bad field and message copied out. */
static int dispatch(const char *s, Params *p, char **ret_field, char **ret_message) {
        _cleanup_(json_object_putp) json_object *o = NULL;
        const char *bad = NULL;
        int r;

        ck_assert_int_eq(json_parse_message(s, strlen(s), &o), 0);
        *ret_message = NULL;
        r = json_dispatch(o, params_fields, p, &bad, ret_message);
        *ret_field = bad ? strdup(bad) : NULL;
        return r;
}

#define ck_dispatch_fails(s, field)                                                  \
        do {                                                                         \
                _cleanup_free_ char *f_ = NULL, *m_ = NULL;                          \
                Params p_;                                                           \
                ck_assert_int_eq(dispatch(s, &p_, &f_, &m_), -EINVAL);               \
                ck_assert_ptr_nonnull(f_);                                           \
                ck_assert_str_eq(f_, field);                                         \
                ck_assert_ptr_nonnull(m_);                                           \
                ck_assert_ptr_null(p_.label);                                        \
                ck_assert_ptr_null(p_.items);                                        \
        } while (0)

START_TEST(test_dispatch) {
        _cleanup_free_ char *f = NULL, *m = NULL;
        Params p;

        ck_assert_int_eq(dispatch("{\"size\":4096,\"delta\":-5}", &p, &f, &m), 0);
        ck_assert_uint_eq(p.size, 4096);
        ck_assert_int_eq(p.device, JSON_ABSENT);
        ck_assert_int_eq(p.delta, -5);
        ck_assert(!p.flag);
        ck_assert_ptr_null(p.label);
        ck_assert_ptr_null(p.items);
        json_dispatch_free(params_fields, &p);

        ck_assert_int_eq(dispatch("{\"size\":1,\"delta\":0,\"device\":null,\"label\":null,\"flag\":true,"
                                  "\"items\":[{\"n\":1},{\"n\":2}]}", &p, &f, &m), 0);
        ck_assert_int_eq(p.device, JSON_ABSENT);
        ck_assert(p.flag);
        ck_assert_uint_eq(p.n_items, 2);
        ck_assert_uint_eq(p.items[1].n, 2);
        json_dispatch_free(params_fields, &p);
        ck_assert_ptr_null(p.items);

        ck_assert_int_eq(dispatch("{\"size\":9223372036854775807,\"delta\":-9223372036854775808,"
                                  "\"device\":3,\"label\":\"h\xc3\xa9llo\"}", &p, &f, &m), 0);
        ck_assert_uint_eq(p.size, INT64_MAX);
        ck_assert_int_eq(p.delta, INT64_MIN);
        ck_assert_int_eq(p.device, 3);
        ck_assert_str_eq(p.label, "h\xc3\xa9llo");
        json_dispatch_free(params_fields, &p);
        ck_assert_ptr_null(p.label);

        /* absent parameters are an empty object */
        ck_assert_int_eq(json_dispatch(NULL, inner_fields, &(Inner){}, NULL, NULL), -EINVAL);
        ck_assert_int_eq(json_dispatch(NULL, (const JsonField[]){ JSON_FIELD_END }, &(Inner){}, NULL, NULL), 0);

        ck_dispatch_fails("{\"size\":1,\"delta\":0,\"color\":1}", "color");             /* unknown */
        ck_dispatch_fails("{\"size\":1,\"delta\":0,\"label\":\"ok\",\"x\":null}", "x");
        ck_dispatch_fails("{\"delta\":0}", "size");                                      /* missing */
        ck_dispatch_fails("{\"size\":null,\"delta\":0}", "size");
        ck_dispatch_fails("{\"size\":\"1\",\"delta\":0}", "size");                       /* wrong types */
        ck_dispatch_fails("{\"size\":1.0,\"delta\":0}", "size");
        ck_dispatch_fails("{\"size\":1e3,\"delta\":0}", "size");
        ck_dispatch_fails("{\"size\":true,\"delta\":0}", "size");
        ck_dispatch_fails("{\"size\":1,\"delta\":0,\"flag\":1}", "flag");
        ck_dispatch_fails("{\"size\":1,\"delta\":0,\"label\":5}", "label");
        ck_dispatch_fails("{\"size\":1,\"delta\":0,\"items\":{}}", "items");
        ck_dispatch_fails("{\"size\":-1,\"delta\":0}", "size");                          /* range */
        ck_dispatch_fails("{\"size\":9223372036854775808,\"delta\":0}", "size");
        ck_dispatch_fails("{\"size\":1,\"delta\":9223372036854775808}", "delta");
        ck_dispatch_fails("{\"size\":1,\"delta\":0,\"device\":-1}", "device");
        ck_dispatch_fails("{\"size\":1,\"delta\":0,\"label\":\"123456789\"}", "label"); /* too long */
        ck_dispatch_fails("{\"size\":1,\"delta\":0,\"label\":\"a\\nb\"}", "label");     /* control */
        ck_dispatch_fails("{\"size\":1,\"delta\":0,\"label\":\"a\\u007f\"}", "label");
        ck_dispatch_fails("{\"size\":1,\"delta\":0,\"label\":\"a\\u0085\"}", "label");  /* C1 */
        ck_dispatch_fails("{\"size\":1,\"delta\":0,\"label\":\"a\\u001b[2J\"}", "label");
        ck_dispatch_fails("{\"size\":1,\"delta\":0,\"label\":\"ok\",\"items\":[{\"n\":1},{\"n\":-1}]}", "items");
        ck_dispatch_fails("{\"size\":1,\"delta\":0,\"items\":[{\"n\":1},{\"n\":1,\"m\":1}]}", "items");
        ck_dispatch_fails("{\"size\":1,\"delta\":0,\"items\":[1]}", "items");
        ck_dispatch_fails("{\"size\":1,\"delta\":0,\"items\":[{\"n\":1},{\"n\":1},{\"n\":1},{\"n\":1}]}", "items");

        /* the message names the field */
        ck_assert_int_eq(dispatch("{\"size\":1,\"delta\":0,\"label\":\"123456789\"}", &p, &f, &m), -EINVAL);
        ck_assert_ptr_nonnull(strstr(m, "'label'"));
        free(f);
        free(m);
        ck_assert_int_eq(dispatch("{\"size\":1,\"delta\":0,\"items\":{}}", &p, &f, &m), -EINVAL);
        ck_assert_str_eq(m, "Parameter 'items' must be an array.");
        free(f);
        free(m);
        ck_assert_int_eq(dispatch("{\"size\":1,\"delta\":0,\"items\":[{\"n\":1},{\"n\":1},{\"n\":1},{\"n\":1}]}",
                                  &p, &f, &m), -EINVAL);
        ck_assert_str_eq(m, "Parameter 'items' has more than 3 elements.");
}
END_TEST

/* ---- json_dispatch_text() against json_parse_message() + json_dispatch() ---- */

/* Every field type, with limits, optional and required, nested. */
typedef struct All {
        int64_t i;
        int64_t opt;
        uint64_t u;
        bool req_flag;
        bool flag;
        char *name;
        char *text;
        Inner inner;
        Inner *items;
        size_t n_items;
        char **words;
        size_t n_words;
        uint64_t *numbers;
        size_t n_numbers;
        json_object *any;
} All;

static const JsonField all_fields[] = {
        JSON_FIELD_INT64("i", All, i, true, false),
        JSON_FIELD_INT64("opt", All, opt, false, true),
        JSON_FIELD_UINT64("u", All, u),
        JSON_FIELD_BOOL("req_flag", All, req_flag, true),
        JSON_FIELD_BOOL("flag", All, flag, false),
        JSON_FIELD_STRING("name", All, name, false, 8),
        JSON_FIELD_TEXT("text", All, text, false, 0),
        JSON_FIELD_OBJECT("inner", All, inner, Inner, inner_fields),
        JSON_FIELD_ARRAY("items", All, items, n_items, Inner, inner_fields, false, 3),
        JSON_FIELD_STRV("words", All, words, n_words, false, 4),
        JSON_FIELD_UINT64V("numbers", All, numbers, n_numbers, false, 3),
        JSON_FIELD_VARIANT("any", All, any, false),
        JSON_FIELD_END,
};

/* `i` is not in the table above: a table whose only member is a required INT64 that is not marked required. */
typedef struct Bad {
        int64_t i;
} Bad;

static const JsonField bad_table_fields[] = {
        { .name = "i", .type = JSON_INT64, .required = false, .offset = offsetof(Bad, i) },
        JSON_FIELD_END,
};

/* What a struct holds, as text: json_build_write() of it (every member, arrays' NULL and empty told apart). */
static char *contents(const JsonField *fields, const void *in) {
        char *buf = NULL;
        size_t alloc = 0;
        ssize_t n;

        n = json_build_write(fields, in, &buf, &alloc, 0);
        ck_assert_int_ge(n, 0);
        buf[n] = 0;
        return buf;
}

/*
 * Reads text[0..len) into `fields`' struct both ways and checks they agree: the same result, and the same
 * contents, or the same bad field and message. The struct is `size` bytes. Returns whether the fast path took
 * it alone (json_dispatch_text_raw()).
 */
static bool ck_same_dispatch(const JsonField *fields, size_t size, const char *text, size_t len) {
        _cleanup_(json_object_putp) json_object *o = NULL;
        _cleanup_free_ char *m1 = NULL, *m2 = NULL, *c1 = NULL, *c2 = NULL, *bad1_copy = NULL;
        _cleanup_free_ void *a = calloc(1, size), *b = calloc(1, size), *c = calloc(1, size);
        const char *bad1 = NULL, *bad2 = NULL, *raw = NULL;
        size_t raw_len = 0;
        int r1, r2, r3;

        ck_assert(a && b && c);
        r1 = json_parse_message(text, len, &o);
        if (r1 == 0)
                r1 = json_dispatch(o, fields, a, &bad1, &m1);
        bad1_copy = bad1 ? strdup(bad1) : NULL;
        r2 = json_dispatch_text(text, len, fields, b, &bad2, &m2);
        ck_assert_msg(r1 == r2, "json-c path %d, text path %d for: %.*s", r1, r2, (int)MIN(len, (size_t)300), text);
        if (r1 == 0) {
                c1 = contents(fields, a);
                c2 = contents(fields, b);
                ck_assert_str_eq(c1, c2);
                json_dispatch_free(fields, a);
                json_dispatch_free(fields, b);
        } else {
                ck_assert_msg((bad1_copy == NULL) == (bad2 == NULL), "bad field %s against %s", bad1_copy ?: "(none)",
                              bad2 ?: "(none)");
                if (bad1_copy)
                        ck_assert_str_eq(bad1_copy, bad2);
                ck_assert_msg((m1 == NULL) == (m2 == NULL), "message %s against %s", m1 ?: "(none)", m2 ?: "(none)");
                if (m1)
                        ck_assert_str_eq(m1, m2);
        }
        /* the fast path alone: only ever a yes the json-c path gives too */
        r3 = json_dispatch_text_raw(text, len, fields, c, NULL, &raw, &raw_len);
        ck_assert_msg(r3 == 1 || (r3 == 0 && r1 == 0), "fast path %d, json-c path %d for: %.*s", r3, r1,
                      (int)MIN(len, (size_t)300), text);
        if (r3 == 0) {
                _cleanup_free_ char *c3 = contents(fields, c);

                ck_assert_str_eq(c1, c3);
                json_dispatch_free(fields, c);
        }
        return r3 == 0;
}

/*
 * ck_same_dispatch() of text, of every prefix of it, and of it with every byte in turn changed. Returns how
 * many of those the fast path took alone.
 */
static size_t ck_same_dispatch_mutated(const JsonField *fields, size_t size, const char *text) {
        static const char subst[] = { 0, '"', '\\', '}', ']', ',', ':', '1', '-', '.', 'e', 'n', ' ', '\x80',
                                      '\xff', '{', '[' };
        size_t len = strlen(text);
        _cleanup_free_ char *m = malloc(len + 1);
        size_t n_fast;

        ck_assert_ptr_nonnull(m);
        n_fast = ck_same_dispatch(fields, size, text, len);
        for (size_t n = 0; n < len; n++)
                n_fast += ck_same_dispatch(fields, size, text, n);
        for (size_t i = 0; i < len; i++)
                for (size_t k = 0; k < sizeof(subst); k++) {
                        memcpy(m, text, len);
                        m[i] = subst[k];
                        n_fast += ck_same_dispatch(fields, size, m, len);
                }
        return n_fast;
}

/* Whole messages and hostile ones, for the table `all_fields`. */
static const char *const all_inputs[] = {
        /* accepted */
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2}}",
        " \t\r\n{\"i\":7, \"u\" : 0 , \"req_flag\" : false , \"inner\" : { \"n\" : 0 } } \n",
        ("{\"i\":-9223372036854775808,\"opt\":9223372036854775807,\"u\":9223372036854775807,\"req_flag\":true,"
         "\"flag\":true,\"name\":\"h\\u00e9llo\",\"text\":\"a\\nb\\tc\",\"inner\":{\"n\":1},"
         "\"items\":[{\"n\":1},{\"n\":2},{\"n\":3}],\"words\":[\"ab\",\"\",\"\\ud83d\\ude00\"],"
         "\"numbers\":[0,1,9223372036854775807],\"any\":{\"x\":[1,2.5,\"s\",null,true,{\"y\":{}}]}}"),
        ("{\"i\":7,\"inner\":{\"n\":1},\"req_flag\":true,\"u\":5,\"opt\":null,\"name\":null,\"items\":null,"
         "\"words\":null,\"numbers\":null,\"any\":null,\"flag\":null,\"text\":null}"),
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"items\":[],\"words\":[],\"numbers\":[]}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"name\":\"12345678\"}",
        "{\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"i\":-0,\"opt\":-0}",
        "{\"i\":7,\"\\u0075\":1,\"req_flag\":true,\"inner\":{\"n\":2}}",                  /* an escaped key */
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"any\":{}}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"text\":\"\\\"\\\\\\/\"}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"text\":\"\\b\"}",
        /* duplicate keys, at every level */
        "{\"i\":7,\"u\":1,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2}}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2,\"n\":2}}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"items\":[{\"n\":1,\"n\":1}]}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"any\":{\"a\":1,\"a\":2}}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"any\":{\"a\":{\"b\":1,\"b\":1}}}",
        "{\"i\":7,\"u\":1,\"\\u0075\":1,\"req_flag\":true,\"inner\":{\"n\":2}}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"x\":1,\"x\":1}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"opt\":null,\"opt\":3}",
        /* numbers at and past the limits, and what is not an integer */
        "{\"i\":7,\"u\":9223372036854775808,\"req_flag\":true,\"inner\":{\"n\":2}}",
        "{\"i\":7,\"u\":18446744073709551615,\"req_flag\":true,\"inner\":{\"n\":2}}",
        "{\"i\":7,\"u\":18446744073709551616,\"req_flag\":true,\"inner\":{\"n\":2}}",
        "{\"u\":1,\"i\":-9223372036854775809,\"req_flag\":true,\"inner\":{\"n\":2}}",
        "{\"u\":1,\"i\":9223372036854775808,\"req_flag\":true,\"inner\":{\"n\":2}}",
        "{\"u\":1,\"i\":99999999999999999999999999,\"req_flag\":true,\"inner\":{\"n\":2}}",
        "{\"i\":7,\"u\":-1,\"req_flag\":true,\"inner\":{\"n\":2}}",
        "{\"i\":7,\"u\":-0,\"req_flag\":true,\"inner\":{\"n\":2}}",
        "{\"i\":7,\"u\":1.0,\"req_flag\":true,\"inner\":{\"n\":2}}",
        "{\"i\":7,\"u\":1e3,\"req_flag\":true,\"inner\":{\"n\":2}}",
        "{\"i\":7,\"u\":1E+3,\"req_flag\":true,\"inner\":{\"n\":2}}",
        "{\"i\":7,\"u\":-0.0,\"req_flag\":true,\"inner\":{\"n\":2}}",
        "{\"i\":7,\"u\":01,\"req_flag\":true,\"inner\":{\"n\":2}}",
        "{\"i\":7,\"u\":+1,\"req_flag\":true,\"inner\":{\"n\":2}}",
        "{\"i\":7,\"u\":1,\"opt\":-1,\"req_flag\":true,\"inner\":{\"n\":2}}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"numbers\":[1,-1]}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"numbers\":[1,1.5]}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"numbers\":[1,2,3,4]}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"numbers\":[9223372036854775808]}",
        "{\"i\":7,\"u\":NaN,\"req_flag\":true,\"inner\":{\"n\":2}}",
        "{\"i\":7,\"u\":Infinity,\"req_flag\":true,\"inner\":{\"n\":2}}",
        /* escapes, NUL, surrogates, UTF-8 */
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"name\":\"a\\u0000b\"}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"name\":\"\\ud83d\"}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"name\":\"\\ude00\"}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"name\":\"\\ud83d\\u0041\"}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"name\":\"\\u00\"}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"name\":\"\\x41\"}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"name\":\"\xc0\xaf\"}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"name\":\"\xed\xa0\x80\"}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"name\":\"\xf4\x90\x80\x80\"}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"name\":\"\xe2\x82\"}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"name\":\"a\tb\"}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"name\":\"a\\tb\"}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"name\":\"\\u007f\"}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"name\":\"\\u0085\"}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"name\":\"123456789\"}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"name\":\"\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\"}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"words\":[\"\\u0001\"]}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"words\":[\"12345\"]}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"words\":[\"a\",1]}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"words\":[\"a\",null]}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"any\":{\"\\u0000\":1}}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"any\":{\"k\":\"\xff\"}}",
        /* wrong types, unknown and missing fields */
        "{\"i\":7,\"u\":\"1\",\"req_flag\":true,\"inner\":{\"n\":2}}",
        "{\"i\":7,\"u\":true,\"req_flag\":true,\"inner\":{\"n\":2}}",
        "{\"i\":7,\"u\":1,\"req_flag\":1,\"inner\":{\"n\":2}}",
        "{\"i\":7,\"u\":1,\"req_flag\":null,\"inner\":{\"n\":2}}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":null}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":[]}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{}}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2,\"m\":1}}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"items\":{}}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"items\":[1]}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"items\":[{\"n\":1},{}]}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"items\":[{\"n\":1},{\"n\":1},{\"n\":1},{\"n\":1}]}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"any\":[]}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"any\":1}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"words\":\"a\"}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"color\":1}",
        "{\"color\":1}",
        "{\"req_flag\":true,\"inner\":{\"n\":2}}",
        "{\"i\":7,\"u\":1,\"inner\":{\"n\":2}}",
        "{}",
        /* the grammar: truncated text, trailing garbage, not an object */
        "",
        " ",
        "[]",
        "\"x\"",
        "1",
        "null",
        "{",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2}} x",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2}}{}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},}",
        "{\"i\":7,\"u\":1,,\"req_flag\":true,\"inner\":{\"n\":2}}",
        "{\"i\":7,\"u\" 1,\"req_flag\":true,\"inner\":{\"n\":2}}",
        "{'u':1}",
        "{\"i\":7,\"u\":1 /* c */,\"req_flag\":true,\"inner\":{\"n\":2}}",
        "{\"i\":7,\"u\":1,\"req_flag\":tru,\"inner\":{\"n\":2}}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"any\":{\"a\":[1,]}}",
        "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"any\":{\"a\":nul}}",
};

START_TEST(test_dispatch_text_same) {
        size_t n_fast = 0;      /* counted here, not left by whichever test ran before in the same process */

        for (size_t i = 0; i < ELEMENTSOF(all_inputs); i++)
                n_fast += ck_same_dispatch_mutated(all_fields, sizeof(All), all_inputs[i]);
        ck_assert_uint_gt(n_fast, 10);          /* the fast path did take the good ones */
        /* the earlier table too, and a table that is not valid */
        ck_same_dispatch_mutated(params_fields, sizeof(Params),
                                 "{\"size\":1,\"delta\":-2,\"device\":3,\"flag\":true,\"label\":\"ok\","
                                 "\"items\":[{\"n\":1}]}");
        ck_same_dispatch(bad_table_fields, sizeof(Bad), "{\"i\":1}", 7);
        ck_same_dispatch(bad_table_fields, sizeof(Bad), "{\"i\":1", 6);
}
END_TEST

START_TEST(test_dispatch_text_fast_path) {
        _cleanup_free_ char *m = NULL;
        const char *bad = NULL;
        All a;

        /* what the fast path is for: it takes these without the json-c path */
        for (size_t i = 0; i < 10; i++) {
                const char *raw;
                size_t raw_len;

                ck_assert_msg(json_dispatch_text_raw(all_inputs[i], strlen(all_inputs[i]), all_fields, &a, NULL,
                                                     &raw, &raw_len) == 0, "not taken: %s", all_inputs[i]);
                json_dispatch_free(all_fields, &a);
        }
        /* an unknown key names itself, kept after the message */
        ck_assert_int_eq(json_dispatch_text("{\"u\":1,\"colour\":1}", 18, all_fields, &a, &bad, &m), -EINVAL);
        ck_assert_str_eq(bad, "colour");
        ck_assert_str_eq(m, "Unknown parameter 'colour'.");
        /* NULL text is an absent object */
        ck_assert_int_eq(json_dispatch_text(NULL, 0, inner_fields, &(Inner){}, &bad, NULL), -EINVAL);
        ck_assert_str_eq(bad, "n");
        ck_assert_int_eq(json_dispatch_text(NULL, 0, (const JsonField[]){ JSON_FIELD_END }, &(Inner){}, NULL, NULL),
                         0);
}
END_TEST

/*
 * The reader's shortcuts at their edges, both ways: strings are scanned eight bytes at a time, so a byte that
 * must be looked at by itself ('"', '\\', control, DEL, the bytes of UTF-8, good and bad) is put at every
 * offset of strings of 0 to 24 bytes, behind keys of three lengths (every alignment of the words); integers
 * of up to 18 digits are read in one pass, so every length from 1 to 21 digits is read, with a sign, a leading
 * zero, and a fraction or exponent after it, into a signed and an unsigned field.
 */
START_TEST(test_dispatch_text_edges) {
        /* each byte sequence, and what it reads as inside a string (NULL: the text is not JSON) */
        static const struct {
                const char *text, *value;
        } specials[] = {
                { "\"", NULL }, { "\\\"", "\"" }, { "\\n", "\n" }, { "\\u00e9", "\xc3\xa9" }, { "\x01", NULL },
                { "\x1f", NULL }, { "\x7f", "\x7f" }, { "\x80", NULL }, { "\xc3\xa9", "\xc3\xa9" },
                { "\xe2\x82\xac", "\xe2\x82\xac" }, { "\xf0\x9f\x98\x80", "\xf0\x9f\x98\x80" }, { "\xc3", NULL },
                { "\xff", NULL }, { " ", " " }, { "~", "~" },
        };
        static const char *const keys[] = { "text", "name", "words" };
        static const char *const tails[] = { "", ".5", "e2", "E2", "x", "-" };
        char buf[256], str[128], value[128], digits[32];
        size_t n;

        for (size_t k = 0; k < ELEMENTSOF(keys); k++)
                for (size_t len = 0; len <= 24; len++)
                        for (size_t at = 0; at <= len; at++)
                                for (size_t c = 0; c < ELEMENTSOF(specials); c++) {
                                        _cleanup_(json_object_putp) json_object *o = NULL;
                                        size_t m = 0, v = 0;
                                        int r;

                                        for (size_t i = 0; i <= len; i++)
                                                if (i == at) {
                                                        m += (size_t)sprintf(str + m, "%s", specials[c].text);
                                                        v += (size_t)sprintf(value + v, "%s", specials[c].value ?: "");
                                                } else if (i < len) {
                                                        str[m++] = 'a';
                                                        value[v++] = 'a';
                                                }
                                        str[m] = value[v] = 0;
                                        /* the grammar, against what it must say (both ways share the string reader) */
                                        n = (size_t)snprintf(buf, sizeof(buf), "{\"k\":\"%s\"}", str);
                                        r = json_parse_message(buf, n, &o);
                                        ck_assert_msg((r == 0) == (specials[c].value != NULL), "%d for %s", r, buf);
                                        if (r == 0)
                                                ck_assert_str_eq(json_object_get_string(
                                                                         json_object_object_get(o, "k")), value);
                                        n = (size_t)snprintf(buf, sizeof(buf),
                                                             k == 2 ? "{\"i\":1,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},"
                                                                      "\"%s\":[\"%s\"]}"
                                                                    : "{\"i\":1,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},"
                                                                      "\"%s\":\"%s\"}",
                                                             keys[k], str);
                                        ck_same_dispatch(all_fields, sizeof(All), buf, n);
                                }
        for (size_t len = 1; len <= 21; len++)
                for (int lead = 0; lead < 3; lead++)            /* 9..., 1..., 0... */
                        for (size_t t = 0; t < ELEMENTSOF(tails); t++)
                                for (int neg = 0; neg < 2; neg++)
                                        for (int field = 0; field < 3; field++) {
                                                char number[40];
                                                const char *v[3] = { "1", "1", "1" };   /* i, u, opt */

                                                memset(digits, lead == 0 ? '9' : '0', len);
                                                digits[0] = lead == 1 ? '1' : digits[0];
                                                digits[len] = 0;
                                                (void)snprintf(number, sizeof(number), "%s%s%s", neg ? "-" : "",
                                                               digits, tails[t]);
                                                v[field] = number;
                                                n = (size_t)snprintf(buf, sizeof(buf),
                                                                     "{\"i\":%s,\"u\":%s,\"opt\":%s,\"req_flag\":true,"
                                                                     "\"inner\":{\"n\":2}}", v[0], v[1], v[2]);
                                                ck_same_dispatch(all_fields, sizeof(All), buf, n);
                                        }
}
END_TEST

/* Nesting at and past VARLINK_MAX_DEPTH, in each kind of field, and arrays and strings past their limits. */
START_TEST(test_dispatch_text_limits) {
        _cleanup_free_ char *big = malloc(200000);
        size_t n;

        ck_assert_ptr_nonnull(big);
        for (int depth = 12; depth <= 18; depth++) {
                static const char *const heads[] = { "\"any\":{\"a\":", "\"items\":[{\"n\":1}],\"any\":" };

                for (size_t h = 0; h < ELEMENTSOF(heads); h++) {
                        n = (size_t)sprintf(big, "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},%s", heads[h]);
                        for (int i = 0; i < depth; i++)
                                n += (size_t)sprintf(big + n, "[");
                        n += (size_t)sprintf(big + n, "1");
                        for (int i = 0; i < depth; i++)
                                n += (size_t)sprintf(big + n, "]");
                        n += (size_t)sprintf(big + n, h == 0 ? "}}" : "}");
                        ck_same_dispatch(all_fields, sizeof(All), big, n);
                }
        }
        /* 1,000 nested arrays */
        n = (size_t)sprintf(big, "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"any\":{\"a\":");
        for (int i = 0; i < 1000; i++)
                big[n++] = '[';
        ck_same_dispatch(all_fields, sizeof(All), big, n);
        /* a string of 100,000 bytes, where 8 are allowed and where there is no limit */
        for (int f = 0; f < 2; f++) {
                n = (size_t)sprintf(big, "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"%s\":\"", f ? "text" : "name");
                memset(big + n, 'x', 100000);
                n += 100000;
                n += (size_t)sprintf(big + n, "\"}");
                ck_same_dispatch(all_fields, sizeof(All), big, n);
        }
        /* arrays of 10,000 elements past the limit of 3, and words without a count limit */
        for (int f = 0; f < 3; f++) {
                static const char *const fmt[] = { "{\"n\":1},", "1,", "\"w\"," };
                static const char *const name[] = { "items", "numbers", "words" };

                n = (size_t)sprintf(big, "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"%s\":[", name[f]);
                for (int i = 0; i < 10000; i++)
                        n += (size_t)sprintf(big + n, "%s", fmt[f]);
                n--;
                n += (size_t)sprintf(big + n, "]}");
                ck_same_dispatch(all_fields, sizeof(All), big, n);
        }
        /* a variant of 100 keys (past what the fast path compares for duplicates), with and without one twice */
        for (int dup = 0; dup < 2; dup++) {
                n = (size_t)sprintf(big, "{\"i\":7,\"u\":1,\"req_flag\":true,\"inner\":{\"n\":2},\"any\":{");
                for (int i = 0; i < 100; i++)
                        n += (size_t)sprintf(big + n, "\"k%d\":%d,", dup && i == 99 ? 0 : i, i);
                n--;
                n += (size_t)sprintf(big + n, "}}");
                ck_same_dispatch(all_fields, sizeof(All), big, n);
        }
}
END_TEST

START_TEST(test_build) {
        _cleanup_(json_object_putp) json_object *o = NULL;
        _cleanup_free_ char *f = NULL, *m = NULL;
        Inner items[] = { { .n = 7 } };
        Params in = {
                .size = 5,
                .device = JSON_ABSENT,
                .delta = -3,
                .label = (char *)"bad\x01\xff\xc3\xa9xyzw",     /* sanitised and cut to 8 bytes */
                .items = items,
                .n_items = 1,
        }, out;
        const char *s;

        ck_assert_int_eq(json_build(params_fields, &in, &o), 0);
        s = json_object_to_json_string_ext(o, JSON_C_TO_STRING_PLAIN);
        ck_assert_str_eq(s, "{\"size\":5,\"delta\":-3,\"label\":\"bad??\xc3\xa9x\",\"items\":[{\"n\":7}]}");
        ck_assert_int_eq(dispatch(s, &out, &f, &m), 0);
        ck_assert_int_eq(out.delta, -3);
        json_dispatch_free(params_fields, &out);

        in.size = UINT64_MAX;
        ck_assert_int_eq(json_build(params_fields, &in, &(json_object *){ NULL }), -ERANGE);

        ck_assert(json_string_is_printable("abc \xc3\xa9", 6, false));
        ck_assert(!json_string_is_printable("a\tb", 3, false));
        ck_assert(json_string_is_printable("a\tb\n", 4, true));
        ck_assert(!json_string_is_printable("a\0b", 3, true));
}
END_TEST

/* JSON_UINT64V: an optional array of non-negative integers, with a limit on its length. */
typedef struct Uids {
        uint64_t *uids;
        size_t n_uids;
} Uids;

static const JsonField uids_fields[] = {
        JSON_FIELD_UINT64V("uids", Uids, uids, n_uids, false, 3),
        JSON_FIELD_END,
};

static int dispatch_uids(const char *s, Uids *ret, const char **ret_field) {
        _cleanup_(json_object_putp) json_object *o = json_tokener_parse(s);

        ck_assert_ptr_nonnull(o);
        return json_dispatch(o, uids_fields, ret, ret_field, NULL);
}

START_TEST(test_uint64_array) {
        _cleanup_(json_object_putp) json_object *o = NULL;
        const char *field = NULL;
        Uids u;

        ck_assert_int_eq(dispatch_uids("{}", &u, &field), 0);
        ck_assert_ptr_null(u.uids);
        ck_assert_uint_eq(u.n_uids, 0);
        ck_assert_int_eq(dispatch_uids("{\"uids\": []}", &u, &field), 0);
        ck_assert_uint_eq(u.n_uids, 0);
        ck_assert_int_eq(dispatch_uids("{\"uids\": [0, 1000, 9223372036854775807]}", &u, &field), 0);
        ck_assert_uint_eq(u.n_uids, 3);
        ck_assert_uint_eq(u.uids[1], 1000);
        ck_assert_uint_eq(u.uids[2], INT64_MAX);

        /* builds back to the same text, and an empty optional array is left out */
        ck_assert_int_eq(json_build(uids_fields, &u, &o), 0);
        ck_assert_str_eq(json_object_to_json_string_ext(o, JSON_C_TO_STRING_PLAIN),
                         "{\"uids\":[0,1000,9223372036854775807]}");
        json_dispatch_free(uids_fields, &u);
        ck_assert_ptr_null(u.uids);
        ck_assert_uint_eq(u.n_uids, 0);

        /* every failure names the field and leaves nothing allocated */
        static const char *const bad[] = {
                "{\"uids\": [1, 2, 3, 4]}", "{\"uids\": [-1]}", "{\"uids\": [1, \"2\"]}", "{\"uids\": [1.5]}",
                "{\"uids\": 1}", "{\"uids\": [9223372036854775808]}", "{\"uids\": [[1]]}",
        };
        for (size_t i = 0; i < ELEMENTSOF(bad); i++) {
                ck_assert_msg(dispatch_uids(bad[i], &u, &field) == -EINVAL, "%s was accepted", bad[i]);
                ck_assert_str_eq(field, "uids");
                ck_assert_ptr_null(u.uids);
        }
}
END_TEST

/* ---- json_build_write(), and json_build(): its text read back into json-c's objects ---- */

typedef struct Every {
        int64_t i;              /* required, any sign */
        int64_t opt;            /* optional, non-negative: -1 is absent */
        uint64_t u;
        bool on;                /* required */
        bool flag;              /* optional: false is absent */
        char *name;             /* required, at most 8 bytes */
        char *label;            /* optional, no limit */
        char *text;             /* optional, newline and tab allowed */
        Inner inner;
        Inner *items;           /* required: NULL with no items is [] */
        size_t n_items;
        Inner *more;            /* optional: NULL is absent */
        size_t n_more;
        char **names;
        size_t n_names;
        uint64_t *ids;
        size_t n_ids;
        json_object *extra;
} Every;

static const JsonField every_fields[] = {
        JSON_FIELD_INT64("i", Every, i, true, false),
        JSON_FIELD_INT64("opt", Every, opt, false, true),
        JSON_FIELD_UINT64("u", Every, u),
        JSON_FIELD_BOOL("on", Every, on, true),
        JSON_FIELD_BOOL("flag", Every, flag, false),
        JSON_FIELD_STRING("name", Every, name, true, 8),
        JSON_FIELD_STRING("label", Every, label, false, 0),
        JSON_FIELD_TEXT("text", Every, text, false, 0),
        JSON_FIELD_OBJECT("inner", Every, inner, Inner, inner_fields),
        JSON_FIELD_ARRAY("items", Every, items, n_items, Inner, inner_fields, true, 0),
        JSON_FIELD_ARRAY("more", Every, more, n_more, Inner, inner_fields, false, 0),
        JSON_FIELD_STRV("names", Every, names, n_names, false, 4),
        JSON_FIELD_UINT64V("ids", Every, ids, n_ids, false, 0),
        JSON_FIELD_VARIANT("extra", Every, extra, false),
        JSON_FIELD_END,
};

/*
 * json_build_write() of `in` after "head" in a buffer of 4 bytes, and json_build() of it then json_write(): the
 * same result, bytes or error (the object read back from the text writes the very text again, which
 * json_write() writes as json-c does). Returns the text (malloc'd) or NULL for an error.
 */
static char *assert_build_write_same(const JsonField *fields, const void *in) {
        _cleanup_(json_object_putp) json_object *o = NULL;
        _cleanup_free_ char *want = strdup("head"), *got = strdup("head");
        size_t want_alloc = 4, got_alloc = 4;
        ssize_t want_end, got_end;
        int r;

        ck_assert_ptr_nonnull(want);
        ck_assert_ptr_nonnull(got);
        r = json_build(fields, in, &o);
        want_end = r < 0 ? r : json_write(o, &want, &want_alloc, 4);
        got_end = json_build_write(fields, in, &got, &got_alloc, 4);
        ck_assert_int_eq(got_end, want_end);
        if (got_end < 0)
                return NULL;
        ck_assert_uint_gt(got_alloc, (size_t)got_end);         /* room for varlink's NUL */
        ck_assert_mem_eq(got, "head", 4);                       /* what was before `at` is kept */
        ck_assert_msg(memcmp(got + 4, want + 4, (size_t)want_end - 4) == 0, "wrote %.*s\njson_build: %.*s",
                      (int)got_end - 4, got + 4, (int)want_end - 4, want + 4);
        ck_assert_ptr_null(memchr(got, 0, (size_t)got_end));
        return strndup(got + 4, (size_t)got_end - 4);
}

/* Strings that need escaping or making printable: quotes, backslashes, every control character, DEL, C1,
 * non-ASCII (2, 3 and 4 bytes), bytes that are not UTF-8, and what JSON allows unescaped ('/', U+2028). */
static const char *const hostile[] = {
        "",
        "plain",
        "\"",
        "\\",
        "\"quoted\" and \\back\\slashed\\",
        "\x01\x02\x03\x04\x05\x06\x07\x08\t\n\x0b\x0c\r\x0e\x0f\x10\x11\x12\x13\x14\x15\x16\x17\x18\x19\x1a\x1b"
        "\x1c\x1d\x1e\x1f",
        "a\x7f" "b",
        "c1 \xc2\x85 \xc2\x9f",
        "h\xc3\xa9llo \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x98\x80",
        "bad \xff \xc0\xaf \xed\xa0\x80 \xe2\x82 \xf4\x90\x80\x80",
        "</script> \xe2\x80\xa8 \xe2\x80\xa9 /",
        "\x1b[2J\x1b]0;title\x07",
        "tab\tnew\nline",
        "123456789",            /* over name's 8 bytes: cut */
        "1234567\xc3\xa9",      /* cut before a character that would not fit */
};

START_TEST(test_build_write) {
        _cleanup_(json_object_putp) json_object *extra = NULL;
        Inner items[] = { { .n = 0 }, { .n = INT64_MAX } };
        uint64_t ids[] = { 0, 1, INT64_MAX };
        char *names[] = { (char *)"a\"b", (char *)"\xff", (char *)"", NULL };
        static const char extra_text[] = "{\"d\":[1.50,-0.0,1e400],\"s\":\"\\u00e9/\\\"\",\"n\":null,\"b\":false}";
        Every in = {
                .i = INT64_MIN, .opt = INT64_MAX, .u = INT64_MAX, .on = true, .flag = true,
                .name = (char *)"dev\"0", .label = (char *)"l", .text = (char *)"t",
                .inner = { .n = 42 }, .items = items, .n_items = 2, .more = items, .n_more = 1,
                .names = names, .n_names = 3, .ids = ids, .n_ids = 3,
        };
        char *t;

        ck_assert_int_eq(json_parse_message(extra_text, strlen(extra_text), &extra), 0);
        in.extra = extra;

        /* every type, every member present, integers at their extremes */
        t = assert_build_write_same(every_fields, &in);
        ck_assert_ptr_nonnull(t);
        ck_assert_str_eq(t, "{\"i\":-9223372036854775808,\"opt\":9223372036854775807,\"u\":9223372036854775807,"
                         "\"on\":true,\"flag\":true,\"name\":\"dev\\\"0\",\"label\":\"l\",\"text\":\"t\","
                         "\"inner\":{\"n\":42},\"items\":[{\"n\":0},{\"n\":9223372036854775807}],"
                         "\"more\":[{\"n\":0}],\"names\":[\"a\\\"b\",\"?\",\"\"],"
                         "\"ids\":[0,1,9223372036854775807],"
                         "\"extra\":{\"d\":[1.50,-0.0,1e400],\"s\":\"\xc3\xa9/\\\"\",\"n\":null,\"b\":false}}");
        free(t);

        /* every optional member absent, the required array empty: present as [], the others left out */
        in = (Every){ .i = INT64_MAX, .opt = JSON_ABSENT, .u = 0, .on = false, .name = (char *)"" };
        t = assert_build_write_same(every_fields, &in);
        ck_assert_ptr_nonnull(t);
        ck_assert_str_eq(t, "{\"i\":9223372036854775807,\"u\":0,\"on\":false,\"name\":\"\",\"inner\":{\"n\":0},"
                         "\"items\":[]}");
        free(t);
        in.opt = INT64_MIN;     /* any negative value is absent */
        in.i = -1;
        t = assert_build_write_same(every_fields, &in);
        ck_assert_str_eq(t, "{\"i\":-1,\"u\":0,\"on\":false,\"name\":\"\",\"inner\":{\"n\":0},\"items\":[]}");
        free(t);
        in.items = items;       /* an empty array that is there */
        in.more = items;
        in.ids = ids;
        in.names = names;
        in.names[0] = NULL;
        t = assert_build_write_same(every_fields, &in);
        ck_assert_str_eq(t, "{\"i\":-1,\"u\":0,\"on\":false,\"name\":\"\",\"inner\":{\"n\":0},\"items\":[],"
                         "\"more\":[],\"names\":[],\"ids\":[]}");
        free(t);
        names[0] = (char *)"a\"b";

        /* hostile strings in every string member, each made printable and escaped as json_build() does, and
         * read back as valid JSON */
        for (size_t i = 0; i < ELEMENTSOF(hostile); i++) {
                _cleanup_(json_object_putp) json_object *back = NULL;
                char *strv[] = { (char *)hostile[i], NULL };

                in = (Every){ .opt = JSON_ABSENT, .name = (char *)hostile[i], .label = (char *)hostile[i],
                              .text = (char *)hostile[i], .names = strv, .n_names = 1 };
                t = assert_build_write_same(every_fields, &in);
                ck_assert_ptr_nonnull(t);
                ck_assert_msg(json_parse_message(t, strlen(t), &back) == 0, "not strict JSON: %s", t);
                free(t);
        }

        /* every number of digits, on both sides of each power of ten */
        {
                int64_t v = 1;

                for (int k = 0; k < 19; k++) {
                        for (int64_t d = -1; d <= 1; d++) {
                                in = (Every){ .i = v + d, .opt = v + d, .u = (uint64_t)(v + d), .name = (char *)"" };
                                free(assert_build_write_same(every_fields, &in));
                                in.i = -(v + d);
                                free(assert_build_write_same(every_fields, &in));
                        }
                        if (k < 18)
                                v *= 10;        /* up to 10^18: INT64_MAX is 9.2 x 10^18 */
                }
        }

        /* a key that needs escaping (no table has one) is escaped as json-c escapes it */
        {
                static const JsonField odd_key_fields[] = {
                        JSON_FIELD_BOOL("plain", Every, on, true),
                        JSON_FIELD_BOOL("k\"e\\y/\n\x01", Every, flag, true),
                        JSON_FIELD_INT64("", Every, i, true, false),
                        JSON_FIELD_END,
                };

                in = (Every){ .on = true, .i = 5 };
                t = assert_build_write_same(odd_key_fields, &in);
                ck_assert_str_eq(t, "{\"plain\":true,\"k\\\"e\\\\y/\\n\\u0001\":false,\"\":5}");
                free(t);
                t = assert_build_write_same(odd_key_fields + 1, &in);  /* first in its object */
                ck_assert_str_eq(t, "{\"k\\\"e\\\\y/\\n\\u0001\":false,\"\":5}");
                free(t);
        }

        /* the errors json_build() gives, in its order */
        in = (Every){ .opt = JSON_ABSENT, .name = NULL };
        ck_assert_ptr_null(assert_build_write_same(every_fields, &in));                 /* required string */
        in.name = (char *)"n";
        in.u = (uint64_t)INT64_MAX + 1;
        ck_assert_ptr_null(assert_build_write_same(every_fields, &in));                 /* -ERANGE */
        in.u = 0;
        in.n_items = 1;
        ck_assert_ptr_null(assert_build_write_same(every_fields, &in));                 /* NULL with a count */
        in.n_items = 0;
        in.ids = ids;
        in.n_ids = 1;
        ids[0] = UINT64_MAX;
        ck_assert_ptr_null(assert_build_write_same(every_fields, &in));                 /* in an array */
        ids[0] = 0;
        in.names = names;
        in.n_names = 4;                                                                 /* names[3] is NULL */
        ck_assert_ptr_null(assert_build_write_same(every_fields, &in));
        in.n_names = 0;
        in.names = NULL;
        ck_assert_ptr_nonnull((t = assert_build_write_same(every_fields, &in)));
        free(t);
        {
                _cleanup_free_ char *buf = NULL;
                size_t alloc = 0;

                in.i = 0;
                ck_assert_int_eq(json_build_write((const JsonField[]){
                                         JSON_FIELD_INT64("i", Every, i, true, true), JSON_FIELD_END },
                                                  &(Every){ .i = -1 }, &buf, &alloc, 0), -ERANGE);
                ck_assert_int_eq(json_build_write((const JsonField[]){
                                         JSON_FIELD_VARIANT("extra", Every, extra, true), JSON_FIELD_END },
                                                  &in, &buf, &alloc, 0), -EINVAL);
        }
}
END_TEST

/* A message far larger than the buffer it starts in (none, then a few bytes): it grows, and nothing is lost. */
START_TEST(test_build_write_large) {
        _cleanup_free_ char *big = malloc(100001), *buf = NULL;
        _cleanup_free_ Inner *items = calloc(5000, sizeof(Inner));
        Every in = { .opt = JSON_ABSENT, .name = (char *)"n", .items = items, .n_items = 5000 };
        size_t alloc = 0;
        ssize_t end;
        char *t;

        ck_assert_ptr_nonnull(big);
        ck_assert_ptr_nonnull(items);
        /* escapes all the way: 1.5 bytes a byte in label (the control characters become '?'), 1.75 in text */
        for (size_t i = 0; i < 100000; i++)
                big[i] = "\"\\\x01\n"[i % 4];
        big[100000] = 0;
        for (size_t i = 0; i < 5000; i++)
                items[i].n = i * 1000003;
        in.label = big;
        in.text = big;
        t = assert_build_write_same(every_fields, &in);
        ck_assert_ptr_nonnull(t);
        ck_assert_uint_gt(strlen(t), 325000);
        free(t);

        end = json_build_write(every_fields, &in, &buf, &alloc, 0);
        ck_assert_int_gt(end, 325000);
        ck_assert_uint_gt(alloc, (size_t)end);
        /* again into the same buffer, after what it holds */
        ck_assert_int_eq(json_build_write(every_fields, &in, &buf, &alloc, (size_t)end), 2 * end);
        ck_assert_mem_eq(buf, buf + end, (size_t)end);
}
END_TEST

/* json_buf_reserve(): room for n bytes from `at`, doubled or what is needed, 256 at the least; what was kept. */
START_TEST(test_buf_reserve) {
        _cleanup_free_ char *buf = NULL;
        size_t alloc = 0;
        char *was;

        ck_assert_int_eq(json_buf_reserve(&buf, &alloc, 0, 1), 0);
        ck_assert_ptr_nonnull(buf);
        ck_assert_uint_eq(alloc, 256);
        memcpy(buf, "head", 4);
        was = buf;
        ck_assert_int_eq(json_buf_reserve(&buf, &alloc, 4, 252), 0);          /* it fits: nothing moves */
        ck_assert_ptr_eq(buf, was);
        ck_assert_uint_eq(alloc, 256);
        ck_assert_int_eq(json_buf_reserve(&buf, &alloc, 4, 253), 0);
        ck_assert_uint_eq(alloc, 512);
        ck_assert_mem_eq(buf, "head", 4);
        ck_assert_int_eq(json_buf_reserve(&buf, &alloc, 4, 5000), 0);
        ck_assert_uint_eq(alloc, 5004);
        ck_assert_mem_eq(buf, "head", 4);
        /* at + n past SIZE_MAX: no memory, and the buffer as it was */
        was = buf;
        ck_assert_int_eq(json_buf_reserve(&buf, &alloc, 4, SIZE_MAX), -ENOMEM);
        ck_assert_ptr_eq(buf, was);
        ck_assert_uint_eq(alloc, 5004);
}
END_TEST

int main(void) {
        Suite *s = suite_create("json");
        TCase *tc = tcase_create("json");
        int failed;

        tcase_add_test(tc, test_parse_strict);
        tcase_add_test(tc, test_parse_builds_tokeners_tree);
        tcase_add_test(tc, test_write_is_json_c);
        tcase_add_test(tc, test_dispatch);
        tcase_add_test(tc, test_dispatch_text_same);
        tcase_add_test(tc, test_dispatch_text_edges);
        tcase_add_test(tc, test_dispatch_text_fast_path);
        tcase_add_test(tc, test_dispatch_text_limits);
        tcase_add_test(tc, test_build);
        tcase_add_test(tc, test_uint64_array);
        tcase_add_test(tc, test_build_write);
        tcase_add_test(tc, test_build_write_large);
        tcase_add_test(tc, test_buf_reserve);
        suite_add_tcase(s, tc);
        failed = run_suite(s);
        return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
