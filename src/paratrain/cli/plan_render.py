"""How `paratrain plan` prints a report: the reference example's opening note, the
reference model's tables (:func:`paratrain.systems.report.render`), and the step model's
prediction beside them, fitted to the terminal's width. No torch here."""

from __future__ import annotations

# What `paratrain plan` with no flags shows, said before its first table: a newcomer's
# first plan does not fit, on purpose.
EXAMPLE_NOTE = (
    "[bold]The reference example[/]: docs/design.md's worked figures, LLaMA 2 7B on 64 "
    "H100 with plain data parallelism, unsharded on purpose so that each figure can be "
    "checked by hand. It does not fit in 80 GB; `paratrain plan --zero 3 --micro-batches "
    "2` does, and `paratrain plan --search` ranks every layout that fits.")


def print_report(rep: dict, json_out: bool, example: bool = False) -> None:
    from rich.console import Console

    from paratrain.systems.report import render

    if json_out:
        import json

        print(json.dumps(rep, indent=2))
        return
    con = Console()
    if example:
        con.print(EXAMPLE_NOTE, highlight=False)
    render(rep, con)
    if "predicted" in rep:
        _render_predicted(rep, con)


def _render_predicted(rep: dict, con) -> None:
    """The step model's prediction (the figure to trust), why its data-parallel sync
    differs from the reference table's, and ``--explain``'s breakdown fitted to the
    terminal's width."""
    from paratrain.systems.report import fmt_sig

    pred, ref = rep["predicted"], rep["step"]
    scaling = pred.get("fp8")
    fp8 = f", FP8 GEMMs ({scaling})" if isinstance(scaling, str) else (
        ", FP8 GEMMs" if scaling else "")
    con.print(f"[bold]prediction[/]: the step model (engine {pred['engine']}{fp8}, "
              "parameters fitted to published runs, `paratrain validate`) predicts a step of "
              f"[bold]{pred['step_s']:.3g} s[/], MFU {100 * pred['mfu']:.1f} %, HFU "
              f"{100 * pred['hfu']:.1f} %; the table above is the reference model's "
              "hand-checkable arithmetic.", highlight=False)
    if ref["dp_comm_s"] or pred["comm_s"]["dp"]:
        exposed = "none in either" if not (ref["dp_exposed_s"] or pred["exposed_s"]["dp"]) \
            else f"{fmt_sig(ref['dp_exposed_s'], 3)} s and {1e3 * pred['exposed_s']['dp']:.0f} ms"
        how = ("a flat ring at one network link per GPU" if
               rep["gradient_sync"]["dp_link"] == "inter" else "a ring over the node link")
        con.print(f"data-parallel sync on the wire: {fmt_sig(ref['dp_comm_s'], 3)} s in the "
                  f"table ({how}), {1e3 * pred['comm_s']['dp']:.0f} ms in the step model (a "
                  "node's links in parallel, at fitted efficiencies); exposed after overlap "
                  f"with the backward: {exposed}.", highlight=False)
    for line in pred.get("explain", []):
        for part in _fit_line(line, con.width):
            con.print(part, highlight=False, markup=False, overflow="ignore", crop=False)


def _fit_line(line: str, width: int) -> list[str]:
    """An ``--explain`` line (name, figure, note) wrapped to ``width``, the note's
    continuation lines under its first word."""
    import re
    import textwrap

    head = re.match(r"^\s+\S.*?\d ms  ", line)
    indent = " " * (len(head.group(0)) if head and len(head.group(0)) < width - 20 else 4)
    return textwrap.wrap(line, width, subsequent_indent=indent, drop_whitespace=True) \
        if len(line) > width else [line]
