"""Memory per GPU: model states by precision recipe and ZeRO stage, activations by
tensor/sequence parallelism, recomputation and pipeline schedule, and the HBM verdict.

Model states (Rajbhandari et al. 2020, "ZeRO", Sec. 3-5), per parameter, default recipe
BF16 weights (2 bytes) and gradients (2) plus FP32 master weights, Adam m and v (12):

    stage 0: 2 + 2 + 12 = 16     stage 1: 2 + 2 + 12/d
    stage 2: 2 + (2 + 12)/d      stage 3: 16/d

with d the data-parallel degree (dp x cp: context-parallel ranks hold the same weights).
Tensor and pipeline parallelism divide the parameters a GPU holds; expert parallelism
divides the routed experts, whose ZeRO shards are over the edp ranks holding the same
experts (:func:`paratrain.cost.moe_layout.expert_data_ranks`; the dense parameters' over
d). The plan's ``etp`` splits the MoE MLP: etp 1 (paratrain's runtime) keeps it whole on
every tp rank, etp = tp (Megatron-Core's default, the published MoE runs) splits it over
tp as the dense MLP is.

Activations per layer: :func:`block_activation_bytes` is the one formula (the runtime's
prediction, the plan's memory and the pipeline report all call it). For paratrain's own
block it counts, tensor by tensor, what autograd keeps for backward (see its docstring;
the tests measure it). For shapes paratrain's block does not implement (GPT-3's GeLU MLP
with biases, mixture of experts, latent attention) it falls back to Korthikanti et al.
2022 ("Reducing Activation Recomputation in Large Transformer Models", Table 2), s
tokens, b sequences, h width, a heads, t tensor-parallel ranks, 16-bit:

    no parallelism          s b h (34 + 5 a s / h)
    tensor parallel         s b h (10 + 24/t + 5 a s / (h t))
    tensor + sequence par.  s b h (34 + 5 a s / h) / t
    selective recompute     s b h (10 + 24/t)      (sequence parallel: 34 s b h / t)
    full recompute          2 s b h                (sequence parallel: 2 s b h / t)

The 5 a s / h term is the attention scores, softmax output and dropout mask of an
unfused kernel; a fused (flash) kernel keeps none of them, so ``attention="flash"``
drops it. FP8 linear layers (the ``fp8-adam`` recipe) keep their four inputs in FP8:
8 + 19/t in place of 10 + 24/t (:func:`layer_activation_bytes`).

Either is multiplied by the layers the busiest pipeline stage holds and the
micro-batches in flight on it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from paratrain.config import ModelConfig
from paratrain.cost.activations import (  # noqa: F401 - re-exported
    ATTENTION,
    _check_kinds,
    block_activation_bytes,
    edge_activation_bytes,
    is_paratrain_block,
    layer_activation_bytes,
    micro_batches_in_flight,
    rank_activation_peaks,
)
from paratrain.cost.dp_bytes import sharded_states
from paratrain.cost.groups import split_batch, stage_layers
from paratrain.cost.hardware import Hardware
from paratrain.cost.moe_layout import expert_data_ranks
from paratrain.cost.ranks import ELEMENT_BYTES, virtual_stages
from paratrain.cost.shapes import ModelShape, as_shape
from paratrain.plan import ParallelPlan


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter for weights, gradients and optimizer state (master + m + v)."""

    name: str
    weight_bytes: float
    grad_bytes: float
    optim_bytes: float
    act_bytes: float = 2.0
    fp8: bool = False  # FP8 linear layers: their saved inputs in FP8 (cost.activations)

    @property
    def total_bytes(self) -> float:
        return self.weight_bytes + self.grad_bytes + self.optim_bytes


_BF16, _FP32 = ELEMENT_BYTES["bfloat16"], ELEMENT_BYTES["float32"]
RECIPES = {  # mixed precision: fp32 master + m + v; fp32: the weights are the master
    "bf16-adam": Precision("bf16-adam", _BF16, _BF16, 3 * _FP32),
    "fp32-adam": Precision("fp32-adam", _FP32, _FP32, 2 * _FP32, act_bytes=_FP32),
    # FP8 linear layers (Transformer Engine, torchao float8): the states of bf16-adam
    # (16-bit weights and gradients, fp32 master and moments), the inputs the linear
    # layers keep for backward in FP8
    "fp8-adam": Precision("fp8-adam", _BF16, _BF16, 3 * _FP32, fp8=True),
}


def mixed_recipe(fp8: bool) -> str:
    """The mixed-precision recipe's name: bf16-adam, or with FP8 linear layers fp8-adam."""
    return "fp8-adam" if fp8 else "bf16-adam"


def recipe(name: str) -> Precision:
    if name not in RECIPES:
        raise ValueError(f"precision {name!r} is unknown; choose one of {', '.join(RECIPES)}")
    return RECIPES[name]


@dataclass(frozen=True)
class ParamsPerGPU:
    """Parameters the busiest GPU holds, split by how they are replicated."""

    dense: float  # replicated over dp x cp
    expert: float  # replicated over dp x cp / ep
    layer_full: float  # one layer's parameters on this tensor-parallel rank (ZeRO-3 buffer)

    @property
    def total(self) -> float:
        return self.dense + self.expert


def params_per_gpu(model: ModelConfig, plan: ParallelPlan) -> ParamsPerGPU:
    """Parameters on the busiest GPU: its pipeline stage's layers (plus the embedding or
    head; with pp > 1 the vocabulary matrix of the first or last stage), over tp; routed
    experts also over ep. Exact for tp = pp = 1. An MoE model as the plan lays its
    experts out (:func:`_moe_params`)."""
    return _params_per_gpu(as_shape(model), plan.pp, plan.tp, plan.ep, plan.etp)


@functools.lru_cache(maxsize=4096)
def _params_per_gpu(m: ModelShape, pp: int, tp: int, ep: int, etp: int) -> ParamsPerGPU:
    """:func:`params_per_gpu` on the axes it reads (cached: the layout search prices
    hundreds of thousands of plans that differ only in the others)."""
    if m.is_moe:
        return _moe_params(m, pp, tp, ep, etp)
    share = stage_layers(m.n_layers, pp) / m.n_layers
    emb = m.embedding_params() if pp == 1 else _stage_embedding(m)
    expert = m.routed_expert_params() * share
    dense = m.num_layer_params() * share - expert + emb
    return ParamsPerGPU(dense / tp, expert / (tp * ep), m.num_layer_params() / m.n_layers / tp)


def _stage_embedding(m: ModelShape) -> int:
    """The vocabulary matrix (and learned positions) of the first or last stage."""
    return m.vocab_size * m.d_model + (m.context * m.d_model if m.learned_positions else 0)


def _moe_params(m: ModelShape, pp: int, tp: int, ep: int, etp: int) -> ParamsPerGPU:
    """Each rank keeps E / ep routed experts of every MoE layer, each split over etp; the
    router and shared experts are dense parameters, split over etp too (attention, dense
    MLPs and the vocabulary over tp as in a dense model). etp 1 is paratrain's runtime
    (:mod:`paratrain.parallel.expert`, :mod:`paratrain.cost.layout`: the whole MoE MLP
    replicated over tp), etp = tp Megatron-Core's default."""
    share = stage_layers(m.n_layers, pp) / m.n_layers
    emb = m.embedding_params() if pp == 1 else _stage_embedding(m)
    moe = m.moe_layers * share
    routed = moe * m.experts * m.expert_params()
    whole = moe * (m.moe_mlp_params() - m.experts * m.expert_params())  # router, shared
    dense = (m.num_layer_params() * share - routed - whole + emb) / tp + whole / etp
    # the largest block on one rank (ZeRO-3's gather): a dense one, or an MoE one with
    # its E / ep routed experts; the model has at most these two kinds
    mlp = m.moe_mlp_params() - m.experts * m.expert_params() * (1 - 1 / ep)
    blocks = [(m.attention_params() + m.norm_params()) / tp + mlp / etp]
    if m.moe_layers < m.n_layers:
        blocks.append(m.layer_params() / tp)
    return ParamsPerGPU(dense, routed / (ep * etp), max(blocks))


@dataclass(frozen=True)
class ModelStates:
    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes


def _sharded(params: float, d: float, zero: int, prec: Precision,
             pipelined: bool = False) -> ModelStates:
    """Per-parameter bytes of each state, over ``d`` where ZeRO shards it
    (:func:`paratrain.cost.dp_bytes.sharded_states`)."""
    w, g, o = prec.weight_bytes * params, prec.grad_bytes * params, prec.optim_bytes * params
    ws, gs, os_ = sharded_states(zero, pipelined)
    return ModelStates(w / d if ws else w, g / d if gs else g, o / d if os_ else o)


def model_states(model: ModelConfig, plan: ParallelPlan,
                 precision: str | Precision = "bf16-adam") -> ModelStates:
    """Weights, gradients and optimizer state per GPU for ``plan.zero`` over dp x cp, or
    under HSDP over one replica's dp x cp / ``dp_replicate`` ranks (gradients unsharded
    under ZeRO-2 with a pipeline, as the runtime keeps them)."""
    prec = recipe(precision) if isinstance(precision, str) else precision
    p = params_per_gpu(model, plan)
    d = plan.dp * plan.cp // plan.dp_replicate
    a = _sharded(p.dense, d, plan.zero, prec, plan.pp > 1)
    b = _sharded(p.expert, max(1.0, expert_data_ranks(plan) / plan.dp_replicate), plan.zero,
                 prec, plan.pp > 1)
    return ModelStates(a.weights_bytes + b.weights_bytes, a.grads_bytes + b.grads_bytes,
                       a.optimizer_bytes + b.optimizer_bytes)


def model_states_bytes(model: ModelConfig, plan: ParallelPlan,
                       precision: str | Precision = "bf16-adam") -> float:
    return model_states(model, plan, precision).total_bytes


@dataclass(frozen=True)
class Memory:
    """Memory per GPU (busiest rank), bytes, and the verdict against the HBM."""

    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    logits_bytes: float  # fp32 logits for the loss (last stage; counted when pp == 1)
    buffers_bytes: float  # ZeRO-3 gathered beside its shards (zero3_buffers)
    hbm_bytes: float

    @property
    def states_bytes(self) -> float:
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> float:
        return self.states_bytes + self.activations_bytes + self.logits_bytes + \
            self.buffers_bytes

    @property
    def margin_bytes(self) -> float:
        return self.hbm_bytes - self.total_bytes

    @property
    def fits(self) -> bool:
        return self.margin_bytes >= 0


def activation_bytes(model: ModelConfig, plan: ParallelPlan, tokens_per_step: int,
                     seq_len: int, attention: str = "eager",
                     element_bytes: float = 2.0, *, runtime: bool = False,
                     ours: bool = True, fp8: bool = False) -> float:
    """Activations on the busiest GPU: per layer x layers per stage x in-flight
    micro-batches. ``attention`` defaults to Korthikanti's unfused kernel (``eager``);
    ``paratrain plan`` passes ``flash`` unless told otherwise.

    ``runtime=True`` (paratrain's own model as its runtime runs it): the busiest rank of
    :func:`rank_activation_peaks` instead, which adds the terms outside the blocks
    (embedding ids, final norm, head input, the loss's logits), the RoPE tables, the
    runtime's block split and the micro-batches in flight read off the schedule.
    ``ours``: :func:`block_activation_bytes`'s (False for a published run); ``fp8``: FP8
    linear layers (:data:`RECIPES` ``fp8-adam``)."""
    m = as_shape(model)
    if runtime and is_paratrain_block(m, plan.etp) and not fp8:
        return max(rank_activation_peaks(model, plan, tokens_per_step, seq_len, attention,
                                         element_bytes))
    batch = split_batch(tokens_per_step, seq_len, plan)
    per_layer = batch.micro_batch * block_activation_bytes(
        m, batch.local_seq, tp=plan.tp, sp=plan.sp, recompute=plan.recompute,
        attention=attention, element_bytes=element_bytes, cp=plan.cp,
        cp_algorithm=plan.cp_algorithm, ep=plan.ep, etp=plan.etp,
        ours=ours, fp8=fp8)
    layers = stage_layers(m.n_layers, plan.pp)
    inflight = micro_batches_in_flight(plan.schedule, plan.pp, plan.micro_batches,
                                       virtual_stages(plan))
    return per_layer * layers * inflight


def memory(model: ModelConfig, plan: ParallelPlan, hw: Hardware, tokens_per_step: int,
           seq_len: int, precision: str | Precision = "bf16-adam",
           attention: str = "eager", *, ours: bool = True) -> Memory:
    """Everything the busiest GPU holds at its peak, against ``hw.hbm_bytes``
    (``ours``: :func:`activation_bytes`'s)."""
    m: ModelShape = as_shape(model)
    prec = recipe(precision) if isinstance(precision, str) else precision
    st = model_states(model, plan, prec)
    act = activation_bytes(m, plan, tokens_per_step, seq_len, attention,
                           ours=ours, fp8=prec.fp8)
    batch = split_batch(tokens_per_step, seq_len, plan)
    logits = 4.0 * batch.local_seq * batch.micro_batch * m.vocab_size / plan.tp \
        if plan.pp == 1 else 0.0
    return Memory(st.weights_bytes, st.grads_bytes, st.optimizer_bytes, act, logits,
                  zero3_buffers(model, plan, prec), hw.hbm_bytes)


def zero3_buffers(model: ModelConfig, plan: ParallelPlan, prec: Precision) -> float:
    """Bytes ZeRO-3 holds gathered beside its shards: one layer computing and the next
    prefetched; under a pipeline the stage's whole weights and gradients, which it gathers
    at its first forward of the step and reduces after its last backward (the runtime's
    deferred FSDP, :mod:`paratrain.parallel.fsdp`, as PyTorch's pipelining runs FSDP: one
    sync a step, :func:`paratrain.cost.dp_bytes.grad_reductions`). 0 below ZeRO-3."""
    if plan.zero != 3:
        return 0.0
    p = params_per_gpu(model, plan)
    if plan.pp > 1:
        return p.total * (prec.weight_bytes + prec.grad_bytes)
    return 2 * p.layer_full * prec.weight_bytes
