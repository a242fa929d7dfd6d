"""A checkpoint as a Hugging Face folder that ``transformers`` loads with the same logits
(docs/export.md): ``LlamaForCausalLM``, or the architecture that computes the model
(Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE; :mod:`paratrain.files.hf_arch` decides, and names
every tensor there).

paratrain's dense decoder *is* Llama: pre-norm RMSNorm (same eps, computed in float32),
SwiGLU MLP (gate, up, down; no biases), causal attention with GQA and scale 1/sqrt(E),
RoPE with the same theta and frequencies, a final RMSNorm and an optional tied head. The
RoPE row order is the one difference that is not a name (``hf_arch.interleaved_to_halves``,
the permutation Meta's own conversion script applies).

Written: ``config.json``, ``model.safetensors`` (float32), ``tokenizer.json`` (for the
bytes tokenizer an equivalent byte-level one whose ids are the byte values),
``tokenizer_config.json``. transformers is not needed to export, only to load.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from paratrain.config import ModelConfig
from paratrain.files.hf_arch import (
    ARCHITECTURES,
    architecture,
    interleaved_to_halves,
    rope_rows,
    tensor_names,
)
from paratrain.files.inference import Loaded


def rope_scaling(cfg: ModelConfig) -> dict:
    """``cfg``'s RoPE as transformers names it: rope_type "default", or "llama3" with its
    four numbers (:data:`paratrain.files.hf_import.LLAMA3_ROPE`, read back on import)."""
    if cfg.rope_factor == 1.0:
        return {"rope_type": "default"}
    return {"rope_type": "llama3", "factor": cfg.rope_factor,
            "low_freq_factor": cfg.rope_low_freq, "high_freq_factor": cfg.rope_high_freq,
            "original_max_position_embeddings": cfg.rope_original_context}


def moe_config(cfg: ModelConfig, kind: str) -> dict:
    """config.json's Mixture-of-Experts keys (Mixtral's experts are ``intermediate_size``
    wide and its router renormalises over the k; Qwen's ``moe_intermediate_size``, with
    ``norm_topk_prob``, and Qwen2-MoE's gated shared expert
    ``shared_expert_intermediate_size``)."""
    if kind == "mixtral":
        return {"num_local_experts": cfg.experts, "num_experts_per_tok": cfg.top_k,
                "intermediate_size": cfg.expert_ffn, "router_jitter_noise": 0.0}
    if kind in ("qwen3_moe", "qwen2_moe"):
        shared = {"shared_expert_intermediate_size": cfg.shared_experts * cfg.expert_ffn,
                  "qkv_bias": True} if kind == "qwen2_moe" else {}
        return {"num_experts": cfg.experts, "num_experts_per_tok": cfg.top_k,
                "moe_intermediate_size": cfg.expert_ffn, "norm_topk_prob": cfg.moe_renorm,
                "decoder_sparse_step": cfg.moe_every, "mlp_only_layers": [], **shared}
    return {}


def hf_config(cfg: ModelConfig) -> dict:
    """config.json of the LlamaForCausalLM (or what :func:`hf_arch.architecture` names)
    that computes what ``cfg`` computes."""
    rope = rope_scaling(cfg)
    kind = architecture(cfg)
    return {
        "architectures": [ARCHITECTURES[kind]], "model_type": kind,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.context, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,  # transformers 4.x
        "rope_parameters": {"rope_theta": cfg.rope_theta, **rope},  # 5.x
        **({"rope_scaling": rope} if rope["rope_type"] != "default" else {}),  # 4.x
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
        "mlp_bias": False, "use_sliding_window": False, "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        "torch_dtype": "float32", "use_cache": True, **moe_config(cfg, kind),
    }


def hf_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The Decoder's state_dict under transformers' names (RoPE rows permuted)."""
    out = {theirs: interleaved_to_halves(state[ours], cfg.head_dim) if rope_rows(ours)
           else state[ours] for ours, theirs in tensor_names(cfg).items()}
    return {k: v.detach().float().contiguous().clone() for k, v in out.items()}


def check_out(out_dir: str | Path) -> Path:
    """``--out`` as a folder export can write, checked before the checkpoint is read:
    not a file, not under a file, and its nearest existing folder writable (a real
    probe: a read-only filesystem, or permissions, refuse it). One-line ValueError."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out_dir)!r} is a file; pass a directory")
    base = out
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise ValueError(f"--out {str(out_dir)!r} lies under {str(base)!r}, which is a file, "
                         "not a directory; pass a folder path outside it")
    try:
        with tempfile.TemporaryFile(dir=base):
            pass
    except OSError as e:
        raise ValueError(f"--out {str(out_dir)!r}: cannot write in {str(base)!r} "
                         f"({e.strerror}); pass a folder you can write") from None
    return out


def export(run: Loaded, out_dir: str | Path, eos: frozenset[int] = frozenset()) -> list[Path]:
    """Write the Hugging Face folder (``eos``: its end-of-sequence ids, in config.json and
    a generation_config.json); returns the files written."""
    cfg = run.model.cfg
    architecture(cfg)
    out = check_out(out_dir)
    try:
        return _write(run, cfg, out, eos)
    except OSError as e:
        raise ValueError(f"--out {str(out_dir)!r}: writing {e.filename or out} failed "
                         f"({e.strerror}); pass a folder you can write") from None


def _write(run: Loaded, cfg: ModelConfig, out: Path, eos: frozenset[int]) -> list[Path]:
    from safetensors.torch import save_file

    from paratrain.files.atomic import default_mode

    out.mkdir(parents=True, exist_ok=True)
    files = [out / n for n in ("config.json", "model.safetensors", "tokenizer.json",
                               "tokenizer_config.json")]
    config = hf_config(cfg)
    if eos:  # the end of sequence of the folder the run started from
        config["eos_token_id"] = sorted(eos)
        files.append(out / "generation_config.json")
        files[-1].write_text(json.dumps({"eos_token_id": sorted(eos)}) + "\n")
    files[0].write_text(json.dumps(config, indent=1) + "\n")
    save_file(hf_state_dict(run.model.state_dict(), cfg), str(files[1]),
              metadata={"format": "pt"})
    os.chmod(files[1], default_mode())  # safetensors writes 0600; the rest follow the umask
    files[2].write_text(run.tokenizer.json)
    files[3].write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.context,
        "clean_up_tokenization_spaces": False, "add_bos_token": False,
        "add_eos_token": False}, indent=1) + "\n")
    return files
