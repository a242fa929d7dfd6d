"""Turn a plain model and a plan into an Engine (the one documented order of transforms)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from paratrain.config import TrainConfig
from paratrain.parallel.engine import Engine, SimulatedWorkers
from paratrain.plan import ParallelPlan


def build_engine(model: nn.Module, cfg: TrainConfig, plan: ParallelPlan,
                 device: torch.device, simulate_workers: int = 1) -> Engine:
    """Apply the plan to ``model`` (in place) and return the engine that trains it."""
    if simulate_workers > 1:
        return SimulatedWorkers(model, cfg, device, simulate_workers)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from paratrain.parallel.data import DataParallel

        return DataParallel(model, cfg, device)
    return Engine(model, cfg, device)
