"""Model and training settings: small frozen dataclasses, validated on construction.

Pure Python (no torch import), so the systems model and `paratrain plan` can use the same
shapes as the runtime; the counts (parameters, FLOPs per token) live in
:mod:`paratrain.cost.shapes` (``as_shape(cfg).num_params()``). Every invalid value raises
one ``ValueError`` line that names the value and the fix; the CLI turns that into exit
code 2.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover: tomllib is stdlib from 3.11; on 3.10 the tomli backport
    import tomli as tomllib


ATTENTION = ("sdpa", "eager")
DTYPES = ("float32", "float64", "bfloat16")
REDUCE_DTYPES = ("bfloat16", "float32")


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def setting(default: object, help: str, *, flag: str | None = "",
            choices: tuple[str, ...] = ()) -> object:
    """A settings field with what its command-line flag needs: ``help``, the ``flag``
    ("" = ``--field-name``; None = a TOML key only) and the ``choices`` it allows (the
    ``__post_init__`` checks them). `paratrain train`, `plan` and `check-model` generate
    their flags from these fields (paratrain/cli/settings.py), so a setting is defined
    here once: name, type, default, help, flag, allowed values."""
    return field(default=default, metadata={"help": help, "flag": flag, "choices": choices})


def flag_of(f: dataclasses.Field) -> str | None:
    """The flag that sets field ``f`` (None: only a TOML key)."""
    flag = f.metadata.get("flag", "")
    return "--" + f.name.replace("_", "-") if flag == "" else flag


def flag_for(name: str) -> str | None:
    """The `paratrain train` flag that sets the field ``name`` of ModelConfig or
    TrainConfig (a ParallelPlan field's flag is always --field-name)."""
    for cls in (ModelConfig, TrainConfig):
        for f in dataclasses.fields(cls):
            if f.name == name:
                return flag_of(f)
    return "--" + name.replace("_", "-")


def pass_hint(name: str, example: object) -> str:
    """'pass e.g. --layers 4', or 'set e.g. vocab_size = 4 in the TOML' (no such flag)."""
    flag = flag_for(name)
    return f"pass e.g. {flag} {example}" if flag else f"set e.g. {name} = {example} in the TOML"


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a LLaMA-style decoder (RMSNorm, RoPE, SwiGLU, GQA).

    ``d_ff`` is the SwiGLU hidden width (three matrices: gate, up, down). ``attention``
    picks the kernel: ``sdpa`` (PyTorch's fused scaled_dot_product_attention, which keeps
    no s x s scores for backward) or ``eager`` (softmax(QK^T / sqrt(E) + mask) V written
    out, which keeps the a x s x s probabilities; the reference the fused kernel is
    checked against, and what Korthikanti et al. 2022's 5 a s / h term describes).
    """

    n_layers: int = setting(4, "Transformer blocks.", flag="--layers")
    d_model: int = setting(192, "Model width.")
    n_heads: int = setting(6, "Attention heads.", flag="--heads")
    n_kv_heads: int | None = setting(None, "KV heads (GQA; default: heads).", flag="--kv-heads")
    d_ff: int = setting(512, "SwiGLU hidden width.")
    vocab_size: int = setting(256, "Vocabulary (follows the tokenizer).", flag=None)
    context: int = setting(128, "Sequence length in tokens.")
    tie_embeddings: bool = setting(False, "Tie input/output embeddings.")
    norm_eps: float = setting(1e-5, "RMSNorm epsilon.", flag=None)
    rope_theta: float = setting(10000.0, "RoPE base.", flag=None)
    attention: str = setting("sdpa", "sdpa (fused, keeps no scores) or eager (keeps them).",
                             choices=ATTENTION)
    # Mixture of Experts (0 experts = dense). Block i's MLP is MoE when
    # (i + 1) % moe_every == 0; each MoE MLP has a router (d_model -> experts), `experts`
    # SwiGLU experts of width moe_ffn (None = d_ff), each token sent to its top_k,
    # plus `shared_experts` always-on experts (one SwiGLU of width shared_experts*moe_ffn).
    experts: int = setting(0, "Routed experts per MoE MLP (0 = dense).")
    top_k: int = setting(2, "Experts each token goes to.")
    moe_ffn: int | None = setting(None, "Expert hidden width (default d_ff).")
    shared_experts: int = setting(0, "Always-on shared experts.")
    moe_every: int = setting(1, "Every L-th block's MLP is MoE.")
    aux_loss_coef: float = setting(0.01, "Load-balancing loss weight.")
    # ST-MoE uses 1e-3 for the router z-loss
    z_loss_coef: float = setting(0.0, "Router z-loss weight (0 = off).")
    # C > 0: ceil(C T k / E) tokens per expert and sequence
    capacity_factor: float = setting(0.0, "Expert capacity (0 = dropless).")

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "d_ff", "vocab_size", "context"):
            v = getattr(self, name)
            _require(
                isinstance(v, int) and v > 0,
                f"{name}={v!r} must be a positive integer; {pass_hint(name, 4)}",
            )
        _require(
            self.d_model % self.n_heads == 0,
            f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
            "choose d_model as a multiple of n_heads",
        )
        kv = self.kv_heads
        _require(
            kv > 0 and self.n_heads % kv == 0,
            f"n_kv_heads={kv} must divide n_heads={self.n_heads}; choose a divisor",
        )
        _require(
            self.head_dim % 2 == 0,
            f"head dimension {self.head_dim} (d_model/n_heads) must be even for RoPE; "
            "change d_model or n_heads",
        )
        _require(
            self.attention in ATTENTION,
            f"attention={self.attention!r} is unknown; choose sdpa or eager "
            "(pass e.g. --attention sdpa)",
        )
        self._check_moe()

    def _check_moe(self) -> None:
        _require(isinstance(self.experts, int) and self.experts >= 0,
                 f"experts={self.experts!r} must be an integer >= 0 (0 = dense); "
                 "pass e.g. --experts 8")
        if not self.experts:
            return
        _require(isinstance(self.top_k, int) and 1 <= self.top_k <= self.experts,
                 f"top_k={self.top_k!r} must be an integer in [1, experts={self.experts}]; "
                 "pass e.g. --top-k 2")
        _require(self.moe_ffn is None or (isinstance(self.moe_ffn, int) and self.moe_ffn > 0),
                 f"moe_ffn={self.moe_ffn!r} must be a positive integer; pass e.g. --moe-ffn 64")
        _require(isinstance(self.shared_experts, int) and self.shared_experts >= 0,
                 f"shared_experts={self.shared_experts!r} must be an integer >= 0; "
                 "pass e.g. --shared-experts 1")
        _require(isinstance(self.moe_every, int) and 1 <= self.moe_every <= self.n_layers,
                 f"moe_every={self.moe_every!r} must be an integer in [1, n_layers="
                 f"{self.n_layers}]; pass e.g. --moe-every 2")
        _require(self.aux_loss_coef >= 0,
                 f"aux_loss_coef={self.aux_loss_coef} must be >= 0; pass e.g. "
                 "--aux-loss-coef 0.01")
        _require(self.z_loss_coef >= 0,
                 f"z_loss_coef={self.z_loss_coef} must be >= 0 (0 = off); pass e.g. "
                 "--z-loss-coef 0.001")
        _require(self.capacity_factor >= 0,
                 f"capacity_factor={self.capacity_factor} must be >= 0 (0 = dropless); "
                 "pass e.g. --capacity-factor 1.25")

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    # ---- Mixture of Experts ---------------------------------------------------------
    @property
    def expert_ffn(self) -> int:
        """Hidden width of one routed (and one shared) expert."""
        return self.d_ff if self.moe_ffn is None else self.moe_ffn

    def is_moe_layer(self, i: int) -> bool:
        """Whether block ``i`` (0-based) has an MoE MLP: (i + 1) % moe_every == 0."""
        return self.experts > 0 and (i + 1) % self.moe_every == 0

    @property
    def moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation and run settings (not the model, not the parallel layout)."""

    steps: int = setting(300, "Optimizer steps.")
    global_batch: int = setting(16, "Windows (sequences) per step, summed over workers.")
    lr: float = setting(3e-3, "Peak learning rate (0: frozen weights).")
    min_lr_ratio: float = setting(0.1, "Cosine floor as a fraction of lr.", flag=None)
    warmup_steps: int = setting(20, "Linear warm-up steps.")
    weight_decay: float = setting(0.1, "AdamW weight decay.", flag=None)
    beta1: float = setting(0.9, "AdamW beta1.", flag=None)
    beta2: float = setting(0.95, "AdamW beta2.", flag=None)
    grad_clip: float = setting(1.0, "Gradient-norm clip (0 = off).", flag=None)
    seed: int = setting(0, "Seed of weights and batches.")
    dtype: str = setting("float32", "Parameter dtype.", choices=DTYPES)
    reduce_dtype: str = setting("bfloat16", "Gradient reduction dtype under --dtype bfloat16.",
                                choices=REDUCE_DTYPES)
    eval_every: int = setting(50, "Validate every K steps (0 = only at the end).")
    eval_batches: int = setting(8, "Validation batches.", flag=None)
    checkpoint_every: int = setting(0, "Checkpoint every K steps (0 = only at the end).")
    data: str | None = setting(None, "Text, .jsonl or .parquet file, or a folder "
                               "(default: the standard library's source).")
    tokenizer: str = setting("bytes", "bytes | bpe:N | tokenizer.json path (docs/data.md).")
    text_field: str = setting("text", "Text field of .jsonl/.parquet records.")
    val_fraction: float = setting(0.05, "Held-out fraction of the corpus.", flag=None)

    def __post_init__(self) -> None:
        _require(self.steps > 0, f"steps={self.steps} must be positive; pass e.g. --steps 100")
        _require(
            self.global_batch > 0,
            f"global_batch={self.global_batch} must be positive; pass e.g. --global-batch 16",
        )
        # lr 0 is a frozen run: AdamW's step is lr x (...) = 0 and its decay factor
        # 1 - lr x weight_decay is exactly 1, so every weight keeps its bits
        # (docs/export.md, "Import"; a weight of -0.0 may come back as +0.0)
        _require(self.lr >= 0, f"lr={self.lr} must be positive (or 0: a frozen run); "
                 "pass e.g. --lr 3e-3")
        _require(
            0 <= self.min_lr_ratio <= 1,
            f"min_lr_ratio={self.min_lr_ratio} must be in [0, 1]",
        )
        _require(
            self.warmup_steps >= 0,
            f"warmup_steps={self.warmup_steps} must be >= 0; pass e.g. --warmup-steps 20",
        )
        _require(self.weight_decay >= 0, f"weight_decay={self.weight_decay} must be >= 0")
        _require(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "Adam betas must lie in [0, 1)")
        _require(
            self.grad_clip >= 0,
            f"grad_clip={self.grad_clip} must be >= 0 (0 disables clipping)",
        )
        _require(
            self.dtype in DTYPES,
            f"dtype={self.dtype!r} is not supported; choose one of {', '.join(DTYPES)}",
        )
        _require(
            self.reduce_dtype in REDUCE_DTYPES,
            f"reduce_dtype={self.reduce_dtype!r} is not supported; choose one of "
            f"{', '.join(REDUCE_DTYPES)} (it applies under --dtype bfloat16)",
        )
        _require(
            self.eval_every >= 0,
            f"eval_every={self.eval_every} must be >= 0 (0 = only at the end)",
        )
        _require(self.eval_batches > 0, f"eval_batches={self.eval_batches} must be positive")
        _require(self.checkpoint_every >= 0, f"checkpoint_every={self.checkpoint_every} >= 0")
        _require(
            0 < self.val_fraction < 1,
            f"val_fraction={self.val_fraction} must be in (0, 1)",
        )


@dataclass(frozen=True)
class RunConfig:
    """Everything a training run needs; built the same way from the CLI and from TOML."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


def read_toml(path: str | Path) -> dict:
    """The one TOML reader of the package (the catalogues, fitted parameters and run
    configs all come through here): ``tomllib`` from Python 3.11, ``tomli`` on 3.10."""
    with Path(path).open("rb") as f:
        return tomllib.load(f)


def load_toml(path: str | Path) -> dict:
    """Read a TOML file of ``[model]``, ``[train]`` and ``[plan]`` tables."""
    p = Path(path)
    _require(p.is_file(), f"config file {str(p)!r} does not exist; pass an existing TOML path")
    data = read_toml(p)
    unknown = set(data) - {"model", "train", "plan"}
    _require(
        not unknown, f"unknown table(s) {sorted(unknown)} in {p}; use [model], [train], [plan]"
    )
    return data


_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _type_word(v: object) -> str:
    if isinstance(v, bool):  # before int: True is an int in Python
        return f"a boolean ({str(v).lower()})"
    for t in (int, float, str):
        if isinstance(v, t):
            return f"{_TYPE_WORDS[t]} ({v!r})"
    return f"a {type(v).__name__} ({v!r})"


def check_value(name: str, where: str, v: object, hint: object) -> None:
    """``v`` is of the field's type ``hint`` (int, float, str, bool, or X | None) and finite;
    else one ValueError naming the key, the flag and the expected type."""
    args = typing.get_args(hint) or (hint,)
    if v is None and type(None) in args:
        return
    want = next(t for t in args if t is not type(None))
    flag = flag_for(name)
    key = f"[{where}] {name}" + (f" ({flag})" if flag else "")
    ok = {int: isinstance(v, int) and not isinstance(v, bool),
          float: isinstance(v, (int, float)) and not isinstance(v, bool),
          bool: isinstance(v, bool), str: isinstance(v, str)}[want]
    _require(ok, f"{key} must be {_TYPE_WORDS[want]}, got {_type_word(v)}")
    if want is float:
        _require(math.isfinite(v), f"{key} = {v!r} must be a finite number")


def check_types(cls, values: dict, where: str) -> None:
    """Every value of a TOML table has its field's type (even one a flag overrides)."""
    hints = typing.get_type_hints(cls)
    for name, v in values.items():
        if name in hints:
            check_value(name, where, v, hints[name])


def build(cls, values: dict, where: str):
    """Construct a settings dataclass from a dict, rejecting unknown keys by name and
    values of the wrong type (a bool for an int, a string for a float...) by key."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - names
    _require(
        not unknown,
        f"unknown key(s) {sorted(unknown)} in [{where}]; known keys: {', '.join(sorted(names))}",
    )
    values = dict(values)
    for name, v in values.items():
        check_value(name, where, v, hints[name])
    for name, v in values.items():
        if isinstance(v, int) and float in (typing.get_args(hints[name]) or (hints[name],)):
            values[name] = float(v)  # lr = 3 in TOML is the number 3.0
    return cls(**values)
