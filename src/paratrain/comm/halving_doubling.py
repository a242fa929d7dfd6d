"""Recursive halving-doubling all-reduce (Rabenseifner 2004; Thakur, Rabenseifner & Gropp
2005), for any p.

With p' the largest power of two <= p and r = p - p': first the 2r lowest ranks pair up and
each even one hands its whole vector to its odd neighbour (one extra step), leaving p'
survivors numbered v = 0..p'-1. Reduce-scatter by recursive halving: at distance
d = p'/2, p'/4, ..., 1 partners v and v^d swap halves of their current range, each keeping
(and adding into) the half that contains chunk v. All-gather by recursive doubling undoes
it. Finally the odd ranks hand the result back. 2 log2 p' steps (+2 when p is not a power
of two); survivors send 2(p'-1)/p' of the vector, the odd helpers one vector more.
"""

from __future__ import annotations

from functools import lru_cache

from paratrain.comm.schedule import COPY, REDUCE, CollectiveSchedule, Transfer, chunk_sizes


def halving_doubling_all_reduce(p: int, n: int) -> CollectiveSchedule:
    """See module docstring. Segments are p' chunks of the vector."""
    pp = 1 << (p.bit_length() - 1)  # largest power of two <= p
    return CollectiveSchedule("all_reduce", "halving_doubling", p, n, chunk_sizes(n, pp),
                              _rounds(p))


@lru_cache(maxsize=32)
def _rounds(p: int) -> tuple[tuple[Transfer, ...], ...]:
    # rounds depend on p only; cached so many vector sizes share them
    pp = 1 << (p.bit_length() - 1)
    extra = p - pp
    everything = range(pp)

    def real(v: int) -> int:
        return 2 * v + 1 if v < extra else v + extra

    rounds: list[tuple[Transfer, ...]] = []
    if extra:
        rounds.append(tuple(Transfer(2 * i, 2 * i + 1, s, REDUCE)
                            for i in range(extra) for s in everything))
    # recursive halving: lo[v], hi[v] is the chunk range survivor v still reduces
    lo, hi = [0] * pp, [pp] * pp
    d = pp // 2
    while d:
        rnd = []
        for v in range(pp):
            mid = (lo[v] + hi[v]) // 2
            give = range(mid, hi[v]) if v & d == 0 else range(lo[v], mid)
            rnd.extend(Transfer(real(v), real(v ^ d), s, REDUCE) for s in give)
        for v in range(pp):
            mid = (lo[v] + hi[v]) // 2
            lo[v], hi[v] = (lo[v], mid) if v & d == 0 else (mid, hi[v])
        rounds.append(tuple(rnd))
        d //= 2
    # recursive doubling: send the owned range to the partner, ranges merge
    d = 1
    while d < pp:
        rounds.append(tuple(Transfer(real(v), real(v ^ d), s, COPY)
                            for v in range(pp) for s in range(lo[v], hi[v])))
        for v in range(pp):
            w = v ^ d
            lo[v], hi[v] = min(lo[v], lo[w]), max(hi[v], hi[w])
        d *= 2
    if extra:
        rounds.append(tuple(Transfer(2 * i + 1, 2 * i, s, COPY)
                            for i in range(extra) for s in everything))
    return tuple(rounds)


def halving_reduce_scatter(p: int, n: int) -> CollectiveSchedule:
    """Recursive halving alone (p a power of two): rank r ends with chunk r of the sum in
    log2 p steps, sending (p-1)/p of the vector."""
    k = p.bit_length() - 1
    return CollectiveSchedule("reduce_scatter", "halving_doubling", p, n, chunk_sizes(n, p),
                    _rounds(p)[:k])


def doubling_all_gather(p: int, n: int) -> CollectiveSchedule:
    """Recursive doubling alone (p a power of two): log2 p steps."""
    k = p.bit_length() - 1
    return CollectiveSchedule("all_gather", "halving_doubling", p, n, chunk_sizes(n, p),
                    _rounds(p)[k:])


def _relative(p: int, root: int, rounds) -> tuple[tuple[Transfer, ...], ...]:
    """Rounds written for root 0, renumbered so that ``root`` plays rank 0."""
    return tuple(tuple(Transfer((t.src + root) % p, (t.dst + root) % p, t.seg, t.op)
                       for t in rnd) for rnd in rounds)


def scatter_allgather_broadcast(p: int, n: int, root: int = 0) -> CollectiveSchedule:
    """Broadcast for long vectors (van de Geijn; p a power of two): the root scatters the
    chunks by recursive halving (log2 p steps), then a recursive-doubling all-gather
    (log2 p steps). The root sends 2(p-1)/p of the vector instead of log2 p vectors."""
    k = p.bit_length() - 1
    scatter = []
    d = p // 2
    while d:
        # relative rank v holding chunks [v, v + 2d) hands [v + d, v + 2d) to v + d
        scatter.append(tuple(Transfer(v, v + d, s, COPY)
                             for v in range(0, p, 2 * d) for s in range(v + d, v + 2 * d)))
        d //= 2
    rounds = _relative(p, root, tuple(scatter) + _rounds(p)[k:])
    return CollectiveSchedule("broadcast", "halving_doubling", p, n, chunk_sizes(n, p), rounds,
                              root=root)


def reduce_scatter_gather_reduce(p: int, n: int, root: int = 0) -> CollectiveSchedule:
    """Reduce for long vectors (Rabenseifner; p a power of two): recursive-halving
    reduce-scatter (log2 p steps), then a binomial gather of the reduced chunks into the
    root (log2 p steps). The root receives 2(p-1)/p of the vector."""
    k = p.bit_length() - 1
    gather = []
    d = 1
    while d < p:
        # relative rank v owning chunks [v, v + d) hands them to v - d
        gather.append(tuple(Transfer(v, v - d, s, COPY)
                            for v in range(d, p, 2 * d) for s in range(v, v + d)))
        d *= 2
    rounds = _relative(p, root, _rounds(p)[:k] + tuple(gather))
    return CollectiveSchedule("reduce", "halving_doubling", p, n, chunk_sizes(n, p), rounds,
                              root=root)
