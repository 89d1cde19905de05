"""Compiling through the vendor backends without a GPU: NVRTC for sm_90, hiprtc for gfx90a."""

from __future__ import annotations

import pickle
import re
import struct

import pytest
from support.compilers import hiprtc_backend, nvrtc_backend
from support.local_rocm import use_local_rocm

from hipattn.errors import CompileError, DriverError
from hipattn.jit.sources import include_closure
from hipattn.jit.target import Target

use_local_rocm()

# A small template that reaches the numeric types header, as every shipped kernel does.
SOURCE = """\
#include "common/types.h"
namespace hipattn {
template <typename T, int N>
__global__ void scale_rows(T* out, const T* in, float factor) {
  float values[N];
  const int offset = (blockIdx.x * blockDim.x + threadIdx.x) * N;
  load_as_float<T, N>(in + offset, values);
#pragma unroll
  for (int i = 0; i < N; ++i) values[i] *= factor;
  store_from_float<T, N>(out + offset, values);
}
}  // namespace hipattn
"""
NAME_EXPRESSION = "hipattn::scale_rows<hipattn::bf16_t, 4>"
BROKEN_SOURCE = SOURCE.replace("values[i] *= factor;", "values[i] *= factor oops;")

ELF_MAGIC = b"\x7fELF"
EM_CUDA = 190
EM_AMDGPU = 224

def elf_machine(binary: bytes) -> int:
    return struct.unpack_from("<H", binary, 18)[0]


@pytest.fixture(scope="module")
def nvrtc():
    return nvrtc_backend()


@pytest.fixture(scope="module")
def hiprtc():
    return hiprtc_backend()


def compile_with(backend, source: str, arch: str):
    target = Target.parse(arch)
    options = backend.compile_options(target)
    return backend.compile(source, include_closure(source), NAME_EXPRESSION, target, options, f"test scale_rows {arch}")


# Each compiler with the arch it builds for here, the ELF machine of its binaries, and its arch option.
COMPILERS = {
    "nvrtc": ("sm_90", EM_CUDA, "--gpu-architecture=sm_90"),
    "hiprtc": ("gfx90a", EM_AMDGPU, "--offload-arch=gfx90a"),
}


@pytest.fixture(params=[pytest.param(name, marks=getattr(pytest.mark, name)) for name in COMPILERS])
def either(request):
    """(backend, arch, ELF machine, arch option) for each compiler in turn."""
    return request.getfixturevalue(request.param), *COMPILERS[request.param]


# ---- both compilers --------------------------------------------------------------------------------


def test_compiles_a_template_to_an_elf_binary_with_its_lowered_name(either):
    backend, arch, machine, _ = either
    kernel = compile_with(backend, SOURCE, arch)
    assert kernel.binary[:4] == ELF_MAGIC
    assert elf_machine(kernel.binary) == machine  # a CUBIN for NVIDIA, a code object for AMD
    assert kernel.lowered_name.startswith("_Z") and "scale_rows" in kernel.lowered_name
    # The symbol the loader will look up is the one in the binary.
    assert kernel.lowered_name.encode() + b"\0" in kernel.binary


def test_syntax_error_raises_a_compile_error_with_the_log(either):
    backend, arch, _, arch_option = either
    with pytest.raises(CompileError) as caught:
        compile_with(backend, BROKEN_SOURCE, arch)
    error = caught.value
    assert "error" in error.log and "oops" in error.log
    assert error.target == arch
    assert arch_option in error.options
    assert f"test scale_rows {arch}" in str(error)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.log, copy.spec, copy.target, copy.options) == (error.log, error.spec, error.target, error.options)


# ---- NVRTC ----------------------------------------------------------------------------------------


@pytest.mark.nvrtc
def test_nvrtc_identity_names_compiler_and_version(nvrtc):
    name, version, *wheel = nvrtc.compiler_identity().split(" ", 2)
    assert name == "nvrtc"
    assert all(part.isdigit() for part in version.split("."))
    # The wheel's full version (patch releases change the binary too), when NVRTC came from one.
    assert not wheel or re.fullmatch(r"\(nvidia-cuda-nvrtc(-cu12)? [0-9.]+\)", wheel[0])


@pytest.mark.nvrtc
def test_nvrtc_options_ask_for_a_cubin_of_the_exact_arch(nvrtc):
    options = nvrtc.compile_options(Target.parse("sm_90a"))
    assert "--gpu-architecture=sm_90a" in options
    assert "-std=c++17" in options
    assert not any("fast" in option for option in options)


@pytest.mark.nvrtc
def test_nvrtc_unknown_arch_is_a_compile_error_not_a_crash(nvrtc):
    with pytest.raises(CompileError) as caught:
        compile_with(nvrtc, SOURCE, "sm_9")
    assert "gpu-architecture" in caught.value.log


@pytest.mark.nvrtc
def test_nvrtc_source_dump_is_behind_the_env_flag(nvrtc, monkeypatch):
    monkeypatch.delenv("HIPATTN_DUMP_SOURCE", raising=False)
    with pytest.raises(CompileError) as quiet:
        compile_with(nvrtc, BROKEN_SOURCE, "sm_90")
    assert quiet.value.source is None
    monkeypatch.setenv("HIPATTN_DUMP_SOURCE", "1")
    with pytest.raises(CompileError) as loud:
        compile_with(nvrtc, BROKEN_SOURCE, "sm_90")
    assert loud.value.source == BROKEN_SOURCE and "oops" in str(loud.value)


@pytest.mark.nvrtc
def test_nvrtc_backend_refuses_an_amd_target(nvrtc):
    assert not nvrtc.can_compile_for(Target.parse("gfx90a"))
    with pytest.raises(ValueError, match="NVIDIA"):
        nvrtc.compile_options(Target.parse("gfx90a"))


# ---- hiprtc ---------------------------------------------------------------------------------------


@pytest.mark.hiprtc
def test_hiprtc_identity_names_the_rocm_release(hiprtc):
    identity = hiprtc.compiler_identity()
    assert identity.startswith("hiprtc ")
    # hiprtcVersion would say 9.0 on ROCm 5.2; the identity carries the HIP release instead.
    version = hiprtc.rocm_version()
    assert version is not None and f"{version[0]}.{version[1]}." in identity


@pytest.mark.hiprtc
def test_hiprtc_keeps_target_features_in_the_arch_flag(hiprtc):
    target = Target.parse("gfx90a:xnack-")
    assert "--offload-arch=gfx90a:xnack-" in hiprtc.compile_options(target)
    kernel = compile_with(hiprtc, SOURCE, "gfx90a:xnack-")
    assert kernel.binary[:4] == ELF_MAGIC


@pytest.mark.hiprtc
def test_hiprtc_refuses_a_processor_its_release_does_not_know(hiprtc):
    version = hiprtc.rocm_version()
    if version is None or version >= (6, 0):
        pytest.skip(f"this hiprtc (ROCm {version}) knows gfx942")
    gfx942 = Target.parse("gfx942")
    assert not hiprtc.can_compile_for(gfx942)
    # The caller gets an error that says what and why; the process is still alive to report it.
    with pytest.raises(CompileError) as caught:
        compile_with(hiprtc, SOURCE, "gfx942")
    message = str(caught.value)
    assert "gfx942" in message and "ROCm >= 6.0" in message and "abort" in message
    assert pickle.loads(pickle.dumps(caught.value)).log == caught.value.log


@pytest.mark.hiprtc
def test_hiprtc_refuses_processors_missing_from_the_table(hiprtc):
    assert not hiprtc.can_compile_for(Target.parse("gfx9999"))
    assert not hiprtc.can_compile_for(Target.parse("sm_90"))
    assert hiprtc.can_compile_for(Target.parse("gfx90a"))


@pytest.mark.hiprtc
def test_hip_runtime_failure_is_a_driver_error_naming_the_call(hiprtc):
    try:
        count = hiprtc.device_count()
    except DriverError as error:
        assert error.call == "hipGetDeviceCount"
        assert error.name.startswith("hipError")
        assert "hipGetDeviceCount failed" in str(error)
        copy = pickle.loads(pickle.dumps(error))
        assert (copy.call, copy.code, copy.name, copy.description) == (
            error.call, error.code, error.name, error.description,
        )  # fmt: skip
    else:
        pytest.skip(f"this machine has {count} AMD device(s): no failing call to observe")


def test_driver_error_pickles_and_names_the_call():
    error = DriverError("cuMemcpyAsync", 1, "CUDA_ERROR_INVALID_VALUE", "invalid argument")
    copy = pickle.loads(pickle.dumps(error))
    assert str(copy) == str(error) == "cuMemcpyAsync failed: CUDA_ERROR_INVALID_VALUE (1): invalid argument"
    assert (copy.call, copy.code) == ("cuMemcpyAsync", 1)
