"""The global batch is a pure function of (seed, step); ranks take contiguous slices."""

import pytest
import torch

from paratrain.files.batches import Corpus, read_corpus, stdlib_corpus


def test_slices_of_any_world_size_reassemble_the_global_batch(text_file):
    c = Corpus.load(text_file, 0.1, 32)
    x1, y1 = c.batch(seed=3, step=7, global_batch=16, context=32)
    for world in (2, 4, 8):
        parts = [c.batch(3, 7, 16, 32, rank=r, world=world) for r in range(world)]
        assert torch.equal(torch.cat([p[0] for p in parts]), x1)
        assert torch.equal(torch.cat([p[1] for p in parts]), y1)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the next bytes
    x2, _ = c.batch(seed=3, step=8, global_batch=16, context=32)
    assert not torch.equal(x1, x2)


def test_validation_windows_are_fixed_and_split(text_file):
    c = Corpus.load(text_file, 0.1, 32)
    a = list(c.val_batches(2, 8, 32))
    b = [torch.cat([next(iter(c.val_batches(2, 8, 32, r, 2)))[0] for r in range(2)])]
    assert torch.equal(a[0][0], b[0])
    assert len(c.val) + len(c.train) == len(read_corpus(text_file))


def test_default_corpus_is_the_stdlib_and_deterministic():
    data = stdlib_corpus()
    assert len(data) > 1_000_000 and b"def " in data
    assert stdlib_corpus() == data


def test_unigram_entropy_is_a_sane_baseline(text_file):
    h = Corpus.load(text_file, 0.1, 32).unigram_entropy()
    assert 2.0 < h < 5.55  # bytes of source code: well under log(256) = 5.545


def test_missing_and_empty_data(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_corpus(str(tmp_path / "nope.txt"))
    empty = tmp_path / "empty.txt"
    empty.write_text("   \n")
    with pytest.raises(ValueError, match="holds no text"):
        read_corpus(str(empty))
    small = tmp_path / "small.txt"
    small.write_text("abc" * 10)
    with pytest.raises(ValueError, match="too small"):
        Corpus.load(str(small), 0.1, 32)


def test_uneven_world_is_refused(text_file):
    c = Corpus.load(text_file, 0.1, 32)
    with pytest.raises(ValueError, match="not divisible by 3"):
        c.batch(0, 0, 16, 32, rank=0, world=3)
