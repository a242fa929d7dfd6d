"""The run prediction's pipeline critical path (torch-free): m x the slowest stage's
micro-batch plus the other stages' fill, which is the schedule's own bubble
(:func:`paratrain.cost.schedule.bubble_over_compute`, the closed form the simulated
schedule equals), so ZB-H1, interleaving and GPipe are each priced as the runtime runs them
(``tests/test_systems_bubble.py``: equal to
:func:`paratrain.cost.pipeline_sim.simulate_pipeline` for every schedule and (p, m, v) up
to 16)."""

from __future__ import annotations

from paratrain.cost.ranks import virtual_stages
from paratrain.cost.schedule import bubble_over_compute
from paratrain.plan import ParallelPlan


def slowest_stage(per_stage: list[float]) -> int:
    """The pipeline rank whose micro-batches take longest (the first of equals)."""
    return max(range(len(per_stage)), key=lambda i: per_stage[i])


def _fill_per_stage(plan: ParallelPlan) -> float:
    """Fill and drain along the critical path per second of one other stage's micro-batch:
    the schedule's closed form (:func:`paratrain.cost.schedule.bubble_over_compute`, which
    equals the simulated schedule) x m, spread over the p - 1 other stages. 1/v for GPipe,
    1F1B and interleaved; ZB-H1's deferred weight gradients fill most of it."""
    if plan.pp == 1:
        return 0.0
    m = plan.micro_batches
    over = bubble_over_compute(plan.schedule, plan.pp, m, virtual_stages(plan))
    return over * m / (plan.pp - 1)


def pipeline_path(xs: list[float], slow: int, plan: ParallelPlan,
                  stretch: tuple[float, float] = (1.0, 1.0)) -> float:
    """Seconds of ``xs`` (per stage, one micro-batch) along the critical path: m x the
    slowest stage's plus the others' share of the schedule's fill (:func:`_fill_per_stage`),
    each times its ``stretch`` (steady state, fill) where the cores are shared
    (:func:`paratrain.predict.sched.stretch`)."""
    others = sum(x for i, x in enumerate(xs) if i != slow)
    return (plan.micro_batches * xs[slow] * stretch[0]
            + _fill_per_stage(plan) * others * stretch[1])


def pipeline_bubble(per_stage: list[float], plan: ParallelPlan) -> float:
    """The step's pipeline bubble (seconds) for ``per_stage`` seconds of one micro-batch's
    forward + backward on each pipeline rank; with equal stages, the simulated schedule's
    idle time per rank (``tests/test_systems_bubble.py``)."""
    slow = slowest_stage(per_stage)
    return _fill_per_stage(plan) * sum(x for i, x in enumerate(per_stage) if i != slow)
