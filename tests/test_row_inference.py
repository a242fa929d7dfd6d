"""What a runs-table reader assumes, and that it says so (docs/runs.md): the engine from
every column with its reason, nothing read from free-text notes, every default listed,
a blank recompute inferred from memory, a layout that cannot fit refused. Rows are copied
from the shipped table and edited the way a user's own table would differ. No torch."""

from __future__ import annotations

import csv
import dataclasses
import json

import pytest

from paratrain.cli import main
from paratrain.systems.fitting import load_params, predict
from paratrain.systems.partial_recompute import share_words
from paratrain.systems.row_engine import case_kernel
from paratrain.systems.row_memory import RECOMPUTE_ORDER, rank_memory
from paratrain.systems.runs import Skip, read_runs, row_to_case
from paratrain.systems.validate import run_validate

BY_ID = {r["id"]: r for r in read_runs()}
ZERO3 = "narayanan21_t2_zero3_175b_384"  # DeepSpeed ZeRO-3, Narayanan et al. Table 2
# row -> (engine, reason) when the table has no engine column
NO_ENGINE_COLUMN = {
    ZERO3: ("deepspeed", "zero_or_fsdp 'ZeRO-3 (no model parallelism)' says 'zero-3'"),
    "narayanan21_t2_zero3_530b_640": ("deepspeed", "zero_or_fsdp 'ZeRO-3 (no model "
                                                   "parallelism)' says 'zero-3'"),
    "titan_llama3_8b_a100_64_sacop": ("torchtitan", "zero_or_fsdp 'FSDP2 (ZeRO-3, "
                                                    "fully_shard)' says 'fsdp2'"),
    "mosaic_mpt7b_h100_80gb_8g_s2048": ("fsdp", "zero_or_fsdp 'FSDP FULL_SHARD (ZeRO-3)' "
                                                "says 'fsdp'"),
    "maxtext_v4_22b_8x64": ("xla", "accelerator 'TPU v4' says 'tpu'"),
    "dgxc_gpt3_175b_128": ("nemo", "zero_or_fsdp 'distributed optimizer (NeMo/Megatron)' "
                                   "says 'nemo'"),
    "narayanan21_t1_1.7B": ("megatron", "model 'GPT 1.7B (Megatron weak-scaling)' says "
                                        "'megatron'"),
}


def _write(path, rows):
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return str(path)


def _without(row: dict, *cols: str) -> dict:
    return {k: v for k, v in row.items() if k not in cols}


def test_a_table_without_an_engine_column_prices_zero3_as_deepspeed(tmp_path):
    rows = [_without(BY_ID[i], "engine") for i in NO_ENGINE_COLUMN]
    path = _write(tmp_path / "no_engine.csv", rows)
    assert "engine" not in read_runs(path)[0]
    res = run_validate(path, None, False, False, (), None)
    recs = {r["id"]: r for r in res["records"]}
    for rid, (eng, why) in NO_ENGINE_COLUMN.items():
        assert (recs[rid]["engine"], recs[rid]["engine_why"]) == (eng, why), rid
    # priced as the named engine prices it, and that is not Megatron-LM's price: Megatron
    # hides the gathers DeepSpeed exposes (reported 144 TFLOP/s; about 190 as Megatron)
    p = load_params()
    named = row_to_case(BY_ID[ZERO3])
    assert named.engine == "deepspeed"
    assert recs[ZERO3]["predicted"] == pytest.approx(predict(named, p), rel=1e-12)
    as_megatron = dataclasses.replace(named, engine="megatron")
    assert predict(as_megatron, p) > 1.25 * recs[ZERO3]["predicted"]
    rep = recs[ZERO3]["reported"]
    assert abs(recs[ZERO3]["predicted"] - rep) < abs(predict(as_megatron, p) - rep)


def test_the_engine_column_decides_when_filled_and_nothing_is_default_silently():
    case = row_to_case(BY_ID[ZERO3])
    assert case.engine_why == "engine 'DeepSpeed ZeRO-3' says 'deepspeed'"
    other = row_to_case({**BY_ID[ZERO3], "engine": "an in-house stack"})
    assert other.engine == "megatron" and "'an in-house stack' is none we model" in \
        other.engine_why
    # on a TPU a stack we do not name is still compiled by XLA: the accelerator decides
    tpu = BY_ID["maxtext_v4_22b_8x64"]
    jax = row_to_case({**tpu, "engine": "an in-house JAX trainer"})
    assert jax.engine == "xla" and "says 'jax'" in jax.engine_why
    own = row_to_case({**tpu, "engine": "an in-house stack"})
    assert own.engine == "xla" and "XLA compiles whatever stack runs on a TPU" in \
        own.engine_why
    assert row_to_case({**tpu, "engine": "Levanter"}).engine == "xla"
    # stacks named without their technique: OLMo-core and torchtune shard with FSDP2,
    # Lightning with FSDP1, AMD's Primus is Megatron-LM's fork
    for stack, eng in (("OLMo-core", "torchtitan"), ("torchtune", "torchtitan"),
                       ("LitGPT", "fsdp"), ("AMD Primus", "megatron")):
        named = row_to_case({**BY_ID[ZERO3], "engine": stack})
        assert named.engine == eng and "none we model" not in named.engine_why, stack
    bare = {**_without(BY_ID["narayanan21_t1_1.7B"], "engine"), "model": "GPT 1.7B",
            "source": "a lab", "source_location": ""}
    case = row_to_case(bare)
    assert case.engine == "megatron" and case.engine_why.startswith("no column of engine")
    assert ("engine", "megatron", case.engine_why) in case.defaults
    # free text is never read: an engine named only in notes or the id changes nothing
    noted = row_to_case({**bare, "id": "deepspeed_run", "notes": "run with DeepSpeed"})
    assert noted.engine == "megatron"


def test_interleaving_comes_from_columns_never_from_notes():
    row = BY_ID["llama3_405b_8192_seq8192"]
    assert "interleaved" in row["notes"] and row["schedule"] == "interleaved"
    case = row_to_case(row)
    L, pp = case.model.n_layers, case.plan.pp
    assert (case.plan.schedule, case.plan.virtual_stages) == ("interleaved", L // pp)
    assert ("vpp", L // pp, "blank with schedule interleaved: one block per virtual "
                            "stage") in case.defaults
    for plain in (_without(row, "schedule"), {**row, "schedule": ""}):
        case = row_to_case(plain)
        assert (case.plan.schedule, case.plan.virtual_stages) == ("1f1b", 1)
        assert ("schedule", "1f1b", "blank: 1F1B, Megatron-LM's default") in case.defaults
    with pytest.raises(Skip, match="schedule 'zigzag' is unknown"):
        row_to_case({**row, "schedule": "zigzag"})


def test_head_dim_comes_from_its_column_never_from_notes():
    row = BY_ID["palm_540b"]
    assert "head dim 256" in row["notes"] and row["head_dim"] == "256"
    assert row_to_case(row).model.head_dim == 256
    blank = row_to_case({**row, "head_dim": ""})
    assert blank.model.head_dim == 18432 // 48
    assert ("head_dim", 384, "blank: hidden / heads") in blank.defaults


def test_every_default_is_listed_in_the_case_and_the_record(tmp_path):
    row = {**BY_ID["narayanan21_t1_1.7B"], "TP": "", "PP": "", "DP": "", "CP": "",
           "zero_or_fsdp": ""}
    case = row_to_case(row)
    got = {d[0]: d[1] for d in case.defaults}
    assert got["TP"] == got["PP"] == got["CP"] == 1 and got["DP"] == 32
    assert got["zero_or_fsdp"] == "ZeRO-0" and got["microbatch"] == 512 // 32
    assert {"kv_heads", "head_dim", "mlp", "tied"} <= set(got) and "recompute" not in got
    filled = row_to_case(BY_ID["narayanan21_t1_1.7B"])
    assert not {"TP", "PP", "DP", "CP"} & {d[0] for d in filled.defaults}
    res = run_validate(_write(tmp_path / "t.csv", [row]), None, False, False, (), None)
    listed = res["records"][0]["defaults"]
    assert [(d["field"], d["value"], d["why"]) for d in listed] == list(case.defaults)
    json.dumps(res)  # the record is JSON as it stands


def test_a_blank_recompute_under_eager_attention_is_full_checkpointing():
    """Before FlashAttention and selective recomputation (2022) a large run checkpointed
    every block (Megatron-LM's and Megatron-DeepSpeed's --checkpoint-activations): a
    blank recompute on an eager-attention run (fp16 on an A100, DeepSpeed's engine) is
    full, said so, not the least that fits."""
    row = {**BY_ID["narayanan21_t1_1.7B"], "recompute": ""}
    case = row_to_case(row)
    assert case_kernel(case) == "eager"
    assert (case.plan.recompute, case.recompute_share) == ("full", 1.0)
    (d,) = [d for d in case.defaults if d[0] == "recompute"]
    assert d[1] == "full" and "eager attention" in d[2]
    # the same row on an H100 runs FlashAttention-2 class: the least that fits again
    h100 = row_to_case({**row, "accelerator": "H100-SXM5-80GB"})
    (d,) = [d for d in h100.defaults if d[0] == "recompute"]
    assert d[2].startswith("inferred: the least of none < selective")


@pytest.mark.parametrize("rid", ["megascale_530b_megatronlm_2240", "dgxc_llama31_8b_8",
                                 "titan_llama3_8b_a100_64_sacop"])
def test_a_blank_recompute_is_the_least_that_fits_and_marked_inferred(rid):
    row = {**BY_ID[rid], "recompute": ""}
    case = row_to_case(row)
    att = case_kernel(case)
    mem = {m: rank_memory(case.model, dataclasses.replace(case.plan, recompute=m), case.hw,
                          case.tokens, case.seq_len, att, case.shard_group,
                          "fp8" in case.precision.lower()) for m in RECOMPUTE_ORDER}
    fits = [m for m in RECOMPUTE_ORDER if mem[m].fits]
    assert case.plan.recompute == fits[0]
    (d,) = [d for d in case.defaults if d[0] == "recompute"]
    assert d[2].startswith("inferred: the least of none < selective")
    share = case.recompute_share
    if fits[0] != "full":
        assert d[1] == fits[0] and share == 1.0
    else:  # the least share of the blocks whose memory fits: the HBM's bytes exactly
        none, full = mem["none"].total_bytes, mem["full"].total_bytes
        assert 0 < share <= 1 and d[1] == (share_words(share) if share < 1 else "full")
        kept = none - share * (none - full)
        assert share == 1 or kept == pytest.approx(mem["none"].hbm_bytes)
    stated = row_to_case({**row, "recompute": "full"})
    assert stated.plan.recompute == "full" and "recompute" not in {x[0] for x in
                                                                  stated.defaults}


def test_inferred_recompute_is_not_always_the_same():
    modes = {row_to_case({**BY_ID[i], "recompute": "not stated"}).plan.recompute
             for i in ("dgxc_nemotron4_340b_128", "dgxc_llama31_8b_8")}
    assert modes == {"full", "none"}


def test_a_layout_needing_terabytes_per_gpu_is_refused_with_the_bytes(tmp_path):
    """GPT-3 175B whole on each of 8 GPUs (TP, PP blank, no sharding): 16 bytes per
    parameter of states, 2.8 TB, and at least 8 (bf16 moments, no fp32 master: the least
    the refusal counts, systems.row_memory.least_bytes), 1.4 TB, against an 80 GB H100."""
    row = {**BY_ID["dgxc_gpt3_175b_128"], "TP": "", "PP": "", "CP": "", "DP": "", "vpp": "",
           "num_accel": "8", "zero_or_fsdp": "none", "global_batch_seqs": "8",
           "tokens_per_step": "", "microbatch": "1", "recompute": ""}
    with pytest.raises(Skip) as e:
        row_to_case(row)
    msg = str(e.value)
    need = float(msg.split("needs ")[1].split(" GB")[0].replace(",", ""))
    assert 1_350 < need < 1_450 and msg.endswith("even with full recompute > 80.0 GB HBM")
    assert {("TP", 1), ("PP", 1), ("DP", 8)} <= {d[:2] for d in e.value.defaults}
    res = run_validate(_write(tmp_path / "t.csv", [row]), None, False, False, (), None)
    rec = res["records"][0]
    assert rec["predicted"] is None and rec["skipped_reason"] == msg
    assert {"TP", "PP", "DP"} <= {d["field"] for d in rec["defaults"]}


def test_validate_explain_prints_the_engine_its_reason_and_the_defaults(tmp_path, capsys):
    rows = [_without(BY_ID[ZERO3], "engine"), _without(BY_ID["dgxc_gpt3_175b_128"], "engine")]
    path = _write(tmp_path / "t.csv", rows)
    assert main(["validate", "--runs", path, "--explain", ZERO3]) == 0
    out = capsys.readouterr().out
    assert "engine deepspeed: zero_or_fsdp 'ZeRO-3 (no model parallelism)' says 'zero-3'" in out
    assert "defaults applied (" in out and "kv_heads = 96: blank: multi-head attention" in out
    assert main(["validate", "--runs", path, "--explain", ZERO3, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["engine"] == "deepspeed" and "'zero-3'" in got["engine_why"]
    assert {"field": "kv_heads", "value": 96, "why": "blank: multi-head attention"} in \
        got["defaults"]


def test_a_run_over_its_hbm_only_by_what_engines_avoid_is_priced_not_refused():
    """MaxText's Llama 3.1 70B on 256 TPU v6e (tpu-recipes) keeps 5 sequences of 8192
    tokens per chip: its 80 layer inputs alone are 54 GB against 32 GB of HBM, and the run
    offloads them to host memory (remat_policy custom, decoder_layer_input: offload). The
    full count is over the HBM; without what the run does not keep (the whole fp32
    logits, fp32 master and moments, the offloaded inputs) it fits, so it is priced with
    full recompute and says why. Said without the offload, it is refused with the least
    bytes: the same lean states plus the layer inputs."""
    row = BY_ID["tpur_v6e_llama31_70b_256"]
    assert "offload" in row["recompute"]
    case = row_to_case(row)
    why = {d[0]: d[2] for d in case.defaults}["recompute"]
    assert case.plan.recompute == "full" and "the run ran" in why and "host" in why
    mem = rank_memory(case.model, case.plan, case.hw, case.tokens, case.seq_len, "flash")
    lean = mem.weights_bytes + mem.grads_bytes + mem.optimizer_bytes / 3 + mem.buffers_bytes
    assert not mem.fits and lean <= mem.hbm_bytes < lean + mem.activations_bytes
    with pytest.raises(Skip) as e:
        row_to_case({**row, "recompute": "full (remat_policy full)"})
    need = float(str(e.value).split("needs ")[1].split(" GB")[0])
    assert need == pytest.approx((lean + mem.activations_bytes) / 1e9, abs=0.06)


def test_selective_under_an_engine_that_checkpoints_blocks_is_the_least_share_that_fits():
    # fms-fsdp's "Selective AC" wraps a share of the blocks (PyTorch FSDP1's checkpoint
    # wrapper): Llama 2 70B at 2 x 4096 tokens per A100 keeps 196 GB without it (the
    # row's MFU and HFU, which say the share themselves, taken out)
    row = _without(BY_ID["fms_llama2_70b_a100_128"], "mfu_pct", "hfu_pct")
    case = row_to_case(row)
    assert case.engine == "fsdp" and case.plan.recompute == "full"
    mem = {m: rank_memory(case.model, dataclasses.replace(case.plan, recompute=m), case.hw,
                          case.tokens, case.seq_len, "flash", case.shard_group)
           for m in ("none", "full")}
    none, full = mem["none"].total_bytes, mem["full"].total_bytes
    assert none > 2 * mem["none"].hbm_bytes and 0 < case.recompute_share < 1
    kept = none - case.recompute_share * (none - full)
    assert kept == pytest.approx(mem["none"].hbm_bytes)
    (d,) = [d for d in case.defaults if d[0] == "recompute"]
    assert d[1] == share_words(case.recompute_share) and "wraps whole blocks" in d[2]
    # the same words under Megatron-LM mean its attention-core recompute, kept as stated
    megatron = row_to_case({**row, "engine": "Megatron-LM"})
    assert megatron.plan.recompute == "selective" and "recompute" not in {
        x[0] for x in megatron.defaults}
    # and a layout that fits with nothing recomputed recomputes nothing
    small = row_to_case({**row, "microbatch": "1", "global_batch_seqs": "128",
                         "tokens_per_step": str(128 * 4096), "model_key": "llama2-7b"})
    assert small.plan.recompute == "none"


def test_a_row_giving_its_mfu_and_hfu_recomputes_the_share_their_ratio_says():
    # recomputing a block reruns its forward, a third of its FLOPs: HFU / MFU = 1 + share / 3
    row = BY_ID["fms_llama2_34b_h100_96"]  # MFU 38%, HFU 49%: 87% of the blocks
    case = row_to_case(row)
    assert case.plan.recompute == "full"
    assert case.recompute_share == pytest.approx(3 * (49 / 38 - 1))
    (d,) = [d for d in case.defaults if d[0] == "recompute"]
    assert d[1] == share_words(case.recompute_share) and "HFU / MFU, 49 / 38" in d[2]
    # and the step priced with that share does the FLOPs the source counted
    params = load_params()
    hfu, mfu = (predict(dataclasses.replace(case, metric=m), params) for m in ("hfu", "mfu"))
    assert hfu / mfu == pytest.approx(49 / 38)
    # a ratio rounded past 4/3 is every block, an equal one none
    assert row_to_case({**row, "hfu_pct": "51"}).recompute_share == 1.0
    assert row_to_case({**row, "hfu_pct": "38"}).plan.recompute == "none"
    # a stated mode is kept as stated: Megatron-LM's selective is its attention core
    assert row_to_case({**row, "engine": "Megatron-LM"}).plan.recompute == "selective"
    # one figure alone says nothing: the least share that fits the HBM
    alone = row_to_case(_without(row, "hfu_pct"))
    (d,) = [d for d in alone.defaults if d[0] == "recompute"]
    assert "wraps whole blocks" in d[2] and alone.recompute_share < case.recompute_share


def test_one_blank_axis_beside_a_stated_dp_is_what_the_others_leave():
    row = BY_ID["dgxc_llama31_405b_576"]  # TP 8, PP 9, CP 2, DP 4 on 576 H100
    stated = row_to_case(row)
    for col in ("TP", "PP", "CP"):
        case = row_to_case({**row, col: ""})
        assert case.plan == stated.plan, col
        (d,) = [d for d in case.defaults if d[0] == col]
        assert d[1] == getattr(stated.plan, col.lower()) and "other axes" in d[2]
    # two blank: which one holds the rest is not said, so each is 1 and the row refused
    with pytest.raises(Skip, match="!= num_accel 576"):
        row_to_case({**row, "TP": "", "CP": ""})


def test_a_blank_ep_of_a_moe_model_spans_the_data_ranks_the_experts_allow():
    # gpt-oss-120b (128 experts) on 64 GB200 ran EP 64 = DP: blank, it is read back
    row = BY_ID["mb2511_gptoss_120b_gb200_bf16_64"]
    case = row_to_case({**row, "EP": ""})
    assert case.plan == row_to_case(row).plan and case.plan.ep == 64
    (d,) = [d for d in case.defaults if d[0] == "EP"]
    assert d[1] == 64 and "experts" in d[2]
    # Mixtral 8x7B over 256 data ranks: no more than its 8 experts
    mixtral = BY_ID["tpur_v6e_mixtral_8x7b_256"]
    assert row_to_case({**mixtral, "EP": ""}).plan.ep == 8
    assert row_to_case(mixtral).plan.ep == 1  # stated: kept
    # a dense model's blank EP is no expert parallelism
    assert row_to_case({**BY_ID["dgxc_llama31_405b_96"], "EP": ""}).plan.ep == 1
    # on 8-GPU nodes a blank EP stays in the node (the ROCm blog's DeepSeek-V3 on 64
    # MI355X ran EP 8 in each node, FSDP across: read back), unless only the data ranks
    # across nodes hold the experts (NeMo AutoModel's DeepSeek-V3 on 256 H100: EP 8
    # needs 130 GB a GPU, so EP 64 = its DP x CP and 256's gcd, as it ran)
    amd = BY_ID["amd_maxtext_dsv3_mi355x_64_cf125_pdbs4"]
    case = row_to_case({**amd, "EP": ""})
    assert case.plan.ep == row_to_case(amd).plan.ep == 8
    (d,) = [d for d in case.defaults if d[0] == "EP"]
    assert "within the fast domain" in d[2]
    wide = row_to_case({**BY_ID["automodel_dsv3_256"], "EP": ""})
    (d,) = [d for d in wide.defaults if d[0] == "EP"]
    assert wide.plan.ep > 8 and "does not fit" in d[2]


def test_a_blank_mlp_width_follows_the_mlp_the_row_names():
    # GPT-530B's shape columns without ffn_hidden and mlp: GPT's two-matrix MLP at 4 x hidden
    row = BY_ID["megascale_530b_megatronlm_2240"]
    assert not row["ffn_hidden"] and not row["mlp"]
    gpt = row_to_case(row).model
    assert (gpt.mlp, gpt.d_ff) == ("gelu", 4 * gpt.d_model)
    # a gated MLP named without its width: LLaMA's 2/3 of 4 x hidden, up to 256
    llama = row_to_case({**row, "mlp": "swiglu"})
    assert llama.model.mlp == "swiglu" and llama.model.d_ff == 54784  # 2/3 of 81,920: 54,613
    (d,) = [d for d in llama.defaults if d[0] == "ffn_hidden"]
    assert d[1] == llama.model.d_ff and "LLaMA" in d[2]
    # a width stated as 4 x hidden with no mlp named is GPT's; any other, gated
    assert row_to_case({**row, "ffn_hidden": str(4 * 20480)}).model.mlp == "gelu"
    assert row_to_case({**row, "ffn_hidden": "54784"}).model.mlp == "swiglu"


def test_a_blank_mlp_width_is_what_the_rows_parameter_count_gives():
    # PaLM 540B: 118 layers of 18,432, SwiGLU; LLaMA's default width would make 380B
    row = {**BY_ID["palm_540b"], "ffn_hidden": ""}
    case = row_to_case(row)
    assert case.model.d_ff == 73728 and case.model.num_params() == pytest.approx(540.35e9,
                                                                                 rel=2e-3)
    (d,) = [d for d in case.defaults if d[0] == "ffn_hidden"]
    assert "params_B (540.35B)" in d[2] and "380.0B" in d[2]
    # a count the default already matches, or none given, leaves the default
    assert row_to_case({**row, "params_B": ""}).model.d_ff == 49152
    gpt = BY_ID["megascale_530b_megatronlm_2240"]  # 530B at GPT's 4 x 20,480
    assert row_to_case(gpt).model.d_ff == 81920


def test_a_model_its_stated_size_contradicts_is_refused_not_priced():
    # Megatron-Bridge's DeepSeek-V3 on 256 GB200 named by its words alone, as a user's
    # table names a small debug flavour of the architecture: not the 671B model
    row = {**BY_ID["mb2511_dsv3_gb200_bf16_256"], "model_key": ""}
    assert row_to_case(row).model.num_params() > 600e9
    with pytest.raises(Skip, match=r"DeepSeek-V3 .*671\.\dB, 37\.\dB active.*5B.*model_key"):
        row_to_case({**row, "model": "DeepSeek-V3 debug 5B (torchtitan)"})
    with pytest.raises(Skip, match="stated size"):
        row_to_case({**row, "model": "DeepSeek-V3", "params_B": "16"})
    # a size that is the total or the active count names it; so does a truncated run of
    # the full model (four layers under its full name)
    for said in ({"params_B": "671"}, {"params_B": "37"}, {"model": "DeepSeek-V3 671B"},
                 {"model": "DeepSeek-V3 671B", "layers": "4"}):
        row_to_case({**row, **said})
    # FlashAttention's GPT3-1.3B run without its shape columns: its words contain "GPT3",
    # which names GPT-3 175B; the catalogue has no 1.3B (XL's 24 heads do not divide 2,048)
    fa = {**BY_ID["fa2_gpt3_1p3b_a100_8"], "layers": "", "hidden": "", "heads": ""}
    with pytest.raises(Skip, match=r"GPT-3 175B .*1\.3B"):
        row_to_case(fa)
    # an explicit model_key is the user's word: no size check
    assert row_to_case({**row, "model": "DeepSeek-V3 5B", "model_key": "deepseek-v3"})
    # "A3B" is an active count, "8x7B" experts times a size: neither is read as a size
assert row_to_case({**BY_ID["tpur_v6e_mixtral_8x7b_256"], "params_B": ""})


def test_a_blank_sequence_or_batch_is_what_the_rows_other_figures_divide_to():
    # dgxc-benchmarking's Llama 3.1 405B on 96 H100: 126 sequences of 8,192 tokens,
    # 1,211.9 tokens/s a GPU at 8.87 s a step (rounded: 125.97 sequences)
    row = BY_ID["dgxc_llama31_405b_96"]
    stated = row_to_case(row)
    for blank in (("seq_len",), ("seq_len", "tokens_per_step"),
                  ("tokens_per_step", "global_batch_seqs")):
        case = row_to_case({**row, **dict.fromkeys(blank, "")})
        assert (case.seq_len, case.tokens, case.plan) == (
            stated.seq_len, stated.tokens, stated.plan), blank
        said = {d[0]: d for d in case.defaults}
        col = "seq_len" if "seq_len" in blank else "global_batch_seqs"
        assert said[col][1] == (8192 if col == "seq_len" else 126)
        assert said[col][2].startswith("blank: ")
    # nothing that divides to a sequence length: refused by name, not guessed
    with pytest.raises(Skip, match="no seq_len"):
        row_to_case({**row, "seq_len": "", "tokens_per_step": "", "step_time_s": ""})
    with pytest.raises(Skip, match="no batch size"):
        row_to_case({**row, "tokens_per_step": "", "global_batch_seqs": "",
                     "step_time_s": ""})


@pytest.mark.parametrize("engine, zero", [("Megatron-LM", 0), ("NeMo 24.03", 1),
                                          ("torchtitan", 3), ("MaxText (JAX)", 3),
                                          ("DeepSpeed", 0), ("PyTorch FSDP1", 3)])
def test_a_blank_sharding_is_the_engines_default_and_says_so(engine, zero):
    row = {**BY_ID["dgxc_llama31_8b_8"], "engine": engine, "zero_or_fsdp": ""}
    case = row_to_case(row)
    assert case.plan.zero == zero
    (d,) = [d for d in case.defaults if d[0] == "zero_or_fsdp"]
    assert d[1] == f"ZeRO-{zero}" and d[2] == f"blank: {case.engine}'s default " \
                                              "(overlap.Engine.zero)"
    stated = row_to_case({**row, "zero_or_fsdp": "none (data parallel all-reduce)"})
    assert stated.plan.zero == 0 and "zero_or_fsdp" not in {x[0] for x in stated.defaults}


def test_a_blank_sharding_that_cannot_fit_is_the_least_stage_that_does():
    """Mixtral 8x7B on 64 H100 at tp 2 with no sharding stated: at Megatron-LM's default
    (ZeRO-0) its 16 bytes of states per parameter need 372 GB a GPU even with full
    recompute, yet the run ran; so the least stage that fits (ZeRO-3 here), said so. A row
    that states its sharding is refused as before."""
    row = {**BY_ID["dgxc_llama31_8b_8"], "engine": "", "model": "Mixtral 8x7B",
           "model_key": "mixtral-8x7b", "num_accel": "64", "TP": "2", "PP": "1", "DP": "",
           "CP": "1", "EP": "1", "seq_len": "4096", "global_batch_seqs": "256",
           "tokens_per_step": "", "microbatch": "", "zero_or_fsdp": "", "recompute": "",
           "source": "a lab", "source_location": ""}
    case = row_to_case(row)
    assert case.plan.zero == 3
    (d,) = [d for d in case.defaults if d[0] == "zero_or_fsdp"]
    assert d[1] == "ZeRO-3" and "ZeRO-0 (megatron's default) does not fit" in d[2]
    with pytest.raises(Skip, match="even with full recompute"):
        row_to_case({**row, "zero_or_fsdp": "none (data parallel all-reduce)"})
    with pytest.raises(Skip, match="even with full recompute"):
        row_to_case({**row, "zero_or_fsdp": "ZeRO-1"})


def test_an_engine_cell_naming_cudnn_runs_the_native_attention():
    # MaxText on B200 with attention: cudnn_flash_te (Google's gpu-recipes)
    row = BY_ID["gpur_a4_70b_256_fp8"]
    case = row_to_case(row)
    assert case.engine == "xla" and "cudnn" in case.engine_why
    from paratrain.systems.row_engine import case_engine

    assert case_engine(case).attention == "flash3"
    plain = row_to_case({**row, "engine": "MaxText (JAX)"})
    assert case_engine(plain).attention == "flash"


def test_sdpa_is_flashattention2_class_unless_the_cell_says_cudnn():
    """PyTorch's SDPA runs its flash backend (FlashAttention-2 class) before cuDNN's until
    torch 2.11: NeMo AutoModel's Llama 3.1 70B run (attn_implementation sdpa) is priced so,
    though its engine is NeMo's, whose own attention is cuDNN's through TE."""
    from paratrain.systems.row_engine import case_engine

    row = BY_ID["automodel_llama3_70b_64"]
    assert case_engine(row_to_case(row)).attention == "flash"
    te = row_to_case({**row, "engine": "NeMo AutoModel (FSDP2, TE)"})
    assert case_engine(te).attention == "flash3"
    both = row_to_case({**row, "engine": "torchtitan (FSDP2, SDPA with its cuDNN backend)"})
    assert case_engine(both).attention == "flash3"


@pytest.mark.parametrize("precision", ["NVFP4", "MXFP4 (Transformer Engine)", "fp4"])
def test_a_four_bit_run_is_refused_by_name_not_priced_as_bf16(precision):
    """Megatron-Bridge publishes NVFP4 runs; the model prices FP8 and 16-bit GEMMs only,
    so such a row is not scored, with its reason, rather than priced as BF16."""
    row = BY_ID["mb2604_gptoss_120b_gb300_bf16_64"]
    with pytest.raises(Skip, match="4-bit training GEMMs are not priced"):
        row_to_case({**row, "precision": precision})
    assert row_to_case({**row, "precision": "MXFP8"}).precision == "MXFP8"


def test_eager_attention_is_an_era_not_a_choice_after_flashattention():
    """DeepSpeed's default (eager attention) and an fp16 run's era price the s x s scores
    through HBM on the chips from before FlashAttention (the table's DeepSpeed and fp16
    rows, all A100); the same rows on an H100 run FlashAttention-2 class, unless the row
    names its kernel, and are priced faster by what the scores' traffic cost."""
    bloom, opt = BY_ID["bloom_176b"], BY_ID["narayanan21_t1_1.7B"]
    assert case_kernel(row_to_case(bloom)) == case_kernel(row_to_case(opt)) == "eager"
    for row in (bloom, opt):
        a100, h100 = (row_to_case({**row, "accelerator": acc})
                      for acc in (row["accelerator"], "H100-SXM5-80GB"))
        assert case_kernel(h100) == "flash"
        said = dataclasses.replace(h100, engine_options=(*h100.engine_options,
                                                         ("attention", "eager")))
        assert case_kernel(said) == "eager"  # a kernel the row names is the row's
        fast, slow = (predict(c, load_params()) for c in (h100, said))
        assert fast > slow  # the metric is throughput (MFU or TFLOP/s)
    # an fp16 A100 run that names its kernel runs it: Megatron-DeepSpeed's GPT-3 125M
    # with FlashAttention 1 (its era's rule had made every fp16 A100 row eager)
    fa1 = row_to_case({**opt, "engine": "Megatron-DeepSpeed, FlashAttention 1"})
    assert case_kernel(fa1) == "flash1"
    assert case_kernel(row_to_case({**opt, "engine": "Megatron-DeepSpeed"})) == "eager"


def test_an_eight_bit_run_on_a_chip_without_an_eight_bit_peak_is_refused():
    """FP8 on an A100 (no FP8 tensor cores, no 8-bit peak in the catalogue) is a row the
    model cannot price as stated: refused with its reason, not priced at the 16-bit peak
    with FP8's casts added."""
    row = {**BY_ID["bloom_176b"], "precision": "fp8"}
    with pytest.raises(Skip, match="no 8-bit matmul peak"):
        row_to_case(row)
    assert row_to_case({**row, "accelerator": "H100-SXM5-80GB"}).precision == "fp8"


def test_a_row_with_only_its_step_time_is_scored_as_its_tokens_per_second():
    """Many tables publish a step (iteration) time and the batch, not tokens/s: such a row
    is scored as the tokens/s they give (tokens per step / step / GPUs), not refused."""
    row = BY_ID["titan_llama3_8b_a100_64_sacop"]
    tps = float(row["tokens_per_s_per_accel"])
    tokens = int(row["seq_len"]) * int(row["global_batch_seqs"])
    step = tokens / tps / int(row["num_accel"])
    bare = {**row, "tokens_per_s_per_accel": "", "mfu_pct": "", "hfu_pct": "",
            "tflops_per_accel_reported": "", "metric": ""}
    timed = row_to_case({**bare, "step_time_s": f"{step:.6f}"})
    assert timed.reported == pytest.approx(row_to_case(row).reported, rel=1e-5)
    assert row_to_case({**bare, "step_time_s": f"{step:.6f}", "metric": "step"}).reported \
        == timed.reported
    with pytest.raises(Skip, match="or a step time with its tokens per step"):
        row_to_case({**bare, "step_time_s": ""})


def test_a_blank_gpu_count_is_the_product_of_the_layout_it_names():
    """A row that names TP, PP and DP but not its GPU count is priced on their product
    (and CP's), the default listed; with an axis blank too it is refused, saying why."""
    row = BY_ID["titan_llama3_8b_a100_64_sacop"]
    blank = row_to_case({**row, "num_accel": ""})
    assert blank.plan.world_size == 64 and blank.reported == row_to_case(row).reported
    assert ("num_accel", 64, "blank: TP x PP x DP x CP") in blank.defaults
    with pytest.raises(Skip, match="no num_accel"):
        row_to_case({**row, "num_accel": "", "DP": ""})


def test_numbers_are_read_as_tables_print_them():
    """A figure copied from a table keeps its thousands separators or its % sign; a
    cell that is no number stays None (the reader then says what is missing)."""
    from paratrain.systems.row_fields import num

    assert num({"k": "15,876"}, "k", int) == 15876 and num({"k": "8_192"}, "k", int) == 8192
    assert num({"k": "58.2%"}, "k") == 58.2 and num({"k": "1,234,567.5"}, "k") == 1234567.5
    assert num({"k": "2,4"}, "k") is None and num({"k": "n/a"}, "k") is None
    # sizes with K / M are binary where whole numbers are set, decimal where measured;
    # a unit word after the number and a leading "~" are dropped
    for text, kind, value in (("8K", int, 8192), ("128K tokens", int, 131072),
                              ("16K GPUs", int, 16384), ("4M", int, 4194304),
                              ("15.9k", float, 15900.0), ("64 GPUs", int, 64),
                              ("~400", float, 400.0), ("1e6", float, 1e6)):
        assert num({"k": text}, "k", kind) == value, text
    assert num({"k": "405B"}, "k") is None  # a billions column says it in its name
    # a count as nodes times accelerators, a parenthetical after it, a time in ms or
    # minutes; a count of nodes is no count of accelerators
    for text, kind, value in (("8x8", int, 64), ("16 \u00d7 8 GPUs", int, 128),
                              ("64 (8 nodes)", int, 64), ("1500 ms", float, 1.5),
                              ("2 min", float, 120.0), ("1.5 s", float, 1.5)):
        assert num({"k": text}, "k", kind) == value, text
    assert num({"k": "8 nodes"}, "k", int) is None
    row = BY_ID["titan_llama3_8b_a100_64_sacop"]
    assert row_to_case({**row, "seq_len": "8K"}).seq_len == 8192
    # an MFU written as a fraction is the percent it is
    mfu = BY_ID["dgxc_gpt3_175b_128"]
    as_pct = row_to_case({**mfu, "metric": "mfu"}).reported
    frac = float(mfu["mfu_pct"]) / 100
    assert row_to_case({**mfu, "metric": "mfu", "mfu_pct": str(frac)}).reported == \
        pytest.approx(as_pct)
    assert row_to_case({**row, "tokens_per_s_per_accel": "2,973"}).reported == \
        row_to_case(row).reported


def test_a_model_named_inside_free_text_is_the_catalogue_model():
    """A source's model cell with words around the name ("Llama-3-8B trained with FSDP")
    is the longest catalogue name it contains as whole words; "Llama 3.1 8B" is not
    Llama 3 8B, and text naming none is still refused, saying so."""
    row = {**BY_ID["titan_llama3_8b_a100_64_sacop"], "model_key": ""}
    for text, name in (("Llama-3-8B trained with FSDP", "Llama 3 8B"),
                       ("our Llama 3.1 8B run", "Llama 3.1 8B"),
                       ("Mixtral 8x22B MoE", "Mixtral 8x22B")):
        assert row_to_case({**row, "model": text}).model.name == name, text
    with pytest.raises(Skip, match="is not in the model catalogue"):
        row_to_case({**row, "model": "some 13B model"})
