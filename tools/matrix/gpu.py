"""The measuring side of run.py on a CUDA GPU through torch: inputs, hipattn and its peers as runners,
event timing, SM clocks, ceilings. Everything here but ``compare`` needs a GPU.

hipattn runs through its public API only: hipattn.forward / hipattn.backward with outputs passed in
(allocated by a first call, then poisoned with NaN so that an unwritten element fails the check), and
hipattn.flash_attn_with_kvcache for decode, with cache_seqlens on the device as serving engines pass
it (paged cells: the same values scattered into pages through a shuffled block table). Peers:
torch SDPA's flash / cuDNN / efficient backends through sdpa_kernel on [B, H, S, D] views of the same
data (enable_gqa when Hkv < Hq), on a padded [B, H, 17, D] batch for small-seq; torch's varlen_attn on
THD data (window_size=(-1, 0) for causal, as tools/bench_flash.py calls it; enable_gqa where this
torch's varlen_attn takes it). Backward peers time torch.autograd.grad over a graph built once per
input set; forward + backward peers build the graph in every call.

Window cells: hipattn gets window_size; SDPA's flash and cuDNN backends take no window, so the peers
are FlexAttention (flex_attention through torch.compile(dynamic=False), with a block mask built once
per cell from a mask_mod of the window), varlen_attn with window_size (FA2) on THD views of the BSHD
data, and SDPA's efficient backend with the window as an explicit [S_q, S_k] boolean mask
(``sdpa_masked``, K/V heads repeated inside the call for GQA, which that backend lacks; not run where
cells.prescreen finds the mask large). A decode step's window is a run of the cache, so SDPA's
backends run there on that slice of the cache (not causal: the slice is exactly the visible keys).

Score-modifier cells: hipattn gets softcap= and alibi_slopes= (fp32 [Hq] on the device, made once per
cell in prepare and shared by every runner); softcap cells' queries are scaled so that the scores reach
the cap (cells.SOFTCAP_QUERY_SCALE). FlexAttention gets the modifier as a score_mod (softcap *
tanh(score / softcap), then - slope[h] * |q_idx + S_k - S_q - kv_idx|) that reads the slopes from that
tensor (an input of the compiled code, not Hq constants compiled into it), and a causal block mask;
for ALiBi alone, SDPA's efficient backend gets the bias as an explicit [Hq, S_q, S_k] bf16 mask (-inf
where causal hides a key; ``sdpa_bias``, K/V heads repeated as for ``sdpa_masked``).
"""

from __future__ import annotations

import functools
import gc
import inspect
import shutil
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import cells

# What sdpa_masked and sdpa_bias run on (an SDPBackend name); the CPU tests set MATH, which the CPU has.
MASKED_SDPA_BACKEND = "EFFICIENT_ATTENTION"
FLEX_RECOMPILE_LIMIT = 64  # every window and scoremod cell compiles flex_attention anew (shapes, mods, autograd)
REL_L2_TOLERANCE = 2e-2  # bf16 against bf16: each about 2-4e-3 from float64 (BENCHMARKS.md error tables)
MAX_ABS_TOLERANCE = 5e-2  # of the reference's largest magnitude
SPIN_CYCLES = 1_000_000  # about 0.5 ms at 2 GHz: the host queues a sample's calls meanwhile
CLOCK_SMI_INTERVAL_S = 0.5


def compare(outputs: tuple, reference: tuple) -> dict:
    """hipattn's outputs against a peer's, tensor by tensor, in float32: the largest ‖a − b‖ / ‖b‖ and
    max |a − b|, and whether every tensor is finite and within REL_L2_TOLERANCE and MAX_ABS_TOLERANCE
    of the reference's largest magnitude."""
    if len(outputs) != len(reference):
        raise ValueError(f"{len(outputs)} outputs against {len(reference)} reference tensors")
    worst_rel, worst_abs, ok = 0.0, 0.0, True
    for a, b in zip(outputs, reference, strict=True):
        if tuple(a.shape) != tuple(b.shape):
            raise ValueError(f"output shape {tuple(a.shape)} against reference shape {tuple(b.shape)}")
        a32, b32 = a.float(), b.float()
        if not bool(torch.isfinite(b32).all()):  # the peer's fault: no verdict on hipattn
            return {"ok": False, "finite": bool(torch.isfinite(a32).all()), "reference_finite": False,
                    "rel_l2": None, "max_abs_diff": None}
        if not bool(torch.isfinite(a32).all()):
            return {"ok": False, "finite": False, "rel_l2": None, "max_abs_diff": None}
        difference = a32 - b32
        rel = float(difference.norm() / b32.norm().clamp_min(1e-30))
        max_abs = float(difference.abs().max()) if difference.numel() else 0.0
        ref_max = float(b32.abs().max()) if b32.numel() else 0.0
        ok = ok and rel <= REL_L2_TOLERANCE and max_abs <= MAX_ABS_TOLERANCE * max(ref_max, 1e-30)
        worst_rel, worst_abs = max(worst_rel, rel), max(worst_abs, max_abs)
        del a32, b32, difference
    return {"ok": ok, "finite": True, "rel_l2": worst_rel, "max_abs_diff": worst_abs,
            "tolerance": f"rel_l2 <= {REL_L2_TOLERANCE}, max_abs <= {MAX_ABS_TOLERANCE} * max|reference|"}


@dataclass
class Runner:
    name: str
    run: Callable[[int], tuple]  # input set index (taken modulo the set count) -> outputs in hipattn's layout


@dataclass
class CellData:
    cell: cells.Cell
    sets: list[dict]  # q, k, v (and dout) per input set, in hipattn's layout
    sequence_args: dict  # THD: cu_seqlens_q/k, max_seqlen_q/k
    generator: torch.Generator
    padded: dict | None = None  # small-seq SDPA peers' [B, H, 17, D] batch, made on first use
    alibi_slopes: torch.Tensor | None = None  # fp32 [Hq] on the device, ALiBi cells only
    dropout_seed: torch.Tensor | None = None  # hipattn's one-element int64 seed, dropout cells only


class ClockReader:
    """The SM clock in MHz through NVML (nvidia-ml-py), else nvidia-smi read at most every
    CLOCK_SMI_INTERVAL_S, else None. Never changes anything."""

    def __init__(self, device: int):
        self.source, self._handle, self._nvml = "none", None, None
        self._device, self._last, self._last_time = device, None, 0.0
        try:
            import pynvml

            try:
                handle = torch.cuda._get_pynvml_handler(device)  # torch's CUDA_VISIBLE_DEVICES mapping
            except Exception:  # noqa: BLE001
                pynvml.nvmlInit()
                handle = pynvml.nvmlDeviceGetHandleByIndex(device)
            pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
            self._nvml, self._handle, self.source = pynvml, handle, "nvml"
        except Exception:  # noqa: BLE001
            if shutil.which("nvidia-smi"):
                self.source = f"nvidia-smi, read at most every {CLOCK_SMI_INTERVAL_S} s"

    def _smi(self, query: str) -> str | None:
        try:
            done = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits",
                                   "-i", str(self._device)], capture_output=True, text=True, timeout=10)
            return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None
        except (OSError, subprocess.SubprocessError):
            return None

    def read(self) -> float | None:
        if self._nvml is not None:
            try:
                return float(self._nvml.nvmlDeviceGetClockInfo(self._handle, self._nvml.NVML_CLOCK_SM))
            except Exception:  # noqa: BLE001
                return None
        if self.source.startswith("nvidia-smi") and time.monotonic() - self._last_time >= CLOCK_SMI_INTERVAL_S:
            text = self._smi("clocks.sm")
            self._last = float(text) if text and text.replace(".", "", 1).isdigit() else None
            self._last_time = time.monotonic()
        return self._last

    def driver(self) -> str | None:
        if self._nvml is not None:
            try:
                version = self._nvml.nvmlSystemGetDriverVersion()
                return version.decode() if isinstance(version, bytes) else str(version)
            except Exception:  # noqa: BLE001
                pass
        return self._smi("driver_version")


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0]


# ---- runners -------------------------------------------------------------------------------------

def _hipattn(cell: cells.Cell, data: CellData) -> Callable[[int], tuple]:
    import hipattn

    sets, count = data.sets, len(data.sets)
    # Only the window and score-modifier cells pass those arguments: the others call as they always have.
    extra = {"window_size": cell.window} if cell.windowed else {}
    if cell.softcap > 0:
        extra["softcap"] = cell.softcap
    if cell.alibi:
        extra["alibi_slopes"] = data.alibi_slopes  # made once per cell
    if cell.dropout_p:
        extra.update(dropout_p=cell.dropout_p, dropout_seed=data.dropout_seed)
    if cell.is_decode:
        caches = [decode_cache(cell, s, data.generator) for s in sets]
        outs = [torch.full_like(s["q"], float("nan")) for s in sets]

        def run_decode(i: int) -> tuple:
            s, cache, out = sets[i % count], caches[i % count], outs[i % count]
            hipattn.flash_attn_with_kvcache(s["q"], cache["k"], cache["v"], cache_seqlens=cache["seqlens"],
                                            block_table=cache["block_table"], causal=cell.causal, out=out, **extra)
            return (out,)
        return run_decode

    arguments = dict(data.sequence_args, causal=cell.causal, **extra)
    state = []
    for s in sets:  # first calls allocate the outputs (and compile or load the kernels)
        out, lse = hipattn.forward(s["q"], s["k"], s["v"], **arguments)
        owned = {"out": out, "lse": lse}
        if cell.direction != "fwd":
            owned["dq"], owned["dk"], owned["dv"] = hipattn.backward(s["dout"], s["q"], s["k"], s["v"], out, lse,
                                                                     **arguments)
        for name in ("dq", "dk", "dv") if cell.direction != "fwd" else ():
            owned[name].fill_(float("nan"))
        if cell.direction != "bwd":  # the backward reads out and lse: poisoned only where a forward rewrites them
            owned["out"].fill_(float("nan"))
            owned["lse"].fill_(float("nan"))
        state.append(owned)

    def run(i: int) -> tuple:
        s, owned = sets[i % count], state[i % count]
        if cell.direction != "bwd":
            hipattn.forward(s["q"], s["k"], s["v"], out=owned["out"], lse=owned["lse"], **arguments)
            if cell.direction == "fwd":
                return (owned["out"],)
        hipattn.backward(s["dout"], s["q"], s["k"], s["v"], owned["out"], owned["lse"],
                         dq=owned["dq"], dk=owned["dk"], dv=owned["dv"], **arguments)
        grads = (owned["dq"], owned["dk"], owned["dv"])
        return grads if cell.direction == "bwd" else (owned["out"], *grads)

    return run


def decode_cache(cell: cells.Cell, s: dict, generator: torch.Generator) -> dict:
    """A decode cell's cache for hipattn: the set's k/v as they are (contiguous), or scattered into
    shuffled pages of cell.page_size tokens with the block table that gathers them back."""
    seqlens = torch.full((cell.batch,), cell.seqlen_k, dtype=torch.int32, device=s["k"].device)
    if not cell.page_size:
        return {"k": s["k"], "v": s["v"], "seqlens": seqlens, "block_table": None}
    pages_per_sequence = cell.seqlen_k // cell.page_size
    pages = cell.batch * pages_per_sequence
    order = torch.randperm(pages, generator=generator, device=generator.device)
    paged = {}
    for name in ("k", "v"):
        tiles = s[name].reshape(pages, cell.page_size, cell.heads_kv, cell.head_dim)
        paged[name] = torch.empty_like(tiles)
        paged[name][order] = tiles
    table = order.to(torch.int32).reshape(cell.batch, pages_per_sequence)
    return {"k": paged["k"], "v": paged["v"], "seqlens": seqlens, "block_table": table}


def _autograd(direction: str, views: list[dict], attend: Callable, to_hipattn: Callable) -> Callable[[int], tuple]:
    """A runner over ``attend(q, k, v)`` on each input set's ``views``: the forward alone, the
    backward of a graph built here, or both in every call; outputs mapped to hipattn's layout."""
    count = len(views)
    if direction == "fwd":
        def run_forward(i: int) -> tuple:
            view = views[i % count]
            with torch.no_grad():
                return (to_hipattn(attend(view["q"], view["k"], view["v"])),)
        return run_forward
    leaves = [{n: view[n].detach().requires_grad_() for n in ("q", "k", "v")} for view in views]
    if direction == "bwd":
        graphs = [attend(leaf["q"], leaf["k"], leaf["v"]) for leaf in leaves]

        def run_backward(i: int) -> tuple:
            leaf = leaves[i % count]
            grads = torch.autograd.grad(graphs[i % count], (leaf["q"], leaf["k"], leaf["v"]), views[i % count]["dout"],
                                        retain_graph=True)
            return tuple(to_hipattn(g) for g in grads)
        return run_backward

    def run_both(i: int) -> tuple:
        leaf = leaves[i % count]
        out = attend(leaf["q"], leaf["k"], leaf["v"])
        grads = torch.autograd.grad(out, (leaf["q"], leaf["k"], leaf["v"]), views[i % count]["dout"])
        return (to_hipattn(out.detach()), *(to_hipattn(g) for g in grads))
    return run_both


def _padded(cell: cells.Cell, data: CellData) -> list[dict]:
    """The small-seq SDPA peers' batch: every sequence padded to 17, [B, H, 17, D], fresh random data
    (shared by those peers)."""
    if data.padded is None:
        tile, generator = cells.SMALLSEQ_TILE, data.generator
        shape_q = (cell.batch, cell.heads_q, tile, cell.head_dim)
        shape_k = (cell.batch, cell.heads_kv, tile, cell.head_dim)
        padded = {n: _random(shape, generator) for n, shape in (("q", shape_q), ("k", shape_k), ("v", shape_k))}
        if cell.direction != "fwd":
            padded["dout"] = _random(shape_q, generator)
        data.padded = padded
    return [data.padded]


def _sdpa(name: str, cell: cells.Cell, data: CellData) -> Callable[[int], tuple]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
               "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}[name]
    extra = {"enable_gqa": True} if cell.heads_q != cell.heads_kv else {}
    sdpa = torch.nn.functional.scaled_dot_product_attention

    # Top-left causal = bottom-right where S_q == S_k; a decode window's slice is its visible keys.
    causal = cell.causal and not cell.windowed
    if cell.windowed and not cell.is_decode:
        raise ValueError(f"{name} takes no sliding window (window cells run sdpa_masked)")
    if cell.score_modified:
        raise ValueError(f"{name} takes no softcap or ALiBi (ALiBi cells run sdpa_bias)")

    def attend(q, k, v):
        with sdpa_kernel(backend):
            return sdpa(q, k, v, is_causal=causal, dropout_p=cell.dropout_p, **extra)

    if cells.padded_peer(cell, name):
        return _autograd(cell.direction, _padded(cell, data), attend, lambda t: t)
    views = [{n: t.transpose(1, 2) for n, t in s.items()} for s in data.sets]  # [B, S, H, D] -> [B, H, S, D]
    if cell.windowed:  # decode: the window's keys, a run of the cache
        first, end = cells.key_range(cell.seqlen_q, cell.seqlen_k, cell.causal, cell.window)
        for view in views:
            view["k"], view["v"] = view["k"][:, :, first:end], view["v"][:, :, first:end]
    return _autograd(cell.direction, views, attend, lambda t: t.transpose(1, 2))


def window_mask(cell: cells.Cell, device) -> torch.Tensor:
    """The window of a BSHD cell as a [S_q, S_k] boolean mask (True: attended), written straight from
    flash-attn's rule: with d = S_k - S_q, query i sees key j when i + d - left <= j <= i + d + right
    (a negative side unbounded; causal makes right 0)."""
    left, right = cells.effective_window(cell.causal, cell.window)
    rows = torch.arange(cell.seqlen_q, device=device)[:, None] + (cell.seqlen_k - cell.seqlen_q)
    keys = torch.arange(cell.seqlen_k, device=device)[None, :]
    keep = torch.ones(cell.seqlen_q, cell.seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        keep &= keys >= rows - left
    if right >= 0:
        keep &= keys <= rows + right
    return keep


def alibi_bias(cell: cells.Cell, slopes: torch.Tensor) -> torch.Tensor:
    """ALiBi on a BSHD cell as an fp32 [Hq, S_q, S_k] additive bias, written straight from flash-attn's
    rule: query i and key j get -slopes[h] * |i + S_k - S_q - j|, and -inf where causal hides the key."""
    rows = torch.arange(cell.seqlen_q, device=slopes.device)[:, None] + (cell.seqlen_k - cell.seqlen_q)
    keys = torch.arange(cell.seqlen_k, device=slopes.device)[None, :]
    bias = -slopes.float()[:, None, None] * (rows - keys).abs()[None]
    if cell.causal:
        bias = bias.masked_fill((keys > rows)[None], float("-inf"))
    return bias


def _sdpa_masked(cell: cells.Cell, data: CellData) -> Callable[[int], tuple]:
    """SDPA (MASKED_SDPA_BACKEND) with an explicit mask, built once: the window as a boolean mask
    (sdpa_masked), or ALiBi as a bf16 bias, the queries' dtype, which the efficient backend needs
    (sdpa_bias); the K/V heads repeated inside the call for GQA (the efficient backend has no
    enable_gqa)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, MASKED_SDPA_BACKEND)
    if cell.windowed:
        mask = window_mask(cell, data.sets[0]["q"].device)
    elif cell.alibi and cell.softcap == 0:
        mask = alibi_bias(cell, data.alibi_slopes).to(data.sets[0]["q"].dtype)
    else:
        raise ValueError("an explicit mask takes a sliding window or ALiBi alone (SDPA has no softcap)")
    group = cell.heads_q // cell.heads_kv
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def attend(q, k, v):
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        with sdpa_kernel(backend):
            return sdpa(q, k, v, attn_mask=mask)

    views = [{n: t.transpose(1, 2) for n, t in s.items()} for s in data.sets]
    return _autograd(cell.direction, views, attend, lambda t: t.transpose(1, 2))


@functools.cache
def _flex_function() -> Callable:
    """flex_attention through torch.compile, once per process (the CPU tests replace this with the
    eager function). Static shapes: no cell should get a dynamic-shape kernel because an earlier cell
    had other sizes; and a recompile limit above the default 8, since every window and scoremod cell
    recompiles."""
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), FLEX_RECOMPILE_LIMIT))
    return torch.compile(flex_attention, dynamic=False)


def score_mod(cell: cells.Cell, slopes: torch.Tensor | None) -> Callable | None:
    """The cell's score modifiers as a FlexAttention score_mod (None: plain attention), flash-attn's
    order: the softcap on the scaled score, then ALiBi's -slope[h] * |q_idx + S_k - S_q - kv_idx|, the
    slope read from ``slopes`` (captured as a tensor: compiled code is not specialised on its values)."""
    if not cell.score_modified:
        return None
    softcap, shift = cell.softcap, cell.seqlen_k - cell.seqlen_q

    def modify(score, b, h, q_idx, kv_idx):
        if softcap > 0:
            score = softcap * torch.tanh(score / softcap)
        if slopes is not None:
            score = score - slopes[h] * torch.abs(q_idx + shift - kv_idx)
        return score

    return modify


def _flex(cell: cells.Cell, data: CellData) -> Callable[[int], tuple]:
    """FlexAttention on [B, H, S, D] views, the window or causal mask as a mask_mod whose block mask is
    built here, outside the timed calls (the same for every batch entry and head: B = H = None; none
    without a mask), and the score modifiers as a score_mod."""
    from torch.nn.attention.flex_attention import create_block_mask

    left, right = cells.effective_window(cell.causal, cell.window)
    shift = cell.seqlen_k - cell.seqlen_q  # bottom-right alignment
    lowest = -left if left >= 0 else -(cell.seqlen_q + cell.seqlen_k)  # bounds of j - i - shift
    highest = right if right >= 0 else cell.seqlen_q + cell.seqlen_k

    def window_mod(b, h, q_idx, kv_idx):
        offset = kv_idx - q_idx - shift
        return (offset >= lowest) & (offset <= highest)

    device = data.sets[0]["q"].device
    masked = cell.windowed or cell.causal
    block_mask = create_block_mask(window_mod, None, None, cell.seqlen_q, cell.seqlen_k, device=device) if masked else None
    flex = _flex_function()
    extra = {"enable_gqa": True} if cell.heads_q != cell.heads_kv else {}
    modify = score_mod(cell, data.alibi_slopes if cell.alibi else None)
    if modify is not None:
        extra["score_mod"] = modify

    def attend(q, k, v):
        return flex(q, k, v, block_mask=block_mask, **extra)

    views = [{n: t.transpose(1, 2) for n, t in s.items()} for s in data.sets]
    return _autograd(cell.direction, views, attend, lambda t: t.transpose(1, 2))


def _varlen(cell: cells.Cell, data: CellData) -> Callable[[int], tuple]:
    from torch.nn.attention.varlen import varlen_attn

    if cell.score_modified:
        raise ValueError("varlen_attn takes no softcap or ALiBi")
    if cell.windowed:  # flash-attn's window, which varlen_attn passes to FA2
        extra = {"window_size": cells.effective_window(cell.causal, cell.window)}
    else:
        extra = {"window_size": (-1, 0)} if cell.causal else {}
    if cell.heads_q != cell.heads_kv and "enable_gqa" in inspect.signature(varlen_attn).parameters:
        extra["enable_gqa"] = True
    if cell.layout == "bshd":  # [B, S_q, H, D] and [B, S_k, H, D] as THD, sequences of S_q and S_k rows
        batch, length_q, length_k = cell.batch, cell.seqlen_q, cell.seqlen_k
        steps = torch.arange(batch + 1, dtype=torch.int32, device=data.sets[0]["q"].device)
        sequence = (steps * length_q, steps * length_k, length_q, length_k)
        views = [{n: t.view(-1, *t.shape[2:]) for n, t in s.items()} for s in data.sets]

        def to_hipattn(t):
            return t.view(batch, -1, *t.shape[1:])
    else:
        a = data.sequence_args
        sequence = (a["cu_seqlens_q"], a["cu_seqlens_k"], a["max_seqlen_q"], a["max_seqlen_k"])
        views, to_hipattn = data.sets, (lambda t: t)

    def attend(q, k, v):
        return varlen_attn(q, k, v, *sequence, **extra)

    return _autograd(cell.direction, views, attend, to_hipattn)


def _copy_runner(generator: torch.Generator) -> Runner:
    source = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda").random_(generator=generator)
    target = torch.empty_like(source)
    return Runner("copy", lambda i: target.copy_(source))


def _gemm_runner(generator: torch.Generator) -> Runner:
    a = torch.randn(8192, 8192, generator=generator, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, generator=generator, device="cuda", dtype=torch.bfloat16)
    return Runner("gemm", lambda i: torch.mm(a, b))


def _random(shape: tuple, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator, device=generator.device, dtype=torch.bfloat16)


def prepare(cell: cells.Cell, device: str) -> CellData:
    """The cell's input sets: random bf16 q, k, v (and dout), seeded by the cell's name, q scaled by
    cells.SOFTCAP_QUERY_SCALE in softcap cells; THD cells' cu_seqlens and bounds; ALiBi cells' slopes;
    dropout cells' seed (one for every call: the kernels' time does not depend on it)."""
    generator = torch.Generator(device=device).manual_seed(zlib.crc32(cell.name.encode()))
    lengths_q, lengths_k = cells.lengths(cell)
    if cell.layout == "thd":
        shape_q = (sum(lengths_q), cell.heads_q, cell.head_dim)
        shape_k = (sum(lengths_k), cell.heads_kv, cell.head_dim)
        cu = [torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)
              for lengths in (lengths_q, lengths_k)]
        sequence_args = {"cu_seqlens_q": cu[0], "cu_seqlens_k": cu[1],
                         "max_seqlen_q": max(lengths_q), "max_seqlen_k": max(lengths_k)}
    else:
        shape_q = (cell.batch, cell.seqlen_q, cell.heads_q, cell.head_dim)
        shape_k = (cell.batch, cell.seqlen_k, cell.heads_kv, cell.head_dim)
        sequence_args = {}
    sets = []
    for _ in range(cells.input_sets(cell)):
        s = {"q": _random(shape_q, generator), "k": _random(shape_k, generator), "v": _random(shape_k, generator)}
        if cell.softcap > 0:
            s["q"].mul_(cells.SOFTCAP_QUERY_SCALE)
        if cell.direction != "fwd":
            s["dout"] = _random(shape_q, generator)
        sets.append(s)
    slopes = torch.tensor(cells.alibi_slopes(cell.heads_q), dtype=torch.float32, device=device) if cell.alibi else None
    seed = (torch.randint(-2**62, 2**62, (1,), generator=generator, device=device, dtype=torch.int64)
            if cell.dropout_p else None)
    return CellData(cell, sets, sequence_args, generator, alibi_slopes=slopes, dropout_seed=seed)


def build(name: str, cell: cells.Cell, data: CellData) -> Runner:
    """hipattn or a peer on the cell's data; raises when it cannot run it."""
    if name == "hipattn":
        run = _hipattn(cell, data)
    elif name in ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient"):
        run = _sdpa(name, cell, data)
    elif name == "varlen_attn":
        run = _varlen(cell, data)
    elif name == "flex":
        run = _flex(cell, data)
    elif name in ("sdpa_masked", "sdpa_bias"):
        run = _sdpa_masked(cell, data)
    else:
        raise ValueError(f"unknown runner {name!r}")
    return Runner(name, run)


# ---- the measurer --------------------------------------------------------------------------------

class CudaMeasurer:
    """run.py's measuring interface on the current CUDA device."""

    def __init__(self):
        if not torch.cuda.is_available():
            raise RuntimeError("bench_matrix's worker needs a CUDA GPU; torch sees none")
        self.device = torch.cuda.current_device()
        self.clock = ClockReader(self.device)
        self._spin = getattr(torch.cuda, "_sleep", None)

    def environment(self) -> dict:
        properties = torch.cuda.get_device_properties(self.device)
        try:
            import hipattn

            hipattn_text = {"hipattn_file": hipattn.__file__, "hipattn_version": hipattn.__version__}
        except Exception as error:  # noqa: BLE001
            hipattn_text = {"hipattn_import_error": _first_line(f"{type(error).__name__}: {error}")}
        return {
            "device": torch.cuda.get_device_name(self.device),
            "capability": ".".join(map(str, torch.cuda.get_device_capability(self.device))),
            "multiprocessors": properties.multi_processor_count,
            "memory_bytes": properties.total_memory,
            "driver": self.clock.driver(),
            "torch": torch.__version__,
            "cuda_runtime": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "python": sys.version.split()[0],
            "clock_source": self.clock.source,
            "spin_before_samples": self._spin is not None,
            **hipattn_text,
        }

    def ceilings(self) -> dict:
        """A 2 GiB device-to-device copy (bytes read + written per second) and an 8192³ bf16 matrix
        product on random data, 3 warm-ups and 10 samples each, with the SM clock of every sample."""
        generator = torch.Generator(device="cuda").manual_seed(1)
        copy = self._ceiling(_copy_runner(generator), 2 * 2 * 1024**3)
        gemm = self._ceiling(_gemm_runner(generator), 2 * 8192**3)
        self.release()
        return {"copy_bytes_per_s": copy["amount"] / (copy["median_ms"] * 1e-3),
                "gemm_flops_per_s": gemm["amount"] / (gemm["median_ms"] * 1e-3), "copy": copy, "gemm": gemm}

    def _ceiling(self, runner: Runner, amount: float) -> dict:
        for _ in range(3):
            runner.run(0)
        torch.cuda.synchronize()
        samples = [[self.sample(runner, 0, 1), self.clock_mhz()] for _ in range(10)]
        return {"amount": amount, "median_ms": sorted(ms for ms, _ in samples)[len(samples) // 2], "samples": samples}

    def prepare(self, cell: cells.Cell) -> CellData:
        return prepare(cell, "cuda")

    def build(self, name: str, cell: cells.Cell, data: CellData) -> Runner:
        return build(name, cell, data)

    def first_call(self, runner: Runner) -> tuple:
        outputs = runner.run(0)
        torch.cuda.synchronize()
        return outputs

    def sample(self, runner: Runner, start: int, calls: int) -> float:
        """Device ms per call of ``calls`` back-to-back calls from input set ``start`` on."""
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if self._spin is not None:
            self._spin(SPIN_CYCLES)
        begin.record()
        for call in range(calls):
            runner.run(start + call)
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / calls

    def clock_mhz(self) -> float | None:
        return self.clock.read()

    compare = staticmethod(compare)

    def context_ok(self) -> bool:
        try:
            torch.cuda.synchronize()
            return float((torch.ones(1, device="cuda") + 1).item()) == 2.0
        except Exception:  # noqa: BLE001
            return False

    def release(self) -> None:
        gc.collect()
        try:
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - a lost context answers in context_ok
            pass
