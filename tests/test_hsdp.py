"""HSDP (``--dp-replicate R``, issue 25): ZeRO over one replica's dp / R ranks, the owned
gradient chunks all-reduced over the R replicas.

- The plan: R divides dp, needs ZeRO >= 1, leaves at least 2 ranks per shard group,
  refuses --ep; each bad value is one ``error:`` line naming the flag (exit 2).
- The mesh: ``dp_shard`` and ``dp_replicate`` groups of the documented ranks.
- Real gloo processes, float64: dp 4 = 2 replicas x 2 shards under ZeRO-1/2/3 (and
  dp 2 x cp 2 = 2 replicas of the cp pair; pp 2 x dp 4, slow) reproduce one process's
  loss trajectory to 1e-9; wire bytes per rank and step, counted transfer by transfer
  (``--collectives ours``), equal :func:`paratrain.cost.layout.dp_wire_bytes_by_axis` on
  each sub-axis, and model-state bytes per rank equal
  :func:`paratrain.cost.layout.state_bytes`.
- The systems models and ``paratrain plan`` price the same bytes.
- A checkpoint saved under HSDP resumes under plain ZeRO and the other way round.
"""

from __future__ import annotations

import json

import pytest

from conftest import TINY, max_rel_diff
from paratrain.cli import main
from paratrain.config import TrainConfig
from paratrain.cost.layout import dp_wire_bytes, dp_wire_bytes_by_axis, state_bytes
from paratrain.parallel.mesh import axis_ranks
from paratrain.parallel.process_groups import spawn
from paratrain.plan import ParallelPlan
from paratrain.run.loop import RunOptions, train

QUIET = dict(quiet=True, measure_peak=False)
BUCKET_MB = 0.02  # many buckets, each padded
FAST = {
    "zero1": ParallelPlan(dp=4, dp_replicate=2, zero=1, collectives="ours",
                          bucket_mb=BUCKET_MB),
    "zero2 accum2": ParallelPlan(dp=4, dp_replicate=2, zero=2, collectives="ours",
                                 bucket_mb=BUCKET_MB, micro_batches=2),
    "zero3": ParallelPlan(dp=4, dp_replicate=2, zero=3, collectives="ours"),
}
SLOW = {
    "zero3 dp2 cp2 (R 2)": ParallelPlan(dp=2, cp=2, dp_replicate=2, zero=3,
                                        collectives="ours"),
    "zero1 native overlap off": ParallelPlan(dp=4, dp_replicate=2, zero=1, overlap=False,
                                             bucket_mb=BUCKET_MB),
}
PIPE = {"zero1 pp2 dp4 (R 2) m2": ParallelPlan(dp=4, pp=2, dp_replicate=2, zero=1,
                                               micro_batches=2, collectives="ours",
                                               bucket_mb=BUCKET_MB)}


def tcfg(data: str, steps: int = 4) -> TrainConfig:
    return TrainConfig(steps=steps, global_batch=8, lr=1e-2, warmup_steps=2, eval_every=0,
                       eval_batches=1, dtype="float64", data=data)


# ---- the plan and the mesh -----------------------------------------------------------
@pytest.mark.parametrize("kw,words", [
    (dict(dp=4, dp_replicate=3, zero=3), "must divide dp=4"),
    (dict(dp=4, dp_replicate=2), "needs --zero 1, 2 or 3"),
    (dict(dp=4, dp_replicate=4, zero=3), "leaves one rank per shard"),
])
def test_bad_replica_counts_are_refused(kw, words):
    with pytest.raises(ValueError, match=words):
        ParallelPlan(**kw)


def test_refusals_are_one_error_line_naming_the_flag(capsys):
    for args in (["--zero", "3", "--dp-replicate", "3"], ["--dp-replicate", "2"]):
        assert main(["plan", "--gpus", "4", "--dp", "4", *args]) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err
        assert "--dp-replicate" in err[0], err
    plan = ParallelPlan(dp=4, ep=2, dp_replicate=2, zero=1)
    with pytest.raises(ValueError, match="--dp-replicate 2 with --ep 2"):
        plan.check_runtime(TINY.replace(experts=4, top_k=2))


def test_mesh_groups_are_replicas_of_consecutive_dp_ranks():
    sizes = {"pp": 1, "dp": 4, "cp": 1, "tp": 2, "dp_replicate": 2}
    assert axis_ranks(0, "dp_shard", sizes) == [0, 2]
    assert axis_ranks(5, "dp_shard", sizes) == [5, 7]
    assert axis_ranks(0, "dp_replicate", sizes) == [0, 4]
    assert axis_ranks(7, "dp_replicate", sizes) == [3, 7]
    cp = {"pp": 1, "dp": 2, "cp": 2, "tp": 1, "dp_replicate": 2}  # S = 1: the cp pair
    assert axis_ranks(2, "dp_shard", cp) == [2, 3]
    assert axis_ranks(3, "dp_replicate", cp) == [1, 3]


# ---- bytes, priced -------------------------------------------------------------------
@pytest.mark.parametrize("zero,factor", [(1, 2), (2, 2), (3, 3)])
def test_sub_axis_bytes_are_the_ring_formulas(zero, factor):
    """TINY pads nothing at dp 4 (one bucket, every unit a multiple of 4): shard axis
    factor x (s-1)/s x payload over s = 2, replica axis 2(R-1)/R x payload / s."""
    from paratrain.cost.hardware import load_hardware
    from paratrain.cost.layout import dp_payload_bytes
    from paratrain.cost.memory import Precision
    from paratrain.systems.step_time import dp_sync_wire_bytes, step_time

    plan = ParallelPlan(dp=4, dp_replicate=2, zero=zero)
    payload = dp_payload_bytes(TINY, plan, "float64", 0)
    assert payload == 8 * 37024
    for r in range(4):
        got = dp_wire_bytes_by_axis(TINY, plan, "float64", r)
        assert got == {"dp_shard": factor * 0.5 * payload, "dp_replicate": payload / 2}
        assert dp_wire_bytes(TINY, plan, "float64", r) == sum(got.values())
    assert dp_sync_wire_bytes(payload, 4, zero, replicate=2) == sum(got.values())
    prec = Precision("fp64-adam", 8, 8, 16)  # the reference model, on the same bytes
    st = step_time(TINY, plan, load_hardware("h100"), 128, 16, precision=prec)
    assert st.dp_wire_bytes == sum(got.values())


def test_step_model_prices_the_plans_shard_group():
    """The fitted step model's hybrid sharding is the plan's: predict_step of an HSDP
    plan equals the R = 1 plan priced with shard_group = dp / R, and differs from plain
    ZeRO over dp."""
    from paratrain.cost.hardware import load_hardware
    from paratrain.systems.step_model import predict_step

    hw, big = load_hardware("h100"), TINY.replace(d_model=256, n_heads=8, d_ff=1024)
    hsdp = ParallelPlan(dp=8, dp_replicate=2, zero=3)
    a = predict_step(big, hsdp, hw, 8 * 1024, 1024)
    b = predict_step(big, hsdp.replace(dp_replicate=1), hw, 8 * 1024, 1024, shard_group=4)
    c = predict_step(big, hsdp.replace(dp_replicate=1), hw, 8 * 1024, 1024)
    assert a.comm["dp"] == b.comm["dp"] and a.comm["dp"] != c.comm["dp"]


# ---- real processes ------------------------------------------------------------------
def _worker(rank: int, world: int, data: str, combos: dict) -> dict:
    out = {}
    for name, plan in combos.items():
        s = train(TINY, tcfg(data), plan, RunOptions(**QUIET))
        out[name] = {"losses": s["losses"], "by_axis": s["dp"]["wire_bytes_by_axis"],
                     "wire": s["wire_bytes_per_step"],
                     "states": s["memory"]["measured_per_rank"]}
    return out


@pytest.fixture(scope="module")
def ref(text_file):
    return train(TINY, tcfg(text_file), None, RunOptions(**QUIET))["losses"]


def _check(results, combos, ref):
    for name, plan in combos.items():
        got = results[0][name]
        d = max_rel_diff(got["losses"], ref)
        print(f"{name}: max rel loss diff {d:.2e}")
        assert d <= 1e-9, name
        for r, res in enumerate(results):
            want = dp_wire_bytes_by_axis(TINY, plan, "float64", r)
            for step in res[name]["by_axis"][1:]:  # steady steps (ZeRO-1/2 gather late)
                assert step == want, (name, r, step, want)
            states = {k: got["states"][r][k] for k in ("params", "grads", "optimizer")}
            assert states == state_bytes(TINY, plan, "float64", r), (name, r)


def test_hsdp_reproduces_one_process_and_its_bytes(text_file, ref):
    _check(spawn(_worker, 4, text_file, FAST, timeout_s=300), FAST, ref)


@pytest.mark.slow
def test_hsdp_with_cp_and_native_collectives(text_file, ref):
    _check(spawn(_worker, 4, text_file, SLOW, timeout_s=600), SLOW, ref)


@pytest.mark.slow
def test_hsdp_under_a_pipeline(text_file, ref):
    _check(spawn(_worker, 8, text_file, PIPE, timeout_s=600), PIPE, ref)


def _resume_worker(rank: int, world: int, data: str, ckpt: str) -> dict:
    """Save at step 3 of 6 under one layout, resume under the other."""
    t = tcfg(data, steps=6)
    hsdp = ParallelPlan(dp=4, dp_replicate=2, zero=3)
    pairs = {"hsdp -> zero1": (hsdp, ParallelPlan(dp=4, zero=1)),
             "zero3 -> hsdp zero2": (ParallelPlan(dp=4, zero=3), hsdp.replace(zero=2))}
    out = {}
    for name, (a, b) in pairs.items():
        d = f"{ckpt}/{name.replace(' ', '_').replace('>', '')}"
        train(TINY, t, a, RunOptions(checkpoint_dir=d, stop_after=3, **QUIET))
        out[name] = train(TINY, t, b, RunOptions(checkpoint_dir=d, resume=True,
                                                 **QUIET))["losses"]
    return out


@pytest.mark.slow
def test_checkpoint_resumes_under_another_layout(text_file, tmp_path):
    full = train(TINY, tcfg(text_file, steps=6), None, RunOptions(**QUIET))["losses"]
    got = spawn(_resume_worker, 4, text_file, str(tmp_path), timeout_s=600)[0]
    for name, losses in got.items():
        assert len(losses) == 3, name
        assert max_rel_diff(losses, full[3:]) <= 1e-9, name
    # the HSDP checkpoint is the plain model's tensors: the same as plain ZeRO-3's
    from paratrain.files.checkpoint import load_full_model

    _, hsdp = load_full_model(tmp_path / "hsdp_-_zero1", step=3)
    _, zero3 = load_full_model(tmp_path / "zero3_-_hsdp_zero2", step=3)
    assert hsdp.keys() == zero3.keys()
    for k in hsdp:
        assert float((hsdp[k] - zero3[k]).abs().max()) <= 1e-12 * float(zero3[k].abs().max()), k


def test_plan_prices_the_bytes_the_run_counts(tmp_path, capsys):
    """`paratrain plan --json` of an HSDP run.toml gives, per rank, the sub-axis wire
    bytes and model states that the spawned runs above measure (the same functions)."""
    cfg = tmp_path / "run.toml"
    cfg.write_text("[model]\nn_layers = 2\nd_model = 32\nn_heads = 4\nd_ff = 64\n"
                   "context = 16\n[plan]\ndp = 4\nzero = 2\ndp_replicate = 2\n"
                   "micro_batches = 2\nbucket_mb = 0.02\n[train]\nglobal_batch = 8\n"
                   "dtype = \"float64\"\n")
    assert main(["plan", "--config", str(cfg), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    plan = FAST["zero2 accum2"]
    assert rep["plan"]["dp_replicate"] == 2 and rep["plan"]["gpus"] == 4
    run = rep["run"]
    for r in range(4):
        assert run["dp_wire_bytes_by_axis_per_rank"][r] == \
            dp_wire_bytes_by_axis(TINY, plan, "float64", r)
        assert run["dp_wire_bytes_per_rank"][r] == dp_wire_bytes(TINY, plan, "float64", r)
        assert run["model_state_bytes_per_rank"][r] == state_bytes(TINY, plan, "float64", r)


def test_search_can_try_replica_counts():
    """``replicas=(1, 2)``: the search also prices HSDP layouts (ZeRO >= 1 only, each
    valid for the runtime), and reports the replica count; by default it tries none."""
    from paratrain.cost.hardware import load_hardware
    from paratrain.systems.search import candidate_record, enumerate_plans, search

    hw, big = load_hardware("h100"), TINY.replace(d_model=256, n_heads=8, d_ff=1024,
                                                  context=1024)
    plain = list(enumerate_plans(big, hw, 8, 64, 1024))
    both = list(enumerate_plans(big, hw, 8, 64, 1024, replicas=(1, 2)))
    hsdp = [p for p, _ in both if p.dp_replicate == 2]
    assert all(p.dp_replicate == 1 for p, _ in plain) and len(both) == len(plain) + len(hsdp)
    assert hsdp and all(p.zero >= 1 and p.dp % 2 == 0 and p.dp * p.cp > 2 for p in hsdp)
    res = search(big, hw, 8, 64 * 1024, 1024, top=len(both), replicas=(1, 2))
    assert {candidate_record(c)["dp_replicate"] for c in res.top} == {1, 2}
