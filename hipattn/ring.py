"""Context parallelism for packed varlen (THD) self-attention: ring attention over torch.distributed.

    import hipattn.torch as hat
    from hipattn.ring import local_cu_seqlens, shard_varlen

    q_r, k_r, v_r = (shard_varlen(t, cu_seqlens, rank, world) for t in (q, k, v))
    cu_local = local_cu_seqlens(cu_seqlens, world).to(q_r.device)   # global cu_seqlens / world
    out_r = hat.ring_flash_attn_varlen_func(q_r, k_r, v_r, cu_local, max_seqlen // world, causal=True)

**Sharding contract.** Every sequence of the packed batch has a length that is a multiple of the
world size W (of ``group``), and is cut into W equal contiguous chunks along its tokens: chunk r of
a sequence of length L is its tokens [r * L / W, (r + 1) * L / W). Rank r holds chunk r of every
sequence, packed in THD order (q [total / W, Hq, D], k and v [total / W, Hkv, D]) and described by
the local ``cu_seqlens`` = global cu_seqlens / W, which is therefore the same on every rank; so are
the shapes, dtypes and arguments of the call. ``shard_varlen`` makes a rank's shard from the full
tensor (and checks the lengths on the host); ``unshard_varlen`` is its inverse. Queries and keys
share the split (self-attention): there is one ``cu_seqlens`` and one ``max_seqlen`` (a bound on the
local chunk lengths). The call cannot check the contract across ranks without communicating; a
rank that breaks it gets wrong results, or a mismatched transfer.

**Schedule.** W steps: at step s rank r attends its query chunk to the key/value chunk of rank
(r - s) mod W, which arrived over the ring while step s - 1 computed (each step posts the transfer of
the block it holds to rank r + 1 before its own attention call, into the other of two buffers). A
query chunk i sees key chunk j < i fully, j == i causally (equal chunk lengths, so flash-attn's
bottom-right alignment is the diagonal), and j > i not at all (the call is skipped); without
``causal`` every chunk fully. The partial outputs are merged with their LSEs in fp32 (``merge_into``).
The backward runs the ring again with hipattn's backward on the merged out and LSE: dq accumulates
on its rank, and the dk/dv of a key/value block travel around the ring with it, arriving back at
the block's owner after W steps. Accumulators are fp32 (or the inputs' dtype, if wider); each block's
gradients come from hipattn in the inputs' dtype.

**Streams.** Everything is enqueued on torch's current stream; with NCCL the transfers run on its
own streams, ordered after the current stream's work at posting and before it at ``wait`` (no host
synchronization). gloo's ``wait`` blocks the host, as that backend requires.

**Not supported (yet).** Sliding windows (``window_size`` other than (-1, -1) raises ValueError),
cross-attention (different query and key splits), dropout, softcap, ALiBi, torch.compile (the ring
is plain eager Python). The causal schedule is not load-balanced: rank W - 1 computes W blocks,
rank 0 one.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import pairwise
from typing import Any, Protocol

import torch

from . import attention
from .dropout import check_dropout_p
from .problem import check_bool, check_max_seqlen, check_softcap, check_window, resolve_softmax_scale

__all__ = ["ring_flash_attn_varlen_func", "ring_attention", "shard_varlen", "unshard_varlen", "local_cu_seqlens",
           "merge_into", "finish_merge", "merge_partials", "ProcessGroupRing"]

Tensor = torch.Tensor
_NEG_INF = float("-inf")
_POS_INF = float("inf")


# ---------------------------------------------------------------------------------------------------
# Sharding helpers (host side: they read cu_seqlens on the host)

def _host_offsets(cu_seqlens: Any, name: str = "cu_seqlens") -> list[int]:
    if isinstance(cu_seqlens, Tensor):
        if cu_seqlens.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(cu_seqlens.shape)}")
        return [int(x) for x in cu_seqlens.tolist()]
    if isinstance(cu_seqlens, (list, tuple)):
        return [int(x) for x in cu_seqlens]
    raise TypeError(f"{name} must be a torch.Tensor or a list of ints, got {type(cu_seqlens).__name__}")


def _check_world(rank: Any, world_size: Any) -> None:
    for value, name in ((world_size, "world_size"), (rank, "rank")):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size is {world_size}; it must be >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank is {rank}; it must be in [0, world_size={world_size})")


def _chunk_lengths(offsets: list[int], world_size: int, name: str) -> list[int]:
    """Each sequence's chunk length, after checking that every length splits into world_size chunks."""
    lengths = [b - a for a, b in pairwise(offsets)]
    for index, length in enumerate(lengths):
        if length < 0 or length % world_size:
            raise ValueError(f"{name}: sequence {index} has length {length}, which is not a non-negative "
                             f"multiple of world_size={world_size} (ring attention splits every sequence "
                             "into world_size equal chunks)")
    return [length // world_size for length in lengths]


def local_cu_seqlens(cu_seqlens: Any, world_size: int) -> Tensor:
    """The local cu_seqlens every rank passes (global / world_size), int32 on cu_seqlens's device
    (CPU for a list); checks on the host that every sequence length is a multiple of world_size."""
    _check_world(0, world_size)
    offsets = _host_offsets(cu_seqlens)
    _chunk_lengths(offsets, world_size, "cu_seqlens")
    device = cu_seqlens.device if isinstance(cu_seqlens, Tensor) else None
    return torch.tensor([o // world_size for o in offsets], dtype=torch.int32, device=device)


def shard_varlen(tensor: Tensor, cu_seqlens: Any, rank: int, world_size: int, dim: int = 0) -> Tensor:
    """Rank ``rank``'s shard of a packed THD ``tensor`` (tokens along ``dim``: 0 for q/k/v/out, 1 for
    an LSE [H, total]): chunk ``rank`` of every sequence, concatenated in sequence order."""
    _check_world(rank, world_size)
    offsets = _host_offsets(cu_seqlens)
    chunks = _chunk_lengths(offsets, world_size, "cu_seqlens")
    if tensor.shape[dim] < offsets[-1]:
        raise ValueError(f"tensor has {tensor.shape[dim]} tokens along dim {dim}; cu_seqlens describes {offsets[-1]}")
    pieces = [tensor.narrow(dim, start + rank * chunk, chunk) for start, chunk in zip(offsets[:-1], chunks, strict=True)]
    return torch.cat(pieces, dim=dim) if pieces else tensor.narrow(dim, 0, 0)


def unshard_varlen(shards: Sequence[Tensor], cu_seqlens: Any, dim: int = 0) -> Tensor:
    """The inverse of shard_varlen: the full packed tensor from every rank's shard (rank order)."""
    world_size = len(shards)
    _check_world(0, world_size)
    offsets = _host_offsets(cu_seqlens)
    chunks = _chunk_lengths(offsets, world_size, "cu_seqlens")
    local_starts = [o // world_size for o in offsets[:-1]]
    pieces = [shard.narrow(dim, local_start, chunk)
              for local_start, chunk in zip(local_starts, chunks, strict=True) for shard in shards]
    return torch.cat(pieces, dim=dim) if pieces else shards[0].narrow(dim, 0, 0)


# ---------------------------------------------------------------------------------------------------
# Merging partial attention by log-sum-exp

def _as_merge_lse(lse: Tensor) -> Tensor:
    """hipattn's LSE in merge form: +inf (a row that saw no key in the block) becomes -inf, a
    weight of exp(-inf) = 0, so that the block contributes nothing to the row."""
    return lse.float().masked_fill(lse == _POS_INF, _NEG_INF)


def merge_into(acc_out: Tensor, acc_lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold one block's attention (out [T, H, D], hipattn LSE [H, T]) into the running (acc_out,
    acc_lse) in place: lse = logaddexp(acc_lse, lse_b), out = exp(acc_lse - lse) acc_out +
    exp(lse_b - lse) out_b. acc_lse holds -inf for rows that have seen no key yet (start it so)."""
    block_lse = _as_merge_lse(block_lse)
    merged = torch.logaddexp(acc_lse, block_lse)
    # A row no block has reached yet stays -inf: subtracting 0 instead of -inf keeps both weights at
    # exp(-inf) = 0 rather than NaN.
    pivot = merged.masked_fill(merged == _NEG_INF, 0.0)
    keep = torch.exp(acc_lse - pivot).transpose(0, 1).unsqueeze(-1).to(acc_out.dtype)
    take = torch.exp(block_lse - pivot).transpose(0, 1).unsqueeze(-1).to(acc_out.dtype)
    # where, not a product, for the block's rows of weight 0: 0 * (anything not finite) would be NaN.
    contribution = torch.where(take > 0, block_out.to(acc_out.dtype) * take, 0.0)
    acc_out.mul_(keep).add_(contribution)
    acc_lse.copy_(merged)


def finish_merge(acc_out: Tensor, acc_lse: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(out in ``dtype``, LSE in hipattn's convention: +inf for a row no block reached, whose out is 0)."""
    return acc_out.to(dtype), acc_lse.masked_fill(acc_lse == _NEG_INF, _POS_INF)


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit inputs; the inputs' own dtype when it is wider (float64 reference runs)."""
    return torch.promote_types(dtype, torch.float32)


def _empty_merge(q: Tensor) -> tuple[Tensor, Tensor]:
    acc_out = torch.zeros(q.shape, dtype=_accumulator_dtype(q.dtype), device=q.device)
    acc_lse = torch.full((q.shape[1], q.shape[0]), _NEG_INF, dtype=torch.float32, device=q.device)
    return acc_out, acc_lse


def merge_partials(outs: Sequence[Tensor], lses: Sequence[Tensor], dtype: torch.dtype | None = None):
    """Attention over the union of several key blocks from each block's (out [T, H, D], LSE [H, T]),
    as finish_merge returns it (dtype: the first out's unless given)."""
    acc_out, acc_lse = _empty_merge(outs[0])
    for block_out, block_lse in zip(outs, lses, strict=True):
        merge_into(acc_out, acc_lse, block_out, block_lse)
    return finish_merge(acc_out, acc_lse, dtype or outs[0].dtype)


# ---------------------------------------------------------------------------------------------------
# The ring: who sends what to whom

class PendingShift(Protocol):
    def wait(self) -> None:
        """Return once the received tensors are usable on the current stream (and the sent ones reusable)."""


class Ring(Protocol):
    """The transport of the ring loops: rank, world_size, and ``shift(tensors, into, tag)``, which
    sends ``tensors`` to rank + 1 and receives rank - 1's into ``into`` (same shapes), mod world_size.
    Every rank posts the same shifts in the same order; ``tag`` tells a call's transfers apart."""

    rank: int
    world_size: int

    def shift(self, tensors: Sequence[Tensor], into: Sequence[Tensor], tag: int) -> PendingShift: ...


class _Works:
    def __init__(self, works):
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()


class ProcessGroupRing:
    """The ring over a torch.distributed process group (``None``: the default group), by
    batch_isend_irecv. The group must be initialized; with NCCL, batch_isend_irecv being the first
    communication of a group needs every rank of it to take part (it does: every rank runs the ring)."""

    def __init__(self, group=None):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialized (call torch.distributed.init_process_group "
                             "first); ring attention needs a process group")
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError("group: this process is not a member of the given process group")

    def shift(self, tensors, into, tag):
        dist = self._dist
        after, before = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size
        ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=after, tag=tag) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, group=self.group, group_peer=before, tag=tag) for t in into]
        return _Works(dist.batch_isend_irecv(ops))


class _BufferPair:
    """Two sets of receive buffers used in turn: a transfer lands in one while the other (the block
    received the step before) is read by the attention call and sent on."""

    def __init__(self, like: Sequence[Tensor]):
        self._like = like
        self._sets: list = [None, None]
        self._turn = 0

    def next(self) -> list[Tensor]:
        if self._sets[self._turn] is None:
            self._sets[self._turn] = [torch.empty_like(t) for t in self._like]
        chosen = self._sets[self._turn]
        self._turn ^= 1
        return chosen


def _block_causality(rank: int, step: int, world_size: int, causal: bool) -> bool | None:
    """How query chunk ``rank`` sees the key chunk it holds at ``step`` (that of rank - step):
    None (not at all: skip the call), True (the diagonal: causally) or False (fully)."""
    if not causal:
        return False
    source = (rank - step) % world_size
    if source > rank:
        return None
    return source == rank


# Tags of one call's transfers: K/V blocks at their step, dK/dV blocks after them.
def _kv_tag(step: int) -> int:
    return step


def _dkv_tag(step: int, world_size: int) -> int:
    return world_size + step


# ---------------------------------------------------------------------------------------------------
# The ring loops

def _block_forward(q, k, v, cu_seqlens, max_seqlen, softmax_scale, block_causal):
    return attention.forward(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
                             max_seqlen_k=max_seqlen, softmax_scale=softmax_scale, causal=block_causal)


def _sendable(*tensors: Tensor) -> tuple[Tensor, ...]:
    """The tensors as the transports take them: contiguous (a copy only of a strided view, such as k
    and v of a packed kv, which the kernels read in place but NCCL sends only whole)."""
    return tuple(t.contiguous() for t in tensors)


def ring_forward_loop(q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, ring: Ring):
    """The forward ring on one rank: (out like q, LSE fp32 [Hq, total], +inf where no key was seen)."""
    acc_out, acc_lse = _empty_merge(q)
    block = _sendable(k, v)
    buffers = _BufferPair(block)
    for step in range(ring.world_size):
        pending = received = None
        if step + 1 < ring.world_size:  # the next block's transfer overlaps this block's attention
            received = buffers.next()
            pending = ring.shift(block, received, _kv_tag(step))
        block_causal = _block_causality(ring.rank, step, ring.world_size, causal)
        if block_causal is not None:
            merge_into(acc_out, acc_lse, *_block_forward(q, *block, cu_seqlens, max_seqlen, softmax_scale,
                                                         block_causal))
        if pending is not None:
            pending.wait()
            block = received
    return finish_merge(acc_out, acc_lse, q.dtype)


def _block_backward(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, softmax_scale, block_causal, deterministic):
    return attention.backward(dout, q, k, v, out, lse, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                              max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, softmax_scale=softmax_scale,
                              causal=block_causal, deterministic=deterministic)


def ring_backward_loop(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, softmax_scale, causal, deterministic,
                       ring: Ring):
    """The backward ring on one rank, from the merged out and LSE: (dq, dk, dv) in the inputs' dtypes.

    At step s the rank holds key block (rank - s) and the gradient of that block summed over the
    ranks it has visited so far (received with it); it adds its own share and passes both on. After
    the last step one more shift of the gradients brings every block's back to its owner."""
    world, rank = ring.world_size, ring.rank
    accumulate = _accumulator_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=accumulate, device=q.device)
    block = _sendable(k, v)
    kv_buffers = _BufferPair(block)
    dkv_buffers = dkv = dkv_pending = None
    for step in range(world):
        kv_pending = kv_received = None
        if step + 1 < world:
            kv_received = kv_buffers.next()
            kv_pending = ring.shift(block, kv_received, _kv_tag(step))
        block_causal = _block_causality(rank, step, world, causal)
        grads = None
        if block_causal is not None:
            grads = _block_backward(dout, q, *block, out, lse, cu_seqlens, max_seqlen, softmax_scale, block_causal,
                                    deterministic)
            dq.add_(grads[0])
        if step == 0:
            # The diagonal block is never skipped, so step 0 always has this rank's gradient of its own block.
            dkv = [grads[1].to(accumulate), grads[2].to(accumulate)]
            dkv_buffers = _BufferPair(dkv)
        else:
            dkv_pending.wait()
            if grads is not None:
                dkv[0].add_(grads[1])
                dkv[1].add_(grads[2])
        if kv_pending is not None:
            kv_pending.wait()
            block = kv_received
        if world > 1:  # on to the next rank, which holds this block at the next step (its owner after the last)
            dkv_received = dkv_buffers.next()
            dkv_pending = ring.shift(dkv, dkv_received, _dkv_tag(step, world))
            dkv = dkv_received
    if dkv_pending is not None:
        dkv_pending.wait()
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, deterministic, ring):
        out, lse = ring_forward_loop(q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, ring)
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.arguments = (max_seqlen, softmax_scale, causal, deterministic, ring)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        max_seqlen, softmax_scale, causal, deterministic, ring = ctx.arguments
        # The kernels read rows with 16-byte accesses: an expanded or transposed gradient is copied first.
        dq, dk, dv = ring_backward_loop(grad_out.contiguous(), q, k, v, out, lse, cu_seqlens, max_seqlen,
                                        softmax_scale, causal, deterministic, ring)
        return dq, dk, dv, None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------------
# Entry points

def _check_tensors(q, k, v, cu_seqlens) -> None:
    for value, name in ((q, "q"), (k, "k"), (v, "v"), (cu_seqlens, "cu_seqlens")):
        if not isinstance(value, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if t.dim() != 3:
            raise ValueError(f"{name} must be THD [total, heads, head_dim], got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k has {k.shape[0]} tokens and q {q.shape[0]}: ring attention is self-attention over one "
                         "split, so q, k and v hold the same chunks of the same sequences")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must be int32 [batch + 1], got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")


def _check_no_window(window_size: Any, causal: bool) -> None:
    left, right = check_window(window_size, causal)  # causal makes the right side 0
    if left != -1 or (not causal and right != -1):
        given = tuple(operator.index(side) for side in window_size)
        raise ValueError(f"window_size={given}: ring attention supports no sliding window yet (pass (-1, -1)); a "
                         "window over the global positions of the chunks is not implemented")


def ring_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, *, softmax_scale: float,
                   causal: bool, deterministic: bool, ring: Ring) -> tuple[Tensor, Tensor]:
    """(out, LSE) of the ring over ``ring`` (any transport with Ring's shape), with autograd when
    q, k or v requires grad; arguments already checked (ring_flash_attn_varlen_func checks them)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _RingAttention.apply(q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, deterministic, ring)
    return ring_forward_loop(q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, ring)


def ring_flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group=None,
):
    """Varlen self-attention with the sequences split over the ranks of ``group`` (the module
    docstring states the sharding contract): this rank's q, k, v chunks [total_local, H, D], the local
    ``cu_seqlens`` (int32 on q's device, global / world size) and ``max_seqlen`` (a host bound on the
    local chunk lengths). Returns this rank's out, or (out, softmax_lse [Hq, total_local], None); with
    autograd through hipattn's backward. Every argument is checked before any communication;
    hipattn's own checks of the tensors run in the first block's call, alike on every rank."""
    if check_dropout_p(dropout_p):
        # A block's dropout mask would need its keys' positions in the whole sequence, as ALiBi's bias.
        raise ValueError(f"ring_flash_attn_varlen_func does not support dropout (dropout_p={dropout_p}); pass "
                         "dropout_p=0.0, or call hipattn.torch.flash_attn_varlen_func on one GPU")
    if check_softcap(softcap) or alibi_slopes is not None:
        # ALiBi's bias needs each block's key positions in the whole sequence, which a block's call does
        # not know; a softcap would go through, but the ring has not been tested with one.
        raise ValueError("ring_flash_attn_varlen_func does not support softcap or alibi_slopes; pass softcap=0.0 "
                         "and alibi_slopes=None, or call hipattn.torch.flash_attn_varlen_func on one GPU")
    _check_tensors(q, k, v, cu_seqlens)
    max_seqlen = check_max_seqlen(max_seqlen, "max_seqlen")
    causal = check_bool(causal, "causal")
    deterministic = check_bool(deterministic, "deterministic")
    return_attn_probs = check_bool(return_attn_probs, "return_attn_probs")
    _check_no_window(window_size, causal)
    scale = float(resolve_softmax_scale(softmax_scale, q.shape[-1]))
    ring = ProcessGroupRing(group)
    out, lse = ring_attention(q, k, v, cu_seqlens, max_seqlen, softmax_scale=scale, causal=causal,
                              deterministic=deterministic, ring=ring)
    return (out, lse, None) if return_attn_probs else out
