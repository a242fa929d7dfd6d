"""The systems model's MoE pricing (paratrain.systems.moe_step): the plan's expert layout
(ep folded over dp x cp x tp, etp), the engine's dispatcher, hand-computed cases."""

from __future__ import annotations

import pytest

from paratrain.config import ModelConfig
from paratrain.cost import moe_layout
from paratrain.cost.hardware import load_hardware
from paratrain.cost.shapes import as_shape, load_model
from paratrain.plan import ParallelPlan
from paratrain.systems import moe_step
from paratrain.systems.moe_step import expert_imbalance
from paratrain.systems.overlap import engine
from paratrain.systems.runs import row_to_case
from paratrain.systems.step_model import predict_step
from paratrain.systems.step_params import StepParams

H100 = load_hardware("h100")
MOE = as_shape(ModelConfig(d_model=256, n_heads=4, d_ff=1024, experts=16, top_k=2,
                           moe_ffn=512, shared_experts=1, context=1024))


def _shapes(M: int, tp: int, sp: bool, ep: int, etp: int, dispatcher: str = "alltoall"):
    """Every GEMM the MoE MLP prices, as (class, N, K, rows, count), and its elements."""
    seen = []
    elems = moe_step.moe_mlp(MOE, M, tp, sp, ep, etp,
                             lambda c, N, K, rows=M, count=1: seen.append((c, N, K, rows,
                                                                           count)),
                             dispatcher)
    return seen, elems


def test_expert_gemm_shapes_follow_the_plans_etp():
    """etp 1: each expert whole (N = 2 f), fed the rank's own tokens; etp = tp under SP:
    N = 2 f / etp, fed the etp group's gathered tokens (etp x t), so the rows per expert
    stay those of the whole micro-batch."""
    M, E, k, f = 4096, 16, 2, 512
    whole, _ = _shapes(M, tp=2, sp=False, ep=4, etp=1)
    mu = M * k * 4 / E  # tokens per local expert
    rows = round(mu * expert_imbalance(mu, E))
    assert ("experts", 2 * f, 256, rows, E // 4) in whole
    assert ("experts", 256, f, rows, E // 4) in whole
    assert ("router", E, 256, M, 1) in whole
    split, _ = _shapes(M, tp=2, sp=True, ep=4, etp=2)
    assert ("experts", 2 * f // 2, 256, rows, E // 4) in split  # u = (M / 2) x 2 = M
    assert ("router", E, 256, M // 2, 1) in split  # SP: the rank routes its own half
    assert ("mlp", 2 * f // 2, 256, M, 1) in split  # shared expert split over etp
    # etp 1 under SP: the rank's own M / tp tokens, whole experts
    own, _ = _shapes(M, tp=2, sp=True, ep=4, etp=1)
    mu2 = M / 2 * k * 4 / E
    assert ("experts", 2 * f, 256, round(mu2 * expert_imbalance(mu2, E)), E // 4) in own


def test_dispatch_bytes_alltoall_vs_allgather():
    """alltoall: each rank holds its t k routed rows (x the busiest rank's excess), plus
    the etp all-gather of the group's u k rows under SP; allgather: the full vector of the
    ep x etp group's tokens (t h each)."""
    M, h, k = 8192, MOE.d_model, MOE.top_k
    plan = ParallelPlan(dp=4, tp=2, ep=4, etp=2, sp=True)
    t = M / 2
    a2a = moe_step.dispatch_payloads(MOE, plan, M, "alltoall")
    assert a2a["all_to_all"] == pytest.approx(t * k * h * 2 * expert_imbalance(t * k, 4))
    assert a2a["etp_all_gather"] == pytest.approx(2 * t * k * h * 2)
    ag = moe_step.dispatch_payloads(MOE, plan, M, "allgather")
    assert ag == {"all_gather": pytest.approx(4 * 2 * t * h * 2)}
    # the gather moves ep etp / k times the rows: slower at ep x etp = 8 > k = 2
    s = {d: moe_step.dispatch_s(MOE, plan, M, H100, 0.8, 0.8, d) for d in
         moe_step.DISPATCHERS}
    assert s["allgather"] > s["alltoall"] > 0
    with pytest.raises(ValueError, match="dispatcher 'ring' is unknown"):
        moe_step.dispatch_payloads(MOE, plan, M, "ring")


def test_flex_dispatch_crosses_the_network_once_per_node():
    """DeepEP / HybridEP (``flex``): across nodes a token goes once to each node that
    holds any of its experts, not once per expert. Qwen3-235B (top 8 of 128) over ep 32
    on four H100 nodes: the expected remote nodes n (1 - C(E - E/n, k) / C(E, k)) minus
    the own one, over the remote experts k (n - 1) / n, by hand; k = 1 or one node: no
    change; inside a node flex prices as alltoall; the engine cell's word sets it. Its
    network leg runs at DeepEP's measured share of the NIC (FLEX_NET_EFF), whatever the
    fitted efficiency of NCCL's collectives."""
    from math import comb

    from paratrain.systems.row_engine import engine_as_said

    assert moe_step.node_dedup(128, 8, 4) == pytest.approx(
        4 * (1 - comb(96, 8) / comb(128, 8)) / 8)
    assert moe_step.node_dedup(128, 8, 4) == pytest.approx(0.4536, abs=1e-4)
    assert moe_step.node_dedup(64, 1, 4) == pytest.approx(1.0)
    assert moe_step.node_dedup(128, 8, 1) == 1.0
    m = as_shape(load_model("qwen3-235b-a22b"))
    M = 4096
    plan = ParallelPlan(dp=16, tp=2, pp=8, ep=32, etp=1, sp=True)
    pay = moe_step.dispatch_payloads(m, plan, M, "flex")["all_to_all"]
    assert pay == moe_step.dispatch_payloads(m, plan, M, "alltoall")["all_to_all"]
    g, p = 8, 32  # eight ep members per node (stride 1), four nodes
    off = pay * (p - g) / p / (H100.inter_bw * 0.8)
    on = pay * (g - 1) / p / (H100.intra_group_bw(g) * 0.8)
    assert off > on
    flex_off = pay * (p - g) / p / (H100.inter_bw * moe_step.FLEX_NET_EFF)
    want = {"alltoall": (p - 1) * H100.inter_alpha + off,
            "flex": (p - 1) * H100.inter_alpha + max(
                flex_off * moe_step.node_dedup(128, 8, 4), on)}
    for d, t in want.items():
        assert moe_step.dispatch_s(m, plan, M, H100, 0.8, 0.8, d) == pytest.approx(t), d
    assert moe_step.dispatch_s(m, plan, M, H100, 0.8, 0.5, "flex") == \
        moe_step.dispatch_s(m, plan, M, H100, 0.8, 0.8, "flex")
    inside = ParallelPlan(dp=4, tp=2, ep=8, etp=1, sp=True)
    assert moe_step.dispatch_s(m, inside, M, H100, 0.8, 0.8, "flex") == \
        moe_step.dispatch_s(m, inside, M, H100, 0.8, 0.8, "alltoall")
    assert engine_as_said("Megatron-Core, DeepEP").dispatcher == "flex"
    assert engine_as_said("NeMo, HybridEP").dispatcher == "flex"
    assert engine_as_said("NeMo").dispatcher == "alltoall"


def test_engines_dispatch_as_they_run():
    assert engine("megatron").dispatcher == "allgather"  # Megatron-LM's default
    assert {engine(n).dispatcher for n in ("nemo", "dualpipe", "torchtitan")} == {"alltoall"}


def test_layouts_follow_the_runtimes_fold():
    """The pricing's ep stride and edp are the runtime's fold (cost.ranks.Fold): every ep
    group it builds is evenly spaced by ep_stride, and edp copies hold each expert."""
    from paratrain.cost.ranks import Fold

    plans = [ParallelPlan(dp=4, tp=2, cp=2, ep=2),  # no SP: tp copies of a dp x cp fold
             ParallelPlan(dp=2, tp=2, cp=2, ep=8, etp=1, sp=True),
             ParallelPlan(dp=8, tp=4, cp=2, ep=8, etp=4, sp=True),
             ParallelPlan(dp=1, tp=4, ep=4)]  # priced only: ep needs the tp ranks
    for plan in plans:
        f = Fold.of(plan)
        group = [f.rank(0, 0, e, 0, 0) for e in range(plan.ep)]
        gaps = {b - a for a, b in zip(group[:-1], group[1:], strict=True)}
        assert gaps == {moe_layout.ep_stride(plan)}, plan
        edp = moe_layout.expert_data_ranks(plan)
        copies = [f.rank(0, i, 0, 0, 0) for i in range(edp)]
        assert {b - a for a, b in zip(copies[:-1], copies[1:], strict=True)} <= {
            moe_layout.edp_stride(plan)}, plan
        assert moe_layout.expert_data_ranks(plan) * plan.ep * plan.etp * (
            plan.tp // f.fold_tp) == plan.dp * plan.cp * plan.tp, plan
    assert [moe_layout.ep_stride(p) for p in plans] == [2, 1, 4, 1]
    assert [moe_layout.expert_data_ranks(p) for p in plans] == [4, 1, 2, 1]


def test_expert_gradients_reduce_across_nodes_when_ep_fills_the_node():
    """gpt-oss-120b on 64 B300s with ep 8 (Megatron-Bridge's 26.04 recipe): each expert's
    eight copies sit one per node (edp outermost in the fold), so its gradients' reduce-
    scatter and the weights' all-gather cross the network, not NVLink: the data-parallel
    sync costs what 14.3B expert parameters cost on the NICs."""
    from paratrain.cost.groups import per_node, strides
    from paratrain.cost.hardware import load_hardware
    from paratrain.systems.fitting import breakdown, load_params
    from paratrain.systems.runs import read_runs, row_to_case

    plan = ParallelPlan(dp=64, ep=8)
    assert moe_layout.edp_stride(plan) == 8 == strides(plan)["edp"]
    assert per_node(plan, "edp", load_hardware("b300"), 8) == 1
    row = next(r for r in read_runs() if r["id"] == "mb2604_gptoss_120b_b300_bf16_64")
    case, p = row_to_case(row), load_params()
    b = breakdown(case, p)
    expert_bytes = 2 * 2 * 14.3e9 * 7 / 8  # reduce-scatter + all-gather, 16-bit
    assert b.comm["dp"] > expert_bytes / (case.hw.inter_bw * p.net_eff)


def _row(**over) -> dict:
    row = {"id": "fold_test", "model_key": "mixtral-8x7b", "seq_len": "4096",
           "global_batch_seqs": "16", "accelerator": "H200-SXM-141GB", "num_accel": "8",
           "TP": "1", "PP": "1", "DP": "2", "CP": "4", "EP": "8", "microbatch": "1",
           "zero_or_fsdp": "distributed optimizer", "recompute": "none", "engine": "NeMo",
           "tokens_per_s_per_accel": "1000", "metric": "tokens", "source": "test",
           "confirmed": "yes", "split": "fit"}
    return {**row, **over}


def test_a_row_with_ep_not_dividing_dp_is_priced_with_its_all_to_all():
    """EP 8 over DP 2 x CP 4 (folded): priced as given, one all-to-all group of 8
    consecutive GPUs (one node), equal to the alpha-beta formula by hand."""
    case = row_to_case(_row())
    assert (case.plan.ep, case.plan.etp) == (8, 1)
    p = StepParams()
    bd = predict_step(case.model, case.plan, case.hw, case.tokens, case.seq_len, p, "nemo")
    m = case.model
    M = 4096 // 4  # one sequence a micro-batch, T / cp on this rank
    rows = M * m.top_k
    payload = rows * m.d_model * 2 * expert_imbalance(rows, 8)
    hw = case.hw  # an H200: Mixtral's states need more than an H100's 80 GB on 8 GPUs
    one = 7 * hw.intra_alpha + 7 / 8 * payload / (hw.intra_bw * p.nvlink_eff)
    per_mb = 4 * one * m.moe_layers / m.n_layers  # dispatch + combine, fwd + bwd
    assert bd.comm["ep"] > 0
    assert bd.comm["ep"] == pytest.approx(case.plan.micro_batches * bd.blocks * per_mb)
    # Megatron-Core's default expert TP: etp = tp unless the row says otherwise
    assert row_to_case(_row(TP="2", DP="1", EP="4")).plan.etp == 2
    assert row_to_case(_row(TP="2", DP="1", EP="8", ETP="1")).plan.etp == 1
    # EP 8 over DP 1 x CP 4 x TP 2 leaves no room for etp 2: folded over tp, etp 1
    assert row_to_case(_row(TP="2", DP="1", EP="8")).plan.etp == 1
    assert moe_layout.default_etp(dp=4, cp=1, tp=8, ep=8) == 4


def test_runtime_plans_price_as_before():
    """A runtime plan (ep | dp, etp 1, no SP) prices the experts whole on every tp rank:
    the same expert GEMMs at tp 1 and tp 2, and the same all-to-all bytes as M k h."""
    m = load_model("mixtral-8x7b")
    base = ParallelPlan(dp=8, ep=8, micro_batches=2)
    tp2 = ParallelPlan(dp=8, tp=2, ep=8, micro_batches=2)
    a = predict_step(m, base, H100, 16 * 4096, 4096, StepParams(), "nemo")
    b = predict_step(m, tp2, H100, 16 * 4096, 4096, StepParams(), "nemo")
    assert a.gemm["experts"] == pytest.approx(b.gemm["experts"])
    pay = moe_step.dispatch_payloads(m, tp2, 4096, "alltoall")["all_to_all"]
    assert pay == pytest.approx(4096 * 2 * m.d_model * 2 * expert_imbalance(4096 * 2, 8))


def test_an_all_to_all_across_nodes_leaves_through_the_ranks_own_nic():
    """EP 64 over 8 nodes (8 members a node): 56/64 of the payload over one NIC, 7/64
    over NVLink beside it, 63 latencies; inside one node, the pairwise exchange."""
    plan = ParallelPlan(dp=64, ep=64)
    n = 1e9
    s = moe_step.all_to_all_s(plan, n, H100, 0.8, 0.9)
    off, on = n * 56 / 64 / (H100.inter_bw * 0.9), n * 7 / 64 / (H100.intra_bw * 0.8)
    assert s == pytest.approx(63 * H100.inter_alpha + max(off, on))
    node = ParallelPlan(dp=8, ep=8)
    assert moe_step.all_to_all_s(node, n, H100, 0.8, 0.9) == pytest.approx(
        7 * H100.intra_alpha + n * 7 / 8 / (H100.intra_bw * 0.8))


def test_expert_parameters_split_over_ep_and_etp():
    """Routed experts per GPU: all of them / (ep etp); the router and shared experts
    over etp, the rest over tp."""
    from paratrain.cost.memory import params_per_gpu

    m = load_model("mixtral-8x7b")
    whole = params_per_gpu(m, ParallelPlan(dp=8, tp=2, ep=8))
    split = params_per_gpu(m, ParallelPlan(dp=8, tp=2, ep=8, etp=2))
    assert whole.expert == pytest.approx(m.routed_expert_params() / 8)
    assert split.expert == pytest.approx(m.routed_expert_params() / 16)
    router = m.moe_layers * m.d_model * m.experts
    assert whole.dense - split.dense == pytest.approx(router / 2)


def test_a_folded_plan_prices_in_both_models():
    """EP 8 over DP 4 x TP 2 (etp 1): the step model and the reference model price it,
    the experts' gradients reduced over their edp = 1 group (nothing to sync)."""
    from paratrain.systems.step_time import step_time

    m = load_model("mixtral-8x7b")
    plan = ParallelPlan(dp=4, tp=2, pp=8, ep=8, sp=True, micro_batches=8)
    assert moe_layout.expert_data_ranks(plan) == 1
    bd = predict_step(m, plan, H100, 256 * 4096, 4096, StepParams(), "nemo")
    assert bd.comm["ep"] > 0 and bd.step_s > 0
    assert step_time(m, plan, H100, 256 * 4096, 4096).step_s > 0


def test_a_padded_expert_capacity_computes_and_sends_every_slot():
    """Under a capacity factor C the busiest expert takes at most C x its mean load
    (tokens beyond are dropped); padded to capacity (Megatron-Core's
    moe_pad_expert_input_to_capacity, MaxText's dense MoE), every expert computes and
    every rank sends exactly C x the mean, empty slots included."""
    import dataclasses

    M, plan = 64, ParallelPlan(dp=4, ep=4)
    t, k, h = M, MOE.top_k, MOE.d_model
    spread = expert_imbalance(t * k, 4)
    assert spread > 1.1  # few rows: a balanced router's busiest rank is well above 1
    dropping = dataclasses.replace(MOE, capacity_factor=1.0)
    padded = dataclasses.replace(MOE, capacity_factor=1.25, pad_to_capacity=True)
    assert moe_step.expert_load(MOE, t * k, 4) == spread
    assert moe_step.expert_load(dropping, t * k, 4) == 1.0
    assert moe_step.expert_load(padded, t * k, 4) == 1.25
    assert moe_step.dispatch_payloads(padded, plan, M, "alltoall")["all_to_all"] == \
        t * k * h * 2.0 * 1.25
    rows = {}
    for name, m in (("dropless", MOE), ("padded", padded)):
        seen: list = []
        moe_step.moe_mlp(m, M, 1, False, 4, 1,
                         lambda c, N, K, r=M, n=1, out=seen: out.append((c, r)))
        rows[name] = [r for c, r in seen if c == "experts"][0]
    mean = M * k * 4 / MOE.experts
    assert rows["padded"] == round(mean * 1.25)
    assert rows["dropless"] == round(mean * expert_imbalance(mean, MOE.experts))
    with pytest.raises(ValueError, match="pad_to_capacity needs an expert capacity"):
        dataclasses.replace(MOE, pad_to_capacity=True)


def test_a_rows_expert_capacity_column_sets_the_models_capacity():
    """The runs table's ``expert_capacity``: empty = dropless, "1.25" drops beyond 1.25 x
    the mean, "1.25 padded" also pads; anything else is refused with its fix."""
    from paratrain.systems.row_fields import Skip

    assert row_to_case(_row()).model.capacity_factor == 0.0
    m = row_to_case(_row(expert_capacity="1.25 padded")).model
    assert (m.capacity_factor, m.pad_to_capacity) == (1.25, True)
    m = row_to_case(_row(expert_capacity="1.0")).model
    assert (m.capacity_factor, m.pad_to_capacity) == (1.0, False)
    for bad in ("big", "1.25 full", "0 padded"):
        with pytest.raises(Skip, match="expert_capacity .* is not a capacity"):
            row_to_case(_row(expert_capacity=bad))


def test_a_tpus_grouped_expert_matmuls_run_at_the_fitted_share():
    """On a TPU a dropless MoE's experts run as grouped matmuls (MaxText's megablox or
    tokamax gmm) at ``tpu_gmm_eff`` of the dense rate: halving it doubles the expert
    GEMMs' compute and nothing else; a GPU, and MaxText's capacity-padded MoE (dense
    einsums), do not read it."""
    import dataclasses

    from paratrain.systems.gemm import chip_of
    from paratrain.systems.layer_cost import block_cost

    def experts_s(hw_name, model, gmm):
        hw = load_hardware(hw_name)
        r = StepParams(tpu_gmm_eff=gmm).rates(hw.name)
        blk = block_cost(model, 4096, 4096, 1, 1, False, 1, hw, chip_of(hw.name), r, True)
        return blk.fwd["experts"], blk.fwd["qkv"]

    moe = load_model("deepseek-v3")
    (e1, q1), (e2, q2) = (experts_s("tpu-v5p", moe, g) for g in (1.0, 0.5))
    assert q2 == q1 and e2 > 1.9 * e1  # compute-bound: about twice (memory term unchanged)
    assert experts_s("h100", moe, 0.5) == experts_s("h100", moe, 1.0)
    padded = dataclasses.replace(moe, capacity_factor=1.25, pad_to_capacity=True)
    assert experts_s("tpu-v5p", padded, 0.5) == experts_s("tpu-v5p", padded, 1.0)
