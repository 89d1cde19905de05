"""Host-side validation of a KV-cache call (``flash_attn_with_kvcache``): the arguments in, a frozen
``KvCacheProblem`` and the described arrays out.

Every failure is a ``TypeError`` or ``ValueError`` naming the argument, raised before anything is
enqueued; nothing reads device memory. What only device memory knows (``cache_seqlens`` and the
block table as tensors) the kernels clamp; what the host knows (an int ``cache_seqlens``, shapes,
the rotary tables' length) is checked here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from . import arrays
from . import problem as problem_mod
from .attention import settle_devices
from .catalog.decode import DECODE_HEAD_DIMS, MAX_SPLITS, PAGE_SIZE_MULTIPLE
from .device_array import UNKNOWN_DEVICE, DeviceArray
from .problem import BSHD, SUPPORTED_DTYPES, check_bool, check_index_array


@dataclass(frozen=True)
class KvCacheProblem:
    """One KV-cache call as the launchers see it. Lengths are tokens; ``capacity`` is what one
    sequence's cache holds (the cache's seqlen, or pages per sequence x page size)."""

    device: int
    dtype: str
    batch: int
    seqlen_q: int
    heads_q: int
    heads_kv: int
    head_dim: int
    seqlen_new: int  # new tokens appended per sequence (0 without k/v)
    capacity: int
    cache_entries: int  # batch entries of a contiguous cache, or pages of a paged one
    page_size: int  # tokens per page; the capacity when not paged
    pages_per_sequence: int  # the block table's width; 1 when not paged
    cache_seqlen: int | None  # cache_seqlens given as a host int (or None: a device array)
    rotary_dim: int  # 0: no rotary
    rotary_positions: int
    rotary_interleaved: bool
    softmax_scale: float
    causal: bool
    num_splits: int  # as asked: 0 = the launcher's heuristic
    return_lse: bool
    # flash-attn's window_size with causal folded in (problem.check_window): -1 is no bound.
    window_left: int = -1
    window_right: int = -1
    # flash-attn's score modifiers (kernels/common/score_mods.h): softcap (0.0: none), and whether ALiBi
    # slopes were given (the array travels in the KvCacheCall, as the other inputs do).
    softcap: float = 0.0
    alibi: bool = False
    # Whether learnable sinks were given (kernels/common/sink.h; the array travels in the KvCacheCall).
    sink: bool = False

    @property
    def score_mods(self) -> bool:
        """Whether the attention kernel's modified instantiation (softcap, ALiBi or sinks) serves this call."""
        return self.softcap != 0.0 or self.alibi or self.sink

    @property
    def keys_bound(self) -> int:
        """The most keys a sequence's rows see together: the capacity, or a window's left side past
        the first query token's diagonal and the seqlen_q tokens' own."""
        return self.capacity if self.window_left < 0 else min(self.capacity, self.window_left + self.seqlen_q)

    @property
    def windowed(self) -> bool:
        """Whether the window bounds some side within the cache, as flash-attn tells a local call
        (which, like a causal one, rotates q at advancing positions)."""
        return any(0 <= side < self.capacity for side in (self.window_left, self.window_right))

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def rows_per_kv_head(self) -> int:
        """Query rows that share one KV head's reads: query tokens x query heads per KV head."""
        return self.seqlen_q * self.group


class KvCacheCall(NamedTuple):
    """The call's arrays, described (None where not given), and its problem."""

    q: DeviceArray
    k_cache: DeviceArray
    v_cache: DeviceArray
    k: DeviceArray | None
    v: DeviceArray | None
    rotary_cos: DeviceArray | None
    rotary_sin: DeviceArray | None
    cache_seqlens: DeviceArray | None
    cache_batch_idx: DeviceArray | None
    cache_leftpad: DeviceArray | None
    block_table: DeviceArray | None
    alibi_slopes: DeviceArray | None
    learnable_sink: DeviceArray | None
    problem: KvCacheProblem

    def inputs(self) -> list[tuple[DeviceArray, str]]:
        """(array, name) of every given array the kernels only read."""
        named = [(self.q, "q"), (self.k, "k"), (self.v, "v"), (self.rotary_cos, "rotary_cos"),
                 (self.rotary_sin, "rotary_sin"), (self.cache_seqlens, "cache_seqlens"),
                 (self.cache_batch_idx, "cache_batch_idx"), (self.cache_leftpad, "cache_leftpad"),
                 (self.block_table, "block_table"), (self.alibi_slopes, "alibi_slopes"),
                 (self.learnable_sink, "learnable_sink")]
        return [(a, name) for a, name in named if a is not None]


def _described(obj: Any, name: str, consumer: int | None) -> DeviceArray | None:
    return None if obj is None else arrays.as_device_array(obj, name, stream=consumer)


def _check_tokens(a: DeviceArray, name: str, dtype: str, device: int) -> tuple[int, int, int, int]:
    """A [batch, tokens, heads, head_dim] array of ``dtype`` on ``device``, rows readable 16 bytes at a time."""
    dims = problem_mod.dims(a, name, BSHD)
    if a.dtype != dtype:
        raise TypeError(f"{name} has dtype {a.dtype}; expected {dtype}, as q")
    if a.device != device:
        raise ValueError(f"{name} is on device {a.device} but q is on device {device}; move it to device {device}")
    problem_mod.check_alignment(a, name, BSHD)
    return dims


def _check_host_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    return value


def describe(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
             block_table, softmax_scale, causal, rotary_interleaved, num_splits, return_softmax_lse,
             stream, window_size=problem_mod.NO_WINDOW, softcap=0.0, alibi_slopes=None,
             learnable_sink=None) -> KvCacheCall:
    """Describe and validate every argument of a KV-cache call."""
    consumer = stream if type(stream) is int else None
    qa = arrays.as_device_array(q, "q", stream=consumer)
    kc = arrays.as_device_array(k_cache, "k_cache", stream=consumer)
    vc = arrays.as_device_array(v_cache, "v_cache", stream=consumer)
    ka, va = _described(k, "k", consumer), _described(v, "v", consumer)
    cos, sin = _described(rotary_cos, "rotary_cos", consumer), _described(rotary_sin, "rotary_sin", consumer)
    if isinstance(cache_seqlens, (bool, float, complex, str)):
        raise TypeError(f"cache_seqlens must be an int or an int32 device array, got {cache_seqlens!r}")
    seqlens = None if cache_seqlens is None or isinstance(cache_seqlens, int) else _described(
        cache_seqlens, "cache_seqlens", consumer)
    batch_idx = _described(cache_batch_idx, "cache_batch_idx", consumer)
    leftpad = _described(cache_leftpad, "cache_leftpad", consumer)
    table = _described(block_table, "block_table", consumer)
    slopes = _described(alibi_slopes, "alibi_slopes", consumer)
    sink = _described(learnable_sink, "learnable_sink", consumer)
    described = (qa, kc, vc, ka, va, cos, sin, seqlens, batch_idx, leftpad, table, slopes, sink)
    if any(a is not None and a.device == UNKNOWN_DEVICE for a in described):
        qa, kc, vc, ka, va, cos, sin, seqlens, batch_idx, leftpad, table, slopes, sink = settle_devices(described)

    problem_mod.check_dtype(qa, "q", SUPPORTED_DTYPES)
    dtype, device = qa.dtype, qa.device
    batch, seqlen_q, heads_q, head_dim = problem_mod.dims(qa, "q", BSHD)
    if head_dim not in DECODE_HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not one of {DECODE_HEAD_DIMS} (flash_attn_with_kvcache)")
    problem_mod.check_alignment(qa, "q", BSHD)
    entries, cache_len, heads_kv, cache_dim = _check_tokens(kc, "k_cache", dtype, device)
    if tuple(vc.shape) != tuple(kc.shape):
        raise ValueError(f"v_cache has shape {tuple(vc.shape)}; expected k_cache's {tuple(kc.shape)}")
    _check_tokens(vc, "v_cache", dtype, device)
    if cache_dim != head_dim:
        raise ValueError(f"k_cache has head_dim {cache_dim} but q has {head_dim}; they must match")
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"q has {heads_q} heads and k_cache {heads_kv}; q's heads must be a multiple of the cache's")

    if table is not None:
        if table.dtype != "int32":
            raise TypeError(f"block_table has dtype {table.dtype}; expected int32")
        if len(table.shape) != 2 or table.shape[0] != batch:
            raise ValueError(f"block_table has shape {tuple(table.shape)}; expected [batch={batch}, max_pages_per_sequence]")
        if table.device != device:
            raise ValueError(f"block_table is on device {table.device} but q is on device {device}")
        if table.shape[1] > 1 and table.strides[1] != 1 or table.ptr % 4:
            raise ValueError("block_table's rows must be contiguous int32 (stride 1, 4-byte aligned)")
        if batch_idx is not None or leftpad is not None:
            which = "cache_batch_idx" if batch_idx is not None else "cache_leftpad"
            raise ValueError(f"{which} with paged KV (block_table) is not supported; flash-attn refuses it too")
        if cache_len % PAGE_SIZE_MULTIPLE or cache_len == 0:
            raise ValueError(f"paged KV (block_table) with a page size of {cache_len} tokens is not supported; "
                             f"the page size (k_cache.shape[1]) must be a positive multiple of {PAGE_SIZE_MULTIPLE}")
        page_size, pages_per_sequence = cache_len, table.shape[1]
        capacity = page_size * pages_per_sequence
    else:
        page_size, pages_per_sequence, capacity = cache_len, 1, cache_len
        if batch_idx is None and entries < batch:
            raise ValueError(f"k_cache holds {entries} sequences but q has batch {batch}; pass cache_batch_idx "
                             "to pick which cache entries the batch uses")
    check_index_array(batch_idx, "cache_batch_idx", batch, device)
    check_index_array(leftpad, "cache_leftpad", batch, device)
    check_index_array(seqlens, "cache_seqlens", batch, device)

    seqlen_new = 0
    if (ka is None) != (va is None):
        raise ValueError("pass both k and v (the new tokens to append) or neither")
    if ka is not None:
        kb, seqlen_new, k_heads, k_dim = _check_tokens(ka, "k", dtype, device)
        if tuple(va.shape) != tuple(ka.shape):
            raise ValueError(f"v has shape {tuple(va.shape)}; expected k's {tuple(ka.shape)}")
        _check_tokens(va, "v", dtype, device)
        if (kb, k_heads, k_dim) != (batch, heads_kv, head_dim):
            raise ValueError(f"k has shape {tuple(ka.shape)}; expected [batch={batch}, new tokens, "
                             f"heads={heads_kv}, head_dim={head_dim}]")
        if seqlen_new > capacity:
            raise ValueError(f"k appends {seqlen_new} tokens per sequence but the cache holds {capacity}")

    cache_seqlen = None
    if cache_seqlens is None:
        cache_seqlen = capacity - seqlen_new if ka is not None else capacity
    elif isinstance(cache_seqlens, int):
        cache_seqlen = cache_seqlens
        if cache_seqlen < 0 or cache_seqlen + seqlen_new > capacity:
            where = "pages the block_table names" if table is not None else "the cache"
            raise ValueError(f"cache_seqlens={cache_seqlen} plus {seqlen_new} new tokens does not fit the "
                             f"{capacity} tokens of {where}")

    rotary_dim = rotary_positions = 0
    if (cos is None) != (sin is None):
        raise ValueError("pass both rotary_cos and rotary_sin or neither")
    if cos is not None:
        if ka is None:
            raise ValueError("rotary embedding (rotary_cos/rotary_sin) needs the new k and v to append; "
                             "without them nothing is rotated")
        for table_array, name in ((cos, "rotary_cos"), (sin, "rotary_sin")):
            if table_array.dtype != dtype:
                raise TypeError(f"{name} has dtype {table_array.dtype}; expected {dtype}, as q")
            if len(table_array.shape) != 2 or (table_array.shape[1] > 1 and table_array.strides[1] != 1):
                raise ValueError(f"{name} has shape {tuple(table_array.shape)} and strides {table_array.strides}; "
                                 "expected [positions, rotary_dim / 2] with contiguous rows")
            if table_array.device != device:
                raise ValueError(f"{name} is on device {table_array.device} but q is on device {device}")
        if tuple(sin.shape) != tuple(cos.shape) or sin.strides != cos.strides:
            raise ValueError(f"rotary_sin has shape {tuple(sin.shape)}; expected rotary_cos's layout {tuple(cos.shape)}")
        rotary_positions, rotary_dim = cos.shape[0], 2 * cos.shape[1]
        if not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_cos has {cos.shape[1]} columns: rotary_dim {rotary_dim} must be in (0, head_dim={head_dim}]")
        if rotary_positions < capacity:
            raise ValueError(f"rotary_cos has {rotary_positions} positions; the cache holds {capacity} tokens, "
                             "and every cache position needs one")

    causal = check_bool(causal, "causal")
    window_left, window_right = problem_mod.check_window(window_size, causal)
    softcap = problem_mod.check_softcap(softcap)
    problem_mod.check_alibi_slopes(slopes, batch, heads_q, device)
    problem_mod.check_learnable_sink(sink, heads_q, device)
    splits = _check_host_int(num_splits, "num_splits")
    if not 0 <= splits <= MAX_SPLITS:
        raise ValueError(f"num_splits is {splits}; expected 0 (choose) to {MAX_SPLITS}")
    problem = KvCacheProblem(
        device=device, dtype=dtype, batch=batch, seqlen_q=seqlen_q, heads_q=heads_q, heads_kv=heads_kv,
        head_dim=head_dim, seqlen_new=seqlen_new, capacity=capacity, cache_entries=entries, page_size=page_size,
        pages_per_sequence=pages_per_sequence, cache_seqlen=cache_seqlen, rotary_dim=rotary_dim,
        rotary_positions=rotary_positions, rotary_interleaved=check_bool(rotary_interleaved, "rotary_interleaved"),
        softmax_scale=problem_mod.resolve_softmax_scale(softmax_scale, head_dim), causal=causal,
        num_splits=splits, return_lse=check_bool(return_softmax_lse, "return_softmax_lse"),
        window_left=window_left, window_right=window_right, softcap=softcap, alibi=slopes is not None,
        sink=sink is not None)
    problem_mod.check_fits_int32(capacity=capacity, rows=batch * seqlen_q * heads_q, cache_entries=entries)
    return KvCacheCall(qa, kc, vc, ka, va, cos, sin, seqlens, batch_idx, leftpad, table, slopes, sink, problem)
