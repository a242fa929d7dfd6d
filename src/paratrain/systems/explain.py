"""A step's breakdown as text: `paratrain plan --explain` and `paratrain validate --explain`.

Every line is computed from the :class:`paratrain.systems.step_model.Breakdown` it
describes, and the parts add up to the step it prints (tests check both). A runs-table
row's assumptions come first (:func:`case_lines`): the engine it is priced as and why,
and every blank the reader filled in, so a reader sees what was guessed before what was
computed from it.
"""

from __future__ import annotations

from paratrain.cost.hardware import load_hardware
from paratrain.systems.layer_cost import fp8_recipe_name
from paratrain.systems.row_engine import fp8_scaling
from paratrain.systems.step_model import AXES, Breakdown

AXIS_NAMES = {"tp": "tensor parallel", "cp": "context parallel", "ep": "expert parallel",
              "pp": "pipeline p2p", "dp": "data parallel sync"}


def _ms(x: float) -> str:
    return f"{1e3 * x:,.1f} ms"


def breakdown_rows(b: Breakdown) -> list[tuple[str, float, str]]:
    """(part, seconds per step, note) in the order they add up to the step."""
    rows = [(f"GEMM {cls}", s, f"{100 * s / b.step_s:.1f}% of the step")
            for cls, s in b.gemm.items()]
    rows.append(("memory-bound work", b.memory_s,
                 "norms, residual adds, activations, RoPE, softmax at HBM bandwidth"))
    rows.append(("kernel launches", b.overhead_s, "fixed cost per kernel"))
    if b.accum_s:
        rows.append(("gradient accumulation", b.accum_s,
                     "each micro-batch's gradients added into fp32 copies"))
    if b.head_s:
        rows.append(("output layer + loss", b.head_s, "on the last pipeline stage"
                     + (", with multi-token prediction's" if b.mtp_blocks else "")))
    rows.append(("pipeline bubble", b.bubble_s, "idle share of the schedule"))
    for axis in AXES:
        if b.comm[axis]:
            rows.append((f"{AXIS_NAMES[axis]} (exposed)", b.exposed[axis],
                         f"of {_ms(b.comm[axis])} on the wire"))
    rows.append(("optimizer step", b.optimizer_s, "memory-bound over this rank's states"))
    return rows


def explain_lines(b: Breakdown, reported: str | None = None) -> list[str]:
    """The breakdown, one part per line, then the step and utilisation it gives."""
    mtp = f" ({b.mtp_blocks} multi-token prediction)" if b.mtp_blocks else ""
    lines = [f"busiest rank: {b.blocks} blocks{mtp} x {b.micro_batches} micro-batches, "
             f"engine {b.engine}"]
    for part, s, note in breakdown_rows(b):
        lines.append(f"  {part:<34} {_ms(s):>14}  {note}")
    total = sum(s for _, s, _ in breakdown_rows(b))
    lines.append(f"  {'step':<34} {_ms(total):>14}  MFU {100 * b.mfu:.1f}%, "
                 f"HFU {100 * b.hfu:.1f}%, {b.tflops_per_gpu:.0f} model TFLOP/s per GPU")
    if reported:
        lines.append(f"  reported: {reported}")
    return lines


def case_lines(case) -> list[str]:
    """The engine a :class:`paratrain.systems.runs.Case` is priced as, with the column and
    word that chose it, then each default applied (column = value: why)."""
    lines = [f"engine {case.engine}: {case.engine_why}"]
    if case.hw.inter_bw != load_hardware(case.hw_key).inter_bw:
        lines.append(f"network: {case.hw.inter_bw * 8 / 1e9:g} Gb/s per accelerator between "
                     "nodes, as the row's inter_gbps states")
    scaling = fp8_scaling(case)
    if scaling:
        lines.append(f"8-bit linear layers: {fp8_recipe_name(scaling)} scaling, as the "
                     "row's precision says (layer_cost.FP8_RECIPES)")
    if case.defaults:
        lines.append(f"defaults applied ({len(case.defaults)}):")
        lines += [f"  {col} = {value}: {why}" for col, value, why in case.defaults]
    else:
        lines.append("defaults applied: none (every column the model reads is filled)")
    return lines
