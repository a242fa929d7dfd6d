"""`paratrain validate`: score the systems model against published training runs.

The work is split by responsibility: :mod:`paratrain.systems.runs` reads the runs table
(``data/calibration.csv``) into priceable cases, :mod:`paratrain.systems.fitting` holds
the predictions, the error summary and the absolute-error fit; this module is the
command's body (:func:`run_validate`) and its table (:func:`render_validate`).

Models: the step model with the shipped fitted parameters (default), the same model at
its parameters' provenance values (``--unfitted``), or docs/design.md's reference model
(``--reference``). With ``--fit`` the parameters are refitted on the table's fit rows and
three errors are reported: leave-one-out over the fit rows (each row predicted by a fit
that never saw it), the held-out split (rows marked ``split=heldout`` in the table, or the
``--holdout`` ids), and in-table (every fit row under the full fit).
"""

from __future__ import annotations

from pathlib import Path

from paratrain.systems import runs as runs_table
from paratrain.systems.fitting import (
    FITTED,
    Params,
    fit,
    fit_with_errors,
    generation,
    leave_one_out,
    leave_source_out,
    load_params,
    predict,
    score,
    summarize,
    write_params,
)
from paratrain.systems.runs import (
    DEFAULT_RUNS,
    Case,
    Record,
    Skip,
    cases_and_skips,
    read_runs,
    row_to_case,
    source_key,
)
from paratrain.systems.step_params import SCALARS, StepParams

__all__ = ["DEFAULT_RUNS", "FITTED", "HOLDOUT", "UNFITTED", "Case", "Params", "Record",
           "Skip", "cases_and_skips", "fit", "fit_with_errors", "generation", "heldout_ids",
           "leave_one_out", "load_params", "params_dict", "predict", "read_runs",
           "render_validate", "row_to_case", "run_validate", "score", "source_key",
           "summarize", "write_params"]

# used only when the table has no ``split`` column
HOLDOUT = ("megascale_530b_megatronlm_11200", "bloom_176b", "glm_130b",
           "llama3_405b_16384_seq131072", "narayanan21_t1_1008.0B", "dgxc_gpt3_175b_2048")
UNFITTED = StepParams()


def params_dict(p: StepParams) -> dict:
    return p.as_dict()


def heldout_ids(rows: list[dict]) -> tuple[str, ...]:
    """The table's held-out split (``split`` column), else :data:`HOLDOUT`."""
    return runs_table.heldout_ids(rows) if rows and "split" in rows[0] else HOLDOUT


def run_validate(runs: str | None, params_path: str | None, unfitted: bool, do_fit: bool,
                 holdout: tuple[str, ...] | None, out: str | None, *,
                 reference: bool = False, loo: bool = True, by_source: bool = False) -> dict:
    """Everything `paratrain validate` reports, as one dict (``holdout`` None: the
    table's own split; ``by_source``: with the fit, also leave each source out in turn,
    :func:`~paratrain.systems.fitting.leave_source_out`)."""
    rows = read_runs(runs)
    cases, skips = cases_and_skips(rows)
    result: dict = {"runs": str(runs or DEFAULT_RUNS),
                    "model": "reference" if reference else "step"}
    if holdout is None:
        holdout = heldout_ids(rows)
    if do_fit:
        unknown = sorted(set(holdout) - {c.id for c in cases} - {s.id for s in skips})
        if unknown:
            raise ValueError(f"holdout id(s) {', '.join(unknown)} are not in the table; "
                             "pass ids from its 'id' column")
        train = [c for c in cases if c.id not in holdout]
        held = [c for c in cases if c.id in holdout]
        fitted = fit_with_errors(train)
        params = fitted.params
        result["fit"] = {"params": params_dict(params), "uncertainty": fitted.as_dict(),
                         "train_rows": len(train),
                         "n_params": len(fitted.fitted), "holdout_ids": [c.id for c in held],
                         "in_table": summarize(score(train, params))}
        if loo:
            recs = leave_one_out(train, params)
            result["fit"]["loo"] = summarize(recs)
            result["fit"]["loo_records"] = [r.as_dict() for r in recs]
        if held:
            result["fit"]["holdout"] = summarize(score(held, params))
        if by_source:
            recs = leave_source_out(train, cases, params)
            result["fit"]["by_source"] = summarize(recs)
            result["fit"]["by_source"]["median"] = _median([r.abs_pct_error for r in recs])
            result["fit"]["by_source_records"] = [r.as_dict() for r in recs]
        if out:
            f = result["fit"]
            prov = [
                "Fitted free parameters of the paratrain step model (systems/step_params.py",
                "gives each one's meaning, bound and provenance).",
                f"Written by `paratrain validate --fit` on {len(train)} rows of "
                f"{Path(runs).name if runs else 'calibration.csv'} (sources in that table),",
                f"holding out {len(held)} rows (the table's split=heldout).",
                f"In-table MAPE {f['in_table']['overall']['mape']:.2f}%"
                + (f"; leave-one-out MAPE {f['loo']['overall']['mape']:.2f}%" if loo else "")
                + (f"; held-out MAPE {f['holdout']['overall']['mape']:.2f}%." if held
                   else "."),
            ]
            result["fit"]["written"] = str(write_params(params, out, prov))
    elif unfitted:
        params = UNFITTED
    else:
        params = load_params(params_path)
    by_id = {c.id: c for c in cases}  # each record says what its case assumed
    records = [r.with_case(by_id[r.id]) for r in score(cases, params, reference)] + skips
    order = {r["id"]: i for i, r in enumerate(rows)}
    records.sort(key=lambda r: order.get(r.id, 0))
    result["params"] = params_dict(params)
    result["records"] = [r.as_dict() for r in records]
    result["summary"] = summarize(records)
    held = [r for r in records if r.id in holdout]
    if held:
        result["summary_heldout"] = summarize(held)
    return result


def _median(xs: list[float]) -> float | None:
    import statistics

    return statistics.median(xs) if xs else None


def _runs_name(runs: str) -> str:
    """The runs table as a title names it: the shipped one by its file name."""
    return f"shipped {Path(runs).name}" if Path(runs) == Path(DEFAULT_RUNS) else runs


def _skipped_lines(records: list[dict]) -> list[str]:
    """One line per reason a row was not priced, naming its rows (a reason is too long
    for a table cell at 80 columns, and many rows share one)."""
    by_reason: dict[str, list[str]] = {}
    for r in records:
        if r["skipped_reason"]:
            by_reason.setdefault(r["skipped_reason"], []).append(r["id"])
    return [f"skipped {len(ids)} row(s), {reason}: {', '.join(ids)}"
            for reason, ids in by_reason.items()]


def _summary_line(name: str, s: dict) -> str:
    if not s["n"]:
        return f"{name}: no priced rows"
    mae = [f"{s['mae_pp']:.2f} pp" if s["mae_pp"] is not None else "",
           f"{s['mae_tflops']:.1f} TFLOP/s" if s["mae_tflops"] is not None else ""]
    mae = " and ".join(x for x in mae if x)
    return f"{name}: n={s['n']}, MAPE {s['mape']:.2f}%" + (f", MAE {mae}" if mae else "")


def render_validate(res: dict, console=None) -> None:
    """The priced rows as a table that keeps every column at 80 columns (the id whole:
    `paratrain validate --explain ID` takes it), then the skipped rows by reason, the
    error summary and the parameters."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    con = console or Console()

    def fmt(metric, x):
        if x is None:
            return "-"
        return f"{x:.1f}" if metric == "tflops" else f"{100 * x:.1f}%"

    t = Table(title=f"Published runs: predicted vs reported ({_runs_name(res['runs'])}, "
                    f"{res['model']} model)", box=box.SIMPLE_HEAD, pad_edge=False,
              collapse_padding=True)
    for c in ("id", "metric", "reported", "predicted", "error %"):
        t.add_column(c, justify="left" if c == "id" else "right", no_wrap=True)
    for r in res["records"]:
        if not r["skipped_reason"]:
            t.add_row(r["id"], r["metric"], fmt(r["metric"], r["reported"]),
                      fmt(r["metric"], r["predicted"]), f"{r['abs_pct_error']:.1f}")
    con.print(t)
    for text in _skipped_lines(res["records"]):
        con.print(text, highlight=False)
    line = _summary_line

    con.print(line("overall", res["summary"]["overall"]))
    if "summary_heldout" in res:
        con.print(line("held-out rows", res["summary_heldout"]["overall"]))
    for src, s in res["summary"]["per_source"].items():
        con.print("  " + line(src, s))
    p = res["params"]
    if "uncertainty" in res.get("fit", {}):
        for text in _uncertainty_lines(res["fit"]["uncertainty"]):
            con.print(text, highlight=False, markup=False)  # [a100] is no markup
    elif res["model"] == "reference":
        con.print("parameters: docs/design.md's reference model (catalogue eta, flat ring)")
    else:
        con.print("parameters: gemm_eff " + ", ".join(f"{k} {v:.3f}" for k, v in
                                                       p["gemm_eff"].items())
                  + "; attn_eff " + ", ".join(f"{k} {v:.3f}" for k, v in
                                             p["attn_eff"].items())
                  + "".join(f"; {k} {p[k]:.3f}" for k in SCALARS if k != "kernel_s")
                  + f"; kernel {p['kernel_s'] * 1e6:.1f} us")
    if "fit" in res:
        f = res["fit"]
        con.print(f"[bold]fit[/] of {f['n_params']} parameters on {f['train_rows']} rows; "
                  + line("in-table", f["in_table"]["overall"]))
        if "loo" in f:
            con.print(line("leave-one-out", f["loo"]["overall"]))
        if "holdout" in f:
            con.print(line(f"held-out ({len(f['holdout_ids'])} rows)",
                           f["holdout"]["overall"]))
        if "by_source" in f:
            b = f["by_source"]
            con.print(line("each source left out of the fit", b["overall"])
                      + f", median {b['median']:.2f}%")
            for src, s in b["per_source"].items():
                con.print("  " + line(src, s))
        if "written" in f:
            con.print(f"wrote {f['written']}")


def _uncertainty_lines(u: dict) -> list[str]:
    """Each fitted parameter with its +/- (one standard deviation, from the fit's
    Jacobian), then which constants the rows pin down and which they do not."""
    def val(k, v):
        return f"{v * 1e6:.1f} us" if k == "kernel_s" else f"{v:.3f}"

    out = ["parameters (+/- one standard deviation, from the fit's Jacobian):"]
    for k, e in u["params"].items():
        side = f" (at its {e['bound']} bound)" if e["bound"] else ""
        if not e["fitted"]:
            note = "  not fitted (too few rows inform it)"
        elif e["sigma"] is None:
            note = f"  not pinned{side}"
        else:
            note = f" +/- {val(k, e['sigma'])}{side}"
        out.append(f"  {k:<15} {val(k, e['value'])}{note}")
    out.append("pinned by the runs: " + (", ".join(u["pinned"]) or "none"))
    if u["at_bound"]:
        out.append("pressed against a bound (the runs would take it outside its physical "
                   "range): " + ", ".join(u["at_bound"]))
    out.append("not pinned by the runs: " + (", ".join(u["not_pinned"]) or "none"))
    return out
