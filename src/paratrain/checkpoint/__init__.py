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

Loading does not trust ``latest``: it tries the step directories newest first; each rank
verifies its own file (present, checksum, loadable) and the ranks agree with one
all-reduce before anyone uses a step, so a corrupt, truncated or missing rank file makes
every rank fall back to the newest intact step together (rank 0 prints one
``warning:`` line per step skipped). Stale ``step_*.tmp`` directories (a crash during a
save) are removed by the next save or load.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
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


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def steps(root: str | Path) -> list[int]:
    """Steps with a (renamed-into-place) directory under ``root``, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [int(m.group(1)) for p in root.iterdir()
             if p.is_dir() and (m := re.fullmatch(r"step_(\d+)", p.name))]
    return sorted(found, reverse=True)


def _remove_stale_tmp(root: Path, keep: str | None = None) -> None:
    if root.is_dir():
        for p in root.glob("step_*.tmp"):
            if p.name != keep:
                shutil.rmtree(p, ignore_errors=True)


def save(root: str | Path, step: int, state: dict, meta: dict, rank: int = 0,
         world: int = 1) -> Path:
    """Write this rank's ``state`` for ``step``; collective over all ranks."""
    root = Path(root)
    name = f"step_{step:06d}"
    tmp_dir, final = root / f"{name}.tmp", root / name
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale_tmp(root)
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
    """The directory ``latest`` names (a hint only: :func:`load` verifies every step)."""
    p = Path(root) / "latest"
    return Path(root) / p.read_text().strip() if p.is_file() else None


def peek(root: str | Path) -> dict | None:
    """meta.json of the newest step whose meta parses (no rank files are read): what the
    launcher checks before starting workers. None when there is none."""
    for step in steps(root):
        try:
            return json.loads((step_dir(root, step) / "meta.json").read_text())
        except (OSError, ValueError):
            continue
    return None


def _verify(ckpt: Path, rank: int) -> tuple[dict | None, str]:
    """(this rank's state, "") if its file in ``ckpt`` is intact, else (None, reason)."""
    try:
        meta = json.loads((ckpt / "meta.json").read_text())
        name = f"rank{rank}.pt"
        path = ckpt / name
        if not path.is_file():
            return None, f"{name} is missing"
        if _sha256(path) != meta["files"].get(name):
            return None, f"{name} fails its sha256 check"
        return torch.load(path, map_location="cpu", weights_only=True), ""
    except Exception as e:  # unreadable meta, truncated pickle, ...: not this step
        return None, f"{type(e).__name__}: {e}".splitlines()[0]


def _all_ok(ok: bool, world: int, device: torch.device | None) -> list[int]:
    """Ranks whose check failed, the same list on every rank (one all-reduce)."""
    if world == 1 or not dist.is_initialized():
        return [] if ok else [0]
    flags = torch.zeros(world, dtype=torch.int32, device=device or "cpu")
    flags[dist.get_rank()] = 0 if ok else 1
    dist.all_reduce(flags)
    return [r for r in range(world) if flags[r]]


def load(root: str | Path, rank: int = 0, world: int = 1,
         expect: dict | None = None, device: torch.device | None = None) -> tuple[int, dict]:
    """Return (step, this rank's state) of the newest intact checkpoint under ``root``.

    ``expect``: meta fields that must match (e.g. the plan and model), so a checkpoint
    from a different layout is refused with a clear message instead of loading garbage.
    Collective when ``world > 1`` (every rank calls it); ``device``: where the agreement
    all-reduce runs (the group's device, e.g. CUDA under NCCL).
    """
    root = Path(root)
    if rank == 0:
        _remove_stale_tmp(root)
    candidates = steps(root)
    metas = [m for m in (_meta(root, s) for s in candidates) if m is not None]
    if not metas:
        raise ValueError(f"no checkpoint found in {str(root)!r}; run without --resume first, "
                         "or point --checkpoint-dir at a directory that has one")
    meta = metas[0]
    if meta["world_size"] != world:
        raise ValueError(f"checkpoint {step_dir(root, meta['step'])} was written by "
                         f"{meta['world_size']} processes but this run has {world}; resume "
                         f"with --nproc {meta['world_size']}")
    for key, want in (expect or {}).items():
        if meta.get(key) != want:
            raise ValueError(f"checkpoint {step_dir(root, meta['step'])} has {key}="
                             f"{meta.get(key)!r} but this run has {want!r}; resume with the "
                             "same settings")
    for i, step in enumerate(candidates):
        state, why = _verify(step_dir(root, step), rank)
        bad = _all_ok(state is not None, world, device)
        if not bad:
            return step, state
        reasons = [why]
        if world > 1 and dist.is_initialized():
            reasons = [None] * world
            dist.all_gather_object(reasons, why)
        if rank == 0:
            nxt = f"step_{candidates[i + 1]:06d}" if i + 1 < len(candidates) else "nothing"
            said = "; ".join(f"rank {r}: {reasons[r]}" for r in bad)
            print(f"warning: checkpoint {step_dir(root, step)} is not intact ({said}); "
                  f"falling back to {nxt}", file=sys.stderr, flush=True)
    raise ValueError(f"no intact checkpoint in {str(root)!r} (every step failed "
                     "verification); start again without --resume")


def _meta(root: Path, step: int) -> dict | None:
    try:
        return json.loads((step_dir(root, step) / "meta.json").read_text())
    except (OSError, ValueError):
        return None


from paratrain.checkpoint.full import load_full_model as load_full_model  # noqa: E402
