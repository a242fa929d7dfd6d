"""Small measurements shared by the benchmarks: memory copy, point-to-point bandwidth and
ping-pong latency over the process group, matmul FLOP/s, and a least-squares alpha-beta
fit. Imported inside command bodies (it imports torch)."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist


def memcpy_bw(nbytes: int = 64 << 20, iters: int = 10) -> float:
    """Bytes copied per second by one thread (each byte is read once and written once)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    return nbytes * iters / (time.perf_counter() - t)


def matmul_flops(n: int = 1024, iters: int = 5, threads: int | None = None) -> float:
    """fp32 matmul FLOP/s (2 n^3 per product) with ``threads`` intra-op threads."""
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        t = time.perf_counter()
        for _ in range(iters):
            a @ b
        return 2 * n**3 * iters / (time.perf_counter() - t)
    finally:
        torch.set_num_threads(old)


def stream_bw(rank: int, nbytes: int = 64 << 20, iters: int = 5) -> float:
    """One-way bandwidth rank 0 -> rank 1 over the group's transport (loopback TCP for
    gloo on one host), bytes/s; other ranks return 0. Collective over ranks 0 and 1."""
    buf = torch.zeros(nbytes // 4)
    dist.barrier()
    if rank > 1:
        dist.barrier()
        return 0.0
    t = time.perf_counter()
    for _ in range(iters):
        if rank == 0:
            dist.send(buf, 1)
        else:
            dist.recv(buf, 0)
    dist.barrier()  # the receiver's clock decides; the barrier costs one alpha
    return nbytes * iters / (time.perf_counter() - t)


def ping_pong(rank: int, sizes: list[int], iters: int = 20) -> list[float]:
    """Half round-trip seconds rank 0 <-> rank 1 for each size in bytes (others: 0s).

    Blocking send then receive is safe here: the two ranks alternate, never both send."""
    out = []
    for nbytes in sizes:
        buf = torch.zeros(max(1, nbytes // 4))
        dist.barrier()
        if rank > 1:
            out.append(0.0)
            continue
        ts = []
        for i in range(iters + 3):
            t = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            if i >= 3:  # after warm-up
                ts.append(time.perf_counter() - t)
        # median: robust to an iteration where another process held the core
        out.append(statistics.median(ts) / 2)
    dist.barrier()
    return out


def fit_alpha_beta(xs: list[float], ts: list[float]) -> tuple[float, float]:
    """Least squares t = a + b x over (x, t) points; returns (a, b) with a, b >= 0."""
    n = len(xs)
    if n < 2:
        raise ValueError(f"{n} point(s) cannot fit a line; measure at least 2 sizes")
    mx, mt = sum(xs) / n, sum(ts) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (t - mt) for x, t in zip(xs, ts, strict=True)) / sxx if sxx else 0.0
    b = max(b, 1e-30)
    a = max(0.0, mt - b * mx)
    return a, b


def fit_two_regimes(xs: list[float], ts: list[float], small: float = 4096,
                    large: float = 1 << 20) -> tuple[float, float]:
    """(a, b) of t = a + b x, with the latency a from the small points (x <= small:
    median time) and b from the large ones (x >= large: median of (t - a) / x).

    A least-squares line through all points is dominated by the large sizes, and one
    preempted large transfer can turn its intercept negative or into milliseconds; the
    two regimes are what alpha and beta mean. Falls back to least squares when either
    regime has no point."""
    lo = [t for x, t in zip(xs, ts, strict=True) if x <= small]
    hi = [(x, t) for x, t in zip(xs, ts, strict=True) if x >= large]
    if not lo or not hi:
        return fit_alpha_beta(xs, ts)
    a = statistics.median(lo)
    b = statistics.median(max(t - a, 1e-12) / x for x, t in hi)
    return a, b
