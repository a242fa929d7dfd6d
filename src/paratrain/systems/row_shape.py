"""The model a runs-table row ran: its shape columns, or the catalogue model it names.

Empty shape columns are filled from ``data/models.toml`` and non-empty ones override it,
so a benchmark that ran a truncated model names the model and its layer count. Every
blank filled in is reported as a default (column, value, why); docs/runs.md.
"""

from __future__ import annotations

import dataclasses
import re

from paratrain.cost.catalogue import named_in
from paratrain.cost.shapes import ModelShape, load_model
from paratrain.systems.row_fields import Skip
from paratrain.systems.row_fields import num as _num
from paratrain.systems.row_words import mlp_said, tied_said

# the expert-parallel issue's column names -> ModelShape (ModelConfig) fields; moe_every:
# an MoE MLP in every k-th block (Llama 4 Maverick's 2, Switch's 2), 1 = every block
MOE_COLUMNS = {"experts": "experts", "top_k": "top_k", "moe_ffn_hidden": "moe_ffn",
               "shared_experts": "shared_experts", "moe_every": "moe_every",
               "mtp_layers": "mtp_layers"}
# multi-head latent attention (DeepSeek-V2/V3, arXiv:2405.04434): the ModelShape fields
# of the same names; q_lora_rank empty or 0 = a full-rank query projection (V2-Lite)
MLA_COLUMNS = ("q_lora_rank", "kv_lora_rank", "qk_nope_dim", "qk_rope_dim", "v_head_dim")
# local attention (ModelShape.attended_keys): the window in tokens, "sliding" (empty) or
# "chunked", and every k-th block attending globally (empty: none)
LOCAL_COLUMNS = ("local_window", "global_every")
# shape columns -> ModelShape fields
SHAPE_COLUMNS = {"layers": "n_layers", "hidden": "d_model", "heads": "n_heads",
                 "kv_heads": "n_kv_heads", "ffn_hidden": "d_ff", "vocab": "vocab_size",
                 "head_dim": "head_size"}


def _catalogue_model(row: dict, within: bool = True) -> ModelShape | None:
    """The catalogue model a row names: its ``model_key`` column if set (nothing else),
    else its ``model`` text (whole, then without a trailing parenthetical like "(NeMo)",
    then, ``within``, the longest catalogue name it contains as whole words: "Llama-3-8B
    trained with FSDP")."""
    key, text = (row.get("model_key") or "").strip(), (row.get("model") or "").strip()
    for name in ((key,) if key else (text, text.split("(")[0].strip())):
        if name:
            try:
                return load_model(name)
            except ValueError:
                continue
    named = None if key or not text or not within else named_in(text, "models.toml")
    return load_model(named) if named else None


def _moe_fields(row: dict, n_layers: int) -> dict:
    """The row's non-empty MoE, MLA and local-attention columns as ModelShape fields;
    ``moe_layers`` sets how many first blocks stay dense (with ``moe_every`` > 1: blocks
    k, 2k, ... are MoE and ``moe_layers`` must count them, :func:`_check_moe_layers`)."""
    out = {field: _num(row, col, int) for col, field in MOE_COLUMNS.items()}
    out |= {col: _num(row, col, int) for col in (*MLA_COLUMNS, *LOCAL_COLUMNS)}
    out = {k: v for k, v in out.items() if v is not None}
    kind = (row.get("local_kind") or "").strip().lower()
    if kind:
        out["local_kind"] = kind
    moe_layers = _num(row, "moe_layers", int)
    if moe_layers is not None and out.get("moe_every", 1) == 1:
        out["first_dense_layers"] = n_layers - moe_layers
    return out | expert_capacity(row.get("expert_capacity") or "")


def expert_capacity(text: str) -> dict:
    """The ``expert_capacity`` column as ModelShape fields: empty = dropless; "1.25" =
    tokens beyond 1.25 x an expert's mean load are dropped; "1.25 padded" = and every
    expert computes its whole capacity (``ModelShape.pad_to_capacity``)."""
    words = text.lower().split()
    if not words:
        return {}
    try:
        factor = float(words[0])
    except ValueError:
        factor = 0.0
    if factor <= 0 or words[1:] not in ([], ["padded"]):
        raise Skip(f"expert_capacity {text!r} is not a capacity; give a factor > 0, "
                   "optionally followed by 'padded' (e.g. '1.25 padded'), or leave it empty")
    return {"capacity_factor": factor, "pad_to_capacity": words[1:] == ["padded"]}


def _check_moe_layers(row: dict, m: ModelShape) -> ModelShape:
    """``moe_layers``, where given, is the model's count of MoE blocks."""
    want = _num(row, "moe_layers", int)
    if want is not None and m.is_moe and m.moe_layers != want:
        raise Skip(f"moe_layers {want} disagrees with the shape: {m.moe_layers} MoE blocks of "
                   f"{m.n_layers} with moe_every {m.moe_every} after {m.first_dense_layers} "
                   "dense ones; fix moe_layers or moe_every")
    return m


def _style(row: dict) -> dict:
    """The ``mlp`` (swiglu/gelu: three or two matrices) and ``tied`` (yes/no) columns."""
    out: dict = {}
    mlp, tied = mlp_said(row.get("mlp")), tied_said(row.get("tied"))
    if mlp:
        out["mlp"] = mlp
    if tied is not None:
        out["tie_embeddings"] = tied
    return out


def row_shape(row: dict, seq: int, defaults: list | None = None) -> ModelShape:
    """The model a row ran: its shape columns, or the catalogue model it names with the
    non-empty shape and MoE columns applied on top. Raises Skip with the reason. Each
    blank filled in is appended to ``defaults`` as (column, value, why)."""
    rid, out = row.get("id", "?"), [] if defaults is None else defaults
    L, h, heads = _num(row, "layers", int), _num(row, "hidden", int), _num(row, "heads", int)
    base = _catalogue_model(row) if (row.get("model_key") or "").strip() or not (
        L and h and heads) else None
    if (row.get("model_key") or "").strip() and base is None:
        raise Skip(f"model_key {row['model_key']!r} is not in the model catalogue "
                   "(data/models.toml); use a catalogue name or fill the shape columns")
    try:
        if base is not None:
            by_words = not (row.get("model_key") or "").strip()
            try:
                shape = _over_catalogue(row, base, seq, out)
            except (ValueError, TypeError):
                if by_words:  # the columns contradict a model the words only seem to name
                    _check_size(row, base, base)
                raise
            if by_words:
                _check_size(row, base, shape)
            return _check_moe_layers(row, shape)
        if not (L and h and heads):
            raise Skip(f"model shape incomplete (layers, hidden, heads) and model "
                       f"{row.get('model') or rid!r} is not in the model catalogue; fill the "
                       "shape columns or set model_key")
        ffn, kv = _num(row, "ffn_hidden", int), _num(row, "kv_heads", int)
        said = _style(row)
        gated = said.get("mlp", "gelu" if not ffn or ffn == 4 * h else "swiglu")
        style = {"mlp": gated, "tie_embeddings": "palm" in (row.get("model") or "").lower(),
                 **said}
        width = (("ffn_hidden", 4 * h, "blank: 4 x hidden, GPT's MLP") if gated == "gelu"
                 else ("ffn_hidden", _llama_ffn(h), "blank with a gated MLP: LLaMA's 2/3 of "
                       "4 x hidden, up to a multiple of 256"))
        blank = [("vocab", 51200, "blank: GPT-2's, padded as Megatron-LM pads it")
                 if not _num(row, "vocab", int) else None,
                 ("kv_heads", heads, "blank: multi-head attention") if not kv else None,
                 ("head_dim", h // heads, "blank: hidden / heads")
                 if not _num(row, "head_dim", int) else None]
        blank += [(col, style[f], why) for col, f, why in _STYLE_DEFAULTS
                  if not (row.get(col) or "").strip()]
        shape = ModelShape(
            name=row.get("model") or rid, n_layers=L, d_model=h, n_heads=heads,
            n_kv_heads=kv if kv and kv != heads else None, d_ff=ffn or width[1],
            vocab_size=_num(row, "vocab", int) or 51200, context=seq,
            head_size=_num(row, "head_dim", int), **style, **_moe_fields(row, L))
        if not ffn:
            shape, width = _ffn_from_count(shape, _num(row, "params_B"), width)
            out.append(width)
        out.extend(d for d in blank if d)
        return _check_moe_layers(row, shape)
    except (ValueError, TypeError) as e:
        raise Skip(f"model shape invalid: {e}") from None


# a size the model text states: "16B", "1.5B", "124M"; not "A3B" (an active count) nor
# "8x7B" (an expert count times a size), which a letter precedes
_SIZE = re.compile(r"(?<![a-z0-9.])(\d+(?:\.\d+)?)\s*([bm])(?![a-z0-9])", re.I)
# how far a stated size may sit from the named model's count and still name it: Gemma's
# "2B" is 2.5B with its embeddings, a truncated benchmark model keeps its full name
SIZE_SLACK = 1.5


def sizes_said(row: dict) -> list[float]:
    """The parameter counts (billions) a row states: its ``params_B`` and the sizes in
    its model text ("DeepSeek-V3 16B" -> [16.0])."""
    said = [float(n) * (1e-3 if unit.lower() == "m" else 1.0)
            for n, unit in _SIZE.findall(row.get("model") or "")]
    params_b = _num(row, "params_B")
    return said + ([params_b] if params_b else [])


def _check_size(row: dict, base: ModelShape, shape: ModelShape) -> None:
    """Refuse a row whose model text found a catalogue model every size the row states
    contradicts (torchtitan's "DeepSeek-V3 16B" is not the 671B model its words name):
    each stated size must be within :data:`SIZE_SLACK` of the model's total or active
    count, as catalogued or as the row's shape columns leave it."""
    counts = [m.num_params() / 1e9 for m in (base, shape)]
    counts += [m.active_params() / 1e9 for m in (base, shape)]
    sizes = sizes_said(row)
    if not sizes or any(c / SIZE_SLACK <= s <= c * SIZE_SLACK for s in sizes
                        for c in counts):
        return
    total, active = counts[0], counts[2]
    count = f"{total:,.1f}B" + (f", {active:,.1f}B active" if active < total else "")
    raise Skip(f"model {row.get('model')!r} reads as catalogue model {base.name} ({count}), "
               f"which its stated size ({', '.join(f'{s:g}B' for s in sizes)}) "
               "contradicts; set model_key to the catalogue model it ran, or fill the "
               "shape columns (layers, hidden, heads, ...)")


def _ffn_from_count(shape: ModelShape, params_b: float | None, said: tuple
                    ) -> tuple[ModelShape, tuple]:
    """A dense shape whose MLP width the row leaves blank but whose parameter count
    (``params_B``) it gives: the width that count implies (the count is linear in it),
    to a multiple of 128, where the default's count is more than 3% off and the implied
    width is a plausible one (1 to 8 x hidden); else the default, as it was."""
    if not params_b or shape.is_moe:
        return shape, said
    want, h = params_b * 1e9, shape.d_model
    a = shape.num_params()
    b = dataclasses.replace(shape, d_ff=shape.d_ff + 128).num_params()
    if abs(a / want - 1) <= 0.03 or b == a:
        return shape, said
    width = shape.d_ff + 128 * round((want - a) / (b - a))
    if not h <= width <= 8 * h:
        return shape, said
    return dataclasses.replace(shape, d_ff=width), (
        "ffn_hidden", width, f"blank: the width its params_B ({params_b:g}B) gives with "
                             f"this shape and {shape.mlp} MLP ({said[1]} would give "
                             f"{a / 1e9:,.1f}B)")


def _llama_ffn(h: int) -> int:
    """A gated MLP's width when a row gives none: LLaMA's 2/3 of GPT's 4 x hidden (three
    matrices holding GPT's two matrices' parameters), rounded up to a multiple of 256
    (Touvron et al. 2023: 4,096 -> 11,008, 5,120 -> 13,824, 8,192 -> 22,016)."""
    return 256 * -(-(8 * h // 3) // 256)


# style columns left blank on a shape-column row -> (column, ModelShape field, why)
_STYLE_DEFAULTS = (
    ("mlp", "mlp", "blank: gelu where ffn_hidden is blank or 4 x hidden, else swiglu"),
    ("tied", "tie_embeddings", "blank: tied for PaLM (its model text), else not"))


def _over_catalogue(row: dict, base: ModelShape, seq: int, out: list) -> ModelShape:
    """The catalogue model with the row's non-empty shape, style and MoE columns on top."""
    over = {f: _num(row, c, int) for c, f in SHAPE_COLUMNS.items()}
    over = {k: v for k, v in over.items() if v}
    over.update(_style(row))
    n_layers = over.get("n_layers", base.n_layers)
    over.update(_moe_fields(row, n_layers))
    if "first_dense_layers" not in over and base.is_moe:
        over["first_dense_layers"] = min(base.first_dense_layers, n_layers - 1)
    blank = [c for c, f in SHAPE_COLUMNS.items() if f not in over]
    if blank:
        out.append(("shape", base.name, f"blank {', '.join(blank)}: the catalogue model's "
                                        "(data/models.toml)"))
    if base.mtp_layers and "mtp_layers" not in over:
        out.append(("mtp_layers", base.mtp_layers, "blank: the catalogue model's "
                    "multi-token-prediction depths, trained as its recipe trains them"))
    return dataclasses.replace(base, context=seq, **over)
