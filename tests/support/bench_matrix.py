"""tools/matrix/ (the package behind tools/bench_matrix.py), imported by file path for the tests.

tools/ is no package and is not on sys.path: the package is loaded from its folder under a name of
its own, so its relative imports work and nothing else on sys.path changes.
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import sys

TOOLS = pathlib.Path(__file__).resolve().parent.parent.parent / "tools"
PACKAGE = "hipattn_tools_matrix"


def load(module: str):
    """tools/matrix/<module>.py as PACKAGE.<module>."""
    if PACKAGE not in sys.modules:
        folder = TOOLS / "matrix"
        spec = importlib.util.spec_from_file_location(PACKAGE, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        package = importlib.util.module_from_spec(spec)
        sys.modules[PACKAGE] = package
        spec.loader.exec_module(package)
    return importlib.import_module(f"{PACKAGE}.{module}")
