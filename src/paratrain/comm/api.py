"""Public collectives over our own schedules, shaped like torch.distributed's.

Every function takes ``group`` (None: the default group; any sub-group of a mesh works,
ranks such as ``src``/``dst`` are *group* ranks), ``algorithm`` (see
:data:`paratrain.comm.algorithms.ALGORITHMS`), ``async_op`` and an optional ``stats``
(:class:`CollectiveCounts`) that accumulates steps and bytes per (op, algorithm). Keywords
passed on to the executor: ``piece_bytes`` (pipeline piece, default 4 MiB),
``timeout_s`` (per wait, default 120), ``segments`` (pipelined schedules) and
``gpus_per_node`` (hierarchical).

Asynchrony and overlap: ``async_op=True`` queues the collective on this process's single
communication thread and returns a :class:`PendingCollective` at once. That thread is a FIFO, like
a CUDA communication stream: collectives run in the order they were issued, which is the
same order on every rank, so their point-to-point messages pair up. While it runs, the
caller's thread continues (e.g. backward): the thread spends its time in gloo waits and
torch kernels, which release the GIL. The overlap is real but shares CPU cores: on a
small machine the in-place additions compete with backward for the same cores.
Synchronous calls run inline when nothing is queued, else behind the queue.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache

import torch
import torch.distributed as dist

from paratrain.comm.algorithms import SEGMENTED, build
from paratrain.comm.direct import ring_shift
from paratrain.comm.executor import DEFAULT_PIECE_BYTES, ExecStats, execute
from paratrain.comm.schedule import chunk_sizes, offsets

DEFAULT_TIMEOUT_S = 120.0
SEGMENT_BYTES = 1 << 20  # pipelined schedules: about one segment per MiB, 2..64 of them


@dataclass
class CollectiveCounts:
    """Totals per (op, algorithm): calls, steps, bytes sent and received, seconds."""

    totals: dict = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    last: ExecStats | None = None

    def record(self, s: ExecStats) -> None:
        """Add one execution."""
        t = self.totals[(s.op, s.algorithm)]
        t["calls"] += 1
        t["steps"] += s.steps
        t["bytes_sent"] += s.bytes_sent
        t["bytes_recv"] += s.bytes_recv
        t["seconds"] += s.seconds
        self.last = s

    def bytes_sent(self) -> int:
        """Bytes this rank sent over all recorded collectives."""
        return int(sum(t["bytes_sent"] for t in self.totals.values()))

    def reset(self) -> None:
        """Forget everything recorded."""
        self.totals.clear()
        self.last = None


class PendingCollective:
    """A collective in flight. ``wait()`` returns its result tensor (re-raising its error);
    ``stats`` is this rank's :class:`ExecStats` once done."""

    def __init__(self, future: Future, result):
        self._future, self._result = future, result

    def wait(self, timeout_s: float | None = None):
        """Block until done; return the result."""
        self._future.result(timeout_s)
        return self._result

    def is_completed(self) -> bool:
        """True once the collective has finished (successfully or not)."""
        return self._future.done()

    @property
    def stats(self) -> ExecStats:
        """What the execution did on this rank (waits for it)."""
        return self._future.result()


_POOL: ThreadPoolExecutor | None = None
_PENDING: list[Future] = []
_LOCK = threading.Lock()


def _submit(fn, async_op: bool, result):
    global _POOL
    with _LOCK:
        _PENDING[:] = [f for f in _PENDING if not f.done()]
        if not async_op and not _PENDING:
            fn()  # nothing queued: run inline, no thread hand-off
            return result
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="paratrain-comm")
        fut = _POOL.submit(fn)
        _PENDING.append(fut)
    if async_op:
        return PendingCollective(fut, result)
    fut.result()
    return result


def _flat(t: torch.Tensor, name: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous; pass {name}.contiguous()")
    return t.view(-1)


def _run(op, algorithm, n, planes, group, reduce_op, async_op, stats, result, *, root=0,
         segments=None, piece_bytes=None, timeout_s=None, after=None, gpus_per_node=8,
         sched=None):
    p = dist.get_world_size(group)
    if (op, algorithm) in SEGMENTED and segments is None:
        nbytes = n * planes[0][0].element_size()
        segments = max(1, min(n, 64, max(2, nbytes // SEGMENT_BYTES)))
    if sched is None:
        sched = build(op, algorithm, p, n, root=root, segments=segments,
                      gpus_per_node=gpus_per_node)

    def go():
        s = execute(sched, planes, group=group, reduce_op=reduce_op,
                    piece_bytes=piece_bytes or DEFAULT_PIECE_BYTES,
                    timeout_s=timeout_s or DEFAULT_TIMEOUT_S)
        if after is not None:
            after()
        if stats is not None:
            stats.record(s)
        return s

    return _submit(go, async_op, result)


def all_reduce(tensor: torch.Tensor, group=None, op: str = "sum", algorithm: str = "ring",
               async_op: bool = False, out: torch.Tensor | None = None,
               stats: CollectiveCounts | None = None, **kw):
    """Reduce ``tensor`` over the group; every rank gets the result. In place unless
    ``out`` is given (then ``tensor`` is left alone). ``op``: sum, mean, max, min.
    Returns the result tensor, or a :class:`PendingCollective` when ``async_op``."""
    buf = _flat(tensor, "tensor")
    if out is not None:
        _flat(out, "out").copy_(buf)
        buf = out.view(-1)
    p = dist.get_world_size(group)
    after = (lambda: buf.div_(p)) if op == "mean" else None
    return _run("all_reduce", algorithm, buf.numel(), [(buf, None)], group, op, async_op,
                stats, out if out is not None else tensor, after=after, **kw)


def reduce_scatter(output: torch.Tensor | None, input: torch.Tensor, group=None,
                   op: str = "sum", algorithm: str = "ring", async_op: bool = False,
                   stats: CollectiveCounts | None = None, **kw):
    """Rank r gets chunk r (``chunk_sizes(n, p)[r]`` elements) of the reduced ``input``.

    ``output=None``: in place, ``input`` is overwritten with partial sums and the result
    is the view of chunk r inside it. Else ``input`` is copied first and left alone."""
    p, r = dist.get_world_size(group), dist.get_rank(group)
    n = input.numel()
    size, off = chunk_sizes(n, p)[r], offsets(chunk_sizes(n, p))[r]
    work = _flat(input, "input") if output is None else input.reshape(-1).clone()
    mine = work[off:off + size]
    if output is not None and output.numel() != size:
        raise ValueError(f"output has {output.numel()} elements; rank {r} of {p} gets "
                         f"{size} of {n}: allocate chunk_sizes(n, p)[rank]")

    def after():
        if op == "mean":
            mine.div_(p)
        if output is not None:
            output.view(-1).copy_(mine)

    return _run("reduce_scatter", algorithm, n, [(work, None)], group, op, async_op, stats,
                mine if output is None else output, after=after, **kw)


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, algorithm: str = "ring",
               async_op: bool = False, stats: CollectiveCounts | None = None, **kw):
    """Concatenate every rank's ``input`` (chunk r, ``chunk_sizes(n, p)[r]`` elements for
    n = output.numel()) into ``output`` on every rank. In place when ``input`` already is
    that view of ``output``."""
    p, r = dist.get_world_size(group), dist.get_rank(group)
    out = _flat(output, "output")
    n = out.numel()
    size, off = chunk_sizes(n, p)[r], offsets(chunk_sizes(n, p))[r]
    if input.numel() != size:
        raise ValueError(f"input has {input.numel()} elements; rank {r} of {p} contributes "
                         f"{size} of {n}: use chunk_sizes(output.numel(), p)[rank]")
    if input.data_ptr() != out[off:].data_ptr() or size == 0:
        out[off:off + size].copy_(input.reshape(-1))
    return _run("all_gather", algorithm, n, [(out, None)], group, "sum", async_op, stats,
                output, **kw)


def broadcast(tensor: torch.Tensor, src: int = 0, group=None, algorithm: str = "tree",
              async_op: bool = False, stats: CollectiveCounts | None = None, **kw):
    """Copy group rank ``src``'s ``tensor`` into everyone's, in place."""
    buf = _flat(tensor, "tensor")
    return _run("broadcast", algorithm, buf.numel(), [(buf, None)], group, "sum", async_op,
                stats, tensor, root=src, **kw)


def reduce(tensor: torch.Tensor, dst: int = 0, group=None, op: str = "sum",
           algorithm: str = "tree", async_op: bool = False, stats: CollectiveCounts | None = None,
           **kw):
    """Reduce into group rank ``dst``'s ``tensor``, in place. Other ranks' tensors are
    used as scratch and hold partial results afterwards."""
    buf = _flat(tensor, "tensor")
    p = dist.get_world_size(group)
    after = None
    if op == "mean" and dist.get_rank(group) == dst:
        def after():
            buf.div_(p)
    return _run("reduce", algorithm, buf.numel(), [(buf, None)], group, op, async_op, stats,
                tensor, root=dst, after=after, **kw)


def all_to_all(output: torch.Tensor, input: torch.Tensor, group=None,
               algorithm: str = "pairwise", async_op: bool = False,
               stats: CollectiveCounts | None = None, **kw):
    """Rank r sends chunk j of ``input`` (n elements, ``chunk_sizes(n, p)``) to rank j and
    receives p blocks of ``chunk_sizes(n, p)[r]`` elements into ``output``, block i from
    rank i (``all_to_all_single`` with those split sizes). Out of place."""
    p, r = dist.get_world_size(group), dist.get_rank(group)
    inp, out = _flat(input, "input"), _flat(output, "output")
    n = inp.numel()
    sizes = chunk_sizes(n, p)
    if out.numel() != p * sizes[r]:
        raise ValueError(f"output has {out.numel()} elements; rank {r} receives p x "
                         f"{sizes[r]} = {p * sizes[r]}: allocate p * chunk_sizes(n, p)[rank]")
    o = offsets(sizes)[r]
    out[r * sizes[r]:(r + 1) * sizes[r]].copy_(inp[o:o + sizes[r]])  # own block stays home
    return _run("all_to_all", algorithm, n, [(out, inp)], group, "sum", async_op, stats,
                output, **kw)


def shift(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False,
          stats: CollectiveCounts | None = None, **kw):
    """Rank r sends ``input`` to group rank r+1 and receives rank r-1's into ``output``
    (same shape), mod p: one round of :func:`paratrain.comm.direct.ring_shift`."""
    inp, out = _flat(input, "input"), _flat(output, "output")
    if out.numel() != inp.numel():
        raise ValueError(f"output has {out.numel()} elements, input {inp.numel()}; "
                         "a shift receives what it sends: allocate torch.empty_like(input)")
    sched = _ring_shift(dist.get_world_size(group), inp.numel())
    return _run("shift", "ring", inp.numel(), [(out, inp)], group, "sum", async_op, stats,
                output, sched=sched, **kw)


@lru_cache(maxsize=64)
def _ring_shift(p: int, n: int):
    return ring_shift(p, n)


def topk_all_reduce(tensor: torch.Tensor, k: int, group=None, async_op: bool = False,
                    stats: CollectiveCounts | None = None, **kw):
    """Sparse gradient exchange: each rank keeps its ``k`` largest-magnitude entries
    (values and int64 indices), all-gathers them (ring), and every rank scatter-adds them
    into a dense result (returned, ``tensor`` untouched). Nothing can be added on the way,
    so each rank sends (p-1) x k x (value + index bytes)."""
    p = dist.get_world_size(group)
    r = dist.get_rank(group)
    flat = _flat(tensor, "tensor")
    if not 0 <= k <= flat.numel():
        raise ValueError(f"k={k} outside 0..{flat.numel()}; keep at most numel entries")
    idx = flat.abs().topk(k).indices
    vals = torch.empty(p * k, dtype=flat.dtype)
    inds = torch.empty(p * k, dtype=torch.int64)
    vals[r * k:(r + 1) * k] = flat[idx]
    inds[r * k:(r + 1) * k] = idx
    dense = torch.zeros_like(flat)

    def after():
        dense.index_add_(0, inds, vals)

    res = _run("sparse_all_gather", "ring", k, [(vals, None), (inds, None)], group, "sum",
               async_op, stats, dense.view_as(tensor), after=after, **kw)
    return res
