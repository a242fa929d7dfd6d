"""The closed forms of paratrain.cost.collectives against the hand-made schedules of
paratrain.comm: the same steps and the same bytes for the busiest rank (vector sizes that
split evenly), including the pipeline fill of segmented algorithms."""

from __future__ import annotations

import pytest

from paratrain.comm import algorithms, cost
from paratrain.cost import collectives as coll

N = 2**4 * 3**2 * 5 * 7 * 11 * 13 * 17  # divisible by every piece count used below


def _cases():
    for op, algs in algorithms.ALGORITHMS.items():
        if op == "sparse_all_gather":
            continue
        for alg in algs:
            segs = (1, 2, 7, 8) if (op, alg) in algorithms.SEGMENTED else (None,)
            for p in (1, 2, 3, 5, 8, 12, 16, 17):
                for seg in segs:
                    try:  # only the schedules paratrain.comm builds (it refuses the rest)
                        algorithms.build(op, alg, p, 64, segments=seg)
                    except ValueError:
                        continue
                    yield op, alg, p, seg


@pytest.mark.parametrize("op, alg, p, seg", list(_cases()))
def test_formulas_equal_executed_schedules(op, alg, p, seg):
    sched = algorithms.build(op, alg, p, N, segments=seg)
    counts = cost.count(sched)
    mine = "naive" if alg == "pairwise" else alg  # pairwise = direct exchange
    assert coll.steps(op, mine, p, segments=seg) == counts.steps
    assert coll.wire_bytes(op, mine, p, N, segments=seg) == pytest.approx(max(counts.sent),
                                                                          rel=1e-12)
