"""Which backend hipattn picks, and that picking one needs neither binding at import time."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support.local_rocm import use_local_rocm

from hipattn import backends
from hipattn.errors import BackendUnavailableError
from hipattn.jit.target import Target

use_local_rocm()


def test_importing_hipattn_imports_no_vendor_binding():
    code = (
        "import sys, hipattn, hipattn.backends\n"
        "loaded = [m for m in sys.modules if m.startswith(('cuda', 'hip.', 'rocm')) or m == 'hip']\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_backend_name_is_a_value_error(monkeypatch):
    monkeypatch.setenv("HIPATTN_BACKEND", "opencl")
    with pytest.raises(ValueError, match="cuda, hip"):
        backends.get_backend()


def test_compiler_backend_follows_the_target_vendor():
    pytest.importorskip("cuda.bindings", reason="cuda-bindings is not installed")
    pytest.importorskip("hip", reason="hip-python is not installed")
    assert backends.compiler_backend(Target.parse("sm_90")).name == "cuda"
    assert backends.compiler_backend(Target.parse("gfx90a")).name == "hip"
    # One object per backend: the compile-only handle is the runtime handle.
    assert backends.compiler_backend(Target.parse("sm_80")) is backends.get_backend("cuda")


def test_environment_forces_a_backend_without_probing_for_a_device(monkeypatch):
    pytest.importorskip("cuda.bindings", reason="cuda-bindings is not installed")
    monkeypatch.setenv("HIPATTN_BACKEND", "cuda")
    assert backends.get_backend().name == "cuda"


def test_no_device_anywhere_says_what_to_install(monkeypatch):
    monkeypatch.delenv("HIPATTN_BACKEND", raising=False)
    monkeypatch.setattr(backends, "_chosen", {})
    try:
        backend = backends.get_backend()
    except BackendUnavailableError as error:
        message = str(error)
        assert "pip install hipattn[nvidia]" in message and "pip install hipattn[amd]" in message
    else:
        pytest.skip(f"this machine has a usable {backend.name} device")
