"""The NVIDIA mma.sync kernels, run on an emulated sm_80 (tests/support/emulation.py: the CPU as a warp32
GPU with mma.sync m16n8k16, ldmatrix, cp.async and named barriers), against a float64 reference,
through hipattn's own launch path (hipattn.forward / hipattn.backward with raw arrays): the small-seq
tensor-core forward and backward, and the flash forward and backward. Outputs are poisoned with NaN
first and every element is compared; the emulated instructions follow PTX's documented layouts, cp.async
copies land only at the waits that cover them, and ldmatrix reads each row as its lane arrives (see
emulation/emulated_sm80.h for what emulation cannot show). These run before a kernel reaches a GPU."""

from __future__ import annotations

import numpy as np
import pytest
from support.emulation import EmulatedDevice, needs_compiler
from support.raw_calls import check_forward, check_forward_and_backward
from support.reference import DROPOUT_CASES, DROPOUT_P, DROPOUT_SEED, SCORE_MODIFIER_CASES

from hipattn.catalog.smallseq import SmallSeqMmaTiles

pytestmark = needs_compiler


@pytest.fixture
def device(emulation_dirs, monkeypatch):
    return EmulatedDevice(*emulation_dirs, monkeypatch, arch="sm_80")


# ---- small-seq tensor-core kernels (every sequence within the 17-token tile) ----------------------

# Sequences of 0 to 17 tokens, Q longer and shorter than KV, an empty Q and an empty KV.
SMALLSEQ_LENGTHS_Q = [17, 1, 0, 9, 17, 4]
SMALLSEQ_LENGTHS_K = [17, 5, 3, 0, 12, 17]


@pytest.fixture(params=["one problem per team", "the table's run"])
def team_runs(request, monkeypatch):
    """Teams walk one problem each (a small call), or their table row's run of problems, as in a call
    of tens of thousands: each problem's tiles then land over the last one's."""
    if request.param == "the table's run":
        monkeypatch.setattr(SmallSeqMmaTiles, "run_length", lambda tiles, problems: tiles.problems_per_team)
    return request.param


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,head_dim", [("bf16", 64), ("fp16", 128), ("bf16", 256)])
def test_the_small_seq_tensor_core_kernels_match_float64(device, team_runs, dtype, head_dim, causal):
    """Forward, then backward (Hq == Hkv, the tensor-core backward's case). At head_dim 256 two warps
    share each problem's columns and meet at named barriers."""
    check_forward_and_backward(device, np.random.default_rng(), SMALLSEQ_LENGTHS_Q, SMALLSEQ_LENGTHS_K, 4, 4, head_dim,
                               dtype, causal, max_q=17, max_k=17)
    assert device.kernels == ["smallseq_forward_mma", "smallseq_backward_mma"]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,head_dim,heads_q,heads_kv", [("fp16", 64, 4, 1), ("fp16", 256, 4, 2)])
def test_the_small_seq_tensor_core_forward_matches_float64_with_gqa(device, team_runs, dtype, head_dim, heads_q,
                                                                    heads_kv, causal):
    check_forward(device, np.random.default_rng(), SMALLSEQ_LENGTHS_Q, SMALLSEQ_LENGTHS_K, heads_q, heads_kv, head_dim,
                  dtype, causal, max_q=17, max_k=17)
    assert device.kernels == ["smallseq_forward_gqa_mma"]  # Hq != Hkv: one team per (sequence, KV head) group


# ---- flash kernels (mma.sync: FlashAttention-2's forward and its two-kernel backward) ---------------

# THD sequences past the small-seq bound: one longer than a 128-row query block whose keys fill more
# 64-key tiles than the forward's K/V ring has slots, Q longer and shorter than KV, an empty KV and an
# empty Q.
FLASH_LENGTHS_Q = [18, 150, 5, 33, 0, 40]
FLASH_LENGTHS_K = [40, 200, 19, 0, 7, 21]
# The backward tests' sequences: FLASH_LENGTHS_Q with a KV past its longest query (80 > 40), so that
# causal leaves keys no query sees.
BACKWARD_LENGTHS_Q = FLASH_LENGTHS_Q
BACKWARD_LENGTHS_K = [40, 200, 19, 0, 7, 80]
# Every head_dim the flash kernels have, each with one dtype (every kernel is instantiated for both),
# GQA at three of them.
FLASH_CASES = [("bf16", 64, 2, 1), ("fp16", 96, 3, 1), ("bf16", 128, 2, 2), ("fp16", 256, 2, 1)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,head_dim,heads_q,heads_kv", FLASH_CASES)
def test_the_flash_forward_matches_float64(device, dtype, head_dim, heads_q, heads_kv, causal):
    check_forward(device, np.random.default_rng(), FLASH_LENGTHS_Q, FLASH_LENGTHS_K, heads_q, heads_kv, head_dim, dtype,
                  causal)
    assert device.kernels == ["flash_forward_mma"]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,head_dim,heads_q,heads_kv", FLASH_CASES)
def test_the_flash_backward_matches_float64(device, dtype, head_dim, heads_q, heads_kv, causal, deterministic):
    """Both dQ schedules: the dK/dV kernel adding dQ into dq_accum with atomics (then convert_dq), and
    the dK/dV kernel without it plus the dQ kernel. The varlen work list comes from the device
    (varlen_records). An empty KV (its rows get dQ = 0), an empty Q (its keys get dK = dV = 0), keys no
    query sees (causal); max_seqlen_q/k are upper bounds above the real maxima, as a graph captured
    for a capacity passes."""
    lengths_q, lengths_k = BACKWARD_LENGTHS_Q, BACKWARD_LENGTHS_K
    check_forward_and_backward(device, np.random.default_rng(), lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype,
                               causal, max_q=max(lengths_q) + 37, max_k=max(lengths_k) + 50, deterministic=deterministic)
    dq_kernels = ["flash_backward_dq_mma"] if deterministic else ["bwd_convert_dq"]
    assert device.kernels == ["flash_forward_mma", "varlen_records", "bwd_dot_do_o", "flash_backward_dkdv_mma",
                              *dq_kernels]


# Sliding windows (flash-attn's window_size, -1: no bound on that side): a left side that skips the
# first key tiles of long rows, a right side that leaves rows of short KV sequences no key at all, both
# sides within one 64-key tile, and causal with a left side (a band under the diagonal).
FLASH_WINDOWS = [((70, -1), False), ((5, 30), False), ((16, 16), False), ((40, 0), True)]


@pytest.mark.parametrize("window_causal", FLASH_WINDOWS, ids=lambda wc: f"window{wc[0]}" + ("-causal" * wc[1]))
@pytest.mark.parametrize("dtype,head_dim,heads_q,heads_kv", [FLASH_CASES[0], FLASH_CASES[2]])
def test_the_flash_kernels_match_float64_with_windows(device, windowed, dtype, head_dim, heads_q, heads_kv,
                                                      window_causal):
    """The forward's key-tile range and its masks at both window edges; the dK/dV kernel's query-tile
    range (rows_seeing) and the deterministic dQ kernel's key-tile range."""
    window, causal = window_causal
    windowed(window)
    lengths_q, lengths_k = BACKWARD_LENGTHS_Q, BACKWARD_LENGTHS_K
    check_forward_and_backward(device, np.random.default_rng(), lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype,
                               causal, deterministic=True)
    assert device.kernels == ["flash_forward_mma", "varlen_records", "bwd_dot_do_o", "flash_backward_dkdv_mma",
                              "flash_backward_dq_mma"]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("softcap,alibi,causal", SCORE_MODIFIER_CASES, ids=lambda m: str(m))
@pytest.mark.parametrize("dtype,head_dim,heads_q,heads_kv", [FLASH_CASES[0], FLASH_CASES[2]])
def test_the_flash_kernels_match_float64_with_score_modifiers(device, score_modified, dtype, head_dim, heads_q,
                                                              heads_kv, softcap, alibi, causal, deterministic):
    """The forward's scores in its masked and unmasked tiles, the dK/dV kernel's recomputed P and dS
    (times 1 - tanh² under softcap) on both dQ schedules, and the dQ kernel's."""
    lengths_q, lengths_k = BACKWARD_LENGTHS_Q, BACKWARD_LENGTHS_K
    score_modified(device, len(lengths_q), heads_q, softcap=softcap, alibi=alibi)
    check_forward_and_backward(device, np.random.default_rng(), lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype,
                               causal, deterministic=deterministic)
    dq_kernels = ["flash_backward_dq_mma"] if deterministic else ["bwd_convert_dq"]
    assert device.kernels == ["flash_forward_mma", "varlen_records", "bwd_dot_do_o", "flash_backward_dkdv_mma",
                              *dq_kernels]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("window_causal", DROPOUT_CASES, ids=["full", "causal", "window"])
@pytest.mark.parametrize("dtype,head_dim,heads_q,heads_kv", [FLASH_CASES[0], FLASH_CASES[3]])
def test_the_flash_kernels_match_float64_with_dropout(device, dropped, windowed, dtype, head_dim, heads_q, heads_kv,
                                                      window_causal, deterministic):
    """dropout_p = 0.17 under a seed with both 32-bit halves set, on short sequences (which the small-seq
    kernels would take without dropout) and long ones: the forward drops what
    hipattn.dropout.keep_mask drops (head_dim 64: whole 32-key stripes per call; 256: the forward's
    32-key and the dQ kernel's 16-key tiles), and the dK/dV and dQ kernels regenerate the same mask."""
    window, causal = window_causal
    windowed(window)
    lengths_q = [18, 150, 5, 33, 0, 40, 3]
    lengths_k = [40, 200, 19, 0, 7, 80, 9]
    dropped(device, DROPOUT_P, seed=DROPOUT_SEED)
    check_forward_and_backward(device, np.random.default_rng(), lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype,
                               causal, deterministic=deterministic)
    dq_kernels = ["flash_backward_dq_mma"] if deterministic else ["bwd_convert_dq"]
    assert device.kernels == ["flash_forward_mma", "varlen_records", "bwd_dot_do_o", "flash_backward_dkdv_mma",
                              *dq_kernels]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,head_dim,heads_q,heads_kv", [FLASH_CASES[0], FLASH_CASES[2]])
def test_the_flash_kernels_match_float64_with_learnable_sinks(device, sinked, dtype, head_dim, heads_q, heads_kv,
                                                              causal):
    """A sink logit per query head (one far above the scores, one far below) joins each row's
    denominator in the forward's last normalization and its LSE, so a row that sees no key gets O = 0
    and LSE = the sink; the backward, unchanged, reads that LSE."""
    sinked(device, np.array([3.0, -4.0, 0.5, 1.5])[:heads_q])
    lengths_q, lengths_k = BACKWARD_LENGTHS_Q, BACKWARD_LENGTHS_K
    check_forward_and_backward(device, np.random.default_rng(), lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype,
                               causal, deterministic=True)
    assert device.kernels == ["flash_forward_mma", "varlen_records", "bwd_dot_do_o", "flash_backward_dkdv_mma",
                              "flash_backward_dq_mma"]
