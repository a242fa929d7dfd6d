"""Pictures people can read, checked on the drawn figures: no label overlaps another or a
bar, every text of every picture the `paratrain viz` commands write at WCAG's 4.5:1
against what it is drawn on (and a changed cell's border at 3:1), frames wide enough,
cells that say whose piece a rank holds, the interleaved legend naming its shades, sparse
all-gather drawable."""

from __future__ import annotations

import json
import re

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from paratrain.cli import main  # noqa: E402
from paratrain.comm import build  # noqa: E402
from paratrain.cost.schedule import build_schedule  # noqa: E402
from paratrain.viz.collective_anim import frame_figure  # noqa: E402
from paratrain.viz.ink import NON_TEXT, contrast, ink, low_contrast  # noqa: E402
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
                    assert contrast(fill, colour) >= 4.5, (text, fill, colour)
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


def test_contrast_is_wcag_and_ink_always_reads():
    assert contrast("black", "white") == pytest.approx(21.0)
    assert contrast("#777777", "white") == pytest.approx(4.48, abs=0.01)  # WCAG's example
    for fill in ("#08306B", "#4292C6", "#C6DBEF", "#D55E00", "#009E73", "#FFFF00"):
        assert contrast(ink(fill), fill) >= 4.5


def _moe_run(root) -> str:
    """A run directory as `paratrain train` writes one for an MoE model (dp 2, ep 2, 4
    experts): rank 0 routes many tokens, rank 1 few, so the send matrix spans light to
    dark cells."""
    root.mkdir()
    recs = [{"step": s, "moe_load": [90, 75, 50, 50], "moe_dropped": 0,
             "moe_load_by_rank": [[50, 50, 35, 35], [40, 25, 15, 15]]} for s in range(1, 7)]
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (root / "summary.json").write_text(json.dumps({"plan": {"dp": 2, "ep": 2}}))
    return str(root)


# every `paratrain viz` command (test_every_viz_command_is_checked keeps this complete)
VIZ = {
    "pipeline": ["pipeline"],
    "pipeline-interleaved": ["pipeline", "--schedule", "interleaved", "--virtual-stages", "2"],
    "pipeline-zb-h1": ["pipeline", "--schedule", "zb-h1"],
    "ring": ["ring"],
    "ring-sparse": ["ring", "--op", "sparse_all_gather", "--p", "3"],  # and its growth chart
    "tree": ["tree"],
    "tree-pipelined": ["tree", "--algorithm", "pipelined_tree"],
    "ring-attention": ["ring-attention"],
    "moe": ["moe", "RUN"],
}


def test_every_viz_command_is_checked():
    from paratrain.cli.viz import app

    names = {c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands}
    assert {args[0] for args in VIZ.values()} == names


def _run_checked(argv: list[str], monkeypatch) -> tuple[list[str], dict]:
    """Run ``paratrain ARGV``, checking each figure it saves as drawn (the colour behind
    each text read from its pixels) before it is written: ({file saved: its texts},
    {file: texts below 4.5:1})."""
    checked, bad = {}, {}
    save = Figure.savefig

    def checked_save(fig, fname, *args, **kwargs):
        checked[str(fname)] = [t.get_text() for t in fig.findobj(Text)]
        if low := low_contrast(fig):
            bad[str(fname)] = low
        return save(fig, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", checked_save)
    assert main(argv) == 0
    return checked, bad


@pytest.mark.parametrize("name", VIZ)
def test_every_text_of_every_picture_reads(name, tmp_path, monkeypatch, capsys):
    args = [_moe_run(tmp_path / "run") if a == "RUN" else a for a in VIZ[name]]
    checked, bad = _run_checked(["viz", *args, "--out", str(tmp_path / "out")], monkeypatch)
    assert checked and all((tmp_path / "out" / p.split("/")[-1]).exists() for p in checked)
    assert bad == {}


def test_plan_plots_read_and_mark_the_prediction(tmp_path, monkeypatch, capsys):
    checked, bad = _run_checked(["plan", "--plot", str(tmp_path)], monkeypatch)
    assert len(checked) == 2 and bad == {}
    step = checked[str(tmp_path / "step_time.png")]
    assert any(re.match(r"prediction \(step model\): \d\.\d\d s", t) for t in step)


def test_changed_cells_keep_a_visible_border_on_dark_cells():
    """The tree's complete sums are navy; a green or red border there still shows."""
    for s in (build("all_reduce", "tree", 4, 4),
              build("all_reduce", "pipelined_tree", 4, 4, segments=4)):
        for k in range(1, s.steps + 1):
            fig = frame_figure(s, k)
            changed = [p for p in fig.axes[1].patches if p.get_linewidth() > 1]
            assert changed
            for p in changed:
                assert contrast(p.get_edgecolor(), p.get_facecolor()) >= NON_TEXT, (s.algorithm, k)
            plt.close(fig)
