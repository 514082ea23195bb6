/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Text tables for vmmctl: columns that line up (text to the left, numbers to
 * the right, two spaces between columns), and fitting to a terminal's width
 * by shortening the columns that allow it with an ellipsis. Widths are
 * counted in terminal cells: UTF-8 is decoded (wcwidth() in a multibyte
 * locale) and colour sequences (ESC [ ... m) count for nothing.
 */

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

typedef enum TableAlign {
        TABLE_LEFT,
        TABLE_RIGHT,
} TableAlign;

typedef struct TableColumn {
        const char *header;
        TableAlign align;
        size_t shrink_to;       /* 0: never shortened; else the narrowest table_fit() may make it
                                   (never narrower than the header) */
} TableColumn;

typedef struct Table Table;

/* A table of the `n_columns` columns (borrowed: they must outlive it). Returns 0, -EINVAL (no columns) or -ENOMEM. */
int table_new(Table **ret, const TableColumn *columns, size_t n_columns);

/* Frees the table; accepts NULL, returns NULL. */
Table *table_free(Table *t);

/* Appends a cell (copied): cells fill the rows left to right, a new row after the last column. */
int table_add(Table *t, const char *text);

/* Replaces the cell at `row`, `column` (copied). Returns 0, -ERANGE or -ENOMEM. */
int table_set(Table *t, size_t row, size_t column, const char *text);

/* Rows begun so far. */
size_t table_rows(const Table *t);

/*
 * Narrows the shrinkable columns, the widest first, until the table is at
 * most `width` cells wide or none can give more. Returns true when it fits.
 */
bool table_fit(Table *t, size_t width);

/* A column's width: as table_fit() left it, else the widest of its header and cells. */
size_t table_column_width(const Table *t, size_t column);

/* The width of a whole line: the columns' widths and the space between them. */
size_t table_width(const Table *t);

/*
 * Prints the table: the header line first when `legend` (bold when `color`),
 * then every row. A cell wider than its column (after table_fit()) ends in
 * `ellipsis`. Lines carry no trailing space. Returns 0 or -ENOMEM.
 */
int table_print(const Table *t, FILE *f, bool legend, bool color, const char *ellipsis);

/* Terminal cells taken by the UTF-8 text `s`; colour sequences take none. */
size_t text_width(const char *s);
