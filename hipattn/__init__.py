"""hipattn: fused-attention kernels for AMD and NVIDIA GPUs, compiled at run time."""

from __future__ import annotations

__version__ = "0.1.0"
