"""When a calibration measurement counts as stable, and the one line that refuses a machine
too busy to calibrate (docs/train-prediction.md)."""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Stability:
    """When a measurement counts as stable: the last ``k`` of at most ``max_repeats``
    rounds agree, every timing's coefficient of variation over them at most ``cv``
    (docs/train-prediction.md says why 30%). ``rounds_set``: ``k`` was set by its user
    (``PARATRAIN_STABLE_ROUNDS``), so the measurements that keep more rounds than ``k``
    for their noise (the sync's, ``bench.calibrate.SYNC_ROUNDS``) keep ``k`` too."""

    k: int = 3
    cv: float = 0.30
    max_repeats: int = 10
    rounds_set: bool = False


STABLE_CV_ENV = "PARATRAIN_STABLE_CV"  # a noisier machine's own threshold, e.g. 0.5
STABLE_ROUNDS_ENV = "PARATRAIN_STABLE_ROUNDS"  # rounds that must agree, e.g. 1: the first


def default_rule() -> Stability:
    """What `paratrain bench calibrate`, `check-model`'s fit and `train --plan auto` use:
    :class:`Stability`'s defaults, with the variation allowed from ``PARATRAIN_STABLE_CV``
    and the rounds that must agree from ``PARATRAIN_STABLE_ROUNDS`` when set (a user who
    knows the machine is noisy, or quiet; a test of the flow that is not a test of the
    machine sets ``inf`` and 1: the first round counts). A value out of range is one
    ValueError naming it."""
    rule = Stability()
    raw = os.environ.get(STABLE_CV_ENV)
    if raw is not None:
        try:
            cv = float(raw)
        except ValueError:
            cv = -1.0
        if not cv > 0:
            raise ValueError(f"{STABLE_CV_ENV}={raw!r} is not a positive number; set it to "
                             "e.g. 0.5 or unset it")
        rule = replace(rule, cv=cv)
    raw = os.environ.get(STABLE_ROUNDS_ENV)
    if raw is not None:
        k = int(raw) if raw.strip().isdigit() else 0
        if not 1 <= k <= rule.max_repeats:
            raise ValueError(f"{STABLE_ROUNDS_ENV}={raw!r} is not a whole number from 1 to "
                             f"{rule.max_repeats}; set it to e.g. 3 or unset it")
        rule = replace(rule, k=k, rounds_set=True)
    return rule


class BusyMachine(ValueError):
    """The machine never settled: one line saying so and what to do (the CLI prints it)."""


def variation(xs: Sequence[float]) -> float:
    """Coefficient of variation (population standard deviation over the mean)."""
    mean = statistics.fmean(xs)
    return statistics.pstdev(xs) / mean if mean > 0 else float("inf")


def until_stable(measure: Callable[[], Sequence[float]], what: str,
                 rule: Stability = Stability(),
                 agree: Callable[[bool], bool] = lambda ok: ok,
                 judged: Callable[[list[float]], Sequence[float]] = lambda xs: xs,
                 command: str = "paratrain bench calibrate") -> list[float]:
    """Call ``measure`` (one round: a few positive timings) until the last ``rule.k``
    rounds are stable; return each timing's median over them. ``judged`` maps a round to
    the figures whose stability counts (default: all; a sweep judges the alpha and beta
    it fits, not each size's latency). ``agree`` lets the ranks of a process group
    decide together (all stable or none), so they stay in step. Raises
    :class:`BusyMachine` (naming ``command`` to run again) after ``rule.max_repeats``
    unstable rounds."""
    rounds: list[list[float]] = []
    worst = float("inf")
    for _ in range(rule.max_repeats):
        rounds.append([float(x) for x in measure()])
        window = rounds[-rule.k:]
        if len(window) == rule.k:
            figs = [judged(r) for r in window]
            worst = max(variation(col) for col in zip(*figs, strict=True))
        if agree(len(window) == rule.k and worst <= rule.cv):
            return [statistics.median(col) for col in zip(*window, strict=True)]
    raise BusyMachine(
        f"the machine was too busy to calibrate: {what} still varied by {worst:.0%} over "
        f"the last {rule.k} of {rule.max_repeats} rounds (at most {rule.cv:.0%} counts as "
        f"stable); run `{command}` again when fewer jobs run (see `uptime`)")


def _agree_all(ok: bool) -> bool:
    """True on every rank only when it is true on every rank (an all-reduce MIN)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([1.0 if ok else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())
