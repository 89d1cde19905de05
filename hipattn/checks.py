"""HIPATTN_CHECK=1: validate what only the device knows, at the cost of a synchronize.

Host-side validation (problem.py) cannot see the contents of cu_seqlens or seqused without
reading device memory, which the launch path never does. The kernels stay memory-safe whatever those
arrays hold (they clamp every start and length to what the host promised), but a malformed
cu_seqlens or a max_seqlen smaller than a real sequence silently gives wrong numbers. With
HIPATTN_CHECK=1 each call copies these arrays to the host on its launch stream, waits for that
stream, and raises ValueError naming the first bad sequence. This blocks the host on every call and
cannot run under graph capture: a debugging aid, off by default.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping

import numpy as np

from . import env
from .backends.base import Backend
from .device_array import DeviceArray
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
        raise ValueError(f"{name}[0] is {values[0]}; cu_seqlens must start at 0 (HIPATTN_CHECK)")
    lengths = np.diff(values.astype(np.int64))
    bad = np.flatnonzero(lengths < 0)
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"{name} decreases at sequence {b}: {values[b]} then {values[b + 1]}; it must be non-decreasing (HIPATTN_CHECK)")
    if values[-1] > total:
        raise ValueError(f"{name}[-1] is {values[-1]} but the tensor has {total} tokens (HIPATTN_CHECK)")
    _check_lengths(lengths, name, max_seqlen)


def _check_lengths(lengths: np.ndarray, name: str, max_seqlen: int) -> None:
    too_long = np.flatnonzero(lengths > max_seqlen)
    if too_long.size:
        b = int(too_long[0])
        bound = name.replace("cu_seqlens", "max_seqlen").replace("seqused", "max_seqlen")
        raise ValueError(
            f"sequence {b} has {int(lengths[b])} tokens by {name} but {bound} is {max_seqlen}; "
            f"pass a {bound} at least as large as every sequence (HIPATTN_CHECK)"
        )
    negative = np.flatnonzero(lengths < 0)
    if negative.size:
        b = int(negative[0])
        raise ValueError(f"{name}[{b}] is {int(lengths[b])}; lengths must be >= 0 (HIPATTN_CHECK)")


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
