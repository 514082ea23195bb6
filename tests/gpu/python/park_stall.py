#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Another process's calls while a lease is parked for the first time: the broker must go on answering them.

    python3 tests/gpu/python/park_stall.py [GIB]

A parker process leases GIB GiB (default 8) on device 0 of a broker of its own
(HostCapacity= above GIB, MaxHostBytes=100%), writes a pattern all over it
with PyTorch (int64 words counting up from a salt), and parks it
(vmmbroker's Lease.park()). The first park of a broker finds no host slabs
cached: the broker pins new host memory (about 0.3 s per GiB) before it
copies. It then unparks the lease and checks the pattern, writes another salt
and parks it again: the host slabs made for the first park are cached now, so
this park is the copy alone (about 1 GiB per 20-40 ms over PCIe); it unparks
and checks again. Meanwhile an observer process calls Status back to back on
its own connection and times each call (CLOCK_MONOTONIC, which both
processes share). A broker that pinned in its loop would answer nobody for as
long as the pinning takes; one that pins off its loop holds others only for
the copy, as every park does. Per park: how long it took, the observer's
longest Status that overlapped it, and its median Status outside it.

A table comes last; exit status 0 when the observer's longest Status during the
first park is no longer than the copy (the second park, with a margin of a
quarter and 1 ms: not the pinning), both unparks gave the pattern back, and some
Status call overlapped the first park.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h  # noqa: E402

GiB = 1 << 30
SLAB = 2 << 20                  # the granularity: leases are whole slabs
CHUNK = 256 << 20               # the pattern is written and checked this many bytes at a time


def write_pattern(torch, t, salt: int) -> None:
    """int64 word i of T is salt + i; a chunk at a time, so that no second copy of the lease is needed."""
    step = CHUNK // 8
    for a in range(0, t.numel(), step):
        b = min(a + step, t.numel())
        t[a:b].copy_(torch.arange(salt + a, salt + b, dtype=torch.int64, device=t.device))
    torch.cuda.synchronize()


def pattern_back(torch, t, salt: int) -> bool:
    """Whether T holds write_pattern(T, SALT)'s words."""
    step = CHUNK // 8
    for a in range(0, t.numel(), step):
        b = min(a + step, t.numel())
        if not torch.equal(t[a:b], torch.arange(salt + a, salt + b, dtype=torch.int64, device=t.device)):
            return False
    return True


def host_cached(c) -> int:
    """Device 0's host slabs cached for the next park (Status), 0 from a broker that does not say."""
    return sum(int(d.get("host_cached") or 0) for d in c.status() if d["index"] == 0)


def main() -> int:
    size = int(float(sys.argv[1]) * GiB) if len(sys.argv) > 1 else 8 * GiB
    size = max(SLAB, size // SLAB * SLAB)
    host_gib = -(-size // GiB) + 1
    config = f"[Broker]\nHostCapacity={host_gib}G\n[Limits]\nMaxHostBytes=100%\n"
    with h.broker(config=config) as path:
        import torch
        import vmmbroker
        import vmmbroker.torch as vt

        torch.cuda.init()
        ctx = multiprocessing.get_context("spawn")
        mine, theirs = ctx.Pipe()
        child = ctx.Process(target=h.status_observer, args=(path, theirs), daemon=True)   # not waited for after a failure
        child.start()
        clock = time.perf_counter_ns
        rows, parks, longest, seen, back, cached = [], [], [], [], [], []
        try:
            with vmmbroker.connect(path) as c:
                lease = c.alloc(size, device=0, label="park-stall")
                t = vt.tensor(lease, torch.int64)
                for r, what in enumerate(("first park (host slabs made)", "second park (host slabs cached)")):
                    salt = (r + 1) << 40
                    write_pattern(torch, t, salt)
                    cached.append(host_cached(c))
                    mine.send("go")
                    assert mine.recv() == "ready"
                    t0 = clock()
                    parked = lease.park()
                    t1 = clock()
                    mine.send("stop")
                    calls = mine.recv()
                    lease.unpark()
                    back.append(parked and pattern_back(torch, t, salt))
                    over = [b - a for a, b in calls if b > t0 and a < t1]
                    alone = [b - a for a, b in calls if b <= t0 or a >= t1]
                    park_ms = (t1 - t0) / 1e6
                    long_ms = max(over) / 1e6 if over else 0.0
                    parks.append(park_ms)
                    longest.append(long_ms)
                    seen.append(len(over))
                    rows.append([what, f"{cached[-1] / GiB:g}", f"{park_ms:.1f}", len(over), f"{long_ms:.3f}",
                                 f"{statistics.median(alone) / 1e3:.1f}" if alone else "-",
                                 "yes" if back[-1] else "NO"])
                del t
                lease.free()
        finally:
            mine.send("done")
            child.join(30)
    copy_ms = parks[1]
    pin_ms = parks[0] - parks[1]
    bound_ms = copy_ms * 1.25 + 1.0
    h.table(f"a {size / GiB:g} GiB lease parked twice while another process calls Status (ms, us)",
            ["park", "host cached before GiB", "park ms", "Status calls during it", "longest of them ms",
             "median Status alone us", "content back"], rows)
    ok = all(back) and seen[0] > 0 and cached[0] == 0 and longest[0] <= bound_ms
    print(f"pinning {pin_ms:.1f} ms (first park - second), copy {copy_ms:.1f} ms (second park); "
          f"longest Status during the first park {longest[0]:.3f} ms: {'PASS' if ok else 'FAIL'} "
          f"(target: longest Status during a first park <= the copy's time, {bound_ms:.1f} ms with the margin, "
          f"not the pinning's"
          f"{'' if all(back) else '; content NOT back'}"
          f"{'' if cached[0] == 0 else '; host slabs were cached before the first park: nothing to pin'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
