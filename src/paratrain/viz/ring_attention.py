"""Frames of ring attention under the causal mask: per ring step, which (query chunk, key
chunk) blocks each cp rank computes, which it skips, which K/V block it holds and which
is in flight; saved as PNGs and a GIF.

Drawn from :func:`paratrain.cost.layout.ring_blocks`, the schedule
:class:`paratrain.parallel.context.RingAttention` runs, with the load-balanced split of
:func:`paratrain.cost.layout.cp_chunks` (sequence cut into 2cp chunks; rank i holds chunks i
and 2cp-1-i). Left: the 2cp x 2cp causal attention matrix (rows: query chunks, columns:
key chunks), each block coloured by the rank that computes it, solid at the step it is
computed, faded afterwards; diagonal blocks are triangles (causal mask inside the chunk);
blocks above the diagonal are never computed, hatched where a rank holds that K/V block
at this step and skips it. Right: the ring, what each rank holds and what travels; below,
attention work per rank so far, beside a contiguous split's.
"""

from __future__ import annotations

import math
from pathlib import Path

from paratrain.cost.layout import attention_pairs_per_rank, cp_chunks, ring_blocks
from paratrain.viz.ink import ink

# colour-blind safe (Okabe-Ito); a label on a block takes ink() of its colour
PALETTE = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#8C564B",
           "#7F7F7F"]


def owner(cp: int, chunk: int) -> int:
    """The cp rank that holds sequence chunk ``chunk``."""
    return chunk if chunk < cp else 2 * cp - 1 - chunk


def frames(cp: int) -> list[dict]:
    """Per ring step: per rank, the K/V owner it holds, the (qc, kc, kind) blocks it
    computes, the (qc, kc) blocks it skips (masked), and the K/V owner in flight to it."""
    scheds = [ring_blocks(cp, i) for i in range(cp)]
    out = []
    for s in range(cp):
        ranks = []
        for i in range(cp):
            j, blocks = scheds[i][s]
            done = {(q, k) for q, k, _ in blocks}
            skipped = [(q, k) for q in cp_chunks(cp, i) for k in cp_chunks(cp, j)
                       if (q, k) not in done]
            ranks.append({"holds": j, "blocks": blocks, "skipped": skipped,
                          "incoming": (j - 1) % cp if s < cp - 1 else None})
        out.append({"step": s, "ranks": ranks})
    return out


def _block(ax, q: int, k: int, kind: str, color: str, alpha: float, edge: str | None):
    from matplotlib.patches import Polygon, Rectangle

    if kind == "diag":  # keys up to the query: the lower-left triangle of the block
        patch = Polygon([(k, q), (k, q + 1), (k + 1, q + 1)], closed=True)
    else:
        patch = Rectangle((k, q), 1, 1)
    patch.set_facecolor(color)
    patch.set_alpha(alpha)
    patch.set_edgecolor(edge or "none")
    patch.set_linewidth(2.0 if edge else 0)
    ax.add_patch(patch)


def _matrix(ax, cp: int, fr: list[dict], s: int) -> None:
    from matplotlib.patches import Rectangle

    n = 2 * cp
    ax.set_xlim(0, n)
    ax.set_ylim(n, 0)
    ax.set_aspect("equal")
    for q in range(n):
        for k in range(q + 1, n):  # above the diagonal: masked, never computed
            ax.add_patch(Rectangle((k, q), 1, 1, facecolor="#EEEEEE", edgecolor="none"))
    for t in range(s + 1):
        for i, r in enumerate(fr[t]["ranks"]):
            for q, k, kind in r["blocks"]:
                now = t == s
                _block(ax, q, k, kind, PALETTE[i % len(PALETTE)], 1.0 if now else 0.28,
                       "black" if now else None)
                if now:
                    x, y = (k + 0.5, q + 0.5) if kind == "full" else (k + 0.3, q + 0.72)
                    ax.text(x, y, f"r{i}", ha="center", va="center",
                            color=ink(PALETTE[i % len(PALETTE)]),
                            fontsize=10, fontweight="bold")
    for i, r in enumerate(fr[s]["ranks"]):
        for q, k in r["skipped"]:
            ax.add_patch(Rectangle((k, q), 1, 1, facecolor="none", hatch="xx",
                                   edgecolor=PALETTE[i % len(PALETTE)], linewidth=0))
            ax.text(k + 0.5, q + 0.5, f"r{i}\nskips" if cp <= 4 else f"r{i}", ha="center",
                    va="center", fontsize=8, color="#333333")
    for v in range(n + 1):
        ax.axhline(v, color="white", lw=1.5)
        ax.axvline(v, color="white", lw=1.5)
    labels = [f"c{c} (r{owner(cp, c)})" for c in range(n)]
    ax.set_xticks([c + 0.5 for c in range(n)], labels, rotation=45, ha="right", fontsize=9)
    ax.set_yticks([c + 0.5 for c in range(n)], labels, fontsize=9)
    ax.set_xlabel("key chunk (its owner rank)", fontsize=11)
    ax.set_ylabel("query chunk (its owner rank)", fontsize=11)
    ax.tick_params(length=0)
    ax.set_title("causal attention blocks: solid = computed now, faded = earlier,\n"
                 "grey = masked (never), hatched = masked block a rank holds and skips",
                 fontsize=10)


def _ring(ax, cp: int, fr: dict) -> None:
    ax.set_xlim(-2.2, 2.2)
    ax.set_ylim(-1.55, 1.55)
    ax.axis("off")
    off = math.pi / cp  # corners, not edges, at the top: labels sit between the boxes
    pos = [(1.45 * math.sin(2 * math.pi * i / cp + off), math.cos(2 * math.pi * i / cp + off))
           for i in range(cp)]
    for i, r in enumerate(fr["ranks"]):
        if fr["ranks"][(i + 1) % cp]["incoming"] is None:
            continue  # last step: nothing travels
        a, b = pos[i], pos[(i + 1) % cp]
        if cp == 2:  # two arcs, one each way
            ax.annotate("", xy=b, xytext=a, arrowprops=dict(
                arrowstyle="-|>,head_width=0.5,head_length=0.9", color="#444444", lw=2.5,
                shrinkA=42, shrinkB=42, connectionstyle="arc3,rad=0.5"))
            lx, ly = 0.0, 0.55 if i == 1 else -0.55
        else:  # the middle of the straight segment between the boxes, label outside
            f = 0.3 if cp <= 4 else 0.36
            ax.annotate("", xy=(a[0] + (1 - f) * (b[0] - a[0]), a[1] + (1 - f) * (b[1] - a[1])),
                        xytext=(a[0] + f * (b[0] - a[0]), a[1] + f * (b[1] - a[1])),
                        arrowprops=dict(arrowstyle="-|>,head_width=0.5,head_length=0.9",
                                        color="#444444", lw=2.5, shrinkA=0, shrinkB=0))
            mx, my = (a[0] + b[0]) / 2, (a[1] + b[1]) / 2
            n = math.hypot(mx, my) or 1.0
            lx, ly = mx + 0.42 * mx / n, my + 0.32 * my / n
        ax.text(lx, ly, f"K/V of r{r['holds']}\nr{i} -> r{(i + 1) % cp}",
                ha="center", va="center", fontsize=9 if cp <= 4 else 8, color="#222222",
                bbox=dict(boxstyle="round,pad=0.25", fc="#FFF6D5", ec="#C9A227"))
    for i, r in enumerate(fr["ranks"]):
        j = r["holds"]
        qs = ", ".join(f"c{c}" for c in cp_chunks(cp, i))
        ks = ", ".join(f"c{c}" for c in cp_chunks(cp, j))
        label = (f"rank {i}   Q: {qs}\nholds K/V of r{j}: {ks}\n"
                 f"computes {len(r['blocks'])}, skips {len(r['skipped'])}") if cp <= 4 \
            else f"r{i}  Q {qs}\nK/V r{j}: {ks}"
        ax.text(*pos[i], label, ha="center", va="center", fontsize=9 if cp <= 4 else 8,
                color="black",
                bbox=dict(boxstyle="round,pad=0.35", fc="white",
                          ec=PALETTE[i % len(PALETTE)], lw=2.5))
    last = fr["step"] == cp - 1
    ax.set_title("the cp ring at this step" + (": last block, nothing in flight" if last
                                               else ": next K/V block in flight (overlapped "
                                               "with this step's blocks)"), fontsize=10)


def _work(ax, cp: int, fr: list[dict], s: int, c: int) -> None:
    """Attention (query, key) pairs computed per rank up to step s, full blocks c^2,
    diagonal c(c+1)/2; beside the whole-step totals of a contiguous split."""
    def pairs(kind: str) -> int:
        return c * c if kind == "full" else c * (c + 1) // 2

    done = [sum(pairs(k) for t in range(s + 1) for *_, k in fr[t]["ranks"][i]["blocks"])
            for i in range(cp)]
    total = attention_pairs_per_rank(2 * cp * c, cp, True)
    contiguous = attention_pairs_per_rank(2 * cp * c, cp, False)
    xs = range(cp)
    ax.bar([x - 0.2 for x in xs], total, 0.38, color="#DDDDDD", edgecolor="#999999",
           label="balanced, whole step")
    ax.bar([x - 0.2 for x in xs], done, 0.38, color=[PALETTE[i % 8] for i in xs],
           label="balanced, done so far")
    ax.bar([x + 0.2 for x in xs], contiguous, 0.38, color="white", edgecolor="black",
           hatch="//", label="contiguous split, whole step")
    ax.set_xticks(list(xs), [f"r{i}" for i in xs])
    ax.set_ylabel("(query, key) pairs", fontsize=9)
    ax.set_xlabel(f"cp rank (chunk = {c} tokens)", fontsize=9)
    mean = sum(total) / cp
    ax.set_title(f"attention work per rank: balanced max/mean {max(total) / mean:.2f}, "
                 f"contiguous {max(contiguous) / mean:.2f}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")


def draw(cp: int, out_dir: str | Path, chunk_tokens: int = 64, fps: float = 0.8
         ) -> tuple[list[Path], Path]:
    """Write ``ring_attention_cpN_stepK.png`` per ring step and ``ring_attention_cpN.gif``;
    return (pngs, gif). Frames are 1400 x 760 px."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    if not 2 <= cp <= 8:
        raise ValueError(f"--cp {cp}: draw between 2 and 8 ranks")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fr = frames(cp)
    pngs = []
    for s in range(cp):
        fig = plt.figure(figsize=(14, 7.6), dpi=100)
        grid = fig.add_gridspec(2, 2, width_ratios=[1.0, 1.15], height_ratios=[1.6, 1.0],
                                wspace=0.22, hspace=0.3)
        _matrix(fig.add_subplot(grid[:, 0]), cp, fr, s)
        _ring(fig.add_subplot(grid[0, 1]), cp, fr[s])
        _work(fig.add_subplot(grid[1, 1]), cp, fr, s, chunk_tokens)
        fig.suptitle(f"ring attention, cp = {cp}, causal, load-balanced (rank i holds chunks "
                     f"i and {2 * cp - 1}-i): forward step {s + 1} of {cp}", fontsize=13)
        fig.subplots_adjust(left=0.09, right=0.98, top=0.9, bottom=0.1)
        path = out / f"ring_attention_cp{cp}_step{s}.png"
        fig.savefig(path)
        plt.close(fig)
        pngs.append(path)
    gif = out / f"ring_attention_cp{cp}.gif"
    ims = [Image.open(p).convert("RGB") for p in pngs]
    ims[0].save(gif, save_all=True, append_images=ims[1:], duration=int(1000 / fps), loop=0)
    return pngs, gif
