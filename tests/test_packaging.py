"""The wheel: it carries every module and kernel source hipattn needs, and an installed copy finds them.

The build runs on a copy of the checkout: building in place would leave build/ and *.egg-info in
the repository, and a stale build/lib can carry a module into the wheel that the package list
leaves out, hiding exactly what this test is here to catch.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from hipattn.catalog import FAMILIES

REPO = Path(__file__).resolve().parent.parent
# Build products, caches and VCS data: nothing a wheel is built from.
_NOT_SOURCES = shutil.ignore_patterns(
    ".git",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    "*.pyc",
    ".venv",
    ".pytest_cache",
    ".ruff_cache",
    ".whl",
)


def _pip(*args: str, cwd: Path) -> None:
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", *args]
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}"


def _setuptools_builds_here() -> bool:
    """Whether this environment can build the wheel without fetching pyproject's build requirements."""
    # Read the installed version without importing setuptools (its distutils hook must not load here).
    try:
        installed = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return False
    version = tuple(int(part) for part in re.findall(r"\d+", installed)[:2])
    if version >= (70, 1):  # bdist_wheel is built into setuptools from 70.1
        return True
    return version >= (68, 0) and importlib.util.find_spec("wheel") is not None


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    if importlib.util.find_spec("pip") is None:
        pytest.skip("pip is not installed in this environment")
    work = tmp_path_factory.mktemp("packaging")
    source = work / "source"
    shutil.copytree(REPO, source, ignore=_NOT_SOURCES)
    out = work / "wheelhouse"
    # Offline when the environment has the build backend; otherwise pip fetches it from PyPI.
    isolation = ["--no-build-isolation"] if _setuptools_builds_here() else []
    _pip("wheel", ".", "--no-deps", *isolation, "-q", "-w", str(out), cwd=source)
    wheels = list(out.glob("hipattn-*.whl"))
    assert len(wheels) == 1, f"expected one hipattn wheel in {out}, found {[w.name for w in wheels]}"
    return wheels[0]


@pytest.fixture(scope="module")
def wheel_files(wheel) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


def test_wheel_carries_the_platform_headers_and_every_family_source(wheel_files):
    expected = {"hipattn/kernels/common/platform.h", "hipattn/kernels/common/types.h"}
    expected |= {f"hipattn/kernels/{family.source}" for family in FAMILIES.values()}
    missing = sorted(expected - wheel_files)
    assert not missing, f"the wheel lacks kernel sources {missing}"


def test_wheel_carries_every_module_of_the_package(wheel_files):
    modules = {path.relative_to(REPO).as_posix() for path in (REPO / "hipattn").rglob("*.py")}
    missing = sorted(modules - wheel_files)
    assert not missing, f"the wheel lacks modules {missing} (is their package in pyproject's packages list?)"


def test_wheel_declares_the_console_script(wheel, wheel_files):
    entry_points = next(name for name in wheel_files if name.endswith(".dist-info/entry_points.txt"))
    with zipfile.ZipFile(wheel) as archive:
        text = archive.read(entry_points).decode()
    assert re.search(r"^hipattn\s*=\s*hipattn\.cli:main\s*$", text, re.MULTILINE), text


_INSTALLED_CHECK = """
import json
import hipattn
from hipattn.catalog import FAMILIES
from hipattn.jit import sources

kernels = sources.kernels_dir()
# Every family's compile unit resolves its whole include closure from the installed files.
headers = sorted({name for f in FAMILIES.values() for name in sources.compile_unit(f)[1]})
print(json.dumps({"package": hipattn.__file__, "kernels_dir": str(kernels), "headers": headers}))
"""


def test_installed_wheel_finds_its_kernels_inside_the_package(wheel, tmp_path):
    target = tmp_path / "site"
    _pip("install", "--no-deps", "--no-index", "-q", "--target", str(target), str(wheel), cwd=tmp_path)
    env = {**os.environ, "PYTHONPATH": str(target)}
    env.pop("HIPATTN_BACKEND", None)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    result = subprocess.run(
        [sys.executable, "-c", _INSTALLED_CHECK],
        cwd=outside,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, (
        f"the installed wheel does not import or find its kernels:\n{result.stderr}"
    )
    found = json.loads(result.stdout.strip().splitlines()[-1])
    package = (target / "hipattn").resolve()
    assert Path(found["package"]).resolve().parent == package, (
        f"imported {found['package']}, not the installed copy"
    )
    assert Path(found["kernels_dir"]).resolve() == package / "kernels"
    assert "common/platform.h" in found["headers"]

    cli = subprocess.run(
        [sys.executable, "-m", "hipattn", "--help"],
        cwd=outside,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 0 and "warm" in cli.stdout, cli.stderr
