"""A trained run back in one process: the plain :class:`~paratrain.model.Decoder` with the
checkpoint's full weights, and the tokenizer the run trained with.

Whatever layout wrote the checkpoint, :func:`paratrain.files.checkpoint.load_full_model`
returns the unsharded state_dict; the tokenizer is the ``tokenizer.json`` that training
writes beside the step directories (checked against the sha256 in the step's meta).
Checkpoints written before tokenizers existed hold byte-level models: they get the bytes
tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from paratrain.config import ModelConfig
from paratrain.files.checkpoint import load_full_model
from paratrain.files.tokenizer import Tokenizer, bytes_tokenizer_json, sha256
from paratrain.model import Decoder


@dataclass
class Loaded:
    model: Decoder  # eval mode, float32, CPU
    tokenizer: Tokenizer
    meta: dict  # the step's meta.json


def load_tokenizer(root: str | Path, meta: dict) -> Tokenizer:
    """The run's tokenizer, from ``root/tokenizer.json`` (verified) or bytes."""
    info = meta.get("tokenizer") or {"spec": "bytes"}
    path = Path(root) / "tokenizer.json"
    if path.is_file():
        text = path.read_text()
        if info.get("sha256") not in (None, sha256(text)):
            raise ValueError(f"{str(path)!r} is not the tokenizer this checkpoint was trained "
                             "with (sha256 differs); restore the run's tokenizer.json")
        return Tokenizer(info["spec"], text)
    if info["spec"] != "bytes":
        raise ValueError(f"{str(path)!r} is missing: the checkpoint was trained with "
                         f"--tokenizer {info['spec']}; restore the run's tokenizer.json")
    return Tokenizer("bytes", bytes_tokenizer_json())


def load(root: str | Path) -> Loaded:
    """The newest intact checkpoint under ``root`` as a float32 model and its tokenizer
    (``meta["step"]`` says which step; a damaged newer one was passed over with one
    ``warning:`` line)."""
    if not Path(root).is_dir():
        raise ValueError(f"--checkpoint {str(root)!r} is not a directory; pass the "
                         "--checkpoint-dir of a training run")
    meta, state = load_full_model(root)  # warns about each damaged step it passes over
    model = Decoder(ModelConfig(**meta["model"]))
    try:
        model.load_state_dict({k: v.float() for k, v in state.items()})
    except RuntimeError as e:
        raise ValueError(f"checkpoint step {meta['step']} in {str(root)!r} does not hold the "
                         f"model its meta.json describes ({str(e).splitlines()[0][:160]}); "
                         "restore the step or remove it") from None
    return Loaded(model.float().eval(), load_tokenizer(root, meta), meta)


def eos_ids(folder: str | Path) -> frozenset[int]:
    """The end-of-sequence ids a Hugging Face folder names (``eos_token_id``, an id or a
    list, in generation_config.json, else config.json), or a checkpoint directory of a
    run started from one (its generation_config.json, :func:`keep_eos`); none: empty."""
    said = None
    for name in ("generation_config.json", "config.json"):
        try:
            said = json.loads((Path(folder) / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        if said is not None:
            break
    ids = said if isinstance(said, list) else [said]
    return frozenset(i for i in ids if isinstance(i, int) and not isinstance(i, bool))


def keep_eos(hf_dir: str | Path, checkpoint_dir: str | Path) -> None:
    """Write the folder's end-of-sequence ids beside a run's checkpoints (as its
    tokenizer.json is), so that generate and export from them stop and say where the
    folder does; nothing when it names none."""
    from paratrain.files.atomic import write_atomic

    ids = eos_ids(hf_dir)
    if ids:
        text = json.dumps({"eos_token_id": sorted(ids)}) + "\n"
        write_atomic(Path(checkpoint_dir) / "generation_config.json", text.encode())


def load_hf(hf_dir: str | Path, prompt: str, max_new_tokens: int) -> Loaded:
    """A Hugging Face folder (``generate --init-from``, read as ``train --init-from``
    reads it: :mod:`paratrain.files.hf_import`) as a float32 model, with the
    folder's ``tokenizer.json`` (none: bytes, for a vocabulary of 256). Its context is
    the prompt plus the new tokens, at most ``max_position_embeddings`` (and a Mistral
    window): every position transformers would give those ids, and no longer a KV cache
    than the text needs."""
    from paratrain.config import TrainConfig
    from paratrain.files import hf_import
    from paratrain.files.tokenizer import load as load_tokenizer_spec

    d = Path(hf_dir)
    raw = hf_import.read_config(d)
    path = d / "tokenizer.json"
    tok = load_tokenizer_spec(str(path)) if path.is_file() else \
        Tokenizer("bytes", bytes_tokenizer_json())
    need = max(1, len(tok.encode_text(prompt)) + max_new_tokens)
    context = min(need, *hf_import.context_limits(raw).values())
    mcfg, _ = hf_import.settle(str(d), ModelConfig(), TrainConfig(), None,
                               {"model": {"context": context}})
    if tok.vocab_size > mcfg.vocab_size or (tok.is_bytes and mcfg.vocab_size != tok.vocab_size):
        raise ValueError(f"--init-from {str(hf_dir)!r}: its tokenizer ({tok.spec}) has "
                         f"{tok.vocab_size} tokens but vocab_size={mcfg.vocab_size}; put the "
                         "model's own tokenizer.json in the folder")
    model = Decoder(mcfg)
    hf_import.load_into(model, d)
    return Loaded(model.float().eval(), tok, {"step": None, "init_from": str(d)})


@torch.no_grad()
def logits(model: Decoder, ids: list[int]) -> torch.Tensor:
    """Next-token logits (V,) after ``ids`` (the last ``context`` of them: the model's
    positions end there)."""
    x = torch.tensor([ids[-model.cfg.context:]], dtype=torch.long)
    return model(x)[0, -1]
