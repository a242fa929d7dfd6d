"""One step of one run on this machine, priced (:func:`predict`), and the CPU fit that
calibrates it from single-process runs (:func:`fit_from_runs`). Every byte count comes
from :mod:`paratrain.cost.layout` (CP, EP terms: :mod:`paratrain.predict.axes`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from paratrain.config import ModelConfig, TrainConfig
from paratrain.cost import collectives as coll
from paratrain.cost import layout as L
from paratrain.cost.hardware import Hardware
from paratrain.cost.layout import ELEMENT_BYTES, RankLayout
from paratrain.cost.ranks import virtual_stages
from paratrain.cost.run_figures import predicted_activations, predicted_states
from paratrain.cost.schedule import bubble_over_compute
from paratrain.cost.tp_bytes import tp_forward_backward
from paratrain.plan import ParallelPlan
from paratrain.predict.axes import (
    cp_block_s,
    cp_calls,
    ep_block_s,
    ep_calls,
    ep_rows_uniform,
    ep_wire_bytes,
    moe_blocks,
    moe_extra_flops,
    one_host,
)
from paratrain.predict.machine import MachineModel
from paratrain.systems.layer_cost import expert_imbalance


@dataclass(frozen=True)
class Prediction:
    """One step of one run on this machine (seconds, bytes; per rank unless named)."""

    step_s: float  # max(critical path, session CPU work / session cores)
    compute_s: float  # matmul FLOPs at eta, summed along the critical path (free cores)
    overhead_s: float  # fixed per-pass and per-step costs along the critical path
    bubble_s: float  # pipeline fill/drain: part of compute + overhead above
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float  # the data-parallel sync, total
    dp_exposed_s: float  # of which not hidden under backward
    share: float  # fraction of a core per rank
    critical_path_s: float  # the step if every rank had a core of its own
    session_work_s: float  # CPU seconds all ranks spend per step (compute + copies)
    session_cores: float  # cores the run's session gets (water-filled between sessions)
    cpu_rank0_s: float  # CPU seconds rank 0 spends per step
    dp_wire_bytes: float  # rank 0, per step
    tp_wire_bytes: float  # rank 0, blocks' collectives per step
    pp_wire_bytes: float  # rank 0, point-to-point sends per step
    cp_comm_s: float = 0.0  # the CP exchange along the critical path, total
    cp_exposed_s: float = 0.0  # of which not hidden under the block attention
    ep_comm_s: float = 0.0  # MoE all-to-alls along the critical path (all exposed)
    cp_wire_bytes: float = 0.0  # rank 0, per step (paratrain.cost.layout.cp_wire_bytes)
    ep_wire_bytes: float = 0.0  # rank 0, per step, expected under uniform routing
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
    """Forward + backward FLOPs of one block on ``tokens`` tokens, one tensor shard:
    6 x matmul params + attention scores and values 12 H Q T (PaLM, appendix B); full
    recomputation adds a forward (1/3), selective the attention's forward. Each token
    attends to the whole context T, so under cp a rank's T/cp tokens cost T/cp of it."""
    d, hd = mcfg.d_model, mcfg.head_dim
    mat = (2 * mcfg.n_heads * hd * d + 2 * mcfg.kv_heads * hd * d + 3 * mcfg.d_ff * d) / tp
    attn = 12.0 * mcfg.n_heads * hd * mcfg.context / tp
    f = 6.0 * mat + attn
    if recompute == "full":
        f *= 4 / 3
    elif recompute == "selective":
        f += attn / 3
    return tokens * f


def _stage_mb_time(mcfg: ModelConfig, plan: ParallelPlan, lay: RankLayout, tokens_mb: float,
                   rate: float, pass_s: float) -> tuple[float, float]:
    """(FLOP seconds, fixed seconds) of one micro-batch's forward + backward on a rank
    (``tokens_mb``: the rank's tokens, T/cp of each sequence); MoE blocks add their
    experts (:func:`paratrain.predict.axes.moe_extra_flops`)."""
    f = lay.blocks * _flops_block(mcfg, tokens_mb, plan.tp, plan.recompute)
    f += moe_blocks(mcfg, lay) * moe_extra_flops(mcfg, plan, tokens_mb)
    if lay.last:
        f += tokens_mb * 6.0 * mcfg.d_model * mcfg.vocab_size / plan.tp  # the head
    passes = lay.blocks + (1 if (lay.first or lay.last) else 0)
    return f / rate, passes * pass_s


def _tp_block_calls(mcfg: ModelConfig, plan: ParallelPlan, lay: RankLayout, act: float
                    ) -> tuple[float, int]:
    """(bytes, all-reduce-sized calls) of the blocks' TP collectives per micro-batch:
    :func:`paratrain.cost.tp_bytes.tp_forward_backward` per dense block (the same
    steps and bytes under SP's all-gather + reduce-scatter); an MoE block has one
    forward and one backward fewer (its MLP is whole on every tp rank: no entry, no exit)."""
    n_fwd, n_bwd = tp_forward_backward(plan.recompute)
    moe = moe_blocks(mcfg, lay)
    return act, (n_fwd + n_bwd) * lay.blocks - 2 * moe


def _tp_calls(mcfg: ModelConfig, plan: ParallelPlan, lay: RankLayout, act: float,
              seqs_mb: float) -> list[tuple[str, float, int]]:
    """TP collectives per step: the blocks' (:func:`_tp_block_calls`), 1 at the
    embedding, 1 + 3 small at the head, per micro-batch."""
    if plan.tp == 1:
        return []
    m = plan.micro_batches
    n, k = _tp_block_calls(mcfg, plan, lay, act)
    out = [("all_reduce", n, m * k),
           ("all_reduce", act, m * (int(lay.first) + int(lay.last)))]
    if lay.last:
        out.append(("all_reduce", seqs_mb * mcfg.context / plan.cp * 4, 3 * m))
    return out


def _pp_calls(plan: ParallelPlan, lay: RankLayout, act: float, v: int
              ) -> list[tuple[str, float, int]]:
    """Point-to-point operations per step: each micro-batch sends (and receives) an
    activation forward and a gradient back at every inner stage boundary."""
    if plan.pp == 1:
        return []
    hop = act / (plan.tp if plan.sp else 1)
    ends = (0 if lay.last else 1) + (0 if lay.first else 1)
    return [("p2p", hop, 2 * plan.micro_batches * v * ends)]


def _dp_groups(mcfg: ModelConfig, plan: ParallelPlan, tcfg: TrainConfig, rank: int
               ) -> list[tuple[int, list[tuple[str, float, int]]]]:
    """(group size, calls) of each gradient reducer of ``rank``: one over dp x cp
    (:func:`paratrain.cost.layout.reducer_plan`), or with ep > 1 the dense one and the
    experts' (:func:`paratrain.cost.layout.reducers`)."""
    parts = [(plan, rank, "all", None)] if plan.ep == 1 else L.reducers(plan, rank)
    out = []
    for q, r, part, e in parts:
        p = L.reducer_plan(q).dp
        if p > 1:
            out.append((p, L.dp_calls(mcfg, q, tcfg.dtype, r, tcfg.reduce_dtype, part, e)))
    return out


# ---- the pipeline's critical path: the schedule's own bubble ---------------------------------
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


def pipeline_path(xs: list[float], slow: int, plan: ParallelPlan) -> float:
    """Seconds of ``xs`` (per stage, one micro-batch) along the critical path: m x the
    slowest stage's plus the others' share of the schedule's fill (:func:`_fill_per_stage`)."""
    others = sum(x for i, x in enumerate(xs) if i != slow)
    return plan.micro_batches * xs[slow] + _fill_per_stage(plan) * others


def pipeline_bubble(per_stage: list[float], plan: ParallelPlan) -> float:
    """The step's pipeline bubble (seconds) for ``per_stage`` seconds of one micro-batch's
    forward + backward on each pipeline rank; with equal stages, the simulated schedule's
    idle time per rank (``tests/test_systems_bubble.py``)."""
    slow = slowest_stage(per_stage)
    return _fill_per_stage(plan) * sum(x for i, x in enumerate(per_stage) if i != slow)


def _comm_cpu(machine: MachineModel, p: int, calls: list[tuple[str, float, int]]) -> float:
    """CPU seconds a rank spends in ``calls`` on a group of ``p``: ring steps x the
    measured CPU per step plus the bytes it sends x the CPU per byte (or bytes / the
    transport's bandwidth)."""
    per_byte = machine.coll_byte_cpu_s or 1.0 / machine.hw.intra_bw
    total = 0.0
    for op, n, k in calls:
        if op == "p2p":
            steps, wire = 1, n
        else:
            steps, wire = coll.steps(op, "ring", p), coll.wire_bytes(op, "ring", p, n)
        total += k * (steps * machine.coll_step_cpu_s + wire * per_byte)
    return total


def predict(mcfg: ModelConfig, tcfg: TrainConfig, plan: ParallelPlan, world: int,
            machine: MachineModel) -> Prediction:
    """Price one step of ``plan`` (any composition of dp, pp, tp/sp, cp, ep) on ``world``
    one-thread ranks of this machine."""
    if plan.world_size != world:
        raise ValueError(f"plan needs {plan.world_size} ranks but world={world}; match them")
    hw = one_host(machine.hw, world)
    notes: list[str] = []
    share = machine.share(world)
    rate = machine.eta * machine.thread_peak  # the critical path is priced on free cores
    pass_s, fixed_s = machine.pass_s, machine.step_s
    e = ELEMENT_BYTES[tcfg.dtype]
    m = plan.micro_batches
    seqs_mb = tcfg.global_batch / plan.dp / m
    tokens_mb = seqs_mb * mcfg.context / plan.cp  # the load-balanced split: equal work
    batch = int(tcfg.global_batch // plan.dp)
    if share < 1:
        notes.append(f"{world} ranks on {machine.cores} cores beside "
                     f"{machine.other_sessions:.1f} other busy sessions "
                     f"({machine.other_threads:.1f} runnable threads): each rank gets "
                     f"{share:.2f} of a core")
    if plan.ep > 1:
        notes.append("EP all-to-all bytes expected under uniform routing (the measured "
                     "ones follow the router); the busiest rank's experts carry "
                     f"x{expert_imbalance(tokens_mb * mcfg.top_k, plan.ep):.3f} the mean load")
    if not machine.fitted:
        notes.append("no CPU fit: eta from the profile, fixed costs 0 (run paratrain "
                     "check-model)")

    # ---- per stage and micro-batch: FLOPs, fixed costs, TP, CP and EP exchanges ----------
    a, bw = hw.intra_alpha, hw.intra_bw
    act = tokens_mb * mcfg.d_model * e  # a micro-batch's activations on the rank
    cp_blk, cp_exp_blk = cp_block_s(mcfg, plan, seqs_mb, tokens_mb, rate, hw, e)
    ep_blk = ep_block_s(mcfg, plan, tokens_mb, hw, e)
    stages, cp_tot = [], []  # (flop_s, fixed_s, tp_s, cp exposed s, ep_s) per micro-batch
    lays = [L.rank_layout(mcfg, plan, L.rank_of(s, 0, 0, plan)) for s in range(plan.pp)]
    for lay in lays:
        f, fx = _stage_mb_time(mcfg, plan, lay, tokens_mb, rate, pass_s)
        tp_t = sum(k * coll.time_s(op, "ring", plan.tp, n, a, bw)
                   for op, n, k in _tp_calls(mcfg, plan, lay, act, seqs_mb)) / m
        stages.append((f, fx, tp_t, lay.blocks * cp_exp_blk, moe_blocks(mcfg, lay) * ep_blk))
        cp_tot.append(lay.blocks * cp_blk)
    per_stage = [sum(x) for x in stages]
    v = virtual_stages(plan)
    slow = slowest_stage(per_stage)

    def path(xs: list[float]) -> float:
        return pipeline_path(xs, slow, plan)

    flop_s, fixed_path, tp_s, cp_exposed, ep_s = (path([st[j] for st in stages])
                                                  for j in range(5))
    cp_s = path(cp_tot)
    bubble_s = pipeline_bubble(per_stage, plan)
    overhead_s = fixed_path + fixed_s
    lay0 = lays[0]
    tp_wire = 0.0
    if plan.tp > 1:
        n, k = _tp_block_calls(mcfg, plan, lay0, act)
        tp_wire = m * k * coll.wire_bytes("all_reduce", "ring", plan.tp, n)

    def cp_wire(lay: RankLayout) -> float:
        return L.cp_wire_bytes(mcfg, plan, e, batch, lay.blocks)

    def ep_wire(lay: RankLayout) -> float:
        rows = m * moe_blocks(mcfg, lay) * ep_rows_uniform(mcfg, plan, tokens_mb)
        return ep_wire_bytes(mcfg, plan, e, rows, rows, m * moe_blocks(mcfg, lay))

    # ---- pipeline point-to-point ------------------------------------------------------------
    pp_s = pp_wire = 0.0
    if plan.pp > 1:
        hop = act / (plan.tp if plan.sp else 1)
        pp_s = 2 * (m + plan.pp - 1) * v * (a + hop / bw)
        sends = (0 if lay0.last else 1) + (0 if lay0.first else 1)  # rank 0: forward only
        pp_wire = m * v * sends * hop

    # ---- data parallel (over dp x cp; with ep, dense and expert reducers) -------------------
    dp_s = dp_exposed = 0.0
    states = [L.state_bytes(mcfg, plan, tcfg.dtype, r, tcfg.reduce_dtype) for r in range(world)]
    wires = [L.dp_wire_bytes(mcfg, plan, tcfg.dtype, r, tcfg.reduce_dtype) for r in range(world)]
    groups = _dp_groups(mcfg, plan, tcfg, 0)
    if groups:
        calls = [c for _, cs in groups for c in cs]
        dp_s = sum(k * coll.time_s(op, "ring", p, n, a, bw)
                   for p, cs in groups for op, n, k in cs)
        # Buckets that fill before backward ends can hide under it; the last cannot. A
        # pipeline reduces each chunk after its last backward, top-k after backward, and
        # ZeRO-3 gathers sit in the path.
        hidden = 0.0
        last = calls[-1][1]
        total = sum(n for _, n, _ in calls)
        if plan.overlap and plan.pp == 1 and L.dp_kind(plan) in ("ddp", "zero") \
                and len(calls) > 1:
            hidden = min(dp_s * (1 - last / total), (2 / 3) * stages[0][0])
        dp_exposed = dp_s - hidden

    crit = flop_s + overhead_s + tp_s + cp_exposed + ep_s + pp_s + dp_exposed
    # CPU work of the whole session per step: every rank's compute and fixed costs, and
    # the CPU its collectives and sends cost (per ring step and per byte sent, measured).
    cpu = []
    for i, lay_s in enumerate(lays):
        c = m * (stages[i][0] + stages[i][1]) + fixed_s
        c += _comm_cpu(machine, plan.tp, _tp_calls(mcfg, plan, lay_s, act, seqs_mb))
        c += _comm_cpu(machine, plan.pp, _pp_calls(plan, lay_s, act, v))
        c += _comm_cpu(machine, plan.cp, cp_calls(plan, cp_wire(lay_s), lay_s.blocks))
        c += _comm_cpu(machine, plan.ep, ep_calls(plan, ep_wire(lay_s),
                                                  m * moe_blocks(mcfg, lay_s)))
        c += sum(_comm_cpu(machine, p, cs) for p, cs in _dp_groups(mcfg, plan, tcfg,
                                                                    lay_s.rank))
        c += _comm_cpu(machine, world, [("all_reduce", 8.0, 2)])  # loss, grad norm
        cpu.append(c)
    work = plan.dp * plan.cp * plan.tp * sum(cpu)
    cores = share * world
    step = max(crit, work / cores)
    if work / cores > crit:
        notes.append(f"CPU-bound: the session's {work:.3f} CPU s per step on {cores:.2f} "
                     f"cores take longer than the critical path ({crit:.3f} s)")
    sys_states = sum(predicted_states(mcfg, plan, tcfg).values())
    return Prediction(
        step_s=step, compute_s=flop_s, overhead_s=overhead_s, bubble_s=bubble_s,
        tp_comm_s=tp_s, pp_comm_s=pp_s, dp_comm_s=dp_s, dp_exposed_s=dp_exposed,
        share=share, critical_path_s=crit, session_work_s=work, session_cores=cores,
        cpu_rank0_s=cpu[0], dp_wire_bytes=wires[0], tp_wire_bytes=tp_wire,
        pp_wire_bytes=pp_wire, cp_comm_s=cp_s, cp_exposed_s=cp_exposed, ep_comm_s=ep_s,
        cp_wire_bytes=cp_wire(lay0), ep_wire_bytes=ep_wire(lay0),
        states_bytes_per_rank=states, dp_wire_bytes_per_rank=wires,
        systems_states_bytes=sys_states,
        activations_bytes=predicted_activations(mcfg, plan, tcfg), machine=machine.source,
        notes=notes)


# ---- fitting eta and the fixed costs from single-process runs -------------------------------
def fit_from_runs(mcfg: ModelConfig, runs: list[tuple[int, int, float]], hw: Hardware,
                  thread_peak: float) -> MachineModel:
    """Least squares t = F / R + units x pass_s + step_s over one-process runs.

    ``runs``: (global_batch, micro_batches, seconds per step on a whole core: CPU time)
    of the same model. F is the step's FLOPs, units = micro_batches x (blocks + 1). Needs
    runs that differ in both batch and micro-batches (at least 3). eta = R / thread_peak.
    """
    if len(runs) < 3:
        raise ValueError(f"{len(runs)} runs cannot fit 3 parameters; pass at least 3")
    rows, ts = [], []
    for gb, m, t in runs:
        f = mcfg.n_layers * _flops_block(mcfg, gb * mcfg.context, 1) + \
            gb * mcfg.context * 6.0 * mcfg.d_model * mcfg.vocab_size
        rows.append((f, m * (mcfg.n_layers + 1), 1.0))
        ts.append(t)
    inv_r, pass_s, step_s = _nnls3(rows, ts)
    if inv_r <= 0:
        raise ValueError("the fit found no FLOP-proportional time; use larger batches")
    return MachineModel(hw, 1.0 / inv_r / thread_peak, thread_peak, pass_s, step_s,
                        fitted=True, source="fit")


def _solve3(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination for a small square system; None if singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        piv = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[piv][c]) < 1e-300:
            return None
        m[c], m[piv] = m[piv], m[c]
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


def _nnls3(rows: list[tuple[float, ...]], ts: list[float]) -> list[float]:
    """Non-negative least squares for 3 unknowns: try every subset of free unknowns
    (8 of them), keep the best feasible one. Columns are scaled first."""
    k = len(rows[0])
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(k)]
    x_rows = [[r[j] / scale[j] for j in range(k)] for r in rows]
    best, best_err = [0.0] * k, sum(t * t for t in ts)
    for mask in range(1, 1 << k):
        free = [j for j in range(k) if mask >> j & 1]
        ata = [[sum(r[i] * r[j] for r in x_rows) for j in free] for i in free]
        atb = [sum(r[i] * t for r, t in zip(x_rows, ts, strict=True)) for i in free]
        sol = _solve3(ata, atb)
        if sol is None or min(sol) < 0:
            continue
        x = [0.0] * k
        for j, v in zip(free, sol, strict=True):
            x[j] = v
        err = sum((sum(r[j] * x[j] for j in range(k)) - t) ** 2
                  for r, t in zip(x_rows, ts, strict=True))
        if err < best_err - 1e-18:
            best, best_err = x, err
    return [best[j] / scale[j] for j in range(k)]
