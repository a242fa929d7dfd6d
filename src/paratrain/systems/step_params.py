"""The step-time model's free parameters: few, physical, each with its provenance.

Twenty-four numbers (with the table's six TPU generations and MI300X), all efficiencies in
(0, 1] of a catalogue figure, except one latency (a family's efficiencies keep their start
values when a table has too few rows on it):

=================  =======  ==============================================================
parameter          start    provenance of the starting value and bound
=================  =======  ==============================================================
gemm_eff[a100]     0.85     the big-square figure the shape curve of gemm.py saturates at:
                            cuBLAS bf16 at 8192^3 reaches ~265 of 312 TF/s (NVIDIA "Matrix
                            multiplication background" guide's A100 curves)
gemm_eff[h100]     0.75     ~740 of 989 TF/s for large bf16 GEMMs on H100 SXM
                            (NVIDIA's Transformer Engine / cuBLAS figures)
gemm_eff[b200]     0.75     B200 and GB200 (one die): H100's start, no published GEMM
                            sweep at hand; the Blackwell rows of the table fit it
gemm_eff[b300]     0.75     B300 and GB300 (Blackwell Ultra, its own die and power limit):
                            B200's start; the table's GB300 and B300 rows fit it
gemm_eff[tpu-v*]   0.85     large matmuls on the 128 x 128 MXUs (Jouppi et al. 2023; v6e's
                            are 256 x 256), one per generation as for GPUs: v4, v5e, v5p,
                            v6e and TPU7x (Ironwood, v7x) differ in MXUs per core, HBM per
                            FLOP and compiler generation (one shared figure left MaxText's
                            v4 rows up to 9% fast, its v5e rows up to 16% slow)
gemm_eff[mi300x]   (mean)   no start of its own: the GPU families' mean (``gemm_for``: a
                            chip the table does not run takes its maker's fitted figure,
                            else its kind's mean); torchao's four MI300X
                            runs fit it (and ``attn_eff[mi300x]``, whose start is 0.7 x
                            the GEMM figure)
attn_eff[a100]     0.60     FlashAttention-2 forward+backward at ~50-70% of peak on A100
                            (Dao 2023); bounded by 0.75 (its best forward is 73%)
attn_eff[h100]     0.35     FlashAttention-2 on H100 reaches ~35-40% of peak: it does not
                            use Hopper's asynchronous tensor cores (Shah et al. 2024)
attn3_eff          0.60     Hopper's native fused attention (FlashAttention-3, cuDNN's, as
                            Transformer Engine runs it: ~600-750 of 989 TF/s forward,
                            Shah et al. 2024, the backward slower), bounded by 0.8;
                            engines that run it: overlap.py
attn3_bw_eff       0.60     Blackwell's (B200, B300 and their Grace pairings): cuDNN's
                            kernels on the fifth-generation tensor cores, another code
                            path than Hopper's; Hopper's start and bound
attn_tpu_eff       0.60     a TPU's attention (the compiler's fused kernel, Pallas splash
                            attention), another kernel again: Hopper's start and bound.
                            One figure for the three once put H100's long-sequence runs
                            30% fast: they say 0.33, Blackwell's 0.42, TPUs' 0.48
fp8_eff            1.0      FP8 GEMMs' share of the FP8 peak over gemm_eff: at 8192^3
                            cuBLASLt's FP8 GEMMs reach about the share of their (twice
                            as high) peak that BF16's reach of theirs, so 1 is the start
                            and the bound; what FP8 training loses beyond the casts and
                            the deeper epilogue (layer_cost.py) is what the FP8 rows fit
                            below it (bound 0.4)
fp8_rowwise_eff    1.0      row-scaled FP8 GEMMs' rate over tensorwise's (torchao's
                            ``rowwise`` recipes, layer_cost.py): their own kernels, no
                            published GEMM figure at hand, so 1 is the start and the
                            bound; the rowwise runs of the table fit it (bound 0.4)
tpu_gmm_eff        1.0      a dropless MoE's expert GEMMs on a TPU (MaxText's grouped
                            matmul kernels, megablox or tokamax ``gmm``, over the tokens
                            sorted by expert) at this share of the dense matmul rate
                            ``gemm_eff``: no published kernel figure at hand, so 1 is the
                            start and the bound; the TPU MoE rows of the table fit it
                            (bound 0.3). MaxText's capacity-padded MoE (``expert_capacity``
                            "padded") runs dense einsums: not priced so
hbm_eff            0.85     STREAM-like copies reach ~85-90% of nominal HBM bandwidth
nvlink_eff         0.80     NCCL all-reduce bus bandwidth ~360 of 450 GB/s (H100 NVLink 4),
                            ~230 of 300 GB/s (A100), nccl-tests; never below 0.6 (Calculon's
                            A100 system file uses 0.65): a fit that wants less is making
                            tensor-parallel bytes pay for something else
net_eff            0.80     NCCL bus bandwidth ~40 of 50 GB/s per 400 Gb/s NIC (nccl-tests)
kernel_s           4e-6     fixed cost of one kernel launch / collective call (CUDA launch
                            latency 3-5 us); bounded to 2-20 us
=================  =======  ==============================================================

Blackwell (B200, B300 and their Grace pairings) has no FlashAttention-2 efficiency of its
own (:data:`LEGACY_MMA`): FlashAttention-2 class kernels (PyTorch's SDPA flash backend,
flash-attn 2) issue Ampere's warp-level ``mma.sync``, which Blackwell's fifth-generation
tensor cores (``tcgen05``) do not accelerate; on a B200 they reach about what they reach on
an H100 (some 350 TF/s forward), a third of what cuDNN's native kernel does. So such a
kernel runs there at Hopper's absolute rate, ``attn_eff[h100]`` x 989 TF/s / the chip's
BF16 peak, and the Blackwell rows that run one inform ``attn_eff[h100]``. (As a free
parameter with a 0.35 start it priced torchtitan's Llama 3 8B on 8 B200 73% fast, its
attention at 790 TF/s.)

One more figure is fixed, not fitted: ``overlap_tax`` = 0.2, the share of a hidden
data-parallel transfer's time (DDP buckets, ZeRO reduce-scatters and gathers, FSDP's
per-block gathers) that still slows the step. Overlap is not free: NCCL runs each
collective as one CTA per channel (16-32 channels on NVLink/InfiniBand systems, i.e.
12-30% of an A100's 108 or an H100's 132 SMs) and shares HBM with the GEMMs it overlaps
(Pati et al., "T3: Transparent Tracking & Triggering for Fine-grained Overlap of Compute
& Collectives", ASPLOS 2024, measure overlapped GEMMs and collectives slowing each
other). Fitted freely on the runs table (bound 0-0.5) it came out at 0.24. It is what
makes FSDP's small micro-batches slow: at 4K tokens per GPU the gathers run under most
of the compute. Tensor-parallel and pipeline transfers are not taxed: Transformer
Engine's overlap and p2p sends run on copy engines.

``paratrain validate --fit`` refits them on the runs table within these bounds
(:mod:`paratrain.systems.fitting`) and writes ``data/fitted.toml``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cache

from paratrain.cost.hardware import load_hardware
from paratrain.systems.gemm import TPU_CHIPS, family, is_tpu, maker
from paratrain.systems.layer_cost import Rates

GEMM_EFF = {"a100": 0.85, "h100": 0.75, "b200": 0.75, "b300": 0.75,
            **dict.fromkeys(TPU_CHIPS, 0.85)}
ATTN_EFF = {"a100": 0.60, "h100": 0.35}
# chip families whose FlashAttention-2 class kernels run at another family's absolute rate
# (module docstring): Blackwell's, at Hopper's
LEGACY_MMA = {"b200": "h100", "b300": "h100"}
# GPU families with a native fused attention kernel ("flash3": cuDNN's through Transformer
# Engine, FlashAttention-3): Hopper and Blackwell
NATIVE_ATTENTION = ("h100", "b200", "b300")


# a score's softmax work, in head widths (layer_cost.head_dim_rate), from the forward
# rates at 64- and 128-wide heads that FlashAttention-3's paper measures on H100 SXM5 at
# 16K tokens (Shah et al. 2024, its forward-speed figures): cuDNN's kernel, which
# Transformer Engine runs natively, 413 against 595 TF/s, h0 = 101 (FlashAttention-3's own
# 497 against 648, 56); FlashAttention-2's 324 against 370, h0 = 21
NATIVE_HEAD_DIMS, FA2_HEAD_DIMS = 101.0, 21.0


# FlashAttention (the first, 2022) over FlashAttention-2's rate on the same chip: "about 2x
# faster than FlashAttention" (Dao 2023, FlashAttention-2, Sec. 4.1, A100 forward and
# backward); a row whose engine cell names it (row_engine.ENGINE_OPTIONS) runs "flash1"
FLASH1_SPEED = 0.5


def native_attention(fam: str, kernel: str) -> bool:
    """Whether ``kernel`` on a chip family runs at its native fused rate (``native_attn``):
    a TPU's compiled attention always, ``flash3`` on :data:`NATIVE_ATTENTION`; otherwise a
    fused kernel runs at the family's FlashAttention-2 class ``attn_eff`` (eager attention
    is priced as its batched GEMMs, :mod:`paratrain.systems.layer_cost`)."""
    return is_tpu(fam) or (kernel == "flash3" and fam in NATIVE_ATTENTION)


# the scalars of native fused attention: Hopper's, Blackwell's, a TPU's
NATIVE_ATTN = ("attn3_eff", "attn3_bw_eff", "attn_tpu_eff")


def native_attn_name(fam: str) -> str:
    """The scalar (of :data:`NATIVE_ATTN`) that prices a chip family's native fused
    attention: a TPU's (``attn_tpu_eff``), Blackwell's (:data:`LEGACY_MMA`'s families,
    ``attn3_bw_eff``) or Hopper's (``attn3_eff``)."""
    hopper, blackwell, tpu = NATIVE_ATTN
    if is_tpu(fam):
        return tpu
    return blackwell if fam in LEGACY_MMA else hopper


@cache
def _peak(key: str) -> float:
    """A catalogue chip's BF16 peak, read once (``attn_for`` runs for every priced row)."""
    return load_hardware(key).peak_flops


# the share of a hidden data-parallel transfer's time that still slows the step; a fixed
# physical figure, not one of the fitted parameters (module docstring)
OVERLAP_TAX = 0.2
SCALARS = (*NATIVE_ATTN, "fp8_eff", "fp8_rowwise_eff", "tpu_gmm_eff", "hbm_eff",
           "nvlink_eff", "net_eff", "kernel_s")
BOUNDS = {"gemm_eff": (0.3, 1.0), "attn_eff": (0.15, 0.75), "attn3_eff": (0.2, 0.8),
          "attn3_bw_eff": (0.2, 0.8), "attn_tpu_eff": (0.2, 0.8),
          "fp8_eff": (0.4, 1.0), "fp8_rowwise_eff": (0.4, 1.0), "tpu_gmm_eff": (0.3, 1.0),
          "hbm_eff": (0.3, 1.0),
          "nvlink_eff": (0.6, 1.0),
          "net_eff": (0.3, 1.0),
          "kernel_s": (2e-6, 20e-6)}


@dataclass(frozen=True)
class StepParams:
    gemm_eff: dict = field(default_factory=lambda: dict(GEMM_EFF))
    attn_eff: dict = field(default_factory=lambda: dict(ATTN_EFF))
    attn3_eff: float = 0.60
    attn3_bw_eff: float = 0.60
    attn_tpu_eff: float = 0.60
    fp8_eff: float = 1.0
    fp8_rowwise_eff: float = 1.0
    tpu_gmm_eff: float = 1.0
    hbm_eff: float = 0.85
    nvlink_eff: float = 0.80
    net_eff: float = 0.80
    kernel_s: float = 4e-6
    overlap_tax: float = OVERLAP_TAX  # fixed, not fitted (module docstring)

    def gemm_for(self, hw_name: str) -> float:
        """The GEMM efficiency of this chip's family; a family no parameter names (MI355X,
        V100: no run of the table pins them) takes the mean of its maker's fitted
        families (:func:`~paratrain.systems.gemm.maker`: MI355X MI300X's), else of its
        kind's (the GPU or the TPU families'), what the published runs say of such chips,
        rather than a start value no run has tested."""
        fam = family(hw_name)
        if fam in self.gemm_eff:
            return self.gemm_eff[fam]
        same = [v for k, v in self.gemm_eff.items() if maker(k) == maker(fam)]
        kind = same or [v for k, v in self.gemm_eff.items() if is_tpu(k) == is_tpu(fam)]
        return sum(kind) / len(kind) if kind else 0.75

    def attn_for(self, hw_name: str, kernel: str = "flash",
                 peak_flops: float | None = None) -> float:
        """Attention efficiency of ``kernel`` on this chip (BF16 peak ``peak_flops``): the
        chip's native fused attention (FlashAttention-3 / cuDNN on Hopper, "flash3"; on
        TPUs the compiler's fused kernel, always) at ``native_attn``; FlashAttention-2 class at
        the generation's attn_eff, on Blackwell at Hopper's absolute rate
        (:data:`LEGACY_MMA`); the first FlashAttention ("flash1") at
        :data:`FLASH1_SPEED` of FlashAttention-2's."""
        if kernel == "flash1":
            return FLASH1_SPEED * self.attn_for(hw_name, "flash", peak_flops)
        fam = family(hw_name)
        if native_attention(fam, kernel):
            return self.native_attn(fam)
        ref = LEGACY_MMA.get(fam)
        if ref is not None and peak_flops:
            return self.attn_eff.get(ref, ATTN_EFF[ref]) * _peak(ref) / peak_flops
        return self.attn_eff.get(fam, ATTN_EFF.get(fam, self.gemm_for(hw_name) * 0.7))

    def native_attn(self, fam: str) -> float:
        """The native fused attention's share of peak on a chip family
        (:func:`native_attn_name`)."""
        return getattr(self, native_attn_name(fam))

    def rates(self, hw_name: str, kernel: str = "flash",
              peak_flops: float | None = None) -> Rates:
        fam = family(hw_name)
        return Rates(self.gemm_for(hw_name), self.attn_for(hw_name, kernel, peak_flops),
                     self.hbm_eff, self.kernel_s,
                     gmm_eff=self.tpu_gmm_eff if is_tpu(fam) else 1.0,
                     attn_head_dims=NATIVE_HEAD_DIMS if native_attention(fam, kernel)
                     else FA2_HEAD_DIMS)

    def replace(self, **kw) -> StepParams:
        return dataclasses.replace(self, **kw)

    def as_dict(self) -> dict:
        return {"gemm_eff": dict(self.gemm_eff), "attn_eff": dict(self.attn_eff),
                **{k: getattr(self, k) for k in SCALARS}}

    def count(self) -> int:
        return len(self.gemm_eff) + len(self.attn_eff) + len(SCALARS)
