"""`paratrain bench ...` sub-commands (collectives, calibrate)."""

import typer

app = typer.Typer(no_args_is_help=True)
