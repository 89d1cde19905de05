"""The index of every kernel family hipattn ships: what `hipattn warm` and the CI compile tests walk.

Each kernel group's module registers its families here as it is imported (``hipattn.catalog``
imports them all), so the index is complete whenever the catalog is.
"""

from __future__ import annotations

from ..jit.spec import KernelFamily, KernelSpec
from ..jit.target import Target

FAMILIES: dict[str, KernelFamily] = {}


def register(family: KernelFamily) -> KernelFamily:
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


def spec_from_canonical(text: str) -> KernelSpec:
    """The spec of one of the catalog's families that ``KernelSpec.canonical()`` wrote."""
    return KernelSpec.from_canonical(text, FAMILIES)
