"""`paratrain plan --search`: enumerate every valid layout, drop those that do not fit, rank
the rest by predicted step time.

Axes: tp (powers of two up to one node, dividing the heads), cp (powers of two up to 16, at
least 1024 tokens per rank; ring or all-to-all when the heads divide over cp x tp), pp
(divisors of what is left, at most the layers), dp (the rest, dividing the batch), ep (MoE:
powers of two dividing the experts and dp x cp x tp / etp, etp 1 or tp), micro-batch size
(divisors of the per-replica batch, so accumulation or pipeline micro-batches follow),
schedule (GPipe, 1F1B, interleaved with v in VIRTUAL_STAGES, ZB-H1, and with 2 chunks per
rank ZB-V and DualPipeV when 2 pp stages fit the layers, DualPipeV only with m >= 2 pp),
ZeRO stage 0-3, recomputation none/selective/full. Only layouts `paratrain train` accepts
are ranked (:func:`runs`: the launcher's checks). Sequence parallelism is always on when tp
> 1: it moves the same bytes as tensor parallelism alone (all-gather + reduce-scatter =
all-reduce) and divides the remaining activations by tp, so it dominates.

Layouts are priced by the step model (:func:`paratrain.systems.step_model.predict_step`:
per-GEMM efficiency, so thin micro-batches and narrow shards cost what they cost; kernel
launches and p2p latency per micro-batch; the busiest stage's share of the layers) unless
``reference=True`` asks for docs/design.md's model. Memory (in-flight activations of the
schedule included) is :func:`paratrain.cost.memory.memory`'s.

The winner is explained in the rules of thumb of docs/design.md: tensor parallel inside a
node, pipeline or FSDP across nodes until the model fits, data parallel for the rest,
gradient accumulation when the batch is small.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from paratrain.config import ModelConfig
from paratrain.cost.dp_bytes import top_useful_zero
from paratrain.cost.hardware import Hardware
from paratrain.cost.memory import Memory, memory, mixed_recipe
from paratrain.cost.shapes import as_shape
from paratrain.plan import ParallelPlan, infer_dp
from paratrain.systems.overlap import SEARCH_ENGINE
from paratrain.systems.step_model import Breakdown, predict_step
from paratrain.systems.step_params import StepParams
from paratrain.systems.step_time import StepTime, bubble_fraction, step_time

ZERO_STAGES = (0, 1, 2, 3)
VIRTUAL_STAGES = (2, 3, 4, 5, 6, 8, 12)  # chunks per rank the published runs use
RECOMPUTES = ("none", "selective", "full")
PROGRESS_EVERY = 50_000  # layouts between two calls of search()'s progress


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _pow2_upto(n: int) -> list[int]:
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    return out


@dataclass(frozen=True)
class Candidate:
    plan: ParallelPlan
    micro_batch: int  # sequences per micro-batch per data-parallel rank
    memory: Memory
    time: StepTime | Breakdown

    @property
    def step_s(self) -> float:
        return self.time.step_s


@dataclass
class SearchResult:
    top: list[Candidate]
    scored: int  # layouts priced (memory at least)
    fitting: int
    elapsed_s: float
    points: list[tuple[float, float]] = field(default_factory=list)  # (step_s, bytes)

    @property
    def layouts_per_s(self) -> float:
        return self.scored / self.elapsed_s if self.elapsed_s > 0 else float("inf")

    def pareto(self) -> list[tuple[float, float]]:
        """Fitting layouts no other beats on both step time and memory."""
        front, best_mem = [], float("inf")
        for t, mem in sorted(self.points):
            if mem < best_mem:
                front.append((t, mem))
                best_mem = mem
        return front


def enumerate_plans(model: ModelConfig, hw: Hardware, gpus: int, sequences: int,
                    seq_len: int, *, zero_stages=ZERO_STAGES, recomputes=RECOMPUTES,
                    max_micro_batch: int = 64, replicas=(1,)
                    ) -> Iterator[tuple[ParallelPlan, int]]:
    """Every valid (plan, micro-batch size) for ``gpus`` GPUs and a global batch of
    ``sequences`` sequences of ``seq_len`` tokens; ``replicas``: the HSDP replica counts
    (``dp_replicate``) tried with ZeRO >= 1 (default none: plain ZeRO over dp x cp)."""
    m = as_shape(model)
    for tp in _pow2_upto(min(hw.gpus_per_node, gpus)):
        if m.n_heads % tp or m.kv_heads % tp or gpus % tp:
            continue
        for cp in _pow2_upto(16):
            if gpus % (tp * cp) or seq_len % cp or (cp > 1 and seq_len // cp < 1024):
                continue
            for pp in _divisors(gpus // (tp * cp)):
                if pp > m.n_layers:
                    break
                dp = infer_dp({"tp": tp, "pp": pp, "cp": cp}, gpus, "gpus")["dp"]
                if sequences % dp:
                    continue
                per_replica = sequences // dp
                eps = _expert_layouts(m, dp, cp, tp)
                for b in _divisors(per_replica):
                    if b > max_micro_batch:
                        break
                    mb = per_replica // b
                    scheds = [("1f1b", 1)] if pp == 1 else [("gpipe", 1), ("1f1b", 1),
                                                            ("zb-h1", 1)]
                    if pp > 1 and mb % pp == 0:
                        scheds += [("interleaved", v) for v in VIRTUAL_STAGES
                                   if pp * v <= m.n_layers]
                    if pp > 1 and 2 * pp <= m.n_layers:  # V: 2 chunks per rank
                        scheds += [("zb-v", 2)] + ([("dualpipev", 2)] if mb >= 2 * pp else [])
                    algos = ("ring",) if cp == 1 else ("ring", "all-to-all") if (
                        m.n_heads % (cp * tp) == 0 and m.kv_heads % (cp * tp) == 0
                        ) else ("ring",)
                    for sched, v in scheds:
                        for ep, etp in eps:
                            for algo in algos:
                                for zero, r in _zero_replicas(zero_stages, replicas,
                                                              dp, cp, ep, pp):
                                    for rc in recomputes:
                                        plan = ParallelPlan(
                                            dp=dp, tp=tp, pp=pp, cp=cp, ep=ep,
                                            etp=etp, zero=zero,
                                            dp_replicate=r, sp=tp > 1, micro_batches=mb,
                                            schedule=sched, virtual_stages=v,
                                            recompute=rc, cp_algorithm=algo)
                                        if runs(plan, m, gpus, sequences):
                                            yield plan, b


def _expert_layouts(m, dp: int, cp: int, tp: int) -> list[tuple[int, int]]:
    """(ep, etp) pairs of an MoE model: etp 1 or tp, ep a power of two dividing the experts
    and dp x cp x tp / etp (Megatron-Core's folding); :func:`runs` keeps those the
    runtime runs."""
    if not m.is_moe:
        return [(1, 1)]
    folded = dp * cp * tp
    return [(e, etp) for etp in sorted({1, tp})
            for e in _pow2_upto(min(folded // etp, m.experts))
            if folded // etp % e == 0 and m.experts % e == 0]


def _zero_replicas(zero_stages, replicas, dp: int, cp: int, ep: int, pp: int = 1
                   ) -> list[tuple[int, int]]:
    """(ZeRO stage, HSDP replicas) pairs of one (dp, cp, ep): replicas > 1 only with
    ZeRO >= 1, dividing dp, leaving 2+ ranks per shard group, without ep (the plan's
    rules, :class:`paratrain.plan.ParallelPlan`). Under a pipeline (``pp`` > 1) the
    stages above :func:`paratrain.cost.dp_bytes.top_useful_zero` are left out where
    that stage is tried: ZeRO-2 is ZeRO-1 there, ZeRO-3 ZeRO-1's traffic with its shards
    held beside."""
    if dp * cp == 1:
        return [(0, 1)]
    top = top_useful_zero(pp > 1)
    stages = [z for z in zero_stages if z <= top or top not in zero_stages]
    return [(z, r) for z in stages for r in replicas
            if r == 1 or (z >= 1 and dp % r == 0 and r < dp * cp and ep == 1)]


def runs(plan: ParallelPlan, model: ModelConfig, gpus: int, sequences: int) -> bool:
    """Whether `paratrain train` accepts ``plan`` (the launcher's own checks): the search
    ranks nothing the runtime refuses (a composition the systems model could price but
    the runtime does not run, such as tied embeddings with a pipeline, is left out)."""
    try:
        plan.check_run(model, gpus, sequences)
    except ValueError:
        return False
    return True


def search(model: ModelConfig, hw: Hardware, gpus: int, tokens_per_step: int, seq_len: int,
           *, top: int = 10, eta: float | None = None, keep_points: bool = True,
           step_kwargs: dict | None = None, attention: str = "eager",
           reference: bool = False, params: StepParams | None = None,
           engine=None, fp8: bool | str = False, progress=None,
           **enum_kw) -> SearchResult:
    """Price every layout; return the ``top`` fitting ones by predicted step time: the
    step model under ``params`` and ``engine`` (default), or with ``reference`` the
    reference :func:`step_time` (``step_kwargs`` go to it); ``attention`` goes to
    :func:`memory`. ``engine`` (a name or an :class:`~paratrain.systems.overlap.Engine`)
    defaults to :data:`SEARCH_ENGINE` (why: overlap.py).
    ``fp8``: the linear layers' GEMMs in FP8 (the step model's pricing; a scaling
    recipe's name, ``layer_cost.FP8_RECIPES``, or True for per-tensor scaling).
    ``progress(scored, fitting, best_step_s)`` is called every :data:`PROGRESS_EVERY`
    layouts (an MoE model's search runs a minute or more: the CLI shows it)."""
    if tokens_per_step % seq_len:
        raise ValueError(
            f"tokens_per_step={tokens_per_step} is not a multiple of seq_len={seq_len}; "
            "pick a whole number of sequences"
        )
    if eta is not None:
        hw = hw.replace(eta=eta)
    m = as_shape(model)
    kw = step_kwargs or {}
    t0 = time.perf_counter()
    scored = fitting = 0
    best: list[Candidate] = []
    worst_kept = float("inf")
    points = []
    for plan, b in enumerate_plans(m, hw, gpus, tokens_per_step // seq_len, seq_len,
                                   **enum_kw):
        scored += 1
        if progress is not None and scored % PROGRESS_EVERY == 0:
            progress(scored, fitting, best[0].step_s if best else None)
        mem = memory(m, plan, hw, tokens_per_step, seq_len, mixed_recipe(fp8),
                     attention=attention)
        if not mem.fits:
            continue
        fitting += 1
        st = (step_time(m, plan, hw, tokens_per_step, seq_len, **kw) if reference else
              predict_step(m, plan, hw, tokens_per_step, seq_len, params,
                           engine or SEARCH_ENGINE, fp8=fp8))
        if keep_points:
            points.append((st.step_s, mem.total_bytes))
        if len(best) < top or st.step_s < worst_kept:
            best.append(Candidate(plan, b, mem, st))
            best.sort(key=lambda c: (c.step_s, c.memory.total_bytes))
            del best[top:]
            worst_kept = best[-1].step_s
    elapsed = time.perf_counter() - t0
    if not best:
        raise ValueError(
            f"no layout of {m.name} fits {gpus} x {hw.name} ({hw.hbm_bytes / 1e9:.0f} GB) "
            f"with {tokens_per_step} tokens per step; use more GPUs or a smaller batch"
        )
    return SearchResult(best, scored, fitting, elapsed, points)


def explain(result: SearchResult, model: ModelConfig, hw: Hardware) -> list[str]:
    """Why the winner wins, in the language of the rules of thumb."""
    m = as_shape(model)
    c = result.top[0]
    p, st, mem = c.plan, c.time, c.memory
    gb = 1e9
    lines = []
    if p.tp > 1:
        where = "inside one node" if p.tp <= hw.gpus_per_node else "across nodes"
        lines.append(
            f"tensor parallel {p.tp} {where} ({hw.intra_group_bw(p.tp) / gb:.0f} GB/s "
            "per rank over the node's links): its "
            f"per-layer collectives cost {st.tp_comm_s:.3g} s per step, cheap only on the "
            "node's fast links; sequence parallelism splits the remaining activations")
    else:
        lines.append("no tensor parallelism: the layers fit whole, so no per-layer "
                     "collectives are needed")
    if p.pp > 1 or p.zero:
        how = []
        if p.pp > 1:
            how.append(f"pipeline {p.pp} across nodes ({p.schedule}"
                       f"{f', v={p.virtual_stages}' if p.schedule == 'interleaved' else ''}, "
                       f"bubble {100 * bubble_fraction(p.schedule, p.pp, p.micro_batches, p.virtual_stages):.1f}%)")  # noqa: E501
        if p.zero and p.dp_replicate > 1:
            how.append(f"ZeRO-{p.zero} over {p.dp * p.cp // p.dp_replicate} data ranks, "
                       f"{p.dp_replicate} replicas (HSDP)")
        elif p.zero:
            how.append(f"ZeRO-{p.zero} over {p.dp * p.cp} data ranks")
        lines.append(f"{' and '.join(how)} until the model fits: model states "
                     f"{mem.states_bytes / gb:.1f} GB, total {mem.total_bytes / gb:.1f} of "
                     f"{hw.hbm_bytes / gb:.0f} GB per GPU")
    else:
        lines.append(f"no pipeline or sharding needed: the model states "
                     f"({mem.states_bytes / gb:.1f} GB) fit replicated")
    ranks = p.dp * p.cp
    if ranks > 1:
        who = f"data parallel {p.dp}" + (f" x context parallel {p.cp}" if p.cp > 1 else "")
        lines.append(f"{who}: gradients are synchronised over {ranks} ranks, "
                     f"{st.dp_comm_s:.3g} s per step, {st.dp_exposed_s:.3g} s of it exposed "
                     "after overlap")
    else:
        lines.append("no data or context parallelism: one replica, no gradient sync")
    if p.cp > 1:
        how = ("ring attention passes K/V around the ring under each block's attention"
               if p.cp_algorithm == "ring" else "all-to-alls switch sequence and head "
               "sharding around attention")
        lines.append(f"context parallel {p.cp} ({p.cp_algorithm}): each sequence is split "
                     f"over {p.cp} ranks, dividing its activations; {how} "
                     f"(exposed {st.cp_exposed_s:.3g} s)")
    if p.micro_batches > 1 and p.pp == 1:
        lines.append(f"gradient accumulation over {p.micro_batches} micro-batches of "
                     f"{c.micro_batch} sequence(s): the activations of the whole per-replica "
                     "batch would not fit (or cost more) at once")
    elif p.pp > 1:
        lines.append(f"{p.micro_batches} micro-batches of {c.micro_batch} sequence(s) keep "
                     "the pipeline bubble small")
    if p.recompute != "none":
        lines.append(f"{p.recompute} recomputation: trades {100 * (st.hardware_flops / st.model_flops - 1):.0f}% "  # noqa: E501
                     "more FLOPs for activation memory")
    # what the runner-up choices would have cost, one axis at a time
    for axis in ("tp", "pp", "zero", "recompute"):
        alt = next((x for x in result.top[1:] if getattr(x.plan, axis) != getattr(p, axis)),
                   None)
        if alt is not None:
            lines.append(f"best with {axis}={getattr(alt.plan, axis)} instead: "
                         f"{100 * (alt.step_s / c.step_s - 1):+.1f}% step time")
    if m.is_moe and p.ep > 1:
        lines.append(f"expert parallel {p.ep}: each rank keeps {m.experts // p.ep} experts"
                     + (f", each split over {p.etp} ranks" if p.etp > 1 else ""))
    return lines


def candidate_record(c: Candidate) -> dict:
    p = c.plan
    return {"dp": p.dp, "tp": p.tp, "pp": p.pp, "cp": p.cp, "ep": p.ep, "etp": p.etp,
            "zero": p.zero,
            "dp_replicate": p.dp_replicate, "sp": p.sp, "micro_batches": p.micro_batches,
            "micro_batch_seqs": c.micro_batch,
            "schedule": p.schedule, "virtual_stages": p.virtual_stages,
            "cp_algorithm": p.cp_algorithm,
            "recompute": p.recompute, "step_s": c.step_s, "mfu": c.time.mfu,
            "hfu": c.time.hfu, "memory_bytes": c.memory.total_bytes,
            "compute_s": c.time.compute_s, "bubble_s": c.time.bubble_s,
            "exposed_comm_s": c.time.exposed_comm_s}


def render_search(result: SearchResult, lines: list[str], title: str, console=None) -> None:
    """The top layouts as a table that fits 80 columns (an axis of size 1 in every row
    shown, and a schedule column of no pipeline, are dropped and named below the table),
    then why the winner wins, each reason wrapped under its bullet."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    con = console or Console()
    rows = []
    for i, c in enumerate(result.top, 1):
        p = c.plan
        sched = p.schedule if p.pp > 1 else "-"
        if p.virtual_stages > 1 and p.schedule == "interleaved":
            sched = f"int v{p.virtual_stages}"
        rows.append((str(i), str(p.dp), str(p.tp), str(p.pp), str(p.cp), str(p.ep),
                     str(p.zero), f"{p.micro_batches}x{c.micro_batch}", sched,
                     p.recompute[:4], f"{c.step_s:.3f}", f"{100 * c.time.mfu:.1f}",
                     f"{c.memory.total_bytes / 1e9:.1f}"))
    cols = ("#", "dp", "tp", "pp", "cp", "ep", "zero", "mb x seqs", "schedule", "recomp",
            "step s", "MFU%", "GB")
    idle = {"cp": "1", "ep": "1", "schedule": "-"}
    dropped = [c for c, v in idle.items() if rows and all(r[cols.index(c)] == v for r in rows)]
    keep = [i for i, c in enumerate(cols) if c not in dropped]
    t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for i in keep:
        t.add_column(cols[i], justify="right", no_wrap=True)
    for r in rows:
        t.add_row(*(r[i] for i in keep))
    con.print(t)
    if dropped:
        said = {"cp": "cp 1", "ep": "ep 1", "schedule": "no pipeline schedule"}
        con.print("every layout shown has " + ", ".join(said[c] for c in dropped) +
                  " (columns left out)", highlight=False)
    con.print("[bold]why the winner wins[/]")
    why = Table.grid(padding=(0, 1))
    why.add_column(no_wrap=True)
    why.add_column()
    for line in lines:
        why.add_row("  -", line)
    con.print(why)
    con.print(f"scored {result.scored:,} layouts ({result.fitting:,} fit) in "
              f"{result.elapsed_s:.2f} s: {result.layouts_per_s:,.0f} layouts/s")
