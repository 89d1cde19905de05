"""The MFMA kernels on an emulated gfx950 (tests/support/emulation.py, HIPATTN_EMULATED_GFX950), against a
float64 reference: there they contract head_dim in pairs of k-steps with gfx950's 16x16x32 MFMA
(kernels/common/mma_amd.h, mfma_two_steps), which the emulator computes from AMD's documented layout
of that instruction (a lane holds eight k of a row, where the 16x16x16 one holds four). The gfx90a
files (tests/test_amd_emulation.py, tests/test_smallseq_mfma_emulation.py) check the same kernels
with the 16x16x16 instructions; this one takes a case per head_dim, dtype and kernel."""

from __future__ import annotations

import numpy as np
import pytest
from support.emulation import EmulatedDevice, needs_compiler
from support.raw_calls import check_forward, check_forward_and_backward

pytestmark = needs_compiler


@pytest.fixture
def device(emulation_dirs, monkeypatch):
    return EmulatedDevice(*emulation_dirs, monkeypatch, arch="gfx950")


def _loaded_families(device) -> set[str]:
    return {kernel.spec.family.name for kernel in device.registry.loaded()}


@pytest.mark.parametrize("dtype,head_dim,heads_q,heads_kv,causal", [
    ("bf16", 64, 2, 1, True), ("fp16", 96, 3, 1, False), ("fp16", 128, 2, 2, True), ("bf16", 256, 1, 1, False)])
def test_the_mfma_flash_forward_matches_float64(device, dtype, head_dim, heads_q, heads_kv, causal):
    check_forward(device, np.random.default_rng(), [18, 70, 5, 33], [40, 70, 19, 0], heads_q, heads_kv, head_dim,
                  dtype, causal)
    assert _loaded_families(device) == {"flash_forward_mfma"}


@pytest.mark.parametrize("dtype,head_dim,heads_q,heads_kv,causal,deterministic", [
    ("bf16", 64, 2, 1, True, False), ("fp16", 96, 2, 2, False, True), ("fp16", 128, 3, 1, True, True),
    ("bf16", 256, 1, 1, False, False)])
def test_the_mfma_flash_backward_matches_float64(device, dtype, head_dim, heads_q, heads_kv, causal, deterministic):
    lengths_q, lengths_k = [18, 70, 5, 33], [40, 70, 19, 0]
    check_forward_and_backward(device, np.random.default_rng(), lengths_q, lengths_k, heads_q, heads_kv, head_dim,
                               dtype, causal, max_q=max(lengths_q), max_k=max(lengths_k), deterministic=deterministic)
    assert "flash_backward_dkdv_mfma" in _loaded_families(device)


@pytest.mark.parametrize("dtype,head_dim,heads_q,heads_kv,softcap,alibi,causal,deterministic", [
    ("bf16", 64, 2, 1, 1.5, "heads", True, False), ("fp16", 96, 2, 2, 1.5, "sequences", False, True)])
def test_the_mfma_flash_kernels_match_float64_with_score_modifiers(device, score_modified, dtype, head_dim, heads_q,
                                                                   heads_kv, softcap, alibi, causal, deterministic):
    """Softcap and ALiBi on the 16x16x32 path: the forward's scores, and P and dS (times 1 - tanh²) as
    the backward recomputes them, on one dQ schedule each."""
    lengths_q, lengths_k = [18, 70, 5, 33, 0], [100, 130, 19, 0, 7]
    score_modified(device, len(lengths_q), heads_q, softcap=softcap, alibi=alibi)
    check_forward_and_backward(device, np.random.default_rng(), lengths_q, lengths_k, heads_q, heads_kv, head_dim,
                               dtype, causal, deterministic=deterministic)
    assert {"flash_forward_mfma", "flash_backward_dkdv_mfma"} <= _loaded_families(device)


@pytest.mark.parametrize("dtype,head_dim,heads_q,heads_kv,causal", [
    ("bf16", 64, 8, 2, True), ("fp16", 128, 4, 4, False), ("bf16", 256, 2, 1, False)])
def test_the_mfma_small_seq_kernels_match_float64(device, dtype, head_dim, heads_q, heads_kv, causal):
    check_forward_and_backward(device, np.random.default_rng(), [17, 1, 0, 9, 12], [17, 5, 3, 0, 17], heads_q,
                               heads_kv, head_dim, dtype, causal, max_q=17, max_k=17)
    assert _loaded_families(device) == {"smallseq_forward_mfma", "smallseq_backward_mfma"}
