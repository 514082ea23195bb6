#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""What a weight-store attach costs the first time in a new process, step by step: a measurement program for
docs/performance.md (issue 15), not a test.

    VMMBROKER_BUILD=build-gpu python3 tests/gpu/python/weights_first_use.py

A producer publishes a GPT-2-medium-shaped state dict (bf16, random, 293 tensors) and exits; then 8 new
processes (imports, CUDA context and connection done first, untimed; every other one after a device-to-host
copy of its own, "d2h", to see whether the driver's first copy is what the header pays) each time, once:
the broker's attach call, the Lease object, wrapping it in a tensor, loading libcuda through ctypes, the host
buffer, the first and a second cuMemcpyDtoH, copying the bytes out, parsing the header, PyTorch's first view,
as_strided and unbind, the views of the rest; then a second whole attach_state_dict(). Prints a JSON line per
process and the medians (us) of each kind.
"""

import ctypes
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h  # noqa: E402

def producer(name):
    import torch, vmmbroker, vmmbroker.weights as w
    sd = {"transformer.wte.weight": torch.randn(50257, 1024), "transformer.wpe.weight": torch.randn(1024, 1024)}
    for i in range(24):
        for p, s in (("ln_1.weight", (1024,)), ("ln_1.bias", (1024,)), ("attn.c_attn.weight", (1024, 3072)), ("attn.c_attn.bias", (3072,)),
                     ("attn.c_proj.weight", (1024, 1024)), ("attn.c_proj.bias", (1024,)), ("ln_2.weight", (1024,)), ("ln_2.bias", (1024,)),
                     ("mlp.c_fc.weight", (1024, 4096)), ("mlp.c_fc.bias", (4096,)), ("mlp.c_proj.weight", (4096, 1024)), ("mlp.c_proj.bias", (1024,))):
            sd[f"transformer.h.{i}.{p}"] = torch.randn(*s)
    sd["transformer.ln_f.weight"] = torch.randn(1024); sd["transformer.ln_f.bias"] = torch.randn(1024)
    sd = {k: v.to("cuda", torch.bfloat16) for k, v in sd.items()}
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    c = vmmbroker.connect()
    w.publish_state_dict(c, name, sd)
    print(json.dumps({"n": len(sd)})); sys.stdout.flush(); os._exit(0)

def consumer(name, prewarm):
    import torch, safetensors.torch, transformers  # noqa
    import vmmbroker, vmmbroker.torch as vt, vmmbroker.weights as w
    from vmmbroker import _lib
    torch.zeros(1, device="cuda"); torch.cuda.synchronize()
    if prewarm == "d2h":
        torch.ones(1, device="cuda").item()
    c = vmmbroker.connect()
    clk = time.perf_counter_ns
    T = [clk()]
    def t(): T.append(clk())
    out = ctypes.c_void_p()
    rc = _lib.lib().vmmb_attach_name(c._check(), name.encode(), _lib.READONLY, ctypes.byref(out)); t()
    lease = c._adopt(out); t()
    mem = vt._LeaseMemory(lease, owned=True); base = torch.as_tensor(mem); mem.torch_device = base.device; t()
    cu = ctypes.CDLL("libcuda.so.1"); f = cu.cuMemcpyDtoH_v2; f.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]; f.restype = ctypes.c_int; t()
    buf = bytearray(65536); t()
    dst = (ctypes.c_char * 65536).from_buffer(buf); t()
    f(dst, base.data_ptr(), 64); t()
    f(dst, base.data_ptr(), 65536); t()
    raw = bytes(memoryview(buf)[:65536]); del dst; t()
    names, groups, doff, meta = w._parse(raw, base.shape[0]); t()
    bv = base.view(torch.bfloat16); t()
    a = bv.as_strided([1024], [1], 0); t()
    b = bv.as_strided([2, 1024], [1024, 1], 0).unbind(0); t()
    sd = w._views(base, names, groups, doff); t()
    del sd, a, b, bv
    t0 = clk(); sd2 = w.attach_state_dict(c, name); t1 = clk()
    labels = ["attach_call", "adopt", "wrap", "cdll", "bytearray", "from_buffer", "d2h_64", "d2h_64k", "bytes", "parse", "view_dtype", "as_strided1", "unbind1", "views_all"]
    r = {k: (T[i + 1] - T[i]) / 1e3 for i, k in enumerate(labels)}
    r["total_first"] = (T[-1] - T[0]) / 1e3; r["second_attach_state_dict"] = (t1 - t0) / 1e3; r["prewarm"] = prewarm
    r["second_phases"] = {k: v / 1e3 for k, v in w.last_timings.items() if k.endswith("_ns")}
    print(json.dumps(r))

if __name__ == "__main__":
    h.setup_paths()
    if sys.argv[1:2] == ["--producer"]: producer(sys.argv[2])
    elif sys.argv[1:2] == ["--consumer"]: consumer(sys.argv[2], sys.argv[3])
    else:
        me = os.path.abspath(__file__)
        with h.broker():
            print(h.run_self(me, ["--producer", "probe"]))
            res = []
            for i in range(4):
                for pw in ("none", "d2h"):
                    r = h.last_json(h.run_self(me, ["--consumer", "probe", pw])); res.append(r); print(json.dumps(r))
            for pw in ("none", "d2h"):
                rs = [r for r in res if r["prewarm"] == pw]
                print(pw, {k: round(statistics.median([r[k] for r in rs]), 1) for k in rs[0] if k not in ("prewarm", "second_phases")})
