"""The oversubscribed CPU in the one prediction (paratrain.predict.sched), by hand: compute
stretched by ranks over the cores the session gets (less in a pipeline's fill), a wake-up
per blocking sync on free cores, the oversubscribed sync's cost on top of the CPU-work
bound, the syncs counted from the same calls as the bytes, and the constants read from
the file `paratrain bench calibrate` writes. No wall clock anywhere."""

from __future__ import annotations

import dataclasses
import json

import pytest

from conftest import TINY
from paratrain.config import TrainConfig
from paratrain.cost.hardware import Hardware
from paratrain.plan import ParallelPlan
from paratrain.predict import MachineModel, load_machine, predict
from paratrain.predict import sched as S
from paratrain.predict.axes import ep_bursts
from paratrain.predict.machine import save_sched

TC = TrainConfig(global_batch=8)
MOE = TINY.replace(experts=4, top_k=2, moe_ffn=32)


def _machine(cores: int, wake: float = 0.0, busy: float = 0.0) -> MachineModel:
    hw = Hardware("test-box", peak_flops=4e9, hbm_bytes=8e9, hbm_bw=1e10, gpus_per_node=cores,
                  intra_bw=1e9, intra_alpha=1e-4, inter_bw=1e9, inter_alpha=1e-4, eta=1.0)
    return MachineModel(hw, eta=0.5, thread_peak=1e9, pass_s=1e-3, step_s=2e-3, wake_s=wake,
                        busy_sync_s=busy, sched="test", fitted=True)


def test_free_cores_add_a_wake_up_per_blocking_sync():
    """tp2 on 4 free cores: per micro-batch 2 blocks x 4 TP all-reduces, the embedding's
    and the head's, 3 small ones at the head; per step the loss and the gradient norm."""
    plan = ParallelPlan(tp=2)
    base = predict(TINY, TC, plan, 2, _machine(4))
    p = predict(TINY, TC, plan, 2, _machine(4, wake=1e-3, busy=5.0))
    assert p.oversubscription == 1.0 and p.syncs == 2 * 4 + 2 + 3 + 2
    assert p.critical_path_s == pytest.approx(base.critical_path_s + 15e-3)
    assert p.step_s == pytest.approx(p.critical_path_s) and p.sync_s == pytest.approx(15e-3)
    assert p.compute_s == base.compute_s  # nothing stretches on free cores


def test_oversubscribed_cores_stretch_compute_and_price_each_sync():
    """dp4 on 2 free cores: 2 ranks per core. The critical path computes at half speed;
    the CPU bound is the work over 2 cores plus busy_sync_s per sync: the one DDP bucket
    and the loss and gradient norm, all-reduces over 4 ranks, 6 blocking rounds each,
    3 calibrated 2-round syncs."""
    plan = ParallelPlan(dp=4)
    free = predict(TINY, TC, plan, 4, _machine(4))
    p = predict(TINY, TC, plan, 4, _machine(2, wake=1e-4, busy=2e-3))
    assert p.share == 0.5 and p.oversubscription == 2.0
    assert p.compute_s == pytest.approx(2 * free.compute_s)
    assert p.overhead_s == pytest.approx(2 * free.overhead_s)
    assert p.syncs == 3 + 2 * 3
    assert p.session_work_s == pytest.approx(free.session_work_s)
    assert p.step_s == pytest.approx(max(p.critical_path_s, p.session_work_s / 2 + 9 * 2e-3))


def test_an_oversubscribed_sync_adds_the_idle_time_the_calibration_measured():
    """busy_sync_s is already the wall beyond the ranks' CPU over the cores (the time no
    core computed at a sync), so the work bound adds it whole, whatever the fitted
    collective CPU."""
    m = _machine(2, wake=1e-4, busy=2e-3).replace(coll_call_cpu_s=3e-4, coll_step_cpu_s=2e-4)
    plan = ParallelPlan(dp=4)
    for machine in (m, m.replace(coll_call_cpu_s=3e-3, sync_cpu_s=1e-3)):
        p = predict(TINY, TC, plan, 4, machine)
        assert p.step_s == pytest.approx(max(p.critical_path_s,
                                             p.session_work_s / 2 + p.syncs * 2e-3))
        assert S.bounds(1.0, 0.5, p.syncs, 2.0, machine)[1] == pytest.approx(
            0.5 + p.syncs * 2e-3)


def test_a_blocking_call_after_compute_costs_its_measured_cpu():
    """sync_cpu_s (a call after a segment of compute, beyond the same call in a tight
    loop) is paid once per collective call and once per send / receive pair: tp2's rank
    makes 2 x 4 + 2 + 3 TP all-reduces and 2 step all-reduces; pp2 with 2 micro-batches
    sends and receives 4 messages on stage 0 (2 pairs), plus the 2 step all-reduces."""
    base = _machine(4).replace(coll_call_cpu_s=1e-4)
    for plan, calls in ((ParallelPlan(tp=2), 15), (ParallelPlan(pp=2, micro_batches=2), 4)):
        a = predict(TINY, TC, plan, plan.world_size, base)
        b = predict(TINY, TC, plan, plan.world_size, base.replace(sync_cpu_s=1e-3))
        assert b.cpu_rank0_s - a.cpu_rank0_s == pytest.approx(calls * 1e-3)


def test_pipeline_fill_stretches_only_with_the_ranks_that_run():
    """dp2 x pp2 on 2 cores: o = 2 in the steady state, o / pp = 1 in the fill."""
    plan = ParallelPlan(dp=2, pp=2, micro_batches=4)
    assert S.stretch(2.0, plan) == (2.0, 1.0)
    assert S.stretch(8.0, plan) == (8.0, 4.0)
    free = predict(TINY, TC, plan, 4, _machine(4))
    p = predict(TINY, TC, plan, 4, _machine(2))
    fill = free.bubble_s  # equal stages: the fill is the bubble, unstretched at o / pp = 1
    assert p.compute_s + p.overhead_s == pytest.approx(
        2 * (free.compute_s + free.overhead_s - fill) + fill, rel=1e-3)


@pytest.mark.parametrize(("plan", "per_mb", "loss"), [
    (ParallelPlan(cp=2), 2 * (2 * 1 + 2) / 2, 2),  # ring: 2(cp-1) + cp receives a block
    (ParallelPlan(cp=2, recompute="full"), 2 * (3 * 1 + 2) / 2, 2),  # the forward's again
    # 8 calls a block in 4 back-to-back groups (q, k, v; the output; both directions)
    (ParallelPlan(cp=2, cp_algorithm="all-to-all"), 2 * 4, 2),
    (ParallelPlan(cp=2, tp=2), 2 * 4 / 2 + 2 * 4 + 2 + 3, 6),  # TP: 2-round all-reduces
])
def test_cp_syncs_by_hand(plan, per_mb, loss):
    """In calibrated syncs (a 2-round all-reduce): a receive is 1/2; the dp x cp
    reducer's one bucket on 2 ranks 1; the loss and gradient norm over the world."""
    p = predict(TINY, TrainConfig(global_batch=2), plan, plan.world_size, _machine(8))
    assert p.syncs == per_mb + 1 + loss


def test_ep_syncs_and_pipeline_sends_by_hand():
    """dp2 x ep2: 4 all-to-alls and the split sizes per MoE block, in 4 back-to-back
    groups (the sizes go with the dispatch), a whole sync each; 6 with full recompute
    (the forward's two groups again); pp2 m4: 2 (m + 1) receives along the path, no
    data-parallel reducer."""
    p = predict(MOE, TC, ParallelPlan(dp=2, ep=2), 2, _machine(4))
    r = predict(MOE, TC, ParallelPlan(dp=2, ep=2, recompute="full"), 2, _machine(4))
    assert p.syncs - 2 * 4 - 2 >= 1  # and the dense and the experts' reducers
    assert r.syncs - p.syncs == 2 * 2
    assert ep_bursts(ParallelPlan(dp=2, ep=2)) == 4
    assert ep_bursts(ParallelPlan(dp=2, ep=2, recompute="full")) == 6
    q = predict(TINY, TC, ParallelPlan(pp=2, micro_batches=4), 2, _machine(4))
    assert q.syncs == 2 * (4 + 1) / 2 + 2
    groups = [(2, [("all_reduce", 100.0, 1), ("all_reduce", 50.0, 2)]),
              (4, [("reduce_scatter", 10.0, 1)])]
    assert S.path_syncs(ParallelPlan(dp=2), groups, True, 2) == 3 / 2 + 2
    assert S.path_syncs(ParallelPlan(dp=2), groups, False, 8) == 1 + 2 + 3 / 2 + 14
    assert S.sync_units("all_to_all", 4, 2) == 2 and S.sync_units("p2p", 2) == 0.5


def test_bounds_pick_the_larger_and_say_what_syncs_add():
    """Free cores: a wake-up per sync on the critical path. Oversubscribed: the idle
    time per sync on the work bound, and no wake-up on the path (another rank runs while
    one sleeps; its wait for a core is the stretch its compute already has)."""
    m = _machine(2, wake=1e-3, busy=4e-3)
    assert S.bounds(0.1, 0.05, 10, 1.0, m) == pytest.approx((0.11, 0.05, 0.01))
    assert S.bounds(0.1, 0.09, 10, 2.0, m) == pytest.approx((0.1, 0.13, 0.04))
    assert S.bounds(0.2, 0.09, 10, 2.0, m) == pytest.approx((0.2, 0.13, 0.0))
    assert S.oversubscription(0.25) == 4.0 and S.oversubscription(1.0) == 1.0


def test_sched_constants_travel_from_the_calibration_file(tmp_path):
    prof = tmp_path / "hardware.toml"
    prof.write_text('name = "box"\npeak_flops = 4e9\nhbm_bytes = 8e9\nhbm_bw = 1e10\n'
                    'gpus_per_node = 2\nintra_bw = 1e9\nintra_alpha = 1e-4\n'
                    'inter_bw = 1e9\ninter_alpha = 1e-4\n')
    m = load_machine(prof)
    assert m.wake_s == 0.0 and not m.sched
    p = predict(TINY, TC, ParallelPlan(dp=2), 2, m)
    assert any("no scheduler calibration" in n for n in p.notes)
    stale = save_sched({"wake_s": 3e-4, "busy_sync_s": 2e-3, "cores": 2}, prof)
    assert not load_machine(prof).sched  # timed after bare matmuls: calibrate again
    path = save_sched({"wake_s": 3e-4, "busy_sync_s": 2e-3, "sync_cpu_s": 1e-4,
                       "segment_s": 5e-3, "cores": 2}, prof)
    assert path == stale and json.loads(path.read_text())["busy_sync_s"] == 2e-3
    m = load_machine(prof)
    assert (m.wake_s, m.busy_sync_s, m.sync_cpu_s) == (3e-4, 2e-3, 1e-4)
    assert str(path) in m.sched
    p = predict(TINY, TC, ParallelPlan(dp=2), 2, m)
    assert not any("no scheduler calibration" in n for n in p.notes)
    assert dataclasses.asdict(m.replace(others=((1,),)))["wake_s"] == 3e-4


def test_cores_computing_at_once_compute_slower():
    """core_speed 0.5: dp2 on 2 cores computes and works at half speed; one rank alone
    on the box does not; with 3 cores and 2 busy ranks the slowdown is half-way."""
    m = dataclasses.replace(_machine(2), core_speed=0.5)
    free = predict(TINY, TC, ParallelPlan(dp=2), 2, _machine(2))
    p = predict(TINY, TC, ParallelPlan(dp=2), 2, m)
    assert p.compute_s == pytest.approx(2 * free.compute_s)
    one = predict(TINY, TC, ParallelPlan(), 1, m)
    assert one.compute_s == predict(TINY, TC, ParallelPlan(), 1, _machine(2)).compute_s
    assert S.contention(m, 2) == 2.0 and S.contention(m, 1) == 1.0
    m3 = dataclasses.replace(_machine(3), core_speed=0.5)
    assert S.contention(m3, 2) == pytest.approx(1 / 0.75)
    cpu_free = free.session_work_s
    assert p.session_work_s > 1.9 * cpu_free - 1e-3  # the compute part doubles
