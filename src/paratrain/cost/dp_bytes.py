"""Bytes of model states and of the dp sync per rank, as the runtime holds and sends them."""

from __future__ import annotations

from paratrain.config import ModelConfig
from paratrain.cost.buffers import (
    dp_flats,
    dp_kind,
    owned,
    pad,
    reducer_plan,
    shard_group,
    topk_keep,
)
from paratrain.cost.collectives import ring_share, wire_bytes
from paratrain.cost.ranks import elements, experts_apart, rank_layout
from paratrain.cost.ranks import reducers as _reducers
from paratrain.plan import ParallelPlan


def reducers(plan: ParallelPlan, rank: int) -> list:
    """:func:`paratrain.cost.ranks.reducers` with each reducer's plan as it sees it
    (:func:`reducer_plan`: cp ranks hold the same parameters, dense and expert ones
    alike, so both reducers run over their dp ranks x cp)."""
    return [(reducer_plan(q), r, part, ep) for q, r, part, ep in _reducers(plan, rank)]


# ---- bytes -----------------------------------------------------------------------------
def sharded_states(zero: int, pipelined: bool = False) -> tuple[bool, bool, bool]:
    """Which of (weights, gradients, optimizer state) ZeRO stage ``zero`` shards over the
    data-parallel ranks (Rajbhandari et al. 2020, sec. 5): 1 the optimizer state, 2 also
    the gradients, except under a pipeline, where they stay whole over the step
    (Megatron-LM's distributed optimizer), 3 everything. The one home of the rule: the
    runtime's exact bytes (:func:`state_bytes`) and the planner's per-parameter ones
    (:func:`paratrain.cost.memory.model_states`) both read it."""
    return zero >= 3, zero >= 3 or (zero == 2 and not pipelined), zero >= 1


def state_bytes(mcfg: ModelConfig, plan: ParallelPlan, dtype: str, rank: int,
                reduce_dtype: str = "bfloat16") -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state (AdamW m, v and, under mixed
    precision, the FP32 masters) on ``rank`` as the memory tracker measures them
    (distinct storages: flat buffers with their padding). With ep > 1 the sum over the
    two reducers (:func:`reducers`)."""
    if experts_apart(plan):
        parts = [_state_bytes(mcfg, q, dtype, r, reduce_dtype, part, ep)
                 for q, r, part, ep in reducers(plan, rank)]
        return {k: sum(d[k] for d in parts) for k in parts[0]}
    return _state_bytes(mcfg, plan, dtype, rank, reduce_dtype)


def _state_bytes(mcfg: ModelConfig, plan: ParallelPlan, dtype: str, rank: int,
                 reduce_dtype: str, part: str = "all", ep: int = 1) -> dict[str, int]:
    plan = reducer_plan(plan)
    w, g, m = elements(dtype, reduce_dtype)
    mixed = dtype == "bfloat16"
    lay = rank_layout(mcfg, plan, rank, part, ep)
    p = shard_group(plan)  # HSDP: chunks of one replica's ranks, padded to the whole dp
    n, r = lay.params, lay.dp % p
    kind = dp_kind(plan)
    flats = dp_flats(mcfg, plan, w, rank, part, ep)
    padded = sum(pad(b, plan.dp) for b in flats)
    own = sum(owned(b, p, r, plan.dp) for b in flats)
    if kind in ("none", "topk"):  # a master per parameter
        return {"params": w * n, "grads": w * n, "optimizer": (2 + mixed) * m * n}
    if kind == "ddp":  # grads are (or main_grad is) views into the padded buckets
        return {"params": w * n, "grads": g * padded, "optimizer": (2 + mixed) * m * n}
    masters = m * padded // p if mixed else 0  # a master of each whole owned chunk
    weights_sharded, grads_sharded, _ = sharded_states(plan.zero, plan.pp > 1)
    return {"params": w * (padded // p if weights_sharded else padded),
            "grads": g * (padded // p if grads_sharded else padded),
            "optimizer": 2 * m * own + masters}


def dp_payload_bytes(mcfg: ModelConfig, plan: ParallelPlan, dtype: str, rank: int,
                     reduce_dtype: str = "bfloat16") -> int:
    """Bytes this rank contributes to one dp reduction: its flat buffers with their
    padding in the reduction dtype, or under top-k its kept values and int32 indices; 0
    without a dp axis (with ep > 1: both reducers')."""
    if experts_apart(plan):
        w, g, _ = elements(dtype, reduce_dtype)
        return sum(0 if dp_kind(q) == "none" else
                   g * sum(pad(b, q.dp) for b in dp_flats(mcfg, q, w, r, part, ep))
                   for q, r, part, ep in reducers(plan, rank))
    plan = reducer_plan(plan)
    w, g, _ = elements(dtype, reduce_dtype)
    kind = dp_kind(plan)
    if kind == "none":
        return 0
    if kind == "topk":
        return topk_keep(plan, rank_layout(mcfg, plan, rank).params) * (w + 4)
    return g * sum(pad(b, plan.dp) for b in dp_flats(mcfg, plan, w, rank))


def dp_wire_factor(plan: ParallelPlan, micro_batches: int | None = None) -> float:
    """Wire bytes per rank and step of the dp sync in units of (p-1)/p x payload
    (:func:`dp_payload_bytes`), with ``micro_batches`` (default the plan's) per step:

    - ZeRO 0 / 1: one all-reduce, or reduce-scatter + all-gather (the all-gather of step
      k is sent in step k+1, so a steady step has both): 2;
    - ZeRO 2 without a pipeline: a reduce-scatter every micro-batch and one all-gather:
      m + 1; with a pipeline gradients stay whole over the step: 2;
    - ZeRO 3 without a pipeline: two all-gathers and a reduce-scatter per micro-batch:
      3m; with a pipeline each unit is gathered and reduced once per step: 2;
    - top-k: every rank's kept entries are all-gathered, (p-1) x payload: p;
    - no dp axis: 0.
    """
    plan = reducer_plan(plan)
    m = plan.micro_batches if micro_batches is None else micro_batches
    kind = dp_kind(plan)
    if kind == "none":
        return 0.0
    if kind == "topk":
        return float(plan.dp)
    return zero_wire_factor(plan.zero, m, plan.pp > 1)


def zero_wire_factor(zero: int, micro_batches: int, pipelined: bool) -> float:
    """:func:`dp_wire_factor` of ``--zero`` 0-3 (for the systems model, which has no
    plan of dp = 1 or top-k to ask about)."""
    if zero <= 1 or pipelined:
        return 2.0
    return float(micro_batches + 1) if zero == 2 else 3.0 * micro_batches


def grad_reductions(zero: int, micro_batches: int, pipelined: bool) -> int:
    """Gradient reductions per step: every micro-batch under ZeRO 2 and 3 without a
    pipeline (a reduce-scatter is what frees the micro-batch's gradients), else one: ZeRO
    0 / 1 reduce after the last micro-batch, and under a pipeline gradients stay whole
    over the step (:func:`sharded_states`), synced once after the last backward, as the
    runtime does and as PyTorch's pipelining runs FSDP (``set_requires_gradient_sync``
    off until the last micro-batch). The one home of that count: the runtime's calls
    (:func:`dp_calls`) and the systems model's sync time
    (:func:`paratrain.systems.dp_sync.dp_sync`) read it."""
    return micro_batches if zero >= 2 and not pipelined else 1


def top_useful_zero(pipelined: bool) -> int:
    """The highest ZeRO stage that saves memory over the one below it: 3, but 1 under a
    pipeline, where ZeRO-2 keeps its gradients whole over the step (:func:`sharded_states`)
    and ZeRO-3 holds its stage whole beside its shards
    (:func:`paratrain.cost.memory.zero3_buffers`), each with ZeRO-1's one sync a step
    (:func:`grad_reductions`). The search and the plan's verdict read it."""
    return 1 if pipelined else 3


def dp_calls(mcfg: ModelConfig, plan: ParallelPlan, dtype: str, rank: int,
             reduce_dtype: str = "bfloat16", part: str = "all", ep: int | None = None
             ) -> list[tuple[str, float, int]]:
    """(op, full bytes, calls per step) of a rank's dp sync, one entry per flat buffer
    and op: reductions in the gradient dtype, parameter all-gathers in the working one
    (with ep > 1: the dense reducer's, then the expert reducer's)."""
    if experts_apart(plan) and part == "all":
        return [c for q, r, pt, e in reducers(plan, rank)
                for c in dp_calls(mcfg, q, dtype, r, reduce_dtype, pt, e)]
    plan = reducer_plan(plan)
    w, g, _ = elements(dtype, reduce_dtype)
    p, kind = plan.dp, dp_kind(plan)
    m = plan.micro_batches if plan.pp == 1 else 1
    if kind == "none":
        return []
    if kind == "topk":  # values and indices: p pieces of each
        keep = topk_keep(plan, rank_layout(mcfg, plan, rank).params)
        return [("all_gather", p * keep * w, 1), ("all_gather", p * keep * 4, 1)]
    flats = [pad(b, p) for b in dp_flats(mcfg, plan, w, rank, part, ep)]
    if kind == "ddp":
        return [("all_reduce", g * n, 1) for n in flats]
    rs = grad_reductions(plan.zero, plan.micro_batches, plan.pp > 1)
    if kind == "fsdp":
        gathers = 2 * m if plan.pp == 1 else 1
        return [c for n in flats for c in (("all_gather", w * n, gathers),
                                           ("reduce_scatter", g * n, rs))]
    return [c for n in flats for c in (("reduce_scatter", g * n, rs), ("all_gather", w * n, 1))]


def dp_replicate_calls(mcfg: ModelConfig, plan: ParallelPlan, dtype: str, rank: int,
                       reduce_dtype: str = "bfloat16") -> list[tuple[str, float, int]]:
    """HSDP: (op, full bytes, calls per step) over the ``dp_replicate`` group of R
    ranks: one all-reduce per flat buffer of the owned gradient chunk (padded / shard
    group elements, gradient dtype), once per step after the last reduce-scatter,
    whatever the micro-batch count (:mod:`paratrain.parallel.dp_sharded`); [] without
    HSDP."""
    if plan.dp_replicate == 1:
        return []
    plan = reducer_plan(plan)
    w, g, _ = elements(dtype, reduce_dtype)
    s = shard_group(plan)
    return [("all_reduce", g * pad(b, plan.dp) // s, 1)
            for b in dp_flats(mcfg, plan, w, rank)]


def dp_wire_bytes_by_axis(mcfg: ModelConfig, plan: ParallelPlan, dtype: str, rank: int,
                          reduce_dtype: str = "bfloat16") -> dict[str, float]:
    """HSDP: bytes ``rank`` sends per steady step on each dp sub-axis, ``dp_shard``
    (ZeRO's reduce-scatters and all-gathers inside one replica) and ``dp_replicate``
    (the owned chunks' all-reduce across replicas): what the runtime reports as
    ``wire_bytes_by_axis``. Without HSDP: everything on ``dp``."""
    total = dp_wire_bytes(mcfg, plan, dtype, rank, reduce_dtype)
    if plan.dp_replicate == 1:
        return {"dp": total}
    rep = sum(k * wire_bytes(op, "ring", plan.dp_replicate, n) for op, n, k in
              dp_replicate_calls(mcfg, plan, dtype, rank, reduce_dtype))
    return {"dp_shard": total - rep, "dp_replicate": rep}


def dp_wire_bytes(mcfg: ModelConfig, plan: ParallelPlan, dtype: str, rank: int,
                  reduce_dtype: str = "bfloat16") -> float:
    """Bytes ``rank`` sends per steady step for its dp sync (ring collectives); with
    ep > 1 both reducers' (each over its own group size); under HSDP both sub-axes'
    (:func:`dp_wire_bytes_by_axis`)."""
    if experts_apart(plan):
        w, g, _ = elements(dtype, reduce_dtype)
        total = 0.0
        for q, r, part, ep in reducers(plan, rank):
            if dp_kind(q) == "none":
                continue
            payload = g * sum(pad(b, q.dp) for b in dp_flats(mcfg, q, w, r, part, ep))
            if w != g and dp_kind(q) == "zero":
                total += sum(k * n * ring_share(q.dp) for _, n, k in
                             dp_calls(mcfg, q, dtype, r, reduce_dtype, part, ep))
            else:
                total += dp_wire_factor(q) * ring_share(q.dp) * payload
        return total
    rep = sum(k * wire_bytes(op, "ring", plan.dp_replicate, n) for op, n, k in
              dp_replicate_calls(mcfg, plan, dtype, rank, reduce_dtype))
    plan = reducer_plan(plan)
    p = shard_group(plan)
    if dp_kind(plan) == "none":
        return 0.0
    w, g, _ = elements(dtype, reduce_dtype)
    if w != g and dp_kind(plan) in ("zero", "fsdp"):  # gathers and reductions differ
        return rep + sum(k * n * ring_share(p) for _, n, k in
                         dp_calls(mcfg, plan, dtype, rank, reduce_dtype))
    return rep + dp_wire_factor(plan) * ring_share(p) * dp_payload_bytes(
        mcfg, plan, dtype, rank, reduce_dtype)
