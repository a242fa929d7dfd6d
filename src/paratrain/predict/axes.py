"""The context- and expert-parallel terms of the one prediction (:func:`paratrain.predict.
predict`), per pipeline stage and micro-batch, so that any composed layout (dp, pp, tp, sp,
cp, ep) is priced by the same critical path. Bytes come from their homes: CP from
:func:`paratrain.cost.layout.cp_wire_bytes` (the runtime's own count), CP seconds from
:func:`paratrain.systems.comm_time.cp_s` and :func:`~paratrain.systems.comm_time.
cp_exposed_s`, EP seconds from :func:`~paratrain.systems.comm_time.ep_s`. The EP byte
count is here (:func:`ep_wire_bytes`): it depends on the routing, so it takes the rows a
rank sends and receives, either expected under uniform routing (:func:`ep_rows_uniform`)
or read off a run's measured routing (:func:`ep_rows_from_load`)."""

from __future__ import annotations

import dataclasses

from paratrain.config import ModelConfig
from paratrain.cost import collectives as coll
from paratrain.cost import layout as L
from paratrain.cost import moe_layout
from paratrain.cost.cp_bytes import A2A_EXCHANGES, ring_hops
from paratrain.cost.hardware import Hardware
from paratrain.cost.shapes import as_shape
from paratrain.plan import ParallelPlan
from paratrain.systems import comm_time as ct
from paratrain.systems import moe_step

COUNT_BYTES = 8  # the split sizes every MoE layer exchanges first are int64


def one_host(hw: Hardware, world: int) -> Hardware:
    """The profile with every rank on this host: gloo over loopback, so the comm-time
    helpers' node-boundary test must not send a group across a "network"."""
    return dataclasses.replace(hw, gpus_per_node=max(hw.gpus_per_node, world))


def moe_blocks(mcfg: ModelConfig, lay: L.RankLayout) -> int:
    """MoE blocks (:meth:`ModelConfig.is_moe_layer`) among the rank's blocks."""
    return sum(mcfg.is_moe_layer(i) for a, b in lay.ranges for i in range(a, b))


def routed_tokens(plan: ParallelPlan, tokens: float) -> float:
    """Of a rank's ``tokens`` (T/cp of each sequence), those its MoE MLP routes
    (:func:`paratrain.cost.moe_layout.routed_tokens`, the one home)."""
    return moe_layout.routed_tokens(tokens, plan.tp, plan.sp)


def moe_extra_flops(mcfg: ModelConfig, plan: ParallelPlan, tokens: float) -> float:
    """FLOPs an MoE block adds (forward + backward, recompute included) over the dense
    block :func:`paratrain.predict.step._flops_block` priced, on ``tokens`` tokens: the
    router, top_k routed experts and the shared ones instead of the tp-sharded SwiGLU
    (the MoE MLP is whole on every tp rank, :func:`paratrain.parallel.tensor.
    shard_block`), at the mean expert load (what the CPU work sums; the busiest rank's
    excess is :func:`expert_wait_flops`); with SP the MoE MLP runs on the rank's 1/tp of
    the tokens (:func:`routed_tokens`)."""
    routed = routed_tokens(plan, tokens)
    m = as_shape(mcfg)
    dense = m.dense_mlp_params() / plan.tp
    return _redo(plan) * 6.0 * (routed * m.moe_mlp_params(active=True) - tokens * dense)


def expert_load(mcfg: ModelConfig, plan: ParallelPlan, tokens: float) -> float:
    """The busiest ep rank's expert rows over the mean, expected of a balanced router,
    cut at the capacity factor when the model drops tokens beyond it
    (:func:`paratrain.systems.moe_step.expert_load`); 1 without ep."""
    if plan.ep == 1:
        return 1.0
    rows = routed_tokens(plan, tokens) * mcfg.top_k
    return moe_step.expert_load(as_shape(mcfg), rows, plan.ep)


def expert_wait_flops(mcfg: ModelConfig, plan: ParallelPlan, tokens: float,
                      load: float) -> float:
    """FLOPs the busiest ep rank's experts compute beyond the mean rank's in an MoE block
    on ``tokens`` tokens, at ``load`` (its rows over the mean: :func:`expert_load`, or
    the run's routing, :func:`expert_load_from_routing`): the critical path waits for
    them, the CPU work does not hold them (the other ranks compute that much less)."""
    routed = routed_tokens(plan, tokens)
    extra = (load - 1.0) * mcfg.top_k * as_shape(mcfg).expert_params()
    return _redo(plan) * 6.0 * routed * extra


def _redo(plan: ParallelPlan) -> float:
    return 4 / 3 if plan.recompute == "full" else 1.0


def cp_block_s(mcfg: ModelConfig, plan: ParallelPlan, seqs_mb: float, tokens_mb: float,
               rate: float, hw: Hardware, elem: int) -> tuple[float, float]:
    """(seconds, exposed seconds) of one block's CP exchange for one micro-batch of
    ``seqs_mb`` sequences (``tokens_mb`` = the rank's T/cp tokens of each): forward,
    backward and, under recompute, the forward again; the ring hides each K/V hop under
    the block's attention on its tp shard of the heads, all-to-all hides nothing."""
    if plan.cp == 1:
        return 0.0, 0.0
    fwd, bwd = ct.cp_s(mcfg, plan, mcfg.context, seqs_mb, hw, 1.0, 1.0, elem)
    bwd += fwd if plan.recompute != "none" else 0.0
    # forward score and value matmuls of one block: a third of the per-layer attention
    # FLOPs, which count forward + backward
    attn = as_shape(mcfg).attention_flops_per_token(mcfg.context) / 3 / mcfg.n_layers
    attn_s = tokens_mb * attn / plan.tp / rate
    return fwd + bwd, ct.cp_exposed_s(fwd, bwd, attn_s, plan.cp_algorithm)


def cp_calls(plan: ParallelPlan, wire: float, blocks: int) -> list[tuple[str, float, int]]:
    """The CP transfers of a step, for their CPU cost: per block and micro-batch, the ring
    sends K/V out and back and the gradients home (:func:`paratrain.cost.cp_bytes.
    ring_hops` point-to-point hops);
    all-to-all is 2 x :data:`paratrain.cost.cp_bytes.A2A_EXCHANGES` collective calls
    (q, k, v and the output, forward and backward), each of its payload's share."""
    if plan.cp == 1 or not wire:
        return []
    m = plan.micro_batches * blocks
    if plan.cp_algorithm == "ring":
        n = m * ring_hops(plan)
        return [("p2p", wire / n, n)]
    n = m * 2 * A2A_EXCHANGES  # each call's payload: what it sends over the share it sends
    return [("all_to_all", wire / n / coll.wire_bytes("all_to_all", "naive", plan.cp, 1.0), n)]


def ep_rows_uniform(mcfg: ModelConfig, plan: ParallelPlan, tokens_mb: float) -> float:
    """Rows one rank sends in a dispatch (and, in expectation, receives) per MoE layer
    and micro-batch under uniform routing: (ep - 1) / ep of the tokens it routes
    (:func:`routed_tokens`) x top_k."""
    return coll.wire_bytes("all_to_all", "naive", plan.ep,
                           routed_tokens(plan, tokens_mb) * mcfg.top_k)


def ep_rows_from_load(plan: ParallelPlan, experts: int, load_by_rank: list[list[int]],
                      dp_rank: int = 0) -> tuple[int, int]:
    """(rows sent, rows received) in a step's dispatches by the ranks of data rank
    ``dp_rank``, from the run's routing (``moe_load_by_rank``: per data rank the
    assignments it routed to each expert, summed over layers and micro-batches). Its ep
    group is ep consecutive data ranks; ep index j holds experts [j E/ep, (j+1) E/ep)."""
    ep, El = plan.ep, experts // plan.ep
    g0, j = dp_rank - dp_rank % ep, dp_rank % ep
    mine = range(j * El, (j + 1) * El)
    sent = sum(n for e, n in enumerate(load_by_rank[dp_rank]) if e not in mine)
    recv = sum(load_by_rank[d][e] for d in range(g0, g0 + ep) if d != dp_rank for e in mine)
    return sent, recv


def expert_load_from_routing(plan: ParallelPlan, experts: int,
                             load_by_rank: list[list[int]]) -> float:
    """The busiest ep rank's expert rows over the mean in a step, from the run's routing
    (``moe_load_by_rank``, as :func:`ep_rows_from_load` reads it): the rows every ep
    group (ep consecutive data ranks) sends each of its ranks' experts. Summed over the
    step's layers, so a layer-by-layer imbalance that changes rank is only partly seen."""
    ep, El = plan.ep, experts // plan.ep
    rows = [sum(load_by_rank[d][e] for d in range(g, g + ep) for e in range(j * El, (j + 1) * El))
            for g in range(0, len(load_by_rank) - ep + 1, ep) for j in range(ep)]
    mean = sum(rows) / len(rows) if rows else 0.0
    return max(rows) / mean if mean > 0 else 1.0


def ep_wire_bytes(mcfg: ModelConfig, plan: ParallelPlan, elem: int, sent: float,
                  recv: float, layer_passes: int) -> float:
    """Bytes one rank sends in a step's MoE all-to-alls (:class:`paratrain.parallel.
    expert.ExpertExchange`): forward, its ``sent`` rows out and the ``recv`` rows' outputs
    back; backward, the reverse of each (the same rows again); full recompute reruns the
    forward. Each forward pass of a layer (``layer_passes`` = MoE layers x micro-batches)
    first exchanges the (ep - 1) x E/ep int64 split sizes."""
    if plan.ep == 1:
        return 0.0
    runs = 2 if plan.recompute == "full" else 1
    counts = (plan.ep - 1) * (mcfg.experts // plan.ep) * COUNT_BYTES
    return (sent + recv) * mcfg.d_model * elem * (runs + 1) + layer_passes * runs * counts


def ep_exchanges(plan: ParallelPlan) -> tuple[int, int]:
    """(row all-to-alls, split-size all-to-alls) of one MoE layer and micro-batch: the
    dispatch and combine forward and their gradients backward (4), with full recompute
    the forward's two again (6); the split sizes once per forward (1, or 2)."""
    runs = 2 if plan.recompute == "full" else 1
    return 2 * runs + 2, runs


def ep_bursts(plan: ParallelPlan) -> int:
    """Of :func:`ep_exchanges`' calls, the groups issued back to back (one wait for the
    peers, :func:`paratrain.predict.sched.sync_units`): per forward the split sizes and
    the dispatch (only the sizes' sums between), then the combine after the experts;
    backward the combine's and the dispatch's gradients, each after compute."""
    rows, _ = ep_exchanges(plan)
    return rows


def ep_block_s(mcfg: ModelConfig, plan: ParallelPlan, tokens_mb: float, hw: Hardware,
               elem: int) -> float:
    """Seconds of one MoE layer's all-to-alls for one micro-batch (:func:`ep_exchanges`:
    the rows' and the split sizes'), exposed: the experts wait for the dispatch, the
    residual for the combine."""
    if plan.ep == 1:
        return 0.0
    rows = routed_tokens(plan, tokens_mb) * mcfg.top_k
    row_calls, count_calls = ep_exchanges(plan)
    counts = mcfg.experts * COUNT_BYTES
    return (row_calls * ct.ep_s(plan, rows * mcfg.d_model * elem, hw, 1.0, 1.0)
            + count_calls * ct.ep_s(plan, counts, hw, 1.0, 1.0))


def ep_calls(plan: ParallelPlan, wire: float, layer_passes: int
             ) -> list[tuple[str, float, int]]:
    """The EP all-to-alls of a step (:func:`ep_exchanges` per layer pass), collective
    calls for their CPU cost: the rows' (``wire``: the bytes they send, spread evenly)
    and the split sizes' (bytes too few to count)."""
    if plan.ep == 1 or not wire:
        return []
    rows, counts = (k * layer_passes for k in ep_exchanges(plan))
    payload = wire / rows / coll.wire_bytes("all_to_all", "naive", plan.ep, 1.0)
    return [("all_to_all", payload, rows),
            ("all_to_all", 0.0, counts)]
