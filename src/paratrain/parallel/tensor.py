"""Megatron-style tensor parallelism (Shoeybi et al. 2019, "Megatron-LM"), and the
sequence-parallel variant (Korthikanti et al. 2022) built from :mod:`.sequence`.

A transformer block holds two tensor-parallel *regions*. Each region begins where the
replicated activation enters column-parallel linears and ends where a row-parallel linear
produces partial sums:

- attention: ``wq, wk, wv`` split by output columns = by heads (query heads and GQA kv
  heads each split t ways, so every rank keeps whole heads and the whole GQA grouping);
  the core runs on the local heads; ``wo`` split by input rows = the same heads.
- SwiGLU: ``w_gate`` and ``w_up`` split by columns (the hidden units), the elementwise
  ``silu(gate) * up`` stays local, ``w_down`` split by rows.

Entry ``f`` and exit ``g`` of a region are explicit autograd functions (Megatron's
``copy_to_tensor_model_parallel_region`` / ``reduce_from_...``)::

    f: forward identity,    backward all-reduce        (without SP)
    g: forward all-reduce,  backward identity
    f: forward all-gather along T, backward reduce-scatter along T   (with SP)
    g: forward reduce-scatter along T, backward all-gather along T

Because :class:`~paratrain.model.Attention` reads its head count from its projections'
widths, sharding the weights is all the model needs: no model change. The entry ``f`` is
attached to the norm before each region (:class:`RegionEntryNorm`), so the three
projections of attention share one entry (one backward all-reduce, not three).

Vocabulary: the embedding and the output head are split by vocabulary rows
(:class:`VocabParallelEmbedding`, head as a column-parallel linear), and
:func:`vocab_parallel_cross_entropy` computes the loss from the local logit shards with
three reductions of (B, T) scalars — the full (B, T, V) logits are never gathered.

Uneven vocabularies: we *split unevenly* rather than pad. Rank r owns rows
``[r*ceil(V/t), min((r+1)*ceil(V/t), V))``; nothing in the embedding lookup or the
vocabulary-parallel loss needs equal shard sizes, so there is no wasted padded compute
and no masking of padded logits. Only ``V < t`` (a rank with no rows) is refused. Heads
(and kv heads) not divisible by t are refused by :meth:`ParallelPlan.check`: a split head
would need a different attention kernel.

Tied embeddings (pp = 1): the embedding and the head are sharded identically, so after
sharding the head's weight is set to the embedding's shard again and the tie holds.

Every rank slices its shard from the full, identically seeded model, so the sharded model
computes exactly what the unsharded one does (up to the order of additions in the
reductions), which is what the oracle tests check.

Placements (:mod:`.placement`): a split weight's box narrows to its rows or columns and
gains the axis ``tp`` in ``sharded``; parameters that stay replicated across the tp group
(the norms' gains, MoE layers) gain ``tp`` in ``replicated``, so the engine counts them
once in the global gradient norm and, under SP, all-reduces their partial gradients. They
also keep Megatron's tag ``tp_replicated = True``. Qwen3's per-head query and key norms
(``qk_norm``) are replicated too, but each rank applies them to its own heads only, so
their gradients are partial sums with or without SP (tagged ``tp_partial``: the engine
all-reduces them over tp as it does the norms' under SP). Qwen2's q, k, v biases are
split with their weights' rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paratrain.cost.layout import vocab_range
from paratrain.cost.tp_bytes import tp_wire_bytes_per_layer  # noqa: F401 - re-export
from paratrain.parallel import sequence
from paratrain.parallel.placement import mark, narrowed
from paratrain.parallel.sequence import TPComm

__all__ = ["TPComm", "TPState", "apply_tensor_parallel", "vocab_parallel_cross_entropy",
           "VocabParallelEmbedding", "RegionEntryNorm", "RowParallelLinear",
           "ColumnParallelLinear", "vocab_range"]


# ---- the region entry and exit as modules ------------------------------------------
class RegionEntryNorm(nn.Module):
    """The block's norm followed by the region entry ``f`` (copy, or gather along T)."""

    def __init__(self, norm: nn.Module, comm: TPComm) -> None:
        super().__init__()
        self.norm = norm
        self.comm = comm
        _replicated(norm.weight)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return sequence.enter_region(self.norm(x_BTD), self.comm)

    @property
    def weight(self) -> torch.Tensor:
        return self.norm.weight


class ColumnParallelLinear(nn.Linear):
    """Local rows of the weight (output columns of y = x W^T); the input must already be
    in the region (replicated along features, full T). ``enter`` adds the entry ``f``
    itself, for the output head whose norm is not a block norm."""

    def __init__(self, weight_local: torch.Tensor, comm: TPComm, enter: bool = False) -> None:
        out_f, in_f = weight_local.shape
        super().__init__(in_f, out_f, bias=False, device=weight_local.device,
                         dtype=weight_local.dtype)
        self.weight = nn.Parameter(weight_local.clone())
        self.comm = comm
        self.enter = enter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enter:
            x = sequence.enter_region(x, self.comm)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Linear):
    """Local columns of the weight (input features); output partial sums leave the
    region through ``g`` (all-reduce, or reduce-scatter along T with SP)."""

    def __init__(self, weight_local: torch.Tensor, comm: TPComm) -> None:
        out_f, in_f = weight_local.shape
        super().__init__(in_f, out_f, bias=False, device=weight_local.device,
                         dtype=weight_local.dtype)
        self.weight = nn.Parameter(weight_local.clone())
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sequence.exit_region(F.linear(x, self.weight), self.comm)


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the embedding table. Ids outside give zeros locally; the
    exit ``g`` sums the shards (all-reduce, or reduce-scatter along T with SP, which
    leaves each rank its sequence slice)."""

    def __init__(self, weight_local: torch.Tensor, start: int, end: int, comm: TPComm) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight_local.clone())
        self.start, self.end = start, end
        self.comm = comm

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        outside = (idx_BT < self.start) | (idx_BT >= self.end)
        local = (idx_BT - self.start).masked_fill(outside, 0)
        h_BTD = F.embedding(local, self.weight).masked_fill(outside[..., None], 0.0)
        return sequence.exit_region(h_BTD, self.comm)


# ---- vocabulary-parallel cross-entropy ----------------------------------------------
class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy from logit shards (Megatron's
    ``_VocabParallelCrossEntropy``): max, sum of exponentials and the target's logit are
    each all-reduced over the tp group as (N,) vectors; the gradient is the local slice of
    softmax - onehot, with no communication."""

    @staticmethod
    def forward(ctx, logits_NV, target_N, start, end, comm: TPComm):
        logits = logits_NV.float() if logits_NV.dtype in (torch.float16,
                                                          torch.bfloat16) else logits_NV
        m_N = logits.max(dim=-1).values
        comm.all_reduce(m_N, op=dist.ReduceOp.MAX)
        z_NV = logits - m_N[:, None]
        outside = (target_N < start) | (target_N >= end)
        local_t = (target_N - start).masked_fill(outside, 0)
        picked_N = z_NV.gather(1, local_t[:, None]).squeeze(1).masked_fill(outside, 0.0)
        exp_NV = z_NV.exp()
        sum_N = exp_NV.sum(dim=-1)
        both = torch.stack((picked_N, sum_N))  # one all-reduce for the two sums
        comm.all_reduce(both)
        picked_N, sum_N = both[0], both[1]
        loss_N = sum_N.log() - picked_N
        ctx.save_for_backward(exp_NV / sum_N[:, None], local_t, outside)
        ctx.in_dtype = logits_NV.dtype
        return loss_N

    @staticmethod
    def backward(ctx, grad_N):
        softmax_NV, local_t, outside = ctx.saved_tensors
        grad_NV = softmax_NV.clone()
        rows = torch.arange(grad_NV.shape[0], device=grad_NV.device)
        grad_NV[rows, local_t] -= (~outside).to(grad_NV.dtype)
        grad_NV *= grad_N[:, None]
        return grad_NV.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits_BTv: torch.Tensor, y_BT: torch.Tensor, start: int,
                                 end: int, comm: TPComm) -> torch.Tensor:
    """Sum of token cross-entropies; ``logits_BTv`` holds vocabulary rows [start, end)."""
    loss_N = _VocabParallelCE.apply(logits_BTv.flatten(0, 1), y_BT.flatten(), start, end, comm)
    return loss_N.sum()


# ---- the transform ----------------------------------------------------------------
def _replicated(p: nn.Parameter) -> None:
    p.tp_replicated = True
    if hasattr(p, "placement"):  # applied outside an engine (the oracle tests): no record
        mark([p], replicated=("tp",))


def _rows(w: torch.Tensor, t: int, r: int) -> torch.Tensor:
    return w.detach().chunk(t, dim=0)[r]


def _cols(w: torch.Tensor, t: int, r: int) -> torch.Tensor:
    return w.detach().chunk(t, dim=1)[r]


def _split(cls, lin: nn.Linear, dim: int, comm: TPComm, **kw) -> nn.Module:
    """The ``cls`` linear holding rank ``comm.rank``'s rows (dim 0) or columns (dim 1)
    of ``lin``'s weight (``torch.chunk``'s pieces), and of a column-parallel one's bias
    (Qwen2's q, k, v: one per output row) the same rows; placements narrowed to them."""
    t, r, w, b = comm.size, comm.rank, lin.weight, lin.bias
    mod = cls((_rows if dim == 0 else _cols)(w, t, r), comm, **kw)
    if b is not None:
        if dim:
            raise ValueError("a row-parallel linear with a bias would add it t times; "
                             "paratrain's wo and w_down have none")
        mod.bias = nn.Parameter(_rows(b, t, r).clone())
    start = r * -(-w.shape[dim] // t)
    for old, new in ((w, mod.weight), (b, mod.bias)):
        if old is not None and hasattr(old, "placement"):
            narrowed(old, new, dim, start, "tp")
    return mod


@torch.no_grad()
def shard_block(block: nn.Module, comm: TPComm) -> None:
    """Shard one :class:`~paratrain.model.Block` in place (heads, then SwiGLU units)."""
    t = comm.size
    attn, mlp = block.attn, block.mlp
    e = attn.head_dim
    # Query heads and kv heads both split t ways: rank r keeps query heads
    # [r*H/t, (r+1)*H/t) and kv heads [r*K/t, (r+1)*K/t); with H/K query heads per kv
    # head, those are exactly the kv heads its query heads use (GQA grouping preserved).
    for name in ("wq", "wk", "wv"):
        w = getattr(attn, name).weight
        if (w.shape[0] // e) % t:
            raise ValueError(f"{name} has {w.shape[0] // e} heads, not divisible by tp={t}; "
                             "choose a tp that divides n_heads and n_kv_heads")
        setattr(attn, name, _split(ColumnParallelLinear, getattr(attn, name), 0, comm))
    attn.wo = _split(RowParallelLinear, attn.wo, 1, comm)
    block.attn_norm = RegionEntryNorm(block.attn_norm, comm)
    if attn.qk_norm:  # whole on every rank, each rank's gradient a sum over its own heads
        for p in (attn.q_norm.weight, attn.k_norm.weight):
            _replicated(p)
            p.tp_partial = True
    if not hasattr(mlp, "w_gate"):
        # an MoE MLP stays whole on every tp rank: it reads the replicated residual and
        # its output is replicated, so neither the entry f nor the exit g is needed
        # (the router runs on identical tokens; under ep each tp rank exchanges with its
        # own ep group). Its parameters, and the norm before it, are tp-replicated.
        for p in (*mlp.parameters(), block.mlp_norm.weight):
            _replicated(p)
        return
    if mlp.w_gate.weight.shape[0] % t:
        raise ValueError(f"d_ff={mlp.w_gate.weight.shape[0]} is not divisible by tp={t}; "
                         "choose d_ff as a multiple of tp")
    mlp.w_gate = _split(ColumnParallelLinear, mlp.w_gate, 0, comm)
    mlp.w_up = _split(ColumnParallelLinear, mlp.w_up, 0, comm)
    mlp.w_down = _split(RowParallelLinear, mlp.w_down, 1, comm)
    block.mlp_norm = RegionEntryNorm(block.mlp_norm, comm)


@dataclass(eq=False)
class TPState:
    """What the transform leaves for the engine: the comms (one for the blocks, one for
    the embedding, head and loss, so bytes per layer can be reported) and the vocabulary
    rows this rank owns."""

    blocks: TPComm
    edges: TPComm
    vocab_start: int
    vocab_end: int


@torch.no_grad()
def apply_tensor_parallel(model: nn.Module, mesh, plan) -> TPState:
    """Shard ``model`` in place over ``mesh``'s tp group (SP if ``plan.sp``).

    ``model`` is a :class:`~paratrain.model.Decoder` or a pipeline chunk with the same
    attribute names (``tok_emb``, ``blocks``, ``norm``, ``head``; absent parts None).
    Afterwards the head (if present) returns the local vocabulary shard of the logits,
    rows ``[state.vocab_start, state.vocab_end)``: use :func:`vocab_parallel_cross_entropy`.
    """
    t, r, group = mesh.size("tp"), mesh.index("tp"), mesh.group("tp")
    state = TPState(TPComm(group, t, r, plan.sp), TPComm(group, t, r, plan.sp), 0, 0)
    emb, head = getattr(model, "tok_emb", None), getattr(model, "head", None)
    table = emb if emb is not None else head
    if table is not None:
        state.vocab_start, state.vocab_end = vocab_range(table.weight.shape[0], t, r)
    if t == 1:
        state.vocab_end = table.weight.shape[0] if table is not None else 0
        return state
    tied = emb is not None and head is not None and head.weight is emb.weight
    start, end = state.vocab_start, state.vocab_end
    for blk in model.blocks:
        shard_block(blk, state.blocks)
    if emb is not None:
        model.tok_emb = VocabParallelEmbedding(emb.weight[start:end], start, end, state.edges)
        if hasattr(emb.weight, "placement"):
            narrowed(emb.weight, model.tok_emb.weight, 0, start, "tp")
    if head is not None:
        model.head = ColumnParallelLinear(head.weight[start:end], state.edges, enter=True)
        if hasattr(head.weight, "placement"):
            narrowed(head.weight, model.head.weight, 0, start, "tp")
        _replicated(model.norm.weight)
        if tied:
            model.head.weight = model.tok_emb.weight
    return state
