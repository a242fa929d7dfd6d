"""What every rank holds and sends, counted exactly, without torch: the one home of the
runtime's per-rank layout (:mod:`paratrain.parallel.mesh_engine`).

The runtime builds its layout from tensors; the prediction (:mod:`paratrain.predict`)
and the tests count it from the configs here, and the runtime calls the pieces it can
(:func:`vocab_range` in :mod:`paratrain.parallel.tensor`, :func:`pack_groups` in
:func:`paratrain.parallel.ddp.pack`), so the two cannot drift apart.

- **Coordinates** (:func:`coords`, :func:`mesh_coords`): rank = ((pp_i x dp + dp_i) x cp
  + cp_i) x tp + tp_i, tp innermost, then cp, dp, pp (:mod:`paratrain.parallel.mesh`).
- **Context parallelism** (:func:`cp_chunks`, :func:`ring_blocks`, :func:`cp_wire_bytes`):
  which sequence pieces a cp rank holds, which attention blocks it computes at each ring
  step, and the bytes it sends (:mod:`paratrain.parallel.context`).
- **Chunks** (:func:`chunk_param_sizes`): pipeline rank i keeps virtual stages
  k = c x pp + i, c < v (v = ``virtual_stages`` when interleaved, else 1), blocks from
  :func:`paratrain.systems.stages.split_layers`; without a pipeline one chunk, the whole
  model. Parameters in registration order: tok_emb (first stage), per block
  [attn_norm, wq, wk, wv, wo, mlp_norm, w_gate, w_up, w_down], norm and head (last);
  a tied head (pp = 1 only) is the embedding's parameter, counted once. An MoE block's
  MLP is [router, this ep rank's E/ep experts x (gate, up, down), shared (gate, up,
  down)], not tp-sharded (:func:`block_param_sizes`); with ep > 1 a rank has two
  reducers, dense over dp and experts over dp / ep ranks (:func:`reducers`).
- **Tensor shards**: heads and d_ff split t ways; vocabulary rows ceil(V/t) per rank,
  the last rank fewer (:func:`vocab_range`); norm gains replicated.
- **The dp reducer** (:func:`dp_kind`, as :func:`paratrain.parallel.data_axis.kind_of`):
  flat buffers per chunk (gradient buckets of at most ``bucket_mb`` MiB packed greedily
  in reverse registration order, :func:`bucket_sizes`; or FSDP units,
  :func:`fsdp_unit_sizes`), each padded to a multiple of dp; rank r owns chunk r.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.config import ModelConfig
from paratrain.plan import ParallelPlan
from paratrain.systems.stages import split_layers

# Bytes per element of the working parameters (what every rank computes with).
ELEMENT_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2}


def elements(dtype: str, reduce_dtype: str = "bfloat16") -> tuple[int, int, int]:
    """(working, gradient, master) bytes per element of a run (parallel/precision.py):
    float32 / float64 keep one copy; bfloat16 is BF16 parameters, gradients reduced in
    ``reduce_dtype`` and FP32 masters in the optimizer."""
    w = ELEMENT_BYTES[dtype]
    if dtype != "bfloat16":
        return w, w, w
    return w, ELEMENT_BYTES[reduce_dtype] if reduce_dtype == "bfloat16" else 4, 4
PER_BLOCK = 9  # parameters of one block: two norms, four attention, three MLP matrices


# ---- coordinates and shards -----------------------------------------------------------
def mesh_coords(rank: int, plan: ParallelPlan) -> tuple[int, int, int, int]:
    """(pp, dp, cp, tp) of a global rank: the runtime's pp-dp-cp-tp order, tp innermost."""
    tp, cp, dp = plan.tp, plan.cp, plan.dp
    return (rank // (dp * cp * tp), (rank // (cp * tp)) % dp, (rank // tp) % cp, rank % tp)


def coords(rank: int, plan: ParallelPlan) -> tuple[int, int, int]:
    """(pp, dp, tp) of a global rank (its cp index: :func:`mesh_coords`)."""
    pp, dp, _, tp = mesh_coords(rank, plan)
    return pp, dp, tp


def rank_of(pp: int, dp: int, tp: int, plan: ParallelPlan, cp: int = 0) -> int:
    """Inverse of :func:`mesh_coords` (cp index 0 unless given)."""
    return ((pp * plan.dp + dp) * plan.cp + cp) * plan.tp + tp


def vocab_range(vocab: int, tp: int, rank: int) -> tuple[int, int]:
    """Rows [start, end) of a vocabulary of ``vocab`` owned by ``rank`` of ``tp``:
    ceil(vocab / tp) each, the last rank(s) fewer."""
    if vocab < tp:
        raise ValueError(f"vocab_size={vocab} is smaller than tp={tp}: a rank would own no "
                         "rows; use tp <= vocab_size")
    per = -(-vocab // tp)
    return min(rank * per, vocab), min((rank + 1) * per, vocab)


def virtual_stages(plan: ParallelPlan) -> int:
    """Chunks per pipeline rank: ``virtual_stages`` when interleaved, else 1."""
    return plan.virtual_stages if plan.schedule == "interleaved" and plan.pp > 1 else 1


def block_param_sizes(mcfg: ModelConfig, tp: int = 1, i: int | None = None, ep: int = 1,
                      part: str = "all") -> list[int]:
    """Elements of block ``i``'s parameters on one tp rank, in registration order (``i``
    None: a dense block). An MoE MLP (:class:`paratrain.model.MoE`) is not tp-sharded:
    router (E x d), this ep rank's E/ep experts (gate, up, down each), the shared
    experts' three matrices. ``part``: "all", "dense" (all but the routed experts) or
    "expert" (only those) — the two gradient reducers of expert parallelism."""
    d, hd, t = mcfg.d_model, mcfg.head_dim, tp
    q, kv = mcfg.n_heads * hd * d // t, mcfg.kv_heads * hd * d // t
    attn = [d, q, kv, kv, q, d]
    if i is None or not mcfg.is_moe_layer(i):
        f = mcfg.d_ff * d // t
        return [] if part == "expert" else attn + [f, f, f]
    fe = mcfg.expert_ffn * d
    experts = [fe] * (3 * (mcfg.experts // ep))
    shared = [fe * mcfg.shared_experts] * 3 if mcfg.shared_experts else []
    if part == "expert":
        return experts
    if part == "dense":
        return attn + [d * mcfg.experts] + shared
    return attn + [d * mcfg.experts] + experts + shared


# ---- what a rank holds ----------------------------------------------------------------
@dataclass(frozen=True)
class RankLayout:
    """One rank: its coordinates, and per chunk (virtual stage) the element counts of its
    trainable parameters in registration order."""

    rank: int
    pp: int
    dp: int
    tp: int
    stages: tuple[int, ...]  # virtual stage of each chunk
    ranges: tuple[tuple[int, int], ...]  # blocks [a, b) of each chunk
    chunks: tuple[tuple[int, ...], ...]
    first: bool  # holds the embedding
    last: bool  # holds the final norm and head
    tied: bool  # the head is the embedding's parameter (pp = 1)
    block_counts: tuple[tuple[int, ...], ...] = ()  # per chunk, parameters of each block

    @property
    def blocks(self) -> int:
        return sum(b - a for a, b in self.ranges)

    @property
    def param_sizes(self) -> tuple[int, ...]:
        return tuple(n for c in self.chunks for n in c)

    @property
    def params(self) -> int:
        return sum(self.param_sizes)


def rank_layout(mcfg: ModelConfig, plan: ParallelPlan, rank: int, part: str = "all",
                ep: int | None = None) -> RankLayout:
    """Parameters of ``rank`` as the runtime shards them (exact element counts); ``part``
    and ``ep`` (default the plan's) as in :func:`block_param_sizes`."""
    pp_i, dp_i, tp_i = coords(rank, plan)
    ep = plan.ep if ep is None else ep
    v = virtual_stages(plan)
    S = plan.pp * v
    ranges = split_layers(mcfg, S)
    a0, b0 = vocab_range(mcfg.vocab_size, plan.tp, tp_i)
    rows = (b0 - a0) * mcfg.d_model
    tied = mcfg.tie_embeddings and S == 1
    edges = part != "expert"
    stages, chunks, counts = [], [], []
    for c in range(v):
        k = c * plan.pp + pp_i
        a, b = ranges[k]
        sizes = [rows] if k == 0 and edges else []
        blocks = [block_param_sizes(mcfg, plan.tp, i, ep, part) for i in range(a, b)]
        sizes += [n for blk in blocks for n in blk]
        if k == S - 1 and edges:
            sizes.append(mcfg.d_model)
            if not tied:
                sizes.append(rows)
        stages.append(k)
        chunks.append(tuple(sizes))
        counts.append(tuple(len(blk) for blk in blocks))
    return RankLayout(rank, pp_i, dp_i, tp_i, tuple(stages),
                      tuple(ranges[k] for k in stages), tuple(chunks), 0 in stages,
                      S - 1 in stages, tied, tuple(counts))


def reducers(plan: ParallelPlan, rank: int) -> list[tuple[ParallelPlan, int, str, int]]:
    """(plan as the reducer sees it, rank in it, part, ep) of each gradient reducer of
    ``rank``: one, or with ep > 1 the dense one over dp and the expert one over the
    dp / ep ranks holding the same experts (index dp_i // ep;
    :mod:`paratrain.parallel.expert`)."""
    if plan.ep == 1:
        return [(plan, rank, "all", 1)]
    pp_i, dp_i, cp_i, tp_i = mesh_coords(rank, plan)
    eplan = plan.replace(dp=plan.dp // plan.ep, ep=1)
    return [(plan.replace(ep=1), rank, "dense", plan.ep),
            (eplan, rank_of(pp_i, dp_i // plan.ep, tp_i, eplan, cp_i), "expert", plan.ep)]


def chunk_param_sizes(mcfg: ModelConfig, plan: ParallelPlan, rank: int
                      ) -> list[list[int]]:
    """Per chunk, the elements of each trainable parameter in registration order."""
    return [list(c) for c in rank_layout(mcfg, plan, rank).chunks]


# ---- flat buffers ----------------------------------------------------------------------
def pack_groups(nbytes: list[int], cap_bytes: int) -> list[list[int]]:
    """Indices of ``nbytes`` grouped greedily in the given order into buckets of at most
    ``cap_bytes``; an item larger than the cap gets its own bucket. The rule of
    :func:`paratrain.parallel.ddp.pack`, which calls this."""
    groups: list[list[int]] = []
    cur: list[int] = []
    cur_b = 0
    for i, b in enumerate(nbytes):
        if cur and cur_b + b > cap_bytes:
            groups.append(cur)
            cur, cur_b = [], 0
        cur.append(i)
        cur_b += b
    if cur:
        groups.append(cur)
    return groups


def bucket_sizes(sizes: list[int], elem: int, cap_bytes: int) -> list[int]:
    """Element counts (unpadded) of the gradient buckets of one chunk whose parameters
    have ``sizes`` elements in registration order: packed in reverse order."""
    rev = list(reversed(sizes))
    return [sum(rev[i] for i in g) for g in pack_groups([n * elem for n in rev], cap_bytes)]


def fsdp_unit_sizes(lay: RankLayout) -> list[list[int]]:
    """Per chunk, element counts of its ZeRO-3 units (:func:`paratrain.parallel.fsdp.
    default_units`): [tok_emb], each block, [norm, head]; tied: [tok_emb + norm] first."""
    out = []
    counts = lay.block_counts or tuple((PER_BLOCK,) * (b - a) for a, b in lay.ranges)
    for k, sizes, per in zip(lay.stages, lay.chunks, counts, strict=True):
        rest = list(sizes)
        emb = [rest.pop(0)] if k == 0 else []
        nb = sum(per)
        starts = [sum(per[:j]) for j in range(len(per))]
        blocks = [sum(rest[a:a + n]) for a, n in zip(starts, per, strict=True)]
        tail = rest[nb:]
        if lay.tied:
            out.append([emb[0] + sum(tail), *blocks])
        else:
            out.append([*emb, *blocks, *([sum(tail)] if tail else [])])
    return out


def pad(n: int, p: int) -> int:
    """Flat buffers are padded to a multiple of the data-parallel size (equal chunks)."""
    return -(-n // p) * p


def owned(n: int, p: int, r: int) -> int:
    """Real (not padding) elements in chunk r of a flat buffer of n padded to p."""
    s = -(-n // p)
    return max(0, min((r + 1) * s, n) - r * s)


def topk_keep(plan: ParallelPlan, n: int) -> int:
    """Gradient entries top-k compression keeps of ``n``: 1 in k (at least one)."""
    return max(1, n // int(plan.compress.partition(":")[2]))


def reducer_plan(plan: ParallelPlan) -> ParallelPlan:
    """The plan as its gradient reducer sees it: cp ranks hold the same parameters, so
    the reducer runs on dp x cp ranks (the mesh's ``dpcp`` group). Folding cp into dp
    keeps every global rank number (((pp x dp + d) x cp + c) x tp + t = (pp x dp cp +
    (d cp + c)) x tp + t), and the dp index becomes the index in ``dpcp``."""
    return plan if plan.cp == 1 else plan.replace(dp=plan.dp * plan.cp, cp=1)


def dp_kind(plan: ParallelPlan) -> str:
    """The reducer on the plan's dp axis (:func:`paratrain.parallel.data_axis.kind_of`)."""
    plan = reducer_plan(plan)
    if plan.dp == 1:
        return "none"
    if plan.compress is not None:
        return "topk"
    return ("ddp", "zero", "zero", "fsdp")[plan.zero]


def dp_flats(mcfg: ModelConfig, plan: ParallelPlan, elem: int, rank: int,
             part: str = "all", ep: int | None = None) -> list[int]:
    """Unpadded element counts of the rank's flat dp buffers (buckets or units), all
    chunks in order; empty for the reducers without flat buffers. ``part``, ``ep``: one
    reducer of :func:`reducers`."""
    plan = reducer_plan(plan)
    kind = dp_kind(plan)
    lay = rank_layout(mcfg, plan, rank, part, ep)
    if kind == "fsdp":
        return [u for c in fsdp_unit_sizes(lay) for u in c]
    if kind in ("ddp", "zero"):
        cap = int(plan.bucket_mb * 1024 * 1024)
        return [b for c in lay.chunks for b in bucket_sizes(list(c), elem, cap)]
    return []


# ---- bytes -----------------------------------------------------------------------------
def state_bytes(mcfg: ModelConfig, plan: ParallelPlan, dtype: str, rank: int,
                reduce_dtype: str = "bfloat16") -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state (AdamW m, v and, under mixed
    precision, the FP32 masters) on ``rank`` as the memory tracker measures them
    (distinct storages: flat buffers with their padding). With ep > 1 the sum over the
    two reducers (:func:`reducers`)."""
    if plan.ep > 1:
        parts = [_state_bytes(mcfg, q, dtype, r, reduce_dtype, part, ep)
                 for q, r, part, ep in reducers(plan, rank)]
        return {k: sum(d[k] for d in parts) for k in parts[0]}
    return _state_bytes(mcfg, plan, dtype, rank, reduce_dtype)


def _state_bytes(mcfg: ModelConfig, plan: ParallelPlan, dtype: str, rank: int,
                 reduce_dtype: str, part: str = "all", ep: int = 1) -> dict[str, int]:
    plan = reducer_plan(plan)
    w, g, m = elements(dtype, reduce_dtype)
    mixed = dtype == "bfloat16"
    lay = rank_layout(mcfg, plan, rank, part, ep)
    n, p, r = lay.params, plan.dp, lay.dp
    kind = dp_kind(plan)
    flats = dp_flats(mcfg, plan, w, rank, part, ep)
    padded = sum(pad(b, p) for b in flats)
    own = sum(owned(b, p, r) for b in flats)
    if kind in ("none", "topk"):  # a master per parameter
        return {"params": w * n, "grads": w * n, "optimizer": (2 + mixed) * m * n}
    if kind == "ddp":  # grads are (or main_grad is) views into the padded buckets
        return {"params": w * n, "grads": g * padded, "optimizer": (2 + mixed) * m * n}
    masters = m * padded // p if mixed else 0  # a master of each whole owned chunk
    if kind == "fsdp":
        return {"params": w * padded // p, "grads": g * padded // p,
                "optimizer": 2 * m * own + masters}
    # ZeRO-2 keeps only the owned shard, except under a pipeline (full buffers, as ZeRO-1)
    grads = padded // p if plan.zero == 2 and plan.pp == 1 else padded
    return {"params": w * padded, "grads": g * grads, "optimizer": 2 * m * own + masters}


def dp_payload_bytes(mcfg: ModelConfig, plan: ParallelPlan, dtype: str, rank: int,
                     reduce_dtype: str = "bfloat16") -> int:
    """Bytes this rank contributes to one dp reduction: its flat buffers with their
    padding in the reduction dtype, or under top-k its kept values and int32 indices; 0
    without a dp axis (with ep > 1: both reducers')."""
    if plan.ep > 1:
        w, g, _ = elements(dtype, reduce_dtype)
        return sum(0 if dp_kind(q) == "none" else
                   g * sum(pad(b, q.dp) for b in dp_flats(mcfg, q, w, r, part, ep))
                   for q, r, part, ep in reducers(plan, rank))
    plan = reducer_plan(plan)
    w, g, _ = elements(dtype, reduce_dtype)
    kind = dp_kind(plan)
    if kind == "none":
        return 0
    if kind == "topk":
        return topk_keep(plan, rank_layout(mcfg, plan, rank).params) * (w + 4)
    return g * sum(pad(b, plan.dp) for b in dp_flats(mcfg, plan, w, rank))


def dp_wire_factor(plan: ParallelPlan, micro_batches: int | None = None) -> float:
    """Wire bytes per rank and step of the dp sync in units of (p-1)/p x payload
    (:func:`dp_payload_bytes`), with ``micro_batches`` (default the plan's) per step:

    - ZeRO 0 / 1: one all-reduce, or reduce-scatter + all-gather (the all-gather of step
      k is sent in step k+1, so a steady step has both): 2;
    - ZeRO 2 without a pipeline: a reduce-scatter every micro-batch and one all-gather:
      m + 1; with a pipeline gradients stay whole over the step: 2;
    - ZeRO 3 without a pipeline: two all-gathers and a reduce-scatter per micro-batch:
      3m; with a pipeline each unit is gathered and reduced once per step: 2;
    - top-k: every rank's kept entries are all-gathered, (p-1) x payload: p;
    - no dp axis: 0.
    """
    plan = reducer_plan(plan)
    m = plan.micro_batches if micro_batches is None else micro_batches
    kind = dp_kind(plan)
    if kind == "none":
        return 0.0
    if kind == "topk":
        return float(plan.dp)
    return zero_wire_factor(plan.zero, m, plan.pp > 1)


def zero_wire_factor(zero: int, micro_batches: int, pipelined: bool) -> float:
    """:func:`dp_wire_factor` of ``--zero`` 0-3 (for the systems model, which has no
    plan of dp = 1 or top-k to ask about)."""
    if zero <= 1 or pipelined:
        return 2.0
    return float(micro_batches + 1) if zero == 2 else 3.0 * micro_batches


def dp_calls(mcfg: ModelConfig, plan: ParallelPlan, dtype: str, rank: int,
             reduce_dtype: str = "bfloat16", part: str = "all", ep: int | None = None
             ) -> list[tuple[str, float, int]]:
    """(op, full bytes, calls per step) of a rank's dp sync, one entry per flat buffer
    and op: reductions in the gradient dtype, parameter all-gathers in the working one
    (with ep > 1: the dense reducer's, then the expert reducer's)."""
    if plan.ep > 1 and part == "all":
        return [c for q, r, pt, e in reducers(plan, rank)
                for c in dp_calls(mcfg, q, dtype, r, reduce_dtype, pt, e)]
    plan = reducer_plan(plan)
    w, g, _ = elements(dtype, reduce_dtype)
    p, kind = plan.dp, dp_kind(plan)
    m = plan.micro_batches if plan.pp == 1 else 1
    if kind == "none":
        return []
    if kind == "topk":  # values and indices: p pieces of each
        keep = topk_keep(plan, rank_layout(mcfg, plan, rank).params)
        return [("all_gather", p * keep * w, 1), ("all_gather", p * keep * 4, 1)]
    flats = [pad(b, p) for b in dp_flats(mcfg, plan, w, rank, part, ep)]
    if kind == "ddp":
        return [("all_reduce", g * n, 1) for n in flats]
    if kind == "fsdp":
        gathers = 2 * m if plan.pp == 1 else 1
        return [c for n in flats for c in (("all_gather", w * n, gathers),
                                           ("reduce_scatter", g * n, m))]
    rs = m if plan.zero == 2 and plan.pp == 1 else 1
    return [c for n in flats for c in (("reduce_scatter", g * n, rs), ("all_gather", w * n, 1))]


def dp_wire_bytes(mcfg: ModelConfig, plan: ParallelPlan, dtype: str, rank: int,
                  reduce_dtype: str = "bfloat16") -> float:
    """Bytes ``rank`` sends per steady step for its dp sync (ring collectives); with
    ep > 1 both reducers' (each over its own group size)."""
    if plan.ep > 1:
        w, g, _ = elements(dtype, reduce_dtype)
        total = 0.0
        for q, r, part, ep in reducers(plan, rank):
            if dp_kind(q) == "none":
                continue
            payload = g * sum(pad(b, q.dp) for b in dp_flats(mcfg, q, w, r, part, ep))
            if w != g and dp_kind(q) == "zero":
                total += sum(k * n * (q.dp - 1) / q.dp for _, n, k in
                             dp_calls(mcfg, q, dtype, r, reduce_dtype, part, ep))
            else:
                total += dp_wire_factor(q) * (q.dp - 1) / q.dp * payload
        return total
    plan = reducer_plan(plan)
    p = plan.dp
    if dp_kind(plan) == "none":
        return 0.0
    w, g, _ = elements(dtype, reduce_dtype)
    if w != g and dp_kind(plan) in ("zero", "fsdp"):  # gathers and reductions differ
        return sum(k * n * (p - 1) / p for _, n, k in
                   dp_calls(mcfg, plan, dtype, rank, reduce_dtype))
    return dp_wire_factor(plan) * (p - 1) / p * dp_payload_bytes(mcfg, plan, dtype, rank,
                                                                 reduce_dtype)


# ---- context parallelism ----------------------------------------------------------------
def cp_chunks(cp: int, i: int) -> tuple[int, int]:
    """The two of the 2 cp sequence chunks cp rank ``i`` holds, in its local order:
    i and 2cp-1-i (an early and a late one, so causal work is equal on every rank)."""
    return i, 2 * cp - 1 - i


def cp_positions(T: int, cp: int, i: int) -> list[int]:
    """Global positions of cp rank ``i``'s T/cp tokens, in its local order."""
    if T % (2 * cp):
        raise ValueError(f"context {T} is not divisible by 2*cp={2 * cp} (the load-balanced "
                         f"split cuts each sequence into 2*cp chunks); use a multiple of "
                         f"{2 * cp}")
    c = T // (2 * cp)
    return [k * c + t for k in cp_chunks(cp, i) for t in range(c)]


def _kind(qc: int, kc: int) -> str | None:
    return "full" if kc < qc else "diag" if kc == qc else None


def ring_blocks(cp: int, i: int) -> list[tuple[int, list[tuple[int, int, str]]]]:
    """The ring schedule of cp rank ``i``, the one :class:`paratrain.parallel.context.
    RingAttention` runs: per step s, the rank whose K/V block it holds (j = i - s mod cp)
    and the (query chunk, key chunk, kind) sub-blocks it computes; kind "full" (every
    key visible), "diag" (causal mask within the chunk); sub-blocks whose keys all lie
    after the queries are skipped (not listed)."""
    out = []
    for s in range(cp):
        j = (i - s) % cp
        blocks = [(qc, kc, k) for qc in cp_chunks(cp, i) for kc in cp_chunks(cp, j)
                  if (k := _kind(qc, kc)) is not None]
        out.append((j, blocks))
    return out


def contiguous_blocks(cp: int, i: int) -> list[tuple[int, list[tuple[int, int, str]]]]:
    """The same schedule for a contiguous split (rank i holds tokens [iT/cp, (i+1)T/cp)),
    for comparison: one chunk per rank."""
    out = []
    for s in range(cp):
        j = (i - s) % cp
        k = _kind(i, j)
        out.append((j, [(i, j, k)] if k else []))
    return out


def attention_pairs_per_rank(T: int, cp: int, balanced: bool = True) -> list[int]:
    """(query, key) pairs each cp rank scores under the causal mask, counted from the
    block schedule (attention FLOPs are proportional): a full c x c sub-block counts c^2,
    a diagonal one c(c+1)/2; c = T/(2cp) balanced, T/cp contiguous."""
    c = T // (2 * cp) if balanced else T // cp
    sched = ring_blocks if balanced else contiguous_blocks
    return [sum(c * c if k == "full" else c * (c + 1) // 2
                for _, blocks in sched(cp, i) for _, _, k in blocks) for i in range(cp)]


def cp_bytes_per_sequence_layer(mcfg: ModelConfig, plan: ParallelPlan, elem: int
                                ) -> tuple[int, int]:
    """(forward, backward) bytes one cp rank sends per layer and per sequence:

    - ring: forward, K and V blocks (T/cp tokens x kv heads/tp x head_dim) go cp-1 hops;
      backward, K and V again cp-1 hops and their gradients cp hops (the last one home),
      the gradients in float32 when the working dtype is 16-bit;
    - all-to-all: q, k, v to head-sharded and the output back, each sending (cp-1)/cp
      of the local tensor; backward the same four with gradients.
    """
    N, T, E = plan.cp, mcfg.context, mcfg.head_dim
    if N == 1:
        return 0, 0
    L = T // N
    kv = 2 * L * (mcfg.kv_heads // plan.tp) * E * elem
    if plan.cp_algorithm == "ring":
        acc = kv // elem * (4 if elem == 2 else elem)
        return (N - 1) * kv, (N - 1) * kv + N * acc
    q = L * (mcfg.n_heads // plan.tp) * E * elem
    a2a = (N - 1) * (2 * q + kv) // N
    return a2a, a2a


def cp_wire_bytes(mcfg: ModelConfig, plan: ParallelPlan, elem: int, batch: int,
                  layers: int) -> int:
    """Bytes one cp rank sends for attention in one training step of ``batch`` sequences
    (all micro-batches) through ``layers`` blocks; recompute (selective or full) reruns
    the forward's sends in backward, except what torch's checkpoint does not rerun."""
    fwd, bwd = cp_bytes_per_sequence_layer(mcfg, plan, elem)
    again = 0 if plan.recompute == "none" else fwd
    if plan.recompute == "selective" and plan.cp_algorithm == "all-to-all" and plan.cp > 1:
        # torch's checkpoint stops recomputing once the last saved tensor is rebuilt: the
        # core's output all-to-all (nothing after it is saved inside the core) is not rerun
        N = plan.cp
        again -= (N - 1) * (mcfg.context // N) * (mcfg.n_heads // plan.tp) \
            * mcfg.head_dim * elem // N
    return layers * batch * (fwd + again + bwd)
