"""A LLaMA-style decoder in plain PyTorch: RMSNorm, RoPE, SwiGLU, causal attention (GQA).

No parallel code lives here: no process groups, no device strings, no globals.
Parallelism enters through transforms in :mod:`paratrain.parallel` that change this
model in place. Two conventions make that possible:

- Attention reads its head count from its projections' output width
  (``wq.out_features // head_dim``), so a tensor-parallel transform that shards the
  projections by heads needs no change here.
- ``cfg.attention`` picks the attention kernel: ``sdpa`` (fused; keeps q, k, v, the
  output and one log-sum-exp per row for backward) or ``eager`` (the textbook formula;
  keeps the a x T x T probabilities). They agree to rounding; the systems model prices
  the bytes each keeps (:func:`paratrain.systems.memory.block_activation_bytes`).
- :meth:`Decoder.forward` is the composition ``head(blocks(embed(idx)))``, and each part
  is callable alone, so a pipeline stage can run any contiguous slice of it.

Shapes: B batch, T time, D model width, H heads, K kv heads, E head dim, V vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * self.weight


def rope_tables(head_dim: int, context: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (context, head_dim/2), in float64 (cast at use)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = torch.outer(torch.arange(context, dtype=torch.float64), inv)
    return ang.cos(), ang.sin()


def apply_rope(x_BTHE: torch.Tensor, cos_TE: torch.Tensor, sin_TE: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) by position-dependent angles (Su et al. 2021)."""
    x1, x2 = x_BTHE[..., 0::2], x_BTHE[..., 1::2]
    c = cos_TE[None, :, None, :].to(x_BTHE.dtype)
    s = sin_TE[None, :, None, :].to(x_BTHE.dtype)
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)


def eager_attention(q_BHTE: torch.Tensor, k_BHTE: torch.Tensor,
                    v_BHTE: torch.Tensor) -> torch.Tensor:
    """softmax(Q K^T / sqrt(E) + causal mask) V, written out (Vaswani et al. 2017).

    Autograd keeps q and k (for the score matmul), the probabilities P_BHTT (softmax's
    backward needs only its output) and v. The mask is added rather than filled in, so
    it is not kept; the scaled scores before the softmax are not kept either.
    """
    T, E = q_BHTE.shape[-2], q_BHTE.shape[-1]
    mask_TT = torch.full((T, T), float("-inf"), dtype=q_BHTE.dtype,
                         device=q_BHTE.device).triu(1)
    s_BHTT = q_BHTE @ k_BHTE.transpose(-2, -1) / math.sqrt(E) + mask_TT
    return s_BHTT.softmax(dim=-1) @ v_BHTE


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.kernel = cfg.attention
        d, e = cfg.d_model, cfg.head_dim
        self.wq = nn.Linear(d, cfg.n_heads * e, bias=False)
        self.wk = nn.Linear(d, cfg.kv_heads * e, bias=False)
        self.wv = nn.Linear(d, cfg.kv_heads * e, bias=False)
        self.wo = nn.Linear(cfg.n_heads * e, d, bias=False)

    def core(self, q_BTHE, k_BTKE, v_BTKE) -> torch.Tensor:
        """Causal softmax attention; returns (B, T, H*E). The 'selective' recompute unit."""
        q, k, v = (t.transpose(1, 2) for t in (q_BTHE, k_BTKE, v_BTKE))
        rep = q.shape[1] // k.shape[1]
        if rep > 1:  # grouped-query attention: each kv head serves `rep` query heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        if self.kernel == "eager":
            y = eager_attention(q, k, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).flatten(2)

    def forward(self, x_BTD, cos, sin) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        e = self.head_dim
        q = apply_rope(self.wq(x_BTD).view(B, T, -1, e), cos, sin)
        k = apply_rope(self.wk(x_BTD).view(B, T, -1, e), cos, sin)
        v = self.wv(x_BTD).view(B, T, -1, e)
        return self.wo(self.core(q, k, v))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w_gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.w_up = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.w_down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x_BTD)) * self.w_up(x_BTD))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x_BTD, cos, sin) -> torch.Tensor:
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), cos, sin)
        return x_BTD + self.mlp(self.mlp_norm(x_BTD))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        cos, sin = rope_tables(cfg.head_dim, cfg.context, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 style: N(0, 0.02), residual outputs scaled by 1/sqrt(2 L)."""
        for name, p in self.named_parameters():
            if p.dim() == 1:
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


def num_params(cfg: ModelConfig) -> int:
    """Exact parameter count from the shape (same as ``cfg.num_params()``)."""
    return cfg.num_params()


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
    """Model FLOPs per trained token: 6N + 12 L H Q T (PaLM, appendix B)."""
    return cfg.flops_per_token(seq_len)
