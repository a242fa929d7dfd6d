"""Stopping on a signal, and reporting a worker's user error to the launcher.

- :func:`install` makes SIGTERM and SIGINT set a flag instead of killing the process;
  the training loop reads it once per step (:func:`requested`), agrees on it across
  ranks with a one-element all-reduce, finishes that step, writes a checkpoint (when
  ``--checkpoint-dir`` is set) and raises :class:`Stopped`. With ``escalate`` (one
  process, the user's own) a second signal of the same kind ends it at once; workers
  do not escalate, since torchrun forwards the launcher's signal once more.
- :func:`write_failure` / :func:`read_failure`: a worker's ``error: ...`` line travels
  to the launcher in ``RUN_DIR/failure.txt`` (the first rank to fail creates it; the
  others find it there), so the launcher prints it once and exits 2.
- :func:`start_heartbeat` / :func:`beat` / :func:`last_beat`: under the launcher each
  worker writes ``RUN_DIR/heartbeat.RANK`` (the step it works on) when it starts and
  after every step and save; the launcher ends a run in which no worker has beaten for
  :func:`progress_deadline` seconds (every worker stopped or hung: no collective
  timeout can fire then).

No torch import: the launcher uses this module too.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

FAILURE_FILE = "failure.txt"
HEARTBEAT = "heartbeat"  # RUN_DIR/heartbeat.RANK
_state = {"signum": 0, "installed": False, "escalate": False, "beat": None}


class Stopped(Exception):
    """The run stopped early on a signal (after a complete step and its checkpoint)."""

    def __init__(self, signum: int, step: int, checkpoint: str | None) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        where = f"; checkpoint {checkpoint}" if checkpoint else " (no --checkpoint-dir)"
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}{where}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _handler(signum, frame) -> None:
    if _state["escalate"] and _state["signum"] == signum:  # asked twice: stop now
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _state["signum"] = signum


def install(escalate: bool = False) -> dict:
    """Turn SIGTERM / SIGINT into a stop request read by the training loop; returns the
    previous handlers for :func:`uninstall`."""
    old = {sig: signal.signal(sig, _handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    _state.update(signum=0, installed=True, escalate=escalate)
    return old


def uninstall(old: dict) -> None:
    for sig, h in old.items():
        signal.signal(sig, h)
    _state.update(signum=0, installed=False)


def installed() -> bool:
    return _state["installed"]


def requested() -> int:
    """The signal number asked to stop (0: none)."""
    return _state["signum"]


def write_failure(run_dir: str | Path, message: str) -> None:
    """Record ``message`` as the run's failure unless another rank already did."""
    path = Path(run_dir) / FAILURE_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:  # another rank was first (or the directory is gone)
        return
    with os.fdopen(fd, "w") as f:
        f.write(message.strip().splitlines()[0] if message.strip() else "unknown error")


def read_failure(run_dir: str | Path) -> str | None:
    path = Path(run_dir) / FAILURE_FILE
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def start_heartbeat(run_dir: str | Path, rank: int) -> None:
    """Beat into ``RUN_DIR/heartbeat.RANK`` from now on (the worker, under the launcher)."""
    _state["beat"] = Path(run_dir) / f"{HEARTBEAT}.{rank}"
    beat("start")


def beat(step: int | str) -> None:
    """Say this worker is alive and working on ``step`` (nothing unless started)."""
    path = _state["beat"]
    if path is not None:  # replaced whole: a worker stopped mid-write leaves no empty file
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            tmp.write_text(f"{step}\n")
            os.replace(tmp, path)
        except OSError:  # a full run directory must not end the run here
            pass


def last_beat(run_dir: str | Path) -> tuple[float, str] | None:
    """(time, step) of the newest heartbeat of any worker; None before the first."""
    newest = None
    for p in Path(run_dir).glob(f"{HEARTBEAT}.*"):
        try:
            t, said = p.stat().st_mtime, p.read_text().strip()
        except OSError:
            continue
        if newest is None or t > newest[0]:
            newest = (t, said)
    return newest


def clear_heartbeats(run_dir: str | Path) -> None:
    """Remove the heartbeats (the launcher, before and after a run)."""
    for pattern in (f"{HEARTBEAT}.*", f".{HEARTBEAT}.*.tmp"):
        for p in Path(run_dir).glob(pattern):
            p.unlink(missing_ok=True)


def progress_deadline(timeout_s: float) -> float:
    """Seconds without a heartbeat after which the launcher ends the run: twice the
    collective timeout plus 5 s. A hang of some workers is the collective timeout's to
    report (after ``timeout_s`` in the collective, its 2 s settle and the launcher's 1 s);
    the collective starts at most one step's compute after the last beat, allowed
    another ``timeout_s``. So only a run that no timeout can end meets this deadline."""
    return 2 * timeout_s + 5.0


def set_pdeathsig() -> None:
    """Get SIGTERM when the parent process dies, even by SIGKILL (Linux; else nothing)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass
