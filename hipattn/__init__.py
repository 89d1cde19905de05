"""hipattn: fused-attention kernels for AMD and NVIDIA GPUs, compiled at run time.

    import hipattn
    out = hipattn.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)

``flash_attn_func`` / ``flash_attn_varlen_func`` / ``flash_attn_with_kvcache`` mirror flash-attn's API,
as do its packed forms (``flash_attn_qkvpacked_func``, ``flash_attn_kvpacked_func`` and their varlen
variants), which split the packed array into views;
``forward`` and ``backward`` are the low-level entry points that take caller-provided outputs
(``flash_attn_with_kvcache`` takes them as keywords). Set ``HIPATTN_LOG=debug`` to log
dispatch decisions and compiles.
"""

from __future__ import annotations

from .api import flash_attn_func, flash_attn_varlen_func
from .attention import backward, backward_workspace_bytes, forward
from .kvcache import flash_attn_with_kvcache, kvcache_workspace_bytes
from .log import configure_from_environment
from .packed import (
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)

__version__ = "0.1.0"
__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "forward", "backward",
           "backward_workspace_bytes", "kvcache_workspace_bytes", "flash_attn_qkvpacked_func",
           "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func",
           "__version__"]

configure_from_environment()
