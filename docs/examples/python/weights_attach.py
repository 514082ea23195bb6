#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Attach weights published by weights_publish.py and run the model on them, with no copy.

    VMMBROKER_SOCKET=/path/to/socket python3 weights_attach.py NAME

The model is built on the meta device (no memory) and load_state_dict(...,
assign=True) makes its parameters the attached tensors. The lease is mapped
read-only: fine for inference; the parameters keep it until the model is gone.
"""

import sys
import time

import torch

import vmmbroker
import vmmbroker.weights as w

name = sys.argv[1] if len(sys.argv) > 1 else "example-weights"
client = vmmbroker.connect()
torch.zeros(1, device="cuda")       # create the CUDA context before timing

t0 = time.perf_counter()
sd = w.attach_state_dict(client, name)
t1 = time.perf_counter()
meta = sd.metadata
with torch.device("meta"):
    layer = torch.nn.TransformerEncoderLayer(meta["d_model"], meta["nhead"], batch_first=True)
    model = torch.nn.TransformerEncoder(layer, meta["layers"]).to(torch.bfloat16)
model.load_state_dict(sd, assign=True)
model.eval()
print(f"attached {name} in {(t1 - t0) * 1e3:.3f} ms: {len(sd)} tensors, read-only {sd.lease.readonly}")

with torch.inference_mode():
    out = model(torch.randn(2, 16, meta["d_model"], device="cuda", dtype=torch.bfloat16))
print(f"output {tuple(out.shape)}, mean {out.float().mean().item():.5f}")
