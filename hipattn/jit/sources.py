"""Kernel sources: where they live, and the compile unit for one instantiation.

The compile unit is tiny: the platform header, the generated structs (the family's further
``structs``, then its parameter struct, each with a size check), and an include of the family's
source. Every file it reaches through ``#include "..."`` is handed to the compiler as an in-memory
header (neither hiprtc nor NVRTC searches directories by default), and the same texts
feed the cache key, so a change to any included header changes the key.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from .spec import KernelFamily

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


@functools.cache
def kernels_dir() -> Path:
    """The kernel sources: inside the installed package (wheel), else beside it (source checkout)."""
    package = Path(__file__).resolve().parent.parent  # hipattn/, above this jit/ package
    for candidate in (package / "kernels", package.parent / "kernels"):
        if (candidate / "common" / "platform.h").is_file():
            return candidate
    raise FileNotFoundError(
        f"hipattn's kernel sources are missing (looked in {package / 'kernels'} and {package.parent / 'kernels'}); "
        "reinstall hipattn"
    )


@functools.cache
def _read(relative: str) -> str:
    path = kernels_dir() / relative
    try:
        return path.read_text()
    except FileNotFoundError:
        raise FileNotFoundError(f"kernel source {relative!r} not found under {kernels_dir()}") from None


def compile_unit(family: KernelFamily) -> tuple[str, dict[str, str]]:
    """(source, headers) for one family: headers maps each include name to its text."""
    source = (
        f"// hipattn compile unit for kernel family {family.name}\n"
        '#include "common/platform.h"\n'
        "namespace hipattn {\n"
        + "".join(s.cpp_checked_declaration() for s in family.structs)
        + family.params.cpp_checked_declaration()
        + "}  // namespace hipattn\n"
        f'#include "{family.source}"\n'
    )
    return source, include_closure(source)


def include_closure(source: str) -> dict[str, str]:
    """Every kernels/ file reachable from ``source`` through quoted includes, by include name.

    Include names are relative to kernels/ (``common/types.h``), in every file, so one flat table
    serves both compilers.
    """
    headers: dict[str, str] = {}
    pending = _INCLUDE.findall(source)
    while pending:
        name = pending.pop()
        if name in headers:
            continue
        headers[name] = _read(name)
        pending.extend(_INCLUDE.findall(headers[name]))
    return dict(sorted(headers.items()))
