"""A context-parallel or expert-parallel step on this machine, priced
(:func:`predict_cp`, :func:`predict_ep`), for the benchmarks that print predicted beside
measured (``benchmarks/context_parallel.py``, ``benchmarks/expert_parallel.py``).

Why beside :func:`paratrain.predict.predict` and not inside it: that function prices
dp x tp x pp runs; CP and MoE add their own exchanges. These two price the same CPU
machine (:class:`~paratrain.predict.machine.MachineModel`: fitted eta and fixed costs,
gloo loopback alpha and bandwidth, the cores water-filled between sessions) for plans
whose only other axis is the data axis (pp = tp = 1), and take every count from its home:

- FLOPs and fixed costs of a block pass: :func:`paratrain.predict.model._stage_mb_time`
  (an MoE block adds its active experts, :meth:`paratrain.config.ModelConfig.moe_mlp_params`);
- CP exchange bytes and seconds: :func:`paratrain.layout.cp_wire_bytes` and
  :func:`paratrain.systems.comm_time.cp_s` (the runtime's bytes, a latency per hop);
  the ring hides its K/V transfer behind the block attention as the step model does
  (forward behind the attention forward, backward behind 2.5x it); all-to-all is exposed;
- MoE all-to-all seconds: :func:`paratrain.systems.comm_time.ep_s` per dispatch/combine
  (4 per MoE layer, 6 with full recompute, as the step model counts them); bytes with
  :func:`paratrain.systems.collectives.wire_bytes` under uniform routing (the measured
  bytes follow the router, so they agree in expectation, not exactly), plus the split
  sizes each layer exchanges first; the busiest rank's expert load by
  :func:`paratrain.systems.layer_cost.expert_imbalance`;
- gradient sync over dp (x cp): :func:`paratrain.layout.dp_calls`, priced as a ring,
  counted exposed (these small models fill one bucket);
- memory: :func:`paratrain.layout.state_bytes` (exact) and
  :func:`paratrain.parallel.memory.predicted_activations` (the systems model).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from paratrain import layout as L
from paratrain.config import ModelConfig, TrainConfig
from paratrain.layout import ELEMENT_BYTES
from paratrain.plan import ParallelPlan
from paratrain.predict.machine import MachineModel
from paratrain.predict.model import _comm_cpu, _stage_mb_time
from paratrain.systems import collectives as coll
from paratrain.systems import comm_time as ct
from paratrain.systems.layer_cost import expert_imbalance
from paratrain.systems.models import as_shape


@dataclass(frozen=True)
class AxisPrediction:
    """One step of a CP or EP run on this machine (seconds, bytes; rank 0)."""

    step_s: float  # max(critical path, session CPU work / session cores)
    compute_s: float  # FLOPs at the fitted rate (busiest rank)
    overhead_s: float  # fixed per-pass and per-step costs
    comm_s: float  # the axis's exchange (CP ring / all-to-all, or MoE all-to-all), total
    exposed_s: float  # of which not hidden under compute
    dp_s: float  # gradient sync over dp (x cp), exposed
    wire_bytes: float  # the axis's bytes sent per step
    states_bytes: int  # params + grads + optimizer
    activations_bytes: float
    critical_path_s: float
    session_work_s: float
    session_cores: float
    share: float
    notes: list[str] = field(default_factory=list)

    @property
    def peak_bytes(self) -> float:
        return self.states_bytes + self.activations_bytes

    def to_dict(self) -> dict:
        return asdict(self) | {"peak_bytes": self.peak_bytes}


def _check(plan: ParallelPlan, world: int, what: str) -> None:
    if plan.world_size != world:
        raise ValueError(f"plan needs {plan.world_size} ranks but world={world}; match them")
    if plan.pp > 1 or plan.tp > 1:
        raise ValueError(f"{what} prices pp = tp = 1 (got pp={plan.pp}, tp={plan.tp}); "
                         "use paratrain.predict.predict for other layouts")


def _assemble(mcfg: ModelConfig, tcfg: TrainConfig, plan: ParallelPlan, world: int,
              machine: MachineModel, flop_s: float, fixed_s: float, comm: float,
              exposed: float, wire: float, axis_calls: list[tuple[str, float, int]],
              notes: list[str]) -> AxisPrediction:
    """The step from its parts: critical path = compute + fixed + exposed exchange +
    gradient sync; session bound = every rank's CPU work over the session's cores."""
    from paratrain.parallel.memory import predicted_activations

    hw = machine.hw
    red = L.reducer_plan(plan)
    dp_calls = L.dp_calls(mcfg, plan, tcfg.dtype, 0, tcfg.reduce_dtype) if red.dp > 1 else []
    dp_s = sum(k * coll.time_s(op, "ring", red.dp, n, hw.intra_alpha, hw.intra_bw)
               for op, n, k in dp_calls)
    overhead = fixed_s + machine.step_s
    crit = flop_s + overhead + exposed + dp_s
    rank_cpu = flop_s + overhead + _comm_cpu(machine, red, "dp", dp_calls) \
        + _comm_cpu(machine, plan, "world", [("all_reduce", 8.0, 2)] + axis_calls)
    share = machine.share(world)
    cores = share * world
    work = world * rank_cpu
    if work / cores > crit:
        notes.append(f"CPU-bound: {work:.3f} CPU s per step on {cores:.2f} cores exceed the "
                     f"critical path ({crit:.3f} s)")
    if not machine.fitted:
        notes.append("no CPU fit: eta from the profile, fixed costs 0 (run paratrain "
                     "check-model)")
    states = sum(L.state_bytes(mcfg, plan, tcfg.dtype, 0, tcfg.reduce_dtype).values())
    return AxisPrediction(max(crit, work / cores), flop_s, overhead, comm, exposed, dp_s,
                          wire, states, predicted_activations(mcfg, plan, tcfg), crit, work,
                          cores, share, notes)


def predict_cp(mcfg: ModelConfig, tcfg: TrainConfig, plan: ParallelPlan, world: int,
               machine: MachineModel) -> AxisPrediction:
    """One step of a context-parallel run (ring or all-to-all; any dp; pp = tp = 1):
    each rank computes T/cp tokens of every sequence against the whole context."""
    _check(plan, world, "predict_cp")
    hw, e, m = machine.hw, ELEMENT_BYTES[tcfg.dtype], plan.micro_batches
    rate = machine.eta * machine.thread_peak
    seqs_mb = tcfg.global_batch / plan.dp / m
    tokens_mb = seqs_mb * mcfg.context / plan.cp  # the load-balanced split: equal work
    lay = L.rank_layout(mcfg, plan, 0)
    f, fx = _stage_mb_time(mcfg, plan, lay, tokens_mb, rate, machine.pass_s)
    comm = exposed = 0.0
    calls: list[tuple[str, float, int]] = []
    wire = 0.0
    if plan.cp > 1:
        cp_f, cp_b = ct.cp_s(mcfg, plan, mcfg.context, seqs_mb, hw, 1.0, 1.0, e)
        cp_f_again = cp_f if plan.recompute != "none" else 0.0  # recompute resends
        # the attention forward of one block (score and value matmuls): a third of the
        # model's per-layer attention FLOPs, which count forward + backward
        fwd_flops = as_shape(mcfg).attention_flops_per_token(mcfg.context) / 3 / mcfg.n_layers
        attn_f = tokens_mb * fwd_flops / rate
        comm = m * lay.blocks * (cp_f + cp_b + cp_f_again)
        exposed = m * lay.blocks * ct.cp_exposed_s(cp_f, cp_b + cp_f_again, attn_f,
                                                  plan.cp_algorithm)
        wire = L.cp_wire_bytes(mcfg, plan, e, int(tcfg.global_batch // plan.dp), lay.blocks)
        per_layer = 3 * (plan.cp - 1) + plan.cp if plan.cp_algorithm == "ring" \
            else 8 * (plan.cp - 1)  # ring: K/V out and back, grads home; a2a: 8 exchanges
        n = m * lay.blocks * per_layer
        calls = [("p2p", wire / n, n)]
    return _assemble(mcfg, tcfg, plan, world, machine, m * f, m * fx, comm, exposed, wire,
                     calls, [])


def predict_ep(mcfg: ModelConfig, tcfg: TrainConfig, plan: ParallelPlan, world: int,
               machine: MachineModel) -> AxisPrediction:
    """One step of an MoE run with experts over ``plan.ep`` ranks (ep ranks are data
    ranks for the dense part; pp = tp = cp = 1)."""
    _check(plan, world, "predict_ep")
    if not mcfg.experts:
        raise ValueError("predict_ep needs an MoE model (experts > 0); use predict")
    hw, e, m, ep = machine.hw, ELEMENT_BYTES[tcfg.dtype], plan.micro_batches, plan.ep
    rate = machine.eta * machine.thread_peak
    tokens_mb = tcfg.global_batch / plan.dp / m * mcfg.context
    lay = L.rank_layout(mcfg, plan, 0)
    f, fx = _stage_mb_time(mcfg, plan, lay, tokens_mb, rate, machine.pass_s)
    K = mcfg.top_k
    # the busiest ep rank holds E/ep experts whose load is ep ranks' tokens x K / ep
    imb = expert_imbalance(tokens_mb * K, ep) if ep > 1 else 1.0
    mlp_dense = 3 * mcfg.d_ff * mcfg.d_model
    mlp_moe = mcfg.moe_mlp_params(active=True) + (imb - 1) * K * mcfg.expert_params()
    redo = 4 / 3 if plan.recompute == "full" else 1.0
    f += redo * 6.0 * tokens_mb * (mlp_moe - mlp_dense) * mcfg.moe_layers / rate
    notes = []
    comm = wire = 0.0
    calls: list[tuple[str, float, int]] = []
    if ep > 1:
        n_a2a = 4 + (2 if plan.recompute == "full" else 0)
        routed = tokens_mb * K * mcfg.d_model * e
        per_layer = n_a2a * ct.ep_s(plan, routed, hw, 1.0, 1.0)
        comm = m * mcfg.moe_layers * per_layer
        counts = (ep - 1) * (mcfg.experts // ep) * 8  # int64 split sizes, first
        wire = m * mcfg.moe_layers * (n_a2a * coll.wire_bytes("all_to_all", "naive", ep,
                                                               routed) + counts)
        calls = [("p2p", wire / (m * mcfg.moe_layers * n_a2a * (ep - 1)),
                  m * mcfg.moe_layers * n_a2a * (ep - 1))]
        notes.append(f"all-to-all bytes expected under uniform routing; busiest rank's "
                     f"expert load x{imb:.3f} the mean")
    return _assemble(mcfg, tcfg, plan, world, machine, m * f, m * fx, comm, comm, wire,
                     calls, notes)
