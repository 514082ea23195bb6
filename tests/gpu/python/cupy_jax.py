#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""CuPy allocating from the broker, and JAX taking a lease through DLPack without a copy.

    python3 tests/gpu/python/cupy_jax.py

CuPy: with vmmbroker.cupy.install() (CuPy's MemoryPool over broker leases),
arrays of several sizes are allocated, filled and checked against NumPy, freed,
and the pool's blocks given back. Then alloc/free of one array in a loop is
timed three ways: CuPy's default pool (cudaMalloc underneath), CuPy's pool over
leases (what install() sets), and a lease per allocation (the bare allocator):
the measurement behind vmmbroker.cupy's design.

JAX: a lease is filled through CuPy (its __cuda_array_interface__ view), then
jax.dlpack.from_dlpack(lease.view(...)) must give an array at the lease's own
address (no copy) with the same values, at offset 0 and inside the lease.

A table comes last; exit status 0 when every check passed.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h  # noqa: E402

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")     # JAX must not take the GPU's memory


def cupy_checks(cupy, np, vc, client) -> list:
    rows = []
    pool = vc.install(client)
    try:
        sizes = [0, 1000, 100_000, 3 << 20, 256 << 20]
        arrays = []
        for n in sizes:
            a = cupy.arange(n // 4, dtype=cupy.int32) * 3 + 1
            arrays.append(a)
        cupy.cuda.runtime.deviceSynchronize()
        for n, a in zip(sizes, arrays):
            want = np.arange(n // 4, dtype=np.int32) * 3 + 1
            ok = bool(np.array_equal(cupy.asnumpy(a), want))
            rows.append([f"cupy pool: int32 x {n // 4}", "ok" if ok else "WRONG", hex(a.data.ptr) if n else "-"])
        used = pool.used_bytes()
        del arrays, a
        cupy.cuda.runtime.deviceSynchronize()
        pool.free_all_blocks()
        rows.append(["cupy pool: blocks given back", "ok" if pool.total_bytes() == 0 else
                     f"{pool.total_bytes()} bytes kept", f"{used >> 20} MiB were in use"])
    finally:
        vc.uninstall()
    b = cupy.ones(10, dtype=cupy.float32)       # CuPy's default pool again
    rows.append(["cupy default pool after uninstall", "ok" if float(b.sum()) == 10.0 else "WRONG", ""])
    return rows


def cupy_timing(cupy, vc, client, nbytes: int, iters: int = 200) -> list:
    def loop(label, setup, teardown):
        setup()
        try:
            a = cupy.empty(nbytes, dtype=cupy.uint8)    # the first allocation fills the cache, and the
            a[:1] = 1                                   # first write loads its kernel: neither is timed
            del a
            cupy.cuda.runtime.deviceSynchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                a = cupy.empty(nbytes, dtype=cupy.uint8)
                a[:1] = 1
                del a
            cupy.cuda.runtime.deviceSynchronize()
            us = (time.perf_counter() - t0) / iters * 1e6
        finally:
            teardown()
        return [f"alloc+free {nbytes >> 20} MiB: {label}", f"{us:.1f} us", f"{iters} iterations"]

    rows = []
    default = cupy.get_default_memory_pool()
    rows.append(loop("CuPy default pool", lambda: cupy.cuda.set_allocator(default.malloc), default.free_all_blocks))
    state = {}
    rows.append(loop("CuPy pool over leases", lambda: state.update(p=vc.install(client)), vc.uninstall))
    rows.append(loop("lease per allocation", lambda: state.update(p=vc.install(client, pool=False)), vc.uninstall))
    return rows


def jax_checks(cupy, np, client) -> list:
    import jax
    import jax.numpy as jnp

    rows = []
    n = 16 << 20                        # 64 MiB of float32
    lease = client.alloc(n * 4, label="jax-dlpack")
    try:
        c = cupy.asarray(lease.view("float32", (n,)))        # CuPy writes through the lease's array interface
        c[...] = cupy.arange(n, dtype=cupy.float32)
        cupy.cuda.runtime.deviceSynchronize()
        want = np.arange(n, dtype=np.float32)
        for offset, count in ((0, n), (4096, 1 << 20)):
            x = jax.dlpack.from_dlpack(lease.view("float32", (count,), offset))
            x.block_until_ready()
            try:
                addr = x.unsafe_buffer_pointer()
            except Exception:
                addr = None
            zero_copy = addr == int(lease.ptr) + offset
            first = offset // 4
            same = bool(np.array_equal(np.asarray(x), want[first:first + count]))
            total = float(jnp.sum(x[:1024]))
            same = same and total == float(want[first:first + 1024].sum())
            rows.append([f"jax from_dlpack, offset {offset}, {count} floats",
                         "ok" if same and zero_copy else ("WRONG" if not same else "COPIED"),
                         f"at {hex(addr) if addr else '?'}, lease {hex(int(lease.ptr))}; {jax.devices()[0]}"])
            del x
        del c
        cupy.cuda.runtime.deviceSynchronize()
    finally:
        lease.free()
    return rows


def main() -> int:
    h.setup_paths()
    rows = []
    with h.broker():
        import numpy as np
        import cupy

        import vmmbroker
        import vmmbroker.cupy as vc

        client = vmmbroker.connect()
        rows += cupy_checks(cupy, np, vc, client)
        rows += jax_checks(cupy, np, client)
        for nbytes in (4 << 20, 64 << 20):
            rows += cupy_timing(cupy, vc, client, nbytes)
    ok = all(r[1] == "ok" or r[1].endswith(" us") for r in rows)
    h.table("CuPy through the broker, JAX through DLPack", ["check", "result", "detail"], rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
