"""Text from a trained model: greedy by default (temperature 0: the argmax of the
logits), otherwise softmax(logits / T) over the top-k tokens and, with ``--top-p P``, the
fewest of those whose probabilities reach P (nucleus sampling, Holtzman et al. 2020),
drawn with a generator seeded by ``--seed`` (the same checkpoint, prompt and seed give
the same text). A Hugging Face folder that names its end-of-sequence tokens
(``eos_token_id`` in config.json or generation_config.json) stops at the first one drawn,
as transformers' generate does; ``--max-new-tokens`` is then an upper bound.

One forward per new token (:class:`NextLogits`): the prompt is prefilled once into a
:class:`~paratrain.run.kv_cache.KVCache`, then each drawn token runs alone, attending to the
cached keys and values (:func:`~paratrain.run.kv_cache.decode`). The logits are those
of the plain forward over the last ``context`` tokens
(:func:`paratrain.files.inference.logits`), to rounding.

Past the context the window slides by one token. RoPE positions count from the window's
start, so sliding renumbers every position and changes what each cached key attended to;
the cache is rebuilt by a prefill of the last ``context`` tokens, still one forward per
token (of ``context`` positions instead of one). Each token is thus predicted from the
same window as without a cache; a cheaper slide by half a window would change that.

The loop runs on one intra-op thread on a CPU, as the training workers do: a decode step
is a few small matrix-vector products, too small to split, and on a loaded machine a
second thread makes every product wait for it (the default 4-layer model on 2 busy
cores: 8 tokens/s on 2 threads, 288 on 1).

A model with expert capacity (``capacity_factor`` > 0) routes by sequence length, so a
token's output changes as the sequence grows: it gets no cache, and each token reruns
the plain forward over its window. docs/export.md has the measured speeds.
"""

from __future__ import annotations

import torch

from paratrain.files.inference import Loaded, logits
from paratrain.model import Decoder
from paratrain.run.kv_cache import KVCache, decode


def check_args(max_new_tokens: int, temperature: float, top_k: int | None,
               top_p: float = 1.0) -> None:
    if max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens {max_new_tokens} must be >= 0")
    if not temperature >= 0:
        raise ValueError(f"--temperature {temperature} must be >= 0 (0 = greedy)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"--top-k {top_k} must be >= 1 (omit it to sample from all tokens)")
    if not 0 < top_p <= 1:
        raise ValueError(f"--top-p {top_p} must be in (0, 1] (1 = every token)")


class NextLogits:
    """The next-token logits (V,) of a growing sequence, one forward per :meth:`push`."""

    def __init__(self, model: Decoder, ids: list[int]) -> None:
        self.model, self.ids = model, list(ids)
        self.context = model.cfg.context
        self.cached = model.cfg.capacity_factor == 0
        self.logits = self._window()

    def _window(self) -> torch.Tensor:
        """A fresh cache holding the last ``context`` ids (a prefill), or the plain
        forward over them for a model without a cache."""
        if not self.cached:
            return logits(self.model, self.ids)
        w = self.model.head.weight
        self.cache = KVCache(self.model.cfg, 1, w.dtype, w.device)
        x = torch.tensor([self.ids[-self.context:]], dtype=torch.long, device=w.device)
        return decode(self.model, x, self.cache)[0, -1]

    def push(self, token: int) -> None:
        self.ids.append(token)
        if self.cached and self.cache.length < self.context:
            x = torch.tensor([[token]], dtype=torch.long, device=self.model.head.weight.device)
            self.logits = decode(self.model, x, self.cache)[0, -1]
        else:
            self.logits = self._window()


def pick(z: torch.Tensor, temperature: float, top_k: int | None,
         g: torch.Generator, top_p: float = 1.0) -> int:
    """One token from logits ``z``: argmax at temperature 0, else a seeded draw from
    softmax(z / T) cut to the top k, then to the fewest tokens whose probabilities reach
    ``top_p`` (the likeliest always kept)."""
    if temperature == 0:
        return int(z.argmax())
    z = z / temperature
    if top_k is not None and top_k < z.numel():
        kth = z.topk(top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    probs = z.softmax(-1)
    if top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # the mass of the likelier tokens
        probs = probs.clone()
        probs[order[before >= top_p]] = 0.0
    return int(torch.multinomial(probs, 1, generator=g))


def sample(run: Loaded, prompt: str, max_new_tokens: int = 200, temperature: float = 0.0,
           top_k: int | None = None, seed: int = 0, top_p: float = 1.0,
           eos: frozenset[int] = frozenset()) -> tuple[list[int], list[int]]:
    """(prompt ids, new ids), stopping after a token of ``eos``. Only the tokenizer's ids
    are ever drawn (a model whose vocabulary was padded past the tokenizer's never emits
    a padding row)."""
    check_args(max_new_tokens, temperature, top_k, top_p)
    ids = run.tokenizer.encode_text(prompt)
    if not ids:
        raise ValueError("--prompt is empty (no tokens); pass some text, e.g. --prompt 'def '")
    g = torch.Generator().manual_seed(seed)
    vocab = run.tokenizer.vocab_size
    new: list[int] = []
    threads = torch.get_num_threads()
    if run.model.head.weight.device.type == "cpu":
        torch.set_num_threads(1)
    try:
        nxt = NextLogits(run.model, ids) if max_new_tokens else None
        for i in range(max_new_tokens):
            new.append(pick(nxt.logits[:vocab].double(), temperature, top_k, g, top_p))
            if new[-1] in eos:
                break
            if i + 1 < max_new_tokens:  # the last token's logits are never needed
                nxt.push(new[-1])
    finally:
        torch.set_num_threads(threads)
    return ids, new
