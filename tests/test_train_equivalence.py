"""Data parallelism changes where the arithmetic happens, not what it computes.

Over 20 steps on the same global batch of 16 windows, these agree:
(a) one process, (b) --simulate-workers 4, (c) 2 and (d) 4 real gloo processes —
to 1e-9 relative in float64 (only the order of additions differs) and 1e-4 in float32
(where AdamW's division by sqrt(v) amplifies rounding). Also: bitwise determinism of
identical runs, and resume (10 + 10 steps) == 20 uninterrupted steps, bitwise.
"""

from __future__ import annotations

import pytest

from conftest import TINY
from paratrain.config import TrainConfig
from paratrain.parallel.process_groups import spawn
from paratrain.plan import ParallelPlan
from paratrain.run.loop import RunOptions, train

MODEL = TINY.replace(context=32)
QUIET = dict(quiet=True, measure_peak=False)


def tcfg(data: str, dtype: str, steps: int = 20) -> TrainConfig:
    return TrainConfig(steps=steps, global_batch=16, lr=1e-2, warmup_steps=3,
                       eval_every=0, eval_batches=2, dtype=dtype, data=data)


def rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _dp_worker(rank: int, world: int, data: str, ckpt: str) -> dict:
    out = {}
    for dtype in ("float64", "float32"):
        out[dtype] = train(MODEL, tcfg(data, dtype), ParallelPlan(dp=world),
                           RunOptions(**QUIET))["losses"]
    if world == 2:  # resume across real processes: 10 steps, stop, resume to 20
        t = tcfg(data, "float32")
        train(MODEL, t, ParallelPlan(dp=2),
              RunOptions(checkpoint_dir=ckpt, stop_after=10, **QUIET))
        out["resumed"] = train(MODEL, t, ParallelPlan(dp=2),
                               RunOptions(checkpoint_dir=ckpt, resume=True, **QUIET))["losses"]
    return out


@pytest.fixture(scope="module")
def reference(text_file):
    return {d: train(MODEL, tcfg(text_file, d), None, RunOptions(**QUIET))["losses"]
            for d in ("float64", "float32")}


def test_identical_runs_are_bitwise_equal(text_file, reference):
    again = train(MODEL, tcfg(text_file, "float32"), None, RunOptions(**QUIET))["losses"]
    assert again == reference["float32"]
    assert reference["float32"][-1] < reference["float32"][0] - 0.5  # it learns


def test_simulated_workers_match_one_process(text_file, reference):
    for dtype, tol in (("float64", 1e-9), ("float32", 1e-4)):
        sim = train(MODEL, tcfg(text_file, dtype), None,
                    RunOptions(simulate_workers=4, **QUIET))["losses"]
        print(f"simulate-workers 4 {dtype}: max rel diff {rel(sim, reference[dtype]):.3e}")
        assert rel(sim, reference[dtype]) <= tol


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.slow
def test_gloo_processes_match_one_process(text_file, reference, tmp_path, world):
    results = spawn(_dp_worker, world, text_file, str(tmp_path / "ckpt"), timeout_s=240)
    for r in results[1:]:  # every rank reports the same global loss
        assert r["float64"] == results[0]["float64"]
    for dtype, tol in (("float64", 1e-9), ("float32", 1e-4)):
        d = rel(results[0][dtype], reference[dtype])
        print(f"{world} gloo processes {dtype}: max rel diff {d:.3e}")
        assert d <= tol
    if world == 2:  # resumed across processes == the uninterrupted 2-process run, bitwise
        assert results[0]["resumed"] == results[0]["float32"][10:]


def test_resume_is_bitwise_identical(text_file, reference, tmp_path):
    t = tcfg(text_file, "float32")
    first = train(MODEL, t, None, RunOptions(checkpoint_dir=str(tmp_path), stop_after=10,
                                             **QUIET))["losses"]
    rest = train(MODEL, t, None, RunOptions(checkpoint_dir=str(tmp_path), resume=True,
                                            **QUIET))["losses"]
    assert first + rest == reference["float32"]


def test_corrupt_checkpoint_is_refused(text_file, tmp_path):
    t = tcfg(text_file, "float32", steps=2)
    train(MODEL, t, None, RunOptions(checkpoint_dir=str(tmp_path), **QUIET))
    (f,) = (tmp_path / "step_000002").glob("*.distcp")  # the one rank's data file
    f.write_bytes(f.read_bytes()[:-8] + b"garbage!")
    with pytest.raises(ValueError, match="no intact checkpoint"):
        train(MODEL, t, None, RunOptions(checkpoint_dir=str(tmp_path), resume=True, **QUIET))


def test_bfloat16_tracks_float32(text_file, reference):
    """bf16 autocast with FP32 master weights: same trajectory to bf16's precision."""
    bf = train(MODEL, tcfg(text_file, "bfloat16"), None, RunOptions(**QUIET))["losses"]
    d = rel(bf, reference["float32"])
    print(f"bfloat16 vs float32: max rel diff {d:.3e}")
    assert d <= 5e-3
