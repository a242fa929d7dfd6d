"""Records (.jsonl / .parquet) read through datasets, the three tokenizers, their cache,
bits per byte, and bad --tokenizer / --text-field values refused by the launcher."""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest
import torch

from conftest import TINY, tiny_flags
from paratrain.cli import main
from paratrain.files.batches import Corpus, bits_per_byte
from paratrain.files.corpus import prepare, read_corpus, records_text
from paratrain.files.tokenizer import Tokenizer, bytes_tokenizer_json, chunks, load

TINY_FLAGS = [*tiny_flags(TINY.replace(n_heads=2)), "--global-batch", "4", "--steps", "2"]


@pytest.fixture()
def home(tmp_path, monkeypatch):
    """A fresh ~/.cache/paratrain for the tokenizer and token caches."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "home" / ".cache" / "paratrain"


@pytest.fixture(scope="module")
def docs(text_file) -> list[str]:
    """Real documents: the conftest corpus cut into ~200 pieces."""
    with open(text_file) as fh:
        text = fh.read()
    return [text[i:i + 1000] for i in range(0, len(text), 1000)]


def test_bytes_tokenizer_is_the_old_byte_corpus(text_file):
    c = Corpus.load(text_file, 0.1, 32)
    raw = read_corpus(text_file)
    n_val = int(len(raw) * 0.1)  # the split as it always was: last 10% of the bytes
    want = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy())
    assert c.train.dtype == torch.uint8 and c.vocab_size == 256
    assert torch.equal(torch.cat([c.train, c.val]), want) and len(c.val) == n_val
    tok = Tokenizer("bytes", bytes_tokenizer_json())  # the JSON generate/export carry
    text = "déf f(x):\n\treturn 'ü' + x  # ok\n"
    assert tok.encode_text(text) == list(text.encode()) and tok.decode(list(text.encode())) == text
    assert c.val_bytes(2, 4, 32) == 2 * 4 * 32  # one byte per token


def test_jsonl_and_parquet_records_streamed_in_file_order(tmp_path, docs):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "ds"
    folder.mkdir()
    with (folder / "a.jsonl").open("w") as f:
        for d in docs[:50]:
            f.write(json.dumps({"text": d, "id": 1}) + "\n")
    pq.write_table(pa.table({"text": docs[50:80], "n": list(range(30))}), folder / "b.parquet")
    (folder / "README.md").write_text("not a record")  # ignored: the folder holds records
    assert read_corpus(str(folder)) == "\n".join(docs[:80]).encode()
    with pytest.raises(ValueError, match=r"no field 'body' \(fields: id, text\)"):
        records_text([folder / "a.jsonl"], "body")


def test_bpe_trained_on_the_training_split_cached_and_exact(tmp_path, docs, home):
    path = tmp_path / "notes.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:60]))
    train, val, tok, digest = prepare(str(path), 0.1, "bpe:300")
    assert tok.vocab_size == 300 and train.dtype == np.uint16
    cached = sorted(p.name for p in home.iterdir())
    assert len(cached) == 2 and cached[0].startswith("bpe-") and cached[0].endswith("-300.json")
    raw = read_corpus(str(path))
    assert digest == hashlib.sha256(raw).hexdigest()  # the data's identity: its text
    cut = len(raw) - int(len(raw) * 0.1)
    assert tok.json == load("bpe:300", raw[:cut]).json  # cache hit = retrained: deterministic
    from paratrain.files.tokenizer import train_bpe

    assert train_bpe(raw[:cut].decode(), 300) == tok.json
    assert train_bpe(raw.decode(), 300) != tok.json  # validation text never shapes it
    again = prepare(str(path), 0.1, "bpe:300")
    assert np.array_equal(again[0], train) and np.array_equal(again[1], val)
    text = raw[cut:].decode()
    assert list(val) == tok.hf.encode(text).ids  # chunked encoding = whole-text encoding
    assert sum(len(c) for c in chunks(text, 100)) == len(text)
    assert int(tok.token_bytes()[val.astype(np.int64)].sum()) == len(raw) - cut
    (tmp_path / "tok.json").write_text(tok.json)  # --tokenizer PATH: the same ids
    for f in home.glob("tokens-*.npz"):
        f.unlink()
    t2, v2, tok2, _ = prepare(str(path), 0.1, str(tmp_path / "tok.json"))
    assert tok2.vocab_size == 300 and np.array_equal(t2, train) and np.array_equal(v2, val)
    c = Corpus.load(str(path), 0.1, 16, "bpe:300")
    nb = c.val_bytes(2, 4, 16)
    assert 2 * 4 * 16 < nb  # a BPE token is more than one byte on average
    assert bits_per_byte(math.log(2), 10, 10) == 1.0


@pytest.mark.parametrize("flags, says", [
    (["--tokenizer", "bpe:100"], "--tokenizer 'bpe:100' needs a vocabulary size N with"),
    (["--tokenizer", "bpe:lots"], "pass e.g. --tokenizer bpe:512"),
    (["--tokenizer", "no/such/tokenizer.json"], "is neither 'bytes', 'bpe:N' nor an existing"),
    (["--tokenizer", "GARBAGE"], "cannot be read as a tokenizer.json"),
    (["--text-field", "body"], "has no field 'body' (fields: text); pass --text-field NAME"),
])
def test_bad_tokenizer_or_text_field_is_one_error_line_before_launch(
        flags, says, tmp_path, docs, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "GARBAGE").write_text('{"not": "a tokenizer"}')
    (tmp_path / "notes.jsonl").write_text("".join(json.dumps({"text": d}) + "\n"
                                                  for d in docs[:20]))
    code = main(["train", "--nproc", "2", *TINY_FLAGS, "--data", "notes.jsonl",
                 "--run-dir", "run", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and says in err[0]
    assert not (tmp_path / "run").exists()  # refused before anything was launched
