"""One GEMM's time from its shape: a roofline with the tile, wave, depth and split-K
effects real GPU kernels show.

A matrix multiply C[M, N] = A[M, K] B[K, N] does 2 M N K FLOPs and moves at least
(M K + K N + M N) elements through HBM. Its time is the larger of the two limits
(the roofline, Williams et al. 2009), as Calculon prices each GEMM of a layer
(Isaev et al., SC'23, "Calculon: a methodology and tool for high-level co-design"):

    t = max(2 M N K / (peak x gemm_eff x q x K / (K + k_fixed)),  bytes / (hbm_bw x hbm_eff))

``gemm_eff`` is the fraction of peak a big square GEMM reaches (a fitted parameter per
accelerator generation, bounded near the published big-square figures: cuBLAS bf16 at
8192^3 reaches about 85% of peak on A100 SXM and 75-80% on H100 SXM, Stas Bekman's
"Maximum Achievable Matmul FLOPS" tables in ml-engineering and NVIDIA's "Matrix
Multiplication Background User's Guide" A100 curves). The shape then costs what real
kernels lose on it; every term is measured in the guide's own terms:

- tile quantisation: the output is cut into tiles of tm x tn; a partial tile at the
  edge costs a whole one, so q_tile = M N / (ceil(M/tm) tm ceil(N/tn) tn);
- wave quantisation: tiles run in waves of one per streaming multiprocessor; the last
  wave is partly empty, q_wave = tiles / (ceil(tiles / SMs) SMs) (the guide's Sec. 3);
- split-K: an output of fewer tiles than SMs (a skinny GEMM: a thin micro-batch's weight
  gradient, a small expert) would leave most SMs idle for its whole time, so cuBLAS and
  CUTLASS split its reduction over s = min(SMs // tiles, K // SPLIT_K_MIN) CTAs that each
  write a float32 partial tile, then reduce them (:func:`split_k`): the wave fills, at
  the price of s partial outputs through HBM;
- depth: each tile also pays a fixed prologue (filling its shared-memory pipeline, about
  ``PROLOGUE_K`` steps) and an epilogue (writing its tm x tn outputs at the SM's share of
  HBM bandwidth, which takes as long as peak / hbm_bw x elem / 2 reduction steps: the
  chip's machine balance) (:func:`depth`). So a GEMM's rate rises with K as
  K / (K + k_fixed) and saturates near the big-square figure: A100 SXM 80 GB k_fixed ~
  280, H100 SXM ~ 420, H200 ~ 330 (more HBM per FLOP). Narrow models and thin
  tensor-parallel shards (short K) lose what their short reductions cost.

The library picks the tile per shape: the largest tile for large bf16 GEMMs on that chip
(A100: 128 x 128 with 108 SMs; H100 SXM: 128 x 256 with 132 SMs, H100 PCIe 114 SMs, from
the A100 and H100 whitepapers' SM counts and CUTLASS's default tile shapes), or a smaller
one (128 x 128, 64 x 128, 64 x 64) when that wastes less; we take the least wasteful. TPUs
have no waves, only the 128 x 128 systolic array (Jouppi et al. 2023, TPU v4), so their
tile is 128 x 128, their "SM" count 1 (no wave loss, no split-K) and K streams through
the array (no depth loss). ``tests/test_gemm_shape.py`` checks the curve against the
guide's qualitative shape: efficiency rising with K and with M, saturating near
``gemm_eff`` for big squares, skinny shapes rescued by split-K.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from paratrain.cost.hardware import Hardware


@dataclass(frozen=True)
class Chip:
    """What shape quantisation needs of one accelerator generation."""

    generation: str
    tile_m: int
    tile_n: int
    sms: int  # concurrent tiles per wave (1: no wave quantisation)
    family: str = ""  # whose fitted efficiencies it shares (default: its generation)


_CHIPS = {
    "a100": Chip("a100", 128, 128, 108),
    "h100": Chip("h100", 128, 256, 132),
    "h100-pcie": Chip("h100-pcie", 128, 256, 114, "h100"),  # the PCIe card's GH100 has 114 SMs
    "b200": Chip("b200", 128, 256, 148),
    # Blackwell Ultra (B300, GB300): a die of its own, 160 SMs enabled (NVIDIA, "Inside
    # NVIDIA Blackwell Ultra"), twice the B200's softmax exponent rate and a higher power
    # limit (1,100-1,400 W against 1,000-1,200 W): its own fitted efficiencies
    "b300": Chip("b300", 128, 256, 160),
    "v100": Chip("v100", 128, 128, 80),
    "mi300x": Chip("mi300x", 256, 256, 304),
    "mi355x": Chip("mi355x", 256, 256, 256),  # CDNA 4: 8 XCDs of 32 CUs, its own die
    "mi250x": Chip("mi250x", 128, 128, 110),  # one CDNA2 die (GCD): 110 compute units
    "mi250": Chip("mi250", 128, 128, 104, "mi250x"),  # MI250's GCD: 104 CUs, MI250X's die
    # H20: a GH100 with 78 SMs and a capped tensor rate (Hopper's kernels and efficiencies)
    "h20": Chip("h20", 128, 256, 78, "h100"),
    # L40S: Ada's AD102 with 142 SMs; no run of the table is on it, so its own family takes
    # the NVIDIA families' mean (StepParams.gemm_for)
    "l40s": Chip("l40s", 128, 128, 142),
    # Gaudi's matrix engines (MMEs) are 256 x 256 arrays a graph compiler shapes and feeds
    # as one, as a TPU's MXUs: no waves to quantise
    "gaudi2": Chip("gaudi2", 256, 256, 1),
    "gaudi3": Chip("gaudi3", 256, 256, 1),
    "tpu-v3": Chip("tpu-v3", 128, 128, 1),
    "tpu-v4": Chip("tpu-v4", 128, 128, 1),
    "tpu-v5e": Chip("tpu-v5e", 128, 128, 1),
    "tpu-v5p": Chip("tpu-v5p", 128, 128, 1),
    "tpu-v6e": Chip("tpu-v6e", 256, 256, 1),  # Trillium's MXUs are 256 x 256
    "tpu-v7x": Chip("tpu-v7x", 256, 256, 1),  # Ironwood: Trillium's MXU size assumed
}
TPU_CHIPS = tuple(name for name in _CHIPS if name.startswith("tpu-"))
# every family a fit can give efficiencies to (a chip's family or its own generation)
FAMILIES = tuple(dict.fromkeys(c.family or c.generation for c in _CHIPS.values()))
# first match wins: the longer names before the ones they contain
_NAME_KEYS = (("h100-pcie", "h100-pcie"), ("h100 pcie", "h100-pcie"), ("a100", "a100"),
              ("a800", "a100"), ("h100", "h100"), ("h800", "h100"), ("h200", "h100"),
              ("gh200", "h100"), ("b200", "b200"), ("gb200", "b200"), ("b300", "b300"),
              ("v100", "v100"), ("mi300", "mi300x"), ("mi325", "mi300x"),
              ("mi355", "mi355x"), ("mi350", "mi355x"),
              ("mi250x", "mi250x"), ("gaudi2", "gaudi2"), ("gaudi3", "gaudi3"),
              ("mi250", "mi250"), ("h20", "h20"), ("l40s", "l40s"),
              ("tpu-v3", "tpu-v3"),
              ("tpu v3", "tpu-v3"), ("tpu-v4", "tpu-v4"), ("tpu v4", "tpu-v4"),
              ("tpu-v5e", "tpu-v5e"), ("tpu v5e", "tpu-v5e"), ("tpu-v5p", "tpu-v5p"),
              ("tpu v5p", "tpu-v5p"), ("tpu-v6e", "tpu-v6e"), ("tpu v6e", "tpu-v6e"),
              ("trillium", "tpu-v6e"), ("tpu-v7", "tpu-v7x"), ("tpu v7", "tpu-v7x"),
              ("tpu7x", "tpu-v7x"), ("ironwood", "tpu-v7x"))


@lru_cache(maxsize=64)
def chip_of(name: str) -> Chip:
    """The chip generation of an accelerator, from its catalogue name or key (chips of one
    die share it: A100 40/80 GB; H100 SXM/NVL/H800/H200). Unknown names get an A100-like
    tile."""
    low = name.lower()
    for key, gen in _NAME_KEYS:
        if key in low:
            return _CHIPS[gen]
    return Chip(low, 128, 128, 108)


def _quantisation(M: int, N: int, tm: int, tn: int, sms: int, split: int = 1) -> float:
    rows, cols = -(-M // tm), -(-N // tn)
    units = rows * cols * split
    waves = -(-units // sms)
    return (M * N) / (rows * tm * cols * tn) * units / (waves * sms)


def family(name: str) -> str:
    """The key the fitted efficiencies share: a GPU generation (a100, h100, ...; the
    variants of one die share it) or a TPU generation (tpu-v4, tpu-v5e, tpu-v5p: the same
    128 x 128 systolic arrays, but not the same count per core, HBM per FLOP or
    compiler)."""
    chip = chip_of(name)
    return chip.family or chip.generation


def is_tpu(fam: str) -> bool:
    """Whether a :func:`family` is a TPU generation's (attention runs as the compiler's
    fused kernel there: no FlashAttention-2 efficiency of its own)."""
    return fam.startswith("tpu-")


def maker(fam: str) -> str:
    """Who makes a :func:`family`'s chips and writes their kernel libraries: AMD (MI*),
    Intel (Gaudi), Google (TPU), else NVIDIA. A family no run pins takes its maker's
    fitted efficiency (``StepParams.gemm_for``): one vendor's libraries carry across its
    generations more than chips in general do."""
    if fam.startswith("mi"):
        return "amd"
    if fam.startswith("gaudi"):
        return "intel"
    return "google" if is_tpu(fam) else "nvidia"


def _tiles(chip: Chip) -> set[tuple[int, int]]:
    return {(chip.tile_m, chip.tile_n), (128, 128), (64, 128), (64, 64)}


@lru_cache(maxsize=65536)
def quantisation(M: int, N: int, chip: Chip) -> float:
    """Useful fraction of the tiles and waves a GEMM with an M x N output occupies, under
    the least wasteful of the chip's large tile and the smaller ones libraries fall back to
    (no split-K: :func:`split_k`)."""
    return max(_quantisation(M, N, tm, tn, chip.sms) for tm, tn in _tiles(chip))


# A GPU GEMM kernel keeps a few 64-deep slices of A and B in flight in shared memory
# (3-4 stages in CUTLASS's sm80/sm90 bf16 kernels); before its first multiply it waits
# for about two of them to arrive from HBM.
PROLOGUE_K = 128
# cuBLAS and CUTLASS do not split a reduction into pieces shorter than a few slices
SPLIT_K_MIN = 256
PARTIAL_BYTES = 4.0  # a split-K partial tile is float32


def k_fixed(chip: Chip, hw: Hardware, elem: float = 2.0) -> float:
    """A GPU tile's fixed cost in reduction steps: the prologue, plus the epilogue that
    writes its tm x tn outputs at the SM's share of HBM bandwidth, which takes
    (elem / 2) x peak / hbm_bw steps of 2 tm tn FLOPs at the SM's share of peak (the
    machine balance; independent of the tile). TPUs stream K through the systolic array
    and overlap the drain: 0."""
    if chip.sms == 1:
        return 0.0
    return PROLOGUE_K + elem / 2 * hw.peak_flops / hw.hbm_bw


def depth(K: float, kf: float) -> float:
    """The multiply share of a tile's time, K / (K + k_fixed): a GEMM with a short
    reduction (a narrow model's d_model, a tensor-parallel shard of it) runs further from
    peak than a deep one of the same FLOPs."""
    return K / (K + kf) if kf else 1.0


@lru_cache(maxsize=65536)
def split_k(M: int, N: int, K: int, chip: Chip, kf: float) -> tuple[float, int]:
    """(useful fraction of the chip's rate, K split) of the best tiling: each candidate
    tile with no split, and, where its tiles do not fill one wave, with the reduction
    split s = min(SMs // tiles, K // SPLIT_K_MIN) ways (each piece K / s deep)."""
    best = (0.0, 1)
    for tm, tn in _tiles(chip):
        tiles = -(-M // tm) * -(-N // tn)
        splits = {1, max(1, min(chip.sms // tiles, K // SPLIT_K_MIN))}
        for s in splits:
            f = _quantisation(M, N, tm, tn, chip.sms, s) * depth(K / s, kf)
            best = max(best, (f, s))
    return best


@lru_cache(maxsize=65536)
def _gemm_one(M: int, N: int, K: int, hw: Hardware, chip: Chip, gemm_eff: float,
              hbm_eff: float, elem: float) -> float:
    rate, s = split_k(M, N, K, chip, k_fixed(chip, hw))
    t_c = 2.0 * M * N * K / (hw.peak_flops * gemm_eff * rate)
    partials = 2 * PARTIAL_BYTES * s * M * N if s > 1 else 0.0  # written, then reduced
    t_m = ((M * K + K * N + M * N) * elem + partials) / (hw.hbm_bw * hbm_eff)
    return max(t_c, t_m)


def gemm_s(M: int, N: int, K: int, hw: Hardware, chip: Chip, gemm_eff: float,
           hbm_eff: float, elem: float = 2.0, count: int = 1) -> float:
    """Seconds for ``count`` GEMMs of M x K by K x N (roofline, quantised, split-K)."""
    if M <= 0 or N <= 0 or K <= 0:
        return 0.0
    return count * _gemm_one(M, N, K, hw, chip, gemm_eff, hbm_eff, elem)


def train_gemm_s(M: int, N: int, K: int, hw: Hardware, chip: Chip, gemm_eff: float,
                 hbm_eff: float, count: int = 1,
                 wgrad: tuple[Hardware, float] | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of one linear layer's GEMMs for M tokens: forward
    Y[M,N] = X[M,K] W[K,N]; backward the input gradient dX[M,K] = dY W^T (an M x K output
    over N) and the weight gradient dW[K,N] = X^T dY (a K x N output over M), on
    ``wgrad`` = (chip at its peak, efficiency) when it runs at another precision."""
    w_hw, w_eff = wgrad or (hw, gemm_eff)
    f = gemm_s(M, N, K, hw, chip, gemm_eff, hbm_eff, count=count)
    b = gemm_s(M, K, N, hw, chip, gemm_eff, hbm_eff, count=count) + \
        gemm_s(K, N, M, w_hw, chip, w_eff, hbm_eff, count=count)
    return f, b
