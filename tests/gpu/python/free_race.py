#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Free a pool segment while a kernel still writes it: the process must not fault, other memory must be intact.

    python3 tests/gpu/python/free_race.py [ROUNDS]

Each round: a 2 GiB tensor is allocated in a vmmbroker.torch pool (one lease);
40 fills of it are queued on the current stream (tens of milliseconds of GPU
work; the host does not wait); then, with the fills still running, the tensor
is deleted and the pool with it, and vmmbroker.torch.release() gives the
segment back: PyTorch calls vmmb_torch_free() on it, which must not unmap the
memory before the queued fills are done. An event recorded after the fills
says whether the GPU was still busy when the free began (the race did
happen) and whether the free returned before the fills ended (a deferred
unmap) or waited for them. Afterwards a later kernel runs and the device is synchronized: any
CUDA error (an illegal address from an unmapped range) fails the round. A
canary tensor from PyTorch's own allocator, outside the pool, is checked
against its host copy; and new memory leased again reads as written.
A table comes last; exit status 0 when every round passed.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h  # noqa: E402

SEGMENT = 2 << 30
FILLS = 40


def one_round(torch, vt, canary, canary_host) -> dict:
    r = {"busy_at_free": None, "deferred": None, "free_ms": None, "error": "", "canary": False, "reuse": False}
    pool = vt.pool()
    with torch.cuda.use_mem_pool(pool):
        x = torch.empty(SEGMENT // 4, dtype=torch.float32, device="cuda")
    ptr = x.data_ptr()
    done = torch.cuda.Event()
    torch.cuda.synchronize()
    for i in range(FILLS):
        x.fill_(float(i + 1))
    done.record()
    r["busy_at_free"] = not done.query()
    t0 = time.perf_counter()
    del x
    del pool                        # the pool's segment: cached, then released by empty_cache
    vt.release()
    r["free_ms"] = (time.perf_counter() - t0) * 1e3
    r["deferred"] = not done.query()    # the free returned before the fills ended (it did not wait)
    r["ptr"] = hex(ptr)
    try:
        y = canary * 2                          # a later kernel
        torch.cuda.synchronize()
        r["canary"] = bool(torch.equal(canary.cpu(), canary_host)) and bool(
            torch.equal(y.cpu(), canary_host * 2))
        del y
        pool = vt.pool()                        # leasing again works, and the memory is usable
        with torch.cuda.use_mem_pool(pool):
            z = torch.full((SEGMENT // 4,), 7.0, device="cuda")
        r["reuse"] = bool(z.eq(7.0).all().item())
        del z, pool
        vt.release()
        torch.cuda.synchronize()
    except Exception as e:      # an illegal address surfaces here, as a RuntimeError
        r["error"] = str(e).splitlines()[0][:100]
    return r


def main() -> int:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    h.setup_paths()
    with h.broker():
        import torch
        import vmmbroker.torch as vt

        torch.cuda.init()
        g = torch.Generator().manual_seed(3)
        canary_host = torch.randint(-2**31, 2**31 - 1, (64 << 20,), generator=g, dtype=torch.int64).to(
            torch.int32)
        canary = canary_host.cuda()             # 256 MiB from PyTorch's own allocator
        torch.cuda.synchronize()
        results = []
        for _ in range(rounds):
            results.append(one_round(torch, vt, canary, canary_host))
            if results[-1]["error"]:
                break
        try:
            torch.cuda.synchronize()
            final = "ok"
        except Exception as e:
            final = str(e).splitlines()[0][:100]
        # Every pool is gone: wait for the pending frees, and count what the broker still has of ours.
        try:
            never_freed = vt.release_all()
            import vmmbroker
            left = [x for x in vmmbroker.connect().list() if x.get("label") == "torch"]
            print(f"release_all: {never_freed} segments PyTorch never freed; "
                  f"leases labelled torch left at the broker: {len(left)}")
            if left:
                final = f"{len(left)} torch leases left after release_all"
        except Exception as e:
            final = f"release_all: {e}"

    rows = []
    ok = final == "ok"
    for i, r in enumerate(results):
        passed = not r["error"] and r["canary"] and r["reuse"]
        ok = ok and passed
        rows.append([i, r["ptr"], "yes" if r["busy_at_free"] else "no",
                     "returned first" if r["deferred"] else "waited", f"{r['free_ms']:.2f}",
                     "intact" if r["canary"] else "CORRUPT", "ok" if r["reuse"] else "FAILED",
                     r["error"] or "none", "pass" if passed else "FAIL"])
    if not any(r["busy_at_free"] for r in results):
        print("note: the fills had ended before every free began: the race was not exercised")
    print(f"final synchronize: {final}")
    h.table(f"free while {FILLS} fills of a {SEGMENT >> 30} GiB pool segment are queued",
            ["round", "segment", "GPU busy at free", "free vs fills", "free ms", "canary", "lease again", "CUDA error", "result"],
            rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
