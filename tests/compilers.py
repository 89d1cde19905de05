"""The vendor compilers as hipattn backends, or a skip where one is not installed: for tests that
compile kernels without a GPU (NVRTC for NVIDIA targets, hiprtc for AMD ones)."""

from __future__ import annotations

import pytest
from local_rocm import use_local_rocm

from hipattn.errors import BackendUnavailableError
from hipattn.sources import compile_unit
from hipattn.spec import name_expression

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


def compile_family(backend, family, target, spec, extra_lines=()):
    """``family``'s compile unit, with ``extra_lines`` appended (static_asserts on its layout), compiled
    for ``spec`` and ``target``; a failure raises CompileError with the compiler's log."""
    source, headers = compile_unit(family)
    source += "".join(f"{line}\n" for line in extra_lines)
    return backend.compile(source, headers, name_expression(family, spec), target, backend.compile_options(target),
                           spec.canonical())


def layout_checks(layout: str, shared_bytes: int, threads: int, formula: str) -> list[str]:
    """static_asserts that the kernel's layout struct ``layout`` (a C++ type) has the launcher's dynamic
    shared bytes (families.``formula``) and threads per block."""
    return [f'static_assert({layout}::kBytes == {shared_bytes}, "{layout}: bytes differ from families.{formula}");',
            f'static_assert({layout}::kThreads == {threads}, "{layout}: threads differ from its tile row");']
