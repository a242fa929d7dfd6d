"""Shared loader for the package's TOML catalogues and users' TOML/JSON files.

A catalogue is a TOML file of tables, one per entry, each with a ``name`` and optional
``aliases``. Lookup is case-insensitive over the table key, the name and the aliases, so
``h100``, ``H100-SXM5-80GB`` and ``h100-sxm`` all find the same entry.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

from paratrain.config import read_toml

DATA_DIR = Path(__file__).parent / "data"


@cache
def read_catalogue(filename: str) -> dict[str, dict]:
    """Entries of ``data/<filename>`` keyed by their table key."""
    return read_toml(DATA_DIR / filename)


def _norm(s: str) -> str:
    return s.strip().lower().replace("_", "-").replace(" ", "-")


@cache
def _keys_by_name(filename: str) -> dict[str, str]:
    """Each entry's key, name and aliases (normalised) -> its key; on a clash the earlier
    entry of the file keeps the name."""
    index: dict[str, str] = {}
    for key, fields in read_catalogue(filename).items():
        for n in (key, fields.get("name", key), *fields.get("aliases", [])):
            index.setdefault(_norm(n), key)
    return index


# what a Hugging Face repository id adds to a model's name: the owner ("meta-llama/"), a
# "Meta-" prefix, and a release suffix ("-hf", "-Base", "-Instruct", "-pt", "-v0.1")
_HUB_SUFFIX = re.compile(r"-(hf|base|instruct|chat|it|pt|v\d+(\.\d+)?)$")


def hub_variants(want: str) -> list[str]:
    """``want`` (normalised), then the names a Hugging Face repository id such as
    "meta-llama/Meta-Llama-3.1-405B-hf" or "Qwen/Qwen3-30B-A3B-Base" stands for: without
    its owner, its "meta-" prefix, and its release suffixes, one at a time."""
    out = [want]
    name = want.rsplit("/", 1)[-1]
    if name.startswith("meta-"):
        name = name[len("meta-"):]
    while True:
        if name not in out:
            out.append(name)
        shorter = _HUB_SUFFIX.sub("", name)
        if shorter == name:
            return out
        name = shorter


def named_in(text: str, filename: str) -> str | None:
    """The key of the longest catalogue key, name or alias that ``text`` contains as whole
    words ("Mixtral 8x22B MoE run" names mixtral-8x22b; "Llama 3.1 8B" does not name
    Llama 3 8B), or None."""
    def words(s: str) -> str:
        return "-" + re.sub(r"[^a-z0-9.]+", "-", s.lower()).strip("-") + "-"

    padded = words(text)
    found = [(len(n), key) for key, fields in read_catalogue(filename).items()
             for n in (key, fields.get("name", key), *fields.get("aliases", []))
             if words(n) in padded]
    return max(found)[1] if found else None


def read_file(path: Path) -> dict:
    """One entry from a user's ``.toml`` or ``.json`` file (a flat table of keys)."""
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"{str(path)!r} is not UTF-8 text (byte "
                             f"{e.object[e.start]:#04x} at offset {e.start}); save it as "
                             "UTF-8") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{str(path)!r} is not valid JSON ({e.msg} at line {e.lineno}, "
                             f"column {e.colno}); fix that line") from None
    else:  # read_toml names the file when it is not UTF-8 or not TOML
        data = read_toml(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a table of keys; write key = value pairs")
    return data


def lookup(name_or_path: str, filename: str, kind: str) -> tuple[str, dict]:
    """Find a catalogue entry by key/name/alias, or read ``name_or_path`` as a file.

    Returns (key, fields); the key is the table key, or the file's stem.
    """
    p = Path(name_or_path)
    if p.suffix.lower() in (".toml", ".json"):
        if not p.is_file():
            raise ValueError(f"{kind} file {name_or_path!r} does not exist; pass an existing path")
        return p.stem, read_file(p)
    entries, index = read_catalogue(filename), _keys_by_name(filename)
    for want in hub_variants(_norm(name_or_path)):
        if want in index:
            return index[want], dict(entries[index[want]])
    known = ", ".join(entries)
    raise ValueError(
        f"unknown {kind} {name_or_path!r}; choose one of {known} or pass a .toml/.json file"
    )
