"""`paratrain check-model` end to end on a 2-plan mini grid (real gloo, tiny model): the
JSON has one record per plan with predicted and measured step times and exact bytes. The
accuracy itself is a benchmark's business (benchmarks/check_model.py), not a test's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import tiny_flags
from paratrain.cli import main
from paratrain.config import ModelConfig
from paratrain.run.check_model import format_table

TINY_FLAGS = [*tiny_flags(), "--global-batch", "8", "--steps", "3"]


@pytest.fixture
def profile(tmp_path):
    path = tmp_path / "hardware.toml"
    path.write_text('name = "test-box"\npeak_flops = 4e9\nhbm_bytes = 8e9\nhbm_bw = 1e10\n'
                    'gpus_per_node = 2\nintra_bw = 1e9\nintra_alpha = 1e-4\n'
                    'inter_bw = 1e9\ninter_alpha = 1e-4\n')
    return str(path)


@pytest.mark.slow
def test_mini_grid_json(profile, text_file, capsys):
    code = main(["check-model", "--plans", "mini", "--no-fit", "--profile", profile,
                 "--data", text_file, "--json", "--launches", "2", *TINY_FLAGS])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    recs = out["records"]
    assert [r["plan"] for r in recs] == ["dp2", "dp2 zero1"]
    for r in recs:
        # two launches each, the record the one with the lower error
        assert len(r["launches"]) == 2
        assert r["error"] == min(x["error"] for x in r["launches"])
        assert r["nproc"] == 2
        assert r["predicted_s"] > 0 and r["measured_s"] > 0
        assert r["error"] == pytest.approx(r["predicted_s"] / r["measured_s"] - 1)
        assert r["wire_exact"] and r["states_exact"]
        assert 0 < r["share"] <= 1
    errs = [abs(r["error"]) for r in recs]
    assert out["median_abs_error"] == pytest.approx(sum(errs) / 2)
    text = format_table(out)
    assert "median absolute error of step time" in text
    assert "wire bytes exact 2/2; model states exact on every rank 2/2" in text


def test_a_plans_record_is_its_median_launch(capsys):
    """Three launches of one plan (one of them where the scheduler kept the ranks waiting:
    28% slower): the record is the launch with the median error, all three listed; bytes
    and states are exact only if they were in every launch."""
    from paratrain.run.check_model import _median_launch

    def launch(measured: float, exact: bool = True) -> dict:
        return {"measured_s": measured, "predicted_s": 0.12, "error": 0.12 / measured - 1,
                "pace": 1.0, "core_speed": 0.95, "other_threads": 0.0, "cpu_share_rank0": 0.9,
                "wire_exact": exact, "states_exact": True}

    rec = _median_launch([launch(0.116), launch(0.148, exact=False), launch(0.124)])
    assert rec["measured_s"] == 0.124 and rec["error"] == pytest.approx(0.12 / 0.124 - 1)
    assert [x["measured_s"] for x in rec["launches"]] == [0.116, 0.148, 0.124]
    assert not rec["wire_exact"] and rec["states_exact"]
    assert _median_launch([launch(0.116), launch(0.148)])["measured_s"] == 0.148  # lower error
    assert main(["check-model", "--plans", "dp2", "--launches", "0"]) == 2
    assert "--launches 0: need at least 1" in capsys.readouterr().err


def test_refusals(profile, capsys, tmp_path):
    assert main(["check-model", "--plans", "dp3", "--profile", profile]) == 2
    assert "unknown plan" in capsys.readouterr().err
    assert main(["check-model", "--plans", "dp2", "--profile", str(tmp_path / "none.toml")]) == 2
    assert "paratrain bench calibrate" in capsys.readouterr().err


def test_fit_on_a_busy_machine_is_refused(profile, capsys, monkeypatch):
    """Injected fit timings that never settle (1 s, 3 s, 1 s, ...: a busy machine misses
    by multiples): one line, exit 2, naming the command to run again; nothing is
    trained."""
    import itertools

    from paratrain.run import cpu_fit as cm

    times = itertools.cycle([1.0, 3.0])
    monkeypatch.setattr(cm, "_thread_peak", lambda: 1e10)
    monkeypatch.setattr(cm, "_one_process", lambda *a: (next(times), 1e-3))
    assert main(["check-model", "--plans", "dp2", "--profile", profile]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the machine was too busy to calibrate: the fit run's CPU")
    assert "`paratrain check-model` again" in err and "\n" not in err


def test_every_grid_plan_passes_the_runtime_checks():
    """CP (ring, all-to-all) and EP join the grid; the EP plan trains a small MoE."""
    from paratrain.run.check_model import GRID, GRID_BATCH, GRID_MODEL, plan_model

    assert {"cp2 ring", "cp2 all-to-all", "dp2 x ep2"} <= set(GRID)
    for name, plan in GRID.items():
        model = plan_model(plan, GRID_MODEL)
        assert bool(model.experts) == (plan.ep > 1), name
        plan.check_run(model, plan.world_size, GRID_BATCH)
    assert {p.cp_algorithm for p in GRID.values() if p.cp > 1} == {"ring", "all-to-all"}


def test_collective_costs_are_solved_from_a_line_of_sizes_and_two_group_sizes():
    """Per-call CPU made of a per-call, a per-ring-step and a per-byte part (and wall of a
    per-step latency and a bandwidth) is taken apart exactly from the measurements the
    fit makes: a line through the 2-rank sizes, the 4-rank small call; the 2-rank calls
    keep the line's CPU at either clamp (4 ranks costing less than 2: all per call; far
    more: all per step), and a noisy size moves the line less than a two-size
    difference."""
    from paratrain.cost import collectives as coll
    from paratrain.run.check_model import COLL_SMALL, solve_collective_costs
    from paratrain.run.coll_fit import COLL_SIZES

    call, step, byte, alpha, bw = 300e-6, 250e-6, 0.6e-9, 700e-6, 1.3e9

    def cpu(p, n):
        return call + coll.steps("all_reduce", "ring", p) * step + \
            coll.wire_bytes("all_reduce", "ring", p, n) * byte

    def wall(n):
        return 2 * alpha + coll.wire_bytes("all_reduce", "ring", 2, n) / bw

    assert len(COLL_SIZES) >= 3 and COLL_SIZES[0] == COLL_SMALL
    c2 = [(n, cpu(2, n)) for n in COLL_SIZES]
    w2 = [(n, wall(n)) for n in COLL_SIZES]
    got = solve_collective_costs(c2, cpu(4, COLL_SMALL), w2)
    assert got == pytest.approx((call, step, byte, alpha, bw), rel=1e-9)
    small = call + 2 * step  # the 2-rank call without its bytes
    flat = solve_collective_costs(c2, small * 0.9, w2)
    assert flat[:3] == pytest.approx((small, 0.0, byte), rel=1e-9)
    steep = solve_collective_costs(c2, small * 10, w2)
    assert steep[:3] == pytest.approx((0.0, small / 2, byte), rel=1e-9)
    noisy = [(n, c * (1.3 if n == 1 << 20 else 1.0)) for n, c in c2]  # 1 MiB 30% high
    two = (noisy[2][1] - noisy[0][1]) / (COLL_SIZES[2] - COLL_SIZES[0])
    per_byte = solve_collective_costs(noisy, cpu(4, COLL_SMALL), w2)[2]
    assert abs(per_byte - byte) < abs(two - byte) / 2


def test_the_collective_fit_is_judged_on_a_large_calls_cpu():
    """Rounds whose per-byte figure swings while the 1 MiB call's CPU holds are stable:
    the fit is judged on what a large call costs (large_call_cpu: the line's 2-rank 1 MiB
    call), not on the slope."""
    from paratrain.bench.calibrate import Stability, until_stable
    from paratrain.run.check_model import COLL_LARGE, solve_collective_costs
    from paratrain.run.coll_fit import large_call_cpu

    def round_(slope: float):  # lines through (1 MiB, 1.6 ms) of different slopes
        c2 = [(n, 1.6e-3 + (n - COLL_LARGE) * slope) for n in (4096, COLL_LARGE, 1 << 22)]
        return solve_collective_costs(c2, 2.2e-3, [(4096, 1.5e-3), (COLL_LARGE, 2e-3)])

    rounds = iter([round_(s) for s in (2e-10, 3e-10, 1.5e-10)])
    got = until_stable(lambda: next(rounds), "t", Stability(k=3, cv=0.3, max_repeats=3),
                       judged=lambda r: [large_call_cpu(r)])
    assert large_call_cpu(got) == pytest.approx(1.6e-3, rel=1e-9)
    assert COLL_LARGE == 1 << 20


def test_route_cost_is_what_the_moe_run_took_beyond_its_price(profile):
    """The MoE run priced with a known cost per routed assignment gives that cost back;
    a run no dearer than its FLOPs gives 0."""
    from paratrain.config import TrainConfig
    from paratrain.plan import ParallelPlan
    from paratrain.predict import load_machine, predict
    from paratrain.run.check_model import GRID_MODEL, plan_model, route_cost

    machine = load_machine(profile).replace(pass_s=1e-3, step_s=2e-3)
    moe = plan_model(ParallelPlan(dp=2, ep=2), GRID_MODEL)
    tcfg = TrainConfig(global_batch=16)
    r0 = 3e-6
    t = predict(moe, tcfg, ParallelPlan(), 1, machine.replace(route_s=r0)).cpu_rank0_s
    assert route_cost((moe, tcfg, t), machine) == pytest.approx(r0, rel=1e-9)
    bare = predict(moe, tcfg, ParallelPlan(), 1, machine).cpu_rank0_s
    assert route_cost((moe, tcfg, 0.9 * bare), machine) == 0.0
    dense = predict(GRID_MODEL, tcfg, ParallelPlan(), 1, machine.replace(route_s=r0))
    assert dense.cpu_rank0_s == predict(GRID_MODEL, tcfg, ParallelPlan(), 1,
                                        machine).cpu_rank0_s  # no MoE block, no routing


def test_the_fit_saves_and_loads_the_collectives_it_measured(profile):
    """The fit's collective latency and bandwidth replace the profile's for the step (its
    calls as a step pays them), with the CPU per call, the cores' shared speed and the
    routing cost; the profile itself is left as calibrated."""
    from paratrain.predict import load_machine, save_fit

    base = load_machine(profile)
    fitted = base.replace(hw=base.hw.replace(intra_alpha=7e-4, intra_bw=1.5e9), eta=0.5,
                          thread_peak=1e11, pass_s=1e-3, step_s=2e-3, coll_call_cpu_s=3e-4,
                          coll_step_cpu_s=2e-4, coll_byte_cpu_s=5e-10, core_speed=0.8,
                          route_s=3e-6, ring_hop_s=1e-4, ring_byte_s=7e-10, ring_hop_cpu_s=2e-4,
                          ring_byte_cpu_s=9e-10, scalar_cpu_s=4e-4, fitted=True)
    save_fit(fitted, profile, "test")
    got = load_machine(profile)
    assert got.scalar_cpu_s == 4e-4
    assert (got.ring_hop_s, got.ring_byte_s, got.ring_hop_cpu_s, got.ring_byte_cpu_s) == (
        1e-4, 7e-10, 2e-4, 9e-10)
    assert (got.hw.intra_alpha, got.hw.intra_bw) == (7e-4, 1.5e9)
    assert (got.coll_call_cpu_s, got.coll_step_cpu_s, got.coll_byte_cpu_s) == (3e-4, 2e-4, 5e-10)
    assert (got.core_speed, got.route_s, got.fitted) == (0.8, 3e-6, True)
    assert "intra_alpha = 1e-4" in Path(profile).read_text()


def test_ring_costs_take_the_ring_calls_cpu_beyond_its_flops_apart():
    """A cp 2 ring call's CPU beyond half the plain core's on the whole sequence, at two
    batches: a line per hop and per byte, for the calling thread (in line with the
    compute) and for gloo's thread (the rest of the process), exactly; each coefficient
    stays >= 0 (a negative intercept goes all per byte, a negative slope all per hop)."""
    from paratrain.run.ring_fit import HOPS, ring_costs

    assert HOPS == 4  # a cp 2 rank, no recompute: 1 K/V hop forward, 1 back, 2 gradients

    def call(sent, own_hop, own_byte, gloo_hop, gloo_byte, plain):
        own = HOPS * own_hop + sent * own_byte
        return [plain / 2 + own + HOPS * gloo_hop + sent * gloo_byte, plain / 2 + own,
                plain, sent]

    k = (2e-4, 5e-10, 3e-4, 7e-10)
    times = call(4e6, *k, 10e-3) + call(2e6, *k, 5e-3)
    assert ring_costs(times) == pytest.approx(k, rel=1e-9)
    steep = call(4e6, 0, 1e-9, 0, 1e-9, 10e-3) + call(2e6, 0, 1e-9, 0, 1e-9, 5e-3)
    steep[5] -= 1e-3  # the smaller call's own part below the line through the origin
    own_hop, own_byte = ring_costs(steep)[:2]
    assert own_hop == 0.0 and own_byte == pytest.approx((4e-3 + 1e-3) / 6e6, rel=1e-9)
    flat = call(4e6, 1e-3, 0, 1e-3, 0, 10e-3) + call(2e6, 2e-3, 0, 1e-3, 0, 5e-3)
    assert ring_costs(flat)[:2] == pytest.approx((1.5e-3, 0.0), rel=1e-9)
    assert ring_costs(call(4e6, *k, 10e-3))[:2] == (0.0, pytest.approx(
        (HOPS * 2e-4 + 4e6 * 5e-10) / 4e6, rel=1e-9))  # one batch: all per byte


def test_the_fitted_ring_cost_prices_cp_ring_by_hops_and_bytes(profile):
    """With the ring's CPU fitted, a cp2 ring rank's own part joins its fixed cost per
    micro-batch (its critical path and its CPU) and gloo's part its CPU, in place of the
    hops priced as point-to-point sends; all-to-all CP is untouched."""
    from paratrain.config import TrainConfig
    from paratrain.cost.cp_bytes import ring_hops
    from paratrain.plan import ParallelPlan
    from paratrain.predict import load_machine, predict
    from paratrain.predict.axes import cp_calls
    from paratrain.predict.calls import comm_cpu
    from paratrain.run.check_model import GRID_MODEL

    base = load_machine(profile).replace(pass_s=1e-3, step_s=2e-3, coll_byte_cpu_s=1e-9,
                                         coll_step_cpu_s=2e-4, core_speed=1.0, others=())
    tcfg = TrainConfig(global_batch=16)
    ring, a2a = ParallelPlan(cp=2, micro_batches=2), ParallelPlan(cp=2, cp_algorithm="all-to-all")
    before = predict(GRID_MODEL, tcfg, ring, 2, base)
    fitted = base.replace(ring_hop_s=1e-4, ring_byte_s=1e-9, ring_hop_cpu_s=3e-4,
                          ring_byte_cpu_s=2e-9)
    after = predict(GRID_MODEL, tcfg, ring, 2, fitted)
    wire, L = before.cp_wire_bytes, GRID_MODEL.n_layers
    hops = 2 * L * ring_hops(ring)
    assert wire == after.cp_wire_bytes > 0 and hops == 2 * L * 4
    sends = comm_cpu(base, 2, cp_calls(ring, wire, L))
    assert after.cpu_rank0_s - before.cpu_rank0_s == pytest.approx(
        hops * 4e-4 + wire * 3e-9 - sends, rel=1e-9)
    assert after.overhead_s - before.overhead_s == pytest.approx(hops * 1e-4 + wire * 1e-9,
                                                                 rel=1e-9)
    assert predict(GRID_MODEL, tcfg, a2a, 2, fitted) == predict(GRID_MODEL, tcfg, a2a, 2, base)


def test_the_steps_scalar_all_reduces_cost_the_measured_call_whatever_the_world(profile):
    """With the 8-byte all-reduce's CPU fitted, the loss and gradient norm cost two such
    calls after compute on any world (gloo leaves most of the ring's pieces empty), not
    the ring's 2(p - 1) steps each; unfitted, the ring's price stands."""
    from paratrain.config import TrainConfig
    from paratrain.plan import ParallelPlan
    from paratrain.predict import load_machine, predict
    from paratrain.predict.calls import comm_cpu
    from paratrain.run.check_model import GRID_MODEL

    base = load_machine(profile).replace(coll_call_cpu_s=3e-4, coll_step_cpu_s=2e-4,
                                         sync_cpu_s=1e-4)
    tcfg = TrainConfig(global_batch=16)
    for dp in (2, 8):
        plan = ParallelPlan(dp=dp)
        before = predict(GRID_MODEL, tcfg, plan, dp, base).cpu_rank0_s
        after = predict(GRID_MODEL, tcfg, plan, dp, base.replace(scalar_cpu_s=5e-4)).cpu_rank0_s
        ring = comm_cpu(base, dp, [("all_reduce", 8.0, 2)])  # by steps: 2 + 28 at dp 8
        assert ring > 2 * (3e-4 + 1e-4 + 2 * (dp - 1) * 2e-4)
        assert after - before == pytest.approx(2 * (5e-4 + 1e-4) - ring, rel=1e-9)


def test_collective_cpu_pays_a_hand_off_per_collective_call_not_per_send(profile):
    from paratrain.predict import load_machine
    from paratrain.predict.calls import comm_cpu

    m = load_machine(profile).replace(coll_call_cpu_s=3e-4, coll_step_cpu_s=2e-4,
                                      coll_byte_cpu_s=1e-9)
    assert comm_cpu(m, 4, [("all_reduce", 4000.0, 2)]) == pytest.approx(
        2 * (3e-4 + 6 * 2e-4 + 6000 * 1e-9))
    assert comm_cpu(m, 4, [("all_to_all", 4000.0, 1)]) == pytest.approx(
        3e-4 + 3 * 2e-4 + 3000 * 1e-9)
    assert comm_cpu(m, 2, [("p2p", 1000.0, 3)]) == pytest.approx(3 * (2e-4 + 1000 * 1e-9))


def test_each_plan_is_priced_at_the_pace_of_the_fit_runs_around_it(profile):
    """A fit run that took 25% longer than its price ran at pace 0.8; a machine at pace
    p does every CPU cost of a one-process step 1/p as long (the wall-only latency and
    bandwidth have no part in a one-process step)."""
    from paratrain.config import TrainConfig
    from paratrain.plan import ParallelPlan
    from paratrain.predict import load_machine, predict
    from paratrain.run.check_model import GRID_MODEL, relative_paces, run_paces

    machine = load_machine(profile).replace(pass_s=1e-3, step_s=2e-3, route_s=1e-6,
                                            coll_call_cpu_s=1e-4, coll_byte_cpu_s=1e-9)
    tcfg = TrainConfig(global_batch=16)

    def price(gb: int, m: int, mach=machine) -> float:
        return predict(GRID_MODEL, TrainConfig(global_batch=gb), ParallelPlan(micro_batches=m),
                       1, mach).cpu_rank0_s

    runs = [(16, 1, price(16, 1)), (4, 1, 1.25 * price(4, 1)), (16, 4, price(16, 4) / 1.1)]
    assert run_paces(GRID_MODEL, tcfg, runs, machine) == pytest.approx([1.0, 0.8, 1.1])
    # the drift alone: each pace over the median of its kind's (the fit's misfit per kind)
    kinds = [(16, 1, 0.0), (4, 1, 0.0), (16, 1, 0.0), (4, 1, 0.0), (16, 1, 0.0)]
    assert relative_paces(kinds, [1.0, 1.05, 0.98, 1.03, 0.99]) == pytest.approx(
        [1 / 0.99, 1.05 / 1.04, 0.98 / 0.99, 1.03 / 1.04, 1.0])
    assert price(16, 4, machine.at_pace(0.8)) == pytest.approx(price(16, 4) / 0.8, rel=1e-12)
    slow = machine.at_pace(0.5)
    assert (slow.hw, slow.wake_s, slow.busy_sync_s) == (machine.hw, machine.wake_s,
                                                        machine.busy_sync_s)
    assert slow.route_s == 2 * machine.route_s and slow.coll_byte_cpu_s == 2e-9
    assert machine.replace(scalar_cpu_s=3e-4).at_pace(0.5).scalar_cpu_s == 6e-4
    ringy = machine.replace(ring_hop_s=1e-4, ring_byte_s=1e-9, ring_hop_cpu_s=2e-4,
                            ring_byte_cpu_s=3e-9).at_pace(0.5)
    assert (ringy.ring_hop_s, ringy.ring_byte_s, ringy.ring_hop_cpu_s,
            ringy.ring_byte_cpu_s) == (2e-4, 2e-9, 4e-4, 6e-9)


@pytest.mark.slow
def test_the_fit_runs_bracket_every_plan_and_set_its_pace(profile, text_file, capsys,
                                                         monkeypatch):
    """One plan trained for real between two injected fit runs that took twice what the
    first four (and the fit's linear cost) say: the plan is priced at the pace of those
    two, slower than the fit's average, and at the core speed with both cores busy
    measured beside them; the record keeps both predictions."""
    from paratrain.config import TrainConfig
    from paratrain.predict import load_machine
    from paratrain.run import cpu_fit as cf
    from paratrain.run import ring_fit

    slow = {"on": False}

    def one_process(mcfg, tcfg, plan):  # a linear cost: per sequence, per pass, per step
        t = 1e-3 * tcfg.global_batch + 2e-4 * plan.micro_batches + 3e-3
        k = (2.0 if mcfg.experts else 1.0) * (2.0 if slow["on"] else 1.0)
        return k * t, k * 3e-3  # and its per-step part, measured outside the passes

    beside = iter([0.8, 0.7])  # a core's speed beside the plan's fit runs (in the pool)

    def core_speed(*a):
        slow["on"] = True  # the last measurement before the grid: the plans' fit runs
        return next(beside) if len(a) == 7 else 1.0

    monkeypatch.setattr(cf, "_thread_peak", lambda: 1e10)
    monkeypatch.setattr(cf, "_one_process", one_process)
    monkeypatch.setattr(cf, "busy_core_speed", core_speed)
    # the ring core's CPU at two batches (ring_fit.ring_core_times: call, its thread, the
    # plain core, bytes sent), injected like the rest: measured, it is refused on a busy box
    monkeypatch.setattr(ring_fit, "ring_core_times",
                        lambda *a: [12e-3, 9e-3, 10e-3, 4e6, 6e-3, 4.5e-3, 5e-3, 2e6])
    monkeypatch.setattr(cf, "collective_costs", lambda: (1e-4, 1e-5, 1e-9, 1e-4, 1e9))
    monkeypatch.setattr(cf, "scalar_cost", lambda: 2e-4)
    assert main(["check-model", "--plans", "dp2", "--profile", profile, "--data", text_file,
                 "--json", "--launches", "1", *TINY_FLAGS]) == 0
    out = json.loads(capsys.readouterr().out)
    (rec,) = out["records"]
    mcfg = ModelConfig(**out["model"])
    tcfg = TrainConfig(global_batch=8, steps=3)  # the fit runs (batch B, then B/4: fit_runs)
    def t(gb: int, m: int) -> float:
        return 1e-3 * gb + 2e-4 * m + 3e-3

    # the fit's runs: one of each kind before the grid, then the plan's two at half speed
    runs = [(gb, m, t(gb, m)) for gb, m in cf.fit_runs(8)]
    runs += [(8, 1, 2 * t(8, 1)), (2, 1, 2 * t(2, 1))]
    paces = cf.relative_paces(runs, cf.run_paces(mcfg, tcfg, runs, load_machine(profile)))
    want = sum(paces[-2:]) / 2
    assert rec["pace"] == pytest.approx(want, rel=1e-9) and rec["pace"] < 1
    assert rec["predicted_s"] > rec["predicted_at_fit_pace_s"]
    assert rec["error_at_fit_pace"] == pytest.approx(
        rec["predicted_at_fit_pace_s"] / rec["measured_s"] - 1)
    assert "at the fit's average pace" in format_table(out)
    # a core's speed with both cores busy: the two beside the plan's, the fit's the median
    assert rec["core_speed"] == pytest.approx(0.75) and out["machine"]["core_speed"] == 0.8


def test_the_busiest_expert_rank_is_taken_layer_by_layer():
    """Two data ranks of one ep 2 group, two MoE layers, four experts: layer 0 sends 30
    rows to rank 0's experts and 10 to rank 1's, layer 1 the reverse. Summed over the
    layers the ranks are even (1.0); each layer's combine waits for a rank with 1.5x the
    mean: the record keeps 1.5, and the prediction prices the median of the timed steps."""
    from paratrain.config import ModelConfig
    from paratrain.plan import ParallelPlan
    from paratrain.predict.axes import expert_load_from_routing
    from paratrain.predict.report import routing_load
    from paratrain.run.moe_stats import layer_load, moe_record

    by_layer = [[[10, 5, 3, 2], [3, 2, 10, 5]]] * 2  # [d][l][e]
    assert layer_load(by_layer, 2) == pytest.approx(1.5)
    summed = [[sum(x) for x in zip(*by_layer[d], strict=True)] for d in range(2)]
    plan = ParallelPlan(dp=2, ep=2)
    assert expert_load_from_routing(plan, 4, summed) == pytest.approx(1.0)
    mcfg = ModelConfig(n_layers=2, d_model=16, n_heads=2, d_ff=32, context=8, experts=4,
                       top_k=2)
    flat_layers = [v for d in range(2) for layer in by_layer[d] for v in layer]
    stats = [0.0, 0.0, 0.0, *map(sum, zip(*summed, strict=True)),
             *[v for row in summed for v in row], *flat_layers]
    rec = moe_record(stats, mcfg, 4, plan)
    assert rec["moe_load_by_rank"] == summed and rec["moe_layer_load"] == pytest.approx(1.5)
    assert "moe_layer_load" not in moe_record(stats[:3 + 4 + 8], mcfg, 4)  # no plan: none
    steps = [{**rec, "moe_layer_load": x} for x in (1.1, 1.5, 1.3, 1.9)]
    assert routing_load({"moe_steps": steps}, plan, mcfg) == 1.5  # median of steps 2-4
    old = [{k: v for k, v in s.items() if k != "moe_layer_load"} for s in steps]
    assert routing_load({"moe_steps": old}, plan, mcfg) == pytest.approx(1.0)
