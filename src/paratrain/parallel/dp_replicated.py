"""The data-axis reducers whose replicas all hold the whole reduced gradient: DDP's flat
buckets and top-k compression (the interface: :class:`.data_axis.DataAxis`)."""

from __future__ import annotations

import torch

from paratrain.parallel.data_axis import DataAxis, bucket_layout
from paratrain.parallel.ddp import DPCommStats, GradBuckets
from paratrain.parallel.ddp_comm import GroupComm
from paratrain.parallel.optim import build_adamw
from paratrain.parallel.placement import mark
from paratrain.parallel.precision import reduce_dtype


class Buckets(DataAxis):
    """``--zero 0``: gradients all-reduced in flat buckets, every replica steps."""

    name = "ddp"
    communicates = True
    grads_replicated = True

    def _build(self, group, cfg, select, units_of) -> None:
        self.comm = GroupComm(group, self.plan.collectives)
        self.buckets = [GradBuckets(ps, self.comm, self.plan.bucket_mb, self.plan.overlap,
                                    dtype=reduce_dtype(cfg)) for ps in self.lists]
        self.opt = build_adamw(self.container, cfg, select)
        mark(self.params, replicated=self.axes)

    def before_backward(self, last: bool) -> None:
        for gb in self.buckets:
            gb.set_sync(last)

    def after_backward(self) -> None:
        for gb in self.buckets:
            gb.end_backward()

    def chunk_done(self, c: int) -> None:
        self.buckets[c].launch_all()

    def _reduce(self) -> DPCommStats:
        stats = self.buckets[0].finish()
        for gb in self.buckets[1:]:
            stats = stats.merge(gb.finish())
        return stats

    def _release_grads(self) -> None:
        for gb in self.buckets:
            gb.zero_grad()  # .grad are views into the flat buckets: keep them

    def layout(self) -> str:
        return bucket_layout(self.buckets)

    def report(self) -> dict:
        out = super().report()
        if not self.deferred:
            out["rebuilt"] = all(gb.rebuilt for gb in self.buckets)
            out["follows_ready_order"] = all(gb.layout_follows_observed_order()
                                             for gb in self.buckets)
        return out


class TopK(DataAxis):
    """``--compress topk:K``: each rank's top-k gradient entries all-gathered, error
    feedback kept per rank (:mod:`.compress`)."""

    name = "topk"
    communicates = True
    grads_replicated = True

    def _build(self, group, cfg, select, units_of) -> None:
        from paratrain.parallel.compress import TopKCompressor, parse_topk

        if select is not None:
            raise ValueError("the topk reducer takes whole chunks; drop --compress")
        self.tk = TopKCompressor(self.container.parameters(), group,
                                 parse_topk(self.plan.compress), self.plan.collectives)
        self.comm = self.tk.comm
        self.opt = build_adamw(self.container, cfg, select)
        mark(self.params, replicated=self.axes)

    def _reduce(self) -> DPCommStats:
        return self.tk.reduce()

    def residuals(self) -> list[torch.Tensor]:
        return [self.tk.residual]

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {**super().state_tensors(), "comm_buffers": [self.tk.residual]}

    def layout(self) -> str:
        tk = self.tk
        return (f"1 top-{tk.k} compressor: {tk.keep:,} of {tk.n:,} gradient entries "
                f"per rank and step (values + int32 indices), all-gathered over "
                f"{tk.comm.size} ranks, error feedback on")

    def report(self) -> dict:
        return {**super().report(), "compression": self.tk.history}
