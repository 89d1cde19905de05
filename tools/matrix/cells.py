"""The cells of the matrix, what each must compute, and how long the matrix should take. Pure Python.

A cell is one workload in one direction with a stable name, e.g. ``smallseq/d128/h16:4/fwd``:

- ``smallseq``: THD cross-attention, SMALLSEQ_SEQUENCES sequences whose query and key lengths are
  drawn independently from 1..17 (fixed seed), head_dim 64/128/256, Hq:Hkv 16:16, 16:8, 16:4, 16:2,
  16:1 and 8:1; forward (``fwd``) and backward (``bwd``) timed separately.
- ``batch``: BSHD self-attention at BATCH_TOKENS tokens (B = tokens / S), head_dim 64/96/128/256,
  MHA 16:16 and GQA 16:4, causal or not, S from 512 to 16384; ``fwd`` and ``fwdbwd``.
- ``varlen``: THD self-attention, lengths drawn from 128..4096 summing to 16384 tokens (the lengths
  of tools/bench_flash.py's varlen workload), head_dim 128, 16:16 and 16:4, causal or not.
- ``decode``: one query token per sequence against a long KV cache, forward only; hipattn through
  flash_attn_with_kvcache, on a contiguous cache and (``pagedN`` cells) on pages of N tokens through
  a shuffled block table holding the same values.
- ``window``: flash-attn's sliding window (``wL,R`` in the name: window_size=(L, R); with d = len_k -
  len_q, query i sees key j when i + d - L <= j <= i + d + R, a negative side unbounded, causal
  making R = 0): BSHD self-attention at BATCH_TOKENS tokens as in ``batch`` (WINDOW_SHAPES: head_dim
  128, and 64 for one window; GQA 16:4, and MHA 16:16 for one shape; S 4096 and 16384; causal
  (1023, 0), Mistral's (4095, 0), and a non-causal (512, 512)), ``fwd`` and ``fwdbwd``; and decode
  cells (one query token, a contiguous cache; WINDOW_DECODE_SHAPES) whose window's left side limits
  the keys read. Peers: FlexAttention (a window mask_mod, torch.compile'd), torch's varlen_attn (FA2)
  with window_size, SDPA's efficient backend with an explicit boolean mask where the mask is small (a
  reference: it computes every pair), and for decode SDPA's backends on the window's keys (a slice of
  the cache).
- ``scoremod``: flash-attn's score modifiers (``capN``: softcap=N, Gemma 2's 50; ``alibi``: alibi_slopes
  [Hq], the ALiBi paper's geometric slopes 2^(-8 (h + 1) / Hq); ``capN,alibi``: both): BSHD
  self-attention at BATCH_TOKENS tokens on SCOREMOD_SHAPES (head_dim 128, and 64 for one shape; GQA
  16:4; S 4096, and 16384 for one; causal or not), ``fwd`` and ``fwdbwd``. Every shape is also a
  ``batch`` cell (plain_twin), the same work without the modifier. Peers: FlexAttention with the
  modifier as a score_mod (torch.compile'd), and for ALiBi alone SDPA's efficient backend with the
  bias as an explicit float mask where it is small (a reference: it computes every pair). SDPA has no
  softcap, its flash and cuDNN backends take no bias, and torch's varlen_attn takes neither.
- ``dropout``: flash-attn's dropout_p (``pP`` in the name: DROPOUT_P): BSHD self-attention at
  BATCH_TOKENS tokens on DROPOUT_SHAPES (head_dim 128, and 64 for one shape; MHA 16:16, and GQA 16:4
  for one; S 4096; causal or not), ``fwd`` and ``fwdbwd``; every shape is also a ``batch`` cell. Peers:
  SDPA's flash (FA2), cuDNN and efficient backends with the same dropout_p. No peer's output is compared
  with hipattn's: each library draws its own mask (the GPU tests check hipattn's dropout against float64
  with its mask).

A cell's FLOPs count only the (query, key) pairs its mask lets through (visible_pairs), and its bytes
only the keys some query sees (key_range): a decode window reads its window, not the cache. The score
modifiers add no matrix product and no tensor to move (the slopes are Hq floats): a scoremod cell has
the FLOPs, bytes and floor of its plain twin; so has a dropout cell (the mask is random numbers made in
registers).

The floor of a cell is the larger of its FLOPs over the measured bf16 GEMM rate and its bytes over
the measured copy bandwidth, both measured at the start of the run; which one binds is recorded
with it.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import asdict, dataclass

SECTIONS = ("smallseq", "batch", "varlen", "decode", "window", "scoremod", "dropout")
DIRECTIONS = ("fwd", "bwd", "fwdbwd")
ELEMENT_BYTES = 2  # bf16
LSE_BYTES = 4  # fp32

SMALLSEQ_TILE = 17  # the longest small-seq sequence on either side (hipattn's SMALLSEQ_TILE)
SMALLSEQ_SEQUENCES = 16384
SMALLSEQ_SEED = 2026
SMALLSEQ_HEAD_DIMS = (64, 128, 256)
SMALLSEQ_HEADS = ((16, 16), (16, 8), (16, 4), (16, 2), (16, 1), (8, 1))

BATCH_TOKENS = 16384
BATCH_HEAD_DIMS = (64, 96, 128, 256)
BATCH_HEADS = ((16, 16), (16, 4))
BATCH_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)

VARLEN_TOKENS = 16384
VARLEN_RANGE = (128, 4096)
VARLEN_SEED = 2026
VARLEN_HEAD_DIM = 128

DECODE_HEAD_DIM = 128
# (batch, KV length, Hq, Hkv)
DECODE_SHAPES = ((64, 4096, 32, 8), (8, 32768, 32, 8), (128, 1024, 32, 32), (1, 32768, 32, 8),
                 (1, 131072, 32, 8), (4, 131072, 32, 8))
# The shapes also run paged (vLLM-style pages of DECODE_PAGE_SIZE tokens): paged should cost what
# contiguous does.
DECODE_PAGED_SHAPES = ((64, 4096, 32, 8), (8, 32768, 32, 8), (1, 131072, 32, 8))
DECODE_PAGE_SIZE = 256

NO_WINDOW = (-1, -1)
WINDOW_HEAD_DIM = 128
# (head_dim, Hq, Hkv, S, (left, right), causal): the sliding-window training shapes, at BATCH_TOKENS
# tokens (B = BATCH_TOKENS / S). Mistral's window is (4095, 0) causal; (1023, 0) is a short one.
WINDOW_SHAPES = (
    *((128, 16, 4, seqlen, window, causal) for seqlen in (4096, 16384)
      for window, causal in (((1023, 0), True), ((512, 512), False))),
    (128, 16, 4, 16384, (4095, 0), True),
    (64, 16, 4, 16384, (1023, 0), True),
    (128, 16, 16, 16384, (1023, 0), True),
)
# (batch, KV length, Hq, Hkv, (left, right)): decode steps with a causal window (a contiguous cache of
# KV tokens of which the last left + 1 are read).
WINDOW_DECODE_SHAPES = ((8, 32768, 32, 8, (4095, 0)), (64, 4096, 32, 8, (1023, 0)))
# SDPA's efficient backend with an explicit [S_q, S_k] boolean mask computes every pair (no tile is
# skipped) and converts the mask to a bias per call: run only where the mask is at most this big.
MASKED_PEER_MAX_MASK_BYTES = 64 * 1024**2

SOFTCAP = 50.0  # Gemma 2's attention logit softcap
# Softcap cells draw q with this standard deviation (a power of 2: exact in bf16), so that the scaled
# scores q·k / sqrt(D) have it too and the largest reach the cap: at D 128, S 4096, causal, leaving the
# cap out then moves the output by about 14% (relative L2), against 0.2% with randn queries, which the
# numeric check (2%) could not tell from rounding. The attention kernels timed here do not branch on the
# values.
SOFTCAP_QUERY_SCALE = 8.0
# (head_dim, Hq, Hkv, S, softcap, alibi, causal): the score-modifier training shapes, at BATCH_TOKENS
# tokens (B = BATCH_TOKENS / S); each is also a batch cell's shape.
SCOREMOD_SHAPES = (
    *((128, 16, 4, 4096, softcap, alibi, causal) for softcap, alibi in ((SOFTCAP, False), (0.0, True))
      for causal in (False, True)),
    (128, 16, 4, 16384, 0.0, True, True),
    (64, 16, 4, 4096, SOFTCAP, False, True),
    (128, 16, 4, 4096, SOFTCAP, True, True),
)
DROPOUT_P = 0.1  # the attention dropout of BERT-era training recipes
# (head_dim, Hq, Hkv, S, causal): the dropout training shapes, at BATCH_TOKENS tokens; each is also a
# batch cell's shape.
DROPOUT_SHAPES = (
    (128, 16, 16, 4096, False),
    (128, 16, 16, 4096, True),
    (128, 16, 4, 4096, True),
    (64, 16, 16, 4096, True),
)
# SDPA's efficient backend with the ALiBi bias as an explicit [Hq, S_q, S_k] bf16 mask (expanded over
# the batch, read per batch entry) computes every pair: run only where the bias is at most this big
# (S 4096 at Hq 16: 512 MiB; S 16384 would be 8 GiB).
BIAS_PEER_MAX_BYTES = 1024**3

# Backward FLOPs over forward FLOPs (the backward does 2.5 forwards' worth of matrix products).
BACKWARD_FLOP_FACTOR = 2.5

# Rotate among input sets until one pass over them touches this many bytes, so that L2 (60 MB on
# the H200) does not serve repeated calls; at most MAX_INPUT_SETS sets.
ROTATION_BYTES = 256 * 1024**2
MAX_INPUT_SETS = 4

# FA2 inside torch SDPA fails with a device-side assert when B * H exceeds this (BENCHMARKS.md,
# small-seq runs 5-9), which would end the CUDA context of the whole process: such cells never run it.
SDPA_FLASH_MAX_BATCH_HEADS = 65535


def modifier_name(softcap: float, alibi: bool) -> str:
    """The name part of the score modifiers: ``cap50``, ``alibi``, ``cap50,alibi``, or "" for none."""
    return ",".join(([f"cap{softcap:g}"] if softcap > 0 else []) + (["alibi"] if alibi else []))


@dataclass(frozen=True)
class Cell:
    section: str
    direction: str
    head_dim: int
    heads_q: int
    heads_kv: int
    causal: bool = False
    batch: int = 0  # sequences
    seqlen_q: int = 0  # BSHD: the length of every sequence (THD: 0, the lengths are drawn)
    seqlen_k: int = 0
    page_size: int = 0  # decode: tokens per page of a paged cache (0: contiguous)
    window_left: int = -1  # flash-attn's window_size=(left, right); -1: that side unbounded
    window_right: int = -1
    softcap: float = 0.0  # flash-attn's softcap (0: none)
    alibi: bool = False  # ALiBi with alibi_slopes(heads_q)
    dropout_p: float = 0.0  # flash-attn's dropout_p (0: none)

    @property
    def window(self) -> tuple[int, int]:
        return (self.window_left, self.window_right)

    @property
    def windowed(self) -> bool:
        return self.window != NO_WINDOW

    @property
    def score_modified(self) -> bool:
        return self.softcap > 0 or self.alibi

    @property
    def modifiers(self) -> str:
        return modifier_name(self.softcap, self.alibi)

    @property
    def is_decode(self) -> bool:
        """One query token per sequence against a KV cache, run through flash_attn_with_kvcache."""
        return self.section == "decode" or (self.section == "window" and self.seqlen_q == 1)

    @property
    def name(self) -> str:
        heads = f"h{self.heads_q}:{self.heads_kv}"
        mask = "causal" if self.causal else "noncausal"
        if self.section == "window":
            window = f"w{self.window_left},{self.window_right}"
            if self.seqlen_q == 1:
                return f"window/d{self.head_dim}/{heads}/b{self.batch}/kv{self.seqlen_k}/{window}/{mask}/{self.direction}"
            return f"window/d{self.head_dim}/{heads}/s{self.seqlen_q}/{window}/{mask}/{self.direction}"
        if self.section == "scoremod":
            return f"scoremod/d{self.head_dim}/{heads}/s{self.seqlen_q}/{self.modifiers}/{mask}/{self.direction}"
        if self.section == "dropout":
            return f"dropout/d{self.head_dim}/{heads}/s{self.seqlen_q}/p{self.dropout_p:g}/{mask}/{self.direction}"
        if self.section == "smallseq":
            return f"smallseq/d{self.head_dim}/{heads}/{self.direction}"
        if self.section == "batch":
            return f"batch/d{self.head_dim}/{heads}/s{self.seqlen_q}/{mask}/{self.direction}"
        if self.section == "varlen":
            return f"varlen/d{self.head_dim}/{heads}/{mask}/{self.direction}"
        paged = f"/paged{self.page_size}" if self.page_size else ""
        return f"decode/d{self.head_dim}/{heads}/b{self.batch}/kv{self.seqlen_k}{paged}/{self.direction}"

    @property
    def layout(self) -> str:
        return "thd" if self.section in ("smallseq", "varlen") else "bshd"

    def params(self) -> dict:
        return {"name": self.name, "layout": self.layout, **asdict(self)}


# ---- the cell list -------------------------------------------------------------------------------

def all_cells() -> list[Cell]:
    """Every cell of the full matrix, in the order the report shows them."""
    found = []
    for head_dim in SMALLSEQ_HEAD_DIMS:
        for heads_q, heads_kv in SMALLSEQ_HEADS:
            for direction in ("fwd", "bwd"):
                found.append(Cell("smallseq", direction, head_dim, heads_q, heads_kv, batch=SMALLSEQ_SEQUENCES))
    for head_dim in BATCH_HEAD_DIMS:
        for heads_q, heads_kv in BATCH_HEADS:
            for causal in (False, True):
                for seqlen in BATCH_SEQLENS:
                    for direction in ("fwd", "fwdbwd"):
                        found.append(Cell("batch", direction, head_dim, heads_q, heads_kv, causal,
                                          batch=BATCH_TOKENS // seqlen, seqlen_q=seqlen, seqlen_k=seqlen))
    for heads_q, heads_kv in BATCH_HEADS:
        for causal in (False, True):
            for direction in ("fwd", "fwdbwd"):
                found.append(Cell("varlen", direction, VARLEN_HEAD_DIM, heads_q, heads_kv, causal,
                                  batch=len(varlen_lengths())))
    for batch, kv, heads_q, heads_kv in DECODE_SHAPES:
        found.append(Cell("decode", "fwd", DECODE_HEAD_DIM, heads_q, heads_kv, batch=batch, seqlen_q=1, seqlen_k=kv))
    for batch, kv, heads_q, heads_kv in DECODE_PAGED_SHAPES:
        found.append(Cell("decode", "fwd", DECODE_HEAD_DIM, heads_q, heads_kv, batch=batch, seqlen_q=1, seqlen_k=kv,
                          page_size=DECODE_PAGE_SIZE))
    for head_dim, heads_q, heads_kv, seqlen, (left, right), causal in WINDOW_SHAPES:
        for direction in ("fwd", "fwdbwd"):
            found.append(Cell("window", direction, head_dim, heads_q, heads_kv, causal, batch=BATCH_TOKENS // seqlen,
                              seqlen_q=seqlen, seqlen_k=seqlen, window_left=left, window_right=right))
    for batch, kv, heads_q, heads_kv, (left, right) in WINDOW_DECODE_SHAPES:
        found.append(Cell("window", "fwd", WINDOW_HEAD_DIM, heads_q, heads_kv, True, batch=batch, seqlen_q=1,
                          seqlen_k=kv, window_left=left, window_right=right))
    for head_dim, heads_q, heads_kv, seqlen, softcap, alibi, causal in SCOREMOD_SHAPES:
        for direction in ("fwd", "fwdbwd"):
            found.append(Cell("scoremod", direction, head_dim, heads_q, heads_kv, causal, batch=BATCH_TOKENS // seqlen,
                              seqlen_q=seqlen, seqlen_k=seqlen, softcap=softcap, alibi=alibi))
    for head_dim, heads_q, heads_kv, seqlen, causal in DROPOUT_SHAPES:
        for direction in ("fwd", "fwdbwd"):
            found.append(Cell("dropout", direction, head_dim, heads_q, heads_kv, causal, batch=BATCH_TOKENS // seqlen,
                              seqlen_q=seqlen, seqlen_k=seqlen, dropout_p=DROPOUT_P))
    return found


def plain_twin(cell: Cell) -> Cell:
    """The batch cell of a scoremod or dropout cell's shape: the same work without the modifier or dropout."""
    return Cell("batch", cell.direction, cell.head_dim, cell.heads_q, cell.heads_kv, cell.causal, batch=cell.batch,
                seqlen_q=cell.seqlen_q, seqlen_k=cell.seqlen_k)


def alibi_slopes(heads: int) -> tuple[float, ...]:
    """The ALiBi paper's slopes for ``heads`` heads: the geometric series 2^(-8 (h + 1) / heads)."""
    return tuple(2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads))


# The A/B subset: a few cells of each section, chosen to span its parameters and its known cliffs.
QUICK_CELLS = (
    "smallseq/d128/h16:16/fwd",
    "smallseq/d128/h16:16/bwd",
    "smallseq/d128/h16:4/bwd",
    "smallseq/d256/h16:16/fwd",
    "smallseq/d64/h16:1/fwd",
    "batch/d128/h16:16/s1024/noncausal/fwd",
    "batch/d128/h16:16/s4096/noncausal/fwdbwd",
    "batch/d128/h16:16/s16384/causal/fwd",
    "batch/d64/h16:4/s2048/causal/fwdbwd",
    "batch/d64/h16:16/s512/noncausal/fwd",
    "batch/d96/h16:16/s4096/noncausal/fwd",
    "batch/d96/h16:4/s4096/causal/fwdbwd",
    "batch/d256/h16:16/s8192/causal/fwdbwd",
    "batch/d128/h16:4/s512/noncausal/fwd",
    "varlen/d128/h16:16/noncausal/fwd",
    "varlen/d128/h16:16/causal/fwdbwd",
    "varlen/d128/h16:4/noncausal/fwdbwd",
    "decode/d128/h32:8/b64/kv4096/fwd",
    "decode/d128/h32:8/b64/kv4096/paged256/fwd",
    "decode/d128/h32:8/b1/kv131072/fwd",
    "decode/d128/h32:32/b128/kv1024/fwd",
    "window/d128/h16:4/s16384/w1023,0/causal/fwd",
    "window/d128/h16:4/s4096/w512,512/noncausal/fwdbwd",
    "scoremod/d128/h16:4/s4096/cap50/causal/fwdbwd",
    "scoremod/d128/h16:4/s4096/alibi/noncausal/fwd",
    "dropout/d128/h16:16/s4096/p0.1/causal/fwdbwd",
)


def quick_cells() -> list[Cell]:
    by_name = {cell.name: cell for cell in all_cells()}
    missing = [name for name in QUICK_CELLS if name not in by_name]
    if missing:
        raise ValueError(f"QUICK_CELLS names cells that are not in the matrix: {missing}")
    return [by_name[name] for name in QUICK_CELLS]


# After the quick subset, the full run measures the small sections first: a run cut short by its
# budget then loses cells of the largest section only.
REST_ORDER = ("varlen", "decode", "window", "scoremod", "dropout", "smallseq", "batch")


def select(quick: bool = False, only: str | None = None) -> list[Cell]:
    """The cells a run measures, in the order it measures them: the quick subset alone, or the quick
    subset first and then the rest section by section in REST_ORDER (so that a run cut short by its
    budget still has a sample of every section); ``only`` keeps the cells whose name matches that
    regular expression (re.search)."""
    import re

    first = quick_cells()
    rest = sorted((c for c in all_cells() if c.name not in QUICK_CELLS), key=lambda c: REST_ORDER.index(c.section))
    cells = first if quick else first + rest
    if only:
        pattern = re.compile(only)
        cells = [c for c in cells if pattern.search(c.name)]
    return cells


def by_name(name: str) -> Cell:
    for cell in all_cells():
        if cell.name == name:
            return cell
    raise KeyError(f"no cell named {name!r}")


# ---- peers ---------------------------------------------------------------------------------------

PEERS = {
    # SDPA's backends on the padded [B, H, 17, D] batch (no padding mask: a lower bound on what a user
    # without varlen support pays), and torch's varlen attention on the same THD data.
    "smallseq": ("varlen_attn", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient"),
    "batch": ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient"),
    # SDPA padded to the longest of these sequences would compute other attention, 2-3x the tokens.
    "varlen": ("varlen_attn",),
    "decode": ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "varlen_attn"),
    # SDPA's flash and cuDNN backends take no window (and an explicit mask turns them off): FlexAttention
    # with a window mask_mod, varlen_attn (FA2) with window_size, and the efficient backend with the
    # boolean mask as a reference (sdpa_masked).
    "window": ("flex", "varlen_attn", "sdpa_masked"),
    # SDPA has no softcap and its flash and cuDNN backends take no bias; torch's varlen_attn takes
    # neither modifier: FlexAttention with a score_mod, and for ALiBi alone the efficient backend with
    # the bias as an explicit float mask as a reference (sdpa_bias).
    "scoremod": ("flex", "sdpa_bias"),
    # SDPA's backends draw their own dropout masks with the same dropout_p.
    "dropout": ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient"),
}
# A decode step's window is a run of the cache: SDPA's backends run on that slice of it (the same
# function on the same data) instead of a mask.
WINDOW_DECODE_PEERS = ("flex", "varlen_attn", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient")


def peers(cell: Cell) -> tuple[str, ...]:
    if cell.section == "window" and cell.is_decode:
        return WINDOW_DECODE_PEERS
    if cell.section == "scoremod" and cell.softcap > 0:  # no SDPA backend caps the scores
        return ("flex",)
    return PEERS[cell.section]


def padded_peer(cell: Cell, peer: str) -> bool:
    """Whether ``peer`` runs on a padded copy of the cell's data (a different function: excluded from
    the numeric check, marked in the report)."""
    return cell.section == "smallseq" and peer.startswith("sdpa_")


def checked_peer(cell: Cell, peer: str) -> bool:
    """Whether hipattn's outputs are checked against ``peer``'s: it computes the same function on the
    same data (not on a padded copy, and without dropout, whose mask each library draws its own way)."""
    return not padded_peer(cell, peer) and cell.dropout_p == 0.0


def prescreen(cell: Cell, peer: str) -> str | None:
    """Why ``peer`` is not run on ``cell`` at all, or None. Only for peers known to end the process's
    CUDA context on such a cell, and for the masked reference peers where their mask is large; every
    other failure is found by running the peer."""
    if peer == "sdpa_flash" and cell.batch * cell.heads_q > SDPA_FLASH_MAX_BATCH_HEADS:
        return (f"not run: B*Hq = {cell.batch * cell.heads_q} > {SDPA_FLASH_MAX_BATCH_HEADS}, where FA2 in SDPA "
                "fails with a device-side assert (BENCHMARKS.md small-seq runs 5-9) that would end the CUDA context")
    if peer == "sdpa_masked" and cell.seqlen_q * cell.seqlen_k > MASKED_PEER_MAX_MASK_BYTES:
        mask = cell.seqlen_q * cell.seqlen_k
        return (f"not run: its [S_q, S_k] boolean mask would be {mask // 1024**2} MiB (> "
                f"{MASKED_PEER_MAX_MASK_BYTES // 1024**2} MiB; twice that again as the bf16 bias SDPA makes of it "
                "per call), and it computes all S_q * S_k pairs: a reference only where that is cheap")
    if peer == "sdpa_bias" and bias_bytes(cell) > BIAS_PEER_MAX_BYTES:
        return (f"not run: its [Hq, S_q, S_k] bf16 ALiBi bias would be {bias_bytes(cell) // 1024**2} MiB (> "
                f"{BIAS_PEER_MAX_BYTES // 1024**2} MiB), read again for every batch entry, and it computes all "
                "S_q * S_k pairs: a reference only where that is cheap")
    return None


def bias_bytes(cell: Cell) -> int:
    """The bytes of the sdpa_bias peer's explicit ALiBi bias, [Hq, S_q, S_k] bf16."""
    return cell.heads_q * cell.seqlen_q * cell.seqlen_k * ELEMENT_BYTES


# ---- sequence lengths ----------------------------------------------------------------------------

@functools.cache
def smallseq_lengths(sequences: int = SMALLSEQ_SEQUENCES, seed: int = SMALLSEQ_SEED) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Query and key lengths, each drawn independently and uniformly from 1..SMALLSEQ_TILE."""
    draw = random.Random(seed)
    lengths_q = tuple(draw.randint(1, SMALLSEQ_TILE) for _ in range(sequences))
    lengths_k = tuple(draw.randint(1, SMALLSEQ_TILE) for _ in range(sequences))
    return lengths_q, lengths_k


@functools.cache
def varlen_lengths(tokens: int = VARLEN_TOKENS, seed: int = VARLEN_SEED) -> tuple[int, ...]:
    """Lengths uniform in VARLEN_RANGE summing to ``tokens`` (the last one trimmed), as
    tools/bench_flash.py draws them."""
    draw = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < tokens:
        lengths.append(min(draw.randint(*VARLEN_RANGE), tokens - sum(lengths)))
    return tuple(lengths)


def lengths(cell: Cell) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per-sequence (query lengths, key lengths) of a cell."""
    if cell.section == "smallseq":
        return smallseq_lengths(cell.batch)
    if cell.section == "varlen":
        drawn = varlen_lengths()
        return drawn, drawn
    return (cell.seqlen_q,) * cell.batch, (cell.seqlen_k,) * cell.batch


# ---- work and floors -----------------------------------------------------------------------------

def effective_window(causal: bool, window: tuple[int, int] = NO_WINDOW) -> tuple[int, int]:
    """flash-attn's (left, right) as the kernels apply it: -1 for an unbounded side, and causal making
    the right side 0 (a causal cell without a window is (-1, 0))."""
    left, right = window
    return (left if left >= 0 else -1, 0 if causal else right if right >= 0 else -1)


def _offset_bounds(len_q: int, len_k: int, causal: bool, window: tuple[int, int]) -> tuple[int, int]:
    """(lo, hi): query i sees key j when lo <= j - i <= hi (clipped to what the grid holds)."""
    left, right = effective_window(causal, window)
    shift = len_k - len_q  # bottom-right alignment
    lo = -len_q if left < 0 else max(-len_q, shift - left)
    hi = len_k - 1 if right < 0 else min(len_k - 1, shift + right)
    return lo, hi


def visible_pairs(len_q: int, len_k: int, causal: bool, window: tuple[int, int] = NO_WINDOW) -> int:
    """(query, key) pairs a sequence computes. Aligned bottom-right as in hipattn and flash-attn 2.1+:
    with d = len_k - len_q, query i sees key j when i + d - left <= j <= i + d + right, a negative
    side having no bound and causal setting right = 0 (causal alone: j <= i + d).

    Counted exactly in O(1): the pairs with j - i <= c number F(c) = sum over rows i of
    clamp(i + c + 1, 0, len_k), a difference of two sums of clamp(x, 0, len_k) over x <= n."""
    if not causal and window == NO_WINDOW:
        return len_q * len_k
    lo, hi = _offset_bounds(len_q, len_k, causal, window)
    if hi < lo:
        return 0

    def clamped_sum(n: int) -> int:  # sum of clamp(x, 0, len_k) for x = 1..n
        if n <= 0:
            return 0
        if n <= len_k:
            return n * (n + 1) // 2
        return len_k * (len_k + 1) // 2 + (n - len_k) * len_k

    def at_most(c: int) -> int:  # pairs with j - i <= c
        return clamped_sum(c + len_q) - clamped_sum(c)

    return at_most(hi) - at_most(lo - 1)


def key_range(len_q: int, len_k: int, causal: bool, window: tuple[int, int] = NO_WINDOW) -> tuple[int, int]:
    """[first, end) of the keys some query of the sequence sees (each row's keys are a run, and the runs
    of consecutive rows overlap, so together they are one run); (0, 0) when no query sees any."""
    lo, hi = _offset_bounds(len_q, len_k, causal, window)
    first, last = max(0, lo), min(len_k - 1, len_q - 1 + hi)
    return (first, last + 1) if hi >= lo and last >= first else (0, 0)


def visible_keys(len_q: int, len_k: int, causal: bool, window: tuple[int, int] = NO_WINDOW) -> int:
    first, end = key_range(len_q, len_k, causal, window)
    return end - first


@dataclass(frozen=True)
class Work:
    flops: float
    bytes: float


def thd_bytes(total_q: int, total_k: int, heads_q: int, heads_kv: int, head_dim: int, direction: str,
              lse: bool = True) -> int:
    """Bytes the math needs to move, each tensor once, real tokens only, K/V once per KV head.

    Forward: q, k, v in; out (and the fp32 LSE, which training keeps) out. Backward: q, k, v, dout,
    LSE in; dq, dk, dv out (out itself is not needed: D_i = rowsum(dO * O) = sum_j P_ij dP_ij).
    Forward + backward: the two added, as every implementation runs them as two passes.
    """
    q_side = total_q * heads_q * head_dim * ELEMENT_BYTES
    kv_side = total_k * heads_kv * head_dim * ELEMENT_BYTES
    lse_bytes = total_q * heads_q * LSE_BYTES if lse else 0
    forward = 2 * q_side + 2 * kv_side + lse_bytes
    backward = 3 * q_side + 4 * kv_side + lse_bytes
    return {"fwd": forward, "bwd": backward, "fwdbwd": forward + backward}[direction]


def work(cell: Cell) -> Work:
    """FLOPs (4 * Hq * D per visible pair forward; 2.5x that backward, 3.5x forward + backward) and
    bytes (thd_bytes over the keys some query sees: all of them but in a decode window) of a cell. A
    decode forward writes no LSE (inference keeps none)."""
    lengths_q, lengths_k = lengths(cell)
    pairs = sum(visible_pairs(lq, lk, cell.causal, cell.window) for lq, lk in zip(lengths_q, lengths_k, strict=True))
    forward_flops = 4.0 * cell.heads_q * cell.head_dim * pairs
    factor = {"fwd": 1.0, "bwd": BACKWARD_FLOP_FACTOR, "fwdbwd": 1.0 + BACKWARD_FLOP_FACTOR}[cell.direction]
    total_bytes = thd_bytes(sum(lengths_q), _keys_read(cell), cell.heads_q, cell.heads_kv, cell.head_dim,
                            cell.direction, lse=not cell.is_decode)
    return Work(flops=forward_flops * factor, bytes=float(total_bytes))


def _keys_read(cell: Cell) -> int:
    """Keys summed over the sequences that some query sees (the others need not be read)."""
    lengths_q, lengths_k = lengths(cell)
    if not cell.windowed:  # every key is seen (causal: by the last row)
        return sum(lengths_k)
    return sum(visible_keys(lq, lk, cell.causal, cell.window) for lq, lk in zip(lengths_q, lengths_k, strict=True))


@dataclass(frozen=True)
class Ceilings:
    copy_bytes_per_s: float  # bytes read + written per second, device-to-device copy
    gemm_flops_per_s: float  # bf16 matrix product on random data


# An H200's copy bandwidth and bf16 GEMM rate as measured on the device tool's H200 (BENCHMARKS.md's
# runs); used for estimates only, never for a recorded floor.
NOMINAL_CEILINGS = Ceilings(copy_bytes_per_s=4.3e12, gemm_flops_per_s=7.8e14)


def floor(cell_work: Work, ceilings: Ceilings) -> dict:
    """The floor in ms: the larger of FLOPs / GEMM rate and bytes / copy bandwidth."""
    flops_ms = cell_work.flops / ceilings.gemm_flops_per_s * 1e3
    bytes_ms = cell_work.bytes / ceilings.copy_bytes_per_s * 1e3
    return {"ms": max(flops_ms, bytes_ms), "flops_ms": flops_ms, "bytes_ms": bytes_ms,
            "bound": "flops" if flops_ms >= bytes_ms else "bytes"}


def set_bytes(cell: Cell) -> int:
    """Bytes of one input set that a call touches (q, the k and v some query sees, and dout where the
    direction reads it)."""
    lengths_q, _ = lengths(cell)
    q_side = sum(lengths_q) * cell.heads_q * cell.head_dim * ELEMENT_BYTES
    kv_side = _keys_read(cell) * cell.heads_kv * cell.head_dim * ELEMENT_BYTES
    return q_side * (1 if cell.direction == "fwd" else 2) + 2 * kv_side


def input_sets(cell: Cell) -> int:
    return max(1, min(MAX_INPUT_SETS, math.ceil(ROTATION_BYTES / set_bytes(cell))))


# ---- timing plan and estimates -------------------------------------------------------------------

ROUNDS = 3  # rounds of interleaved timing per cell (hipattn, peers..., then back: ..., peers, hipattn)
SAMPLE_TARGET_MS = 1.0  # a sample runs back-to-back calls until it lasts about this long
MAX_CALLS_PER_SAMPLE = 32


def timing_plan(call_ms: float) -> tuple[int, int]:
    """(calls per sample, samples per round) for a runner whose call takes about ``call_ms``: short
    calls run back to back (a call's host overhead overlaps the previous call's kernels, as in a
    training step); long ones take fewer samples (they vary less and cost more)."""
    calls = max(1, min(MAX_CALLS_PER_SAMPLE, math.ceil(SAMPLE_TARGET_MS / max(call_ms, 1e-3))))
    samples = 3 if call_ms < 5.0 else 2 if call_ms < 25.0 else 1
    return calls, samples


# Expected time / floor of each runner, from BENCHMARKS.md where measured, guessed where not (only
# for estimates). hipattn's GQA/MQA small-seq backward runs the portable kernels.
EXPECTED_FLOOR_RATIO = {
    ("smallseq", "fwd"): {"hipattn": 1.4, "varlen_attn": 10, "sdpa_cudnn": 10, "sdpa_efficient": 10},
    ("smallseq", "bwd"): {"hipattn": 1.5, "varlen_attn": 19, "sdpa_cudnn": 11, "sdpa_efficient": 50},
    ("batch", "fwd"): {"hipattn": 2.5, "sdpa_flash": 2.8, "sdpa_cudnn": 1.6, "sdpa_efficient": 4.5},
    ("batch", "fwdbwd"): {"hipattn": 3.0, "sdpa_flash": 3.3, "sdpa_cudnn": 2.0, "sdpa_efficient": 5.5},
    ("varlen", "fwd"): {"hipattn": 2.5, "varlen_attn": 3.0},
    ("varlen", "fwdbwd"): {"hipattn": 3.0, "varlen_attn": 3.5},
    ("decode", "fwd"): {"hipattn": 15, "sdpa_flash": 4, "sdpa_cudnn": 4, "sdpa_efficient": 6, "varlen_attn": 4},
    # Guesses: windowed tiles are partly masked; sdpa_masked's is per computed pair (estimate_seconds
    # scales it by all pairs over the visible ones).
    ("window", "fwd"): {"hipattn": 3.0, "flex": 4.0, "varlen_attn": 3.0, "sdpa_masked": 6.0},
    ("window", "fwdbwd"): {"hipattn": 3.5, "flex": 5.0, "varlen_attn": 3.5, "sdpa_masked": 7.0},
    ("window", "decode"): {"hipattn": 15, "flex": 8, "varlen_attn": 4, "sdpa_flash": 4, "sdpa_cudnn": 4,
                           "sdpa_efficient": 6},
    # Guesses: a little above plain attention (the modifier's arithmetic per score); sdpa_bias's, like
    # sdpa_masked's, is per computed pair (the window run's masked SDPA: 6.3-6.4x the dense floor).
    ("scoremod", "fwd"): {"hipattn": 3.0, "flex": 3.5, "sdpa_bias": 6.5},
    ("scoremod", "fwdbwd"): {"hipattn": 3.5, "flex": 4.0, "sdpa_bias": 7.0},
    # Guesses: plain attention's plus the random numbers of the mask.
    ("dropout", "fwd"): {"hipattn": 3.5, "sdpa_flash": 3.5, "sdpa_cudnn": 2.5, "sdpa_efficient": 6.0},
    ("dropout", "fwdbwd"): {"hipattn": 4.0, "sdpa_flash": 4.0, "sdpa_cudnn": 3.0, "sdpa_efficient": 7.0},
}
# FlexAttention compiles (Dynamo + Inductor + Triton) on its first call in a cell: every cell has other
# shapes, block mask, score_mod or autograd mode. Seconds per direction, a little above the window
# section's H200 run (BENCHMARKS.md, 2026-12-01: setup_s 1.5-2.7 s forward and 4.8-5.8 s forward +
# backward, 10 s for the process's first compile); the records' setup_s say what it took.
FLEX_COMPILE_S = {"fwd": 3.0, "bwd": 6.0, "fwdbwd": 6.5}
# The peers that compute every (query, key) pair whatever the mask lets through.
DENSE_PEERS = ("sdpa_masked", "sdpa_bias")
SMALLSEQ_PORTABLE_BACKWARD_RATIO = 15
CELL_OVERHEAD_S = 0.3  # inputs, autograd graphs, the numeric check, freeing memory
RUNNER_OVERHEAD_S = 0.05  # set-up and first call (cuDNN plans, module loads)
SAMPLE_OVERHEAD_MS = 0.8  # the spin kernel before the sample, synchronize, clock read


def runner_seconds(call_ms: float, rounds: int = ROUNDS) -> float:
    """Device time of one runner on one cell: set-up call, check call, estimate call, then rounds."""
    calls, samples = timing_plan(call_ms)
    timed_ms = rounds * samples * (calls * call_ms + SAMPLE_OVERHEAD_MS)
    return RUNNER_OVERHEAD_S + (3 * call_ms + timed_ms) / 1e3


def estimate_seconds(cell: Cell, ceilings: Ceilings = NOMINAL_CEILINGS, rounds: int = ROUNDS) -> float:
    """Expected wall time of one cell, every runner included."""
    floor_ms = floor(work(cell), ceilings)["ms"]
    kind = "decode" if cell.section == "window" and cell.is_decode else cell.direction
    ratios = dict(EXPECTED_FLOOR_RATIO[(cell.section, kind)])
    if cell.section == "smallseq" and cell.direction == "bwd" and cell.heads_q != cell.heads_kv:
        ratios["hipattn"] = SMALLSEQ_PORTABLE_BACKWARD_RATIO
    for dense in DENSE_PEERS:
        if dense in ratios:  # it computes every pair
            lengths_q, lengths_k = lengths(cell)
            visible = sum(visible_pairs(q, k, cell.causal, cell.window) for q, k in zip(lengths_q, lengths_k, strict=True))
            ratios[dense] *= sum(q * k for q, k in zip(lengths_q, lengths_k, strict=True)) / max(visible, 1)
    seconds = CELL_OVERHEAD_S
    for runner in ("hipattn", *peers(cell)):
        if prescreen(cell, runner) is None:
            seconds += runner_seconds(floor_ms * ratios.get(runner, 5.0), rounds)
            seconds += FLEX_COMPILE_S[cell.direction] if runner == "flex" else 0.0
    return seconds


def estimate_by_section(cells: list[Cell], ceilings: Ceilings = NOMINAL_CEILINGS,
                        rounds: int = ROUNDS) -> dict[str, tuple[int, float]]:
    """{section: (cells, seconds)} in SECTIONS order, sections without cells left out."""
    totals: dict[str, tuple[int, float]] = {}
    for section in SECTIONS:
        chosen = [c for c in cells if c.section == section]
        if chosen:
            totals[section] = (len(chosen), sum(estimate_seconds(c, ceilings, rounds) for c in chosen))
    return totals
