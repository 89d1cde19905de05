"""Launch a KV-cache call's kernels: the append (new K/V into the cache, rotary on K and Q), the
split-KV attention, and the combine of its splits (hipattn.catalog.decode).

The caller has validated the call (kvcache_problem.describe), made the device current, resolved the
stream and laid out the workspace; everything here is enqueued on that stream, nothing synchronizes,
and every grid is sized from host-known facts, so a call can be captured into a graph and replayed
with new cache_seqlens and block tables.
"""

from __future__ import annotations

from .. import runtime
from ..catalog import decode
from ..catalog.decode import MAX_SPLITS
from ..catalog.targets import check_grid
from ..device_array import DeviceArray
from ..kvcache_problem import KvCacheCall, KvCacheProblem
from ..problem import BSHD
from .fields import kernel_window_side, put_absent_tensor, put_tensor, score_mod_fields
from .persistent import persistent_blocks
from .tensor_map_fields import has_tensor_maps, tensor_map_fields

# The split heuristic (choose_splits) gives no split fewer keys than this: below it, a block's pipeline
# start and the partials' writes and combine cost more than the parallelism gains ...
MIN_KEYS_PER_SPLIT = 1024
# ... takes no splits when the blocks without them fill this share of the device's slots ...
FILLED = 0.8
# ... and otherwise the fewest splits whose last wave is this full, relative to the best count's. Decode
# is bound by reading K and V, and an SM left without a block is its share of the read lost: at batch 1
# and 32k keys (8 KV heads, one copy-engine block an SM at head_dim 128) FlashAttention-2's 0.85 chose
# 14 splits, 112 blocks on 132 SMs, where 16 (128 blocks) read faster on the H100 and the H200.
WAVE_EFFICIENCY = 0.95
# grid.y and grid.z are 16-bit on NVIDIA.
MAX_GRID_YZ = 65535
# The L2 promotion of the copy-engine kernel's cache maps (TensorMapLayout.l2_promotion): none. Decode
# reads every byte of K and V once; with 256-byte promotion ncu counted 1.25x their sectors requested
# from L2 (the extra quarter all hits) against 1.00x without, which is what cuDNN's kernel requests.
CACHE_L2_PROMOTION = 0


def row_chunks(problem: KvCacheProblem, tiles: decode.AttentionTiles) -> int:
    """Blocks per (sequence, KV head, split) along the query rows: grid.z."""
    return -(-problem.rows_per_kv_head // tiles.rows)


def choose_splits(problem: KvCacheProblem, tiles: decode.AttentionTiles, slots: int) -> int:
    """Splits of the KV length: ``num_splits`` when the caller chose, else from host facts (batch,
    KV heads, query rows, the keys the rows can see) and the device's ``slots`` (blocks it runs at once:
    compute units x blocks per unit). Every split of a sequence does equal work, so the grid runs in
    waves of ``slots`` blocks: the count is the fewest splits whose last wave is nearly as full as
    the best count's (FlashAttention-2's rule, with WAVE_EFFICIENCY tighter than its 85%), each split
    keeping MIN_KEYS_PER_SPLIT keys."""
    if problem.num_splits:
        return problem.num_splits
    blocks = problem.batch * problem.heads_kv * row_chunks(problem, tiles)
    if blocks == 0 or blocks >= FILLED * slots:
        return 1
    most = max(1, min(MAX_SPLITS, problem.keys_bound // MIN_KEYS_PER_SPLIT))
    efficiency = []
    for splits in range(1, most + 1):
        waves = blocks * splits / slots
        efficiency.append(waves / -(-waves // 1))
    best = max(efficiency)
    return next(s for s, e in enumerate(efficiency, start=1) if e >= WAVE_EFFICIENCY * best)


def _tensor(fields: dict, name: str, a: DeviceArray | None) -> None:
    """A [batch, token, head, dim] array's fields (ops.fields), or a null one where the call has none."""
    if a is None:
        put_absent_tensor(fields, name)
    else:
        put_tensor(fields, name, a, BSHD)


def _cache_fields(call: KvCacheCall) -> dict:
    p = call.problem
    table = call.block_table
    return {
        "cache_seqlens": call.cache_seqlens.ptr if call.cache_seqlens is not None else 0,
        "cache_batch_idx": call.cache_batch_idx.ptr if call.cache_batch_idx is not None else 0,
        "block_table": table.ptr if table is not None else 0,
        "block_table_batch_stride": table.strides[0] if table is not None else 0,
        "cache_seqlen": p.cache_seqlen or 0,
        "page_size": p.page_size,
        "pages_per_sequence": p.pages_per_sequence,
        "cache_entries": p.cache_entries,
        "cache_capacity": p.capacity,
        "batch": p.batch,
        "heads_q": p.heads_q,
        "heads_kv": p.heads_kv,
        "seqlen_q": p.seqlen_q,
        "seqlen_new": p.seqlen_new,
    }


def append(call: KvCacheCall, q_rotated: DeviceArray | None, stream: int) -> None:
    """Enqueue the append of k/v at cache_seqlens (rotated k when rotary is on) and, with rotary, the
    rotated queries into ``q_rotated``. Nothing to do without new tokens."""
    p = call.problem
    pairs = p.head_dim // 2
    kv_pairs = p.batch * p.seqlen_new * p.heads_kv * pairs
    q_pairs = p.batch * p.seqlen_q * p.heads_q * pairs if q_rotated is not None else 0
    blocks = -(-(kv_pairs + q_pairs) // decode.APPEND_PAIRS_PER_BLOCK)
    if blocks == 0:
        return
    active = runtime.active()
    check_grid(active.target(p.device), blocks, decode.DECODE_BLOCK_THREADS, "pairs of appended and rotated elements")
    kernel = active.kernel(decode.DECODE_APPEND.spec(dtype=p.dtype), p.device)
    fields = _cache_fields(call)
    for name, a in (("k_new", call.k), ("v_new", call.v), ("k", call.k_cache), ("v", call.v_cache), ("q", call.q),
                    ("q_rotated", q_rotated)):
        _tensor(fields, name, a)
    cos = call.rotary_cos
    fields.update(rotary_cos=cos.ptr if cos is not None else 0,
                  rotary_sin=call.rotary_sin.ptr if cos is not None else 0,
                  rotary_stride=cos.strides[0] if cos is not None else 0, rotary_dim=p.rotary_dim,
                  rotary_positions=p.rotary_positions, rotary_interleaved=int(p.rotary_interleaved),
                  rotate_q=int(q_rotated is not None), q_positions_advance=int(p.causal or p.windowed),
                  head_dim=p.head_dim)
    kernel.launch((blocks, 1, 1), (decode.DECODE_BLOCK_THREADS, 1, 1), 0, stream, kernel.params.from_dict(fields))


def attention_tiles(problem: KvCacheProblem, tensor_maps: bool = True) -> decode.AttentionTiles:
    """The attention kernel's row for the call's device (catalog.decode.tiles_for), with or without
    tensor maps of the cache."""
    target = runtime.active().target(problem.device)
    return decode.tiles_for(target, problem.head_dim, problem.rows_per_kv_head, tensor_maps)


def _cache_maps(call: KvCacheCall, tiles: decode.AttentionTiles) -> dict[str, DeviceArray]:
    """The caches a row's tensor maps describe (by its kernel's field names)."""
    return {name: a for name, a in (("k", call.k_cache), ("v", call.v_cache)) if name in tiles.tensor_map_rows()}


def cache_has_tensor_maps(call: KvCacheCall) -> bool:
    """Whether the copy-engine kernel can read the call's cache: maps describe both caches
    (ops.tensor_map_fields), and a paged cache's pages hold whole 64-key tiles, so that no box
    crosses a page."""
    p = call.problem
    if call.block_table is not None and p.page_size % decode.MMA_TILE_KEYS:
        return False
    rows = {"k": decode.MMA_TILE_KEYS, "v": decode.MMA_TILE_KEYS}
    return has_tensor_maps({"k": call.k_cache, "v": call.v_cache}, BSHD, rows)


def device_slots(problem: KvCacheProblem, tiles: decode.AttentionTiles) -> int:
    """Blocks of ``tiles`` the call's device runs at once."""
    active = runtime.active()
    return active.compute_units(problem.device) * tiles.blocks_per_unit(active.target(problem.device), problem.head_dim)


def attention_plan(call: KvCacheCall) -> tuple[decode.AttentionTiles, int]:
    """The attention row the call runs and its split count (attention_tiles, choose_splits)."""
    tiles = attention_tiles(call.problem, cache_has_tensor_maps(call))
    return tiles, choose_splits(call.problem, tiles, device_slots(call.problem, tiles))


def attend(call: KvCacheCall, q: DeviceArray, out: DeviceArray, lse: DeviceArray | None, splits: int,
           o_partial: DeviceArray | None, lse_partial: DeviceArray | None, stream: int,
           tiles: decode.AttentionTiles) -> None:
    """Enqueue the attention of ``q`` (the call's queries, rotated or not) against the cache with
    ``tiles`` (attention_tiles, or another row: tools/bench_decode.py sweeps them), and with more than
    one split the combine; ``out`` and ``lse`` (optional) get the result."""
    p = call.problem
    active = runtime.active()
    target = active.target(p.device)
    chunks = row_chunks(p, tiles)
    blocks = p.batch * p.heads_kv
    if blocks == 0 or chunks == 0:
        return
    if chunks > MAX_GRID_YZ:
        raise ValueError(f"the call has {p.rows_per_kv_head} query rows per KV head (seqlen_q x query heads per "
                         f"KV head); at most {MAX_GRID_YZ * tiles.rows} fit one launch")
    maps = {}
    if tiles.tensor_map_rows():
        maps = tensor_map_fields(active, BSHD, _cache_maps(call, tiles), tiles.tensor_map_rows(), CACHE_L2_PROMOTION)
        if maps is None:  # the driver refused an encoding: the threads copy instead, with the same splits
            tiles, maps = attention_tiles(p, tensor_maps=False), {}
    check_grid(target, blocks, tiles.threads, "sequences x KV heads")
    kernel = active.kernel(tiles.spec(p.dtype, p.head_dim, score_mods=p.score_mods), p.device)
    shared = tiles.shared_bytes(p.head_dim)
    if shared:
        kernel.reserve_dynamic_shared_memory(shared)
    sink = call.learnable_sink.ptr if call.learnable_sink is not None else 0
    fields = {**_cache_fields(call), **score_mod_fields(p.softcap, call.alibi_slopes), "learnable_sink": sink, **maps}
    for name, a in (("q", q), ("k", call.k_cache), ("v", call.v_cache), ("o", out)):
        _tensor(fields, name, a)
    lse_batch, lse_head = lse.strides[:2] if lse is not None else (0, 0)  # [B, Hq, S_q], tokens contiguous
    fields.update(lse=lse.ptr if lse is not None else 0, lse_batch_stride=lse_batch, lse_head_stride=lse_head,
                  o_partial=o_partial.ptr if o_partial is not None else 0,
                  lse_partial=lse_partial.ptr if lse_partial is not None else 0,
                  cache_leftpad=call.cache_leftpad.ptr if call.cache_leftpad is not None else 0,
                  splits=splits, softmax_scale=p.softmax_scale,
                  window_left=kernel_window_side(p.window_left, p.capacity),
                  window_right=kernel_window_side(p.window_right, p.seqlen_q))
    # A persistent grid: each block walks items blockIdx.x, + gridDim.x, ... of the blocks x splits x
    # chunks (decode/forward_tma.hip).
    grid = (persistent_blocks(blocks * splits * chunks, device_slots(p, tiles)), 1, 1) if tiles.persistent else (
        blocks, splits, chunks)
    kernel.launch(grid, (tiles.threads, 1, 1), shared, stream, kernel.params.from_dict(fields))
    if splits == 1:
        return
    combine_blocks = p.batch * p.heads_q * p.seqlen_q  # one per query row
    check_grid(target, combine_blocks, decode.DECODE_BLOCK_THREADS, "query rows")
    combine = active.kernel(decode.combine_spec(p.dtype), p.device)
    merged = {"lse": fields["lse"], "lse_batch_stride": lse_batch, "lse_head_stride": lse_head,
              "o_partial": o_partial.ptr, "lse_partial": lse_partial.ptr, "batch": p.batch, "heads_q": p.heads_q,
              "seqlen_q": p.seqlen_q, "head_dim": p.head_dim, "splits": splits, "learnable_sink": sink}
    _tensor(merged, "o", out)
    combine.launch((combine_blocks, 1, 1), (decode.DECODE_BLOCK_THREADS, 1, 1), 0, stream,
                   combine.params.from_dict(merged))
