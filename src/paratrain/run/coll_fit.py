"""What a gloo collective costs a training step on this machine, for the CPU fit
(:mod:`paratrain.run.cpu_fit`): blocks of all-reduces on cold buffers, their CPU and
wall per call, taken apart into per call, per ring step and per byte
(docs/train-prediction.md, "The CPU fit"). Importing this module does not import torch."""

from __future__ import annotations

import statistics
import time

COLL_CPU_BUFFERS = 32  # distinct vectors per size, taken in turn: 32 MiB at 1 MiB, more
# than the caches hold, so every call reads memory the others have evicted
COLL_CPU_BLOCKS = 21  # timed blocks per size (their mean kept; the ring fit's median)


def _coll_cost_worker(rank: int, world: int, sizes: list[int]) -> list[tuple[float, float]]:
    """(CPU s, wall s) per all-reduce call of this rank at each size: the mean over
    :data:`COLL_CPU_BLOCKS` blocks of the block's mean, each call on the next of
    :data:`COLL_CPU_BUFFERS` vectors. A training step sends activations and gradients that
    its compute has just pushed out of the caches, never the same hot buffer again: one
    buffer reduced over and over measured 0.71-1.07 ns per byte, 32 in turn 1.15-1.34
    (1 MiB, two runs each on the quiet 2-core box). A step pays every call, its
    scheduler hiccups included, so each block keeps the mean of its calls (a 4 KiB
    all-reduce's median call took 0.70 ms on one box, the mean 1.73 ms), and for the same
    reason the fit keeps the blocks' mean: they swing with where the scheduler puts the
    ranks and their progress threads (a 2-rank 4 KiB call's blocks ranged 0.3-1.3 ms of
    CPU within one process pair). Over six fresh pairs on the
    quiet 2-core box (2026-12-05) the median of 7 blocks spread by 84% (4 KiB) and 34% (1
    MiB) of CPU, 86% and 20% of wall; the mean of 21 by 37%, 23%, 37% and 22%."""
    import torch
    import torch.distributed as dist

    out = []
    for nbytes in sizes:
        iters = 96 if nbytes < 1 << 16 else 32
        xs = [torch.zeros(nbytes // 4) for _ in range(COLL_CPU_BUFFERS)]
        for x in xs:  # untimed: every buffer's pages touched once
            dist.all_reduce(x)
        blocks = []
        for _ in range(COLL_CPU_BLOCKS):
            dist.barrier()
            c0, w0 = time.process_time(), time.perf_counter()
            for i in range(iters):
                dist.all_reduce(xs[i % COLL_CPU_BUFFERS])
            blocks.append(((time.process_time() - c0) / iters,
                           (time.perf_counter() - w0) / iters))
        out.append((statistics.mean(b[0] for b in blocks),
                    statistics.mean(b[1] for b in blocks)))
    return out


COLL_SMALL, COLL_LARGE = 4096, 1 << 20  # the 4-rank size; the call the fit is judged on
# the 2-rank sizes, a line through all four: the CPU and wall per byte as a difference of
# two sizes (4 KiB, 1 MiB) spread by 66% and 65% over six fresh pairs on the quiet 2-core
# box, the line through these by 16% and 19% (2026-12-05); below ~1 MiB the fixed costs
# swamp the bytes (256 KiB often cost as much as 1 MiB), so 4 MiB carries the slope
COLL_SIZES = (COLL_SMALL, 1 << 18, COLL_LARGE, 1 << 22)


def collective_costs() -> tuple[float, float, float, float, float]:
    """What a gloo all-reduce costs a training step on this machine: (CPU s per call, CPU
    s per ring step, CPU s per byte sent, wall s per ring step, wall bytes per s), from
    blocks of calls (:func:`_coll_cost_worker`) on 2 ranks at :data:`COLL_SIZES` and on 4
    ranks at 4 KiB. CPU per call = per call + ring steps x per step + bytes sent x per
    byte (2 ranks: 2 steps, 4 ranks: 6): the per-call part (handing the call to gloo's
    worker thread and back) does not grow with the group, the per-step part does, so
    the two group sizes tell them apart. Wall, on 2 ranks (free cores): the ring's
    latency per step and its bandwidth, as the critical path prices a call; with ranks
    beyond the cores the oversubscribed sync (:mod:`paratrain.predict.sched`) prices the
    wait instead."""
    from paratrain.parallel.process_groups import spawn

    def mean_over_ranks(p: int, sizes) -> list[tuple[float, float]]:
        res = spawn(_coll_cost_worker, p, list(sizes))
        return [tuple(sum(r[i][j] for r in res) / p for j in range(2)) for i in range(len(sizes))]

    two = mean_over_ranks(2, COLL_SIZES)
    ((c4, _),) = mean_over_ranks(4, [COLL_SMALL])
    return solve_collective_costs([(n, c) for n, (c, _) in zip(COLL_SIZES, two, strict=True)],
                                  c4, [(n, w) for n, (_, w) in zip(COLL_SIZES, two, strict=True)])


def scalar_cost() -> float:
    """CPU s of one of the step's scalar all-reduces (:data:`paratrain.predict.calls.
    SCALAR_BYTES`) on 4
    ranks: a block's mean call, the blocks' mean (:func:`_coll_cost_worker`), the mean of
    the ranks. gloo's ring cuts a buffer into p pieces and an 8-byte one leaves most of
    them empty, so it costs a fraction of what the ring's steps price a 4 KiB call at: on
    2, 4 and 8 ranks of the 2-core box 0.23, 0.46 and 0.56 ms of CPU, against 1.0, 1.9
    and 3.9 ms at 4 KiB (priced by steps, the two of an 8-rank step came to 8.8 ms of a
    rank's 53). 4 ranks sits between the world sizes a step has on such a box."""
    from paratrain.parallel.process_groups import spawn
    from paratrain.predict.calls import SCALAR_BYTES

    res = spawn(_coll_cost_worker, 4, [SCALAR_BYTES])
    return sum(r[0][0] for r in res) / len(res)


def large_call_cpu(costs: tuple[float, ...]) -> float:
    """The CPU of a 2-rank all-reduce of :data:`COLL_LARGE` bytes as ``costs`` (per call,
    per ring step, per byte sent: :func:`collective_costs`) price it: what the fit's
    repeated rounds are judged stable on. It is most of what a step's large calls cost;
    the per-byte figure alone, then a difference of two sizes' calls, varied by 41-71%
    over three rounds on the quiet 2-core box and refused two check-model runs in five
    (now a line through :data:`COLL_SIZES`, it still moves more than this call)."""
    from paratrain.cost import collectives as coll

    call, step, byte = costs[:3]
    return (call + coll.steps("all_reduce", "ring", 2) * step
            + coll.wire_bytes("all_reduce", "ring", 2, COLL_LARGE) * byte)


def solve_collective_costs(cpu2: list[tuple[int, float]], c4_small: float,
                           wall2: list[tuple[int, float]]
                           ) -> tuple[float, float, float, float, float]:
    """(CPU per call, per ring step, per byte sent; wall per ring step, bytes per s) from
    the per-call CPU and wall of 2 ranks at several sizes ((bytes, seconds) each: a line
    in the bytes sent) and the CPU of 4 ranks at :data:`COLL_SMALL` bytes
    (:func:`collective_costs`). Each is clamped at 0, so that a 2-rank call keeps the
    line's CPU: 4 ranks costing no more than 2 put all of it per call, 4 ranks costing
    more than the steps can explain put all of it per step."""
    from paratrain.cost import collectives as coll

    def wire(p: int, n: int) -> float:
        return coll.wire_bytes("all_reduce", "ring", p, n)

    def steps(p: int) -> int:
        return coll.steps("all_reduce", "ring", p)

    per_byte, at0 = statistics.linear_regression([wire(2, n) for n, _ in cpu2],
                                                 [c for _, c in cpu2])
    per_byte = max(0.0, per_byte)
    if per_byte == 0.0:
        at0 = statistics.mean(c for _, c in cpu2)
    small = [max(0.0, at0), c4_small - wire(4, COLL_SMALL) * per_byte]
    per_step = max(0.0, (small[1] - small[0]) / (steps(4) - steps(2)))
    per_call = max(0.0, small[0] - steps(2) * per_step)
    if per_call == 0.0:
        per_step = max(0.0, small[0] / steps(2))
    beta, w0 = statistics.linear_regression([wire(2, n) for n, _ in wall2],
                                            [w for _, w in wall2])
    beta = max(1e-12, beta)
    alpha = max(0.0, w0 / steps(2))
    return per_call, per_step, per_byte, alpha, 1.0 / beta
