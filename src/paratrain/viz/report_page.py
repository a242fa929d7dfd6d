"""`paratrain report RUN_DIR`: one self-contained HTML page about a finished run
(docs/report.md).

Why one file with everything inside: it can be mailed, attached to an issue or opened
from a laptop with no network and no paratrain installed. Plots are PNGs embedded as
base64 ``data:`` URIs (:mod:`paratrain.viz.run_plots`); there is no script, stylesheet
or font from elsewhere.

Reads what ``paratrain train`` leaves in its run directory: ``metrics.jsonl`` (one record
per step: loss, val_loss, lr, grad_norm, tokens_per_s, step_s, compute_s, comm_s, mfu,
peak_flops, mem_bytes) and ``summary.json`` (plan, baseline, memory per rank measured
and predicted, pipeline bubble, the prediction). A run stopped before its summary still
gets its curves; the page says what is missing.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

_CSS = """
body { font-family: sans-serif; max-width: 980px; margin: 2em auto; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; } td { padding: 2px 14px 2px 0; vertical-align: top; }
td:first-child { color: #555; }
pre { background: #f4f4f4; padding: 10px; overflow-x: auto; font-size: 12px; }
img { max-width: 100%; border: 1px solid #ddd; }
.note { color: #8a4b00; }
"""


def read_run(run_dir: str | Path) -> tuple[list[dict], dict | None]:
    """(records, summary or None) of a run directory; ValueError when it holds none."""
    d = Path(run_dir)
    path = d / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{str(path)!r} does not exist; pass the --run-dir of a "
                         "`paratrain train` run")
    recs = []
    for line in path.read_text(errors="replace").splitlines():  # bad bytes: a bad line
        try:
            recs.append(json.loads(line))
        except ValueError:  # a torn last line from a killed run
            continue
    if not recs:
        raise ValueError(f"{str(path)!r} holds no steps; train for at least one step")
    s = d / "summary.json"
    if not s.is_file():
        return recs, None
    try:
        summary = json.loads(s.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{str(s)!r} is not a run summary ({str(e).splitlines()[0]}); "
                         "rerun the training, or remove it to get the curves only") from None
    if not isinstance(summary, dict):
        raise ValueError(f"{str(s)!r} is not a run summary (a JSON object); rerun the "
                         "training, or remove it to get the curves only")
    return recs, summary


def _img(png: bytes, alt: str) -> str:
    return (f'<img alt="{html.escape(alt)}" '
            f'src="data:image/png;base64,{base64.b64encode(png).decode()}">')


def _facts(recs: list[dict], s: dict) -> list[tuple[str, str]]:
    from paratrain.run.summary import mean_label

    plan = s.get("plan", {})
    layout = ", ".join(f"{k}={plan[k]}" for k in ("dp", "tp", "pp", "cp", "ep", "zero")
                       if k in plan)
    return [
        ("processes / plan", f"{s.get('world_size')} / {layout}"),
        ("parameters", f"{s.get('params', 0):,}"),
        ("tokens per step", f"{s.get('tokens_per_step', 0):,}"),
        ("steps", f"{len(recs)} logged (last {recs[-1]['step']})"),
        ("final train loss", f"{s['final_loss']:.4f}"),
        ("validation loss", f"{s['val_loss']:.4f}"),
        ("unigram baseline", f"{s['unigram_entropy']:.4f} (context-free model)"),
        ("tokens/s", f"{s['tokens_per_s']:,.0f} ({mean_label(s)})"),
        ("MFU", f"{100 * s['mfu']:.2f}% ({mean_label(s)}) of "
                f"{s['peak_flops_per_rank'] / 1e9:.1f} GFLOP/s per rank, the matmul peak "
                "measured once before training (every step's MFU divides by it)"),
        ("s/step", f"{s['step_s']:.4f} = compute {s['compute_s_per_step']:.4f} + exposed "
                   f"communication {s['comm_s_per_step']:.4f}"),
    ]


def build_html(recs: list[dict], s: dict | None, title: str) -> str:
    """The page (a string): summary facts, four charts, the prediction block."""
    from paratrain.viz import run_plots as rp

    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
             f"</title><style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"]
    summary = s or {}
    if s is None:
        parts.append("<p class='note'>summary.json is missing (the run stopped before its "
                     "end): curves only.</p>")
    else:
        rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>"
                       for k, v in _facts(recs, s))
        parts.append(f"<table>{rows}</table>")
    parts += ["<h2>Loss</h2>", _img(rp.plot_losses(recs, summary), "loss curves"),
              "<h2>Throughput and MFU</h2>", _img(rp.plot_speed(recs), "tokens/s and MFU"),
              "<h2>Where each step's time went</h2>",
              _img(rp.plot_step_split(recs, summary), "step time split")]
    if s is not None and (s.get("memory") or {}).get("measured_per_rank"):
        parts += ["<h2>Memory per rank</h2>", _img(rp.plot_memory(s), "memory per rank")]
    if s is not None:
        from paratrain.predict import format_prediction

        parts += ["<h2>Prediction beside measurement</h2>",
                  f"<pre>{html.escape(format_prediction(s.get('prediction')))}</pre>"]
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write ``RUN_DIR/report.html`` (or ``out``); return its path."""
    from paratrain.files.outputs import check_writable_file

    recs, s = read_run(run_dir)
    path = Path(out) if out else Path(run_dir) / "report.html"
    check_writable_file("--out" if out else "the report", path, make_parents=True,
                        fix="pass a writable path" if out else "pass --out FILE elsewhere")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(build_html(recs, s, f"paratrain run {Path(run_dir).resolve().name}"))
    return path


def register(app) -> None:
    import typer

    @app.command()
    def report(
        run_dir: str = typer.Argument(..., help="A --run-dir of `paratrain train`."),
        out: str = typer.Option(None, help="HTML file to write (default RUN_DIR/report.html)."),
    ) -> None:
        """One self-contained HTML page of a run: curves, speed, step split, memory,
        prediction."""
        print(f"wrote {write_report(run_dir, out)}")
