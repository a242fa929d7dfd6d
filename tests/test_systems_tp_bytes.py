"""TP collectives per block: one torch-free count (cost/tp_bytes.py) that the systems
model uses and that equals the runtime's (parallel/tensor.py), full recomputation
included (5 all-reduce-sized transfers per block, not 6)."""

from __future__ import annotations

import pytest

from paratrain.cost.hardware import load_hardware
from paratrain.cost.shapes import load_model
from paratrain.cost.tp_bytes import tp_collectives_per_layer, tp_wire_bytes_per_layer
from paratrain.plan import ParallelPlan
from paratrain.systems.step_time import step_time


def test_counts_per_block():
    assert tp_collectives_per_layer(False, "none") == {"all_reduce": 4}
    assert tp_collectives_per_layer(False, "selective") == {"all_reduce": 4}
    # non-reentrant checkpointing stops once the MLP's saved tensors are back: the
    # recomputed forward repeats the attention exit's all-reduce only
    assert tp_collectives_per_layer(False, "full") == {"all_reduce": 5}
    assert tp_collectives_per_layer(True, "none") == {"all_gather": 4, "reduce_scatter": 4}
    assert tp_collectives_per_layer(True, "full") == {"all_gather": 5, "reduce_scatter": 5}


def test_the_runtime_uses_this_formula():
    """One home: the runtime's report (its formulas: cost/run_figures.py) and the
    systems model call the same function."""
    from paratrain.cost import run_figures
    from paratrain.parallel import tensor

    assert tensor.tp_wire_bytes_per_layer is tp_wire_bytes_per_layer
    assert run_figures.tp_wire_bytes_per_layer is tp_wire_bytes_per_layer


@pytest.mark.parametrize("sp", [False, True])
def test_step_time_counts_five_transfers_under_full_recompute(sp):
    m, hw = load_model("llama2-7b"), load_hardware("h100")
    kw = dict(tp=8, dp=8, sp=sp, micro_batches=2)
    none = step_time(m, ParallelPlan(**kw), hw, 2**20, 4096)
    full = step_time(m, ParallelPlan(**kw, recompute="full"), hw, 2**20, 4096)
    assert full.tp_wire_bytes == pytest.approx(none.tp_wire_bytes * 5 / 4, rel=1e-12)
    assert full.tp_comm_s == pytest.approx(none.tp_comm_s * 5 / 4, rel=1e-12)
    act = 16 * 4096 * 4096 * 2  # 16 sequences per micro-batch per dp rank, bf16
    per_layer = tp_wire_bytes_per_layer(16, 4096, 4096, 8, 2, 2, "full")
    assert full.tp_wire_bytes == pytest.approx(2 * 32 * per_layer, rel=1e-12)
    assert per_layer == pytest.approx(5 * 2 * 7 / 8 * act, rel=1e-12)
