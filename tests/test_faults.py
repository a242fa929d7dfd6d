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
                                        (1, signal.SIGTERM), (2, signal.SIGKILL)])
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
    stdout = (tmp_path / "out").read_text()
    if sig == signal.SIGKILL:  # no handler: torchrun gets SIGTERM as its parent dies
        assert rc == -signal.SIGKILL
        sig = signal.SIGTERM
    else:
        assert rc == 128 + sig, (rc, (tmp_path / "err").read_text()[-3000:])
    assert f"stopped by {sig.name} after step" in stdout, stdout
    stopped_at = int(stdout.split("after step ")[1].split(";")[0])
    steps = _steps(run)
    assert steps == list(range(stopped_at))  # every finished step logged, each once
    assert (ck / f"step_{stopped_at:06d}" / "meta.json").is_file()
    assert "Traceback" not in (tmp_path / "err").read_text()
    if (nproc, sig) == (2, signal.SIGTERM):  # preempted, resumed: nothing lost or repeated
        common = ["--nproc", "2", *TINY, "--steps", str(stopped_at + 2), "--data", text_file]
        r = _run([*common, "--run-dir", str(run), "--checkpoint-dir", str(ck), "--resume"],
                 tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        ref = _run([*common, "--run-dir", str(tmp_path / "ref")], tmp_path)
        assert ref.returncode == 0, ref.stderr[-3000:]
        assert _steps(run) == list(range(stopped_at + 2))
        losses = [[json.loads(x)["loss"] for x in (d / "metrics.jsonl").read_text().splitlines()]
                  for d in (run, tmp_path / "ref")]
        assert losses[0] == losses[1]


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


@pytest.mark.parametrize("nproc", [1, 2])
def test_diverged_loss_is_one_error(tmp_path, text_file, reaper, nproc):
    r = _run(["--nproc", str(nproc), *TINY, "--steps", "5", "--warmup-steps", "0", "--lr",
              "1e30", "--data", text_file, "--run-dir", str(tmp_path / "r")], tmp_path)
    _one_clean_error(r, "lower --lr")


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


# ---- bad input: one `error:` line, exit 2, before anything is launched -------------------
def _toml(tmp_path, text):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    return ["--config", str(p)]


def _fake_checkpoint(tmp_path, step, world):
    d = tmp_path / "ck" / f"step_{step:06d}"
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"step": step, "world_size": world}))
    return ["--checkpoint-dir", str(tmp_path / "ck"), "--resume"]


def _fifo(tmp_path):
    p = tmp_path / "fifo"
    os.mkfifo(p)
    return ["--data", str(p)]


def _empty_dir(tmp_path):
    (tmp_path / "nothing").mkdir()
    return ["--data", str(tmp_path / "nothing")]


def _empty_file(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    return ["--data", str(tmp_path / "empty.txt")]


def _a_file(tmp_path):
    (tmp_path / "afile").write_text("x")
    return str(tmp_path / "afile")


def _full_run_dir(tmp_path):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "metrics.jsonl").write_text('{"step": 0}\n')
    return ["--run-dir", str(tmp_path / "used")]


BAD = {  # name: (args from tmp_path and nproc, fragment of the one error line)
    "toml bool for int": (lambda t, n: _toml(t, "[model]\nn_layers = true\n"),
                          "[model] n_layers (--layers) must be an integer, got a boolean"),
    "toml string for float": (lambda t, n: _toml(t, '[train]\nlr = "fast"\n'),
                              "[train] lr (--lr) must be a number, got a string"),
    "toml float for int": (lambda t, n: _toml(t, "[train]\nsteps = 2.5\n"),
                           "[train] steps (--steps) must be an integer"),
    "toml string for bool": (lambda t, n: _toml(t, '[plan]\noverlap = "yes"\n'),
                             "[plan] overlap (--overlap) must be true or false"),
    "toml int for string": (lambda t, n: _toml(t, "[train]\ndtype = 64\n"),
                            "[train] dtype (--dtype) must be a string"),
    "toml inf": (lambda t, n: _toml(t, "[train]\nlr = inf\n"), "must be a finite number"),
    "toml key without a flag": (lambda t, n: _toml(t, "[model]\nvocab_size = 0\n"),
                                "set e.g. vocab_size = 4 in the TOML"),
    "--lr inf": (lambda t, n: ["--lr", "inf"], "[train] lr (--lr) = inf must be a finite"),
    "--lr nan": (lambda t, n: ["--lr", "nan"], "[train] lr (--lr) = nan must be a finite"),
    "--bucket-mb inf": (lambda t, n: ["--bucket-mb", "inf"], "must be a finite number"),
    "--layers 0 names --layers": (lambda t, n: ["--layers", "0"], "pass e.g. --layers 4"),
    "--heads 0 names --heads": (lambda t, n: ["--heads", "0"], "pass e.g. --heads 4"),
    "--data /proc/self/mem": (lambda t, n: ["--data", "/proc/self/mem"], "cannot be read"),
    "--data a FIFO": (lambda t, n: _fifo(t), "is not a regular file or folder"),
    "--data empty file": (lambda t, n: _empty_file(t), "holds no text"),
    "--data empty folder": (lambda t, n: _empty_dir(t), "holds no text"),
    "--run-dir under a file": (lambda t, n: ["--run-dir", _a_file(t) + "/run"],
                               "is a file, not a directory"),
    "--run-dir is a file": (lambda t, n: ["--run-dir", _a_file(t)], "is a file, not a dir"),
    "--checkpoint-dir under a file": (lambda t, n: ["--checkpoint-dir", _a_file(t) + "/ck"],
                                      "--checkpoint-dir"),
    "--run-dir not empty": (lambda t, n: _full_run_dir(t), "already holds files"),
    "--resume, empty dir": (lambda t, n: ["--checkpoint-dir", str(t), "--resume"],
                            "no checkpoint found"),
    "--resume, --steps at the checkpoint": (lambda t, n: _fake_checkpoint(t, 2, n),
                                            "is at step 2 but --steps is 2"),
    "--resume, other world size": (lambda t, n: _fake_checkpoint(t, 1, 3 - n),
                                   f"resume with --nproc {3 - 0}"),
}


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_error_line_before_launch(tmp_path, text_file, capsys, monkeypatch,
                                                   case, nproc):
    monkeypatch.chdir(tmp_path)  # a default runs/ would land here
    make, fragment = BAD[case]
    args = make(tmp_path, nproc)
    if "--data" not in args:
        args = [*args, "--data", text_file]
    if case == "--resume, other world size":
        fragment = f"resume with --nproc {3 - nproc}"
    t0 = time.monotonic()
    code = main(["train", "--nproc", str(nproc), *TINY, "--steps", "2", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and fragment in err, err
    assert time.monotonic() - t0 < 5  # refused before any worker starts
    assert not (tmp_path / "runs").exists()


def test_messages_name_only_flags_that_exist():
    """Every --flag written in the sources is a real flag of some command (or torchrun's)."""
    import re

    from typer.main import get_command

    from paratrain.cli import app

    flags = {"--nproc-per-node", "--standalone", "--field-name"}  # torchrun's; a comment

    def walk(cmd):
        for p in getattr(cmd, "params", []):
            flags.update(p.opts + p.secondary_opts)
        for sub in getattr(cmd, "commands", {}).values():
            walk(sub)

    walk(get_command(app))
    src = Path(__file__).parents[1] / "src" / "paratrain"
    unknown = {(m, f.name) for f in src.rglob("*.py")
               for m in re.findall(r"--[a-z][a-z0-9-]*", f.read_text()) if m not in flags}
    assert not unknown


def test_default_run_dir_in_a_read_only_place_is_one_error(tmp_path, text_file, capsys,
                                                           monkeypatch):
    (tmp_path / "runs").write_text("a file where runs/ would go")
    monkeypatch.chdir(tmp_path)
    code = main(["train", "--nproc", "1", *TINY, "--steps", "2", "--data", text_file])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "cannot create the run dir" in err, err
