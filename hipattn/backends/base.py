"""The one small interface both vendor runtimes implement.

A backend compiles (no GPU needed), loads modules, launches kernels and moves memory, all
asynchronously on a caller's stream. Handles are plain ints (device pointers, streams, events) or
opaque objects returned by the backend itself (modules, functions). Every failing runtime call
raises ``DriverError`` naming the call; compile failures raise ``CompileError`` with the log.
"""

from __future__ import annotations

import ctypes
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from .. import env
from ..errors import BackendUnavailableError, CompileError
from ..jit.target import Target


@dataclass(frozen=True)
class CompiledKernel:
    """What the runtime compiler produced for one name expression."""

    binary: bytes  # CUBIN (NVIDIA) or code object ELF (AMD) for exactly the target arch
    lowered_name: str  # the mangled symbol to look up in the loaded module
    log: str  # compiler warnings, kept for `hipattn warm -v`


def compile_error(spec_text: str, target: Target, options: tuple[str, ...], log: str, source: str) -> CompileError:
    """The CompileError both backends raise; the instantiated source rides along under HIPATTN_DUMP_SOURCE=1."""
    dump = env.flag("HIPATTN_DUMP_SOURCE", False)
    return CompileError(spec_text, str(target), options, log, source if dump else None)


class LoadedFunction:
    """A loaded kernel: the runtime's function handle ``launch`` passes, and the module that must outlive it."""

    __slots__ = ("handle", "module", "name")

    def __init__(self, handle: Any, module: Any, name: str) -> None:
        self.handle = handle
        self.module = module
        self.name = name

    def __repr__(self) -> str:
        return f"LoadedFunction({self.name})"


class KernelArgumentSlot(threading.local):
    """A per-thread ``void*[1]`` holding the address of the one by-value kernel argument.

    Both launch APIs want ``void** kernelParams``. Reusing one cell per thread saves the ctypes
    allocation a fresh array would cost on every launch; it must be per thread because the bindings
    release the GIL inside the launch call, while the driver is still reading the cell.
    """

    def __init__(self) -> None:
        cell = ctypes.c_void_p()
        # (cell, address of cell): one attribute read on the hot path gives both.
        self.cell_and_address = (cell, ctypes.addressof(cell))


def binding_modules(package: str, names: tuple[str, ...], given: tuple[Any, ...], distribution: str,
                    install_hint: str) -> tuple[Any, ...]:
    """``from package import names``, for each name whose module is not ``given`` (tests pass stand-ins);
    BackendUnavailableError naming the ``distribution`` and how to install it when it is missing."""
    if all(module is not None for module in given):
        return given
    try:
        package_module = __import__(package, fromlist=names)
        imported = tuple(getattr(package_module, name) for name in names)
    except (ImportError, AttributeError) as error:
        raise BackendUnavailableError(f"{distribution} is not installed ({error}); {install_hint}") from None
    return tuple(imported_module if module is None else module for module, imported_module in zip(given, imported, strict=True))


def binding_outputs(call: str, returned: tuple, error: Callable[[str, Any], Exception]) -> Any:
    """The one error path of both bindings: a call returns ``(result, *outputs)``; a non-zero result
    raises ``error(call, result)``, else the outputs come back (None, one value, or a tuple)."""
    if returned[0]:
        raise error(call, returned[0])
    if len(returned) == 1:
        return None
    return returned[1] if len(returned) == 2 else returned[1:]


# A grid or block size: (x, y, z).
Dim3 = tuple[int, int, int]


@dataclass(frozen=True)
class RuntimeCall:
    """The binding function that serves one generic backend call, and the constants (attribute paths in
    the binding module, or plain values) that follow the caller's arguments."""

    function: str
    constants: tuple[Any, ...] = ()
    needs_context: bool = False


class Backend(ABC):
    name: ClassVar[str]  # "cuda" or "hip": the HIPATTN_BACKEND spelling
    vendor: ClassVar[str]  # target.AMD or target.NVIDIA

    # ---- compiling (works without a GPU) ------------------------------------------------------
    @abstractmethod
    def compiler_identity(self) -> str:
        """Compiler name and version, e.g. 'nvrtc 13.0' or 'hiprtc 5.2.21153': part of the cache key."""

    @abstractmethod
    def compile_options(self, target: Target) -> tuple[str, ...]:
        """The options hipattn compiles with for ``target`` (arch flag, language standard, optimisation)."""

    _compiler: Any  # the vendor's rtc.RuntimeCompiler

    def compile(self, source: str, headers: dict[str, str], name_expression: str, target: Target,
                options: tuple[str, ...], spec_text: str) -> CompiledKernel:
        """Compile one template instantiation; raises CompileError(spec_text, target, options, log)."""
        self._before_compile(target, options, spec_text, source)
        return self._compiler.compile(source, headers, name_expression, target, options, spec_text)

    @abstractmethod
    def _before_compile(self, target: Target, options: tuple[str, ...], spec_text: str, source: str) -> None:
        """Refuse, before the compiler sees it, what it cannot compile (another vendor's target, one an
        old compiler would abort on), and make sure the compiler loads."""

    def unsupported_reason(self, target: Target) -> str | None:
        """Why this backend's compiler cannot compile for ``target``, or None when it can: the text
        ``hipattn warm`` prints, once per target, instead of one compile error per kernel."""
        if target.vendor != self.vendor:
            return f"the {self.name} backend compiles for {self.vendor} targets, not {target}"
        return None

    def can_compile_for(self, target: Target) -> bool:
        """False where the compiler is known not to handle ``target`` (an old hiprtc aborts on new gfx)."""
        return self.unsupported_reason(target) is None

    # ---- devices ------------------------------------------------------------------------------
    @abstractmethod
    def device_count(self) -> int: ...

    @abstractmethod
    def device_target(self, device: int) -> Target: ...

    @abstractmethod
    def device_name(self, device: int) -> str: ...

    def compute_units(self, device: int) -> int:
        """Streaming multiprocessors (NVIDIA) or compute units (AMD) of ``device``: how many blocks run
        side by side, which work-splitting heuristics size grids by. A backend that cannot tell says 1."""
        return 1

    @abstractmethod
    def get_device(self) -> int:
        """The calling thread's current device."""

    @abstractmethod
    def set_device(self, device: int) -> None:
        """Make ``device`` current on the calling thread (its primary context, shared with the frameworks)."""

    @abstractmethod
    def pointer_device(self, ptr: int) -> int:
        """The ordinal of the device ``ptr`` was allocated on or registered with; DriverError when the
        runtime does not know the pointer. Asked only for arrays whose producer names no device."""

    # ---- modules and launches (on the current device) -------------------------------------------
    @abstractmethod
    def load_function(self, binary: bytes, lowered_name: str) -> Any:
        """Load a module on the current device and return the kernel's function handle."""

    @abstractmethod
    def set_max_dynamic_shared_memory(self, function: Any, nbytes: int) -> None: ...

    # ---- the hot path: launches, memsets, event records and queries, host functions ---------------
    # Bound once by each vendor's constructor (the binding's function objects, no lookups per call);
    # the methods below are the same for both, error names from CALL_NAMES.
    _launch_kernel: Callable[..., tuple]
    _launch_extra: Any  # the binding's "no extra launch options" (0 for cuda-bindings, None for hip-python)
    _memset_d8_async: Callable[..., tuple]
    _event_record_call: Callable[..., tuple]
    _event_query_call: Callable[..., tuple]
    _not_ready: int  # the result code of an event still pending
    _launch_host_func_call: Callable[[int, int, int], tuple]  # bound by the vendor: its binding's, or one of its own
    _argument_slot: KernelArgumentSlot
    CALL_NAMES: ClassVar[Mapping[str, str]] = {}  # launch, memset_async, event_record, event_query, launch_host_func

    def _bind_hot_path(self, binding: Any, *, launch_extra: Any, not_ready: int) -> None:
        """Bind the hot path's functions of ``binding`` once, by their CALL_NAMES: a launch then does no
        lookups. Each vendor's constructor calls this."""
        self._launch_kernel = getattr(binding, self.CALL_NAMES["launch"])
        self._memset_d8_async = getattr(binding, self.CALL_NAMES["memset_async"])
        self._event_record_call = getattr(binding, self.CALL_NAMES["event_record"])
        self._event_query_call = getattr(binding, self.CALL_NAMES["event_query"])
        self._launch_extra = launch_extra
        self._not_ready = not_ready

    @abstractmethod
    def _error(self, call: str, result: Any) -> Exception:
        """The DriverError of ``call`` returning ``result``: the vendor's one error path."""

    def _check(self, call: str, returned: tuple) -> Any:
        return binding_outputs(call, returned, self._error)

    def encode_tensor_map(self, address: int, layout: Any) -> Any:
        """The ``TensorMapBytes`` of a ``backends.tensor_maps.TensorMapLayout`` at ``address``: NVIDIA
        Hopper's copy engine alone reads them, so only the CUDA backend encodes them."""
        raise NotImplementedError(f"the {self.name} backend has no tensor maps (an NVIDIA sm_90 feature)")

    def launch(self, function: Any, grid: Dim3, block: Dim3, shared_bytes: int, stream: int,
               params: ctypes.Structure) -> None:
        """Enqueue ``function<<<grid, block, shared_bytes, stream>>>(params)``; ``params`` passed by value."""
        cell, cell_address = self._argument_slot.cell_and_address
        cell.value = ctypes.addressof(params)
        (result,) = self._launch_kernel(
            function.handle, grid[0], grid[1], grid[2], block[0], block[1], block[2],
            shared_bytes, stream, cell_address, self._launch_extra,
        )  # fmt: skip
        if result:
            raise self._error(f"{self.CALL_NAMES['launch']}({function.name})", result)

    def memset_async(self, ptr: int, byte_value: int, nbytes: int, stream: int) -> None:
        if nbytes:
            (result,) = self._memset_d8_async(ptr, byte_value, nbytes, stream)
            if result:
                raise self._error(self.CALL_NAMES["memset_async"], result)

    def event_record(self, event: int, stream: int) -> None:
        (result,) = self._event_record_call(event, stream)
        if result:
            raise self._error(self.CALL_NAMES["event_record"], result)

    def event_query(self, event: int) -> bool:
        """True once all work captured by the event has completed; never blocks."""
        (result,) = self._event_query_call(event)
        if not result:
            return True
        if result == self._not_ready:
            return False
        raise self._error(self.CALL_NAMES["event_query"], result)

    @abstractmethod
    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Any direction (unified addressing): device<->device, device<->pinned host."""

    def launch_host_func(self, stream: int, function_address: int, user_data: int) -> None:
        """Enqueue a host function; ``function_address`` is the int address of a C-callable ``void(void*)``."""
        if type(function_address) is not int:
            # A CFUNCTYPE object is not its address, and hip-python would even take one silently and
            # pass the address of its Python-side buffer.
            raise TypeError(
                f"function_address must be the int address of a C function, got {type(function_address).__name__}"
            )
        (result,) = self._launch_host_func_call(stream, function_address, user_data)
        if result:
            raise self._error(self.CALL_NAMES["launch_host_func"], result)

    # ---- one runtime call each: memory, streams, events -------------------------------------------
    # Each vendor names, per generic call, the binding function that serves it and the constants that
    # follow the caller's arguments (RUNTIME_CALLS); the methods below are written once. They are off
    # the hot path, so each resolves its function when called (a test can stand a recorder in for it).
    RUNTIME_CALLS: ClassVar[Mapping[str, RuntimeCall]] = {}
    CAPTURE_NONE: ClassVar[str] = ""  # the binding's "no capture" status, as a constant path

    def _binding(self) -> Any:
        """The vendor runtime module RUNTIME_CALLS name functions and constants of."""
        raise NotImplementedError(f"the {self.name} backend has no runtime binding")

    def _make_context_current(self) -> None:  # noqa: B027 - a hook; only the CUDA driver API needs it
        """Before a call that needs a current context (RuntimeCall.needs_context): nothing, unless the
        vendor's runtime needs one made current first."""

    def _constant(self, path: str) -> Any:
        value = self._binding()
        for attribute in path.split("."):
            value = getattr(value, attribute)
        return value

    def _runtime_call(self, what: str, *args: Any) -> Any:
        call = self.RUNTIME_CALLS.get(what)
        if call is None:
            raise NotImplementedError(f"the {self.name} backend has no runtime call for {what}")
        if call.needs_context:
            self._make_context_current()
        function = getattr(self._binding(), call.function)
        constants = tuple(self._constant(c) if isinstance(c, str) else c for c in call.constants)
        return self._check(call.function, function(*args, *constants))

    def malloc_async(self, nbytes: int, stream: int) -> int:
        return int(self._runtime_call("malloc_async", nbytes, stream)) if nbytes else 0

    def free_async(self, ptr: int, stream: int) -> None:
        if ptr:
            self._runtime_call("free_async", ptr, stream)

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of the current device: leak tests compare ``free`` before and after."""
        free, total = self._runtime_call("mem_get_info")
        return int(free), int(total)

    def host_alloc(self, nbytes: int) -> int:
        """Pinned (page-locked) host memory, portable across devices."""
        return int(self._runtime_call("host_alloc", max(nbytes, 1)))

    def host_free(self, ptr: int) -> None:
        if ptr:
            self._runtime_call("host_free", ptr)

    def stream_create(self) -> int:
        """A stream that does not synchronise with the legacy default stream."""
        return int(self._runtime_call("stream_create"))

    def stream_destroy(self, stream: int) -> None:
        self._runtime_call("stream_destroy", stream)

    def stream_synchronize(self, stream: int) -> None:
        """Blocks the host (releasing the GIL). Never called on a launch path; for tests and tools."""
        self._runtime_call("stream_synchronize", stream)

    def stream_is_capturing(self, stream: int) -> bool:
        status = self._runtime_call("stream_is_capturing", stream)
        # Active and invalidated both mean a capture is still open on the stream.
        return int(status) != int(self._constant(self.CAPTURE_NONE))

    def stream_wait_event(self, stream: int, event: int) -> None:
        """Make later work on ``stream`` wait for ``event`` (recorded elsewhere); the host does not wait."""
        self._runtime_call("stream_wait_event", stream, event)

    def event_create(self, timing: bool = False) -> int:
        # Timing costs a timestamp per record; events used for ordering do without.
        return int(self._runtime_call("event_create_timing" if timing else "event_create"))

    def event_destroy(self, event: int) -> None:
        self._runtime_call("event_destroy", event)

    def event_synchronize(self, event: int) -> None:
        self._runtime_call("event_synchronize", event)

    def event_elapsed_ms(self, start: int, end: int) -> float:
        return float(self._runtime_call("event_elapsed_ms", start, end))
