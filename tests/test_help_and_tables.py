"""A newcomer's first hour at an 80-column terminal: every help page and table fits and
keeps its key columns; `train --help` groups its flags by subject and shows every
default; the default `plan` says what it is and which figure is the prediction.

Each command runs in this process through the CLI's entry point with ``COLUMNS=80``
(rich, which typer prints with, sizes its console from it; typer's own TERMINAL_WIDTH,
read at import, would override it for help pages, so it is cleared)."""

from __future__ import annotations

import json
import re

import pytest

from paratrain.cli import main
from paratrain.cli.settings import FIELD_PANELS, PANELS, schema

WIDTH = 80
EVERY = {"model": None, "train": None, "plan": None}
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _run(argv: list[str], monkeypatch, capsys) -> list[str]:
    from typer import rich_utils

    monkeypatch.setenv("COLUMNS", str(WIDTH))
    # typer reads TERMINAL_WIDTH once, at import, and it overrides COLUMNS for help pages
    monkeypatch.setattr(rich_utils, "MAX_WIDTH", None)
    assert main(argv) == 0
    return ANSI.sub("", capsys.readouterr().out).splitlines()


COMMANDS = [["--help"], ["train", "--help"], ["plan", "--help"], ["check-model", "--help"],
            ["plan"], ["plan", "--explain"], ["plan", "--search"], ["validate"],
            ["viz", "--help"], ["bench", "--help"]]


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_every_line_fits_80_columns_and_nothing_is_cut(argv, monkeypatch, capsys):
    lines = _run(argv, monkeypatch, capsys)
    assert lines
    assert [x for x in lines if len(x) > WIDTH] == []
    assert [x for x in lines if "…" in x] == []  # rich's mark of a cut cell


# ---- train --help ---------------------------------------------------------------------
def test_every_setting_has_a_panel():
    names = {s.name for s in schema(EVERY)}
    assert set(FIELD_PANELS) == names
    assert set(FIELD_PANELS.values()) <= set(PANELS)


def _options(lines: list[str]) -> dict[str, tuple[str, str]]:
    """{flag: (panel title, its help joined)} of a rich help page."""
    out, panel, flag = {}, None, None
    for line in lines:
        if line.startswith("╭─"):
            panel = line.strip("╭─╮ ")
            continue
        if not line.startswith("│"):
            continue
        body = line.strip("│ ")
        m = re.match(r"(--[\w-]+)(?:\s+--no-[\w-]+)?\s+<\w+>\s+(.*)", body)
        if m:
            flag = m.group(1)
            out[flag] = (panel, m.group(2))
        elif flag:
            out[flag] = (panel, out[flag][1] + " " + body)
    return out


def test_train_help_groups_flags_and_shows_every_default(monkeypatch, capsys):
    lines = _run(["train", "--help"], monkeypatch, capsys)
    opts = _options(lines)
    titles = [line.strip("╭─╮ ") for line in lines if line.startswith("╭─")]
    assert titles == ["Options"] + [t.replace("\\[", "[") for t in PANELS.values()]
    assert all(panel == "Options" for f, (panel, _) in opts.items()
               if f in ("--config", "--help"))
    assert {f for f, (panel, _) in opts.items() if panel == "Options"} == {"--config",
                                                                         "--help"}
    for flag, (_, text) in opts.items():
        assert flag in ("--config", "--help") or "[default: " in text, flag
    assert "[default: world / (tp*pp*cp)]" in opts["--dp"][1]  # not the stored 1
    assert "[default: heads]" in opts["--kv-heads"][1]
    assert "[gpipe | 1f1b | interleaved | zb-h1 | zb-v | dualpipev]" in opts["--schedule"][1]
    assert "--resume auto" in opts["--resume"][1]
    assert opts["--resume"][0] == "Checkpoints and faults"
    usage = next(line for line in lines if "Usage:" in line)
    assert usage.split("train", 1)[1].split() == ["[OPTIONS]"]  # no stray [resume_mode]


def test_no_help_paragraph_keeps_a_line_break(monkeypatch, capsys):
    """A single line break inside a paragraph would split a sentence mid-line."""
    from paratrain.cli.app import app

    def commands(group):
        yield from group.registered_commands
        for sub in group.registered_groups:
            yield from commands(sub.typer_instance)

    for info in commands(app):
        assert all("\n" not in par for par in info.help.split("\n\n")), info.help


def test_top_level_help_lists_every_drawing(monkeypatch, capsys):
    from paratrain.cli.viz import app as viz_app

    text = " ".join(_run(["--help"], monkeypatch, capsys))
    row = text.split("│ viz", 1)[1].split("╰", 1)[0]
    row = " ".join(w for w in row.split() if w != "│")
    for c in viz_app.registered_commands:
        assert (c.name or c.callback.__name__) in row


# ---- plan -----------------------------------------------------------------------------
def test_default_plan_says_what_it_is_and_which_figure_to_trust(monkeypatch, capsys):
    lines = _run(["plan"], monkeypatch, capsys)
    text = " ".join(" ".join(lines).split())
    assert lines[0].startswith("The reference example: docs/design.md's worked figures")
    assert "unsharded on purpose" in text
    m = re.search(r"`paratrain plan (--zero \d --micro-batches \d)` does", text)
    assert m, "the note names a layout that fits"
    # the figures move with the fitted parameters (data/fitted.toml): their form is checked
    assert re.search(r"prediction: the step model .* predicts a step of \d\.\d\d s", text)
    assert "Step time, reference model" in text
    sync = text.split("data-parallel sync on the wire:", 1)[1][:300]
    assert "0.533 s in the table" in sync and re.search(r"\d+ ms in the step model", sync)
    assert "exposed after overlap" in sync
    # the layout the note says fits does fit, and no longer opens with the note
    fits = _run(["plan", *m.group(1).split()], monkeypatch, capsys)
    assert any(x.startswith("verdict: fits") for x in fits)
    assert not fits[0].startswith("The reference example")


def test_plan_search_keeps_its_gb_column(monkeypatch, capsys):
    argv = ["plan", "--search", "--model", "llama2-70b", "--gpus", "512"]
    lines = _run(argv, monkeypatch, capsys)
    head = next(x for x in lines if x.strip().startswith("#"))
    assert head.split()[-3:] == ["s", "MFU%", "GB"]
    rows = [x.split() for x in lines if re.match(r"^\s+\d+\s+\d+\s", x)]
    want = json.loads(" ".join(_run([*argv, "--json"], monkeypatch, capsys)))["top"]
    assert [r[-1] for r in rows] == [f"{c['memory_bytes'] / 1e9:.1f}" for c in want]
    assert any("every layout shown has cp 1, ep 1" in x for x in lines)


# ---- validate -------------------------------------------------------------------------
def test_validate_keeps_every_id_whole(monkeypatch, capsys):
    lines = _run(["validate"], monkeypatch, capsys)
    recs = json.loads("\n".join(_run(["validate", "--json"], monkeypatch, capsys)))["records"]
    first = {x.split()[0] for x in lines if x.strip()}
    priced = [r["id"] for r in recs if not r["skipped_reason"]]
    assert priced and set(priced) <= first
    skipped = " ".join(x for x in lines if not x.startswith(" "))
    for r in recs:
        if r["skipped_reason"]:
            assert r["id"] in skipped and r["skipped_reason"] in skipped
