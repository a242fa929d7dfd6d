"""`paratrain plan` and `paratrain validate`.

Importing this module must not import torch or the systems model's heavier parts: the
commands import what they need inside their bodies. Bad names or layouts raise
``ValueError``; ``paratrain.cli.app.main`` prints it as one line and exits with code 2.

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
    cp_algorithm: str = typer.Option("ring", help="Context parallelism: ring (K/V pass "
                                                  "around the cp ring) or all-to-all."),
    experts: int = typer.Option(0, help="Routed experts per MoE layer (0: the catalogue "
                                        "model's own; makes a dense model MoE)."),
    top_k: int = typer.Option(2, help="With --experts: experts per token."),
    moe_ffn: int | None = typer.Option(None, help="With --experts: expert FFN width "
                                                  "(default: the model's d_ff)."),
    shared_experts: int = typer.Option(0, help="With --experts: always-on experts."),
    engine: str | None = typer.Option(None, help="Training engine whose overlap and "
                                                 "collectives the step model prices: "
                                                 "megatron, nemo, megascale, deepspeed, "
                                                 "fsdp, torchtitan or xla (default: "
                                                 "megatron; nemo for --search)."),
    explain: bool = typer.Option(False, "--explain", help="Show the step model's "
                                                         "breakdown: compute per GEMM class, "
                                                         "memory-bound work, each axis' "
                                                         "exposed communication, bubble."),
    reference: bool = typer.Option(False, "--reference", help="Price with docs/design.md's "
                                                             "reference model only (one eta, "
                                                             "flat ring); --search too."),
    params: str | None = typer.Option(None, help="Step-model parameters (default: the "
                                                 "shipped data/fitted.toml)."),
) -> PlanOutput:
    """Price a parallel plan: memory per GPU, wire bytes, step time, MFU (no GPU needed).

    With no flags: docs/design.md's reference example, LLaMA 2 7B on 64 H100, with its
    figures from the reference model, and beside them the step model's prediction.
    """
    from paratrain.cost.hardware import load_hardware
    from paratrain.cost.memory import ATTENTION
    from paratrain.plan import ParallelPlan
    from paratrain.systems.overlap import engine as find_engine
    from paratrain.systems.report import build_report, render

    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r} is unknown; choose flash or eager "
                         "(pass e.g. --attention flash)")
    m = _model(model, experts, top_k, moe_ffn, shared_experts)
    hw = load_hardware(hardware)
    if engine is None:
        from paratrain.systems.overlap import DEFAULT_ENGINE, SEARCH_ENGINE

        engine = SEARCH_ENGINE if search else DEFAULT_ENGINE
    eng = find_engine(engine)
    step_params = None
    if not reference:
        from paratrain.systems.fitting import load_params

        step_params = load_params(params)
    if gpus < 1:
        raise ValueError(f"gpus={gpus} must be >= 1; pass e.g. --gpus 64")
    if global_batch is not None:
        tokens = global_batch * seq_len
    if search:
        return _search(m, hw, gpus, tokens, seq_len, top, eta, json_out, plot, attention,
                       step_params, eng.name)
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
                     virtual_stages=virtual_stages, recompute=recompute, overlap=overlap,
                     cp_algorithm=cp_algorithm)
    p.check(m, world_size=gpus)
    if ep > 1 and (not m.is_moe or m.experts % ep):
        raise ValueError(f"ep={ep} needs an MoE model whose experts it divides (model has "
                         f"{m.experts}); pass --experts 8 or a catalogue MoE model")
    rep = build_report(m, hw, p, tokens, seq_len, eta=eta, precision=precision,
                       attention=attention)
    lines = []
    if step_params is not None:
        from paratrain.systems.explain import explain_lines
        from paratrain.systems.step_model import predict_step

        bd = predict_step(m, p, hw, tokens, seq_len, step_params, eng)
        rep["predicted"] = bd.as_dict()
        if explain:
            lines = explain_lines(bd)
            rep["predicted"]["explain"] = lines
    if json_out:
        import json

        print(json.dumps(rep, indent=2))
    else:
        render(rep)
        if "predicted" in rep:
            _render_predicted(rep["predicted"], lines)
    return PlanOutput("report", rep, f"{m.name} on {gpus} x {hw.name}")


def _model(name: str, experts: int, top_k: int, moe_ffn: int | None, shared: int):
    """The catalogue model, made MoE by ``--experts`` (every layer routed)."""
    from paratrain.cost.shapes import load_model

    m = load_model(name)
    if experts < 0:
        raise ValueError(f"experts={experts} must be >= 0; pass e.g. --experts 8")
    if not experts:
        return m
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k={top_k} must be in 1..experts={experts}; pass e.g. "
                         "--top-k 2")
    return m.replace(experts=experts, top_k=top_k, moe_ffn=moe_ffn, shared_experts=shared,
                     first_dense_layers=0, experts_over_tp=True)


def _render_predicted(pred: dict, lines: list[str]) -> None:
    from rich.console import Console

    con = Console()
    con.print(f"[bold]step model[/] (engine {pred['engine']}, fitted parameters): step "
              f"{pred['step_s']:.3g} s, MFU {100 * pred['mfu']:.1f} %, HFU "
              f"{100 * pred['hfu']:.1f} %")
    for line in lines:
        print(line)


def _search(m, hw, gpus, tokens, seq_len, top, eta, json_out, plot, attention,
            step_params, engine) -> PlanOutput:
    from paratrain.systems.search import candidate_record, explain, render_search, search

    if top < 1:
        raise ValueError(f"top={top} must be >= 1; pass e.g. --top 10")
    res = search(m, hw, gpus, tokens, seq_len, top=top, eta=eta, keep_points=bool(plot),
                 attention=attention, reference=step_params is None, params=step_params,
                 engine=engine)
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
    fit: bool = typer.Option(False, "--fit", help="Refit the step model's physical "
                                                  "parameters (least absolute relative "
                                                  "error); report in-table, leave-one-out "
                                                  "and held-out error."),
    out: str | None = typer.Option(None, help="With --fit: write the fitted values here "
                                              "(TOML)."),
    params: str | None = typer.Option(None, help="Fitted parameters to use (default: the "
                                                 "shipped data/fitted.toml)."),
    unfitted: bool = typer.Option(False, "--unfitted", help="Use the step model at its "
                                                            "parameters' provenance values."),
    reference: bool = typer.Option(False, "--reference", help="Use docs/design.md's "
                                                             "reference model (catalogue "
                                                             "eta, flat ring)."),
    holdout: str = typer.Option("", help="With --fit: comma-separated row ids kept out of "
                                         "the fit (default: the table's split=heldout "
                                         "rows)."),
    explain: str | None = typer.Option(None, help="Print one row's breakdown (compute per "
                                                  "GEMM class, memory-bound work, each "
                                                  "axis' exposed communication, bubble) "
                                                  "beside its reported figure."),
) -> None:
    """Score the systems model against published training runs (MFU / HFU / TFLOP/s)."""
    from paratrain.systems.validate import render_validate, run_validate

    if explain:
        _explain_row(runs, params, unfitted, explain, json_out)
        return
    ids = tuple(x.strip() for x in holdout.split(",") if x.strip()) or None
    res = run_validate(runs, params, unfitted, fit, ids, out, reference=reference)
    if json_out:
        import json

        print(json.dumps(res, indent=2))
    else:
        render_validate(res)


def _explain_row(runs, params, unfitted, row_id, json_out) -> None:
    from paratrain.systems.explain import explain_lines
    from paratrain.systems.fitting import _figure, breakdown, source_count
    from paratrain.systems.runs import Skip, read_runs, row_to_case
    from paratrain.systems.validate import UNFITTED, load_params

    rows = {r["id"]: r for r in read_runs(runs)}
    if row_id not in rows:
        raise ValueError(f"row {row_id!r} is not in the runs table; pass an id from its "
                         "'id' column")
    try:
        case = row_to_case(rows[row_id])
    except Skip as e:
        raise ValueError(f"row {row_id!r} cannot be priced: {e}") from None
    p = UNFITTED if unfitted else load_params(params)
    bd = breakdown(case, p)
    pred = _figure(case, bd)
    unit = (lambda x: f"{x:.1f} TFLOP/s") if case.metric == "tflops" else \
        (lambda x: f"{100 * x:.1f}%")
    rep = f"{case.metric} {unit(case.reported)}, predicted {unit(pred)} " \
          f"({100 * (pred / case.reported - 1):+.1f}%)"
    count = source_count(case)
    if case.model.flops_per_token(case.seq_len, count) != \
            case.model.flops_per_token(case.seq_len):
        rep += f", in the source's FLOP count ({count}, docs/systems-model.md)"
    lines = [f"{row_id}: {case.model.name} on {case.plan.world_size} x {case.hw.name}, "
             f"dp {case.plan.dp} tp {case.plan.tp} pp {case.plan.pp} cp {case.plan.cp} "
             f"ep {case.plan.ep}, ZeRO-{case.plan.zero}, {case.plan.micro_batches} "
             f"micro-batches, recompute {case.plan.recompute}"] + explain_lines(bd, rep)
    if json_out:
        import json

        print(json.dumps({"id": row_id, "metric": case.metric, "reported": case.reported,
                          "predicted": pred, "breakdown": bd.as_dict(), "lines": lines},
                         indent=2))
    else:
        for line in lines:
            print(line)


def register(app: typer.Typer, plotter: Plotter | None = None) -> None:
    """Add the systems-model commands to the top-level app; ``plotter`` draws `plan
    --plot` (without one, ``--plot`` is refused)."""
    app.command("plan")(with_plots(plan, plotter or _no_plotter))
    app.command("validate")(validate)
