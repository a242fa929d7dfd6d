"""Where an MoE layer's tokens and experts sit on a stage's ranks, as the plan states it.

The plan (:class:`paratrain.plan.ParallelPlan`) carries the expert layout: ``ep`` groups
of experts and ``etp``, each expert split over etp ranks, folded over the stage's
dp x cp x tp ranks as edp x ep x etp (Megatron-Core's "MoE parallel folding", Liu et al.
2025). Nothing about the layout lives in the model's shape, so a catalogue model and a
run's own model are priced the same way under the same plan.

Two layouts follow from the plan:

- **runtime**: ``etp = 1`` and ``ep`` dividing dp, paratrain's runtime
  (:mod:`paratrain.parallel.expert`): ep consecutive data ranks (``tp x cp`` apart) form
  an ep group; each tp rank keeps whole experts and runs its own tp index's ep group,
  so the edp = dp cp / ep ranks holding the same experts reduce their gradients together.
- **folded** (everything else): etp innermost, then ep (``etp`` apart), then edp =
  dp cp tp / (ep etp), Megatron-Core's rank order for the expert layers.

Tokens: the MoE MLP reads the residual stream, sequence-sharded under SP, so a rank routes
T / cp of each sequence, T / (cp tp) with SP (:func:`routed_tokens`). An expert split over
etp ranks needs the tokens all of them hold: with SP the etp group gathers its members'
tokens (etp x), without SP they hold the same ones (:func:`expert_group_tokens`).
"""

from __future__ import annotations

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


def runtime_layout(plan: ParallelPlan) -> bool:
    """Whether the experts sit as paratrain's runtime places them: whole (etp 1) and
    expert-parallel over data ranks only (ep divides dp)."""
    return plan.etp == 1 and plan.dp % plan.ep == 0


def ep_stride(plan: ParallelPlan) -> int:
    """Ranks between neighbours of an ep group (rank order tp, cp, dp, pp): tp x cp in the
    runtime layout (consecutive data ranks), etp when folded (etp innermost, then ep)."""
    return plan.tp * plan.cp if runtime_layout(plan) else plan.etp


def expert_data_ranks(plan: ParallelPlan) -> int:
    """edp: the ranks holding the same expert shard, whose gradients reduce together and
    over which ZeRO shards the expert states: dp cp / ep in the runtime layout (a tp
    rank's copy is its own), dp cp tp / (ep etp) folded."""
    if runtime_layout(plan):
        return plan.dp * plan.cp // plan.ep
    return max(1, plan.dp * plan.cp * plan.tp // (plan.ep * plan.etp))


def default_etp(dp: int, cp: int, tp: int, ep: int) -> int:
    """The expert TP a run that does not state it ran: tp, Megatron-Core's default (each
    expert split as the dense MLP is), unless ep x tp does not fit in dp x cp x tp; then
    the largest divisor of tp that does (the only layouts Megatron-Core accepts; etp 1
    when ep folds over all of tp)."""
    folded = dp * cp * tp
    return max(e for e in range(1, tp + 1) if tp % e == 0 and folded % (ep * e) == 0)
