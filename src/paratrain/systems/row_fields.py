"""What every runs-table reader shares: a number from a cell, the refusal of a row
(:class:`Skip`) and the shape of a default applied to a blank (``Default``)."""

from __future__ import annotations

Default = tuple[str, object, str]  # (column, value applied, why): a blank filled in, said so


class Skip(Exception):
    """A row the model cannot price; the message is the reason, ``defaults`` those applied
    before it was refused (often the reason: a blank TP or PP)."""

    def __init__(self, reason: str, defaults: tuple = ()):
        super().__init__(reason)
        self.defaults = tuple(defaults)


def num(row: dict, key: str, kind=float):
    """The cell as a number, None when blank or no number (an int column: None unless
    whole); a caller that fills a None in lists the default it applied."""
    v = (row.get(key) or "").strip()
    if not v:
        return None
    try:
        x = float(v)
    except ValueError:
        return None
    return int(x) if kind is int and x == int(x) else (None if kind is int else x)
