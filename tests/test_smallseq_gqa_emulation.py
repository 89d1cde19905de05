"""The grouped-heads (GQA/MQA) tensor-core small-seq kernels on an emulated sm_80 (tests/support/emulation.py),
through hipattn's own launch path, against a float64 reference: every head_dim, both dtypes, groups of
2, 3, 4, 8 (MQA) and 16 query heads, causal and not, sliding windows (with the one-problem-per-head
kernels too), sequences of 0, 1 and 17 tokens on either side, THD and BSHD with seqused, batch 0 and 1,
and teams that walk runs of groups. Outputs are poisoned with NaN first; every element is compared, and
rows past a sequence must stay unwritten."""

from __future__ import annotations

import numpy as np
import pytest
from support.emulation import EmulatedDevice, from_16bit, needs_compiler, to_16bit
from support.raw_calls import (
    check_bshd_forward_and_backward,
    check_forward_and_backward,
    run_backward,
    run_forward,
    thd_inputs,
)
from support.reference import (
    assert_forward_matches,
    assert_gradients_match,
    reference_backward,
    reference_forward,
)

from hipattn.catalog import smallseq
from hipattn.catalog.smallseq import SmallSeqBackwardGqaMmaTiles, SmallSeqForwardGqaMmaTiles, SmallSeqMmaTiles

pytestmark = needs_compiler

GROUPED = ["smallseq_forward_gqa_mma", "smallseq_backward_gqa_mma"]

# Sequences of 0 to 17 tokens: Q longer and shorter than KV, empty Q, empty KV, one token on either side.
LENGTHS_Q = [17, 1, 0, 9, 17, 4, 1, 13]
LENGTHS_K = [17, 5, 3, 0, 12, 17, 1, 1]

# (Hq, Hkv): groups of 2, 3 (odd: its chunks of 16 stacked rows split tokens), 4, 8 (MQA) and 16.
HEADS = [(4, 2), (6, 2), (8, 2), (8, 1), (16, 1)]


@pytest.fixture
def device(emulation_dirs, monkeypatch):
    return EmulatedDevice(*emulation_dirs, monkeypatch, arch="sm_80")


def grouped_kernels_match(device, rng, lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype, causal):
    check_forward_and_backward(device, rng, lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype, causal, max_q=17,
                               max_k=17)
    assert device.kernels == GROUPED


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads_q,heads_kv", HEADS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_the_grouped_kernels_match_float64(device, dtype, head_dim, heads_q, heads_kv, causal):
    """One team per (sequence, KV head) group: at head_dim 256 the forward's teams are two warps and
    the backward's four, meeting at barriers; at 64 and 128 a block holds several teams."""
    grouped_kernels_match(device, np.random.default_rng(), LENGTHS_Q, LENGTHS_K, heads_q, heads_kv, head_dim,
                               dtype, causal)


# Sliding windows, flash-attn's window_size=(left, right) (-1: no bound on that side), with causal or
# not (causal makes the right side 0): windows cut by either end of a sequence, rows whose window holds
# no key, each side bounded alone. A one-key window, (0, 0), would give dQ = dK = 0 exactly in float64.
WINDOWS = [((2, 0), False), ((0, 3), False), ((1, 1), False), ((3, -1), False), ((-1, 2), False), ((0, 1), False),
           ((1, 1), True), ((3, -1), True)]


def _window_id(window_causal) -> str:
    (left, right), causal = window_causal
    return f"window{left},{right}" + ("-causal" if causal else "")


@pytest.mark.parametrize("window_causal", WINDOWS, ids=_window_id)
@pytest.mark.parametrize("heads_q,heads_kv", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("head_dim,dtype", [(64, "bf16"), (256, "fp16")])
def test_the_tensor_core_kernels_match_float64_with_windows(device, windowed, dtype, head_dim, heads_q, heads_kv,
                                                            window_causal):
    """The stacked rows' key masks (group_tiles.h key_bits, a row's [first, end) keys as bits), and with
    Hq = Hkv the one-problem-per-head kernels (smallseq/forward_mma.hip, backward_mma.hip)."""
    window, causal = window_causal
    windowed(window)
    check_forward_and_backward(device, np.random.default_rng(), LENGTHS_Q, LENGTHS_K, heads_q, heads_kv, head_dim,
                               dtype, causal, max_q=17, max_k=17)
    assert device.kernels == (GROUPED if heads_q != heads_kv else ["smallseq_forward_mma", "smallseq_backward_mma"])


@pytest.mark.parametrize("groups_per_team", [2, 3])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_teams_walking_runs_of_groups_match_float64(device, monkeypatch, groups_per_team, head_dim):
    """A team walks several groups, as in a call of thousands of sequences: each group's K, V and chunk
    tiles land over the last one's, its runs cross sequences (and empty ones), and the chunk tiles and
    exchange slots alternate across groups."""
    monkeypatch.setattr(SmallSeqMmaTiles, "run_length", lambda tiles, problems: groups_per_team)
    rng = np.random.default_rng()
    lengths_q = [17, 0, 1, 5, 17, 0, 12, 3, 16, 1, 17]
    lengths_k = [17, 4, 1, 0, 9, 0, 17, 17, 2, 17, 3]
    grouped_kernels_match(device, rng, lengths_q, lengths_k, 9, 3, head_dim, "bf16", True)


# One query against one key alone would have dQ = dK = 0 exactly in float64 (P = 1), which rounding
# misses by 1e-8: relative errors need a reference that is not all zero. 1 x 1 sequences run inside
# the batches above.
@pytest.mark.parametrize("lengths", [([17], [17]), ([1], [2]), ([0], [17]), ([17], [0]), ([], [])],
                         ids=["17x17", "1x2", "no-query", "no-key", "batch-0"])
def test_batch_of_one_or_none(device, lengths):
    """Every array holds one row past the batch (after cu_seqlens[-1]), which must stay unwritten; it
    also keeps each array non-empty (NumPy gives an empty one zero strides, which hipattn refuses)."""
    lengths_q, lengths_k = lengths
    rng = np.random.default_rng()
    heads_q, heads_kv, head_dim, dtype = 8, 2, 128, "fp16"
    bits, exact, cu_q, cu_k = thd_inputs(rng, lengths_q + [1], lengths_k + [1], heads_q, heads_kv, head_dim, dtype)
    cu_q, cu_k = cu_q[:-1], cu_k[:-1]
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    scale = head_dim ** -0.5
    out, lse = run_forward(device, bits, cu_q, cu_k, 17, 17, heads_q, dtype, True)
    dout_bits = to_16bit(rng.standard_normal(bits["q"].shape), dtype)
    # The forward's outputs as the backward's inputs, the unwritten row past the batch made finite.
    got = run_backward(device, bits, to_16bit(np.nan_to_num(out), dtype),
                       np.where(np.isnan(lse), 0.0, lse).astype(np.float32), dout_bits, cu_q, cu_k, 17, 17, dtype, True)
    assert device.kernels == ([] if not lengths_q else GROUPED)
    assert np.isnan(out[total_q:]).all() and np.isnan(lse[:, total_q:]).all(), "a row past the batch was written"
    for g, total in zip(got, (total_q, total_k, total_k), strict=True):
        assert np.isnan(g[total:]).all(), "a gradient row past the batch was written"
    if not lengths_q:
        return
    rows = {"q": slice(0, total_q), "k": slice(0, total_k), "v": slice(0, total_k)}
    want_out, want_lse = reference_forward(exact["q"][rows["q"]], exact["k"][rows["k"]], exact["v"][rows["v"]],
                                           lengths_q, lengths_k, scale, True)
    if total_q:
        assert_forward_matches(out[:total_q], lse[:, :total_q], want_out, want_lse, dtype)
    want = reference_backward(exact["q"][rows["q"]], exact["k"][rows["k"]], exact["v"][rows["v"]],
                              from_16bit(dout_bits, dtype)[rows["q"]], lengths_q, lengths_k, scale, True)
    assert_gradients_match([g[rows[name]] for name, g in zip("qkv", got, strict=True)], want, dtype)


@pytest.mark.parametrize("head_dim,dtype", [(64, "bf16"), (128, "fp16"), (256, "bf16")])
def test_bshd_with_seqused_matches_float64_and_leaves_the_padding_alone(device, head_dim, dtype):
    used_q, used_k = [17, 0, 3, 9, 1, 12], [13, 5, 0, 2, 15, 1]
    check_bshd_forward_and_backward(device, np.random.default_rng(), used_q, used_k, 17, 15, 12, 4, head_dim, dtype,
                                    True)  # G = 3
    assert device.kernels == GROUPED


@pytest.fixture
def grouped_rows(monkeypatch):
    """Run the grouped kernels with other table rows: use(head_dim, forward_tiles, backward_tiles)."""
    def use(head_dim, forward_tiles, backward_tiles):
        monkeypatch.setitem(smallseq.SMALLSEQ_GQA_FORWARD_MMA_TILES, head_dim, forward_tiles)
        monkeypatch.setitem(smallseq.SMALLSEQ_GQA_BACKWARD_MMA_TILES, head_dim, backward_tiles)
    return use


@pytest.mark.parametrize("head_dim", [128, 256])
def test_blocks_of_several_multi_warp_teams_match_float64(device, grouped_rows, monkeypatch, head_dim):
    """Two teams of several warps a block, each with a named barrier of its own (the shipped rows have
    one such team a block, which meets at __syncthreads), walking runs of three groups."""
    split = head_dim // 64
    grouped_rows(head_dim, SmallSeqForwardGqaMmaTiles(warps=4, problems_per_team=3, split=2),
                 SmallSeqBackwardGqaMmaTiles(warps=2 * split, problems_per_team=3, split=split))
    monkeypatch.setattr(SmallSeqMmaTiles, "run_length", lambda tiles, problems: tiles.problems_per_team)
    lengths_q = [17, 0, 1, 5, 17, 0, 12, 3, 16, 1, 17]
    lengths_k = [17, 4, 1, 0, 9, 0, 17, 17, 2, 17, 3]
    grouped_kernels_match(device, np.random.default_rng(), lengths_q, lengths_k, 12, 4, head_dim, "fp16", True)
