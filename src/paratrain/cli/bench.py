"""`paratrain bench ...` sub-commands (collectives, calibrate).

No torch at import time: the commands import their modules inside their bodies.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True)

_ALL_OPS = "all_reduce,reduce_scatter,all_gather,broadcast,reduce,all_to_all"


def _split(text: str | None) -> tuple[str, ...] | None:
    return tuple(t.strip() for t in text.split(",") if t.strip()) if text else None


@app.command()
def collectives(
    nproc: int = typer.Option(2, help="Worker processes (gloo on CPU) to launch."),
    ops: str = typer.Option(_ALL_OPS, help="Comma-separated collectives."),
    algorithms: str = typer.Option(None, help="Comma-separated algorithms (default: all)."),
    min_bytes: str = typer.Option("1K", help="Smallest buffer (K/M/G suffixes)."),
    max_bytes: str = typer.Option("64M", help="Largest buffer."),
    factor: int = typer.Option(2, help="Size multiplier between rows."),
    iters: int = typer.Option(20, help="Timed iterations per block."),
    warmup: int = typer.Option(5, help="Untimed iterations first."),
    repeats: int = typer.Option(1, help="Rounds of --iters timed iterations (median of all)."),
    piece_bytes: str = typer.Option(None, help="Our pipeline piece size (default 4M)."),
    check: bool = typer.Option(True, help="Count wrong elements (outside the timed loop)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON records instead."),
) -> None:
    """nccl-tests-style table: our collectives vs the backend's, per size and algorithm."""
    from paratrain.bench import collectives as bc
    from paratrain.comm.algorithms import ALGORITHMS

    op_list = _split(ops) or ()
    for op in op_list:
        if op not in bc.OPS:
            raise ValueError(f"--ops {op!r} is unknown; use some of {', '.join(bc.OPS)}")
    algs = _split(algorithms)
    known = {a for op in op_list for a in ALGORITHMS[op]}
    for a in algs or ():
        if a not in known:
            raise ValueError(
                f"--algorithms {a!r} fits none of {list(op_list)}; use {sorted(known)}")
    if iters < 1 or warmup < 0 or repeats < 1:
        raise ValueError(f"--iters {iters} --warmup {warmup} --repeats {repeats}: "
                         "need iters >= 1, warmup >= 0, repeats >= 1")
    sizes = bc.sizes_pow2(bc.parse_bytes(min_bytes), bc.parse_bytes(max_bytes), factor)
    cfg = bc.BenchConfig(op_list, tuple(sizes), algs, iters, warmup, repeats,
                         bc.parse_bytes(piece_bytes) if piece_bytes else None, check)
    records, limits = bc.run(nproc, cfg)
    if as_json:
        print(json.dumps(records, indent=1))
    else:
        print(bc.format_table(records, limits))


@app.command()
def calibrate(
    nproc: int = typer.Option(2, help="Worker processes for the transport measurements."),
    out: Path = typer.Option(None, help="Profile path (default ~/.cache/paratrain/hardware.toml)."),
    min_bytes: str = typer.Option("4", help="Smallest message."),
    max_bytes: str = typer.Option("16M", help="Largest message."),
    factor: int = typer.Option(4, help="Size multiplier between points."),
    iters: int = typer.Option(20, help="Timed iterations per point."),
    algorithms: str = typer.Option("ring,tree,halving_doubling,pipelined_tree,naive",
                                   help="All-reduce algorithms to set beside the prediction."),
) -> None:
    """Measure alpha, bandwidth, memcpy and matmul; write a hardware profile; compare."""
    from paratrain.bench import calibrate as cal
    from paratrain.bench.collectives import parse_bytes, sizes_pow2
    from paratrain.comm.algorithms import ALGORITHMS

    algs = list(_split(algorithms) or ())
    for a in algs:
        if a not in ALGORITHMS["all_reduce"]:
            raise ValueError(f"--algorithms {a!r}; all_reduce has {ALGORITHMS['all_reduce']}")
    if iters < 1:
        raise ValueError(f"--iters {iters}: need at least 1")
    sizes = sizes_pow2(parse_bytes(min_bytes), parse_bytes(max_bytes), factor)
    if len(sizes) < 2:
        raise ValueError(f"sizes {min_bytes}..{max_bytes} give {len(sizes)} point; need >= 2")
    _, report = cal.run(nproc, sizes, iters, out or cal.DEFAULT_PROFILE, algs)
    print(report)
