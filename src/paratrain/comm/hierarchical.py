"""Hierarchical (2D ring) all-reduce: inside each node, then across nodes, then inside.

Ranks r = node * g + local, g = ranks per node, k = p / g nodes. The vector is cut into
g local chunks, each into k sub-chunks (segment c * k + s, in memory order). (1) A ring
reduce-scatter inside every node leaves rank (node, l) with local chunk l summed over its
node: g-1 steps of n/g. (2) The k ranks sharing local index l run a ring all-reduce
across nodes over the k sub-chunks of chunk l: 2(k-1) steps of n/(g k), the only traffic
on the slow network. (3) A ring all-gather inside every node: g-1 steps of n/g.
"""

from __future__ import annotations

from paratrain.comm.schedule import COPY, REDUCE, CollectiveSchedule, Transfer, chunk_sizes


def hierarchical_all_reduce(p: int, n: int, gpus_per_node: int) -> CollectiveSchedule:
    """See module docstring. ``gpus_per_node`` >= p means one node: a plain ring."""
    g = min(p, gpus_per_node)
    if p % g:
        raise ValueError(f"hierarchical needs p={p} to be a multiple of gpus_per_node={g}; "
                         "use ring")
    k = p // g

    def rank(node: int, local: int) -> int:
        return node * g + local

    def local_chunk(c: int) -> range:
        return range(c * k, (c + 1) * k)

    rounds: list[tuple[Transfer, ...]] = []
    for step in range(g - 1):  # intra-node reduce-scatter over local chunks
        rounds.append(tuple(
            Transfer(rank(nd, l), rank(nd, (l + 1) % g), s, REDUCE)
            for nd in range(k) for l in range(g) for s in local_chunk((l - step - 1) % g)))
    for phase, op in ((0, REDUCE), (1, COPY)):  # inter-node ring all-reduce per local chunk
        for step in range(k - 1):
            rounds.append(tuple(
                Transfer(rank(nd, l), rank((nd + 1) % k, l),
                         l * k + ((nd - step - 1) % k if phase == 0 else (nd - step) % k), op)
                for l in range(g) for nd in range(k)))
    for step in range(g - 1):  # intra-node all-gather
        rounds.append(tuple(
            Transfer(rank(nd, l), rank(nd, (l + 1) % g), s, COPY)
            for nd in range(k) for l in range(g) for s in local_chunk((l - step) % g)))
    return CollectiveSchedule("all_reduce", "hierarchical", p, n, chunk_sizes(n, p), tuple(rounds))
