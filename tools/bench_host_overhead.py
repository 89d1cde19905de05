"""Host (Python) time of one hipattn.forward / hipattn.backward call with torch tensors.

    python -m tools.bench_host_overhead [--calls 5000] [--out host_overhead.json]

A small varlen problem (8 sequences of 9 tokens, 16 heads, head_dim 128, bf16) with caller-provided
outputs, so nothing is allocated: what is timed is validation, device guard, stream resolution,
dispatch, parameter packing and the launch call. The GPU queue is drained every 500 calls outside
the timed region, so it never fills and blocks a launch. Also reports the median of each stage on
its own (the same calls the API makes), to show where the time goes.
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

    drain = torch.cuda.synchronize
    forward()
    backward()  # compile / load both kernels outside the timing
    drain()
    results = {"forward_us": _median_us(forward, args.calls, drain),
               "backward_us": _median_us(backward, args.calls, drain)}

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
    print(f"hipattn.forward  {results['forward_us']:7.2f} us host per call (median of {args.calls})")
    print(f"hipattn.backward {results['backward_us']:7.2f} us host per call")
    for name, us in results["stages_us"].items():
        print(f"  {name:42s} {us:7.2f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
