"""The on-disk compile cache as a protocol: keys, hits, self-checking entries, degraded directories."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import stat
import struct

import pytest
from support.fake_backend import FAKE_FAMILY, FakeBackend, put_same_key
from support.unprivileged import run_unprivileged, unprivileged_directory, unprivileged_uid

from hipattn.backends.base import CompiledKernel
from hipattn.jit import cache as cache_module
from hipattn.jit.cache import DiskCache, cache_key, default_cache_dir
from hipattn.jit.cache_format import CACHE_FORMAT_VERSION
from hipattn.jit.registry import compile_inputs, compile_spec
from hipattn.jit.target import Target

SM90 = Target.parse("sm_90")
SPEC = FAKE_FAMILY.spec(dtype="bf16", head_dim=64)


@pytest.fixture
def cache(tmp_path) -> DiskCache:
    return DiskCache(tmp_path / "cache")


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


def entry_file(cache: DiskCache, backend: FakeBackend, spec=SPEC, target=SM90):
    return cache.directory / f"{compile_inputs(spec, target, backend).key}.hipattn"


def warnings_in(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "hipattn"]


# ---- the directory ------------------------------------------------------------------------------
def test_directory_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("HIPATTN_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("HIPATTN_CACHE_DIR")
    assert default_cache_dir() == tmp_path / "xdg" / "hipattn"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "hipattn"


def test_directory_is_created_private(tmp_path):
    cache = DiskCache(tmp_path / "a" / "b")
    assert cache.writable
    assert stat.S_IMODE((tmp_path / "a" / "b").stat().st_mode) == 0o700


# ---- miss, hit, key -----------------------------------------------------------------------------
def test_miss_then_hit(cache, backend):
    first = compile_spec(SPEC, SM90, backend, cache)
    assert backend.compiles == 1
    second = compile_spec(SPEC, SM90, backend, DiskCache(cache.directory))  # a fresh process's view
    assert backend.compiles == 1
    assert second == first
    (entry,) = cache.entries()
    assert (entry.spec, entry.family, entry.arch, entry.compiler) == (
        SPEC.canonical(),
        "fake_copy",
        "sm_90",
        "fakecc 1.0",
    )
    assert entry.size == cache.total_size() > len(first.binary)
    assert 0 <= entry.age_seconds < 60


def test_each_arch_and_spec_has_its_own_entry(cache, backend):
    other = FAKE_FAMILY.spec(dtype="fp16", head_dim=64)
    for spec in (SPEC, other):
        for target in (SM90, Target.parse("sm_80")):
            compile_spec(spec, target, backend, cache)
    assert backend.compiles == 4
    assert len(cache.entries()) == 4
    assert compile_spec(other, Target.parse("sm_80"), backend, cache).binary.startswith(b"sm_80|")
    assert backend.compiles == 4


KEY_INPUTS = dict(
    source='#include "a.h"\nkernel body',
    headers={"a.h": "struct A {};", "b.h": "int b;"},
    name_expression="hipattn::k<float, 64>",
    spec_text='{"args": [["head_dim", 64]], "family": "k"}',
    options=("-O3", "--std=c++17"),
    arch="gfx90a:xnack-",
    compiler_identity="hiprtc 5.2.21153",
)


@pytest.mark.parametrize(
    "change",
    [
        {"source": '#include "a.h"\nkernel body // edited'},
        {"headers": {"a.h": "struct A { int x; };", "b.h": "int b;"}},
        {"headers": {"a.h": "struct A {};", "c.h": "int b;"}},  # a header renamed, same content
        {"headers": {"a.h": "struct A {};"}},  # a header dropped
        {"name_expression": "hipattn::k<float, 128>"},
        {"spec_text": '{"args": [["head_dim", 128]], "family": "k"}'},
        {"options": ("-O2", "--std=c++17")},
        {"options": ("-O3",)},
        {"arch": "gfx90a"},  # the target feature alone changes the binary
        {"arch": "gfx90a:xnack+"},
        {"compiler_identity": "hiprtc 6.2.41133"},
        {"format_version": CACHE_FORMAT_VERSION + 1},
    ],
    ids=lambda change: next(iter(change)),
)
def test_key_changes_when_an_input_changes(change):
    assert cache_key(**{**KEY_INPUTS, **change}) != cache_key(**KEY_INPUTS)


def test_key_is_stable_otherwise():
    same = dict(
        KEY_INPUTS,
        headers=dict(reversed(list(KEY_INPUTS["headers"].items()))),
        options=list(KEY_INPUTS["options"]),
    )
    assert cache_key(**same) == cache_key(**KEY_INPUTS)
    assert cache_key(**KEY_INPUTS, format_version=CACHE_FORMAT_VERSION) == cache_key(**KEY_INPUTS)


def test_key_fields_do_not_run_into_each_other():
    # The same bytes moved from one field to its neighbour must not hash alike.
    moved = dict(
        KEY_INPUTS, source=KEY_INPUTS["source"] + "x", name_expression="x" + KEY_INPUTS["name_expression"]
    )
    assert cache_key(**moved) != cache_key(**dict(KEY_INPUTS, source=KEY_INPUTS["source"] + "xx"))
    assert cache_key(**dict(KEY_INPUTS, options=("-O3 --std=c++17",))) != cache_key(**KEY_INPUTS)


def test_spec_key_follows_the_backend(backend):
    key = compile_inputs(SPEC, SM90, backend).key
    assert compile_inputs(SPEC, SM90, FakeBackend()).key == key
    assert compile_inputs(SPEC, Target.parse("sm_90a"), backend).key != key
    assert compile_inputs(SPEC, SM90, FakeBackend(identity="fakecc 1.1")).key != key
    assert compile_inputs(SPEC, SM90, FakeBackend(options=("-O2",))).key != key
    assert compile_inputs(FAKE_FAMILY.spec(dtype="bf16", head_dim=128), SM90, backend).key != key


def test_a_changed_compiler_recompiles(cache):
    compile_spec(SPEC, SM90, FakeBackend(identity="fakecc 1.0"), cache)
    newer = FakeBackend(identity="fakecc 2.0")
    compile_spec(SPEC, SM90, newer, cache)
    assert newer.compiles == 1
    assert sorted(e.compiler for e in cache.entries()) == ["fakecc 1.0", "fakecc 2.0"]


# ---- bad entries are misses -----------------------------------------------------------------------
def corrupt_flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def corrupt_truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def corrupt_truncate_into_header(path):
    path.write_bytes(path.read_bytes()[:10])


def corrupt_empty(path):
    path.write_bytes(b"")


def corrupt_magic(path):
    path.write_bytes(b"NOTMAGIC" + path.read_bytes()[8:])


def corrupt_version(path):
    data = path.read_bytes()
    path.write_bytes(data[:8] + struct.pack("<I", CACHE_FORMAT_VERSION + 7) + data[12:])


@pytest.mark.parametrize(
    "corrupt",
    [
        corrupt_flip_a_byte,
        corrupt_truncate,
        corrupt_truncate_into_header,
        corrupt_empty,
        corrupt_magic,
        corrupt_version,
    ],
)
def test_bad_entry_is_detected_warned_and_rebuilt(cache, backend, caplog, corrupt):
    good = compile_spec(SPEC, SM90, backend, cache)
    path = entry_file(cache, backend)
    corrupt(path)
    with caplog.at_level(logging.WARNING, logger="hipattn"):
        rebuilt = compile_spec(SPEC, SM90, backend, cache)
    assert backend.compiles == 2
    assert rebuilt == good
    assert any("invalid entry" in message and path.name in message for message in warnings_in(caplog))
    # The rebuilt entry is valid again: a fresh cache hits it without a warning or a compile.
    caplog.clear()
    assert compile_spec(SPEC, SM90, backend, DiskCache(cache.directory)) == good
    assert backend.compiles == 2
    assert warnings_in(caplog) == []


def test_entry_for_another_arch_under_the_right_name_is_a_miss(cache, backend, caplog):
    sm80 = Target.parse("sm_80")
    compile_spec(SPEC, sm80, backend, cache)
    compile_spec(SPEC, SM90, backend, cache)
    # A sm_80 binary sitting where the sm_90 one belongs (a copied directory, a bad rename...).
    entry_file(cache, backend).write_bytes(entry_file(cache, backend, target=sm80).read_bytes())
    with caplog.at_level(logging.WARNING, logger="hipattn"):
        compiled = compile_spec(SPEC, SM90, backend, cache)
    assert compiled.binary.startswith(b"sm_90|")
    assert backend.compiles == 3
    assert any("for key" in message for message in warnings_in(caplog))


def test_arch_recorded_in_the_entry_is_checked(cache, backend, caplog):
    compile_spec(SPEC, SM90, backend, cache)
    key = compile_inputs(SPEC, SM90, backend).key
    assert cache.get(key, arch="sm_90") is not None
    with caplog.at_level(logging.WARNING, logger="hipattn"):
        assert cache.get(key, arch="sm_90a") is None
    assert any("built for 'sm_90'" in message for message in warnings_in(caplog))


def test_bad_entry_is_left_out_of_listings(cache, backend):
    compile_spec(SPEC, SM90, backend, cache)
    corrupt_flip_a_byte(entry_file(cache, backend))
    assert cache.entries() == []


# ---- directories that cannot be used ----------------------------------------------------------------
def test_unusable_directory_degrades_to_memory(tmp_path, backend, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="hipattn"):
        cache = DiskCache(blocker / "cache")
        first = compile_spec(SPEC, SM90, backend, cache)
        second = compile_spec(SPEC, SM90, backend, cache)
    assert first == second
    assert backend.compiles == 1  # memory still serves the second call
    assert not cache.readable and not cache.writable
    assert len(warnings_in(caplog)) == 1
    assert cache.entries() == [] and cache.total_size() == 0


def _compile_then_serve_read_only(directory: str) -> tuple:
    """Fill a cache, make its directory read-only, and use it again: (compiles, readable, writable,
    effective uid, read-only warnings). Returns plain values: it may run in a child process."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logger = logging.getLogger("hipattn")
    handler = Collect(logging.WARNING)
    logger.addHandler(handler)
    try:
        backend = FakeBackend()
        compile_spec(SPEC, SM90, backend, DiskCache(directory))
        os.chmod(directory, 0o500)
        cache = DiskCache(directory)
        compile_spec(SPEC, SM90, backend, cache)  # the entry already there: read, no compile
        other = FAKE_FAMILY.spec(dtype="fp16", head_dim=64)
        compile_spec(other, SM90, backend, cache)
        compile_spec(other, SM90, backend, cache)
        return backend.compiles, cache.readable, cache.writable, os.geteuid(), [m for m in messages if "read-only" in m]
    finally:
        logger.removeHandler(handler)


def test_read_only_directory_serves_entries_and_keeps_new_ones_in_memory():
    # Root writes into read-only directories, so under root this runs as an unprivileged user.
    with unprivileged_directory() as home:
        compiles, readable, writable, uid, read_only_warnings = run_unprivileged(
            _compile_then_serve_read_only, os.path.join(home, "cache")
        )
    assert uid == unprivileged_uid() != 0
    assert compiles == 2
    assert readable and not writable
    assert len(read_only_warnings) == 1


def test_full_disk_warns_once_and_continues_in_memory(cache, backend, caplog, monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cache_module.os, "replace", disk_full)
    with caplog.at_level(logging.WARNING, logger="hipattn"):
        compile_spec(SPEC, SM90, backend, cache)
        compile_spec(SPEC, SM90, backend, cache)
        compile_spec(FAKE_FAMILY.spec(dtype="fp16", head_dim=64), SM90, backend, cache)
    assert backend.compiles == 2
    assert [m for m in warnings_in(caplog) if "No space left" in m] == [warnings_in(caplog)[0]]
    assert len(warnings_in(caplog)) == 1
    # Nothing partial is left behind: neither the entry nor the temporary file.
    assert list(cache.directory.iterdir()) == []


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777])
def test_directory_writable_by_others_is_refused(tmp_path, backend, caplog, mode):
    directory = tmp_path / "cache"
    compile_spec(SPEC, SM90, backend, DiskCache(directory))
    directory.chmod(mode)
    with caplog.at_level(logging.WARNING, logger="hipattn"):
        cache = DiskCache(directory)
        compile_spec(SPEC, SM90, backend, cache)
    # The entry sitting there is not loaded (someone else could have planted it), nor is one written.
    assert backend.compiles == 2
    assert not cache.readable and not cache.writable
    assert any("writable by group or others" in m for m in warnings_in(caplog))
    assert cache.entries() == []


# ---- concurrency and atomic publication --------------------------------------------------------------
def test_two_processes_writing_the_same_key_leave_a_valid_entry(tmp_path, caplog):
    directory = tmp_path / "cache"
    key = "ab" * 32
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(3)
    writers = [
        context.Process(target=put_same_key, args=(str(directory), key, byte, start, 10))
        for byte in (0x11, 0x22)
    ]
    for writer in writers:
        writer.start()
    # Meanwhile read the entry as fast as possible: every read is a miss or a whole entry, never a
    # partial one (a partial read would be logged as invalid).
    reader = DiskCache(directory)
    start.wait(timeout=60)
    seen = set()
    with caplog.at_level(logging.WARNING, logger="hipattn"):
        while any(w.is_alive() for w in writers):
            compiled = reader.get(key)
            if compiled is not None:
                assert len(set(compiled.binary)) == 1
                seen.add(compiled.binary[0])
    for writer in writers:
        writer.join(timeout=60)
        assert writer.exitcode == 0
    assert warnings_in(caplog) == []
    final = DiskCache(directory).get(key)
    assert final is not None and final.binary[0] in (0x11, 0x22) and len(final.binary) == 4 << 20
    assert seen <= {0x11, 0x22}
    assert [p.name for p in directory.iterdir()] == [f"{key}.hipattn"]  # no temporary files left


def test_publication_is_temp_file_then_rename(cache, backend, monkeypatch):
    renames = []
    real_replace = os.replace

    def watching_replace(source, destination, *, src_dir_fd, dst_dir_fd):
        # At the moment of publication the final name does not exist yet and the data sits,
        # complete, in a hidden temporary file of the same directory (the one the cache holds open).
        assert src_dir_fd == dst_dir_fd
        assert destination not in os.listdir(dst_dir_fd)
        assert os.sep not in source and os.sep not in destination
        assert source.startswith(".")
        renames.append(os.stat(source, dir_fd=src_dir_fd).st_size)
        real_replace(source, destination, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

    monkeypatch.setattr(cache_module.os, "replace", watching_replace)
    compile_spec(SPEC, SM90, backend, cache)
    assert renames == [entry_file(cache, backend).stat().st_size]


# ---- clearing ----------------------------------------------------------------------------------------
def test_clear_removes_entries_and_stray_temporary_files(cache, backend):
    compile_spec(SPEC, SM90, backend, cache)
    compile_spec(SPEC, Target.parse("sm_80"), backend, cache)
    (cache.directory / f".{'cd' * 32}.123.abcdef012345.tmp").write_bytes(b"half an entr")  # a killed writer's
    assert cache.clear() == 2
    assert list(cache.directory.iterdir()) == []
    assert cache.entries() == [] and cache.total_size() == 0
    compile_spec(SPEC, SM90, backend, cache)
    assert backend.compiles == 3


def test_put_and_get_round_trip_every_field(cache):
    compiled = CompiledKernel(binary=bytes(range(256)) * 3, lowered_name="_Z3fooILi64EEvv", log="warning: x")
    key = "0f" * 32
    cache.put(key, compiled, {"spec": SPEC.canonical(), "family": "fake_copy", "arch": "sm_90"})
    assert DiskCache(cache.directory).get(key) == compiled
    assert dataclasses.asdict(cache.entries()[0])["arch"] == "sm_90"
