"""tools.bench_decode's configuration knobs on the CPU (the sweep itself needs a GPU)."""

from __future__ import annotations

import pytest

from hipattn.catalog import decode
from tools import bench_decode


def test_a_copy_engine_row_names_its_ring():
    tiles = bench_decode._attention_rows("tma:4")(128, 4)
    assert tiles.stages == 4 and isinstance(tiles, decode.DecodeTmaTiles)


def test_an_unknown_kernel_row_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown kernel 'wgmma:3'"):
        bench_decode._attention_rows("wgmma:3")


def test_only_keeps_the_shapes_whose_name_matches():
    assert bench_decode.selected_shapes("^b1/") == [(1, 32768, 32, 8), (1, 131072, 32, 8)]
    assert bench_decode.selected_shapes(None) == list(bench_decode.DECODE_SHAPES)


def test_only_that_matches_no_shape_is_refused_with_the_names():
    with pytest.raises(ValueError, match=r"matches no decode shape; the shapes are b64/kv4096/h32:8, "):
        bench_decode.selected_shapes("^b2/")
