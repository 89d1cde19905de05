"""Paged K/V for ``flash_attn_varlen_func``: flash-attn's ``block_table`` argument, gathered into packed
varlen K and V with torch operations before hipattn's varlen kernels run.

flash-attn reads a paged cache in its varlen forward (chunked prefill against a paged cache): k_cache
and v_cache are [num_blocks, page_size, nheads_k, headdim], ``block_table`` int32 [batch, pages]
names sequence b's pages in order, and ``cu_seqlens_k`` gives only the key lengths (key j of sequence b
is row j % page_size of page block_table[b, j // page_size]).

hipattn's flash kernels read K and V as one packed varlen array. This module builds it: row r of the
packed arrays is key r - cu_seqlens_k[b] of the sequence b whose range holds r, gathered from its page.
Everything is worked out on the device from host-known sizes, so the call neither synchronizes nor
stops a CUDA graph from capturing it. The host does not know cu_seqlens_k[-1], so the packed arrays
hold batch * max_seqlen_k rows, the most that the lengths max_seqlen_k bounds can fill. That is the
cost: a copy of the keys the call reads, in arrays of that many rows. Gradients reach the caches
through the gather (pages shared by several sequences sum theirs).

A table entry outside [0, num_blocks) reads the nearest page instead of faulting; so does a row past
every sequence (it is never read).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .problem import check_max_seqlen


def _check(k_cache, v_cache, block_table, cu_seqlens_k, max_seqlen_k: int) -> int:
    """The pages each sequence's max_seqlen_k keys need, after checking the paged arguments' kinds,
    shapes and devices (ValueError or TypeError naming the argument; nothing is enqueued)."""
    for t, name in ((k_cache, "k"), (v_cache, "v"), (block_table, "block_table"), (cu_seqlens_k, "cu_seqlens_k")):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch tensor with block_table (paged KV); got {type(t).__name__}")
    if k_cache.dim() != 4:
        raise ValueError(f"k has shape {tuple(k_cache.shape)}; with block_table it is a paged cache "
                         "[num_blocks, page_size, nheads_k, headdim]")
    if tuple(v_cache.shape[:3]) != tuple(k_cache.shape[:3]) or v_cache.dim() != 4:
        raise ValueError(f"v has shape {tuple(v_cache.shape)}; with block_table it must be a paged cache of k's "
                         f"blocks, page size and heads {tuple(k_cache.shape[:3])}")
    for t, name in ((block_table, "block_table"), (cu_seqlens_k, "cu_seqlens_k")):
        if t.dtype != torch.int32:
            raise TypeError(f"{name} has dtype {t.dtype}; expected int32")
    if block_table.dim() != 2:
        raise ValueError(f"block_table has shape {tuple(block_table.shape)}; expected [batch, pages]")
    if cu_seqlens_k.dim() != 1 or cu_seqlens_k.shape[0] < 1:
        raise ValueError(f"cu_seqlens_k has shape {tuple(cu_seqlens_k.shape)}; expected [batch + 1]")
    batch = cu_seqlens_k.shape[0] - 1
    if block_table.shape[0] != batch:
        raise ValueError(f"block_table has {block_table.shape[0]} rows but cu_seqlens_k describes {batch} sequences; "
                         "give one row per sequence")
    for t, name in ((v_cache, "v"), (block_table, "block_table"), (cu_seqlens_k, "cu_seqlens_k")):
        if t.device != k_cache.device:
            raise ValueError(f"{name} is on {t.device} but k is on {k_cache.device}; the paged call's tensors "
                             "must share one device")
    num_blocks, page_size = k_cache.shape[0], k_cache.shape[1]
    pages = -(-max_seqlen_k // page_size) if page_size else 0
    if max_seqlen_k and (page_size == 0 or num_blocks == 0):
        raise ValueError(f"k has shape {tuple(k_cache.shape)}: no pages to hold max_seqlen_k {max_seqlen_k} keys")
    if pages > block_table.shape[1]:
        raise ValueError(f"max_seqlen_k {max_seqlen_k} needs {pages} pages of {page_size} keys, but block_table rows "
                         f"name {block_table.shape[1]}; give block_table more columns or a smaller max_seqlen_k")
    return pages


def packed_keys_and_values(k_cache: Tensor, v_cache: Tensor, block_table: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_k: int) -> tuple[Tensor, Tensor]:
    """(k, v) packed as a varlen call's keys for cu_seqlens_k, [batch * max_seqlen_k, nheads_k, headdim]
    each, gathered from the paged caches through block_table (see the module docstring)."""
    max_seqlen_k = check_max_seqlen(max_seqlen_k, "max_seqlen_k")
    pages = _check(k_cache, v_cache, block_table, cu_seqlens_k, max_seqlen_k)
    batch, page_size = block_table.shape[0], k_cache.shape[1]
    device = k_cache.device
    rows = torch.arange(batch * max_seqlen_k, device=device)
    starts = cu_seqlens_k.to(torch.long)
    # The sequence whose range holds each row: the last whose start is not past it. Its key there
    # counts only below the length max_seqlen_k bounds (as the kernels bound it); clamps keep malformed
    # offsets indexing inside the arrays. The search runs over every start rather than over the ends
    # (starts[1:]): Inductor's GPU lowering of searchsorted read a sliced sequence from the start of its
    # buffer (torch 2.11), one sequence off for every row.
    sequence = (torch.searchsorted(starts, rows, right=True) - 1).clamp_(0, max(batch - 1, 0))
    key = rows - starts[sequence]
    inside = (key >= 0) & (key < (starts[1:] - starts[:-1]).clamp(0, max_seqlen_k)[sequence])
    key = torch.where(inside, key, 0)
    table = block_table[:, :pages].to(torch.long).clamp(0, max(k_cache.shape[0] - 1, 0))
    page, place = table[sequence, key // page_size], key % page_size

    def gather(cache: Tensor) -> Tensor:
        packed = cache[page, place]  # indexed as it lies: a strided cache is not copied whole
        if cache.requires_grad and torch.is_grad_enabled():
            # The kernels leave dK and dV of rows past every sequence unwritten: none of it may reach a page.
            packed = torch.where(inside[:, None, None], packed, packed.new_zeros(()))
        return packed

    return gather(k_cache), gather(v_cache)
