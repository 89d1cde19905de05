"""hipattn.dropout on the host: its Philox4x32-10 is the published generator (Random123's known-answer
vectors), the keep rule reads the 16-bit lane of the counter the kernels read (the emulated kernels
are checked against it in test_nvidia_emulation.py and test_amd_emulation.py), the same elements come
out in NumPy and torch, the drop rate is dropout_p, and bad probabilities are refused by name."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hipattn import dropout

WORD = 0xFFFFFFFF


@pytest.mark.parametrize("counter,key,expected", [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((WORD, WORD, WORD, WORD), (WORD, WORD), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
], ids=["zeros", "ones", "pi"])
def test_philox_matches_the_published_known_answers(counter, key, expected):
    as_arrays = [np.array([x], dtype=np.int64) for x in counter]
    assert tuple(int(x[0]) for x in dropout.philox4x32_10(*as_arrays, *key)) == expected


def test_an_element_is_the_16_bit_lane_its_counter_names():
    """Element (row i, key j) of stream s: lane 2 ((j % 32) // 8) + j % 2 of counter
    (i, 4 (j // 32) + (j % 8) // 2, s, 0) under the seed's two halves, kept when >= the threshold."""
    seed, stream, dropout_p = -0x1234_5678_9ABC_DEF1, 7, 0.3
    rows = np.arange(40, dtype=np.int64)[:, None]
    keys = np.arange(100, dtype=np.int64)[None, :]
    mask = dropout.keep_mask(np.int64(seed), stream, rows, keys, dropout_p)
    for i, j in [(0, 0), (3, 1), (5, 33), (39, 99), (17, 46)]:
        words = dropout.philox4x32_10(np.int64(i), np.int64(4 * (j // 32) + (j % 8) // 2), np.int64(stream),
                                      np.int64(0), seed & WORD, (seed >> 32) & WORD)
        value = (int(words[(j % 32) // 8]) >> (16 * (j % 2))) & 0xFFFF
        assert mask[i, j] == (value >= round(dropout_p * 65536)), (i, j)


def test_numpy_and_torch_keep_the_same_elements():
    torch = pytest.importorskip("torch")
    seed = -0x0F0F_0000_1234_5678
    rows, keys = np.arange(64, dtype=np.int64)[:, None], np.arange(96, dtype=np.int64)[None, :]
    expected = dropout.keep_mask(np.int64(seed), 3, rows, keys, 0.17)
    got = dropout.keep_mask(torch.tensor([seed]), 3, torch.from_numpy(rows), torch.from_numpy(keys), 0.17)
    assert np.array_equal(got.numpy(), expected)


def test_the_grid_of_a_whole_tensor_keeps_what_keep_mask_keeps():
    """keep_grid (one Philox call per eight keys, for S_dmask) against the per-element rule, on key
    counts off the 32-key stripe, for several streams at once."""
    torch = pytest.importorskip("torch")
    seed = torch.tensor([0x7A5A_0000_FFFF_0001 - (1 << 63)])
    streams = torch.tensor([[0, 1, 2], [9, 10, 11]])
    grid = dropout.keep_grid(seed, streams, 37, 71, 0.3)
    assert grid.shape == (2, 3, 37, 71)
    rows, keys = torch.arange(37)[:, None], torch.arange(71)[None, :]
    for index, stream in ((0, 0), (1, 2), (1, 1)):
        assert torch.equal(grid[index][stream], dropout.keep_mask(seed, int(streams[index, stream]), rows, keys, 0.3))


@pytest.mark.parametrize("dropout_p", [0.0, 0.1, 0.5, 0.9])
def test_the_drop_rate_is_dropout_p(dropout_p):
    rows, keys = np.arange(256, dtype=np.int64)[:, None], np.arange(256, dtype=np.int64)[None, :]
    kept = dropout.keep_mask(np.int64(99), 0, rows, keys, dropout_p)
    spread = 5 * math.sqrt(dropout_p * (1 - dropout_p) / kept.size)
    assert abs((1 - kept.mean()) - dropout_p) <= spread


def test_streams_and_seeds_give_other_masks():
    rows, keys = np.arange(64, dtype=np.int64)[:, None], np.arange(64, dtype=np.int64)[None, :]
    first = dropout.keep_mask(np.int64(5), 0, rows, keys, 0.5)
    assert not np.array_equal(first, dropout.keep_mask(np.int64(5), 1, rows, keys, 0.5))
    assert not np.array_equal(first, dropout.keep_mask(np.int64(6), 0, rows, keys, 0.5))
    assert not np.array_equal(first, dropout.keep_mask(np.int64(5 + (1 << 32)), 0, rows, keys, 0.5))


def test_kernel_fields_of_a_call():
    assert dropout.fields(0.0, None) == {"dropout_threshold": 0, "dropout_scale": 1.0, "dropout_seed": 0}
    assert dropout.threshold(0.17) == round(0.17 * 65536) and dropout.keep_scale(0.2) == pytest.approx(1.25)
    assert dropout.threshold(0.999999) == 65535, "the largest threshold still keeps some values"


@pytest.mark.parametrize("value,error,message", [
    (1.0, ValueError, "dropout_p is 1.0; it must be in [0, 1)"),
    (-0.5, ValueError, "dropout_p is -0.5"),
    (math.nan, ValueError, "dropout_p is nan"),
    ("0.1", TypeError, "dropout_p must be a host number in [0, 1), got '0.1'"),
    (True, TypeError, "got True"),
    (None, TypeError, "got None"),
])
def test_bad_probabilities_are_refused_by_name(value, error, message):
    with pytest.raises(error) as raised:
        dropout.check_dropout_p(value)
    assert message in str(raised.value)
