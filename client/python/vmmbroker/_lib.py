# SPDX-License-Identifier: MIT
"""libvmmbroker through ctypes: finding the library and declaring its functions.

Nothing here is public: the package's classes wrap it. The library is found as
$VMMBROKER_LIBRARY names it (a path, or a name for the dynamic loader), else
by ctypes.util.find_library("vmmbroker"), else as "libvmmbroker.so.0".
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import threading
from typing import Any, Optional

#: Bytes of the buffer vmmb_share() writes a token to (VMMB_TOKEN_SIZE).
TOKEN_SIZE = 65
#: vmmb_alloc()'s "first device the broker serves" (VMMB_ANY_DEVICE).
ANY_DEVICE = -1
#: The read-only flag of vmmb_share(), vmmb_attach*() and vmmb_publish() (VMMB_READONLY).
READONLY = 1
#: vmmb_share()'s "any user" and vmmb_lease_owner()'s "not said" ((uid_t)-1).
ANY_UID = 0xFFFFFFFF
#: vmmb_lease_set_reclaimable()'s priority that makes a lease not reclaimable (VMMB_NOT_RECLAIMABLE).
NOT_RECLAIMABLE = -1
#: The broker's socket when neither the caller nor $VMMBROKER_SOCKET names one (VMMB_DEFAULT_SOCKET).
DEFAULT_SOCKET = "/run/vmmbroker/io.vmmbroker"


class Token(ctypes.Structure):
    """struct vmmb_token."""
    _fields_ = [
        ("token", ctypes.c_char * TOKEN_SIZE),
        ("uid", ctypes.c_uint32),
        ("creator", ctypes.c_uint32),
        ("readonly", ctypes.c_int),
    ]


_client_p = ctypes.c_void_p
_lease_p = ctypes.c_void_p

#: vmmb_reclaim_fn: int (*)(vmmb_lease *lease, uint64_t timeout_usec, void *userdata). ctypes takes the GIL
#: when the library's watch thread calls one, and lets nothing of Python's unwind into C (an exception is
#: printed and 0 returned, which would mean "give it back": the package's callbacks catch everything).
RECLAIM_FN = ctypes.CFUNCTYPE(ctypes.c_int, _lease_p, ctypes.c_uint64, ctypes.c_void_p)

# name: (restype, argtypes)
_PROTOTYPES = {
    "vmmb_connect": (ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(_client_p)]),
    "vmmb_close": (None, [_client_p]),
    "vmmb_alloc": (ctypes.c_int, [_client_p, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p,
                                  ctypes.POINTER(_lease_p)]),
    "vmmb_alloc_wait": (ctypes.c_int, [_client_p, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p,
                                       ctypes.c_uint64, ctypes.POINTER(_lease_p)]),
    "vmmb_alloc_among": (ctypes.c_int, [_client_p, ctypes.c_uint64, ctypes.POINTER(ctypes.c_int), ctypes.c_size_t,
                                        ctypes.c_char_p, ctypes.c_uint64, ctypes.POINTER(_lease_p)]),
    "vmmb_free": (ctypes.c_int, [_lease_p]),
    "vmmb_free_stream": (ctypes.c_int, [_lease_p, ctypes.c_void_p]),
    "vmmb_share": (ctypes.c_int, [_lease_p, ctypes.c_uint32, ctypes.c_uint, ctypes.c_char_p]),
    "vmmb_revoke": (ctypes.c_int, [_client_p, ctypes.c_char_p]),
    "vmmb_attach": (ctypes.c_int, [_client_p, ctypes.c_char_p, ctypes.c_uint, ctypes.POINTER(_lease_p)]),
    "vmmb_attach_name": (ctypes.c_int, [_client_p, ctypes.c_char_p, ctypes.c_uint, ctypes.POINTER(_lease_p)]),
    "vmmb_publish": (ctypes.c_int, [_lease_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint32),
                                    ctypes.c_size_t, ctypes.c_uint]),
    "vmmb_unpublish": (ctypes.c_int, [_client_p, ctypes.c_char_p]),
    "vmmb_tokens": (ctypes.c_int, [_lease_p, ctypes.POINTER(ctypes.POINTER(Token)),
                                   ctypes.POINTER(ctypes.c_size_t)]),
    "vmmb_tokens_free": (None, [ctypes.POINTER(Token), ctypes.c_size_t]),
    "vmmb_lease_ptr": (ctypes.c_uint64, [_lease_p]),
    "vmmb_lease_size": (ctypes.c_uint64, [_lease_p]),
    "vmmb_lease_device": (ctypes.c_int, [_lease_p]),
    "vmmb_lease_id": (ctypes.c_char_p, [_lease_p]),
    "vmmb_lease_owner": (ctypes.c_uint32, [_lease_p]),
    "vmmb_lease_owner_name": (ctypes.c_char_p, [_lease_p]),
    "vmmb_lease_readonly": (ctypes.c_int, [_lease_p]),
    "vmmb_error_message": (ctypes.c_char_p, []),
}

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None


def library_path() -> str:
    """What the package loads: $VMMBROKER_LIBRARY, else what the loader finds for "vmmbroker"."""
    env = os.environ.get("VMMBROKER_LIBRARY")
    if env:
        return env
    return ctypes.util.find_library("vmmbroker") or "libvmmbroker.so.0"


def lib() -> ctypes.CDLL:
    """The loaded library, with every function declared; loaded at the first call."""
    global _lib
    with _lock:
        if _lib is None:
            path = library_path()
            try:
                dll = ctypes.CDLL(path)
            except OSError as e:
                raise ImportError(f"vmmbroker: cannot load libvmmbroker ({path}): {e}; install it, "
                                  "or point $VMMBROKER_LIBRARY at libvmmbroker.so.0") from e
            for name, (restype, argtypes) in _PROTOTYPES.items():
                try:
                    f = getattr(dll, name)
                except AttributeError:
                    raise ImportError(f"vmmbroker: libvmmbroker ({path}) has no {name}(): it is older than "
                                      "this package needs (LIBVMMBROKER_0.7) or not libvmmbroker; install "
                                      "the library of this package's release, or point $VMMBROKER_LIBRARY "
                                      "at it") from None
                f.restype = restype
                f.argtypes = argtypes
            _lib = dll
        return _lib


def has_symbol(name: str) -> bool:
    """Whether the loaded library exports `name`."""
    try:
        getattr(lib(), name)
    except AttributeError:
        return False
    return True


def error_message() -> str:
    """vmmb_error_message(): the calling thread's last failure, as a sentence."""
    m = lib().vmmb_error_message()
    return m.decode("utf-8", "replace") if m else ""


def free_stream(lease: ctypes.c_void_p, stream: int) -> int:
    """vmmb_free_stream(lease, stream): 0 or -errno (stream 0: the legacy default stream)."""
    return lib().vmmb_free_stream(lease, stream or None)



_read_fn: Any = None


def lease_read(lease: ctypes.c_void_p, offset: int, address: Optional[int], n: int) -> int:
    """vmmb_lease_read(lease, offset, address, n): 0 or -errno; Error EOPNOTSUPP when the library is older
    than reading (LIBVMMBROKER_0.12). The function is declared once, at the first call."""
    global _read_fn
    f = _read_fn
    if f is None:
        try:
            f = lib().vmmb_lease_read
        except AttributeError:
            from ._errors import error
            raise error(errno.EOPNOTSUPP, f"libvmmbroker ({library_path()}) cannot read leases "
                                          "(vmmb_lease_read): update it.") from None
        f.restype = ctypes.c_int
        f.argtypes = [_lease_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
        _read_fn = f
    return f(lease, offset, address, n)


def _reclaim_functions(dll: ctypes.CDLL) -> tuple[Any, Any]:
    """vmmb_lease_set_reclaimable and vmmb_lease_reclaimed, declared; Error EOPNOTSUPP when the library
    is older than reclaimable leases (LIBVMMBROKER_0.6; lib() already fails on one older than 0.7, as it
    declares vmmb_alloc_among)."""
    try:
        mark, reclaimed = dll.vmmb_lease_set_reclaimable, dll.vmmb_lease_reclaimed
    except AttributeError:
        from ._errors import error
        raise error(errno.EOPNOTSUPP, f"libvmmbroker ({library_path()}) has no reclaimable leases "
                                      "(vmmb_lease_set_reclaimable): update it.") from None
    mark.restype = ctypes.c_int
    mark.argtypes = [_lease_p, ctypes.c_int, RECLAIM_FN, ctypes.c_void_p]
    reclaimed.restype = ctypes.c_int
    reclaimed.argtypes = [_lease_p]
    return mark, reclaimed


def set_reclaimable(lease: ctypes.c_void_p, priority: int, callback: Any) -> int:
    """vmmb_lease_set_reclaimable(lease, priority, callback, NULL); `callback` a RECLAIM_FN or None (NULL)."""
    mark, _ = _reclaim_functions(lib())
    return mark(lease, priority, callback if callback is not None else RECLAIM_FN(), None)


def lease_reclaimed(lease: ctypes.c_void_p) -> bool:
    """vmmb_lease_reclaimed(lease); False when the library has no such function (it reclaims nothing)."""
    try:
        _, reclaimed = _reclaim_functions(lib())
    except OSError:
        return False
    return bool(reclaimed(lease))


def _park_functions(dll: ctypes.CDLL) -> tuple[Any, Any, Any]:
    """vmmb_lease_park, vmmb_lease_unpark and vmmb_lease_parked, declared; Error EOPNOTSUPP when the library
    is older than parking (LIBVMMBROKER_0.9)."""
    try:
        park, unpark, parked = dll.vmmb_lease_park, dll.vmmb_lease_unpark, dll.vmmb_lease_parked
    except AttributeError:
        from ._errors import error
        raise error(errno.EOPNOTSUPP, f"libvmmbroker ({library_path()}) cannot park leases "
                                      "(vmmb_lease_park): update it.") from None
    park.restype = ctypes.c_int
    park.argtypes = [_lease_p, ctypes.c_void_p]
    unpark.restype = ctypes.c_int
    unpark.argtypes = [_lease_p]
    parked.restype = ctypes.c_int
    parked.argtypes = [_lease_p]
    return park, unpark, parked


def lease_park(lease: ctypes.c_void_p, stream: Optional[int]) -> int:
    """vmmb_lease_park(lease, stream): 1 in host memory now, 0 waiting for other holders, or -errno."""
    park, _, _ = _park_functions(lib())
    return park(lease, stream or None)


def lease_unpark(lease: ctypes.c_void_p) -> int:
    """vmmb_lease_unpark(lease): 0 or -errno."""
    _, unpark, _ = _park_functions(lib())
    return unpark(lease)


def lease_parked(lease: ctypes.c_void_p) -> bool:
    """vmmb_lease_parked(lease); False when the library cannot park (nothing is parked then)."""
    try:
        _, _, parked = _park_functions(lib())
    except OSError:
        return False
    return bool(parked(lease))


def free_keep(lease: ctypes.c_void_p) -> int:
    """vmmb_free_keep(lease); vmmb_free(lease) when the library is older than keeping (LIBVMMBROKER_0.11):
    keeping only saves work, so a plain free is what it falls back to."""
    dll = lib()
    try:
        f = dll.vmmb_free_keep
    except AttributeError:
        return dll.vmmb_free(lease)
    f.restype = ctypes.c_int
    f.argtypes = [_lease_p]
    return f(lease)


def give_back_kept(client: ctypes.c_void_p) -> int:
    """vmmb_give_back_kept(client): how many leases were given back, or -errno; 0 when the library is older
    than keeping (it kept nothing)."""
    dll = lib()
    try:
        f = dll.vmmb_give_back_kept
    except AttributeError:
        return 0
    f.restype = ctypes.c_int
    f.argtypes = [_client_p]
    return f(client)
