"""Is a step directory intact? meta.json's schema, its files' sha256s, one warning line.

A step is intact when its ``meta.json`` is a JSON object of the expected shape (below),
every file it lists is present with its sha256, and (checked where the tensors are read,
:mod:`.safe_metadata`) DCP's ``.metadata`` unpickles with the restricted unpickler and
names no file outside that list. Anything else is a corrupt step: loading falls back to
the next older one with one ``warning:`` line (:func:`fallback_line`).

The schema, written by :func:`paratrain.files.checkpoint.save`: ``format`` (int), ``step``
(the int in the directory's name), ``model`` (an object that builds a
:class:`~paratrain.config.ModelConfig`), ``world_size`` (int >= 1) and ``plan`` (an
object) where present, ``files`` (a
non-empty object from a plain file name in the step directory to a sha256 hex digest;
format 2 lists ``.metadata``). A name with a slash, ``..`` or an absolute path is
refused: the names say which files verification covers, so they must be the step's.

Torch-free: the launcher checks steps with it before any worker starts.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

FORMAT = 2  # 1: one torch.save pickle per rank (world size locked)
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*|\.metadata")
_DIGEST = re.compile(r"[0-9a-f]{64}")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _files_problem(files, fmt: int) -> str | None:
    if not isinstance(files, dict) or not files:
        return "its files is not a non-empty object of file name to sha256"
    for name, digest in files.items():
        if not _NAME.fullmatch(name) or name in ("meta.json", "latest") or ".." in name:
            return f"it lists {name!r}, which is not a file name inside the step directory"
        if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
            return f"its sha256 of {name!r} is not 64 hex digits"
    if fmt == FORMAT and ".metadata" not in files:
        return "its files do not list .metadata"
    return None


def meta_problem(meta, d: Path) -> str | None:
    """What is wrong with ``meta`` as the meta.json of step directory ``d``; None if
    nothing."""
    if not isinstance(meta, dict):
        return f"meta.json holds a JSON {type(meta).__name__}, not an object"
    fmt = meta.get("format", 1)
    if fmt not in (1, FORMAT) or not _is_int(fmt):
        return f"meta.json has format {fmt!r}, this version reads 1 and {FORMAT}"
    m = re.fullmatch(r"step_(\d+)", d.name)
    step = meta.get("step")
    if step is None:
        return "meta.json has no step"
    if not _is_int(step) or (m and step != int(m.group(1))):
        return f"meta.json has step {step!r}, not the {d.name} of its directory"
    ws = meta.get("world_size", 1)
    if not _is_int(ws) or ws < 1:
        return f"meta.json has world_size {ws!r}, not a count of processes"
    if not isinstance(meta.get("plan", {}), dict) or not isinstance(meta.get("model"), dict):
        return "meta.json has no model object (or a plan that is not an object)"
    from paratrain.config import ModelConfig

    try:
        ModelConfig(**meta["model"])
    except (TypeError, ValueError) as e:
        return f"meta.json's model is not a model: {str(e).splitlines()[0][:120]}"
    why = _files_problem(meta.get("files"), fmt)
    return f"meta.json: {why}" if why else None


def read_meta_why(d: Path) -> tuple[dict | None, str]:
    """(meta.json of step ``d``, "") when it parses and has the schema, else (None,
    why)."""
    try:
        meta = json.loads((d / "meta.json").read_text())
    except OSError:
        return None, "meta.json is missing or unreadable"
    except ValueError:
        return None, "meta.json is not JSON"
    why = meta_problem(meta, d)
    return (None, why) if why else (meta, "")


def verify_files(d: Path, meta: dict, share) -> list[str]:
    """Problems with the files of step ``d`` numbered in ``share`` (sorted by name), and
    any file meta.json lists that is missing. ``meta`` has passed :func:`meta_problem`."""
    names = sorted(meta["files"])
    bad = [f"{n} is missing" for n in names if not (d / n).is_file()]
    for i in share:
        n = names[i]
        if (d / n).is_file() and sha256_file(d / n) != meta["files"][n]:
            bad.append(f"{n} fails its sha256 check")
    return bad


def check_step(d: Path) -> tuple[dict | None, str]:
    """(meta, "") when step ``d``'s meta.json and every file it lists are intact (no
    tensor or pickle is read), else (None, why)."""
    meta, why = read_meta_why(d)
    if meta is None:
        return None, why
    bad = verify_files(d, meta, range(len(meta["files"])))
    return (None, "; ".join(bad)) if bad else (meta, "")


def fallback_line(d: Path, why: str, nxt: str) -> str:
    """The one warning for a step that is not intact (train --resume, generate, export
    print the same)."""
    return f"warning: checkpoint {d} is not intact ({why}); falling back to {nxt}"
