"""The command-line layer: `paratrain train | plan | validate | check-model | report | bench
| viz | generate | export`, each a thin module that parses and hands over."""

from paratrain.cli.app import main  # noqa: F401 - the `paratrain` console script

__all__ = ["main"]
