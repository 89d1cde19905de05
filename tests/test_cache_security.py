"""The cache executes what it loads: what an attacker who controls a path, a file or a directory near
it can and cannot make it load, block on, or delete."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import struct
import threading
import tracemalloc

import pytest
from support.fake_backend import FAKE_FAMILY, FakeBackend
from support.unprivileged import NOBODY, run_unprivileged, running_as_root, unprivileged_directory

from hipattn.backends.base import CompiledKernel
from hipattn.jit.cache import DiskCache
from hipattn.jit.cache_format import CACHE_FORMAT_VERSION
from hipattn.jit.cache_safety import MAX_ENTRY_BYTES
from hipattn.jit.registry import compile_inputs, compile_spec
from hipattn.jit.target import Target

SM90 = Target.parse("sm_90")
SPEC = FAKE_FAMILY.spec(dtype="bf16", head_dim=64)
PLANTED = CompiledKernel(binary=b"planted code", lowered_name="_Zplanted", log="")


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


def key_of(backend) -> str:
    return compile_inputs(SPEC, SM90, backend).key


def plant(directory, key: str, compiled: CompiledKernel = PLANTED) -> None:
    """A valid entry for ``key`` in ``directory``, written by someone other than the cache under test."""
    DiskCache(directory).put(key, compiled, {"spec": SPEC.canonical(), "family": SPEC.family.name, "arch": "sm_90"})


def warnings_in(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "hipattn"]


# ---- the directory is resolved and opened once ----------------------------------------------------
def test_cache_dir_replaced_by_a_symlink_after_opening_loads_nothing_from_the_new_target(tmp_path, backend):
    cache = DiskCache(tmp_path / "cache")
    good = compile_spec(SPEC, SM90, backend, cache)
    # Someone with write access to the parent swaps the directory for a link to theirs.
    plant(tmp_path / "theirs", key_of(backend))
    (tmp_path / "cache").rename(tmp_path / "moved")
    (tmp_path / "cache").symlink_to(tmp_path / "theirs")
    assert cache.get(key_of(backend), arch="sm_90") == good
    assert compile_spec(SPEC, SM90, backend, cache) == good and backend.compiles == 1


def test_writes_and_deletes_go_to_the_directory_that_was_opened(tmp_path, backend):
    cache = DiskCache(tmp_path / "cache")
    (tmp_path / "cache").rename(tmp_path / "moved")
    (tmp_path / "theirs").mkdir(mode=0o700)
    (tmp_path / "cache").symlink_to(tmp_path / "theirs")
    compile_spec(SPEC, SM90, backend, cache)
    assert os.listdir(tmp_path / "theirs") == []
    assert os.listdir(tmp_path / "moved") == [f"{key_of(backend)}.hipattn"]
    plant(tmp_path / "theirs", key_of(backend))
    assert cache.clear() == 1
    assert os.listdir(tmp_path / "moved") == [] and len(os.listdir(tmp_path / "theirs")) == 1


def test_relative_cache_dir_is_resolved_when_the_cache_opens_not_after_a_chdir(tmp_path, backend, monkeypatch):
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    monkeypatch.chdir(tmp_path / "first")
    cache = DiskCache("cache")
    good = compile_spec(SPEC, SM90, backend, cache)
    plant(tmp_path / "second" / "cache", key_of(backend))
    monkeypatch.chdir(tmp_path / "second")
    assert cache.directory == tmp_path / "first" / "cache"
    assert cache.get(key_of(backend), arch="sm_90") == good


def test_parent_directory_writable_by_others_is_refused(tmp_path, backend, caplog):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # not sticky: anyone may rename the cache directory inside it
    with caplog.at_level(logging.WARNING, logger="hipattn"):
        cache = DiskCache(shared / "cache")
    assert not cache.readable and not cache.writable
    assert any("above it is writable by group or others" in m for m in warnings_in(caplog))


def test_parent_directory_owned_by_another_user_is_refused(tmp_path, backend, caplog):
    """Whoever owns a directory above the cache can rename the cache away and put theirs in its place."""
    if not running_as_root():
        pytest.skip("needs a directory owned by another user: only root can make one")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    (theirs / "cache").mkdir(mode=0o700)  # this user's own cache, inside a directory they do not own
    with caplog.at_level(logging.WARNING, logger="hipattn"):
        cache = DiskCache(theirs / "cache")
    assert not cache.readable and not cache.writable
    assert any("neither root nor this user" in m for m in warnings_in(caplog))


def test_parent_directory_writable_by_others_but_sticky_is_accepted(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp: others cannot rename what is not theirs
    assert DiskCache(shared / "cache").writable


def test_symlinked_cache_dir_to_a_safe_target_is_used(tmp_path, backend):
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    cache = DiskCache(tmp_path / "link")
    assert cache.writable and cache.directory == tmp_path / "real"
    compile_spec(SPEC, SM90, backend, cache)
    assert os.listdir(tmp_path / "real") == [f"{key_of(backend)}.hipattn"]


@pytest.mark.parametrize("weak", ["target", "target's parent"])
def test_symlinked_cache_dir_whose_target_fails_the_checks_is_refused(tmp_path, backend, weak):
    (tmp_path / "elsewhere").mkdir()
    target = tmp_path / "elsewhere" / "real"
    target.mkdir(mode=0o700)
    (target if weak == "target" else target.parent).chmod(0o777)
    (tmp_path / "link").symlink_to(target)
    cache = DiskCache(tmp_path / "link")
    assert not cache.readable and not cache.writable


def _open_cache(path: str) -> tuple[bool, bool]:
    cache = DiskCache(path)
    return cache.readable, cache.writable


def test_cache_dir_owned_by_another_user_is_refused():
    if not running_as_root():
        pytest.skip("needs a directory owned by another user: only root can make one")
    with unprivileged_directory() as home:
        theirs = os.path.join(home, "theirs")
        os.mkdir(theirs, 0o755)  # root's, inside a directory the unprivileged user owns
        assert run_unprivileged(_open_cache, theirs) == (False, False)


# ---- entry files ------------------------------------------------------------------------------------
def test_symlink_named_like_an_entry_is_not_followed(tmp_path, backend, caplog):
    cache = DiskCache(tmp_path / "cache")
    plant(tmp_path / "elsewhere", key_of(backend))
    (tmp_path / "cache" / f"{key_of(backend)}.hipattn").symlink_to(tmp_path / "elsewhere" / f"{key_of(backend)}.hipattn")
    with caplog.at_level(logging.WARNING, logger="hipattn"):
        compiled = compile_spec(SPEC, SM90, backend, cache)
    assert compiled != PLANTED and backend.compiles == 1
    assert any("symbolic link" in m for m in warnings_in(caplog))


def _finishes(function, seconds: float = 10.0) -> bool:
    done = threading.Event()

    def run():
        function()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done.wait(seconds)


def test_fifo_named_like_an_entry_blocks_neither_a_lookup_nor_a_listing(tmp_path, backend):
    cache = DiskCache(tmp_path / "cache")
    os.mkfifo(tmp_path / "cache" / f"{key_of(backend)}.hipattn")
    os.mkfifo(tmp_path / "cache" / f"{'ab' * 32}.hipattn")
    try:
        assert _finishes(lambda: compile_spec(SPEC, SM90, backend, cache)), "a lookup blocked on a FIFO"
        assert _finishes(cache.entries), "a listing blocked on a FIFO"
    finally:
        for name in os.listdir(tmp_path / "cache"):  # release a reader stuck on a FIFO, if one is
            path = tmp_path / "cache" / name
            if stat.S_ISFIFO(os.lstat(path).st_mode):
                try:
                    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    pass
    assert backend.compiles == 1


def test_entry_owned_by_another_user_is_not_loaded(tmp_path, backend, caplog):
    if not running_as_root():
        pytest.skip("only root can give a file to another user")
    cache = DiskCache(tmp_path / "cache")
    plant(tmp_path / "cache", key_of(backend))
    os.chown(tmp_path / "cache" / f"{key_of(backend)}.hipattn", NOBODY, NOBODY)
    with caplog.at_level(logging.WARNING, logger="hipattn"):
        assert compile_spec(SPEC, SM90, backend, cache) != PLANTED
    assert backend.compiles == 1
    assert any(f"belongs to uid {NOBODY}" in m for m in warnings_in(caplog))


def test_entry_writable_by_group_is_not_loaded(tmp_path, backend, caplog):
    cache = DiskCache(tmp_path / "cache")
    plant(tmp_path / "cache", key_of(backend))
    (tmp_path / "cache" / f"{key_of(backend)}.hipattn").chmod(0o660)
    with caplog.at_level(logging.WARNING, logger="hipattn"):
        assert compile_spec(SPEC, SM90, backend, cache) != PLANTED
    assert backend.compiles == 1
    assert any("writable by group or others" in m for m in warnings_in(caplog))


def test_oversized_entry_is_refused_before_it_is_read(tmp_path, backend, caplog):
    cache = DiskCache(tmp_path / "cache")
    with open(tmp_path / "cache" / f"{key_of(backend)}.hipattn", "wb") as huge:
        huge.truncate(MAX_ENTRY_BYTES + 1)  # sparse: costs no disk
    tracemalloc.start()
    try:
        with caplog.at_level(logging.WARNING, logger="hipattn"):
            compile_spec(SPEC, SM90, backend, cache)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"a lookup allocated {peak} bytes for a file it must refuse"
    assert any("more than any entry" in m for m in warnings_in(caplog))
    assert backend.compiles == 1


def test_entry_whose_header_announces_more_than_the_file_holds_is_a_miss(tmp_path, backend, caplog):
    cache = DiskCache(tmp_path / "cache")
    compile_spec(SPEC, SM90, backend, cache)
    path = tmp_path / "cache" / f"{key_of(backend)}.hipattn"
    data = bytearray(path.read_bytes())
    struct.pack_into("<Q", data, 44, 1 << 27)  # the body length field: 128 MiB, past the file's end
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="hipattn"):
        compile_spec(SPEC, SM90, backend, DiskCache(tmp_path / "cache"))
    assert backend.compiles == 2
    assert any("truncated" in m for m in warnings_in(caplog))


def entry_bytes(metadata: bytes, binary: bytes) -> bytes:
    """An entry in the documented format, written independently of the cache's own writer."""
    body = struct.pack("<I", len(metadata)) + metadata + binary
    return struct.pack("<8sI32sQ", b"HIPATTN\x1a", CACHE_FORMAT_VERSION, hashlib.sha256(body).digest(), len(body)) + body


def test_deeply_nested_metadata_is_an_invalid_entry_not_a_recursion_error(tmp_path, backend, caplog):
    cache = DiskCache(tmp_path / "cache")
    key = key_of(backend)
    fields = {"key": key, "arch": "sm_90", "lowered_name": "_Z", "spec": SPEC.canonical(), "family": SPEC.family.name}
    deep = json.dumps(fields)[:-1].encode() + b', "deep": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for name in (f"{key}.hipattn", f"{'cd' * 32}.hipattn"):
        (tmp_path / "cache" / name).write_bytes(entry_bytes(deep, b"binary"))
    assert [entry.path.name for entry in cache.entries()] == []  # the listing skips them, and survives
    with caplog.at_level(logging.WARNING, logger="hipattn"):
        assert cache.get(key, arch="sm_90") is None
    assert any("invalid entry" in m and "unreadable metadata" in m for m in warnings_in(caplog))


# ---- clear deletes only what hipattn wrote -----------------------------------------------------------
def test_clear_keeps_files_that_are_not_hipattn_entries(tmp_path, backend):
    cache = DiskCache(tmp_path / "cache")
    compile_spec(SPEC, SM90, backend, cache)
    directory = tmp_path / "cache"
    keep = {
        "thesis.hipattn": b"chapter one",
        ".report.docx.tmp": b"an editor's autosave",
        f"{'ef' * 32}.hipattn": b"named like an entry, but not one",
        f".{'cd' * 32}.tmp": b"a temporary file of someone else's naming",
        "notes.txt": b"",
    }
    for name, data in keep.items():
        (directory / name).write_bytes(data)
    killed_writer = f".{'cd' * 32}.4242.0123456789ab.tmp"
    (directory / killed_writer).write_bytes(b"half an entr")
    assert cache.clear() == 1
    assert sorted(os.listdir(directory)) == sorted(keep)


def test_root_and_empty_cache_dirs_are_refused(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="hipattn"):
        for directory in ("/", ""):
            cache = DiskCache(directory)
            assert not cache.readable and not cache.writable, directory
            assert cache.clear() == 0
    assert len(warnings_in(caplog)) == 2


# ---- what reaches the log ----------------------------------------------------------------------------
def test_cache_path_with_a_newline_cannot_forge_a_log_line(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="hipattn"):
        DiskCache(blocker / "cache\nhipattn WARNING: all is well\x1b[2K")
    (message,) = warnings_in(caplog)
    assert "\n" not in message and "\x1b" not in message
    assert "cache\\x0ahipattn WARNING: all is well\\x1b[2K" in message
