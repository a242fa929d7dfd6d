"""Cutting the decoder into pipeline stages, balanced by compute (torch-free).

The runtime (:mod:`paratrain.parallel.pipeline.stage`) cuts the model with
:func:`split_layers`, and the systems model (:func:`paratrain.cost.groups.stage_layers`)
prices the busiest pipeline rank from the same split, so the two never disagree.

Costs (Narayanan et al. 2021 balance layers; the ends are not free): each block costs its
training FLOPs per token, ``6 * layer_params + 12 H Q T`` (PaLM, appendix B;
:meth:`paratrain.cost.shapes.ModelShape.block_flops_per_token`, a dense block's); the
head costs ``6 * V * d_model`` and is added to the last stage; the embedding lookup costs
no FLOPs (its parameters are memory, not compute). The contiguous split that minimises
the most expensive stage is wanted; every stage gets at least one block.

Exactness and speed. :func:`split_blocks_dp` is the O(S L^2) dynamic programme the runtime
used: ``best[s][j]`` = min over splits of blocks [0, j) into stages 0..s-1 of the most
expensive stage, keeping the smallest cut on ties. The planner's search prices hundreds of
thousands of layouts, so :func:`split_blocks` computes the same split in O(L + S):

- with uniform block cost b and a free embedding, a prefix of j blocks over s stages that
  excludes the last stage costs ``ceil(j / s) * b`` (the most loaded stage can hold no
  fewer), and the smallest cut reaching it leaves ``ceil(j / s)`` blocks to stage s-1,
  since any smaller cut gives that stage more (so larger stages sit later in the prefix);
- the last stage's cut is the smallest i minimising ``max(ceil(i / (S-1)) b, (L-i) b + h)``,
  found by scanning i, with the same arithmetic and the same strict-improvement test as
  the programme.

Both steps choose exactly what the programme chooses, so the two agree on every input
(``tests/test_systems_stages.py`` checks them against each other over every L <= 24,
S <= L and a range of head costs, ties included).
"""

from __future__ import annotations

from functools import lru_cache

from paratrain.config import ModelConfig
from paratrain.cost.shapes import as_shape


def stage_costs(cfg: ModelConfig, seq_len: int | None = None) -> tuple[float, float, float]:
    """(per block, embedding, head) training FLOPs per token at ``seq_len`` (default: the
    model's context, which is what the runtime trains at). Every block is weighed as a
    dense one (:meth:`paratrain.cost.shapes.ModelShape.block_flops_per_token`), MoE
    blocks too: the split assumes uniform blocks. The head carries the multi-token-
    prediction depths, which sit beside it on the last stage
    (:meth:`~paratrain.cost.shapes.ModelShape.mtp_flops_per_token`)."""
    m = as_shape(cfg)
    return (m.block_flops_per_token(None, seq_len), 0.0,
            m.head_flops_per_token() + m.mtp_flops_per_token(seq_len))


def _check(n: int, stages: int) -> None:
    if not 1 <= stages <= n:
        raise ValueError(f"{stages} pipeline stages for {n} layers: each stage needs a "
                         "block; use pp*virtual_stages <= n_layers")


def split_blocks_dp(n: int, stages: int, block: float, emb: float, head: float
                    ) -> list[tuple[int, int]]:
    """Reference: the min-max contiguous split by dynamic programming, O(stages n^2)."""
    _check(n, stages)

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


@lru_cache(maxsize=4096)
def split_blocks(n: int, stages: int, block: float, head: float) -> tuple[tuple[int, int], ...]:
    """Contiguous [start, end) block ranges of ``stages`` stages, min-max cost, with a free
    embedding: the same split as :func:`split_blocks_dp` in O(n + stages) (module
    docstring)."""
    _check(n, stages)
    if stages == 1:
        return ((0, n),)
    prefix = stages - 1
    best, cut = float("inf"), prefix
    for i in range(prefix, n):
        c = max(-(-i // prefix) * block, (n - i) * block + 0.0 + head)
        if c < best - 1e-9:
            best, cut = c, i
    out, j = [(cut, n)], cut
    for s in range(prefix, 0, -1):
        k = -(-j // s)  # ceil(j / s) blocks for stage s-1
        out.append((j - k, j))
        j -= k
    return tuple(out[::-1])


def split_layers(cfg: ModelConfig, stages: int, seq_len: int | None = None
                 ) -> list[tuple[int, int]]:
    """Contiguous [start, end) block ranges for ``stages`` virtual stages, min-max cost."""
    block, emb, head = stage_costs(cfg, seq_len)
    assert emb == 0.0  # split_blocks assumes a free embedding (see stage_costs)
    return list(split_blocks(cfg.n_layers, stages, block, head))


@lru_cache(maxsize=4096)
def rank_blocks(n: int, pp: int, virtual_stages: int, block: float, head: float,
                v_shape: bool = False) -> tuple[int, ...]:
    """Blocks each pipeline rank holds (virtual stages r, r + pp, ...; ``v_shape``: r and
    2 pp - 1 - r, :func:`paratrain.cost.schedule.stage_of`) under :func:`split_blocks`;
    cached, as the planner asks for the same few splits again and again."""
    ranges = split_blocks(n, pp * virtual_stages, block, head)
    if v_shape:
        return tuple(sum(b - a for a, b in (ranges[r], ranges[2 * pp - 1 - r]))
                     for r in range(pp))
    return tuple(sum(b - a for a, b in ranges[r::pp]) for r in range(pp))


def blocks_per_rank(cfg: ModelConfig, pp: int, virtual_stages: int = 1,
                    seq_len: int | None = None) -> list[int]:
    """Blocks each pipeline rank holds: virtual stages r, r + pp, ... of the split."""
    block, _, head = stage_costs(cfg, seq_len)
    return list(rank_blocks(cfg.n_layers, pp, virtual_stages, block, head))
