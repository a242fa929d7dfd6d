"""``--collectives ours``: :class:`ddp_comm.GroupComm` on paratrain's own ring collectives.

:mod:`paratrain.comm.api` runs each collective as a schedule of point-to-point transfers
on its communication thread (FIFO, the same order on every rank) and counts the bytes
each rank actually sends; :attr:`OursAdapter.bytes_sent` is that count, which is what the
wire-byte tests check against 2(p-1)/p and 3(p-1)/p x payload.
"""

from __future__ import annotations

import torch

from paratrain.parallel.handle import Handle


class OursAdapter:
    def __init__(self, group) -> None:
        try:
            from paratrain.comm import api
        except ImportError as e:  # pragma: no cover - depends on the comm package
            raise ValueError("--collectives ours needs paratrain.comm.api, which failed to "
                             f"import ({e}); use --collectives native") from e
        self.api = api
        self.stats = api.CollectiveCounts()

    @property
    def bytes_sent(self) -> float:
        return float(self.stats.bytes_sent())

    def _handle(self, res, async_op: bool) -> Handle:
        return Handle(res if async_op else None)

    def all_reduce(self, gc, flat: torch.Tensor, async_op: bool) -> Handle:
        return self._handle(self.api.all_reduce(flat, group=gc.group, async_op=async_op,
                                                stats=self.stats), async_op)

    def reduce_scatter(self, gc, out: torch.Tensor, inp: torch.Tensor, async_op: bool) -> Handle:
        return self._handle(self.api.reduce_scatter(out, inp, group=gc.group,
                                                    async_op=async_op, stats=self.stats),
                            async_op)

    def all_gather(self, gc, out: torch.Tensor, inp: torch.Tensor, async_op: bool) -> Handle:
        return self._handle(self.api.all_gather(out, inp, group=gc.group, async_op=async_op,
                                                stats=self.stats), async_op)
