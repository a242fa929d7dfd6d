"""How steady the matmul peak a run's MFU divides by is on this machine (issue 23).

The unit tests check the peak's arithmetic with injected timings; its speed, and how
much the machine's load moves it, is this benchmark's business. It measures
:func:`paratrain.bench.peak.matmul_peak_flops` (the best of 16 trials after a warm-up,
as a run measures it before training) ``--repeats`` times, a pause apart, and prints
each measurement and their spread (max / min). On a quiet machine the spread is near 1;
on a shared one it says how far two runs' MFU can differ for the same speed.

    PYTHONPATH=src python benchmarks/peak.py --repeats 10 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from paratrain.bench.peak import TRIALS, matmul_peak_flops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--pause", type=float, default=1.0, help="seconds between repeats")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (workers: 1)")
    ap.add_argument("--n", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    got = []
    for i in range(args.repeats):
        if i:
            time.sleep(args.pause)
        t0 = time.perf_counter()
        got.append(matmul_peak_flops(torch.float32, args.n))
        print(f"repeat {i}: {got[-1] / 1e9:7.1f} GFLOP/s (best of {TRIALS}, "
              f"{time.perf_counter() - t0:.2f} s)", flush=True)
    print(json.dumps({"n": args.n, "threads": args.threads, "trials": TRIALS,
                      "gflops": [round(g / 1e9, 2) for g in got],
                      "median_gflops": round(statistics.median(got) / 1e9, 2),
                      "spread_max_over_min": round(max(got) / min(got), 3)}))


if __name__ == "__main__":
    main()
