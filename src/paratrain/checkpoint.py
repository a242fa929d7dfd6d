"""Rank-aware checkpoints, written atomically and verified on load.

Layout::

    DIR/step_000010/rank0.pt, rank1.pt, ...   each rank's share of the state
    DIR/step_000010/meta.json                 step, world size, plan, sha256 of each file
    DIR/latest                                "step_000010"

Each rank writes its file into ``step_XXXXXX.tmp`` (temp file + rename), then rank 0
writes ``meta.json`` with every file's checksum and renames the directory into place;
``latest`` is replaced atomically last. A crash at any point leaves the previous
checkpoint intact. Loading checks the checksum and uses ``weights_only=True``: no
arbitrary pickle is ever executed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(root: str | Path, step: int, state: dict, meta: dict, rank: int = 0,
         world: int = 1) -> Path:
    """Write this rank's ``state`` for ``step``; collective over all ranks."""
    root = Path(root)
    name = f"step_{step:06d}"
    tmp_dir, final = root / f"{name}.tmp", root / name
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp_dir, ignore_errors=True)
        tmp_dir.mkdir()
    _barrier()
    fd, tmp = tempfile.mkstemp(dir=tmp_dir, prefix=f"rank{rank}.")
    with os.fdopen(fd, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, tmp_dir / f"rank{rank}.pt")
    _barrier()
    if rank == 0:
        files = {f"rank{r}.pt": _sha256(tmp_dir / f"rank{r}.pt") for r in range(world)}
        full = dict(meta, step=step, world_size=world, files=files)
        _atomic_write_bytes(tmp_dir / "meta.json", json.dumps(full, indent=1).encode())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp_dir, final)
        _atomic_write_bytes(root / "latest", name.encode())
    _barrier()
    return final


def latest(root: str | Path) -> Path | None:
    p = Path(root) / "latest"
    return Path(root) / p.read_text().strip() if p.is_file() else None


def load(root: str | Path, rank: int = 0, world: int = 1,
         expect: dict | None = None) -> tuple[int, dict]:
    """Return (step, this rank's state) of the latest checkpoint under ``root``.

    ``expect``: meta fields that must match (e.g. the plan and model), so a checkpoint
    from a different layout is refused with a clear message instead of loading garbage.
    """
    ckpt = latest(root)
    if ckpt is None or not (ckpt / "meta.json").is_file():
        raise ValueError(f"no checkpoint found in {str(root)!r}; run without --resume first, "
                         "or point --checkpoint-dir at a directory that has one")
    meta = json.loads((ckpt / "meta.json").read_text())
    if meta["world_size"] != world:
        raise ValueError(f"checkpoint {ckpt} was written by {meta['world_size']} processes but "
                         f"this run has {world}; resume with --nproc {meta['world_size']}")
    for key, want in (expect or {}).items():
        if meta.get(key) != want:
            raise ValueError(f"checkpoint {ckpt} has {key}={meta.get(key)!r} but this run has "
                             f"{want!r}; resume with the same settings")
    path = ckpt / f"rank{rank}.pt"
    if _sha256(path) != meta["files"][path.name]:
        raise ValueError(f"checkpoint file {path} is corrupt (sha256 mismatch); "
                         "delete that step directory to fall back to an earlier one")
    state = torch.load(path, map_location="cpu", weights_only=True)
    return int(meta["step"]), state
