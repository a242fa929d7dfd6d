"""Ring schedules: reduce-scatter, all-gather, all-reduce (= the two), and the pipelined
chain used by broadcast and reduce.

Ring (Patarasuk & Yuan 2009): ranks form a cycle r -> r+1. In reduce-scatter step k rank r
sends chunk (r-k-1) mod p, which it has just accumulated, and adds the chunk arriving from
r-1. After p-1 steps rank r owns the full sum of chunk r. All-gather circulates the owned
chunks for another p-1 steps. Each rank sends 2(p-1) chunks = 2(p-1)/p of the vector, the
proven minimum for all-reduce, in 2(p-1) steps.
"""

from __future__ import annotations

from functools import lru_cache

from paratrain.comm.schedule import COPY, REDUCE, CollectiveSchedule, Transfer, chunk_sizes


@lru_cache(maxsize=32)
def _rs_rounds(p: int) -> tuple[tuple[Transfer, ...], ...]:
    # rounds depend on p only; cached so many vector sizes share them
    return tuple(tuple(Transfer(r, (r + 1) % p, (r - k - 1) % p, REDUCE) for r in range(p))
            for k in range(p - 1))


@lru_cache(maxsize=32)
def _ag_rounds(p: int) -> tuple[tuple[Transfer, ...], ...]:
    return tuple(tuple(Transfer(r, (r + 1) % p, (r - k) % p, COPY) for r in range(p))
            for k in range(p - 1))


def ring_reduce_scatter(p: int, n: int) -> CollectiveSchedule:
    """Rank r ends with chunk r of the sum: p-1 steps, (p-1)/p of the vector sent."""
    return CollectiveSchedule("reduce_scatter", "ring", p, n, chunk_sizes(n, p), _rs_rounds(p))


def ring_all_gather(p: int, n: int) -> CollectiveSchedule:
    """Rank r starts with chunk r; all end with every chunk: p-1 steps."""
    return CollectiveSchedule("all_gather", "ring", p, n, chunk_sizes(n, p), _ag_rounds(p))


def ring_all_reduce(p: int, n: int) -> CollectiveSchedule:
    """Reduce-scatter then all-gather: 2(p-1) steps, 2(p-1)/p of the vector sent."""
    return CollectiveSchedule("all_reduce", "ring", p, n, chunk_sizes(n, p),
                    _rs_rounds(p) + _ag_rounds(p))


def sparse_all_gather(p: int, k: int) -> CollectiveSchedule:
    """Top-k exchange: every rank's k (value, index) pairs reach every rank by a ring
    all-gather. Nothing can be added on the way (the indices differ), so each rank sends
    (p-1) x its payload, growing with p. Segment r is rank r's payload of k entries.
    """
    return CollectiveSchedule("sparse_all_gather", "ring", p, k, (k,) * p, _ag_rounds(p))


def chain_broadcast(p: int, n: int, segments: int, root: int = 0) -> CollectiveSchedule:
    """Pipelined chain root -> root+1 -> ... in ``segments`` pieces: rank at chain
    position i forwards segment t-i in round t. S + p - 2 steps, each rank sends ~1x."""
    sizes = chunk_sizes(n, segments)
    rounds = []
    for t in range(segments + p - 2 if p > 1 else 0):
        rounds.append(tuple(
            Transfer((root + i) % p, (root + i + 1) % p, t - i, COPY)
            for i in range(p - 1) if 0 <= t - i < segments))
    return CollectiveSchedule("broadcast", "ring", p, n, sizes, tuple(rounds), root=root)


def chain_reduce(p: int, n: int, segments: int, root: int = 0) -> CollectiveSchedule:
    """Pipelined chain toward the root: position i (counted from the root) adds what
    position i+1 sent and forwards segment t-(p-1-i) in round t. S + p - 2 steps."""
    sizes = chunk_sizes(n, segments)
    rounds = []
    for t in range(segments + p - 2 if p > 1 else 0):
        rounds.append(tuple(
            Transfer((root + i) % p, (root + i - 1) % p, t - (p - 1 - i), REDUCE)
            for i in range(p - 1, 0, -1) if 0 <= t - (p - 1 - i) < segments))
    return CollectiveSchedule("reduce", "ring", p, n, sizes, tuple(rounds), root=root)
