"""A collective schedule is plain data: rounds of transfers over the segments of a buffer.

Vocabulary (used across ``paratrain.comm``):

- A *segment* is a contiguous run of elements of the buffer every rank holds. Most
  collectives split one flat vector of ``n`` elements into ``p`` *chunks*; chunk ``i`` has
  ``n // p + (i < n % p)`` elements (:func:`chunk_sizes`), so any ``n`` works, including
  ``n < p`` where some chunks are empty.
- A :class:`Transfer` moves one segment from ``src`` to ``dst``; ``dst`` either adds it into
  its own copy of the segment (``REDUCE``; the executor applies sum or max) or overwrites
  its copy (``COPY``).
- A *round* is a set of transfers that run concurrently. Every send of a round reads the
  state from before the round; receives are applied after. Rounds run in order, so the
  number of rounds is the latency term of the alpha-beta model (the *steps*).

The same object is executed on process groups (:mod:`paratrain.comm.executor`), run in
memory (:mod:`paratrain.comm.simulator`), counted and priced (:mod:`paratrain.comm.cost`)
and drawn (:mod:`paratrain.viz.collective_anim`). No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

REDUCE = "reduce"
COPY = "copy"

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all",
       "sparse_all_gather", "shift")

#: Buffer layouts. ``flat``: segments tile one vector in order (offsets are cumulative).
#: ``blocks``: all-to-all; segment ``i * p + j`` is the block rank ``i`` sends to rank ``j``;
#: a rank only ever holds the blocks of its own row (input) and column (output).
#: ``pair``: point to point; segment ``i`` is rank ``i``'s block: a rank sends its own from
#: its input and receives one into its output (the ring shift of ring attention).
LAYOUTS = ("flat", "blocks", "pair")


def chunk_sizes(n: int, k: int) -> tuple[int, ...]:
    """Sizes of ``k`` nearly equal chunks of ``n`` elements: n//k + (i < n%k)."""
    if n < 0:
        raise ValueError(f"element count n={n} is negative; pass n >= 0")
    if k < 1:
        raise ValueError(f"chunk count k={k} must be >= 1")
    q, r = divmod(n, k)
    return tuple(q + (i < r) for i in range(k))


def offsets(sizes: tuple[int, ...]) -> tuple[int, ...]:
    """Start of each segment when the segments tile one vector in order."""
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return tuple(out)


class Transfer(NamedTuple):
    """Segment ``seg`` travels ``src`` -> ``dst``; ``op`` is REDUCE or COPY at ``dst``."""

    src: int
    dst: int
    seg: int
    op: str


@dataclass(frozen=True)
class CollectiveSchedule:
    """Rounds of transfers for one collective among ``p`` ranks (group ranks 0..p-1).

    ``seg_sizes[s]`` is the element count of segment ``s``; ``root`` matters for
    broadcast and reduce. ``n`` is the element count of the logical vector (for
    all-to-all: of each rank's input; for sparse all-gather: of each rank's payload).
    """

    op: str
    algorithm: str
    p: int
    n: int
    seg_sizes: tuple[int, ...]
    rounds: tuple[tuple[Transfer, ...], ...]
    root: int = 0
    layout: str = "flat"
    # Derived views (per-rank rounds, counts, arrays) memoised on the object itself:
    # hashing a large schedule to look it up elsewhere would cost as much as rebuilding.
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def steps(self) -> int:
        """Number of rounds: the alpha (latency) count of the schedule."""
        return len(self.rounds)

    @property
    def seg_offsets(self) -> tuple[int, ...]:
        """Offset of each segment in the rank's virtual buffer (all segments in order)."""
        return offsets(self.seg_sizes)

    def validate(self) -> CollectiveSchedule:
        """Raise ValueError if a transfer is malformed; return self."""
        if self.op not in OPS:
            raise ValueError(f"op={self.op!r} is unknown; use one of {OPS}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r} is unknown; use one of {LAYOUTS}")
        nseg = len(self.seg_sizes)
        for j, rnd in enumerate(self.rounds):
            written = set()
            for t in rnd:
                if not (0 <= t.src < self.p and 0 <= t.dst < self.p) or t.src == t.dst:
                    raise ValueError(
                        f"round {j}: transfer {t} needs distinct ranks in 0..{self.p - 1}")
                if not 0 <= t.seg < nseg:
                    raise ValueError(f"round {j}: transfer {t} names segment {t.seg} of {nseg}")
                if t.op not in (REDUCE, COPY):
                    raise ValueError(f"round {j}: transfer op {t.op!r}; use 'reduce' or 'copy'")
                if t.op == COPY:
                    # Two copies into one place in one round would make the result depend
                    # on arrival order: forbidden.
                    if (t.dst, t.seg) in written:
                        raise ValueError(
                            f"round {j}: two copies into segment {t.seg} of rank {t.dst}")
                    written.add((t.dst, t.seg))
        return self

    def rank_rounds(self, rank: int) -> tuple[tuple[tuple[Transfer, ...], ...], ...]:
        """Per round, (sends, receives) of ``rank``, each in schedule order (cached)."""
        key = ("rank", rank)
        if key not in self._memo:
            self._memo[key] = tuple(
                (tuple(t for t in rnd if t.src == rank), tuple(t for t in rnd if t.dst == rank))
                for rnd in self.rounds
            )
        return self._memo[key]
