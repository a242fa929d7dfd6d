"""Each parallel axis' communication time per micro-batch or step, at achieved bandwidths.

Achieved bandwidth of a group (:func:`group_bw`): inside one node, the NVLink/ICI link x
``nvlink_eff`` (on a fully connected node without a switch, one link per peer of the
group: :meth:`paratrain.cost.hardware.Hardware.intra_group_bw`). Across nodes NCCL builds
its rings over every NIC the group's GPUs own (each GPU of a DGX/HGX node has its own
NIC), so a group with g members per node moves g x the per-GPU network bandwidth x
``net_eff`` across each node boundary, and never more than its NVLink hops carry. A ring
across nodes pays the network's latency only on the hops that cross a node boundary (n of
its p hops for a group on n nodes) and NVLink's on the others (:func:`ring_bw`), as NCCL's
own tuning model prices a ring (its ``nInterSteps``: about 2 n network steps for an all-
reduce, the rest at the intra-node latency): a flat ring charging 2 (p - 1) network
latencies makes a 1024-rank gradient sync 8x too latency-bound. Times are the alpha-beta
forms of :mod:`paratrain.cost.collectives` (ring steps x latency + bytes / bandwidth);
wire bytes come from the homes that count them for the runtime
(:mod:`paratrain.cost.tp_bytes`, :mod:`paratrain.cost.cp_bytes`).
"""

from __future__ import annotations

import functools

from paratrain.cost import collectives as coll
from paratrain.cost.cp_bytes import A2A_EXCHANGES, cp_bytes_per_sequence_layer
from paratrain.cost.groups import span, strides
from paratrain.cost.hardware import Hardware
from paratrain.cost.shapes import ModelShape
from paratrain.cost.tp_bytes import tp_forward_backward
from paratrain.plan import ParallelPlan


def group_bw(plan: ParallelPlan, axis: str, size: int, hw: Hardware, nvlink_eff: float,
             net_eff: float) -> tuple[float, float]:
    """(alpha_s, achieved bytes/s per rank) of an ``axis`` group of ``size`` ranks."""
    return strided_bw(strides(plan)[axis], size, hw, nvlink_eff, net_eff)


def strided_bw(stride: int, size: int, hw: Hardware, nvlink_eff: float, net_eff: float
               ) -> tuple[float, float]:
    """(alpha_s, achieved bytes/s per rank) of ``size`` ranks ``stride`` apart."""
    if span(size, stride) <= hw.gpus_per_node:
        return hw.intra_alpha, hw.intra_group_bw(size) * nvlink_eff
    g = max(1, min(size, hw.gpus_per_node // stride))
    bw = min(g * hw.inter_bw * net_eff,
             hw.intra_group_bw(g) * nvlink_eff if g > 1 else float("inf"))
    return hw.inter_alpha, bw


def ring_bw(stride: int, size: int, hw: Hardware, nvlink_eff: float, net_eff: float
            ) -> tuple[float, float]:
    """(per-step alpha_s, achieved bytes/s per rank) of a ring over ``size`` ranks
    ``stride`` apart (:func:`strided_bw`), its alpha the hop-weighted mean of the two
    links' latencies: a group with g members per node crosses a node boundary on 1 / g of
    its hops."""
    alpha, bw = strided_bw(stride, size, hw, nvlink_eff, net_eff)
    if alpha == hw.intra_alpha:
        return alpha, bw
    g = max(1, min(size, hw.gpus_per_node // stride))
    return hw.inter_alpha / g + hw.intra_alpha * (1 - 1 / g), bw


def ring_s(op: str, p: int, payload: float, alpha: float, bw: float) -> float:
    return coll.time_s(op, "ring", p, payload, alpha, bw) if p > 1 else 0.0


def tp_s(plan: ParallelPlan, act_bytes: float, hw: Hardware, nvlink_eff: float,
         net_eff: float) -> float:
    """Tensor-parallel time per block per micro-batch: the runtime's count of
    all-reduce-sized transfers (:func:`tp_forward_backward`) of the block's activations."""
    if plan.tp == 1:
        return 0.0
    a, bw = group_bw(plan, "tp", plan.tp, hw, nvlink_eff, net_eff)
    return sum(tp_forward_backward(plan.recompute)) * ring_s("all_reduce", plan.tp,
                                                             act_bytes, a, bw)


def pp_send_s(plan: ParallelPlan, act_bytes: float, hw: Hardware, nvlink_eff: float,
              net_eff: float, kernel_s: float, split: bool = True) -> float:
    """One activation (or gradient) send between neighbouring stages: latency, a launch
    and 1/tp of the activations when the engine splits them over the tensor-parallel
    ranks (scatter/gather, Narayanan et al. 2021), else all of them from every rank."""
    if plan.pp == 1:
        return 0.0
    stride = strides(plan)["pp"]
    if stride < hw.gpus_per_node and span(2, stride) <= hw.gpus_per_node:
        a, bw = hw.intra_alpha, hw.intra_bw * nvlink_eff
    else:
        a, bw = hw.inter_alpha, hw.inter_bw * net_eff
    return a + kernel_s + act_bytes / (plan.tp if split else 1) / bw


def cp_s(m: ModelShape, plan: ParallelPlan, seq_len: int, micro_batch: int, hw: Hardware,
         nvlink_eff: float, net_eff: float, elem: int = 2, kernel_s: float = 0.0
         ) -> tuple[float, float]:
    """(forward, backward) seconds of one block's context-parallel exchange for a
    micro-batch: the runtime's bytes (:func:`cp_bytes_per_sequence_layer`, ring or
    all-to-all), plus one latency and one launch per ring hop (each ring step also
    launches its block's attention kernel: two launches a hop) or, all-to-all, per peer
    of each of the :data:`A2A_EXCHANGES` exchanges a direction makes."""
    if plan.cp == 1:
        return 0.0, 0.0
    fwd, bwd = cp_bytes_per_sequence_layer(_at_context(m, seq_len), plan, elem)
    a, bw = group_bw(plan, "cp", plan.cp, hw, nvlink_eff, net_eff)
    hops = plan.cp - 1
    if plan.cp_algorithm != "ring":
        lat = A2A_EXCHANGES * hops * (a + kernel_s)
        return lat + micro_batch * fwd / bw, lat + micro_batch * bwd / bw
    step = a + 2 * kernel_s
    return hops * step + micro_batch * fwd / bw, 2 * hops * step + micro_batch * bwd / bw


@functools.lru_cache(maxsize=256)
def _at_context(m: ModelShape, seq_len: int) -> ModelShape:
    """``m`` at a context of ``seq_len`` (cached: the layout search prices one model at
    one sequence length hundreds of thousands of times)."""
    return m if m.context == seq_len else m.replace(context=seq_len)


def ep_s(plan: ParallelPlan, routed_bytes: float, hw: Hardware, nvlink_eff: float,
         net_eff: float) -> float:
    """One all-to-all of the ``routed_bytes`` each rank holds (dispatch or combine)."""
    if plan.ep == 1:
        return 0.0
    a, bw = group_bw(plan, "ep", plan.ep, hw, nvlink_eff, net_eff)
    return coll.time_s("all_to_all", "naive", plan.ep, routed_bytes, a, bw)


def cp_exposed_s(fwd_s: float, bwd_s: float, attn_fwd_s: float, algorithm: str,
                 overlap: float = 1.0) -> float:
    """CP exchange seconds a block's compute does not hide: the ring's next K/V transfer
    runs under the current block's attention (backward: 2.5x the forward's work), scaled
    by the engine's ``overlap`` (0 none, 1 full); all-to-all sits between the projections
    and the attention, exposed."""
    if algorithm != "ring":
        return fwd_s + bwd_s
    return (max(0.0, fwd_s - overlap * attn_fwd_s)
            + max(0.0, bwd_s - overlap * 2.5 * attn_fwd_s))
