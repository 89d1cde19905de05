"""Every kernel instantiation hipattn ships for gfx942 compiles with clang-19, and for gfx950 with
clang-22 (tests/support/offline_amd.py: hiprtc's compile by hand, for the targets Debian's ROCm 5.2
hiprtc refuses), and each code object's metadata holds: the kernel under its name expression, no
VGPR spills or scratch (SGPR spills land in VGPR lanes, which costs no memory), the registers per
lane that the kernel's launch bounds leave it, and LDS (static and the launcher's dynamic bytes)
within the target's. The MFMA kernels use gfx950's 16x16x32
instructions there, and only there.

gfx90a's are checked through hiprtc itself (tests/test_compile_shipped.py, tests/test_smallseq_mfma_tiles.py).
Nothing here has run on AMD hardware.
"""

from __future__ import annotations

import functools
import logging
from concurrent.futures import ThreadPoolExecutor

import pytest
from support import amdgpu_metadata, offline_amd
from support.compilers import compile_family, hiprtc_for

from hipattn.catalog import flash_backward, flash_forward, shipped_specs, smallseq
from hipattn.catalog.targets import AMD_LDS_BYTES
from hipattn.jit.spec import KernelSpec
from hipattn.jit.target import Target

# LDS per workgroup: gfx942's as gfx90a's; gfx950 (CDNA4) has 160 KiB.
LDS_BYTES = {"gfx942": AMD_LDS_BYTES, "gfx950": 160 * 1024}

# Families whose kernels may use scratch, and why: the one place a spill is admitted. The portable
# small-seq backward holds a lane's elements of every row of its tile's Q, K, V, dO, dK and dV in
# registers, more than a lane has (it spills on gfx90a too); MFMA targets run the MFMA rows unless a
# caller forces the portable ones.
SCRATCH_ADMITTED = {"smallseq_backward"}

# gfx950's 16x16x32 MFMA, by its mnemonic's stem (f16 and bf16 forms).
WIDE_MFMA = "v_mfma_f32_16x16x32"

# clang runs as a subprocess per spec, so threads keep both CI cores busy.
_WORKERS = 2


def registers_per_lane(max_threads: int) -> int:
    """The VGPRs and AGPRs one lane may hold when a workgroup of ``max_threads`` (its launch bounds)
    must fit on one compute unit: CDNA's 512 registers per SIMD lane, shared by the waves that land on
    each of its four SIMDs."""
    waves = -(-max_threads // 64)
    return 512 // -(-waves // 4)


def dynamic_shared_bytes(spec: KernelSpec, target: Target) -> int:
    """The most dynamic LDS a launch of ``spec`` asks for on ``target``: its tile row's bytes (for the
    portable small-seq backward, a grouped call's, which adds the group's dK/dV sums)."""
    name = spec.family.name
    if name in ("bwd_convert_dq", "bwd_dot_do_o", "varlen_records", "decode_forward", "decode_forward_mfma",
                "decode_combine", "decode_append"):
        return 0  # static tiles only; the launchers pass 0
    head_dim = spec.arg("head_dim")
    if name == "flash_forward_mfma":
        return flash_forward.tiles_for(head_dim, target).shared_bytes(head_dim)
    if name in ("flash_backward_dkdv_mfma", "flash_backward_dq_mfma"):
        dkdv, dq = flash_backward.tiles_for(head_dim, target)
        return (dkdv if "dkdv" in name else dq).shared_bytes(head_dim)
    rows = {"smallseq_forward": smallseq.forward_tiles, "smallseq_forward_mfma": smallseq.forward_tiles,
            "smallseq_backward": smallseq.backward_tiles, "smallseq_backward_mfma": smallseq.backward_tiles}[name]
    row = rows(head_dim, target, group=2, portable=not name.endswith("_mfma"))
    assert row.family is spec.family, f"{spec}: the launcher's row is of {row.family.name}"
    return row.shared_bytes(head_dim, group=2)


@pytest.mark.parametrize("arch", sorted(offline_amd.LLVM_FOR))
def test_every_shipped_instantiation_compiles_offline(arch, tmp_path):
    tools = offline_amd.toolchain(arch, tmp_path)
    target = Target.parse(arch)
    specs = shipped_specs(target)
    with ThreadPoolExecutor(_WORKERS) as pool:
        binaries = dict(zip(specs, pool.map(functools.partial(offline_amd.compile_spec, tools), specs), strict=True))
    assert binaries, f"no shipped specs for {arch}"
    findings, problems = [], []
    for spec, binary in binaries.items():
        (kernel,) = amdgpu_metadata.kernels(binary)
        (declaration,) = offline_amd.demangled(tools, [kernel[".name"]])
        if not declaration.startswith(f"void {spec.name_expression()}("):
            problems.append(f"{spec}: the kernel is {declaration}")
        usage = {name: kernel[f".{name}"] for name in ("vgpr_count", "agpr_count", "sgpr_count", "vgpr_spill_count",
                                                       "sgpr_spill_count", "private_segment_fixed_size",
                                                       "group_segment_fixed_size", "max_flat_workgroup_size")}
        findings.append(f"{spec}: {usage}")
        # SGPR spills go to VGPR lanes, not memory; VGPR spills and scratch go to memory.
        if spec.family.name not in SCRATCH_ADMITTED and (usage["vgpr_spill_count"] or usage["private_segment_fixed_size"]):
            problems.append(f"{spec} uses scratch: {usage}")
        # On gfx90a and later .vgpr_count counts the unified file: architectural VGPRs and AGPRs.
        budget = registers_per_lane(usage["max_flat_workgroup_size"])
        if usage["vgpr_count"] > budget:
            problems.append(f"{spec} holds more registers per lane than its launch bounds leave ({budget}): {usage}")
        lds = usage["group_segment_fixed_size"] + dynamic_shared_bytes(spec, target)
        if lds > LDS_BYTES[arch]:
            problems.append(f"{spec} needs {lds} bytes of LDS of {LDS_BYTES[arch]}: {usage}")
        if spec.family.name.endswith("_mfma"):
            # gfx950 contracts head_dim with its 16x16x32 MFMA (mma_amd.h mfma_two_steps); gfx942 has none.
            wide = sum(name.startswith(WIDE_MFMA) for name in offline_amd.instructions(tools, binary))
            if (wide > 0) != (arch == "gfx950"):
                problems.append(f"{spec}: {wide} {WIDE_MFMA} instructions on {arch}")
    # Each kernel's registers, scratch and LDS, for a reader comparing targets (pytest --log-cli-level=INFO).
    logging.getLogger(__name__).info("%s\n%s", arch, "\n".join(findings))
    assert not problems, f"{arch}:\n" + "\n".join(problems)


def test_kernel_names_match_hiprtcs_lowered_names(tmp_path):
    """One spec of each family: the symbol clang's code object defines is the lowered name hiprtc
    reports for the same unit (hiprtc for gfx90a; the mangling does not depend on the target)."""
    backend, gfx90a = hiprtc_for("gfx90a")
    tools = offline_amd.toolchain("gfx942", tmp_path)
    firsts = {}
    for spec in shipped_specs(Target.parse("gfx942")):
        firsts.setdefault(spec.family.name, spec)
    for spec in (firsts["varlen_records"], firsts["smallseq_forward_mfma"]):
        lowered = compile_family(backend, spec.family, gfx90a, spec).lowered_name
        (kernel,) = amdgpu_metadata.kernels(offline_amd.compile_spec(tools, spec))
        assert kernel[".name"] == lowered, spec
