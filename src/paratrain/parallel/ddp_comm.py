"""The three collectives data parallelism needs, on a process group, native or ours.

Public API (used by :mod:`ddp`, :mod:`zero`, :mod:`fsdp`, :mod:`compress`; reusable on
any sub-group such as a mesh's ``dp`` axis)::

    comm = GroupComm(group, impl="native")      # or "ours" (paratrain.comm's executor)
    h = comm.all_reduce(flat, async_op=True)     # sum in place
    h = comm.reduce_scatter(out_S, in_N)         # out = my chunk of the sum; N = p * S
    h = comm.all_gather(out_N, in_S)             # out = every rank's chunk, in rank order
    h.wait()                                     # then the result is in place
    comm.bytes_sent                              # bytes this rank has sent so far

Invariants:

- Chunks are equal (``N == p * S``): callers pad their flat buffers to a multiple of
  ``p``. Rank ``r`` owns elements ``[r*S, (r+1)*S)``.
- ``bytes_sent`` is what this rank puts on the wire. With ``native`` it is the ring
  algorithm's count (2(p-1)/p x payload for all-reduce, (p-1)/p x the full vector for
  reduce-scatter and all-gather), because the backend does not report bytes; with
  ``ours`` it is counted transfer by transfer by paratrain's own executor. gloo has no
  reduce-scatter of its own: torch's ProcessGroupGloo all-reduces a clone of the whole
  buffer and copies the chunk out, so on gloo a native reduce-scatter puts an
  all-reduce's bytes on the wire, twice the count (NCCL's is a ring reduce-scatter).
- gloo cannot all-gather in place (the input must not alias the output): callers pass
  a separate input buffer.

The deprecated ``*_tensor`` names of torch's collectives are used only here, behind
:func:`_native_reduce_scatter` / :func:`_native_all_gather`, with the new ``*_single``
names preferred when present (STYLE: private or moving APIs behind one adapter).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from paratrain.cost.collectives import wire_bytes
from paratrain.parallel.handle import Handle

IMPLS = ("native", "ours")


def _native_reduce_scatter(out, inp, group, async_op):
    fn = getattr(dist, "reduce_scatter_single", None)
    if fn is not None:
        return fn(out, inp, group=group, async_op=async_op)
    return dist.reduce_scatter_tensor(out, inp, group=group, async_op=async_op)


def _native_all_gather(out, inp, group, async_op):
    fn = getattr(dist, "all_gather_single", None)
    if fn is not None:
        return fn(out, inp, group=group, async_op=async_op)
    return dist.all_gather_into_tensor(out, inp, group=group, async_op=async_op)


class GroupComm:
    """Collectives over ``group`` (None = the default group) with byte accounting."""

    def __init__(self, group=None, impl: str = "native") -> None:
        if impl not in IMPLS:
            raise ValueError(f"collectives={impl!r} is unknown; choose one of {', '.join(IMPLS)}")
        self.group = group
        self.impl = impl
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._native_bytes = 0.0
        self._ours = _load_ours(group) if impl == "ours" else None

    @property
    def bytes_sent(self) -> float:
        """Bytes this rank has sent so far (counted by ``ours``; ring formula for native)."""
        return self._ours.bytes_sent if self._ours is not None else self._native_bytes

    # ---- the three collectives ----------------------------------------------------
    def all_reduce(self, flat: torch.Tensor, async_op: bool = True) -> Handle:
        p, nbytes = self.size, flat.numel() * flat.element_size()
        if self._ours is not None:
            return self._ours.all_reduce(self, flat, async_op)
        self._native_bytes += wire_bytes("all_reduce", "ring", p, nbytes)
        return self._finish(dist.all_reduce(flat, group=self.group, async_op=async_op))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor,
                       async_op: bool = True) -> Handle:
        self._check_chunks(out, inp, "reduce_scatter")
        if self._ours is not None:
            return self._ours.reduce_scatter(self, out, inp, async_op)
        self._native_bytes += wire_bytes("reduce_scatter", "ring", self.size,
                                         inp.numel() * inp.element_size())
        return self._finish(_native_reduce_scatter(out, inp, self.group, async_op))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = True) -> Handle:
        self._check_chunks(inp, out, "all_gather")
        if self._ours is not None:
            return self._ours.all_gather(self, out, inp, async_op)
        self._native_bytes += wire_bytes("all_gather", "ring", self.size,
                                         out.numel() * out.element_size())
        return self._finish(_native_all_gather(out, inp, self.group, async_op))

    def all_gather_equal(self, inp: torch.Tensor, async_op: bool = False) -> tuple:
        """All-gather a vector of the same length from every rank: (handle, out_PN).

        Used for payloads that cannot be reduced on the way (top-k values and indices):
        each rank sends (p-1) x its payload.
        """
        out = torch.empty((self.size, inp.numel()), dtype=inp.dtype, device=inp.device)
        return self.all_gather(out.view(-1), inp.reshape(-1), async_op), out

    # ---- helpers ------------------------------------------------------------------
    def _check_chunks(self, small: torch.Tensor, big: torch.Tensor, op: str) -> None:
        if big.numel() != small.numel() * self.size:
            raise ValueError(f"{op}: {big.numel()} elements are not {self.size} x "
                             f"{small.numel()}; pad the flat buffer to a multiple of {self.size}")

    @staticmethod
    def _finish(work) -> Handle:
        return Handle(work)


def _load_ours(group):
    """paratrain.comm's hand-written ring collectives, adapted to :class:`GroupComm`."""
    from paratrain.parallel import ddp_comm_ours

    return ddp_comm_ours.OursAdapter(group)
