"""Repeat forward calls replay the launch the first call of their signature validated
(hipattn.launch_plans): the same results as the full path, every pointer check still made, and
graph capture unchanged."""

from __future__ import annotations

import pytest
import torch

import hipattn
from hipattn import runtime
from hipattn.catalog.targets import runs_nvidia_wgmma

from .conftest import bshd_inputs, cumulative, poisoned, randn_like


@pytest.fixture
def fresh_plans(monkeypatch):
    """A runtime with no plans yet (over the process's registry, so nothing recompiles)."""
    fresh = runtime.Runtime(registry=runtime.active().registry)
    monkeypatch.setattr(runtime, "_active", fresh)
    return fresh.launch_plans


def _varlen_call(rng, lengths, heads_q=16, heads_kv=4, head_dim=128):
    cu = cumulative(lengths)
    q = torch.randn(cu[-1], heads_q, head_dim, generator=rng, device="cuda").bfloat16()
    k = torch.randn(cu[-1], heads_kv, head_dim, generator=rng, device="cuda").bfloat16()
    cu_dev = torch.tensor(cu, dtype=torch.int32, device="cuda")
    return (q, k, randn_like(k, rng)), dict(cu_seqlens_q=cu_dev, cu_seqlens_k=cu_dev, max_seqlen_q=max(lengths),
                                            max_seqlen_k=max(lengths), causal=True)


def _batch_call(rng):
    return bshd_inputs(2, 300, 300, 8, 2, 128, "bf16", rng), dict(causal=True)


@pytest.mark.parametrize("make_call", [lambda rng: _varlen_call(rng, [9, 3, 17, 0, 12]), _batch_call],
                         ids=["small-seq varlen", "flash batch"])
def test_a_replayed_call_writes_what_the_full_path_writes(rng, fresh_plans, make_call):
    (q, k, v), kwargs = make_call(rng)
    first_out, first_lse = hipattn.forward(q, k, v, **kwargs)
    assert len(fresh_plans) == 1
    for _ in range(3):
        out, lse = poisoned(q.shape, q.dtype), poisoned(first_lse.shape, torch.float32)
        hipattn.forward(q, k, v, out=out, lse=lse, **kwargs)  # a signature of its own: the outputs are given
        assert torch.equal(out, first_out) and torch.equal(lse, first_lse)
        allocated_out, allocated_lse = hipattn.forward(q, k, v, **kwargs)
        assert allocated_out.data_ptr() != first_out.data_ptr()
        assert torch.equal(allocated_out, first_out) and torch.equal(allocated_lse, first_lse)
    assert len(fresh_plans) == 2


def test_new_inputs_of_the_same_signature_give_new_results(rng, fresh_plans):
    (q, k, v), kwargs = _varlen_call(rng, [9, 3, 17])
    hipattn.forward(q, k, v, **kwargs)
    (q2, k2, v2), _ = _varlen_call(rng, [9, 3, 17])
    replayed, _ = hipattn.forward(q2, k2, v2, **kwargs)
    fresh_plans.clear()
    full, _ = hipattn.forward(q2, k2, v2, **kwargs)
    assert torch.equal(replayed, full)


def test_new_flash_inputs_replay_with_tensor_maps_of_their_own(rng, fresh_plans):
    """On H100/H200 the flash forward reads q, k and v through tensor maps, which hold their addresses:
    a replay with new arrays must encode maps of the new arrays, not reuse the recorded call's."""
    (q, k, v), kwargs = _batch_call(rng)
    hipattn.forward(q, k, v, **kwargs)
    (plan,) = fresh_plans.values()
    if runs_nvidia_wgmma(runtime.active().target(q.device.index)):
        assert [len(launch.tensor_maps) for launch in plan.launches] == [3], "q, k and v each through a map"
    (q2, k2, v2), _ = _batch_call(rng)
    replayed, replayed_lse = hipattn.forward(q2, k2, v2, **kwargs)
    fresh_plans.clear()
    full, full_lse = hipattn.forward(q2, k2, v2, **kwargs)
    assert torch.equal(replayed, full) and torch.equal(replayed_lse, full_lse)


def test_pointer_checks_still_refuse_after_a_plan_exists(rng, fresh_plans):
    (q, k, v), kwargs = _varlen_call(rng, [9, 3, 17])
    _, lse = hipattn.forward(q, k, v, **kwargs)
    hipattn.forward(q, k, v, out=torch.empty_like(q), lse=torch.empty_like(lse), **kwargs)
    with pytest.raises(ValueError, match="out overlaps q"):
        hipattn.forward(q, k, v, out=q, lse=torch.empty_like(lse), **kwargs)
    out = torch.empty_like(q)
    lse_inside_out = out.view(-1).view(torch.float32)[: lse.numel()].view(lse.shape)
    with pytest.raises(ValueError, match="overlaps"):
        hipattn.forward(q, k, v, out=out, lse=lse_inside_out, **kwargs)
    storage = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")
    shifted = storage[1:].view(q.shape)  # same shape and strides, 2 bytes off the 16-byte grid
    with pytest.raises(ValueError, match="aligned"):
        hipattn.forward(q, k, v, out=shifted, lse=torch.empty_like(lse), **kwargs)


def test_a_replayed_call_is_captured_and_replays_in_a_graph(rng, fresh_plans):
    (q, k, v), kwargs = _varlen_call(rng, [9, 3, 17, 5])
    out, lse = hipattn.forward(q, k, v, **kwargs)
    hipattn.forward(q, k, v, out=out, lse=lse, **kwargs)  # the plan of the captured signature
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        hipattn.forward(q, k, v, out=out, lse=lse, **kwargs)
    (q2, k2, v2), _ = _varlen_call(rng, [9, 3, 17, 5])
    for dst, src in ((q, q2), (k, k2), (v, v2)):
        dst.copy_(src)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    fresh_plans.clear()
    expected, _ = hipattn.forward(q2, k2, v2, **kwargs)
    assert torch.equal(out, expected)


def test_a_given_stream_is_the_launch_stream_on_replay(rng, fresh_plans):
    (q, k, v), kwargs = _varlen_call(rng, [9, 3, 17])
    expected, lse = hipattn.forward(q, k, v, **kwargs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    outs = [poisoned(q.shape, q.dtype) for _ in range(2)]
    for out in outs:
        hipattn.forward(q, k, v, out=out, lse=torch.empty_like(lse), stream=side, **kwargs)
    side.synchronize()
    assert all(torch.equal(out, expected) for out in outs)
