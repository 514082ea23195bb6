#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""How much of a new process's first attach_state_dict() is first use, and whose: a measurement program for
docs/performance.md (issue 15), not a test.

    VMMBROKER_BUILD=build-gpu python3 tests/gpu/python/weights_warmups.py [ROUNDS]

weights_first_use.py's producer publishes a GPT-2-medium-shaped state dict (bf16, 293 tensors) and exits.
Then ROUNDS times (default 6), one new process of each kind, alternating; each imports what weights.py's
restart imports, makes its CUDA context and connects, untimed, then does its kind's untimed warm-up and
times its first attach_state_dict():

  base     nothing more (weights.py's restart);
  cpu      PyTorch's view(dtype), as_strided and unbind on a small CPU tensor, and one json.loads():
           the first use of the operations the views make, paid on other memory;
  lib      an Attach of a name that does not exist: the library's and ctypes' first call, no driver;
  all      cpu and lib;
  thread   cpu's warm-up in a thread started just before the attach, joined after it, timed with it:
           whether that first use can be hidden behind the broker's round trip.

Prints the medians of each kind and of its phases (ms).
"""

import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h  # noqa: E402

PRODUCER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "weights_first_use.py")
KINDS = ("base", "cpu", "lib", "all", "thread")


def cpu_warmup(torch) -> None:
    t = torch.empty(64, dtype=torch.uint8)
    v = t.view(torch.bfloat16)
    v.as_strided([4], [1], 0)
    v.as_strided([2, 4], [4, 1], 0).unbind(0)
    json.loads('{"a": [1, 2], "b": "c"}')


def consumer(name: str, kind: str) -> None:
    import torch
    import safetensors.torch  # noqa: F401
    import transformers  # noqa: F401
    import vmmbroker
    import vmmbroker.torch  # noqa: F401
    import vmmbroker.weights as w

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    client = vmmbroker.connect()
    if kind in ("lib", "all"):
        try:
            client.attach(name="no-such-name")
        except vmmbroker.NotFound:
            pass
    if kind in ("cpu", "all"):
        cpu_warmup(torch)
    t0 = time.perf_counter_ns()
    if kind == "thread":
        th = threading.Thread(target=cpu_warmup, args=(torch,))
        th.start()
        sd = w.attach_state_dict(client, name)
        th.join()
    else:
        sd = w.attach_state_dict(client, name)
    r = {"kind": kind, "ms": (time.perf_counter_ns() - t0) / 1e6, "tensors": len(sd)}
    r.update({k[:-3]: v / 1e6 for k, v in w.last_timings.items() if k.endswith("_ns")})
    sd.close()
    print(json.dumps(r))


def main() -> int:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    me = os.path.abspath(__file__)
    name = f"warmups-{os.getpid()}"
    with h.broker():
        print(h.run_self(PRODUCER, ["--producer", name]).strip())
        got = {k: [] for k in KINDS}
        for _ in range(rounds):
            for kind in KINDS:
                got[kind].append(h.last_json(h.run_self(me, ["--consumer", name, kind])))
        import vmmbroker
        vmmbroker.connect().unpublish(name)
    for kind in KINDS:
        rs = got[kind]

        def med(k):
            return statistics.median(r[k] for r in rs)
        each = " ".join(f"{r['ms']:.2f}" for r in rs)
        print(f"{kind:7s} first attach_state_dict {med('ms'):.3f} ms ({each}); "
              f"phases: attach {med('attach'):.3f}, wrap {med('wrap'):.3f}, copy {med('copy'):.3f}, "
              f"parse {med('parse'):.3f}, views {med('views'):.3f}")
    return 0


if __name__ == "__main__":
    h.setup_paths()
    if sys.argv[1:2] == ["--consumer"]:
        consumer(sys.argv[2], sys.argv[3])
        sys.exit(0)
    sys.exit(main())
