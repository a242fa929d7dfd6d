"""Does a runs-table row's layout fit its accelerator, and which recomputation did it run?

A published run ran, so its layout fitted its HBM. Two consequences for a row whose
columns leave something out:

- a blank (or "not stated") recompute is inferred as the least recomputation, in the
  order none < selective < full, whose memory fits the accelerator's HBM, full with the
  least share of the blocks that fits (:mod:`paratrain.systems.partial_recompute`), and
  marked inferred among the case's defaults;
- a layout that does not fit even with full recomputation is not the layout that ran (a
  blank TP or PP defaulted to 1 can leave a 175B model whole on one GPU): it is refused,
  with the bytes needed and the HBM.

The memory is :func:`paratrain.cost.memory.memory`, the same busiest-rank count
``paratrain plan`` and its search use, with the attention kernel the row's engine runs.
That count is approximate (fp32 logits kept whole, no allocator fragmentation, an MoE's
dispatch buffers priced roughly), so the rule is deliberately one-sided: a row is
refused only when it needs more than its HBM with full recomputation, the least any
layout can hold; a stated recompute is never second-guessed.
"""

from __future__ import annotations

import dataclasses

from paratrain.cost.hardware import Hardware
from paratrain.cost.memory import Memory, memory, mixed_recipe
from paratrain.cost.shapes import ModelShape
from paratrain.plan import ParallelPlan
from paratrain.systems.partial_recompute import least_share

RECOMPUTE_ORDER = ("none", "selective", "full")  # least recomputation first


def rank_memory(model: ModelShape, plan: ParallelPlan, hw: Hardware, tokens: int, seq: int,
                attention: str, shard_group: int | None = None, fp8: bool = False) -> Memory:
    """The busiest GPU's memory under ``plan`` (``attention``: the engine's kernel;
    anything fused counts as flash, which keeps no s x s scores), its ZeRO states over
    ``shard_group`` ranks when the row shards over fewer than DP (hybrid sharding);
    ``fp8``: FP8 linear layers, whose saved inputs take half the bytes (the ``fp8-adam``
    recipe of :mod:`paratrain.cost.memory`)."""
    kernel = "eager" if attention == "eager" else "flash"
    if shard_group and plan.zero and plan.dp % shard_group == 0 and shard_group < plan.dp:
        try:
            plan = dataclasses.replace(plan, dp_replicate=plan.dp // shard_group)
        except ValueError:
            pass  # a layout HSDP does not run with: the states over every DP rank
    # a published engine's block keeps the published figure, not what paratrain's runtime
    # keeps (cost.activations.block_activation_bytes)
    return memory(model, plan, hw, tokens, seq, mixed_recipe(fp8), attention=kernel,
                  ours=False)


def _gb(x: float) -> str:
    return f"{x / 1e9:,.1f} GB"


def fitting_recompute(model: ModelShape, plan: ParallelPlan, hw: Hardware, tokens: int,
                      seq: int, attention: str, shard_group: int | None = None,
                      fp8: bool = False) -> tuple[str | None, Memory, float]:
    """(the least recomputation whose memory fits the HBM, its memory, the share of the
    blocks it recomputes), or (None, the memory under full recomputation, 1) when none
    does. Full recomputation comes with the least share of blocks that fits
    (:func:`paratrain.systems.partial_recompute.least_share`) and its memory."""
    mems = {}
    for mode in RECOMPUTE_ORDER:
        mem = mems[mode] = rank_memory(model, dataclasses.replace(plan, recompute=mode), hw,
                                       tokens, seq, attention, shard_group, fp8)
        if mem.fits and mode == "full":
            share = least_share(mems["none"], mem)
            act = mems["none"].activations_bytes
            return mode, dataclasses.replace(
                mem, activations_bytes=act + share * (mem.activations_bytes - act)), share
        if mem.fits:
            return mode, mem, 1.0
    return None, mem, 1.0


def refusal(mem: Memory, hw: Hardware) -> str:
    """The reason a layout that cannot fit is refused, the bytes needed against the HBM:
    short enough for `paratrain validate`'s one line per reason at 80 columns (the fix,
    filling the layout and sharding columns the run used, is in docs/runs.md)."""
    return f"needs {_gb(mem.total_bytes)}/GPU even with full recompute > {_gb(mem.hbm_bytes)} HBM"
