"""Validating and timing a pipeline schedule (no torch): :func:`simulate_pipeline` runs
each rank's action list of a :class:`~paratrain.cost.schedule.PipelineSchedule` under
the runtime's semantics (every send non-blocking, every receive blocking until its
message exists) and fails on a deadlock, an unmatched send or receive, a backward before
its forward, or a missing or duplicated action; :func:`validate` is the check alone.
See :mod:`paratrain.cost.schedule` for the semantics and the closed-form bubble the
simulation equals (``tests/test_systems_bubble.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from paratrain.cost.schedule import COMPUTE, Action, PipelineSchedule


@dataclass
class Timeline:
    """Per rank, (action, start, end) of each compute action; and the summary numbers."""

    spans: list[list[tuple[Action, float, float]]]
    makespan: float
    bubble: float  # idle fraction of p x makespan
    fifo: bool  # whether every pair of ranks also matches sends and receives in order
    peak_in_flight: list[int]  # per rank, most micro-batch-chunks holding activations


def _costs(kind: str, v: int, costs: dict[str, float] | None) -> float:
    c = costs or {"F": 1.0, "B": 2.0, "BI": 1.0, "BW": 1.0}
    return c[kind] / v


@dataclass
class _Simulation:
    """The simulation's state: each rank's position and clock, the messages in flight
    and the compute actions done."""

    s: PipelineSchedule
    costs: dict[str, float] | None
    pos: list[int] = field(default_factory=list)
    clock: list[float] = field(default_factory=list)
    channel: dict[tuple, float] = field(default_factory=dict)  # message -> time sent
    order: dict[tuple[int, int], list[tuple]] = field(default_factory=dict)  # per (src, dst)
    fifo: bool = True
    done: dict[tuple, float] = field(default_factory=dict)  # (kind, mb, stage) -> finish
    received: set[tuple] = field(default_factory=set)  # (kind, mb, receiver stage)
    spans: list[list[tuple[Action, float, float]]] = field(default_factory=list)
    live: list[int] = field(default_factory=list)
    peak: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        p = self.s.pp
        self.pos, self.clock = [0] * p, [0.0] * p
        self.spans = [[] for _ in range(p)]
        self.live, self.peak = [0] * p, [0] * p

    def need(self, r: int, a: Action) -> str | None:
        """Why compute action ``a`` cannot run yet (None if it can)."""
        s, done, k, last = self.s, self.done, self.s.stage(r, a.chunk), self.s.stages - 1
        if a.kind == "F":
            if k > 0 and ("F", a.mb, k - 1) not in done:
                return "input"
            if k > 0 and s.locate(k - 1)[0] != r and ("F", a.mb, k) not in self.received:
                return "recv"
            return None
        if ("F", a.mb, k) not in done:
            raise ValueError(f"rank {r}: {a} runs before F{a.mb} of stage {k}")
        if a.kind == "BW":
            if ("BI", a.mb, k) not in done:
                raise ValueError(f"rank {r}: {a} runs before BI{a.mb} of stage {k}")
            return None
        if k < last:
            if not any(key in done for key in (("B", a.mb, k + 1), ("BI", a.mb, k + 1))):
                return "grad"
            if s.locate(k + 1)[0] != r and ("B", a.mb, k) not in self.received:
                return "recv"
        return None

    def send(self, r: int, a: Action, k: int) -> bool:
        fwd = a.kind == "SEND_F"
        src_key = ("F", a.mb, k) if fwd else next(
            (key for key in (("B", a.mb, k), ("BI", a.mb, k)) if key in self.done), None)
        if src_key is None or src_key not in self.done:
            raise ValueError(f"rank {r}: {a} sends before it is computed")
        want = self.s.locate(k + 1 if fwd else k - 1)[0]
        if a.peer != want:
            raise ValueError(f"rank {r}: {a} goes to {a.peer}, stage {k}'s "
                             f"{'next' if fwd else 'previous'} is rank {want}")
        key = (r, a.peer, a.kind[-1], a.mb, k)
        self.channel[key] = self.done[src_key]
        self.order.setdefault((r, a.peer), []).append(key)
        return True

    def recv(self, r: int, a: Action, k: int) -> bool:
        """False while the message has not been sent (the rank blocks here)."""
        fwd = a.kind == "RECV_F"
        key = (a.peer, r, a.kind[-1], a.mb, k - 1 if fwd else k + 1)
        if key not in self.channel:
            return False
        q = self.order.get((a.peer, r), [])
        self.fifo = self.fifo and bool(q) and q[0] == key
        if key in q:
            q.remove(key)
        self.clock[r] = max(self.clock[r], self.channel.pop(key))
        self.received.add((a.kind[-1], a.mb, k))
        return True

    def compute(self, r: int, a: Action, k: int) -> bool:
        """False while an input is missing (the rank waits for another rank)."""
        s, done, last = self.s, self.done, self.s.stages - 1
        if not 0 <= a.mb < s.micro_batches or not 0 <= a.chunk < s.virtual_stages:
            raise ValueError(f"rank {r}: {a} is outside m={s.micro_batches}, "
                             f"v={s.virtual_stages}")
        why = self.need(r, a)
        if why == "recv":
            raise ValueError(f"rank {r}: {a} has no receive for its input")
        if why is not None:
            return False
        dep = 0.0  # a local producer's finish (remote ones came via RECV)
        if a.kind == "F" and k > 0 and s.locate(k - 1)[0] == r:
            dep = done[("F", a.mb, k - 1)]
        elif a.kind in ("B", "BI") and k < last and s.locate(k + 1)[0] == r:
            dep = max(done.get(("B", a.mb, k + 1), 0.0), done.get(("BI", a.mb, k + 1), 0.0))
        t0 = max(self.clock[r], dep)
        t1 = t0 + _costs(a.kind, s.virtual_stages, self.costs)
        if (a.kind, a.mb, k) in done:
            raise ValueError(f"rank {r}: {a} appears twice")
        done[(a.kind, a.mb, k)] = t1
        self.clock[r] = t1
        self.spans[r].append((a, t0, t1))
        self.live[r] += 1 if a.kind == "F" else (-1 if a.kind in ("B", "BW") else 0)
        self.peak[r] = max(self.peak[r], self.live[r])
        return True

    def run(self, r: int, a: Action) -> bool:
        """Run ``a`` on rank ``r``; False if it blocks."""
        k = self.s.stage(r, a.chunk)
        if a.kind in ("SEND_F", "SEND_B"):
            return self.send(r, a, k)
        if a.kind in ("RECV_F", "RECV_B"):
            return self.recv(r, a, k)
        if a.kind in COMPUTE:
            return self.compute(r, a, k)
        raise ValueError(f"rank {r}: unknown action kind {a.kind!r}")

    def check_complete(self) -> None:
        if self.channel:
            raise ValueError(f"unmatched sends (never received): {sorted(self.channel)[:4]}")
        done = self.done
        for k in range(self.s.stages):
            for i in range(self.s.micro_batches):
                if ("F", i, k) not in done:
                    raise ValueError(f"F{i} of stage {k} is missing")
                if ("B", i, k) not in done and not (("BI", i, k) in done
                                                    and ("BW", i, k) in done):
                    raise ValueError(f"backward of micro-batch {i} on stage {k} is missing")


def simulate_pipeline(s: PipelineSchedule, costs: dict[str, float] | None = None) -> Timeline:
    """Validate ``s`` and time it (F = 1, B = 2, BI = BW = 1 per full stage; a chunk costs
    1/v of that; communication free). Raises ValueError naming the first problem."""
    p = s.pp
    if len(s.actions) != p:
        raise ValueError(f"schedule has {len(s.actions)} ranks' lists, expected pp={p}")
    sim = _Simulation(s, costs)
    while any(sim.pos[r] < len(s.actions[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while sim.pos[r] < len(s.actions[r]) and sim.run(r, s.actions[r][sim.pos[r]]):
                sim.pos[r] += 1
                moved = True
        if not moved:
            stuck = {r: str(s.actions[r][sim.pos[r]]) for r in range(p)
                     if sim.pos[r] < len(s.actions[r])}
            raise ValueError(f"schedule {s.name} deadlocks: ranks wait at {stuck}")
    sim.check_complete()
    makespan = max(sim.clock) if sim.clock else 0.0
    busy = sum(t1 - t0 for sp in sim.spans for _, t0, t1 in sp)
    bubble = 1.0 - busy / (p * makespan) if makespan > 0 else 0.0
    return Timeline(sim.spans, makespan, bubble, sim.fifo, sim.peak)


def validate(s: PipelineSchedule) -> Timeline:
    """Raise ValueError if ``s`` is not executable; see :mod:`paratrain.cost.schedule`."""
    return simulate_pipeline(s)
