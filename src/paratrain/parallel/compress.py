"""Top-k gradient compression with error feedback (``--compress topk:K``).

Public API (composable: any parameter list, any group)::

    tk = TopKCompressor(params, group, k=16, impl="native")
    stats = tk.reduce()        # after backward: p.grad <- sum over ranks of the sparse picks

The dp axis's top-k strategy (:class:`.dp_replicated.TopK`, chosen by
:func:`.data_axis.data_axis`) uses it for ``--zero 0 --compress topk:K``.

Each rank adds its carried residual to its gradient, keeps the ``n // k`` entries of
largest magnitude (values and int32 indices) and carries the rest into the next step
(error feedback: Seide et al. 2014; Stich et al. 2018, "Sparsified SGD with memory").
Different ranks pick different indices, so the picks cannot be summed on the way as a
ring all-reduce does: they are all-gathered, and every rank sends (p-1) x its payload,
which grows with p, against the dense ring's 2(p-1)/p x the dense gradient (docs/design.md).
Each step's payload, wire bytes and the dense ring's bytes are kept in ``history``.
"""

from __future__ import annotations

import logging
import time

import torch

from paratrain.cost.collectives import wire_bytes
from paratrain.parallel.ddp import DPCommStats
from paratrain.parallel.ddp_comm import GroupComm

log = logging.getLogger(__name__)


def parse_topk(spec: str) -> int:
    kind, _, k = spec.partition(":")
    if kind != "topk" or not k.isdigit() or int(k) < 1:
        raise ValueError(f"compress={spec!r} is not understood; use e.g. topk:16")
    return int(k)


class TopKCompressor:
    def __init__(self, params, group, k: int, impl: str = "native") -> None:
        if k < 1:
            raise ValueError(f"k={k} must be >= 1 (keep 1 value in k)")
        self.params = [p for p in params if p.requires_grad]
        self.comm = GroupComm(group, impl)
        self.k = k
        self.n = sum(p.numel() for p in self.params)
        self.keep = max(1, self.n // k)
        like = self.params[0]
        self.residual = torch.zeros(self.n, dtype=like.dtype, device=like.device)
        self.history: list[dict] = []

    @torch.no_grad()
    def reduce(self) -> DPCommStats:
        t0 = time.perf_counter()
        acc = torch.cat([p.grad.reshape(-1) if p.grad is not None
                         else torch.zeros(p.numel(), dtype=self.residual.dtype,
                                          device=self.residual.device)
                         for p in self.params])
        acc.add_(self.residual)
        idx = acc.abs().topk(self.keep, sorted=False).indices
        vals = acc[idx]
        self.residual.copy_(acc)
        self.residual[idx] = 0  # what was not sent is carried into the next step
        bytes0 = self.comm.bytes_sent
        hv, all_vals = self.comm.all_gather_equal(vals.contiguous(), async_op=True)
        hi, all_idx = self.comm.all_gather_equal(idx.to(torch.int32), async_op=True)
        hv.wait()
        hi.wait()
        dense = torch.zeros_like(acc)
        dense.index_add_(0, all_idx.reshape(-1).long(), all_vals.reshape(-1))
        off = 0
        for p in self.params:
            g = dense[off:off + p.numel()].view_as(p)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
            off += p.numel()
        payload = self.keep * (vals.element_size() + 4)
        wire = self.comm.bytes_sent - bytes0
        dense_wire = wire_bytes("all_reduce", "ring", self.comm.size, self.n * acc.element_size())
        self.history.append({"payload_bytes": payload, "wire_bytes": wire,
                             "dense_ring_wire_bytes": dense_wire})
        log.info("top-%d: payload %d B, wire %.0f B = %.2f x payload (dense ring %.0f B)",
                 self.k, payload, wire, wire / payload, dense_wire)
        return DPCommStats(seconds=time.perf_counter() - t0, payload_bytes=payload,
                           wire_bytes=wire)
