"""Faults with real processes and real signals (issue 14): the launcher's signal handling,
no orphans, a checkpoint on SIGTERM, workers' errors reported once, corrupt checkpoints
fallen back from, a worker killed and restarted (elastic), a worker stopped (collective
timeout), resume on another world size and layout, two launchers as two nodes, unique
run directories, and bad input refused before launch.

One uninterrupted reference run (``reference``: 2 processes, ZeRO-3, float64, 40 steps,
a checkpoint every 2 steps, the newest 3 kept) serves every test that compares losses or
needs a checkpoint; each such test works on its own copy of the checkpoints.

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

from conftest import tiny_flags
from paratrain.cli import main

TINY_FLAGS = [*tiny_flags(), "--global-batch", "4", "--eval-every", "0", "--quiet",
              "--dtype", "float64"]
REF = ["--nproc", "2", "--zero", "3", *TINY_FLAGS]  # the reference layout (warm-up 20 steps, so
# the learning rate of steps < 20 does not depend on --steps)
REF_STEPS, REF_KEEP = 40, 3
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


def _losses(run: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text_file):
    """(checkpoint dir, losses) of the uninterrupted reference run."""
    tmp = tmp_path_factory.mktemp("reference")
    r = _run([*REF, "--steps", str(REF_STEPS), "--data", text_file, "--run-dir",
              str(tmp / "run"), "--checkpoint-dir", str(tmp / "ck"), "--checkpoint-every", "2",
              "--keep-checkpoints", str(REF_KEEP)], tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / "ck", _losses(tmp / "run")


def _copy_ck(reference, tmp_path, newest: int | None = None) -> Path:
    """A copy of the reference checkpoints, without the steps above ``newest``."""
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(reference[0], ck)
    for d in ck.glob("step_*"):
        if newest is not None and int(d.name[5:]) > newest:
            shutil.rmtree(d)
    return ck


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
@pytest.mark.slow
def test_signal_to_launcher_leaves_no_process_and_checkpoints(tmp_path, text_file, reaper,
                                                              reference, nproc, sig):
    run, ck = tmp_path / "run", tmp_path / "ck"
    layout = REF if nproc == 2 else ["--nproc", "1", *TINY_FLAGS]
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        p = subprocess.Popen([*CMD, *layout, "--steps", "100000",
                              "--data", text_file, "--run-dir", str(run),
                              "--checkpoint-dir", str(ck)], stdout=out, stderr=err,
                             cwd=tmp_path)
        _wait_for_steps(p, run, 2, tmp_path)
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
    if (nproc, sig) == (2, signal.SIGTERM) and stopped_at + 2 <= 20:
        # preempted, resumed: nothing lost or repeated, the reference's losses bit for bit
        r = _run([*REF, "--steps", str(stopped_at + 2), "--data", text_file, "--run-dir",
                  str(run), "--checkpoint-dir", str(ck), "--resume"], tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        assert _steps(run) == list(range(stopped_at + 2))
        assert _losses(run) == reference[1][:stopped_at + 2]


def _wait_for_steps(p, run: Path, n: int, tmp_path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and p.poll() is None:
        metrics = run / "metrics.jsonl"
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= n:
            break
        time.sleep(0.05)
    assert p.poll() is None, (tmp_path / "err").read_text()[-3000:]


def _workers(run: Path) -> dict[int, int]:
    """rank -> pid of the torchrun workers of ``run``."""
    out = {}
    for pid in _procs_mentioning(str(run)):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"paratrain.run.worker" in cmd:
            for kv in env:
                if kv.startswith(b"RANK="):
                    out[int(kv[5:])] = pid
    return out


# ---- a worker killed: torchrun restarts the workers, they resume (elastic) ----------------
TOPK = ["--nproc", "2", "--compress", "topk:4", *TINY_FLAGS]


@pytest.mark.slow
def test_killed_worker_without_restarts_is_one_error_line(tmp_path, text_file, reaper):
    """No --max-restarts: the run ends with one line naming how the worker died and where
    torchrun's own report went, no traceback, and nothing left running."""
    run = tmp_path / "run"
    with open(tmp_path / "err", "w") as err:
        p = subprocess.Popen([*CMD, "--nproc", "2", *TINY_FLAGS, "--steps", "100000", "--data",
                              text_file, "--run-dir", str(run)], stderr=err, cwd=tmp_path)
        _wait_for_steps(p, run, 2, tmp_path)
        victim = _workers(run)[1]
        os.kill(victim, signal.SIGKILL)
        rc = p.wait(timeout=60)
    err = (tmp_path / "err").read_text()
    assert rc != 0
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: a worker"), err[-3000:]
    assert "SIGKILL" in lines[0] and "--max-restarts 1 --resume auto" in lines[0]
    assert "Traceback" in (run / "torchrun.log").read_text()  # torchrun's report, kept
    assert _wait_gone(str(run), 10) == []


@pytest.mark.slow
def test_killed_worker_restarts_and_resumes_bitwise(tmp_path, text_file, reaper, capsys):
    """Run under top-k compression, whose per-rank error-feedback residuals must come back
    with the checkpoint for the trajectory to continue bit for bit (a zero residual leaves
    it). The survivor of the kill exits without a traceback; resuming the top-k
    checkpoint on another layout is refused before launch, naming why and the fix."""
    ref = _run([*TOPK, "--steps", str(REF_STEPS), "--data", text_file, "--run-dir",
                str(tmp_path / "ref")], tmp_path)
    assert ref.returncode == 0, ref.stderr[-3000:]
    run, ck = tmp_path / "run", tmp_path / "ck"
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        p = subprocess.Popen([*CMD, *TOPK, "--steps", str(REF_STEPS), "--data", text_file,
                              "--run-dir", str(run), "--checkpoint-dir", str(ck),
                              "--checkpoint-every", "4", "--max-restarts", "1", "--resume",
                              "auto"], stdout=out, stderr=err, cwd=tmp_path)
        _wait_for_steps(p, run, 6, tmp_path)
        killed_after = len(_steps(run))
        os.kill(_workers(run)[1], signal.SIGKILL)
        rc = p.wait(timeout=300)
    err = (tmp_path / "err").read_text()
    assert rc == 0, err[-3000:]
    assert killed_after < REF_STEPS  # the kill really landed mid-run
    assert _steps(run) == list(range(REF_STEPS))  # no record lost or repeated
    assert _losses(run) == _losses(tmp_path / "ref")  # bit for bit
    restarted = [line for line in err.splitlines() if line.startswith("warning: a worker died")]
    assert len(restarted) == 1 and "restart 1 of 1 resumes from step" in restarted[0], err
    assert "Traceback" not in err and "exitcode" not in err, err[-3000:]  # our lines only
    code = main(["train", *TOPK, "--nproc", "1", "--steps", str(REF_STEPS + 1), "--data",
                 text_file, "--run-dir", str(tmp_path / "r1"), "--checkpoint-dir", str(ck),
                 "--resume"])
    said = capsys.readouterr().err.strip()
    assert code == 2 and len(said.splitlines()) == 1, said
    assert "per-rank top-k residuals for dp=2 but this run has dp=1" in said, said


# ---- a worker's user error: once, exit 2, no torchrun traceback --------------------------
@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("change, fragment", [(["--seed", "7"], "has train.seed=0 but"),
                                              ("data", "trained on data"),
                                              (["--d-ff", "96"], "has model.d_ff=64 but")])
@pytest.mark.slow
def test_resume_with_other_settings_is_one_error(tmp_path, text_file, capsys, reference,
                                                 nproc, change, fragment):
    """Refused before launch, naming the field (the workers check again when torchrun is
    run directly; a worker's error reaching the launcher is the diverged-loss test)."""
    ck = _copy_ck(reference, tmp_path)
    if change == "data":
        other = tmp_path / "other.txt"
        other.write_text(Path(text_file).read_text()[::-1])
        change = ["--data", str(other)]
    code = main(["train", "--nproc", str(nproc), *TINY_FLAGS, "--steps", str(REF_STEPS + 2),
                 "--data", text_file, *change, "--run-dir", str(tmp_path / "r2"),
                 "--checkpoint-dir", str(ck), "--resume"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert fragment in err, err


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.slow
def test_diverged_loss_is_one_error(tmp_path, text_file, reaper, nproc):
    r = _run(["--nproc", str(nproc), *TINY_FLAGS, "--steps", "5", "--warmup-steps", "0", "--lr",
              "1e30", "--dtype", "float32", "--data", text_file, "--run-dir",
              str(tmp_path / "r")], tmp_path)
    _one_clean_error(r, "lower --lr")


# ---- a flipped byte, a truncated or a missing file: every rank falls back together --------
@pytest.mark.parametrize("damage", ["flip", "truncate", "missing"])
@pytest.mark.slow
def test_damaged_newest_checkpoint_falls_back_with_a_warning(tmp_path, text_file, reaper,
                                                             reference, damage):
    ck = _copy_ck(reference, tmp_path)
    assert sorted(d.name for d in ck.glob("step_*")) == \
        [f"step_{s:06d}" for s in range(REF_STEPS - 2 * REF_KEEP + 2, REF_STEPS + 1, 2)]
    newest, prev = ck / f"step_{REF_STEPS:06d}", f"step_{REF_STEPS - 2:06d}"
    victim = newest / "__1_0.distcp"  # rank 1's tensors
    if damage == "flip":
        b = bytearray(victim.read_bytes())
        b[len(b) // 2] ^= 0xFF
        victim.write_bytes(bytes(b))
    elif damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:100])
    else:
        victim.unlink()
    (ck / "step_000099.tmp").mkdir()  # a stale temporary from a crashed save
    run = tmp_path / "run"
    r = _run([*REF, "--steps", str(REF_STEPS), "--data", text_file, "--run-dir", str(run),
              "--checkpoint-dir", str(ck), "--resume"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and newest.name in warnings[0] and "__1_0.distcp" in warnings[0] \
        and f"falling back to {prev}" in warnings[0], r.stderr[-3000:]
    assert not (ck / "step_000099.tmp").exists()
    # the two steps after the fallback equal the uninterrupted run's, bit for bit
    assert _steps(run) == [REF_STEPS - 2, REF_STEPS - 1]
    assert _losses(run) == reference[1][-2:]


def test_every_checkpoint_damaged_is_one_error(tmp_path, text_file, reaper, reference):
    ck = _copy_ck(reference, tmp_path)
    for d in ck.glob("step_*"):
        (d / ".metadata").write_bytes(b"garbage")
    r = _run([*REF, "--steps", str(REF_STEPS + 2), "--data", text_file, "--run-dir",
              str(tmp_path / "r2"), "--checkpoint-dir", str(ck), "--resume"], tmp_path)
    assert r.returncode == 2, r.stderr[-3000:]
    assert len(_errors(r.stderr)) == 1 and "no intact checkpoint" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


# ---- resharding: another world size, another layout -------------------------------------
@pytest.mark.parametrize("layout", [["--nproc", "1"], ["--nproc", "2", "--tp", "2"]])
@pytest.mark.slow
def test_resume_on_another_world_size_and_layout(tmp_path, text_file, reaper, reference,
                                                 layout):
    """The reference's ZeRO-3 (dp 2) checkpoint of step 36, resumed in one process and as
    2-way tensor parallelism: the next losses equal the uninterrupted run's within 1e-9."""
    start = REF_STEPS - 2 * REF_KEEP + 2
    ck = _copy_ck(reference, tmp_path, newest=start)
    run = tmp_path / "run"
    r = _run([*layout, *TINY_FLAGS, "--steps", str(REF_STEPS), "--data", text_file, "--run-dir",
              str(run), "--checkpoint-dir", str(ck), "--resume"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _steps(run) == list(range(start, REF_STEPS))
    want = reference[1][start:]
    assert max(abs(a - b) for a, b in zip(_losses(run), want, strict=True)) < 1e-9


def test_load_full_model_gives_the_plain_model(reference, text_file):
    """The ZeRO-3 checkpoint of step s, loaded in one process as the plain Decoder, gives
    the loss the run logged at step s (computed from the same weights)."""
    import torch

    from paratrain.config import ModelConfig
    from paratrain.files.batches import Corpus
    from paratrain.files.checkpoint import load_full_model
    from paratrain.model import Decoder
    from paratrain.parallel.engine import token_loss_sum

    meta, sd = load_full_model(reference[0])
    step = REF_STEPS  # the newest: what a missing step means
    assert meta["step"] == step and meta["world_size"] == 2
    cfg = ModelConfig(**meta["model"])
    model = Decoder(cfg).double()
    model.load_state_dict(sd, strict=True)
    meta2, sd2 = load_full_model(reference[0], step=step - 2)
    assert meta2["step"] == step - 2
    model2 = Decoder(cfg).double()
    model2.load_state_dict(sd2, strict=True)
    corpus = Corpus.load(text_file, 0.05, cfg.context)
    x, y = corpus.batch(0, step - 2, 4, cfg.context)
    with torch.no_grad():
        loss = float(token_loss_sum(model2(x), y)) / y.numel()
    assert abs(loss - reference[1][step - 2]) < 1e-9
    assert not torch.equal(sd["tok_emb.weight"], sd2["tok_emb.weight"])


# ---- two launchers on loopback as two nodes -----------------------------------------------
@pytest.mark.slow
def test_two_launchers_as_two_nodes(tmp_path, text_file, reaper, reference):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ps = [subprocess.Popen([*CMD, "--nproc", "1", "--zero", "3", *TINY_FLAGS, "--steps", "4",
                            "--data", text_file, "--nnodes", "2", "--node-rank", str(n),
                            "--rdzv-endpoint", f"127.0.0.1:{port}", "--run-dir",
                            str(tmp_path / f"node{n}")], cwd=tmp_path,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
          for n in (0, 1)]
    for p in ps:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    # global rank 0 (which writes the metrics) is on whichever node joined first
    logged = [d for d in (tmp_path / "node0", tmp_path / "node1")
              if (d / "metrics.jsonl").is_file()]
    assert len(logged) == 1
    assert _losses(logged[0]) == reference[1][:4]


# ---- a stopped worker: the collective times out, naming who did not arrive ----------------
@pytest.mark.slow
def test_stopped_worker_is_a_named_timeout(tmp_path, text_file, reaper):
    run = tmp_path / "run"
    timeout = 5
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        p = subprocess.Popen([*CMD, "--nproc", "2", *TINY_FLAGS, "--steps", "100000", "--data",
                              text_file, "--run-dir", str(run), "--timeout", str(timeout)],
                             stdout=out, stderr=err, cwd=tmp_path)
        _wait_for_steps(p, run, 2, tmp_path)
        os.kill(_workers(run)[1], signal.SIGSTOP)
        t0 = time.monotonic()
        rc = p.wait(timeout=timeout + 60)
        took = time.monotonic() - t0
    err = (tmp_path / "err").read_text()
    assert rc == 2, err[-3000:]
    assert took < timeout + 10, took
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    assert "timed out after 5 s" in err and "rank(s) 1 of 2 did not arrive" in err, err
    assert "(group " in err
    assert not _wait_gone(str(tmp_path), 5.0)


# ---- run directories ---------------------------------------------------------------------
def test_two_runs_started_together_get_their_own_run_dirs(tmp_path, text_file, reaper):
    args = [*CMD, "--nproc", "1", *TINY_FLAGS, "--steps", "2", "--data", text_file]
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
    base = ["train", "--nproc", "1", *TINY_FLAGS, "--data", text_file, "--run-dir", str(run),
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
    (d / ".metadata").write_bytes(b"m")
    import hashlib

    files = {".metadata": hashlib.sha256(b"m").hexdigest()}
    (d / "meta.json").write_text(json.dumps({"format": 2, "step": step, "world_size": world,
                                             "model": {}, "files": files}))
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
                                "set e.g. vocab_size = 256 in the TOML"),
    "--lr inf": (lambda t, n: ["--lr", "inf"], "[train] lr (--lr) = inf must be a finite"),
    "--lr nan": (lambda t, n: ["--lr", "nan"], "[train] lr (--lr) = nan must be a finite"),
    "--bucket-mb inf": (lambda t, n: ["--bucket-mb", "inf"], "must be a finite number"),
    "--layers 0 names --layers": (lambda t, n: ["--layers", "0"], "pass e.g. --layers 4"),
    "--heads 0 names --heads": (lambda t, n: ["--heads", "0"], "pass e.g. --heads "),
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
    "--lr 1e300 in float32": (lambda t, n: ["--lr", "1e300", "--dtype", "float32"],
                              "--lr 1e+300 does not fit in float32"),
    "model too big for memory": (lambda t, n: ["--d-model", "65536", "--layers", "64",
                                               "--heads", "64", "--d-ff", "262144"],
                                 "GB of memory"),
    "--timeout 0": (lambda t, n: ["--timeout", "0"], "--timeout 0.0 must be a positive"),
    "--grace nan": (lambda t, n: ["--grace", "nan"], "--grace nan must be a positive"),
    "--max-restarts -1": (lambda t, n: ["--max-restarts", "-1"], "--max-restarts -1 must"),
    "--keep-checkpoints -1": (lambda t, n: ["--keep-checkpoints", "-1"],
                              "--keep-checkpoints -1 must"),
    "--nnodes 2 without endpoint": (lambda t, n: ["--nnodes", "2"], "needs --rdzv-endpoint"),
    "--node-rank out of range": (lambda t, n: ["--nnodes", "2", "--node-rank", "2",
                                               "--rdzv-endpoint", "127.0.0.1:1"],
                                 "--node-rank 2 must lie in [0, 1]"),
    "--rdzv-endpoint not host:port": (lambda t, n: ["--nnodes", "2", "--rdzv-endpoint",
                                                    "nowhere"], "is not HOST:PORT"),
    "a stray argument": (lambda t, n: ["auto"], "unexpected argument 'auto'"),
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
    t0 = time.monotonic()
    code = main(["train", "--nproc", str(nproc), *TINY_FLAGS, "--steps", "2", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and fragment in err, err
    assert time.monotonic() - t0 < 5  # refused before any worker starts
    assert not (tmp_path / "runs").exists()


def test_messages_name_only_flags_that_exist():
    """Every --flag written in the sources is a real flag of some command (or torchrun's)."""
    import re

    from typer.main import get_command

    from paratrain.cli.app import app

    flags = {"--nproc-per-node", "--standalone", "--field-name", "--rdzv-backend",
             "--rdzv-id",  # torchrun's; a comment
             "--logdir",  # TensorBoard's own (`tensorboard --logdir DIR`, in a hint)
             "--help"}  # every command's (click adds it, outside cmd.params)

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
    code = main(["train", "--nproc", "1", *TINY_FLAGS, "--steps", "2", "--data", text_file])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "cannot create the run dir" in err, err
