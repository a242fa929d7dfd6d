"""One run per checkpoint directory: an exclusive ``flock`` on ``DIR/.paratrain.lock``.

The process that starts a run holds the lock for the run's life: the launcher of
``paratrain train --nproc N`` (its workers write, it holds), the one process of
``--nproc 1``, and global rank 0 of a run started with ``torchrun -m paratrain.cli
train`` directly (the CLI runs inside that worker). A second run pointed at the same
directory is refused with one line naming the holder's pid.

- The kernel releases a ``flock`` when its holder dies, even by SIGKILL, so a lock left
  by a dead run never blocks: the pid written in the file is for the message only.
- :meth:`DirLock.release` unlinks the file before unlocking; :func:`acquire` therefore
  checks, once it holds a lock, that the file it locked is still the one at the path
  (else it locked a file another run just unlinked, and tries again).
- A directory :func:`acquire` created is removed again on release if the run left
  nothing in it (a run refused by a later check touches nothing).

No torch here (the launcher takes the lock before any worker starts).
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

LOCK_FILE = ".paratrain.lock"


class DirLock:
    """A held lock; :meth:`release` (or leaving the ``with`` block) gives it up."""

    def __init__(self, root: Path, fd: int, created: bool) -> None:
        self.root, self.fd, self.created = root, fd, created

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            (self.root / LOCK_FILE).unlink(missing_ok=True)
            if self.created and not any(self.root.iterdir()):
                self.root.rmdir()
        except OSError:  # a read-only or vanished directory: the unlock below suffices
            pass
        os.close(self.fd)  # closing the descriptor drops the flock
        self.fd = -1

    def __enter__(self) -> DirLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def holder(root: str | Path) -> str:
    """What the lock file says about its holder ("pid 123 on host"), or "another run"."""
    try:
        said = (Path(root) / LOCK_FILE).read_text().split()
    except OSError:
        said = []
    return f"pid {said[0]} on {said[1]}" if len(said) >= 2 else "another run"


def _in_use(root: Path) -> ValueError:
    return ValueError(f"--checkpoint-dir {str(root)!r} is in use by another run "
                      f"({holder(root)}); wait for it to end, or pass another "
                      "--checkpoint-dir")


def acquire(root: str | Path) -> DirLock:
    """Lock ``root`` (created if missing) for this process, or raise ValueError naming
    the run that holds it."""
    root = Path(root)
    created = not root.exists()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create --checkpoint-dir {str(root)!r} ({e.strerror}); "
                         "pass a writable directory") from None
    path = root / LOCK_FILE
    for _ in range(100):
        try:
            # read-only: a descriptor open for writing would keep the filesystem from
            # being remounted read-only (EBUSY), and flock needs none
            fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
        except OSError as e:
            raise ValueError(f"cannot create the lock file {str(path)!r} ({e.strerror}); "
                             "pass a writable --checkpoint-dir") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _in_use(root) from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # the previous holder unlinked it as we opened it: again
            os.close(fd)
            continue
        try:
            path.write_text(f"{os.getpid()} {socket.gethostname()}\n")
        except OSError:
            pass  # the pid is for the message only
        return DirLock(root, fd, created)
    raise _in_use(root)

