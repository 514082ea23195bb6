/* SPDX-License-Identifier: MIT */
#pragma once

#include "macro.h"

/*
 * Sets *ret_message to a newly formatted sentence for a person, freeing what
 * it held. Does nothing when ret_message is NULL; leaves NULL if memory runs
 * out. Library code reports errors this way instead of logging.
 */
_printf_(2, 3) void set_message(char **ret_message, const char *fmt, ...);

/* set_message(), then returns `error` (a negative errno), so that a check says what is wrong in one statement. */
_printf_(3, 4) int set_message_error(char **ret_message, int error, const char *fmt, ...);
