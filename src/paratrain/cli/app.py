"""`paratrain train | plan | validate | report | bench | viz | generate | export`.

This module and the command modules it imports must not import torch at import time:
`paratrain plan` has to answer instantly. Commands import torch inside their bodies.
Every ``ValueError`` raised by a command becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import inspect
import sys

import typer

from paratrain.cli.bench import app as bench_app
from paratrain.cli.check import register as register_check
from paratrain.cli.checkpoint import register as register_model
from paratrain.cli.plan import register as register_systems
from paratrain.cli.train import register as register_train
from paratrain.cli.validate import register as register_validate
from paratrain.cli.viz import app as viz_app
from paratrain.viz.plan_plots import write_plan_output
from paratrain.viz.report_page import register as register_report

app = typer.Typer(
    help="Train decoder LMs with every classic form of parallelism; price any plan at scale.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
register_train(app)
register_systems(app, plotter=write_plan_output)  # viz -> systems, never back
register_validate(app)
register_check(app)
register_model(app)  # generate, export
register_report(app)
app.add_typer(bench_app, name="bench", help="Benchmarks: " + ", ".join(
    c.name or c.callback.__name__ for c in bench_app.registered_commands) + ".")
app.add_typer(viz_app, name="viz", help="Draw pictures to files: " + ", ".join(
    c.name or c.callback.__name__ for c in viz_app.registered_commands) + ".")


def reflow_help(group: typer.Typer) -> None:
    """Every command's help with its paragraphs' single line breaks joined: typer's rich
    mode keeps a docstring's line breaks, which then split a sentence mid-line at any
    terminal width (`paratrain --help` at 80 columns; tests/test_help_and_tables.py)."""
    for info in group.registered_commands:
        doc = info.help or inspect.getdoc(info.callback) or ""
        info.help = "\n\n".join(" ".join(par.split()) for par in doc.split("\n\n"))
    for sub in group.registered_groups:
        reflow_help(sub.typer_instance)


reflow_help(app)


def main(argv: list[str] | None = None) -> int:
    """Console entry point. Returns (and exits with) the command's exit code."""
    try:
        rv = app(args=argv, standalone_mode=False)
    except (ValueError, FileNotFoundError, FloatingPointError) as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except (typer.Exit, typer.Abort, Exception) as e:
        # typer's click exceptions (usage errors: exit 2) show themselves; typer may vendor
        # click, so match by behaviour rather than by class.
        if hasattr(e, "show") and hasattr(e, "exit_code"):
            e.show()
            code = e.exit_code
        elif isinstance(e, typer.Exit) or hasattr(e, "exit_code"):
            code = e.exit_code
        elif isinstance(e, typer.Abort):
            print("aborted", file=sys.stderr)
            code = 1
        else:
            raise
    else:
        code = rv if isinstance(rv, int) else 0
    if argv is None:
        sys.exit(code)
    return code


if __name__ == "__main__":
    main()
