"""Where each rank's state sits in the plain model: global boxes of every local tensor.

A checkpoint is layout-free when every rank writes its state as *pieces of the plain
model's tensors*: for a parameter named as in :class:`paratrain.model.Decoder`, a box
(offsets, sizes) of its full shape, for each of four kinds: ``param`` (the optimizer's
master value), ``exp_avg``, ``exp_avg_sq`` (AdamW's moments, elementwise like the
parameter) and ``step``. Any other layout then reads the boxes it owns
(:mod:`.sharded` does both through ``torch.distributed.checkpoint``).

Two levels map local storage to the plain model:

1. **Which part of which plain parameter a local parameter is** (pipeline split, tensor
   and expert sharding). Rather than restating each transform's slicing rule (uneven
   vocabulary rows, heads by columns, experts by index, tied weights), a *probe* model in
   float64 whose every element holds its own global index (parameter number x 2^32 +
   flat position) goes through the same transforms; reading the local probe parameter
   back gives its box exactly. The box is checked to be a dense row-major box.
2. **Which flat range of a local parameter this rank's optimizer owns** (the data axis):
   the whole parameter (one process, DDP, top-k: every dp replica holds it, dp rank 0
   writes it), or a ZeRO-1/2/3 segment (the part of the parameter inside this rank's
   chunk of a flat bucket or unit). A flat range of a box is cut into at most 2 n - 1
   sub-boxes (:func:`flat_range_boxes`).

A replicated piece is written by one rank only (dp rank 0; tp rank 0 for the norms'
gains that every tp rank holds), so the saved boxes of a tensor never overlap, as
``torch.distributed.checkpoint`` requires.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

SCALE = 2.0 ** 32  # probe value = parameter number x SCALE + flat position (exact in f64)
KINDS = ("param", "exp_avg", "exp_avg_sq")


@dataclass
class Entry:
    """A flat range [lo, hi) of local parameter ``p`` held by this rank's optimizer."""

    p: nn.Parameter
    lo: int
    hi: int
    opt: object  # the torch AdamW whose state holds this range
    key: nn.Parameter  # the tensor that state is keyed by (and the master value)
    canonical: bool  # this rank writes it (no other rank writes the same elements)
    name: str = ""
    shape: tuple = ()  # global shape of the plain parameter
    offsets: tuple = ()  # the local parameter's box in it
    sizes: tuple = ()


def flat_range_boxes(shape: tuple, lo: int, hi: int) -> list[tuple[tuple, tuple, int, int]]:
    """Cut elements [lo, hi) (row-major) of a tensor of ``shape`` into boxes:
    [(offsets, sizes, flat_lo, flat_hi)], in order."""
    if lo >= hi:
        return []
    if len(shape) == 0:
        return [((), (), 0, 1)]
    inner = math.prod(shape[1:])
    if len(shape) == 1 or (lo % inner == 0 and hi % inner == 0):
        if len(shape) == 1:
            return [((lo,), (hi - lo,), lo, hi)]
        return [((lo // inner,) + (0,) * (len(shape) - 1),
                 ((hi - lo) // inner,) + tuple(shape[1:]), lo, hi)]
    out = []
    r0 = lo // inner
    if lo % inner:  # a partial first row
        end = min(hi, (r0 + 1) * inner)
        out += [((r0,) + o, (1,) + s, a + r0 * inner, b + r0 * inner)
                for o, s, a, b in flat_range_boxes(shape[1:], lo - r0 * inner, end - r0 * inner)]
        lo = end
    if lo < hi and hi - lo >= inner:
        full = (hi - lo) // inner * inner
        out += flat_range_boxes(shape, lo, lo + full)
        lo += full
    if lo < hi:  # a partial last row
        r1 = lo // inner
        out += [((r1,) + o, (1,) + s, a + r1 * inner, b + r1 * inner)
                for o, s, a, b in flat_range_boxes(shape[1:], 0, hi - r1 * inner)]
    return out


def _probe(mcfg) -> tuple[nn.Module, list[str], list[tuple]]:
    from paratrain.model import Decoder

    probe = Decoder(mcfg).double()
    names, shapes = [], []
    with torch.no_grad():
        for i, (n, p) in enumerate(probe.named_parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float64).view_as(p) + i * SCALE)
            names.append(n)
            shapes.append(tuple(p.shape))
    return probe, names, shapes


def _box_of(q: torch.Tensor, names, shapes) -> tuple[str, tuple, tuple, tuple]:
    v = q.detach().reshape(-1)
    pid = int(v[0].item() // SCALE)
    idx = (v - pid * SCALE).long()
    shape = shapes[pid]
    coords, rest = [], idx
    for d in reversed(shape):
        coords.append(rest % d)
        rest = rest // d
    coords.reverse()
    offsets = tuple(int(c.min()) for c in coords)
    sizes = tuple(int(c.max()) - o + 1 for c, o in zip(coords, offsets, strict=True))
    want = torch.arange(math.prod(shape)).view(shape)[
        tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].reshape(-1)
    if bool((v // SCALE != pid).any()) or sizes != tuple(q.shape) or not torch.equal(idx, want):
        raise ValueError(f"a local parameter of shape {tuple(q.shape)} is no box of "
                         f"{names[pid]}; this layout cannot be checkpointed by pieces")
    return names[pid], shape, offsets, sizes


def global_boxes(engine, mcfg, plan) -> dict[int, tuple[str, tuple, tuple, tuple]]:
    """id(local parameter) -> (plain name, plain shape, box offsets, box sizes)."""
    if not hasattr(engine, "mesh"):  # one process: the plain model itself
        return {id(p): (n, tuple(p.shape), (0,) * p.dim(), tuple(p.shape))
                for n, p in engine.model.named_parameters()}
    from paratrain.cost.ranks import virtual_stages
    from paratrain.parallel.pipeline.stage import build_chunks
    from paratrain.parallel.tensor import apply_tensor_parallel

    probe, names, shapes = _probe(mcfg)
    v = virtual_stages(plan)
    chunks = build_chunks(probe, plan.pp, v, engine.pp_rank)
    for c in chunks:
        apply_tensor_parallel(c, engine.mesh, plan)
    if plan.ep > 1:
        from paratrain.parallel.expert import apply_expert_parallel

        apply_expert_parallel(chunks, engine.mesh, plan.collectives)
    mine = list(engine.model.parameters())
    theirs = list(nn.ModuleList(chunks).parameters())
    if len(mine) != len(theirs) or any(a.shape != b.shape
                                       for a, b in zip(mine, theirs, strict=True)):
        raise ValueError("the probe model's parameters do not line up with this rank's; "
                         "this layout cannot be checkpointed by pieces")
    return {id(p): _box_of(q, names, shapes) for p, q in zip(mine, theirs, strict=True)}


def _whole(params, opt, canonical) -> list[Entry]:
    """Entries of optimizers that hold whole parameters (AdamW, or MasterAdamW's FP32
    masters)."""
    masters = dict((id(p), m) for p, m in getattr(opt, "pairs", []))
    inner = getattr(opt, "opt", opt)
    return [Entry(p, 0, p.numel(), inner, masters.get(id(p), p), canonical(p))
            for p in params if p.requires_grad]


def _segments(flat_params, adam, rank: int, world: int, counted) -> list[Entry]:
    """Entries of a :class:`paratrain.parallel.zero.ShardedAdamW` whose shards are chunk
    ``rank`` of flat buffers holding ``flat_params``: [(params, offsets, padded)]."""
    segs = iter(adam._segs)
    out = []
    for (params, offsets, padded), shard in zip(flat_params, adam.shards, strict=True):
        s = padded // world
        lo_b, hi_b = rank * s, (rank + 1) * s
        for q, off in zip(params, offsets, strict=True):
            a, b = max(off, lo_b), min(off + q.numel(), hi_b)
            if a < b and q.requires_grad:
                seg, sh, sa, sb, _ = next(segs)
                if sh is not shard or (sa, sb) != (a - lo_b, b - lo_b):
                    raise ValueError("ZeRO segments do not follow their buckets")
                out.append(Entry(q, a - off, b - off, adam.opt, seg, counted(q)))
    return out


def _axis_entries(da, counted) -> list[Entry]:
    if da.kind in ("none", "ddp", "topk"):
        return _whole(da.params, da.opt, lambda p: da.dp_rank == 0 and counted(p))
    if da.kind == "zero":
        zo = da.zo
        flats = [(b.params, b.offsets, b.padded) for gb in zo.chunks for b in gb.buckets]
        return _segments(flats, zo.adam, zo.comm.rank, zo.comm.size, counted)
    fs = da.fs
    flats = [(u.params, u.offsets, u.padded) for u in fs.units if u.n_trainable]
    return _segments(flats, fs.adam, fs.comm.rank, fs.comm.size, counted)


def entries(engine, mcfg, plan) -> list[Entry]:
    """Every flat range of a local parameter this rank's optimizer holds, with its place
    in the plain model (cached on the engine: the layout is fixed once built)."""
    cached = getattr(engine, "_ckpt_entries", None)
    if cached is not None:
        return cached
    if not hasattr(engine, "mesh"):
        out = _whole(list(engine.model.parameters()), engine.opt, lambda p: True)
    else:
        axes = getattr(engine.data, "parts", (engine.data,))
        out = [e for da in axes for e in _axis_entries(da, engine._counted)]
    boxes = global_boxes(engine, mcfg, plan)
    for e in out:
        e.name, e.shape, e.offsets, e.sizes = boxes[id(e.p)]
    engine._ckpt_entries = out
    return out


def pieces(e: Entry) -> list[tuple[tuple, tuple, int, int]]:
    """(global offsets, sizes, flat_lo, flat_hi) of the boxes of ``e`` (flat positions
    relative to ``e.lo``)."""
    return [(tuple(a + b for a, b in zip(e.offsets, o, strict=True)), s, fa - e.lo, fb - e.lo)
            for o, s, fa, fb in flat_range_boxes(e.sizes, e.lo, e.hi)]
