"""`paratrain train`."""

import typer


def register(app: typer.Typer) -> None:
    """Add the train command to the top-level app."""
