#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Train a GPT-2-shaped model 20 AdamW steps twice, with PyTorch's allocator and through the broker; compare.

    python3 tests/gpu/python/train_gpt2.py [STEPS]

Each run is a process of its own (this script with --child torch|broker): a
GPT2LMHeadModel from GPT2Config(n_layer=6, n_embd=768, n_head=12), random
weights (torch.manual_seed(0)), batch 8 x 512 random tokens, AdamW. The broker
run allocates everything (the model, the optimizer's state, activations and
the backward pass's tensors, on every thread) in vmmbroker.torch.use(pool).
Both runs use deterministic algorithms, no TF32, and CUBLAS_WORKSPACE_CONFIG
:4096:8. The runs go torch, broker, torch, broker, then one process trains both
models with their steps alternating (--child paired), each with its own RNG
states: a step of one allocator beside a step of the other sees the same clocks
and neighbours, which separate processes on a shared VM do not. Prints both
loss sequences, the median step time of each (steps after the first 3) over
the separate processes, the paired process's median ratio of a broker step to
the torch step beside it, whether every run's losses are bit-identical (float32
bits compared), and a table last. Target: bit-identical; broker step time
within 2% of PyTorch's. Exit status 0 only when the losses are bit-identical.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h  # noqa: E402

WARMUP = 3


def child(mode: str, steps: int) -> None:
    import torch
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.cuda.init()
    dev = torch.device("cuda", torch.cuda.current_device())

    def build():
        torch.manual_seed(0)
        # Eager attention: deterministic forward and backward (flash attention's backward accumulates
        # with atomics); $VMMB_TEST_ATTN=sdpa measures PyTorch's fused kernels instead.
        config = GPT2Config(n_layer=6, n_embd=768, n_head=12,
                            attn_implementation=os.environ.get("VMMB_TEST_ATTN", "eager"))
        model = GPT2LMHeadModel(config).to(dev)
        model.train()
        g = torch.Generator().manual_seed(1)
        batch = torch.randint(0, config.vocab_size, (8, 512), generator=g).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        return model, batch, opt

    def step(model, batch, opt):
        """One training step, timed from a synchronized device to its loss on the host: (loss, seconds)."""
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        v = loss.detach().float().item()        # synchronizes
        return v, time.perf_counter() - t0

    def train(model, batch, opt):
        losses, times = [], []
        for _ in range(steps):
            v, t = step(model, batch, opt)
            times.append(t)
            losses.append(v)
        return losses, times

    pool_bytes = reserved = attn = None
    if mode == "paired":
        paired(build, step, steps)
        return
    if mode == "broker":
        import vmmbroker.torch as vt
        pool = vt.pool()
        with vt.use(pool):
            model, batch, opt = build()
            attn = getattr(model.config, "_attn_implementation", None)
            losses, times = train(model, batch, opt)
            torch.cuda.synchronize()
            pool_bytes = pool.reserved_bytes()
            reserved = torch.cuda.memory_reserved()
            del model, batch, opt
        vt.release()
        del pool
        vt.release()
    else:
        model, batch, opt = build()
        attn = getattr(model.config, "_attn_implementation", None)
        losses, times = train(model, batch, opt)
        reserved = torch.cuda.memory_reserved()
    bits = [struct.unpack("<I", struct.pack("<f", v))[0] for v in losses]
    print(json.dumps({"mode": mode, "losses": losses, "bits": bits, "times": times,
                      "pool_bytes": pool_bytes, "reserved": reserved, "attn": attn}))


def paired(build, step, steps: int) -> None:
    """Both models in one process, their steps alternating (torch first on even steps, the broker's on odd):
    each pair of steps sees the same clocks, heat and neighbours, which separate processes do not. Each model
    keeps its own RNG states, swapped in before its step, so its losses are those of a process of its own."""
    import torch
    import vmmbroker.torch as vt

    pool = vt.pool()
    runs = {}
    for mode in ("broker", "torch"):
        if mode == "broker":
            with vt.use(pool):
                parts = build()
        else:
            parts = build()
        runs[mode] = {"parts": parts, "rng": (torch.get_rng_state(), torch.cuda.get_rng_state()),
                      "losses": [], "times": []}
    for i in range(steps):
        for mode in (("torch", "broker") if i % 2 == 0 else ("broker", "torch")):
            r = runs[mode]
            model, batch, opt = r["parts"]
            torch.set_rng_state(r["rng"][0])
            torch.cuda.set_rng_state(r["rng"][1])
            with vt.use(pool) if mode == "broker" else contextlib.nullcontext():
                v, t = step(model, batch, opt)
            r["times"].append(t)
            r["losses"].append(v)
            r["rng"] = (torch.get_rng_state(), torch.cuda.get_rng_state())
    out = {m: {"losses": r["losses"], "times": r["times"],
               "bits": [struct.unpack("<I", struct.pack("<f", v))[0] for v in r["losses"]]}
           for m, r in runs.items()}
    del runs
    print(json.dumps({"mode": "paired", **out}))


def main() -> int:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    h.setup_paths()
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    os.environ.pop("PYTORCH_ALLOC_CONF", None)     # the same allocator settings for both runs
    me = os.path.abspath(__file__)
    with h.broker():
        # A B A B: the second pair evens out drift (clocks, heat) between the first two runs.
        runs = [(mode, h.last_json(h.run_self(me, ["--child", mode, str(steps)], env=env)))
                for mode in ("torch", "broker", "torch", "broker")]
        both = h.last_json(h.run_self(me, ["--child", "paired", str(steps)], env=env))
    a, b = runs[0][1], runs[1][1]
    identical = (all(r["bits"] == a["bits"] for _, r in runs) and
                 both["torch"]["bits"] == a["bits"] and both["broker"]["bits"] == a["bits"])
    times = {m: [t for mm, r in runs if mm == m for t in r["times"][WARMUP:]] for m in ("torch", "broker")}
    # the paired process: each broker step against the torch step next to it
    ratios = [y / x for x, y in zip(both["torch"]["times"][WARMUP:], both["broker"]["times"][WARMUP:])]
    pa = h.median(both["torch"]["times"][WARMUP:]) * 1e3
    pb = h.median(both["broker"]["times"][WARMUP:]) * 1e3
    pdiff = (h.median(ratios) - 1.0) * 100.0
    print(f"{'step':>4}  {'PyTorch allocator':>18}  {'broker pool':>18}  same bits")
    for i, (x, y) in enumerate(zip(a["losses"], b["losses"])):
        print(f"{i:>4}  {x:>18.9g}  {y:>18.9g}  {'yes' if a['bits'][i] == b['bits'][i] else 'NO'}")
    ta = h.median(times["torch"]) * 1e3
    tb = h.median(times["broker"]) * 1e3
    diff = (tb - ta) / ta * 100.0
    gib = 1 << 30
    h.table(f"GPT-2 (6 x 768, batch 8 x 512), {steps} AdamW steps, attention {a.get('attn')}",
            ["run", "first loss", "last loss", "median step ms", "reserved GiB", "in broker pool GiB"],
            [["PyTorch allocator", f"{a['losses'][0]:.5f}", f"{a['losses'][-1]:.5f}", f"{ta:.2f}",
              f"{a['reserved'] / gib:.2f}", "-"],
             ["vmmbroker.torch pool", f"{b['losses'][0]:.5f}", f"{b['losses'][-1]:.5f}", f"{tb:.2f}",
              f"{b['reserved'] / gib:.2f}",
              "-" if b["pool_bytes"] is None else f"{b['pool_bytes'] / gib:.2f}"],
             ["result, separate processes", "bit-identical" if identical else "DIFFERENT", "", f"{diff:+.2f}%"
              + (" (within 2%)" if abs(diff) <= 2.0 else " (OVER 2%)"), "", ""],
             ["paired, one process: PyTorch", f"{both['torch']['losses'][0]:.5f}",
              f"{both['torch']['losses'][-1]:.5f}", f"{pa:.2f}", "", ""],
             ["paired, one process: broker", f"{both['broker']['losses'][0]:.5f}",
              f"{both['broker']['losses'][-1]:.5f}", f"{pb:.2f}", "", ""],
             ["result, paired (median of step ratios)", "", "", f"{pdiff:+.2f}%"
              + (" (within 2%)" if abs(pdiff) <= 2.0 else " (OVER 2%)"), "", ""]])
    return 0 if identical else 1


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        h.setup_paths()
        child(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 20)
        sys.exit(0)
    sys.exit(main())
