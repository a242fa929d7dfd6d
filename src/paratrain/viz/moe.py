"""Token routing of an MoE run: where the tokens went, what the all-to-all carried, and
how uneven it was (``paratrain viz moe RUN_DIR``).

Read from the run directory ``paratrain train`` writes: ``metrics.jsonl`` (per step
``moe_load``, the assignments each expert received summed over layers and ranks, and
``moe_load_by_rank``, the same per data rank: the tokens that rank routed) and
``summary.json`` (the plan: dp, ep). Four panels, one figure:

1. **Expert load over steps**: a heat map, experts x steps, of each expert's load over
   the mean load (1.0 = balanced; the colour scale is centred on 1).
2. **Imbalance over steps**: max / mean load (what sets an ep rank's expert compute),
   and, on a right-hand axis, the share of assignments dropped when a capacity factor
   is set.
3. **Tokens per expert per rank** at the most uneven step: for each expert a stacked
   bar, one colour per source data rank; the background bands mark the ep rank that
   holds the experts, so a band's bars are what that rank computes (the busiest band
   sets the step's pace).
4. **The all-to-all send matrix** (mean per step): row = source data rank, column =
   destination data rank, assignments sent in the dispatch (the combine sends the
   transpose back); the diagonal stays on the rank. A data rank d sends to the ep ranks
   of its own group (ranks ep * (d // ep) ... + ep - 1), so the matrix is block
   diagonal with ep x ep blocks. Each assignment is d_model values of the working dtype
   each way; with tp > 1 every tp rank of a data rank sends the same.

No torch import: matplotlib (Agg) and json only.
"""

from __future__ import annotations

import json
from pathlib import Path

from paratrain.viz import save_figure
from paratrain.viz.ink import ink


def read_run(run_dir: str) -> dict:
    """The MoE records of a run: load per step (steps x E), load per rank per step
    (steps x dp x E), dropped per step, and the plan's dp and ep."""
    root = Path(run_dir)
    path = root / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run_dir!r} has no metrics.jsonl; pass the --run-dir of a "
                         "`paratrain train` run")
    recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    recs = [r for r in recs if "moe_load" in r]
    if not recs:
        raise ValueError(f"the run in {run_dir!r} logged no expert load; train an MoE "
                         "model (pass --experts E)")
    plan = {"dp": len(recs[0].get("moe_load_by_rank", [0])), "ep": 1}
    summary = root / "summary.json"
    if summary.is_file():
        plan.update({k: v for k, v in json.loads(summary.read_text())["plan"].items()
                     if k in ("dp", "ep", "tp", "pp")})
    return {"steps": [r["step"] for r in recs], "load": [r["moe_load"] for r in recs],
            "by_rank": [r.get("moe_load_by_rank", [r["moe_load"]]) for r in recs],
            "dropped": [r.get("moe_dropped", 0) for r in recs], "plan": plan}


def send_matrix(by_rank: list[list[float]], ep: int) -> list[list[float]]:
    """dp x dp assignments sent in one dispatch: data rank d sends the rows for experts
    [j E/ep, (j+1) E/ep) to rank ep (d // ep) + j of its ep group."""
    dp, E = len(by_rank), len(by_rank[0])
    per = E // ep
    out = [[0.0] * dp for _ in range(dp)]
    for d, row in enumerate(by_rank):
        base = ep * (d // ep)
        for j in range(ep):
            out[d][base + j] = sum(row[j * per:(j + 1) * per])
    return out


def _mean(rows: list[list[list[float]]]) -> list[list[float]]:
    n = len(rows)
    return [[sum(r[d][e] for r in rows) / n for e in range(len(rows[0][0]))]
            for d in range(len(rows[0]))]


def _load_panel(fig, ax, rel: list[list[float]], steps: list[int], E: int) -> None:
    """Expert load over steps, relative to the mean (1 = balanced)."""
    from matplotlib.colors import TwoSlopeNorm

    hi = max(2.0, max(max(r) for r in rel))
    im = ax.imshow([list(c) for c in zip(*rel, strict=True)], aspect="auto", cmap="RdBu_r",
                   norm=TwoSlopeNorm(vcenter=1.0, vmin=0.0, vmax=hi), interpolation="nearest",
                   extent=(steps[0] - 0.5, steps[-1] + 0.5, E - 0.5, -0.5))
    ax.set_yticks(range(E), [f"expert {e}" for e in range(E)])
    ax.set_xlabel("step")
    ax.set_title("expert load / mean load over steps (1 = balanced)")
    fig.colorbar(im, ax=ax, fraction=0.05)


def _imbalance_panel(ax, run: dict, imb: list[float]) -> None:
    """Max / mean expert load per step, and the dropped share under a capacity."""
    steps, load = run["steps"], run["load"]
    ax.plot(steps, imb, color="#C44E52", label="max / mean expert load")
    ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylim(bottom=0.9)
    ax.set_title(f"imbalance: last step {imb[-1]:.2f}, worst {max(imb):.2f}")
    ax.grid(alpha=0.3)
    if any(run["dropped"]):  # capacity: the share of assignments dropped, right axis
        share = [d / (d + sum(row)) for d, row in zip(run["dropped"], load, strict=True)]
        right = ax.twinx()
        right.plot(steps, share, color="#8172B2", label="dropped share (right axis)")
        right.set_ylim(0, max(share) * 1.3)
        right.legend(loc="upper left")
    ax.legend(loc="upper right")


def _worst_step_panel(ax, run: dict, worst: int, E: int, dp: int, ep: int) -> None:
    """Tokens per expert at the most uneven step, stacked by the data rank they came from."""
    import matplotlib.pyplot as plt

    load, by_rank, steps = run["load"], run["by_rank"], run["steps"]
    per, at = E // ep, load[worst]
    for j in range(ep):  # the experts ep rank j holds, and what they computed
        ax.axvspan(j * per - 0.5, (j + 1) * per - 0.5, color=f"C{j % 10}", alpha=0.08)
        ax.text((j + 0.5) * per - 0.5, 0.8, f"ep rank {j}: {sum(at[j * per:(j + 1) * per])}",
                ha="center",
                va="center", transform=ax.get_xaxis_transform(), fontsize=10,
                bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8})
    bottom = [0.0] * E
    cmap = plt.get_cmap("tab10")
    for d in range(dp):
        ax.bar(range(E), by_rank[worst][d], bottom=bottom, color=cmap(d % 10),
               edgecolor="white", label=f"from data rank {d}")
        bottom = [b + v for b, v in zip(bottom, by_rank[worst][d], strict=True)]
    ax.axhline(sum(bottom) / E, color="black", linestyle="--", linewidth=1,
               label="mean (balanced)")
    ax.set_xticks(range(E), [str(e) for e in range(E)])
    ax.set_xlabel("expert")
    ax.set_ylabel("assignments (all MoE layers)")
    ax.set_title(f"tokens per expert by source data rank, step {steps[worst]} "
                 f"(the most uneven)")
    ax.set_ylim(top=max(bottom) * 1.5)
    ax.legend(fontsize=8, loc="upper center", ncol=3)


def _dispatch_panel(fig, ax, mean: list[list[float]], dp: int, ep: int) -> None:
    """What the all-to-all carries between data ranks, per step (run mean)."""
    mat = send_matrix(mean, ep)
    im = ax.imshow(mat, cmap="Blues", interpolation="nearest")
    for s in range(dp):
        for d in range(dp):
            v = mat[s][d]
            ax.text(d, s, f"{v:.0f}", ha="center", va="center", fontsize=10,
                    color=ink(im.cmap(im.norm(v))))  # by the cell's own colour
    ax.set_xticks(range(dp), [f"to {d}" for d in range(dp)])
    ax.set_yticks(range(dp), [f"from {s}" for s in range(dp)])
    off = sum(mat[s][d] for s in range(dp) for d in range(dp) if s != d)
    ax.set_title(f"all-to-all dispatch, assignments per step (run mean)\n"
                 f"{off:.0f} ({100 * off / max(1.0, sum(map(sum, mat))):.0f}%) leave "
                 f"their rank; the combine returns them")
    fig.colorbar(im, ax=ax, fraction=0.05)


def draw_moe(run_dir: str, out_dir: str) -> Path:
    """Write ``moe_routing.png`` under ``out_dir``; return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = read_run(run_dir)
    load, by_rank, steps = run["load"], run["by_rank"], run["steps"]
    E, dp = len(load[0]), len(by_rank[0])
    ep = run["plan"]["ep"] if dp == run["plan"]["dp"] else 1
    rel = [[v / (sum(row) / E) if sum(row) else 0.0 for v in row] for row in load]
    imb = [max(row) / (sum(row) / E) if sum(row) else 0.0 for row in load]
    fig, axes = plt.subplots(2, 2, figsize=(13, 9), dpi=100)
    fig.suptitle(f"MoE routing of {Path(run_dir).name}: {E} experts, dp {dp}, ep {ep} "
                 f"({len(steps)} steps)", fontsize=13)
    _load_panel(fig, axes[0][0], rel, steps, E)
    _imbalance_panel(axes[0][1], run, imb)
    _worst_step_panel(axes[1][0], run, max(range(len(imb)), key=imb.__getitem__), E, dp, ep)
    _dispatch_panel(fig, axes[1][1], _mean(by_rank), dp, ep)
    fig.tight_layout()
    return save_figure(fig, out_dir, "moe_routing.png")
