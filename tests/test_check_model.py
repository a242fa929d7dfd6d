"""`paratrain check-model` end to end on a 2-plan mini grid (real gloo, tiny model): the
JSON has one record per plan with predicted and measured step times and exact bytes. The
accuracy itself is a benchmark's business (benchmarks/check_model.py), not a test's."""

from __future__ import annotations

import json

import pytest

from conftest import tiny_flags
from paratrain.cli import main
from paratrain.run.check_model import format_table

TINY_FLAGS = [*tiny_flags(), "--global-batch", "8", "--steps", "3"]


@pytest.fixture
def profile(tmp_path):
    path = tmp_path / "hardware.toml"
    path.write_text('name = "test-box"\npeak_flops = 4e9\nhbm_bytes = 8e9\nhbm_bw = 1e10\n'
                    'gpus_per_node = 2\nintra_bw = 1e9\nintra_alpha = 1e-4\n'
                    'inter_bw = 1e9\ninter_alpha = 1e-4\n')
    return str(path)


@pytest.mark.slow
def test_mini_grid_json(profile, text_file, capsys):
    code = main(["check-model", "--plans", "mini", "--no-fit", "--profile", profile,
                 "--data", text_file, "--json", *TINY_FLAGS])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    recs = out["records"]
    assert [r["plan"] for r in recs] == ["dp2", "dp2 zero1"]
    for r in recs:
        assert r["nproc"] == 2
        assert r["predicted_s"] > 0 and r["measured_s"] > 0
        assert r["error"] == pytest.approx(r["predicted_s"] / r["measured_s"] - 1)
        assert r["wire_exact"] and r["states_exact"]
        assert 0 < r["share"] <= 1
    errs = [abs(r["error"]) for r in recs]
    assert out["median_abs_error"] == pytest.approx(sum(errs) / 2)
    text = format_table(out)
    assert "median absolute error of step time" in text
    assert "wire bytes exact 2/2; model states exact on every rank 2/2" in text


def test_refusals(profile, capsys, tmp_path):
    assert main(["check-model", "--plans", "dp3", "--profile", profile]) == 2
    assert "unknown plan" in capsys.readouterr().err
    assert main(["check-model", "--plans", "dp2", "--profile", str(tmp_path / "none.toml")]) == 2
    assert "paratrain bench calibrate" in capsys.readouterr().err


def test_fit_on_a_busy_machine_is_refused(profile, capsys, monkeypatch):
    """Injected fit timings that never settle (1 s, 3 s, 1 s, ...: a busy machine misses
    by multiples): one line, exit 2, naming the command to run again; nothing is
    trained."""
    import itertools

    from paratrain.run import check_model as cm

    times = itertools.cycle([1.0, 3.0])
    monkeypatch.setattr(cm, "_thread_peak", lambda: 1e10)
    monkeypatch.setattr(cm, "_one_process", lambda *a: next(times))
    assert main(["check-model", "--plans", "dp2", "--profile", profile]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the machine was too busy to calibrate: the fit run's CPU")
    assert "`paratrain check-model` again" in err and "\n" not in err


def test_every_grid_plan_passes_the_runtime_checks():
    """CP (ring, all-to-all) and EP join the grid; the EP plan trains a small MoE."""
    from paratrain.run.check_model import GRID, GRID_BATCH, GRID_MODEL, plan_model

    assert {"cp2 ring", "cp2 all-to-all", "dp2 x ep2"} <= set(GRID)
    for name, plan in GRID.items():
        model = plan_model(plan, GRID_MODEL)
        assert bool(model.experts) == (plan.ep > 1), name
        plan.check_run(model, plan.world_size, GRID_BATCH)
    assert {p.cp_algorithm for p in GRID.values() if p.cp > 1} == {"ring", "all-to-all"}
