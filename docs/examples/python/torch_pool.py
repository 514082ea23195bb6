#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Train a small model with every CUDA allocation leased from the broker, then give the memory back.

    VMMBROKER_SOCKET=/path/to/socket python3 torch_pool.py

vmmbroker.torch.pool() is a torch.cuda.MemPool whose segments are leases;
vmmbroker.torch.use(pool) routes every thread's allocations to it (autograd's
backward runs on a thread of its own; torch.cuda.use_mem_pool(pool) would route
only this thread's).
"""

import torch

import vmmbroker.torch as vt

torch.manual_seed(0)
pool = vt.pool()
with vt.use(pool):
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 10)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(256, 4096, device="cuda")
    y = torch.randint(0, 10, (256,), device="cuda")
    for step in range(10):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.5f}")
    print(f"leased by the pool: {pool.reserved_bytes() >> 20} MiB")

# Giving the segments back: torch.cuda.empty_cache() alone keeps a live pool's segments.
del model, opt, x, y, loss
del pool
vt.release()
print("pool released; leases returned to the broker")
