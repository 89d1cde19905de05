"""Attention against a KV cache (``flash_attn_with_kvcache``): append with rotary, the split-KV
attention kernel, and the combine of its splits.

Decoding reads K and V once and is bound by that read. On NVIDIA sm_80+ the attention runs on the
tensor cores (kernels/decode/forward_mma.hip: cp.async staging, mma.sync), one table row per
head_dim; on Hopper, where the cache has tensor maps, the same tensor-core work is fed by the copy
engine in a persistent grid (kernels/decode/forward_tma.hip); on AMD gfx90a/gfx94x/gfx950 on the
matrix cores (kernels/decode/forward_mfma.hip: operands straight from global memory, MFMA 16x16x16)
at head_dims that are multiples of 32; elsewhere the
portable kernel (kernels/decode/forward.hip: 16-byte loads per lane, dot products on the vector
units), one row per query-rows bound. Append and combine are portable."""

from __future__ import annotations

from dataclasses import dataclass

from ..jit.params import TENSOR_MAP, ParamsStruct
from ..jit.spec import KernelFamily, KernelSpec
from ..jit.target import Target
from .common import DTYPES, FLASH_ROW_PAD, MBARRIER_BYTES, wgmma_row_elements
from .fields import (
    SCORE_MOD_FIELDS,
    SCORE_MODS_PARAM,
    SCORE_MODS_VALUES,
    SINK_FIELDS,
    WINDOW_FIELDS,
    Fields,
    row_statistic,
    strided,
)
from .index import register
from .targets import (
    HOPPER_SHARED_BYTES,
    SM86_SHARED_BYTES,
    has_hopper_shared_memory,
    runs_amd_mfma,
    runs_nvidia_mma,
    runs_nvidia_wgmma,
)
from .tiles import ELEMENT_BYTES, KernelTiles

# Every head_dim a multiple of 8 up to 256 could run; these ship. 32 and 80 are flash-attn's
# kvcache test dims that the flash path lacks; 192 is DeepSeek's qk head_dim.
DECODE_HEAD_DIMS = (32, 64, 80, 96, 128, 192, 256)

# A block of the attention and combine kernels (decode::Layout::kThreads, decode_combine's bounds).
DECODE_BLOCK_THREADS = 128
# The tensor-core kernels' tile (decode/warp_keys_mma.h): 16 query rows, four warps of 16 keys.
MMA_ROWS = 16
MMA_WARPS = 4
MMA_TILE_KEYS = 64
# decode_combine: one block per query row, merging at most this many splits (one per thread).
MAX_SPLITS = DECODE_BLOCK_THREADS
# decode_append: one thread per pair of elements of a row.
APPEND_PAIRS_PER_BLOCK = DECODE_BLOCK_THREADS

# Where the cache's rows live (kernels/decode/cache.h), shared by the kernels that read and write it.
_CACHE_FIELDS: Fields = (
    ("cache_seqlens", "const_ptr"),
    ("cache_batch_idx", "const_ptr"),
    ("block_table", "const_ptr"),
    ("block_table_batch_stride", "i64"),
    ("cache_seqlen", "i32"),  # the one length of every sequence when cache_seqlens is a host int
    ("page_size", "i32"),
    ("pages_per_sequence", "i32"),
    ("cache_entries", "i32"),  # batch entries of a contiguous cache, or pages of a paged one
    ("cache_capacity", "i32"),  # tokens a sequence's cache holds
    ("batch", "i32"),
    ("heads_q", "i32"),
    ("heads_kv", "i32"),
    ("seqlen_q", "i32"),
    ("seqlen_new", "i32"),
)

DECODE_FORWARD_PARAMS = ParamsStruct(
    "DecodeForwardParams",
    strided("q") + strided("k") + strided("v") + strided("o") + row_statistic("lse", "ptr")
    + (("o_partial", "ptr"), ("lse_partial", "ptr"), ("cache_leftpad", "const_ptr")) + _CACHE_FIELDS
    + (("splits", "i32"), ("softmax_scale", "f32")) + WINDOW_FIELDS + SCORE_MOD_FIELDS + SINK_FIELDS,
)
# The copy-engine kernel's struct: the attention's fields, then the tensor maps of the K and V caches
# ([entry or page, token, head, dim], boxes of one 64-column swizzle block of a tile's rows).
DECODE_FORWARD_TMA_PARAMS = ParamsStruct.extending(
    "DecodeForwardTmaParams", DECODE_FORWARD_PARAMS, (("k_map", TENSOR_MAP), ("v_map", TENSOR_MAP)))
DECODE_COMBINE_PARAMS = ParamsStruct(
    "DecodeCombineParams",
    strided("o") + row_statistic("lse", "ptr")
    + (("o_partial", "const_ptr"), ("lse_partial", "const_ptr"), ("batch", "i32"), ("heads_q", "i32"),
       ("seqlen_q", "i32"), ("head_dim", "i32"), ("splits", "i32")) + SINK_FIELDS,
)
DECODE_APPEND_PARAMS = ParamsStruct(
    "DecodeAppendParams",
    strided("k_new") + strided("v_new") + strided("k", "ptr") + strided("v", "ptr") + strided("q")
    + strided("q_rotated", "ptr") + _CACHE_FIELDS
    + (("rotary_cos", "const_ptr"), ("rotary_sin", "const_ptr"), ("rotary_stride", "i64"), ("rotary_dim", "i32"),
       ("rotary_positions", "i32"), ("rotary_interleaved", "i32"), ("rotate_q", "i32"),
       ("q_positions_advance", "i32"), ("head_dim", "i32")),
)


@dataclass(frozen=True)
class DecodeTiles(KernelTiles):
    """A row of the portable attention kernel: query rows per block and keys per team per step. More
    rows serve a bigger query-head group per read of K/V; fewer keys per step keep 8-row blocks'
    registers within what two blocks per compute unit leave."""

    rows: int
    unroll: int

    family = property(lambda self: DECODE_FORWARD)
    threads = DECODE_BLOCK_THREADS
    persistent = False  # a block per (sequence, KV head, split, row chunk)

    def shared_bytes(self, head_dim: int, element_bytes: int = ELEMENT_BYTES) -> int:
        return 0  # its merge buffers are static shared arrays

    def blocks_per_unit(self, target: Target | None, head_dim: int) -> int:
        """Blocks a compute unit holds at once, for the split heuristic: registers bound it (about 240
        VGPRs a lane on CDNA: two 2-wave blocks per CU's SIMD pairs)."""
        return 2


# Blocks of up to 4 rows (a group of 4, or 1-4 query tokens of MHA), else 8 (groups of 5-8 and
# longer query runs; a grid's z covers rows past 8).
DECODE_TILES = (DecodeTiles(rows=4, unroll=4), DecodeTiles(rows=8, unroll=2))

# Keys every run of the portable kernel starts on a multiple of (its largest unroll): a page size
# must be a multiple of it, so that no run crosses a page.
PAGE_SIZE_MULTIPLE = max(t.unroll for t in DECODE_TILES)


@dataclass(frozen=True)
class DecodeMmaTiles(KernelTiles):
    """A row of the tensor-core attention kernel (NVIDIA sm_80+): 16 query rows per block, four warps
    of 16 keys each per tile of ``block_n``, and ``stages`` K/V slots in flight."""

    block_n: int
    stages: int

    family = property(lambda self: DECODE_FORWARD_MMA)
    threads = DECODE_BLOCK_THREADS
    rows = MMA_ROWS
    persistent = False

    def shared_bytes(self, head_dim: int, element_bytes: int = ELEMENT_BYTES) -> int:
        """decode::MmaLayout<...>::kBytes: the Q tile and STAGES K and V slots, rows of head_dim + 8
        elements; or the four warps' merge states (fp32 rows of head_dim + 4, a max and a sum), if larger."""
        pitch = head_dim + FLASH_ROW_PAD
        staging = (self.rows + 2 * self.stages * self.block_n) * pitch * element_bytes
        merge = 4 * self.rows * (head_dim + 4 + 2) * 4
        return max(staging, merge)

    def blocks_per_unit(self, target: Target | None, head_dim: int) -> int:
        """Blocks an SM holds at once, for the split heuristic: its shared memory over a block's (the
        per-block opt-in limit standing in for the SM's), at most MAX_RESIDENT_MMA_BLOCKS (registers)."""
        limit = HOPPER_SHARED_BYTES if has_hopper_shared_memory(target) else SM86_SHARED_BYTES
        return max(1, min(MAX_RESIDENT_MMA_BLOCKS, limit // self.shared_bytes(head_dim)))


# 128 threads of about 128 registers each: four blocks fill an SM's 64K registers.
MAX_RESIDENT_MMA_BLOCKS = 4

# Hopper (227 KiB per block): every row leaves room for two blocks per SM (at most 113 KiB each),
# with as many stages as that allows. Other sm_80+ parts: every row within sm_86/sm_89's 99 KiB.
DECODE_MMA_TILES_HOPPER: dict[int, DecodeMmaTiles] = {
    32: DecodeMmaTiles(block_n=64, stages=4), 64: DecodeMmaTiles(block_n=64, stages=3),
    80: DecodeMmaTiles(block_n=64, stages=3), 96: DecodeMmaTiles(block_n=64, stages=3),
    128: DecodeMmaTiles(block_n=64, stages=3), 192: DecodeMmaTiles(block_n=64, stages=2),
    256: DecodeMmaTiles(block_n=64, stages=1),
}
DECODE_MMA_TILES: dict[int, DecodeMmaTiles] = {
    32: DecodeMmaTiles(block_n=64, stages=3), 64: DecodeMmaTiles(block_n=64, stages=2),
    80: DecodeMmaTiles(block_n=64, stages=2), 96: DecodeMmaTiles(block_n=64, stages=2),
    128: DecodeMmaTiles(block_n=64, stages=2), 192: DecodeMmaTiles(block_n=64, stages=1),
    256: DecodeMmaTiles(block_n=64, stages=1),
}

@dataclass(frozen=True)
class DecodeTmaTiles(KernelTiles):
    """A row of the copy-engine attention kernel (Hopper): the tensor-core kernel's tiles (16 query
    rows, four consumer warps of 16 keys per 64-key tile) and a producer warp, and ``stages`` slots of
    a tile's K and V. Its grid is persistent: the blocks an SM holds (blocks_per_unit) walk the call's
    work items."""

    stages: int

    family = property(lambda self: DECODE_FORWARD_TMA)
    threads = DECODE_BLOCK_THREADS + 32
    rows = MMA_ROWS
    persistent = True

    def shared_bytes(self, head_dim: int, element_bytes: int = ELEMENT_BYTES) -> int:
        """decode::TmaLayout<...>::kBytes: STAGES slots of a swizzled K and V tile (rows in whole
        64-column blocks), two Q tiles (rows of head_dim + 8), the warps' merge states and two
        mbarriers per slot."""
        tile = MMA_TILE_KEYS * wgmma_row_elements(head_dim) * element_bytes
        query = 2 * MMA_ROWS * (head_dim + FLASH_ROW_PAD) * element_bytes
        merge = MMA_WARPS * MMA_ROWS * (head_dim + 4 + 2) * 4
        return self.stages * 2 * tile + query + merge + 2 * self.stages * MBARRIER_BYTES

    def blocks_per_unit(self, target: Target | None, head_dim: int) -> int:
        """Persistent blocks per SM: as many as its shared memory holds and its registers allow
        (resident_blocks)."""
        return max(1, min(self.resident_blocks(head_dim), HOPPER_SHARED_BYTES // self.shared_bytes(head_dim)))

    @staticmethod
    def resident_blocks(head_dim: int) -> int:
        """decode::TmaLayout<...>::kResidentBlocks, the kernel's launch bound: two blocks of 160 threads
        share an SM's registers up to head_dim 128; above, one (two would spill)."""
        return 2 if head_dim <= 128 else 1

    def tensor_map_rows(self) -> dict[str, int]:
        return {"k": MMA_TILE_KEYS, "v": MMA_TILE_KEYS}


# Three slots: on the H200, with the cache maps' L2 promotion off (tools/bench_decode.py), two or four
# read 1-9% slower, and copying a tile's V behind the next tile's K 1-7% slower. Head_dim 256 stays
# with the thread-copy kernel: its consumers' O and Q fragments leave the score-modified instantiation
# too few registers (ptxas spills).
DECODE_TMA_TILES: dict[int, DecodeTmaTiles] = {d: DecodeTmaTiles(stages=3) for d in (64, 80, 96, 128, 192)}


@dataclass(frozen=True)
class DecodeMfmaTiles(KernelTiles):
    """A row of the matrix-core attention kernel (AMD gfx90a/gfx94x/gfx950): 16 query rows per block,
    ``waves`` waves that each walk their own runs of 16 keys."""

    waves: int

    family = property(lambda self: DECODE_FORWARD_MFMA)
    rows = 16
    persistent = False

    @property
    def threads(self) -> int:
        return 64 * self.waves

    def shared_bytes(self, head_dim: int, element_bytes: int = ELEMENT_BYTES) -> int:
        return 0  # its merge buffers are static LDS

    def blocks_per_unit(self, target: Target | None, head_dim: int) -> int:
        """Blocks a CU holds at once, for the split heuristic: its merge buffers' LDS (static, at most
        34 KiB) leave room for one or two; registers for more."""
        return 2 if head_dim <= 64 else 1


# Four waves up to head_dim 128; two above, whose merge buffers of four would pass 64 KiB of LDS.
DECODE_MFMA_TILES: dict[int, DecodeMfmaTiles] = {
    d: DecodeMfmaTiles(waves=4 if d <= 128 else 2) for d in (32, 64, 96, 128, 192, 256)}

AttentionTiles = DecodeTiles | DecodeMmaTiles | DecodeTmaTiles | DecodeMfmaTiles


def tiles_for(target: Target | None, head_dim: int, rows: int, tensor_maps: bool = True) -> AttentionTiles:
    """The attention row ``target`` runs for ``rows`` query rows per KV head (query tokens x group):
    on Hopper the copy-engine kernel where its table has head_dim and the cache has tensor maps
    (``tensor_maps``), else the tensor-core kernel on NVIDIA sm_80+; the matrix-core one on AMD's MFMA
    targets where its table has head_dim; else the portable one."""
    if tensor_maps and runs_nvidia_wgmma(target) and head_dim in DECODE_TMA_TILES:
        return DECODE_TMA_TILES[head_dim]
    if runs_nvidia_mma(target):
        table = DECODE_MMA_TILES_HOPPER if has_hopper_shared_memory(target) else DECODE_MMA_TILES
        return table[head_dim]
    if runs_amd_mfma(target) and head_dim in DECODE_MFMA_TILES:
        return DECODE_MFMA_TILES[head_dim]
    for tiles in DECODE_TILES:
        if rows <= tiles.rows:
            return tiles
    return DECODE_TILES[-1]


def _shipped(family_name: str, target: Target) -> list[KernelSpec]:
    """The attention instantiations of ``family_name`` that ``target`` runs (tiles_for), every dtype,
    head_dim and query-rows bound."""
    return [t.spec(dtype, d, score_mods=m) for dtype in DTYPES for t, d in _row_dims(target)
            if t.family.name == family_name for m in SCORE_MODS_VALUES]


def _row_dims(target: Target) -> list:
    """(row, head_dim) of every attention row ``target`` runs, once each, in a stable order."""
    found = []
    for d in DECODE_HEAD_DIMS:
        for bound in (t.rows for t in DECODE_TILES):
            for tensor_maps in (True, False):
                pair = (tiles_for(target, d, bound, tensor_maps), d)
                if pair not in found:
                    found.append(pair)
    return found


# Each target ships the attention kernels it runs (tiles_for).
DECODE_FORWARD = register(KernelFamily(
    name="decode_forward", source="decode/forward.hip", template="hipattn::decode_forward",
    template_params=("dtype", "head_dim", "rows", "unroll", SCORE_MODS_PARAM), params=DECODE_FORWARD_PARAMS,
    shipped=lambda target: _shipped("decode_forward", target)))
DECODE_FORWARD_MMA = register(KernelFamily(
    name="decode_forward_mma", source="decode/forward_mma.hip", template="hipattn::decode_forward_mma",
    template_params=("dtype", "head_dim", "block_n", "stages", SCORE_MODS_PARAM), params=DECODE_FORWARD_PARAMS,
    shipped=lambda target: _shipped("decode_forward_mma", target)))
DECODE_FORWARD_TMA = register(KernelFamily(
    name="decode_forward_tma", source="decode/forward_tma.hip", template="hipattn::decode_forward_tma",
    template_params=("dtype", "head_dim", "stages", SCORE_MODS_PARAM), params=DECODE_FORWARD_TMA_PARAMS,
    structs=(DECODE_FORWARD_PARAMS,), shipped=lambda target: _shipped("decode_forward_tma", target)))
DECODE_FORWARD_MFMA = register(KernelFamily(
    name="decode_forward_mfma", source="decode/forward_mfma.hip", template="hipattn::decode_forward_mfma",
    template_params=("dtype", "head_dim", "waves", SCORE_MODS_PARAM), params=DECODE_FORWARD_PARAMS,
    shipped=lambda target: _shipped("decode_forward_mfma", target)))
DECODE_COMBINE = register(KernelFamily(
    name="decode_combine", source="decode/combine.hip", template="hipattn::decode_combine",
    template_params=("dtype", "max_splits"), params=DECODE_COMBINE_PARAMS,
    shipped=lambda target: [combine_spec(dtype) for dtype in DTYPES]))


def combine_spec(dtype: str) -> KernelSpec:
    return DECODE_COMBINE.spec(dtype=dtype, max_splits=MAX_SPLITS)


DECODE_APPEND = register(KernelFamily(
    name="decode_append", source="decode/append.hip", template="hipattn::decode_append",
    template_params=("dtype",), params=DECODE_APPEND_PARAMS,
    shipped=lambda target: [DECODE_APPEND.spec(dtype=dtype) for dtype in DTYPES]))
