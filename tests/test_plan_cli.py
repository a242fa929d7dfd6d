"""`paratrain plan`: defaults print DESIGN.md's figures, --json, --plot, bad inputs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from paratrain.cli import main

FIGURES = ["13.5 GB", "0.052 s", "0.53 s", "26.5 GB", "3.2 s", "107.8", "28.2", "15.0",
           "1.7", "39.8", "1.64 s", "2.17 s / 1.64 s", "35.7 % / 47.3 %"]


def test_defaults_print_every_reference_figure(capsys):
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    for fig in FIGURES:
        assert fig in out, fig
    assert "6,738,415,616" in out and "does not fit" in out


def test_json_has_the_same_numbers(capsys):
    assert main(["plan", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["model"]["params"] == 6_738_415_616
    assert round(rep["gradient_sync"]["payload_bytes"] / 1e9, 1) == 13.5
    assert round(rep["gradient_sync"]["ring_allreduce_node_s"], 3) == 0.052
    assert round(rep["gradient_sync"]["ring_allreduce_dp_s"], 2) == 0.53
    assert round(rep["gradient_sync"]["tree_allreduce_dp_s"], 1) == 3.2
    assert [round(r["states_bytes"] / 1e9, 1) for r in rep["zero"]] == [107.8, 28.2, 15.0, 1.7]
    assert round(rep["zero"][3]["wire_bytes"] / 1e9, 1) == 39.8
    s = rep["step"]
    assert (round(s["step_sync_s"], 2), round(s["step_overlap_s"], 2)) == (2.17, 1.64)
    assert (round(100 * s["mfu_sync"], 1), round(100 * s["mfu_overlap"], 1)) == (35.7, 47.3)


def test_flags_change_the_plan(capsys):
    args = ["plan", "--json", "--model", "llama3-70b", "--hardware", "H200", "--gpus", "128",
            "--tokens", "2097152", "--seq-len", "8192", "--tp", "8", "--pp", "4", "--sp",
            "--zero", "1", "--micro-batches", "8", "--schedule", "interleaved",
            "--virtual-stages", "2", "--recompute", "selective", "--no-overlap", "--eta", "0.5"]
    assert main(args) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["plan"]["dp"] == 4 and rep["hardware"]["eta"] == 0.5
    s = rep["step"]
    assert s["bubble_s"] > 0 and s["tp_comm_s"] > 0 and s["pp_comm_s"] > 0
    assert s["dp_exposed_s"] == s["dp_comm_s"]  # --no-overlap
    assert s["hfu_sync"] > s["mfu_sync"]  # selective recomputation


def _is_png(path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_writes_valid_pngs(tmp_path, capsys):
    out = tmp_path / "plots"
    assert main(["plan", "--plot", str(out), "--micro-batches", "4",
                 "--recompute", "full"]) == 0
    import matplotlib.image as mpimg

    for name in ("memory.png", "step_time.png"):
        p = out / name
        assert p.is_file() and _is_png(p), name
        img = mpimg.imread(p)
        assert img.shape[0] > 100 and img.shape[1] > 100


@pytest.mark.parametrize("args, msg", [
    (["--model", "llama9"], "unknown model 'llama9'"),
    (["--hardware", "h1000"], "unknown hardware 'h1000'"),
    (["--tp", "3"], "does not divide gpus=64"),
    (["--tp", "7", "--gpus", "7"], "does not divide n_heads=32"),
    (["--dp", "4", "--tp", "2"], "there are 64 processes"),
    (["--pp", "64"], "exceeds n_layers=32"),
    (["--schedule", "zigzag"], "schedule='zigzag' is unknown"),
    (["--recompute", "some"], "recompute='some' is unknown"),
    (["--zero", "4"], "zero=4"),
    (["--tokens", "1000"], "not a multiple of seq_len"),
    (["--eta", "1.5"], "eta"),
    (["--sp"], "sequence parallelism"),
])
def test_bad_inputs_exit_2_with_one_line(args, msg, capsys):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and msg in err and "\n" not in err


def test_console_script_prints_the_reference_and_exits_2_on_bad_names(paratrain_exe):
    r = subprocess.run([paratrain_exe, "plan"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "47.3 %" in r.stdout
    r = subprocess.run([paratrain_exe, "plan", "--model", "nope"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().startswith("error: unknown model 'nope'")


def test_plan_command_does_not_import_torch():
    code = ("import sys\nfrom paratrain.cli import main\nrc = main(['plan', '--json'])\n"
            "assert rc == 0 and 'torch' not in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_step_model_beside_the_reference_and_reference_mode(capsys):
    from paratrain.systems.fitting import load_params
    from paratrain.systems.step_model import predict_step

    assert main(["plan", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    # the reference figures are untouched; the step model (fitted parameters) sits beside
    assert (round(rep["step"]["step_sync_s"], 2), round(rep["step"]["step_overlap_s"], 2)) \
        == (2.17, 1.64)
    from paratrain.cost.hardware import load_hardware
    from paratrain.cost.shapes import load_model
    from paratrain.plan import ParallelPlan

    bd = predict_step(load_model("llama2-7b"), ParallelPlan(dp=64), load_hardware("h100"),
                      1_048_576, 4096, load_params(), "megatron")
    assert rep["predicted"]["step_s"] == pytest.approx(bd.step_s)
    assert rep["predicted"]["engine"] == "megatron"
    assert main(["plan", "--json", "--reference"]) == 0
    assert "predicted" not in json.loads(capsys.readouterr().out)
    assert main(["plan", "--search", "--reference", "--gpus", "8", "--global-batch", "64",
                 "--top", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["top"][0]["mfu"] > 0


def test_moe_and_cp_flags(capsys):
    args = ["plan", "--json", "--model", "llama3-8b", "--gpus", "16", "--tokens",
            str(32 * 8192), "--seq-len", "8192"]
    assert main([*args, "--experts", "8", "--top-k", "2", "--ep", "4"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["predicted"]["comm_s"]["ep"] > 0 and "experts" in rep["predicted"]["gemm_s"]
    assert rep["model"]["active_params"] < rep["model"]["params"] / 2
    assert main([*args, "--cp", "2", "--cp-algorithm", "all-to-all", "--engine", "nemo"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["predicted"]["comm_s"]["cp"] > 0 and rep["predicted"]["engine"] == "nemo"
    assert main([*args, "--ep", "2"]) == 2
    assert "needs an MoE model" in capsys.readouterr().err
    assert main([*args, "--engine", "horovod"]) == 2
    assert "engine 'horovod' is unknown" in capsys.readouterr().err
