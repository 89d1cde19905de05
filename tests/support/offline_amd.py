"""hipattn's AMD kernels compiled by Debian's clang for processors Debian's hiprtc (ROCm 5.2) does not
know: gfx942 with clang-19, gfx950 with clang-22. No GPU, no newer ROCm.

What hiprtc does, done by hand: the compile unit is ``compile_unit(family)`` plus the line hiprtc
appends for a name expression (``extern "C" constexpr auto __hiprtc_N = <expression>;``, which
instantiates the kernel); clang compiles it device-only to an HSA code object with hiprtc 5.2's own
runtime header (the ``.hipRTC_header`` section of ``libamdhip64.so.5``: the HIP device names, no
include path needed) and Debian's device-library bitcode (rocm-device-libs). Those libraries predate
gfx942 and gfx950 only in their ISA-version constant, so a copy of gfx940's with the target's number
stands in. LLVM 22 no longer defines ``__AMDGCN_WAVEFRONT_SIZE`` (hiprtc 5.2's header defines its
``warpSize`` from it; hipattn's kernels read the processor family instead) nor links ``hip.bc`` and
``oclc_daz_opt_off.bc`` by default, so those are given explicitly there.

A missing clang, LLVM tool, hiprtc library or bitcode is a pytest skip naming it.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from hipattn.jit.sources import compile_unit
from hipattn.jit.spec import KernelSpec
from support import amdgpu_metadata

BITCODE_DIR = Path("/usr/lib/x86_64-linux-gnu/amdgcn/bitcode")
HIPRTC_LIBRARY = Path("/usr/lib/x86_64-linux-gnu/libamdhip64.so.5")

# The LLVM release whose clang compiles each target: Debian 12's clang-19 knows gfx942, not gfx950.
LLVM_FOR = {"gfx942": 19, "gfx950": 22}
# The ISA-version bitcode each target's copy is made from.
_ISA_TEMPLATE = "gfx940"
# What LLVM 22 stopped doing on its own, which hiprtc 5.2's runtime header still expects.
_LLVM22_DEFINES = ("-D__AMDGCN_WAVEFRONT_SIZE=64",)
_LLVM22_LINKS = ("hip.bc", "oclc_daz_opt_off.bc")

_ISA_CONSTANT = re.compile(r"(@__oclc_ISA_version = [^\n]* i32 )(\d+)")


class OfflineCompileError(RuntimeError):
    """clang rejected a compile unit; the message holds its command and diagnostics."""


@dataclass(frozen=True)
class Toolchain:
    """Everything one target's compiles need: clang, and a folder holding the device libraries (with
    the target's ISA-version copy) and hiprtc's runtime header."""

    arch: str
    clang: str
    demangler: str
    disassembler: str
    library_dir: Path
    runtime_header: Path

    def options(self) -> tuple[str, ...]:
        options = ["-x", "hip", f"--offload-arch={self.arch}", "--cuda-device-only", "--no-gpu-bundle-output",
                   "-nogpuinc", "-mcode-object-version=5", "-D__HIPCC_RTC__", "-include", str(self.runtime_header),
                   f"--rocm-device-lib-path={self.library_dir}", "-O3", "-std=c++17"]  # hiprtc's -O3 -std=c++17
        if LLVM_FOR[self.arch] >= 22:
            options += _LLVM22_DEFINES
            for library in _LLVM22_LINKS:
                options += ["-Xclang", "-mlink-builtin-bitcode", "-Xclang", str(self.library_dir / library)]
        return tuple(options)


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (.ci/run installs it)")
    return path


def toolchain(arch: str, work_dir: Path) -> Toolchain:
    """The toolchain for ``arch`` ("gfx942" or "gfx950"), set up under ``work_dir``, or a skip."""
    version = LLVM_FOR[arch]
    clang, demangler, disassembler, llvm_dis, llvm_as = (
        _tool(f"{tool}-{version}") for tool in ("clang", "llvm-cxxfilt", "llvm-objdump", "llvm-dis", "llvm-as"))
    template = BITCODE_DIR / f"oclc_isa_version_{_ISA_TEMPLATE[3:]}.bc"
    if not template.is_file():
        pytest.skip(f"ROCm device libraries are missing ({template}; Debian's rocm-device-libs has them)")
    if not HIPRTC_LIBRARY.is_file():
        pytest.skip(f"{HIPRTC_LIBRARY} is missing (Debian's libamdhip64-5): its hiprtc header is the runtime's")

    library_dir = work_dir / f"bitcode-{arch}"
    library_dir.mkdir(parents=True, exist_ok=True)
    for bitcode in BITCODE_DIR.glob("*.bc"):
        (library_dir / bitcode.name).unlink(missing_ok=True)
        (library_dir / bitcode.name).symlink_to(bitcode)
    _write_isa_version(llvm_dis, llvm_as, template, library_dir / f"oclc_isa_version_{arch[3:]}.bc", arch)
    runtime_header = work_dir / "hiprtc_runtime.h"
    runtime_header.write_bytes(hiprtc_runtime_header(HIPRTC_LIBRARY.read_bytes()))
    return Toolchain(arch, clang, demangler, disassembler, library_dir, runtime_header)


def isa_version(arch: str) -> int:
    """The device libraries' ``__oclc_ISA_version`` of ``arch``: major * 1000 + minor * 100 + stepping
    (gfx90a: 9010, gfx942: 9402, gfx1030: 10300; minor and stepping are hex digits)."""
    digits = arch[3:]
    return int(digits[:-2]) * 1000 + int(digits[-2], 16) * 100 + int(digits[-1], 16)


def _write_isa_version(llvm_dis: str, llvm_as: str, template: Path, output: Path, arch: str) -> None:
    text = subprocess.run([llvm_dis, str(template), "-o", "-"], check=True, capture_output=True, text=True).stdout
    was = isa_version(_ISA_TEMPLATE)
    if [int(match.group(2)) for match in _ISA_CONSTANT.finditer(text)] != [was]:
        raise ValueError(f"{template} does not define __oclc_ISA_version as {was} once")
    text = _ISA_CONSTANT.sub(lambda match: f"{match.group(1)}{isa_version(arch)}", text)
    subprocess.run([llvm_as, "-", "-o", str(output)], input=text, check=True, capture_output=True, text=True)


def hiprtc_runtime_header(library: bytes) -> bytes:
    """The preprocessed runtime header hiprtc compiles every program with: ``library``'s (an ELF64
    shared object's) ``.hipRTC_header`` section, whose last 4 bytes are the header's length."""
    for name, _, data in amdgpu_metadata.elf_sections(library):
        if name == b".hipRTC_header":
            (length,) = struct.unpack_from("<I", data, len(data) - 4)
            if length > len(data) - 4:
                raise ValueError(f".hipRTC_header says {length} bytes of its {len(data)}")
            return data[:length]
    raise ValueError("the library has no .hipRTC_header section")


def unit_source(spec: KernelSpec) -> tuple[str, dict[str, str]]:
    """(source, headers) as hiprtc compiles ``spec``: the family's unit and the line hiprtc appends for
    its name expression."""
    source, headers = compile_unit(spec.family)
    return source + f'extern "C" constexpr auto __hiprtc_0 = {spec.name_expression()};\n', headers


def compile_spec(tools: Toolchain, spec: KernelSpec) -> bytes:
    """``spec``'s code object for ``tools.arch`` (an ELF64 AMDGPU HSA code object); OfflineCompileError
    with clang's diagnostics when it fails."""
    source, headers = unit_source(spec)
    with tempfile.TemporaryDirectory(prefix="hipattn-offline-") as folder:
        root = Path(folder)
        for name, text in headers.items():  # include names are relative to kernels/, as hiprtc gets them
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(text)
        (root / "unit.hip").write_text(source)
        command = [tools.clang, *tools.options(), f"-I{root}", str(root / "unit.hip"), "-o", str(root / "unit.co")]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise OfflineCompileError(f"{spec} for {tools.arch}: {' '.join(command)}\n{done.stderr[-6000:]}")
        return (root / "unit.co").read_bytes()


def instructions(tools: Toolchain, binary: bytes) -> list[str]:
    """The mnemonics of a code object's instructions, in order (llvm-objdump's disassembly)."""
    with tempfile.NamedTemporaryFile(suffix=".co") as code_object:
        code_object.write(binary)
        code_object.flush()
        done = subprocess.run([tools.disassembler, "-d", f"--mcpu={tools.arch}", code_object.name], check=True,
                              capture_output=True, text=True)
    return [line.split()[0] for line in done.stdout.splitlines() if line.startswith("\t") and line.split()]


def demangled(tools: Toolchain, names: list[str]) -> list[str]:
    """``names`` (kernel symbols) as C++ declarations: ``void hipattn::f<...>(hipattn::Params)``."""
    done = subprocess.run([tools.demangler], input="\n".join(names), check=True, capture_output=True, text=True)
    return done.stdout.splitlines()
