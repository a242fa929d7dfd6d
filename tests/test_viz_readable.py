"""Pictures people can read, checked on the drawn figures: no label overlaps another or a
bar, text contrast against its cell, frames wide enough, cells that say whose piece a rank
holds, the interleaved legend naming its shades, sparse all-gather drawable."""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from paratrain.cli import main  # noqa: E402
from paratrain.comm import build  # noqa: E402
from paratrain.cost.schedule import build_schedule  # noqa: E402
from paratrain.viz.collective_anim import frame_figure  # noqa: E402
from paratrain.viz.pipeline_gantt import _legend  # noqa: E402
from paratrain.viz.plan_plots import memory_figure, pareto_figure  # noqa: E402


def _texts(fig):
    """(text, window box) of every label drawn (tick labels only for ticks in view)."""
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    out = []
    for t in fig.findobj(Text):
        if not (t.get_visible() and t.get_text().strip()):
            continue
        ax = t.axes
        if ax is not None and t in ax.xaxis.get_ticklabels(which="both"):
            lo, hi = sorted(ax.get_xlim())
            if not lo <= t.get_position()[0] <= hi:
                continue
        out.append((t.get_text(), t.get_window_extent(r).expanded(1, 1).padded(-1)))
    return out


def _overlapping(fig) -> list:
    boxes = _texts(fig)
    return [(a, b) for i, (a, ba) in enumerate(boxes) for b, bb in boxes[i + 1:]
            if ba.overlaps(bb)]


def test_memory_chart_has_model_states_panel_and_no_overlaps(capsys):
    assert main(["plan", "--json"]) == 0
    fig = memory_figure(json.loads(capsys.readouterr().out))
    assert _overlapping(fig) == []
    r = fig.canvas.get_renderer()
    bars = [p.get_window_extent(r) for ax in fig.axes for p in ax.patches
            if isinstance(p, Rectangle) and p.get_height() > 0]
    on_bars = [t for t, b in _texts(fig) if any(b.overlaps(x) for x in bars)]
    assert on_bars == []  # "HBM 80 GB" lives in the legend now
    ticks = " ".join(t for t, _ in _texts(fig))
    assert "107.8 GB" in ticks and "1.7 GB" in ticks  # the ZeRO story on its own panel
    plt.close(fig)


def test_pareto_log_axis_labels_do_not_overlap():
    from paratrain.cost.hardware import load_hardware
    from paratrain.cost.shapes import load_model
    from paratrain.systems.search import search

    res = search(load_model("llama2-7b"), load_hardware("h100"), 8, 2**19, 4096, top=3)
    fig = pareto_figure(res, "llama2-7b")
    ax = fig.axes[0]
    lo, hi = ax.get_xlim()
    assert hi / lo > 3  # a log axis that spans several labels
    assert _overlapping(fig) == []
    plt.close(fig)


def _contrast(c1, c2) -> float:
    """WCAG contrast ratio of two colours."""
    from matplotlib.colors import to_rgb

    def lum(c):
        ch = [x / 12.92 if x <= 0.03928 else ((x + 0.055) / 1.055) ** 2.4 for x in to_rgb(c)]
        return 0.2126 * ch[0] + 0.7152 * ch[1] + 0.0722 * ch[2]

    a, b = sorted((lum(c1), lum(c2)), reverse=True)
    return (a + 0.05) / (b + 0.05)


def _cells(fig):
    """{(rank, seg): (fill, [(text, colour)])} of the grid panel."""
    grid = fig.axes[1]
    cells = {}
    for p in grid.patches:
        x, y = p.get_xy()
        cells[(round(y + 0.5), round(x + 0.5))] = (p.get_facecolor(), [])
    for t in grid.texts:
        x, y = t.get_position()
        cells[(round(y), round(x))][1].append((t.get_text(), t.get_color()))
    return cells


def test_collective_frames_are_wide_readable_and_say_whose_piece():
    s = build("all_gather", "ring", 4, 4)
    start, end = frame_figure(s, 0), frame_figure(s, s.steps)
    assert start.get_size_inches()[0] * start.dpi >= 800
    first = _cells(start)
    assert [t for t, _ in first[(2, 2)][1]] == ["r2's"] and first[(2, 1)][1][0][0] == ""
    last = _cells(end)
    assert all(last[(r, g)][1][0][0] == f"r{g}'s" for r in range(4) for g in range(4))
    for fig in (start, end, frame_figure(build("all_reduce", "ring", 8, 8), 9)):
        for fill, texts in _cells(fig).values():
            for text, colour in texts:
                if text:
                    assert _contrast(fill, colour) >= 4.5, (text, fill, colour)
        plt.close(fig)
    plt.close(start)
    plt.close(end)


def test_sparse_all_gather_is_drawable_with_its_growth(tmp_path, capsys):
    assert main(["viz", "ring", "--p", "3", "--op", "sparse_all_gather",
                 "--out", str(tmp_path)]) == 0
    assert len(list(tmp_path.glob("ring_sparse_all_gather_p3_step*.png"))) == 3
    assert (tmp_path / "sparse_all_gather_growth.png").stat().st_size > 10_000
    from paratrain.viz.sparse_growth import sent_bytes

    sparse = [sent_bytes(p, 1 << 12, 16)[0] for p in (2, 8, 32)]
    dense = [sent_bytes(p, 1 << 12, 16)[1] for p in (2, 8, 32)]
    assert sparse[0] < sparse[1] < sparse[2] and sparse[2] > dense[2]  # grows past dense


def test_interleaved_legend_names_each_chunk_shade():
    labels = [h.get_label() for h in _legend(build_schedule("interleaved", 4, 8, 2), Patch)]
    assert labels == ["forward, chunk 0", "forward, chunk 1", "backward, chunk 0",
                      "backward, chunk 1"]
