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
