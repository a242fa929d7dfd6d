"""`paratrain viz ring|tree` write valid PNG frames and an animated GIF."""

from __future__ import annotations

from PIL import Image

from paratrain.cli import main
from paratrain.comm import build
from paratrain.viz.collective_anim import ownership


def test_ownership_ends_with_every_rank_summed():
    for alg in ("ring", "tree", "pipelined_tree", "halving_doubling"):
        s = build("all_reduce", alg, 5, 10, segments=4)
        last = ownership(s)[-1]
        assert all(len(cell) == 5 for row in last for cell in row), alg


def test_viz_ring_and_tree_write_png_frames_and_gif(tmp_path, capsys):
    assert main(["viz", "ring", "--p", "4", "--out", str(tmp_path)]) == 0
    assert main(["viz", "tree", "--p", "4", "--out", str(tmp_path)]) == 0
    assert main(["viz", "tree", "--p", "4", "--algorithm", "pipelined_tree",
                 "--out", str(tmp_path)]) == 0
    assert "frames" in capsys.readouterr().out
    ring_pngs = sorted(tmp_path.glob("ring_all_reduce_p4_step*.png"))
    assert len(ring_pngs) == 2 * 3 + 1  # start + 2(p-1) steps
    for png in tmp_path.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for stem, frames in (("ring_all_reduce_p4", 7), ("tree_all_reduce_p4", 5)):
        gif = Image.open(tmp_path / f"{stem}.gif")
        assert gif.format == "GIF" and gif.n_frames == frames


def test_viz_rejects_bad_values(tmp_path, capsys):
    assert main(["viz", "ring", "--p", "1", "--out", str(tmp_path)]) == 2
    assert main(["viz", "tree", "--algorithm", "ring", "--out", str(tmp_path)]) == 2
    assert "error:" in capsys.readouterr().err
