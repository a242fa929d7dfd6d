"""Checkpoints that any layout can resume: sharded, atomic, verified, agreed on.

Layout::

    DIR/step_000010/.metadata, __0_0.distcp, ...   torch.distributed.checkpoint files
    DIR/step_000010/meta.json                      step, settings, data identity, sha256s
    DIR/latest                                     "step_000010" (a hint only)

Each rank writes the pieces of the plain model's tensors it owns (:mod:`.pieces`,
:mod:`.sharded`) into ``step_XXXXXX.tmp``; rank 0 then hashes every file into
``meta.json`` and renames the directory into place; ``latest`` is replaced atomically
last. A crash at any point leaves the previous checkpoint intact; the next save or load
removes the stale ``.tmp``. ``keep``: the step written and the K - 1 newest intact steps
below it are kept, steps above it are not touched (:mod:`.prune`). Files follow the
user's umask (:mod:`.atomic`).

Importing this package does not import torch (the launcher reads meta.json with it).

Loading does not trust ``latest``: it tries the step directories newest first. The
ranks split the files of a step between them, each checks meta.json's schema and its
share of the files (present, sha256: :mod:`.verify`) and reads DCP's ``.metadata`` with a
restricted unpickler (:mod:`.safe_metadata`: a crafted pickle runs no code), and they
agree with one all-reduce before anyone reads; a step that fails anywhere, or whose read
fails, is skipped by every rank together, with one ``warning:`` line (rank 0).
The settings that decide the loss trajectory (model, seed, batch, optimizer, dtype,
data identity) must match the checkpoint's; the refusal names the field. The layout
(world size, dp/tp/pp/ep/cp, ZeRO stage, micro-batches) may differ: every rank reads
the pieces its new layout owns, except a top-k run (``--compress``), whose per-rank
residuals resume on the same layout only. Design notes: docs/faults.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from pathlib import Path

from paratrain.files.atomic import write_atomic
from paratrain.files.checkpoint.verify import FORMAT, check_step, fallback_line, read_meta_why
from paratrain.files.checkpoint.verify import sha256_file as _sha256
from paratrain.files.checkpoint.verify import verify_files as verify_files


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    import torch.distributed as dist

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


def remove_stale(root: str | Path) -> list[str]:
    """Delete ``step_*.tmp`` directories (a save that crashed); their names."""
    root = Path(root)
    gone = []
    if root.is_dir():
        for p in root.glob("step_*.tmp"):
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p.name)
    return gone


def read_meta(d: Path) -> dict | None:
    """Step ``d``'s meta.json when it parses and has the schema (:mod:`.verify`)."""
    return read_meta_why(d)[0]


def _meta(root: Path, step: int) -> dict | None:
    return read_meta(step_dir(root, step))


TRAJECTORY = ("seed", "global_batch", "lr", "min_lr_ratio", "warmup_steps", "weight_decay",
              "beta1", "beta2", "grad_clip", "dtype", "val_fraction")


def run_settings(mcfg, tcfg, plan, data_sha256: str) -> dict:
    """What decides the loss trajectory, recorded in meta.json and checked on resume:
    the model, the optimisation settings, gradient compression (lossy, with state of its
    own) and the data's identity (sha256 of the corpus bytes, :func:`data_sha256`; the
    path for the message). Not the layout, and not ``steps`` (a run may be extended;
    the cosine schedule follows)."""
    from dataclasses import asdict

    train = {k: getattr(tcfg, k) for k in TRAJECTORY}
    if tcfg.dtype == "bfloat16":
        train["reduce_dtype"] = tcfg.reduce_dtype
    return {"model": asdict(mcfg), "train": train, "compress": plan.compress,
            "data": {"sha256": data_sha256, "path": tcfg.data or "(standard library)"}}


RESIDUAL_LAYOUT = ("dp", "tp", "pp", "cp", "ep", "virtual_stages")


def check_residual_layout(meta: dict, plan, where: Path) -> None:
    """Refuse to resume a top-k run on another layout. Each rank's error-feedback
    residual (:mod:`paratrain.parallel.compress`) is saved whole, per rank: it is what
    that rank's gradients have not yet delivered, not a piece of a model tensor. Another
    layout has other ranks holding other parameters, and top-k's picks are not linear in
    the residual, so no redistribution would continue the trajectory (docs/faults.md)."""
    if plan.compress is None or meta.get("compress") is None:
        return
    have = meta.get("plan", {})
    for k in RESIDUAL_LAYOUT:
        if have.get(k, 1) != getattr(plan, k):
            raise ValueError(
                f"checkpoint {where} holds per-rank top-k residuals for {k}={have.get(k, 1)} "
                f"but this run has {k}={getattr(plan, k)}; resume a --compress run on the "
                f"same layout (--{k.replace('_', '-')} {have.get(k, 1)}, same --nproc), or "
                "start a new --checkpoint-dir")


def data_sha256(data: bytes) -> str:
    """The corpus's identity: sha256 of its bytes (train and validation, in order)."""
    return hashlib.sha256(data).hexdigest()


def save(root: str | Path, step: int, engine, mcfg, plan, meta: dict, keep: int = 0) -> Path:
    """Write ``engine``'s state at ``step``; collective over all ranks. ``keep`` > 0:
    afterwards delete what :mod:`.prune` says (never this step, nothing above it)."""
    from paratrain.files.checkpoint.prune import prune, remember_intact
    from paratrain.files.checkpoint.sharded import save_pieces

    rank, world = _rank_world()
    root = Path(root)
    name = f"step_{step:06d}"
    tmp_dir, final = root / f"{name}.tmp", root / name
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        remove_stale(root)
        tmp_dir.mkdir()
    _barrier()
    save_pieces(tmp_dir, engine)
    _barrier()
    if rank == 0:
        files = {p.name: _sha256(p) for p in sorted(tmp_dir.iterdir()) if p.is_file()}
        from dataclasses import asdict

        full = dict(meta, format=FORMAT, step=step, world_size=world, plan=asdict(plan),
                    files=files)
        write_atomic(tmp_dir / "meta.json", json.dumps(full, indent=1).encode())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp_dir, final)
        remember_intact(final)
        write_atomic(root / "latest", name.encode())
        prune(root, steps(root), step, keep, step_dir)
    _barrier()
    return final


def latest(root: str | Path) -> Path | None:
    """The directory ``latest`` names (a hint only: :func:`load` verifies every step)."""
    p = Path(root) / "latest"
    return Path(root) / p.read_text().strip() if p.is_file() else None


def peek(root: str | Path) -> dict | None:
    """meta.json of the newest intact step (meta has the schema, every file present with
    its sha256; no tensor or pickle is read): what the launcher checks before starting
    workers, so a damaged newest step does not decide the checks. None when there is
    none. (A crafted ``.metadata`` with matching sha256s passes here and is refused by
    the restricted unpickler where the workers read it: :mod:`.safe_metadata`.)"""
    for step in steps(root):
        meta, _ = check_step(step_dir(root, step))
        if meta is not None and meta.get("format", 1) == FORMAT:  # format 1: full.py only
            return meta
    return None


def _failed_ranks(ok: bool, world: int, device) -> list[int]:
    """Ranks whose check failed, the same list on every rank (one all-reduce)."""
    import torch
    import torch.distributed as dist

    if world == 1 or not dist.is_initialized():
        return [] if ok else [0]
    flags = torch.zeros(world, dtype=torch.int32, device=device or "cpu")
    flags[dist.get_rank()] = 0 if ok else 1
    dist.all_reduce(flags)
    return [r for r in range(world) if flags[r]]


def check_settings(meta: dict, expect: dict, where: Path) -> None:
    """Refuse a checkpoint whose trajectory settings differ, naming the first field."""
    for key, want in expect.items():
        have = meta.get(key)
        if key == "data" and isinstance(have, dict) and have.get("sha256") != want["sha256"]:
            raise ValueError(f"checkpoint {where} was trained on data {have.get('path')!r} "
                             f"(sha256 {str(have.get('sha256'))[:12]}) but this run's data "
                             f"{want['path']!r} has sha256 {want['sha256'][:12]}; resume with "
                             "the same --data")
        if key == "data":
            continue
        if isinstance(want, dict) and isinstance(have, dict):
            diff = [k for k in sorted(set(want) | set(have)) if want.get(k) != have.get(k)]
            if diff:
                k = diff[0]
                raise ValueError(f"checkpoint {where} has {key}.{k}={have.get(k)!r} but this "
                                 f"run has {want.get(k)!r}; resume with the same {key} "
                                 "settings or start a new --checkpoint-dir")
        elif have != want:
            raise ValueError(f"checkpoint {where} has {key}={have!r} but this run has "
                             f"{want!r}; resume with the same settings or start a new "
                             "--checkpoint-dir")


def _step_problem(d: Path, rank: int, world: int) -> tuple[str, object]:
    """(why step ``d`` is not intact as this rank sees it, or "";  its DCP metadata,
    read by the restricted unpickler). The rank checks its share of the files."""
    from paratrain.files.checkpoint.safe_metadata import UnsafeMetadata, read_metadata

    meta, why = read_meta_why(d)
    if meta is None:
        return why, None
    if meta.get("format", 1) != FORMAT:
        return f"meta.json has format {meta.get('format', 1)}, this version resumes {FORMAT}", None
    bad = verify_files(d, meta, range(rank, len(meta["files"]), world))
    if bad:
        return "; ".join(bad), None
    try:
        return "", read_metadata(d, meta["files"])
    except UnsafeMetadata as e:
        return str(e), None


def _agreed_problem(why: str, world: int, device) -> str:
    """"" when every rank found its share intact, else the reasons, each naming its
    ranks ("rank 0, 1: __1_0.distcp is missing")."""
    import torch.distributed as dist

    bad = _failed_ranks(not why, world, device)
    if not bad:
        return ""
    reasons = [why]
    if world > 1 and dist.is_initialized():
        reasons = [None] * world
        dist.all_gather_object(reasons, why)
    by_reason: dict[str, list[int]] = {}
    for r in bad:
        by_reason.setdefault(reasons[r], []).append(r)
    return "; ".join(f"rank {', '.join(map(str, rs))}: {why}" for why, rs in by_reason.items())


def _point_latest(root: Path, step: int) -> None:
    """After a fallback, ``latest`` names the step loaded (it named a damaged one)."""
    try:
        if latest(root) != step_dir(root, step):
            write_atomic(root / "latest", f"step_{step:06d}".encode())
    except OSError:
        pass  # a hint only; the next save rewrites it


def load(root: str | Path, engine, mcfg, plan, expect: dict | None = None,
         device=None) -> int:
    """Load the newest intact checkpoint under ``root`` into ``engine`` (any layout);
    return its step. Collective when a process group exists; ``device``: where the
    agreement all-reduce runs (the group's device, e.g. CUDA under NCCL)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from paratrain.files.checkpoint.safe_metadata import read_failure
    from paratrain.files.checkpoint.sharded import load_pieces

    rank, world = _rank_world()
    root = Path(root)
    if rank == 0:
        remove_stale(root)
    candidates = steps(root)
    metas = [(s, m) for s, m in ((s, _meta(root, s)) for s in candidates) if m is not None]
    if not metas:
        raise ValueError(f"no checkpoint found in {str(root)!r}; run without --resume first, "
                         "or point --checkpoint-dir at a directory that has one")
    check_settings(metas[0][1], expect or {}, step_dir(root, metas[0][0]))
    check_residual_layout(metas[0][1], plan, step_dir(root, metas[0][0]))
    for i, step in enumerate(candidates):
        d = step_dir(root, step)
        why, md = _step_problem(d, rank, world)
        said = _agreed_problem(why, world, device)
        if not said:
            try:
                load_pieces(d, md, engine)
                if rank == 0:
                    _point_latest(root, step)
                return step
            except CheckpointException as e:  # raised on every rank together
                said = read_failure(e)
        if rank == 0:
            nxt = f"step_{candidates[i + 1]:06d}" if i + 1 < len(candidates) else "nothing"
            print(fallback_line(d, said, nxt), file=sys.stderr, flush=True)
    raise ValueError(f"no intact checkpoint in {str(root)!r} (every step failed "
                     "verification); start again without --resume")


from paratrain.files.checkpoint.full import load_full_model as load_full_model  # noqa: E402
