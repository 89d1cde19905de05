"""The one runtime seam: the backend and the kernel registry that every launch goes through.

Launch code never looks a backend or a registry up on its own: it asks ``active()`` for the process's
``Runtime`` and uses its ``backend`` (device guard, streams, memory), ``kernel(spec, device)`` (a
loaded function) and ``target(device)`` (what the device's GPU runs, asked once per device). Tests
and tools that stand a fake or emulated GPU in for the real one install their ``Runtime`` with
``installed(...)`` in one place, so a module that launches cannot slip past them (as Triton's
``driver.active`` serves its whole runtime).

The default runtime picks its backend lazily (``HIPATTN_BACKEND``, else the first vendor runtime
that sees a device: ``backends.get_backend``) and its registry over the default cache directory, so
``import hipattn`` touches no GPU.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from .backends.base import Backend
from .backends.tensor_maps import TensorMapCache
from .jit.cache import DiskCache
from .jit.registry import LoadedKernel, Registry
from .jit.spec import KernelSpec
from .jit.target import Target


class Runtime:
    """A backend, the registry of kernels loaded through it, and its devices' targets."""

    __slots__ = ("_backend", "_cache", "_registry", "_targets", "_compute_units", "_lock", "launch_plans",
                 "tensor_maps")

    def __init__(self, backend: Backend | None = None, cache: DiskCache | None = None,
                 registry: Registry | None = None):
        """Everything left out is made on first use: the default backend, the default cache, and a
        registry over the two."""
        self._backend = backend
        self._cache = cache
        self._registry = registry
        self._targets: dict[int, Target] = {}
        self._compute_units: dict[int, int] = {}
        self._lock = threading.Lock()
        # Validated launches by call signature (launch_plans), over this runtime's kernels.
        self.launch_plans: dict = {}
        # The tensor maps its kernels were handed, by address and layout (backends.tensor_maps).
        self.tensor_maps = TensorMapCache()

    def tensor_map(self, address: int, layout) -> object:
        """The backend's tensor map of ``layout`` (a backends.tensor_maps.TensorMapLayout) at ``address``,
        encoded once per pair."""
        return self.tensor_maps.get(self.backend, address, layout)

    @property
    def backend(self) -> Backend:
        backend = self._backend
        if backend is None:  # the registry's: the one it compiles and loads through
            backend = self._backend = self.registry.backend
        return backend

    @property
    def registry(self) -> Registry:
        if self._registry is None:
            with self._lock:
                if self._registry is None:
                    # What is left out the registry makes on first use (backends.get_backend, default_cache).
                    self._registry = Registry(self._backend, self._cache)
        return self._registry

    def kernel(self, spec: KernelSpec, device: int) -> LoadedKernel:
        """The function of ``spec`` loaded on ``device``, which the caller has made current."""
        registry = self._registry
        if registry is None:
            registry = self.registry
        return registry.get_kernel(spec, device)

    def target(self, device: int) -> Target:
        """What ``device`` runs (``sm_90a``, ``gfx942:xnack-``), asked of the backend once per device."""
        target = self._targets.get(device)
        if target is None:
            target = self.backend.device_target(device)
            self._targets[device] = target
        return target

    def compute_units(self, device: int) -> int:
        """How many blocks ``device`` runs side by side (SMs, CUs), asked of the backend once per device."""
        units = self._compute_units.get(device)
        if units is None:
            units = self._compute_units[device] = max(1, int(self.backend.compute_units(device)))
        return units


_active = Runtime()


def active() -> Runtime:
    """The runtime launches go through."""
    return _active


@contextlib.contextmanager
def installed(runtime: Runtime) -> Iterator[Runtime]:
    """Make ``runtime`` the active one for the block, then restore the previous one (tests, tools)."""
    global _active
    previous, _active = _active, runtime
    try:
        yield runtime
    finally:
        _active = previous
