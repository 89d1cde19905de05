"""The cache's checks of what it finds on disk: it executes what it loads, so nothing it opens may be
something another user could have put or changed there.

The cache directory is opened from ``/`` one component at a time without following links, and each
component checked (``open_checked_directory``): the cache itself must be this user's and writable by
no one else; a directory above it must belong to root or this user and be writable by no one else
unless it is sticky. Entry files are opened without following links or blocking and checked before a
byte is read (``check_entry_file``): a regular file of this user's, writable by no one else, no larger
than ``MAX_ENTRY_BYTES``. ``printable`` escapes what the cache logs, so a path or a metadata field
cannot forge a log line or drive the terminal.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

# No entry comes near this (kernels are kilobytes to a few megabytes); anything larger is refused
# before it is read, so a planted or runaway file cannot make a lookup allocate gigabytes.
MAX_ENTRY_BYTES = 256 << 20

# The cache needs these POSIX flags and descriptor-relative calls; without them it is memory-only.
SUPPORTED = all(hasattr(os, flag) for flag in ("O_DIRECTORY", "O_NOFOLLOW", "O_NONBLOCK", "geteuid")) and (
    os.open in os.supports_dir_fd
)
_NOFOLLOW, _CLOEXEC = getattr(os, "O_NOFOLLOW", 0), getattr(os, "O_CLOEXEC", 0)
_DIRECTORY_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW | _CLOEXEC
# O_NONBLOCK: opening a FIFO named like an entry returns at once (and fstat then refuses it).
ENTRY_READ_FLAGS = os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | _CLOEXEC
TEMP_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


class InvalidEntry(Exception):
    """An entry file that must not be loaded; the message says why."""


class UnsafeDirectory(Exception):
    """A cache directory (or one above it) that someone else could change; the message says how."""


def printable(text: object) -> str:
    """``text`` with control characters (and the Unicode ones that move or reorder a line) written
    as escapes, so that a path or a metadata field cannot forge a log line or drive the terminal."""
    return _UNPRINTABLE.sub(_escape, str(text))


_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def open_checked_directory(directory: Path, create: bool) -> int:
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
        raise UnsafeDirectory(f"{printable(path)} above it belongs to uid {info.st_uid}, neither root nor this user (uid {euid})")
    if info.st_mode & _WRITABLE_BY_OTHERS and not info.st_mode & stat.S_ISVTX:
        raise UnsafeDirectory(
            f"{printable(path)} above it is writable by group or others and not sticky (mode "
            f"{stat.S_IMODE(info.st_mode):o}). Fix with: chmod go-w {printable(path)}"
        )


def _check_cache_directory(info: os.stat_result, path: Path) -> None:
    euid = os.geteuid()
    if info.st_mode & _WRITABLE_BY_OTHERS:
        raise UnsafeDirectory(
            f"it is writable by group or others (mode {stat.S_IMODE(info.st_mode):o}). Fix with: chmod go-w {printable(path)}"
        )
    if info.st_uid != euid:
        raise UnsafeDirectory(f"it belongs to uid {info.st_uid}, not to this user (uid {euid})")


def check_entry_file(info: os.stat_result) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise InvalidEntry("it is not a regular file")
    if info.st_uid != os.geteuid():
        raise InvalidEntry(f"it belongs to uid {info.st_uid}, not to this user (uid {os.geteuid()})")
    if info.st_mode & _WRITABLE_BY_OTHERS:
        raise InvalidEntry(f"it is writable by group or others (mode {stat.S_IMODE(info.st_mode):o})")
    if info.st_size > MAX_ENTRY_BYTES:
        raise InvalidEntry(f"it has {info.st_size} bytes, more than any entry ({MAX_ENTRY_BYTES})")


def read_exactly(fd: int, count: int) -> bytes:
    chunks = []
    while count:
        chunk = os.read(fd, min(count, 1 << 24))
        if not chunk:
            raise InvalidEntry("truncated (shorter than its header says)")
        chunks.append(chunk)
        count -= len(chunk)
    return b"".join(chunks)
