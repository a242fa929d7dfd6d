"""`paratrain viz ...` sub-commands (ring, tree, pipeline, moe, ring-attention)."""

import typer

app = typer.Typer(no_args_is_help=True)


@app.command()
def pipeline(
    schedule: str = typer.Option("1f1b", help="gpipe | 1f1b | interleaved | zb-h1 | zb-v | "
                                 "dualpipev."),
    pp: int = typer.Option(4, help="Pipeline ranks."),
    micro_batches: int = typer.Option(8, help="Micro-batches per step."),
    virtual_stages: int = typer.Option(1, help="Chunks per rank (interleaved; 2 for zb-v, "
                                       "dualpipev)."),
    measured: str = typer.Option(None, help="RUN_DIR of a --pp run: overlay its timings."),
    out: str = typer.Option("plots", help="Output directory."),
) -> None:
    """Gantt chart of a pipeline schedule (the one the runtime executes), bubbles visible."""
    from paratrain.viz.pipeline_gantt import draw_pipeline

    path = draw_pipeline(schedule, pp, micro_batches, virtual_stages, out, measured)
    print(f"wrote {path}")


@app.command()
def ring(
    p: int = typer.Option(4, help="Ranks in the ring."),
    op: str = typer.Option("all_reduce", help="all_reduce | reduce_scatter | all_gather | "
                                              "sparse_all_gather."),
    out: str = typer.Option("plots", help="Output directory."),
) -> None:
    """Frames (PNG) and a GIF of a ring collective: chunk ownership per rank per step."""
    from paratrain.comm.algorithms import build
    from paratrain.viz.collective_anim import draw

    if op not in ("all_reduce", "reduce_scatter", "all_gather", "sparse_all_gather"):
        raise ValueError(f"--op {op!r}; ring draws all_reduce, reduce_scatter, all_gather or "
                         "sparse_all_gather")
    if not 2 <= p <= 16:
        raise ValueError(f"--p {p}: draw between 2 and 16 ranks")
    pngs, gif = draw(build(op, "ring", p, p), out, f"ring_{op}_p{p}")
    print(f"wrote {len(pngs)} frames and {gif}")
    if op == "sparse_all_gather":  # its cost grows with p: drawn beside the frames
        from paratrain.viz.sparse_growth import draw_growth

        print(f"wrote {draw_growth(p, out)}")


@app.command()
def tree(
    p: int = typer.Option(4, help="Ranks in the tree."),
    algorithm: str = typer.Option("tree", help="tree (binomial) | pipelined_tree (double)."),
    segments: int = typer.Option(4, help="Segments of the pipelined tree."),
    out: str = typer.Option("plots", help="Output directory."),
) -> None:
    """Frames (PNG) and a GIF of a tree all-reduce: reduce up, broadcast down."""
    from paratrain.comm.algorithms import build
    from paratrain.viz.collective_anim import draw

    if algorithm not in ("tree", "pipelined_tree"):
        raise ValueError(f"--algorithm {algorithm!r}; use tree or pipelined_tree")
    if not 2 <= p <= 16:
        raise ValueError(f"--p {p}: draw between 2 and 16 ranks")
    s = build("all_reduce", algorithm, p, max(p, segments), segments=segments)
    pngs, gif = draw(s, out, f"{algorithm}_all_reduce_p{p}")
    print(f"wrote {len(pngs)} frames and {gif}")


@app.command()
def moe(
    run_dir: str = typer.Argument(..., help="RUN_DIR of an MoE `paratrain train` run."),
    out: str = typer.Option("plots", help="Output directory."),
) -> None:
    """Token routing of an MoE run: expert load over steps, imbalance, tokens per expert
    per rank, the all-to-all send matrix."""
    from paratrain.viz.moe import draw_moe

    print(f"wrote {draw_moe(run_dir, out)}")


@app.command("ring-attention")
def ring_attention(
    cp: int = typer.Option(4, help="Context-parallel ranks in the ring."),
    out: str = typer.Option("plots", help="Output directory."),
) -> None:
    """Frames (PNG) and a GIF of ring attention: blocks computed, skipped, in flight."""
    from paratrain.viz.ring_attention import draw

    pngs, gif = draw(cp, out)
    print(f"wrote {len(pngs)} frames and {gif}")
