"""Data parallelism and ZeRO as a transform on the mesh's ``dp`` axis.

Applied last (after the pipeline split, tensor/sequence sharding and recompute) to
whatever parameters this rank holds — one list per pipeline chunk — over the mesh's dp
group. A pure data-parallel run is the same code with tp = pp = 1 and one chunk, the
whole model. One of five reducers does the work:

=========  ====================================================================
kind       what it is
=========  ====================================================================
none       dp = 1: nothing to reduce (sharding over one rank is no sharding)
ddp        ``--zero 0``: flat buckets, all-reduce (:class:`.ddp.GradBuckets`)
topk       ``--zero 0 --compress topk:K``: top-k values + indices all-gathered
zero       ``--zero 1|2``: bucketed reduce-scatter, sharded AdamW, all-gather
fsdp       ``--zero 3``: units gathered just in time (:class:`.fsdp.FullyShard`)
=========  ====================================================================

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

Global norm. Each reducer gives the squares of the gradient it *owns* (its ZeRO shard,
or everything on dp rank 0 when gradients are replicated), skipping pieces another tp
rank holds too (``counted``); the engine sums them over the world.
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain.config import TrainConfig
from paratrain.parallel.ddp import DPCommStats, GradBuckets
from paratrain.parallel.ddp_comm import GroupComm
from paratrain.parallel.engine import grad_sq
from paratrain.parallel.optim import build_adamw, set_lr
from paratrain.parallel.precision import grad_of, optimizer_tensors, reduce_dtype
from paratrain.plan import ParallelPlan


def kind_of(plan: ParallelPlan, dp: int) -> str:
    """Which reducer a plan selects on a dp axis of size ``dp``."""
    if dp == 1:
        return "none"
    if plan.compress is not None:
        return "topk"
    return ("ddp", "zero", "zero", "fsdp")[plan.zero]


class DataAxis:
    """The dp-axis reducer of this rank's chunks, and the optimizer that goes with it."""

    def __init__(self, chunks: list[nn.Module], group, dp: int, plan: ParallelPlan,
                 cfg: TrainConfig, counted, select=None, units_of=None) -> None:
        """``select(p)``: the parameters this reducer takes (default all); expert
        parallelism builds two, dense over dp and experts over the edp group.
        ``units_of(chunk)``: ZeRO-3's units (default :func:`.fsdp.default_units`), of
        which the reducer takes the selected parameters."""
        self.kind = kind_of(plan, dp)
        self.plan = plan
        self.deferred = plan.pp > 1
        self.dp_rank = 0
        self.counted = counted
        self.container = nn.ModuleList(chunks)
        sel = select or (lambda p: True)
        lists = [[p for p in c.parameters() if p.requires_grad and sel(p)] for c in chunks]
        self.params = [p for p in self.container.parameters() if sel(p)]
        if select is not None and self.kind == "topk":
            raise ValueError("the topk reducer takes whole chunks; drop --compress")
        self.buckets: list[GradBuckets] = []
        self.zo = self.fs = self.tk = None
        self.comm = None
        self.history: list[DPCommStats] = []
        self.steps_done = 0
        self._exposed = 0.0  # ZeRO-2's per-micro-batch waits, billed to the step
        if self.kind == "none":
            self.opt = build_adamw(self.container, cfg, select)
            return
        self.comm = GroupComm(group, plan.collectives)
        self.dp_rank = self.comm.rank
        rdt = reduce_dtype(cfg)
        if self.kind == "ddp":
            self.buckets = [GradBuckets(ps, self.comm, plan.bucket_mb, plan.overlap,
                                        dtype=rdt) for ps in lists]
            self.opt = build_adamw(self.container, cfg, select)
        elif self.kind == "topk":
            from paratrain.parallel.compress import TopKCompressor, parse_topk

            self.tk = TopKCompressor(self.container.parameters(), group,
                                     parse_topk(plan.compress), plan.collectives)
            self.comm = self.tk.comm
            self.opt = build_adamw(self.container, cfg, select)
        elif self.kind == "zero":
            from paratrain.parallel.zero import ZeroOptimizer

            self.zo = ZeroOptimizer(lists, group, plan.zero, cfg, plan.bucket_mb,
                                    plan.overlap, plan.collectives, counted, self.deferred,
                                    rdt)
            self.comm = self.zo.comm
            self.buckets = self.zo.chunks
            self.opt = self.zo.adam.opt
        else:
            from paratrain.parallel.fsdp import FullyShard, default_units

            units, owner = [], []
            for c, chunk in enumerate(chunks):
                for u in (units_of or default_units)(chunk):
                    if any(sel(q) for m in u for q in m.parameters()):
                        units.append(u)
                        owner.append(c)
            self.fs = FullyShard(units, group, cfg, plan.collectives, reduce_dtype=rdt,
                                 overlap=plan.overlap, deferred=self.deferred,
                                 unit_chunks=owner, counted=counted, select=select)
            self.comm = self.fs.comm
            self.opt = self.fs.adam.opt
        if self.deferred:
            for gb in self.buckets:
                gb.set_sync(False)  # a pipeline reduces per chunk, never from hooks
        self._mark = self.comm.bytes_sent

    # ---- backward ------------------------------------------------------------------
    def before_backward(self, last: bool) -> None:
        """No pipeline: the coming backward is the step's last micro-batch or not."""
        self._last = last
        if self.kind == "ddp":
            for gb in self.buckets:
                gb.set_sync(last)
        elif self.kind == "zero":
            self.zo.set_sync(last or self.zo.stage == 2)

    def after_backward(self) -> None:
        if self.kind == "ddp":
            for gb in self.buckets:
                gb.end_backward()
        elif self.kind == "zero":
            st = self.zo.end_backward(self._last)
            if st is not None:
                self._exposed += st.seconds
        elif self.kind == "fsdp":
            self.fs.end_backward()

    def chunk_done(self, c: int) -> None:
        """Pipeline: chunk ``c`` has had its last backward of the step."""
        if self.kind == "ddp":
            self.buckets[c].launch_all()
        elif self.kind == "zero":
            self.zo.launch_chunk(c)
        elif self.kind == "fsdp":
            self.fs.launch_chunk(c)

    def finish(self) -> DPCommStats:
        """After the step's last backward: reduce what is left and wait for all."""
        if self.kind == "none":
            return DPCommStats()
        if self.kind == "topk":
            stats = self.tk.reduce()
        elif self.kind == "ddp":
            stats = self.buckets[0].finish()
            for gb in self.buckets[1:]:
                stats = stats.merge(gb.finish())
        elif self.kind == "zero":
            stats = self.zo.finish()
            # the previous step's parameter all-gather belongs to this step's bill
            stats.seconds += self._exposed + self.zo.gather_s
            self._exposed = 0.0
        else:
            stats = self.fs.finish()
        stats.wire_bytes = self.comm.bytes_sent - self._mark
        self._mark = self.comm.bytes_sent
        self.history.append(stats)
        return stats

    # ---- the update ------------------------------------------------------------------
    @torch.no_grad()
    def local_sq(self, every_replica: bool = False) -> torch.Tensor:
        """Squares of the gradient this rank owns (float64, CPU), counted once; with
        ``every_replica`` each data replica counts its (identical, replicated) gradients,
        for a caller that will not sum over the dp axis."""
        if self.kind == "zero":
            self.zo.adam.bind_grads()
            return self.zo.adam.local_sq()
        if self.kind == "fsdp":
            self.fs.prepare_step()
            return self.fs.adam.local_sq()
        sq = torch.zeros((), dtype=torch.float64)
        if self.dp_rank == 0 or every_replica:  # replicated: one data replica counts them
            for p in self.params:
                g = grad_of(p)
                if g is not None and self.counted(p):
                    sq += grad_sq(g)
        return sq

    @torch.no_grad()
    def scale(self, coef: float) -> None:
        if self.kind in ("zero", "fsdp"):
            (self.zo or self.fs).adam.scale(coef)
        elif coef != 1.0:
            for p in self.params:
                g = grad_of(p)
                if g is not None:
                    g.mul_(coef)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """The optimizer step on what this rank owns, then ready for the next step."""
        self.steps_done += 1
        if self.kind == "zero":
            self.zo.step(lr)
            return
        if self.kind == "fsdp":
            self.fs.step(lr)
            return
        set_lr(self.opt, lr)
        self.opt.step()
        if self.kind == "ddp":
            for gb in self.buckets:
                gb.zero_grad()  # .grad are views into the flat buckets: keep them
        else:
            self.opt.zero_grad(set_to_none=True)

    # ---- state, memory, reports ---------------------------------------------------------
    def state_dict(self) -> dict:
        if self.kind == "fsdp":
            return {"shards": [u.shard for u in self.fs.units],
                    "optim": self.fs.adam.state_dict()}
        opt = self.zo.adam if self.kind == "zero" else self.opt
        return {"model": self.container.state_dict(), "optim": opt.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if self.kind == "fsdp":
            for u, s in zip(self.fs.units, state["shards"], strict=True):
                u.shard.copy_(s)
            self.fs.adam.load_state_dict(state["optim"])
            return
        self.container.load_state_dict(state["model"])
        (self.zo.adam if self.kind == "zero" else self.opt).load_state_dict(state["optim"])

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        if self.kind == "zero":
            return self.zo.state_tensors()
        if self.kind == "fsdp":
            return self.fs.state_tensors()
        params = self.params
        out = {"params": params, "grads": [grad_of(p) for p in params if grad_of(p) is not None],
               "optimizer": optimizer_tensors(self.opt)}
        if self.kind == "topk":
            out["comm_buffers"] = [self.tk.residual]
        return out

    @property
    def comm_buffer_peak(self) -> int:
        """Peak bytes of transient flat buffers: ZeRO-2 buckets, ZeRO-3 gathered units."""
        if self.kind == "fsdp":
            return self.fs.gathered_peak
        return max([gb.comm_buffer_peak for gb in self.buckets] or [0])

    def layout(self) -> str:
        """What the reducer built (the first word is the number of flat buffers)."""
        if self.kind == "none":
            return "0 flat buffers: one data replica, nothing to reduce"
        if self.kind == "topk":
            tk = self.tk
            return (f"1 top-{tk.k} compressor: {tk.keep:,} of {tk.n:,} gradient entries "
                    f"per rank and step (values + int32 indices), all-gathered over "
                    f"{tk.comm.size} ranks, error feedback on")
        if self.kind == "fsdp":
            return self.fs.layout()
        parts = [gb.layout() for gb in self.buckets]
        n = sum(len(gb.buckets) for gb in self.buckets)
        if len(parts) == 1:
            return parts[0]
        return f"{n} gradient buckets in {len(parts)} chunks:\n" + "\n".join(parts)

    def describe(self) -> str:
        prefix = {"zero": f"ZeRO-{self.plan.zero}: ", "fsdp": "ZeRO-3: "}.get(self.kind, "")
        return prefix + self.layout()

    def full_parameters(self) -> dict[int, torch.Tensor]:
        """id(param) -> full value (collective under ZeRO-3)."""
        if self.kind == "fsdp":
            return self.fs.full_parameters()
        return {id(p): p.detach().clone() for p in self.params}

    def report(self) -> dict:
        last = self.history[-1] if self.history else None
        out = {"kind": self.kind, "bucket_layout": self.layout(),
               "wire_bytes_total": self.comm.bytes_sent if self.comm else 0.0,
               "steps": self.steps_done,
               "last_step": last.__dict__.copy() if last else None,
               "exposed_s_per_step": [h.seconds for h in self.history],
               "hidden_s_per_step": [h.hidden_s for h in self.history]}
        if self.kind == "ddp" and not self.deferred:
            out["rebuilt"] = all(gb.rebuilt for gb in self.buckets)
            out["follows_ready_order"] = all(gb.layout_follows_observed_order()
                                             for gb in self.buckets)
        if self.kind == "topk":
            out["compression"] = self.tk.history
        return out

