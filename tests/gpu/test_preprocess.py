"""The flash backward's pre-processing kernels on the GPU: D = rowsum(dO * O) and dq conversion,
launched from torch tensors and CuPy arrays on a non-default stream, against numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hipattn import arrays
from hipattn.backends import get_backend
from hipattn.ops import preprocess
from hipattn.streams import on_device


def _host(t: torch.Tensor) -> np.ndarray:
    return t.float().cpu().numpy().astype(np.float64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("layout", ["thd", "bshd"])
def test_dot_do_o_matches_numpy(dtype, head_dim, layout):
    shape = (1000, 12, head_dim) if layout == "thd" else (3, 333, 12, head_dim)
    o = torch.randn(shape, device="cuda").to(dtype)
    do = torch.randn(shape, device="cuda").to(dtype)
    d_shape = (12, 1000) if layout == "thd" else (3, 12, 333)
    d = torch.full(d_shape, float("nan"), device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), on_device(get_backend(), 0):
        preprocess.dot_do_o(arrays.as_device_array(o, "o"), arrays.as_device_array(do, "do"),
                            arrays.as_device_array(d, "d"), stream.cuda_stream)
    stream.synchronize()
    expected = (_host(o) * _host(do)).sum(-1)
    expected = expected.T if layout == "thd" else expected.transpose(0, 2, 1)
    np.testing.assert_allclose(d.cpu().numpy(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_convert_dq_scales_rounds_and_zeroing_clears_the_accumulator(dtype, head_dim):
    accum = torch.randn(777, 8, head_dim, device="cuda")
    dq = torch.full(accum.shape, float("nan"), device="cuda").to(dtype)
    stream = torch.cuda.Stream()
    with on_device(get_backend(), 0):
        preprocess.convert_dq(arrays.as_device_array(accum, "acc"), arrays.as_device_array(dq, "dq"), 0.125,
                              stream.cuda_stream)
        stream.synchronize()
        expected = (accum * 0.125).to(dtype)  # fp32 product, then round to nearest even: what the kernel does
        assert torch.equal(dq, expected)
        preprocess.zero_dq_accum(arrays.as_device_array(accum, "acc"), stream.cuda_stream)
        stream.synchronize()
    assert torch.equal(accum, torch.zeros_like(accum))


def test_dot_do_o_from_cupy_on_a_non_default_stream():
    cupy = pytest.importorskip("cupy")
    o = cupy.random.standard_normal((500, 4, 128), dtype=cupy.float32).astype(cupy.float16)
    do = cupy.random.standard_normal((500, 4, 128), dtype=cupy.float32).astype(cupy.float16)
    d = cupy.full((4, 500), cupy.nan, dtype=cupy.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with on_device(get_backend(), 0):
        preprocess.dot_do_o(arrays.as_device_array(o, "o"), arrays.as_device_array(do, "do"),
                            arrays.as_device_array(d, "d"), stream.ptr)
    stream.synchronize()
    expected = (cupy.asnumpy(o).astype(np.float64) * cupy.asnumpy(do).astype(np.float64)).sum(-1).T
    np.testing.assert_allclose(cupy.asnumpy(d), expected, rtol=1e-5, atol=1e-4)


def test_preprocess_launches_capture_into_a_cuda_graph():
    o = torch.randn(256, 4, 128, device="cuda").half()
    do = torch.randn_like(o)
    d = torch.empty(4, 256, device="cuda")
    a_o, a_do, a_d = (arrays.as_device_array(x, n) for x, n in ((o, "o"), (do, "do"), (d, "d")))
    stream = torch.cuda.Stream()
    with on_device(get_backend(), 0):
        preprocess.dot_do_o(a_o, a_do, a_d, stream.cuda_stream)  # compile + load before capture
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            preprocess.dot_do_o(a_o, a_do, a_d, stream.cuda_stream)
    d.fill_(float("nan"))
    o.normal_()
    graph.replay()
    torch.cuda.synchronize()
    expected = (o.double() * do.double()).sum(-1).T
    torch.testing.assert_close(d.double(), expected, rtol=1e-5, atol=1e-4)
