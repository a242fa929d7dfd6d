"""Process-group set-up and tear-down: the one place that knows about backends.

- Backend and device are chosen by themselves: NCCL + CUDA when a GPU is visible (gloo
  + CUDA when a node runs more ranks than it has GPUs), gloo + CPU otherwise.
- Every group gets a timeout, so a broken collective fails instead of hanging.
- Clean exit: with torch 2.13 and gloo, a process can abort at exit ("terminate called
  without an active exception") while gloo's threads are torn down after
  ``destroy_process_group()``. We therefore finish every output (files flushed, a final
  barrier so no peer is still talking to us) and then end the worker with ``os._exit``,
  which skips the interpreter's and gloo's destructors. See :func:`finish`.
"""

from __future__ import annotations

import datetime
import os
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 120.0
JOIN_TIMEOUT_S = 300.0  # the longest a worker waits for its peers to start


# ---- naming a hang: which collective, which group, which ranks did not arrive -------------
class CollectiveTimeout(RuntimeError):
    """A collective waited longer than ``--timeout`` for its peers."""


# The phase of the step this process is in: breadcrumbs for the timeout message only
# (like torch's flight recorder, process-wide; nothing reads it to decide anything).
_where = {"phase": "start-up", "group": "world", "step": -1, "timeout_s": DEFAULT_TIMEOUT_S}


def at(phase: str, group: str, step: int | None = None) -> None:
    """Record that this process enters ``phase``, whose collectives run on ``group``."""
    _where.update(phase=phase, group=group)
    if step is not None:
        _where["step"] = step


def is_timeout(e: BaseException) -> bool:
    """gloo: "Timed out waiting Nms for recv operation"; NCCL's watchdog: "Timeout"."""
    return isinstance(e, RuntimeError) and ("timed out" in str(e).lower()
                                            or "timeout" in str(e).lower())


PEER_LOST = ("connection reset", "connection closed", "broken pipe", "socket closed",
             "connection refused", "end of file")  # gloo's words for a peer gone


def is_peer_lost(e: BaseException) -> bool:
    """A collective failed because a peer process went away (killed, crashed)."""
    return isinstance(e, RuntimeError) and any(w in str(e).lower() for w in PEER_LOST)


def peer_lost_message(e: BaseException) -> str:
    """One line for a survivor of a dead peer: where it was, and gloo's first line."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    first = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0]  # gloo's source location
    return (f"{_where['phase']} at step {_where['step']} (group {_where['group']}) lost a "
            f"peer, which died or was killed ({first[:160]})")


def _store():
    """The default group's store (private in torch: this is its one adapter); under
    :func:`init_from_env` already this attempt's prefix."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # no group, or the API moved: the message loses the rank list only
        return None


def timeout_error(e: BaseException, settle_s: float = 2.0) -> CollectiveTimeout:
    """Name the phase, its group and the ranks that did not arrive. Every rank that
    times out marks itself on the store; after ``settle_s`` the ranks without a mark are
    the ones that never reached a collective (stopped, hung, or far behind)."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if not dist.is_initialized():
        return CollectiveTimeout(f"joining the process group timed out ({first[:160]}); "
                                 "check that every worker and node started, or raise "
                                 "--timeout")
    rank, world = dist.get_rank(), dist.get_world_size()
    missing: list[int] | None = None
    store = _store()
    if store is not None:
        try:
            store.set(f"paratrain/timeout/{rank}", _where["phase"])
            keys = [f"paratrain/timeout/{r}" for r in range(world)]
            deadline = time.monotonic() + settle_s
            while True:
                missing = [r for r, k in enumerate(keys) if not store.check([k])]
                if not missing or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        except Exception:
            missing = None
    who = (f"rank(s) {', '.join(map(str, missing))} of {world} did not arrive"
           if missing else "every rank arrived or the store could not tell which did not")
    return CollectiveTimeout(
        f"{_where['phase']} at step {_where['step']} (group {_where['group']}) timed out "
        f"after {_where['timeout_s']:g} s: {who} ({first[:160]}); check those processes, "
        "or raise --timeout")


def pick_backend() -> tuple[str, torch.device]:
    """('nccl', cuda:<local rank>) when CUDA is available, else ('gloo', cpu).

    More processes on this node (torchrun's LOCAL_WORLD_SIZE) than visible GPUs, e.g.
    benchmarks/gpu_check.py's 2-4 ranks on one GPU: NCCL refuses two ranks on one device,
    so gloo carries the CUDA tensors (its all-reduce, broadcast, all-gather and all-to-all
    stage through pinned host memory; it has no CUDA send/recv, so pipeline and ring
    context parallelism cannot run that way)."""
    if torch.cuda.is_available():
        ranks, gpus = node_ranks_and_gpus()
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return ("gloo" if ranks > gpus else "nccl"), torch.device("cuda", local % gpus)
    return "gloo", torch.device("cpu")


def node_ranks_and_gpus() -> tuple[int, int]:
    """(ranks on this node: torchrun's LOCAL_WORLD_SIZE, visible GPUs)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count()


def init_from_env(timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int, torch.device]:
    """Join the group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR/PORT).

    The group's store is keyed by torchrun's restart count: after an elastic restart the
    agent's store still holds the previous attempt's gloo addresses, and workers that
    read them connect to dead ports (seen with torch 2.13's ``--standalone``)."""
    backend, device = pick_backend()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=timeout_s)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    # joining waits for the slowest worker to start (seconds to minutes on a loaded
    # machine): the store gets its own generous timeout, collectives get ``timeout_s``
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent and rank == 0,
                          timeout=datetime.timedelta(seconds=max(timeout_s, JOIN_TIMEOUT_S)))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"paratrain/attempt_{attempt}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    _where["timeout_s"] = timeout_s
    return dist.get_rank(), dist.get_world_size(), device


def init_file_store(path: str, rank: int, world: int,
                    timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.device:
    """Join a group through a FileStore (tests and spawned benchmarks: no ports)."""
    backend, device = pick_backend()
    store = dist.FileStore(path, world)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return device


def finish(code: int = 0) -> None:
    """End a worker process after its outputs are complete (see module docstring)."""
    if code == 0 and dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        except Exception:  # a peer already failed; its error is what matters
            code = code or 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _spawned(fn, rank, world, store_path, out_dir, timeout_s, args):
    torch.set_num_threads(1)
    code = 0
    try:
        init_file_store(store_path, rank, world, timeout_s)
        result = fn(rank, world, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        traceback.print_exc()
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        code = 1
    finish(code)


def spawn(fn: Callable[..., Any], world: int, *args: Any,
          timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` fresh gloo processes; return the
    per-rank results (which must be torch.save-able). Raises RuntimeError with the first
    failing rank's traceback, or on timeout (processes are killed, never left hanging).
    ``fn`` must be importable (a module-level function).
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="paratrain-spawn-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_spawned, args=(fn, r, world, store, tmp, timeout_s, args))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = timeout_s + 60.0
        for p in procs:
            p.join(deadline)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        errs = sorted(Path(tmp).glob("rank*.err"))
        if errs:
            raise RuntimeError(f"{errs[0].stem} failed:\n{errs[0].read_text()}")
        if hung:
            raise RuntimeError(f"ranks {hung} did not finish within {deadline:.0f} s")
        bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            raise RuntimeError(f"ranks {bad} exited with codes {[procs[r].exitcode for r in bad]}")
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=True) for r in range(world)]
