"""Start from a Hugging Face folder: ``paratrain train --init-from HF_DIR`` (docs/export.md,
"Import"). The inverse of :mod:`paratrain.files.export`.

``HF_DIR`` holds a ``LlamaForCausalLM`` (or a ``MistralForCausalLM``: the same decoder
and tensor names, its sliding window no narrower than the run's context; or a
``Qwen2ForCausalLM``, Llama with biased q, k, v projections, or a ``Qwen3ForCausalLM``,
Llama with an RMSNorm over each head's queries and keys; or Mixtral, Qwen2-MoE, Qwen3-MoE;
or a ``Phi3ForCausalLM``, Llama with fused tensors): ``config.json``,
``model.safetensors`` (or the shards a ``model.safetensors.index.json`` lists) and
optionally ``tokenizer.json``.

- :func:`settle` (the launcher, no torch): ``config.json`` -> the run's
  :class:`~paratrain.config.ModelConfig`, Llama 3's RoPE scaling (Llama 3.1 onwards)
  and a ``head_dim`` other than hidden / heads included; what paratrain's decoder cannot
  compute (another RoPE scaling, biases, another activation, ...) is refused by name, and
  so is a model setting given by flag or TOML that contradicts the config (``--init-from``
  sets the model; only ``--context``, at most ``max_position_embeddings``, and
  ``--attention``, a kernel choice, are the run's). The folder's ``tokenizer.json``,
  when present, is the run's tokenizer.
- :func:`load_into` (every worker): the tensors under paratrain's names
  (``hf_arch.tensor_names``), RoPE rows permuted back (``hf_arch.halves_to_interleaved``),
  in float32, copied one by one into the seeded :class:`~paratrain.model.Decoder` before
  the engine is built, so every layout takes its shards from the full model exactly as
  it does from a fresh one.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from paratrain.config import ModelConfig, TrainConfig, flag_for, load_toml
from paratrain.files.hf_arch import ARCHITECTURES, MOE_NAMES

# ModelConfig field -> config.json key (and its transformers default when absent; None:
# required), the settings --init-from decides
FIELDS = {"n_layers": ("num_hidden_layers", None), "d_model": ("hidden_size", None),
          "n_heads": ("num_attention_heads", None), "d_ff": ("intermediate_size", None),
          "vocab_size": ("vocab_size", None), "n_kv_heads": ("num_key_value_heads", 0),
          "tie_embeddings": ("tie_word_embeddings", False),
          "norm_eps": ("rms_norm_eps", 1e-6), "rope_theta": ("rope_theta", 10000.0)}
RUN_FIELDS = ("context", "attention")  # the run's own, not the checkpoint's
DEFAULT_CONTEXT = ModelConfig().context


def read_config(hf_dir: str | Path) -> dict:
    """``HF_DIR/config.json`` as a dict; one ValueError when it is not there or not JSON."""
    d = Path(hf_dir)
    if not d.is_dir():
        raise ValueError(f"--init-from {str(hf_dir)!r} is not a directory; pass a Hugging "
                         "Face model folder (config.json + model.safetensors)")
    p = d / "config.json"
    try:
        cfg = json.loads(p.read_text())
    except OSError:
        raise ValueError(f"--init-from {str(hf_dir)!r} has no readable config.json; pass a "
                         "folder written by save_pretrained or paratrain export") from None
    except ValueError as e:
        raise ValueError(f"{p} is not JSON ({e}); pass a folder written by "
                         "save_pretrained or paratrain export") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{p} is not a JSON object; pass a Hugging Face config.json")
    return cfg


# Llama 3's RoPE scaling: ModelConfig field -> its key in rope_scaling / rope_parameters
LLAMA3_ROPE = {"rope_factor": "factor", "rope_low_freq": "low_freq_factor",
               "rope_high_freq": "high_freq_factor",
               "rope_original_context": "original_max_position_embeddings"}


def _rope(hf: dict, where: str) -> dict:
    """``rope_theta`` and, for Llama 3's scaling (rope_type "llama3", Llama 3.1 onwards),
    its four numbers, as ModelConfig fields (transformers 4.x: ``rope_theta`` at the top
    level and ``rope_scaling``; 5.x: both in ``rope_parameters``); any other scaled RoPE
    (linear, dynamic, yarn, longrope, ...) is refused: paratrain does not compute it."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    if not isinstance(scaling, dict):
        raise ValueError(f"{where} has rope_scaling={scaling!r}; pass a config.json whose "
                         "rope_scaling is an object with a rope_type")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"{where} has partial_rotary_factor={partial}; paratrain rotates "
                         "every pair of a head: pick a model with partial_rotary_factor 1")
    unscaled = ModelConfig()
    out = {"rope_theta": float(params.get("rope_theta", hf.get("rope_theta", 10000.0))),
           **{name: getattr(unscaled, name) for name in LLAMA3_ROPE}}  # factor 1: none
    if kind == "default":
        return out
    if kind != "llama3":
        raise ValueError(f"{where} sets rope_scaling (rope_type {kind!r}); paratrain's RoPE "
                         "is the default one or Llama 3's (rope_type 'llama3'): pick a "
                         "model with one of those")
    missing = [k for k in LLAMA3_ROPE.values() if k not in scaling]
    if missing:
        raise ValueError(f"{where}'s llama3 rope_scaling has no {', '.join(missing)}; pass "
                         "a complete config.json")
    out.update({name: scaling[key] for name, key in LLAMA3_ROPE.items()})
    out["rope_factor"] = float(out["rope_factor"])
    return out


# what a folder's model_type adds to Llama's decoder (hf_arch.ARCHITECTURES has them all):
# Mistral's, Mixtral's and Phi-3's sliding window changes nothing while the run's context
# fits in it (settle); Qwen's are the ModelConfig fields of QWEN (and a window of their
# own, off unless use_sliding_window); the MoE ones' experts are _moe_fields'
QWEN = {"qwen2": {"qkv_bias": True}, "qwen3": {"qk_norm": True},
        "qwen2_moe": {"qkv_bias": True}, "qwen3_moe": {"qk_norm": True}}
# ModelConfig field -> config.json key of an MoE folder's (key when absent: None required)
MOE_FIELDS = {"experts": ("num_local_experts", None), "top_k": ("num_experts_per_tok", None),
              "moe_ffn": ("moe_intermediate_size", None),
              "moe_every": ("decoder_sparse_step", 1)}
# a key as another architecture spells it, for messages (Qwen3-MoE's num_experts; Mixtral's
# experts are intermediate_size wide)
OTHER_KEYS = {"num_local_experts": "num_experts", "moe_intermediate_size": "intermediate_size"}
SAME_AS = {"n_kv_heads": "n_heads", "moe_ffn": "d_ff"}  # None: the other field's value


def _windowed(hf: dict) -> bool:
    """Whether the model attends within ``sliding_window`` (Mistral's, Mixtral's and
    Phi-3's always, Qwen's layers only under ``use_sliding_window``)."""
    kind = hf.get("model_type")
    return kind in ("mistral", "mixtral", "phi3") or (kind in QWEN and
                                                     bool(hf.get("use_sliding_window")))


def _moe_fields(hf: dict, where: str) -> dict:
    """An MoE folder's experts as ModelConfig fields (a dense one's: experts 0). paratrain's
    router is Mixtral's (softmax, top k, renormalised over the k) and Qwen's (renormalised
    under ``norm_topk_prob``: ``moe_renorm``); its MoE blocks are every ``moe_every``-th,
    as Qwen's ``decoder_sparse_step`` (``mlp_only_layers`` would need a list); Qwen2-MoE's
    shared expert is ``shared_experts`` routed experts wide, behind its sigmoid gate."""
    kind = hf.get("model_type")
    if kind not in MOE_NAMES:
        return {"experts": 0}
    if hf.get("mlp_only_layers"):
        raise ValueError(f"{where} has mlp_only_layers={hf['mlp_only_layers']}; paratrain's "
                         "MoE blocks are every decoder_sparse_step-th: pick a model without")
    out = {"moe_ffn": None, "moe_every": 1}  # Mixtral: every block, experts d_ff wide
    for name, (key, default) in MOE_FIELDS.items():
        if kind == "mixtral" and name in out:
            continue
        v = hf.get(key, hf.get("num_experts") if name == "experts" else default)
        if v is None:
            raise ValueError(f"{where} has no {key}; pass a complete {ARCHITECTURES[kind]} "
                             "config.json")
        out[name] = v
    out["moe_renorm"] = kind == "mixtral" or bool(hf.get("norm_topk_prob", False))
    shared = hf.get("shared_expert_intermediate_size", 0) if kind == "qwen2_moe" else 0
    if shared and shared % out["moe_ffn"]:
        raise ValueError(f"{where} has shared_expert_intermediate_size={shared}, not a "
                         f"multiple of moe_intermediate_size={out['moe_ffn']}; paratrain's "
                         "shared expert is a whole number of experts wide")
    n = shared // out["moe_ffn"] if shared else 0
    return {**out, "shared_experts": n, "shared_gate": bool(n)}


def context_limits(hf: dict) -> dict[str, int]:
    """The config.json keys that bound a run's context, with their values: the positions
    the model was made for and a sliding window (paratrain attends the whole context, so
    a context past the window would compute something else)."""
    window = hf.get("sliding_window") if _windowed(hf) else None
    limits = {"max_position_embeddings": hf.get("max_position_embeddings"),
              "sliding_window": window}
    return {k: v for k, v in limits.items() if isinstance(v, int) and v > 0}


def _refuse_unsupported(hf: dict, where: str) -> None:
    """What LlamaForCausalLM can set and paratrain's decoder cannot compute, by name."""
    arch = hf.get("architectures") or []
    kind = hf.get("model_type")
    if kind not in ARCHITECTURES or (arch and ARCHITECTURES[kind] not in arch):
        raise ValueError(f"{where} describes model_type {kind!r} "
                         f"({', '.join(arch) or 'no architectures'}); --init-from reads "
                         f"{', '.join(ARCHITECTURES.values())} folders only")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where} has hidden_act={hf['hidden_act']!r}; paratrain's MLP is "
                         "SwiGLU (silu): pick a model with hidden_act silu")
    for key in ("attention_bias", "mlp_bias"):  # Llama's and Qwen3's bias the output too
        if hf.get(key):
            raise ValueError(f"{where} has {key}=true; paratrain's output and MLP "
                             "projections have no bias: pick a model without those biases")
    for key in ("attention_dropout", "resid_pdrop", "embd_pdrop"):  # Phi-3's, the last two
        if hf.get(key, 0.0):
            raise ValueError(f"{where} has {key}={hf[key]}; paratrain trains without "
                             "dropout: set it to 0.0 in config.json")


def hf_model_fields(hf: dict, where: str) -> dict:
    """The ModelConfig fields ``config.json`` decides (dense: experts 0)."""
    _refuse_unsupported(hf, where)
    out = {}
    for name, (key, default) in FIELDS.items():
        if name == "rope_theta":
            out.update(_rope(hf, where))
            continue
        v = hf.get(key, default)
        if v is None:
            raise ValueError(f"{where} has no {key}; pass a complete LlamaForCausalLM "
                             "config.json")
        out[name] = v
    if out["n_kv_heads"] in (0, out["n_heads"]):
        out["n_kv_heads"] = None  # plain multi-head attention, as paratrain's default
    head = hf.get("head_dim")  # Mistral NeMo, Mistral Small 3: wider than hidden / heads
    out["head_size"] = head if head and head * out["n_heads"] != out["d_model"] else None
    out["norm_eps"] = float(out["norm_eps"])
    out.update({"qkv_bias": False, "qk_norm": False, **QWEN.get(hf.get("model_type"), {}),
                **_moe_fields(hf, where)})
    return out


# ModelConfig field -> what config.json calls it (the fields hf_model_fields decides)
CONFIG_KEYS = {**{name: key for name, (key, _) in FIELDS.items()}, "head_size": "head_dim",
               **{name: f"rope {key}" for name, key in LLAMA3_ROPE.items()},
               **{name: key for name, (key, _) in MOE_FIELDS.items()},
               "qkv_bias": "model_type", "qk_norm": "model_type", "moe_renorm":
               "norm_topk_prob", "shared_experts": "shared_expert_intermediate_size",
               "shared_gate": "model_type"}


def _said(name: str, v: object) -> str:
    flag = flag_for(name)
    return f"{flag} {v}" if flag else f"[model] {name} = {v!r} in the TOML"


def _contradiction(given: dict, hf: dict, raw: dict, where: str) -> None:
    """A model setting given by flag or TOML that config.json decides otherwise."""
    for name, v in given.items():
        if name in RUN_FIELDS or name not in hf:
            continue
        want = hf[name]
        if name in SAME_AS:  # None and n_heads both mean multi-head attention, ...
            v, want = v or hf[SAME_AS[name]], want or hf[SAME_AS[name]]
        if v == want:
            continue
        if name == "experts" and not want:
            raise ValueError(f"{_said(name, v)} contradicts {where}: its model is dense; "
                             "--init-from sets the model: drop it")
        key = CONFIG_KEYS[name]
        if key not in raw and OTHER_KEYS.get(key) in raw:
            key = OTHER_KEYS[key]
        raise ValueError(f"{_said(name, v)} contradicts {key}={raw.get(key, want)} in "
                         f"{where}; --init-from sets the model: drop it")


def _tokenizer(hf_dir: Path, tcfg: TrainConfig, given: str | None) -> TrainConfig:
    """The folder's ``tokenizer.json`` when present (an explicit other --tokenizer is a
    contradiction); otherwise --tokenizer decides."""
    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        return tcfg
    spec = str(path.resolve())
    if given is not None and (not Path(given).is_file() or Path(given).resolve() != path.resolve()):
        raise ValueError(f"--tokenizer {given} contradicts {path}, the tokenizer of "
                         "--init-from; drop --tokenizer (the folder's is used)")
    return dataclasses.replace(tcfg, tokenizer=spec)


def settle(hf_dir: str, mcfg: ModelConfig, tcfg: TrainConfig, config: str | None,
           flags: dict) -> tuple[ModelConfig, TrainConfig]:
    """The run's (ModelConfig, TrainConfig) under ``--init-from hf_dir``: the model from
    ``config.json`` with the run's context and attention kernel, the folder's tokenizer.
    ``mcfg``: the [model] TOML table's (built without the model flags: a flag such as
    --kv-heads is checked against config.json, not against the defaults' heads);
    ``flags``: {table: {field: value}} given on the command line. Everything set
    explicitly is checked against config.json."""
    raw = read_config(hf_dir)
    weight_files(hf_dir)
    where = str(Path(hf_dir) / "config.json")
    tables = load_toml(config) if config else {}
    given = {**tables.get("model", {}), **flags.get("model", {})}
    hf = hf_model_fields(raw, where)
    _contradiction(given, hf, raw, where)
    limits = context_limits(raw)
    context = given.get("context", min(DEFAULT_CONTEXT, *limits.values()))
    for key, n in limits.items():
        if context > n:
            raise ValueError(f"--context {context} exceeds {key}={n} in {where}"
                             + (": paratrain's attention sees the whole context, Mistral's "
                                "the window" if key == "sliding_window" else "")
                             + f"; pass --context {n} or less")
    own = {k: v for k, v in flags.get("model", {}).items() if k not in hf}
    try:
        out = mcfg.replace(**{**own, **hf, "context": context})
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    tok = flags.get("train", {}).get("tokenizer", tables.get("train", {}).get("tokenizer"))
    return out, _tokenizer(Path(hf_dir), tcfg, tok)


def weight_files(hf_dir: str | Path) -> list[Path]:
    """``model.safetensors``, or the shards ``model.safetensors.index.json`` lists (no
    torch: the launcher checks them before any worker starts)."""
    d = Path(hf_dir)
    index = d / "model.safetensors.index.json"
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values())) \
            if index.is_file() else ["model.safetensors"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"{index} is not a safetensors index (no weight_map); save the "
                         "model again with save_pretrained") from None
    missing = [n for n in names if not (d / n).is_file()]
    if missing:
        raise ValueError(f"--init-from {str(hf_dir)!r} has no {missing[0]}; save the model "
                         "with save_pretrained (safetensors) or paratrain export")
    return [d / n for n in names]


def _files_of(hf_dir: Path) -> dict[str, Path]:
    """transformers name -> the safetensors file holding it."""
    from safetensors import safe_open

    out = {}
    for f in weight_files(hf_dir):
        with safe_open(str(f), "pt") as h:
            out.update(dict.fromkeys(h.keys(), f))
    return out


def load_into(model, hf_dir: str | Path) -> None:
    """Copy the folder's weights into the plain Decoder ``model`` (its config is the
    folder's, :func:`settle`) one tensor at a time, file by file, so that the peak is the
    model and one tensor (float32, whatever the file's dtype); a fused tensor (Phi-3's
    qkv_proj, gate_up_proj: ``hf_arch.FUSED``) is cut into its parts by rows. A missing
    tensor, or one of another shape, is named, not a traceback."""
    from safetensors import safe_open

    from paratrain.files.hf_arch import folder_names, halves_to_interleaved, rope_rows

    cfg, hf_dir = model.cfg, Path(hf_dir)
    files = _files_of(hf_dir)
    names = folder_names(cfg, read_config(hf_dir).get("model_type"))
    missing = [theirs for theirs in names if theirs not in files]
    if missing:
        raise ValueError(f"the safetensors have no {missing[0]}; the folder does not hold "
                         "the model its config.json describes")
    params = model.state_dict()  # views of the parameters themselves
    for f in sorted(set(files.values())):
        with safe_open(str(f), "pt") as h:
            for theirs, parts in names.items():
                if files[theirs] != f:
                    continue
                w = h.get_tensor(theirs).float()
                want = (sum(params[p].shape[0] for p in parts), *params[parts[0]].shape[1:])
                if tuple(w.shape) != want:
                    raise ValueError(f"--init-from {str(hf_dir)!r}: {theirs} has shape "
                                     f"{tuple(w.shape)} but its config.json implies {want}; "
                                     "the weights do not match the config")
                for ours, piece in zip(parts, w.split([params[p].shape[0] for p in parts]),
                                       strict=True):
                    params[ours].copy_(halves_to_interleaved(piece, cfg.head_dim)
                                       if rope_rows(ours) else piece)
