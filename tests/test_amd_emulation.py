"""The AMD kernels, run on an emulated gfx90a (tests/support/emulation.py: the CPU as a wave64 GPU with MFMA),
against a float64 reference: the MFMA flash forward and backward, and the portable small-seq forward and
backward that AMD targets without MFMA run (the MFMA small-seq kernels have their own file,
tests/test_smallseq_mfma_emulation.py). No AMD GPU exists here; this is where those kernels'
arithmetic is checked (the portable small-seq kernels also run on the H200, at wave32, in tests/gpu). Outputs are poisoned with
NaN first and every element is compared; the emulated MFMA follows AMD's documented fragment layouts
(see emulation/emulated_device.h for what emulation cannot show)."""

from __future__ import annotations

import numpy as np
import pytest
from support.emulation import EmulatedDevice, needs_compiler
from support.raw_calls import (
    check_bshd_forward_and_backward,
    check_forward,
    check_forward_and_backward,
)
from support.reference import DROPOUT_CASES, DROPOUT_P, DROPOUT_SEED, SCORE_MODIFIER_CASES

from hipattn.ops import smallseq

pytestmark = needs_compiler


@pytest.fixture
def device(emulation_dirs, monkeypatch):
    return EmulatedDevice(*emulation_dirs, monkeypatch)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim,heads_q,heads_kv", [(64, 2, 1), (96, 3, 1), (128, 2, 2), (256, 1, 1)])
def test_the_mfma_flash_forward_matches_float64(device, dtype, causal, head_dim, heads_q, heads_kv):
    # Lengths past the small-seq bound (18 and up), around the 16-row tiles, Q longer and shorter than KV,
    # and an empty KV.
    lengths_q = [18, 70, 5, 33, 40]
    lengths_k = [40, 70, 19, 0, 21]
    check_forward(device, np.random.default_rng(), lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype, causal)
    assert device.backend.launches == 1, "the flash path ran (not the small-seq one)"


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim,heads_q,heads_kv", [(64, 4, 4), (64, 4, 1), (128, 8, 2), (256, 8, 8)])
def test_the_portable_small_seq_kernels_match_float64_at_wave64(device, monkeypatch, dtype, causal, head_dim,
                                                                heads_q, heads_kv):
    """The small-seq path of AMD targets without MFMA (portable kernels, teams of head_dim / 4 lanes:
    four, two or one a 64-lane wave), forced on the emulated gfx90a: forward, and backward with dK/dV
    summed over a GQA group."""
    monkeypatch.setenv(smallseq.KERNEL_SWITCH, "portable")
    lengths_q = [17, 1, 0, 9, 17, 4]
    lengths_k = [17, 5, 3, 0, 12, 17]
    check_forward_and_backward(device, np.random.default_rng(), lengths_q, lengths_k, heads_q, heads_kv, head_dim,
                               dtype, causal, max_q=17, max_k=17)
    assert device.backend.launches == 2, "one small-seq kernel each way"


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,head_dim,heads_q,heads_kv", [("bf16", 64, 2, 1), ("fp16", 96, 2, 2),
                                                             ("bf16", 128, 3, 1), ("fp16", 256, 1, 1)])
def test_the_mfma_flash_backward_matches_float64(device, dtype, head_dim, heads_q, heads_kv, causal, deterministic):
    """Both schedules: the dK/dV kernel adding dQ into dq_accum with atomics (then convert_dq), and the
    dK/dV kernel without it plus the dQ kernel. Lengths around the 16-row and 64-key tiles, Q longer
    and shorter than KV, an empty KV (its rows get dQ = 0), and keys no query sees (causal);
    max_seqlen_q/k are upper bounds above the real maxima, as a graph captured for a capacity passes."""
    lengths_q = [18, 70, 5, 33, 40]
    lengths_k = [40, 70, 19, 0, 80]
    check_forward_and_backward(device, np.random.default_rng(), lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype,
                               causal, max_q=max(lengths_q) + 37, max_k=max(lengths_k) + 50, deterministic=deterministic)


# Sliding windows (flash-attn's window_size, -1: no bound on that side): a left side that skips the
# first key tiles, a right side that leaves the rows of a short KV sequence no key, a band within one
# tile, and causal with a left side.
FLASH_WINDOWS = [((40, -1), False), ((3, 20), False), ((8, 8), False), ((24, 0), True)]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("window_causal", FLASH_WINDOWS, ids=lambda wc: f"window{wc[0]}" + ("-causal" * wc[1]))
def test_the_mfma_flash_kernels_match_float64_with_windows(device, windowed, window_causal, deterministic):
    """The forward's key-tile range and masks at both window edges, the dK/dV kernel's query tiles
    (rows_seeing), and the dQ kernel's key range."""
    window, causal = window_causal
    windowed(window)
    lengths_q = [18, 70, 5, 33, 40]
    lengths_k = [40, 70, 19, 0, 80]
    check_forward_and_backward(device, np.random.default_rng(), lengths_q, lengths_k, 2, 1, 64, "bf16", causal,
                               deterministic=deterministic)


def test_the_mfma_flash_kernels_match_float64_in_batch_mode_with_seqused(device):
    """BSHD with per-sequence lengths (seqused): batch strides instead of cu_seqlens, rows past a
    sequence's length left alone, causal, GQA, both dQ schedules."""
    for deterministic in (False, True):
        check_bshd_forward_and_backward(device, np.random.default_rng(), [40, 23, 1], [50, 19, 33], 40, 50, 4, 2, 64,
                                        "bf16", True, deterministic=deterministic,
                                        dq_padding_written=not deterministic)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("heads_q,heads_kv,head_dim", [(4, 2, 64), (4, 2, 128), (2, 2, 64)],
                         ids=["gqa-key-tile-first", "gqa-key-tile-fastest", "mha"])
def test_the_mfma_flash_backward_reaches_every_key_tile_of_a_causal_batch(device, heads_q, heads_kv, head_dim,
                                                                         deterministic):
    """BSHD across several 64-key tiles per sequence, causal: the dK/dV grid starts every key tile 0
    first with grouped-query heads where a tile holds head_dim keys (64), and walks each sequence's
    tiles in turn otherwise (head_dim 128, or one head per block; flash/backward_common.h
    key_block_of); either way every (key tile, sequence, KV head) gets its gradients once."""
    check_bshd_forward_and_backward(device, np.random.default_rng(), [150, 97, 64], [170, 130, 64], 150, 170, heads_q,
                                    heads_kv, head_dim, "bf16", True, deterministic=deterministic,
                                    dq_padding_written=not deterministic)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("softcap,alibi,causal", SCORE_MODIFIER_CASES, ids=lambda m: str(m))
@pytest.mark.parametrize("dtype,head_dim,heads_q,heads_kv", [("bf16", 64, 2, 1), ("fp16", 128, 3, 1)])
def test_the_mfma_flash_kernels_match_float64_with_score_modifiers(device, score_modified, dtype, head_dim, heads_q,
                                                                   heads_kv, softcap, alibi, causal, deterministic):
    """The forward's scores in its masked and unmasked key tiles (a short Q against a long KV has
    unmasked tiles under causal too), the dK/dV kernel's recomputed P and dS (times 1 - tanh² under
    softcap) for each query head of a GQA group on both dQ schedules, and the dQ kernel's."""
    lengths_q = [18, 70, 5, 33, 0, 40]
    lengths_k = [100, 130, 19, 0, 7, 80]
    score_modified(device, len(lengths_q), heads_q, softcap=softcap, alibi=alibi)
    check_forward_and_backward(device, np.random.default_rng(), lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype,
                               causal, deterministic=deterministic)
    dq_kernels = ["flash_backward_dq_mfma"] if deterministic else ["bwd_convert_dq"]
    assert device.kernels == ["flash_forward_mfma", "varlen_records", "bwd_dot_do_o", "flash_backward_dkdv_mfma",
                              *dq_kernels]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("window_causal", DROPOUT_CASES, ids=["full", "causal", "window"])
@pytest.mark.parametrize("dtype,head_dim,heads_q,heads_kv", [("bf16", 64, 2, 1), ("fp16", 256, 2, 2)])
def test_the_mfma_flash_kernels_match_float64_with_dropout(device, dropped, windowed, dtype, head_dim, heads_q,
                                                           heads_kv, window_causal, deterministic):
    """dropout_p = 0.17 under a seed with both 32-bit halves set: the forward drops what
    hipattn.dropout.keep_mask drops and scales the rest; the dK/dV kernel (for each query head of a GQA
    group) and the dQ kernel regenerate the same mask. A kernel that dropped other entries, or none,
    would be off by about the dropped share of O."""
    window, causal = window_causal
    windowed(window)
    lengths_q = [18, 70, 5, 33, 0, 40]
    lengths_k = [100, 130, 19, 0, 7, 80]
    dropped(device, DROPOUT_P, seed=DROPOUT_SEED)
    check_forward_and_backward(device, np.random.default_rng(), lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype,
                               causal, deterministic=deterministic)
    dq_kernels = ["flash_backward_dq_mfma"] if deterministic else ["bwd_convert_dq"]
    assert device.kernels == ["flash_forward_mfma", "varlen_records", "bwd_dot_do_o", "flash_backward_dkdv_mfma",
                              *dq_kernels]


@pytest.mark.parametrize("causal", [False, True])
def test_the_mfma_flash_kernels_match_float64_with_learnable_sinks(device, sinked, causal):
    """The MFMA forward's epilogue adds each head's sink to the denominator and the LSE (a row with no
    key: O = 0, LSE = the sink); the backward reads that LSE."""
    sinked(device, np.array([3.0, -4.0]))
    lengths_q = [18, 70, 5, 33, 0, 40]
    lengths_k = [100, 130, 19, 0, 7, 80]
    check_forward_and_backward(device, np.random.default_rng(), lengths_q, lengths_k, 2, 1, 64, "bf16", causal,
                               deterministic=False)
    assert device.kernels == ["flash_forward_mfma", "varlen_records", "bwd_dot_do_o", "flash_backward_dkdv_mfma",
                              "bwd_convert_dq"]
