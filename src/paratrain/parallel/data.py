"""Plain data parallelism: after backward, all-reduce (sum) every gradient.

Because the loss is normalised by the global token count (see engine.py), the sum over
ranks is the global mean gradient. This is the textbook version; bucketed, overlapped
all-reduce and ZeRO live in their own modules.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from paratrain.parallel.engine import CommStats, Engine


def ring_wire_bytes(payload_bytes: int, p: int) -> float:
    """Bytes each rank sends in a ring all-reduce: 2(p-1)/p x payload."""
    return 2.0 * (p - 1) / p * payload_bytes


class DataParallel(Engine):
    def __init__(self, model, cfg, device, group=None) -> None:
        super().__init__(model, cfg, device)
        self.group = group
        self.world = dist.get_world_size(group)
        self.dp_rank, self.dp_size = dist.get_rank(group), self.world
        self._broadcast_parameters()

    @torch.no_grad()
    def _broadcast_parameters(self) -> None:
        """Every replica starts from rank 0's weights (they are seeded alike anyway)."""
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            dist.broadcast(t.data, src=src, group=self.group)

    def reduce_gradients(self) -> CommStats:
        t0 = time.perf_counter()
        payload = 0
        for p in self.model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)
                payload += p.grad.numel() * p.grad.element_size()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return CommStats(time.perf_counter() - t0, payload, ring_wire_bytes(payload, self.world))

    def all_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.group)
        return t.tolist()
