"""Activation recomputation per block (Chen et al. 2016; Korthikanti et al. 2022).

- ``none``: every block keeps what autograd saves.
- ``selective``: only the attention core (``block.attn.core``: softmax(QK^T)V, the
  part whose saved tensors grow with T^2 in an unfused kernel, Korthikanti's 5 a s / h
  term) is recomputed in backward; its inputs q, k, v are kept.
- ``full``: each block keeps only its input and reruns its forward in backward
  (Korthikanti: 2 s b h bytes per layer at 16 bit).

Both use ``torch.utils.checkpoint`` (non-reentrant). The transform replaces the bound
method on the instance (``block.forward`` or ``block.attn.core``), so parameter names
and the plain model's code stay unchanged. Recomputing a tensor-parallel block reruns
its forward collectives during backward; every tp rank reruns them in the same order.

Accounting: non-reentrant checkpoint keeps its inputs alive outside autograd's saved
tensors, so the full-recompute wrapper passes the block input through
:class:`_KeepInput` (identity both ways), which saves it for backward: the saved-tensor
meter (:class:`paratrain.parallel.memory.ActivationMeter`) then sees exactly
what is held.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

MODES = ("none", "selective", "full")


class _KeepInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def _checkpointed(fn, keep_input: bool):
    def run(x, *args):
        if keep_input and x.requires_grad:
            x = _KeepInput.apply(x)
        return checkpoint(fn, x, *args, use_reentrant=False)
    return run


def apply_recompute(blocks: nn.ModuleList | list, mode: str) -> None:
    """Make each block recompute according to ``mode`` (in place)."""
    if mode not in MODES:
        raise ValueError(f"recompute={mode!r} is unknown; choose one of {', '.join(MODES)}")
    if mode == "none":
        return
    for blk in blocks:
        if mode == "full":
            blk.forward = _checkpointed(blk.forward, keep_input=True)
        else:
            blk.attn.core = _checkpointed(blk.attn.core, keep_input=False)
