"""What a mesh run reports beside its prediction: the measured pipeline bubble, the
activation peaks, the tensor-parallel bytes per layer (collective over the world)."""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from paratrain.cost.ranks import ELEMENT_BYTES
from paratrain.cost.run_figures import block_figures, pipeline_figures
from paratrain.parallel.mesh import Mesh


def model_parallel_report(engine) -> dict:
    """Measured beside predicted (collective over the world: every rank calls it).

    Bubble: per step, 1 - (sum of compute-action durations over the p stages of data
    replica 0, tp rank 0) / (p x the step's span from first start to last end), the
    median over steps after the first; beside the schedule's simulated and textbook
    bubble. Activations: the peak over a step of bytes saved for backward on each
    rank (in-flight micro-batches included), beside the per-layer formula. TP/SP: bytes
    each rank sent in the blocks' collectives, per layer and micro-batch. Every formula
    comes from :mod:`paratrain.cost.run_figures`; this module only measures.
    """
    plan, m = engine.plan, engine.mcfg
    out: dict = {"mesh": dict(engine.mesh.sizes), "groups_built_by": engine.mesh.source}
    world = engine.mesh.world
    if engine.runtime is not None:
        gathered = [None] * world
        mine = engine.timelines if engine.mesh.index("tp") == 0 and engine.dp_rank == 0 else None
        dist.all_gather_object(gathered, mine)
        over = [None] * world
        dist.all_gather_object(over, statistics.median(engine.overheads[1:] or engine.overheads))
        stages = [gathered[_rank_for(engine.mesh, r)] for r in range(plan.pp)]
        bubbles = [_bubble([st[i] for st in stages]) for i in range(len(stages[0]))]
        v = engine.schedule.virtual_stages
        t_first = min(sp[3] for st in stages for sp in st[-1])
        out["pipeline"] = {
            "schedule": plan.schedule, "pp": plan.pp, "micro_batches": plan.micro_batches,
            "virtual_stages": v,
            "bubble_measured": statistics.median(bubbles[1:] or bubbles),
            "bubble_measured_per_step": bubbles,
            **pipeline_figures(engine.schedule),
            "runtime_overhead_s_per_action_per_rank": over,
            "timeline": [[[k, mb, c, a - t_first, b - t_first] for k, mb, c, a, b in st[-1]]
                         for st in stages],
        }
    peak = torch.tensor([float(max(engine.act_peaks[1:] or engine.act_peaks or [0]))],
                        dtype=torch.float64, device=engine.device)
    peaks = [torch.zeros_like(peak) for _ in range(world)]
    if dist.is_initialized():
        dist.all_gather(peaks, peak)
    else:
        peaks = [peak]
    local_b = engine.cfg.global_batch // engine.dp_size
    b_mb = local_b // plan.micro_batches
    layers_on_rank = sum(len(c.blocks) for c in engine.model)
    formula = block_figures(m, plan, engine.cfg, b_mb)
    out["activation"] = {
        "recompute": plan.recompute,
        "measured_peak_bytes_per_rank": [int(t.item()) for t in peaks],
        "formula_bytes_per_layer_per_microbatch":
            formula["activation_bytes_per_layer_per_microbatch"],
        "systems_model_busiest_rank_bytes": formula["busiest_rank_activation_bytes"],
        "layers_on_rank": layers_on_rank, "sequences_per_microbatch": b_mb,
    }
    if plan.tp > 1:
        # forward + backward passes of each block: one per call without a pipeline
        # (the loop accumulates micro-batches), m per step with one
        mbs = max(1, len(engine.act_peaks)) * (plan.micro_batches if plan.pp > 1 else 1)
        st_blk = engine.tp_states
        layers = max(1, layers_on_rank)
        out["tp"] = {
            "sp": plan.sp,
            "wire_bytes_per_layer_per_microbatch":
                sum(st.blocks.wire_bytes for st in st_blk) / layers / mbs,
            "collectives_per_layer_per_microbatch":
                sum(st.blocks.calls for st in st_blk) / layers / mbs,
            "formula_wire_bytes_per_layer_per_microbatch":
                formula["tp_wire_bytes_per_layer_per_microbatch"],
        }
    if engine.cp is not None:
        out["cp"] = cp_report(engine)
    return out


def cp_report(engine) -> dict:
    """Bytes this rank sent for context-parallel attention per training step (evaluation
    excluded), beside :func:`paratrain.cost.layout.cp_wire_bytes`; the load balance of the
    block schedule (attention pairs per cp rank, balanced vs contiguous)."""
    from paratrain.cost.layout import attention_pairs_per_rank, cp_wire_bytes

    plan, m = engine.plan, engine.mcfg
    steps = max(1, engine.data.steps_done or len(engine.act_peaks))
    layers = sum(len(c.blocks) for c in engine.model)
    batch = engine.cfg.global_batch // engine.dp_size
    marks = engine.cp.step_marks
    exposed = [b - a for a, b in zip([0.0] + marks[:-1], marks, strict=True)]
    bal = attention_pairs_per_rank(m.context, plan.cp, True)
    con = attention_pairs_per_rank(m.context, plan.cp, False)
    return {
        "cp": plan.cp, "algorithm": plan.cp_algorithm,
        "wire_bytes_per_step": engine.cp.wire_bytes / steps,
        "transfers_per_step": engine.cp.calls / steps,
        # waiting for K/V (ring) or in the all-to-alls: what overlap did not hide; the
        # mean over steps after the first (which also opens gloo's connections)
        "exposed_comm_s_per_step": statistics.mean(exposed[1:] or exposed or [0.0]),
        "formula_wire_bytes_per_step": cp_wire_bytes(m, plan, ELEMENT_BYTES[engine.cfg.dtype],
                                                     batch, layers),
        "attention_pairs_per_rank": bal,
        "attention_pairs_per_rank_contiguous": con,
    }


def format_model_parallel(rep: dict) -> str:
    """A few lines for the end of a run: bubble, activations, TP bytes, each measured
    beside its prediction."""
    lines = []
    if "pipeline" in rep:
        p = rep["pipeline"]
        over_ms = 1e3 * max(p["runtime_overhead_s_per_action_per_rank"])
        lines.append(f"pipeline {p['schedule']} p={p['pp']} m={p['micro_batches']} "
                     f"v={p['virtual_stages']}: bubble measured {p['bubble_measured']:.3f}, "
                     f"simulated {p['bubble_simulated']:.3f}, formula {p['bubble_formula']:.3f}; "
                     f"runtime overhead {over_ms:.3f} ms per action (neither computing nor "
                     "waiting)")
    a = rep["activation"]
    lines.append(f"activations (recompute {a['recompute']}): measured peak "
                 f"{max(a['measured_peak_bytes_per_rank']) / 1e6:.3f} MB on the busiest rank; "
                 f"systems model {a['systems_model_busiest_rank_bytes'] / 1e6:.3f} MB; "
                 f"formula {a['formula_bytes_per_layer_per_microbatch'] / 1e6:.3f} MB per "
                 "layer per micro-batch")
    if "tp" in rep:
        t = rep["tp"]
        lines.append(f"tensor parallel (sp={t['sp']}): "
                     f"{t['wire_bytes_per_layer_per_microbatch'] / 1e6:.4f} MB sent per layer "
                     f"per micro-batch in {t['collectives_per_layer_per_microbatch']:.0f} "
                     f"collectives (formula "
                     f"{t['formula_wire_bytes_per_layer_per_microbatch'] / 1e6:.4f} MB)")
    if "cp" in rep:
        c = rep["cp"]
        lines.append(f"context parallel {c['cp']} ({c['algorithm']}): "
                     f"{c['wire_bytes_per_step'] / 1e6:.4f} MB sent per step in "
                     f"{c['transfers_per_step']:.0f} transfers (formula "
                     f"{c['formula_wire_bytes_per_step'] / 1e6:.4f} MB)")
    return "\n".join(lines)


def _rank_for(mesh: Mesh, pp_index: int) -> int:
    """Global rank of (pp_index, dp 0, tp 0): whose timeline represents that stage."""
    return pp_index * mesh.size("dp") * mesh.size("cp") * mesh.size("tp")


def _bubble(stage_spans: list[list]) -> float:
    """1 - busy / (p x span) over one step's compute spans (absolute times) per stage."""
    lo = min(a for st in stage_spans for _, _, _, a, _ in st)
    hi = max(b for st in stage_spans for _, _, _, _, b in st)
    busy = sum(b - a for st in stage_spans for _, _, _, a, b in st)
    return 1.0 - busy / (len(stage_spans) * (hi - lo)) if hi > lo else 0.0
