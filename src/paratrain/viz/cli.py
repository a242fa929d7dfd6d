"""`paratrain viz ...` sub-commands (ring, tree, pipeline)."""

import typer

app = typer.Typer(no_args_is_help=True)
