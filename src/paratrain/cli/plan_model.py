"""The model `paratrain plan --model` prices: a catalogue entry or a .toml/.json file
(default llama2-7b), or a Hugging Face folder's config.json, with the model flags given
(a shape field replaced, made MoE by ``--experts``). Importing this module does not
import torch."""

from __future__ import annotations

from pathlib import Path

from paratrain.cost.shapes import ModelShape, load_model
from paratrain.files.hf_import import hf_model_fields, read_config


def hf_folder(name: str | None) -> str | None:
    """``name`` when ``--model`` names a Hugging Face folder (a directory), else None."""
    return name if name is not None and Path(name).is_dir() else None


def _named(name: str | None):
    """The model ``--model`` names: a catalogue entry or file (default llama2-7b), or a
    Hugging Face folder read as `train --init-from` reads its config.json (no weights
    needed; what paratrain's model cannot compute is refused the same way)."""
    if hf_folder(name) is None:
        return load_model(name or "llama2-7b")
    fields = hf_model_fields(read_config(name), str(Path(name) / "config.json"))
    return ModelShape(name=Path(name).resolve().name, **fields)


def model_shape(name: str | None, values: dict):
    """The catalogue model (default llama2-7b) with the model flags given: a shape field
    replaced, made MoE by ``--experts``."""
    m = _named(name)
    moe = ("experts", "top_k", "moe_ffn", "shared_experts")
    shape = {k: v for k, v in values.items() if k not in moe and k != "context"}
    m = m.replace(**shape) if shape else m
    experts = values.get("experts", 0)
    if experts < 0:
        raise ValueError(f"experts={experts} must be >= 0; pass e.g. --experts 8")
    if not experts:
        return m
    top_k = values.get("top_k", 2)
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k={top_k} must be in 1..experts={experts}; pass e.g. "
                         "--top-k 2")
    # how the experts split over ranks is the plan's (--ep, --etp), not the shape's
    return m.replace(experts=experts, top_k=top_k, moe_ffn=values.get("moe_ffn"),
                     shared_experts=values.get("shared_experts", 0), first_dense_layers=0)
