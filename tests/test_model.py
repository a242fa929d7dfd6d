"""Exact parameter counts and FLOPs, checked by hand and against the built model."""

import pytest
import torch

from conftest import TINY
from paratrain.config import ModelConfig
from paratrain.cost.shapes import as_shape
from paratrain.model import Decoder

LLAMA2_7B = ModelConfig(n_layers=32, d_model=4096, n_heads=32, d_ff=11008,
                        vocab_size=32000, context=4096)


def test_llama2_7b_parameter_count():
    assert as_shape(LLAMA2_7B).num_params() == 6_738_415_616


def test_llama2_7b_flops_per_token_by_hand():
    n = 6_738_415_616
    attn = 12 * 32 * 32 * 128 * 4096  # 12 L H Q T
    assert as_shape(LLAMA2_7B).flops_per_token(4096) == 6 * n + attn


@pytest.mark.parametrize("cfg", [
    TINY.replace(vocab_size=131),
    ModelConfig(n_layers=3, d_model=48, n_heads=6, n_kv_heads=2, d_ff=96, context=16),
    TINY.replace(tie_embeddings=True),
])
def test_count_matches_built_model(cfg):
    model = Decoder(cfg)
    assert sum(p.numel() for p in model.parameters()) == as_shape(cfg).num_params()


def test_hand_count_small_gqa():
    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64,
                      vocab_size=256, context=16)
    attn = 32 * 32 + 2 * 32 * 16 + 32 * 32  # q, k and v with 2 kv heads of 8, o
    mlp = 3 * 32 * 64
    per_layer = attn + mlp + 2 * 32
    assert as_shape(cfg).num_params() == 2 * per_layer + 2 * 256 * 32 + 32


def test_forward_shape_causality_and_tied_weights():
    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=4, d_ff=64, context=16,
                      tie_embeddings=True)
    torch.manual_seed(0)
    model = Decoder(cfg).double()
    idx = torch.randint(0, 256, (2, 16))
    out = model(idx)
    assert out.shape == (2, 16, 256)
    idx2 = idx.clone()
    idx2[:, 10:] = (idx2[:, 10:] + 1) % 256  # change the future only
    assert torch.equal(model(idx2)[:, :10], out[:, :10])
    assert model.head.weight is model.tok_emb.weight


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(n_layers=0), "n_layers = 0"),
    (dict(d_model=30, n_heads=4), "not divisible by n_heads"),
    (dict(n_heads=4, n_kv_heads=3, d_model=32), "n_kv_heads=3"),
])
def test_bad_shapes_raise_one_line(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment) as e:
        ModelConfig(**kwargs)
    assert "\n" not in str(e.value)
