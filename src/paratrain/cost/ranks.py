"""Coordinates, shards and the parameters each rank holds (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.config import ModelConfig
from paratrain.cost.schedule import V_SHAPED, stage_of
from paratrain.cost.stages import split_layers
from paratrain.plan import ParallelPlan

ELEMENT_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2}


def elements(dtype: str, reduce_dtype: str = "bfloat16") -> tuple[int, int, int]:
    """(working, gradient, master) bytes per element of a run (parallel/precision.py):
    float32 / float64 keep one copy; bfloat16 is BF16 parameters, gradients reduced in
    ``reduce_dtype`` and FP32 masters in the optimizer."""
    w = ELEMENT_BYTES[dtype]
    if dtype != "bfloat16":
        return w, w, w
    return w, ELEMENT_BYTES[reduce_dtype] if reduce_dtype == "bfloat16" else 4, 4
# ---- coordinates and shards -----------------------------------------------------------
def grid_coords(rank: int, dp: int, cp: int, tp: int) -> tuple[int, int, int, int]:
    """(pp, dp, cp, tp) indices of a global rank on a grid of dp x cp x tp ranks per
    pipeline stage: the one home of the rank order (pp-dp-cp-tp, tp innermost), which
    the runtime's mesh (:mod:`paratrain.parallel.mesh`) and every per-rank count use."""
    return (rank // (dp * cp * tp), (rank // (cp * tp)) % dp, (rank // tp) % cp, rank % tp)


def grid_rank(pp_i: int, dp_i: int, cp_i: int, tp_i: int, dp: int, cp: int, tp: int) -> int:
    """Inverse of :func:`grid_coords`."""
    return ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i


def mesh_coords(rank: int, plan: ParallelPlan) -> tuple[int, int, int, int]:
    """(pp, dp, cp, tp) of a global rank of ``plan`` (:func:`grid_coords`)."""
    return grid_coords(rank, plan.dp, plan.cp, plan.tp)


def coords(rank: int, plan: ParallelPlan) -> tuple[int, int, int]:
    """(pp, dp, tp) of a global rank (its cp index: :func:`mesh_coords`)."""
    pp, dp, _, tp = mesh_coords(rank, plan)
    return pp, dp, tp


def rank_of(pp: int, dp: int, tp: int, plan: ParallelPlan, cp: int = 0) -> int:
    """Inverse of :func:`mesh_coords` (cp index 0 unless given)."""
    return grid_rank(pp, dp, cp, tp, plan.dp, plan.cp, plan.tp)


@dataclass(frozen=True)
class Fold:
    """The MoE layers' regrouping of one pipeline stage's ranks (Megatron-Core's "MoE
    parallel folding"): the ``ranks`` = dp x cp x ``fold_tp`` ranks of a stage, in the
    global order (index f = (dp_i cp + cp_i) fold_tp + tp_i mod fold_tp), are cut as
    edp x ep x etp, etp innermost, then ep: etp index f mod etp, ep index (f / etp) mod
    ep, edp index f / (ep etp). ``fold_tp``: the tp ranks inside a fold, all of them with
    SP (each holds its own tokens) or when the experts are split over the whole tp group
    (etp = tp); without SP and with etp 1 every tp rank routes the same tokens, so each
    is a ``copy`` of the fold (copy index tp_i, experts tp-replicated). The one home of
    the fold: the mesh's ep, etp and edp groups and the per-rank counts read it."""

    dp: int
    cp: int
    tp: int
    ep: int
    etp: int
    fold_tp: int

    @classmethod
    def of(cls, plan: ParallelPlan) -> Fold:
        # a plan whose ep x etp needs more ranks than dp x cp folds over tp too: the
        # systems model prices it as Megatron-Core runs it (MoE under tp needs SP there),
        # the runtime refuses it without --sp (ParallelPlan.check_runtime)
        spans_tp = (plan.dp * plan.cp) % (plan.ep * plan.etp) != 0
        ft = plan.tp if plan.sp or plan.etp == plan.tp or spans_tp else 1
        return cls(plan.dp, plan.cp, plan.tp, plan.ep, plan.etp, ft)

    @property
    def edp(self) -> int:
        """Copies of each expert piece whose gradients are summed."""
        return self.dp * self.cp * self.fold_tp // (self.ep * self.etp)

    def check(self) -> None:
        n = self.dp * self.cp * self.fold_tp
        if n % (self.ep * self.etp):
            raise ValueError(f"ep*etp={self.ep}*{self.etp} does not divide the {n} ranks "
                             "the experts fold over (dp*cp, times tp with --sp or --etp "
                             "tp); pass --sp or choose --ep dividing dp*cp")

    def coords(self, rank: int) -> tuple[int, int, int, int, int]:
        """(pp, edp, ep, etp, copy) indices of a global rank."""
        pp_i, dp_i, cp_i, tp_i = grid_coords(rank, self.dp, self.cp, self.tp)
        f = (dp_i * self.cp + cp_i) * self.fold_tp + tp_i % self.fold_tp
        return (pp_i, f // (self.ep * self.etp), (f // self.etp) % self.ep, f % self.etp,
                tp_i // self.fold_tp)

    def rank(self, pp_i: int, edp_i: int, ep_i: int, etp_i: int, copy: int) -> int:
        """Inverse of :meth:`coords`."""
        dpcp, t = divmod((edp_i * self.ep + ep_i) * self.etp + etp_i, self.fold_tp)
        dp_i, cp_i = divmod(dpcp, self.cp)
        return grid_rank(pp_i, dp_i, cp_i, copy * self.fold_tp + t, self.dp, self.cp,
                         self.tp)


def vocab_range(vocab: int, tp: int, rank: int) -> tuple[int, int]:
    """Rows [start, end) of a vocabulary of ``vocab`` owned by ``rank`` of ``tp``:
    ceil(vocab / tp) each, the last rank(s) fewer."""
    if vocab < tp:
        raise ValueError(f"vocab_size={vocab} is smaller than tp={tp}: a rank would own no "
                         "rows; use tp <= vocab_size")
    per = -(-vocab // tp)
    return min(rank * per, vocab), min((rank + 1) * per, vocab)


def virtual_stages(plan: ParallelPlan) -> int:
    """Chunks per pipeline rank: ``virtual_stages`` when interleaved or V-shaped (where it
    is 2), else 1."""
    multi = plan.schedule == "interleaved" or plan.schedule in V_SHAPED
    return plan.virtual_stages if multi and plan.pp > 1 else 1


def block_param_sizes(mcfg: ModelConfig, tp: int = 1, i: int | None = None, ep: int = 1,
                      part: str = "all", etp: int = 1) -> list[int]:
    """Elements of block ``i``'s parameters on one tp rank, in registration order (``i``
    None: a dense block). An MoE MLP (:class:`paratrain.model.MoE`) is not tp-sharded:
    router (E x d), this ep rank's E/ep experts (gate, up, down each, 1/etp of each
    under expert tensor parallelism), the shared experts' three matrices and their
    gate (d). ``part``:
    "all", "dense" (all but the routed experts) or "expert" (only those) — the two
    gradient reducers of expert parallelism."""
    d, hd, t = mcfg.d_model, mcfg.head_dim, tp
    q, kv = mcfg.n_heads * hd // t, mcfg.kv_heads * hd // t  # output rows of wq, wk, wv
    qkv = [[n * d, n] if mcfg.qkv_bias else [n * d] for n in (q, kv, kv)]
    # attn_norm, wq, wk, wv (each with Qwen2's bias), wo, Qwen3's q and k norms, mlp_norm
    attn = [d, *qkv[0], *qkv[1], *qkv[2], q * d, *([hd, hd] if mcfg.qk_norm else []), d]
    if i is None or not mcfg.is_moe_layer(i):
        f = mcfg.d_ff * d // t
        return [] if part == "expert" else attn + [f, f, f]
    fe = mcfg.expert_ffn * d
    experts = [fe // etp] * (3 * (mcfg.experts // ep))
    shared = [fe * mcfg.shared_experts] * 3 if mcfg.shared_experts else []
    shared += [d] if mcfg.shared_gate else []  # Qwen2-MoE's gate, after the shared SwiGLU
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
    block_counts: tuple[tuple[int, ...], ...]  # per chunk, parameters of each block

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
        k = stage_of(plan.schedule, plan.pp, pp_i, c)
        a, b = ranges[k]
        sizes = [rows] if k == 0 and edges else []
        blocks = [block_param_sizes(mcfg, plan.tp, i, ep, part, plan.etp)
                  for i in range(a, b)]
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


def experts_apart(plan: ParallelPlan) -> bool:
    """Whether expert parameters have their own reducer (ep or etp > 1): the runtime's
    choice (:mod:`paratrain.parallel.mesh_engine`) and every count's."""
    return plan.ep > 1 or plan.etp > 1


def reducers(plan: ParallelPlan, rank: int) -> list[tuple[ParallelPlan, int, str, int]]:
    """(plan as the reducer sees it, rank in it, part, ep) of each gradient reducer of
    ``rank``: one, or with ep > 1 or etp > 1 the dense one over dp x cp and the expert
    one over the edp ranks holding the same expert pieces (:class:`Fold`; its plan: dp =
    edp, tp = etp, so a rank's expert pieces are its etp index's;
    :mod:`paratrain.parallel.expert`)."""
    if not experts_apart(plan):
        return [(plan, rank, "all", 1)]
    fold = Fold.of(plan)
    pp_i, edp_i, _, etp_i, _ = fold.coords(rank)
    eplan = plan.replace(dp=fold.edp, cp=1, tp=plan.etp, sp=False, ep=1, dp_replicate=1)
    return [(plan.replace(ep=1), rank, "dense", plan.ep),
            (eplan, rank_of(pp_i, edp_i, etp_i, eplan), "expert", plan.ep)]


def chunk_param_sizes(mcfg: ModelConfig, plan: ParallelPlan, rank: int
                      ) -> list[list[int]]:
    """Per chunk, the elements of each trainable parameter in registration order."""
    return [list(c) for c in rank_layout(mcfg, plan, rank).chunks]
