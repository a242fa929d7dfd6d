"""`paratrain viz pipeline` draws the schedule the runtime executes; --measured overlays a
recorded timeline; importing the viz CLI does not import torch."""

from __future__ import annotations

import json
import subprocess
import sys

from paratrain.cli import main
from paratrain.cost.pipeline_sim import simulate_pipeline
from paratrain.cost.schedule import build_schedule


def test_viz_cli_does_not_import_torch():
    code = "import sys, paratrain.cli.viz; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_gantt_predicted_and_measured(tmp_path):
    assert main(["viz", "pipeline", "--schedule", "zb-h1", "--pp", "4", "--micro-batches",
                 "8", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "pipeline_zb-h1_p4_m8.png").stat().st_size > 10_000
    sched = build_schedule("interleaved", 2, 4, 2)
    spans = simulate_pipeline(sched).spans  # a stand-in for a run's recorded timings
    run = tmp_path / "run"
    run.mkdir()
    (run / "pipeline_timeline.json").write_text(json.dumps({
        "schedule": "interleaved", "pp": 2, "micro_batches": 4, "virtual_stages": 2,
        "bubble_measured": 0.2,
        "timeline": [[[a.kind, a.mb, a.chunk, t0 / 100, t1 / 100] for a, t0, t1 in sp]
                     for sp in spans]}))
    assert main(["viz", "pipeline", "--schedule", "interleaved", "--pp", "2",
                 "--micro-batches", "4", "--virtual-stages", "2", "--measured", str(run),
                 "--out", str(tmp_path)]) == 0
    assert (tmp_path / "pipeline_interleaved_p2_m4_v2.png").is_file()
    # a timeline of another schedule, or an impossible schedule: one line, exit 2
    assert main(["viz", "pipeline", "--schedule", "1f1b", "--pp", "2", "--micro-batches", "4",
                 "--measured", str(run), "--out", str(tmp_path)]) == 2
    assert main(["viz", "pipeline", "--schedule", "interleaved", "--pp", "4",
                 "--micro-batches", "6", "--virtual-stages", "2", "--out", str(tmp_path)]) == 2


def test_gantt_draws_the_v_schedules(tmp_path, capsys):
    for name in ("zb-v", "dualpipev"):
        assert main(["viz", "pipeline", "--schedule", name, "--pp", "4", "--micro-batches",
                     "8", "--virtual-stages", "2", "--out", str(tmp_path)]) == 0
        assert (tmp_path / f"pipeline_{name}_p4_m8_v2.png").stat().st_size > 10_000
    capsys.readouterr()
    # one chunk per rank cannot make a V: one line naming the fix, exit 2
    assert main(["viz", "pipeline", "--schedule", "zb-v", "--pp", "4", "--micro-batches",
                 "8", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "virtual_stages=1 must be 2" in err[0]
