"""The `paratrain train --nproc N` launcher: torchrun in its own session, signals
forwarded, no orphans, a worker's error printed once; and the checks it makes first.

- :func:`torchrun_command`: one node (``--standalone``) or several (c10d rendezvous
  at ``--rdzv-endpoint``, each node's launcher started with its ``--node-rank``), with
  torchrun's elastic agent restarting the workers up to ``--max-restarts`` times.
- :func:`launch`: SIGINT / SIGTERM are forwarded to torchrun and every worker (SIGKILL
  after ``grace_s`` or on a second signal); when a worker reports a user error in
  ``RUN_DIR/failure.txt`` the launcher stops the rest at once (a peer stuck in a
  collective, or stopped, would otherwise hold the run until torchrun's own timeouts)
  and prints that one line. When no worker has beaten its heartbeat for
  :func:`paratrain.run.shutdown.progress_deadline` (every worker stopped or hung), the
  launcher SIGKILLs them all and names the step. A worker that died otherwise is one
  line with advice fitted to the flags the run was given (:func:`restart_advice`).
- :func:`check_memory`: the systems model's bytes per rank against this machine's
  available memory, before anything is allocated.

No torch import (the CLI must start instantly).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from paratrain.run import shutdown

RDZV_ID = "paratrain"  # every node's launcher names the same rendezvous


def torchrun_command(nproc: int, spec_path: str, nnodes: int = 1, node_rank: int = 0,
                     rdzv_endpoint: str | None = None, max_restarts: int = 0) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if nnodes == 1 and rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={RDZV_ID}"]
    cmd += [f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
            "-m", "paratrain.run.worker", str(spec_path)]
    return cmd


def check_endpoint(endpoint: str | None, nnodes: int, node_rank: int) -> None:
    if nnodes < 1:
        raise ValueError(f"--nnodes {nnodes} must be >= 1")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank {node_rank} must lie in [0, {nnodes - 1}] for "
                         f"--nnodes {nnodes}")
    if nnodes > 1 and endpoint is None:
        raise ValueError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (the same on "
                         "every node, e.g. the first node's address and a free port)")
    if endpoint is not None:
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--rdzv-endpoint {endpoint!r} is not HOST:PORT; pass e.g. "
                             "--rdzv-endpoint 10.0.0.1:29400")


def _available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def rank_bytes(mcfg, tcfg, plan) -> float:
    """Bytes the busiest rank needs (the systems model): its model states
    (:func:`paratrain.predict.rank_state_bytes`) and saved activations
    (:func:`paratrain.cost.activations.rank_activation_peaks`), or the full FP32 model
    every rank builds before sharding it, whichever is larger."""
    from paratrain.cost.activations import kernel, rank_activation_peaks
    from paratrain.cost.ranks import ELEMENT_BYTES
    from paratrain.cost.shapes import as_shape
    from paratrain.predict import rank_state_bytes

    world = plan.dp * plan.tp * plan.pp * plan.cp
    states = max(sum(rank_state_bytes(mcfg, plan, tcfg, r).values()) for r in range(world))
    elem = float(ELEMENT_BYTES[tcfg.dtype])
    try:
        acts = max(rank_activation_peaks(
            mcfg, plan, tcfg.global_batch * mcfg.context, mcfg.context,
            kernel(mcfg.attention), elem))
    except ValueError:
        acts = 0.0
    return max(states + acts, as_shape(mcfg).num_params() * 4.0)


def check_memory(mcfg, tcfg, plan, local_ranks: int) -> None:
    """Refuse, before any allocation, a run the machine cannot hold."""
    have = _available_bytes()
    if have is None:
        return
    need = rank_bytes(mcfg, tcfg, plan) * local_ranks
    if need > have:
        raise ValueError(f"this run needs {need / 1e9:.3g} GB of memory ({local_ranks} "
                         f"process(es), the systems model's bytes per rank) but this machine "
                         f"has {have / 1e9:.3g} GB available; use a smaller model, more "
                         "ranks (--zero 3, --tp, --pp) or fewer processes per node")


# ---- the launcher ------------------------------------------------------------------------
def _children() -> dict[int, int]:
    """pid -> parent pid of every process (Linux /proc)."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                out[int(d.name)] = int(fields[1])
            except (OSError, IndexError, ValueError):
                continue
    return out


def _descendants(pid: int) -> set[int]:
    parents = _children()
    found, frontier = set(), {pid}
    while frontier:
        frontier = {c for c, pp in parents.items() if pp in frontier and c not in found}
        found |= frontier
    return found


def _kill(pids, sig) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass


TORCH_LOG = re.compile(rb"[IWEF]\d{4} \d\d:\d\d:\d\d")  # glog-style lines torch logs
FAILURE_SETTLE_S = 1.0  # after the first failure line: time for torchrun to end by itself


def _spec(cmd: list[str]) -> dict:
    """The workers' spec (RUN_DIR/run.json, the command's last argument): what the run
    was given, for the deadline and the advice. {} for another command."""
    try:
        return json.loads(Path(cmd[-1]).read_text()) if cmd[-1].endswith(".json") else {}
    except (OSError, ValueError):
        return {}


def _max_restarts(cmd: list[str]) -> int:
    for a in cmd:
        if a.startswith("--max-restarts="):
            return int(a.split("=", 1)[1])
    return 0


class _Watch:
    """torchrun and its workers while they run: signals forwarded (SIGKILL after
    ``grace_s`` or on a second signal), a worker's failure line, and the progress
    deadline (no heartbeat for ``deadline_s``: every worker stopped or hung)."""

    def __init__(self, proc, run_dir: str, grace_s: float, deadline_s: float) -> None:
        self.proc, self.run_dir, self.grace_s, self.deadline_s = proc, run_dir, grace_s, \
            deadline_s
        self.got: list[tuple[int, float]] = []
        self.seen: set[int] = set()
        self.failed_at = None
        self.stalled: tuple[float, str] | None = None  # (seconds, step) when the deadline hit
        self.started = time.time()

    def kill_all(self, sig) -> None:
        self.seen.update(_descendants(self.proc.pid))
        _kill([self.proc.pid, *self.seen], sig)

    def forward(self, signum, frame) -> None:
        if self.got:  # a second signal: stop now
            self.kill_all(signal.SIGKILL)
            return
        self.got.append((signum, time.monotonic()))
        self.kill_all(signum)

    def _check_progress(self) -> None:
        last = shutdown.last_beat(self.run_dir)
        if last is None or last[0] < self.started:
            return  # before the first beat: starting up (torchrun's rendezvous bounds it)
        quiet = time.time() - last[0]
        if quiet > self.deadline_s:
            self.stalled = (quiet, last[1])
            self.kill_all(signal.SIGKILL)  # SIGKILL ends a stopped process too

    def wait(self) -> int:
        while True:
            try:
                return self.proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if self.got and now - self.got[0][1] > self.grace_s:
                    self.kill_all(signal.SIGKILL)
                if self.failed_at is None and shutdown.read_failure(self.run_dir):
                    self.failed_at = now
                if self.failed_at is not None and now - self.failed_at > FAILURE_SETTLE_S:
                    self.kill_all(signal.SIGKILL)  # a peer may hang or be stopped
                if not self.got and self.failed_at is None and self.stalled is None:
                    self._check_progress()

    def reap(self) -> None:
        """Nothing outlives the launcher: wait for what it saw to go, SIGKILL the rest."""
        left = [p for p in self.seen if Path(f"/proc/{p}").exists()]
        deadline = time.monotonic() + 2.0
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = [p for p in left if Path(f"/proc/{p}").exists()]
        _kill(left, signal.SIGKILL)


def _start(cmd: list[str]):
    """torchrun in its own session (dies with us); its stderr read by a thread that
    shows our warnings now and holds the rest. (proc, held lines, reader thread)."""
    # torchrun prints an OMP_NUM_THREADS banner unless the variable is set; the workers
    # run one intra-op thread each anyway (worker.run_worker)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, start_new_session=True, env=env,
                            preexec_fn=shutdown.set_pdeathsig if sys.platform == "linux" else None)
    held: list[bytes] = []

    def relay() -> None:  # our own warnings now; torchrun's noise only if it matters
        for line in iter(proc.stderr.readline, b""):
            if line.startswith(b"warning:"):
                sys.stderr.buffer.write(line)
                sys.stderr.flush()
            else:
                held.append(line)

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    return proc, held, reader


def launch(cmd: list[str], run_dir: str, grace_s: float = 7.0) -> int:
    """Run torchrun; forward SIGINT/SIGTERM to it and its workers (SIGKILL after
    ``grace_s`` or on a second signal); relay the first worker's user error once; end a
    run without progress (:func:`paratrain.run.shutdown.progress_deadline`)."""
    spec = _spec(cmd)
    (Path(run_dir) / shutdown.FAILURE_FILE).unlink(missing_ok=True)
    shutdown.clear_heartbeats(run_dir)
    proc, held, reader = _start(cmd)
    watch = _Watch(proc, run_dir, grace_s, shutdown.progress_deadline(
        spec.get("timeout_s", 120.0)))
    old = {s: signal.signal(s, watch.forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = watch.wait()
    finally:
        signal.signal(signal.SIGINT, old[signal.SIGINT])
        signal.signal(signal.SIGTERM, old[signal.SIGTERM])
        watch.reap()
        reader.join(timeout=5.0)
        shutdown.clear_heartbeats(run_dir)
    return _report(rc, watch, b"".join(held), run_dir, spec, _max_restarts(cmd))


def _report(rc: int, watch: _Watch, held: bytes, run_dir: str, spec: dict,
            max_restarts: int) -> int:
    """The launcher's exit code, and its one line when the run failed."""
    if watch.got:
        return 128 + watch.got[0][0]
    failure = shutdown.read_failure(run_dir)
    if rc != 0 and failure:
        print(f"error: {failure}", file=sys.stderr)
        return 2
    if watch.stalled is not None:
        quiet, step = watch.stalled
        where = "while starting" if step == "start" else f"in step {step}"
        timeout = spec.get("timeout_s", 120.0)
        print(f"error: no worker made progress for {quiet:.0f} s (the deadline is 2 x "
              f"--timeout {timeout:g} + 5 s): every worker is stopped or hung {where}; "
              "they were killed; pass a larger --timeout if a step really takes this long",
              file=sys.stderr)
        return 2
    if rc == 0:  # torchrun's log of a worker it restarted: our warnings said it already
        kept = [line for line in held.splitlines(keepends=True) if not TORCH_LOG.match(line)]
        sys.stderr.buffer.write(b"".join(kept))
        sys.stderr.flush()
        return rc
    # A worker died without a user-facing error (killed, crashed): one line, and
    # torchrun's own report (its ChildFailedError traceback) kept in a file, not shown.
    log = Path(run_dir) / "torchrun.log"
    try:
        log.write_bytes(held)
        where = f"torchrun's report is in {log}"
    except OSError:
        where = "torchrun wrote no readable report"
    print(f"error: {worker_death(held)}; {where}; {restart_advice(spec, max_restarts)}",
          file=sys.stderr)
    return rc


def restart_advice(spec: dict, max_restarts: int) -> str:
    """What to pass next, from what this run was given (``spec``: the workers' spec)."""
    opts = spec.get("opts", {})
    resumes = bool(opts.get("checkpoint_dir")) and bool(opts.get("resume"))
    if max_restarts == 0:
        if resumes:
            return "pass --max-restarts 1 to survive a lost worker"
        return ("pass --max-restarts 1 --resume auto (with --checkpoint-dir) to survive a "
                "lost worker")
    said = (f"the workers failed again after all {max_restarts} restart(s) of "
            f"--max-restarts {max_restarts}; pass --max-restarts {max_restarts + 1} or more "
            "if the failures are transient, or find why the worker dies")
    if not resumes:
        said += "; add --checkpoint-dir DIR --resume auto so a restart resumes its steps"
    return said


def worker_death(report: bytes) -> str:
    """One phrase for how a worker ended, from torchrun's failure report."""
    text = report.decode(errors="replace")
    sig = re.search(r"Signal (\d+) \((SIG\w+)\) received by PID (\d+)", text)
    if sig:
        return f"a worker (pid {sig.group(3)}) was killed by {sig.group(2)}"
    code = re.search(r"exitcode\s*:\s*(-?\d+)", text)
    rank = re.search(r"rank\s*:\s*(\d+)", text)
    if code:
        who = f"worker rank {rank.group(1)}" if rank else "a worker"
        return f"{who} exited with code {code.group(1)}"
    return "the workers failed"
