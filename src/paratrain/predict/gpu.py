"""The prediction for a run on CUDA GPUs, set beside what it measured.

A run on a CPU box is priced by :func:`paratrain.predict.predict` from this machine's
calibrated profile. A run on GPUs is priced by the systems model that prices published
runs (:func:`paratrain.systems.step_model.predict_step`) on the hardware catalogue's
entry for the device (:func:`paratrain.cost.hardware.resolve_hardware` of
``torch.cuda.get_device_name``), with the ``torchtitan`` engine: eager PyTorch with
unfused element-wise work and flash attention, which is how paratrain's runtime computes.
The same plan value, the same byte and state counts (:mod:`paratrain.cost.layout`).

What it does not price, it says (``{"skipped": reason}``, printed as one line by
:func:`paratrain.predict.report.format_prediction`):

- ranks sharing a GPU (more ranks than GPUs on the node, e.g. benchmarks/gpu_check.py's
  parity rows over gloo): the systems model prices one rank per GPU;
- a dtype other than bfloat16: the model prices bf16 mixed precision;
- a GPU the catalogue lacks: the line names it and the catalogue's keys.
"""

from __future__ import annotations

from paratrain.config import ModelConfig, TrainConfig
from paratrain.cost import layout as L
from paratrain.cost.hardware import Hardware, hardware_names, load_hardware, resolve_hardware
from paratrain.cost.run_figures import predicted_activations
from paratrain.plan import ParallelPlan
from paratrain.predict.report import memory_vs_measured
from paratrain.systems.step_model import predict_step

ENGINE = "torchtitan"  # eager PyTorch: unfused element-wise work, flash attention


def gpu_hardware(device_name: str) -> Hardware:
    """The catalogue entry of a CUDA device name; ValueError naming the keys if none."""
    try:
        return load_hardware(resolve_hardware(device_name))
    except ValueError:
        raise ValueError(f"GPU {device_name!r} is not in the hardware catalogue (keys: "
                         f"{', '.join(hardware_names())})") from None


def gpu_prediction(mcfg: ModelConfig, tcfg: TrainConfig, plan: ParallelPlan, world: int,
                   summary: dict, hw: Hardware | str, node: tuple[int, int] = (1, 1)) -> dict:
    """``summary["prediction"]`` of a run of ``world`` ranks on ``hw`` (an entry, or the
    CUDA device name to resolve), ``node`` = (ranks, GPUs) on this node: the systems
    model's step and MFU beside the measured ones, the model states of every rank (exact
    or not) and the activation peak; or ``{"skipped": reason}``."""
    if node[0] > node[1]:
        return {"skipped": f"{node[0]} ranks share {node[1]} GPU(s) on this node; the "
                           "systems model prices one rank per GPU"}
    if tcfg.dtype != "bfloat16":
        return {"skipped": f"the systems model prices bf16 mixed precision on GPUs; this "
                           f"run is {tcfg.dtype} (pass --dtype bfloat16)"}
    try:
        hw = gpu_hardware(hw) if isinstance(hw, str) else hw
    except ValueError as e:
        return {"skipped": str(e)}
    try:
        bd = predict_step(mcfg, plan, hw, summary["tokens_per_step"], mcfg.context,
                          engine_name=ENGINE)
    except ValueError as e:  # a layout the step model refuses says why
        return {"skipped": f"the systems model cannot price this layout: {e}"}
    step_m = summary["step_s"]
    mfu_m = bd.model_flops / (step_m * bd.gpus * hw.peak_flops) if step_m else float("nan")
    states = [L.state_bytes(mcfg, plan, tcfg.dtype, q, tcfg.reduce_dtype)
              for q in range(world)]
    return {"gpu": {**bd.as_dict(), "hardware": hw.name, "peak_flops": hw.peak_flops,
                    "notes": list(bd.notes)},
            "vs_measured": {
                "step_s": {"predicted": bd.step_s, "measured": step_m,
                           "error": bd.step_s / step_m - 1 if step_m else float("nan")},
                "mfu": {"predicted": bd.mfu, "measured": mfu_m},
                **memory_vs_measured(summary, states,
                                     predicted_activations(mcfg, plan, tcfg))}}
