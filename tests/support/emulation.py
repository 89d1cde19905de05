"""GPUs emulated on the CPU, so that the kernels run in tests on machines without one.

``EmulationBackend`` is a hipattn backend whose device is an AMD gfx90a (wave64, MFMA) or an NVIDIA
sm_80 (warp32, mma.sync, ldmatrix, cp.async): it compiles a kernel's real compile unit with g++
against tests/support/emulation/emulated_device.h (threads as fibers, blocks in turn, matrix and
cross-lane operations through per-lane slots) into a shared library, and launches run it on host
memory. Arrays are NumPy arrays passed by address, so the whole launch path (dispatch, validation,
parameter packing, grid sizing, workspace) runs as on a GPU, and results can be compared with a
float64 reference. ``EmulatedDevice`` installs the backend as the active runtime (hipattn.runtime)
for the duration of a test.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest

from hipattn import dispatch, runtime, varlen_prep
from hipattn.arrays import raw_array
from hipattn.backends.base import Backend, CompiledKernel
from hipattn.errors import CompileError
from hipattn.jit.cache import DiskCache
from hipattn.jit.registry import Registry
from hipattn.jit.target import Target
from hipattn.ops import smallseq

RUNTIME_DIR = Path(__file__).parent / "emulation"
RUNTIME_HEADER = RUNTIME_DIR / "emulated_device.h"


@dataclass(frozen=True)
class EmulatedArch:
    """What one emulated device is: its arch, the macros its build defines, and its shared memory."""

    arch: str
    defines: tuple[str, ...]
    shared_bytes_per_block: int
    shared_memory: str  # the vendor's word for it, for messages


EMULATED_ARCHS = {
    "gfx90a": EmulatedArch("gfx90a", ("-DHIPATTN_EMULATION",), 64 * 1024, "LDS per workgroup"),
    # gfx950 (CDNA4): the MFMA kernels take its 16x16x32 instructions; 160 KiB of LDS per workgroup.
    "gfx950": EmulatedArch("gfx950", ("-DHIPATTN_EMULATION", "-DHIPATTN_EMULATED_GFX950"), 160 * 1024,
                           "LDS per workgroup"),
    # sm_80's opt-in maximum of dynamic shared memory per block (A100): 163 KiB.
    "sm_80": EmulatedArch("sm_80", ("-DHIPATTN_EMULATION", "-DHIPATTN_EMULATED_NVIDIA"), 163 * 1024,
                          "shared memory per block"),
}
EMULATED_ARCH = "gfx90a"  # the default device

# Appended to a compile unit: the kernel named by NAME, run over a grid by the emulated device, and
# the reason of a launch that failed.
_DRIVER = """
namespace {
template <typename F> struct KernelArgument;
template <typename P> struct KernelArgument<void (*)(P)> { typedef P type; };
typedef KernelArgument<decltype(&NAME)>::type Argument;
void hipattn_emulated_body(const void* params) {
  NAME(*static_cast<const Argument*>(params));
}
}  // namespace
extern "C" int hipattn_emulated_launch(unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                                       unsigned int by, unsigned int bz, unsigned int shared_bytes,
                                       const void* params) {
  return hipattn_emulation::launch({gx, gy, gz}, {bx, by, bz}, shared_bytes, hipattn_emulated_body, params);
}
extern "C" const char* hipattn_emulated_error() { return hipattn_emulation::block().error.c_str(); }
"""


# `extern __shared__ [__align__(N)] TYPE NAME[];`, a kernel's dynamic shared memory.
_DYNAMIC_SHARED = re.compile(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([\w:\s]+?)\s+(\w+)\[\];")


def _dynamic_shared_as_buffer(text: str) -> str:
    """Point each kernel's dynamic shared array at the emulated block's buffer (hipattn::shared_bytes)."""
    return _DYNAMIC_SHARED.sub(r"\1* const \2 = reinterpret_cast<\1*>(::hipattn::shared_bytes);", text)


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


# CI installs g++ (.ci/run) and must run the emulated kernels; elsewhere they need it on PATH (or CXX).
needs_compiler = pytest.mark.skipif(compiler() is None and not os.environ.get("CI"),
                                    reason="needs g++ (CXX) to build the emulated kernels")

# The switches that steer dispatch: an emulated device starts from their defaults, so that what a test
# runs does not depend on the environment it was started from (a test sets one itself to force a path).
DISPATCH_SWITCHES = (dispatch.SMALLSEQ_SWITCH, smallseq.KERNEL_SWITCH, varlen_prep.PREP_SWITCH)


class EmulatedLaunchError(RuntimeError):
    pass


class _EmulatedFunction(NamedTuple):
    """A loaded kernel library's two entry points: the launch (its result: 0, 1 for a deadlock, 2 for
    another error) and the reason of the last failed launch."""

    launch: Callable[..., int]
    error: Callable[[], bytes]


class EmulationBackend(Backend):
    """A GPU made of the CPU (``arch``: gfx90a or sm_80): compiles with g++, launches on host memory,
    in call order."""

    name = "emulation"

    def __init__(self, build_dir: str, arch: str = EMULATED_ARCH):
        self.build_dir = build_dir
        self.emulated = EMULATED_ARCHS[arch]
        self.target = Target.parse(arch)
        self.vendor = self.target.vendor
        self.launches = 0
        self._identity: str | None = None

    def compiler_identity(self) -> str:
        # Asked for every kernel's cache key: run the compiler and hash the runtime once.
        if self._identity is None:
            version = subprocess.run([compiler(), "--version"], capture_output=True, text=True, check=True)
            runtime = hashlib.sha256()
            for path in sorted(RUNTIME_DIR.glob("*.h")):
                runtime.update(path.name.encode() + b"\0" + path.read_bytes())
            self._identity = f"{version.stdout.splitlines()[0]} emulation {runtime.hexdigest()[:16]}"
        return self._identity

    def compile_options(self, target: Target) -> tuple[str, ...]:
        return ("-std=c++17", "-O1", "-fPIC", "-shared", *EMULATED_ARCHS[target.arch].defines, "-Wno-unknown-pragmas",
                "-Wno-ignored-attributes")

    def compile(self, source, headers, name_expression, target, options, spec_text) -> CompiledKernel:
        work = Path(tempfile.mkdtemp(dir=self.build_dir))
        for name, text in headers.items():
            path = work / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(_dynamic_shared_as_buffer(text))
        unit = work / "unit.cpp"
        unit.write_text(_dynamic_shared_as_buffer(source) + _DRIVER.replace("NAME", name_expression))
        library = work / "kernel.so"
        command = [compiler(), *options, "-include", str(RUNTIME_HEADER), f"-I{work}", str(unit), "-o", str(library)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise CompileError(spec_text, target.arch, options, done.stderr[-4000:])
        return CompiledKernel(binary=library.read_bytes(), lowered_name="hipattn_emulated_launch", log=done.stderr)

    def device_count(self) -> int:
        return 1

    def device_target(self, device: int) -> Target:
        return self.target

    def device_name(self, device: int) -> str:
        return f"emulated {self.target.arch}"

    def get_device(self) -> int:
        return 0

    def set_device(self, device: int) -> None:
        pass

    def load_function(self, binary: bytes, lowered_name: str) -> _EmulatedFunction:
        path = Path(tempfile.mkdtemp(dir=self.build_dir)) / "kernel.so"
        path.write_bytes(binary)
        library = ctypes.CDLL(str(path))
        launch = getattr(library, lowered_name)
        launch.restype = ctypes.c_int
        launch.argtypes = [ctypes.c_uint] * 7 + [ctypes.c_void_p]
        error = library.hipattn_emulated_error
        error.restype = ctypes.c_char_p
        return _EmulatedFunction(launch, error)

    def set_max_dynamic_shared_memory(self, function, nbytes: int) -> None:
        limit = self.emulated.shared_bytes_per_block
        if nbytes > limit:
            raise ValueError(f"{nbytes} bytes of shared memory requested; the emulated {self.target.arch} has "
                             f"{limit // 1024} KiB of {self.emulated.shared_memory}")

    def launch(self, function: _EmulatedFunction, grid, block, shared_bytes, stream, params) -> None:
        self.launches += 1
        result = function.launch(*grid, *block, shared_bytes, ctypes.addressof(params))
        if result == 1:
            raise EmulatedLaunchError("deadlock: threads of a block wait at a barrier the others never reach")
        if result:
            raise EmulatedLaunchError(function.error().decode())

    # Memory operations run at once: host memory, one stream, calls in order.
    def memset_async(self, ptr, byte_value, nbytes, stream) -> None:
        ctypes.memset(ptr, byte_value, nbytes)

    def memcpy_async(self, dst, src, nbytes, stream) -> None:
        ctypes.memmove(dst, src, nbytes)

    def stream_synchronize(self, stream) -> None:
        pass

    def stream_is_capturing(self, stream) -> bool:
        return False


def _unsupported(self, *args, **kwargs):
    raise AssertionError("the emulated device has no allocator, host functions, streams or events")


for _name in sorted(EmulationBackend.__abstractmethods__):
    setattr(EmulationBackend, _name, _unsupported)
EmulationBackend.__abstractmethods__ = frozenset()


class _RecordingRuntime(runtime.Runtime):
    """The emulated device's runtime, which also records the family of every kernel asked for."""

    __slots__ = ("kernels",)

    def __init__(self, backend: Backend, registry: Registry):
        super().__init__(backend, registry=registry)
        self.kernels: list[str] = []

    def kernel(self, spec, device):
        self.kernels.append(spec.family.name)
        return super().kernel(spec, device)


class EmulatedDevice:
    """The emulation backend and a registry over it, installed as the active runtime for the test
    (monkeypatch restores the previous one), with the DISPATCH_SWITCHES unset."""

    def __init__(self, build_dir, cache_dir, monkeypatch: pytest.MonkeyPatch, arch: str = EMULATED_ARCH):
        for switch in DISPATCH_SWITCHES:
            monkeypatch.delenv(switch, raising=False)
        self.backend = EmulationBackend(str(build_dir), arch)
        self.registry = Registry(self.backend, DiskCache(str(cache_dir)))
        self.runtime = _RecordingRuntime(self.backend, self.registry)
        monkeypatch.setattr(runtime, "_active", self.runtime)

    @property
    def kernels(self) -> list[str]:
        """The family of every kernel the launch path asked for, in order."""
        return self.runtime.kernels

    @staticmethod
    def array(values: np.ndarray):
        """A raw hipattn array over ``values``' memory (kept alive by the caller)."""
        dtype = {np.dtype(np.float32): "fp32", np.dtype(np.int32): "int32", np.dtype(np.uint8): "uint8",
                 np.dtype(np.int64): "int64"}.get(values.dtype)
        if dtype is None:
            raise TypeError(f"use to_16bit() for {values.dtype}")
        return raw_array(values.ctypes.data, values.shape, dtype, 0,
                         tuple(s // values.itemsize for s in values.strides))


def to_16bit(values: np.ndarray, dtype: str) -> np.ndarray:
    """float values rounded to bf16 or fp16 (nearest even), as uint16 bit patterns."""
    if dtype == "fp16":
        return values.astype(np.float16).view(np.uint16)
    bits = values.astype(np.float32).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).astype(np.uint16)


def from_16bit(bits: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "fp16":
        return bits.view(np.float16).astype(np.float64)
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def array_16bit(bits: np.ndarray, dtype: str):
    """A raw hipattn array of ``dtype`` over uint16 bit patterns."""
    return raw_array(bits.ctypes.data, bits.shape, dtype, 0, tuple(s // 2 for s in bits.strides))


def aligned_bytes(nbytes: int, alignment: int = 256) -> np.ndarray:
    """Zeroed host bytes starting at a multiple of ``alignment`` (hipattn's workspace alignment)."""
    raw = np.zeros(nbytes + alignment, dtype=np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start:start + nbytes]
