"""Multi-token prediction (DeepSeek-V3's MTP depth) and multi-head latent attention's
compressed query, as the step model prices them."""

from __future__ import annotations

import dataclasses

import pytest

from paratrain.cost.hardware import load_hardware
from paratrain.cost.shapes import load_model
from paratrain.cost.stages import rank_blocks, stage_costs
from paratrain.plan import ParallelPlan
from paratrain.systems.fitting import load_params
from paratrain.systems.gemm import chip_of
from paratrain.systems.layer_cost import block_cost, train_gemm_s
from paratrain.systems.runs import row_to_case
from paratrain.systems.step_model import predict_step
from paratrain.systems.step_params import StepParams

H100 = load_hardware("h100")
DSV3 = load_model("deepseek-v3")


def test_deepseek_v3_trains_one_mtp_depth_outside_its_counts():
    """The catalogue's DeepSeek-V3 has one MTP depth (config.json); its parameter and
    FLOP counts stay the 671B model's; the depth's FLOPs are a block, the 2d x d
    projection and another output layer."""
    assert DSV3.mtp_layers == 1
    none = dataclasses.replace(DSV3, mtp_layers=0)
    assert DSV3.num_params() == none.num_params()
    assert DSV3.flops_per_token(4096) == none.flops_per_token(4096)
    d = DSV3.d_model
    assert DSV3.mtp_flops_per_token(4096) == pytest.approx(
        DSV3.block_flops_per_token(None, 4096) + 6 * 2 * d * d + 6 * DSV3.vocab_size * d)
    assert none.mtp_flops_per_token(4096) == 0.0
    with pytest.raises(ValueError, match="mtp_layers=-1"):
        dataclasses.replace(DSV3, mtp_layers=-1)


def test_an_mtp_depth_is_one_more_block_a_projection_and_a_head_on_the_last_stage():
    """pp 1: the rank runs L + 1 blocks, and its head time is two output layers and
    losses plus the projection's GEMMs, per micro-batch; every per-block part grows by
    (L + 1) / L."""
    m1 = dataclasses.replace(load_model("llama3-8b"), mtp_layers=1)
    m0 = dataclasses.replace(m1, mtp_layers=0)
    plan = ParallelPlan(dp=8, micro_batches=2)
    b0 = predict_step(m0, plan, H100, 8 * 2 * 8192, 8192, StepParams())
    b1 = predict_step(m1, plan, H100, 8 * 2 * 8192, 8192, StepParams())
    L = m0.n_layers
    assert (b0.blocks, b1.blocks, b1.mtp_blocks) == (L, L + 1, 1)
    assert b1.memory_s == pytest.approx(b0.memory_s * (L + 1) / L)
    sp = StepParams()
    rates = sp.rates("h100", "flash", H100.peak_flops)
    pf, pb = train_gemm_s(8192, m1.d_model, 2 * m1.d_model, H100, chip_of(H100.name),
                          rates.gemm_eff, rates.hbm_eff)
    assert b1.head_s == pytest.approx(2 * b0.head_s + 2 * (pf + pb))


def test_the_pipeline_split_moves_blocks_off_the_stage_that_holds_the_mtp_depth():
    """As Megatron-Bridge's DeepSeek-V3 layouts do (the last of 16 virtual stages: one
    decoder layer and the MTP depth), the split weighs the depth with the head."""
    none = dataclasses.replace(DSV3, mtp_layers=0)
    block, _, head = stage_costs(DSV3, 4096)
    assert head == pytest.approx(stage_costs(none, 4096)[2] + DSV3.mtp_flops_per_token(4096))
    with_mtp = rank_blocks(61, 4, 4, block, head)
    without = rank_blocks(61, 4, 4, block, stage_costs(none, 4096)[2])
    assert sum(with_mtp) == sum(without) == 61
    assert with_mtp[-1] < without[-1]
    # Megatron-Bridge's DeepSeek-V3 recipe (recipes/deepseek/deepseek_v3.py, its
    # map_pp_vp_to_layout at the 25.09 release): decoder layers per pipeline rank
    bridge = {(4, 1): (16, 16, 16, 13), (8, 1): (8,) * 7 + (5,), (16, 1): (4,) * 15 + (1,),
              (4, 2): (16, 16, 16, 13), (8, 2): (8,) * 7 + (5,), (4, 4): (16, 16, 16, 13)}
    for (pp, v), ranks in bridge.items():
        assert rank_blocks(61, pp, v, block, head) == ranks, (pp, v)


def test_a_rows_mtp_column_overrides_the_catalogue_and_a_blank_is_listed():
    row = {"id": "mtp_test", "model_key": "deepseek-v3", "seq_len": "4096",
           "global_batch_seqs": "4096", "accelerator": "H100-SXM5-80GB",
           "num_accel": "1024", "TP": "2", "PP": "8", "DP": "64", "EP": "64",
           "vpp": "4", "microbatch": "1", "zero_or_fsdp": "distributed optimizer",
           "recompute": "none", "engine": "NeMo", "tokens_per_s_per_accel": "1000",
           "metric": "tokens", "source": "test", "confirmed": "yes", "split": "fit"}
    case = row_to_case(row)
    assert case.model.mtp_layers == 1
    assert any(d[0] == "mtp_layers" for d in case.defaults)
    case = row_to_case({**row, "mtp_layers": "0"})
    assert case.model.mtp_layers == 0
    assert not any(d[0] == "mtp_layers" for d in case.defaults)


def test_mla_prices_the_query_through_its_compression():
    """DeepSeek-V3's query goes d -> q_lora_rank -> heads x (nope + rope): the qkv GEMMs
    a block prices are exactly those of the compressed path (48.7M weights), not of a
    full-rank d x heads x 192 projection (176M)."""
    M, chip = 4096, chip_of(H100.name)
    rates = StepParams().rates("h100", "flash", H100.peak_flops)
    cost = block_cost(DSV3, M, 4096, 1, 1, False, 1, H100, chip, rates, moe=False)
    d, H, qk = DSV3.d_model, DSV3.n_heads, DSV3.qk_nope_dim + DSV3.qk_rope_dim
    shapes = [(DSV3.q_lora_rank, d), (H * qk, DSV3.q_lora_rank),
              (DSV3.kv_lora_rank + DSV3.qk_rope_dim, d),
              (H * (DSV3.qk_nope_dim + DSV3.v_head_dim), DSV3.kv_lora_rank)]
    want = [train_gemm_s(M, N, K, H100, chip, rates.gemm_eff, rates.hbm_eff)
            for N, K in shapes]
    assert cost.fwd["qkv"] == pytest.approx(sum(f for f, _ in want))
    assert cost.bwd["qkv"] == pytest.approx(sum(b for _, b in want))
    full_rank = dataclasses.replace(DSV3, q_lora_rank=0)
    assert block_cost(full_rank, M, 4096, 1, 1, False, 1, H100, chip, rates,
                      moe=False).fwd["qkv"] > 2 * cost.fwd["qkv"]


def test_the_busiest_rank_counts_each_blocks_exposed_communication():
    """DeepSeek-V3 at pp 16 on H100 with ep 64 across nodes: the last rank holds one
    decoder block and the MTP depth beside two output layers, the others four blocks,
    each waiting on its exposed expert all-to-alls. Compared by compute alone the last
    rank looked the busiest; with each block's exposed communication a four-block rank
    is, and the step is priced on it."""
    from paratrain.systems.layer_cost import head_cost

    plan = ParallelPlan(dp=64, pp=16, ep=64, micro_batches=32)
    params = load_params()
    b = predict_step(DSV3, plan, H100, 64 * 32 * 4096, 4096, params, "nemo")
    assert (b.blocks, b.head_s, b.mtp_blocks) == (4, 0.0, 0)
    per_block = (sum(b.gemm.values()) + b.memory_s + b.overhead_s
                 + sum(b.exposed[a] for a in ("tp", "cp", "ep"))) / (b.micro_batches * 4)
    rates = params.rates("h100", "flash3", H100.peak_flops)
    hf, hb = head_cost(DSV3, 4096, 1, H100, chip_of(H100.name),
                       dataclasses.replace(rates, kernel_s=params.kernel_s))
    assert 4 * per_block > 2 * per_block + hf + hb
