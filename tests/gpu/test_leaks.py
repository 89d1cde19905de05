"""No leaks: 10,000 back-to-back forward+backward calls per kernel family on one stream
(varlen, a different cu_seqlens every call, small problems) leave device memory, Python
host-function entries and the registry's loaded kernels where they were after warm-up, and the
pinned pool small and wholly free (it caches as many blocks as were once in flight). The
small-seq kernels (tensor-core and portable) and the flash path with either varlen preparation
(the device kernel, and the host function with its pinned pool), atomic and deterministic dQ.

Set HIPATTN_LEAK_REPORT=path.json to have the figures written there (for the issue note).
"""

from __future__ import annotations

import gc
import json
import os
import resource

import pytest
import torch

import hipattn
from hipattn import pinned, runtime
from hipattn.backends import get_backend
from hipattn.catalog.smallseq import SMALLSEQ_TILE

from .conftest import fresh_seed, randn_like

CALLS = 10_000
WARMUP = 200
SAMPLES = 10  # figures taken every CALLS / SAMPLES calls
PATTERNS = 97  # distinct cu_seqlens rows, cycled (a prime, so patterns and samples never line up)
BATCH = 16
# Flash calls draw lengths up to here: past the small-seq tile, and over more than one flash tile.
FLASH_LONGEST = 150
FIGURES: dict[str, dict] = {}
# The caching allocator may keep a few more blocks around after warm-up (a new size class): allow
# that much growth of what the driver reports free, but none of what torch reports allocated.
DEVICE_SLACK_BYTES = 64 * 2**20
HOST_RSS_SLACK_BYTES = 64 * 2**20
# Pinned blocks the process's pools may hold after the run, free: far below one per call.
PINNED_BLOCKS_BOUND = 64


def _record(case: str, figures: dict) -> None:
    FIGURES[case] = figures
    path = os.environ.get("HIPATTN_LEAK_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(FIGURES, f, indent=1, sort_keys=True)


def _pinned_pools() -> list[pinned.PinnedPool]:
    """Every PinnedPool alive in the process (hipattn's launch path keeps none today; any it adds counts)."""
    return [obj for obj in gc.get_objects() if isinstance(obj, pinned.PinnedPool)]


def _snapshot() -> dict:
    torch.cuda.synchronize()
    # One-shot host functions that have run are dropped at the next launch; drop them now, so that
    # python_host_funcs counts the ones still pending or owned by a graph, not how many the last
    # call happened to enqueue.
    pinned.collect_host_funcs()
    free, total = get_backend().mem_get_info()
    pools = [pool.stats() for pool in _pinned_pools()]
    loaded = runtime.active().registry.loaded()
    return {
        "device_free_bytes": free,
        "device_used_bytes": total - free,
        "torch_allocated_bytes": torch.cuda.memory_allocated(),
        "torch_reserved_bytes": torch.cuda.memory_reserved(),
        "pinned_pools": len(pools),
        "pinned_blocks": sum(s.free_blocks + s.held_blocks + s.in_flight_blocks + s.graph_blocks for s in pools),
        "pinned_bytes": sum(s.free_bytes + s.held_bytes + s.in_flight_bytes + s.graph_bytes for s in pools),
        "pinned_held_blocks": sum(s.held_blocks for s in pools),
        "process_lifetime_entries": len(pinned._PROCESS_LIFETIME),
        "python_host_funcs": pinned.pending_host_funcs(),
        "loaded_kernels": len(loaded),
        "load_count": runtime.active().registry.load_count,
        "host_max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def _patterns(gen: torch.Generator, longest: int = SMALLSEQ_TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """[PATTERNS, BATCH + 1] int32 cu_seqlens on the device, lengths 0..longest, ends <= BATCH * longest."""
    rows = []
    for _ in range(2):
        lengths = torch.randint(0, longest + 1, (PATTERNS, BATCH), generator=gen)
        cu = torch.zeros(PATTERNS, BATCH + 1, dtype=torch.int32)
        cu[:, 1:] = lengths.cumsum(1)
        rows.append(cu.cuda())
    return rows[0], rows[1]


# Which kernels the calls reach: the small-seq kernels (lengths within the tile) or the flash path
# (lengths past it) with each way of preparing its varlen work list.
WORKLOADS = {
    "tensor-core": ({"HIPATTN_SMALLSEQ_KERNEL": None}, SMALLSEQ_TILE),
    "portable": ({"HIPATTN_SMALLSEQ_KERNEL": "portable"}, SMALLSEQ_TILE),
    "flash-device-prep": ({"HIPATTN_VARLEN_PREP": "device"}, FLASH_LONGEST),
    "flash-host-prep": ({"HIPATTN_VARLEN_PREP": "host"}, FLASH_LONGEST),
}


@pytest.fixture(params=sorted(WORKLOADS))
def workload(request, monkeypatch) -> tuple[str, int]:
    """(name, longest sequence) with the environment that selects the workload's kernels."""
    env, longest = WORKLOADS[request.param]
    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    return request.param, longest


@pytest.mark.parametrize("heads_q,heads_kv", [(8, 8), (8, 2)])
def test_ten_thousand_calls_leave_memory_and_kernels_bounded(workload, heads_q, heads_kv):
    name, longest = workload
    capacity = BATCH * longest
    gen = torch.Generator().manual_seed(fresh_seed())
    head_dim = 64
    q = torch.randn(capacity, heads_q, head_dim, generator=gen).bfloat16().cuda()
    k = torch.randn(capacity, heads_kv, head_dim, generator=gen).bfloat16().cuda()
    v = randn_like(k, gen)
    dout = randn_like(q, gen)
    cu_q, cu_k = _patterns(gen, longest)
    given = dict(out=torch.empty_like(q), lse=torch.empty(heads_q, capacity, device="cuda"))
    grads = dict(dq=torch.empty_like(q), dk=torch.empty_like(k), dv=torch.empty_like(v))
    stream = torch.cuda.Stream()

    def call(i: int) -> None:
        args = dict(cu_seqlens_q=cu_q[i % PATTERNS], cu_seqlens_k=cu_k[i % PATTERNS], max_seqlen_q=longest,
                    max_seqlen_k=longest, causal=bool(i % 3 == 0))
        # The flash path alternates its dQ schedules (the atomic one allocates dq_accum); the small-seq
        # path is deterministic either way.
        deterministic = bool(i % 4 < 2)
        if i % 2:  # half the calls allocate their outputs, half write caller-provided ones
            out, lse = hipattn.forward(q, k, v, **args)
            hipattn.backward(dout, q, k, v, out, lse, deterministic=deterministic, **args)
        else:
            hipattn.forward(q, k, v, **given, **args)
            hipattn.backward(dout, q, k, v, given["out"], given["lse"], **grads, deterministic=deterministic, **args)

    with torch.cuda.stream(stream):
        for i in range(WARMUP):
            call(i)
        stream.synchronize()
        gc.collect()
        before = _snapshot()
        samples = []
        for i in range(CALLS):
            call(WARMUP + i)
            if (i + 1) % (CALLS // SAMPLES) == 0:
                stream.synchronize()
                samples.append(_snapshot())
    stream.synchronize()
    gc.collect()
    after = _snapshot()
    _record(f"{name} h{heads_q}/{heads_kv}", {"calls": CALLS, "before": before, "after": after,
                                                 "samples": samples})

    assert after["torch_allocated_bytes"] == before["torch_allocated_bytes"], (before, after)
    assert {s["torch_allocated_bytes"] for s in samples} == {before["torch_allocated_bytes"]}, samples
    assert after["device_used_bytes"] - before["device_used_bytes"] <= DEVICE_SLACK_BYTES, (before, after)
    # No growth over the second half: a leak grows with calls, a cache settles.
    half = samples[len(samples) // 2 - 1]
    assert after["device_used_bytes"] <= half["device_used_bytes"] + 2**20, (half, after)
    for name in ("loaded_kernels", "load_count", "pinned_pools", "process_lifetime_entries", "python_host_funcs"):
        assert after[name] == before[name], (name, before[name], after[name])
    # The pinned pool keeps as many blocks as calls once had in flight at the same time (the host
    # preparation's staging), so it may still grow late in a run when the host gets further ahead
    # (measured on the H200: 4 after warm-up, 10, then 14 after 6,000 calls). A leak of one block
    # per call would hold thousands; every block is back in the pool once the stream is done.
    assert after["pinned_blocks"] <= PINNED_BLOCKS_BOUND, (before["pinned_blocks"], after["pinned_blocks"])
    assert after["pinned_held_blocks"] == 0
    assert after["host_max_rss_bytes"] - before["host_max_rss_bytes"] <= HOST_RSS_SLACK_BYTES, (before, after)


def test_hipattn_check_calls_free_their_pinned_staging(monkeypatch):
    """HIPATTN_CHECK=1 stages cu_seqlens through pinned host memory on every call: 1,000 calls must
    not grow the process (a leaked cuMemHostAlloc is pinned, page-locked RSS)."""
    monkeypatch.setenv("HIPATTN_CHECK", "1")
    gen = torch.Generator().manual_seed(fresh_seed())
    q = torch.randn(BATCH * SMALLSEQ_TILE, 8, 64, generator=gen).bfloat16().cuda()
    cu_q, cu_k = _patterns(gen)

    def call(i: int) -> None:
        out, lse = hipattn.forward(q, q, q, cu_seqlens_q=cu_q[i % PATTERNS], cu_seqlens_k=cu_k[i % PATTERNS],
                                   max_seqlen_q=SMALLSEQ_TILE, max_seqlen_k=SMALLSEQ_TILE)

    for i in range(50):
        call(i)
    before = _snapshot()
    for i in range(1000):
        call(i)
    after = _snapshot()
    _record("HIPATTN_CHECK=1", {"calls": 1000, "before": before, "after": after})
    assert after["torch_allocated_bytes"] == before["torch_allocated_bytes"]
    assert after["host_max_rss_bytes"] - before["host_max_rss_bytes"] <= HOST_RSS_SLACK_BYTES, (before, after)
