"""benchmarks/fsdp_tp.py smoke test: paratrain's 2-D FSDP x TP (dp 2, tp 2, ZeRO-3) and
torch's FSDP2 + DTensor TP both run on 4 gloo ranks with a tiny model, write the JSON the
docstring promises, and compute the same first-step loss.

Tolerance: 1e-5 absolute on a loss of ~5.5 nats. Both start from identical weights and
the same batch, in float32, so the first step's loss differs only by the order of
additions in the row-parallel all-reduces and the vocabulary-parallel cross-entropy
(a few ulps; measured 0 to 1e-7); later steps may drift by rounding and are not checked.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "benchmarks" / "fsdp_tp.py"
TINY = ["--n-layers", "1", "--d-model", "64", "--n-heads", "4", "--d-ff", "128",
        "--context", "32", "--batch", "4"]


@pytest.mark.slow
def test_fsdp_tp_benchmark_runs_both_and_agrees(tmp_path):
    out = tmp_path / "fsdp_tp.json"
    run = subprocess.run([sys.executable, str(BENCH), "--rounds", "1", "--steps", "2", *TINY,
                          "--timeout", "120", "--json", str(out)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "median of the per-round ratios: tokens/s" in run.stdout
    assert "largest |loss difference|" in run.stdout
    records = json.loads(out.read_text())
    assert {r["impl"] for r in records} == {"paratrain-fsdp-tp", "torch-fsdp2-tp"}
    for r in records:
        assert r["round"] == 0 and r["tokens_per_s"] > 0
        assert len(r["peak_rss_mb"]) == 4 and all(m > 0 for m in r["peak_rss_mb"])
        assert len(r["losses"]) == 3  # 1 warm-up + 2 timed steps
    ours, theirs = (next(r for r in records if r["impl"] == i)
                    for i in ("paratrain-fsdp-tp", "torch-fsdp2-tp"))
    assert ours["zero"] == 3
    assert abs(ours["losses"][0] - theirs["losses"][0]) < 1e-5, (ours["losses"],
                                                                 theirs["losses"])
