"""The user surface of `paratrain train`: real console script, real torchrun, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import TINY, tiny_flags
from paratrain.cli import main

TINY_FLAGS = [*tiny_flags(TINY.replace(context=32)), "--global-batch", "8", "--quiet"]


@pytest.mark.slow
def test_train_steps_5_with_defaults_through_torchrun(tmp_path, paratrain_exe):
    """README's main job, shortened: 2 workers, default model and corpus."""
    run = tmp_path / "run"
    r = subprocess.run([paratrain_exe, "train", "--steps", "5", "--run-dir", str(run)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "validation loss" in r.stdout and "unigram baseline" in r.stdout
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [0, 1, 2, 3, 4]
    for key in ("loss", "lr", "tokens_per_s"):
        assert all(isinstance(rec[key], float) for rec in recs)
    assert "val_loss" in recs[-1]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["payload_bytes_per_step"] > 0


@pytest.mark.slow
def test_torchrun_directly_and_toml_config(tmp_path, text_file):
    cfg = tmp_path / "run.toml"
    cfg.write_text('[model]\nn_layers = 2\nd_model = 32\nn_heads = 4\nd_ff = 64\n'
                   'context = 32\n[train]\nsteps = 3\nglobal_batch = 8\n'
                   f'data = "{text_file}"\n')
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node=2", "-m", "paratrain.cli", "train", "--config",
                        str(cfg), "--run-dir", str(run), "--quiet"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3


def test_nproc_1_runs_in_process(tmp_path, text_file):
    code = main(["train", "--nproc", "1", "--steps", "2", "--data", text_file,
                 "--run-dir", str(tmp_path), *TINY_FLAGS])
    assert code == 0
    assert (tmp_path / "summary.json").is_file()


@pytest.mark.parametrize("args, fragment", [
    (["--global-batch", "15", "--nproc", "2"], "not divisible by dp*micro_batches"),
    (["--data", "/no/such/file.txt"], "does not exist"),
    (["--lr", "-1"], "lr = -1.0 (--lr): must be a number >= 0"),
    (["--layers", "0"], "n_layers = 0 (--layers)"),
    (["--tp", "3", "--nproc", "3"], "tp=3 does not divide n_heads"),
    (["--nproc", "3", "--dp", "2"], "but there are 3 processes"),
    (["--dtype", "float16"], "dtype='float16'"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--simulate-workers", "4"], "add --nproc 1"),
    (["--pp", "2", "--tie-embeddings"], "tied embeddings with pp=2"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, args, fragment):
    base = TINY_FLAGS
    if "--global-batch" in args:
        base = [a for a in TINY_FLAGS if a != "--global-batch" and a != "8"]
    code = main(["train", *base, *args])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert fragment in err and len(err.splitlines()) == 1, err


def test_bad_input_exit_code_from_the_console_script(paratrain_exe):
    r = subprocess.run([paratrain_exe, "train", "--global-batch", "7"], capture_output=True,
                       text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error: global batch 7 is not divisible")
    assert "Traceback" not in r.stderr


def test_unknown_flag_is_refused():
    assert main(["train", "--no-such-flag"]) == 2
