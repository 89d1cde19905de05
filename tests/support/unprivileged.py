"""Running test code as a user other than root, so that checks root bypasses can be tested as root.

CI runs the suite as root, and root writes into read-only directories and owns everything it
creates. ``run_unprivileged`` runs a function as uid/gid 65534 (``nobody``): directly when the
tests already run unprivileged, else in a forked child that drops its privileges first. A forked
child, not a fresh interpreter: the interpreter may live where ``nobody`` cannot read it (under
/root), while a fork already has every module it needs loaded.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

NOBODY = 65534


def running_as_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def unprivileged_uid() -> int:
    """The uid ``run_unprivileged`` runs as."""
    return NOBODY if running_as_root() else os.geteuid()


def run_unprivileged(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` as a non-root user; its return value (pickled) comes back. An exception
    in the child is raised here as AssertionError carrying the child's traceback."""
    if not running_as_root():
        return function(*args)
    if not hasattr(os, "fork"):
        pytest.skip("the tests run as root and this platform cannot fork a child to drop root in")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop root, run, report, and leave without running any of pytest's exit code
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                payload = ("returned", function(*args))
            except BaseException:
                payload = ("raised", traceback.format_exc())
            with os.fdopen(write, "wb") as channel:
                channel.write(pickle.dumps(payload))
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as channel:
        data = channel.read()
    os.waitpid(pid, 0)
    if not data:
        raise AssertionError("the unprivileged child died before reporting")
    outcome, value = pickle.loads(data)
    if outcome == "raised":
        raise AssertionError(f"in the unprivileged child (uid {NOBODY}):\n{value}")
    return value


@contextmanager
def unprivileged_directory() -> Iterator[str]:
    """A fresh directory owned by ``unprivileged_uid()``, mode 0700, in the system's sticky temporary
    directory (pytest's own tmp_path lies under a 0700 directory of root's that nobody cannot enter)."""
    path = tempfile.mkdtemp(prefix="hipattn-unprivileged-", dir="/tmp" if os.path.isdir("/tmp") else None)
    try:
        if running_as_root():
            os.chown(path, NOBODY, NOBODY)
        yield path
    finally:
        for root, dirs, _ in os.walk(path):
            for name in dirs:
                os.chmod(os.path.join(root, name), 0o700)
        shutil.rmtree(path, ignore_errors=True)
