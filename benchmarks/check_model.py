"""Closing the loop on this machine: the systems model's predicted step time, wire bytes
and model-state bytes beside the measurement, for a grid of plans (DP, ZeRO-1/2/3, TP, PP
1F1B and interleaved, CP ring and all-to-all, EP on a small MoE, and their combinations;
2-8 gloo processes).

The same code as ``paratrain check-model`` (:func:`paratrain.run.check_model.run_grid`).
Needs a hardware profile: ``paratrain bench calibrate`` first (on a quiet machine: it
refuses on a busy one). Target (issue 22): median absolute error of step time <= 10 %, no
plan beyond 25 %, wire bytes and model states exact.

    python benchmarks/check_model.py [--plans "dp2,tp2"] [--steps 6] [--launches 3] [--json]
"""

from __future__ import annotations

import argparse
import json

from paratrain.run.check_model import GRID, LAUNCHES, format_table, run_grid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", default=None, help=f"comma-separated, of: {', '.join(GRID)}")
    ap.add_argument("--steps", type=int, default=6, help="steps per run (first is warm-up)")
    ap.add_argument("--launches", type=int, default=LAUNCHES,
                    help="times each plan is launched; its record is the median launch")
    ap.add_argument("--profile", default=None, help="hardware profile (default: calibrate's)")
    ap.add_argument("--no-fit", action="store_true", help="use the saved CPU fit")
    ap.add_argument("--json", action="store_true", help="print the records as JSON")
    a = ap.parse_args()
    names = [p.strip() for p in a.plans.split(",")] if a.plans else None
    log = (lambda *x, **k: None) if a.json else print
    result = run_grid(names, profile=a.profile, steps=a.steps, fit=not a.no_fit,
                      launches=a.launches, log=log)
    print(json.dumps(result, indent=1) if a.json else format_table(result))


if __name__ == "__main__":
    main()
