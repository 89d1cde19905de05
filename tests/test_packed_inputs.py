"""flash-attn's packed-input functions, on the CPU: flash_attn_qkvpacked_func, flash_attn_kvpacked_func
and their varlen forms, in hipattn (raw arrays) and hipattn.torch (autograd).

Each splits the packed array into views and calls the unpacked function (flash_attn_func or
flash_attn_varlen_func) with every other argument as given. What is tested here: the views (the packed
memory, no copy: pointers, shapes, strides, for every array kind), the arguments' way through, the errors
for a packed argument that is not one, and the gradient's way back into the packed tensor, through a
pure-torch stand-in of the unpacked function and through hipattn.torch's autograd with
hipattn.attention's entry points replaced by a float64 reference. tests/gpu/test_packed_inputs.py runs
the four functions on the kernels.
"""

from __future__ import annotations

import ctypes
import gc
import inspect
import math
import sys
import types
from dataclasses import dataclass

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hipattn  # noqa: E402
import hipattn.torch as hat  # noqa: E402
from hipattn import api, attention  # noqa: E402
from hipattn import problem as problem_mod  # noqa: E402
from hipattn.arrays import raw_array  # noqa: E402
from hipattn.device_array import DeviceArray  # noqa: E402
from hipattn.packed import KV_BATCH, KV_VARLEN, QKV_BATCH, QKV_VARLEN, Packing  # noqa: E402

# ---- the four calls -----------------------------------------------------------------------------------

BATCH, SEQLEN_Q, SEQLEN_K, HEADS_Q, HEADS_KV, HEAD_DIM = 2, 5, 7, 4, 2, 64
LENGTHS_Q, LENGTHS_K = [3, 2], [4, 5]  # varlen: every query row sees a key, causal or not


def _cumulative(lengths):
    return [0, *np.cumsum(lengths).tolist()]


@dataclass(frozen=True)
class Case:
    """One packed function: its name, how its packed argument stacks, and the function it calls."""

    function: str
    packing: Packing
    unpacked: str  # "flash_attn_func" or "flash_attn_varlen_func"

    @property
    def varlen(self) -> bool:
        return self.unpacked == "flash_attn_varlen_func"

    @property
    def packs_q(self) -> bool:
        return self.packing.count == 3

    def shapes(self) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        """(packed array's shape, q's shape or None when q is packed too)."""
        if self.function == "flash_attn_qkvpacked_func":
            return (BATCH, SEQLEN_Q, 3, HEADS_Q, HEAD_DIM), None
        if self.function == "flash_attn_kvpacked_func":
            return (BATCH, SEQLEN_K, 2, HEADS_KV, HEAD_DIM), (BATCH, SEQLEN_Q, HEADS_Q, HEAD_DIM)
        if self.function == "flash_attn_varlen_qkvpacked_func":
            return (sum(LENGTHS_Q), 3, HEADS_Q, HEAD_DIM), None
        return (sum(LENGTHS_K), 2, HEADS_KV, HEAD_DIM), (sum(LENGTHS_Q), HEADS_Q, HEAD_DIM)

    def sequences(self, cu_seqlens_q, cu_seqlens_k):
        """(the packed call's sequence arguments, the unpacked call's): a qkv-packed varlen call has one
        cu_seqlens and one max_seqlen for queries and keys alike."""
        if not self.varlen:
            return (), ()
        if self.packs_q:
            return (cu_seqlens_q, max(LENGTHS_Q)), (cu_seqlens_q, cu_seqlens_q, max(LENGTHS_Q), max(LENGTHS_Q))
        both = (cu_seqlens_q, cu_seqlens_k, max(LENGTHS_Q), max(LENGTHS_K))
        return both, both

    def arguments(self, packed, q, sequences):
        """The packed call's positional arguments up to the first feature argument (dropout_p)."""
        return ((packed,) if self.packs_q else (q, packed)) + tuple(sequences)


CASES = [
    Case("flash_attn_qkvpacked_func", QKV_BATCH, "flash_attn_func"),
    Case("flash_attn_kvpacked_func", KV_BATCH, "flash_attn_func"),
    Case("flash_attn_varlen_qkvpacked_func", QKV_VARLEN, "flash_attn_varlen_func"),
    Case("flash_attn_varlen_kvpacked_func", KV_VARLEN, "flash_attn_varlen_func"),
]
each_function = pytest.mark.parametrize("case", CASES, ids=[c.function for c in CASES])
both_modules = pytest.mark.parametrize("module", [hipattn, hat], ids=["hipattn", "hipattn.torch"])

FEATURES = ("dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "deterministic",
            "return_attn_probs")


class Marker:
    """An argument value that says which argument it is; compared by identity."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"<{self.name}>"


class Recorder:
    """Stands in for an unpacked function: keeps each call's arguments by parameter name (bound to the
    real function's signature) and returns a marker."""

    def __init__(self, real):
        self.signature = inspect.signature(real)
        self.calls: list[dict] = []
        self.result = Marker("result")

    def __call__(self, *args, **kwargs):
        self.calls.append(self.signature.bind(*args, **kwargs).arguments)
        return self.result


@pytest.fixture
def unpacked(monkeypatch):
    """Recorders in place of the unpacked functions of both modules, by (module, function name)."""
    recorders = {}
    for module in (api, hat):
        for name in ("flash_attn_func", "flash_attn_varlen_func"):
            recorders[module, name] = Recorder(getattr(module, name))
            monkeypatch.setattr(module, name, recorders[module, name])
    return recorders


def _the_unpacked_module(module):
    return api if module is hipattn else hat


def _sequence_tensors():
    return (torch.tensor(_cumulative(LENGTHS_Q), dtype=torch.int32),
            torch.tensor(_cumulative(LENGTHS_K), dtype=torch.int32))


# ---- signatures and exports ---------------------------------------------------------------------------

FLASH_ATTN_SIGNATURES = {
    "flash_attn_qkvpacked_func": ["qkv"],
    "flash_attn_kvpacked_func": ["q", "kv"],
    "flash_attn_varlen_qkvpacked_func": ["qkv", "cu_seqlens", "max_seqlen"],
    "flash_attn_varlen_kvpacked_func": ["q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"],
}
FEATURE_DEFAULTS = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
                    ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False),
                    ("return_attn_probs", False)]


@both_modules
@each_function
def test_the_signature_is_flash_attns_with_the_same_names_order_and_defaults(module, case):
    parameters = list(inspect.signature(getattr(module, case.function)).parameters.values())
    positional = [(p.name, p.default) for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD]
    required = [(name, inspect.Parameter.empty) for name in FLASH_ATTN_SIGNATURES[case.function]]
    assert positional == required + FEATURE_DEFAULTS
    keyword_only = [(p.name, p.default) for p in parameters if p.kind is p.KEYWORD_ONLY]
    # The unpacked functions' keyword-only arguments: learnable sinks; hipattn's raw-array functions add
    # flash_attn_func's dropout_seed= and stream= (hipattn.torch draws seeds and runs on torch's stream).
    expected = [("dropout_seed", None), ("learnable_sink", None), ("stream", None)] if module is hipattn \
        else [("learnable_sink", None)]
    assert keyword_only == expected
    assert case.function in module.__all__


# ---- the views: torch ---------------------------------------------------------------------------------


@both_modules
@each_function
@pytest.mark.parametrize("spelling", ["keywords", "positions"])
def test_the_unpacked_function_gets_views_of_the_packed_tensor_and_every_argument_as_given(
        unpacked, module, case, spelling):
    packed_shape, q_shape = case.shapes()
    packed = torch.randn(packed_shape, dtype=torch.float16)
    q = None if q_shape is None else torch.randn(q_shape, dtype=torch.float16)
    cu_q, cu_k = _sequence_tensors()
    given_sequences, expected_sequences = case.sequences(cu_q, cu_k)
    features = {name: Marker(name) for name in FEATURES}
    keyword_only = ("dropout_seed", "learnable_sink", "stream") if module is hipattn else ("learnable_sink",)
    extra = {name: Marker(name) for name in keyword_only}
    function = getattr(module, case.function)
    leading = case.arguments(packed, q, given_sequences)
    if spelling == "keywords":
        result = function(*leading, **features, **extra)
    else:
        result = function(*leading, *features.values(), **extra)

    recorder = unpacked[_the_unpacked_module(module), case.unpacked]
    assert result is recorder.result
    (call,) = recorder.calls
    views = [call[name] for name in ("q", "k", "v")][3 - case.packing.count:]
    axis = case.packing.axis
    for i, view in enumerate(views):
        assert view.shape == packed.shape[:axis] + packed.shape[axis + 1:]
        assert view.stride() == packed.stride()[:axis] + packed.stride()[axis + 1:]
        assert view.data_ptr() == packed.data_ptr() + i * packed.stride(axis) * packed.element_size()
        assert view.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr(), "a view, not a copy"
        assert torch.equal(view, packed.select(axis, i))
    if not case.packs_q:
        assert call["q"] is q
    sequence_names = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k") if case.varlen else ()
    for name, value in zip(sequence_names, expected_sequences, strict=True):
        assert call[name] is value, name
    for name, marker in {**features, **extra}.items():
        assert call[name] is marker, f"{name} arrived as {call.get(name)!r}"


def test_cupy_arrays_are_split_by_their_own_indexing(unpacked, monkeypatch):
    """A CuPy array's basic indexing gives views (a NumPy subclass plays cupy.ndarray here)."""

    class ndarray(np.ndarray):  # noqa: N801 - CuPy's spelling
        pass

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(ndarray=ndarray))
    kv = np.zeros((sum(LENGTHS_K), 2, HEADS_KV, HEAD_DIM), np.float16).view(ndarray)
    hipattn.flash_attn_varlen_kvpacked_func("q", kv, "cu_q", "cu_k", 3, 5)
    (call,) = unpacked[api, "flash_attn_varlen_func"].calls
    for i, name in enumerate(("k", "v")):
        view = call[name]
        assert type(view) is ndarray and view.base is kv and view.shape == (sum(LENGTHS_K), HEADS_KV, HEAD_DIM)
        assert view.__array_interface__["data"][0] == kv.__array_interface__["data"][0] + i * kv.strides[1]


# ---- the views: arrays described by protocol ----------------------------------------------------------


def _unpacked_views(recorder, case):
    (call,) = recorder.calls
    return [call[name] for name in ("q", "k", "v")][3 - case.packing.count:]


@each_function
def test_a_raw_device_array_is_split_into_device_arrays_over_its_memory(unpacked, case):
    packed_shape, q_shape = case.shapes()
    packed = raw_array(0x100000, packed_shape, "fp16", device=1)
    q = None if q_shape is None else raw_array(0x200000, q_shape, "fp16", device=1)
    given_sequences, _ = case.sequences("cu_q", "cu_k")
    getattr(hipattn, case.function)(*case.arguments(packed, q, given_sequences))
    axis = case.packing.axis
    views = _unpacked_views(unpacked[api, case.unpacked], case)
    for i, view in enumerate(views):
        assert isinstance(view, DeviceArray)
        assert view.ptr == 0x100000 + i * packed.strides[axis] * 2
        assert view.shape == packed.shape[:axis] + packed.shape[axis + 1:]
        assert view.strides == packed.strides[:axis] + packed.strides[axis + 1:]
        assert (view.dtype, view.device, view.framework) == ("fp16", 1, "raw")


class CAIArray:
    """A __cuda_array_interface__ v3 producer that names no device and supports no slicing."""

    def __init__(self, ptr, shape, typestr="<f2", stream=None, readonly=False):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, readonly),
                                         "strides": None, "version": 3, "stream": stream}


def test_a_cai_array_keeps_its_producer_stream_read_only_flag_and_owner_in_each_view(unpacked):
    qkv = CAIArray(0x300000, (BATCH, SEQLEN_Q, 3, HEADS_Q, HEAD_DIM), stream=0x77, readonly=True)
    hipattn.flash_attn_qkvpacked_func(qkv)
    q, k, v = _unpacked_views(unpacked[api, "flash_attn_func"], CASES[0])
    row = 3 * HEADS_Q * HEAD_DIM
    assert [view.ptr for view in (q, k, v)] == [0x300000 + i * HEADS_Q * HEAD_DIM * 2 for i in range(3)]
    for view in (q, k, v):
        assert view.strides == (SEQLEN_Q * row, row, HEAD_DIM, 1)
        assert (view.stream, view.readonly, view.framework, view.owner) == (0x77, True, "cai", qkv)
        assert view.device == -1, "an unknown device is left for the launch path to settle, as for q itself"


def test_the_views_of_a_packed_raw_array_pass_the_launch_paths_validation():
    """problem.describe, which attention.forward runs on its inputs, takes the views: last dimension
    contiguous, strides and pointers on 16-byte boundaries; GQA for the kv-packed forms."""
    qkv = raw_array(0x100000, (BATCH, SEQLEN_Q, 3, HEADS_Q, HEAD_DIM), "bf16", 0)
    problem = problem_mod.describe(*hipattn.packed.split(qkv, QKV_BATCH))
    assert (problem.layout, problem.heads_q, problem.heads_kv, problem.max_seqlen_k) == ("bshd", 4, 4, SEQLEN_Q)
    q = raw_array(0x200000, (sum(LENGTHS_Q), HEADS_Q, HEAD_DIM), "bf16", 0)
    kv = raw_array(0x300000, (sum(LENGTHS_K), 2, HEADS_KV, HEAD_DIM), "bf16", 0)
    cu_q, cu_k = (raw_array(ptr, (3,), "int32", 0) for ptr in (0x400000, 0x400100))
    problem = problem_mod.describe(q, *hipattn.packed.split(kv, KV_VARLEN), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                   max_seqlen_q=3, max_seqlen_k=5)
    assert (problem.layout, problem.heads_q, problem.heads_kv, problem.total_k) == ("thd", 4, 2, 9)


class DLTensor(ctypes.Structure):
    """DLPack's DLTensor, laid out from the C header (not from hipattn's reader)."""

    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32),
                ("ndim", ctypes.c_int32), ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16),
                ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_KDL_CUDA, _KDL_FLOAT = 2, 2


class DLPackArray:
    """A contiguous fp16 CUDA DLPack producer (legacy capsule, no slicing) that counts how often its
    deleter ran and records the stream each export was asked for."""

    def __init__(self, ptr, shape):
        self.streams = []
        deleted = self._deleted = [0]
        self._shape = (ctypes.c_int64 * len(shape))(*shape)
        # The callback closes over a plain list, not self: it may run while self is being collected.
        self._deleter = _DELETER(lambda address: deleted.__setitem__(0, deleted[0] + 1))
        tensor = DLTensor(ptr, _KDL_CUDA, 0, len(shape), _KDL_FLOAT, 16, 1, ctypes.addressof(self._shape), None, 0)
        self.managed = DLManagedTensor(tensor, None, ctypes.cast(self._deleter, ctypes.c_void_p).value)

    @property
    def deleted(self):
        return self._deleted[0]

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, stream=None, max_version=None):
        self.streams.append(stream)
        return _new_capsule(ctypes.addressof(self.managed), b"dltensor", None)


def test_a_dlpack_array_is_consumed_once_on_the_calls_stream_and_lives_as_long_as_its_views(unpacked):
    kv = DLPackArray(0x500000, (BATCH, SEQLEN_K, 2, HEADS_KV, HEAD_DIM))
    hipattn.flash_attn_kvpacked_func("q", kv, stream=0x55)
    assert kv.streams == [0x55]
    recorder = unpacked[api, "flash_attn_func"]
    k, v = _unpacked_views(recorder, CASES[1])
    assert (k.ptr, v.ptr, k.framework, k.device) == (0x500000, 0x500000 + HEADS_KV * HEAD_DIM * 2, "dlpack", 0)
    assert kv.deleted == 0, "the producer's deleter must not run while a view is alive"
    del k, v
    recorder.calls.clear()
    gc.collect()
    assert kv.deleted == 1


# ---- what is not a packed argument ----------------------------------------------------------------------


def _call_with_packed(module, case, packed):
    """A call of ``case``'s function with ``packed`` as its packed argument and well-formed others."""
    _, q_shape = case.shapes()
    q = None if q_shape is None else torch.randn(q_shape, dtype=torch.float16)
    given_sequences, _ = case.sequences(*_sequence_tensors())
    return getattr(module, case.function)(*case.arguments(packed, q, given_sequences))


def _misshapen(case):
    """(packed shape one dimension short, packed shape stacking one array too many)."""
    shape, _ = case.shapes()
    axis = case.packing.axis
    return shape[1:], shape[:axis] + (case.packing.count + 1,) + shape[axis + 1:]


@both_modules
@each_function
def test_a_packed_argument_of_the_wrong_rank_or_stack_is_refused_naming_it(unpacked, module, case):
    name = case.packing.name
    too_few_dimensions, too_many_stacked = _misshapen(case)
    with pytest.raises(ValueError, match=rf"{name} has shape .*expected {case.packing.rank} dimensions"):
        _call_with_packed(module, case, torch.zeros(too_few_dimensions, dtype=torch.float16))
    with pytest.raises(ValueError, match=rf"{name} has shape .*dimension {case.packing.axis} stacks .* extent "
                                         rf"{case.packing.count}, not {case.packing.count + 1}"):
        _call_with_packed(module, case, torch.zeros(too_many_stacked, dtype=torch.float16))
    if module is hipattn:  # raw arrays too, checked on their description
        with pytest.raises(ValueError, match=rf"{name} has shape"):
            _call_with_packed(module, case, raw_array(0x100000, too_many_stacked, "fp16", 0))
    assert all(not recorder.calls for recorder in unpacked.values()), "nothing reached the unpacked function"


@both_modules
@each_function
@pytest.mark.parametrize("packed", [None, [[1.0, 2.0]], "qkv", 3.0], ids=["None", "list", "str", "float"])
def test_a_packed_argument_that_is_not_an_array_is_a_type_error_naming_it(unpacked, module, case, packed):
    expected = "must be a torch.Tensor" if module is hat else "not a device array"
    with pytest.raises(TypeError, match=rf"{case.packing.name} .*{expected}"):
        _call_with_packed(module, case, packed)
    assert all(not recorder.calls for recorder in unpacked.values())


def test_a_host_numpy_array_is_refused_naming_the_packed_argument():
    qkv = np.zeros((BATCH, SEQLEN_Q, 3, HEADS_Q, HEAD_DIM), np.float16)
    with pytest.raises((TypeError, ValueError), match="qkv .*host"):
        hipattn.flash_attn_qkvpacked_func(qkv)
    with pytest.raises(TypeError, match="qkv must be a torch.Tensor, got ndarray"):
        hat.flash_attn_qkvpacked_func(qkv)


def test_hipattn_torch_names_each_other_argument_that_is_not_a_tensor():
    cu_q, cu_k = _sequence_tensors()
    q = torch.zeros(CASES[3].shapes()[1], dtype=torch.float16)
    kv = torch.zeros(CASES[3].shapes()[0], dtype=torch.float16)
    with pytest.raises(TypeError, match="q must be a torch.Tensor, got list"):
        hat.flash_attn_kvpacked_func([0.0], torch.zeros(CASES[1].shapes()[0], dtype=torch.float16))
    with pytest.raises(TypeError, match="cu_seqlens_k must be a torch.Tensor, got list"):
        hat.flash_attn_varlen_kvpacked_func(q, kv, cu_q, [0, 4, 9], 3, 5)
    with pytest.raises(TypeError, match="cu_seqlens must be a torch.Tensor, got list"):
        hat.flash_attn_varlen_qkvpacked_func(torch.zeros(CASES[2].shapes()[0], dtype=torch.float16), [0, 3, 5], 3)


# ---- what the unpacked functions refuse -----------------------------------------------------------------


@both_modules
@each_function
def test_an_impossible_dropout_p_is_refused_naming_it(module, case):
    shape, _ = case.shapes()
    with pytest.raises(ValueError, match=r"dropout_p is 1\.5; it must be in \[0, 1\)"):
        _call_with_features(module, case, torch.randn(shape, dtype=torch.float16), dropout_p=1.5)


def _call_with_features(module, case, packed, **features):
    _, q_shape = case.shapes()
    q = None if q_shape is None else torch.randn(q_shape, dtype=torch.float16)
    given_sequences, _ = case.sequences(*_sequence_tensors())
    return getattr(module, case.function)(*case.arguments(packed, q, given_sequences), **features)


@both_modules
@each_function
@pytest.mark.parametrize("features", [{"dropout_p": 0.25}, {"window_size": (3, 0)}, {"softcap": 30.0},
                                      {"alibi_slopes": "slopes"}, {"window_size": "wide"}],
                         ids=["dropout", "window", "softcap", "alibi", "malformed window"])
def test_each_feature_argument_meets_the_unpacked_functions_verdict(module, case, features):
    """Whatever flash_attn_func or flash_attn_varlen_func answers for a feature argument (here, on CPU
    tensors: a ValueError naming what it does not support, or, for what it serves, the complaint that
    q is a CPU tensor), the packed form answers the same."""
    shape, q_shape = case.shapes()
    packed = torch.randn(shape, dtype=torch.float16)
    with pytest.raises(Exception) as packed_error:  # noqa: B017 - the type is compared below
        _call_with_features(module, case, packed, **features)
    views = packed.unbind(case.packing.axis)
    arrays = views if case.packs_q else (torch.randn(q_shape, dtype=torch.float16), *views)
    _, unpacked_sequences = case.sequences(*_sequence_tensors())
    unpacked_function = getattr(_the_unpacked_module(module), case.unpacked)
    with pytest.raises(Exception) as unpacked_error:  # noqa: B017
        unpacked_function(*arrays, *unpacked_sequences, **features)
    assert type(packed_error.value) is type(unpacked_error.value)
    assert str(packed_error.value) == str(unpacked_error.value)
    assert isinstance(packed_error.value, (TypeError, ValueError))


# ---- gradients: into the packed tensor ------------------------------------------------------------------


def _sequence_lists(cu_seqlens_q, cu_seqlens_k):
    return [int(x) for x in cu_seqlens_q], [int(x) for x in cu_seqlens_k]


def attention_float64(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal):
    """Differentiable float64 attention with hipattn's conventions: (out, lse), BSHD when cu_seqlens_q
    is None (lse [B, H, S_q]) and THD otherwise (lse [H, total_q]); GQA; bottom-right causal mask; a row
    that sees no key gives zeros and an LSE of +inf."""
    if cu_seqlens_q is None:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        cu_q = torch.arange(batch + 1) * seqlen_q
        cu_k = torch.arange(batch + 1) * seqlen_k
        out, lse = attention_float64(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, softmax_scale,
                                     causal)
        return out.unflatten(0, (batch, seqlen_q)), lse.unflatten(1, (batch, seqlen_q)).transpose(0, 1)
    starts_q, starts_k = _sequence_lists(cu_seqlens_q, cu_seqlens_k)
    group = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for b in range(len(starts_q) - 1):
        qs = q[starts_q[b]:starts_q[b + 1]].double()
        ks = k[starts_k[b]:starts_k[b + 1]].double().repeat_interleave(group, dim=1)
        vs = v[starts_k[b]:starts_k[b + 1]].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("ihd,jhd->hij", qs, ks) * softmax_scale
        if causal:
            i = torch.arange(qs.shape[0])[:, None]
            j = torch.arange(ks.shape[0])[None, :]
            scores = scores.masked_fill(j > i + ks.shape[0] - qs.shape[0], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        seen = torch.isfinite(lse)
        probs = torch.exp(scores - torch.where(seen, lse, 0.0)[..., None])  # 0 where masked
        outs.append(torch.einsum("hij,jhd->ihd", probs, vs))
        lses.append(torch.where(seen, lse, float("inf")))
    return torch.cat(outs), torch.cat(lses, dim=1)


def stand_in_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             learnable_sink=None):
    """hipattn.torch.flash_attn_func in pure torch, differentiable on CPU tensors (without sinks, which
    the test does not pass)."""
    assert learnable_sink is None
    scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(q.shape[-1])
    out, lse = attention_float64(q, k, v, None, None, scale, causal)
    return (out, lse, None) if return_attn_probs else out


def stand_in_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                    block_table=None, *, learnable_sink=None):
    assert learnable_sink is None
    scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(q.shape[-1])
    out, lse = attention_float64(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal)
    return (out, lse, None) if return_attn_probs else out


def _leaves(case):
    """Random float64 leaves (packed, q or None) that require grad."""
    packed_shape, q_shape = case.shapes()
    packed = torch.randn(packed_shape, dtype=torch.float64, requires_grad=True)
    q = None if q_shape is None else torch.randn(q_shape, dtype=torch.float64, requires_grad=True)
    return packed, q


def _expected_gradients(case, packed, q, dout, causal):
    """(d packed, dq or None) by plain torch autograd on separate q, k, v leaves, stacked as flash-attn
    returns dqkv and dkv: no hipattn code on this path."""
    arrays = [packed.detach().select(case.packing.axis, i).clone().requires_grad_() for i in range(case.packing.count)]
    if q is not None:
        arrays.insert(0, q.detach().clone().requires_grad_())
    cu_q, cu_k = _sequence_tensors()
    sequences = (cu_q, cu_q if case.packs_q else cu_k) if case.varlen else (None, None)
    out, _ = attention_float64(*arrays, *sequences, 1 / math.sqrt(HEAD_DIM), causal)
    out.backward(dout)
    stacked = torch.stack([a.grad for a in arrays[-case.packing.count:]], dim=case.packing.axis)
    return stacked, (arrays[0].grad if q is not None else None)


def _check_gradients(module, case, causal=True):
    packed, q = _leaves(case)
    given_sequences, _ = case.sequences(*_sequence_tensors())
    out = getattr(module, case.function)(*case.arguments(packed, q, given_sequences), causal=causal)
    assert out.requires_grad
    dout = torch.randn(out.shape, dtype=torch.float64)
    out.backward(dout)
    expected_packed, expected_q = _expected_gradients(case, packed, q, dout, causal)
    assert packed.grad.shape == packed.shape
    torch.testing.assert_close(packed.grad, expected_packed)
    if q is not None:
        torch.testing.assert_close(q.grad, expected_q)


@pytest.fixture
def stand_ins(monkeypatch):
    monkeypatch.setattr(hat, "flash_attn_func", stand_in_flash_attn_func)
    monkeypatch.setattr(hat, "flash_attn_varlen_func", stand_in_flash_attn_varlen_func)


@both_modules
@each_function
def test_gradients_flow_back_into_the_packed_tensor_through_its_views(stand_ins, module, case):
    """hipattn.torch's packed forms, and hipattn's (whose torch views keep requires_grad, so that the
    unpacked function records autograd through hipattn.torch), with hipattn.torch's unpacked functions
    replaced by a pure-torch stand-in: the packed tensor's .grad is dq, dk and dv stacked (GQA: dk and dv
    summed over each group, for the kv-packed forms)."""
    _check_gradients(module, case)


class Float64Kernels:
    """hipattn.attention.forward and backward in float64 (the backward by torch.func.vjp, which works
    below autograd, where hipattn.torch's backward op runs): the real autograd path around them."""

    def __init__(self):
        self.forward_calls = self.backward_calls = 0

    def forward(self, q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, softmax_scale=None, causal=False, **ignored):
        self.forward_calls += 1
        scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(q.shape[-1])
        out, lse = attention_float64(q.detach(), k.detach(), v.detach(), cu_seqlens_q, cu_seqlens_k, scale, causal)
        return out.to(q.dtype), lse.float()

    def backward(self, dout, q, k, v, out, lse, *, cu_seqlens_q=None, cu_seqlens_k=None, softmax_scale, causal,
                 **ignored):
        self.backward_calls += 1

        def attend(q, k, v):
            return attention_float64(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)[0]

        _, pullback = torch.func.vjp(attend, q.double(), k.double(), v.double())
        return tuple(g.to(t.dtype) for g, t in zip(pullback(dout.double()), (q, k, v), strict=True))


@both_modules
@each_function
@pytest.mark.parametrize("causal", [False, True])
def test_hipattns_backward_runs_once_and_its_gradients_land_in_the_packed_tensor(monkeypatch, module, case, causal):
    kernels = Float64Kernels()
    monkeypatch.setattr(attention, "forward", kernels.forward)
    monkeypatch.setattr(attention, "backward", kernels.backward)
    _check_gradients(module, case, causal)
    assert (kernels.forward_calls, kernels.backward_calls) == (1, 1)


@both_modules
def test_torch_compile_traces_a_packed_call_in_one_graph_with_eagers_gradients(monkeypatch, module):
    kernels = Float64Kernels()
    monkeypatch.setattr(attention, "forward", kernels.forward)
    monkeypatch.setattr(attention, "backward", kernels.backward)
    qkv, _ = _leaves(CASES[0])

    def step(qkv):
        return (module.flash_attn_qkvpacked_func(qkv, causal=True) ** 2).sum()

    torch.compile(step, backend="aot_eager", fullgraph=True)(qkv).backward()
    compiled_gradient, qkv.grad = qkv.grad, None
    step(qkv).backward()
    torch.testing.assert_close(compiled_gradient, qkv.grad)
