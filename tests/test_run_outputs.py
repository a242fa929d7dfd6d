"""What a run tells its user: where its outputs go and where it resumed from (one line
each, printed once, not once per rank), the one peak its MFU divides by, which figures
are the last step's and which are means, and every parallelism axis' bytes and seconds
as the runtime counted them. One real tp2 x pp2 run through `paratrain train` (torchrun,
4 gloo workers), resumed once; the peak's agreement across two real gloo processes.
Those runs are marked slow (a minute on a loaded 2-core machine, beyond the inner loop's
margin); the arithmetic of each item is checked without them."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
import torch

from conftest import TINY, tiny_flags
from paratrain.parallel.process_groups import spawn

STEPS = 3


def _train(paratrain_exe, text_file, d, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["COLUMNS"] = "220"  # no wrapped table cells or progress line
    r = subprocess.run([paratrain_exe, "train", "--nproc", "4", "--tp", "2", "--pp", "2",
                        "--micro-batches", "2", "--global-batch", "8", "--eval-every", "0",
                        "--data", text_file, "--run-dir", str(d / "run"),
                        "--checkpoint-dir", str(d / "ck"), "--checkpoint-every", "2",
                        "--keep-checkpoints", "2", *tiny_flags(), *extra],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    return r


@pytest.fixture(scope="module")
def run(tmp_path_factory, paratrain_exe, text_file):
    d = tmp_path_factory.mktemp("outputs")
    r = _train(paratrain_exe, text_file, d, "--steps", str(STEPS), "--tensorboard",
               str(d / "tb"))
    summary = json.loads((d / "run" / "summary.json").read_text())
    recs = [json.loads(x) for x in (d / "run" / "metrics.jsonl").read_text().splitlines()]
    return d, r.stdout, summary, recs


def _once(stdout: str, line: str) -> None:
    assert stdout.splitlines().count(line) == 1, (line, stdout[-4000:])


@pytest.mark.slow
def test_each_output_is_named_once(run):
    d, out, _, _ = run
    _once(out, f"run dir: {d / 'run'} (metrics.jsonl, summary.json; plots: paratrain "
               f"report {d / 'run'})")
    _once(out, f"checkpoints: {d / 'ck'} (every 2 steps and at the end, keep the newest 2)")
    _once(out, f"tensorboard: {d / 'tb'} (tensorboard --logdir {d / 'tb'})")
    peaks = [x for x in out.splitlines() if x.startswith("peak: ")]
    assert len(peaks) == 1 and re.fullmatch(
        r"peak: \d+\.\d GFLOP/s per rank \(matmul 512\^3 float32, best of 16 on each of 4 "
        r"ranks, max over ranks, measured before training\)", peaks[0]), peaks
    assert "resumed from" not in out


@pytest.mark.slow
def test_every_step_divides_by_the_one_peak(run):
    _, out, s, recs = run
    peak = s["peak_flops_per_rank"]
    assert f"peak: {peak / 1e9:.1f} GFLOP/s" in out
    assert s["peak"]["measured"] == "once, before training" and s["peak"]["ranks"] == 4
    flops = s["mfu"] * s["step_s"] * 4 * peak  # model FLOPs per step, from the summary
    for r in recs:
        assert r["peak_flops"] == peak
        assert r["mfu"] == pytest.approx(flops / r["step_s"] / 4 / peak, rel=1e-9)


@pytest.mark.slow
def test_last_step_and_means_are_labelled(run):
    _, out, s, recs = run
    assert s["mean_over_steps"] == [2, STEPS]
    last = [x for x in out.splitlines() if f"step {STEPS}/{STEPS}" in x][-1]
    assert (f"last step: loss {recs[-1]['loss']:.4f} | {recs[-1]['tokens_per_s']:,.0f} "
            f"tok/s | MFU {100 * recs[-1]['mfu']:.1f}%") in last, last
    assert f"{s['tokens_per_s']:,.0f}  (mean over steps 2-{STEPS})" in out
    assert f"{100 * s['mfu']:.1f}%  (mean over steps 2-{STEPS}) of" in out


@pytest.mark.slow
def test_summary_counts_tp_and_pp_bytes_as_the_runtime_did(run):
    _, out, s, recs = run
    c, mp = s["comm"], s["model_parallel"]
    assert set(c) == {"dp", "tp", "pp"} and c["tp"]["ranks"] == c["pp"]["ranks"] == 2
    # tp: the blocks' collectives the TP layers counted (per layer and micro-batch), and
    # the cost model's torch-free formula for them; embedding/head traffic on top
    per_step = mp["activation"]["layers_on_rank"] * 2  # layers x micro-batches
    blocks = c["tp"]["blocks_wire_bytes_per_step"]
    assert blocks == pytest.approx(mp["tp"]["wire_bytes_per_layer_per_microbatch"] * per_step)
    assert blocks == pytest.approx(mp["tp"]["formula_wire_bytes_per_layer_per_microbatch"]
                                   * per_step)
    assert c["tp"]["wire_bytes_per_step"] > blocks > 0 and c["tp"]["seconds_per_step"] > 0
    # pp: rank 0 (the first stage) sends every token's d_model float32 activations once
    assert c["pp"]["wire_bytes_per_step"] == s["tokens_per_step"] * 32 * 4
    assert c["dp"]["wire_bytes_per_step"] == 0  # dp = 1: no gradient reduction
    for axis in ("tp", "pp"):  # every step's record holds the same counts
        assert [r["comm_by_axis"][axis]["wire_bytes"] for r in recs] == \
            [c[axis]["wire_bytes_per_step"]] * STEPS
        _, text = next((k, v) for k, v in _rows(out) if k == f"comm {axis} x2 per rank/step")
        assert text.startswith(f"{c[axis]['wire_bytes_per_step'] / 1e6:.4f} MB sent, "
                               f"{c[axis]['seconds_per_step']:.4f} s"), text


def _rows(out: str) -> list[tuple[str, str]]:
    """The (key, value) rows of the printed summary table."""
    rows = []
    for line in out.splitlines():
        cells = [x.strip() for x in line.strip().strip("│").split("│")]
        if len(cells) == 2:
            rows.append((cells[0], cells[1]))
    return rows


@pytest.mark.slow
def test_tensorboard_has_every_axis(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    d, _, s, _ = run
    acc = EventAccumulator(str(d / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    got = [e.value for e in acc.Scalars("comm/pp_wire_bytes")]
    assert got == [s["comm"]["pp"]["wire_bytes_per_step"]] * STEPS
    assert {"comm/tp_wire_bytes", "comm/tp_s", "comm/pp_s", "comm/dp_s"} <= \
        set(acc.Tags()["scalars"])


@pytest.mark.slow
def test_resume_says_where_it_resumed_from(run, paratrain_exe, text_file):
    d, _, _, _ = run
    out = _train(paratrain_exe, text_file, d, "--steps", "5", "--resume").stdout
    _once(out, f"resumed from {d / 'ck' / f'step_{STEPS:06d}'} (step {STEPS} of 5)")
    s = json.loads((d / "run" / "summary.json").read_text())
    assert s["mean_over_steps"] == [5, 5]  # this session ran steps 4 and 5
    assert "(step 5) of" in out  # the MFU row names the one step it is over


def test_resume_auto_without_a_checkpoint_says_so(tmp_path):
    from paratrain.config import TrainConfig
    from paratrain.run.loop import RunOptions
    from paratrain.run.outputs import output_lines

    opts = RunOptions(checkpoint_dir=str(tmp_path / "ck"), resume="auto")
    assert output_lines(opts, TrainConfig(steps=10), 0) == [
        f"checkpoints: {tmp_path / 'ck'} (at the end, keep all)",
        f"no checkpoint in {tmp_path / 'ck'} yet (--resume auto): starting at step 0"]


def test_a_step_above_the_peak_warns_once(capsys):
    from paratrain.bench.peak import Peak
    from paratrain.run.loop import _Tally
    from paratrain.run.outputs import mfu_of_step

    tally, peak = _Tally(), Peak(10e9)
    assert [mfu_of_step(peak, a, i, 0, tally) for i, a in enumerate((5e9, 20e9, 30e9))] == \
        [0.5, 2.0, 3.0]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("warning: step 2 ran at 20.0 GFLOP/s"), err


def _peak_worker(rank: int, world: int) -> dict:
    from paratrain.bench.peak import measure_peak

    p = measure_peak(torch.float32, local=lambda: [3e9, 7e9][rank])  # injected
    return {"flops": torch.tensor(p.flops), "ranks": torch.tensor(p.ranks)}


@pytest.mark.slow
def test_ranks_agree_on_the_largest_peak():
    got = spawn(_peak_worker, 2)
    assert [(float(r["flops"]), int(r["ranks"])) for r in got] == [(7e9, 2), (7e9, 2)]


@pytest.mark.parametrize("v,sends", [(1, 1), (2, 3), (4, 7)])
def test_pp_bytes_predicted_as_the_runtime_sends_them(v, sends):
    """Rank 0's pipeline sends per micro-batch, now that the summary shows the measured
    count beside the prediction: chunk 0 sends its output forward; under interleaving
    each further chunk also sends its input gradient back (measured exactly so by the
    runtime's ``sent_bytes`` for v = 2: 24576 B at m = 4 of one 16 x 32 float32 window)."""
    from paratrain.config import TrainConfig
    from paratrain.cost.hardware import Hardware
    from paratrain.plan import ParallelPlan
    from paratrain.predict import MachineModel, predict

    hw = Hardware("test-box", peak_flops=4e9, hbm_bytes=8e9, hbm_bw=1e10, gpus_per_node=4,
                  intra_bw=1e9, intra_alpha=1e-4, inter_bw=1e9, inter_alpha=1e-4, eta=1.0)
    machine = MachineModel(hw, eta=0.5, thread_peak=1e9, pass_s=1e-3, step_s=2e-3,
                           fitted=True)
    plan = ParallelPlan(pp=2, micro_batches=4, virtual_stages=v,
                        schedule="interleaved" if v > 1 else "1f1b")
    model = TINY.replace(n_layers=8)
    p = predict(model, TrainConfig(steps=2, global_batch=4, dtype="float32"), plan, 2,
                machine)
    assert p.pp_wire_bytes == 4 * sends * 16 * 32 * 4


@pytest.mark.parametrize("v,sends", [(1, 1), (2, 3), (4, 7)])
def test_pp_messages_cost_rank_cpu_both_ways(v, sends):
    """The CPU rank 0's pipeline messages cost is priced on the same count as their
    bytes: each send and each receive one step of point-to-point CPU (an interleaved
    rank's middle chunks both ways; the stage-boundary count priced 2 per micro-batch
    at every v)."""
    from paratrain.config import TrainConfig
    from paratrain.cost.hardware import Hardware
    from paratrain.plan import ParallelPlan
    from paratrain.predict import MachineModel, predict

    hw = Hardware("test-box", peak_flops=4e9, hbm_bytes=8e9, hbm_bw=1e10, gpus_per_node=4,
                  intra_bw=1e9, intra_alpha=1e-4, inter_bw=1e9, inter_alpha=1e-4, eta=1.0)
    plan = ParallelPlan(pp=2, micro_batches=4, virtual_stages=v,
                        schedule="interleaved" if v > 1 else "1f1b")
    tcfg = TrainConfig(steps=2, global_batch=4, dtype="float32")
    cpu = [predict(TINY.replace(n_layers=8), tcfg, plan, 2,
                   MachineModel(hw, eta=0.5, thread_peak=1e9, fitted=True,
                                coll_step_cpu_s=step)).cpu_rank0_s for step in (0.0, 1e-3)]
    loss_and_norm = 2 * 2  # the step's two 2-rank all-reduces, 2 ring steps each
    assert cpu[1] - cpu[0] == pytest.approx((2 * 4 * sends + loss_and_norm) * 1e-3, rel=1e-9)


def test_comm_rows_list_every_axis_beside_the_prediction():
    """The summary's per-axis means over the steps it is given, and its table rows: every
    axis wider than one rank (dp always), measured MB and seconds, the prediction's
    beside them (the real runtime's counts: the slow tp2 x pp2 run above)."""
    from paratrain.plan import ParallelPlan
    from paratrain.run.summary import comm_summary, format_comm

    steps = [{"dp": [0.0, 0.0], "tp": [3e6, 0.25], "tp_blocks": [2e6, 0.0],
              "pp": [1e6, 0.5], "ep": [7e6, 0.125]},
             {"dp": [0.0, 0.0], "tp": [3e6, 0.75], "tp_blocks": [2e6, 0.0],
              "pp": [1e6, 1.5], "ep": [9e6, 0.375]}]
    c = comm_summary(ParallelPlan(tp=2, pp=2, ep=2, dp=2), steps)
    assert list(c) == ["dp", "tp", "pp", "ep"]  # cp = 1: no row
    assert (c["tp"]["wire_bytes_per_step"], c["tp"]["seconds_per_step"],
            c["tp"]["blocks_wire_bytes_per_step"]) == (3e6, 0.5, 2e6)
    assert (c["ep"]["wire_bytes_per_step"], c["ep"]["seconds_per_step"]) == (8e6, 0.25)
    pred = {f"{a}_wire_bytes": 1e6 for a in ("dp", "tp", "pp", "cp", "ep")}
    pred |= {"dp_exposed_s": 0.1, "tp_comm_s": 0.2, "pp_comm_s": 0.3, "ep_comm_s": 0.4}
    rows = dict(format_comm({"comm": c, "prediction": {"predicted": pred}}))
    assert rows["comm tp x2 per rank/step"] == ("3.0000 MB sent, 0.5000 s in collectives; "
                                                "predicted 1.0000 MB (blocks; measured "
                                                "2.0000), 0.2000 s")
    assert rows["comm pp x2 per rank/step"] == ("1.0000 MB sent, 1.0000 s waited, bubble "
                                                "included; predicted 1.0000 MB, 0.3000 s")
    assert rows["comm ep x2 per rank/step"].startswith("8.0000 MB sent, 0.2500 s in all-to-alls")
    assert dict(format_comm({"comm": c}))["comm dp x2 per rank/step"] == \
        "0.0000 MB sent, 0.0000 s waited"  # no profile: no prediction beside it


def test_output_lines_name_each_output():
    from paratrain.config import TrainConfig
    from paratrain.run.loop import RunOptions
    from paratrain.run.outputs import output_lines

    opts = RunOptions(run_dir="runs/a", checkpoint_dir="ck", keep_checkpoints=3,
                      tensorboard="tb", resume=True)
    assert output_lines(opts, TrainConfig(steps=100, checkpoint_every=50), 40) == [
        "run dir: runs/a (metrics.jsonl, summary.json; plots: paratrain report runs/a)",
        "checkpoints: ck (every 50 steps and at the end, keep the newest 3)",
        "tensorboard: tb (tensorboard --logdir tb)",
        "resumed from ck/step_000040 (step 40 of 100)"]
