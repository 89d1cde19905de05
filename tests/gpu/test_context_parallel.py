"""torch's own context parallelism (torch.distributed.tensor.experimental.context_parallel) on hipattn's
kernels: with hipattn enabled as torch's flash SDPA implementation, torch shards a Llama-style
attention layer's sequence over the ranks of a device mesh, runs the flash SDPA op on each shard
pair of its ring (here hipattn's forward and backward) and merges the partial outputs by their LSEs,
with head-tail load balancing when causal. No ring loop of hipattn's own is involved.

The layer (q, k, v and output projections around SDPA, bf16) runs one forward and backward under
context_parallel with its input and the loss weights as the sharded buffers; the loss and the
parameters' gradients, summed over the ranks, must match the same layer's unsharded step on one GPU
within bf16's tolerance, and hipattn's kernels must have served the sharded calls. One process on one
GPU (a mesh of one) runs everywhere; two processes on two GPUs (NCCL) run on nvidia-h200-x2 and are
skipped with fewer than two GPUs.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from support.processes import nccl_rank, run_spawned
from torch.nn.attention import SDPBackend, sdpa_kernel

import hipattn.torch  # noqa: F401  (registers "hipattn" with torch's flash-attention registry)
from hipattn import attention, torch_sdpa

from .conftest import TOLERANCE, relative_error

context_parallel = pytest.importorskip("torch.distributed.tensor.experimental").context_parallel
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_nccl_available(),
                                reason="this torch has no NCCL backend")

# Sequence length divisible by 2 x the ranks (head-tail load balancing cuts it into 2 x world chunks).
BATCH, SEQLEN, HEADS, HEAD_DIM = 2, 2048, 8, 64
EMBED = HEADS * HEAD_DIM


class AttentionLayer(torch.nn.Module):
    """Llama's attention without rotary: projections of x into q, k and v per head, SDPA, the output
    projection."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(EMBED, 3 * EMBED, bias=False)
        self.out = torch.nn.Linear(EMBED, EMBED, bias=False)

    def forward(self, x: torch.Tensor, causal: bool) -> torch.Tensor:
        batch, seqlen, _ = x.shape
        q, k, v = self.qkv(x).view(batch, seqlen, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.out(o.transpose(1, 2).reshape(batch, seqlen, EMBED))


def _problem(device):
    """The same layer, input and loss weights on every rank (a seeded CPU generator, then the device)."""
    torch.manual_seed(2026)
    layer = AttentionLayer().to(device=device, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(BATCH, SEQLEN, EMBED, generator=generator).to(device=device, dtype=torch.bfloat16)
    weight = torch.randn(BATCH, SEQLEN, EMBED, generator=generator).to(device=device, dtype=torch.bfloat16)
    return layer, x, weight


def _cp_options():
    """torch's context-parallel options (a private module, moved between torch releases)."""
    try:
        from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options
    except ImportError:
        from torch.distributed.tensor.experimental._attention import _cp_options
    return _cp_options


@contextlib.contextmanager
def _load_balanced(enabled: bool):
    """Head-tail load balancing on or off (torch refuses it for non-causal attention), then as before."""
    options = _cp_options()
    before = options.enable_load_balance
    options.enable_load_balance = enabled
    try:
        yield
    finally:
        options.enable_load_balance = before


def _step(layer, x, weight, causal, mesh=None):
    """The loss and the parameters' gradients of one forward and backward; under context_parallel over
    ``mesh`` (x and weight sharded along the sequence, restored afterwards, load-balanced when causal)
    summed over its ranks."""
    layer.zero_grad(set_to_none=True)
    with contextlib.ExitStack() as sharded:
        if mesh is not None:
            sharded.enter_context(_load_balanced(causal))
            sharded.enter_context(context_parallel(mesh, buffers=[x, weight], buffer_seq_dims=[1, 1]))
        loss = (layer(x, causal).float() * weight.float()).sum()
        loss.backward()
    results = [loss.detach(), *(p.grad.float() for p in layer.parameters())]
    if mesh is not None:
        for r in results:
            dist.all_reduce(r)
    return results


@contextlib.contextmanager
def _counting_hipattn_calls():
    """hipattn enabled as torch's flash SDPA implementation and SDPA pinned to it, counting hipattn's
    forward and backward calls."""
    counts = {"forward": 0, "backward": 0}
    originals = {name: getattr(attention, name) for name in counts}

    def counted(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)
        return call

    for name in counts:
        setattr(attention, name, counted(name))
    try:
        # SDPA's own choice can be cuDNN or the efficient kernel: pinned to the flash op hipattn serves.
        with torch_sdpa.enabled(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            yield counts
    finally:
        for name, original in originals.items():
            setattr(attention, name, original)


def _check_against_one_gpu(mesh, device, causal) -> None:
    layer, x, weight = _problem(device)
    with _counting_hipattn_calls() as counts:
        unsharded = _step(layer, x, weight, causal)
        before = dict(counts)
        sharded = _step(layer, x, weight, causal, mesh)
    torch.cuda.synchronize()
    assert counts["forward"] > before["forward"] and counts["backward"] > before["backward"], \
        f"hipattn served no sharded call: {counts}, {before} before context_parallel"
    for name, got, want in zip(("loss", "qkv.weight", "out.weight"), sharded, unsharded, strict=True):
        error = relative_error(got, want)
        assert error < TOLERANCE["bf16"], (dist.get_rank(), causal, name, error)


@pytest.fixture
def mesh_of_one(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh

    with nccl_rank(0, 1, str(tmp_path / "init")):
        yield init_device_mesh("cuda", (1,))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_a_mesh_of_one_matches_the_unsharded_layer(mesh_of_one, causal):
    _check_against_one_gpu(mesh_of_one, "cuda", causal)


def _nccl_worker(rank: int, world_size: int, init_file: str) -> None:
    """One rank of the two-GPU test (spawned)."""
    from torch.distributed.device_mesh import init_device_mesh

    with nccl_rank(rank, world_size, init_file, seconds=120):
        mesh = init_device_mesh("cuda", (world_size,))
        for causal in (False, True):
            _check_against_one_gpu(mesh, f"cuda:{rank}", causal)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")
def test_two_gpus_over_nccl_match_one_gpu(tmp_path):
    finished = run_spawned(_nccl_worker, (2, str(tmp_path / "init")), 2, 300)
    assert finished, "the two ranks did not finish within 300 s"
