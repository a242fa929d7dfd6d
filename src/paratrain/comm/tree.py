"""Tree schedules: binomial-tree broadcast and reduce, the naive tree all-reduce built from
them, and the pipelined binary-tree all-reduce.

Binomial tree over ranks relative to the root: in reduce round k, relative rank v with
v mod 2^(k+1) == 2^k sends to v - 2^k; broadcast runs the rounds backwards. ceil(log2 p)
rounds, each moving the whole vector: the tree wins on latency and loses on bandwidth.

Pipelined binary tree (heap numbering: children 2i+1, 2i+2): the vector is cut into S
segments; a node forwards segment s upward in round s + height(node), after both children
delivered it, and the root starts sending finished segments down while later ones still
climb. S + 2*depth - 1 rounds, each moving one segment (a node with two children sends two).
"""

from __future__ import annotations

from paratrain.comm.schedule import COPY, REDUCE, CollectiveSchedule, Transfer, chunk_sizes


def _levels(p: int) -> int:
    return max(0, (p - 1).bit_length())  # ceil(log2 p)


def _binomial_reduce_rounds(p: int, root: int, segs: range) -> list[tuple[Transfer, ...]]:
    rounds = []
    for k in range(_levels(p)):
        step = 1 << k
        rounds.append(tuple(
            Transfer((v + root) % p, (v - step + root) % p, s, REDUCE)
            for v in range(step, p, 2 * step) for s in segs))
    return rounds


def _binomial_bcast_rounds(p: int, root: int, segs: range) -> list[tuple[Transfer, ...]]:
    rounds = []
    for k in reversed(range(_levels(p))):
        step = 1 << k
        rounds.append(tuple(
            Transfer((v + root) % p, (v + step + root) % p, s, COPY)
            for v in range(0, p - step, 2 * step) for s in segs))
    return rounds


def binomial_broadcast(p: int, n: int, root: int = 0) -> CollectiveSchedule:
    """Whole vector down a binomial tree: ceil(log2 p) steps."""
    rounds = tuple(_binomial_bcast_rounds(p, root, range(1)))
    return CollectiveSchedule("broadcast", "tree", p, n, (n,), rounds, root=root)


def binomial_reduce(p: int, n: int, root: int = 0) -> CollectiveSchedule:
    """Whole vector up a binomial tree into ``root``: ceil(log2 p) steps."""
    rounds = tuple(_binomial_reduce_rounds(p, root, range(1)))
    return CollectiveSchedule("reduce", "tree", p, n, (n,), rounds, root=root)


def tree_all_reduce(p: int, n: int) -> CollectiveSchedule:
    """Naive tree: binomial reduce to rank 0, then binomial broadcast. 2 ceil(log2 p) steps,
    each moving the whole vector (the DESIGN figure: 64 GPUs -> 12 x payload / bw)."""
    rounds = _binomial_reduce_rounds(p, 0, range(1)) + _binomial_bcast_rounds(p, 0, range(1))
    return CollectiveSchedule("all_reduce", "tree", p, n, (n,), tuple(rounds))


def _heights(p: int) -> list[int]:
    h = [0] * p
    for i in reversed(range(p)):
        kids = [c for c in (2 * i + 1, 2 * i + 2) if c < p]
        h[i] = 1 + max(h[c] for c in kids) if kids else 0
    return h


def _depths(p: int) -> list[int]:
    d = [0] * p
    for i in range(1, p):
        d[i] = d[(i - 1) // 2] + 1
    return d


def pipelined_tree_all_reduce(p: int, n: int, segments: int) -> CollectiveSchedule:
    """Double binary tree all-reduce pipelined over ``segments`` pieces.

    Tree A is the heap tree over ranks 0..p-1, tree B the same tree over the mirrored
    ranks p-1-i, so the inner nodes of one are mostly leaves of the other (NCCL's double
    binary tree, Sanders, Speck & Traeff 2009). A carries the first half of the segments,
    B the rest, at the same time: each rank sends at most ~2x the vector and the latency
    is S/2 + 2 depth - 1 rounds.
    """
    sizes = chunk_sizes(n, segments)
    if p == 1:
        return CollectiveSchedule("all_reduce", "pipelined_tree", p, n, sizes, ())
    h, d = _heights(p), _depths(p)
    top = h[0]
    half = (segments + 1) // 2
    rounds: list[list[Transfer]] = [[] for _ in range(half + top + max(d) - 1)]
    trees = ((lambda i: i, range(half)), (lambda i: p - 1 - i, range(half, segments)))
    for rank_of, segs in trees:
        for t, s in enumerate(segs):
            for i in range(1, p):
                up, parent = rank_of(i), rank_of((i - 1) // 2)
                # up: after both children delivered segment s (their heights are < h[i])
                rounds[t + h[i]].append(Transfer(up, parent, s, REDUCE))
                # down: the parent holds the final segment s from round t + top + d[parent]
                rounds[t + top + d[i] - 1].append(Transfer(parent, up, s, COPY))
    return CollectiveSchedule("all_reduce", "pipelined_tree", p, n, sizes,
                              tuple(tuple(r) for r in rounds))
