"""Tensors across the host boundary through DLPack, bf16 included (docs/design ARCHITECTURE).

``to_numpy(x)`` gives a NumPy view of any ``__dlpack__`` producer on the CPU (torch tensors,
NumPy arrays, ...) without copying. Integer and float tensors go through ``np.from_dlpack``;
bfloat16 tensors (DLPack type code 4, ``kDLBfloat``), which NumPy refuses, are consumed here
with ctypes and come back as ``ml_dtypes.bfloat16`` views of the producer's memory, strides
and storage offset included. The view keeps the producer's buffer alive and calls its DLPack
deleter when the view (and every view of it) is gone.

``from_numpy_like(array, like)`` hands a result back as the caller's type: a CPU torch tensor
sharing the array's memory when ``like`` is a torch tensor, the NumPy array otherwise.
"""

from __future__ import annotations

import ctypes
import sys
import weakref

import ml_dtypes
import numpy as np

from .errors import NotSupported

__all__ = ["KDL_BFLOAT", "KDL_CPU", "from_numpy_like", "is_torch_tensor", "to_numpy"]

#: DLPack device type of host memory.
KDL_CPU = 1
#: DLPack type code of bfloat16.
KDL_BFLOAT = 4

_KDL_INT, _KDL_UINT, _KDL_FLOAT, _KDL_COMPLEX, _KDL_BOOL = 0, 1, 2, 5, 6
_CODE_NAMES = {0: "int", 1: "uint", 2: "float", 3: "opaque handle", 4: "bfloat", 5: "complex", 6: "bool",
               7: "float8_e3m4", 8: "float8_e4m3", 9: "float8_e4m3b11fnuz", 10: "float8_e4m3fn",
               11: "float8_e4m3fnuz", 12: "float8_e5m2", 13: "float8_e5m2fnuz", 14: "float8_e8m0fnu",
               15: "float6_e2m3fn", 16: "float6_e3m2fn", 17: "float4_e2m1fn"}
_DEVICE_NAMES = {1: "CPU", 2: "CUDA", 3: "CUDA host", 4: "OpenCL", 7: "Vulkan", 8: "Metal", 9: "VPI",
                 10: "ROCm", 11: "ROCm host", 12: "ExtDev", 13: "CUDA managed", 14: "oneAPI",
                 15: "WebGPU", 16: "Hexagon", 17: "MAIA"}
#: (code, bits) pairs that cross the boundary; everything else is a TypeError.
_SUPPORTED = {(_KDL_INT, b) for b in (8, 16, 32, 64)} | {(_KDL_UINT, b) for b in (8, 16, 32, 64)} \
    | {(_KDL_FLOAT, b) for b in (16, 32, 64)} | {(KDL_BFLOAT, 16)}

_FLAG_READ_ONLY = 1 << 0


# ---- the DLPack C structures (dlpack.h, v1.x; the legacy DLManagedTensor of v0.x) ---------


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", _DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", _Deleter),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _DLTensor),
    ]


_LEGACY = b"dltensor"
_VERSIONED = b"dltensor_versioned"
# PyCapsule_SetName keeps the pointer, not a copy: these buffers live as long as the module.
_USED_LEGACY = ctypes.create_string_buffer(b"used_dltensor")
_USED_VERSIONED = ctypes.create_string_buffer(b"used_dltensor_versioned")

_api = ctypes.pythonapi
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_SetName.restype = ctypes.c_int
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_void_p]


# ---- import ------------------------------------------------------------------------------


def _device_name(device_type: int) -> str:
    return _DEVICE_NAMES.get(device_type, f"device type {device_type}")


def _check_device(device, what: str) -> None:
    device_type = int(device[0])
    if device_type != KDL_CPU:
        raise NotSupported(
            f"{what}: the tensor is on a {_device_name(device_type)} device "
            f"(DLPack device {(device_type, int(device[1]))}); only host (kDLCPU) memory is read "
            "here: move it to the CPU first (e.g. tensor.cpu())"
        )


def _check_dtype(code: int, bits: int, lanes: int, what: str) -> None:
    if lanes != 1:
        raise TypeError(f"{what}: vector DLPack dtypes (lanes={lanes}) are not supported")
    if (code, bits) not in _SUPPORTED:
        name = _CODE_NAMES.get(code, f"type code {code}")
        if code in (_KDL_INT, _KDL_UINT, _KDL_FLOAT, KDL_BFLOAT, _KDL_COMPLEX):
            name += str(bits)
        raise TypeError(
            f"{what}: unsupported DLPack dtype {name} (code {code}, bits {bits}); "
            "expected a float (fp16/fp32/fp64), bfloat16 or integer tensor"
        )


class _Capsule:
    """A capsule already taken from the producer, offered again to ``np.from_dlpack``."""

    def __init__(self, capsule):
        self._capsule = capsule

    def __dlpack__(self, **kwargs):
        capsule, self._capsule = self._capsule, None
        if capsule is None:
            raise BufferError("the DLPack capsule was already consumed")
        return capsule

    def __dlpack_device__(self):
        return (KDL_CPU, 0)


class _Owner:
    """The base of a bf16 view: holds the producer's managed tensor until the view goes."""

    __slots__ = ("__array_interface__", "__weakref__")

    def __init__(self, interface: dict, managed: int, deleter):
        self.__array_interface__ = interface
        if deleter:
            fin = weakref.finalize(self, _release, deleter, managed)
            fin.atexit = False  # at exit the producer's library may already be gone


def _release(deleter, managed: int) -> None:
    deleter(managed)


def _export(obj):
    """A capsule from ``obj``: versioned (DLPack >= 1.0) if the producer can, legacy if not."""
    try:
        return obj.__dlpack__(max_version=(1, 0))
    except TypeError:  # a producer older than the v2023.12 Python protocol
        return obj.__dlpack__()


def _bf16_view(capsule, versioned: bool, managed: int, t: _DLTensor, read_only: bool, deleter) -> np.ndarray:
    ndim = t.ndim
    shape = tuple(int(t.shape[i]) for i in range(ndim)) if ndim else ()
    if t.strides and ndim:
        strides = tuple(int(t.strides[i]) * 2 for i in range(ndim))
    else:  # NULL strides: compact row-major
        strides, step = [], 2
        for n in reversed(shape):
            strides.append(step)
            step *= max(n, 1)
        strides = tuple(reversed(strides))
    size = int(np.prod(shape, dtype=np.int64))
    if size and not t.data:
        raise ValueError("DLPack tensor with a NULL data pointer")

    # The capsule is ours from here: rename it so that its destructor leaves the tensor alone.
    used = _USED_VERSIONED if versioned else _USED_LEGACY
    if _api.PyCapsule_SetName(capsule, ctypes.addressof(used)) != 0:
        raise BufferError("cannot mark the DLPack capsule as used")
    if size == 0:  # nothing to view: release the producer's tensor now
        if deleter:
            deleter(managed)
        return np.empty(shape, dtype=ml_dtypes.bfloat16)
    interface = {
        "version": 3,
        "shape": shape,
        "typestr": "<u2" if sys.byteorder == "little" else ">u2",
        "data": ((t.data or 0) + int(t.byte_offset), read_only),
        "strides": strides,
    }
    owner = _Owner(interface, managed, deleter)
    return np.asarray(owner).view(ml_dtypes.bfloat16)


def to_numpy(obj, what: str = "tensor") -> np.ndarray:
    """A NumPy array over ``obj``'s memory, without copying.

    NumPy arrays come back as they are. Any object with ``__dlpack__`` (torch tensors, ...)
    must be on the CPU and hold integers, fp16/fp32/fp64 (through ``np.from_dlpack``) or
    bfloat16 (an ``ml_dtypes.bfloat16`` view built here, strides and offset included). A
    producer that marks its tensor read-only gives a read-only view.

    Raises ``NotSupported`` (a ``ValueError``) for a tensor not in host memory, and
    ``TypeError`` for other dtypes (complex, bool, fp8, vector lanes) or for an object that
    is neither an array nor a DLPack producer.
    """
    if isinstance(obj, np.ndarray):
        return obj
    if not hasattr(obj, "__dlpack__"):
        raise TypeError(f"{what}: expected a NumPy array or a DLPack producer, got {type(obj).__name__}")
    if hasattr(obj, "__dlpack_device__"):  # before exporting, so nothing is consumed in vain
        _check_device(obj.__dlpack_device__(), what)

    capsule = _export(obj)
    if _api.PyCapsule_IsValid(capsule, _VERSIONED):
        versioned = True
        managed = _api.PyCapsule_GetPointer(capsule, _VERSIONED)
        m = _DLManagedTensorVersioned.from_address(managed)
        if m.version.major != 1:
            raise BufferError(f"{what}: DLPack version {m.version.major}.{m.version.minor} is not supported")
        read_only = bool(m.flags & _FLAG_READ_ONLY)
    elif _api.PyCapsule_IsValid(capsule, _LEGACY):
        versioned = False
        managed = _api.PyCapsule_GetPointer(capsule, _LEGACY)
        m = _DLManagedTensor.from_address(managed)
        read_only = False
    else:
        raise ValueError(f"{what}: __dlpack__ returned {capsule!r}, not an unused DLPack capsule")

    # Errors up to the rename leave the capsule to its own destructor, which frees the tensor.
    t = m.dl_tensor
    _check_device((t.device.device_type, t.device.device_id), what)
    _check_dtype(t.dtype.code, t.dtype.bits, t.dtype.lanes, what)
    if t.dtype.code == KDL_BFLOAT:
        # Copy the deleter's address out of the struct it frees.
        deleter = _Deleter(ctypes.cast(m.deleter, ctypes.c_void_p).value or 0)
        return _bf16_view(capsule, versioned, managed, t, read_only, deleter)
    return np.from_dlpack(_Capsule(capsule))


# ---- export ------------------------------------------------------------------------------


def is_torch_tensor(x) -> bool:
    """Whether ``x`` is a torch tensor (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def from_numpy_like(array, like):
    """``array`` as ``like``'s type: a torch tensor when ``like`` is one (sharing the array's
    memory when torch can: non-negative strides; bf16 as ``torch.bfloat16``; moved to
    ``like``'s device if that is not the CPU), else the NumPy array itself.

    A torch tensor over a read-only array is writable (torch has no read-only tensors):
    writing through it writes the array's memory.
    """
    a = np.asarray(array)
    if not is_torch_tensor(like):
        return a
    import torch

    if any(s < 0 or s % a.itemsize for s in a.strides):  # torch cannot view these
        a = np.ascontiguousarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        out = torch.from_dlpack(a.view(np.int16)).view(torch.bfloat16)
    else:
        out = torch.from_dlpack(a)
    if like.device.type != "cpu":
        out = out.to(like.device)
    return out
