"""Run a schedule in memory (numpy) for any p up to ~1024: results and traffic, no processes.

State: every rank's virtual buffer, stored padded as ``[p, segments, max_segment]`` so a
round is three vectorised numpy operations: gather what every sender holds (the
pre-round state, as the schedule's semantics require), then add or copy it into the
receivers. Padding lanes stay zero and never leave their slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from paratrain.comm.algorithms import build
from paratrain.comm.schedule import REDUCE, CollectiveSchedule, chunk_sizes, offsets

MAX_SIM_ELEMENTS = 200_000_000


@dataclass(frozen=True)
class SimResult:
    """Final virtual buffers ``[p, V]`` and the traffic actually simulated (elements)."""

    state: np.ndarray
    steps: int
    sent: tuple[int, ...]
    recv: tuple[int, ...]


def _arrays(s: CollectiveSchedule):
    if "arrays" not in s._memo:
        out = []
        for rnd in s.rounds:
            if not rnd:
                out.append(None)
                continue
            a = np.array([(t.src, t.dst, t.seg, t.op == REDUCE) for t in rnd], dtype=np.int64)
            src, dst, seg, red = a[:, 0], a[:, 1], a[:, 2], a[:, 3].astype(bool)
            key = dst[red] * len(s.seg_sizes) + seg[red]
            unique = len(np.unique(key)) == len(key)  # else several adds into one place
            out.append((src, dst, seg, red, unique))
        s._memo["arrays"] = out
    return s._memo["arrays"]


def simulate_schedule(schedule: CollectiveSchedule, state: np.ndarray, reduce: str = "sum"
                      ) -> SimResult:
    """Run ``schedule`` on ``state`` ([p, V], V = sum of segment sizes); return the end."""
    p, sizes = schedule.p, np.array(schedule.seg_sizes, dtype=np.int64)
    if state.shape != (p, int(sizes.sum())):
        raise ValueError(f"state shape {state.shape}; this schedule needs ({p}, {sizes.sum()})")
    if reduce not in ("sum", "max"):
        raise ValueError(f"reduce={reduce!r}; the simulator does 'sum' or 'max'")
    nseg, width = len(sizes), int(sizes.max(initial=0))
    if p * nseg * width > MAX_SIM_ELEMENTS:
        raise ValueError(f"p={p} x {nseg} segments x {width} is too big to simulate; shrink n or p")
    offs = offsets(schedule.seg_sizes)
    pad = np.zeros((p, nseg, width), dtype=state.dtype)
    for s, (o, k) in enumerate(zip(offs, schedule.seg_sizes, strict=True)):
        pad[:, s, :k] = state[:, o:o + k]
    sent, recv = np.zeros(p, dtype=np.int64), np.zeros(p, dtype=np.int64)
    ufunc = np.add if reduce == "sum" else np.maximum
    for arrs in _arrays(schedule):
        if arrs is None:
            continue
        src, dst, seg, red, unique = arrs
        data = pad[src, seg]  # fancy indexing copies: the pre-round state
        if red.any():
            if unique:
                pad[dst[red], seg[red]] = ufunc(pad[dst[red], seg[red]], data[red])
            else:
                ufunc.at(pad, (dst[red], seg[red]), data[red])
        cp = ~red
        if cp.any():
            pad[dst[cp], seg[cp]] = data[cp]
        sent += np.bincount(src, weights=sizes[seg], minlength=p).astype(np.int64)
        recv += np.bincount(dst, weights=sizes[seg], minlength=p).astype(np.int64)
    out = np.empty_like(state)
    for s, (o, k) in enumerate(zip(offs, schedule.seg_sizes, strict=True)):
        out[:, o:o + k] = pad[:, s, :k]
    return SimResult(out, schedule.steps, tuple(int(x) for x in sent),
                     tuple(int(x) for x in recv))


def simulate_collective(op: str, algorithm: str | None, inputs: np.ndarray, *, root: int = 0,
                        segments: int | None = None, reduce: str = "sum",
                        gpus_per_node: int = 8):
    """Run one collective on per-rank ``inputs`` and return (outputs, SimResult).

    ``inputs[r]`` is rank r's input: the vector (all_reduce, reduce_scatter, broadcast,
    reduce, all_to_all), its chunk (all_gather: a list of arrays) or its k-entry payload
    (sparse_all_gather). Outputs follow torch.distributed: the full vector, rank r's chunk,
    the root's vector (reduce: a list where only the root's entry is meaningful), or for
    all_to_all the p received blocks concatenated.
    """
    p = len(inputs)
    if op == "all_gather":
        n = sum(len(x) for x in inputs)
    else:
        n = len(inputs[0])
    s = build(op, algorithm, p, n, root=root, segments=segments, gpus_per_node=gpus_per_node)
    if op == "all_to_all":
        # virtual buffer: p x p blocks; rank r starts with its row (r, *) = its input
        sizes = chunk_sizes(n, p)
        row = int(sum(s.seg_sizes[:p]))
        state = np.zeros((p, p * row), dtype=np.asarray(inputs[0]).dtype)
        for r in range(p):
            state[r, r * row:(r + 1) * row] = inputs[r]
        res = simulate_schedule(s, state, reduce)
        offs = s.seg_offsets
        outs = [np.concatenate([res.state[r, offs[i * p + r]:offs[i * p + r] + sizes[r]]
                                for i in range(p)]) for r in range(p)]
        for r in range(p):  # the diagonal block never travels: it is the rank's own
            k, o = sizes[r], offsets(sizes)[r]
            outs[r][r * k:(r + 1) * k] = inputs[r][o:o + k]
        return outs, res
    if op == "all_gather":
        state = np.zeros((p, n), dtype=np.asarray(inputs[0]).dtype)
        for r, o in enumerate(s.seg_offsets):
            state[r, o:o + len(inputs[r])] = inputs[r]
    elif op == "sparse_all_gather":
        state = np.zeros((p, p * n), dtype=np.asarray(inputs[0]).dtype)
        for r in range(p):
            state[r, r * n:(r + 1) * n] = inputs[r]
    else:
        state = np.array(inputs, copy=True)
    res = simulate_schedule(s, state, reduce)
    if op == "reduce_scatter":
        offs = s.seg_offsets
        return [res.state[r, offs[r]:offs[r] + s.seg_sizes[r]] for r in range(p)], res
    return list(res.state), res
