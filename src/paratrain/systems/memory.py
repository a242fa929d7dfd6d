"""Memory per GPU: model states by precision recipe and ZeRO stage, activations by
tensor/sequence parallelism, recomputation and pipeline schedule, and the HBM verdict.

Model states (Rajbhandari et al. 2020, "ZeRO", Sec. 3-5), per parameter, default recipe
BF16 weights (2 bytes) and gradients (2) plus FP32 master weights, Adam m and v (12):

    stage 0: 2 + 2 + 12 = 16     stage 1: 2 + 2 + 12/d
    stage 2: 2 + (2 + 12)/d      stage 3: 16/d

with d the data-parallel degree (dp x cp: context-parallel ranks hold the same weights).
Tensor and pipeline parallelism divide the parameters a GPU holds; expert parallelism
divides the routed experts.

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
drops it.

Either is multiplied by the layers the busiest pipeline stage holds and the
micro-batches in flight on it.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.config import ModelConfig
from paratrain.plan import ParallelPlan
from paratrain.systems.hardware import Hardware
from paratrain.systems.layout import split_batch, stage_layers
from paratrain.systems.models import ModelShape, as_shape


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter for weights, gradients and optimizer state (master + m + v)."""

    name: str
    weight_bytes: float
    grad_bytes: float
    optim_bytes: float
    act_bytes: float = 2.0

    @property
    def total_bytes(self) -> float:
        return self.weight_bytes + self.grad_bytes + self.optim_bytes


RECIPES = {
    "bf16-adam": Precision("bf16-adam", 2, 2, 12),  # mixed precision, fp32 master + m + v
    "fp32-adam": Precision("fp32-adam", 4, 4, 8, act_bytes=4),  # fp32 weights, grads, m, v
}


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
    experts also over ep. Exact for tp = pp = 1."""
    m = as_shape(model)
    share = stage_layers(m.n_layers, plan.pp) / m.n_layers
    if plan.pp == 1:
        emb = m.embedding_params()
    else:
        emb = m.vocab_size * m.d_model + (m.context * m.d_model if m.learned_positions else 0)
    expert = m.expert_params() * share
    dense = m.num_layer_params() * share - expert + emb
    return ParamsPerGPU(dense / plan.tp, expert / (plan.tp * plan.ep),
                        m.num_layer_params() / m.n_layers / plan.tp)


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
    """ZeRO-2 under a pipeline keeps whole gradient buffers over the step (Megatron-LM's
    distributed optimizer; :mod:`paratrain.layout`): only ZeRO-3 shards them then."""
    w, g, o = prec.weight_bytes * params, prec.grad_bytes * params, prec.optim_bytes * params
    if zero >= 1:
        o /= d
    if zero >= 3 or (zero == 2 and not pipelined):
        g /= d
    if zero >= 3:
        w /= d
    return ModelStates(w, g, o)


def model_states(model: ModelConfig, plan: ParallelPlan,
                 precision: str | Precision = "bf16-adam") -> ModelStates:
    """Weights, gradients and optimizer state per GPU for ``plan.zero`` over dp x cp
    (gradients unsharded under ZeRO-2 with a pipeline, as the runtime keeps them)."""
    prec = recipe(precision) if isinstance(precision, str) else precision
    p = params_per_gpu(model, plan)
    d = plan.dp * plan.cp
    a = _sharded(p.dense, d, plan.zero, prec, plan.pp > 1)
    b = _sharded(p.expert, d / plan.ep, plan.zero, prec, plan.pp > 1)
    return ModelStates(a.weights_bytes + b.weights_bytes, a.grads_bytes + b.grads_bytes,
                       a.optimizer_bytes + b.optimizer_bytes)


def model_states_bytes(model: ModelConfig, plan: ParallelPlan,
                       precision: str | Precision = "bf16-adam") -> float:
    return model_states(model, plan, precision).total_bytes


ATTENTION = ("flash", "eager")


def _check_kinds(recompute: str, attention: str) -> None:
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute={recompute!r} is unknown; choose none, selective or full")
    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r} is unknown; choose flash or eager "
                         "(pass e.g. --attention flash)")


def layer_activation_bytes(seq: int, batch: int, hidden: int, heads: int, tp: int = 1,
                           sp: bool = False, recompute: str = "none",
                           attention: str = "eager") -> float:
    """Korthikanti et al. 2022, Table 2: activation bytes one GPT layer (LayerNorm, GeLU
    MLP, dropout) keeps for backward at 16 bit. ``attention="eager"`` (their setting, the
    default here so the published figures are reproduced) keeps the 5 a s^2 b bytes of
    scores, softmax output and dropout mask; ``"flash"`` keeps none of them."""
    _check_kinds(recompute, attention)
    sbh = seq * batch * hidden
    t = tp
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    if recompute == "selective":
        return 34 * sbh / t if sp else sbh * (10 + 24 / t)
    attn = 5 * heads * seq / hidden if attention == "eager" else 0.0
    if sp:
        return sbh * (34 + attn) / t
    return sbh * (10 + 24 / t + attn / t)


def is_paratrain_block(model: ModelConfig) -> bool:
    """Whether ``model``'s layers are paratrain's own block (model.py): RMSNorm x 2, RoPE
    attention with head dim d_model / n_heads, SwiGLU, no biases, dense."""
    m = as_shape(model)
    return (m.mlp == "swiglu" and not m.bias and not m.learned_positions
            and m.norms_per_layer == 2 and not m.is_moe and not m.is_mla
            and m.head_dim * m.n_heads == m.d_model)


def block_activation_bytes(model: ModelConfig, seq: int, *, tp: int = 1, sp: bool = False,
                           recompute: str = "none", attention: str = "flash",
                           element_bytes: float = 2.0) -> float:
    """Bytes one layer keeps for backward, per sequence of ``seq`` tokens, on one
    tensor-parallel rank of ``tp`` (with sequence parallelism if ``sp``), at
    ``element_bytes`` per element. The one activation formula of paratrain.

    For paratrain's block (:func:`is_paratrain_block`) it is exact: the tensors autograd
    keeps in model.py, counted once per storage as
    :class:`paratrain.parallel.memory.ActivationMeter` measures them (the tests check
    float32 and float64 runs). With h = d_model, f = d_ff, a heads of E, K kv heads,
    t = tp and u = t with sequence parallelism (else 1), in elements:

    ====================  =====================================================  ========
    part                  kept for backward                                      elements
    ====================  =====================================================  ========
    each RMSNorm (2)      its input x, the normalised x r before the weight,    (2 s h
                          the reciprocal rms r                                    + s) / u
    linear inputs (2)     the normed input of wq/wk/wv and of w_gate/w_up;      2 s h
                          with SP the all-gathered (full-T) copy
    attention, flash      q, and k, v repeated to a heads (our GQA repeats       (4 s a E
                          before the kernel), the output, a log-sum-exp per row  + s a)/t
    attention, eager      q, k, v (repeated), the probabilities, wo's input      (4 s a E
                                                                                 + a s^2)/t
    attention, selective  q; k, v before the repeat (kept by the checkpoint);    (2 s a E
                          wo's input; the core is rerun in backward              + 2 s K E)/t
    SwiGLU                gate output, its silu, up output, their product        4 s f / t
    full recompute        only the block input                                   s h / u
    ====================  =====================================================  ========

    How it differs from Korthikanti's 34 s b h (16 bit): RMSNorm keeps the normalised
    tensor before and after its weight (LayerNorm in Megatron keeps its input only);
    SwiGLU keeps four d_ff-wide tensors where GeLU keeps two 4h-wide ones; there is no
    dropout (Korthikanti's masks are 3 s b h + a s^2 b). Under eager our block keeps
    only the softmax output (a s^2, no scores, no mask), not 5 a s^2 b. The RoPE
    tables are constants shared by all layers and are not counted. Under bf16
    autocast the element size varies by tensor (the norms run in fp32), so the count is
    exact only for float32 / float64 runs.

    Other shapes: Korthikanti's per-sequence figure scaled from 2 bytes to
    ``element_bytes`` (:func:`layer_activation_bytes`; ``flash`` drops 5 a s^2).
    """
    _check_kinds(recompute, attention)
    m = as_shape(model)
    if not is_paratrain_block(m):
        return layer_activation_bytes(seq, 1, m.d_model, m.n_heads, tp, sp, recompute,
                                      attention) * element_bytes / 2.0
    s, h, f, a, t = seq, m.d_model, m.d_ff, m.n_heads, tp
    u = t if sp else 1
    ae, ke = a * m.head_dim, m.kv_heads * m.head_dim
    if recompute == "full":
        return s * h / u * element_bytes
    norms = 2 * (2 * s * h + s) / u
    linear_inputs = 2 * s * h
    if recompute == "selective":
        attn = (2 * s * ae + 2 * s * ke) / t
    elif attention == "eager":
        attn = (4 * s * ae + a * s * s) / t
    else:
        attn = (4 * s * ae + s * a) / t
    mlp = 4 * s * f / t
    return (norms + linear_inputs + attn + mlp) * element_bytes


def edge_activation_bytes(model: ModelConfig, seq: int, micro_batch: int, *,
                          window_sequences: int, tp: int = 1, sp: bool = False,
                          first: bool = True, last: bool = True,
                          element_bytes: float = 2.0) -> float:
    """Bytes paratrain's runtime keeps for backward outside the blocks, for one
    micro-batch of ``micro_batch`` sequences on a chunk that holds the embedding
    (``first``) and/or the final norm, head and loss (``last``); each storage counted
    once per micro-batch, as both meters count it. With s = seq, b = micro_batch,
    h = d_model, V the vocabulary (ceil(V / t) rows on the busiest tp rank), e the
    element size, l = max(e, 4) the loss's (the loss runs in at least float32):

    ====================  =========================================  ================
    part                  kept for backward                          bytes
    ====================  =========================================  ================
    embedding, tp = 1     the token ids: a view into the loader's     8 W (s + 1)
                          (W, s + 1) window of the W sequences this
                          rank takes per step (x and y are views)
    embedding, tp > 1     the local ids and the outside-shard mask    9 b s
    final norm, head      norm input, normalised, 1/rms (sp: T / t);  e b ((2 s h + s)
                          the head's input (sp: all-gathered)         / u + s h)
    loss, tp = 1          log-softmax output, the targets (a copy     l b s V + 8 b s
                          if b > 1; for b = 1 a view of the window,   + l
                          counted unless the embedding holds it),
                          nll's scalar total weight
    loss, tp > 1          the local softmax, local target ids, mask   l b s V / t
                                                                      + 9 b s
    ====================  =========================================  ================
    """
    m = as_shape(model)
    s, b, h, e = seq, micro_batch, m.d_model, element_bytes
    u = tp if sp else 1
    window = 8.0 * window_sequences * (s + 1)
    out = 0.0
    if first:
        out += window if tp == 1 else 9.0 * b * s
    if last:
        loss_e = max(e, 4.0)
        out += e * b * ((2 * s * h + s) / u + s * h)
        if tp == 1:
            target = 8.0 * b * s if b > 1 else (0.0 if first else window)
            out += loss_e * b * s * m.vocab_size + target + loss_e
        else:
            out += loss_e * b * s * -(-m.vocab_size // tp) + 9.0 * b * s
    return out


def rank_activation_peaks(model: ModelConfig, plan: ParallelPlan, tokens_per_step: int,
                          seq_len: int, attention: str = "flash",
                          element_bytes: float = 2.0) -> list[float]:
    """Peak bytes saved for backward on each pipeline rank of paratrain's runtime, exact
    for its own model (float32 / float64; bf16 approximately).

    Each (micro-batch, chunk) keeps its blocks (:func:`block_activation_bytes`), the
    RoPE tables (the model's (context, E/2) cos and sin buffers, shared by its layers:
    counted once per micro-batch; under full recompute the checkpoints keep them as
    inputs) and the terms
    outside the blocks (:func:`edge_activation_bytes`), from its forward until its
    backward (``B``; under zero-bubble from ``F`` to the weight pass ``BW``). The peak of
    each rank is read off the pipeline schedule itself
    (:func:`paratrain.parallel.pipeline.schedule.build_schedule`): the live sum after
    each ``F`` in that rank's action order, which is what the runtime's meter records.
    The block split is the runtime's (:func:`paratrain.systems.stages.split_layers`).
    """
    from paratrain.parallel.pipeline.schedule import build_schedule
    from paratrain.systems.stages import split_layers

    m = as_shape(model)
    batch = split_batch(tokens_per_step, seq_len, plan)
    s, b = batch.local_seq, batch.micro_batch
    v = plan.virtual_stages if plan.schedule == "interleaved" and plan.pp > 1 else 1
    S = plan.pp * v
    ranges = split_layers(model, S)
    per_block = b * block_activation_bytes(m, s, tp=plan.tp, sp=plan.sp,
                                           recompute=plan.recompute, attention=attention,
                                           element_bytes=element_bytes)
    rope = m.context * m.head_dim * element_bytes  # full recompute: checkpoint inputs

    def chunk_bytes(rank: int, chunk: int) -> float:
        k = chunk * plan.pp + rank
        n = ranges[k][1] - ranges[k][0]
        return n * per_block + (rope if n else 0.0) + edge_activation_bytes(
            m, s, b, window_sequences=b * plan.micro_batches, tp=plan.tp, sp=plan.sp,
            first=k == 0, last=k == S - 1, element_bytes=element_bytes)

    if plan.pp == 1:
        return [chunk_bytes(0, 0)]
    sched = build_schedule(plan.schedule, plan.pp, plan.micro_batches, v)
    peaks = []
    for r, acts in enumerate(sched.actions):
        live: dict = {}
        cur = peak = 0.0
        for a in acts:
            if a.kind == "F":
                live[(a.mb, a.chunk)] = chunk_bytes(r, a.chunk)
                cur += live[(a.mb, a.chunk)]
                peak = max(peak, cur)
            elif a.kind in ("B", "BW"):  # BI keeps them until the weight pass
                cur -= live.pop((a.mb, a.chunk), 0.0)
        peaks.append(peak)
    return peaks


def micro_batches_in_flight(schedule: str, pp: int, m: int, v: int = 1) -> float:
    """Micro-batches whose activations the first (busiest) stage holds at its peak.

    GPipe: all m. 1F1B and ZB-H1: min(pp, m) (Narayanan et al. 2021; Qi et al. 2023).
    Interleaved 1F1B with v chunks: pp (1 + (pp - 1)/(pp v)) in units of a full stage
    (Korthikanti et al. 2022, Sec. 4.2.3).
    """
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return m
    if schedule == "interleaved":
        return min(m, pp) * (1 + (pp - 1) / (pp * v))
    return min(pp, m)


@dataclass(frozen=True)
class Memory:
    """Memory per GPU (busiest rank), bytes, and the verdict against the HBM."""

    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    logits_bytes: float  # fp32 logits for the loss (last stage; counted when pp == 1)
    buffers_bytes: float  # ZeRO-3: one layer gathered plus one prefetched
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
                     element_bytes: float = 2.0, *, runtime: bool = False) -> float:
    """Activations on the busiest GPU: per layer x layers per stage x in-flight
    micro-batches. ``attention`` defaults to Korthikanti's unfused kernel (``eager``);
    ``paratrain plan`` passes ``flash`` unless told otherwise.

    ``runtime=True`` (paratrain's own model as its runtime runs it): the busiest rank of
    :func:`rank_activation_peaks` instead, which adds the terms outside the blocks
    (embedding ids, final norm, head input, the loss's logits), the RoPE tables, the
    runtime's block split and the micro-batches in flight read off the schedule."""
    m = as_shape(model)
    if runtime and is_paratrain_block(m):
        return max(rank_activation_peaks(model, plan, tokens_per_step, seq_len, attention,
                                         element_bytes))
    batch = split_batch(tokens_per_step, seq_len, plan)
    per_layer = batch.micro_batch * block_activation_bytes(
        m, batch.local_seq, tp=plan.tp, sp=plan.sp, recompute=plan.recompute,
        attention=attention, element_bytes=element_bytes)
    layers = stage_layers(m.n_layers, plan.pp)
    inflight = micro_batches_in_flight(plan.schedule, plan.pp, plan.micro_batches,
                                       plan.virtual_stages)
    return per_layer * layers * inflight


def memory(model: ModelConfig, plan: ParallelPlan, hw: Hardware, tokens_per_step: int,
           seq_len: int, precision: str | Precision = "bf16-adam",
           attention: str = "eager") -> Memory:
    """Everything the busiest GPU holds at its peak, against ``hw.hbm_bytes``."""
    m: ModelShape = as_shape(model)
    prec = recipe(precision) if isinstance(precision, str) else precision
    st = model_states(m, plan, prec)
    act = activation_bytes(m, plan, tokens_per_step, seq_len, attention)
    batch = split_batch(tokens_per_step, seq_len, plan)
    logits = 4.0 * batch.local_seq * batch.micro_batch * m.vocab_size / plan.tp \
        if plan.pp == 1 else 0.0
    buffers = 2 * params_per_gpu(m, plan).layer_full * prec.weight_bytes if plan.zero == 3 \
        else 0.0
    return Memory(st.weights_bytes, st.grads_bytes, st.optimizer_bytes, act, logits, buffers,
                  hw.hbm_bytes)
