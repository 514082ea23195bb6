#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Another process's calls while a large kept lease is asked back: the broker must go on answering them.

    python3 tests/gpu/python/kept_stall.py [ROUNDS] [GIB]

A keeper process leases GIB GiB (default 16, or a quarter of device 0's
capacity on a smaller device), and in each round frees it with
keep=True (the broker queues its zeroing in place on the device, about 0.3 ms
per GiB) and at once asks for the size again: the broker hands the same lease
back once the zeroing is done. Meanwhile an observer process calls Status back
to back on its own connection and times each call (CLOCK_MONOTONIC, which both
processes share). A broker that waited for the zeroing in its loop would
answer nobody for as long as the keeper waits; one that parks the keeper's
call answers the observer as usual. Per round: the keeper's wait (the
free and the alloc that gets the lease back) and the observer's longest Status that overlapped it.

A table comes last; exit status 0 when the median over the rounds of the
observer's longest Status is less than half the median of the keeper's wait,
every alloc got its kept lease back, and some Status call overlapped a wait.
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


def main() -> int:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    size = int(float(sys.argv[2]) * GiB) if len(sys.argv) > 2 else None
    with h.broker() as path:
        import vmmbroker

        if size is None:
            with vmmbroker.connect(path) as c:
                capacity = c.status()[0]["capacity"]
            size = min(16 * GiB, capacity // 4 // (2 << 20) * (2 << 20))

        ctx = multiprocessing.get_context("spawn")
        mine, theirs = ctx.Pipe()
        child = ctx.Process(target=h.status_observer, args=(path, theirs))
        child.start()
        clock = time.perf_counter_ns
        rows, waits, longest, same, seen = [], [], [], True, 0
        try:
            with vmmbroker.connect(path) as c:
                lease = c.alloc(size, label="kept-stall")
                for r in range(rounds + 1):         # round 0 is a warm-up, not counted
                    mine.send("go")
                    assert mine.recv() == "ready"
                    first = lease.id
                    t0 = clock()
                    lease.free(keep=True)
                    lease = c.alloc(size, label="kept-stall")
                    t1 = clock()
                    mine.send("stop")
                    calls = mine.recv()
                    over = [b - a for a, b in calls if b > t0 and a < t1]
                    alone = [b - a for a, b in calls if b <= t0 or a >= t1]
                    if r == 0:
                        continue
                    same = same and lease.id == first
                    wait_ms = (t1 - t0) / 1e6
                    long_ms = max(over) / 1e6 if over else 0.0
                    seen += len(over)
                    waits.append(wait_ms)
                    longest.append(long_ms)
                    rows.append([r, f"{wait_ms:.3f}", len(over), f"{long_ms:.3f}",
                                 f"{statistics.median(alone) / 1e3:.1f}" if alone else "-",
                                 "yes" if lease.id == first else "NO"])
                lease.free()
        finally:
            mine.send("done")
            child.join(30)
    h.table(f"a {size / GiB:g} GiB kept lease asked back while another process calls Status (ms, us)",
            ["round", "keeper's wait ms", "Status calls during it", "longest of them ms",
             "median Status alone us", "same lease back"], rows)
    mw, ml = statistics.median(waits), statistics.median(longest)
    ok = same and seen > 0 and ml < mw / 2
    print(f"median keeper's wait {mw:.3f} ms, median longest Status during it {ml:.3f} ms: "
          f"{'PASS' if ok else 'FAIL'} (longest < half the wait{', same lease back' if same else ', a lease NOT handed back'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
