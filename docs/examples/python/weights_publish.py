#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Publish a model's weights in GPU memory under a name, then exit: the weights stay.

    VMMBROKER_SOCKET=/path/to/socket python3 weights_publish.py NAME

Another process (weights_attach.py NAME) attaches them without a copy. The
memory is kept until `vmmctl unpublish NAME` (or Client.unpublish(NAME)).
"""

import sys

import torch

import vmmbroker
import vmmbroker.weights as w

name = sys.argv[1] if len(sys.argv) > 1 else "example-weights"
torch.manual_seed(0)
model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(512, 8, batch_first=True), 4)
model = model.to("cuda", torch.bfloat16).eval()

client = vmmbroker.connect()
lease = w.publish_state_dict(client, name, model.state_dict(), readonly=True,
                             metadata={"d_model": 512, "nhead": 8, "layers": 4})
print(f"published {name}: {len(model.state_dict())} tensors in {lease.size >> 20} MiB at {lease.ptr:#x}")
# Exit without freeing: the name keeps the lease. (lease.free() would end only this process's hold.)
