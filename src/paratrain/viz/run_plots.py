"""Charts of one finished run (``RUN_DIR/metrics.jsonl`` + ``summary.json``) for
`paratrain report`: each function returns PNG bytes, so the page can embed them.

- :func:`plot_losses`: train and validation loss per step against the unigram baseline
  (the loss of a model that ignores context: below it, the model uses its context).
- :func:`plot_speed`: tokens/s and MFU per step (two panels sharing the step axis).
- :func:`plot_step_split`: each step's wall time stacked as compute, exposed
  communication and pipeline bubble (bubble = the step's measured bubble fraction times
  its compute time, for pipeline runs; exposed comm = the wait on gradient
  communication after backward), with the prediction's step time as a line.
- :func:`plot_memory`: memory per rank by kind, measured (solid) beside predicted
  (hatched).

No torch import: matplotlib (Agg) only.
"""

from __future__ import annotations

import io

from paratrain.viz import pyplot

MB = 1e6
_KINDS = (("params", "parameters", "#4C72B0"), ("grads", "gradients", "#55A868"),
          ("optimizer", "optimizer state", "#C44E52"),
          ("comm_buffers", "comm buffers", "#CCB974"),
          ("activations_peak", "activations (peak)", "#8172B2"))


def _steps_axis(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_xlabel("optimizer step")


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    pyplot().close(fig)
    return buf.getvalue()


def plot_losses(recs: list[dict], summary: dict) -> bytes:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    steps = [r["step"] for r in recs]
    ax.plot(steps, [r["loss"] for r in recs], color="#4C72B0", lw=1.5, label="train loss")
    val = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
    if val:
        vs, vl = zip(*val, strict=True)
        ax.plot(vs, vl, "o-", color="#DD8452", ms=5, lw=1.5, label="validation loss")
    base = summary.get("unigram_entropy")
    if base is not None:
        ax.axhline(base, color="#555555", ls="--", lw=1.2,
                   label=f"unigram baseline {base:.3f}")
    _steps_axis(ax)
    ax.set_ylabel("loss (nats per token)")
    ax.set_title("Loss: below the dashed line the model uses its context", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9)
    fig.tight_layout()
    return _png(fig)


def plot_speed(recs: list[dict]) -> bytes:
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(8, 4.6), sharex=True)
    steps = [r["step"] for r in recs]
    a1.plot(steps, [r["tokens_per_s"] for r in recs], "o-", ms=3, color="#4C72B0")
    a1.set_ylabel("tokens / s")
    a1.set_title("Throughput and model FLOPs utilisation per step (first step pays "
                 "warm-up)", fontsize=10)
    mfu = [100 * r["mfu"] if r.get("mfu") == r.get("mfu") else float("nan") for r in recs]
    a2.plot(steps, mfu, "o-", ms=3, color="#55A868")
    a2.set_ylabel("MFU (%)")
    a2.set_ylim(bottom=0)
    _steps_axis(a2)
    for a in (a1, a2):
        a.grid(alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def step_split(recs: list[dict], summary: dict) -> list[tuple[float, float, float]]:
    """(compute, exposed comm, bubble) seconds per record. The pipeline's per-step bubble
    fractions are matched to the last records (a resumed run logs earlier steps too)."""
    pipe = (summary.get("model_parallel") or {}).get("pipeline") or {}
    fracs = pipe.get("bubble_measured_per_step") or []
    pad = [0.0] * max(0, len(recs) - len(fracs)) + list(fracs[-len(recs):] if recs else [])
    out = []
    for r, f in zip(recs, pad, strict=True):
        compute = r.get("compute_s", r["step_s"] - r.get("comm_s", 0.0))
        out.append((compute * (1 - f), r.get("comm_s", 0.0), compute * f))
    return out


def plot_step_split(recs: list[dict], summary: dict) -> bytes:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    steps = [r["step"] for r in recs]
    parts = step_split(recs, summary)
    bottom = [0.0] * len(recs)
    for j, (name, color) in enumerate((("compute", "#4C72B0"),
                                       ("exposed communication", "#C44E52"),
                                       ("pipeline bubble", "#BBBBBB"))):
        vals = [p[j] for p in parts]
        ax.bar(steps, vals, bottom=bottom, color=color, label=name, width=0.8)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    pred = (summary.get("prediction") or {}).get("predicted") or {}
    if "step_s" in pred:
        ax.axhline(pred["step_s"], color="black", ls="--", lw=1.2,
                   label=f"predicted {pred['step_s']:.3g} s")
    _steps_axis(ax)
    ax.set_ylabel("seconds")
    ax.set_title("Step time: compute, exposed communication, pipeline bubble", fontsize=10)
    ax.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4,
              frameon=False)
    fig.tight_layout()
    return _png(fig)


def memory_rows(summary: dict) -> tuple[list[dict], list[dict]]:
    """(measured, predicted) bytes per rank by kind. Predicted model states per rank come
    from the prediction's exact layout when the run has one, else the systems formula
    (the busiest rank's) for every rank; activations from the memory report."""
    mem = summary.get("memory") or {}
    measured = mem.get("measured_per_rank") or []
    base = mem.get("predicted_per_rank") or {}
    exact = ((summary.get("prediction") or {}).get("predicted") or {}).get(
        "states_bytes_per_rank") or []
    predicted = []
    for r in range(len(measured)):
        row = dict(base)
        if r < len(exact):
            row.update(exact[r])
        predicted.append(row)
    return measured, predicted


def plot_memory(summary: dict) -> bytes:
    plt = pyplot()
    measured, predicted = memory_rows(summary)
    n = len(measured)
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 + 1.4 * n), 4.2))
    w = 0.38
    for which, rows, dx, hatch in (("measured", measured, -w / 2, None),
                                   ("predicted", predicted, w / 2, "//")):
        bottom = [0.0] * n
        for key, name, color in _KINDS:
            vals = [row.get(key, 0.0) / MB for row in rows]
            ax.bar([i + dx for i in range(n)], vals, w, bottom=bottom, color=color,
                   hatch=hatch, edgecolor="white" if hatch else color,
                   label=name if which == "measured" else None)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        for i, b in enumerate(bottom):
            ax.text(i + dx, b, f"{b:.2f}", ha="center", va="bottom", fontsize=8)
    from matplotlib.patches import Patch

    handles, _ = ax.get_legend_handles_labels()
    handles += [Patch(facecolor="#DDDDDD", label="left: measured"),
                Patch(facecolor="#DDDDDD", hatch="//", edgecolor="white",
                      label="right: predicted")]
    ax.set_xticks(range(n), [f"rank {r}" for r in range(n)])
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_ylabel("MB")
    ax.set_title("Memory per rank: measured (solid) vs predicted (hatched)\n"
                 "(predicted activations: the busiest rank's, on every rank)", fontsize=10)
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    top = max([0.0] + [sum(r.get(k, 0.0) for k, _, _ in _KINDS) / MB
                       for r in measured + predicted])
    ax.set_ylim(0, top * 1.15 or 1.0)
    fig.tight_layout()
    return _png(fig)
