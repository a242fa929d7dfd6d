"""The tensor-parallel region's entry and exit, with and without sequence parallelism.

Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", section 4.2.2): outside the tensor-parallel regions (the norms,
the residual additions, dropout if any) the activations are identical on every tp rank,
so each rank can keep only its 1/t slice along the sequence. The all-reduce that ends a
region becomes a reduce-scatter along T (each rank keeps its slice of the sum) and the
entry of the next region becomes an all-gather along T. An all-reduce *is* a
reduce-scatter followed by an all-gather, so the bytes on the wire are the same and the
activations outside the regions shrink t-fold.

Collectives run over the tp group held by a :class:`TPComm`, which also counts the bytes
each rank sends, per call, so runs can report TP/SP bytes per layer. Gathers and
scatters act on dim 0 of the tensor, so (B, T, D) activations are transposed to
(T, B, D) around them (Megatron keeps activations in [s, b, h] for this reason).

Newer torch renames ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to
``all_gather_single`` / ``reduce_scatter_single``; :func:`_gather0` and :func:`_scatter0`
are the one adapter that picks whichever exists.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from paratrain.cost.collectives import ring_share


def _gather0(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _scatter0(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)


@dataclass(eq=False)
class TPComm:
    """The tp group of this rank, whether SP is on, and the bytes sent so far."""

    group: object
    size: int
    rank: int
    sp: bool = False
    wire_bytes: float = 0.0  # bytes this rank sent (ring algorithms' counts)
    payload_bytes: float = 0.0  # bytes of the full tensors reduced or gathered
    calls: int = 0
    seconds: float = 0.0  # in the collectives (synchronous: all of it is exposed)

    def _count(self, full_bytes: float, wire_factor: float) -> None:
        self.calls += 1
        self.payload_bytes += full_bytes
        self.wire_bytes += wire_factor * ring_share(self.size) * full_bytes

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        self._count(t.numel() * t.element_size(), 2.0)
        t0 = time.perf_counter()
        dist.all_reduce(t, op=op, group=self.group)
        self.seconds += time.perf_counter() - t0
        return t

    def gather_T(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """(B, T/t, ...) on each rank -> (B, T, ...) on every rank, rank order along T."""
        x_TBD = x_BTD.transpose(0, 1).contiguous()
        out = x_TBD.new_empty((x_TBD.shape[0] * self.size,) + tuple(x_TBD.shape[1:]))
        self._count(out.numel() * out.element_size(), 1.0)
        t0 = time.perf_counter()
        _gather0(out, x_TBD, self.group)
        self.seconds += time.perf_counter() - t0
        # contiguous once here: a (B, T, D) view of the (T, B, D) buffer would make each
        # column-parallel linear (wq, wk, wv; w_gate, w_up) copy it and keep its own copy
        # for backward, 3 + 2 full-T tensors per layer where one each is enough
        return out.transpose(0, 1).contiguous()

    def scatter_T(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) partial sums on each rank -> (B, T/t, ...) slices of the sum."""
        T = x_BTD.shape[1]
        if T % self.size:
            raise ValueError(f"sequence length {T} is not divisible by tp={self.size} for "
                             "sequence parallelism; use a context that is a multiple of tp")
        x_TBD = x_BTD.transpose(0, 1).contiguous()
        out = x_TBD.new_empty((T // self.size,) + tuple(x_TBD.shape[1:]))
        self._count(x_TBD.numel() * x_TBD.element_size(), 1.0)
        t0 = time.perf_counter()
        _scatter0(out, x_TBD, self.group)
        self.seconds += time.perf_counter() - t0
        return out.transpose(0, 1)

    def split_T(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """This rank's slice along T of a replicated tensor (no communication)."""
        return x_BTD.chunk(self.size, dim=1)[self.rank]


class CopyToRegion(torch.autograd.Function):
    """f without SP: identity forward, all-reduce of the input gradient backward (over
    any ``comm`` with ``all_reduce``: the tp group's, or the etp group's in
    :mod:`paratrain.parallel.expert_tp`)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.comm.all_reduce(g.contiguous().clone()), None


class ReduceFromRegion(torch.autograd.Function):
    """g without SP: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, comm):
        return comm.all_reduce(x.contiguous().clone())

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFromSeq(torch.autograd.Function):
    """f with SP: all-gather along T forward, reduce-scatter along T backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return comm.gather_T(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.comm.scatter_T(g), None


class _ScatterToSeq(torch.autograd.Function):
    """g with SP: reduce-scatter along T forward, all-gather along T backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return comm.scatter_T(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.comm.gather_T(g), None


def enter_region(x_BTD: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """Replicated (or, with SP, sequence-sharded) -> the full input of column-parallel."""
    if comm.size == 1:
        return x_BTD
    return _GatherFromSeq.apply(x_BTD, comm) if comm.sp else CopyToRegion.apply(x_BTD, comm)


def exit_region(y_BTD: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """Partial sums of row-parallel -> the sum (replicated, or with SP sharded along T)."""
    if comm.size == 1:
        return y_BTD
    return _ScatterToSeq.apply(y_BTD, comm) if comm.sp else ReduceFromRegion.apply(y_BTD, comm)
