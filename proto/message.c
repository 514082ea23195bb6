/* SPDX-License-Identifier: MIT */

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "message.h"

void set_message(char **ret_message, const char *fmt, ...) {
        va_list ap;
        char *m;

        if (!ret_message)
                return;
        va_start(ap, fmt);
        if (vasprintf(&m, fmt, ap) < 0)
                m = NULL;
        va_end(ap);
        free(*ret_message);
        *ret_message = m;
}
