"""Which transformers architecture computes a paratrain model, and what each tensor is
called there: the one table export (:mod:`paratrain.files.export`) writes with and
import (:mod:`paratrain.files.hf_import`) reads with (docs/export.md).

paratrain's decoder is Llama's; with q, k, v biases (``qkv_bias``) Qwen2's, with per-head
q, k norms (``qk_norm``) Qwen3's; a dropless Mixture of Experts (softmax router, top k)
is Mixtral's (weights renormalised over the k, no shared experts), Qwen3-MoE's (the q, k
norms, no shared experts) or Qwen2-MoE's (the q, k, v biases and a sigmoid-gated shared
expert). A Phi-3 folder (Phi-3, Phi-4) is Llama's decoder with the q, k, v projections
and the MLP's gate and up stored fused (:data:`FUSED`): read, not written. Torch-free:
the launcher reads it before any worker starts.

The RoPE layout is the one difference that is not a name: paratrain rotates interleaved
pairs (x[2i], x[2i+1]), transformers rotates halves (x[i], x[i + E/2]).
:func:`interleaved_to_halves` moves the rows of each head of ``wq`` and ``wk`` (and of
their biases and the q, k norms' gains, which act per row of a head) so that pair i lands
on (i, i + E/2): q.k within a head is unchanged by the same permutation of both, an
RMSNorm's mean of squares by any.
"""

from __future__ import annotations

from paratrain.config import ModelConfig

# model_type -> the transformers class of a folder (import reads them all; export writes
# all but Mistral's and Phi-3's, as the Llama folder that computes the same)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "phi3": "Phi3ForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}
# paratrain name -> transformers name, per block ({i} = block index)
BLOCK_NAMES = {"attn_norm.weight": "input_layernorm.weight",
               "attn.wq.weight": "self_attn.q_proj.weight",
               "attn.wk.weight": "self_attn.k_proj.weight",
               "attn.wv.weight": "self_attn.v_proj.weight",
               "attn.wo.weight": "self_attn.o_proj.weight",
               "mlp_norm.weight": "post_attention_layernorm.weight",
               "mlp.w_gate.weight": "mlp.gate_proj.weight",
               "mlp.w_up.weight": "mlp.up_proj.weight",
               "mlp.w_down.weight": "mlp.down_proj.weight"}
QKV_BIAS_NAMES = {f"attn.w{x}.bias": f"self_attn.{x}_proj.bias" for x in "qkv"}  # Qwen2
QK_NORM_NAMES = {f"attn.{x}_norm.weight": f"self_attn.{x}_norm.weight" for x in "qk"}  # Qwen3
DENSE_MLP = ("mlp.w_gate.weight", "mlp.w_up.weight", "mlp.w_down.weight")
# an MoE block's MLP per model_type: the router, then each expert's gate, up and down
MOE_NAMES = {"mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.",
                         ("w1", "w3", "w2")),
             "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{e}.",
                           ("gate_proj", "up_proj", "down_proj"))}
MOE_NAMES["qwen2_moe"] = MOE_NAMES["qwen3_moe"]
SHARED_NAMES = {"mlp.shared.w_gate.weight": "mlp.shared_expert.gate_proj.weight",
                "mlp.shared.w_up.weight": "mlp.shared_expert.up_proj.weight",
                "mlp.shared.w_down.weight": "mlp.shared_expert.down_proj.weight",
                "mlp.shared_gate.weight": "mlp.shared_expert_gate.weight"}  # Qwen2-MoE
# fused tensors a folder may hold (import only: export writes the unfused architecture
# that computes the same): per block, theirs -> the paratrain tensors it stacks by rows
FUSED = {"phi3": {"self_attn.qkv_proj.weight": ("attn.wq.weight", "attn.wk.weight",
                                                "attn.wv.weight"),
                  "mlp.gate_up_proj.weight": ("mlp.w_gate.weight", "mlp.w_up.weight")}}
# tensors whose rows are permuted between the RoPE layouts
ROPE_ROWS = ("attn.wq.weight", "attn.wk.weight", "attn.wq.bias", "attn.wk.bias",
             *QK_NORM_NAMES)


def architecture(cfg: ModelConfig) -> str:
    """The model_type of the transformers class that computes ``cfg``
    (:data:`ARCHITECTURES` names the class); one ValueError naming what none computes."""
    if cfg.qkv_bias and cfg.qk_norm:
        raise ValueError("this model has both q, k, v biases and q, k norms; no transformers "
                         "architecture computes that (Qwen2 has the first, Qwen3 the "
                         "second): train with one of them")
    if not cfg.experts:
        if cfg.qk_norm:
            return "qwen3"
        return "qwen2" if cfg.qkv_bias else "llama"
    qwen2 = cfg.qkv_bias and cfg.shared_gate  # Qwen2-MoE: both, or neither
    odd = {"capacity_factor": cfg.capacity_factor,
           "shared_experts": cfg.shared_experts and not qwen2,
           "qkv_bias": cfg.qkv_bias and not qwen2}
    odd = {k: v for k, v in odd.items() if v}
    if odd:
        said = ", ".join(f"{k} = {getattr(cfg, k)}" for k in odd)
        raise ValueError(f"this Mixture-of-Experts model has {said}; transformers' Mixtral, "
                         "Qwen2-MoE and Qwen3-MoE are dropless, and only Qwen2-MoE has shared "
                         "experts (gated: shared_gate) and q, k, v biases (both): export a "
                         "model trained without them, or with both")
    if qwen2:
        return "qwen2_moe"
    if cfg.qk_norm:
        return "qwen3_moe"
    if cfg.moe_every != 1 or not cfg.moe_renorm:
        raise ValueError(f"this Mixture-of-Experts model has moe_every = {cfg.moe_every}, "
                         f"moe_renorm = {cfg.moe_renorm}; Mixtral's every block is MoE and "
                         "renormalises its top k (Qwen3-MoE's decoder_sparse_step and "
                         "norm_topk_prob need its q, k norms): export a model with "
                         "moe_every 1 and moe_renorm true")
    return "mixtral"


def block_names(cfg: ModelConfig, i: int) -> dict[str, str]:
    """paratrain name -> transformers name of each of block ``i``'s tensors."""
    names = {**BLOCK_NAMES, **(QKV_BIAS_NAMES if cfg.qkv_bias else {}),
             **(QK_NORM_NAMES if cfg.qk_norm else {})}
    if not cfg.is_moe_layer(i):
        return names
    for k in DENSE_MLP:
        del names[k]
    router, prefix, theirs = MOE_NAMES[architecture(cfg)]
    names["mlp.router.weight"] = router
    if cfg.shared_experts:
        names.update(SHARED_NAMES)
    for e in range(cfg.experts):
        for ours, name in zip(("w_gate", "w_up", "w_down"), theirs, strict=True):
            names[f"mlp.experts.{e}.{ours}.weight"] = f"{prefix.format(e=e)}{name}.weight"
    return names


def tensor_names(cfg: ModelConfig) -> dict[str, str]:
    """paratrain name -> transformers name of every tensor of the Decoder's state_dict
    (a tied head is the embedding's: not listed)."""
    out = {"tok_emb.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        out["head.weight"] = "lm_head.weight"
    for i in range(cfg.n_layers):
        for ours, theirs in block_names(cfg, i).items():
            out[f"blocks.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
    return out


def folder_names(cfg: ModelConfig, kind: str) -> dict[str, tuple[str, ...]]:
    """transformers name -> the paratrain tensors it holds (one, or several stacked by
    rows in a ``kind`` folder's fused tensors, :data:`FUSED`)."""
    names = tensor_names(cfg)
    out = {theirs: (ours,) for ours, theirs in names.items()}
    for i in range(cfg.n_layers):
        for theirs, parts in FUSED.get(kind, {}).items():
            for ours in parts:
                del out[names[f"blocks.{i}.{ours}"]]
            out[f"model.layers.{i}.{theirs}"] = tuple(f"blocks.{i}.{p}" for p in parts)
    return out


def rope_rows(name: str) -> bool:
    """Whether the paratrain tensor ``name`` has its rows in the RoPE layout."""
    return name.startswith("blocks.") and name.split(".", 2)[2] in ROPE_ROWS


def interleaved_to_halves(w, head_dim: int):
    """Rows of a q or k projection (heads x E, ...) reordered so that each head's
    interleaved RoPE pairs (2i, 2i+1) become rotate-half pairs (i, i + E/2)."""
    heads = w.shape[0] // head_dim
    return w.view(heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def halves_to_interleaved(w, head_dim: int):
    """The inverse of :func:`interleaved_to_halves` (a transformers q or k projection back
    into paratrain's row order); exact: rows move, no arithmetic."""
    heads = w.shape[0] // head_dim
    return w.view(heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(w.shape)
