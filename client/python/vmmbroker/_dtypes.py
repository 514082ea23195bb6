# SPDX-License-Identifier: MIT
"""Element types of lease views: their names, CUDA Array Interface typestrs and DLPack codes."""

from __future__ import annotations

from typing import Any, NamedTuple

# DLDataTypeCode (dlpack.h)
DL_INT, DL_UINT, DL_FLOAT, DL_BFLOAT, DL_COMPLEX, DL_BOOL = 0, 1, 2, 4, 5, 6


class DType(NamedTuple):
    """One element type."""
    name: str           # "float32"
    itemsize: int       # bytes per element
    typestr: str        # the NumPy array interface's typestr, as __cuda_array_interface__ takes it
    dl_code: int        # DLDataTypeCode
    dl_bits: int        # DLDataType.bits


def _t(name: str, size: int, typestr: str, code: int) -> DType:
    return DType(name, size, typestr, code, size * 8)


# bfloat16 has no NumPy typestr; "<V2" is what ml_dtypes (JAX) and PyTorch use for it, and DLPack has a
# code of its own (kDLBfloat), so consumers of DLPack see it as bfloat16 and CAI consumers as 2 raw bytes.
DTYPES: dict[str, DType] = {d.name: d for d in (
    _t("bool", 1, "|b1", DL_BOOL),
    _t("int8", 1, "|i1", DL_INT),
    _t("int16", 2, "<i2", DL_INT),
    _t("int32", 4, "<i4", DL_INT),
    _t("int64", 8, "<i8", DL_INT),
    _t("uint8", 1, "|u1", DL_UINT),
    _t("uint16", 2, "<u2", DL_UINT),
    _t("uint32", 4, "<u4", DL_UINT),
    _t("uint64", 8, "<u8", DL_UINT),
    _t("float16", 2, "<f2", DL_FLOAT),
    _t("bfloat16", 2, "<V2", DL_BFLOAT),
    _t("float32", 4, "<f4", DL_FLOAT),
    _t("float64", 8, "<f8", DL_FLOAT),
    _t("complex64", 8, "<c8", DL_COMPLEX),
    _t("complex128", 16, "<c16", DL_COMPLEX),
)}

ALIASES = {
    "half": "float16", "float": "float32", "double": "float64", "bf16": "bfloat16",
    "fp16": "float16", "fp32": "float32", "fp64": "float64", "byte": "uint8",
    "short": "int16", "int": "int32", "long": "int64", "cfloat": "complex64", "cdouble": "complex128",
}


def dtype(d: Any) -> DType:
    """The DType for a name ("float32", "bf16"...), or an object whose str() is one
    (numpy.dtype("float32"), torch.float32)."""
    if isinstance(d, DType):
        return d
    name = d if isinstance(d, str) else str(d)
    if name.startswith("torch."):
        name = name[len("torch."):]
    name = ALIASES.get(name, name)
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {d!r}: one of {', '.join(DTYPES)}") from None
