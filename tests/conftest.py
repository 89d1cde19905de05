"""Fixtures shared by the CPU test modules."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def emulation_dirs(tmp_path_factory):
    """Build and cache directories for a module's emulated kernels: each compiles once per module."""
    return tmp_path_factory.mktemp("emulated-build"), tmp_path_factory.mktemp("emulated-cache")
