"""Arrays interop: what as_device_array reads from each kind of producer, and what it refuses."""

from __future__ import annotations

import ctypes
import gc
import sys
import types

import numpy as np
import pytest

from hipattn import dlpack
from hipattn.arrays import as_device_array, empty, raw_array
from hipattn.device_array import UNKNOWN_DEVICE, DeviceArray, contiguous_strides, element_size
from hipattn.streams import launch_device

# ---- CAI producers ------------------------------------------------------------------------------


class CAIArray:
    """A minimal __cuda_array_interface__ producer (what Numba or a hand-rolled wrapper exports)."""

    def __init__(
        self, ptr, shape, typestr, strides=None, version=2, stream=None, device=None, readonly=False
    ):
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (ptr, readonly),
            "strides": strides,
            "version": version,
        }
        if version >= 3:
            self.__cuda_array_interface__["stream"] = stream
        if device is not None:
            self.device = device


def test_cai_v2_reads_pointer_shape_byte_strides_and_dtype():
    a = as_device_array(CAIArray(0x7000, (4, 8, 2), "<f2", strides=(64, 4, 2), device=0), "q")
    assert (a.ptr, a.shape, a.strides, a.dtype) == (0x7000, (4, 8, 2), (32, 2, 1), "fp16")
    assert a.framework == "cai" and a.device == 0 and a.stream is None


def test_cai_none_strides_mean_c_contiguous():
    a = as_device_array(CAIArray(0x1000, (3, 5, 7), "<f4", device=0), "k")
    assert a.strides == (35, 7, 1)
    assert a.dtype == "fp32"


def test_cai_v3_records_the_producer_stream():
    a = as_device_array(CAIArray(0x1000, (2,), "<i4", version=3, stream=0xABC0, device=0), "cu_seqlens_q")
    assert a.stream == 0xABC0 and a.dtype == "int32"
    b = as_device_array(CAIArray(0x1000, (2,), "<i8", version=3, stream=None, device=0), "cu_seqlens_k")
    assert b.stream is None and b.dtype == "int64"


def test_cai_v3_stream_zero_is_rejected():
    with pytest.raises(ValueError, match="forbids"):
        as_device_array(CAIArray(0x1000, (2,), "<i4", version=3, stream=0, device=0), "cu_seqlens_q")


def test_cai_bf16_void_typestr_is_rejected_with_a_way_out():
    with pytest.raises(TypeError) as info:
        as_device_array(CAIArray(0x1000, (2, 2), "<V2", device=0), "v")
    message = str(info.value)
    assert "v" in message and "<V2" in message and "DLPack" in message and "bfloat16" in message


def test_cai_unaligned_byte_strides_are_rejected():
    with pytest.raises(ValueError, match="not multiples"):
        as_device_array(CAIArray(0x1000, (2, 2), "<f4", strides=(6, 4), device=0), "q")


def test_cai_device_from_pointer_query_or_attribute_or_unknown():
    by_query = as_device_array(CAIArray(0x1000, (1,), "<f4"), "q", pointer_device=lambda ptr: 3)
    assert by_query.device == 3
    by_attribute = as_device_array(CAIArray(0x1000, (1,), "<f4", device=types.SimpleNamespace(id=2)), "q")
    assert by_attribute.device == 2
    unknown = as_device_array(CAIArray(0x1000, (1,), "<f4"), "q")
    assert unknown.device == UNKNOWN_DEVICE


def test_cai_readonly_flag_is_kept():
    assert as_device_array(CAIArray(0x1000, (1,), "<f4", device=0, readonly=True), "q").readonly


# ---- host arrays and other objects --------------------------------------------------------------


def test_numpy_host_array_is_rejected_saying_what_was_given():
    with pytest.raises((TypeError, ValueError)) as info:
        as_device_array(np.zeros((2, 2), np.float16), "q")
    message = str(info.value)
    assert "q" in message and "numpy" in message and "host" in message


def test_object_without_any_interface_is_rejected():
    with pytest.raises(TypeError, match=r"q has type builtins\.list.*not a device array"):
        as_device_array([1.0, 2.0], "q")


# ---- devices ------------------------------------------------------------------------------------


def test_mismatched_devices_name_both_arrays():
    q = raw_array(0x1000, (2, 4), "fp16", device=0)
    k = raw_array(0x2000, (2, 4), "fp16", device=1)
    with pytest.raises(ValueError) as info:
        launch_device([q, k], names=["q", "k"])
    message = str(info.value)
    assert "q is on device 0" in message and "k is on device 1" in message


def test_arrays_of_unknown_device_follow_the_others():
    q = as_device_array(CAIArray(0x1000, (1,), "<f2"), "q")
    k = raw_array(0x2000, (1,), "fp16", device=2)
    assert launch_device([q, k]) == 2
    with pytest.raises(ValueError, match="cannot tell which device"):
        launch_device([q])


# ---- raw pointers -------------------------------------------------------------------------------


def test_raw_array_defaults_to_c_contiguous_and_validates():
    a = raw_array(0xDEAD00, (2, 3, 4), "bf16", device=1)
    assert a.strides == (12, 4, 1) and a.framework == "raw" and a.nbytes == 48
    assert raw_array(0x10, (2, 3), "fp32", 0, strides=(1, 2)).strides == (1, 2)
    with pytest.raises(ValueError, match="unknown dtype"):
        raw_array(0x10, (2,), "float16", 0)
    with pytest.raises(ValueError, match="null pointer"):
        raw_array(0, (2,), "fp16", 0)
    assert raw_array(0, (0, 4), "fp16", 0).size == 0  # an empty array may have no memory
    with pytest.raises(ValueError, match="strides"):
        raw_array(0x10, (2, 3), "fp32", 0, strides=(1,))
    with pytest.raises(TypeError):
        raw_array(16.0, (2,), "fp32", 0)


def test_helpers():
    assert element_size("bf16") == 2 and element_size("int64") == 8
    assert as_device_array(raw_array(0x10, (1,), "fp16", 0), "q").ptr == 0x10


def test_device_array_equality_ignores_the_owner():
    a = DeviceArray(1, (1,), (1,), "fp16", 0, "raw", owner=object())
    b = DeviceArray(1, (1,), (1,), "fp16", 0, "raw", owner=object())
    assert a == b and hash(a) == hash(b)


# ---- torch and CuPy look-alikes (the fast paths duck-type their attributes) ---------------------


def _fake_torch():
    torch = types.ModuleType("torch")

    class Dtype:
        def __init__(self, name):
            self.name = name

        def __str__(self):
            return self.name

    for name in ("float16", "bfloat16", "float32", "int32", "int64", "complex64"):
        setattr(torch, name, Dtype(name))

    class Device:
        def __init__(self, type, index=None):
            self.type, self.index = type, index

        def __str__(self):
            return self.type if self.index is None else f"{self.type}:{self.index}"

    class Tensor:
        def __init__(self, ptr, shape, stride, dtype, device):
            self._ptr, self.shape, self._stride, self.dtype, self.device = ptr, shape, stride, dtype, device

        def data_ptr(self):
            return self._ptr

        def stride(self):
            return self._stride

    torch.Tensor, torch.device = Tensor, Device
    return torch


def test_torch_tensor_fast_path_reads_bf16_and_device_index(monkeypatch):
    torch = _fake_torch()
    monkeypatch.setitem(sys.modules, "torch", torch)
    t = torch.Tensor(0x5000, (2, 3), (3, 1), torch.bfloat16, torch.device("cuda", 1))
    a = as_device_array(t, "q")
    assert (a.ptr, a.shape, a.strides, a.dtype, a.device, a.framework) == (
        0x5000,
        (2, 3),
        (3, 1),
        "bf16",
        1,
        "torch",
    )
    assert a.owner is t


def test_torch_cpu_tensor_is_rejected(monkeypatch):
    torch = _fake_torch()
    monkeypatch.setitem(sys.modules, "torch", torch)
    t = torch.Tensor(0x5000, (2,), (1,), torch.float16, torch.device("cpu"))
    with pytest.raises(ValueError, match="q is a CPU tensor; hipattn needs device arrays"):
        as_device_array(t, "q")


def test_torch_unsupported_dtype_is_rejected(monkeypatch):
    torch = _fake_torch()
    monkeypatch.setitem(sys.modules, "torch", torch)
    t = torch.Tensor(0x5000, (2,), (1,), torch.complex64, torch.device("cuda", 0))
    with pytest.raises(TypeError, match="q has dtype complex64"):
        as_device_array(t, "q")


def test_cupy_array_fast_path_converts_byte_strides(monkeypatch):
    cupy = types.ModuleType("cupy")

    class ndarray:  # noqa: N801 - CuPy's spelling
        def __init__(self):
            self.data = types.SimpleNamespace(ptr=0x9000)
            self.shape, self.strides, self.dtype = (4, 2), (4, 2), np.dtype(np.float16)
            self.itemsize, self.device = 2, types.SimpleNamespace(id=3)

    cupy.ndarray = ndarray
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    a = as_device_array(ndarray(), "k")
    assert (a.ptr, a.shape, a.strides, a.dtype, a.device, a.framework) == (
        0x9000,
        (4, 2),
        (2, 1),
        "fp16",
        3,
        "cupy",
    )


# ---- empty --------------------------------------------------------------------------------------


def test_empty_refuses_inputs_without_an_allocator():
    like = raw_array(0x10, (2,), "fp16", 0)
    with pytest.raises(TypeError, match="pass preallocated output buffers"):
        empty(like, (2,), "fp16")


def test_empty_torch_allocates_on_the_launch_stream_when_it_is_not_current(monkeypatch):
    torch = _fake_torch()
    events = []

    class ExternalStream:
        def __init__(self, handle, device=None):
            self.handle = handle

    class StreamContext:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            events.append(("enter", self.stream.handle))

        def __exit__(self, *exc):
            events.append(("exit", self.stream.handle))

    def torch_empty(shape, dtype, device):
        events.append(("alloc", shape))
        return torch.Tensor(0x4000, shape, contiguous_strides(shape), dtype, device)

    torch.empty = torch_empty
    torch.cuda = types.SimpleNamespace(
        current_stream=lambda device: types.SimpleNamespace(cuda_stream=0),
        ExternalStream=ExternalStream,
        stream=StreamContext,
    )
    monkeypatch.setitem(sys.modules, "torch", torch)
    like = as_device_array(torch.Tensor(0x5000, (2,), (1,), torch.float16, torch.device("cuda", 1)), "q")
    out, out_array = empty(like, (2, 3), "fp32", stream=0x77)
    assert events == [("enter", 0x77), ("alloc", (2, 3)), ("exit", 0x77)]
    assert out_array.device == 1 and out_array.dtype == "fp32" and out_array.strides == (3, 1)
    events.clear()
    empty(like, (2,), "fp32", stream=0)  # already the current stream: no wrapper
    assert events == [("alloc", (2,))]


# ---- DLPack: a producer built with ctypes, laid out independently of hipattn's reader ----------

_pyapi = ctypes.PyDLL(None)
_capsule_new = _pyapi["PyCapsule_New"]
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_is_valid_raw = _pyapi["PyCapsule_IsValid"]
_is_valid_raw.restype = ctypes.c_int
_is_valid_raw.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_is_valid = _pyapi["PyCapsule_IsValid"]
_is_valid.restype = ctypes.c_int
_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]

_VOIDP = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device_type", ctypes.c_int32),
        ("device_id", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("code", ctypes.c_uint8),
        ("bits", ctypes.c_uint8),
        ("lanes", ctypes.c_uint16),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("byte_offset", ctypes.c_uint64),
    ]


class Managed(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class ManagedVersioned(ctypes.Structure):
    _fields_ = [
        ("major", ctypes.c_uint32),
        ("minor", ctypes.c_uint32),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


def test_dlpack_struct_layouts_match_the_c_header():
    assert (
        ctypes.sizeof(DLTensor) == 48
        and ctypes.sizeof(Managed) == 64
        and ctypes.sizeof(ManagedVersioned) == 80
    )
    assert ctypes.sizeof(dlpack._DLTensor) == 48
    assert ctypes.sizeof(dlpack._DLManagedTensor) == 64
    assert ctypes.sizeof(dlpack._DLManagedTensorVersioned) == 80


class DLPackProducer:
    """Exports one tensor the way a C producer does: the capsule destructor calls the deleter only
    if no consumer renamed the capsule."""

    def __init__(self, shape, strides=None, code=2, bits=16, device_type=2, device_id=0,
                 byte_offset=0, versioned=False, readonly=False, knows_max_version=True, has_device=True,
                 data=0x10000):  # fmt: skip
        self.stream_seen = "not called"
        self.max_version_seen = None
        self._shape = (ctypes.c_int64 * len(shape))(*shape)
        self._strides = (ctypes.c_int64 * len(strides))(*strides) if strides else None
        # The callbacks close over plain locals, not self: the capsule may be destroyed while the
        # garbage collector is tearing this producer down.
        deleted = self._deleted = [0]
        name = b"dltensor_versioned" if versioned else b"dltensor"

        def delete(address):
            deleted[0] += 1

        def capsule_destructor(capsule_address):
            if _is_valid_raw(capsule_address, name):  # not renamed: nobody consumed it
                deleted[0] += 1

        self._deleter = _VOIDP(delete)
        self._destructor = _VOIDP(capsule_destructor)
        self.versioned, self.readonly, self.knows_max_version = versioned, readonly, knows_max_version
        self.device = (device_type, device_id)
        if not has_device:
            self.__dlpack_device__ = None
        t = DLTensor(data, device_type, device_id, len(shape), code, bits, 1,
                     ctypes.addressof(self._shape),
                     ctypes.addressof(self._strides) if strides else None, byte_offset)  # fmt: skip
        if versioned:
            self.managed = ManagedVersioned(1, 0, None, ctypes.cast(self._deleter, ctypes.c_void_p).value,
                                            1 if readonly else 0, t)  # fmt: skip
        else:
            self.managed = Managed(t, None, ctypes.cast(self._deleter, ctypes.c_void_p).value)

    @property
    def deleted(self):
        return self._deleted[0]

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, stream=None, max_version=None):
        if max_version is not None and not self.knows_max_version:
            raise TypeError("unexpected keyword argument 'max_version'")
        self.stream_seen, self.max_version_seen = stream, max_version
        name = b"dltensor_versioned" if self.versioned else b"dltensor"
        self.capsule = _capsule_new(
            ctypes.addressof(self.managed), name, ctypes.cast(self._destructor, ctypes.c_void_p).value
        )
        return self.capsule


def test_dlpack_reads_bf16_offset_and_contiguous_default_and_owns_the_tensor():
    producer = DLPackProducer((2, 3), code=4, bits=16, device_id=1, byte_offset=64)
    a = as_device_array(producer, "q", stream=0x55)
    assert (a.ptr, a.shape, a.strides, a.dtype, a.device, a.framework) == (
        0x10040,
        (2, 3),
        (3, 1),
        "bf16",
        1,
        "dlpack",
    )
    assert _is_valid(producer.capsule, b"used_dltensor"), "the consumer renames the capsule it consumed"
    assert producer.stream_seen == 0x55 and producer.max_version_seen == (1, 0)
    assert producer.deleted == 0, "the deleter must not run while hipattn holds the array"
    del a
    gc.collect()
    assert producer.deleted == 1
    del producer.capsule
    gc.collect()
    assert producer.deleted == 1, "the producer's capsule destructor must not delete a consumed tensor again"


def test_dlpack_versioned_with_strides_and_readonly_flag():
    producer = DLPackProducer((4, 2), strides=(1, 4), code=2, bits=32, versioned=True, readonly=True)
    a = as_device_array(producer, "k")
    assert (a.strides, a.dtype, a.readonly) == ((1, 4), "fp32", True)
    assert _is_valid(producer.capsule, b"used_dltensor_versioned")
    del a
    gc.collect()
    assert producer.deleted == 1


def test_dlpack_stream_argument_follows_the_protocol():
    cuda = DLPackProducer((1,))
    as_device_array(cuda, "q", stream=0)  # hipattn's 0 is the legacy stream; CUDA spells it 1
    assert cuda.stream_seen == 1
    as_device_array(cuda, "q")
    assert cuda.stream_seen is None
    rocm = DLPackProducer((1,), device_type=10)
    as_device_array(rocm, "q", stream=0)  # on ROCm 0 is the default stream itself
    assert rocm.stream_seen == 0


def test_dlpack_producer_without_max_version_falls_back_to_legacy_call():
    producer = DLPackProducer((3,), code=0, bits=32, knows_max_version=False)
    a = as_device_array(producer, "cu_seqlens_q")
    assert a.dtype == "int32" and producer.max_version_seen is None


def test_dlpack_host_device_rejected_before_consuming():
    producer = DLPackProducer((3,), device_type=1)
    with pytest.raises(ValueError, match="host array"):
        as_device_array(producer, "q")
    assert producer.stream_seen == "not called"


def test_dlpack_rejected_after_consuming_runs_the_deleter_once():
    producer = DLPackProducer((3,), code=5, bits=64)  # complex: consumed, then refused
    with pytest.raises(TypeError, match="code 5"):
        as_device_array(producer, "q")
    gc.collect()
    assert producer.deleted == 1
    wrong_device = DLPackProducer((3,), device_type=1, has_device=False)  # no __dlpack_device__ to ask first
    with pytest.raises(ValueError, match="CPU"):
        as_device_array(wrong_device, "q")
    gc.collect()
    assert wrong_device.deleted == 1


def test_dlpack_reader_with_numpy_as_a_real_producer_releases_its_reference():
    """NumPy is a real C producer (CPU only): a wrapper claims a GPU so the reader consumes the
    capsule, finds a CPU tensor, refuses it, and must hand NumPy's reference back exactly once."""
    host = np.arange(6, dtype=np.float16).reshape(2, 3)

    class ClaimsGPU:
        def __dlpack_device__(self):
            return (2, 0)

        def __dlpack__(self, stream=None, max_version=None):
            return host.__dlpack__(max_version=max_version) if max_version else host.__dlpack__()

    before = sys.getrefcount(host)
    with pytest.raises(ValueError, match="CPU"):
        as_device_array(ClaimsGPU(), "q")
    gc.collect()
    assert sys.getrefcount(host) == before


# ---- values that do not describe memory, or do not fit the kernels' fields ---------------------


def test_non_empty_array_at_address_zero_is_refused_naming_the_argument():
    with pytest.raises(ValueError, match=r"q has a null data pointer \(0\) but shape \(2, 4\) is not empty"):
        as_device_array(CAIArray(0, (2, 4), "<f2", device=0), "q")
    with pytest.raises(ValueError, match="k has a null data pointer"):
        as_device_array(CAIArray(None, (2,), "<f2", device=0), "k")
    with pytest.raises(ValueError, match="v has a null data pointer"):
        as_device_array(DeviceArray(0, (3,), (1,), "fp16", 0, "raw"), "v")
    producer = DLPackProducer((2, 3), data=0)
    with pytest.raises(ValueError, match="cu_seqlens_q has a null data pointer"):
        as_device_array(producer, "cu_seqlens_q")
    gc.collect()
    assert producer.deleted == 1


def test_empty_arrays_may_sit_at_address_zero():
    assert as_device_array(CAIArray(0, (0, 4), "<f2", device=0), "q").ptr == 0
    assert as_device_array(DeviceArray(0, (0,), (1,), "fp16", 0, "raw"), "q").size == 0
    assert as_device_array(DLPackProducer((2, 0), data=0), "q").size == 0


def test_negative_dlpack_shapes_and_devices_are_refused():
    with pytest.raises(ValueError, match="negative extent"):
        as_device_array(DLPackProducer((2, -3)), "q")
    with pytest.raises(ValueError, match="q's DLPack device_id is -1; expected a device ordinal >= 0"):
        as_device_array(DLPackProducer((2,), device_id=-1), "q")


def test_negative_cai_devices_are_refused():
    with pytest.raises(ValueError, match=r"k\.device is -2"):
        as_device_array(CAIArray(0x1000, (1,), "<f4", device=-2), "k")
    with pytest.raises(ValueError, match=r"k\.device\.id is -1"):
        as_device_array(CAIArray(0x1000, (1,), "<f4", device=types.SimpleNamespace(id=-1)), "k")
    with pytest.raises(ValueError, match="the device of k's pointer is -1"):
        as_device_array(CAIArray(0x1000, (1,), "<f4"), "k", pointer_device=lambda ptr: -1)


@pytest.mark.parametrize("ptr", [2**64, 2**64 + 0x1000, -0x1000])
def test_pointers_outside_64_bits_are_refused(ptr):
    with pytest.raises(ValueError, match=r"q.__cuda_array_interface__\['data'\] got"):
        as_device_array(CAIArray(ptr, (2,), "<f2", device=0), "q")
    with pytest.raises(ValueError, match="raw_array got"):
        raw_array(ptr, (2,), "fp16", 0)
    with pytest.raises(ValueError, match="DeviceArray got"):
        DeviceArray(ptr, (2,), (1,), "fp16", 0, "raw")


def test_dlpack_pointer_plus_offset_past_64_bits_is_refused():
    with pytest.raises(ValueError, match="past the end of a 64-bit address space"):
        as_device_array(DLPackProducer((2,), data=2**64 - 16, byte_offset=32), "q")


def test_strides_outside_int64_are_refused():
    with pytest.raises(ValueError, match="does not fit in 64 bits"):
        raw_array(0x1000, (2, 2), "fp16", 0, strides=(2**63, 1))
    with pytest.raises(ValueError, match="does not fit in 64 bits"):
        raw_array(0x1000, (2, 2), "fp16", 0, strides=(-(2**63) - 1, 1))
    with pytest.raises(ValueError, match=r"q.__cuda_array_interface__: strides .* does not fit in 64 bits"):
        as_device_array(CAIArray(0x1000, (2, 2), "<f2", strides=(2**64, 2), device=0), "q")


@pytest.mark.parametrize("stream", [-1, 2**64])
def test_cai_v3_streams_outside_a_pointer_are_refused(stream):
    with pytest.raises(ValueError, match=r"q.__cuda_array_interface__\['stream'\] is"):
        as_device_array(CAIArray(0x1000, (2,), "<i4", version=3, stream=stream, device=0), "q")


@pytest.mark.parametrize(
    ("interface", "message"),
    [
        ({"typestr": ["<f2"]}, r"q.__cuda_array_interface__\['typestr'\] is \['<f2'\] \(list\)"),
        ({"version": "3"}, r"q.__cuda_array_interface__\['version'\] is '3' \(str\); expected an int"),
        ({"data": ("0x1000", False)}, r"needs the pointer as an int; got '0x1000' \(str\)"),
        ({"data": (4096.7, False)}, r"needs the pointer as an int; got 4096.7 \(float\)"),
        ({"shape": (2.5, 2)}, r"q.__cuda_array_interface__: shape must be a sequence of ints"),
        ({"shape": "22"}, r"shape must be a sequence of ints"),
        ({"strides": (4.0, 2)}, r"strides must be a sequence of ints"),
    ],
    ids=["typestr list", "version str", "pointer str", "pointer float", "shape float", "shape str", "strides float"],
)
def test_malformed_cai_fields_are_type_errors_naming_the_argument(interface, message):
    a = CAIArray(0x1000, (2, 2), "<f2", version=3, device=0)
    a.__cuda_array_interface__.update(interface)
    with pytest.raises(TypeError, match=message):
        as_device_array(a, "q")


def test_float_and_bool_extents_are_refused_not_truncated():
    with pytest.raises(TypeError, match="raw_array: shape must be a sequence of ints; got \\(3.7,\\)"):
        raw_array(0x1000, (3.7,), "fp16", 0)
    with pytest.raises(TypeError, match="raw_array: strides must be a sequence of ints"):
        raw_array(0x1000, (3,), "fp16", 0, strides=(True,))
    with pytest.raises(TypeError, match="raw_array needs the device ordinal as an int"):
        raw_array(0x1000, (3,), "fp16", 0.0)
    assert raw_array(0x1000, (np.int64(3),), "fp16", 0).shape == (3,)  # NumPy's ints are ints


def test_hand_built_device_arrays_are_checked_when_built():
    with pytest.raises(ValueError, match="DeviceArray got 2-d shape"):
        DeviceArray(0x1000, (2, 2), (1,), "fp16", 0, "raw")
    with pytest.raises(ValueError, match="DeviceArray got device -5"):
        DeviceArray(0x1000, (2,), (1,), "fp16", -5, "raw")
    with pytest.raises(ValueError, match="unknown dtype"):
        DeviceArray(0x1000, (2,), (1,), "float16", 0, "raw")
    assert DeviceArray(0x1000, [2, 3], [3, 1], "fp16", UNKNOWN_DEVICE, "raw").shape == (2, 3)


def test_stream_handles_outside_a_pointer_are_refused():
    from hipattn.streams import resolve_stream

    with pytest.raises(ValueError, match="wider than 64 bits"):
        resolve_stream([raw_array(0x10, (1,), "fp16", 0)], 2**64)

    class Stream:
        def __cuda_stream__(self):
            return (0, "0x5000")

    with pytest.raises(TypeError, match=r"stream.__cuda_stream__\(\) returned handle '0x5000'; expected an int"):
        resolve_stream([raw_array(0x10, (1,), "fp16", 0)], Stream())
