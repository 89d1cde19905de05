"""Host (Python) time of one hipattn call with torch tensors, beside torch SDPA's on the same problem.

    python -m tools.bench_host_overhead [--calls 5000] [--out host_overhead.json]

A small problem (8 sequences of 9 tokens, 16 heads, head_dim 128, bf16), so the GPU time is
negligible and what is timed is the host's: validation (or, on a repeat call, the replay of a
validated plan: hipattn.launch_plans), device guard, stream resolution, dispatch, parameter packing
and the launch call. Timed: hipattn.forward (varlen) with outputs given and allocating,
hipattn.backward, hipattn.torch.flash_attn_func (batch, inference and with autograd recording),
hipattn.flash_attn_with_kvcache (a decode step of the same 8 sequences against a 64-token paged
cache, with one new token appended, repeat calls and every call on the full path), and torch's
scaled_dot_product_attention with its flash backend on the same batch. The GPU queue is
drained every 500 calls outside the timed region, so it never fills and blocks a launch. Also
reports the median of each stage of the full (first-call) path on its own, to show where that
time goes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import hipattn
from hipattn import arrays, dispatch, runtime, streams
from hipattn import problem as problem_mod
from hipattn.ops import smallseq

DRAIN_EVERY = 500


def _median_us(fn, calls: int, drain) -> float:
    times = []
    clock = time.perf_counter_ns
    for i in range(calls):
        if i % DRAIN_EVERY == 0:
            drain()
        begin = clock()
        fn()
        times.append(clock() - begin)
    drain()
    return statistics.median(times) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--out", default=None, help="write the results as JSON here too")
    args = parser.parse_args()

    import torch

    batch, seqlen, heads, head_dim = 8, 9, 16, 128
    total = batch * seqlen

    def t(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", dtype=dtype)

    q, k, v, dout = (t(total, heads, head_dim) for _ in range(4))
    out, dq, dk, dv = (torch.empty_like(q) for _ in range(4))
    lse = torch.empty(heads, total, device="cuda", dtype=torch.float32)
    cu = torch.arange(0, total + 1, seqlen, dtype=torch.int32, device="cuda")
    varlen = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=seqlen, max_seqlen_k=seqlen)

    def forward():
        hipattn.forward(q, k, v, out=out, lse=lse, **varlen)

    def backward():
        hipattn.backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, **varlen)

    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import hipattn.torch as hat

    def forward_allocating():
        hipattn.forward(q, k, v, **varlen)

    qb, kb, vb = (x.view(batch, seqlen, heads, head_dim) for x in (q, k, v))
    qg = qb.detach().clone().requires_grad_()

    def torch_api():
        hat.flash_attn_func(qb, kb, vb)

    def torch_api_recording():
        hat.flash_attn_func(qg, kb, vb)

    qs, ks, vs = (x.transpose(1, 2) for x in (qb, kb, vb))

    def sdpa_flash():
        F.scaled_dot_product_attention(qs, ks, vs)

    plans = runtime.active().launch_plans

    def forward_full_path():
        plans.clear()  # every call validates from scratch, as the first call of a signature does
        forward()

    # A decode step: one query token per sequence, pages of 16 tokens, one new token at position 40.
    q1 = t(batch, 1, heads, head_dim)
    k_pages, v_pages = t(batch * 4, 16, 4, head_dim), t(batch * 4, 16, 4, head_dim)
    k_new, v_new = t(batch, 1, 4, head_dim), t(batch, 1, 4, head_dim)
    table = torch.arange(batch * 4, dtype=torch.int32, device="cuda").view(batch, 4)
    lengths = torch.full((batch,), 40, dtype=torch.int32, device="cuda")
    decode_out = torch.empty_like(q1)

    def kvcache():
        hipattn.flash_attn_with_kvcache(q1, k_pages, v_pages, k_new, v_new, cache_seqlens=lengths, block_table=table,
                                        out=decode_out)

    def kvcache_full_path():
        plans.clear()
        kvcache()

    drain = torch.cuda.synchronize
    calls = {"forward_us": forward, "forward_full_path_us": forward_full_path, "forward_allocating_us": forward_allocating, "backward_us": backward,
             "torch_flash_attn_func_us": torch_api, "torch_flash_attn_func_recording_us": torch_api_recording,
             "kvcache_us": kvcache, "kvcache_full_path_us": kvcache_full_path, "torch_sdpa_flash_us": sdpa_flash}
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for fn in calls.values():
            fn()  # compile / load every kernel outside the timing
        drain()
        results = {name: _median_us(fn, args.calls, drain) for name, fn in calls.items()}

    # Per stage, as forward runs them.
    qa, ka, va = (arrays.as_device_array(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    cua, outa, lsea = (arrays.as_device_array(x, n) for x, n in ((cu, "cu"), (out, "out"), (lse, "lse")))
    problem = problem_mod.describe(qa, ka, va, cu_seqlens_q=cua, cu_seqlens_k=cua, max_seqlen_q=seqlen,
                                   max_seqlen_k=seqlen)
    backend = runtime.active().backend
    inputs = ((qa, "q"), (ka, "k"), (va, "v"))
    spans = problem_mod.memory_spans(inputs)
    stream = torch.cuda.current_stream().cuda_stream

    def guard_and_stream():
        with streams.on_device(backend, problem.device):
            streams.resolve_stream((qa, ka, va), None, device=problem.device)

    stages = {
        "as_device_array (one tensor)": lambda: arrays.as_device_array(q, "q"),
        "describe": lambda: problem_mod.describe(qa, ka, va, cu_seqlens_q=cua, cu_seqlens_k=cua,
                                                 max_seqlen_q=seqlen, max_seqlen_k=seqlen),
        "memory_spans (3 inputs)": lambda: problem_mod.memory_spans(inputs),
        "check_output (one output)": lambda: problem_mod.check_output(outa, "out", qa.shape, qa.dtype, problem,
                                                                      spans),
        "choose_path": lambda: dispatch.choose_path(problem, "forward"),
        "runtime.active().backend": lambda: runtime.active().backend,
        "on_device + resolve_stream": guard_and_stream,
        "smallseq.forward (spec, params, launch)": lambda: smallseq.forward(
            problem, qa, ka, va, outa, lsea, stream, cu_seqlens_q=cua, cu_seqlens_k=cua),
        "torch.cuda.current_stream().cuda_stream": lambda: torch.cuda.current_stream(0).cuda_stream,
    }
    with streams.on_device(backend, problem.device):
        results["stages_us"] = {name: _median_us(fn, args.calls, drain) for name, fn in stages.items()}

    results["device"] = torch.cuda.get_device_name()
    results["torch"] = torch.__version__
    for name in calls:
        print(f"{name:42s} {results[name]:7.2f} us host per call (median of {args.calls})")
    for name, us in results["stages_us"].items():
        print(f"  {name:42s} {us:7.2f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
