"""Our ring all-reduce against gloo's own at 16-64 MiB for p = 2 and 4 (the performance
target of issue 4: busbw >= 0.8x native), plus the machine's physical limits.

    python benchmarks/collectives.py [--repeats 5] [--iters 20] [--piece-bytes 1M]

Ours and native take turns iteration by iteration (so load from other processes hits both
alike); each rank keeps the median iteration; ratio = native time / our time (= busbw
ratio); "p10 ratio" compares the 10th-percentile iterations (the least disturbed).
"""

from __future__ import annotations

import argparse

from paratrain.bench import collectives as bc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nprocs", default="2,4")
    ap.add_argument("--min-bytes", default="16M")
    ap.add_argument("--max-bytes", default="64M")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--piece-bytes", default=None)
    args = ap.parse_args()
    sizes = bc.sizes_pow2(bc.parse_bytes(args.min_bytes), bc.parse_bytes(args.max_bytes))
    piece = bc.parse_bytes(args.piece_bytes) if args.piece_bytes else None
    print(f"{'p':>2} {'size':>6} {'native busbw':>12} {'ours busbw':>10} {'ratio':>6} "
          f"{'p10 ratio':>9}  (GB/s; median iteration)")
    for p in (int(x) for x in args.nprocs.split(",")):
        cfg = bc.BenchConfig(("all_reduce",), tuple(sizes), ("ring",), args.iters, args.warmup,
                             args.repeats, piece, check=True)
        records, limits = bc.run(p, cfg)
        nat = {r["bytes"]: r for r in records if r["impl"] == "native"}
        for r in records:
            if r["impl"] != "ours":
                continue
            n = nat[r["bytes"]]
            print(f"{p:>2} {r['bytes'] >> 20:>4}Mi {n['busbw_gbps']:>12.3f} "
                  f"{r['busbw_gbps']:>10.3f} {n['time_us'] / r['time_us']:>6.2f} "
                  f"{n['time_best_us'] / r['time_best_us']:>9.2f}"
                  f"{'' if r['wrong'] == 0 else '  WRONG'}")
        print(f"   limits: memcpy {limits['memcpy_bw'] / 1e9:.2f} GB/s (1 thread), "
              f"loopback p2p {limits['tcp_bw'] / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
