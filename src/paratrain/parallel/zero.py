"""ZeRO stages 1 and 2: optimizer state (and gradients) sharded over the data ranks.

Public API (composable: any parameter list, any group, e.g. a mesh's ``dp`` axis)::

    opt = ShardedAdamW(shards, comm, cfg)   # shards: [FlatShard(master_S, grad_S, segments)]
    norm = opt.clip_and_step(lr)            # true global norm, clip, AdamW on owned slices

    zo = ZeroOptimizer(params, group, stage, cfg, bucket_mb=25, overlap=True, impl="native")
    zo.set_sync(last_micro_step); loss.backward(); zo.end_backward()   # per micro-step
    stats = zo.finish()                     # reduce-scatter the rest, wait
    norm = zo.step(lr)                      # update owned slices, all-gather parameters

    ZeroEngine(model, cfg, device, plan, group=None)   # the Engine for --zero 1 / 2

Layout and invariants (Rajbhandari et al. 2020, "ZeRO"):

- Trainable parameters live in flat per-bucket buffers (:mod:`ddp`'s buckets, reverse
  registration order, padded to a multiple of the group size p); each ``p.data`` is a
  view into its bucket. Rank r *owns* chunk r of every bucket: its optimizer state
  (AdamW m and v) exists only for those elements, and the owned chunk of the parameter
  buffer itself is the FP32 master (no second copy: the run's dtype is the master dtype;
  under ``--dtype bfloat16`` autocast computes in BF16 from these FP32 weights).
- Stage 1: gradients accumulate in full flat buffers (views as ``p.grad``); on the last
  micro-step each full bucket is reduce-scattered into the owner's chunk.
- Stage 2: a bucket's flat gradient buffer exists only while the bucket is filled and
  reduce-scattered (launched from backward hooks), ``p.grad`` is released as soon as it
  is copied in, and every micro-step reduce-scatters (the owned chunk accumulates), so
  gradient memory at rest is 1/p.
- After the update, every bucket's parameters are all-gathered from their owners. Wire
  bytes per step: (p-1)/p (reduce-scatter) + (p-1)/p (all-gather) = 2(p-1)/p x payload,
  the same as one all-reduce.
- Clipping uses the true global norm: the squares of the owned chunks summed, then
  all-reduced (padding is zero and adds nothing).
- The layout is fixed at construction (no rebuild from the observed order: ownership
  of optimizer state is tied to it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from paratrain.config import TrainConfig
from paratrain.optim import set_lr
from paratrain.parallel.data import DataParallel
from paratrain.parallel.ddp import DPCommStats, GradBuckets, dp_report, record_step
from paratrain.parallel.ddp_comm import GroupComm


@dataclass
class FlatShard:
    """One owned chunk: ``master_S`` (updated in place), ``grad_S`` (reduced gradient),
    ``segments``: (start, end, decays) per parameter piece inside the chunk."""

    master: torch.Tensor
    grad: torch.Tensor | None
    segments: list[tuple[int, int, bool]]


def owned_segments(params, offsets, lo: int, hi: int,
                   shapes=None) -> list[tuple[int, int, bool]]:
    """Pieces of ``params`` (at ``offsets`` in a flat buffer) inside [lo, hi), relative to
    ``lo``; matrices decay, vectors do not (as :func:`paratrain.optim.param_groups`).
    ``shapes`` overrides the parameters' own (FSDP frees them at rest)."""
    out = []
    shapes = shapes or [p.shape for p in params]
    for p, off, shape in zip(params, offsets, shapes, strict=True):
        a, b = max(off, lo), min(off + shape.numel(), hi)
        if a < b and p.requires_grad:
            out.append((a - lo, b - lo, len(shape) >= 2))
    return out


class ShardedAdamW:
    """AdamW over owned flat chunks. Each segment becomes an ``nn.Parameter`` aliasing
    the master chunk, with a gradient aliasing the reduced chunk, so torch's own
    (per-tensor, foreach=False) AdamW does elementwise exactly what it does unsharded."""

    def __init__(self, shards: list[FlatShard], comm: GroupComm, cfg: TrainConfig) -> None:
        self.shards = shards
        self.comm = comm
        self.cfg = cfg
        decay, no_decay = [], []
        self._segs: list[tuple[nn.Parameter, FlatShard, int, int]] = []
        for s in shards:
            for a, b, dec in s.segments:
                p = nn.Parameter(s.master[a:b])
                self._segs.append((p, s, a, b))
                (decay if dec else no_decay).append(p)
        self.bind_grads()
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, foreach=False)

    def bind_grads(self) -> None:
        """Point each segment's ``.grad`` at its shard's current gradient chunk (None
        when the shard has none: the segment is skipped, as torch skips grad-less
        parameters). Shards whose gradient is allocated per step (FSDP) call this."""
        for p, s, a, b in self._segs:
            p.grad = None if s.grad is None else s.grad[a:b]

    @torch.no_grad()
    def global_norm(self) -> torch.Tensor:
        """sqrt of the sum over ranks of the owned chunks' squared gradients."""
        sq = torch.zeros((), dtype=torch.float64)
        for s in self.shards:
            if s.grad is not None:
                sq += s.grad.double().pow(2).sum().cpu()
        if self.comm.size > 1:  # a scalar: native, and not counted as gradient traffic
            sq = sq.to(self.shards[0].master.device) if self.shards else sq
            dist.all_reduce(sq, group=self.comm.group)
        return sq.sqrt()

    @torch.no_grad()
    def clip_and_step(self, lr: float) -> float:
        self.bind_grads()
        norm = self.global_norm()
        if self.cfg.grad_clip > 0:
            coef = min(1.0, self.cfg.grad_clip / (float(norm) + 1e-6))
            for s in self.shards:
                if s.grad is not None:
                    s.grad.mul_(coef)
        set_lr(self.opt, lr)
        self.opt.step()
        return float(norm)

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for st in self.opt.state.values() for t in st.values()
                if torch.is_tensor(t) and t.dim() > 0]


class ZeroOptimizer:
    """ZeRO-1/2 for ``params`` on ``group``: flat parameter buckets, bucketed
    reduce-scatter overlapped with backward, sharded AdamW, all-gather of parameters."""

    def __init__(self, params, group, stage: int, cfg: TrainConfig, bucket_mb: float = 25.0,
                 overlap: bool = True, impl: str = "native") -> None:
        if stage not in (1, 2):
            raise ValueError(f"ZeroOptimizer handles stages 1 and 2, not {stage}; "
                             "use FullyShard for stage 3")
        self.stage = stage
        self.comm = GroupComm(group, impl)
        self.buckets = GradBuckets(params, self.comm, bucket_mb, overlap, "reduce_scatter",
                                   persistent=stage == 1, rebuild=False)
        p, r = self.comm.size, self.comm.rank
        shards = []
        self.flats: list[torch.Tensor] = []
        for b in self.buckets.buckets:
            flat = torch.zeros(b.padded, dtype=b.params[0].dtype, device=b.params[0].device)
            with torch.no_grad():
                for q, off in zip(b.params, b.offsets, strict=True):
                    flat[off:off + q.numel()].copy_(q.reshape(-1))
                    q.data = flat[off:off + q.numel()].view_as(q)
            self.flats.append(flat)
            s = b.padded // p
            shards.append(FlatShard(flat[r * s:(r + 1) * s], b.grad_shard,
                                    owned_segments(b.params, b.offsets, r * s, (r + 1) * s)))
        self.adam = ShardedAdamW(shards, self.comm, cfg)
        self.gather_s = 0.0

    def set_sync(self, sync: bool) -> None:
        self.buckets.set_sync(sync)

    def end_backward(self) -> DPCommStats | None:
        """After each backward: stage 2 finishes its reduce-scatters every micro-step."""
        if self.stage == 2 and not self.buckets.sync:
            return self.buckets.finish()
        self.buckets.end_backward()
        return None

    def finish(self) -> DPCommStats:
        return self.buckets.finish()

    @torch.no_grad()
    def step(self, lr: float) -> float:
        """Clip by the global norm, update the owned chunks, all-gather the parameters."""
        norm = self.adam.clip_and_step(lr)
        t0 = time.perf_counter()
        p, r = self.comm.size, self.comm.rank
        handles = []
        for flat in self.flats:
            s = flat.numel() // p
            handles.append(self.comm.all_gather(flat, flat[r * s:(r + 1) * s].clone()))
        for h in handles:
            h.wait()
        self.gather_s = time.perf_counter() - t0
        self.buckets.zero_grad()
        return norm

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        grads = [b.grad for b in self.buckets.buckets if b.grad is not None]
        grads += [b.grad_shard for b in self.buckets.buckets]
        return {"params": list(self.flats), "grads": grads,
                "optimizer": self.adam.state_tensors()}


class ZeroEngine(DataParallel):
    """``--zero 1`` / ``--zero 2`` on the data-parallel group."""

    def __init__(self, model, cfg, device, plan, group=None) -> None:
        super().__init__(model, cfg, device, group)
        self.zo = ZeroOptimizer(model.parameters(), group, plan.zero, cfg, plan.bucket_mb,
                                plan.overlap, plan.collectives)
        self.opt = self.zo.adam.opt  # what checkpoints and set_lr see
        self.comm = self.zo.comm
        self.micro_batches = plan.micro_batches if plan.pp == 1 else 1
        self._micro = 0
        self._mark = 0.0
        self._exposed = 0.0
        self.steps_done = 0
        self.history: list[DPCommStats] = []

    def forward_backward(self, x_BT, y_BT, n_tokens_global: int) -> float:
        self._micro += 1
        last = self._micro >= self.micro_batches
        self.zo.set_sync(last or self.zo.stage == 2)
        loss = super().forward_backward(x_BT, y_BT, n_tokens_global)
        if not last and self.zo.stage == 2:
            self._exposed += self.zo.buckets.finish().seconds
        else:
            self.zo.buckets.end_backward()
        return loss

    def reduce_gradients(self) -> DPCommStats:
        self._micro = 0
        stats = self.zo.finish()
        # the previous step's parameter all-gather belongs to this step's bill
        stats.seconds += self._exposed + self.zo.gather_s
        self._exposed = 0.0
        return record_step(self, stats)

    def describe_layout(self) -> str:
        """Printed by the loop at the start of a run (rank 0)."""
        return f"ZeRO-{self.zo.stage}: " + self.zo.buckets.layout()

    def clip_and_step(self, lr: float) -> float:
        self.steps_done += 1
        return self.zo.step(lr)

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return self.zo.state_tensors()

    def report(self) -> dict:
        return dp_report(self, self.zo.buckets.layout())

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}
