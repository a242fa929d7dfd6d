"""The busiest expert-parallel rank's load: counted from a run's routing by hand, and
priced on the critical path only (the other ranks compute that much less, so the CPU
work does not grow)."""

from __future__ import annotations

import pytest

from conftest import TINY
from paratrain.config import TrainConfig
from paratrain.cost.hardware import Hardware
from paratrain.plan import ParallelPlan
from paratrain.predict import MachineModel, predict
from paratrain.predict.axes import expert_load, expert_load_from_routing, expert_wait_flops
from paratrain.predict.report import routing_load

MOE = TINY.replace(experts=4, top_k=2, moe_ffn=32)
TC = TrainConfig(global_batch=8)


def _machine(cores: int) -> MachineModel:
    hw = Hardware("test-box", peak_flops=4e9, hbm_bytes=8e9, hbm_bw=1e10, gpus_per_node=cores,
                  intra_bw=1e9, intra_alpha=1e-4, inter_bw=1e9, inter_alpha=1e-4, eta=1.0)
    return MachineModel(hw, eta=0.5, thread_peak=1e9, pass_s=1e-3, step_s=2e-3,
                        sched="test", fitted=True)


def test_load_from_routing_by_hand():
    """ep 2, 4 experts: ep rank 0 holds experts 0-1, rank 1 experts 2-3. Data ranks 0 and
    1 route 10 + 20 and 10 + 10 rows to rank 0's experts, 5 + 5 twice to rank 1's: 50
    against 20, mean 35. With dp 4 a second group (data ranks 2, 3) balanced at 20 / 20:
    the busiest of the four ranks is still 50, the mean (50 + 20 + 20 + 20) / 4."""
    one = [[10, 20, 5, 5], [10, 10, 5, 5]]
    assert expert_load_from_routing(ParallelPlan(dp=2, ep=2), 4, one) == pytest.approx(50 / 35)
    two = one + [[5, 5, 10, 10], [5, 5, 0, 0]]
    assert expert_load_from_routing(ParallelPlan(dp=4, ep=2), 4, two) == pytest.approx(
        50 / 27.5)
    assert expert_load_from_routing(ParallelPlan(dp=2, ep=2), 4, [[0] * 4, [0] * 4]) == 1.0


def test_routing_load_reads_the_first_step_where_the_groups_routed_it():
    s = {"moe_steps": [{"moe_load_by_rank": [[3, 1, 1, 1], [1, 1, 1, 1]]},
                       {"moe_load_by_rank": [[1, 1, 1, 1], [1, 1, 1, 1]]}]}
    assert routing_load(s, ParallelPlan(dp=2, ep=2), MOE) == pytest.approx(6 / 5)
    assert routing_load(s, ParallelPlan(dp=2), MOE) is None  # no ep
    assert routing_load(s, ParallelPlan(dp=2, ep=2, cp=2), MOE) is None  # a cp shard each
    assert routing_load({}, ParallelPlan(dp=2, ep=2), MOE) is None


def test_the_busiest_rank_is_waited_for_but_adds_no_work():
    """A skewed router (1.5 x the mean on one rank) lengthens the critical path by the
    extra experts' FLOPs and leaves every rank's CPU as the mean load prices it; the
    default is a balanced router's expected extreme."""
    plan, m = ParallelPlan(dp=2, ep=2), _machine(4)
    base = predict(MOE, TC, plan, 2, m)
    skew = predict(MOE, TC, plan, 2, m, load=1.5)
    tokens = TC.global_batch / 2 * MOE.context
    assert base.expert_load == pytest.approx(expert_load(MOE, plan, tokens))
    assert base.expert_load > 1.0
    assert skew.expert_load == 1.5
    extra = (MOE.moe_layers * (expert_wait_flops(MOE, plan, tokens, 1.5)
                               - expert_wait_flops(MOE, plan, tokens, base.expert_load))
             / (m.eta * m.thread_peak))
    assert skew.critical_path_s - base.critical_path_s == pytest.approx(extra)
    assert skew.cpu_rank0_s == pytest.approx(base.cpu_rank0_s)
    assert skew.session_work_s == pytest.approx(base.session_work_s)
    assert predict(MOE, TC, ParallelPlan(dp=2), 2, m, load=1.5).expert_load == 1.0


def test_a_capacity_caps_the_priced_load():
    """A run that drops tokens beyond capacity C never gives an ep rank more than C x the
    mean rows: the balanced router's spread (above 1 here) is cut at C, the same formula
    the systems model prices published runs with (systems.moe_step.expert_load)."""
    plan, tokens = ParallelPlan(dp=2, ep=2), TC.global_batch / 2 * MOE.context
    spread = expert_load(MOE, plan, tokens)
    assert spread > 1.0
    assert expert_load(MOE.replace(capacity_factor=1.0), plan, tokens) == 1.0
    assert expert_load(MOE.replace(capacity_factor=4.0), plan, tokens) == spread
    assert predict(MOE.replace(capacity_factor=1.0), TC, plan, 2,
                   _machine(4)).expert_load == 1.0
