"""Gantt chart of a pipeline schedule: ranks x time, one box per compute action.

Drawn from the very :class:`~paratrain.cost.schedule.PipelineSchedule` the runtime
executes: the predicted panel places each action at the time
:func:`~paratrain.cost.pipeline_sim.simulate_pipeline` gives it (F = 1, B = 2,
BI = BW = 1 per full stage, a chunk 1/v of that); white gaps are the bubble. With a
measured timeline (``RUN_DIR/pipeline_timeline.json``, written by ``paratrain train``
with ``--pp > 1``) a second panel draws the recorded start and end of every action of
the last step, in seconds, on the same rows.

Colours: forward blue, backward orange (input-gradient half of zero-bubble darker
orange), weight gradient green; chunks of interleaved and V-shaped schedules are lighter
shades, one legend entry per (action, chunk); labels are micro-batch numbers. The rows are
ranks whatever the placement, so a V schedule (chunk 1 of rank r is stage 2p-1-r) needs
no other drawing: the legend's title states the placement.

No torch import: matplotlib (Agg) and the pure schedule module only.
"""

from __future__ import annotations

import json
from pathlib import Path

COLOURS = {"F": "#4C72B0", "B": "#DD8452", "BI": "#C44E00", "BW": "#55A868"}


def _shade(hex_colour: str, chunk: int) -> tuple[float, float, float]:
    r, g, b = (int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5))
    f = min(0.6, 0.3 * chunk)
    return (r + (1 - r) * f, g + (1 - g) * f, b + (1 - b) * f)


_LEGEND_IN = 0.6  # inches under the panels for the legend

NAMES = {"F": "forward", "B": "backward", "BI": "backward (input grad)",
         "BW": "backward (weight grad)"}


def _legend(sched, Patch) -> list:
    """One patch per (kind, chunk) the schedule runs: the shading of interleaved chunks is
    explained, not left for the reader to guess."""
    kinds = sorted({a.kind for acts in sched.actions for a in acts if a.kind in COLOURS},
                   key=list(COLOURS).index)
    v = sched.virtual_stages
    return [Patch(facecolor=_shade(COLOURS[k], c), edgecolor="black", linewidth=0.4,
                  label=NAMES[k] + (f", chunk {c}" if v > 1 else ""))
            for k in kinds for c in range(v)]


def _draw(ax, rows: list[list[tuple[str, int, int, float, float]]], title: str,
          unit: str) -> None:
    from paratrain.viz.ink import ink

    for r, spans in enumerate(rows):
        size = 8 if len(spans) <= 40 else 6
        for kind, mb, chunk, t0, t1 in spans:
            fill = _shade(COLOURS[kind], chunk)
            ax.barh(r, t1 - t0, left=t0, height=0.8, color=fill, edgecolor="black",
                    linewidth=0.4)
            if len(spans) <= 96:  # white on the dark shades, black on the light ones
                ax.text((t0 + t1) / 2, r, str(mb), ha="center", va="center", fontsize=size,
                        color=ink(fill))
    ax.set_yticks(range(len(rows)), [f"rank {r}" for r in range(len(rows))])
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=9)


def draw_pipeline(name: str, pp: int, micro_batches: int, virtual_stages: int, out_dir: str,
                  measured: str | None = None) -> Path:
    """Write ``pipeline_<name>_p<pp>_m<m>[_v<v>].png`` under ``out_dir``; return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from paratrain.cost.pipeline_sim import simulate_pipeline
    from paratrain.cost.schedule import V_SHAPED, bubble_formula, build_schedule

    sched = build_schedule(name, pp, micro_batches, virtual_stages)
    tl = simulate_pipeline(sched)
    predicted = [[(a.kind, a.mb, a.chunk, t0, t1) for a, t0, t1 in spans] for spans in tl.spans]
    panels = [(predicted, f"{name}: p={pp} m={micro_batches} v={virtual_stages} — simulated "
               f"bubble {tl.bubble:.3f} (formula "
               f"{bubble_formula(name, pp, micro_batches, virtual_stages):.3f})",
               "time (units of one stage's forward)")]
    if measured is not None:
        path = Path(measured) / "pipeline_timeline.json"
        if not path.is_file():
            raise ValueError(f"{path} does not exist; train with --pp > 1 and --run-dir "
                             f"{measured} first")
        rec = json.loads(path.read_text())
        got = (rec["schedule"], rec["pp"], rec["micro_batches"], rec["virtual_stages"])
        if got != (name, pp, micro_batches, virtual_stages):
            raise ValueError(f"{path} records schedule/pp/m/v {got}; draw it with those flags")
        rows = [[tuple(s) for s in st] for st in rec["timeline"]]
        panels.append((rows, f"measured (last step): bubble {rec['bubble_measured']:.3f}",
                       "time (s)"))
    fig, axes = plt.subplots(len(panels), 1, squeeze=False,
                             figsize=(12, 1.0 + _LEGEND_IN + 0.55 * pp * len(panels)))
    for ax, (rows, title, unit) in zip(axes[:, 0], panels, strict=True):
        _draw(ax, rows, title, unit)
    handles = _legend(sched, Patch)
    fig.legend(handles=handles, loc="lower center", fontsize=8, ncols=min(6, len(handles)),
               title="box = one action of a micro-batch (its number inside)"
               + ("; lighter shade = a later model chunk on the rank"
                  if virtual_stages > 1 else "")
               + (f"; V placement: chunk 0 of rank r is stage r, chunk 1 stage {2 * pp - 1}-r"
                  if name in V_SHAPED else ""), title_fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, _LEGEND_IN / fig.get_figheight(), 1, 1))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    v = f"_v{virtual_stages}" if virtual_stages > 1 else ""
    path = out / f"pipeline_{name}_p{pp}_m{micro_batches}{v}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
