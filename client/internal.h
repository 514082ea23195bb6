/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * What the library's other files (torch.c) share with vmmbroker.c. Not
 * installed and not exported: -fvisibility=hidden and the version script keep
 * these inside libvmmbroker.
 */

#include "driver.h"
#include "macro.h"

/* Sets the calling thread's vmmb_error_message() and returns `error`, a negative errno. */
_printf_(2, 3) int client_set_error(int error, const char *fmt, ...);

/* The process's CUDA driver, loaded on first use; 0, or -ENODEV with the message set. */
int client_driver(CudaDriver **ret);
