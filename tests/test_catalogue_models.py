"""Catalogue entries for open models that published throughput runs name
(``src/paratrain/cost/data/models.toml``): each entry's counts reproduce the published
parameter count within a few percent, the spellings a runs table uses find it, and the
names that found other entries before still find them."""

from __future__ import annotations

import pytest

from paratrain.cost.catalogue import named_in
from paratrain.cost.shapes import ModelShape, load_model


def _embeddings(m: ModelShape) -> int:
    """The token embedding and output matrices (one when tied)."""
    return m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2)


def _all(m: ModelShape, active: bool) -> int:
    return m.active_params() if active else m.num_params()


def _no_embedding(m: ModelShape, active: bool) -> int:
    return _all(m, active) - _embeddings(m)


def _active_without_embedding(m: ModelShape, active: bool) -> int:
    """Z.ai's GLM-4.5 counts: the total every parameter, the active count the blocks a
    token uses, no embedding matrix."""
    return _no_embedding(m, active) if active else _all(m, active)


# key, spellings a runs table or a Hugging Face id uses, published total (None: not
# published), published active (None: dense), how the publisher counts (_all: every
# parameter; _no_embedding: without the embedding matrices), relative tolerance
NEW = [
    ("qwen2.5-0.5b", ["Qwen2.5-0.5B (torchtitan)", "Qwen/Qwen2.5-0.5B-Instruct",
                      "Qwen2.5 0.5B"], 0.49e9, None, _all, 0.02),
    ("qwen2.5-1.5b", ["Qwen2.5-1.5B (torchtitan)", "Qwen2.5 1.5B", "Qwen2.5-1.5B-Instruct"],
     1.54e9, None, _all, 0.02),
    ("qwen2.5-3b", ["Qwen2.5-3B", "Qwen/Qwen2.5-3B-Instruct", "qwen-2.5-3b"], 3.09e9, None,
     _all, 0.02),
    ("qwen3-0.6b", ["Qwen3-0.6B", "Qwen/Qwen3-0.6B-Base", "Qwen3 0.6B (torchtitan)"], 0.6e9,
     None, _all, 0.02),
    ("qwen3-1.7b", ["Qwen3-1.7B", "Qwen3 1.7B", "Qwen/Qwen3-1.7B-Base"], 1.7e9, None, _all,
     0.02),
    ("qwen1.5-moe-a2.7b", ["Qwen1.5-MoE-A2.7B", "Qwen/Qwen1.5-MoE-A2.7B-Chat"], 14.3e9,
     2.7e9, _all, 0.02),
    ("glm-4.5", ["GLM-4.5 (Megatron-Bridge)", "zai-org/GLM-4.5", "GLM 4.5"], 355e9, 32e9,
     _active_without_embedding, 0.02),
    ("glm-4.5-air", ["GLM-4.5-Air", "zai-org/GLM-4.5-Air-Base", "GLM 4.5 Air"], 106e9, 12e9,
     _active_without_embedding, 0.02),
    ("moonlight-16b-a3b", ["Moonlight-16B-A3B (Megatron-Bridge)",
                           "moonshotai/Moonlight-16B-A3B-Instruct", "Moonlight 16B"],
     16e9, 3e9, _all, 0.04),
    ("deepseek-moe-16b", ["DeepSeekMoE 16B", "deepseek-ai/deepseek-moe-16b-base",
                          "DeepSeek-MoE-16B"], 16.4e9, 2.8e9, _all, 0.02),
    # the Phi-3 report gives the active count only (41.9e9 in all here)
    ("phi-3.5-moe", ["Phi-3.5-MoE", "microsoft/Phi-3.5-MoE-instruct"], None, 6.6e9, _all,
     0.02),
    ("gemma3-1b", ["Gemma 3 1B", "google/gemma-3-1b-it", "gemma-3-1b-pt"], 1e9, None, _all,
     0.02),
    ("mistral-small-24b", ["Mistral-Small-24B-Base-2501", "Mistral Small 3 24B",
                           "mistralai/Mistral-Small-24B-Instruct-2501"], 24e9, None, _all,
     0.03),
    ("codellama-34b", ["Code Llama 34B", "codellama/CodeLlama-34b-hf",
                       "Llama 2 34B (fms-fsdp)", "Llama-2-34B"], 34e9, None, _all, 0.02),
    # InternLM2 7B's name counts the blocks only (7.74e9 with both embedding matrices)
    ("internlm2-7b", ["InternLM2 7B", "internlm/internlm2-7b", "internlm2_7B (InternEvo)"],
     7e9, None, _no_embedding, 0.02),
    ("internlm2-20b", ["InternLM2 20B", "internlm/internlm2-20b"], 20e9, None, _all, 0.02),
    ("granite-3.0-8b", ["Granite 3.0 8B", "ibm-granite/granite-3.0-8b-base",
                        "Granite-3.0-8B-Instruct"], 8e9, None, _all, 0.03),
    ("olmo2-32b", ["OLMo 2 32B", "allenai/OLMo-2-0325-32B", "OLMo-2-0325-32B-Instruct"],
     32e9, None, _all, 0.02),
    ("smollm2-1.7b", ["SmolLM2-1.7B", "HuggingFaceTB/SmolLM2-1.7B-Instruct"], 1.7e9, None,
     _all, 0.02),
    ("smollm3-3b", ["SmolLM3-3B", "HuggingFaceTB/SmolLM3-3B-Base", "SmolLM3 3B (nanotron)"],
     3e9, None, _all, 0.03),
    ("gpt2-124m", ["GPT-2 small", "gpt2", "GPT-2 124M (nanoGPT)"], 124e6, None, _all, 0.01),
    ("gpt2-355m", ["GPT-2 medium", "gpt2-medium", "GPT-2 355M"], 350e6, None, _all, 0.02),
    ("gpt2-774m", ["GPT-2 large", "gpt2-large", "GPT-2 774M"], 774e6, None, _all, 0.01),
    ("gpt2-1.5b", ["GPT-2 XL", "gpt2-xl", "GPT-2 1.5B"], 1558e6, None, _all, 0.01),
    ("falcon-7b", ["Falcon-7B", "tiiuae/falcon-7b-instruct", "Falcon 7B"], 7e9, None, _all,
     0.02),
    ("falcon-40b", ["Falcon-40B", "tiiuae/falcon-40b-instruct", "Falcon 40B"], 40e9, None, _all,
     0.04),  # 41.3e9: "40B" by name
    ("falcon-180b", ["Falcon-180B", "tiiuae/falcon-180B-chat", "Falcon 180B"], 180e9, None,
     _all, 0.02),
]


@pytest.mark.parametrize("key, spellings, total, active, count, tol", NEW,
                         ids=[e[0] for e in NEW])
def test_new_entries_count_their_published_size_and_are_found(key, spellings, total,
                                                              active, count, tol):
    m = load_model(key)
    if total is not None:
        assert count(m, active=False) == pytest.approx(total, rel=tol)
    if active is None:
        assert m.active_params() == m.num_params()
    else:
        assert m.is_moe
        assert count(m, active=True) == pytest.approx(active, rel=tol)
    for text in spellings:
        assert named_in(text, "models.toml") == key, text


def test_shapes_the_counts_rest_on():
    for key, dense in (("glm-4.5", 3), ("glm-4.5-air", 1)):
        glm = load_model(key)  # one MTP depth (priced as work, not counted), 1 shared expert
        assert (glm.mtp_layers, glm.shared_experts, glm.first_dense_layers) == (1, 1, dense)
    q = load_model("qwen1.5-moe-a2.7b")  # one gated shared expert of 5632 = 4 x 1408
    assert q.shared_experts * q.expert_ffn == 5632 and q.shared_gate and not q.moe_renorm
    g = load_model("gemma3-1b")  # five 512-token sliding-window layers, then a global one
    assert (g.local_window, g.global_every) == (512, 6)
    assert [g.is_local_layer(i) for i in range(6)] == [True] * 5 + [False]
    ml = load_model("moonlight-16b-a3b")
    assert ml.is_mla and ml.q_lora_rank == 0 and ml.first_dense_layers == 1
    f7, f180 = load_model("falcon-7b"), load_model("falcon-180b")
    assert (f7.kv_heads, f7.norms_per_layer, f180.kv_heads, f180.norms_per_layer) == (1, 1, 8, 2)
    assert f7.mlp == f180.mlp == "gelu" and f180.d_ff == 4 * f180.d_model
    gpt2 = load_model("gpt2-124m")
    assert gpt2.learned_positions and gpt2.bias and gpt2.tie_embeddings


def test_torchtitan_deepseek_v3_16b_is_deepseek_v2_lite():
    """torchtitan's deepseek_v3 "16B" flavor: 27 layers (1 dense of 10944), d 2048, 16 MLA
    heads (no q compression, kv rank 512, qk 128+64, v 128), 64 experts of 1408 + 2
    shared, top-6, vocabulary 102400."""
    for text in ("DeepSeek-V3 16B (torchtitan)", "deepseek-v3-16b", "DeepSeek-V3 16B"):
        assert named_in(text, "models.toml") == "deepseek-v2-lite", text
    m = load_model("DeepSeek-V3 16B")
    assert (m.n_layers, m.d_model, m.n_heads, m.d_ff, m.vocab_size) == \
        (27, 2048, 16, 10944, 102400)
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_dim, m.qk_rope_dim, m.v_head_dim) == \
        (0, 512, 128, 64, 128)
    assert (m.experts, m.moe_ffn, m.shared_experts, m.top_k, m.first_dense_layers) == \
        (64, 1408, 2, 6, 1)
    assert not m.tie_embeddings


@pytest.mark.parametrize("text, key", [
    ("Qwen2-7B", "qwen2.5-7b"), ("Qwen/Qwen2-7B-Instruct", "qwen2.5-7b"),
    ("DeepSeek-V2.5", "deepseek-v2"), ("deepseek-ai/DeepSeek-V2.5", "deepseek-v2"),
    ("Llama 3.1 Nemotron 70B", "llama3.1-70b"),
    ("nvidia/Llama-3.1-Nemotron-70B-Instruct-HF", "llama3.1-70b"),
])
def test_aliases_on_existing_entries(text, key):
    assert named_in(text, "models.toml") == key


@pytest.mark.parametrize("text, key", [
    ("DeepSeek-V3 671B", "deepseek-v3"), ("DeepSeek-V3 671B (Megatron-Bridge)", "deepseek-v3"),
    ("DeepSeek V3 671B (NeMo AutoModel)", "deepseek-v3"), ("DeepSeek-V2-Lite", "deepseek-v2-lite"),
    ("Qwen3-30B-A3B", "qwen3-30b-a3b"), ("Qwen3-30B-A3B (Megatron-Bridge)", "qwen3-30b-a3b"),
    ("Qwen3-235B-A22B (MaxText, TPU7x Ironwood)", "qwen3-235b-a22b"),
    ("Qwen3 8B (torchtitan)", "qwen3-8b"), ("Qwen2.5-7B", "qwen2.5-7b"),
    ("Qwen2-72B", "qwen2.5-72b"),
    ("Llama 3.1 405B", "llama3.1-405b"), ("Llama 3.1 70B (NeMo)", "llama3.1-70b"),
    ("Llama 3 8B (torchtitan)", "llama3-8b"), ("Llama 2 13B (torchtitan)", "llama2-13b"),
    ("Mistral 7B (MaxText, TPU v6e)", "mistral-7b"),
    ("Gemma 3 12B (MaxText, TPU v6e)", "gemma3-12b"),
    ("GPT3-125M (FlashAttention training)", "gpt3-125m"), ("GPT-3 175B (NeMo)", "gpt3-175b"),
    ("OLMo 7B (OLMo-core olmo_7B)", "olmo-7b"), ("OLMo 2 7B", "olmo2-7b"),
    ("Kimi K2 (Megatron-Bridge)", "kimi-k2"), ("gpt-oss-120b (MaxText, TPU7x Ironwood)",
                                               "gpt-oss-120b"),
    # names no entry holds stay unresolved
    ("InternLM 7B (InternEvo)", None), ("GLM-130B", None), ("Falcon3-7B", None),
    ("GLM-4.5V", None), ("Mistral-Small-3.1-24B-Instruct-2503", None),
    ("tiiuae/Falcon-H1-34B-Base", None),  # a hybrid: test_systems_catalogue's example
])
def test_existing_names_resolve_as_before(text, key):
    assert named_in(text, "models.toml") == key
