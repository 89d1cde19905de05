"""The compile target: one frozen description of the GPU a binary is built for."""

from __future__ import annotations

import re
from dataclasses import dataclass

AMD = "amd"
NVIDIA = "nvidia"

_NVIDIA_ARCH = re.compile(r"^sm_(\d+)([a-z]?)$")
_AMD_ARCH = re.compile(r"^gfx([0-9a-f]+)((?::[a-z0-9_-]+[+-])*)$")


@dataclass(frozen=True)
class Target:
    """A GPU architecture a kernel is compiled for.

    ``arch`` is the full compiler spelling (``sm_90a``, ``gfx90a:xnack-``): target features change
    the binary, so they are part of the name, the cache key and the compile options.
    """

    vendor: str
    arch: str
    warp_size: int

    @classmethod
    def parse(cls, arch: str) -> Target:
        """``Target.parse("gfx942")``, ``Target.parse("sm_90a")``; raises ValueError for anything else."""
        arch = arch.strip()
        if _NVIDIA_ARCH.match(arch):
            return cls(NVIDIA, arch, 32)
        match = _AMD_ARCH.match(arch)
        if match:
            return cls(AMD, arch, _amd_wave_size(match.group(1)))
        raise ValueError(
            f"unknown GPU architecture {arch!r}; expected an NVIDIA 'sm_NN' (e.g. sm_90, sm_90a) "
            "or an AMD 'gfxNNN' name with optional features (e.g. gfx90a, gfx942:xnack-)"
        )

    @property
    def base_arch(self) -> str:
        """The processor name without target features (``gfx90a`` for ``gfx90a:xnack-``)."""
        return self.arch.split(":", 1)[0]

    @property
    def compute_capability(self) -> int:
        """NVIDIA only: 90 for sm_90 and sm_90a."""
        if self.vendor != NVIDIA:
            raise ValueError(f"{self.arch} is not an NVIDIA target")
        return int(_NVIDIA_ARCH.match(self.arch).group(1))

    def __str__(self) -> str:
        return self.arch


def _amd_wave_size(processor: str) -> int:
    # GCN and CDNA (three-digit names: gfx803, gfx90a, gfx942) run 64-wide wavefronts; RDNA
    # (gfx1030, gfx1100: four digits) compiles wave32 by default,
    # which is also what hiprtc picks. The kernels derive the same fact from the compiler's processor
    # family macros (kernels/common/platform.h), so host and device agree.
    return 64 if len(processor) == 3 else 32
