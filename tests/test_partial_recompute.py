"""Partial recomputation of published runs (systems.partial_recompute) and FP8 linear
layers' activations (cost.activations): the bytes by hand, the least share of blocks
that fits, and the step priced as the blend of none and all. No torch."""

from __future__ import annotations

import dataclasses

import pytest

from paratrain.cost.hardware import load_hardware
from paratrain.cost.memory import layer_activation_bytes, memory
from paratrain.cost.shapes import load_model
from paratrain.plan import ParallelPlan
from paratrain.systems.fitting import breakdown, load_params, predict
from paratrain.systems.partial_recompute import blend, least_share
from paratrain.systems.row_memory import rank_memory
from paratrain.systems.runs import read_runs, row_to_case
from paratrain.systems.step_model import predict_step

S, H, A = 8192, 16384, 128  # Llama 3.1 405B's layer at 8K, one sequence
BY_ID = {r["id"]: r for r in read_runs()}


def test_fp8_linear_inputs_take_half_the_bytes_of_korthikantis_count():
    """QKV's (2), the output projection's (2) and the MLP's (2 + 8) inputs of the 34 s b h
    are kept in FP8: 10 + 24/t becomes 8 + 19/t, 34 becomes 27; full recompute keeps
    the 16-bit block input either way."""
    sbh = S * H
    assert layer_activation_bytes(S, 1, H, A, attention="flash", fp8=True) == 27 * sbh
    assert layer_activation_bytes(S, 1, H, A, tp=8, attention="flash", fp8=True) == \
        sbh * (8 + 19 / 8)
    assert layer_activation_bytes(S, 1, H, A, tp=8, sp=True, attention="flash", fp8=True) == \
        27 * sbh / 8
    assert layer_activation_bytes(S, 1, H, A, tp=8, recompute="selective", fp8=True) == \
        sbh * (8 + 19 / 8)
    for sp in (False, True):
        assert layer_activation_bytes(S, 1, H, A, tp=8, sp=sp, recompute="full", fp8=True) == \
            layer_activation_bytes(S, 1, H, A, tp=8, sp=sp, recompute="full")


def test_the_fp8_recipe_keeps_bf16_adams_states_and_fewer_activation_bytes():
    m, hw = load_model("llama3.1-405b"), load_hardware("gb200")
    plan = ParallelPlan(dp=4, tp=4, pp=16, sp=True, micro_batches=384, schedule="interleaved",
                        virtual_stages=4)
    b16, f8 = (memory(m, plan, hw, 1536 * 8192, 8192, r, "flash", ours=False)
               for r in ("bf16-adam", "fp8-adam"))
    assert (b16.weights_bytes, b16.grads_bytes, b16.optimizer_bytes) == \
        (f8.weights_bytes, f8.grads_bytes, f8.optimizer_bytes)
    assert f8.activations_bytes == pytest.approx(b16.activations_bytes * 27 / 34)


def test_the_least_share_that_fits():
    m, hw = load_model("llama3.1-405b"), load_hardware("gb200")
    plan = ParallelPlan(dp=4, tp=4, pp=16, sp=True, micro_batches=384, schedule="interleaved",
                        virtual_stages=4)
    none, full = (rank_memory(m, plan.replace(recompute=r), hw, 1536 * 8192, 8192, "flash")
                  for r in ("none", "full"))
    assert not none.fits and full.fits
    f = least_share(none, full)
    assert 0 < f < 1
    assert none.total_bytes - f * (none.total_bytes - full.total_bytes) == \
        pytest.approx(none.hbm_bytes)
    assert least_share(full, full) == 0.0  # fits without recomputing anything
    assert least_share(none, none) == 1.0  # recomputing saves nothing: all of it


def test_a_blend_is_linear_in_the_share_between_none_and_all():
    m, hw, sp = load_model("llama3-70b"), load_hardware("h100"), load_params()
    plan = ParallelPlan(dp=4, tp=8, pp=2, sp=True, micro_batches=16, recompute="full")
    full = predict_step(m, plan, hw, 1_048_576, 4096, sp, "nemo")
    none = predict_step(m, plan.replace(recompute="none"), hw, 1_048_576, 4096, sp, "nemo")
    assert full.step_s > none.step_s and full.hardware_flops > none.hardware_flops
    assert blend(none, full, 0.0).step_s == pytest.approx(none.step_s)
    assert blend(none, full, 1.0).step_s == pytest.approx(full.step_s)
    q = blend(none, full, 0.25)
    assert q.step_s == pytest.approx(0.75 * none.step_s + 0.25 * full.step_s)
    assert q.gemm["mlp"] == pytest.approx(0.75 * none.gemm["mlp"] + 0.25 * full.gemm["mlp"])
    assert q.model_flops == full.model_flops


def test_a_row_that_recomputes_a_share_is_priced_as_the_blend():
    """Megatron-Bridge's Llama 3.1 405B on 256 GB200 (FP8, recompute not stated) does not
    fit without recomputation; the least share of blocks that fits is priced, between
    no recomputation and all of it."""
    case = row_to_case(BY_ID["mb2511_llama31_405b_gb200_cs_256"])
    assert case.plan.recompute == "full" and 0 < case.recompute_share < 1
    p = load_params()
    at = {r: breakdown(dataclasses.replace(case, plan=case.plan.replace(recompute=r),
                                           recompute_share=1.0), p)
          for r in ("none", "full")}
    want = blend(at["none"], at["full"], case.recompute_share)
    assert breakdown(case, p).step_s == pytest.approx(want.step_s, rel=1e-12)
    figure = predict(case, p)
    assert predict(dataclasses.replace(case, recompute_share=1.0), p) < figure
