"""tools.bench_matrix on the CPU: the cell list, the floors' arithmetic, the ratios and summary,
the markdown and heat map from a synthetic JSON, the A/B comparison, the CLI's GPU-free commands,
and the orchestration (interleaving, failing peers, budget, crashed workers) with a fake measurer.

The GPU side's runners are tested in test_bench_matrix_runners.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tools.matrix import cells, report, run

# The tool's command line, run from the repository root as its users run it.
TOOL = [sys.executable, "-m", "tools.bench_matrix"]
REPOSITORY = run.REPOSITORY


# ---- the cells -----------------------------------------------------------------------------------

def test_cell_names_are_unique_and_every_section_is_there():
    every = cells.all_cells()
    names = [c.name for c in every]
    assert len(names) == len(set(names))
    counts = {s: sum(1 for c in every if c.section == s) for s in cells.SECTIONS}
    # 3 head_dims x 6 head groupings x 2 directions; 4 x 2 x 2 x 6 x 2; 2 x 2 x 2; the decode shapes;
    # the window shapes x 2 directions and the window decode steps; the score-modifier and dropout
    # shapes x 2 directions
    assert counts == {"smallseq": 36, "batch": 192, "varlen": 8,
                      "decode": len(cells.DECODE_SHAPES) + len(cells.DECODE_PAGED_SHAPES),
                      "window": 2 * len(cells.WINDOW_SHAPES) + len(cells.WINDOW_DECODE_SHAPES),
                      "scoremod": 2 * len(cells.SCOREMOD_SHAPES), "dropout": 2 * len(cells.DROPOUT_SHAPES)}
    assert counts["scoremod"] == 14
    assert "smallseq/d128/h16:4/fwd" in names
    assert "batch/d96/h16:4/s16384/causal/fwdbwd" in names
    assert "decode/d128/h32:8/b1/kv131072/fwd" in names
    assert all(cells.by_name(n).name == n for n in names)


def test_window_cells_are_named_by_their_window_and_the_others_keep_their_names():
    names = {c.name for c in cells.all_cells()}
    for name in ("window/d128/h16:4/s16384/w1023,0/causal/fwd", "window/d128/h16:4/s4096/w1023,0/causal/fwdbwd",
                 "window/d128/h16:4/s4096/w512,512/noncausal/fwd", "window/d128/h16:4/s16384/w4095,0/causal/fwdbwd",
                 "window/d64/h16:4/s16384/w1023,0/causal/fwdbwd", "window/d128/h16:16/s16384/w1023,0/causal/fwd",
                 "window/d128/h32:8/b8/kv32768/w4095,0/causal/fwd", "window/d128/h32:8/b64/kv4096/w1023,0/causal/fwd"):
        assert name in names
    cell = cells.by_name("window/d128/h16:4/s16384/w1023,0/causal/fwd")
    assert (cell.window, cell.causal, cell.batch, cell.seqlen_q, cell.seqlen_k) == ((1023, 0), True, 1, 16384, 16384)
    assert cell.params()["window_left"] == 1023 and cell.layout == "bshd" and not cell.is_decode
    decode = cells.by_name("window/d128/h32:8/b8/kv32768/w4095,0/causal/fwd")
    assert decode.is_decode and decode.seqlen_q == 1 and decode.window == (4095, 0)
    for c in cells.all_cells():
        assert c.windowed == (c.section == "window")  # a window field is set only in the window section
        assert c.is_decode == (c.section == "decode" or (c.section == "window" and c.seqlen_q == 1))
        assert ",".join(map(str, c.window)) in c.name or not c.windowed
    # the default window leaves every other cell's name as it was
    plain = cells.Cell("batch", "fwd", 128, 16, 4, True, batch=4, seqlen_q=4096, seqlen_k=4096)
    assert plain.window == cells.NO_WINDOW and plain.name == "batch/d128/h16:4/s4096/causal/fwd"


SCOREMOD_NAMES = (
    "scoremod/d128/h16:4/s4096/cap50/noncausal/fwd", "scoremod/d128/h16:4/s4096/cap50/noncausal/fwdbwd",
    "scoremod/d128/h16:4/s4096/cap50/causal/fwd", "scoremod/d128/h16:4/s4096/cap50/causal/fwdbwd",
    "scoremod/d128/h16:4/s4096/alibi/noncausal/fwd", "scoremod/d128/h16:4/s4096/alibi/noncausal/fwdbwd",
    "scoremod/d128/h16:4/s4096/alibi/causal/fwd", "scoremod/d128/h16:4/s4096/alibi/causal/fwdbwd",
    "scoremod/d128/h16:4/s16384/alibi/causal/fwd", "scoremod/d128/h16:4/s16384/alibi/causal/fwdbwd",
    "scoremod/d64/h16:4/s4096/cap50/causal/fwd", "scoremod/d64/h16:4/s4096/cap50/causal/fwdbwd",
    "scoremod/d128/h16:4/s4096/cap50,alibi/causal/fwd", "scoremod/d128/h16:4/s4096/cap50,alibi/causal/fwdbwd",
)


def _parse_scoremod(name: str) -> dict:
    """A scoremod cell's parameters read back from its name alone."""
    section, head_dim, heads, seqlen, modifiers, mask, direction = name.split("/")
    heads_q, heads_kv = heads[1:].split(":")
    parts = modifiers.split(",")
    caps = [float(part[3:]) for part in parts if part.startswith("cap")]
    assert set(parts) <= {"alibi", *(f"cap{cap:g}" for cap in caps)} and len(caps) <= 1
    return {"section": section, "head_dim": int(head_dim[1:]), "heads_q": int(heads_q), "heads_kv": int(heads_kv),
            "seqlen_q": int(seqlen[1:]), "seqlen_k": int(seqlen[1:]), "softcap": caps[0] if caps else 0.0,
            "alibi": "alibi" in parts, "causal": {"causal": True, "noncausal": False}[mask], "direction": direction}


def test_scoremod_cells_are_named_by_their_modifiers_and_parse_back():
    chosen = [c for c in cells.all_cells() if c.section == "scoremod"]
    assert tuple(c.name for c in chosen) == SCOREMOD_NAMES
    for c in chosen:
        parsed = _parse_scoremod(c.name)
        assert {key: getattr(c, key) for key in parsed} == parsed
        assert c.batch * c.seqlen_q == cells.BATCH_TOKENS and c.layout == "bshd" and not c.windowed
        assert c.score_modified and c.softcap in (0.0, 50.0)
        assert c.params()["softcap"] == c.softcap and c.params()["alibi"] == c.alibi
    # both modifiers, each alone, both directions and masks; one head_dim 64 shape, one at S 16384
    assert {c.modifiers for c in chosen} == {"cap50", "alibi", "cap50,alibi"}
    assert {c.head_dim for c in chosen} == {64, 128} and {c.seqlen_q for c in chosen} == {4096, 16384}
    assert {(c.heads_q, c.heads_kv) for c in chosen} == {(16, 4)}
    for modifiers in ("cap50", "alibi"):
        assert {(c.causal, c.direction) for c in chosen if c.modifiers == modifiers} == {
            (causal, direction) for causal in (False, True) for direction in ("fwd", "fwdbwd")}
    for c in cells.all_cells():  # a modifier is set only in the scoremod section
        assert c.score_modified == (c.section == "scoremod")
    plain = cells.Cell("batch", "fwd", 128, 16, 4, True, batch=4, seqlen_q=4096, seqlen_k=4096)
    assert plain.modifiers == "" and plain.name == "batch/d128/h16:4/s4096/causal/fwd"
    assert cells.modifier_name(30.0, False) == "cap30" and cells.modifier_name(2.5, True) == "cap2.5,alibi"


def test_alibi_slopes_are_the_alibi_paper_s_geometric_series():
    slopes = cells.alibi_slopes(16)
    assert slopes[0] == 2.0 ** -0.5 and slopes[-1] == 2.0 ** -8
    assert all(b / a == pytest.approx(2.0 ** -0.5) for a, b in zip(slopes, slopes[1:], strict=False))
    assert cells.alibi_slopes(8) == tuple(2.0 ** -(h + 1) for h in range(8))  # the paper's 1/2 .. 1/256


def test_quick_is_a_subset_of_the_full_list_with_every_section():
    quick, full = cells.select(quick=True), cells.select()
    assert {c.name for c in quick} < {c.name for c in full}
    assert {c.section for c in quick} == set(cells.SECTIONS)
    assert [c.name for c in full[:len(quick)]] == [c.name for c in quick]  # measured first in a full run
    assert sorted(c.name for c in full) == sorted(c.name for c in cells.all_cells())
    assert set(cells.REST_ORDER) == set(cells.SECTIONS)
    window = [c for c in quick if c.section == "window"]
    assert sorted(c.direction for c in window) == ["fwd", "fwdbwd"]  # one of each
    assert any(cells.prescreen(c, "sdpa_masked") is None for c in window)  # one has the masked reference too
    scoremod = [c for c in quick if c.section == "scoremod"]
    assert sorted((c.modifiers, c.direction) for c in scoremod) == [("alibi", "fwd"), ("cap50", "fwdbwd")]
    alibi = next(c for c in scoremod if c.alibi)
    assert cells.prescreen(alibi, "sdpa_bias") is None  # the ALiBi one has the SDPA reference too


def test_only_keeps_the_cells_whose_name_matches():
    chosen = cells.select(only=r"^smallseq/d256/.*/bwd$")
    assert [c.name for c in chosen] == [f"smallseq/d256/h{q}:{k}/bwd" for q, k in cells.SMALLSEQ_HEADS]
    assert cells.select(quick=True, only="decode") == [c for c in cells.quick_cells() if c.section == "decode"]
    assert cells.select(only="no such cell") == []


def test_the_batch_cells_hold_a_fixed_token_count():
    for c in cells.all_cells():
        if c.section in ("batch", "scoremod") or (c.section == "window" and not c.is_decode):
            assert c.batch * c.seqlen_q == cells.BATCH_TOKENS and c.seqlen_q == c.seqlen_k


def test_small_seq_lengths_are_drawn_from_1_to_17_independently_and_reproducibly():
    lengths_q, lengths_k = cells.smallseq_lengths()
    assert len(lengths_q) == len(lengths_k) == cells.SMALLSEQ_SEQUENCES
    assert min(lengths_q) == min(lengths_k) == 1 and max(lengths_q) == max(lengths_k) == 17
    assert lengths_q != lengths_k
    assert cells.smallseq_lengths.__wrapped__() == (lengths_q, lengths_k)  # same seed, same draw


def test_varlen_lengths_are_bench_flash_s():
    lengths = cells.varlen_lengths()
    assert sum(lengths) == cells.VARLEN_TOKENS
    # BENCHMARKS.md (e8e4ca3): "16k tokens in 7 sequences of 615..4024 tokens"
    assert (len(lengths), min(lengths), max(lengths)) == (7, 615, 4024)


def test_sdpa_flash_is_never_run_where_it_ends_the_cuda_context():
    smallseq = cells.by_name("smallseq/d128/h16:16/fwd")
    assert "device-side assert" in cells.prescreen(smallseq, "sdpa_flash")
    assert cells.prescreen(smallseq, "sdpa_cudnn") is None
    assert all(cells.prescreen(c, p) is None for c in cells.all_cells() if c.section != "smallseq" for p in cells.peers(c)
               if p not in cells.DENSE_PEERS)
    assert cells.padded_peer(smallseq, "sdpa_cudnn") and not cells.padded_peer(smallseq, "varlen_attn")


def test_window_peers_and_where_the_masked_reference_is_not_run():
    train = cells.by_name("window/d128/h16:4/s4096/w512,512/noncausal/fwdbwd")
    decode = cells.by_name("window/d128/h32:8/b8/kv32768/w4095,0/causal/fwd")
    assert cells.peers(train) == ("flex", "varlen_attn", "sdpa_masked")  # SDPA flash and cuDNN take no window
    assert cells.peers(decode) == ("flex", "varlen_attn", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient")
    assert cells.prescreen(train, "sdpa_masked") is None  # a 16 MiB mask
    reason = cells.prescreen(cells.by_name("window/d128/h16:4/s16384/w1023,0/causal/fwd"), "sdpa_masked")
    assert reason.startswith("not run: its [S_q, S_k] boolean mask would be 256 MiB (> 64 MiB")
    assert not any(cells.padded_peer(c, p) for c in cells.all_cells() if c.section == "window" for p in cells.peers(c))


def test_scoremod_peers_and_where_the_bias_reference_is_not_run():
    for c in cells.all_cells():
        if c.section == "scoremod":  # SDPA has no softcap; varlen_attn takes no modifier
            assert cells.peers(c) == (("flex",) if c.softcap else ("flex", "sdpa_bias")), c.name
            assert not any(cells.padded_peer(c, p) for p in cells.peers(c))
    alibi = cells.by_name("scoremod/d128/h16:4/s4096/alibi/causal/fwdbwd")
    assert cells.bias_bytes(alibi) == 16 * 4096 * 4096 * 2 == 512 * 1024**2
    assert cells.prescreen(alibi, "sdpa_bias") is None and cells.prescreen(alibi, "flex") is None
    long = cells.by_name("scoremod/d128/h16:4/s16384/alibi/causal/fwd")
    assert cells.prescreen(long, "sdpa_bias").startswith(
        "not run: its [Hq, S_q, S_k] bf16 ALiBi bias would be 8192 MiB (> 1024 MiB)")


def test_dropout_cells_are_plain_shapes_with_dropout_p_and_no_peer_is_checked():
    chosen = [c for c in cells.all_cells() if c.section == "dropout"]
    assert "dropout/d128/h16:16/s4096/p0.1/causal/fwdbwd" in {c.name for c in chosen}
    batch = {c.name for c in cells.all_cells() if c.section == "batch"}
    for c in chosen:
        assert c.dropout_p == cells.DROPOUT_P and not c.score_modified and not c.windowed
        assert cells.plain_twin(c).name in batch, "every dropout shape has its plain batch cell"
        assert cells.peers(c) == ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient")
        assert not any(cells.checked_peer(c, p) for p in cells.peers(c)), "each library draws its own mask"
    assert all(c.dropout_p == 0.0 for c in cells.all_cells() if c.section != "dropout")
    assert cells.checked_peer(cells.by_name("batch/d128/h16:16/s4096/causal/fwd"), "sdpa_flash")


# ---- floors --------------------------------------------------------------------------------------

@pytest.mark.parametrize(("len_q", "len_k", "causal", "pairs"), [
    (5, 7, False, 35),
    (4, 4, True, 10),  # 1 + 2 + 3 + 4
    (2, 5, True, 9),  # bottom-right: rows see 4 and 5 keys (hipattn's docstring draws this mask)
    (5, 2, True, 3),  # rows 0-2 see nothing, rows 3 and 4 see 1 and 2 keys
    (1, 4096, True, 4096),  # a decode step sees the whole cache
    (1024, 1024, True, 1024 * 1025 // 2),
])
def test_visible_pairs_by_hand(len_q, len_k, causal, pairs):
    assert cells.visible_pairs(len_q, len_k, causal) == pairs


def test_visible_pairs_match_the_mask_drawn_element_by_element():
    for len_q in range(1, 9):
        for len_k in range(1, 9):
            drawn = sum(1 for i in range(len_q) for j in range(len_k) if j <= i + len_k - len_q)
            assert cells.visible_pairs(len_q, len_k, True) == drawn


def _drawn(len_q: int, len_k: int, causal: bool, window: tuple[int, int]) -> list[tuple[int, int]]:
    """The visible (query, key) pairs by flash-attn's rule, one by one: with d = len_k - len_q, query i
    sees key j when i + d - left <= j <= i + d + right; a negative side has no bound; causal: right = 0."""
    left, right = window
    right = 0 if causal else right
    d = len_k - len_q
    return [(i, j) for i in range(len_q) for j in range(len_k)
            if (left < 0 or j >= i + d - left) and (right < 0 or j <= i + d + right)]


@pytest.mark.parametrize("causal", [False, True])
def test_windowed_visible_pairs_and_keys_match_the_mask_drawn_element_by_element(causal):
    for len_q in range(1, 10):
        for len_k in range(1, 10):
            for left in range(-1, 11):
                for right in range(-1, 11):
                    pairs = _drawn(len_q, len_k, causal, (left, right))
                    assert cells.visible_pairs(len_q, len_k, causal, (left, right)) == len(pairs), (len_q, len_k, left, right)
                    keys = sorted({j for _, j in pairs})
                    expected = (keys[0], keys[-1] + 1) if keys else (0, 0)
                    assert cells.key_range(len_q, len_k, causal, (left, right)) == expected
                    assert cells.visible_keys(len_q, len_k, causal, (left, right)) == len(keys)
                    assert keys == list(range(*expected))  # one run of keys


@pytest.mark.parametrize(("len_q", "len_k", "causal", "window", "pairs"), [
    (4096, 4096, True, (1023, 0), 1024 * 1025 // 2 + 3072 * 1024),  # rows 0..1023 see i + 1 keys, the rest 1024
    (4096, 4096, False, (1023, 0), 1024 * 1025 // 2 + 3072 * 1024),  # the same window spelled without causal
    (4096, 4096, True, (1023, 7), 1024 * 1025 // 2 + 3072 * 1024),  # causal sets right = 0
    (4096, 4096, False, (512, 512), 4096 * 1025 - 2 * (512 * 513 // 2)),  # 1025 keys a row, less both edges
    (16384, 16384, True, (-1, -1), 16384 * 16385 // 2),  # no window: plain causal
    (16384, 16384, False, (-1, -1), 16384 * 16384),
    (1, 32768, True, (4095, 0), 4096),  # a decode step sees the last left + 1 keys
    (1, 100, True, (4095, 0), 100),  # ... or the whole cache when shorter
    (1, 32768, False, (-1, 0), 32768),
    (3, 10, False, (0, 0), 3),  # the diagonal, bottom-right: keys 7, 8, 9
    (10, 3, True, (1, 0), 5),  # rows 0..6 see nothing; row 7 sees key 0, rows 8 and 9 two keys
])
def test_windowed_visible_pairs_by_hand(len_q, len_k, causal, window, pairs):
    assert cells.visible_pairs(len_q, len_k, causal, window) == pairs


def test_thd_bytes_by_hand():
    # total_q 10, total_k 20, Hq 4, Hkv 2, D 8: q = out = dout = dq = 10*4*8*2 = 640 bytes;
    # k = v = dk = dv = 20*2*8*2 = 640 bytes; lse = 10*4*4 = 160 bytes.
    assert cells.thd_bytes(10, 20, 4, 2, 8, "fwd") == 640 + 640 + 640 + 640 + 160
    assert cells.thd_bytes(10, 20, 4, 2, 8, "bwd") == 3 * 640 + 4 * 640 + 160
    assert cells.thd_bytes(10, 20, 4, 2, 8, "fwdbwd") == 2720 + 4640
    assert cells.thd_bytes(10, 20, 4, 2, 8, "fwd", lse=False) == 2560


def test_a_causal_batch_cell_by_hand():
    work = cells.work(cells.by_name("batch/d128/h16:16/s1024/causal/fwd"))
    # B = 16 sequences of 1024: 16 * 1024 * 1025 / 2 visible pairs, 4 * Hq * D FLOPs each
    assert work.flops == 4 * 16 * 128 * 16 * 1024 * 1025 // 2 == 68_786_585_600
    tensor = 16 * 1024 * 16 * 128 * 2  # one [B, S, H, D] bf16 tensor
    assert work.bytes == 4 * tensor + 16 * 16 * 1024 * 4  # q, k, v, out + lse
    both = cells.work(cells.by_name("batch/d128/h16:16/s1024/causal/fwdbwd"))
    assert both.flops == 3.5 * work.flops
    noncausal = cells.work(cells.by_name("batch/d128/h16:16/s1024/noncausal/fwd"))
    assert noncausal.flops == 4 * 16 * 128 * 16 * 1024 * 1024
    gqa = cells.work(cells.by_name("batch/d128/h16:4/s1024/causal/fwd"))
    assert gqa.flops == work.flops and gqa.bytes == 2 * tensor + 2 * tensor // 4 + 16 * 16 * 1024 * 4


def test_a_small_seq_backward_cell_counts_real_tokens_and_kv_heads_once():
    cell = cells.by_name("smallseq/d128/h16:4/bwd")
    lengths_q, lengths_k = cells.lengths(cell)
    work = cells.work(cell)
    assert work.bytes == cells.thd_bytes(sum(lengths_q), sum(lengths_k), 16, 4, 128, "bwd")
    assert work.flops == 2.5 * 4 * 16 * 128 * sum(q * k for q, k in zip(lengths_q, lengths_k, strict=True))


def test_window_cells_by_hand():
    work = cells.work(cells.by_name("window/d128/h16:4/s4096/w1023,0/causal/fwd"))
    pairs = 4 * (1024 * 1025 // 2 + 3072 * 1024)  # B = 4 sequences of 4096
    assert work.flops == 4 * 16 * 128 * pairs
    tensor = 4 * 4096 * 16 * 128 * 2  # one [B, S, Hq, D] bf16 tensor; K and V have a quarter of the heads
    assert work.bytes == 2 * tensor + 2 * tensor // 4 + 4 * 16 * 4096 * 4  # every key is seen by some query
    both = cells.work(cells.by_name("window/d128/h16:4/s4096/w1023,0/causal/fwdbwd"))
    assert both.flops == 3.5 * work.flops
    symmetric = cells.work(cells.by_name("window/d128/h16:4/s4096/w512,512/noncausal/fwd"))
    assert symmetric.flops == 4 * 16 * 128 * 4 * (4096 * 1025 - 512 * 513)
    full = cells.work(cells.by_name("batch/d128/h16:4/s16384/causal/fwd"))
    windowed = cells.work(cells.by_name("window/d128/h16:4/s16384/w1023,0/causal/fwd"))
    assert windowed.bytes == full.bytes and windowed.flops < full.flops / 7
    ceilings = cells.NOMINAL_CEILINGS
    assert cells.floor(windowed, ceilings)["ms"] == pytest.approx(windowed.flops / ceilings.gemm_flops_per_s * 1e3)


def test_a_scoremod_cell_has_its_plain_twin_s_work_and_floor():
    for c in cells.all_cells():
        if c.section != "scoremod":
            continue
        twin = cells.plain_twin(c)
        assert twin.section == "batch" and cells.by_name(twin.name) == twin  # a cell of the matrix
        assert twin.name == c.name.replace("scoremod/", "batch/").replace(f"/{c.modifiers}/", "/")
        assert cells.work(c) == cells.work(twin)
        assert cells.floor(cells.work(c), cells.NOMINAL_CEILINGS) == cells.floor(cells.work(twin), cells.NOMINAL_CEILINGS)
        assert cells.input_sets(c) == cells.input_sets(twin)
    work = cells.work(cells.by_name("scoremod/d128/h16:4/s4096/cap50/causal/fwd"))
    assert work.flops == 4 * 16 * 128 * 4 * 4096 * 4097 // 2  # B = 4 sequences of 4096, causal
    tensor = 4 * 4096 * 16 * 128 * 2
    assert work.bytes == 2 * tensor + 2 * tensor // 4 + 4 * 16 * 4096 * 4  # q, out; k, v at 4 heads; lse


def test_the_estimates_count_the_bias_reference_s_dense_work():
    causal = cells.by_name("scoremod/d128/h16:4/s4096/alibi/causal/fwd")
    floor_ms = cells.floor(cells.work(causal), cells.NOMINAL_CEILINGS)["ms"]
    dense_ms = cells.floor(cells.work(cells.by_name("scoremod/d128/h16:4/s4096/alibi/noncausal/fwd")),
                           cells.NOMINAL_CEILINGS)["ms"]
    ratios = cells.EXPECTED_FLOOR_RATIO[("scoremod", "fwd")]
    expected = (cells.CELL_OVERHEAD_S + cells.FLEX_COMPILE_S["fwd"] + cells.runner_seconds(floor_ms * ratios["hipattn"])
                + cells.runner_seconds(floor_ms * ratios["flex"]) + cells.runner_seconds(dense_ms * ratios["sdpa_bias"]))
    assert cells.estimate_seconds(causal) == pytest.approx(expected)
    long = cells.by_name("scoremod/d128/h16:4/s16384/alibi/causal/fwd")  # the bias peer is prescreened out
    long_floor = cells.floor(cells.work(long), cells.NOMINAL_CEILINGS)["ms"]
    assert cells.estimate_seconds(long) == pytest.approx(
        cells.CELL_OVERHEAD_S + cells.FLEX_COMPILE_S["fwd"] + cells.runner_seconds(long_floor * ratios["hipattn"])
        + cells.runner_seconds(long_floor * ratios["flex"]))


def test_a_decode_window_reads_its_window_only():
    work = cells.work(cells.by_name("window/d128/h32:8/b8/kv32768/w4095,0/causal/fwd"))
    q = out = 8 * 32 * 128 * 2
    assert work.bytes == q + out + 2 * 8 * 4096 * 8 * 128 * 2  # the last 4096 keys of each cache, no lse
    assert work.flops == 4 * 32 * 128 * 8 * 4096
    assert cells.floor(work, cells.NOMINAL_CEILINGS)["bound"] == "bytes"
    whole = cells.work(cells.by_name("decode/d128/h32:8/b8/kv32768/fwd"))
    assert whole.bytes - work.bytes == 2 * 8 * (32768 - 4096) * 8 * 128 * 2
    # the rotation counts the bytes a call touches: two sets of 128 MiB windows, not one 1 GiB cache
    assert cells.set_bytes(cells.by_name("window/d128/h32:8/b8/kv32768/w4095,0/causal/fwd")) == q + 2 * 8 * 4096 * 8 * 128 * 2
    assert cells.input_sets(cells.by_name("window/d128/h32:8/b8/kv32768/w4095,0/causal/fwd")) == 2


def test_the_estimates_count_flexattention_s_compile_and_the_masked_peer_s_dense_work():
    cell = cells.by_name("window/d128/h16:4/s4096/w1023,0/causal/fwdbwd")
    assert cells.estimate_seconds(cell) > cells.FLEX_COMPILE_S["fwdbwd"]
    # the masked SDPA computes every pair: its call, about 7x the dense floor, is what the estimate plans
    dense_ms = cells.floor(cells.work(cells.by_name("batch/d128/h16:4/s4096/noncausal/fwdbwd")),
                           cells.NOMINAL_CEILINGS)["ms"]
    without_masked = cells.CELL_OVERHEAD_S + cells.FLEX_COMPILE_S["fwdbwd"] + sum(
        cells.runner_seconds(cells.floor(cells.work(cell), cells.NOMINAL_CEILINGS)["ms"] * ratio)
        for runner, ratio in cells.EXPECTED_FLOOR_RATIO[("window", "fwdbwd")].items() if runner != "sdpa_masked")
    assert cells.estimate_seconds(cell) - without_masked == pytest.approx(cells.runner_seconds(7.0 * dense_ms))


def test_a_decode_cell_reads_the_cache_once_and_writes_no_lse():
    work = cells.work(cells.by_name("decode/d128/h32:8/b1/kv131072/fwd"))
    q = out = 1 * 32 * 128 * 2
    kv = 2 * 131072 * 8 * 128 * 2
    assert work.bytes == q + kv + out
    assert work.flops == 4 * 32 * 128 * 131072


def test_the_floor_is_the_larger_term():
    ceilings = cells.Ceilings(copy_bytes_per_s=1e12, gemm_flops_per_s=1e15)
    assert cells.floor(cells.Work(flops=2e12, bytes=1e9), ceilings) == {
        "ms": 2.0, "flops_ms": 2.0, "bytes_ms": 1.0, "bound": "flops"}
    assert cells.floor(cells.Work(flops=1e9, bytes=3e9), ceilings)["bound"] == "bytes"
    assert cells.floor(cells.work(cells.by_name("smallseq/d64/h16:16/fwd")), cells.NOMINAL_CEILINGS)["bound"] == "bytes"
    assert cells.floor(cells.work(cells.by_name("batch/d128/h16:16/s4096/noncausal/fwd")),
                       cells.NOMINAL_CEILINGS)["bound"] == "flops"


def test_input_sets_rotate_until_l2_cannot_serve_the_repeats():
    for c in cells.all_cells():
        sets = cells.input_sets(c)
        assert 1 <= sets <= cells.MAX_INPUT_SETS
        assert sets == cells.MAX_INPUT_SETS or sets * cells.set_bytes(c) >= cells.ROTATION_BYTES


def test_timing_plan():
    assert cells.timing_plan(0.01) == (cells.MAX_CALLS_PER_SAMPLE, 3)
    assert cells.timing_plan(0.25) == (4, 3)
    assert cells.timing_plan(10.0) == (1, 2)
    assert cells.timing_plan(100.0) == (1, 1)


def test_the_estimates_fit_the_budget_with_room_for_the_prewarm():
    full = sum(s for _, s in cells.estimate_by_section(cells.select()).values())
    quick = sum(s for _, s in cells.estimate_by_section(cells.select(quick=True)).values())
    # of the default 480 s budget, leaving about 2 minutes for `hipattn warm`; the window section's share
    # is mostly FlexAttention's compiles (cells.FLEX_COMPILE_S, guessed)
    assert full < 360
    assert quick < 40


# ---- ratios, summary, markdown, heat map, A/B -----------------------------------------------------

def _record(name: str, hipattn_ms: float | None, peers: dict, floor_ms: float = 1.0, check_ok: bool | None = True,
            clock: float = 1980.0) -> dict:
    """A cell record as the worker writes it; peers maps a name to a time in ms or an error string."""
    runners = {"hipattn": {"median_ms": hipattn_ms, "samples": [[hipattn_ms, clock]] * 3}
               if hipattn_ms is not None else {"error": "ValueError: no kernel"}}
    for peer, value in peers.items():
        runners[peer] = {"median_ms": value, "samples": [[value, clock - 15]]} if isinstance(value, float) else {"error": value}
        if cells.padded_peer(cells.by_name(name), peer):
            runners[peer]["padded"] = True
    comparable = [p for p, v in peers.items() if isinstance(v, float) and cells.checked_peer(cells.by_name(name), p)]
    checks = {p: {"ok": check_ok, "rel_l2": 3e-3 if check_ok else 0.4, "max_abs_diff": 0.01 if check_ok else 2.0}
              for p in comparable} if check_ok is not None else {}
    record = {"name": name, "section": name.split("/")[0], "params": cells.by_name(name).params(),
              "floor": {"ms": floor_ms, "bound": "flops"}, "runners": runners, "checks": checks}
    return {**record, **report.derive(record)}


def _doc(records: list[dict], skipped: dict | None = None) -> dict:
    return {"format": run.FORMAT, "date": "2026-12-01", "command": "python -m tools.bench_matrix --out out",
            "source": {"commit": "0123456789abcdef", "dirty": False, "source_sha256": "ab" * 32},
            "environment": {"device": "NVIDIA H200", "torch": "2.11.0+cu130", "driver": "580.159.04",
                            "clock_source": "nvml"},
            "ceilings": {"copy_bytes_per_s": 4.25e12, "gemm_flops_per_s": 7.8e14},
            "timing": run.TIMING, "floors": run.FLOORS, "planned": [r["name"] for r in records] + list(skipped or {}),
            "cells": {r["name"]: r for r in records}, "skipped": skipped or {}, "excluded": {}, "workers": [],
            "warm": {"command": "python -m hipattn warm --arch sm_90a --jobs 16", "exit": 0, "seconds": 71.2}}


def _synthetic() -> dict:
    return _doc([
        _record("smallseq/d128/h16:16/fwd", 0.7, {"varlen_attn": 5.9, "sdpa_cudnn": 5.5,
                                                  "sdpa_flash": "not run: B*Hq = 262144 > 65535"}, floor_ms=0.56),
        _record("batch/d128/h16:16/s1024/noncausal/fwd", 0.4, {"sdpa_flash": 0.45, "sdpa_cudnn": 0.2,
                                                               "sdpa_efficient": "RuntimeError: No available kernel"}),
        _record("batch/d128/h16:16/s1024/causal/fwd", 0.3, {"sdpa_flash": 0.6}, check_ok=False),
        _record("varlen/d128/h16:16/noncausal/fwd", 0.5, {"varlen_attn": "RuntimeError: boom"}),
        _record("decode/d128/h32:8/b1/kv131072/fwd", None, {"sdpa_flash": 0.3}, check_ok=None),
        _record("window/d128/h16:4/s4096/w512,512/noncausal/fwdbwd", 0.8,
                {"flex": 1.0, "varlen_attn": 0.9, "sdpa_masked": 4.0}),
        _record("scoremod/d128/h16:4/s4096/alibi/noncausal/fwd", 0.9, {"flex": 0.75, "sdpa_bias": 4.5}),
        _record("dropout/d128/h16:16/s4096/p0.1/causal/fwdbwd", 1.1, {"sdpa_flash": 1.25, "sdpa_cudnn": 1.0}),
        {"name": "decode/d128/h32:8/b64/kv4096/fwd", "section": "decode",
         "params": cells.by_name("decode/d128/h32:8/b64/kv4096/fwd").params(),
         "error": "the worker ended with status -11 during setup of sdpa_cudnn"},
    ], skipped={"batch/d256/h16:4/s16384/causal/fwdbwd": "budget: 2.1 s expected, 0.4 s left"})


def test_derive_takes_the_fastest_peer_and_the_floor():
    record = _record("batch/d128/h16:16/s1024/noncausal/fwd", 0.4,
                     {"sdpa_flash": 0.45, "sdpa_cudnn": 0.2, "sdpa_efficient": "RuntimeError: x"}, floor_ms=0.1)
    assert record["best_peer"] == "sdpa_cudnn" and record["best_peer_ms"] == 0.2
    assert record["vs_best_peer"] == pytest.approx(2.0)
    assert record["vs_floor"] == pytest.approx(4.0)
    assert record["check"]["reference"] == "sdpa_cudnn"


def test_a_padded_peer_can_be_the_best_but_the_check_is_against_the_same_function():
    record = _record("smallseq/d128/h16:16/fwd", 0.7, {"varlen_attn": 5.9, "sdpa_cudnn": 5.5})
    assert record["best_peer"] == "sdpa_cudnn"
    assert record["check"]["reference"] == "varlen_attn"


def test_a_cell_whose_peers_all_failed_has_a_floor_ratio_and_no_peer_ratio():
    record = _record("varlen/d128/h16:16/noncausal/fwd", 0.5, {"varlen_attn": "RuntimeError: boom"}, check_ok=None)
    assert record["best_peer"] is None and record["vs_best_peer"] is None and record["check"] is None
    assert record["vs_floor"] == pytest.approx(0.5)


def test_the_summary_counts_wins_failures_and_the_worst_cells():
    summary = report.summarize(_synthetic())
    assert summary["compared"] == 6  # small-seq, batch non-causal and causal, window, scoremod, dropout
    assert summary["wins"] == 2  # small-seq and window; the causal cell is faster but its check failed
    assert summary["check_failures"] == ["batch/d128/h16:16/s1024/causal/fwd"]
    assert summary["worst"] == [("batch/d128/h16:16/s1024/noncausal/fwd", pytest.approx(2.0), "sdpa_cudnn"),
                                ("scoremod/d128/h16:4/s4096/alibi/noncausal/fwd", pytest.approx(1.2), "flex"),
                                ("dropout/d128/h16:16/s4096/p0.1/causal/fwdbwd", pytest.approx(1.1), "sdpa_cudnn")]
    assert summary["no_peer"] == ["varlen/d128/h16:16/noncausal/fwd"]
    assert set(summary["hipattn_failed"]) == {"decode/d128/h32:8/b1/kv131072/fwd", "decode/d128/h32:8/b64/kv4096/fwd"}
    assert summary["skipped"] == ["batch/d256/h16:4/s16384/causal/fwdbwd"]
    assert summary["geomean_vs_best_peer"] == pytest.approx((0.7 / 5.5 * 2.0 * 0.5 * 0.8 / 0.9 * 1.2 * 1.1) ** (1 / 6))
    assert report.summarize(_synthetic(), "smallseq")["wins"] == 1
    window = report.summarize(_synthetic(), "window")
    assert (window["cells"], window["wins"], window["geomean_vs_best_peer"]) == (1, 1, pytest.approx(0.8 / 0.9))
    scoremod = report.summarize(_synthetic(), "scoremod")
    assert (scoremod["cells"], scoremod["wins"], scoremod["geomean_vs_best_peer"]) == (1, 0, pytest.approx(1.2))
    dropout = report.summarize(_synthetic(), "dropout")
    assert (dropout["compared"], dropout["check_failures"]) == (1, []), "unchecked (each draws its own mask): no failure"


def test_each_peer_gets_its_own_ratios_per_direction_where_both_ran():
    batch = [r for r in report.records(_synthetic()) if r.get("section") == "batch"]
    ratios = report.peer_ratios(batch)
    assert ratios == {"fwd": {"FA2 (SDPA)": [pytest.approx(0.4 / 0.45), pytest.approx(0.5)],
                              "cuDNN (SDPA)": [pytest.approx(2.0)]}}, "the failed efficient backend has no ratio"
    assert report.peer_ratio_text(batch) == (
        "hipattn ÷ each peer, lowest-highest: fwd: FA2 (SDPA) 0.50-0.89× (geometric mean 0.67×, 2 cells), "
        "cuDNN (SDPA) 2.00-2.00× (geometric mean 2.00×, 1 cell).")
    assert report.peer_ratio_text(batch) in report.markdown(_synthetic())
    smallseq = [r for r in report.records(_synthetic()) if r.get("section") == "smallseq"]
    assert report.peer_ratios(smallseq)["fwd"].keys() == {"varlen_attn", "cuDNN (SDPA) padded"}
    failed = [r for r in report.records(_synthetic()) if r["name"].startswith("decode/")]
    assert report.peer_ratio_text(failed) is None, "hipattn did not run: nothing to compare"


def test_the_markdown_has_a_titled_table_per_section_and_a_summary():
    text = report.markdown(_synthetic())
    assert text.startswith("## Performance matrix — 2026-12-01, NVIDIA H200, commit 0123456789")
    assert "`python -m tools.bench_matrix --out out`" in text
    assert "copy 4.25 TB/s" in text and "780 TFLOP/s" in text
    assert "SM clock 1965-1980 MHz" in text
    for section in cells.SECTIONS:
        assert f"### {report.SECTION_TITLES[section]}" in text
    assert text.count("| cell | hipattn ms | best peer | peer ms | ÷ best peer | ÷ floor | check |") == 7
    assert "| `d128/h16:16/fwd` | 0.7 | cuDNN (SDPA) padded | 5.5 | **0.13×** | 1.25× | ok (3.0e-03) |" in text
    assert "| `d128/h16:16/s1024/noncausal/fwd` | 0.4 | cuDNN (SDPA) | 0.2 | 2.00× | 0.40× | ok (3.0e-03) |" in text
    assert "**FAIL**" in text
    assert "error: ValueError: no kernel" in text
    assert "failed: the worker ended with status -11" in text
    assert "efficient (SDPA) in 1 cells (RuntimeError: No available kernel)" in text
    assert "Skipped 1 cells (budget: 2.1 s expected, 0.4 s left): `d256/h16:4/s16384/causal/fwdbwd`" in text
    assert "| `d128/h16:4/s4096/w512,512/noncausal/fwdbwd` | 0.8 | varlen_attn | 0.9 | **0.89×** | 0.80× | ok (3.0e-03) |" in text
    assert f"Peers: {report.SECTION_PEERS['window']}. hipattn wins 1 of 1" in text
    assert "| `d128/h16:4/s4096/alibi/noncausal/fwd` | 0.9 | FlexAttention | 0.75 | 1.20× | 0.90× | ok (3.0e-03) |" in text
    assert f"Peers: {report.SECTION_PEERS['scoremod']}. hipattn wins 0 of 1" in text
    assert "Without the modifier" not in text  # no plain twin in this run
    assert "**Summary:** hipattn is faster than the best peer in 2 of 6 cells" in text
    assert "Prewarm: `python -m hipattn warm --arch sm_90a --jobs 16`, exit 0, 71.2 s." in text


def test_the_heat_map_puts_each_cell_at_its_parameters():
    laid_out = {p["section"]: p for p in report.panels(_synthetic())}
    assert set(laid_out) == set(cells.SECTIONS)
    smallseq = laid_out["smallseq"]
    assert smallseq["rows"] == ["d128 fwd"] and smallseq["columns"] == ["h16:16"]
    assert smallseq["entries"][("d128 fwd", "h16:16")] == (pytest.approx(0.7 / 5.5), "0.13")
    batch = laid_out["batch"]
    assert batch["rows"] == ["d128 h16:16 noncausal", "d128 h16:16 causal", "d256 h16:4 causal"]
    assert batch["entries"][("d128 h16:16 causal", "s1024\nfwd")][1] == "0.50\nFAIL"
    assert batch["entries"][("d256 h16:4 causal", "s16384\nfwdbwd")] == (None, "skip")
    assert laid_out["varlen"]["entries"][("noncausal", "h16:16\nfwd")] == (None, "no peer")
    assert {text for _, text in laid_out["decode"]["entries"].values()} == {"error"}
    window = laid_out["window"]
    assert window["rows"] == ["d128 h16:4 w512,512 noncausal"] and window["columns"] == ["s4096\nfwdbwd"]
    assert window["entries"][("d128 h16:4 w512,512 noncausal", "s4096\nfwdbwd")] == (pytest.approx(0.8 / 0.9), "0.89")
    decode = cells.by_name("window/d128/h32:8/b8/kv32768/w4095,0/causal/fwd").params()
    assert report.panel_position(decode) == ("decode w4095,0 causal", "b8 kv32768\nh32:8")
    scoremod = laid_out["scoremod"]
    assert scoremod["rows"] == ["d128 h16:4 alibi noncausal"] and scoremod["columns"] == ["s4096\nfwd"]
    assert scoremod["entries"][("d128 h16:4 alibi noncausal", "s4096\nfwd")] == (pytest.approx(1.2), "1.20")
    both = cells.by_name("scoremod/d64/h16:4/s4096/cap50/causal/fwdbwd").params()
    assert report.panel_position(both) == ("d64 h16:4 cap50 causal", "s4096\nfwdbwd")
    assert laid_out["dropout"]["entries"][("d128 h16:16 p0.1 causal", "s4096\nfwdbwd")] == (pytest.approx(1.1), "1.10")


def test_the_scoremod_section_says_what_the_modifiers_cost_against_the_plain_twin():
    doc = _doc([
        _record("scoremod/d128/h16:4/s4096/cap50/causal/fwd", 1.1, {"flex": 1.3}),
        _record("scoremod/d128/h16:4/s4096/cap50/causal/fwdbwd", 4.4, {"flex": 4.0}),
        _record("scoremod/d128/h16:4/s4096/alibi/causal/fwd", 1.5, {"flex": 1.3}),
        _record("scoremod/d128/h16:4/s4096/cap50,alibi/causal/fwd", 1.2, {"flex": 1.3}),  # its twin is shared
        _record("scoremod/d64/h16:4/s4096/cap50/causal/fwd", 1.0, {"flex": 1.3}),  # no twin in the run
        _record("batch/d128/h16:4/s4096/causal/fwd", 1.0, {"sdpa_cudnn": 0.9}),
        _record("batch/d128/h16:4/s4096/causal/fwdbwd", 4.0, {"sdpa_cudnn": 3.5}),
        _record("batch/d64/h16:4/s4096/causal/fwd", None, {"sdpa_cudnn": 0.5}, check_ok=None),  # hipattn failed
    ])
    costs = report.modifier_costs(doc)
    assert costs == {"cap50": [pytest.approx(1.1), pytest.approx(1.1)], "alibi": [pytest.approx(1.5)],
                     "cap50,alibi": [pytest.approx(1.2)]}
    text = report.markdown(doc)
    assert ("Without the modifier (hipattn on the `batch` cell of the same shape, same run; not interleaved with "
            "these): hipattn with ÷ without, geometric mean cap50 1.10× (2 cells), alibi 1.50× (1 cells), "
            "cap50,alibi 1.20× (1 cells).") in text
    assert text.index("Without the modifier") > text.index(f"### {report.SECTION_TITLES['scoremod']}")
    assert report.modifier_cost_text(_doc([_record("batch/d128/h16:4/s4096/causal/fwd", 1.0, {})])) is None


def test_every_section_and_peer_has_its_report_text():
    assert set(report.SECTION_TITLES) == set(report.SECTION_PEERS) == set(cells.SECTIONS)
    every_peer = {p for c in cells.all_cells() for p in cells.peers(c)}
    assert every_peer <= set(report.PEER_NAMES)
    for c in cells.all_cells():  # every runner of a cell has an expected time (else the estimate guesses 5x)
        kind = "decode" if c.section == "window" and c.is_decode else c.direction
        run = {p for p in ("hipattn", *cells.peers(c)) if cells.prescreen(c, p) is None}
        assert run <= set(cells.EXPECTED_FLOOR_RATIO[(c.section, kind)]), c.name


def _write(doc: dict, folder) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / run.JSON_NAME).write_text(json.dumps(doc))


def test_report_renders_the_markdown_and_the_png_from_a_json(tmp_path):
    _write(_synthetic(), tmp_path / "run")
    done = subprocess.run([*TOOL, "--report", str(tmp_path / "run"), "--out", str(tmp_path / "new")],
                          capture_output=True, text=True, timeout=120, cwd=REPOSITORY)
    assert done.returncode == 0, done.stderr
    assert "hipattn is faster than the best peer in 2 of 6" in done.stdout
    assert (tmp_path / "new" / report.MARKDOWN_NAME).read_text() == report.markdown(_synthetic())
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pytest.skip("matplotlib is not installed: the markdown was checked, the heat map cannot be drawn")
    png = (tmp_path / "new" / report.PNG_NAME).read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000


def test_compare_prints_per_cell_ratios_and_their_geometric_mean(tmp_path):
    old = _doc([_record("batch/d128/h16:16/s1024/noncausal/fwd", 0.5, {"sdpa_flash": 0.45}),
                _record("varlen/d128/h16:16/noncausal/fwd", 1.0, {"varlen_attn": 1.2}),
                _record("smallseq/d128/h16:16/fwd", 0.7, {"varlen_attn": 5.9})])
    new = _doc([_record("batch/d128/h16:16/s1024/noncausal/fwd", 0.4, {"sdpa_flash": 0.45}),
                _record("varlen/d128/h16:16/noncausal/fwd", 1.25, {"varlen_attn": 1.2}),
                _record("decode/d128/h32:8/b1/kv131072/fwd", 2.0, {"sdpa_flash": 0.3})])
    text = report.compare_text(old, new)
    assert "batch/d128/h16:16/s1024/noncausal/fwd" in text and "0.80×" in text and "1.25×" in text
    assert "geometric mean new/old over 2 cells: 1.000; faster by more than 3% in 1, slower in 1" in text
    assert "cells only in old: 1; only in new: 1" in text
    _write(old, tmp_path / "old")
    _write(new, tmp_path / "new")
    done = subprocess.run([*TOOL, "--compare", str(tmp_path / "old" / run.JSON_NAME),
                           str(tmp_path / "new")], capture_output=True, text=True, timeout=120, cwd=REPOSITORY)
    assert done.returncode == 0, done.stderr
    assert "geometric mean new/old over 2 cells" in done.stdout


def test_list_prints_the_cells_and_estimates_without_a_gpu():
    done = subprocess.run([*TOOL, "--list", "--quick"], capture_output=True, text=True, timeout=120, cwd=REPOSITORY)
    assert done.returncode == 0, done.stderr
    listed = [line.split()[0] for line in done.stdout.splitlines() if "peers:" in line]
    assert listed == list(cells.QUICK_CELLS)
    assert f"total       {len(cells.QUICK_CELLS)} cells" in done.stdout


def test_list_and_help_show_the_scoremod_cells():
    done = subprocess.run([*TOOL, "--list", "--only", "^scoremod/"], capture_output=True, text=True, timeout=120,
                          cwd=REPOSITORY)
    assert done.returncode == 0, done.stderr
    listed = {line.split()[0]: line.split("peers: ")[1] for line in done.stdout.splitlines() if "peers:" in line}
    assert sorted(listed) == sorted(SCOREMOD_NAMES)
    assert listed["scoremod/d128/h16:4/s4096/cap50/causal/fwdbwd"] == "flex"
    assert listed["scoremod/d128/h16:4/s4096/alibi/noncausal/fwd"] == "flex, sdpa_bias"
    assert "scoremod    14 cells" in done.stdout
    helped = subprocess.run([*TOOL, "--help"], capture_output=True, text=True, timeout=120, cwd=REPOSITORY)
    assert helped.returncode == 0 and "scoremod (flash-attn's softcap=50 and ALiBi" in helped.stdout


# ---- orchestration, with a fake measurer ---------------------------------------------------------

class FakeMeasurer:
    """Runners are names; ``fail`` maps a runner to where it raises ("build", "first", or the number
    of successful samples after which it raises); ``lose_context`` makes a failure poison everything."""

    def __init__(self, fail: dict | None = None, lose_context: bool = False, times: dict | None = None):
        self.fail, self.lose_context, self.times = fail or {}, lose_context, times or {}
        self.calls: list[tuple[str, int, int]] = []
        self.broken = False
        self.samples: dict[str, int] = {}
        self.released = 0

    def prepare(self, cell):
        return {"cell": cell.name}

    def build(self, name, cell, data):
        if self.fail.get(name) == "build":
            import warnings

            warnings.warn(f"{name} kernel not used because: a reason only the warning gives", UserWarning, stacklevel=1)
            self.broken = self.lose_context
            raise RuntimeError("No available kernel. Aborting execution.\nmore detail")
        return name

    def first_call(self, runner):
        if self.fail.get(runner) == "first":
            self.broken = self.lose_context
            raise RuntimeError(f"{runner} failed")
        return (runner,)

    def sample(self, runner, start, calls):
        done = self.samples.get(runner, 0)
        if isinstance(self.fail.get(runner), int) and done >= self.fail[runner]:
            self.broken = self.lose_context
            raise RuntimeError(f"{runner} failed while timed")
        self.samples[runner] = done + 1
        self.calls.append((runner, start, calls))
        return self.times.get(runner, 1.0)

    def clock_mhz(self):
        return 1980.0

    def compare(self, outputs, reference):
        return {"ok": True, "rel_l2": 1e-3, "max_abs_diff": 1e-2, "against": reference[0]}

    def context_ok(self):
        return not self.broken

    def release(self):
        self.released += 1

    def environment(self):
        return {"device": "fake GPU", "clock_source": "fake"}

    def ceilings(self):
        return {"copy_bytes_per_s": 4e12, "gemm_flops_per_s": 8e14}


def test_interleave_alternates_the_order_and_a_failing_runner_drops_out():
    measurer = FakeMeasurer(fail={"b": 2})  # b raises on its third timed sample
    results = run.interleave({"hipattn": "hipattn", "a": "a", "b": "b"}, measurer, rounds=3)
    first_of_each_sample = []
    for runner, _, calls in measurer.calls[3:]:  # after one sizing sample each
        if not first_of_each_sample or first_of_each_sample[-1] != runner:
            first_of_each_sample.append(runner)
        assert calls == 1  # 1.0 ms a call: one call per sample
    # rounds: hipattn a b | b(fails after 1 more) a hipattn | hipattn a
    assert first_of_each_sample == ["hipattn", "a", "b", "a", "hipattn", "a"]
    assert len(results["hipattn"]["samples"]) == 3 * 3 and results["hipattn"]["median_ms"] == 1.0
    assert results["b"]["error"] == "RuntimeError: b failed while timed" and "median_ms" not in results["b"]
    assert results["a"]["clock_mhz_median"] == 1980.0
    starts = [start for runner, start, _ in measurer.calls if runner == "a"]
    assert starts == list(range(1, 1 + len(starts)))  # every call moves to the next input set


def test_short_runners_take_several_calls_per_sample():
    measurer = FakeMeasurer(times={"hipattn": 0.1})
    results = run.interleave({"hipattn": "hipattn"}, measurer, rounds=1)
    assert results["hipattn"]["calls_per_sample"] == 10
    assert [calls for _, _, calls in measurer.calls] == [1, 10, 10, 10]
    assert [start for _, start, _ in measurer.calls] == [1, 2, 12, 22]


def test_a_cell_records_failing_and_prescreened_peers_and_still_appears():
    cell = cells.by_name("smallseq/d128/h16:4/fwd")
    measurer = FakeMeasurer(fail={"varlen_attn": "first", "sdpa_cudnn": "build", "sdpa_efficient": 1})
    record = run.measure_cell(cell, measurer, cells.NOMINAL_CEILINGS, rounds=2)
    runners = record["runners"]
    assert runners["varlen_attn"]["error"] == "RuntimeError: varlen_attn failed"
    assert runners["sdpa_cudnn"]["error"] == ("RuntimeError: No available kernel. Aborting execution. "
                                              "[sdpa_cudnn kernel not used because: a reason only the warning gives]")
    assert runners["sdpa_flash"]["error"].startswith("not run: B*Hq = 262144 > 65535")
    assert runners["sdpa_efficient"]["error"] == "RuntimeError: sdpa_efficient failed while timed"
    assert runners["sdpa_efficient"]["padded"] is True
    assert record["checks"] == {}  # the one same-function peer failed
    assert record["best_peer"] is None and record["vs_best_peer"] is None
    assert record["vs_floor"] == pytest.approx(1.0 / record["floor"]["ms"])
    assert record["shape"]["total_q"] == sum(cells.lengths(cell)[0])
    assert measurer.released == 1


def test_a_cell_checks_hipattn_against_every_same_function_peer():
    cell = cells.by_name("batch/d64/h16:4/s2048/causal/fwdbwd")
    record = run.measure_cell(cell, FakeMeasurer(times={"sdpa_flash": 2.0, "sdpa_cudnn": 0.5}), cells.NOMINAL_CEILINGS,
                              rounds=1)
    assert set(record["checks"]) == {"sdpa_flash", "sdpa_cudnn", "sdpa_efficient"}
    assert record["best_peer"] == "sdpa_cudnn" and record["vs_best_peer"] == pytest.approx(2.0)
    assert record["check"]["reference"] == "sdpa_cudnn" and record["check"]["against"] == "sdpa_cudnn"
    assert record["checks"]["sdpa_flash"]["against"] == "sdpa_flash"


def test_a_lost_context_stops_the_worker():
    cell = cells.by_name("batch/d64/h16:4/s2048/causal/fwdbwd")
    with pytest.raises(run.ContextLost, match="sdpa_cudnn"):
        run.measure_cell(cell, FakeMeasurer(fail={"sdpa_cudnn": "first"}, lose_context=True), cells.NOMINAL_CEILINGS, 1)
    with pytest.raises(run.ContextLost, match="hipattn"):
        run.measure_cell(cell, FakeMeasurer(fail={"hipattn": 0}, lose_context=True), cells.NOMINAL_CEILINGS, 1)


def _planned_doc(tmp_path, names, **extra):
    options = {"quick": False, "only": None, "budget_seconds": 480, "rounds": 2, "warm": False, "warm_arch": "sm_90a"}
    doc = run.new_document(["--out", str(tmp_path)], options, [cells.by_name(n) for n in names])
    doc.update(extra)
    run.save(doc, tmp_path)
    return doc


def test_the_worker_writes_the_json_after_every_cell_and_skips_what_the_budget_cannot_hold(tmp_path):
    names = ["decode/d128/h32:8/b64/kv4096/fwd", "varlen/d128/h16:16/causal/fwd"]
    _planned_doc(tmp_path, names)
    saved = []
    original_save = run.save

    def recording_save(doc, directory):
        saved.append(sorted(doc["cells"]))
        original_save(doc, directory)

    run.save = recording_save
    try:
        assert run.work_loop(tmp_path, time.time() + 1000, FakeMeasurer()) == 0
    finally:
        run.save = original_save
    assert saved == [[], [names[0]], sorted(names)]  # ceilings, then after each cell
    doc = run.load(tmp_path)
    assert doc["environment"]["device"] == "fake GPU" and doc["ceilings"]["copy_bytes_per_s"] == 4e12
    assert sorted(doc["cells"]) == sorted(names) and doc["skipped"] == {}
    assert doc["cells"][names[0]]["floor"]["ms"] == pytest.approx(doc["cells"][names[0]]["work"]["bytes"] / 4e12 * 1e3)
    assert run.read_progress(tmp_path)["phase"] == "done"

    _planned_doc(tmp_path, names)
    assert run.work_loop(tmp_path, time.time() - 1, FakeMeasurer()) == 0
    doc = run.load(tmp_path)
    assert doc["cells"] == {} and all(doc["skipped"][n].startswith("budget: ") for n in names)


def test_the_budget_check_scales_the_estimates_by_what_the_cells_took():
    assert run.estimate_scale({"cells": {}}) == 1.0
    done = {"a": {"seconds": 3.0, "estimate_seconds": 1.0}, "b": {"seconds": 2.0, "estimate_seconds": 1.0},
            "c": {"seconds": 8.0, "estimate_seconds": 2.0}, "d": {"name": "d", "error": "crashed"}}
    assert run.estimate_scale({"cells": done}) == 3.0
    assert run.estimate_scale({"cells": {"a": {"seconds": 100.0, "estimate_seconds": 1.0}}}) == 10.0


def test_failed_ceilings_fall_back_to_the_nominal_ones_and_say_so(tmp_path):
    class NoCeilings(FakeMeasurer):
        def ceilings(self):
            raise RuntimeError("CUDA out of memory")

    _planned_doc(tmp_path, ["decode/d128/h32:8/b64/kv4096/fwd"])
    assert run.work_loop(tmp_path, time.time() + 1000, NoCeilings()) == 0
    doc = run.load(tmp_path)
    assert doc["ceilings"]["nominal"] and doc["ceilings"]["copy_bytes_per_s"] == cells.NOMINAL_CEILINGS.copy_bytes_per_s
    assert "NOT measured" in report.markdown(doc) and "CUDA out of memory" in report.markdown(doc)
    assert len(doc["cells"]) == 1


def test_a_new_worker_skips_the_cells_done_and_leaves_excluded_runners_out(tmp_path):
    names = ["decode/d128/h32:8/b64/kv4096/fwd", "varlen/d128/h16:16/causal/fwd"]
    _planned_doc(tmp_path, names, ceilings={"copy_bytes_per_s": 4e12, "gemm_flops_per_s": 8e14},
                 excluded={names[0]: {"sdpa_cudnn": "ended the worker process (ended with status -11): Segfault"}})
    assert run.work_loop(tmp_path, time.time() + 1000, FakeMeasurer()) == 0
    doc = run.load(tmp_path)
    assert doc["cells"][names[0]]["runners"]["sdpa_cudnn"]["error"].startswith("ended the worker process")
    assert "median_ms" in doc["cells"][names[0]]["runners"]["sdpa_flash"]
    measurer = FakeMeasurer()
    assert run.work_loop(tmp_path, time.time() + 1000, measurer) == 0
    assert measurer.calls == []  # nothing left to measure


def test_the_worker_asks_for_a_new_process_when_the_context_is_lost(tmp_path):
    names = ["batch/d64/h16:4/s2048/causal/fwdbwd", "varlen/d128/h16:16/causal/fwd"]
    _planned_doc(tmp_path, names)
    assert run.work_loop(tmp_path, time.time() + 1000,
                         FakeMeasurer(fail={"sdpa_cudnn": "first"}, lose_context=True)) == run.EXIT_CONTEXT_LOST
    assert run.read_progress(tmp_path) | {"time": 0} == {"cell": names[0], "runner": "sdpa_cudnn", "phase": "setup",
                                                         "time": 0}
    assert run.load(tmp_path)["cells"] == {}


def test_after_a_crash_the_supervisor_excludes_the_runner_then_fails_the_cell():
    name = "batch/d64/h16:4/s2048/causal/fwdbwd"
    doc = {"cells": {}, "excluded": {}}
    setup = {"cell": name, "runner": "sdpa_cudnn", "phase": "setup"}
    assert run.after_worker(doc, setup, 0, "", False) == "done"
    assert run.after_worker(doc, setup, -11, "Segmentation fault", False) == "restart"
    assert doc["excluded"][name]["sdpa_cudnn"] == "ended the worker process (ended with status -11): Segmentation fault"
    assert doc["cells"] == {}
    assert run.after_worker(doc, setup, 3, "lost again", False) == "restart"  # the same runner again: the cell fails
    assert doc["cells"][name]["error"].startswith("the worker ended with status 3 during setup of sdpa_cudnn")
    doc = {"cells": {}, "excluded": {}}
    assert run.after_worker(doc, {"cell": name, "runner": None, "phase": "timing"}, 3, "x", False) == "restart"
    assert "during timing of the cell" in doc["cells"][name]["error"]
    assert run.after_worker(doc, {"cell": name, "runner": "hipattn", "phase": "setup"}, -9, "", True) == "stop"
    assert "killed past the budget" in doc["cells"][name]["error"]
    assert run.after_worker(doc, {"cell": None, "phase": "ceilings"}, 1, "ImportError: no torch", False) == "stop"
    assert doc["errors"] == ["worker ended with status 1 during ceilings: ImportError: no torch"]


def test_the_supervisor_restarts_a_crashed_worker_without_the_runner_that_crashed(tmp_path, monkeypatch, capsys):
    crashed_in = "decode/d128/h32:8/b1/kv131072/fwd"  # the second quick decode cell
    launches = []

    def fake_launch(directory, deadline):
        launches.append(deadline)
        if len(launches) == 1:  # measures one cell, then dies setting up sdpa_cudnn on the next
            doc = run.load(directory)
            doc["planned"], planned = doc["planned"][:1], doc["planned"]
            run.save(doc, directory)
            assert run.work_loop(directory, deadline, FakeMeasurer()) == 0
            doc = run.load(directory)
            doc["planned"] = planned
            run.save(doc, directory)
            run.set_progress(directory, crashed_in, "sdpa_cudnn", "setup")
            return -11, "Fatal Python error: Segmentation fault", False
        return run.work_loop(directory, deadline, FakeMeasurer()), "", False

    monkeypatch.setattr(run, "launch_worker", fake_launch)
    options = {"quick": True, "only": "decode", "budget_seconds": 480, "rounds": 1, "warm": False, "warm_arch": "sm_90a"}
    assert run.supervise(tmp_path, ["--quick", "--only", "decode", "--no-warm", "--out", "x"], options) == 0
    doc = run.load(tmp_path)
    assert len(launches) == 2 and launches[0] == launches[1]  # one deadline for the whole run
    assert sorted(doc["cells"]) == sorted(doc["planned"]) and doc["skipped"] == {}
    assert doc["cells"][crashed_in]["runners"]["sdpa_cudnn"]["error"] == (
        "ended the worker process (ended with status -11): Fatal Python error: Segmentation fault")
    assert "median_ms" in doc["cells"][crashed_in]["runners"]["hipattn"]
    assert [w["exit"] for w in doc["workers"]] == [-11, 0]
    assert doc["finished"] and doc["elapsed_seconds"] >= 0
    assert (tmp_path / report.MARKDOWN_NAME).exists()
    out = capsys.readouterr().out
    assert "starting another" in out and "hipattn is faster than the best peer in" in out


def test_the_prewarm_records_how_hipattn_warm_ended():
    warm = run.prewarm("not_an_arch", timeout=120)
    assert warm["command"].endswith("-m hipattn warm --arch not_an_arch --jobs " + warm["command"].split()[-1])
    assert warm["exit"] not in (0, "timeout") and warm["tail"] and warm["seconds"] >= 0


def test_a_run_without_a_gpu_ends_with_a_report_that_says_why(tmp_path):
    try:
        import torch
    except ImportError:
        pass  # the worker fails to import it: the same outcome
    else:
        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU: the worker would measure")
    done = subprocess.run([*TOOL, "--no-warm", "--only", "b64/kv4096/fwd", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=REPOSITORY)
    doc = run.load(tmp_path)
    assert done.returncode == 1
    assert doc["skipped"] == {"decode/d128/h32:8/b64/kv4096/fwd": "not reached: the worker stopped before it"}
    assert doc["workers"][0]["exit"] == 1 and doc["errors"]
    assert doc["command"] == f"python -m tools.bench_matrix --no-warm --only b64/kv4096/fwd --out {tmp_path}"
    assert (tmp_path / report.MARKDOWN_NAME).exists()
