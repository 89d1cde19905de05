"""The vendor compilers as hipattn backends, or a skip where one is not installed: for tests that
compile kernels without a GPU (NVRTC for NVIDIA targets, hiprtc for AMD ones)."""

from __future__ import annotations

import pytest
from local_rocm import use_local_rocm

from hipattn.errors import BackendUnavailableError

use_local_rocm()


def nvrtc_backend():
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings is not installed")
    from hipattn.backends.cuda import CudaBackend

    backend = CudaBackend()
    try:
        backend.compiler_identity()
    except BackendUnavailableError as error:
        pytest.skip(f"NVRTC is not loadable: {error}")
    return backend


def hiprtc_backend():
    pytest.importorskip("hip", reason="hip-python is not installed")
    from hipattn.backends.hip import HipBackend

    backend = HipBackend()
    try:
        backend.compiler_identity()
    except BackendUnavailableError as error:
        pytest.skip(f"hiprtc is not loadable: {error}")
    return backend
