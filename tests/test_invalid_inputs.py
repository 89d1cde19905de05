"""Invalid calls fail on the host, with the right exception and a message that says what is expected,
and enqueue nothing.

Inputs are raw arrays: fake device pointers (16-byte aligned unless a case says otherwise, each array
in its own address range) on device 0 or 1, so no GPU is needed. The backend is a recording fake
installed as the active runtime (hipattn.runtime), which counts how often the launch path asks for the
backend or a device's target; raw arrays point at nothing, so "the outputs are untouched" is shown by "nothing
was enqueued": no launch, memset, copy, allocation or host function.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.fake_backend import FakeBackend

import hipattn
from hipattn import runtime
from hipattn.arrays import raw_array
from hipattn.catalog import smallseq as smallseq_catalog
from hipattn.device_array import DeviceArray, element_size
from hipattn.errors import DriverError
from hipattn.jit.cache import DiskCache
from hipattn.jit.registry import Registry
from hipattn.ops import smallseq

# ---- the fake device ------------------------------------------------------------------------------


class RecordingBackend(FakeBackend):
    """FakeBackend that also records (instead of failing on) everything that enqueues or allocates."""

    def __init__(self):
        super().__init__(device_arch="sm_90")
        self.enqueued: list[tuple] = []
        self.devices_set: list[int] = []
        self.pointer_devices: dict[int, int] = {}  # what the runtime knows; other pointers it does not

    def set_device(self, device):
        self.devices_set.append(device)

    def pointer_device(self, ptr):
        try:
            return self.pointer_devices[ptr]
        except KeyError:
            raise DriverError("cuPointerGetAttribute(DEVICE_ORDINAL)", 1, "CUDA_ERROR_INVALID_VALUE") from None

    def memset_async(self, ptr, byte_value, nbytes, stream):
        self.enqueued.append(("memset_async", ptr, nbytes, stream))

    def memcpy_async(self, dst, src, nbytes, stream):
        self.enqueued.append(("memcpy_async", dst, src, nbytes, stream))

    def malloc_async(self, nbytes, stream):
        self.enqueued.append(("malloc_async", nbytes, stream))
        return 0x7000_0000

    def free_async(self, ptr, stream):
        self.enqueued.append(("free_async", ptr, stream))

    def launch_host_func(self, stream, function_address, user_data):
        self.enqueued.append(("launch_host_func", stream))


class CountingRuntime(runtime.Runtime):
    """A runtime over the recording backend that counts how often the launch path asks for the backend
    or a device's target (both mean: past validation)."""

    __slots__ = ("requests",)

    def __init__(self, backend, registry):
        super().__init__(backend, registry=registry)
        self.requests = 0

    @property
    def backend(self):
        self.requests += 1
        return self._backend

    def target(self, device):
        self.requests += 1
        return super().target(device)


class FakeDevice:
    """The recording backend, a registry over it, and the runtime that counts the launch path's requests."""

    def __init__(self, cache_dir):
        self.backend = RecordingBackend()
        self.registry = Registry(self.backend, DiskCache(cache_dir))
        self.runtime = CountingRuntime(self.backend, self.registry)

    @property
    def backend_requests(self) -> int:
        return self.runtime.requests

    def reset(self) -> None:
        self.backend.launches.clear()
        self.backend.enqueued.clear()
        self.backend.devices_set.clear()
        self.backend.pointer_devices.clear()
        self.runtime.requests = 0

    def work(self) -> list[tuple]:
        """Everything that reached the device: kernel launches, then memory operations."""
        return [("launch", *launch) for launch in self.backend.launches] + self.backend.enqueued


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    patch = pytest.MonkeyPatch()
    fake = FakeDevice(tmp_path_factory.mktemp("kernel-cache"))
    patch.setattr(runtime, "_active", fake.runtime)
    patch.delenv("HIPATTN_SMALLSEQ", raising=False)
    patch.delenv(smallseq.KERNEL_SWITCH, raising=False)
    yield fake
    patch.undo()


@pytest.fixture
def fake(device):
    device.reset()
    return device


# ---- fake device memory ---------------------------------------------------------------------------

BASE = 0x1_0000_0000


class Memory:
    """Fake device addresses: each array gets its own 4 KiB-aligned range, no two overlapping."""

    def __init__(self):
        self.next = BASE

    def array(self, shape, dtype="fp16", device=0, strides=None, offset=0) -> DeviceArray:
        """A raw array at a fresh address (+ ``offset`` bytes: an unaligned pointer when it is not 16)."""
        probe = raw_array(0x1000, shape, dtype, 0, strides)
        span = (sum((n - 1) * s for n, s in zip(probe.shape, probe.strides, strict=True)) + 1) * element_size(dtype)
        ptr = self.next + offset
        self.next += (span + offset + 0x1FFF) // 0x1000 * 0x1000
        return raw_array(ptr, shape, dtype, device, strides)

    def inside(self, a: DeviceArray, shape, dtype, byte_offset=0) -> DeviceArray:
        """An array starting ``byte_offset`` bytes into ``a``'s memory (an alias)."""
        return raw_array(a.ptr + byte_offset, shape, dtype, a.device)


# The valid baseline every case perturbs: varlen (THD) and batch (BSHD), GQA 4/2, head_dim 64.
TOTAL_Q, TOTAL_K, HEADS_Q, HEADS_KV, HEAD_DIM, BATCH = 10, 12, 4, 2, 64, 2
SEQLEN_Q, SEQLEN_K = 5, 7


def thd(m: Memory, dtype="fp16") -> dict:
    return {
        "q": m.array((TOTAL_Q, HEADS_Q, HEAD_DIM), dtype),
        "k": m.array((TOTAL_K, HEADS_KV, HEAD_DIM), dtype),
        "v": m.array((TOTAL_K, HEADS_KV, HEAD_DIM), dtype),
        "cu_seqlens_q": m.array((BATCH + 1,), "int32"),
        "cu_seqlens_k": m.array((BATCH + 1,), "int32"),
        "max_seqlen_q": 8,
        "max_seqlen_k": 8,
    }


def bshd(m: Memory, dtype="fp16") -> dict:
    return {
        "q": m.array((BATCH, SEQLEN_Q, HEADS_Q, HEAD_DIM), dtype),
        "k": m.array((BATCH, SEQLEN_K, HEADS_KV, HEAD_DIM), dtype),
        "v": m.array((BATCH, SEQLEN_K, HEADS_KV, HEAD_DIM), dtype),
    }


def _resolve(m: Memory, kwargs: dict, changes: dict) -> dict:
    """Apply ``changes``; a callable value is given the memory and the call's arrays so far."""
    kwargs = dict(kwargs)
    for name, value in changes.items():
        if value is DROP:
            kwargs.pop(name, None)
        else:
            kwargs[name] = value(m, kwargs) if callable(value) else value
    return kwargs


DROP = object()


def forward_thd(m: Memory, **changes) -> None:
    kwargs = thd(m)
    kwargs["out"] = m.array(kwargs["q"].shape)
    kwargs["lse"] = m.array((HEADS_Q, TOTAL_Q), "fp32")
    kwargs = _resolve(m, kwargs, changes)
    hipattn.forward(kwargs.pop("q"), kwargs.pop("k"), kwargs.pop("v"), **kwargs)


def forward_bshd(m: Memory, **changes) -> None:
    kwargs = bshd(m)
    kwargs["out"] = m.array(kwargs["q"].shape)
    kwargs["lse"] = m.array((BATCH, HEADS_Q, SEQLEN_Q), "fp32")
    kwargs = _resolve(m, kwargs, changes)
    hipattn.forward(kwargs.pop("q"), kwargs.pop("k"), kwargs.pop("v"), **kwargs)


def backward_thd(m: Memory, **changes) -> None:
    kwargs = thd(m)
    q, k = kwargs["q"], kwargs["k"]
    kwargs.update(
        dout=m.array(q.shape), out=m.array(q.shape), lse=m.array((HEADS_Q, TOTAL_Q), "fp32"),
        dq=m.array(q.shape), dk=m.array(k.shape), dv=m.array(k.shape),
    )  # fmt: skip
    kwargs = _resolve(m, kwargs, changes)
    grads = [kwargs.pop(name) for name in ("dout", "q", "k", "v", "out", "lse")]
    hipattn.backward(*grads, **kwargs)


def varlen_api(m: Memory, **changes) -> None:
    kwargs = _resolve(m, thd(m), changes)
    hipattn.flash_attn_varlen_func(**kwargs)


def batch_api(m: Memory, **changes) -> None:
    kwargs = _resolve(m, bshd(m), changes)
    hipattn.flash_attn_func(**kwargs)


# ---- the table ------------------------------------------------------------------------------------

VALIDATION = "validation"  # raises before the backend is even asked for
GUARDED = "guarded"  # raises inside the device guard (outputs, streams): backend asked, nothing enqueued


@dataclass(frozen=True)
class Case:
    name: str
    call: Callable[[Memory], None]
    error: type[Exception]
    message: str  # a substring of the message that says what was expected
    stage: str = VALIDATION


def case(name, entry, error, message, stage=VALIDATION, **changes) -> Case:
    return Case(name, lambda m: entry(m, **changes), error, message, stage)


def thd_array(shape, dtype="fp16", device=0, strides=None, offset=0):
    return lambda m, _: m.array(shape, dtype, device, strides, offset)


Q_SHAPE, KV_SHAPE = (TOTAL_Q, HEADS_Q, HEAD_DIM), (TOTAL_K, HEADS_KV, HEAD_DIM)
KV_BSHD = (BATCH, SEQLEN_K, HEADS_KV, HEAD_DIM)


def _same_head_dim(head_dim):
    """Changes giving q, k, v and out one head_dim; rows spaced as a slice [..., :head_dim] of a
    head_dim 64 tensor would be (every stride 16-byte aligned, whatever head_dim is)."""
    q_strides, kv_strides = (HEADS_Q * 64, 64, 1), (HEADS_KV * 64, 64, 1)
    if head_dim > 64:
        q_strides, kv_strides = None, None  # contiguous
    return {
        "q": thd_array((TOTAL_Q, HEADS_Q, head_dim), strides=q_strides),
        "k": thd_array((TOTAL_K, HEADS_KV, head_dim), strides=kv_strides),
        "v": thd_array((TOTAL_K, HEADS_KV, head_dim), strides=kv_strides),
        "out": thd_array((TOTAL_Q, HEADS_Q, head_dim), strides=q_strides),
    }


class CAI:
    """A bare __cuda_array_interface__ producer (v2: no stream, no device attribute)."""

    def __init__(self, ptr, shape, typestr="<f2"):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False), "version": 2}


def reversed_tokens(shape):
    """A raw array whose token axis runs backwards (stride < 0) through fresh memory."""
    tokens, heads, head_dim = shape

    def make(m, _):
        memory = m.array(shape)
        row = heads * head_dim
        return raw_array(memory.ptr + (tokens - 1) * row * 2, shape, "fp16", 0, strides=(-row, head_dim, 1))

    return make


FLASH_BOUNDS = {"max_seqlen_q": 64, "max_seqlen_k": 64}  # past the small-seq tile: the flash path


def _workspace_bytes(call) -> int:
    return hipattn.backward_workspace_bytes(call["q"], call["k"], call["v"], cu_seqlens_q=call["cu_seqlens_q"],
                                            cu_seqlens_k=call["cu_seqlens_k"], **FLASH_BOUNDS)


def cu_seqlens_with_room_below(m, _):
    """cu_seqlens_q 256 bytes into a fresh 64 KiB range nothing else uses (room for a workspace)."""
    return raw_array(m.array((1 << 16,), "uint8").ptr + 256, (BATCH + 1,), "int32", 0)


def workspace_over(name: str, bytes_below: int = 0):
    """A workspace of the call's size that starts ``bytes_below`` bytes under the call's array ``name``."""
    return lambda m, call: raw_array(call[name].ptr - bytes_below, (_workspace_bytes(call),), "uint8", 0)


def read_only_workspace(m, call):
    n = _workspace_bytes(call)
    return DeviceArray(m.array((n,), "uint8").ptr, (n,), (1,), "uint8", 0, "cai", readonly=True)


# batch 2^31 - 1 (mostly empty sequences) x 32 heads: more small-seq blocks than one launch may have
HUGE_BATCH, MANY_HEADS = 2**31 - 1, 32


CASES = [
    # dtypes
    case("fp32 q", forward_thd, TypeError, "q has dtype fp32; hipattn supports fp16 and bf16",
         q=thd_array(Q_SHAPE, "fp32")),
    case("int32 q", forward_thd, TypeError, "q has dtype int32; hipattn supports fp16 and bf16",
         q=thd_array(Q_SHAPE, "int32")),
    case("fp16 q with bf16 k and v", forward_thd, TypeError, "must share one dtype",
         k=thd_array(KV_SHAPE, "bf16"), v=thd_array(KV_SHAPE, "bf16")),
    case("bf16 v only", forward_bshd, TypeError, "must share one dtype; got q fp16, k fp16, v bf16",
         v=thd_array(KV_BSHD, "bf16")),
    case("fp64 k through the API", batch_api, TypeError, "k has dtype fp64; hipattn supports",
         k=thd_array(KV_BSHD, "fp64")),
    # ranks
    case("4-d q in a varlen call", forward_thd, ValueError, "expected 3 dimensions [total_tokens, heads, head_dim]",
         q=thd_array((1, TOTAL_Q, HEADS_Q, HEAD_DIM))),
    case("2-d k in a varlen call", varlen_api, ValueError, "k has shape (12, 128); expected 3 dimensions",
         k=thd_array((TOTAL_K, HEADS_KV * HEAD_DIM))),
    case("3-d q in a batch call", forward_bshd, ValueError, "expected 4 dimensions [batch, seqlen, heads, head_dim]",
         q=thd_array((SEQLEN_Q, HEADS_Q, HEAD_DIM)), out=thd_array((SEQLEN_Q, HEADS_Q, HEAD_DIM))),
    # q / k / v shapes
    case("k batch differs from q", forward_bshd, ValueError, "k has batch 3 but q has batch 2",
         k=thd_array((3, SEQLEN_K, HEADS_KV, HEAD_DIM)), v=thd_array((3, SEQLEN_K, HEADS_KV, HEAD_DIM))),
    case("k head_dim differs from q", forward_thd, ValueError, "k has head_dim 128 but q has 64; they must be equal",
         k=thd_array((TOTAL_K, HEADS_KV, 128)), v=thd_array((TOTAL_K, HEADS_KV, 128))),
    case("v heads differ from k", forward_thd, ValueError, "v has shape (12, 1, 64); it must match k's (12, 2, 64)",
         v=thd_array((TOTAL_K, 1, HEAD_DIM))),
    case("v head_dim differs from k", forward_thd, ValueError,
         "v has head_dim 32 but k has 64: the kernels take one head_dim for q, k and v; hipattn.torch",
         v=thd_array((TOTAL_K, HEADS_KV, 32))),
    case("v tokens differ from k", backward_thd, ValueError, "it must match k's",
         v=thd_array((TOTAL_K + 1, HEADS_KV, HEAD_DIM))),
    case("query heads not a multiple of kv heads", forward_thd, ValueError,
         "q has 4 heads and k/v 3; the query heads must be a multiple of the key/value heads",
         k=thd_array((TOTAL_K, 3, HEAD_DIM)), v=thd_array((TOTAL_K, 3, HEAD_DIM))),
    case("zero kv heads", forward_bshd, ValueError, "must be a multiple of the key/value heads",
         k=thd_array((BATCH, SEQLEN_K, 0, HEAD_DIM)), v=thd_array((BATCH, SEQLEN_K, 0, HEAD_DIM))),
    case("heads not a multiple in backward", backward_thd, ValueError, "must be a multiple of the key/value heads",
         k=thd_array((TOTAL_K, 3, HEAD_DIM)), v=thd_array((TOTAL_K, 3, HEAD_DIM)),
         dk=thd_array((TOTAL_K, 3, HEAD_DIM)), dv=thd_array((TOTAL_K, 3, HEAD_DIM))),
    # head_dim: a degenerate one is invalid; a real one no kernel serves is a documented NotImplementedError
    case("head_dim 0", forward_thd, ValueError, "head_dim is 0; it must be at least 1", **_same_head_dim(0)),
    case("head_dim 80 (no kernel serves it)", forward_thd, NotImplementedError,
         "not the flash path (head_dim 80 is not one of (64, 96, 128, 256))", **_same_head_dim(80)),
    case("head_dim 512 (no kernel serves it)", forward_thd, NotImplementedError,
         "not the small-seq path (head_dim 512 is not one of (64, 128, 256))", **_same_head_dim(512)),
    case("head_dim 80 backward (no kernel serves it)", backward_thd, NotImplementedError,
         "not the flash path (head_dim 80 is not one of (64, 96, 128, 256))",
         q=thd_array((TOTAL_Q, HEADS_Q, 80)), k=thd_array((TOTAL_K, HEADS_KV, 80)),
         v=thd_array((TOTAL_K, HEADS_KV, 80)), dout=thd_array((TOTAL_Q, HEADS_Q, 80)),
         out=thd_array((TOTAL_Q, HEADS_Q, 80))),
    # layout: contiguity, alignment
    case("q last dimension strided", forward_thd, ValueError, "its last dimension (head_dim) must be contiguous",
         q=thd_array(Q_SHAPE, strides=(HEADS_Q * HEAD_DIM * 2, HEAD_DIM * 2, 2))),
    case("v last dimension strided", forward_bshd, ValueError, "v has strides",
         v=thd_array(KV_BSHD, strides=(SEQLEN_K * HEADS_KV * HEAD_DIM * 2, HEADS_KV * HEAD_DIM * 2, HEAD_DIM * 2, 2))),
    case("q pointer 8 bytes off", forward_thd, ValueError, "is not 16-byte aligned", q=thd_array(Q_SHAPE, offset=8)),
    case("k token stride not a multiple of 16 bytes", forward_thd, ValueError,
         "every stride must be a multiple of 8 elements (16 bytes)",
         k=thd_array(KV_SHAPE, strides=(HEADS_KV * HEAD_DIM + 4, HEAD_DIM, 1))),
    case("q head stride not a multiple of 16 bytes", forward_bshd, ValueError, "every stride must be a multiple of 8",
         q=thd_array((BATCH, SEQLEN_Q, HEADS_Q, HEAD_DIM), strides=(SEQLEN_Q * HEADS_Q * 68, HEADS_Q * 68, 68, 1))),
    # cu_seqlens
    case("int64 cu_seqlens_q", forward_thd, TypeError, "cu_seqlens_q has dtype int64; expected int32",
         cu_seqlens_q=thd_array((BATCH + 1,), "int64")),
    case("fp32 cu_seqlens_k", varlen_api, TypeError, "cu_seqlens_k has dtype fp32; expected int32",
         cu_seqlens_k=thd_array((BATCH + 1,), "fp32")),
    case("cu_seqlens of different lengths", forward_thd, ValueError, "must both have shape (batch + 1,)",
         cu_seqlens_k=thd_array((BATCH + 2,), "int32")),
    case("2-d cu_seqlens", forward_thd, ValueError, "must both have shape (batch + 1,)",
         cu_seqlens_q=thd_array((BATCH + 1, 1), "int32"), cu_seqlens_k=thd_array((BATCH + 1, 1), "int32")),
    case("empty cu_seqlens", backward_thd, ValueError, "must both have shape (batch + 1,)",
         cu_seqlens_q=thd_array((0,), "int32"), cu_seqlens_k=thd_array((0,), "int32")),
    case("cu_seqlens_k on another device", forward_thd, ValueError, "cu_seqlens_k is on device 1 but q is on device 0",
         cu_seqlens_k=thd_array((BATCH + 1,), "int32", device=1)),
    case("strided cu_seqlens_q", forward_thd, ValueError, "cu_seqlens_q must be contiguous",
         cu_seqlens_q=thd_array((BATCH + 1,), "int32", strides=(2,))),
    case("cu_seqlens_q pointer not int32-aligned", forward_thd, ValueError,
         "is not aligned to its 4-byte elements",
         cu_seqlens_q=thd_array((BATCH + 1,), "int32", offset=2)),
    case("NumPy cu_seqlens_q", varlen_api, ValueError, "hipattn needs arrays in CUDA or ROCm device memory",
         cu_seqlens_q=lambda m, _: np.array([0, 5, 10], dtype=np.int32)),
    case("only cu_seqlens_q", forward_thd, ValueError, "give both cu_seqlens_q and cu_seqlens_k", cu_seqlens_k=None),
    case("only cu_seqlens_k", varlen_api, ValueError, "give both cu_seqlens_q and cu_seqlens_k", cu_seqlens_q=None),
    case("seqused_q of the wrong length", forward_bshd, ValueError, "seqused_q has shape (3,); expected (2,)",
         seqused_q=thd_array((BATCH + 1,), "int32")),
    # host arrays, non-arrays, devices
    case("NumPy q", forward_thd, ValueError, "(a host array); hipattn needs arrays in CUDA or ROCm device memory",
         q=lambda m, _: np.zeros(Q_SHAPE, dtype=np.float16)),
    case("nested list k", batch_api, TypeError, "k has type builtins.list, which is not a device array",
         k=lambda m, _: [[0.0]]),
    case("k on another device", forward_thd, ValueError, "k is on device 1 but q is on device 0",
         k=thd_array(KV_SHAPE, device=1)),
    case("v on another device", batch_api, ValueError, "all inputs must share one device",
         v=thd_array(KV_BSHD, device=1)),
    # max_seqlen
    case("negative max_seqlen_q", forward_thd, ValueError, "max_seqlen_q is -1; it must be >= 0", max_seqlen_q=-1),
    case("negative max_seqlen_k in a batch call", forward_bshd, ValueError, "max_seqlen_k is -3; it must be >= 0",
         max_seqlen_k=-3),
    case("float max_seqlen_k", varlen_api, TypeError, "max_seqlen_k must be a host int", max_seqlen_k=8.0),
    case("bool max_seqlen_q", forward_thd, TypeError, "max_seqlen_q must be a host int", max_seqlen_q=True),
    case("max_seqlen_k beyond 32-bit", forward_thd, ValueError, "max_seqlen_k is 2147483648; hipattn's kernels index",
         max_seqlen_k=2**31),
    case("missing max_seqlen_k in a varlen call", forward_thd, ValueError,
         "varlen calls need max_seqlen_q and max_seqlen_k", max_seqlen_k=DROP),
    case("max_seqlen_q None through the API", varlen_api, ValueError, "need max_seqlen_q and max_seqlen_k",
         max_seqlen_q=None),
    # softmax_scale, causal, deterministic
    case("NaN softmax_scale", forward_thd, ValueError, "softmax_scale must be a finite number, got nan",
         softmax_scale=math.nan),
    case("inf softmax_scale", varlen_api, ValueError, "softmax_scale must be a finite number, got inf",
         softmax_scale=math.inf),
    case("bool softmax_scale", forward_bshd, TypeError, "softmax_scale must be a number", softmax_scale=True),
    case("str softmax_scale", batch_api, TypeError, "softmax_scale must be a number", softmax_scale="0.125"),
    case("str causal", forward_thd, TypeError, "causal must be a bool, got 'yes'", causal="yes"),
    case("None causal", batch_api, TypeError, "causal must be a bool, got None", causal=None),
    case("int causal", forward_bshd, TypeError, "causal must be a bool, got 1", causal=1),
    case("str deterministic", backward_thd, TypeError, "deterministic must be a bool, got 'yes'",
         deterministic="yes"),
    case("int deterministic", backward_thd, TypeError, "deterministic must be a bool, got 0", deterministic=0),
    # flash-attn arguments hipattn does not support
    # dropout: a probability in [0, 1) and, for raw arrays, the seed array the kernels read
    case("dropout without a seed", varlen_api, ValueError, "dropout_p is 0.1: pass dropout_seed=", dropout_p=0.1),
    case("dropout without a seed (batch)", batch_api, ValueError, "pass dropout_seed=", dropout_p=0.5),
    case("dropout_p of 1", varlen_api, ValueError, "dropout_p is 1.0; it must be in [0, 1)", dropout_p=1.0),
    case("negative dropout_p", forward_thd, ValueError, "dropout_p is -0.1; it must be in [0, 1)", dropout_p=-0.1,
         dropout_seed=thd_array((1,), "int64")),
    case("NaN dropout_p", forward_bshd, ValueError, "dropout_p is nan", dropout_p=math.nan),
    case("dropout without a seed (low level)", forward_thd, ValueError, "dropout_p is 0.2, which needs dropout_seed",
         dropout_p=0.2),
    case("int32 dropout_seed", forward_thd, TypeError, "dropout_seed has dtype int32; expected int64", dropout_p=0.2,
         dropout_seed=thd_array((1,), "int32")),
    case("two-element dropout_seed", backward_thd, ValueError, "dropout_seed has shape (2,); expected (1,)",
         dropout_p=0.2, dropout_seed=thd_array((2,), "int64")),
    case("misaligned dropout_seed", forward_thd, ValueError, "dropout_seed's data pointer", dropout_p=0.2,
         dropout_seed=thd_array((1,), "int64", offset=4)),
    case("dropout_seed on another device", forward_bshd, ValueError, "dropout_seed is on device 1 but q is on device 0",
         dropout_p=0.2, dropout_seed=thd_array((1,), "int64", device=1)),
    case("dropout_seed without dropout", forward_thd, ValueError, "dropout_seed was given but dropout_p is 0.0",
         dropout_seed=thd_array((1,), "int64")),
    # learnable sinks: fp32, one per query head, on q's device
    case("fp16 learnable_sink", forward_thd, TypeError, "learnable_sink has dtype fp16; expected fp32",
         learnable_sink=thd_array((HEADS_Q,), "fp16")),
    case("learnable_sink per KV head", varlen_api, ValueError,
         f"learnable_sink has shape ({HEADS_KV},); expected ({HEADS_Q},)", learnable_sink=thd_array((HEADS_KV,), "fp32")),
    case("strided learnable_sink", batch_api, ValueError, "learnable_sink has strides (2,); it must be contiguous",
         learnable_sink=thd_array((HEADS_Q,), "fp32", strides=(2,))),
    case("learnable_sink on another device", backward_thd, ValueError, "learnable_sink is on device 1 but q is on device 0",
         learnable_sink=thd_array((HEADS_Q,), "fp32", device=1)),
    case("window_size not a pair", batch_api, TypeError, "window_size must be a pair of ints (left, right), got 5",
         window_size=5),
    case("window_size of three", forward_thd, TypeError, "window_size must be a pair of ints", window_size=(1, 2, 3)),
    case("window_size of bools", forward_bshd, TypeError, "window_size must be a pair of ints",
         window_size=(True, 0)),
    case("block_table of raw arrays", varlen_api, ValueError,
         "block_table (paged KV) in flash_attn_varlen_func takes torch tensors", block_table=thd_array((BATCH, 4), "int32")),
    # forward outputs
    case("out of the wrong shape", forward_thd, ValueError, "out has shape (10, 4, 128); expected (10, 4, 64)",
         GUARDED, out=thd_array((TOTAL_Q, HEADS_Q, 128))),
    case("out of the wrong dtype", forward_thd, TypeError, "out has dtype bf16; expected fp16", GUARDED,
         out=thd_array(Q_SHAPE, "bf16")),
    case("out on another device", forward_bshd, ValueError, "out is on device 1 but the inputs are on device 0",
         GUARDED, out=thd_array((BATCH, SEQLEN_Q, HEADS_Q, HEAD_DIM), device=1)),
    case("out is q", forward_thd, ValueError, "out overlaps q in memory; outputs must not alias inputs", GUARDED,
         out=lambda m, call: call["q"]),
    case("out overlaps the tail of v", forward_thd, ValueError, "out overlaps v in memory", GUARDED,
         out=lambda m, call: m.inside(call["v"], Q_SHAPE, "fp16", byte_offset=1024)),
    case("out pointer 8 bytes off", forward_thd, ValueError, "out's data pointer", GUARDED,
         out=thd_array(Q_SHAPE, offset=8)),
    case("out last dimension strided", forward_thd, ValueError, "out has strides", GUARDED,
         out=thd_array(Q_SHAPE, strides=(HEADS_Q * HEAD_DIM * 2, HEAD_DIM * 2, 2))),
    case("out is a broadcast view", forward_thd, ValueError, "an output needs positive strides", GUARDED,
         out=thd_array(Q_SHAPE, strides=(0, HEAD_DIM, 1))),
    case("read-only out", forward_thd, ValueError, "out is read-only", GUARDED,
         out=lambda m, call: DeviceArray(m.array(Q_SHAPE).ptr, Q_SHAPE, (HEADS_Q * HEAD_DIM, HEAD_DIM, 1), "fp16", 0,
                                         "cai", readonly=True)),
    case("lse of the wrong shape", forward_thd, ValueError, "lse has shape (10, 4); expected (4, 10)", GUARDED,
         lse=thd_array((TOTAL_Q, HEADS_Q), "fp32")),
    case("lse of the wrong dtype", forward_bshd, TypeError, "lse has dtype fp16; expected fp32", GUARDED,
         lse=thd_array((BATCH, HEADS_Q, SEQLEN_Q), "fp16")),
    case("lse overlaps k", forward_thd, ValueError, "lse overlaps k in memory", GUARDED,
         lse=lambda m, call: m.inside(call["k"], (HEADS_Q, TOTAL_Q), "fp32")),
    case("lse overlaps out", forward_thd, ValueError, "lse overlaps out in memory; outputs must not alias each other",
         GUARDED, lse=lambda m, call: m.inside(call["out"], (HEADS_Q, TOTAL_Q), "fp32")),
    case("bad stream", forward_thd, TypeError, "expected an int handle", GUARDED, stream="default"),
    # backward inputs
    case("lse of the wrong shape in backward", backward_thd, ValueError,
         "lse has shape (2, 4, 5); expected (4, 10) fp32", lse=thd_array((BATCH, HEADS_Q, 5), "fp32")),
    case("lse of the wrong dtype in backward", backward_thd, TypeError, "lse has dtype fp16; hipattn supports fp32",
         lse=thd_array((HEADS_Q, TOTAL_Q), "fp16")),
    case("lse on another device in backward", backward_thd, ValueError, "lse is on device 1 but q is on device 0",
         lse=thd_array((HEADS_Q, TOTAL_Q), "fp32", device=1)),
    case("lse last dimension strided in backward", backward_thd, ValueError, "last dimension contiguous",
         lse=thd_array((HEADS_Q, TOTAL_Q), "fp32", strides=(1, HEADS_Q))),
    case("dout shape differs from q", backward_thd, ValueError, "dout has shape (10, 4, 128); expected q's (10, 4, 64)",
         dout=thd_array((TOTAL_Q, HEADS_Q, 128))),
    case("out shape differs from q", backward_thd, ValueError, "out has shape (9, 4, 64); expected q's (10, 4, 64)",
         out=thd_array((TOTAL_Q - 1, HEADS_Q, HEAD_DIM))),
    case("dout dtype differs from q", backward_thd, TypeError, "dout has dtype bf16; expected q's fp16",
         dout=thd_array(Q_SHAPE, "bf16")),
    case("dout on another device", backward_thd, ValueError, "dout is on device 1 but q is on device 0",
         dout=thd_array(Q_SHAPE, device=1)),
    case("dout pointer 8 bytes off", backward_thd, ValueError, "dout's data pointer", dout=thd_array(Q_SHAPE, offset=8)),
    case("out last dimension strided in backward", backward_thd, ValueError,
         "out has strides (512, 128, 2); its last dimension", out=thd_array(Q_SHAPE, strides=(512, 128, 2))),
    # backward outputs
    case("dq of the wrong shape", backward_thd, ValueError, "dq has shape (10, 2, 64); expected (10, 4, 64)", GUARDED,
         dq=thd_array((TOTAL_Q, HEADS_KV, HEAD_DIM))),
    case("dk of the wrong dtype", backward_thd, TypeError, "dk has dtype fp32; expected fp16", GUARDED,
         dk=thd_array(KV_SHAPE, "fp32")),
    case("dv on another device", backward_thd, ValueError, "dv is on device 1", GUARDED,
         dv=thd_array(KV_SHAPE, device=1)),
    case("dk is v", backward_thd, ValueError, "dk overlaps v in memory", GUARDED, dk=lambda m, call: call["v"]),
    case("dq overlaps lse", backward_thd, ValueError, "dq overlaps lse in memory", GUARDED,
         dq=lambda m, call: m.inside(call["lse"], Q_SHAPE, "fp16")),
    case("dv overlaps dk", backward_thd, ValueError, "dv overlaps dk in memory; outputs must not alias each other",
         GUARDED, dv=lambda m, call: call["dk"]),
    case("dq pointer 8 bytes off", backward_thd, ValueError, "dq's data pointer", GUARDED,
         dq=thd_array(Q_SHAPE, offset=8)),
    # null pointers from every kind of producer
    case("CAI q at address 0", forward_thd, ValueError, "q has a null data pointer",
         q=lambda m, _: CAI(0, Q_SHAPE)),
    case("hand-built DeviceArray k at address 0", forward_thd, ValueError, "k has a null data pointer",
         k=lambda m, _: DeviceArray(0, KV_SHAPE, (HEADS_KV * HEAD_DIM, HEAD_DIM, 1), "fp16", 0, "raw")),
    # outputs and the workspace against the sequence arrays
    case("out overlaps cu_seqlens_q", forward_thd, ValueError, "out overlaps cu_seqlens_q in memory", GUARDED,
         out=lambda m, call: m.inside(call["cu_seqlens_q"], Q_SHAPE, "fp16")),
    case("lse overlaps seqused_k", forward_bshd, ValueError, "lse overlaps seqused_k in memory", GUARDED,
         seqused_k=thd_array((BATCH,), "int32"),
         lse=lambda m, call: m.inside(call["seqused_k"], (BATCH, HEADS_Q, SEQLEN_Q), "fp32")),
    case("dq overlaps cu_seqlens_k", backward_thd, ValueError, "dq overlaps cu_seqlens_k in memory", GUARDED,
         dq=lambda m, call: m.inside(call["cu_seqlens_k"], Q_SHAPE, "fp16")),
    case("workspace overlaps cu_seqlens_q", backward_thd, ValueError, "workspace overlaps cu_seqlens_q in memory",
         GUARDED, cu_seqlens_q=cu_seqlens_with_room_below, workspace=workspace_over("cu_seqlens_q", 256),
         **FLASH_BOUNDS),
    case("workspace overlaps dq", backward_thd, ValueError, "workspace overlaps dq in memory", GUARDED,
         workspace=workspace_over("dq"), **FLASH_BOUNDS),
    case("workspace overlaps q", backward_thd, ValueError, "workspace overlaps q in memory", GUARDED,
         workspace=workspace_over("q"), **FLASH_BOUNDS),
    case("read-only workspace", backward_thd, ValueError, "workspace is read-only", GUARDED,
         workspace=read_only_workspace, **FLASH_BOUNDS),
    # overlaps with strides of any sign, and outputs that overlap themselves
    case("lse inside a reversed v", forward_thd, ValueError, "lse overlaps v in memory", GUARDED,
         v=reversed_tokens(KV_SHAPE),  # its pointer is its last row: its memory lies below it
         lse=lambda m, call: raw_array(call["v"].ptr - (TOTAL_K - 1) * HEADS_KV * HEAD_DIM * 2, (HEADS_Q, TOTAL_Q),
                                       "fp32", 0)),
    case("out whose rows overlap each other", forward_thd, ValueError, "some of its elements share memory", GUARDED,
         out=thd_array(Q_SHAPE, strides=(HEAD_DIM, HEAD_DIM, 1))),
    case("lse whose heads overlap each other", forward_thd, ValueError,
         "lse has shape (4, 10) and strides (5, 1), so some of its elements share memory", GUARDED,
         lse=thd_array((HEADS_Q, TOTAL_Q), "fp32", strides=(5, 1))),
    # lse alignment
    case("lse pointer 2 bytes off", forward_thd, ValueError, "is not aligned to its 4-byte fp32 elements", GUARDED,
         lse=thd_array((HEADS_Q, TOTAL_Q), "fp32", offset=2)),
    case("lse pointer 2 bytes off in backward", backward_thd, ValueError, "lse's data pointer",
         lse=thd_array((HEADS_Q, TOTAL_Q), "fp32", offset=2)),
    # softmax_scale must be a float32
    case("softmax_scale beyond float32", forward_thd, ValueError, "softmax_scale 1e+39 does not fit in float32",
         softmax_scale=1e39),
    case("softmax_scale 10**400", varlen_api, ValueError, "does not fit in float32", softmax_scale=10**400),
    case("softmax_scale that rounds to 0 in float32", forward_bshd, ValueError, "rounds to 0 in float32",
         softmax_scale=1e-50),
    # head counts and grids
    case("zero query heads", forward_thd, ValueError, "q has 0 heads",
         q=thd_array((TOTAL_Q, 0, HEAD_DIM)), out=thd_array((TOTAL_Q, 0, HEAD_DIM))),
    case("zero query heads in backward", backward_thd, ValueError, "q has 0 heads",
         q=thd_array((TOTAL_Q, 0, HEAD_DIM)), dout=thd_array((TOTAL_Q, 0, HEAD_DIM)),
         out=thd_array((TOTAL_Q, 0, HEAD_DIM)), dq=thd_array((TOTAL_Q, 0, HEAD_DIM))),
    case("query heads beyond 32-bit", forward_thd, ValueError, "heads_q is 2147483648; hipattn's kernels index",
         q=thd_array((TOTAL_Q, 2**31, HEAD_DIM)), k=thd_array((TOTAL_K, 2**31, HEAD_DIM)),
         v=thd_array((TOTAL_K, 2**31, HEAD_DIM))),
    case("small-seq grid beyond 2**31 - 1 blocks", forward_thd, ValueError, "one launch takes at most 2147483647",
         GUARDED, cu_seqlens_q=thd_array((HUGE_BATCH + 1,), "int32"), cu_seqlens_k=thd_array((HUGE_BATCH + 1,), "int32"),
         q=thd_array((TOTAL_Q, MANY_HEADS, HEAD_DIM)), k=thd_array((TOTAL_K, MANY_HEADS, HEAD_DIM)),
         v=thd_array((TOTAL_K, MANY_HEADS, HEAD_DIM)), out=thd_array((TOTAL_Q, MANY_HEADS, HEAD_DIM)),
         lse=thd_array((MANY_HEADS, TOTAL_Q), "fp32")),
    # field widths and the types of flash-attn's scalars
    case("stream handle wider than 64 bits", forward_thd, ValueError, "wider than 64 bits", GUARDED, stream=2**64),
    case("dropout_p as a string", varlen_api, TypeError, "dropout_p must be a host number in [0, 1), got '0'",
         dropout_p="0"),
    case("softcap as an array", batch_api, TypeError, "softcap must be a host number (0.0 for none), got DeviceArray",
         softcap=thd_array((1,), "fp32")),
    # score modifiers
    case("negative softcap", varlen_api, ValueError, "softcap is -30.0; it must be 0.0 (no capping) or a positive",
         softcap=-30.0),
    case("NaN softcap", forward_thd, ValueError, "softcap is nan", softcap=math.nan),
    case("inf softcap", backward_thd, ValueError, "softcap is inf", softcap=math.inf),
    case("str softcap", forward_bshd, TypeError, "softcap must be a host number (0.0 for none), got '30'",
         softcap="30"),
    case("bool softcap", batch_api, TypeError, "softcap must be a host number (0.0 for none), got True", softcap=True),
    case("fp16 alibi_slopes", batch_api, TypeError, "alibi_slopes has dtype fp16; expected fp32",
         alibi_slopes=thd_array((HEADS_Q,), "fp16")),
    case("alibi_slopes per KV head", forward_thd, ValueError,
         f"alibi_slopes has shape ({HEADS_KV},); expected ({HEADS_Q},) or ({BATCH}, {HEADS_Q})",
         alibi_slopes=thd_array((HEADS_KV,), "fp32")),
    case("alibi_slopes of the wrong batch", forward_bshd, ValueError, "alibi_slopes has shape (3, 4)",
         alibi_slopes=thd_array((BATCH + 1, HEADS_Q), "fp32")),
    case("alibi_slopes strided over heads", backward_thd, ValueError, "its last dimension (heads) must be contiguous",
         alibi_slopes=thd_array((BATCH, HEADS_Q), "fp32", strides=(2 * HEADS_Q, 2))),
    case("alibi_slopes on another device", varlen_api, ValueError, "alibi_slopes is on device 1 but q is on device 0",
         alibi_slopes=thd_array((HEADS_Q,), "fp32", device=1)),
    case("alibi_slopes as a list", batch_api, TypeError, "alibi_slopes has type builtins.list",
         alibi_slopes=lambda m, _: [0.5] * HEADS_Q),
    case("alibi_slopes pointer 2 bytes off", forward_thd, ValueError, "alibi_slopes's data pointer",
         alibi_slopes=thd_array((HEADS_Q,), "fp32", offset=2)),
    case("window_size of strings", varlen_api, TypeError, "window_size must be a pair of ints",
         window_size=("-1", "-1")),
]


def test_the_table_has_at_least_45_distinct_cases():
    assert len(CASES) >= 45
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("bad", CASES, ids=[c.name for c in CASES])
def test_invalid_call_raises_and_enqueues_nothing(fake, bad):
    with pytest.raises(Exception) as raised:  # noqa: B017 - the exact type is asserted below
        bad.call(Memory())
    assert type(raised.value) is bad.error, f"{bad.name}: {type(raised.value).__name__}: {raised.value}"
    assert re.search(re.escape(bad.message), str(raised.value)), str(raised.value)
    assert fake.work() == [], "an invalid call enqueued work"
    if bad.stage == VALIDATION:
        assert fake.backend_requests == 0, "validation should fail before the backend is asked for"


# The baselines every case perturbs are themselves valid: otherwise a case could pass for the wrong reason.
@pytest.mark.parametrize("entry", [forward_thd, forward_bshd, backward_thd], ids=lambda f: f.__name__)
def test_the_baseline_call_launches_once(fake, entry):
    entry(Memory())
    assert len(fake.backend.launches) == 1 and fake.backend.enqueued == []


@pytest.mark.parametrize("entry", [varlen_api, batch_api], ids=lambda f: f.__name__)
def test_the_api_baseline_passes_validation(fake, entry):
    # Raw arrays have no allocator: a valid flash-attn-style call gets as far as allocating its output.
    with pytest.raises(TypeError, match="cannot allocate outputs for 'raw' inputs"):
        entry(Memory())
    assert fake.work() == []


# ---- fuzzing: invalid varlen calls ----------------------------------------------------------------

# What each perturbation of a valid varlen call must raise.
PERTURBATIONS = {
    "k_head_dim": ValueError,
    "heads_not_divisible": ValueError,
    "cu_seqlens_length": ValueError,
    "dtype_mix": TypeError,
}


@st.composite
def varlen_calls(draw):
    return {
        "lengths_q": draw(st.lists(st.integers(0, 17), min_size=1, max_size=4)),
        "lengths_k": None,
        "heads_kv": draw(st.integers(1, 4)),
        "group": draw(st.integers(1, 4)),
        "head_dim": draw(st.sampled_from(smallseq_catalog.SMALLSEQ_HEAD_DIMS)),
        "dtype": draw(st.sampled_from(("fp16", "bf16"))),
        "causal": draw(st.booleans()),
    }


def _varlen_arrays(m: Memory, config: dict, perturb: frozenset = frozenset(), draw_int=None) -> dict:
    batch = len(config["lengths_q"])
    total_q = sum(config["lengths_q"])
    total_k = total_q + batch  # any total works: the lengths only bound the tile
    heads_kv, head_dim, dtype = config["heads_kv"], config["head_dim"], config["dtype"]
    heads_q = heads_kv * config["group"]
    k_dim = head_dim
    cu_k_length = batch + 1
    kv_dtype = dtype
    if "k_head_dim" in perturb:
        k_dim = head_dim + draw_int(-head_dim + 1, 64, exclude=0)
    if "heads_not_divisible" in perturb:
        heads_kv = heads_q + 1  # more kv heads than query heads: never a divisor
    if "cu_seqlens_length" in perturb:
        cu_k_length = batch + 1 + draw_int(-batch, 3, exclude=0)
    if "dtype_mix" in perturb:
        kv_dtype = "bf16" if dtype == "fp16" else "fp16"
    return {
        "q": m.array((total_q, heads_q, head_dim), dtype),
        "k": m.array((total_k, heads_kv, k_dim), kv_dtype),
        "v": m.array((total_k, heads_kv, k_dim), kv_dtype),
        "cu_seqlens_q": m.array((batch + 1,), "int32"),
        "cu_seqlens_k": m.array((cu_k_length,), "int32"),
        "max_seqlen_q": max(config["lengths_q"]),
        "max_seqlen_k": max(config["lengths_q"]) + 1,
        "causal": config["causal"],
        "out": m.array((total_q, heads_q, head_dim), dtype),
        "lse": m.array((heads_q, total_q), "fp32"),
    }


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(config=varlen_calls(), perturb=st.sets(st.sampled_from(sorted(PERTURBATIONS)), min_size=1),
       entry=st.sampled_from(("forward", "api")), data=st.data())
def test_perturbed_varlen_calls_fail_cleanly(device, config, perturb, entry, data):
    device.reset()

    def draw_int(low, high, exclude):
        return data.draw(st.integers(low, high).filter(lambda n: n != exclude))

    kwargs = _varlen_arrays(Memory(), config, frozenset(perturb), draw_int)
    expected = tuple({PERTURBATIONS[p] for p in perturb})
    with pytest.raises(Exception) as raised:  # noqa: B017 - the type is asserted below
        if entry == "forward":
            hipattn.forward(kwargs.pop("q"), kwargs.pop("k"), kwargs.pop("v"), **kwargs)
        else:
            del kwargs["out"], kwargs["lse"]
            hipattn.flash_attn_varlen_func(**kwargs)
    assert type(raised.value) in expected, f"{perturb}: {type(raised.value).__name__}: {raised.value}"
    assert device.work() == [] and device.backend_requests == 0


# ---- fuzzing: valid small calls reach the registry as exactly one launch --------------------------

WARP_LANES = 32


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    layout=st.sampled_from(("thd", "bshd")),
    lengths=st.lists(st.tuples(st.integers(0, 17), st.integers(0, 17)), min_size=1, max_size=4),
    heads_kv=st.integers(1, 4),
    group=st.integers(1, 4),
    head_dim=st.sampled_from((64, 128, 256)),
    dtype=st.sampled_from(("fp16", "bf16")),
    causal=st.booleans(),
    direction=st.sampled_from(("forward", "backward")),
    portable=st.booleans(),
)
def test_valid_small_calls_launch_once_with_one_block_per_group_of_problems(
    device, layout, lengths, heads_kv, group, head_dim, dtype, causal, direction, portable
):
    device.reset()
    m = Memory()
    batch, heads_q = len(lengths), heads_kv * group
    if layout == "thd":
        total_q, total_k = sum(q for q, _ in lengths), sum(k for _, k in lengths)
        q_shape, kv_shape, lse_shape = (total_q, heads_q, head_dim), (total_k, heads_kv, head_dim), (heads_q, total_q)
        seqs = {
            "cu_seqlens_q": m.array((batch + 1,), "int32"), "cu_seqlens_k": m.array((batch + 1,), "int32"),
            "max_seqlen_q": max(q for q, _ in lengths), "max_seqlen_k": max(k for _, k in lengths),
        }  # fmt: skip
    else:
        seqlen_q, seqlen_k = max(q for q, _ in lengths), max(k for _, k in lengths)
        q_shape, kv_shape = (batch, seqlen_q, heads_q, head_dim), (batch, seqlen_k, heads_kv, head_dim)
        lse_shape = (batch, heads_q, seqlen_q)
        seqs = {"seqused_q": m.array((batch,), "int32"), "seqused_k": m.array((batch,), "int32")}
    q, k, v = m.array(q_shape, dtype), m.array(kv_shape, dtype), m.array(kv_shape, dtype)
    lse = m.array(lse_shape, "fp32")
    with pytest.MonkeyPatch.context() as patch:
        if portable:
            patch.setenv(smallseq.KERNEL_SWITCH, "portable")
        if direction == "forward":
            hipattn.forward(q, k, v, out=m.array(q_shape, dtype), lse=lse, causal=causal, **seqs)
        else:
            hipattn.backward(m.array(q_shape, dtype), q, k, v, m.array(q_shape, dtype), lse, dq=m.array(q_shape, dtype),
                             dk=m.array(kv_shape, dtype), dv=m.array(kv_shape, dtype), causal=causal, **seqs)

    assert device.backend.enqueued == []
    assert len(device.backend.launches) == 1, "one kernel per call"
    _, grid, block, _, _, params = device.backend.launches[0]
    # Tensor-core kernels: MHA (Hq == Hkv) one problem per (sequence, head); GQA/MQA one per (sequence,
    # KV head) group, in both directions. Portable kernels: the forward one per (sequence, query head),
    # the backward one per (sequence, KV head), which walks the query heads of its group.
    tensor_cores = not portable
    grouped = tensor_cores and heads_q != heads_kv
    problems = batch * (heads_q if direction == "forward" and not grouped else heads_kv)
    # Tensor-core kernels give each run of problems_per_team problems a team of warps (the table row's
    # split: one, or two and at head_dim 256 in the grouped backward four); the portable ones give each
    # problem a team of head_dim / 4 lanes (four elements of a row per lane).
    if tensor_cores:
        if grouped:
            table = (smallseq_catalog.SMALLSEQ_GQA_FORWARD_MMA_TILES if direction == "forward"
                     else smallseq_catalog.SMALLSEQ_GQA_BACKWARD_MMA_TILES)
            assert params.group_size == group
        else:
            table = (smallseq_catalog.SMALLSEQ_FORWARD_MMA_TILES if direction == "forward"
                     else smallseq_catalog.SMALLSEQ_BACKWARD_MMA_TILES)
        tiles = table[head_dim]
        assert params.problems_per_team == tiles.run_length(problems)
        problems = -(-problems // params.problems_per_team)  # teams, each of which walks its run
        lanes = WARP_LANES * tiles.split
    else:
        lanes = head_dim // 4
    assert block[0] % lanes == 0 and block[1:] == (1, 1)
    per_block = block[0] // lanes
    assert grid == (-(-problems // per_block), 1, 1)
    assert (grid[0] - 1) * per_block < problems <= grid[0] * per_block
    assert (params.batch, params.heads_kv) == (batch, heads_kv)
    # causal is the window's right side at 0; a side with no bound reaches past any sequence.
    assert (params.window_left, params.window_right) == (params.max_seqlen_k, 0 if causal else params.max_seqlen_q)
    function = device.backend.launches[0][0]
    (kernel,) = [kernel for kernel in device.registry.loaded() if kernel.function is function]
    assert kernel.spec.family.name == f"smallseq_{direction}" + ("_gqa_mma" if grouped else "_mma" if tensor_cores else "")


def test_numpy_scalars_are_valid_causal_and_softmax_scale(fake):
    # The stricter checks above reject 1 for causal and "0.125" for softmax_scale, not NumPy's scalars.
    forward_thd(Memory(), causal=np.bool_(True), softmax_scale=np.float32(0.125))
    assert len(fake.backend.launches) == 1
    assert fake.backend.launches[0][-1].softmax_scale == 0.125



def test_numpy_bools_are_valid_deterministic_as_for_causal(fake):
    backward_thd(Memory(), deterministic=np.bool_(True), causal=np.bool_(False))
    assert len(fake.backend.launches) == 1


# ---- arrays whose producer names no device ------------------------------------------------------------


def test_arrays_of_unknown_device_follow_the_others_and_minus_one_never_reaches_the_runtime(fake):
    m = Memory()
    forward_thd(m, q=lambda m, _: CAI(m.array(Q_SHAPE).ptr, Q_SHAPE), k=thd_array(KV_SHAPE, device=1),
                v=thd_array(KV_SHAPE, device=1), cu_seqlens_q=thd_array((BATCH + 1,), "int32", device=1),
                cu_seqlens_k=thd_array((BATCH + 1,), "int32", device=1),
                out=lambda m, _: CAI(m.array(Q_SHAPE).ptr, Q_SHAPE), lse=thd_array((HEADS_Q, TOTAL_Q), "fp32", device=1))
    assert len(fake.backend.launches) == 1
    assert fake.backend.devices_set == [1, 0]  # into device 1 for the call, and back


def test_the_runtime_is_asked_where_a_pointer_lives_when_its_producer_does_not_say(fake):
    m = Memory()
    q = m.array(Q_SHAPE)
    fake.backend.pointer_devices[q.ptr] = 1
    with pytest.raises(ValueError, match="k is on device 0 but q is on device 1"):
        forward_thd(m, q=lambda m, _: CAI(q.ptr, Q_SHAPE))
    assert fake.work() == [] and -1 not in fake.backend.devices_set


def test_arrays_none_of_which_knows_its_device_are_refused_before_anything_runs(fake):
    def unknown(shape, dtype="<f2"):
        return lambda m, _: CAI(m.array(shape, "int32" if dtype == "<i4" else "fp16").ptr, shape, dtype)

    with pytest.raises(ValueError, match="cannot tell which device the arrays live on"):
        forward_thd(Memory(), q=unknown(Q_SHAPE), k=unknown(KV_SHAPE), v=unknown(KV_SHAPE),
                    cu_seqlens_q=unknown((BATCH + 1,), "<i4"), cu_seqlens_k=unknown((BATCH + 1,), "<i4"))
    assert fake.work() == [] and fake.backend.devices_set == []
