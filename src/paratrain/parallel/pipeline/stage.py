"""Cutting the plain decoder into pipeline chunks, balanced by compute.

A chunk holds a contiguous run of blocks, plus the token embedding if it is the first
virtual stage and the final norm and output head if it is the last. It keeps the
decoder's attribute names (``tok_emb``, ``blocks``, ``norm``, ``head``; None where
absent), so the tensor-parallel transform shards a chunk exactly as it shards a whole
:class:`~paratrain.model.Decoder`, and it runs the same composition
``head(norm(blocks(embed(idx))))`` restricted to its slice.

Where the cuts go is decided by :func:`paratrain.cost.stages.split_layers` (torch-free,
re-exported here): blocks cost their training FLOPs, the head is added to the last stage,
and the contiguous split minimising the most expensive stage is chosen, every stage
keeping at least one block (``ParallelPlan.check`` refuses more stages than layers). The
systems model prices the busiest pipeline rank of that same split.
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain.cost.schedule import stage_of
from paratrain.cost.stages import split_layers, stage_costs

__all__ = ["StageChunk", "build_chunks", "split_layers", "stage_costs"]


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


def build_chunks(model: nn.Module, pp: int, virtual_stages: int, rank: int,
                 schedule: str = "1f1b") -> list[StageChunk]:
    """The chunks pipeline ``rank`` holds: virtual stages rank, rank + pp, ... (or, for a
    V-shaped ``schedule``, rank and 2 pp - 1 - rank: :func:`paratrain.cost.schedule.stage_of`)."""
    cfg = model.cfg
    S = pp * virtual_stages
    ranges = split_layers(cfg, S)
    chunks = []
    for c in range(virtual_stages):
        k = stage_of(schedule, pp, rank, c)
        a, b = ranges[k]
        chunks.append(StageChunk(model, a, b, k == 0, k == S - 1))
    return chunks
