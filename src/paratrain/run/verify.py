"""`paratrain plan --search --verify K`: the planner checks its own ranking on this machine.

The search (:func:`paratrain.predict.layouts.rank_layouts`) ranks every layout `paratrain
train` accepts by the prediction for this machine; here the top K and K others drawn at
random (seeded) from the rest are each trained for a few steps in fresh gloo processes,
and the verdict is printed beside the prediction:

- measured vs predicted step time per layout (the median step after the first, which
  warms up; the same measurement as `paratrain check-model`);
- Kendall's tau (tau-b: ties in either order count as neither concordant nor discordant)
  between the predicted and the measured order: 1 means the planner ordered them as the
  machine did;
- whether the predicted winner is the measured winner, and how far it is from the
  measured best (the figure that matters when the planner picks the layout).

The random layouts keep the test honest: a planner that only compares near-identical
winners says little about its ordering.

Importing this module does not import torch.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import tempfile

from paratrain.config import ModelConfig, TrainConfig
from paratrain.plan import ParallelPlan
from paratrain.predict.layouts import Ranked, describe
from paratrain.predict.machine import MachineModel
from paratrain.predict.step import predict
from paratrain.run.check_model import _Sampler, _train_worker


def kendall_tau(xs: list[float], ys: list[float]) -> float:
    """Kendall's tau-b of two orderings of the same items (nan for fewer than 2)."""
    n = len(xs)
    conc = disc = tx = ty = 0
    for i in range(n):
        for j in range(i + 1, n):
            a, b = xs[i] - xs[j], ys[i] - ys[j]
            if a == 0 and b == 0:
                continue
            if a == 0:
                tx += 1
            elif b == 0:
                ty += 1
            elif (a > 0) == (b > 0):
                conc += 1
            else:
                disc += 1
    denom = ((conc + disc + tx) * (conc + disc + ty)) ** 0.5
    return (conc - disc) / denom if denom else float("nan")


def pick(ranked: list[Ranked], k: int, seed: int = 0) -> list[tuple[str, Ranked]]:
    """The top ``k`` and ``k`` drawn at random from the rest: [(why picked, layout)]."""
    if k < 1:
        raise ValueError(f"--verify {k}: run at least 1 layout (e.g. --verify 4)")
    rest = ranked[k:]
    drawn = random.Random(seed).sample(rest, min(k, len(rest)))
    drawn.sort(key=lambda r: r.step_s)
    return [("top", r) for r in ranked[:k]] + [("random", r) for r in drawn]


def measure(mcfg: ModelConfig, tcfg: TrainConfig, plan: ParallelPlan, world: int,
            timeout_s: float = 900) -> dict:
    """Train one layout for ``tcfg.steps`` steps: the median step after the first, and
    the other sessions' runnable threads sampled meanwhile (the machine's load)."""
    from paratrain.parallel.process_groups import spawn

    with tempfile.TemporaryDirectory(prefix="paratrain-verify-") as d, _Sampler() as smp:
        s = spawn(_train_worker, world, dataclasses.asdict(mcfg), dataclasses.asdict(tcfg),
                  dataclasses.asdict(plan), d, timeout_s=timeout_s)[0]
    return {"measured_s": statistics.median(s["step_times"][1:]),
            "others": tuple(smp.samples)}


def verify(mcfg: ModelConfig, tcfg: TrainConfig, ranked: list[Ranked], world: int, k: int,
           machine: MachineModel, steps: int = 6, seed: int = 0, log=print) -> dict:
    """Run the picked layouts; the records, tau and the winner's verdict.

    Each layout's prediction is re-priced with the load sampled while it ran (the other
    sessions' threads, as `paratrain check-model` does: the cores this run gets are part
    of the machine's state, the same physics for every layout); the search's own
    prediction, made before anything ran, is kept beside it (``search_s``)."""
    if steps < 3:
        raise ValueError(f"--verify-steps {steps}: need at least 3 (the first is warm-up)")
    tcfg = dataclasses.replace(tcfg, steps=steps, eval_every=0, eval_batches=1,
                               checkpoint_every=0)
    records = []
    for why, r in pick(ranked, k, seed):
        got = measure(mcfg, tcfg, r.plan, world)
        pred = predict(mcfg, tcfg, r.plan, world, machine.replace(others=got["others"]))
        rec = {"layout": describe(r.plan), "picked": why,
               "predicted_rank": ranked.index(r) + 1, "search_s": r.step_s,
               "predicted_s": pred.step_s, "measured_s": got["measured_s"],
               "error": pred.step_s / got["measured_s"] - 1,
               "other_threads": machine.replace(others=got["others"]).other_threads,
               "plan": dataclasses.asdict(r.plan)}
        records.append(rec)
        log(f"ran {rec['layout'][:34]:<34} pred {pred.step_s * 1e3:7.1f} ms, measured "
            f"{got['measured_s'] * 1e3:7.1f} ms")
    return verdict(records)


def verdict(records: list[dict]) -> dict:
    """Tau between the predicted and measured order (the load-adjusted prediction, and
    the search's own, made before anything ran), and the place of the search's winner
    (the layout `train --plan auto` would train: the record of search rank 1, else the
    best-ranked one measured)."""
    pred = [r["predicted_s"] for r in records]
    meas = [r["measured_s"] for r in records]
    for key, xs in (("measured_place", meas), ("predicted_place", pred)):
        for i, r in enumerate(sorted(range(len(xs)), key=xs.__getitem__), 1):
            records[r][key] = i
    winner = min(range(len(records)), key=lambda i: records[i]["predicted_rank"])
    best = min(meas)
    search = [r.get("search_s", r["predicted_s"]) for r in records]
    return {"records": records, "kendall_tau": kendall_tau(pred, meas),
            "kendall_tau_search": kendall_tau(search, meas),
            "winner": records[winner]["layout"],
            "winner_is_measured_best": meas[winner] == best,
            "winner_over_best": meas[winner] / best - 1,
            "median_abs_error": statistics.median(abs(r["error"]) for r in records)}


def format_verdict(result: dict) -> str:
    """The verification table (at most 80 columns) and the verdict lines."""
    lines = [f"{'layout':<30} {'pick':>6} {'search':>6} {'pred':>4} {'meas':>4} "
             f"{'pred ms':>8} {'meas ms':>8} {'err':>5}"]
    for r in sorted(result["records"], key=lambda r: r["predicted_rank"]):
        lines.append(f"{r['layout'][:30]:<30} {r['picked']:>6} {r['predicted_rank']:>6} "
                     f"{r['predicted_place']:>4} {r['measured_place']:>4} "
                     f"{r['predicted_s'] * 1e3:>8.1f} {r['measured_s'] * 1e3:>8.1f} "
                     f"{100 * r['error']:>+4.0f}%")
    n = len(result["records"])
    lines.append(f"Kendall tau (predicted vs measured order, {n} layouts): "
                 f"{result['kendall_tau']:.2f} (the search's unloaded prediction: "
                 f"{result['kendall_tau_search']:.2f})")
    where = ("is the measured best" if result["winner_is_measured_best"] else
             f"is {100 * result['winner_over_best']:.1f}% slower than the measured best")
    lines.append(f"the search's winner ({result['winner']}) {where}; median |error| "
                 f"{100 * result['median_abs_error']:.0f}%")
    lines.append("search: the layout's place among every valid layout ranked; pred, meas: "
                 "its place among these, predicted and measured")
    return "\n".join(lines)
