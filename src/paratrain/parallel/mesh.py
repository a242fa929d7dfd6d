"""The device mesh: one object that owns every process group, with named axes.

Rank layout (Megatron-LM, Narayanan et al. 2021, section 3.3): ``tp`` is the innermost
axis, then ``dp``, then ``pp``, i.e.::

    global_rank = (pp_index * dp + dp_index) * tp + tp_index

so tensor-parallel partners are neighbouring ranks (on a GPU server: the same node, on
NVLink, where TP's per-layer all-reduces belong), data-parallel replicas come next, and
pipeline stages — which only exchange one activation per micro-batch — are furthest
apart. ``cp`` and ``ep`` are reserved names: the plan may not set them above 1 yet
(refused in :meth:`Mesh.from_plan`).

Groups come from ``torch.distributed.device_mesh.init_device_mesh`` with
``mesh_dim_names=("pp", "dp", "tp")``. If that fails (an older torch, or a backend that
cannot create sub-groups through it), we fall back to ``dist.new_group`` per axis: every
rank creates every group of every axis in the same order, as ``new_group`` requires,
and keeps the ones it belongs to. Both give the same ranks per group (tested).

The mesh is passed explicitly to every transform and engine; there is no global mesh.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch.distributed as dist

from paratrain.plan import ParallelPlan

AXES = ("pp", "dp", "tp")  # outermost to innermost


def coords_of(rank: int, sizes: dict[str, int]) -> dict[str, int]:
    """Axis indices of ``rank`` under the pp-dp-tp layout (tp innermost)."""
    tp, dp = sizes["tp"], sizes["dp"]
    return {"pp": rank // (dp * tp), "dp": (rank // tp) % dp, "tp": rank % tp}


def rank_of(coords: dict[str, int], sizes: dict[str, int]) -> int:
    """Inverse of :func:`coords_of`."""
    return (coords["pp"] * sizes["dp"] + coords["dp"]) * sizes["tp"] + coords["tp"]


def axis_ranks(rank: int, axis: str, sizes: dict[str, int]) -> list[int]:
    """Global ranks of the group along ``axis`` that contains ``rank``, in axis order."""
    c = coords_of(rank, sizes)
    return [rank_of({**c, axis: i}, sizes) for i in range(sizes[axis])]


def layout_table(sizes: dict[str, int]) -> str:
    """Printable rank layout: one line per rank with its (pp, dp, tp) coordinates."""
    world = sizes["pp"] * sizes["dp"] * sizes["tp"]
    head = (f"mesh pp={sizes['pp']} x dp={sizes['dp']} x tp={sizes['tp']} "
            f"({world} ranks; tp innermost, then dp, then pp)")
    lines = [head]
    for r in range(world):
        c = coords_of(r, sizes)
        lines.append(f"  rank {r:3d}: pp {c['pp']}  dp {c['dp']}  tp {c['tp']}   "
                     f"tp group {axis_ranks(r, 'tp', sizes)}  dp group "
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
        if plan.cp != 1 or plan.ep != 1:
            raise ValueError(f"cp={plan.cp}, ep={plan.ep}: context and expert parallelism "
                             "are reserved mesh axes, not implemented yet; use cp=1 ep=1")
        initialized = dist.is_available() and dist.is_initialized()
        world = world if world is not None else (dist.get_world_size() if initialized else 1)
        sizes = {"pp": plan.pp, "dp": plan.dp, "tp": plan.tp}
        if sizes["pp"] * sizes["dp"] * sizes["tp"] != world:
            raise ValueError(f"pp*dp*tp = {plan.pp}*{plan.dp}*{plan.tp} != world size {world}; "
                             "make the plan's product equal the process count")
        if not initialized:
            return cls(sizes, 0, {}, "none")
        rank = dist.get_rank()
        try:
            groups, source = cls._device_mesh_groups(sizes, device_type), "device_mesh"
        except Exception:  # noqa: BLE001 - any failure here means: build them by hand
            groups, source = cls._new_group_groups(sizes, rank), "new_group"
        mesh = cls(sizes, rank, groups, source)
        for axis in AXES:  # both paths must give the layout documented above
            got = dist.get_process_group_ranks(groups[axis])
            if got != axis_ranks(rank, axis, sizes):
                raise RuntimeError(f"{source} built {axis} group {got}, expected "
                                   f"{axis_ranks(rank, axis, sizes)}")
        return mesh

    @staticmethod
    def _device_mesh_groups(sizes: dict[str, int], device_type: str) -> dict[str, object]:
        from torch.distributed.device_mesh import init_device_mesh

        dm = init_device_mesh(device_type, tuple(sizes[a] for a in AXES), mesh_dim_names=AXES)
        return {a: dm.get_group(a) for a in AXES}

    @staticmethod
    def _new_group_groups(sizes: dict[str, int], rank: int) -> dict[str, object]:
        world = sizes["pp"] * sizes["dp"] * sizes["tp"]
        mine = {}
        for axis in AXES:
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
        return self.sizes[axis]

    def index(self, axis: str) -> int:
        """This rank's coordinate along ``axis``."""
        return coords_of(self.rank, self.sizes)[axis]

    def group(self, axis: str):
        """The process group along ``axis`` (None when there is one process)."""
        return self.groups.get(axis)

    def peer(self, axis: str, index: int) -> int:
        """Global rank of the member at ``index`` along ``axis`` of this rank's group."""
        return axis_ranks(self.rank, axis, self.sizes)[index]

    @property
    def world(self) -> int:
        return self.sizes["pp"] * self.sizes["dp"] * self.sizes["tp"]

    def layout(self) -> str:
        return layout_table(self.sizes) + f"\n  groups built by: {self.source}"


def all_layouts(max_world: int) -> list[dict[str, int]]:
    """Every (pp, dp, tp) with product <= max_world (for tests of the arithmetic)."""
    out = []
    for pp, dp, tp in itertools.product(range(1, max_world + 1), repeat=3):
        if pp * dp * tp <= max_world:
            out.append({"pp": pp, "dp": dp, "tp": tp})
    return out
