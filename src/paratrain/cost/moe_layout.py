"""Where an MoE layer's tokens and experts sit on a stage's ranks, as the plan states it.

The plan (:class:`paratrain.plan.ParallelPlan`) carries the expert layout: ``ep`` groups
of experts and ``etp``, each expert split over etp ranks, folded over the stage's
dp x cp x tp ranks as edp x ep x etp (Megatron-Core's "MoE parallel folding", Liu et al.
2025). Nothing about the layout lives in the model's shape, so a catalogue model and a
run's own model are priced the same way under the same plan.

The rank order is :class:`paratrain.cost.ranks.Fold`'s, the runtime's own (one home):
etp innermost, then ep, then edp, over dp x cp (x tp with SP, with etp = tp, or when ep x
etp needs the tp ranks). Without SP and with etp 1 each tp rank is a copy of a fold over
dp x cp holding whole experts (paratrain's runtime under tp).

Tokens: the MoE MLP reads the residual stream, sequence-sharded under SP, so a rank routes
T / cp of each sequence, T / (cp tp) with SP (:func:`routed_tokens`). An expert split over
etp ranks needs the tokens all of them hold: with SP the etp group gathers its members'
tokens (etp x), without SP they hold the same ones (:func:`expert_group_tokens`).
"""

from __future__ import annotations

from paratrain.cost.ranks import Fold
from paratrain.plan import ParallelPlan


def routed_tokens(tokens: float, tp: int, sp: bool) -> float:
    """Of a rank's ``tokens`` (T / cp of each sequence), those its MoE MLP routes: with
    SP 1 / tp of them (each tp rank routes its own shard), else all of them (the tp ranks
    hold identical tokens)."""
    return tokens / tp if sp else tokens


def expert_group_tokens(tokens: float, tp: int, sp: bool, etp: int) -> float:
    """Tokens the etp ranks sharing an expert shard see together: etp x a rank's routed
    tokens with SP (the etp group gathers them), the rank's own without (identical)."""
    t = routed_tokens(tokens, tp, sp)
    return t * etp if sp else t


def ep_stride(plan: ParallelPlan) -> int:
    """Global ranks between neighbours of an ep group (rank order tp, cp, dp, pp), read
    off :class:`~paratrain.cost.ranks.Fold`: etp inside a fold that spans tp, etp x tp in
    one that does not (each tp rank a copy of it)."""
    return plan.etp if Fold.of(plan).fold_tp == plan.tp else plan.etp * plan.tp


def edp_stride(plan: ParallelPlan) -> int:
    """Global ranks between neighbours of an edp group (the ranks that reduce one expert
    shard's gradients): edp is outermost in the fold, so ep x :func:`ep_stride` apart;
    Megatron-Core's expert data-parallel group the same (its expert rank order
    tp-ep-dp). Eight experts groups of a 64-GPU data group put each edp group's eight
    ranks on eight nodes, not in one."""
    return ep_stride(plan) * plan.ep


def expert_data_ranks(plan: ParallelPlan) -> int:
    """edp: the ranks holding the same expert shard, whose gradients reduce together and
    over which ZeRO shards the expert states (:attr:`paratrain.cost.ranks.Fold.edp`)."""
    return max(1, Fold.of(plan).edp)


def default_etp(dp: int, cp: int, tp: int, ep: int) -> int:
    """The expert TP a run that does not state it ran: tp, Megatron-Core's default (each
    expert split as the dense MLP is), unless ep x tp does not fit in dp x cp x tp; then
    the largest divisor of tp that does (the only layouts Megatron-Core accepts; etp 1
    when ep folds over all of tp)."""
    folded = dp * cp * tp
    return max(e for e in range(1, tp + 1) if tp % e == 0 and folded % (ep * e) == 0)
