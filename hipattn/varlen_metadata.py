"""The varlen (THD) backward's work list: one record per sequence, and the host packer that derives it.

The dK/dV kernel runs one block per (key block of BLOCK_N keys, sequence, KV head). In BSHD mode
every sequence may have ``ceil(max_seqlen_k / BLOCK_N)`` key blocks and the grid says so. In THD
mode the lengths live on the device, and a grid sized from ``max_seqlen_k`` for every sequence
leaves most blocks idle when lengths are mixed. Instead the kernel walks a compact list: the key
blocks of sequence 0, then those of sequence 1, and so on. A sequence's record says where it is
(``query_start``/``query_length``, ``key_start``/``key_length``) and where its blocks start in the
list (``first_key_block``, the exclusive prefix sum over the sequences before it of
``ceil(key_length / block_n)``); a block of the kernel finds its sequence by a binary search over
``first_key_block`` (``key_block_of`` in kernels/flash/backward_mma.hip). A prefix sum over the batch
reads ``cu_seqlens``, which live on the device: this module is the pure half (numpy in, numpy out);
``varlen_prep`` derives the same records on the caller's stream, with this packer inside a host
function or with a small kernel (kernels/flash/varlen_records.hip), bit for bit alike.

The record is declared once, below, as a field list. The numpy dtype the packer writes and the C++
struct the kernels read are both built from it (the kernel families that use it list it in
``KernelFamily.structs``; ``sources.compile_unit`` declares it, so it is part of the cache key).

Lengths are clamped exactly as the kernels' ``sequence_bounds`` clamps them (kernels/common/
sequence.h): ``seqused`` replaces the ``cu_seqlens`` difference when given, a start is clamped to
``[0, total]``, a length to ``[0, min(max_seqlen, total - start)]``. So the records agree with what
the kernels see.

The grid is sized on the host, from ``key_block_bound``: the smaller of ``ceil(total_k / block_n) +
batch`` (every sequence wastes less than one block) and ``batch * ceil(max_seqlen_k / block_n)`` (no
sequence has more). Well-formed ``cu_seqlens`` (non-decreasing, within the totals) always fit. For
malformed ones (overlapping sequences) whose blocks would pass the bound, the sequences from the
first one that does not fit get ``key_length`` 0, so no blocks: wrong numbers for those sequences,
never a block outside the grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .jit.params import ParamsStruct

INT32_MAX = 2**31 - 1

# One record per sequence, every field int32 (token and block counts; cu_seqlens are int32 too).
VARLEN_RECORD = ParamsStruct(
    "VarlenSequenceRecord",
    (
        ("query_start", "i32"),  # first query token of the sequence (clamped cu_seqlens_q[b])
        ("query_length", "i32"),  # query tokens (clamped; seqused_q[b] when given)
        ("key_start", "i32"),  # first key token (clamped cu_seqlens_k[b])
        ("key_length", "i32"),  # key tokens (clamped; 0 when the sequence's blocks did not fit the bound)
        ("first_key_block", "i32"),  # the sequence's first key block in the work list
    ),
)
if any(kind != "i32" for _, kind in VARLEN_RECORD.fields):  # pragma: no cover - a guard for future edits
    raise TypeError("VARLEN_RECORD's fields must all be i32: the packer and the copies treat it as int32 words")

VARLEN_RECORD_DTYPE = np.dtype([(name, np.int32) for name, _ in VARLEN_RECORD.fields])
VARLEN_RECORD_BYTES = VARLEN_RECORD_DTYPE.itemsize
VARLEN_RECORD_WORDS = len(VARLEN_RECORD.fields)
if VARLEN_RECORD_BYTES != VARLEN_RECORD.nbytes:  # pragma: no cover - numpy and the C layout must agree
    raise TypeError(f"VARLEN_RECORD: numpy itemsize {VARLEN_RECORD_BYTES} != C size {VARLEN_RECORD.nbytes}")


def varlen_record_cpp() -> str:
    """The C++ declaration of one record, as ``sources.compile_unit`` emits it for a kernel family."""
    return f"namespace hipattn {{\n{VARLEN_RECORD.cpp_checked_declaration()}}}  // namespace hipattn\n"


def key_blocks(keys: int, block_n: int) -> int:
    """Key blocks of ``block_n`` keys that cover ``keys`` keys."""
    if isinstance(block_n, bool) or not isinstance(block_n, int) or block_n < 1:
        raise ValueError(f"block_n must be a positive int (a kernel's BLOCK_N from its tile table); got {block_n!r}")
    return -(-keys // block_n)


@dataclass(frozen=True)
class SequenceLimits:
    """What the host promised about the sequences (problem.Problem's fields of the same names)."""

    max_seqlen_q: int
    max_seqlen_k: int
    total_q: int
    total_k: int

    @classmethod
    def of(cls, problem) -> SequenceLimits:
        return cls(problem.max_seqlen_q, problem.max_seqlen_k, problem.total_q, problem.total_k)


def key_block_bound(limits: SequenceLimits, batch: int, block_n: int) -> int:
    """The work list's length bound, from host facts: what the dK/dV grid covers (times heads_kv).

    ``ceil(total_k / block_n) + batch`` holds for well-formed cu_seqlens (each sequence's last block
    is its only partial one); ``batch * ceil(max_seqlen_k / block_n)`` holds always (lengths are
    clamped to max_seqlen_k) and is the tighter one for batches of short sequences.
    """
    return min(key_blocks(limits.total_k, block_n) + batch, batch * key_blocks(limits.max_seqlen_k, block_n))


def check_key_block_bound(limits: SequenceLimits, batch: int, block_n: int) -> int:
    """``key_block_bound``, refused when the records' int32 block indices cannot reach it."""
    bound = key_block_bound(limits, batch, block_n)
    if bound > INT32_MAX:
        raise ValueError(
            f"the varlen work list may hold {bound} key blocks (total_k {limits.total_k}, batch {batch}, "
            f"block_n {block_n}); its int32 block indices reach {INT32_MAX}"
        )
    return bound


def _limits_of(cu_seqlens_q: np.ndarray, cu_seqlens_k: np.ndarray) -> SequenceLimits:
    """The tightest limits well-formed cu_seqlens (batch >= 1) satisfy: the packer's default."""

    def bounds(cu: np.ndarray) -> tuple[int, int]:
        return max(int(np.max(np.diff(cu.astype(np.int64)))), 0), max(int(cu[-1]), 0)

    max_q, total_q = bounds(cu_seqlens_q)
    max_k, total_k = bounds(cu_seqlens_k)
    return SequenceLimits(max_q, max_k, total_q, total_k)


def _clamped(cu: np.ndarray, seqused: np.ndarray | None, max_seqlen: int, total: int) -> tuple[np.ndarray, np.ndarray]:
    """(start, length) per sequence, as sequence_bounds clamps them; int64 so garbage cannot overflow."""
    cu = cu.astype(np.int64)
    start = np.clip(cu[:-1], 0, total)
    length = seqused.astype(np.int64) if seqused is not None else cu[1:] - cu[:-1]
    np.clip(length, 0, None, out=length)
    np.minimum(length, np.minimum(max_seqlen, total - start), out=length)
    return start, length


def pack_varlen_records(cu_seqlens_q: np.ndarray, cu_seqlens_k: np.ndarray, block_n: int, out: np.ndarray,
                        limits: SequenceLimits | None = None, seqused_q: np.ndarray | None = None,
                        seqused_k: np.ndarray | None = None) -> np.ndarray:
    """Fill ``out`` (``batch`` records of VARLEN_RECORD_DTYPE) from int32 ``cu_seqlens`` of length batch + 1.

    ``block_n`` is the dK/dV kernel's BLOCK_N; ``seqused_q``/``seqused_k`` (int32, ``batch`` each)
    are the optional per-sequence lengths the kernels honour; ``limits`` are the host's promises
    (``SequenceLimits.of(problem)``), without which the cu_seqlens are trusted as they are. Returns
    ``out``. Pure numpy, no allocation beyond temporaries and no runtime call: it runs inside a host
    function.
    """
    batch = len(cu_seqlens_q) - 1
    if batch < 0 or len(cu_seqlens_k) != batch + 1:
        raise ValueError(
            f"cu_seqlens_q ({len(cu_seqlens_q)}) and cu_seqlens_k ({len(cu_seqlens_k)}) must both have batch + 1 entries"
        )
    for name, used in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if used is not None and len(used) != batch:
            raise ValueError(f"{name} has {len(used)} entries; expected batch = {batch}")
    if out.dtype != VARLEN_RECORD_DTYPE or out.shape != (batch,):
        raise ValueError(f"out must be {batch} records of VARLEN_RECORD_DTYPE; got {out.dtype} {out.shape}")
    key_blocks(0, block_n)  # validates block_n, also for batch 0
    if batch == 0:
        return out
    if limits is None:
        limits = _limits_of(cu_seqlens_q, cu_seqlens_k)
    bound = check_key_block_bound(limits, batch, block_n)
    query_start, query_length = _clamped(cu_seqlens_q, seqused_q, limits.max_seqlen_q, limits.total_q)
    key_start, key_length = _clamped(cu_seqlens_k, seqused_k, limits.max_seqlen_k, limits.total_k)
    blocks = (key_length + (block_n - 1)) // block_n
    # The running sum never decreases, so the sequences past the bound are a suffix; only malformed
    # cu_seqlens get there (see the module docstring). They keep no blocks and no keys.
    overflow = np.cumsum(blocks) > bound
    blocks[overflow] = 0
    key_length[overflow] = 0
    out["query_start"] = query_start
    out["query_length"] = query_length
    out["key_start"] = key_start
    out["key_length"] = key_length
    out["first_key_block"] = np.cumsum(blocks) - blocks
    return out
