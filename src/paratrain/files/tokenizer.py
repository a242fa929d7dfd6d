"""Tokenizers: raw bytes (the default), a byte-level BPE trained on the training split,
or any ``tokenizer.json`` (Hugging Face ``tokenizers``).

``--tokenizer`` takes one of three specs:

- ``bytes``: token id = byte value, vocabulary 256 (no library involved; the corpus
  stays a uint8 array, so results are exactly what they were before tokenizers existed).
- ``bpe:N``: a byte-level BPE (GPT-2's pre-tokenizer and byte alphabet, no special
  tokens) of at most N tokens, trained with ``tokenizers`` on the training split only, so
  validation text never shapes the vocabulary. Training is deterministic; the result is
  cached as ``~/.cache/paratrain/bpe-<hash of the training split>-<N>.json``.
- ``PATH``: a ``tokenizer.json`` file, used as it is (special tokens are never added).

Every tokenizer is also written as a ``tokenizer.json`` into checkpoint and export
folders; for ``bytes`` that is an equivalent byte-level BPE with no merges whose ids are
the byte values, so ``paratrain generate`` and ``transformers`` decode any run alike.

Large texts are encoded in chunks cut just before a newline that follows a non-space
character: GPT-2's pre-tokenizer always starts a new piece there, so chunked encoding
gives exactly the ids of encoding the whole text at once, in parallel and in bounded
memory (``Tokenizer.encode_batch_fast``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BYTES_VOCAB = 256
CHUNK_CHARS = 1 << 16


def parse_spec(spec: str) -> tuple[str, int | str | None]:
    """``bytes`` -> ("bytes", None); ``bpe:N`` -> ("bpe", N); else ("file", path).
    Checks what can be checked without reading the corpus; one ValueError otherwise."""
    if spec == "bytes":
        return "bytes", None
    if spec.startswith("bpe:") or spec == "bpe":
        n = spec[4:]
        if not n.isdigit() or not BYTES_VOCAB < int(n) <= 1 << 20:
            raise ValueError(f"--tokenizer {spec!r} needs a vocabulary size N with "
                             f"{BYTES_VOCAB} < N <= {1 << 20} (the 256 byte symbols come "
                             "first); pass e.g. --tokenizer bpe:512")
        return "bpe", int(n)
    p = Path(spec)
    if not p.is_file():
        raise ValueError(f"--tokenizer {spec!r} is neither 'bytes', 'bpe:N' nor an existing "
                         "tokenizer.json file; pass e.g. --tokenizer bpe:512 or a path")
    return "file", str(p)


def _gpt2_byte_chars() -> list[str]:
    """The printable character GPT-2's byte-level alphabet gives each byte 0..255."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def bytes_tokenizer_json() -> str:
    """A ``tokenizer.json`` equivalent to the bytes tokenizer: byte-level, no regex split,
    no merges, token id = byte value."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: b for b, c in enumerate(_gpt2_byte_chars())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def chunks(text: str, size: int = CHUNK_CHARS) -> Iterator[str]:
    """``text`` in pieces of about ``size`` characters, each cut just before a newline
    that follows a non-space character (a pre-token boundary; see the module note)."""
    i, n = 0, len(text)
    while i < n:
        j = min(n, i + size)
        while j < n and not (text[j] == "\n" and not text[j - 1].isspace()):
            j += 1
        yield text[i:j]
        i = j


def train_bpe(train_text: str, n: int) -> str:
    """A byte-level BPE of at most ``n`` tokens trained on ``train_text``; its JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=n, show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(chunks(train_text), trainer=trainer)
    return tok.to_str()


def sha256(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


@dataclass(frozen=True)
class TokenizerInfo:
    """What a run records about its tokenizer: the spec given, the vocabulary size and
    the sha256 of its ``tokenizer.json`` (resuming with another tokenizer is refused)."""

    spec: str
    vocab_size: int
    sha256: str


class Tokenizer:
    """One loaded tokenizer: ``encode`` for corpora, ``decode`` for samples, and the
    ``tokenizer.json`` text that checkpoints and exports carry."""

    def __init__(self, spec: str, json_text: str) -> None:
        from tokenizers import Tokenizer as HF

        self.spec, self.json = spec, json_text
        self.is_bytes = spec == "bytes"
        self.hf = HF.from_str(json_text)
        self.vocab_size = BYTES_VOCAB if self.is_bytes else \
            self.hf.get_vocab_size(with_added_tokens=True)

    @property
    def info(self) -> TokenizerInfo:
        return TokenizerInfo(self.spec, self.vocab_size, sha256(self.json))

    def encode(self, data: bytes) -> np.ndarray:
        """Token ids of ``data`` (uint8 for bytes, uint16/int32 otherwise). Text that is
        not valid UTF-8 has its bad bytes replaced by U+FFFD before a library encodes it."""
        if self.is_bytes:
            return np.frombuffer(data, dtype=np.uint8).copy()
        text = data.decode("utf-8", errors="replace")
        dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.int32
        parts = [np.asarray(e.ids, dtype=dtype) for e in
                 self.hf.encode_batch_fast(list(chunks(text)), add_special_tokens=False)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)

    def encode_text(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes each token id stands for (V,): what turns nats per token into
        bits per byte. Byte-level tokens map back through the byte alphabet exactly;
        tokens of other tokenizers count the bytes of their decoded text."""
        if self.is_bytes:
            return np.ones(BYTES_VOCAB, dtype=np.int64)
        alphabet = set(_gpt2_byte_chars())
        out = np.zeros(self.vocab_size, dtype=np.int64)
        for tok, i in self.hf.get_vocab(with_added_tokens=True).items():
            out[i] = len(tok) if set(tok) <= alphabet else \
                len(self.hf.decode([i], skip_special_tokens=False).encode())
        return out


def load(spec: str, train_bytes: bytes | None = None) -> Tokenizer:
    """The tokenizer ``spec`` names. ``bpe:N`` needs the training split (``train_bytes``)
    unless its cache entry exists; the trained JSON is cached beside the corpus cache."""
    kind, arg = parse_spec(spec)
    if kind == "bytes":
        return Tokenizer(spec, bytes_tokenizer_json())
    if kind == "file":
        try:
            text = Path(arg).read_text()
            json.loads(text)
            return Tokenizer(spec, text)
        except Exception as e:  # OSError, bad JSON, a JSON tokenizers cannot build
            msg = f"{type(e).__name__}: {e}".splitlines()[0]
            raise ValueError(f"--tokenizer {spec!r} cannot be read as a tokenizer.json "
                             f"({msg}); pass a file saved by tokenizers, or bpe:N") from None
    if train_bytes is None:
        raise ValueError(f"--tokenizer {spec} is trained on the corpus; load the corpus first")
    from paratrain.files.atomic import write_atomic
    from paratrain.files.corpus import cache_dir

    cache = cache_dir() / f"bpe-{sha256(train_bytes)[:16]}-{arg}.json"
    if cache.is_file():
        return Tokenizer(spec, cache.read_text())
    text = train_bpe(train_bytes.decode("utf-8", errors="replace"), arg)
    try:
        write_atomic(cache, text.encode())
    except OSError:  # read-only home: retrain next time (training is deterministic)
        pass
    return Tokenizer(spec, text)
