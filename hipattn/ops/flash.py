"""Launch the general attention forward (FlashAttention on tensor cores): on NVIDIA sm_90a (H100, H200)
the warp-specialised wgmma kernel, whose producer copies through tensor maps (ops.tensor_map_fields),
or the FA2-class wgmma kernel where the arrays have no maps or the head_dim no warp-specialised row;
mma.sync on other NVIDIA sm_80+ parts, MFMA on AMD gfx90a/gfx94x/gfx950. Every call the
small-seq path cannot take comes here (hipattn.dispatch).

The caller has validated the problem (problem.describe), made the device current and resolved the
stream; everything here is enqueued on that stream, nothing synchronizes, and the grid is sized from
host-known facts only (batch, heads, max_seqlen_q, the layout and mask, the device's SM count), so a
call can be captured into a graph.
"""

from __future__ import annotations

import functools

from .. import dropout, runtime
from ..catalog import flash_forward
from ..catalog.common import FLASH_HEAD_DIMS
from ..catalog.flash_forward import FlashForwardTiles
from ..catalog.targets import check_grid, runs_amd_mfma, runs_nvidia_mma
from ..jit.spec import KernelSpec
from ..problem import BSHD, Problem
from .fields import forward_fields
from .persistent import persistent_blocks
from .tensor_map_fields import maps_or_fallback


def ineligibility(problem: Problem, direction: str) -> str | None:
    """Why the flash ``direction`` ("forward" or "backward") cannot take ``problem`` on its device, or
    None when it can."""
    if problem.head_dim not in FLASH_HEAD_DIMS:
        return f"head_dim {problem.head_dim} is not one of {FLASH_HEAD_DIMS}"
    target = runtime.active().target(problem.device)
    if not (runs_nvidia_mma(target) or runs_amd_mfma(target)):
        return f"the flash {direction} needs NVIDIA sm_80+ or AMD gfx90a/gfx94x/gfx950; device {problem.device} is {target.arch}"
    return None


# A row's spec and shared memory per (dtype, head_dim), worked out once: a launch pays a dict hit.
@functools.cache
def _launch_of(tiles: FlashForwardTiles, dtype: str, head_dim: int, score_mods: bool) -> tuple[KernelSpec, int]:
    return tiles.spec(dtype, head_dim, score_mods=score_mods), tiles.shared_bytes(head_dim)


def grid_blocks(problem: Problem, block_m: int) -> int:
    """Query tiles of ``block_m`` rows for max_seqlen_q, times batch, times query heads: the work
    items, and grid.x where a block takes one."""
    return -(-problem.max_seqlen_q // block_m) * problem.batch * problem.heads_q


# How a persistent grid's blocks take a call's work items (ops.flash.forward_grid).
ONE_ITEM_PER_BLOCK, EQUAL_ITEMS, PAIRED_TILES = "one item per block", "equal items", "paired tiles"


def item_schedule(problem: Problem, seqused_q, seqused_k) -> str:
    """How blocks that walk work items should take ``problem``'s: in a batch of equal sequences (no
    cu_seqlens, no seqused) without a causal mask or window every item costs the same (EQUAL_ITEMS);
    with one, a query tile's cost grows along the sequence, and a pair of tiles from both ends costs
    the same as any other pair (PAIRED_TILES). Where sequences differ (varlen, seqused) no fixed
    stride balances them, and the hardware's scheduling of a block per item is kept."""
    if problem.layout != BSHD or seqused_q is not None or seqused_k is not None:
        return ONE_ITEM_PER_BLOCK
    if problem.window_left < 0 and problem.window_right < 0:
        return EQUAL_ITEMS
    return PAIRED_TILES


def forward_grid(problem: Problem, tiles: FlashForwardTiles, schedule: str, compute_units: int) -> tuple[int, bool]:
    """(grid.x, whether the blocks take query tiles in pairs) for ``tiles``' kernel: a block per work
    item, or, for a kernel whose blocks walk items (``walks_items``) under a ``schedule``
    (item_schedule) that balances them, persistent blocks over the device's ``compute_units`` (one
    block each: the kernel's tiles fill an SM), walking single items or pairs of query tiles."""
    items = grid_blocks(problem, tiles.block_m)
    if schedule == ONE_ITEM_PER_BLOCK or not tiles.walks_items:
        return items, False
    if schedule == EQUAL_ITEMS:
        return persistent_blocks(items, compute_units), False
    query_tiles = -(-problem.max_seqlen_q // tiles.block_m)
    pairs = -(-query_tiles // 2) * problem.batch * problem.heads_q
    return persistent_blocks(pairs, compute_units), True


def forward(problem: Problem, q, k, v, out, lse, stream: int, *, cu_seqlens_q=None, cu_seqlens_k=None,
            seqused_q=None, seqused_k=None, alibi_slopes=None, dropout_seed=None, learnable_sink=None,
            tiles: FlashForwardTiles | None = None, blocks: int | None = None) -> None:
    """Enqueue O and LSE: a work item per (query tile, sequence, query head), a block per item or, on the
    warp-specialised kernel where a fixed stride balances them, persistent blocks that walk them
    (forward_grid).

    Rows beyond a sequence's length are not written (as flash-attn). A row that sees no key gets
    O = 0 and LSE = +inf. ``dropout_seed``: the seed array of a call with dropout (hipattn.dropout);
    ``learnable_sink``: fp32 [Hq] sink logits, or None.
    ``tiles`` overrides the table row for head_dim, and with it the kernel
    (tools/bench_flash.py sweeps tiles this way, and times mma.sync against wgmma on one device);
    the default is the row the device's target runs (catalog.flash_forward.tiles_for). ``blocks``
    overrides the grid of a kernel whose blocks walk items (tests run few blocks over many items),
    which then take query tiles in pairs where item_schedule says so.
    """
    reason = ineligibility(problem, "forward")
    if reason is not None:
        raise ValueError(f"flash forward: {reason}")
    active = runtime.active()
    target = active.target(problem.device)
    chosen = tiles is None
    if chosen:
        tiles = flash_forward.tiles_for(problem.head_dim, target, score_mods=problem.score_mods)
    if grid_blocks(problem, tiles.block_m) == 0:
        return  # batch 0 or max_seqlen_q 0: nothing to write
    tiles, map_fields = maps_or_fallback(
        active, problem.layout, {"q": q, "k": k, "v": v}, tiles, chosen, "flash forward",
        lambda: flash_forward.tiles_for(problem.head_dim, target, tensor_maps=False))
    threads = tiles.threads
    check_grid(target, grid_blocks(problem, tiles.block_m), threads, "query tiles x sequences x heads")
    schedule = item_schedule(problem, seqused_q, seqused_k)
    if blocks is None:
        blocks, paired = forward_grid(problem, tiles, schedule, active.compute_units(problem.device))
    elif not tiles.walks_items or blocks < 1:
        raise ValueError(f"flash forward: blocks={blocks} needs a kernel whose blocks walk work items and at "
                         f"least one block; {type(tiles).__name__} takes one item per block")
    else:
        paired = schedule == PAIRED_TILES
    spec, shared = _launch_of(tiles, problem.dtype, problem.head_dim, problem.score_mods)
    kernel = active.kernel(spec, problem.device)
    kernel.reserve_dynamic_shared_memory(shared)
    fields = forward_fields(problem, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                            alibi_slopes, learnable_sink)
    fields["heads_q"] = problem.heads_q
    fields["pair_query_tiles"] = int(paired)
    fields.update(dropout.fields(problem.dropout_p, dropout_seed))
    fields.update(map_fields)
    kernel.launch((blocks, 1, 1), (threads, 1, 1), shared, stream, kernel.params.from_dict(fields))
