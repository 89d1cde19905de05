"""The flash backward's pre- and post-processing kernels: Delta = rowsum(dO * O), and dq_accum (fp32)
converted to dq. Both read rows with teams of lanes, 16 bytes per lane, for every head_dim the flash
path serves."""

from __future__ import annotations

import functools

from ..jit.params import ParamsStruct
from ..jit.spec import KernelFamily, KernelSpec
from .common import DTYPES, FLASH_HEAD_DIMS
from .fields import strided
from .index import register

# A row is read by a team of PREPROCESS_TEAM_LANES lanes with 16-byte accesses; the grid covers
# block_threads / team lanes rows per block.
PREPROCESS_BLOCK_THREADS = 256
PREPROCESS_TEAM_LANES = 8
PREPROCESS_ROWS_PER_BLOCK = PREPROCESS_BLOCK_THREADS // PREPROCESS_TEAM_LANES


def _preprocess_family(name: str, params: ParamsStruct) -> KernelFamily:
    family = KernelFamily(name=name, source=f"flash/{name}.hip", template=f"hipattn::{name}",
                          template_params=("dtype", "head_dim", "block_threads", "team_lanes"), params=params,
                          shipped=lambda target: [_spec(family, t, d) for t in DTYPES for d in FLASH_HEAD_DIMS])
    return register(family)


@functools.cache
def _spec(family: KernelFamily, dtype: str, head_dim: int) -> KernelSpec:
    return family.spec(dtype=dtype, head_dim=head_dim, block_threads=PREPROCESS_BLOCK_THREADS,
                       team_lanes=PREPROCESS_TEAM_LANES)


BWD_DOT_DO_O = _preprocess_family(
    "bwd_dot_do_o",
    ParamsStruct("DotDoOParams", strided("o") + strided("dout") + (
        ("d", "ptr"), ("d_batch_stride", "i64"), ("d_head_stride", "i64"),
        ("batch", "i32"), ("seqlen", "i32"), ("heads", "i32"))),
)
BWD_CONVERT_DQ = _preprocess_family(
    "bwd_convert_dq",
    ParamsStruct("ConvertDqParams", strided("dq_accum") + strided("dq") + (
        ("scale", "f32"), ("batch", "i32"), ("seqlen", "i32"), ("heads", "i32"))),
)


def dot_do_o_spec(dtype: str, head_dim: int) -> KernelSpec:
    return _spec(BWD_DOT_DO_O, dtype, head_dim)


def convert_dq_spec(dtype: str, head_dim: int) -> KernelSpec:
    return _spec(BWD_CONVERT_DQ, dtype, head_dim)
