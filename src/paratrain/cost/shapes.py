"""Model shapes and their counts: the one home of parameter counts and FLOPs per token.

``ModelShape`` extends :class:`paratrain.config.ModelConfig` (LLaMA-style by default, so
the runtime's model is priced as it is built) with: a GELU (two-matrix) MLP and biases
(GPT-3), learned positions, a head size other than d_model / n_heads (PaLM), dense first
layers in a mixture-of-experts model (DeepSeek-V3: Dai et al. 2024), multi-head
latent attention (DeepSeek-V2/V3, arXiv:2405.04434) and multi-token prediction
(DeepSeek-V3; priced as work, left out of the counts as its report leaves it out).
Mixture of experts uses ModelConfig's names (``experts``, ``top_k``, ``moe_ffn``,
``shared_experts``, ``moe_every``; Fedus et al. 2021), so ``as_shape(cfg)`` counts what
the runtime builds from ``cfg``. Counts are exact: parameters are summed matrix by matrix
from the shape. Every caller (runtime, systems model, run prediction, tests, benchmarks)
prices a ModelConfig through :func:`as_shape` (docs/design.md, "Parameter and FLOP
counts").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from paratrain.config import ModelConfig
from paratrain.cost.catalogue import lookup, read_catalogue

MLPS = ("swiglu", "gelu")


@dataclass(frozen=True)
class ModelShape(ModelConfig):
    """A decoder's shape. Defaults reproduce ModelConfig (LLaMA: SwiGLU, no biases)."""

    name: str = "custom"
    mlp: str = "swiglu"
    bias: bool = False
    learned_positions: bool = False
    norms_per_layer: int = 2
    # mixture of experts beyond ModelConfig: the first layers keep a dense MLP of width
    # d_ff (DeepSeek-V3's first 3); how the experts split over ranks is the plan's (ep,
    # etp: paratrain.cost.moe_layout), not the shape's
    first_dense_layers: int = 0
    # multi-head latent attention (kv_lora_rank 0 = ordinary attention)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    # local attention (Mistral 7B, Gemma 2/3, gpt-oss, Llama 4): a query sees the last
    # ``local_window`` keys ("sliding") or only its own ``local_window``-token chunk
    # ("chunked"), except in every ``global_every``-th block (0: in none), which attends
    # to the whole causal context. Prices the attention's time (:meth:`attended_keys`);
    # the FLOP counts a source reports MFU in stay the full causal ones.
    local_window: int = 0
    local_kind: str = "sliding"
    global_every: int = 0
    # under an expert capacity (ModelConfig.capacity_factor > 0), every expert computes
    # its whole capacity, empty slots included (Megatron-Core's
    # moe_pad_expert_input_to_capacity; MaxText's dense, non-megablox MoE): priced by
    # paratrain.systems.moe_step.expert_load
    pad_to_capacity: bool = False
    # multi-token prediction (DeepSeek-V3, arXiv:2412.19437 Sec. 2.2): each depth is one
    # more block of the model's kind, fed the 2d x d projection of [next token's
    # embedding; hidden], with its own output layer and loss, on the last pipeline stage
    # (Megatron-Core's MTP). Priced as work (:meth:`mtp_flops_per_token`); the parameter
    # and FLOP counts stay the main model's, as DeepSeek's 671B leaves the module out.
    mtp_layers: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mlp not in MLPS:
            raise ValueError(f"mlp={self.mlp!r} is unknown; choose one of {', '.join(MLPS)}")
        if self.experts and not 0 <= self.first_dense_layers < self.n_layers:
            raise ValueError(f"first_dense_layers={self.first_dense_layers} must be in "
                             f"[0, n_layers={self.n_layers}); set e.g. first_dense_layers = 0")
        if self.local_kind not in LOCAL_KINDS:
            raise ValueError(f"local_kind={self.local_kind!r} is unknown; choose one of "
                             f"{', '.join(LOCAL_KINDS)}")
        if self.pad_to_capacity and self.capacity_factor <= 0:
            raise ValueError("pad_to_capacity needs an expert capacity: set capacity_factor "
                             "> 0 (e.g. 1.0)")
        if self.mtp_layers < 0:
            raise ValueError(f"mtp_layers={self.mtp_layers}: give 0 (none) or a count")
        if self.local_window < 0 or self.global_every < 0:
            raise ValueError(f"local_window={self.local_window}, global_every="
                             f"{self.global_every}: give 0 (none) or a positive count")
        if self.is_mla and min(self.qk_nope_dim, self.qk_rope_dim, self.v_head_dim) <= 0:
            raise ValueError(f"multi-head latent attention (kv_lora_rank={self.kv_lora_rank}) "
                             "needs qk_nope_dim, qk_rope_dim and v_head_dim > 0 (DeepSeek-V3: "
                             "128, 64, 128)")

    # ---- shape helpers -------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def grouped_experts(self) -> bool:
        """Whether the experts run as one grouped matmul over the tokens sorted by expert
        (a dropless MoE), not as dense einsums over capacity slots (``pad_to_capacity``)."""
        return self.is_moe and not self.pad_to_capacity

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def mlp_up_matrices(self) -> int:
        """The MLP's d -> width matrices (SwiGLU: gate and up; GELU: up); one more, the
        down projection, maps back."""
        return 2 if self.mlp == "swiglu" else 1

    def is_moe_layer(self, i: int) -> bool:
        """ModelConfig's rule ((i + 1) % moe_every == 0) past the first dense layers."""
        return i >= self.first_dense_layers and super().is_moe_layer(i)

    # ---- exact parameter counts ----------------------------------------------------
    def dense_mlp_params(self) -> int:
        """A dense block's MLP (width d_ff)."""
        return self._mlp_params(self.d_ff)

    def _mlp_params(self, width: int) -> int:
        d = self.d_model
        up = self.mlp_up_matrices
        return (up + 1) * d * width + (up * width + d if self.bias else 0)

    def attention_params(self) -> int:
        d, h = self.d_model, self.n_heads
        if self.is_mla:
            qk = self.qk_nope_dim + self.qk_rope_dim
            q = (d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * qk
                 if self.q_lora_rank else d * h * qk)
            kv = (d * (self.kv_lora_rank + self.qk_rope_dim) + self.kv_lora_rank
                  + self.kv_lora_rank * h * (self.qk_nope_dim + self.v_head_dim))
            return q + kv + h * self.v_head_dim * d
        hd = self.head_dim
        n = d * h * hd + 2 * d * self.kv_heads * hd + h * hd * d
        if self.bias or self.qkv_bias:  # q, k, v biases (GPT-3: the output's too)
            n += h * hd + 2 * self.kv_heads * hd + (d if self.bias else 0)
        return n

    def norm_params(self) -> int:
        """One block's norm weights (and LayerNorm biases), Qwen3's per-head query and
        key norms (``qk_norm``, head_dim each): element-wise, no matmul."""
        qk = 2 * self.head_dim if self.qk_norm else 0
        return self.norms_per_layer * self.d_model * (2 if self.bias else 1) + qk

    def expert_params(self) -> int:
        """One routed expert: an MLP of width ``expert_ffn`` (SwiGLU: gate, up, down)."""
        return self._mlp_params(self.expert_ffn)

    def moe_mlp_params(self, active: bool = False) -> int:
        """One MoE MLP: router (d_model -> experts) + the routed experts (all, or the
        top_k a token uses) + the shared experts (one MLP of shared_experts x moe_ffn)
        and their gate (``shared_gate``)."""
        routed = self.top_k if active else self.experts
        shared = (self._mlp_params(self.shared_experts * self.expert_ffn)
                  if self.shared_experts else 0)
        gate = self.d_model if self.shared_gate else 0  # Qwen2-MoE's d -> 1 sigmoid gate
        return self.d_model * self.experts + routed * self.expert_params() + shared + gate

    def layer_params(self, i: int | None = None, active: bool = False) -> int:
        """Parameters of block ``i`` (attention, MLP, norms); ``i`` None: a dense block.
        ``active``: only what one token uses (its top_k experts)."""
        moe = i is not None and self.is_moe_layer(i)
        mlp = self.moe_mlp_params(active) if moe else self._mlp_params(self.d_ff)
        return self.attention_params() + mlp + self.norm_params()

    def num_layer_params(self, active: bool = False) -> int:
        """All blocks' parameters (``active``: those one token uses)."""
        n_moe = self.moe_layers if self.is_moe else 0
        moe = self.layer_params(self._first_moe_layer(), active) if n_moe else 0
        return (self.n_layers - n_moe) * self.layer_params() + n_moe * moe

    def _first_moe_layer(self) -> int:
        return next(i for i in range(self.n_layers) if self.is_moe_layer(i))

    def routed_expert_params(self) -> int:
        """Every routed expert of every MoE layer: what expert parallelism splits."""
        return self.moe_layers * self.experts * self.expert_params() if self.is_moe else 0

    def embedding_params(self) -> int:
        """Token embedding plus output head (one matrix when tied), learned positions,
        the final norm."""
        d = self.d_model
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        pos = self.context * d if self.learned_positions else 0
        return emb + pos + d * (2 if self.bias else 1)

    def lookup_params(self) -> int:
        """Tables a token only reads a row of (no matmul): the input embedding when it is
        not also the output layer, and learned position embeddings."""
        d = self.d_model
        return ((0 if self.tie_embeddings else self.vocab_size * d)
                + (self.context * d if self.learned_positions else 0))

    def num_params(self) -> int:
        """Exact parameter count (LLaMA 2 7B's shape gives 6,738,415,616); with MoE the
        total (every expert)."""
        return self.num_layer_params() + self.embedding_params()

    def active_params(self) -> int:
        """Parameters one token uses: the total for a dense model; with MoE the router,
        top_k routed experts and the shared experts of each MoE MLP."""
        return self.num_layer_params(active=True) + self.embedding_params()

    # ---- FLOPs per token -----------------------------------------------------------
    def _attention_flops_per_layer(self, seq_len: int) -> float:
        if self.is_mla:
            dqk, dv = self.qk_nope_dim + self.qk_rope_dim, self.v_head_dim
        else:
            dqk = dv = self.head_dim
        return 6.0 * self.n_heads * (dqk + dv) * seq_len

    def is_local_layer(self, i: int) -> bool:
        """Whether block ``i`` attends within its local window (:attr:`local_window`)."""
        return self.local_window > 0 and not (
            self.global_every and (i + 1) % self.global_every == 0)

    def attended_keys(self, seq_len: int) -> float:
        """Keys a query attends to in causal attention over ``seq_len`` tokens, the mean
        over queries and blocks, as a continuous count (the whole context: seq_len / 2,
        half the score matrix). A sliding window w: w - w^2 / (2 seq_len) once seq_len >
        w; chunks of c tokens: c / 2 a whole chunk, the remainder r's r / 2."""
        full = seq_len / 2
        w = self.local_window
        if not w or seq_len <= w:
            return full
        if self.local_kind == "sliding":
            local = w - w * w / (2 * seq_len)
        else:
            whole, r = divmod(seq_len, w)
            local = (whole * w * w / 2 + r * r / 2) / seq_len
        n_local = sum(map(self.is_local_layer, range(self.n_layers)))
        return (n_local * local + (self.n_layers - n_local) * full) / self.n_layers

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Score and value matmuls, forward + backward: 6 T H (d_qk + d_v) per layer,
        i.e. 12 L H Q T when d_qk = d_v = Q (PaLM, appendix B)."""
        return self.n_layers * self._attention_flops_per_layer(seq_len)

    def block_flops_per_token(self, i: int | None = None, seq_len: int | None = None, *,
                              norms: bool = True) -> float:
        """Forward + backward FLOPs of block ``i`` (None: a dense block) per token at
        ``seq_len`` (default: the context): 6 x the parameters a token uses + the
        attention's 6 T H (d_qk + d_v) (PaLM, appendix B). ``norms=False`` leaves out the
        norm weights (element-wise, and replicated over tensor-parallel ranks, so the rest
        is what a tp shard divides). The pipeline split (:mod:`paratrain.cost.stages`)
        and the run prediction (:mod:`paratrain.predict.step`) weigh blocks by it."""
        t = self.context if seq_len is None else seq_len
        params = self.layer_params(i, active=True) - (0 if norms else self.norm_params())
        return 6.0 * params + self._attention_flops_per_layer(t)

    def head_flops_per_token(self) -> float:
        """The output layer's matmul, forward + backward: 6 V d (the embedding is a
        lookup, no FLOPs)."""
        return 6.0 * self.vocab_size * self.d_model

    def mtp_projection_params(self) -> int:
        """One multi-token-prediction depth's 2d x d projection (:attr:`mtp_layers`)."""
        return 2 * self.d_model * self.d_model

    def mtp_flops_per_token(self, seq_len: int | None = None) -> float:
        """Forward + backward FLOPs per token of the multi-token-prediction depths, each
        a block (weighed as a dense one, as the pipeline split weighs blocks), its
        projection and its output layer; 0 without them."""
        depth = (self.block_flops_per_token(None, seq_len)
                 + 6.0 * self.mtp_projection_params() + self.head_flops_per_token())
        return self.mtp_layers * depth

    def flops_per_token(self, seq_len: int | None = None, count: str = "6N") -> float:
        """Model FLOPs per token, forward + backward, as one of :data:`FLOP_COUNTS` counts
        them: ``6N`` (ours, docs/design.md: 6 N_active + 12 L H Q T, PaLM appendix B; N
        includes the embedding), ``matmul`` (the input-embedding lookup is no matmul:
        6 (N_active - lookup tables) + 12 L H Q T, as Megatron-LM, NeMo, MaxText,
        torchtitan and llm-foundry's benchmark table report) or ``causal`` (``matmul``
        with the attention halved for the causal mask, for a source that counts only the
        scores a causal kernel computes)."""
        t = self.context if seq_len is None else seq_len
        if count not in FLOP_COUNTS:
            raise ValueError(f"FLOP count {count!r} is unknown; use one of "
                             f"{', '.join(FLOP_COUNTS)}")
        params = self.active_params() - (0 if count == "6N" else self.lookup_params())
        attention = self.attention_flops_per_token(t) * (0.5 if count == "causal" else 1.0)
        return 6.0 * params + attention


FLOP_COUNTS = ("6N", "matmul", "causal")
LOCAL_KINDS = ("sliding", "chunked")


_FIELDS = {f.name for f in dataclasses.fields(ModelShape)}
# the MoE keys ModelShape had before it shared ModelConfig's names
_RENAMED = {"n_experts": "experts", "d_ff_expert": "moe_ffn",
            "n_shared_experts": "shared_experts", "n_dense_layers": "first_dense_layers"}


def model_from_dict(values: dict, where: str) -> ModelShape:
    values = {k: v for k, v in values.items() if k != "aliases"}
    values.setdefault("name", where)
    old = sorted(set(values) & set(_RENAMED))
    if old:
        raise ValueError(f"model {where!r} uses old key(s) {', '.join(old)}; rename them "
                         + ", ".join(f"{k} -> {_RENAMED[k]}" for k in old))
    unknown = sorted(set(values) - _FIELDS)
    if unknown:
        raise ValueError(
            f"model {where!r} has unknown key(s) {', '.join(unknown)}; "
            f"known keys: {', '.join(sorted(_FIELDS))}"
        )
    for k in ("n_layers", "d_model", "n_heads", "d_ff", "vocab_size"):
        if k not in values:
            raise ValueError(f"model {where!r} is missing key {k}; add it")
    return ModelShape(**values)


def as_shape(model: ModelConfig) -> ModelShape:
    """View any ModelConfig as a ModelShape (same counts) so the model can price it."""
    if isinstance(model, ModelShape):
        return model
    values = {f.name: getattr(model, f.name) for f in dataclasses.fields(ModelConfig)}
    return ModelShape(**values)


def load_model(name_or_path: str) -> ModelShape:
    """A catalogue model by name or alias (case-insensitive), or a .toml/.json file."""
    key, fields = lookup(name_or_path, "models.toml", "model")
    return model_from_dict(fields, key)


def model_names() -> list[str]:
    return list(read_catalogue("models.toml"))
