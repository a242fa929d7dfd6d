"""The `paratrain train --nproc N` launcher: torchrun in its own session, signals
forwarded, no orphans, a worker's error printed once; and the checks it makes first.

- :func:`torchrun_command`: one node (``--standalone``) or several (c10d rendezvous
  at ``--rdzv-endpoint``, each node's launcher started with its ``--node-rank``), with
  torchrun's elastic agent restarting the workers up to ``--max-restarts`` times.
- :func:`launch`: SIGINT / SIGTERM are forwarded to torchrun and every worker (SIGKILL
  after ``grace_s`` or on a second signal); when a worker reports a user error in
  ``RUN_DIR/failure.txt`` the launcher stops the rest at once (a peer stuck in a
  collective, or stopped, would otherwise hold the run until torchrun's own timeouts)
  and prints that one line.
- :func:`check_memory`: the systems model's bytes per rank against this machine's
  available memory, before anything is allocated.

No torch import (the CLI must start instantly).
"""

from __future__ import annotations

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


def launch(cmd: list[str], run_dir: str, grace_s: float = 7.0) -> int:
    """Run torchrun; forward SIGINT/SIGTERM to it and its workers (SIGKILL after
    ``grace_s`` or on a second signal); relay the first worker's user error once."""
    (Path(run_dir) / shutdown.FAILURE_FILE).unlink(missing_ok=True)
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
    got: list[tuple[int, float]] = []
    seen: set[int] = set()
    failed_at = None

    def forward(signum, frame) -> None:
        seen.update(_descendants(proc.pid))
        if got:  # a second signal: stop now
            _kill([proc.pid, *seen], signal.SIGKILL)
            return
        got.append((signum, time.monotonic()))
        _kill([proc.pid, *seen], signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                rc = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if got and now - got[0][1] > grace_s:
                    seen.update(_descendants(proc.pid))
                    _kill([proc.pid, *seen], signal.SIGKILL)
                if failed_at is None and shutdown.read_failure(run_dir):
                    failed_at = now
                if failed_at is not None and now - failed_at > FAILURE_SETTLE_S:
                    seen.update(_descendants(proc.pid))  # a peer may hang or be stopped
                    _kill([proc.pid, *seen], signal.SIGKILL)
    finally:
        signal.signal(signal.SIGINT, old[signal.SIGINT])
        signal.signal(signal.SIGTERM, old[signal.SIGTERM])
        left = [p for p in seen if Path(f"/proc/{p}").exists()]
        deadline = time.monotonic() + 2.0
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = [p for p in left if Path(f"/proc/{p}").exists()]
        _kill(left, signal.SIGKILL)  # nothing outlives the launcher
        reader.join(timeout=5.0)
    if got:
        return 128 + got[0][0]
    failure = shutdown.read_failure(run_dir)
    if rc != 0 and failure:
        print(f"error: {failure}", file=sys.stderr)
        return 2
    if rc == 0:  # torchrun's log of a worker it restarted: our warnings said it already
        held = [line for line in held if not TORCH_LOG.match(line)]
        sys.stderr.buffer.write(b"".join(held))
        sys.stderr.flush()
        return rc
    # A worker died without a user-facing error (killed, crashed): one line, and
    # torchrun's own report (its ChildFailedError traceback) kept in a file, not shown.
    log = Path(run_dir) / "torchrun.log"
    try:
        log.write_bytes(b"".join(held))
        where = f"torchrun's report is in {log}"
    except OSError:
        where = "torchrun wrote no readable report"
    print(f"error: {worker_death(b''.join(held))}; {where}; pass --max-restarts 1 "
          "--resume auto (with --checkpoint-dir) to survive a lost worker", file=sys.stderr)
    return rc


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
