"""Frames of a collective schedule: what every rank holds, per segment, after every round,
with that round's transfers drawn on the ranks; saved as PNGs and a GIF.

Drawn from the same :class:`~paratrain.comm.schedule.CollectiveSchedule` the executor
runs. Each frame (1100 px wide) has two panels:

- left, the ranks on a circle (for a ring: the ring itself; grey: every link the
  schedule ever uses) with this round's sends as arrows labelled by segment; red adds
  into the receiver's copy (reduce), green replaces it (copy);
- right, the rank x segment grid. For reductions a cell lists whose contributions the
  rank's copy of that segment sums (``0+1``, ``all 4`` when complete), shaded light to
  mid blue by how many, dark once complete; for gathers (all-gather, sparse all-gather,
  broadcast) a cell names whose piece the rank holds (``r2's``), coloured by that owner,
  blank until it arrives. Cells that
  received something this round get a red (added) or green (copied) border and a second
  line saying from whom.

Text is black on light cells and white on dark ones (chosen from the cell's luminance).
"""

from __future__ import annotations

import math
from pathlib import Path

from paratrain.comm.schedule import COPY, REDUCE, CollectiveSchedule
from paratrain.viz.ink import edge, ink

GATHERS = ("all_gather", "sparse_all_gather", "broadcast")
_ADD, _COPY = "#C0392B", "#1E8449"


def ownership(s: CollectiveSchedule) -> list[list[list[frozenset]]]:
    """Contribution sets per state (initial, then after each round) x rank x segment."""
    if s.op in ("all_gather", "sparse_all_gather"):
        state = [[frozenset({r}) if g == r else frozenset() for g in range(len(s.seg_sizes))]
                 for r in range(s.p)]
    elif s.op == "broadcast":
        state = [[frozenset({r}) if r == s.root else frozenset() for _ in s.seg_sizes]
                 for r in range(s.p)]
    else:
        state = [[frozenset({r}) for _ in s.seg_sizes] for r in range(s.p)]
    frames = [state]
    for rnd in s.rounds:
        nxt = [row[:] for row in state]
        for t in rnd:  # sends read the pre-round state
            got = state[t.src][t.seg]
            nxt[t.dst][t.seg] = nxt[t.dst][t.seg] | got if t.op == REDUCE else got
        state = nxt
        frames.append(state)
    return frames


def _ranks_text(c: frozenset, p: int) -> str:
    if len(c) == p:
        return f"all {p}"
    if not c:
        return ""
    if len(c) <= 4:
        return "+".join(map(str, sorted(c)))
    return f"{len(c)} of {p}"


def _cell(s: CollectiveSchedule, c: frozenset, cmap, owners):
    """(fill colour, text) of one grid cell."""
    if s.op in GATHERS:
        if not c:
            return (1, 1, 1), ""
        (who,) = c if len(c) == 1 else (min(c),)
        return owners((2 * who) % 20 + (2 * who) // 20 % 2), f"r{who}'s"  # distinct hues
    # partial sums light to mid blue (black text), the complete sum dark (white text)
    shade = 0.85 if len(c) == s.p else 0.08 + 0.4 * len(c) / s.p
    return cmap(shade), _ranks_text(c, s.p)


def _ring_panel(ax, s: CollectiveSchedule, rnd, plt) -> None:
    p = s.p
    pos = [(math.sin(2 * math.pi * r / p), math.cos(2 * math.pi * r / p)) for r in range(p)]
    links = {(min(t.src, t.dst), max(t.src, t.dst)) for rd in s.rounds for t in rd}
    for a, b in links:
        ax.plot([pos[a][0], pos[b][0]], [pos[a][1], pos[b][1]], color="#D5D8DC", lw=1.2,
                zorder=1)
    rad = 0.16 if p > 2 else 0.35
    for t in rnd:
        (x0, y0), (x1, y1) = pos[t.src], pos[t.dst]
        color = _ADD if t.op == REDUCE else _COPY
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0), zorder=2,
                    arrowprops={"arrowstyle": "-|>", "color": color, "lw": 2.0,
                                "shrinkA": 17, "shrinkB": 17, "mutation_scale": 16,
                                "connectionstyle": f"arc3,rad={rad}"})
        # label near the arc's middle, pushed to the arc's side
        mx, my = (x0 + x1) / 2, (y0 + y1) / 2
        nx, ny = (y1 - y0), -(x1 - x0)
        ax.text(mx + rad * 0.6 * nx, my + rad * 0.6 * ny, f"s{t.seg}", color=color,
                fontsize=9, ha="center", va="center", zorder=4,
                bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none"})
    for r, (x, y) in enumerate(pos):
        ax.add_patch(plt.Circle((x, y), 0.16, fc="#EAF2F8", ec="#1B4F72", lw=1.5, zorder=3))
        ax.text(x, y, f"r{r}", ha="center", va="center", fontsize=11, color="#1B4F72",
                zorder=5, fontweight="bold")
    ax.set_xlim(-1.35, 1.35)
    ax.set_ylim(-1.35, 1.35)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title("ranks: this round's sends (s = segment)", fontsize=10)


def _grid_panel(ax, s: CollectiveSchedule, state, rnd, plt) -> None:
    from matplotlib.patches import Rectangle

    nseg = len(s.seg_sizes)
    cmap, owners = plt.get_cmap("Blues"), plt.get_cmap("tab20")
    got = {(t.dst, t.seg): t for t in rnd}
    small = nseg > 8
    for r in range(s.p):
        for g in range(nseg):
            fill, text = _cell(s, state[r][g], cmap, _pastel(owners))
            t = got.get((r, g))
            # a changed cell's border in its round's colour, kept visible on a dark cell
            edge_c = edge(_ADD if t.op == REDUCE else _COPY, fill) if t else "#BBBBBB"
            ax.add_patch(Rectangle((g - 0.5, r - 0.5), 1, 1, fc=fill, ec=edge_c,
                                   lw=3 if t else 0.6, zorder=2 if t else 1))
            txt = ink(fill)
            if t:
                ax.text(g, r - 0.14, text, ha="center", va="center", fontsize=8 if small
                        else 10, color=txt, zorder=3)
                how = "+" if t.op == REDUCE else "copy"
                ax.text(g, r + 0.22, f"{how} r{t.src}", ha="center", va="center",
                        fontsize=7 if small else 8, color=txt, zorder=3, style="italic")
            else:
                ax.text(g, r, text, ha="center", va="center", fontsize=8 if small else 10,
                        color=txt, zorder=3)
    ax.set_xlim(-0.5, nseg - 0.5)
    ax.set_ylim(s.p - 0.5, -0.5)
    ax.set_xticks(range(nseg), [f"seg {g}" for g in range(nseg)],
                  fontsize=7 if small else 9, rotation=45 if small else 0)
    ax.set_yticks(range(s.p), [f"rank {r}" for r in range(s.p)], fontsize=9)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    what = ("whose piece each rank holds" if s.op in GATHERS
            else "whose contributions each rank's copy sums")
    ax.set_title(f"rank x segment: {what}", fontsize=10)


def _growth_note(s: CollectiveSchedule) -> str:
    """For sparse all-gather: the cost that grows with p (nothing is summed on the way)."""
    if s.op != "sparse_all_gather":
        return ""
    from paratrain.comm.cost import count

    return (f"\nsparse: each rank's buffer grows to p = {s.p} pieces of k = {s.n} entries; "
            f"it sends p-1 = {s.p - 1} pieces ({count(s).sent[0]} entries): both grow with p")


def _pastel(cmap):
    """Light tints of a qualitative palette (owner colours that black text reads on)."""
    def tint(i):
        r, g, b, _ = cmap(i)
        return (0.45 * r + 0.55, 0.45 * g + 0.55, 0.45 * b + 0.55)

    return tint


def frame_figure(s: CollectiveSchedule, k: int, state=None):
    """The matplotlib figure of state ``k`` (0 = start, k = after round k)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    state = state if state is not None else ownership(s)[k]
    nseg = len(s.seg_sizes)
    width = max(11.0, 5.5 + 0.75 * nseg)
    rnd = s.rounds[k - 1] if k else ()
    fig = plt.figure(figsize=(width, max(5.0, 1.9 + 0.5 * s.p)), dpi=100)
    gs = fig.add_gridspec(1, 2, width_ratios=(4.2, width - 4.2), wspace=0.12)
    _ring_panel(fig.add_subplot(gs[0]), s, rnd, plt)
    _grid_panel(fig.add_subplot(gs[1]), s, state, rnd, plt)
    what = "start" if k == 0 else f"round {k} of {s.steps}"
    fig.suptitle(f"{s.algorithm} {s.op.replace('_', '-')}, p={s.p}: {what}",
                 fontsize=13, fontweight="bold")
    fig.text(0.5, 0.015, "red = received and added (reduce)    green = received as a "
             "copy    bordered cells changed this round" + _growth_note(s), ha="center",
             fontsize=9, color="#333333")
    fig.subplots_adjust(left=0.03, right=0.98, top=0.86, bottom=0.12)
    return fig


def draw(s: CollectiveSchedule, out_dir: str | Path, stem: str, fps: float = 1.5
         ) -> tuple[list[Path], Path]:
    """Write ``stem_stepNN.png`` per state and ``stem.gif``; return (pngs, gif)."""
    import matplotlib.pyplot as plt
    from PIL import Image

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pngs = []
    for k, state in enumerate(ownership(s)):
        fig = frame_figure(s, k, state)
        path = out / f"{stem}_step{k:02d}.png"
        fig.savefig(path)
        plt.close(fig)
        pngs.append(path)
    images = [Image.open(p).convert("RGB") for p in pngs]
    size = images[0].size
    images = [im.resize(size) for im in images]
    gif = out / f"{stem}.gif"
    images[0].save(gif, save_all=True, append_images=images[1:], duration=int(1000 / fps),
                   loop=0)
    return pngs, gif


__all__ = ["COPY", "REDUCE", "draw", "frame_figure", "ink", "ownership"]
