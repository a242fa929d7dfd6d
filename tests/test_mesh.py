"""The mesh: tp innermost, then dp, then pp; device_mesh and the new_group fallback
build the same groups; the layout prints."""

from __future__ import annotations

from paratrain.parallel.mesh import Mesh, all_layouts, axis_ranks, coords_of, layout_table, rank_of
from paratrain.parallel.process_groups import spawn
from paratrain.plan import ParallelPlan


def test_layout_arithmetic():
    for sizes in all_layouts(12):
        world = sizes["pp"] * sizes["dp"] * sizes["tp"]
        for r in range(world):
            c = coords_of(r, sizes)
            assert rank_of(c, sizes) == r
            for axis in ("pp", "dp", "tp"):
                ranks = axis_ranks(r, axis, sizes)
                assert r in ranks and len(ranks) == sizes[axis]
    sizes = {"pp": 2, "dp": 2, "tp": 2}
    assert axis_ranks(0, "tp", sizes) == [0, 1]  # tp partners are neighbours
    assert axis_ranks(0, "dp", sizes) == [0, 2]
    assert axis_ranks(0, "pp", sizes) == [0, 4]  # stages furthest apart
    text = layout_table(sizes)
    assert "rank   5: pp 1  dp 0  tp 1" in text


def test_ep_is_a_sub_axis_of_dp():
    """ep groups: consecutive dp indices; edp: the dp ranks holding the same experts."""
    sizes = {"pp": 1, "dp": 4, "cp": 1, "tp": 2, "ep": 2}
    assert axis_ranks(0, "ep", sizes) == [0, 2]
    assert axis_ranks(4, "ep", sizes) == [4, 6]
    assert axis_ranks(0, "edp", sizes) == [0, 4]
    assert axis_ranks(3, "edp", sizes) == [3, 7]
    m = Mesh.from_plan(ParallelPlan(dp=4, tp=2, ep=2), world=8)
    assert m.size("ep") == 2 and m.size("edp") == 2


def test_cp_sits_between_dp_and_tp():
    sizes = {"pp": 2, "dp": 2, "cp": 2, "tp": 2}
    for r in range(16):
        assert rank_of(coords_of(r, sizes), sizes) == r
    assert axis_ranks(0, "tp", sizes) == [0, 1]
    assert axis_ranks(0, "cp", sizes) == [0, 2]
    assert axis_ranks(0, "dp", sizes) == [0, 4]
    assert axis_ranks(0, "pp", sizes) == [0, 8]
    assert axis_ranks(1, "dpcp", sizes) == [1, 3, 5, 7]  # gradients reduce over dp x cp
    assert "rank   6: pp 0  dp 1  cp 1  tp 0" in layout_table(sizes)


def _mesh_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    out = {}
    for plan in (ParallelPlan(pp=2, tp=2), ParallelPlan(dp=2, tp=2), ParallelPlan(pp=2, dp=2),
                 ParallelPlan(dp=2, cp=2), ParallelPlan(cp=2, tp=2)):
        mesh = Mesh.from_plan(plan)
        fallback = Mesh._new_group_groups(mesh.sizes, rank)
        out[str(mesh.sizes)] = {
            "source": mesh.source,
            "groups": {a: dist.get_process_group_ranks(mesh.group(a)) for a in mesh.sizes},
            "fallback": {a: dist.get_process_group_ranks(fallback[a]) for a in mesh.sizes},
            "dpcp": dist.get_process_group_ranks(mesh.group("dpcp")),
            "index": {a: mesh.index(a) for a in mesh.sizes},
            "layout": mesh.layout(),
        }
    return out


def test_groups_on_four_processes():
    results = spawn(_mesh_worker, 4, timeout_s=120)
    for rank, res in enumerate(results):
        for key, r in res.items():
            assert r["groups"] == r["fallback"]  # device_mesh == the new_group fallback
            sizes = eval(key)  # noqa: S307 - our own dict repr
            for a in ("pp", "dp", "cp", "tp"):
                assert r["groups"][a] == axis_ranks(rank, a, sizes)
                assert r["index"][a] == coords_of(rank, sizes)[a]
            assert r["dpcp"] == axis_ranks(rank, "dpcp", sizes)
    print(results[0]["{'pp': 2, 'dp': 1, 'cp': 1, 'tp': 2}"]["layout"])
