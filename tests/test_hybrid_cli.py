"""`paratrain train` with model-parallel flags: prints the mesh and the measured-vs-
predicted report, writes the pipeline timeline; impossible plans exit 2 in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import max_rel_diff, tiny_flags

TINY_FLAGS = [*tiny_flags(), "--global-batch", "4", "--steps", "2", "--eval-every", "0"]


def paratrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "paratrain.cli", "train", *args],
                          capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_tp_pp_run_prints_mesh_and_report(text_file, tmp_path):
    run = tmp_path / "run"
    r = paratrain("--nproc", "4", "--tp", "2", "--pp", "2", "--sp", "--micro-batches", "2",
                  "--schedule", "1f1b", "--data", text_file, "--run-dir", str(run), *TINY_FLAGS)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "mesh pp=2 x dp=1 x tp=2" in r.stdout
    assert "stage 1 (pp rank 1, chunk 0): blocks [1, 2) + norm, head" in r.stdout
    assert "pipeline 1f1b p=2 m=2 v=1: bubble measured" in r.stdout
    assert "tensor parallel (sp=True)" in r.stdout
    rec = json.loads((run / "pipeline_timeline.json").read_text())
    assert len(rec["timeline"]) == 2 and rec["schedule"] == "1f1b"


def test_impossible_plans_exit_2_with_one_line(text_file):
    for nproc, bad in (("6", ["--tp", "3"]), ("2", ["--tp", "2", "--sp", "--context", "15"])):
        r = paratrain("--nproc", nproc, "--data", text_file, *TINY_FLAGS, *bad)
        assert r.returncode == 2, (bad, r.stderr[-500:])
        lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
        assert len(lines) == 1, r.stderr


@pytest.mark.slow
def test_fsdp_with_tp_from_the_cli_matches_one_process(text_file, tmp_path):
    """`--nproc 4 --tp 2 --zero 3` runs from the command line and reproduces one process
    (float64), printing the mesh and the FSDP units it built."""
    runs = {}
    for name, flags in (("one", ["--nproc", "1"]),
                        ("tp2 zero3", ["--nproc", "4", "--tp", "2", "--zero", "3"])):
        run = tmp_path / name.replace(" ", "_")
        r = paratrain(*flags, "--dtype", "float64", "--data", text_file, "--run-dir", str(run),
                      *TINY_FLAGS)
        assert r.returncode == 0, r.stderr[-2000:]
        runs[name] = (r.stdout, [json.loads(x)["loss"] for x in
                                 (run / "metrics.jsonl").read_text().splitlines()])
    out, losses = runs["tp2 zero3"]
    assert "mesh pp=1 x dp=2 x tp=2" in out and "ZeRO-3: " in out and "FSDP units" in out
    ref = runs["one"][1]
    assert len(losses) == len(ref) == 2
    assert max_rel_diff(losses, ref) <= 1e-9
