"""`paratrain generate`: greedy by default, and one forward per new token through a KV
cache whose logits are the plain forward's at every step (dense, GQA, eager kernel,
tied head, MoE), also past the context, where the window slides."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from conftest import TINY
from paratrain.cli import main
from paratrain.files.inference import Loaded, logits
from paratrain.files.tokenizer import Tokenizer, bytes_tokenizer_json
from paratrain.model import Decoder
from paratrain.run.generate import NextLogits, sample
from paratrain.run.kv_cache import KVCache, decode

CONFIGS = {
    "gqa": TINY.replace(n_kv_heads=2),
    "mha-eager-tied": TINY.replace(attention="eager", tie_embeddings=True),
    "moe-gqa": TINY.replace(n_kv_heads=1, experts=4, top_k=2, moe_ffn=32,
                            shared_experts=1, moe_every=2),
}
TOL = {torch.float64: 1e-6, torch.float32: 1e-4}


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _model(cfg, dtype=torch.float32) -> Decoder:
    """A random model with norms away from 1 and larger weights, so that greedy text is
    not one token repeated and a misplaced cache entry shows in the logits."""
    torch.manual_seed(0)
    model = Decoder(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model.to(dtype).eval()


def _run(model: Decoder) -> Loaded:
    return Loaded(model, Tokenizer("bytes", bytes_tokenizer_json()), {})


def _greedy_uncached(model: Decoder, ids: list[int], n: int) -> list[int]:
    """The reference: argmax of the plain forward over the last ``context`` ids."""
    out = list(ids)
    for _ in range(n):
        out.append(int(logits(model, out).argmax()))
    return out[len(ids):]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", CONFIGS)
def test_decode_in_chunks_equals_the_forward(name, dtype):
    """Prefill, chunks of several new positions (the explicit-mask case) and single
    tokens give the forward's logits at the same positions."""
    model = _model(CONFIGS[name], dtype)
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(idx)
    cache, got, t = KVCache(model.cfg, 2, dtype), [], 0
    for n in (5, 3, 1, 1, 6):
        got.append(decode(model, idx[:, t:t + n], cache))
        t += n
    assert cache.length == 16
    torch.testing.assert_close(torch.cat(got, 1), ref, rtol=0, atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", CONFIGS)
def test_cached_logits_equal_the_uncached_at_every_step(name, dtype):
    """40 tokens on a 16-token context: inside the window and while it slides."""
    model = _model(CONFIGS[name], dtype)
    seq = torch.randint(0, 256, (43,), generator=torch.Generator().manual_seed(2)).tolist()
    nxt = NextLogits(model, seq[:3])
    for i in range(3, len(seq)):
        torch.testing.assert_close(nxt.logits, logits(model, seq[:i]), rtol=0,
                                   atol=TOL[dtype])
        nxt.push(seq[i])


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_is_the_default_and_the_uncached_argmax(name):
    run = _run(_model(CONFIGS[name], torch.float64))
    ids, new = sample(run, "def ", 40)
    assert sample(run, "def ", 40) == (ids, new)
    assert new == _greedy_uncached(run.model, ids, 40)
    assert len(set(new)) > 1  # not one token repeated: the comparison says something


def _forward_sizes(model: Decoder, threads: list[int] | None = None) -> list[int]:
    """Positions of every forward of ``model`` (its embedding runs once per forward);
    ``threads`` gets the intra-op threads each ran with."""
    sizes: list[int] = []

    def hook(module, args, out):
        sizes.append(args[0].shape[1])
        if threads is not None:
            threads.append(torch.get_num_threads())

    model.tok_emb.register_forward_hook(hook)
    return sizes


def test_one_forward_per_new_token_on_one_thread():
    """The prompt is prefilled once, then each token is a forward of one position until
    the context is full; past it each token is one prefill of the last 16. The loop runs
    on one thread and gives the caller's count back."""
    run = _run(_model(CONFIGS["gqa"]))
    threads: list[int] = []
    sizes = _forward_sizes(run.model, threads)
    torch.set_num_threads(2)
    ids, new = sample(run, "ab", 30)
    assert torch.get_num_threads() == 2
    torch.set_num_threads(1)
    assert len(new) == 30 and sizes == [2] + [1] * 14 + [16] * 15
    assert set(threads) == {1}
    sizes.clear()
    sample(run, "ab", 1)
    assert sizes == [2]
    sample(run, "ab", 0)
    assert sizes == [2]


def test_a_model_with_expert_capacity_has_no_cache():
    """Capacity routes by sequence length, so decode refuses it and generate reruns the
    plain forward over the window (one forward per token, as before)."""
    model = _model(CONFIGS["moe-gqa"].replace(capacity_factor=1.0), torch.float64)
    with pytest.raises(ValueError, match="capacity_factor > 0"):
        decode(model, torch.zeros(1, 2, dtype=torch.long), KVCache(model.cfg, 1, torch.float64))
    sizes = _forward_sizes(model)
    ids, new = sample(_run(model), "ab", 20)
    assert sizes == [min(2 + i, 16) for i in range(20)]
    assert new == _greedy_uncached(model, ids, 20)


def test_decode_refuses_more_than_the_context():
    model = _model(TINY)
    cache = KVCache(model.cfg, 1, torch.float32)
    decode(model, torch.zeros(1, 10, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="10 cached \\+ 7 new positions exceed the model "
                                         "context 16; start a new cache"):
        decode(model, torch.zeros(1, 7, dtype=torch.long), cache)


def test_cli_default_is_greedy(tmp_path, capsys):
    """`paratrain generate` without --temperature, on a checkpoint on disk: the same text
    twice, equal to --temperature 0 and to the uncached argmax past the context."""
    from paratrain.config import TrainConfig
    from paratrain.files import checkpoint
    from paratrain.parallel.engine import Engine
    from paratrain.plan import ParallelPlan

    model = _model(CONFIGS["gqa"]).train()
    engine = Engine(model, TrainConfig(), torch.device("cpu"))
    checkpoint.save(tmp_path / "ck", 1, engine, model.cfg, ParallelPlan(),
                    {"model": asdict(model.cfg)})
    args = ["generate", "--checkpoint", str(tmp_path / "ck"), "--prompt", "def ",
            "--max-new-tokens", "24"]
    outs = []
    for extra in ([], [], ["--temperature", "0"], ["--temperature", "1", "--seed", "3"]):
        assert main([*args, *extra]) == 0
        outs.append(capsys.readouterr().out.rstrip("\n"))
    assert outs[0] == outs[1] == outs[2] != outs[3]
    tok = Tokenizer("bytes", bytes_tokenizer_json())
    ids = tok.encode_text("def ")
    assert outs[0] == tok.decode(ids + _greedy_uncached(model.eval(), ids, 24))


def test_top_p_keeps_the_fewest_tokens_that_reach_p():
    """Nucleus sampling: probabilities 0.6, 0.3, 0.1 at T = 1. p 0.5 keeps the likeliest
    alone, p 0.7 the first two (0.6 < 0.7 <= 0.9), p 1 all three; 300 seeded draws each."""
    from paratrain.run.generate import check_args, pick

    z = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64).log()
    drawn = {p: {pick(z, 1.0, None, torch.Generator().manual_seed(s), p) for s in range(300)}
             for p in (0.5, 0.7, 1.0)}
    assert drawn == {0.5: {0}, 0.7: {0, 1}, 1.0: {0, 1, 2}}
    assert pick(z, 1.0, 2, torch.Generator().manual_seed(0), 1e-9) == 0  # after top-k too
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="--top-p .* must be in \\(0, 1\\]"):
            check_args(4, 1.0, None, bad)
