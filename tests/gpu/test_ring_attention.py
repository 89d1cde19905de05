"""hipattn.ring on the GPU: ring attention through torch.distributed on hipattn's kernels.

A ring of one (a one-process NCCL group) is one forward and one backward call, so its results must
be hipattn.torch.flash_attn_varlen_func's bit for bit; two processes on two GPUs (NCCL) must match
the unsharded call and the float64 reference within bf16's tolerance. The two-GPU test runs on
nvidia-h200-x2 and is skipped with fewer than two GPUs (it has not run yet: no two-GPU machine has
been lent).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from support.processes import nccl_rank, run_spawned

import hipattn.torch as hat
from hipattn import ring

from .conftest import TOLERANCE, relative_error
from .reference import attention_reference

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_nccl_available(),
                                reason="this torch has no NCCL backend")

# Sequence lengths (multiples of 2): chunks of 256 and 150 tokens take the flash path, 17 and 1 the small-seq one.
LENGTHS = [512, 34, 2, 300]
HEADS_Q, HEADS_KV, HEAD_DIM = 16, 4, 128


def _inputs(seed: int, device):
    generator = torch.Generator().manual_seed(seed)
    cu = [0]
    for n in LENGTHS:
        cu.append(cu[-1] + n)

    def make(heads):
        return torch.randn(cu[-1], heads, HEAD_DIM, generator=generator).to(device=device, dtype=torch.bfloat16)

    return make(HEADS_Q), make(HEADS_KV), make(HEADS_KV), make(HEADS_Q), cu


def _ring_step(q, k, v, dout, cu, rank, world_size, causal):
    """This rank's (out, lse, dq, dk, dv) through the ring, from its shards of the full inputs."""
    shard = [ring.shard_varlen(t, cu, rank, world_size) for t in (q, k, v, dout)]
    leaves = [t.clone().requires_grad_() for t in shard[:3]]
    cu_local = ring.local_cu_seqlens(cu, world_size).to(q.device)
    out, lse, _ = hat.ring_flash_attn_varlen_func(*leaves, cu_local, max(LENGTHS) // world_size, causal=causal,
                                                  deterministic=True, return_attn_probs=True)
    out.backward(shard[3])
    return out.detach(), lse, *(t.grad for t in leaves)


def _unsharded_step(q, k, v, dout, cu, causal):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    cu_dev = torch.tensor(cu, dtype=torch.int32, device=q.device)
    out, lse, _ = hat.flash_attn_varlen_func(*leaves, cu_dev, cu_dev, max(LENGTHS), max(LENGTHS), causal=causal,
                                             deterministic=True, return_attn_probs=True)
    out.backward(dout)
    return out.detach(), lse, *(t.grad for t in leaves)


@pytest.fixture
def group_of_one(tmp_path):
    with nccl_rank(0, 1, str(tmp_path / "init")):
        yield


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_a_ring_of_one_is_flash_attn_varlen_func_bit_for_bit(group_of_one, causal):
    q, k, v, dout, cu = _inputs(1, "cuda")
    got = _ring_step(q, k, v, dout, cu, 0, 1, causal)
    want = _unsharded_step(q, k, v, dout, cu, causal)
    torch.cuda.synchronize()
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        assert torch.equal(g, w), name


def _nccl_worker(rank: int, world_size: int, init_file: str) -> None:
    """One rank of the two-GPU test (spawned): ring results against the unsharded call and float64."""
    with nccl_rank(rank, world_size, init_file, seconds=120):
        q, k, v, dout, cu = _inputs(2, f"cuda:{rank}")
        scale = 1 / math.sqrt(HEAD_DIM)
        for causal in (False, True):
            got = _ring_step(q, k, v, dout, cu, rank, world_size, causal)
            unsharded = [ring.shard_varlen(t, cu, rank, world_size, dim=1 if i == 1 else 0)
                         for i, t in enumerate(_unsharded_step(q, k, v, dout, cu, causal))]
            ref = attention_reference(q, k, v, cu, cu, causal=causal, scale=scale, dout=dout)
            reference = [ring.shard_varlen(t, cu, rank, world_size, dim=1 if i == 1 else 0)
                         for i, t in enumerate(ref)]
            torch.cuda.synchronize()
            for name, g, u, r in zip(("out", "lse", "dq", "dk", "dv"), got, unsharded, reference, strict=True):
                errors = relative_error(g, u), relative_error(g, r)
                assert max(errors) < TOLERANCE["bf16"], (rank, causal, name, errors)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")
def test_two_gpus_over_nccl_match_the_unsharded_call_and_float64(tmp_path):
    finished = run_spawned(_nccl_worker, (2, str(tmp_path / "init")), 2, 300)
    assert finished, "the two ranks did not finish within 300 s"
