"""Measurements of this machine used to express speed as a fraction of peak (MFU).

The peak a run's MFU divides by is measured **once, before training**, and never changes
during the run (:func:`measure_peak`), so the MFU curve moves only when the run's speed
does. An earlier version re-measured the peak whenever a step beat it; on a shared machine
the re-measure could land in a quieter moment than the first measurement and the curve
then fell from ~70% to ~20% at that step while tokens/s stayed flat.

Why robust: on a shared machine one measurement taken while another job runs understates
the peak. So the peak is the best of several short trials after a warm-up (a trial that
lands in a quiet moment wins), taken on every rank at once (the ranks then train at once,
sharing the cores the same way), and the ranks agree on the largest: interference only
ever makes a measurement slower than the hardware, never faster. A peak measured under
heavy load can still be beaten by the run; its MFU is then above 100%, which the loop
says once in a warning rather than hiding by moving the denominator.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

TRIALS = 16  # timed trials per rank, after WARMUP untimed ones
WARMUP = 2
REPS = 2  # matmuls per trial


def matmul_peak_flops(dtype: torch.dtype = torch.float32, n: int = 512, trials: int = TRIALS,
                      device: torch.device | None = None, warmup: int = WARMUP,
                      reps: int = REPS, pause_s: float = 0.01,
                      clock: Callable[[], float] = time.perf_counter) -> float:
    """Best observed FLOP/s of an n x n matmul in this process (its thread count): the
    maximum over ``trials`` timed trials of ``reps`` matmuls each, after ``warmup``
    untimed ones (allocation, thread-pool wake-up), a short pause between trials so a
    burst of another process's work does not cover them all. ``clock`` is injectable so
    tests can check the arithmetic with known timings."""
    device = device or torch.device("cpu")
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)

    def trial() -> float:
        t0 = clock()
        for _ in range(reps):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return clock() - t0

    for _ in range(warmup):
        trial()
    best = 0.0
    for k in range(trials):
        if k:
            time.sleep(pause_s)
        dt = trial()
        if dt > 0:
            best = max(best, reps * 2 * n**3 / dt)
    return best


@dataclass(frozen=True)
class Peak:
    """The per-rank peak FLOP/s one run's MFU divides by, and how it was measured."""

    flops: float  # per rank; NaN when not measured
    n: int = 512
    trials: int = TRIALS
    ranks: int = 1
    dtype: str = "float32"

    def mfu(self, achieved: float) -> float:
        """``achieved`` FLOP/s per rank as a fraction of the peak (NaN unmeasured)."""
        return achieved / self.flops if math.isfinite(self.flops) else float("nan")

    def describe(self) -> str:
        """The one line a run prints before its first step."""
        if not math.isfinite(self.flops):
            return "peak: not measured (MFU is not reported)"
        ranks = f" on each of {self.ranks} ranks, max over ranks" if self.ranks > 1 else ""
        return (f"peak: {self.flops / 1e9:.1f} GFLOP/s per rank (matmul {self.n}^3 "
                f"{self.dtype}, best of {self.trials}{ranks}, measured before training)")

    def to_dict(self) -> dict:
        return {"flops_per_rank": self.flops, "matmul_n": self.n, "trials": self.trials,
                "ranks": self.ranks, "dtype": self.dtype, "agreed_by": "max over ranks",
                "measured": "once, before training"}


def measure_peak(dtype: torch.dtype, device: torch.device | None = None,
                 enabled: bool = True, local: Callable[[], float] | None = None) -> Peak:
    """:class:`Peak` of this run: every rank measures at once (after a barrier), then an
    all-reduce MAX agrees on one number (collective when a process group exists).
    ``local`` is this rank's measurement (default :func:`matmul_peak_flops`; injectable
    so tests can check the agreement with known numbers)."""
    device = device or torch.device("cpu")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    n = 4096 if device.type == "cuda" else 512  # 512^3 is no test of a GPU
    name = str(dtype).removeprefix("torch.")
    if not enabled:
        return Peak(float("nan"), n, TRIALS, world, name)
    if world > 1:
        dist.barrier()
    flops = local() if local is not None else matmul_peak_flops(dtype, n, device=device)
    if world > 1:
        t = torch.tensor([flops], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        flops = float(t.item())
    return Peak(flops, n, TRIALS, world, name)


def memory_bytes(device: torch.device) -> int:
    """This process's memory now: the allocator's peak on CUDA, else the resident set
    (``/proc/self/statm``; 0 where there is no /proc)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
