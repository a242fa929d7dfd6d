"""`paratrain train | plan | validate | report | bench | viz | generate | export`.

This module and the command modules it imports must not import torch at import time:
`paratrain plan` has to answer instantly. Commands import torch inside their bodies.
Every ``ValueError`` raised by a command becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys

import typer

from paratrain.cli.bench import app as bench_app
from paratrain.cli.check import register as register_check
from paratrain.cli.checkpoint import register as register_model
from paratrain.cli.plan import register as register_systems
from paratrain.cli.train import register as register_train
from paratrain.cli.validate import register as register_validate
from paratrain.cli.viz import app as viz_app
from paratrain.config import ModelConfig, TrainConfig, flag_of
from paratrain.plan import ParallelPlan
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


def _quiet_rank() -> bool:
    """Under torchrun (``python -m torch.distributed.run ... -m paratrain.cli train``)
    every rank parses the same flags and validates the same settings before it joins the
    group, so only rank 0 prints the error line; the others exit 2 silently. torchrun's
    own failure report after it cannot be silenced from inside a worker (docs/design.md,
    "Settings: one schema")."""
    return "WORLD_SIZE" in os.environ and os.environ.get("RANK", "0") != "0"


def _command(ctx) -> str:
    """'paratrain train' for click's context of `train` (whatever the program name)."""
    names = []
    while ctx is not None and ctx.parent is not None:
        names.append(ctx.info_name)
        ctx = ctx.parent
    return " ".join(["paratrain", *reversed(names)])


def _given(flag: str, argv: list[str]) -> str | None:
    """The value that followed ``flag`` on the command line (``--lr x`` or ``--lr=x``)."""
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a[len(flag) + 1:]
    return None


def _example(flag: str, param) -> object:
    """A valid value for ``flag``: its setting's default, else the option's own."""
    for cls in (ModelConfig, TrainConfig, ParallelPlan):
        for f in dataclasses.fields(cls):
            if flag_of(f) == flag:
                return f.default
    return param.default


def usage_line(e, argv: list[str]) -> str:
    """One line for a click usage error (typer vendors click, so by attribute): the
    flag, the value, what it should be, the closest flag, where the help is."""
    ctx = getattr(e, "ctx", None)
    cmd = _command(ctx) if ctx else " ".join(["paratrain", *argv[:1]])
    see = f"see `{cmd} --help`"
    param = getattr(e, "param", None)
    if getattr(param, "param_type_name", "") == "option":
        flag = max(param.opts, key=len)
        value, msg, ex = _given(flag, argv), e.message, _example(flag, param)
        for word, want in (("integer", "an integer"), ("number", "a number")):
            if f"valid {word}" in msg:
                msg = f"is not {want}"
        return (f"{flag}: {value!r} {msg}" if value is not None else f"{flag}: {msg}") + \
            (f"; pass e.g. {flag} {ex}" if ex is not None else "") + f" ({see})"
    if hasattr(e, "possibilities"):  # NoSuchOption
        close = ", ".join(sorted(e.possibilities))
        return (f"{e.option_name} is not a flag of `{cmd}`"
                + (f"; did you mean {close}?" if close else "") + f" ({see})")
    return f"{e.format_message().rstrip('.')} ({see})"


def main(argv: list[str] | None = None) -> int:
    """Console entry point. Returns (and exits with) the command's exit code. A bad
    value or flag is one ``error:`` line on stderr and exit code 2."""
    args = sys.argv[1:] if argv is None else list(argv)
    line = None
    try:
        rv = app(args=args, standalone_mode=False)
    except (ValueError, FileNotFoundError, FloatingPointError) as e:
        line, code = " ".join(str(e).split("\n")), 2
    except (typer.Exit, typer.Abort, Exception) as e:
        # typer vendors click, so its exceptions are matched by behaviour, not class
        if hasattr(e, "show") and hasattr(e, "exit_code"):  # a usage error: exit 2
            line, code = usage_line(e, args), e.exit_code
        elif isinstance(e, typer.Exit) or hasattr(e, "exit_code"):
            code = e.exit_code
        elif isinstance(e, typer.Abort):
            print("aborted", file=sys.stderr)
            code = 1
        else:
            raise
    else:
        code = rv if isinstance(rv, int) else 0
    if line is not None and not _quiet_rank():
        print(f"error: {line}", file=sys.stderr)
    if argv is None:
        sys.exit(code)
    return code


if __name__ == "__main__":
    main()
