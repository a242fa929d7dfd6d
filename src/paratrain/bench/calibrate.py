"""`paratrain bench calibrate`: measure this machine and write a hardware profile.

Measured: the transport's alpha (latency) and beta (1 / bandwidth) from a ping-pong
between two ranks, the same two fitted from a native all-reduce sweep
(t = 2(p-1) alpha + 2(p-1)/p n / bw; alpha from the messages <= 4 KiB, beta from those
>= 1 MiB), one-thread memory copy bandwidth, and fp32 matmul
FLOP/s on one thread and on all. The profile holds exactly the keys
``paratrain.cost.hardware.load_hardware`` reads; ``peak_flops`` is the measured matmul
rate, so ``eta`` is 1.0. Then every all-reduce algorithm is timed and set beside the
alpha-beta price of its schedule (:func:`paratrain.comm.cost.time_s`), size by size.

Why every measurement is repeated until it is stable: a calibration taken while other
jobs run is wrong for as long as the profile is used (one run was then +720% off). Each
measurement is repeated in rounds until the last ``k`` rounds agree (coefficient of
variation of every timing at most ``cv``, :class:`Stability`), and its median over them is
kept; a machine that never settles within ``max_repeats`` rounds is refused with one line
(:class:`BusyMachine`) instead of writing a profile that misleads every later prediction.

Also measured, for the oversubscribed CPU (:mod:`paratrain.predict.sched`): what a
blocking sync costs beyond the compute around it, on free cores and with twice as many
ranks as cores (:func:`sync_worker`), written beside the profile
(:func:`save_sched`).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from paratrain.bench.stability import (  # noqa: F401 - re-exported
    STABLE_CV_ENV,
    BusyMachine,
    Stability,
    _agree_all,
    default_rule,
    until_stable,
    variation,
)
from paratrain.cost.collectives import ring_factor, steps

DEFAULT_PROFILE = Path("~/.cache/paratrain/hardware.toml")
SCHED_NAME = "cpu_sched.json"  # written next to the profile by `paratrain bench calibrate`


def _ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _native_sweep(sizes: list[int], iters: int) -> list[float]:
    """Median seconds of a native gloo all-reduce at each size."""
    import torch
    import torch.distributed as dist

    out = []
    for nbytes in sizes:
        buf = torch.zeros(max(1, nbytes // 4))
        for _ in range(3):
            dist.all_reduce(buf)
        dist.barrier()
        ts = []
        for _ in range(iters):
            t = time.perf_counter()
            dist.all_reduce(buf)
            ts.append(time.perf_counter() - t)
        out.append(statistics.median(ts))
    return out


def calibrate_worker(rank: int, world: int, sizes: list[int], iters: int,
                     algorithms: list[str], rule: Stability = Stability()) -> dict:
    """Ping-pong and native all-reduce sweep, repeated until stable (the ranks agree),
    then our algorithms once (for the report): per-size seconds. Unstable: {"busy": line}."""
    import torch
    import torch.distributed as dist

    from paratrain.bench import measure
    from paratrain.comm import api

    n = len(sizes)

    def one_round() -> list[float]:
        pp = measure.ping_pong(rank, sizes, iters)  # every rank joins its barriers
        return [*(pp if rank < 2 else [1.0] * n), *_native_sweep(sizes, iters)]

    def fitted(xs: list[float]) -> list[float]:
        """The latency and per-byte time the profile takes from a round (fit_two_regimes):
        one size's latency alone flips between a wake-up and none."""
        from paratrain.bench.measure import fit_two_regimes

        fs = [float(x) for x in sizes]
        (a_pp, b_pp), (a_ar, b_ar) = fit_two_regimes(fs, xs[:n]), fit_two_regimes(fs, xs[n:])
        # without a size of 1 MiB or more the slope is the small sizes' noise: not judged
        return [a_pp, a_ar] + ([b_pp, b_ar] if max(sizes) >= 1 << 20 else [])

    try:
        vals = until_stable(one_round, "the gloo ping-pong and all-reduce sweep", rule,
                            _agree_all, fitted)
    except BusyMachine as e:
        return {"busy": str(e)}
    ours = {a: [] for a in algorithms}
    for nbytes in sizes:
        bufs = [torch.zeros(max(1, nbytes // 4)) for _ in range(2)]
        for a in algorithms:
            for i in range(3):
                api.all_reduce(bufs[i % 2], algorithm=a)
            dist.barrier()
            ts = []
            for i in range(iters):
                t = time.perf_counter()
                api.all_reduce(bufs[i % 2], algorithm=a)
                ts.append(time.perf_counter() - t)
            ours[a].append(statistics.median(ts))
    return {"ping_pong": vals[:n] if rank < 2 else [0.0] * n, "native": vals[n:],
            "ours": ours}


SYNC_SEGMENT_S = 5e-3  # the compute between two syncs: about a TP block region's
SEGMENT_ROWS, SEGMENT_D, SEGMENT_F = 1024, 128, 384  # a micro-batch's tokens, the grid's widths
# stable rounds the sync's excess is the median of: one round's wake-up ran anywhere
# from 0 to 2.8 ms on the quiet 2-core box, so medians of 5 rounds ranged 0.79-1.94 ms
# within one run, and calibrations minutes apart gave 1.35, 2.38 and 2.06 ms; medians of
# 30 rounds came out 1.38-1.40 ms in four runs (the idle time on 4 ranks: 0.34 and 0.45)
SYNC_ROUNDS = 25


def _segment(torch, passes: int):
    """A step's compute between two syncs: ``passes`` passes of an MLP block (two matmuls,
    an activation, a residual add and an RMS norm) over a 1024 x 128 activation, each
    allocating its outputs fresh as a step's activations are; returns the last output,
    the sync's payload (512 KiB). A bare matmul loop on one hot buffer, the old segment,
    measured a fifth of the wake-up a step's syncs pay (docs/train-prediction.md)."""
    x0 = torch.randn(SEGMENT_ROWS, SEGMENT_D)
    w1 = torch.randn(SEGMENT_D, SEGMENT_F) / SEGMENT_D ** 0.5
    w2 = torch.randn(SEGMENT_F, SEGMENT_D) / SEGMENT_F ** 0.5

    def seg():
        y = x0
        for _ in range(passes):
            y = y + torch.relu(y @ w1) @ w2
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)
        return y

    return seg


def segment_alone_s(passes: int = 1, iters: int = 30) -> float:
    """Seconds of ``passes`` passes of the segment (:func:`_segment`) in this process on
    one thread, alone: how many passes make :data:`SYNC_SEGMENT_S`, and the reference
    :func:`sync_costs` divides the ranks' concurrent segment by."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seg = _segment(torch, passes)
        seg()
        t0 = time.perf_counter()
        for _ in range(iters):
            seg()
        return (time.perf_counter() - t0) / iters
    finally:
        torch.set_num_threads(old)


def sync_worker(rank: int, world: int, iters: int, rule: Stability = Stability(),
                passes: int = 1) -> list[float] | str:
    """Wall and CPU seconds per iteration of (compute only, compute then an all-reduce
    of its output in the rank's pair, the all-reduce alone on one buffer): three walls,
    three CPU times, then the sync's wall and CPU beyond the other two (each round's own
    difference, so the median over rounds is the median excess, not a difference of
    medians). Ranks are paired (0, 1), (2, 3), ...: what a blocking sync costs beyond
    the compute around it, when the peer may not be running. Repeated until stable (the
    ranks agree); unstable: the :class:`BusyMachine` line."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    groups = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)]
    g, seg = groups[rank // 2], _segment(torch, passes)
    x = seg().clone()

    def timed(body: Callable[[], None], n: int) -> tuple[float, float]:
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(n):
            body()
        return time.perf_counter() - t0, time.process_time() - c0

    bodies = (seg, lambda: dist.all_reduce(seg(), group=g),
              lambda: dist.all_reduce(x, group=g))

    def one_round() -> list[float]:
        # the three loops interleaved in blocks of 10, so a drift of the load between
        # them does not masquerade as a cost of the sync
        wall, cpu = [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]
        n = 10 * max(1, iters // 10)
        for _ in range(n // 10):
            for i, b in enumerate(bodies):
                w, c = timed(b, 10)
                wall[i] += w / n
                cpu[i] += c / n
        return [*wall, *cpu, wall[1] - wall[0] - wall[2], cpu[1] - cpu[0] - cpu[2]]

    one_round()  # warm-up: the pairs' connections, the allocator
    try:
        # judged on the two loops the constants are differences of; the all-reduce
        # alone is short, and its scheduling jitter on shared cores says nothing about
        # them (its median over the stable rounds is still what is used)
        return until_stable(one_round, f"a blocking sync among {world} ranks", rule,
                            _agree_all, judged=lambda r: r[:2])
    except BusyMachine as e:
        return str(e)


def sync_costs(cores: int, iters: int = 30, rule: Stability = Stability(),
               spawn_fn: Callable | None = None,
               alone_fn: Callable[[int], float] = segment_alone_s) -> dict[str, float]:
    """The scheduler's constants (:mod:`paratrain.predict.sched`), each from a segment of
    compute (:func:`_segment`, as many passes as make :data:`SYNC_SEGMENT_S` alone)
    followed by an all-reduce of its output in pairs of ranks: ``wake_s``, the wall a
    blocking sync costs on free cores beyond the compute around it and the call's own
    time (``cores`` ranks, at least 2); ``sync_cpu_s``, the CPU it costs beyond the same
    call in a tight loop (the caches the compute left, the wake-up); ``busy_sync_s``,
    the wall it adds beyond the ranks' CPU work over the cores when ranks outnumber
    cores (2 x cores ranks, up to 16: the iteration's wall less every rank's CPU of it
    over the cores, the time no core computed; more cores than 8: the free-core
    figure); ``core_speed``, a
    core's compute speed while ``cores`` ranks compute at once over its speed alone (at
    most 1). ``spawn_fn`` and ``alone_fn`` (seconds of so many passes alone) are
    injectable for tests."""
    from paratrain.parallel.process_groups import spawn

    run = spawn_fn or spawn
    (one,) = until_stable(lambda: [alone_fn(1)], "one compute segment alone", rule)
    passes = max(1, round(SYNC_SEGMENT_S / one))
    (alone_seg,) = until_stable(lambda: [alone_fn(passes)], "one compute segment alone",
                                rule)

    # the excess is a difference of loops ten times longer: its median over
    # SYNC_ROUNDS rounds (the rule's own when its user set them), with the rule's room
    # for unstable rounds beside them
    k = rule.k if rule.rounds_set else max(rule.k, SYNC_ROUNDS)
    sync_rule = replace(rule, k=k, max_repeats=k + rule.max_repeats)

    def measured(world: int) -> list[float]:
        res = run(sync_worker, world, iters, sync_rule, passes, timeout_s=600)
        busy = next((r for r in res if isinstance(r, str)), None)
        if busy is not None:
            raise BusyMachine(busy)
        return [statistics.fmean(r[i] for r in res) for i in range(8)]

    comp, _, alone, *_, wake, sync_cpu = measured(max(2, cores - cores % 2))
    out = {"wake_s": max(0.0, wake), "sync_cpu_s": max(0.0, sync_cpu), "cores": cores,
           "segment_s": alone_seg, "core_speed": min(1.0, alone_seg / comp) if cores > 1
           else 1.0}
    if 2 * cores > 16:
        return {**out, "busy_sync_s": out["wake_s"] + alone}
    _, synced2, _, _, cpu_synced2, *_ = measured(2 * cores)
    # 2 x cores ranks, each spending cpu_synced2 per iteration, on cores cores: what the
    # wall holds beyond that work is the time no core computed
    return {**out, "busy_sync_s": max(0.0, synced2 - 2 * cpu_synced2)}


def sched_path(profile: Path) -> Path:
    """The scheduler's constants' file beside ``profile``."""
    return profile.expanduser().with_name(SCHED_NAME)


def save_sched(values: dict, profile: str | Path | None) -> Path:
    """The scheduler's constants (:func:`paratrain.bench.calibrate.sync_costs`) beside
    the profile, with the date they were measured."""
    path = sched_path(Path(profile or DEFAULT_PROFILE))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**values, "date": time.strftime("%Y-%m-%d %H:%M:%S")},
                               indent=1))
    return path


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
        algorithms: list[str], rule: Stability | None = None) -> tuple[dict, str]:
    """Measure (each measurement until stable under ``rule``, default
    :func:`default_rule`: :func:`until_stable`), write the profile and the scheduler's
    constants beside it, and return (profile, report text)."""
    rule = rule or default_rule()
    from paratrain.bench import measure
    from paratrain.comm.algorithms import build
    from paratrain.comm.api import SEGMENT_BYTES
    from paratrain.comm.cost import time_s
    from paratrain.parallel.process_groups import spawn

    if nproc < 2:
        raise ValueError(f"--nproc {nproc}: calibration needs at least 2 ranks")
    per_rank = spawn(calibrate_worker, nproc, sizes, iters, algorithms, rule, timeout_s=3600)
    busy = next((r["busy"] for r in per_rank if "busy" in r), None)
    if busy is not None:
        raise BusyMachine(busy)
    f = fit(sizes, per_rank, nproc)
    cores = os.cpu_count() or 1
    (memcpy,) = until_stable(lambda: [measure.memcpy_bw()], "memcpy bandwidth", rule)
    (f1,) = until_stable(lambda: [measure.matmul_flops(threads=1)], "one-thread matmul",
                         rule)
    (fall,) = until_stable(lambda: [measure.matmul_flops(threads=cores)], "matmul", rule)
    sched = sync_costs(cores, rule=rule)
    # The profile takes alpha and bw fitted to the native all-reduce: what a collective
    # step really costs here (both directions, the reduction, the shared memory bus),
    # which is what the systems model's ring formula multiplies. Ping-pong is printed.
    alpha, bw = f["alpha_ar"], f["bw_ar"]
    prof = profile(f"calibrated-{socket.gethostname()}", max(f1, fall), memcpy, alpha, bw,
                   cores)
    path = write_toml(prof, out)
    sched_path = save_sched(sched, out)
    lines = [
        f"wrote {path} and {sched_path}",
        f"a blocking sync after {sched['segment_s'] * 1e3:.1f} ms of compute: "
        f"{sched['wake_s'] * 1e6:.0f} us more than its own time and "
        f"{sched['sync_cpu_s'] * 1e6:.0f} us more CPU on free cores; with "
        f"{2 * cores} ranks on {cores} cores the cores sit idle "
        f"{sched['busy_sync_s'] * 1e6:.0f} us at each; a core computes at "
        f"{sched['core_speed']:.2f} of its speed alone while every core computes",
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
