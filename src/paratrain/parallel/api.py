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
    """Apply the plan to ``model`` (in place) and return the engine that trains it.

    One process: the plain :class:`Engine` (sharding over one rank is the unsharded
    arithmetic), or :class:`SimulatedWorkers` for ``--simulate-workers``. Several
    processes: :class:`~paratrain.parallel.mesh_engine.MeshEngine`, whatever the layout
    — pipeline split, tensor/sequence, recompute, then data parallelism / ZeRO /
    compression on the dp axis, in that order. A pure data-parallel run is the same
    engine with tp = pp = 1.
    """
    plan.check_runtime(model.cfg)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if simulate_workers > 1:
        if plan.tp > 1 or plan.pp > 1 or plan.cp > 1 or plan.recompute != "none" \
                or plan.compress:
            raise ValueError("--simulate-workers is plain data parallelism in one process; "
                             "drop it with --tp/--pp/--cp/--recompute/--compress")
        return SimulatedWorkers(model, cfg, device, simulate_workers)
    if world > 1:
        from paratrain.parallel.mesh_engine import MeshEngine

        return MeshEngine(model, cfg, plan, device)
    if plan.recompute != "none":
        from paratrain.parallel.recompute import apply_recompute

        apply_recompute(model.blocks, plan.recompute)
    return Engine(model, cfg, device)
