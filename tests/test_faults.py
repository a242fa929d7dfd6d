"""Faults with real processes and real signals (issue 14): the launcher's signal handling,
no orphans, a checkpoint on SIGTERM, workers' errors reported once, corrupt checkpoints
fallen back from, unique run directories, and bad input refused before launch.

Every process a test starts is found afterwards by its run directory (a unique tmp path)
in its command line and killed, so a failing test leaves no orphan behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paratrain.cli import main

TINY = ["--layers", "2", "--d-model", "32", "--heads", "4", "--d-ff", "64", "--context", "16",
        "--global-batch", "4", "--eval-every", "0", "--quiet"]
CMD = [sys.executable, "-m", "paratrain.cli", "train"]


def _procs_mentioning(text: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmd:
                out.append(int(d.name))
    return out


def _wait_gone(text: str, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    left = _procs_mentioning(text)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = _procs_mentioning(text)
    return left


@pytest.fixture
def reaper(tmp_path):
    """Kill whatever a test left behind (found by the test's tmp path)."""
    yield
    for pid in _procs_mentioning(str(tmp_path)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _run(args, cwd, timeout=240):
    return subprocess.run([*CMD, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd)


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _one_clean_error(r, fragment: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert _errors(r.stderr) == [line for line in r.stderr.splitlines() if line.strip()], \
        r.stderr[-3000:]
    assert len(_errors(r.stderr)) == 1 and fragment in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr


def test_subprocesses_import_this_worktree(tmp_path):
    r = subprocess.run([sys.executable, "-c", "import paratrain; print(paratrain.__file__)"],
                       capture_output=True, text=True, cwd=tmp_path)
    import paratrain

    assert r.stdout.strip() == paratrain.__file__


# ---- signals to the launcher alone ------------------------------------------------------
@pytest.mark.parametrize("nproc, sig", [(2, signal.SIGTERM), (2, signal.SIGINT),
                                        (1, signal.SIGTERM)])
def test_signal_to_launcher_leaves_no_process_and_checkpoints(tmp_path, text_file, reaper,
                                                              nproc, sig):
    run, ck = tmp_path / "run", tmp_path / "ck"
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        p = subprocess.Popen([*CMD, "--nproc", str(nproc), *TINY, "--steps", "100000",
                              "--data", text_file, "--run-dir", str(run),
                              "--checkpoint-dir", str(ck)], stdout=out, stderr=err,
                             cwd=tmp_path)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and p.poll() is None:
            metrics = run / "metrics.jsonl"
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
                break
            time.sleep(0.2)
        assert p.poll() is None, (tmp_path / "err").read_text()[-3000:]
        assert len(_procs_mentioning(str(run))) >= (3 if nproc == 2 else 1)
        os.kill(p.pid, sig)  # the launcher alone, as `kill PID` does
        t0 = time.monotonic()
        left = _wait_gone(str(tmp_path), 10.0)
        took = time.monotonic() - t0
        assert not left, f"processes left {took:.1f} s after {sig.name}: {left}"
        rc = p.wait(timeout=5)
    assert rc == 128 + sig, (rc, (tmp_path / "err").read_text()[-3000:])
    stdout = (tmp_path / "out").read_text()
    assert f"stopped by {sig.name} after step" in stdout
    stopped_at = int(stdout.split("after step ")[1].split(";")[0])
    steps = _steps(run)
    assert steps == list(range(stopped_at))  # every finished step logged, each once
    assert (ck / f"step_{stopped_at:06d}" / "meta.json").is_file()
    assert "Traceback" not in (tmp_path / "err").read_text()


# ---- a worker's user error: once, exit 2, no torchrun traceback --------------------------
def _checkpointed(tmp_path, text_file, nproc, steps=4, every=2):
    ck, run = tmp_path / "ck", tmp_path / "first"
    r = _run(["--nproc", str(nproc), *TINY, "--steps", str(steps), "--data", text_file,
              "--run-dir", str(run), "--checkpoint-dir", str(ck), "--checkpoint-every",
              str(every)], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    return ck, run


@pytest.mark.parametrize("nproc", [1, 2])
def test_worker_error_reaches_the_launcher_once(tmp_path, text_file, reaper, nproc):
    ck, _ = _checkpointed(tmp_path, text_file, nproc, steps=2, every=0)
    r = _run(["--nproc", str(nproc), *TINY, "--steps", "4", "--seed", "7", "--data",
              text_file, "--run-dir", str(tmp_path / "r2"), "--checkpoint-dir", str(ck),
              "--resume"], tmp_path)
    _one_clean_error(r, "has seed=0 but this run has 7")
    assert "ChildFailedError" not in r.stderr


# ---- corrupt / truncated / missing rank files: every rank falls back together ------------
@pytest.mark.parametrize("damage", ["flip", "truncate", "missing"])
def test_damaged_newest_checkpoint_falls_back_with_a_warning(tmp_path, text_file, reaper,
                                                             damage):
    ck, run = _checkpointed(tmp_path, text_file, 2, steps=4, every=2)
    victim = ck / "step_000004" / "rank1.pt"
    if damage == "flip":
        b = bytearray(victim.read_bytes())
        b[len(b) // 2] ^= 0xFF
        victim.write_bytes(bytes(b))
    elif damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:100])
    else:
        victim.unlink()
    (ck / "step_000009.tmp").mkdir()  # a stale temporary from a crashed save
    r = _run(["--nproc", "2", *TINY, "--steps", "6", "--data", text_file, "--run-dir",
              str(run), "--checkpoint-dir", str(ck), "--resume"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "step_000004" in warnings[0] and "rank 1" in warnings[0] \
        and "falling back to step_000002" in warnings[0], r.stderr[-3000:]
    assert _steps(run) == list(range(6))  # 0-1 from the first run, 2-5 resumed; no repeats
    assert not (ck / "step_000009.tmp").exists()
    # the resumed trajectory equals an uninterrupted one
    ref = _run(["--nproc", "2", *TINY, "--steps", "6", "--data", text_file, "--run-dir",
                str(tmp_path / "ref")], tmp_path)
    assert ref.returncode == 0, ref.stderr[-3000:]
    got = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    want = [json.loads(x)["loss"] for x in
            (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
    assert got == want


def test_every_checkpoint_damaged_is_one_error(tmp_path, text_file, reaper):
    ck, run = _checkpointed(tmp_path, text_file, 2, steps=4, every=2)
    for step in (2, 4):
        (ck / f"step_{step:06d}" / "rank0.pt").write_bytes(b"garbage")
    r = _run(["--nproc", "2", *TINY, "--steps", "6", "--data", text_file, "--run-dir",
              str(tmp_path / "r2"), "--checkpoint-dir", str(ck), "--resume"], tmp_path)
    assert r.returncode == 2, r.stderr[-3000:]
    assert len(_errors(r.stderr)) == 1 and "no intact checkpoint" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


# ---- run directories ---------------------------------------------------------------------
def test_two_runs_started_together_get_their_own_run_dirs(tmp_path, text_file, reaper):
    args = [*CMD, "--nproc", "1", *TINY, "--steps", "2", "--data", text_file]
    ps = [subprocess.Popen([*args, "--seed", str(s)], cwd=tmp_path, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True) for s in (1, 2)]
    for p in ps:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
    dirs = sorted((tmp_path / "runs").iterdir())
    assert len(dirs) == 2
    seeds = set()
    for d in dirs:
        assert _steps(d) == [0, 1]
        seeds.add(json.loads((d / "summary.json").read_text())["final_loss"])
    assert len(seeds) == 2  # each directory holds its own run


def test_existing_run_dir_is_refused_and_resume_truncates(tmp_path, text_file):
    run, ck = tmp_path / "run", tmp_path / "ck"
    base = ["train", "--nproc", "1", *TINY, "--data", text_file, "--run-dir", str(run),
            "--checkpoint-dir", str(ck)]
    assert main([*base, "--steps", "4", "--checkpoint-every", "2"]) == 0
    assert _steps(run) == [0, 1, 2, 3]
    assert main([*base, "--steps", "4"]) == 2  # refused: the directory holds a run
    # fall back to step 2 (as after a crash) and resume into the same run dir
    import shutil

    shutil.rmtree(ck / "step_000004")
    assert main([*base, "--steps", "5", "--resume"]) == 0
    assert _steps(run) == [0, 1, 2, 3, 4]
