#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Record the segments PyTorch's caching allocator asks the driver for while training GPT-2; write bench-trace's trace.

    python3 tests/gpu/python/record_segments.py [OUTPUT] [STEPS]

OUTPUT defaults to tests/bench/traces/gpt2-train-segments.txt, STEPS to 20.
The run is train_gpt2.py's PyTorch-allocator run, alone in this process and
with no broker: a GPT2LMHeadModel from GPT2Config(n_layer=6, n_embd=768,
n_head=12), random weights (torch.manual_seed(0)), batch 8 x 512 random tokens
(generator seed 1), AdamW (lr 3e-4), eager attention ($VMMB_TEST_ATTN=sdpa
for PyTorch's fused kernels), deterministic algorithms, no TF32,
CUBLAS_WORKSPACE_CONFIG=:4096:8 and PYTORCH_CUDA_ALLOC_CONF=
expandable_segments:False (the settings train_gpt2.py runs both its runs
with; this script sets them itself before it imports torch).

Memory history is recorded (torch.cuda.memory._record_memory_history, no
stack traces) from before the first CUDA allocation to the end of the last
step; the trace is the snapshot's 'device_traces' for the current device, of
which only 'segment_alloc' (the allocator's cudaMalloc of a segment, 'size'
bytes at 'addr') and 'segment_free' (its cudaFree, by 'addr') are kept, in
order. The output is bench-trace's format: a # header saying how it was
recorded, then one line per event: "+SIZE" allocates the next segment
(numbered 0, 1, ... in the order of these lines), "-N" frees segment N.

It refuses to write a trace that would not be the run's: when the history's
ring buffer filled (earlier events lost), when a segment was allocated before
recording began, when the allocator hit out-of-memory ('oom'), or when it
mapped expandable segments ('segment_map') instead of allocating segments.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
DEFAULT_OUTPUT = os.path.join(REPO, "tests", "bench", "traces", "gpt2-train-segments.txt")
MAX_ENTRIES = 4_000_000             # history ring buffer; a 20-step run makes far fewer events
ALLOC_CONF = "expandable_segments:False"


def driver_version() -> str:
    """The NVIDIA kernel module's version, or 'unknown'."""
    try:
        with open("/proc/driver/nvidia/version") as f:
            line = f.readline()
        # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Thu ..."
        for word in line.split():
            if word[:1].isdigit() and "." in word:
                return word
    except OSError:
        pass
    return "unknown"


def train(torch, steps: int) -> str:
    """Builds and trains the model exactly as train_gpt2.py's child does; returns the attention it used."""
    from transformers import GPT2Config, GPT2LMHeadModel

    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    config = GPT2Config(n_layer=6, n_embd=768, n_head=12,
                        attn_implementation=os.environ.get("VMMB_TEST_ATTN", "eager"))
    model = GPT2LMHeadModel(config).to(dev)
    model.train()
    g = torch.Generator().manual_seed(1)
    batch = torch.randint(0, config.vocab_size, (8, 512), generator=g).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for _ in range(steps):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.detach().float().item()        # synchronizes, as train_gpt2.py's step does
    torch.cuda.synchronize()
    return str(getattr(model.config, "_attn_implementation", None))


def segment_events(snapshot: dict, device: int) -> list:
    """The trace's segment events as ('+', size) and ('-', index); raises SystemExit when they are not the run's."""
    traces = snapshot.get("device_traces")
    if not traces or device >= len(traces):
        sys.exit(f"record_segments: the snapshot has no trace for device {device}")
    trace = traces[device]
    if len(trace) >= MAX_ENTRIES:
        sys.exit(f"record_segments: the history holds {len(trace)} entries, its limit: earlier events were lost; "
                 "raise MAX_ENTRIES")
    actions = {e["action"] for e in trace}
    if "oom" in actions:
        sys.exit("record_segments: the allocator ran out of memory during the run; its segments are not a "
                 "normal run's")
    if actions & {"segment_map", "segment_unmap"}:
        sys.exit("record_segments: the allocator mapped expandable segments (segment_map); "
                 f"PYTORCH_CUDA_ALLOC_CONF must be {ALLOC_CONF}")
    events, live = [], {}               # live: address -> segment index
    n = 0
    for e in trace:
        if e["action"] == "segment_alloc":
            if e["addr"] in live:
                sys.exit(f"record_segments: segment at {e['addr']:#x} allocated twice without a free")
            live[e["addr"]] = n
            events.append(("+", int(e["size"])))
            n += 1
        elif e["action"] == "segment_free":
            if e["addr"] not in live:
                sys.exit(f"record_segments: segment at {e['addr']:#x} freed but its allocation is not in the "
                         "trace (allocated before recording began)")
            events.append(("-", live.pop(e["addr"])))
    # Every segment the allocator holds at the end must be one the trace allocated.
    for seg in snapshot.get("segments", []):
        if seg.get("device", device) == device and seg["address"] not in live:
            sys.exit(f"record_segments: segment at {seg['address']:#x} ({seg['total_size']} bytes) is not in the "
                     "trace (allocated before recording began)")
    if n == 0:
        sys.exit("record_segments: the run allocated no segment")
    return events


def main() -> int:
    output = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_OUTPUT
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    # train_gpt2.py's settings, before torch is imported (the allocator reads its configuration once).
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF
    os.environ.pop("PYTORCH_ALLOC_CONF", None)

    import torch
    import transformers
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    if not torch.cuda.is_available():
        sys.exit("record_segments: no CUDA device: run it on the GPU machine")
    if torch.cuda.memory_reserved() != 0:
        sys.exit("record_segments: the allocator holds memory already; nothing may allocate before recording")

    # Allocation and free events only: no stack traces (context=None), which would slow the run down.
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=MAX_ENTRIES)
    device = torch.cuda.current_device()
    attn = train(torch, steps)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = segment_events(snapshot, device)

    sizes = [v for op, v in events if op == "+"]
    frees = sum(1 for op, _ in events if op == "-")
    live = peak = 0
    for op, v in events:
        live += v if op == "+" else -sizes[v]
        peak = max(peak, live)
    props = torch.cuda.get_device_properties(device)
    header = [
        "vmmbroker segment trace (bench-trace's format): one event per line, in the order the allocator made them",
        "  +SIZE  the next segment is allocated (cudaMalloc of SIZE bytes); segments are numbered 0, 1, ... in the",
        "         order of these lines",
        "  -N     segment N is freed (cudaFree)",
        f"recorded by tests/gpu/python/record_segments.py, {steps} steps, "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"  torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, "
        f"Python {platform.python_version()}",
        f"  device {device}: {props.name}, {props.total_memory >> 20} MiB, NVIDIA driver {driver_version()}",
        f"  GPT2LMHeadModel(GPT2Config(n_layer=6, n_embd=768, n_head=12)), attention {attn}, batch 8 x 512, "
        f"AdamW lr 3e-4, seeds 0 (weights) and 1 (tokens)",
        f"  PYTORCH_CUDA_ALLOC_CONF={ALLOC_CONF}, CUBLAS_WORKSPACE_CONFIG=:4096:8, deterministic algorithms, no TF32",
        "  history: torch.cuda.memory._record_memory_history(enabled='all', context=None) from before the first",
        "  allocation to the end of the last step; 'segment_alloc' and 'segment_free' of _snapshot()['device_traces']",
        f"{len(sizes)} segments allocated ({sum(sizes)} bytes), {frees} freed, at most {peak} bytes live at once",
    ]
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(output + ".tmp", "w") as f:
        for line in header:
            f.write(f"# {line}\n")
        for op, v in events:
            f.write(f"{op}{v}\n")
    os.replace(output + ".tmp", output)
    distinct = sorted(set(sizes))
    print(f"record_segments: wrote {output}: {len(sizes)} segments, {len(distinct)} distinct sizes "
          f"({', '.join(f'{s / (1 << 20):g} MiB' for s in distinct)}), {frees} freed, peak {peak / (1 << 20):.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
