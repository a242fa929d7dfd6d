"""Expert parallelism: an MoE layer's experts split over the mesh's ``ep`` group.

The MoE layers fold over the ranks of a pipeline stage (Megatron-Core's "MoE parallel
folding", :mod:`.mesh`, :class:`paratrain.cost.ranks.Fold`): the dp x cp (x tp with SP)
ranks are regrouped as edp x ep x etp. The ep group is ep ranks that hold different
tokens (other sequences, other cp chunks, other SP slices); ep index j keeps experts
[j E/ep, (j+1) E/ep) of every MoE layer and drops the others. Each rank routes its own
tokens (the router is a dense parameter, replicated), sorts the assignments by expert
(:func:`paratrain.model.sort_assignments`) and hands them to :class:`ExpertExchange`,
which

1. exchanges split sizes: an all-to-all of the (ep, E/ep) counts, so each rank learns
   how many rows each source sends to each of its experts;
2. sends the rows with ``all_to_all_single`` and variable input / output splits (rows
   for rank r are contiguous: sorted by global expert, rank r's experts are adjacent);
3. regroups the received rows by local expert (stable, so source order inside an expert),
   runs every local expert (on zero rows if need be, so each has a gradient), with
   ``--etp`` each split over the etp group (:mod:`.expert_tp`);
4. sends the outputs back with the reverse all-to-all, in the order they came; the
   model combines them with the router weights.

Both all-to-alls are one autograd function whose backward is the reverse all-to-all of
the gradient (:class:`_AllToAll`). Without SP and with etp 1 the experts are replicated
over the tp ranks (:func:`paratrain.parallel.tensor.shard_block` leaves an MoE MLP
whole): each tp rank routes identical tokens and runs the same exchange with its own tp
index's ep group. The all-to-all is torch's ``all_to_all_single``, or with
``--collectives ours`` paratrain's pairwise exchange (p - 1 rounds of isend / irecv,
:meth:`ExpertExchange._pairwise`); both send the same bytes.

Sharded sequences (cp > 1, or sp: :class:`TokenShards`): each rank routes only the
tokens it holds (T/cp of each sequence, T/(cp tp) with SP, where the MoE MLP reads the
sequence-sharded residual), through the same exchange. The load-balancing loss needs each
sequence's per-expert counts, so :meth:`paratrain.model.MoE.route` sums them over the
shards (one small all-reduce per layer and micro-batch over cp, then over tp with SP) and
stays exact (docs/expert-parallel.md, "Context and sequence parallelism").

Gradients: dense parameters are reduced over dp x cp (the usual :class:`.data_axis.
DataAxis`), expert parameters (tagged ``expert = True``, ``ep`` among their placement's
sharded axes, ``etp`` too when split: :mod:`.placement`) by a second data axis over the
``edp`` group of the ranks holding the same expert pieces; :class:`SplitDataAxis`
drives the two as one. Where the fold spans tp the experts are no longer tp-replicated
(their SP gradient hook is not installed: the edp reducer sums them). Each expert
parameter's square enters the global norm once: on edp rank 0 (or its ZeRO shard's
owner). Under ZeRO-3 both reducers are FSDP: the dense one shards each block's other
parameters over dp, the expert one shards each MoE layer's local experts over edp, one
unit per layer (:func:`expert_units`), gathered around the experts' own forward and
backward, inside the block's.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.all_to_all import all_to_all
from paratrain.cost.layout import cp_positions
from paratrain.model import moe_modules
from paratrain.parallel.ddp import DPCommStats
from paratrain.parallel.placement import mark, unmark


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` in ``in_splits`` to the group's ranks; receives ``out_splits``.
    Backward: the gradient travels the reverse way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, ex):
        ctx.splits, ctx.ex = (out_splits, in_splits), ex
        return ex.all_to_all(x, out_splits, in_splits)

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return ctx.ex.all_to_all(g.contiguous(), in_splits, out_splits), None, None, None


class ExpertExchange:
    """The token dispatch and combine of every MoE layer of this rank (see the module
    docstring); counts the bytes it sends to other ranks."""

    def __init__(self, group, size: int, rank: int, experts: int,
                 collectives: str = "native") -> None:
        self.group, self.size, self.rank, self.experts = group, size, rank, experts
        self.local = experts // size
        self.ours = collectives == "ours"
        self.wire_bytes = 0  # rows (and split sizes) sent to other ranks, fwd + bwd
        self.calls = 0
        self.run_local = None  # (moe, rows, counts) -> outputs; None: moe.run_sorted
        self.seconds = 0.0  # in the exchanges (synchronous: all of it is exposed)

    def _pairwise(self, out: torch.Tensor, x: torch.Tensor, out_splits: list[int],
                  in_splits: list[int]) -> None:
        """paratrain's all-to-all (``--collectives ours``): the pairwise exchange over
        the group's point-to-point send / recv, every round posted before any is
        waited, straight into ``out``'s slices (:func:`paratrain.comm.all_to_all.all_to_all`)."""
        all_to_all(out, x, out_splits, in_splits, self.rank, self.group)

    def all_to_all(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int]
                   ) -> torch.Tensor:
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        t0 = time.perf_counter()
        if self.ours:
            self._pairwise(out, x.contiguous(), out_splits, in_splits)
        else:
            dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits,
                                   group=self.group)
        self.seconds += time.perf_counter() - t0
        row = math.prod(x.shape[1:]) * x.element_size()
        self.wire_bytes += (sum(in_splits) - in_splits[self.rank]) * row
        self.calls += 1
        return out

    def _run(self, moe: nn.Module, x_SD: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.run_local is None:
            return moe.run_sorted(x_SD, counts)
        return self.run_local(moe, x_SD, counts)

    def __call__(self, moe: nn.Module, x_SD: torch.Tensor, counts_E: torch.Tensor
                 ) -> torch.Tensor:
        ep, El = self.size, self.local
        if ep == 1:  # etp only: every expert is here
            return self._run(moe, x_SD, counts_E)
        send = counts_E.view(ep, El).contiguous()  # row r: my rows for rank r's experts
        recv = torch.empty_like(send)  # row r: rank r's rows for my experts
        t0 = time.perf_counter()
        if self.ours:
            self._pairwise(recv, send, [1] * ep, [1] * ep)
        else:
            dist.all_to_all_single(recv, send, group=self.group)
        self.seconds += time.perf_counter() - t0
        self.wire_bytes += (ep - 1) * El * send.element_size()
        in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        x_RD = _AllToAll.apply(x_SD, out_splits, in_splits, self)
        local = torch.arange(El, device=x_SD.device).repeat(ep)
        which = local.repeat_interleave(recv.flatten())  # local expert of each row
        perm = torch.argsort(which, stable=True)
        y_sorted = self._run(moe, x_RD[perm], recv.sum(0))
        y_RD = y_sorted[torch.argsort(perm)]
        return _AllToAll.apply(y_RD, in_splits, out_splits, self)


def is_expert(p: nn.Parameter) -> bool:
    return getattr(p, "expert", False)


def expert_units(chunk: nn.Module) -> list[list[nn.Module]]:
    """ZeRO-3 units of the expert reducer: each MoE layer's local experts, one unit,
    gathered at the first expert's forward and freed after the last's (every local
    expert runs each forward, in order: :meth:`paratrain.model.MoE.run_sorted`)."""
    return [list(m.experts) for m in moe_modules(chunk)]


def apply_expert_parallel(chunks: list[nn.Module], mesh, plan) -> ExpertExchange:
    """Keep this ep rank's experts in every MoE layer of ``chunks`` (with etp > 1 this
    etp rank's slices of each), tag their parameters ``expert``, and route through one
    :class:`ExpertExchange`. Where the fold spans the tp ranks (``fold_tp`` > 1) the
    experts are no longer tp-replicated."""
    from paratrain.parallel.expert_tp import EtpExchange, EtpStage, split_expert

    ep, j = mesh.size("ep"), mesh.index("ep")
    etp, t = mesh.size("etp"), mesh.index("etp")
    mods = [m for c in chunks for m in moe_modules(c)]
    E = mods[0].num_experts if mods else ep
    ex = ExpertExchange(mesh.group("ep"), ep, j, E,  # ep 1 (etp only): nothing to send
                        plan.collectives if ep > 1 else "native")
    if etp > 1:
        ex.run_local = EtpStage(EtpExchange(mesh.group("etp"), etp, t, plan.collectives,
                                            ex), plan.sp)
    lo, hi = j * ex.local, (j + 1) * ex.local
    for m in mods:
        m.experts = nn.ModuleList(list(m.experts)[lo:hi])
        for e in m.experts if etp > 1 else ():
            split_expert(e, etp, t)
        for p in m.experts.parameters():
            p.expert = True
        if all(hasattr(p, "placement") for p in m.experts.parameters()):
            mark(m.experts.parameters(), sharded=("ep",))  # the plain name says which
            if mesh.sizes.get("fold_tp", 1) > 1:
                unmark(m.experts.parameters(), replicated="tp")
        m.exchange = ex
    return ex


class TokenShards:
    """The ranks holding pieces of the same sequences: the cp group, and with SP the tp
    group (:attr:`paratrain.model.MoE.shards`). ``factor`` pieces per sequence; the
    ``owner`` (cp and tp index 0) records the group's MoE statistics. ``cp`` and ``tp``:
    (group, size, index) of each axis that cuts the sequence, None where it does not."""

    def __init__(self, cp: tuple | None, tp: tuple | None) -> None:
        self.cp, self.tp = cp, tp
        self.groups = [a[0] for a in (cp, tp) if a is not None]
        self.factor = math.prod(a[1] for a in (cp, tp) if a is not None)
        self.owner = all(a[2] == 0 for a in (cp, tp) if a is not None)
        self.calls = 0
        self.payload_bytes = 0  # router statistics and expert indices moved (per rank)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the shards in place: over each group in turn (cp x tp)."""
        for g in self.groups:
            dist.all_reduce(t, group=g)
            self._count(t)
        return t

    def _count(self, t: torch.Tensor) -> None:
        self.calls += 1
        self.payload_bytes += t.numel() * t.element_size()

    def _gather(self, x: torch.Tensor, axis: tuple) -> list[torch.Tensor]:
        parts = [torch.empty_like(x) for _ in range(axis[1])]
        dist.all_gather(parts, x.contiguous(), group=axis[0])
        self._count(x)
        return parts

    def whole(self, x_BtK: torch.Tensor) -> torch.Tensor:
        """This rank's (B, T / factor, ...) piece -> every sequence whole, (B, T, ...) in
        position order: SP pieces are consecutive slices of the cp rank's tokens (in
        its local order), cp ranks hold the load-balanced chunks (:func:`paratrain.cost.
        layout.cp_positions`)."""
        if self.tp is not None:
            x_BtK = torch.cat(self._gather(x_BtK, self.tp), dim=1)
        if self.cp is None:
            return x_BtK
        B, Tc, *rest = x_BtK.shape
        T = Tc * self.cp[1]
        out = x_BtK.new_empty((B, T, *rest))
        for i, part in enumerate(self._gather(x_BtK, self.cp)):
            out[:, self._cp_pos(T, i, x_BtK.device)] = part
        return out

    def mine(self, x_BT: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`whole` for this rank: its columns, in its order."""
        if self.cp is not None:
            x_BT = x_BT.index_select(1, self._cp_pos(x_BT.shape[1], self.cp[2], x_BT.device))
        if self.tp is not None:
            x_BT = x_BT.chunk(self.tp[1], dim=1)[self.tp[2]]
        return x_BT

    def _cp_pos(self, T: int, i: int, device) -> torch.Tensor:
        return torch.tensor(cp_positions(T, self.cp[1], i), device=device)


def apply_token_shards(chunks: list[nn.Module], mesh, plan) -> TokenShards | None:
    """With cp > 1 or sp, tell every MoE layer of ``chunks`` which ranks share its
    sequences (:class:`TokenShards`); None when each rank holds whole sequences."""
    if plan.cp == 1 and not plan.sp:
        return None
    cp = (mesh.group("cp"), plan.cp, mesh.index("cp")) if plan.cp > 1 else None
    tp = (mesh.group("tp"), plan.tp, mesh.index("tp")) if plan.sp else None
    shards = TokenShards(cp, tp)
    for c in chunks:
        for m in moe_modules(c):
            m.shards = shards
    return shards


class SplitDataAxis:
    """Two reducers driven as one: dense parameters over dp, experts over edp."""

    grads_replicated = False  # the expert gradients are not on every dp rank

    def __init__(self, dense, expert) -> None:
        self.dense, self.expert = dense, expert
        self.parts = (dense, expert)
        self.opt, self.communicates = dense.opt, dense.communicates or expert.communicates

    @property
    def steps_done(self) -> int:
        return self.dense.steps_done

    def before_backward(self, last: bool) -> None:
        for d in self.parts:
            d.before_backward(last)

    def after_backward(self) -> None:
        for d in self.parts:
            d.after_backward()

    def chunk_done(self, c: int) -> None:
        for d in self.parts:
            d.chunk_done(c)

    def finish(self) -> DPCommStats:
        a, b = (d.finish() for d in self.parts)
        return a.merge(b)

    @torch.no_grad()
    def local_sq(self) -> torch.Tensor:
        return self.dense.local_sq() + self.expert.local_sq()

    def scale(self, coef: float) -> None:
        for d in self.parts:
            d.scale(coef)

    def step(self, lr: float) -> None:
        for d in self.parts:
            d.step(lr)

    def owned_state(self) -> list:
        return self.dense.owned_state() + self.expert.owned_state()

    def residuals(self) -> list[torch.Tensor]:
        return self.dense.residuals() + self.expert.residuals()

    def sync_working(self) -> None:
        for d in self.parts:
            d.sync_working()

    def state_dict(self) -> dict:
        return {"dense": self.dense.state_dict(), "expert": self.expert.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.dense.load_state_dict(state["dense"])
        self.expert.load_state_dict(state["expert"])

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        out: dict[str, list[torch.Tensor]] = {}
        for d in self.parts:
            for k, v in d.state_tensors().items():
                out.setdefault(k, []).extend(v)
        return out

    @property
    def comm_buffer_peak(self) -> int:
        return self.dense.comm_buffer_peak + self.expert.comm_buffer_peak

    def describe(self) -> str:
        return (f"dense parameters: {self.dense.describe()}\n"
                f"expert parameters (over the expert-data-parallel group): "
                f"{self.expert.describe()}")

    def full_parameters(self) -> dict[int, torch.Tensor]:
        return {**self.dense.full_parameters(), **self.expert.full_parameters()}

    def report(self) -> dict:
        out = self.dense.report()
        out["expert"] = self.expert.report()
        return out
