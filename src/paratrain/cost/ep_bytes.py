"""Bytes of the MoE dispatch under the expert fold (:class:`paratrain.cost.ranks.Fold`),
as the runtime sends them (:mod:`paratrain.parallel.expert_tp`): the etp stage's
gathers and scatters around the experts. The ep all-to-all's own count, which takes the
rows sent and received, is :func:`paratrain.predict.axes.ep_wire_bytes`; the rows a rank
routes, :func:`paratrain.predict.axes.routed_tokens`."""

from __future__ import annotations

from paratrain.config import ModelConfig
from paratrain.cost.collectives import ring_share
from paratrain.plan import ParallelPlan

COUNT_BYTES = 8  # the per-expert row counts exchanged first are int64


def etp_wire_bytes(mcfg: ModelConfig, plan: ParallelPlan, elem: int, mine: float,
                   others: float, layer_passes: int) -> float:
    """Bytes one rank sends in a step's etp stages: ``mine`` rows reached its local
    experts after the ep exchange (summed over the step's ``layer_passes`` = MoE layers
    x micro-batches), ``others`` those of the other etp ranks. With SP each forward
    all-gathers the per-expert counts ((etp - 1) x E/ep int64) and the rows ((etp - 1)
    x mine), and reduce-scatters the partial outputs (the others' rows); the backward
    sends the reverse of each. Without SP (etp = tp, the same rows on every etp rank)
    each forward all-reduces the partial outputs and the backward the input gradients
    (ring: 2 (p - 1)/p of mine). Full recompute reruns the forward."""
    t = plan.etp
    if t == 1:
        return 0.0
    runs = 2 if plan.recompute == "full" else 1
    row = mcfg.d_model * elem
    if not plan.sp:
        return (runs + 1) * 2 * ring_share(t) * mine * row
    counts = (t - 1) * (mcfg.experts // plan.ep) * COUNT_BYTES
    return (runs + 1) * ((t - 1) * mine + others) * row + layer_passes * runs * counts
