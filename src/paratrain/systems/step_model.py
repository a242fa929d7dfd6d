"""The step-time model: per-GEMM compute, memory-bound work, engine-aware communication.

Where :mod:`paratrain.systems.step_time` is docs/design.md's reference (one eta, every
collective at the slowest link, reproducing its worked example), this model prices a step
the way the step runs on the busiest pipeline rank (docs/systems-model.md):

1. one micro-batch's block: each GEMM from its shape, attention, memory-bound work and
   kernel launches (:mod:`paratrain.systems.layer_cost`); the stage holds the runtime's
   split of blocks (:func:`paratrain.cost.stages.rank_blocks`), the last one the head;
2. per micro-batch, what tensor, context and expert parallelism leave exposed: each
   axis' time (:mod:`paratrain.systems.comm_time`) less the engine's overlap of it
   (:mod:`paratrain.systems.overlap`), a ring's K/V passes hidden only under the block's
   attention;
3. the pipeline bubble (the schedule's closed form) and its point-to-point sends;
4. data-parallel sync by the engine's algorithm (:mod:`paratrain.systems.dp_sync`):
   bucketed rings under the backward, or ZeRO-3/FSDP gathers block by block;
5. the optimizer step (memory-bound over this rank's shard of the states).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache

from paratrain.cost.groups import split_batch, strides
from paratrain.cost.hardware import Hardware
from paratrain.cost.memory import params_per_gpu
from paratrain.cost.moe_layout import expert_data_ranks
from paratrain.cost.ranks import virtual_stages
from paratrain.cost.schedule import V_SHAPED, bubble_over_compute
from paratrain.cost.shapes import as_shape
from paratrain.cost.stages import rank_blocks, stage_costs
from paratrain.plan import ParallelPlan
from paratrain.systems import comm_time as ct
from paratrain.systems.dp_sync import dp_sync, taxed
from paratrain.systems.gemm import chip_of
from paratrain.systems.layer_cost import GEMM_CLASSES, block_cost, fp8_recipe_name, head_cost
from paratrain.systems.moe_step import moe_comm_s
from paratrain.systems.overlap import Engine, engine
from paratrain.systems.recompute_modules import rerun_classes
from paratrain.systems.step_params import StepParams
from paratrain.systems.step_time import recompute_flops_per_token

AXES = ("tp", "cp", "ep", "pp", "dp")
OPTIMIZER_BYTES_PER_PARAM = 28.0  # Adam: read grad, master, m, v; write master, m, v, bf16


@dataclass(frozen=True)
class Breakdown:
    """One step on the busiest rank, in seconds, with what each part comes from."""

    gemm: dict  # GEMM class -> seconds per step (recompute included)
    memory_s: float  # memory-bound element-wise work
    overhead_s: float  # kernel launches
    head_s: float  # logits + loss on the last stage
    comm: dict  # axis -> seconds of communication per step
    exposed: dict  # axis -> seconds of it not hidden
    bubble_s: float
    optimizer_s: float
    model_flops: float
    hardware_flops: float
    gpus: int
    peak_flops: float
    engine: str
    blocks: int  # blocks on the busiest rank
    micro_batches: int
    notes: list = field(default_factory=list)
    accum_s: float = 0.0  # gradient accumulation outside the GEMMs (Engine.hp_grad_bytes)
    mtp_blocks: int = 0  # of ``blocks``, multi-token prediction's (ModelShape.mtp_layers)

    @property
    def compute_s(self) -> float:
        return (sum(self.gemm.values()) + self.memory_s + self.overhead_s + self.head_s
                + self.accum_s)

    @property
    def exposed_comm_s(self) -> float:
        return sum(self.exposed.values())

    @property
    def comm_s(self) -> float:
        return sum(self.comm.values())

    @property
    def step_s(self) -> float:
        return self.compute_s + self.bubble_s + self.exposed_comm_s + self.optimizer_s

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.step_s * self.gpus * self.peak_flops)

    @property
    def hfu(self) -> float:
        return self.hardware_flops / (self.step_s * self.gpus * self.peak_flops)

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops / self.step_s / self.gpus / 1e12

    # names shared with StepTime so search and its explanation read either
    @property
    def dp_comm_s(self) -> float:
        return self.comm["dp"]

    @property
    def dp_exposed_s(self) -> float:
        return self.exposed["dp"]

    @property
    def tp_comm_s(self) -> float:
        return self.comm["tp"]

    @property
    def cp_exposed_s(self) -> float:
        return self.exposed["cp"]

    def as_dict(self) -> dict:
        return {"gemm_s": dict(self.gemm), "memory_bound_s": self.memory_s,
                "kernel_overhead_s": self.overhead_s, "head_s": self.head_s,
                "grad_accumulation_s": self.accum_s,
                "compute_s": self.compute_s, "comm_s": dict(self.comm),
                "exposed_s": dict(self.exposed), "bubble_s": self.bubble_s,
                "optimizer_s": self.optimizer_s, "step_s": self.step_s, "mfu": self.mfu,
                "hfu": self.hfu, "engine": self.engine, "blocks_on_busiest_rank": self.blocks,
                "micro_batches": self.micro_batches}


@lru_cache(maxsize=4096)
def _params_per_gpu(m, tp: int, pp: int, ep: int, etp: int = 1):
    return params_per_gpu(m, ParallelPlan(dp=ep, tp=tp, pp=pp, ep=ep, etp=etp))


def full_rerun_share(cls: str, up_matrices: int, dead_tail: bool) -> float:
    """The share of a GEMM class's forward that full recomputation reruns: all of it, or
    with ``dead_tail`` (:class:`paratrain.systems.overlap.Engine`: XLA's remat) none of
    the attention output projection and not the MLP's (or experts') down projection,
    whose outputs the backward never reads: one of ``up_matrices`` + 1 equal matrices
    (:attr:`paratrain.cost.shapes.ModelShape.mlp_up_matrices`)."""
    if not dead_tail:
        return 1.0
    if cls == "out":
        return 0.0
    if cls in ("mlp", "experts"):
        return up_matrices / (up_matrices + 1)
    return 1.0


@lru_cache(maxsize=8192)
def _block_summary(m, M: int, seq_len: int, tp: int, cp: int, sp: bool, ep: int, hw, chip,
                   rates, kernel: str, recompute: str, selective: float = 0.0,
                   etp: int = 1, dispatcher: str = "alltoall", dead_tail: bool = False,
                   rerun: tuple[str, ...] = ()) -> dict:
    """One average block (dense and MoE blocks weighted by their counts) for a
    micro-batch: forward and backward seconds (recomputation in backward), per GEMM class,
    memory-bound and launch seconds, and the attention core's forward. ``selective``: the
    share of the other forward GEMMs (and all the element-wise work) that selective
    recomputation reruns (the engine's); ``dead_tail``: full recomputation skips the
    GEMMs whose outputs the backward never reads (:func:`full_rerun_share`); ``rerun``:
    the recompute modules a run names, which rerun their GEMM classes' forward and no
    other (:mod:`paratrain.systems.recompute_modules`)."""
    args = (M, seq_len, tp, cp, sp, ep, hw, chip, rates)
    dense = block_cost(m, *args, moe=False, attention=kernel)
    moe = block_cost(m, *args, moe=True, attention=kernel, etp=etp,
                     dispatcher=dispatcher) if m.is_moe else None
    frac = m.moe_layers / m.n_layers if m.is_moe else 0.0

    def avg(get) -> float:
        return get(dense) * (1 - frac) + (get(moe) * frac if moe else 0.0)

    sel = recompute == "selective" and not rerun
    # the classes rerun whole (full recompute, or named modules); None: selective's shares
    named = None if sel else _reruns(recompute, rerun)
    attn_f = avg(lambda b: b.attn_fwd_s)
    fwd = avg(lambda b: b.fwd_s)
    gemm, again, fwd_gemm = {}, 0.0, 0.0
    for cls in GEMM_CLASSES:
        f = avg(lambda b, c=cls: b.fwd.get(c, 0.0))
        b_ = avg(lambda b, c=cls: b.bwd.get(c, 0.0))
        share = (1.0 if cls == "attention" else selective) if sel else \
            full_rerun_share(cls, m.mlp_up_matrices, dead_tail) if cls in named else 0.0
        b_ += share * f
        again += share * f
        fwd_gemm += f
        if f + b_:
            gemm[cls] = f + b_
    # element-wise work (and its launches) rerun: selective's share, all of it under full
    # recompute, and for named modules the share of the forward's GEMM time they rerun
    # (the element-wise work goes with the GEMMs it feeds: mla_up_proj reruns its norms,
    # not the experts' activation and permutation)
    rc = selective if sel else (again / fwd_gemm if rerun and fwd_gemm else float(bool(named)))
    mem_again = rc * avg(lambda b: b.mem_fwd_s)
    bwd = avg(lambda b: b.bwd_s) + again + mem_again + rc * avg(lambda b: b.overhead_s) / 3
    return {"fwd": fwd, "bwd": bwd, "attn_f": attn_f, "gemm": gemm,
            "mem": avg(lambda b: b.mem_fwd_s + b.mem_bwd_s) + mem_again,
            "overhead": avg(lambda b: b.overhead_s * (1 + rc / 3))}


@lru_cache(maxsize=1024)
def _flops_per_token(m, seq_len: int, recompute: str) -> tuple[float, float]:
    """(model FLOPs, extra hardware FLOPs of recomputation) per token."""
    return m.flops_per_token(seq_len), recompute_flops_per_token(m, recompute, seq_len)


def _busiest(m, seq_len: int, pp: int, v: int, block_s: float, head_s: float,
             v_shape: bool = False) -> tuple[int, bool]:
    """(blocks, holds the head) of the slowest pipeline rank under the runtime's split
    (the head is on the last rank, or on rank 0 with a V placement); the head's rank also
    runs a block per multi-token-prediction depth (``ModelShape.mtp_layers``)."""
    block_flops, _, head_flops = stage_costs(m, seq_len)
    per_rank = list(rank_blocks(m.n_layers, pp, v, block_flops, head_flops, v_shape))
    head_blocks = per_rank.pop(0 if v_shape else -1) + m.mtp_layers
    rest = max(per_rank, default=0)
    return (head_blocks, True) if head_blocks * block_s + head_s >= rest * block_s \
        else (rest, False)


def _reruns(recompute: str, rerun: tuple[str, ...]) -> frozenset[str]:
    """The GEMM classes a backward reruns: the named recompute modules' (``rerun``), else
    the plan's ``recompute`` (full: all; selective: the attention core, beside the
    engine's share of the rest, :func:`_block_summary`)."""
    if rerun:
        return rerun_classes(rerun)
    return {"full": frozenset(GEMM_CLASSES), "selective": frozenset({"attention"})}.get(
        recompute, frozenset())


def _overlapped(t: float, share: float, window: float) -> float:
    """Exposed seconds of a per-block transfer of ``t`` of which the engine overlaps
    ``share`` (:class:`paratrain.systems.overlap.Engine`) under a compute ``window``:
    overlap hides at most the window, so a transfer longer than its compute shows the
    excess whatever the engine's share."""
    return max(t * (1 - share), t - window)


def predict_step(model, plan: ParallelPlan, hw: Hardware, tokens_per_step: int,
                 seq_len: int, params: StepParams | None = None,
                 engine_name: str | Engine | None = None, attention: str | None = None,
                 shard_group: int | None = None, fp8: bool | str = False,
                 rerun: tuple[str, ...] = ()) -> Breakdown:
    """Price one optimizer step of ``plan`` (see the module docstring); ``attention``
    (flash or eager) defaults to the engine's kernel; ``shard_group`` (hybrid sharding,
    HSDP / multi-slice FSDP): ZeRO runs over that many data ranks, replicas all-reduce;
    default: the plan's dp x cp / ``dp_replicate``, where the runtime shards; ``fp8``:
    the linear layers' GEMMs in FP8, their operands cast first (:mod:`paratrain.systems.
    layer_cost`, which says what stays 16-bit; MFU stays relative to the BF16 peak):
    True for per-tensor scaling, or a scaling recipe's name (``layer_cost.FP8_RECIPES``);
    ``rerun``: the recompute modules a run names (:func:`_reruns`)."""
    m = as_shape(model)
    sp = params or StepParams()
    eng = engine_name if isinstance(engine_name, Engine) else engine(engine_name)
    batch = split_batch(tokens_per_step, seq_len, plan)
    chip = chip_of(hw.name)
    mb, M = plan.micro_batches, batch.micro_batch * batch.local_seq
    kernel = attention or eng.attention
    rates = dataclasses.replace(sp.rates(hw.name, kernel, hw.peak_flops), fusion=eng.fusion,
                                kernel_s=eng.kernel_s(sp.kernel_s),
                                graph_scopes=eng.graph_scopes,
                                graph_kernel_s=eng.graph_kernel_s(sp.kernel_s))
    if fp8 and hw.peak_flops_fp8:  # the linear layers' GEMMs at the FP8 peak (layer_cost)
        rates = dataclasses.replace(rates, fp8_hw=hw.replace(peak_flops=hw.peak_flops_fp8),
                                    fp8_eff=sp.fp8_eff, fp8_recipe=fp8_recipe_name(fp8),
                                    fp8_rowwise_eff=sp.fp8_rowwise_eff)
    blk = _block_summary(m, M, seq_len, plan.tp, plan.cp, plan.sp, plan.ep, hw, chip, rates,
                         kernel, plan.recompute, eng.selective, plan.etp, eng.dispatcher,
                         eng.dead_tail, rerun)
    blk_f, blk_b = blk["fwd"], blk["bwd"]
    L = m.n_layers
    frac_moe = m.moe_layers / L if m.is_moe else 0.0
    head_f, head_b = head_cost(m, M, plan.tp, hw, chip, rates)

    # exposed tensor / context / expert communication, per block per micro-batch
    act = M * m.d_model * 2.0
    tp_t = ct.tp_s(plan, act, hw, sp.nvlink_eff, sp.net_eff)
    cp_f, cp_b = ct.cp_s(m, plan, seq_len, batch.micro_batch, hw, sp.nvlink_eff, sp.net_eff,
                         kernel_s=sp.kernel_s)
    again = _reruns(plan.recompute, rerun)
    if "attention" in again:
        cp_b += cp_f  # the rerun attention core passes K/V round the ring again
    tp_x = _overlapped(tp_t, eng.tp, sum(blk["gemm"].values()))  # split under its GEMMs
    cp_x = ct.cp_exposed_s(cp_f, cp_b, blk["attn_f"], plan.cp_algorithm, eng.cp)
    ep_t = frac_moe * moe_comm_s(m, plan, M, hw, sp.nvlink_eff, sp.net_eff, eng.dispatcher,
                                 rerun="experts" in again)
    ep_x = _overlapped(ep_t, eng.ep, blk_f + blk_b)  # under the other micro-batch's block

    # the busiest pipeline rank: the runtime's split of blocks, the head on the last rank
    # (on rank 0 with a V placement), each block with the communication it leaves exposed
    blocks, has_head = _busiest(m, seq_len, plan.pp, virtual_stages(plan),
                                blk_f + blk_b + tp_x + cp_x + ep_x, head_f + head_b,
                                plan.schedule in V_SHAPED)

    def per_step(x: float) -> float:
        return mb * blocks * x

    gemm = {cls: per_step(x) for cls, x in blk["gemm"].items()}
    mem_s = per_step(blk["mem"])
    over_s = per_step(blk["overhead"])
    head_s = mb * (head_f + head_b) if has_head else 0.0
    comm = {"tp": per_step(tp_t), "cp": per_step(cp_f + cp_b), "ep": per_step(ep_t)}
    exposed = {"tp": per_step(tp_x), "cp": per_step(cp_x), "ep": per_step(ep_x)}
    p = _params_per_gpu(m, plan.tp, plan.pp, plan.ep, plan.etp)

    def hbm_s(nbytes: float) -> float:  # a memory-bound pass over this rank's parameters
        return nbytes / (hw.hbm_bw * sp.hbm_eff)
    # the engine's gradient accumulation outside the GEMMs (Engine.hp_grad_bytes)
    accum_s = hbm_s(p.total * eng.hp_grad_bytes) if plan.zero <= 1 else 0.0
    stage_mb = blocks * (blk_f + blk_b) + (head_f + head_b if has_head else 0.0) + \
        (tp_x + cp_x + ep_x) * blocks + accum_s
    compute_like = mb * stage_mb
    bubble = compute_like * bubble_over_compute(plan.schedule, plan.pp, mb,
                                                virtual_stages(plan))
    send = ct.pp_send_s(plan, act, hw, sp.nvlink_eff, sp.net_eff, sp.kernel_s,
                        eng.p2p_split)
    comm["pp"] = 2 * mb * virtual_stages(plan) * send
    exposed["pp"] = comm["pp"] * (1 - eng.pp)

    d_dense, d_exp = plan.dp * plan.cp, expert_data_ranks(plan)
    sg = shard_group or d_dense // plan.dp_replicate  # HSDP: the plan's replica size
    if d_dense % sg:
        raise ValueError(f"shard_group={sg} does not divide dp*cp={d_dense}; pick a divisor")
    apart = strides(plan)
    payloads = [(p.dense, d_dense, sg, apart["dp"]),
                (p.expert, d_exp, min(sg, d_exp), apart["edp"])]
    comm["dp"], dp_x = dp_sync(plan, payloads, hw, sp, eng, blk_f, blk_b, blocks,
                                blocks * blk_f, blocks * blk_b)
    exposed["dp"] = taxed(comm["dp"], dp_x, sp.overlap_tax)
    shard = (p.dense / sg + p.expert / min(sg, d_exp) if plan.zero >= 1 else p.total)
    opt_s = hbm_s(shard * OPTIMIZER_BYTES_PER_PARAM)

    per_token, extra = _flops_per_token(m, seq_len, plan.recompute)
    return Breakdown(gemm, mem_s, over_s, head_s, comm, exposed, bubble, opt_s,
                     per_token * tokens_per_step, (per_token + extra) * tokens_per_step,
                     plan.world_size, hw.peak_flops, eng.name, blocks, mb,
                     accum_s=mb * accum_s, mtp_blocks=m.mtp_layers if has_head else 0)
