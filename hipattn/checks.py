"""HIPATTN_CHECK=1: validate what only the device knows, at the cost of a synchronize.

Host-side validation (problem.py) cannot see the contents of cu_seqlens or seqused without
reading device memory, which the launch path never does. The kernels stay memory-safe whatever those
arrays hold (they clamp every start and length to what the host promised), but a malformed
cu_seqlens or a max_seqlen smaller than a real sequence silently gives wrong numbers. With
HIPATTN_CHECK=1 each call copies these arrays to the host on its launch stream, waits for that
stream, and raises DeviceContentError (a ValueError) naming the first bad sequence; KV-cache calls have
their cache_seqlens, batch indices, left padding and block table checked against the cache the same
way. This blocks the host on every call and cannot run under graph capture: a debugging aid, off by
default.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping

import numpy as np

from . import env
from .backends.base import Backend
from .device_array import DeviceArray, derived_array
from .errors import DeviceContentError
from .problem import THD, Problem

SWITCH = "HIPATTN_CHECK"


def enabled() -> bool:
    """Whether HIPATTN_CHECK is on (read now): an on/off switch as env.flag reads it, off by default."""
    return env.flag(SWITCH, False)


def _to_host(backend: Backend, stream: int, array: DeviceArray) -> np.ndarray:
    """A host copy of a contiguous int32 device array, read after the stream's earlier work."""
    count = array.shape[0]
    if count == 0:
        return np.zeros(0, dtype=np.int32)
    nbytes = count * 4
    pinned = backend.host_alloc(nbytes)
    try:
        backend.memcpy_async(pinned, array.ptr, nbytes, stream)
        backend.stream_synchronize(stream)
        return np.frombuffer((ctypes.c_int32 * count).from_address(pinned), dtype=np.int32).copy()
    finally:
        backend.host_free(pinned)


def _check_cu_seqlens(values: np.ndarray, name: str, total: int, max_seqlen: int) -> None:
    if values[0] != 0:
        raise DeviceContentError(f"{name}[0] is {values[0]}; cu_seqlens must start at 0 (HIPATTN_CHECK)")
    lengths = np.diff(values.astype(np.int64))
    bad = np.flatnonzero(lengths < 0)
    if bad.size:
        b = int(bad[0])
        raise DeviceContentError(f"{name} decreases at sequence {b}: {values[b]} then {values[b + 1]}; it must be non-decreasing (HIPATTN_CHECK)")
    if values[-1] > total:
        raise DeviceContentError(f"{name}[-1] is {values[-1]} but the tensor has {total} tokens (HIPATTN_CHECK)")
    _check_lengths(lengths, name, max_seqlen)


def _check_lengths(lengths: np.ndarray, name: str, max_seqlen: int) -> None:
    too_long = np.flatnonzero(lengths > max_seqlen)
    if too_long.size:
        b = int(too_long[0])
        bound = name.replace("cu_seqlens", "max_seqlen").replace("seqused", "max_seqlen")
        raise DeviceContentError(
            f"sequence {b} has {int(lengths[b])} tokens by {name} but {bound} is {max_seqlen}; "
            f"pass a {bound} at least as large as every sequence (HIPATTN_CHECK)"
        )
    negative = np.flatnonzero(lengths < 0)
    if negative.size:
        b = int(negative[0])
        raise DeviceContentError(f"{name}[{b}] is {int(lengths[b])}; lengths must be >= 0 (HIPATTN_CHECK)")


def check_sequences(backend: Backend, stream: int, problem: Problem,
                    sequences: Mapping[str, DeviceArray | None]) -> None:
    """Raise ValueError if the device-side sequence description breaks the host's promises.

    ``sequences`` holds the call's cu_seqlens_q/k and seqused_q/k by name (None, or absent, where not
    given), as the launch path carries them."""
    if problem.layout == THD:
        for name, total, bound in (("cu_seqlens_q", problem.total_q, problem.max_seqlen_q),
                                   ("cu_seqlens_k", problem.total_k, problem.max_seqlen_k)):
            _check_cu_seqlens(_to_host(backend, stream, sequences.get(name)), name, total, bound)
    for name, bound in (("seqused_q", problem.max_seqlen_q), ("seqused_k", problem.max_seqlen_k)):
        array = sequences.get(name)
        if array is not None:
            _check_lengths(_to_host(backend, stream, array).astype(np.int64), name, bound)


def check_kvcache(backend: Backend, stream: int, call) -> None:
    """Raise DeviceContentError if a KV-cache call's device arrays (``call``: a
    kvcache_problem.KvCacheCall) break what its cache holds: every sequence's cache_seqlens plus the
    new tokens within the capacity, batch indices among the cache's entries, left padding within the
    sequence, and the block table's pages that those tokens use among the cache's pages."""
    p = call.problem
    where = "the pages the block_table gives each sequence" if call.block_table is not None else "the cache"
    if call.cache_seqlens is not None:
        lengths = _to_host(backend, stream, call.cache_seqlens).astype(np.int64)
    else:
        lengths = np.full(p.batch, p.cache_seqlen, dtype=np.int64)
    for b, length in enumerate(lengths):
        if length < 0 or length + p.seqlen_new > p.capacity:
            raise DeviceContentError(
                f"cache_seqlens[{b}] is {length}: with {p.seqlen_new} new tokens that does not fit the {p.capacity} "
                f"tokens of {where} (HIPATTN_CHECK)")
    if call.cache_batch_idx is not None:
        entries = _to_host(backend, stream, call.cache_batch_idx)
        bad = np.flatnonzero((entries < 0) | (entries >= p.cache_entries))
        if bad.size:
            b = int(bad[0])
            raise DeviceContentError(f"cache_batch_idx[{b}] is {entries[b]}; k_cache has {p.cache_entries} entries "
                                     "(HIPATTN_CHECK)")
    if call.cache_leftpad is not None:
        starts = _to_host(backend, stream, call.cache_leftpad).astype(np.int64)
        bad = np.flatnonzero((starts < 0) | (starts > lengths + p.seqlen_new))
        if bad.size:
            b = int(bad[0])
            raise DeviceContentError(f"cache_leftpad[{b}] is {starts[b]}; it must be within the sequence's "
                                     f"{lengths[b] + p.seqlen_new} tokens (HIPATTN_CHECK)")
    if call.block_table is not None:
        table = call.block_table
        rows = table.strides[0]
        flat = _to_host(backend, stream, _rows_as_vector(table, rows))
        for b, length in enumerate(lengths):
            used = flat[b * rows:b * rows + -(-(int(length) + p.seqlen_new) // p.page_size)]
            bad = np.flatnonzero((used < 0) | (used >= p.cache_entries))
            if bad.size:
                raise DeviceContentError(f"block_table[{b}, {int(bad[0])}] is {used[bad[0]]}; k_cache has "
                                         f"{p.cache_entries} pages (HIPATTN_CHECK)")


def _rows_as_vector(table: DeviceArray, row_stride: int) -> DeviceArray:
    """An int32 [B, P] array with row stride ``row_stride`` as the vector of B * row_stride elements
    from its first one (what a copy to the host reads)."""
    count = (table.shape[0] - 1) * row_stride + table.shape[1] if table.shape[0] else 0
    return derived_array(table, table.ptr, (count,), (1,), "int32", table.owner)
