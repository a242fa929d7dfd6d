"""Data-parallel sync time: what each engine's gradient reductions and weight gathers
cost per step, and how much of it hides under compute.

Bucketed NCCL rings hide under the last micro-batch's backward (and the distributed
optimizer's all-gather under the next forward) except their last bucket; each bucket is
its own collective and pays the ring's latency, at the engine's bucket size
(``Engine.bucket``: Megatron-Core's max(40M, 1M x dp) parameters); ZeRO-3/FSDP
gathers go block by block, each hidden only under the previous block's compute, so the
first gather and the last reduce-scatter of each micro-batch hide under nothing; what
hides still pays the overlap tax (NCCL's SMs and HBM share). Hybrid sharding (HSDP,
InternEvo's ``zero1`` groups) shards over a group smaller than the data ranks.

Engines whose ZeRO-1 descends from Colossal-AI's low-level ZeRO (InternEvo:
``Engine.zero1_broadcast``) all-reduce every gradient bucket over the whole data group,
twice a reduce-scatter's bytes, and then broadcast each rank's updated shard to its
sharding group after the optimizer step, where nothing runs beside it: priced as the
all-gather those broadcasts add up to plus a launch each, all of it exposed. (What each
of 256-1,024 broadcasts costs beyond that, about 2.4 ms in InternEvo's table, is not priced:
docs/systems-model.md.)
"""

from __future__ import annotations

import math

from paratrain.cost.dp_bytes import grad_reductions
from paratrain.cost.hardware import Hardware
from paratrain.plan import ParallelPlan
from paratrain.systems import comm_time as ct
from paratrain.systems.overlap import COLLECTIVES_PER_BLOCK, Engine
from paratrain.systems.step_params import StepParams


def taxed(total: float, exposed: float, tax: float) -> float:
    """Exposed seconds of a transfer of ``total`` seconds of which ``exposed`` does not
    hide, plus ``tax`` of the part that does: overlap is not free, the collective's
    kernels occupy SMs (one per NCCL channel) and HBM bandwidth the overlapped compute
    would have used (``StepParams.overlap_tax``)."""
    return exposed + tax * max(0.0, total - exposed)


def _hidden(t: float, window: float, tail: float) -> float:
    """Seconds of a bucketed sync of ``t`` that a compute ``window`` does not hide: the
    buckets run under the window, but the last one (the first layers' gradients, ready
    only when the backward ends; or the first layers' weights, needed before the forward
    starts) waits for nothing to hide under, so at least ``tail`` is exposed."""
    return max(t - window, min(t, tail))


def _with_tail(op: str, d: int, payload: float, bucket: float, alpha: float, bw: float
               ) -> tuple[float, float]:
    """(the bucketed collective over d ranks, its last bucket alone): each bucket is its
    own collective and pays the ring's latency."""
    n_b = max(1, math.ceil(payload / bucket))
    return (ct.ring_s(op, d, payload, alpha, bw) + (n_b - 1) * ct.ring_s(op, d, 0.0, alpha, bw),
            ct.ring_s(op, d, min(bucket, payload), alpha, bw))


def dp_sync(plan: ParallelPlan, payloads, hw: Hardware, sp: StepParams, eng: Engine,
             blk_f: float, blk_b: float, blocks: int, stage_f: float, stage_b: float
             ) -> tuple[float, float]:
    """(total, exposed) data-parallel seconds per step; ``payloads``: (parameters, group
    size, sharding group size, global ranks between group members) for the dense and the
    expert ones, weights at 16 bits and gradients at ``Engine.reduce_bytes``, on NCCL's
    rings (:func:`.comm_time.ring_bw`)."""
    total = exposed = 0.0
    m = plan.micro_batches
    for n, d, shard, stride in payloads:
        if d == 1 or n == 0:
            continue
        per = eng.bucket(d, plan.bucket_mb * 1e6 / eng.reduce_bytes)  # parameters
        payload, grad = 2.0 * n, eng.reduce_bytes * n  # weights' bytes, gradients'
        w_bucket, g_bucket = 2.0 * per, eng.reduce_bytes * per
        if plan.zero == 1 and eng.zero1_broadcast:
            t, x = _broadcast_zero1(d, shard, stride, payload, grad, g_bucket, hw, sp, eng,
                                    stage_b)
            total, exposed = total + t, exposed + x
            continue
        if plan.zero >= 1 and shard < d:
            # hybrid sharding: ZeRO over ``shard`` neighbouring ranks, then the gradient
            # shards all-reduced across the d / shard replicas, under the backward
            a, bw = ct.ring_bw(stride * shard, d // shard, hw, sp.nvlink_eff, sp.net_eff)
            ar, tail = _with_tail("all_reduce", d // shard, grad / shard, g_bucket / shard, a, bw)
            total += ar
            exposed += _hidden(ar, eng.dp * stage_b, tail)
            d = shard
            if d == 1:
                continue
        a, bw = ct.ring_bw(stride, d, hw, sp.nvlink_eff, sp.net_eff)
        if plan.zero == 3 and plan.pp == 1:
            t, x = _zero3_gathers(d, payload, grad, blocks, a, bw, hw, sp, eng, blk_f, blk_b)
            total, exposed = total + m * t, exposed + m * x
            continue
        if plan.zero == 0:
            ar, tail = _with_tail("all_reduce", d, grad, g_bucket, a, bw)
            total += ar
            exposed += _hidden(ar, eng.dp * stage_b, tail)
            continue
        rs, rs_tail = _with_tail("reduce_scatter", d, grad, g_bucket, a, bw)
        ag, ag_tail = _with_tail("all_gather", d, payload, w_bucket, a, bw)
        # one of each per step (the distributed optimizer; ZeRO 2 and 3 under a pipeline,
        # whose stage keeps its weights and gradients whole over the step and syncs after
        # the last backward); ZeRO-2 without one reduce-scatters every micro-batch, each
        # under that micro-batch's backward (dp_bytes.grad_reductions)
        n_rs = grad_reductions(plan.zero, m, plan.pp > 1)
        total += n_rs * rs + ag
        exposed += (n_rs - 1) * max(0.0, rs - eng.dp * stage_b)
        # the reduce-scatter under the last backward, the gather under the next forward
        exposed += _hidden(rs, eng.dp * stage_b, rs_tail) + _hidden(ag, eng.dp * stage_f,
                                                                    ag_tail)
    return total, exposed


def _broadcast_zero1(d: int, shard: int, stride: int, payload: float, grad: float,
                     bucket: float, hw: Hardware, sp: StepParams, eng: Engine,
                     stage_b: float) -> tuple[float, float]:
    """(total, exposed) seconds of a Colossal-AI-lineage ZeRO-1 step
    (``Engine.zero1_broadcast``): every gradient bucket all-reduced over the ``d`` data
    ranks under the last backward, then each of the ``shard`` ranks of a sharding group
    broadcasts its updated weights to the group, one launch each, after the optimizer
    step with nothing to hide under: the bytes of the all-gather those add up to."""
    a, bw = ct.ring_bw(stride, d, hw, sp.nvlink_eff, sp.net_eff)
    ar, tail = _with_tail("all_reduce", d, grad, bucket, a, bw)
    a, bw = ct.ring_bw(stride, shard, hw, sp.nvlink_eff, sp.net_eff)
    bc = ct.ring_s("all_gather", shard, payload, a, bw) + shard * sp.kernel_s
    return ar + bc, _hidden(ar, eng.dp * stage_b, tail) + bc


def _zero3_gathers(d: int, payload: float, grad: float, blocks: int, a: float, bw: float,
                   hw: Hardware, sp: StepParams, eng: Engine, blk_f: float, blk_b: float
                   ) -> tuple[float, float]:
    """(total, exposed) seconds of one micro-batch's ZeRO-3/FSDP traffic: the blocks'
    weights (``payload``) gathered for the forward and the backward, their gradients
    (``grad``) reduce-scattered; the weights stay sharded between micro-batches. (Under a
    pipeline a stage gathers once a step and reduces once, after its last backward, as
    the runtime and PyTorch's pipelining run FSDP: :func:`dp_sync`.) Each gather hides under the
    previous block's compute, each reduce-scatter under the next block's backward, so the
    first block's forward gather and the last block's reduce-scatter have nothing to hide
    under: a fixed cost per micro-batch that short micro-batches cannot amortise."""
    n_coll = COLLECTIVES_PER_BLOCK[eng.gather]
    if eng.gather == "param" and a > hw.intra_alpha:
        # small per-submodule gathers run on one or two NCCL channels: one NIC's
        # bandwidth per node, not the node's aggregate
        bw = min(bw, hw.inter_bw * sp.net_eff)
    per = payload / blocks / n_coll
    ag = n_coll * (ct.ring_s("all_gather", d, per, a, bw) + sp.kernel_s)
    rs = n_coll * (ct.ring_s("reduce_scatter", d, grad / blocks / n_coll, a, bw) + sp.kernel_s)
    wait_f = blocks * max(0.0, ag - eng.dp * blk_f)  # gathers longer than a block
    wait_b = blocks * max(0.0, ag + rs - eng.dp * blk_b)
    first = min(ag, eng.dp * blk_f) + min(rs, eng.dp * blk_b)  # what those could not hide
    return blocks * (2 * ag + rs), wait_f + wait_b + first
