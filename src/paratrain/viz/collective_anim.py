"""Frames of a collective schedule: which ranks' data each rank holds, per segment, after
every round, with that round's transfers drawn as arrows; saved as PNGs and a GIF.

Drawn from the same :class:`~paratrain.comm.schedule.CollectiveSchedule` the executor runs. A cell
(rank r, segment s) shows how many ranks' contributions r's copy of s holds: a reduce adds
the sender's set to the receiver's, a copy replaces it. Darker = more of the sum.
"""

from __future__ import annotations

from pathlib import Path

from paratrain.comm.schedule import REDUCE, CollectiveSchedule


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


def draw(s: CollectiveSchedule, out_dir: str | Path, stem: str, fps: float = 1.5
         ) -> tuple[list[Path], Path]:
    """Write ``stem_stepNN.png`` per state and ``stem.gif``; return (pngs, gif)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    frames = ownership(s)
    nseg = len(s.seg_sizes)
    pngs = []
    for k, state in enumerate(frames):
        fig, ax = plt.subplots(figsize=(max(4.0, 1.2 + 0.9 * nseg), 1.2 + 0.6 * s.p), dpi=80)
        grid = [[len(state[r][g]) / s.p for g in range(nseg)] for r in range(s.p)]
        ax.imshow(grid, cmap="Blues", vmin=0, vmax=1.15, aspect="auto")
        for r in range(s.p):
            for g in range(nseg):
                ax.text(g, r, str(len(state[r][g])), ha="center", va="center", fontsize=9)
        if k > 0:
            for t in s.rounds[k - 1]:
                color = "tab:red" if t.op == REDUCE else "tab:green"
                ax.annotate("", xy=(t.seg + 0.2, t.dst), xytext=(t.seg - 0.2, t.src),
                            arrowprops={"arrowstyle": "->", "color": color, "lw": 1.5,
                                        "connectionstyle": "arc3,rad=0.25"})
        ax.set_xticks(range(nseg), [f"seg {g}" for g in range(nseg)], fontsize=8)
        ax.set_yticks(range(s.p), [f"rank {r}" for r in range(s.p)], fontsize=8)
        what = "start" if k == 0 else f"step {k}/{s.steps}"
        ax.set_title(f"{s.algorithm} {s.op}, p={s.p}: {what}\n"
                     "(cell: ranks summed in; red = add, green = copy)", fontsize=9)
        fig.tight_layout()
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
