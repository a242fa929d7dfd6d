"""One bubble formula: the closed form in ``cost/schedule.py`` equals the
simulation of the very schedule the runtime executes, for every (schedule, p, m, v) up to
16 that the builder accepts (the V-shaped zb-v and dualpipev at their only v, 2), and the
systems model's step time uses that closed form."""

from __future__ import annotations

import pytest

from conftest import TINY
from paratrain.cost.pipeline_sim import simulate_pipeline
from paratrain.cost.schedule import (
    SCHEDULES,
    V_SHAPED,
    bubble_formula,
    bubble_over_compute,
    build_schedule,
)
from paratrain.systems import step_time as st

TOL = 1e-12  # the simulator adds unit (or 1/v) durations: only rounding separates them


def _accepted(p: int):
    for name in SCHEDULES:
        for m in range(1, 17):
            for v in (range(1, 17) if name == "interleaved" else (2,) if name in V_SHAPED
                      else (1,)):
                try:
                    yield name, m, v, build_schedule(name, p, m, v)
                except ValueError:  # interleaved with m % p != 0, dualpipev with m < 2p
                    assert (name == "interleaved" and m % p
                            or name == "dualpipev" and m < 2 * p), (name, p, m, v)


@pytest.mark.parametrize("p", range(1, 17))
@pytest.mark.slow
def test_closed_form_equals_the_simulated_schedule(p):
    for name, m, v, sched in _accepted(p):
        sim = simulate_pipeline(sched).bubble
        assert sim == pytest.approx(bubble_formula(name, p, m, v), abs=TOL), (name, p, m, v)
        b = bubble_over_compute(name, p, m, v)
        assert b / (1 + b) == pytest.approx(sim, abs=TOL)
        if name == "zb-h1" and m < p:
            # Qi et al.'s (p-1)/(3m+p-1) assumes m >= p: with fewer micro-batches than
            # stages the deferred weight gradients cannot fill the ramp (the last
            # micro-batch's forward still needs p-1 hops and its input gradient p-1 back),
            # so the step lasts 2(p+m)-1 forward times: more bubble than the paper's figure,
            # still less than 1F1B's.
            paper = (p - 1) / (3 * m + p - 1)
            assert paper < sim < bubble_formula("1f1b", p, m)
            assert sim == pytest.approx((2 * p - m - 1) / (2 * p + 2 * m - 1), abs=TOL)


def test_v_schedules_are_accepted_and_proved_everywhere_up_to_16():
    """The V schedules' closed form against the simulator for every accepted (p, m) up to
    16 (the slow test above covers the others at every v): zb-v takes every m, dualpipev
    every m >= 2p; with enough micro-batches both idle (p-1)/2 forward-times per rank."""
    n = 0
    for p in range(1, 17):
        for name in V_SHAPED:
            for m in range(1, 17):
                if name == "dualpipev" and m < 2 * p:
                    with pytest.raises(ValueError, match="2\\*pp"):
                        build_schedule(name, p, m, 2)
                    continue
                sim = simulate_pipeline(build_schedule(name, p, m, 2)).bubble
                assert sim == pytest.approx(bubble_formula(name, p, m, 2), abs=TOL), (
                    name, p, m)
                b = bubble_over_compute(name, p, m, 2)
                assert b / (1 + b) == pytest.approx(sim, abs=TOL)
                if 2 * p - 1 - m <= (p - 1) / 2:
                    assert sim == pytest.approx((p - 1) / (6 * m + p - 1), abs=TOL)
                n += 1
    assert n == 16 * 16 + sum(max(0, 17 - 2 * p) for p in range(1, 17))


def test_step_time_prices_the_same_bubble():
    for name, p, m, v in (("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2), ("zb-h1", 8, 4, 1),
                          ("zb-h1", 4, 8, 1), ("gpipe", 1, 3, 1), ("zb-v", 4, 8, 2),
                          ("dualpipev", 4, 8, 2)):
        assert st.bubble_fraction(name, p, m, v) == bubble_formula(name, p, m, v)
        assert st.bubble_over_compute(name, p, m, v) == bubble_over_compute(name, p, m, v)


def test_unknown_schedule_is_one_line_error():
    with pytest.raises(ValueError, match="unknown"):
        bubble_formula("pipedream", 4, 8)


@pytest.mark.parametrize("p", range(1, 17))
@pytest.mark.slow
def test_run_prediction_prices_the_simulated_bubble(p):
    """The run prediction's bubble (:func:`paratrain.predict.pipeline.pipeline_bubble`, with
    injected equal stage times) is the simulated schedule's idle time per rank, and its
    critical path the simulated step, for every schedule the builder accepts: ZB-H1 is
    not priced like 1F1B."""
    from paratrain.plan import ParallelPlan
    from paratrain.predict.pipeline import pipeline_bubble, pipeline_path

    t = 1.5  # one micro-batch's forward + backward on a stage (seconds)
    costs = {"F": t / 3, "B": 2 * t / 3, "BI": t / 3, "BW": t / 3}
    for name, m, v, sched in _accepted(p):
        plan = ParallelPlan(pp=p, micro_batches=m, schedule=name, virtual_stages=v)
        tl = simulate_pipeline(sched, costs)
        got = pipeline_bubble([t] * p, plan)
        assert got == pytest.approx(tl.makespan - m * t, rel=1e-12, abs=TOL), (name, p, m, v)
        assert pipeline_path([t] * p, 0, plan) == pytest.approx(tl.makespan, rel=1e-12)


def test_run_prediction_prices_each_schedule_its_own_bubble():
    """Through :func:`paratrain.predict.predict`: the same stages cost the same, and the
    bubble scales by the schedule's closed form, ZB-H1 a third of 1F1B's with m >= p."""
    from paratrain.config import TrainConfig
    from paratrain.cost.hardware import Hardware
    from paratrain.plan import ParallelPlan
    from paratrain.predict import MachineModel, predict

    model = TINY.replace(n_layers=4)
    tc = TrainConfig(steps=2, global_batch=8, dtype="float32")
    hw = Hardware("test-box", peak_flops=4e9, hbm_bytes=8e9, hbm_bw=1e10, gpus_per_node=4,
                  intra_bw=1e9, intra_alpha=1e-4, inter_bw=1e9, inter_alpha=1e-4, eta=1.0)
    machine = MachineModel(hw, eta=0.5, thread_peak=1e9, pass_s=1e-3, step_s=2e-3,
                           fitted=True)
    got = {s: predict(model, tc, ParallelPlan(pp=2, micro_batches=4, schedule=s), 2,
                      machine) for s in ("1f1b", "gpipe", "zb-h1")}
    one_f = got["1f1b"].bubble_s
    assert one_f > 0 and got["gpipe"].bubble_s == one_f
    assert got["zb-h1"].bubble_s == pytest.approx(
        one_f * bubble_over_compute("zb-h1", 2, 4) / bubble_over_compute("1f1b", 2, 4),
        rel=1e-12)
    assert got["zb-h1"].bubble_s == pytest.approx(one_f / 3, rel=1e-12)
    # the schedule changes the fill only: the critical path is shorter by the difference
    saved = got["1f1b"].critical_path_s - got["zb-h1"].critical_path_s
    assert saved == pytest.approx(one_f - got["zb-h1"].bubble_s, rel=1e-9)
