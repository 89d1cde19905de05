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

import errno
import hashlib
import json
import logging
import os
import re
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


class _UnsafeDirectory(Exception):
    """A cache directory (or one above it) that someone else could change; the message says how."""


def printable(text: object) -> str:
    """``text`` with control characters (and the Unicode ones that move or reorder a line) written
    as escapes, so that a path or a metadata field cannot forge a log line or drive the terminal."""
    return _UNPRINTABLE.sub(_escape, str(text))


_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


class DiskCache:
    """Compiled kernels by cache key, on disk when a safe directory is usable, else in memory.

    The directory is resolved to an absolute path (symbolic links followed) once, when the cache is
    built, then opened from ``/`` down one component at a time without following links, each
    component checked (see ``_check_ancestor`` and ``_check_cache_directory``), and held open: every
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
        if not _SUPPORTED:
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
            self._fd = _open_checked_directory(self.directory, create)
        except FileNotFoundError as error:
            if create:  # it vanished while being made
                logger.warning("hipattn cache dir %s is unusable (%s); compiling into memory only", where,
                               printable(error))
            else:
                self.missing = True
            return False, False
        except _UnsafeDirectory as error:
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
        name = _entry_name(key)
        try:
            metadata, binary, _ = self._read_entry(name)
            if metadata.get("key") != key:
                raise _InvalidEntry(f"it holds the entry for key {printable(repr(metadata.get('key')))}")
            if arch is not None and metadata.get("arch") != arch:
                raise _InvalidEntry(f"it was built for {printable(repr(metadata.get('arch')))}, not {arch!r}")
            lowered_name, log = metadata["lowered_name"], metadata.get("log", "")
            if not (isinstance(lowered_name, str) and lowered_name and isinstance(log, str)):
                raise _InvalidEntry("its lowered name or log is not text")
            return CompiledKernel(binary=binary, lowered_name=lowered_name, log=log)
        except FileNotFoundError:
            return None
        except (_InvalidEntry, KeyError, TypeError, ValueError) as error:
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
            self._unlink(_entry_name(key))

    def _read_entry(self, name: str) -> tuple[dict[str, Any], bytes, int]:
        """(metadata, binary, bytes on disk) of the entry file ``name``, opened without following links or blocking
        and checked before a byte is read: a regular file of this user's, writable by no one else,
        of plausible size; then the header, then exactly the body it announces."""
        try:
            fd = os.open(name, _ENTRY_READ_FLAGS, dir_fd=self._fd)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise _InvalidEntry("it is a symbolic link") from None
            raise
        try:
            info = os.fstat(fd)
            _check_entry_file(info)
            checksum, length = _decode_header(_read_exactly(fd, _HEADER.size))
            if _HEADER.size + length != info.st_size:
                raise _InvalidEntry(f"truncated (body {info.st_size - _HEADER.size} bytes, header says {length})")
            return (*_decode_body(_read_exactly(fd, length), checksum), info.st_size)
        finally:
            os.close(fd)

    def put(self, key: str, compiled: CompiledKernel, metadata: Mapping[str, Any]) -> None:
        """Publish ``compiled`` under ``key``. Never raises for disk trouble: it falls back to memory.

        ``metadata`` should name at least ``spec`` (canonical text), ``family`` and ``arch``;
        the cache adds the key, the lowered name, the log, the format version and the time.
        """
        name = _entry_name(key)
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
        temp = f".{key}.{os.getpid()}.{secrets.token_hex(6)}{_TEMP_SUFFIX}"
        try:
            fd = os.open(temp, _TEMP_WRITE_FLAGS, 0o600, dir_fd=self._fd)
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
            if not _ENTRY_NAME.fullmatch(name):
                continue
            try:
                metadata, _, size = self._read_entry(name)
                created = metadata.get("created", now)
                found.append(
                    CacheEntryInfo(
                        spec=_text_field(metadata, "spec"),
                        family=_text_field(metadata, "family"),
                        arch=_text_field(metadata, "arch"),
                        compiler=_text_field(metadata, "compiler", ""),
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
            if _ENTRY_NAME.fullmatch(name):
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
            if _TEMP_NAME.fullmatch(name):
                if self._is_regular(name):
                    self._unlink(name)
            elif _ENTRY_NAME.fullmatch(name) and self._has_entry_magic(name) and self._unlink(name):
                removed += 1
        return removed

    def _is_regular(self, name: str) -> bool:
        try:
            return stat.S_ISREG(os.stat(name, dir_fd=self._fd, follow_symlinks=False).st_mode)
        except OSError:
            return False

    def _has_entry_magic(self, name: str) -> bool:
        try:
            fd = os.open(name, _ENTRY_READ_FLAGS, dir_fd=self._fd)
        except OSError:
            return False
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return False
            return os.read(fd, len(_MAGIC)) == _MAGIC
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


# ---- the checks ------------------------------------------------------------------------------------

# No entry comes near this (kernels are kilobytes to a few megabytes); anything larger is refused
# before it is read, so a planted or runaway file cannot make a lookup allocate gigabytes.
MAX_ENTRY_BYTES = 256 << 20

_ENTRY_NAME = re.compile(r"[0-9a-f]{64}" + re.escape(_ENTRY_SUFFIX))
_TEMP_NAME = re.compile(r"\.[0-9a-f]{64}\.[0-9]+\.[0-9a-f]{12}" + re.escape(_TEMP_SUFFIX))
# The cache needs these POSIX flags and descriptor-relative calls; without them it is memory-only.
_SUPPORTED = all(hasattr(os, flag) for flag in ("O_DIRECTORY", "O_NOFOLLOW", "O_NONBLOCK", "geteuid")) and (
    os.open in os.supports_dir_fd
)
_NOFOLLOW, _CLOEXEC = getattr(os, "O_NOFOLLOW", 0), getattr(os, "O_CLOEXEC", 0)
_DIRECTORY_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW | _CLOEXEC
# O_NONBLOCK: opening a FIFO named like an entry returns at once (and fstat then refuses it).
_ENTRY_READ_FLAGS = os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | _CLOEXEC
_TEMP_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


def _entry_name(key: str) -> str:
    if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
        raise ValueError(f"cache key {key!r} is not a lowercase sha256 hex digest")
    return f"{key}{_ENTRY_SUFFIX}"


def _open_checked_directory(directory: Path, create: bool) -> int:
    """A descriptor of ``directory`` (absolute, links resolved), opened from ``/`` one component at
    a time with O_NOFOLLOW, so the chain checked is the chain opened. Missing components are created
    (mode 0700) when ``create``; FileNotFoundError otherwise."""
    fd = os.open(directory.anchor, _DIRECTORY_FLAGS)
    try:
        current = Path(directory.anchor)
        _check_ancestor(os.fstat(fd), current)
        components = directory.parts[1:]
        for i, name in enumerate(components):
            try:
                child = os.open(name, _DIRECTORY_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(name, 0o700, dir_fd=fd)
                except FileExistsError:  # another process made it first: checked below all the same
                    pass
                child = os.open(name, _DIRECTORY_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
            current = current / name
            info = os.fstat(fd)
            if i == len(components) - 1:
                _check_cache_directory(info, current)
            else:
                _check_ancestor(info, current)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _check_ancestor(info: os.stat_result, path: Path) -> None:
    """A directory above the cache: whoever can rename entries in it can swap the cache for theirs,
    so it must belong to root or this user, and be writable by no one else unless it is sticky
    (like /tmp: then others cannot rename what is not theirs)."""
    euid = os.geteuid()
    if info.st_uid not in (0, euid):
        raise _UnsafeDirectory(f"{printable(path)} above it belongs to uid {info.st_uid}, neither root nor this user (uid {euid})")
    if info.st_mode & _WRITABLE_BY_OTHERS and not info.st_mode & stat.S_ISVTX:
        raise _UnsafeDirectory(
            f"{printable(path)} above it is writable by group or others and not sticky (mode "
            f"{stat.S_IMODE(info.st_mode):o}). Fix with: chmod go-w {printable(path)}"
        )


def _check_cache_directory(info: os.stat_result, path: Path) -> None:
    euid = os.geteuid()
    if info.st_mode & _WRITABLE_BY_OTHERS:
        raise _UnsafeDirectory(
            f"it is writable by group or others (mode {stat.S_IMODE(info.st_mode):o}). Fix with: chmod go-w {printable(path)}"
        )
    if info.st_uid != euid:
        raise _UnsafeDirectory(f"it belongs to uid {info.st_uid}, not to this user (uid {euid})")


def _check_entry_file(info: os.stat_result) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise _InvalidEntry("it is not a regular file")
    if info.st_uid != os.geteuid():
        raise _InvalidEntry(f"it belongs to uid {info.st_uid}, not to this user (uid {os.geteuid()})")
    if info.st_mode & _WRITABLE_BY_OTHERS:
        raise _InvalidEntry(f"it is writable by group or others (mode {stat.S_IMODE(info.st_mode):o})")
    if info.st_size > MAX_ENTRY_BYTES:
        raise _InvalidEntry(f"it has {info.st_size} bytes, more than any entry ({MAX_ENTRY_BYTES})")


def _read_exactly(fd: int, count: int) -> bytes:
    chunks = []
    while count:
        chunk = os.read(fd, min(count, 1 << 24))
        if not chunk:
            raise _InvalidEntry("truncated (shorter than its header says)")
        chunks.append(chunk)
        count -= len(chunk)
    return b"".join(chunks)


def _text_field(metadata: Mapping[str, Any], field: str, default: str | None = None) -> str:
    value = metadata[field] if default is None else metadata.get(field, default)
    if not isinstance(value, str):
        raise _InvalidEntry(f"its {field} is not text")
    return value


# ---- the entry format ----------------------------------------------------------------------------------


def _encode(metadata: Mapping[str, Any], binary: bytes) -> bytes:
    meta = json.dumps(metadata, sort_keys=True).encode()
    body = _META_LEN.pack(len(meta)) + meta + binary
    return _HEADER.pack(_MAGIC, CACHE_FORMAT_VERSION, hashlib.sha256(body).digest(), len(body)) + body


def _decode_header(header: bytes) -> tuple[bytes, int]:
    """(sha256 of the body, body length) from an entry's header; _InvalidEntry naming what is wrong."""
    if len(header) < _HEADER.size:
        raise _InvalidEntry(f"truncated ({len(header)} bytes, shorter than the header)")
    magic, version, checksum, length = _HEADER.unpack_from(header)
    if magic != _MAGIC:
        raise _InvalidEntry("not a hipattn cache entry (wrong magic)")
    if version != CACHE_FORMAT_VERSION:
        raise _InvalidEntry(f"format version {version}, expected {CACHE_FORMAT_VERSION}")
    if length > MAX_ENTRY_BYTES:
        raise _InvalidEntry(f"its header announces {length} bytes, more than any entry ({MAX_ENTRY_BYTES})")
    return checksum, length


def _decode_body(body: bytes, checksum: bytes) -> tuple[dict[str, Any], bytes]:
    """(metadata, binary) of a body whose sha256 must be ``checksum``."""
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
    except (ValueError, RecursionError) as error:  # RecursionError: metadata nested thousands deep
        raise _InvalidEntry(f"unreadable metadata ({type(error).__name__})") from None
    if not isinstance(metadata, dict):
        raise _InvalidEntry("metadata is not a JSON object")
    return metadata, body[meta_end:]


def _decode(data: bytes) -> tuple[dict[str, Any], bytes]:
    """(metadata, binary) of a whole verified entry; raises _InvalidEntry naming the first failed check."""
    checksum, length = _decode_header(data[: _HEADER.size])
    body = data[_HEADER.size :]
    if len(body) != length:
        raise _InvalidEntry(f"truncated (body {len(body)} bytes, header says {length})")
    return _decode_body(body, checksum)


_default_cache: DiskCache | None = None
_default_cache_lock = threading.Lock()


def default_cache() -> DiskCache:
    """The process-wide cache at ``default_cache_dir()``, created (and its warnings logged) on first use."""
    global _default_cache
    with _default_cache_lock:
        if _default_cache is None:
            _default_cache = DiskCache()
        return _default_cache
