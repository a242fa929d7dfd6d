"""AdamW with decoupled weight decay on matrices only, and warm-up + cosine LR."""

from __future__ import annotations

import math

import torch
from torch import nn

from paratrain.config import TrainConfig


def param_groups(named_params, weight_decay: float) -> list[dict]:
    """Matrices (and embeddings) decay; norms' gains do not."""
    decay, no_decay = [], []
    for _, p in named_params:
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_adamw(model: nn.Module, cfg: TrainConfig, select=None) -> torch.optim.AdamW:
    """AdamW over the model's parameters (those ``select(p)`` accepts, when given); under
    ``--dtype bfloat16`` on FP32 master copies of the BF16 parameters
    (:class:`paratrain.parallel.precision.MasterAdamW`)."""
    named = [(n, p) for n, p in model.named_parameters() if select is None or select(p)]
    if cfg.dtype == "bfloat16":
        from paratrain.parallel.precision import MasterAdamW

        return MasterAdamW(param_groups(named, cfg.weight_decay), cfg)
    # foreach=False: the per-parameter loop's arithmetic is the same whatever the sharding,
    # which keeps single-process and parallel runs comparable to rounding.
    return torch.optim.AdamW(param_groups(named, cfg.weight_decay),
                             lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8,
                             foreach=False)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps``, then cosine to ``lr*min_lr_ratio``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    frac = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * frac))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr
