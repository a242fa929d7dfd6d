"""The systems model's prediction for a run on THIS machine, set beside what it measured.

Why a separate module: :mod:`paratrain.systems` prices GPUs and must stay torch-free;
this glue knows what is special about a CPU box running gloo, and may import torch-side
layout helpers (the pipeline's stage split, the engines' bucket packing) to count bytes
exactly. Everything it says is in the open, in :attr:`Prediction.notes`.

What is special here, and how it is priced:

- **Ranks are processes with one thread each, sharing the cores.** Linux schedules
  fairly between *sessions* first (autogroups, ``/proc/sys/kernel/sched_autogroup_enabled``)
  and then between the threads of a session. So ``C`` cores are water-filled between the
  active sessions, each capped at its runnable threads; this run's session (n ranks) gets
  ``c`` cores and each rank ``share = c / n`` of one (:func:`waterfill`). Alone on the box
  that is ``min(1, C / n)``; on a box shared with three colleagues' jobs it is about
  ``C / 4`` for the whole run, however many ranks it has. ``C`` is the profile's
  ``gpus_per_node`` (``bench calibrate`` writes the core count); the other sessions'
  runnable threads are sampled from /proc (:func:`sample_other_sessions`).
- **Small matmuls on one CPU thread are not a GPU's.** Fitted once from three
  single-process runs of the same model (:func:`fit_from_runs`; ``check-model`` does it
  and saves the result beside the profile), on CPU time so another session's load does not
  leak in: ``eta``, the achieved fraction of one thread's matmul peak (measured then, with
  :func:`paratrain.perf.matmul_peak_flops`: a calibration taken under load can understate
  it), ``pass_s``, the fixed cost of one block's forward + backward for one micro-batch
  (Python and autograd dispatch of tens of small kernels, which does not shrink with the
  batch), and ``step_s``, the fixed cost of a step (optimizer, clip, data). Without a
  fit, ``eta`` and the peak are the profile's and the fixed costs 0, and a note says so.
- **gloo over loopback**: alpha and bandwidth from the profile, priced per collective
  call with :func:`paratrain.systems.collectives.time_s` (ring), so a ZeRO-3 run pays
  one latency chain per unit and a TP run one per block region.

Step time is the larger of two bounds. The critical path on free cores: pipeline stages
s with per-micro-batch
time t_s run m micro-batches in ``sum_s t_s + (m - 1) max_s t_s`` (fill + steady state;
for equal stages this is DESIGN.md's bubble (p-1)/(m+p-1)); TP collectives sit inside
every block (exposed); the pipeline's point-to-point sends cost alpha + bytes/bw each;
the data-parallel sync is exposed except for buckets that finish while backward still
runs (a model that fits one bucket hides nothing). And the session's CPU work per step
(every rank's compute, fixed costs and loopback copies) over the cores it gets: when
ranks outnumber those cores, a rank waiting in a collective or a pipeline bubble hands its
core to another, so waits are hidden and the work sets the pace.

Bytes are counted exactly, per rank, from the runtime's layout: the stage split
(:func:`paratrain.parallel.pipeline.stage.split_layers`), tensor shards (heads, SwiGLU
units, vocabulary rows ``ceil(V/t)``; norms replicated) and the flat buffers' padding to
a multiple of the data-parallel size (buckets of ``bucket_mb`` MiB in reverse
registration order; ZeRO-3 units). The systems model's busiest-rank formula
(:func:`paratrain.systems.memory.model_states`) is reported beside it.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from paratrain.config import ModelConfig, TrainConfig
from paratrain.plan import ParallelPlan
from paratrain.systems import collectives as coll
from paratrain.systems.hardware import Hardware, load_hardware
from paratrain.systems.step_time import dp_sync_wire_bytes

DEFAULT_PROFILE = Path("~/.cache/paratrain/hardware.toml")
FIT_NAME = "cpu_fit.json"  # written next to the profile by `paratrain check-model`
ELEMENT_BYTES = {"float64": 8, "float32": 4, "bfloat16": 4}
CALIBRATE_HINT = ("prediction: no hardware profile of this machine; run `paratrain bench "
                  "calibrate` to measure it (then every run prints predicted vs measured)")


# ---- this machine -------------------------------------------------------------------------
@dataclass(frozen=True)
class MachineModel:
    """This machine as the prediction sees it: the profile plus the CPU fit.

    ``eta`` is relative to ``thread_peak`` (one thread's matmul FLOP/s); ``pass_s`` and
    ``step_s`` are the fixed costs of a block pass and of a step on a whole core;
    ``others`` the runnable threads of each other active session, one tuple per sample.
    """

    hw: Hardware
    eta: float
    thread_peak: float
    pass_s: float = 0.0
    step_s: float = 0.0
    others: tuple[tuple[int, ...], ...] = ()
    coll_step_cpu_s: float = 0.0  # CPU a rank spends per collective step (gloo, loopback)
    coll_byte_cpu_s: float = 0.0  # CPU per byte it sends (0: priced as bytes / intra_bw)
    fitted: bool = False
    source: str = "profile"

    @property
    def cores(self) -> int:
        return self.hw.gpus_per_node

    @property
    def other_threads(self) -> float:
        """Mean runnable threads of other sessions (for the record)."""
        return sum(map(sum, self.others)) / len(self.others) if self.others else 0.0

    @property
    def other_sessions(self) -> float:
        return sum(map(len, self.others)) / len(self.others) if self.others else 0.0

    def share(self, nproc: int) -> float:
        """Fraction of a core each of ``nproc`` one-thread ranks gets: the session's
        water-filled cores over its ranks, averaged over the samples of the others."""
        samples = self.others or ((),)
        return sum(waterfill(self.cores, nproc, o) for o in samples) / len(samples)

    def replace(self, **changes) -> MachineModel:
        d = {f: getattr(self, f) for f in self.__dataclass_fields__}
        d.update(changes)
        return MachineModel(**d)


def waterfill(cores: float, nproc: int, others: tuple[int, ...]) -> float:
    """Per-rank core share when ``cores`` are split fairly between sessions (each capped
    at its runnable threads): ours has ``nproc`` ranks, the others ``others`` threads."""
    demands = sorted([*others, nproc])
    left, k = float(cores), len(demands)
    for d in demands:
        fair = left / k
        give = min(d, fair)
        if d == nproc:
            return min(1.0, give / nproc)
        left -= give
        k -= 1
    return min(1.0, cores / nproc)


def sample_other_sessions(samples: int = 10, interval_s: float = 0.02
                          ) -> tuple[tuple[int, ...], ...]:
    """Runnable threads of every other session (autogroup) with any, per sample, from
    /proc; empty where /proc or autogroups are missing (then the box counts as free)."""
    def group(pid: str) -> str | None:
        try:
            with open(f"/proc/{pid}/autogroup") as f:
                return f.read().split()[0]
        except (OSError, IndexError):
            return None

    mine = group("self")
    if mine is None:
        return ()
    out = []
    for i in range(samples):
        counts: dict[str, int] = {}
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            running = 0
            for tid in tids:
                try:
                    with open(f"/proc/{pid}/task/{tid}/stat") as f:
                        running += f.read().rsplit(")", 1)[1].split()[0] == "R"
                except (OSError, IndexError):
                    continue
            if running:
                g = group(pid)
                if g is not None and g != mine:
                    counts[g] = counts.get(g, 0) + running
        out.append(tuple(sorted(counts.values())))
        if i + 1 < samples:
            time.sleep(interval_s)
    return tuple(out)


def fit_path(profile: Path) -> Path:
    return profile.expanduser().with_name(FIT_NAME)


def load_machine(profile: str | Path | None = None) -> MachineModel | None:
    """The profile (default ``~/.cache/paratrain/hardware.toml``) and, if present, the CPU
    fit beside it; ``None`` when this machine has not been calibrated."""
    path = Path(profile or DEFAULT_PROFILE).expanduser()
    if not path.is_file():
        return None
    hw = load_hardware(str(path))
    fp = fit_path(path)
    fit = json.loads(fp.read_text()) if fp.is_file() else {}
    if {"eta", "thread_peak", "pass_s", "step_s"} <= set(fit):  # else none or stale: ignored
        return MachineModel(hw, fit["eta"], fit["thread_peak"], fit["pass_s"], fit["step_s"],
                            coll_step_cpu_s=fit.get("coll_step_cpu_s", 0.0),
                            coll_byte_cpu_s=fit.get("coll_byte_cpu_s", 0.0), fitted=True,
                            source=f"fit {fp} ({fit.get('fitted_on', '?')})")
    return MachineModel(hw, hw.eta, hw.peak_flops / hw.gpus_per_node,
                        source=f"profile {path} (eta {hw.eta:g}, no CPU fit: run "
                               "`paratrain check-model` to fit one)")


def save_fit(m: MachineModel, profile: str | Path | None, fitted_on: str) -> Path:
    path = fit_path(Path(profile or DEFAULT_PROFILE))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"eta": m.eta, "thread_peak": m.thread_peak, "pass_s": m.pass_s,
                                "step_s": m.step_s, "coll_step_cpu_s": m.coll_step_cpu_s,
                                "coll_byte_cpu_s": m.coll_byte_cpu_s, "fitted_on": fitted_on,
                                "date": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    return path


# ---- exact per-rank layout ------------------------------------------------------------------
@dataclass(frozen=True)
class RankLayout:
    """What one rank holds: its blocks, whether it has the embedding / head, its params."""

    rank: int
    pp: int
    dp: int
    tp: int
    blocks: int
    first: bool
    last: bool
    params: int  # elements of trainable parameters on this rank
    param_sizes: tuple[int, ...]  # per parameter, registration order


def coords(rank: int, plan: ParallelPlan) -> tuple[int, int, int]:
    """(pp, dp, tp) of a global rank: the runtime's pp-dp-tp order, tp innermost."""
    return rank // (plan.dp * plan.tp), (rank // plan.tp) % plan.dp, rank % plan.tp


def _vocab_rows(vocab: int, tp: int, r: int) -> int:
    per = -(-vocab // tp)
    return min((r + 1) * per, vocab) - min(r * per, vocab)


def rank_layout(mcfg: ModelConfig, plan: ParallelPlan, rank: int) -> RankLayout:
    """Parameters of ``rank`` as the runtime shards them (exact element counts)."""
    from paratrain.parallel.pipeline.stage import split_layers

    pp_i, dp_i, tp_i = coords(rank, plan)
    t = plan.tp
    v = plan.virtual_stages if plan.schedule == "interleaved" and plan.pp > 1 else 1
    S = plan.pp * v
    ranges = split_layers(mcfg, S) if S > 1 else [(0, mcfg.n_layers)]
    mine = [k for k in range(S) if k % plan.pp == pp_i]
    d, hd = mcfg.d_model, mcfg.head_dim
    block = [d, mcfg.n_heads * hd * d // t, mcfg.kv_heads * hd * d // t,
             mcfg.kv_heads * hd * d // t, d * mcfg.n_heads * hd // t, d,
             mcfg.d_ff * d // t, mcfg.d_ff * d // t, d * mcfg.d_ff // t]
    rows = _vocab_rows(mcfg.vocab_size, t, tp_i) * d
    sizes: list[int] = []
    first = last = False
    blocks = 0
    for k in mine:
        a, b = ranges[k]
        if k == 0:
            first = True
            sizes.append(rows)
        for _ in range(a, b):
            sizes += block
        blocks += b - a
        if k == S - 1:
            last = True
            sizes.append(d)
            if not (mcfg.tie_embeddings and S == 1):
                sizes.append(rows)
    return RankLayout(rank, pp_i, dp_i, tp_i, blocks, first, last, sum(sizes), tuple(sizes))


def _pack(sizes_reversed: list[int], elem: int, cap_bytes: int) -> list[int]:
    """Element counts of the flat buckets :func:`paratrain.parallel.ddp.pack` builds."""
    out, cur, cur_b = [], 0, 0
    for n in sizes_reversed:
        b = n * elem
        if cur and cur_b + b > cap_bytes:
            out.append(cur)
            cur, cur_b = 0, 0
        cur += n
        cur_b += b
    if cur:
        out.append(cur)
    return out


def _fsdp_units(mcfg: ModelConfig, sizes: tuple[int, ...]) -> list[int]:
    """Element counts of ZeRO-3 units: embedding, each block, (norm + head); with tied
    embeddings one root unit of embedding + norm (:func:`fsdp.default_units`)."""
    per_block = 9
    emb, rest = sizes[0], sizes[1:]
    blocks = [sum(rest[i:i + per_block]) for i in range(0, mcfg.n_layers * per_block,
                                                         per_block)]
    tail = rest[mcfg.n_layers * per_block:]
    if mcfg.tie_embeddings:
        return [emb + sum(tail), *blocks]
    return [emb, *blocks, sum(tail)]


def _pad(n: int, p: int) -> int:
    """Flat buffers are padded to a multiple of the data-parallel size (equal chunks)."""
    return -(-n // p) * p


def _topk_keep(plan: ParallelPlan, n: int) -> int:
    """Gradient entries top-k compression keeps: 1 in k (at least one)."""
    return max(1, n // int(plan.compress.partition(":")[2]))


def _owned(n: int, p: int, r: int) -> int:
    """Real (not padding) elements in chunk r of a flat buffer of n padded to p."""
    s = -(-n // p)
    return max(0, min((r + 1) * s, n) - r * s)


def rank_state_bytes(mcfg: ModelConfig, plan: ParallelPlan, tcfg: TrainConfig, rank: int
                     ) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state (AdamW m, v) on ``rank``, as the
    memory tracker measures them (distinct storages: flat buffers with their padding)."""
    e = ELEMENT_BYTES[tcfg.dtype]
    lay = rank_layout(mcfg, plan, rank)
    p, r, n = plan.dp, lay.dp, lay.params
    world = plan.world_size
    cap = int(plan.bucket_mb * 1024 * 1024)
    mesh = plan.tp > 1 or plan.pp > 1 or plan.recompute != "none"
    if world == 1 or p == 1 or (mesh and plan.zero == 0) or plan.compress is not None:
        return {"params": e * n, "grads": e * n, "optimizer": 2 * e * n}
    if plan.zero == 3:
        units = _fsdp_units(mcfg, lay.param_sizes)
        return {"params": e * sum(_pad(u, p) // p for u in units),
                "grads": e * sum(_pad(u, p) // p for u in units),
                "optimizer": 2 * e * sum(_owned(u, p, r) for u in units)}
    buckets = _pack(list(reversed(lay.param_sizes)), e, cap)
    padded = sum(_pad(b, p) for b in buckets)
    if plan.zero == 0:
        return {"params": e * n, "grads": e * padded, "optimizer": 2 * e * n}
    grads = e * padded if plan.zero == 1 else e * padded // p
    return {"params": e * padded, "grads": grads,
            "optimizer": 2 * e * sum(_owned(b, p, r) for b in buckets)}


def dp_payload_bytes(mcfg: ModelConfig, plan: ParallelPlan, tcfg: TrainConfig, rank: int
                     ) -> int:
    """Gradient bytes this rank reduces over dp (flat buffers with their padding)."""
    e = ELEMENT_BYTES[tcfg.dtype]
    lay = rank_layout(mcfg, plan, rank)
    p = plan.dp
    mesh = plan.tp > 1 or plan.pp > 1 or plan.recompute != "none"
    if p == 1:
        return 0
    if plan.compress is not None:  # top-k values and int32 indices (parallel/compress.py)
        return _topk_keep(plan, lay.params) * (e + 4)
    if mesh and plan.zero == 0:
        return e * lay.params
    if plan.zero == 3:
        return e * sum(_pad(u, p) for u in _fsdp_units(mcfg, lay.param_sizes))
    cap = int(plan.bucket_mb * 1024 * 1024)
    return e * sum(_pad(b, p) for b in _pack(list(reversed(lay.param_sizes)), e, cap))


# ---- the prediction --------------------------------------------------------------------------
@dataclass(frozen=True)
class Prediction:
    """One step of one run on this machine (seconds, bytes; per rank unless named)."""

    step_s: float  # max(critical path, session CPU work / session cores)
    compute_s: float  # matmul FLOPs at eta, summed along the critical path (free cores)
    overhead_s: float  # fixed per-pass and per-step costs along the critical path
    bubble_s: float  # pipeline fill/drain: part of compute + overhead above
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float  # the data-parallel sync, total
    dp_exposed_s: float  # of which not hidden under backward
    share: float  # fraction of a core per rank
    critical_path_s: float  # the step if every rank had a core of its own
    session_work_s: float  # CPU seconds all ranks spend per step (compute + copies)
    session_cores: float  # cores the run's session gets (water-filled between sessions)
    cpu_rank0_s: float  # CPU seconds rank 0 spends per step
    dp_wire_bytes: float  # rank 0, per step
    tp_wire_bytes: float  # rank 0, blocks' collectives per step
    pp_wire_bytes: float  # rank 0, point-to-point sends per step
    states_bytes_per_rank: list[dict] = field(default_factory=list)
    systems_states_bytes: float = 0.0  # the systems model's busiest-rank formula
    activations_bytes: float = 0.0  # the systems model (Korthikanti, scaled to dtype)
    machine: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def comm_s(self) -> float:
        """Measured ``comm_s`` is the wait for the data-parallel sync only."""
        return self.dp_exposed_s

    @property
    def wire_bytes(self) -> float:
        return self.dp_wire_bytes + self.tp_wire_bytes + self.pp_wire_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d["comm_s"] = self.comm_s
        d["wire_bytes"] = self.wire_bytes
        return d


def _flops_block(mcfg: ModelConfig, tokens: float, tp: int, recompute: str = "none"
                 ) -> float:
    """Forward + backward FLOPs of one block on ``tokens`` tokens, one tensor shard:
    6 x matmul params + attention scores and values 12 H Q T (PaLM, appendix B); full
    recomputation adds a forward (1/3), selective the attention's forward."""
    d, hd = mcfg.d_model, mcfg.head_dim
    mat = (2 * mcfg.n_heads * hd * d + 2 * mcfg.kv_heads * hd * d + 3 * mcfg.d_ff * d) / tp
    attn = 12.0 * mcfg.n_heads * hd * mcfg.context / tp
    f = 6.0 * mat + attn
    if recompute == "full":
        f *= 4 / 3
    elif recompute == "selective":
        f += attn / 3
    return tokens * f


def _stage_mb_time(mcfg: ModelConfig, plan: ParallelPlan, lay: RankLayout, tokens_mb: float,
                   rate: float, pass_s: float) -> tuple[float, float]:
    """(FLOP seconds, fixed seconds) of one micro-batch's forward + backward on a rank."""
    f = lay.blocks * _flops_block(mcfg, tokens_mb, plan.tp, plan.recompute)
    if lay.last:
        f += tokens_mb * 6.0 * mcfg.d_model * mcfg.vocab_size / plan.tp  # the head
    passes = lay.blocks + (1 if (lay.first or lay.last) else 0)
    return f / rate, passes * pass_s


def _dp_calls(mcfg: ModelConfig, plan: ParallelPlan, lay: RankLayout, e: int,
              gather_e: int | None = None) -> list[tuple[str, float, int]]:
    """(op, full bytes, calls per step) of a rank's data-parallel sync: per bucket (DDP,
    ZeRO-1/2), per gradient tensor (mesh engine), or per unit and micro-batch (ZeRO-3,
    whose gathers move ``gather_e``-byte elements: 2 when it computes in bf16)."""
    p, m = plan.dp, plan.micro_batches if plan.pp == 1 else 1
    mesh = plan.tp > 1 or plan.pp > 1 or plan.recompute != "none"
    cap = int(plan.bucket_mb * 1024 * 1024)
    if plan.zero == 3:
        g = e if gather_e is None else gather_e
        units = [_pad(u, p) for u in _fsdp_units(mcfg, lay.param_sizes)]
        return [c for n in units for c in (("all_gather", g * n, 2 * m),
                                           ("reduce_scatter", e * n, m))]
    if mesh and plan.zero == 0:  # one all-reduce per gradient tensor, after backward
        return [("all_reduce", e * n, 1) for n in lay.param_sizes]
    if plan.compress is not None:  # values and indices all-gathered: p pieces of each
        keep = _topk_keep(plan, lay.params)
        return [("all_gather", p * keep * e, 1), ("all_gather", p * keep * 4, 1)]
    buckets = [e * _pad(b, p) for b in _pack(list(reversed(lay.param_sizes)), e, cap)]
    if plan.zero == 0:
        return [("all_reduce", n, 1) for n in buckets]
    rs = m if plan.zero == 2 else 1
    return [c for n in buckets for c in (("reduce_scatter", n, rs), ("all_gather", n, 1))]


def _tp_calls(mcfg: ModelConfig, plan: ParallelPlan, lay: RankLayout, act: float,
              seqs_mb: float, act_fwd: float | None = None) -> list[tuple[str, float, int]]:
    """TP collectives per step: 4 per block (2 forward exits of ``act_fwd`` bytes: bf16
    under autocast; 2 backward entries of ``act``), 1 at the embedding, 1 + 3 small at
    the head, per micro-batch (all-gather + reduce-scatter under SP: the same steps and
    bytes)."""
    if plan.tp == 1:
        return []
    m = plan.micro_batches
    act_fwd = act if act_fwd is None else act_fwd
    # Full recompute reruns a block's forward in backward, but torch's non-reentrant
    # checkpoint stops once the last saved tensor is rebuilt: the attention output's
    # all-reduce is repeated, the MLP output's (nothing after it is saved) is not.
    fwd = (3 if plan.recompute == "full" else 2) * lay.blocks
    out = [("all_reduce", act_fwd, m * fwd),
           ("all_reduce", act, m * (2 * lay.blocks + int(lay.first) + int(lay.last)))]
    if lay.last:
        out.append(("all_reduce", seqs_mb * mcfg.context * 4, 3 * m))
    return out


def _pp_calls(plan: ParallelPlan, lay: RankLayout, act: float, v: int
              ) -> list[tuple[str, float, int]]:
    """Point-to-point operations per step: each micro-batch sends (and receives) an
    activation forward and a gradient back at every inner stage boundary."""
    if plan.pp == 1:
        return []
    hop = act / (plan.tp if plan.sp else 1)
    ends = (0 if lay.last else 1) + (0 if lay.first else 1)
    return [("p2p", hop, 2 * plan.micro_batches * v * ends)]


def _comm_cpu(machine: MachineModel, plan: ParallelPlan, axis: str,
              calls: list[tuple[str, float, int]]) -> float:
    """CPU seconds a rank spends in ``calls``: ring steps x the measured CPU per step plus
    the bytes it sends x the CPU per byte (or bytes / the transport's bandwidth)."""
    p = plan.world_size if axis == "world" else getattr(plan, axis)
    per_byte = machine.coll_byte_cpu_s or 1.0 / machine.hw.intra_bw
    total = 0.0
    for op, n, k in calls:
        if op == "p2p":
            steps, wire = 1, n
        else:
            steps, wire = coll.steps(op, "ring", p), coll.wire_bytes(op, "ring", p, n)
        total += k * (steps * machine.coll_step_cpu_s + wire * per_byte)
    return total


def predict(mcfg: ModelConfig, tcfg: TrainConfig, plan: ParallelPlan, world: int,
            machine: MachineModel) -> Prediction:
    """Price one step of ``plan`` on ``world`` one-thread ranks of this machine."""
    if plan.world_size != world:
        raise ValueError(f"plan needs {plan.world_size} ranks but world={world}; match them")
    hw = machine.hw
    notes: list[str] = []
    share = machine.share(world)
    rate = machine.eta * machine.thread_peak  # the critical path is priced on free cores
    pass_s, fixed_s = machine.pass_s, machine.step_s
    e = ELEMENT_BYTES[tcfg.dtype]
    m = plan.micro_batches
    seqs_mb = tcfg.global_batch / plan.dp / m
    tokens_mb = seqs_mb * mcfg.context
    if share < 1:
        notes.append(f"{world} ranks on {machine.cores} cores beside "
                     f"{machine.other_sessions:.1f} other busy sessions "
                     f"({machine.other_threads:.1f} runnable threads): each rank gets "
                     f"{share:.2f} of a core")
    if not machine.fitted:
        notes.append("no CPU fit: eta from the profile, fixed costs 0 (run paratrain "
                     "check-model)")

    # ---- per stage and micro-batch: FLOPs, fixed costs, TP collectives (in every block) --
    a, bw = hw.intra_alpha, hw.intra_bw
    act = seqs_mb * mcfg.context * mcfg.d_model * e
    act_fwd = act / 2 if tcfg.dtype == "bfloat16" else act  # TP exits in the autocast dtype
    stages = []  # (flop_s, fixed_s, tp_s) per micro-batch
    for s in range(plan.pp):
        lay = rank_layout(mcfg, plan, s * plan.dp * plan.tp)
        f, fx = _stage_mb_time(mcfg, plan, lay, tokens_mb, rate, pass_s)
        tp_t = sum(k * coll.time_s(op, "ring", plan.tp, n, a, bw)
                   for op, n, k in _tp_calls(mcfg, plan, lay, act, seqs_mb, act_fwd)) / m
        stages.append((f, fx, tp_t))
    per_stage = [sum(x) for x in stages]
    v = plan.virtual_stages if plan.schedule == "interleaved" and plan.pp > 1 else 1
    slow = max(range(plan.pp), key=lambda i: per_stage[i])
    others = [i for i in range(plan.pp) if i != slow]

    def path(j: int) -> float:
        """Component j along the critical path: m x the slowest stage + the others' fill."""
        return m * stages[slow][j] + sum(stages[i][j] for i in others) / v

    flop_s, fixed_path, tp_s = path(0), path(1), path(2)
    bubble_s = sum(per_stage[i] for i in others) / v
    overhead_s = fixed_path + fixed_s
    lay0 = rank_layout(mcfg, plan, 0)
    tp_wire = 0.0
    if plan.tp > 1:
        n_fwd = 3 if plan.recompute == "full" else 2  # see _tp_calls
        per_block = n_fwd * act_fwd + 2 * act
        tp_wire = m * lay0.blocks * coll.wire_bytes("all_reduce", "ring", plan.tp, per_block)

    # ---- pipeline point-to-point ------------------------------------------------------------
    pp_s = pp_wire = 0.0
    if plan.pp > 1:
        hop = act / (plan.tp if plan.sp else 1)
        pp_s = 2 * (m + plan.pp - 1) * v * (a + hop / bw)
        sends = (0 if lay0.last else 1) + (0 if lay0.first else 1)  # rank 0: forward only
        pp_wire = m * v * sends * hop

    # ---- data parallel --------------------------------------------------------------------
    dp_s = dp_exposed = dp_wire = 0.0
    states = [rank_state_bytes(mcfg, plan, tcfg, r) for r in range(world)]
    mesh = plan.tp > 1 or plan.pp > 1 or plan.recompute != "none"
    if plan.dp > 1:
        payload = dp_payload_bytes(mcfg, plan, tcfg, 0)
        gather_e = 2 if tcfg.dtype == "bfloat16" else e  # ZeRO-3 gathers what it computes in
        calls = _dp_calls(mcfg, plan, lay0, e, gather_e)
        dp_wire = dp_sync_wire_bytes(payload, plan.dp, plan.zero, m if plan.pp == 1 else 1) \
            if plan.compress is None else coll.compressed_wire_bytes(plan.dp, payload)
        if plan.zero == 3 and gather_e != e:  # the systems formula assumes one dtype
            dp_wire = sum(k * coll.wire_bytes(op, "ring", plan.dp, n) for op, n, k in calls)
        dp_s = sum(k * coll.time_s(op, "ring", plan.dp, n, a, bw) for op, n, k in calls)
        # Buckets that fill before backward ends can hide under it; the last cannot, and a
        # mesh run or overlap off reduces after backward. ZeRO-3 gathers sit in the path.
        hidden = 0.0
        last = calls[-1][1]
        total = sum(n for _, n, _ in calls)
        if plan.overlap and not mesh and plan.zero in (0, 1, 2) and len(calls) > 1:
            hidden = min(dp_s * (1 - last / total), (2 / 3) * stages[0][0])
        dp_exposed = dp_s - hidden

    crit = flop_s + overhead_s + tp_s + pp_s + dp_exposed
    # CPU work of the whole session per step: every rank's compute and fixed costs, and
    # the CPU its collectives and sends cost (per ring step and per byte sent, measured).
    cpu = []
    for i in range(plan.pp):
        lay_s = rank_layout(mcfg, plan, i * plan.dp * plan.tp)
        c = m * (stages[i][0] + stages[i][1]) + fixed_s
        c += _comm_cpu(machine, plan, "tp", _tp_calls(mcfg, plan, lay_s, act, seqs_mb,
                                                      act_fwd))
        c += _comm_cpu(machine, plan, "pp", _pp_calls(plan, lay_s, act, v))
        if plan.dp > 1:
            c += _comm_cpu(machine, plan, "dp", _dp_calls(
                mcfg, plan, lay_s, e, 2 if tcfg.dtype == "bfloat16" else e))
        c += _comm_cpu(machine, plan, "world", [("all_reduce", 8.0, 2)])  # loss, grad norm
        cpu.append(c)
    work = plan.dp * plan.tp * sum(cpu)
    cores = share * world
    step = max(crit, work / cores)
    if work / cores > crit:
        notes.append(f"CPU-bound: the session's {work:.3f} CPU s per step on {cores:.2f} "
                     f"cores take longer than the critical path ({crit:.3f} s)")
    from paratrain.parallel.memory import predicted_activations, predicted_states

    sys_states = sum(predicted_states(mcfg, plan, tcfg).values())
    return Prediction(step, flop_s, overhead_s, bubble_s, tp_s, pp_s, dp_s, dp_exposed, share,
                      crit, work, cores, cpu[0], dp_wire, tp_wire, pp_wire, states, sys_states,
                      predicted_activations(mcfg, plan, tcfg), machine.source, notes)


# ---- fitting eta and the fixed costs from single-process runs -------------------------------
def fit_from_runs(mcfg: ModelConfig, runs: list[tuple[int, int, float]], hw: Hardware,
                  thread_peak: float) -> MachineModel:
    """Least squares t = F / R + units x pass_s + step_s over one-process runs.

    ``runs``: (global_batch, micro_batches, seconds per step on a whole core: CPU time)
    of the same model. F is the step's FLOPs, units = micro_batches x (blocks + 1). Needs
    runs that differ in both batch and micro-batches (at least 3). eta = R / thread_peak.
    """
    if len(runs) < 3:
        raise ValueError(f"{len(runs)} runs cannot fit 3 parameters; pass at least 3")
    rows, ts = [], []
    for gb, m, t in runs:
        f = mcfg.n_layers * _flops_block(mcfg, gb * mcfg.context, 1) + \
            gb * mcfg.context * 6.0 * mcfg.d_model * mcfg.vocab_size
        rows.append((f, m * (mcfg.n_layers + 1), 1.0))
        ts.append(t)
    inv_r, pass_s, step_s = _nnls3(rows, ts)
    if inv_r <= 0:
        raise ValueError("the fit found no FLOP-proportional time; use larger batches")
    return MachineModel(hw, 1.0 / inv_r / thread_peak, thread_peak, pass_s, step_s,
                        fitted=True, source="fit")


def _solve3(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination for a small square system; None if singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        piv = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[piv][c]) < 1e-300:
            return None
        m[c], m[piv] = m[piv], m[c]
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


def _nnls3(rows: list[tuple[float, ...]], ts: list[float]) -> list[float]:
    """Non-negative least squares for 3 unknowns: try every subset of free unknowns
    (8 of them), keep the best feasible one. Columns are scaled first."""
    k = len(rows[0])
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(k)]
    x_rows = [[r[j] / scale[j] for j in range(k)] for r in rows]
    best, best_err = [0.0] * k, sum(t * t for t in ts)
    for mask in range(1, 1 << k):
        free = [j for j in range(k) if mask >> j & 1]
        ata = [[sum(r[i] * r[j] for r in x_rows) for j in free] for i in free]
        atb = [sum(r[i] * t for r, t in zip(x_rows, ts, strict=True)) for i in free]
        sol = _solve3(ata, atb)
        if sol is None or min(sol) < 0:
            continue
        x = [0.0] * k
        for j, v in zip(free, sol, strict=True):
            x[j] = v
        err = sum((sum(r[j] * x[j] for j in range(k)) - t) ** 2
                  for r, t in zip(x_rows, ts, strict=True))
        if err < best_err - 1e-18:
            best, best_err = x, err
    return [best[j] / scale[j] for j in range(k)]


# ---- predicted vs measured ----------------------------------------------------------------
def compare(pred: Prediction, summary: dict, plan: ParallelPlan) -> dict:
    """Predicted beside measured for one run's summary (rank 0's view; memory per rank)."""
    meas_ranks = summary.get("memory", {}).get("measured_per_rank", [])
    states_exact = bool(meas_ranks) and all(
        all(m[k] == p[k] for k in ("params", "grads", "optimizer"))
        for m, p in zip(meas_ranks, pred.states_bytes_per_rank, strict=False))
    tp_meas = None
    mp = summary.get("model_parallel") or {}
    if "tp" in mp:
        layers = mp["activation"]["layers_on_rank"]
        tp_meas = mp["tp"]["wire_bytes_per_layer_per_microbatch"] * layers * plan.micro_batches
    act_meas = max((m.get("activations_peak", 0) for m in meas_ranks), default=0)
    step_m = summary["step_s"]
    return {
        "step_s": {"predicted": pred.step_s, "measured": step_m,
                   "error": pred.step_s / step_m - 1 if step_m else float("nan")},
        "compute_s": {"predicted": pred.step_s - pred.comm_s,
                      "measured": summary["compute_s_per_step"]},
        "comm_s": {"predicted": pred.comm_s, "measured": summary["comm_s_per_step"]},
        "dp_wire_bytes": {"predicted": pred.dp_wire_bytes,
                          "measured": summary["wire_bytes_per_step"],
                          "exact": pred.dp_wire_bytes == summary["wire_bytes_per_step"]},
        "tp_wire_bytes": {"predicted": pred.tp_wire_bytes, "measured": tp_meas,
                          "exact": None if tp_meas is None else
                          math.isclose(pred.tp_wire_bytes, tp_meas, rel_tol=1e-12)},
        "states_bytes": {"predicted_per_rank": pred.states_bytes_per_rank,
                         "measured_per_rank": [{k: m[k] for k in ("params", "grads",
                                                                  "optimizer")}
                                               for m in meas_ranks],
                         "exact": states_exact},
        "activations_bytes": {"predicted": pred.activations_bytes, "measured": act_meas},
    }


def summary_prediction(mcfg: ModelConfig, tcfg: TrainConfig, plan: ParallelPlan, world: int,
                       summary: dict, profile: str | Path | None = None) -> dict | None:
    """``summary["prediction"]`` for a finished run, or None without a profile. The other
    sessions' load is sampled now, at the end of the run (a proxy for during it)."""
    machine = load_machine(profile)
    if machine is None:
        return None
    machine = machine.replace(others=sample_other_sessions(samples=5))
    pred = predict(mcfg, tcfg, plan, world, machine)
    import torch

    if torch.get_num_threads() > 1:  # the model prices one-thread ranks (workers set 1)
        pred.notes.append(f"this process ran {torch.get_num_threads()} intra-op threads; the "
                          "prediction prices one thread per rank")
    return {"predicted": pred.to_dict(), "vs_measured": compare(pred, summary, plan)}


def summary_row(rep: dict | None) -> tuple[str, str]:
    """One row for the run's summary table: predicted step time, or what to do."""
    if rep is None:
        return "predicted s/step", "no hardware profile: run `paratrain bench calibrate`"
    if "error" in rep:
        return "predicted s/step", f"profile unusable: {rep['error']}"
    c = rep["vs_measured"]["step_s"]
    return "predicted s/step", (f"{c['predicted']:.4f}  ({100 * c['error']:+.0f}% vs "
                                f"measured; breakdown above)")


def format_prediction(rep: dict | None) -> str:
    """A few lines for the end of a run: predicted beside measured."""
    if rep is None:
        return CALIBRATE_HINT
    if "error" in rep:
        return f"prediction: skipped, the hardware profile is unusable: {rep['error']}"
    p, c = rep["predicted"], rep["vs_measured"]
    mb = 1e6
    st = c["states_bytes"]
    m0 = st["measured_per_rank"][0] if st["measured_per_rank"] else None
    p0 = st["predicted_per_rank"][0]
    lines = [
        f"prediction ({p['machine']}; {p['share']:.2f} core per rank)",
        f"  step s      predicted {p['step_s']:.4f}  measured {c['step_s']['measured']:.4f}"
        f"  ({100 * c['step_s']['error']:+.0f}%)",
        f"  bounds      critical path {p['critical_path_s']:.4f} s; session CPU work "
        f"{p['session_work_s']:.4f} s on {p['session_cores']:.2f} cores = "
        f"{p['session_work_s'] / p['session_cores']:.4f} s; rank 0 CPU {p['cpu_rank0_s']:.4f} s",
        f"  compute s   predicted {c['compute_s']['predicted']:.4f} (FLOPs "
        f"{p['compute_s']:.4f}, fixed {p['overhead_s']:.4f}, bubble {p['bubble_s']:.4f}, "
        f"TP {p['tp_comm_s']:.4f}, PP {p['pp_comm_s']:.4f})  measured "
        f"{c['compute_s']['measured']:.4f}",
        f"  comm s      predicted {c['comm_s']['predicted']:.4f} (DP sync "
        f"{p['dp_comm_s']:.4f})  measured {c['comm_s']['measured']:.4f}",
        f"  wire MB/rank DP predicted {p['dp_wire_bytes'] / mb:.4f}  measured "
        f"{c['dp_wire_bytes']['measured'] / mb:.4f}"
        f"  {'exact' if c['dp_wire_bytes']['exact'] else 'DIFFERENT'}",
    ]
    if c["tp_wire_bytes"]["measured"] is not None:
        lines.append(f"  wire MB/rank TP predicted {p['tp_wire_bytes'] / mb:.4f}  measured "
                     f"{c['tp_wire_bytes']['measured'] / mb:.4f}"
                     f"  {'exact' if c['tp_wire_bytes']['exact'] else 'DIFFERENT'}")
    if p["pp_wire_bytes"]:
        lines.append(f"  wire MB/rank PP predicted {p['pp_wire_bytes'] / mb:.4f} (sends are "
                     "not counted by the runtime)")
    if m0 is not None:
        pt, mt = sum(p0.values()), sum(m0.values())
        lines.append(f"  model states MB rank 0 predicted {pt / mb:.4f}  measured {mt / mb:.4f}"
                     f"  {'exact on every rank' if st['exact'] else 'DIFFERENT'}"
                     f" (systems formula {p['systems_states_bytes'] / mb:.4f})")
    a = c["activations_bytes"]
    lines.append(f"  activations MB predicted {a['predicted'] / mb:.4f} (Korthikanti) "
                 f"measured peak {a['measured'] / mb:.4f}")
    lines += [f"  note: {n}" for n in p["notes"]]
    return "\n".join(lines)
