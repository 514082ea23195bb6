/* SPDX-License-Identifier: MIT */

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <wchar.h>

#include "macro.h"
#include "table.h"

#define TABLE_SEPARATOR "  "
#define TABLE_SEPARATOR_WIDTH (sizeof(TABLE_SEPARATOR) - 1)

struct Table {
        const TableColumn *columns;
        size_t n_columns;
        char **cells;           /* row by row */
        size_t n_cells, n_allocated;
        size_t *widths;         /* set by table_fit() */
        bool fitted;
};

/* --- text widths ------------------------------------------------------------------------------------ */

/* Length of the colour sequence (ESC [ parameters final-byte) at `s`, or 0 when none starts there. */
static size_t escape_len(const char *s) {
        size_t i;

        if (s[0] != '\033' || s[1] != '[')
                return 0;
        for (i = 2; s[i]; i++)
                if (s[i] >= 0x40 && s[i] <= 0x7e)
                        return i + 1;
        return i;
}

/* Decodes the UTF-8 character at `s` into *ret and returns its length; a stray byte is U+FFFD, 1 long. */
static size_t utf8_decode(const char *s, uint32_t *ret) {
        const unsigned char *u = (const unsigned char *)s;
        size_t len;
        uint32_t cp;

        if (u[0] < 0x80)
                len = 1, cp = u[0];
        else if ((u[0] & 0xe0) == 0xc0)
                len = 2, cp = u[0] & 0x1f;
        else if ((u[0] & 0xf0) == 0xe0)
                len = 3, cp = u[0] & 0x0f;
        else if ((u[0] & 0xf8) == 0xf0)
                len = 4, cp = u[0] & 0x07;
        else
                len = 0, cp = 0;
        for (size_t i = 1; i < len; i++) {
                if ((u[i] & 0xc0) != 0x80) {    /* the string's NUL stops here too */
                        len = 0;
                        break;
                }
                cp = cp << 6 | (u[i] & 0x3f);
        }
        if (len == 0) {
                *ret = 0xfffd;
                return 1;
        }
        *ret = cp;
        return len;
}

/* Terminal cells of one character: wcwidth() where the locale knows it, else one. */
static size_t char_width(uint32_t cp) {
        int w;

        if (cp < 0x80 || MB_CUR_MAX == 1)
                return 1;
        w = wcwidth((wchar_t)cp);
        return w < 0 ? 1 : (size_t)w;
}

/*
 * The longest start of `s` at most `max_width` cells wide: returns its length
 * in bytes, and its width in *ret_width.
 */
static size_t text_prefix(const char *s, size_t max_width, size_t *ret_width) {
        size_t i = 0, width = 0;

        while (s[i]) {
                size_t n = escape_len(s + i), w = 0;
                uint32_t cp;

                if (n == 0) {
                        n = utf8_decode(s + i, &cp);
                        w = char_width(cp);
                }
                if (width + w > max_width)
                        break;
                width += w;
                i += n;
        }
        *ret_width = width;
        return i;
}

size_t text_width(const char *s) {
        size_t width;

        (void)text_prefix(s, SIZE_MAX, &width);
        return width;
}

/* --- the table -------------------------------------------------------------------------------------- */

int table_new(Table **ret, const TableColumn *columns, size_t n_columns) {
        Table *t;

        if (n_columns == 0)
                return -EINVAL;
        t = calloc(1, sizeof(*t));
        if (!t)
                return -ENOMEM;
        t->widths = calloc(n_columns, sizeof(size_t));
        if (!t->widths) {
                free(t);
                return -ENOMEM;
        }
        t->columns = columns;
        t->n_columns = n_columns;
        *ret = t;
        return 0;
}

Table *table_free(Table *t) {
        if (!t)
                return NULL;
        for (size_t i = 0; i < t->n_cells; i++)
                free(t->cells[i]);
        free(t->cells);
        free(t->widths);
        free(t);
        return NULL;
}

int table_add(Table *t, const char *text) {
        char *copy;

        if (t->n_cells == t->n_allocated) {
                size_t n = t->n_allocated * 2 + 16;
                char **cells = reallocarray(t->cells, n, sizeof(char *));

                if (!cells)
                        return -ENOMEM;
                t->cells = cells;
                t->n_allocated = n;
        }
        copy = strdup(text);
        if (!copy)
                return -ENOMEM;
        t->cells[t->n_cells++] = copy;
        return 0;
}

int table_set(Table *t, size_t row, size_t column, const char *text) {
        size_t i = row * t->n_columns + column;
        char *copy;

        if (column >= t->n_columns || i >= t->n_cells)
                return -ERANGE;
        copy = strdup(text);
        if (!copy)
                return -ENOMEM;
        free(t->cells[i]);
        t->cells[i] = copy;
        return 0;
}

size_t table_rows(const Table *t) {
        return (t->n_cells + t->n_columns - 1) / t->n_columns;
}

static const char *table_cell(const Table *t, size_t row, size_t column) {
        size_t i = row * t->n_columns + column;

        return i < t->n_cells ? t->cells[i] : "";
}

/* The widest of the column's header and cells. */
static size_t natural_width(const Table *t, size_t column) {
        size_t width = text_width(t->columns[column].header);

        for (size_t row = 0; row < table_rows(t); row++) {
                size_t w = text_width(table_cell(t, row, column));

                if (w > width)
                        width = w;
        }
        return width;
}

size_t table_column_width(const Table *t, size_t column) {
        return t->fitted ? t->widths[column] : natural_width(t, column);
}

size_t table_width(const Table *t) {
        size_t width = TABLE_SEPARATOR_WIDTH * (t->n_columns - 1);

        for (size_t c = 0; c < t->n_columns; c++)
                width += table_column_width(t, c);
        return width;
}

bool table_fit(Table *t, size_t width) {
        size_t total;

        for (size_t c = 0; c < t->n_columns; c++)
                t->widths[c] = natural_width(t, c);
        t->fitted = true;

        /* One cell at a time from the widest shrinkable column, so that the shortening is shared out. */
        for (total = table_width(t); total > width; total--) {
                size_t widest = SIZE_MAX;

                for (size_t c = 0; c < t->n_columns; c++) {
                        const TableColumn *col = &t->columns[c];
                        size_t header = text_width(col->header);
                        size_t min = col->shrink_to > header ? col->shrink_to : header;

                        if (col->shrink_to > 0 && t->widths[c] > min &&
                            (widest == SIZE_MAX || t->widths[c] > t->widths[widest]))
                                widest = c;
                }
                if (widest == SIZE_MAX)
                        return false;
                t->widths[widest]--;
        }
        return true;
}

static void put_spaces(FILE *f, size_t n) {
        for (size_t i = 0; i < n; i++)
                fputc(' ', f);
}

/* Writes `text` into `width` cells as the column aligns it, shortened with `ellipsis` if it is too wide. */
static void put_cell(FILE *f, const char *text, size_t width, TableAlign align, const char *ellipsis) {
        size_t w = text_width(text), len = strlen(text);

        if (w > width) {
                size_t ew = text_width(ellipsis);

                if (ew > width)
                        ellipsis = "", ew = 0;
                len = text_prefix(text, width - ew, &w);
                fwrite(text, 1, len, f);
                fputs(ellipsis, f);
                put_spaces(f, width - w - ew);
                return;
        }
        if (align == TABLE_RIGHT)
                put_spaces(f, width - w);
        fwrite(text, 1, len, f);
        if (align == TABLE_LEFT)
                put_spaces(f, width - w);
}

/* One line in columns `widths` wide, with the trailing padding trimmed; `row` SIZE_MAX is the header. */
static int print_line(const Table *t, const size_t *widths, FILE *f, size_t row, bool bold,
                      const char *ellipsis) {
        _cleanup_free_ char *line = NULL;
        size_t len = 0;
        FILE *m;

        m = open_memstream(&line, &len);
        if (!m)
                return -ENOMEM;
        for (size_t c = 0; c < t->n_columns; c++) {
                const char *text = row == SIZE_MAX ? t->columns[c].header : table_cell(t, row, c);
                TableAlign align = t->columns[c].align;

                if (c > 0)
                        fputs(TABLE_SEPARATOR, m);
                /* the header of a right-aligned column sits over its numbers' right edge */
                put_cell(m, text, widths[c], align, ellipsis);
        }
        if (fclose(m) != 0)
                return -ENOMEM;
        while (len > 0 && line[len - 1] == ' ')
                len--;
        if (bold)
                fputs("\033[1m", f);
        fwrite(line, 1, len, f);
        if (bold)
                fputs("\033[0m", f);
        fputc('\n', f);
        return 0;
}

int table_print(const Table *t, FILE *f, bool legend, bool color, const char *ellipsis) {
        _cleanup_free_ size_t *widths = calloc(t->n_columns, sizeof(size_t));
        int k;

        if (!widths)
                return -ENOMEM;
        for (size_t c = 0; c < t->n_columns; c++)
                widths[c] = table_column_width(t, c);   /* once: each is a pass over the column */
        if (legend) {
                k = print_line(t, widths, f, SIZE_MAX, color, ellipsis);
                if (k < 0)
                        return k;
        }
        for (size_t row = 0; row < table_rows(t); row++) {
                k = print_line(t, widths, f, row, false, ellipsis);
                if (k < 0)
                        return k;
        }
        return 0;
}
