"""The ``hipattn`` command, run as users run it: ``python -m hipattn`` in a fresh process, no GPU needed."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hipattn import catalog, cli
from hipattn.backends.base import CompiledKernel
from hipattn.jit.cache import DiskCache
from hipattn.jit.target import Target

REPO = Path(__file__).resolve().parent.parent
# Debian's ROCm 5.2 hiprtc, linked into a ROCM_PATH-shaped folder (as .ci/run makes it).
ROCM52 = Path("/opt/rocm52")


def hipattn(*args: str, cache_dir: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, HIPATTN_CACHE_DIR=str(cache_dir))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if "ROCM_PATH" not in env and ROCM52.is_dir():
        env["ROCM_PATH"] = str(ROCM52)
    return subprocess.run(
        [sys.executable, "-m", "hipattn", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@functools.cache
def compilers() -> dict[str, str]:
    """What `hipattn info` reports for each compiler: its identity, or 'unavailable (...)'."""
    result = hipattn("info", cache_dir=Path(os.devnull) / "unused")
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(":", 1) for line in result.stdout.splitlines() if ":" in line)
    return {name: lines.get(name, "unavailable").strip() for name in ("nvrtc", "hiprtc")}


def require_compiler(arch: str) -> str:
    name = "nvrtc" if Target.parse(arch).vendor == "nvidia" else "hiprtc"
    identity = compilers()[name]
    if identity.startswith("unavailable"):
        pytest.skip(f"{name} is {identity}")
    return identity


def test_info_works_without_a_gpu(tmp_path):
    result = hipattn("info", cache_dir=tmp_path / "cache")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for label in ("hipattn ", "nvrtc:", "hiprtc:", "backend:", "cache:"):
        assert label in out
    assert f"cache:   {tmp_path / 'cache'} (not created yet; 0 entries, 0 B)" in out
    assert "Traceback" not in result.stderr
    (tmp_path / "cache").mkdir(mode=0o700)
    assert f"cache:   {tmp_path / 'cache'} (writable; 0 entries, 0 B)" in hipattn("info", cache_dir=tmp_path / "cache").stdout


@pytest.mark.parametrize("arch", ["sm_90", "gfx90a"])
def test_warm_list_clear(tmp_path, arch):
    require_compiler(arch)
    target = Target.parse(arch)
    by_family: dict[str, list] = {}
    for spec in catalog.shipped_specs(target):
        by_family.setdefault(spec.family.name, []).append(spec)
    if not by_family:
        pytest.skip(f"no kernel family ships instantiations for {arch} yet")
    # The smallest family keeps this quick; tests of the kernels compile all of them.
    family, specs = min(by_family.items(), key=lambda item: (len(item[1]), item[0]))
    cache_dir = tmp_path / "cache"

    warm = hipattn("warm", "--arch", arch, "--family", family, "--jobs", "2", cache_dir=cache_dir)
    assert warm.returncode == 0, warm.stdout + warm.stderr
    assert f"{len(specs)} compiled, 0 already cached, 0 failed" in warm.stdout
    # No terminal here: plain progress lines on stderr instead of a bar, so a log shows it working.
    assert f"hipattn warm: compiling {len(specs)} kernels" in warm.stderr
    assert f"hipattn warm: {len(specs)}/{len(specs)} kernels done after" in warm.stderr
    cached = {(entry.spec, entry.arch) for entry in DiskCache(cache_dir).entries()}
    assert cached == {(spec.canonical(), arch) for spec in specs}

    again = hipattn("warm", "--arch", arch, "--family", family, cache_dir=cache_dir)
    assert again.returncode == 0, again.stderr
    assert f"0 compiled, {len(specs)} already cached, 0 failed" in again.stdout

    listing = hipattn("list", cache_dir=cache_dir)
    assert listing.returncode == 0, listing.stderr
    rows = [line for line in listing.stdout.splitlines() if f"  {arch}  " in line]
    assert sorted(row.split("  ")[0] for row in rows) == sorted(str(spec) for spec in specs)
    assert f"{len(specs)} entries" in listing.stdout

    cleared = hipattn("clear", cache_dir=cache_dir)
    assert cleared.returncode == 0 and f"removed {len(specs)} entries" in cleared.stdout
    assert DiskCache(cache_dir).entries() == []
    assert "0 entries" in hipattn("list", cache_dir=cache_dir).stdout


def test_warm_for_a_target_the_compiler_does_not_know_fails_cleanly(tmp_path):
    identity = require_compiler("gfx90a")
    if not identity.startswith("hiprtc 5."):
        pytest.skip(f"{identity} may know gfx942")
    # hiprtc 5.2 aborts the process on gfx942: warm must report it, not crash or hang.
    result = hipattn("warm", "--arch", "gfx942", cache_dir=tmp_path / "cache")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "gfx942" in result.stderr
    assert "Traceback" not in result.stderr
    assert DiskCache(tmp_path / "cache").entries() == []


@pytest.mark.parametrize("arch", ["sm_99", "sm_70"])
def test_warm_for_an_arch_nvrtc_does_not_support_says_so_once_and_exits_2(tmp_path, arch):
    require_compiler("sm_90")
    result = hipattn("warm", "--arch", arch, cache_dir=tmp_path / "cache")
    assert result.returncode == 2, result.stdout + result.stderr
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert len(lines) <= 3, lines
    assert f"skipped {arch}" in result.stderr and "does not compile for" in result.stderr and "sm_90" in result.stderr
    assert DiskCache(tmp_path / "cache").entries() == []


def test_cache_dir_is_accepted_before_or_after_the_command(tmp_path):
    for args in (["--cache-dir", str(tmp_path / "a"), "list"], ["list", "--cache-dir", str(tmp_path / "a")]):
        result = hipattn(*args, cache_dir=tmp_path / "environment")
        assert result.returncode == 0, result.stderr
        assert f"0 entries, 0 B in {tmp_path / 'a'}" in result.stdout


def test_a_closed_pipe_ends_the_command_without_a_traceback(tmp_path):
    env = dict(os.environ, HIPATTN_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
    reader, writer = os.pipe()
    os.close(reader)  # the reader is gone before anything is written, as after `| head` has read enough
    with os.fdopen(writer, "w") as stdout:
        result = subprocess.run([sys.executable, "-m", "hipattn", "info"], cwd=REPO, env=env, stdout=stdout,
                                stderr=subprocess.PIPE, text=True, timeout=120)
    assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr, result.stderr
    assert result.returncode == cli.EXIT_FAILED


def test_warm_rejects_an_unknown_family(tmp_path):
    result = hipattn("warm", "--arch", "sm_90", "--family", "no_such_family", cache_dir=tmp_path / "cache")
    assert result.returncode == 2
    assert "no_such_family" in result.stderr


@pytest.mark.parametrize("args", [["--arch", "sm90"], ["--arch", "sm_90", "--jobs", "-1"]])
def test_warm_rejects_bad_arguments(tmp_path, args):
    result = hipattn("warm", *args, cache_dir=tmp_path / "cache")
    assert result.returncode == 2
    assert "usage: hipattn warm" in result.stderr


def test_list_and_clear_an_empty_cache(tmp_path):
    cache_dir = tmp_path / "cache"
    listing = hipattn("list", cache_dir=cache_dir)
    assert listing.returncode == 0 and f"0 entries, 0 B in {cache_dir}" in listing.stdout
    cleared = hipattn("clear", cache_dir=cache_dir)
    assert cleared.returncode == 0 and f"removed 0 entries from {cache_dir}" in cleared.stdout


# ---- what the commands must not do ---------------------------------------------------------------
def test_list_info_and_clear_do_not_create_a_missing_cache_dir(tmp_path, capsys):
    missing = tmp_path / "not" / "yet"
    for command in ("list", "info", "clear"):
        assert cli.main(["--cache-dir", str(missing), command]) == 0
        assert not (tmp_path / "not").exists(), f"hipattn {command} created the cache dir"
    assert "not created yet" in capsys.readouterr().out


def test_clear_with_an_empty_cache_dir_is_refused_and_deletes_nothing(tmp_path):
    (tmp_path / "thesis.hipattn").write_text("four years of work")
    (tmp_path / ".report.docx.tmp").write_text("an autosave")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-m", "hipattn", "--cache-dir", "", "clear"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--cache-dir ''" in result.stderr
    assert sorted(os.listdir(tmp_path)) == [".report.docx.tmp", "thesis.hipattn"]


def test_list_escapes_control_characters_in_entry_metadata(tmp_path, capsys):
    spec = next(iter(catalog.shipped_specs(Target.parse("sm_90"))))
    DiskCache(tmp_path).put(
        "ab" * 32,
        CompiledKernel(b"binary", "_Z", ""),
        {"spec": spec.canonical(), "family": spec.family.name, "arch": "sm_90\x1b]0;owned\x07",
         "compiler": "nvrtc\r\nFAKE  ROW  FROM  A  FILE"},
    )
    assert cli.main(["--cache-dir", str(tmp_path), "list"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out and "\x07" not in out
    assert "sm_90\\x1b]0;owned\\x07" in out and "nvrtc\\x0d\\x0aFAKE" in out
    assert len(out.splitlines()) == 3  # the header, one row, the summary


# ---- warm's workers ---------------------------------------------------------------------------------
_POOL_PARENT = """
import sys
sys.path[:0] = [{repo!r}, {tests!r}]
from hipattn import catalog, cli
from hipattn.jit.target import Target
from support.slow_compile import record_pid_then_sleep
target = Target.parse("sm_90")
work = [(spec, target) for spec in list(catalog.shipped_specs(target))[:2]]
cli.run_compile_pool(work, 2, {directory!r}, lambda *outcome: None, compile_one=record_pid_then_sleep)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as status:
            return status.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_compile_workers_exit_when_warm_is_killed(tmp_path):
    script = _POOL_PARENT.format(repo=str(REPO), tests=str(REPO / "tests"), directory=str(tmp_path))
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("worker-*"))) < 2:
            assert parent.poll() is None, "the pool's parent exited on its own"
            assert time.monotonic() < deadline, "the workers never started"
            time.sleep(0.1)
        workers = [int(path.name.split("-")[1]) for path in tmp_path.glob("worker-*")]
        assert all(_alive(pid) for pid in workers)
    finally:
        parent.kill()  # SIGKILL: the pool gets no chance to shut its workers down
        parent.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [pid for pid in workers if _alive(pid)]
    for pid in survivors:  # do not leave them behind on the unfixed code
        os.kill(pid, signal.SIGKILL)
    assert survivors == [], "compile workers outlived the killed parent"
