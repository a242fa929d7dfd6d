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
from torch import nn

from paratrain.config import TrainConfig
from paratrain.parallel.ddp import DPCommStats, GradBuckets
from paratrain.parallel.ddp_comm import GroupComm
from paratrain.parallel.engine import grad_sq
from paratrain.parallel.optim import set_lr


@dataclass
class FlatShard:
    """One owned chunk: ``working_S`` (the parameters' own elements, what is gathered),
    ``master_S`` (the optimizer's copy: ``working`` itself, or its FP32 copy under
    mixed precision), ``grad_S`` (reduced gradient), ``segments``: (start, end, decays,
    counted, parameter) per parameter piece inside the chunk; ``counted`` is False for a piece
    another rank also holds (a tensor-parallel replicated norm gain on tp rank > 0),
    which the global norm must count once."""

    working: torch.Tensor
    grad: torch.Tensor | None
    segments: list[tuple[int, int, bool, bool, nn.Parameter]]
    master: torch.Tensor | None = None
    grad32: torch.Tensor | None = None  # this step's gradient in the master dtype

    def __post_init__(self) -> None:
        if self.master is None:
            self.master = self.working


def owned_segments(params, offsets, lo: int, hi: int, shapes=None,
                   counted=lambda p: True) -> list[tuple[int, int, bool, bool, nn.Parameter]]:
    """Pieces of ``params`` (at ``offsets`` in a flat buffer) inside [lo, hi), relative to
    ``lo``, with the parameter each is of; matrices decay, vectors do not (as
    :func:`paratrain.parallel.optim.param_groups`). ``shapes`` overrides the parameters'
    own (FSDP frees them at rest)."""
    out = []
    shapes = shapes or [p.shape for p in params]
    for p, off, shape in zip(params, offsets, shapes, strict=True):
        a, b = max(off, lo), min(off + shape.numel(), hi)
        if a < b and p.requires_grad:
            out.append((a - lo, b - lo, len(shape) >= 2, counted(p), p))
    return out


class ShardedAdamW:
    """AdamW over owned flat chunks. Each segment becomes an ``nn.Parameter`` aliasing
    the master chunk, with a gradient aliasing the reduced chunk, so torch's own
    (per-tensor, foreach=False) AdamW does elementwise exactly what it does unsharded.

    The global gradient norm spans more than this group (tensor and pipeline shards
    live on other ranks), so this class only gives its share, :meth:`local_sq`; the
    engine sums the shares over the world and clips with :meth:`scale`."""

    def __init__(self, shards: list[FlatShard], cfg: TrainConfig) -> None:
        from paratrain.parallel.precision import master_dtype

        self.shards = shards
        self.cfg = cfg
        for s in shards:  # mixed precision: an FP32 master beside the BF16 working chunk
            if s.master.dtype != master_dtype(cfg):
                s.master = s.working.to(master_dtype(cfg)).clone()
        decay, no_decay = [], []
        self._segs: list[tuple[nn.Parameter, FlatShard, int, int, bool]] = []
        self._owners: list[nn.Parameter] = []
        for s in shards:
            for a, b, dec, counted, q in s.segments:
                p = nn.Parameter(s.master[a:b])
                self._segs.append((p, s, a, b, counted))
                self._owners.append(q)
                (decay if dec else no_decay).append(p)
        self.bind_grads()
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, foreach=False)

    def bind_grads(self) -> None:
        """Point each segment's ``.grad`` at its shard's current gradient chunk (None
        when the shard has none: the segment is skipped, as torch skips grad-less
        parameters), in the master dtype (a copy when the reduction dtype differs).
        Called before each step."""
        for s in self.shards:
            g = s.grad
            s.grad32 = g if g is None or g.dtype == s.master.dtype else g.to(s.master.dtype)
        for p, s, a, b, _ in self._segs:
            p.grad = None if s.grad32 is None else s.grad32[a:b]

    @torch.no_grad()
    def local_sq(self) -> torch.Tensor:
        """Sum of squares (float64) of the owned, counted gradient pieces."""
        sq = torch.zeros((), dtype=torch.float64)
        for p, _, _, _, counted in self._segs:
            if counted and p.grad is not None:
                sq += grad_sq(p.grad)
        return sq

    @torch.no_grad()
    def scale(self, coef: float) -> None:
        if coef != 1.0:
            for s in self.shards:
                if s.grad32 is not None:
                    s.grad32.mul_(coef)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        set_lr(self.opt, lr)
        self.opt.step()
        for s in self.shards:
            s.grad32 = None
            if s.master is not s.working:
                s.working.copy_(s.master)  # round the update into the working copy

    def owned(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """(model parameter, the master segment of it this rank owns, which keys its AdamW
        state), in shard order; the segment is the parameter's ``placement.owned`` range."""
        return [(q, seg) for q, (seg, *_) in zip(self._owners, self._segs, strict=True)]

    @torch.no_grad()
    def to_working(self) -> None:
        """Round loaded masters into the working chunks."""
        for s in self.shards:
            if s.master is not s.working:
                s.working.copy_(s.master)

    def state_tensors(self) -> list[torch.Tensor]:
        """Adam moments and (under mixed precision) the FP32 masters."""
        out = [t for st in self.opt.state.values() for t in st.values()
               if torch.is_tensor(t) and t.dim() > 0]
        return out + [s.master for s in self.shards if s.master is not s.working]

    def state_dict(self) -> dict:
        return {"adamw": self.opt.state_dict(), "masters": [s.master for s in self.shards]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state["adamw"])
        for s, m in zip(self.shards, state["masters"], strict=True):
            s.master.copy_(m)
            s.working.copy_(m)


class ZeroOptimizer:
    """ZeRO-1/2 on ``group`` for ``param_lists`` (one list per pipeline chunk; each gets
    its own buckets, so a chunk can be reduced as soon as its backward is over): flat
    parameter buckets, bucketed reduce-scatter overlapped with backward, one sharded
    AdamW over every owned chunk, all-gather of parameters after the update.

    ``deferred`` (under a pipeline): nothing is sent from backward hooks; gradients
    accumulate over the step's micro-batches in full flat buffers and each chunk is
    reduce-scattered once, by :meth:`launch_chunk`, when its last backward is done.
    ZeRO-2 then keeps ZeRO-1's gradient buffers (as Megatron-LM's distributed optimizer
    does under pipelining; DeepSpeed refuses ZeRO-2 with pipelining): reduce-scattering
    every micro-batch instead would multiply the gradient traffic by the micro-batch
    count. The systems model prices it so (:mod:`paratrain.cost.layout`)."""

    def __init__(self, param_lists, group, stage: int, cfg: TrainConfig,
                 bucket_mb: float = 25.0, overlap: bool = True, impl: str = "native",
                 counted=lambda p: True, deferred: bool = False,
                 reduce_dtype: torch.dtype | None = None, pad_to: int | None = None) -> None:
        if stage not in (1, 2):
            raise ValueError(f"ZeroOptimizer handles stages 1 and 2, not {stage}; "
                             "use FullyShard for stage 3")
        self.stage = stage
        self.comm = GroupComm(group, impl)
        self.deferred = deferred
        persistent = stage == 1 or deferred
        self.chunks = [GradBuckets(ps, self.comm, bucket_mb, overlap, "reduce_scatter",
                                   persistent=persistent, rebuild=False, dtype=reduce_dtype,
                                   pad_to=pad_to)
                       for ps in param_lists]
        p, r = self.comm.size, self.comm.rank
        shards = []
        self.flats: list[torch.Tensor] = []
        for b in (b for gb in self.chunks for b in gb.buckets):
            flat = torch.zeros(b.padded, dtype=b.params[0].dtype, device=b.params[0].device)
            with torch.no_grad():
                for q, off in zip(b.params, b.offsets, strict=True):
                    flat[off:off + q.numel()].copy_(q.reshape(-1))
                    q.data = flat[off:off + q.numel()].view_as(q)
            self.flats.append(flat)
            s = b.padded // p
            shards.append(FlatShard(flat[r * s:(r + 1) * s], b.grad_shard,
                                    owned_segments(b.params, b.offsets, r * s, (r + 1) * s,
                                                   counted=counted)))
        self.adam = ShardedAdamW(shards, cfg)
        self.gather_s = 0.0

    def set_sync(self, sync: bool) -> None:
        for gb in self.chunks:
            gb.set_sync(sync)

    def end_backward(self, last: bool) -> DPCommStats | None:
        """After each backward (no pipeline): stage 2 finishes its reduce-scatters on
        every micro-step but the last (its transient buffers must be sent before the
        next backward refills them; the last is finished with the step)."""
        out = None
        for gb in self.chunks:
            if self.stage == 2 and not last:
                st = gb.finish()
                out = st if out is None else out.merge(st)
            else:
                gb.end_backward()
        return out

    def launch_chunk(self, c: int) -> None:
        """Pipeline: chunk ``c``'s backward is over for every micro-batch: send it."""
        self.chunks[c].launch_all()

    def finish(self) -> DPCommStats:
        stats = None
        for gb in self.chunks:
            st = gb.finish()
            stats = st if stats is None else stats.merge(st)
        return stats

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """Update the owned chunks (already clipped), all-gather the parameters."""
        self.adam.step(lr)
        t0 = time.perf_counter()
        self.gather_parameters()
        self.gather_s = time.perf_counter() - t0
        for gb in self.chunks:
            gb.zero_grad()

    @torch.no_grad()
    def gather_parameters(self) -> None:
        """All-gather every bucket's parameters from their owners' chunks."""
        p, r = self.comm.size, self.comm.rank
        handles = []
        for flat in self.flats:
            s = flat.numel() // p
            handles.append(self.comm.all_gather(flat, flat[r * s:(r + 1) * s].clone()))
        for h in handles:
            h.wait()

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        buckets = [b for gb in self.chunks for b in gb.buckets]
        grads = [b.grad for b in buckets if b.grad is not None]
        grads += [b.grad_shard for b in buckets]
        return {"params": list(self.flats), "grads": grads,
                "optimizer": self.adam.state_tensors()}
