/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Small helpers used everywhere: cleanup attributes, ownership transfer and
 * array sizes. Kept deliberately tiny.
 */

#include <errno.h>
#include <stdlib.h>
#include <unistd.h>

#define _cleanup_(f) __attribute__((cleanup(f)))
#define _unused_ __attribute__((unused))
#define _printf_(a, b) __attribute__((format(printf, a, b)))
#define _likely_(x) __builtin_expect(!!(x), 1)
#define _unlikely_(x) __builtin_expect(!!(x), 0)

#define ELEMENTSOF(x) (sizeof(x) / sizeof((x)[0]))

#define container_of(ptr, type, member) ((type *)((char *)(ptr) - offsetof(type, member)))

/* Hand ownership of a pointer or fd over to the caller, leaving the local empty. */
#define TAKE_PTR(p)                         \
        ({                                  \
                __typeof__(p) _take_ = (p); \
                (p) = NULL;                 \
                _take_;                     \
        })
#define TAKE_FD(fd)                 \
        ({                          \
                int _take_ = (fd);  \
                (fd) = -EBADF;      \
                _take_;             \
        })

/* Frees `p`; returns NULL, so that `x = mfree(x);` leaves nothing dangling. */
static inline void *mfree(void *p) {
        free(p);
        return NULL;
}

static inline void freep(void *p) {
        free(*(void **)p);
}
#define _cleanup_free_ _cleanup_(freep)

/* Close an fd, keeping errno; returns -EBADF so that `fd = safe_close(fd);` works. */
static inline int safe_close(int fd) {
        if (fd >= 0) {
                int saved = errno;
                (void)close(fd);
                errno = saved;
        }
        return -EBADF;
}
static inline void closep(int *fd) {
        safe_close(*fd);
}
#define _cleanup_close_ _cleanup_(closep)

/* Defines `funcp(type **)` for use with _cleanup_(funcp) from a `type *func(type *)` destructor. */
#define DEFINE_TRIVIAL_CLEANUP_FUNC(type, func)    \
        static inline void func##p(type **p) {      \
                if (*p)                             \
                        (void)func(*p);             \
        }

#define MIN(a, b) ((a) < (b) ? (a) : (b))
#define MAX(a, b) ((a) > (b) ? (a) : (b))
#define ALIGN_UP(x, a) ((((x) + (a) - 1) / (a)) * (a))
#define IS_POWER_OF_2(x) ((x) != 0 && ((x) & ((x) - 1)) == 0)
