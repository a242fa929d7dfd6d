"""Every parallelism composes on one mesh: ZeRO 0-3 x TP (+SP) x PP (every schedule),
with recompute, overlap on/off and our own collectives, reproduce the single process.

float64, 4+ steps, same global batch: the loss trajectory and the validation loss match
one process to 1e-9 relative. The layouts the composable-mesh issue names are here, plus
a spread of the rest (each world size runs in one spawn; start-up is ~3 s a spawn).
"""

from __future__ import annotations

import pytest

from conftest import TINY, max_rel_diff, parity_tcfg
from paratrain.config import ModelConfig
from paratrain.parallel.process_groups import spawn
from paratrain.plan import ParallelPlan
from paratrain.run.loop import RunOptions, train

M4 = TINY.replace(n_layers=4)
M8 = M4.replace(n_layers=8)
# a vocabulary of 131 over tp 2 (66 / 65 rows) and sizes nothing divides evenly
ODD = ModelConfig(n_layers=4, d_model=36, n_heads=2, d_ff=50, context=16, vocab_size=131)
QUIET = dict(quiet=True, measure_peak=False)
BUCKET_MB = 0.02  # many buckets per chunk

FOUR = {
    "tp2 zero3": (M4, ParallelPlan(dp=2, tp=2, zero=3)),
    "tp2 zero1": (M4, ParallelPlan(dp=2, tp=2, zero=1)),
    "pp2 zero2 m4": (M4, ParallelPlan(dp=2, pp=2, zero=2, micro_batches=4)),
    "pp2 zero3 interleaved v2 m4": (M8, ParallelPlan(dp=2, pp=2, zero=3, micro_batches=4,
                                                     schedule="interleaved",
                                                     virtual_stages=2)),
    "tp2 sp zero2 accum2 ours": (M4, ParallelPlan(dp=2, tp=2, sp=True, zero=2,
                                                  micro_batches=2, collectives="ours")),
    "tp2 zero3 full recompute no overlap": (M4, ParallelPlan(dp=2, tp=2, zero=3,
                                                             recompute="full",
                                                             overlap=False)),
    "tp2 zero3 odd vocab": (ODD, ParallelPlan(dp=2, tp=2, zero=3)),
    "pp2 zero1 zb-h1 m4": (M4, ParallelPlan(dp=2, pp=2, zero=1, micro_batches=4,
                                            schedule="zb-h1")),
    "pp2 zero3 zb-h1 m4 ours": (M4, ParallelPlan(dp=2, pp=2, zero=3, micro_batches=4,
                                                 schedule="zb-h1", collectives="ours")),
    "pp2 zero0 gpipe m2 no overlap": (M4, ParallelPlan(dp=2, pp=2, micro_batches=2,
                                                       schedule="gpipe", overlap=False)),
    "pp2 zero2 1f1b selective": (M4, ParallelPlan(dp=2, pp=2, zero=2, micro_batches=2,
                                                  recompute="selective")),
}
EIGHT = {
    "tp2 pp2 zero3 sp m4": (M4, ParallelPlan(dp=2, tp=2, pp=2, zero=3, sp=True,
                                             micro_batches=4)),
    "tp2 pp2 zero2 interleaved m4": (M8, ParallelPlan(dp=2, tp=2, pp=2, zero=2,
                                                      micro_batches=4, schedule="interleaved",
                                                      virtual_stages=2)),
    "tp2 pp2 zero1 full recompute m2": (M4, ParallelPlan(dp=2, tp=2, pp=2, zero=1,
                                                         micro_batches=2, recompute="full")),
}


def _worker(rank: int, world: int, data: str, combos: dict) -> dict:
    out = {}
    for name, (model, plan) in combos.items():
        plan = plan.replace(bucket_mb=BUCKET_MB)
        s = train(model, parity_tcfg(data), plan, RunOptions(**QUIET))
        out[name] = (s["losses"], s["val_loss"])
    return out


@pytest.fixture(scope="module")
def refs(text_file):
    return {m: train(m, parity_tcfg(text_file), None, RunOptions(**QUIET))
            for m in {m for m, _ in (*FOUR.values(), *EIGHT.values())}}


@pytest.mark.parametrize("world,combos", [(4, FOUR), (8, EIGHT)], ids=["world4", "world8"])
@pytest.mark.slow
def test_layouts_reproduce_one_process(text_file, refs, world, combos):
    results = spawn(_worker, world, text_file, combos, timeout_s=600)
    worst = {}
    for name, (model, _) in combos.items():
        losses, val = results[0][name]
        ref = refs[model]
        d = max_rel_diff(losses, ref["losses"])
        worst[name] = d
        print(f"{name}: {len(losses)}-step max rel loss diff {d:.2e}; val {val:.10f} vs "
              f"{ref['val_loss']:.10f}")
        for r in results[1:]:
            assert r[name][0] == losses, f"{name}: ranks disagree on the loss"
    for name, (model, _) in combos.items():
        assert worst[name] <= 1e-9, f"{name}: {worst[name]:.2e}"
        assert results[0][name][1] == pytest.approx(refs[model]["val_loss"], rel=1e-9), name
