/* SPDX-License-Identifier: MIT */
#pragma once

#include "macro.h"

/*
 * Sets *ret_message to a newly formatted sentence for a person, freeing what
 * it held. Does nothing when ret_message is NULL; leaves NULL if memory runs
 * out. Library code reports errors this way instead of logging.
 */
_printf_(2, 3) void set_message(char **ret_message, const char *fmt, ...);
