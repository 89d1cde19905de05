"""What the backends hand to the runtime, checked against stand-in bindings (no GPU, no driver).

Each stand-in keeps the real binding's enums and constants and replaces the calls with recorders, so
the tests see exactly the arguments a real driver would get: the one-pointer kernel argument, int
handles, the copy kind, the host-function address, and how result codes become values or errors.
"""

from __future__ import annotations

import ctypes
import dataclasses

import pytest
from support.local_rocm import use_local_rocm

from hipattn.backends.base import LoadedFunction
from hipattn.errors import DriverError
from hipattn.jit.params import ParamsStruct
from hipattn.jit.target import Target

use_local_rocm()

PARAMS = ParamsStruct("ScaleParams", (("out", "ptr"), ("in_", "const_ptr"), ("rows", "i32"), ("factor", "f32")))


class StandIn:
    """The real binding's names, with the calls listed in ``results`` replaced by recorders."""

    def __init__(self, real, success, results: dict):
        self._real = real
        self._success = success
        self.calls: list[tuple] = []
        for name, outputs in results.items():
            setattr(self, name, self._recorder(name, outputs))

    def _recorder(self, name, outputs):
        def call(*args):
            self.calls.append((name, args))
            value = outputs(*args) if callable(outputs) else outputs
            return value if isinstance(value, tuple) else (self._success,)

        return call

    def __getattr__(self, name):
        return getattr(self._real, name)

    def called(self, name):
        return [args for call, args in self.calls if call == name]


def read_argument(kernel_params: int, nbytes: int) -> bytes:
    """What the driver copies for a one-argument kernel: follow void** -> void* -> the struct's bytes."""
    argument = ctypes.c_void_p.from_address(kernel_params).value
    return ctypes.string_at(argument, nbytes)


# ---- CUDA -----------------------------------------------------------------------------------------


@pytest.fixture
def cuda():
    driver = pytest.importorskip("cuda.bindings.driver", reason="cuda-bindings is not installed")
    from cuda.bindings import nvrtc

    from hipattn.backends.cuda import CudaBackend

    ok = driver.CUresult.CUDA_SUCCESS
    fake = StandIn(
        driver,
        ok,
        {
            "cuInit": None,
            "cuLaunchKernel": None,
            "cuMemsetD8Async": None,
            "cuMemcpyAsync": None,
            "cuLaunchHostFunc": None,
            "cuCtxSetCurrent": None,
            "cuEventRecord": None,
            "cuEventQuery": None,
            "cuDeviceGet": lambda ordinal: (ok, driver.CUdevice(ordinal)),
            "cuDevicePrimaryCtxRetain": lambda device: (ok, driver.CUcontext(0x1000 + int(device))),
            "cuCtxGetDevice": (driver.CUresult.CUDA_ERROR_INVALID_CONTEXT, driver.CUdevice(0)),
            "cuMemAllocAsync": (ok, driver.CUdeviceptr(0xD000)),
            "cuMemHostAlloc": (ok, 0xB000),
            "cuStreamCreate": (ok, driver.CUstream(0x5000)),
            "cuStreamIsCapturing": (ok, driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE),
            "cuEventCreate": (ok, driver.CUevent(0xE000)),
            "cuDeviceGetAttribute": lambda attribute, device: (ok, 9 if "MAJOR" in attribute.name else 0),
            "cuMemGetInfo": (ok, 100, 200),
        },
    )
    return CudaBackend(driver_module=fake, nvrtc_module=nvrtc), fake, driver


def test_cuda_launch_failure_names_the_kernel(cuda):
    backend, fake, driver = cuda
    failing = fake._recorder("cuLaunchKernel", (driver.CUresult.CUDA_ERROR_INVALID_VALUE,))
    backend._launch_kernel = failing
    with pytest.raises(DriverError) as caught:
        backend.launch(LoadedFunction(1, None, "scale"), (1, 1, 1), (1, 1, 1), 0, 0, PARAMS.new(out=0, in_=0, rows=0, factor=0))
    assert caught.value.call == "cuLaunchKernel(scale)"
    assert caught.value.code == int(driver.CUresult.CUDA_ERROR_INVALID_VALUE)
    assert "CUDA_ERROR_INVALID_VALUE" in str(caught.value)


def test_cuda_get_device_without_a_context_makes_device_0_current(cuda):
    backend, fake, _ = cuda
    assert backend.get_device() == 0
    (context,) = fake.called("cuCtxSetCurrent")[0]
    assert int(context) == 0x1000
    assert len(fake.called("cuDevicePrimaryCtxRetain")) == 1
    backend.set_device(0)  # the primary context is retained once, then reused
    assert len(fake.called("cuDevicePrimaryCtxRetain")) == 1


def test_cuda_event_query_treats_not_ready_as_false(cuda):
    backend, fake, driver = cuda
    for result, expected in ((driver.CUresult.CUDA_SUCCESS, True), (driver.CUresult.CUDA_ERROR_NOT_READY, False)):
        backend._event_query_call = fake._recorder("cuEventQuery", (result,))
        assert backend.event_query(0xE000) is expected
    backend._event_query_call = fake._recorder("cuEventQuery", (driver.CUresult.CUDA_ERROR_INVALID_HANDLE,))
    with pytest.raises(DriverError, match="cuEventQuery"):
        backend.event_query(0xE000)


def test_cuda_memory_calls_return_ints_and_skip_empty_work(cuda):
    backend, fake, driver = cuda
    assert backend.malloc_async(256, 0x5000) == 0xD000
    assert backend.malloc_async(0, 0x5000) == 0
    assert backend.host_alloc(64) == 0xB000
    assert fake.called("cuMemHostAlloc") == [(64, driver.CU_MEMHOSTALLOC_PORTABLE)]
    backend.memcpy_async(0x1, 0x2, 0, 0x5000)
    backend.memset_async(0x1, 0, 0, 0x5000)
    assert not fake.called("cuMemcpyAsync") and not fake.called("cuMemsetD8Async")
    backend.memcpy_async(0x1, 0x2, 8, 0x5000)
    backend.memset_async(0x1, 0xFF, 8, 0x5000)
    assert fake.called("cuMemcpyAsync") == [(0x1, 0x2, 8, 0x5000)]
    assert fake.called("cuMemsetD8Async") == [(0x1, 0xFF, 8, 0x5000)]
    assert backend.mem_get_info() == (100, 200)


def test_cuda_streams_events_and_target(cuda):
    backend, fake, driver = cuda
    assert backend.stream_create() == 0x5000
    assert fake.called("cuStreamCreate") == [(driver.CUstream_flags.CU_STREAM_NON_BLOCKING,)]
    assert backend.stream_is_capturing(0x5000) is True
    assert backend.event_create() == 0xE000
    assert fake.called("cuEventCreate")[-1] == (driver.CUevent_flags.CU_EVENT_DISABLE_TIMING,)
    backend.event_create(timing=True)
    assert fake.called("cuEventCreate")[-1] == (driver.CUevent_flags.CU_EVENT_DEFAULT,)
    # Compute capability 9.0 is named sm_90a: its kernels may use wgmma (catalog.targets.runs_nvidia_wgmma).
    assert backend.device_target(0) == Target.parse("sm_90a")


# ---- HIP ------------------------------------------------------------------------------------------


@pytest.fixture
def hip_fake():
    hip_bindings = pytest.importorskip("hip", reason="hip-python is not installed")
    hip, hiprtc = hip_bindings.hip, hip_bindings.hiprtc

    from hipattn.backends.hip import HipBackend

    ok = hip.hipError_t.hipSuccess

    class Properties:
        gcnArchName = b"gfx90a:sramecc+:xnack-"
        name = b"AMD Instinct MI210"
        warpSize = 64

    fake = StandIn(
        hip,
        ok,
        {
            "hipModuleLaunchKernel": None,
            "hipMemsetAsync": None,
            "hipMemcpyAsync": None,
            "hipLaunchHostFunc": None,
            "hipSetDevice": None,
            "hipEventRecord": None,
            "hipEventQuery": (hip.hipError_t.hipErrorNotReady,),
            "hipGetDevice": (ok, 1),
            "hipGetDeviceProperties": (ok, Properties()),
            "hipDeviceGetAttribute": (ok, 65536),
            "hipMallocAsync": (ok, 0xD000),
            "hipHostMalloc": (ok, 0xB000),
            "hipStreamCreateWithFlags": (ok, 0x5000),
            "hipStreamIsCapturing": (ok, hip.hipStreamCaptureStatus.hipStreamCaptureStatusNone),
            "hipEventCreateWithFlags": (ok, 0xE000),
            "hipMemGetInfo": (ok, 10, 20),
        },
    )
    return HipBackend(hip_module=fake, hiprtc_module=hiprtc), fake, hip


def test_hip_memcpy_uses_the_default_kind_for_every_direction(hip_fake):
    backend, fake, hip = hip_fake
    backend.memcpy_async(0x1, 0x2, 16, 0x5000)
    backend.memcpy_async(0x1, 0x2, 0, 0x5000)
    assert fake.called("hipMemcpyAsync") == [(0x1, 0x2, 16, hip.hipMemcpyKind.hipMemcpyDefault, 0x5000)]


def test_hip_device_target_keeps_the_features(hip_fake):
    backend, _, _ = hip_fake
    target = backend.device_target(0)
    assert target == Target.parse("gfx90a:sramecc+:xnack-")
    assert target.warp_size == 64
    assert backend.device_name(0) == "AMD Instinct MI210"


def test_hip_events_streams_and_memory(hip_fake):
    backend, fake, hip = hip_fake
    assert backend.event_query(0xE000) is False
    assert backend.get_device() == 1
    assert backend.stream_create() == 0x5000
    assert fake.called("hipStreamCreateWithFlags") == [(hip.hipStreamNonBlocking,)]
    assert backend.stream_is_capturing(0x5000) is False
    assert backend.event_create() == 0xE000
    assert fake.called("hipEventCreateWithFlags") == [(hip.hipEventDisableTiming,)]
    assert backend.malloc_async(100, 0x5000) == 0xD000
    assert backend.host_alloc(100) == 0xB000
    assert fake.called("hipHostMalloc") == [(100, hip.hipHostMallocPortable)]
    assert backend.mem_get_info() == (10, 20)


def test_hip_shared_memory_beyond_the_device_limit_fails_up_front(hip_fake):
    backend, _, _ = hip_fake
    kernel = LoadedFunction(0xF00, None, "scale")
    backend.set_max_dynamic_shared_memory(kernel, 65536)
    with pytest.raises(DriverError, match="65537 bytes"):
        backend.set_max_dynamic_shared_memory(kernel, 65537)


def test_hip_error_names_come_from_the_runtime(hip_fake):
    backend, _, hip = hip_fake
    backend._hipSetDevice = lambda device: (hip.hipError_t.hipErrorInvalidDevice,)
    with pytest.raises(DriverError) as caught:
        backend.set_device(3)
    assert caught.value.call == "hipSetDevice"
    assert caught.value.name == "hipErrorInvalidDevice"
    assert caught.value.code == int(hip.hipError_t.hipErrorInvalidDevice)


def test_cuda_tensor_maps_reach_the_driver_in_the_bindings_own_integer_types(cuda):
    """cuTensorMapEncodeTiled's lists take cuuint64_t (dims, byte strides) and cuuint32_t (box, element
    strides), not ints; the map comes back as its 128 bytes."""
    from hipattn.backends.tensor_maps import TensorMapLayout

    backend, fake, driver = cuda
    encoded = driver.CUtensorMap()
    encoded.opaque = list(range(16))
    fake.cuTensorMapEncodeTiled = lambda *args: (fake.calls.append(("cuTensorMapEncodeTiled", args)) or
                                                 (driver.CUresult.CUDA_SUCCESS, encoded))
    layout = TensorMapLayout("fp16", (128, 16, 1000, 3), (256, 4096, 4096000), (64, 1, 128, 1))
    returned = backend.encode_tensor_map(0xA000, layout)
    (args,) = fake.called("cuTensorMapEncodeTiled")
    assert args[0] == driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16 and args[1:3] == (4, 0xA000)
    assert all(isinstance(x, driver.cuuint64_t) for x in (*args[3], *args[4]))
    assert all(isinstance(x, driver.cuuint32_t) for x in (*args[5], *args[6]))
    assert [int(x) for x in args[3]] == [128, 16, 1000, 3] and [int(x) for x in args[5]] == [64, 1, 128, 1]
    assert args[8] == driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B
    assert args[9] == driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B  # the layout's default
    assert bytes(returned) == b"".join(i.to_bytes(8, "little") for i in range(16))

    backend.encode_tensor_map(0xA000, dataclasses.replace(layout, l2_promotion=0))
    assert fake.called("cuTensorMapEncodeTiled")[-1][9] == driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_NONE


def test_cuda_pointer_device_asks_for_the_device_ordinal(cuda):
    backend, fake, driver = cuda
    fake.cuPointerGetAttribute = fake._recorder("cuPointerGetAttribute", (driver.CUresult.CUDA_SUCCESS, 3))
    assert backend.pointer_device(0x7000) == 3
    assert fake.called("cuPointerGetAttribute") == [
        (driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, 0x7000)
    ]
    fake.cuPointerGetAttribute = fake._recorder("cuPointerGetAttribute", (driver.CUresult.CUDA_ERROR_INVALID_VALUE, 0))
    with pytest.raises(DriverError, match="cuPointerGetAttribute"):
        backend.pointer_device(0x7000)


def test_hip_pointer_device_reads_the_pointers_attributes(hip_fake):
    backend, fake, hip = hip_fake

    class Attributes:
        device = 2

    fake.hipPointerGetAttributes = fake._recorder("hipPointerGetAttributes", (hip.hipError_t.hipSuccess, Attributes()))
    assert backend.pointer_device(0x7000) == 2
    assert fake.called("hipPointerGetAttributes") == [(0x7000,)]
    fake.hipPointerGetAttributes = fake._recorder("hipPointerGetAttributes", (hip.hipError_t.hipErrorInvalidValue, None))
    with pytest.raises(DriverError, match="hipPointerGetAttributes"):
        backend.pointer_device(0x7000)


# ---- both -----------------------------------------------------------------------------------------

# What each launch passes after kernelParams for "no extra options", and each host-function call's name.
NO_LAUNCH_EXTRA = {"cuda": 0, "hip_fake": None}
HOST_FUNC_CALL = {"cuda": "cuLaunchHostFunc", "hip_fake": "hipLaunchHostFunc"}


@pytest.fixture(params=["cuda", "hip_fake"])
def either(request):
    """(vendor fixture's name, backend, fake) for each backend in turn."""
    backend, fake, _ = request.getfixturevalue(request.param)
    return request.param, backend, fake


def test_launch_passes_the_struct_by_value_through_one_pointer(either):
    vendor, backend, fake = either
    params = PARAMS.new(out=0xA0, in_=0xB0, rows=7, factor=0.5)
    seen = {}

    def launch(*args):
        seen["args"] = args
        seen["argument"] = read_argument(args[9], PARAMS.nbytes)  # read while the call is in flight
        return (fake._success,)

    backend._launch_kernel = launch
    backend.launch(LoadedFunction(handle=0xF00, module=None, name="scale"), (3, 2, 1), (128, 1, 1), 4096, 0x5000, params)
    args = seen["args"]
    assert args[:9] == (0xF00, 3, 2, 1, 128, 1, 1, 4096, 0x5000)
    extra = NO_LAUNCH_EXTRA[vendor]
    assert isinstance(args[9], int) and (args[10], type(args[10])) == (extra, type(extra))
    assert seen["argument"] == bytes(params)


def test_host_function_must_be_an_int_address(either):
    vendor, backend, fake = either
    callback = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _: None)
    # hip-python would accept this object and pass the address of its Python-side buffer.
    with pytest.raises(TypeError, match="int address"):
        backend.launch_host_func(0x5000, callback, 0)
    address = ctypes.cast(callback, ctypes.c_void_p).value
    backend.launch_host_func(0x5000, address, 0x77)
    assert fake.called(HOST_FUNC_CALL[vendor]) == [(0x5000, address, 0x77)]


def test_a_missing_hiprtc_library_names_rocm_path_without_raw_bytes(monkeypatch):
    """hip-python installed but no libhiprtc: the hint says what to set, not to install the installed extra."""
    hip_bindings = pytest.importorskip("hip", reason="hip-python is not installed")
    from hipattn.backends.hip import HipBackend
    from hipattn.errors import BackendUnavailableError

    class NoLibrary:
        def __getattr__(self, name):
            def fail(*args):
                raise RuntimeError("failed to dlopen 'b'libhiprtc.so'': b'libhiprtc.so: cannot open shared object file'")
            return fail

    monkeypatch.delenv("ROCM_PATH", raising=False)
    backend = HipBackend(hip_module=hip_bindings.hip, hiprtc_module=NoLibrary())
    with pytest.raises(BackendUnavailableError) as raised:
        backend.compiler_identity()
    message = str(raised.value)
    assert "ROCM_PATH is not set" in message and "libhiprtc.so" in message
    assert "b'" not in message and "pip install" not in message
