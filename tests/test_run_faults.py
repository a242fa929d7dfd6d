"""Checkpoints and runs that cannot lose work (issue 21), with real processes, real
files, real filesystems and real signals:

- a fresh run pointed at another run's checkpoint directory is refused, touching
  nothing; two runs on one directory at once: the second is refused naming the first's
  pid; a lock left by a SIGKILLed run does not block;
- a checkpoint directory on a full disk (a small tmpfs: bytes, then inodes) or one
  remounted read-only mid-run is one line naming the device, the step and the size, with
  the previous step intact;
- a worker killed again after its restarts is told to pass more restarts, not the flags
  it was given;
- every worker stopped (SIGSTOP): the launcher's progress deadline ends the run;
- ``--checkpoint-every`` without ``--checkpoint-dir`` is refused.

The tmpfs tests mount filesystems, which needs root; elsewhere they skip, saying so.
The inner loop (``-m "not slow"``) keeps the full disk and the stopped workers; the
concurrent run, the inodes, the remount and the spent restarts are marked slow.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paratrain.cli import main
from paratrain.files import checkpoint, disk
from paratrain.files.checkpoint.lock import LOCK_FILE, acquire
from test_faults import (  # noqa: F401  (reaper is a fixture)
    CMD,
    TINY_FLAGS,
    _procs_mentioning,
    _steps,
    _wait_for_steps,
    _wait_gone,
    _workers,
    reaper,
)

pytestmark = pytest.mark.usefixtures("reaper")  # no process a test starts outlives it
ONE = ["--nproc", "1", *TINY_FLAGS]
TWO = ["--nproc", "2", *TINY_FLAGS]


def _snapshot(d: Path) -> dict[str, tuple[int, str]]:
    """Every file under ``d``: (mtime_ns, sha256)."""
    return {str(p.relative_to(d)): (p.stat().st_mtime_ns,
                                    hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(d.rglob("*")) if p.is_file()}


def _only_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    assert "Traceback" not in err
    return lines[0]


# ---- another run's checkpoint directory -------------------------------------------------
def test_fresh_run_into_another_runs_checkpoints_is_refused(tmp_path, text_file, capsys):
    """Another run's steps and tokenizer.json stay as they were, to the byte and the
    mtime; --resume into it is still checked (its seed differs: refused, naming it)."""
    ck = tmp_path / "ck"
    assert main(["train", *ONE, "--steps", "2", "--data", text_file, "--run-dir",
                 str(tmp_path / "a"), "--checkpoint-dir", str(ck)]) == 0
    before = _snapshot(ck)
    capsys.readouterr()
    code = main(["train", *ONE, "--steps", "2", "--seed", "7", "--data", text_file,
                 "--run-dir", str(tmp_path / "b"), "--checkpoint-dir", str(ck)])
    line = _only_line(capsys.readouterr().err)
    assert code == 2
    assert f"--checkpoint-dir {str(ck)!r} already holds files" in line
    assert "step_000002" in line and "--resume" in line
    assert _snapshot(ck) == before and not (tmp_path / "b").exists()
    assert not (ck / LOCK_FILE).exists()  # released with the refusal
    code = main(["train", *ONE, "--steps", "4", "--seed", "7", "--data", text_file,
                 "--run-dir", str(tmp_path / "c"), "--checkpoint-dir", str(ck), "--resume"])
    assert code == 2 and "train.seed=0 but" in capsys.readouterr().err
    assert _snapshot(ck) == before


@pytest.mark.slow
def test_second_run_on_one_checkpoint_dir_is_refused_naming_the_holder(tmp_path, text_file):
    """Run A holds the directory; B (--resume auto, which would otherwise resume A's
    checkpoint and write beside it) is refused with A's pid. A then dies by SIGKILL,
    leaving its lock file: the kernel released the flock, so C resumes."""
    ck, run = tmp_path / "ck", tmp_path / "a"
    with open(tmp_path / "err", "w") as err:
        a = subprocess.Popen([*CMD, *ONE, "--steps", "100000", "--data", text_file,
                              "--run-dir", str(run), "--checkpoint-dir", str(ck),
                              "--checkpoint-every", "2"], stderr=err, cwd=tmp_path)
        _wait_for_steps(a, run, 3, tmp_path)
        b = subprocess.run([*CMD, *ONE, "--steps", "100000", "--data", text_file, "--run-dir",
                            str(tmp_path / "b"), "--checkpoint-dir", str(ck), "--resume",
                            "auto"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
        line = _only_line(b.stderr)
        assert b.returncode == 2, b.stderr
        assert f"is in use by another run (pid {a.pid} on " in line, line
        assert a.poll() is None  # A runs on
        assert (ck / LOCK_FILE).read_text().split()[0] == str(a.pid)
        os.kill(a.pid, signal.SIGKILL)
        a.wait(timeout=10)
    assert (ck / LOCK_FILE).is_file()  # a stale lock file: its holder is dead
    newest = checkpoint.steps(ck)[0]
    c = subprocess.run([*CMD, *ONE, "--steps", str(newest + 1), "--data", text_file,
                        "--run-dir", str(tmp_path / "c"), "--checkpoint-dir", str(ck),
                        "--resume"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert c.returncode == 0, c.stderr[-3000:]
    assert _steps(tmp_path / "c") == [newest]
    assert not (ck / LOCK_FILE).exists()


def test_lock_is_exclusive_between_processes_and_released_on_death(tmp_path):
    """The lock itself: a live holder in another process refuses, naming its pid; once
    that process is SIGKILLed the same directory locks at once."""
    ck = tmp_path / "ck"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from paratrain.files.checkpoint.lock import "
         "acquire; acquire(sys.argv[1]); print('held', flush=True); time.sleep(600)",
         str(ck)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match=f"in use by another run \\(pid {holder.pid} on"):
            acquire(ck)
    finally:
        holder.kill()
        holder.wait(timeout=10)
    with acquire(ck):
        assert (ck / LOCK_FILE).read_text().split()[0] == str(os.getpid())
    assert ck.is_dir() and not (ck / LOCK_FILE).exists()
    with acquire(tmp_path / "new"):
        assert (tmp_path / "new" / LOCK_FILE).is_file()
    assert not (tmp_path / "new").exists()  # created by the lock, left empty: removed


def test_checkpoint_every_without_a_checkpoint_dir_is_refused(tmp_path, text_file, capsys,
                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = main(["train", *ONE, "--steps", "4", "--checkpoint-every", "2", "--data",
                 text_file])
    line = _only_line(capsys.readouterr().err)
    assert code == 2 and "--checkpoint-every 2 saves nothing without --checkpoint-dir" in line
    assert not (tmp_path / "runs").exists()


# ---- full and read-only disks -------------------------------------------------------------
@pytest.fixture
def tmpfs(tmp_path):
    """mount(options) -> a fresh tmpfs of its own under tmp_path; unmounted afterwards."""
    mounted = []

    def mount(options: str) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs needs root (mount -t tmpfs); the test "
                        "fills a real filesystem")
        d = tmp_path / f"fs{len(mounted)}"
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(d)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"mount -t tmpfs failed here ({r.stderr.strip()}); the test needs "
                        "a real small filesystem")
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def _run_until_failure(tmp_path, text_file, ck: Path, after=None, timeout=180):
    """A 2-worker run checkpointing every 2 steps into ``ck``; ``after(ck)`` once the
    first checkpoint exists. (exit code, stderr)."""
    run = tmp_path / "run"
    with open(tmp_path / "err", "w") as err:
        p = subprocess.Popen([*CMD, *TWO, "--steps", "100000", "--data", text_file,
                              "--run-dir", str(run), "--checkpoint-dir", str(ck),
                              "--checkpoint-every", "2"], stderr=err, cwd=tmp_path)
        if after is not None:
            deadline = time.monotonic() + 120
            while not (ck / "step_000002").is_dir() and p.poll() is None \
                    and time.monotonic() < deadline:
                time.sleep(0.02)
            after(ck)
        rc = p.wait(timeout=timeout)
    assert not _wait_gone(str(tmp_path), 10.0)
    return rc, (tmp_path / "err").read_text()


def test_full_disk_is_one_line_and_the_previous_step_is_intact(tmp_path, text_file, tmpfs):
    """1.5 MB: the first checkpoint (about 1.04 MB) fits, the second cannot; the check
    before the save says so, naming tmpfs, the path, step 4 and the size."""
    ck = tmpfs("size=1536k") / "ck"
    rc, err = _run_until_failure(tmp_path, text_file, ck)
    line = _only_line(err)
    assert rc == 2, err
    assert line.startswith(f"error: no space left on tmpfs {ck} while saving step 4 "
                           "(needs about 1.04 MB"), line
    assert "the previous checkpoint step_000002 is intact" in line, line
    assert checkpoint.peek(ck)["step"] == 2  # every file there, every sha256 right
    assert not list(ck.glob("step_*.tmp"))


@pytest.mark.slow
def test_no_free_inode_during_a_save_is_one_line(tmp_path, text_file, tmpfs):
    """Room for the bytes but not the files: the check before the save passes and the
    save itself fails (ENOSPC from mkdir on rank 0, its peer waiting in a barrier); the
    worker that hit it reports it, the launcher stops the peer and prints it once.
    10 inodes: the root, ck, the lock, tokenizer.json, latest, step_000002 and its 4."""
    ck = tmpfs("size=64m,nr_inodes=10") / "ck"
    rc, err = _run_until_failure(tmp_path, text_file, ck)
    line = _only_line(err)
    assert rc == 2, err
    assert line.startswith(f"error: no space left on tmpfs {ck} while saving step 4"), line
    assert "no free inodes" in line and "step_000002 is intact" in line, line
    assert checkpoint.peek(ck)["step"] == 2


def _remount_read_only(fs: Path) -> None:
    """As the kernel does to a failing disk; EBUSY while a file is open for writing
    (the save of ``latest``), so tried again."""
    for _ in range(200):
        if subprocess.run(["mount", "-o", "remount,ro", str(fs)],
                          capture_output=True).returncode == 0:
            return
        time.sleep(0.01)
    raise AssertionError(f"could not remount {fs} read-only")


@pytest.mark.slow
def test_disk_remounted_read_only_is_one_line(tmp_path, text_file, tmpfs):
    """Read-only mid-run (after the first checkpoint): the next save is one line."""
    fs = tmpfs("size=64m")
    rc, err = _run_until_failure(tmp_path, text_file, fs / "ck",
                                 after=lambda ck: _remount_read_only(fs))
    line = _only_line(err)
    assert rc == 2, err
    assert line.startswith(f"error: read-only file system on tmpfs {fs / 'ck'} while saving "
                           "step "), line
    kept = checkpoint.peek(fs / "ck")["step"]
    assert f"the previous checkpoint step_{kept:06d} is intact" in line, line
    assert "make it writable or pass another --checkpoint-dir" in line


def test_permission_denied_is_named(tmp_path):
    """EACCES as a save meets it (root ignores chmod, so the error itself is made)."""
    ck = tmp_path / "ck"
    ck.mkdir()
    e = PermissionError(errno.EACCES, "Permission denied", str(ck / "step_000004.tmp"))
    said = disk.diagnose(e, ck, 4, 2_000_000, 2)
    assert said.startswith(f"permission denied on {disk.device_of(ck)} {ck} while saving "
                           "step 4 (needs about 2 MB)"), said
    assert "the previous checkpoint step_000002 is intact" in said
    assert disk.diagnose(RuntimeError("peer lost"), ck, 4, 2_000_000, 2) is None


# ---- restarts spent: the advice follows what was passed ----------------------------------
@pytest.mark.slow
def test_killed_again_after_the_restarts_is_told_to_pass_more(tmp_path, text_file):
    run, ck = tmp_path / "run", tmp_path / "ck"
    with open(tmp_path / "err", "w") as err:
        p = subprocess.Popen([*CMD, *TWO, "--steps", "100000", "--data", text_file,
                              "--run-dir", str(run), "--checkpoint-dir", str(ck),
                              "--checkpoint-every", "2", "--max-restarts", "1", "--resume",
                              "auto"], stderr=err, cwd=tmp_path)
        _wait_for_steps(p, run, 3, tmp_path)
        first = _workers(run)[1]
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while "resumes from step" not in (tmp_path / "err").read_text() \
                and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.1)
        again = _workers(run).get(1)
        assert again not in (None, first), (tmp_path / "err").read_text()
        os.kill(again, signal.SIGKILL)
        rc = p.wait(timeout=120)
    err = (tmp_path / "err").read_text()
    assert rc != 0
    line = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(line) == 1, err
    assert "SIGKILL" in line[0] and "after all 1 restart(s) of --max-restarts 1" in line[0]
    assert "pass --max-restarts 2 or more" in line[0], line[0]
    assert "--resume auto" not in line[0]  # it was passed
    assert _wait_gone(str(run), 10) == []


# ---- every worker stopped: the progress deadline ------------------------------------------
def test_every_worker_stopped_is_ended_by_the_progress_deadline(tmp_path, text_file):
    """No collective can time out when no worker runs: the launcher sees no heartbeat
    for 2 x --timeout + 5 s (13 s here), SIGKILLs the stopped workers and names the step."""
    run = tmp_path / "run"
    timeout = 4
    with open(tmp_path / "err", "w") as err:
        p = subprocess.Popen([*CMD, *TWO, "--steps", "100000", "--data", text_file,
                              "--run-dir", str(run), "--timeout", str(timeout)],
                             stderr=err, cwd=tmp_path)
        _wait_for_steps(p, run, 2, tmp_path)
        workers = _workers(run)
        for pid in workers.values():
            os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        rc = p.wait(timeout=60)
        took = time.monotonic() - t0
    err = (tmp_path / "err").read_text()
    line = _only_line(err)
    assert rc == 2, err
    assert took < 2 * timeout + 5 + 10, took
    logged = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert "no worker made progress for" in line and "2 x --timeout 4 + 5 s" in line, line
    assert "every worker is stopped or hung in step" in line, line
    assert int(line.split("in step ")[1].split(";")[0]) >= logged[-1]
    assert not _wait_gone(str(tmp_path), 5.0)
    assert not any(Path(f"/proc/{pid}/cmdline").exists() and
                   Path(f"/proc/{pid}/cmdline").read_bytes() for pid in workers.values())
    assert _procs_mentioning(str(run)) == []
