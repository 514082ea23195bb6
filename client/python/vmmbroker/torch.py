# SPDX-License-Identifier: MIT
"""PyTorch through the broker: a MemPool whose segments are leases, and tensors over leases.

    import torch, vmmbroker.torch

    pool = vmmbroker.torch.pool()                 # a torch.cuda.MemPool
    with torch.cuda.use_mem_pool(pool):           # this thread's allocations
        x = torch.empty(1 << 30, device="cuda")   # a segment leased from the broker
    with vmmbroker.torch.use(pool):               # every thread's (autograd's backward too)
        loss = model(batch).sum(); loss.backward()

The pool's allocator is PyTorch's CUDAPluggableAllocator over two C functions
of libvmmbroker, vmmb_torch_alloc() and vmmb_torch_free(): no Python runs when
PyTorch's caching allocator asks for a segment or gives one back, the C side is
thread-safe, and its free does not unmap memory that work queued on the
segment's stream still uses. PyTorch's caching allocator sits on top: a segment
(a lease, a multiple of 2 MiB) is split into blocks and reused by tensors of
the pool as any cudaMalloc segment is.

Giving the segments back. torch.cuda.empty_cache() does NOT release the
segments of a MemPool that is still alive: PyTorch releases a pool's cached
segments only when the pool object is gone. So: drop the tensors allocated in
the pool, `del pool`, then call release() (gc, then empty_cache), and PyTorch
hands every segment of every deleted pool to vmmb_torch_free(). That free does
not block: the library records an event on the segment's stream and frees the
lease once the event has completed, which its next vmmb_torch_alloc() or
vmmb_torch_free() (any thread) notices, or release_all(). It frees it with
vmmb_free_keep(): the broker keeps it, mapped, for the next segment of its
size until another process waits for room, release_all() or sleep(). Segments of tensors
that outlive their pool come back when those tensors die and release() runs
again. release_all() (vmmb_torch_release_all()) is for tearing everything
down: once every pool is gone, it waits for the pending frees and also gives
back segments PyTorch never freed; it must not be called while a pool that
allocated through the library is alive.

Expandable segments cannot be used inside a MemPool (PyTorch refuses them with
a less helpful error at the first allocation): pool() and use() raise
vmmbroker.torch.ExpandableSegmentsError when PYTORCH_CUDA_ALLOC_CONF or
PYTORCH_ALLOC_CONF (or torch._C._accelerator_setAllocatorSettings) turn
expandable_segments on. The native caching allocator is required (not
backend:cudaMallocAsync).

tensor(lease) wraps any lease (or part of one) in a zero-copy torch.Tensor,
through __cuda_array_interface__ so that read-only leases work too (PyTorch
refuses a read-only array interface; the memory itself is mapped read-only by
the library, and writing to it is a fault, so treat such tensors as constant).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import gc
import os
import threading
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

__all__ = [
    "ExpandableSegmentsError",
    "Pool",
    "ReclaimableBuffer",
    "library_path",
    "pool",
    "release",
    "release_all",
    "sleep",
    "tensor",
    "use",
    "wake",
]

ALLOC_SYMBOL = "vmmb_torch_alloc"
FREE_SYMBOL = "vmmb_torch_free"
RELEASE_ALL_SYMBOL = "vmmb_torch_release_all"
SLEEP_SYMBOL = "vmmb_torch_sleep"
WAKE_SYMBOL = "vmmb_torch_wake"


class ExpandableSegmentsError(RuntimeError):
    """PyTorch's allocator settings turn expandable segments on: a MemPool cannot use them."""


# --- finding libvmmbroker -------------------------------------------------------------------

def _loaded_from_maps() -> Optional[str]:
    """The path of the libvmmbroker this process has mapped, if any (Linux /proc/self/maps)."""
    try:
        with open("/proc/self/maps", "r", encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.rstrip("\n").split(None, 5)
                if len(path) == 6 and os.path.basename(path[5]).startswith("libvmmbroker.so"):
                    return path[5]
    except OSError:
        pass
    return None


def library_path() -> str:
    """The libvmmbroker that PyTorch's pluggable allocator loads: the one the vmmbroker package uses.

    In order: the path the core package says it loaded (an attribute of the
    vmmbroker module), the libvmmbroker mapped into this process, then
    $VMMBROKER_LIBRARY, then what ctypes.util.find_library("vmmbroker")
    finds, then the soname libvmmbroker.so.0 (which dlopen resolves).
    """
    try:
        import vmmbroker as _core
    except ImportError:     # pragma: no cover - the package is the parent of this module
        _core = None
    if _core is not None:
        for attr in ("LIBRARY", "LIBRARY_PATH", "library_path", "_library_path", "_LIBRARY_PATH"):
            v = getattr(_core, attr, None)
            if callable(v):
                try:
                    v = v()
                except Exception:
                    v = None
            if isinstance(v, (str, os.PathLike)) and str(v):
                return str(v)
        for attr in ("_lib", "_LIB", "lib", "_libvmmbroker", "_dll"):
            lib = getattr(_core, attr, None)
            name = getattr(lib, "_name", None)
            if isinstance(name, str) and name:
                mapped = _loaded_from_maps()
                return mapped or name
    mapped = _loaded_from_maps()
    if mapped:
        return mapped
    env = os.environ.get("VMMBROKER_LIBRARY")
    if env:
        return env
    found = ctypes.util.find_library("vmmbroker")
    return found or "libvmmbroker.so.0"


_lock = threading.Lock()
_allocator = None           # the torch.cuda.memory.CUDAPluggableAllocator, made once per process
_allocator_path = None


def _pluggable_allocator():
    global _allocator, _allocator_path
    with _lock:
        if _allocator is None:
            path = library_path()
            try:
                lib = ctypes.CDLL(path)
            except OSError as e:
                raise RuntimeError(f"vmmbroker.torch: cannot load libvmmbroker ({path}): {e}; "
                                   "set $VMMBROKER_LIBRARY to the library's path") from e
            for sym in (ALLOC_SYMBOL, FREE_SYMBOL):
                if not hasattr(lib, sym):
                    raise RuntimeError(f"vmmbroker.torch: {path} has no {sym}(): "
                                       "a libvmmbroker older than the PyTorch entry points")
            _allocator = torch.cuda.memory.CUDAPluggableAllocator(path, ALLOC_SYMBOL, FREE_SYMBOL)
            _allocator_path = path
        return _allocator


# --- PyTorch's allocator settings -----------------------------------------------------------

def _settings_strings() -> list:
    out = []
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if get is not None:
        try:
            out.append(("torch._C._accelerator_getAllocatorSettings()", str(get())))
        except Exception:
            pass
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        v = os.environ.get(var)
        if v:
            out.append(("$" + var, v))
    return out


def expandable_segments_on() -> Optional[str]:
    """Where expandable segments are turned on ("$PYTORCH_CUDA_ALLOC_CONF", ...), or None when off.

    PyTorch reads "key:value" pairs separated by commas; the last
    expandable_segments of a string wins.
    """
    for where, s in _settings_strings():
        on = None
        for item in s.split(","):
            key, sep, value = item.partition(":")
            if sep and key.strip() == "expandable_segments":
                on = value.strip().lower() in ("true", "1", "yes")
        if on:
            return where
    return None


def _check_settings() -> None:
    where = expandable_segments_on()
    if where is not None:
        raise ExpandableSegmentsError(
            f"vmmbroker.torch: expandable segments are on ({where} has expandable_segments:True); "
            "a torch.cuda.MemPool with a pluggable allocator cannot use them. "
            "Turn them off (expandable_segments:False) for a process that allocates from the broker.")
    backend = torch.cuda.memory.get_allocator_backend()
    if backend != "native":
        raise RuntimeError(f"vmmbroker.torch: PyTorch's allocator backend is {backend!r}; "
                           "a MemPool needs the native caching allocator (remove backend:cudaMallocAsync)")


# --- the pool -------------------------------------------------------------------------------

def _device_index(device) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    d = torch.device(device)
    if d.type != "cuda":
        raise ValueError(f"vmmbroker.torch: not a CUDA device: {device!r}")
    return d.index if d.index is not None else torch.cuda.current_device()


class Pool(torch.cuda.MemPool):
    """A torch.cuda.MemPool whose segments are leased from the broker; make it with pool().

    Use it with torch.cuda.use_mem_pool(pool) (this thread's allocations) or
    vmmbroker.torch.use(pool) (every thread's, on the pool's device).
    """

    def __init__(self, device_index: int, allocator) -> None:
        # MemPool's C++ side takes the current device as the pool's.
        with torch.cuda.device(device_index):
            super().__init__(allocator.allocator())
        self.device_index = device_index

    def reserved_bytes(self) -> int:
        """Bytes of the pool's segments (leases) that PyTorch holds now."""
        try:
            segments = torch.cuda.memory.memory_snapshot(self.id, include_traces=False)
        except TypeError:   # a PyTorch without include_traces
            segments = torch.cuda.memory.memory_snapshot(self.id)
        return sum(int(s.get("total_size", 0)) for s in segments)

    def __repr__(self) -> str:
        return f"<vmmbroker.torch.Pool id={self.id} device=cuda:{self.device_index}>"


def _new_pool(device=None) -> Pool:
    torch.cuda.init()
    _check_settings()
    return Pool(_device_index(device), _pluggable_allocator())


def pool(device=None) -> Pool:
    """A new torch.cuda.MemPool on DEVICE (default: the current one) whose segments are leases.

    Raises ExpandableSegmentsError when expandable segments are on, RuntimeError
    when libvmmbroker lacks the PyTorch entry points or PyTorch's allocator
    backend is not the native one.
    """
    return _new_pool(device)


@contextlib.contextmanager
def use(pool: Optional[Pool] = None, device=None, all_threads: bool = True) -> Iterator[Pool]:
    """Route allocations on the pool's device to POOL (a new pool() when None) for the block.

    With all_threads (the default), every thread's allocations on that device go
    to the pool, autograd's backward thread included; torch.cuda.use_mem_pool()
    routes only the calling thread's. Cannot be nested with another routing of
    the same pool. Yields the pool.
    """
    if pool is None:
        pool = _new_pool(device)
    _check_settings()
    idx = getattr(pool, "device_index", None)
    if idx is None:
        idx = _device_index(device)
    if not all_threads:
        with torch.cuda.use_mem_pool(pool, device=idx):
            yield pool
        return
    torch._C._cuda_beginAllocateToPool(idx, pool.id)
    try:
        yield pool
    finally:
        torch._C._cuda_endAllocateToPool(idx, pool.id)
        torch._C._cuda_releasePool(idx, pool.id)


def release() -> None:
    """Hand the cached segments of every MemPool that no longer exists to vmmb_torch_free().

    Call after dropping a pool's tensors and the pool itself (`del pool`).
    A pool that is still alive keeps its segments (PyTorch's rule): delete it
    first. Runs the garbage collector first, so that tensors kept only by
    reference cycles are freed. Each lease is freed once the work queued on its
    segment is done (the library notices at its next call, or release_all()),
    and kept for the next segment of its size (see the module's docstring).
    """
    gc.collect()
    torch.cuda.empty_cache()


def _call_int(symbol: str, argtypes: list, *args: Any) -> int:
    """Calls libvmmbroker's `symbol` (the allocator's library) returning int; a negative errno raises
    vmmbroker.Error with the library's message."""
    path = _allocator_path or library_path()
    lib = ctypes.CDLL(path)
    try:
        fn = getattr(lib, symbol)
    except AttributeError:
        k, message = -errno.EOPNOTSUPP, f"libvmmbroker ({path}) has no {symbol}: update it."
    else:
        fn.restype = ctypes.c_int
        fn.argtypes = argtypes
        k = fn(*args)
        if k >= 0:
            return k
        message = os.strerror(-k)
        try:
            msg = lib.vmmb_error_message
            msg.restype = ctypes.c_char_p
            msg.argtypes = []
            m = msg()
            if m:
                message = m.decode("utf-8", "replace")
        except AttributeError:
            pass
    try:
        from vmmbroker import _errors
        raise _errors.error(-k, message)
    except ImportError:
        raise OSError(-k, message) from None


def release_all() -> int:
    """Give back every segment the library still leases for PyTorch (vmmb_torch_release_all()).

    Waits for the frees still pending (their streams' work), then synchronizes
    each device that has segments PyTorch never freed and frees those too.
    Only once every pool made by pool() is gone and nothing uses its memory:
    a live pool's segments would be unmapped under it. Returns the number of
    never-freed segments given back; raises vmmbroker.Error for a negative errno.
    """
    return _call_int(RELEASE_ALL_SYMBOL, [])


# --- sleep and wake -------------------------------------------------------------------------

def sleep(stream: Optional[Any] = None) -> int:
    """Put the broker-backed pools to sleep: park every segment (vmmb_torch_sleep()).

    Each segment that vmmb_torch_alloc() leased and PyTorch still holds, in
    every pool made by pool() (all of them: the library knows segments, not
    pools), is unmapped, its content moved to host memory by the broker and
    its device memory given back for other processes to use, while its
    address stays reserved. Tensors in the pools keep their data pointers;
    until wake(), nothing may touch them: no kernel or copy on them, no
    allocation in a pool and no free of its tensors (PyTorch could hand a
    cached block out again). Frees still waiting for their streams are
    finished first, so that memory goes back to the broker rather than into
    host memory.

    ``stream``: a torch.cuda.Stream (or a CUstream as an int) whose queued
    work may still use the segments, waited for; None waits for all the
    work of each segment's device (its primary context, PyTorch's).

    Returns the number of segments parked (those parked already are passed
    over). Raises vmmbroker.Error after trying every segment when one could
    not be parked: OutOfHostMemory, QuotaExceeded (host bytes),
    PermissionDenied; those parked stay parked until wake().
    """
    handle = getattr(stream, "cuda_stream", stream)
    return _call_int(SLEEP_SYMBOL, [ctypes.c_void_p], handle or None)


def wake() -> int:
    """Wake the pools that sleep() parked: unpark every segment at its address (vmmb_torch_wake()).

    The broker brings each segment's content back into device memory and the
    library maps it where it was, so tensors read exactly what they held
    before sleep(). Returns the number of segments unparked. Raises
    vmmbroker.OutOfMemory (or QuotaExceeded) when the device has no room for
    one now, after trying every segment: those unparked are usable, the
    others stay parked and a later wake() tries them again.
    """
    return _call_int(WAKE_SYMBOL, [])


# --- tensors over leases --------------------------------------------------------------------

class _LeaseMemory:
    """Bytes of a lease as a __cuda_array_interface__ (v3, 1-D uint8) that PyTorch takes without a copy.

    torch.as_tensor() keeps this object alive as long as the tensor's storage
    (its deleter holds the reference). When OWNED, the last reference going
    away synchronizes the device (work queued on the memory must end before it
    is unmapped) and frees the lease.
    """

    __slots__ = ("lease", "ptr", "nbytes", "owned", "torch_device", "__weakref__")

    def __init__(self, lease, offset: int = 0, nbytes: Optional[int] = None, owned: bool = False) -> None:
        size = int(lease.size)
        if nbytes is None:
            nbytes = size - offset
        if offset < 0 or nbytes < 0 or offset + nbytes > size:
            raise ValueError(f"vmmbroker.torch: bytes {offset}..{offset + nbytes} outside the lease's {size}")
        self.lease = lease
        self.ptr = int(lease.ptr) + offset
        self.nbytes = nbytes
        self.owned = owned
        self.torch_device = None

    @property
    def __cuda_array_interface__(self) -> dict:
        # readonly stays False: PyTorch refuses read-only arrays (it has no read-only tensors).
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False),
                "version": 3, "strides": None, "stream": None}

    def close(self) -> None:
        lease, self.lease = self.lease, None
        if lease is None or not self.owned:
            return
        try:
            if self.torch_device is not None:
                torch.cuda.synchronize(self.torch_device)
        except Exception:
            pass
        try:
            lease.free()
        except Exception:
            pass

    def __del__(self) -> None:
        self.close()


def tensor(lease, dtype: Optional[torch.dtype] = None, shape: Optional[Sequence[int]] = None,
           offset: int = 0, *, owned: bool = False) -> torch.Tensor:
    """A torch.Tensor viewing LEASE's memory (from OFFSET bytes), without a copy.

    With no dtype and shape: 1-D uint8 over the rest of the lease. With DTYPE
    (and SHAPE, default 1-D over the rest): a contiguous typed view; OFFSET must
    be a multiple of the dtype's size. The tensor keeps the lease object alive;
    with owned=True the lease is freed (after a device synchronize) when the last
    tensor viewing it is gone, so do not free it yourself. Tensors over a
    read-only lease must not be written (the mapping is read-only: a write faults).
    """
    mem = _LeaseMemory(lease, offset, owned=owned)
    base = torch.as_tensor(mem)
    mem.torch_device = base.device
    if dtype is None and shape is None:
        return base
    if dtype is None:
        dtype = torch.uint8
    itemsize = dtype.itemsize
    if shape is None:
        shape = (mem.nbytes // itemsize,)
    n = 1
    for s in shape:
        n *= int(s)
    if n * itemsize > mem.nbytes:
        raise ValueError(f"vmmbroker.torch: {tuple(shape)} of {dtype} needs {n * itemsize} bytes, "
                         f"{mem.nbytes} left in the lease")
    return base[: n * itemsize].view(dtype).view(tuple(int(s) for s in shape))


# --- memory the broker may ask back ----------------------------------------------------------

_client_lock = threading.Lock()
_shared_client: Any = None


def _client() -> Any:
    """The process's client for ReclaimableBuffer, connected on first use ($VMMBROKER_SOCKET)."""
    global _shared_client
    import vmmbroker
    with _client_lock:
        if _shared_client is None or _shared_client.closed:
            _shared_client = vmmbroker.connect()
        return _shared_client


class ReclaimableBuffer:
    """A tensor on a lease of its own that the broker may ask back, for memory a server can drop (a KV cache).

        def drop_cache(buf):                      # on the library's thread, with the GIL
            engine.evict_all_blocks()             # forget every tensor made from buf.tensor
            return True                           # give it back (False keeps it)

        kv = vmmbroker.torch.ReclaimableBuffer((n_blocks, block_bytes), torch.uint8, priority=10,
                                               on_reclaim=drop_cache)
        cache = kv.tensor                         # use it as any tensor ...
        if kv.reclaimed: ...                      # ... until the broker took it back

    The lease is marked reclaimable (Lease.set_reclaimable()): when another
    process waits for room on the device (an alloc with ``wait``), the broker
    asks the holders of reclaimable leases, lowest ``priority`` first. Then
    ``on_reclaim(buffer)`` runs on the library's watch thread: drop every
    reference to the tensor and to views of it, and return True (or None) to
    give the memory back, False to keep it (the buffer is then no longer
    reclaimable; mark_reclaimable() offers it again). Given back, the library
    waits for the work queued on the device's primary context (PyTorch's),
    unmaps the memory and frees the lease: ``reclaimed`` is True and
    ``tensor`` raises vmmbroker.Error ESTALE. A tensor made from it before
    and kept anyway points at unmapped memory: a kernel reading it faults,
    which ends the process's CUDA context. An exception in ``on_reclaim``
    keeps the memory (and is logged on the "vmmbroker" logger).

    ``on_reclaim`` must not allocate or free ReclaimableBuffers nor call
    other methods of the client they share (``client``, by default one client
    for the process): the library's thread is busy with the request. Without
    ``on_reclaim`` the memory is given back without asking; ``reclaimed``
    tells the program. free() (or the end of a ``with`` block) gives it back
    on the program's own terms, after synchronizing the device.
    """

    def __init__(self, shape: Sequence[int], dtype: torch.dtype = torch.uint8, device: Any = None, *,
                 priority: int = 0, on_reclaim: Optional[Callable[["ReclaimableBuffer"], Optional[bool]]] = None,
                 client: Any = None, label: str = "torch-reclaimable") -> None:
        shape = tuple(int(s) for s in shape)
        n = 1
        for s in shape:
            n *= s
        nbytes = n * dtype.itemsize
        if nbytes <= 0:
            raise ValueError(f"vmmbroker.torch: a ReclaimableBuffer of shape {shape} holds no bytes")
        if on_reclaim is not None and not callable(on_reclaim):
            raise TypeError(f"on_reclaim must be callable, not {type(on_reclaim).__name__}")
        self._on_reclaim = on_reclaim
        self._client = client if client is not None else _client()
        self._lease = self._client.alloc(nbytes, device=_device_index(device), label=label)
        try:
            self._tensor: Optional[torch.Tensor] = tensor(self._lease, dtype, shape)
            self.mark_reclaimable(priority)
        except BaseException:
            self._tensor = None
            self._lease.free()
            raise

    @property
    def lease(self) -> Any:
        """The vmmbroker.Lease under the tensor."""
        return self._lease

    @property
    def reclaimed(self) -> bool:
        """Whether the broker took the memory back (the tensor must not be used any more)."""
        return self._lease.reclaimed

    @property
    def tensor(self) -> torch.Tensor:
        """The tensor over the whole buffer; vmmbroker.Error ESTALE once reclaimed, ValueError once freed."""
        t = self._tensor
        if t is None or self._lease.reclaimed:
            if self._lease.freed:
                raise ValueError(f"vmmbroker.torch: the buffer on lease {self._lease.id} is freed")
            raise self._lease._stale()
        return t

    def mark_reclaimable(self, priority: Optional[int] = 0) -> None:
        """Offer the buffer to the broker with ``priority`` (lower is asked first), or stop (None)."""
        if priority is None:
            self._lease.set_reclaimable(None)
            return
        ref = weakref.ref(self)         # the lease keeps the callback: no cycle back to the buffer

        def callback(_lease: Any) -> bool:
            buf = ref()
            if buf is None:
                return True
            give = True
            if buf._on_reclaim is not None:
                give = buf._on_reclaim(buf) is not False
            if give:
                buf._tensor = None
            return give
        self._lease.set_reclaimable(priority, callback)

    def free(self) -> None:
        """Give the memory back now (after synchronizing the device); idempotent."""
        if self._lease.freed:
            return
        if self._tensor is not None:
            self._tensor = None
            if not self._lease.reclaimed:
                torch.cuda.synchronize(self._lease.device)
        self._lease.free()

    def __enter__(self) -> "ReclaimableBuffer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.free()

    def __repr__(self) -> str:
        state = " reclaimed" if self.reclaimed else (" freed" if self._lease.freed else "")
        return f"<vmmbroker.torch.ReclaimableBuffer on lease {self._lease.id}{state}>"


def _stats() -> Any:   # pragma: no cover - a debugging aid
    return {"library": _allocator_path, "expandable_segments": expandable_segments_on()}
