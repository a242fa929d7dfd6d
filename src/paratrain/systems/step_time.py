"""Step time: compute at peak x eta, communication per parallelism, overlap, bubble, MFU.

Compute (Kaplan et al. 2020; PaLM, Chowdhery et al. 2022, appendix B): model FLOPs per
token, forward + backward, are 6 N + 12 L H Q T; full recomputation adds another forward
(hardware FLOPs, HFU), selective recomputation the attention-score forward. Compute time is
hardware FLOPs / (GPUs x peak x eta).

Communication per step, each priced with :mod:`paratrain.cost.collectives` on the
slowest link its group spans (:mod:`paratrain.cost.groups`):

- data parallel (dp x cp ranks): ZeRO 0 ring all-reduce of the gradients; ZeRO 1
  reduce-scatter of gradients + all-gather of weights (the same 2(p-1)/p bytes); ZeRO 2
  reduce-scatters every micro-batch; ZeRO 3 also all-gathers the weights for forward and
  backward of every micro-batch: 3(p-1)/p x payload with one micro-batch
  (:func:`dp_sync_wire_bytes`).
- tensor parallel (Shoeybi et al. 2019): 2 all-reduces of the layer's activations in
  forward and 2 in backward per layer and micro-batch (with sequence parallelism: the
  same bytes as all-gathers + reduce-scatters); full recomputation repeats the attention
  exit's only, 5 per layer (:mod:`paratrain.cost.tp_bytes`, the runtime's own count).
- pipeline: one point-to-point activation send forward and one gradient back per micro-batch
  and virtual stage (scatter/gather optimisation: 1/tp of it per rank, Narayanan et al. 2021).
- context parallel (ring attention, Liu et al. 2023): K and V pass around the cp ring,
  forward once and backward twice (K/V and their gradients), hidden behind attention.
- expert parallel: two all-to-alls (dispatch, combine) forward and two backward per MoE layer.

Overlap: data-parallel sync runs under the remaining backward of the last micro-batch,
about 2/3 of its compute (``overlap_fraction``); ZeRO-2/3 reduce-scatters under each
micro-batch's backward, their all-gathers under a forward (the other 1/3). What does
not fit is exposed. Tensor, pipeline and expert communication is counted as exposed.
Pipeline bubble: (p-1)/m of the compute for GPipe and 1F1B (a fraction (p-1)/(m+p-1) of
the step), divided by v for interleaving, by 3 for ZB-H1 with m >= p (Qi et al. 2023);
one closed form, :func:`paratrain.cost.schedule.bubble_over_compute`
(torch-free), equal to the simulated schedule the runtime runs.

MFU = model FLOPs / (step time x GPUs x peak); HFU uses hardware FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.config import ModelConfig
from paratrain.cost import collectives as coll
from paratrain.cost.groups import group_link, span, split_batch, stage_layers
from paratrain.cost.hardware import Hardware
from paratrain.cost.layout import zero_wire_factor
from paratrain.cost.memory import Precision, params_per_gpu, recipe
from paratrain.cost.moe_layout import expert_data_ranks
from paratrain.cost.ranks import virtual_stages
from paratrain.cost.schedule import bubble_formula, bubble_over_compute
from paratrain.cost.shapes import as_shape
from paratrain.cost.tp_bytes import tp_forward_backward, tp_wire_bytes_per_layer
from paratrain.plan import ParallelPlan

OVERLAP_FRACTION = 2 / 3  # backward's share of compute (2 of 6N per token)


def bubble_fraction(schedule: str, pp: int, m: int, v: int = 1) -> float:
    """Idle fraction of a pipeline step: the schedule module's closed form
    (:func:`paratrain.cost.schedule.bubble_formula`), which equals the
    simulated bubble of the schedule the runtime executes."""
    return bubble_formula(schedule, pp, m, v)


def dp_sync_wire_bytes(payload_bytes: float, p: int, zero: int, micro_batches: int = 1,
                       pipelined: bool = False, replicate: int = 1) -> float:
    """Bytes each data-parallel rank sends per step for its gradient sync, m micro-batches
    (:func:`paratrain.cost.layout.dp_wire_factor`, the runtime's count):

    ZeRO 0/1: one all-reduce (1: reduce-scatter + all-gather), 2(p-1)/p x payload.
    ZeRO 2: gradients are sharded, so each micro-batch reduce-scatters, then one
    all-gather of the weights: (m + 1)(p-1)/p (2(p-1)/p at m = 1).
    ZeRO 3: each micro-batch all-gathers the weights for forward and again for backward
    and reduce-scatters its gradients: 3m(p-1)/p (3(p-1)/p at m = 1).
    Under a pipeline (``pipelined``) ZeRO 2 and 3 sync once per step: 2(p-1)/p.
    HSDP (``replicate`` R > 1, ZeRO >= 1): the above over s = p / R ranks, plus one
    all-reduce per step of the owned 1/s of the payload over the R replicas,
    2(R-1)/R x payload / s (:func:`paratrain.cost.layout.dp_wire_bytes_by_axis`).
    """
    if replicate > 1:
        s = p // replicate
        return (dp_sync_wire_bytes(payload_bytes, s, zero, micro_batches, pipelined)
                + coll.wire_bytes("all_reduce", "ring", replicate, payload_bytes / s))
    if zero <= 1:
        return coll.wire_bytes("all_reduce", "ring", p, payload_bytes)
    piece = coll.wire_bytes("all_gather", "ring", p, payload_bytes)  # (p-1)/p x payload
    return zero_wire_factor(zero, micro_batches, pipelined) * piece


@dataclass(frozen=True)
class StepTime:
    """Predicted time of one optimizer step and its utilisation (seconds, FLOPs)."""

    compute_s: float
    bubble_s: float
    dp_comm_s: float
    dp_exposed_s: float
    tp_comm_s: float
    pp_comm_s: float
    cp_comm_s: float
    cp_exposed_s: float
    ep_comm_s: float
    model_flops: float
    hardware_flops: float
    gpus: int
    peak_flops: float
    dp_wire_bytes: float
    tp_wire_bytes: float
    overlap: bool

    @property
    def comm_s(self) -> float:
        return self.dp_comm_s + self.tp_comm_s + self.pp_comm_s + self.cp_comm_s + \
            self.ep_comm_s

    @property
    def exposed_comm_s(self) -> float:
        return self.dp_exposed_s + self.tp_comm_s + self.pp_comm_s + self.cp_exposed_s + \
            self.ep_comm_s

    @property
    def step_sync_s(self) -> float:
        """Nothing overlapped: compute, bubble, then every collective waits its turn."""
        return self.compute_s + self.bubble_s + self.comm_s

    @property
    def step_overlap_s(self) -> float:
        return self.compute_s + self.bubble_s + self.exposed_comm_s

    @property
    def step_s(self) -> float:
        """The plan's own step: overlapped if ``plan.overlap``."""
        return self.step_overlap_s if self.overlap else self.step_sync_s

    def _util(self, flops: float, t: float) -> float:
        return flops / (t * self.gpus * self.peak_flops)

    @property
    def mfu_sync(self) -> float:
        return self._util(self.model_flops, self.step_sync_s)

    @property
    def mfu_overlap(self) -> float:
        return self._util(self.model_flops, self.step_overlap_s)

    @property
    def hfu_sync(self) -> float:
        return self._util(self.hardware_flops, self.step_sync_s)

    @property
    def hfu_overlap(self) -> float:
        return self._util(self.hardware_flops, self.step_overlap_s)

    @property
    def mfu(self) -> float:
        return self._util(self.model_flops, self.step_s)

    @property
    def hfu(self) -> float:
        return self._util(self.hardware_flops, self.step_s)

    @property
    def tflops_per_gpu(self) -> float:
        """Achieved model TFLOP/s per GPU at the plan's step time."""
        return self.model_flops / self.step_s / self.gpus / 1e12


def _dp_algorithm(name: str, p: int, per_node: int, crosses_nodes: bool) -> tuple[str, int]:
    """(algorithm, ranks per node) for the data-parallel sync.

    ``ring`` is docs/design.md's flat ring at the slowest link. ``auto`` goes hierarchical
    (intra-node, then inter-node on 1/g of the payload) when the group crosses nodes with
    several ranks in each; g is rounded down to a divisor of p.
    """
    if name != "auto":
        return name, per_node
    if not crosses_nodes or per_node == 1:
        return "ring", per_node
    g = max(x for x in range(1, per_node + 1) if p % x == 0)
    return ("hierarchical", g) if g > 1 else ("ring", g)


def recompute_flops_per_token(model: ModelConfig, recompute: str, seq_len: int) -> float:
    """Extra hardware FLOPs per token that recomputation adds (a forward is 1/3 of 6N +
    12 L H Q T; selective recomputes only the attention scores and values)."""
    m = as_shape(model)
    if recompute == "full":
        return m.flops_per_token(seq_len) / 3
    if recompute == "selective":
        return m.attention_flops_per_token(seq_len) / 3
    return 0.0


def _dp_group_time(plan: ParallelPlan, algo: str, d: int, payload: float, a: float,
                   bw: float, kw: dict, compute_mb: float, overlap_fraction: float
                   ) -> tuple[float, float]:
    """(seconds, exposed seconds) per step of one reducer's sync over ``d`` ranks: it
    hides under the last micro-batch's backward (ZeRO-2/3: reduce-scatters under each
    backward, all-gathers under a forward)."""
    mb = plan.micro_batches
    fwd, bwd = (1 - overlap_fraction) * compute_mb, overlap_fraction * compute_mb
    if plan.zero <= 1:
        t = coll.time_s("all_reduce", algo, d, payload, a, bw, **kw)
        return t, max(0.0, t - bwd)
    t_ag = coll.time_s("all_gather", algo, d, payload, a, bw, **kw)
    t_rs = coll.time_s("reduce_scatter", algo, d, payload, a, bw, **kw)
    if plan.pp > 1:  # ZeRO-2/3 under a pipeline: one reduce-scatter + all-gather
        return t_rs + t_ag, max(0.0, t_rs - bwd) + max(0.0, t_ag - fwd)
    if plan.zero == 2:  # reduce-scatter under each backward, all-gather under a forward
        return mb * t_rs + t_ag, mb * max(0.0, t_rs - bwd) + max(0.0, t_ag - fwd)
    # ZeRO-3: gather for forward, gather + reduce-scatter under backward
    return mb * (2 * t_ag + t_rs), mb * (max(0.0, t_ag - fwd) + max(0.0, t_ag + t_rs - bwd))


def _dp_sync(m: ModelConfig, plan: ParallelPlan, hw: Hardware, prec: Precision,
             compute_mb: float, overlap_fraction: float, dp_algorithm: str
             ) -> tuple[float, float, float]:
    """(seconds, exposed seconds, wire bytes) of the data-parallel sync per step: the
    dense parameters over dp*cp, the routed experts over their edp ranks."""
    p = params_per_gpu(m, plan)
    dp_comm = dp_exposed = dp_wire = 0.0
    groups = ((p.dense, plan.dp * plan.cp, plan.tp),
              (p.expert, expert_data_ranks(plan), plan.tp * plan.ep))
    for params, d, stride in groups:
        if d == 1 or params == 0:
            continue
        r = plan.dp_replicate if stride == plan.tp else 1  # HSDP: the dense reducer only
        payload = params * prec.grad_bytes
        a, bw = hw.link(span(d, stride), d)
        algo, g = _dp_algorithm(dp_algorithm, d, max(1, min(d, hw.gpus_per_node // stride)),
                                span(d, stride) > hw.gpus_per_node)
        kw = {"gpus_per_node": g, "intra_alpha_s": hw.intra_alpha,
              "intra_bw_bytes_per_s": hw.intra_group_bw(g)}
        dp_wire += dp_sync_wire_bytes(payload, d, plan.zero, plan.micro_batches, plan.pp > 1,
                                      r)
        t, exposed = _dp_group_time(plan, algo, d // r, payload, a, bw, kw, compute_mb,
                                    overlap_fraction)
        if r > 1:  # HSDP: the owned 1/s of the gradients all-reduced over the replicas
            t_ar = coll.time_s("all_reduce", "ring", r, payload * r / d, a, bw)
            t, exposed = t + t_ar, exposed + t_ar
        dp_comm += t
        dp_exposed += exposed
    return dp_comm, dp_exposed, dp_wire


def _tp_terms(m: ModelConfig, plan: ParallelPlan, hw: Hardware, batch, prec: Precision,
              layers: float, act_bytes: float) -> tuple[float, float]:
    """(seconds, wire bytes per rank) of the tensor-parallel collectives per step."""
    if plan.tp == 1:
        return 0.0, 0.0
    mb = plan.micro_batches
    a, bw = group_link(plan, "tp", hw)
    count = mb * layers * sum(tp_forward_backward(plan.recompute))
    tp_comm = count * coll.time_s("all_reduce", "ring", plan.tp, act_bytes, a, bw)
    tp_wire = mb * layers * tp_wire_bytes_per_layer(
        batch.micro_batch, batch.local_seq, m.d_model, plan.tp, prec.act_bytes,
        prec.act_bytes, plan.recompute)
    return tp_comm, tp_wire


def _pp_time(plan: ParallelPlan, hw: Hardware, act_bytes: float) -> float:
    """Point-to-point seconds per step, on the slowest hop between neighbouring stages."""
    if plan.pp == 1:
        return 0.0
    a, bw = group_link(plan, "pp", hw)
    send = a + act_bytes / plan.tp / bw
    return 2 * plan.micro_batches * virtual_stages(plan) * send


def _cp_terms(m: ModelConfig, plan: ParallelPlan, hw: Hardware, batch, prec: Precision,
              layers: float, attn_s: float) -> tuple[float, float]:
    """(seconds, exposed seconds) of ring attention's K/V passes per step; they hide
    under the attention's ``attn_s``."""
    if plan.cp == 1:
        return 0.0, 0.0
    a, bw = group_link(plan, "cp", hw)
    kv_bytes = 2 * batch.micro_batch * batch.local_seq * m.kv_heads * m.head_dim * \
        prec.act_bytes / plan.tp
    per_layer = 3 * coll.time_s("all_gather", "ring", plan.cp, plan.cp * kv_bytes, a, bw)
    cp_comm = plan.micro_batches * layers * per_layer
    return cp_comm, max(0.0, cp_comm - attn_s)


def _ep_time(m: ModelConfig, plan: ParallelPlan, hw: Hardware, layers: float,
             act_bytes: float) -> float:
    """Seconds of the MoE all-to-alls per step: dispatch and combine, forward and back."""
    if plan.ep == 1 or not m.is_moe:
        return 0.0
    a, bw = group_link(plan, "ep", hw)
    moe_layers = m.moe_layers * layers / m.n_layers
    payload = act_bytes * m.top_k
    return plan.micro_batches * moe_layers * 4 * coll.time_s("all_to_all", "naive", plan.ep,
                                                             payload, a, bw)


def step_time(model: ModelConfig, plan: ParallelPlan, hw: Hardware, tokens_per_step: int,
              seq_len: int, *, eta: float | None = None,
              overlap_fraction: float = OVERLAP_FRACTION,
              precision: str | Precision = "bf16-adam", dp_algorithm: str = "ring",
              overhead_width: float = 0.0) -> StepTime:
    """Predict one optimizer step of ``plan`` on ``plan.world_size`` GPUs of ``hw``.

    ``dp_algorithm``: "ring" (docs/design.md's reference), "auto" (hierarchical across nodes),
    or any algorithm of :mod:`paratrain.cost.collectives`. ``overhead_width`` (h0)
    prices the memory-bound, non-matmul work of a layer (norms, activations, softmax,
    optimizer): it scales with s b h while matmuls scale with s b h^2, so compute time is
    multiplied by (1 + h0 / d_model); 0 (the default, docs/design.md's model) ignores it.
    """
    m = as_shape(model)
    prec = recipe(precision) if isinstance(precision, str) else precision
    batch = split_batch(tokens_per_step, seq_len, plan)
    gpus = plan.world_size
    eta = hw.eta if eta is None else eta
    if not 0 < eta <= 1:
        raise ValueError(f"eta={eta} must be in (0, 1]; pass e.g. --eta 0.473")
    mb = plan.micro_batches

    model_flops = m.flops_per_token(seq_len) * tokens_per_step
    hw_flops = model_flops + recompute_flops_per_token(m, plan.recompute, seq_len) * \
        tokens_per_step
    rate = gpus * hw.peak_flops * eta
    compute_s = hw_flops / rate * (1 + overhead_width / m.d_model)
    bubble_s = compute_s * bubble_over_compute(plan.schedule, plan.pp, mb, virtual_stages(plan))
    compute_mb = compute_s / mb  # one micro-batch's forward + backward on a stage
    dp_comm, dp_exposed, dp_wire = _dp_sync(m, plan, hw, prec, compute_mb, overlap_fraction,
                                            dp_algorithm)

    layers = stage_layers(m.n_layers, plan.pp, model=m, virtual_stages=virtual_stages(plan),
                          seq_len=seq_len)  # the runtime's busiest pipeline rank
    act_bytes = batch.micro_batch * batch.local_seq * m.d_model * prec.act_bytes
    tp_comm, tp_wire = _tp_terms(m, plan, hw, batch, prec, layers, act_bytes)
    pp_comm = _pp_time(plan, hw, act_bytes)
    attn_s = m.attention_flops_per_token(seq_len) * tokens_per_step / rate
    cp_comm, cp_exposed = _cp_terms(m, plan, hw, batch, prec, layers, attn_s)
    ep_comm = _ep_time(m, plan, hw, layers, act_bytes)
    if not plan.overlap:
        dp_exposed, cp_exposed = dp_comm, cp_comm
    return StepTime(compute_s, bubble_s, dp_comm, dp_exposed, tp_comm, pp_comm, cp_comm,
                    cp_exposed, ep_comm, model_flops, hw_flops, gpus, hw.peak_flops, dp_wire,
                    tp_wire, plan.overlap)
