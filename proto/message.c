/* SPDX-License-Identifier: MIT */

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "message.h"

_printf_(2, 0) static void set_message_va(char **ret_message, const char *fmt, va_list ap) {
        char *m;

        if (!ret_message)
                return;
        if (vasprintf(&m, fmt, ap) < 0)
                m = NULL;
        free(*ret_message);
        *ret_message = m;
}

void set_message(char **ret_message, const char *fmt, ...) {
        va_list ap;

        va_start(ap, fmt);
        set_message_va(ret_message, fmt, ap);
        va_end(ap);
}

int set_message_error(char **ret_message, int error, const char *fmt, ...) {
        va_list ap;

        va_start(ap, fmt);
        set_message_va(ret_message, fmt, ap);
        va_end(ap);
        return error;
}
