"""The on-disk compile cache: one self-checking file per compiled kernel instantiation.

The key (``cache_key``) is a sha256 over everything that changes the binary: the instantiated
compile unit, every header it includes (name and content), the name expression, the spec's
canonical text, the compile options, the full arch string, the compiler's identity and
``CACHE_FORMAT_VERSION``. Each field is length-prefixed, so no two different inputs hash the same
byte stream.

An entry file is::

    magic (8 bytes) | format version (u32) | sha256 of body (32 bytes) | body length (u64) | body
    body = metadata length (u32) | metadata JSON | binary

A file that fails any check (magic, version, length, hash, JSON, or its metadata names another key
or arch) is a miss: it is logged, deleted and rebuilt, never loaded. Entries are published with a
temporary file in the same directory and ``os.replace``, so a reader sees the old file or the new
one, never a partial one, and two processes writing the same key both succeed.

The cache executes what it loads, so it refuses a directory that someone else could write into
(group/other-writable, or owned by another user). A directory that cannot be created, is read-only
or fills up degrades to an in-memory cache with one warning; no call ever fails because of the cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import stat
import struct
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..backends.base import CompiledKernel

logger = logging.getLogger("hipattn")

# Bump whenever the entry layout, the key's fields or the meaning of a cached binary changes: old
# entries then simply stop matching (the version is hashed into every key) and age out via `clear`.
CACHE_FORMAT_VERSION = 1

_MAGIC = b"HIPATTN\x1a"  # \x1a stops `type`/`cat`-style tools from dumping the binary
_HEADER = struct.Struct("<8sI32sQ")  # magic, format version, sha256(body), len(body)
_META_LEN = struct.Struct("<I")
_ENTRY_SUFFIX = ".hipattn"
_TEMP_SUFFIX = ".tmp"


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


class _InvalidEntry(Exception):
    """An entry file that must not be loaded; the message says why."""


class DiskCache:
    """Compiled kernels by cache key, on disk when a safe directory is usable, else in memory.

    Thread-safe: disk operations are atomic by construction and the memory map is guarded by a lock.
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None):
        self.directory = Path(directory).expanduser() if directory is not None else default_cache_dir()
        self._lock = threading.Lock()
        # Used only when the disk cannot be written: keeps "compile once per process" true anyway.
        self._memory: dict[str, CompiledKernel] = {}
        self._write_warned = False
        self.readable, self.writable = self._open_directory()

    # ---- directory ------------------------------------------------------------------------------
    def _open_directory(self) -> tuple[bool, bool]:
        """(readable, writable). A read-only directory still serves verified entries (a pre-warmed
        cache baked into an image); an unsafe or missing one is not used at all."""
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            info = self.directory.stat()
        except OSError as error:
            logger.warning(
                "hipattn cache dir %s is unusable (%s); compiling into memory only", self.directory, error
            )
            return False, False
        if not stat.S_ISDIR(info.st_mode):
            logger.warning(
                "hipattn cache dir %s is not a directory; compiling into memory only", self.directory
            )
            return False, False
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            logger.warning(
                "hipattn cache dir %s is writable by group or others (mode %o); refusing to load code from it "
                "and compiling into memory only. Fix with: chmod go-w %s",
                self.directory,
                stat.S_IMODE(info.st_mode),
                self.directory,
            )
            return False, False
        if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
            logger.warning(
                "hipattn cache dir %s belongs to uid %d, not to this user (uid %d); refusing to load code from "
                "it and compiling into memory only",
                self.directory,
                info.st_uid,
                os.geteuid(),
            )
            return False, False
        if not os.access(self.directory, os.W_OK | os.X_OK):
            logger.warning(
                "hipattn cache dir %s is read-only; reading existing entries, keeping new ones in memory only",
                self.directory,
            )
            self._write_warned = True
            return True, False
        return True, True

    def _entry_path(self, key: str) -> Path:
        if not key or any(c not in "0123456789abcdef" for c in key):
            raise ValueError(f"cache key {key!r} is not a lowercase hex digest")
        return self.directory / f"{key}{_ENTRY_SUFFIX}"

    # ---- lookups -----------------------------------------------------------------------------------
    def get(self, key: str, arch: str | None = None) -> CompiledKernel | None:
        """The kernel stored under ``key``, or None. With ``arch``, an entry built for another arch
        is also a miss. An invalid entry is logged and deleted."""
        with self._lock:
            compiled = self._memory.get(key)
        if compiled is not None or not self.readable:
            return compiled
        path = self._entry_path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as error:
            logger.warning("hipattn cache: cannot read %s (%s); recompiling", path, error)
            return None
        try:
            metadata, binary = _decode(data)
            if metadata.get("key") != key:
                raise _InvalidEntry(f"it holds the entry for key {metadata.get('key')!r}")
            if arch is not None and metadata.get("arch") != arch:
                raise _InvalidEntry(f"it was built for {metadata.get('arch')!r}, not {arch!r}")
            return CompiledKernel(
                binary=binary, lowered_name=metadata["lowered_name"], log=metadata.get("log", "")
            )
        except (_InvalidEntry, KeyError, TypeError) as error:
            logger.warning("hipattn cache: discarding invalid entry %s: %s; recompiling", path, error)
            self._discard(path)
            return None

    def put(self, key: str, compiled: CompiledKernel, metadata: Mapping[str, Any]) -> None:
        """Publish ``compiled`` under ``key``. Never raises for disk trouble: it falls back to memory.

        ``metadata`` should name at least ``spec`` (canonical text), ``family`` and ``arch``;
        the cache adds the key, the lowered name, the log, the format version and the time.
        """
        path = self._entry_path(key)
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
        data = _encode(record, compiled.binary)
        # Unique per process and call, in the same directory so os.replace is an atomic rename.
        temp = self.directory / f".{key}.{os.getpid()}.{secrets.token_hex(6)}{_TEMP_SUFFIX}"
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as file:
                file.write(data)
            # No fsync: after a power loss a renamed-but-empty file fails the hash check and is
            # rebuilt, which is cheaper than an fsync on every compile.
            os.replace(temp, path)
        except OSError as error:
            self._discard(temp)
            with self._lock:
                self._memory[key] = compiled
                warn = not self._write_warned
                self._write_warned = True
                self.writable = False
            if warn:
                logger.warning(
                    "hipattn cache: cannot write %s (%s); keeping compiled kernels in memory only",
                    self.directory,
                    error,
                )
            return
        logger.debug("hipattn cache: stored %s (%d bytes)", path.name, len(data))

    # ---- inventory -----------------------------------------------------------------------------
    def _entry_files(self) -> list[Path]:
        if not self.readable:
            return []
        try:
            return sorted(p for p in self.directory.iterdir() if p.name.endswith(_ENTRY_SUFFIX))
        except OSError:
            return []

    def entries(self) -> list[CacheEntryInfo]:
        """Every valid entry on disk (invalid ones are skipped here; a lookup would rebuild them)."""
        now = time.time()
        found = []
        for path in self._entry_files():
            try:
                data = path.read_bytes()
                metadata, _ = _decode(data)
                found.append(
                    CacheEntryInfo(
                        spec=_text_field(metadata, "spec"),
                        family=_text_field(metadata, "family"),
                        arch=metadata["arch"],
                        compiler=metadata.get("compiler", ""),
                        size=len(data),
                        age_seconds=max(0.0, now - float(metadata.get("created", now))),
                        path=path,
                    )
                )
            except (OSError, _InvalidEntry, KeyError, TypeError, ValueError) as error:
                logger.debug("hipattn cache: skipping %s in listing: %s", path, error)
        return found

    def total_size(self) -> int:
        """Bytes on disk taken by entry files (valid or not)."""
        total = 0
        for path in self._entry_files():
            try:
                total += path.stat().st_size
            except OSError:
                pass
        return total

    def clear(self) -> int:
        """Delete every entry (and temporary files left by killed writers); returns entries removed."""
        with self._lock:
            removed = len(self._memory)
            self._memory.clear()
        if not self.writable:
            return removed
        try:
            paths = list(self.directory.iterdir())
        except OSError:
            return removed
        for path in paths:
            if path.name.endswith(_ENTRY_SUFFIX) or (
                path.name.startswith(".") and path.name.endswith(_TEMP_SUFFIX)
            ):
                if self._discard(path) and path.name.endswith(_ENTRY_SUFFIX):
                    removed += 1
        return removed

    @staticmethod
    def _discard(path: Path) -> bool:
        try:
            path.unlink()
            return True
        except OSError:
            return False


def _text_field(metadata: Mapping[str, Any], name: str) -> str:
    value = metadata[name]
    if not isinstance(value, str):
        raise _InvalidEntry(f"metadata field {name!r} is not text")
    return value


def _encode(metadata: Mapping[str, Any], binary: bytes) -> bytes:
    meta = json.dumps(metadata, sort_keys=True).encode()
    body = _META_LEN.pack(len(meta)) + meta + binary
    return _HEADER.pack(_MAGIC, CACHE_FORMAT_VERSION, hashlib.sha256(body).digest(), len(body)) + body


def _decode(data: bytes) -> tuple[dict[str, Any], bytes]:
    """(metadata, binary) of a verified entry; raises _InvalidEntry naming the first failed check."""
    if len(data) < _HEADER.size:
        raise _InvalidEntry(f"truncated ({len(data)} bytes, shorter than the header)")
    magic, version, checksum, length = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        raise _InvalidEntry("not a hipattn cache entry (wrong magic)")
    if version != CACHE_FORMAT_VERSION:
        raise _InvalidEntry(f"format version {version}, expected {CACHE_FORMAT_VERSION}")
    body = data[_HEADER.size :]
    if len(body) != length:
        raise _InvalidEntry(f"truncated (body {len(body)} bytes, header says {length})")
    if hashlib.sha256(body).digest() != checksum:
        raise _InvalidEntry("checksum mismatch (corrupt)")
    if len(body) < _META_LEN.size:
        raise _InvalidEntry("body too short for its metadata")
    (meta_length,) = _META_LEN.unpack_from(body)
    meta_end = _META_LEN.size + meta_length
    if meta_end > len(body):
        raise _InvalidEntry("metadata runs past the end of the body")
    try:
        metadata = json.loads(body[_META_LEN.size : meta_end])
    except ValueError as error:
        raise _InvalidEntry(f"unreadable metadata ({error})") from None
    if not isinstance(metadata, dict):
        raise _InvalidEntry("metadata is not a JSON object")
    return metadata, body[meta_end:]


_default_cache: DiskCache | None = None
_default_cache_lock = threading.Lock()


def default_cache() -> DiskCache:
    """The process-wide cache at ``default_cache_dir()``, created (and its warnings logged) on first use."""
    global _default_cache
    with _default_cache_lock:
        if _default_cache is None:
            _default_cache = DiskCache()
        return _default_cache
