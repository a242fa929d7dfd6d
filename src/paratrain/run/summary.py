"""A training run's summary: what it measured (loss, speed, bytes, memory), built once
at the end of :func:`paratrain.run.loop.train`, printed by rank 0 and written to
``RUN_DIR/summary.json`` (what `paratrain report` and `paratrain check-model` read).

Means: ``step_s``, ``tokens_per_s``, ``mfu`` and every axis' communication are means over
the steps of this session after its first (which pays warm-up: gloo's connections,
allocator growth), named by ``mean_over_steps`` (1-based, inclusive); the progress line
shows the last step's figures and says so. MFU divides by one peak, measured before
training (:func:`paratrain.bench.peak.measure_peak`), for every step and the summary.

Communication per axis (``comm``): bytes this rank sent and seconds it spent, per step,
as the runtime counted them, for each axis of the mesh wider than one rank:

- ``dp``: the gradient reduction (dense over dp x cp, experts over edp); the wait after
  backward that overlap did not hide;
- ``tp``: the blocks' and the embedding/head's collectives (``blocks_wire_bytes_per_step``
  is the part the prediction prices); time inside them, all exposed (they block);
- ``pp``: the activations and input gradients sent between stages; time blocked in
  receives and the step's last send waits, so the bubble is included;
- ``cp``: the K/V exchange of context-parallel attention; the wait overlap did not hide;
- ``ep``: the MoE token all-to-alls and their split sizes; time inside them.

Scalar all-reduces (loss, gradient norm, stop signal) are not counted.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from paratrain.bench.peak import Peak
from paratrain.config import ModelConfig, TrainConfig
from paratrain.cost.shapes import as_shape
from paratrain.files.batches import Corpus, bits_per_byte
from paratrain.parallel.memory import ActivationMeter, format_report, memory_report
from paratrain.parallel.process_groups import node_ranks_and_gpus
from paratrain.plan import ParallelPlan

AXES = ("dp", "tp", "pp", "cp", "ep")
TIME_IS = {"dp": "exposed wait after backward", "tp": "in the blocking collectives",
           "pp": "blocked in receives and sends, bubble included",
           "cp": "exposed wait for K/V", "ep": "in the all-to-alls"}
# the prediction's (bytes, seconds) fields for each axis (paratrain.predict.step.Prediction)
PREDICTED = {"dp": ("dp_wire_bytes", "dp_exposed_s"), "tp": ("tp_wire_bytes", "tp_comm_s"),
             "pp": ("pp_wire_bytes", "pp_comm_s"), "cp": ("cp_wire_bytes", "cp_exposed_s"),
             "ep": ("ep_wire_bytes", "ep_comm_s")}


def comm_counters(engine) -> dict[str, list[float]]:
    """[bytes sent, seconds] per axis that this rank's runtime has counted so far
    (cumulative; the pipeline's seconds are its last step's): read before and after a
    training step by :func:`step_comm`."""
    out: dict[str, list[float]] = {}
    tp = getattr(engine, "tp_states", None) or []
    if tp:
        comms = [c for st in tp for c in (st.blocks, st.edges)]
        out["tp"] = [sum(c.wire_bytes for c in comms), sum(c.seconds for c in comms)]
        out["tp_blocks"] = [sum(st.blocks.wire_bytes for st in tp), 0.0]
    rt = getattr(engine, "runtime", None)
    if rt is not None:
        out["pp"] = [rt.sent_bytes, 0.0]
    for axis in ("cp", "ep"):
        ex = getattr(engine, axis, None)
        if ex is not None:
            out[axis] = [ex.wire_bytes, getattr(ex, "exposed_s", getattr(ex, "seconds", 0.0))]
    return out


def step_comm(engine, before: dict, dp) -> dict[str, list[float]]:
    """One training step's [bytes sent, seconds] per axis: the counters' change since
    ``before`` (so evaluation's traffic is left out) and ``dp``, the step's CommStats."""
    now = comm_counters(engine)
    out = {"dp": [float(dp.wire_bytes), float(dp.seconds)]}
    for k, (b, s) in now.items():
        b0, s0 = before.get(k, (0.0, 0.0))
        out[k] = [b - b0, s - s0]
    if "pp" in out:  # the runtime's wait is per step already
        out["pp"][1] = float(engine.runtime.wait_s)
    return out


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def comm_summary(plan: ParallelPlan, steps: list[dict]) -> dict:
    """``summary["comm"]``: per axis wider than one rank, the means over ``steps`` (the
    per-step dicts of :func:`step_comm`)."""
    out = {}
    for axis in AXES:
        size = getattr(plan, axis)
        if size == 1 and axis != "dp":
            continue
        out[axis] = {"ranks": size, "time_is": TIME_IS[axis],
                     "wire_bytes_per_step": _mean([s.get(axis, [0.0])[0] for s in steps]),
                     "seconds_per_step": _mean([s.get(axis, [0, 0.0])[1] for s in steps])}
    if "tp" in out:
        out["tp"]["blocks_wire_bytes_per_step"] = _mean(
            [s.get("tp_blocks", [0.0])[0] for s in steps])
    return out


SHORT = {"dp": "waited", "tp": "in collectives", "pp": "waited, bubble included",
         "cp": "waited", "ep": "in all-to-alls"}


def format_comm(summary: dict) -> list[tuple[str, str]]:
    """Rows for the run's table: each axis' MB sent and seconds per rank per step (the
    summary's mean), beside the prediction when the run has one."""
    pred = (summary.get("prediction") or {}).get("predicted")
    rows = []
    for axis, c in (summary.get("comm") or {}).items():
        text = (f"{c['wire_bytes_per_step'] / 1e6:.4f} MB sent, "
                f"{c['seconds_per_step']:.4f} s {SHORT[axis]}")
        if pred:
            b, s = PREDICTED[axis]
            blocks = (f" (blocks; measured {c['blocks_wire_bytes_per_step'] / 1e6:.4f})"
                      if axis == "tp" else "")
            text += f"; predicted {pred[b] / 1e6:.4f} MB{blocks}, {pred[s]:.4f} s"
        rows.append((f"comm {axis} x{c['ranks']} per rank/step", text))
    return rows


def mean_label(summary: dict) -> str:
    """"mean over steps 2-300" (or "step 1" for a one-step run)."""
    if "mean_over_steps" not in summary:  # a summary written before the field existed
        return "mean over steps after the first"
    a, b = summary["mean_over_steps"]
    return f"mean over steps {a}-{b}" if b > a else f"step {b}"


def build_summary(engine, corpus: Corpus, mcfg: ModelConfig, tcfg: TrainConfig,
                  plan: ParallelPlan, world: int, tally, peak: Peak,
                  meter: ActivationMeter, val_tokens: int, val_bytes: int) -> dict:
    """The run's summary (without the prediction), the same on every rank but for its
    communication (this rank's); ``tally`` holds what the steps left (paratrain.run.loop's
    _Tally)."""
    tokens = tcfg.global_batch * mcfg.context
    times, comms = tally.times, tally.comms
    skip = 1 if len(times) > 1 else 0  # the first step pays warm-up costs
    step_s = _mean(times[skip:])
    comm_s = _mean(comms[skip:])
    if hasattr(engine, "activation_peak_bytes"):  # engines that meter their own: theirs
        # (the pipeline's in-flight peak; the loop's watch spans a whole pipeline step,
        # every micro-batch at once, which is no peak the rank ever holds)
        meter.peak_bytes = engine.activation_peak_bytes()
    flops = as_shape(mcfg).flops_per_token(mcfg.context) * tokens
    return {
        "steps": tcfg.steps, "world_size": world, "plan": asdict(plan),
        "params": as_shape(mcfg).num_params(), "active_params": as_shape(mcfg).active_params(),
        "tokens_per_step": tokens,
        "final_loss": tally.losses[-1] if tally.losses else float("nan"),
        "val_loss": tally.val_loss, "losses": tally.losses, "tokenizer": tcfg.tokenizer,
        "val_bpb": bits_per_byte(tally.val_loss, val_tokens, val_bytes),
        "moe_steps": tally.moe_steps,
        "mean_over_steps": [tally.first_step + 1 + skip, tally.first_step + len(times)],
        "step_s": step_s, "tokens_per_s": tokens / step_s,
        "compute_s_per_step": step_s - comm_s, "comm_s_per_step": comm_s,
        "payload_bytes_per_step": tally.payload, "wire_bytes_per_step": tally.wire,
        "comm": comm_summary(plan, tally.comm_steps[skip:]),
        "peak_flops_per_rank": peak.flops, "peak": peak.to_dict(),
        "mfu": peak.mfu(flops / step_s / world) if math.isfinite(step_s) else float("nan"),
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


def run_prediction(mcfg: ModelConfig, tcfg: TrainConfig, plan: ParallelPlan, world: int,
                   summary: dict, profile: str | None, device: torch.device) -> dict | None:
    """The systems model's prediction beside this run's measurement (paratrain.predict):
    on CUDA the catalogue's entry for the GPU (:mod:`paratrain.predict.gpu`), on CPU this
    machine's calibrated profile, None without one. A broken profile is reported, not
    fatal to a run. Rank 0 computes it (it samples the machine's load) and sends it to
    every rank, so the summary stays the same everywhere."""
    from paratrain.predict import summary_prediction
    from paratrain.predict.gpu import gpu_prediction

    distributed = dist.is_available() and dist.is_initialized()
    rep = None
    if not distributed or dist.get_rank() == 0:
        try:
            if device.type == "cuda":
                rep = gpu_prediction(mcfg, tcfg, plan, world, summary,
                                     torch.cuda.get_device_name(device), node_ranks_and_gpus())
            else:
                rep = summary_prediction(mcfg, tcfg, plan, world, summary, profile)
        except ValueError as e:
            rep = {"error": str(e)}
    if distributed and world > 1:
        box = [rep]
        dist.broadcast_object_list(box, src=0)
        rep = box[0]
    return rep
