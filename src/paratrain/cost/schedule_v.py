"""The V-shaped schedules (zb-v, dualpipev) as per-rank compute lists: chunk 0 of rank r
is stage r, chunk 1 stage 2p - 1 - r (:func:`paratrain.cost.schedule.stage_of`).
:mod:`paratrain.cost.schedule` adds the sends and receives and validates them; its
docstring says what each schedule is and where it comes from. No torch here."""

from __future__ import annotations

from paratrain.cost.actions import Action


class _Emitter:
    """One rank's list under construction: ``emit(kind, chunk)`` appends that chunk's next
    micro-batch of ``kind`` (a full ``B`` counts as that chunk's next input gradient, so
    B and BI share a counter); ``BI`` queues its ``BW``, which ``weight()`` emits oldest
    first (``weight(chunk)``: the oldest of that chunk)."""

    def __init__(self) -> None:
        self.acts: list[Action] = []
        self.next: dict[tuple[str, int], int] = {}
        self.deferred: list[tuple[int, int]] = []  # (chunk, mb) whose BW is still owed

    def emit(self, kind: str, chunk: int, times: int = 1) -> None:
        for _ in range(times):
            key = ("BI" if kind == "B" else kind, chunk)
            mb = self.next.get(key, 0)
            self.next[key] = mb + 1
            self.acts.append(Action(kind, mb, chunk))
            if kind == "BI":
                self.deferred.append((chunk, mb))

    def weight(self, chunk: int | None = None) -> bool:
        """Emit the oldest owed BW (of ``chunk`` if given); False if none is owed."""
        i = next((j for j, (c, _) in enumerate(self.deferred) if chunk in (None, c)), None)
        if i is None:
            return False
        c, mb = self.deferred.pop(i)
        self.acts.append(Action("BW", mb, c))
        return True

    def count(self, kind: str, chunk: int) -> int:
        return self.next.get((kind, chunk), 0)


def zb_v(p: int, m: int) -> list[list[Action]]:
    """ZB-V (Qi et al. 2023, sec. 6), V placement. Built for ``n = max(m, 2p - 1)``
    micro-batches (the fewest that fill the V) and cut back to m: per rank r, forwards of
    chunk 0 until the V's bottom is reached, then chunk 1's first backwards right behind
    their forwards, a steady phase of F BI BW on each chunk in turn, and a drain whose
    deferred BW fill the ramp-down."""
    n = max(m, 2 * p - 1)
    out = []
    for r in range(p):
        e = _Emitter()
        e.emit("F", 0, 2 * (p - r) - 1)
        for _ in range(r):
            e.emit("F", 1)
            e.emit("F", 0)
        for _ in range(p - r):
            e.emit("F", 1)
            e.emit("BI", 1)
            e.weight()
        while e.count("F", 1) < e.count("F", 0) or e.count("F", 0) < n:
            if e.count("F", 0) < n:
                e.emit("F", 0)
            e.emit("BI", 0)
            e.weight()
            e.emit("F", 1)
            e.emit("BI", 1)
            e.weight()
        for _ in range(r):
            e.emit("BI", 0)
            e.emit("BI", 1)
        # drain: chunk 0's backwards, each followed by the oldest chunk-0 BW, then the rest
        for _ in range(p - r):
            e.emit("BI", 0)
            e.weight(0)
        while e.weight(1):
            pass
        while e.weight(0):
            pass
        out.append([a for a in e.acts if a.mb < m])
    return out


def dualpipev(p: int, m: int) -> list[list[Action]]:
    """DualPipeV (DeepSeek-AI 2024, DeepSeek-V3 report sec. 3.2.1, in its V-shaped
    one-copy form): per rank r, forwards of chunk 0 then of both chunks; a zero-bubble
    lead-in on chunk 1 (BI, a deferred BW, F); the main phase pairs a forward of one chunk
    with a full backward of the other (F0 B1, F1 B0: DeepSeek overlaps each pair's
    communication with the other's compute; here they run back to back); then backwards
    only, the second half as BI whose BW fill the ramp-down. Needs m >= 2p."""
    if m < 2 * p:
        raise ValueError(f"dualpipev needs micro_batches >= 2*pp = {2 * p} (got {m}); "
                         f"use --micro-batches {2 * p}")
    out = []
    for r in range(p):
        e = _Emitter()
        e.emit("F", 0, 2 * (p - r - 1))
        for _ in range(r + 1):
            e.emit("F", 0)
            e.emit("F", 1)
        for _ in range(p - r - 1):
            e.emit("BI", 1)
            e.weight()
            e.emit("F", 1)
        for _ in range(m - 2 * p + r + 1):
            for f, b in ((0, 1), (1, 0)):
                e.emit("F", f)
                e.emit("B", b)
        for _ in range(p - r - 1):
            e.emit("B", 1)
            e.emit("F", 1)
            e.emit("B", 0)
        zb = False
        for i in range(r + 1):  # the switch to BI falls mid-phase, on chunk 1 (r odd) or 0
            for c in (1, 0):
                zb = zb or (i == (r + 1) // 2 and (r % 2 == 1) == (c == 1))
                e.emit("BI" if zb else "B", c)
        for _ in range(p - r - 1):
            e.weight()
            e.emit("BI" if zb else "B", 0)
        while e.weight():
            pass
        out.append(e.acts)
    return out
