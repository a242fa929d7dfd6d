"""A run written as the TOML `paratrain train --config FILE` reads (``plan --emit-config``).

Three tables, ``[model]``, ``[train]`` and ``[plan]``, each holding every field of its
dataclass whose value differs from the default (so the file says what was chosen, and a
later change of a default does not hide in it), ``dp`` always (the world size it was
planned for is then explicit). ``None`` values are left out: TOML has no null, and a
missing key is the default. Reading it back through :func:`paratrain.cli.settings.resolve`
gives the same three values (a test round-trips it). No torch here.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from paratrain.config import ModelConfig, TrainConfig
from paratrain.files.atomic import write_atomic
from paratrain.plan import ParallelPlan


def _value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"{v!r} has no TOML spelling here")
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    raise TypeError(f"cannot write {v!r} ({type(v).__name__}) to TOML")


def _table(name: str, value, always: tuple[str, ...] = ()) -> list[str]:
    default = type(value)()
    lines = [f"[{name}]"]
    for f in dataclasses.fields(value):
        v = getattr(value, f.name)
        if v is None or (v == getattr(default, f.name) and f.name not in always):
            continue
        lines.append(f"{f.name} = {_value(v)}")
    return lines


def run_toml(mcfg: ModelConfig, tcfg: TrainConfig, plan: ParallelPlan, header: str = ""
             ) -> str:
    """The text of the TOML (``header``: comment lines put first)."""
    mcfg = ModelConfig(**{f.name: getattr(mcfg, f.name)
                          for f in dataclasses.fields(ModelConfig)})  # a shape's extras out
    out = [f"# {line}" for line in header.splitlines()]
    for lines in (_table("model", mcfg), _table("train", tcfg),
                  _table("plan", plan, always=("dp",))):
        out += ([""] if out else []) + lines
    return "\n".join(out) + "\n"


def write_run_toml(path: str | Path, mcfg: ModelConfig, tcfg: TrainConfig,
                   plan: ParallelPlan, header: str = "") -> Path:
    """Write :func:`run_toml` to ``path`` atomically (:func:`paratrain.files.atomic.
    write_atomic`; its folder is checked before any work by the caller)."""
    path = Path(path)
    write_atomic(path, run_toml(mcfg, tcfg, plan, header).encode())
    return path


def check_writable(path: str | Path, flag: str = "--emit-config") -> None:
    """Refuse, before any work, a ``path`` whose folder is missing or not writable, or
    that is a directory."""
    import os

    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise ValueError(f"{flag} {path}: is a directory; give a file name, e.g. run.toml")
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: folder {str(parent)!r} does not exist; create it "
                         "or pick another path")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{flag} {path}: folder {str(parent)!r} is not writable; pick "
                         "another path")
