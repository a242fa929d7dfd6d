"""`paratrain bench calibrate`: measure this machine and write a hardware profile.

Measured: the transport's alpha (latency) and beta (1 / bandwidth) from a ping-pong
between two ranks, the same two fitted from a native all-reduce sweep
(t = 2(p-1) alpha + 2(p-1)/p n / bw; alpha from the messages <= 4 KiB, beta from those
>= 1 MiB), one-thread memory copy bandwidth, and fp32 matmul
FLOP/s on one thread and on all. The profile holds exactly the keys
``paratrain.cost.hardware.load_hardware`` reads; ``peak_flops`` is the measured matmul
rate, so ``eta`` is 1.0. Then every all-reduce algorithm is timed and set beside the
alpha-beta price of its schedule (:func:`paratrain.comm.cost.time_s`), size by size.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from pathlib import Path

from paratrain.cost.collectives import ring_factor, steps

DEFAULT_PROFILE = Path("~/.cache/paratrain/hardware.toml")


def _ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def calibrate_worker(rank: int, world: int, sizes: list[int], iters: int,
                     algorithms: list[str]) -> dict:
    """Ping-pong, native all-reduce sweep and our algorithms: per-size seconds."""
    import torch
    import torch.distributed as dist

    from paratrain.bench import measure
    from paratrain.comm import api

    pp = measure.ping_pong(rank, sizes, iters)
    native, ours = [], {a: [] for a in algorithms}
    for nbytes in sizes:
        bufs = [torch.zeros(max(1, nbytes // 4)) for _ in range(2)]
        calls = [("native", lambda b: dist.all_reduce(b))] + [
            (a, lambda b, a=a: api.all_reduce(b, algorithm=a)) for a in algorithms]
        for name, fn in calls:
            for i in range(3):
                fn(bufs[i % 2])
            dist.barrier()
            ts = []
            for i in range(iters):
                t = time.perf_counter()
                fn(bufs[i % 2])
                ts.append(time.perf_counter() - t)
            # median: robust to the odd iteration where another process took the core
            (native if name == "native" else ours[name]).append(statistics.median(ts))
    return {"ping_pong": pp, "native": native, "ours": ours}


def fit(sizes: list[int], per_rank: list[dict], p: int) -> dict:
    """alpha and bandwidth from the ping-pong and from the native all-reduce sweep."""
    from paratrain.bench.measure import fit_two_regimes

    pp = per_rank[0]["ping_pong"]
    a_pp, b_pp = fit_two_regimes([float(s) for s in sizes], pp)
    native = [statistics.fmean(r["native"][i] for r in per_rank) for i in range(len(sizes))]
    f = ring_factor("all_reduce", p)  # wire bytes per payload byte: 2(p-1)/p
    xs = [f * s for s in sizes]
    a_ar, b_ar = fit_two_regimes(xs, native, small=4096 * f, large=(1 << 20) * f)
    return {"alpha_pp": a_pp, "bw_pp": 1 / b_pp,
            "alpha_ar": a_ar / steps("all_reduce", "ring", p),
            "bw_ar": 1 / b_ar, "native": native}


def profile(name: str, flops: float, memcpy: float, alpha: float, bw: float,
            gpus_per_node: int) -> dict:
    """The hardware profile: the keys ``load_hardware`` reads (no fp8 figure here)."""
    return {"name": name, "peak_flops": flops, "hbm_bytes": float(_ram_bytes()),
            "hbm_bw": memcpy, "gpus_per_node": gpus_per_node, "intra_bw": bw,
            "intra_alpha": alpha, "inter_bw": bw, "inter_alpha": alpha, "eta": 1.0,
            "topology": "switch"}


def write_toml(values: dict, path: Path) -> Path:
    """Write a flat table as TOML (strings quoted, numbers in repr form)."""
    path = path.expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["# written by `paratrain bench calibrate`; read by load_hardware(path)"]
    for k, v in values.items():
        lines.append(f'{k} = "{v}"' if isinstance(v, str) else f"{k} = {v!r}")
    path.write_text("\n".join(lines) + "\n")
    return path


def run(nproc: int, sizes: list[int], iters: int, out: Path,
        algorithms: list[str]) -> tuple[dict, str]:
    """Measure, write the profile, and return (profile, report text)."""
    from paratrain.bench import measure
    from paratrain.comm.algorithms import build
    from paratrain.comm.api import SEGMENT_BYTES
    from paratrain.comm.cost import time_s
    from paratrain.parallel.process_groups import spawn

    if nproc < 2:
        raise ValueError(f"--nproc {nproc}: calibration needs at least 2 ranks")
    per_rank = spawn(calibrate_worker, nproc, sizes, iters, algorithms, timeout_s=3600)
    f = fit(sizes, per_rank, nproc)
    memcpy = measure.memcpy_bw()
    f1 = measure.matmul_flops(threads=1)
    fall = measure.matmul_flops(threads=os.cpu_count() or 1)
    # The profile takes alpha and bw fitted to the native all-reduce: what a collective
    # step really costs here (both directions, the reduction, the shared memory bus),
    # which is what the systems model's ring formula multiplies. Ping-pong is printed.
    alpha, bw = f["alpha_ar"], f["bw_ar"]
    prof = profile(f"calibrated-{socket.gethostname()}", max(f1, fall), memcpy, alpha, bw,
                   os.cpu_count() or 1)
    path = write_toml(prof, out)
    lines = [
        f"wrote {path}",
        f"ping-pong (ranks 0<->1): alpha {f['alpha_pp'] * 1e6:.1f} us, "
        f"bw {f['bw_pp'] / 1e9:.3f} GB/s",
        f"native all-reduce sweep (p={nproc}): alpha {f['alpha_ar'] * 1e6:.1f} us per step, "
        f"bw {f['bw_ar'] / 1e9:.3f} GB/s",
        f"memcpy (1 thread): {memcpy / 1e9:.2f} GB/s; matmul fp32: {f1 / 1e9:.1f} GFLOP/s "
        f"(1 thread), {fall / 1e9:.1f} GFLOP/s ({os.cpu_count()} threads)",
        "",
        f"all_reduce p={nproc}: measured (median iteration, mean over ranks) vs the "
        f"alpha-beta price of each schedule; pred = profile (all-reduce fit), "
        f"pp = ping-pong fit",
        f"{'size(B)':>10} {'algorithm':>16} {'measured(us)':>12} {'pred(us)':>9} "
        f"{'meas/pred':>9} {'pp(us)':>9} {'meas/pp':>8}",
    ]
    for i, s in enumerate(sizes):
        n = max(1, s // 4)
        rows = [("native(gloo)", "ring", f["native"][i])] + [
            (a, a, statistics.fmean(r["ours"][a][i] for r in per_rank)) for a in algorithms]
        for label, a, meas in rows:
            segs = max(1, min(n, 64, max(2, s // SEGMENT_BYTES)))
            sched = build("all_reduce", a, nproc, n, segments=segs)
            pred, pp = time_s(sched, alpha, bw), time_s(sched, f["alpha_pp"], f["bw_pp"])
            lines.append(f"{s:>10} {label:>16} {meas * 1e6:>12.1f} {pred * 1e6:>9.1f} "
                         f"{meas / pred:>9.2f} {pp * 1e6:>9.1f} {meas / pp:>8.2f}")
    return prof, "\n".join(lines)
