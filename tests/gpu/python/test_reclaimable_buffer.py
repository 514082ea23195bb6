# SPDX-License-Identifier: MIT
"""A KV-cache-like vmmbroker.torch.ReclaimableBuffer given back when another process waits for room.

    python3 tests/gpu/python/test_reclaimable_buffer.py

A private broker with a pool of 1 GiB (and no user limit below it). This
process fills a ReclaimableBuffer of 640 MiB (priority 5) whose on_reclaim
drops the "cache" and gives it back. A second process then asks for 640 MiB
with wait=30 s: the device has no room, so the broker asks this process,
on_reclaim runs, the library synchronizes, unmaps and frees, and the second
process is served. Checked: the callback ran once, for the buffer's lease;
the waiter got its lease, which reads zero (not the buffer's bytes); the
buffer says reclaimed and its tensor raises vmmbroker.Error (ESTALE); a
buffer whose on_reclaim returns False keeps its memory (the waiter fails
with OutOfMemory at its deadline). Exit status 0 only when every check
passed.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h  # noqa: E402

MiB = 1 << 20
CONFIG = "[Broker]\nCapacity=1G\n[Limits]\nMaxBytes=4G\n"


def waiter(size: int, wait: float) -> None:
    """The second process: alloc with wait; prints what happened and whether the memory reads zero."""
    import torch
    import vmmbroker
    c = vmmbroker.connect()
    t0 = time.perf_counter()
    try:
        lease = c.alloc(size, device=0, wait=wait)
    except vmmbroker.Error as e:
        print(json.dumps({"served": False, "errno": e.errno, "seconds": time.perf_counter() - t0}))
        return
    seconds = time.perf_counter() - t0
    t = torch.as_tensor(lease, device="cuda").view(torch.uint8)
    zero = bool((t == 0).all().item())
    del t
    torch.cuda.synchronize()
    lease.free()
    print(json.dumps({"served": True, "zero": zero, "seconds": seconds}))


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--waiter":
        h.setup_paths()
        waiter(int(sys.argv[2]), float(sys.argv[3]))
        return 0
    failures = []
    with h.broker(config=CONFIG):
        import torch
        import vmmbroker
        import vmmbroker.torch as vt

        torch.cuda.init()
        asked = []

        def drop(buf):
            asked.append(buf.lease.id)
            return True

        kv = vt.ReclaimableBuffer((640 * MiB,), torch.uint8, priority=5, on_reclaim=drop)
        kv_id = kv.lease.id
        kv.tensor.fill_(7)
        torch.cuda.synchronize()
        out = h.last_json(h.run_self(__file__, ["--waiter", str(640 * MiB), "30"]))
        if not out["served"]:
            failures.append(f"the waiter was not served: errno {out.get('errno')}")
        elif not out["zero"]:
            failures.append("the waiter's memory does not read zero")
        if asked != [kv_id]:
            failures.append(f"on_reclaim ran for {asked}, not once for {kv_id}")
        if not kv.reclaimed:
            failures.append("the buffer does not say reclaimed")
        try:
            kv.tensor
            failures.append("the tensor of a reclaimed buffer is still given")
        except vmmbroker.Error as e:
            if e.errno != errno.ESTALE:
                failures.append(f"the tensor of a reclaimed buffer raised errno {e.errno}, not ESTALE")
        print(f"given back: waiter served in {out.get('seconds', 0) * 1e3:.1f} ms, on_reclaim asked for "
              f"{len(asked)} lease(s)")

        # A refusal: the memory stays, the waiter fails at its deadline.
        refused = []

        def keep(buf):
            refused.append(buf.lease.id)
            return False

        kv2 = vt.ReclaimableBuffer((640 * MiB,), torch.uint8, priority=5, on_reclaim=keep)
        out = h.last_json(h.run_self(__file__, ["--waiter", str(640 * MiB), "2"]))
        if out["served"] or out.get("errno") != errno.ENOMEM:
            failures.append(f"a refused reclaim still served the waiter, or it failed otherwise: {out}")
        if refused != [kv2.lease.id] or kv2.reclaimed:
            failures.append(f"the refusing buffer: asked {refused}, reclaimed {kv2.reclaimed}")
        kv2.tensor.fill_(1)                      # still ours
        torch.cuda.synchronize()
        kv2.free()
        print(f"refused: the waiter failed with OutOfMemory after {out.get('seconds', 0):.1f} s, the buffer kept")
    for f in failures:
        print("FAILED:", f)
    print("every check passed" if not failures else f"{len(failures)} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
