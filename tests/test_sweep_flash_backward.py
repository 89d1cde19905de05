"""The backward sweep's variant spelling: every table row it times by default reads back as that row."""

import pytest

from hipattn.catalog.flash_backward import FlashDkdvWgmmaTiles
from tools.sweep_flash_backward import default_variants, parse_variant, spell


@pytest.mark.parametrize("variant", default_variants())
def test_every_default_variant_reads_back_as_itself(variant):
    head_dim, dkdv, dq = parse_variant(variant)
    assert f"{head_dim}:{spell(dkdv)}/{spell(dq)}" == variant


def test_column_groups_are_spelled_only_where_there_are_several():
    assert parse_variant("256:w2c2/128x32x8")[1] == FlashDkdvWgmmaTiles(warpgroups=2, column_groups=2)
    assert parse_variant("128:w2/128x64x8")[1] == FlashDkdvWgmmaTiles(warpgroups=2)
    assert spell(FlashDkdvWgmmaTiles(warpgroups=2)) == "w2"


def test_query_rows_are_spelled_only_where_they_are_not_64():
    assert parse_variant("64:w2m128/128x128x8")[1] == FlashDkdvWgmmaTiles(warpgroups=2, block_m=128)
    assert spell(FlashDkdvWgmmaTiles(warpgroups=2, block_m=128)) == "w2m128"
    assert parse_variant("64:w2m64/128x128x8")[1] == FlashDkdvWgmmaTiles(warpgroups=2)
