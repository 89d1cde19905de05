"""Choosing a vendor backend.

Importing this package imports neither binding: each backend module imports its binding when it is
first constructed, so ``import hipattn`` works on a machine with neither installed.
"""

from __future__ import annotations

import logging
import os
import threading

from ..errors import BackendUnavailableError
from ..jit.target import AMD, NVIDIA, Target
from .base import Backend, CompiledKernel

__all__ = ["Backend", "CompiledKernel", "compiler_backend", "get_backend"]

logger = logging.getLogger("hipattn")

_NAMES = ("cuda", "hip")
_INSTALL = {
    "cuda": "pip install hipattn[nvidia]",
    "hip": "pip install hipattn[amd]",
}
_instances: dict[str, Backend] = {}
_chosen: dict[str, str] = {}  # "auto" -> the backend name the device probe picked
_lock = threading.RLock()


def _instance(name: str) -> Backend:
    """One backend object per name, constructed without touching a GPU."""
    with _lock:
        backend = _instances.get(name)
        if backend is None:
            if name == "cuda":
                from .cuda import CudaBackend

                backend = CudaBackend()
            else:
                from .hip import HipBackend

                backend = HipBackend()
            _instances[name] = backend
        return backend


def _sees_a_device(name: str) -> bool:
    """Whether the runtime loads and reports at least one device; any failure is a quiet no."""
    if name == "cuda":
        from .cuda import driver_library_present

        # Ask the dynamic loader first: calling into cuda-bindings without libcuda raises from its
        # loader, and higher layers built on it have been seen to hang on a second attempt.
        if not driver_library_present():
            logger.debug("backend probe: libcuda not found")
            return False
    try:
        count = _instance(name).device_count()
    except Exception as error:  # missing binding, missing runtime library, no driver, no device
        logger.debug("backend probe: %s unusable: %s", name, error)
        return False
    logger.debug("backend probe: %s sees %d device(s)", name, count)
    return count > 0


def get_backend(name: str | None = None) -> Backend:
    """The backend to run on: ``name`` ('cuda' or 'hip'), else ``$HIPATTN_BACKEND``, else the first of
    CUDA, HIP whose runtime loads and sees a device. Cached; raises BackendUnavailableError.
    """
    name = name or os.environ.get("HIPATTN_BACKEND", "").strip().lower() or None
    if name is not None:
        if name not in _NAMES:
            raise ValueError(f"unknown hipattn backend {name!r}; expected one of {', '.join(_NAMES)}")
        return _instance(name)
    with _lock:
        chosen = _chosen.get("auto")
        if chosen is None:
            for candidate in _NAMES:
                if _sees_a_device(candidate):
                    chosen = candidate
                    break
            else:
                raise BackendUnavailableError(
                    "hipattn found no usable GPU: neither the CUDA driver nor the HIP runtime loaded and "
                    f"reported a device. On NVIDIA: {_INSTALL['cuda']} (needs the NVIDIA driver). On AMD: "
                    f"{_INSTALL['hip']} (needs ROCm; set ROCM_PATH if it is not in /opt/rocm). "
                    "Set HIPATTN_LOG=debug to see why each was rejected."
                )
            _chosen["auto"] = chosen
    return _instance(chosen)


def compiler_backend(target: Target) -> Backend:
    """The backend that compiles for ``target``'s vendor; needs its compiler, not a GPU."""
    if target.vendor == NVIDIA:
        return _instance("cuda")
    if target.vendor == AMD:
        return _instance("hip")
    raise ValueError(f"no backend compiles for vendor {target.vendor!r} ({target})")
