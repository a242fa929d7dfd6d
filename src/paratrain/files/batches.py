"""Token corpus and global batches that are identical for any world size.

- Where the text comes from, the train/validation split and the tokenizer (bytes by
  default, vocabulary 256): :mod:`paratrain.files.corpus` and :mod:`paratrain.files.tokenizer`.
- The global batch of step k is a pure function of (seed, k): ``global_batch`` window
  starts drawn from a generator seeded with (seed, k). Rank r of W takes the contiguous
  slice ``[r*B/W, (r+1)*B/W)``, so 1 worker with 16 windows and 4 workers with 4 each
  see the same 16 windows. The tokenizer changes what a window holds, never which
  windows a step draws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from paratrain.files.corpus import prepare, read_corpus, stdlib_corpus  # noqa: F401 - re-exported
from paratrain.files.tokenizer import BYTES_VOCAB, Tokenizer

VOCAB = BYTES_VOCAB


def bits_per_byte(loss_nats: float, tokens: int, nbytes: int) -> float:
    """Loss in bits per byte of text: comparable across tokenizers (nats per token x
    tokens per byte / ln 2)."""
    return loss_nats * tokens / nbytes / math.log(2)


@dataclass
class Corpus:
    """Train/validation split of a tokenized corpus, and the batches drawn from it."""

    train: torch.Tensor  # token ids, 1-D (uint8 for bytes, int32 otherwise)
    val: torch.Tensor
    tokenizer: Tokenizer | None = None  # None: bytes
    token_bytes: torch.Tensor | None = None  # (V,) UTF-8 bytes per token id
    text_sha256: str = ""  # of the corpus bytes: the data's identity in checkpoints

    @classmethod
    def load(cls, path: str | None, val_fraction: float, context: int,
             tokenizer: str = "bytes", text_field: str = "text") -> Corpus:
        train, val, tok, digest = prepare(path, val_fraction, tokenizer, text_field)
        need = context + 1
        if len(train) < need or len(val) < need:
            n = len(train) + len(val)
            raise ValueError(
                f"corpus of {n} tokens is too small for context {context} with "
                f"val_fraction {val_fraction}; use more text (at least "
                f"{math.ceil(need / min(val_fraction, 1 - val_fraction))} tokens) or a "
                "shorter --context")

        def as_tensor(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a if a.dtype == np.uint8 else a.astype(np.int32))

        return cls(train=as_tensor(train), val=as_tensor(val), tokenizer=tok,
                   token_bytes=torch.from_numpy(tok.token_bytes()), text_sha256=digest)

    @property
    def vocab_size(self) -> int:
        return VOCAB if self.tokenizer is None else self.tokenizer.vocab_size

    def max_id(self) -> int:
        """The largest token id in the data (train and validation)."""
        return int(max(self.train.max(), self.val.max()))

    def unigram_entropy(self) -> float:
        """Cross-entropy (nats/token) of the best context-free model: the baseline to beat."""
        counts = torch.bincount(self.train.long(), minlength=self.vocab_size).double()
        p = counts[counts > 0] / counts.sum()
        return float(-(p * p.log()).sum())

    @staticmethod
    def _windows(src: torch.Tensor, starts: torch.Tensor, context: int):
        idx = starts[:, None] + torch.arange(context + 1)[None, :]
        w = src[idx].long()
        return w[:, :-1], w[:, 1:]

    def batch(self, seed: int, step: int, global_batch: int, context: int,
              rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice (x, y), each (B/W, T) int64, of the global batch of ``step``."""
        if global_batch % world:
            raise ValueError(f"global batch {global_batch} is not divisible by {world} "
                             f"workers; use a multiple of {world}")
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.train) - context - 1, (global_batch,), generator=g)
        per = global_batch // world
        return self._windows(self.train, starts[rank * per:(rank + 1) * per], context)

    def val_batches(self, n_batches: int, global_batch: int, context: int,
                    rank: int = 0, world: int = 1):
        """Fixed validation windows, evenly spaced over the split; this rank's slices."""
        total = n_batches * global_batch
        span = len(self.val) - context - 1
        starts = torch.linspace(0, span, total).long()
        per = global_batch // world
        for b in range(n_batches):
            s = starts[b * global_batch:(b + 1) * global_batch]
            yield self._windows(self.val, s[rank * per:(rank + 1) * per], context)

    def val_bytes(self, n_batches: int, global_batch: int, context: int) -> int:
        """UTF-8 bytes the targets of every rank's validation windows stand for (the
        denominator of :func:`bits_per_byte`; the tokens are n_batches * B * T)."""
        if self.token_bytes is None:
            return n_batches * global_batch * context
        return sum(int(self.token_bytes[y.long()].sum())
                   for _, y in self.val_batches(n_batches, global_batch, context))
