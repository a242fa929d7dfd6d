"""Charts of a `paratrain plan` report (matplotlib, Agg backend, written as PNG files).

- ``memory.png``: memory per GPU for each ZeRO stage, stacked by component (weights,
  gradients, optimizer state, activations, ZeRO-3 buffers) against the HBM line.
- ``step_time.png``: the step split into compute, pipeline bubble and exposed
  communication, waiting for the sync versus overlapping it.
"""

from __future__ import annotations

from pathlib import Path

GB = 1e9
_MEM_PARTS = (("weights_bytes", "weights", "#4C72B0"), ("grads_bytes", "gradients", "#55A868"),
              ("optimizer_bytes", "optimizer state", "#C44E52"),
              ("activations_bytes", "activations", "#8172B2"),
              ("buffers_bytes", "ZeRO-3 buffers", "#CCB974"))


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_memory(rep: dict, path: str | Path) -> Path:
    """Stacked bar of memory per GPU by component for ZeRO 0-3 against the HBM line."""
    plt = _plt()
    rows = rep["zero"]
    labels = ["no sharding", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    bottom = [0.0] * len(rows)
    for key, name, color in _MEM_PARTS:
        vals = [r[key] / GB for r in rows]
        ax.bar(labels, vals, bottom=bottom, label=name, color=color)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    hbm = rep["hardware"]["hbm_bytes"] / GB
    ax.axhline(hbm, color="black", linestyle="--", linewidth=1.2)
    ax.text(-0.45, hbm, f"HBM {hbm:.0f} GB", va="bottom", ha="left", fontsize=9)
    for i, r in enumerate(rows):
        ax.text(i, bottom[i], f"{r['total_bytes'] / GB:.1f}", ha="center", va="bottom",
                fontsize=9)
    pl = rep["plan"]
    ax.set_ylabel("GB per GPU")
    ax.set_title(f"{rep['model']['name']} on {pl['gpus']} x {rep['hardware']['name']}: "
                 f"memory per GPU (dp {pl['dp']}, tp {pl['tp']}, pp {pl['pp']})", fontsize=10)
    top = max(max(bottom), hbm)
    if max(bottom) > 20 * hbm:
        ax.set_yscale("log")
        ax.set_ylim(top=top * 3)
    else:
        ax.set_ylim(0, top * 1.12)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_step_time(rep: dict, path: str | Path) -> Path:
    """Horizontal bars: compute, bubble and exposed communication, sync vs overlapped."""
    plt = _plt()
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
    ax.set_xlim(0, max(sum(p) for p in bars.values()) * 1.35)
    ax.set_title(f"{rep['model']['name']}: step time on {rep['plan']['gpus']} GPUs",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=3)
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
    :class:`paratrain.systems.cli.PlanOutput`): memory and step time for a priced plan,
    the Pareto front for a search."""
    if out.kind == "search":
        return [plot_pareto(out.data, out_dir, out.title)]
    return write_plan_plots(out.data, out_dir)


def plot_pareto(result, out_dir: str | Path, title: str) -> Path:
    """Step time vs memory per GPU of every fitting layout of a search, Pareto front marked
    (``result`` is a :class:`paratrain.systems.search.SearchResult`)."""
    plt = _plt()
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
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
               color="#4C72B0", zorder=3, label="fastest")
    ax.set_xlabel("predicted step time (s)")
    ax.set_ylabel("memory per GPU (GB)")
    ax.set_xscale("log")
    ax.set_title(f"{title}: {result.fitting:,} layouts that fit", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = d / "search_pareto.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
