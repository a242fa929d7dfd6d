"""Which algorithms exist for which collective, and one cached entry point to build them."""

from __future__ import annotations

from functools import lru_cache

from paratrain.comm import direct, halving_doubling, hierarchical, ring, tree
from paratrain.comm.schedule import CollectiveSchedule

#: op -> algorithms, the first being the default.
ALGORITHMS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("ring", "naive", "tree", "pipelined_tree", "halving_doubling",
                   "hierarchical"),
    "reduce_scatter": ("ring", "naive", "halving_doubling"),
    "all_gather": ("ring", "naive", "halving_doubling"),
    "broadcast": ("tree", "ring", "naive", "halving_doubling"),
    "reduce": ("tree", "ring", "naive", "halving_doubling"),
    "all_to_all": ("pairwise", "naive"),  # naive: the same pairwise exchange
    "sparse_all_gather": ("ring",),
}

#: algorithms that cut the vector into ``segments`` pipelined pieces
SEGMENTED = {("all_reduce", "pipelined_tree"), ("broadcast", "ring"), ("reduce", "ring")}

DEFAULT_SEGMENTS = 8


def default_segments(n: int) -> int:
    """Segments for pipelined schedules when none are given: 8, fewer for tiny vectors."""
    return max(1, min(n, DEFAULT_SEGMENTS))


def build(op: str, algorithm: str | None, p: int, n: int, *, root: int = 0,
          segments: int | None = None, gpus_per_node: int = 8) -> CollectiveSchedule:
    """The schedule of ``op`` by ``algorithm`` among ``p`` ranks over ``n`` elements.

    ``root`` is used by broadcast and reduce; ``segments`` by pipelined algorithms (see
    :data:`SEGMENTED`); ``gpus_per_node`` by hierarchical (ranks per node; the default
    matches paratrain.cost.collectives). Schedules are cached: cheap to call.
    """
    if op not in ALGORITHMS:
        raise ValueError(f"op={op!r} is unknown; use one of {tuple(ALGORITHMS)}")
    algorithm = algorithm or ALGORITHMS[op][0]
    if algorithm not in ALGORITHMS[op]:
        raise ValueError(f"algorithm={algorithm!r} is not available for {op}; "
                         f"use one of {ALGORITHMS[op]}")
    if p < 1:
        raise ValueError(f"p={p} ranks; a group has at least 1 rank")
    if n < 0:
        raise ValueError(f"n={n} elements is negative; pass n >= 0")
    if not 0 <= root < p:
        raise ValueError(f"root={root} is outside the group of {p}; pass 0 <= root < p")
    if algorithm == "halving_doubling" and op != "all_reduce" and p & (p - 1):
        raise ValueError(f"{op} by halving_doubling needs p a power of two, got p={p}; use ring")
    if (op, algorithm) in SEGMENTED:
        segments = default_segments(n) if segments is None else segments
        if segments < 1:
            raise ValueError(f"segments={segments}; pipelined schedules need >= 1")
    else:
        segments = None
    if op not in ("broadcast", "reduce"):
        root = 0
    if algorithm == "hierarchical":
        if gpus_per_node < 1:
            raise ValueError(f"gpus_per_node={gpus_per_node}; a node has >= 1 rank")
        if p % min(p, gpus_per_node):
            raise ValueError(f"hierarchical needs p={p} to be a multiple of "
                             f"gpus_per_node={gpus_per_node}; use ring")
    else:
        gpus_per_node = 0
    return _build(op, algorithm, p, n, root, segments, gpus_per_node)


@lru_cache(maxsize=256)
def _build(op: str, algorithm: str, p: int, n: int, root: int, segments: int | None,
           gpus_per_node: int) -> CollectiveSchedule:
    makers = {
        ("all_reduce", "ring"): lambda: ring.ring_all_reduce(p, n),
        ("all_reduce", "naive"): lambda: direct.naive_all_reduce(p, n),
        ("all_reduce", "tree"): lambda: tree.tree_all_reduce(p, n),
        ("all_reduce", "pipelined_tree"): lambda: tree.pipelined_tree_all_reduce(p, n, segments),
        ("all_reduce", "halving_doubling"):
            lambda: halving_doubling.halving_doubling_all_reduce(p, n),
        ("all_reduce", "hierarchical"):
            lambda: hierarchical.hierarchical_all_reduce(p, n, gpus_per_node),
        ("reduce_scatter", "ring"): lambda: ring.ring_reduce_scatter(p, n),
        ("reduce_scatter", "naive"): lambda: direct.naive_reduce_scatter(p, n),
        ("all_gather", "ring"): lambda: ring.ring_all_gather(p, n),
        ("all_gather", "naive"): lambda: direct.naive_all_gather(p, n),
        ("broadcast", "tree"): lambda: tree.binomial_broadcast(p, n, root),
        ("broadcast", "ring"): lambda: ring.chain_broadcast(p, n, segments, root),
        ("broadcast", "naive"): lambda: direct.naive_broadcast(p, n, root),
        ("broadcast", "halving_doubling"):
            lambda: halving_doubling.scatter_allgather_broadcast(p, n, root),
        ("reduce", "halving_doubling"):
            lambda: halving_doubling.reduce_scatter_gather_reduce(p, n, root),
        ("reduce", "tree"): lambda: tree.binomial_reduce(p, n, root),
        ("reduce", "ring"): lambda: ring.chain_reduce(p, n, segments, root),
        ("reduce", "naive"): lambda: direct.naive_reduce(p, n, root),
        ("all_to_all", "pairwise"): lambda: direct.pairwise_all_to_all(p, n),
        ("all_to_all", "naive"): lambda: direct.pairwise_all_to_all(p, n, "naive"),
        ("reduce_scatter", "halving_doubling"):
            lambda: halving_doubling.halving_reduce_scatter(p, n),
        ("all_gather", "halving_doubling"): lambda: halving_doubling.doubling_all_gather(p, n),
        ("sparse_all_gather", "ring"): lambda: ring.sparse_all_gather(p, n),
    }
    return makers[(op, algorithm)]()
