"""The oversubscribed CPU: what sharing the cores does to a step (:func:`paratrain.predict.
predict` uses it for `paratrain train`'s prediction line and for `paratrain check-model`).

Why: on free cores a rank computes on a core of its own and a collective costs its
latency and bytes. With more runnable threads than cores (ranks beyond the cores, or
other sessions taking them, :func:`paratrain.predict.machine.waterfill`) three things
change, and none of them is a per-plan factor:

- **Compute time-shares the cores.** The session's ranks get ``share`` of a core each,
  so a rank's compute stretches by ``o = 1 / share`` -- but only while the others also
  compute: in a pipeline's fill and drain only some stages run, and there the stretch is
  ``o / pp`` (at least 1): :func:`stretch`. And a core computes slower while the others
  compute too (shared caches and memory bandwidth; a VM's cores may share physical ones):
  ``core_speed``, measured once (one core's speed with every core computing, over its
  speed alone), :func:`contention`; it also inflates the CPU work.
- **gloo's progress threads need CPU too**: every collective step and byte costs CPU
  (measured by `paratrain check-model`, :func:`paratrain.predict.calls.comm_cpu`), which
  the session's CPU work over its cores counts.
- **A blocking sync waits for peers the scheduler has not run.** A rank that reaches a
  collective or a receive before its peer sleeps; the sync ends only when the scheduler
  has run the late peer to the call and then the sleeper again. On free cores that is a
  wake-up (``wake_s``, beyond the call's own latency); with the cores taken it is the
  wait for the slowest peer plus a scheduling quantum (``busy_sync_s``, the wall the
  sync adds beyond the ranks' CPU work over the cores). A call after compute also costs more CPU
  than the same call in a tight loop (``sync_cpu_s``: the caches the compute left, the
  wake-up), which :func:`paratrain.predict.calls.comm_cpu` charges per blocking call.
  All three, and ``core_speed``, are measured once by `paratrain bench calibrate`
  (:func:`paratrain.bench.calibrate.sync_costs`: pairs of ranks that compute about 5 ms
  of a step's work, then all-reduce its output, on ``cores`` and on 2 x ``cores`` ranks;
  the same compute alone in one process) and the two wall costs multiply the
  blocking syncs along the critical path, counted from the same calls the bytes are
  (:func:`stage_syncs`, :func:`path_syncs`) in units of the calibrated one: every
  sequential round of a collective is a blocking receive (:func:`sync_units`), so an
  all-reduce over 8 ranks waits 7 times as often as one over 2.

The step is then the larger of two bounds (:func:`bounds`): the critical path with its
compute stretched (and on free cores a wake-up per sync), and the session's CPU work over
its cores plus, per sync when the cores are oversubscribed, the time the calibration's
cores sat idle at each sync (a sync is a moment no rank of the group computes, so the
work bound cannot hide it).
"""

from __future__ import annotations

from paratrain.config import ModelConfig
from paratrain.cost import collectives as coll
from paratrain.cost.cp_bytes import A2A_BURSTS, ring_hops
from paratrain.cost.layout import RankLayout
from paratrain.cost.ranks import virtual_stages
from paratrain.plan import ParallelPlan
from paratrain.predict.axes import ep_bursts, moe_blocks
from paratrain.predict.calls import SCALAR_ALL_REDUCES
from paratrain.predict.machine import MachineModel

CALIBRATED_STEPS = 2  # the calibration's sync is a 2-rank all-reduce: 2 blocking receives


def sync_units(op: str, p: int, k: float = 1.0) -> float:
    """``k`` blocking calls of ``op`` on ``p`` ranks in units of the calibrated sync:
    every sequential round is a blocking receive (ring all-reduce 2(p - 1), gather and
    scatter p - 1: :func:`paratrain.cost.collectives.steps`; a point-to-point receive 1),
    over the 2 of the 2-rank all-reduce the calibration times. An all-to-all posts all
    its rounds before it waits, so its rounds are not sequential: a call is one whole
    calibrated sync (after the calibration's 5 ms segment, a 2-rank all-to-all paid the
    same 1.48 ms beyond its own time as the 2-rank all-reduce; counted by its p - 1
    rounds, the all-to-all CP and EP plans were priced half of it). All-to-alls issued
    back to back (only reshapes between) are one sync: the first finds the peers in
    step and awake for the next, so ``k`` counts the groups (:data:`paratrain.cost.
    cp_bytes.A2A_BURSTS`, :func:`paratrain.predict.axes.ep_bursts`). After the same
    segment, four 128 KiB all-to-alls in a row paid 2.1 ms beyond their own time in two
    runs, one alone 1.4 and 2.3 ms; four all-reduces in a row paid 2.4 and 6.0 ms, one
    0.8 and 2.4 ms, so an all-reduce is still counted call by call."""
    if op == "p2p":
        rounds = 1
    elif op == "all_to_all":
        rounds = CALIBRATED_STEPS
    else:
        rounds = coll.steps(op, "ring", p)
    return k * rounds / CALIBRATED_STEPS


def oversubscription(share: float) -> float:
    """Runnable ranks per core the session gets: 1 / share, at least 1."""
    return 1.0 / share if 0 < share < 1 else 1.0


def contention(machine: MachineModel, busy: float) -> float:
    """How much slower a core computes while ``busy`` threads (ours and the other
    sessions') compute at once than alone: 1 / ``core_speed`` once every core computes
    (the cores share caches, memory bandwidth and, on a VM, physical cores), linear in
    the busy cores from 1 (one core busy) to there."""
    c = machine.cores
    if c <= 1 or machine.core_speed >= 1:
        return 1.0
    frac = min(1.0, max(0.0, (min(busy, c) - 1) / (c - 1)))
    return 1.0 / (1.0 - (1.0 - machine.core_speed) * frac)


def stretch(o: float, plan: ParallelPlan, machine: MachineModel | None = None,
            world: int = 1) -> tuple[float, float]:
    """(steady, fill) factors on a rank's compute: every stage computes in the steady
    state (o), one stage's ranks of pp on average in the fill and drain (o / pp); each
    times the cores' :func:`contention` with that many of the ``world`` ranks busy."""
    steady, fill = o, max(1.0, o / plan.pp)
    if machine is not None:
        others = machine.other_threads
        steady *= contention(machine, world + others)
        fill *= contention(machine, world / plan.pp + others)
    return steady, fill


def stage_syncs(mcfg: ModelConfig, plan: ParallelPlan, lay: RankLayout,
                tp_calls: list[tuple[str, float, int]]) -> float:
    """Blocking syncs (:func:`sync_units`) of one micro-batch's forward + backward on a
    rank of ``lay``'s stage: its TP collectives (``tp_calls``, per step,
    :func:`paratrain.predict.calls.tp_calls`), the CP exchange per block (ring: its receives,
    :func:`paratrain.cost.cp_bytes.ring_hops`; all-to-all:
    its 8 calls in 4 back-to-back groups) and per MoE block the 4 all-to-alls and the
    split sizes' exchange in 4 groups (6 with full recompute, :func:`paratrain.
    predict.axes.ep_bursts`)."""
    n = sum(sync_units(op, plan.tp, k) for op, _, k in tp_calls) / plan.micro_batches
    if plan.cp > 1:
        n += lay.blocks * (sync_units("p2p", 2, ring_hops(plan))
                           if plan.cp_algorithm == "ring" else
                           sync_units("all_to_all", plan.cp, 2 * A2A_BURSTS))
    if plan.ep > 1:
        n += moe_blocks(mcfg, lay) * sync_units("all_to_all", plan.ep, ep_bursts(plan))
    return float(n)


def path_syncs(plan: ParallelPlan, dp_groups: list[tuple[int, list[tuple[str, float, int]]]],
               dp_hidden: bool, world: int) -> float:
    """Blocking syncs (:func:`sync_units`) of a step outside the stages' micro-batches:
    the pipeline's receives along the critical path (2 (m + pp - 1) v), the
    data-parallel reducers' calls (``dp_groups``: :func:`paratrain.predict.calls.
    dp_groups`; only the last call when the others hide under backward) and the loss and
    gradient-norm all-reduces over the ``world``."""
    pp = 2 * (plan.micro_batches + plan.pp - 1) * virtual_stages(plan) if plan.pp > 1 else 0
    calls = [(p, op, k) for p, cs in dp_groups for op, _, k in cs]
    if dp_hidden and calls:
        calls = [(*calls[-1][:2], 1)]
    dp = sum(sync_units(op, p, k) for p, op, k in calls)
    return sync_units("p2p", 2, pp) + dp + sync_units("all_reduce", world, SCALAR_ALL_REDUCES)


def bounds(crit: float, work_over_cores: float, syncs: float, o: float,
           machine: MachineModel) -> tuple[float, float, float]:
    """(critical path, CPU work bound, seconds the syncs add to the larger): the step is
    the larger bound. On free cores (``o`` <= 1) each sync adds a wake-up to the
    critical path; on oversubscribed cores it adds ``busy_sync_s`` to the work bound
    instead: the time the calibration's cores sat idle at each sync, its wall beyond its
    ranks' own CPU over the cores (:func:`paratrain.bench.calibrate.sync_costs`, so
    nothing of the model's collective prices is taken off it), and nothing to the
    path: while a
    rank sleeps at a sync another runs on its core, and its wait for a core when it
    wakes is the time-sharing its compute is already stretched by (``o``). Charged the
    free-core wake-up too, the 4-8-rank pipelines with TP (68 and 51 syncs a step) came
    out 17-40% over in two grids of the 2-core box."""
    wake = syncs * machine.wake_s if o <= 1 else 0.0
    busy = syncs * machine.busy_sync_s if o > 1 else 0.0
    path, work = crit + wake, work_over_cores + busy
    return path, work, wake if path >= work else busy
