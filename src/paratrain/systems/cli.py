"""`paratrain plan` and `paratrain validate`."""

import typer


def register(app: typer.Typer) -> None:
    """Add the systems-model commands to the top-level app."""
