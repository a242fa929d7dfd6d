"""Closed-form cost of collectives: steps, wire bytes, alpha-beta time.

Conventions (every function takes the same ``payload_bytes``):

- all_reduce, broadcast, reduce: ``payload_bytes`` is the vector each rank holds (n).
- all_gather, reduce_scatter: ``payload_bytes`` is the FULL vector n; each rank's piece
  is n / p (the gathered result, or the reduce-scatter input).
- all_to_all: ``payload_bytes`` is what each rank holds before the exchange; it keeps
  n / p and sends the rest.

``steps`` counts sequential communication rounds (each pays one latency alpha).
``wire_bytes`` is the bytes the busiest rank sends (for symmetric algorithms: every rank).
``time_s = steps x alpha + critical bytes / bandwidth``, where the critical bytes are the
bytes that cross the bottleneck port one after another. For ring, halving-doubling and
pipelined algorithms that equals the wire bytes; for the naive star and the naive binary
tree it is more, because a root receives (or a level forwards) the whole vector in
sequence: the naive binary-tree all-reduce moves the whole payload on each of its
2 log2(p) levels (docs/design.md: 3.2 s for 13.5 GB among 64 GPUs at 50 GB/s).

Pipelined algorithms (ring broadcast/reduce as a chain, pipelined_tree) take an optional
``segments`` S: the step count then includes the pipeline's fill, exactly as the
hand-made schedules in :mod:`paratrain.comm` execute it; ``None`` is the ideal limit of
many segments (chain: p - 1 steps, n on the critical path). Byte counts are exact when
the vector splits evenly into the pieces (the schedules send whole elements, so with an
uneven split the busiest rank sends up to one element more per piece).

Algorithms:
  ring             Patarasuk & Yuan 2009: 2(p-1) steps, 2(p-1)/p x n per rank (the minimum).
  naive            everyone to one root (a star), one message at a time; all_to_all: direct
                   pairwise sends.
  tree             binomial tree, each level moving the whole vector (log2 p levels up,
                   log2 p down).
  pipelined_tree   the vector cut into S segments streamed up and down two mirrored heap
                   binary trees, each carrying half (NCCL's double binary tree, Sanders,
                   Speck & Traeff 2009): ceil(S/2) + 2 floor(log2 p) - 1 steps; a rank
                   sends n/2 per tree edge it owns (up to ~2n).
  halving_doubling recursive halving reduce-scatter + recursive doubling all-gather
                   (Thakur, Rabenseifner & Gropp 2005); all_to_all: Bruck et al. 1997.
                   Needs p a power of two, except all_reduce: with p' the largest power
                   of two <= p, p - p' ranks first hand their vector to a neighbour and
                   get the result back at the end (2 more steps, one more vector).
  hierarchical     inside each node (g GPUs) then across nodes (p / g) then inside again
                   (2D ring: reduce-scatter intra, all-reduce inter on n / g, all-gather
                   intra). Takes ``gpus_per_node`` and the intra link separately.
"""

from __future__ import annotations

import math

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all")
ALGORITHMS = ("ring", "naive", "tree", "pipelined_tree", "halving_doubling", "hierarchical")

# (op, algorithm) pairs that are meaningful; everything else is a ValueError.
_SUPPORTED = {
    "ring": {"all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"},
    "naive": set(OPS),
    "tree": {"all_reduce", "broadcast", "reduce"},
    "pipelined_tree": {"all_reduce", "broadcast", "reduce"},
    "halving_doubling": set(OPS),
    "hierarchical": {"all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"},
}


def ring_share(p: int) -> float:
    """(p-1)/p: the share of the full vector each of ``p`` ranks sends in a ring
    all-gather or reduce-scatter (its own 1/p it keeps); the one home of the ring factor
    (Patarasuk & Yuan 2009), which every byte counter imports."""
    return (p - 1) / p


def ring_factor(op: str, p: int) -> float:
    """Bytes each rank sends per payload byte in a ring ``op`` (pairwise for all_to_all),
    nccl-tests' busbw / algbw factor: 2(p-1)/p all-reduce; (p-1)/p all-gather,
    reduce-scatter, all-to-all; 1 broadcast and reduce (a chain)."""
    if op not in OPS:
        raise ValueError(f"op={op!r} is unknown; choose one of {', '.join(OPS)}")
    if op == "all_reduce":
        return 2 * ring_share(p)
    return ring_share(p) if op in ("reduce_scatter", "all_gather", "all_to_all") else 1.0


def _check(op: str, algorithm: str, p: int, gpus_per_node: int | None = None) -> None:
    if op not in OPS:
        raise ValueError(f"collective op {op!r} is unknown; choose one of {', '.join(OPS)}")
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"algorithm {algorithm!r} is unknown; choose one of {', '.join(ALGORITHMS)}"
        )
    if op not in _SUPPORTED[algorithm]:
        ok = ", ".join(a for a in ALGORITHMS if op in _SUPPORTED[a])
        raise ValueError(f"{op} has no {algorithm} algorithm; use one of {ok}")
    if not (isinstance(p, int) and p >= 1):
        raise ValueError(f"group size p={p!r} must be an integer >= 1")
    if algorithm == "halving_doubling" and p & (p - 1) and op != "all_reduce":
        raise ValueError(f"{op} by halving_doubling needs p a power of two, got p={p}; use ring")
    if algorithm == "hierarchical" and gpus_per_node is not None and p > gpus_per_node and (
        p % gpus_per_node
    ):
        raise ValueError(
            f"hierarchical needs p={p} to be a multiple of gpus_per_node={gpus_per_node}; "
            "use ring"
        )


def _log2(p: int) -> int:
    return math.ceil(math.log2(p)) if p > 1 else 0


def _split(p: int, gpus_per_node: int) -> tuple[int, int]:
    """(g, k): ranks per node and nodes of a hierarchical group."""
    g = min(p, gpus_per_node)
    return g, p // g


def _double_tree_wire(p: int, n: float, share_a: float) -> float:
    """Bytes the busiest rank sends in the two mirrored heap trees (children 2i+1, 2i+2;
    tree B numbers rank r as p-1-r): each tree edge a rank owns (up to its parent, down to
    each child) carries that tree's share of the vector (``share_a`` of it for tree A)."""
    def edges(i: int) -> int:
        return (i > 0) + (2 * i + 1 < p) + (2 * i + 2 < p)

    return max(edges(r) * share_a * n + edges(p - 1 - r) * (1 - share_a) * n for r in range(p))


def _flat(op: str, algorithm: str, p: int, n: float, segments: int | None = None
          ) -> tuple[int, float, float]:
    """(steps, wire bytes of the busiest rank, critical bytes) for one flat algorithm."""
    if p == 1:
        return 0, 0.0, 0.0
    L = _log2(p)
    f = ring_share(p)
    if algorithm == "ring":
        if op in ("broadcast", "reduce"):  # a pipelined chain: every rank but one sends n
            if segments is None:
                return p - 1, n, n
            k = segments
            return p - 2 + k, n, (p - 2 + k) * n / k
        steps = {"all_reduce": 2 * (p - 1), "reduce_scatter": p - 1, "all_gather": p - 1}[op]
        wire = {"all_reduce": 2 * f * n, "reduce_scatter": f * n, "all_gather": f * n}[op]
        return steps, wire, wire
    if algorithm == "naive":
        if op == "all_to_all":  # direct pairwise exchange
            return p - 1, f * n, f * n
        if op == "reduce":  # every rank sends n to the root, which takes them in turn
            return p - 1, n, (p - 1) * n
        if op == "broadcast":  # the root sends n to each rank in turn
            return p - 1, (p - 1) * n, (p - 1) * n
        if op == "all_reduce":  # reduce then broadcast through the root
            return 2 * (p - 1), (p - 1) * n, 2 * (p - 1) * n
        if op == "reduce_scatter":  # reduce to the root, which sends each rank its piece
            return 2 * (p - 1), max(n, f * n), (p - 1) * n + f * n
        # all_gather: gather the pieces to the root, then broadcast the whole vector
        return 2 * (p - 1), (p - 1) * n, f * n + (p - 1) * n
    if algorithm == "tree":
        if op == "reduce":
            return L, n, L * n
        if op == "broadcast":
            return L, L * n, L * n
        return 2 * L, L * n, 2 * L * n  # all_reduce: reduce up, broadcast down
    if algorithm == "pipelined_tree":
        depth = p.bit_length() - 1  # floor(log2 p): height of a heap tree
        if op == "all_reduce":
            share_a = 0.5 if segments is None else (segments + 1) // 2 / segments
            wire = _double_tree_wire(p, n, share_a)
            steps = 2 * depth if segments is None else (segments + 1) // 2 + 2 * depth - 1
            return steps, wire, wire
        return L, n, n
    # halving_doubling
    if op == "all_reduce" and p & (p - 1):  # fold the extra ranks in and out
        q = 1 << (p.bit_length() - 1)
        hd = 2 * (q - 1) / q * n
        return 2 * _log2(q) + 2, hd + n, hd + 2 * n
    steps = {"all_reduce": 2 * L, "reduce_scatter": L, "all_gather": L,
             "broadcast": 2 * L, "reduce": 2 * L, "all_to_all": L}[op]
    wire = {"all_reduce": 2 * f * n, "reduce_scatter": f * n, "all_gather": f * n,
            "broadcast": 2 * f * n, "reduce": 2 * f * n, "all_to_all": L * n / 2}[op]
    if op == "reduce" and p > 1:
        # reduce-scatter, then a binomial gather to the root: the busiest *sender* (the
        # root's last partner) sends f n + n/2; the root *receives* 2 f n, which is what
        # bounds the time.
        return steps, f * n + n / 2, wire
    return steps, wire, wire


def _hier_parts(op: str, p: int, n: float, gpus_per_node: int):
    """[(steps, wire, critical, 'intra'|'inter'), ...] of a hierarchical collective."""
    g, k = _split(p, gpus_per_node)
    if op == "all_reduce":
        parts = [(*_flat("reduce_scatter", "ring", g, n), "intra"),
                 (*_flat("all_reduce", "ring", k, n / g), "inter"),
                 (*_flat("all_gather", "ring", g, n), "intra")]
    elif op == "reduce_scatter":
        parts = [(*_flat("reduce_scatter", "ring", g, n), "intra"),
                 (*_flat("reduce_scatter", "ring", k, n / g), "inter")]
    elif op == "all_gather":
        parts = [(*_flat("all_gather", "ring", k, n / g), "inter"),
                 (*_flat("all_gather", "ring", g, n), "intra")]
    elif op == "broadcast":
        parts = [(*_flat("broadcast", "ring", k, n), "inter"),
                 (*_flat("broadcast", "ring", g, n), "intra")]
    else:  # reduce
        parts = [(*_flat("reduce", "ring", g, n), "intra"),
                 (*_flat("reduce", "ring", k, n), "inter")]
    return parts


def _check_segments(segments: int | None) -> None:
    if segments is not None and not (isinstance(segments, int) and segments >= 1):
        raise ValueError(f"segments={segments!r} must be an integer >= 1 (or None)")


def steps(op: str, algorithm: str, p: int, *, gpus_per_node: int = 8,
          segments: int | None = None) -> int:
    """Sequential rounds of ``op`` with ``algorithm`` among ``p`` ranks (ring all-reduce:
    2(p-1); binary tree all-reduce: 2 log2 p)."""
    _check(op, algorithm, p, gpus_per_node)
    _check_segments(segments)
    if algorithm == "hierarchical":
        return sum(s for s, _, _, _ in _hier_parts(op, p, 1.0, gpus_per_node))
    return _flat(op, algorithm, p, 1.0, segments)[0]


def wire_bytes(op: str, algorithm: str, p: int, payload_bytes: float, *,
               gpus_per_node: int = 8, segments: int | None = None) -> float:
    """Bytes the busiest rank sends (ring all-reduce: 2(p-1)/p x payload, the minimum)."""
    _check(op, algorithm, p, gpus_per_node)
    _check_segments(segments)
    if payload_bytes < 0:
        raise ValueError(f"payload_bytes={payload_bytes} must be >= 0")
    if algorithm == "hierarchical":
        return sum(w for _, w, _, _ in _hier_parts(op, p, payload_bytes, gpus_per_node))
    return _flat(op, algorithm, p, payload_bytes, segments)[1]


def time_s(op: str, algorithm: str, p: int, payload_bytes: float, alpha_s: float,
           bw_bytes_per_s: float, *, gpus_per_node: int = 8, intra_alpha_s: float | None = None,
           intra_bw_bytes_per_s: float | None = None, segments: int | None = None) -> float:
    """Alpha-beta time: steps x alpha + critical bytes / bandwidth.

    ``alpha_s``/``bw_bytes_per_s`` describe the slowest link the group spans. For
    ``hierarchical`` they are the inter-node link, and ``intra_*`` the link inside a node
    (default: the same link).
    """
    _check(op, algorithm, p, gpus_per_node)
    _check_segments(segments)
    if bw_bytes_per_s <= 0:
        raise ValueError(f"bandwidth {bw_bytes_per_s} must be positive bytes/s")
    if payload_bytes < 0:
        raise ValueError(f"payload_bytes={payload_bytes} must be >= 0")
    if algorithm != "hierarchical":
        s, _, crit = _flat(op, algorithm, p, payload_bytes, segments)
        return s * alpha_s + crit / bw_bytes_per_s
    ia = alpha_s if intra_alpha_s is None else intra_alpha_s
    ib = bw_bytes_per_s if intra_bw_bytes_per_s is None else intra_bw_bytes_per_s
    total = 0.0
    for s, _, crit, where in _hier_parts(op, p, payload_bytes, gpus_per_node):
        a, b = (ia, ib) if where == "intra" else (alpha_s, bw_bytes_per_s)
        total += s * a + crit / b
    return total


def topk_payload_bytes(n_values: int, k: int, value_bytes: int = 2,
                       index_bytes: int = 4) -> float:
    """Bytes one rank originates when it keeps 1 value in ``k`` with its index."""
    if k < 1:
        raise ValueError(f"k={k} must be >= 1 (keep 1 value in k)")
    return n_values / k * (value_bytes + index_bytes)


def compressed_wire_bytes(p: int, piece_bytes: float) -> float:
    """Sparse (top-k) payloads cannot be summed on the way, so they go by all-gather:
    each rank sends (p - 1) x its own piece, growing with p (docs/design.md)."""
    return wire_bytes("all_gather", "ring", p, p * piece_bytes)
