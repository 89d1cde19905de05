"""Launch the small-sequence kernels (every sequence <= SMALLSEQ_TILE tokens on both sides).

The caller has validated the problem (problem.describe), made the device current and resolved the
stream; everything here is enqueued on that stream, nothing synchronizes, and the grid is sized
from host-known facts only (batch and heads), so a call can be captured into a graph.
"""

from __future__ import annotations

import functools
import os

from ..families import (
    SMALLSEQ_BACKWARD,
    SMALLSEQ_BACKWARD_GQA_MMA,
    SMALLSEQ_BACKWARD_MMA,
    SMALLSEQ_BACKWARD_MMA_TILES,
    SMALLSEQ_FORWARD,
    SMALLSEQ_FORWARD_GQA_MMA,
    SMALLSEQ_FORWARD_MMA,
    SMALLSEQ_FORWARD_MMA_TILES,
    SMALLSEQ_GQA_BACKWARD_MMA_TILES,
    SMALLSEQ_GQA_FORWARD_MMA_TILES,
    SMALLSEQ_GQA_MAX_GROUP,
    SMALLSEQ_HEAD_DIMS,
    SMALLSEQ_TILE,
    smallseq_gqa_mma_shared_bytes,
    smallseq_gqa_mma_spec,
    smallseq_mma_shared_bytes,
    smallseq_mma_spec,
    smallseq_portable_spec,
    smallseq_problems_per_team,
    smallseq_teams_per_block,
)
from ..problem import Problem
from ..registry import get_kernel
from ..spec import KernelSpec
from .capabilities import has_nvidia_mma
from .fields import forward_fields, put_row_statistic, put_tensor, sequence_fields
from .flash import MAX_GRID_X

# HIPATTN_SMALLSEQ_KERNEL=portable forces the portable (CUDA-core / any wave size) kernels, forward
# and backward, on a GPU that has the tensor-core ones: for A/B comparisons and to test both on one
# machine.
KERNEL_SWITCH = "HIPATTN_SMALLSEQ_KERNEL"


def ineligibility(problem: Problem) -> str | None:
    """Why the small-seq path cannot take ``problem``, or None when it can."""
    if problem.head_dim not in SMALLSEQ_HEAD_DIMS:
        return f"head_dim {problem.head_dim} is not one of {SMALLSEQ_HEAD_DIMS}"
    if problem.max_seqlen_q > SMALLSEQ_TILE or problem.max_seqlen_k > SMALLSEQ_TILE:
        return (
            f"max_seqlen_q={problem.max_seqlen_q}, max_seqlen_k={problem.max_seqlen_k}: "
            f"a sequence may be longer than {SMALLSEQ_TILE} tokens"
        )
    return None


# The kernels a call can take: the portable ones (CUDA cores / any wave size), the tensor-core ones
# with one problem per (sequence, head) (Hq == Hkv), and the tensor-core ones with one per (sequence,
# KV head) group of G = Hq / Hkv query heads (GQA/MQA).
PORTABLE, MMA, GQA_MMA = "portable", "mma", "gqa_mma"


# Specs are frozen and few (one per dtype, head_dim and heads in use): each is built once, so a
# launch pays a dict hit instead of KernelFamily.spec's argument checks.
@functools.cache
def _forward_spec(kernels: str, dtype: str, head_dim: int, heads: int) -> KernelSpec:
    if kernels == GQA_MMA:
        return smallseq_gqa_mma_spec(SMALLSEQ_FORWARD_GQA_MMA, dtype, head_dim)
    if kernels == MMA:
        return smallseq_mma_spec(SMALLSEQ_FORWARD_MMA, dtype, head_dim, heads)
    return smallseq_portable_spec(SMALLSEQ_FORWARD, dtype, head_dim, heads)


@functools.cache
def _backward_spec(kernels: str, dtype: str, head_dim: int, heads: int) -> KernelSpec:
    if kernels == GQA_MMA:
        return smallseq_gqa_mma_spec(SMALLSEQ_BACKWARD_GQA_MMA, dtype, head_dim)
    if kernels == MMA:
        return smallseq_mma_spec(SMALLSEQ_BACKWARD_MMA, dtype, head_dim, heads)
    return smallseq_portable_spec(SMALLSEQ_BACKWARD, dtype, head_dim, heads)


def _tensor_cores(device: int) -> bool:
    return has_nvidia_mma(device) and os.environ.get(KERNEL_SWITCH) != "portable"


def kernels_for(problem: Problem) -> str:
    """PORTABLE, MMA or GQA_MMA: which kernels serve ``problem``, forward and backward alike. The
    grouped kernels' row -> query division is exact up to SMALLSEQ_GQA_MAX_GROUP query heads a group."""
    if not _tensor_cores(problem.device):
        return PORTABLE
    if problem.heads_q == problem.heads_kv:
        return MMA
    return GQA_MMA if problem.heads_q // problem.heads_kv <= SMALLSEQ_GQA_MAX_GROUP else PORTABLE


def forward(problem: Problem, q, k, v, out, lse, stream: int, *, cu_seqlens_q=None, cu_seqlens_k=None,
            seqused_q=None, seqused_k=None) -> None:
    """Enqueue O and LSE for every (sequence, query head) problem, or (GQA/MQA on tensor cores) for
    every (sequence, KV head) group."""
    kernels = kernels_for(problem)
    problems = problem.batch * (problem.heads_kv if kernels == GQA_MMA else problem.heads_q)
    if problems == 0:
        return  # batch 0: nothing to read or write
    fields = forward_fields(problem, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    _launch("forward", kernels, problem, problems, fields, stream)


def _launch(direction: str, kernels: str, problem: Problem, problems: int, fields: dict, stream: int) -> None:
    """Launch the forward or backward kernel over ``problems`` problems.

    Portable kernels give each problem a team of head_dim / SMALLSEQ_LANE_ELEMENTS lanes; tensor-core
    kernels give each run of problems_per_team problems (GQA_MMA: groups) a team of warps (the table's
    row).
    """
    spec_of = _forward_spec if direction == "forward" else _backward_spec
    spec = spec_of(kernels, problem.dtype, problem.head_dim, problem.heads_q)
    if kernels == PORTABLE:
        teams, teams_per_block, threads = problems, smallseq_teams_per_block(spec), spec.arg("block_threads")
        shared = backward_shared_bytes(problem, teams_per_block) if direction == "backward" else 0
    else:
        if kernels == GQA_MMA:
            table = SMALLSEQ_GQA_FORWARD_MMA_TILES if direction == "forward" else SMALLSEQ_GQA_BACKWARD_MMA_TILES
            tiles = table[problem.head_dim]
            shared = smallseq_gqa_mma_shared_bytes(direction, problem.head_dim, tiles)
            fields["group_size"] = problem.heads_q // problem.heads_kv
        else:
            table = SMALLSEQ_FORWARD_MMA_TILES if direction == "forward" else SMALLSEQ_BACKWARD_MMA_TILES
            tiles = table[problem.head_dim]
            shared = smallseq_mma_shared_bytes(direction, problem.head_dim, tiles)
        fields["problems_per_team"] = per_team = smallseq_problems_per_team(problems, tiles)
        teams, teams_per_block, threads = (problems + per_team - 1) // per_team, tiles.teams, tiles.threads
    # The teams go on grid.x (up to 2^31 - 1 blocks): no 65535 limit on batch.
    blocks = (teams + teams_per_block - 1) // teams_per_block
    if blocks > MAX_GRID_X:
        raise ValueError(f"small-seq {direction}: {blocks} blocks of {problems} problems exceed the grid limit of "
                         f"{MAX_GRID_X} blocks; split the batch")
    kernel = get_kernel(spec, problem.device)
    kernel.reserve_dynamic_shared_memory(shared)
    kernel.launch((blocks, 1, 1), (threads, 1, 1), shared, stream, kernel.params.from_dict(fields))


def backward_shared_bytes(problem: Problem, teams_per_block: int) -> int:
    """Dynamic shared memory of one portable backward block: each team's dK/dV sums over its GQA
    group, fp32 [2][tile][head_dim] (backward.hip's group_accum)."""
    if problem.heads_q == problem.heads_kv:
        return 0  # each team writes its dK/dV straight out
    return teams_per_block * 2 * SMALLSEQ_TILE * problem.head_dim * 4


def backward(problem: Problem, dout, q, k, v, lse, dq, dk, dv, stream: int, *, cu_seqlens_q=None,
             cu_seqlens_k=None, seqused_q=None, seqused_k=None) -> None:
    """Enqueue dQ, dK, dV: per (sequence, KV head) problem, walking the query heads of its group
    (portable, and the tensor cores' GQA_MMA), or per (sequence, head) problem (tensor cores, Hq == Hkv)."""
    problems = problem.batch * problem.heads_kv
    if problems == 0:
        return
    fields = sequence_fields(problem, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    layout = problem.layout
    for name, a in (("q", q), ("k", k), ("v", v), ("dout", dout), ("dq", dq), ("dk", dk), ("dv", dv)):
        put_tensor(fields, name, a, layout)
    put_row_statistic(fields, "lse", lse, problem)
    _launch("backward", kernels_for(problem), problem, problems, fields, stream)
