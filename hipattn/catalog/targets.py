"""Which GPUs run which kernels, and the limits a launch must respect there.

Each predicate answers for a ``jit.target.Target`` (None, a device whose target is unknown, runs
nothing), so the catalog's tables and the launchers ask the same question the same way.
"""

from __future__ import annotations

from ..jit.target import AMD, NVIDIA, Target

# The only target with wgmma: the arch-specific variant of compute capability 9.0 (H100, H200, GH200).
# The CUDA backend reports every 9.0 device as sm_90a, so these kernels, and every other one, are
# built for it there.
WGMMA_ARCH = "sm_90a"

# The processors whose MFMA 16x16x16 f16 and bf16_1k instructions kernels/common/mma_amd.h uses (its
# #error guard names the same list). gfx908 lacks the bf16_1k form. gfx950 keeps both (CI compiles
# its kernels with clang-22, tests/test_compile_offline_amd.py).
AMD_MFMA_ARCHS = ("gfx90a", "gfx940", "gfx941", "gfx942", "gfx950")

# Dynamic shared memory a block may opt in to: Hopper (sm_90, sm_90a); sm_86/sm_89's limit, which
# every row of the sm_80+ tables fits; gfx90a's and gfx94x's LDS per workgroup (gfx950 has 160 KiB;
# hipattn's rows are sized for 64).
HOPPER_SHARED_BYTES = 227 * 1024
SM86_SHARED_BYTES = 99 * 1024
AMD_LDS_BYTES = 64 * 1024

# grid.x is at most 2^31 - 1 blocks on every sm_80+ part. HIP counts the grid in work-items, in 32
# bits: blocks x threads per block must stay below 2^32.
MAX_GRID_X = 2**31 - 1
MAX_AMD_WORK_ITEMS = 2**32 - 1


def runs_nvidia_mma(target: Target | None) -> bool:
    """Whether ``target`` runs the mma.sync m16n8k16 kernels: NVIDIA sm_80 and newer."""
    return target is not None and target.vendor == NVIDIA and target.compute_capability >= 80


def runs_nvidia_wgmma(target: Target | None) -> bool:
    """Whether ``target`` runs the wgmma kernels: NVIDIA sm_90a."""
    return target is not None and target.arch == WGMMA_ARCH


def has_hopper_shared_memory(target: Target | None) -> bool:
    """Whether ``target`` is an NVIDIA sm_90 part (227 KiB of opt-in shared memory per block)."""
    return target is not None and target.vendor == NVIDIA and target.compute_capability == 90


def runs_amd_mfma(target: Target | None) -> bool:
    """Whether ``target`` runs the MFMA 16x16x16 kernels: AMD gfx90a, gfx94x and gfx950, any target features."""
    return target is not None and target.base_arch in AMD_MFMA_ARCHS


def max_blocks(target: Target, threads: int) -> int:
    """The most blocks of ``threads`` threads one launch's grid.x may hold on ``target``."""
    if target.vendor == AMD:
        return min(MAX_GRID_X, MAX_AMD_WORK_ITEMS // threads)
    return MAX_GRID_X


def check_grid(target: Target, blocks: int, threads: int, what: str) -> None:
    """ValueError, before anything is enqueued, when ``blocks`` of ``what`` exceed the grid's limit."""
    limit = max_blocks(target, threads)
    if blocks > limit:
        raise ValueError(f"the call needs {blocks} {what}; one launch takes at most {limit}: split the batch")
