#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""JAX reading a lease through DLPack, without a copy.

    VMMBROKER_SOCKET=/path/to/socket python3 jax_dlpack.py

The lease is filled through CuPy (its __cuda_array_interface__), then
jax.dlpack.from_dlpack() takes a typed view of it: the JAX array's buffer is
the lease's own memory. Keep the lease until JAX no longer uses the array.
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # leave the GPU's memory to the broker

import cupy
import jax
import jax.numpy as jnp
import numpy as np

import vmmbroker

n = 1 << 20
client = vmmbroker.connect()
with client.alloc(n * 4, label="jax-example") as lease:
    c = cupy.asarray(lease.view("float32", (n,)))
    c[...] = cupy.arange(n, dtype=cupy.float32)
    cupy.cuda.runtime.deviceSynchronize()          # the writes are done before JAX reads

    x = jax.dlpack.from_dlpack(lease.view("float32", (n,)))
    print(f"lease at {lease.ptr:#x}, JAX array at {x.unsafe_buffer_pointer():#x}")
    assert x.unsafe_buffer_pointer() == lease.ptr, "JAX copied the lease"
    assert np.array_equal(np.asarray(x), np.arange(n, dtype=np.float32))
    print(f"sum of the first 1000: {float(jnp.sum(x[:1000]))} (expected {sum(range(1000))})")
    x.block_until_ready()
    del x, c
print("lease freed")
