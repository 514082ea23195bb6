# SPDX-License-Identifier: MIT
"""vmmbroker - lease GPU memory from vmmbrokerd, and share it, from Python.

The package speaks to the GPU memory broker through libvmmbroker (ctypes; no
compiled extension). A program connects to the broker, asks for device
memory and gets a *lease*: the broker sends the memory, the library maps it
into one range of this process's device addresses, and the program uses the
address like any memory from cuMemAlloc, or hands it to a framework without
a copy through ``__cuda_array_interface__`` or DLPack::

    import vmmbroker, torch
    with vmmbroker.connect() as client:
        with client.alloc(256 << 20, label="scratch") as lease:
            t = torch.from_dlpack(lease.view("float32", (1024, 65536)))
            t.fill_(1.0)
            torch.cuda.synchronize()
            del t

CONNECTING
    connect(socket_path=None) -> Client. The socket is ``socket_path``, else
    $VMMBROKER_SOCKET, else /run/vmmbroker/io.vmmbroker. A Client outlives
    its connection: when the broker restarts, the next call connects again
    (waiting up to $VMMBROKER_RECONNECT_TIMEOUT seconds, 30 by default), and
    leases stay mapped throughout. A call polls for the broker's reply for up
    to $VMMBROKER_REPLY_SPIN_USEC microseconds before it sleeps (100 on
    machines with 4 CPUs or more, else 0). The CUDA driver is libcuda.so.1, or the
    file $VMMBROKER_LIBCUDA names; libvmmbroker is $VMMBROKER_LIBRARY when
    set, else the one the dynamic loader finds (library_path() says which).

LEASES
    Client.alloc(size, device=None, label=None, wait=None, devices=None) ->
    Lease; ``wait`` seconds for room when the device is full, ``devices`` to
    let the broker place it among those. The memory reads
    zero and is rounded up to the device's granularity (2 MiB). It stays this
    process's until Lease.free(), the end of a ``with`` block, garbage
    collection of the Lease, Client.close(), the interpreter's exit, or the
    end of the process (the broker takes back a dead process's holds).
    Properties: id, ptr, size, device, readonly, owner, owner_name, freed,
    reclaimed, parked.
    free() unmaps the memory; the driver does not wait for work still queued
    on it, so synchronize first. Lease.read(size, offset=0) and
    Lease.readinto(buffer, offset=0) copy bytes of it to host memory (one
    synchronous copy, for small reads such as a header).

SHARING
    A lease belongs to the user that made it, its owner, who is charged for
    it and alone makes tokens for it and publishes it. Lease.share(uid=None,
    readonly=False) makes a token; another process passes it to
    Client.attach(token=...) and maps the same memory. Lease.publish(name,
    uids=(), readonly=False) names the lease and keeps it alive after every
    holder has exited, until Client.unpublish(name). Names live in their
    owner's namespace: the owner attaches "NAME", the users it listed
    attach "OWNER/NAME" (OWNER a user name or uid). A name the caller may
    not attach and one that does not exist are the same NotFound. Each
    process frees its own hold; the memory goes back to the broker when no
    process holds the lease and it is not published. Lease.tokens() lists
    the live tokens, Client.revoke(token) revokes one.

ARRAYS
    A Lease is a 1-D uint8 array over its whole size; Lease.view(dtype,
    shape, offset=0) is a typed window of it (LeaseView). Both expose
    ``__cuda_array_interface__`` (version 3; no stream to synchronize with)
    and DLPack (``__dlpack__``, a legacy "dltensor" capsule, and
    ``__dlpack_device__`` -> (2, device), kDLCUDA), so PyTorch, CuPy, JAX
    and Numba take them without a copy. A DLPack export keeps the lease
    mapped: free() of a lease with live exports ends the hold only when the
    last tensor made from it is deleted.

RECLAIMING
    Lease.set_reclaimable(priority, callback=None) offers a lease back to
    the broker (priority 0 to MAX_PRIORITY, lower asked first; None
    unmarks it): when another process's alloc(..., wait=...) needs the room,
    the library's watch thread calls callback(lease), with the GIL; True
    gives the lease back, False keeps it (and unmarks it). An exception in
    the callback keeps it too, and is logged on the "vmmbroker" logger; a
    lease with live DLPack exports is never given back. Once given back,
    Lease.reclaimed is True, the memory is gone (ptr and the array
    interfaces raise Error ESTALE) and free() ends the object only. Do not
    call into the lease's Client from the callback (free(), close() and the
    like raise Error EDEADLK there).

PARKING
    Lease.park(stream=None) waits for the work queued on ``stream`` (None:
    the whole context), unmaps the lease here while keeping its address,
    and lets the broker move the content to host memory once every holder
    has parked; it returns True when it moved, False while others still map
    it. Lease.unpark() maps it again at the same ptr, content and all;
    Lease.parked says whether this process has it parked. A refused park
    leaves the lease mapped. vmmbroker.torch.sleep() and wake() do it for
    every segment of PyTorch's broker-backed pools.

STATUS
    Client.status() lists the pool on each device; Client.list(all=False)
    the leases the calling user made or holds (all=True: every lease, for the
    broker's administrators only); Client.users(all=False) the calling user's
    use of the broker and its limits (all=True: every user's, administrators
    only). All three are the broker's own answers, as dicts
    (docs/protocol.md: Device, LeaseInfo, User).

ERRORS
    Failures raise Error, an OSError whose errno is the error number and
    whose strerror is the broker's or the library's sentence. NotFound
    (ENOENT, ENOKEY), PermissionDenied (EACCES), QuotaExceeded (EDQUOT),
    OutOfMemory (ENOMEM) and OutOfHostMemory (ENOSPC: no host memory to park
    in) are its subclasses for the errnos worth catching on their own.
    Misused arguments raise TypeError or ValueError, except those alloc()
    checks as the library does (Error EINVAL, ENODEV).

SEE ALSO
    libvmmbroker(3), vmmbrokerd(8), vmmctl(1), docs/python.md.
"""

from __future__ import annotations

from ._client import MAX_PRIORITY, Client, Lease, LeaseView, connect
from ._dtypes import DTYPES as _DTYPES
from ._errors import Error, NotFound, OutOfHostMemory, OutOfMemory, PermissionDenied, QuotaExceeded
from ._lib import DEFAULT_SOCKET, library_path

__version__ = "0.1.0"

#: The element types Lease.view() takes, by name.
DTYPES: tuple[str, ...] = tuple(_DTYPES)

__all__ = [
    "connect", "Client", "Lease", "LeaseView",
    "Error", "NotFound", "PermissionDenied", "QuotaExceeded", "OutOfMemory", "OutOfHostMemory",
    "DEFAULT_SOCKET", "DTYPES", "MAX_PRIORITY", "library_path",
]
