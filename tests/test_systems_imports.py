"""Import rules read from the source with ``ast`` (nothing is imported to check them).

- Python 3.10 is declared supported, so ``tomllib`` (3.11+) may only be imported under a
  ``sys.version_info`` guard; only ``config.py`` does it (its ``read_toml`` is the one reader).
- The systems model never imports the plots: the dependency runs viz -> systems only.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "paratrain"
SYSTEMS = SRC / "systems"


def _imports(tree: ast.AST):
    """(module name, node, guarded) for every import; guarded = under an ``if`` whose test
    reads ``sys.version_info``."""
    def walk(node, guarded):
        for child in ast.iter_child_nodes(node):
            g = guarded
            if isinstance(child, ast.If) and "version_info" in ast.unparse(child.test):
                g = True
            if isinstance(child, ast.Import):
                for a in child.names:
                    yield a.name, child, g
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                yield child.module, child, g
                for a in child.names:
                    yield f"{child.module}.{a.name}", child, g
            yield from walk(child, g)

    yield from walk(tree, False)


def _modules(root: Path):
    for path in sorted(root.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def test_tomllib_is_imported_only_under_a_version_guard():
    bare = [f"{p.relative_to(SRC)}:{n.lineno}" for p, tree in _modules(SRC)
            for name, n, guarded in _imports(tree)
            if name.split(".")[0] == "tomllib" and not guarded]
    assert not bare, f"bare `import tomllib` breaks Python 3.10: {bare}"


def test_the_package_reads_toml_through_one_helper():
    others = [f"{p.relative_to(SRC)}:{n.lineno}" for p, tree in _modules(SRC)
              if p != SRC / "config.py"
              for name, n, _ in _imports(tree) if name.split(".")[0] in ("tomllib", "tomli")]
    assert not others, f"use paratrain.config.read_toml instead: {others}"


def test_systems_never_imports_viz():
    bad = [f"{p.relative_to(SRC)}:{n.lineno} imports {name}" for p, tree in _modules(SYSTEMS)
           for name, n, _ in _imports(tree)
           if name == "paratrain.viz" or name.startswith("paratrain.viz.")]
    assert not bad, f"systems/ must not depend on viz/ (viz -> systems only): {bad}"
