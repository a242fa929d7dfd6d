"""Expert tensor parallelism (``--etp``): each expert's matrices split over the etp group,
as the dense SwiGLU is under tp (:mod:`.tensor`): ``w_gate`` and ``w_up`` by rows (the
hidden units), ``w_down`` by columns, so every etp rank computes a partial sum of each
row's output and the sum over the etp ranks is the expert's output.

The rows reach an etp group after the ep exchange (:class:`.expert.ExpertExchange`),
sorted by local expert on each rank. Two cases (:class:`EtpStage`):

- **SP** (each etp rank holds its own tokens): the ranks' rows and per-expert counts
  are all-gathered over etp, each rank runs its slices on all of them (regrouped by
  local expert), and the partial outputs are reduce-scattered back, each rank receiving
  the sum for its own rows (Megatron-Core's all-gather / reduce-scatter around the
  experts). Both are all-to-alls with variable splits (the exchange's own
  :meth:`~.expert.ExpertExchange.all_to_all`), so the backward is the reverse of each.
- **no SP** (etp = tp: every etp rank holds the same tokens and rows): the region entry
  and exit of :mod:`.sequence`, identity forward / all-reduce backward before the
  experts and all-reduce forward / identity backward after them.

Every byte is counted on the layer's :class:`~.expert.ExpertExchange` (the run's
``ep_wire_bytes``: all the MoE dispatch sends); :func:`paratrain.cost.ep_bytes.
etp_wire_bytes` is the same count from the configs.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from paratrain.cost.collectives import ring_share
from paratrain.parallel.expert import ExpertExchange, _AllToAll
from paratrain.parallel.placement import narrowed
from paratrain.parallel.sequence import CopyToRegion, ReduceFromRegion


class EtpExchange(ExpertExchange):
    """The exchange over the etp group; its bytes, calls and seconds count as
    ``owner``'s (the ep exchange of the same layers)."""

    def __init__(self, group, size: int, rank: int, collectives: str,
                 owner: ExpertExchange) -> None:
        super().__init__(group, size, rank, size, collectives)
        self.owner = owner

    def all_to_all(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int]
                   ) -> torch.Tensor:
        w, s = self.wire_bytes, self.seconds
        out = super().all_to_all(x, out_splits, in_splits)
        self._credit(self.wire_bytes - w, self.seconds - s)
        return out

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over etp in place (ring: 2 (p-1)/p of its bytes sent)."""
        t0 = time.perf_counter()
        dist.all_reduce(t, group=self.group)
        self._credit(2 * ring_share(self.size) * t.numel() * t.element_size(),
                     time.perf_counter() - t0)
        return t

    def _credit(self, wire: float, seconds: float) -> None:
        self.owner.wire_bytes += wire
        self.owner.seconds += seconds
        self.owner.calls += 1


class EtpStage:
    """Runs a layer's local experts on rows sorted by local expert (``counts_El`` rows
    each), their matrices split over etp (module docstring): a drop-in for
    :meth:`paratrain.model.MoE.run_sorted`."""

    def __init__(self, ex: EtpExchange, sp: bool) -> None:
        self.ex, self.sp = ex, sp

    def __call__(self, moe: nn.Module, x_RD: torch.Tensor, counts_El: torch.Tensor
                 ) -> torch.Tensor:
        if not self.sp:
            y = moe.run_sorted(CopyToRegion.apply(x_RD, self.ex), counts_El)
            return ReduceFromRegion.apply(y, self.ex)
        t, El = self.ex.size, counts_El.numel()
        counts = self.ex.all_to_all(counts_El.repeat(t), [El] * t, [El] * t).view(t, El)
        n = counts.sum(1).tolist()  # rows of each etp rank
        mine = [n[self.ex.rank]] * t
        x_all = _AllToAll.apply(x_RD.repeat(t, 1), n, mine, self.ex)
        which = torch.arange(El, device=x_RD.device).repeat(t).repeat_interleave(
            counts.flatten())  # local expert of each gathered row
        perm = torch.argsort(which, stable=True)
        y_all = moe.run_sorted(x_all[perm], counts.sum(0))[torch.argsort(perm)]
        y_parts = _AllToAll.apply(y_all, mine, n, self.ex)  # my rows' partial sums
        return y_parts.view(t, n[self.ex.rank], x_RD.shape[1]).sum(0)  # 0 rows too


@torch.no_grad()
def split_expert(expert: nn.Module, etp: int, r: int) -> None:
    """Keep etp rank ``r``'s slices of an :class:`paratrain.model.moe.Expert`: rows of
    gate and up, the same columns of down (``torch.chunk``'s pieces, placements
    narrowed to them)."""
    for name, dim in (("w_gate", 0), ("w_up", 0), ("w_down", 1)):
        old = getattr(expert, name).weight
        piece = old.detach().chunk(etp, dim=dim)[r].clone()
        lin = nn.Linear(piece.shape[1], piece.shape[0], bias=False, device=piece.device,
                        dtype=piece.dtype)
        lin.weight = nn.Parameter(piece)
        if hasattr(old, "placement"):
            narrowed(old, lin.weight, dim, r * piece.shape[dim], "etp")
        setattr(expert, name, lin)
