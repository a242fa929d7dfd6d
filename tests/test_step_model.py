"""The step model (issue 13): GEMM shapes, engine-aware ZeRO-3 strong scaling, MoE, context
parallelism's bytes, an explanation that adds up, a search that does not contradict itself."""

from __future__ import annotations

import re

import pytest

from paratrain.cli import main
from paratrain.cost.cp_bytes import A2A_EXCHANGES, cp_bytes_per_sequence_layer
from paratrain.cost.hardware import load_hardware
from paratrain.cost.shapes import load_model
from paratrain.plan import ParallelPlan
from paratrain.systems import comm_time as ct
from paratrain.systems.explain import breakdown_rows, explain_lines
from paratrain.systems.fitting import load_params
from paratrain.systems.gemm import chip_of, depth, gemm_s, k_fixed, quantisation
from paratrain.systems.layer_cost import expert_imbalance
from paratrain.systems.search import search
from paratrain.systems.step_model import predict_step
from paratrain.systems.step_params import BOUNDS, StepParams

H100 = load_hardware("h100")


def test_tile_and_wave_quantisation_by_hand():
    h = chip_of("H100-SXM5-80GB")  # 128 x 256 tiles, 132 SMs
    assert (h.tile_m, h.tile_n, h.sms) == (128, 256, 132)
    assert quantisation(128 * 132, 256, h) == 1.0  # one full wave of whole tiles
    # one row too many: with 128 x 256 tiles a 133rd tile row starts a second, nearly empty
    # wave (q = 1/2); 64 x 64 tiles waste least: 265 x 4 tiles in 9 waves of 132
    q = quantisation(128 * 132 + 1, 256, h)
    assert q == pytest.approx((128 * 132 + 1) * 256 / (265 * 64 * 4 * 64) * 1060 / (9 * 132))
    # a thin GEMM is memory-bound: time = bytes / (HBM x eff), not FLOPs / peak
    t = gemm_s(16, 8192, 8192, H100, h, 0.8, 1.0)
    assert t == pytest.approx((16 * 8192 * 2 + 8192 * 8192) * 2 / H100.hbm_bw)
    assert chip_of("TPU-v4").sms == 1 and chip_of("A100-SXM4-40GB").generation == "a100"
    # depth: a tile's prologue and epilogue cost k_fixed reduction steps on a GPU (the
    # prologue plus the chip's machine balance), so a K = k_fixed GEMM runs at half the
    # rate of a very deep one; a TPU streams K
    M, kf = 128 * 132, k_fixed(h, H100)
    assert kf == pytest.approx(128 + H100.peak_flops / H100.hbm_bw)
    K = round(kf)
    deep, short = gemm_s(M, 256, 2**20, H100, h, 0.8, 1.0), gemm_s(M, 256, K, H100, h,
                                                                    0.8, 1.0)
    assert short == pytest.approx(2 * M * 256 * K / (H100.peak_flops * 0.8 * depth(K, kf)))
    assert deep == pytest.approx(2 * M * 256 * 2**20 / (H100.peak_flops * 0.8), rel=1e-3)
    assert k_fixed(chip_of("TPU-v4"), load_hardware("tpu-v4")) == 0.0
    assert depth(64, 0.0) == 1.0


def test_parameters_are_few_and_physical():
    p = load_params()
    # a100, h100, b200, b300, mi300x, mi355x and six TPU generations (five pinned by the
    # runs), four FlashAttention-2 figures, ten scalars (native attention on Hopper,
    # Blackwell and TPUs, FP8 GEMMs' efficiency, row-scaled FP8 GEMMs' and the TPU's
    # grouped matmuls' among them)
    assert p.count() <= 26
    for name, (lo, hi) in BOUNDS.items():
        vals = getattr(p, name)
        for v in (vals.values() if isinstance(vals, dict) else [vals]):
            assert lo <= v <= hi, name
    assert BOUNDS["kernel_s"][1] <= 20e-6 and all(
        hi <= 1.0 for k, (_, hi) in BOUNDS.items() if k != "kernel_s")
    assert 0 < p.overlap_tax <= 0.3  # NCCL's channels' share of the SMs, not fitted


@pytest.mark.parametrize("engine", ["deepspeed", "fsdp"])
def test_zero3_strong_scaling_loses_throughput(engine):
    """Fixed global batch: per-GPU compute shrinks with GPUs, the per-block gathers do not
    (and their ring latency grows), so throughput per GPU must fall, far more for
    DeepSpeed's small per-parameter gathers (latency-bound) than for FSDP's block-sized
    ones, which NCCL's ring keeps bandwidth-bound at 1024 ranks (it pays the network's
    latency only at node boundaries)."""
    m = load_model("llama2-70b") if engine == "fsdp" else load_model("llama2-13b")
    p = load_params()
    tokens, seq = 1024 * 4096, 4096
    tf = []
    for gpus in (128, 256, 512, 1024):
        plan = ParallelPlan(dp=gpus, zero=3, micro_batches=1024 // gpus, recompute="full")
        tf.append(predict_step(m, plan, H100, tokens, seq, p, engine).tflops_per_gpu)
    assert tf == sorted(tf, reverse=True)
    assert tf[-1] < (0.8 if engine == "deepspeed" else 0.97) * tf[0]


def test_moe_prices_active_flops_all_to_all_and_imbalance():
    m = load_model("mixtral-8x7b")
    p = StepParams()
    tokens, seq = 256 * 4096, 4096
    base = ParallelPlan(dp=64, tp=2, zero=1, sp=True, micro_batches=4)
    bd1 = predict_step(m, base, H100, tokens, seq, p)
    assert bd1.model_flops == pytest.approx(m.flops_per_token(seq) * tokens)
    assert m.active_params() < m.num_params() / 3  # active, not total, parameters
    assert bd1.comm["ep"] == 0 and "experts" in bd1.gemm and "router" in bd1.gemm
    bd8 = predict_step(m, base.replace(ep=8), H100, tokens, seq, p)
    assert bd8.comm["ep"] > 0 and bd8.exposed["ep"] == bd8.comm["ep"]  # megatron: blocking
    assert expert_imbalance(1e9, 8) == pytest.approx(1, abs=1e-3)
    assert expert_imbalance(64, 8) == pytest.approx(1 + (2 * 2.0794415 / 64) ** 0.5)


@pytest.mark.parametrize("algo", ["ring", "all-to-all"])
def test_context_parallel_time_uses_the_runtime_bytes(algo):
    m = load_model("llama3-8b")
    plan = ParallelPlan(dp=4, cp=2, cp_algorithm=algo)
    seq, mb = 8192, 2
    f, b = ct.cp_s(m, plan, seq, mb, H100, 0.8, 0.8)
    fb, bb = cp_bytes_per_sequence_layer(m.replace(context=seq), plan, 2)
    bw = H100.intra_bw * 0.8
    # a latency per ring hop (backward: out and home), or per peer of each of the
    # all-to-all's four exchanges (q, k, v, output) in each direction
    lat_f, lat_b = (1, 2) if algo == "ring" else (A2A_EXCHANGES, A2A_EXCHANGES)
    assert f == pytest.approx(lat_f * H100.intra_alpha + mb * fb / bw)
    assert b == pytest.approx(lat_b * H100.intra_alpha + mb * bb / bw)
    bd = predict_step(m, plan, H100, 32 * seq, seq, StepParams())
    assert bd.comm["cp"] > 0
    if algo == "all-to-all":  # nothing hides an all-to-all
        assert bd.exposed["cp"] == pytest.approx(bd.comm["cp"])


def _ms(text: str) -> float:
    return float(text.replace(",", "").split()[0]) / 1e3


def test_explanation_adds_up_to_the_step_it_prints(capsys):
    assert main(["plan", "--model", "llama3-70b", "--gpus", "64", "--tp", "8", "--pp", "2",
                 "--sp", "--micro-batches", "8", "--tokens", str(64 * 8192), "--context",
                 "8192", "--zero", "1", "--explain", "--json"]) == 0
    import json

    rep = json.loads(capsys.readouterr().out)
    lines, pred = rep["predicted"]["explain"], rep["predicted"]
    parts = [_ms(m.group(1)) for line in lines[1:-1]
             if (m := re.search(r"\s([\d,]+\.\d ms)\s", line))]
    total = _ms(re.search(r"([\d,]+\.\d ms)", lines[-1]).group(1))
    assert sum(parts) == pytest.approx(total, abs=1e-3 * len(parts))
    assert total == pytest.approx(pred["step_s"], abs=1e-4)
    assert f"MFU {100 * pred['mfu']:.1f}%" in lines[-1]


def test_breakdown_rows_sum_to_step_exactly():
    bd = predict_step(load_model("llama3-8b"), ParallelPlan(dp=8, tp=2, pp=2, sp=True,
                                                            micro_batches=8, zero=1),
                      H100, 64 * 8192, 8192, load_params(), "nemo")
    assert sum(s for _, s, _ in breakdown_rows(bd)) == pytest.approx(bd.step_s)
    assert "engine nemo" in explain_lines(bd)[0]


def test_search_picks_a_practical_layout_for_llama3_70b_on_256_h100():
    """Issue 13's contradiction: tp 1, pp 32, cp 8 with 512 micro-batches."""
    res = search(load_model("llama3-70b"), H100, 256, 2**21, 8192, top=3,
                 keep_points=False, params=load_params(), zero_stages=(1,),
                 recomputes=("selective",))  # one stage and recompute: the test's budget
    p = res.top[0].plan
    assert p.pp <= 8 and p.cp <= 4 and p.micro_batches <= 64 and p.tp * p.pp > 1
    from paratrain.systems.search import explain

    why = explain(res, load_model("llama3-70b"), H100)
    sync = next(line for line in why if "gradient" in line)
    if p.dp * p.cp > 1:
        assert f"over {p.dp * p.cp} ranks" in sync
        assert f"{res.top[0].time.dp_comm_s:.3g} s" in sync
    else:
        assert "no gradient sync" in sync


def _published_layouts():
    """One published run per (engine, accelerator, pipelined or not) on at most 256 GPUs,
    the smallest: the test's time budget; benchmarks/search.py --self-check runs every row."""
    from paratrain.systems.runs import cases_and_skips, read_runs

    cases, _ = cases_and_skips(read_runs())
    pick: dict = {}
    for c in sorted(cases, key=lambda c: c.plan.world_size):
        key = (getattr(c, "engine", ""), c.hw.name, c.plan.pp > 1)
        if c.plan.world_size <= 256:
            pick.setdefault(key, c)
    return list(pick.values())


def test_search_self_check_on_published_runs():
    """The search's best layout is predicted no slower than each published layout it could
    have chosen (a valid plan, power-of-two tp, that fits in memory): same model, engine
    (with the options its row's engine cell sets, e.g. torch.compile), parameters, ZeRO
    stage and recomputation."""
    from paratrain.cost.memory import memory
    from paratrain.systems.row_engine import case_attention, case_engine

    p = load_params()
    checked = 0
    for c in _published_layouts():
        tp = c.plan.tp
        if tp & (tp - 1) or not memory(c.model, c.plan, c.hw, c.tokens, c.seq_len,
                                       attention="flash").fits:
            continue
        eng = case_engine(c)
        pub = predict_step(c.model, c.plan, c.hw, c.tokens, c.seq_len, p, eng,
                           case_attention(c)).step_s
        res = search(c.model, c.hw, c.plan.world_size, c.tokens, c.seq_len, top=1,
                     keep_points=False, params=p, engine=eng, attention="flash",
                     zero_stages=(c.plan.zero,), recomputes=(c.plan.recompute,))
        assert res.top[0].step_s <= pub * (1 + 1e-9), c.id
        checked += 1
    assert checked >= 8


def test_validate_explain_prints_one_rows_breakdown(capsys):
    assert main(["validate", "--explain", "dgxc_gpt3_175b_128"]) == 0
    out = capsys.readouterr().out
    for part in ("GEMM mlp", "memory-bound work", "pipeline bubble",
                 "tensor parallel (exposed)", "reported: tflops 532.6 TFLOP/s"):
        assert part in out, part
    assert main(["validate", "--explain", "no_such_row"]) == 2
    assert "no_such_row" in capsys.readouterr().err
    # an untied model's MFU is predicted in the source's count, and the line says so
    assert main(["validate", "--explain", "llama3_405b_8192_seq8192"]) == 0
    assert "in the source's FLOP count (matmul" in capsys.readouterr().out


def test_deepspeed_pipeline_sends_whole_activations_from_every_tp_rank():
    plan = ParallelPlan(tp=8, pp=4, dp=2, micro_batches=8)
    act, p = 64e6, load_params()
    split = ct.pp_send_s(plan, act, H100, p.nvlink_eff, p.net_eff, p.kernel_s)
    whole = ct.pp_send_s(plan, act, H100, p.nvlink_eff, p.net_eff, p.kernel_s, split=False)
    fixed = split - act / 8 / (H100.inter_bw * p.net_eff)
    assert whole - fixed == pytest.approx(8 * (split - fixed))
    m = load_model("gpt3-175b")
    t = {e: predict_step(m, plan, H100, 16 * 2048, 2048, p, e).comm["pp"]
         for e in ("megatron", "deepspeed")}
    assert t["deepspeed"] > 5 * t["megatron"]


def test_zero3_under_a_pipeline_syncs_once_a_step():
    """Under a pipeline a ZeRO-3 stage gathers its weights once a step and reduces its
    gradients once, after the last backward (the runtime's deferred FSDP, PyTorch's
    pipelining; the planner counts the stage held whole, ``cost.memory.zero3_buffers``):
    its sync does not grow with the micro-batches and is ZeRO-1's; without a pipeline
    it gathers and reduces every micro-batch."""
    m, p = load_model("llama2-13b"), load_params()

    def dp(zero: int, pp: int, mb: int) -> float:
        plan = ParallelPlan(dp=16 // pp, pp=pp, zero=zero, micro_batches=mb)
        return predict_step(m, plan, H100, plan.dp * mb * 4096, 4096, p, "fsdp").comm["dp"]

    assert dp(3, 2, 16) == pytest.approx(dp(3, 2, 4), rel=1e-12)
    assert dp(3, 2, 4) == pytest.approx(dp(1, 2, 4), rel=1e-12)
    assert dp(3, 1, 16) / dp(3, 1, 4) == pytest.approx(4, rel=0.1)


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_an_engine_that_reduces_in_fp32_moves_twice_the_gradient_bytes(zero):
    """torchtitan reduces gradients in float32 (its ``mixed_precision_reduce``, which
    admits no other value) while gathering bf16 weights: its reductions carry 4 bytes a
    parameter, the gathers 2 (``overlap.Engine.reduce_bytes``)."""
    import dataclasses

    from paratrain.systems.overlap import ENGINES

    m, p = load_model("llama3-8b"), load_params()
    titan = ENGINES["torchtitan"]
    assert titan.reduce_bytes == 4.0 and ENGINES["megatron"].reduce_bytes == 2.0
    half = dataclasses.replace(titan, reduce_bytes=2.0)
    plan = ParallelPlan(dp=8, zero=zero, micro_batches=2, bucket_mb=1e4)
    dp = {e.reduce_bytes: predict_step(m, plan, H100, 8 * 2 * 8192, 8192, p, e).comm["dp"]
          for e in (titan, half)}
    # ZeRO-3: per block and micro-batch, gathers for forward and backward and one
    # reduce-scatter (2 + 2 against 2 + 1); ZeRO-2: two reduce-scatters and a gather
    # (4 + 1 against 2 + 1); DDP: the all-reduce alone
    ratio = {3: 4 / 3, 2: 5 / 3, 0: 2.0}[zero]
    assert dp[4.0] / dp[2.0] == pytest.approx(ratio, rel=0.02)


def test_loss_reads_and_writes_every_logit_as_the_unfused_chain_does():
    from paratrain.systems.gemm import train_gemm_s
    from paratrain.systems.layer_cost import LOSS_BYTES_PER_LOGIT, Rates, head_cost

    m, p = load_model("llama3-8b"), load_params()
    r = Rates(p.gemm_for("h100"), 0.5, p.hbm_eff, p.kernel_s)
    chip = chip_of(H100.name)
    f, b = head_cost(m, 8192, 1, H100, chip, r)
    gemm = sum(train_gemm_s(8192, m.vocab_size, m.d_model, H100, chip, r.gemm_eff, r.hbm_eff))
    loss = LOSS_BYTES_PER_LOGIT * 8192 * m.vocab_size / (H100.hbm_bw * p.hbm_eff)
    assert f + b == pytest.approx(gemm + loss + 4 * r.kernel_s)
    # cast (2 + 4), max, subtract, exp, sum, divide; backward scale and cast back
    assert LOSS_BYTES_PER_LOGIT == 6 + 4 + 8 + 8 + 4 + 8 + 8 + 6


def test_experts_split_over_tp_only_where_the_plan_says_so():
    """The plan's etp lays the experts out, not the model's shape: etp 1 (paratrain's
    runtime keeps the MoE MLP whole on every tp rank) prices the same expert GEMMs at tp 1
    and tp 2; etp = tp (Megatron-Core's default) splits them over tp."""
    from paratrain.config import ModelConfig
    from paratrain.cost.shapes import as_shape
    from paratrain.systems.layer_cost import Rates, block_cost

    p = load_params()
    r = Rates(p.gemm_for("h100"), 0.5, p.hbm_eff, p.kernel_s)
    chip = chip_of(H100.name)
    run = as_shape(ModelConfig(d_model=1024, n_heads=8, d_ff=4096, experts=8, top_k=2,
                               shared_experts=1, context=2048))

    def experts_s(tp, etp):
        c = block_cost(run, 8192, 2048, tp, 1, False, 1, H100, chip, r, True, etp=etp)
        return c.fwd["experts"] + c.bwd["experts"]

    assert experts_s(2, 1) == pytest.approx(experts_s(1, 1))
    assert experts_s(2, 2) < 0.6 * experts_s(1, 1)


def test_narrow_heads_run_flash_attention_at_the_rate_published_kernels_reach():
    """A score costs its softmax work whatever the head's width: at 64-wide heads the
    FlashAttention-3 paper's H100 forward figures (16K tokens) are 413 of 595 TF/s for
    cuDNN's kernel and 324 of 370 for FlashAttention-2's, and the model's rate at 64 over
    128 reproduces both; wider heads run no faster; a block's attention at 64-wide heads
    costs that much more time per FLOP than at 128-wide ones."""
    from paratrain.config import ModelConfig
    from paratrain.cost.shapes import as_shape
    from paratrain.systems.layer_cost import Rates, block_cost, head_dim_rate
    from paratrain.systems.step_params import FA2_HEAD_DIMS, NATIVE_HEAD_DIMS

    assert head_dim_rate(64, NATIVE_HEAD_DIMS) == pytest.approx(413 / 595, rel=0.01)
    assert head_dim_rate(64, FA2_HEAD_DIMS) == pytest.approx(324 / 370, rel=0.01)
    assert head_dim_rate(128, NATIVE_HEAD_DIMS) == head_dim_rate(256, NATIVE_HEAD_DIMS) == 1
    p = load_params()
    r = Rates(p.gemm_for("h100"), 0.5, p.hbm_eff, p.kernel_s, attn_head_dims=NATIVE_HEAD_DIMS)
    chip = chip_of(H100.name)

    def attention_s(heads):  # the same d_model, so the same attention FLOPs
        run = as_shape(ModelConfig(d_model=2048, n_heads=heads, d_ff=4096, context=4096))
        c = block_cost(run, 8192, 4096, 1, 1, False, 1, H100, chip, r, moe=False,
                       attention="flash3")
        return c.fwd["attention"] + c.bwd["attention"]

    assert attention_s(32) / attention_s(16) == pytest.approx(
        1 / head_dim_rate(64, NATIVE_HEAD_DIMS))


def test_xla_full_recompute_skips_the_gemms_whose_outputs_backward_never_reads():
    """Full recomputation under XLA's remat reruns only what the backward reads: not the
    attention output projection, not the MLP's down projection (one of SwiGLU's three
    equal matrices); Megatron's checkpointing reruns the whole forward. Forward : backward
    GEMM time is 1 : 2, so XLA's out costs 3/4 of Megatron's, its MLP 11/12, the rest
    the same."""
    from dataclasses import replace

    from paratrain.systems.overlap import engine
    from paratrain.systems.step_model import full_rerun_share

    assert full_rerun_share("out", 2, True) == 0.0
    assert full_rerun_share("mlp", 2, True) == pytest.approx(2 / 3)  # SwiGLU: gate, up
    assert full_rerun_share("experts", 1, True) == 0.5  # GELU: up
    assert {full_rerun_share(c, 2, False) for c in ("qkv", "out", "mlp")} == {1.0}
    m, hw = load_model("llama2-13b"), load_hardware("tpu-v5p")
    assert m.mlp_up_matrices == 2
    plan = ParallelPlan(dp=64, zero=3, recompute="full")
    xla = engine("xla")
    assert xla.dead_tail and not engine("megatron").dead_tail
    g = {tail: predict_step(m, plan, hw, 64 * 4096, 4096, load_params(),
                            replace(xla, dead_tail=tail)).gemm for tail in (True, False)}
    assert g[True]["out"] == pytest.approx(0.75 * g[False]["out"], rel=1e-9)
    assert g[True]["mlp"] == pytest.approx(11 / 12 * g[False]["mlp"], rel=1e-9)
    assert g[True]["qkv"] == pytest.approx(g[False]["qkv"], rel=1e-12)


def test_each_tpu_generation_has_its_own_gemm_efficiency():
    """TPU v4, v5e and v5p are fitted apart, as GPU generations are; the variants of one
    GPU die still share theirs."""
    from paratrain.systems.gemm import family

    assert [family(n) for n in ("TPU v4", "TPU-v5e", "tpu v5p")] == [
        "tpu-v4", "tpu-v5e", "tpu-v5p"]
    assert family("H200") == family("H100-SXM5-80GB")
    p = load_params()
    assert {"tpu-v4", "tpu-v5e", "tpu-v5p"} <= set(p.gemm_eff) and "tpu" not in p.gemm_eff


def test_deepspeed_bf16_accumulates_every_micro_batchs_gradients_in_fp32():
    """DeepSpeed's BF16 optimizer (ZeRO 0/1) adds each micro-batch's bf16 gradients into
    an fp32 copy of every local parameter's gradient: 20 bytes of HBM traffic per
    parameter per micro-batch, on the stage's critical path (so in the bubble too).
    Megatron accumulates inside the weight-gradient GEMM; ZeRO 2/3 into the shard."""
    from dataclasses import replace

    from paratrain.systems.overlap import engine
    from paratrain.systems.step_model import _params_per_gpu

    m, p = load_model("gpt3-175b"), load_params()
    ds = engine("deepspeed")
    assert ds.hp_grad_bytes == 20.0 and engine("megatron").hp_grad_bytes == 0.0
    # an fp16 run has no BF16 optimizer, so no fp32 copies to add into
    from types import SimpleNamespace

    from paratrain.systems.row_engine import case_engine
    assert case_engine(SimpleNamespace(engine="deepspeed", precision="bf16")) == ds
    assert case_engine(SimpleNamespace(engine="deepspeed",
                                       precision="fp16 mixed")).hp_grad_bytes == 0.0
    for zero, priced in ((0, True), (1, True), (2, False), (3, False)):
        plan = ParallelPlan(tp=8, pp=4, dp=2, zero=zero, micro_batches=16)
        with_, without = (predict_step(m, plan, H100, 32 * 2048, 2048, p, e)
                          for e in (ds, replace(ds, hp_grad_bytes=0.0)))
        per_mb = (_params_per_gpu(m, 8, 4, 1).total * 20.0 / (H100.hbm_bw * p.hbm_eff)
                  if priced else 0.0)
        assert with_.accum_s == pytest.approx(16 * per_mb, abs=1e-12)
        assert with_.memory_s == without.memory_s and without.accum_s == 0.0
        assert with_.bubble_s - without.bubble_s == pytest.approx(3 * per_mb, abs=1e-12)


def test_overlap_hides_at_most_the_compute_it_runs_under():
    """An engine that overlaps all of the expert dispatch (DualPipe) still shows what
    exceeds the block's compute: on a slow network the exposed share is the excess."""
    from dataclasses import replace

    from paratrain.systems.step_model import _overlapped

    assert _overlapped(5.0, 1.0, 3.0) == 2.0 and _overlapped(5.0, 0.5, 10.0) == 2.5
    m, p = load_model("mixtral-8x7b"), load_params()
    plan = ParallelPlan(dp=64, ep=8, zero=1, micro_batches=4)
    fast = predict_step(m, plan, H100, 256 * 4096, 4096, p, "dualpipe")
    assert fast.comm["ep"] > 0 and fast.exposed["ep"] == 0.0
    slow_net = replace(H100, intra_bw=H100.intra_bw / 200, inter_bw=H100.inter_bw / 200)
    slow = predict_step(m, plan, slow_net, 256 * 4096, 4096, p, "dualpipe")
    compute = slow.compute_s - slow.head_s  # the blocks' compute on the busiest rank
    assert slow.exposed["ep"] == pytest.approx(slow.comm["ep"] - compute, rel=1e-6)
