# SPDX-License-Identifier: MIT
"""CuPy through the broker: an allocator for cupy.cuda.set_allocator() whose memory is leased.

    import cupy, vmmbroker.cupy

    pool = vmmbroker.cupy.install()        # cupy.cuda.set_allocator(pool.malloc)
    a = cupy.arange(1 << 20)               # memory leased from the broker
    del a
    pool.free_all_blocks()                 # the leases go back to the broker
    vmmbroker.cupy.uninstall()             # CuPy's own default pool again

The design: CuPy's own MemoryPool on top, leases underneath.
cupy.cuda.MemoryPool(allocator=LeaseAllocator(...)) keeps CuPy's caching,
best-fit splitting and per-stream free lists, and asks the LeaseAllocator
only when it has no free block that fits. The LeaseAllocator leases per
allocation: a request of small_size (1 MiB) or more gets a lease of its own;
smaller ones are packed into shared 2 MiB leases (the broker's granularity),
so that many small arrays do not each cost 2 MiB. Each allocation is a
cupy.cuda.MemoryPointer over cupy.cuda.UnownedMemory(ptr, size, owner=...):
the owner holds the lease, and the lease is freed when CuPy drops the last
memory over it (free_all_blocks(), or an out-of-memory retry). Before the
lease is unmapped the device is synchronized, as work queued on it may still
run (the driver's unmap does not wait for it).

An allocation the broker refuses for room (ENOMEM) or quota (EDQUOT) raises
CUDARuntimeError(cudaErrorMemoryAllocation), which makes CuPy's pool free its
cached blocks and try again before raising OutOfMemoryError, as it does for
cudaMalloc. Other broker errors propagate as vmmbroker.Error.

allocator() alone (without the pool) may be given to cupy.cuda.set_allocator()
too: then every CuPy allocation is a broker call, which is correct but slower
for frequently reallocated arrays (tests/gpu/python/cupy_jax.py measures both).
"""

from __future__ import annotations

import errno
import threading
from typing import Any, Dict, Optional

import cupy

__all__ = ["LeaseAllocator", "allocator", "install", "memory_pool", "uninstall"]

SLAB_SIZE = 2 << 20         # the broker's granularity: a lease is a multiple of it
SMALL_SIZE = 1 << 20        # requests below this share slabs
_ALIGN = 512                # CuPy rounds to 512 bytes; keep sub-allocations aligned the same way


class _Holder:
    """Owns one lease; the UnownedMemory objects over it keep it. Frees it, after a sync, when they are gone."""

    __slots__ = ("lease", "device_id", "__weakref__")

    def __init__(self, lease, device_id: int) -> None:
        self.lease = lease
        self.device_id = device_id

    def __del__(self) -> None:
        lease, self.lease = self.lease, None
        if lease is None:
            return
        try:
            # The unmap does not wait for kernels still using the memory.
            with cupy.cuda.Device(self.device_id):
                cupy.cuda.runtime.deviceSynchronize()
        except Exception:
            pass
        try:
            lease.free()
        except Exception:
            pass


class _Slab:
    __slots__ = ("holder", "ptr", "size", "used")

    def __init__(self, holder: _Holder) -> None:
        self.holder = holder
        self.ptr = int(holder.lease.ptr)
        self.size = int(holder.lease.size)
        self.used = 0


class LeaseAllocator:
    """A CuPy allocator (size -> cupy.cuda.MemoryPointer) that leases from the broker.

    client: a vmmbroker Client (default: vmmbroker.connect()). label: the
    leases' label in `vmmctl list`. small_size: requests below it are packed
    into shared SLAB_SIZE leases (0 to give every request a lease of its own).
    The device is CuPy's current device at each call. Thread-safe.
    """

    def __init__(self, client=None, *, label: Optional[str] = "cupy", small_size: int = SMALL_SIZE) -> None:
        if client is None:
            import vmmbroker
            client = vmmbroker.connect()
        self.client = client
        self.label = label
        self.small_size = min(small_size, SLAB_SIZE)
        self._lock = threading.Lock()
        self._slabs: Dict[int, _Slab] = {}
        self.leases = 0             # leases made, for statistics

    def _lease(self, size: int, device_id: int):
        import vmmbroker
        try:
            lease = self.client.alloc(size, device=device_id, label=self.label)
        except vmmbroker.Error as e:
            if e.errno in (errno.ENOMEM, errno.EDQUOT):
                raise cupy.cuda.runtime.CUDARuntimeError(
                    cupy.cuda.runtime.errorMemoryAllocation) from e
            raise
        self.leases += 1
        return _Holder(lease, device_id)

    def __call__(self, size: int) -> "cupy.cuda.MemoryPointer":
        device_id = cupy.cuda.runtime.getDevice()
        if size == 0:
            return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(0, 0, None, device_id), 0)
        if size >= self.small_size:
            holder = self._lease(size, device_id)
            mem = cupy.cuda.UnownedMemory(int(holder.lease.ptr), size, holder, device_id)
            return cupy.cuda.MemoryPointer(mem, 0)
        need = (size + _ALIGN - 1) // _ALIGN * _ALIGN
        with self._lock:
            slab = self._slabs.get(device_id)
            if slab is None or slab.used + need > slab.size:
                slab = self._slabs[device_id] = _Slab(self._lease(SLAB_SIZE, device_id))
            off = slab.used
            slab.used += need
            holder = slab.holder
            ptr = slab.ptr + off
        # The slab's lease is freed when every UnownedMemory over it is gone and the slab is full or replaced.
        mem = cupy.cuda.UnownedMemory(ptr, size, holder, device_id)
        return cupy.cuda.MemoryPointer(mem, 0)

    def release_slabs(self) -> None:
        """Forget the partly used slabs, so that their leases end once CuPy drops what was carved from them."""
        with self._lock:
            self._slabs.clear()


def allocator(client=None, *, label: Optional[str] = "cupy", small_size: int = SMALL_SIZE) -> LeaseAllocator:
    """A LeaseAllocator (leases per allocation); for cupy.cuda.set_allocator() or a MemoryPool."""
    return LeaseAllocator(client, label=label, small_size=small_size)


def memory_pool(client=None, *, label: Optional[str] = "cupy", small_size: int = SMALL_SIZE) -> "cupy.cuda.MemoryPool":
    """cupy.cuda.MemoryPool(allocator=LeaseAllocator(...)): CuPy's pool on top of broker leases.

    The LeaseAllocator lives as long as the pool; its partly used 2 MiB slab
    (one per device) stays leased until then. The pool's .vmmbroker_allocator
    attribute is the LeaseAllocator where CuPy lets us set one.
    """
    alloc = LeaseAllocator(client, label=label, small_size=small_size)
    pool = cupy.cuda.MemoryPool(allocator=alloc)
    try:
        pool.vmmbroker_allocator = alloc
    except AttributeError:      # a cdef class without a __dict__
        pass
    return pool


_installed: Optional[Any] = None
_installed_allocator: Optional[LeaseAllocator] = None


def install(client=None, *, label: Optional[str] = "cupy", pool: bool = True,
            small_size: int = SMALL_SIZE) -> Any:
    """Make CuPy allocate from the broker: cupy.cuda.set_allocator() with a pool as memory_pool() makes (or the
    bare allocator).

    Returns the MemoryPool (or the LeaseAllocator when pool=False). Call
    pool.free_all_blocks() to give the cached leases back, uninstall() to return
    to CuPy's default pool. Arrays allocated before stay valid either way.
    """
    global _installed, _installed_allocator
    alloc = LeaseAllocator(client, label=label, small_size=small_size)
    if pool:
        obj = cupy.cuda.MemoryPool(allocator=alloc)
        cupy.cuda.set_allocator(obj.malloc)
    else:
        obj = alloc
        cupy.cuda.set_allocator(obj)
    _installed, _installed_allocator = obj, alloc
    return obj


def uninstall() -> None:
    """Return CuPy to its default memory pool; frees the installed pool's free blocks."""
    global _installed, _installed_allocator
    cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
    obj, _installed = _installed, None
    alloc, _installed_allocator = _installed_allocator, None
    if obj is not None and hasattr(obj, "free_all_blocks"):
        obj.free_all_blocks()
    if alloc is not None:
        alloc.release_slabs()
