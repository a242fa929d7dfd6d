"""How fast the planner is, and whether its search agrees with the published runs.

    python benchmarks/search.py [--repeats 3] [--self-check]

- `paratrain plan` (one layout, reference figures plus the step model): issue target < 1 s.
- `paratrain plan --search` for Llama 3 405B on 16,384 H100, sequence 8192, 16M tokens per
  step, with the fitted step model: issue target < 5 s.
- ``--self-check``: for every published run in the runs table, the search's best layout
  (same model, engine, fitted parameters, ZeRO stage and recomputation) against the
  published layout's predicted step; a published layout the search could not choose
  (not a valid power-of-two-tp plan, or over memory) is listed as such.
"""

from __future__ import annotations

import argparse
import statistics
import time

from paratrain.cost.hardware import load_hardware
from paratrain.cost.memory import memory
from paratrain.cost.shapes import load_model
from paratrain.systems.fitting import load_params
from paratrain.systems.row_engine import case_attention, case_engine
from paratrain.systems.search import search
from paratrain.systems.step_model import predict_step


def self_check(params) -> None:
    from paratrain.systems.runs import cases_and_skips, read_runs

    cases, _ = cases_and_skips(read_runs())
    ok = slower = unchoosable = 0
    for c in cases:
        eng = case_engine(c)
        pub = predict_step(c.model, c.plan, c.hw, c.tokens, c.seq_len, params, eng,
                           case_attention(c)).step_s
        fits = memory(c.model, c.plan, c.hw, c.tokens, c.seq_len, attention="flash").fits
        choosable = fits and not (c.plan.tp & (c.plan.tp - 1))
        try:
            best = search(c.model, c.hw, c.plan.world_size, c.tokens, c.seq_len, top=1,
                          keep_points=False, params=params, engine=eng.name,
                          attention="flash", zero_stages=(c.plan.zero,),
                          recomputes=(c.plan.recompute,)).top[0].step_s
        except ValueError:
            best = float("nan")
        if best <= pub * (1 + 1e-9):
            ok += 1
        elif choosable:
            slower += 1
            print(f"SLOWER {c.id}: best {best:.3f} s vs published {pub:.3f} s")
        else:
            unchoosable += 1
            print(f"not choosable {c.id} (fits {fits}, tp {c.plan.tp}): best {best:.3f} s "
                  f"vs published {pub:.3f} s")
    print(f"self-check: {ok} no slower, {slower} slower, {unchoosable} published layouts "
          "outside the search space")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--self-check", action="store_true")
    args = ap.parse_args()
    import contextlib
    import io

    from paratrain.cli import main as cli

    t = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            cli(["plan", "--json"])
        t.append(time.perf_counter() - t0)
    plan_s = statistics.median(t)
    model, hw, params = load_model("llama3-405b"), load_hardware("h100"), load_params()
    times = []
    for _ in range(args.repeats):
        res = search(model, hw, 16384, 16 * 2**20, 8192, keep_points=False, params=params)
        times.append(res.elapsed_s)
    s = statistics.median(times)
    print(f"paratrain plan: {plan_s:.2f} s (median of {args.repeats}, in-process)")
    print(f"search: scored {res.scored:,} layouts in {s:.2f} s (median of {args.repeats}): "
          f"{res.scored / s:,.0f} layouts/s")
    print(f"winner: {res.top[0].plan} ({res.top[0].micro_batch} seqs per micro-batch)")
    if args.self_check:
        self_check(params)


if __name__ == "__main__":
    main()
