#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""CuPy allocating from the broker: CuPy's memory pool on top of broker leases.

    VMMBROKER_SOCKET=/path/to/socket python3 cupy_allocator.py
"""

import cupy
import numpy as np

import vmmbroker.cupy as vc

pool = vc.install()                 # cupy.cuda.set_allocator(pool.malloc), pool over leases
a = cupy.arange(10_000_000, dtype=cupy.float32)
b = cupy.sqrt(a) * 2
assert np.allclose(cupy.asnumpy(b[:5]), np.sqrt(np.arange(5, dtype=np.float32)) * 2)
print(f"in use {pool.used_bytes() >> 20} MiB, cached {pool.total_bytes() >> 20} MiB, all leased")

del a, b
pool.free_all_blocks()              # the leases go back to the broker
vc.uninstall()                      # CuPy's default pool again
print("leases returned")
