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


# a number as a table may print it: "~400", "8K", "128K tokens", "64 GPUs", "15.9k",
# "64 (8 nodes)"; its unit word kept ("nodes", "ms")
_WORDED = re.compile(r"^(?:~|about\s+)?\s*([0-9][0-9.,_]*)\s*([km])?"
                     r"(?:\s+([a-z][a-z/ ()-]*))?(?:\s*\(.*\))?$")
# a count written as a product: "8x8", "16 x 8 GPUs" (nodes times accelerators a node)
_PRODUCT = re.compile(r"^(\d+)\s*[x\u00d7*]\s*(\d+)(?:\s+[a-z][a-z/ ()-]*)?$")
# time units a step time may carry, in seconds
_TIME_UNITS = {"ms": 1e-3, "msec": 1e-3, "milliseconds": 1e-3, "min": 60.0, "minutes": 60.0}


def num(row: dict, key: str, kind=float):
    """The cell as a number, None when blank or no number (an int column: None unless
    whole); thousands separators, underscores and a trailing % are read as a table
    prints them ("15,876", "58.2%"), and so are a leading "~", a trailing unit word
    ("64 GPUs", "8192 tokens") and a K or M: binary in a whole-number column, where
    sizes are set ("8K" sequences are 8,192 tokens, "16K" GPUs 16,384, "4M" tokens a
    step 4,194,304), decimal in a measured one ("15.9k" tokens/s); a product ("8x8":
    nodes times accelerators) in a whole-number column; "ms" or "min" after a time; a
    count of "nodes" is no number of accelerators (None). A caller that fills a None in
    lists the default it applied."""
    v = (row.get(key) or "").strip().removesuffix("%").strip()
    scale = 1.0
    product = _PRODUCT.match(v.lower())
    if product and kind is int:
        return int(product.group(1)) * int(product.group(2))
    worded = _WORDED.match(v.lower())
    if worded:
        v, unit, word = worded.groups()
        if word and word.split()[0] in ("node", "nodes", "hosts"):
            return None  # a count of nodes is not one of accelerators
        base = 1024 if kind is int else 1000
        scale = {"k": base, "m": base ** 2}.get(unit, 1) * _TIME_UNITS.get(
            (word or "").split(" ")[0], 1.0)
    if _GROUPED.match(v):  # "15,876", "8_192": digits grouped in threes
        v = v.replace(",", "").replace("_", "")
    if not v:
        return None
    try:
        x = float(v) * scale
    except ValueError:
        return None
    return int(x) if kind is int and x == int(x) else (None if kind is int else x)
