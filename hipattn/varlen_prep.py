"""Stream-async preparation of the varlen backward's work list (docs/ARCHITECTURE.md, "The varlen
preparation").

The records (hipattn.varlen_metadata) are derived from ``cu_seqlens`` (and ``seqused``, when given),
which live on the device, and the host must not block to read them. Two ways, both enqueued on the
caller's stream before the kernels that read the records, neither synchronizing, and bit for bit
alike:

- ``prepare_varlen_metadata_on_device``: one launch of the ``varlen_records`` kernel
  (kernels/flash/varlen_records.hip; one block walks the batch with a block-wide scan). No pinned
  memory, no host function, nothing special under graph capture.
- ``prepare_varlen_metadata_async``, the host path:

  1. async copies: ``cu_seqlens_q``, ``cu_seqlens_k`` (and ``seqused_q``/``seqused_k``), device ->
     pinned block A;
  2. a Python host function: ``pack_varlen_records`` reads A and writes the records into pinned
     block B;
  3. an async copy: B -> the workspace's ``varlen_records`` section on the device;
  4. ``pool.release_after(stream, A, B)``: a ``sem_post`` at the stream's tail returns both blocks
     to the pool once the stream has passed step 3 (pinned.PinnedPool's keepalive).

  The host function touches only numpy views of pinned memory: no runtime call, no device memory,
  nothing whose finaliser could call the runtime. Captured into a graph, the four steps replay as a
  unit: each replay copies the *current* contents of the same device buffers, packs, and copies
  the new records out. ``launch_python_host_func`` keeps a captured host function for the life of
  the process, and the pool makes blocks released during capture graph-owned (never recycled). A
  capture in global mode (PyTorch's default) forbids allocating pinned memory, so call
  ``reserve_blocks`` before capturing. The GIL: step 2 is Python and runs on the runtime's callback
  thread; while it is pending, no thread may wait on this stream while holding the GIL (both
  bindings release it in their blocking calls).

``prepare_varlen_records`` is what the backward launcher calls: it reads ``HIPATTN_VARLEN_PREP``
(``device``, the default, or ``host``) on every call and takes the host path's pool from
``pinned.device_pool``.
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np

from . import env, runtime
from .backends.base import Backend
from .catalog.varlen import VARLEN_RECORDS_BLOCK_THREADS, records_spec
from .pinned import PinnedBlock, PinnedPool, device_pool, launch_python_host_func, size_class
from .varlen_metadata import (
    VARLEN_RECORD_BYTES,
    VARLEN_RECORD_DTYPE,
    SequenceLimits,
    check_key_block_bound,
    pack_varlen_records,
)

logger = logging.getLogger("hipattn")

_INT32_BYTES = 4

# HIPATTN_VARLEN_PREP=device|host picks the preparation; read on every call.
PREP_SWITCH = "HIPATTN_VARLEN_PREP"
PREP_WAYS = ("device", "host")
DEFAULT_PREP = "device"


def block_bytes(batch: int) -> tuple[int, int]:
    """(bytes of block A: both cu_seqlens and room for both seqused, bytes of block B: the records).

    Block A always has room for the seqused arrays, so one size class serves every call of a batch
    size (``reserve_blocks`` need not know which arrays a call passes)."""
    return (2 * (batch + 1) + 2 * batch) * _INT32_BYTES, batch * VARLEN_RECORD_BYTES


def reserve_blocks(pool: PinnedPool, batch: int, calls: int = 1) -> None:
    """Make sure ``calls`` host-path preparations of ``batch`` sequences can acquire their blocks
    without allocating: required before a stream capture in global mode."""
    if batch == 0:
        return
    for size, count in Counter(size_class(n) for n in block_bytes(batch)).items():
        pool.reserve(size, count * calls)


def _check_arguments(batch: int, block_n: int, limits: SequenceLimits) -> int:
    """Validate before anything is enqueued; returns the work list's bound."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
        raise ValueError(f"batch must be an int >= 0; got {batch!r}")
    return check_key_block_bound(limits, batch, block_n)  # also validates block_n


def prepare_varlen_metadata_async(
    backend: Backend,
    pool: PinnedPool,
    stream: int,
    cu_seqlens_q: int,
    cu_seqlens_k: int,
    batch: int,
    block_n: int,
    records_ptr: int,
    *,
    limits: SequenceLimits,
    seqused_q: int = 0,
    seqused_k: int = 0,
) -> None:
    """The host path: enqueue the records of ``batch`` sequences into ``records_ptr`` on ``stream``.

    ``cu_seqlens_q``/``cu_seqlens_k`` are device pointers to ``batch + 1`` int32 each, and
    ``seqused_q``/``seqused_k`` to ``batch`` int32 each, or 0 when absent; ``records_ptr`` is the
    device address of the workspace's ``varlen_records`` section; ``block_n`` is the dK/dV kernel's
    BLOCK_N and ``limits`` the host's promises (``SequenceLimits.of(problem)``), against which the
    records are clamped. The current device must be the stream's. Batch 0 enqueues nothing.
    """
    _check_arguments(batch, block_n, limits)
    if batch == 0:
        return
    input_bytes, record_bytes = block_bytes(batch)
    inputs = pool.acquire(input_bytes)
    try:
        records_block = pool.acquire(record_bytes)
    except BaseException:
        pool.release(inputs)
        raise
    # Views made here, on the main thread; the host function only reads and writes through them.
    words = inputs.array[:input_bytes].view(np.int32)
    # (device pointer or 0, first word in block A, words) per array; block A keeps room for all four.
    copies = []
    offset = 0
    for ptr, count in ((cu_seqlens_q, batch + 1), (cu_seqlens_k, batch + 1), (seqused_q, batch), (seqused_k, batch)):
        copies.append((ptr, offset, count))
        offset += count
    host_cu_q, host_cu_k, host_used_q, host_used_k = (
        words[first : first + count] if ptr else None for ptr, first, count in copies)
    records = records_block.array[:record_bytes].view(VARLEN_RECORD_DTYPE)

    def pack() -> None:
        pack_varlen_records(host_cu_q, host_cu_k, block_n, records, limits, host_used_q, host_used_k)

    enqueued = False
    try:
        for ptr, first, count in copies:
            if ptr:
                backend.memcpy_async(inputs.ptr + first * _INT32_BYTES, ptr, count * _INT32_BYTES, stream)
                enqueued = True
        launch_python_host_func(backend, stream, pack)
        backend.memcpy_async(records_ptr, records_block.ptr, record_bytes, stream)
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


def prepare_varlen_metadata_on_device(
    backend: Backend,
    stream: int,
    cu_seqlens_q: int,
    cu_seqlens_k: int,
    batch: int,
    block_n: int,
    records_ptr: int,
    *,
    limits: SequenceLimits,
    seqused_q: int = 0,
    seqused_k: int = 0,
    device: int | None = None,
) -> None:
    """The device path: one ``varlen_records`` launch on ``stream``; the host path's arguments
    minus the pool. ``device`` is the current device (the stream's), asked of the backend when not
    given. Batch 0 enqueues nothing."""
    bound = _check_arguments(batch, block_n, limits)
    if batch == 0:
        return
    kernel = runtime.active().kernel(records_spec(), backend.get_device() if device is None else device)
    params = kernel.params.from_dict({
        "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, "seqused_q": seqused_q, "seqused_k": seqused_k,
        "records": records_ptr, "batch": batch, "max_seqlen_q": limits.max_seqlen_q,
        "max_seqlen_k": limits.max_seqlen_k, "total_q": limits.total_q, "total_k": limits.total_k,
        "block_n": block_n, "key_block_bound": bound,
    })  # fmt: skip
    kernel.launch((1, 1, 1), (VARLEN_RECORDS_BLOCK_THREADS, 1, 1), 0, stream, params)


def prep_way() -> str:
    """``HIPATTN_VARLEN_PREP``'s value (read now), or the default."""
    return env.choice(PREP_SWITCH, PREP_WAYS, DEFAULT_PREP)


def prepare_varlen_records(backend: Backend, stream: int, device: int, cu_seqlens_q: int, cu_seqlens_k: int,
                           batch: int, block_n: int, records_ptr: int, *, limits: SequenceLimits,
                           seqused_q: int = 0, seqused_k: int = 0, way: str | None = None) -> None:
    """Enqueue the records on ``stream`` the ``way`` given (one of PREP_WAYS), or, by default, the
    way ``HIPATTN_VARLEN_PREP`` says now (device unless it says host)."""
    if (way or prep_way()) == "host":
        prepare_varlen_metadata_async(backend, device_pool(backend, device), stream, cu_seqlens_q, cu_seqlens_k,
                                      batch, block_n, records_ptr, limits=limits, seqused_q=seqused_q,
                                      seqused_k=seqused_k)
    else:
        prepare_varlen_metadata_on_device(backend, stream, cu_seqlens_q, cu_seqlens_k, batch, block_n, records_ptr,
                                          limits=limits, seqused_q=seqused_q, seqused_k=seqused_k, device=device)
