"""One MoE layer on one rank as the engines run it: expert GEMMs, permutation, dispatch.

The layout is the plan's (:mod:`paratrain.cost.moe_layout`): E / ep experts per rank,
each split over etp ranks, fed the tokens of its etp group. For a micro-batch of M
tokens on a rank (T / cp of each sequence), t = M / tp routed by this rank with SP (M
without), u = t etp with SP (t without) seen by an expert shard, k = top_k, h = d_model,
f the expert width, e the element size:

=================  =======================================================  ============
part               what it does                                             priced as
=================  =======================================================  ============
router             t x h by h x E                                           a GEMM
experts            E / ep GEMMs of mu = u k ep / E rows each, x the         the GEMM
                   expected busiest expert 1 + sqrt(2 ln E / mu)            model on the
                   (:func:`expert_imbalance`; under a capacity,             per-expert
                   :func:`expert_load`): the grouped GEMM of many small     shape
                   experts runs at each expert's (small) shape's
                   efficiency
shared experts     u x h by h x S f / etp (and back)                        a GEMM
permutation        the routed rows gathered into expert order and back      4 h k rows
                   (read and written): t k rows, u k with all-gather        at HBM speed
dispatch/combine   alltoall: the t k routed rows (x the busiest rank's      alpha-beta
                   excess) over the ep group, then (SP, etp > 1) an         (cost.
                   all-gather / reduce-scatter of the u k rows over etp;    collectives)
                   allgather: all tokens of the ep x etp group gathered
                   (t h each), each rank keeping its experts' rows, and
                   the outputs reduce-scattered back
=================  =======================================================  ============

The dispatcher is the engine's (:class:`paratrain.systems.overlap.Engine.dispatcher`,
Megatron-Core's ``moe_token_dispatcher_type``): ``allgather`` moves about ep etp / k times
the alltoall's bytes, so it wins only on small groups (ep etp <= k; it is what Megatron-LM
runs by default);
``alltoall`` is what the MoE recipes of NeMo, DeepSeek and torchtitan (and paratrain's
runtime) run. Each is four collectives a layer (dispatch and combine, forward and
backward), six with full recompute. An all-to-all that leaves the node is priced at the
rank's own NIC for its off-node share (:func:`all_to_all_s`).

``flex`` is Megatron-Core's dispatcher over DeepEP or HybridEP: inside a node the same
bytes as ``alltoall``, but across nodes a token crosses the network once per node that
holds any of its experts, to the rank of the same local index there, which forwards it
over NVLink to the experts' ranks (and the combine reduces within the node before
sending back): DeepSeek-V3's report (arXiv:2412.19437, section 3.2.2) and DeepEP's
README. So the off-node bytes are a token's expected distinct remote nodes, not its
remote experts (:func:`node_dedup`): for Qwen3-235B's top 8 of 128 experts over four
nodes, 2.7 remote copies where ``alltoall`` sends 6. The NVLink leg keeps the
``alltoall`` count (the forwarding runs beside the network leg, which bounds the time).
"""

from __future__ import annotations

import math

from paratrain.cost import moe_layout
from paratrain.cost.groups import span
from paratrain.cost.hardware import Hardware
from paratrain.cost.shapes import ModelShape
from paratrain.plan import ParallelPlan
from paratrain.systems import comm_time as ct

DISPATCHERS = ("alltoall", "allgather", "flex")
# elements per routed row and hidden unit through HBM: the permutation reads and writes
# each row (h), and so does the un-permutation after the combine
PERMUTE_ELEMS_PER_ROW = 4


# Kernels an MoE layer launches in its forward beyond a dense block's (backward: twice as
# many), as Megatron-Core's alltoall dispatcher and TE grouped MLP run it: the router (the
# gating GEMM, softmax or sigmoid, top-k, the load-balancing loss's reductions), the
# dispatcher's bookkeeping (tokens per expert, the device-to-host copy of the all-to-all's
# split sizes, which stalls the launch queue), the permutation and the unpermutation, the
# sort of the received chunks by local expert, the all-to-alls; and per local expert, the
# fc1 and fc2 GEMMs a grouped linear layer launches one by one. Priced at the fitted cost
# per kernel, like the dense block's: on fine-grained MoE (Qwen3-30B-A3B, 128 experts of
# 768) a micro-batch's layer is a few milliseconds of GEMMs and these launches are most of
# what is left (docs/systems-model.md, "MoE layers' fixed costs").
MOE_KERNELS_FWD = 40
MOE_KERNELS_PER_LOCAL_EXPERT = 2
# of MOE_KERNELS_FWD, the router's (gating GEMM, score function, top-k, the routing map,
# the balancing loss's reductions) and the dispatcher's bookkeeping before the exchange
# (tokens per expert, their exchange over the ep group, the split sizes): what the
# ``moe_router`` and ``moe_preprocess`` CUDA graph scopes replay (systems.graph_scopes)
MOE_ROUTER_KERNELS_FWD = 12
MOE_PREPROCESS_KERNELS_FWD = 8
# The flex dispatcher's share of a NIC's bandwidth across nodes: DeepEP's README measures
# its normal (training) kernels at 43, 58 and 51 GB/s of RDMA per GPU dispatching over 16,
# 32 and 64 ranks, and 43, 57, 50 GB/s combining, on H800 with one 400 Gb/s (~50 GB/s)
# ConnectX-7 NIC per GPU: 50.3 GB/s on average, the line rate. Its kernels drive the NIC
# from the GPU (NVSHMEM, IBGDA) with no proxy thread or ring protocol between, so the
# fitted efficiency of NCCL's collectives (``StepParams.net_eff``) is not theirs; with it,
# DeepSeek-V3 on 1024 H100 was priced 19% slow (docs/systems-model.md, stop 54).
FLEX_NET_EFF = 1.0


def moe_kernels(m: ModelShape, ep: int) -> int:
    """Forward kernels of one MoE layer on a rank beyond a dense block's
    (:data:`MOE_KERNELS_FWD`, :data:`MOE_KERNELS_PER_LOCAL_EXPERT` per local expert)."""
    return MOE_KERNELS_FWD + MOE_KERNELS_PER_LOCAL_EXPERT * max(1, m.experts // ep)


def expert_imbalance(tokens_per_expert: float, experts: int) -> float:
    """Expected busiest expert over the mean: the largest of E counts of mean mu,
    mu + sqrt(2 mu ln E) (Gaussian extreme, a balanced router's spread)."""
    if experts <= 1 or tokens_per_expert <= 0:
        return 1.0
    return 1.0 + math.sqrt(2.0 * math.log(experts) / tokens_per_expert)


def expert_load(m: ModelShape, rows_per_expert: float, experts: int) -> float:
    """Rows the busiest of ``experts`` computes (or sends) over the mean of
    ``rows_per_expert``: a balanced router's spread (:func:`expert_imbalance`), cut at the
    capacity factor where the model drops tokens beyond it, and exactly the capacity
    factor where every expert's input is padded to its capacity
    (``ModelShape.pad_to_capacity``: its GEMMs and its exchange carry the empty slots)."""
    cap = m.capacity_factor
    if cap > 0 and m.pad_to_capacity:
        return cap
    spread = expert_imbalance(rows_per_expert, experts)
    return min(spread, cap) if cap > 0 else spread


def check_dispatcher(name: str) -> str:
    """``name`` if it is a dispatcher, else one ValueError line naming the choices."""
    if name not in DISPATCHERS:
        raise ValueError(f"dispatcher {name!r} is unknown; choose one of "
                         f"{', '.join(DISPATCHERS)}")
    return name


def moe_mlp(m: ModelShape, M: int, tp: int, sp: bool, ep: int, etp: int, lin,
            dispatcher: str = "alltoall") -> float:
    """Price one MoE MLP's GEMMs through ``lin(class, N, K, rows, count)`` (the block's
    GEMM accumulator) and return its element-wise elements (expert activation and
    permutation) per token of the micro-batch's M."""
    E, k, fe, d = m.experts, m.top_k, m.expert_ffn, m.d_model
    up = m.mlp_up_matrices
    t = moe_layout.routed_tokens(M, tp, sp)
    u = moe_layout.expert_group_tokens(M, tp, sp, etp)
    lin("router", E, d, max(1, round(t)))
    per_expert = u * k * ep / E
    imb = expert_load(m, per_expert, E)
    rows = max(1, round(per_expert * imb))
    lin("experts", up * fe // etp, d, rows, E // ep)
    lin("experts", d, fe // etp, rows, E // ep)
    if m.shared_experts:
        lin("mlp", up * m.shared_experts * fe // etp, d, max(1, round(u)))
        lin("mlp", d, m.shared_experts * fe // etp, max(1, round(u)))
    act = (up + 1) * fe / etp * u * k * imb  # the experts' activation, over its rows
    moved = u if dispatcher == "allgather" else t
    return (act + PERMUTE_ELEMS_PER_ROW * d * k * moved) / M


def dispatch_payloads(m: ModelShape, plan: ParallelPlan, M: int, dispatcher: str,
                      elem: float = 2.0) -> dict:
    """Bytes of one dispatch (the combine moves the same) per rank, by collective:
    ``all_to_all`` (what each rank holds before the ep group's exchange: its t k rows,
    x the busiest rank's expected excess), ``etp_all_gather`` (the full u k rows of the
    etp group, SP only) or ``all_gather`` (allgather: the full vector of the ep x etp
    group's tokens)."""
    check_dispatcher(dispatcher)
    t = moe_layout.routed_tokens(M, plan.tp, plan.sp)
    u = moe_layout.expert_group_tokens(M, plan.tp, plan.sp, plan.etp)
    h, k = m.d_model, m.top_k
    if dispatcher == "allgather":
        return {"all_gather": plan.ep * plan.etp * t * h * elem}
    a2a = t * k * h * elem * expert_load(m, t * k, plan.ep) if plan.ep > 1 else 0.0
    out = {"all_to_all": a2a}
    if plan.sp and plan.etp > 1:
        out["etp_all_gather"] = u * k * h * elem
    return out


def node_dedup(experts: int, top_k: int, nodes: int) -> float:
    """The ``flex`` dispatcher's off-node bytes over ``alltoall``'s (module docstring):
    a token's expected remote nodes holding any of its ``top_k`` experts (chosen without
    replacement from ``experts`` spread evenly over ``nodes``), over its expected remote
    experts, top_k (nodes - 1) / nodes."""
    if nodes <= 1 or top_k <= 1:
        return 1.0
    per_node = experts / nodes
    miss = math.comb(round(experts - per_node), top_k) / math.comb(experts, top_k)
    return nodes * (1.0 - miss) / top_k


def all_to_all_s(plan: ParallelPlan, payload: float, hw: Hardware, nvlink_eff: float,
                 net_eff: float, routing: tuple[int, int] | None = None) -> float:
    """One all-to-all over the ep group of the ``payload`` each rank holds (it keeps
    1 / ep). Inside a node: pairwise over NVLink (:func:`paratrain.systems.comm_time.
    ep_s`). Across nodes every GPU of a node is in some ep group at once, so a rank's
    off-node share, (ep - g) / ep with g members per node, leaves through its own NIC
    (not g NICs, as a ring's would), while the rest crosses NVLink beside it;
    ``routing`` = (experts, top_k) sends each token once per node (the ``flex``
    dispatcher: :func:`node_dedup` scales the off-node share) at
    :data:`FLEX_NET_EFF` of the NIC, not the fitted ``net_eff`` of NCCL's collectives."""
    if plan.ep == 1:
        return 0.0
    stride, p = moe_layout.ep_stride(plan), plan.ep
    if span(p, stride) <= hw.gpus_per_node:
        return ct.ep_s(plan, payload, hw, nvlink_eff, net_eff)
    g = max(1, min(p, hw.gpus_per_node // stride))
    eff, dedup = ((net_eff, 1.0) if routing is None
                  else (FLEX_NET_EFF, node_dedup(*routing, p // g)))
    off = payload * (p - g) / p / (hw.inter_bw * eff) * dedup
    on = payload * (g - 1) / p / (hw.intra_group_bw(g) * nvlink_eff)
    return (p - 1) * hw.inter_alpha + max(off, on)


def dispatch_s(m: ModelShape, plan: ParallelPlan, M: int, hw: Hardware, nvlink_eff: float,
               net_eff: float, dispatcher: str) -> float:
    """Seconds of one dispatch (or combine) on a rank, from :func:`dispatch_payloads`."""
    pay = dispatch_payloads(m, plan, M, dispatcher)
    routing = (m.experts, m.top_k) if dispatcher == "flex" else None
    s = all_to_all_s(plan, pay.get("all_to_all", 0.0), hw, nvlink_eff, net_eff, routing)
    if "etp_all_gather" in pay:  # etp innermost: consecutive ranks
        a, bw = ct.strided_bw(1, plan.etp, hw, nvlink_eff, net_eff)
        s += ct.ring_s("all_gather", plan.etp, pay["etp_all_gather"], a, bw)
    if "all_gather" in pay:
        size = plan.ep * plan.etp
        stride = moe_layout.ep_stride(plan) if plan.etp == 1 else 1
        a, bw = ct.strided_bw(stride, size, hw, nvlink_eff, net_eff)
        s += ct.ring_s("all_gather", size, pay["all_gather"], a, bw)
    return s


def moe_comm_s(m: ModelShape, plan: ParallelPlan, M: int, hw: Hardware, nvlink_eff: float,
               net_eff: float, dispatcher: str, rerun: bool = False) -> float:
    """Seconds of an MoE layer's dispatches and combines for one micro-batch: four
    (forward and backward), six when the backward reruns the layer (``rerun``: full
    recompute, or a recompute of the ``moe`` module); none when nothing leaves the rank."""
    if not m.is_moe or plan.ep * plan.etp == 1:
        return 0.0
    n = 4 + (2 if rerun else 0)
    return n * dispatch_s(m, plan, M, hw, nvlink_eff, net_eff, dispatcher)
