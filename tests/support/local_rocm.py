"""Point hip-python at this project's compile-only ROCm 5.2 when nothing else is configured.

Debian's ROCm 5.2 hiprtc lives inside libamdhip64.so.5; /opt/rocm52/lib links the two names hip-python
looks for (libamdhip64.so, libhiprtc.so) to it (as .ci/run does). hip-python reads ROCM_PATH once, at
its first call into either library, and remembers a failure, so every test module that may touch it
calls this at import: pytest imports all test modules before it runs any test.
"""

from __future__ import annotations

import os
from pathlib import Path

LOCAL_ROCM = Path("/opt/rocm52")


def use_local_rocm() -> None:
    if "ROCM_PATH" not in os.environ and (LOCAL_ROCM / "lib").is_dir():
        os.environ["ROCM_PATH"] = str(LOCAL_ROCM)
