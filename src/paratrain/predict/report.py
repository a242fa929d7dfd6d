"""Predicted beside measured: the comparison stored in a run's summary and the lines
printed at its end (:mod:`paratrain.predict`)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from paratrain.config import ModelConfig, TrainConfig
from paratrain.cost.layout import ELEMENT_BYTES
from paratrain.plan import ParallelPlan
from paratrain.predict.axes import ep_rows_from_load, ep_wire_bytes, expert_load_from_routing
from paratrain.predict.machine import load_machine, sample_other_sessions
from paratrain.predict.step import Prediction, predict

CALIBRATE_HINT = ("prediction: no hardware profile of this machine; run `paratrain bench "
                  "calibrate` to measure it (then every run prints predicted vs measured)")


def compare(pred: Prediction, summary: dict, plan: ParallelPlan, rank: int = 0,
            mcfg: ModelConfig | None = None, tcfg: TrainConfig | None = None) -> dict:
    """Predicted beside measured for one run's summary as ``rank`` saw it (its dp wire
    bytes; memory of every rank); CP bytes as the runtime counted them, EP bytes beside
    the count from the run's own routing (needs ``mcfg`` and ``tcfg``)."""
    tp_meas = None
    mp = summary.get("model_parallel") or {}
    if "tp" in mp:
        layers = mp["activation"]["layers_on_rank"]
        tp_meas = mp["tp"]["wire_bytes_per_layer_per_microbatch"] * layers * plan.micro_batches
    cp_meas = (mp.get("cp") or {}).get("wire_bytes_per_step")
    pp_meas = ((summary.get("comm") or {}).get("pp") or {}).get("wire_bytes_per_step")
    step_m = summary["step_s"]
    wires = pred.dp_wire_bytes_per_rank
    dp_pred = wires[rank] if rank < len(wires) else pred.dp_wire_bytes
    dp_meas = summary["wire_bytes_per_step"]
    return {
        "step_s": {"predicted": pred.step_s, "measured": step_m,
                   "error": pred.step_s / step_m - 1 if step_m else float("nan")},
        "compute_s": {"predicted": pred.step_s - pred.comm_s,
                      "measured": summary["compute_s_per_step"]},
        "comm_s": {"predicted": pred.comm_s, "measured": summary["comm_s_per_step"]},
        "dp_wire_bytes": {"predicted": dp_pred, "measured": dp_meas, "rank": rank,
                          "exact": math.isclose(dp_pred, dp_meas, rel_tol=1e-12,
                                                abs_tol=1e-9)},
        "tp_wire_bytes": {"predicted": pred.tp_wire_bytes, "measured": tp_meas,
                          "exact": None if tp_meas is None else
                          math.isclose(pred.tp_wire_bytes, tp_meas, rel_tol=1e-12)},
        "cp_wire_bytes": {"predicted": pred.cp_wire_bytes, "measured": cp_meas,
                          "exact": None if cp_meas is None else
                          math.isclose(pred.cp_wire_bytes, cp_meas, rel_tol=1e-12)},
        "pp_wire_bytes": {"predicted": pred.pp_wire_bytes, "measured": pp_meas,
                          "exact": None if pp_meas is None else
                          math.isclose(pred.pp_wire_bytes, pp_meas, rel_tol=1e-12)},
        "ep_wire_bytes": _ep_bytes(pred, summary, plan, mcfg, tcfg),
        **memory_vs_measured(summary, pred.states_bytes_per_rank, pred.activations_bytes),
    }


STATES = ("params", "grads", "optimizer")


def memory_vs_measured(summary: dict, states_per_rank: list[dict], activations: float
                       ) -> dict:
    """``states_bytes`` (every rank's model states, exact or not) and ``activations_bytes``
    (the peak over ranks) beside what the run's summary measured."""
    meas = summary.get("memory", {}).get("measured_per_rank", [])
    exact = bool(meas) and all(all(m[k] == p[k] for k in STATES)
                               for m, p in zip(meas, states_per_rank, strict=False))
    return {"states_bytes": {"predicted_per_rank": states_per_rank,
                             "measured_per_rank": [{k: m[k] for k in STATES} for m in meas],
                             "exact": exact},
            "activations_bytes": {"predicted": activations,
                                  "measured": max((m.get("activations_peak", 0)
                                                   for m in meas), default=0)}}


def _ep_bytes(pred: Prediction, summary: dict, plan: ParallelPlan,
              mcfg: ModelConfig | None, tcfg: TrainConfig | None) -> dict:
    """Rank 0's MoE all-to-all bytes in the first step (no evaluation precedes it):
    predicted under uniform routing, measured, and counted from that step's routing
    (:func:`paratrain.predict.axes.ep_rows_from_load`; pp = 1, where rank 0 holds every
    layer whose load the step records; dropless, where every routed row is sent; cp = 1
    and no SP, where the recorded load of data rank 0 is what rank 0 itself routed)."""
    steps = [s for s in summary.get("moe_steps") or [] if "ep_wire_bytes" in s]
    out = {"predicted": pred.ep_wire_bytes, "measured": None, "given_routing": None,
           "exact": None}
    if not steps:
        return out
    out["measured"] = steps[0]["ep_wire_bytes"]
    if (mcfg is not None and tcfg is not None and not mcfg.capacity_factor
            and _load_is_the_groups(plan)):
        sent, recv = ep_rows_from_load(plan, mcfg.experts, steps[0]["moe_load_by_rank"])
        out["given_routing"] = ep_wire_bytes(mcfg, plan, ELEMENT_BYTES[tcfg.dtype], sent,
                                             recv, plan.micro_batches * mcfg.moe_layers)
        out["exact"] = out["given_routing"] == out["measured"]
    return out


def _load_is_the_groups(plan: ParallelPlan) -> bool:
    """Whether a step's recorded ``moe_load_by_rank`` is what the ep groups routed: pp = 1
    (rank 0 holds every layer whose load the step records), cp = 1 and no SP (else each
    rank routes one shard of its data rank's tokens)."""
    return plan.pp == 1 and plan.cp == 1 and not plan.sp


def routing_load(summary: dict, plan: ParallelPlan, mcfg: ModelConfig) -> float | None:
    """The busiest ep rank's expert rows over the mean, from the run's routing, where
    the recorded load is what the ep groups routed (:func:`_load_is_the_groups`, as for
    the bytes: :func:`_ep_bytes`); None otherwise, or without ep. Layer by layer where
    the steps recorded it (``moe_layer_load``, :func:`paratrain.run.moe_stats.
    layer_load`: each layer's combine waits for that layer's busiest rank), the median
    over the steps after the first (the steps whose times are compared); else the first
    step's sum over layers (:func:`paratrain.predict.axes.expert_load_from_routing`),
    which a layer-by-layer imbalance that changes rank mostly cancels in."""
    steps = [s for s in summary.get("moe_steps") or [] if "moe_load_by_rank" in s]
    if plan.ep == 1 or not steps or not _load_is_the_groups(plan):
        return None
    layers = [s["moe_layer_load"] for s in steps[1:] or steps if "moe_layer_load" in s]
    if layers:
        return statistics.median(layers)
    return expert_load_from_routing(plan, mcfg.experts, steps[0]["moe_load_by_rank"])


def summary_prediction(mcfg: ModelConfig, tcfg: TrainConfig, plan: ParallelPlan, world: int,
                       summary: dict, profile: str | Path | None = None) -> dict | None:
    """``summary["prediction"]`` for a finished run, or None without a profile. The other
    sessions' load is sampled now, at the end of the run (a proxy for during it)."""
    machine = load_machine(profile)
    if machine is None:
        return None
    machine = machine.replace(others=sample_other_sessions(samples=5))
    pred = predict(mcfg, tcfg, plan, world, machine)
    import torch

    if torch.get_num_threads() > 1:  # the model prices one-thread ranks (workers set 1)
        pred.notes.append(f"this process ran {torch.get_num_threads()} intra-op threads; the "
                          "prediction prices one thread per rank")
    return {"predicted": pred.to_dict(), "vs_measured": compare(pred, summary, plan, 0, mcfg, tcfg)}


def summary_row(rep: dict | None) -> tuple[str, str]:
    """One row for the run's summary table: predicted step time, or what to do."""
    if rep is None:
        return "predicted s/step", "no hardware profile: run `paratrain bench calibrate`"
    if "error" in rep:
        return "predicted s/step", f"profile unusable: {rep['error']}"
    if "skipped" in rep:
        return "predicted s/step", f"not priced: {rep['skipped']}"
    c = rep["vs_measured"]["step_s"]
    return "predicted s/step", (f"{c['predicted']:.4f}  ({100 * c['error']:+.0f}% vs "
                                f"measured; breakdown above)")


def _axes_s(p: dict) -> str:
    """The CP exchange (exposed of total) and the MoE all-to-alls, where the run has them."""
    out = ""
    if p.get("cp_comm_s"):
        out += f", CP {p['cp_exposed_s']:.4f} exposed of {p['cp_comm_s']:.4f}"
    if p.get("ep_comm_s"):
        out += f", EP {p['ep_comm_s']:.4f}"
    return out


def format_prediction(rep: dict | None) -> str:
    """A few lines for the end of a run: predicted beside measured."""
    if rep is None:
        return CALIBRATE_HINT
    if "error" in rep:
        return f"prediction: skipped, the hardware profile is unusable: {rep['error']}"
    if "skipped" in rep:
        return f"prediction: not priced: {rep['skipped']}"
    if "gpu" in rep:
        return format_gpu_prediction(rep)
    p, c = rep["predicted"], rep["vs_measured"]
    mb = 1e6
    st = c["states_bytes"]
    m0 = st["measured_per_rank"][0] if st["measured_per_rank"] else None
    p0 = st["predicted_per_rank"][0]
    lines = [
        f"prediction ({p['machine']}; {p['share']:.2f} core per rank)",
        f"  step s      predicted {p['step_s']:.4f}  measured {c['step_s']['measured']:.4f}"
        f"  ({100 * c['step_s']['error']:+.0f}%)",
        f"  bounds      critical path {p['critical_path_s']:.4f} s; session CPU work "
        f"{p['session_work_s']:.4f} s on {p['session_cores']:.2f} cores = "
        f"{p['session_work_s'] / p['session_cores']:.4f} s; rank 0 CPU {p['cpu_rank0_s']:.4f} s",
        f"  syncs       {p.get('syncs', 0):.0f} blocking syncs on the critical path add "
        f"{p.get('sync_s', 0):.4f} s ({p.get('oversubscription', 1):.2f} runnable ranks per "
        "core)",
        f"  compute s   predicted {c['compute_s']['predicted']:.4f} (FLOPs "
        f"{p['compute_s']:.4f}, fixed {p['overhead_s']:.4f}, bubble {p['bubble_s']:.4f}, "
        f"TP {p['tp_comm_s']:.4f}, PP {p['pp_comm_s']:.4f}{_axes_s(p)})  measured "
        f"{c['compute_s']['measured']:.4f}",
        f"  comm s      predicted {c['comm_s']['predicted']:.4f} (DP sync "
        f"{p['dp_comm_s']:.4f})  measured {c['comm_s']['measured']:.4f}",
        f"  wire MB/rank DP predicted {c['dp_wire_bytes']['predicted'] / mb:.4f}  measured "
        f"{c['dp_wire_bytes']['measured'] / mb:.4f}"
        f"  {'exact' if c['dp_wire_bytes']['exact'] else 'DIFFERENT'}",
    ]
    if c["tp_wire_bytes"]["measured"] is not None:
        lines.append(f"  wire MB/rank TP predicted {p['tp_wire_bytes'] / mb:.4f}  measured "
                     f"{c['tp_wire_bytes']['measured'] / mb:.4f}"
                     f"  {'exact' if c['tp_wire_bytes']['exact'] else 'DIFFERENT'}")
    cp = c.get("cp_wire_bytes") or {}
    if cp.get("measured") is not None:
        lines.append(f"  wire MB/rank CP predicted {p['cp_wire_bytes'] / mb:.4f}  measured "
                     f"{cp['measured'] / mb:.4f}  {'exact' if cp['exact'] else 'DIFFERENT'}")
    ep = c.get("ep_wire_bytes") or {}
    if ep.get("measured") is not None:
        given = "" if ep["given_routing"] is None else (
            f"; from its routing {ep['given_routing'] / mb:.4f} "
            f"{'exact' if ep['exact'] else 'DIFFERENT'}")
        lines.append(f"  wire MB/rank EP predicted {p['ep_wire_bytes'] / mb:.4f} (uniform "
                     f"routing)  measured {ep['measured'] / mb:.4f} (step 1{given})")
    pp = c.get("pp_wire_bytes") or {}
    if pp.get("measured") is not None:
        lines.append(f"  wire MB/rank PP predicted {p['pp_wire_bytes'] / mb:.4f}  measured "
                     f"{pp['measured'] / mb:.4f}  {'exact' if pp['exact'] else 'DIFFERENT'}")
    if m0 is not None:
        pt, mt = sum(p0.values()), sum(m0.values())
        lines.append(f"  model states MB rank 0 predicted {pt / mb:.4f}  measured {mt / mb:.4f}"
                     f"  {'exact on every rank' if st['exact'] else 'DIFFERENT'}"
                     f" (systems formula {p['systems_states_bytes'] / mb:.4f})")
    a = c["activations_bytes"]
    lines.append(f"  activations MB predicted {a['predicted'] / mb:.4f} (tensor by tensor) "
                 f"measured peak {a['measured'] / mb:.4f}")
    lines += [f"  note: {n}" for n in p["notes"]]
    return "\n".join(lines)


def format_gpu_prediction(rep: dict) -> str:
    """A few lines for the end of a GPU run: predicted beside measured."""
    g, c = rep["gpu"], rep["vs_measured"]
    gemm = sum(g["gemm_s"].values())
    exposed = sum(g["exposed_s"].values())
    p0 = sum(c["states_bytes"]["predicted_per_rank"][0].values())
    a = c["activations_bytes"]
    lines = [
        f"prediction (systems model, {g['hardware']}, engine {g['engine']})",
        f"  step s      predicted {c['step_s']['predicted']:.4f}  measured "
        f"{c['step_s']['measured']:.4f}  ({100 * c['step_s']['error']:+.0f}%)",
        f"  MFU         predicted {100 * c['mfu']['predicted']:.1f}%  measured "
        f"{100 * c['mfu']['measured']:.1f}%  (of {g['peak_flops'] / 1e12:.0f} TFLOP/s)",
        f"  breakdown   GEMMs {gemm:.4f}, memory-bound {g['memory_bound_s']:.4f}, launches "
        f"{g['kernel_overhead_s']:.4f}, head {g['head_s']:.4f}, bubble {g['bubble_s']:.4f}, "
        f"exposed comm {exposed:.4f}, optimizer {g['optimizer_s']:.4f}",
        f"  model states MB rank 0 predicted {p0 / 1e6:.4f}  "
        f"{'exact on every rank' if c['states_bytes']['exact'] else 'DIFFERENT'}",
        f"  activations MB predicted {a['predicted'] / 1e6:.4f}  measured peak "
        f"{a['measured'] / 1e6:.4f}",
    ]
    return "\n".join(lines + [f"  note: {n}" for n in g["notes"]])
