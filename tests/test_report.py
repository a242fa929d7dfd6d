"""One real 2-process pipeline run (torchrun, --quiet, --tensorboard) read back three
ways: TensorBoard's own event reader, `paratrain report` rendered in headless Chromium
(screenshot not blank, every plot loaded), and the step records' honest MFU. Plus the
peak's arithmetic and the CLI's help texts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

from conftest import TINY, tiny_flags
from paratrain.cli import main

TINY_FLAGS = [*tiny_flags(TINY.replace(context=32)), "--global-batch", "8"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, paratrain_exe, text_file):
    d = tmp_path_factory.mktemp("run")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    r = subprocess.run([paratrain_exe, "train", "--nproc", "2", "--pp", "2",
                        "--micro-batches", "2", "--steps", "4", "--eval-every", "2",
                        "--data", text_file, "--run-dir", str(d / "run"),
                        "--tensorboard", str(d / "tb"), "--quiet", *TINY_FLAGS],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return d, r


def test_quiet_is_quiet(run):
    _, r = run
    assert r.stdout == "" and r.stderr == "", (r.stdout, r.stderr)  # no OMP banner either


def test_tensorboard_events_hold_the_step_records(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    d, _ = run
    recs = [json.loads(x) for x in (d / "run" / "metrics.jsonl").read_text().splitlines()]
    acc = EventAccumulator(str(d / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("loss/train", "loss/val", "optim/lr", "optim/grad_norm",
                "speed/tokens_per_s", "speed/mfu", "speed/exposed_comm_s",
                "memory/process_bytes", "memory/measured/activations_peak",
                "memory/predicted/params", "loss/unigram_baseline"):
        assert tag in tags, (tag, sorted(tags))
    for tag, key in (("loss/train", "loss"), ("optim/lr", "lr"),
                     ("optim/grad_norm", "grad_norm"), ("speed/mfu", "mfu")):
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert [s for s, _ in got] == [r["step"] for r in recs]
        for (_, v), rec in zip(got, recs, strict=True):
            assert v == pytest.approx(rec[key], rel=1e-6)  # stored as float32
    assert [e.step for e in acc.Scalars("loss/val")] == [1, 3]
    assert all(0 < e.value <= 1 for e in acc.Scalars("speed/mfu"))
    assert "prediction/text_summary" in acc.Tags()["tensors"]


def _chromium() -> str:
    exe = next(filter(None, map(shutil.which, ("chromium", "chromium-browser",
                                               "google-chrome"))), None)
    assert exe, "headless Chromium is needed: apt-get install chromium (.ci/run does)"
    return exe


def _headless(exe: str, profile, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu",
                           f"--user-data-dir={profile}", "--hide-scrollbars", *args],
                          capture_output=True, text=True, timeout=120)


def test_report_renders_in_headless_chromium(run, tmp_path, capsys):
    from PIL import Image

    d, _ = run
    page = tmp_path / "report.html"
    assert main(["report", str(d / "run"), "--out", str(page)]) == 0
    text = page.read_text()
    assert "http://" not in text and "https://" not in text  # self-contained
    assert text.count("<img ") == 4 and "Prediction beside measurement" in text
    exe = _chromium()
    shot = tmp_path / "shot.png"
    r = _headless(exe, tmp_path / "p1", "--window-size=1100,3000",
                  f"--screenshot={shot}", page.as_uri())
    assert shot.is_file(), r.stderr[-2000:]
    px = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    ink = (px.min(axis=2) < 200).mean()
    blue = ((px[..., 2] > 150) & (px[..., 0] < 110)).mean()  # the plots' lines and bars
    assert ink > 0.03 and blue > 0.002, (ink, blue)
    # every <img> decoded: a copy of the page whose onload records each image's size
    probe = tmp_path / "probe.html"
    probe.write_text(text.replace("</body>", "<script>window.onload=function(){"
                                  "var a=[].map.call(document.images,function(i){return "
                                  "i.complete&&i.naturalWidth>0?i.naturalWidth:0});"
                                  "document.body.setAttribute('data-loaded',a.join(','))}"
                                  "</script></body>"))
    r = _headless(exe, tmp_path / "p2", "--virtual-time-budget=5000", "--dump-dom",
                  probe.as_uri())
    loaded = r.stdout.split('data-loaded="', 1)[1].split('"', 1)[0].split(",")
    assert len(loaded) == 4 and all(int(w) >= 600 for w in loaded), loaded


def test_matmul_peak_is_the_best_timed_trial_after_the_warm_up():
    """The arithmetic with injected timings (speed itself belongs in benchmarks): the
    warm-up trials are not counted, the fastest timed trial is the peak."""
    from paratrain.bench.peak import matmul_peak_flops

    durations = [1e-9, 1e-9,  # warm-up: would be the best by far if it counted
                 4e-3, 1e-3, 2e-3]
    ticks = iter([t for d in durations for t in (0.0, d)])
    n, reps = 8, 2
    got = matmul_peak_flops(torch.float32, n, trials=3, warmup=2, reps=reps, pause_s=0.0,
                            clock=lambda: next(ticks))
    assert got == reps * 2 * n**3 / 1e-3
    assert next(ticks, None) is None  # every trial read the clock twice, no more


def test_one_peak_for_the_whole_run():
    """MFU divides by the peak measured before training, whatever the steps achieve: no
    re-measure moves the denominator mid-run (a step above it reads above 100%)."""
    from paratrain.bench.peak import Peak

    p = Peak(100e9, n=512, trials=16, ranks=4, dtype="float32")
    assert [p.mfu(a) for a in (25e9, 50e9, 300e9, 50e9)] == [0.25, 0.5, 3.0, 0.5]
    assert p.describe() == ("peak: 100.0 GFLOP/s per rank (matmul 512^3 float32, best of "
                            "16 on each of 4 ranks, max over ranks, measured before training)")
    assert Peak(float("nan")).describe() == "peak: not measured (MFU is not reported)"


def test_every_help_text_renders(monkeypatch, capsys):
    """Rich markup must not eat a help text (``[model]`` once printed as blanks)."""
    from rich.markup import render
    from typer.main import get_command

    from paratrain.cli.app import app

    def walk(group):
        for cmd in getattr(group, "commands", {}).values():
            yield cmd
            yield from walk(cmd)

    for cmd in walk(get_command(app)):
        for h in [cmd.help] + [getattr(p, "help", None) for p in cmd.params]:
            if h:
                assert render(h).plain == h.replace("\\[", "["), (cmd.name, h)
    monkeypatch.setenv("COLUMNS", "200")
    main(["train", "--help"])
    assert "TOML with [model] [train] [plan] tables." in capsys.readouterr().out
