"""The one-line contract, everywhere: every bad value, file, path or flag reaches the user as
exactly one ``error:`` line on stderr and exit code 2, from the real CLI, before any work
(issue 21 items 8-13; issue 23 item 12: flag-spelled TOML keys)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from paratrain.cli import main
from paratrain.cli.settings import resolve
from paratrain.systems.runs import DEFAULT_RUNS

ROOT = Path(__file__).resolve().parents[1]


def one_error(capsys, argv: list[str]) -> str:
    """Run the real CLI; require exit 2 and exactly one ``error:`` line; return it."""
    code = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def toml(tmp_path: Path, text: str, name: str = "run.toml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def small_runs(tmp_path: Path, n: int = 3) -> str:
    """The first ``n`` priced rows of the shipped runs table (a fit on them is quick)."""
    with DEFAULT_RUNS.open(newline="") as f:
        reader = csv.DictReader(f)
        rows = [r for r in reader][:n]
    out = tmp_path / "runs.csv"
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=reader.fieldnames)
        w.writeheader()
        w.writerows(rows)
    return str(out)


def run_dir(tmp_path: Path, summary: str | None = None) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0, "lr": 1e-3}) + "\n")
    if summary is not None:
        (d / "summary.json").write_text(summary)
    return d


# ---- item 8: output paths are checked before the work ----------------------------------
def test_report_out_under_a_file_is_one_line(capsys, tmp_path):
    d = run_dir(tmp_path)
    (tmp_path / "afile").write_text("x")
    line = one_error(capsys, ["report", str(d), "--out", str(tmp_path / "afile" / "r.html")])
    assert "afile" in line and "is a file, not a folder" in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a 0555 folder, so there "
                    "is nothing to refuse (a read-only mount is refused by the same probe)")
def test_report_in_a_read_only_run_dir_is_one_line(capsys, tmp_path):
    d = run_dir(tmp_path)
    d.chmod(0o555)
    try:
        line = one_error(capsys, ["report", str(d)])
    finally:
        d.chmod(0o755)
    assert "not writable" in line and "--out" in line


def test_validate_out_is_checked_before_the_fit(capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "x.toml"
    line = one_error(capsys, ["validate", "--runs", small_runs(tmp_path), "--fit",
                              "--out", str(out)])
    assert "--out" in line and "is a file, not a folder" in line
    assert "fit of" not in capsys.readouterr().out  # nothing was fitted


# ---- item 9: impossible step-model parameters --------------------------------------------
@pytest.mark.parametrize("text, fragment", [
    ("hbm_eff = nan\n", "hbm_eff = nan is outside its physical range [0.3, 1]"),
    ("[gemm_eff]\na100 = -5\n", "gemm_eff.a100 = -5 is outside its physical range"),
    ("kernel_s = 1.0\n", "kernel_s = 1.0 is outside"),
    ('hbm_eff = "fast"\n', "hbm_eff = 'fast'"),
    ('name = "H100"\npeak_tflops = 989\n', "name, peak_tflops that are no step-model"),
])
def test_bad_params_are_refused_by_name(capsys, tmp_path, text, fragment):
    p = toml(tmp_path, text, "params.toml")
    line = one_error(capsys, ["validate", "--runs", small_runs(tmp_path), "--params", p])
    assert fragment in line and "params.toml" in line


def test_the_shipped_params_are_inside_their_ranges():
    from paratrain.systems.fitting import load_params

    load_params()  # raises if a fitted value left its documented range


# ---- item 10: sizes are bounded before any loop ------------------------------------------
def test_a_billion_layers_is_refused_by_plan_and_train(capsys):
    for cmd in (["plan"], ["train", "--nproc", "1"]):
        line = one_error(capsys, [*cmd, "--layers", "1000000000"])
        assert "n_layers = 1000000000 (--layers): must be an integer in [1, 4096]" in line


@pytest.mark.parametrize("layers", ["1000000000", "100000000000000000000000"])
def test_a_model_file_with_huge_depth_is_refused(capsys, tmp_path, layers):
    m = toml(tmp_path, f'name = "deep"\nn_layers = {layers}\nd_model = 64\nn_heads = 4\n'
             "d_ff = 128\nvocab_size = 100\n", "deep.toml")
    assert f"n_layers = {layers}" in one_error(capsys, ["plan", "--model", m])


def test_steps_beyond_the_maximum_are_refused(capsys, tmp_path):
    cfg = toml(tmp_path, f"[train]\nsteps = {10**18}\n")
    assert "steps = 1000000000000000000 (--steps): must be an integer in [1, 1000000000]" \
        in one_error(capsys, ["plan", "--config", cfg])


# ---- item 11: what only a worker would have seen -----------------------------------------
@pytest.mark.parametrize("table, fragment", [
    (f"[train]\nseed = {10**18}\n", "seed = 1000000000000000000 (--seed): must be an integer"),
    ("[model]\nvocab_size = 1\n", "vocab_size = 1: must be an integer in [2, "),
    ("[model]\nrope_theta = -1.0\n", "rope_theta = -1.0: must be a number in (1, 1e+12]"),
    ("[model]\nnorm_eps = 0.0\n", "norm_eps = 0.0: must be a number in (0, 1)"),
])
def test_the_launcher_refuses_what_a_worker_would_trip_on(capsys, tmp_path, table, fragment):
    line = one_error(capsys, ["train", "--config", toml(tmp_path, table), "--nproc", "2"])
    assert fragment in line


# ---- item 12: flags, records, torchrun -----------------------------------------------------
@pytest.mark.parametrize("args, want", [
    (["--lr", "fast"], "error: --lr: 'fast' is not a number; pass e.g. --lr 0.003 "
                       "(see `paratrain train --help`)"),
    (["--steps", "2.5"], "error: --steps: '2.5' is not an integer; pass e.g. --steps 300"),
    (["--bogus-flag"], "error: --bogus-flag is not a flag of `paratrain train` "
                       "(see `paratrain train --help`)"),
    (["--glbal-batch", "4"], "did you mean --global-batch?"),
    (["--lr"], "--lr' requires an argument (see `paratrain train --help`)"),
])
def test_flag_errors_are_one_line(capsys, args, want):
    assert want in one_error(capsys, ["train", *args])


@pytest.mark.parametrize("name, data, fragment", [
    ("bad.jsonl", b'{"text": "abc"}\n{"text": \n', "cannot be read as json records"),
    ("fake.parquet", b"not a parquet file", "cannot be read as parquet records"),
    ("null.jsonl", b'{"text": null}\n', "has no text in field 'text' (null or absent)"),
])
def test_bad_records_are_one_line_without_datasets_logs(tmp_path, name, data, fragment):
    p = tmp_path / name
    p.write_bytes(data)
    # a subprocess: datasets' log handler holds the real stderr, which capsys cannot see
    r = subprocess.run([sys.executable, "-m", "paratrain.cli", "train", "--nproc", "1",
                        "--steps", "1", "--data", str(p)], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ") and fragment in lines[0] and name in lines[0]


@pytest.mark.parametrize("rank, lines", [("0", 1), ("1", 0)])
def test_under_torchrun_only_rank_0_prints(capsys, monkeypatch, rank, lines):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    assert main(["train", "--bogus-flag"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == lines


@pytest.mark.slow
def test_torchrun_with_a_bad_flag_prints_one_error_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node=2", "-m", "paratrain.cli", "train", "--bogus-flag"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    errors = [x for x in (r.stdout + r.stderr).splitlines() if x.startswith("error:")]
    assert r.returncode != 0
    # torchrun's own ChildFailedError report follows; it cannot be silenced from a worker
    assert errors == ["error: --bogus-flag is not a flag of `paratrain train` "
                      "(see `paratrain train --help`)"], r.stderr[-2000:]


# ---- item 13: messages that say what to fix -----------------------------------------------
def test_duplicate_toml_key_names_file_and_key(capsys, tmp_path):
    cfg = toml(tmp_path, "[model]\nd_model = 64\nd_model = 32\n")
    line = one_error(capsys, ["plan", "--config", cfg])
    assert "run.toml" in line and "line 3: 'd_model' is given twice; keep one" in line


@pytest.mark.parametrize("argv", [
    lambda p: ["plan", "--config", p],
    lambda p: ["plan", "--model", p],
])
def test_non_utf8_toml_names_the_file(capsys, tmp_path, argv):
    p = tmp_path / "latin1.toml"
    p.write_bytes(b'name = "caf\xe9"\n')
    line = one_error(capsys, argv(str(p)))
    assert "latin1.toml" in line and "is not UTF-8 text (byte 0xe9" in line


def test_non_utf8_runs_csv_names_the_file(capsys, tmp_path):
    p = tmp_path / "runs.csv"
    p.write_bytes(b"id,model\nr\xe9,x\n")
    line = one_error(capsys, ["validate", "--runs", str(p)])
    assert "runs.csv" in line and "not UTF-8" in line


def test_header_only_runs_csv_says_so(capsys, tmp_path):
    p = tmp_path / "runs.csv"
    p.write_text("id,model\n")
    assert "has a header but no rows" in one_error(capsys, ["validate", "--runs", str(p)])


@pytest.mark.parametrize("table, want", [
    ("[train]\nbeta1 = 2.0\n", "beta1 = 2.0: must be a number in [0, 1); set e.g. beta1 = 0.9"),
    ("[train]\ncheckpoint_every = -1\n",
     "checkpoint_every = -1 (--checkpoint-every): must be an integer in [0, 1000000000]"),
    ("[plan]\nzero = 5\n", "zero = 5 (--zero): must be 0, 1, 2 or 3; pass e.g. --zero 0"),
])
def test_field_errors_name_key_value_flag_and_range(capsys, tmp_path, table, want):
    assert one_error(capsys, ["plan", "--config", toml(tmp_path, table)]).startswith(
        f"error: {want}")


def test_zero_flag_error_names_the_flag(capsys):
    assert "zero = 5 (--zero): must be 0, 1, 2 or 3" in one_error(
        capsys, ["train", "--nproc", "1", "--zero", "5"])


@pytest.mark.parametrize("path, what", [("/dev/null", "is not a regular file"),
                                        (".", "is a directory")])
def test_config_that_is_no_file(capsys, path, what):
    assert what in one_error(capsys, ["plan", "--config", path])


def test_bad_summary_json_names_the_file(capsys, tmp_path):
    d = run_dir(tmp_path, summary="{not json")
    line = one_error(capsys, ["report", str(d)])
    assert "summary.json" in line and "is not a run summary" in line


def test_bad_json_model_file_names_the_file(capsys, tmp_path):
    p = tmp_path / "m.json"
    p.write_text('{"n_layers": 2,}')
    assert "'" + str(p) + "' is not valid JSON" in one_error(capsys, ["plan", "--model",
                                                                       str(p)])


# ---- issue 23 item 12: a TOML key may be spelled as its flag -------------------------------
def test_flag_spelled_toml_keys_are_the_fields(tmp_path):
    cfg = toml(tmp_path, "[model]\nlayers = 3\nheads = 2\nkv_heads = 1\nd_model = 32\n")
    m, _, _ = resolve(cfg, {}, {}, {}, 1)
    assert (m.n_layers, m.n_heads, m.n_kv_heads) == (3, 2, 1)
    m, _, _ = resolve(cfg, {"n_layers": 5}, {}, {}, 1)  # the flag still wins
    assert m.n_layers == 5


def test_both_spellings_in_one_table_are_refused(capsys, tmp_path):
    cfg = toml(tmp_path, "[model]\nlayers = 2\nn_layers = 3\n")
    line = one_error(capsys, ["plan", "--config", cfg])
    assert line == "error: [model] gives both n_layers and layers (one field, the flag " \
                   "--layers); keep one"
