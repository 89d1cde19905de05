"""tools.bench_decode's configuration knobs on the CPU (the sweep itself needs a GPU)."""

from __future__ import annotations

import pytest

from hipattn.catalog import decode
from tools import bench_decode


def test_a_copy_engine_row_names_its_ring_and_v_lag():
    tiles = bench_decode._attention_rows("tma:4v1")(128, 4)
    assert (tiles.stages, tiles.v_lag) == (4, 1) and isinstance(tiles, decode.DecodeTmaTiles)


def test_an_unknown_kernel_row_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown kernel 'wgmma:3'"):
        bench_decode._attention_rows("wgmma:3")
