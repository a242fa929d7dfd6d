"""MeshEngine: data x tensor (+ sequence) x pipeline parallelism on one device mesh.

Transforms are applied to the plain, identically seeded model in one documented order
(STYLE.md; torchtitan's ``parallelize`` does the same):

1. **pipeline split** (:mod:`.pipeline.stage`): this rank keeps the chunks of its
   pipeline index (v of them when interleaved), balanced by compute;
2. **tensor / sequence** (:mod:`.tensor`, :mod:`.sequence`): each kept chunk is sharded
   over the tp group (each rank slices its shard from the full weights);
3. **recompute** (:mod:`.recompute`): none / selective / full per block;
4. **data / ZeRO**: gradients are summed over the dp group — bucketed all-reduce
   (:func:`paratrain.parallel.ddp.BucketedAllReduce`, once after the pipeline), or
   ZeRO-1 (:class:`paratrain.parallel.zero.ZeroOptimizer` on the dp group, ``tp == 1``).

Invariants:

- The loss is normalised once: every micro-batch's loss *sum* is divided by the global
  token count before backward; the pipeline, TP and DP only ever *sum* gradients.
- TP-sharded parameters are disjoint across tp ranks; TP-replicated ones (norm gains,
  tagged ``tp_replicated``) hold identical gradients without SP, and partial sums over
  their sequence slice with SP (all-reduced over tp here, as Megatron-LM does).
- The global gradient norm is the sum of squares of each rank's *owned unique* shards:
  replicated parameters are counted on tp rank 0 only, data replicas on dp rank 0 only
  (or each dp rank's ZeRO slice), pipeline stages are disjoint; one all-reduce over the
  world.
- ``all_sum`` counts each data replica's loss once: tp rank 0 of the last stage holds it.

Tied embeddings with pp > 1 are refused: the tie would span two ranks (embedding on the
first stage, head on the last) and need an extra all-reduce of the two copies' grads;
with pp == 1 the tie is kept, also under TP (both are sharded by the same vocab rows).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from paratrain.config import TrainConfig
from paratrain.optim import set_lr
from paratrain.parallel.engine import CommStats, Engine, token_loss_sum
from paratrain.parallel.mesh import Mesh
from paratrain.parallel.pipeline.runtime import ActivationMeter, PipelineRuntime
from paratrain.parallel.pipeline.schedule import bubble_formula, build_schedule, simulate
from paratrain.parallel.pipeline.stage import build_chunks
from paratrain.parallel.recompute import apply_recompute
from paratrain.parallel.tensor import (
    apply_tensor_parallel,
    tp_wire_bytes_per_layer,
    vocab_parallel_cross_entropy,
)
from paratrain.plan import ParallelPlan


def check_supported(model: nn.Module, cfg: TrainConfig, plan: ParallelPlan) -> None:
    """Refuse, with one line each, what MeshEngine does not do (never ignore silently)."""
    m = model.cfg
    plan.check_runtime(m)  # tied + pp, zb-h1 + recompute, ZeRO stages
    if plan.compress is not None:
        raise ValueError(f"--compress {plan.compress} is data-parallel only; drop it with "
                         "--tp/--pp")
    if plan.cp != 1 or plan.ep != 1:
        raise ValueError(f"cp={plan.cp}, ep={plan.ep}: context/expert parallelism are not "
                         "implemented; use 1")


class MeshEngine(Engine):
    """Engine for any (dp, tp, pp) layout with SP, pipeline schedules and recompute."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, plan: ParallelPlan,
                 device: torch.device) -> None:
        check_supported(model, cfg, plan)
        self.plan = plan
        self.mcfg = model.cfg
        self.mesh = Mesh.from_plan(plan, device_type=device.type)
        mesh = self.mesh
        v = plan.virtual_stages if plan.schedule == "interleaved" else 1
        self.pp_rank = mesh.index("pp")
        # 1. pipeline split; 2. tensor/sequence; 3. recompute
        chunks = build_chunks(model, plan.pp, v, self.pp_rank)
        self.tp_states = [apply_tensor_parallel(c, mesh, plan) for c in chunks]
        for c in chunks:
            apply_recompute(c.blocks, plan.recompute)
        container = nn.ModuleList(chunks)
        super().__init__(container, cfg, device)
        # 4. data / ZeRO
        self.dp_rank, self.dp_size = mesh.index("dp"), mesh.size("dp")
        self.zo = self.buckets = None
        if plan.zero == 0 and self.dp_size > 1:
            from paratrain.parallel.ddp import BucketedAllReduce

            # flat buckets, reduced once after the whole pipeline (every micro-batch's
            # backward, deferred weight gradients included, has accumulated into them)
            self.buckets = BucketedAllReduce(list(container.parameters()), mesh.group("dp"),
                                             plan.bucket_mb, False, plan.collectives)
            self.buckets.set_sync(False)
        if plan.zero == 1 and self.dp_size > 1:
            from paratrain.parallel.zero import ZeroOptimizer

            no_clip = dataclasses.replace(cfg, grad_clip=0.0)  # we clip by the global norm
            self.zo = ZeroOptimizer(list(container.parameters()), mesh.group("dp"), 1,
                                    no_clip, plan.bucket_mb, False, plan.collectives)
            self.zo.set_sync(False)  # reduce-scatter once, after the whole pipeline
            self.opt = self.zo.adam.opt
        self.replicated = [p for p in container.parameters()
                           if getattr(p, "tp_replicated", False)]
        self.meter = ActivationMeter(container.parameters())
        self.dtype = next(container.parameters()).dtype
        self.schedule = None
        self.runtime = None
        if plan.pp > 1:
            self.schedule = build_schedule(plan.schedule, plan.pp, plan.micro_batches, v)
            self.runtime = PipelineRuntime(
                chunks, self.schedule, self.pp_rank, lambda r: mesh.peer("pp", r),
                self._loss_sum, self._hidden_shape, self.dtype, device, self.meter,
                self.autocast)
        self.timelines: list[list] = []
        self.overheads: list[float] = []  # runtime seconds per compute action, per step
        self.act_peaks: list[int] = []

    def describe_layout(self) -> str:
        """The mesh, the stage split and the pipeline actions (printed at start, rank 0)."""
        from paratrain.parallel.pipeline.stage import split_layers

        plan = self.plan
        lines = [self.mesh.layout()]
        S = plan.pp * (self.schedule.virtual_stages if self.schedule else 1)
        for k, (a, b) in enumerate(split_layers(self.mcfg, S)):
            ends = (" + embedding" if k == 0 else "") + (" + norm, head" if k == S - 1 else "")
            lines.append(f"  stage {k} (pp rank {k % plan.pp}, chunk {k // plan.pp}): "
                         f"blocks [{a}, {b}){ends}")
        lines.append(f"  tensor parallel {plan.tp}, sequence parallel {plan.sp}, "
                     f"recompute {plan.recompute}, zero {plan.zero}")
        if self.schedule is not None and plan.pp <= 8:
            lines.append(self.schedule.describe())
        return "\n".join(lines)

    # ---- pieces --------------------------------------------------------------------
    def _amp(self):
        """bf16 autocast from the fp32 weights under --dtype bfloat16 (as Engine does);
        hidden states between stages stay fp32 (the residual stream is fp32)."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast)

    def _hidden_shape(self, b: int) -> tuple[int, int, int]:
        T = self.mcfg.context
        return (b, T // self.plan.tp if self.plan.sp else T, self.mcfg.d_model)

    def _loss_sum(self, logits_BTv: torch.Tensor, y_BT: torch.Tensor) -> torch.Tensor:
        st = self.tp_states[-1]
        if self.plan.tp > 1:
            return vocab_parallel_cross_entropy(logits_BTv, y_BT.to(self.device),
                                                st.vocab_start, st.vocab_end, st.edges)
        return token_loss_sum(logits_BTv, y_BT.to(self.device))

    # ---- forward / backward ----------------------------------------------------------
    def forward_backward(self, x_BT, y_BT, n_tokens_global: int) -> float:
        x_BT, y_BT = x_BT.to(self.device), y_BT.to(self.device)
        T = x_BT.shape[1]
        self.meter.reset()
        if self.runtime is None:
            with self.meter.recording(0):
                with self._amp():
                    logits = self.model[0](x_BT, T)
                loss = self._loss_sum(logits, y_BT)
            (loss / n_tokens_global).backward()
            self.meter.release(0)
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
        try:
            x_BT, y_BT = x_BT.to(self.device), y_BT.to(self.device)
            if self.runtime is None:
                with self._amp():
                    logits = self.model[0](x_BT, x_BT.shape[1])
                return float(self._loss_sum(logits, y_BT))
            return self.runtime.forward_only(x_BT, y_BT, x_BT.shape[1])
        finally:
            self.model.train()
            comms = [c for st in self.tp_states for c in (st.blocks, st.edges)]
            for c, (w, p, n) in zip(comms, counts, strict=True):
                c.wire_bytes, c.payload_bytes, c.calls = w, p, n

    # ---- communication and update --------------------------------------------------
    def reduce_gradients(self) -> CommStats:
        t0 = time.perf_counter()
        if self.plan.sp:  # partial sums over the sequence slices
            for p in self.replicated:
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=self.mesh.group("tp"))
        payload = wire = 0
        if self.dp_size > 1:
            st = (self.zo or self.buckets).finish()
            payload, wire = st.payload_bytes, st.wire_bytes
        return CommStats(time.perf_counter() - t0, payload, wire)

    def all_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.mesh.index("tp") != 0:
            t.zero_()
        if dist.is_initialized():
            dist.all_reduce(t)
        return t.tolist()

    @torch.no_grad()
    def _global_norm(self) -> float:
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.zo is not None:  # each dp rank's owned slice; tp == 1 here
            for s in self.zo.adam.shards:
                sq += s.grad.double().pow(2).sum()
        elif self.dp_rank == 0:
            tp0 = self.mesh.index("tp") == 0
            for p in self.model.parameters():
                if p.grad is not None and (tp0 or not getattr(p, "tp_replicated", False)):
                    sq += p.grad.double().pow(2).sum()
        if dist.is_initialized():
            dist.all_reduce(sq)
        return math.sqrt(float(sq))

    @torch.no_grad()
    def clip_and_step(self, lr: float) -> float:
        norm = self._global_norm()
        coef = min(1.0, self.cfg.grad_clip / (norm + 1e-6)) if self.cfg.grad_clip > 0 else 1.0
        if self.zo is not None:
            for s in self.zo.adam.shards:
                s.grad.mul_(coef)
            self.zo.step(lr)
            return norm
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
        set_lr(self.opt, lr)
        self.opt.step()
        if self.buckets is not None:
            self.buckets.zero_grad()  # .grad are views into the flat buckets: keep them
        else:
            self.opt.zero_grad(set_to_none=True)
        return norm

    # ---- measurements --------------------------------------------------------------
    def activation_peak_bytes(self) -> int:
        """Peak bytes saved for backward on this rank over a step (in-flight micro-batches
        of the pipeline included), steps after the first."""
        return max(self.act_peaks[1:] or self.act_peaks or [0])

    def model_parallel_report(self) -> dict:
        """Measured beside predicted (collective over the world: every rank calls it).

        Bubble: per step, 1 - (sum of compute-action durations over the p stages of data
        replica 0, tp rank 0) / (p x the step's span from first start to last end), the
        median over steps after the first; beside the schedule's simulated and textbook
        bubble. Activations: the peak over a step of bytes saved for backward on each
        rank (in-flight micro-batches included), beside Korthikanti's per-layer formula.
        TP/SP: bytes each rank sent in the blocks' collectives, per layer and micro-batch.
        """
        plan, m = self.plan, self.mcfg
        out: dict = {"mesh": dict(self.mesh.sizes), "groups_built_by": self.mesh.source}
        world = self.mesh.world
        if self.runtime is not None:
            gathered = [None] * world
            mine = self.timelines if self.mesh.index("tp") == 0 and self.dp_rank == 0 else None
            dist.all_gather_object(gathered, mine)
            over = [None] * world
            dist.all_gather_object(over, statistics.median(self.overheads[1:] or self.overheads))
            stages = [gathered[_rank_for(self.mesh, r)] for r in range(plan.pp)]
            bubbles = [_bubble([st[i] for st in stages]) for i in range(len(stages[0]))]
            v = self.schedule.virtual_stages
            t_first = min(sp[3] for st in stages for sp in st[-1])
            out["pipeline"] = {
                "schedule": plan.schedule, "pp": plan.pp, "micro_batches": plan.micro_batches,
                "virtual_stages": v,
                "bubble_measured": statistics.median(bubbles[1:] or bubbles),
                "bubble_measured_per_step": bubbles,
                "bubble_simulated": simulate(self.schedule).bubble,
                "bubble_formula": bubble_formula(plan.schedule, plan.pp, plan.micro_batches, v),
                "runtime_overhead_s_per_action_per_rank": over,
                "timeline": [[[k, mb, c, a - t_first, b - t_first] for k, mb, c, a, b in st[-1]]
                             for st in stages],
            }
        peak = torch.tensor([float(max(self.act_peaks[1:] or self.act_peaks or [0]))],
                            dtype=torch.float64, device=self.device)
        peaks = [torch.zeros_like(peak) for _ in range(world)]
        if dist.is_initialized():
            dist.all_gather(peaks, peak)
        else:
            peaks = [peak]
        local_b = self.cfg.global_batch // self.dp_size
        b_mb = local_b // plan.micro_batches
        layers_on_rank = sum(len(c.blocks) for c in self.model)
        per_seq = _korthikanti(m, plan, self.dtype)
        from paratrain.parallel.memory import predicted_activations

        out["activation"] = {
            "recompute": plan.recompute,
            "measured_peak_bytes_per_rank": [int(t.item()) for t in peaks],
            "formula_bytes_per_layer_per_microbatch": per_seq * b_mb,
            "systems_model_busiest_rank_bytes": predicted_activations(m, plan, self.cfg),
            "layers_on_rank": layers_on_rank, "sequences_per_microbatch": b_mb,
        }
        if plan.tp > 1:
            # forward + backward passes of each block: one per call without a pipeline
            # (the loop accumulates micro-batches), m per step with one
            mbs = max(1, len(self.act_peaks)) * (plan.micro_batches if plan.pp > 1 else 1)
            st_blk = self.tp_states
            layers = max(1, layers_on_rank)
            out["tp"] = {
                "sp": plan.sp,
                "wire_bytes_per_layer_per_microbatch":
                    sum(st.blocks.wire_bytes for st in st_blk) / layers / mbs,
                "collectives_per_layer_per_microbatch":
                    sum(st.blocks.calls for st in st_blk) / layers / mbs,
                "formula_wire_bytes_per_layer_per_microbatch": tp_wire_bytes_per_layer(
                    b_mb, m.context, m.d_model, plan.tp, 2 if self.autocast else
                    _elem(self.dtype), _elem(self.dtype), plan.recompute),
            }
        return out


def format_model_parallel(rep: dict) -> str:
    """A few lines for the end of a run: bubble, activations, TP bytes, each measured
    beside its prediction."""
    lines = []
    if "pipeline" in rep:
        p = rep["pipeline"]
        over_ms = 1e3 * max(p["runtime_overhead_s_per_action_per_rank"])
        lines.append(f"pipeline {p['schedule']} p={p['pp']} m={p['micro_batches']} "
                     f"v={p['virtual_stages']}: bubble measured {p['bubble_measured']:.3f}, "
                     f"simulated {p['bubble_simulated']:.3f}, formula {p['bubble_formula']:.3f}; "
                     f"runtime overhead {over_ms:.3f} ms per action (neither computing nor "
                     "waiting)")
    a = rep["activation"]
    lines.append(f"activations (recompute {a['recompute']}): measured peak "
                 f"{max(a['measured_peak_bytes_per_rank']) / 1e6:.3f} MB on the busiest rank; "
                 f"systems model {a['systems_model_busiest_rank_bytes'] / 1e6:.3f} MB; "
                 f"Korthikanti {a['formula_bytes_per_layer_per_microbatch'] / 1e6:.3f} MB per "
                 "layer per micro-batch")
    if "tp" in rep:
        t = rep["tp"]
        lines.append(f"tensor parallel (sp={t['sp']}): "
                     f"{t['wire_bytes_per_layer_per_microbatch'] / 1e6:.4f} MB sent per layer "
                     f"per micro-batch in {t['collectives_per_layer_per_microbatch']:.0f} "
                     f"collectives (formula "
                     f"{t['formula_wire_bytes_per_layer_per_microbatch'] / 1e6:.4f} MB)")
    return "\n".join(lines)


def _elem(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def _rank_for(mesh: Mesh, pp_index: int) -> int:
    """Global rank of (pp_index, dp 0, tp 0): whose timeline represents that stage."""
    return pp_index * mesh.size("dp") * mesh.size("tp")


def _bubble(stage_spans: list[list]) -> float:
    """1 - busy / (p x span) over one step's compute spans (absolute times) per stage."""
    lo = min(a for st in stage_spans for _, _, _, a, _ in st)
    hi = max(b for st in stage_spans for _, _, _, _, b in st)
    busy = sum(b - a for st in stage_spans for _, _, _, a, b in st)
    return 1.0 - busy / (len(stage_spans) * (hi - lo)) if hi > lo else 0.0


def _korthikanti(m, plan: ParallelPlan, dtype: torch.dtype) -> float:
    """Korthikanti et al. 2022, table 2: activation bytes per layer per sequence (s, h,
    a heads, t = tp) at 16 bit, scaled to this run's element size. Their block has
    LayerNorm, GeLU MLP and dropout; ours RMSNorm, SwiGLU and none, so expect the same
    order of magnitude and the same trends (t, SP, recompute), not equality."""
    s, h, a, t = m.context, m.d_model, m.n_heads, plan.tp
    attn = 0 if plan.recompute == "selective" else 5 * a * s / h
    if plan.recompute == "full":
        per = 2 * s * h
    elif plan.sp:
        per = s * h / t * (34 + attn)
    else:
        per = s * h * (10 + 24 / t + attn / t)
    return per * _elem(dtype) / 2.0
