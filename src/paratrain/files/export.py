"""A checkpoint as a Hugging Face folder that ``transformers`` loads as
``LlamaForCausalLM`` with the same logits (docs/export.md).

paratrain's dense decoder *is* Llama: pre-norm RMSNorm (same eps, computed in float32),
SwiGLU MLP (gate, up, down; no biases), causal attention with GQA and scale 1/sqrt(E),
RoPE with the same theta and frequencies, a final RMSNorm and an optional tied head. One
difference is layout, not function: paratrain rotates interleaved pairs (x[2i],
x[2i+1]) (Su et al. 2021, as Meta's Llama code), transformers rotates halves (x[i],
x[i + E/2]). Permuting the rows of each head of wq and wk so that pair i lands on
(i, i + E/2) makes the two identical: q.k within a head is unchanged by the same
permutation of both, and v, wo are untouched (Meta's own conversion script does this).

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
from paratrain.files.inference import Loaded

# paratrain name -> transformers name, per block ({i} = block index); the one mapping,
# which import (paratrain/files/hf_import.py) inverts
BLOCK_NAMES = {"attn_norm.weight": "input_layernorm.weight",
          "attn.wq.weight": "self_attn.q_proj.weight",
          "attn.wk.weight": "self_attn.k_proj.weight",
          "attn.wv.weight": "self_attn.v_proj.weight",
          "attn.wo.weight": "self_attn.o_proj.weight",
          "mlp_norm.weight": "post_attention_layernorm.weight",
          "mlp.w_gate.weight": "mlp.gate_proj.weight",
          "mlp.w_up.weight": "mlp.up_proj.weight",
          "mlp.w_down.weight": "mlp.down_proj.weight"}
ROPE_ROWS = ("attn.wq.weight", "attn.wk.weight")  # rows permuted between the layouts


def interleaved_to_halves(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of a q or k projection (heads x E, D) reordered so that each head's
    interleaved RoPE pairs (2i, 2i+1) become rotate-half pairs (i, i + E/2)."""
    heads = w.shape[0] // head_dim
    return w.view(heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def halves_to_interleaved(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The inverse of :func:`interleaved_to_halves` (a transformers q or k projection back
    into paratrain's row order); exact: rows move, no arithmetic."""
    heads = w.shape[0] // head_dim
    return w.view(heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(w.shape)


def rope_scaling(cfg: ModelConfig) -> dict:
    """``cfg``'s RoPE as transformers names it: rope_type "default", or "llama3" with its
    four numbers (:data:`paratrain.files.hf_import.LLAMA3_ROPE`, read back on import)."""
    if cfg.rope_factor == 1.0:
        return {"rope_type": "default"}
    return {"rope_type": "llama3", "factor": cfg.rope_factor,
            "low_freq_factor": cfg.rope_low_freq, "high_freq_factor": cfg.rope_high_freq,
            "original_max_position_embeddings": cfg.rope_original_context}


def hf_config(cfg: ModelConfig) -> dict:
    """config.json of the LlamaForCausalLM that computes what ``cfg`` computes."""
    rope = rope_scaling(cfg)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.context, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,  # transformers 4.x
        "rope_parameters": {"rope_theta": cfg.rope_theta, **rope},  # 5.x
        **({"rope_scaling": rope} if rope["rope_type"] != "default" else {}),  # 4.x
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
        "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        "torch_dtype": "float32", "use_cache": True,
    }


def hf_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The Decoder's state_dict under Llama's names (RoPE rows permuted; see above)."""
    out = {"model.embed_tokens.weight": state["tok_emb.weight"],
           "model.norm.weight": state["norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["head.weight"]
    for i in range(cfg.n_layers):
        for ours, theirs in BLOCK_NAMES.items():
            w = state[f"blocks.{i}.{ours}"]
            if ours in ROPE_ROWS:
                w = interleaved_to_halves(w, cfg.head_dim)
            out[f"model.layers.{i}.{theirs}"] = w
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


def export(run: Loaded, out_dir: str | Path) -> list[Path]:
    """Write the Hugging Face folder; returns the files written."""
    cfg = run.model.cfg
    if cfg.experts:
        raise ValueError(f"this checkpoint is a Mixture-of-Experts model (experts="
                         f"{cfg.experts}); export writes LlamaForCausalLM, which is dense: "
                         "export a model trained without --experts")
    out = check_out(out_dir)
    try:
        return _write(run, cfg, out)
    except OSError as e:
        raise ValueError(f"--out {str(out_dir)!r}: writing {e.filename or out} failed "
                         f"({e.strerror}); pass a folder you can write") from None


def _write(run: Loaded, cfg: ModelConfig, out: Path) -> list[Path]:
    from safetensors.torch import save_file

    from paratrain.files.atomic import default_mode

    out.mkdir(parents=True, exist_ok=True)
    files = [out / n for n in ("config.json", "model.safetensors", "tokenizer.json",
                               "tokenizer_config.json")]
    files[0].write_text(json.dumps(hf_config(cfg), indent=1) + "\n")
    save_file(hf_state_dict(run.model.state_dict(), cfg), str(files[1]),
              metadata={"format": "pt"})
    os.chmod(files[1], default_mode())  # safetensors writes 0600; the rest follow the umask
    files[2].write_text(run.tokenizer.json)
    files[3].write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.context,
        "clean_up_tokenization_spaces": False, "add_bos_token": False,
        "add_eos_token": False}, indent=1) + "\n")
    return files
