"""What every runs-table reader shares: a number from a cell, the refusal of a row
(:class:`Skip`) and the shape of a default applied to a blank (``Default``)."""

from __future__ import annotations

import re

_GROUPED = re.compile(r"^\d{1,3}([,_]\d{3})+(\.\d+)?$")

Default = tuple[str, object, str]  # (column, value applied, why): a blank filled in, said so


class Skip(Exception):
    """A row the model cannot price; the message is the reason, ``defaults`` those applied
    before it was refused (often the reason: a blank TP or PP)."""

    def __init__(self, reason: str, defaults: tuple = ()):
        super().__init__(reason)
        self.defaults = tuple(defaults)


def num(row: dict, key: str, kind=float):
    """The cell as a number, None when blank or no number (an int column: None unless
    whole); thousands separators, underscores and a trailing % are read as a table
    prints them ("15,876", "58.2%"). A caller that fills a None in lists the default it
    applied."""
    v = (row.get(key) or "").strip().removesuffix("%").strip()
    if _GROUPED.match(v):  # "15,876", "8_192": digits grouped in threes
        v = v.replace(",", "").replace("_", "")
    if not v:
        return None
    try:
        x = float(v)
    except ValueError:
        return None
    return int(x) if kind is int and x == int(x) else (None if kind is int else x)
