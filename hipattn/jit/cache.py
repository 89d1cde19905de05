"""The on-disk compile cache: one self-checking file per compiled kernel instantiation.

The key (``cache_key``) is a sha256 over everything that changes the binary: the instantiated
compile unit, every header it includes (name and content), the name expression, the spec's
canonical text, the compile options, the full arch string, the compiler's identity and
``CACHE_FORMAT_VERSION``. Each field is length-prefixed, so no two different inputs hash the same
byte stream.

An entry file (its layout: ``cache_format``) that fails any check (magic, version, length, hash,
JSON, or its metadata names another key or arch) is a miss: it is logged, deleted and rebuilt, never
loaded. Entries are published with a temporary file in the same directory and ``os.replace``, so a
reader sees the old file or the new one, never a partial one, and two processes writing the same key
both succeed.

The cache executes what it loads, so it refuses a directory that someone else could write into
(group/other-writable, or owned by another user: ``cache_safety``). A directory that cannot be
created, is read-only or fills up degrades to an in-memory cache with one warning; no call ever fails
because of the cache.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..backends.base import CompiledKernel
from .cache_format import (
    CACHE_FORMAT_VERSION,
    ENTRY_NAME,
    HEADER,
    MAGIC,
    TEMP_NAME,
    decode_body,
    decode_header,
    encode,
    entry_name,
    temp_name,
    text_field,
)
from .cache_safety import (
    ENTRY_READ_FLAGS,
    SUPPORTED,
    TEMP_WRITE_FLAGS,
    InvalidEntry,
    UnsafeDirectory,
    check_entry_file,
    open_checked_directory,
    printable,
    read_exactly,
)

logger = logging.getLogger("hipattn")

def default_cache_dir() -> Path:
    """``$HIPATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/hipattn``, else ``~/.cache/hipattn``."""
    explicit = os.environ.get("HIPATTN_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "hipattn"


def cache_key(
    *,
    source: str,
    headers: Mapping[str, str],
    name_expression: str,
    spec_text: str,
    options: Iterable[str],
    arch: str,
    compiler_identity: str,
    format_version: int = CACHE_FORMAT_VERSION,
) -> str:
    """The hex sha256 naming one binary. Pass ``arch`` in full (``gfx90a:xnack-``, ``sm_90a``)."""
    digest = hashlib.sha256()

    def field(tag: str, value: str) -> None:
        # Tag + length prefix: "ab"+"c" and "a"+"bc" must not collide, nor a header named like an option.
        data = value.encode()
        digest.update(f"{tag}:{len(data)}:".encode())
        digest.update(data)

    field("format", str(format_version))
    field("compiler", compiler_identity)
    field("arch", arch)
    field("spec", spec_text)
    field("name_expression", name_expression)
    options = tuple(options)
    field("options", str(len(options)))
    for option in options:
        field("option", option)
    field("source", source)
    # Sorted, so the key does not depend on the order the include walk found the headers in.
    field("headers", str(len(headers)))
    for name in sorted(headers):
        field("header_name", name)
        field("header", headers[name])
    return digest.hexdigest()


@dataclass(frozen=True)
class CacheEntryInfo:
    """One valid entry on disk, as ``hipattn list`` shows it."""

    spec: str  # canonical text (KernelSpec.canonical)
    family: str
    arch: str
    compiler: str
    size: int  # bytes on disk
    age_seconds: float
    path: Path



class DiskCache:
    """Compiled kernels by cache key, on disk when a safe directory is usable, else in memory.

    The directory is resolved to an absolute path (symbolic links followed) once, when the cache is
    built, then opened from ``/`` down one component at a time without following links, each
    component checked (``cache_safety.open_checked_directory``), and held open: every
    later read, write, rename and delete goes through that descriptor, so no path is looked up again.
    ``create=False`` leaves a missing directory missing (the cache is then empty and memory-only).

    Thread-safe: disk operations are atomic by construction and the memory map is guarded by a lock.
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, create: bool = True):
        self._lock = threading.Lock()
        # Used only when the disk cannot be written: keeps "compile once per process" true anyway.
        self._memory: dict[str, CompiledKernel] = {}
        self._write_warned = False
        self._fd: int | None = None
        self.missing = False  # the directory does not exist (and create=False)
        given = os.fspath(directory) if directory is not None else os.fspath(default_cache_dir())
        self.directory = Path(os.path.realpath(os.path.expanduser(given))) if given else Path()
        self.readable, self.writable = self._open_directory(given, create)

    # ---- directory ------------------------------------------------------------------------------
    def _open_directory(self, given: str, create: bool) -> tuple[bool, bool]:
        """(readable, writable). A read-only directory still serves verified entries (a pre-warmed
        cache baked into an image); an unsafe or missing one is not used at all."""
        where = printable(self.directory)
        if not SUPPORTED:
            logger.warning("hipattn cache: this platform cannot open %s safely (no O_NOFOLLOW or dir_fd); "
                           "compiling into memory only", where)
            return False, False
        if not given or self.directory == Path(self.directory.anchor):
            logger.warning(
                "hipattn cache dir '%s' is %s; compiling into memory only",
                printable(given),
                "an empty path" if not given else "a filesystem root",
            )
            return False, False
        try:
            self._fd = open_checked_directory(self.directory, create)
        except FileNotFoundError as error:
            if create:  # it vanished while being made
                logger.warning("hipattn cache dir %s is unusable (%s); compiling into memory only", where,
                               printable(error))
            else:
                self.missing = True
            return False, False
        except UnsafeDirectory as error:
            logger.warning("hipattn cache dir %s: %s; refusing to load code from it and compiling into memory only",
                           where, error)
            return False, False
        except OSError as error:
            logger.warning("hipattn cache dir %s is unusable (%s); compiling into memory only", where,
                           printable(error))
            return False, False
        access = {"effective_ids": True} if os.access in os.supports_effective_ids else {}
        if not os.access(".", os.W_OK | os.X_OK, dir_fd=self._fd, **access):
            logger.warning(
                "hipattn cache dir %s is read-only; reading existing entries, keeping new ones in memory only", where
            )
            self._write_warned = True
            return True, False
        return True, True

    def close(self) -> None:
        """Release the directory descriptor; the cache then works in memory only."""
        fd, self._fd = self._fd, None
        self.readable = self.writable = False
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:  # already closed with the process's other descriptors
                pass

    # ---- lookups -----------------------------------------------------------------------------------
    def get(self, key: str, arch: str | None = None) -> CompiledKernel | None:
        """The kernel stored under ``key``, or None. With ``arch``, an entry built for another arch
        is also a miss. An invalid entry is logged and deleted."""
        with self._lock:
            compiled = self._memory.get(key)
        if compiled is not None or not self.readable:
            return compiled
        name = entry_name(key)
        try:
            metadata, binary, _ = self._read_entry(name)
            if metadata.get("key") != key:
                raise InvalidEntry(f"it holds the entry for key {printable(repr(metadata.get('key')))}")
            if arch is not None and metadata.get("arch") != arch:
                raise InvalidEntry(f"it was built for {printable(repr(metadata.get('arch')))}, not {arch!r}")
            lowered_name, log = metadata["lowered_name"], metadata.get("log", "")
            if not (isinstance(lowered_name, str) and lowered_name and isinstance(log, str)):
                raise InvalidEntry("its lowered name or log is not text")
            return CompiledKernel(binary=binary, lowered_name=lowered_name, log=log)
        except FileNotFoundError:
            return None
        except (InvalidEntry, KeyError, TypeError, ValueError) as error:
            logger.warning("hipattn cache: discarding invalid entry %s: %s; recompiling",
                           printable(self.directory / name), printable(error))
            self._unlink(name)
            return None
        except OSError as error:
            logger.warning("hipattn cache: cannot read %s (%s); recompiling", printable(self.directory / name),
                           printable(error))
            return None

    def discard(self, key: str) -> None:
        """Forget ``key``, on disk and in memory: for an entry that verified but would not load."""
        with self._lock:
            self._memory.pop(key, None)
        if self.writable:
            self._unlink(entry_name(key))

    def _read_entry(self, name: str) -> tuple[dict[str, Any], bytes, int]:
        """(metadata, binary, bytes on disk) of the entry file ``name``, opened without following links or blocking
        and checked before a byte is read: a regular file of this user's, writable by no one else,
        of plausible size; then the header, then exactly the body it announces."""
        try:
            fd = os.open(name, ENTRY_READ_FLAGS, dir_fd=self._fd)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise InvalidEntry("it is a symbolic link") from None
            raise
        try:
            info = os.fstat(fd)
            check_entry_file(info)
            checksum, length = decode_header(read_exactly(fd, HEADER.size))
            if HEADER.size + length != info.st_size:
                raise InvalidEntry(f"truncated (body {info.st_size - HEADER.size} bytes, header says {length})")
            return (*decode_body(read_exactly(fd, length), checksum), info.st_size)
        finally:
            os.close(fd)

    def put(self, key: str, compiled: CompiledKernel, metadata: Mapping[str, Any]) -> None:
        """Publish ``compiled`` under ``key``. Never raises for disk trouble: it falls back to memory.

        ``metadata`` should name at least ``spec`` (canonical text), ``family`` and ``arch``;
        the cache adds the key, the lowered name, the log, the format version and the time.
        """
        name = entry_name(key)
        if not self.writable:
            with self._lock:
                self._memory[key] = compiled
            return
        record = dict(metadata)
        record.update(
            key=key,
            lowered_name=compiled.lowered_name,
            log=compiled.log,
            format=CACHE_FORMAT_VERSION,
            created=time.time(),
        )
        data = encode(record, compiled.binary)
        temp = temp_name(key)
        try:
            fd = os.open(temp, TEMP_WRITE_FLAGS, 0o600, dir_fd=self._fd)
            with os.fdopen(fd, "wb") as file:
                file.write(data)
            # No fsync: after a power loss a renamed-but-empty file fails the hash check and is
            # rebuilt, which is cheaper than an fsync on every compile.
            os.replace(temp, name, src_dir_fd=self._fd, dst_dir_fd=self._fd)
        except OSError as error:
            self._unlink(temp)
            with self._lock:
                self._memory[key] = compiled
                warn = not self._write_warned
                self._write_warned = True
                self.writable = False
            if warn:
                logger.warning(
                    "hipattn cache: cannot write %s (%s); keeping compiled kernels in memory only",
                    printable(self.directory),
                    printable(error),
                )
            return
        logger.debug("hipattn cache: stored %s (%d bytes)", name, len(data))

    # ---- inventory -----------------------------------------------------------------------------
    def _names(self) -> list[str]:
        if not self.readable:
            return []
        try:
            return sorted(os.listdir(self._fd))
        except OSError:
            return []

    def entries(self) -> list[CacheEntryInfo]:
        """Every valid entry on disk (invalid ones are skipped here; a lookup would rebuild them)."""
        now = time.time()
        found = []
        for name in self._names():
            if not ENTRY_NAME.fullmatch(name):
                continue
            try:
                metadata, _, size = self._read_entry(name)
                created = metadata.get("created", now)
                found.append(
                    CacheEntryInfo(
                        spec=text_field(metadata, "spec"),
                        family=text_field(metadata, "family"),
                        arch=text_field(metadata, "arch"),
                        compiler=text_field(metadata, "compiler", ""),
                        size=size,
                        age_seconds=max(0.0, now - float(created)) if isinstance(created, (int, float)) else 0.0,
                        path=self.directory / name,
                    )
                )
            except Exception as error:  # a listing reports; whatever one entry holds, it never fails
                logger.debug("hipattn cache: skipping %s in listing: %s", name, printable(error))
        return found

    def total_size(self) -> int:
        """Bytes on disk taken by entry files (valid or not)."""
        total = 0
        for name in self._names():
            if ENTRY_NAME.fullmatch(name):
                try:
                    info = os.stat(name, dir_fd=self._fd, follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(info.st_mode):
                    total += info.st_size
        return total

    def clear(self) -> int:
        """Delete every entry and temporary files left by killed writers; returns entries removed.

        Only what hipattn itself writes goes: regular files named ``<64 hex>.hipattn`` whose header
        starts with the entry magic (any format version, intact or not), and temporary files named
        exactly as ``put`` names them. Anything else in the directory stays.
        """
        with self._lock:
            removed = len(self._memory)
            self._memory.clear()
        if not self.writable:
            return removed
        for name in self._names():
            if TEMP_NAME.fullmatch(name):
                if self._is_regular(name):
                    self._unlink(name)
            elif ENTRY_NAME.fullmatch(name) and self._has_entry_magic(name) and self._unlink(name):
                removed += 1
        return removed

    def _is_regular(self, name: str) -> bool:
        try:
            return stat.S_ISREG(os.stat(name, dir_fd=self._fd, follow_symlinks=False).st_mode)
        except OSError:
            return False

    def _has_entry_magic(self, name: str) -> bool:
        try:
            fd = os.open(name, ENTRY_READ_FLAGS, dir_fd=self._fd)
        except OSError:
            return False
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return False
            return os.read(fd, len(MAGIC)) == MAGIC
        except OSError:
            return False
        finally:
            os.close(fd)

    def _unlink(self, name: str) -> bool:
        if self._fd is None:
            return False
        try:
            os.unlink(name, dir_fd=self._fd)
            return True
        except OSError:
            return False



_default_cache: DiskCache | None = None
_default_cache_lock = threading.Lock()


def default_cache() -> DiskCache:
    """The process-wide cache at ``default_cache_dir()``, created (and its warnings logged) on first use."""
    global _default_cache
    with _default_cache_lock:
        if _default_cache is None:
            _default_cache = DiskCache()
        return _default_cache
