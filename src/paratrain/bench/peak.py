"""Measurements of this machine used to express speed as a fraction of peak (MFU).

Why robust: on a shared machine one long measurement taken while another job runs
understates the peak, and the run then reports an MFU above 100%. So the peak is the
best of several short trials (a trial that lands in a quiet moment wins), and
:class:`PeakTracker` re-measures whenever the run itself goes faster than the peak it
was divided by, keeping the larger of the re-measurement and what the run achieved:
MFU = achieved / peak then never exceeds 1.
"""

from __future__ import annotations

import os
import time

import torch


def matmul_peak_flops(dtype: torch.dtype = torch.float32, n: int = 512, trials: int = 5,
                      seconds: float = 0.05, device: torch.device | None = None) -> float:
    """Best observed FLOP/s of an n x n matmul in this process (its thread count): the
    maximum over ``trials`` short trials of ``seconds`` each, a short pause between them
    so a burst of another process's work does not cover them all."""
    device = device or torch.device("cpu")
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    a @ b  # warm-up
    best = 0.0
    for trial in range(trials):
        if trial:
            time.sleep(0.01)
        end = time.perf_counter() + seconds
        while True:
            t0 = time.perf_counter()
            for _ in range(4):
                a @ b
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t1 = time.perf_counter()
            best = max(best, 4 * 2 * n**3 / (t1 - t0))
            if t1 >= end:
                break
    return best


class PeakTracker:
    """The per-rank peak FLOP/s a run's MFU divides by; never below what the run did.

    ``observe(achieved)`` is called with each step's achieved FLOP/s per rank; when it
    beats the current peak (the peak was measured under load) the matmul peak is measured
    again and the peak becomes the larger of both, so the fraction stays <= 1.
    ``remeasured`` counts how often that happened (the report says so).
    """

    def __init__(self, dtype: torch.dtype, device: torch.device | None = None,
                 enabled: bool = True) -> None:
        self.dtype, self.device = dtype, device
        self.enabled = enabled
        self.peak = matmul_peak_flops(dtype, device=device) if enabled else float("nan")
        self.remeasured = 0

    def observe(self, achieved: float) -> float:
        """MFU of ``achieved`` FLOP/s per rank (NaN when the peak is not measured)."""
        if not self.enabled:
            return float("nan")
        if achieved > self.peak:
            self.remeasured += 1
            self.peak = max(self.peak, achieved,
                            matmul_peak_flops(self.dtype, device=self.device))
        return achieved / self.peak


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
