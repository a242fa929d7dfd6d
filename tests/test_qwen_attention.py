"""Qwen's attention in every layout: q, k, v biases (Qwen2, ``qkv_bias``) and an RMSNorm
over each head's queries and keys before RoPE (Qwen3, ``qk_norm``).

- The biases start at zero and the q, k norms' gains at one, as transformers initialises
  them.
- Each layout below trains the model with both (GQA, heads wider than width / heads) for
  4 float64 steps and follows the single process's loss trajectory and validation loss
  to 1e-9 relative: tensor parallelism splits each bias with its weight's rows and keeps
  the q, k norms whole on every rank, whose gradients (each rank's sum over its own
  heads) are summed over tp with and without SP; the pipeline, ZeRO-3 units, context
  parallelism (ring and all-to-all) and selective recompute take the new tensors as any
  other. The per-rank counts are tests/test_shape_counts.py's, the placements
  tests/test_placements.py's, the saved activations tests/test_attention.py's.
"""

from __future__ import annotations

import pytest
import torch

from conftest import max_rel_diff, parity_tcfg
from paratrain.config import ModelConfig
from paratrain.parallel.process_groups import spawn
from paratrain.plan import ParallelPlan
from paratrain.run.loop import RunOptions, train

QWEN = ModelConfig(n_layers=4, d_model=32, n_heads=4, n_kv_heads=2, head_size=16, d_ff=64,
                   context=16, qkv_bias=True, qk_norm=True)
QUIET = dict(quiet=True, measure_peak=False)
FOUR = {
    "tp2 zero3": ParallelPlan(dp=2, tp=2, zero=3),
    "tp2 sp zero2 m2 ours": ParallelPlan(dp=2, tp=2, sp=True, zero=2, micro_batches=2,
                                         collectives="ours"),
    "tp2 pp2 1f1b m2": ParallelPlan(tp=2, pp=2, micro_batches=2),
    "pp2 zero1 zb-h1 m4": ParallelPlan(dp=2, pp=2, zero=1, micro_batches=4,
                                       schedule="zb-h1"),
    "cp2 tp2 ring": ParallelPlan(cp=2, tp=2),
    "cp2 all-to-all zero3 selective": ParallelPlan(dp=2, cp=2, zero=3,
                                                   cp_algorithm="all-to-all",
                                                   recompute="selective"),
}


def test_fresh_biases_are_zero_and_gains_one():
    from paratrain.model import Decoder

    torch.manual_seed(0)
    model = Decoder(QWEN)
    attn = model.blocks[0].attn
    assert all(torch.equal(b, torch.zeros_like(b)) for b in
               (attn.wq.bias, attn.wk.bias, attn.wv.bias))
    assert torch.equal(attn.q_norm.weight, torch.ones(16)) and attn.wo.bias is None
    assert torch.equal(attn.k_norm.weight, torch.ones(16))


def _worker(rank: int, world: int, data: str) -> dict:
    return {name: (s["losses"], s["val_loss"]) for name, plan in FOUR.items()
            for s in [train(QWEN, parity_tcfg(data), plan, RunOptions(**QUIET))]}


@pytest.mark.slow
def test_every_layout_reproduces_one_process(text_file):
    ref = train(QWEN, parity_tcfg(text_file), None, RunOptions(**QUIET))
    results = spawn(_worker, 4, text_file, timeout_s=600)
    for name in FOUR:
        losses, val = results[0][name]
        assert len(losses) == 4, name
        assert max_rel_diff(losses, ref["losses"]) <= 1e-9, name
        assert abs(val - ref["val_loss"]) <= 1e-9 * abs(ref["val_loss"]), name
