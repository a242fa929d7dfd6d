"""One step of one run on this machine, priced (:func:`predict`): this machine's profile
(:mod:`paratrain.predict.machine`, calibrated by :mod:`paratrain.predict.fit`) over the
costs of :mod:`paratrain.cost`. Every byte count comes from :mod:`paratrain.cost.layout`
(CP, EP terms: :mod:`paratrain.predict.axes`), the stage split from
:func:`paratrain.cost.layout.rank_layout`, the pipeline's fill from the schedule
(:mod:`paratrain.predict.pipeline`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from paratrain.config import ModelConfig, TrainConfig
from paratrain.cost import collectives as coll
from paratrain.cost import layout as L
from paratrain.cost.cp_bytes import ring_hops
from paratrain.cost.hardware import Hardware
from paratrain.cost.layout import ELEMENT_BYTES, RankLayout
from paratrain.cost.ranks import virtual_stages
from paratrain.cost.run_figures import predicted_activations, predicted_states
from paratrain.cost.shapes import as_shape
from paratrain.plan import ParallelPlan
from paratrain.predict import sched as S
from paratrain.predict.axes import (
    cp_block_s,
    cp_calls,
    ep_block_s,
    ep_calls,
    ep_rows_uniform,
    ep_wire_bytes,
    expert_load,
    expert_wait_flops,
    moe_blocks,
    moe_extra_flops,
    one_host,
    routed_tokens,
)
from paratrain.predict.calls import SCALAR_ALL_REDUCES, SCALAR_BYTES
from paratrain.predict.calls import comm_cpu as _comm_cpu
from paratrain.predict.calls import dp_groups as _dp_groups
from paratrain.predict.calls import pp_calls as _pp_calls
from paratrain.predict.calls import pp_hop as _pp_hop
from paratrain.predict.calls import pp_messages as _pp_messages
from paratrain.predict.calls import tp_block_calls as _tp_block_calls
from paratrain.predict.calls import tp_calls as _tp_calls
from paratrain.predict.machine import RING_FIELDS, MachineModel
from paratrain.predict.pipeline import pipeline_bubble, pipeline_path, slowest_stage


@dataclass(frozen=True)
class Prediction:
    """One step of one run on this machine (seconds, bytes; per rank unless named)."""

    step_s: float  # max(critical path, session CPU work / session cores + busy syncs)
    compute_s: float  # matmul FLOPs at eta, summed along the critical path (free cores)
    overhead_s: float  # fixed per-pass and per-step costs along the critical path
    bubble_s: float  # pipeline fill/drain: part of compute + overhead above
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float  # the data-parallel sync, total
    dp_exposed_s: float  # of which not hidden under backward
    share: float  # fraction of a core per rank
    critical_path_s: float  # compute stretched by the shared cores, a wake-up per sync
    session_work_s: float  # CPU seconds all ranks spend per step (compute + copies)
    session_cores: float  # cores the run's session gets (water-filled between sessions)
    cpu_rank0_s: float  # CPU seconds rank 0 spends per step
    dp_wire_bytes: float  # rank 0, per step
    tp_wire_bytes: float  # rank 0, blocks' collectives per step
    pp_wire_bytes: float  # rank 0, point-to-point sends per step
    cp_comm_s: float = 0.0  # the CP exchange along the critical path, total
    cp_exposed_s: float = 0.0  # of which not hidden under the block attention
    expert_load: float = 1.0  # the busiest ep rank's expert rows over the mean, as priced
    ep_comm_s: float = 0.0  # MoE all-to-alls along the critical path (all exposed)
    cp_wire_bytes: float = 0.0  # rank 0, per step (paratrain.cost.layout.cp_wire_bytes)
    ep_wire_bytes: float = 0.0  # rank 0, per step, expected under uniform routing
    oversubscription: float = 1.0  # runnable ranks per core the session gets (sched.py)
    syncs: float = 0.0  # blocking syncs along the critical path per step
    sync_s: float = 0.0  # what they add to the step (wake-ups or oversubscribed waits)
    states_bytes_per_rank: list[dict] = field(default_factory=list)
    dp_wire_bytes_per_rank: list[float] = field(default_factory=list)  # per step
    systems_states_bytes: float = 0.0  # the systems model's busiest-rank formula
    activations_bytes: float = 0.0  # the systems model, as the runtime keeps them
    machine: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def comm_s(self) -> float:
        """Measured ``comm_s`` is the wait for the data-parallel sync only."""
        return self.dp_exposed_s

    @property
    def wire_bytes(self) -> float:
        return (self.dp_wire_bytes + self.tp_wire_bytes + self.pp_wire_bytes
                + self.cp_wire_bytes + self.ep_wire_bytes)

    @property
    def peak_bytes(self) -> float:
        """Rank 0's model states plus the busiest rank's activations."""
        states = self.states_bytes_per_rank[0] if self.states_bytes_per_rank else {}
        return sum(states.values()) + self.activations_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d["comm_s"] = self.comm_s
        d["wire_bytes"] = self.wire_bytes
        d["peak_bytes"] = self.peak_bytes
        return d


def _flops_block(mcfg: ModelConfig, tokens: float, tp: int, recompute: str = "none"
                 ) -> float:
    """Forward + backward FLOPs of one dense block on ``tokens`` tokens, one tensor shard:
    :meth:`paratrain.cost.shapes.ModelShape.block_flops_per_token` without the norms
    (6 x matmul params + attention scores and values 12 H Q T, PaLM appendix B) over tp;
    full recomputation adds a forward (1/3), selective the attention's forward. Each token
    attends to the whole context T, so under cp a rank's T/cp tokens cost T/cp of it."""
    m = as_shape(mcfg)
    attn = m.attention_flops_per_token(m.context) / m.n_layers / tp
    f = m.block_flops_per_token(None, m.context, norms=False) / tp
    if recompute == "full":
        f *= 4 / 3
    elif recompute == "selective":
        f += attn / 3
    return tokens * f


def _stage_mb_time(mcfg: ModelConfig, plan: ParallelPlan, lay: RankLayout, tokens_mb: float,
                   rate: float, pass_s: float, route_s: float = 0.0) -> tuple[float, float]:
    """(FLOP seconds, fixed seconds) of one micro-batch's forward + backward on a rank
    (``tokens_mb``: the rank's tokens, T/cp of each sequence); MoE blocks add their
    experts (:func:`paratrain.predict.axes.moe_extra_flops`) and ``route_s`` per routed
    assignment (top-k of each routed token: the sort, gathers and scatter-adds around
    the experts, :attr:`paratrain.predict.machine.MachineModel.route_s`)."""
    f = lay.blocks * _flops_block(mcfg, tokens_mb, plan.tp, plan.recompute)
    f += moe_blocks(mcfg, lay) * moe_extra_flops(mcfg, plan, tokens_mb)
    if lay.last:
        f += tokens_mb * as_shape(mcfg).head_flops_per_token() / plan.tp  # the head
    passes = lay.blocks + (1 if (lay.first or lay.last) else 0)
    routed = moe_blocks(mcfg, lay) * routed_tokens(plan, tokens_mb) * mcfg.top_k
    return f / rate, passes * pass_s + routed * route_s


@dataclass(frozen=True)
class _Run:
    """What every term of one prediction shares: the run, this machine and one
    micro-batch's sizes on a rank."""

    mcfg: ModelConfig
    tcfg: TrainConfig
    plan: ParallelPlan
    machine: MachineModel
    hw: Hardware  # this machine as one host of ``world`` ranks
    world: int
    rate: float  # FLOP/s of a free core at eta: the critical path is priced on free cores
    e: int  # bytes per element of the run's dtype
    seqs_mb: float  # sequences of a micro-batch on a dp rank
    tokens_mb: float  # the rank's tokens of them: T/cp each (the load-balanced split)
    batch: int  # sequences per dp rank and step
    lays: list[RankLayout]  # per pipeline stage, its rank (dp 0, cp 0, tp 0)
    load: float = 1.0  # the busiest ep rank's expert rows over the mean
    routed: bool = False  # ``load`` from the run's routing, not a balanced router's

    @property
    def m(self) -> int:
        return self.plan.micro_batches

    @property
    def act(self) -> float:
        """A micro-batch's activations on the rank (bytes)."""
        return self.tokens_mb * self.mcfg.d_model * self.e


def _run(mcfg: ModelConfig, tcfg: TrainConfig, plan: ParallelPlan, world: int,
         machine: MachineModel, load: float | None = None) -> _Run:
    if plan.world_size != world:
        raise ValueError(f"plan needs {plan.world_size} ranks but world={world}; match them")
    seqs_mb = tcfg.global_batch / plan.dp / plan.micro_batches
    tokens_mb = seqs_mb * mcfg.context / plan.cp
    lays = [L.rank_layout(mcfg, plan, L.rank_of(s, 0, 0, plan)) for s in range(plan.pp)]
    routed = load is not None and plan.ep > 1
    return _Run(mcfg, tcfg, plan, machine, one_host(machine.hw, world), world,
                machine.eta * machine.thread_peak, ELEMENT_BYTES[tcfg.dtype], seqs_mb,
                tokens_mb, int(tcfg.global_batch // plan.dp), lays,
                load if routed else expert_load(mcfg, plan, tokens_mb), routed)


def _notes(r: _Run, share: float) -> list[str]:
    """What the reader of the prediction should know about its inputs."""
    machine, notes = r.machine, []
    if share < 1:
        notes.append(f"{r.world} ranks on {machine.cores} cores beside "
                     f"{machine.other_sessions:.1f} other busy sessions "
                     f"({machine.other_threads:.1f} runnable threads): each rank gets "
                     f"{share:.2f} of a core")
    if r.plan.ep > 1:
        notes.append("EP all-to-all bytes expected under uniform routing (the measured "
                     "ones follow the router); the busiest rank's experts carry "
                     f"x{r.load:.3f} the mean load"
                     + (" (the run's routing)" if r.routed else " (a balanced router)"))
    if not machine.fitted:
        notes.append("no CPU fit: eta from the profile, fixed costs 0 (run paratrain "
                     "check-model)")
    if not machine.sched:
        notes.append("no scheduler calibration: blocking syncs cost their latency only "
                     "(run `paratrain bench calibrate`)")
    return notes


def _stage_terms(r: _Run) -> tuple[list[tuple[float, ...]], list[float]]:
    """Per pipeline stage and micro-batch: (FLOP s, fixed s, TP s, exposed CP s, EP s,
    the busiest ep rank's expert FLOP s beyond the mean: on the path, not in the CPU
    work), and the CP exchange in total."""
    mcfg, plan = r.mcfg, r.plan
    a, bw = r.hw.intra_alpha, r.hw.intra_bw
    cp_blk, cp_exp_blk = cp_block_s(mcfg, plan, r.seqs_mb, r.tokens_mb, r.rate, r.hw, r.e)
    ep_blk = ep_block_s(mcfg, plan, r.tokens_mb, r.hw, r.e)
    stages, cp_tot = [], []
    for lay in r.lays:
        f, fx = _stage_mb_time(mcfg, plan, lay, r.tokens_mb, r.rate, r.machine.pass_s,
                               r.machine.route_s)
        if _ring_fitted(r):  # the ring core's own work beyond its FLOPs, per micro-batch
            fx += _ring_cpu(r, lay, r.machine.ring_hop_s, r.machine.ring_byte_s) / r.m
        tp_t = sum(k * coll.time_s(op, "ring", plan.tp, n, a, bw)
                   for op, n, k in _tp_calls(mcfg, plan, lay, r.act, r.seqs_mb)) / r.m
        wait = moe_blocks(mcfg, lay) * expert_wait_flops(mcfg, plan, r.tokens_mb, r.load)
        stages.append((f, fx, tp_t, lay.blocks * cp_exp_blk, moe_blocks(mcfg, lay) * ep_blk,
                       wait / r.rate))
        cp_tot.append(lay.blocks * cp_blk)
    return stages, cp_tot


def _tp_wire(r: _Run) -> float:
    """Bytes rank 0 sends per step in its blocks' TP collectives."""
    if r.plan.tp == 1:
        return 0.0
    n, k = _tp_block_calls(r.mcfg, r.plan, r.lays[0], r.act)
    return r.m * k * coll.wire_bytes("all_reduce", "ring", r.plan.tp, n)


def _cp_wire(r: _Run, lay: RankLayout) -> float:
    return L.cp_wire_bytes(r.mcfg, r.plan, r.e, r.batch, lay.blocks)


def _ep_wire(r: _Run, lay: RankLayout) -> float:
    rows = r.m * moe_blocks(r.mcfg, lay) * ep_rows_uniform(r.mcfg, r.plan, r.tokens_mb)
    return ep_wire_bytes(r.mcfg, r.plan, r.e, rows, rows, r.m * moe_blocks(r.mcfg, lay))


def _pp_terms(r: _Run) -> tuple[float, float]:
    """(seconds along the critical path, bytes rank 0 sends) of the pipeline's sends."""
    plan = r.plan
    if plan.pp == 1:
        return 0.0, 0.0
    hop = _pp_hop(plan, r.act)
    pp_s = 2 * (r.m + plan.pp - 1) * virtual_stages(plan) * (r.hw.intra_alpha
                                                             + hop / r.hw.intra_bw)
    return pp_s, _pp_messages(plan, r.lays[0].pp)[0] * hop


def _dp_terms(r: _Run, first_flop_s: float) -> tuple[float, float]:
    """(total, exposed) seconds of the data-parallel sync (over dp x cp; with ep, the
    dense and expert reducers) of rank 0, whose first stage computes ``first_flop_s``
    per micro-batch."""
    plan = r.plan
    groups = _dp_groups(r.mcfg, plan, r.tcfg, 0)
    if not groups:
        return 0.0, 0.0
    a, bw = r.hw.intra_alpha, r.hw.intra_bw

    def t(p: int, op: str, n: float, k: int) -> float:
        return k * coll.time_s(op, "ring", p, n, a, bw)

    dp_s = sum(t(p, op, n, k) for p, cs in groups for op, n, k in cs)
    # Gradient buckets that fill before backward ends can hide under it; the last cannot.
    # ZeRO-1/2 all-gather the parameters after the optimizer step, HSDP's replica
    # all-reduce (the last group) runs after backward, a pipeline reduces each chunk after
    # its last backward, top-k after backward, and ZeRO-3 gathers sit in the path.
    hidden = 0.0
    if plan.overlap and plan.pp == 1 and L.dp_kind(plan) in ("ddp", "zero"):
        red = [(p, op, n, k) for p, cs in (groups[:-1] if plan.dp_replicate > 1 else groups)
               for op, n, k in cs if op in ("all_reduce", "reduce_scatter")]
        if len(red) > 1:
            hidden = min(sum(t(*c) for c in red) - t(*red[-1]), (2 / 3) * first_flop_s)
    return dp_s, dp_s - hidden


def _rank_cpu(r: _Run, lay: RankLayout, stage: tuple[float, ...], slow: float) -> float:
    """CPU seconds one rank of ``lay``'s stage spends per step: its compute and fixed
    costs (``slow`` x, the cores' contention: :func:`paratrain.predict.sched.contention`),
    and the CPU its collectives and sends cost (per ring step and per byte sent,
    measured)."""
    mcfg, plan, machine, m = r.mcfg, r.plan, r.machine, r.m
    c = (m * (stage[0] + stage[1]) + machine.step_s) * slow
    c += _comm_cpu(machine, plan.tp, _tp_calls(mcfg, plan, lay, r.act, r.seqs_mb))
    c += _comm_cpu(machine, plan.pp, _pp_calls(plan, lay, r.act))
    c += _cp_cpu(r, lay)
    c += _comm_cpu(machine, plan.ep, ep_calls(plan, _ep_wire(r, lay),
                                              m * moe_blocks(mcfg, lay)))
    c += sum(_comm_cpu(machine, p, cs) for p, cs in _dp_groups(mcfg, plan, r.tcfg, lay.rank))
    c += _scalar_cpu(machine, r.world)
    return c


def _scalar_cpu(machine: MachineModel, world: int) -> float:
    """CPU seconds of the step's scalar all-reduces over the ``world`` (the loss and the
    gradient norm, :data:`paratrain.predict.calls.SCALAR_BYTES` each): the fit's measured
    call (``scalar_cpu_s``: gloo leaves most of the ring's pieces empty) after compute
    (``sync_cpu_s``); unmeasured, a collective's price by its ring steps."""
    if machine.scalar_cpu_s:
        return SCALAR_ALL_REDUCES * (machine.scalar_cpu_s + machine.sync_cpu_s)
    return _comm_cpu(machine, world, [("all_reduce", SCALAR_BYTES, SCALAR_ALL_REDUCES)])


def _ring_fitted(r: _Run) -> bool:
    """Whether the fit measured the CP ring's CPU (``check-model``'s, run/ring_fit.py)."""
    m = r.machine
    return r.plan.cp > 1 and r.plan.cp_algorithm == "ring" and any(
        getattr(m, k) for k in RING_FIELDS)


def _ring_cpu(r: _Run, lay: RankLayout, hop_s: float, byte_s: float) -> float:
    """CPU seconds of ``lay``'s stage rank's CP ring per step at ``hop_s`` per hop and
    ``byte_s`` per byte it sends (:func:`paratrain.cost.cp_bytes.ring_hops` a block and
    micro-batch)."""
    return r.m * lay.blocks * ring_hops(r.plan) * hop_s + _cp_wire(r, lay) * byte_s


def _cp_cpu(r: _Run, lay: RankLayout) -> float:
    """CPU seconds a rank spends on its CP exchange per step beyond its own thread's
    (which :func:`_stage_terms` puts in line with its compute): with the ring's CPU
    fitted, gloo's progress thread's; otherwise, and for all-to-all, its transfers as
    calls (:func:`paratrain.predict.axes.cp_calls`)."""
    if _ring_fitted(r):
        return _ring_cpu(r, lay, r.machine.ring_hop_cpu_s, r.machine.ring_byte_cpu_s)
    return _comm_cpu(r.machine, r.plan.cp, cp_calls(r.plan, _cp_wire(r, lay), lay.blocks))


def _syncs(r: _Run, slow: int, dp_s: float, dp_exposed: float) -> float:
    """Blocking syncs along the critical path per step (:mod:`paratrain.predict.sched`):
    the stages' micro-batches (the slowest m times, the others' fill) and the step's."""
    per = [S.stage_syncs(r.mcfg, r.plan, lay, _tp_calls(r.mcfg, r.plan, lay, r.act,
                                                        r.seqs_mb)) for lay in r.lays]
    groups = _dp_groups(r.mcfg, r.plan, r.tcfg, 0)
    return pipeline_path(per, slow, r.plan) + S.path_syncs(r.plan, groups,
                                                           dp_exposed < dp_s, r.world)


def predict(mcfg: ModelConfig, tcfg: TrainConfig, plan: ParallelPlan, world: int,
            machine: MachineModel, load: float | None = None) -> Prediction:
    """Price one step of ``plan`` (any composition of dp, pp, tp/sp, cp, ep) on ``world``
    one-thread ranks of this machine: the larger of the critical path (compute stretched
    where the cores are shared, a wake-up per blocking sync) and the session's CPU work
    over the cores it gets (plus the oversubscribed syncs), :func:`paratrain.predict.
    sched.bounds`; the pipeline's fill is the schedule's own bubble
    (:mod:`paratrain.predict.pipeline`). ``load``: the busiest ep rank's expert rows
    over the mean, where the run's routing is known (`paratrain check-model`:
    :func:`paratrain.predict.axes.expert_load_from_routing`); None: a balanced
    router's expected extreme."""
    r = _run(mcfg, tcfg, plan, world, machine, load)
    share = machine.share(world)
    o = S.oversubscription(share)
    notes = _notes(r, share)
    stages, cp_tot = _stage_terms(r)
    per_stage = [sum(x) for x in stages]
    slow = slowest_stage(per_stage)
    k = S.stretch(o, plan, machine, world)
    flop_s, fixed_path = (pipeline_path([st[j] for st in stages], slow, plan, k)
                          for j in range(2))
    flop_s += pipeline_path([st[5] for st in stages], slow, plan, k)
    tp_s, cp_exposed, ep_s = (pipeline_path([st[j] for st in stages], slow, plan)
                              for j in range(2, 5))
    overhead_s = fixed_path + machine.step_s * k[0]
    pp_s, pp_wire = _pp_terms(r)
    dp_s, dp_exposed = _dp_terms(r, stages[0][0])
    syncs = _syncs(r, slow, dp_s, dp_exposed)
    slowdown = S.contention(machine, world + machine.other_threads)
    cpu = [_rank_cpu(r, lay, stages[i], slowdown) for i, lay in enumerate(r.lays)]
    work = plan.dp * plan.cp * plan.tp * sum(cpu)
    cores = share * world
    crit, bound, sync_s = S.bounds(flop_s + overhead_s + tp_s + cp_exposed + ep_s + pp_s
                                   + dp_exposed, work / cores, syncs, o, machine)
    if bound > crit:
        notes.append(f"CPU-bound: the session's {work:.3f} CPU s per step on {cores:.2f} "
                     f"cores (and {syncs:.0f} syncs) take longer than the critical path "
                     f"({crit:.3f} s)")
    states = [L.state_bytes(mcfg, plan, tcfg.dtype, q, tcfg.reduce_dtype) for q in range(world)]
    wires = [L.dp_wire_bytes(mcfg, plan, tcfg.dtype, q, tcfg.reduce_dtype) for q in range(world)]
    return Prediction(
        step_s=max(crit, bound), compute_s=flop_s, overhead_s=overhead_s,
        bubble_s=pipeline_bubble(per_stage, plan), tp_comm_s=tp_s, pp_comm_s=pp_s,
        dp_comm_s=dp_s, dp_exposed_s=dp_exposed, share=share, critical_path_s=crit,
        session_work_s=work, session_cores=cores, cpu_rank0_s=cpu[0],
        dp_wire_bytes=wires[0], tp_wire_bytes=_tp_wire(r), pp_wire_bytes=pp_wire,
        cp_comm_s=pipeline_path(cp_tot, slow, plan), cp_exposed_s=cp_exposed,
        ep_comm_s=ep_s, cp_wire_bytes=_cp_wire(r, r.lays[0]),
        ep_wire_bytes=_ep_wire(r, r.lays[0]), oversubscription=o, syncs=syncs,
        sync_s=sync_s, expert_load=r.load, states_bytes_per_rank=states,
        dp_wire_bytes_per_rank=wires,
        systems_states_bytes=sum(predicted_states(mcfg, plan, tcfg).values()),
        activations_bytes=predicted_activations(mcfg, plan, tcfg), machine=machine.source,
        notes=notes)
