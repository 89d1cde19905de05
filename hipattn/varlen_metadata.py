"""Per-sequence metadata of a varlen (THD) backward, and the host packer that derives it.

The deterministic backward gives every key block of a sequence its own fp32 slice of ``dq_accum``
(a later pass sums the slices in a fixed order, so the result is bit-identical run to run). Slices
are packed compactly: sequence ``b`` owns ``key_splits[b] * query_length[b]`` rows, starting at
the exclusive prefix sum of that product over the sequences before it. A prefix sum over the batch
is host logic (or a device scan), and it reads ``cu_seqlens``, which lives on the device: this
module is the pure half (numpy in, numpy out); ``varlen_prep`` runs it inside a host function on
the caller's stream.

The record is declared once, below, as a field list. The numpy dtype the packer writes and the
C++ struct a kernel will read (``varlen_record_cpp()``) are both built from it, as the kernel
parameter structs are (``hipattn.params``), so the two sides cannot drift apart.

Lengths are clamped exactly as the kernels' ``sequence_bounds`` clamps them (kernels/common/
sequence.h): a start to ``[0, total]``, a length to ``[0, min(max_seqlen, total - start)]``. So the
records agree with what the kernels see, and every slice fits the ``dq_accum`` the host sized from
its own facts (``dq_accum_rows``). Well-formed ``cu_seqlens`` (non-decreasing, within the totals)
always fit; for malformed ones whose slices would run past that bound, the sequences that do not
fit get ``query_length`` 0 (the kernels do nothing for them) and their offset is clamped to the
bound: wrong numbers for those sequences, never an out-of-bounds write.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .params import ParamsStruct

INT32_MAX = 2**31 - 1

# One record per sequence, every field int32 (token and row counts; cu_seqlens are int32 too).
VARLEN_RECORD = ParamsStruct(
    "VarlenSequenceRecord",
    (
        ("query_start", "i32"),  # first query token of the sequence (clamped cu_seqlens_q[b])
        ("query_length", "i32"),  # query tokens (clamped; 0 when the slice did not fit, see above)
        ("key_start", "i32"),  # first key token (clamped cu_seqlens_k[b])
        ("key_length", "i32"),  # key tokens (clamped)
        ("key_splits", "i32"),  # key blocks: ceil(key_length / block_n)
        ("dq_accum_row_offset", "i32"),  # first row of the sequence's dq_accum slice (rows of heads_q * head_dim fp32)
    ),
)
if any(kind != "i32" for _, kind in VARLEN_RECORD.fields):  # pragma: no cover - a guard for future edits
    raise TypeError("VARLEN_RECORD's fields must all be i32: the packer and the copies treat it as int32 words")

VARLEN_RECORD_DTYPE = np.dtype([(name, np.int32) for name, _ in VARLEN_RECORD.fields])
VARLEN_RECORD_BYTES = VARLEN_RECORD_DTYPE.itemsize
if VARLEN_RECORD_BYTES != VARLEN_RECORD.nbytes:  # pragma: no cover - numpy and the C layout must agree
    raise TypeError(f"VARLEN_RECORD: numpy itemsize {VARLEN_RECORD_BYTES} != C size {VARLEN_RECORD.nbytes}")


def varlen_record_cpp() -> str:
    """The C++ declaration of one record, for a kernel that reads the metadata (none does yet).

    Prepend it to a compile unit as the kernel parameter structs are (``sources.compile_unit``), so
    it is part of the cache key too.
    """
    return (
        "namespace hipattn {\n"
        f"{VARLEN_RECORD.cpp_declaration()}"
        f'static_assert(sizeof({VARLEN_RECORD.name}) == {VARLEN_RECORD_BYTES}, "hipattn.varlen_metadata layout");\n'
        "}  // namespace hipattn\n"
    )


def key_block_splits(max_seqlen_k: int, block_n: int) -> int:
    """Key blocks of ``block_n`` keys that cover ``max_seqlen_k`` keys: the split count's host bound."""
    if isinstance(block_n, bool) or not isinstance(block_n, int) or block_n < 1:
        raise ValueError(f"block_n must be a positive int (a kernel's BLOCK_N from its tile table); got {block_n!r}")
    return -(-max_seqlen_k // block_n)


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

    def dq_accum_rows(self, block_n: int) -> int:
        """Rows of the deterministic dq_accum: every query row may need one slot per key block."""
        return key_block_splits(self.max_seqlen_k, block_n) * self.total_q


def _limits_of(cu_seqlens_q: np.ndarray, cu_seqlens_k: np.ndarray) -> SequenceLimits:
    """The tightest limits well-formed cu_seqlens (batch >= 1) satisfy: the packer's default."""

    def bounds(cu: np.ndarray) -> tuple[int, int]:
        return max(int(np.max(np.diff(cu.astype(np.int64)))), 0), max(int(cu[-1]), 0)

    max_q, total_q = bounds(cu_seqlens_q)
    max_k, total_k = bounds(cu_seqlens_k)
    return SequenceLimits(max_q, max_k, total_q, total_k)


def _clamped(cu: np.ndarray, max_seqlen: int, total: int) -> tuple[np.ndarray, np.ndarray]:
    """(start, length) per sequence, as sequence_bounds clamps them; int64 so garbage cannot overflow."""
    cu = cu.astype(np.int64)
    start = np.clip(cu[:-1], 0, total)
    length = np.clip(cu[1:] - cu[:-1], 0, None)
    length = np.minimum(length, np.minimum(max_seqlen, total - start))
    return start, length


def pack_split_offsets(cu_seqlens_q: np.ndarray, cu_seqlens_k: np.ndarray, block_n: int, out: np.ndarray,
                       limits: SequenceLimits | None = None) -> np.ndarray:
    """Fill ``out`` (``batch`` records of VARLEN_RECORD_DTYPE) from int32 ``cu_seqlens`` of length batch + 1.

    ``limits`` are the host's promises (``SequenceLimits.of(problem)``); without them the
    cu_seqlens are trusted as they are. Returns ``out``. Pure numpy, no allocation beyond
    temporaries and no runtime call: it runs inside a host function.
    """
    batch = len(cu_seqlens_q) - 1
    if batch < 0 or len(cu_seqlens_k) != batch + 1:
        raise ValueError(
            f"cu_seqlens_q ({len(cu_seqlens_q)}) and cu_seqlens_k ({len(cu_seqlens_k)}) must both have batch + 1 entries"
        )
    if out.dtype != VARLEN_RECORD_DTYPE or out.shape != (batch,):
        raise ValueError(f"out must be {batch} records of VARLEN_RECORD_DTYPE; got {out.dtype} {out.shape}")
    if batch == 0:
        return out
    if limits is None:
        limits = _limits_of(cu_seqlens_q, cu_seqlens_k)
    capacity = limits.dq_accum_rows(block_n)
    if capacity > INT32_MAX:
        raise ValueError(
            f"the deterministic dq_accum would have {capacity} rows; its int32 row offsets reach {INT32_MAX}"
        )
    query_start, query_length = _clamped(cu_seqlens_q, limits.max_seqlen_q, limits.total_q)
    key_start, key_length = _clamped(cu_seqlens_k, limits.max_seqlen_k, limits.total_k)
    key_splits = (key_length + (block_n - 1)) // block_n
    rows = key_splits * query_length
    end = np.cumsum(rows)
    offset = end - rows
    overflow = end > capacity  # only malformed cu_seqlens get here (see the module docstring)
    query_length[overflow] = 0
    np.minimum(offset, capacity, out=offset)
    out["query_start"] = query_start
    out["query_length"] = query_length
    out["key_start"] = key_start
    out["key_length"] = key_length
    out["key_splits"] = key_splits
    out["dq_accum_row_offset"] = offset
    return out
