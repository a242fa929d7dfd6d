"""Activation memory: the bytes a layer, the model's ends and a pipeline rank keep for
backward (torch-free). Korthikanti et al. 2022 for published shapes; exact counts of the
tensors paratrain's own block saves (:func:`block_activation_bytes`)."""

from __future__ import annotations

from paratrain.config import ModelConfig
from paratrain.cost.groups import split_batch
from paratrain.cost.moe_activations import moe_mlp_activation_bytes
from paratrain.cost.ranks import virtual_stages
from paratrain.cost.schedule import stage_of
from paratrain.cost.shapes import ModelShape, as_shape
from paratrain.plan import ParallelPlan

ATTENTION = ("flash", "eager")


def kernel(attention: str) -> str:
    """A run's ``attention`` setting (ModelConfig: ``sdpa`` | ``eager``) in the cost
    model's words: ``flash`` is any fused kernel that keeps no scores for backward
    (PyTorch's sdpa, FlashAttention), ``eager`` the written-out softmax."""
    return "eager" if attention == "eager" else "flash"


def _check_kinds(recompute: str, attention: str) -> None:
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute={recompute!r} is unknown; choose none, selective or full")
    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r} is unknown; choose flash or eager "
                         "(pass e.g. --attention flash)")


def layer_activation_bytes(seq: int, batch: int, hidden: int, heads: int, tp: int = 1,
                           sp: bool = False, recompute: str = "none",
                           attention: str = "eager", fp8: bool = False) -> float:
    """Korthikanti et al. 2022, Table 2: activation bytes one GPT layer (LayerNorm, GeLU
    MLP, dropout) keeps for backward at 16 bit. ``attention="eager"`` (their setting, the
    default here so the published figures are reproduced) keeps the 5 a s^2 b bytes of
    scores, softmax output and dropout mask; ``"flash"`` keeps none of them.

    ``fp8`` (FP8 linear layers, Transformer Engine's recipe: each linear layer keeps its
    input for the weight gradient as the FP8 copy it multiplied with): the four linear
    inputs of the 34 s b h, QKV's (2), the output projection's (2), the first MLP
    matrix's (2) and the second's (8), take half the bytes, 7 s b h less: 10 + 24 / t
    becomes 8 + 19 / t (QKV's and the first MLP matrix's inputs are the replicated ones).
    Full recompute keeps the block's 16-bit input either way."""
    _check_kinds(recompute, attention)
    sbh = seq * batch * hidden
    t = tp
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    whole, split = (8, 19) if fp8 else (10, 24)  # replicated / split over tp, x s b h
    if recompute == "selective":
        return (whole + split) * sbh / t if sp else sbh * (whole + split / t)
    attn = 5 * heads * seq / hidden if attention == "eager" else 0.0
    if sp:
        return sbh * (whole + split + attn) / t
    return sbh * (whole + split / t + attn / t)


def is_paratrain_block(model: ModelConfig, etp: int = 1) -> bool:
    """Whether ``model``'s layers are paratrain's own block (paratrain.model): RMSNorm x 2, RoPE
    attention (heads of ``head_dim``, d_model / n_heads or ``head_size``), SwiGLU, no
    biases; its MLP dense or
    paratrain's :class:`paratrain.model.MoE` (``ModelConfig.experts``, layers picked by
    ``is_moe_layer``) with whole experts (the plan's ``etp`` 1). Experts split over etp > 1
    (Megatron-Core's layout) or a published model's layer plan (``first_dense_layers``)
    are not: they keep Korthikanti's figure."""
    m = as_shape(model)
    return (m.mlp == "swiglu" and not m.bias and not m.learned_positions
            and m.norms_per_layer == 2 and not m.is_mla
            and not (m.is_moe and (etp > 1 or m.first_dense_layers)))


def block_activation_bytes(model: ModelConfig, seq: int, *, tp: int = 1, sp: bool = False,
                           recompute: str = "none", attention: str = "flash",
                           element_bytes: float = 2.0, cp: int = 1,
                           cp_algorithm: str = "ring", layer: int | None = None,
                           ep: int = 1, etp: int = 1, ours: bool = True,
                           fp8: bool = False) -> float:
    """Bytes one layer keeps for backward, per sequence of ``seq`` tokens held by this
    rank (T / cp under context parallelism), on one tensor-parallel rank of ``tp`` (with
    sequence parallelism if ``sp``), at ``element_bytes`` per element. The one
    activation formula of paratrain.

    For paratrain's block (:func:`is_paratrain_block`) it is exact: the tensors autograd
    keeps in paratrain.model, counted once per storage as
    :class:`paratrain.parallel.memory.ActivationMeter` measures them (the tests check
    float32 and float64 runs). With h = d_model, f = d_ff, t = tp and u = t with
    sequence parallelism (else 1), in elements:

    ====================  =====================================================  ========
    part                  kept for backward                                      elements
    ====================  =====================================================  ========
    each RMSNorm (2)      its input x, the normalised x r before the weight,    (2 s h
                          the reciprocal rms r                                    + s) / u
    linear inputs (2)     the normed input of wq/wk/wv and of w_gate/w_up;      2 s h
                          with SP the all-gathered (full-T) copy
    attention             :func:`attention_elements` (kernel, recompute, cp)
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

    ``ours=False`` (a published run, e.g. the runs table's): the count above is what
    paratrain's runtime keeps, not what another engine keeps (under SP it holds the
    all-gathered input of the column-parallel linears, where Megatron-Core keeps the
    shard and gathers it again in the backward, Korthikanti et al. 2022, Sec. 4.2.2), so
    every shape gets the published figure.

    MoE layers keep :func:`mlp_activation_bytes` in place of the SwiGLU row. Other
    shapes: :func:`_published_block_bytes` (Korthikanti et al. 2022).

    ``fp8``: FP8 linear layers (:func:`layer_activation_bytes`), which paratrain's runtime
    does not train with, so every shape gets the published figure with FP8 inputs.
    """
    _check_kinds(recompute, attention)
    m = as_shape(model)
    ring = cp > 1 and cp_algorithm == "ring"
    if fp8 or not (ours and is_paratrain_block(m, etp)):
        return _published_block_bytes(m, seq, tp, sp, recompute, attention, element_bytes,
                                      cp, ring, fp8)
    s, h, t = seq, m.d_model, tp
    u = t if sp else 1
    if recompute == "full":
        return s * h / u * element_bytes
    norms = 2 * (2 * s * h + s) / u
    linear_inputs = 2 * s * h
    attn = attention_elements(m, s, t, recompute, attention, cp, ring)
    mlp = mlp_activation_bytes(m, s, t, element_bytes, layer, ep)
    return (norms + linear_inputs + attn) * element_bytes + mlp


def _published_block_bytes(m: ModelShape, seq: int, tp: int, sp: bool, recompute: str,
                           attention: str, element_bytes: float, cp: int, ring: bool,
                           fp8: bool = False) -> float:
    """Shapes paratrain's block does not implement: Korthikanti's per-sequence figure
    scaled from 2 bytes to ``element_bytes`` (:func:`layer_activation_bytes`; ``flash``
    drops 5 a s^2; ``fp8`` its linear inputs in FP8); the ring keeps no scores;
    all-to-all, unfused, keeps each rank's a / cp heads' T x T = cp s x s scores."""
    def korthikanti(kind: str) -> float:
        return layer_activation_bytes(seq, 1, m.d_model, m.n_heads, tp, sp, recompute,
                                      kind, fp8) * element_bytes / 2.0
    if ring or attention == "flash" or cp == 1:
        return korthikanti("flash" if ring else attention)
    return korthikanti("eager") + (cp - 1) * (korthikanti("eager") - korthikanti("flash"))


def attention_elements(m: ModelShape, s: int, t: int, recompute: str, attention: str, cp: int,
                       ring: bool) -> float:
    """Elements paratrain's attention keeps for backward per sequence of ``s`` tokens on
    one of ``t`` tensor-parallel ranks, a heads of E, K kv heads:

    ====================  =====================================================  ========
    attention, flash      q, and k, v repeated to a heads (our GQA repeats       (4 s a E
                          before the kernel), the output, a log-sum-exp per row  + s a)/t
    attention, eager      q, k, v (repeated), the probabilities, wo's input      (4 s a E
                                                                                 + a s^2)/t
    attention, selective  q; k, v before the repeat (kept by the checkpoint);    (2 s a E
                          wo's input; the core is rerun in backward              + 2 s K E)/t
    ====================  =====================================================  ========

    Context parallelism (cp > 1, :mod:`paratrain.parallel.context`) changes only this
    (selective and full recompute keep the same tensors as without cp):

    ====================  =====================================================  ========
    ring (any kernel)     q; k, v as the rank holds them (kv heads, not         (2 s a E
                          repeated: GQA repeats per block); the merged output,  + 2 s K E
                          which is also wo's input (a view); one log-sum-exp     + s a)/t
                          per row. Blocks are computed and dropped one by one:
                          no s x s scores are kept, whatever ``attention`` says
    all-to-all, flash     as flash, over the whole sequence T = cp s on a / cp   (5 s a E
                          heads (the same element count), plus wo's input: the   + s a)/t
                          output after the return all-to-all is a new tensor
    all-to-all, eager     q, k, v, the a / cp heads' T x T probabilities, wo's   (4 s a E
                          input                                                  + cp a s^2)/t
    ====================  =====================================================  ========

    The K/V blocks in flight around the ring (the rank's own and the one arriving: 4 s K E
    elements; in backward also the travelling dK/dV accumulators), the ring's per-block
    scores, and all-to-all's received pieces before they are put in global order are
    working memory of one layer at a time, freed before the next layer runs: they are not
    kept for backward and not counted here (docs/context-parallel.md).

    Qwen3's query and key norms (``qk_norm``) run before the core, outside its rerun,
    and keep what a block's norm keeps, per head: the projection's output, the
    normalised tensor and one reciprocal rms per head and token, 2 s (a + K) E + s (a +
    K) elements / t under every kernel, recompute and cp but full."""
    a = m.n_heads
    ae, ke = a * m.head_dim, m.kv_heads * m.head_dim
    qk = (2 * s * (ae + ke) + s * (a + m.kv_heads)) / t if m.qk_norm else 0.0
    if recompute == "selective":
        return qk + (2 * s * ae + 2 * s * ke) / t
    if ring:
        return qk + (2 * s * ae + 2 * s * ke + s * a) / t
    if attention == "eager":
        return qk + (4 * s * ae + cp * a * s * s) / t
    return qk + (4 * s * ae + s * a + (s * ae if cp > 1 else 0)) / t


def mlp_activation_bytes(m: ModelShape, s: int, t: int, element_bytes: float, layer: int | None,
                         ep: int) -> float:
    """Bytes the MLP of block ``layer`` keeps per sequence of ``s`` tokens: the SwiGLU's
    4 s f / t elements, or when it is an MoE layer (``model.is_moe_layer(layer)``)
    :func:`moe_mlp_activation_bytes` (the norms, attention and the MLP's linear input,
    which is the router's, are the dense block's); ``layer`` None gives the mean over the
    model's blocks (times n_layers: the model's total). ``ep``: the expert-parallel size
    (its index tensors)."""
    dense_mlp = 4 * s * m.d_ff / t * element_bytes
    if layer is None:
        moe_share = m.moe_layers / m.n_layers
    else:
        moe_share = float(m.is_moe_layer(layer))
    if not moe_share:
        return dense_mlp
    moe = moe_mlp_activation_bytes(m, s, element_bytes=element_bytes, ep=ep)
    return (1 - moe_share) * dense_mlp + moe_share * moe


def edge_activation_bytes(model: ModelConfig, seq: int, micro_batch: int, *,
                          window_sequences: int, tp: int = 1, sp: bool = False,
                          first: bool = True, last: bool = True,
                          element_bytes: float = 2.0, cp_ids: bool = False) -> float:
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

    ``cp_ids`` (context parallelism): x and y are this cp rank's columns, gathered into
    two new (W, s) tensors, so with tp = 1 the embedding keeps 8 W s (x) and the loss
    8 W s (its targets, a view of y whatever b is), W the sequences gathered at once.
    """
    m = as_shape(model)
    s, b, h, e = seq, micro_batch, m.d_model, element_bytes
    u = tp if sp else 1
    window = 8.0 * window_sequences * (s if cp_ids else s + 1)
    out = 0.0
    if first:
        out += window if tp == 1 else 9.0 * b * s
    if last:
        loss_e = max(e, 4.0)
        out += e * b * ((2 * s * h + s) / u + s * h)
        if tp == 1:
            if cp_ids:
                target = window
            else:
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

    Each (micro-batch, chunk) keeps its blocks (:func:`block_activation_bytes`, block
    by block: an MoE model's MoE and dense blocks differ; ``plan.ep`` for its exchange), the
    RoPE tables (the model's (context / cp, E/2) cos and sin buffers, shared by its layers:
    counted once per micro-batch; under full recompute the checkpoints keep them as
    inputs) and the terms
    outside the blocks (:func:`edge_activation_bytes`), from its forward until its
    backward (``B``; under zero-bubble from ``F`` to the weight pass ``BW``). The peak of
    each rank is read off the pipeline schedule itself
    (:func:`paratrain.cost.schedule.build_schedule`): the live sum after
    each ``F`` in that rank's action order, which is what the runtime's meter records.
    The block split is the runtime's (:func:`paratrain.cost.stages.split_layers`).
    """
    from paratrain.cost.schedule import build_schedule
    from paratrain.cost.stages import split_layers

    m = as_shape(model)
    batch = split_batch(tokens_per_step, seq_len, plan)
    s, b = batch.local_seq, batch.micro_batch
    v = virtual_stages(plan)
    S = plan.pp * v
    ranges = split_layers(model, S)
    per_block = [b * block_activation_bytes(m, s, tp=plan.tp, sp=plan.sp,
                                            recompute=plan.recompute, attention=attention,
                                            element_bytes=element_bytes, cp=plan.cp,
                                            cp_algorithm=plan.cp_algorithm, layer=i,
                                            ep=plan.ep, etp=plan.etp)
                 for i in range(m.n_layers)]
    # full recompute: checkpoint inputs; cp: the rank's own T / cp rows of the tables
    rope = m.context // plan.cp * m.head_dim * element_bytes
    # cp: the ids are gathered per forward_backward call (one micro-batch without a
    # pipeline, the rank's whole batch with one)
    window = b * plan.micro_batches if plan.cp == 1 or plan.pp > 1 else b

    def chunk_bytes(rank: int, chunk: int) -> float:
        k = stage_of(plan.schedule, plan.pp, rank, chunk)
        lo, hi = ranges[k]
        return sum(per_block[lo:hi]) + (rope if hi > lo else 0.0) + edge_activation_bytes(
            m, s, b, window_sequences=window, tp=plan.tp, sp=plan.sp,
            first=k == 0, last=k == S - 1, element_bytes=element_bytes, cp_ids=plan.cp > 1)

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
    (Korthikanti et al. 2022, Sec. 4.2.3). ZB-V: min(2 pp, 2 m) half-stage chunks, i.e.
    min(pp, m) (Qi et al. 2023, sec. 6); DualPipeV one chunk more, pp + 1/2 (both read
    off the simulated schedules, ``tests/test_pipeline_schedule.py``).
    """
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return m
    if schedule == "dualpipev":
        return pp + 0.5
    if schedule == "interleaved":
        return min(m, pp) * (1 + (pp - 1) / (pp * v))
    return min(pp, m)
