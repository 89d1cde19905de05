"""Dropout of the attention probabilities on the host: the check of ``dropout_p`` and of the seed, the
kernels' fields, and the keep mask itself, computed as kernels/common/dropout.h computes it.

The kernels decide which probability is dropped from the call's 64-bit seed and the element's place
alone: (sequence, query head, query row, key). Philox4x32-10 keyed by the seed, at counter
``(row, 4 (key // 32) + (key % 8) // 2, sequence * heads_q + head, 0)``, gives eight 16-bit values;
the element's is number ``2 ((key % 32) // 8) + key % 2`` (low half first), and the element is kept
when it is at least ``round(dropout_p * 65536)``. ``keep_mask`` is that rule for arrays of places, in
NumPy (int64) or torch (int64, on any device): the tests' float64 references and
hipattn.torch's ``return_attn_probs`` use it, and so they see exactly the kernels' mask.

The seed lives in device memory, a one-element int64 array the kernels read when dropout is on, so
that a captured graph draws a new seed per replay: hipattn.torch fills it from torch's generator.
"""

from __future__ import annotations

import math
import numbers

from .device_array import DeviceArray

# Keep decisions compare 16-bit random values with round(dropout_p * 2^16).
_LEVELS = 1 << 16
_WORD = 0xFFFFFFFF
_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
_WEYL = (0x9E3779B9, 0xBB67AE85)  # the key's increment per round
ROUNDS = 10


def check_dropout_p(dropout_p: object) -> float:
    """flash-attn's ``dropout_p``: a host number in [0, 1). Returns it as a float."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        given = repr(dropout_p) if isinstance(dropout_p, (str, bool)) or dropout_p is None else type(dropout_p).__qualname__
        raise TypeError(f"dropout_p must be a host number in [0, 1), got {given}")
    value = float(dropout_p)
    if not (0.0 <= value < 1.0) or math.isnan(value):
        raise ValueError(f"dropout_p is {dropout_p!r}; it must be in [0, 1) (the probability of dropping an entry)")
    return value


def threshold(dropout_p: float) -> int:
    """The 16-bit value a kept element's random value reaches: 0 keeps everything."""
    return min(round(dropout_p * _LEVELS), _LEVELS - 1)


def keep_scale(dropout_p: float) -> float:
    """What kept probabilities are multiplied by: 1 / (1 - dropout_p)."""
    return 1.0 / (1.0 - dropout_p)


def check_seed(seed: DeviceArray | None, dropout_p: float, device: int) -> None:
    """The seed array of a call with dropout: int64, one element, 8-byte aligned, on the
    call's device. A call without dropout takes none (there is nothing to draw for)."""
    if dropout_p == 0.0:
        if seed is not None:
            raise ValueError("dropout_seed was given but dropout_p is 0.0; pass dropout_p > 0 or no seed")
        return
    if seed is None:
        raise ValueError(f"dropout_p is {dropout_p}, which needs dropout_seed: a one-element int64 device array "
                         "holding the call's 64-bit seed (hipattn.torch draws it from torch's generator)")
    if seed.dtype != "int64":
        raise TypeError(f"dropout_seed has dtype {seed.dtype}; expected int64")
    if tuple(seed.shape) != (1,):
        raise ValueError(f"dropout_seed has shape {tuple(seed.shape)}; expected (1,)")
    if seed.ptr % 8:
        raise ValueError(f"dropout_seed's data pointer 0x{seed.ptr:x} is not aligned to its 8-byte element")
    if seed.device != device:
        raise ValueError(f"dropout_seed is on device {seed.device} but q is on device {device}; move it to device {device}")


def fields(dropout_p: float, seed: DeviceArray | None) -> dict:
    """catalog.fields.DROPOUT_FIELDS of a call."""
    return {
        "dropout_threshold": threshold(dropout_p),
        "dropout_scale": keep_scale(dropout_p),
        "dropout_seed": seed.ptr if seed is not None else 0,
    }


def _multiply(multiplier: int, x):
    """(high, low) words of multiplier * x for 32-bit x in an int64 array, without int64 overflow:
    x is split into 16-bit halves, so no partial product reaches 2^49."""
    low_part = multiplier * (x & 0xFFFF)
    high_part = multiplier * (x >> 16)
    middle = low_part + ((high_part & 0xFFFF) << 16)
    return ((high_part >> 16) + (middle >> 32)) & _WORD, middle & _WORD


def philox4x32_10(x0, x1, x2, x3, k0, k1):
    """Philox4x32-10 of counter (x0, x1, x2, x3) under key (k0, k1), elementwise over int64 arrays
    (NumPy or torch; scalars broadcast) holding 32-bit values. Returns the four output words."""
    for _ in range(ROUNDS):
        high0, low0 = _multiply(_MULTIPLIERS[0], x0)
        high1, low1 = _multiply(_MULTIPLIERS[1], x2)
        x0, x1, x2, x3 = high1 ^ x1 ^ k0, low1, high0 ^ x3 ^ k1, low0
        k0 = (k0 + _WEYL[0]) & _WORD
        k1 = (k1 + _WEYL[1]) & _WORD
    return x0, x1, x2, x3


def _lane(words, keys):
    """The 16-bit value of key ``keys`` among its counter's four output words (``words[w]`` for
    w < 4, any indexable of arrays): lane 2 ((key % 32) // 8) + key % 2, low half first."""
    return (words >> (16 * (keys % 2))) & 0xFFFF


def keep_mask(seed, stream, rows, keys, dropout_p: float):
    """Whether each element (query row ``rows``, key ``keys``) of stream ``stream`` (sequence *
    heads_q + query head) is kept, under the 64-bit ``seed``: int64 arrays of one kind (NumPy or
    torch; they broadcast), or Python ints. A seed given as an int64 array holds the seed's bits."""
    seed_low, seed_high = seed & _WORD, (seed >> 32) & _WORD
    x = philox4x32_10(rows, 4 * (keys // 32) + (keys % 8) // 2, stream, 0 * rows, seed_low, seed_high)
    word = (keys % 32) // 8
    chosen = sum(x[w] * (word == w) for w in range(4))
    return _lane(chosen, keys) >= threshold(dropout_p)


def keep_grid(seed, streams, num_rows: int, num_keys: int, dropout_p: float):
    """``keep_mask`` of every (row, key) in [0, num_rows) x [0, num_keys) of each stream in the torch
    int64 tensor ``streams``: a bool tensor of shape streams.shape + (num_rows, num_keys). One Philox
    call per counter (eight keys) rather than per element, for S_dmask's whole-tensor masks."""
    import torch  # the NumPy paths above need no torch

    device = streams.device
    seed_low, seed_high = seed & _WORD, (seed >> 32) & _WORD
    rows = torch.arange(num_rows, device=device, dtype=torch.int64)[:, None]
    counters = torch.arange(4 * -(-num_keys // 32), device=device, dtype=torch.int64)[None, :]
    words = torch.stack(philox4x32_10(rows, counters, streams[..., None, None], 0 * rows, seed_low, seed_high), -1)
    keys = torch.arange(num_keys, device=device, dtype=torch.int64)
    chosen = words[..., 4 * (keys // 32) + (keys % 8) // 2, (keys % 32) // 8]
    return _lane(chosen, keys) >= threshold(dropout_p)
