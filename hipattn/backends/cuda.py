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
from ..target import NVIDIA, Target
from .base import Backend, CompiledKernel, KernelArgumentSlot, LoadedFunction, binding_outputs, compile_error

logger = logging.getLogger("hipattn")

_INSTALL_HINT = "install the NVIDIA extra: pip install hipattn[nvidia]"


def driver_library_present() -> bool:
    """Whether libcuda can be loaded, tried with dlopen before any call into cuda-bindings.

    Without a driver, cuda-bindings raises from deep inside its loader, and higher layers built on it
    have been seen to hang on a second attempt (PLATFORM_NOTES); asking the dynamic loader first is
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

    def __init__(self, driver_module: Any = None, nvrtc_module: Any = None) -> None:
        """``driver_module``/``nvrtc_module`` default to cuda-bindings; tests may pass stand-ins."""
        # The dlopen probe guards the real cuda-bindings only; an injected stand-in needs no libcuda.
        self._probe_driver_library = driver_module is None
        if driver_module is None or nvrtc_module is None:
            try:
                from cuda.bindings import driver, nvrtc
            except ImportError as error:
                raise BackendUnavailableError(f"cuda-bindings is not installed ({error}); {_INSTALL_HINT}") from None
            driver_module = driver_module or driver
            nvrtc_module = nvrtc_module or nvrtc
        self._driver = driver_module
        self._nvrtc = nvrtc_module
        self._init_lock = threading.Lock()
        self._initialized = False
        self._primary_contexts: dict[int, Any] = {}
        self._identity: str | None = None
        self._argument_slot = KernelArgumentSlot()

        d = driver_module
        # Bound once: the hot path (launch, memset, memcpy, set_device) then does no module lookups.
        self._cuLaunchKernel = d.cuLaunchKernel
        self._cuMemsetD8Async = d.cuMemsetD8Async
        self._cuMemcpyAsync = d.cuMemcpyAsync
        self._cuLaunchHostFunc = d.cuLaunchHostFunc
        self._cuCtxSetCurrent = d.cuCtxSetCurrent
        self._cuEventRecord = d.cuEventRecord
        self._cuEventQuery = d.cuEventQuery
        self._not_ready = int(d.CUresult.CUDA_ERROR_NOT_READY)
        self._capture_none = int(d.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE)

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

    def _nvrtc_error(self, call: str, result: Any) -> DriverError:
        name = _result_name(result)
        try:
            error, text = self._nvrtc.nvrtcGetErrorString(result)
            if not error and text:
                name = text.decode()
        except Exception:  # same fallback as the driver: the enum's own name
            pass
        return DriverError(call, int(result), name)

    def _check(self, call: str, returned: tuple) -> Any:
        return binding_outputs(call, returned, self._error)

    def _nvrtc_check(self, call: str, returned: tuple) -> Any:
        return binding_outputs(call, returned, self._nvrtc_error)

    # ---- compiling ------------------------------------------------------------------------------
    def compiler_identity(self) -> str:
        if self._identity is None:
            try:
                returned = self._nvrtc.nvrtcVersion()
            except Exception as error:  # libnvrtc missing: cuda-bindings loads it lazily, on first use
                raise BackendUnavailableError(
                    f"NVRTC could not be loaded ({error}); install it: pip install 'cuda-toolkit[nvrtc]' "
                    f"or {_INSTALL_HINT}"
                ) from None
            major, minor = self._nvrtc_check("nvrtcVersion", returned)
            # nvrtcVersion stops at major.minor; the wheel's full version tells patch releases apart
            # in the cache key (a system libnvrtc without the wheel keeps major.minor).
            self._identity = f"nvrtc {major}.{minor}" + _nvrtc_wheel_suffix()
        return self._identity

    def compile_options(self, target: Target) -> tuple[str, ...]:
        self._require_vendor(target)
        # A CUBIN for exactly this arch, never PTX: PTX defers inline-asm checks (wgmma on sm_90a) to the
        # driver's JIT at load time, on the user's machine. No --use_fast_math: IEEE division and sqrt
        # unless a kernel asks for an intrinsic explicitly.
        return (f"--gpu-architecture={target.arch}", "-std=c++17")

    def compile(
        self,
        source: str,
        headers: dict[str, str],
        name_expression: str,
        target: Target,
        options: tuple[str, ...],
        spec_text: str,
    ) -> CompiledKernel:
        self._require_vendor(target)
        nv = self._nvrtc
        self.compiler_identity()  # a missing libnvrtc becomes BackendUnavailableError, not a traceback
        names = [name.encode() for name in headers]
        texts = [text.encode() for text in headers.values()]
        program = self._nvrtc_check(
            "nvrtcCreateProgram", nv.nvrtcCreateProgram(source.encode(), b"hipattn_kernel.cu", len(names), texts, names)
        )
        try:
            expression = name_expression.encode()
            self._nvrtc_check("nvrtcAddNameExpression", nv.nvrtcAddNameExpression(program, expression))
            encoded_options = [option.encode() for option in options]
            (result,) = nv.nvrtcCompileProgram(program, len(encoded_options), encoded_options)
            log = self._program_log(program)
            if result:
                # Compilation errors and rejected options (an unknown arch) both come back with a log.
                detail = log if log.strip() else f"{_result_name(result)} ({int(result)})"
                raise compile_error(spec_text, target, tuple(options), detail, source)
            lowered = self._nvrtc_check("nvrtcGetLoweredName", nv.nvrtcGetLoweredName(program, expression))
            size = self._nvrtc_check("nvrtcGetCUBINSize", nv.nvrtcGetCUBINSize(program))
            buffer = bytearray(size)  # written in place by NVRTC: never a (possibly shared) bytes object
            self._nvrtc_check("nvrtcGetCUBIN", nv.nvrtcGetCUBIN(program, buffer))
            binary = bytes(buffer)
        finally:
            nv.nvrtcDestroyProgram(program)
        if log.strip():
            logger.debug("nvrtc log for %s on %s:\n%s", spec_text, target, log)
        return CompiledKernel(binary=binary, lowered_name=lowered.decode(), log=log)

    def _program_log(self, program: Any) -> str:
        size = self._nvrtc_check("nvrtcGetProgramLogSize", self._nvrtc.nvrtcGetProgramLogSize(program))
        if size <= 1:
            return ""
        buffer = bytearray(size)
        self._nvrtc_check("nvrtcGetProgramLog", self._nvrtc.nvrtcGetProgramLog(program, buffer))
        return bytes(buffer).rstrip(b"\0").decode(errors="replace")

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
        # sm_90a builds every kernel for it, and lets families.runs_nvidia_wgmma pick the wgmma ones.
        return Target.parse(f"sm_{major}{minor}" + ("a" if (major, minor) == (9, 0) else ""))

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

    def _ensure_context(self) -> None:
        """Calls that need a context (module load, allocation) get the current or device 0's primary one."""
        self.get_device()

    # ---- modules and launches -----------------------------------------------------------------------
    def load_function(self, binary: bytes, lowered_name: str) -> Any:
        self._ensure_context()
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

    def launch(
        self,
        function: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_bytes: int,
        stream: int,
        params: ctypes.Structure,
    ) -> None:
        cell, cell_address = self._argument_slot.cell_and_address
        cell.value = ctypes.addressof(params)
        (result,) = self._cuLaunchKernel(
            function.handle, grid[0], grid[1], grid[2], block[0], block[1], block[2],
            shared_bytes, stream, cell_address, 0,
        )  # fmt: skip
        if result:
            raise self._error(f"cuLaunchKernel({function.name})", result)

    # ---- memory -----------------------------------------------------------------------------------
    def memset_async(self, ptr: int, byte_value: int, nbytes: int, stream: int) -> None:
        if nbytes:
            (result,) = self._cuMemsetD8Async(ptr, byte_value, nbytes, stream)
            if result:
                raise self._error("cuMemsetD8Async", result)

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        if nbytes:  # empty arrays may carry null pointers; a zero-byte copy is nothing to enqueue
            (result,) = self._cuMemcpyAsync(dst, src, nbytes, stream)
            if result:
                raise self._error("cuMemcpyAsync", result)

    def malloc_async(self, nbytes: int, stream: int) -> int:
        if nbytes == 0:
            return 0
        return int(self._check("cuMemAllocAsync", self._driver.cuMemAllocAsync(nbytes, stream)))

    def free_async(self, ptr: int, stream: int) -> None:
        if ptr:
            self._check("cuMemFreeAsync", self._driver.cuMemFreeAsync(ptr, stream))

    def mem_get_info(self) -> tuple[int, int]:
        self._ensure_context()
        free, total = self._check("cuMemGetInfo", self._driver.cuMemGetInfo())
        return int(free), int(total)

    def host_alloc(self, nbytes: int) -> int:
        self._ensure_context()
        flags = self._driver.CU_MEMHOSTALLOC_PORTABLE  # usable from every device's context
        return int(self._check("cuMemHostAlloc", self._driver.cuMemHostAlloc(max(nbytes, 1), flags)))

    def host_free(self, ptr: int) -> None:
        if ptr:
            self._check("cuMemFreeHost", self._driver.cuMemFreeHost(ptr))

    def launch_host_func(self, stream: int, function_address: int, user_data: int) -> None:
        if type(function_address) is not int:
            # A CFUNCTYPE object is not its address; the HIP bindings even accept one silently.
            raise TypeError(
                f"function_address must be the int address of a C function, got {type(function_address).__name__}"
            )
        if self._probe_driver_library:
            # Straight into libcuda, not through cuda-bindings: its cuLaunchHostFunc wraps the
            # function in a heap record that its trampoline frees after the first call (and runs
            # under the GIL). A graph that captured the host node replays it, and the second
            # replay then reads freed memory: seen on the H200 as a segfault in the callback
            # thread. The direct call registers our own C function, which survives every replay.
            code = _libcuda_launch_host_func()(stream or None, function_address, user_data or None)
            result = self._driver.CUresult(code)
        else:
            (result,) = self._cuLaunchHostFunc(stream, function_address, user_data)
        if result:
            raise self._error("cuLaunchHostFunc", result)

    # ---- streams and events ------------------------------------------------------------------------
    def stream_create(self) -> int:
        self._ensure_context()
        flags = self._driver.CUstream_flags.CU_STREAM_NON_BLOCKING  # no implicit sync with the legacy stream
        return int(self._check("cuStreamCreate", self._driver.cuStreamCreate(flags)))

    def stream_destroy(self, stream: int) -> None:
        self._check("cuStreamDestroy", self._driver.cuStreamDestroy(stream))

    def stream_synchronize(self, stream: int) -> None:
        self._check("cuStreamSynchronize", self._driver.cuStreamSynchronize(stream))

    def stream_is_capturing(self, stream: int) -> bool:
        status = self._check("cuStreamIsCapturing", self._driver.cuStreamIsCapturing(stream))
        # ACTIVE and INVALIDATED both mean a capture is still open on the stream.
        return int(status) != self._capture_none

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._check("cuStreamWaitEvent", self._driver.cuStreamWaitEvent(stream, event, 0))

    def event_create(self, timing: bool = False) -> int:
        self._ensure_context()
        flags = self._driver.CUevent_flags
        # Timing costs a timestamp per record; events used for ordering do without.
        value = flags.CU_EVENT_DEFAULT if timing else flags.CU_EVENT_DISABLE_TIMING
        return int(self._check("cuEventCreate", self._driver.cuEventCreate(value)))

    def event_destroy(self, event: int) -> None:
        self._check("cuEventDestroy", self._driver.cuEventDestroy(event))

    def event_record(self, event: int, stream: int) -> None:
        (result,) = self._cuEventRecord(event, stream)
        if result:
            raise self._error("cuEventRecord", result)

    def event_query(self, event: int) -> bool:
        (result,) = self._cuEventQuery(event)
        if not result:
            return True
        if result == self._not_ready:
            return False
        raise self._error("cuEventQuery", result)

    def event_synchronize(self, event: int) -> None:
        self._check("cuEventSynchronize", self._driver.cuEventSynchronize(event))

    def event_elapsed_ms(self, start: int, end: int) -> float:
        return float(self._check("cuEventElapsedTime", self._driver.cuEventElapsedTime(start, end)))

