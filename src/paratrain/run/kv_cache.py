"""Inference with a KV cache: :func:`decode` appends tokens to a :class:`KVCache` (the keys
and values of the positions already seen) and runs only the new ones.

It lives outside :mod:`paratrain.model` because only sampling needs it: the training
model and every parallel transform stay as they are. It reuses the model's own pieces
(``Attention.project``: the projections and RoPE; :func:`paratrain.model.heads_first`:
grouped-query heads; :func:`paratrain.model.eager_attention`, whose mask already allows
S keys for T queries), so the cached logits are the uncached ones (tests/test_generate.py:
1e-6 in float64 at every step).

Shapes: B batch, T new positions, S = cached + T keys, H heads, K kv heads, E head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paratrain.config import ModelConfig
from paratrain.model import Attention, Block, Decoder, eager_attention, heads_first


def cached_attention(q_BHTE, k_BHSE, v_BHSE, kernel: str) -> torch.Tensor:
    """Causal attention of T new queries over S = cached + T keys.

    sdpa's ``is_causal`` aligns its mask top-left (query i sees keys 0..i), right only
    when S = T; with a cache the mask is explicit (query i sees keys 0..S - T + i), and
    a single new query sees every key, so it needs none."""
    T, S = q_BHTE.shape[-2], k_BHSE.shape[-2]
    if kernel == "eager":
        return eager_attention(q_BHTE, k_BHSE, v_BHSE)
    if T == S or T == 1:
        return F.scaled_dot_product_attention(q_BHTE, k_BHSE, v_BHSE, is_causal=T > 1)
    sees_TS = torch.ones(T, S, dtype=torch.bool, device=q_BHTE.device).tril(S - T)
    return F.scaled_dot_product_attention(q_BHTE, k_BHSE, v_BHSE, attn_mask=sees_TS)


class KVCache:
    """Keys and values (after RoPE) of the positions a batch has seen.

    One (B, context, K, E) buffer each for keys and values per block, K the model's kv
    heads (grouped-query attention repeats them only at use, as in training); ``length``
    positions are filled. :func:`decode` writes into it and advances it."""

    def __init__(self, cfg: ModelConfig, batch: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        shape = (batch, cfg.context, cfg.kv_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.length = 0

    def extend(self, layer: int, k_BTKE, v_BTKE) -> tuple[torch.Tensor, torch.Tensor]:
        """Write block ``layer``'s new keys/values at ``length``; all of them so far."""
        t0, t1 = self.length, self.length + k_BTKE.shape[1]
        self.k[layer][:, t0:t1] = k_BTKE
        self.v[layer][:, t0:t1] = v_BTKE
        return self.k[layer][:, :t1], self.v[layer][:, :t1]


def _attention(attn: Attention, x_BTD, cos, sin, cache: KVCache, layer: int) -> torch.Tensor:
    """``attn.forward`` for T new positions after ``cache.length`` cached ones (cos, sin
    are the new positions' rows): their keys/values join the cache."""
    q, k, v = attn.project(x_BTD, cos, sin)
    q, k, v = heads_first(q, *cache.extend(layer, k, v))
    return attn.wo(cached_attention(q, k, v, attn.kernel).transpose(1, 2).flatten(2))


def _block(blk: Block, x_BTD, cos, sin, cache: KVCache, layer: int) -> torch.Tensor:
    x_BTD = x_BTD + _attention(blk.attn, blk.attn_norm(x_BTD), cos, sin, cache, layer)
    return x_BTD + blk.mlp(blk.mlp_norm(x_BTD))


@torch.no_grad()
def decode(model: Decoder, idx_BT: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Token ids (B, T) at positions ``cache.length`` onwards -> their logits (B, T, V),
    equal to ``model.forward``'s at those positions over the whole sequence (a prefill is
    decode on an empty cache). The cache advances by T.

    A causal model only: with expert capacity (``capacity_factor`` > 0) a token's output
    depends on the sequence length, so that model has no cache."""
    T, t0 = idx_BT.shape[1], cache.length
    if model.cfg.capacity_factor > 0:
        raise ValueError("a model with expert capacity (capacity_factor > 0) routes "
                         "by sequence length; run forward over the whole sequence")
    if t0 + T > model.cfg.context:
        raise ValueError(f"{t0} cached + {T} new positions exceed the model context "
                         f"{model.cfg.context}; start a new cache")
    cos, sin = model.rope(t0, t0 + T)
    h = model.embed(idx_BT)
    for i, blk in enumerate(model.blocks):
        h = _block(blk, h, cos, sin, cache, i)
    cache.length = t0 + T
    return model.logits(h)
