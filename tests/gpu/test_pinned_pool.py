"""The pinned pool and host functions on a real GPU: blocks come back only after the stream passed
their keepalive, nothing is recycled while a copy is in flight, and a main thread waiting on the
stream never deadlocks with a Python host function."""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from hipattn.backends import get_backend
from hipattn.pinned import PinnedPool, collect_host_funcs, launch_python_host_func


def test_host_written_blocks_are_never_overwritten_before_their_copy_ran():
    """The host-path preparation's pattern: the host fills a pinned block, the stream copies it to the device later.
    If the pool handed the block out again before the copy ran, the next round's host write would
    corrupt an earlier round's result."""
    backend = get_backend()
    pool = PinnedPool(backend)
    stream = torch.cuda.Stream()
    n = 4096
    rounds = 1000
    results = torch.empty(rounds, n, dtype=torch.int32, device="cuda")
    for r in range(rounds):
        block = pool.acquire(n * 4)
        block.array.view(np.int32)[:n] = r  # host write, as a metadata packer would
        with torch.cuda.stream(stream):
            torch.cuda._sleep(2_000)  # keep the stream behind the host
        backend.memcpy_async(results[r].data_ptr(), block.ptr, n * 4, stream.cuda_stream)
        pool.release_after(stream.cuda_stream, block)
    stream.synchronize()
    expected = torch.arange(rounds, dtype=torch.int32, device="cuda")[:, None].expand(rounds, n)
    assert torch.equal(results, expected), "a pinned block was rewritten while its copy was still pending"
    pool.collect()
    stats = pool.stats()
    assert stats.in_flight_blocks == 0, stats
    # Bounded: blocks are recycled, not allocated per call.
    assert stats.free_blocks + stats.held_blocks <= 256, stats


def test_a_block_is_not_reused_while_its_copy_is_pending():
    backend = get_backend()
    pool = PinnedPool(backend)
    stream = torch.cuda.Stream()
    block = pool.acquire(4096)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time holds the stream
    pool.release_after(stream.cuda_stream, block)
    other = pool.acquire(4096)
    assert other.ptr != block.ptr, "a pinned block was handed out while its stream had not reached the keepalive"
    stream.synchronize()
    pool.collect()
    again = pool.acquire(4096)
    assert again.ptr in (block.ptr, other.ptr)


def test_main_thread_waiting_on_the_stream_does_not_deadlock_with_a_python_host_function():
    backend = get_backend()
    stream = torch.cuda.Stream()
    ran = []
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)
    launch_python_host_func(backend, stream.cuda_stream, lambda: (time.sleep(0.05), ran.append(threading.get_ident())))
    done = threading.Event()

    def wait():
        backend.stream_synchronize(stream.cuda_stream)
        done.set()

    waiter = threading.Thread(target=wait)
    waiter.start()
    backend.stream_synchronize(stream.cuda_stream)  # the main thread blocks here while the callback needs the GIL
    waiter.join(timeout=10)
    assert done.is_set() and len(ran) == 1
    assert ran[0] != threading.get_ident(), "the host function ran on the runtime's callback thread"
    collect_host_funcs()


def test_python_host_function_survives_graph_replays():
    backend = get_backend()
    stream = torch.cuda.Stream()
    calls = []
    x = torch.zeros(16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        x.add_(1)
        launch_python_host_func(backend, stream.cuda_stream, lambda: calls.append(1))
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    collect_host_funcs()
    assert len(calls) == 5, f"host function ran {len(calls)} times over 5 replays"
