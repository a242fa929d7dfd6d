"""Context and expert parallelism in the one prediction (paratrain.predict.predict),
checked by hand against the counts' homes: CP ring exchange seconds and what the block
attention hides, all-to-all exposed, FLOPs split over cp ranks, alone and composed with
tp, sp, pp and dp; MoE active FLOPs and all-to-all bytes under uniform routing and from
a given routing, composed with tp and pp; exact model-state bytes. No wall-clock accuracy
is asserted (the benchmarks print that); the predicted == measured bytes of real runs are
in tests/test_predict.py."""

from __future__ import annotations

import math

import pytest

from conftest import TINY
from paratrain.config import TrainConfig
from paratrain.cost.hardware import Hardware
from paratrain.cost.layout import cp_wire_bytes, state_bytes
from paratrain.cost.run_figures import predicted_activations
from paratrain.cost.shapes import as_shape
from paratrain.plan import ParallelPlan
from paratrain.predict import MachineModel, predict
from paratrain.predict.axes import ep_rows_from_load, ep_wire_bytes

MODEL = TINY
MOE = MODEL.replace(experts=4, top_k=2, moe_ffn=64)
TC = TrainConfig(steps=2, global_batch=1, dtype="float32")
HW = Hardware("test-box", peak_flops=4e9, hbm_bytes=8e9, hbm_bw=1e10, gpus_per_node=4,
              intra_bw=1e9, intra_alpha=1e-4, inter_bw=1e9, inter_alpha=1e-4, eta=1.0)
MACHINE = MachineModel(HW, eta=0.5, thread_peak=1e9, pass_s=1e-3, step_s=2e-3, fitted=True)


def test_cp_ring_by_hand():
    one = predict(MODEL, TC, ParallelPlan(), 1, MACHINE)
    p = predict(MODEL, TC, ParallelPlan(cp=2), 2, MACHINE)
    assert math.isclose(p.compute_s, one.compute_s / 2)  # load balanced: T/cp tokens each
    # K and V of 8 tokens x 4 heads x 8 dims, float32: 2048 bytes a hop; forward 1 hop,
    # backward 1 hop of K/V + 2 of their gradients; a latency per hop (two backward)
    fwd, bwd = 1e-4 + 2048 / 1e9, 2e-4 + 6144 / 1e9
    assert math.isclose(p.cp_comm_s, 2 * (fwd + bwd))
    attn = 8 * 4 * 4 * 8 * 16 / 0.5e9  # forward attention FLOPs of a block / rate
    assert math.isclose(p.cp_exposed_s, 2 * ((fwd - attn) + (bwd - 2.5 * attn)))
    assert p.cp_wire_bytes == cp_wire_bytes(MODEL, ParallelPlan(cp=2), 4, 1, 2) == 2 * 8192
    # cp ranks reduce their gradients together, over dp x cp
    assert p.dp_comm_s > 0 and p.dp_wire_bytes > 0 and one.dp_comm_s == 0
    assert math.isclose(p.critical_path_s, p.compute_s + p.overhead_s + p.cp_exposed_s
                        + p.dp_exposed_s)
    assert p.step_s == max(p.critical_path_s, p.session_work_s / p.session_cores)
    assert p.activations_bytes == predicted_activations(MODEL, ParallelPlan(cp=2), TC)
    assert not any("not priced" in n for n in p.notes)
    a2a = predict(MODEL, TC, ParallelPlan(cp=2, cp_algorithm="all-to-all"), 2, MACHINE)
    assert a2a.cp_exposed_s == a2a.cp_comm_s > 0  # nothing hides the all-to-all


@pytest.mark.parametrize("plan", [ParallelPlan(tp=2, cp=2), ParallelPlan(tp=2, cp=2, sp=True),
                                  ParallelPlan(pp=2, cp=2, micro_batches=2),
                                  ParallelPlan(dp=2, cp=2, cp_algorithm="all-to-all")],
                         ids=["tp2 cp2", "tp2 cp2 sp", "pp2 cp2 m2", "dp2 cp2 a2a"])
def test_cp_composed_by_hand(plan):
    """cp halves every stage's tokens (FLOPs, TP and PP bytes) beside the same layout
    without it; CP bytes are the layout's count for rank 0's blocks and batch."""
    tc = TrainConfig(steps=2, global_batch=2 * plan.dp, dtype="float32")
    p = predict(MODEL, tc, plan, plan.world_size, MACHINE)
    base = plan.replace(cp=1, cp_algorithm="ring")
    q = predict(MODEL, tc, base, base.world_size, MACHINE)
    assert math.isclose(p.compute_s, q.compute_s / 2)
    assert math.isclose(p.tp_wire_bytes, q.tp_wire_bytes / 2)
    assert math.isclose(p.pp_wire_bytes, q.pp_wire_bytes / 2)
    assert (p.tp_wire_bytes > 0) == (plan.tp > 1) and (p.pp_wire_bytes > 0) == (plan.pp > 1)
    blocks = MODEL.n_layers // plan.pp
    assert p.cp_wire_bytes == cp_wire_bytes(MODEL, plan, 4, 2, blocks) > 0
    assert p.cp_comm_s >= p.cp_exposed_s > 0
    assert math.isclose(p.critical_path_s, p.compute_s + p.overhead_s + p.tp_comm_s
                        + p.pp_comm_s + p.cp_exposed_s + p.dp_exposed_s)
    assert p.dp_comm_s > 0  # reduced over dp x cp even at dp = 1


@pytest.mark.parametrize("ep", [1, 2])
def test_ep_flops_bytes_states_by_hand(ep):
    tc = TrainConfig(steps=2, global_batch=2 * ep, dtype="float32")
    plan = ParallelPlan(dp=ep, ep=ep)
    p = predict(MOE, tc, plan, ep, MACHINE)
    tokens, d, L = 2 * 16, MOE.d_model, MOE.n_layers
    matmul = sum(as_shape(MOE).layer_params(i, active=True) - 2 * d for i in range(L))
    imb = 1 + math.sqrt(2 * math.log(2) / (tokens * 2)) if ep > 1 else 1.0
    matmul += (imb - 1) * 2 * as_shape(MOE).expert_params() * L  # the busiest rank's extra load
    flops = tokens * (6 * matmul + 12 * L * 4 * 8 * 16 + 6 * d * MOE.vocab_size)
    assert math.isclose(p.compute_s, flops / 0.5e9)
    # per layer: 4 all-to-alls of 32 tokens x top-2 rows of 32 floats, half to the other
    # rank, plus 2 int64 split sizes sent first
    assert p.ep_wire_bytes == (0 if ep == 1 else L * (4 * 32 * 2 * 32 * 4 / 2 + 16))
    assert (p.ep_comm_s > 0) == (ep > 1)
    assert p.states_bytes_per_rank[0] == state_bytes(MOE, plan, "float32", 0, tc.reduce_dtype)


def test_ep_composed_with_tp_and_pp():
    """Under tp the MoE MLP is whole on each tp rank (its FLOPs are not split, its block
    has no MLP collectives) and every tp rank exchanges the same rows; a pipeline stage
    sends for its own MoE layers only."""
    tc = TrainConfig(steps=2, global_batch=4, dtype="float32")
    ep2 = predict(MOE, tc, ParallelPlan(dp=2, ep=2), 2, MACHINE)
    tp = predict(MOE, tc, ParallelPlan(dp=2, ep=2, tp=2), 4, MACHINE)
    assert tp.ep_wire_bytes == ep2.ep_wire_bytes > 0
    assert tp.ep_comm_s == ep2.ep_comm_s > 0
    # 2 MoE blocks x 2 all-reduce-sized transfers of 2 x 16 x 32 floats, half sent at tp 2
    assert tp.tp_wire_bytes == 2 * 2 * 2 * 16 * 32 * 4
    pp = predict(MOE, tc, ParallelPlan(dp=2, ep=2, pp=2, micro_batches=2), 4, MACHINE)
    # stage 0 holds 1 MoE layer; 2 micro-batches of 16 tokens: 4 all-to-alls, half sent
    assert pp.ep_wire_bytes == 2 * (4 * 16 * 2 * 32 * 4 / 2 + 16)


def test_ep_bytes_from_a_routing_by_hand():
    """ep 2 over dp 4: data rank 0 holds experts 0, 1 and trades with data rank 1 only."""
    load = [[3, 1, 4, 1], [5, 9, 2, 6], [7, 7, 7, 7], [0, 0, 0, 0]]
    plan = ParallelPlan(dp=4, ep=2)
    assert ep_rows_from_load(plan, 4, load) == (4 + 1, 5 + 9)
    assert ep_rows_from_load(plan, 4, load, 3) == (0, 7 + 7)
    # rows out and back, twice (forward, backward), 32 floats; 2 layers x 2 int64 counts
    assert ep_wire_bytes(MOE, plan, 4, 5, 14, 2) == 2 * 19 * 32 * 4 + 2 * 2 * 8
    full = plan.replace(recompute="full")  # the forward again, with its counts
    assert ep_wire_bytes(MOE, full, 4, 5, 14, 2) == 3 * 19 * 32 * 4 + 2 * 2 * 2 * 8
