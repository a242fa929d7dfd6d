"""3-D layouts on 8 gloo processes reproduce the single process (10 float64 steps):
(dp, tp, pp) = (2, 2, 2) with 1F1B and SP, (2, 1, 4) with ZeRO-1 over the dp axis,
(1, 2, 4) interleaved with v = 2. Also: the measured bubble and TP bytes are reported."""

from __future__ import annotations

import pytest

from conftest import TINY, max_rel_diff
from paratrain.config import TrainConfig
from paratrain.parallel.process_groups import spawn
from paratrain.plan import ParallelPlan
from paratrain.run.loop import RunOptions, train

MODEL4 = TINY.replace(n_layers=4)
MODEL8 = MODEL4.replace(n_layers=8)
QUIET = dict(quiet=True, measure_peak=False)
COMBOS = {
    "(2,2,2) 1f1b sp": (MODEL4, ParallelPlan(dp=2, tp=2, pp=2, sp=True, micro_batches=2)),
    "(2,1,4) zero-1": (MODEL4, ParallelPlan(dp=2, pp=4, zero=1, micro_batches=4)),
    "(1,2,4) interleaved v=2": (MODEL8, ParallelPlan(tp=2, pp=4, schedule="interleaved",
                                                     virtual_stages=2, micro_batches=4)),
}


def tcfg(data: str) -> TrainConfig:
    return TrainConfig(steps=10, global_batch=8, lr=1e-2, warmup_steps=3, eval_every=0,
                       eval_batches=1, dtype="float64", data=data)


def _worker(rank: int, world: int, data: str) -> dict:
    out = {}
    for name, (model, plan) in COMBOS.items():
        s = train(model, tcfg(data), plan, RunOptions(**QUIET))
        out[name] = (s["losses"], s["val_loss"], s["model_parallel"])
    return out


@pytest.mark.slow
def test_three_d_layouts_match_one_process(text_file):
    refs = {n: train(m, tcfg(text_file), None, RunOptions(**QUIET))
            for n, m in ((4, MODEL4), (8, MODEL8))}
    results = spawn(_worker, 8, text_file, timeout_s=600)
    for name, (model, _) in COMBOS.items():
        losses, val, rep = results[0][name]
        ref = refs[model.n_layers]
        d = max_rel_diff(losses, ref["losses"])
        print(f"{name}: 10-step max rel loss diff {d:.2e}; val {val:.6f} vs "
              f"{ref['val_loss']:.6f}; bubble measured "
              f"{rep['pipeline']['bubble_measured']:.3f} simulated "
              f"{rep['pipeline']['bubble_simulated']:.3f}")
        assert d <= 1e-9
        assert val == pytest.approx(ref["val_loss"], rel=1e-9)
        for r in results[1:]:
            assert r[name][0] == losses
        assert 0.0 <= rep["pipeline"]["bubble_measured"] < 1.0
        if "tp" in rep:
            assert rep["tp"]["wire_bytes_per_layer_per_microbatch"] == pytest.approx(
                rep["tp"]["formula_wire_bytes_per_layer_per_microbatch"])
