"""Model-parallel benchmark: pipeline bubbles, runtime overhead, 3-D layout step time.

    python benchmarks/model_parallel.py [--steps 6] [--json out.json]

1. Bubble at pp = 4, m = 8 for gpipe, 1f1b, interleaved (v = 2) and zb-h1: the measured
   idle fraction of the step (from the runtime's per-action timings, median over steps
   after the first) beside the schedule's simulated bubble and the textbook formula.
2. Runtime overhead per pipeline action: the same model and micro-batches run in one
   process (gradient accumulation, no p2p) take T1 per step; a perfect p-stage pipeline
   would take T1 / p / (1 - bubble_simulated); the measured step time above that,
   divided by the compute actions per rank (2m, or 3m for zb-h1), is the overhead
   ("ms/action"). "runtime ms" is measured directly: per compute action, the part of
   the step a rank spent neither computing nor blocked in a receive (posting sends and
   receives, bookkeeping), the worst rank.
3. Step time of (dp, tp, pp) = (2, 2, 2) vs pure data parallelism on 8 processes.

Each configuration runs in fresh gloo processes (one thread each), on CPU. On a machine
with fewer cores than processes the ranks share cores, which inflates both compute
spans and waits: read the numbers with the core count printed at the top.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from paratrain.config import ModelConfig, TrainConfig
from paratrain.parallel.process_groups import spawn
from paratrain.plan import ParallelPlan
from paratrain.run.loop import RunOptions, train

MODEL = ModelConfig(n_layers=8, d_model=128, n_heads=4, d_ff=512, context=64)
OPTS = RunOptions(quiet=True, measure_peak=False)


def tcfg(steps: int, data: str | None) -> TrainConfig:
    return TrainConfig(steps=steps, global_batch=16, lr=3e-3, warmup_steps=2, eval_every=0,
                       eval_batches=1, dtype="float32", data=data)


def _run(rank: int, world: int, plan: ParallelPlan, steps: int, data: str | None) -> dict:
    t = time.perf_counter()
    s = train(MODEL, tcfg(steps, data), plan, OPTS)
    mp = s.get("model_parallel", {})
    return {"step_s": s["step_s"], "losses": s["losses"], "wall_s": time.perf_counter() - t,
            "pipeline": {k: v for k, v in mp.get("pipeline", {}).items() if k != "timeline"},
            "tp": mp.get("tp"), "activation": mp.get("activation")}


def run(world: int, plan: ParallelPlan, steps: int, data: str | None) -> dict:
    if world == 1:
        return _run(0, 1, plan, steps, data)
    return spawn(_run, world, plan, steps, data, timeout_s=900)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--data", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-3d", action="store_true")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)  # like every spawned rank: compare one core's work with one
    print(f"{os.cpu_count()} CPU cores; model {MODEL}")
    records = []
    one = run(1, ParallelPlan(micro_batches=8), args.steps, args.data)
    records.append({"impl": "1 process, 8 micro-batches", **one})
    print(f"one process, 8 accumulated micro-batches: {one['step_s']:.4f} s/step")
    print(f"{'schedule':<16} {'measured':>9} {'simulated':>9} {'formula':>8} "
          f"{'s/step':>8} {'ideal':>8} {'ms/action':>9} {'runtime ms':>10}")
    for sched, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)):
        plan = ParallelPlan(pp=4, micro_batches=8, schedule=sched, virtual_stages=v)
        r = run(4, plan, args.steps, args.data)
        p = r["pipeline"]
        ideal = one["step_s"] / 4 / (1 - p["bubble_simulated"])
        actions = (3 if sched == "zb-h1" else 2) * 8 * v
        over = (r["step_s"] - ideal) / actions
        name = f"{sched} v={v}" if v > 1 else sched
        print(f"{name:<16} {p['bubble_measured']:9.3f} {p['bubble_simulated']:9.3f} "
              f"{p['bubble_formula']:8.3f} {r['step_s']:8.4f} {ideal:8.4f} {1e3 * over:9.2f} "
              f"{1e3 * max(p['runtime_overhead_s_per_action_per_rank']):10.2f}")
        records.append({"impl": f"pp4 {name}", "ideal_step_s": ideal,
                        "overhead_s_per_action": over, **r})
    if not args.skip_3d:
        for name, plan in (("dp=8", ParallelPlan(dp=8)),
                           ("(2,2,2) 1f1b m=4", ParallelPlan(dp=2, tp=2, pp=2,
                                                             micro_batches=4)),
                           ("(2,2,2) 1f1b m=4 sp", ParallelPlan(dp=2, tp=2, pp=2, sp=True,
                                                                micro_batches=4))):
            r = run(8, plan, args.steps, args.data)
            print(f"8 processes {name:<20} {r['step_s']:.4f} s/step")
            records.append({"impl": f"8 procs {name}", **r})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    print("median step of the pipelines:",
          statistics.median(r["step_s"] for r in records[1:5]))


if __name__ == "__main__":
    main()
