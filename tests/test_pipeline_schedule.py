"""Pipeline schedules as data: every generated schedule executes (no deadlock, every send
received, no backward before its forward, nothing missing or repeated) for p up to 64,
and its simulated bubble is the textbook one."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import TINY
from paratrain.cost.activations import micro_batches_in_flight
from paratrain.cost.pipeline_sim import simulate_pipeline, validate
from paratrain.cost.schedule import (
    SCHEDULES,
    V_SHAPED,
    Action,
    bubble_formula,
    build_schedule,
)
from paratrain.plan import ParallelPlan


def cases(p: int):
    for name in SCHEDULES:
        for m in sorted({1, 2, p, 2 * p}):
            for v in ((1, 2, 3) if name == "interleaved" else (2,) if name in V_SHAPED
                      else (1,)):
                if name == "interleaved" and m % p or name == "dualpipev" and m < 2 * p:
                    continue
                yield name, m, v


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8, 16, 32, 64])
def test_every_schedule_validates(p):
    for name, m, v in cases(p):
        tl = validate(build_schedule(name, p, m, v))
        assert 0.0 <= tl.bubble < 1.0
        if name not in V_SHAPED:  # the V schedules rely on the runtime's message tags
            assert tl.fifo  # sends and receives also pair up in order between two ranks
        else:
            assert tl.bubble == pytest.approx(bubble_formula(name, p, m, v), abs=1e-12)
        if name in ("gpipe", "1f1b"):
            assert tl.bubble == pytest.approx(bubble_formula(name, p, m), abs=1e-12)
        if name == "interleaved":
            assert tl.bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
        if name == "zb-h1" and m >= p:
            assert tl.bubble == pytest.approx(bubble_formula(name, p, m), abs=1e-12)
            assert tl.bubble <= bubble_formula("1f1b", p, m)


def test_memory_of_1f1b_vs_gpipe():
    p, m = 4, 8
    assert simulate_pipeline(build_schedule("gpipe", p, m)).peak_in_flight == [m] * p
    want = [p - r for r in range(p)]
    assert simulate_pipeline(build_schedule("1f1b", p, m)).peak_in_flight == want


def test_v_placement_and_its_schedules():
    """Chunk 0 of rank r is stage r, chunk 1 stage 2p-1-r; rank p-1's hand-off from stage
    p-1 to p is no message; both V schedules hold p stages' activations (2p chunks, ZB-V;
    one more, DualPipeV) and beat ZB-H1's bubble at the same (p, m)."""
    p, m = 4, 8
    for name in V_SHAPED:
        s = build_schedule(name, p, m, 2)
        assert [s.stage(r, c) for r in range(p) for c in (0, 1)] == [0, 7, 1, 6, 2, 5, 3, 4]
        assert all(s.locate(s.stage(r, c)) == (r, c) for r in range(p) for c in (0, 1))
        comms = [a for a in s.actions[p - 1] if a.kind in ("SEND_F", "RECV_F")]
        assert len(comms) == 2 * m  # stage p-2 -> p-1 and p -> p+1 only
        tl = simulate_pipeline(s)
        assert tl.peak_in_flight == [2 * p + (name == "dualpipev")] * p
        # the analytical memory model's count, in full stages (a chunk is half of one)
        assert micro_batches_in_flight(name, p, m, 2) == max(tl.peak_in_flight) / 2
        assert tl.bubble < bubble_formula("zb-h1", p, m) < bubble_formula("1f1b", p, m)
        # the compute lists: every (stage, micro-batch) has F and a backward exactly once
        for r in range(p):
            got = sorted((a.chunk, a.mb, a.kind) for a in s.compute(r))
            assert len(got) == len(set(got))
    with pytest.raises(ValueError, match="exactly 2 chunks"):
        build_schedule("zb-v", 4, 8, 1)
    with pytest.raises(ValueError, match="micro_batches >= 2"):
        build_schedule("dualpipev", 4, 7, 2)


def test_predicted_bubbles_at_pp4_m8():
    got = {n: simulate_pipeline(build_schedule(
        n, 4, 8, 2 if n == "interleaved" or n in V_SHAPED else 1)).bubble for n in SCHEDULES}
    print({k: round(v, 4) for k, v in got.items()})
    assert got["gpipe"] == pytest.approx(3 / 11)
    assert got["1f1b"] == pytest.approx(3 / 11)
    assert got["interleaved"] == pytest.approx(3 / 19)
    assert got["zb-h1"] == pytest.approx(3 / 27)
    assert got["zb-v"] == got["dualpipev"] == pytest.approx(3 / 51)  # (p-1)/(6m+p-1)


def _replace(s, rank, acts):
    rows = list(s.actions)
    rows[rank] = tuple(acts)
    return dataclasses.replace(s, actions=tuple(rows))


def test_validator_rejects_broken_schedules():
    s = build_schedule("1f1b", 2, 2)
    r1 = list(s.actions[1])
    # a backward whose forward never ran
    with pytest.raises(ValueError, match="before F0"):
        validate(_replace(s, 1, [a for a in r1 if not (a.kind == "F" and a.mb == 0)]))
    # a receive nobody sends -> deadlock
    with pytest.raises(ValueError, match="deadlock"):
        validate(_replace(s, 0, [Action("RECV_B", 5, 0, 1)] + list(s.actions[0])))
    # a send nobody receives
    r0 = list(s.actions[0]) + [Action("SEND_F", 1, 0, 1)]
    with pytest.raises(ValueError):
        validate(_replace(s, 0, r0))
    # a missing backward (and its send)
    with pytest.raises(ValueError, match="missing|deadlock"):
        validate(_replace(s, 1, [a for a in r1 if a.mb != 1 or a.kind in ("F", "RECV_F")]))
    # two ranks each waiting for the other first: a cycle
    g = build_schedule("gpipe", 2, 1)
    swapped = [Action("RECV_B", 0, 0, 1)] + [a for a in g.actions[0] if a.kind != "RECV_B"]
    with pytest.raises(ValueError, match="deadlock"):
        validate(_replace(g, 0, swapped))


def test_bad_arguments_are_one_line_errors():
    with pytest.raises(ValueError, match="unknown"):
        build_schedule("pipedream", 2, 2)
    with pytest.raises(ValueError, match="multiple"):
        build_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="interleaved"):
        build_schedule("1f1b", 2, 2, 2)


def test_stage_split_accounts_for_the_head():
    from paratrain.parallel.pipeline.stage import split_layers

    small_vocab = TINY.replace(n_layers=8)
    assert split_layers(small_vocab, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    big_head = small_vocab.replace(vocab_size=4096)  # head ~ 4 blocks of FLOPs
    split = split_layers(big_head, 2)
    assert split[0][1] - split[0][0] > split[1][1] - split[1][0]  # last stage fewer blocks
    assert all(b > a for a, b in split_layers(big_head, 8))  # every stage keeps a block
    with pytest.raises(ValueError, match="n_layers"):
        split_layers(small_vocab, 9)


@pytest.mark.parametrize("args,msg", [
    (["--schedule", "zb-v"], "schedule=zb-v places 2 chunks per rank in a V; pass "
                             "--virtual-stages 2"),
    (["--schedule", "dualpipev", "--virtual-stages", "2", "--micro-batches", "4"],
     "schedule=dualpipev needs micro_batches >= 2*pp = 8 (got 4); pass --micro-batches 8"),
    (["--schedule", "1f1b", "--virtual-stages", "2"], "needs --schedule interleaved"),
])
def test_v_constraints_are_one_line_errors(args, msg, capsys):
    from paratrain.cli import main

    assert main(["plan", "--pp", "4", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and msg in err[0], err


def test_v_schedules_are_planned(capsys):
    from paratrain.cli import main

    for name in V_SHAPED:
        assert main(["plan", "--pp", "4", "--schedule", name, "--virtual-stages", "2",
                     "--micro-batches", "8"]) == 0
        assert "pipeline bubble" in capsys.readouterr().out


def _torch_order(cls, p: int, m: int) -> list[list[tuple[str, int, int]]]:
    """Per rank, (kind, micro-batch, stage) of PyTorch's own generator for ``cls``, its
    combined forward+backward actions unpacked in order (private API: see the caller)."""
    import torch.distributed.pipelining.schedules as ts

    kinds = {ts.F: "F", ts.FULL_BACKWARD: "B", ts.I: "BI", ts.W: "BW"}
    gen = object.__new__(cls)  # the generator needs only these, not real stages
    gen.pp_group_size, gen._n_microbatches = p, m
    gen.num_stages = gen._num_stages = 2 * p
    out = []
    for r in range(p):
        acts = [a for a in gen._calculate_single_rank_operations(r) if a is not None]
        out.append([(kinds[x.computation_type], x.microbatch_index, x.stage_index)
                    for a in acts for x in (a.sub_actions or (a,))])
    return out


def test_v_schedules_are_pytorchs_compute_orders():
    """Our generators are our code, but their compute order is PyTorch's
    ``ScheduleZBVZeroBubble`` / ``ScheduleDualPipeV`` (torch/distributed/pipelining/
    schedules.py), action for action, for every p <= 6 and m <= 12 each accepts."""
    ts = pytest.importorskip("torch.distributed.pipelining.schedules")
    if not all(hasattr(ts, n) for n in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")) or \
            not hasattr(ts.ScheduleDualPipeV, "_calculate_single_rank_operations"):
        pytest.skip("this torch has no ZBV/DualPipeV generators to compare with (private API)")
    for name, cls in (("zb-v", ts.ScheduleZBVZeroBubble), ("dualpipev", ts.ScheduleDualPipeV)):
        for p in range(1, 7):
            for m in range(2 * p if name == "dualpipev" else 1, 13):
                s = build_schedule(name, p, m, 2)
                ours = [[(a.kind, a.mb, s.stage(r, a.chunk)) for a in s.compute(r)]
                        for r in range(p)]
                assert ours == _torch_order(cls, p, m), (name, p, m)


def test_run_prediction_counts_the_v_messages_off_the_lists():
    """Under a V rank 0 holds both ends of the model and still sends for each (2m hops
    a step, 1F1B's rank 0 m); rank p-1's middle hand-off is no message."""
    from paratrain.predict.calls import pp_messages

    p, m = 4, 8
    for name in V_SHAPED:
        plan = ParallelPlan(pp=p, micro_batches=m, schedule=name, virtual_stages=2)
        assert [pp_messages(plan, r) for r in range(p)] == [(2 * m, 2 * m)] + [
            (4 * m, 4 * m)] * (p - 2) + [(2 * m, 2 * m)]


def test_the_plan_offers_exactly_the_generated_schedules():
    """plan.py sits below cost/ (no import of it), so it spells the names again."""
    import paratrain.plan as plan_mod

    assert plan_mod.SCHEDULES == SCHEDULES and plan_mod.V_SHAPED == V_SHAPED
