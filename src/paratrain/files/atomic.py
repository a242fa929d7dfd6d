"""Files written whole or not at all, with one permission policy: the user's umask. The
package's one atomic writer: checkpoints, metrics, caches and run TOMLs all come here.

``tempfile.mkstemp`` creates its file 0600 whatever the umask, so a file written through
it and renamed into place (``meta.json``, ``latest``, ``metrics.jsonl``) came out 0600
beside DCP's 0644 tensors. Here the temporary is created with ``os.open(..., 0o666)``,
which the kernel narrows by the umask exactly as for any other file the run writes.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def umask() -> int:
    """This process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_mode() -> int:
    """The mode a new regular file gets here: 0666 less the umask (0644 under 022)."""
    return 0o666 & ~umask()


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` (its folder made if missing) through a fsynced temporary
    beside it and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
