"""The vendor compilers as hipattn backends, or a skip where one is not installed: for tests that
compile kernels without a GPU (NVRTC for NVIDIA targets, hiprtc for AMD ones)."""

from __future__ import annotations

import re

import pytest

from hipattn.backends.cuda import CudaBackend  # both modules import their vendor packages lazily
from hipattn.backends.hip import HipBackend
from hipattn.errors import BackendUnavailableError
from hipattn.jit.sources import compile_unit
from hipattn.jit.target import Target
from support.local_rocm import use_local_rocm

use_local_rocm()


def _loadable_backend(module: str, package: str, backend_class, compiler: str):
    """A ``backend_class()`` whose compiler answers, or a skip naming what is missing."""
    pytest.importorskip(module, reason=f"{package} is not installed")
    backend = backend_class()
    try:
        backend.compiler_identity()
    except BackendUnavailableError as error:
        pytest.skip(f"{compiler} is not loadable: {error}")
    return backend


def nvrtc_backend():
    return _loadable_backend("cuda.bindings.nvrtc", "cuda-bindings", CudaBackend, "NVRTC")


def hiprtc_backend():
    return _loadable_backend("hip", "hip-python", HipBackend, "hiprtc")


def hiprtc_for(arch: str):
    """(hiprtc backend, target) for ``arch``, or a skip where this hiprtc's release cannot compile for it."""
    backend = hiprtc_backend()
    target = Target.parse(arch)
    if not backend.can_compile_for(target):
        pytest.skip(backend.unsupported_reason(target))
    return backend, target


def compile_family(backend, family, target, spec, extra_lines=(), options=()):
    """``family``'s compile unit, with ``extra_lines`` appended (static_asserts on its layout), compiled
    for ``spec`` and ``target`` with the backend's options and then ``options`` (NVRTC's
    --ptxas-options=-v puts ptxas's resource report in the log); a failure raises CompileError with the
    compiler's log."""
    source, headers = compile_unit(family)
    source += "".join(f"{line}\n" for line in extra_lines)
    return backend.compile(source, headers, spec.name_expression(), target,
                           (*backend.compile_options(target), *options), spec.canonical())


_REGISTERS = re.compile(r"Used (\d+) registers")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def ptxas_resources(log: str) -> tuple[int, int, int, int]:
    """(registers, stack frame, spill stores, spill loads) from ptxas's -v report of one kernel, in the
    log of a ``compile_family`` call with ``--ptxas-options=-v``."""
    registers, frame = _REGISTERS.findall(log), _FRAME.findall(log)
    assert len(registers) == 1 and len(frame) == 1, f"not one kernel's resource report:\n{log}"
    return (int(registers[0]), *(int(x) for x in frame[0]))


def compile_with_layout_checks(backend, family, target, table, layout_of) -> None:
    """One compile of ``family``'s unit for ``target`` with static_asserts that, for every (head_dim, tiles)
    row of ``table``, the kernel's layout struct ``layout_of(head_dim, tiles)`` (a C++ type) has the
    launcher's dynamic shared bytes, ``tiles.shared_bytes(head_dim)``, and the row's threads per block."""
    checks = []
    for head_dim, tiles in sorted(table.items()):
        layout = layout_of(head_dim, tiles)
        checks += [f'static_assert({layout}::kBytes == {tiles.shared_bytes(head_dim)}, '
                   f'"{layout}: bytes differ from its tile row\'s shared_bytes");',
                   f'static_assert({layout}::kThreads == {tiles.threads}, "{layout}: threads differ from its tile row");']
    compile_family(backend, family, target, family.shipped(target)[0], checks)
