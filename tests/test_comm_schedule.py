"""Schedules as data: shapes, validation, errors, and the DESIGN figures priced from them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from paratrain.comm import ALGORITHMS, build, chunk_sizes, count, time_s
from paratrain.comm.schedule import COPY, CollectiveSchedule, Transfer


def test_chunk_sizes_split_any_count():
    assert chunk_sizes(10, 4) == (3, 3, 2, 2)
    assert chunk_sizes(2, 4) == (1, 1, 0, 0)
    assert chunk_sizes(0, 3) == (0, 0, 0)
    for n in range(40):
        for k in range(1, 9):
            c = chunk_sizes(n, k)
            assert sum(c) == n and max(c) - min(c) <= 1


@pytest.mark.parametrize("op", sorted(ALGORITHMS))
def test_every_schedule_validates_and_single_rank_is_empty(op):
    for alg in ALGORITHMS[op]:
        for p in (1, 2, 3, 4, 5, 8):
            if alg == "halving_doubling" and op != "all_reduce" and p & (p - 1):
                continue
            s = build(op, alg, p, 11).validate()
            assert s.p == p and sum(s.seg_sizes) >= 0
            if p == 1:
                assert s.steps == 0


def test_ring_all_reduce_shape():
    s = build("all_reduce", "ring", 4, 8)
    assert s.steps == 6 and all(len(r) == 4 for r in s.rounds)
    assert count(s).sent == (12, 12, 12, 12)  # 2(p-1)/p x 8 elements


def test_bad_inputs_are_one_line_value_errors():
    with pytest.raises(ValueError, match="algorithm='ringg'.*use one of"):
        build("all_reduce", "ringg", 4, 8)
    with pytest.raises(ValueError, match="op='allreduce'"):
        build("allreduce", "ring", 4, 8)
    with pytest.raises(ValueError, match="root=4"):
        build("broadcast", "tree", 4, 8, root=4)
    with pytest.raises(ValueError, match="power of two"):
        build("reduce_scatter", "halving_doubling", 3, 8)
    with pytest.raises(ValueError, match="n=-1"):
        build("all_reduce", "ring", 2, -1)
    bad = CollectiveSchedule("broadcast", "x", 2, 1, (1,), ((Transfer(0, 1, 0, COPY),
                                                   Transfer(0, 1, 0, COPY)),))
    with pytest.raises(ValueError, match="two copies"):
        bad.validate()


def test_schedules_import_no_torch():
    code = ("import sys, paratrain.comm as c, paratrain.comm.simulator; "
            "c.build('all_reduce', 'ring', 4, 9); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_design_figures_priced_from_schedules():
    """DESIGN.md: LLaMA-2 7B bf16 gradient (13.5 GB) among 64 GPUs at 50 GB/s."""
    n = 6_738_415_616  # parameters = bf16 elements
    ring = build("all_reduce", "ring", 64, n)
    assert max(count(ring).sent) * 2 / 1e9 == pytest.approx(26.5, abs=0.05)
    assert time_s(ring, 0.0, 50e9, elem_bytes=2) == pytest.approx(0.53, abs=0.005)
    tree = build("all_reduce", "tree", 64, n)
    assert tree.steps == 12
    assert time_s(tree, 0.0, 50e9, elem_bytes=2) == pytest.approx(3.2, abs=0.05)
    nvlink = build("all_reduce", "ring", 8, n)
    assert time_s(nvlink, 0.0, 450e9, elem_bytes=2) == pytest.approx(0.052, abs=0.001)


def test_rounds_and_simple_prices_agree_for_balanced_schedules():
    for alg in ("ring", "halving_doubling"):
        s = build("all_reduce", alg, 8, 8 * 1000)
        assert time_s(s, 1e-5, 1e9, model="rounds") == pytest.approx(
            time_s(s, 1e-5, 1e9, model="simple"))
    # a tree's root sends log2 p times but waits in between: rounds > simple
    t = build("all_reduce", "tree", 8, 1000)
    assert time_s(t, 0, 1e9) == pytest.approx(2 * time_s(t, 0, 1e9, model="simple"))
