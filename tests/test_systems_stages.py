"""One stage split for runtime and systems model: the fast split equals the dynamic
programme, the runtime re-exports it, and the systems model prices the busiest rank of
that very split."""

from __future__ import annotations

import pytest

from paratrain.config import ModelConfig
from paratrain.cost.groups import stage_layers
from paratrain.cost.hardware import load_hardware
from paratrain.cost.stages import (
    blocks_per_rank,
    split_blocks,
    split_blocks_dp,
    split_layers,
    stage_costs,
)
from paratrain.plan import ParallelPlan
from paratrain.systems.step_time import step_time


@pytest.mark.parametrize("head", [0.0, 1.0, 3.0, 7.0, 10.0, 25.0, 0.5, 2.5, 13.7])
def test_fast_split_equals_the_dynamic_programme(head):
    block = 10.0  # heads of 0, 1, ... blocks and fractions: ties included
    for n in range(1, 25):
        for s in range(1, n + 1):
            assert split_blocks(n, s, block, head) == tuple(
                split_blocks_dp(n, s, block, 0.0, head)), (n, s, head)


def test_real_model_costs_split_like_the_dynamic_programme():
    for cfg in (ModelConfig(n_layers=32, d_model=4096, n_heads=32, d_ff=11008,
                            vocab_size=32000, context=4096),
                ModelConfig(n_layers=8, d_model=32, n_heads=4, d_ff=64, context=16,
                            vocab_size=4096)):
        block, emb, head = stage_costs(cfg)
        for s in range(1, cfg.n_layers + 1):
            assert split_layers(cfg, s) == split_blocks_dp(cfg.n_layers, s, block, emb, head)


def test_runtime_uses_the_same_split():
    from paratrain.parallel.pipeline import stage as runtime

    assert runtime.split_layers is split_layers and runtime.stage_costs is stage_costs


def test_systems_prices_the_runtimes_busiest_rank():
    big_head = ModelConfig(n_layers=8, d_model=32, n_heads=4, d_ff=64, context=16,
                           vocab_size=4096)  # head ~ 11.6 blocks: the first stage takes 7
    assert split_layers(big_head, 2) == [(0, 7), (7, 8)]
    assert blocks_per_rank(big_head, 2) == [7, 1]
    assert stage_layers(big_head.n_layers, 2, model=big_head, seq_len=16) == 7
    assert stage_layers(32, 4) == 8 and stage_layers(30, 4) == 8  # no model: equal blocks
    hw = load_hardware("h100")
    one = step_time(big_head, ParallelPlan(tp=2, micro_batches=2), hw, 4 * 16, 16)
    two = step_time(big_head, ParallelPlan(tp=2, pp=2, micro_batches=2), hw, 4 * 16, 16)
    assert two.tp_wire_bytes == pytest.approx(one.tp_wire_bytes * 7 / 8, rel=1e-12)


def test_too_many_stages_is_one_line_error():
    with pytest.raises(ValueError, match="n_layers"):
        split_blocks(4, 5, 1.0, 0.0)
