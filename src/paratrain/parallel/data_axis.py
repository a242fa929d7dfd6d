"""Data parallelism and ZeRO as a transform on the mesh's ``dp`` axis: one interface,
one implementation per strategy, chosen once from the plan by :func:`data_axis`.

Applied last (after the pipeline split, tensor/sequence sharding and recompute) to
whatever parameters this rank holds — one list per pipeline chunk — over the mesh's dp
group. A pure data-parallel run is the same code with tp = pp = 1 and one chunk, the
whole model. :func:`data_axis` builds one of five:

- :class:`DataAxis` itself: dp = 1, nothing to reduce (sharding over one rank is none);
- :class:`.dp_replicated.Buckets`: ``--zero 0``, flat buckets all-reduced
  (:class:`.ddp.GradBuckets`);
- :class:`.dp_replicated.TopK`: ``--zero 0 --compress topk:K``, top-k values + indices
  all-gathered;
- :class:`.dp_sharded.Zero`: ``--zero 1|2``, bucketed reduce-scatter, sharded AdamW,
  all-gather;
- :class:`.dp_sharded.Units`: ``--zero 3``, units gathered just in time
  (:class:`.fsdp.FullyShard`).

Micro-batches. Without a pipeline the loop calls :meth:`before_backward` /
:meth:`after_backward` around each micro-batch: ZeRO 0/1 communicate only on the last
(buckets launch from backward hooks as they fill, with ``--overlap``); ZeRO-2 reduces
every micro-batch (that is what frees its gradients); ZeRO-3 gathers and reduces every
micro-batch. Under a pipeline (``deferred``) the micro-batches of a step interleave on
the rank, so every reducer accumulates over the whole step and reduces each chunk once,
from :meth:`chunk_done`, called by the pipeline runtime right after the chunk's last
backward action (with ``--overlap``; otherwise at :meth:`finish`): the reduction of a
finished chunk overlaps the rest of the pipeline's cool-down. ZeRO-3 then keeps each
unit gathered from its first forward to its chunk's end (FSDP2's
``reshard_after_forward=False``), 2(p-1)/p x payload per step instead of 3m(p-1)/p;
ZeRO-2 keeps full gradient buffers during the step, like ZeRO-1. The systems model
prices exactly this (:func:`paratrain.cost.layout.dp_wire_factor`).

Placements (:mod:`.placement`). Replicating reducers add their axes (``dp``/``cp``, or
``edp`` for experts) to each parameter's ``replicated`` axes; ZeRO-1/2/3 add them to
``sharded`` with the flat range of the parameter this rank's optimizer owns.

HSDP (``--dp-replicate R``, :mod:`.dp_sharded`): ``group`` is one replica's dp / R
(x cp) ranks, over which ZeRO-1/2/3 run unchanged, with flat buffers padded to a
multiple of the whole dp x cp; after the step's last reduce-scatter each owned gradient
chunk is all-reduced over the R replicas (``replicate``: once per step, whatever the
micro-batch count, exposed), and parameters are marked ``replicated`` over
``dp_replicate`` so that replica 0 alone counts them (norm, checkpoint).

Global norm. Each reducer gives the squares of the gradient it *owns* (its ZeRO shard,
or everything on dp rank 0 when gradients are replicated): a piece counts where its
placement is canonical (index 0 on every replicated axis); the engine sums them over
the world.
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain.config import TrainConfig
from paratrain.cost.buffers import strategy
from paratrain.parallel.ddp import DPCommStats, GradBuckets
from paratrain.parallel.engine import grad_sq
from paratrain.parallel.optim import build_adamw, set_lr
from paratrain.parallel.placement import mark, placement_of
from paratrain.parallel.precision import (
    grad_of,
    optimizer_owned,
    optimizer_tensors,
    to_working,
)
from paratrain.plan import ParallelPlan


def data_axis(chunks: list[nn.Module], group, dp: int, plan: ParallelPlan,
              cfg: TrainConfig, index, axes: tuple[str, ...], select=None,
              units_of=None, replicate=None) -> DataAxis:
    """The reducer the plan selects for a data axis of ``dp`` ranks (``group``, the mesh
    axes ``axes``). ``index(axis)``: this rank's mesh coordinate. ``select(p)``: the
    parameters it takes (default all; expert parallelism builds two, dense over dp and
    experts over edp). ``units_of(chunk)``: ZeRO-3's units (default
    :func:`.fsdp.default_units`). ``replicate``: HSDP's replica group (the mesh's
    ``dp_replicate``; ``group`` is then one replica's ``dp_shard`` ranks)."""
    from paratrain.parallel.dp_replicated import Buckets, TopK
    from paratrain.parallel.dp_sharded import Units, Zero

    ranks = dp * (plan.dp_replicate if replicate is not None else 1)  # the whole axis
    cls = {"none": DataAxis, "topk": TopK, "ddp": Buckets, "zero": Zero,
           "fsdp": Units}[strategy(ranks, plan)]
    return cls(chunks, group, plan, cfg, index, axes, select, units_of, replicate)


class DataAxis:
    """The dp-axis reducer of this rank's chunks and the optimizer that goes with it.
    This base is dp = 1 (nothing to reduce); every strategy subclasses it."""

    name = "none"  # the report's word for the strategy
    communicates = False  # it sends something (dp > 1)
    grads_replicated = False  # every replica holds the whole reduced gradient

    def __init__(self, chunks, group, plan: ParallelPlan, cfg: TrainConfig, index,
                 axes: tuple[str, ...], select=None, units_of=None, replicate=None) -> None:
        self.plan, self.index, self.axes = plan, index, axes
        self.deferred = plan.pp > 1
        self.container = nn.ModuleList(chunks)
        self.select = select or (lambda p: True)
        self.lists = [[p for p in c.parameters() if p.requires_grad and self.select(p)]
                      for c in chunks]
        self.params = [p for p in self.container.parameters() if self.select(p)]
        self.comm = None
        self.dp_rank = 0
        self.history: list[DPCommStats] = []
        self.steps_done = 0
        self.buckets: list[GradBuckets] = []
        self.rcomm = None  # HSDP: the replicas' group (the all-reduce of owned chunks)
        self.by_axis: list[dict[str, float]] = []  # HSDP: wire bytes per sub-axis, per step
        if replicate is not None:
            from paratrain.parallel.ddp_comm import GroupComm

            self.rcomm = GroupComm(replicate, plan.collectives)
            # replicas hold the same chunks: count (norm, checkpoint) on replica 0 only
            mark(self.params, replicated=("dp_replicate",))
        self._build(group, cfg, select, units_of)
        if self.comm is not None:
            self.dp_rank = self.comm.rank
            self._mark = self.comm.bytes_sent
            self._rmark = self.rcomm.bytes_sent if self.rcomm else 0.0
        if self.deferred:
            for gb in self.buckets:
                gb.set_sync(False)  # a pipeline reduces per chunk, never from hooks

    def _build(self, group, cfg, select, units_of) -> None:
        self.opt = build_adamw(self.container, cfg, select)

    def counted(self, p: nn.Parameter) -> bool:
        """Whether this rank's copy of ``p`` is the one that counts (norm, checkpoint)."""
        return placement_of(p).canonical(self.index)

    # ---- backward ------------------------------------------------------------------
    def before_backward(self, last: bool) -> None:
        """No pipeline: the coming backward is the step's last micro-batch or not."""

    def after_backward(self) -> None:
        """No pipeline: a micro-batch's backward is over."""

    def chunk_done(self, c: int) -> None:
        """Pipeline: chunk ``c`` has had its last backward of the step."""

    def finish(self) -> DPCommStats:
        """After the step's last backward: reduce what is left and wait for all."""
        if self.comm is None:
            return DPCommStats()
        stats = self._reduce()
        stats.wire_bytes = self.comm.bytes_sent - self._mark
        self._mark = self.comm.bytes_sent
        if self.rcomm is not None:
            rep = self.rcomm.bytes_sent - self._rmark
            self._rmark = self.rcomm.bytes_sent
            self.by_axis.append({"dp_shard": stats.wire_bytes, "dp_replicate": rep})
            stats.wire_bytes += rep
        self.history.append(stats)
        return stats

    def _reduce(self) -> DPCommStats:
        """Each strategy that communicates reduces its gradients here; the base (dp = 1)
        has no group, so :meth:`finish` never calls it."""
        raise NotImplementedError(f"{type(self).__name__} has a group but no reduction")

    # ---- the update (whole parameters; the ZeRO classes override) ---------------------
    @torch.no_grad()
    def local_sq(self, every_replica: bool = False) -> torch.Tensor:
        """Squares of the gradient this rank owns (float64, CPU), counted once; with
        ``every_replica`` each data replica counts its (identical, replicated) gradients,
        for a caller that will not sum over the dp axis."""
        skip = self.axes if every_replica else ()
        sq = torch.zeros((), dtype=torch.float64)
        for p in self.params:
            g = grad_of(p)
            if g is not None and placement_of(p).canonical(self.index, skip):
                sq += grad_sq(g)
        return sq

    @torch.no_grad()
    def scale(self, coef: float) -> None:
        if coef != 1.0:
            for p in self.params:
                g = grad_of(p)
                if g is not None:
                    g.mul_(coef)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """The optimizer step on what this rank owns, then ready for the next step."""
        self.steps_done += 1
        set_lr(self.opt, lr)
        self.opt.step()
        self._release_grads()

    def _release_grads(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    # ---- state: what the checkpoint reads ------------------------------------------------
    def owned_state(self) -> list[tuple[nn.Parameter, torch.Tensor, torch.optim.Optimizer]]:
        """(parameter, the tensor its optimizer state is keyed by — its master or its
        owned ZeRO segment —, the torch optimizer holding that state), in order; which
        part of the plain model each is, is the parameter's placement."""
        return optimizer_owned(self.opt, self.params)

    def residuals(self) -> list[torch.Tensor]:
        """Per-rank state that is no piece of a model tensor (top-k's error feedback)."""
        return []

    @torch.no_grad()
    def sync_working(self) -> None:
        """Working parameters as an optimizer step leaves them, from loaded masters."""
        to_working(self.opt)

    def state_dict(self) -> dict:
        return {"model": self.container.state_dict(), "optim": self.opt.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.container.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optim"])

    # ---- memory, reports -------------------------------------------------------------
    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        params = self.params
        return {"params": params,
                "grads": [grad_of(p) for p in params if grad_of(p) is not None],
                "optimizer": optimizer_tensors(self.opt)}

    @property
    def comm_buffer_peak(self) -> int:
        """Peak bytes of transient flat buffers: ZeRO-2 buckets, ZeRO-3 gathered units."""
        return max([gb.comm_buffer_peak for gb in self.buckets] or [0])

    def layout(self) -> str:
        """What the reducer built (the first word is the number of flat buffers)."""
        return "0 flat buffers: one data replica, nothing to reduce"

    def describe(self) -> str:
        return self.layout()

    def full_parameters(self) -> dict[int, torch.Tensor]:
        """id(param) -> full value (collective under ZeRO-3)."""
        return {id(p): p.detach().clone() for p in self.params}

    def report(self) -> dict:
        last = self.history[-1] if self.history else None
        return {"kind": self.name, "bucket_layout": self.layout(),
                "wire_bytes_total": self.comm.bytes_sent if self.comm else 0.0,
                "steps": self.steps_done,
                "last_step": last.__dict__.copy() if last else None,
                "exposed_s_per_step": [h.seconds for h in self.history],
                "hidden_s_per_step": [h.hidden_s for h in self.history],
                **({"wire_bytes_by_axis": self.by_axis} if self.rcomm else {})}


def bucket_layout(buckets: list[GradBuckets]) -> str:
    """The layouts of one GradBuckets per chunk, as one text."""
    parts = [gb.layout() for gb in buckets]
    n = sum(len(gb.buckets) for gb in buckets)
    if len(parts) == 1:
        return parts[0]
    return f"{n} gradient buckets in {len(parts)} chunks:\n" + "\n".join(parts)


