"""A compile that never finishes, for ``hipattn.cli.run_compile_pool`` in tests: each call records
its worker's pid in the cache directory it is given, then sleeps far longer than any test waits.
In a module of its own so that spawned workers can import it by name."""

from __future__ import annotations

import os
import time


def record_pid_then_sleep(spec_text: str, arch: str, cache_dir: str):
    with open(os.path.join(cache_dir, f"worker-{os.getpid()}"), "w") as marker:
        marker.write(spec_text)
    time.sleep(600)
    raise AssertionError("a sleeping compile outlived its test")
