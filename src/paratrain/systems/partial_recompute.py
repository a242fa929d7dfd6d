"""Partial recomputation: a published run that recomputes some of its blocks, not all.

Engines recompute less than every block when less is enough: Megatron-LM and NeMo
recompute the first K blocks of each pipeline chunk (``recompute_method`` block,
``recompute_num_layers`` K) or chosen modules of every block (``recompute_modules``),
torchtitan every n-th block, and a tuned recipe sets them to the least that fits. A
runs-table row whose recompute is blank is inferred as the least recomputation that fits
its HBM (:mod:`paratrain.systems.row_memory`): none, selective, then full recomputation
of the least share f of the blocks. Activations are kept block by block, so recomputing
a share f keeps (1 - f) A_none + f A_full, and the least f that fits is

    f = (M_none - HBM) / (M_none - M_full)

M the rank's memory under each mode (the states are the same). f is a share, not a whole
number of blocks: recomputing modules rather than blocks moves the memory almost
continuously, and a row does not say which knob its recipe turned.

The step is priced as the blend of the step model's two breakdowns, (1 - f) under no
recomputation and f under full: every term recomputation adds is per block (the GEMMs
and element-wise work rerun, their launches, the tensor-, context- and
expert-parallel collectives rerun) and so linear in the blocks recomputed; the pipeline
bubble is a share of a stage's time and scales with it. Terms recomputation leaves alone
are equal in both and stay as they are.

paratrain's own runtime recomputes every block or none (``--recompute``); this share is
how the systems model prices the published runs that do otherwise.
"""

from __future__ import annotations

import dataclasses

from paratrain.cost.memory import Memory
from paratrain.systems.step_model import Breakdown


def least_share(none: Memory, full: Memory) -> float:
    """The least share of blocks recomputed whose memory fits the HBM (0 when no
    recomputation fits, 1 when only all of it does), from the rank's memory without
    recomputation and with all of it."""
    over, saved = none.total_bytes - none.hbm_bytes, none.total_bytes - full.total_bytes
    if over <= 0:
        return 0.0
    return 1.0 if saved <= over else over / saved


def share_from_utilisation(mfu: float | None, hfu: float | None) -> float | None:
    """The share of blocks a run recomputes, as its own MFU and HFU say, or None when it
    does not give both (or gives HFU below MFU). Recomputing a block reruns its forward, a
    third of its training FLOPs, so HFU / MFU = 1 + share / 3: the convention of the
    sources that publish both (MosaicML's full recomputation 4/3 to the digit, its runs
    without 1, fms-fsdp's block checkpointing in between). Rounded figures (55 and 74%)
    can say a little over 4/3: all of them."""
    if not mfu or not hfu or hfu < mfu:
        return None
    return min(1.0, 3.0 * (hfu / mfu - 1.0))


def blend(none: Breakdown, full: Breakdown, share: float) -> Breakdown:
    """The breakdown of a step that recomputes ``share`` of its blocks: each number, and
    each entry of the per-class and per-axis tables, ``(1 - share) none + share full``."""
    def mix(a, b):
        if isinstance(a, dict):
            return {k: mix(a.get(k, 0.0), b.get(k, 0.0)) for k in {**a, **b}}
        return a + share * (b - a)

    # every float and table of floats (seconds, FLOPs); counts, names and notes are full's
    return dataclasses.replace(full, **{
        f.name: mix(getattr(none, f.name), getattr(full, f.name))
        for f in dataclasses.fields(Breakdown) if isinstance(getattr(full, f.name), (float, dict))})


def share_words(share: float) -> str:
    """How a share of blocks recomputed reads in a case's defaults and ``--explain``."""
    return f"full on {100 * share:.0f}% of the blocks"


def recompute_words(case) -> str:
    """A runs-table case's recomputation in words: the modules it names
    (:mod:`paratrain.systems.recompute_modules`), its plan's, or the share of blocks."""
    rerun = getattr(case, "rerun", ())
    if rerun:
        return f"of modules {', '.join(rerun)}"
    share = getattr(case, "recompute_share", 1.0)
    return share_words(share) if case.plan.recompute == "full" and share < 1 else \
        case.plan.recompute
