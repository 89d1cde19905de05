"""AMD backend: hiprtc compiles, the HIP runtime loads and launches (both through hip-python).

It mirrors the CUDA backend call for call. hip-python accepts plain ints for handles and pointers and
an int address of a ``void**`` for ``kernelParams``. Two traps it sets: ``hipLaunchHostFunc`` accepts a
ctypes CFUNCTYPE object silently and hands the runtime the address of the Python object's buffer, so
only ints are passed; ``hiprtcDestroyProgram`` takes a ``hiprtcProgram*``, so it gets ``createRef()``
(the bare program segfaults).

The runtime half has never run on AMD hardware (no AMD GPU is available to this project); the compile
half is exercised in CI with ROCm 5.2's hiprtc.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import threading
from typing import Any

from ..errors import BackendUnavailableError, DriverError
from ..target import AMD, Target
from .base import Backend, CompiledKernel, KernelArgumentSlot, LoadedFunction, binding_outputs, compile_error

logger = logging.getLogger("hipattn")

_INSTALL_HINT = "install the AMD extra: pip install hipattn[amd] (and ROCm, or set ROCM_PATH to it)"

# The first ROCm release (major, minor) whose hiprtc compiles for each processor, and the first that no
# longer does. hiprtc does not report an unknown processor: the process aborts inside comgr (SIGABRT,
# seen with ROCm 5.2 on gfx940/941/942/950/1100), so hipattn refuses what the table does not list.
# Entries are conservative (an older release may know a processor a little earlier than listed):
#   5.2: everything up to gfx90a/gfx90c and RDNA2 up to gfx1036 (tried here: all compile);
#   6.0: CDNA3 gfx940/941/942 and RDNA3 gfx1100-1103 (5.5-5.7 knew some of them, unsupported);
#   6.1/6.2: RDNA3.5 gfx1150/1151 and RDNA4 gfx1200/1201;
#   7.0: gfx950 (CDNA4; some 6.4 compilers know it too, but 7.0 is the first release that ships it),
#        and gfx940/941 are gone from the compiler (folded into gfx942).
_ROCM_FIRST = (5, 0)
_PROCESSORS: dict[str, tuple[tuple[int, int], tuple[int, int] | None]] = {
    **{gfx: (_ROCM_FIRST, None) for gfx in ("gfx900", "gfx906", "gfx908", "gfx90a", "gfx90c")},
    **{f"gfx{n}": (_ROCM_FIRST, None) for n in (1010, 1011, 1012, 1030, 1031, 1032, 1033, 1034, 1035)},
    "gfx1036": ((5, 2), None),
    "gfx940": ((6, 0), (7, 0)),
    "gfx941": ((6, 0), (7, 0)),
    "gfx942": ((6, 0), None),
    **{f"gfx{n}": ((6, 0), None) for n in (1100, 1101, 1102, 1103)},
    "gfx1150": ((6, 1), None),
    "gfx1151": ((6, 1), None),
    "gfx1200": ((6, 2), None),
    "gfx1201": ((6, 2), None),
    "gfx950": ((7, 0), None),
}

_SONAME_VERSION = re.compile(r"^lib(?:hiprtc|amdhip64)\.so\.(\d+)\.(\d+)(?:\.(\d+))?")


def _text(value: Any) -> str:
    """hip-python hands strings back as bytes or as its CStr type; both decode."""
    if value is None:
        return ""
    decode = getattr(value, "decode", None)
    return decode() if decode is not None else str(value)


def _loaded_library(prefixes: tuple[str, ...]) -> str | None:
    """The real path of a shared library already mapped into this process (Linux), by name prefix."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return None
    for prefix in prefixes:
        for path in sorted(paths):
            if os.path.basename(path).startswith(prefix):
                return os.path.realpath(path)
    return None


class HipBackend(Backend):
    name = "hip"
    vendor = AMD

    def __init__(self, hip_module: Any = None, hiprtc_module: Any = None) -> None:
        """``hip_module``/``hiprtc_module`` default to hip-python's; tests may pass stand-ins."""
        if hip_module is None or hiprtc_module is None:
            try:
                from hip import hip, hiprtc
            except ImportError as error:
                raise BackendUnavailableError(f"hip-python is not installed ({error}); {_INSTALL_HINT}") from None
            hip_module = hip_module or hip
            hiprtc_module = hiprtc_module or hiprtc
        self._hip = hip_module
        self._hiprtc = hiprtc_module
        self._identity: str | None = None
        self._rocm_version: tuple[int, int] | None = None
        self._properties: dict[int, Any] = {}
        self._shared_limits: dict[int, int] = {}
        self._lock = threading.Lock()
        # comgr in older ROCm releases keeps global state; compiles in one process are serialised
        # (parallel `hipattn warm` uses processes, which also contain an abort).
        self._compile_lock = threading.Lock()
        self._argument_slot = KernelArgumentSlot()

        h = hip_module
        self._hipModuleLaunchKernel = h.hipModuleLaunchKernel
        self._hipMemsetAsync = h.hipMemsetAsync
        self._hipMemcpyAsync = h.hipMemcpyAsync
        self._hipLaunchHostFunc = h.hipLaunchHostFunc
        self._hipSetDevice = h.hipSetDevice
        self._hipEventRecord = h.hipEventRecord
        self._hipEventQuery = h.hipEventQuery
        self._memcpy_default = h.hipMemcpyKind.hipMemcpyDefault  # unified addressing: any direction
        self._not_ready = int(h.hipError_t.hipErrorNotReady)
        self._capture_none = int(h.hipStreamCaptureStatus.hipStreamCaptureStatusNone)

    # ---- the one error path ---------------------------------------------------------------------
    def _error(self, call: str, result: Any) -> DriverError:
        name, description = getattr(result, "name", "") or "", ""
        try:
            _, text = self._hip.hipGetErrorName(result)
            name = _text(text) or name
            _, text = self._hip.hipGetErrorString(result)
            description = _text(text)
        except Exception:  # the lookup needs libamdhip64; the enum's own name is a fine fallback
            pass
        if description == name:  # HIP often describes an error by repeating its name
            description = ""
        return DriverError(call, int(result), name, description)

    def _rtc_error(self, call: str, result: Any) -> DriverError:
        name = getattr(result, "name", "") or ""
        try:
            _, text = self._hiprtc.hiprtcGetErrorString(result)
            name = _text(text) or name
        except Exception:  # same fallback as the runtime: the enum's own name
            pass
        return DriverError(call, int(result), name)

    def _check(self, call: str, returned: tuple) -> Any:
        return binding_outputs(call, returned, self._error)

    def _rtc_check(self, call: str, returned: tuple) -> Any:
        return binding_outputs(call, returned, self._rtc_error)

    # ---- compiling ------------------------------------------------------------------------------
    def compiler_identity(self) -> str:
        """'hiprtc 5.2.21153 (libamdhip64.so.5.2.21153)': the HIP version and the library file compiling.

        ``hiprtcVersion`` is no use: ROCm 5.2 answers 9.0. ``hipRuntimeGetVersion`` answers without a
        GPU (tried with 5.2); the real file name of the loaded hiprtc library pins the exact build
        (from ROCm 6 hiprtc is its own library, which could come from another install than the runtime).
        """
        if self._identity is None:
            self._identity, self._rocm_version = self._probe_compiler()
        return self._identity

    def _probe_compiler(self) -> tuple[str, tuple[int, int] | None]:
        try:
            returned = self._hiprtc.hiprtcVersion()  # loads libhiprtc (hip-python loads lazily)
        except Exception as error:
            raise BackendUnavailableError(f"hiprtc could not be loaded ({error}); {_INSTALL_HINT}") from None
        self._rtc_check("hiprtcVersion", returned)
        version, rocm = None, None
        try:
            result, number = self._hip.hipRuntimeGetVersion()
            if not result and number:
                # HIP_VERSION = major * 10_000_000 + minor * 100_000 + patch
                major, minor, patch = number // 10_000_000, number // 100_000 % 100, number % 100_000
                version, rocm = f"{major}.{minor}.{patch}", (major, minor)
        except Exception:  # the library file name below still identifies the compiler
            logger.debug("hipRuntimeGetVersion failed; identifying hiprtc by its library file", exc_info=True)
        library = _loaded_library(("libhiprtc", "libamdhip64"))
        file_name = os.path.basename(library) if library else None
        if file_name and rocm is None:
            match = _SONAME_VERSION.match(file_name)
            if match:
                rocm = (int(match.group(1)), int(match.group(2)))
        identity = f"hiprtc {version or 'unknown'}" + (f" ({file_name})" if file_name else "")
        return identity, rocm

    def rocm_version(self) -> tuple[int, int] | None:
        """(major, minor) of the ROCm release whose hiprtc compiles here, None if it cannot be told."""
        self.compiler_identity()
        return self._rocm_version

    def unsupported_reason(self, target: Target) -> str | None:
        """Why this hiprtc cannot compile for ``target`` (None if it can): the text of the error callers get."""
        if target.vendor != AMD:
            return f"the hip backend compiles for AMD targets (gfxNNN), not {target}"
        version = self.rocm_version()
        known = _PROCESSORS.get(target.base_arch)
        if known is None:
            return (
                f"{target.base_arch} is not in hipattn's table of processors hiprtc knows; an unknown processor "
                "aborts the process inside hiprtc instead of failing, so hipattn does not try it"
            )
        first, gone = known
        effective = version or _ROCM_FIRST  # unknown release: assume the oldest, so nothing aborts
        if effective < first or (gone is not None and effective >= gone):
            have = f"ROCm {version[0]}.{version[1]}" if version else "an unidentified ROCm"
            need = f"ROCm >= {first[0]}.{first[1]}" + (f" and < {gone[0]}.{gone[1]}" if gone else "")
            return (
                f"{self.compiler_identity()} is from {have}, which does not know {target.base_arch} "
                f"(hiprtc would abort the process instead of reporting an error); {target.base_arch} needs "
                f"{need}: point ROCM_PATH at a newer ROCm"
            )
        return None

    def can_compile_for(self, target: Target) -> bool:
        return self.unsupported_reason(target) is None

    def compile_options(self, target: Target) -> tuple[str, ...]:
        if target.vendor != AMD:
            raise ValueError(f"the hip backend compiles for AMD targets (gfxNNN), not {target}")
        # The full arch with its features (gfx90a:sramecc+:xnack-): features change the code object.
        return (f"--offload-arch={target.arch}", "-O3", "-std=c++17")

    def compile(
        self,
        source: str,
        headers: dict[str, str],
        name_expression: str,
        target: Target,
        options: tuple[str, ...],
        spec_text: str,
    ) -> CompiledKernel:
        reason = self.unsupported_reason(target)
        if reason is not None:
            if target.vendor != AMD:
                raise ValueError(reason)
            raise compile_error(spec_text, target, tuple(options), reason, source)
        rtc = self._hiprtc
        names = [name.encode() for name in headers]
        texts = [text.encode() for text in headers.values()]
        with self._compile_lock:
            program = self._rtc_check(
                "hiprtcCreateProgram",
                rtc.hiprtcCreateProgram(
                    source.encode(), b"hipattn_kernel.hip", len(names), texts or None, names or None
                ),
            )
            try:
                expression = name_expression.encode()
                self._rtc_check("hiprtcAddNameExpression", rtc.hiprtcAddNameExpression(program, expression))
                encoded_options = [option.encode() for option in options]
                (result,) = rtc.hiprtcCompileProgram(program, len(encoded_options), encoded_options)
                log = self._program_log(program)
                if result:
                    detail = log if log.strip() else f"{getattr(result, 'name', '')} ({int(result)})"
                    raise compile_error(spec_text, target, tuple(options), detail, source)
                # The lowered name points into the program: copy it out before the program is destroyed.
                lowered = _text(self._rtc_check("hiprtcGetLoweredName", rtc.hiprtcGetLoweredName(program, expression)))
                size = self._rtc_check("hiprtcGetCodeSize", rtc.hiprtcGetCodeSize(program))
                buffer = bytearray(size)
                self._rtc_check("hiprtcGetCode", rtc.hiprtcGetCode(program, buffer))
            finally:
                rtc.hiprtcDestroyProgram(program.createRef())
        if log.strip():
            logger.debug("hiprtc log for %s on %s:\n%s", spec_text, target, log)
        return CompiledKernel(binary=bytes(buffer), lowered_name=lowered, log=log)

    def _program_log(self, program: Any) -> str:
        size = self._rtc_check("hiprtcGetProgramLogSize", self._hiprtc.hiprtcGetProgramLogSize(program))
        if size <= 1:
            return ""
        buffer = bytearray(size)
        self._rtc_check("hiprtcGetProgramLog", self._hiprtc.hiprtcGetProgramLog(program, buffer))
        return bytes(buffer).rstrip(b"\0").decode(errors="replace")

    # ---- devices ----------------------------------------------------------------------------------
    def _device_properties(self, device: int) -> Any:
        properties = self._properties.get(device)
        if properties is None:  # hipGetDeviceProperties is slow (it fills a large struct): once per device
            properties = self._check("hipGetDeviceProperties", self._hip.hipGetDeviceProperties(device))
            self._properties[device] = properties
        return properties

    def device_count(self) -> int:
        try:
            returned = self._hip.hipGetDeviceCount()
        except Exception as error:  # hip-python loads libamdhip64 lazily; a missing runtime shows here
            raise BackendUnavailableError(f"the HIP runtime could not be loaded ({error}); {_INSTALL_HINT}") from None
        return int(self._check("hipGetDeviceCount", returned))

    def device_target(self, device: int) -> Target:
        properties = self._device_properties(device)
        # gcnArchName carries the target features the code object must match (gfx90a:sramecc+:xnack-).
        target = Target.parse(_text(properties.gcnArchName))
        warp_size = int(getattr(properties, "warpSize", target.warp_size))
        if warp_size != target.warp_size:
            logger.warning(
                "device %d (%s) reports a warp size of %d; hipattn assumes %d for %s",
                device, target.arch, warp_size, target.warp_size, target.base_arch,
            )  # fmt: skip
        return target

    def device_name(self, device: int) -> str:
        return _text(self._device_properties(device).name)

    def get_device(self) -> int:
        return int(self._check("hipGetDevice", self._hip.hipGetDevice()))

    def set_device(self, device: int) -> None:
        (result,) = self._hipSetDevice(device)
        if result:
            raise self._error("hipSetDevice", result)

    def pointer_device(self, ptr: int) -> int:
        attributes = self._check("hipPointerGetAttributes", self._hip.hipPointerGetAttributes(ptr))
        return int(attributes.device)

    # ---- modules and launches -----------------------------------------------------------------------
    def load_function(self, binary: bytes, lowered_name: str) -> Any:
        module = self._check("hipModuleLoadData", self._hip.hipModuleLoadData(binary))
        function = self._check("hipModuleGetFunction", self._hip.hipModuleGetFunction(module, lowered_name.encode()))
        # Never unloaded, as on CUDA: functions live as long as the process's registry.
        return LoadedFunction(function, module, lowered_name)

    def set_max_dynamic_shared_memory(self, function: Any, nbytes: int) -> None:
        # AMD needs no opt-in for dynamic LDS up to the device's limit (hipFuncSetAttribute wants a
        # host-side kernel symbol, which a module function does not have). Check the limit instead, so
        # an oversized request fails here, as it does on CUDA, and not at launch.
        device = self.get_device()
        limit = self._shared_limits.get(device)
        if limit is None:
            attribute = self._hip.hipDeviceAttribute_t.hipDeviceAttributeMaxSharedMemoryPerBlock
            limit = int(self._check("hipDeviceGetAttribute", self._hip.hipDeviceGetAttribute(attribute, device)))
            self._shared_limits[device] = limit
        if nbytes > limit:
            invalid = self._hip.hipError_t.hipErrorInvalidValue
            raise DriverError(
                f"set_max_dynamic_shared_memory({function.name})",
                int(invalid),
                getattr(invalid, "name", "hipErrorInvalidValue"),
                f"{nbytes} bytes of shared memory requested; device {device} allows {limit} per block",
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
        (result,) = self._hipModuleLaunchKernel(
            function.handle, grid[0], grid[1], grid[2], block[0], block[1], block[2],
            shared_bytes, stream, cell_address, None,
        )  # fmt: skip
        if result:
            raise self._error(f"hipModuleLaunchKernel({function.name})", result)

    # ---- memory -----------------------------------------------------------------------------------
    def memset_async(self, ptr: int, byte_value: int, nbytes: int, stream: int) -> None:
        if nbytes:
            (result,) = self._hipMemsetAsync(ptr, byte_value, nbytes, stream)
            if result:
                raise self._error("hipMemsetAsync", result)

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        if nbytes:  # empty arrays may carry null pointers; a zero-byte copy is nothing to enqueue
            (result,) = self._hipMemcpyAsync(dst, src, nbytes, self._memcpy_default, stream)
            if result:
                raise self._error("hipMemcpyAsync", result)

    def malloc_async(self, nbytes: int, stream: int) -> int:
        if nbytes == 0:
            return 0
        return int(self._check("hipMallocAsync", self._hip.hipMallocAsync(nbytes, stream)))

    def free_async(self, ptr: int, stream: int) -> None:
        if ptr:
            self._check("hipFreeAsync", self._hip.hipFreeAsync(ptr, stream))

    def mem_get_info(self) -> tuple[int, int]:
        free, total = self._check("hipMemGetInfo", self._hip.hipMemGetInfo())
        return int(free), int(total)

    def host_alloc(self, nbytes: int) -> int:
        flags = self._hip.hipHostMallocPortable  # usable from every device
        return int(self._check("hipHostMalloc", self._hip.hipHostMalloc(max(nbytes, 1), flags)))

    def host_free(self, ptr: int) -> None:
        if ptr:
            self._check("hipHostFree", self._hip.hipHostFree(ptr))

    def launch_host_func(self, stream: int, function_address: int, user_data: int) -> None:
        if type(function_address) is not int:
            # hip-python would take a CFUNCTYPE object and pass the address of its Python-side buffer.
            raise TypeError(
                f"function_address must be the int address of a C function, got {type(function_address).__name__}"
            )
        (result,) = self._hipLaunchHostFunc(stream, function_address, user_data)
        if result:
            raise self._error("hipLaunchHostFunc", result)

    # ---- streams and events ------------------------------------------------------------------------
    def stream_create(self) -> int:
        flags = self._hip.hipStreamNonBlocking  # no implicit sync with the null stream
        return int(self._check("hipStreamCreateWithFlags", self._hip.hipStreamCreateWithFlags(flags)))

    def stream_destroy(self, stream: int) -> None:
        self._check("hipStreamDestroy", self._hip.hipStreamDestroy(stream))

    def stream_synchronize(self, stream: int) -> None:
        self._check("hipStreamSynchronize", self._hip.hipStreamSynchronize(stream))

    def stream_is_capturing(self, stream: int) -> bool:
        status = self._check("hipStreamIsCapturing", self._hip.hipStreamIsCapturing(stream))
        # Active and invalidated both mean a capture is still open on the stream.
        return int(status) != self._capture_none

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._check("hipStreamWaitEvent", self._hip.hipStreamWaitEvent(stream, event, 0))

    def event_create(self, timing: bool = False) -> int:
        # Timing costs a timestamp per record; events used for ordering do without.
        flags = self._hip.hipEventDefault if timing else self._hip.hipEventDisableTiming
        return int(self._check("hipEventCreateWithFlags", self._hip.hipEventCreateWithFlags(flags)))

    def event_destroy(self, event: int) -> None:
        self._check("hipEventDestroy", self._hip.hipEventDestroy(event))

    def event_record(self, event: int, stream: int) -> None:
        (result,) = self._hipEventRecord(event, stream)
        if result:
            raise self._error("hipEventRecord", result)

    def event_query(self, event: int) -> bool:
        (result,) = self._hipEventQuery(event)
        if not result:
            return True
        if result == self._not_ready:
            return False
        raise self._error("hipEventQuery", result)

    def event_synchronize(self, event: int) -> None:
        self._check("hipEventSynchronize", self._hip.hipEventSynchronize(event))

    def event_elapsed_ms(self, start: int, end: int) -> float:
        return float(self._check("hipEventElapsedTime", self._hip.hipEventElapsedTime(start, end)))
