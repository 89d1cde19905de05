"""The MFMA small-seq kernels (kernels/smallseq/forward_mfma.hip, backward_mfma.hip), which gfx90a and
gfx94x run for every small-seq call, on the emulated gfx90a (tests/support/emulation.py) against float64,
through hipattn's own API and launch path.

Each case is one instantiation (dtype, head_dim, query heads) of both kernels, so that every
head_dim's waves-per-workgroup (1, 2 and 4 in the backward, the partial scores summed through LDS)
meets both dtypes, and the group sizes 1, 2, 3, 4 and 8 (MQA) are spread over them. Lengths cover 0, 1,
16 and 17 on each side (17: the second key tile of one row, the 17th query row of a tile), queries
longer and shorter than keys (causal rows that see no key), THD with cu_seqlens and BSHD with seqused,
and sliding windows (flash-attn's window_size), also through the portable kernels.
Outputs are poisoned with NaN and every element is compared; rows past a sequence must stay NaN."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest
from support.emulation import (
    EMULATED_ARCH,
    EmulatedDevice,
    EmulationBackend,
    aligned_bytes,
    needs_compiler,
)
from support.raw_calls import (
    check_bshd_forward_and_backward,
    check_forward_and_backward,
)

import hipattn
from hipattn.arrays import raw_array
from hipattn.catalog import smallseq as catalog
from hipattn.jit.cache import DiskCache
from hipattn.jit.registry import Registry
from hipattn.jit.target import Target
from hipattn.ops import smallseq as smallseq_ops

pytestmark = needs_compiler

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
    return [row.spec(case.dtype, case.head_dim, heads=case.heads_q, score_mods=False) for row in (forward, backward)]


@pytest.fixture(scope="module")
def build_dirs(emulation_dirs):
    """Build and cache directories for the module, filled up front: every case's two kernels are
    compiled two at a time (g++ in subprocesses), so the tests then load them from the cache."""
    build, cache = emulation_dirs
    registry = Registry(EmulationBackend(str(build)), DiskCache(str(cache)))
    specs = sorted({spec for case in CASES for spec in _specs(case)}, key=lambda spec: spec.canonical())
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(lambda spec: registry.compile_spec(spec, Target.parse(EMULATED_ARCH)), specs))
    return build, cache


@pytest.fixture
def device(build_dirs, monkeypatch):
    return EmulatedDevice(*build_dirs, monkeypatch)


def _loaded_families(device) -> set[str]:
    return {kernel.spec.family.name for kernel in device.registry.loaded()}


def _run(device, case: Case, rng):
    # max_seqlen is the tile, an upper bound of the real lengths (as a graph captured for a capacity passes).
    lengths_q, lengths_k = list(case.lengths_q), list(case.lengths_k)
    if case.layout == "thd":
        check_forward_and_backward(device, rng, lengths_q, lengths_k, case.heads_q, case.heads_kv, case.head_dim,
                                   case.dtype, case.causal, max_q=17, max_k=17)
    else:
        check_bshd_forward_and_backward(device, rng, lengths_q, lengths_k, 17, 17, case.heads_q, case.heads_kv,
                                        case.head_dim, case.dtype, case.causal)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_mfma_small_seq_kernels_match_float64(device, case):
    rng = np.random.default_rng()
    _run(device, case, rng)
    assert device.backend.launches == 2, "one small-seq kernel each way"
    assert _loaded_families(device) == {"smallseq_forward_mfma", "smallseq_backward_mfma"}


# Sliding windows, flash-attn's window_size=(left, right) (-1: no bound on that side), with causal or
# not (causal makes the right side 0, as in flash-attn), over sequences whose queries are longer and
# shorter than their keys: windows cut by either end of a sequence, rows whose window holds no key
# (O = 0, LSE = +inf), and each side bounded alone.
# (A window of one key, (0, 0), would give dQ = 0 exactly in float64, P being 1, which rounding misses
# by 1e-8: relative errors need a reference that is not all zero.)
WINDOWS = [((2, 0), False), ((0, 3), False), ((1, 1), False), ((3, -1), False), ((-1, 2), False), ((0, 1), False),
           ((1, 1), True), ((3, -1), True)]
# MHA, MQA (8 x 17 stacked rows: query tiles that cross heads), BSHD with G = 3, and two waves a
# workgroup (head_dim 128); causal comes with the window.
WINDOW_CASES = [dataclasses.replace(case, causal=False) for case in CASES[:4]]


def _window_id(window_causal) -> str:
    (left, right), causal = window_causal
    return f"window{left},{right}" + ("-causal" if causal else "")


@pytest.mark.parametrize("window_causal", WINDOWS, ids=_window_id)
@pytest.mark.parametrize("case", WINDOW_CASES, ids=str)
def test_the_mfma_small_seq_kernels_match_float64_with_windows(device, windowed, case, window_causal):
    window, causal = window_causal
    windowed(window)
    _run(device, dataclasses.replace(case, causal=causal), np.random.default_rng())
    assert device.backend.launches == 2
    assert _loaded_families(device) == {"smallseq_forward_mfma", "smallseq_backward_mfma"}


@pytest.mark.parametrize("window_causal", [((2, 0), False), ((1, 3), True)], ids=_window_id)
def test_the_portable_small_seq_kernels_match_float64_with_windows(device, windowed, monkeypatch, window_causal):
    """The kernels AMD targets without MFMA run (smallseq/forward.hip, backward.hip), GQA included."""
    window, causal = window_causal
    monkeypatch.setenv(smallseq_ops.KERNEL_SWITCH, "portable")
    windowed(window)
    _run(device, Case("bf16", 64, 4, 2, causal, "thd", *THD), np.random.default_rng())
    assert _loaded_families(device) == {"smallseq_forward", "smallseq_backward"}


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
