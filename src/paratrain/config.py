"""Model and training settings: small frozen dataclasses, validated on construction.

Pure Python (no torch import), so the systems model and `paratrain plan` can use the same
shapes as the runtime; the counts (parameters, FLOPs per token) live in
:mod:`paratrain.cost.shapes` (``as_shape(cfg).num_params()``). Every invalid value raises
one ``ValueError`` line that names the value and the fix; the CLI turns that into exit
code 2.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
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
# Documented maxima (each field's range is in its setting(...)), so nothing loops a billion
# times before refusing; the largest published models (models.toml, calibration.csv) have
# 128 layers, width 25,600, FFN 114,688, 256 heads or experts, 256k vocabulary, 131k context.
MAX_LAYERS = 4096
MAX_WIDTH = 2**22
MAX_HEADS = 2**14
MAX_VOCAB = 2**24
MAX_CONTEXT = 2**24
MAX_STEPS = 10**9
MAX_BATCH = 2**24
MAX_SEED = 2**40  # the batch generator seeds torch with seed * 1_000_003 + step (int64)


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def setting(default: object, help: str, *, flag: str | None = "",
            choices: tuple[str, ...] = (), lo: float | None = None, hi: float | None = None,
            gt: float | None = None, lt: float | None = None) -> object:
    """A settings field with what its flag needs: ``help``, the ``flag`` ("" =
    ``--field-name``; None = a TOML key only), the ``choices`` it allows, and a number's
    documented range, ``lo``/``hi`` inclusive and ``gt``/``lt`` exclusive (checked by
    :func:`check_ranges` before anything loops over the value). `paratrain train`, `plan`
    and `check-model` generate their flags from these fields (paratrain/cli/settings.py),
    so a setting is defined here once."""
    bounds = dict(lo=lo, hi=hi, gt=gt, lt=lt)
    return field(default=default, metadata={"help": help, "flag": flag, "choices": choices,
                                            "bounds": {k: v for k, v in bounds.items()
                                                       if v is not None}})


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


def range_text(b: dict, integer: bool) -> str:
    """'an integer in [1, 4096]', 'a number in (0, 10]', '0, 1, 2 or 3', 'a number >= 0'."""
    n = lambda x: str(x) if isinstance(x, int) else f"{x:g}"  # noqa: E731
    if integer and "lo" in b and "hi" in b and b["hi"] - b["lo"] <= 4:
        *first, last = (str(i) for i in range(b["lo"], b["hi"] + 1))
        return f"{', '.join(first)} or {last}"
    left = f"[{n(b['lo'])}" if "lo" in b else f"({n(b['gt'])}" if "gt" in b else ""
    right = f"{n(b['hi'])}]" if "hi" in b else f"{n(b['lt'])})" if "lt" in b else ""
    kind = "an integer" if integer else "a number"
    if left and right:
        return f"{kind} in {left}, {right}"
    return f"{kind} {'>=' if 'lo' in b else '>'} {left[1:]}" if left else \
        f"{kind} {'<=' if 'hi' in b else '<'} {right[:-1]}"


def _in_range(v: float, b: dict) -> bool:
    return ((not isinstance(v, float) or math.isfinite(v)) and b.get("lo", v) <= v
            <= b.get("hi", v) and v > b.get("gt", -math.inf) and v < b.get("lt", math.inf))


@functools.cache  # the systems model builds plans by the thousand
def _bounded(cls) -> list[tuple[dataclasses.Field, dict, bool, bool]]:
    """(field, bounds, integer?, may be None?) of each bounded field: once per class."""
    args = {n: typing.get_args(h) or (h,) for n, h in typing.get_type_hints(cls).items()}
    return [(f, f.metadata["bounds"], int in args[f.name], type(None) in args[f.name])
            for f in dataclasses.fields(cls) if f.metadata.get("bounds")]


def check_ranges(obj) -> None:
    """Every bounded field of the settings dataclass ``obj`` is a number of its type
    inside its documented range (``setting(lo=, hi=, gt=, lt=)``); else one ValueError
    naming the key, the value, the flag, the range and an example: 'zero = 5 (--zero):
    must be 0, 1, 2 or 3; pass e.g. --zero 0'."""
    for f, b, integer, optional in _bounded(type(obj)):
        v = getattr(obj, f.name)
        if v is None and optional:
            continue
        ok = isinstance(v, int if integer else (int, float)) and not isinstance(v, bool)
        if not (ok and _in_range(v, b)):  # nan and inf too
            flag = flag_for(f.name)
            raise ValueError(f"{f.name} = {v!r}" + (f" ({flag})" if flag else "") + ": must "
                             f"be {range_text(b, integer)}; {pass_hint(f.name, f.default)}")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a LLaMA-style decoder (RMSNorm, RoPE, SwiGLU, GQA).

    ``d_ff`` is the SwiGLU hidden width (three matrices: gate, up, down). ``attention``
    picks the kernel: ``sdpa`` (PyTorch's fused scaled_dot_product_attention, which keeps
    no s x s scores for backward) or ``eager`` (softmax(QK^T / sqrt(E) + mask) V written
    out, which keeps the a x s x s probabilities; the reference the fused kernel is
    checked against, and what Korthikanti et al. 2022's 5 a s / h term describes).
    """

    n_layers: int = setting(4, "Transformer blocks.", flag="--layers", lo=1, hi=MAX_LAYERS)
    d_model: int = setting(192, "Model width.", lo=1, hi=MAX_WIDTH)
    n_heads: int = setting(6, "Attention heads.", flag="--heads", lo=1, hi=MAX_HEADS)
    n_kv_heads: int | None = setting(None, "KV heads (GQA; default: heads).", flag="--kv-heads",
                                     lo=1, hi=MAX_HEADS)
    head_size: int | None = setting(None, "Head width (default d_model / heads).", flag=None,
                                    lo=2, hi=MAX_WIDTH)
    d_ff: int = setting(512, "SwiGLU hidden width.", lo=1, hi=MAX_WIDTH)
    vocab_size: int = setting(256, "Vocabulary (follows the tokenizer).", flag=None, lo=2,
                              hi=MAX_VOCAB)
    context: int = setting(128, "Sequence length in tokens.", lo=1, hi=MAX_CONTEXT)
    tie_embeddings: bool = setting(False, "Tie input/output embeddings.")
    norm_eps: float = setting(1e-5, "RMSNorm epsilon.", flag=None, gt=0, lt=1)
    rope_theta: float = setting(10000.0, "RoPE base.", flag=None, gt=1, hi=1e12)
    # Llama 3's RoPE scaling (model.rope_frequencies): factor 1 = none; the rest Llama 3.1's
    rope_factor: float = setting(1.0, "Llama 3 RoPE scaling factor.", flag=None, lo=1, hi=1e6)
    rope_low_freq: float = setting(1.0, "Llama 3 RoPE low_freq_factor.", flag=None, gt=0, hi=1e6)
    rope_high_freq: float = setting(4.0, "Llama 3 RoPE high_freq_factor.", flag=None, gt=0, hi=1e6)
    rope_original_context: int = setting(8192, "Llama 3 RoPE original context.", flag=None,
                                         lo=1, hi=MAX_CONTEXT)
    attention: str = setting("sdpa", "sdpa (fused, keeps no scores) or eager (keeps them).",
                             choices=ATTENTION)
    # Qwen's attention (TOML keys that --init-from sets): q, k, v biases; q, k norms
    qkv_bias: bool = setting(False, "Biases on the q, k, v projections (Qwen2).", flag=None)
    qk_norm: bool = setting(False, "RMSNorm on each head's queries and keys (Qwen3).", flag=None)
    # Mixture of Experts (0 experts = dense; model.MoE): every moe_every-th block's MLP
    experts: int = setting(0, "Routed experts per MoE MLP (0 = dense).", lo=0, hi=MAX_HEADS)
    top_k: int = setting(2, "Experts each token goes to.")
    moe_ffn: int | None = setting(None, "Expert hidden width (default d_ff).", lo=1, hi=MAX_WIDTH)
    moe_renorm: bool = setting(True, "Renormalise the top-k weights (Qwen2-MoE: no).", flag=None)
    shared_experts: int = setting(0, "Always-on shared experts.", lo=0, hi=MAX_HEADS)
    shared_gate: bool = setting(False, "Sigmoid gate on the shared experts (Qwen2-MoE).",
                                flag=None)
    moe_every: int = setting(1, "Every L-th block's MLP is MoE.")
    aux_loss_coef: float = setting(0.01, "Load-balancing loss weight.", lo=0)
    # ST-MoE uses 1e-3 for the router z-loss
    z_loss_coef: float = setting(0.0, "Router z-loss weight (0 = off).", lo=0)
    # C > 0: ceil(C T k / E) tokens per expert and sequence
    capacity_factor: float = setting(0.0, "Expert capacity (0 = dropless).", lo=0)

    def __post_init__(self) -> None:
        check_ranges(self)
        _require(self.head_size is not None or self.d_model % self.n_heads == 0,
                 f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                 "choose d_model as a multiple of n_heads, or set head_size")
        _require(self.kv_heads > 0 and self.n_heads % self.kv_heads == 0, f"n_kv_heads="
                 f"{self.kv_heads} must divide n_heads={self.n_heads}; choose a divisor")
        _require(self.head_dim % 2 == 0,
                 f"head dimension {self.head_dim} (head_size, or d_model/n_heads) must be "
                 "even for RoPE; change head_size, d_model or n_heads")
        _require(self.rope_high_freq > self.rope_low_freq,
                 f"rope_high_freq={self.rope_high_freq} must exceed rope_low_freq="
                 f"{self.rope_low_freq} (Llama 3 scaling interpolates between them); set "
                 "e.g. rope_low_freq = 1.0 and rope_high_freq = 4.0 in [model]")
        _require(self.attention in ATTENTION,
                 f"attention={self.attention!r} is unknown; choose sdpa or eager "
                 "(pass e.g. --attention sdpa)")
        self._check_moe()

    def _check_moe(self) -> None:
        if not self.experts:
            return
        _require(isinstance(self.top_k, int) and 1 <= self.top_k <= self.experts,
                 f"top_k={self.top_k!r} must be an integer in [1, experts={self.experts}]; "
                 "pass e.g. --top-k 2")
        _require(isinstance(self.moe_every, int) and 1 <= self.moe_every <= self.n_layers,
                 f"moe_every={self.moe_every!r} must be an integer in [1, n_layers="
                 f"{self.n_layers}]; pass e.g. --moe-every 2")
        _require(self.shared_experts or not self.shared_gate, "shared_gate = true needs "
                 "shared experts; pass e.g. --shared-experts 1")

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.n_heads

    @property
    def expert_ffn(self) -> int:
        """Hidden width of one routed (and one shared) expert."""
        return self.d_ff if self.moe_ffn is None else self.moe_ffn

    def is_moe_layer(self, i: int) -> bool:
        """Whether block ``i`` (0-based) has an MoE MLP: (i + 1) % moe_every == 0."""
        return self.experts > 0 and (i + 1) % self.moe_every == 0

    @functools.cached_property  # the layout search asks hundreds of thousands of times
    def moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation and run settings (not the model, not the parallel layout)."""

    steps: int = setting(300, "Optimizer steps.", lo=1, hi=MAX_STEPS)
    global_batch: int = setting(16, "Windows (sequences) per step, summed over workers.",
                                lo=1, hi=MAX_BATCH)
    # lr 0: a frozen run (AdamW's step and decay vanish: every weight keeps its bits)
    lr: float = setting(3e-3, "Peak learning rate (0: frozen weights).", lo=0)
    min_lr_ratio: float = setting(0.1, "Cosine floor as a fraction of lr.", flag=None, lo=0, hi=1)
    warmup_steps: int = setting(20, "Linear warm-up steps.", lo=0, hi=MAX_STEPS)
    weight_decay: float = setting(0.1, "AdamW weight decay.", flag=None, lo=0)
    beta1: float = setting(0.9, "AdamW beta1.", flag=None, lo=0, lt=1)
    beta2: float = setting(0.95, "AdamW beta2.", flag=None, lo=0, lt=1)
    grad_clip: float = setting(1.0, "Gradient-norm clip (0 = off).", flag=None, lo=0)
    seed: int = setting(0, "Seed of weights and batches.", lo=0, hi=MAX_SEED)
    dtype: str = setting("float32", "Parameter dtype.", choices=DTYPES)
    reduce_dtype: str = setting("bfloat16", "Gradient reduction dtype under --dtype bfloat16.",
                                choices=REDUCE_DTYPES)
    eval_every: int = setting(50, "Validate every K steps (0 = only at the end).", lo=0,
                              hi=MAX_STEPS)
    eval_batches: int = setting(8, "Validation batches.", flag=None, lo=1, hi=MAX_BATCH)
    checkpoint_every: int = setting(0, "Checkpoint every K steps (0 = only at the end).",
                                    lo=0, hi=MAX_STEPS)
    data: str | None = setting(None, "Text, .jsonl or .parquet file, or a folder "
                               "(default: the standard library's source).")
    tokenizer: str = setting("bytes", "bytes | bpe:N | tokenizer.json path (docs/data.md).")
    text_field: str = setting("text", "Text field of .jsonl/.parquet records.")
    val_fraction: float = setting(0.05, "Held-out fraction of the corpus.", flag=None, gt=0, lt=1)

    def __post_init__(self) -> None:
        check_ranges(self)
        _require(self.dtype in DTYPES, f"dtype={self.dtype!r} is not supported; choose one "
                 f"of {', '.join(DTYPES)}")
        _require(self.reduce_dtype in REDUCE_DTYPES, f"reduce_dtype={self.reduce_dtype!r} is "
                 f"not supported; choose one of {', '.join(REDUCE_DTYPES)} (it applies under "
                 "--dtype bfloat16)")


@dataclass(frozen=True)
class RunConfig:
    """Everything a training run needs; built the same way from the CLI and from TOML."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


def read_toml(path: str | Path) -> dict:
    """The one TOML reader of the package (the catalogues, fitted parameters and run
    configs all come through here): ``tomllib`` from Python 3.11, ``tomli`` on 3.10.
    A file that cannot be read, is not UTF-8 or is not TOML is one ValueError naming it
    (and, for a key given twice, the key)."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except UnicodeDecodeError as e:
        raise ValueError(f"{str(p)!r} is not UTF-8 text (byte {e.object[e.start]:#04x} at "
                         f"offset {e.start}); save it as UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(_toml_error(p, str(e))) from None
    except OSError as e:
        raise ValueError(f"{str(p)!r} cannot be read ({e.strerror}); pass a readable "
                         "TOML file") from None


def _toml_error(p: Path, msg: str) -> str:
    where = re.search(r"\(at line (\d+), column \d+\)", msg)
    if where and msg.startswith(("Cannot overwrite", "Cannot declare")):
        line = p.read_text(encoding="utf-8").splitlines()[int(where[1]) - 1]
        key = line.split("=")[0].strip().strip("[]")
        return f"{str(p)!r} line {where[1]}: {key!r} is given twice; keep one"
    return f"{str(p)!r} is not valid TOML: {msg}; fix that line"


def canonical_keys(cls, values: dict, where: str) -> dict:
    """A TOML table's keys as ``cls``'s field names: a field may also be spelled as its
    flag (``layers`` for ``n_layers``, as ``--layers``); both spellings of one field in one
    table is an error naming both."""
    alias = {flag[2:].replace("-", "_"): f.name for f in dataclasses.fields(cls)
             if (flag := flag_of(f)) and flag[2:].replace("-", "_") != f.name}
    out: dict = {}
    for k, v in values.items():
        name = alias.get(k, k)
        if name in out:
            other = next(a for a, n in alias.items() if n == name)
            raise ValueError(f"[{where}] gives both {name} and {other} (one field, the flag "
                             f"{flag_for(name)}); keep one")
        out[name] = v
    return out


def load_toml(path: str | Path) -> dict:
    """Read a TOML file of ``[model]``, ``[train]`` and ``[plan]`` tables (a [model] or
    [train] key may be spelled as its flag: :func:`canonical_keys`)."""
    p = Path(path)
    _require(p.exists(), f"config file {str(p)!r} does not exist; pass an existing TOML path")
    _require(p.is_file(), f"config file {str(p)!r} is "
             f"{'a directory' if p.is_dir() else 'not a regular file'}; pass a TOML file")
    data = read_toml(p)
    unknown = set(data) - {"model", "train", "plan"}
    _require(not unknown,
             f"unknown table(s) {sorted(unknown)} in {p}; use [model], [train], [plan]")
    for where, v in data.items():
        _require(isinstance(v, dict), f"{where} in {p} must be a table ([{where}]), got {v!r}")
    for where, cls in (("model", ModelConfig), ("train", TrainConfig)):
        if where in data:
            data[where] = canonical_keys(cls, data[where], where)
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
    """Construct a settings dataclass from a dict (a key may be a field's flag name),
    rejecting unknown keys by name and values of the wrong type by key."""
    hints = typing.get_type_hints(cls)
    values = canonical_keys(cls, values, where)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - names
    _require(
        not unknown,
        f"unknown key(s) {sorted(unknown)} in [{where}]; known keys: {', '.join(sorted(names))}",
    )
    for name, v in values.items():
        check_value(name, where, v, hints[name])
    for name, v in values.items():
        if isinstance(v, int) and float in (typing.get_args(hints[name]) or (hints[name],)):
            values[name] = float(v)  # lr = 3 in TOML is the number 3.0
    return cls(**values)
