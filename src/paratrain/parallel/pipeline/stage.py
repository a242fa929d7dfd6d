"""Cutting the plain decoder into pipeline chunks, balanced by compute.

A chunk holds a contiguous run of blocks, plus the token embedding if it is the first
virtual stage and the final norm and output head if it is the last. It keeps the
decoder's attribute names (``tok_emb``, ``blocks``, ``norm``, ``head``; None where
absent), so the tensor-parallel transform shards a chunk exactly as it shards a whole
:class:`~paratrain.model.Decoder`, and it runs the same composition
``head(norm(blocks(embed(idx))))`` restricted to its slice.

Balance (Narayanan et al. 2021 balance layers; the ends are not free): each block costs
its training FLOPs per token, ``6 * layer_params + 12 * d_model * T`` (PaLM, appendix B);
the head costs ``6 * V * d_model`` and is added to the last stage; the embedding lookup
costs no FLOPs (its parameters are memory, not compute). The contiguous split that
minimises the most expensive stage is found by dynamic programming; every stage gets at
least one block (``ParallelPlan.check`` refuses more stages than layers).
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain.config import ModelConfig


def stage_costs(cfg: ModelConfig) -> tuple[float, float, float]:
    """(per block, embedding, head) training FLOPs per token."""
    block = 6.0 * cfg.layer_params() + 12.0 * cfg.d_model * cfg.context
    return block, 0.0, 6.0 * cfg.vocab_size * cfg.d_model


def split_layers(cfg: ModelConfig, stages: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) block ranges for ``stages`` virtual stages, min-max cost."""
    n = cfg.n_layers
    if not 1 <= stages <= n:
        raise ValueError(f"{stages} pipeline stages for {n} layers: each stage needs a "
                         "block; use pp*virtual_stages <= n_layers")
    block, emb, head = stage_costs(cfg)

    def cost(s: int, a: int, b: int) -> float:
        return (b - a) * block + (emb if s == 0 else 0.0) + (head if s == stages - 1 else 0.0)

    inf = float("inf")
    # best[s][j]: min over splits of blocks [0, j) into stages 0..s-1 of the max stage cost
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n + 1):
            for i in range(s - 1, j):
                c = max(best[s - 1][i], cost(s - 1, i, j))
                if c < best[s][j] - 1e-9:
                    best[s][j], cut[s][j] = c, i
    out, j = [], n
    for s in range(stages, 0, -1):
        i = cut[s][j]
        out.append((i, j))
        j = i
    return out[::-1]


class StageChunk(nn.Module):
    """One virtual stage: maybe the embedding, blocks [start, end), maybe norm + head."""

    def __init__(self, model: nn.Module, start: int, end: int, first: bool, last: bool) -> None:
        super().__init__()
        self.tok_emb = model.tok_emb if first else None
        self.blocks = nn.ModuleList(model.blocks[start:end])
        self.norm = model.norm if last else None
        self.head = model.head if last else None
        self.layer_range = (start, end)
        self.first, self.last = first, last
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, inp: torch.Tensor, T: int) -> torch.Tensor:
        """Token ids (B, T) or hidden (B, T', D) -> hidden, or local logits if last.

        ``T`` is the full sequence length (with sequence parallelism the hidden states
        carry T' = T / tp positions, but attention gathers all T)."""
        h = self.tok_emb(inp) if self.first else inp
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        for blk in self.blocks:
            h = blk(h, cos, sin)
        return self.head(self.norm(h)) if self.last else h


def build_chunks(model: nn.Module, pp: int, virtual_stages: int, rank: int) -> list[StageChunk]:
    """The chunks pipeline ``rank`` holds: virtual stages rank, rank + pp, ..."""
    cfg = model.cfg
    S = pp * virtual_stages
    ranges = split_layers(cfg, S)
    chunks = []
    for c in range(virtual_stages):
        k = c * pp + rank
        a, b = ranges[k]
        chunks.append(StageChunk(model, a, b, k == 0, k == S - 1))
    return chunks
