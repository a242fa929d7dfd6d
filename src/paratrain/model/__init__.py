"""A LLaMA-style decoder in plain PyTorch: RMSNorm, RoPE, SwiGLU, causal attention (GQA);
optionally Qwen's attention (q, k, v biases: Qwen2; an RMSNorm over each head's queries
and keys before RoPE: Qwen3).

No parallel code lives here: no process groups, no device strings, no globals.
Parallelism enters through transforms in :mod:`paratrain.parallel` that change this
model in place. Two conventions make that possible:

- Attention reads its head count from its projections' output width
  (``wq.out_features // head_dim``), so a tensor-parallel transform that shards the
  projections by heads needs no change here.
- ``cfg.attention`` picks the attention kernel: ``sdpa`` (fused; keeps q, k, v, the
  output and one log-sum-exp per row for backward) or ``eager`` (the textbook formula;
  keeps the a x T x T probabilities). They agree to rounding; the systems model prices
  the bytes each keeps (:func:`paratrain.cost.memory.block_activation_bytes`).
- :meth:`Decoder.forward` is the composition ``head(blocks(embed(idx)))``, and each part
  is callable alone, so a pipeline stage can run any contiguous slice of it.
- :class:`MoE` sorts its token assignments by expert and runs them through
  :meth:`MoE.run_sorted`; expert parallelism (:mod:`paratrain.parallel.expert`) sets
  ``moe.exchange`` to send those rows to the experts' ranks instead, and keeps only its
  own experts in ``moe.experts``.
- Inference with a KV cache (:mod:`paratrain.run.kv_cache`) reuses ``Attention.project``
  and :func:`heads_first`, so it shares every layer with ``forward`` and changes nothing
  there; the parallel transforms never see it (they wrap ``forward`` and ``attn.core``).

Shapes: B batch, T time, D model width, H heads, K kv heads, E head dim, V vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.config import ModelConfig
from paratrain.model.moe import Expert, MoE, sort_assignments  # noqa: F401 (re-exported)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * self.weight


def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Pair i's angle per position, theta^(-2i/E), in float64; under Llama 3's scaling
    (``rope_factor`` > 1: Meta's Llama 3.1 code, transformers' rope_type "llama3") a pair
    whose wavelength 2 pi / f is longer than ``rope_original_context / rope_low_freq``
    turns ``rope_factor`` times slower, one shorter than ``rope_original_context /
    rope_high_freq`` is kept, and between them f is interpolated: (1 - a) f / factor + a
    f with a = (rope_original_context / wavelength - low) / (high - low)."""
    E = cfg.head_dim
    f = 1.0 / cfg.rope_theta ** (torch.arange(0, E, 2, dtype=torch.float64) / E)
    if cfg.rope_factor == 1.0:
        return f
    wavelength = 2 * math.pi / f
    low, high, old = cfg.rope_low_freq, cfg.rope_high_freq, cfg.rope_original_context
    a = ((old / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - a) * f / cfg.rope_factor + a * f


def rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (context, head_dim/2), in float64 (cast at use)."""
    ang = torch.outer(torch.arange(cfg.context, dtype=torch.float64), rope_frequencies(cfg))
    return ang.cos(), ang.sin()


def apply_rope(x_BTHE: torch.Tensor, cos_TE: torch.Tensor, sin_TE: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) by position-dependent angles (Su et al. 2021)."""
    x1, x2 = x_BTHE[..., 0::2], x_BTHE[..., 1::2]
    c = cos_TE[None, :, None, :].to(x_BTHE.dtype)
    s = sin_TE[None, :, None, :].to(x_BTHE.dtype)
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)


def eager_attention(q_BHTE: torch.Tensor, k_BHSE: torch.Tensor,
                    v_BHSE: torch.Tensor) -> torch.Tensor:
    """softmax(Q K^T / sqrt(E) + causal mask) V, written out (Vaswani et al. 2017).

    Autograd keeps q and k (for the score matmul), the probabilities P_BHTT (softmax's
    backward needs only its output) and v. The mask is added rather than filled in, so
    it is not kept; the scaled scores before the softmax are not kept either.

    The S keys may extend the T queries backwards (a KV cache: S = cached + T): query i
    is position S - T + i and sees keys 0..S - T + i. Training has S = T.
    """
    T, S, E = q_BHTE.shape[-2], k_BHSE.shape[-2], q_BHTE.shape[-1]
    mask_TS = torch.full((T, S), float("-inf"), dtype=q_BHTE.dtype,
                         device=q_BHTE.device).triu(1 + S - T)
    s_BHTS = q_BHTE @ k_BHSE.transpose(-2, -1) / math.sqrt(E) + mask_TS
    return s_BHTS.softmax(dim=-1) @ v_BHSE


def heads_first(q_BTHE, k_BSKE, v_BSKE) -> tuple[torch.Tensor, ...]:
    """(B, H, T, E) q and (B, H, S, E) k, v: grouped-query attention repeats each of the
    K kv heads for H / K query heads."""
    q, k, v = (t.transpose(1, 2) for t in (q_BTHE, k_BSKE, v_BSKE))
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return q, k, v


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.kernel = cfg.attention
        d, e = cfg.d_model, cfg.head_dim
        self.wq = nn.Linear(d, cfg.n_heads * e, bias=cfg.qkv_bias)
        self.wk = nn.Linear(d, cfg.kv_heads * e, bias=cfg.qkv_bias)
        self.wv = nn.Linear(d, cfg.kv_heads * e, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * e, d, bias=False)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:  # Qwen3: E gains each, shared by the heads (and by the tp ranks)
            self.q_norm = RMSNorm(e, cfg.norm_eps)
            self.k_norm = RMSNorm(e, cfg.norm_eps)

    def core(self, q_BTHE, k_BTKE, v_BTKE) -> torch.Tensor:
        """Causal softmax attention; returns (B, T, H*E). The 'selective' recompute unit."""
        q, k, v = heads_first(q_BTHE, k_BTKE, v_BTKE)
        if self.kernel == "eager":
            y = eager_attention(q, k, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).flatten(2)

    def project(self, x_BTD, cos, sin) -> tuple[torch.Tensor, ...]:
        """q (B, T, H, E) and k (B, T, K, E) rotated by RoPE (each head's normalised first
        under ``qk_norm``), v (B, T, K, E)."""
        B, T, _ = x_BTD.shape
        e = self.head_dim
        q = self.wq(x_BTD).view(B, T, -1, e)
        k = self.wk(x_BTD).view(B, T, -1, e)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), self.wv(x_BTD).view(B, T, -1, e)

    def forward(self, x_BTD, cos, sin) -> torch.Tensor:
        return self.wo(self.core(*self.project(x_BTD, cos, sin)))

class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w_gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.w_up = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.w_down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x_BTD)) * self.w_up(x_BTD))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int = 0) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(i) else SwiGLU(cfg)

    def forward(self, x_BTD, cos, sin) -> torch.Tensor:
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), cos, sin)
        return x_BTD + self.mlp(self.mlp_norm(x_BTD))

class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 style: N(0, 0.02), residual outputs scaled by 1/sqrt(2 L); biases 0."""
        for name, p in self.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            elif name.endswith(("wo.weight", "w_down.weight")):
                p.normal_(0.0, 0.02 / math.sqrt(2 * self.cfg.n_layers))
            else:
                p.normal_(0.0, 0.02)

    def rope(self, t0: int, t1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables for absolute positions [t0, t1)."""
        return self.rope_cos[t0:t1], self.rope_sin[t0:t1]

    def embed(self, idx_BT: torch.Tensor) -> torch.Tensor:
        return self.tok_emb(idx_BT)

    def logits(self, h_BTD: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(h_BTD))

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, V)."""
        T = idx_BT.shape[1]
        if T > self.cfg.context:
            raise ValueError(f"sequence length {T} exceeds the model context {self.cfg.context}")
        cos, sin = self.rope(0, T)
        h = self.embed(idx_BT)
        for blk in self.blocks:
            h = blk(h, cos, sin)
        return self.logits(h)

def moe_modules(model: nn.Module) -> list[MoE]:
    """The MoE MLPs of ``model`` (or of a list of pipeline chunks), in order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def set_moe_loss_scale(model: nn.Module, scale: float | None) -> None:
    """d(step loss)/d(token loss sum) = 1 / global tokens: the engines set it before each
    forward so the auxiliary loss enters backward with the same normalisation."""
    for m in moe_modules(model):
        m.loss_scale = scale


def take_moe_stats(model: nn.Module, experts: int, per_layer: bool = False) -> list[float]:
    """This rank's MoE statistics since the last call, as one flat list to be summed over
    ranks: [aux sum over layers and sequences, z-loss sum over layers and tokens,
    dropped assignments, load of expert 0..E-1 summed over layers] (a rank holding a
    subset of the experts counts all E: the load is counted where the tokens are routed),
    then with ``per_layer`` each MoE layer's load of expert 0..E-1, in layer order.
    Resets them."""
    aux, z, dropped, load = 0.0, 0.0, 0, torch.zeros(experts, dtype=torch.long)
    layers: list[float] = []
    for m in moe_modules(model):
        aux += m.stats["aux_sum"]
        z += m.stats["z_sum"]
        dropped += m.stats["dropped"]
        load += m.stats["load"]
        if per_layer:
            layers += map(float, m.stats["load"].tolist())
        m.reset_stats()
    return [aux, z, float(dropped), *map(float, load.tolist()), *layers]
