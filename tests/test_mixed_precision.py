"""Mixed precision as the recipe describes it: BF16 working parameters and gradients,
FP32 master weights and Adam moments in the optimizer (sharded by ZeRO), gradients
reduced in BF16 (default) or FP32.

On 2 gloo ranks, for every ZeRO stage and both reduction dtypes, the measured
model-state bytes of every rank equal the systems model's recipe (2 + 2 + 12 bytes per
parameter, 2 + 4 + 12 with FP32 reduction, sharded per stage) up to the zero padding of
flat buffers, and the payload reduced per step is 2 (or 4) bytes per parameter, plus
that padding. The loss follows float32's within a stated tolerance, and the optimizer
really holds FP32 masters (the BF16 parameters are their rounding).
"""

from __future__ import annotations

import pytest
import torch

from conftest import TINY
from paratrain.config import TrainConfig
from paratrain.cost.memory import model_states
from paratrain.cost.run_figures import run_precision
from paratrain.cost.shapes import as_shape
from paratrain.parallel.process_groups import spawn
from paratrain.plan import ParallelPlan
from paratrain.run.loop import RunOptions, build_model, train

MODEL = TINY
QUIET = dict(quiet=True, measure_peak=False)
BUCKET_MB = 0.02


def tcfg(data: str, dtype: str, reduce_dtype: str = "bfloat16") -> TrainConfig:
    return TrainConfig(steps=6, global_batch=8, lr=1e-2, warmup_steps=2, eval_every=0,
                       eval_batches=1, dtype=dtype, reduce_dtype=reduce_dtype, data=data)


def _worker(rank: int, world: int, data: str) -> dict:
    out = {}
    for rd in ("bfloat16", "float32"):
        for z in (0, 1, 2, 3):
            s = train(MODEL, tcfg(data, "bfloat16", rd),
                      ParallelPlan(dp=world, zero=z, bucket_mb=BUCKET_MB), RunOptions(**QUIET))
            out[(rd, z)] = {k: s[k] for k in ("losses", "memory", "payload_bytes_per_step",
                                              "wire_bytes_per_step")}
    return out if rank == 0 else {}


@pytest.fixture(scope="module")
def runs(text_file):
    f32 = train(MODEL, tcfg(text_file, "float32"), None, RunOptions(**QUIET))["losses"]
    one = train(MODEL, tcfg(text_file, "bfloat16"), None, RunOptions(**QUIET))["losses"]
    return f32, one, spawn(_worker, 2, text_file)[0]


def test_one_process_keeps_fp32_masters_of_bf16_parameters():
    t = TrainConfig(dtype="bfloat16", lr=1e-2)
    model = build_model(MODEL, t, torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    from paratrain.parallel.engine import Engine

    eng = Engine(model, t, torch.device("cpu"))
    x = torch.randint(0, 256, (2, MODEL.context + 1), generator=torch.Generator().manual_seed(0))
    eng.forward_backward(x[:, :-1], x[:, 1:], 2 * MODEL.context)
    assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters())
    eng.clip_and_step(1e-2)
    for p, m in eng.opt.pairs:
        assert m.dtype == torch.float32
        assert torch.equal(p, m.to(torch.bfloat16))  # the working copy is the master rounded
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for _, m in eng.opt.pairs)


def test_bf16_follows_float32(runs):
    f32, one, out = runs
    for name, losses in [("one process", one)] + [(k, v["losses"]) for k, v in out.items()]:
        d = max(abs(a - b) / b for a, b in zip(losses, f32, strict=True))
        print(f"bf16 {name}: max rel loss difference to float32 {d:.2e}")
        assert d < 2e-2, name


@pytest.mark.parametrize("reduce_dtype", ["bfloat16", "float32"])
def test_state_and_payload_bytes_follow_the_recipe(runs, reduce_dtype):
    _, _, out = runs
    n = as_shape(MODEL).num_params()
    g = 2 if reduce_dtype == "bfloat16" else 4
    prec = run_precision(tcfg("", "bfloat16", reduce_dtype))
    assert (prec.weight_bytes, prec.grad_bytes, prec.optim_bytes) == (2, g, 12)
    for z in (0, 1, 2, 3):
        r = out[(reduce_dtype, z)]
        want = model_states(MODEL, ParallelPlan(dp=2, zero=z), prec)
        mem = r["memory"]
        assert mem["predicted_per_rank"]["params"] == want.weights_bytes
        assert mem["predicted_per_rank"]["grads"] == want.grads_bytes
        slack = 16 * 64  # zero padding: < 2 elements per flat buffer, at most 16 bytes each
        for rank in mem["measured_per_rank"]:
            for kind, w in (("params", want.weights_bytes), ("grads", want.grads_bytes),
                            ("optimizer", want.optimizer_bytes)):
                assert abs(rank[kind] - w) <= slack, (reduce_dtype, z, kind, rank[kind], w)
        # the payload: g bytes per parameter (+ padding to a multiple of 2 per buffer)
        assert g * n <= r["payload_bytes_per_step"] <= g * (n + 64), (reduce_dtype, z)
        print(f"reduce {reduce_dtype} zero {z}: payload {r['payload_bytes_per_step']} B for "
              f"{n} params; states r0 {mem['measured_per_rank'][0]}")
