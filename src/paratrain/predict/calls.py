"""The calls each rank makes per step, as (op, bytes, count) lists priced by
:mod:`paratrain.predict.step`: the TP collectives of its blocks, the pipeline's sends,
the data-parallel reducers, and the CPU they cost (:func:`comm_cpu`). One home for the
counts, so the critical path, the CPU work and the blocking syncs of
:mod:`paratrain.predict.sched` count the same calls."""

from __future__ import annotations

from paratrain.config import ModelConfig, TrainConfig
from paratrain.cost import collectives as coll
from paratrain.cost import layout as L
from paratrain.cost.layout import RankLayout
from paratrain.cost.ranks import experts_apart, virtual_stages
from paratrain.cost.schedule import COMMS, build_schedule
from paratrain.cost.tp_bytes import tp_forward_backward
from paratrain.plan import ParallelPlan
from paratrain.predict.axes import moe_blocks
from paratrain.predict.machine import MachineModel

SCALAR_BYTES = 8  # the step's scalar all-reduces over the world: the loss and the
SCALAR_ALL_REDUCES = 2  # gradient norm, one each


def tp_block_calls(mcfg: ModelConfig, plan: ParallelPlan, lay: RankLayout, act: float
                  ) -> tuple[float, int]:
    """(bytes, all-reduce-sized calls) of the blocks' TP collectives per micro-batch:
    :func:`paratrain.cost.tp_bytes.tp_forward_backward` per dense block (the same
    steps and bytes under SP's all-gather + reduce-scatter); an MoE block has one
    forward and one backward fewer (its MLP is whole on every tp rank: no entry, no exit)."""
    n_fwd, n_bwd = tp_forward_backward(plan.recompute)
    moe = moe_blocks(mcfg, lay)
    return act, (n_fwd + n_bwd) * lay.blocks - 2 * moe


def tp_calls(mcfg: ModelConfig, plan: ParallelPlan, lay: RankLayout, act: float,
             seqs_mb: float) -> list[tuple[str, float, int]]:
    """TP collectives per step: the blocks' (:func:`tp_block_calls`), 1 at the
    embedding, 1 + 3 small at the head, per micro-batch."""
    if plan.tp == 1:
        return []
    m = plan.micro_batches
    n, k = tp_block_calls(mcfg, plan, lay, act)
    out = [("all_reduce", n, m * k),
           ("all_reduce", act, m * (int(lay.first) + int(lay.last)))]
    if lay.last:
        out.append(("all_reduce", seqs_mb * mcfg.context / plan.cp * 4, 3 * m))
    return out


def pp_messages(plan: ParallelPlan, pp_rank: int) -> tuple[int, int]:
    """(sends, receives) of a rank of pipeline stage ``pp_rank`` per step, read off its
    action lists (:func:`paratrain.cost.schedule.build_schedule`, the lists the runtime
    executes): an interleaved rank's middle chunks send and receive both ways, a V's rank
    0 holds both ends of the model and still talks to rank 1 for each, and rank p-1's
    middle hand-off is no message, so counting stage boundaries would be wrong
    (docs/pipeline-schedules.md)."""
    if plan.pp == 1:
        return 0, 0
    acts = build_schedule(plan.schedule, plan.pp, plan.micro_batches,
                          virtual_stages(plan)).actions[pp_rank]
    sends = sum(a.kind.startswith("SEND") for a in acts)
    return sends, sum(a.kind in COMMS for a in acts) - sends


def pp_hop(plan: ParallelPlan, act: float) -> float:
    """Bytes of one pipeline message: a micro-batch's activations (``act``; its tp shard
    under SP)."""
    return act / (plan.tp if plan.sp else 1)


def pp_calls(plan: ParallelPlan, lay: RankLayout, act: float) -> list[tuple[str, float, int]]:
    """Point-to-point operations per step (:func:`pp_messages`), each one hop."""
    if plan.pp == 1:
        return []
    return [("p2p", pp_hop(plan, act), sum(pp_messages(plan, lay.pp)))]


def dp_groups(mcfg: ModelConfig, plan: ParallelPlan, tcfg: TrainConfig, rank: int
             ) -> list[tuple[int, list[tuple[str, float, int]]]]:
    """(group size, calls) of each gradient reducer of ``rank``: one over dp x cp
    (:func:`paratrain.cost.layout.reducer_plan`), or with ep or etp > 1 the dense one and the
    experts' (:func:`paratrain.cost.layout.reducers`)."""
    parts = L.reducers(plan, rank) if experts_apart(plan) else [(plan, rank, "all", None)]
    out = []
    for q, r, part, e in parts:
        p = L.shard_group(q)  # HSDP: ZeRO within a replica, then the replicas' all-reduce
        if L.reducer_plan(q).dp > 1:
            out.append((p, L.dp_calls(mcfg, q, tcfg.dtype, r, tcfg.reduce_dtype, part, e)))
    if plan.dp_replicate > 1:
        out.append((plan.dp_replicate, L.dp_replicate_calls(mcfg, plan, tcfg.dtype, rank,
                                                            tcfg.reduce_dtype)))
    return out


def comm_cpu(machine: MachineModel, p: int, calls: list[tuple[str, float, int]]) -> float:
    """CPU seconds a rank spends in ``calls`` on a group of ``p``: per collective call the
    measured hand-off to gloo's worker thread, ring steps x the CPU per step and the bytes
    it sends x the CPU per byte (or bytes / the transport's bandwidth); a point-to-point
    operation, posted by the rank's own thread, one step and its bytes. Every blocking
    call -- a collective, or the receive of a send / receive pair -- also pays what a
    call after a segment of compute costs beyond the same call in a tight loop
    (``sync_cpu_s``, :func:`paratrain.bench.calibrate.sync_costs`: the caches the compute
    left, the wake-up)."""
    per_byte = machine.coll_byte_cpu_s or 1.0 / machine.hw.intra_bw
    total = 0.0
    for op, n, k in calls:
        if op == "p2p":
            call, steps, wire = machine.sync_cpu_s / 2, 1, n
        else:
            call, alg = (machine.coll_call_cpu_s + machine.sync_cpu_s,
                         "naive" if op == "all_to_all" else "ring")
            steps, wire = coll.steps(op, alg, p), coll.wire_bytes(op, alg, p, n)
        total += k * (call + steps * machine.coll_step_cpu_s + wire * per_byte)
    return total
