"""Where a command will write, checked before its work (a 137 s fit is not lost to a
read-only folder at the end): one ``ValueError`` line naming the path and the fix.

The check writes and removes a probe file in the folder rather than asking
``os.access``: that answers for root as for anyone, and for a read-only mount. No torch.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def check_writable_file(what: str, path: str | Path, make_parents: bool = False,
                        fix: str = "pass a writable path") -> None:
    """``path`` can be written as a file (``make_parents``: its missing folders will be
    created, so the first existing one must take a file); ``fix`` ends the message."""
    p = Path(path).absolute()
    if p.is_dir():
        raise ValueError(f"{what} {str(path)!r} is a folder; pass a file path")
    folder = p.parent
    while make_parents and not folder.exists():
        folder = folder.parent
    if not folder.exists():
        raise ValueError(f"{what} {str(path)!r}: its folder {str(folder)!r} does not exist; "
                         "create it or pass another path")
    if not folder.is_dir():
        raise ValueError(f"{what} {str(path)!r} cannot be created: {str(folder)!r} is a "
                         "file, not a folder; pass another path")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".paratrain-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{what} {str(path)!r} cannot be written: folder {str(folder)!r} "
                         f"is not writable ({e.strerror}); {fix}") from None
    if p.exists() and not os.access(p, os.W_OK):
        raise ValueError(f"{what} {str(path)!r} is read-only; {fix}")
