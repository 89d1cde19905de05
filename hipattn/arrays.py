"""Device arrays from any framework, as one small frozen description.

hipattn launches on raw device pointers. ``as_device_array`` turns what a user passes (a PyTorch
tensor, a CuPy array, anything with ``__cuda_array_interface__`` or ``__dlpack__``) into a
``DeviceArray``: pointer, shape, strides in elements, dtype name, device ordinal, and the original
object kept alive. Users with nothing but a pointer call ``raw_array``.

Order of the checks, cheapest and most exact first:

1. ``torch.Tensor`` and ``cupy.ndarray`` through their attributes (a few attribute reads, and the
   only way to tell bf16 from other 2-byte types without DLPack). Neither module is ever imported
   here: if a user passes a tensor, its module is already in ``sys.modules``.
2. ``__cuda_array_interface__`` (v2 and v3). CAI has no bf16 spelling (``<V2``), so a bf16 array
   must come through DLPack or as a torch/cupy object. A v3 ``stream`` is kept on the array
   (``DeviceArray.stream``) for ``streams.resolve_stream``.
3. ``__dlpack__`` through a minimal ctypes reader of ``DLManagedTensor`` (legacy) and
   ``DLManagedTensorVersioned`` (DLPack 1.x).

Nothing here touches the GPU runtime, so every check runs before anything is enqueued.
"""

from __future__ import annotations

import ctypes
import operator
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# ---- dtypes -----------------------------------------------------------------------------------

_ELEMENT_SIZE = {
    "bool": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "fp16": 2,
    "bf16": 2,
    "int32": 4,
    "fp32": 4,
    "int64": 8,
    "fp64": 8,
}

# NumPy/CuPy dtype names (and ml_dtypes' bfloat16) to hipattn's names.
_NUMPY_NAME = {
    "bool": "bool",
    "int8": "int8",
    "uint8": "uint8",
    "int16": "int16",
    "float16": "fp16",
    "bfloat16": "bf16",
    "int32": "int32",
    "float32": "fp32",
    "int64": "int64",
    "float64": "fp64",
}
_TO_NUMPY_NAME = {v: k for k, v in _NUMPY_NAME.items()}

# CAI typestrings. '<V2' (PyTorch's bf16) is deliberately absent: see _cai_dtype.
_TYPESTR = {
    "|b1": "bool",
    "|i1": "int8",
    "|u1": "uint8",
    "<i2": "int16",
    "<f2": "fp16",
    "<i4": "int32",
    "<f4": "fp32",
    "<i8": "int64",
    "<f8": "fp64",
}

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

# torch spells its dtypes (torch.float16, torch.bfloat16, ...) with NumPy's names.
_TORCH_DTYPE_ATTRS = _NUMPY_NAME

# A CAI array whose producer says nothing about its device (CAI has no device field) and for
# which no pointer_device resolver was given. The launch path asks the runtime about its pointer or
# lets the other arrays decide (attention._settle_devices); -1 never reaches the runtime.
UNKNOWN_DEVICE = -1

# The widths of the fields these values end up in: kernel pointers are u64, strides i64.
POINTER_LIMIT = 1 << 64
_STRIDE_MIN, _STRIDE_MAX = -(1 << 63), (1 << 63) - 1


def element_size(dtype: str) -> int:
    """Bytes per element of a hipattn dtype name ('fp16', 'bf16', 'fp32', 'int32', 'int64', ...)."""
    try:
        return _ELEMENT_SIZE[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(_ELEMENT_SIZE)}") from None


# ---- the description --------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceArray:
    """One device array as hipattn sees it. ``strides`` are in elements, not bytes.

    ``owner`` keeps the producer's memory alive for as long as this description exists (the
    original tensor, or for DLPack the managed tensor whose deleter runs when the owner dies).
    ``stream`` is the producer's stream from CAI v3 (the data is ready in that stream's order),
    None when the producer named none.
    """

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    device: int
    framework: str  # 'torch' | 'cupy' | 'cai' | 'dlpack' | 'raw'
    # Equality and hashing ignore the owner (a torch tensor's == is elementwise).
    owner: Any = field(default=None, compare=False, repr=False)
    stream: int | None = None
    readonly: bool = False

    def __post_init__(self) -> None:
        # Runs for DeviceArrays built by hand only: the readers below build theirs through
        # _device_array, after checking each field with the argument's name.
        shape = _int_tuple(self.shape, "shape", "DeviceArray")
        strides = _int_tuple(self.strides, "strides", "DeviceArray", allow_negative=True)
        if len(strides) != len(shape):
            raise ValueError(f"DeviceArray got {len(shape)}-d shape {shape} but strides {strides}")
        _check_strides(strides, "DeviceArray")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "strides", strides)
        _check_pointer(self.ptr, "DeviceArray")
        element_size(self.dtype)
        if isinstance(self.device, bool) or not isinstance(self.device, int) or self.device < UNKNOWN_DEVICE:
            raise ValueError(
                f"DeviceArray got device {self.device!r}; expected a device ordinal >= 0 "
                f"(or {UNKNOWN_DEVICE}: unknown, settled from the other arrays of a call)"
            )

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        n = 1
        for extent in self.shape:
            n *= extent
        return n

    @property
    def nbytes(self) -> int:
        return self.size * _ELEMENT_SIZE[self.dtype]


_new_object = object.__new__


def _device_array(
    ptr: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: str,
    device: int,
    framework: str,
    owner: Any,
    stream: int | None = None,
    readonly: bool = False,
) -> DeviceArray:
    # The hot-path constructor: the frozen dataclass __init__ sets each field through
    # object.__setattr__ (~1.5 us); filling __dict__ directly builds the same object in ~0.6 us.
    array = _new_object(DeviceArray)
    array.__dict__.update(
        ptr=ptr, shape=shape, strides=strides, dtype=dtype, device=device,
        framework=framework, owner=owner, stream=stream, readonly=readonly,
    )  # fmt: skip
    return array


def derived_array(
    base: DeviceArray, ptr: int, shape: tuple[int, ...], strides: tuple[int, ...], dtype: str, owner: Any
) -> DeviceArray:
    """A view hipattn itself carves out of ``base`` (a workspace section): on ``base``'s device and
    framework, built without checking its fields again, as they were derived from checked ones."""
    return _device_array(ptr, shape, strides, dtype, base.device, base.framework, owner)


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """C-order strides in elements for ``shape``."""
    strides = [0] * len(shape)
    step = 1
    for axis in range(len(shape) - 1, -1, -1):
        strides[axis] = step
        step *= max(int(shape[axis]), 1)
    return tuple(strides)


def raw_array(
    ptr: int,
    shape: Sequence[int],
    dtype: str,
    device: int,
    strides: Sequence[int] | None = None,
) -> DeviceArray:
    """Describe memory a user has only a pointer to. ``strides`` in elements; None means C-contiguous."""
    _check_pointer(ptr, "raw_array")
    element_size(dtype)  # validates the name
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(f"raw_array needs the device ordinal as an int; got {device!r}")
    if device < 0:
        raise ValueError(f"raw_array needs a device ordinal >= 0; got {device!r}")
    shape_t = _int_tuple(shape, "shape", "raw_array")
    if strides is None:
        strides_t = contiguous_strides(shape_t)
    else:
        strides_t = _int_tuple(strides, "strides", "raw_array", allow_negative=True)
        if len(strides_t) != len(shape_t):
            raise ValueError(f"raw_array got {len(shape_t)}-d shape {shape_t} but strides {strides_t}")
    _check_strides(strides_t, "raw_array")
    if ptr == 0 and _nonzero_size(shape_t):
        raise ValueError(f"raw_array got a null pointer for a non-empty array of shape {shape_t}")
    return _device_array(ptr, shape_t, strides_t, dtype, device, "raw", None)


# ---- entry point ------------------------------------------------------------------------------

# type -> 'torch' | 'cupy' | 'other': a dict hit after the first call with each type. Caching
# 'other' is safe: a class that is not a torch.Tensor/cupy.ndarray subclass now never becomes one.
_KIND_BY_TYPE: dict[type, str] = {}


def as_device_array(
    obj: Any,
    name: str,
    *,
    stream: int | None = None,
    pointer_device: Callable[[int], int] | None = None,
) -> DeviceArray:
    """Describe ``obj`` (torch/cupy/CAI/DLPack device array, or a DeviceArray) for a launch.

    ``name`` is the argument's name in error messages ("q", "cu_seqlens_k").
    ``stream`` is the consumer stream handle hipattn will launch on; only DLPack uses it (the
    producer makes that stream wait for its pending writes). None follows the protocol's default:
    the legacy default stream on CUDA, stream 0 on ROCm.
    ``pointer_device`` maps a pointer to its device ordinal (the backend's pointer query); it is
    only consulted for CAI objects, whose interface carries no device.
    """
    if isinstance(obj, DeviceArray):
        # Its fields were checked when it was built; a null pointer is only wrong once it is a
        # call's argument (an empty array may have no memory), so it is named here.
        if not obj.ptr and _nonzero_size(obj.shape):
            raise ValueError(_null_pointer(name, obj.shape))
        return obj
    cls = type(obj)
    kind = _KIND_BY_TYPE.get(cls)
    if kind is None:
        kind = _classify(cls)
    if kind == "torch":
        return _from_torch(obj, name)
    if kind == "cupy":
        return _from_cupy(obj, name)
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        return _from_cai(obj, cai, name, pointer_device)
    if hasattr(obj, "__dlpack__"):
        return _from_dlpack(obj, name, stream)
    raise TypeError(_not_a_device_array(obj, name))


def _classify(cls: type) -> str:
    torch = sys.modules.get("torch")
    if (
        torch is not None
        and isinstance(getattr(torch, "Tensor", None), type)
        and issubclass(cls, torch.Tensor)
    ):
        _KIND_BY_TYPE[cls] = "torch"
        return "torch"
    cupy = sys.modules.get("cupy")
    if (
        cupy is not None
        and isinstance(getattr(cupy, "ndarray", None), type)
        and issubclass(cls, cupy.ndarray)
    ):
        _KIND_BY_TYPE[cls] = "cupy"
        return "cupy"
    _KIND_BY_TYPE[cls] = "other"
    return "other"


def _not_a_device_array(obj: Any, name: str) -> str:
    cls = type(obj)
    what = f"{cls.__module__}.{cls.__qualname__}"
    if cls.__module__ == "numpy" or hasattr(obj, "__array_interface__"):
        return (
            f"{name} is a host (NumPy) array ({what}); hipattn needs device arrays: a torch CUDA/ROCm "
            "tensor, a CuPy array, an object with __cuda_array_interface__ or __dlpack__ on a GPU, "
            "or hipattn.arrays.raw_array(ptr, shape, dtype, device)"
        )
    return (
        f"{name} has type {what}, which is not a device array; hipattn accepts torch tensors, CuPy "
        "arrays, objects with __cuda_array_interface__ or __dlpack__, or "
        "hipattn.arrays.raw_array(ptr, shape, dtype, device)"
    )


# ---- torch ------------------------------------------------------------------------------------

# (torch module, torch.strided, {torch dtype: hipattn name}), rebuilt if the module object changes.
_torch_facts: tuple[Any, Any, dict[Any, str]] = (None, None, {})


def _torch_table(torch: Any) -> tuple[Any, Any, dict[Any, str]]:
    global _torch_facts
    table = {}
    for attr, ours in _TORCH_DTYPE_ATTRS.items():
        dt = getattr(torch, attr, None)
        if dt is not None:
            table[dt] = ours
    _torch_facts = (torch, getattr(torch, "strided", None), table)
    return _torch_facts


def _from_torch(t: Any, name: str) -> DeviceArray:
    device = t.device
    if device.type != "cuda":
        if device.type == "cpu":
            raise ValueError(
                f"{name} is a CPU tensor; hipattn needs device arrays (move it with {name}.cuda() or "
                f"{name}.to('cuda'), which is also the spelling on ROCm builds of PyTorch)"
            )
        raise ValueError(
            f"{name} is a tensor on device '{device}'; hipattn needs a CUDA/ROCm ('cuda') tensor"
        )
    torch = sys.modules["torch"]
    module, strided, table = _torch_facts
    if module is not torch:
        module, strided, table = _torch_table(torch)
    if strided is not None and t.layout is not strided:
        raise TypeError(f"{name} has layout {t.layout}; hipattn needs a dense (torch.strided) tensor")
    dtype = table.get(t.dtype)
    if dtype is None:
        raise TypeError(f"{name} has dtype {t.dtype}; hipattn handles {', '.join(_TORCH_DTYPE_ATTRS)}")
    index = device.index
    if index is None:  # a tensor's device always has an index; a bare 'cuda' device would not
        raise ValueError(f"{name} reports device '{device}' without an index")
    return _device_array(t.data_ptr(), tuple(t.shape), tuple(t.stride()), dtype, index, "torch", t)


# ---- cupy -------------------------------------------------------------------------------------


def _from_cupy(a: Any, name: str) -> DeviceArray:
    dtype = _NUMPY_NAME.get(a.dtype.name)
    if dtype is None:
        raise TypeError(f"{name} has dtype {a.dtype.name}; hipattn handles {', '.join(_NUMPY_NAME)}")
    itemsize = a.itemsize
    strides = _byte_strides_to_elements(a.strides, itemsize, name)
    return _device_array(a.data.ptr, tuple(a.shape), strides, dtype, a.device.id, "cupy", a)


# ---- __cuda_array_interface__ -----------------------------------------------------------------


def _cai_dtype(typestr: Any, name: str) -> str:
    if not isinstance(typestr, str):
        raise TypeError(
            f"{name}.__cuda_array_interface__['typestr'] is {typestr!r} ({type(typestr).__name__}); "
            "expected a typestring such as '<f2'"
        )
    dtype = _TYPESTR.get(typestr)
    if dtype is not None:
        return dtype
    if typestr == "<V2":
        raise TypeError(
            f"{name} exports __cuda_array_interface__ with typestr '<V2', which is how bfloat16 (and any "
            "other 2-byte type) is spelled there, so hipattn cannot tell what it holds; pass it as a torch "
            "tensor or CuPy array, or through DLPack (its dtype code says bfloat16), or describe it with "
            "hipattn.arrays.raw_array(ptr, shape, 'bf16', device)"
        )
    raise TypeError(
        f"{name} has __cuda_array_interface__ typestr {typestr!r}; hipattn handles "
        f"{', '.join(sorted(_TYPESTR))} (little-endian; bf16 only through torch/cupy/DLPack)"
    )


def _from_cai(obj: Any, cai: Any, name: str, pointer_device: Callable[[int], int] | None) -> DeviceArray:
    if not isinstance(cai, dict):
        raise TypeError(f"{name}.__cuda_array_interface__ is a {type(cai).__name__}, expected a dict")
    interface = f"{name}.__cuda_array_interface__"
    try:
        shape = _int_tuple(cai["shape"], "shape", interface)
        typestr = cai["typestr"]
        data = cai["data"]
    except KeyError as missing:
        raise TypeError(f"{interface} has no {missing} entry") from None
    if cai.get("mask") is not None:
        raise TypeError(
            f"{name} is a masked array (__cuda_array_interface__ 'mask'); hipattn does not take masks"
        )
    version = cai.get("version", 0)
    if isinstance(version, bool) or not isinstance(version, int):
        raise TypeError(f"{interface}['version'] is {version!r} ({type(version).__name__}); expected an int")
    dtype = _cai_dtype(typestr, name)
    if not (isinstance(data, tuple) and len(data) == 2):
        raise TypeError(f"{interface}['data'] must be (pointer, readonly); got {data!r}")
    ptr, readonly = data
    ptr = 0 if ptr is None else ptr
    _check_pointer(ptr, f"{interface}['data']")
    if ptr == 0 and _nonzero_size(shape):
        raise ValueError(_null_pointer(name, shape))
    byte_strides = cai.get("strides")
    if byte_strides is None:
        strides = contiguous_strides(shape)
    else:
        byte_strides = _int_tuple(byte_strides, "strides", interface, allow_negative=True)
        if len(byte_strides) != len(shape):
            raise TypeError(f"{interface} has shape {shape} but strides {byte_strides}")
        _check_strides(byte_strides, interface)
        strides = _byte_strides_to_elements(byte_strides, _ELEMENT_SIZE[dtype], name)
    stream = None
    if version >= 3:
        stream = _cai_stream(cai.get("stream"), name)
    device = _cai_device(obj, ptr, pointer_device, name)
    return _device_array(ptr, shape, strides, dtype, device, "cai", obj, stream, bool(readonly))


def _cai_stream(stream: Any, name: str) -> int | None:
    # CAI v3: None = no synchronisation needed; 1 = legacy default; 2 = per-thread default; 0 is
    # forbidden because it is ambiguous between the two.
    if stream is None:
        return None
    if isinstance(stream, bool) or not isinstance(stream, int):
        raise TypeError(f"{name}.__cuda_array_interface__['stream'] must be an int or None; got {stream!r}")
    if stream == 0:
        raise ValueError(
            f"{name}.__cuda_array_interface__['stream'] is 0, which the interface forbids (ambiguous "
            "between the legacy and per-thread default streams); the producer should say 1 or 2"
        )
    if stream < 0 or stream >= POINTER_LIMIT:
        raise ValueError(
            f"{name}.__cuda_array_interface__['stream'] is {stream}; a stream handle is a pointer "
            "(0 < handle < 2**64)"
        )
    return int(stream)


def _cai_device(obj: Any, ptr: int, pointer_device: Callable[[int], int] | None, name: str) -> int:
    if pointer_device is not None and ptr != 0:
        return _checked_device(pointer_device(ptr), f"the device of {name}'s pointer")
    # Some CAI producers carry a device attribute: an int, or an object with .id (CuPy) / .index
    # (torch). Anything else is left for the launch path to settle (attention._settle_devices).
    device = getattr(obj, "device", None)
    if isinstance(device, int) and not isinstance(device, bool):
        return _checked_device(device, f"{name}.device")
    for attr in ("id", "index"):
        value = getattr(device, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return _checked_device(value, f"{name}.device.{attr}")
    return UNKNOWN_DEVICE


def _checked_device(device: Any, what: str) -> int:
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(f"{what} is {device!r}; expected a device ordinal (an int)")
    if device < 0:
        raise ValueError(f"{what} is {device}; expected a device ordinal >= 0")
    return int(device)


# ---- DLPack -----------------------------------------------------------------------------------

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


def _from_dlpack(obj: Any, name: str, stream: int | None) -> DeviceArray:
    device = dlpack_device(obj)
    if device is not None and device[0] not in (_KDL_CUDA, _KDL_ROCM):
        raise ValueError(_dlpack_wrong_device(obj, name, device[0]))
    stream_arg = None if device is None else _dlpack_stream_argument(device[0], stream)
    try:
        capsule = obj.__dlpack__(stream=stream_arg, max_version=(1, 0))
    except TypeError:  # a producer from before DLPack 1.0 knows no max_version
        capsule = obj.__dlpack__(stream=stream_arg)

    if _capsule_is_valid(capsule, _NAME_VERSIONED):
        address = _capsule_get_pointer(capsule, _NAME_VERSIONED)
        if not address:
            raise TypeError(f"{name}.__dlpack__() returned a capsule holding a null pointer")
        _capsule_set_name(capsule, _USED_NAME_VERSIONED)
        versioned = _DLManagedTensorVersioned.from_address(address)
        owner = DLPackOwner(obj, capsule, address, versioned.deleter)
        if versioned.version.major != 1:
            raise TypeError(f"{name} exports DLPack version {versioned.version.major}; hipattn reads 1.x")
        tensor = versioned.dl_tensor
        readonly = bool(versioned.flags & _DL_FLAG_READ_ONLY)
    elif _capsule_is_valid(capsule, _NAME):
        address = _capsule_get_pointer(capsule, _NAME)
        if not address:
            raise TypeError(f"{name}.__dlpack__() returned a capsule holding a null pointer")
        _capsule_set_name(capsule, _USED_NAME)
        managed = _DLManagedTensor.from_address(address)
        owner = DLPackOwner(obj, capsule, address, managed.deleter)
        tensor = managed.dl_tensor
        readonly = False
    else:
        raise TypeError(f"{name}.__dlpack__() returned {capsule!r}, not an unconsumed DLPack capsule")

    # From here on the owner holds the tensor; any error below drops it and runs the deleter.
    device_type = tensor.device.device_type
    if device_type not in (_KDL_CUDA, _KDL_ROCM):
        raise ValueError(_dlpack_wrong_device(obj, name, device_type))
    code, bits, lanes = tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes
    dtype = _DL_DTYPE.get((code, bits)) if lanes == 1 else None
    if dtype is None:
        raise TypeError(
            f"{name} has DLPack dtype (code {code}, bits {bits}, lanes {lanes}); hipattn handles "
            f"{', '.join(_ELEMENT_SIZE)}"
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
    if ptr == 0 and _nonzero_size(shape):
        raise ValueError(_null_pointer(name, shape))
    device = _checked_device(tensor.device.device_id, f"{name}'s DLPack device_id")
    return _device_array(ptr, shape, strides, dtype, device, "dlpack", owner, None, readonly)


def _dlpack_wrong_device(obj: Any, name: str, device_type: int) -> str:
    where = _DL_DEVICE_NAME.get(device_type, f"type {device_type}")
    host = " (a host array)" if device_type in (_KDL_CPU, _KDL_CUDA_HOST, 11) else ""
    return (
        f"{name} ({type(obj).__module__}.{type(obj).__qualname__}) lives on a DLPack {where} device{host}; "
        "hipattn needs arrays in CUDA or ROCm device memory"
    )


# ---- allocation in the caller's framework -----------------------------------------------------


def empty(
    like: DeviceArray, shape: Sequence[int], dtype: str, *, stream: int | None = None
) -> tuple[Any, DeviceArray]:
    """Allocate an uninitialised output in the same framework and on the same device as ``like``.

    Returns (the framework's object, its DeviceArray). Both frameworks' caching allocators are
    stream-ordered: a block is tied to the stream that is current when it is allocated, and is
    reused after free only by work ordered after that stream's pending work. So pass ``stream``,
    the handle hipattn launches on: when it differs from the framework's current stream the
    allocation is made with that stream current (an external-stream wrapper), so the block is
    never handed to other work while hipattn's kernels may still write it. Call inside the device
    guard (streams.on_device). Raw, CAI and DLPack inputs have no allocator hipattn can use: the
    caller passes output buffers to the low-level API instead.
    """
    element_size(dtype)
    shape_t = _int_tuple(shape, "shape", "empty")
    if like.framework == "torch":
        return _empty_torch(like, shape_t, dtype, stream)
    if like.framework == "cupy":
        return _empty_cupy(like, shape_t, dtype, stream)
    raise TypeError(
        f"hipattn cannot allocate outputs for {like.framework!r} inputs (only torch and CuPy have an "
        "allocator it can use); pass preallocated output buffers through the low-level API"
    )


def _empty_torch(
    like: DeviceArray, shape: tuple[int, ...], dtype: str, stream: int | None
) -> tuple[Any, DeviceArray]:
    torch = sys.modules["torch"]
    torch_dtype = getattr(torch, _TO_NUMPY_NAME[dtype])
    device = torch.device("cuda", like.device)
    if stream is None or stream == torch.cuda.current_stream(like.device).cuda_stream:
        out = torch.empty(shape, dtype=torch_dtype, device=device)
    else:
        with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=device)):
            out = torch.empty(shape, dtype=torch_dtype, device=device)
    return out, _from_torch(out, "output")


def _empty_cupy(
    like: DeviceArray, shape: tuple[int, ...], dtype: str, stream: int | None
) -> tuple[Any, DeviceArray]:
    cupy = sys.modules["cupy"]
    if dtype == "bf16":
        try:
            import ml_dtypes  # CuPy spells bfloat16 through ml_dtypes, when it supports it at all
        except ImportError:
            raise TypeError(
                "allocating a bf16 CuPy output needs ml_dtypes; pass an output buffer instead"
            ) from None
        np_dtype: Any = ml_dtypes.bfloat16
    else:
        np_dtype = _TO_NUMPY_NAME[dtype]
    with cupy.cuda.Device(like.device):
        if stream is None or stream == cupy.cuda.get_current_stream().ptr:
            out = cupy.empty(shape, dtype=np_dtype)
        else:
            with cupy.cuda.ExternalStream(stream):
                out = cupy.empty(shape, dtype=np_dtype)
    return out, _from_cupy(out, "output")


# ---- small helpers ----------------------------------------------------------------------------


def _int_tuple(values: Any, what: str, name: str, allow_negative: bool = False) -> tuple[int, ...]:
    """``values`` as a tuple of ints. Only true integers count (NumPy's among them, through
    ``__index__``): 3.7 is refused, not truncated, and so are "3" and True."""
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{name}: {what} must be a sequence of ints; got {values!r}")
    try:
        result = tuple(_index(v) for v in values)
    except TypeError:
        raise TypeError(f"{name}: {what} must be a sequence of ints; got {values!r}") from None
    if not allow_negative and any(v < 0 for v in result):
        raise ValueError(f"{name}: {what} {result} has a negative entry")
    return result


def _index(value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError("a bool is not an extent")
    return operator.index(value)


def _check_pointer(ptr: Any, what: str) -> None:
    """A device address: an int in [0, 2**64) (the kernels take u64 pointers)."""
    if isinstance(ptr, bool) or not isinstance(ptr, int):
        raise TypeError(f"{what} needs the pointer as an int; got {ptr!r} ({type(ptr).__name__})")
    if ptr < 0:
        raise ValueError(f"{what} got a negative pointer {ptr}")
    if ptr >= POINTER_LIMIT:
        raise ValueError(f"{what} got pointer 0x{ptr:x}, which does not fit in 64 bits")


def _check_strides(strides: tuple[int, ...], what: str) -> None:
    for stride in strides:
        if not _STRIDE_MIN <= stride <= _STRIDE_MAX:
            raise ValueError(f"{what}: strides {strides} has {stride}, which does not fit in 64 bits (the kernels take int64 strides)")


def _null_pointer(name: str, shape: tuple[int, ...]) -> str:
    return f"{name} has a null data pointer (0) but shape {shape} is not empty; pass the array's device memory"


def _byte_strides_to_elements(byte_strides: Sequence[int], itemsize: int, name: str) -> tuple[int, ...]:
    strides = []
    for s in byte_strides:
        if s % itemsize:
            raise ValueError(
                f"{name} has byte strides {tuple(byte_strides)} that are not multiples of its element size "
                f"{itemsize}; hipattn needs element-aligned strides"
            )
        strides.append(s // itemsize)
    return tuple(strides)


def _nonzero_size(shape: tuple[int, ...]) -> bool:
    return all(extent > 0 for extent in shape)
