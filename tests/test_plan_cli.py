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
            "--tokens", "2097152", "--context", "8192", "--tp", "8", "--pp", "4", "--sp",
            "--zero", "1", "--micro-batches", "8", "--schedule", "interleaved",
            "--virtual-stages", "2", "--recompute", "selective", "--no-overlap", "--eta", "0.5"]
    assert main(args) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["plan"]["dp"] == 4 and rep["hardware"]["eta"] == 0.5
    s = rep["step"]
    assert s["bubble_s"] > 0 and s["tp_comm_s"] > 0 and s["pp_comm_s"] > 0
    assert s["dp_exposed_s"] == s["dp_comm_s"]  # --no-overlap
    assert s["hfu_sync"] > s["mfu_sync"]  # selective recomputation


def test_fp8_prices_the_step_models_fp8_gemms_and_search_ranks_with_them(capsys):
    """--fp8 goes to the step model (the same call validate makes for an FP8 row): a
    shorter step than BF16's, said in the JSON; memory is fp8-adam's (bf16-adam's
    states, the linear inputs kept in FP8: fewer activation bytes); the search prices
    every layout so."""
    base = ["plan", "--json", "--model", "llama3-70b", "--gpus", "64", "--tp", "8",
            "--pp", "2", "--sp", "--micro-batches", "16"]
    reps = []
    for extra in ([], ["--fp8"]):
        assert main(base + extra) == 0
        reps.append(json.loads(capsys.readouterr().out))
    bf, f8 = (r["predicted"] for r in reps)
    assert (bf["fp8"], f8["fp8"]) == (False, True)
    from paratrain.cost.hardware import load_hardware
    from paratrain.cost.shapes import load_model
    from paratrain.plan import ParallelPlan
    from paratrain.systems.fitting import load_params
    from paratrain.systems.step_model import predict_step

    plan = ParallelPlan(dp=4, tp=8, pp=2, sp=True, micro_batches=16)
    for rec, fp8 in ((bf, False), (f8, True)):  # exactly the library's prices
        want = predict_step(load_model("llama3-70b"), plan, load_hardware("h100"),
                            1_048_576, 4096, load_params(), "megatron", fp8=fp8)
        assert rec["step_s"] == pytest.approx(want.step_s, rel=1e-12)
    assert f8["step_s"] < bf["step_s"]
    from paratrain.cost.memory import memory

    (b16, m8), states = (r["memory"] for r in reps), ("weights_bytes", "grads_bytes",
                                                        "optimizer_bytes")
    assert [b16[k] for k in states] == [m8[k] for k in states]
    want = memory(load_model("llama3-70b"), plan, load_hardware("h100"), 1_048_576, 4096,
                  "fp8-adam", "flash")
    assert m8["activations_bytes"] == want.activations_bytes < b16["activations_bytes"]
    tops = []
    for extra in ([], ["--fp8"]):
        assert main(["plan", "--search", "--json", "--model", "llama3-70b", "--gpus", "64",
                     "--top", "1", *extra]) == 0
        res = json.loads(capsys.readouterr().out)
        tops.append(res["top"][0]["step_s"])
        assert res["fp8"] == bool(extra)
    assert tops[1] < tops[0]


def test_fp8_scaling_names_the_recipe_the_step_model_prices(capsys):
    """--fp8-scaling rowwise (torchao's row-scaled recipe: more casts, slower GEMMs,
    systems/layer_cost.py) is the library's price at that recipe, said in the JSON, and
    a longer step than tensorwise's (the default, what --fp8 alone prices)."""
    from paratrain.cost.hardware import load_hardware
    from paratrain.cost.shapes import load_model
    from paratrain.plan import ParallelPlan
    from paratrain.systems.fitting import load_params
    from paratrain.systems.step_model import predict_step

    base = ["plan", "--json", "--model", "llama3-8b", "--gpus", "8", "--fp8"]
    reps = {}
    for scaling in ("tensorwise", "rowwise", None):
        assert main(base + (["--fp8-scaling", scaling] if scaling else [])) == 0
        reps[scaling] = json.loads(capsys.readouterr().out)["predicted"]
    assert (reps["rowwise"]["fp8"], reps[None]["fp8"]) == ("rowwise", True)
    assert reps["tensorwise"]["step_s"] == reps[None]["step_s"] < reps["rowwise"]["step_s"]
    want = predict_step(load_model("llama3-8b"), ParallelPlan(dp=8), load_hardware("h100"),
                        1_048_576, 4096, load_params(), "megatron", fp8="rowwise")
    assert reps["rowwise"]["step_s"] == pytest.approx(want.step_s, rel=1e-12)


def test_engine_options_price_in_plan_as_in_the_runs_table(capsys):
    """`--engine "torchtitan, torch.compile"` is read as a runs table's engine cell
    (row_engine.engine_as_said): the fused element-wise work shortens the step, and the
    search ranks with the same engine."""
    base = ["plan", "--json", "--model", "llama3-8b", "--gpus", "8", "--micro-batches", "4"]
    steps = []
    for eng in ("torchtitan", "torchtitan, torch.compile", "torchtitan (FSDP2, torch.compile)"):
        assert main(base + ["--engine", eng]) == 0
        steps.append(json.loads(capsys.readouterr().out)["predicted"]["step_s"])
    assert steps[1] < steps[0] and steps[1] == steps[2]
    tops = []
    for eng in ("torchtitan", "torchtitan, torch.compile"):
        assert main(["plan", "--search", "--json", "--model", "llama3-8b", "--gpus", "8",
                     "--top", "1", "--engine", eng]) == 0
        tops.append(json.loads(capsys.readouterr().out)["top"][0]["step_s"])
    assert tops[1] < tops[0]


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
    (["--zero", "4"], "zero = 4 (--zero)"),
    (["--tokens", "1000"], "not a multiple of seq_len"),
    (["--eta", "1.5"], "eta"),
    (["--sp"], "sequence parallelism"),
    (["--fp8", "--hardware", "a100"], "has no FP8 peak"),
    (["--fp8", "--reference"], "drop --reference"),
    (["--fp8-scaling", "rowwise"], "add --fp8"),
    (["--fp8", "--fp8-scaling", "colwise"], "'colwise' is unknown"),
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
            str(32 * 8192), "--context", "8192"]
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


RUNS = {  # a dense and an MoE run, both data parallel over 2 workers
    "dense": "[model]\nn_layers = 2\nd_model = 32\nn_heads = 4\nd_ff = 64\ncontext = 32\n"
             "[plan]\nzero = 1\n",
    "moe": "[model]\nn_layers = 2\nd_model = 32\nn_heads = 4\nd_ff = 64\ncontext = 32\n"
           "experts = 4\ntop_k = 2\nmoe_ffn = 48\nshared_experts = 1\n[plan]\nzero = 2\n",
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(RUNS))
def test_plan_config_prices_the_run_train_config_trains(kind, tmp_path, text_file, capsys):
    """Issue 20's "done when": `plan --config run.toml` and the summary of `train --config
    run.toml` agree on parameters, model-state bytes and wire bytes per rank."""
    cfg = tmp_path / "run.toml"
    cfg.write_text(RUNS[kind] + f'[train]\nsteps = 2\nglobal_batch = 8\neval_every = 0\n'
                                f'data = "{text_file}"\n')
    assert main(["train", "--config", str(cfg), "--nproc", "2", "--quiet",
                 "--run-dir", str(tmp_path / "run")]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    capsys.readouterr()
    assert main(["plan", "--config", str(cfg), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    run = rep["run"]
    assert rep["plan"]["gpus"] == summary["world_size"] == 2
    assert run["params"] == summary["params"] == rep["model"]["params"]
    assert run["active_params"] == summary["active_params"]
    states = [{k: m[k] for k in ("params", "grads", "optimizer")}
              for m in summary["memory"]["measured_per_rank"]]
    assert run["model_state_bytes_per_rank"] == states
    assert run["dp_wire_bytes_per_rank"][0] == summary["wire_bytes_per_step"]
    assert rep["plan"]["zero"] == summary["plan"]["zero"]
    assert rep["plan"]["tokens_per_step"] == summary["tokens_per_step"]


def test_old_plan_spellings_warn_once_and_mean_the_new(capsys):
    assert main(["plan", "--json", "--seq-len", "2048", "--attention", "flash"]) == 0
    out = capsys.readouterr()
    assert out.err.splitlines() == ["warning: --seq-len is deprecated; use --context",
                                    "warning: --attention flash is deprecated; use "
                                    "--attention sdpa"]
    old = json.loads(out.out)
    assert main(["plan", "--json", "--context", "2048", "--attention", "sdpa"]) == 0
    new = capsys.readouterr()
    assert new.err == "" and json.loads(new.out) == old


def test_plan_config_refuses_a_second_model(tmp_path, capsys):
    cfg = tmp_path / "run.toml"
    cfg.write_text("[model]\nn_layers = 2\n")
    assert main(["plan", "--config", str(cfg), "--model", "llama2-7b"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --model llama2-7b and --config")


@pytest.mark.parametrize("zero, hint", [(3, False), (1, False), (0, True)])
def test_under_a_pipeline_the_verdict_suggests_a_higher_zero_only_below_one(zero, hint,
                                                                           capsys):
    """Under a pipeline ZeRO 2 and 3 keep the stage's gradients (and weights) whole over
    the step, so nothing above ZeRO-1 saves memory there: the verdict does not suggest it."""
    assert main(["plan", "--model", "llama3-8b", "--gpus", "16", "--pp", "2",
                 "--zero", str(zero)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "does not fit" in out and ("a higher --zero" in out) == hint
