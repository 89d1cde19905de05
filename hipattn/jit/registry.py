"""From a kernel spec to a loaded, launchable function: in-process dict -> disk cache -> compile.

Launch code reaches a ``Registry`` through the active runtime (``hipattn.runtime``) and calls
``get_kernel(spec, device)`` with ``device`` already current on the calling thread. A hit is one
dict lookup. A miss compiles (or reads the disk cache) for the device's target, loads the module on
the current device and remembers the result; concurrent misses for the same (spec, device) compile
and load once.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..backends.base import Backend, CompiledKernel
from ..errors import HipattnError
from . import sources
from .cache import DiskCache, cache_key, default_cache
from .cache_safety import printable
from .params import ParamsStruct
from .spec import KernelSpec
from .target import Target

logger = logging.getLogger("hipattn")


# Per thread: the list that launches are appended to while ``recording_launches`` is active.
_recording = threading.local()


@contextlib.contextmanager
def recording_launches() -> Iterator[list]:
    """Collect ``(kernel, grid, block, shared_bytes, params)`` of every launch this thread makes in
    the block (launch_plans records what a validated call launched this way)."""
    previous = getattr(_recording, "launches", None)
    launches = _recording.launches = []
    try:
        yield launches
    finally:
        _recording.launches = previous


class LoadedKernel:
    """One kernel function loaded on one device, with the struct its single argument is built from."""

    __slots__ = (
        "function",
        "params",
        "spec",
        "device",
        "target",
        "lowered_name",
        "_backend",
        "_launch",
        "_max_shared",
    )

    def __init__(
        self,
        backend: Backend,
        function: Any,
        params: ParamsStruct,
        spec: KernelSpec,
        device: int,
        target: Target,
        lowered_name: str,
    ):
        self.function = function
        self.params = params
        self.spec = spec
        self.device = device
        self.target = target
        self.lowered_name = lowered_name
        self._backend = backend
        # Bound once, so a launch is a plain call with nothing looked up on the way.
        self._launch = backend.launch
        self._max_shared = 0

    def launch(
        self,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_bytes: int,
        stream: int,
        params: ctypes.Structure,
    ) -> None:
        """Enqueue the kernel on ``stream`` (the device must be current); ``params`` from ``self.params.new``."""
        self._launch(self.function, grid, block, shared_bytes, stream, params)
        launches = getattr(_recording, "launches", None)
        if launches is not None:
            launches.append((self, grid, block, shared_bytes, params))

    def reserve_dynamic_shared_memory(self, nbytes: int) -> None:
        """Allow launches with up to ``nbytes`` of dynamic shared memory; a no-op once already allowed.

        Two threads racing here may both call the backend; that is harmless (the attribute is
        idempotent), so no lock is paid on the launch path.
        """
        if nbytes > self._max_shared:
            self._backend.set_max_dynamic_shared_memory(self.function, nbytes)
            self._max_shared = nbytes

    def __repr__(self) -> str:
        return f"LoadedKernel({self.spec} on device {self.device}, {self.target.arch})"


@dataclass(frozen=True)
class CompileInputs:
    """Everything that goes into one compile, and the cache key naming its binary."""

    key: str
    source: str
    headers: dict[str, str]
    name_expression: str
    options: tuple[str, ...]
    compiler_identity: str


def compile_inputs(spec: KernelSpec, target: Target, backend: Backend) -> CompileInputs:
    """The compile unit, name expression, options and cache key of ``spec`` for ``target``."""
    source, headers = sources.compile_unit(spec.family)
    expression = spec.name_expression()
    options = tuple(backend.compile_options(target))
    identity = backend.compiler_identity()
    key = cache_key(
        source=source,
        headers=headers,
        name_expression=expression,
        spec_text=spec.canonical(),
        options=options,
        arch=target.arch,
        compiler_identity=identity,
    )
    return CompileInputs(key, source, headers, expression, options, identity)


def _check_compilable(spec: KernelSpec, target: Target, backend: Backend) -> None:
    if not backend.can_compile_for(target):
        raise HipattnError(
            f"cannot compile {spec} for {target.arch}: the {backend.name} backend's compiler "
            f"({backend.compiler_identity()}) does not support {target.vendor} target {target.arch}"
            + (
                " (an older hiprtc would abort the process on it; a ROCm release that knows this GPU is needed)"
                if target.vendor == backend.vendor
                else ""
            )
        )


def fetch_or_compile(
    spec: KernelSpec, target: Target, backend: Backend, cache: DiskCache, *, refresh: bool = False
) -> tuple[CompiledKernel, bool]:
    """(compiled kernel, whether it was compiled now rather than read from the cache).

    ``refresh`` discards what the cache holds for ``spec`` and compiles afresh: for an entry that
    verified but whose binary the runtime would not load.
    """
    _check_compilable(spec, target, backend)
    inputs = compile_inputs(spec, target, backend)
    if refresh:
        cache.discard(inputs.key)
    else:
        compiled = cache.get(inputs.key, arch=target.arch)
        if compiled is not None:
            logger.debug("disk cache hit %s for %s (%s)", spec, target.arch, inputs.key[:12])
            return compiled, False
    start = time.perf_counter()
    compiled = backend.compile(
        inputs.source, inputs.headers, inputs.name_expression, target, inputs.options, spec.canonical()
    )
    seconds = time.perf_counter() - start
    logger.debug("compiled %s for %s in %.3f s (%s)", spec, target.arch, seconds, inputs.key[:12])
    cache.put(
        inputs.key,
        compiled,
        {
            "spec": spec.canonical(),
            "family": spec.family.name,
            "arch": target.arch,
            "vendor": target.vendor,
            "compiler": inputs.compiler_identity,
            "options": list(inputs.options),
            "name_expression": inputs.name_expression,
            "compile_seconds": seconds,
        },
    )
    return compiled, True


def compile_spec(
    spec: KernelSpec, target: Target, backend: Backend | None = None, cache: DiskCache | None = None
) -> CompiledKernel:
    """The binary of ``spec`` for ``target``: from the disk cache, else compiled and stored. No GPU needed.

    ``backend`` defaults to the one that compiles for ``target``'s vendor; ``cache`` to the default
    cache dir. Raises HipattnError when the compiler cannot handle ``target`` (checked before
    calling it, since an old hiprtc aborts the process) and CompileError with the log on failure.
    """
    if backend is None:
        from ..backends import compiler_backend

        backend = compiler_backend(target)
    return fetch_or_compile(spec, target, backend, cache if cache is not None else default_cache())[0]


class Registry:
    """Loaded kernels per (spec, device) for one backend, backed by a disk cache.

    Build your own for tests (``Registry(FakeBackend(), DiskCache(tmp_path))``); library code uses the
    active runtime's (``hipattn.runtime.active().registry``).
    """

    def __init__(self, backend: Backend | None = None, cache: DiskCache | None = None):
        self._backend = backend
        self._cache = cache
        self._loaded: dict[tuple[KernelSpec, int], LoadedKernel] = {}
        # Binaries by (spec, arch), so a second device of the same arch skips even the disk read;
        # with whether each came from the disk cache (which a load failure then discards).
        self._compiled: dict[tuple[KernelSpec, str], tuple[CompiledKernel, bool]] = {}
        self._lock = threading.Lock()
        self._inflight: dict[tuple[KernelSpec, Any], threading.Lock] = {}
        self.compile_count = 0  # backend.compile calls made through this registry
        self.load_count = 0  # modules loaded onto a device

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            from ..backends import get_backend

            self._backend = get_backend()
        return self._backend

    @property
    def cache(self) -> DiskCache:
        if self._cache is None:
            self._cache = default_cache()
        return self._cache

    def get_kernel(self, spec: KernelSpec, device: int) -> LoadedKernel:
        """The function for ``spec`` loaded on ``device``, which the caller has already made current.

        Nothing here checks or changes the current device (that would cost a runtime call per
        launch); loading on a miss happens on whatever device is current.
        """
        try:
            return self._loaded[(spec, device)]
        except KeyError:
            return self._load(spec, device)

    def _load(self, spec: KernelSpec, device: int) -> LoadedKernel:
        slot = (spec, device)
        with self._slot_lock(slot):
            kernel = self._loaded.get(slot)
            if kernel is not None:
                return kernel
            backend = self.backend
            target = backend.device_target(device)
            compiled, from_disk = self._binary(spec, target)
            start = time.perf_counter()
            try:
                function = backend.load_function(compiled.binary, compiled.lowered_name)
            except Exception as error:
                if not from_disk:
                    raise
                # An entry can verify and still not load (written by a broken compiler, a runtime
                # that changed under it): no call may fail because of the cache, so rebuild it once.
                logger.warning(
                    "hipattn cache: the cached binary of %s for %s does not load (%s); discarding it and "
                    "compiling afresh", spec, target.arch, printable(error),
                )
                compiled = self._rebuild(spec, target)
                function = backend.load_function(compiled.binary, compiled.lowered_name)
            logger.debug(
                "loaded %s on device %d (%s) in %.3f s",
                spec,
                device,
                target.arch,
                time.perf_counter() - start,
            )
            kernel = LoadedKernel(
                backend,
                function,
                spec.family.params,
                spec,
                device,
                target,
                compiled.lowered_name,
            )
            with self._lock:
                self.load_count += 1
                self._loaded[slot] = kernel
            return kernel

    def compile_spec(self, spec: KernelSpec, target: Target) -> CompiledKernel:
        """The binary of ``spec`` for ``target`` through this registry's backend and cache."""
        return self._binary(spec, target)[0]

    def _binary(self, spec: KernelSpec, target: Target) -> tuple[CompiledKernel, bool]:
        """(binary, whether it came from the disk cache rather than this process's compiler)."""
        slot = (spec, target.arch)
        known = self._compiled.get(slot)
        if known is not None:
            return known
        with self._slot_lock(slot):
            known = self._compiled.get(slot)
            if known is not None:
                return known
            compiled, fresh = fetch_or_compile(spec, target, self.backend, self.cache)
            with self._lock:
                if fresh:
                    self.compile_count += 1
                self._compiled[slot] = known = (compiled, not fresh)
            return known

    def _rebuild(self, spec: KernelSpec, target: Target) -> CompiledKernel:
        """Discard the cached binary of ``spec`` for ``target`` and compile it afresh."""
        slot = (spec, target.arch)
        with self._slot_lock(slot):
            compiled, _ = fetch_or_compile(spec, target, self.backend, self.cache, refresh=True)
            with self._lock:
                self.compile_count += 1
                self._compiled[slot] = (compiled, False)
            return compiled

    def _slot_lock(self, slot: tuple[KernelSpec, Any]) -> threading.Lock:
        """One lock per slot, kept for the registry's life: racing threads wait for the first, while
        other specs compile in parallel. (Locks are tiny and slots are few: one per kernel used.)"""
        with self._lock:
            return self._inflight.setdefault(slot, threading.Lock())

    def loaded(self) -> list[LoadedKernel]:
        """Every kernel loaded so far (for diagnostics)."""
        with self._lock:
            return list(self._loaded.values())
