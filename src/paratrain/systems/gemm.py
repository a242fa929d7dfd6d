"""One GEMM's time from its shape: a roofline with tile and wave quantisation.

A matrix multiply C[M, N] = A[M, K] B[K, N] does 2 M N K FLOPs and moves at least
(M K + K N + M N) elements through HBM. Its time is the larger of the two limits
(the roofline, Williams et al. 2009), as Calculon prices each GEMM of a layer
(Isaev et al., SC'23, "Calculon: a methodology and tool for high-level co-design"):

    t = max(2 M N K / (peak x gemm_eff x q x K / (K + K_FIXED)),  bytes / (hbm_bw x hbm_eff))

``gemm_eff`` is the fraction of peak a large, well-shaped GEMM reaches (a fitted
parameter per accelerator generation); ``q`` <= 1 is the work a GPU wastes on padding:

- tile quantisation: the output is cut into tiles of tm x tn; a partial tile at the
  edge costs a whole one, so q_tile = M N / (ceil(M/tm) tm ceil(N/tn) tn);
- wave quantisation: tiles run in waves of one per streaming multiprocessor; the last
  wave is partly empty, q_wave = tiles / (ceil(tiles / SMs) SMs) (NVIDIA's "Matrix
  multiplication background user's guide" describes both);
- depth: each tile also pays a fixed prologue and epilogue, worth K_FIXED = 256 steps of
  its reduction (:func:`depth`), so short-K GEMMs (narrow models, thin TP shards) lose
  efficiency. Without it the model over-predicted Megatron's 1.7B-7.5B weak-scaling runs;
  with it leave-one-out error fell from 5.90% to 5.56% (128: 5.78%, 512: 5.47%; we keep
  the value the kernels' pipeline depth gives, not the best-scoring one).

The library picks the tile per shape: the largest tile for large bf16 GEMMs on that chip
(A100: 128 x 128 with 108 SMs; H100 SXM: 128 x 256 with 132 SMs, from the A100 and H100
whitepapers' SM counts and CUTLASS's default tile shapes), or a smaller one (128 x 128,
64 x 128, 64 x 64) when that wastes less; we take the least wasteful. TPUs have no waves, only the
128 x 128 systolic array (Jouppi et al. 2023, TPU v4), so their tile is 128 x 128 and
their "SM" count 1 (no wave loss). Small GEMMs (thin micro-batches, narrow tensor-parallel
shards) lose efficiency through both terms, which is what keeps the search off absurdly
thin layouts.
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


_CHIPS = {
    "a100": Chip("a100", 128, 128, 108),
    "h100": Chip("h100", 128, 256, 132),
    "b200": Chip("b200", 128, 256, 148),
    "v100": Chip("v100", 128, 128, 80),
    "mi300x": Chip("mi300x", 256, 256, 304),
    "tpu-v3": Chip("tpu-v3", 128, 128, 1),
    "tpu-v4": Chip("tpu-v4", 128, 128, 1),
    "tpu-v5e": Chip("tpu-v5e", 128, 128, 1),
    "tpu-v5p": Chip("tpu-v5p", 128, 128, 1),
}
_NAME_KEYS = (("a100", "a100"), ("h100", "h100"), ("h800", "h100"), ("h200", "h100"),
              ("gh200", "h100"), ("b200", "b200"), ("gb200", "b200"), ("v100", "v100"),
              ("mi300", "mi300x"), ("tpu-v3", "tpu-v3"), ("tpu v3", "tpu-v3"),
              ("tpu-v4", "tpu-v4"), ("tpu v4", "tpu-v4"), ("tpu-v5e", "tpu-v5e"),
              ("tpu v5e", "tpu-v5e"), ("tpu-v5p", "tpu-v5p"), ("tpu v5p", "tpu-v5p"))


@lru_cache(maxsize=64)
def chip_of(name: str) -> Chip:
    """The chip generation of an accelerator, from its catalogue name or key (chips of one
    die share it: A100 40/80 GB; H100/H800/H200). Unknown names get an A100-like tile."""
    low = name.lower()
    for key, gen in _NAME_KEYS:
        if key in low:
            return _CHIPS[gen]
    return Chip(low, 128, 128, 108)


def _quantisation(M: int, N: int, tm: int, tn: int, sms: int) -> float:
    rows, cols = -(-M // tm), -(-N // tn)
    tiles = rows * cols
    waves = -(-tiles // sms)
    return (M * N) / (rows * tm * cols * tn) * tiles / (waves * sms)


def family(name: str) -> str:
    """The key the fitted efficiencies share: a GPU generation (a100, h100, ...) or "tpu"
    for every TPU (the same 128 x 128 systolic arrays, compiled by XLA)."""
    gen = chip_of(name).generation
    return "tpu" if gen.startswith("tpu") else gen


@lru_cache(maxsize=65536)
def quantisation(M: int, N: int, chip: Chip) -> float:
    """Useful fraction of the tiles and waves a GEMM with an M x N output occupies, under
    the least wasteful of the chip's large tile and the smaller ones libraries fall back to."""
    tiles = {(chip.tile_m, chip.tile_n), (128, 128), (64, 128), (64, 64)}
    return max(_quantisation(M, N, tm, tn, chip.sms) for tm, tn in tiles)


# A GPU GEMM kernel computes each output tile in K / 64 main-loop steps of a 64-deep
# slice, after a prologue that fills its multi-stage shared-memory pipeline (3-4 slices
# ahead in CUTLASS's sm80/sm90 bf16 kernels) and before an epilogue that writes the tile
# out: about four slices' time that does no multiply. So a tile costs K + K_FIXED.
K_FIXED = 256


def depth(K: int, chip: Chip) -> float:
    """The multiply share of a GPU tile's time, K / (K + K_FIXED): a GEMM with a short
    reduction (a narrow model's d_model, a tensor-parallel shard of it) runs further from
    peak than a deep one of the same FLOPs. TPUs stream K through the systolic array
    (no per-tile prologue): 1."""
    if chip.sms == 1:
        return 1.0
    return K / (K + K_FIXED)


def gemm_s(M: int, N: int, K: int, hw: Hardware, chip: Chip, gemm_eff: float,
           hbm_eff: float, elem: float = 2.0, count: int = 1) -> float:
    """Seconds for ``count`` GEMMs of M x K by K x N (roofline, quantised)."""
    if M <= 0 or N <= 0 or K <= 0:
        return 0.0
    flops = 2.0 * M * N * K
    t_c = flops / (hw.peak_flops * gemm_eff * quantisation(M, N, chip) * depth(K, chip))
    t_m = (M * K + K * N + M * N) * elem / (hw.hbm_bw * hbm_eff)
    return count * max(t_c, t_m)


def train_gemm_s(M: int, N: int, K: int, hw: Hardware, chip: Chip, gemm_eff: float,
                 hbm_eff: float, count: int = 1) -> tuple[float, float]:
    """(forward, backward) seconds of one linear layer's GEMMs for M tokens: forward
    Y[M,N] = X[M,K] W[K,N]; backward the input gradient dX[M,K] = dY W^T (an M x K output
    over N) and the weight gradient dW[K,N] = X^T dY (a K x N output over M)."""
    f = gemm_s(M, N, K, hw, chip, gemm_eff, hbm_eff, count=count)
    b = gemm_s(M, K, N, hw, chip, gemm_eff, hbm_eff, count=count) + \
        gemm_s(K, N, M, hw, chip, gemm_eff, hbm_eff, count=count)
    return f, b
