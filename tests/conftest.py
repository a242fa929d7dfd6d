"""Shared fixtures: a small real text corpus on disk and tiny model settings."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> str:
    """~200 KB of real Python source (this repo's and the json module's) as an ASCII text
    file."""
    src = [Path(inspect.getfile(json)).parent, Path(__file__).parents[1] / "src"]
    parts = []
    for root in src:
        parts += [p.read_text() for p in sorted(root.rglob("*.py"))]
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    # ASCII only: tests train models with vocabularies under 256 (e.g. 131, split unevenly
    # over ranks), which every byte of an ASCII text fits
    path.write_text("\n".join(parts).encode("ascii", "ignore").decode())
    return str(path)


@pytest.fixture(scope="session")
def paratrain_exe() -> str:
    """The installed console script, beside this interpreter (no PATH or shim needed)."""
    import shutil
    import sys

    here = Path(sys.executable).with_name("paratrain")
    exe = str(here) if here.exists() else shutil.which("paratrain")
    assert exe, "the paratrain console script is not installed; run pip install -e '.[dev]'"
    return exe


def max_rel_diff(losses, ref) -> float:
    """Largest relative difference between two loss trajectories of equal length."""
    return max(abs(a - b) / abs(b) for a, b in zip(losses, ref, strict=True))
