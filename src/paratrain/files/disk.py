"""The disk under a checkpoint directory: room before a save, the cause after a failed one.

A save that runs out of space, or meets a read-only or forbidden directory, fails deep in
a writer (an ``OSError``, or torch's "unexpected pos" ``RuntimeError`` from a short
write, wrapped by torch.distributed.checkpoint), and the rank that hit it took the run
down with a traceback the launcher could only call "exit code 1". Here:

- :func:`checkpoint_bytes`: what one step's checkpoint takes, the previous step's files
  if there is one, else the model's saved tensors (the master parameters and AdamW's
  two moments, :func:`state_bytes`).
- :func:`check_room`: before a save, a directory that is read-only, not writable or
  has less free space (``statvfs``) than that is a one-line ``ValueError``.
- :func:`diagnose`: after a save failed, the same line when the cause was the disk
  (the errno in the exception chain, or the directory's state now), else None.

Every line names the device and the path, the step being saved, the size, and the
newest step still intact. No torch import.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

DISK_ERRNOS = {errno.ENOSPC: "no space left", errno.EDQUOT: "disk quota exceeded",
               errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
               errno.EPERM: "permission denied"}
MB = 1e6


def state_bytes(params: int, master_bytes: int) -> int:
    """Bytes of a checkpoint's tensors: the master parameters and AdamW's exp_avg and
    exp_avg_sq, each ``params`` elements of ``master_bytes``."""
    return 3 * params * master_bytes


def _nearest(path: Path) -> Path:
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def device_of(path: str | Path) -> str:
    """The filesystem's source (``/dev/sda1``, ``tmpfs``) from /proc/self/mounts, or ''."""
    p = str(_nearest(Path(path)).resolve())
    best, source = "", ""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return ""
    for line in mounts:
        fields = line.split()
        if len(fields) < 2:
            continue
        mnt = fields[1].replace("\\040", " ")
        if (p == mnt or p.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, source = mnt, fields[0]
    return source


def checkpoint_bytes(root: str | Path, newest: int | None, estimate: int) -> int:
    """The previous step's size on disk when there is one (``newest``), else ``estimate``."""
    if newest is not None:
        d = Path(root) / f"step_{newest:06d}"
        try:
            size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
            if size > 0:
                return size
        except OSError:
            pass
    return estimate


def _line(cause: str, root: Path, step: int, need: int, newest: int | None,
          free: int | None = None) -> str:
    dev = device_of(root)
    where = f"{dev} {root}" if dev else str(root)
    room = f", {free / MB:.3g} MB free" if free is not None else ""
    if cause == "no space left" and free_inodes(root) == 0:
        room += ", no free inodes"
    kept = (f"the previous checkpoint step_{newest:06d} is intact" if newest is not None
            else "no earlier checkpoint was written")
    fix = ("free space there or pass another --checkpoint-dir" if cause == "no space left"
           else "make it writable or pass another --checkpoint-dir")
    return (f"{cause} on {where} while saving step {step} (needs about "
            f"{need / MB:.3g} MB{room}); {kept}; {fix}")


def free_bytes(root: str | Path) -> int | None:
    """Bytes an unprivileged writer may still use on ``root``'s filesystem."""
    try:
        st = os.statvfs(_nearest(Path(root)))
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def free_inodes(root: str | Path) -> int | None:
    """Files that can still be created on ``root``'s filesystem (None: not counted)."""
    try:
        st = os.statvfs(_nearest(Path(root)))
    except OSError:
        return None
    return st.f_favail if st.f_files else None


def _state(root: Path, need: int) -> tuple[str, int | None] | None:
    """(cause, free bytes) of the directory's disk as it stands, or None if it is fine."""
    at = _nearest(root)
    try:
        st = os.statvfs(at)
    except OSError:
        return None
    if st.f_flag & os.ST_RDONLY:
        return "read-only file system", None
    if not os.access(at, os.W_OK | os.X_OK):
        return "permission denied", None
    free = st.f_bavail * st.f_frsize
    return ("no space left", free) if free < need else None


def check_room(root: str | Path, step: int, need: int, newest: int | None) -> None:
    """Raise the one-line ValueError when the save of ``step`` cannot fit or be written."""
    found = _state(Path(root), need)
    if found is not None:
        raise ValueError(_line(found[0], Path(root), step, need, newest, found[1]))


def _errnos(e: BaseException):
    """Every errno in ``e``'s chain, and in the failures torch.distributed.checkpoint
    wraps (its CheckpointException holds each rank's (exception, traceback))."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno is not None:
            yield x.errno
        todo += [x.__cause__, x.__context__]
        for v in (getattr(x, "failures", None) or {}).values():
            todo.append(v[0] if isinstance(v, tuple) else v)


def diagnose(e: BaseException, root: str | Path, step: int, need: int,
             newest: int | None) -> str | None:
    """The one line for a save of ``step`` that raised ``e``, when the disk caused it."""
    root = Path(root)
    for code in _errnos(e):
        if code in DISK_ERRNOS:
            cause = DISK_ERRNOS[code]
            return _line(cause, root, step, need, newest,
                         free_bytes(root) if cause == "no space left" else None)
    found = _state(root, need)
    return _line(found[0], root, step, need, newest, found[1]) if found else None
