"""Every layout `paratrain train` runs for one model, batch and world size, ranked by the
prediction for THIS machine (``train --plan auto``, ``plan --search --verify``).

Why its own enumeration, beside :func:`paratrain.systems.search.enumerate_plans`: that
one walks GPU clusters of thousands of ranks with the published runs' habits (tp inside a
node, sp always on with tp, cp only from 1024 tokens per rank); on a CPU box of a few
ranks every axis is cheap to try and none of those habits holds, so here every divisor
is tried and the runtime's own checks (:meth:`ParallelPlan.check_run`, the one the
launcher calls) decide what is valid:
nothing is ranked that `paratrain train` would refuse.

Torch-free: the ranking is arithmetic (:func:`paratrain.predict.predict`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from paratrain.config import ModelConfig, TrainConfig
from paratrain.cost.schedule import V_SHAPED
from paratrain.plan import CP_ALGORITHMS, RECOMPUTE, SCHEDULES, ParallelPlan
from paratrain.predict.machine import MachineModel
from paratrain.predict.step import Prediction, predict

MAX_MICRO_BATCHES = 16  # more only adds fixed per-pass cost on a CPU
MAX_VIRTUAL_STAGES = 4


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _schedules(pp: int, n_layers: int) -> list[tuple[str, int]]:
    """(schedule, virtual stages) worth trying: one entry when there is no pipeline
    (the schedule does not matter), every schedule and chunk count otherwise."""
    if pp == 1:
        return [("1f1b", 1)]
    out = []
    for s in SCHEDULES:
        if s == "interleaved":
            out += [(s, v) for v in range(2, MAX_VIRTUAL_STAGES + 1) if pp * v <= n_layers]
        elif s in V_SHAPED:  # V placement: two chunks per rank
            out += [(s, 2)] if 2 * pp <= n_layers else []
        else:
            out.append((s, 1))
    return out


def runtime_plans(mcfg: ModelConfig, world: int, global_batch: int) -> Iterator[ParallelPlan]:
    """Every plan of ``world`` ranks that `paratrain train` accepts for ``mcfg`` and a
    global batch of ``global_batch`` sequences: dp, tp, pp (with its schedule and chunks),
    cp (ring or all-to-all), ep, ZeRO 0-3 (and HSDP replicas of the dp axis), micro-batches,
    sp and recomputation. Plans the
    runtime refuses are skipped silently: refusing them is the checks' job."""
    for tp, cp in itertools.product(_divisors(world), repeat=2):
        if world % (tp * cp):
            continue
        for pp in _divisors(world // (tp * cp)):
            dp = world // (tp * cp * pp)
            if global_batch % dp:
                continue
            eps = [e for e in _divisors(dp) if mcfg.experts % e == 0] if mcfg.experts else [1]
            for m in _divisors(global_batch // dp):
                if m > MAX_MICRO_BATCHES:
                    break
                for (sched, v), ep, sp in itertools.product(
                        _schedules(pp, mcfg.n_layers), eps, (False, True) if tp > 1 else
                        (False,)):
                    for zero, reps, rc, algo in itertools.product(
                            (0, 1, 2, 3) if dp * cp > 1 else (0,), _divisors(dp), RECOMPUTE,
                            CP_ALGORITHMS if cp > 1 else ("ring",)):
                        if reps > 1 and (zero == 0 or ep > 1 or reps == dp * cp):
                            continue  # not HSDP (the checks would refuse it anyway)
                        try:
                            plan = ParallelPlan(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero,
                                                sp=sp, micro_batches=m, schedule=sched,
                                                virtual_stages=v, recompute=rc,
                                                cp_algorithm=algo, dp_replicate=reps)
                            plan.check_run(mcfg, world, global_batch)
                        except ValueError:
                            continue
                        yield plan


@dataclass(frozen=True)
class Ranked:
    """One layout and what the prediction says it costs here."""

    plan: ParallelPlan
    prediction: Prediction

    @property
    def step_s(self) -> float:
        return self.prediction.step_s

    @property
    def memory_bytes(self) -> float:
        return self.prediction.peak_bytes


def rank_layouts(mcfg: ModelConfig, tcfg: TrainConfig, world: int, machine: MachineModel,
                 max_memory_bytes: float | None = None, base: ParallelPlan | None = None
                 ) -> list[Ranked]:
    """Every runtime-valid layout (:func:`runtime_plans`), fastest predicted first. Ties
    (common when ranks outnumber cores: the session's CPU work sets the pace, whatever
    the layout) go to the shorter critical path (the layout that loses least when the
    cores are freer than predicted), then less memory, then the simpler plan (fewer
    non-default fields). ``base`` carries the
    settings the search does not choose (bucket size, overlap, collectives); a layout
    over ``max_memory_bytes`` per rank is left out."""
    keep = {f: getattr(base, f) for f in ("bucket_mb", "overlap", "collectives")} \
        if base is not None else {}
    out = []
    for plan in runtime_plans(mcfg, world, tcfg.global_batch):
        plan = plan.replace(**keep) if keep else plan
        pred = predict(mcfg, tcfg, plan, world, machine)
        if max_memory_bytes is not None and pred.peak_bytes > max_memory_bytes:
            continue
        out.append(Ranked(plan, pred))
    out.sort(key=lambda r: (round(r.step_s, 9), round(r.prediction.critical_path_s, 9),
                            r.memory_bytes, _fancy(r.plan)))
    return out


def _fancy(plan: ParallelPlan) -> int:
    default = ParallelPlan()
    return sum(getattr(plan, f.name) != getattr(default, f.name)
               for f in dataclasses.fields(plan) if f.name != "dp")


def describe(plan: ParallelPlan) -> str:
    """A layout in one short phrase: ``dp2 x tp2 zero1 sp m4 1f1b``."""
    parts = [f"{a}{getattr(plan, a)}" for a in ("dp", "tp", "pp", "cp", "ep")
             if getattr(plan, a) > 1] or ["dp1"]
    words = " x ".join(parts)
    if plan.zero:
        words += f" zero{plan.zero}"
    if plan.dp_replicate > 1:
        words += f" hsdp{plan.dp_replicate}"
    if plan.sp:
        words += " sp"
    if plan.cp > 1:
        words += f" {plan.cp_algorithm}"
    if plan.micro_batches > 1:
        words += f" m{plan.micro_batches}"
    if plan.pp > 1:
        words += f" {plan.schedule}" + (f" v{plan.virtual_stages}"
                                        if plan.virtual_stages > 1 else "")
    if plan.recompute != "none":
        words += f" rc-{plan.recompute}"
    return words


def why_the_winner_wins(ranked: list[Ranked]) -> list[str]:
    """The winner's predicted step split into its terms, and the best layout that
    differs from it on each axis, with what that costs."""
    win = ranked[0]
    p = win.prediction
    lines = [f"{describe(win.plan)}: {p.step_s * 1e3:.1f} ms per step = compute "
             f"{p.compute_s * 1e3:.1f} + fixed costs {p.overhead_s * 1e3:.1f} + exposed "
             f"comm {(p.tp_comm_s + p.pp_comm_s + p.dp_exposed_s + p.cp_exposed_s + p.ep_comm_s) * 1e3:.1f} ms"  # noqa: E501
             f" on the critical path"
             + (" (CPU-bound: the ranks' work over the cores this run gets sets the pace)"
                if p.session_work_s / p.session_cores > p.critical_path_s else "")]
    for axis in ("dp", "tp", "pp", "cp", "zero", "micro_batches", "schedule", "recompute"):
        alt = next((r for r in ranked[1:] if getattr(r.plan, axis) != getattr(win.plan, axis)),
                   None)
        if alt is not None:
            lines.append(f"best with {axis}={getattr(alt.plan, axis)}: {describe(alt.plan)}, "
                         f"{100 * (alt.step_s / win.step_s - 1):+.1f}% step time")
    return lines


def format_top(ranked: list[Ranked], k: int = 5) -> str:
    """The top ``k`` as a table of at most 80 columns."""
    lines = [f"{'#':>2} {'layout':<40} {'step ms':>8} {'MB/rank':>8} {'comm ms':>8}"]
    for i, r in enumerate(ranked[:k], 1):
        p = r.prediction
        comm = p.tp_comm_s + p.pp_comm_s + p.dp_exposed_s + p.cp_exposed_s + p.ep_comm_s
        lines.append(f"{i:>2} {describe(r.plan)[:40]:<40} {r.step_s * 1e3:>8.1f} "
                     f"{r.memory_bytes / 2**20:>8.1f} {comm * 1e3:>8.1f}")
    return "\n".join(lines)


def bullets(lines: list[str], width: int = 80) -> str:
    """``lines`` as "  - " bullets wrapped to ``width`` columns, continuations indented
    under their bullet's text."""
    import textwrap

    return "\n".join(textwrap.fill(line, width, initial_indent="  - ",
                                    subsequent_indent="    ") for line in lines)
