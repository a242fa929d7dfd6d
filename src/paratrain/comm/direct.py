"""Direct ("naive") schedules through one root, and the pairwise all-to-all.

The root talks to one rank per round (it has one port): the naive all-reduce gathers the
whole vector from ranks 1..p-1 in turn, adding, then sends the sum back in turn: 2(p-1)
steps, each moving the whole vector, so the root's link carries 2(p-1) vectors. These
are the baselines ``paratrain.cost.collectives`` calls ``naive``.
"""

from __future__ import annotations

from paratrain.comm.schedule import COPY, REDUCE, CollectiveSchedule, Transfer, chunk_sizes


def _gather(p: int, root: int, segs, op: str) -> list[tuple[Transfer, ...]]:
    # one sender per round, in rank order after the root
    return [tuple(Transfer((root + k) % p, root, s, op) for s in segs) for k in range(1, p)]


def _scatter(p: int, root: int, segs_for) -> list[tuple[Transfer, ...]]:
    return [tuple(Transfer(root, (root + k) % p, s, COPY) for s in segs_for((root + k) % p))
            for k in range(1, p)]


def naive_all_reduce(p: int, n: int) -> CollectiveSchedule:
    """Reduce into rank 0 one sender at a time, then send the sum back one at a time."""
    rounds = _gather(p, 0, (0,), REDUCE) + _scatter(p, 0, lambda r: (0,))
    return CollectiveSchedule("all_reduce", "naive", p, n, (n,), tuple(rounds))


def naive_reduce(p: int, n: int, root: int = 0) -> CollectiveSchedule:
    """Each rank sends the whole vector to ``root`` in turn: p-1 steps."""
    return CollectiveSchedule("reduce", "naive", p, n, (n,), tuple(_gather(p, root, (0,), REDUCE)),
                    root=root)


def naive_broadcast(p: int, n: int, root: int = 0) -> CollectiveSchedule:
    """``root`` sends the whole vector to each rank in turn: p-1 steps, (p-1) x n out."""
    return CollectiveSchedule("broadcast", "naive", p, n, (n,),
                    tuple(_scatter(p, root, lambda r: (0,))), root=root)


def naive_reduce_scatter(p: int, n: int) -> CollectiveSchedule:
    """Reduce the whole vector into rank 0 in turn, then rank 0 sends chunk r to rank r."""
    rounds = _gather(p, 0, range(p), REDUCE) + _scatter(p, 0, lambda r: (r,))
    return CollectiveSchedule("reduce_scatter", "naive", p, n, chunk_sizes(n, p), tuple(rounds))


def naive_all_gather(p: int, n: int) -> CollectiveSchedule:
    """Rank 0 collects chunk r from rank r in turn, then sends the whole vector to each."""
    rounds = ([(Transfer(k, 0, k, COPY),) for k in range(1, p)]
              + _scatter(p, 0, lambda r: range(p)))
    return CollectiveSchedule("all_gather", "naive", p, n, chunk_sizes(n, p), tuple(rounds))


def _block_sizes(p: int, n: int) -> tuple[int, ...]:
    # block (i, j) = what rank i sends rank j = chunk j of rank i's input
    c = chunk_sizes(n, p)
    return tuple(c[j] for _ in range(p) for j in range(p))


def pairwise_all_to_all(p: int, n: int, algorithm: str = "pairwise") -> CollectiveSchedule:
    """Round k = 1..p-1: rank r sends block (r, r+k) to r+k and receives (r-k, r) from
    r-k. Each rank sends and receives once per round: p-1 steps, (p-1)/p of its input.
    Rank r's input is n elements split into p chunks; its output is p blocks of chunk r's
    size (an uneven all-to-all when p does not divide n). The systems model calls these
    direct pairwise sends ``naive``."""
    rounds = tuple(tuple(Transfer(r, (r + k) % p, r * p + (r + k) % p, COPY) for r in range(p))
                   for k in range(1, p))
    return CollectiveSchedule("all_to_all", algorithm, p, n, _block_sizes(p, n), rounds,
                              layout="blocks")


def ring_shift(p: int, n: int) -> CollectiveSchedule:
    """One round: rank r sends its block of n elements to r+1 and receives r-1's (mod p).
    The step of ring attention's K/V and dK/dV pass (:mod:`paratrain.parallel.context`):
    each rank sends n elements; it is not a collective of the systems model's catalogue
    (the cp price counts these bytes itself: :func:`paratrain.cost.layout.cp_wire_bytes`)."""
    rounds = (tuple(Transfer(r, (r + 1) % p, r, COPY) for r in range(p)),) if p > 1 else ()
    return CollectiveSchedule("shift", "ring", p, n, (n,) * p, rounds, layout="pair")
