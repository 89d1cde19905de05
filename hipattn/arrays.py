"""Device arrays from any framework: what users pass, read by its protocol into a ``DeviceArray``.

hipattn launches on raw device pointers. ``as_device_array`` turns what a user passes (a PyTorch
tensor, a CuPy array, anything with ``__cuda_array_interface__`` or ``__dlpack__``) into a
``DeviceArray`` (``device_array``): pointer, shape, strides in elements, dtype name, device ordinal,
and the original object kept alive. Users with nothing but a pointer call ``raw_array``; ``empty``
allocates an output in the inputs' framework.

Order of the checks, cheapest and most exact first:

1. ``torch.Tensor`` and ``cupy.ndarray`` through their attributes (a few attribute reads, and the
   only way to tell bf16 from other 2-byte types without DLPack). Neither module is ever imported
   here: if a user passes a tensor, its module is already in ``sys.modules``.
2. ``__cuda_array_interface__`` (v2 and v3). CAI has no bf16 spelling (``<V2``), so a bf16 array
   must come through DLPack or as a torch/cupy object. A v3 ``stream`` is kept on the array
   (``DeviceArray.stream``) for ``streams.resolve_stream``.
3. ``__dlpack__``, read by ``dlpack`` (legacy and 1.x managed tensors).

Nothing here touches the GPU runtime, so every check runs before anything is enqueued.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from .device_array import (
    ELEMENT_SIZE,
    POINTER_LIMIT,
    UNKNOWN_DEVICE,
    DeviceArray,
    byte_strides_to_elements,
    check_pointer,
    check_strides,
    checked_device,
    contiguous_strides,
    element_size,
    int_tuple,
    nonzero_size,
    null_pointer_message,
    unchecked_device_array,
)
from .dlpack import from_dlpack

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

# torch spells its dtypes (torch.float16, torch.bfloat16, ...) with NumPy's names.
_TORCH_DTYPE_ATTRS = _NUMPY_NAME


def raw_array(
    ptr: int,
    shape: Sequence[int],
    dtype: str,
    device: int,
    strides: Sequence[int] | None = None,
) -> DeviceArray:
    """Describe memory a user has only a pointer to. ``strides`` in elements; None means C-contiguous."""
    check_pointer(ptr, "raw_array")
    element_size(dtype)  # validates the name
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(f"raw_array needs the device ordinal as an int; got {device!r}")
    if device < 0:
        raise ValueError(f"raw_array needs a device ordinal >= 0; got {device!r}")
    shape_t = int_tuple(shape, "shape", "raw_array")
    if strides is None:
        strides_t = contiguous_strides(shape_t)
    else:
        strides_t = int_tuple(strides, "strides", "raw_array", allow_negative=True)
        if len(strides_t) != len(shape_t):
            raise ValueError(f"raw_array got {len(shape_t)}-d shape {shape_t} but strides {strides_t}")
    check_strides(strides_t, "raw_array")
    if ptr == 0 and nonzero_size(shape_t):
        raise ValueError(f"raw_array got a null pointer for a non-empty array of shape {shape_t}")
    return unchecked_device_array(ptr, shape_t, strides_t, dtype, device, "raw", None)


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
        if not obj.ptr and nonzero_size(obj.shape):
            raise ValueError(null_pointer_message(name, obj.shape))
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
        return from_dlpack(obj, name, stream)
    raise TypeError(_not_a_device_array(obj, name))




# The framework types read through their attributes: (kind, the module's name and its array class).
_FRAMEWORK_ARRAYS = (("torch", "Tensor"), ("cupy", "ndarray"))


def _classify(cls: type) -> str:
    kind = "other"
    for framework, class_name in _FRAMEWORK_ARRAYS:
        array_type = getattr(sys.modules.get(framework), class_name, None)
        if isinstance(array_type, type) and issubclass(cls, array_type):
            kind = framework
            break
    _KIND_BY_TYPE[cls] = kind
    return kind


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
    return unchecked_device_array(t.data_ptr(), tuple(t.shape), tuple(t.stride()), dtype, index, "torch", t)


# ---- cupy -------------------------------------------------------------------------------------


def _from_cupy(a: Any, name: str) -> DeviceArray:
    dtype = _NUMPY_NAME.get(a.dtype.name)
    if dtype is None:
        raise TypeError(f"{name} has dtype {a.dtype.name}; hipattn handles {', '.join(_NUMPY_NAME)}")
    itemsize = a.itemsize
    strides = byte_strides_to_elements(a.strides, itemsize, name)
    return unchecked_device_array(a.data.ptr, tuple(a.shape), strides, dtype, a.device.id, "cupy", a)


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
        shape = int_tuple(cai["shape"], "shape", interface)
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
    check_pointer(ptr, f"{interface}['data']")
    if ptr == 0 and nonzero_size(shape):
        raise ValueError(null_pointer_message(name, shape))
    byte_strides = cai.get("strides")
    if byte_strides is None:
        strides = contiguous_strides(shape)
    else:
        byte_strides = int_tuple(byte_strides, "strides", interface, allow_negative=True)
        if len(byte_strides) != len(shape):
            raise TypeError(f"{interface} has shape {shape} but strides {byte_strides}")
        check_strides(byte_strides, interface)
        strides = byte_strides_to_elements(byte_strides, ELEMENT_SIZE[dtype], name)
    stream = None
    if version >= 3:
        stream = _cai_stream(cai.get("stream"), name)
    device = _cai_device(obj, ptr, pointer_device, name)
    return unchecked_device_array(ptr, shape, strides, dtype, device, "cai", obj, stream, bool(readonly))


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
        return checked_device(pointer_device(ptr), f"the device of {name}'s pointer")
    # Some CAI producers carry a device attribute: an int, or an object with .id (CuPy) / .index
    # (torch). Anything else is left for the launch path to settle (attention.settle_devices).
    device = getattr(obj, "device", None)
    if isinstance(device, int) and not isinstance(device, bool):
        return checked_device(device, f"{name}.device")
    for attr in ("id", "index"):
        value = getattr(device, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return checked_device(value, f"{name}.device.{attr}")
    return UNKNOWN_DEVICE



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
    shape_t = int_tuple(shape, "shape", "empty")
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
