/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * A fake service manager's fd store for the unit tests of the Store and the broker (a StoreBackend):
 * it keeps a dup of every fd saved, by name, and drops it when removed, as systemd does.
 */

#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "macro.h"
#include "store.h"

#define FAKE_MAX 8

typedef struct Fake {
        char names[FAKE_MAX][64];
        int fds[FAKE_MAX];
        size_t n;
        unsigned saves, removes;
} Fake;

_unused_ static int fake_save(void *userdata, const char *name, int fd) {
        Fake *f = userdata;
        int copy;

        ck_assert_uint_lt(f->n, FAKE_MAX);
        copy = fcntl(fd, F_DUPFD_CLOEXEC, 3);
        if (copy < 0)
                return -errno;
        for (size_t i = 0; i < f->n; i++)
                ck_assert_str_ne(f->names[i], name);
        snprintf(f->names[f->n], sizeof(f->names[f->n]), "%s", name);
        f->fds[f->n++] = copy;
        f->saves++;
        return 0;
}

_unused_ static int fake_remove(void *userdata, const char *name) {
        Fake *f = userdata;

        f->removes++;
        for (size_t i = 0; i < f->n; i++)
                if (strcmp(f->names[i], name) == 0) {
                        safe_close(f->fds[i]);
                        f->n--;
                        memmove(&f->names[i], &f->names[i + 1], (f->n - i) * sizeof(f->names[0]));
                        memmove(&f->fds[i], &f->fds[i + 1], (f->n - i) * sizeof(f->fds[0]));
                        return 0;
                }
        return -ENOENT;
}

_unused_ static void fake_done(Fake *f) {
        for (size_t i = 0; i < f->n; i++)
                safe_close(f->fds[i]);
        *f = (Fake){};
}

/* The stored table of the highest generation, as a restarted daemon picks it. */
_unused_ static int fake_latest(const Fake *f) {
        uint64_t best = 0;
        int fd = -EBADF;

        for (size_t i = 0; i < f->n; i++) {
                uint64_t g = strtoull(f->names[i] + strlen(STORE_NAME_PREFIX), NULL, 10);

                ck_assert(strncmp(f->names[i], STORE_NAME_PREFIX, strlen(STORE_NAME_PREFIX)) == 0);
                if (g > best) {
                        best = g;
                        fd = f->fds[i];
                }
        }
        ck_assert_int_ge(fd, 0);
        return fd;
}

