"""Launch the small-sequence kernels (every sequence <= SMALLSEQ_TILE tokens on both sides).

The caller has validated the problem (problem.describe), made the device current and resolved the
stream; everything here is enqueued on that stream, nothing synchronizes, and the grid is sized
from host-known facts only (batch and heads), so a call can be captured into a graph.
"""

from __future__ import annotations

import functools

from .. import dropout, env, runtime
from ..catalog import smallseq
from ..catalog.smallseq import SMALLSEQ_HEAD_DIMS, SMALLSEQ_TILE, SmallSeqTiles
from ..catalog.targets import check_grid
from ..jit.spec import KernelSpec
from ..problem import Problem
from .fields import forward_fields, put_row_statistic, put_tensor, sequence_fields

# HIPATTN_SMALLSEQ_KERNEL=portable forces the portable (CUDA-core / any wave size) kernels, forward
# and backward, on a GPU that has the tensor-core (NVIDIA) or matrix-core (AMD MFMA) ones: for A/B
# comparisons and to test both on one machine. "auto" (the default) takes those where the GPU has them.
KERNEL_SWITCH = "HIPATTN_SMALLSEQ_KERNEL"
KERNEL_CHOICES = ("auto", "portable")


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


def _portable_forced() -> bool:
    # Read per call (a change applies at once), before the device is asked anything, so a typo in the
    # switch is reported whatever the GPU.
    return env.choice(KERNEL_SWITCH, KERNEL_CHOICES, "auto") == "portable"


# Specs are frozen and few (one per row, dtype, head_dim and heads in use): each is built once, so a
# launch pays a dict hit instead of KernelFamily.spec's argument checks.
@functools.cache
def _spec(tiles: SmallSeqTiles, dtype: str, head_dim: int, heads: int, score_mods: bool) -> KernelSpec:
    return tiles.call_spec(dtype, head_dim, heads, score_mods)


def _launch(tiles: SmallSeqTiles, problem: Problem, problems: int, fields: dict, stream: int) -> None:
    """Launch ``tiles``' kernel over ``problems`` problems; the row says how its teams cover them. The
    grid is checked before the kernel is loaded, so a call too large for one launch enqueues and
    compiles nothing."""
    active = runtime.active()
    launch = tiles.launch(problems, problem.head_dim, problem.heads_q // problem.heads_kv)
    check_grid(active.target(problem.device), launch.blocks, launch.threads,
               f"blocks of small-seq work for batch {problem.batch}")
    kernel = active.kernel(_spec(tiles, problem.dtype, problem.head_dim, problem.heads_q, problem.score_mods),
                           problem.device)
    fields.update(launch.fields)
    kernel.reserve_dynamic_shared_memory(launch.shared_bytes)
    kernel.launch((launch.blocks, 1, 1), (launch.threads, 1, 1), launch.shared_bytes, stream,
                  kernel.params.from_dict(fields))


def forward(problem: Problem, q, k, v, out, lse, stream: int, *, cu_seqlens_q=None, cu_seqlens_k=None,
            seqused_q=None, seqused_k=None, alibi_slopes=None, dropout_seed=None, learnable_sink=None) -> None:
    """Enqueue O and LSE for every (sequence, query head) problem; ``dropout_seed``: the seed array of a
    call with dropout (hipattn.dropout); ``learnable_sink``: fp32 [Hq] sink logits, or None (the LSE
    then includes them, which is all the backward needs)."""
    problems = problem.batch * problem.heads_q
    if problems == 0:
        return  # batch 0: nothing to read or write
    portable = _portable_forced()
    fields = forward_fields(problem, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                            alibi_slopes, learnable_sink)
    fields.update(dropout.fields(problem.dropout_p, dropout_seed), heads_q=problem.heads_q)
    target = runtime.active().target(problem.device)
    tiles = smallseq.forward_tiles(problem.head_dim, target, group=problem.heads_q // problem.heads_kv,
                                   portable=portable)
    _launch(tiles, problem, problems, fields, stream)


def backward(problem: Problem, dout, q, k, v, lse, dq, dk, dv, stream: int, *, cu_seqlens_q=None,
             cu_seqlens_k=None, seqused_q=None, seqused_k=None, alibi_slopes=None, dropout_seed=None) -> None:
    """Enqueue dQ, dK, dV: per (sequence, KV head) problem, walking the query heads of its group (every
    kernel but NVIDIA's tensor-core one for ungrouped heads, which takes a problem per (sequence, head)).
    ``dropout_seed``: the forward's seed array, for a call with dropout."""
    problems = problem.batch * problem.heads_kv
    if problems == 0:
        return
    portable = _portable_forced()
    fields = sequence_fields(problem, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes)
    layout = problem.layout
    for name, a in (("q", q), ("k", k), ("v", v), ("dout", dout), ("dq", dq), ("dk", dk), ("dv", dv)):
        put_tensor(fields, name, a, layout)
    put_row_statistic(fields, "lse", lse, problem)
    fields.update(dropout.fields(problem.dropout_p, dropout_seed), heads_q=problem.heads_q)
    target = runtime.active().target(problem.device)
    tiles = smallseq.backward_tiles(problem.head_dim, target, group=problem.heads_q // problem.heads_kv,
                                    portable=portable)
    _launch(tiles, problem, problems, fields, stream)
