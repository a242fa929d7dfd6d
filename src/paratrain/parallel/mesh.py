"""The device mesh: one object that owns every process group, with named axes.

Rank layout (Megatron-LM, Narayanan et al. 2021, section 3.3; Megatron's context-parallel
order): ``tp`` is the innermost axis, then ``cp``, then ``dp``, then ``pp``, i.e.::

    global_rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index

(one home, :func:`paratrain.cost.ranks.grid_rank`, which the systems model's per-rank
counts use too), so tensor-parallel partners are neighbouring ranks (on a GPU server: the
same node, on NVLink, where TP's per-layer all-reduces belong), context-parallel partners
(which pass K/V blocks every layer) come next, then data-parallel replicas, and pipeline
stages — which only exchange one activation per micro-batch — are furthest apart.

Expert parallelism (``ep``, ``etp``) folds the MoE layers over the same ranks
(Megatron-Core's "MoE parallel folding", :class:`paratrain.cost.ranks.Fold`, the one
home of the arithmetic): a stage's dp x cp (x tp with SP, or when etp = tp) ranks in the
global order are regrouped as edp x ep x etp, etp innermost, then ep. The ``etp`` group
splits each expert's matrices, the ``ep`` group (ep ranks, stride etp) holds every expert
once (ep index j: experts [j E/ep, (j+1) E/ep)), and ``edp`` holds the same expert
pieces and sums their gradients. Without SP and with etp 1 every tp rank routes the same
tokens: each tp index is a copy of a fold over dp x cp (the experts tp-replicated). The
groups come from ``dist.new_group`` and exist only for axes of more than one rank
(``sizes["ep"]``, ``sizes["etp"]``, ``sizes["fold_tp"]``).

Besides one group per axis the mesh holds ``dpcp``: the dp x cp ranks of one (pp, tp)
coordinate. Context-parallel ranks hold the same parameters and different pieces of
the same sequences, so gradients are summed over dp x cp: the data-parallel reducer
runs on ``dpcp`` (the same group as ``dp`` when cp = 1). Its rank order is the global
order, so a rank's index in it is ``dp_index * cp + cp_index``.

Groups come from ``torch.distributed.device_mesh.init_device_mesh`` with
``mesh_dim_names=("pp", "dp", "cp", "tp")`` (``dpcp`` always from ``dist.new_group``).
If that fails (an older torch, or a backend that cannot create sub-groups through it),
we fall back to ``dist.new_group`` per axis: every
rank creates every group of every axis in the same order, as ``new_group`` requires,
and keeps the ones it belongs to. Both give the same ranks per group (tested).

HSDP (``dp_replicate`` R > 1; torchtitan's ``dp_replicate`` x ``dp_shard``) cuts the
dp x cp ranks into R replicas of consecutive dp indices (dp index = rep * S + s, S =
dp / R; replicate outer, as torchtitan's mesh): ``dp_shard`` is the S x cp ranks of one
replica (where ZeRO shards, global order, index s * cp + cp index) and ``dp_replicate``
the R ranks holding the same shard (index rep), which all-reduce it. Both come from
``dist.new_group`` and exist only when R > 1 (``sizes["dp_replicate"]``).

The mesh is passed explicitly to every transform and engine; there is no global mesh.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch.distributed as dist

from paratrain.cost.ranks import Fold, grid_coords, grid_rank
from paratrain.plan import ParallelPlan

AXES = ("pp", "dp", "cp", "tp")  # outermost to innermost
HSDP_AXES = ("dp_shard", "dp_replicate")  # sub-groups of dp x cp under HSDP
FOLD_AXES = ("edp", "ep", "etp")  # the MoE layers' regrouping (outermost to innermost)


def _full(sizes: dict[str, int]) -> dict[str, int]:
    """``sizes`` with a cp axis of 1 where it has none (the pre-cp three-axis dicts)."""
    return sizes if "cp" in sizes else {**sizes, "cp": 1}


def coords_of(rank: int, sizes: dict[str, int]) -> dict[str, int]:
    """Axis indices of ``rank`` under the pp-dp-cp-tp layout (tp innermost); the keys of
    ``sizes`` (a cp index only when ``sizes`` has a cp axis)."""
    f = _full(sizes)
    c = dict(zip(AXES, grid_coords(rank, f["dp"], f["cp"], f["tp"]), strict=True))
    return {a: c[a] for a in AXES if a in sizes}


def rank_of(coords: dict[str, int], sizes: dict[str, int]) -> int:
    """Inverse of :func:`coords_of`."""
    f = _full(sizes)
    return grid_rank(coords["pp"], coords["dp"], coords.get("cp", 0), coords["tp"],
                     f["dp"], f["cp"], f["tp"])


def fold_of(sizes: dict[str, int]) -> Fold:
    """The expert fold of a mesh's ``sizes`` (ep = etp = 1 when it has none)."""
    f = _full(sizes)
    return Fold(f["dp"], f["cp"], f["tp"], sizes.get("ep", 1), sizes.get("etp", 1),
                sizes.get("fold_tp", 1))


def _fold_ranks(rank: int, axis: str, sizes: dict[str, int]) -> list[int]:
    fold = fold_of(sizes)
    c = list(fold.coords(rank))  # pp, edp, ep, etp, copy
    k = 1 + FOLD_AXES.index(axis)
    n = (fold.edp, fold.ep, fold.etp)[k - 1]
    return [fold.rank(*c[:k], i, *c[k + 1:]) for i in range(n)]


def axis_ranks(rank: int, axis: str, sizes: dict[str, int]) -> list[int]:
    """Global ranks of the group along ``axis`` that contains ``rank``, in axis order;
    ``axis="dpcp"``: the dp x cp group (dp outer, cp inner = global order)."""
    c = coords_of(rank, sizes)
    if axis in ("dp_shard", "dp_replicate"):
        f = _full(sizes)
        R = sizes.get("dp_replicate", 1)
        S = f["dp"] // R
        rep, s = divmod(c["dp"], S)
        if axis == "dp_replicate":
            return [rank_of({**c, "dp": i * S + s}, sizes) for i in range(R)]
        return [rank_of({**c, "dp": rep * S + d, "cp": k}, sizes)
                for d in range(S) for k in range(f["cp"])]
    if axis in FOLD_AXES:
        return _fold_ranks(rank, axis, sizes)
    if axis == "dpcp":
        f = _full(sizes)
        return [rank_of({**c, "dp": d, "cp": k}, sizes)
                for d in range(f["dp"]) for k in range(f["cp"])]
    return [rank_of({**c, axis: i}, sizes) for i in range(sizes[axis])]


def world_of(sizes: dict[str, int]) -> int:
    f = _full(sizes)
    return f["pp"] * f["dp"] * f["cp"] * f["tp"]


def layout_table(sizes: dict[str, int]) -> str:
    """Printable rank layout: one line per rank with its (pp, dp, [cp,] tp) coordinates
    (the cp column only when cp > 1)."""
    world = world_of(sizes)
    cp = _full(sizes)["cp"]
    mid = f" x cp={cp}" if cp > 1 else ""
    head = (f"mesh pp={sizes['pp']} x dp={sizes['dp']}{mid} x tp={sizes['tp']} "
            f"({world} ranks; tp innermost, then {'cp, then ' if cp > 1 else ''}dp, "
            "then pp)")
    lines = [head]
    if sizes.get("dp_replicate", 1) > 1:
        R = sizes["dp_replicate"]
        groups = sorted({tuple(axis_ranks(r, "dp_shard", sizes)) for r in range(world)})
        lines.append(f"  HSDP: {R} replicas; ZeRO shard groups {[list(g) for g in groups]}")
    if "ep" in sizes:
        fold = fold_of(sizes)
        copies = (f", each of the {sizes['tp']} tp ranks a copy"
                  if fold.fold_tp < sizes["tp"] else "")
        groups = sorted({tuple(axis_ranks(r, "ep", sizes)) for r in range(world)})
        lines.append(f"  MoE fold: edp {fold.edp} x ep {fold.ep} x etp {fold.etp}{copies}; "
                     f"ep groups {[list(g) for g in groups]}")
    for r in range(world):
        c = coords_of(r, sizes)
        cpc = f"  cp {c['cp']}" if cp > 1 else ""
        cpg = f"  cp group {axis_ranks(r, 'cp', sizes)}" if cp > 1 else ""
        lines.append(f"  rank {r:3d}: pp {c['pp']}  dp {c['dp']}{cpc}  tp {c['tp']}   "
                     f"tp group {axis_ranks(r, 'tp', sizes)}{cpg}  dp group "
                     f"{axis_ranks(r, 'dp', sizes)}  pp group {axis_ranks(r, 'pp', sizes)}")
    return "\n".join(lines)


@dataclass
class Mesh:
    """Process groups of this rank along each named axis, plus the layout arithmetic."""

    sizes: dict[str, int]
    rank: int
    groups: dict[str, object] = field(default_factory=dict)
    source: str = "none"  # "device_mesh", "new_group" or "none" (one process)

    @classmethod
    def from_plan(cls, plan: ParallelPlan, world: int | None = None,
                  device_type: str = "cpu") -> Mesh:
        """Build the groups for ``plan`` (collective: every rank must call it)."""
        initialized = dist.is_available() and dist.is_initialized()
        world = world if world is not None else (dist.get_world_size() if initialized else 1)
        sizes = {"pp": plan.pp, "dp": plan.dp, "cp": plan.cp, "tp": plan.tp}
        if plan.ep > 1 or plan.etp > 1:
            fold = Fold.of(plan)
            fold.check()
            sizes.update(ep=plan.ep, etp=plan.etp, fold_tp=fold.fold_tp)
        if plan.dp_replicate > 1:
            sizes["dp_replicate"] = plan.dp_replicate
        if world_of(sizes) != world:
            raise ValueError(f"pp*dp*cp*tp = {plan.pp}*{plan.dp}*{plan.cp}*{plan.tp} != "
                             f"world size {world}; make the plan's product equal the "
                             "process count")
        if not initialized:
            return cls(sizes, 0, {}, "none")
        rank = dist.get_rank()
        try:
            groups, source = cls._device_mesh_groups(sizes, device_type), "device_mesh"
        except Exception:  # noqa: BLE001 - any failure here means: build them by hand
            groups, source = cls._new_group_groups(sizes, rank), "new_group"
        groups["dpcp"] = groups["dp"] if plan.cp == 1 else cls._new_groups(
            sizes, rank, ("dpcp",))["dpcp"]
        extra = tuple(a for a in FOLD_AXES if "ep" in sizes and cls._fold_size(sizes, a) > 1)
        groups.update(cls._new_groups(sizes, rank, extra))
        if plan.dp_replicate > 1:
            groups.update(cls._new_groups(sizes, rank, HSDP_AXES))
            extra += HSDP_AXES
        mesh = cls(sizes, rank, groups, source)
        for axis in (*AXES, "dpcp", *extra):  # both paths must give the layout documented above
            got = dist.get_process_group_ranks(groups[axis])
            if got != axis_ranks(rank, axis, sizes):
                raise RuntimeError(f"{source} built {axis} group {got}, expected "
                                   f"{axis_ranks(rank, axis, sizes)}")
        return mesh

    @staticmethod
    def _fold_size(sizes: dict[str, int], axis: str) -> int:
        fold = fold_of(sizes)
        return {"edp": fold.edp, "ep": fold.ep, "etp": fold.etp}[axis]

    @staticmethod
    def _device_mesh_groups(sizes: dict[str, int], device_type: str) -> dict[str, object]:
        from torch.distributed.device_mesh import init_device_mesh

        dm = init_device_mesh(device_type, tuple(sizes[a] for a in AXES), mesh_dim_names=AXES)
        return {a: dm.get_group(a) for a in AXES}

    @staticmethod
    def _new_group_groups(sizes: dict[str, int], rank: int) -> dict[str, object]:
        return Mesh._new_groups(sizes, rank, tuple(a for a in AXES if a in sizes))

    @staticmethod
    def _new_groups(sizes: dict[str, int], rank: int, axes: tuple[str, ...]
                    ) -> dict[str, object]:
        world = world_of(sizes)
        mine = {}
        for axis in axes:
            seen = set()
            for r in range(world):  # same creation order on every rank
                ranks = tuple(axis_ranks(r, axis, sizes))
                if ranks in seen:
                    continue
                seen.add(ranks)
                g = dist.new_group(list(ranks))
                if rank in ranks:
                    mine[axis] = g
        return mine

    # ---- queries ---------------------------------------------------------------------
    def size(self, axis: str) -> int:
        if axis == "dpcp":
            return self.sizes["dp"] * self.sizes["cp"]
        if axis in HSDP_AXES:
            R = self.sizes.get("dp_replicate", 1)
            return R if axis == "dp_replicate" else self.sizes["dp"] // R * self.sizes["cp"]
        if axis in FOLD_AXES:
            return self._fold_size(self.sizes, axis)
        return self.sizes[axis]

    def index(self, axis: str) -> int:
        """This rank's coordinate along ``axis`` (``dpcp``: dp index x cp + cp index)."""
        c = coords_of(self.rank, self.sizes)
        if axis == "dpcp":
            return c["dp"] * self.sizes["cp"] + c["cp"]
        if axis in HSDP_AXES:
            rep, s = divmod(c["dp"], self.sizes["dp"] // self.sizes.get("dp_replicate", 1))
            return rep if axis == "dp_replicate" else s * self.sizes["cp"] + c["cp"]
        if axis in FOLD_AXES:
            return fold_of(self.sizes).coords(self.rank)[1 + FOLD_AXES.index(axis)]
        return c[axis]

    def group(self, axis: str):
        """The process group along ``axis`` (None when there is one process)."""
        return self.groups.get(axis)

    def peer(self, axis: str, index: int) -> int:
        """Global rank of the member at ``index`` along ``axis`` of this rank's group."""
        return axis_ranks(self.rank, axis, self.sizes)[index]

    def peer_ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along ``axis``."""
        return axis_ranks(self.rank, axis, self.sizes)

    @property
    def world(self) -> int:
        return world_of(self.sizes)

    def layout(self) -> str:
        return layout_table(self.sizes) + f"\n  groups built by: {self.source}"


def all_layouts(max_world: int) -> list[dict[str, int]]:
    """Every (pp, dp, tp) with product <= max_world (for tests of the arithmetic)."""
    out = []
    for pp, dp, tp in itertools.product(range(1, max_world + 1), repeat=3):
        if pp * dp * tp <= max_world:
            out.append({"pp": pp, "dp": dp, "tp": tp})
    return out
