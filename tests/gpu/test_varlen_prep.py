"""The varlen backward's stream-async metadata on a real GPU: device cu_seqlens -> pinned -> host
function packs -> device workspace, all on one stream, against the numpy packer.

Shown: 1,000 back-to-back calls with different cu_seqlens on one stream; a CUDA graph that replays
with new cu_seqlens written into the same device buffers; zero host-blocking calls on the path (and
the calls return while the stream is still busy).
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import torch

from hipattn import pinned
from hipattn.backends import get_backend
from hipattn.pinned import PinnedPool, collect_host_funcs
from hipattn.streams import on_device
from hipattn.varlen_metadata import (
    VARLEN_RECORD_BYTES,
    VARLEN_RECORD_DTYPE,
    SequenceLimits,
    pack_split_offsets,
)
from hipattn.varlen_prep import prepare_varlen_metadata_async, reserve_blocks

WORDS = VARLEN_RECORD_BYTES // 4


def random_cu_seqlens(rng: np.random.Generator, batch: int, max_len: int) -> np.ndarray:
    lengths = rng.integers(0, max_len + 1, batch)
    lengths[rng.random(batch) < 0.15] = 0  # empty sequences
    lengths[rng.random(batch) < 0.1] = max_len
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def expected(cu_q: np.ndarray, cu_k: np.ndarray, block_n: int, limits: SequenceLimits) -> np.ndarray:
    out = np.zeros(len(cu_q) - 1, VARLEN_RECORD_DTYPE)
    return pack_split_offsets(cu_q, cu_k, block_n, out, limits).view(np.int32).reshape(-1, WORDS)


def test_1000_back_to_back_calls_on_one_stream_match_the_packer():
    backend = get_backend()
    pool = PinnedPool(backend)
    rng = np.random.default_rng()
    stream = torch.cuda.Stream()
    block_n, calls = 64, 1000
    limits = SequenceLimits(max_seqlen_q=200, max_seqlen_k=3000, total_q=64 * 200, total_k=64 * 3000)
    cases = []
    for _ in range(calls):
        batch = int(rng.integers(0, 65))
        cu_q, cu_k = random_cu_seqlens(rng, batch, 200), random_cu_seqlens(rng, batch, 3000)
        metadata = torch.full((batch, WORDS), -1, dtype=torch.int32, device="cuda")  # poisoned
        cases.append((cu_q, cu_k, torch.from_numpy(cu_q).cuda(), torch.from_numpy(cu_k).cuda(), metadata))
    torch.cuda.synchronize()  # inputs in place before the path under test starts
    errors_before = len(pinned.host_func_errors)
    with on_device(backend, 0), torch.cuda.stream(stream):
        for i, (cu_q, _, device_q, device_k, metadata) in enumerate(cases):
            if i % 50 == 0:
                torch.cuda._sleep(2_000_000)  # keep the stream behind the host, so blocks are in flight
            prepare_varlen_metadata_async(backend, pool, stream.cuda_stream, device_q.data_ptr(), device_k.data_ptr(),
                                          len(cu_q) - 1, block_n, metadata.data_ptr(), limits=limits)
    backend.stream_synchronize(stream.cuda_stream)
    for cu_q, cu_k, _, _, metadata in cases:
        np.testing.assert_array_equal(metadata.cpu().numpy(), expected(cu_q, cu_k, block_n, limits))
    assert len(pinned.host_func_errors) == errors_before
    pool.collect()
    stats = pool.stats()
    assert stats.in_flight_blocks == 0 and stats.held_blocks == 0, stats
    assert stats.free_blocks <= 256, f"blocks are recycled, not allocated per call: {stats}"
    collect_host_funcs()


def test_graph_replays_with_new_cu_seqlens_in_the_same_buffers():
    backend = get_backend()
    pool = PinnedPool(backend)
    rng = np.random.default_rng()
    batch, block_n = 20, 64
    limits = SequenceLimits(max_seqlen_q=128, max_seqlen_k=2048, total_q=batch * 128, total_k=batch * 2048)
    device_q = torch.zeros(batch + 1, dtype=torch.int32, device="cuda")
    device_k = torch.zeros(batch + 1, dtype=torch.int32, device="cuda")
    metadata = torch.full((batch, WORDS), -1, dtype=torch.int32, device="cuda")
    reserve_blocks(pool, batch)  # a global-mode capture forbids allocating pinned memory
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with on_device(backend, 0), torch.cuda.graph(graph, stream=stream):
        prepare_varlen_metadata_async(backend, pool, stream.cuda_stream, device_q.data_ptr(), device_k.data_ptr(),
                                      batch, block_n, metadata.data_ptr(), limits=limits)
    assert pool.stats().graph_blocks == 2
    errors_before = len(pinned.host_func_errors)
    for _ in range(5):
        cu_q, cu_k = random_cu_seqlens(rng, batch, 128), random_cu_seqlens(rng, batch, 2048)
        with torch.cuda.stream(stream):
            device_q.copy_(torch.from_numpy(cu_q))
            device_k.copy_(torch.from_numpy(cu_k))
            metadata.fill_(-1)
            graph.replay()
        backend.stream_synchronize(stream.cuda_stream)  # releases the GIL the host node needs
        np.testing.assert_array_equal(metadata.cpu().numpy(), expected(cu_q, cu_k, block_n, limits))
        collect_host_funcs()
    assert len(pinned.host_func_errors) == errors_before


def test_the_path_makes_no_host_blocking_call_and_returns_while_the_stream_is_busy(monkeypatch):
    backend = get_backend()
    pool = PinnedPool(backend)
    rng = np.random.default_rng()
    batch, block_n, calls = 40, 64, 20
    limits = SequenceLimits(max_seqlen_q=100, max_seqlen_k=1000, total_q=batch * 100, total_k=batch * 1000)
    cases = []
    for _ in range(calls):
        cu_q, cu_k = random_cu_seqlens(rng, batch, 100), random_cu_seqlens(rng, batch, 1000)
        cases.append((cu_q, cu_k, torch.from_numpy(cu_q).cuda(), torch.from_numpy(cu_k).cuda(),
                      torch.full((batch, WORDS), -1, dtype=torch.int32, device="cuda")))
    reserve_blocks(pool, batch, calls)  # steady state: the pool is warm
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()

    blocking = Counter()

    def counting(name, real):
        def wrapper(*args, **kwargs):
            blocking[name] += 1
            return real(*args, **kwargs)
        return wrapper

    for name in ("stream_synchronize", "event_synchronize"):
        monkeypatch.setattr(backend, name, counting(f"backend.{name}", getattr(backend, name)))
    driver = getattr(backend, "_driver", None)
    for name in ("cuStreamSynchronize", "cuEventSynchronize", "cuCtxSynchronize"):
        if driver is not None and hasattr(driver, name):
            monkeypatch.setattr(driver, name, counting(name, getattr(driver, name)))
    monkeypatch.setattr(torch.cuda, "synchronize", counting("torch.cuda.synchronize", torch.cuda.synchronize))
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", counting("Stream.synchronize", torch.cuda.Stream.synchronize))
    monkeypatch.setattr(torch.cuda.Event, "synchronize", counting("Event.synchronize", torch.cuda.Event.synchronize))

    with on_device(backend, 0), torch.cuda.stream(stream):
        torch.cuda._sleep(500_000_000)  # a few hundred ms of GPU time ahead of every call
        start = time.perf_counter()
        for _, _, device_q, device_k, metadata in cases:
            prepare_varlen_metadata_async(backend, pool, stream.cuda_stream, device_q.data_ptr(), device_k.data_ptr(),
                                          batch, block_n, metadata.data_ptr(), limits=limits)
        host_seconds = time.perf_counter() - start
        done = torch.cuda.Event()
        done.record(stream)
    stream_still_busy = not done.query()
    monkeypatch.undo()
    backend.stream_synchronize(stream.cuda_stream)

    assert not blocking, f"host-blocking calls on the path: {dict(blocking)}"
    assert stream_still_busy, f"the {calls} calls ({host_seconds * 1e3:.1f} ms) returned only after the stream drained"
    for cu_q, cu_k, _, _, metadata in cases:
        np.testing.assert_array_equal(metadata.cpu().numpy(), expected(cu_q, cu_k, block_n, limits))
    collect_host_funcs()
