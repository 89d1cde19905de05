"""tools.bench_decode's configuration knobs on the CPU (the sweep itself needs a GPU)."""

from __future__ import annotations

from hipattn.backends.tensor_maps import TensorMapLayout
from tools import bench_decode

LAYOUT = TensorMapLayout("bf16", (128, 8, 4096, 64), (256, 2048, 8388608), (64, 1, 64, 1))


def test_an_l2_promotion_configuration_changes_only_the_maps_promotion():
    promoted = bench_decode._promoted_layout(lambda *args: LAYOUT, 0, "k_cache", "bshd", 64)
    assert promoted.l2_promotion == 0
    assert (promoted.dims, promoted.strides, promoted.box) == (LAYOUT.dims, LAYOUT.strides, LAYOUT.box)


def test_an_array_without_a_map_keeps_none():
    assert bench_decode._promoted_layout(lambda *args: None, 128, "k_cache", "bshd", 64) is None
