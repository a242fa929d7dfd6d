"""The CP ring's CPU for the CPU fit (:mod:`paratrain.run.cpu_fit`): the bare
ring-attention core on 2 ranks against the plain core in the same processes, at two
batches, taken apart into a cost per hop and per byte (docs/train-prediction.md, "The CPU
fit"). Importing this module does not import torch."""

from __future__ import annotations

import statistics
import time

from paratrain.config import ModelConfig, TrainConfig
from paratrain.cost.cp_bytes import ring_hops
from paratrain.plan import ParallelPlan

RING_CALLS = 4  # ring-attention calls per timed block (each a forward and a backward)
HOPS = ring_hops(ParallelPlan(cp=2))  # of one call: a cp 2 rank's forward and backward


def _ring_worker(rank: int, world: int, shapes: list[tuple[int, ...]], dtype: str
                 ) -> list[tuple[float, float, float, float]]:
    """Per shape (B, H, K, T, E): (CPU s of a ring-attention call, of it the calling
    thread's, CPU s of the plain causal core on the whole sequence, bytes the call sent)
    on this rank: blocks of :data:`RING_CALLS` calls of each, taken in turn, the median
    of the fit's :data:`paratrain.run.coll_fit.COLL_CPU_BLOCKS` blocks of each kept.
    q (B, H, T/world, E), k and v (B, K, T/world, E), forward and backward, in the run's
    working ``dtype``; the plain core on (B, H, T, E), in the same process, so that both
    share the cores alike."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from paratrain.parallel.context import CPComm, RingAttention
    from paratrain.parallel.precision import WORKING
    from paratrain.run.coll_fit import COLL_CPU_BLOCKS as BLOCKS  # the fit's own count

    def rand(*size):
        return torch.randn(*size, dtype=WORKING[dtype], requires_grad=True)

    comm = CPComm(dist.group.WORLD, world, rank, (rank + 1) % world, (rank - 1) % world)
    out = []
    for B, H, K, T, E in shapes:
        q, k, v = rand(B, H, T // world, E), rand(B, K, T // world, E), rand(B, K, T // world, E)
        qf, kf, vf = (rand(B, H, T, E) for _ in range(3))

        def ring(q=q, k=k, v=v):
            RingAttention.apply(q, k, v, comm).sum().backward()

        def plain(qf=qf, kf=kf, vf=vf):
            F.scaled_dot_product_attention(qf, kf, vf, is_causal=True).sum().backward()

        ring(), plain()  # untimed: first use
        sent0, blocks = comm.wire_bytes, {ring: [], plain: []}
        for _ in range(BLOCKS):
            for fn in blocks:
                dist.barrier()
                c0, t0 = time.process_time(), time.thread_time()
                for _ in range(RING_CALLS):
                    fn()
                blocks[fn].append(((time.process_time() - c0) / RING_CALLS,
                                   (time.thread_time() - t0) / RING_CALLS))
        out.append((statistics.median(b[0] for b in blocks[ring]),
                    statistics.median(b[1] for b in blocks[ring]),
                    statistics.median(b[0] for b in blocks[plain]),
                    (comm.wire_bytes - sent0) / (BLOCKS * RING_CALLS)))
    return out


def fit_batches(global_batch: int) -> tuple[int, ...]:
    """The two batches (sequences of one micro-batch) the ring core is timed at: the
    fit's batch and half of it (one, when the batch is 1)."""
    return (global_batch, global_batch // 2) if global_batch > 1 else (global_batch,)


def ring_core_times(mcfg: ModelConfig, tcfg: TrainConfig) -> list[float]:
    """:func:`_ring_worker`'s four figures at each of :func:`fit_batches`, in one list,
    the mean of 2 ranks: the bare core of a cp 2 rank (:class:`paratrain.parallel.
    context.RingAttention`)."""
    from paratrain.parallel.process_groups import spawn

    shapes = [(b, mcfg.n_heads, mcfg.kv_heads, mcfg.context, mcfg.head_dim)
              for b in fit_batches(tcfg.global_batch)]
    res = spawn(_ring_worker, 2, shapes, tcfg.dtype)
    return [sum(r[s][i] for r in res) / len(res) for s in range(len(shapes)) for i in range(4)]


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(per hop, per byte) >= 0 through (bytes, CPU s per call) of :data:`HOPS` hops each:
    the line through two points, or through the origin and their sum when the line's
    intercept or slope would be negative (or there is one point)."""
    (b1, x1), (b0, x0) = points[0], points[-1]
    if b1 != b0:
        per_byte = (x1 - x0) / (b1 - b0)
        per_hop = (x0 - b0 * per_byte) / HOPS
        if per_byte >= 0 and per_hop >= 0:
            return per_hop, per_byte
        if per_byte < 0:
            return max(0.0, (x0 + x1) / 2 / HOPS), 0.0
    total = sum(b for b, _ in points)
    return 0.0, max(0.0, sum(x for _, x in points) / total) if total else 0.0


def ring_costs(times: list[float]) -> tuple[float, float, float, float]:
    """(CPU s per hop and per byte on the ring rank's own thread, per hop and per byte on
    gloo's progress thread) of the CP ring, its core's work beyond its FLOPs included,
    from :func:`ring_core_times`' figures: what each cp 2 ring call (its CPU, of it the
    calling thread's, sending its bytes) took beyond half the plain core's call on the
    whole sequence (the FLOPs a cp 2 rank's tokens cost, which the prediction prices at
    the fitted rate), as a line in the bytes over :data:`HOPS` hops a call. The rank's
    thread allocates and copies the travelling blocks and accumulators, runs 2cp + 1
    fused kernels on sub-blocks of T/(2cp) tokens and posts and waits for the hops (in
    line with its compute: on the critical path); gloo's thread moves the bytes (beside
    it). On the 2-core box half the batch cost more than half (the kernels' and the hops'
    fixed costs), so one figure per byte priced a dp2 x cp2 rank's 8 sequences under."""
    calls = [times[i:i + 4] for i in range(0, len(times), 4)]
    own = [(sent, max(0.0, thread - plain / 2)) for ring, thread, plain, sent in calls]
    gloo = [(sent, max(0.0, ring - thread)) for ring, thread, plain, sent in calls]
    return (*_line(own), *_line(gloo))
