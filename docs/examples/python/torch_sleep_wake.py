#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Put a model to sleep, let another workload use the GPU memory, wake it: the same answers.

    VMMBROKER_SOCKET=/path/to/socket python3 torch_sleep_wake.py

The model, its optimizer state and every other tensor live in a
vmmbroker.torch pool. vmmbroker.torch.sleep() parks each segment of the pool:
the broker copies it into host memory and gives its device memory to whoever
asks next, while this process keeps the addresses reserved, so every tensor
keeps its data pointer. vmmbroker.torch.wake() brings the segments back at
those addresses. Nothing may touch the pool's tensors in between.
"""

import torch

import vmmbroker
import vmmbroker.torch as vt

torch.manual_seed(0)
pool = vt.pool()
with vt.use(pool):
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 10)).cuda()
    x = torch.randn(256, 4096, device="cuda")
    with torch.no_grad():
        before = model(x)
    torch.cuda.synchronize()

    parked = vt.sleep()                     # waits for the device's queued work, then parks
    print(f"asleep: {parked} segments ({pool.reserved_bytes() >> 20} MiB) parked in host memory")
    with vmmbroker.connect() as client:     # another workload may lease that memory now
        for d in client.status():
            print(f"device {d['index']}: {d['leased'] >> 20} MiB leased while the model sleeps")

    print(f"awake: {vt.wake()} segments back at their addresses")
    with torch.no_grad():
        after = model(x)
    print("the same logits:", torch.equal(before, after))
    del model, x, before, after

del pool
vt.release()
