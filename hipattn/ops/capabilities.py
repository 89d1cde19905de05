"""What a device's tensor cores offer the launchers, asked once per device."""

from __future__ import annotations

import functools

from ..backends import get_backend
from ..families import runs_amd_mfma, runs_nvidia_mma


@functools.cache
def has_nvidia_mma(device: int) -> bool:
    """Whether ``device`` runs the mma.sync m16n8k16 kernels (NVIDIA sm_80 and newer).

    Cached per device: callers that swap the backend (tests) call ``has_nvidia_mma.cache_clear()``.
    """
    return runs_nvidia_mma(get_backend().device_target(device))


@functools.cache
def has_amd_mfma(device: int) -> bool:
    """Whether ``device`` runs the MFMA 16x16x16 kernels (AMD gfx90a and gfx94x). Cached as above."""
    return runs_amd_mfma(get_backend().device_target(device))
