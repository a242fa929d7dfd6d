"""Layout-free state through ``torch.distributed.checkpoint`` (DCP): save the pieces a
rank owns, load the pieces a (possibly different) layout needs.

Each rank hands DCP its pieces (:mod:`.pieces`) as shard write items of the plain
model's tensors, keyed ``KIND/NAME`` (``param/blocks.0.attn.wq.weight``, ``exp_avg/...``,
``exp_avg_sq/...``, ``step/...``), and each rank's top-k residual whole
(``topk_residual/rankR/I``); DCP writes one file per rank plus ``.metadata``, which
lists every tensor's global size and saved chunks. Loading asks, per piece this rank
needs, for a box of a tensor; DCP's resharding (``create_read_items_for_chunk_list``)
finds the saved chunks that overlap it, whatever layout wrote them. That is how a run
saved by 4-way ZeRO-3 resumes as 2-way TP, or dp 2 as dp 4.

What a rank loads: the master value and moments of every range its optimizer holds
(the whole parameter under DDP on every replica; its own segment under ZeRO), then the
working parameters follow from the masters as an optimizer step leaves them (ZeRO-1/2
all-gather their buckets; ZeRO-3 keeps its shard).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from paratrain.files.checkpoint.pieces import KINDS, Entry, entries, pieces
from paratrain.files.checkpoint.safe_metadata import VerifiedReader


class _PieceSaver(DefaultSavePlanner):
    """Write exactly the given (fqn, global size, offsets, tensor) pieces."""

    def __init__(self, items: list[tuple[str, tuple, tuple, torch.Tensor]]) -> None:
        super().__init__(flatten_state_dict=False)
        self.items = items
        self.data = {}

    def create_local_plan(self) -> SavePlan:
        plan = []
        for fqn, size, offsets, t in self.items:
            idx = self._index(fqn, offsets)
            self.data[idx] = t
            plan.append(WriteItem(index=idx, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=t.shape),
                properties=TensorProperties(dtype=t.dtype), size=torch.Size(size))))
        self.plan = SavePlan(plan)
        return self.plan

    @staticmethod
    def _index(fqn, offsets):
        from torch.distributed.checkpoint.metadata import MetadataIndex

        return MetadataIndex(fqn, torch.Size(offsets))

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self.data[write_item.index]


class _PieceLoader(LoadPlanner):
    """Fill the given (fqn, offsets, destination tensor) boxes from any saved layout."""

    def __init__(self, wants: list[tuple[str, tuple, torch.Tensor]]) -> None:
        self.wants = wants

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.metadata = metadata
        self.dest = {}

    def create_local_plan(self) -> LoadPlan:
        reads = []
        md = self.metadata.state_dict_metadata
        for fqn, offsets, t in self.wants:
            if fqn not in md:
                raise ValueError(f"the checkpoint has no {fqn}; it was written by a "
                                 "different model")
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=t.shape)
            for r in create_read_items_for_chunk_list(fqn, md[fqn], [chunk]):
                self.dest[(r.dest_index.fqn, tuple(r.dest_index.offset))] = t
                reads.append(r)
        covered = {}
        for r in reads:  # every element of every wanted box must be read from somewhere
            key = (r.dest_index.fqn, tuple(r.dest_index.offset))
            covered[key] = covered.get(key, 0) + int(torch.Size(r.lengths).numel())
        for fqn, offsets, t in self.wants:
            if covered.get((fqn, tuple(offsets)), 0) != t.numel():
                raise ValueError(f"the checkpoint does not cover {fqn} at {offsets}")
        return LoadPlan(reads)

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan):
        return central_plan

    def load_bytes(self, read_item, value) -> None:
        raise ValueError(f"unexpected non-tensor item {read_item.dest_index.fqn}")

    def resolve_tensor(self, read_item) -> torch.Tensor:
        t = self.dest[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        for d, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            t = t.narrow(d, o, n)
        return t

    def commit_tensor(self, read_item, tensor) -> None:
        """``resolve_tensor`` handed out a view of the destination: nothing to copy."""


@contextmanager
def _quiet():
    """DCP warns that one process "assumes the intent" of a single-process save: it is."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1)


def _state_of(e: Entry) -> dict:
    return e.opt.state.get(e.key, {})


def _residuals(engine) -> list[torch.Tensor]:
    """This rank's top-k error-feedback residuals (one per top-k data axis; none
    without ``--compress`` or on a dp axis of 1)."""
    return engine.residuals()


def _residual_fqn(i: int) -> str:
    """Keyed by global rank: a residual is this rank's alone, not a piece of a tensor
    (resuming needs the same layout: :func:`paratrain.files.checkpoint.check_residual_layout`)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return f"topk_residual/rank{rank}/{i}"


def save_pieces(path: Path, engine) -> None:
    """Write this rank's canonical pieces, and its top-k residuals, into ``path``
    (collective over the world)."""
    items = [(_residual_fqn(i), tuple(r.shape), (0,), r.detach().clone().cpu())
             for i, r in enumerate(_residuals(engine))]
    for e in entries(engine):
        if not e.canonical:
            continue
        st = _state_of(e)
        srcs = {"param": _flat(e.key)}
        for k in KINDS[1:]:
            srcs[k] = _flat(st[k]) if k in st else torch.zeros_like(srcs["param"])
        for offsets, sizes, a, b in pieces(e):
            for k, src in srcs.items():
                items.append((f"{k}/{e.name}", e.shape, offsets,
                              src[a:b].reshape(sizes).clone().cpu()))
            if not any(offsets) and e.lo == 0 and a == 0:  # one writer per parameter
                items.append((f"step/{e.name}", (1,), (0,),
                              torch.tensor([float(st["step"]) if "step" in st else 0.0],
                                           dtype=torch.float64)))
    with _quiet():
        dcp.save({}, storage_writer=dcp.FileSystemWriter(str(path), thread_count=1),
                 planner=_PieceSaver(items), no_dist=not dist.is_initialized())


@torch.no_grad()
def load_pieces(path: Path, metadata, engine) -> None:
    """Fill this rank's optimizer ranges and parameters from ``path`` (collective), whose
    ``metadata`` :func:`.safe_metadata.read_metadata` read."""
    es = entries(engine)
    res = [(r, torch.empty(r.shape, dtype=r.dtype)) for r in _residuals(engine)]
    wants = [(_residual_fqn(i), (0,), buf) for i, (_, buf) in enumerate(res)]
    bufs = []
    steps = {}
    for e in es:
        dt = e.key.dtype
        kb = {k: torch.empty(e.hi - e.lo, dtype=dt) for k in KINDS}
        for offsets, sizes, a, b in pieces(e):
            for k in KINDS:
                wants.append((f"{k}/{e.name}", offsets, kb[k][a:b].view(sizes)))
        if e.name not in steps:
            steps[e.name] = torch.empty(1, dtype=torch.float64)
            wants.append((f"step/{e.name}", (0,), steps[e.name]))
        bufs.append(kb)
    with _quiet():
        dcp.load({}, storage_reader=VerifiedReader(path, metadata),
                 planner=_PieceLoader(wants), no_dist=not dist.is_initialized())
    for e, kb in zip(es, bufs, strict=True):
        dev = e.key.device
        e.key.copy_(kb["param"].to(dev).view_as(e.key))
        n = float(steps[e.name][0])
        e.opt.state.pop(e.key, None)
        if n > 0:
            e.opt.state[e.key] = {
                "step": torch.tensor(n, dtype=torch.float32),
                "exp_avg": kb["exp_avg"].to(dev).view_as(e.key).clone(),
                "exp_avg_sq": kb["exp_avg_sq"].to(dev).view_as(e.key).clone()}
    for r, buf in res:
        r.copy_(buf.to(r.device))
    engine.sync_working()  # working parameters as an optimizer step leaves them


def load_full(path: Path, metadata) -> dict[str, torch.Tensor]:
    """Every ``param/*`` tensor whole, in one process (no process group), from ``path``
    whose ``metadata`` :func:`.safe_metadata.read_metadata` read."""
    reader = VerifiedReader(path, metadata)
    md = metadata.state_dict_metadata
    out, wants = {}, []
    for fqn, tmd in md.items():
        if fqn.startswith("param/"):
            t = torch.empty(tmd.size, dtype=tmd.properties.dtype)
            out[fqn.removeprefix("param/")] = t
            wants.append((fqn, (0,) * len(tmd.size), t))
    with _quiet():
        dcp.load({}, storage_reader=reader, planner=_PieceLoader(wants), no_dist=True)
    return out
