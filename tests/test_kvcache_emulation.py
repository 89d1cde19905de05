"""flash_attn_with_kvcache's kernels (append with rotary, split-KV attention, combine) on an emulated
gfx90a (wave64: the MFMA attention kernel at head_dims that are multiples of 32, the portable one at
80), an emulated gfx950 (the MFMA kernel with its 16x16x32 instructions) and an emulated sm_80
(warp32: the tensor-core kernel), through the low-level entry with raw arrays, caller outputs and
workspace, against a float64 model of the call (tests/support/kvcache_reference.py). Outputs are
poisoned with NaN first and every element, and the whole cache after the append, is compared."""

from __future__ import annotations

import numpy as np
import pytest
from support.emulation import EmulatedDevice, aligned_bytes, array_16bit, from_16bit, needs_compiler, to_16bit
from support.kvcache_reference import KvCacheCase, expected
from support.raw_calls import NAN_BITS
from support.reference import TOLERANCE, alibi_slopes, relative_error, sink_logits

import hipattn
from hipattn.catalog import decode as catalog_decode

pytestmark = needs_compiler


@pytest.fixture(params=["gfx90a", "sm_80"])
def device(request, emulation_dirs, monkeypatch):
    return EmulatedDevice(*emulation_dirs, monkeypatch, arch=request.param)


def _round16(dtype):
    return lambda x: from_16bit(to_16bit(x, dtype), dtype)


def _values(rng, shape, dtype):
    """Random values rounded to ``dtype``: (bits for the kernel, the same values as float64)."""
    bits = to_16bit(rng.standard_normal(shape), dtype)
    return bits, from_16bit(bits, dtype)


def _run(device, case_bits: dict, case: KvCacheCase, dtype, num_splits, *, cache_seqlens_as_int=False):
    """Call hipattn.flash_attn_with_kvcache on the emulated device; returns (out, lse, k_cache, v_cache)
    as float64. ``case_bits`` holds the 16-bit arrays, which the call appends to in place."""
    batch, seqlen_q, heads_q, head_dim = case.q.shape
    out = np.full(case.q.shape, NAN_BITS[dtype], dtype=np.uint16)
    lse = np.full((batch, heads_q, seqlen_q), np.nan, dtype=np.float32)
    ints = {name: getattr(case, name) for name in ("batch_idx", "leftpad", "block_table")}
    ints = {name: None if value is None else np.ascontiguousarray(value, dtype=np.int32) for name, value in ints.items()}
    seqlens = np.ascontiguousarray(case.cache_seqlens, dtype=np.int32)
    arguments = dict(
        k=array_16bit(case_bits["k"], dtype) if case.k is not None else None,
        v=array_16bit(case_bits["v"], dtype) if case.v is not None else None,
        rotary_cos=array_16bit(case_bits["cos"], dtype) if case.cos is not None else None,
        rotary_sin=array_16bit(case_bits["sin"], dtype) if case.cos is not None else None,
        cache_seqlens=int(seqlens[0]) if cache_seqlens_as_int else device.array(seqlens),
        cache_batch_idx=device.array(ints["batch_idx"]) if ints["batch_idx"] is not None else None,
        cache_leftpad=device.array(ints["leftpad"]) if ints["leftpad"] is not None else None,
        block_table=device.array(ints["block_table"]) if ints["block_table"] is not None else None,
        causal=case.causal, window_size=case.window, num_splits=num_splits)
    q, k_cache, v_cache = (array_16bit(case_bits[name], dtype) for name in ("q", "k_cache", "v_cache"))
    workspace_bytes = hipattn.kvcache_workspace_bytes(q, k_cache, v_cache, **arguments)
    workspace = aligned_bytes(workspace_bytes)
    slopes = device.array(np.ascontiguousarray(case.alibi, dtype=np.float32)) if case.alibi is not None else None
    sink = device.array(np.ascontiguousarray(case.sink, dtype=np.float32)) if case.sink is not None else None
    hipattn.flash_attn_with_kvcache(q, k_cache, v_cache, **arguments, rotary_interleaved=case.interleaved,
                                    softcap=case.softcap, alibi_slopes=slopes, learnable_sink=sink,
                                    return_softmax_lse=True,
                                    out=array_16bit(out, dtype), lse=device.array(lse),
                                    workspace=device.array(workspace) if workspace_bytes else None)
    return (from_16bit(out, dtype), lse.astype(np.float64), from_16bit(case_bits["k_cache"], dtype),
            from_16bit(case_bits["v_cache"], dtype))


def _case(rng, dtype, *, batch=3, seqlen_q=1, heads_q=4, heads_kv=2, head_dim=64, capacity=80, seqlen_new=0,
          rotary_dim=0, interleaved=True, page_size=None, batch_idx=False, leftpad=False, causal=False, lengths=None,
          window=(-1, -1), softcap=0.0, alibi=None, sink=False):
    """A call's inputs; ``alibi``: None, "heads" (slopes [Hq]) or "sequences" ([batch, Hq]); ``sink``:
    learnable sink logits [Hq] (reference.sink_logits)."""
    bits, case = {}, {}
    bits["q"], case["q"] = _values(rng, (batch, seqlen_q, heads_q, head_dim), dtype)
    if page_size is None:
        entries = batch + 2 if batch_idx else batch
        cache_shape = (entries, capacity, heads_kv, head_dim)
    else:
        pages_per_sequence = -(-capacity // page_size)
        cache_shape = (batch * pages_per_sequence + 3, page_size, heads_kv, head_dim)
        capacity = pages_per_sequence * page_size
        # Shuffled pages, with spare ones no sequence uses.
        case["block_table"] = rng.permutation(cache_shape[0])[:batch * pages_per_sequence].reshape(batch, -1)
    bits["k_cache"], case["k_cache"] = _values(rng, cache_shape, dtype)
    bits["v_cache"], case["v_cache"] = _values(rng, cache_shape, dtype)
    if seqlen_new:
        bits["k"], case["k"] = _values(rng, (batch, seqlen_new, heads_kv, head_dim), dtype)
        bits["v"], case["v"] = _values(rng, (batch, seqlen_new, heads_kv, head_dim), dtype)
    if rotary_dim:
        angle = rng.uniform(0, 2 * np.pi, (capacity, rotary_dim // 2))
        bits["cos"], case["cos"] = to_16bit(np.cos(angle), dtype), from_16bit(to_16bit(np.cos(angle), dtype), dtype)
        bits["sin"], case["sin"] = to_16bit(np.sin(angle), dtype), from_16bit(to_16bit(np.sin(angle), dtype), dtype)
    if lengths is None:
        lengths = rng.integers(0, capacity - seqlen_new + 1, batch)
    case["cache_seqlens"] = np.asarray(lengths)
    if batch_idx:
        case["batch_idx"] = rng.permutation(cache_shape[0])[:batch]
    if leftpad:
        case["leftpad"] = np.array([rng.integers(0, n + 1) for n in case["cache_seqlens"]])
    slopes = None if alibi is None else alibi_slopes(batch, heads_q, per_sequence=alibi == "sequences")
    sinks = sink_logits(heads_q) if sink else None
    return bits, KvCacheCase(**case, interleaved=interleaved, causal=causal, window=window, softcap=softcap,
                             alibi=slopes, sink=sinks)


def _check(device, bits, case, dtype, num_splits, portable=False, **options):
    scale = case.q.shape[-1] ** -0.5
    want_out, want_lse, want_k, want_v = expected(case, scale, _round16(dtype))
    out, lse, k_cache, v_cache = _run(device, bits, case, dtype, num_splits, **options)
    assert not np.isnan(out).any() and not np.isnan(lse).any(), "an output element was never written"
    assert relative_error(out, want_out) < TOLERANCE[dtype]
    finite = np.isfinite(want_lse)
    assert (np.isinf(lse) == ~finite).all(), "LSE = +inf exactly on rows that see no key (and no sink)"
    assert np.abs(lse[finite] - want_lse[finite]).max(initial=0.0) < 1e-3
    assert np.array_equal(v_cache, want_v), "values are appended bit for bit, and nothing else changes"
    # Rotated keys are rounded once from fp32; the model rounds from float64: at most one unit apart.
    assert np.abs(k_cache - want_k).max() <= 2 * np.abs(want_k).max() * 2.0 ** -8
    # The tensor-core kernel on NVIDIA, the matrix-core one on AMD (the portable one at head_dim 80);
    # the combine only for split calls.
    arch = device.backend.target.arch
    attention = "decode_forward_mma" if arch == "sm_80" else (
        "decode_forward_mfma" if case.q.shape[-1] % 32 == 0 and not portable else "decode_forward")
    assert attention in device.kernels
    if num_splits:
        assert ("decode_combine" in device.kernels) == (num_splits > 1)


@pytest.mark.parametrize("num_splits", [1, 3, 0])
@pytest.mark.parametrize("heads_q,heads_kv,seqlen_q", [(4, 2, 1), (8, 1, 1), (2, 2, 3)])
def test_attention_over_a_contiguous_cache_matches_float64(device, heads_q, heads_kv, seqlen_q, num_splits):
    """GQA, MQA (a group of 8: the 8-row kernel) and MHA with 3 query tokens, causal (bottom-right);
    lengths 0 (no key: O = 0, LSE = +inf), partial and at capacity; one, three and the host's splits."""
    rng = np.random.default_rng()
    bits, case = _case(rng, "bf16", heads_q=heads_q, heads_kv=heads_kv, seqlen_q=seqlen_q, causal=seqlen_q > 1,
                       lengths=[0, 37, 80])
    _check(device, bits, case, "bf16", num_splits)


@pytest.mark.parametrize("head_dim", [80, 96])
@pytest.mark.parametrize("interleaved", [True, False])
def test_append_with_rotary_into_a_paged_cache_matches_float64(device, interleaved, head_dim):
    """Two new tokens appended through a shuffled block table (pages of 16, the last one partly
    full), keys and queries rotated on 32 dims, causal; head_dim 80 (on AMD the portable kernel, a
    team of 16 lanes with 10 holding data) and 96 (three 32-column pieces per row on MFMA)."""
    rng = np.random.default_rng()
    bits, case = _case(rng, "fp16", head_dim=head_dim, capacity=70, seqlen_q=2, seqlen_new=2, rotary_dim=32,
                       interleaved=interleaved, page_size=16, causal=True, lengths=[0, 33, 68])
    _check(device, bits, case, "fp16", 2)


@pytest.mark.parametrize("dtype,head_dim,heads_q,heads_kv,seqlen_q", [("bf16", 128, 8, 2, 1), ("fp16", 256, 4, 1, 3)])
def test_the_mfma_kernel_on_an_emulated_gfx950_matches_float64(emulation_dirs, monkeypatch, dtype, head_dim, heads_q,
                                                                heads_kv, seqlen_q):
    """gfx950 contracts head_dim with its 16x16x32 MFMA (mma_amd.h's mfma_two_steps); two waves at
    head_dim 256; GQA and MQA, causal with 3 query tokens, three splits."""
    device = EmulatedDevice(*emulation_dirs, monkeypatch, arch="gfx950")
    rng = np.random.default_rng()
    bits, case = _case(rng, dtype, head_dim=head_dim, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=seqlen_q,
                       causal=seqlen_q > 1, seqlen_new=1, lengths=[0, 40, 79])
    _check(device, bits, case, dtype, 3)


def test_batch_index_leftpad_and_an_int_cache_seqlens(device):
    """cache_batch_idx picks entries of a bigger cache, cache_leftpad hides each sequence's first keys;
    then one host int for every sequence's length, with new tokens and no rotary."""
    rng = np.random.default_rng()
    bits, case = _case(rng, "bf16", batch_idx=True, leftpad=True, seqlen_new=1)
    _check(device, bits, case, "bf16", 0)
    bits, case = _case(rng, "bf16", seqlen_new=3, lengths=[20, 20, 20])
    _check(device, bits, case, "bf16", 2, cache_seqlens_as_int=True)


@pytest.mark.parametrize("heads_q,heads_kv,seqlen_q,head_dim", [(4, 2, 1, 64), (8, 1, 1, 128), (2, 2, 3, 256)])
def test_the_portable_kernel_matches_float64_at_wave64(emulation_dirs, monkeypatch, heads_q, heads_kv, seqlen_q,
                                                       head_dim):
    """The kernel of AMD targets without MFMA (and of head_dim 80 on MFMA ones), forced on the emulated
    gfx90a: its 4-row blocks (a group of 4) and 8-row ones (a group of 8; 3 tokens of MHA, causal), with
    teams of 8, 16 and 32 lanes, three splits and new tokens appended."""
    monkeypatch.setattr(catalog_decode, "DECODE_MFMA_TILES", {})
    device = EmulatedDevice(*emulation_dirs, monkeypatch, arch="gfx90a")
    rng = np.random.default_rng()
    bits, case = _case(rng, "bf16", heads_q=heads_q, heads_kv=heads_kv, seqlen_q=seqlen_q, head_dim=head_dim,
                       causal=seqlen_q > 1, seqlen_new=1, lengths=[0, 37, 79])
    _check(device, bits, case, "bf16", 3, portable=True)


@pytest.mark.parametrize("window,causal", [((10, -1), False), ((20, 0), True), ((3, 2), False)])
@pytest.mark.parametrize("num_splits,cache", [(1, "paged"), (3, "paged"), (3, "leftpad")])
def test_sliding_windows_match_float64(device, window, causal, num_splits, cache):
    """flash-attn's window_size against the cache, aligned with its end: a left side that cuts the keys
    the splits share out, a band under the causal diagonal, and a window with a right side (three
    query tokens, so that the right side matters); appended keys with rotary (windowed calls rotate q
    at advancing positions), over a paged cache or a contiguous one with leftpad."""
    rng = np.random.default_rng()
    layout = dict(page_size=16) if cache == "paged" else dict(leftpad=True)
    bits, case = _case(rng, "bf16", heads_q=4, heads_kv=2, seqlen_q=3, seqlen_new=2, rotary_dim=32, causal=causal,
                       window=window, lengths=[0, 37, 70], **layout)
    _check(device, bits, case, "bf16", num_splits)


# flash-attn's score modifiers: a softcap that bends N(0, 1) scores (1.5), ALiBi slopes per query head
# or per (sequence, query head), and both, with GQA so that a block's rows (tokens of the group's
# query heads) each need their own head's slope (a group of 3, so that the two rows g and g + 8 an
# mma.sync lane holds are of different heads); key positions count from cache_leftpad.
SCORE_MODS = [(1.5, None, "leftpad", 1, 3), (0.0, "heads", "paged", 3, 1), (0.0, "sequences", "leftpad", 3, 0),
              (1.5, "heads", "paged", 2, 3)]


@pytest.mark.parametrize("softcap,alibi,cache,seqlen_q,num_splits", SCORE_MODS, ids=lambda m: str(m))
def test_score_modifiers_match_float64(device, softcap, alibi, cache, seqlen_q, num_splits):
    """The tensor-core and matrix-core kernels with softcap and ALiBi: 6 query heads over 2 KV heads,
    one new token appended, a causal multi-token query (whose tokens sit at different distances from
    each key), over a contiguous cache with leftpad or a paged one, with one, three and the host's
    splits."""
    rng = np.random.default_rng()
    layout = dict(page_size=16) if cache == "paged" else dict(leftpad=True)
    bits, case = _case(rng, "bf16", heads_q=6, heads_kv=2, seqlen_q=seqlen_q, seqlen_new=1, causal=seqlen_q > 1,
                       lengths=[0, 37, 70], softcap=softcap, alibi=alibi, **layout)
    _check(device, bits, case, "bf16", num_splits)


# Learnable sinks: in the one-split kernels' merge and in the combine; a sequence with an empty cache
# and no new token (length 0) whose rows see only the sink, with and without a softcap beside them.
SINKS = [(0.0, "leftpad", 1, 1), (0.0, "paged", 3, 3), (1.5, "leftpad", 2, 0)]


@pytest.mark.parametrize("softcap,cache,seqlen_q,num_splits", SINKS, ids=lambda m: str(m))
def test_learnable_sinks_match_float64(device, softcap, cache, seqlen_q, num_splits):
    """A sink per query head joins every row's softmax sum and the LSE; a row that sees no key gets
    O = 0 and LSE = its sink (6 query heads over 2 KV heads, the group's rows with different sinks)."""
    rng = np.random.default_rng()
    layout = dict(page_size=16) if cache == "paged" else dict(leftpad=True)
    bits, case = _case(rng, "bf16", heads_q=6, heads_kv=2, seqlen_q=seqlen_q, causal=seqlen_q > 1,
                       lengths=[0, 37, 70], softcap=softcap, sink=True, **layout)
    _check(device, bits, case, "bf16", num_splits)


@pytest.mark.parametrize("heads_q,heads_kv,seqlen_q", [(4, 1, 1), (4, 2, 3)])
def test_the_portable_kernel_matches_float64_with_score_modifiers(emulation_dirs, monkeypatch, heads_q, heads_kv,
                                                                  seqlen_q):
    """The portable kernel, forced on the emulated gfx90a, forms its scores from the raw dot products
    when modified (the plain kernel pre-scales q): a 4-row block of a group of 4 (one split), and an
    8-row one of 3 causal tokens of a group of 2 (three splits); softcap, ALiBi per sequence and sinks,
    leftpad."""
    monkeypatch.setattr(catalog_decode, "DECODE_MFMA_TILES", {})
    device = EmulatedDevice(*emulation_dirs, monkeypatch, arch="gfx90a")
    rng = np.random.default_rng()
    bits, case = _case(rng, "bf16", heads_q=heads_q, heads_kv=heads_kv, seqlen_q=seqlen_q, causal=seqlen_q > 1,
                       seqlen_new=1, leftpad=True, lengths=[0, 37, 79], softcap=1.5, alibi="sequences", sink=True)
    _check(device, bits, case, "bf16", 1 if seqlen_q == 1 else 3, portable=True)


def test_the_mfma_kernel_on_an_emulated_gfx950_matches_float64_with_score_modifiers(emulation_dirs, monkeypatch):
    """gfx950's 16x16x32 MFMA kernel with softcap, ALiBi per head and sinks: GQA, 2 causal tokens, leftpad."""
    device = EmulatedDevice(*emulation_dirs, monkeypatch, arch="gfx950")
    rng = np.random.default_rng()
    bits, case = _case(rng, "fp16", head_dim=128, heads_q=8, heads_kv=2, seqlen_q=2, causal=True, seqlen_new=1,
                       leftpad=True, lengths=[0, 40, 79], softcap=1.5, alibi="heads", sink=True)
    _check(device, bits, case, "fp16", 3)
