#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Put a model trained in a broker-backed MemPool to sleep and wake it: the same logits, bit for bit.

    python3 tests/gpu/python/test_sleep_wake.py [STEPS]

A small transformer encoder with a classification head (torch.nn only, random
weights, torch.manual_seed(0)) is trained STEPS (default 20) AdamW steps with
everything allocated in vmmbroker.torch.use(pool), then evaluated on a fixed
batch. Then vmmbroker.torch.sleep() parks every segment of the pool: the
broker copies their content to host memory and its "leased" bytes for the
device fall to what is left; vmmbroker.torch.wake() unparks them at the same
addresses. Checked after the wake: every parameter and optimizer state keeps
its data pointer and its bytes (a checksum), the logits of the same batch are
bit-identical, and one more training step runs. Prints the times of sleep and
wake against the host<->device copy bandwidth measured in the same run, and a
table. Exit status 0 only when every check passed.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h  # noqa: E402


def checksums(tensors) -> list:
    import torch
    # The bytes of each tensor, summed as int64 words of its raw storage: any changed bit shows.
    out = []
    for t in tensors:
        b = t.detach().contiguous().view(torch.uint8).flatten()
        pad = (-b.numel()) % 8
        if pad:
            b = torch.cat([b, torch.zeros(pad, dtype=torch.uint8, device=b.device)])
        out.append(int(b.view(torch.int64).sum().item()))
    return out


def copy_bandwidth(nbytes: int) -> tuple[float, float]:
    """Host->device and device->host GB/s of one pinned copy of NBYTES (the ceiling for park and unpark)."""
    import torch
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    rates = []
    for src, dst in ((host, dev), (dev, host)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
    del host, dev
    return rates[0], rates[1]


def leased_bytes(client, device: int) -> int:
    """The broker's leased bytes on DEVICE (Status): parked leases are not counted there."""
    return sum(int(d["leased"]) for d in client.status() if d["index"] == device)


def main() -> int:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    h.setup_paths()
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:False"
    os.environ.pop("PYTORCH_ALLOC_CONF", None)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    with h.broker():
        import torch
        import vmmbroker
        import vmmbroker.torch as vt

        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.cuda.init()
        device = torch.cuda.current_device()
        client = vmmbroker.connect()
        failures = []

        pool = vt.pool()
        with vt.use(pool):
            torch.manual_seed(0)
            layer = torch.nn.TransformerEncoderLayer(d_model=512, nhead=8, dim_feedforward=2048, batch_first=True,
                                                     dropout=0.0)
            model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, num_layers=4),
                                        torch.nn.Flatten(), torch.nn.LazyLinear(10)).cuda()
            g = torch.Generator().manual_seed(1)
            x = torch.randn(32, 64, 512, generator=g).cuda()
            y = torch.randint(0, 10, (32,), generator=g).cuda()
            model(x)                                                # materializes the lazy layer
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            for _ in range(steps):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            model.eval()
            with torch.no_grad():
                before = model(x).clone()
            tensors = list(model.parameters()) + [v for s in opt.state.values() for v in s.values()
                                                  if torch.is_tensor(v) and v.is_cuda]
            ptrs = [t.data_ptr() for t in tensors]
            sums = checksums(tensors)
            torch.cuda.synchronize()

            pool_bytes = pool.reserved_bytes()
            leased_awake = leased_bytes(client, device)
            t0 = time.perf_counter()
            parked = vt.sleep()
            t_sleep = time.perf_counter() - t0
            leased_asleep = leased_bytes(client, device)
            t0 = time.perf_counter()
            woken = vt.wake()
            t_wake = time.perf_counter() - t0

            if parked <= 0 or woken != parked:
                failures.append(f"sleep parked {parked} segments, wake unparked {woken}")
            if leased_awake - leased_asleep < pool_bytes:
                failures.append(f"the broker's leased bytes fell by {leased_awake - leased_asleep}, "
                                f"less than the pool's {pool_bytes}")
            if [t.data_ptr() for t in tensors] != ptrs:
                failures.append("a tensor's data pointer changed")
            if checksums(tensors) != sums:
                failures.append("a parameter or optimizer state changed across sleep and wake")
            with torch.no_grad():
                after = model(x)
            identical = torch.equal(before.view(torch.int32), after.view(torch.int32))
            if not identical:
                failures.append(f"the logits differ (max |diff| {(before - after).abs().max().item():.3g})")
            model.train()
            loss = torch.nn.functional.cross_entropy(model(x), y)      # and it trains on
            loss.backward()
            opt.step()
            torch.cuda.synchronize()
            del model, opt, x, y, before, after, tensors, loss, layer
        vt.release()
        del pool
        vt.release()
        client.close()

        h2d, d2h = copy_bandwidth(pool_bytes or (256 << 20))
        gb = pool_bytes / 1e9
        h.table(f"sleep and wake of a broker-backed MemPool ({pool_bytes / (1 << 20):.0f} MiB in {parked} segments)",
                ["step", "seconds", "GB/s", "copy GB/s (same run)", "of copy"],
                [["sleep (park: device -> host)", f"{t_sleep:.4f}", f"{gb / t_sleep:.2f}", f"{d2h:.2f}",
                  f"{gb / t_sleep / d2h * 100:.0f}%"],
                 ["wake (unpark: host -> device)", f"{t_wake:.4f}", f"{gb / t_wake:.2f}", f"{h2d:.2f}",
                  f"{gb / t_wake / h2d * 100:.0f}%"]])
        print(f"logits bit-identical after sleep and wake: {'yes' if identical else 'NO'}")
        for f in failures:
            print(f"FAILED: {f}")
        return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
