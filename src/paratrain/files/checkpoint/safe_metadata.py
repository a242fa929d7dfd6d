"""DCP's ``.metadata`` read without running code: a restricted unpickler, and a reader
that hands DCP the metadata read that way.

``torch.distributed.checkpoint.FileSystemReader.read_metadata`` is ``pickle.load``, and
a pickle can call any importable function (``__reduce__``). The sha256s in ``meta.json``
do not help: meta.json is just as writable, so a crafted ``.metadata`` with recomputed
checksums would run its code in ``generate``, ``export`` and every worker of
``train --resume``. Here the pickle is read by :class:`MetadataUnpickler`, whose
``find_class`` admits only what DCP's metadata is built of (found by pickling a real
checkpoint's metadata and listing the globals it names): the metadata dataclasses,
``_StorageInfo``, ``torch.Size``, torch dtypes, the layout lookup and ``PosixPath``
(``StorageMeta.checkpoint_id``). Each of these only builds a value. Any other global,
or a result that is not a :class:`Metadata` whose storage entries name files in the
step's ``meta.json`` list, is :class:`UnsafeMetadata`: the step is corrupt (fallback,
one warning). DCP then reads through :class:`VerifiedReader`, which returns that
object and never unpickles anything itself (nor falls back to per-rank
``__R.metadata`` files). The tensors in the ``.distcp`` files are read by DCP with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_ADMITTED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorProperties",
        "TensorStorageMetadata", "BytesStorageMetadata", "StorageMeta",
        "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "pathlib._local": {"PosixPath", "PurePosixPath"},  # Python 3.13's home of the classes
}


class UnsafeMetadata(ValueError):
    """``.metadata`` names something outside the admitted classes, or is malformed."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata; any other global raises :class:`UnsafeMetadata`."""

    def find_class(self, module: str, name: str):
        if name in _ADMITTED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeMetadata(f".metadata names {module}.{name}, which is not part of a "
                             "checkpoint's metadata (refused: it could run code)")


def read_metadata(d: Path, files) -> Metadata:
    """Step ``d``'s ``.metadata``, unpickled by :class:`MetadataUnpickler`; every file
    its storage entries read must be one of ``files`` (meta.json's verified list)."""
    try:
        with (d / ".metadata").open("rb") as f:
            md = MetadataUnpickler(f).load()
    except UnsafeMetadata:
        raise
    except OSError as e:
        raise UnsafeMetadata(f".metadata cannot be read ({e.strerror})") from None
    except Exception as e:  # a truncated or garbled pickle raises many kinds
        raise UnsafeMetadata(f".metadata does not unpickle: {type(e).__name__}: "
                             f"{str(e).splitlines()[0][:120] if str(e) else ''}") from None
    if not isinstance(md, Metadata) or not isinstance(md.storage_data, dict) \
            or not isinstance(md.state_dict_metadata, dict):
        raise UnsafeMetadata(".metadata does not hold checkpoint metadata")
    for info in md.storage_data.values():
        path = getattr(info, "relative_path", None)
        if path not in files or getattr(info, "transform_descriptors", None):
            raise UnsafeMetadata(f".metadata reads {path!r}, which meta.json does not list")
    return md


class VerifiedReader(FileSystemReader):
    """A FileSystemReader of step ``d`` whose metadata :func:`read_metadata` read."""

    def __init__(self, d: Path, metadata: Metadata) -> None:
        super().__init__(str(d))
        self._verified = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        md = self._verified
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def read_failure(e: BaseException) -> str:
    """One line for DCP's ``CheckpointException`` (whose ``str`` holds a traceback per
    rank): the first failing rank and its exception."""
    failures = getattr(e, "failures", None) or {}
    if not failures:
        return f"reading it failed: {str(e).splitlines()[0][:200]}"
    rank = min(failures)
    exc = failures[rank][0]
    text = str(exc).splitlines()[0].split(". ")[0][:160] if str(exc) else ""
    return f"rank {rank}: reading it failed: {type(exc).__name__}: {text}"
