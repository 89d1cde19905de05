"""Stream-async preparation of the varlen backward's metadata (DESIGN.md, seed 000_2d4a19ef11f4b7a1).

The records (hipattn.varlen_metadata) are derived from ``cu_seqlens``, which live on the device,
and the host must not block to read them. ``prepare_varlen_metadata_async`` enqueues on the
caller's stream, in this order:

1. two async copies: ``cu_seqlens_q`` and ``cu_seqlens_k``, device -> pinned block A;
2. a Python host function: ``pack_split_offsets`` reads A and writes the records into pinned block B;
3. an async copy: B -> the workspace's ``varlen_metadata`` section on the device;
4. ``pool.release_after(stream, A, B)``: a ``sem_post`` at the stream's tail returns both blocks to
   the pool once the stream has passed step 3 (pinned.PinnedPool's keepalive).

Kernels enqueued afterwards on the same stream see the records. Nothing synchronizes. The host
function touches only numpy views of pinned memory: no runtime call, no device memory, nothing
whose finaliser could call the runtime. Zeroing ``dq_accum`` is the caller's (ops.preprocess),
before or after this, on the same stream.

Graph capture. Captured, the four steps become graph nodes that replay as a unit: each replay
copies the *current* contents of the same ``cu_seqlens`` device buffers, packs, and copies the new
records out. ``launch_python_host_func`` keeps a captured host function for the life of the process
(a graph may replay it at any time), and the pool makes blocks released during capture
graph-owned: never recycled, since every replay copies into and out of them again. A capture in
global mode (PyTorch's default) forbids allocating pinned memory, so call ``reserve_blocks`` before
capturing.

The GIL. Step 2 is Python and runs on the runtime's callback thread: while it is pending, no thread
may wait on this stream while holding the GIL (both bindings release it in their blocking calls).

The device alternative (DESIGN.md: build both, measure, default to the faster). A small kernel can
derive the same records: one block walks the batch in chunks, clamps each sequence as
``sequence_bounds`` does, and carries an exclusive block-wide scan of ``key_splits * query_length``
from chunk to chunk, writing ``VarlenSequenceRecord`` (declared by ``varlen_record_cpp()``, prepended
to its compile unit) into the same ``varlen_metadata`` section. It would replace steps 1-4 with one
launch (no pinned blocks, no host function, no GIL, nothing special under capture) and sit beside
this function as ``prepare_varlen_metadata_on_device`` with the same arguments minus ``pool``, tested
against ``pack_split_offsets``. This host path stays, working and tested, for metadata that needs
host logic.
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np

from .backends.base import Backend
from .pinned import PinnedBlock, PinnedPool, launch_python_host_func, size_class
from .varlen_metadata import (
    INT32_MAX,
    VARLEN_RECORD_BYTES,
    VARLEN_RECORD_DTYPE,
    SequenceLimits,
    pack_split_offsets,
)

logger = logging.getLogger("hipattn")

_INT32_BYTES = 4


def block_bytes(batch: int) -> tuple[int, int]:
    """(bytes of block A: both cu_seqlens, bytes of block B: the records) for ``batch`` sequences."""
    return 2 * (batch + 1) * _INT32_BYTES, batch * VARLEN_RECORD_BYTES


def reserve_blocks(pool: PinnedPool, batch: int, calls: int = 1) -> None:
    """Make sure ``calls`` preparations of ``batch`` sequences can acquire their blocks without
    allocating: required before a stream capture in global mode."""
    if batch == 0:
        return
    for size, count in Counter(size_class(n) for n in block_bytes(batch)).items():
        pool.reserve(size, count * calls)


def prepare_varlen_metadata_async(
    backend: Backend,
    pool: PinnedPool,
    stream: int,
    cu_seqlens_q: int,
    cu_seqlens_k: int,
    batch: int,
    block_n: int,
    metadata_ptr: int,
    *,
    limits: SequenceLimits,
) -> None:
    """Enqueue the metadata of ``batch`` sequences into ``metadata_ptr`` on ``stream`` (module docstring).

    ``cu_seqlens_q``/``cu_seqlens_k`` are device pointers to ``batch + 1`` int32 each;
    ``metadata_ptr`` is the device address of the workspace's ``varlen_metadata`` section
    (``plan.pointer(base, "varlen_metadata")``); ``block_n`` is the backward kernel's BLOCK_N and
    ``limits`` the host's promises (``SequenceLimits.of(problem)``), against which the records are
    clamped. The current device must be the stream's. Batch 0 enqueues nothing.
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
        raise ValueError(f"batch must be an int >= 0; got {batch!r}")
    rows = limits.dq_accum_rows(block_n)  # also validates block_n, before anything is enqueued
    if rows > INT32_MAX:
        raise ValueError(f"the deterministic dq_accum would have {rows} rows; its int32 row offsets reach {INT32_MAX}")
    if batch == 0:
        return
    input_bytes, record_bytes = block_bytes(batch)
    seqlens_bytes = input_bytes // 2
    inputs = pool.acquire(input_bytes)
    try:
        records_block = pool.acquire(record_bytes)
    except BaseException:
        pool.release(inputs)
        raise
    # Views made here, on the main thread; the host function only reads and writes through them.
    words = inputs.array[:input_bytes].view(np.int32)
    host_cu_seqlens_q, host_cu_seqlens_k = words[: batch + 1], words[batch + 1 :]
    records = records_block.array[:record_bytes].view(VARLEN_RECORD_DTYPE)

    def pack() -> None:
        pack_split_offsets(host_cu_seqlens_q, host_cu_seqlens_k, block_n, records, limits)

    enqueued = False
    try:
        backend.memcpy_async(inputs.ptr, cu_seqlens_q, seqlens_bytes, stream)
        enqueued = True
        backend.memcpy_async(inputs.ptr + seqlens_bytes, cu_seqlens_k, seqlens_bytes, stream)
        launch_python_host_func(backend, stream, pack)
        backend.memcpy_async(metadata_ptr, records_block.ptr, record_bytes, stream)
    except BaseException:
        if enqueued:
            _abandon(pool, stream, inputs, records_block)
        else:
            pool.release(inputs, records_block)
        raise
    pool.release_after(stream, inputs, records_block)


def _abandon(pool: PinnedPool, stream: int, *blocks: PinnedBlock) -> None:
    """After a failed enqueue, the stream may still use ``blocks``: hand them back in stream order,
    or, if even that fails, keep them held for good (a leak, never a block reused under a copy)."""
    try:
        pool.release_after(stream, *blocks)
    except Exception:
        logger.warning("hipattn: could not enqueue the keepalive of %d pinned blocks; they are leaked", len(blocks))
