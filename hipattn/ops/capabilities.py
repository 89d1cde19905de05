"""What a device's tensor cores offer the launchers, asked once per device."""

from __future__ import annotations

import functools

from ..backends import get_backend
from ..families import (
    FlashBackwardDkdvRow,
    FlashBackwardDqRow,
    FlashForwardRow,
    flash_backward_tiles,
    flash_forward_tiles,
    runs_amd_mfma,
    runs_nvidia_mma,
)


@functools.cache
def has_nvidia_mma(device: int) -> bool:
    """Whether ``device`` runs the mma.sync m16n8k16 kernels (NVIDIA sm_80 and newer).

    Cached per device: callers that swap the backend (tests) call ``forget_devices()``.
    """
    return runs_nvidia_mma(get_backend().device_target(device))


@functools.cache
def has_amd_mfma(device: int) -> bool:
    """Whether ``device`` runs the MFMA 16x16x16 kernels (AMD gfx90a and gfx94x). Cached as above."""
    return runs_amd_mfma(get_backend().device_target(device))


@functools.cache
def forward_tiles(device: int, head_dim: int) -> FlashForwardRow:
    """The flash forward's table row for ``head_dim`` on ``device`` (families.flash_forward_tiles: wgmma's
    on sm_90a, MFMA's on AMD, mma.sync's elsewhere). Cached as above."""
    return flash_forward_tiles(head_dim, get_backend().device_target(device))


@functools.cache
def backward_tiles(device: int, head_dim: int) -> tuple[FlashBackwardDkdvRow, FlashBackwardDqRow]:
    """The flash backward's (dK/dV, dQ) tiles for ``head_dim`` on ``device`` (families.flash_backward_tiles:
    Hopper's larger rows on sm_90, the wgmma dK/dV kernel's on sm_90a). Cached as above."""
    return flash_backward_tiles(head_dim, get_backend().device_target(device))


def forget_devices() -> None:
    """Drop every answer cached above (a test that swaps the backend has new devices)."""
    for cached in (has_nvidia_mma, has_amd_mfma, forward_tiles, backward_tiles):
        cached.cache_clear()
