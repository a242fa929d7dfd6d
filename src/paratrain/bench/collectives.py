"""`paratrain bench collectives`: our collectives against the backend's own, nccl-tests
style.

Per op, algorithm and size (bytes per rank's buffer; all_gather: the gathered output,
reduce_scatter: the input, as nccl-tests counts them): warm-up, a barrier, then
``repeats`` x ``iters`` timed iterations over rotated buffers, ours and native taking
turns iteration by iteration (so a noisy neighbour hurts both alike); each rank keeps
the median iteration (and the 10th percentile, "best"). The
table shows time (mean and max over ranks), algbw = bytes / time and busbw = algbw x
nccl-tests' factor (all-reduce 2(p-1)/p; all-gather, reduce-scatter, all-to-all (p-1)/p;
broadcast, reduce 1), which makes algorithms and p comparable with the link speed.
Correctness is checked outside the timed loop with small integers, exact in fp32: the
``#wrong`` column counts wrong elements over all ranks.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

from paratrain.cost.collectives import ring_factor

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all")
CHUNKED = ("reduce_scatter", "all_gather", "all_to_all")  # count rounded to a multiple of p


def bus_factor(op: str, p: int) -> float:
    """nccl-tests' busbw / algbw factor (:func:`paratrain.cost.collectives.ring_factor`)."""
    return ring_factor(op, p)


def parse_bytes(text: str) -> int:
    """'1K', '64M', '2G' or a plain integer -> bytes (powers of 1024)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        value = int(t[:-1] if mult > 1 else t)
    except ValueError:
        raise ValueError(f"size {text!r} is not a byte count; write e.g. 1K, 64M or 4096") from None
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return value * mult


def sizes_pow2(min_bytes: int, max_bytes: int, factor: int = 2) -> list[int]:
    """min, min*factor, ... up to max (inclusive)."""
    if min_bytes > max_bytes or factor < 2:
        raise ValueError(f"sizes {min_bytes}..{max_bytes} x{factor}: need min <= max, factor >= 2")
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(s)
        s *= factor
    return out


@dataclass(frozen=True)
class BenchConfig:
    """What to run. ``algorithms=None``: every algorithm of each op."""

    ops: tuple[str, ...]
    sizes: tuple[int, ...]
    algorithms: tuple[str, ...] | None = None
    iters: int = 20
    warmup: int = 5
    repeats: int = 1
    piece_bytes: int | None = None
    check: bool = True
    limits: bool = True


def _count(op: str, nbytes: int, p: int) -> int:
    n = max(1, nbytes // 4)
    if op in CHUNKED:
        n = max(p, n - n % p)
    return n


def _pattern(rank: int, n: int):
    import torch

    i = torch.arange(n, dtype=torch.int64)
    return ((i * (rank + 3) + 7 * rank) % 13 - 6).to(torch.float32)


class _Case:
    """Buffers and calls of one (op, size): ours by algorithm, and native."""

    def __init__(self, op: str, n: int, rank: int, p: int, nbuf: int, piece_bytes):
        import torch

        self.op, self.n, self.rank, self.p, self.piece = op, n, rank, p, piece_bytes
        k = n // p if op in CHUNKED else n
        inn = k if op == "all_gather" else n
        out = {"all_gather": n, "reduce_scatter": k, "all_to_all": n}.get(op, 0)
        # zeros for timing: in-place reductions then never grow or turn denormal
        self.ins = [torch.zeros(inn) for _ in range(nbuf)]
        self.outs = [torch.zeros(out) for _ in range(nbuf)]

    def call(self, impl: str, alg: str | None, x, y):
        import torch.distributed as dist

        from paratrain.comm import api

        op = self.op
        kw = {"algorithm": alg, "piece_bytes": self.piece}
        if impl == "native":
            if op == "all_reduce":
                dist.all_reduce(x)
            elif op == "reduce_scatter":
                dist.reduce_scatter_tensor(y, x)
            elif op == "all_gather":
                dist.all_gather_into_tensor(y, x)
            elif op == "broadcast":
                dist.broadcast(x, 0)
            elif op == "reduce":
                dist.reduce(x, 0)
            else:
                dist.all_to_all_single(y, x)
        elif op == "all_reduce":
            api.all_reduce(x, **kw)
        elif op == "reduce_scatter":
            api.reduce_scatter(y, x, **kw)
        elif op == "all_gather":
            api.all_gather(y, x, **kw)
        elif op == "broadcast":
            api.broadcast(x, 0, **kw)
        elif op == "reduce":
            api.reduce(x, 0, **kw)
        else:
            api.all_to_all(y, x, **kw)

    def wrong(self, impl: str, alg: str | None) -> int:
        """Run once on exact inputs; count wrong elements of this rank's result."""
        import torch

        op, n, p, r = self.op, self.n, self.p, self.rank
        k = n // p if op in CHUNKED else n
        mine = _pattern(r, n)
        if op == "all_gather":
            x, y = mine[r * k:(r + 1) * k].clone(), torch.full((n,), 99.0)
            want = torch.cat([_pattern(q, n)[q * k:(q + 1) * k] for q in range(p)])
        elif op == "all_to_all":
            x, y = mine.clone(), torch.full((n,), 99.0)
            want = torch.cat([_pattern(q, n)[r * k:(r + 1) * k] for q in range(p)])
        elif op == "broadcast":
            x, y, want = mine.clone(), None, _pattern(0, n)
        else:
            total = sum(_pattern(q, n) for q in range(p))
            x, y = mine.clone(), torch.full((k,), 99.0) if op == "reduce_scatter" else None
            want = total[r * k:(r + 1) * k] if op == "reduce_scatter" else total
        self.call(impl, alg, x, y)
        got = y if op in CHUNKED else x
        if op == "reduce" and r != 0:
            return 0
        return int((got != want).sum())


def bench_worker(rank: int, world: int, cfg: BenchConfig) -> dict:
    """Runs on every rank (via paratrain.parallel.process_groups.spawn); returns this
    rank's rows."""
    import torch.distributed as dist

    from paratrain.bench import measure
    from paratrain.comm.algorithms import ALGORITHMS

    rows, limits = [], {}
    if cfg.limits and world >= 2:
        limits["tcp_bw"] = measure.stream_bw(rank)
        limits["memcpy_bw"] = measure.memcpy_bw() if rank == 0 else 0.0
        dist.barrier()
    for op in cfg.ops:
        algs = [a for a in ALGORITHMS[op] if cfg.algorithms is None or a in cfg.algorithms]
        if op == "all_to_all":
            algs = [a for a in algs if a != "naive"]  # same schedule as pairwise
        algs = [a for a in algs if not (a == "halving_doubling" and op != "all_reduce"
                                         and world & (world - 1))]
        algs = [a for a in algs if not (a == "hierarchical" and world % min(world, 8))]
        impls = [("native", None)] + [("ours", a) for a in algs]
        for nbytes in cfg.sizes:
            n = _count(op, nbytes, world)
            nbuf = max(2, min(8, math.ceil((32 << 20) / (4 * n))))
            case = _Case(op, n, rank, world, nbuf, cfg.piece_bytes)
            wrong = {i: case.wrong(*i) if cfg.check else 0 for i in impls}
            times: dict = {i: [] for i in impls}
            for impl in impls:
                for it in range(cfg.warmup):
                    case.call(*impl, case.ins[it % nbuf], case.outs[it % nbuf])
            for _ in range(cfg.repeats):
                dist.barrier()
                for it in range(cfg.iters):
                    # implementations take turns iteration by iteration: whatever else
                    # runs on the machine meanwhile slows them alike
                    for impl in impls:
                        t = time.perf_counter()
                        case.call(*impl, case.ins[it % nbuf], case.outs[it % nbuf])
                        times[impl].append(time.perf_counter() - t)
            for impl in impls:
                ts = sorted(times[impl])
                rows.append({"op": op, "algorithm": impl[1] or "native", "impl": impl[0],
                             "bytes": 4 * n, "count": n, "t": statistics.median(ts),
                             "t_best": ts[len(ts) // 10], "wrong": wrong[impl]})
            del case
    return {"rows": rows, "limits": limits}


def run(nproc: int, cfg: BenchConfig) -> tuple[list[dict], dict]:
    """Spawn ``nproc`` gloo workers, benchmark, and merge ranks into records."""
    from paratrain.parallel.process_groups import spawn

    if nproc < 2:
        raise ValueError(f"--nproc {nproc}: a collective needs at least 2 ranks")
    per_rank = spawn(bench_worker, nproc, cfg, timeout_s=3600)
    records = []
    for i, row in enumerate(per_rank[0]["rows"]):
        ts = [res["rows"][i]["t"] for res in per_rank]
        mean, worst = statistics.fmean(ts), max(ts)
        algbw = row["bytes"] / mean / 1e9
        records.append({
            "op": row["op"], "algorithm": row["algorithm"], "impl": row["impl"],
            "nproc": nproc, "bytes": row["bytes"], "count": row["count"],
            "time_us": mean * 1e6, "time_max_us": worst * 1e6,
            # 10th-percentile iteration, slowest rank: the least disturbed by other load
            "time_best_us": max(res["rows"][i]["t_best"] for res in per_rank) * 1e6,
            "algbw_gbps": algbw, "busbw_gbps": algbw * bus_factor(row["op"], nproc),
            "wrong": sum(res["rows"][i]["wrong"] for res in per_rank),
        })
    limits = {"memcpy_bw": per_rank[0]["limits"].get("memcpy_bw", 0.0),
              "tcp_bw": per_rank[0]["limits"].get("tcp_bw", 0.0)}
    return records, limits


def format_table(records: list[dict], limits: dict) -> str:
    """nccl-tests-like text: per op, one row per size and algorithm, native beside ours."""
    lines = []
    if limits.get("tcp_bw"):
        lines.append(f"# physical limits: memcpy {limits['memcpy_bw'] / 1e9:.2f} GB/s (1 thread), "
                     f"loopback p2p (rank 0 -> 1) {limits['tcp_bw'] / 1e9:.2f} GB/s")
    native = {(r["op"], r["bytes"]): r for r in records if r["impl"] == "native"}
    ops = list(dict.fromkeys(r["op"] for r in records))
    head = (f"{'size(B)':>10} {'count':>9} {'algorithm':>16} {'time(us)':>10} {'max(us)':>10} "
            f"{'algbw':>7} {'busbw':>7} {'#wrong':>6} | {'native(us)':>10} {'busbw':>7} "
            f"{'#wrong':>6} | {'ratio':>5}")
    for op in ops:
        nproc = next(r["nproc"] for r in records if r["op"] == op)
        lines.append(f"\n# {op}  nproc={nproc}  (GB/s; ratio = native time / ours = busbw ratio)")
        lines.append(head)
        for r in records:
            if r["op"] != op or r["impl"] != "ours":
                continue
            nat = native[(op, r["bytes"])]
            lines.append(
                f"{r['bytes']:>10} {r['count']:>9} {r['algorithm']:>16} {r['time_us']:>10.1f} "
                f"{r['time_max_us']:>10.1f} {r['algbw_gbps']:>7.3f} {r['busbw_gbps']:>7.3f} "
                f"{r['wrong']:>6} | {nat['time_us']:>10.1f} {nat['busbw_gbps']:>7.3f} "
                f"{nat['wrong']:>6} | {nat['time_us'] / r['time_us']:>5.2f}")
    return "\n".join(lines)
