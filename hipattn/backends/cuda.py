"""NVIDIA backend: NVRTC compiles, the CUDA driver API loads and launches (both through cuda-bindings).

The driver API is used on each device's *primary* context, which is the context the CUDA runtime
(PyTorch, CuPy) uses too, so pointers, streams and events are shared with the frameworks as plain ints.

cuda-bindings accepts plain ints for every handle (function, stream, event, pointer) and an int
address of a ``void**`` for ``kernelParams``; the int path skips its slow ``(values, types)`` packing.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
import threading
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from ..errors import BackendUnavailableError, DriverError
from ..jit.params import TENSOR_MAP_BYTES, TensorMapBytes
from ..jit.target import NVIDIA, Target
from .base import Backend, KernelArgumentSlot, LoadedFunction, RuntimeCall, binding_modules
from .rtc import RuntimeCompiler
from .tensor_maps import TensorMapLayout

logger = logging.getLogger("hipattn")

_INSTALL_HINT = "install the NVIDIA extra: pip install hipattn[nvidia]"

# A tensor map's element type per hipattn dtype, from the driver binding's enum.
_TENSOR_MAP_DTYPES = {
    "bf16": lambda d: d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
    "fp16": lambda d: d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
}


def _l2_promotion(driver, promotion_bytes: int):
    """CUtensorMapL2promotion for a TensorMapLayout's l2_promotion (0, 64, 128 or 256 bytes)."""
    name = "NONE" if promotion_bytes == 0 else f"L2_{promotion_bytes}B"
    return getattr(driver.CUtensorMapL2promotion, f"CU_TENSOR_MAP_L2_PROMOTION_{name}")


def driver_library_present() -> bool:
    """Whether libcuda can be loaded, tried with dlopen before any call into cuda-bindings.

    Without a driver, cuda-bindings raises from deep inside its loader, and higher layers built on it
    have been seen to hang on a second attempt; asking the dynamic loader first is
    harmless and definite.
    """
    name = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
    try:
        ctypes.CDLL(name)
    except OSError:
        return False
    return True


def _nvrtc_wheel_suffix() -> str:
    for distribution in ("nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu12"):
        try:
            return f" ({distribution} {version(distribution)})"
        except PackageNotFoundError:
            continue
    return ""


@functools.cache
def _libcuda_launch_host_func() -> Any:
    """libcuda's own ``cuLaunchHostFunc(CUstream, CUhostFn, void*)`` through ctypes."""
    function = ctypes.CDLL("libcuda.so.1").cuLaunchHostFunc
    function.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
    function.restype = ctypes.c_int
    return function


def _result_name(result: Any) -> str:
    return getattr(result, "name", "") or ""


class CudaBackend(Backend):
    name = "cuda"
    vendor = NVIDIA
    CALL_NAMES = {"launch": "cuLaunchKernel", "memset_async": "cuMemsetD8Async", "event_record": "cuEventRecord",
                  "event_query": "cuEventQuery", "launch_host_func": "cuLaunchHostFunc"}
    RUNTIME_CALLS = {
        "malloc_async": RuntimeCall("cuMemAllocAsync"),
        "free_async": RuntimeCall("cuMemFreeAsync"),
        "mem_get_info": RuntimeCall("cuMemGetInfo", needs_context=True),
        "host_alloc": RuntimeCall("cuMemHostAlloc", ("CU_MEMHOSTALLOC_PORTABLE",), needs_context=True),
        "host_free": RuntimeCall("cuMemFreeHost"),
        # Non-blocking: no implicit synchronisation with the legacy stream.
        "stream_create": RuntimeCall("cuStreamCreate", ("CUstream_flags.CU_STREAM_NON_BLOCKING",), needs_context=True),
        "stream_destroy": RuntimeCall("cuStreamDestroy"),
        "stream_synchronize": RuntimeCall("cuStreamSynchronize"),
        "stream_is_capturing": RuntimeCall("cuStreamIsCapturing"),
        "stream_wait_event": RuntimeCall("cuStreamWaitEvent", (0,)),
        "event_create": RuntimeCall("cuEventCreate", ("CUevent_flags.CU_EVENT_DISABLE_TIMING",), needs_context=True),
        "event_create_timing": RuntimeCall("cuEventCreate", ("CUevent_flags.CU_EVENT_DEFAULT",), needs_context=True),
        "event_destroy": RuntimeCall("cuEventDestroy"),
        "event_synchronize": RuntimeCall("cuEventSynchronize"),
        "event_elapsed_ms": RuntimeCall("cuEventElapsedTime"),
    }
    CAPTURE_NONE = "CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE"

    def __init__(self, driver_module: Any = None, nvrtc_module: Any = None) -> None:
        """``driver_module``/``nvrtc_module`` default to cuda-bindings; tests may pass stand-ins."""
        # The dlopen probe guards the real cuda-bindings only; an injected stand-in needs no libcuda.
        self._probe_driver_library = driver_module is None
        driver_module, nvrtc_module = binding_modules("cuda.bindings", ("driver", "nvrtc"), (driver_module, nvrtc_module),
                                                      "cuda-bindings", _INSTALL_HINT)
        self._driver = driver_module
        self._nvrtc = nvrtc_module
        self._init_lock = threading.Lock()
        self._initialized = False
        self._primary_contexts: dict[int, Any] = {}
        self._identity: str | None = None
        self._supported: tuple[int, ...] | None = None
        self._argument_slot = KernelArgumentSlot()

        self._compiler = RuntimeCompiler(nvrtc_module, "nvrtc", code_call="CUBIN", file_name="hipattn_kernel.cu",
                                         destroy=nvrtc_module.nvrtcDestroyProgram)

        d = driver_module
        # Bound once: the hot path (launch, memset, memcpy, set_device) then does no module lookups.
        self._bind_hot_path(d, launch_extra=0, not_ready=int(d.CUresult.CUDA_ERROR_NOT_READY))
        self._cuMemcpyAsync = d.cuMemcpyAsync
        # The real driver through libcuda itself (see _launch_host_func_through_libcuda); a stand-in's own call.
        self._launch_host_func_call = (
            self._launch_host_func_through_libcuda if self._probe_driver_library else d.cuLaunchHostFunc
        )
        self._cuCtxSetCurrent = d.cuCtxSetCurrent

    # ---- the one error path ---------------------------------------------------------------------
    def _error(self, call: str, result: Any) -> DriverError:
        code = int(result)
        name, description = _result_name(result), ""
        try:
            error, text = self._driver.cuGetErrorName(result)
            if not error and text:
                name = text.decode()
            error, text = self._driver.cuGetErrorString(result)
            if not error and text:
                description = text.decode()
        except Exception:  # the lookup itself needs libcuda; the enum's name is a fine fallback
            pass
        return DriverError(call, code, name, description)

    def _binding(self) -> Any:
        return self._driver

    # ---- compiling ------------------------------------------------------------------------------
    def compiler_identity(self) -> str:
        if self._identity is None:
            try:
                major, minor = self._compiler.call("Version")
            except Exception as error:  # libnvrtc missing: cuda-bindings loads it lazily, on first use
                raise BackendUnavailableError(
                    f"NVRTC could not be loaded ({error}); install it: pip install 'cuda-toolkit[nvrtc]' "
                    f"or {_INSTALL_HINT}"
                ) from None
            # nvrtcVersion stops at major.minor; the wheel's full version tells patch releases apart
            # in the cache key (a system libnvrtc without the wheel keeps major.minor).
            self._identity = f"nvrtc {major}.{minor}" + _nvrtc_wheel_suffix()
        return self._identity

    def unsupported_reason(self, target: Target) -> str | None:
        """None when this NVRTC compiles for ``target``; else why not (each NVRTC release drops old
        targets and knows no newer ones than its own: ``nvrtcGetSupportedArchs``)."""
        if target.vendor != NVIDIA:
            return f"the cuda backend compiles for NVIDIA targets (sm_NN), not {target}"
        supported = self._supported_compute_capabilities()
        if supported and target.compute_capability not in supported:
            listed = ", ".join(f"sm_{cc}" for cc in supported)
            return (f"{self.compiler_identity()} does not compile for {target.arch}; it supports {listed} "
                    "(another NVRTC release, e.g. another cuda-toolkit[nvrtc] wheel, may)")
        return None

    def _supported_compute_capabilities(self) -> tuple[int, ...]:
        """What ``nvrtcGetSupportedArchs`` lists (empty when this NVRTC cannot be asked)."""
        if self._supported is None:
            self.compiler_identity()  # a missing libnvrtc is BackendUnavailableError, not this probe's
            try:
                archs = self._compiler.call("GetSupportedArchs")
                self._supported = tuple(int(cc) for cc in archs)
            except Exception:  # an NVRTC before 11.2 has no such call: every target is attempted
                self._supported = ()
        return self._supported

    def compile_options(self, target: Target) -> tuple[str, ...]:
        self._require_vendor(target)
        # A CUBIN for exactly this arch, never PTX: PTX defers inline-asm checks (wgmma on sm_90a) to the
        # driver's JIT at load time, on the user's machine. No --use_fast_math: IEEE division and sqrt
        # unless a kernel asks for an intrinsic explicitly.
        return (f"--gpu-architecture={target.arch}", "-std=c++17")

    def _before_compile(self, target: Target, options: tuple[str, ...], spec_text: str, source: str) -> None:
        self._require_vendor(target)
        self.compiler_identity()  # a missing libnvrtc becomes BackendUnavailableError, not a traceback

    def _require_vendor(self, target: Target) -> None:
        if target.vendor != NVIDIA:
            raise ValueError(f"the cuda backend compiles for NVIDIA targets (sm_NN), not {target}")

    # ---- devices ----------------------------------------------------------------------------------
    def _ensure_initialized(self) -> None:
        if self._initialized:
            return
        with self._init_lock:
            if self._initialized:
                return
            if self._probe_driver_library and not driver_library_present():
                raise BackendUnavailableError(
                    "the NVIDIA driver library (libcuda) is not installed or not on the loader path; "
                    "the cuda backend needs an NVIDIA GPU with its driver"
                )
            self._check("cuInit", self._driver.cuInit(0))
            self._initialized = True

    def _primary_context(self, device: int) -> Any:
        context = self._primary_contexts.get(device)
        if context is None:
            self._ensure_initialized()
            with self._init_lock:
                context = self._primary_contexts.get(device)
                if context is None:
                    handle = self._check("cuDeviceGet", self._driver.cuDeviceGet(device))
                    # Retained once and never released: the frameworks share this context, and
                    # releasing the last reference would tear it down under them.
                    context = self._check("cuDevicePrimaryCtxRetain", self._driver.cuDevicePrimaryCtxRetain(handle))
                    self._primary_contexts[device] = context
        return context

    def _device_handle(self, device: int) -> Any:
        self._ensure_initialized()
        return self._check("cuDeviceGet", self._driver.cuDeviceGet(device))

    def device_count(self) -> int:
        self._ensure_initialized()
        return int(self._check("cuDeviceGetCount", self._driver.cuDeviceGetCount()))

    def device_target(self, device: int) -> Target:
        handle = self._device_handle(device)
        attribute = self._driver.CUdevice_attribute
        major = self._check(
            "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MAJOR)",
            self._driver.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, handle),
        )
        minor = self._check(
            "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MINOR)",
            self._driver.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, handle),
        )
        # Compute capability 9.0 runs sm_90a's arch-specific instructions (wgmma); naming the device
        # sm_90a builds every kernel for it, and lets catalog.targets.runs_nvidia_wgmma pick the wgmma ones.
        return Target.parse(f"sm_{major}{minor}" + ("a" if (major, minor) == (9, 0) else ""))

    def compute_units(self, device: int) -> int:
        handle = self._device_handle(device)
        attribute = self._driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
        return int(self._check("cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)",
                               self._driver.cuDeviceGetAttribute(attribute, handle)))

    def device_name(self, device: int) -> str:
        handle = self._device_handle(device)
        raw = self._check("cuDeviceGetName", self._driver.cuDeviceGetName(256, handle))
        return raw.split(b"\0", 1)[0].decode(errors="replace")

    def get_device(self) -> int:
        self._ensure_initialized()
        (result, device) = self._driver.cuCtxGetDevice()
        if result == self._driver.CUresult.CUDA_ERROR_INVALID_CONTEXT:
            # Nothing current on this thread: the runtime API (PyTorch, CuPy) would lazily make device
            # 0's primary context current at its first call; do the same so both sides agree.
            self.set_device(0)
            return 0
        if result:
            raise self._error("cuCtxGetDevice", result)
        return int(device)

    def set_device(self, device: int) -> None:
        context = self._primary_contexts.get(device)
        if context is None:
            context = self._primary_context(device)
        (result,) = self._cuCtxSetCurrent(context)
        if result:
            raise self._error("cuCtxSetCurrent", result)

    def pointer_device(self, ptr: int) -> int:
        self._ensure_initialized()
        ordinal = self._check(
            "cuPointerGetAttribute(DEVICE_ORDINAL)",
            self._driver.cuPointerGetAttribute(self._driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr),
        )
        return int(ordinal)

    def _make_context_current(self) -> None:
        """Calls that need a context (module load, allocation) get the current or device 0's primary one."""
        self.get_device()

    # ---- modules and launches -----------------------------------------------------------------------
    def load_function(self, binary: bytes, lowered_name: str) -> Any:
        self._make_context_current()
        module = self._check("cuModuleLoadData", self._driver.cuModuleLoadData(binary))
        function = self._check("cuModuleGetFunction", self._driver.cuModuleGetFunction(module, lowered_name.encode()))
        # Modules are never unloaded: the registry keeps functions for the life of the process, and an
        # unload from a finaliser could run inside a host function, where driver calls are forbidden.
        return LoadedFunction(function, module, lowered_name)

    def set_max_dynamic_shared_memory(self, function: Any, nbytes: int) -> None:
        self._check(
            "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)",
            self._driver.cuFuncSetAttribute(
                function.handle,
                self._driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                nbytes,
            ),
        )

    def encode_tensor_map(self, address: int, layout: TensorMapLayout) -> TensorMapBytes:
        d = self._driver
        wide, narrow = d.cuuint64_t, d.cuuint32_t  # the binding takes its own integer types in these lists
        encoded = self._check("cuTensorMapEncodeTiled", d.cuTensorMapEncodeTiled(
            _TENSOR_MAP_DTYPES[layout.dtype](d), len(layout.dims), address, [wide(x) for x in layout.dims],
            [wide(x) for x in layout.strides], [narrow(x) for x in layout.box], [narrow(1)] * len(layout.dims),
            d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
            _l2_promotion(d, layout.l2_promotion),
            d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE))
        return TensorMapBytes.from_buffer_copy(ctypes.string_at(encoded.getPtr(), TENSOR_MAP_BYTES))

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        if nbytes:  # empty arrays may carry null pointers; a zero-byte copy is nothing to enqueue
            (result,) = self._cuMemcpyAsync(dst, src, nbytes, stream)
            if result:
                raise self._error("cuMemcpyAsync", result)

    def _launch_host_func_through_libcuda(self, stream: int, function_address: int, user_data: int) -> tuple:
        # Straight into libcuda, not through cuda-bindings: its cuLaunchHostFunc wraps the function
        # in a heap record that its trampoline frees after the first call (and runs under the GIL).
        # A graph that captured the host node replays it, and the second replay then reads freed
        # memory: seen on the H200 as a segfault in the callback thread. The direct call registers
        # our own C function, which survives every replay.
        code = _libcuda_launch_host_func()(stream or None, function_address, user_data or None)
        return (self._driver.CUresult(code),)
