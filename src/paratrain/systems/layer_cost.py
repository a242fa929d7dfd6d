"""One transformer block's compute on one rank, per GEMM class, plus its memory-bound work.

The block is priced GEMM by GEMM from its shape (:mod:`paratrain.systems.gemm`), in the
manner of Calculon (Isaev et al., SC'23), for one micro-batch of M = b x s / cp tokens on
one tensor-parallel rank:

==============  ==========================================  ============================
class           forward GEMM (M x K by K x N)               note
==============  ==========================================  ============================
qkv             M x d by d x (H + 2 G) hd / tp              G kv heads (GQA)
attention       causal flash attention, H / tp heads        FLOPs / (peak x attn_eff)
out             M x H hd / tp by H hd / tp x d
mlp             up: M x d by d x (2|1) f / tp; down back    SwiGLU has two up matrices
router          t x d by d x E, t the tokens it routes      MoE only
experts         E / ep GEMMs of u k ep / E rows, f / etp     :mod:`.moe_step`
==============  ==========================================  ============================

Backward is the input-gradient and weight-gradient GEMMs (twice the forward FLOPs);
flash attention's backward does 2.5 times its forward's matmul work (five matmuls to
two, Dao 2023). A flash kernel's rate (``attn_eff``, a 128-wide head's) falls with
narrower heads: each score costs its softmax work whatever the head's width, as if the
head were ``h0`` wider (``Rates.attn_head_dims``), so a head of width h < 128 runs at
h / (h + h0) x (128 + h0) / 128 of it (:func:`head_dim_rate`); wider heads run no faster
(at 256, FlashAttention-3 holds its 128-wide rate, cuDNN's and FlashAttention-2's drop).
Causal attention computes half the score matrix; context parallelism's load-balanced
split gives each rank 1/cp of it (:mod:`paratrain.cost.cp_bytes`).

Memory-bound work (norms, residual adds, activation functions, RoPE, dropout, MoE
permutation) is counted in bytes read and written per token and priced at the HBM's
achieved bandwidth. Forward, per token, in elements: each norm reads and writes d (2 x
2d), each residual add reads two and writes one (2 x 3d), the SwiGLU activation reads two
f / tp and writes one (GELU: one and one), RoPE reads and writes q and k (and so do
Qwen3's per-head q and k norms, ``qk_norm``); with biases (GPT-style) the
bias-dropout-add adds 2 x 2d. Sequence parallelism runs the norms and adds
on M / tp tokens. Backward moves twice the forward's bytes. Every kernel also pays a
fixed launch cost (``KERNELS_FWD`` per block forward, twice that backward), or the GPU's
own gap for those a CUDA graph replays (:mod:`paratrain.systems.graph_scopes`).

FP8 training (Transformer Engine's recipe; torchao's float8 the same way) runs the
linear layers' GEMMs (qkv, out, mlp, experts; not the router, the attention core or the
output layer) on FP8 operands: at the FP8 peak (``Rates.fp8_hw``, whose machine balance
also sets the tile's epilogue in :func:`paratrain.systems.gemm.k_fixed`) times the
fitted ``fp8_eff`` of the 16-bit efficiency, and each GEMM's operands are cast first.
A fused cast-transpose reads the 16-bit tensor and writes it and its transpose in FP8
(``FP8_CAST_BYTES`` per element): forward, every linear layer's input; backward, every
linear layer's output gradient; one kernel per linear layer, counted with the block's
others (weights are cast once per step, which this per-micro-batch count leaves out).

The scaling recipe (:data:`FP8_RECIPES`, torchao's names) changes the casts and the
GEMMs. Per-tensor scales (Transformer Engine's delayed or current scaling, torchao's
``tensorwise``) and the block scales Blackwell's tensor cores apply themselves (MXFP8) are
the case above. torchao's ``rowwise`` scales each row of each operand: a tensor scaled
along one dimension cannot be reused along the other, so each input and output gradient
is cast twice, once per GEMM that reads it (6 bytes per element in two kernels, against
tensorwise's 4 in one: torchao's roofline, ``torchao/testing/training/roofline_utils.py``,
with the first read fused into the previous op as ``torch.compile`` does), and the
row-scaled GEMMs run on their own kernels (a CUTLASS kernel on H100, not cuBLAS's
tensorwise one), at the fitted ``fp8_rowwise_eff`` of tensorwise's rate: torchao calls
tensorwise "fastest" and publishes rowwise runs at 10% over BF16 where tensorwise gains
25% (H100) and 10% against 15% (MI300X), with no GEMM figure of its own.
``rowwise_with_gw_hp`` casts each input and output gradient once (1 byte per element,
fused) and computes the weight gradient in BF16.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from paratrain.cost.hardware import Hardware
from paratrain.cost.shapes import ModelShape
from paratrain.systems.gemm import Chip, train_gemm_s
from paratrain.systems.graph_scopes import graphed_kernels
from paratrain.systems.moe_step import (  # noqa: F401 (re-export)
    expert_imbalance,
    moe_kernels,
    moe_mlp,
)

KERNELS_FWD = 14  # norms, GEMMs, RoPE, attention, adds, activation, TP collectives
# eager attention, forward, per score element beyond what its two batched GEMMs move
# (QK^T writes the scores, PV reads the probabilities): the fused scale-mask-softmax
# kernel reads and writes each once, 4 bytes at 16 bits (backward moves twice as many)
EAGER_BYTES_PER_SCORE = 4.0
# The vocabulary-parallel cross-entropy as Megatron-LM writes it (and PyTorch's unfused
# loss), bytes per logit through HBM: cast the 16-bit logits to float32 (2 read + 4
# written), max (4), subtract it (4 + 4), exp (4 + 4), sum (4), divide by the sum in place
# (4 + 4, kept for backward); backward scales the saved softmax (4 + 4) and casts it back
# (4 + 2). For a 1.7B model with a 131K vocabulary that is a tenth of the step.
LOSS_BYTES_PER_LOGIT = 52.0
FP8_CAST_BYTES = 4.0  # read 2, write the FP8 copy and its transpose (1 + 1), per element
FP8_CLASSES = ("qkv", "out", "mlp", "experts")  # the linear layers FP8 recipes cast


@dataclass(frozen=True)
class Fp8Recipe:
    """What an FP8 scaling recipe costs beyond the GEMMs at the FP8 peak (module
    docstring): bytes per cast element, cast kernels per linear layer, whether the
    GEMMs are row-scaled (``fp8_rowwise_eff``) and whether the weight gradient is FP8."""

    cast_bytes: float
    cast_kernels: int
    rowwise: bool = False
    wgrad_fp8: bool = True


FP8_RECIPES = {
    "tensorwise": Fp8Recipe(FP8_CAST_BYTES, 1),
    "rowwise": Fp8Recipe(6.0, 2, rowwise=True),
    "rowwise_with_gw_hp": Fp8Recipe(1.0, 1, rowwise=True, wgrad_fp8=False),
}


def fp8_recipe_name(fp8: bool | str) -> str:
    """The :data:`FP8_RECIPES` key an ``fp8`` argument names: True is per-tensor scaling
    (``tensorwise``); a name must be one of them (one ValueError line otherwise)."""
    if fp8 is True:
        return "tensorwise"
    if fp8 not in FP8_RECIPES:
        raise ValueError(f"FP8 scaling {fp8!r} is unknown; choose one of "
                         f"{', '.join(FP8_RECIPES)}")
    return fp8
GEMM_CLASSES = ("qkv", "attention", "out", "mlp", "router", "experts")


@dataclass(frozen=True)
class Rates:
    """The physical efficiencies the compute terms use."""

    gemm_eff: float  # of the 16-bit peak
    attn_eff: float
    hbm_eff: float
    kernel_s: float
    fusion: float = 1.0  # element-wise bytes over the fused count (overlap.Engine.fusion)
    fp8_hw: Hardware | None = None  # FP8 GEMMs: the chip at its FP8 peak (module docstring)
    fp8_eff: float = 1.0  # FP8 GEMMs' share of their peak over gemm_eff
    fp8_recipe: str = "tensorwise"  # FP8_RECIPES: the scaling, its casts and GEMM kernels
    fp8_rowwise_eff: float = 1.0  # row-scaled FP8 GEMMs' rate over tensorwise's
    gmm_eff: float = 1.0  # a dropless MoE's grouped expert GEMMs' rate over gemm_eff (TPU)
    graph_scopes: tuple[str, ...] = ()  # parts of a layer replayed from CUDA graphs
    graph_kernel_s: float = 0.0  # ... whose kernels cost this instead of kernel_s
    attn_head_dims: float = 0.0  # a score's softmax work, in head widths (head_dim_rate)


def head_dim_rate(head_dim: float, h0: float) -> float:
    """A flash kernel's rate at heads ``head_dim`` wide over its rate at 128-wide heads,
    a score's fixed work counted as ``h0`` more head widths (module docstring)."""
    if head_dim >= 128 or h0 <= 0:
        return 1.0
    return head_dim / (head_dim + h0) * (128 + h0) / 128


@dataclass(frozen=True)
class BlockCost:
    """Seconds of one block on one rank for one micro-batch, forward and backward."""

    fwd: dict  # class -> seconds
    bwd: dict
    mem_fwd_s: float
    mem_bwd_s: float
    overhead_s: float  # kernel launches, forward + backward
    attn_fwd_s: float  # the attention core alone (what ring attention hides behind)

    @property
    def gemm_s(self) -> float:
        return sum(self.fwd.values()) + sum(self.bwd.values())

    @property
    def fwd_s(self) -> float:
        return sum(self.fwd.values()) + self.mem_fwd_s + self.overhead_s / 3

    @property
    def bwd_s(self) -> float:
        return sum(self.bwd.values()) + self.mem_bwd_s + 2 * self.overhead_s / 3

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_s


@lru_cache(maxsize=8192)
def block_cost(m: ModelShape, M: int, seq_len: int, tp: int, cp: int, sp: bool, ep: int,
               hw: Hardware, chip: Chip, r: Rates, moe: bool,
               attention: str = "flash", etp: int = 1,
               dispatcher: str = "alltoall") -> BlockCost:
    """One block (MoE if ``moe``: ``etp`` the plan's expert tensor parallelism,
    ``dispatcher`` the engine's) for a micro-batch of M tokens on one rank (cached: the
    search asks for the same few shapes again and again)."""
    d, hd, H, G = m.d_model, m.head_dim, m.n_heads, m.kv_heads
    he = r.hbm_eff
    # grouped expert matmuls at the TPU's grouped-kernel share (Rates.gmm_eff)
    grouped_eff = r.gemm_eff * (r.gmm_eff if m.grouped_experts else 1.0)
    fwd, bwd = {}, {}
    cast = [0.0, 0.0]  # FP8 casts: forward bytes, backward bytes
    cast_kernels: dict[str, int] = {}  # ... and their kernels per GEMM class
    rec = FP8_RECIPES[r.fp8_recipe]

    def lin(name: str, N: int, K: int, rows: int = M, count: int = 1) -> None:
        ge = grouped_eff if name == "experts" else r.gemm_eff
        if r.fp8_hw is not None and name in FP8_CLASSES:
            e8 = ge * r.fp8_eff * (r.fp8_rowwise_eff if rec.rowwise else 1.0)
            f, b = train_gemm_s(rows, N, K, r.fp8_hw, chip, e8, he, count,
                                None if rec.wgrad_fp8 else (hw, ge))  # dW in 16 bits
            cast[0] += rec.cast_bytes * rows * K * count
            cast[1] += rec.cast_bytes * rows * N * count
            cast_kernels[name] = cast_kernels.get(name, 0) + rec.cast_kernels
        else:
            f, b = train_gemm_s(rows, N, K, hw, chip, ge, he, count)
        fwd[name] = fwd.get(name, 0.0) + f
        bwd[name] = bwd.get(name, 0.0) + b

    if m.is_mla:
        qk = m.qk_nope_dim + m.qk_rope_dim
        if m.q_lora_rank:  # the query through its compression: d -> rank -> heads
            lin("qkv", m.q_lora_rank, d)
            lin("qkv", (H * qk) // tp, m.q_lora_rank)
        else:
            lin("qkv", (H * qk) // tp, d)
        lin("qkv", m.kv_lora_rank + m.qk_rope_dim, d)
        lin("qkv", H * (m.qk_nope_dim + m.v_head_dim) // tp, m.kv_lora_rank)
        dqk, dv = qk, m.v_head_dim
    else:
        lin("qkv", (H + 2 * G) * hd // tp, d)
        dqk = dv = hd
    lin("out", d, H * dv // tp)
    b_seqs = M * cp / seq_len
    heads = H // tp
    if attention != "eager":  # flash(3), causal: half the s x s scores (or a local
        # window's, ModelShape.attended_keys), 1/cp on this rank
        attn_flops = 2.0 * b_seqs * seq_len * m.attended_keys(seq_len) * heads * (dqk + dv) / cp
        rate = r.attn_eff * head_dim_rate((dqk + dv) / 2, r.attn_head_dims)
        attn_f = attn_flops / (hw.peak_flops * rate)
        fwd["attention"], bwd["attention"] = attn_f, 2.5 * attn_f
        scores = 0.0
    else:  # eager: batched GEMMs over the whole score matrix, which goes through HBM
        s_q = seq_len // cp
        count = max(1, round(b_seqs * heads))
        lin("attention", seq_len, dqk, s_q, count)
        lin("attention", dv, seq_len, s_q, count)
        attn_f = fwd["attention"]
        scores = b_seqs * heads * s_q * seq_len * EAGER_BYTES_PER_SCORE
    up = m.mlp_up_matrices
    f_act = 0.0
    if moe:  # the plan's expert layout and the engine's dispatcher (systems.moe_step)
        f_act = moe_mlp(m, M, tp, sp, ep, etp, lin, dispatcher)
    else:
        lin("mlp", up * m.d_ff // tp, d)
        lin("mlp", d, m.d_ff // tp)
        f_act = (up + 1) * m.d_ff / tp
    seq_part = (M / tp if sp else M)
    rope = 0 if m.learned_positions else 2 * (H + G) * hd / tp
    elems = seq_part * (4 + 6 + (4 if m.bias else 0)) * d + M * (
        f_act + rope * (2 if m.qk_norm else 1))
    mem_f = (elems * 2.0 * r.fusion + scores) / (hw.hbm_bw * he)
    cast_f, cast_b = (n / (hw.hbm_bw * he) for n in cast)
    moe_k = moe_kernels(m, ep) if moe else 0
    kernels = KERNELS_FWD + moe_k + sum(cast_kernels.values())
    graphed = graphed_kernels(r.graph_scopes, KERNELS_FWD, moe_k, cast_kernels)
    launches = (kernels - graphed) * r.kernel_s + graphed * r.graph_kernel_s
    return BlockCost(fwd, bwd, mem_f + cast_f, 2 * mem_f + cast_b, 3 * launches, attn_f)


@lru_cache(maxsize=4096)
def head_cost(m: ModelShape, M: int, tp: int, hw: Hardware, chip: Chip, r: Rates
              ) -> tuple[float, float]:
    """(forward, backward) seconds of the output layer and the loss on the last stage:
    the M x d by d x V / tp logits GEMM, and the softmax cross-entropy over them
    (:data:`LOSS_BYTES_PER_LOGIT`, forward and backward); and for each multi-token-
    prediction depth (``ModelShape.mtp_layers``) its 2d x d / tp projection and another
    output layer and loss (its block is priced as one more block on this stage,
    :func:`paratrain.systems.step_model.predict_step`)."""
    V = -(-m.vocab_size // tp)
    f, b = train_gemm_s(M, V, m.d_model, hw, chip, r.gemm_eff, r.hbm_eff)
    loss = LOSS_BYTES_PER_LOGIT * M * V / (hw.hbm_bw * r.hbm_eff)
    f, b = f + loss / 2, b + loss / 2 + 4 * r.kernel_s
    if not m.mtp_layers:
        return f, b
    pf, pb = train_gemm_s(M, -(-m.d_model // tp), 2 * m.d_model, hw, chip, r.gemm_eff,
                          r.hbm_eff)
    n = m.mtp_layers
    return (1 + n) * f + n * pf, (1 + n) * b + n * pb


