"""The varlen backward's work list on a real GPU, prepared both ways (the varlen_records kernel and the
host path: device cu_seqlens -> pinned -> host function packs -> device workspace), on one stream.

Shown: both ways write exactly the numpy packer's records, for random and malformed cu_seqlens (and
seqused) over batches of several scan chunks; a flash forward + backward captured into a CUDA graph
replays correctly with new cu_seqlens written into the same buffers; 1,000 back-to-back backward
calls with different cu_seqlens on one stream give what each call gives alone; and no host-blocking
call is made on the backward path, which returns while the stream is still busy.
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import pytest
import torch

from hipattn import arrays, pinned, runtime
from hipattn import problem as problem_mod
from hipattn.backends import get_backend
from hipattn.catalog.flash_backward import tiles_for
from hipattn.ops import flash, flash_backward
from hipattn.pinned import PinnedPool, collect_host_funcs, device_pool
from hipattn.streams import on_device
from hipattn.varlen_metadata import (
    INT32_MAX,
    VARLEN_RECORD_DTYPE,
    VARLEN_RECORD_WORDS,
    SequenceLimits,
    pack_varlen_records,
)
from hipattn.varlen_prep import (
    PREP_SWITCH,
    prepare_varlen_metadata_async,
    prepare_varlen_metadata_on_device,
    reserve_blocks,
)
from hipattn.workspace import backward_workspace

WAYS = ("device", "host")
TORCH_DTYPES = {"fp32": torch.float32, "int32": torch.int32}


def random_cu_seqlens(rng: np.random.Generator, batch: int, max_len: int) -> np.ndarray:
    lengths = rng.integers(0, max_len + 1, batch)
    lengths[rng.random(batch) < 0.15] = 0  # empty sequences
    lengths[rng.random(batch) < 0.1] = max_len
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def malformed_cu_seqlens(rng: np.random.Generator, batch: int, total: int) -> np.ndarray:
    """Overlapping, decreasing, negative and out-of-range entries: enough blocks to pass the bound."""
    kind = rng.integers(0, 3)
    if kind == 0:  # every sequence spans most of the tensor: the work list overflows its bound
        return np.where(np.arange(batch + 1) % 2 == 0, 0, total).astype(np.int32)
    if kind == 1:
        return rng.integers(-100, total + 100, batch + 1).astype(np.int32)
    return rng.integers(-(2**31), 2**31, batch + 1, dtype=np.int64).astype(np.int32)


def expected_records(cu_q, cu_k, block_n, limits, used_q=None, used_k=None) -> np.ndarray:
    out = np.zeros(len(cu_q) - 1, VARLEN_RECORD_DTYPE)
    pack_varlen_records(cu_q, cu_k, block_n, out, limits, used_q, used_k)
    return out.view(np.int32).reshape(-1, VARLEN_RECORD_WORDS)


def prepare(way: str, backend, pool, stream: int, pointers: dict, batch: int, block_n: int, records, limits) -> None:
    args = (pointers["cu_q"], pointers["cu_k"], batch, block_n, records.data_ptr())
    used = dict(seqused_q=pointers.get("used_q", 0), seqused_k=pointers.get("used_k", 0))
    if way == "device":
        prepare_varlen_metadata_on_device(backend, stream, *args, limits=limits, **used)
    else:
        prepare_varlen_metadata_async(backend, pool, stream, *args, limits=limits, **used)


def untruncated_key_lengths(cu_k: np.ndarray, used_k: np.ndarray | None, limits: SequenceLimits) -> np.ndarray:
    """The clamped key lengths before the bound rule (sequence_bounds' clamp alone)."""
    cu = cu_k.astype(np.int64)
    start = np.clip(cu[:-1], 0, limits.total_k)
    length = used_k.astype(np.int64) if used_k is not None else cu[1:] - cu[:-1]
    return np.clip(length, 0, np.minimum(limits.max_seqlen_k, limits.total_k - start))


def test_both_ways_write_the_packers_records_for_random_and_malformed_input():
    backend = get_backend()
    pool = PinnedPool(backend)
    rng = np.random.default_rng()
    stream = torch.cuda.Stream()
    errors_before = len(pinned.host_func_errors)
    truncated = 0
    with on_device(backend, 0), torch.cuda.stream(stream):
        for case in range(120):
            batch = int(rng.choice([1, 7, 255, 256, 257, 700, 1100]))  # one to several scan chunks
            block_n = int(rng.choice([16, 32, 64, 128]))
            max_q, max_k = int(rng.integers(0, 300)), int(rng.integers(1, 3000))
            if case % 2 == 0:
                cu_q, cu_k = random_cu_seqlens(rng, batch, max_q), random_cu_seqlens(rng, batch, max_k)
                limits = SequenceLimits(max_q, max_k, int(cu_q[-1]), int(cu_k[-1]))
            else:  # tensors a few sequences long, and cu_seqlens that claim far more
                limits = SequenceLimits(max_q, max_k, int(rng.integers(0, 4 * max_q + 2)),
                                        int(rng.integers(0, 4 * max_k + 2)))
                cu_q = malformed_cu_seqlens(rng, batch, limits.total_q)
                cu_k = malformed_cu_seqlens(rng, batch, limits.total_k)
            host = {"cu_q": cu_q, "cu_k": cu_k}
            if case % 3 == 0:
                host["used_q"] = rng.integers(-5, max_q + 20, batch).astype(np.int32)
                host["used_k"] = rng.choice([0, max_k, INT32_MAX, -(2**31)], batch).astype(np.int32)
            device = {name: torch.from_numpy(a).cuda() for name, a in host.items()}
            pointers = {name: t.data_ptr() for name, t in device.items()}
            expected = expected_records(cu_q, cu_k, block_n, limits, host.get("used_q"), host.get("used_k"))
            truncated += int((expected[:, 3] != untruncated_key_lengths(cu_k, host.get("used_k"), limits)).any())
            for way in WAYS:
                records = torch.full((batch, VARLEN_RECORD_WORDS), -1, dtype=torch.int32, device="cuda")
                prepare(way, backend, pool, stream.cuda_stream, pointers, batch, block_n, records, limits)
                stream.synchronize()  # the test's own wait, releasing the GIL the host path needs
                np.testing.assert_array_equal(records.cpu().numpy(), expected, err_msg=f"{way} path, case {case}")
    assert truncated, "no case passed the work list's bound: the overflow rule went untested"
    assert len(pinned.host_func_errors) == errors_before
    collect_host_funcs()


# ---- the flash forward + backward with the work list ------------------------------------------------


class VarlenCall:
    """One THD problem's buffers (inputs, outputs, workspace), reused by every call with new cu_seqlens."""

    def __init__(self, batch: int, max_seqlen: int, heads_q: int, heads_kv: int, head_dim: int, causal: bool,
                 deterministic: bool, rng: np.random.Generator):
        gen = torch.Generator(device="cuda").manual_seed(int(rng.integers(2**31)))
        self.batch, self.max_seqlen, self.deterministic = batch, max_seqlen, deterministic
        total = batch * max_seqlen
        self.q = torch.randn(total, heads_q, head_dim, generator=gen, device="cuda").bfloat16()
        self.k = torch.randn(total, heads_kv, head_dim, generator=gen, device="cuda").bfloat16()
        self.v = torch.randn(total, heads_kv, head_dim, generator=gen, device="cuda").bfloat16()
        self.dout = torch.randn(total, heads_q, head_dim, generator=gen, device="cuda").bfloat16()
        self.cu_q = torch.zeros(batch + 1, dtype=torch.int32, device="cuda")
        self.cu_k = torch.zeros(batch + 1, dtype=torch.int32, device="cuda")
        self.qa, self.ka, self.va = (arrays.as_device_array(t, n) for t, n in ((self.q, "q"), (self.k, "k"), (self.v, "v")))
        self.sequences = dict(cu_seqlens_q=arrays.as_device_array(self.cu_q, "cu_seqlens_q"),
                              cu_seqlens_k=arrays.as_device_array(self.cu_k, "cu_seqlens_k"))
        self.problem = problem_mod.describe(self.qa, self.ka, self.va, max_seqlen_q=max_seqlen,
                                            max_seqlen_k=max_seqlen, causal=causal, **self.sequences)
        plan = backward_workspace(self.problem, flash_backward.adds_dq_atomically(self.problem, deterministic))
        self.workspace = torch.empty(plan.total_bytes, dtype=torch.uint8, device="cuda")  # one buffer, as attention.py
        self.sections = {
            s.name: self.workspace[s.offset:s.offset + s.nbytes].view(TORCH_DTYPES[s.dtype]).view(s.shape)
            for s in plan.sections
        }
        self.block_n = tiles_for(head_dim, runtime.active().target(0))[0].block_n

    def random_cu_seqlens(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        return random_cu_seqlens(rng, self.batch, self.max_seqlen), random_cu_seqlens(rng, self.batch, self.max_seqlen)

    def outputs(self, forward: bool = True) -> dict[str, torch.Tensor]:
        """Fresh buffers poisoned with NaN (rows no sequence covers keep it): the gradients, and the
        forward's out and lse unless ``forward`` is False."""
        shapes = {"dq": self.q.shape, "dk": self.k.shape, "dv": self.k.shape}
        if forward:
            shapes["out"] = self.q.shape
        result = {name: torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")
                  for name, shape in shapes.items()}
        if forward:
            result["lse"] = torch.full(problem_mod.lse_shape(self.problem), float("nan"), device="cuda")
        return result

    def set_random_cu_seqlens(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """New random cu_seqlens written into the call's buffers, in the current stream's order; returns them."""
        cu_q, cu_k = self.random_cu_seqlens(rng)
        self.cu_q.copy_(torch.from_numpy(cu_q))
        self.cu_k.copy_(torch.from_numpy(cu_k))
        return cu_q, cu_k

    def forward_and_backward(self, o: dict, stream: int) -> None:
        self.forward(o, stream)
        self.backward(o, stream)

    def forward(self, o: dict, stream: int) -> None:
        flash.forward(self.problem, self.qa, self.ka, self.va, arrays.as_device_array(o["out"], "out"),
                      arrays.as_device_array(o["lse"], "lse"), stream, **self.sequences)

    def backward(self, o: dict, stream: int) -> None:
        a = {name: arrays.as_device_array(t, name) for name, t in o.items()}
        views = {name: arrays.as_device_array(t, name) for name, t in self.sections.items()}
        flash_backward.backward(self.problem, self.qa, self.ka, self.va, a["out"], arrays.as_device_array(self.dout, "dout"),
                                a["lse"], a["dq"], a["dk"], a["dv"], stream, deterministic=self.deterministic,
                                **views, **self.sequences)

    def expected_records(self, cu_q: np.ndarray, cu_k: np.ndarray) -> np.ndarray:
        return expected_records(cu_q, cu_k, self.block_n, SequenceLimits.of(self.problem))


def bits(t: torch.Tensor) -> torch.Tensor:
    """An exact comparison that treats equal NaN payloads (the poison) as equal."""
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def assert_same(actual: dict, expected: dict, exact: bool, what: str) -> None:
    for name in ("dq", "dk", "dv"):
        if exact:
            assert torch.equal(bits(actual[name]), bits(expected[name])), f"{what}: {name} differs"
        else:  # atomic dQ: the order of the additions varies
            torch.testing.assert_close(actual[name], expected[name], rtol=2e-2, atol=2e-2, equal_nan=True,
                                       msg=lambda m, name=name: f"{what}: {name}: {m}")


@pytest.fixture(params=WAYS)
def way(request, monkeypatch):
    """Each way of preparing the work list in turn, chosen as users choose it (HIPATTN_VARLEN_PREP)."""
    monkeypatch.setenv(PREP_SWITCH, request.param)
    return request.param


@pytest.mark.parametrize("deterministic", [True, False])
def test_a_captured_forward_and_backward_replays_with_new_cu_seqlens(way, deterministic):
    backend = get_backend()
    rng = np.random.default_rng()
    call = VarlenCall(batch=6, max_seqlen=150, heads_q=4, heads_kv=2, head_dim=128, causal=True,
                      deterministic=deterministic, rng=rng)
    stream = torch.cuda.Stream()
    captured = call.outputs()
    with on_device(backend, 0), torch.cuda.stream(stream):
        call.set_random_cu_seqlens(rng)
        call.forward_and_backward(captured, stream.cuda_stream)  # warm-up: kernels compiled and loaded before capture
    stream.synchronize()
    reserve_blocks(device_pool(backend, 0), call.batch)  # a global-mode capture forbids pinned allocation
    graph = torch.cuda.CUDAGraph()
    errors_before = len(pinned.host_func_errors)
    with on_device(backend, 0), torch.cuda.graph(graph, stream=stream):
        call.forward_and_backward(captured, stream.cuda_stream)
    for replay in range(4):
        with torch.cuda.stream(stream):
            cu_q, cu_k = call.set_random_cu_seqlens(rng)
            for t in captured.values():
                t.fill_(float("nan"))
            graph.replay()
        stream.synchronize()  # releases the GIL the host path's host node needs
        np.testing.assert_array_equal(call.sections["varlen_records"].cpu().numpy(), call.expected_records(cu_q, cu_k))
        uncaptured = call.outputs()
        with on_device(backend, 0), torch.cuda.stream(stream):
            call.forward_and_backward(uncaptured, stream.cuda_stream)
        stream.synchronize()
        assert_same(captured, uncaptured, deterministic, f"replay {replay} ({way})")
        assert not torch.isnan(captured["dk"][: int(cu_k[-1])]).any(), "a key of a sequence got no dK"
        collect_host_funcs()
    assert len(pinned.host_func_errors) == errors_before
    del graph


def test_1000_back_to_back_backward_calls_match_each_call_run_alone(way):
    backend = get_backend()
    rng = np.random.default_rng()
    call = VarlenCall(batch=4, max_seqlen=130, heads_q=2, heads_kv=1, head_dim=128, causal=False,
                      deterministic=True, rng=rng)
    calls, patterns = 1000, 97  # a prime: consecutive calls always differ
    stream = torch.cuda.Stream()
    table_q = torch.zeros(patterns, call.batch + 1, dtype=torch.int32, device="cuda")
    table_k = torch.zeros_like(table_q)
    host_patterns, forwards = [], []
    with on_device(backend, 0), torch.cuda.stream(stream):
        for p in range(patterns):  # each pattern's O and LSE, computed once
            cu_q, cu_k = call.random_cu_seqlens(rng)
            host_patterns.append((cu_q, cu_k))
            table_q[p].copy_(torch.from_numpy(cu_q))
            table_k[p].copy_(torch.from_numpy(cu_k))
            call.cu_q.copy_(table_q[p])
            call.cu_k.copy_(table_k[p])
            o = call.outputs()
            call.forward(o, stream.cuda_stream)
            forwards.append({"out": o["out"], "lse": o["lse"]})
    stream.synchronize()

    def run(i: int) -> dict:
        o = {**forwards[i % patterns], **call.outputs(forward=False)}
        call.cu_q.copy_(table_q[i % patterns])  # new contents in the same buffers, in stream order
        call.cu_k.copy_(table_k[i % patterns])
        call.backward(o, stream.cuda_stream)
        return o

    errors_before = len(pinned.host_func_errors)
    with on_device(backend, 0), torch.cuda.stream(stream):
        back_to_back = []
        for i in range(calls):
            if i % 100 == 0:
                torch.cuda._sleep(1_000_000)  # keep the stream behind the host: blocks and records in flight
            back_to_back.append(run(i))
    stream.synchronize()
    with on_device(backend, 0), torch.cuda.stream(stream):
        for i in range(calls):
            alone = run(i)
            stream.synchronize()
            if i < 50:
                cu_q, cu_k = host_patterns[i % patterns]
                np.testing.assert_array_equal(call.sections["varlen_records"].cpu().numpy(),
                                              call.expected_records(cu_q, cu_k))
            assert_same(back_to_back[i], alone, True, f"call {i} ({way})")
            back_to_back[i] = None
    assert len(pinned.host_func_errors) == errors_before
    pool = device_pool(backend, 0)
    pool.collect()
    stats = pool.stats()
    assert stats.in_flight_blocks == 0 and stats.held_blocks == 0, stats
    assert stats.free_blocks <= 512, f"blocks are recycled, not allocated per call: {stats}"
    collect_host_funcs()


def test_the_backward_makes_no_host_blocking_call_and_returns_while_the_stream_is_busy(way, monkeypatch):
    backend = get_backend()
    rng = np.random.default_rng()
    # One dQ schedule per way: atomics (with its memset and convert_dq) on the device way, the dQ
    # kernel on the host way.
    call = VarlenCall(batch=8, max_seqlen=200, heads_q=4, heads_kv=2, head_dim=64, causal=True,
                      deterministic=way == "host", rng=rng)
    calls = 20
    stream = torch.cuda.Stream()
    o = call.outputs()
    with on_device(backend, 0), torch.cuda.stream(stream):
        cu_q, cu_k = call.set_random_cu_seqlens(rng)
        call.forward_and_backward(o, stream.cuda_stream)  # warm: kernels loaded, the pool has its blocks
    stream.synchronize()
    reserve_blocks(device_pool(backend, 0), call.batch, calls)

    blocking = Counter()

    def counting(name, real):
        def wrapper(*args, **kwargs):
            blocking[name] += 1
            return real(*args, **kwargs)
        return wrapper

    for name in ("stream_synchronize", "event_synchronize"):
        monkeypatch.setattr(backend, name, counting(f"backend.{name}", getattr(backend, name)))
    for binding in (getattr(backend, "_driver", None), getattr(backend, "_hip", None)):
        for name in ("cuStreamSynchronize", "cuEventSynchronize", "cuCtxSynchronize", "cuMemcpy", "cuMemcpyDtoH",
                     "cuMemcpyHtoD", "hipStreamSynchronize", "hipEventSynchronize", "hipDeviceSynchronize",
                     "hipMemcpy", "hipMemcpyDtoH", "hipMemcpyHtoD"):
            if binding is not None and hasattr(binding, name):
                monkeypatch.setattr(binding, name, counting(name, getattr(binding, name)))
    monkeypatch.setattr(torch.cuda, "synchronize", counting("torch.cuda.synchronize", torch.cuda.synchronize))
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", counting("Stream.synchronize", torch.cuda.Stream.synchronize))
    monkeypatch.setattr(torch.cuda.Event, "synchronize", counting("Event.synchronize", torch.cuda.Event.synchronize))

    with on_device(backend, 0), torch.cuda.stream(stream):
        torch.cuda._sleep(500_000_000)  # a few hundred ms of GPU time ahead of every call
        start = time.perf_counter()
        for _ in range(calls):
            call.backward(o, stream.cuda_stream)
        host_seconds = time.perf_counter() - start
        done = torch.cuda.Event()
        done.record(stream)
    stream_still_busy = not done.query()
    monkeypatch.undo()
    backend.stream_synchronize(stream.cuda_stream)

    assert not blocking, f"host-blocking calls on the backward path: {dict(blocking)}"
    assert stream_still_busy, f"the {calls} calls ({host_seconds * 1e3:.1f} ms) returned only after the stream drained"
    np.testing.assert_array_equal(call.sections["varlen_records"].cpu().numpy(), call.expected_records(cu_q, cu_k))
    collect_host_funcs()
