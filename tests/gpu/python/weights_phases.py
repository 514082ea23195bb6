#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Where the weight store's attach spends its time, step by step, and what other ways of making the views cost.

    VMMBROKER_BUILD=build-gpu python3 tests/gpu/python/weights_phases.py
    PROBE_IMPORT=1 ...     # the same with transformers and safetensors imported in the consumer

A producer process publishes GPT-2 medium's state dict (bf16, random weights) and exits; a consumer process
then, 20 times (after one untimed round), times: the broker's attach (read-write and read-only) and free,
wrapping the lease in a tensor, reading 64 bytes and 64 KiB of the header back, decoding the layout, and
making the 293 views five ways (as_strided on a typed view, Tensor.set_, slicing and view, split_with_sizes, and
one strided view per group split by unbind(), as attach_state_dict() does),
then attach_state_dict() whole. It prints one JSON line of medians in microseconds. A measurement program
for docs/performance.md, not a test: it checks only that split_with_sizes gives the same views.
"""

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h  # noqa: E402

def producer(name):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    import vmmbroker, vmmbroker.weights as w
    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(n_layer=24, n_embd=1024, n_head=16)).to(device="cuda", dtype=torch.bfloat16)
    sd = dict(m.state_dict())
    c = vmmbroker.connect()
    l = w.publish_state_dict(c, name, sd, readonly=True)
    print(json.dumps({"size": int(l.size), "n": len(sd)})); sys.stdout.flush()
    os._exit(0)

def med(xs): return statistics.median(xs) / 1e3

def consumer(name):
    if os.environ.get("PROBE_IMPORT"):
        import transformers, safetensors.torch  # noqa: F401
        from transformers import GPT2Config, GPT2LMHeadModel  # noqa: F401
    import torch
    import vmmbroker, vmmbroker.weights as w
    from vmmbroker import torch as vt
    torch.zeros(1, device="cuda")
    c = vmmbroker.connect()
    clk = time.perf_counter_ns
    r = {k: [] for k in ("attach_rw", "attach_ro", "free", "wrap", "hdr64", "hdr64k", "decode", "views_as_strided", "views_set", "views_slice", "full")}
    for i in range(21):
        t0 = clk(); l = c.attach(name=name, readonly=False); t1 = clk(); l.free(); t2 = clk()
        if i: r["attach_rw"].append(t1 - t0); r["free"].append(t2 - t1)
        t0 = clk(); l = c.attach(name=name, readonly=True); t1 = clk()
        if i: r["attach_ro"].append(t1 - t0)
        mem = vt._LeaseMemory(l, owned=True)
        t0 = clk(); base = torch.as_tensor(mem); mem.torch_device = base.device; t1 = clk()
        b64 = w._device_bytes(base, 0, 64); t2 = clk()
        bb = w._device_bytes(base, 0, 64 * 1024); t3 = clk()
        js, _, _, _ = w.decode_prefix(bb)
        buf = bb if 64 + js <= len(bb) else bb + w._device_bytes(base, len(bb), 64 + js - len(bb))
        t4 = clk(); entries, doff, meta = w.decode_layout(buf, base.shape[0]); t5 = clk()
        typed = {}
        out = {}
        for n_, dt, shape, stride, off, _ in entries:
            v = typed.get(dt)
            if v is None: v = typed[dt] = base.view(getattr(torch, dt))
            out[n_] = v.as_strided(shape, stride, (doff + off) // w.ITEMSIZE[dt])
        t6 = clk()
        st = base.untyped_storage()
        out2 = {}
        for n_, dt, shape, stride, off, _ in entries:
            d = getattr(torch, dt)
            out2[n_] = torch.empty((), dtype=d, device=base.device).set_(st, (doff + off) // w.ITEMSIZE[dt], shape, stride)
        t7 = clk()
        out3 = {}
        for n_, dt, shape, stride, off, nb in entries:
            out3[n_] = base[doff + off: doff + off + nb].view(getattr(torch, dt)).view(shape)
        t8 = clk()
        typed2 = base[doff:].view(torch.bfloat16)
        spans = sorted({(e[4], e[5]) for e in entries})
        sizes = []; pos = 0; idx = {}
        for off, nb in spans:
            if off > pos: sizes.append((off - pos) // 2)
            idx[off] = len(sizes); sizes.append(nb // 2); pos = off + nb
        if typed2.numel() > pos // 2: sizes.append(typed2.numel() - pos // 2)
        pieces = typed2.split_with_sizes(sizes)
        out4 = {e[0]: (pieces[idx[e[4]]] if len(e[2]) == 1 else pieces[idx[e[4]]].view(e[2])) for e in entries}
        t9 = clk()
        ok = all(torch.equal(out4[k].view(torch.int16), out[k].view(torch.int16)) for k in list(out)[:3]) and all(out4[k].data_ptr() == out[k].data_ptr() and out4[k].shape == out[k].shape for k in out)
        t10 = clk()
        out5 = {}
        ast = torch.as_strided
        for n_, dt, shape, stride, off, _ in entries:
            out5[n_] = ast(typed[dt], tuple(shape), tuple(stride), (doff + off) // 2)
        t11 = clk()
        t12 = clk(); names3, groups3, doff3, _ = w._parse(buf, base.shape[0]); t13 = clk()
        out6 = w._views(base, names3, groups3, doff3); t14 = clk()
        same6 = list(out6) == list(out) and all(out6[k].data_ptr() == out[k].data_ptr() and out6[k].shape == out[k].shape and out6[k].stride() == out[k].stride() for k in out)
        if i: r.setdefault("parse_groups", []).append(t13 - t12); r.setdefault("views_grouped", []).append(t14 - t13); r["grouped_same"] = [1000 * same6]; r["groups"] = [1000 * len(groups3)]
        del out6
        if i: r.setdefault("views_split", []).append(t9 - t8); r.setdefault("views_fn_tuple", []).append(t11 - t10); r["split_same"] = [1000 * ok]
        if i:
            r["wrap"].append(t1 - t0); r["hdr64"].append(t2 - t1); r["hdr64k"].append(t3 - t2); r["decode"].append(t5 - t4)
            r["views_as_strided"].append(t6 - t5); r["views_set"].append(t7 - t6); r["views_slice"].append(t8 - t7)
        del out, out2, out3, out4, out5, pieces, typed2, base, typed, st
        mem.close()
        t0 = clk(); sd = w.attach_state_dict(c, name); t1 = clk(); sd.close()
        if i: r["full"].append(t1 - t0)
    import torch.overrides
    print(json.dumps({k: round(med(v), 1) for k, v in r.items()} | {"json_bytes": js, "n": len(entries), "unit": "us",
                      "import": bool(os.environ.get("PROBE_IMPORT")), "torch_function_mode": bool(torch.overrides._get_current_function_mode_stack()) if hasattr(torch.overrides, "_get_current_function_mode_stack") else None, "gc_objects": len(__import__("gc").get_objects())}))

if __name__ == "__main__":
    h.setup_paths()
    if sys.argv[1:2] == ["--producer"]: producer(sys.argv[2])
    elif sys.argv[1:2] == ["--consumer"]: consumer(sys.argv[2])
    else:
        me = os.path.abspath(__file__)
        with h.broker():
            print(h.run_self(me, ["--producer", "probe"]))
            print(h.run_self(me, ["--consumer", "probe"]))
