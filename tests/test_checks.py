"""HIPATTN_CHECK=1 reads cu_seqlens/seqused back and rejects what the host promises contradict.

The "device" here is host memory: a backend whose copies are memmoves, so the check's own logic
runs for real on any machine.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from hipattn import checks
from hipattn.arrays import raw_array
from hipattn.problem import BSHD, THD, Problem


class HostMemoryBackend:
    """Just the calls checks.py makes, on host memory; records them to show the order."""

    def __init__(self):
        self.calls: list[str] = []
        self._buffers: dict[int, ctypes.Array] = {}

    def host_alloc(self, nbytes: int) -> int:
        buffer = (ctypes.c_char * nbytes)()
        address = ctypes.addressof(buffer)
        self._buffers[address] = buffer
        self.calls.append("host_alloc")
        return address

    def host_free(self, ptr: int) -> None:
        del self._buffers[ptr]
        self.calls.append("host_free")

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        ctypes.memmove(dst, src, nbytes)
        self.calls.append(f"memcpy_async(stream={stream})")

    def stream_synchronize(self, stream: int) -> None:
        self.calls.append(f"stream_synchronize({stream})")


def _int32(values) -> tuple[np.ndarray, object]:
    host = np.ascontiguousarray(values, dtype=np.int32)
    return host, raw_array(host.ctypes.data, host.shape, "int32", device=0)


def _problem(layout=THD, batch=3, max_q=17, max_k=17, total_q=30, total_k=40) -> Problem:
    return Problem(layout, "bf16", batch, 8, 8, 64, max_q, max_k, total_q, total_k, False, 0.125, 0)


def _check(problem, **arrays):
    backend = HostMemoryBackend()
    checks.check_sequences(backend, 7, problem, arrays)
    return backend


def test_valid_cu_seqlens_pass_after_reading_on_the_launch_stream():
    keep_q, cu_q = _int32([0, 10, 10, 27])
    keep_k, cu_k = _int32([0, 17, 30, 40])
    backend = _check(_problem(), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert backend.calls[:3] == ["host_alloc", "memcpy_async(stream=7)", "stream_synchronize(7)"]
    assert backend.calls.count("host_alloc") == backend.calls.count("host_free") == 2


@pytest.mark.parametrize(
    "cu_q, message",
    [
        ([1, 10, 10, 27], "must start at 0"),
        ([0, 10, 9, 27], "decreases at sequence 1"),
        ([0, 10, 10, 31], "the tensor has 30 tokens"),
        ([0, 18, 20, 27], "sequence 0 has 18 tokens by cu_seqlens_q but max_seqlen_q is 17"),
    ],
)
def test_malformed_cu_seqlens_are_named(cu_q, message):
    keep_q, cu_q_array = _int32(cu_q)
    keep_k, cu_k = _int32([0, 17, 30, 40])
    with pytest.raises(ValueError, match=message):
        _check(_problem(), cu_seqlens_q=cu_q_array, cu_seqlens_k=cu_k)


def test_a_max_seqlen_bound_smaller_than_a_key_sequence_is_named():
    keep_q, cu_q = _int32([0, 10, 10, 27])
    keep_k, cu_k = _int32([0, 5, 30, 40])
    with pytest.raises(ValueError, match="sequence 1 has 25 tokens by cu_seqlens_k but max_seqlen_k is 17"):
        _check(_problem(), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def test_seqused_longer_than_the_padded_batch_allows_is_named():
    keep, used_q = _int32([3, 17, 18])
    with pytest.raises(ValueError, match="sequence 2 has 18 tokens by seqused_q but max_seqlen_q is 17"):
        _check(_problem(BSHD, total_q=17), seqused_q=used_q)
    keep, negative = _int32([3, -1, 2])
    with pytest.raises(ValueError, match=r"seqused_k\[1\] is -1"):
        _check(_problem(BSHD), seqused_k=negative)


def test_switch_reads_the_environment_each_call(monkeypatch):
    monkeypatch.delenv(checks.SWITCH, raising=False)
    assert not checks.enabled()
    monkeypatch.setenv(checks.SWITCH, "1")
    assert checks.enabled()
    monkeypatch.setenv(checks.SWITCH, "0")
    assert not checks.enabled()


def test_the_public_call_runs_the_check_on_its_launch_stream_only_when_switched_on(monkeypatch):
    """hipattn.forward with a cu_seqlens that breaks max_seqlen: rejected under HIPATTN_CHECK=1,
    launched (and silently clamped by the kernel) without it."""
    import hipattn
    from hipattn import runtime
    from hipattn.ops import smallseq

    class GuardedHostBackend(HostMemoryBackend):
        def get_device(self) -> int:
            return 0

        def set_device(self, device: int) -> None:
            self.calls.append(f"set_device({device})")

    backend = GuardedHostBackend()
    launched = []
    monkeypatch.setattr(runtime, "_active", runtime.Runtime(backend))
    monkeypatch.setattr(smallseq, "forward", lambda *args, **kwargs: launched.append(args[-1]))
    keep_q, cu_q = _int32([0, 5, 30])  # the second sequence has 25 tokens
    keep_k, cu_k = _int32([0, 4, 8])
    base = 1 << 32  # fake, 256-byte aligned device addresses: nothing dereferences them
    q = raw_array(base, (30, 8, 64), "bf16", device=0)
    k = raw_array(base + (1 << 24), (8, 8, 64), "bf16", device=0)
    v = raw_array(base + (2 << 24), (8, 8, 64), "bf16", device=0)
    out = raw_array(base + (3 << 24), (30, 8, 64), "bf16", device=0)
    lse = raw_array(base + (4 << 24), (8, 30), "fp32", device=0)
    call = dict(out=out, lse=lse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=17, max_seqlen_k=17, stream=7)

    monkeypatch.setenv(checks.SWITCH, "1")
    with pytest.raises(ValueError, match="sequence 1 has 25 tokens by cu_seqlens_q but max_seqlen_q is 17"):
        hipattn.forward(q, k, v, **call)
    assert "memcpy_async(stream=7)" in backend.calls and not launched

    monkeypatch.delenv(checks.SWITCH)
    backend.calls.clear()
    hipattn.forward(q, k, v, **call)
    assert launched == [7] and not any(c.startswith("memcpy") for c in backend.calls)
