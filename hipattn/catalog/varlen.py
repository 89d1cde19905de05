"""The varlen backward's work list, derived on the device (hipattn.varlen_prep): one block walks the
batch, one sequence per thread per chunk, carrying a block-wide scan from chunk to chunk. Portable
(no warp intrinsics, any wave size): shipped for every target."""

from __future__ import annotations

from ..jit.params import ParamsStruct
from ..jit.spec import KernelFamily, KernelSpec
from ..varlen_metadata import VARLEN_RECORD
from .index import register

VARLEN_RECORDS_BLOCK_THREADS = 256

VARLEN_RECORDS = register(KernelFamily(
    name="varlen_records",
    source="flash/varlen_records.hip",
    template="hipattn::varlen_records",
    template_params=("block_threads",),
    params=ParamsStruct("VarlenRecordsParams", (
        ("cu_seqlens_q", "const_ptr"),
        ("cu_seqlens_k", "const_ptr"),
        ("seqused_q", "const_ptr"),
        ("seqused_k", "const_ptr"),
        ("records", "ptr"),
        ("batch", "i32"),
        ("max_seqlen_q", "i32"),
        ("max_seqlen_k", "i32"),
        ("total_q", "i32"),
        ("total_k", "i32"),
        ("block_n", "i32"),
        ("key_block_bound", "i32"),
    )),
    shipped=lambda target: [records_spec()],
    structs=(VARLEN_RECORD,),
))

_RECORDS_SPEC = VARLEN_RECORDS.spec(block_threads=VARLEN_RECORDS_BLOCK_THREADS)


def records_spec() -> KernelSpec:
    return _RECORDS_SPEC
