"""Every kernel family hipattn ships, and the instantiations it ships for each target.

This is the one table `hipattn warm` and the CI compile tests walk. The launch code of each family
lives in hipattn/ops/; the C++ templates in kernels/.
"""

from __future__ import annotations

from .spec import KernelFamily, KernelSpec
from .target import Target

FAMILIES: dict[str, KernelFamily] = {}


def _register(family: KernelFamily) -> KernelFamily:
    if family.name in FAMILIES:
        raise ValueError(f"kernel family {family.name!r} is defined twice")
    FAMILIES[family.name] = family
    return family


def family(name: str) -> KernelFamily:
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown kernel family {name!r}; known: {sorted(FAMILIES)}") from None


def shipped_specs(target: Target) -> list[KernelSpec]:
    """All instantiations hipattn ships for ``target``, in a stable order."""
    return [spec for name in sorted(FAMILIES) for spec in FAMILIES[name].shipped(target)]
