#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""The weight store's layout header, without PyTorch or a GPU: plan, encode, decode, reject.

    python3 tests/gpu/python/layout_selftest.py

Loads client/python/vmmbroker/weights.py by path (its module level needs only
the standard library), so it runs anywhere, CI included. Exit status 0 on success.
"""

import importlib.util
import json
import os
import struct
import sys
import zlib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
spec = importlib.util.spec_from_file_location(
    "vmmbroker_weights_layout", os.path.join(REPO, "client", "python", "vmmbroker", "weights.py"))
w = importlib.util.module_from_spec(spec)
spec.loader.exec_module(w)

failures = 0


def check(cond, what):
    global failures
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures += 1


def raises(exc, fn, what):
    try:
        fn()
    except exc as e:
        check(True, f"{what}: {type(e).__name__}: {e}")
        return
    except Exception as e:      # the wrong kind
        check(False, f"{what}: {type(e).__name__}: {e}")
        return
    check(False, f"{what}: no error")


# plan: alignment, aliases, zero-size and 0-d tensors
specs = [
    ("wte.weight", "bfloat16", (50257, 1024), None),
    ("h.0.ln_1.weight", "float32", (1024,), None),
    ("scalar", "int64", (), None),
    ("empty", "float16", (0, 7), None),
    ("lm_head.weight", "bfloat16", (50257, 1024), "wte.weight"),
    ("mask", "bool", (1, 1, 5, 5), None),
]
entries, data_size = w.plan_layout(specs)
by = {e[0]: e for e in entries}
check(all(e[4] % w.ALIGN == 0 for e in entries), "every offset is aligned to 256")
check(by["lm_head.weight"][4] == by["wte.weight"][4], "a tied tensor shares its source's offset")
check(by["wte.weight"][5] == 50257 * 1024 * 2, "bf16 bytes")
check(by["h.0.ln_1.weight"][4] == w._align(50257 * 1024 * 2, 256), "the next tensor starts at the next aligned offset")
check(by["scalar"][2] == [] and by["scalar"][3] == [] and by["scalar"][5] == 8, "a 0-d tensor: no dims, 8 bytes")
check(by["empty"][5] == 0 and by["empty"][3] == [7, 1], "an empty tensor: 0 bytes, contiguous strides")
check(by["mask"][3] == [25, 25, 5, 1], "contiguous strides")
ends = [e[4] + e[5] for e in entries]
check(data_size == max(ends), "data size is the end of the last tensor")
spans = sorted((e[4], e[4] + e[5]) for e in entries if e[5] and e[0] != "lm_head.weight")
check(all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "tensors do not overlap")

# encode / decode round trip
meta = {"config": {"n_layer": 24, "name": "gpt2-medium"}, "revision": 3}
header, data_offset = w.encode_layout(entries, data_size, meta)
check(header[:8] == w.MAGIC, "magic first")
check(data_offset % w.ALIGN == 0 and data_offset >= len(header), "data starts aligned, after the header")
check(len(header) == w.PREFIX_SIZE + struct.unpack_from("<Q", header, 16)[0], "prefix says the JSON's size")
lease_size = (data_offset + data_size + (2 << 20) - 1) // (2 << 20) * (2 << 20)
buf = header + b"\xAA" * 1000          # what follows the header is data, not parsed
got, off, m = w.decode_layout(buf, lease_size)
check(got == entries and off == data_offset and m == meta, "decode(encode(x)) == x")
check(w.decode_prefix(header)[1] == data_offset, "decode_prefix gives the data offset")

# element offsets divide exactly for every dtype (what attach_state_dict's as_strided needs)
specs2 = [(f"t{i}", d, (3, 5), None) for i, d in enumerate(sorted(w.ITEMSIZE))]
e2, s2 = w.plan_layout(specs2)
h2, o2 = w.encode_layout(e2, s2)
check(all((o2 + e[4]) % w.ITEMSIZE[e[1]] == 0 for e in e2), "every tensor's byte offset divides by its element size")

# rejections
raises(w.LayoutError, lambda: w.decode_layout(b"\0" * 4096), "zeroed memory (a lease never written)")
raises(w.LayoutError, lambda: w.decode_layout(header[:40]), "a short buffer")
bad = bytearray(header)
bad[w.PREFIX_SIZE + 5] ^= 0x01
raises(w.LayoutError, lambda: w.decode_layout(bytes(bad)), "a flipped bit in the JSON (checksum)")
bad = bytearray(header)
struct.pack_into("<I", bad, 8, w.FORMAT_VERSION + 1)
raises(w.LayoutError, lambda: w.decode_layout(bytes(bad)), "a later version")


def header_of(doc, version, data_size):
    """A header as a producer of VERSION wrote it, for DOC (the JSON document)."""
    js = json.dumps(doc, separators=(",", ":")).encode()
    data_off = w._align(w.PREFIX_SIZE + len(js), w.ALIGN)
    pre = struct.pack("<8sIIQQQI", w.MAGIC, version, w.PREFIX_SIZE, len(js), data_off, data_size,
                      zlib.crc32(js) & 0xFFFFFFFF)
    return pre + b"\0" * (w.PREFIX_SIZE - len(pre)) + js, data_off


# a store published by version 1 (one array per tensor, strides kept) reads the same
h1, o1 = header_of({"tensors": entries, "metadata": meta}, 1, data_size)
got1, off1, m1 = w.decode_layout(h1, None)
check(got1 == entries and off1 == o1 and m1 == meta, "a version 1 header decodes to the same entries")
# version 2 writes one array per field, no strides
doc2 = json.loads(header[w.PREFIX_SIZE:])
check(sorted(doc2) == ["dtypes", "metadata", "names", "nbytes", "offsets", "shapes"] and
      doc2["names"] == [e[0] for e in entries], "version 2 keeps one array per field")
raises(ValueError, lambda: w.encode_layout([["t", "float32", [2, 3], [1, 2], 0, 24]], 24),
       "strides that are not contiguous cannot be stored")
bad_doc = dict(doc2, offsets=doc2["offsets"][:-1])
raises(w.LayoutError, lambda: w.decode_layout(header_of(bad_doc, 2, data_size)[0]), "arrays of different lengths")
raises(w.LayoutError, lambda: w.decode_layout(header_of({"names": []}, 2, data_size)[0]), "a field missing")
raises(w.LayoutError, lambda: w.decode_layout(header_of(dict(doc2, dtypes=["qint8"] * len(entries)), 2,
                                                        data_size)[0]), "an unknown dtype")
raises(w.LayoutError, lambda: w.decode_layout(header_of([1, 2], 2, data_size)[0]), "JSON that is not an object")
raises(w.LayoutError, lambda: w.decode_layout(header_of(dict(doc2, names=7), 2, data_size)[0]), "names not an array")
raises(w.LayoutError, lambda: w.decode_layout(header_of(dict(doc2, offsets=["0"] * len(entries)), 2,
                                                        data_size)[0]), "offsets that are not numbers")
raises(w.LayoutError, lambda: w.decode_layout(header_of(dict(doc2, shapes=[["x"]] * len(entries)), 2,
                                                        data_size)[0]), "shapes that are not numbers")
raises(w.LayoutError, lambda: w.decode_layout(header_of(dict(doc2, metadata=[]), 2, data_size)[0]),
       "metadata that is not an object")
raises(w.LayoutError, lambda: w.decode_layout(header[:-10]), "a truncated JSON")
raises(w.LayoutError, lambda: w.decode_layout(header, data_offset + data_size - 1), "a lease too small for the layout")
raises(ValueError, lambda: w.plan_layout([("a", "float32", (2,), None), ("a", "float32", (2,), None)]), "a duplicate name")
raises(ValueError, lambda: w.plan_layout([("a", "qint8", (2,), None)]), "a dtype that cannot be stored")
raises(ValueError, lambda: w.plan_layout([("b", "float32", (2,), "a")]), "an alias of a missing tensor")
raises(ValueError, lambda: w.plan_layout([("a", "float32", (2,), None), ("b", "float16", (2,), "a")]),
       "an alias with another dtype")
raises(ValueError, lambda: w.plan_layout([], align=100), "an alignment that is not a power of two")

# a header whose tensor points outside the data
doc_entries = [["x", "float32", [4], [1], 0, 16]]
hx, ox = w.encode_layout(doc_entries, 8)
raises(w.LayoutError, lambda: w.decode_layout(hx), "a tensor outside the data")

# the first read at attach covers a GPT-2-medium-sized header
n_layer = 24
names = []
for i in range(n_layer):
    for p in ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
              "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
              "mlp.c_proj.weight", "mlp.c_proj.bias"):
        names.append((f"transformer.h.{i}.{p}", "bfloat16", (1024, 3072), None))
e3, s3 = w.plan_layout(names)
h3, _ = w.encode_layout(e3, s3)
check(len(h3) <= w.FIRST_READ, f"a 24-layer header ({len(h3)} bytes) fits the first read ({w.FIRST_READ})")
check(zlib.crc32(h3[w.PREFIX_SIZE:]) & 0xFFFFFFFF == struct.unpack_from("<I", h3, 40)[0], "crc32 at byte 40")

print(f"\n{'all checks passed' if not failures else f'{failures} checks FAILED'}")
sys.exit(1 if failures else 0)
