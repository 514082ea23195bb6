#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""The weight store's layout header, without PyTorch or a GPU: plan, encode, decode, reject.

    python3 tests/gpu/python/layout_selftest.py

Imports vmmbroker.weights from this tree's client/python (the package loads
libvmmbroker only when a client connects, and PyTorch only when it is there),
so it runs anywhere, CI included. Exit status 0 on success.
"""

import json
import os
import random
import struct
import sys
import zlib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(REPO, "client", "python"))
import vmmbroker.weights as w  # noqa: E402

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
    """A header as a producer of VERSION wrote it, for DOC (the JSON document); and its data offset."""
    js = json.dumps(doc, separators=(",", ":")).encode()
    return header_of_raw(js, version, data_size), w._align(w.PREFIX_SIZE + len(js), w.ALIGN)


def header_of_raw(js, version, data_size):
    """A header of VERSION around the JSON bytes JS, with their right checksum."""
    data_off = w._align(w.PREFIX_SIZE + len(js), w.ALIGN)
    pre = struct.pack("<8sIIQQQI", w.MAGIC, version, w.PREFIX_SIZE, len(js), data_off, data_size,
                      zlib.crc32(js) & 0xFFFFFFFF)
    return pre + b"\0" * (w.PREFIX_SIZE - len(pre)) + js


# a store published by version 1 (one array per tensor, strides kept) reads the same
h1, o1 = header_of({"tensors": entries, "metadata": meta}, 1, data_size)
got1, off1, m1 = w.decode_layout(h1, None)
check(got1 == entries and off1 == o1 and m1 == meta, "a version 1 header decodes to the same entries")
# a store published by version 2 (one array per field, no strides) reads the same
doc2 = {"names": [e[0] for e in entries], "dtypes": [e[1] for e in entries], "shapes": [e[2] for e in entries],
        "offsets": [e[4] for e in entries], "nbytes": [e[5] for e in entries], "metadata": meta}
h2v, o2v = header_of(doc2, 2, data_size)
got2, off2, m2 = w.decode_layout(h2v, None)
check(got2 == entries and off2 == o2v and m2 == meta, "a version 2 header decodes to the same entries")
raises(ValueError, lambda: w.encode_layout([["t", "float32", [2, 3], [1, 2], 0, 24]], 24),
       "strides that are not contiguous cannot be stored")
bad_doc = dict(doc2, offsets=doc2["offsets"][:-1])
raises(w.LayoutError, lambda: w.decode_layout(header_of(bad_doc, 2, data_size)[0]), "v2: arrays of different lengths")
raises(w.LayoutError, lambda: w.decode_layout(header_of({"names": []}, 2, data_size)[0]), "v2: a field missing")
raises(w.LayoutError, lambda: w.decode_layout(header_of(dict(doc2, dtypes=["qint8"] * len(entries)), 2,
                                                        data_size)[0]), "v2: an unknown dtype")
raises(w.LayoutError, lambda: w.decode_layout(header_of(dict(doc2, offsets=["0"] * len(entries)), 2,
                                                        data_size)[0]), "v2: offsets that are not numbers")
raises(w.LayoutError, lambda: w.decode_layout(header_of(dict(doc2, shapes=[["x"]] * len(entries)), 2,
                                                        data_size)[0]), "v2: shapes that are not numbers")

# version 3: names, and groups [dtype, shape, offset, step, count, first, index step]
doc3 = json.loads(header[w.PREFIX_SIZE:])
check(sorted(doc3) == ["groups", "metadata", "names"] and doc3["names"] == [e[0] for e in entries],
      "version 3 keeps the names and the groups")
check(sorted(g[5] for g in doc3["groups"]) == list(range(len(entries))),
      "no two of these tensors share a template, dtype and shape: a group each")
raises(w.LayoutError, lambda: w.decode_layout(header_of([1, 2], 3, data_size)[0]), "JSON that is not an object")
raises(w.LayoutError, lambda: w.decode_layout(header_of(dict(doc3, names=7), 3, data_size)[0]), "names not an array")
raises(w.LayoutError, lambda: w.decode_layout(header_of(dict(doc3, metadata=[]), 3, data_size)[0]),
       "metadata that is not an object")
raises(w.LayoutError, lambda: w.decode_layout(header_of({"names": doc3["names"]}, 3, data_size)[0]),
       "groups missing")


def with_group(i, field, value):
    """doc3 with field FIELD of group I set to VALUE."""
    groups = [list(g) for g in doc3["groups"]]
    groups[i][field] = value
    return header_of(dict(doc3, groups=groups), 3, data_size)[0]


g0 = doc3["groups"][0]          # wte.weight, bf16
for field, value, what in [
        (0, "qint8", "an unknown dtype"), (0, 5, "a dtype that is not a string"),
        (1, ["x"], "a shape that is not numbers"), (1, [-1, 2], "a negative dimension"), (1, 7, "a shape not a list"),
        (2, -256, "a negative offset"), (2, "0", "an offset that is a string"), (2, 0.5, "an offset that is a float"),
        (2, True, "an offset that is a bool"), (2, data_size, "a tensor past the data"),
        (2, 1, "an offset not a multiple of the element size"),
        (3, -2, "a negative step"), (3, 1, "a step not a multiple of the element size"),
        (4, 0, "a count of 0"), (4, len(entries) + 1, "a count past the names"),
        (5, len(entries), "a first index past the names"), (5, -1, "a negative index"),
        (6, 0, "an index step of 0")]:
    raises(w.LayoutError, lambda: w.decode_layout(with_group(0, field, value)), f"v3: {what}")
groups = [list(g) for g in doc3["groups"]]
groups[1][5] = groups[0][5]
raises(w.LayoutError, lambda: w.decode_layout(header_of(dict(doc3, groups=groups), 3, data_size)[0]),
       "v3: a tensor in two groups (and another in none)")
raises(w.LayoutError, lambda: w.decode_layout(header_of(dict(doc3, groups=doc3["groups"][1:]), 3, data_size)[0]),
       "v3: a tensor in no group")
raises(w.LayoutError, lambda: w.decode_layout(header_of(dict(doc3, groups=doc3["groups"] + [[1, 2]]), 3,
                                                        data_size)[0]), "v3: a group of 2 fields")
raises(w.LayoutError, lambda: w.decode_layout(header_of(dict(doc3, names=doc3["names"][:-1] + [doc3["names"][0]]),
                                                        3, data_size)[0]), "v3: a name twice")
raises(w.LayoutError, lambda: w.decode_layout(header[:-10]), "a truncated JSON")
bad_utf8 = header[w.PREFIX_SIZE:].replace(b'"metadata"', b'"metad\xffta"')
raises(w.LayoutError, lambda: w.decode_layout(header_of_raw(bad_utf8, 3, data_size)), "JSON that is not UTF-8")
raises(w.LayoutError, lambda: w.decode_layout(header, data_offset + data_size - 1), "a lease too small for the layout")
# what a hostile publisher controls: the JSON's size (read and parsed by every attach), and its nesting
huge = bytearray(header[:w.PREFIX_SIZE])
huge[16:24] = (w.MAX_JSON + 1).to_bytes(8, "little")
huge[24:32] = (w.PREFIX_SIZE + w.MAX_JSON + 1).to_bytes(8, "little")
raises(w.LayoutError, lambda: w.decode_prefix(bytes(huge)), "a JSON size over MAX_JSON (before anything is read)")
deep = b'{"names":[],"groups":[],"metadata":{"a":' + b"[" * 100000 + b"]" * 100000 + b"}}"
raises(w.LayoutError, lambda: w.decode_layout(header_of_raw(deep, 3, 0)), "JSON nested 100,000 deep")
saved_max = w.MAX_JSON
w.MAX_JSON = len(header) - w.PREFIX_SIZE - 1
try:
    raises(ValueError, lambda: w.encode_layout(entries, data_size, meta), "a layout over MAX_JSON, written")
    raises(w.LayoutError, lambda: w.decode_layout(header), "a layout over MAX_JSON, read")
finally:
    w.MAX_JSON = saved_max
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
names = [("transformer.wte.weight", "bfloat16", (50257, 1024), None),
         ("transformer.wpe.weight", "bfloat16", (1024, 1024), None)] + names + [
        ("transformer.ln_f.weight", "bfloat16", (1024,), None), ("transformer.ln_f.bias", "bfloat16", (1024,), None),
        ("lm_head.weight", "bfloat16", (50257, 1024), "transformer.wte.weight")]
e3, s3 = w.plan_layout(names)
h3, o3 = w.encode_layout(e3, s3)
g3 = json.loads(h3[w.PREFIX_SIZE:])["groups"]
check(len(g3) == 12 + 5 and sorted(g[4] for g in g3) == [1] * 5 + [24] * 12,
      f"a 24-layer model's {len(e3)} tensors make 17 groups: 12 of 24 and 5 of one ({len(g3)})")
check(w.decode_layout(h3)[0] == e3, "the 24-layer layout decodes to its entries")
# a layer whose tensors are not where the run expects them ends the run, and the layout still decodes
e4 = [list(e) for e in e3]
e4[2 + 12 * 5][4], e4[2 + 12 * 6][4] = e4[2 + 12 * 6][4], e4[2 + 12 * 5][4]
h4, _ = w.encode_layout(e4, s3)
g4 = json.loads(h4[w.PREFIX_SIZE:])["groups"]
check(len(g4) > len(g3) and w.decode_layout(h4)[0] == e4, f"a broken run is cut in more groups ({len(g4)})")
check(len(h3) <= w.FIRST_READ, f"a 24-layer header ({len(h3)} bytes) fits the first read ({w.FIRST_READ})")
check(zlib.crc32(h3[w.PREFIX_SIZE:]) & 0xFFFFFFFF == struct.unpack_from("<I", h3, 40)[0], "crc32 at byte 40")

# What a hostile publisher might write, at random (seeded: the same cases every run): every header of
# versions 1-3 with one value replaced by another of any JSON type, or one byte of its JSON changed, each with
# its checksum made right again, either is refused with LayoutError or decodes to tensors that all lie inside
# the data, aligned to their element size, each name once. Any other exception is a failure.
def hostile_values(rng, value):
    """Values to put in place of VALUE: of its kind but out of range, and of every other JSON kind."""
    big = rng.choice([2**31, 2**53 + 1, 2**64, 10**30])
    return [-1, 0, 1, big, -big, 0.5, 1e308, True, None, "", "x" * rng.randint(1, 40), [], [big], [-1], {},
            {"a": 1}, [value, value], [[value]]]


def leaves(doc, path=()):
    """Every (path, value) in DOC, containers included."""
    yield path, doc
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from leaves(v, path + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from leaves(v, path + (i,))


def replaced(doc, path, value):
    """A copy of DOC with the value at PATH replaced by VALUE."""
    if not path:
        return value
    out = dict(doc) if isinstance(doc, dict) else list(doc)
    out[path[0]] = replaced(doc[path[0]], path[1:], value)
    return out


def sane(decoded, data_size):
    """Whether decoded entries are what an attach may turn into views of the data."""
    got, _, meta = decoded
    names = [e[0] for e in got]
    return (isinstance(meta, dict) and all(isinstance(n, str) for n in names) and
            len(set(names)) == len(names) and
            all(e[1] in w.ITEMSIZE and e[4] >= 0 and e[4] % w.ITEMSIZE[e[1]] == 0 and
                e[4] + e[5] <= data_size and all(type(d) is int and d >= 0 for d in e[2]) for e in got))


def try_hostile(buf, data_size, lease_size):
    """None if BUF is refused with LayoutError or decodes sanely; else what went wrong."""
    try:
        decoded = w.decode_layout(buf, lease_size)
    except w.LayoutError:
        return None
    except Exception as e:          # noqa: BLE001: any other exception is what this looks for
        return f"{type(e).__name__}: {e}"
    return None if sane(decoded, data_size) else f"decoded to a layout an attach cannot use: {decoded[0]!r:.200}"


rng = random.Random(20261129)
small = [["a", "float32", [4, 2], [2, 1], 0, 32], ["b", "bfloat16", [3], [1], 256, 6],
         ["c", "float32", [4, 2], [2, 1], 512, 32], ["d", "int64", [], [], 768, 8]]
small_size = 776
docs = [(1, {"tensors": small, "metadata": {"m": 1}}),
        (2, {"names": [e[0] for e in small], "dtypes": [e[1] for e in small], "shapes": [e[2] for e in small],
             "offsets": [e[4] for e in small], "nbytes": [e[5] for e in small]}),
        (3, json.loads(w.encode_layout(small, small_size, {"m": 1})[0][w.PREFIX_SIZE:])),
        (3, json.loads(h3[w.PREFIX_SIZE:]))]
bad_cases, cases = [], 0
for version, doc in docs:
    size = s3 if len(doc.get("names", ())) > 10 else small_size
    paths = list(leaves(doc))
    for _ in range(400):
        path, value = rng.choice(paths)
        hdr, off = header_of(replaced(doc, path, rng.choice(hostile_values(rng, value))), version, size)
        for lease in (None, off + size):
            cases += 1
            why = try_hostile(hdr, size, lease)
            if why:
                bad_cases.append(f"v{version} {path}: {why}")
    js = json.dumps(doc, separators=(",", ":")).encode()
    for _ in range(400):
        raw = bytearray(js)
        raw[rng.randrange(len(raw))] = rng.choice(b'0123456789-.eE[]{}",:tfn \\x\xff')
        cases += 1
        why = try_hostile(header_of_raw(bytes(raw), version, size), size, None)
        if why:
            bad_cases.append(f"v{version} byte: {why}")
check(not bad_cases, f"{cases} hostile headers (seeded): refused or decoded inside the data"
      + "".join(f"\n     {b}" for b in bad_cases[:10]))

print(f"\n{'all checks passed' if not failures else f'{failures} checks FAILED'}")
sys.exit(1 if failures else 0)
