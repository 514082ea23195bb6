/* SPDX-License-Identifier: MIT */
#pragma once

#include <stddef.h>
#include <stdint.h>

/*
 * Parses a byte size: digits with an optional binary suffix K, M, G or T
 * (KiB, MiB, ... are accepted too). Returns 0 or -EINVAL/-ERANGE.
 */
int parse_size(const char *s, uint64_t *ret);

/* Formats a byte size for people: "512 B", "2 MiB", "1.5 GiB". Returns buf. */
char *format_size(uint64_t bytes, char *buf, size_t len);
#define FORMAT_SIZE_MAX 32
