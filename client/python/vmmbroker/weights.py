# SPDX-License-Identifier: MIT
"""A GPU-resident weight store: a state dict kept in one published lease, attached by name without a copy.

    import vmmbroker, vmmbroker.weights as w

    client = vmmbroker.connect()
    w.publish_state_dict(client, "gpt2-medium", model.state_dict())   # the producer may exit now

    # later, in any process of an allowed user:
    sd = w.attach_state_dict(client, "gpt2-medium")                   # 1-2 ms for GPT-2 medium
    with torch.device("meta"):
        model = Model(config)
    model.load_state_dict(sd, assign=True)                            # the parameters view the lease

The tensors are copied into ONE lease, each at an offset aligned to 256 bytes,
and a layout header is written at the start of the lease's device memory, so
that the lease is all a consumer needs: nothing on disk, no side channel. The
lease is published under the name (vmmbroker's Lease.publish()), so it
outlives the producer; vmmbroker's Client.unpublish(name) ends it once no
process holds it.

Layout of the lease (version 3; little-endian):

    offset 0   magic          8 bytes  b"VMMBWTS\\0"
           8   version        u32      3 (this version also reads 1 and 2)
          12   prefix size    u32      64 (bytes before the JSON)
          16   json size      u64      bytes of the JSON that follows the prefix (at most MAX_JSON, 64 MiB)
          24   data offset    u64      where the tensor data starts (aligned)
          32   data size      u64      bytes of tensor data after the data offset
          40   json crc32     u32      zlib.crc32 of the JSON bytes
          44   zero padding to 64
          64   JSON (UTF-8):  {"names": [...], "groups": [[...], ...], "metadata": {...}}
                names: every tensor's name, in the state dict's order.
                groups: every tensor in exactly one group; a group is
                    [dtype, shape, offset, step, count, first, index step]:
                    COUNT tensors of one dtype and shape, the k-th at byte
                    OFFSET + k * STEP of the data, named names[FIRST + k * INDEX STEP].
                offsets are relative to the data offset and, like the steps,
                multiples of the dtype's size; dtype is PyTorch's name
                ("bfloat16", "float32", ...); every tensor is stored
                contiguous; tensors that shared memory in the producer's
                state dict (tied weights) share it here too.

A model repeats its layers, so a state dict's tensors fall into few groups
(GPT-2 medium's 293 into 17: one per parameter of a block, 24 blocks each,
and five of their own): attach makes one strided view per group and splits it
with one unbind(), instead of one view per tensor made from Python, and
parses a JSON of 17 small arrays and the names.

Version 2 kept one array per field ("names", "dtypes", "shapes", "offsets",
"nbytes"), version 1 one array per tensor ([name, dtype, shape, stride,
offset, nbytes]) under "tensors"; stores published by them are still read
(each tensor a group of one).

The layout functions (plan_layout, encode_layout, decode_prefix, decode_layout)
are plain Python, usable and tested without PyTorch.
"""

from __future__ import annotations

import ctypes
import gc
import json
import operator
import struct
import threading
import time
import zlib
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

# PyTorch and the package's glue for it (vmmbroker.torch) are imported with this module, as any module's
# dependencies are, and not by the first publish or attach: importing vmmbroker.torch there was most of a new
# process's first attach_state_dict() (see docs/performance.md). Without a PyTorch that vmmbroker.torch can
# use, the layout functions still work; publish_state_dict() and attach_state_dict() raise ImportError naming
# why (_need_torch()).
try:
    import torch
except ImportError as _e:
    torch = None
    _vt = None
    _torch_missing = f"{type(_e).__name__}: {_e}"
else:
    try:
        from . import torch as _vt
        _torch_missing = ""
    except Exception as _e:     # a PyTorch vmmbroker.torch cannot use (one without torch.cuda.MemPool, say)
        _vt = None
        _torch_missing = f"vmmbroker.torch: {type(_e).__name__}: {_e}"

__all__ = [
    "ALIGN",
    "FORMAT_VERSION",
    "MAGIC",
    "LayoutError",
    "StateDict",
    "attach_state_dict",
    "decode_layout",
    "decode_prefix",
    "encode_layout",
    "plan_layout",
    "publish_state_dict",
    "read_layout",
]

MAGIC = b"VMMBWTS\0"
FORMAT_VERSION = 3
READ_VERSIONS = (1, 2, 3)
PREFIX_SIZE = 64
ALIGN = 256
_PREFIX = struct.Struct("<8sIIQQQI")     # magic, version, prefix size, json size, data offset, data size, crc
FIRST_READ = 64 * 1024                  # bytes read back at attach before parsing: most headers fit (GPT-2
                                        # medium's is 21 KiB; a copy of 64 KiB costs what one of 16 KiB does)
#: The most bytes of JSON a header may have, written or read: about 70 bytes a tensor, so room for hundreds
#: of thousands of tensors; past it, whoever published the store cannot make an attach copy and parse more.
MAX_JSON = 64 * 1024 * 1024

# Element sizes of the dtypes a header may name (PyTorch's names), for checking without PyTorch.
ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2,
    "int32": 4, "uint32": 4, "float32": 4, "complex32": 4,
    "int64": 8, "uint64": 8, "float64": 8, "complex64": 8,
    "complex128": 16,
}


#: Where the last attach_state_dict() in this process spent its time (nanoseconds): the broker's attach
#: and mapping, wrapping the lease in a tensor, reading the header back (copy_ns + parse_ns), making the
#: views; and how many tensors.
last_timings: Dict[str, int] = {}


class LayoutError(ValueError):
    """The lease's memory does not hold a weight-store layout this version reads."""


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def contiguous_stride(shape: Sequence[int]) -> List[int]:
    """The strides, in elements, of a C-contiguous tensor of SHAPE (a size-0 dimension counts as 1)."""
    stride = [1] * len(shape)
    acc = 1
    for i in range(len(shape) - 1, -1, -1):
        stride[i] = acc
        acc *= max(int(shape[i]), 1)
    return stride


def _nbytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes of a contiguous tensor of DTYPE (a key of ITEMSIZE) and SHAPE."""
    n = ITEMSIZE[dtype]
    for s in shape:
        n *= s
    return n


def plan_layout(specs: Iterable[Tuple[str, str, Sequence[int], Optional[str]]],
                align: int = ALIGN) -> Tuple[List[list], int]:
    """Offsets for tensors laid out back to back, each aligned to ALIGN bytes.

    specs: (name, dtype name, shape, alias) in order; alias is None, or the name
    of an earlier spec whose memory this one shares (same dtype and shape).
    Returns (entries, data size): entries are [name, dtype, shape, stride,
    offset, nbytes] as decode_layout() returns them (the version 3 JSON keeps
    groups of them: group_entries()), offsets relative to the data offset.
    """
    if align <= 0 or align & (align - 1):
        raise ValueError(f"alignment {align} is not a power of two")
    entries: List[list] = []
    by_name: Dict[str, list] = {}
    end = 0
    for name, dtype, shape, alias in specs:
        if not isinstance(name, str):
            raise TypeError(f"state dict key {name!r} is not a string")
        if name in by_name:
            raise ValueError(f"duplicate tensor name {name!r}")
        if dtype not in ITEMSIZE:
            raise ValueError(f"{name}: dtype {dtype!r} cannot be stored")
        shape = [int(s) for s in shape]
        if any(s < 0 for s in shape):
            raise ValueError(f"{name}: negative dimension in {shape}")
        nbytes = _nbytes(dtype, shape)
        if alias is not None:
            src = by_name.get(alias)
            if src is None or src[4] < 0:
                raise ValueError(f"{name}: alias of {alias!r}, which comes later or is missing")
            if src[1] != dtype or src[5] < nbytes:
                raise ValueError(f"{name}: alias of {alias!r} with another dtype or a larger size")
            offset = src[4]
        else:
            offset = _align(end, align)
            end = offset + nbytes
        e = [name, dtype, shape, contiguous_stride(shape), offset, nbytes]
        entries.append(e)
        by_name[name] = e
    return entries, end


def _template(name: str) -> str:
    """NAME with its all-digit components (a ModuleList's indices) replaced: the key that finds a layer's peers."""
    return ".".join("#" if part.isdigit() else part for part in name.split("."))


def group_entries(entries: Sequence[Sequence[Any]]) -> List[list]:
    """Groups of plan_layout()'s entries, as the version 3 header keeps them (see the module's docstring).

    Tensors of one dtype and shape whose names differ only in all-digit
    components ("h.0.attn.weight", "h.1.attn.weight", ...) are taken in the
    state dict's order and cut into runs where both the index and the offset
    advance by the same steps; every other tensor is a group of one. Any
    grouping is a valid layout: this one only makes the groups few.
    """
    peers: Dict[tuple, List[int]] = {}
    for i, e in enumerate(entries):
        peers.setdefault((e[1], tuple(e[2]), _template(e[0])), []).append(i)
    groups: List[list] = []
    for (dtype, shape, _), idx in peers.items():
        size = ITEMSIZE[dtype]
        k = 0
        while k < len(idx):
            first = idx[k]
            offset = entries[first][4]
            count, istep, step = 1, 1, 0
            if k + 1 < len(idx):
                istep = idx[k + 1] - first
                step = entries[idx[k + 1]][4] - offset
                if step >= 0 and step % size == 0:
                    count = 2
                    while (k + count < len(idx) and idx[k + count] == first + count * istep and
                           entries[idx[k + count]][4] == offset + count * step):
                        count += 1
            if count == 1:
                istep, step = 1, 0
            groups.append([dtype, list(shape), offset, step, count, first, istep])
            k += count
    groups.sort(key=operator.itemgetter(5))
    return groups


def encode_layout(entries: List[list], data_size: int, metadata: Optional[Mapping[str, Any]] = None,
                  align: int = ALIGN) -> Tuple[bytes, int]:
    """The header bytes (prefix + JSON) and the data offset they imply (the header's end, aligned).

    entries are plan_layout()'s; each must have its shape's contiguous strides
    (the store keeps every tensor contiguous), else ValueError.
    """
    for e in entries:
        if list(e[3]) != contiguous_stride(e[2]):
            raise ValueError(f"{e[0]}: strides {list(e[3])} are not the contiguous ones of shape {list(e[2])}")
    doc = {"names": [e[0] for e in entries], "groups": group_entries(entries), "metadata": dict(metadata or {})}
    js = json.dumps(doc, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")
    if len(js) > MAX_JSON:
        raise ValueError(f"the layout's JSON is {len(js)} bytes, more than the {MAX_JSON} an attach reads "
                         f"(vmmbroker.weights.MAX_JSON): fewer tensors, or less metadata")
    data_offset = _align(PREFIX_SIZE + len(js), align)
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, PREFIX_SIZE, len(js), data_offset, data_size,
                          zlib.crc32(js) & 0xFFFFFFFF)
    return prefix + b"\0" * (PREFIX_SIZE - len(prefix)) + js, data_offset


def _prefix(buf: bytes) -> Tuple[int, int, int, int, int]:
    """(version, json size, data offset, data size, crc32) from the first PREFIX_SIZE bytes."""
    if len(buf) < PREFIX_SIZE:
        raise LayoutError("too short for a weight-store header")
    magic, version, prefix_size, js, data_offset, data_size, crc = _PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise LayoutError("not a vmmbroker weight store (bad magic)")
    if version not in READ_VERSIONS:
        raise LayoutError(f"weight-store layout version {version}; this vmmbroker reads "
                          f"{', '.join(map(str, READ_VERSIONS))}")
    if prefix_size != PREFIX_SIZE or data_offset < PREFIX_SIZE + js:
        raise LayoutError("corrupt weight-store header (sizes)")
    if js > MAX_JSON:
        raise LayoutError(f"weight-store header of {js} bytes of JSON, more than the {MAX_JSON} this vmmbroker "
                          f"reads")
    return version, js, data_offset, data_size, crc


def decode_prefix(buf: bytes) -> Tuple[int, int, int, int]:
    """(json size, data offset, data size, crc32) from the first PREFIX_SIZE bytes; LayoutError if not a layout."""
    return _prefix(buf)[1:]


def _is_count(x: Any) -> bool:
    """A JSON integer >= 0 (not a bool, not a float)."""
    return type(x) is int and x >= 0


def _older_groups(doc: Dict[str, Any], version: int) -> Tuple[list, list]:
    """(names, groups) of a version 1 or 2 header: each tensor a group of one."""
    if version == 1:
        t = doc["tensors"]
        names, dtypes, shapes = [e[0] for e in t], [e[1] for e in t], [e[2] for e in t]
        offsets = [e[4] for e in t]
    else:
        names, dtypes, shapes, offsets = doc["names"], doc["dtypes"], doc["shapes"], doc["offsets"]
    if not (len(dtypes) == len(shapes) == len(offsets) == len(names)):
        raise LayoutError("corrupt weight-store header (arrays of different lengths)")
    return names, [[d, s, o, 0, 1, i, 1] for i, (d, s, o) in enumerate(zip(dtypes, shapes, offsets))]


def _parse(buf: bytes, lease_size: Optional[int]) -> Tuple[list, list, int, Dict[str, Any]]:
    """(names, groups, data offset, metadata) of a header of any version read, checked: every group's
    fields of the right types, every dtype known, every tensor inside the data and aligned to its element
    size, every name in exactly one group, the data inside the lease."""
    version, js, data_offset, data_size, crc = _prefix(buf)
    if len(buf) < PREFIX_SIZE + js:
        raise LayoutError(f"header needs {PREFIX_SIZE + js} bytes, {len(buf)} given")
    if lease_size is not None and data_offset + data_size > lease_size:
        raise LayoutError(f"layout needs {data_offset + data_size} bytes, the lease has {lease_size}")
    raw = memoryview(buf)[PREFIX_SIZE:PREFIX_SIZE + js]
    if zlib.crc32(raw) & 0xFFFFFFFF != crc:
        raise LayoutError("corrupt weight-store header (checksum)")
    try:
        doc = json.loads(str(raw, "utf-8"))
        if version < 3:
            names, groups = _older_groups(doc, version)
        else:
            names, groups = doc["names"], doc["groups"]
        metadata = doc.get("metadata", {})
        if not isinstance(metadata, dict):
            raise LayoutError("corrupt weight-store header (metadata is not an object)")
        if not isinstance(names, list) or not isinstance(groups, list):
            raise LayoutError("corrupt weight-store header (names or groups not an array)")
        n = len(names)
        seen = bytearray(n)
        for g in groups:
            if not isinstance(g, list) or len(g) != 7:
                raise LayoutError(f"corrupt weight-store header (a group is not 7 fields: {g!r:.80})")
            dtype, shape, offset, step, count, first, istep = g
            size = ITEMSIZE.get(dtype) if isinstance(dtype, str) else None
            label = names[first] if _is_count(first) and first < n else f"group at {first!r:.20}"
            if size is None:
                raise LayoutError(f"{label}: unknown dtype {dtype!r}")
            if not (isinstance(shape, list) and all(map(_is_count, shape))):
                raise LayoutError(f"{label}: shape {shape!r:.80} is not a list of sizes")
            if not (_is_count(offset) and _is_count(step) and _is_count(count) and count > 0 and
                    _is_count(first) and _is_count(istep) and istep > 0):
                raise LayoutError(f"{label}: a group's offset, step, count or indices are not sizes "
                                  f"({[offset, step, count, first, istep]!r:.80})")
            stop = first + (count - 1) * istep + 1
            if stop > n:
                raise LayoutError(f"{label}: a group of {count} from index {first} by {istep} "
                                  f"past the {n} names")
            end = offset + (count - 1) * step + _nbytes(dtype, shape)
            if end > data_size:
                raise LayoutError(f"{label}: bytes {offset}..{end} outside the data ({data_size})")
            if (data_offset + offset) % size or step % size:
                raise LayoutError(f"{label}: offset {offset} (step {step}) is not a multiple of "
                                  f"{dtype}'s {size} bytes")
            if any(seen[first:stop:istep]):
                i = next(i for i in range(first, stop, istep) if seen[i])
                raise LayoutError(f"{names[i]}: in two groups")
            seen[first:stop:istep] = b"\1" * count
        if n and min(seen) == 0:
            raise LayoutError(f"{names[seen.index(0)]}: in no group")
        if len(set(names)) != n or set(map(type, names)) - {str}:
            raise LayoutError("corrupt weight-store header (names not distinct strings)")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError) as e:
        if isinstance(e, LayoutError):
            raise
        raise LayoutError(f"corrupt weight-store header (JSON: {type(e).__name__}: {e})") from None
    return names, groups, data_offset, metadata


def decode_layout(buf: bytes, lease_size: Optional[int] = None) -> Tuple[List[list], int, Dict[str, Any]]:
    """(entries, data offset, metadata) from the header bytes (at least prefix + JSON), of any version read.

    entries are [name, dtype, shape, stride, offset, nbytes] in the state
    dict's order, as plan_layout() makes them.
    """
    names, groups, data_offset, metadata = _parse(buf, lease_size)
    entries: List[Any] = [None] * len(names)
    for dtype, shape, offset, step, count, first, istep in groups:
        nbytes = _nbytes(dtype, shape)
        stride = contiguous_stride(shape)
        for k in range(count):
            i = first + k * istep
            entries[i] = [names[i], dtype, list(shape), list(stride), offset + k * step, nbytes]
    return entries, data_offset, metadata


# --- PyTorch --------------------------------------------------------------------------------

class StateDict(dict):
    """The tensors attach_state_dict() returned, by name, plus the lease they view.

    A plain dict for load_state_dict(). The tensors (and what is built on
    them: nn.Parameters after load_state_dict(..., assign=True)) keep the
    lease: it is freed, after a device synchronize, when the last of them is
    gone. close() frees it at once: only when no tensor of it is used any more.
    """

    lease: Any
    metadata: Dict[str, Any]
    _memory: Any

    def close(self) -> None:
        """Empty the dict and free the lease now (after a synchronize of its device), not when the last
        tensor goes: call it only once no tensor of it, nor a parameter built on one, is used any more,
        since their memory is unmapped."""
        self.clear()
        mem, self._memory = getattr(self, "_memory", None), None
        self.lease = None
        if mem is not None:
            mem.close()


def _need_torch(what: str):
    """vmmbroker.torch, or ImportError saying that WHAT needs PyTorch and why it could not be imported."""
    if _vt is None:
        raise ImportError(f"vmmbroker.weights.{what}() needs PyTorch, which could not be imported "
                          f"({_torch_missing}); install it (pip install torch) for the Python that runs this, "
                          "a version with torch.cuda.MemPool")
    return _vt


def _dtype_name(dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def publish_state_dict(client, name: str, state_dict: Mapping[str, Any], uids: Sequence[int] = (),
                       readonly: bool = True, *, metadata: Optional[Mapping[str, Any]] = None,
                       device: Optional[int] = None, label: Optional[str] = None, align: int = ALIGN):
    """Copy STATE_DICT's tensors into one new lease, write the layout, publish it as NAME; return the Lease.

    uids, readonly: as Lease.publish() (other users allowed to attach; read-only
    holds through the name). metadata: JSON-able data kept in the header (a
    model config, a revision), returned by attach_state_dict() as .metadata.
    device: as Client.alloc() (None: the broker places it). Tensors may be on
    any device (CPU ones are copied up). Tensors that share memory (tied
    weights) are stored once and come back sharing it. The producer may free
    the returned lease or exit: the name keeps the memory until
    Client.unpublish(name). On failure the new lease is freed and nothing is
    published. ValueError, before anything is leased, when the names and
    metadata make more than MAX_JSON (64 MiB) of JSON, which no attach reads.
    """
    vt = _need_torch("publish_state_dict")
    specs = []
    sources = []            # (entry index, tensor) of the tensors to copy
    seen: Dict[tuple, str] = {}
    for key, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{key}: not a tensor ({type(t).__name__})")
        t = t.detach()
        if t.is_meta:
            raise ValueError(f"{key}: a meta tensor has no data to store")
        dtype = _dtype_name(t.dtype)
        alias = None
        if t.is_contiguous() and t.numel() > 0:
            ident = (t.device, t.data_ptr(), t.dtype, tuple(t.shape))
            alias = seen.get(ident)
            if alias is None:
                seen[ident] = key
        specs.append((key, dtype, tuple(t.shape), alias))
        if alias is None:
            sources.append((len(specs) - 1, t))
    entries, data_size = plan_layout(specs, align)
    header, data_offset = encode_layout(entries, data_size, metadata, align)

    lease = client.alloc(data_offset + data_size, device=device, label=label or f"weights:{name}"[:128])
    try:
        base = vt.tensor(lease)
        for i, t in sources:
            e = entries[i]
            if e[5]:
                dst = base[data_offset + e[4]: data_offset + e[4] + e[5]]
                dst.copy_(t.reshape(-1).view(torch.uint8), non_blocking=False)
        # the header last, so that a half-written store never has a valid magic
        base[: len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        torch.cuda.synchronize(base.device)
        del base
        lease.publish(name, uids=tuple(uids), readonly=readonly)
    except BaseException:
        try:
            lease.free()
        except Exception:
            pass
        raise
    return lease


_cuda = None
_copy_lock = threading.Lock()
_copy_buf = bytearray()          # the host buffer the header is copied into, kept for the next attach


def _device_bytes(base, start: int, n: int) -> bytes:
    """N bytes of BASE's device memory from START: one cuMemcpyDtoH straight into a host buffer.

    A tensor's .cpu() goes through PyTorch's copy machinery and a temporary tensor (about 0.5 ms each
    time, measured on an H100); the driver's synchronous copy of a few KiB takes microseconds. The host
    buffer is kept for the next call: a fresh 64 KiB one cost 47 us on the H100 machine (its pages are
    touched anew). Falls back to .cpu() when libcuda cannot be loaded.
    """
    with _copy_lock:
        view = _device_view(base, start, n)
        try:
            return bytes(view)
        finally:
            view.release()


def _device_view(base, start: int, n: int, lease=None) -> memoryview:
    """_device_bytes() without the copy out: a view of the kept host buffer, which the caller must hold
    _copy_lock for and release() before the buffer is used again. With LEASE (BASE's), the copy is the
    library's (vmmb_lease_read(): its driver is loaded already; loading libcuda here costs some 45 us a
    process, measured on an H200)."""
    global _cuda, _copy_buf
    if len(_copy_buf) < n:
        _copy_buf = bytearray(max(n, FIRST_READ))
    if lease is not None:
        view = memoryview(_copy_buf)[:n]
        try:
            lease.readinto(view, start)
        except BaseException:
            view.release()
            raise
        return view
    if _cuda is None:
        try:
            _cuda = ctypes.CDLL("libcuda.so.1")
            _cuda.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
            _cuda.cuMemcpyDtoH_v2.restype = ctypes.c_int
        except (OSError, AttributeError):
            _cuda = False
    if _cuda:
        # a c_char over the first byte, not a (c_char * n) array: making an array type costs tens of us
        dst = ctypes.c_char.from_buffer(_copy_buf)
        ok = _cuda.cuMemcpyDtoH_v2(ctypes.addressof(dst), base.data_ptr() + start, n) == 0
        del dst                 # the buffer may be resized only once no ctypes view holds it
        if ok:
            return memoryview(_copy_buf)[:n]
    return memoryview(base[start:start + n].cpu().numpy().tobytes())


def _read_header(base, lease=None) -> bytes:
    """The header bytes of BASE (prefix and JSON, no more), a 1-D uint8 CUDA tensor over a whole lease: one
    small copy, two if the header is larger than FIRST_READ. With LEASE (BASE's), read through the library
    (Lease.readinto()) rather than the driver loaded here."""
    size = base.shape[0]
    first = min(size, FIRST_READ)
    with _copy_lock:
        view = _device_view(base, 0, first, lease)
        try:
            need = PREFIX_SIZE + _prefix(view)[1]
            if need <= first:
                return bytes(view[:need])
            head = bytes(view)
        finally:
            view.release()
        if need > size:
            raise LayoutError(f"header of {need} bytes in a lease of {size}")
        view = _device_view(base, first, need - first, lease)
        try:
            return head + bytes(view)
        finally:
            view.release()


def read_layout(base) -> Tuple[List[list], int, Dict[str, Any]]:
    """Read the layout from BASE, a 1-D uint8 CUDA tensor over a whole lease (one small copy, two if large)."""
    return decode_layout(_read_header(base), base.shape[0])


def attach_state_dict(client, name: str, readonly: bool = True) -> StateDict:
    """Attach the weight store published as NAME ("NAME" or "OWNER/NAME") and return its tensors, no copy.

    One attach, one small device-to-host copy of the header, then one strided
    view per group of the layout, split into its tensors. The tensors live on
    the lease's device; with readonly (the default) the memory is mapped
    read-only: fine for inference and load_state_dict(..., assign=True), a
    fault if written. They keep the lease
    (see StateDict). Raises vmmbroker.Error from the broker, LayoutError when
    the lease holds no weight store (or a corrupt one); on any error the hold
    taken is freed. Python's cyclic garbage collector is paused for the call
    (it would otherwise run over the whole heap while the views are made) and
    restored as it was.
    """
    vt = _need_torch("attach_state_dict")
    clock = time.perf_counter_ns
    collecting = gc.isenabled()
    gc.disable()
    try:
        t0 = clock()
        lease = client.attach(name=name, readonly=readonly)
        t1 = clock()
        try:
            mem = vt._LeaseMemory(lease, owned=True)
        except BaseException:
            lease.free()
            raise
        try:
            base = torch.as_tensor(mem)
            mem.torch_device = base.device
            t2 = clock()
            header = _read_header(base, lease)
            t2h = clock()
            names, groups, data_offset, metadata = _parse(header, base.shape[0])
            t3 = clock()
            out = _views(base, names, groups, data_offset)
        except BaseException:
            mem.close()
            raise
        out.lease = lease
        out.metadata = metadata
        out._memory = mem
        t4 = clock()
    finally:
        if collecting:
            gc.enable()
    last_timings.update(attach_ns=t1 - t0, wrap_ns=t2 - t1, header_ns=t3 - t2, views_ns=t4 - t3,
                        copy_ns=t2h - t2, parse_ns=t3 - t2h,
                        tensors=len(names))
    return out


def _views(base, names: list, groups: list, data_offset: int) -> StateDict:
    """The tensors of a checked layout as views of BASE, in the names' order: one as_strided view per group,
    split by unbind() when it holds more than one tensor (one call into PyTorch per group, not per tensor)."""
    tensors: List[Any] = [None] * len(names)
    typed: Dict[str, Any] = {}          # dtype name -> BASE viewed as it
    for dtype, shape, offset, step, count, first, istep in groups:
        t = typed.get(dtype)
        if t is None:
            t = typed[dtype] = base.view(getattr(torch, dtype))
        size = ITEMSIZE[dtype]
        stride = contiguous_stride(shape)
        start = (data_offset + offset) // size
        try:
            if count == 1:
                tensors[first] = t.as_strided(shape, stride, start)
            else:
                stacked = t.as_strided([count] + shape, [step // size] + stride, start)
                tensors[first:first + (count - 1) * istep + 1:istep] = stacked.unbind(0)
        except (RuntimeError, TypeError, ValueError) as e:
            raise LayoutError(f"{names[first]}: {count} x {dtype}{list(shape)} at offset {offset} does not fit "
                              f"the lease: {e}") from None
    out = StateDict(zip(names, tensors))
    return out
