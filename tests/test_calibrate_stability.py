"""A calibration on a busy machine is detected (paratrain.bench.calibrate): each
measurement is repeated until its last k rounds agree, or refused with one line saying the
machine was too busy and what to do. Every timing here is injected (a scripted
measurement, a fake spawn); no real load, no wall clock."""

from __future__ import annotations

import itertools

import pytest

from paratrain.bench import calibrate as cal
from paratrain.bench.calibrate import BusyMachine, Stability, sync_costs, until_stable
from paratrain.cli import main


def _scripted(values):
    it = iter(values)
    calls = []

    def measure():
        calls.append(1)
        return next(it)

    return measure, calls


def test_repeats_until_the_last_k_rounds_agree():
    """Two disturbed rounds, then three within 15%: the median of those three."""
    measure, calls = _scripted([[1.0, 5.0], [3.0, 5.0], [1.0, 5.0], [1.05, 5.1], [0.98, 4.9],
                                [9.0, 9.0]])
    got = until_stable(measure, "test timing", Stability(k=3, cv=0.15, max_repeats=10))
    assert got == [1.0, 5.0] and len(calls) == 5


def test_a_machine_that_never_settles_is_refused_with_one_line():
    """Alternating 1 s and 2 s rounds (33% variation) never pass a 15% threshold."""
    measure, calls = _scripted(itertools.cycle([[1.0], [2.0]]))
    with pytest.raises(BusyMachine) as e:
        until_stable(measure, "the matmul", Stability(k=3, cv=0.15, max_repeats=7))
    msg = str(e.value)
    assert len(calls) == 7 and "\n" not in msg
    assert msg.startswith("the machine was too busy to calibrate: the matmul still varied by")
    assert "paratrain bench calibrate" in msg and "again" in msg
    assert isinstance(e.value, ValueError)  # the CLI prints it as one `error:` line


def test_the_ranks_decide_together():
    """A rank whose own rounds are stable keeps measuring while a peer's are not."""
    votes = iter([False, False, True])
    measure, calls = _scripted(itertools.repeat([1.0]))
    got = until_stable(measure, "t", Stability(k=1, cv=0.1, max_repeats=5),
                       agree=lambda ok: ok and next(votes))
    assert got == [1.0] and len(calls) == 3


def _fake_spawn(results: dict[int, list], seen: list | None = None):
    """spawn(fn, world, ...) -> the scripted per-rank results for that world size; the
    segment's passes each world was asked for go to ``seen``."""
    def spawn(fn, world, iters, rule, passes, timeout_s=0):
        assert fn is cal.sync_worker
        if seen is not None:
            seen.append((world, passes, rule.k))
            assert rule.max_repeats >= rule.k  # room for the window at all
        return results[world]
    return spawn


def _round(comp, synced, alone, c_comp, c_synced, c_alone, wake=None, cpu=None):
    """One rank's medians as sync_worker returns them: three walls, three CPU times, the
    median excesses (by default the medians' own differences)."""
    return [comp, synced, alone, c_comp, c_synced, c_alone,
            synced - comp - alone if wake is None else wake,
            c_synced - c_comp - c_alone if cpu is None else cpu]


def test_sync_costs_from_injected_timings():
    """2 cores: free (2 ranks) compute 5 ms, compute + sync 7.5 ms, sync alone 1 ms: a
    wake-up of 1.5 ms (the rounds' median excess, not the medians' difference), and
    0.4 ms of CPU beyond the sync's own; 4 ranks on 2 cores: compute + sync 13 ms of
    wall, 6 ms of CPU per rank: the cores sat idle 13 - 4 x 6 / 2 = 1 ms at each
    oversubscribed sync. One pass of the segment takes 1.25
    ms alone, so 4 passes make its 5 ms; 4 passes take 4 ms alone: core speed 0.8. A
    segment alone that never settles is refused."""
    free = [_round(5e-3, 7.5e-3, 1e-3, 5e-3, 6.6e-3, 1.2e-3, wake=1.5e-3, cpu=4e-4)] * 2
    busy = [_round(10e-3, 13e-3, 2e-3, 5e-3, 6e-3, 1.2e-3)] * 4
    seen = []
    alone = {1: 1.25e-3, 4: 4e-3}
    got = sync_costs(2, spawn_fn=_fake_spawn({2: free, 4: busy}, seen),
                     alone_fn=lambda passes: alone[passes])
    assert got["wake_s"] == pytest.approx(1.5e-3)
    assert got["sync_cpu_s"] == pytest.approx(4e-4)
    assert got["busy_sync_s"] == pytest.approx(1e-3)
    assert got["core_speed"] == pytest.approx(0.8)  # 4 ms alone, 5 ms beside the other
    assert got["segment_s"] == pytest.approx(4e-3)
    # 4 passes; the excess's median over SYNC_ROUNDS rounds (the user's own when set)
    assert seen == [(2, 4, cal.SYNC_ROUNDS), (4, 4, cal.SYNC_ROUNDS)]
    seen.clear()
    sync_costs(2, rule=Stability(k=1, rounds_set=True), alone_fn=lambda passes: alone[passes],
               spawn_fn=_fake_spawn({2: free, 4: busy}, seen))
    assert seen == [(2, 4, 1), (4, 4, 1)]
    with pytest.raises(BusyMachine, match="too busy"):
        sync_costs(2, spawn_fn=_fake_spawn({2: free, 4: ["the machine was too busy to "
                                                         "calibrate: x", *busy[1:]]}),
                   alone_fn=lambda passes: alone[passes])
    noisy = itertools.cycle([1e-3, 3e-3])
    with pytest.raises(BusyMachine, match="one compute segment alone"):
        sync_costs(2, spawn_fn=_fake_spawn({2: free, 4: busy}),
                   alone_fn=lambda passes: next(noisy))


def test_sync_worker_measures_the_excess_per_round():
    """The real worker on 2 gloo ranks, one short round: three walls, three CPU times and
    the two excesses, each a round's own difference (here the only round's)."""
    from paratrain.parallel.process_groups import spawn

    res = spawn(cal.sync_worker, 2, 10, Stability(k=1, cv=10.0, max_repeats=1), 1,
                timeout_s=120)
    for r in res:
        assert len(r) == 8 and all(x > 0 for x in r[:6])
        assert r[6] == pytest.approx(r[1] - r[0] - r[2])
        assert r[7] == pytest.approx(r[4] - r[3] - r[5])


def test_bench_calibrate_refuses_on_a_busy_machine(monkeypatch, tmp_path, capsys):
    """The CLI: the sweep's ranks report that they never settled; exit 2, one line, and
    no profile written."""
    import paratrain.parallel.process_groups as pg

    line = ("the machine was too busy to calibrate: the gloo ping-pong and all-reduce sweep "
            "still varied by 40% ...; run `paratrain bench calibrate` again when fewer jobs run")
    monkeypatch.setattr(pg, "spawn", lambda fn, world, *a, **k: [{"busy": line}] * world)
    out = tmp_path / "hw.toml"
    assert main(["bench", "calibrate", "--out", str(out), "--algorithms", "ring"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the machine was too busy to calibrate") and "\n" not in err
    assert not out.exists()


def test_a_sweep_is_judged_by_what_it_fits_not_by_each_size():
    """One size's latency flips between rounds (a wake-up or none), the fitted latency
    (the median of the small sizes) does not: stable after k rounds."""
    rounds = [[1e-4, 3e-4, 1e-4], [3e-4, 1e-4, 1e-4], [1e-4, 1e-4, 3e-4]]
    measure, calls = _scripted(rounds)
    got = until_stable(measure, "sweep", Stability(k=3, cv=0.15, max_repeats=3),
                       judged=lambda xs: [sorted(xs)[1]])
    assert got == [1e-4, 1e-4, 1e-4] and len(calls) == 3
    with pytest.raises(BusyMachine):
        until_stable(_scripted(rounds)[0], "sweep", Stability(k=3, cv=0.15, max_repeats=3))


def test_the_threshold_comes_from_the_environment_when_set(monkeypatch, capsys, tmp_path):
    """PARATRAIN_STABLE_CV sets the variation allowed; a value that is no positive number
    is one line naming it, exit 2, before anything is measured."""
    monkeypatch.delenv("PARATRAIN_STABLE_CV", raising=False)
    assert cal.default_rule() == Stability()
    monkeypatch.setenv("PARATRAIN_STABLE_CV", "0.5")
    assert cal.default_rule() == Stability(cv=0.5)
    for bad in ("abc", "0", "-1", "nan"):
        monkeypatch.setenv("PARATRAIN_STABLE_CV", bad)
        assert main(["bench", "calibrate", "--out", str(tmp_path / "hw.toml")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: PARATRAIN_STABLE_CV=") and "\n" not in err, err
    monkeypatch.delenv("PARATRAIN_STABLE_CV")
    monkeypatch.setenv("PARATRAIN_STABLE_ROUNDS", "1")  # the first round counts
    assert cal.default_rule() == Stability(k=1, rounds_set=True)
    assert until_stable(_scripted([[1.0], [9.0]])[0], "sweep", cal.default_rule()) == [1.0]
    for bad in ("x", "0", "-2", "1.5", "11"):
        monkeypatch.setenv("PARATRAIN_STABLE_ROUNDS", bad)
        assert main(["bench", "calibrate", "--out", str(tmp_path / "hw.toml")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: PARATRAIN_STABLE_ROUNDS=") and "\n" not in err, err
    assert not (tmp_path / "hw.toml").exists()
