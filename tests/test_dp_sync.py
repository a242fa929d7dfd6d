"""Data-parallel sync as NCCL and the engines run it (issue 22, items 5 and 6): a ring's
network latency only at node boundaries, a last bucket nothing hides and a latency per
bucket, FSDP's first gather and last reduce-scatter per micro-batch, the overlap tax on
what does hide, and InternEvo's all-reduce-then-broadcast ZeRO-1."""

from __future__ import annotations

import dataclasses

import pytest

from paratrain.cost import collectives as coll
from paratrain.cost.hardware import load_hardware
from paratrain.cost.memory import params_per_gpu
from paratrain.cost.shapes import load_model
from paratrain.plan import ParallelPlan
from paratrain.systems import comm_time as ct
from paratrain.systems.overlap import ENGINES
from paratrain.systems.step_model import predict_step
from paratrain.systems.step_params import StepParams

H100 = load_hardware("h100")
P = StepParams()


def test_a_ring_across_nodes_pays_the_network_latency_only_at_node_boundaries():
    """NCCL's tuning model: of a ring's hops over g ranks per node, 1 / g cross a node
    boundary; the rest are NVLink hops. A flat ring would charge every hop the network's
    latency: 8x too much at 1024 ranks, 8 per node."""
    a, bw = ct.ring_bw(1, 1024, H100, P.nvlink_eff, P.net_eff)
    assert a == pytest.approx(H100.inter_alpha / 8 + H100.intra_alpha * 7 / 8)
    assert bw == ct.strided_bw(1, 1024, H100, P.nvlink_eff, P.net_eff)[1]
    flat = coll.time_s("all_reduce", "ring", 1024, 0.0, H100.inter_alpha, bw)
    assert ct.ring_s("all_reduce", 1024, 0.0, a, bw) < 0.5 * flat
    # one rank per node (dp strided over tp 8): every hop crosses the network
    assert ct.ring_bw(8, 128, H100, P.nvlink_eff, P.net_eff)[0] == H100.inter_alpha
    # inside one node nothing changes
    assert ct.ring_bw(1, 8, H100, P.nvlink_eff, P.net_eff) == ct.strided_bw(
        1, 8, H100, P.nvlink_eff, P.net_eff)


def _dp(model, plan, tokens, seq, engine="megatron", params=P):
    return predict_step(model, plan, H100, tokens, seq, params, engine)


def test_one_micro_batch_always_exposes_the_last_bucket():
    """The first layers' gradients are ready only when the backward ends, so even a
    backward far longer than the all-reduce leaves one bucket's collective exposed."""
    m = load_model("llama3-8b")
    untaxed = dataclasses.replace(P, overlap_tax=0.0)
    plan = ParallelPlan(dp=64, micro_batches=1)
    b = _dp(m, plan, 64 * 8 * 8192, 8192, params=untaxed)  # 64K tokens per GPU: long bwd
    bucket = 2.0 * ENGINES["megatron"].bucket(64, plan.bucket_mb * 1e6 / 2.0)
    assert bucket == 128e6  # Megatron-Core's max(40M, 1M x dp) parameters, 2 bytes each
    a, bw = ct.ring_bw(1, 64, H100, P.nvlink_eff, P.net_eff)
    tail = ct.ring_s("all_reduce", 64, bucket, a, bw)
    assert b.exposed["dp"] == pytest.approx(tail)
    assert b.comm["dp"] > 20 * tail  # the rest hid under the backward


def test_fsdp_pays_a_fixed_gather_per_micro_batch_that_long_ones_amortise():
    """FSDP with gradient accumulation re-gathers every micro-batch; the first block's
    gather and the last block's reduce-scatter hide under nothing, so the exposed sync
    grows with the micro-batch count at a fixed batch, and the cost per token falls as
    the micro-batches get longer."""
    m = load_model("llama2-13b")
    seq, gpus = 2048, 64
    exposed, per_token = {}, {}
    for mb in (1, 4, 16):
        plan = ParallelPlan(dp=gpus, zero=3, micro_batches=mb)
        b = _dp(m, plan, gpus * 16 * seq, seq, "fsdp")
        exposed[mb] = b.exposed["dp"]
        per_token[mb] = b.step_s
    assert exposed[1] > 0 and exposed[4] > 2 * exposed[1] and exposed[16] > 2 * exposed[4]
    assert per_token[1] < per_token[4] < per_token[16]


def test_overlap_is_taxed_at_the_fixed_share_of_what_hides():
    m = load_model("llama3-8b")
    plan = ParallelPlan(dp=64, micro_batches=1)
    tokens, seq = 64 * 8 * 8192, 8192
    free = _dp(m, plan, tokens, seq, params=dataclasses.replace(P, overlap_tax=0.0))
    taxed = _dp(m, plan, tokens, seq)
    hidden = free.comm["dp"] - free.exposed["dp"]
    assert taxed.exposed["dp"] - free.exposed["dp"] == pytest.approx(P.overlap_tax * hidden)
    assert taxed.step_s - free.step_s == pytest.approx(P.overlap_tax * hidden)


def test_colossal_ai_lineage_zero1_all_reduces_then_broadcasts_in_the_open():
    """InternEvo's ZeRO-1 (``Engine.zero1_broadcast``) all-reduces the gradients over the
    data group and broadcasts each rank's shard after the step, nothing beside it; the
    distributed optimizer reduce-scatters and gathers under the next forward."""
    m = load_model("llama3-8b")
    ie = ENGINES["internevo"]
    assert ie.zero1_broadcast and not ENGINES["nemo"].zero1_broadcast and ie.zero == 1
    plan = ParallelPlan(dp=8, zero=1, micro_batches=4)
    b = predict_step(m, plan, H100, 8 * 4 * 4096, 4096, P, ie)
    mcore = predict_step(m, plan, H100, 8 * 4 * 4096, 4096, P,  # one bucket: one of each
                         dataclasses.replace(ENGINES["megatron"], bucket_params=1e12))
    n = 2.0 * params_per_gpu(m, plan).total  # bf16 weights and gradients, one NVLink ring
    a, bw = H100.intra_alpha, H100.intra_bw * P.nvlink_eff
    ar = coll.time_s("all_reduce", "ring", 8, n, a, bw)
    ag = coll.time_s("all_gather", "ring", 8, n, a, bw) + 8 * P.kernel_s
    n_b = -(-n // (512 * 2**20 * 2))  # 512 Mi-element buckets, each its own all-reduce
    ar += (n_b - 1) * coll.time_s("all_reduce", "ring", 8, 0.0, a, bw)
    assert b.comm["dp"] == pytest.approx(ar + ag, rel=1e-9)
    assert b.exposed["dp"] >= ag  # the broadcasts wait for nothing to hide under
    rs = coll.time_s("reduce_scatter", "ring", 8, n, a, bw)
    assert mcore.comm["dp"] == pytest.approx(rs + ag - 8 * P.kernel_s, rel=1e-9)


def test_each_gradient_bucket_pays_the_rings_latency_and_megatron_sizes_them_by_dp():
    """Megatron-Core's buckets hold max(40M, 1M x dp) parameters, so a 1,024-rank sync
    runs few of them; each is its own collective, latency and all."""
    e = ENGINES["megatron"]
    assert e.bucket(8, 12.5e6) == 40e6 and e.bucket(1024, 12.5e6) == 1024e6
    assert ENGINES["torchtitan"].bucket(8, 6.25e6) == 6.25e6  # the plan's
    m = load_model("llama3-8b")
    plan = ParallelPlan(dp=8, zero=0, micro_batches=4)
    b = predict_step(m, plan, H100, 8 * 4 * 4096, 4096, P, e)
    n = 2.0 * params_per_gpu(m, plan).total
    a, bw = H100.intra_alpha, H100.intra_bw * P.nvlink_eff
    n_b = -(-n // 80e6)
    assert n_b > 100
    want = coll.time_s("all_reduce", "ring", 8, n, a, bw) + (n_b - 1) * 14 * a
    assert b.comm["dp"] == pytest.approx(want, rel=1e-9)
