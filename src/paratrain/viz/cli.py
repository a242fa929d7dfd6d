"""`paratrain viz ...` sub-commands (ring, tree, pipeline)."""

import typer

app = typer.Typer(no_args_is_help=True)


@app.command()
def pipeline(
    schedule: str = typer.Option("1f1b", help="gpipe | 1f1b | interleaved | zb-h1."),
    pp: int = typer.Option(4, help="Pipeline ranks."),
    micro_batches: int = typer.Option(8, help="Micro-batches per step."),
    virtual_stages: int = typer.Option(1, help="Chunks per rank (interleaved)."),
    measured: str = typer.Option(None, help="RUN_DIR of a --pp run: overlay its timings."),
    out: str = typer.Option("plots", help="Output directory."),
) -> None:
    """Gantt chart of a pipeline schedule (the one the runtime executes), bubbles visible."""
    from paratrain.viz.pipeline_gantt import draw_pipeline

    path = draw_pipeline(schedule, pp, micro_batches, virtual_stages, out, measured)
    print(f"wrote {path}")
