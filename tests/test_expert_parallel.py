"""Mixture of Experts and expert parallelism (issue 12).

- The MoE layer: the auxiliary loss equals the Switch/GShard formula computed here
  independently; with capacity factor 1.0 the dropped assignments are exactly those
  over ceil(T k / E) per sequence and expert, and counted; one expert, top-1, no
  auxiliary loss is the dense model with the same weights; exact parameter counts.
- The router z-loss (ST-MoE) and its gradient equal (log sum exp logits)^2 summed over
  tokens, computed here independently.
- ``--ep``: float64, 4 steps, every step's loss within 1e-9 relative of one process
  running the same MoE model (experts 4, top-k 2, dropless), and the MoE statistics
  (auxiliary loss, z-loss, load per expert) equal; under ZeRO-3 the experts are sharded
  over the expert-data-parallel group (model states per rank: paratrain.cost.layout's count).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import TINY, max_rel_diff
from paratrain.config import ModelConfig, TrainConfig
from paratrain.cost.layout import dp_wire_bytes, state_bytes
from paratrain.cost.shapes import as_shape
from paratrain.model import Decoder, moe_modules, set_moe_loss_scale, take_moe_stats
from paratrain.parallel.process_groups import spawn
from paratrain.plan import ParallelPlan
from paratrain.run.loop import RunOptions, train

MOE = ModelConfig(n_layers=2, d_model=32, n_heads=4, d_ff=64, context=16, experts=4,
                  top_k=2)
QUIET = dict(quiet=True, measure_peak=False)
CAPPED = MOE.replace(capacity_factor=1.0, shared_experts=1)
ZMOE = MOE.replace(z_loss_coef=0.01)

FOUR = {
    "ep4": ParallelPlan(dp=4, ep=4),
    "ep4 ours accum2": ParallelPlan(dp=4, ep=4, collectives="ours", micro_batches=2),
    "ep2 zero1 (dp4)": ParallelPlan(dp=4, ep=2, zero=1),
    "ep2 tp2": ParallelPlan(dp=2, tp=2, ep=2),
    "ep2 zero2 accum2 (dp4)": ParallelPlan(dp=4, ep=2, zero=2, micro_batches=2),
    "ep2 pp2 m4": ParallelPlan(dp=2, pp=2, ep=2, micro_batches=4),
    "ep2 zero3 (dp4) accum2 ours full recompute, z-loss": (
        ZMOE, ParallelPlan(dp=4, ep=2, zero=3, micro_batches=2, collectives="ours",
                           recompute="full")),
}
TWO = {"ep2": ParallelPlan(dp=2, ep=2),
       "ep2 capacity 1.0 shared 1": (CAPPED, ParallelPlan(dp=2, ep=2)),
       "ep2 ours": ParallelPlan(dp=2, ep=2, collectives="ours"),
       "ep2 full recompute": ParallelPlan(dp=2, ep=2, recompute="full"),
       "moe dp2 zero3 (ep 1)": ParallelPlan(dp=2, zero=3)}


def tcfg(data: str) -> TrainConfig:
    return TrainConfig(steps=4, global_batch=8, lr=1e-2, warmup_steps=2, eval_every=0,
                       eval_batches=1, dtype="float64", data=data)


def _split(entry) -> tuple[ModelConfig, ParallelPlan]:
    return entry if isinstance(entry, tuple) else (MOE, entry)


def _worker(rank: int, world: int, data: str, combos: dict) -> dict:
    out = {}
    for name, entry in combos.items():
        model, plan = _split(entry)
        s = train(model, tcfg(data), plan, RunOptions(**QUIET))
        out[name] = (s["losses"], s["val_loss"], s["moe_steps"],
                     s["memory"]["measured_per_rank"],
                     (s["wire_bytes_per_step"], dp_wire_bytes(model, plan, "float64", rank)),
                     s["memory"]["predicted_per_rank"])
    return out


@pytest.fixture(scope="module")
def refs(text_file):
    return {m: train(m, tcfg(text_file), None, RunOptions(**QUIET))
            for m in (MOE, CAPPED, ZMOE)}


@pytest.mark.parametrize("world,combos", [(2, TWO), (4, FOUR)], ids=["world2", "world4"])
@pytest.mark.slow
def test_expert_parallel_reproduces_one_process(text_file, refs, world, combos):
    results = spawn(_worker, world, text_file, combos, timeout_s=600)
    worst = {}
    for name in combos:
        model, plan = _split(combos[name])
        ref = refs[model]
        losses, val, moe, states, _, systems = results[0][name]
        for r, res in enumerate(results):  # dp sync bytes (both reducers): the formula's
            assert res[name][4][0] == pytest.approx(res[name][4][1], rel=1e-12), (name, r)
        d = max_rel_diff(losses, ref["losses"])
        worst[name] = d
        print(f"{name}: 4-step max rel loss diff {d:.2e}; val {val:.12f} vs "
              f"{ref['val_loss']:.12f}")
        for r in results[1:]:
            assert r[name][0] == losses, f"{name}: ranks disagree on the loss"
        for got, want in zip(moe, ref["moe_steps"], strict=True):
            assert got["moe_load"] == want["moe_load"], name
            assert got["aux_loss"] == pytest.approx(want["aux_loss"], rel=1e-9), name
            assert got["z_loss"] == pytest.approx(want["z_loss"], rel=1e-9), name
            assert (got["z_loss"] > 0) == (model.z_loss_coef > 0), name
            assert got["moe_dropped"] == want["moe_dropped"]
            assert (got["moe_dropped"] > 0) == (model.capacity_factor > 0)
            assert ("ep_wire_bytes" in got) == (plan.ep > 1)
            assert got.get("ep_wire_bytes", 1) > 0
        for r in range(world):  # model states per rank: paratrain.cost.layout's exact count
            want = state_bytes(model, plan, "float64", r)
            assert {k: states[r][k] for k in want} == want, (name, r)
            if plan.tp == plan.pp == 1:  # and the systems model's (no padding here)
                assert {k: systems[k] for k in want} == want, (name, r)
    for name in combos:
        ref = refs[_split(combos[name])[0]]
        assert worst[name] <= 1e-9, f"{name}: {worst[name]:.2e}"
        assert results[0][name][1] == pytest.approx(ref["val_loss"], rel=1e-9), name


def _routing(x_BTD, w_router, k):
    """The reference router: probabilities, top-k indices, renormalised weights."""
    p = (x_BTD @ w_router.T).softmax(-1)
    w, i = p.topk(k, dim=-1)
    return p, i, w / w.sum(-1, keepdim=True)


def _expert(ex, x):
    return ex.w_down(F.silu(ex.w_gate(x)) * ex.w_up(x))


def test_aux_loss_and_capacity_match_the_formulas():
    torch.manual_seed(1)
    cfg = MOE.replace(capacity_factor=1.0, n_layers=1)
    m = Decoder(cfg).double()
    moe = moe_modules(m)[0]
    B, T, E, K = 3, 16, cfg.experts, cfg.top_k
    x = torch.randn(B, T, cfg.d_model, dtype=torch.float64)
    y = moe(x)
    p, idx, w = _routing(x, moe.router.weight, K)
    # Switch / GShard per sequence: E * sum_e f_e P_e, f over the T*K assignments
    aux = 0.0
    for b in range(B):
        f = torch.stack([(idx[b] == e).sum() for e in range(E)]).double() / (T * K)
        aux += E * float((f * p[b].mean(0)).sum().detach())
    assert moe.stats["aux_sum"] == pytest.approx(aux, rel=1e-12)
    # capacity ceil(1.0 * T * K / E) per sequence and expert, first come first served
    cap = math.ceil(T * K / E)
    want = torch.zeros_like(x)
    dropped = 0
    for b in range(B):
        seen = [0] * E
        for t in range(T):
            for j in range(K):
                e = int(idx[b, t, j])
                seen[e] += 1
                if seen[e] > cap:
                    dropped += 1
                    continue
                want[b, t] += w[b, t, j] * _expert(moe.experts[e], x[b, t])
    assert dropped > 0 and moe.stats["dropped"] == dropped
    assert int(moe.stats["load"].sum()) == B * T * K - dropped
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)


def test_aux_loss_gradient_is_coef_times_the_mean_over_sequences():
    torch.manual_seed(2)
    cfg = MOE.replace(n_layers=1, aux_loss_coef=0.5)
    m = Decoder(cfg).double()
    moe = moe_modules(m)[0]
    B, T = 2, 16
    x = torch.randn(B, T, cfg.d_model, dtype=torch.float64)
    n = B * T
    set_moe_loss_scale(m, 1.0 / n)
    moe(x).sum().backward()
    g_auto = moe.router.weight.grad.clone()
    moe.router.weight.grad = None
    set_moe_loss_scale(m, None)
    y = moe(x)
    p, idx, _ = _routing(x, moe.router.weight, cfg.top_k)
    f = F.one_hot(idx.view(B, -1), cfg.experts).sum(1).double() / (T * cfg.top_k)
    aux = cfg.experts * (f * p.mean(1)).sum()
    (y.sum() + 0.5 * T * aux / n).backward()
    torch.testing.assert_close(g_auto, moe.router.weight.grad, rtol=1e-12, atol=1e-15)


def test_z_loss_and_its_gradient_match_the_formula():
    torch.manual_seed(4)
    cfg = MOE.replace(n_layers=1, aux_loss_coef=0.0, z_loss_coef=0.3)
    moe = moe_modules(Decoder(cfg).double())[0]
    x = torch.randn(2, 16, cfg.d_model, dtype=torch.float64)
    n = 32
    set_moe_loss_scale(moe, 1.0 / n)
    moe(x).sum().backward()
    g_auto = moe.router.weight.grad.clone()
    moe.router.weight.grad = None
    logits = x @ moe.router.weight.T  # ST-MoE eq. 5: (log sum_e exp x_e)^2 per token
    z = torch.log(torch.exp(logits).sum(-1)).square().sum()
    assert moe.stats["z_sum"] == pytest.approx(float(z.detach()), rel=1e-12)
    set_moe_loss_scale(moe, None)
    (moe(x).sum() + 0.3 * z / n).backward()
    torch.testing.assert_close(g_auto, moe.router.weight.grad, rtol=1e-12, atol=1e-15)


def test_one_expert_top1_is_the_dense_model():
    dense_cfg = TINY
    torch.manual_seed(3)
    dense = Decoder(dense_cfg).double()
    moe = Decoder(dense_cfg.replace(experts=1, top_k=1, aux_loss_coef=0.0)).double()
    state = {k.replace(".mlp.", ".mlp.experts.0."): v for k, v in dense.state_dict().items()}
    state.update({k: v for k, v in moe.state_dict().items() if "router" in k})
    moe.load_state_dict(state)
    x = torch.randint(0, 256, (2, 16))
    set_moe_loss_scale(moe, 1.0 / 32)
    a, b = dense(x), moe(x)
    assert torch.equal(a, b)
    a.square().sum().backward()
    b.square().sum().backward()
    gm = dict(moe.named_parameters())
    for k, p in dense.named_parameters():
        assert torch.equal(p.grad, gm[k.replace(".mlp.", ".mlp.experts.0.")].grad), k
    assert take_moe_stats(moe, 1)[3] == 2 * 32  # two layers, every token to expert 0


def test_exact_parameter_counts_total_and_active():
    cfg = MOE.replace(shared_experts=1, moe_ffn=48, moe_every=2)
    m = Decoder(cfg)
    shape = as_shape(cfg)
    assert sum(p.numel() for p in m.parameters()) == shape.num_params()
    d, f = cfg.d_model, 48
    assert shape.num_params() - shape.active_params() == (cfg.experts - cfg.top_k) * 3 * d * f
    dense = as_shape(TINY)
    assert dense.active_params() == dense.num_params()
    assert dense.flops_per_token() == 6.0 * dense.num_params() + 12.0 * 2 * 4 * 8 * 16


@pytest.mark.parametrize("bad,match", [
    (dict(experts=-1), "experts = -1"), (dict(experts=4, top_k=5), "top_k=5"),
    (dict(experts=4, moe_every=3), "moe_every=3"),
    (dict(experts=4, capacity_factor=-1.0), "capacity_factor"),
])
def test_bad_moe_settings_are_one_line(bad, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(n_layers=2, **bad)


def test_systems_model_prices_moe_states_as_the_runtime_holds_them():
    """Experts over ep (ZeRO shards over dp / ep), router and shared experts dense:
    the systems model's busiest-rank bytes equal paratrain.cost.layout's per-rank count, for
    uneven shapes too (moe_every 2, a shared expert, expert width 48)."""
    from paratrain.cost.memory import Precision, model_states

    odd = MOE.replace(n_layers=4, shared_experts=1, moe_every=2, moe_ffn=48)
    for model in (MOE, odd):
        for plan in (ParallelPlan(dp=4, ep=4), ParallelPlan(dp=4, ep=2, zero=1),
                     ParallelPlan(dp=4, ep=2, zero=2), ParallelPlan(dp=8, ep=4, zero=3)):
            ms = model_states(model, plan, Precision("float64", 8, 8, 16))
            got = {"params": ms.weights_bytes, "grads": ms.grads_bytes,
                   "optimizer": ms.optimizer_bytes}
            for r in range(plan.dp):
                assert got == state_bytes(model, plan, "float64", r), (plan, r)
            if plan.zero < 3:  # weights: everything but the other ep ranks' experts
                routed = as_shape(model).routed_expert_params()
                assert ms.weights_bytes == 8 * (as_shape(model).num_params() - routed
                                                + routed // plan.ep), plan


def test_plans_refused_with_ep():
    with pytest.raises(ValueError, match="needs a Mixture-of-Experts"):
        ParallelPlan(dp=2, ep=2).check_runtime(ModelConfig())
    with pytest.raises(ValueError, match="drop --compress"):
        ParallelPlan(dp=2, ep=2, compress="topk:4").check_runtime(MOE)
    with pytest.raises(ValueError, match="does not divide experts"):
        ParallelPlan(dp=3, ep=3).check(MOE)
    for m in (MOE, CAPPED):  # MoE runs under cp and sp (tests/test_moe_cp_sp.py)
        ParallelPlan(dp=1, cp=2).check_runtime(m)
        ParallelPlan(tp=2, sp=True).check_runtime(m)
    # folded over the mesh (tests/test_ep_folding.py); without SP the tp ranks are copies
    ParallelPlan(dp=2, tp=2, ep=2).check_runtime(MOE)
    ParallelPlan(tp=2, sp=True, ep=2).check_runtime(MOE)
    with pytest.raises(ValueError, match="pass --sp to fold ep over tp"):
        ParallelPlan(tp=2, ep=2).check_runtime(MOE)


@pytest.mark.parametrize("args, fragment", [
    (["--ep", "2", "--nproc", "2"], "needs a Mixture-of-Experts model"),
    (["--experts", "4", "--ep", "2", "--nproc", "2", "--compress", "topk:4"],
     "works without --compress"),
    (["--experts", "4", "--z-loss-coef", "-1"], "z_loss_coef = -1.0 (--z-loss-coef)"),
    (["--experts", "3", "--ep", "2", "--nproc", "2"], "does not divide experts=3"),
    (["--experts", "4", "--ep", "3", "--nproc", "2"], "ep*etp=3*1 must divide dp*cp*tp=2"),
    (["--experts", "4", "--top-k", "5"], "top_k=5"),
    (["--experts", "4", "--capacity-factor", "-1"], "capacity_factor = -1.0 (--capacity-factor)"),
])
def test_bad_moe_flags_are_one_line_and_exit_2(capsys, args, fragment):
    from paratrain.cli import main

    code = main(["train", "--layers", "2", "--d-model", "32", "--heads", "4", "--context",
                 "16", "--global-batch", "8", "--steps", "1", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert fragment in err and len(err.splitlines()) == 1, err


@pytest.mark.slow
def test_cli_ep_run_logs_expert_load(text_file, tmp_path):
    """The same command from the CLI (torchrun): the mesh line and per-step MoE records."""
    import json
    import subprocess
    import sys

    run = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "paratrain.cli", "train", "--nproc", "2", "--ep", "2",
         "--experts", "4", "--top-k", "2", "--dtype", "float64", "--layers", "2",
         "--d-model", "32", "--heads", "4", "--d-ff", "64", "--context", "16",
         "--global-batch", "8", "--steps", "2", "--eval-every", "0", "--data", text_file,
         "--run-dir", str(run)], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "expert parallel 2: ep rank 0 holds experts [0, 2) of 4" in r.stdout
    assert "ep=2" in r.stdout  # the summary's plan row names the expert split
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for rec in recs:
        assert sum(rec["moe_load"]) == 8 * 16 * 2 * 2  # tokens x top-k x MoE layers
        assert rec["moe_tokens_mean"] == 128 and rec["moe_tokens_max"] >= 128
        assert rec["ep_wire_bytes"] > 0 and rec["aux_loss"] > 0
        by_rank = rec["moe_load_by_rank"]  # each data rank routed its 4 sequences
        assert [sum(r) for r in by_rank] == [4 * 16 * 2 * 2] * 2
        assert [sum(c) for c in zip(*by_rank, strict=True)] == rec["moe_load"]
    from paratrain.cli import main
    from paratrain.viz.moe import read_run, send_matrix

    assert main(["viz", "moe", str(run), "--out", str(tmp_path / "plots")]) == 0
    png = (tmp_path / "plots" / "moe_routing.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") >= 800
    # the dispatch matrix: rank d keeps its rows for its own experts, sends the rest
    last = read_run(str(run))["by_rank"][-1]
    assert send_matrix(last, 2) == [[sum(last[0][:2]), sum(last[0][2:])],
                                    [sum(last[1][:2]), sum(last[1][2:])]]


def _resume_worker(rank: int, world: int, data: str, ckpt: str) -> tuple[list, list]:
    t = TrainConfig(steps=6, global_batch=8, lr=1e-2, warmup_steps=2, eval_every=0,
                    eval_batches=1, dtype="float64", data=data)
    plan = ParallelPlan(dp=2, ep=2, zero=1)
    full = train(MOE, t, plan, RunOptions(**QUIET))["losses"]
    train(MOE, t, plan, RunOptions(checkpoint_dir=ckpt, stop_after=3, **QUIET))
    resumed = train(MOE, t, plan, RunOptions(checkpoint_dir=ckpt, resume=True, **QUIET))
    return full[3:], resumed["losses"]


def test_ep_checkpoint_resumes_exactly(text_file, tmp_path):
    """Each rank saves its experts and both reducers' optimizer shards; resuming at step 3
    continues the uninterrupted run bit for bit."""
    for full, resumed in spawn(_resume_worker, 2, text_file, str(tmp_path / "ckpt")):
        assert resumed == full
