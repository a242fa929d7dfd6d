"""Sampling text from a trained model: greedy at temperature 0, otherwise softmax of
logits / T over the top-k tokens, drawn with a generator seeded by ``--seed`` (the same
seed and prompt give the same text).

No key/value cache: each new token reruns the model over the last ``context`` tokens.
For the models paratrain trains on a CPU that costs milliseconds, and it keeps one code
path (:meth:`Decoder.forward`) for training, sampling and the export check.
"""

from __future__ import annotations

import torch

from paratrain.files.inference import Loaded, logits


def check_args(max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    if max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens {max_new_tokens} must be >= 0")
    if not temperature >= 0:
        raise ValueError(f"--temperature {temperature} must be >= 0 (0 = greedy)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"--top-k {top_k} must be >= 1 (omit it to sample from all tokens)")


def sample(run: Loaded, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
           top_k: int | None = None, seed: int = 0) -> tuple[list[int], list[int]]:
    """(prompt ids, new ids). Only the tokenizer's ids are ever drawn (a model whose
    vocabulary was padded past the tokenizer's never emits a padding row)."""
    check_args(max_new_tokens, temperature, top_k)
    ids = run.tokenizer.encode_text(prompt)
    if not ids:
        raise ValueError("--prompt is empty (no tokens); pass some text, e.g. --prompt 'def '")
    g = torch.Generator().manual_seed(seed)
    vocab = run.tokenizer.vocab_size
    out = list(ids)
    for _ in range(max_new_tokens):
        z = logits(run.model, out)[:vocab].double()
        if temperature == 0:
            nxt = int(z.argmax())
        else:
            z = z / temperature
            if top_k is not None and top_k < vocab:
                kth = z.topk(top_k).values[-1]
                z = z.masked_fill(z < kth, float("-inf"))
            nxt = int(torch.multinomial(z.softmax(-1), 1, generator=g))
        out.append(nxt)
    return ids, out[len(ids):]
