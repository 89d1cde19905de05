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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from .. import env
from ..errors import CompileError
from ..target import Target


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


def binding_outputs(call: str, returned: tuple, error: Callable[[str, Any], Exception]) -> Any:
    """The one error path of both bindings: a call returns ``(result, *outputs)``; a non-zero result
    raises ``error(call, result)``, else the outputs come back (None, one value, or a tuple)."""
    if returned[0]:
        raise error(call, returned[0])
    if len(returned) == 1:
        return None
    return returned[1] if len(returned) == 2 else returned[1:]


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

    @abstractmethod
    def compile(
        self,
        source: str,
        headers: dict[str, str],
        name_expression: str,
        target: Target,
        options: tuple[str, ...],
        spec_text: str,
    ) -> CompiledKernel:
        """Compile one template instantiation; raises CompileError(spec_text, target, options, log)."""

    def can_compile_for(self, target: Target) -> bool:
        """False where the compiler is known not to handle ``target`` (an old hiprtc aborts on new gfx)."""
        return target.vendor == self.vendor

    # ---- devices ------------------------------------------------------------------------------
    @abstractmethod
    def device_count(self) -> int: ...

    @abstractmethod
    def device_target(self, device: int) -> Target: ...

    @abstractmethod
    def device_name(self, device: int) -> str: ...

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

    @abstractmethod
    def launch(
        self,
        function: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_bytes: int,
        stream: int,
        params: ctypes.Structure,
    ) -> None:
        """Enqueue ``function<<<grid, block, shared_bytes, stream>>>(params)``; ``params`` passed by value."""

    # ---- memory (all stream-ordered; pointers are ints) -----------------------------------------
    @abstractmethod
    def memset_async(self, ptr: int, byte_value: int, nbytes: int, stream: int) -> None: ...

    @abstractmethod
    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Any direction (unified addressing): device<->device, device<->pinned host."""

    @abstractmethod
    def malloc_async(self, nbytes: int, stream: int) -> int: ...

    @abstractmethod
    def free_async(self, ptr: int, stream: int) -> None: ...

    @abstractmethod
    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of the current device: leak tests compare ``free`` before and after."""

    @abstractmethod
    def host_alloc(self, nbytes: int) -> int:
        """Pinned (page-locked) host memory, portable across devices."""

    @abstractmethod
    def host_free(self, ptr: int) -> None: ...

    @abstractmethod
    def launch_host_func(self, stream: int, function_address: int, user_data: int) -> None:
        """Enqueue a host function; ``function_address`` is the int address of a C-callable ``void(void*)``."""

    # ---- streams and events --------------------------------------------------------------------
    @abstractmethod
    def stream_create(self) -> int: ...

    @abstractmethod
    def stream_destroy(self, stream: int) -> None: ...

    @abstractmethod
    def stream_synchronize(self, stream: int) -> None:
        """Blocks the host (releasing the GIL). Never called on a launch path; for tests and tools."""

    @abstractmethod
    def stream_is_capturing(self, stream: int) -> bool: ...

    @abstractmethod
    def stream_wait_event(self, stream: int, event: int) -> None:
        """Make later work on ``stream`` wait for ``event`` (recorded elsewhere); the host does not wait."""

    @abstractmethod
    def event_create(self, timing: bool = False) -> int: ...

    @abstractmethod
    def event_destroy(self, event: int) -> None: ...

    @abstractmethod
    def event_record(self, event: int, stream: int) -> None: ...

    @abstractmethod
    def event_query(self, event: int) -> bool:
        """True once all work captured by the event has completed; never blocks."""

    @abstractmethod
    def event_synchronize(self, event: int) -> None: ...

    @abstractmethod
    def event_elapsed_ms(self, start: int, end: int) -> float: ...
