"""The systems model counts what the runtime builds (issue 20): one home for parameter
counts and FLOPs per token, :mod:`paratrain.cost.shapes`.

For every kind of model the CLI and the catalogue can build (dense, GQA, tied or not, an
uneven vocabulary, MoE with shared experts, every-L-th MoE) the shape's parameter count,
active count, FLOPs per token and model-state bytes equal those of the real
:class:`paratrain.model.Decoder`; and per rank, for every layout of
``tests/test_compose.py`` plus MoE layouts with expert parallelism, the parameters and
model-state bytes each rank really holds after the transforms (real gloo processes)
equal the systems model's per-rank count (:mod:`paratrain.cost.layout`).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paratrain.config import ModelConfig, TrainConfig
from paratrain.cost import layout as L
from paratrain.cost.memory import Precision, model_states
from paratrain.cost.shapes import as_shape, load_model, model_names
from paratrain.model import Decoder, moe_modules
from paratrain.parallel.process_groups import spawn
from paratrain.plan import ParallelPlan
from test_compose import EIGHT, FOUR

FP64 = Precision("float64", 8, 8, 16)  # float64 weights and gradients, Adam m and v
BASE = dict(n_layers=4, d_model=32, n_heads=4, d_ff=64, context=16)
MOE = ModelConfig(**BASE, experts=4, top_k=2)
MOE_SHARED = MOE.replace(shared_experts=1, moe_ffn=48, moe_every=2)  # every 2nd block
MODELS = {
    "default": ModelConfig(),
    "default moe": ModelConfig(experts=8),
    "dense": ModelConfig(**BASE),
    "gqa odd vocab": ModelConfig(**{**BASE, "d_model": 36, "n_heads": 6}, n_kv_heads=2,
                                 vocab_size=131),
    "tied": ModelConfig(**BASE, tie_embeddings=True),
    "moe": MOE,
    "moe shared every 2": MOE_SHARED,
    "moe tied top1": MOE.replace(top_k=1, tie_embeddings=True, moe_ffn=40),
    # Qwen's attention: q, k, v biases (Qwen2), per-head q, k norms (Qwen3), wide heads
    "qwen": ModelConfig(**BASE, n_kv_heads=2, head_size=16, qkv_bias=True, qk_norm=True),
    # Qwen2-MoE's router (no renormalisation) and gated shared expert
    "qwen2 moe": MOE.replace(qkv_bias=True, shared_experts=1, shared_gate=True,
                             moe_renorm=False),
}


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_default_moe_model_is_priced_as_the_runtime_holds_it():
    cfg = ModelConfig(experts=8)
    assert as_shape(cfg).num_params() == _numel(Decoder(cfg)) == 10_133_184
    assert as_shape(ModelConfig()).num_params() == 1_869_504
    llama = ModelConfig(n_layers=32, d_model=4096, n_heads=32, d_ff=11008, vocab_size=32000,
                        context=4096)
    assert as_shape(llama).num_params() == load_model("llama2-7b").num_params() == \
        6_738_415_616


@pytest.mark.parametrize("name", MODELS)
def test_counts_flops_and_states_equal_the_built_decoder(name):
    cfg = MODELS[name]
    m, dec = as_shape(cfg), Decoder(cfg)
    total = _numel(dec)
    # a token uses, of each MoE MLP, top_k routed experts (all the same size) of E
    unused = sum((moe.num_experts - moe.top_k) * _numel(moe.experts[0])
                 for moe in moe_modules(dec))
    assert m.num_params() == total and m.active_params() == total - unused
    blocks = [_numel(b) for b in dec.blocks]
    assert [m.layer_params(i) for i in range(cfg.n_layers)] == blocks
    assert m.num_layer_params() == sum(blocks)
    assert m.embedding_params() == total - sum(blocks)
    assert m.routed_expert_params() == sum(_numel(x.experts) for x in moe_modules(dec))
    assert all(m.expert_params() == _numel(e) for x in moe_modules(dec) for e in x.experts)
    assert m.moe_layers == len(moe_modules(dec))
    hq_t = cfg.n_heads * cfg.head_dim * cfg.context
    assert m.flops_per_token() == 6.0 * (total - unused) + 12.0 * cfg.n_layers * hq_t
    for i, b in enumerate(dec.blocks):
        used = blocks[i] - sum((x.num_experts - x.top_k) * _numel(x.experts[0])
                               for x in moe_modules(b))
        assert m.block_flops_per_token(i) == 6.0 * used + 12.0 * hq_t
        norms = sum(p.numel() for n, p in b.named_parameters() if "norm" in n)
        assert m.block_flops_per_token(i, norms=False) == 6.0 * (used - norms) + 12.0 * hq_t
    assert m.head_flops_per_token() == 6.0 * dec.head.weight.numel()
    for plan in (ParallelPlan(), ParallelPlan(dp=4, zero=3)):
        ms = model_states(cfg, plan, FP64)
        want = 32 * total / plan.dp if plan.zero == 3 else 32 * total
        assert ms.total_bytes == want == model_states(m, plan, FP64).total_bytes, plan


def _runtime_config(shape) -> ModelConfig:
    return ModelConfig(**{f.name: getattr(shape, f.name)
                          for f in dataclasses.fields(ModelConfig)})


def _buildable(shape) -> bool:
    """Whether paratrain's Decoder has this shape's layers (placement aside)."""
    return (shape.mlp == "swiglu" and not shape.bias and not shape.learned_positions
            and shape.norms_per_layer == 2 and not shape.is_mla
            and not shape.first_dense_layers
            and shape.head_dim * shape.n_heads == shape.d_model)


@pytest.mark.parametrize("name", [n for n in model_names() if _buildable(load_model(n))])
def test_catalogue_models_count_what_the_decoder_holds(name):
    """Built on the meta device: shapes only, no memory."""
    shape = load_model(name)
    cfg = _runtime_config(shape)
    with torch.device("meta"):
        dec = Decoder(cfg)
    assert shape.num_params() == as_shape(cfg).num_params() == _numel(dec)
    assert shape.active_params() == as_shape(cfg).active_params()
    assert shape.flops_per_token() == as_shape(cfg).flops_per_token()


def test_a_shared_gate_needs_shared_experts():
    with pytest.raises(ValueError, match="shared_gate = true needs shared experts"):
        MOE.replace(shared_gate=True)


def test_catalogue_moe_vocabulary_is_the_runtimes():
    mix, ds = load_model("mixtral-8x7b"), load_model("deepseek-v3")
    assert (mix.experts, mix.top_k, mix.expert_ffn, mix.moe_layers) == (8, 2, 14336, 32)
    assert (ds.experts, ds.shared_experts, ds.first_dense_layers, ds.moe_layers) == \
        (256, 1, 3, 58)
    assert not ds.is_moe_layer(2) and ds.is_moe_layer(3)
    assert ds.routed_expert_params() == 58 * 256 * ds.expert_params()
    with pytest.raises(ValueError, match="first_dense_layers=61"):
        ds.replace(first_dense_layers=61)


def test_a_model_file_with_the_old_moe_keys_is_told_the_new_names(tmp_path):
    f = tmp_path / "old.toml"
    f.write_text("n_layers = 2\nd_model = 32\nn_heads = 4\nd_ff = 64\nvocab_size = 256\n"
                 "n_experts = 4\nd_ff_expert = 32\n")
    with pytest.raises(ValueError, match="d_ff_expert -> moe_ffn, n_experts -> experts"):
        load_model(str(f))


# ---- per rank, in real gloo processes ----------------------------------------------
MOE_FOUR = {
    "moe dp4 ep4 zero2": (MOE, ParallelPlan(dp=4, ep=4, zero=2)),
    "moe shared tp2 ep2 zero3": (MOE_SHARED, ParallelPlan(dp=2, tp=2, ep=2, zero=3)),
    "moe shared pp2 ep2 zero1 m2": (MOE_SHARED, ParallelPlan(dp=2, pp=2, ep=2, zero=1,
                                                             micro_batches=2)),
    "tied dp2 tp2 zero1": (MODELS["tied"], ParallelPlan(dp=2, tp=2, zero=1)),
    "moe tied top1 dp4 ep2 zero3": (MODELS["moe tied top1"], ParallelPlan(dp=4, ep=2, zero=3)),
    "qwen dp2 tp2 zero3": (MODELS["qwen"], ParallelPlan(dp=2, tp=2, zero=3)),
    "qwen2 moe tp2 ep2 zero3": (MODELS["qwen2 moe"], ParallelPlan(dp=2, tp=2, ep=2, zero=3)),
}
MOE_EIGHT = {
    "moe shared tp2 pp2 ep2 zero2 m2": (MOE_SHARED, ParallelPlan(dp=2, tp=2, pp=2, ep=2,
                                                                 zero=2, micro_batches=2)),
}
TC = TrainConfig(steps=1, global_batch=8, warmup_steps=0, eval_every=0, eval_batches=1,
                 dtype="float64")


def _worker(rank: int, world: int, combos: dict) -> dict:
    from paratrain.parallel.api import build_engine
    from paratrain.parallel.memory import measure_states
    from paratrain.run.loop import build_model

    out = {}
    for name, (mcfg, plan) in combos.items():
        engine = build_engine(build_model(mcfg, TC, torch.device("cpu")), TC, plan,
                              torch.device("cpu"))
        held = sum(t.numel() for t in engine.full_parameters().values())
        # a step, then a second one's gradients, as the loop measures them: optimizer
        # state exists after the first step, gradients until the step consumes them
        x_BT = torch.randint(0, mcfg.vocab_size, (4, mcfg.context + 1))  # 4 micro-batches
        for step in range(2):
            engine.forward_backward(x_BT[:, :-1], x_BT[:, 1:], 4 * mcfg.context * plan.dp)
            engine.reduce_gradients()
            if step == 0:
                engine.clip_and_step(1e-3)
        out[name] = (held, measure_states(engine))
    return out


@pytest.mark.parametrize("world,combos", [
    pytest.param(4, {**FOUR, **MOE_FOUR}, id="world4"),
    pytest.param(8, {**EIGHT, **MOE_EIGHT}, id="world8", marks=pytest.mark.slow),  # ~50 s
])
@pytest.mark.slow
def test_each_rank_holds_what_the_systems_model_counts(world, combos):
    results = spawn(_worker, world, combos, timeout_s=600)
    for name, (mcfg, plan) in combos.items():
        for r in range(world):
            held, states = results[r][name]
            assert held == L.rank_layout(mcfg, plan, r).params, (name, r)
            want = L.state_bytes(mcfg, plan, "float64", r)
            assert {k: states[k] for k in want} == want, (name, r)
        if plan.tp == plan.pp == 1:  # the planner's busiest rank (exact without tp, pp)
            ms = model_states(mcfg, plan, FP64)
            busiest = max((results[r][name][1] for r in range(world)),
                          key=lambda st: st["params"] + st["grads"] + st["optimizer"])
            assert (ms.weights_bytes, ms.grads_bytes, ms.optimizer_bytes) == \
                (busiest["params"], busiest["grads"], busiest["optimizer"]), name
