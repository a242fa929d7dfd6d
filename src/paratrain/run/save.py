"""A checkpoint save as the training loop makes it: the disk checked first, and a save
the disk broke named in one line.

A full, read-only or forbidden checkpoint directory used to end a run with a traceback
from the rank that hit it and, from the launcher, "a worker was killed by SIGTERM"
(docs/faults.md, "Fault table"). :func:`save_checked` raises a ``ValueError`` instead,
the same on every rank when the check before the save fails, which the worker reports
once through the launcher (exit 2). A full or read-only disk is not cured by restarting,
so it is never left to torchrun's restarts.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from paratrain.config import ModelConfig, TrainConfig
from paratrain.cost.ranks import elements
from paratrain.cost.shapes import as_shape
from paratrain.files import checkpoint, disk
from paratrain.plan import ParallelPlan


def _agree(line: str | None) -> str | None:
    """Rank 0's verdict on every rank (one broadcast), so all raise or none do."""
    if not (dist.is_available() and dist.is_initialized()):
        return line
    box = [line]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def save_checked(engine, mcfg: ModelConfig, tcfg: TrainConfig, plan: ParallelPlan,
                 opts, meta: dict, step: int) -> None:
    """:func:`paratrain.files.checkpoint.save` of ``step`` into ``opts.checkpoint_dir``
    (collective), after :func:`paratrain.files.disk.check_room` on rank 0 for the size
    of the previous step (or of the model's saved tensors); a failed save whose cause
    :func:`paratrain.files.disk.diagnose` finds on the disk becomes that one line."""
    root = opts.checkpoint_dir
    done = checkpoint.steps(root)
    newest = done[0] if done else None
    master = elements(tcfg.dtype, tcfg.reduce_dtype)[2]  # bf16 runs keep FP32 masters
    need = disk.checkpoint_bytes(root, newest,
                                 disk.state_bytes(as_shape(mcfg).num_params(), master))
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    said = None
    if rank == 0:
        try:
            disk.check_room(root, step, need, newest)
        except ValueError as e:
            said = str(e)
    said = _agree(said)
    if said:
        raise ValueError(said)
    try:
        checkpoint.save(root, step, engine, mcfg, plan, meta, opts.keep_checkpoints)
    except (OSError, RuntimeError, CheckpointException) as e:
        said = disk.diagnose(e, root, step, need, newest)
        if said is None:
            raise
        if rank == 0:
            checkpoint.remove_stale(root)  # give the partial step's space back
        raise ValueError(said) from None
