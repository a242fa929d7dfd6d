"""Where a parameter sits: recorded on it by the transform that moved it, never rediscovered.

Every parameter of a run carries a :class:`Placement` (``p.placement``): its name in the
plain :class:`paratrain.model.Decoder`, the global box it is of the plain tensor (offsets
and sizes), the mesh axes whose ranks hold disjoint parts of that tensor (``sharded``)
and those whose ranks hold the same elements (``replicated``). Each transform updates
the record as it goes, in the order of docs/design.md:

1. :func:`record_plain` on the plain model (the one-process engine stops here);
2. the pipeline split adds ``pp`` to ``sharded`` (each stage holds its own blocks);
3. tensor parallelism narrows the box of a split weight to its rows or columns and adds
   ``tp`` to ``sharded`` (:func:`narrowed`), or adds ``tp`` to ``replicated`` (norm gains,
   MoE layers);
4. expert parallelism adds ``ep`` to an expert's ``sharded`` axes (the plain name, taken
   before the split, already says which expert it is), ``etp`` where each expert is
   split (its box narrowed), and drops ``tp`` from ``replicated`` where the fold spans
   the tp ranks (:func:`unmark`);
5. the data axis: DDP and top-k add the reducer's axes (``dp``, ``cp`` or ``edp``) to
   ``replicated``; ZeRO-1/2/3 add them to ``sharded`` and set ``flat``, the range of the
   box (row-major) whose optimizer state this rank owns (:func:`record_flat`).

Readers: the checkpoint (which pieces of which plain tensor a rank writes and reads,
:mod:`paratrain.files.checkpoint.pieces`), the global gradient norm (a gradient counts on
the rank whose index is 0 on every ``replicated`` axis, :meth:`Placement.canonical`) and
the memory report (parameters held per rank, :func:`held_elements`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn


@dataclass(frozen=True)
class Placement:
    """One local parameter's place in the plain model (see the module docstring)."""

    name: str  # as in the plain Decoder's named_parameters()
    shape: tuple[int, ...]  # the plain tensor's shape
    offsets: tuple[int, ...]  # this local tensor's box in it
    sizes: tuple[int, ...]
    sharded: tuple[str, ...] = ()  # mesh axes whose ranks hold disjoint parts
    replicated: tuple[str, ...] = ()  # mesh axes whose ranks hold the same elements
    flat: tuple[int, int] | None = None  # ZeRO: owned range [lo, hi) of the box; None: all

    @property
    def owned(self) -> tuple[int, int]:
        """The flat range of the box (row-major) this rank's optimizer holds."""
        if self.flat is not None:
            return self.flat
        n = 1
        for s in self.sizes:
            n *= s
        return (0, n)

    def canonical(self, index, skip: tuple[str, ...] = ()) -> bool:
        """Whether this rank is the one copy of its elements that counts (index 0 on
        every replicated axis but ``skip``): it writes them to a checkpoint and adds their
        gradient's squares to the global norm. ``index(axis)``: the mesh's coordinate."""
        return all(index(a) == 0 for a in self.replicated if a not in skip)

    def add(self, sharded: tuple[str, ...] = (), replicated: tuple[str, ...] = ()
            ) -> Placement:
        return replace(self, sharded=self.sharded + tuple(a for a in sharded
                                                          if a not in self.sharded),
                       replicated=self.replicated + tuple(a for a in replicated
                                                          if a not in self.replicated))


def placement_of(p: nn.Parameter) -> Placement:
    pl = getattr(p, "placement", None)
    if pl is None:
        raise ValueError(f"a parameter of shape {tuple(p.shape)} has no placement; build "
                         "the model through the engine (record_plain runs first)")
    return pl


def record_plain(model: nn.Module) -> None:
    """Every parameter of the plain model is its own whole tensor, on every rank."""
    for n, p in model.named_parameters():
        p.placement = Placement(n, tuple(p.shape), (0,) * p.dim(), tuple(p.shape))


def mark(params, sharded: tuple[str, ...] = (), replicated: tuple[str, ...] = ()) -> None:
    """Add mesh axes to the placements of ``params`` (each parameter once)."""
    seen: set[int] = set()
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            p.placement = placement_of(p).add(sharded, replicated)


def unmark(params, replicated: str) -> None:
    """``replicated`` is no longer a replicated axis of ``params`` (expert parallelism
    folded over tp: the tp ranks hold different experts or slices)."""
    for p in params:
        pl = placement_of(p)
        p.placement = replace(pl, replicated=tuple(a for a in pl.replicated
                                                   if a != replicated))


def narrowed(old: nn.Parameter, new: nn.Parameter, dim: int, start: int, axis: str) -> None:
    """``new`` is ``old`` narrowed along ``dim`` from ``start`` (a tensor-parallel shard
    of it over ``axis``): record its box."""
    pl = placement_of(old)
    offsets, sizes = list(pl.offsets), list(pl.sizes)
    offsets[dim] += start
    sizes[dim] = new.shape[dim]
    new.placement = replace(pl, offsets=tuple(offsets), sizes=tuple(sizes)).add((axis,))


def record_flat(params, offsets, padded: int, rank: int, world: int,
                axes: tuple[str, ...]) -> None:
    """ZeRO: ``params`` lie at ``offsets`` in a flat buffer of ``padded`` elements cut into
    ``world`` equal chunks; this rank owns chunk ``rank`` of it. Record, per parameter,
    the part of it inside that chunk (possibly empty) and the axes it is sharded over."""
    s = padded // world
    lo, hi = rank * s, (rank + 1) * s
    for q, off in zip(params, offsets, strict=True):
        n = placement_of(q).owned[1]
        a, b = max(off, lo) - off, min(off + n, hi) - off
        q.placement = replace(placement_of(q).add(sharded=axes),
                              flat=(a, b) if a < b else (0, 0))


def held_elements(params) -> int:
    """Elements of the plain model this rank's optimizer holds (each parameter once)."""
    seen: set[int] = set()
    total = 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            lo, hi = placement_of(p).owned
            total += hi - lo
    return total
