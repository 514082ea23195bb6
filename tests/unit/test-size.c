/* SPDX-License-Identifier: MIT */

#include <errno.h>
#include <stdlib.h>

#include "size.h"
#include "unit.h"

START_TEST(test_parse_size) {
        uint64_t v;

        ck_assert_int_eq(parse_size("0", &v), 0);
        ck_assert_uint_eq(v, 0);
        ck_assert_int_eq(parse_size("4096", &v), 0);
        ck_assert_uint_eq(v, 4096);
        ck_assert_int_eq(parse_size("2M", &v), 0);
        ck_assert_uint_eq(v, UINT64_C(2) << 20);
        ck_assert_int_eq(parse_size("1GiB", &v), 0);
        ck_assert_uint_eq(v, UINT64_C(1) << 30);
        ck_assert_int_eq(parse_size("3T", &v), 0);
        ck_assert_uint_eq(v, UINT64_C(3) << 40);

        ck_assert_int_eq(parse_size("", &v), -EINVAL);
        ck_assert_int_eq(parse_size("-1", &v), -EINVAL);
        ck_assert_int_eq(parse_size(" 1", &v), -EINVAL);
        ck_assert_int_eq(parse_size("1X", &v), -EINVAL);
        ck_assert_int_eq(parse_size("1 G", &v), -EINVAL);
        ck_assert_int_eq(parse_size("1.5G", &v), -EINVAL);
        ck_assert_int_eq(parse_size("99999999999999999999", &v), -ERANGE);
        ck_assert_int_eq(parse_size("16777216T", &v), -ERANGE);
}
END_TEST

START_TEST(test_format_size) {
        char b[FORMAT_SIZE_MAX];

        ck_assert_str_eq(format_size(0, b, sizeof(b)), "0 B");
        ck_assert_str_eq(format_size(1023, b, sizeof(b)), "1023 B");
        ck_assert_str_eq(format_size(2 << 20, b, sizeof(b)), "2 MiB");
        ck_assert_str_eq(format_size(UINT64_C(3) << 29, b, sizeof(b)), "1.5 GiB");
        ck_assert_str_eq(format_size(UINT64_MAX, b, sizeof(b)), "16 EiB");
}
END_TEST

int main(void) {
        return run_suite(UNIT_SUITE("size", NULL, test_parse_size, test_format_size)) == 0 ? EXIT_SUCCESS
                                                                                           : EXIT_FAILURE;
}
