"""A training step's MoE statistics: each rank's routing summed over the world in one
collective (:func:`moe_stats`) and the step's record of it (:func:`moe_record`), the
per-layer busiest expert rank included (:func:`layer_load`), which the prediction of an
expert-parallel run reads (:func:`paratrain.predict.report.routing_load`)."""

from __future__ import annotations

from paratrain.config import ModelConfig
from paratrain.model import take_moe_stats
from paratrain.plan import ParallelPlan


def moe_stats(engine, experts: int, plan: ParallelPlan) -> list[float]:
    """:func:`paratrain.model.take_moe_stats` of this rank, followed by a dp x E block
    in which this rank fills its own row with its load (tokens it routed, per expert)
    and, under :func:`per_layer_load`, a dp x layers x E block of the same per layer,
    summed over the world in one collective: the totals, and each data rank's routing."""
    mine = take_moe_stats(engine.model, experts, per_layer_load(plan))
    head, layers = mine[:3 + experts], mine[3 + experts:]

    def own_row(values: list[float]) -> list[float]:  # dp rows, this rank's filled
        n = len(values)
        return [0.0] * (engine.dp_rank * n) + values + [0.0] * (
            (engine.dp_size - 1 - engine.dp_rank) * n)

    return engine.all_sum(head + own_row(head[3:]) + own_row(layers))


def per_layer_load(plan: ParallelPlan) -> bool:
    """Whether a step records each MoE layer's routing per data rank: with ep > 1 where
    every rank holds every layer and routes its data rank's tokens (pp = 1, cp = 1, no
    SP), as :func:`paratrain.predict.report.routing_load` reads it."""
    return plan.ep > 1 and plan.pp == 1 and plan.cp == 1 and not plan.sp


def layer_load(by_layer: list[list[list[int]]], ep: int) -> float:
    """The busiest ep rank's expert rows over the mean, per MoE layer, averaged over the
    layers (``by_layer[d][l][e]``: data rank d's assignments to expert e in layer l; an
    ep group is ep consecutive data ranks, its rank j holding experts [j E/ep, (j+1)
    E/ep)). Each layer's combine waits for that layer's busiest rank, so a step waits
    for this, not for the busiest rank of the step's sum (on the grid's dp2 x ep2 run:
    1.15-1.67 against 1.02-1.31 over its six steps)."""
    dp, L, E = len(by_layer), len(by_layer[0]), len(by_layer[0][0])
    El, out = E // ep, 0.0
    for layer in range(L):
        rows = [sum(by_layer[d][layer][e] for d in range(g, g + ep)
                    for e in range(j * El, (j + 1) * El))
                for g in range(0, dp - ep + 1, ep) for j in range(ep)]
        mean = sum(rows) / len(rows)
        out += max(rows) / mean if mean > 0 else 1.0
    return out / L


def moe_record(stats: list[float], mcfg: ModelConfig, sequences: int,
               plan: ParallelPlan | None = None) -> dict:
    """Metrics of a step's MoE layers from :func:`paratrain.model.take_moe_stats` summed
    over ranks: ``aux_loss`` is the term the step's loss adds (coef x the mean over
    sequences of the per-layer balance losses, summed over layers; each is 1.0 when
    perfectly balanced), ``z_loss`` the router z-loss term it adds (z_coef x the mean
    over tokens, summed over layers; with the coefficient 0 it is 0.0), ``moe_load`` the
    assignments each expert received (summed over layers), ``moe_dropped`` the
    assignments over capacity, ``moe_load_by_rank`` the load per data rank (the tokens
    each routed: the all-to-all's send counts, ``paratrain viz moe``) and, where
    :func:`per_layer_load`, ``moe_layer_load`` (:func:`layer_load`)."""
    E = mcfg.experts
    aux, z, dropped, load = stats[0], stats[1], stats[2], [int(v) for v in stats[3:3 + E]]
    rest = [int(v) for v in stats[3 + E:]]  # moe_stats: each data rank's load
    L = mcfg.moe_layers if plan is not None and per_layer_load(plan) else 0
    dp = len(rest) // (E * (1 + L))
    rest, layers = rest[:dp * E], rest[dp * E:]
    by_rank = [rest[i:i + E] for i in range(0, len(rest), E)] if rest else [load]
    out = {"aux_loss": mcfg.aux_loss_coef * aux / sequences,
           "moe_load_by_rank": by_rank,
           "z_loss": mcfg.z_loss_coef * z / (sequences * mcfg.context),
           "moe_balance": aux / sequences / max(1, mcfg.moe_layers),
           "moe_load": load, "moe_tokens_max": max(load),
           "moe_tokens_mean": sum(load) / len(load), "moe_dropped": int(dropped)}
    if L and layers:
        by_layer = [[layers[(d * L + i) * E:(d * L + i + 1) * E] for i in range(L)]
                    for d in range(dp)]
        out["moe_layer_load"] = layer_load(by_layer, plan.ep)
    return out
