"""Model shapes for the systems model: ModelConfig plus what large published models need.

``ModelShape`` extends :class:`paratrain.config.ModelConfig` (LLaMA-style by default, so
the runtime's formulas hold unchanged) with: a GELU (two-matrix) MLP and biases (GPT-3),
learned positions, a head size other than d_model / n_heads (PaLM), mixture-of-experts
layers (Mixtral, DeepSeek-V3: Fedus et al. 2021; Dai et al. 2024) and multi-head latent
attention (DeepSeek-V2/V3, arXiv:2405.04434). Counts stay exact: parameters are summed
matrix by matrix from the shape.
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
    head_size: int | None = None  # None = d_model // n_heads
    norms_per_layer: int = 2
    # mixture of experts (0 experts = dense)
    n_experts: int = 0
    top_k: int = 0
    d_ff_expert: int = 0
    n_shared_experts: int = 0
    n_dense_layers: int = 0  # the first layers keep a dense MLP of width d_ff
    # multi-head latent attention (kv_lora_rank 0 = ordinary attention)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mlp not in MLPS:
            raise ValueError(f"mlp={self.mlp!r} is unknown; choose one of {', '.join(MLPS)}")
        if self.n_experts:
            if not 1 <= self.top_k <= self.n_experts:
                raise ValueError(
                    f"top_k={self.top_k} must be in 1..n_experts={self.n_experts}; set top_k"
                )
            if self.d_ff_expert <= 0:
                raise ValueError("d_ff_expert must be positive for an MoE model; set it")
            if not 0 <= self.n_dense_layers < self.n_layers:
                raise ValueError(
                    f"n_dense_layers={self.n_dense_layers} must be below n_layers={self.n_layers}"
                )

    # ---- shape helpers -------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.head_size if self.head_size else self.d_model // self.n_heads

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers if self.is_moe else 0

    def _mlp_params(self, width: int) -> int:
        d = self.d_model
        if self.mlp == "swiglu":
            return 3 * d * width + (2 * width + d if self.bias else 0)
        return 2 * d * width + (width + d if self.bias else 0)

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
        if self.bias:
            n += h * hd + 2 * self.kv_heads * hd + d
        return n

    def _norm_params(self) -> int:
        return self.norms_per_layer * self.d_model * (2 if self.bias else 1)

    def dense_layer_params(self) -> int:
        return self.attention_params() + self._mlp_params(self.d_ff) + self._norm_params()

    def expert_params_per_layer(self) -> int:
        """Routed experts of one MoE layer (these are what expert parallelism splits)."""
        return self.n_experts * self._mlp_params(self.d_ff_expert)

    def moe_layer_params(self) -> int:
        shared = self.n_shared_experts * self._mlp_params(self.d_ff_expert)
        router = self.d_model * self.n_experts
        return (self.attention_params() + self.expert_params_per_layer() + shared + router
                + self._norm_params())

    # ---- exact counts (override ModelConfig's) --------------------------------------
    def layer_params(self) -> int:
        """Parameters of an average block (exact for dense models)."""
        return self.num_layer_params() // self.n_layers

    def num_layer_params(self) -> int:
        if not self.is_moe:
            return self.n_layers * self.dense_layer_params()
        return (self.n_dense_layers * self.dense_layer_params()
                + self.moe_layers * self.moe_layer_params())

    def embedding_params(self) -> int:
        d = self.d_model
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        pos = self.context * d if self.learned_positions else 0
        return emb + pos + d * (2 if self.bias else 1)

    def num_params(self) -> int:
        return self.num_layer_params() + self.embedding_params()

    def expert_params(self) -> int:
        """All routed-expert parameters (split by ep); the rest is replicated."""
        return self.moe_layers * self.expert_params_per_layer()

    def active_params(self) -> int:
        """Parameters each token passes through (MoE: top_k of the routed experts)."""
        if not self.is_moe:
            return self.num_params()
        unused = self.moe_layers * (self.n_experts - self.top_k) * self._mlp_params(
            self.d_ff_expert)
        return self.num_params() - unused

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Score and value matmuls, forward + backward: 6 T H (d_qk + d_v) per layer,
        i.e. 12 L H Q T when d_qk = d_v = Q (PaLM, appendix B)."""
        if self.is_mla:
            dqk, dv = self.qk_nope_dim + self.qk_rope_dim, self.v_head_dim
        else:
            dqk = dv = self.head_dim
        return 6.0 * self.n_layers * self.n_heads * (dqk + dv) * seq_len

    def lookup_params(self) -> int:
        """Tables a token only reads a row of (no matmul): the input embedding when it is
        not also the output layer, and learned position embeddings."""
        d = self.d_model
        return ((0 if self.tie_embeddings else self.vocab_size * d)
                + (self.context * d if self.learned_positions else 0))

    def flops_per_token(self, seq_len: int | None = None, count: str = "6N") -> float:
        """Model FLOPs per token, forward + backward, as one of :data:`FLOP_COUNTS` counts
        them: ``6N`` (ours, docs/design.md: 6 N_active + 12 L H Q T), ``matmul`` (the
        input-embedding lookup is no matmul: 6 (N_active - lookup tables) + 12 L H Q T, as
        Megatron-LM, NeMo, MaxText, torchtitan and llm-foundry's benchmark table report)
        or ``causal`` (``matmul`` with the attention halved for the causal mask, for a
        source that counts only the scores a causal kernel computes)."""
        t = self.context if seq_len is None else seq_len
        if count not in FLOP_COUNTS:
            raise ValueError(f"FLOP count {count!r} is unknown; use one of "
                             f"{', '.join(FLOP_COUNTS)}")
        params = self.active_params() - (0 if count == "6N" else self.lookup_params())
        attention = self.attention_flops_per_token(t) * (0.5 if count == "causal" else 1.0)
        return 6.0 * params + attention


FLOP_COUNTS = ("6N", "matmul", "causal")


_FIELDS = {f.name for f in dataclasses.fields(ModelShape)}


def model_from_dict(values: dict, where: str) -> ModelShape:
    values = {k: v for k, v in values.items() if k != "aliases"}
    values.setdefault("name", where)
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
