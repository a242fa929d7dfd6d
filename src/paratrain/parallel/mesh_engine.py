"""MeshEngine: every multi-process run, any (pp, dp, tp) layout, one code path.

Transforms are applied to the plain, identically seeded model in one documented order
(docs/design.md; torchtitan's ``parallelize`` does the same):

1. **pipeline split** (:mod:`.pipeline.stage`): this rank keeps the chunks of its
   pipeline index (v of them when interleaved), balanced by compute; without a
   pipeline, one chunk holds the whole model;
2. **tensor / sequence** (:mod:`.tensor`, :mod:`.sequence`): each kept chunk is sharded
   over the tp group (each rank slices its shard from the full weights);
3. **context** (:mod:`.context`): with cp > 1 each chunk gets the RoPE rows of this cp
   rank's load-balanced positions and a ring / all-to-all attention core; batches are
   cut to the rank's tokens before the first stage;
4. **recompute** (:mod:`.recompute`): none / selective / full per block (after 3, so
   selective recompute reruns the CP attention);
5. **data / ZeRO** (:mod:`.data_axis`, one reducer chosen by :func:`.data_axis.data_axis`):
   DDP buckets, ZeRO-1/2, FSDP units or top-k
   compression over the dp x cp group (cp ranks hold the same parameters), on whatever
   parameters steps 1-4 left on this rank. With ep or etp > 1 (:mod:`.expert`, folded
   over the stage's ranks: :class:`paratrain.cost.ranks.Fold`) each MoE layer first
   keeps this ep rank's experts (this etp rank's slices of each) and routes through an
   all-to-all exchange; then the SP gradient hooks (not on experts the fold spreads over
   tp) and two reducers: dense parameters over dp x cp, expert parameters over edp.

Each step records on every parameter where it now sits (:mod:`.placement`: plain name,
global box, sharded and replicated mesh axes); the checkpoint, the global norm and the
memory report read that record.

Invariants:

- The loss is normalised once: every micro-batch's loss *sum* is divided by the global
  token count before backward; the pipeline, TP and DP only ever *sum* gradients.
- TP-sharded parameters are disjoint across tp ranks; TP-replicated ones (norm gains,
  ``tp`` among their placement's replicated axes) hold identical gradients without SP
  (but Qwen3's per-head q/k norms, each rank's sum over its own heads: all-reduced).
  With SP each rank's gradient is a partial sum over its sequence slice: a hook on the parameter
  all-reduces it over tp *before* it is accumulated (:func:`sum_partial_grads_over_tp`),
  so every data-parallel reducer — including ZeRO-2/3, which take gradients away during
  backward — sees the full gradient (Megatron-LM all-reduces them after backward; this
  is the same sum, d_model elements per norm and micro-batch).
- The global gradient norm is the sum of squares of each rank's *owned unique*
  gradient: a piece counts where its placement is canonical (index 0 on each replicated
  axis: norm gains on tp rank 0, data replicas on dp rank 0, or each dp rank's ZeRO
  shard; pipeline stages are disjoint); one all-reduce over the world
  (:meth:`.engine.Engine.clip_and_step` clips with it).
- ``all_sum`` counts each data replica's loss once: tp rank 0 of the last stage holds it
  (every cp rank holds the partial sum over its own tokens, so all of them count).

Tied embeddings with pp > 1 are refused: the tie would span two ranks (embedding on the
first stage, head on the last) and need an extra all-reduce of the two copies' grads;
with pp == 1 the tie is kept, also under TP (both are sharded by the same vocab rows).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from paratrain.config import TrainConfig
from paratrain.cost.ranks import experts_apart, virtual_stages
from paratrain.cost.schedule import build_schedule, owner_of
from paratrain.parallel.context import apply_context_parallel, cp_comm, local_tokens
from paratrain.parallel.data_axis import data_axis
from paratrain.parallel.engine import (
    CommStats,
    Engine,
    normalise_aux,
    normalised,
    token_loss_sum,
)
from paratrain.parallel.memory import ActivationMeter
from paratrain.parallel.mesh import Mesh
from paratrain.parallel.pipeline.runtime import PipelineRuntime
from paratrain.parallel.pipeline.stage import build_chunks
from paratrain.parallel.placement import mark, placement_of, record_plain
from paratrain.parallel.recompute import apply_recompute
from paratrain.parallel.tensor import apply_tensor_parallel, vocab_parallel_cross_entropy
from paratrain.plan import ParallelPlan


def sum_partial_grads_over_tp(chunks: list[nn.Module], group, sp: bool) -> None:
    """All-reduce over tp, as it is produced, the gradient of each replicated parameter
    whose tp ranks hold partial sums: every one under SP, else the per-head query and
    key norms (``tp_partial``, :func:`paratrain.parallel.tensor.shard_block`)."""
    def hook(g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        dist.all_reduce(g, group=group)
        return g

    for c in chunks:
        for p in c.parameters():
            if "tp" in placement_of(p).replicated and (sp or getattr(p, "tp_partial", False)):
                p.register_hook(hook)


METERED_CALLS = 4  # forward_backward calls whose saved activations are measured


class MeshEngine(Engine):
    """The engine of every multi-process run (see the module docstring)."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, plan: ParallelPlan,
                 device: torch.device) -> None:
        plan.check_runtime(model.cfg)
        self.plan, self.cfg, self.device = plan, cfg, device
        self.mcfg = model.cfg
        self.mesh = mesh = Mesh.from_plan(plan, device_type=device.type)
        v = virtual_stages(plan)
        self.pp_rank, self.tp_rank = mesh.index("pp"), mesh.index("tp")
        # 1. pipeline split; 2. tensor/sequence; 3. context; 4. recompute
        record_plain(model)
        chunks = build_chunks(model, plan.pp, v, self.pp_rank, plan.schedule)
        if plan.pp > 1:
            mark(nn.ModuleList(chunks).parameters(), sharded=("pp",))
        self.tp_states = [apply_tensor_parallel(c, mesh, plan) for c in chunks]
        self.cp = None
        if plan.cp > 1:
            self.cp = cp_comm(mesh, plan.cp_algorithm, plan.collectives)
            for c in chunks:
                apply_context_parallel(c, self.cp, self.mcfg.context)
        from paratrain.parallel.expert import apply_token_shards

        self.shards = apply_token_shards(chunks, mesh, plan)  # MoE routing under cp / sp
        for c in chunks:
            apply_recompute(c.blocks, plan.recompute)
        self.model = nn.ModuleList(chunks)
        # 5. data / ZeRO on the dp x cp group (mixed precision: parallel/precision.py);
        # with ep or etp > 1 the experts are split over ep x etp and reduced over edp
        # instead; the SP hooks then skip the experts the fold spreads over tp
        self.ep = None
        if experts_apart(plan):
            from paratrain.parallel import expert

            self.ep = expert.apply_expert_parallel(chunks, mesh, plan)
        if plan.tp > 1:
            sum_partial_grads_over_tp(chunks, mesh.group("tp"), plan.sp)
        if self.ep is not None:
            self.data = expert.SplitDataAxis(
                self._data_axis(chunks, "dpcp", select=lambda p: not expert.is_expert(p)),
                self._data_axis(chunks, "edp", select=expert.is_expert,
                                units_of=expert.expert_units))
        else:
            self.data = self._data_axis(chunks, "dpcp")
        self.opt = self.data.opt
        self.dp_rank, self.dp_size = mesh.index("dp"), mesh.size("dp")
        self._micro = 0
        self.micro_batches = plan.micro_batches if plan.pp == 1 else 1
        self.meter = ActivationMeter(self.model.parameters())
        self.dtype = next(self.model.parameters()).dtype
        self.schedule = self.runtime = None
        if plan.pp > 1:
            self.schedule = build_schedule(plan.schedule, plan.pp, plan.micro_batches, v)
            self.runtime = PipelineRuntime(
                chunks, self.schedule, self.pp_rank, lambda r: mesh.peer("pp", r),
                self._loss_sum, self._hidden_shape, self.dtype, device, self.meter,
                on_chunk_done=self.data.chunk_done)
        self.timelines: list[list] = []
        self.overheads: list[float] = []  # runtime seconds per compute action, per step
        self.act_peaks: list[int] = []

    def _data_axis(self, chunks, group: str, **kw):
        """The plan's reducer over the mesh group ``dpcp`` or ``edp``."""
        m = self.mesh
        if group == "dpcp" and self.plan.dp_replicate > 1:  # HSDP: shard in a replica
            return data_axis(chunks, m.group("dp_shard"), m.size("dp_shard"), self.plan,
                             self.cfg, m.index, ("dp_shard",),
                             replicate=m.group("dp_replicate"), **kw)
        names = ("dp", "cp") if group == "dpcp" else ("edp",)
        axes = tuple(a for a in names if m.size(a) > 1)
        return data_axis(chunks, m.group(group), m.size(group), self.plan, self.cfg,
                         m.index, axes, **kw)

    def axis_index(self, axis: str) -> int:
        return self.mesh.index(axis)

    def describe_layout(self) -> str:
        """The mesh, the stage split, the pipeline actions and the dp reducer (printed
        at start, rank 0)."""
        from paratrain.parallel.pipeline.stage import split_layers

        plan = self.plan
        lines = [self.mesh.layout()]
        S = plan.pp * (self.schedule.virtual_stages if self.schedule else 1)
        for k, (a, b) in enumerate(split_layers(self.mcfg, S)):
            ends = (" + embedding" if k == 0 else "") + (" + norm, head" if k == S - 1 else "")
            r, c = owner_of(plan.schedule, plan.pp, k)
            lines.append(f"  stage {k} (pp rank {r}, chunk {c}): "
                         f"blocks [{a}, {b}){ends}")
        if plan.cp > 1:
            lines.append(f"  context parallel {plan.cp} ({plan.cp_algorithm}, load-balanced: "
                         f"cp rank i holds chunks i and {2 * plan.cp - 1}-i of "
                         f"{2 * plan.cp}); gradients reduced over dp x cp")
        if self.ep is not None:
            m, j = self.mesh, self.mesh.index("ep")
            split = (f", each split over etp {plan.etp} (etp rank {m.index('etp')})"
                     if plan.etp > 1 else "")
            lines.append(f"  expert parallel {plan.ep}: ep rank {j} holds experts "
                         f"[{j * self.ep.local}, {(j + 1) * self.ep.local}) of "
                         f"{self.ep.experts} per MoE layer{split}; ep group "
                         f"{m.peer_ranks('ep')}, expert gradients reduced over "
                         f"{m.size('edp')} rank(s) {m.peer_ranks('edp')}")
        lines.append(f"  tensor parallel {plan.tp}, sequence parallel {plan.sp}, "
                     f"recompute {plan.recompute}, zero {plan.zero}, "
                     f"overlap {'on' if plan.overlap else 'off'}")
        if self.schedule is not None and plan.pp <= 8:
            lines.append(self.schedule.describe())
        lines.append(self.data.describe())
        return "\n".join(lines)

    # ---- pieces --------------------------------------------------------------------
    def _hidden_shape(self, b: int) -> tuple[int, int, int]:
        T = self.mcfg.context // self.plan.cp
        return (b, T // self.plan.tp if self.plan.sp else T, self.mcfg.d_model)

    def _local(self, x_BT, y_BT):
        """The batch on this device, cut to this cp rank's tokens; and the length the
        chunks see (T / cp)."""
        x_BT, y_BT = x_BT.to(self.device), y_BT.to(self.device)
        if self.cp is None:
            return x_BT, y_BT, x_BT.shape[1]
        if x_BT.shape[1] != self.mcfg.context:
            raise ValueError(f"context parallelism runs sequences of the full context "
                             f"{self.mcfg.context}, got {x_BT.shape[1]}")
        x_BT, y_BT = local_tokens(x_BT, self.cp), local_tokens(y_BT, self.cp)
        return x_BT, y_BT, x_BT.shape[1]

    def _loss_sum(self, logits_BTv: torch.Tensor, y_BT: torch.Tensor) -> torch.Tensor:
        st = self.tp_states[-1]
        if self.plan.tp > 1:
            return vocab_parallel_cross_entropy(logits_BTv, y_BT.to(self.device),
                                                st.vocab_start, st.vocab_end, st.edges)
        return token_loss_sum(logits_BTv, y_BT.to(self.device))

    # ---- forward / backward ----------------------------------------------------------
    def forward_backward(self, x_BT, y_BT, n_tokens_global: int) -> float:
        x_BT, y_BT, T = self._local(x_BT, y_BT)
        normalise_aux(self.model, n_tokens_global)
        self.meter.reset()
        # the saved-tensor hooks cost a Python call per tensor: meter the first calls only
        # (every step of a run has the same shapes, so the same peak)
        self.meter.active = len(self.act_peaks) < METERED_CALLS
        if self.runtime is None:
            self._micro += 1
            self.data.before_backward(self._micro >= self.micro_batches)
            with self.meter.recording(0):
                logits = self.model[0](x_BT, T)
                loss = self._loss_sum(logits, y_BT)
            normalised(loss, n_tokens_global).backward()
            self.meter.release(0)
            self.data.after_backward()
            self.act_peaks.append(self.meter.peak)
            return float(loss.detach())
        m = self.plan.micro_batches
        if x_BT.shape[0] % m:
            raise ValueError(f"local batch {x_BT.shape[0]} is not divisible by "
                             f"micro_batches={m}; use a global batch multiple of dp*{m}")
        loss = self.runtime.run(list(x_BT.chunk(m)), list(y_BT.chunk(m)), n_tokens_global, T)
        self.timelines.append(list(self.runtime.timeline))
        n = sum(1 for _ in self.runtime.timeline)
        self.overheads.append(self.runtime.overhead_s() / max(1, n))
        self.act_peaks.append(self.meter.peak)
        return loss

    @torch.no_grad()
    def eval_loss_sum(self, x_BT, y_BT) -> float:
        self.model.eval()
        counts = [(c.wire_bytes, c.payload_bytes, c.calls) for st in self.tp_states
                  for c in (st.blocks, st.edges)]  # evaluation traffic is not training's
        cp_counts = (self.cp.wire_bytes, self.cp.calls, self.cp.exposed_s) if self.cp \
            else None
        ep_counts = (self.ep.wire_bytes, self.ep.calls) if self.ep else None
        try:
            x_BT, y_BT, T = self._local(x_BT, y_BT)
            if self.runtime is None:
                logits = self.model[0](x_BT, T)
                return float(self._loss_sum(logits, y_BT))
            return self.runtime.forward_only(x_BT, y_BT, T)
        finally:
            self.model.train()
            if self.cp is not None:
                self.cp.wire_bytes, self.cp.calls, self.cp.exposed_s = cp_counts
            if self.ep is not None:
                self.ep.wire_bytes, self.ep.calls = ep_counts
            comms = [c for st in self.tp_states for c in (st.blocks, st.edges)]
            for c, (w, p, n) in zip(comms, counts, strict=True):
                c.wire_bytes, c.payload_bytes, c.calls = w, p, n

    # ---- communication and update --------------------------------------------------
    def reduce_gradients(self) -> CommStats:
        t0 = time.perf_counter()
        self._micro = 0
        if self.cp is not None:
            self.cp.step_marks.append(self.cp.exposed_s)
        stats = self.data.finish()
        if not self.data.communicates:
            stats.seconds = time.perf_counter() - t0
        return stats

    def all_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.tp_rank != 0:
            t.zero_()
        if dist.is_initialized():
            dist.all_reduce(t)
        return t.tolist()

    def global_sq(self) -> torch.Tensor:
        """The squares every rank owns, summed over the world (clipped by the base's
        :meth:`~.engine.Engine.clip_and_step`)."""
        # Pure data parallelism with replicated gradients: every rank already holds the
        # whole gradient, so its own sum is the global one (no collective on the step).
        alone = self.data.grads_replicated and self.mesh.world == self.dp_size
        sq = (self.data.local_sq(every_replica=True) if alone else self.data.local_sq())
        sq = sq.to(self.device)
        if dist.is_initialized() and not alone:
            dist.all_reduce(sq)
        return sq

    def scale_grads(self, coef: float) -> None:
        self.data.scale(coef)

    def update(self, lr: float) -> None:
        self.data.step(lr)

    def zero_grad(self) -> None:
        """Gradients are released by the reducer's step (kept as bucket views)."""

    # ---- checkpoints, memory, reports -------------------------------------------------
    def state_dict(self) -> dict:
        return self.data.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.data.load_state_dict(state)

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return self.data.state_tensors()

    def owned_state(self) -> list:
        return self.data.owned_state()

    def residuals(self) -> list[torch.Tensor]:
        return self.data.residuals()

    def sync_working(self) -> None:
        self.data.sync_working()

    @property
    def comm_buffer_peak(self) -> int:
        return self.data.comm_buffer_peak

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Name -> this rank's full (unsharded by ZeRO) value of each parameter it holds
        (collective under ZeRO-3). Names are the plain model's when there is one chunk."""
        by_id = self.data.full_parameters()
        prefix = "0." if len(self.model) == 1 else ""
        return {n.removeprefix(prefix): by_id[id(q)]
                for n, q in self.model.named_parameters()}

    def report(self) -> dict:
        return self.data.report()

    def activation_peak_bytes(self) -> int:
        """Peak bytes saved for backward on this rank over a step (in-flight micro-batches
        of the pipeline included), steps after the first."""
        return max(self.act_peaks[1:] or self.act_peaks or [0])

    def model_parallel_report(self) -> dict:
        from paratrain.parallel.mesh_report import model_parallel_report

        return model_parallel_report(self)
