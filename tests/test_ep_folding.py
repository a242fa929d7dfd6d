"""Expert parallelism folded over the mesh (issue 25, item 3; Megatron-Core's "MoE
parallel folding"): ``--ep`` spanning dp x cp, and tp with SP; ``--etp`` splitting each
expert over tp ranks (etp = tp), or not at all under tp 2 (etp 1).

- The fold's arithmetic (:class:`paratrain.cost.ranks.Fold`): the ep, etp and edp groups
  of every layout partition a stage's ranks, the ep groups hold different tokens, and
  the mesh builds them on real gloo groups as documented.
- float64 against one process on real gloo: every step's loss within 1e-9 relative, the
  MoE statistics equal (:func:`test_moe_cp_sp._check`), ZeRO 0-3, a pipeline, recompute.
- Bytes per rank predicted == measured: the expert gradient sync (both reducers,
  :func:`paratrain.cost.layout.dp_wire_bytes`), the model states, and the MoE dispatch
  (the ep all-to-all, :func:`paratrain.predict.axes.ep_wire_bytes`, plus the etp stage,
  :func:`paratrain.cost.ep_bytes.etp_wire_bytes`) for a model whose top_k = E routes
  every token to every expert, so the rows are known from the plan; for etp 1 also the
  systems model's own prediction (:func:`paratrain.predict.predict`).
"""

from __future__ import annotations

import itertools

import pytest

from conftest import parity_tcfg
from paratrain.config import ModelConfig
from paratrain.cost.ep_bytes import etp_wire_bytes
from paratrain.cost.layout import rank_layout
from paratrain.cost.ranks import Fold
from paratrain.parallel.mesh import Mesh, axis_ranks, layout_table
from paratrain.parallel.process_groups import spawn
from paratrain.plan import ParallelPlan
from paratrain.predict.axes import ep_wire_bytes, moe_blocks, routed_tokens
from paratrain.run.loop import RunOptions, train
from test_moe_cp_sp import _check, _worker

MOE = ModelConfig(n_layers=2, d_model=32, n_heads=4, d_ff=64, context=16, experts=4,
                  top_k=2, z_loss_coef=0.01)
ALL = MOE.replace(top_k=4)  # every token to every expert: the dispatch's rows are known
CAPPED = MOE.replace(capacity_factor=1.0)  # drops assignments (places in line over T)
QUIET = dict(quiet=True, measure_peak=False)
P = ParallelPlan

TWO = {
    "etp 1 under tp 2: tp2 sp ep2": (ALL, P(tp=2, sp=True, ep=2)),
    "etp = tp: tp2 sp etp2 zero1 ours": (ALL, P(tp=2, sp=True, etp=2, zero=1,
                                                 collectives="ours")),
    "etp = tp without sp: tp2 etp2": (MOE, P(tp=2, etp=2)),
    "ep over cp: cp2 ep2 zero3": (ALL, P(cp=2, ep=2, zero=3)),
}
FOUR = {
    "ep over dp x cp: dp2 cp2 ep4": (ALL, P(dp=2, cp=2, ep=4)),
    "dp2 cp2 ep4 zero3 accum2": (MOE, P(dp=2, cp=2, ep=4, zero=3, micro_batches=2)),
}
FOUR_SLOW = {
    "dp2 cp2 ep4 zero1 ours full recompute": (ALL, P(dp=2, cp=2, ep=4, zero=1,
                                                     collectives="ours", recompute="full")),
    "dp2 cp2 ep4 zero2 all-to-all": (MOE, P(dp=2, cp=2, ep=4, zero=2,
                                            cp_algorithm="all-to-all")),
    "etp 1 under tp 2: dp2 tp2 sp ep4": (ALL, P(dp=2, tp=2, sp=True, ep=4)),
    "dp2 tp2 sp ep4 zero3": (MOE, P(dp=2, tp=2, sp=True, ep=4, zero=3)),
    "etp = tp: dp2 tp2 sp ep2 etp2 zero1": (ALL, P(dp=2, tp=2, sp=True, ep=2, etp=2,
                                                   zero=1)),
    "dp2 tp2 sp ep2 etp2 zero3 full recompute": (ALL, P(dp=2, tp=2, sp=True, ep=2, etp=2,
                                                        zero=3, recompute="full")),
    "dp2 tp2 ep2 etp2 (no sp) zero2": (ALL, P(dp=2, tp=2, ep=2, etp=2, zero=2)),
    "etp = tp over dp: dp2 tp2 sp etp2 zero2": (ALL, P(dp=2, tp=2, sp=True, etp=2,
                                                        zero=2)),
    "pp2 tp2 sp ep2 m4": (ALL, P(pp=2, tp=2, sp=True, ep=2, micro_batches=4)),
    "pp2 tp2 sp etp2 zero1 m2": (MOE, P(pp=2, tp=2, sp=True, etp=2, zero=1,
                                        micro_batches=2)),
    "pp2 dp2 ep2 zero3 m2": (ALL, P(pp=2, dp=2, ep=2, zero=3, micro_batches=2)),
    "capacity 1.0: dp2 cp2 ep4": (CAPPED, P(dp=2, cp=2, ep=4)),
    "capacity 1.0: dp2 tp2 sp ep2 etp2": (CAPPED, P(dp=2, tp=2, sp=True, ep=2, etp=2)),
}

EIGHT_SLOW = {  # the first routes no rows to some rank's experts at some layer
    "dp2 cp2 tp2 sp ep4 etp2 zero1": (MOE, P(dp=2, cp=2, tp=2, sp=True, ep=4, etp=2,
                                             zero=1)),
    "pp2 cp2 tp2 sp ep2 etp2 zero3 m2": (ALL, P(pp=2, cp=2, tp=2, sp=True, ep=2, etp=2,
                                                zero=3, micro_batches=2)),
}


def dispatch_bytes(mcfg: ModelConfig, plan: ParallelPlan, rank: int, seqs: int) -> float:
    """Bytes ``rank`` sends per step in its MoE dispatches when top_k = E: it routes N
    tokens per layer and micro-batch, each to all E experts; E/ep of them are its own, so
    it sends N (E - E/ep) rows to and receives as many from its ep group, and its
    experts run on ep N E/ep rows (x etp, all-gathered, with SP)."""
    m = plan.micro_batches
    n = routed_tokens(plan, seqs // plan.dp // m * mcfg.context // plan.cp)
    passes = m * moe_blocks(mcfg, rank_layout(mcfg, plan, rank))
    El = mcfg.experts // plan.ep
    rows = passes * n * El * (plan.ep - 1)
    mine = passes * plan.ep * n * El
    return (ep_wire_bytes(mcfg, plan, 8, rows, rows, passes)
            + etp_wire_bytes(mcfg, plan, 8, mine, (plan.etp - 1) * mine, passes))


@pytest.fixture(scope="module")
def refs(text_file):
    return {m: train(m, parity_tcfg(text_file), None, RunOptions(**QUIET))
            for m in (MOE, ALL, CAPPED)}


def _run(text_file, refs, world: int, combos: dict) -> None:
    results = spawn(_worker, world, text_file, combos, timeout_s=600)
    _check(results, combos, refs)
    for name, (model, plan) in combos.items():
        if model.top_k != model.experts:
            continue
        for r, res in enumerate(results):
            want = dispatch_bytes(model, plan, r, parity_tcfg(text_file).global_batch)
            assert want > 0 and res[name][5] == [want] * len(res[name][5]), (name, r)
        if plan.etp == 1:  # the systems model's expected bytes, exact when top_k = E
            assert _predicted_ep_bytes(model, plan, text_file) == results[0][name][5][0], name


def _predicted_ep_bytes(model, plan, text_file) -> float:
    from paratrain.cost.hardware import Hardware
    from paratrain.predict import MachineModel, predict

    hw = Hardware("test-box", peak_flops=4e9, hbm_bytes=8e9, hbm_bw=1e10, gpus_per_node=8,
                  intra_bw=1e9, intra_alpha=1e-4, inter_bw=1e9, inter_alpha=1e-4, eta=1.0)
    machine = MachineModel(hw, eta=0.5, thread_peak=1e9, pass_s=1e-3, step_s=2e-3,
                           fitted=True)
    return predict(model, parity_tcfg(text_file), plan, plan.world_size, machine).ep_wire_bytes


def test_fold_world2_reproduces_one_process(text_file, refs):
    _run(text_file, refs, 2, TWO)


def test_fold_over_dp_and_cp_world4(text_file, refs):
    _run(text_file, refs, 4, FOUR)


@pytest.mark.slow
def test_fold_over_tp_etp_and_pp_world4(text_file, refs):
    _run(text_file, refs, 4, FOUR_SLOW)


@pytest.mark.slow
def test_fold_over_dp_cp_tp_world8(text_file, refs):
    _run(text_file, refs, 8, EIGHT_SLOW)


# ---- the fold's arithmetic ------------------------------------------------------------
LAYOUTS = [P(dp=2, cp=2, ep=4), P(dp=4, cp=2, ep=2), P(dp=2, tp=2, sp=True, ep=4),
           P(dp=2, tp=2, sp=True, ep=2, etp=2), P(dp=2, tp=2, ep=2, etp=2),
           P(dp=4, tp=2, ep=2), P(pp=2, dp=2, cp=2, tp=2, sp=True, ep=2, etp=2),
           P(dp=8, tp=2, sp=True, ep=4, etp=2)]


@pytest.mark.parametrize("plan", LAYOUTS, ids=str)
def test_fold_groups_partition_the_stage(plan):
    """Each of ep, etp and edp cuts every stage into groups of its size; an ep group's
    ranks hold different tokens (dp, cp and, with SP, tp coordinates differ) and a rank
    is in exactly one group of each; the mesh's sizes and indices are the fold's."""
    fold = Fold.of(plan)
    mesh = Mesh.from_plan(plan, world=plan.world_size)
    for axis, n in (("ep", plan.ep), ("etp", plan.etp), ("edp", fold.edp)):
        groups = {tuple(axis_ranks(r, axis, mesh.sizes)) for r in range(plan.world_size)}
        assert all(len(g) == n for g in groups), (axis, groups)
        members = sorted(r for g in groups for r in g)
        assert members == list(range(plan.world_size)), axis
    assert fold.edp * plan.ep * plan.etp * (plan.tp // fold.fold_tp) == plan.dp * plan.cp * plan.tp
    for r in range(plan.world_size):
        g = axis_ranks(r, "ep", mesh.sizes)
        tokens = {Fold.of(plan).coords(q)[0:1] + _token_coords(q, plan) for q in g}
        assert len(tokens) == plan.ep, (r, g)
        assert g.index(r) == Fold.of(plan).coords(r)[2]


def _token_coords(rank: int, plan: ParallelPlan) -> tuple:
    from paratrain.cost.ranks import mesh_coords

    _, dp_i, cp_i, tp_i = mesh_coords(rank, plan)
    return (dp_i, cp_i, tp_i if plan.sp else 0)


def test_fold_order_is_megatrons():
    """Ranks of a stage in the global order cut as edp x ep x etp, etp innermost: dp 4
    cp 2 ep 2 puts each cp pair in one ep group; dp 2 tp 2 sp ep 2 makes the tp pair the
    ep group and the dp pair the edp group; with etp = tp the ep group strides over tp."""
    s = Mesh.from_plan(P(dp=4, cp=2, ep=2), world=8).sizes
    assert axis_ranks(1, "ep", s) == [0, 1] and axis_ranks(0, "edp", s) == [0, 2, 4, 6]
    s = Mesh.from_plan(P(dp=2, tp=2, sp=True, ep=2), world=4).sizes
    assert axis_ranks(0, "ep", s) == [0, 1] and axis_ranks(1, "edp", s) == [1, 3]
    s = Mesh.from_plan(P(dp=2, tp=2, sp=True, ep=2, etp=2), world=4).sizes
    assert axis_ranks(1, "ep", s) == [1, 3] and axis_ranks(2, "etp", s) == [2, 3]
    s = Mesh.from_plan(P(dp=4, tp=2, ep=2), world=8).sizes  # no SP: each tp rank a copy
    assert axis_ranks(0, "ep", s) == [0, 2] and axis_ranks(3, "edp", s) == [3, 7]
    assert "MoE fold: edp 2 x ep 2 x etp 1, each of the 2 tp ranks a copy" in layout_table(s)


@pytest.mark.parametrize("plan,match", [
    (P(tp=2, ep=2), "must divide dp\\*cp=1"),
    (P(tp=4, etp=2), "--etp 2 with --tp 4 and no --sp"),
    (P(tp=2, sp=True, etp=2, dp_replicate=1, zero=1), None),
    (P(dp=4, ep=2, etp=1, compress="topk:4"), "drop --compress"),
])
def test_runtime_refuses_only_what_it_cannot_run(plan, match):
    if match is None:
        plan.check_runtime(MOE)
        return
    with pytest.raises(ValueError, match=match):
        plan.check_runtime(MOE)


def test_runtime_accepts_every_fold_of_the_issue():
    combos = {**TWO, **FOUR, **FOUR_SLOW, **EIGHT_SLOW}
    for plan in itertools.chain(LAYOUTS, (p for _, p in combos.values())):
        plan.check_run(MOE, plan.world_size, 8)
    with pytest.raises(ValueError, match="needs a Mixture-of-Experts"):
        P(tp=2, sp=True, etp=2).check_runtime(MOE.replace(experts=0, top_k=1))
    with pytest.raises(ValueError, match="divide the expert width 66"):
        P(tp=4, sp=True, etp=4).check_runtime(MOE.replace(moe_ffn=66))


@pytest.mark.parametrize("args,fragment", [
    (["--ep", "2", "--tp", "2", "--nproc", "2"],
     "--ep 2 with --tp 2 and no --sp must divide dp*cp=1"),
    (["--etp", "2", "--tp", "4", "--nproc", "4"], "--etp 2 with --tp 4 and no --sp"),
])
def test_bad_fold_flags_are_one_line_and_exit_2(capsys, args, fragment):
    from paratrain.cli import main

    code = main(["train", "--layers", "2", "--d-model", "32", "--heads", "4", "--context",
                 "16", "--global-batch", "8", "--steps", "1", "--experts", "4", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert fragment in err and len(err.splitlines()) == 1, err


def _resume_worker(rank: int, world: int, data: str, ckpt: str) -> tuple[list, list]:
    from paratrain.config import TrainConfig

    t = TrainConfig(steps=6, global_batch=8, lr=1e-2, warmup_steps=2, eval_every=0,
                    eval_batches=1, dtype="float64", data=data)
    split, whole = P(tp=2, sp=True, etp=2, zero=1), P(tp=2, sp=True, ep=2, zero=3)
    full = train(MOE, t, split, RunOptions(**QUIET))["losses"]
    train(MOE, t, split, RunOptions(checkpoint_dir=ckpt, stop_after=3, **QUIET))
    resumed = train(MOE, t, whole, RunOptions(checkpoint_dir=ckpt, resume=True, **QUIET))
    return full[3:], resumed["losses"]


def test_checkpoint_of_split_experts_resumes_under_another_fold(text_file, tmp_path):
    """Each etp rank saves its slices of every expert (their boxes narrowed over etp);
    a run saved at step 3 with etp 2 resumes with whole experts over ep 2 (ZeRO-3) and
    continues the uninterrupted run's losses within 1e-9."""
    from conftest import max_rel_diff

    for full, resumed in spawn(_resume_worker, 2, text_file, str(tmp_path / "ckpt")):
        assert len(resumed) == 3 and max_rel_diff(resumed, full) <= 1e-9, (resumed, full)
