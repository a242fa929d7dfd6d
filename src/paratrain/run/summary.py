"""A training run's summary: what it measured (loss, speed, bytes, memory), built once
at the end of :func:`paratrain.run.loop.train`, printed by rank 0 and written to
``RUN_DIR/summary.json`` (what `paratrain report` and `paratrain check-model` read).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from paratrain.bench.peak import PeakTracker
from paratrain.config import ModelConfig, TrainConfig
from paratrain.cost.shapes import as_shape
from paratrain.files.batches import Corpus, bits_per_byte
from paratrain.parallel.memory import ActivationMeter, format_report, memory_report
from paratrain.plan import ParallelPlan


def build_summary(engine, corpus: Corpus, mcfg: ModelConfig, tcfg: TrainConfig,
                  plan: ParallelPlan, world: int, tally, peak: PeakTracker,
                  meter: ActivationMeter, val_tokens: int, val_bytes: int) -> dict:
    """The run's summary (without the prediction), the same on every rank; ``tally``
    holds what the steps left (paratrain.run.loop's _Tally)."""
    tokens = tcfg.global_batch * mcfg.context
    times, comms = tally.times, tally.comms
    skip = 1 if len(times) > 1 else 0  # the first step pays warm-up costs
    n = max(1, len(times) - skip)
    step_s = sum(times[skip:]) / n if times else float("nan")
    comm_s = sum(comms[skip:]) / n if comms else float("nan")
    if hasattr(engine, "activation_peak_bytes"):  # engines that meter their own: theirs
        # (the pipeline's in-flight peak; the loop's watch spans a whole pipeline step,
        # every micro-batch at once, which is no peak the rank ever holds)
        meter.peak_bytes = engine.activation_peak_bytes()
    return {
        "steps": tcfg.steps, "world_size": world, "plan": asdict(plan),
        "params": as_shape(mcfg).num_params(), "active_params": as_shape(mcfg).active_params(),
        "tokens_per_step": tokens,
        "final_loss": tally.losses[-1] if tally.losses else float("nan"),
        "val_loss": tally.val_loss, "losses": tally.losses, "tokenizer": tcfg.tokenizer,
        "val_bpb": bits_per_byte(tally.val_loss, val_tokens, val_bytes),
        "moe_steps": tally.moe_steps,
        "step_s": step_s, "tokens_per_s": tokens / step_s,
        "compute_s_per_step": step_s - comm_s, "comm_s_per_step": comm_s,
        "payload_bytes_per_step": tally.payload, "wire_bytes_per_step": tally.wire,
        "peak_flops_per_rank": peak.peak, "peak_remeasured": peak.remeasured,
        "mfu": as_shape(mcfg).flops_per_token(mcfg.context) * tokens / step_s / (peak.peak * world),
        "unigram_entropy": corpus.unigram_entropy(),
        "memory": memory_report(engine, mcfg, plan, tcfg, meter),
        "dp": engine.report() if hasattr(engine, "report") else {},
        "model_parallel": engine.model_parallel_report()  # bubble, activations, TP bytes
        if hasattr(engine, "model_parallel_report") else {},
    }


def report_summary(summary: dict, rank: int, quiet: bool, run_dir: Path | None) -> None:
    """Rank 0 prints the memory, model-parallel and prediction tables and writes
    summary.json (and the measured pipeline timeline)."""
    if rank == 0 and not quiet:
        print(format_report(summary["memory"]))
        if summary["model_parallel"]:
            from paratrain.parallel.mesh_report import format_model_parallel

            print(format_model_parallel(summary["model_parallel"]))
        from paratrain.predict import format_prediction

        print(format_prediction(summary["prediction"]))
    if rank == 0 and run_dir is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        if "pipeline" in summary["model_parallel"]:  # for `paratrain viz pipeline --measured`
            (run_dir / "pipeline_timeline.json").write_text(
                json.dumps(summary["model_parallel"]["pipeline"]))
