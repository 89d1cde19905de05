"""AMD backend: hiprtc compiles, the HIP runtime loads and launches (both through hip-python).

What it shares with the CUDA backend (the launch, the one-call memory, stream and event methods, the
runtime compiler's skeleton) is written once in ``base`` and ``rtc``; this module names hip-python's
calls for them and holds what differs: target checks against the ROCm release, device properties, the
LDS limit, the copy kind. hip-python accepts plain ints for handles and pointers and an int address of a
``void**`` for ``kernelParams``. Two traps it sets: ``hipLaunchHostFunc`` accepts a
ctypes CFUNCTYPE object silently and hands the runtime the address of the Python object's buffer, so
only ints are passed; ``hiprtcDestroyProgram`` takes a ``hiprtcProgram*``, so it gets ``createRef()``
(the bare program segfaults).

The runtime half has never run on AMD hardware (no AMD GPU is available to this project); the compile
half is exercised in CI with ROCm 5.2's hiprtc.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from typing import Any

from ..errors import BackendUnavailableError, DriverError
from ..jit.target import AMD, Target
from .base import (
    Backend,
    KernelArgumentSlot,
    LoadedFunction,
    RuntimeCall,
    binding_modules,
    compile_error,
)
from .rtc import RuntimeCompiler, binding_text

logger = logging.getLogger("hipattn")

_INSTALL_HINT = "install the AMD extra: pip install hipattn[amd] (and ROCm, or set ROCM_PATH to it)"


def _missing_library(library: str, error: Exception) -> str:
    """What to do when hip-python (so the AMD extra) is installed but cannot load ``library``."""
    detail = re.sub(r"b'([^']*)'", r"\1", str(error))  # hip-python quotes the loader's bytes as b'...'
    rocm = os.environ.get("ROCM_PATH")
    where = (f"ROCM_PATH={rocm} has no loadable lib/{library}" if rocm
             else f"ROCM_PATH is not set and {library} is not on the loader's path")
    return (f"{library} could not be loaded ({detail}): {where}. hip-python is installed; it needs a ROCm "
            "install: set ROCM_PATH to one whose lib/ holds libamdhip64.so and libhiprtc.so (the README's "
            "'AMD setup' shows how with Debian's packages)")


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
    CALL_NAMES = {"launch": "hipModuleLaunchKernel", "memset_async": "hipMemsetAsync", "event_record": "hipEventRecord",
                  "event_query": "hipEventQuery", "launch_host_func": "hipLaunchHostFunc"}
    RUNTIME_CALLS = {
        "malloc_async": RuntimeCall("hipMallocAsync"),
        "free_async": RuntimeCall("hipFreeAsync"),
        "mem_get_info": RuntimeCall("hipMemGetInfo"),
        "host_alloc": RuntimeCall("hipHostMalloc", ("hipHostMallocPortable",)),  # usable from every device
        "host_free": RuntimeCall("hipHostFree"),
        # Non-blocking: no implicit synchronisation with the null stream.
        "stream_create": RuntimeCall("hipStreamCreateWithFlags", ("hipStreamNonBlocking",)),
        "stream_destroy": RuntimeCall("hipStreamDestroy"),
        "stream_synchronize": RuntimeCall("hipStreamSynchronize"),
        "stream_is_capturing": RuntimeCall("hipStreamIsCapturing"),
        "stream_wait_event": RuntimeCall("hipStreamWaitEvent", (0,)),
        "event_create": RuntimeCall("hipEventCreateWithFlags", ("hipEventDisableTiming",)),
        "event_create_timing": RuntimeCall("hipEventCreateWithFlags", ("hipEventDefault",)),
        "event_destroy": RuntimeCall("hipEventDestroy"),
        "event_synchronize": RuntimeCall("hipEventSynchronize"),
        "event_elapsed_ms": RuntimeCall("hipEventElapsedTime"),
    }
    CAPTURE_NONE = "hipStreamCaptureStatus.hipStreamCaptureStatusNone"

    def __init__(self, hip_module: Any = None, hiprtc_module: Any = None) -> None:
        """``hip_module``/``hiprtc_module`` default to hip-python's; tests may pass stand-ins."""
        hip_module, hiprtc_module = binding_modules("hip", ("hip", "hiprtc"), (hip_module, hiprtc_module), "hip-python",
                                                    _INSTALL_HINT)
        self._hip = hip_module
        self._hiprtc = hiprtc_module
        self._identity: str | None = None
        self._rocm_version: tuple[int, int] | None = None
        self._properties: dict[int, Any] = {}
        self._shared_limits: dict[int, int] = {}
        self._lock = threading.Lock()
        self._argument_slot = KernelArgumentSlot()
        # comgr in older ROCm releases keeps global state, so compiles in one process are serialised
        # (parallel `hipattn warm` uses processes, which also contain an abort). hiprtcDestroyProgram
        # takes a hiprtcProgram*: createRef() (the bare program segfaults).
        self._compiler = RuntimeCompiler(hiprtc_module, "hiprtc", code_call="Code", file_name="hipattn_kernel.hip",
                                         serialise=True, empty_as_none=True,
                                         destroy=lambda program: hiprtc_module.hiprtcDestroyProgram(program.createRef()))

        h = hip_module
        self._bind_hot_path(h, launch_extra=None, not_ready=int(h.hipError_t.hipErrorNotReady))
        self._hipMemcpyAsync = h.hipMemcpyAsync
        self._launch_host_func_call = h.hipLaunchHostFunc
        self._hipSetDevice = h.hipSetDevice
        self._memcpy_default = h.hipMemcpyKind.hipMemcpyDefault  # unified addressing: any direction

    # ---- the one error path ---------------------------------------------------------------------
    def _error(self, call: str, result: Any) -> DriverError:
        name, description = getattr(result, "name", "") or "", ""
        try:
            _, text = self._hip.hipGetErrorName(result)
            name = binding_text(text) or name
            _, text = self._hip.hipGetErrorString(result)
            description = binding_text(text)
        except Exception:  # the lookup needs libamdhip64; the enum's own name is a fine fallback
            pass
        if description == name:  # HIP often describes an error by repeating its name
            description = ""
        return DriverError(call, int(result), name, description)

    def _binding(self) -> Any:
        return self._hip

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
            self._compiler.call("Version")  # loads libhiprtc (hip-python loads lazily)
        except Exception as error:
            raise BackendUnavailableError(_missing_library("libhiprtc.so", error)) from None
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

    def compile_options(self, target: Target) -> tuple[str, ...]:
        if target.vendor != AMD:
            raise ValueError(f"the hip backend compiles for AMD targets (gfxNNN), not {target}")
        # The full arch with its features (gfx90a:sramecc+:xnack-): features change the code object.
        return (f"--offload-arch={target.arch}", "-O3", "-std=c++17")

    def _before_compile(self, target: Target, options: tuple[str, ...], spec_text: str, source: str) -> None:
        reason = self.unsupported_reason(target)
        if reason is not None:
            if target.vendor != AMD:
                raise ValueError(reason)
            raise compile_error(spec_text, target, tuple(options), reason, source)

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
            raise BackendUnavailableError(_missing_library("libamdhip64.so", error)) from None
        return int(self._check("hipGetDeviceCount", returned))

    def device_target(self, device: int) -> Target:
        properties = self._device_properties(device)
        # gcnArchName carries the target features the code object must match (gfx90a:sramecc+:xnack-).
        target = Target.parse(binding_text(properties.gcnArchName))
        warp_size = int(getattr(properties, "warpSize", target.warp_size))
        if warp_size != target.warp_size:
            logger.warning(
                "device %d (%s) reports a warp size of %d; hipattn assumes %d for %s",
                device, target.arch, warp_size, target.warp_size, target.base_arch,
            )  # fmt: skip
        return target

    def device_name(self, device: int) -> str:
        return binding_text(self._device_properties(device).name)

    def compute_units(self, device: int) -> int:
        return int(self._device_properties(device).multiProcessorCount)

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

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        if nbytes:  # empty arrays may carry null pointers; a zero-byte copy is nothing to enqueue
            (result,) = self._hipMemcpyAsync(dst, src, nbytes, self._memcpy_default, stream)
            if result:
                raise self._error("hipMemcpyAsync", result)
