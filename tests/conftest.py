"""Shared fixtures: a small real text corpus on disk and tiny model settings."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from paratrain.config import ModelConfig, flag_for

CORPUS = Path(__file__).parent / "data" / "corpus.txt.gz"

# The tests' tiny decoder (2 blocks, d_model 32, 4 heads, SwiGLU 64, context 16): one
# definition, varied with TINY.replace(...) where a test needs another shape.
TINY = ModelConfig(n_layers=2, d_model=32, n_heads=4, d_ff=64, context=16)


def tiny_flags(cfg: ModelConfig = TINY) -> list[str]:
    """``cfg``'s shape as `paratrain train` flags (the flag names come from the schema)."""
    names = ("n_layers", "d_model", "n_heads", "d_ff", "context")
    return [a for n in names for a in (flag_for(n), str(getattr(cfg, n)))]


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


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's in-process models: tiny matrices on a shared
    2-core machine run far faster so (``pytestmark = pytest.mark.usefixtures(...)``)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def parity_tcfg(data: str):
    """The short float64 run the composition parity tests train (4 steps of 8 windows)."""
    from paratrain.config import TrainConfig

    return TrainConfig(steps=4, global_batch=8, lr=1e-2, warmup_steps=2, eval_every=0,
                       eval_batches=1, dtype="float64", data=data)
