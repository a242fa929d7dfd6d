"""Where each parallel group sits on the cluster, and the batch each rank sees.

Rank order (fastest-varying first): tp, cp, dp, pp, as in Megatron-LM, so tensor-parallel
groups are consecutive GPUs (inside a node when tp <= GPUs per node), and pipeline
neighbours are furthest apart. Expert-parallel groups are ``ep`` consecutive data ranks in
the runtime's layout, ``etp`` apart when folded (:func:`paratrain.cost.moe_layout.ep_stride`).
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.config import ModelConfig
from paratrain.cost.hardware import Hardware
from paratrain.cost.moe_layout import edp_stride, ep_stride
from paratrain.cost.stages import rank_blocks, stage_costs
from paratrain.plan import ParallelPlan


def span(size: int, stride: int) -> int:
    """GPUs from the first to the last member of a group of ``size`` ranks ``stride`` apart."""
    return (size - 1) * stride + 1


def strides(plan: ParallelPlan) -> dict[str, int]:
    return {"tp": 1, "cp": plan.tp, "dp": plan.tp * plan.cp, "ep": ep_stride(plan),
            "edp": edp_stride(plan), "pp": plan.tp * plan.cp * plan.dp}


def group_link(plan: ParallelPlan, axis: str, hw: Hardware, size: int | None = None
               ) -> tuple[float, float]:
    """(alpha_s, bw) of the slowest link the ``axis`` group crosses."""
    n = getattr(plan, axis) if size is None else size
    return hw.link(span(n, strides(plan)[axis]), n)


def per_node(plan: ParallelPlan, axis: str, hw: Hardware, size: int) -> int:
    """Members of one ``axis`` group that share a node (for hierarchical collectives)."""
    return max(1, min(size, hw.gpus_per_node // strides(plan)[axis]))


@dataclass(frozen=True)
class Batch:
    """The global batch split over the plan: sequences and tokens per rank."""

    tokens_per_step: int
    seq_len: int
    sequences: int  # global sequences per optimizer step
    micro_batch: int  # sequences per micro-batch per data-parallel rank
    micro_batches: int
    local_seq: int  # tokens of one sequence a rank holds (seq_len / cp)


def split_batch(tokens_per_step: int, seq_len: int, plan: ParallelPlan) -> Batch:
    """Check that the batch divides evenly and return the per-rank shapes."""
    if seq_len < 1 or tokens_per_step < 1:
        raise ValueError(
            f"tokens_per_step={tokens_per_step} and seq_len={seq_len} must be positive"
        )
    if tokens_per_step % seq_len:
        raise ValueError(
            f"tokens_per_step={tokens_per_step} is not a multiple of seq_len={seq_len}; "
            "pick a whole number of sequences"
        )
    if seq_len % plan.cp:
        raise ValueError(f"cp={plan.cp} does not divide seq_len={seq_len}; choose a divisor")
    seqs = tokens_per_step // seq_len
    per = plan.dp * plan.micro_batches
    if seqs % per:
        raise ValueError(
            f"{seqs} sequences per step do not split over dp*micro_batches={plan.dp}*"
            f"{plan.micro_batches}={per}; pick a batch that is a multiple of {per} sequences"
        )
    return Batch(tokens_per_step, seq_len, seqs, seqs // per, plan.micro_batches,
                 seq_len // plan.cp)


def stage_layers(n_layers: int, pp: int, *, model: ModelConfig | None = None,
                 virtual_stages: int = 1, seq_len: int | None = None) -> int:
    """Blocks on the busiest pipeline rank, from the runtime's own split
    (:func:`paratrain.cost.stages.split_layers`, costs at ``seq_len``). Without a
    ``model`` the blocks are split with equal costs and a free head, which gives
    ceil(n_layers / pp) for one chunk per rank."""
    if model is None:
        return max(rank_blocks(n_layers, pp, virtual_stages, 1.0, 0.0))
    if model.n_layers != n_layers:
        raise ValueError(f"n_layers={n_layers} but the model has {model.n_layers}; "
                         "pass model.n_layers")
    block, _, head = stage_costs(model, seq_len)
    return max(rank_blocks(n_layers, pp, virtual_stages, block, head))
