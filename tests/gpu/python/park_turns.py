#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""A small park while another process's large first park pins its host memory: it must not wait for all of it.

    python3 tests/gpu/python/park_turns.py [GIB] [ROUNDS]

Each round starts a broker of its own (HostCapacity= above GIB + 1, MaxHostBytes=100%, HostSlab= its default
64M), so that no host memory is cached: every park pins new host memory, about 0.3 s per GiB, in pieces of
HostSlab=, which the broker's maker thread makes off its loop. Process A leases GIB GiB (default 8) and parks
it; 0.2 s into that park, process B leases 100 MiB (a piece of 64 MiB and one of 36 MiB, a size A's park
does not make) on its own connection and parks it. The maker
takes one piece of each waiting park in turn, and a park goes on as soon as its own pieces are made, so B's
park takes about four pieces' pinning and a 100 MiB copy; a broker that made A's pieces first, or let B's park
go on only once nothing was left to make, holds B for the rest of A's pinning. Both leases are unparked and
freed after each round. Times are CLOCK_MONOTONIC around each call; A's and B's clocks are the same clock.

A table comes last; exit status 0 when, in every round, B's park took at most a tenth of A's.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h  # noqa: E402

GiB = 1 << 30
SMALL = 100 << 20               # a piece of HostSlab= and one of 36 MiB, a size the large park does not make


def small_parker(socket_path: str, pipe) -> None:
    """B: leases SMALL, says ready, parks when told, sends (start, end) in ns, unparks and frees."""
    import vmmbroker
    with vmmbroker.connect(socket_path) as c:
        lease = c.alloc(SMALL, device=0)
        pipe.send("ready")
        pipe.recv()
        t0 = time.monotonic_ns()
        lease.park()
        t1 = time.monotonic_ns()
        lease.unpark()
        lease.free()
    pipe.send((t0, t1))


def one_round(gib: int) -> dict:
    """A's and B's park times (ms) on a broker of its own, and where B's fell in A's."""
    with h.broker(config=h.park_config(gib)) as path:
        import vmmbroker
        mine, child = h.start_child(small_parker, path)
        with vmmbroker.connect(path) as c:
            lease = c.alloc(gib * GiB, device=0)
            t0, t1, b0, b1 = h.park_while_other_parks(lease, mine, 0.2)
            child.join(60)
            lease.unpark()
            lease.free()
    return {"a_ms": (t1 - t0) / 1e6, "b_ms": (b1 - b0) / 1e6, "b_start_ms": (b0 - t0) / 1e6,
            "b_end_ms": (b1 - t0) / 1e6}


def main() -> int:
    gib = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    h.setup_paths()
    rows, ok = [], True
    for i in range(rounds):
        r = one_round(gib)
        good = r["b_ms"] <= r["a_ms"] / 10
        ok = ok and good
        print(f"round {i + 1}: A's park of {gib} GiB {r['a_ms']:.1f} ms; B's park of 100 MiB from {r['b_start_ms']:.1f} "
              f"to {r['b_end_ms']:.1f} ms into it: {r['b_ms']:.1f} ms: {'PASS' if good else 'FAIL'}", flush=True)
        rows.append([str(i + 1), f"{r['a_ms']:.1f}", f"{r['b_ms']:.1f}", f"{r['b_start_ms']:.1f}",
                     "PASS" if good else "FAIL"])
    h.table(f"a 100 MiB first park 0.2 s into another process's first park of {gib} GiB (target: B <= a tenth of A)",
            ["round", "A's park ms", "B's park ms", "B started at ms", "verdict"], rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
