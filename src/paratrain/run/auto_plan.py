"""`paratrain train --plan auto`: the layout is the search's winner on this machine.

1. The machine's calibrated profile (``~/.cache/paratrain/hardware.toml`` and the CPU fit
   beside it, as `paratrain check-model` leaves them). Without one it is made first, and
   the run says so: a short transport sweep (`paratrain bench calibrate`'s, 2 ranks, all-
   reduce only) and the CPU fit of `check-model` (three one-process runs of its grid model,
   on CPU time).
2. Every layout `paratrain train` accepts for the model, batch and world size, ranked by the
   prediction (:func:`paratrain.predict.layouts.rank_layouts`); the plan flags given on the
   command line fix their axes (``--plan auto --tp 2`` searches the rest), and
   ``--max-memory-gb`` drops layouts whose predicted memory per rank is over it.
3. The top 5 are printed with predicted step time, memory per rank and exposed
   communication, then why the winner wins; the run trains the winner, and its summary sets
   the prediction beside the measurement, as every run's does.

Importing this module does not import torch.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from paratrain.config import ModelConfig, TrainConfig
from paratrain.plan import ParallelPlan
from paratrain.predict.layouts import (
    Ranked,
    bullets,
    format_top,
    rank_layouts,
    why_the_winner_wins,
)
from paratrain.predict.machine import DEFAULT_PROFILE, MachineModel, load_machine

CALIBRATION_SIZES = [4 << k for k in range(0, 19, 3)]  # 4 B .. 1 MiB, 7 points


def ensure_machine(profile: str | None = None, log=print) -> MachineModel:
    """This machine's fitted model; calibrated and fitted first when it is missing."""
    from paratrain.run.check_model import GRID_BATCH, GRID_MODEL, fit_machine

    path = Path(profile or DEFAULT_PROFILE).expanduser()
    machine = load_machine(path)
    if machine is None:
        from paratrain.bench import calibrate

        log(f"no calibrated profile of this machine at {path}: calibrating first "
            "(gloo all-reduce sweep on 2 ranks, memcpy, matmul; about 10 s)")
        calibrate.run(2, CALIBRATION_SIZES, 5, path, [])
        machine = load_machine(path)
    if not machine.fitted:
        log("no CPU fit beside the profile: fitting this machine's compute constants first "
            "(three short one-process runs, as `paratrain check-model` does)")
        tcfg = TrainConfig(steps=6, global_batch=GRID_BATCH, lr=1e-3, warmup_steps=1,
                           eval_every=0, eval_batches=1)
        fit_machine(GRID_MODEL, tcfg, str(path), log=log)
        machine = load_machine(path)
    return machine


def constrained(ranked: list[Ranked], fixed: dict) -> list[Ranked]:
    """The layouts whose fields equal every value in ``fixed`` (the plan flags given)."""
    return [r for r in ranked if all(getattr(r.plan, k) == v for k, v in fixed.items())]


def search_here(mcfg: ModelConfig, tcfg: TrainConfig, world: int, fixed: dict,
                max_memory_gb: float | None, profile: str | None = None, log=print
                ) -> list[Ranked]:
    """Every valid layout for this run on this machine, fastest predicted first."""
    if max_memory_gb is not None and not max_memory_gb > 0:
        raise ValueError(f"--max-memory-gb {max_memory_gb}: give a positive size in GB, "
                         "e.g. --max-memory-gb 2")
    machine = ensure_machine(profile, log)
    unknown = sorted(set(fixed) - {f.name for f in dataclasses.fields(ParallelPlan)})
    if unknown:  # a programming error: the CLI passes plan fields only
        raise TypeError(f"not plan fields: {unknown}")
    limit = None if max_memory_gb is None else max_memory_gb * 1e9
    base = ParallelPlan().replace(**{k: v for k, v in fixed.items()
                                     if k in ("bucket_mb", "overlap", "collectives")})
    ranked = constrained(rank_layouts(mcfg, tcfg, world, machine, limit, base), fixed)
    if not ranked:
        given = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in fixed.items())
        raise ValueError(
            f"no layout of {world} processes fits"
            + (f" {max_memory_gb:g} GB per rank" if limit else "")
            + (f" with {given}" if given else "")
            + " for this model and batch; raise --max-memory-gb, drop a fixed flag, or "
            "change --nproc")
    return ranked


def choose(mcfg: ModelConfig, tcfg: TrainConfig, world: int, fixed: dict,
           max_memory_gb: float | None, profile: str | None = None, log=print
           ) -> ParallelPlan:
    """The winner, after printing the top 5 and why it wins."""
    ranked = search_here(mcfg, tcfg, world, fixed, max_memory_gb, profile, log)
    log(f"--plan auto: {len(ranked)} layouts of {world} processes ranked for this "
        "machine; the top 5:")
    log(format_top(ranked, 5))
    log("why the winner wins:")
    log(bullets(why_the_winner_wins(ranked)))
    return ranked[0].plan
