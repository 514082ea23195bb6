#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""A small park while another process's large park is being copied: it must not wait for the whole copy.

    python3 tests/gpu/python/copy_turns.py [GIB] [ROUNDS]

The device runs the copies queued on it in the order they were queued, those of all its streams: on an H200 a
100 MiB park queued 20 ms into another process's 8 GiB park took 139 ms, against 3.5 ms alone. The broker
queues each park's and unpark's copy in pieces of 64 MiB, a few on the device at once, the next piece the next
user's in turn (docs/pool.md, "Copies in turn").

Each round runs twice: B as A's user, whose copies take turns with A's own, and B as another user (uid 65534,
when run as root), who goes before the user whose piece went last. Each run starts a broker of its own
(HostCapacity= above GIB + 1, MaxHostBytes=100%) and leaves host memory cached for both parks at once (A parks,
B parks and unparks, A unparks; then the broker's Status is polled until it is all zeroed and cached), so that
the timed parks are copies only, nothing pinned. Then process B parks its 100 MiB lease alone (timed, then
unparked); then process A parks a lease of GIB GiB (default 8) and, 20 ms into that park, B parks its lease
again on its own connection. Times are CLOCK_MONOTONIC around each call;
A's and B's clocks are the same clock.

A table comes last; exit status 0 when, in every run, B's park during A's took at most a tenth of A's.
"""

from __future__ import annotations

import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h  # noqa: E402

GiB = 1 << 30
SMALL = 100 << 20
START_S = 0.02                  # B's park starts this long into A's
OTHER_UID = 65534               # B's user when it is another (nobody)


def small_parker(socket_path: str, pipe) -> None:
    """B: leases SMALL, says ready; on "cycle" parks and unparks it once (pinning its host memory) and says so;
    then on each "alone" or "park" parks, sends (start, end) in ns, and unparks; "done" frees."""
    import vmmbroker
    with vmmbroker.connect(socket_path) as c:
        lease = c.alloc(SMALL, device=0)
        pipe.send("ready")
        assert pipe.recv() == "cycle"
        lease.park()
        lease.unpark()
        pipe.send("cycled")
        while (what := pipe.recv()) != "done":
            t0 = time.monotonic_ns()
            lease.park()
            t1 = time.monotonic_ns()
            lease.unpark()
            pipe.send((t0, t1))
        lease.free()


def small_parker_as(uid: int, socket_path: str, pipe) -> None:
    """small_parker() as user UID: the broker sees that uid on B's connection, made after the switch. What it
    imports and loads is loaded first, as root: Python's own files may be where UID cannot read."""
    import traceback  # noqa: F401  (multiprocessing reports a failure with it)
    import vmmbroker
    vmmbroker._lib.lib()
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    small_parker(socket_path, pipe)


def _wait_cached(client, nbytes: int, timeout_s: float = 30.0) -> None:
    """Polls Status until at least NBYTES of host memory are zeroed and cached on device 0."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if int(client.status()[0].get("host_cached") or 0) >= nbytes:
            return
        time.sleep(0.01)        # a GPU benchmark's set-up, not a test's synchronisation
    raise SystemExit(f"host memory of {nbytes} bytes was not cached within {timeout_s} s")


def one_round(gib: int, other_uid) -> dict:
    """B alone, A's park and B's park during it (ms), on a broker of its own; B as OTHER_UID when not None."""
    with h.broker(config=h.park_config(gib)) as path:
        import vmmbroker
        if other_uid is None:
            target = small_parker
        else:
            # The broker's socket is in a private directory; B needs to reach it (as tests/gpu/canary.sh does).
            os.chmod(os.path.dirname(path), 0o711)
            os.chmod(path, 0o666)
            target = functools.partial(small_parker_as, other_uid)
        mine, child = h.start_child(target, path)
        with vmmbroker.connect(path) as c:
            lease = c.alloc(gib * GiB, device=0)
            # Host memory for both parks at once: B's pinned while A's is in use, so that B does not take A's.
            lease.park()
            mine.send("cycle")
            assert mine.recv() == "cycled"
            lease.unpark()
            _wait_cached(c, gib * GiB + SMALL)
            mine.send("alone")
            b0, b1 = mine.recv()
            alone_ms = (b1 - b0) / 1e6
            _wait_cached(c, gib * GiB + SMALL)
            t0, t1, b0, b1 = h.park_while_other_parks(lease, mine, START_S)
            mine.send("done")
            child.join(60)
            lease.unpark()
            lease.free()
    return {"alone_ms": alone_ms, "a_ms": (t1 - t0) / 1e6, "b_ms": (b1 - b0) / 1e6,
            "b_start_ms": (b0 - t0) / 1e6, "b_end_ms": (b1 - t0) / 1e6}


def main() -> int:
    gib = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    h.setup_paths()
    users = [None] + ([OTHER_UID] if os.geteuid() == 0 else [])
    if len(users) == 1:
        print(f"not root: B runs as A's user only (another user's B needs root to switch to uid {OTHER_UID})")
    rows, ok = [], True
    for i in range(rounds):
        for uid in users:
            who = "A's" if uid is None else f"uid {uid}"
            r = one_round(gib, uid)
            good = r["b_ms"] <= r["a_ms"] / 10
            ok = ok and good
            print(f"round {i + 1}, B {who}: B alone {r['alone_ms']:.1f} ms; A's park of {gib} GiB {r['a_ms']:.1f} "
                  f"ms; B from {r['b_start_ms']:.1f} to {r['b_end_ms']:.1f} ms into it: {r['b_ms']:.1f} ms: "
                  f"{'PASS' if good else 'FAIL'}", flush=True)
            rows.append([str(i + 1), who, f"{r['alone_ms']:.1f}", f"{r['a_ms']:.1f}", f"{r['b_ms']:.1f}",
                         f"{r['b_start_ms']:.1f}", "PASS" if good else "FAIL"])
    h.table(f"a 100 MiB park {START_S * 1e3:.0f} ms into another process's park of {gib} GiB, host memory cached "
            f"(copies only; target: B <= a tenth of A)",
            ["round", "B's user", "B alone ms", "A's park ms", "B's park ms", "B started at ms", "verdict"], rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
