"""The MFMA small-seq kernels (kernels/smallseq/forward_mfma.hip, backward_mfma.hip), which gfx90a and
gfx94x run for every small-seq call, on the emulated gfx90a (tests/support/emulation.py) against float64,
through hipattn's own API and launch path.

Each case is one instantiation (dtype, head_dim, query heads) of both kernels, so that every
head_dim's waves-per-workgroup (1, 2 and 4 in the backward, the partial scores summed through LDS)
meets both dtypes, and the group sizes 1, 2, 3, 4 and 8 (MQA) are spread over them. Lengths cover 0, 1,
16 and 17 on each side (17: the second key tile of one row, the 17th query row of a tile), queries
longer and shorter than keys (causal rows that see no key), THD with cu_seqlens and BSHD with seqused.
Outputs are poisoned with NaN and every element is compared; rows past a sequence must stay NaN."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest
from support.emulation import (
    EMULATED_ARCH,
    EmulatedDevice,
    EmulationBackend,
    aligned_bytes,
    array_16bit,
    compiler,
    from_16bit,
    to_16bit,
)
from support.raw_calls import NAN_BITS, run_backward, run_forward, thd_inputs
from support.reference import TOLERANCE, reference_backward, reference_forward, relative_error

import hipattn
from hipattn.arrays import raw_array
from hipattn.catalog import smallseq as catalog
from hipattn.jit.cache import DiskCache
from hipattn.jit.registry import Registry
from hipattn.jit.target import Target
from hipattn.ops import smallseq

pytestmark = pytest.mark.skipif(compiler() is None and not os.environ.get("CI"),
                                reason="needs g++ (CXX) to build the emulated kernels")

# Sequences of the THD cases: (len_q, len_k) pairs with 0, 1, 16 and 17 on each side.
THD_LENGTHS_Q = [17, 1, 0, 9, 17, 4, 16, 3]
THD_LENGTHS_K = [17, 5, 3, 0, 12, 17, 1, 16]
# The BSHD cases: seqused per batch entry, in [batch, 17, heads, head_dim] tensors.
BSHD_LENGTHS_Q = [17, 0, 6, 1]
BSHD_LENGTHS_K = [16, 17, 0, 17]


@dataclass(frozen=True)
class Case:
    dtype: str
    head_dim: int
    heads_q: int
    heads_kv: int
    causal: bool
    layout: str  # "thd" or "bshd"
    lengths_q: tuple[int, ...]
    lengths_k: tuple[int, ...]

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    def __str__(self) -> str:
        return (f"{self.dtype}-d{self.head_dim}-g{self.group}-{self.layout}-batch{len(self.lengths_q)}"
                + ("-causal" if self.causal else ""))


THD = (tuple(THD_LENGTHS_Q), tuple(THD_LENGTHS_K))
BSHD = (tuple(BSHD_LENGTHS_Q), tuple(BSHD_LENGTHS_K))
ONE = ((17,), (17,))  # batch 1, both sides full
CASES = [
    Case("bf16", 64, 8, 8, False, "thd", *THD),
    Case("bf16", 64, 8, 1, True, "thd", *THD),  # MQA: one KV head, 8 x 17 stacked rows (9 tiles)
    Case("fp16", 64, 6, 2, True, "bshd", *BSHD),
    Case("fp16", 128, 8, 4, True, "thd", *THD),
    Case("fp16", 128, 8, 2, False, "bshd", *ONE),
    Case("bf16", 128, 6, 2, False, "thd", *THD),
    Case("bf16", 256, 8, 2, False, "thd", *THD),
    Case("bf16", 256, 8, 8, True, "bshd", *ONE),
    Case("fp16", 256, 6, 2, True, "bshd", *BSHD),
]


def _specs(case: Case):
    target = Target.parse(EMULATED_ARCH)
    forward = catalog.forward_tiles(case.head_dim, target, group=case.group)
    backward = catalog.backward_tiles(case.head_dim, target, group=case.group)
    return [row.spec(case.dtype, case.head_dim, heads=case.heads_q) for row in (forward, backward)]


@pytest.fixture(scope="module")
def build_dirs(tmp_path_factory):
    """Build and cache directories for the module, filled up front: every case's two kernels are
    compiled two at a time (g++ in subprocesses), so the tests then load them from the cache."""
    build, cache = tmp_path_factory.mktemp("emulated-build"), tmp_path_factory.mktemp("emulated-cache")
    registry = Registry(EmulationBackend(str(build)), DiskCache(str(cache)))
    specs = sorted({spec for case in CASES for spec in _specs(case)}, key=lambda spec: spec.canonical())
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(lambda spec: registry.compile_spec(spec, Target.parse(EMULATED_ARCH)), specs))
    return build, cache


@pytest.fixture
def device(build_dirs, monkeypatch):
    monkeypatch.delenv("HIPATTN_SMALLSEQ", raising=False)
    monkeypatch.delenv(smallseq.KERNEL_SWITCH, raising=False)
    return EmulatedDevice(*build_dirs, monkeypatch)


def _loaded_families(device) -> set[str]:
    return {kernel.spec.family.name for kernel in device.registry.loaded()}


def _check_forward(case: Case, out, lse, want_out, want_lse):
    assert not np.isnan(out).any() and not np.isnan(lse).any(), "an output element was never written"
    assert relative_error(out, want_out) < TOLERANCE[case.dtype]
    finite = np.isfinite(want_lse)
    assert (np.isinf(lse) == ~finite).all(), "rows that see no key have LSE = +inf, all others a finite one"
    assert np.abs(lse[finite] - want_lse[finite]).max(initial=0.0) < 1e-3


def _check_gradients(case: Case, got, want):
    for name, g, w in zip("qkv", got, want, strict=True):
        assert not np.isnan(g).any(), f"d{name}: an element was never written"
        assert relative_error(g, w) < TOLERANCE[case.dtype], f"d{name}"


def _run_thd(device, case: Case, rng):
    lengths_q, lengths_k = list(case.lengths_q), list(case.lengths_k)
    bits, exact, cu_q, cu_k = thd_inputs(rng, lengths_q, lengths_k, case.heads_q, case.heads_kv, case.head_dim,
                                         case.dtype)
    scale = case.head_dim ** -0.5
    # max_seqlen is the tile, an upper bound of the real lengths (as a graph captured for a capacity passes).
    out, lse = run_forward(device, bits, cu_q, cu_k, 17, 17, case.heads_q, case.dtype, case.causal)
    want_out, want_lse = reference_forward(exact["q"], exact["k"], exact["v"], lengths_q, lengths_k, scale,
                                           case.causal)
    _check_forward(case, out, lse, want_out, want_lse)

    dout_bits = to_16bit(rng.standard_normal(bits["q"].shape), case.dtype)
    got = run_backward(device, bits, to_16bit(out, case.dtype), lse.astype(np.float32), dout_bits, cu_q, cu_k, 17,
                       17, case.dtype, case.causal)
    want = reference_backward(exact["q"], exact["k"], exact["v"], from_16bit(dout_bits, case.dtype), lengths_q,
                              lengths_k, scale, case.causal)
    _check_gradients(case, got, want)


def _packed(x, lengths):
    return np.concatenate([x[b, :n] for b, n in enumerate(lengths)])


def _run_bshd(device, case: Case, rng):
    """BSHD with per-sequence lengths (seqused): rows past a sequence's length are untouched."""
    dtype, batch, seqlen = case.dtype, len(case.lengths_q), 17
    lengths_q, lengths_k = list(case.lengths_q), list(case.lengths_k)
    shapes = {"q": (batch, seqlen, case.heads_q, case.head_dim), "k": (batch, seqlen, case.heads_kv, case.head_dim),
              "v": (batch, seqlen, case.heads_kv, case.head_dim)}
    bits = {name: to_16bit(rng.standard_normal(shape), dtype) for name, shape in shapes.items()}
    exact = {name: from_16bit(b, dtype) for name, b in bits.items()}
    dout_bits = to_16bit(rng.standard_normal(shapes["q"]), dtype)
    used_q, used_k = np.array(lengths_q, np.int32), np.array(lengths_k, np.int32)
    seq = dict(seqused_q=device.array(used_q), seqused_k=device.array(used_k), causal=case.causal)
    inputs = [array_16bit(bits[n], dtype) for n in ("q", "k", "v")]
    out = np.full(shapes["q"], NAN_BITS[dtype], np.uint16)
    lse = np.full((batch, case.heads_q, seqlen), np.nan, np.float32)
    hipattn.forward(*inputs, out=array_16bit(out, dtype), lse=device.array(lse), **seq)

    scale = case.head_dim ** -0.5
    packed = {name: _packed(exact[name], lengths_q if name == "q" else lengths_k) for name in exact}
    want_out, want_lse = reference_forward(packed["q"], packed["k"], packed["v"], lengths_q, lengths_k, scale,
                                           case.causal)
    got_out = from_16bit(out, dtype)
    got_lse = np.concatenate([lse[b, :, :n] for b, n in enumerate(lengths_q)], axis=1).astype(np.float64)
    _check_forward(case, _packed(got_out, lengths_q), got_lse, want_out, want_lse)
    assert all(np.isnan(got_out[b, n:]).all() for b, n in enumerate(lengths_q)), "rows past seqused are untouched"
    assert all(np.isnan(lse[b, :, n:]).all() for b, n in enumerate(lengths_q)), "LSE past seqused is untouched"

    grads = {name: np.full(shapes[name], NAN_BITS[dtype], np.uint16) for name in shapes}
    arrays = [array_16bit(dout_bits, dtype), *inputs, array_16bit(out, dtype)]
    workspace_bytes = hipattn.backward_workspace_bytes(*inputs, **seq)
    options = {"workspace": device.array(aligned_bytes(workspace_bytes))} if workspace_bytes else {}
    hipattn.backward(*arrays, device.array(lse), dq=array_16bit(grads["q"], dtype), dk=array_16bit(grads["k"], dtype),
                     dv=array_16bit(grads["v"], dtype), **seq, **options)
    want = reference_backward(packed["q"], packed["k"], packed["v"], _packed(from_16bit(dout_bits, dtype), lengths_q),
                              lengths_q, lengths_k, scale, case.causal)
    got = [from_16bit(grads[name], dtype) for name in "qkv"]
    lengths = {"q": lengths_q, "k": lengths_k, "v": lengths_k}
    _check_gradients(case, [_packed(g, lengths[name]) for name, g in zip("qkv", got, strict=True)], want)
    for name, g in zip("qkv", got, strict=True):
        assert all(np.isnan(g[b, n:]).all() for b, n in enumerate(lengths[name])), f"d{name} past seqused is untouched"


@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_mfma_small_seq_kernels_match_float64(device, case):
    rng = np.random.default_rng()
    (_run_thd if case.layout == "thd" else _run_bshd)(device, case, rng)
    assert device.backend.launches == 2, "one small-seq kernel each way"
    assert _loaded_families(device) == {"smallseq_forward_mfma", "smallseq_backward_mfma"}


@pytest.mark.parametrize("layout", ["thd", "bshd"])
def test_batch_0_launches_nothing(device, layout):
    """No sequences: both calls validate and return without a launch (and without reading anything)."""
    dtype, heads, head_dim = "bf16", 8, 64
    memory = aligned_bytes(256)  # valid, aligned pointers for zero-sized tensors
    shape = (0, 8, heads, head_dim) if layout == "bshd" else (0, heads, head_dim)
    lse_shape = (0, heads, 8) if layout == "bshd" else (heads, 0)

    def empty(shape, dtype=dtype):
        return raw_array(memory.ctypes.data, shape, dtype, 0)

    if layout == "bshd":
        seq = dict(seqused_q=empty((0,), "int32"), seqused_k=empty((0,), "int32"))
    else:
        cu_seqlens = np.zeros(1, np.int32)
        seq = dict(cu_seqlens_q=device.array(cu_seqlens), cu_seqlens_k=device.array(cu_seqlens), max_seqlen_q=17,
                   max_seqlen_k=17)
    q, k, v = empty(shape), empty(shape), empty(shape)
    hipattn.forward(q, k, v, out=empty(shape), lse=empty(lse_shape, "fp32"), causal=True, **seq)
    hipattn.backward(empty(shape), q, k, v, empty(shape), empty(lse_shape, "fp32"), dq=empty(shape), dk=empty(shape),
                     dv=empty(shape), causal=True, **seq)
    assert device.backend.launches == 0
