"""Measurements of this machine used to express speed as a fraction of peak (MFU)."""

from __future__ import annotations

import time

import torch


def matmul_peak_flops(dtype: torch.dtype = torch.float32, n: int = 512,
                      seconds: float = 0.25, device: torch.device | None = None) -> float:
    """Best observed FLOP/s of an n x n matmul in this process (its thread count)."""
    device = device or torch.device("cpu")
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    a @ b  # warm-up
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t0))
    return best
