"""The CP and EP step prices (paratrain.predict.parallel), checked by hand against the
counts' homes: CP ring exchange seconds and what the block attention hides, all-to-all
exposed, FLOPs split over cp ranks, MoE active FLOPs and all-to-all bytes under uniform
routing, exact model-state bytes. No wall-clock accuracy is asserted (the benchmarks
print that)."""

from __future__ import annotations

import math

import pytest

from paratrain.config import ModelConfig, TrainConfig
from paratrain.layout import cp_wire_bytes, state_bytes
from paratrain.parallel.memory import predicted_activations
from paratrain.plan import ParallelPlan
from paratrain.predict import MachineModel
from paratrain.predict.parallel import predict_cp, predict_ep
from paratrain.systems.hardware import Hardware

MODEL = ModelConfig(n_layers=2, d_model=32, n_heads=4, d_ff=64, context=16)
MOE = MODEL.replace(experts=4, top_k=2, moe_ffn=64)
TC = TrainConfig(steps=2, global_batch=1, dtype="float32")
HW = Hardware("test-box", peak_flops=4e9, hbm_bytes=8e9, hbm_bw=1e10, gpus_per_node=4,
              intra_bw=1e9, intra_alpha=1e-4, inter_bw=1e9, inter_alpha=1e-4, eta=1.0)
MACHINE = MachineModel(HW, eta=0.5, thread_peak=1e9, pass_s=1e-3, step_s=2e-3, fitted=True)


def test_cp_ring_by_hand():
    one = predict_cp(MODEL, TC, ParallelPlan(), 1, MACHINE)
    p = predict_cp(MODEL, TC, ParallelPlan(cp=2), 2, MACHINE)
    assert math.isclose(p.compute_s, one.compute_s / 2)  # load balanced: T/cp tokens each
    # K and V of 8 tokens x 4 heads x 8 dims, float32: 2048 bytes a hop; forward 1 hop,
    # backward 1 hop of K/V + 2 of their gradients; a latency per hop (two backward)
    fwd, bwd = 1e-4 + 2048 / 1e9, 2e-4 + 6144 / 1e9
    assert math.isclose(p.comm_s, 2 * (fwd + bwd))
    attn = 8 * 4 * 4 * 8 * 16 / 0.5e9  # forward attention FLOPs of a block / rate
    assert math.isclose(p.exposed_s, 2 * ((fwd - attn) + (bwd - 2.5 * attn)))
    assert p.wire_bytes == cp_wire_bytes(MODEL, ParallelPlan(cp=2), 4, 1, 2) == 2 * 8192
    assert p.dp_s > 0 and one.dp_s == 0  # cp ranks reduce their gradients together
    assert math.isclose(p.critical_path_s,
                        p.compute_s + p.overhead_s + p.exposed_s + p.dp_s)
    assert p.step_s == max(p.critical_path_s, p.session_work_s / p.session_cores)
    assert p.activations_bytes == predicted_activations(MODEL, ParallelPlan(cp=2), TC)
    a2a = predict_cp(MODEL, TC, ParallelPlan(cp=2, cp_algorithm="all-to-all"), 2, MACHINE)
    assert a2a.exposed_s == a2a.comm_s > 0  # nothing hides the all-to-all


@pytest.mark.parametrize("ep", [1, 2])
def test_ep_flops_bytes_states_by_hand(ep):
    tc = TrainConfig(steps=2, global_batch=2 * ep, dtype="float32")
    plan = ParallelPlan(dp=ep, ep=ep)
    p = predict_ep(MOE, tc, plan, ep, MACHINE)
    tokens, d, L = 2 * 16, MOE.d_model, MOE.n_layers
    matmul = sum(MOE.layer_params(i, active=True) - 2 * d for i in range(L))
    imb = 1 + math.sqrt(2 * math.log(2) / (tokens * 2)) if ep > 1 else 1.0
    matmul += (imb - 1) * 2 * MOE.expert_params() * L  # the busiest rank's extra load
    flops = tokens * (6 * matmul + 12 * L * 4 * 8 * 16 + 6 * d * MOE.vocab_size)
    assert math.isclose(p.compute_s, flops / 0.5e9)
    # per layer: 4 all-to-alls of 32 tokens x top-2 rows of 32 floats, half to the other
    # rank, plus 2 int64 split sizes sent first
    assert p.wire_bytes == (0 if ep == 1 else L * (4 * 32 * 2 * 32 * 4 / 2 + 16))
    assert p.exposed_s == p.comm_s and (p.comm_s > 0) == (ep > 1)
    assert p.states_bytes == sum(state_bytes(MOE, plan, "float32", 0, tc.reduce_dtype)
                                 .values())


def test_refuses_what_it_does_not_price():
    with pytest.raises(ValueError, match="pp = tp = 1"):
        predict_cp(MODEL, TC, ParallelPlan(cp=2, tp=2), 4, MACHINE)
    with pytest.raises(ValueError, match="MoE model"):
        predict_ep(MODEL, TC, ParallelPlan(dp=2, ep=2), 2, MACHINE)
