# SPDX-License-Identifier: MIT
"""Client, Lease and LeaseView: libvmmbroker's objects, in Python."""

from __future__ import annotations

import atexit
import ctypes
import errno
import logging
import math
import os
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Optional, Sequence

from . import _dlpack, _lib, _varlink
from ._dtypes import DType, dtype as _dtype
from ._errors import error

__all__ = ["connect", "Client", "Lease", "LeaseView"]

# Set when the interpreter exits: from then on, a hold whose free was put off (a DLPack tensor still alive)
# is left to the process's exit, which ends it anyway, instead of calling into the library during teardown.
_exiting = False
_clients: "weakref.WeakSet[Client]" = weakref.WeakSet()
# Failures of reclaim callbacks go here (they cannot be raised: the callback runs on the library's thread).
_log = logging.getLogger("vmmbroker")
# .lease: the Lease whose reclaim callback this thread (the library's watch thread) runs now, if any.
_tls = threading.local()

#: The highest reclaim priority (INT_MAX).
MAX_PRIORITY = (1 << 31) - 1


def _reclaiming_now() -> "Optional[Lease]":
    return getattr(_tls, "lease", None)


def _fail(rc: int) -> None:
    raise error(rc, _lib.error_message())


def _encode(s: str, what: str) -> bytes:
    if not isinstance(s, str):
        raise TypeError(f"{what} must be a str, not {type(s).__name__}")
    return s.encode("utf-8")


def _socket_path(socket_path: Optional[str]) -> str:
    if socket_path is not None:
        return socket_path
    return os.environ.get("VMMBROKER_SOCKET") or _lib.DEFAULT_SOCKET


def connect(socket_path: Optional[str] = None) -> "Client":
    """Connect to the broker and return a Client (vmmb_connect()).

    ``socket_path`` is the broker's socket; with None, $VMMBROKER_SOCKET when it
    is set and not empty, else /run/vmmbroker/io.vmmbroker. Loads the CUDA
    driver (libcuda.so.1, or $VMMBROKER_LIBCUDA) the first time in the process.
    Connecting does not wait for a broker; a call that finds none waits up to
    $VMMBROKER_RECONNECT_TIMEOUT seconds (30) for one to come back.

    Raises Error: NotFound (ENOENT) or ECONNREFUSED when no broker listens
    there, ENODEV when the CUDA driver cannot be loaded, EINVAL for an empty
    path or a bad $VMMBROKER_RECONNECT_TIMEOUT or $VMMBROKER_REPLY_SPIN_USEC,
    ENAMETOOLONG, PermissionDenied (EACCES) when the caller may not connect.
    Raises ImportError, at the process's first call into the library, when
    libvmmbroker cannot be loaded or lacks a function this package uses (a
    library older than LIBVMMBROKER_0.7, or not libvmmbroker).
    """
    path = None if socket_path is None else _encode(socket_path, "socket_path")
    handle = ctypes.c_void_p()
    rc = _lib.lib().vmmb_connect(path, ctypes.byref(handle))
    if rc < 0:
        _fail(rc)
    return Client(handle, _socket_path(socket_path))


class Client:
    """A connection to the broker, from connect(); a context manager that closes it.

    Every method may be called from several threads at once. A Client belongs
    to the process that made it: in a child of fork(), connect again.
    """
    __module__ = "vmmbroker"

    def __init__(self, handle: ctypes.c_void_p, socket_path: str) -> None:
        """Made by connect(); not called directly."""
        self._handle: Optional[ctypes.c_void_p] = handle
        self._socket_path = socket_path
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._leases: "weakref.WeakSet[Lease]" = weakref.WeakSet()
        self._held = 0                 # leases of this client not yet given back to the library
        self._closing = False
        _clients.add(self)

    # --- life ---------------------------------------------------------------------------------------

    @property
    def socket_path(self) -> str:
        """The broker's socket this client talks to."""
        return self._socket_path

    @property
    def closed(self) -> bool:
        """Whether close() was called."""
        return self._closing

    def close(self) -> None:
        """Free every lease of this client still held, give back those it kept (free(keep=True)), then
        close the connection (vmmb_close()).

        A lease with live DLPack exports is freed when the last of them is
        deleted, and the connection is closed after it. Closing twice is
        harmless. Leases' addresses must not be used afterwards.

        Raises Error EDEADLK when called from a reclaim callback of one of
        this client's leases (closing waits until the watch thread that runs
        it is done with the client's leases).
        """
        asked = _reclaiming_now()
        if asked is not None and asked._client is self:
            raise error(errno.EDEADLK, "Client.close() from a reclaim callback of one of its leases: the "
                                       "callback runs on the thread that closing waits for. Close it elsewhere.")
        with self._lock:
            if self._closing:
                return
            self._closing = True
            leases = list(self._leases)
        for lease in leases:
            try:
                lease.free()
            except Exception:       # the broker is told at exit anyway
                pass
        self._maybe_close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "closed" if self._closing else "open"
        return f"<vmmbroker.Client {self._socket_path!r} {state}>"

    def _maybe_close(self) -> None:
        with self._lock:
            if not self._closing or self._held or self._handle is None:
                return
            handle, self._handle = self._handle, None
        if os.getpid() == self._pid and not _exiting_late():
            _lib.lib().vmmb_close(handle)

    def _check(self) -> ctypes.c_void_p:
        if os.getpid() != self._pid:
            raise RuntimeError("a vmmbroker Client cannot be used in a child of fork(): connect again there")
        handle = self._handle
        if self._closing or handle is None:
            raise ValueError("the vmmbroker Client is closed")
        return handle

    def _adopt(self, handle: ctypes.c_void_p) -> "Lease":
        lease = Lease(self, handle)
        with self._lock:
            self._held += 1
            self._leases.add(lease)
        return lease

    def _lease_done(self) -> None:
        with self._lock:
            self._held -= 1
        self._maybe_close()

    # --- calls --------------------------------------------------------------------------------------

    def alloc(self, size: int, device: Optional[int] = None, label: Optional[str] = None,
              wait: Optional[float] = None, devices: Optional[Sequence[int]] = None) -> "Lease":
        """Lease at least ``size`` bytes of device memory (vmmb_alloc(), vmmb_alloc_wait(), vmmb_alloc_among()).

        ``device`` is a CUDA device index as the broker numbers them, None to
        let the broker place it by its Placement= rule (by default the device
        with the most room). ``devices`` (at most 64 indices, never with
        ``device``) restricts that choice to those devices. The broker rounds the size up to the
        device's granularity (2 MiB); ``Lease.size`` says what was leased. The
        memory is mapped read-write and reads zero. ``label`` (at most 128
        bytes) is shown by ``vmmctl list``.

        ``wait``: seconds to wait for room when the device has none now, in
        the broker's queue for the device (users take turns, each user's calls
        first come, first served), at most the broker's MaxAllocWait= (5 min by
        default); None or 0 fails at once. While it waits, other calls on this
        client wait too. Memory freed and still being scrubbed by the broker
        is room without ``wait``: the broker waits for the scrubs it needs.

        Raises Error: EINVAL for a size of 0 or more than the device can
        serve, a label too long, a negative ``wait``, or both ``device`` and
        ``devices``; QuotaExceeded (EDQUOT) over a limit of the
        calling user; OutOfMemory (ENOMEM) when the device has no room (after
        ``wait`` seconds, if given); ENODEV
        for a device the broker does not serve (in ``devices`` too); ECONNREFUSED when no broker
        answers.
        """
        if not isinstance(size, int) or isinstance(size, bool):
            raise TypeError(f"size must be an int, not {type(size).__name__}")
        if size < 0 or size >= 1 << 64:
            raise error(errno.EINVAL, f"A lease's size is a number of bytes above 0, not {size}.")
        if wait is not None and (isinstance(wait, bool) or not isinstance(wait, (int, float)) or not wait >= 0):
            raise error(errno.EINVAL, f"wait is a number of seconds, 0 or more, not {wait!r}.")
        wait_usec = 0 if wait is None else min(int(wait * 1e6), (1 << 63) - 1)
        dev = _lib.ANY_DEVICE if device is None else int(device)
        lab = None if label is None else _encode(label, "label")
        if devices is not None and device is not None:
            raise error(errno.EINVAL, "Give device or devices, not both.")
        handle = self._check()
        out = ctypes.c_void_p()
        if devices is not None:
            ids = [int(d) for d in devices]
            if any(not 0 <= d < 1 << 31 for d in ids):
                raise error(errno.ENODEV, f"Devices are numbered from 0: not {ids!r}.")
            arr = (ctypes.c_int * max(len(ids), 1))(*ids)
            rc = _lib.lib().vmmb_alloc_among(handle, size, arr, len(ids), lab, wait_usec, ctypes.byref(out))
        elif wait_usec > 0:
            rc = _lib.lib().vmmb_alloc_wait(handle, size, dev, lab, wait_usec, ctypes.byref(out))
        else:
            rc = _lib.lib().vmmb_alloc(handle, size, dev, lab, ctypes.byref(out))
        if rc < 0:
            _fail(rc)
        return self._adopt(out)

    def attach(self, token: Optional[str] = None, name: Optional[str] = None,
               readonly: bool = False) -> "Lease":
        """Map a lease that another process shared: by ``token`` (from Lease.share()) or by
        ``name`` (from Lease.publish()): exactly one of the two (vmmb_attach(), vmmb_attach_name()).

        ``name`` is "NAME", one of the calling user's own names, or
        "OWNER/NAME", one that user OWNER (a user name or a uid) published.
        The memory is the same as every other holder's, as they left it. It is
        mapped read-only when ``readonly`` is true or the token or name gives
        read-only holds (``Lease.readonly`` says which). Free the hold as any
        lease; attaching a lease this process holds already maps it once more.

        Raises NotFound: ENOKEY for a token no live lease has (mistyped,
        revoked, ended), ENOENT for a name that does not exist or that the
        caller may not attach (the two read the same); PermissionDenied
        (EACCES) for a token made for another user; Error EINVAL for a
        malformed token or name.
        """
        if (token is None) == (name is None):
            raise ValueError("attach() takes exactly one of token= and name=")
        flags = _lib.READONLY if readonly else 0
        handle = self._check()
        out = ctypes.c_void_p()
        if token is not None:
            rc = _lib.lib().vmmb_attach(handle, _encode(token, "token"), flags, ctypes.byref(out))
        else:
            rc = _lib.lib().vmmb_attach_name(handle, _encode(name, "name"), flags, ctypes.byref(out))
        if rc < 0:
            _fail(rc)
        return self._adopt(out)

    def unpublish(self, name: str) -> None:
        """Remove a published name ("NAME" or "OWNER/NAME") (vmmb_unpublish()).

        The processes that hold the lease keep it; it ends when none does.
        Allowed to the lease's owner and the broker's administrators.

        Raises NotFound (ENOENT) for a name that does not exist or the caller
        may not attach; PermissionDenied (EACCES) when the caller may attach
        it but not unpublish it.
        """
        rc = _lib.lib().vmmb_unpublish(self._check(), _encode(name, "name"))
        if rc < 0:
            _fail(rc)

    def revoke(self, token: str) -> None:
        """Revoke a token of Lease.share() (vmmb_revoke()): later attaches with it fail
        (NotFound, ENOKEY); holds already taken with it stay.

        Allowed to the lease's owner, the user that made the token, and the
        broker's administrators. Raises NotFound (ENOKEY) for a token the
        broker does not know, PermissionDenied (EACCES).
        """
        rc = _lib.lib().vmmb_revoke(self._check(), _encode(token, "token"))
        if rc < 0:
            _fail(rc)

    def status(self) -> list[dict[str, Any]]:
        """The pool on each device the broker serves (the broker's Status call).

        One dict per device: index, name, total, granularity, capacity,
        leased, scrubbing, cached (bytes), leases and waiters (Alloc calls
        waiting for room; absent from a broker without waiting) (counts), as
        docs/protocol.md describes Device.

        Sent on a new connection of its own, which does not wait for a broker
        that is away: NotFound (ENOENT) or Error ECONNREFUSED at once.
        """
        self._check()
        reply = _varlink.call(self._socket_path, "Status")
        return list(reply.get("devices") or [])

    def give_back_kept(self) -> int:
        """Give back every lease this client kept with Lease.free(keep=True) (vmmb_give_back_kept()).

        Each is unmapped and freed with the broker, which then has its memory
        for good. close() does it too. Returns how many were given back.

        Raises Error after trying them all when one could not be given back
        (ECONNREFUSED, ECONNRESET: the broker takes it back when the process
        exits).
        """
        rc = _lib.give_back_kept(self._check())
        if rc < 0:
            _fail(rc)
        return rc

    def list(self, all: bool = False) -> list[dict[str, Any]]:
        """Leases that the calling user made or holds; every lease with ``all=True``
        (administrators only) (the broker's List call).

        One dict per lease: id, device, size, slabs, pid, uid, comm, label,
        created (microseconds since the epoch), name (when published),
        holders (a list of dicts: pid, uid, comm, readonly) and kept (True for
        a lease kept for its process's next alloc), as docs/protocol.md
        describes LeaseInfo; optional fields may be absent.

        Raises PermissionDenied (EACCES) for ``all=True`` by a user who is not
        an administrator. Sent as status() is.
        """
        self._check()
        reply = _varlink.call(self._socket_path, "List", {"all": True} if all else {})
        return list(reply.get("leases") or [])

    def users(self, all: bool = False) -> list[dict[str, Any]]:
        """The calling user's use of the broker and its limits; every user's with ``all=True``
        (administrators only) (the broker's Users call, what ``vmmctl users`` shows).

        One dict per user: uid, leases and max_leases (leases the user owns,
        published ones included), connections and max_connections (its
        processes' connections open now, this call's own included), requests
        (replies queued for its connections and not read yet) and devices: a
        list of dicts, one per device served, with index, bytes and max_bytes
        (device memory it owns and may own), host_bytes and max_host_bytes
        (its parked leases' host memory and the most it may park), as
        docs/protocol.md describes User and UserDevice; optional fields may be
        absent (from brokers older than parking).

        Raises PermissionDenied (EACCES) for ``all=True`` by a user who is not
        an administrator. Sent as status() is.
        """
        self._check()
        reply = _varlink.call(self._socket_path, "Users", {"all": True} if all else {})
        return list(reply.get("users") or [])


def _exiting_late() -> bool:
    return _exiting


class _Exportable:
    """What Lease and LeaseView share: the array interfaces over one C-contiguous window."""

    def _window(self) -> tuple["Lease", int, DType, tuple[int, ...]]:
        raise NotImplementedError

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """The CUDA Array Interface, version 3, over the window.

        "stream" is None: the broker's memory comes with no work queued on it
        by this package, so a consumer need not synchronize with anything.
        "strides" is None: the window is C-contiguous. The consumer keeps a
        reference to this object, which keeps the lease from being freed by
        garbage collection, but not from an explicit free(): use DLPack when
        a framework tensor must outlive your own references.
        """
        lease, ptr, dt, shape = self._window()
        count = math.prod(shape)
        return {
            "shape": shape,
            "typestr": dt.typestr,
            "data": (ptr if count else 0, lease.readonly),
            "strides": None,
            "stream": None,
            "version": 3,
        }

    def __dlpack__(self, *, stream: Optional[int] = None, max_version: Optional[tuple[int, int]] = None,
                   dl_device: Optional[tuple[int, int]] = None, copy: Optional[bool] = None) -> Any:
        """Export the window as a DLPack capsule ("dltensor", a legacy DLManagedTensor), without a copy.

        ``stream`` is the consumer's CUDA stream; nothing is synchronized, as
        this package queues no work on the memory. ``max_version`` may be any
        (major, minor) tuple (TypeError otherwise): the legacy capsule is what
        every consumer takes.
        ``dl_device`` other than (2, device) and ``copy=True`` raise
        BufferError: a lease does not copy itself elsewhere.

        The lease stays mapped until the consumer's tensor is deleted (or the
        capsule is dropped unconsumed): free() of a lease with live exports
        is put off until the last one is gone. A read-only lease is exported
        too (legacy DLPack has no read-only flag): writing to it faults.
        """
        lease, ptr, dt, shape = self._window()
        _dlpack.check_dlpack_args(lease.device, stream, max_version, dl_device, copy)
        return _dlpack.export(lease, ptr, lease.device, dt, shape)

    def __dlpack_device__(self) -> tuple[int, int]:
        """(2, device): kDLCUDA and the lease's CUDA device index."""
        lease = self._window()[0]
        return (_dlpack.KDL_CUDA, lease.device)


class Lease(_Exportable):
    """Device memory leased from the broker and mapped into this process.

    From Client.alloc() or Client.attach(). A context manager that frees it;
    also freed when garbage-collected and when the interpreter exits (and, in
    any case, when the process ends: the broker reclaims a dead holder's
    leases). Exposes the memory as a 1-D uint8 array through
    ``__cuda_array_interface__`` and DLPack; view() gives typed windows.

    A lease marked with set_reclaimable() may be given back on the broker's
    request: its memory is then gone (``reclaimed`` is True, and ``ptr``, the
    array interfaces and the broker calls raise Error ESTALE), and free()
    only ends the object.
    """
    __module__ = "vmmbroker"

    def __init__(self, client: Client, handle: ctypes.c_void_p) -> None:
        """Made by Client.alloc() and Client.attach(); not called directly."""
        lib = _lib.lib()
        self._client = client
        self._handle: Optional[ctypes.c_void_p] = handle
        # _lock: the handle is in use (held across calls into the library that use it); never taken by this
        # lease's reclaim callback, which a holder of _lock may wait for (set_reclaimable()).
        self._lock = threading.RLock()
        # _state: _exports, _free_asked, _handle's end and _given_back; taken after _lock, never held across a
        # call into the library or while taking another lock (the reclaim callback takes it).
        self._state = threading.Lock()
        self._exports = 0
        self._given_back = False       # its reclaim callback said "give it back": the memory is not ours
        self._reclaimed = False        # ... and the library did (vmmb_lease_reclaimed()), as last seen
        self._reclaim_priority: Optional[int] = None
        self._reclaim_deadline: Optional[float] = None     # set while its reclaim callback runs
        self._reclaim_fns: list = []   # the RECLAIM_FN the library may call: kept alive until it cannot
        self._free_asked = False
        self._free_stream: Optional[int] = None
        self._free_keep = False
        self._id = (lib.vmmb_lease_id(handle) or b"").decode("utf-8", "replace")
        self._ptr = int(lib.vmmb_lease_ptr(handle))
        self._size = int(lib.vmmb_lease_size(handle))
        self._device = int(lib.vmmb_lease_device(handle))
        owner = int(lib.vmmb_lease_owner(handle))
        self._owner = None if owner == _lib.ANY_UID else owner
        name = lib.vmmb_lease_owner_name(handle)
        self._owner_name = name.decode("utf-8", "replace") if name else None
        self._readonly = bool(lib.vmmb_lease_readonly(handle))

    # --- properties ---------------------------------------------------------------------------------

    @property
    def id(self) -> str:
        """The lease's identifier, as ``vmmctl list`` and Client.list() show it."""
        return self._id

    @property
    def ptr(self) -> int:
        """The start of the mapping: a CUDA device address (CUdeviceptr).

        ValueError once freed; Error ESTALE once given back on the broker's
        request (``reclaimed``), when the address no longer maps this memory.
        """
        self._mapped()
        return self._ptr

    @property
    def size(self) -> int:
        """Bytes mapped at ``ptr``: the request rounded up to the device's granularity."""
        return self._size

    @property
    def device(self) -> int:
        """The CUDA device index of the memory, as the broker numbers devices."""
        return self._device

    @property
    def readonly(self) -> bool:
        """Whether the memory is mapped read-only here (writing to it from the device faults)."""
        return self._readonly

    @property
    def owner(self) -> Optional[int]:
        """The uid of the lease's owner (who made it and is charged for it); None if the broker did not say."""
        return self._owner

    @property
    def owner_name(self) -> Optional[str]:
        """The owner's user name, as the broker looked it up; None if it did not send one."""
        return self._owner_name

    @property
    def freed(self) -> bool:
        """Whether free() was called (the hold itself may wait for live DLPack exports)."""
        return self._free_asked

    @property
    def reclaimed(self) -> bool:
        """Whether the lease was given back on the broker's request (vmmb_lease_reclaimed()).

        True once its reclaim callback agreed (or it had none) and the
        library waited for the work queued in the device's primary context,
        unmapped the memory and freed it with the broker. The memory is gone:
        ``ptr``, the array interfaces and the broker calls raise Error ESTALE,
        and free() only ends the object. Stays True after free().
        """
        if self._reclaimed:
            return True
        if not self._given_back:
            return False            # the library gives nothing back without asking this package first
        with self._lock:
            handle = self._handle
            if handle is not None and _lib.lease_reclaimed(handle):
                self._reclaimed = True
        return self._reclaimed

    @property
    def reclaim_priority(self) -> Optional[int]:
        """The priority set_reclaimable() marked the lease with; None when not marked (by this object),
        given back, or refused (a refusal unmarks it)."""
        return None if self._given_back else self._reclaim_priority

    @property
    def reclaim_deadline(self) -> Optional[float]:
        """In this lease's own reclaim callback, the time.monotonic() by which the broker wants the
        callback's answer; None anywhere else.

        The broker waits its ReclaimTimeout= (5 s by default) for the answer,
        counted from when it asked; this deadline is counted from when the
        library called the callback, so the broker's is earlier by the time the
        request took to arrive (normally well under a millisecond). A callback
        that cannot stop using the memory by then should refuse (return False)
        rather than answer late: at the deadline the broker calls the lease
        unresponsive, stops asking for it (it is not reclaimable until marked
        again) and asks the next lease. A late give-back still frees the
        lease, and its memory still serves a call that waits.
        """
        return self._reclaim_deadline if _reclaiming_now() is self else None

    @property
    def client(self) -> Client:
        """The client the lease came from."""
        return self._client

    def __repr__(self) -> str:
        state = (" reclaimed" if self._given_back else "") + (" freed" if self._free_asked else "")
        ro = " readonly" if self._readonly else ""
        return (f"<vmmbroker.Lease {self._id} {self._size} bytes on device {self._device} "
                f"at {self._ptr:#x}{ro}{state}>")

    # --- life ---------------------------------------------------------------------------------------

    def free(self, stream: Optional[int] = None, keep: bool = False) -> None:
        """End this process's hold on the lease (vmmb_free()). Idempotent.

        Unmaps the memory, then tells the broker. Neither the driver nor the
        library waits for work still queued on the memory, which would then
        fault: synchronize first, or pass ``stream`` (a CUstream /
        cudaStream_t as an int; 0 or 1 for the legacy default stream, 2 for
        the per-thread one) to wait for the work queued on it first
        (vmmb_free_stream()). When that wait fails, Error is raised and the
        memory stays mapped until Client.close() or the end of the process.

        When DLPack exports of the lease are alive (a framework tensor made
        from it), the hold ends when the last of them is deleted (waiting for
        ``stream`` then). For a shared or published lease this ends only this
        process's hold.

        A lease given back on the broker's request (``reclaimed``) has no
        memory left: free() ends the object only, and tells nobody. From the
        lease's own reclaim callback, free() raises Error EDEADLK: return True
        from the callback instead, and the library gives it back. A free()
        from another thread while the callback runs waits for it.

        With ``keep=True`` (vmmb_free_keep()) the memory stays mapped for this
        process: the broker zeroes the lease and hands the same lease back to
        this process's next alloc() of its size (on any Client of the
        process), which then returns at once with the same ``id`` and ``ptr``,
        with nothing imported or mapped. Nothing may use the memory meanwhile,
        and the work queued on it must be done first: ``keep`` does not wait
        for a stream, so it cannot be given with ``stream``. A kept lease is
        still the user's (its limits, ``vmmctl list`` shows it kept): the
        library gives it back when the broker asks for it (another alloc
        waits for room), when this process's alloc is refused for room or a
        limit, and in Client.give_back_kept() and Client.close(). A lease the
        broker would not keep (attached, shared, published, parked, read-only,
        marked reclaimable) or a broker older than keeping gets a plain free.

        Raises Error when telling the broker failed (ECONNREFUSED,
        ECONNRESET): the memory is unmapped all the same and the broker takes
        it back when the process exits.
        """
        if stream is not None and (not isinstance(stream, int) or isinstance(stream, bool)):
            raise TypeError(f"stream must be None or an int (a CUDA stream), not {type(stream).__name__}")
        if not isinstance(keep, bool):
            raise TypeError(f"keep must be a bool, not {type(keep).__name__}")
        if keep and stream is not None:
            raise ValueError("free(keep=True) does not wait for a stream: synchronize it first, then free with "
                             "keep=True and no stream")
        if _reclaiming_now() is self:
            raise error(errno.EDEADLK, f"free() of lease {self._id} from its own reclaim callback: return True "
                                       "from the callback instead, and the library gives it back.")
        with self._lock, self._state:
            if self._free_asked:
                return
            self._free_asked = True
            self._free_stream = stream
            self._free_keep = keep
            if self._exports:
                return
        self._release(raise_errors=True)

    def _release(self, raise_errors: bool) -> None:
        if _reclaiming_now() is self:
            # The last DLPack export of a freed lease was dropped inside the lease's own reclaim callback, where
            # vmmb_free() cannot be called (EDEADLK): free it from another thread, which waits for the callback.
            threading.Thread(target=self._release, args=(False,), name="vmmbroker-free", daemon=True).start()
            return
        with self._lock:
            if self._handle is not None and self._given_back and _lib.lease_reclaimed(self._handle):
                self._reclaimed = True
            with self._state:
                handle, self._handle = self._handle, None
            stream = self._free_stream
        if handle is None:
            return
        rc = 0
        if os.getpid() == self._client._pid and not _exiting_late():
            if self._free_keep and not self._given_back:
                rc = _lib.free_keep(handle)
            elif stream is None or self._given_back:        # given back: nothing left to wait for
                rc = _lib.lib().vmmb_free(handle)
            else:
                # A failed wait leaves the lease mapped and held, a failed free does not, and the errno
                # does not tell the two apart: either way the handle is not used again, and what the
                # library still holds is given back by Client.close() or the end of the process.
                rc = _lib.free_stream(handle, stream)
            message = _lib.error_message() if rc < 0 else ""
            # vmmb_free() waited for a reclaim callback under way and freed the lease object: nothing calls
            # the callbacks any more. (In a child of fork(), or at exit, the library may still: keep them.)
            self._reclaim_fns = []
        self._client._lease_done()
        if rc < 0 and raise_errors:
            raise error(rc, message)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.free()

    def __del__(self) -> None:
        try:
            if not self._free_asked:
                self._free_asked = True
                self._release(raise_errors=False)
        except Exception:
            pass

    def _stale(self) -> Exception:
        return error(errno.ESTALE, f"Lease {self._id} was given back on the broker's request (reclaimed): its "
                                   "memory is gone. Free the object, and lease again if need be.")

    def _mapped(self) -> ctypes.c_void_p:
        handle = self._handle
        if handle is None:
            raise ValueError(f"lease {self._id} is freed")
        if self._given_back:
            raise self._stale()
        return handle

    def _usable(self) -> ctypes.c_void_p:
        if self._free_asked:
            raise ValueError(f"lease {self._id} is freed")
        self._client._check()
        return self._mapped()

    def _not_in_own_callback(self, what: str) -> None:
        # These calls take _lock, which a set_reclaimable() of another thread may hold while it waits for
        # this very callback to return.
        if _reclaiming_now() is self:
            raise error(errno.EDEADLK, f"{what} of lease {self._id} from its own reclaim callback: the callback "
                                       "only decides (return True to give it back, False to keep it).")

    def _export_acquire(self) -> None:
        with self._state:
            if self._free_asked or self._handle is None:
                raise BufferError(f"lease {self._id} is freed: nothing to export")
            if self._given_back:
                raise self._stale()
            self._exports += 1

    def _export_release(self) -> None:
        with self._state:
            self._exports -= 1
            last = self._exports == 0 and self._free_asked
        if last:
            self._release(raise_errors=False)

    # --- reclaiming ---------------------------------------------------------------------------------

    def set_reclaimable(self, priority: Optional[int],
                        callback: Optional[Callable[["Lease"], bool]] = None) -> None:
        """Offer the lease back to the broker, or (``priority`` None) stop offering it
        (vmmb_lease_set_reclaimable()).

        When another process's alloc(..., wait=...) waits for room on the
        lease's device, the broker asks the holders of reclaimable leases
        there, lowest ``priority`` (0 to 2**31-1) first, then the earliest
        marked, for what that call needs. When this lease is asked, the
        library's watch thread (the process's, started by its first mark or
        keep, stopped when the last client using it is closed) calls
        ``callback(lease)``; a true value gives the
        lease back, a false one (None too) refuses. Without a callback the
        lease is given back without asking. Given back: the library waits for
        the work queued in the device's primary context (PyTorch's, CuPy's,
        the CUDA runtime's), unmaps the memory and frees it with the broker;
        ``reclaimed`` is then True and the memory is gone (``ptr``, the array
        interfaces and the broker calls raise Error ESTALE; free() ends the
        object). Refused: the lease stays mapped and is no longer reclaimable
        (mark it again, once the callback has returned, to offer it again: it
        may then be asked again at once, by a call that still waits), and the
        broker asks another.

        The callback runs on the library's thread, holding the GIL, one
        request at a time; the broker waits for it ReclaimTimeout= (5 s by
        default), after which the lease is "unresponsive" and no longer asked.
        In the callback, stop using the memory: drop the tensors made from it
        and finish the work queued on it in contexts other than the primary
        one. A lease with live DLPack exports (a framework tensor still made
        from it) is refused whatever the callback says, with a warning on the
        "vmmbroker" logger: giving it back would leave the tensor pointing at
        unmapped memory. An exception raised by the callback refuses too (the
        program may still be using the memory), and is logged with its
        traceback on the "vmmbroker" logger (at ERROR); it never reaches the
        library. ``ptr`` and ``__cuda_array_interface__`` still work in the
        callback (the memory is mapped until it returns).

        Do not call into this lease's Client from the callback, except for
        properties. free(), set_reclaimable(), share(), publish(), tokens(),
        park(), unpark(), read() and readinto() of the lease being asked raise
        Error EDEADLK there, and Client.close() too; other calls of the same Client that go to the
        broker (alloc, attach, free of other leases) may wait behind a call of
        another thread that waits for memory, which may wait for this very
        callback: use another Client (or do it after the callback). The
        callback is kept as long as the lease is marked, and dropped when it
        is unmarked or freed; it holds no reference that keeps the Lease
        alive.

        Only a process that holds the lease read-write, of the owner's user,
        may mark it; a published lease is never asked, and a lease shared
        with other processes is asked only if every holder watches. Marks are
        not kept across a restart of the broker: the library marks again.

        Raises PermissionDenied (EACCES) for a lease held read-only or of
        another user; NotFound (ENOENT) for a lease the broker does not know;
        Error ESTALE for a lease given back already, EDEADLK (above),
        EOPNOTSUPP for a broker or library older than reclaiming; ValueError
        for a priority out of range or a callback with ``priority`` None;
        TypeError for a priority that is not an int or a callback that is not
        callable.
        """
        if priority is not None:
            if not isinstance(priority, int) or isinstance(priority, bool):
                raise TypeError(f"priority must be None or an int, not {type(priority).__name__}")
            if not 0 <= priority <= MAX_PRIORITY:
                raise ValueError(f"priority is 0 to {MAX_PRIORITY} (lower is asked first), or None: not {priority}")
        elif callback is not None:
            raise ValueError("a callback is for marking: set_reclaimable(None) unmarks the lease")
        if callback is not None and not callable(callback):
            raise TypeError(f"callback must be callable, not {type(callback).__name__}")
        self._not_in_own_callback("set_reclaimable()")
        fn = None if priority is None else _reclaim_fn(weakref.ref(self), callback)
        with self._lock:
            handle = self._usable()
            rc = _lib.set_reclaimable(handle, _lib.NOT_RECLAIMABLE if priority is None else priority, fn)
            if rc < 0:
                # The library may still hold the callback given before, or (marked, then refused by the
                # broker) this one: keep both until the lease is freed.
                message = _lib.error_message()
                if fn is not None:
                    self._reclaim_fns.append(fn)
            else:
                # Returned: the library holds this one alone (or none), and no call of an earlier one is under way.
                self._reclaim_fns = [] if fn is None else [fn]
                self._reclaim_priority = priority
        if rc < 0:
            raise error(rc, message)

    def _on_reclaim(self, callback: Optional[Callable[["Lease"], bool]], timeout_usec: int) -> int:
        """On the library's watch thread, with the GIL: 0 gives the lease back, -1 refuses. TIMEOUT_USEC is
        how long the broker waits for the answer (reclaim_deadline)."""
        give = True
        if callback is not None:
            before = _reclaiming_now()
            _tls.lease = self
            self._reclaim_deadline = time.monotonic() + timeout_usec / 1e6
            try:
                give = bool(callback(self))
            except BaseException:
                _log.error("vmmbroker: the reclaim callback of lease %s raised; the lease is kept (refused) and "
                           "no longer reclaimable", self._id, exc_info=True)
                give = False
            finally:
                _tls.lease = before
                self._reclaim_deadline = None
        if give:
            with self._state:
                exports = self._exports
                if not exports:
                    self._given_back = True
            if exports:
                _log.warning("vmmbroker: lease %s is kept (refused): %d DLPack export(s) of it are still alive, "
                             "and giving it back would leave them pointing at unmapped memory", self._id, exports)
                give = False
        if not give:
            self._reclaim_priority = None      # the library unmarks a refused lease
        return 0 if give else -1

    # --- parking ------------------------------------------------------------------------------------

    @property
    def parked(self) -> bool:
        """Whether this process has the lease parked (vmmb_lease_parked()): nothing is mapped at ``ptr``,
        which stays reserved for it until unpark() maps the memory there again."""
        handle = self._handle
        return handle is not None and _lib.lease_parked(handle)

    def park(self, stream: Optional[int] = None) -> bool:
        """Unmap the lease here, keeping its address, and let the broker move it to host memory
        (vmmb_lease_park()).

        Waits for the work queued on ``stream`` (a CUstream / cudaStream_t as
        an int), or with None (or 0) for all the work of the context (the
        thread's current one, else the device's primary context: PyTorch's,
        CuPy's, the CUDA runtime's; when neither exists, nothing is queued,
        and no context is created to wait in), then unmaps the memory while ``ptr``
        stays reserved, and tells the broker. Until unpark(), nothing is
        mapped at ``ptr``: tensors and arrays made from the lease keep their
        pointers but must not be used (a kernel touching them faults, and the
        fault ends the process's CUDA context).

        Returns True when the content is in host memory now (the device
        memory went back to the broker; that ends the lease's reclaimable
        mark: set_reclaimable() again after unpark() to offer it again),
        False when other processes still map the lease: it moves when the
        last of them parks too.

        When the broker refuses, the lease is mapped again as it was (or, when
        that fails too because the broker is gone, left parked: ``parked`` is
        true and unpark() maps it again) and the error raised: PermissionDenied (EACCES) for a read-only hold or a
        lease of another user, OutOfHostMemory (ENOSPC) when the broker's
        host memory is full, QuotaExceeded (EDQUOT) over the owner's
        host-bytes limit (MaxHostBytes=). Error EALREADY for a lease parked
        already, ESTALE for one given back on the broker's request,
        EOPNOTSUPP for a broker or library older than parking (nothing
        unmapped); ValueError once freed; TypeError for a stream that is not
        an int.
        """
        if stream is not None and (not isinstance(stream, int) or isinstance(stream, bool)):
            raise TypeError(f"stream must be None or an int (a CUDA stream), not {type(stream).__name__}")
        self._not_in_own_callback("park()")
        with self._lock:
            rc = _lib.lease_park(self._usable(), stream)
            message = _lib.error_message() if rc < 0 else ""
            if rc == 1:
                self._reclaim_priority = None   # its mark ended with the move (the library forgets it too)
        if rc < 0:
            raise error(rc, message)
        return rc == 1

    def unpark(self) -> None:
        """Bring a lease this process parked back, mapped at the same ``ptr`` (vmmb_lease_unpark()).

        The broker puts the content back into device memory when it was in
        host memory; the library maps it where it was, with the access it had
        (read-only, peer devices). Tensors made from the lease before it was
        parked read what they held.

        Raises OutOfMemory (ENOMEM) when the device has no room now and
        QuotaExceeded (EDQUOT) over a limit of the owner: the lease stays
        parked, and unpark() may be called again. Error EALREADY for a lease
        not parked here, ESTALE for one given back; ValueError once freed.
        """
        self._not_in_own_callback("unpark()")
        with self._lock:
            rc = _lib.lease_unpark(self._usable())
            message = _lib.error_message() if rc < 0 else ""
        if rc < 0:
            raise error(rc, message)

    # --- reading ------------------------------------------------------------------------------------

    def readinto(self, buffer: Any, offset: int = 0) -> int:
        """Copy the lease's bytes from ``offset`` into ``buffer``, as many as it holds (vmmb_lease_read());
        return that count.

        ``buffer``: a writable, C-contiguous bytes-like object (a bytearray,
        a memoryview of one, an array, a NumPy array). One synchronous
        device-to-host copy, made for small reads such as a header: it comes
        after the work queued on the context's legacy default stream, so wait
        for work that writes the range on other streams first (for PyTorch,
        ``torch.cuda.current_stream().synchronize()``). Read-only leases are
        read too. A free or park of this lease from another thread waits for
        the copy; nothing else does (the client's other leases, and the answers
        to reclaim requests for them, go on). Copy large ranges through the
        mapping on a stream instead.

        Raises Error ERANGE for bytes past the lease's size (nothing is
        read), ENXIO for a parked lease, ESTALE for one given back on the
        broker's request, EOPNOTSUPP for a library older than reading;
        ValueError once freed or for a negative offset; TypeError for a
        read-only or non-contiguous buffer.
        """
        view = memoryview(buffer)
        if view.readonly:
            raise TypeError("readinto() needs a writable buffer, not a read-only one")
        if not view.c_contiguous:
            raise TypeError("readinto() needs a C-contiguous buffer")
        view = view.cast("B")
        n = view.nbytes
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise ValueError(f"offset must be an int >= 0, not {offset!r}")
        offset = min(offset, 2**64 - 1)     # past any lease: the library refuses it (ERANGE) as it should
        self._not_in_own_callback("readinto()")
        with self._lock:
            if self._free_asked:
                raise ValueError(f"lease {self._id} is freed")
            handle = self._mapped()
            # a c_char over the first byte, not a (c_char * n) array: making an array type costs tens of us
            first = ctypes.c_char.from_buffer(view) if n else None
            try:
                rc = _lib.lease_read(handle, offset, ctypes.addressof(first) if first is not None else None, n)
            finally:
                del first           # the buffer may be resized only once no ctypes object holds it
            message = _lib.error_message() if rc < 0 else ""
        if rc < 0:
            raise error(rc, message)
        return n

    def read(self, size: int, offset: int = 0) -> bytes:
        """``size`` bytes of the lease from ``offset``, copied to host memory (readinto(), which says how)."""
        buf = bytearray(size)
        self.readinto(buf, offset)
        return bytes(buf)

    # --- sharing ------------------------------------------------------------------------------------

    def share(self, uid: Optional[int] = None, readonly: bool = False) -> str:
        """Make a token with which another process attaches this lease (vmmb_share()).

        ``uid``: the only user that may attach with it; None for any user that
        can reach the broker. ``readonly``: attaching with it gives read-only
        holds. A token works until Client.revoke() or the end of the lease;
        whoever presents it gets the memory, so keep it as secret as a
        password. Only the owner's processes make tokens.

        Raises PermissionDenied (EACCES) for a holder that is not of the owner
        or a read-only holder asking for a read-write token; QuotaExceeded
        (EDQUOT) past 64 live tokens.
        """
        self._not_in_own_callback("share()")
        u = _lib.ANY_UID if uid is None else int(uid)
        buf = ctypes.create_string_buffer(_lib.TOKEN_SIZE)
        with self._lock:
            rc = _lib.lib().vmmb_share(self._usable(), u, _lib.READONLY if readonly else 0, buf)
        if rc < 0:
            _fail(rc)
        return buf.value.decode("ascii")

    def publish(self, name: str, uids: Iterable[int] = (), readonly: bool = False) -> None:
        """Publish the lease as ``name`` in its owner's namespace (vmmb_publish()).

        ``name``: 1-128 ASCII letters, digits and "._-:@+", beginning with a
        letter or digit, no "/". The owner's processes attach it as "NAME",
        the users of ``uids`` (at most 64) as "OWNER/NAME". ``readonly``: holds
        through the name are read-only, the owner's included. A published
        lease outlives every process holding it, with what was last written
        to it, until Client.unpublish(). Publishing again under the same name
        replaces the users and the flag.

        Raises Error EEXIST for a name another of the owner's leases has,
        EINVAL for a bad name or a lease published under another name;
        PermissionDenied (EACCES) when the caller is not of the owner or holds
        it read-only.
        """
        self._not_in_own_callback("publish()")
        ids = [int(u) for u in uids]
        arr = (ctypes.c_uint32 * max(len(ids), 1))(*ids)
        with self._lock:
            rc = _lib.lib().vmmb_publish(self._usable(), _encode(name, "name"), arr, len(ids),
                                         _lib.READONLY if readonly else 0)
        if rc < 0:
            _fail(rc)

    def tokens(self) -> list[dict[str, Any]]:
        """The live share tokens of the lease (vmmb_tokens()), for a holder of the owner.

        One dict per token: token (str), uid (the only user that may attach
        with it, None for any), creator (the uid whose process made it),
        readonly (bool). Raises PermissionDenied (EACCES) for a holder that is
        not of the owner.
        """
        self._not_in_own_callback("tokens()")
        arr = ctypes.POINTER(_lib.Token)()
        n = ctypes.c_size_t()
        with self._lock:
            rc = _lib.lib().vmmb_tokens(self._usable(), ctypes.byref(arr), ctypes.byref(n))
        if rc < 0:
            _fail(rc)
        try:
            return [{
                "token": arr[i].token.decode("ascii"),
                "uid": None if arr[i].uid == _lib.ANY_UID else int(arr[i].uid),
                "creator": int(arr[i].creator),
                "readonly": bool(arr[i].readonly),
            } for i in range(n.value)]
        finally:
            _lib.lib().vmmb_tokens_free(arr, n.value)

    # --- arrays -------------------------------------------------------------------------------------

    def _window(self) -> tuple["Lease", int, DType, tuple[int, ...]]:
        self._mapped()
        return self, self._ptr, _dtype("uint8"), (self._size,)

    def view(self, dtype: Any, shape: Any, offset: int = 0) -> "LeaseView":
        """A typed, C-contiguous window of the lease: ``shape`` elements of ``dtype`` from byte ``offset``.

        ``dtype`` is a name: bool, int8, int16, int32, int64, uint8, uint16,
        uint32, uint64, float16, bfloat16, float32, float64, complex64,
        complex128 (or an alias: half, float, double, bf16..., or an object
        whose str() is one, such as numpy.dtype("float32") or torch.float32).
        ``shape`` is an int or a tuple of ints. ``offset`` must be a multiple
        of the element's size, and the window must lie inside the lease
        (ValueError otherwise). The view exposes the same array interfaces as
        the lease, and keeps the lease alive.
        """
        return LeaseView(self, _dtype(dtype), shape, offset)


def _reclaim_fn(lease_ref: "weakref.ref[Lease]", callback: Optional[Callable[[Lease], bool]]) -> Any:
    """The C callback (a RECLAIM_FN) for a lease: calls Lease._on_reclaim(), lets nothing escape into C.

    It holds the Lease by a weak reference, so that marking makes no cycle that keeps the lease alive; a lease
    being collected is freed by its __del__, whose vmmb_free() waits for a callback under way.
    """
    def trampoline(_handle: Any, timeout_usec: int, _userdata: Any) -> int:
        try:
            lease = lease_ref()
            if lease is None or _exiting_late():
                return -1
            return lease._on_reclaim(callback, timeout_usec)
        except BaseException:           # nothing may unwind into the library: ctypes would answer 0, "give back"
            try:
                _log.error("vmmbroker: reclaim callback failed; the lease is kept (refused)", exc_info=True)
            except BaseException:
                pass
            return -1
    return _lib.RECLAIM_FN(trampoline)


class LeaseView(_Exportable):
    """A typed window of a Lease, from Lease.view(): exposes ``__cuda_array_interface__``
    and DLPack for ``shape`` elements of ``dtype`` at ``lease.ptr + offset``."""
    __module__ = "vmmbroker"

    def __init__(self, lease: Lease, dtype: DType, shape: Any, offset: int = 0) -> None:
        """Made by Lease.view(); not called directly."""
        if isinstance(shape, int) and not isinstance(shape, bool):
            shape = (shape,)
        if isinstance(shape, (str, bytes)):
            raise TypeError(f"shape must be an int or a tuple of ints, not {shape!r}")
        try:
            shape = tuple(int(n) for n in shape)
        except TypeError:
            raise TypeError(f"shape must be an int or a tuple of ints, not {shape!r}") from None
        if any(n < 0 for n in shape):
            raise ValueError(f"shape {shape} has a negative dimension")
        if not isinstance(offset, int) or isinstance(offset, bool):
            raise TypeError("offset must be an int")
        if offset < 0:
            raise ValueError(f"offset {offset} is negative")
        if offset % dtype.itemsize:
            raise ValueError(f"offset {offset} is not a multiple of {dtype.name}'s {dtype.itemsize} bytes")
        nbytes = math.prod(shape) * dtype.itemsize
        if offset + nbytes > lease.size:
            raise ValueError(f"{dtype.name}{list(shape)} at offset {offset} ({nbytes} bytes) does not fit "
                             f"in the lease's {lease.size} bytes")
        self._lease = lease
        self._dtype = dtype
        self._shape = shape
        self._offset = offset
        self._nbytes = nbytes

    @property
    def lease(self) -> Lease:
        """The lease the window is of."""
        return self._lease

    @property
    def dtype(self) -> str:
        """The element type's name ("float32")."""
        return self._dtype.name

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self._dtype.itemsize

    @property
    def shape(self) -> tuple[int, ...]:
        """The window's shape."""
        return self._shape

    @property
    def offset(self) -> int:
        """Bytes from the start of the lease."""
        return self._offset

    @property
    def nbytes(self) -> int:
        """Bytes in the window."""
        return self._nbytes

    @property
    def ptr(self) -> int:
        """The window's device address: lease.ptr + offset."""
        return self._lease.ptr + self._offset

    @property
    def readonly(self) -> bool:
        """Whether the lease is mapped read-only here."""
        return self._lease.readonly

    def __repr__(self) -> str:
        return (f"<vmmbroker.LeaseView {self._dtype.name}{list(self._shape)} at offset {self._offset} "
                f"of lease {self._lease.id}>")

    def _window(self) -> tuple[Lease, int, DType, tuple[int, ...]]:
        return self._lease, self.ptr, self._dtype, self._shape


@atexit.register
def _at_exit() -> None:
    # Free what can be freed; a lease with live DLPack exports is left to the process's exit.
    global _exiting
    for client in list(_clients):
        try:
            if client._pid == os.getpid():
                client.close()
        except Exception:
            pass
    # Leases left (live DLPack exports) stay marked: unmark them, so that the library's watch thread calls no
    # Python while the interpreter is torn down.
    for client in list(_clients):
        if client._pid != os.getpid():
            continue
        for lease in list(client._leases):
            try:
                with lease._lock:
                    if lease._reclaim_fns and lease._handle is not None and not lease._given_back:
                        _lib.set_reclaimable(lease._handle, _lib.NOT_RECLAIMABLE, None)
            except Exception:
                pass
    _exiting = True
