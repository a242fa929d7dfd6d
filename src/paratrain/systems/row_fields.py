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


# a number as a table may print it: "~400", "8K", "128K tokens", "64 GPUs", "15.9k"
_WORDED = re.compile(r"^(?:~|about\s+)?\s*([0-9][0-9.,_]*)\s*([km])?(?:\s+[a-z][a-z/ ()-]*)?$")


def num(row: dict, key: str, kind=float):
    """The cell as a number, None when blank or no number (an int column: None unless
    whole); thousands separators, underscores and a trailing % are read as a table
    prints them ("15,876", "58.2%"), and so are a leading "~", a trailing unit word
    ("64 GPUs", "8192 tokens") and a K or M: binary in a whole-number column, where
    sizes are set ("8K" sequences are 8,192 tokens, "16K" GPUs 16,384, "4M" tokens a
    step 4,194,304), decimal in a measured one ("15.9k" tokens/s). A caller that fills
    a None in lists the default it applied."""
    v = (row.get(key) or "").strip().removesuffix("%").strip()
    scale = 1.0
    worded = _WORDED.match(v.lower())
    if worded:
        v, unit = worded.groups()
        base = 1024 if kind is int else 1000
        scale = {"k": base, "m": base ** 2}.get(unit, 1)
    if _GROUPED.match(v):  # "15,876", "8_192": digits grouped in threes
        v = v.replace(",", "").replace("_", "")
    if not v:
        return None
    try:
        x = float(v) * scale
    except ValueError:
        return None
    return int(x) if kind is int and x == int(x) else (None if kind is int else x)
