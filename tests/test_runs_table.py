"""The shipped runs table (data/calibration.csv) and the model catalogue it leans on:
enough public rows, each with its source; every row priced or skipped with a reason;
catalogue models resolve empty shape columns; a held-out split that follows its rule;
MoE totals that match the published ones. Pure Python, no torch (docs/runs.md)."""

from __future__ import annotations

import dataclasses

import pytest

from paratrain.cost.shapes import load_model
from paratrain.systems.fitting import load_params, predict
from paratrain.systems.row_shape import SHAPE_COLUMNS
from paratrain.systems.runs import (
    SPLITS,
    Skip,
    _catalogue_model,
    cases_and_skips,
    heldout_ids,
    read_runs,
    row_shape,
    row_to_case,
)

ROWS = read_runs()
BY_ID = {r["id"]: r for r in ROWS}


def _family(accelerator: str) -> str:
    a = accelerator.lower()
    return next((f for f in ("a100", "h100", "h800", "tpu", "ampere") if f in a), a)


def test_table_is_wide_and_every_row_names_its_source():
    assert len(ROWS) >= 80 and len(BY_ID) == len(ROWS)
    for r in ROWS:
        for col in ("source", "source_location", "engine", "confirmed", "split"):
            assert (r[col] or "").strip(), f"{r['id']}: empty {col}"
        assert r["confirmed"] in ("yes", "no"), r["id"]
    scored = [r for r in ROWS if r["confirmed"] == "yes"]
    assert len(scored) >= 80
    assert {_family(r["accelerator"]) for r in scored} >= {"a100", "h100", "tpu"}
    engines = " ".join(r["engine"] for r in scored).lower()
    for e in ("megatron", "deepspeed", "fsdp", "torchtitan", "nemo", "mosaicml", "megascale",
              "maxtext"):
        assert e in engines, e
    assert any(r["experts"] for r in scored) and any(not r["experts"] for r in scored)


def test_every_row_is_priced_or_says_why_and_catalogued_models_are_never_shapeless():
    cases, skips = cases_and_skips(ROWS)
    assert len(cases) + len(skips) == len(ROWS)
    assert all(s.skipped_reason for s in skips)
    # rows kept for reference are skipped, and no confirmed row is refused: every one fits
    # its HBM in the least an engine runs it in (systems.row_memory.least_bytes; GLM-130B,
    # its sharding "not recorded", so ZeRO-0, is 34.8 GB of a 40 GB A100 with bf16
    # moments, and MaxText's TPU v6e rows fit with their offloaded layer inputs)
    refused = {s.id for s in skips if s.skipped_reason.startswith("needs ")}
    assert refused == set()
    assert {s.id for s in skips} - refused == {r["id"] for r in ROWS if r["confirmed"] == "no"}
    assert all(s.skipped_reason.startswith("confirmed=no") for s in skips if s.id not in refused)
    for r in ROWS:
        if _catalogue_model(r) is None:
            continue
        blank = {**r, "confirmed": "yes", "layers": "", "hidden": "", "heads": ""}
        if _catalogue_model(r, within=False) is None:  # named inside free text: a variant
            blank |= {c: "" for c in SHAPE_COLUMNS}  # ("GPT3-2.7B, 20 heads of 128")
        try:
            row_to_case(blank)
        except Skip as e:  # or its words found a model of another size: "GPT3-1.3B"
            assert "shape" not in str(e) or "stated size" in str(e), (r["id"], str(e))


def test_empty_shape_columns_come_from_the_catalogue_and_filled_ones_override_it():
    row = dict(BY_ID["dgxc_llama31_70b_64"])
    assert not row["layers"] and row["model_key"] == "llama3.1-70b"
    case = row_to_case(row)
    want = dataclasses.replace(load_model("llama3.1-70b"), context=8192)
    assert case.model == want and case.model.num_params() == 70_553_706_496
    by_name = row_to_case({**row, "model_key": "", "model": "Llama 3.1 70B (NeMo)"})
    assert by_name.model == want
    truncated = row_to_case(BY_ID["dgxc_llama31_405b_32"])
    assert truncated.model.n_layers == 7 and truncated.model.d_model == 16384
    with pytest.raises(Skip, match="not in the model catalogue"):
        row_to_case({**row, "model_key": "", "model": "an uncatalogued model"})
    with pytest.raises(Skip, match="model_key 'nope'"):
        row_to_case({**row, "model_key": "nope"})


def test_moe_rows_are_priced_as_moe_and_columns_override():
    grok = row_to_case(BY_ID["dgxc_grok1_512"]).model
    assert grok.is_moe and grok.experts == 8 and grok.top_k == 2
    assert grok.active_params() < 0.3 * grok.num_params()
    ds = row_to_case(BY_ID["deepseek_v3_pretrain_2048"])
    assert ds.model.moe_layers == 58 and ds.plan.ep == 64
    row = {**BY_ID["dgxc_llama31_8b_8"], "experts": "8", "top_k": "2", "moe_ffn_hidden": "1024",
           "moe_layers": "16"}
    m = row_to_case(row).model
    assert (m.experts, m.top_k, m.expert_ffn, m.moe_layers) == (8, 2, 1024, 16)


def test_latent_attention_and_interleaved_moe_come_from_shape_columns():
    """A run of an uncatalogued MLA model is given by its columns: DeepSeek-V3 written
    out column by column prices exactly as its catalogue entry; ``moe_every`` puts an MoE
    MLP in every k-th block (Llama 4 Maverick: every second of 48) and ``moe_layers``
    must then count them; MLA without its head dims is refused by name."""
    ds = BY_ID["deepseek_v3_pretrain_2048"]
    cat = row_to_case(ds)
    shape = {"model_key": "", "model": "a DeepSeek-V3-shaped model", "layers": "61",
             "hidden": "7168", "heads": "128", "ffn_hidden": "18432", "vocab": "129280",
             "mlp": "swiglu", "tied": "no", "q_lora_rank": "1536", "kv_lora_rank": "512",
             "qk_nope_dim": "128", "qk_rope_dim": "64", "v_head_dim": "128"}
    by_cols = row_to_case({**ds, **shape})
    assert by_cols.model.is_mla and by_cols.model.num_params() == cat.model.num_params()
    assert by_cols.model.flops_per_token(4096) == cat.model.flops_per_token(4096)
    assert predict(by_cols) == pytest.approx(predict(cat), rel=1e-12)
    no_mla = row_to_case({**ds, **shape, "kv_lora_rank": "", "q_lora_rank": ""})
    assert not no_mla.model.is_mla and no_mla.model.num_params() != cat.model.num_params()
    with pytest.raises(Skip, match="qk_nope_dim, qk_rope_dim and v_head_dim"):
        row_to_case({**ds, **shape, "v_head_dim": ""})
    maverick = {**BY_ID["dgxc_llama31_8b_8"], "model_key": "", "model": "interleaved MoE",
                "layers": "48", "hidden": "5120", "heads": "40", "kv_heads": "8",
                "ffn_hidden": "16384", "vocab": "202048", "experts": "128", "top_k": "1",
                "moe_ffn_hidden": "8192", "shared_experts": "1", "moe_every": "2"}
    m = row_shape({**maverick, "moe_layers": "24"}, 8192)
    assert m.moe_layers == 24 and [m.is_moe_layer(i) for i in range(4)] == [False, True] * 2
    assert row_shape(maverick, 8192) == m
    with pytest.raises(Skip, match="moe_layers 48 disagrees"):
        row_shape({**maverick, "moe_layers": "48"}, 8192)


def test_local_attention_prices_the_keys_a_query_sees():
    """Sliding and chunked windows, in every block or all but every k-th: the mean keys a
    query attends to (the whole causal context: seq / 2), which the step model's
    attention time follows; the columns of a runs row set them, an unknown kind is
    refused by name."""
    from paratrain.cost.hardware import load_hardware
    from paratrain.systems.gemm import chip_of
    from paratrain.systems.layer_cost import Rates, block_cost

    full = load_model("llama3.1-8b")
    assert full.attended_keys(8192) == 4096
    sliding = dataclasses.replace(full, local_window=4096)
    assert sliding.attended_keys(4096) == 2048  # the window covers the sequence
    assert sliding.attended_keys(8192) == 4096 - 4096**2 / (2 * 8192)  # 3072
    alternate = dataclasses.replace(sliding, global_every=2)
    assert [alternate.is_local_layer(i) for i in range(4)] == [True, False, True, False]
    assert alternate.attended_keys(8192) == (3072 + 4096) / 2
    chunked = dataclasses.replace(full, local_window=1000, local_kind="chunked")
    assert chunked.attended_keys(8192) == (8 * 1000**2 / 2 + 192**2 / 2) / 8192
    assert load_model("gpt-oss-120b").attended_keys(4096) == (128 - 128**2 / 8192 + 2048) / 2
    hw = load_hardware("h100")
    r = Rates(gemm_eff=0.7, attn_eff=0.5, hbm_eff=0.7, kernel_s=1e-5)

    def attn(m):
        return block_cost(m, 8192, 8192, 1, 1, False, 1, hw, chip_of(hw.name), r,
                          False).fwd["attention"]

    assert attn(alternate) / attn(full) == pytest.approx(alternate.attended_keys(8192) / 4096)
    row = {**BY_ID["dgxc_llama31_8b_8"], "local_window": "4096", "global_every": "2"}
    assert row_shape(row, 8192).attended_keys(8192) == alternate.attended_keys(8192)
    assert row_shape({**row, "local_kind": "Chunked"}, 8192).local_kind == "chunked"
    with pytest.raises(Skip, match="local_kind='tiled' is unknown"):
        row_shape({**row, "local_kind": "tiled"}, 8192)


def test_tokens_per_second_rows_are_priced_as_model_tflops():
    row = BY_ID["mosaic_mpt7b_h100_80gb_8g_s2048"]
    case = row_to_case(row)
    assert case.metric == "tflops" and case.tflops_kind == "model"
    tps = float(row["tokens_per_s_per_accel"])
    assert case.reported == pytest.approx(tps * case.model.flops_per_token(2048) / 1e12)
    # the published MFU is the same throughput on the 989 TF peak (full attention FLOPs)
    assert case.reported / 989 == pytest.approx(float(row["mfu_pct"]) / 100, rel=0.01)
    assert row_to_case({**row, "metric": "mfu"}).reported == pytest.approx(0.4644)
    with pytest.raises(Skip, match="metric 'speed'"):
        row_to_case({**row, "metric": "speed"})


def test_the_engine_cell_says_how_its_engine_ran_and_notes_never_do():
    """torchtitan's rows: "torch.compile" in the engine cell fuses the element-wise work
    (fusion 1, a faster step), "vanilla TP" blocks on the tensor-parallel collectives (a
    slower one); the same words in ``notes`` change nothing; --explain says why."""
    from paratrain.systems.row_engine import case_engine

    row = {**BY_ID["titan_llama3_8b_h100_64_tp8"], "notes": ""}
    plain = row_to_case({**row, "engine": "torchtitan (FSDP2 + TP)"})
    said = {w: row_to_case({**row, "engine": f"torchtitan (FSDP2 + TP, {w})"})
            for w in ("torch.compile", "vanilla TP")}
    noted = row_to_case({**row, "engine": "torchtitan (FSDP2 + TP)",
                         "notes": "torch.compile on; vanilla TP column"})
    assert case_engine(plain).fusion == 3.0 and case_engine(plain).tp == 0.5
    assert case_engine(said["torch.compile"]).fusion == 1.0
    assert case_engine(said["vanilla TP"]).tp == 0.0
    assert "'torch.compile': the compiler fuses" in said["torch.compile"].engine_why
    assert predict(said["torch.compile"]) > predict(plain) > predict(said["vanilla TP"])
    assert predict(noted) == predict(plain) and noted.engine_why == plain.engine_why


def test_a_full_iteration_cuda_graph_leaves_each_kernel_only_the_gpus_gap():
    """Megatron-Bridge's 26.08 Qwen3-30B-A3B on 8 GB200 (MXFP8) replays its step from a
    CUDA graph (the release's recipe): its kernels cost GRAPH_KERNEL_S each, not the
    fitted launch cost, so its launches take a tenth of the time; the words in notes
    alone change nothing, and `plan --engine` reads them the same way."""
    from paratrain.systems.fitting import breakdown, load_params
    from paratrain.systems.overlap import GRAPH_KERNEL_S
    from paratrain.systems.row_engine import case_engine, engine_as_said

    row = BY_ID["mb2608_qwen3_30b_gb200_mx_8"]
    assert "full-iteration CUDA graph" in row["engine"]
    graphed = row_to_case(row)
    plain = row_to_case({**row, "engine": "NeMo (Megatron-Bridge)"})
    assert case_engine(graphed).graphed and not case_engine(plain).graphed
    assert "'full-iteration cuda graph': the step's kernels replay" in graphed.engine_why
    p = load_params()
    g, b = breakdown(graphed, p), breakdown(plain, p)
    assert g.overhead_s == pytest.approx(b.overhead_s * GRAPH_KERNEL_S / p.kernel_s)
    assert g.step_s < b.step_s and g.comm == b.comm
    noted = row_to_case({**row, "engine": "NeMo (Megatron-Bridge)",
                         "notes": "full-iteration CUDA graph"})
    assert predict(noted) == predict(plain)
    assert engine_as_said("nemo, full-iteration CUDA graph").graphed
    assert case_engine(graphed).kernel_s(1e-5) == GRAPH_KERNEL_S


def test_tpu_slices_set_the_fast_domain():
    case = row_to_case(BY_ID["maxtext_v4_22b_8x64"])
    assert case.hw.gpus_per_node == 64 and case.plan.dp == 512 and case.hw.topology == "torus"
    assert case.shard_group == 64 and case.engine == "xla"
    assert case.engine_why == "engine 'MaxText (JAX)' says 'jax'"


def test_a_stated_network_replaces_the_catalogues_and_explain_says_so():
    """InternEvo's A100 cluster: 4 x 100 Gb RoCE per 8 GPUs, 50 Gb/s per GPU against the
    catalogue's DGX A100 200 Gb/s: the row's ``inter_gbps`` sets the network, and a
    gradient all-reduce across 128 nodes takes longer on it."""
    from paratrain.systems.explain import case_lines
    from paratrain.systems.fitting import breakdown, load_params

    row = BY_ID["internevo_7b_a100_1024_tp1_zero8"]
    case = row_to_case(row)
    assert row["inter_gbps"] == "50" and case.hw.inter_bw == 50e9 / 8
    assert case.engine == "internevo" and case.shard_group == 8
    assert "network: 50 Gb/s per accelerator between nodes" in "\n".join(case_lines(case))
    default = row_to_case({**row, "inter_gbps": ""})
    assert default.hw.inter_bw == 25e9
    assert "network" not in "\n".join(case_lines(default))
    p = load_params()
    assert breakdown(case, p).comm["dp"] > 1.5 * breakdown(default, p).comm["dp"]


def test_heldout_split_is_disjoint_spread_and_follows_its_rule():
    assert {r["split"] for r in ROWS} <= set(SPLITS)
    held = set(heldout_ids(ROWS))
    fit = {r["id"] for r in ROWS if r["split"] == "fit"}
    assert held and not held & fit and held | fit == set(BY_ID)
    scored = [r for r in ROWS if r["confirmed"] == "yes"]
    assert 0.15 <= sum(r["id"] in held for r in scored) / len(scored) <= 0.35
    held_rows = [BY_ID[i] for i in held]
    assert all(r["confirmed"] == "yes" for r in held_rows)
    assert {_family(r["accelerator"]) for r in held_rows} >= {"a100", "h100", "tpu"}
    assert len({r["engine"] for r in held_rows}) >= 6
    # the rule of docs/runs.md: per (stack, accelerator) group in table order, the 2nd,
    # 6th, 10th, ... row is held out; the stack is the engine cell up to its first comma
    seen: dict = {}
    for r in ROWS:
        g = (r["engine"].split(",")[0].strip(), r["accelerator"].split("(")[0].strip())
        i = seen[g] = seen.get(g, -1) + 1
        assert (r["id"] in held) == (i % 4 == 1 and r["confirmed"] == "yes"), r["id"]


@pytest.mark.parametrize("name, total, active", [
    ("mixtral-8x7b", 46.7e9, 12.9e9), ("mixtral-8x22b", 141e9, 39e9),
    ("deepseek-v3", 671e9, 37e9), ("grok-1", 314e9, None),
    ("deepseek-v2", 236e9, 21e9), ("deepseek-v2-lite", 15.7e9, None),
    ("qwen3-30b-a3b", 30.5e9, 3.3e9), ("qwen3-235b-a22b", 235e9, 22e9),
    ("qwen2-57b-a14b", 57e9, 14e9), ("dbrx", 132e9, 36e9), ("olmoe-1b-7b", 6.9e9, 1.3e9),
    ("llama4-scout", 109e9, 17e9), ("llama4-maverick", 400e9, 17e9),
    ("kimi-k2", 1.04e12, 32.6e9), ("gpt-oss-120b", 116.8e9, None), ("gpt-oss-20b", 20.9e9, None),
    ("qwen3-480b-a35b", 480e9, 35e9),
])
def test_catalogue_moe_models_match_published_totals(name, total, active):
    m = load_model(name)
    assert m.num_params() == pytest.approx(total, rel=0.02)
    if active:
        assert m.active_params() == pytest.approx(active, rel=0.03)


@pytest.mark.parametrize("name, params", [
    ("nemotron4-340b", 341.0e9), ("nemotron4-15b", 15.6e9), ("bloom-176b", 176.2e9),
    ("opt-175b", 175e9), ("mt-nlg-530b", 530e9), ("gemma2-9b", 9.24e9), ("gemma2-27b", 27.2e9),
    ("olmo-7b", 6.89e9), ("gpt3-6.7b", 6.7e9), ("llama3.1-405b", 405.9e9),
    # Gemma 3 report (arXiv:2503.19786) Table 1, embedding + non-embedding, text decoder
    ("gemma3-4b", 3.884e9), ("gemma3-12b", 11.771e9), ("gemma3-27b", 27.016e9),
    # the model cards' counts (Mistral 7B: arXiv:2310.06825's 7.3B)
    ("mistral-7b", 7.3e9), ("qwen2.5-7b", 7.61e9), ("qwen2.5-14b", 14.7e9),
    ("qwen3-4b", 4.0e9), ("qwen3-8b", 8.2e9), ("qwen3-14b", 14.8e9), ("qwen3-32b", 32.8e9),
])
def test_catalogue_dense_models_match_published_sizes(name, params):
    assert load_model(name).num_params() == pytest.approx(params, rel=0.01)


def test_mpt_shapes_reproduce_the_benchmark_table_exactly():
    # NumParams column of mosaicml/llm-foundry scripts/train/benchmarking/README.md
    assert load_model("mpt-7b").num_params() == 6_658_859_008
    assert load_model("mpt-70b").num_params() == 64_862_437_376
    assert load_model("mpt-125m").num_params() == 125_311_488


def test_flop_counts_by_hand_and_rows_priced_in_their_sources_count():
    """Megatron-LM (and NeMo, MaxText, torchtitan) count the logits matmul once and the
    input-embedding lookup not at all: for an untied model that is 6 V d fewer FLOPs per
    token than our 6N, and the prediction of a row's TFLOP/s is made in its source's count."""
    from paratrain.cost.shapes import FLOP_COUNTS
    from paratrain.systems.fitting import predict

    row = {**BY_ID["mcore_weak_1.7b_48"], "tied": "no"}
    case = row_to_case(row)
    m, s = case.model, case.seq_len
    assert not m.tie_embeddings and set(FLOP_COUNTS) == {"6N", "matmul", "causal"}
    ours, matmul = m.flops_per_token(s), m.flops_per_token(s, "matmul")
    assert ours - matmul == pytest.approx(6 * m.vocab_size * m.d_model)
    attn = 12 * m.n_layers * m.n_heads * m.head_dim * s
    assert matmul - m.flops_per_token(s, "causal") == pytest.approx(attn / 2)
    gpt3 = load_model("gpt3-175b")  # tied: only its learned positions are a lookup
    assert gpt3.tie_embeddings and gpt3.learned_positions
    assert gpt3.flops_per_token(2048) - gpt3.flops_per_token(2048, "matmul") == \
        pytest.approx(6 * gpt3.context * gpt3.d_model)
    # the same step, reported as TFLOP/s in Megatron's count and in ours
    as_ours = row_to_case({**row, "flops_count": "6N"})
    assert predict(case) / predict(as_ours) == pytest.approx(matmul / ours)
    # a tokens/s row is turned into TFLOP/s by our own count, whatever the column says
    tok = row_to_case({**BY_ID["mosaic_mpt7b_h100_80gb_8g_s2048"], "flops_count": "causal"})
    assert tok.flops_count == "6N"
    with pytest.raises(Skip, match="flops_count 'megatron' is unknown"):
        row_to_case({**row, "flops_count": "megatron"})
    with pytest.raises(ValueError, match="FLOP count 'x' is unknown"):
        m.flops_per_token(s, "x")


def test_recompute_words():
    from paratrain.systems.row_words import recompute_mode as _recompute
    from paratrain.systems.row_words import recompute_stated

    assert _recompute("selective (modules mla_up_proj, mlp, moe)") == "full"
    assert _recompute("selective (modules core_attn)") == "selective"
    assert _recompute("selective (RMSNorm and MLA up-projections recomputed)") == "selective"
    assert _recompute("full (activation checkpointing)") == "full"
    assert _recompute("none (no activation checkpointing)") == "none"
    assert _recompute("") == "none"
    for stated in ("none (no activation checkpointing)", "selective (attention core)",
                   "full", "rematerialization"):
        assert recompute_stated(stated), stated
    for unstated in ("", "not stated (recipe default)", "not stated", "not recorded"):
        assert not recompute_stated(unstated)  # inferred from memory by row_to_case
    # as configs and tables write it: a flag, torchtitan's AC / SAC
    for words, mode in (("true", "full"), ("yes", "full"), ("AC", "full"),
                        ("SAC", "selective"), ("op-level SAC", "selective"),
                        ("false", "none"), ("no", "none"), ("off", "none"),
                        ("remat", "full"), ("act ckpt", "full")):
        assert _recompute(words) == mode and recompute_stated(words), words
    assert not recompute_stated("remat_policy: minimal")  # MaxText's: saves most


def test_a_recompute_cell_that_names_a_share_of_the_blocks_reruns_that_share():
    from paratrain.systems.row_words import recompute_share_said

    assert recompute_share_said("full on 50% of the blocks") == 0.5
    assert recompute_share_said("activation checkpointing on 8 of 32 layers") == 0.25
    assert recompute_share_said("full") == recompute_share_said("selective 50%") == 1.0
    # a shipped row (NeMo's Llama 3.1 70B, every block rerun) told it reruns half its
    # blocks: priced between none and full
    row = {**BY_ID["dgxc_llama31_70b_64"], "recompute": "full"}
    full, half, none = (row_to_case({**row, "recompute": w})
                        for w in ("full", "full on 50% of the blocks", "none"))
    assert (full.recompute_share, half.recompute_share) == (1.0, 0.5)
    p = load_params()
    assert predict(full, p) < predict(half, p) < predict(none, p)


def test_zero_stage_words():
    """The sharding cell as DeepSpeed, PyTorch FSDP and Megatron write it."""
    from paratrain.systems.row_words import zero_stage, zero_stated

    for words, stage in (("ZeRO-3 (no model parallelism)", 3), ("zero3", 3), ("ZeRO++ (hpZ)", 3),
                         ("ZeRO stage 2", 2), ("zero_stage: 1", 1), ("FSDP FULL_SHARD", 3),
                         ("HYBRID_SHARD", 3), ("FSDP2", 3), ("SHARD_GRAD_OP", 2),
                         ("FSDP NO_SHARD", 0), ("distributed optimizer (Megatron-Core)", 1),
                         ("DDP", 0), ("", 0), ("dist opt", 1),
                         ("0", 0), ("1", 1), ("2", 2), ("3", 3), ("stage 2", 2)):
        assert zero_stage(words) == stage, words
    # a zero_stage column's bare number says its stage, 0 included
    assert zero_stated("0") and zero_stated("3") and not zero_stated("12")
    # DDP and NO_SHARD say their stage (none); silence leaves the engine's default
    assert zero_stated("DDP") and zero_stated("FSDP NO_SHARD") and zero_stated("none")
    assert not zero_stated("") and not zero_stated("not stated")


def test_precision_and_flop_kind_words():
    """The precision cell as Transformer Engine, torchao / torchtitan ("float8"), MaxText
    (AQT int8) and PyTorch write it: torchtitan's float8 runs had been priced in BF16."""
    from paratrain.systems.row_engine import eight_bit, fp8_scaling
    from paratrain.systems.row_words import eight_bit_said, four_bit_said, fp16_said

    for words in ("FP8", "fp8-hybrid", "MXFP8", "Float8", "float8 tensorwise", "e4m3",
                  "8-bit floating point", "int8 (AQT)"):
        assert eight_bit_said(words), words
    for words in ("bf16", "bfloat16", "bf16 with 8-bit Adam", "fp16 mixed", ""):
        assert not eight_bit_said(words), words
    assert four_bit_said("NVFP4") and four_bit_said("float4") and not four_bit_said("fp8")
    assert fp16_said("fp16 mixed") and fp16_said("torch.float16") and fp16_said("half precision")
    assert not fp16_said("bf16 (weight_dtype bfloat16)")
    from paratrain.systems.row_words import hardware_flops_said

    for words, hw in (("hardware-like: eq.(3) ... includes recompute forward", True),
                      ("HFU", True), ("incl. recompute", True), ("model", False),
                      ("including activation recomputation", True), ("not stated", False),
                      ("model (excluding recompute)", False), ("model (MFU basis)", False)):
        assert hardware_flops_said(words) == hw, words
    # a torchtitan row that says float8 runs its linear layers at the 8-bit peak, rowwise
    # where it says so; a bf16 run on the same row at the 16-bit one
    row = BY_ID["ao_llama3_8b_h100_8_rw"]
    case = row_to_case({**row, "precision": "float8 rowwise"})
    assert eight_bit(case) and fp8_scaling(case) == "rowwise"
    assert not eight_bit(row_to_case({**row, "precision": "bf16"}))
    with pytest.raises(Skip, match="4-bit"):
        row_to_case({**row, "precision": "NVFP4"})


def test_metric_words():
    """The metric cell as sources label their columns; a word naming no figure refused."""
    from paratrain.systems.row_words import metric_said

    for words, key in (("MFU", "mfu"), ("HFU (%)", "hfu"), ("tokens/s/GPU", "tokens"),
                       ("throughput", "tokens"), ("TFLOP/s per GPU", "tflops"),
                       ("step time (s)", "step"), ("accuracy", None)):
        assert metric_said(words) == key, words
    row = BY_ID["dgxc_gpt3_175b_128"]
    assert row_to_case({**row, "metric": "Tokens/s/GPU"}).reported == pytest.approx(
        row_to_case({**row, "metric": "tokens"}).reported)
    assert row_to_case({**row, "metric": "MFU"}).metric == "mfu"
    with pytest.raises(Skip, match="metric 'accuracy' is unknown"):
        row_to_case({**row, "metric": "accuracy"})


def test_mlp_words():
    """Any gated MLP prices as three matrices, any other activation as two."""
    from paratrain.systems.row_words import mlp_said

    for words, mlp in (("SwiGLU", "swiglu"), ("GeGLU", "swiglu"), ("gated GELU", "swiglu"),
                       ("ReGLU", "swiglu"), ("GELU", "gelu"), ("squared ReLU", "gelu"),
                       ("relu", "gelu"), ("", None)):
        assert mlp_said(words) == mlp, words
    row = BY_ID["megascale_530b_megatronlm_2240"]
    assert row_to_case({**row, "mlp": "GeGLU", "ffn_hidden": "54784"}).model.mlp == "swiglu"


def test_tied_words():
    from paratrain.systems.row_shape import _style

    for words, tied in (("yes", True), ("true", True), ("tied", True), ("Y", True),
                        ("shared (input and output)", True), ("no", False),
                        ("untied", False), ("not tied", False), ("false", False)):
        assert _style({"tied": words})["tie_embeddings"] == tied, words
    assert "tie_embeddings" not in _style({"tied": ""})


def test_schedule_words():
    """The schedule cell as Megatron, torchtitan, the zero-bubble paper and DeepSeek name
    theirs; 1F1B beside a vpp > 1 is Megatron's interleaved 1F1B; a V-shaped schedule
    without a vpp runs its two chunks a rank."""
    from paratrain.systems.row_words import schedule_said

    for words, name in (("Interleaved 1F1B", "interleaved"), ("virtual pipeline", "interleaved"),
                        ("VPP", "interleaved"), ("LoopedBFS", "interleaved"),
                        ("zero bubble", "zb-h1"), ("ZB-H1", "zb-h1"), ("ZB-V", "zb-v"),
                        ("DualPipe", "dualpipev"), ("PipeDream-Flush", "1f1b"),
                        ("1F1B", "1f1b"), ("GPipe", "gpipe"), ("chimera", None)):
        assert schedule_said(words) == name, words
    row = BY_ID["dgxc_llama31_405b_576"]  # PP 9 with 7 virtual stages a rank
    stated = row_to_case(row).plan
    assert row_to_case({**row, "schedule": "1F1B"}).plan == stated
    assert row_to_case({**row, "schedule": "Interleaved 1F1B"}).plan == stated
    v = row_to_case({**row, "schedule": "DualPipe", "vpp": ""}).plan
    assert (v.schedule, v.virtual_stages) == ("dualpipev", 2)
    with pytest.raises(Skip, match="schedule 'chimera' is unknown"):
        row_to_case({**row, "schedule": "chimera"})


def test_a_named_recompute_module_reruns_what_it_holds_and_nothing_else():
    """Megatron-Core's selective recompute of modules "layernorm, moe" reruns the MoE
    layer's forward (its GEMMs and all-to-alls), not the attention core: at 128K tokens,
    where attention is most of the step, pricing it as full recompute charged the core
    29% more than the run did (systems.recompute_modules)."""
    from paratrain.systems.fitting import breakdown, load_params
    from paratrain.systems.recompute_modules import modules_said, rerun_classes

    assert modules_said("selective (modules layernorm, moe)") == ("layernorm", "moe")
    assert modules_said("selective (attention core)") == ()
    assert rerun_classes(("layernorm", "moe_act")) == frozenset()
    assert rerun_classes(("moe",)) == {"router", "experts", "mlp"}
    row = BY_ID["mz_qwen3_235b_h100_256_cp8_128k"]
    case = row_to_case(row)
    assert case.rerun == ("layernorm", "moe") and case.plan.recompute == "full"
    p = load_params()
    named, full = breakdown(case, p), breakdown(dataclasses.replace(case, rerun=()), p)
    none = breakdown(dataclasses.replace(
        case, rerun=(), plan=dataclasses.replace(case.plan, recompute="none")), p)
    assert named.gemm["attention"] == pytest.approx(none.gemm["attention"])
    assert full.gemm["attention"] > 1.2 * named.gemm["attention"]
    assert named.gemm["experts"] == pytest.approx(full.gemm["experts"])
    assert named.gemm["experts"] > 1.2 * none.gemm["experts"]
    assert named.comm["ep"] == pytest.approx(full.comm["ep"])
    assert named.comm["ep"] > none.comm["ep"]
    assert named.comm["cp"] == pytest.approx(none.comm["cp"])
    assert named.comm["cp"] < full.comm["cp"]
    # element-wise modules alone rerun nothing the step model prices
    act = row_to_case({**row, "recompute": "selective (modules moe_act, layernorm)"})
    assert act.plan.recompute == "selective"
    assert breakdown(act, p).gemm == pytest.approx(none.gemm)


def test_a_named_module_reruns_the_element_wise_work_of_the_gemms_it_holds():
    """MLA's up projections (``mla_up_proj``) rerun their own GEMMs and the element-wise
    work that goes with them, not the whole block's: charging DeepSeek-V3's every norm,
    activation and expert permutation again priced a recompute of the query and key/value
    GEMMs' forward (a few percent of the block) at 7% of the step. The share rerun is the
    forward GEMM time the modules hold (systems.step_model._block_summary)."""
    from paratrain.systems.fitting import breakdown, load_params

    case = row_to_case(BY_ID["mb2604_dsv3_b200_mx_256"])
    assert case.rerun == ("mla_up_proj",) and case.plan.recompute == "selective"
    p = load_params()
    named = breakdown(case, p)
    none = breakdown(dataclasses.replace(
        case, rerun=(), plan=dataclasses.replace(case.plan, recompute="none")), p)
    full = breakdown(dataclasses.replace(
        case, rerun=(), plan=dataclasses.replace(case.plan, recompute="full")), p)
    # per block: the busiest pipeline rank (and so the block count) may differ between them
    def per_block(b, get):
        return get(b) / b.blocks

    def again(b, get):
        return per_block(b, get) - per_block(none, get)

    assert again(named, lambda b: b.gemm["qkv"]) > 0
    assert per_block(named, lambda b: b.gemm["experts"]) == pytest.approx(
        per_block(none, lambda b: b.gemm["experts"]))
    # the element-wise work and launches rerun are the qkv GEMMs' share, far below full's
    for get in (lambda b: b.memory_s, lambda b: b.overhead_s):
        assert 0 < again(named, get) < 0.25 * again(full, get)


@pytest.mark.parametrize("cell,key", [
    ("NVIDIA GB200 NVL72", "gb200"), ("NVIDIA H100 PCIe", "h100-pcie"), ("H100 NVL", "h100-nvl"),
    ("H100-SXM5-80GB", "h100"), ("TPU v4 (pod)", "tpu-v4"), ("A100-SXM4-40GB", "a100-40gb")])
def test_an_accelerator_cell_names_the_longest_catalogue_entry_it_contains(cell, key):
    from paratrain.systems.runs import _hardware

    assert _hardware(cell)[0] == key
