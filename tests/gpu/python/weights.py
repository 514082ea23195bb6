#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""The weight store on GPT-2 medium: publish from one process, attach by name from another, compare.

    python3 tests/gpu/python/weights.py [REPEATS [RESTARTS]]

1. A producer process builds GPT-2 medium (GPT2Config(n_layer=24, n_embd=1024,
   n_head=16), bf16, random weights, torch.manual_seed(0): about 677 MiB),
   computes reference logits on fixed input, saves them and a safetensors file
   of the same tensors, publishes its state dict with
   vmmbroker.weights.publish_state_dict() and exits without freeing anything.
2. A consumer process attaches the store by name REPEATS times (default 20)
   and times "attach by name to state dict ready"; the first attach of the
   process is reported on its own, the median of the others is the result. It
   builds the model on the meta device, load_state_dict(..., assign=True) on
   the attached tensors, runs the forward pass on the same input and compares
   the logits bit for bit with the reference. Then it times
   safetensors.torch.load_file(..., device="cuda") of the same tensors from the
   page-cached file (read once to warm the cache).
3. What a restarted inference server does, RESTARTS times (default 8): a new
   process imports torch, transformers, safetensors and vmmbroker (with
   vmmbroker.torch), makes its CUDA context and connects to the broker, untimed,
   then times its first attach_state_dict() of the store; alternating with a
   new process, prepared the same way, that times its first
   safetensors.torch.load_file(..., device="cuda") of the page-cached file.
   Then the same two again in processes that first build the model on the
   meta device from the config file, untimed, as a server that knows its
   model does before it has weights; this warms PyTorch's code paths the
   attach uses (a new process's first view, as_strided and unbind), and
   shows what such a server sees. These rows are printed beside the
   target's, not instead of them: the target is judged on the bare restart.
4. The name is unpublished. A table comes last. Targets: attach <= 2 ms,
   >= 100x faster than safetensors, logits bit-identical. The restart (first
   attach in a fresh process against first load in a fresh process) is the
   case the weight store exists for; the attach is also judged within one
   process, each attach right after a full gc.collect() (which leaves the CPU's
   caches and the heap cold: the conservative number) and back to back (as
   Python's timeit measures). Within one process each attach is timed while
   the previous one's tensors still exist, and they are dropped after it: on
   the H100, mapping the lease right after this process unmapped it took 617 us
   against 145 us otherwise (the driver's unmap of 678 MiB finishing), a cost
   no restarted server pays. The attach before the previous one is dropped
   just before, so these two rows still carry part of that cost; the restart
   rows carry none. Exit status 0 when the logits are identical.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h  # noqa: E402

CONFIG = dict(n_layer=24, n_embd=1024, n_head=16)


def _input(torch, vocab: int, device):
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, vocab, (2, 128), generator=g).to(device)


def producer(name: str, tmp: str) -> None:
    import torch
    import safetensors.torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import vmmbroker
    import vmmbroker.weights as w

    torch.manual_seed(0)
    config = GPT2Config(**CONFIG)
    model = GPT2LMHeadModel(config).to(device="cuda", dtype=torch.bfloat16).eval()
    ids = _input(torch, config.vocab_size, "cuda")
    with torch.inference_mode():
        ref = model(input_ids=ids, use_cache=False).logits
    torch.save({"ids": ids.cpu(), "logits": ref.cpu()}, os.path.join(tmp, "reference.pt"))

    sd = model.state_dict()
    persistent = list(sd.keys())
    extra = {n: b for n, b in model.named_buffers() if n not in sd}     # non-persistent buffers
    store = dict(sd)
    store.update(extra)

    # safetensors refuses shared tensors: keep each memory once (tied weights), as the store does
    seen, unique = set(), {}
    for k, t in store.items():
        key = (t.data_ptr(), t.dtype, tuple(t.shape))
        if key not in seen:
            seen.add(key)
            unique[k] = t.contiguous()
    safetensors.torch.save_file(unique, os.path.join(tmp, "model.safetensors"))
    config.to_json_file(os.path.join(tmp, "config.json"))      # what a restarted server reads (--restart model-*)
    nbytes = sum(t.numel() * t.element_size() for t in unique.values())

    client = vmmbroker.connect()
    t0 = time.perf_counter()
    lease = w.publish_state_dict(client, name, store, readonly=True,
                                 metadata={"config": json.loads(config.to_json_string()),
                                           "persistent": persistent, "buffers": list(extra)})
    publish_s = time.perf_counter() - t0
    print(json.dumps({"tensors": len(store), "unique": len(unique), "bytes": nbytes,
                      "lease_size": int(lease.size), "publish_s": publish_s}))
    sys.stdout.flush()
    os._exit(0)         # exit without freeing: the published name keeps the memory


def _set_buffer(model, name: str, t) -> None:
    mod_name, _, leaf = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    mod._buffers[leaf] = t


def consumer(name: str, tmp: str, repeats: int) -> None:
    import torch
    import safetensors.torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import vmmbroker
    import vmmbroker.weights as w

    torch.cuda.init()
    torch.zeros(1, device="cuda")        # the CUDA context exists before timing
    client = vmmbroker.connect()

    times = []
    phases = []
    first = None
    sd = None
    # Each attach is timed while the previous one's tensors exist, and they go after it (see above).
    for i in range(repeats + 1):
        prev, sd = sd, None
        gc.collect()
        t0 = time.perf_counter_ns()
        sd = w.attach_state_dict(client, name, readonly=True)
        t1 = time.perf_counter_ns()
        if prev is not None:
            prev.close()
        if i == 0:
            first = (t1 - t0) / 1e6
            first_phases = dict(w.last_timings)
        else:
            times.append((t1 - t0) / 1e6)
            phases.append(dict(w.last_timings))
    # The same without a full collection right before each attach (which leaves the CPU's caches cold: the
    # loop above is the conservative number, this one what back-to-back attaches cost).
    warm = []
    for i in range(repeats):
        prev, sd = sd, None
        t0 = time.perf_counter_ns()
        sd = w.attach_state_dict(client, name, readonly=True)
        warm.append((time.perf_counter_ns() - t0) / 1e6)
        prev.close()
    readonly = bool(sd.lease.readonly)
    nbytes = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in sd.values()}.values())

    meta = sd.metadata
    config = GPT2Config.from_dict(meta["config"])
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = GPT2LMHeadModel(config).to(torch.bfloat16)
    model.load_state_dict({k: sd[k] for k in meta["persistent"]}, assign=True, strict=True)
    for b in meta["buffers"]:
        _set_buffer(model, b, sd[b])
    model.eval()
    load_s = time.perf_counter() - t0
    on_meta = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if on_meta:
        raise SystemExit(f"left on the meta device: {on_meta[:5]}")
    ref = torch.load(os.path.join(tmp, "reference.pt"))
    with torch.inference_mode():
        logits = model(input_ids=ref["ids"].cuda(), use_cache=False).logits
    got = logits.cpu()
    identical = got.shape == ref["logits"].shape and torch.equal(
        got.contiguous().view(torch.int16), ref["logits"].contiguous().view(torch.int16))
    del model, logits
    sd.close()
    sd = None
    gc.collect()

    path = os.path.join(tmp, "model.safetensors")
    with open(path, "rb") as f:          # warm the page cache
        while f.read(1 << 24):
            pass
    st = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        tensors = safetensors.torch.load_file(path, device="cuda")
        torch.cuda.synchronize()
        st.append((time.perf_counter_ns() - t0) / 1e6)
        del tensors
    print(json.dumps({"first_ms": first, "first_phases_ms": {k: v / 1e6 for k, v in first_phases.items()
                                                             if k.endswith("_ns")},
                      "warm_ms": warm, "attach_ms": times, "safetensors_ms": st, "identical": identical,
                      "readonly": readonly, "bytes": nbytes, "load_state_dict_s": load_s,
                      "phases_ms": {k: h.median([p[k] for p in phases]) / 1e6 for k in
                                    ("attach_ns", "wrap_ns", "header_ns", "views_ns")}}))


def restart(mode: str, name: str, tmp: str) -> None:
    """A restarted server: everything a server imports and sets up, untimed; then its first attach or load.

    It imports what docs/examples/python/weights_attach.py imports (vmmbroker and vmmbroker.weights, which
    imports vmmbroker.torch itself), no more. MODE is attach or load; model-attach and model-load build the
    model on the meta device first, untimed, from the config file the producer wrote (as a server that
    knows its model does before it has weights).
    """
    import torch
    import safetensors.torch
    import transformers  # noqa: F401

    import vmmbroker
    import vmmbroker.weights as w

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    model = None
    if mode.startswith("model-"):
        from transformers import GPT2Config, GPT2LMHeadModel
        config = GPT2Config.from_json_file(os.path.join(tmp, "config.json"))
        with torch.device("meta"):
            model = GPT2LMHeadModel(config).to(torch.bfloat16)
        mode = mode[len("model-"):]
    client = vmmbroker.connect()
    if mode == "attach":
        t0 = time.perf_counter_ns()
        sd = w.attach_state_dict(client, name, readonly=True)
        ms = (time.perf_counter_ns() - t0) / 1e6
        phases = {k[:-3]: v / 1e6 for k, v in w.last_timings.items() if k.endswith("_ns")}
        n = len(sd)
        if model is not None:           # what was timed is ready for it: checked, untimed
            model.load_state_dict({k: sd[k] for k in sd.metadata["persistent"]}, assign=True, strict=True)
            del model
        sd.close()
    else:
        t0 = time.perf_counter_ns()
        tensors = safetensors.torch.load_file(os.path.join(tmp, "model.safetensors"), device="cuda")
        torch.cuda.synchronize()
        ms = (time.perf_counter_ns() - t0) / 1e6
        phases, n = {}, len(tensors)
    print(json.dumps({"mode": mode, "ms": ms, "phases_ms": phases, "tensors": n}))


RESTART_MODES = ("attach", "load", "model-attach", "model-load")


def restarts(me: str, name: str, tmp: str, n: int) -> dict:
    """N fresh processes of each kind (RESTART_MODES), alternating; the file is page-cached first."""
    with open(os.path.join(tmp, "model.safetensors"), "rb") as f:
        while f.read(1 << 24):
            pass
    got: dict = {mode: [] for mode in RESTART_MODES}
    got["phases"], got["model-phases"] = [], []
    for _ in range(n):
        for mode in RESTART_MODES:
            r = h.last_json(h.run_self(me, ["--restart", mode, name, tmp]))
            got[mode].append(r["ms"])
            if mode.endswith("attach"):
                got[mode[:-len("attach")] + "phases"].append(r["phases_ms"])
    return got


def main() -> int:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    n_restarts = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    h.setup_paths()
    me = os.path.abspath(__file__)
    out = os.environ.get("OUT")
    tmp = tempfile.mkdtemp(prefix="vmmb-weights-", dir=out if out and os.path.isdir(out) else None)
    name = f"gpt2-medium-{os.getpid()}"
    try:
        with h.broker():
            prod = h.last_json(h.run_self(me, ["--producer", name, tmp]))
            try:
                cons = h.last_json(h.run_self(me, ["--consumer", name, tmp, str(repeats)]))
                fresh = restarts(me, name, tmp, n_restarts)
            finally:
                import vmmbroker
                try:
                    vmmbroker.connect().unpublish(name)
                except Exception as e:      # reported, not fatal: the daemon ends with the test
                    print(f"unpublish {name}: {e}")
    finally:
        for f in ("model.safetensors", "reference.pt", "config.json"):
            try:
                os.unlink(os.path.join(tmp, f))
            except OSError:
                pass
        try:
            os.rmdir(tmp)
        except OSError:
            pass
    attach = h.median(cons["attach_ms"])
    warm = h.median(cons["warm_ms"])
    stm = h.median(cons["safetensors_ms"])
    ratio = stm / attach if attach > 0 else float("inf")
    warm_ratio = stm / warm if warm > 0 else float("inf")
    mib = 1 << 20
    print(f"attach times (ms): {' '.join(f'{t:.3f}' for t in cons['attach_ms'])}")
    print(f"safetensors load_file times (ms): {' '.join(f'{t:.1f}' for t in cons['safetensors_ms'])}")
    print(f"published {prod['tensors']} tensors ({prod['unique']} distinct), "
          f"{prod['bytes'] / mib:.1f} MiB in a lease of {prod['lease_size'] / mib:.0f} MiB, "
          f"in {prod['publish_s'] * 1e3:.0f} ms; producer exited without freeing")
    ph = cons.get("phases_ms", {})
    print("attach phases, median ms: " + ", ".join(f"{k[:-3]} {v:.3f}" for k, v in ph.items()))
    print("first attach in the process, phases ms: " +
          ", ".join(f"{k[:-3]} {v:.3f}" for k, v in cons.get("first_phases_ms", {}).items()))
    print(f"attach without a gc.collect() just before (back to back), median of {len(cons['warm_ms'])}: "
          f"{warm:.3f} ms")
    r_attach = h.median(fresh["attach"])
    r_load = h.median(fresh["load"])
    r_ratio = r_load / r_attach if r_attach > 0 else float("inf")
    print(f"restarts: first attach in a fresh process (ms): {' '.join(f'{t:.3f}' for t in fresh['attach'])}")
    print(f"restarts: first safetensors load in a fresh process (ms): "
          f"{' '.join(f'{t:.1f}' for t in fresh['load'])}")
    print("restarts: first attach's phases, median ms: " +
          ", ".join(f"{k} {h.median([p[k] for p in fresh['phases']]):.3f}" for k in fresh["phases"][0]))
    for i, (ms, p) in enumerate(zip(fresh["attach"], fresh["phases"])):    # which phases a slow one spent
        print(f"restart {i + 1}: first attach {ms:.3f} ms: " + ", ".join(f"{k} {v:.3f}" for k, v in p.items()))
    m_attach = h.median(fresh["model-attach"])
    m_load = h.median(fresh["model-load"])
    print(f"restarts, model built first: first attach (ms): {' '.join(f'{t:.3f}' for t in fresh['model-attach'])}")
    print(f"restarts, model built first: first safetensors load (ms): "
          f"{' '.join(f'{t:.1f}' for t in fresh['model-load'])}")
    print("restarts, model built first: first attach's phases, median ms: " +
          ", ".join(f"{k} {h.median([p[k] for p in fresh['model-phases']]):.3f}" for k in fresh["model-phases"][0]))
    h.table("GPT-2 medium bf16 state dict: attach by name vs safetensors (page-cached)",
            ["what", "median ms", "note"],
            [["restart: first attach_state_dict in a new process", f"{r_attach:.3f}",
              f"{len(fresh['attach'])} processes; target <= 2 ms " + ("met" if r_attach <= 2.0 else "MISSED")],
             ["restart: first safetensors load_file in a new process", f"{r_load:.1f}",
              f"{len(fresh['load'])} processes, alternating with the attaches"],
             ["ratio, restart", f"{r_ratio:.0f}x", "target >= 100x " + ("met" if r_ratio >= 100 else "MISSED")],
             ["restart, model built on meta first: first attach", f"{m_attach:.3f}",
              f"{len(fresh['model-attach'])} processes; not the target's measure (see the docstring)"],
             ["restart, model built on meta first: first load_file", f"{m_load:.1f}",
              f"ratio {m_load / m_attach if m_attach > 0 else float('inf'):.0f}x"],
             ["attach_state_dict, each after a full gc.collect()", f"{attach:.3f}",
              f"first in process {cons['first_ms']:.3f} ms; {len(cons['attach_ms'])} repeats; "
              f"read-only {cons['readonly']}; target <= 2 ms " + ("met" if attach <= 2.0 else "MISSED")],
             ["attach_state_dict, back to back", f"{warm:.3f}",
              f"{len(cons['warm_ms'])} repeats; target <= 2 ms " + ("met" if warm <= 2.0 else "MISSED")],
             ["safetensors load_file cuda", f"{stm:.1f}", f"{cons['bytes'] / mib:.1f} MiB"],
             ["ratio, after gc.collect()", f"{ratio:.0f}x", "target >= 100x " + ("met" if ratio >= 100 else "MISSED")],
             ["ratio, back to back", f"{warm_ratio:.0f}x",
              "target >= 100x " + ("met" if warm_ratio >= 100 else "MISSED")],
             ["meta model + load_state_dict(assign)", f"{cons['load_state_dict_s'] * 1e3:.1f}", ""],
             ["logits vs producer's", "bit-identical" if cons["identical"] else "DIFFERENT", ""]])
    return 0 if cons["identical"] else 1


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "--producer":
        h.setup_paths()
        producer(sys.argv[2], sys.argv[3])
    elif len(sys.argv) > 4 and sys.argv[1] == "--restart":
        h.setup_paths()
        restart(sys.argv[2], sys.argv[3], sys.argv[4])
        sys.exit(0)
    elif len(sys.argv) > 3 and sys.argv[1] == "--consumer":
        h.setup_paths()
        consumer(sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 20)
        sys.exit(0)
    else:
        sys.exit(main())
