"""Where each rank's state sits in the plain model: global boxes of every local tensor.

A checkpoint is layout-free when every rank writes its state as *pieces of the plain
model's tensors*: for a parameter named as in :class:`paratrain.model.Decoder`, a box
(offsets, sizes) of its full shape, for each of four kinds: ``param`` (the optimizer's
master value), ``exp_avg``, ``exp_avg_sq`` (AdamW's moments, elementwise like the
parameter) and ``step``. Any other layout then reads the boxes it owns
(:mod:`.sharded` does both through ``torch.distributed.checkpoint``).

Where each local tensor sits is not worked out here: every transform recorded it on the
parameter (:mod:`paratrain.parallel.placement`): the plain name, the box of the plain
tensor the local parameter is (pipeline split, tensor and expert sharding), and the
flat range of that box this rank's optimizer owns (the data axis): the whole box (one
process, DDP, top-k: every dp replica holds it, dp rank 0 writes it), or a ZeRO-1/2/3
segment (the part of the parameter inside this rank's chunk of a flat bucket or unit).
The engine lists, per owned piece, the tensor its optimizer state is keyed by
(``owned_state``). A flat range of a box is cut into at most 2 n - 1 sub-boxes
(:func:`flat_range_boxes`).

A replicated piece is written by one rank only (the one whose index is 0 on every axis
its placement replicates it over: dp rank 0; tp rank 0 for the norms' gains), so the
saved boxes of a tensor never overlap, as ``torch.distributed.checkpoint`` requires.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from paratrain.parallel.placement import placement_of

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


def entries(engine) -> list[Entry]:
    """Every flat range of a local parameter this rank's optimizer holds, with its place
    in the plain model, read from the parameters' placements."""
    out = []
    for p, key, opt in engine.owned_state():
        pl = placement_of(p)
        lo, hi = pl.owned
        if lo >= hi:
            continue
        if key.numel() != hi - lo:
            raise ValueError(f"{pl.name}: the optimizer holds {key.numel()} elements where "
                             f"its placement owns {hi - lo}; this layout cannot be "
                             "checkpointed by pieces")
        out.append(Entry(p, lo, hi, opt, key, pl.canonical(engine.axis_index), pl.name,
                         pl.shape, pl.offsets, pl.sizes))
    return out


def pieces(e: Entry) -> list[tuple[tuple, tuple, int, int]]:
    """(global offsets, sizes, flat_lo, flat_hi) of the boxes of ``e`` (flat positions
    relative to ``e.lo``)."""
    return [(tuple(a + b for a, b in zip(e.offsets, o, strict=True)), s, fa - e.lo, fb - e.lo)
            for o, s, fa, fb in flat_range_boxes(e.sizes, e.lo, e.hi)]
