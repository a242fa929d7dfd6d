"""Flat buffers of the dp reducers: gradient buckets, FSDP units, padding, ownership."""

from __future__ import annotations

from paratrain.config import ModelConfig
from paratrain.cost.ranks import RankLayout, rank_layout
from paratrain.plan import ParallelPlan


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
    default_units`): [tok_emb], each block, [norm, head]; tied: [tok_emb + norm] first.
    A layout of one part (:func:`reducers`) has only the units holding some of it: the
    dense part every unit less the routed experts, the expert part one unit of local
    experts per MoE block (:func:`paratrain.parallel.expert.expert_units`)."""
    out = []
    for k, sizes, per in zip(lay.stages, lay.chunks, lay.block_counts, strict=True):
        rest = list(sizes)
        nb = sum(per)
        emb = [rest.pop(0)] if k == 0 and len(rest) > nb else []  # the expert part: none
        starts = [sum(per[:j]) for j in range(len(per))]
        blocks = [sum(rest[a:a + n]) for a, n in zip(starts, per, strict=True) if n]
        tail = rest[nb:]
        if lay.tied and emb:
            out.append([emb[0] + sum(tail), *blocks])
        else:
            out.append([*emb, *blocks, *([sum(tail)] if tail else [])])
    return out


def pad(n: int, p: int) -> int:
    """Flat buffers are padded to a multiple of the data-parallel size (equal chunks)."""
    return -(-n // p) * p


def owned(n: int, p: int, r: int, pad_to: int | None = None) -> int:
    """Real (not padding) elements in chunk r of p of a flat buffer of n padded to a
    multiple of ``pad_to`` (default p; HSDP pads to the whole dp, :func:`shard_group`)."""
    s = pad(n, pad_to or p) // p
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


def shard_group(plan: ParallelPlan) -> int:
    """Ranks a ZeRO shard group spans: the reducer's dp x cp (:func:`reducer_plan`), or
    under HSDP (``dp_replicate`` R) one replica's dp x cp / R. Flat buffers are padded to
    a multiple of the whole dp x cp either way, so the owned chunk (padded / group) is
    all-reduced over the R replicas in equal pieces (:mod:`paratrain.parallel.dp_sharded`).
    A rank's index in it is its reducer dp index mod the group (replicas outer)."""
    return reducer_plan(plan).dp // plan.dp_replicate


def strategy(dp: int, plan: ParallelPlan) -> str:
    """The reducer a data axis of ``dp`` ranks runs under ``plan``: none (dp = 1), topk
    (--compress), else ddp, zero (ZeRO-1/2) or fsdp (ZeRO-3). The one rule: the
    runtime's factory (:func:`paratrain.parallel.data_axis.data_axis`) builds the class
    it names, the byte counts here price it."""
    if dp == 1:
        return "none"
    if plan.compress is not None:
        return "topk"
    return ("ddp", "zero", "zero", "fsdp")[plan.zero]


def dp_kind(plan: ParallelPlan) -> str:
    """The reducer on the plan's dp axis (dp x cp ranks, :func:`reducer_plan`)."""
    return strategy(reducer_plan(plan).dp, plan)


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
