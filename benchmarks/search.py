"""How fast `paratrain plan --search` scores layouts: Llama 3 405B on 16,384 H100,
sequence 8192, 16M tokens per step (issue target: under 5 s).

    python benchmarks/search.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics

from paratrain.systems.hardware import load_hardware
from paratrain.systems.models import load_model
from paratrain.systems.search import search


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model, hw = load_model("llama3-405b"), load_hardware("h100")
    times = []
    for _ in range(args.repeats):
        res = search(model, hw, 16384, 16 * 2**20, 8192, keep_points=False)
        times.append(res.elapsed_s)
    t = statistics.median(times)
    best = res.top[0]
    print(f"scored {res.scored:,} layouts in {t:.2f} s (median of {args.repeats}): "
          f"{res.scored / t:,.0f} layouts/s")
    print(f"winner: {best}")


if __name__ == "__main__":
    main()
