# SPDX-License-Identifier: MIT
"""DLPack export: a PyCapsule named "dltensor" holding a DLManagedTensor (DLPack 0.x, the legacy,
unversioned struct every framework takes), built with ctypes.

The DLManagedTensor, its shape and its strides live in ctypes objects that a
module-level table keeps alive, keyed by the struct's address, until the
tensor's deleter runs. The deleter (one ctypes callback for every export)
drops that entry and tells the owner (a Lease) that one export is gone; the
owner keeps its lease mapped while any export lives. The capsule's destructor
calls the deleter only when the capsule was never consumed (its name is still
"dltensor"): a consumer renames it "used_dltensor" and calls the deleter
itself when its tensor dies (the DLPack Python specification).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Protocol, Sequence

from ._dtypes import DType

KDL_CUDA = 2                    # DLDeviceType kDLCUDA

CAPSULE_NAME = b"dltensor"
USED_CAPSULE_NAME = b"used_dltensor"


class DLDevice(ctypes.Structure):
    """DLPack's DLDevice: the device type (KDL_CUDA here) and the CUDA device index."""
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    """DLPack's DLDataType: type code, bits per lane, lanes (1 for every dtype exported here)."""
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    """DLPack's DLTensor (DLPack 0.x and the unversioned capsule): a device pointer, its device, shape and
    strides in elements (NULL strides: C-contiguous), and a byte offset."""
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    """DLPack's DLManagedTensor: the DLTensor, the producer's context, and the deleter the consumer calls
    when it is done with the memory (which releases the export's hold on the lease)."""
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER)]


class Owner(Protocol):
    """What an exported object does for its exports."""
    def _export_acquire(self) -> None: ...
    def _export_release(self) -> None: ...


class _Export:
    __slots__ = ("owner", "managed", "shape", "strides")

    def __init__(self, owner: Owner, managed: DLManagedTensor, shape: Any, strides: Any) -> None:
        self.owner = owner
        self.managed = managed
        self.shape = shape
        self.strides = strides


_live: dict[int, _Export] = {}
_live_lock = threading.Lock()


def live_exports() -> int:
    """How many exported tensors have not been deleted yet, in the whole process."""
    with _live_lock:
        return len(_live)


def _deleter(address: int) -> None:
    # DLManagedTensor.deleter: may run in any thread (ctypes takes the GIL), once per tensor.
    lock, live = _live_lock, _live
    if lock is None or live is None:    # interpreter shutdown: nothing left to release
        return
    with lock:
        e = live.pop(address, None)
    if e is not None:
        e.owner._export_release()


_DELETER = DELETER(_deleter)

_name = ctypes.create_string_buffer(CAPSULE_NAME)     # the capsule's name must outlive the capsule

_api = ctypes.pythonapi
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
# The destructor's own calls take the dying capsule as a plain address: no reference may be made to it.
_capsule_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", _api))
_capsule_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _api))


def _capsule_destructor(capsule: int) -> None:
    if _capsule_is_valid(capsule, CAPSULE_NAME):        # not consumed: the tensor is still ours to delete
        address = _capsule_get_pointer(capsule, CAPSULE_NAME)
        if address:
            DLManagedTensor.from_address(address).deleter(address)


_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_capsule_destructor)


def export(owner: Owner, data: int, device: int, dtype: DType, shape: Sequence[int]) -> Any:
    """A "dltensor" capsule over `data` (a CUDA device address) on `device`, C-contiguous.

    Calls owner._export_acquire() first (which may raise to refuse) and
    owner._export_release() from the tensor's deleter.
    """
    ndim = len(shape)
    shape_array = (ctypes.c_int64 * max(ndim, 1))(*shape)
    strides_array = (ctypes.c_int64 * max(ndim, 1))()
    step = 1
    for i in reversed(range(ndim)):
        strides_array[i] = step
        step *= shape[i]
    m = DLManagedTensor()
    t = m.dl_tensor
    t.data = data or None
    t.device = DLDevice(KDL_CUDA, device)
    t.ndim = ndim
    t.dtype = DLDataType(dtype.dl_code, dtype.dl_bits, 1)
    t.shape = ctypes.cast(shape_array, ctypes.POINTER(ctypes.c_int64))
    t.strides = ctypes.cast(strides_array, ctypes.POINTER(ctypes.c_int64))
    t.byte_offset = 0
    address = ctypes.addressof(m)
    m.manager_ctx = address
    m.deleter = _DELETER
    owner._export_acquire()
    with _live_lock:
        _live[address] = _Export(owner, m, shape_array, strides_array)
    try:
        return _api.PyCapsule_New(address, ctypes.cast(_name, ctypes.c_char_p),
                                  ctypes.cast(_CAPSULE_DESTRUCTOR, ctypes.c_void_p))
    except BaseException:
        _deleter(address)
        raise


def check_dlpack_args(device: int, stream: Any, max_version: Any, dl_device: Any,
                      copy: Any) -> None:
    """Validates __dlpack__'s keyword arguments for an export of memory on CUDA device `device`."""
    if stream is not None and (not isinstance(stream, int) or isinstance(stream, bool)):
        raise TypeError(f"stream must be None or an int (a CUDA stream), not {type(stream).__name__}")
    if max_version is not None:
        if not (isinstance(max_version, tuple) and len(max_version) == 2):
            raise TypeError("max_version must be None or a (major, minor) tuple")
    if dl_device is not None:
        if tuple(dl_device) != (KDL_CUDA, device):
            raise BufferError(f"the memory is on CUDA device {device}, dl_device {tuple(dl_device)} "
                              "would need a copy, which a lease does not make")
    if copy:
        raise BufferError("copy=True: a lease exports its own memory, it does not make copies")
