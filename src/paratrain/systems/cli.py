"""`paratrain plan` and `paratrain validate`.

Importing this module must not import torch or the systems model's heavier parts: the
commands import what they need inside their bodies. Bad names or layouts raise
``ValueError``; ``paratrain.cli.main`` prints it as one line and exits with code 2.

The systems model draws nothing itself (the dependency runs viz -> systems only): `plan`
returns a :class:`PlanOutput`, and :func:`register` wraps the command with a ``plotter``
that the top-level CLI passes in (:func:`paratrain.viz.plan_plots.write_plan_output`),
which writes the charts when ``--plot DIR`` is given.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import typer

DEFAULT_TOKENS = 1_048_576


class PlanOutput(NamedTuple):
    """What `paratrain plan` priced, for a plotter: ``kind`` "report" (``data`` is
    :func:`paratrain.systems.report.build_report`'s dict) or "search" (``data`` is a
    :class:`paratrain.systems.search.SearchResult`), with a chart title."""

    kind: str
    data: Any
    title: str


Plotter = Callable[[PlanOutput, str], list[Path]]


def _holdout_default() -> tuple[str, ...]:
    from paratrain.systems.validate import HOLDOUT

    return HOLDOUT


def plan(
    model: str = typer.Option("llama2-7b", help="Catalogue model name or a .toml/.json file."),
    hardware: str = typer.Option("h100", help="Catalogue accelerator or a .toml/.json file."),
    gpus: int = typer.Option(64, help="Number of GPUs (accelerators)."),
    tokens: int = typer.Option(DEFAULT_TOKENS, "--tokens", "--tokens-per-step",
                               help="Global batch in tokens per optimizer step."),
    seq_len: int = typer.Option(4096, help="Sequence length in tokens."),
    dp: int | None = typer.Option(None, help="Data-parallel size (default: the GPUs "
                                                "left after tp, pp, cp)."),
    tp: int = typer.Option(1, help="Tensor-parallel size."),
    pp: int = typer.Option(1, help="Pipeline stages."),
    cp: int = typer.Option(1, help="Context-parallel size."),
    ep: int = typer.Option(1, help="Expert-parallel size (divides dp)."),
    zero: int = typer.Option(0, help="ZeRO stage 0-3 (3 = FSDP)."),
    sp: bool = typer.Option(False, "--sp", help="Sequence parallelism (needs tp > 1)."),
    micro_batches: int = typer.Option(1, help="Micro-batches (gradient accumulation at pp 1)."),
    schedule: str = typer.Option("1f1b", help="gpipe, 1f1b, interleaved or zb-h1."),
    virtual_stages: int = typer.Option(1, help="Chunks per stage (interleaved schedule)."),
    recompute: str = typer.Option("none", help="none, selective or full."),
    attention: str = typer.Option("flash", help="flash (a fused kernel: keeps no s x s "
                                                "scores) or eager (keeps them)."),
    overlap: bool = typer.Option(True, "--overlap/--no-overlap",
                                 help="Overlap gradient sync with backward."),
    eta: float | None = typer.Option(None, help="Matmul efficiency (default: the "
                                                   "hardware's, 0.473 for H100)."),
    precision: str = typer.Option("bf16-adam", help="bf16-adam (16 B/param) or fp32-adam."),
    json_out: bool = typer.Option(False, "--json", help="Print the numbers as JSON."),
    plot: str | None = typer.Option(None, help="Write memory and step-time PNGs to DIR "
                                                "(with --search: the Pareto front)."),
    search: bool = typer.Option(False, "--search", help="Search every layout that fits; "
                                                        "rank by predicted step time."),
    top: int = typer.Option(10, help="With --search: how many layouts to show."),
    global_batch: int | None = typer.Option(None, help="Global batch in sequences "
                                                       "(overrides --tokens)."),
    calibrated: bool = typer.Option(False, "--calibrated", help="Use the parameters fitted "
                                    "on published runs (paratrain validate) instead of "
                                    "docs/design.md's eta 0.473 and flat ring."),
) -> PlanOutput:
    """Price a parallel plan: memory per GPU, wire bytes, step time, MFU (no GPU needed).

    With no flags: docs/design.md's reference example, LLaMA 2 7B on 64 H100.
    """
    from paratrain.plan import ParallelPlan
    from paratrain.systems.hardware import load_hardware
    from paratrain.systems.memory import ATTENTION
    from paratrain.systems.models import load_model
    from paratrain.systems.report import build_report, render

    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r} is unknown; choose flash or eager "
                         "(pass e.g. --attention flash)")
    m = load_model(model)
    hw = load_hardware(hardware)
    step_kwargs = None
    if calibrated:
        from paratrain.systems.catalogue import lookup
        from paratrain.systems.validate import load_params

        fitted = load_params()
        hw = fitted.apply(lookup(hardware, "hardware.toml", "hardware")[0], hw)
        step_kwargs = fitted.step_kwargs()
    if gpus < 1:
        raise ValueError(f"gpus={gpus} must be >= 1; pass e.g. --gpus 64")
    if global_batch is not None:
        tokens = global_batch * seq_len
    if search:
        return _search(m, hw, gpus, tokens, seq_len, top, eta, json_out, plot, step_kwargs,
                       attention)
    if dp is None:
        rest = tp * pp * cp
        if rest < 1 or gpus % rest:
            raise ValueError(
                f"tp*pp*cp = {tp}*{pp}*{cp} = {rest} does not divide gpus={gpus}; "
                "choose sizes whose product divides the GPU count"
            )
        dp = gpus // rest
    p = ParallelPlan(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero, sp=sp,
                     micro_batches=micro_batches, schedule=schedule,
                     virtual_stages=virtual_stages, recompute=recompute, overlap=overlap)
    p.check(m, world_size=gpus)
    from paratrain.systems.step_time import OVERLAP_FRACTION

    kw = dict(step_kwargs or {})
    rep = build_report(m, hw, p, tokens, seq_len, eta=eta, precision=precision,
                       overlap_fraction=kw.pop("overlap_fraction", OVERLAP_FRACTION),
                       step_kwargs=kw, attention=attention)
    if json_out:
        import json

        print(json.dumps(rep, indent=2))
    else:
        render(rep)
    return PlanOutput("report", rep, f"{m.name} on {gpus} x {hw.name}")


def _search(m, hw, gpus, tokens, seq_len, top, eta, json_out, plot, step_kwargs,
            attention) -> PlanOutput:
    from paratrain.systems.search import candidate_record, explain, render_search, search

    if top < 1:
        raise ValueError(f"top={top} must be >= 1; pass e.g. --top 10")
    res = search(m, hw, gpus, tokens, seq_len, top=top, eta=eta, keep_points=bool(plot),
                 step_kwargs=step_kwargs, attention=attention)
    hw = hw if eta is None else hw.replace(eta=eta)
    lines = explain(res, m, hw)
    if json_out:
        import json

        print(json.dumps({"model": m.name, "hardware": hw.name, "gpus": gpus,
                          "tokens_per_step": tokens, "seq_len": seq_len,
                          "scored": res.scored, "fitting": res.fitting,
                          "elapsed_s": res.elapsed_s, "layouts_per_s": res.layouts_per_s,
                          "top": [candidate_record(c) for c in res.top], "why": lines},
                         indent=2))
    else:
        render_search(res, lines, f"{m.name} on {gpus} x {hw.name}, {tokens:,} tokens/step, "
                                  f"sequence {seq_len}: fastest layouts that fit")
    return PlanOutput("search", res, f"{m.name} on {gpus} x {hw.name}")


def with_plots(command: Callable[..., PlanOutput], plotter: Plotter) -> Callable[..., None]:
    """``command`` (same options, for typer) that then hands its result to ``plotter``
    when ``--plot DIR`` is given, printing each file written unless ``--json``."""
    @functools.wraps(command)
    def run(*args, **kwargs) -> None:
        out = command(*args, **kwargs)
        plot = kwargs.get("plot")
        if plot:
            for path in plotter(out, plot):
                if not kwargs.get("json_out"):
                    print(f"wrote {path}")

    return run


def _no_plotter(out: PlanOutput, out_dir: str) -> list[Path]:
    raise ValueError("--plot needs the plotting package; run through `paratrain plan`")


def validate(
    runs: str | None = typer.Option(None, help="CSV of published runs in the columns of "
                                               "calibration.csv (default: the shipped one)."),
    json_out: bool = typer.Option(False, "--json", help="Print records and summary as JSON."),
    fit: bool = typer.Option(False, "--fit", help="Fit eta, bandwidth efficiency, overlap "
                                                  "and overhead by least squares; report "
                                                  "leave-one-out and held-out error."),
    out: str | None = typer.Option(None, help="With --fit: write the fitted values here "
                                              "(TOML)."),
    params: str | None = typer.Option(None, help="Fitted parameters to use (default: the "
                                                 "shipped data/fitted.toml)."),
    unfitted: bool = typer.Option(False, "--unfitted", help="Use docs/design.md's raw model "
                                                            "(catalogue eta, flat ring)."),
    holdout: str = typer.Option(",".join(_holdout_default()),
                                help="With --fit: comma-separated row ids kept out of the fit."),
) -> None:
    """Score the systems model against published training runs (MFU / HFU / TFLOP/s)."""
    from paratrain.systems.validate import render_validate, run_validate

    ids = tuple(x.strip() for x in holdout.split(",") if x.strip())
    res = run_validate(runs, params, unfitted, fit, ids, out)
    if json_out:
        import json

        print(json.dumps(res, indent=2))
    else:
        render_validate(res)


def register(app: typer.Typer, plotter: Plotter | None = None) -> None:
    """Add the systems-model commands to the top-level app; ``plotter`` draws `plan
    --plot` (without one, ``--plot`` is refused)."""
    app.command("plan")(with_plots(plan, plotter or _no_plotter))
    app.command("validate")(validate)
