"""The package's import order, read from the source with ``ast`` (nothing is imported).

Each top-level module or folder of ``paratrain`` has a place in :data:`ORDER`, bottom
first; every import, also one inside a function, goes to a place at or below the
importer's own. So there is no import cycle between folders, and a path through the code
(``paratrain train``: cli -> run -> files -> predict -> parallel -> ... -> cost) only ever
goes down. docs/design.md ("Package layout") says what each place holds.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "paratrain"

ORDER = ["config", "plan", "cost", "comm", "model", "systems", "parallel", "bench",
         "predict", "files", "run", "viz", "cli"]
TORCH_FREE = ["config", "plan", "cost", "systems"]  # `paratrain plan` answers at once


def _place(path: Path) -> str:
    rel = path.relative_to(SRC).parts
    return rel[0] if len(rel) > 1 else path.stem


def _paratrain_imports(path: Path):
    """(line, place imported) for every ``paratrain.X`` import in the file, lazy ones too."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] if node.module != "paratrain" else \
                [f"paratrain.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "paratrain" and len(parts) > 1:
                yield node.lineno, parts[1]


def _modules():
    return [p for p in sorted(SRC.rglob("*.py")) if p.name != "__init__.py" or
            p.parent != SRC]


def test_every_place_is_in_the_order():
    places = {_place(p) for p in _modules()}
    assert places <= set(ORDER), f"add {sorted(places - set(ORDER))} to ORDER"
    assert set(ORDER) <= places, f"ORDER names what is gone: {sorted(set(ORDER) - places)}"


def test_imports_only_go_down():
    climbs = []
    for path in _modules():
        me = ORDER.index(_place(path))
        for line, other in _paratrain_imports(path):
            if other in ORDER and ORDER.index(other) > me:
                climbs.append(f"{path.relative_to(SRC)}:{line} imports {other}")
    assert not climbs, "imports that climb the order:\n" + "\n".join(climbs)


def test_the_cost_model_never_imports_torch():
    bad = []
    for path in _modules():
        if _place(path) not in TORCH_FREE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path.relative_to(SRC)}:{node.lineno}" for m in mods
                    if m.split(".")[0] == "torch"]
    assert not bad, f"torch-free packages import torch: {bad}"
