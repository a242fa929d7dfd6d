"""Count and price a schedule: steps, elements each rank sends and receives, alpha-beta time.

The systems model can price collectives from these schedules; its closed forms
(:mod:`paratrain.cost.collectives`) are the cross-check.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.comm.schedule import CollectiveSchedule


@dataclass(frozen=True)
class Counts:
    """Per-rank traffic of one schedule, in elements (multiply by the element size).

    ``round_load[j]`` is the busiest rank's max(sent, received) in round j: with full-duplex
    links of bandwidth bw, round j cannot finish before round_load[j] * elem_bytes / bw.
    Zero-length segments cost nothing (both sides skip them) but their round still counts.
    """

    steps: int
    sent: tuple[int, ...]
    recv: tuple[int, ...]
    round_load: tuple[int, ...]

    def bytes_sent(self, elem_bytes: int) -> list[int]:
        """Bytes each rank sends."""
        return [e * elem_bytes for e in self.sent]

    def bytes_recv(self, elem_bytes: int) -> list[int]:
        """Bytes each rank receives."""
        return [e * elem_bytes for e in self.recv]


def count(schedule: CollectiveSchedule) -> Counts:
    """Steps and per-rank element traffic of ``schedule`` (pure Python, memoised)."""
    if "counts" not in schedule._memo:
        schedule._memo["counts"] = _count(schedule)
    return schedule._memo["counts"]


def _count(schedule: CollectiveSchedule) -> Counts:
    p, sizes = schedule.p, schedule.seg_sizes
    sent, recv = [0] * p, [0] * p
    load = []
    for rnd in schedule.rounds:
        rs, rr = {}, {}
        for t in rnd:
            k = sizes[t.seg]
            rs[t.src] = rs.get(t.src, 0) + k
            rr[t.dst] = rr.get(t.dst, 0) + k
        for r, k in rs.items():
            sent[r] += k
        for r, k in rr.items():
            recv[r] += k
        load.append(max(max(rs.values(), default=0), max(rr.values(), default=0)))
    return Counts(schedule.steps, tuple(sent), tuple(recv), tuple(load))


def time_s(schedule: CollectiveSchedule, alpha_s: float, bw_bytes_per_s: float, elem_bytes: int = 4,
           model: str = "rounds", *, gpus_per_node: int | None = None,
           intra_alpha_s: float | None = None,
           intra_bw_bytes_per_s: float | None = None) -> float:
    """Alpha-beta time of ``schedule``.

    ``model="simple"``: steps x alpha + (max bytes any rank sends or receives) / bw, the
    textbook form. ``model="rounds"`` (default): sum over rounds of alpha + busiest rank's
    bytes in that round / bw. The two agree for ring, halving-doubling and pairwise
    schedules, where every round is equally loaded; "rounds" is right for trees and
    pipelines, where a rank's bytes are spread unevenly over the rounds (a tree root that
    sends log2 p times still waits for its subtrees in between).
    """
    if alpha_s < 0 or bw_bytes_per_s <= 0:
        raise ValueError(f"alpha_s={alpha_s}, bw={bw_bytes_per_s}: need alpha >= 0, bw > 0")
    if gpus_per_node is not None:
        return _two_links(schedule, alpha_s, bw_bytes_per_s, elem_bytes, gpus_per_node,
                          alpha_s if intra_alpha_s is None else intra_alpha_s,
                          bw_bytes_per_s if intra_bw_bytes_per_s is None
                          else intra_bw_bytes_per_s)
    c = count(schedule)
    if model == "simple":
        most = max(max(c.sent, default=0), max(c.recv, default=0))
        return c.steps * alpha_s + most * elem_bytes / bw_bytes_per_s
    if model == "rounds":
        return sum(alpha_s + load * elem_bytes / bw_bytes_per_s for load in c.round_load)
    raise ValueError(f"model={model!r}; use 'rounds' or 'simple'")


def _two_links(s: CollectiveSchedule, alpha: float, bw: float, elem: int, g: int, ia: float,
               ib: float) -> float:
    """Rounds model with two links: ranks r // g share a node and its faster link; a
    round lasts as long as its slower part (``alpha``/``bw``: between nodes)."""
    total = 0.0
    for rnd in s.rounds:
        load: dict[tuple[bool, str, int], int] = {}
        for t in rnd:
            intra = t.src // g == t.dst // g
            k = s.seg_sizes[t.seg]
            load[(intra, "s", t.src)] = load.get((intra, "s", t.src), 0) + k
            load[(intra, "r", t.dst)] = load.get((intra, "r", t.dst), 0) + k
        part = 0.0
        for intra, a, b in ((True, ia, ib), (False, alpha, bw)):
            most = max((v for key, v in load.items() if key[0] == intra), default=None)
            if most is not None:
                part = max(part, a + most * elem / b)
        total += part
    return total
