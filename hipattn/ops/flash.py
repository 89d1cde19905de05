"""Launch the general attention forward (FlashAttention-2 on NVIDIA tensor cores, sm_80+).

NOT WIRED IN: nothing in hipattn.dispatch or the public API reaches this module yet. It becomes the
path for every call the small-seq kernels cannot take once tests/gpu/test_flash_forward.py has
passed on the GPU; until then only that test and tools/bench_flash.py call it.

The caller has validated the problem (problem.describe), made the device current and resolved the
stream; everything here is enqueued on that stream, nothing synchronizes, and the grid is sized from
host-known facts only (batch, heads and max_seqlen_q), so a call can be captured into a graph.
"""

from __future__ import annotations

import functools

from ..backends import get_backend
from ..families import FLASH_FORWARD_TILES, FLASH_HEAD_DIMS, flash_forward_shared_bytes, flash_forward_spec
from ..problem import Problem
from ..registry import get_kernel
from ..spec import KernelSpec
from .capabilities import has_nvidia_mma
from .fields import forward_fields

# grid.x is at most 2^31 - 1 blocks on every sm_80+ part.
MAX_GRID_X = 2**31 - 1


def ineligibility(problem: Problem) -> str | None:
    """Why the flash forward cannot take ``problem`` on its device, or None when it can."""
    if problem.head_dim not in FLASH_HEAD_DIMS:
        return f"head_dim {problem.head_dim} is not one of {FLASH_HEAD_DIMS}"
    if not has_nvidia_mma(problem.device):
        arch = get_backend().device_target(problem.device).arch
        return f"the flash forward needs NVIDIA sm_80 or newer; device {problem.device} is {arch}"
    return None


@functools.cache
def _spec(dtype: str, head_dim: int) -> KernelSpec:
    return flash_forward_spec(dtype, head_dim)


def grid_blocks(problem: Problem) -> int:
    """Query tiles for max_seqlen_q, times batch, times query heads: the kernel's grid.x."""
    block_m = FLASH_FORWARD_TILES[problem.head_dim].block_m
    return -(-problem.max_seqlen_q // block_m) * problem.batch * problem.heads_q


def forward(problem: Problem, q, k, v, out, lse, stream: int, *, cu_seqlens_q=None, cu_seqlens_k=None,
            seqused_q=None, seqused_k=None) -> None:
    """Enqueue O and LSE: one block per (query tile, sequence, query head).

    Rows beyond a sequence's length are not written (as flash-attn). A row that sees no key gets
    O = 0 and LSE = +inf.
    """
    reason = ineligibility(problem)
    if reason is not None:
        raise ValueError(f"flash forward: {reason}")
    blocks = grid_blocks(problem)
    if blocks == 0:
        return  # batch 0 or max_seqlen_q 0: nothing to write
    if blocks > MAX_GRID_X:
        raise ValueError(f"{blocks} query tiles x sequences x heads exceed the grid limit of {MAX_GRID_X} blocks")
    tiles = FLASH_FORWARD_TILES[problem.head_dim]
    kernel = get_kernel(_spec(problem.dtype, problem.head_dim), problem.device)
    shared = flash_forward_shared_bytes(problem.head_dim, tiles)
    kernel.reserve_dynamic_shared_memory(shared)
    fields = forward_fields(problem, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    fields["heads_q"] = problem.heads_q
    kernel.launch((blocks, 1, 1), (tiles.threads, 1, 1), shared, stream, kernel.params.from_dict(fields))
