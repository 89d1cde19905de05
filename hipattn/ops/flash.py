"""Launch the general attention forward (FlashAttention-2 on tensor cores): wgmma on NVIDIA sm_90a
(H100, H200), mma.sync on other NVIDIA sm_80+ parts, MFMA on AMD gfx90a/gfx94x. Every call the
small-seq path cannot take comes here (hipattn.dispatch).

The caller has validated the problem (problem.describe), made the device current and resolved the
stream; everything here is enqueued on that stream, nothing synchronizes, and the grid is sized from
host-known facts only (batch, heads and max_seqlen_q), so a call can be captured into a graph.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from ..backends import get_backend
from ..families import (
    FLASH_HEAD_DIMS,
    FlashForwardMfmaTiles,
    FlashForwardRow,
    FlashForwardWgmmaTiles,
    flash_forward_mfma_shared_bytes,
    flash_forward_mfma_spec,
    flash_forward_shared_bytes,
    flash_forward_spec,
    flash_forward_wgmma_shared_bytes,
    flash_forward_wgmma_spec,
)
from ..problem import Problem
from ..registry import get_kernel
from ..spec import KernelSpec
from .capabilities import forward_tiles, has_amd_mfma, has_nvidia_mma
from .fields import forward_fields

# grid.x is at most 2^31 - 1 blocks on every sm_80+ part. HIP counts the grid in work-items, in 32
# bits: blocks x threads per block must stay below 2^32.
MAX_GRID_X = 2**31 - 1
MAX_AMD_WORK_ITEMS = 2**32 - 1


class _Launch(NamedTuple):
    """The device's matrix-core forward for one problem: its spec, tiles and dynamic shared bytes."""

    spec: KernelSpec
    tiles: FlashForwardRow
    shared_bytes: int


def ineligibility(problem: Problem) -> str | None:
    """Why the flash forward cannot take ``problem`` on its device, or None when it can."""
    if problem.head_dim not in FLASH_HEAD_DIMS:
        return f"head_dim {problem.head_dim} is not one of {FLASH_HEAD_DIMS}"
    if not (has_nvidia_mma(problem.device) or has_amd_mfma(problem.device)):
        arch = get_backend().device_target(problem.device).arch
        return f"the flash forward needs NVIDIA sm_80+ or AMD gfx90a/gfx94x; device {problem.device} is {arch}"
    return None


@functools.cache
def _launch_of(dtype: str, head_dim: int, tiles: FlashForwardRow) -> _Launch:
    """The kernel a tile row names: its type says which (so a sweep can time mma.sync on sm_90a too)."""
    if isinstance(tiles, FlashForwardMfmaTiles):
        return _Launch(flash_forward_mfma_spec(dtype, head_dim, tiles), tiles,
                       flash_forward_mfma_shared_bytes(head_dim, tiles))
    if isinstance(tiles, FlashForwardWgmmaTiles):
        return _Launch(flash_forward_wgmma_spec(dtype, head_dim, tiles), tiles,
                       flash_forward_wgmma_shared_bytes(head_dim, tiles))
    return _Launch(flash_forward_spec(dtype, head_dim, tiles), tiles, flash_forward_shared_bytes(head_dim, tiles))


def grid_blocks(problem: Problem, block_m: int) -> int:
    """Query tiles of ``block_m`` rows for max_seqlen_q, times batch, times query heads: grid.x."""
    return -(-problem.max_seqlen_q // block_m) * problem.batch * problem.heads_q


def forward(problem: Problem, q, k, v, out, lse, stream: int, *, cu_seqlens_q=None, cu_seqlens_k=None,
            seqused_q=None, seqused_k=None, tiles: FlashForwardRow | None = None) -> None:
    """Enqueue O and LSE: one block per (query tile, sequence, query head).

    Rows beyond a sequence's length are not written (as flash-attn). A row that sees no key gets
    O = 0 and LSE = +inf. ``tiles`` overrides the table row for head_dim, and with it the kernel
    (tools/bench_flash.py sweeps tiles this way, and times mma.sync against wgmma on one device);
    the default is the device's row (capabilities.forward_tiles).
    """
    reason = ineligibility(problem)
    if reason is not None:
        raise ValueError(f"flash forward: {reason}")
    launch = _launch_of(problem.dtype, problem.head_dim, tiles or forward_tiles(problem.device, problem.head_dim))
    threads = launch.tiles.threads
    blocks = grid_blocks(problem, launch.tiles.block_m)
    if blocks == 0:
        return  # batch 0 or max_seqlen_q 0: nothing to write
    amd = isinstance(launch.tiles, FlashForwardMfmaTiles)
    if blocks > MAX_GRID_X or (amd and blocks * threads > MAX_AMD_WORK_ITEMS):
        raise ValueError(f"{blocks} query tiles x sequences x heads exceed the device's grid limit; split the batch")
    kernel = get_kernel(launch.spec, problem.device)
    kernel.reserve_dynamic_shared_memory(launch.shared_bytes)
    fields = forward_fields(problem, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    fields["heads_q"] = problem.heads_q
    kernel.launch((blocks, 1, 1), (threads, 1, 1), launch.shared_bytes, stream, kernel.params.from_dict(fields))
