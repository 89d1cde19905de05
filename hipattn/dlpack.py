"""DLPack's side of ``arrays.as_device_array``: a minimal ctypes reader of ``DLManagedTensor``
(legacy) and ``DLManagedTensorVersioned`` (DLPack 1.x), and the owner that runs a consumed tensor's
deleter once.

The structs are laid out as DLPack's C ABI defines them; nothing here imports a framework or touches
the GPU, so every check runs before anything is enqueued.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

from .device_array import (
    ELEMENT_SIZE,
    POINTER_LIMIT,
    DeviceArray,
    checked_device,
    contiguous_strides,
    nonzero_size,
    null_pointer_message,
    unchecked_device_array,
)

_KDL_CPU, _KDL_CUDA, _KDL_CUDA_HOST, _KDL_ROCM = 1, 2, 3, 10
_DL_DEVICE_NAME = {
    1: "CPU",
    2: "CUDA",
    3: "CUDA host (pinned)",
    4: "OpenCL",
    7: "Vulkan",
    8: "Metal",
    9: "VPI",
    10: "ROCm",
    11: "ROCm host (pinned)",
    13: "CUDA managed",
    14: "oneAPI",
}
_DL_FLAG_READ_ONLY = 1

# DLPack (code, bits) with lanes == 1. Code 4 is kDLBfloat.
_DL_DTYPE = {
    (0, 8): "int8",
    (0, 16): "int16",
    (0, 32): "int32",
    (0, 64): "int64",
    (1, 8): "uint8",
    (2, 16): "fp16",
    (2, 32): "fp32",
    (2, 64): "fp64",
    (4, 16): "bf16",
    (6, 8): "bool",
}


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


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", _DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _DLTensor),
    ]


def _python_api(name: str, restype: Any, argtypes: list[Any]) -> Any:
    # pythonapi[name] makes a private function object: setting argtypes on the shared attribute
    # (pythonapi.PyCapsule_IsValid) would change it for every other library in the process.
    function = ctypes.pythonapi[name]
    function.restype = restype
    function.argtypes = argtypes
    return function


_capsule_is_valid = _python_api("PyCapsule_IsValid", ctypes.c_int, [ctypes.py_object, ctypes.c_char_p])
_capsule_get_pointer = _python_api(
    "PyCapsule_GetPointer", ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
)
_capsule_set_name = _python_api("PyCapsule_SetName", ctypes.c_int, [ctypes.py_object, ctypes.c_char_p])

# PyCapsule_SetName stores the pointer, it does not copy the string: these bytes objects are
# module globals so the names outlive every capsule renamed with them.
_NAME = b"dltensor"
_USED_NAME = b"used_dltensor"
_NAME_VERSIONED = b"dltensor_versioned"
_USED_NAME_VERSIONED = b"used_dltensor_versioned"

# (capsule name, the name that marks it consumed, the struct it holds), newest protocol first.
_CAPSULE_KINDS = (
    (_NAME_VERSIONED, _USED_NAME_VERSIONED, _DLManagedTensorVersioned),
    (_NAME, _USED_NAME, _DLManagedTensor),
)


class DLPackOwner:
    """Owns one consumed DLPack tensor: keeps the capsule and producer alive, runs the deleter once.

    The protocol hands ownership to the consumer when it renames the capsule to 'used_dltensor'
    (the producer's capsule destructor then does nothing), so the consumer must call the managed
    tensor's deleter when it is done. hipattn is done when this owner, held by the DeviceArray,
    is collected. The deleter is called through a GIL-releasing ctypes call: the protocol lets it
    run on any thread and requires producers to take the GIL themselves if they need it.
    """

    __slots__ = ("producer", "capsule", "_managed", "_deleter", "__weakref__")

    def __init__(self, producer: Any, capsule: Any, managed: int, deleter: int | None):
        self.producer = producer
        self.capsule = capsule
        self._managed = managed
        self._deleter = deleter

    def release(self) -> None:
        """Run the producer's deleter now (idempotent). Only once no enqueued work reads the data."""
        deleter, self._deleter = self._deleter, None
        if deleter:
            _DELETER(deleter)(self._managed)

    def __del__(self) -> None:
        # At interpreter shutdown the producer's runtime may already be gone; leaking is harmless.
        if not sys.is_finalizing():
            self.release()


def dlpack_device(obj: Any) -> tuple[int, int] | None:
    """``obj.__dlpack_device__()`` as (device_type, device_id), or None when it has none. Consumes nothing."""
    probe = getattr(obj, "__dlpack_device__", None)
    if probe is None:
        return None
    device_type, device_id = probe()
    return int(device_type), int(device_id)


def _dlpack_stream_argument(device_type: int, stream: int | None) -> int | None:
    if stream is None:
        return None  # the protocol's default: legacy stream on CUDA, 0 on ROCm
    if device_type == _KDL_CUDA and stream == 0:
        # hipattn's handle 0 is the legacy default stream; on CUDA the protocol spells it 1 (0 is illegal).
        return 1
    return stream


def from_dlpack(obj: Any, name: str, stream: int | None) -> DeviceArray:
    device = dlpack_device(obj)
    if device is not None and device[0] not in (_KDL_CUDA, _KDL_ROCM):
        raise ValueError(_dlpack_wrong_device(obj, name, device[0]))
    stream_arg = None if device is None else _dlpack_stream_argument(device[0], stream)
    try:
        capsule = obj.__dlpack__(stream=stream_arg, max_version=(1, 0))
    except TypeError:  # a producer from before DLPack 1.0 knows no max_version
        capsule = obj.__dlpack__(stream=stream_arg)

    kind = next((kind for kind in _CAPSULE_KINDS if _capsule_is_valid(capsule, kind[0])), None)
    if kind is None:
        raise TypeError(f"{name}.__dlpack__() returned {capsule!r}, not an unconsumed DLPack capsule")
    capsule_name, used_name, struct = kind
    address = _capsule_get_pointer(capsule, capsule_name)
    if not address:
        raise TypeError(f"{name}.__dlpack__() returned a capsule holding a null pointer")
    _capsule_set_name(capsule, used_name)
    managed = struct.from_address(address)
    owner = DLPackOwner(obj, capsule, address, managed.deleter)
    versioned = struct is _DLManagedTensorVersioned
    if versioned and managed.version.major != 1:
        raise TypeError(f"{name} exports DLPack version {managed.version.major}; hipattn reads 1.x")
    tensor = managed.dl_tensor
    readonly = versioned and bool(managed.flags & _DL_FLAG_READ_ONLY)

    # From here on the owner holds the tensor; any error below drops it and runs the deleter.
    device_type = tensor.device.device_type
    if device_type not in (_KDL_CUDA, _KDL_ROCM):
        raise ValueError(_dlpack_wrong_device(obj, name, device_type))
    code, bits, lanes = tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes
    dtype = _DL_DTYPE.get((code, bits)) if lanes == 1 else None
    if dtype is None:
        raise TypeError(
            f"{name} has DLPack dtype (code {code}, bits {bits}, lanes {lanes}); hipattn handles "
            f"{', '.join(ELEMENT_SIZE)}"
        )
    ndim = tensor.ndim
    if ndim < 0:
        raise ValueError(f"{name} exports a DLPack tensor with ndim {ndim}; expected >= 0")
    shape = tuple(tensor.shape[i] for i in range(ndim))
    if any(extent < 0 for extent in shape):
        raise ValueError(f"{name} exports a DLPack tensor of shape {shape}, which has a negative extent")
    if tensor.strides:
        strides = tuple(tensor.strides[i] for i in range(ndim))  # int64 by the struct: always in range
    else:
        strides = contiguous_strides(shape)
    ptr = (tensor.data or 0) + tensor.byte_offset
    if ptr >= POINTER_LIMIT:
        raise ValueError(
            f"{name} exports a DLPack tensor at 0x{tensor.data or 0:x} + byte_offset {tensor.byte_offset}, "
            "past the end of a 64-bit address space"
        )
    if ptr == 0 and nonzero_size(shape):
        raise ValueError(null_pointer_message(name, shape))
    device = checked_device(tensor.device.device_id, f"{name}'s DLPack device_id")
    return unchecked_device_array(ptr, shape, strides, dtype, device, "dlpack", owner, None, readonly)


def _dlpack_wrong_device(obj: Any, name: str, device_type: int) -> str:
    where = _DL_DEVICE_NAME.get(device_type, f"type {device_type}")
    host = " (a host array)" if device_type in (_KDL_CPU, _KDL_CUDA_HOST, 11) else ""
    return (
        f"{name} ({type(obj).__module__}.{type(obj).__qualname__}) lives on a DLPack {where} device{host}; "
        "hipattn needs arrays in CUDA or ROCm device memory"
    )
