"""tools.sanitize's pure parts, on the CPU: its model of how the kernels clamp a sequence
description, and that its cases reach every kernel family hipattn ships."""

from __future__ import annotations

import pytest

from hipattn.catalog import FAMILIES
from hipattn.catalog.smallseq import SMALLSEQ_TILE
from tools import sanitize

# compute-sanitizer runs on the H200: the families to cover are those shipped for its target, sm_90a
# (the AMD-only MFMA kernels cannot launch there; the wgmma ones exist only there).
SANITIZED_FAMILIES = {name for name, family in FAMILIES.items() if list(family.shipped(sanitize.SANITIZER_TARGET))}


def test_the_cases_launch_every_kernel_family_hipattn_ships():
    launched = {name for case in sanitize.build_cases() for name in case.families}
    assert launched == SANITIZED_FAMILIES, SANITIZED_FAMILIES ^ launched


def test_the_quick_cases_still_launch_every_family():
    launched = {name for case in sanitize.build_cases(quick=True) for name in case.families}
    assert launched == SANITIZED_FAMILIES


def test_every_adversarial_description_runs_on_both_kernels_and_both_sides():
    names = {case.name for case in sanitize.build_cases()}
    for kernel in ("tensor-core", "portable"):
        for bad in sanitize.adversarial_cu_seqlens(sanitize.TOTAL_Q):
            for side in ("q", "k", "both"):
                assert any(n.startswith(kernel) and n.endswith(f"{bad} on {side}") for n in names), (kernel, bad, side)


def test_adversarial_descriptions_are_each_malformed_and_of_batch_plus_one_entries():
    total = sanitize.TOTAL_Q
    for name, cu in sanitize.adversarial_cu_seqlens(total).items():
        assert len(cu) == sanitize.BATCH + 1, name
        lengths = [b - a for a, b in zip(cu, cu[1:], strict=False)]
        well_formed = cu[0] == 0 and all(0 <= n <= SMALLSEQ_TILE for n in lengths) and cu[-1] <= total
        assert not well_formed, name
        assert all(sanitize.INT32_MIN <= x <= sanitize.INT32_MAX for x in cu), name


def test_valid_cu_seqlens_clamp_to_themselves():
    cu = sanitize.cumulative([0, 1, 17, 13])
    assert sanitize.clamped_sequences(cu, None, 4, 17, 40, 17) == [(0, 0), (0, 1), (1, 17), (18, 13)]


@pytest.mark.parametrize(
    "cu,expected",
    [
        ([0, 10, 5, 30, 37], [(0, 10), (10, 0), (5, 17), (30, 7)]),  # a negative length is empty
        ([40, 30, 20, 10, 0], [(40, 0), (30, 0), (20, 0), (10, 0)]),  # decreasing: all empty
        ([0, 10, 20, 30, 1040], [(0, 10), (10, 10), (20, 10), (30, 10)]),  # the last stops at the tensor's end
        ([-5, -100, 3, -7, 40], [(0, 0), (0, 17), (3, 0), (0, 17)]),  # negative starts clamp to 0
        ([41, 45, 140, 2**20, 2**30], [(40, 0)] * 4),  # beyond the tensor: empty, starting at its end
    ],
)
def test_malformed_cu_seqlens_clamp_inside_the_tensor(cu, expected):
    assert sanitize.clamped_sequences(cu, None, 4, 17, 40, 17) == expected


def test_int32_wraparound_and_exact_differences_are_both_kept_in_the_may_write_set():
    cu = [sanitize.INT32_MIN, sanitize.INT32_MAX, sanitize.INT32_MIN, 0, sanitize.INT32_MAX]
    wrapped = sanitize.clamped_sequences(cu, None, 4, 17, 40, 17, wrap=True)
    exact = sanitize.clamped_sequences(cu, None, 4, 17, 40, 17, wrap=False)
    # INT32_MAX - INT32_MIN wraps to -1 (empty) but is 2^32 - 1 exactly (clamped to the tile).
    assert wrapped[0] == (0, 0) and exact[0] == (0, 17)
    rows = sanitize.rows_a_kernel_may_write(cu, None, 4, 17, 40, 17)
    assert set(range(17)) <= rows[0]


def test_max_seqlen_and_seqused_bound_the_length():
    cu = sanitize.cumulative([17, 17])
    assert sanitize.clamped_sequences(cu, None, 2, 5, 34, 17) == [(0, 5), (17, 5)]
    assert sanitize.clamped_sequences(cu, [-1, 1000], 2, 17, 34, 17) == [(0, 0), (17, 17)]
    # BSHD: every sequence starts at token 0 of its own batch slot.
    assert sanitize.clamped_sequences(None, [3, 2**31 - 1], 2, 13, 13, 17) == [(0, 3), (0, 13)]


def test_rows_outside_every_sequence_are_not_in_the_may_write_set():
    cu = sanitize.cumulative([0, 1, 17, 13])  # 31 of 40 tokens
    rows = sanitize.rows_a_kernel_may_write(cu, None, 4, 17, 40, 17)
    assert all(r == set(range(31)) for r in rows)
    bshd = sanitize.rows_a_kernel_may_write(None, [0, 4, 17, 1], 4, 17, 17, 17)
    assert bshd == [set(), set(range(4)), set(range(17)), {0}]
