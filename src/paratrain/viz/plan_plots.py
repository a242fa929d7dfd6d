"""Charts of a `paratrain plan` report (matplotlib, Agg backend, written as PNG files).

- ``memory.png``: memory per GPU for each ZeRO stage, stacked by component: the model
  states on their own panel (the ZeRO story), everything (activations, ZeRO-3 buffers
  too) beside it against the HBM line.
- ``step_time.png``: the step split into compute, pipeline bubble and exposed
  communication, waiting for the sync versus overlapping it.
"""

from __future__ import annotations

from pathlib import Path

from paratrain.viz import pyplot

GB = 1e9
_MEM_PARTS = (("weights_bytes", "weights", "#4C72B0"), ("grads_bytes", "gradients", "#55A868"),
              ("optimizer_bytes", "optimizer state", "#C44E52"),
              ("activations_bytes", "activations", "#8172B2"),
              ("buffers_bytes", "ZeRO-3 buffers", "#CCB974"))


def memory_figure(rep: dict):
    """Two panels, so the activations of a long sequence cannot flatten the ZeRO story:
    left, the model states alone (weights + gradients + optimizer state) on their own
    scale, each stage's total under its bar; right, everything per GPU against the HBM
    line (named in the legend, so it never sits on a bar)."""
    plt = pyplot()
    from matplotlib.lines import Line2D

    rows = rep["zero"]
    labels = ["no sharding", "ZeRO-1", "ZeRO-2", "ZeRO-3"][:len(rows)]
    fig, (ax_s, ax_t) = plt.subplots(1, 2, figsize=(12, 4.8),
                                     gridspec_kw={"width_ratios": (1, 1)})
    hbm = rep["hardware"]["hbm_bytes"] / GB
    for ax, parts, title in ((ax_s, _MEM_PARTS[:3], "model states per GPU"),
                             (ax_t, _MEM_PARTS, "everything per GPU")):
        bottom = [0.0] * len(rows)
        for key, name, color in parts:
            vals = [r[key] / GB for r in rows]
            ax.bar(range(len(rows)), vals, bottom=bottom, label=name, color=color, width=0.6)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.set_xticks(range(len(rows)), [f"{lab}\n{b:.1f} GB" for lab, b
                                         in zip(labels, bottom, strict=True)], fontsize=9)
        ax.set_ylabel("GB per GPU")
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        if ax is ax_t:
            ax.axhline(hbm, color="black", linestyle="--", linewidth=1.2)
            top = max(max(bottom), hbm)
            if max(bottom) > 20 * hbm:
                ax.set_yscale("log")
                ax.set_ylim(top=top * 3)
            else:
                ax.set_ylim(0, top * 1.1)
        else:
            ax.set_ylim(0, max(bottom) * 1.1)
    handles, names = ax_t.get_legend_handles_labels()
    handles.append(Line2D([], [], color="black", linestyle="--", linewidth=1.2))
    names.append(f"HBM {hbm:.0f} GB")
    ax_t.legend(handles, names, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    first, last = rows[0]["states_bytes"] / GB, rows[-1]["states_bytes"] / GB
    pl = rep["plan"]
    fig.suptitle(f"{rep['model']['name']} on {pl['gpus']} x {rep['hardware']['name']} "
                 f"(dp {pl['dp']}, tp {pl['tp']}, pp {pl['pp']}): ZeRO takes model states "
                 f"from {first:.1f} to {last:.1f} GB per GPU", fontsize=10)
    fig.tight_layout()
    return fig


def plot_memory(rep: dict, path: str | Path) -> Path:
    """Write :func:`memory_figure` as a PNG."""
    fig = memory_figure(rep)
    out = Path(path)
    fig.savefig(out, dpi=120)
    pyplot().close(fig)
    return out


def plot_step_time(rep: dict, path: str | Path) -> Path:
    """Horizontal bars: compute, bubble and exposed communication, sync vs overlapped."""
    plt = pyplot()
    s = rep["step"]
    other = s["tp_comm_s"] + s["pp_comm_s"] + s["ep_comm_s"]
    bars = {
        "sync waits": (s["compute_s"], s["bubble_s"], s["dp_comm_s"] + s["cp_comm_s"] + other),
        "overlapped": (s["compute_s"], s["bubble_s"],
                       s["dp_exposed_s"] + s["cp_exposed_s"] + other),
    }
    fig, ax = plt.subplots(figsize=(7, 3.6))
    colors = ("#4C72B0", "#CCCCCC", "#C44E52")
    names = ("compute", "pipeline bubble", "exposed communication")
    for i, (label, parts) in enumerate(bars.items()):
        left = 0.0
        for j, v in enumerate(parts):
            ax.barh(i, v, left=left, color=colors[j], label=names[j] if i == 0 else None)
            left += v
        mfu = s["mfu_sync"] if label == "sync waits" else s["mfu_overlap"]
        ax.text(left, i, f" {left:.3g} s, MFU {100 * mfu:.1f}%", va="center", fontsize=9)
    ax.set_yticks(range(len(bars)), list(bars))
    ax.invert_yaxis()
    ax.set_xlabel("seconds per optimizer step")
    top = max(sum(p) for p in bars.values())
    if "predicted" in rep:  # the figure to trust, beside the reference model's bars
        pred = rep["predicted"]["step_s"]
        ax.axvline(pred, color="black", linestyle="--", linewidth=1.2,
                   label=f"prediction (step model): {pred:.3g} s")
        top = max(top, pred)
    ax.set_xlim(0, top * 1.35)
    ax.set_title(f"{rep['model']['name']}: step time on {rep['plan']['gpus']} GPUs "
                 "(bars: the reference model)", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=2)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def write_plan_plots(rep: dict, out_dir: str | Path) -> list[Path]:
    """Write memory.png and step_time.png into ``out_dir`` (created if missing)."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    return [plot_memory(rep, d / "memory.png"), plot_step_time(rep, d / "step_time.png")]


def write_plan_output(out, out_dir: str | Path) -> list[Path]:
    """The charts of one `paratrain plan` result (``out`` is a
    :class:`paratrain.cli.plan.PlanOutput`): memory and step time for a priced plan,
    the Pareto front for a search."""
    if out.kind == "search":
        return [plot_pareto(out.data, out_dir, out.title)]
    return write_plan_plots(out.data, out_dir)


def pareto_figure(result, title: str):
    """Step time vs memory per GPU of every fitting layout of a search, Pareto front marked
    (``result`` is a :class:`paratrain.systems.search.SearchResult`). The log time axis
    is labelled at 1, 2, 5 x 10^k in plain numbers (matplotlib's default labels every
    minor tick as 3x10^0, which overlap)."""
    plt = pyplot()
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, ax = plt.subplots(figsize=(8, 4.8))
    if result.points:
        t, mem = zip(*result.points, strict=True)
        ax.scatter(t, [x / GB for x in mem], s=4, alpha=0.3, color="#999999",
                   label="layouts that fit")
    front = result.pareto()
    if front:
        ft, fm = zip(*front, strict=True)
        ax.step(ft, [x / GB for x in fm], where="post", color="#C44E52", label="Pareto front")
        ax.scatter(ft, [x / GB for x in fm], s=14, color="#C44E52")
    best = result.top[0]
    ax.scatter([best.step_s], [best.memory.total_bytes / GB], s=80, marker="*",
               color="#4C72B0", zorder=3, label=f"fastest: {best.step_s:.3g} s")
    ax.set_xlabel("predicted step time (s, log scale)")
    ax.set_ylabel("memory per GPU (GB)")
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.grid(alpha=0.3, which="major")
    ax.set_title(f"{title}: {result.fitting:,} layouts that fit", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_pareto(result, out_dir: str | Path, title: str) -> Path:
    """Write :func:`pareto_figure` as ``search_pareto.png`` under ``out_dir``."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    fig = pareto_figure(result, title)
    out = d / "search_pareto.png"
    fig.savefig(out, dpi=120)
    pyplot().close(fig)
    return out
