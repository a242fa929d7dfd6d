"""Shared fixtures: a small real text corpus on disk and tiny model settings."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

CORPUS = Path(__file__).parent / "data" / "corpus.txt.gz"


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> str:
    """~880 KB of real Python source as an ASCII text file: a frozen snapshot of this
    repository's own sources (tests/data/corpus.txt.gz), so the corpus is the same on every
    commit and every Python version. ASCII only: tests train models with vocabularies
    under 256 (e.g. 131, split unevenly over ranks), which every byte of it fits."""
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_bytes(gzip.decompress(CORPUS.read_bytes()))
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
