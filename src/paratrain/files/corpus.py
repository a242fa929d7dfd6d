"""Where the corpus comes from, and its tokenized train/validation split (no torch here:
the launcher prepares the split before any worker starts).

- Default: the Python standard library's own ``.py`` source, found through
  ``sysconfig`` (present wherever Python is), files in sorted order, joined by newlines,
  cached once per Python version under ``~/.cache/paratrain`` as raw bytes.
- ``--data FILE`` or ``--data FOLDER``: a text file, or every regular file under a
  folder (sorted), joined by newlines.
- Records: ``.jsonl`` and ``.parquet`` files (or a folder holding any; then only those
  are read), one document per record in field ``--text-field`` (default ``text``), read
  with Hugging Face ``datasets`` in streaming mode from local files only (no hub, no
  Arrow cache copy), documents joined by newlines.
- Split: the last ``val_fraction`` of the bytes is validation, the rest training (for a
  tokenizer other than bytes the cut moves back to a UTF-8 character boundary), then
  each side is tokenized alone. Token ids are cached as
  ``~/.cache/paratrain/tokens-<hash of corpus, split and tokenizer>.npz``.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

import numpy as np

from paratrain.files import tokenizer as tk
from paratrain.files.atomic import write_atomic

RECORD_KINDS = {".jsonl": "json", ".parquet": "parquet"}


def cache_dir() -> Path:
    return Path.home() / ".cache" / "paratrain"  # beside the calibration profile


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.parts))


def stdlib_corpus() -> bytes:
    """The standard library's .py files, sorted and newline-joined (cached)."""
    ver = ".".join(map(str, sys.version_info[:3]))
    cache = cache_dir() / f"stdlib-{ver}-{sys.implementation.name}.bytes"
    if cache.is_file():
        return cache.read_bytes()
    data = b"\n".join(p.read_bytes() for p in _stdlib_files())
    try:
        write_atomic(cache, data)
    except OSError:  # read-only home: fine, just slower next time
        pass
    return data


def data_files(path: str) -> tuple[list[Path], bool]:
    """(files to read, whether they are records): a file, or a folder's regular files
    (sorted); a folder holding any .jsonl/.parquet file is read as records only."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"data path {path!r} does not exist; pass an existing file or folder "
                         "to --data, or omit it to use the Python standard library")
    files = [p] if not p.is_dir() else sorted(f for f in p.rglob("*") if f.is_file())
    recs = [f for f in files if f.suffix in RECORD_KINDS]
    return (recs, True) if recs else (files, False)


def records_text(files: list[Path], field: str, first_only: bool = False) -> bytes:
    """The ``field`` of every record of ``files``, newline-joined (streamed, offline).
    ``first_only``: read one record per file (the launcher's quick check)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before datasets is imported
    import datasets

    # datasets logs a failed load at ERROR level before raising; the raise is reported
    # as our one error line, so nothing of datasets' own is printed during these loads
    level = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL + 1)
    datasets.disable_progress_bars()
    try:
        texts = (_field_text(datasets, f, field, first_only) for f in files)
        return b"\n".join(t for t in texts if t)  # a file without records adds nothing
    finally:
        datasets.logging.set_verbosity(level)


class _BadRecord(ValueError):
    """A record without text in the field (our message, passed on as it is)."""


def _field_text(datasets, f: Path, field: str, first_only: bool) -> bytes:
    parts: list[bytes] = []
    try:
        ds = datasets.load_dataset(RECORD_KINDS[f.suffix], data_files=[str(f)],
                                   split="train", streaming=True)
        for i, rec in enumerate(ds):
            value = rec.get(field)
            if not isinstance(value, str):
                have = ", ".join(sorted(rec)) or "none"
                what = (f"has no field {field!r}" if field not in rec else
                        f"has no text in field {field!r} (null or absent)" if value is None
                        else f"has a non-text field {field!r}")
                raise _BadRecord(f"record {i} of data file {str(f)!r} {what} (fields: "
                                 f"{have}); pass --text-field NAME or fix the record")
            parts.append(value.encode())
            if first_only:
                break
    except _BadRecord:
        raise
    except Exception as e:  # a broken JSON line, a file that is not parquet, ...
        msg = f"{type(e).__name__}: {e}".splitlines()[0]
        raise ValueError(f"data file {str(f)!r} cannot be read as "
                         f"{RECORD_KINDS[f.suffix]} records ({msg}); fix or remove it"
                         ) from None
    return b"\n".join(parts)


def read_corpus(path: str | None, text_field: str = "text") -> bytes:
    """Bytes of the corpus at ``path`` (text file, folder or records), or the default."""
    if path is None:
        return stdlib_corpus()
    files, records = data_files(path)
    if records:
        data = records_text(files, text_field)
    else:
        data = b"\n".join(f.read_bytes() for f in files)
    if not data.strip():
        raise ValueError(f"data path {path!r} holds no text; point --data at a non-empty "
                         "text file or folder")
    return data


def split_point(data: bytes, val_fraction: float, utf8: bool) -> int:
    """Index of the first validation byte: the last ``val_fraction`` of the bytes,
    moved back to the start of a UTF-8 character when ``utf8``."""
    cut = len(data) - int(len(data) * val_fraction)
    while utf8 and 0 < cut < len(data) and data[cut] & 0xC0 == 0x80:
        cut -= 1
    return cut


def prepare(path: str | None, val_fraction: float, spec: str = "bytes",
            text_field: str = "text") -> tuple[np.ndarray, np.ndarray, tk.Tokenizer, str]:
    """(train ids, validation ids, tokenizer, sha256 of the corpus bytes): the tokenizer
    trained on the training split if it is ``bpe:N``; ids cached (see the module note).
    The sha256 is the data's identity in checkpoints, whatever the tokenizer."""
    data = read_corpus(path, text_field)
    digest = tk.sha256(data)
    kind, _ = tk.parse_spec(spec)
    cut = split_point(data, val_fraction, utf8=kind != "bytes")
    if kind == "bytes":
        tok = tk.load(spec)
        return tok.encode(data[:cut]), tok.encode(data[cut:]), tok, digest
    tok = tk.load(spec, data[:cut])
    key = tk.sha256(f"{digest} {cut} {tok.info.sha256}")[:24]
    cache = cache_dir() / f"tokens-{key}.npz"
    if cache.is_file():
        with np.load(cache) as z:
            return z["train"], z["val"], tok, digest
    train, val = tok.encode(data[:cut]), tok.encode(data[cut:])
    try:
        import io

        buf = io.BytesIO()
        np.savez(buf, train=train, val=val)
        write_atomic(cache, buf.getvalue())
    except OSError:  # read-only home: encode again next time
        pass
    return train, val, tok, digest
