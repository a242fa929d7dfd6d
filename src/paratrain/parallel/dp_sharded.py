"""The data-axis reducers that shard optimizer state over the data ranks: ZeRO-1/2
(:class:`.zero.ZeroOptimizer`) and ZeRO-3 (:class:`.fsdp.FullyShard`); the interface is
:class:`.data_axis.DataAxis`. Each records on its parameters the flat range this rank
owns (:func:`.placement.record_flat`)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from paratrain.parallel.data_axis import DataAxis, bucket_layout
from paratrain.parallel.ddp import DPCommStats
from paratrain.parallel.placement import record_flat
from paratrain.parallel.precision import reduce_dtype


class _Sharded(DataAxis):
    """What ZeRO-1/2 and ZeRO-3 share: a :class:`.zero.ShardedAdamW` (``self.adam``)
    over owned flat segments, which gives the norm's squares, clips and is checkpointed."""

    communicates = True

    @torch.no_grad()
    def local_sq(self, every_replica: bool = False) -> torch.Tensor:
        self._bind()
        return self.adam.local_sq()

    def _bind(self) -> None:
        self.adam.bind_grads()

    @torch.no_grad()
    def scale(self, coef: float) -> None:
        self.adam.scale(coef)

    def owned_state(self) -> list[tuple[nn.Parameter, torch.Tensor, torch.optim.Optimizer]]:
        return [(q, seg, self.adam.opt) for q, seg in self.adam.owned()]

    def layout(self) -> str:
        return bucket_layout(self.buckets)

    def _pad_to(self, group) -> int | None:
        """HSDP: flat buffers padded to a multiple of the whole dp (x cp), so the owned
        chunk splits evenly over the replicas (None: the group's size, plain ZeRO)."""
        if self.rcomm is None:
            return None
        return dist.get_world_size(group) * self.rcomm.size

    def _hsdp(self) -> str:
        if self.rcomm is None:
            return ""
        return (f" (HSDP: sharded over {self.comm.size} ranks, owned chunks all-reduced "
                f"over {self.rcomm.size} replicas once per step)")

    def _replicas(self, shards: list[torch.Tensor]) -> float:
        """HSDP: sum each owned gradient chunk over the replicas (in place, all launched
        then all waited); the seconds it took, all exposed."""
        if self.rcomm is None:
            return 0.0
        t0 = time.perf_counter()
        for h in [self.rcomm.all_reduce(g) for g in shards]:
            h.wait()
        return time.perf_counter() - t0


class Zero(_Sharded):
    """``--zero 1|2``: bucketed reduce-scatter, sharded AdamW, all-gather
    (:class:`.zero.ZeroOptimizer`)."""

    name = "zero"

    def _build(self, group, cfg, select, units_of) -> None:
        from paratrain.parallel.zero import ZeroOptimizer

        plan = self.plan
        self.zo = ZeroOptimizer(self.lists, group, plan.zero, cfg, plan.bucket_mb,
                                plan.overlap, plan.collectives, self.counted,
                                self.deferred, reduce_dtype(cfg), self._pad_to(group))
        self.comm, self.buckets = self.zo.comm, self.zo.chunks
        self.adam, self.opt = self.zo.adam, self.zo.adam.opt
        self._exposed = 0.0  # ZeRO-2's per-micro-batch waits, billed to the step
        for b in (b for gb in self.buckets for b in gb.buckets):
            record_flat(b.params, b.offsets, b.padded, self.comm.rank, self.comm.size,
                        self.axes)

    def before_backward(self, last: bool) -> None:
        self._last = last
        self.zo.set_sync(last or self.zo.stage == 2)

    def after_backward(self) -> None:
        st = self.zo.end_backward(self._last)
        if st is not None:
            self._exposed += st.seconds

    def chunk_done(self, c: int) -> None:
        self.zo.launch_chunk(c)

    def _reduce(self) -> DPCommStats:
        stats = self.zo.finish()
        # the previous step's parameter all-gather belongs to this step's bill
        stats.seconds += self._exposed + self.zo.gather_s
        stats.seconds += self._replicas([b.grad_shard for gb in self.buckets
                                         for b in gb.buckets])
        self._exposed = 0.0
        return stats

    @torch.no_grad()
    def step(self, lr: float) -> None:
        self.steps_done += 1
        self.zo.step(lr)

    @torch.no_grad()
    def sync_working(self) -> None:
        self.adam.to_working()
        self.zo.gather_parameters()

    def state_dict(self) -> dict:
        return {"model": self.container.state_dict(), "optim": self.adam.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.container.load_state_dict(state["model"])
        self.adam.load_state_dict(state["optim"])

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return self.zo.state_tensors()

    def describe(self) -> str:
        return f"ZeRO-{self.plan.zero}{self._hsdp()}: " + self.layout()


class Units(_Sharded):
    """``--zero 3``: FSDP units, parameters sharded at rest (:class:`.fsdp.FullyShard`)."""

    name = "fsdp"

    def _build(self, group, cfg, select, units_of) -> None:
        from paratrain.parallel.fsdp import FullyShard, default_units

        units, owner = [], []
        for c, chunk in enumerate(self.container):
            for u in (units_of or default_units)(chunk):
                if any(self.select(q) for m in u for q in m.parameters()):
                    units.append(u)
                    owner.append(c)
        plan = self.plan
        self.fs = FullyShard(units, group, cfg, plan.collectives, reduce_dtype=reduce_dtype(cfg),
                             overlap=plan.overlap, deferred=self.deferred,
                             unit_chunks=owner, counted=self.counted, select=select,
                             pad_to=self._pad_to(group))
        self.comm, self.adam, self.opt = self.fs.comm, self.fs.adam, self.fs.adam.opt
        for u in self.fs.units:
            record_flat(u.params, u.offsets, u.padded, self.comm.rank, self.comm.size,
                        self.axes)

    def after_backward(self) -> None:
        self.fs.end_backward()

    def chunk_done(self, c: int) -> None:
        self.fs.launch_chunk(c)

    def _reduce(self) -> DPCommStats:
        stats = self.fs.finish()
        stats.seconds += self._replicas([u.grad_shard for u in self.fs.units
                                         if u.grad_shard is not None])
        return stats

    def _bind(self) -> None:
        self.fs.prepare_step()

    @torch.no_grad()
    def step(self, lr: float) -> None:
        self.steps_done += 1
        self.fs.step(lr)

    @torch.no_grad()
    def sync_working(self) -> None:
        self.adam.to_working()

    def state_dict(self) -> dict:
        return {"shards": [u.shard for u in self.fs.units], "optim": self.adam.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for u, s in zip(self.fs.units, state["shards"], strict=True):
            u.shard.copy_(s)
        self.adam.load_state_dict(state["optim"])

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return self.fs.state_tensors()

    @property
    def comm_buffer_peak(self) -> int:
        return self.fs.gathered_peak

    def layout(self) -> str:
        return self.fs.layout()

    def describe(self) -> str:
        return f"ZeRO-3{self._hsdp()}: " + self.layout()

    def full_parameters(self) -> dict[int, torch.Tensor]:
        return self.fs.full_parameters()
