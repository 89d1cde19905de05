"""The AMD kernels, run on an emulated gfx90a (tests/support/emulation.py: the CPU as a wave64 GPU with MFMA),
against a float64 reference: the MFMA flash forward and backward, and the portable small-seq forward and
backward that AMD targets without MFMA run (the MFMA small-seq kernels have their own file,
tests/test_smallseq_mfma_emulation.py). No AMD GPU exists here; this is where those kernels'
arithmetic is checked (the portable small-seq kernels also run on the H200, at wave32, in tests/gpu). Outputs are poisoned with
NaN first and every element is compared; the emulated MFMA follows AMD's documented fragment layouts
(see emulation/emulated_device.h for what emulation cannot show)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from support.emulation import EmulatedDevice, aligned_bytes, array_16bit, compiler, from_16bit, to_16bit
from support.raw_calls import NAN_BITS, run_backward, run_forward, thd_inputs
from support.reference import TOLERANCE, reference_backward, reference_forward, relative_error

import hipattn
from hipattn.ops import smallseq

# CI installs g++ (.ci/run) and must run these; elsewhere they need it on PATH (or CXX).
pytestmark = pytest.mark.skipif(compiler() is None and not os.environ.get("CI"),
                                reason="needs g++ (CXX) to build the emulated kernels")

@pytest.fixture(scope="module")
def build_dirs(tmp_path_factory):
    return tmp_path_factory.mktemp("emulated-build"), tmp_path_factory.mktemp("emulated-cache")


@pytest.fixture
def device(build_dirs, monkeypatch):
    monkeypatch.delenv("HIPATTN_SMALLSEQ", raising=False)
    return EmulatedDevice(*build_dirs, monkeypatch)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim,heads_q,heads_kv", [(64, 2, 1), (96, 3, 1), (128, 2, 2), (256, 1, 1)])
def test_the_mfma_flash_forward_matches_float64(device, dtype, causal, head_dim, heads_q, heads_kv):
    rng = np.random.default_rng()
    # Lengths past the small-seq bound (18 and up), around the 16-row tiles, Q longer and shorter than KV,
    # and an empty KV.
    lengths_q = [18, 70, 5, 33, 40]
    lengths_k = [40, 70, 19, 0, 21]
    bits, exact, cu_q, cu_k = thd_inputs(rng, lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype)
    out, lse = run_forward(device, bits, cu_q, cu_k, max(lengths_q), max(lengths_k), heads_q, dtype, causal)
    want_out, want_lse = reference_forward(exact["q"], exact["k"], exact["v"], lengths_q, lengths_k,
                                           head_dim ** -0.5, causal)
    assert device.backend.launches == 1, "the flash path ran (not the small-seq one)"
    assert not np.isnan(out).any() and not np.isnan(lse).any(), "an output element was never written"
    assert relative_error(out, want_out) < TOLERANCE[dtype]
    finite = np.isfinite(want_lse)
    assert (np.isinf(lse) == ~finite).all(), "rows that see no key have LSE = +inf, all others a finite one"
    assert np.abs(lse[finite] - want_lse[finite]).max() < 1e-3


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim,heads_q,heads_kv", [(64, 4, 4), (64, 4, 1), (128, 8, 2), (256, 8, 8)])
def test_the_portable_small_seq_kernels_match_float64_at_wave64(device, monkeypatch, dtype, causal, head_dim,
                                                                heads_q, heads_kv):
    """The small-seq path of AMD targets without MFMA (portable kernels, teams of head_dim / 4 lanes:
    four, two or one a 64-lane wave), forced on the emulated gfx90a: forward, and backward with dK/dV
    summed over a GQA group."""
    monkeypatch.setenv(smallseq.KERNEL_SWITCH, "portable")
    rng = np.random.default_rng()
    lengths_q = [17, 1, 0, 9, 17, 4]
    lengths_k = [17, 5, 3, 0, 12, 17]
    bits, exact, cu_q, cu_k = thd_inputs(rng, lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype)
    out, lse = run_forward(device, bits, cu_q, cu_k, 17, 17, heads_q, dtype, causal)
    scale = head_dim ** -0.5
    want_out, want_lse = reference_forward(exact["q"], exact["k"], exact["v"], lengths_q, lengths_k, scale, causal)
    assert relative_error(out, want_out) < TOLERANCE[dtype]
    finite = np.isfinite(want_lse)
    assert (np.isinf(lse) == ~finite).all() and np.abs(lse[finite] - want_lse[finite]).max() < 1e-3

    dout = rng.standard_normal(bits["q"].shape)
    dout_bits = to_16bit(dout, dtype)
    got = run_backward(device, bits, to_16bit(out, dtype), lse.astype(np.float32), dout_bits, cu_q, cu_k, 17, 17,
                       dtype, causal)
    want = reference_backward(exact["q"], exact["k"], exact["v"], from_16bit(dout_bits, dtype), lengths_q, lengths_k,
                              scale, causal)
    assert device.backend.launches == 2, "one small-seq kernel each way"
    for name, g, w in zip("qkv", got, want, strict=True):
        assert not np.isnan(g).any(), f"d{name}: an element was never written"
        assert relative_error(g, w) < TOLERANCE[dtype], f"d{name}"


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,head_dim,heads_q,heads_kv", [("bf16", 64, 2, 1), ("fp16", 96, 2, 2),
                                                             ("bf16", 128, 3, 1), ("fp16", 256, 1, 1)])
def test_the_mfma_flash_backward_matches_float64(device, dtype, head_dim, heads_q, heads_kv, causal, deterministic):
    """Both schedules: the dK/dV kernel adding dQ into dq_accum with atomics (then convert_dq), and the
    dK/dV kernel without it plus the dQ kernel. Lengths around the 16-row and 64-key tiles, Q longer
    and shorter than KV, an empty KV (its rows get dQ = 0), and keys no query sees (causal);
    max_seqlen_q/k are upper bounds above the real maxima, as a graph captured for a capacity passes."""
    rng = np.random.default_rng()
    lengths_q = [18, 70, 5, 33, 40]
    lengths_k = [40, 70, 19, 0, 80]
    bits, exact, cu_q, cu_k = thd_inputs(rng, lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype)
    max_q, max_k = max(lengths_q) + 37, max(lengths_k) + 50
    out, lse = run_forward(device, bits, cu_q, cu_k, max_q, max_k, heads_q, dtype, causal)
    dout_bits = to_16bit(rng.standard_normal(bits["q"].shape), dtype)
    got = run_backward(device, bits, to_16bit(out, dtype), lse.astype(np.float32), dout_bits, cu_q, cu_k, max_q,
                       max_k, dtype, causal, deterministic=deterministic)
    # The reference starts from the same rounded inputs; the kernel's O and LSE are the forward's.
    want = reference_backward(exact["q"], exact["k"], exact["v"], from_16bit(dout_bits, dtype), lengths_q, lengths_k,
                              head_dim ** -0.5, causal)
    for name, g, w in zip("qkv", got, want, strict=True):
        assert not np.isnan(g).any(), f"d{name}: an element was never written"
        assert relative_error(g, w) < TOLERANCE[dtype], f"d{name}"


def test_the_mfma_flash_kernels_match_float64_in_batch_mode_with_seqused(device):
    """BSHD with per-sequence lengths (seqused): batch strides instead of cu_seqlens, rows past a
    sequence's length untouched by the forward and by dQ, causal, GQA, both dQ schedules."""
    rng = np.random.default_rng()
    dtype, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim = "bf16", 3, 40, 50, 4, 2, 64
    lengths_q, lengths_k = [40, 23, 1], [50, 19, 33]
    shapes = {"q": (batch, seqlen_q, heads_q, head_dim), "k": (batch, seqlen_k, heads_kv, head_dim),
              "v": (batch, seqlen_k, heads_kv, head_dim)}
    bits = {name: to_16bit(rng.standard_normal(shape), dtype) for name, shape in shapes.items()}
    exact = {name: from_16bit(b, dtype) for name, b in bits.items()}
    dout_bits = to_16bit(rng.standard_normal(shapes["q"]), dtype)
    used_q, used_k = np.array(lengths_q, np.int32), np.array(lengths_k, np.int32)
    seq = dict(seqused_q=device.array(used_q), seqused_k=device.array(used_k), causal=True)
    out = np.full(shapes["q"], NAN_BITS[dtype], np.uint16)
    lse = np.full((batch, heads_q, seqlen_q), np.nan, np.float32)
    inputs = [array_16bit(bits[n], dtype) for n in ("q", "k", "v")]
    hipattn.forward(*inputs, out=array_16bit(out, dtype), lse=device.array(lse), **seq)

    # The reference: each sequence's used rows, as THD.
    def packed(x, lengths):
        return np.concatenate([x[b, :n] for b, n in enumerate(lengths)])

    scale = head_dim ** -0.5
    want_out, _ = reference_forward(packed(exact["q"], lengths_q), packed(exact["k"], lengths_k),
                                    packed(exact["v"], lengths_k), lengths_q, lengths_k, scale, True)
    got_out = from_16bit(out, dtype)
    assert relative_error(packed(got_out, lengths_q), want_out) < TOLERANCE[dtype]
    assert all(np.isnan(got_out[b, n:]).all() for b, n in enumerate(lengths_q)), "rows past seqused are untouched"

    want = reference_backward(packed(exact["q"], lengths_q), packed(exact["k"], lengths_k),
                              packed(exact["v"], lengths_k), packed(from_16bit(dout_bits, dtype), lengths_q),
                              lengths_q, lengths_k, scale, True)
    for deterministic in (False, True):
        grads = {name: np.full(shapes[name], NAN_BITS[dtype], np.uint16) for name in shapes}
        arrays = [array_16bit(dout_bits, dtype), *inputs, array_16bit(out, dtype)]
        workspace = aligned_bytes(hipattn.backward_workspace_bytes(*inputs, **seq, deterministic=deterministic))
        hipattn.backward(*arrays, device.array(lse), dq=array_16bit(grads["q"], dtype),
                         dk=array_16bit(grads["k"], dtype), dv=array_16bit(grads["v"], dtype),
                         workspace=device.array(workspace), deterministic=deterministic, **seq)
        for name, lengths, w in zip("qkv", (lengths_q, lengths_k, lengths_k), want, strict=True):
            got = from_16bit(grads[name], dtype)
            assert relative_error(packed(got, lengths), w) < TOLERANCE[dtype], f"d{name}, deterministic={deterministic}"
