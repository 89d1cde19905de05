"""Small varlen calls for the concurrency and leak tests: inputs made once, run many times.

A ``Call`` holds one forward+backward problem on one device (THD, lengths drawn from 0..17 so the
small-seq path serves it, a different cu_seqlens each call). ``run`` launches it through the public
API on whatever stream is current (or the one given) and returns the five outputs; the small-seq
kernels are deterministic, so two runs of one call must agree bit for bit.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

import hipattn
from hipattn.catalog.smallseq import SMALLSEQ_TILE

from .reference import attention_reference


@dataclass
class Call:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    host_cu_q: list[int]
    host_cu_k: list[int]
    causal: bool


def make_calls(count: int, device: int, *, seed: int, batch: int = 6, heads_q: int = 8, heads_kv: int = 8,
               head_dim: int = 64, dtype=torch.bfloat16) -> list[Call]:
    """``count`` calls on ``device``, each with its own lengths (some 0) and fresh random inputs."""
    gen = torch.Generator().manual_seed(seed)
    calls = []
    for i in range(count):
        lengths_q = torch.randint(0, SMALLSEQ_TILE + 1, (batch,), generator=gen).tolist()
        lengths_k = torch.randint(0, SMALLSEQ_TILE + 1, (batch,), generator=gen).tolist()
        host_q = [0] + torch.tensor(lengths_q).cumsum(0).tolist()
        host_k = [0] + torch.tensor(lengths_k).cumsum(0).tolist()
        dev = torch.device("cuda", device)
        q = torch.randn(host_q[-1], heads_q, head_dim, generator=gen).to(dtype).to(dev)
        k = torch.randn(host_k[-1], heads_kv, head_dim, generator=gen).to(dtype).to(dev)
        v = torch.randn(host_k[-1], heads_kv, head_dim, generator=gen).to(dtype).to(dev)
        dout = torch.randn(host_q[-1], heads_q, head_dim, generator=gen).to(dtype).to(dev)
        cu_q = torch.tensor(host_q, dtype=torch.int32, device=dev)
        cu_k = torch.tensor(host_k, dtype=torch.int32, device=dev)
        calls.append(Call(q, k, v, dout, cu_q, cu_k, host_q, host_k, causal=bool(i % 2)))
    torch.cuda.synchronize(device)
    return calls


def run(call: Call, stream=None) -> tuple[torch.Tensor, ...]:
    """(out, lse, dq, dk, dv) of one call; outputs allocated by hipattn on the launch stream."""
    args = dict(cu_seqlens_q=call.cu_q, cu_seqlens_k=call.cu_k, max_seqlen_q=SMALLSEQ_TILE,
                max_seqlen_k=SMALLSEQ_TILE, causal=call.causal, stream=stream)
    out, lse = hipattn.forward(call.q, call.k, call.v, **args)
    dq, dk, dv = hipattn.backward(call.dout, call.q, call.k, call.v, out, lse, **args)
    return out, lse, dq, dk, dv


def max_error_against_reference(call: Call, results) -> float:
    """The worst relative error of (out, dq, dk, dv) against the float64 reference."""
    from .conftest import relative_error

    out, _, dq, dk, dv = results
    scale = 1.0 / math.sqrt(call.q.shape[-1])
    ref_out, _, ref_dq, ref_dk, ref_dv = attention_reference(call.q, call.k, call.v, call.host_cu_q, call.host_cu_k,
                                                             causal=call.causal, scale=scale, dout=call.dout)
    return max(relative_error(a, b) for a, b in ((out, ref_out), (dq, ref_dq), (dk, ref_dk), (dv, ref_dv)))


def first_difference(expected: list[tuple], actual: list[tuple]) -> str | None:
    """None when every output of every call is bitwise equal; else which call and output differ."""
    names = ("out", "lse", "dq", "dk", "dv")
    if len(expected) != len(actual):
        return f"{len(actual)} calls ran, expected {len(expected)}"
    for i, (a, b) in enumerate(zip(expected, actual, strict=True)):
        for name, x, y in zip(names, a, b, strict=True):
            if not torch.equal(x, y):
                return f"call {i}: {name} differs"
    return None


@contextlib.contextmanager
def current_stream_on(device: int, stream: torch.cuda.Stream, *, keep_device: int | None = None):
    """Make ``stream`` the current stream of ``device`` without leaving ``device`` current.

    torch.cuda.set_stream (and ``with torch.cuda.stream(...)``) also makes the stream's device
    current; the device is set back right after, so the calling thread's current device stays
    ``keep_device`` (default: the one current on entry) while ``device``'s current stream is ``stream``.
    """
    keep = torch.cuda.current_device() if keep_device is None else keep_device
    previous = torch.cuda.current_stream(device)
    torch.cuda.set_stream(stream)
    torch.cuda.set_device(keep)
    try:
        yield stream
    finally:
        torch.cuda.set_stream(previous)
        torch.cuda.set_device(keep)
