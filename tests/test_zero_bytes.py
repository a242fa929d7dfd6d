"""Measured memory and wire bytes per rank equal the systems model's formulas.

- Model states (parameters, gradients, AdamW m and v) measured from the tensors' real
  storages equal ``paratrain.cost.memory.model_states`` for the plan, for d = 2 and
  4 and every ZeRO stage: exactly for the optimizer state summed over ranks, and per
  rank up to the zero padding of uneven shards (at most d - 1 elements per flat buffer).
- Wire bytes per rank per step, counted transfer by transfer by paratrain's own
  collectives (``--collectives ours``), equal 2(p-1)/p x payload for stages 0-2 and
  3(p-1)/p x payload for stage 3 (``systems.step_time.dp_sync_wire_bytes``).
"""

from __future__ import annotations

import pytest

from conftest import TINY
from paratrain.config import ModelConfig, TrainConfig
from paratrain.cost.memory import Precision, model_states
from paratrain.cost.shapes import as_shape
from paratrain.parallel.process_groups import spawn
from paratrain.plan import ParallelPlan
from paratrain.run.loop import RunOptions, train
from paratrain.systems.step_time import dp_sync_wire_bytes

MODEL = TINY
ODD = ModelConfig(n_layers=2, d_model=42, n_heads=3, d_ff=51, context=16)  # N % 4 == 2
BUCKET_MB = 0.02
FP32 = Precision("fp32-adam", 4, 4, 8)


def _worker(rank: int, world: int, data: str) -> dict:
    t = TrainConfig(steps=3, global_batch=8, lr=1e-3, warmup_steps=1, eval_every=0,
                    eval_batches=1, dtype="float32", data=data)
    out = {}
    for name, mcfg in (("model", MODEL), ("odd", ODD)):
        for z in (0, 1, 2, 3):
            plan = ParallelPlan(dp=world, zero=z, bucket_mb=BUCKET_MB, collectives="ours")
            s = train(mcfg, t, plan, RunOptions(quiet=True, measure_peak=False))
            out[(name, z)] = {k: s[k] for k in ("memory", "payload_bytes_per_step",
                                                "wire_bytes_per_step", "dp")}
    t2 = TrainConfig(steps=3, global_batch=8, lr=1e-3, warmup_steps=1, eval_every=0,
                     eval_batches=1, dtype="float32", data=data)
    for z in (0, 1, 2, 3):  # accumulation: ZeRO-2/3 reduce every micro-batch
        plan = ParallelPlan(dp=world, zero=z, bucket_mb=BUCKET_MB, collectives="ours",
                            micro_batches=2)
        s = train(MODEL, t2, plan, RunOptions(quiet=True, measure_peak=False))
        out[("accum", z)] = {k: s[k] for k in ("payload_bytes_per_step", "wire_bytes_per_step")}
    return out if rank == 0 else {}


@pytest.fixture(scope="module", params=[2, 4])
def runs(request, text_file):
    return request.param, spawn(_worker, request.param, text_file)[0]


@pytest.mark.parametrize("name", ["model", "odd"])
@pytest.mark.slow
def test_model_state_bytes_equal_the_formula(runs, name):
    d, out = runs
    mcfg = {"model": MODEL, "odd": ODD}[name]
    n = as_shape(mcfg).num_params()
    for z in (0, 1, 2, 3):
        mem = out[(name, z)]["memory"]
        pred = model_states(mcfg, ParallelPlan(dp=d, zero=z), FP32)
        assert mem["predicted_per_rank"]["params"] == pred.weights_bytes
        ranks = mem["measured_per_rank"]
        assert len(ranks) == d
        # Optimizer state: exactly the owned real elements, 8 bytes each; over all ranks
        # that is every parameter once (sharded) or d times (replicated).
        total_opt = sum(r["optimizer"] for r in ranks)
        assert total_opt == (8 * n if z >= 1 else 8 * n * d), f"zero={z}"
        # the placements say the same: each element owned once (sharded) or d times
        owned = sum(r["owned_elements"] for r in ranks)
        assert owned == (n if z >= 1 else n * d), f"zero={z} owned elements {owned}"
        layout = out[(name, z)]["dp"]["bucket_layout"]
        flats = int(layout.split()[0])  # buckets or units, each padded by < d elements
        slack = 4 * flats * (d - 1)
        for r in ranks:
            for kind, want in (("params", pred.weights_bytes), ("grads", pred.grads_bytes),
                               ("optimizer", pred.optimizer_bytes)):
                got = r[kind]
                assert want - slack <= got <= want + slack, \
                    f"d={d} zero={z} {kind}: measured {got} vs formula {want} (+-{slack})"
        if name == "model" and z == 0:  # nothing to pad: exact
            assert ranks[0]["params"] == pred.weights_bytes
            assert ranks[0]["grads"] == pred.grads_bytes


@pytest.mark.slow
def test_wire_bytes_per_step_equal_the_ring_formulas(runs):
    d, out = runs
    for name in ("model", "odd"):
        for z in (0, 1, 2, 3):
            r = out[(name, z)]
            payload = r["payload_bytes_per_step"]  # the padded flat buffers, fp32
            want = dp_sync_wire_bytes(payload, d, z)
            factor = 3 if z == 3 else 2
            assert want == pytest.approx(factor * (d - 1) / d * payload, rel=1e-12)
            assert r["wire_bytes_per_step"] == pytest.approx(want, rel=1e-12), \
                f"{name} d={d} zero={z}"
            n_bytes = 4 * as_shape({"model": MODEL, "odd": ODD}[name]).num_params()
            assert n_bytes <= payload < n_bytes + 4 * 64 * d  # padding only


def test_wire_bytes_with_two_micro_batches_follow_the_systems_model(runs):
    """m = 2: ZeRO 0/1 still send one all-reduce's worth (no communication on the
    first micro-step); ZeRO-2 reduce-scatters each micro-batch, (m+1)(p-1)/p; ZeRO-3
    gathers and reduces per micro-batch, 3m(p-1)/p."""
    d, out = runs
    for z, factor in ((0, 2), (1, 2), (2, 3), (3, 6)):
        r = out[("accum", z)]
        payload = r["payload_bytes_per_step"]
        assert dp_sync_wire_bytes(payload, d, z, 2) == pytest.approx(factor * (d - 1) / d *
                                                                     payload)
        assert r["wire_bytes_per_step"] == pytest.approx(factor * (d - 1) / d * payload,
                                                         rel=1e-12), f"d={d} zero={z}"


def test_zero_shrinks_measured_memory_in_the_right_order(runs):
    d, out = runs
    totals = []
    for z in (0, 1, 2, 3):
        m = out[("model", z)]["memory"]["measured_per_rank"][0]
        totals.append(m["params"] + m["grads"] + m["optimizer"])
    assert totals[0] > totals[1] > totals[2] > totals[3]
    assert totals[3] == pytest.approx(totals[0] / d, rel=0.02)


def test_the_step_model_prices_zero2_under_a_pipeline_with_one_reduction_per_step():
    """ZeRO-2 keeps gradients whole over the step under a pipeline (the runtime's counts
    and the memory model's, ``cost.dp_bytes.grad_reductions``): the step model's data-
    parallel sync is then ZeRO-1's, one reduce-scatter and one all-gather; without a
    pipeline it reduce-scatters every micro-batch, m - 1 more of them."""
    from paratrain.cost.dp_bytes import grad_reductions
    from paratrain.cost.hardware import load_hardware
    from paratrain.cost.shapes import load_model
    from paratrain.systems.step_model import predict_step

    model, hw, m = load_model("llama2-7b"), load_hardware("h100"), 8

    def dp_total(zero: int, pp: int) -> float:
        plan = ParallelPlan(dp=64 // pp, pp=pp, zero=zero, micro_batches=m)
        return predict_step(model, plan, hw, plan.dp * m * 4096, 4096).comm["dp"]

    assert [grad_reductions(2, m, p) for p in (False, True)] == [m, 1]
    assert grad_reductions(3, m, False) == m and grad_reductions(1, m, False) == 1
    assert dp_total(2, 2) == pytest.approx(dp_total(1, 2), rel=1e-12)
    one, two = dp_total(1, 1), dp_total(2, 1)
    assert two > one * (m + 1) / 2 * 0.9  # m reduce-scatters and a gather vs one of each


def _pipelined_zero3_worker(rank: int, world: int, data: str) -> dict:
    t = TrainConfig(steps=2, global_batch=8, lr=1e-3, warmup_steps=1, eval_every=0,
                    eval_batches=1, dtype="float32", data=data)
    plan = ParallelPlan(dp=world // 2, pp=2, zero=3, micro_batches=4)
    s = train(MODEL.replace(n_layers=4), t, plan, RunOptions(quiet=True, measure_peak=False))
    return s["memory"]["measured_per_rank"]


def test_zero3_under_a_pipeline_holds_its_stage_whole_as_the_planner_counts(text_file):
    """Under a pipeline ZeRO-3 gathers its stage once a step and reduces once after the
    last backward, so the stage's whole weights and gradients sit in communication
    buffers through the step: the planner's ``zero3_buffers`` is what the runtime
    measures, up to the flat buffers' padding (a few elements per rank)."""
    from paratrain.cost.memory import recipe, zero3_buffers

    measured = spawn(_pipelined_zero3_worker, 4, text_file)[0]
    want = zero3_buffers(MODEL.replace(n_layers=4), ParallelPlan(dp=2, pp=2, zero=3,
                                                                 micro_batches=4),
                         recipe("fp32-adam"))
    for r in measured:
        assert 0 <= r["comm_buffers"] - want <= 4 * 2 * 64, r
    assert want > 2 * max(r["params"] for r in measured)  # whole, not the owned shards
