"""The CP ring's CPU per byte for the CPU fit (:mod:`paratrain.run.cpu_fit`): the bare
ring-attention core on 2 ranks against the plain core in the same processes
(docs/train-prediction.md, "The CPU fit"). Importing this module does not import torch."""

from __future__ import annotations

import statistics
import time

from paratrain.config import ModelConfig, TrainConfig

BLOCKS = 7  # timed blocks of each; their median is kept
RING_CALLS = 4  # ring-attention calls per timed block (each a forward and a backward)


def _ring_worker(rank: int, world: int, shape: tuple[int, ...], dtype: str
                 ) -> tuple[float, float, float, float]:
    """(CPU s of a ring-attention call, of it the calling thread's, CPU s of the plain
    causal core on the whole sequence, bytes the call sent) on this rank: blocks of
    :data:`RING_CALLS` calls of each, taken in turn, the median block of each kept.
    q (B, H, T/world, E), k and v (B, K, T/world, E), forward and backward, in the run's
    working ``dtype``; the plain core on (B, H, T, E), in the same process, so that both
    share the cores alike."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from paratrain.parallel.context import CPComm, RingAttention
    from paratrain.parallel.precision import WORKING

    B, H, K, T, E = shape
    comm = CPComm(dist.group.WORLD, world, rank, (rank + 1) % world, (rank - 1) % world)

    def rand(*size):
        return torch.randn(*size, dtype=WORKING[dtype], requires_grad=True)

    q, k, v = rand(B, H, T // world, E), rand(B, K, T // world, E), rand(B, K, T // world, E)
    qf, kf, vf = (rand(B, H, T, E) for _ in range(3))

    def ring():
        RingAttention.apply(q, k, v, comm).sum().backward()

    def plain():
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
    sent = (comm.wire_bytes - sent0) / (BLOCKS * RING_CALLS)
    return (statistics.median(b[0] for b in blocks[ring]),
            statistics.median(b[1] for b in blocks[ring]),
            statistics.median(b[0] for b in blocks[plain]), sent)


def ring_core_times(mcfg: ModelConfig, tcfg: TrainConfig) -> tuple[float, ...]:
    """:func:`_ring_worker`'s four figures, the mean of 2 ranks: the bare core of a cp 2
    rank (:class:`paratrain.parallel.context.RingAttention`), the fit's batch as one
    micro-batch."""
    from paratrain.parallel.process_groups import spawn

    shape = (tcfg.global_batch, mcfg.n_heads, mcfg.kv_heads, mcfg.context, mcfg.head_dim)
    res = spawn(_ring_worker, 2, shape, tcfg.dtype)
    return tuple(sum(r[i] for r in res) / len(res) for i in range(4))


def ring_byte_costs(ring_s: float, ring_thread_s: float, plain_s: float, sent: float
                    ) -> tuple[float, float]:
    """(CPU s per byte on the ring rank's own thread, CPU s per byte on gloo's progress
    thread) of the CP ring, its core's work beyond the FLOPs included: what a cp 2 ring
    call (``ring_s``, ``ring_thread_s`` of it on the calling thread, sending ``sent``
    bytes) took beyond half the plain core's call on the whole sequence (``plain_s``:
    the FLOPs a cp 2 rank's tokens cost, which the prediction prices at the fitted
    rate), over its bytes. The rank's thread allocates and copies the travelling blocks
    and accumulators, runs 2cp + 1 fused kernels on sub-blocks of T/(2cp) tokens and
    posts and waits for the hops (in line with its compute: on the critical path); gloo's
    thread moves the bytes (beside it). Priced as point-to-point sends, the hops were
    half of what a cp2 ring rank spent beyond a dp2 rank of the same tokens on the 2-core
    box (docs/train-prediction.md, "The CPU fit")."""
    if not sent:
        return 0.0, 0.0
    own = max(0.0, ring_thread_s - plain_s / 2) / sent
    return own, max(0.0, ring_s - ring_thread_s) / sent
