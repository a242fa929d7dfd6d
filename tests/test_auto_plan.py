"""The planner closes the loop (issue 24): every layout it ranks is one `paratrain train`
accepts (this machine's search and the cluster search), the ranking and its verdict
(Kendall tau, the winner's place) are computed as documented, the winner is emitted as a
TOML `train --config` reads back to the same settings, and `train --plan auto` /
`plan --search --verify` run end to end on real gloo processes (slow)."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys

import pytest

from conftest import TINY
from paratrain.cli import main
from paratrain.cli.settings import resolve
from paratrain.config import TrainConfig
from paratrain.cost.hardware import Hardware, load_hardware
from paratrain.cost.shapes import load_model
from paratrain.files.run_toml import run_toml, write_run_toml
from paratrain.plan import ParallelPlan
from paratrain.predict import MachineModel
from paratrain.predict.layouts import describe, rank_layouts, runtime_plans
from paratrain.run.auto_plan import constrained
from paratrain.run.verify import kendall_tau, pick, verdict
from paratrain.systems.search import runs as _accepted  # ParallelPlan.check_run, the launcher's
from paratrain.systems.search import search

HW = Hardware("test-box", peak_flops=4e9, hbm_bytes=8e9, hbm_bw=1e10, gpus_per_node=2,
              intra_bw=1e9, intra_alpha=1e-4, inter_bw=1e9, inter_alpha=1e-4, eta=1.0)
MACHINE = MachineModel(HW, eta=0.5, thread_peak=1e9, pass_s=1e-3, step_s=2e-3, fitted=True)
TC = TrainConfig(steps=2, global_batch=8)


@pytest.mark.parametrize("name,gpus,tokens,seq", [
    ("llama2-7b", 64, 1 << 20, 4096),
    ("llama3-70b", 128, 1 << 21, 8192),
    ("mixtral-8x7b", 32, 1 << 20, 4096),  # MoE: the runtime refuses MoE with cp or sp
])
def test_the_cluster_search_ranks_only_what_train_accepts(name, gpus, tokens, seq):
    model = load_model(name)
    res = search(model, load_hardware("h100"), gpus, tokens, seq, top=20, keep_points=False)
    assert len(res.top) == 20
    for c in res.top:
        assert _accepted(c.plan, model, gpus, tokens // seq), c.plan


def test_this_machines_search_tries_every_axis_and_only_valid_layouts():
    deep = TINY.replace(n_layers=4)  # room for pp 2 x 2 chunks
    moe = TINY.replace(experts=4, moe_ffn=32)
    for model, world in ((deep, 4), (moe, 4)):
        plans = list(runtime_plans(model, world, TC.global_batch))
        assert plans and len(set(plans)) == len(plans)
        assert all(_accepted(p, model, world, TC.global_batch) for p in plans)
    dense = list(runtime_plans(deep, 4, TC.global_batch))
    seen = {(p.tp > 1, p.pp > 1, p.cp > 1, p.zero, p.sp, p.recompute) for p in dense}
    assert {(True, False, False, 0, True, "none"), (False, True, False, 1, False, "full"),
            (False, False, True, 3, False, "selective")} <= seen
    assert {p.schedule for p in dense if p.pp > 1} >= {"gpipe", "1f1b", "interleaved", "zb-h1"}
    assert {p.cp_algorithm for p in dense if p.cp > 1} == {"ring", "all-to-all"}
    moe_plans = list(runtime_plans(moe, 4, TC.global_batch))
    assert any(p.ep == 4 for p in moe_plans)
    assert any(p.cp > 1 for p in moe_plans) and any(p.sp for p in moe_plans)  # issue 25


def test_the_ranking_is_the_predictions_order_and_respects_limits_and_fixed_flags():
    ranked = rank_layouts(TINY, TC, 4, MACHINE)
    steps = [r.step_s for r in ranked]
    assert steps == sorted(steps)
    assert len(ranked) == len(list(runtime_plans(TINY, 4, TC.global_batch)))
    limit = sorted(r.memory_bytes for r in ranked)[len(ranked) // 2]
    small = rank_layouts(TINY, TC, 4, MACHINE, max_memory_bytes=limit)
    assert 0 < len(small) < len(ranked) and all(r.memory_bytes <= limit for r in small)
    tp2 = constrained(ranked, {"tp": 2, "zero": 1})
    assert tp2 and all(r.plan.tp == 2 and r.plan.zero == 1 for r in tp2)


def test_kendall_tau_by_hand():
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    # one discordant pair of six: (5 - 1) / 6
    assert math.isclose(kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]), 4 / 6)
    # tau-b with a tie in x: concordant 2, discordant 0, tied-in-x 1 -> 2 / sqrt(3 * 2)
    assert math.isclose(kendall_tau([1, 1, 2], [1, 2, 3]), 2 / math.sqrt(6))


def test_the_verdict_names_the_winner_and_its_gap():
    recs = [{"layout": n, "predicted_rank": k, "predicted_s": p, "measured_s": m,
             "error": p / m - 1}
            for n, k, p, m in (("a", 1, 1.0, 1.2), ("b", 2, 1.1, 1.0), ("c", 9, 2.0, 2.5))]
    v = verdict(recs)
    assert v["winner"] == "a" and not v["winner_is_measured_best"]
    assert v["kendall_tau_search"] == v["kendall_tau"]  # no separate search figure given
    assert math.isclose(v["winner_over_best"], 0.2)
    assert [r["measured_place"] for r in v["records"]] == [2, 1, 3]
    assert math.isclose(v["kendall_tau"], 1 / 3)


def test_verify_picks_the_top_k_and_k_others_at_random_reproducibly():
    ranked = rank_layouts(TINY, TC, 4, MACHINE)
    a, b = pick(ranked, 3, seed=1), pick(ranked, 3, seed=1)
    assert [r for _, r in a] == [r for _, r in b]
    assert [why for why, _ in a] == ["top"] * 3 + ["random"] * 3
    assert [r for _, r in a[:3]] == ranked[:3]
    assert not {id(r) for _, r in a[3:]} & {id(r) for r in ranked[:3]}


def test_the_emitted_config_reads_back_to_the_same_run(tmp_path):
    mcfg, tcfg = TINY.replace(n_layers=4), TrainConfig(steps=20, global_batch=8, lr=3e-3)
    for plan in itertools.islice(runtime_plans(mcfg, 4, 8), 0, None, 97):
        path = write_run_toml(tmp_path / "run.toml", mcfg, tcfg, plan, "a header")
        assert resolve(str(path), {}, {}, {}, 4) == (mcfg, tcfg, plan), run_toml(
            mcfg, tcfg, plan)


def test_plan_search_emit_config_writes_a_run_train_accepts(tmp_path, capsys):
    out = tmp_path / "run.toml"
    assert main(["plan", "--search", "--model", "llama2-7b", "--gpus", "64",
                 "--emit-config", str(out)]) == 0
    mcfg, tcfg, plan = resolve(str(out), {}, {}, {}, 64)
    assert plan.world_size == 64 and mcfg.d_model == 4096 and mcfg.context == 4096
    assert _accepted(plan, mcfg, 64, tcfg.global_batch)
    assert "wrote" in capsys.readouterr().out
    # a model the runtime does not build is refused by name, before the search
    assert main(["plan", "--search", "--model", "gpt3-175b", "--gpus", "64",
                 "--emit-config", str(tmp_path / "x.toml")]) == 2
    assert "mlp = 'gelu'" in capsys.readouterr().err


def test_emit_config_to_a_missing_folder_is_refused_before_any_work(tmp_path, capsys):
    assert main(["plan", "--search", "--emit-config", str(tmp_path / "no" / "run.toml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --emit-config") and "does not exist" \
        in err[0]


@pytest.mark.slow
def test_plan_search_verify_runs_the_layouts_and_reports_tau(tmp_path):
    """A real verification on 2 processes: top 2 and 2 random layouts of a tiny model,
    trained for 3 steps each; the JSON record carries every field the table prints."""
    cfg = tmp_path / "tiny.toml"
    write_run_toml(cfg, TINY, TrainConfig(global_batch=4), ParallelPlan(dp=2))
    # a fresh box calibrates first: the flow is tested, not the machine's steadiness
    r = subprocess.run([sys.executable, "-m", "paratrain.cli", "plan", "--search",
                        "--config", str(cfg), "--nproc", "2", "--verify", "2",
                        "--verify-steps", "3", "--json"],
                       capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PARATRAIN_STABLE_CV": "inf",
                            "PARATRAIN_STABLE_ROUNDS": "1"})
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    v = rec["verify"]
    assert len(v["records"]) == 4 and [x["picked"] for x in v["records"]] == \
        ["top", "top", "random", "random"]
    assert all(x["measured_s"] > 0 and x["predicted_s"] > 0 for x in v["records"])
    assert -1.0 <= v["kendall_tau"] <= 1.0
    assert v["winner"] == describe(ParallelPlan(**rec["top"][0]["plan"]))


@pytest.mark.slow
@pytest.mark.timeout(900)  # calibration and the CPU fit, one round each
def test_train_plan_auto_calibrates_a_fresh_machine_then_trains_the_winner(tmp_path,
                                                                           text_file):
    """`paratrain train --plan auto` from a fresh profile (HOME is empty): it says it
    calibrates, prints the top 5 and why the winner wins, trains the winner, and ends
    with the prediction beside the measurement."""
    import os

    from conftest import tiny_flags

    # the flow, not the machine's steadiness (tests/test_calibrate_stability.py checks
    # that on injected timings): the first calibration round counts
    env = {**os.environ, "HOME": str(tmp_path / "home"), "PARATRAIN_STABLE_CV": "inf",
           "PARATRAIN_STABLE_ROUNDS": "1"}
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "paratrain.cli", "train", "--nproc", "2",
                        "--plan", "auto", "--steps", "3", "--global-batch", "4",
                        "--data", text_file, "--run-dir", str(run_dir), *tiny_flags()],
                       capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "calibrating first" in out and "fitting this machine's compute constants" in out
    assert (tmp_path / "home" / ".cache" / "paratrain" / "hardware.toml").is_file()
    assert "the top 5:" in out and "why the winner wins:" in out
    first = out.split("the top 5:")[1].splitlines()[2]  # after the header row
    summary = json.loads((run_dir / "summary.json").read_text())
    assert first.split()[0] == "1" and describe(ParallelPlan(**summary["plan"]))[:40] in first
    assert "predicted s/step" in out


def test_the_top_and_the_why_fit_80_columns():
    from paratrain.predict.layouts import bullets, format_top, why_the_winner_wins

    ranked = rank_layouts(TINY.replace(n_layers=4), TC, 4, MACHINE)
    text = format_top(ranked, 5) + "\n" + bullets(why_the_winner_wins(ranked))
    assert max(map(len, text.splitlines())) <= 80
    assert describe(ranked[0].plan) in text.splitlines()[1]
