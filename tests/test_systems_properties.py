"""Hypothesis properties of the systems model (issue 3)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paratrain.cost import collectives as coll
from paratrain.cost.hardware import load_hardware
from paratrain.cost.memory import model_states_bytes
from paratrain.cost.shapes import load_model
from paratrain.plan import ParallelPlan
from paratrain.systems.step_time import step_time

FAST = settings(deadline=None, max_examples=40)
P = st.integers(min_value=1, max_value=4096)
PAYLOAD = st.floats(min_value=0.0, max_value=1e12, allow_nan=False)
LLAMA = load_model("llama2-7b")
H100 = load_hardware("h100")


@FAST
@given(P, PAYLOAD)
def test_ring_all_reduce_wire_is_minimum_and_rs_plus_ag(p, n):
    w = coll.wire_bytes("all_reduce", "ring", p, n)
    assert w == pytest.approx(2 * (p - 1) / p * n, rel=1e-12, abs=1e-9)
    rs_ag = coll.wire_bytes("reduce_scatter", "ring", p, n) + \
        coll.wire_bytes("all_gather", "ring", p, n)
    assert w == pytest.approx(rs_ag, rel=1e-12, abs=1e-9)
    assert coll.steps("all_reduce", "ring", p) == 2 * (p - 1)
    assert coll.steps("all_reduce", "ring", p) == coll.steps("reduce_scatter", "ring", p) + \
        coll.steps("all_gather", "ring", p)


@FAST
@given(st.integers(min_value=1, max_value=20))
def test_tree_steps_grow_as_log2_p(k):
    p = 2 ** k
    assert coll.steps("all_reduce", "tree", p) == 2 * k
    assert coll.steps("broadcast", "tree", p) == k
    assert coll.steps("all_reduce", "halving_doubling", p) == 2 * k
    # and for any p, ceil(log2 p) levels
    assert coll.steps("reduce", "tree", p + 1) == math.ceil(math.log2(p + 1))


@FAST
@given(P, st.floats(min_value=1.0, max_value=1e11), st.floats(min_value=0, max_value=1e-4),
       st.floats(min_value=1e9, max_value=1e12))
def test_ring_never_slower_than_naive_tree_for_large_payloads(p, n, alpha, bw):
    ring = coll.time_s("all_reduce", "ring", p, n, alpha, bw)
    tree = coll.time_s("all_reduce", "tree", p, n, alpha, bw)
    if n / bw > 100 * alpha * p:
        assert ring <= tree + 1e-12


@FAST
@given(P, PAYLOAD)
def test_compressed_all_gather_grows_with_p(p, piece):
    expect = pytest.approx((p - 1) * piece, rel=1e-12, abs=1e-6)
    assert coll.compressed_wire_bytes(p, piece) == expect


@FAST
@given(st.sampled_from([1, 2, 4, 8, 16, 64, 256, 1024]), st.sampled_from([1, 2, 4, 8]),
       st.sampled_from([1, 2, 4]))
def test_zero_memory_falls_with_stage_and_with_d(d, tp, pp):
    prev = math.inf
    for z in range(4):
        b = model_states_bytes(LLAMA, ParallelPlan(dp=d, tp=tp, pp=pp, zero=z))
        assert b <= prev + 1e-6
        prev = b
        if z:
            assert model_states_bytes(LLAMA, ParallelPlan(dp=2 * d, tp=tp, pp=pp, zero=z)) < b


LAYOUTS = st.fixed_dictionaries({
    "tp": st.sampled_from([1, 2, 4, 8]), "pp": st.sampled_from([1, 2, 4]),
    "cp": st.sampled_from([1, 2]), "zero": st.integers(0, 3),
    "micro_batches": st.sampled_from([1, 2, 4, 8]),
    "schedule": st.sampled_from(["gpipe", "1f1b", "zb-h1"]),
    "recompute": st.sampled_from(["none", "selective", "full"]),
    "gpus": st.sampled_from([8, 16, 64, 256]),
    "hw": st.sampled_from(["h100", "a100", "mi300x", "tpu-v4"]),
    "eta": st.floats(min_value=0.1, max_value=1.0),
})


@FAST
@given(LAYOUTS)
def test_mfu_bounded_by_eta_and_overlap_never_slower(c):
    rest = c["tp"] * c["pp"] * c["cp"]
    dp = max(1, c["gpus"] // rest)
    plan = ParallelPlan(dp=dp, tp=c["tp"], pp=c["pp"], cp=c["cp"], zero=c["zero"],
                        micro_batches=c["micro_batches"], schedule=c["schedule"],
                        recompute=c["recompute"])
    tokens = 4096 * dp * c["micro_batches"] * 2
    s = step_time(LLAMA, plan, load_hardware(c["hw"]), tokens, 4096, eta=c["eta"])
    assert s.step_overlap_s <= s.step_sync_s + 1e-12
    assert s.mfu_overlap <= c["eta"] + 1e-12
    assert s.mfu_sync <= s.mfu_overlap + 1e-12
    assert s.hfu_overlap <= c["eta"] + 1e-12
    assert s.mfu_overlap <= s.hfu_overlap + 1e-12
