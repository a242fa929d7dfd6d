"""Does a runs-table row's layout fit its accelerator, and which recomputation did it run?

A published run ran, so its layout fitted its HBM. Two consequences for a row whose
columns leave something out:

- a blank (or "not stated") recompute is inferred as the least recomputation, in the
  order none < selective < full, whose memory fits the accelerator's HBM, full with the
  least share of the blocks that fits (:mod:`paratrain.systems.partial_recompute`), and
  marked inferred among the case's defaults;
- a layout that does not fit even with full recomputation is not the layout that ran (a
  blank TP or PP defaulted to 1 can leave a 175B model whole on one GPU): it is refused,
  with the bytes needed and the HBM. "Fit" here is the least any engine runs the layout
  in (:func:`least_bytes`): without the loss's whole fp32 logits, which engines compute
  in chunks (MaxText's ``num_vocab_tiling``, fused cross-entropy kernels: Gemma 3's
  262K-token vocabulary at 32K tokens is 34 GB of logits, more than a TPU v6e holds),
  with the optimizer's moments in bf16 and no fp32 master copy (MaxText's
  ``weight_dtype: bfloat16``: 8 bytes of states per parameter, not 16), and without the
  saved activations where the row's recompute words say they are offloaded to host
  memory (MaxText's ``remat_policy: custom`` with ``decoder_layer_input:
  offload``, which its Llama 3.1 70B recipe on 256 TPU v6e needs: 54 GB of layer inputs
  against 32 GB of HBM). Such a row is priced with full recomputation, and the case's
  defaults say why it was not refused.

The memory is :func:`paratrain.cost.memory.memory`, the same busiest-rank count
``paratrain plan`` and its search use, with the attention kernel the row's engine runs.
That count is approximate (fp32 logits kept whole, no allocator fragmentation, an MoE's
dispatch buffers priced roughly), so the rule is deliberately one-sided: a row is
refused only when even the least it can be run in (full recomputation, what
:func:`least_bytes` leaves out) is more than its HBM; a stated recompute is never
second-guessed, except that an engine whose "selective" checkpoints a share of whole
blocks (``overlap.Engine.selective_blocks``) is given the least share that fits, over
:data:`BLOCK_ORDER`.
"""

from __future__ import annotations

import dataclasses

from paratrain.cost.hardware import Hardware
from paratrain.cost.memory import Memory, memory, mixed_recipe
from paratrain.cost.shapes import ModelShape
from paratrain.plan import ParallelPlan
from paratrain.systems.partial_recompute import least_share

RECOMPUTE_ORDER = ("none", "selective", "full")  # least recomputation first
BLOCK_ORDER = ("none", "full")  # an engine whose "selective" is a share of whole blocks


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
                      fp8: bool = False, order: tuple[str, ...] = RECOMPUTE_ORDER
                      ) -> tuple[str | None, Memory, float]:
    """(the least recomputation of ``order`` whose memory fits the HBM, its memory, the
    share of the blocks it recomputes), or (None, the memory under full recomputation, 1)
    when none does. Full recomputation comes with the least share of blocks that fits
    (:func:`paratrain.systems.partial_recompute.least_share`) and its memory."""
    mems = {}
    for mode in order:
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


def offloaded(recompute_text: str) -> bool:
    """Whether a row's recompute words say saved activations go to host memory."""
    return "offload" in (recompute_text or "").lower()


# the optimizer's share of its bytes a lean engine keeps: two bf16 moments and no fp32
# master (MaxText's weight_dtype bfloat16), 4 of mixed precision's 12 bytes per parameter
LEAN_OPTIMIZER_SHARE = 4 / 12


def least_bytes(mem: Memory, offload: bool) -> float:
    """The least an engine runs a layout of memory ``mem`` (full recomputation) in: the
    count without the loss's fp32 logits (computed in chunks), with the optimizer's
    moments in bf16 and no fp32 master (:data:`LEAN_OPTIMIZER_SHARE`) and, with
    ``offload``, without the saved activations (module docstring)."""
    return (mem.weights_bytes + mem.grads_bytes + LEAN_OPTIMIZER_SHARE * mem.optimizer_bytes
            + mem.buffers_bytes + (0.0 if offload else mem.activations_bytes))


def refusal(mem: Memory, hw: Hardware, offload: bool = False) -> str:
    """The reason a layout that cannot fit is refused, the least bytes it needs
    (:func:`least_bytes`) against the HBM: short enough for `paratrain validate`'s one
    line per reason at 80 columns (the fix, filling the layout and sharding columns the
    run used, is in docs/runs.md)."""
    need = least_bytes(mem, offload)
    return f"needs {_gb(need)}/GPU even with full recompute > {_gb(mem.hbm_bytes)} HBM"


def admitted_why(mem: Memory, offload: bool) -> str:
    """Why a layout whose full count is over the HBM is priced, not refused."""
    what = "the loss's whole fp32 logits (engines chunk them), with bf16 moments" + (
        " and the activations the row offloads to host" if offload else "")
    return (f"counted {_gb(mem.total_bytes)} with full recompute > {_gb(mem.hbm_bytes)} "
            f"HBM, {_gb(least_bytes(mem, offload))} without {what}: the run ran, so it "
            "is priced with full recompute")
