"""``--keep-checkpoints K``: which steps a save may delete.

Keeping "the K highest step numbers" lost work: after a resume that fell back past two
damaged newest steps, the step just written was the lowest of the K highest, so it and
the intact older steps were deleted, the damaged ones kept, and ``latest`` named a
deleted directory. The same happened beside a higher step of another run. The rule now,
after step S was written (rank 0, in :func:`paratrain.files.checkpoint.save`):

- S itself is never deleted, and ``latest`` names it.
- Steps *above* S are not touched. They are not this run's continuation: a damaged step
  a resume fell back past, or another run's. They are neither counted nor deleted; the
  next load tries them first and falls back past a damaged one with its one warning
  (and a save that reaches the same number replaces it).
- Below S, the K - 1 newest *intact* steps are kept (:func:`.verify.check_step`:
  meta.json's schema, every file's sha256). Everything else below S goes: older intact
  steps, and damaged ones (a newer intact step exists, so no load would choose them).

A step is hashed once per process: an intact result is remembered by the identity of
its meta.json (device, inode, size, mtime), and S is remembered when it is written.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from paratrain.files.checkpoint.verify import check_step

_intact: set[tuple] = set()


def _identity(d: Path) -> tuple | None:
    try:
        st = (d / "meta.json").stat()
    except OSError:
        return None
    return (str(d.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def remember_intact(d: Path) -> None:
    """Step ``d`` was just written whole (its files hashed into meta.json)."""
    key = _identity(d)
    if key is not None:
        _intact.add(key)


def is_intact(d: Path) -> bool:
    key = _identity(d)
    if key is None:
        return False
    if key in _intact:
        return True
    meta, _ = check_step(d)
    if meta is not None:
        _intact.add(key)
    return meta is not None


def to_delete(found: list[int], written: int, keep: int, intact) -> list[int]:
    """The steps of ``found`` (newest first) that go after ``written`` was saved under
    ``--keep-checkpoints keep``; ``intact(step)`` says whether a step is intact."""
    if keep <= 0:
        return []
    kept, out = 1, []
    for s in found:
        if s >= written:
            continue
        if kept < keep and intact(s):
            kept += 1
        else:
            out.append(s)
    return out


def prune(root: Path, found: list[int], written: int, keep: int, step_dir) -> list[int]:
    """Delete what :func:`to_delete` says; the steps deleted."""
    gone = to_delete(found, written, keep, lambda s: is_intact(step_dir(root, s)))
    for s in gone:
        shutil.rmtree(step_dir(root, s), ignore_errors=True)
    return gone
