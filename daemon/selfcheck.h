/* SPDX-License-Identifier: MIT */
#pragma once

#include <stdio.h>

#include "pool.h"

/*
 * `vmmbrokerd --check`: exercises the pool on every device it serves the way a
 * client would (lease, import the slab fds, map, write, read back, free, lease
 * again from the cache and check it reads zero) and prints a report to `out`.
 * Returns 0 when every device passed, 1 when one failed.
 */
int selfcheck_run(Pool *pool, CudaDriver *cu, FILE *out);
