"""MoE composed with context and sequence parallelism (issue 25, item 2).

Each cp (and, with SP, tp) rank routes only the tokens it holds; the load-balancing loss
sums each sequence's per-expert counts over those shards (:meth:`paratrain.model.MoE.
route`), so it stays the single process's. Checked in float64 against one process on
real gloo: every step's loss within 1e-9 relative, and the MoE statistics (auxiliary
loss, z-loss, load per expert) equal, for cp (ring and all-to-all), tp + sp, and with
ep, ZeRO and a pipeline; with expert capacity the same assignments are dropped (the
places in line are counted over the whole sequence).
"""

from __future__ import annotations

import pytest

from conftest import max_rel_diff, parity_tcfg
from paratrain.config import ModelConfig, TrainConfig
from paratrain.cost.layout import dp_wire_bytes, state_bytes
from paratrain.parallel.process_groups import spawn
from paratrain.plan import ParallelPlan
from paratrain.run.loop import RunOptions, train

MOE = ModelConfig(n_layers=2, d_model=32, n_heads=4, d_ff=64, context=16, experts=4,
                  top_k=2, z_loss_coef=0.01)
SHARED = MOE.replace(shared_experts=1, moe_every=2)  # block 0 dense, block 1 MoE
CAPPED = MOE.replace(capacity_factor=1.0)  # drops assignments: places in line matter
QUIET = dict(quiet=True, measure_peak=False)

FAST = {"cp2": (MOE, ParallelPlan(cp=2))}
TWO = {
    "cp2 all-to-all full recompute": (MOE, ParallelPlan(cp=2, cp_algorithm="all-to-all",
                                                        recompute="full")),
    "tp2 sp": (MOE, ParallelPlan(tp=2, sp=True)),
    "tp2 sp shared, moe_every 2, ours": (SHARED, ParallelPlan(tp=2, sp=True,
                                                              collectives="ours")),
    "cp2 capacity 1.0": (CAPPED, ParallelPlan(cp=2)),
    "tp2 sp capacity 1.0": (CAPPED, ParallelPlan(tp=2, sp=True)),
}
FOUR = {
    "dp2 ep2 cp2": (MOE, ParallelPlan(dp=2, ep=2, cp=2)),
    "cp2 tp2 sp": (MOE, ParallelPlan(cp=2, tp=2, sp=True)),
    "dp2 ep2 tp2 sp accum2": (MOE, ParallelPlan(dp=2, ep=2, tp=2, sp=True,
                                                micro_batches=2)),
    "dp2 ep2 cp2 zero3 all-to-all": (MOE, ParallelPlan(dp=2, ep=2, cp=2, zero=3,
                                                       cp_algorithm="all-to-all")),
    "cp2 pp2 m4 shared": (SHARED, ParallelPlan(cp=2, pp=2, micro_batches=4)),
    "cp2 tp2 sp capacity 1.0 full recompute": (CAPPED, ParallelPlan(
        cp=2, tp=2, sp=True, recompute="full")),
    "dp2 ep2 cp2 capacity 1.0 all-to-all": (CAPPED, ParallelPlan(
        dp=2, ep=2, cp=2, cp_algorithm="all-to-all")),
}


def _worker(rank: int, world: int, data: str, combos: dict) -> dict:
    out = {}
    for name, (model, plan) in combos.items():
        s = train(model, parity_tcfg(data), plan, RunOptions(**QUIET))
        out[name] = (s["losses"], s["val_loss"], s["moe_steps"],
                     (s["wire_bytes_per_step"], dp_wire_bytes(model, plan, "float64", rank)),
                     (s["memory"]["measured_per_rank"][rank],
                      state_bytes(model, plan, "float64", rank)),
                     [m.get("ep_wire_bytes") for m in s["moe_steps"]])
    return out


@pytest.fixture(scope="module")
def refs(text_file):
    return {m: train(m, parity_tcfg(text_file), None, RunOptions(**QUIET))
            for m in (MOE, SHARED, CAPPED)}


def _check(results: list, combos: dict, refs: dict) -> None:
    for name, (model, plan) in combos.items():
        ref = refs[model]
        losses, val, moe = results[0][name][:3]
        for r, res in enumerate(results):  # dp sync bytes (dense and expert reducers)
            assert res[name][3][0] == pytest.approx(res[name][3][1], rel=1e-12), (name, r)
            measured, want = res[name][4]  # model states: the layout's exact count
            assert {k: measured[k] for k in want} == want, (name, r)
        for r in results[1:]:
            assert r[name][0] == losses, f"{name}: ranks disagree on the loss"
        d = max_rel_diff(losses, ref["losses"])
        print(f"{name}: 4-step max rel loss diff {d:.2e}")
        assert d <= 1e-9, f"{name}: {d:.2e}"
        assert val == pytest.approx(ref["val_loss"], rel=1e-9), name
        for got, want in zip(moe, ref["moe_steps"], strict=True):
            assert got["moe_load"] == want["moe_load"], name
            assert got["moe_load_by_rank"] == want["moe_load_by_rank"] or plan.dp > 1, name
            assert got["aux_loss"] == pytest.approx(want["aux_loss"], rel=1e-9), name
            assert got["z_loss"] == pytest.approx(want["z_loss"], rel=1e-9), name
            assert got["z_loss"] > 0 and got["aux_loss"] > 0, name
            assert ("ep_wire_bytes" in got) == (plan.ep > 1 or plan.etp > 1), name
            assert got["moe_dropped"] == want["moe_dropped"], name
            assert (got["moe_dropped"] > 0) == (model.capacity_factor > 0), name


def test_moe_cp2_reproduces_one_process(text_file, refs):
    _check(spawn(_worker, 2, text_file, FAST, timeout_s=600), FAST, refs)


@pytest.mark.parametrize("world,combos", [(2, TWO), (4, FOUR)], ids=["world2", "world4"])
@pytest.mark.slow
def test_moe_cp_sp_reproduce_one_process(text_file, refs, world, combos):
    _check(spawn(_worker, world, text_file, combos, timeout_s=600), combos, refs)


def test_expert_groups_fold_over_the_cp_ranks():
    """The MoE layers fold over dp x cp (Megatron-Core's order: the global order cut as
    edp x ep, ep inner): the cp pair holding different chunks of the same sequences is
    one ep group, and the ranks of the same ep index sum their experts' gradients."""
    from paratrain.parallel.mesh import axis_ranks

    sizes = {"pp": 1, "dp": 4, "cp": 2, "tp": 1, "ep": 2}  # rank = dp index * 2 + cp index
    assert axis_ranks(0, "edp", sizes) == [0, 2, 4, 6]
    assert axis_ranks(3, "edp", sizes) == [1, 3, 5, 7]
    assert axis_ranks(1, "ep", sizes) == [0, 1]


def _resume_worker(rank: int, world: int, data: str, ckpt: str) -> tuple[list, list]:
    t = TrainConfig(steps=6, global_batch=8, lr=1e-2, warmup_steps=2, eval_every=0,
                    eval_batches=1, dtype="float64", data=data)
    plan = ParallelPlan(dp=2, ep=2, cp=2, zero=1)
    full = train(MOE, t, plan, RunOptions(**QUIET))["losses"]
    train(MOE, t, plan, RunOptions(checkpoint_dir=ckpt, stop_after=3, **QUIET))
    resumed = train(MOE, t, plan, RunOptions(checkpoint_dir=ckpt, resume=True, **QUIET))
    return full[3:], resumed["losses"]


@pytest.mark.slow
def test_ep_cp_checkpoint_resumes_exactly(text_file, tmp_path):
    """dp 2 ep 2 cp 2 ZeRO-1: the expert shards' owners over edp (which spans cp) save
    and reload them; resuming at step 3 continues the uninterrupted run bit for bit."""
    for full, resumed in spawn(_resume_worker, 4, text_file, str(tmp_path / "ckpt")):
        assert resumed == full
