"""Hand-checked activation memory (Korthikanti et al. 2022), pipeline bubbles, memory
verdicts and the ZeRO-3 buffer."""

from __future__ import annotations

import pytest

from conftest import TINY
from paratrain.cost.hardware import load_hardware
from paratrain.cost.memory import (
    activation_bytes,
    layer_activation_bytes,
    memory,
    micro_batches_in_flight,
)
from paratrain.cost.shapes import load_model
from paratrain.plan import ParallelPlan
from paratrain.systems.step_time import bubble_fraction, step_time

S, B, H, A = 2048, 1, 12288, 96  # GPT-3 175B layer, one sequence


def test_activation_no_parallelism():
    # s b h (34 + 5 a s / h) = 2048*12288*(34 + 5*96*2048/12288) = 2048*12288*114
    assert layer_activation_bytes(S, B, H, A) == 2048 * 12288 * 114


def test_activation_tensor_parallel_8():
    # s b h (10 + 24/t + 5 a s / (h t)) = 2048*12288*(10 + 3 + 10)
    assert layer_activation_bytes(S, B, H, A, tp=8) == 2048 * 12288 * 23


def test_activation_tensor_and_sequence_parallel_8():
    # s b h (34 + 5 a s / h) / t = 2048*12288*114/8
    assert layer_activation_bytes(S, B, H, A, tp=8, sp=True) == 2048 * 12288 * 114 / 8


def test_activation_selective_and_full_recompute():
    assert layer_activation_bytes(S, B, H, A, tp=8, sp=True, recompute="selective") == \
        2048 * 12288 * 34 / 8
    assert layer_activation_bytes(S, B, H, A, tp=8, recompute="selective") == 2048 * 12288 * 13
    assert layer_activation_bytes(S, B, H, A, tp=8, recompute="full") == 2 * 2048 * 12288
    assert layer_activation_bytes(S, B, H, A, tp=8, sp=True, recompute="full") == \
        2 * 2048 * 12288 / 8


def test_activation_scales_with_layers_and_micro_batches_in_flight():
    gpt3 = load_model("gpt3-175b")
    plan = ParallelPlan(dp=1, tp=8, pp=8, sp=True, micro_batches=16)
    per_layer = layer_activation_bytes(2048, 1, 12288, 96, tp=8, sp=True)
    # 1F1B: the first stage holds pp micro-batches of its 12 layers
    assert activation_bytes(gpt3, plan, 16 * 2048, 2048) == per_layer * 12 * 8
    gpipe = plan.replace(schedule="gpipe")
    assert activation_bytes(gpt3, gpipe, 16 * 2048, 2048) == per_layer * 12 * 16


@pytest.mark.parametrize("pp, m", [(4, 8), (8, 8), (2, 1), (16, 64)])
def test_1f1b_bubble(pp, m):
    assert bubble_fraction("1f1b", pp, m) == pytest.approx((pp - 1) / (m + pp - 1))
    assert bubble_fraction("gpipe", pp, m) == pytest.approx((pp - 1) / (m + pp - 1))
    # interleaving with v chunks divides the bubble (relative to compute) by v
    inter = bubble_fraction("interleaved", pp, m, 2)
    assert inter / (1 - inter) == pytest.approx((pp - 1) / m / 2)
    assert bubble_fraction("zb-h1", pp, m) < bubble_fraction("1f1b", pp, m)
    assert bubble_fraction("1f1b", 1, m) == 0.0


def test_bubble_appears_in_step_time():
    m = load_model("llama2-7b")
    hw = load_hardware("h100")
    s = step_time(m, ParallelPlan(dp=8, pp=4, micro_batches=8), hw, 32 * 8 * 4096, 4096)
    assert s.bubble_s == pytest.approx(s.compute_s * 3 / 8)


def test_in_flight_counts():
    assert micro_batches_in_flight("1f1b", 1, 8) == 1
    assert micro_batches_in_flight("1f1b", 4, 8) == 4
    assert micro_batches_in_flight("1f1b", 4, 2) == 2
    assert micro_batches_in_flight("gpipe", 4, 8) == 8


def test_memory_verdict_and_zero3_buffers():
    m, hw = load_model("llama2-7b"), load_hardware("h100")
    full = ParallelPlan(dp=64, micro_batches=4, recompute="full", zero=1)
    mem = memory(m, full, hw, 1_048_576, 4096)
    assert mem.fits and mem.margin_bytes == pytest.approx(80e9 - mem.total_bytes)
    assert mem.activations_bytes == 2 * 4096 * 1 * 4096 * 32  # 2 s b h per layer
    assert not memory(m, ParallelPlan(dp=64), hw, 1_048_576, 4096).fits
    z3 = memory(m, full.replace(zero=3), hw, 1_048_576, 4096)
    assert z3.buffers_bytes == pytest.approx(2 * 2 * m.num_layer_params() / 32)


def test_tensor_parallel_comm_priced_on_nvlink():
    m, hw = load_model("llama2-7b"), load_hardware("h100")
    s = step_time(m, ParallelPlan(dp=8, tp=8), hw, 64 * 4096, 4096)
    # 4 all-reduces per layer of b s h 2 bytes over 8 GPUs on NVLink
    act = 8 * 4096 * 4096 * 2
    one = 14 * hw.intra_alpha + 2 * 7 / 8 * act / hw.intra_bw
    assert s.tp_comm_s == pytest.approx(32 * 4 * one)


def test_sharded_gradients_sync_every_micro_batch():
    from paratrain.systems.step_time import dp_sync_wire_bytes

    n, p = 1e9, 8
    piece = 7 / 8 * n
    assert dp_sync_wire_bytes(n, p, 1, micro_batches=4) == pytest.approx(2 * piece)
    assert dp_sync_wire_bytes(n, p, 2, micro_batches=4) == pytest.approx(5 * piece)
    assert dp_sync_wire_bytes(n, p, 3, micro_batches=4) == pytest.approx(12 * piece)


def test_plain_model_config_is_priced_like_its_shape():
    from paratrain.config import ModelConfig
    from paratrain.cost.shapes import as_shape

    cfg = ModelConfig(n_layers=4, d_model=64, n_heads=4, d_ff=128, vocab_size=256, context=32)
    plan = ParallelPlan(dp=2, zero=1)
    hw = load_hardware("h100")
    assert memory(cfg, plan, hw, 8 * 32, 32) == memory(as_shape(cfg), plan, hw, 8 * 32, 32)
    assert step_time(cfg, plan, hw, 8 * 32, 32).model_flops == \
        as_shape(cfg).flops_per_token(32) * 256


def test_zero2_under_a_pipeline_keeps_whole_gradients():
    """The runtime (paratrain.cost.layout) keeps ZeRO-2's gradient buffers whole under a
    pipeline and syncs ZeRO-2/3 once per step there; the systems model agrees."""
    from paratrain.cost import layout as L
    from paratrain.cost.memory import Precision, model_states
    from paratrain.systems.step_time import dp_sync_wire_bytes

    m = TINY.replace(n_layers=4)
    fp32 = Precision("fp32-adam", 4, 4, 8, act_bytes=4)
    for zero, pp, sharded in ((2, 1, True), (2, 2, False), (3, 2, True), (1, 2, False)):
        plan = ParallelPlan(dp=2, pp=pp, zero=zero, micro_batches=4)
        ms = model_states(m, plan, fp32)
        assert ms.grads_bytes == pytest.approx(ms.weights_bytes / (2 if sharded and zero == 2
                                                                   else 1)), (zero, pp)
        # the runtime: gradients a full copy of the rank's parameters, or half of them
        st = [L.state_bytes(m, plan, "float32", r) for r in range(2 * pp)]
        held = [4 * L.rank_layout(m, plan, r).params for r in range(2 * pp)]
        assert all((s["grads"] < h) == sharded for s, h in zip(st, held, strict=True))
        factor = L.dp_wire_factor(plan)
        assert dp_sync_wire_bytes(1e6, 2, zero, 4, pp > 1) == pytest.approx(factor * 0.5e6)
