"""`paratrain validate`: score the systems model against published training runs.

The work is split by responsibility: :mod:`paratrain.systems.runs` reads the runs table
(``data/calibration.csv``) into priceable cases, :mod:`paratrain.systems.fitting` holds
the free parameters, the predictions, the error summary and the least-squares fit; this
module is the command's body (:func:`run_validate`) and its table (:func:`render_validate`).
The names tests and other modules import from here are re-exported below.
"""

from __future__ import annotations

from pathlib import Path

from paratrain.systems.fitting import (
    BOUNDS,
    FITTED,
    SCALARS,
    Params,
    fit,
    generation,
    leave_one_out,
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
from paratrain.systems.step_time import OVERLAP_FRACTION

__all__ = ["BOUNDS", "DEFAULT_RUNS", "FITTED", "HOLDOUT", "SCALARS", "UNFITTED", "Case",
           "Params", "Record", "Skip", "cases_and_skips", "fit", "generation",
           "leave_one_out", "load_params", "params_dict", "predict", "read_runs",
           "render_validate", "row_to_case", "run_validate", "score", "source_key",
           "summarize", "write_params"]

HOLDOUT = ("megascale_530b_megatronlm_11200", "bloom_176b", "glm_130b",
           "llama3_405b_16384_seq131072", "narayanan21_t1_1008.0B", "dgxc_gpt3_175b_2048")
UNFITTED = Params(eta={}, bw_eff=1.0, overlap_fraction=OVERLAP_FRACTION, overhead_width=0.0,
                  dp_algorithm="ring")


def params_dict(p: Params) -> dict:
    return {"eta": dict(p.eta), "bw_eff": p.bw_eff, "overlap_fraction": p.overlap_fraction,
            "overhead_width": p.overhead_width, "dp_algorithm": p.dp_algorithm}


def run_validate(runs: str | None, params_path: str | None, unfitted: bool, do_fit: bool,
                 holdout: tuple[str, ...], out: str | None) -> dict:
    """Everything `paratrain validate` reports, as one dict."""
    rows = read_runs(runs)
    cases, skips = cases_and_skips(rows)
    result: dict = {"runs": str(runs or DEFAULT_RUNS)}
    if do_fit:
        unknown = sorted(set(holdout) - {c.id for c in cases} - {s.id for s in skips})
        if unknown:
            raise ValueError(f"holdout id(s) {', '.join(unknown)} are not in the table; "
                             "pass ids from its 'id' column")
        train = [c for c in cases if c.id not in holdout]
        held = [c for c in cases if c.id in holdout]
        params = fit(train)
        loo = leave_one_out(train, params)
        result["fit"] = {"params": params_dict(params), "train_rows": len(train),
                         "loo": summarize(loo), "loo_records": [r.as_dict() for r in loo],
                         "holdout_ids": [c.id for c in held]}
        if held:
            h = score(held, params)
            result["fit"]["holdout"] = summarize(h)
        if out:
            prov = [
                "Fitted free parameters of the paratrain systems model.",
                f"Written by `paratrain validate --fit` on {len(train)} rows of "
                f"{Path(runs).name if runs else 'calibration.csv'} (sources in that table),",
                f"holding out: {', '.join(c.id for c in held) or 'none'}.",
                f"Leave-one-out MAPE {result['fit']['loo']['overall']['mape']:.2f}% on the "
                "fitted rows"
                + (f"; held-out MAPE {result['fit']['holdout']['overall']['mape']:.2f}%."
                   if held else "."),
                "eta: dense matmul efficiency per accelerator generation; bw_eff: achieved /",
                "nominal link bandwidth; overlap_fraction: compute share that hides the",
                "data-parallel sync; overhead_width h0: compute time x (1 + h0 / d_model).",
            ]
            result["fit"]["written"] = str(write_params(params, out, prov))
    elif unfitted:
        params = UNFITTED
    else:
        params = load_params(params_path)
    records = score(cases, params) + skips
    order = {r["id"]: i for i, r in enumerate(rows)}
    records.sort(key=lambda r: order.get(r.id, 0))
    result["params"] = params_dict(params)
    result["records"] = [r.as_dict() for r in records]
    result["summary"] = summarize(records)
    return result


def render_validate(res: dict, console=None) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    con = console or Console()

    def fmt(metric, x):
        if x is None:
            return "-"
        return f"{x:.1f}" if metric == "tflops" else f"{100 * x:.1f}%"

    t = Table(title=f"Published runs: predicted vs reported ({res['runs']})",
              box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for c in ("id", "metric", "reported", "predicted", "error %"):
        t.add_column(c, justify="left" if c == "id" else "right", no_wrap=c != "id")
    for r in res["records"]:
        if r["skipped_reason"]:
            t.add_row(r["id"], "-", "-", "-", f"skipped: {r['skipped_reason']}")
            continue
        t.add_row(r["id"], r["metric"], fmt(r["metric"], r["reported"]),
                  fmt(r["metric"], r["predicted"]), f"{r['abs_pct_error']:.1f}")
    con.print(t)

    def line(name, s):
        mae = f"MAE {s['mae_pp']:.2f} pp" if s["mae_pp"] is not None else ""
        if s["mae_tflops"] is not None:
            mae += f" {s['mae_tflops']:.1f} TFLOP/s"
        return f"{name}: n={s['n']}, MAPE {s['mape']:.2f}%, {mae}" if s["n"] else \
            f"{name}: no priced rows"

    con.print(line("overall", res["summary"]["overall"]))
    for src, s in res["summary"]["per_source"].items():
        con.print("  " + line(src, s))
    p = res["params"]
    con.print("parameters: eta " + ", ".join(f"{k} {v:.3f}" for k, v in p["eta"].items())
              + f"; bw_eff {p['bw_eff']:.3f}; overlap_fraction {p['overlap_fraction']:.3f}; "
              f"overhead_width {p['overhead_width']:.0f}; dp sync {p['dp_algorithm']}")
    if "fit" in res:
        f = res["fit"]
        con.print(f"[bold]fit[/] on {f['train_rows']} rows; "
                  + line("leave-one-out", f["loo"]["overall"]))
        if "holdout" in f:
            con.print(f"held out ({', '.join(f['holdout_ids'])}): "
                      + line("held-out", f["holdout"]["overall"]))
        if "written" in f:
            con.print(f"wrote {f['written']}")
