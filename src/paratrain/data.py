"""Byte-level corpus and global batches that are identical for any world size.

- Tokens are bytes (vocabulary 256).
- Default corpus: the Python standard library's own ``.py`` source, found through
  ``sysconfig`` (present wherever Python is), files in sorted order, joined by newlines.
  It is cached once per Python version under ``~/.cache/paratrain`` as raw bytes.
- ``--data PATH``: any text file, or a folder (every regular file under it, sorted).
- Split: the last ``val_fraction`` of the bytes is validation, the rest training.
- The global batch of step k is a pure function of (seed, k): ``global_batch`` window
  starts drawn from a generator seeded with (seed, k). Rank r of W takes the contiguous
  slice ``[r*B/W, (r+1)*B/W)``, so 1 worker with 16 windows and 4 workers with 4 each
  see the same 16 windows.
"""

from __future__ import annotations

import math
import os
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

VOCAB = 256


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.parts))


def _cache_dir() -> Path:
    return Path.home() / ".cache" / "paratrain"  # beside the calibration profile


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def stdlib_corpus() -> bytes:
    """The standard library's .py files, sorted and newline-joined (cached)."""
    ver = ".".join(map(str, sys.version_info[:3]))
    cache = _cache_dir() / f"stdlib-{ver}-{sys.implementation.name}.bytes"
    if cache.is_file():
        return cache.read_bytes()
    data = b"\n".join(p.read_bytes() for p in _stdlib_files())
    try:
        _write_atomic(cache, data)
    except OSError:  # read-only home: fine, just slower next time
        pass
    return data


def read_corpus(path: str | None) -> bytes:
    """Bytes of the corpus at ``path`` (file or folder), or the default corpus."""
    if path is None:
        return stdlib_corpus()
    p = Path(path)
    if not p.exists():
        raise ValueError(f"data path {path!r} does not exist; pass an existing file or folder "
                         "to --data, or omit it to use the Python standard library")
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
    data = b"\n".join(f.read_bytes() for f in files)
    if not data.strip():
        raise ValueError(f"data path {path!r} holds no text; point --data at a non-empty "
                         "text file or folder")
    return data


@dataclass
class Corpus:
    """Train/validation split of a byte corpus, and the batches drawn from it."""

    train: torch.Tensor  # uint8, 1-D
    val: torch.Tensor

    @classmethod
    def load(cls, path: str | None, val_fraction: float, context: int) -> Corpus:
        data = torch.from_numpy(np.frombuffer(read_corpus(path), dtype=np.uint8).copy())
        n_val = int(len(data) * val_fraction)
        need = context + 1
        if len(data) - n_val < need or n_val < need:
            raise ValueError(
                f"corpus of {len(data)} bytes is too small for context {context} with "
                f"val_fraction {val_fraction}; use more text (at least "
                f"{math.ceil(need / min(val_fraction, 1 - val_fraction))} bytes) or a "
                "shorter --context")
        return cls(train=data[: len(data) - n_val], val=data[len(data) - n_val:])

    def unigram_entropy(self) -> float:
        """Cross-entropy (nats/byte) of the best context-free model: the baseline to beat."""
        counts = torch.bincount(self.train.long(), minlength=VOCAB).double()
        p = counts[counts > 0] / counts.sum()
        return float(-(p * p.log()).sum())

    @staticmethod
    def _windows(src: torch.Tensor, starts: torch.Tensor, context: int):
        idx = starts[:, None] + torch.arange(context + 1)[None, :]
        w = src[idx].long()
        return w[:, :-1], w[:, 1:]

    def batch(self, seed: int, step: int, global_batch: int, context: int,
              rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice (x, y), each (B/W, T) int64, of the global batch of ``step``."""
        if global_batch % world:
            raise ValueError(f"global batch {global_batch} is not divisible by {world} "
                             f"workers; use a multiple of {world}")
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.train) - context - 1, (global_batch,), generator=g)
        per = global_batch // world
        return self._windows(self.train, starts[rank * per:(rank + 1) * per], context)

    def val_batches(self, n_batches: int, global_batch: int, context: int,
                    rank: int = 0, world: int = 1):
        """Fixed validation windows, evenly spaced over the split; this rank's slices."""
        total = n_batches * global_batch
        span = len(self.val) - context - 1
        starts = torch.linspace(0, span, total).long()
        per = global_batch // world
        for b in range(n_batches):
            s = starts[b * global_batch:(b + 1) * global_batch]
            yield self._windows(self.val, s[rank * per:(rank + 1) * per], context)
