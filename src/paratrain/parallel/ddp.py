"""Data parallelism as people run it: flat gradient buckets reduced while backward runs.

Public API (composable: any parameter list, any process group, e.g. a mesh's ``dp``
axis and one pipeline stage's possibly tensor-sharded parameters)::

    buckets = BucketedAllReduce(params, group=None, bucket_mb=25, overlap=True,
                                impl="native")   # or GradBuckets(..., mode="reduce_scatter")
    buckets.set_sync(last_micro_step)   # before each backward: communicate this time?
    loss.backward()                     # hooks launch each full bucket's async all-reduce
    stats = buckets.finish()            # after the last backward: launch the rest, wait
    ... clip, optimizer.step() ...
    buckets.zero_grad()                 # zero the flat buffers (and rebuild once, below)


How it works (after PyTorch's reducer, Li et al. 2020, "PyTorch Distributed"):

- Trainable parameters are packed into flat buckets of at most ``bucket_mb`` MB, in
  *reverse registration order* (roughly the order backward produces their gradients).
  Each ``p.grad`` is a view into its bucket, so autograd accumulates straight into the
  flat buffer and nothing is copied.
- A post-accumulate-grad hook counts the ready parameters of each bucket; the moment a
  bucket is complete on a *sync* backward, its all-reduce is launched asynchronously and
  backward continues. ``finish`` launches what is left (everything, with overlap off)
  and waits, just before the optimizer step.
- Gradient accumulation: on micro-steps with ``set_sync(False)`` nothing is sent; the
  buffers keep accumulating. Correctness never depends on the flag: ``finish`` always
  reduces every bucket once; the flag only decides *when* a bucket may go early.
- After the first step, the buckets are rebuilt once in the observed gradient-ready
  order (if it differs), like PyTorch's reducer. Sharded stages (:mod:`zero`) keep their
  first layout because optimizer-state ownership is tied to it.
- Exposed communication is the wall time ``finish`` waits after backward ended; hidden
  communication is the part of the in-flight intervals (launch to observed completion)
  that lay inside backward.
- Transient buffers (ZeRO-2, ``persistent=False``): at most ``MAX_IN_FLIGHT`` buckets
  are being reduced at once; launching another first waits for the oldest, so the full
  gradient buffers are released during backward, not all at its end.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from paratrain.cost.layout import pack_groups
from paratrain.parallel.ddp_comm import GroupComm
from paratrain.parallel.engine import CommStats
from paratrain.parallel.handle import Handle

log = logging.getLogger(__name__)

MODES = ("all_reduce", "reduce_scatter")
MAX_IN_FLIGHT = 2  # transient (ZeRO-2) buckets being reduced at once


@dataclass
class DPCommStats(CommStats):
    """CommStats plus the overlap picture: ``seconds`` is the exposed wait."""

    hidden_s: float = 0.0  # communication that ran while backward was still computing
    buckets: int = 0  # collectives launched for this step
    launched_early: int = 0  # of which launched from backward hooks

    def merge(self, other: DPCommStats) -> DPCommStats:
        """Two reducers' stats of one step as one (times and counts add)."""
        return DPCommStats(self.seconds + other.seconds,
                           self.payload_bytes + other.payload_bytes,
                           self.wire_bytes + other.wire_bytes, self.hidden_s + other.hidden_s,
                           self.buckets + other.buckets,
                           self.launched_early + other.launched_early)


def _union_inside(intervals: list[tuple[float, float]], end: float) -> float:
    """Length of the union of [a, b) intervals, each clipped to end before ``end``."""
    total, cur_a, cur_b = 0.0, None, None
    for a, b in sorted((a, min(b, end)) for a, b in intervals if a < end):
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


@dataclass
class Bucket:
    """Parameters sharing one flat gradient buffer of ``padded`` elements.

    ``offsets[i]`` is where ``params[i]`` starts; elements ``[numel, padded)`` are zero
    padding to a multiple of the group size ``p``, so that reduce-scatter cuts the buffer
    into ``p`` equal chunks and every rank of a ring all-reduce sends exactly
    2(p-1)/p of it.
    """

    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    padded: int
    grad: torch.Tensor | None = None  # (padded,) flat gradient, or None when freed
    grad_shard: torch.Tensor | None = None  # (padded / p,) owned reduced chunk (sharded modes)
    ready: int = 0
    handle: Handle | None = None
    early: bool = False
    index: dict = field(default_factory=dict)  # id(param) -> position in params


def pack(params: list[nn.Parameter], cap_bytes: int, pad_to: int) -> list[Bucket]:
    """Greedy packing in the given order (:func:`paratrain.cost.layout.pack_groups`, the rule
    the prediction counts with); a parameter larger than the cap gets its own bucket.
    Each bucket's length is padded to a multiple of ``pad_to``."""
    params = list(params)
    nbytes = [p.numel() * p.element_size() for p in params]
    groups = [[params[i] for i in g] for g in pack_groups(nbytes, cap_bytes)]
    out = []
    for g in groups:
        offs, n = [], 0
        for p in g:
            offs.append(n)
            n += p.numel()
        padded = -(-n // pad_to) * pad_to
        out.append(Bucket(g, offs, n, padded, index={id(p): i for i, p in enumerate(g)}))
    return out


class GradBuckets:
    """Bucketed, overlapped gradient reduction over ``comm``'s group.

    ``mode="all_reduce"``: every rank ends with the summed gradient in ``p.grad``.
    ``mode="reduce_scatter"``: rank r ends with chunk r of each bucket's sum in
    ``bucket.grad_shard``; with ``persistent=False`` (ZeRO-2) the full flat buffer only
    exists while its bucket is being filled and sent, ``p.grad`` is released the moment
    it is copied in, and every backward reduces (the owned chunk accumulates).
    """

    def __init__(self, params, comm: GroupComm, bucket_mb: float = 25.0,
                 overlap: bool = True, mode: str = "all_reduce", persistent: bool = True,
                 rebuild: bool = True, dtype: torch.dtype | None = None,
                 pad_to: int | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is unknown; choose one of {', '.join(MODES)}")
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb={bucket_mb} must be positive, e.g. 25")
        if mode == "all_reduce" and not persistent:
            raise ValueError("persistent=False frees gradients after a reduce-scatter; "
                             "use mode='reduce_scatter'")
        self.comm = comm
        self.mode = mode
        self.persistent = persistent
        self.dtype = dtype  # of the flat buffers: the reduction dtype (default: the params')
        self.overlap = overlap
        self.cap_bytes = int(bucket_mb * 1024 * 1024)
        self.params = [p for p in params if p.requires_grad]
        # Padding to a multiple of p: equal chunks for reduce-scatter, and a perfectly
        # balanced ring all-reduce (every rank sends exactly 2(p-1)/p of the bucket).
        # ``pad_to`` (a multiple of p): HSDP pads to the whole dp, so that each owned
        # chunk is all-reduced over the replicas in equal pieces too.
        self.pad_to = pad_to or comm.size
        self.sync = True
        self.rebuild_pending = rebuild
        self.rebuilt = False  # True once the layout followed the observed order
        self.observed: list[int] = []  # id(param) in gradient-ready order, first step only
        self._recording = True
        self._bucket_of: dict[int, Bucket] = {}
        self._build(list(reversed(self.params)))
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_ready) for p in self.params]
        self._intervals: list[tuple[float, float]] = []
        self._bytes_mark = comm.bytes_sent
        self._launched = self._early = 0  # collectives launched this step (from hooks)
        self._retired: list[tuple[float, float]] = []  # (launch, done) of waited ones
        self.comm_buffer_peak = 0  # bytes of flat buffers alive at once (transient mode)

    # ---- layout -------------------------------------------------------------------
    def _build(self, order: list[nn.Parameter]) -> None:
        self.main = False
        self.buckets = pack(order, self.cap_bytes, self.pad_to)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        for b in self.buckets:
            like = b.params[0]
            dt = self.dtype or like.dtype
            # Buffers in another dtype than the gradients (BF16 gradients summed in FP32):
            # each gradient is added into its FP32 view, ``p.main_grad``, as it is
            # produced, and released (Megatron-LM's main_grad).
            self.main = dt != like.dtype
            if self.persistent:
                b.grad = torch.zeros(b.padded, dtype=dt, device=like.device)
                for p, off in zip(b.params, b.offsets, strict=True):
                    view = b.grad[off:off + p.numel()].view_as(p)
                    if self.main:
                        p.main_grad = view
                    else:
                        p.grad = view
            if self.mode == "reduce_scatter":
                s, r = b.padded // self.comm.size, self.comm.rank
                # ZeRO-1: the owned chunk of the full buffer receives the sum (no second
                # copy); ZeRO-2: a persistent chunk that accumulates over micro-steps.
                b.grad_shard = b.grad[r * s:(r + 1) * s] if self.persistent else \
                    torch.zeros(s, dtype=dt, device=like.device)

    def layout(self) -> str:
        """One line per bucket: size and the parameter shapes it holds (first few)."""
        lines = [f"{len(self.buckets)} gradient buckets ({self.mode}, cap "
                 f"{self.cap_bytes / 2**20:g} MB, overlap {'on' if self.overlap else 'off'}):"]
        for i, b in enumerate(self.buckets):
            shapes = ", ".join("x".join(map(str, p.shape)) for p in b.params[:4])
            more = f" +{len(b.params) - 4}" if len(b.params) > 4 else ""
            mb = b.padded * (self.dtype or b.params[0].dtype).itemsize / 1e6
            lines.append(f"  bucket {i}: {len(b.params)} params, {b.numel} elements "
                         f"(padded {b.padded}), {mb:.3f} MB [{shapes}{more}]")
        return "\n".join(lines)

    # ---- backward hooks -----------------------------------------------------------
    def set_sync(self, sync: bool) -> None:
        """Whether the coming backward is the last micro-step (communicates early)."""
        self.sync = sync

    def _on_ready(self, p: nn.Parameter) -> None:
        if self._recording:
            self.observed.append(id(p))
        b = self._bucket_of[id(p)]
        if p.grad is None:  # a deferred weight gradient (zero bubble): swept at launch
            return
        if not self.persistent:  # ZeRO-2: copy into the transient buffer, release p.grad
            if b.grad is None:
                b.grad = torch.zeros(b.padded, dtype=self.dtype or p.dtype, device=p.device)
                self._note_buffers()
            off = b.offsets[b.index[id(p)]]
            b.grad[off:off + p.numel()].add_(p.grad.reshape(-1))
            p.grad = None
        elif self.main:
            p.main_grad.add_(p.grad)
            p.grad = None
        b.ready += 1
        if b.ready == len(b.params) and self.sync and self.overlap:
            self._launch(b, early=True)
        for other in self.buckets:  # observe completions to measure hidden time
            if other.handle is not None:
                other.handle.is_completed()

    def _launch(self, b: Bucket, early: bool = False) -> None:
        if self.main and self.persistent:  # gradients assigned outside autograd's
            for p in b.params:             # accumulation (zero bubble's deferred dW)
                if p.grad is not None:
                    p.main_grad.add_(p.grad)
                    p.grad = None
        if self.mode == "all_reduce":
            b.handle = self.comm.all_reduce(b.grad, async_op=True)
        else:
            out = torch.empty_like(b.grad_shard)
            b.handle = self.comm.reduce_scatter(out, b.grad, async_op=True)
            b.handle.then = self._make_accumulate(b, out)
        b.early = early
        self._launched += 1
        self._early += early
        if not self.persistent:
            self._retire_beyond(MAX_IN_FLIGHT)

    def _retire_beyond(self, window: int) -> None:
        """Transient buffers: wait for the oldest reductions until at most ``window``
        are in flight, so at most that many full buckets exist at once (the gradient
        memory ZeRO-2 promises), not one per bucket until backward ends."""
        flying = sorted((b for b in self.buckets if b.handle is not None),
                        key=lambda b: b.handle.launched_s)
        for b in flying[:max(0, len(flying) - window)]:
            b.handle.wait()
            self._retired.append((b.handle.launched_s, b.handle.done_s))
            b.handle = None

    def _make_accumulate(self, b: Bucket, out: torch.Tensor):
        def then():
            if self.persistent:
                b.grad_shard.copy_(out)
            else:
                b.grad_shard.add_(out)
            if not self.persistent:
                b.grad = None  # the non-owned gradient memory goes as soon as it is sent
        return then

    def _note_buffers(self) -> None:
        live = sum(b.grad.numel() * b.grad.element_size() for b in self.buckets
                   if b.grad is not None)
        self.comm_buffer_peak = max(self.comm_buffer_peak, live)

    # ---- after backward -----------------------------------------------------------
    def end_backward(self) -> DPCommStats | None:
        """Call after every backward. Transient (ZeRO-2) buckets must be reduced before
        the next backward reuses them, so they are finished here; otherwise nothing."""
        self._recording = False
        if self.persistent and not self.sync:
            for b in self.buckets:
                b.ready = 0
            return None
        if not self.persistent and not self.sync:
            return self._finish_all()
        return None

    def launch_all(self) -> None:
        """Launch every bucket not yet in flight (a pipeline chunk whose backward is
        over for all micro-batches: its reduction overlaps the rest of the step)."""
        if self.overlap:
            for b in self.buckets:
                if b.handle is None and b.grad is not None:
                    self._launch(b, early=True)

    def finish(self) -> DPCommStats:
        """After the last micro-step's backward: reduce whatever is not yet in flight,
        wait for all, and report exposed vs hidden time and bytes."""
        self._recording = False
        return self._finish_all()

    def _finish_all(self) -> DPCommStats:
        t_end = time.perf_counter()
        for b in self.buckets:
            if b.handle is None and b.grad is not None and (self.persistent or b.ready):
                self._launch(b)
        intervals, self._retired = self._retired, []
        launched, early, self._launched, self._early = self._launched, self._early, 0, 0
        for b in self.buckets:
            if b.handle is not None:
                b.handle.wait()
                intervals.append((b.handle.launched_s, b.handle.done_s))
                b.handle = None
            b.ready = 0
            if not self.persistent:
                b.grad = None
        exposed = time.perf_counter() - t_end
        mark, self._bytes_mark = self._bytes_mark, self.comm.bytes_sent
        payload = sum(b.padded * (self.dtype or b.params[0].dtype).itemsize for b in self.buckets)
        return DPCommStats(seconds=exposed, payload_bytes=payload,
                           wire_bytes=self.comm.bytes_sent - mark,
                           hidden_s=_union_inside(intervals, t_end), buckets=launched,
                           launched_early=early)

    def zero_grad(self) -> None:
        """Zero the flat buffers after the step; rebuild the layout once from the
        observed gradient-ready order."""
        if self.rebuild_pending and self.persistent and self.mode == "all_reduce":
            self.rebuild_pending = False
            by_id = {id(p): p for p in self.params}
            seen = list(dict.fromkeys(self.observed))
            order = [by_id[i] for i in seen] + [p for p in reversed(self.params)
                                                 if id(p) not in set(seen)]
            if [id(p) for p in order] != [id(p) for b in self.buckets for p in b.params]:
                log.info("rebuilding gradient buckets in the observed ready order")
                self._build(order)
                self.rebuilt = True
                return
        for b in self.buckets:
            if b.grad is not None and self.persistent:
                b.grad.zero_()
            if b.grad_shard is not None and not self.persistent:
                b.grad_shard.zero_()

    def layout_follows_observed_order(self) -> bool:
        """Whether the buckets hold the parameters in the first step's ready order."""
        seen = list(dict.fromkeys(self.observed))
        return [id(p) for b in self.buckets for p in b.params][:len(seen)] == seen

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def BucketedAllReduce(params, group=None, bucket_mb: float = 25.0, overlap: bool = True,
                      impl: str = "native") -> GradBuckets:
    """DDP's reducer on ``group``: summed gradients in ``p.grad`` after ``finish()``."""
    return GradBuckets(params, GroupComm(group, impl), bucket_mb, overlap, "all_reduce")
