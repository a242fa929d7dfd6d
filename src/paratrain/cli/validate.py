"""`paratrain validate`: score the systems model against published training runs.

Importing this module must not import torch or the systems model's heavier parts: the
command imports what it needs inside its body. Bad names raise ``ValueError``;
``paratrain.cli.app.main`` prints it as one line and exits with code 2.
"""

from __future__ import annotations

import typer


def validate(
    runs: str | None = typer.Option(None, help="CSV of published runs in the columns of "
                                               "calibration.csv (default: the shipped one)."),
    json_out: bool = typer.Option(False, "--json", help="Print records and summary as JSON."),
    fit: bool = typer.Option(False, "--fit", help="Refit the step model's physical "
                                                  "parameters (least absolute relative "
                                                  "error); report each one's +/- and "
                                                  "whether the runs pin it, and in-table, "
                                                  "leave-one-out and held-out error."),
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
    by_source: bool = typer.Option(False, "--by-source", help="With --fit: refit without "
                                                             "each source in turn and "
                                                             "predict its rows (the error "
                                                             "on a source the fit never "
                                                             "saw; a few minutes more)."),
    loo: bool = typer.Option(True, "--loo/--no-loo", help="With --fit: also refit without "
                                                       "each fit row in turn (leave-one-out: "
                                                       "most of the run's time, about 40 "
                                                       "minutes on the shipped table on 2 "
                                                       "cores; --fit --no-loo --by-source "
                                                       "takes under 4)."),
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
    if not loo and not fit:
        raise ValueError("--no-loo skips the fit's leave-one-out; add --fit (or drop "
                         "--no-loo)")
    if by_source and not fit:
        raise ValueError("--by-source refits without each source; add --fit (or drop "
                         "--by-source)")
    if out is not None:
        if not fit:
            raise ValueError("--out writes fitted parameters; add --fit (or drop --out)")
        from paratrain.files.outputs import check_writable_file

        check_writable_file("--out", out)  # before the fit, which takes minutes
    if params is not None:
        from paratrain.systems.fitting import load_params

        load_params(params)  # a bad --params file is refused before any work
    ids = tuple(x.strip() for x in holdout.split(",") if x.strip()) or None
    res = run_validate(runs, params, unfitted, fit, ids, out, reference=reference,
                       loo=loo, by_source=by_source)
    if json_out:
        import json

        print(json.dumps(res, indent=2))
    else:
        render_validate(res)


def _explain_row(runs, params, unfitted, row_id, json_out) -> None:
    from paratrain.systems.explain import case_lines, explain_lines
    from paratrain.systems.fitting import _figure, breakdown, source_count
    from paratrain.systems.partial_recompute import recompute_words
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
             f"micro-batches, recompute {recompute_words(case)}"] + case_lines(case) + \
        explain_lines(bd, rep)
    if json_out:
        import json

        print(json.dumps({"id": row_id, "metric": case.metric, "reported": case.reported,
                          "predicted": pred, "engine": case.engine,
                          "engine_why": case.engine_why,
                          "defaults": [{"field": f, "value": v, "why": w}
                                       for f, v, w in case.defaults],
                          "breakdown": bd.as_dict(), "lines": lines},
                         indent=2))
    else:
        for line in lines:
            print(line)


def register(app: typer.Typer) -> None:
    app.command("validate")(validate)
