"""Launch the general attention backward: FlashAttention-2 on NVIDIA tensor cores (sm_80+; on sm_90a the
dK/dV kernel runs on Hopper's warpgroup tensor cores at the head_dims its table has, warp-specialised
where its producer can copy Q and dO through tensor maps, ops.tensor_map_fields) and on AMD matrix
cores (gfx90a/gfx94x/gfx950).

hipattn.attention.backward calls it for every call the small-seq path cannot take (hipattn.dispatch),
with the workspace sections of workspace.backward_workspace.

Two schedules, both enqueued on the caller's stream after Delta = rowsum(dO * O) (preprocess.dot_do_o):

* ``deterministic=False``: dq_accum is zeroed, the dK/dV kernel adds each key tile's share of dQ
  into it with fp32 atomics, and preprocess.convert_dq writes dq = softmax_scale * dq_accum. The
  order of the atomic additions varies, so dQ may differ in its last bits from run to run.
* ``deterministic=True``: the dK/dV kernel without dQ, then the dQ kernel, one block per query tile
  summing over its key tiles in a fixed order: bit-identical run to run, no dq_accum.

Varlen (THD) work list. Given the workspace's ``varlen_records`` section, the backward first
enqueues its preparation (hipattn.varlen_prep: a small kernel, or the host path with a host
function; ``HIPATTN_VARLEN_PREP``), and the dK/dV kernel's grid covers only the key blocks the
sequences can have, ``key_block_bound`` (hipattn.varlen_metadata) times the KV heads, instead of
ceil(max_seqlen_k / BLOCK_N) per sequence; each block finds its sequence in the records. Without
it (and always in BSHD) the grid is sized from max_seqlen_k. The dQ kernel keeps its grid.

The caller has validated the problem, made the device current and resolved the stream; nothing here
synchronizes, and grids are sized from host facts only (batch, heads, max_seqlen, total_k), so a
call can be captured into a graph. Keys of a sequence that no query sees get dK = dV = 0; rows past a sequence's
length are not written by the kernels (convert_dq, on the atomic schedule, writes every row of dq:
zeros where no sequence is).
"""

from __future__ import annotations

import functools

from .. import dropout, runtime
from ..catalog import flash_backward
from ..catalog.flash_backward import FlashDkdvTiles, FlashDqTiles
from ..catalog.targets import check_grid
from ..catalog.tiles import KernelTiles
from ..device_array import DeviceArray
from ..jit.spec import KernelSpec
from ..problem import THD, Problem
from ..varlen_metadata import VARLEN_RECORD_WORDS, SequenceLimits, key_block_bound
from ..varlen_prep import prep_way, prepare_varlen_records
from . import preprocess
from .fields import put_absent_tensor, put_row_statistic, put_tensor, sequence_fields
from .flash import ineligibility
from .tensor_map_fields import maps_or_fallback


# A row's spec and shared memory per (dtype, head_dim[, write_dq], score_mods), worked out once: a launch pays a
# dict hit.
@functools.cache
def _launch_of(tiles: KernelTiles, dtype: str, head_dim: int, **more) -> tuple[KernelSpec, int]:
    return tiles.spec(dtype, head_dim, **more), tiles.shared_bytes(head_dim)


def dkdv_grid_blocks(problem: Problem, work_list: bool, block_n: int) -> int:
    """The dK/dV kernel's grid.x for key tiles of ``block_n``: with a varlen work list, its bound
    (key_block_bound) times KV heads; else key tiles for max_seqlen_k, times batch, times KV heads."""
    if work_list:
        return key_block_bound(SequenceLimits.of(problem), problem.batch, block_n) * problem.heads_kv
    return -(-problem.max_seqlen_k // block_n) * problem.batch * problem.heads_kv


def dq_grid_blocks(problem: Problem, block_m: int) -> int:
    """Query tiles of ``block_m`` rows for max_seqlen_q, times batch, times query heads: the dQ
    kernel's grid.x."""
    return -(-problem.max_seqlen_q // block_m) * problem.batch * problem.heads_q


def _check_records(varlen_records: DeviceArray, problem: Problem) -> None:
    if problem.layout != THD:
        raise ValueError("flash backward: varlen_records is the THD (cu_seqlens) work list; this call is BSHD")
    expected = (problem.batch, VARLEN_RECORD_WORDS)
    if varlen_records.dtype != "int32" or tuple(varlen_records.shape) != expected or (
            problem.batch and varlen_records.strides != (VARLEN_RECORD_WORDS, 1)):
        raise ValueError(f"flash backward: varlen_records must be contiguous int32 {expected}; got "
                         f"{varlen_records.dtype} {varlen_records.shape} strides {varlen_records.strides}")


def adds_dq_atomically(problem: Problem, deterministic: bool) -> bool:
    """Whether a backward of ``problem`` adds dQ atomically from the dK/dV kernel into dq_accum (the
    workspace section it then needs) rather than computing it with the dQ kernel: when ``deterministic``
    is off, unless the device's rows make the dQ kernel the faster schedule at this head_dim
    (catalog.flash_backward.dq_kernel_always; only the head_dims it names ask the device which it is)."""
    if deterministic:
        return False
    if problem.head_dim not in flash_backward.HOPPER_DQ_KERNEL_HEAD_DIMS:
        return True
    return not flash_backward.dq_kernel_always(problem.head_dim, runtime.active().target(problem.device))


def backward(problem: Problem, q, k, v, out, dout, lse, dq, dk, dv, stream: int, *, softmax_d: DeviceArray,
             dq_accum: DeviceArray | None = None, varlen_records: DeviceArray | None = None,
             deterministic: bool, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
             alibi_slopes=None, dropout_seed=None, tiles: tuple[FlashDkdvTiles, FlashDqTiles] | None = None) -> None:
    """Enqueue dQ, dK and dV of attention ``out`` = softmax(scale q kᵀ) v, given dout and the forward's lse.

    All arguments are DeviceArrays in ``problem``'s layout; dq, dk, dv take q, k, v's shapes and dtype.
    ``softmax_d`` is fp32 workspace shaped like ``lse`` (it receives Delta = rowsum(dout * out)).
    ``dq_accum`` is contiguous fp32 workspace shaped like dq, needed where ``adds_dq_atomically``.
    ``varlen_records`` (THD only) is contiguous int32 workspace [batch, VARLEN_RECORD_WORDS]: the
    dK/dV kernel's work list, prepared here on ``stream`` (workspace.backward_workspace's section).
    ``dropout_seed``: the forward's seed array, for a call with dropout (hipattn.dropout).
    ``tiles`` overrides the (dK/dV, dQ) table rows for head_dim, and with the dK/dV row's type its
    kernel (tools/sweep_flash_backward.py sweeps them this way, and times mma.sync against wgmma on one
    device); the default is the rows the device's target runs (catalog.flash_backward.tiles_for).
    """
    reason = ineligibility(problem, "backward")
    if reason is not None:
        raise ValueError(f"flash backward: {reason}")
    active = runtime.active()
    target = active.target(problem.device)
    # A `tiles` override keeps the caller's schedule, so that a sweep times both.
    atomic_dq = not deterministic if tiles is not None else adds_dq_atomically(problem, deterministic)
    if atomic_dq and dq_accum is None:
        raise ValueError("flash backward: the atomic dQ schedule (deterministic=False) needs dq_accum")
    work_list = varlen_records is not None
    if work_list:
        _check_records(varlen_records, problem)
        way = prep_way()  # a bad HIPATTN_VARLEN_PREP raises before anything is enqueued
    chosen = tiles is None
    dkdv_tiles, dq_tiles = tiles or flash_backward.tiles_for(problem.head_dim, target, score_mods=problem.score_mods)
    dkdv_tiles, map_fields = maps_or_fallback(
        active, problem.layout, {"q": q, "dout": dout}, dkdv_tiles, chosen, "flash backward",
        lambda: flash_backward.tiles_for(problem.head_dim, target, score_mods=problem.score_mods, tensor_maps=False)[0])
    dkdv_blocks = dkdv_grid_blocks(problem, work_list, dkdv_tiles.block_n)
    dq_blocks = dq_grid_blocks(problem, dq_tiles.block_m)
    check_grid(target, dkdv_blocks, dkdv_tiles.threads,
               "key blocks x KV heads" if work_list else "key tiles x sequences x KV heads")
    check_grid(target, dq_blocks, dq_tiles.threads, "query tiles x sequences x heads")

    fields = sequence_fields(problem, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes)
    layout = problem.layout
    for name, a in (("q", q), ("k", k), ("v", v), ("dout", dout), ("dq", dq), ("dk", dk), ("dv", dv)):
        put_tensor(fields, name, a, layout)
    if atomic_dq:
        put_tensor(fields, "dq_accum", dq_accum, layout)
    else:
        put_absent_tensor(fields, "dq_accum")
    put_row_statistic(fields, "lse", lse, problem)
    put_row_statistic(fields, "softmax_d", softmax_d, problem)
    fields["heads_q"] = problem.heads_q
    fields.update(dropout.fields(problem.dropout_p, dropout_seed))
    fields["varlen_records"] = varlen_records.ptr if work_list else 0

    if work_list and dkdv_blocks:
        prepare_varlen_records(
            active.backend, stream, problem.device, fields["cu_seqlens_q"], fields["cu_seqlens_k"], problem.batch,
            dkdv_tiles.block_n, varlen_records.ptr, limits=SequenceLimits.of(problem),
            seqused_q=fields["seqused_q"], seqused_k=fields["seqused_k"], way=way)
    preprocess.dot_do_o(out, dout, softmax_d, stream)
    if atomic_dq:
        preprocess.zero_dq_accum(dq_accum, stream)
    # With no query rows (max_seqlen_q 0) the dK/dV kernel still runs: its keys get dK = dV = 0.
    if dkdv_blocks:
        _launch(active, _launch_of(dkdv_tiles, problem.dtype, problem.head_dim, write_dq=atomic_dq,
                                               score_mods=problem.score_mods),
                dkdv_tiles, dkdv_blocks, problem, stream, {**fields, **map_fields} if map_fields else fields)
    if atomic_dq:
        # The kernel adds unscaled dS K; the conversion applies softmax_scale once.
        preprocess.convert_dq(dq_accum, dq, problem.softmax_scale, stream)
    elif dq_blocks:
        # With no keys (max_seqlen_k 0) the dQ kernel still runs: its rows get dQ = 0.
        _launch(active, _launch_of(dq_tiles, problem.dtype, problem.head_dim, score_mods=problem.score_mods),
                dq_tiles, dq_blocks, problem, stream, fields)


def _launch(active: runtime.Runtime, launch: tuple[KernelSpec, int], tiles: KernelTiles, blocks: int,
            problem: Problem, stream: int, fields: dict) -> None:
    """One of the two kernels, on ``blocks`` blocks of ``tiles.threads``; both read the one struct."""
    spec, shared_bytes = launch
    kernel = active.kernel(spec, problem.device)
    kernel.reserve_dynamic_shared_memory(shared_bytes)
    kernel.launch((blocks, 1, 1), (tiles.threads, 1, 1), shared_bytes, stream, kernel.params.from_dict(fields))
